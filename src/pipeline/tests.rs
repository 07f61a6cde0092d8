//! Unit tests of the pipeline.

use super::*;
use crate::detect::spill::Spill;
use crate::detect::spill::SpilledParcel;
use crate::detect::stream::ScanResult;
use crate::ingest::normalize::NormalizeRules;
use crate::notify::matcher::Subscriber;
use crate::store::CommitMode;
use super::commit::COMMIT_CHUNK;
use super::run::scan_digested;
use geo::polygon;
use std::collections::HashMap;

/// An engine over a store in `dir` with one file source, `s1`.
fn test_engine(dir: &std::path::Path) -> Engine {
    let toml = r#"
[store]
path = "zw.redb"
[[source]]
id = "s1"
jurisdiction = "testville"
kind = "file"
path = "layer.geojson"
[source.fields]
parcel_id = "APN"
zoning = "ZONE_CODE"
"#;
    Engine::open(Config::parse_str(toml, dir).unwrap()).unwrap()
}

/// A layer read that fails on its own while a stop is asked meanwhile is that failure,
/// not a stop (found by a reviewer: a store or disk error was logged as "stopped"); one
/// the reader refused because of the stop is a stop, also when the refusal comes from the
/// read past the last feature.
#[test]
fn a_scan_is_told_stopped_by_the_readers_refusal_not_by_the_flag() {
    struct FailsAndStops<'a>(&'a crate::run_stop::RunStop);
    impl std::io::Read for FailsAndStops<'_> {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            self.0.request();
            Err(std::io::Error::other("disk on fire"))
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let engine = test_engine(dir.path());
    let view = engine.store.snapshot_view("s1").unwrap();
    let src = engine.config.source("s1").unwrap().clone();
    let rules = NormalizeRules { fields: &src.fields, bbox: None };
    let stop = crate::run_stop::RunStop::default();
    let scan = |r: &mut (dyn std::io::Read + Send), stop: &crate::run_stop::RunStop| scan_digested(r, dir.path(), &rules, &view, false, dir.path(), 1, None, stop).err().unwrap();
    let err = scan(&mut FailsAndStops(&stop), &stop);
    assert!(!err.is_stopped() && err.to_string().contains("disk on fire"), "{err}");

    // Every feature read, then the stop: the read to the end of the bytes is refused.
    struct StopsAtTheEnd<'a>(&'a [u8], &'a crate::run_stop::RunStop);
    impl std::io::Read for StopsAtTheEnd<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(buf)?;
            if n == 0 {
                self.1.request();
            }
            Ok(n)
        }
    }
    let stop = crate::run_stop::RunStop::default();
    let layer = br#"{"type":"FeatureCollection","features":[]}"#;
    let err = scan(&mut StopsAtTheEnd(layer, &stop), &stop);
    assert!(err.is_stopped(), "{err}");
}

/// A scan that failed (a broken feature that swallows the next ones fails the layer in a
/// worker) stops reading the layer: one that never ends is not read to its end first.
#[test]
fn a_failed_scan_stops_reading_the_layer() {
    struct Endless {
        head: std::io::Cursor<Vec<u8>>,
        feature: Vec<u8>,
        at: usize,
    }
    impl std::io::Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.head.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            let n = buf.len().min(self.feature.len() - self.at);
            buf[..n].copy_from_slice(&self.feature[self.at..self.at + n]);
            self.at = (self.at + n) % self.feature.len();
            Ok(n)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let engine = test_engine(dir.path());
    let view = engine.store.snapshot_view("s1").unwrap();
    let src = engine.config.source("s1").unwrap().clone();
    let rules = NormalizeRules { fields: &src.fields, bbox: None };
    let feature = r#"{"type":"Feature","properties":{"APN":"A","ZONE_CODE":"R-1"},"geometry":{"type":"Polygon","coordinates":[[[-71.1,42.36],[-71.099,42.36],[-71.099,42.361],[-71.1,42.36]]]}}"#;
    let head = format!(r#"{{"type":"FeatureCollection","features":[{{"type":"Feature","properties":{{"NOTE":{{"b":1]}}}},{feature}}},{feature}"#);
    let reader = Endless { head: std::io::Cursor::new(head.into_bytes()), feature: format!(",{feature}").into_bytes(), at: 0 };
    let err = scan_digested(reader, dir.path(), &rules, &view, false, dir.path(), 2, None, &Default::default()).err().unwrap();
    assert!(err.to_string().contains("holds more than one \"Feature\""), "{err}");
}

/// What `scan_layer` would hand the commit for a first ingest whose delta is `spill`.
fn baseline_scan(spill: Spill, duplicate_ids: std::collections::HashSet<String>) -> ScanResult {
    let parcels = spill.parcels;
    ScanResult {
        spill: spill.finish().unwrap(),
        features: parcels,
        parcels,
        repaired: 0,
        quarantined: 0,
        systemic: 0,
        unreadable_known: 0,
        changes: parcels,
        warnings: vec![],
        duplicate_ids,
        duplicate_drafts: vec![],
        removed: vec![],
        previous_parcels: 0,
    }
}

/// Opening an engine sweeps the staging temp files killed runs left — also those of a
/// source no longer configured — and nothing else.
#[test]
fn opening_an_engine_sweeps_staging_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    drop(test_engine(dir.path()));
    let staging = crate::ingest::staging::staging_dir(&dir.path().join("zw.redb"));
    std::fs::create_dir_all(&staging).unwrap();
    for name in ["gone.geojson.a1B2c3.tmp", "s1.geojson", "s1.json"] {
        std::fs::write(staging.join(name), b"x").unwrap();
    }
    let _engine = test_engine(dir.path());
    assert!(!staging.join("gone.geojson.a1B2c3.tmp").exists());
    assert!(staging.join("s1.geojson").exists() && staging.join("s1.json").exists());
}

/// A spill that cannot be read back half-way through a commit (five chunks of parcels a
/// subscriber's AOI covers, so the writer has written their primed keys and audit rows,
/// then a damaged record): the preparing thread reports the error and stops, the commit
/// fails whole and leaves no parcel, watermark or audit row behind.
#[test]
fn a_spill_read_error_mid_commit_fails_the_run_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = test_engine(dir.path());
    let aoi = geo::MultiPolygon(vec![polygon![(x: -71.01, y: 41.99), (x: -70.99, y: 41.99), (x: -70.99, y: 42.01), (x: -71.01, y: 42.01)]]);
    let sub = Subscriber { id: "w1".into(), target: "http://127.0.0.1:9/hook".into(), secret: None, min_severity: Severity::Info, aoi, secret_old: None };
    engine.subscribers = Arc::new(SubscriberIndex::build(vec![sub]));
    let src = engine.config.sources[0].clone();
    let state = ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 100.0, revision: 0, announced: None };
    let geometry = StoredGeometry(vec![vec![vec![[-71.0, 42.0], [-70.999, 42.0], [-70.999, 42.001], [-71.0, 42.0]]]]);
    let parcels = 5 * COMMIT_CHUNK as u64;
    let scan = |damaged: bool| {
        let mut spill = Spill::create(dir.path()).unwrap();
        for i in 0..parcels {
            let p = SpilledParcel { feature_index: i, key_revision: 0, id: format!("p{i:06}"), state: state.clone(), geometry: geometry.clone(), kind: Some(ChangeKind::Added), from: None };
            spill.push_parcel(p).unwrap();
        }
        if damaged {
            spill.push_damaged_record().unwrap();
        }
        baseline_scan(spill, Default::default())
    };
    let watermark = Watermark { digest: "d".into(), size: 1, ..Default::default() };
    let err = engine.commit_scan(&src, scan(true), CommitMode::Baseline, watermark.clone(), 1, 2).unwrap_err();
    assert!(err.to_string().contains("unknown spill record version"), "{err}");
    assert_eq!(engine.store.watermark("s1").unwrap(), None);
    assert!(engine.store.snapshot_states("s1").unwrap().is_empty(), "no parcel of the failed commit");
    assert!(engine.store.audit(&Default::default()).unwrap().is_empty(), "no audit row of the failed commit");
    // The same spill undamaged commits every parcel with an audit row each (the primed
    // keys): what the failed commit had begun to write and did not keep.
    let record = engine.commit_scan(&src, scan(false), CommitMode::Baseline, watermark, 3, 4).unwrap();
    assert_eq!(record.verdict, Verdict::Baseline);
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len() as u64, parcels);
    let all = engine.store.audit(&Default::default()).unwrap();
    assert_eq!(all.len() as u64, parcels);

    // The ledger walked a page at a time, each way, is the ledger: what the control
    // port's pages read without collecting it.
    let walk = |filter: &crate::store::AuditFilter, desc: bool, before: Option<u64>, limit: usize| {
        let mut page = Vec::new();
        engine.store.audit_walk(filter, desc, before, |r| {
            page.push(r.seq);
            page.len() < limit
        }).unwrap();
        page
    };
    let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
    let (mut up, mut down) = (Vec::new(), Vec::new());
    loop {
        let page = walk(&crate::store::AuditFilter { since_seq: up.last().map(|s: &u64| s + 1), ..Default::default() }, false, None, 777);
        up.extend(&page);
        if page.len() < 777 {
            break;
        }
    }
    loop {
        let page = walk(&Default::default(), true, down.last().copied(), 777);
        down.extend(&page);
        if page.len() < 777 {
            break;
        }
    }
    down.reverse();
    assert_eq!((up.as_slice(), down.as_slice()), (seqs.as_slice(), seqs.as_slice()));
    let one = all[100].parcel_id.clone();
    let only = crate::store::AuditFilter { parcel: one.clone(), ..Default::default() };
    assert_eq!(walk(&only, true, None, 5).len(), 1, "a filter is applied as it walks");
}

/// A baseline's rows are copied off the spill, each beside its parcel: every parcel is
/// stored with its own state and geometry, in chunks in key order and out of it (sorted),
/// and the copies of a duplicated id, spread over the chunks, are skipped with their rows.
/// Events are built only for parcels near a subscriber: every new parcel still counts as
/// a change, and exactly the parcels an AOI touches are primed for it. Then a delivering
/// run mixing changed and new parcels queues exactly the events an AOI touches.
#[test]
fn rows_are_copied_off_the_spill_and_events_built_only_where_they_can_match() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = test_engine(dir.path());
    // A triangle over part of the layer: its envelope takes in more parcels than it
    // touches, so the exact test decides some.
    // A box over parcels of the shuffled second chunk as well.
    let subscriber = |id: &str, aoi| Subscriber { id: id.into(), target: "http://127.0.0.1:9/hook".into(), secret: None, min_severity: Severity::Info, aoi, secret_old: None };
    let triangle = geo::MultiPolygon(vec![polygon![(x: -70.95, y: 41.99), (x: -70.8, y: 41.99), (x: -70.95, y: 42.01)]]);
    let boxed = geo::MultiPolygon(vec![polygon![(x: -70.55, y: 41.99), (x: -70.5, y: 41.99), (x: -70.5, y: 42.01), (x: -70.55, y: 42.01)]]);
    engine.subscribers = Arc::new(SubscriberIndex::build(vec![subscriber("w1", triangle), subscriber("w2", boxed)]));
    let src = engine.config.sources[0].clone();
    let parcel = |i: u64, id: String| {
        let x = -71.0 + i as f64 * 1e-4;
        SpilledParcel {
            feature_index: i,
            id,
            // A few snapshot-only updates among them: stored, no event.
            kind: (i % 997 != 5).then_some(ChangeKind::Added),
            from: None,
            key_revision: 0,
            state: ParcelState { zoning: format!("Z{i}"), effective_date: i.is_multiple_of(3).then(|| format!("2026-01-{:02}", i % 28 + 1)), content_hash: [i as u8; 32], geom_hash: [2; 32], area_m2: i as f64, revision: 0, announced: None },
            geometry: StoredGeometry(vec![vec![vec![[x, 42.0], [x + 1e-5, 42.0], [x, 42.0 + (i % 7 + 1) as f64 * 1e-5], [x, 42.0]]]]),
        }
    };
    // Chunk one in key order, chunk two shuffled (sorted before it is written), a third
    // partly; "dup" three times, in the first two chunks and the last.
    let n = 3 * COMMIT_CHUNK as u64 - 100;
    let id_of = |i: u64| if i < COMMIT_CHUNK as u64 { format!("p{i:06}") } else { format!("p{:06}", (i * 7_919) % n + n) };
    let mut spill = Spill::create(dir.path()).unwrap();
    let mut want = HashMap::new();
    let mut updates = std::collections::HashSet::new();
    for i in 0..n {
        if [17, COMMIT_CHUNK as u64 + 5, n - 3].contains(&i) {
            spill.push_parcel(parcel(1_000_000 + i, "dup".into())).unwrap();
        }
        let p = parcel(i, id_of(i));
        if p.kind.is_none() {
            updates.insert(p.id.clone());
        }
        want.insert(p.id.clone(), (p.state.clone(), p.geometry.clone()));
        spill.push_parcel(p).unwrap();
    }
    let watermark = Watermark { digest: "d".into(), size: 1, ..Default::default() };
    let scan = baseline_scan(spill, ["dup".to_string()].into_iter().collect());
    let record = engine.commit_scan(&src, scan, CommitMode::Baseline, watermark, 1, 2).unwrap();
    let stored = engine.store.snapshot_parcels("s1").unwrap();
    assert_eq!(stored.len(), want.len(), "every parcel once, no duplicate");
    assert!(!updates.is_empty());
    assert_eq!(record.counts.changes, (want.len() - updates.len()) as u64, "every added parcel is a change, built or counted");
    let mut touched = 0;
    for (id, state, geometry) in stored {
        assert_eq!(want.get(&id), Some(&(state, geometry.clone())), "parcel {id}");
        let matched = engine.subscribers.matching(&[&geometry.to_geo()]).len();
        assert!(matched <= 1, "the AOIs do not overlap");
        // A snapshot-only update has no event to claim.
        touched += if updates.contains(&id) { 0 } else { matched };
    }
    assert!(touched > 200 && touched < want.len() / 2, "the AOIs touch some parcels ({touched})");
    assert_eq!(engine.store.audit(&Default::default()).unwrap().len(), touched, "one primed key per touched parcel");

    // A delivering run whose chunk mixes changed parcels (their events built by the
    // writer, after it reads their stored geometry) with new ones: rezoned parcels moved
    // out of an AOI (matched by their old shape), rezoned ones outside, new ones inside
    // and outside. Every event that touches an AOI by either shape is queued.
    let mut spill = Spill::create(dir.path()).unwrap();
    let mut queued = 0;
    for i in (600..620).chain(7_000..7_010) {
        let mut p = parcel(i, id_of(i));
        let (old, _) = want.get(&p.id).cloned().unwrap();
        if i < 700 {
            p.geometry.0[0][0].iter_mut().for_each(|c| c[0] += 1.0);
        }
        p.kind = Some(ChangeKind::Rezoned);
        p.from = Some(old.zoning);
        p.state.zoning = format!("R{i}");
        let (_, old_geometry) = want.get(&p.id).cloned().unwrap();
        queued += engine.subscribers.matching(&[&old_geometry.to_geo(), &p.geometry.to_geo()]).len();
        spill.push_parcel(p).unwrap();
    }
    for j in 0..40u64 {
        let i = if j % 2 == 0 { 4_600 + j } else { 12_000 + j };
        let p = parcel(i, format!("n{j:03}"));
        queued += engine.subscribers.matching(&[&p.geometry.to_geo()]).len();
        spill.push_parcel(SpilledParcel { kind: Some(ChangeKind::Added), ..p }).unwrap();
    }
    assert!(queued >= 30, "the AOIs touch the run's changes ({queued})");
    let watermark = Watermark { digest: "e".into(), size: 2, ..Default::default() };
    let record = engine.commit_scan(&src, baseline_scan(spill, Default::default()), CommitMode::Deliver, watermark, 3, 4).unwrap();
    assert_eq!(record.counts.changes, 70);
    assert_eq!(record.counts.queued, queued as u64);
}
