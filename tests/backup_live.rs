//! Backups taken from a running daemon while it ingests a sizeable layer and delivers to a
//! slow webhook receiver: `POST /v1/backup` and `zonewatch backup DEST`, repeatedly, mid-flight.
//! Every copy must be a sound redb file of this schema version, logically whole (outbox rows
//! claimed and audited, no orphan index entries or leases, watermark naming a committed run
//! whose parcel count is the snapshot's), hold exactly one published version's snapshot and a
//! prefix of the live audit ledger — and restore into a fresh store. The live store must not
//! notice: delivery completes, each event reaches the receiver exactly once.

mod common;
use common::*;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zonewatch::receiver::{Receiver, Reply};
use zonewatch::store::Store;
use zonewatch::synth::{generate_county, rezone, to_geojson, CountySpec, SynthParcel};

const PARCELS: usize = 30_000;
const REZONED_V2: usize = 120;
const REZONED_V3: usize = 120;
const RECEIVER_DELAY: Duration = Duration::from_millis(200);

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().no_proxy().timeout(Duration::from_secs(120)).build().expect("client")
}

/// One published version: its file bytes' digest and each parcel's zoning.
struct Version {
    digest: String,
    zoning: HashMap<String, String>,
}

fn publish(ws: &Workspace, parcels: &[SynthParcel]) -> Version {
    let text = to_geojson(parcels, "2024-01-01");
    ws.write_layer(&text);
    Version {
        digest: zonewatch::ingest::source::digest(text.as_bytes()),
        zoning: parcels.iter().map(|p| (p.id.clone(), p.zoning.clone())).collect(),
    }
}

/// What one backup was taken during.
struct Copy {
    path: PathBuf,
    via: &'static str,
    ingest_running: bool,
    delivered_before: usize,
    delivered_after: usize,
}

fn api_backup(c: &reqwest::blocking::Client, d: &Daemon, name: &str) -> PathBuf {
    let r = c
        .post(d.url("/v1/backup"))
        .header("authorization", format!("Bearer {}", d.token))
        .header("content-type", "application/json")
        .body(format!("{{\"name\": \"{name}\"}}"))
        .send()
        .expect("backup request");
    assert_eq!(r.status(), 201, "POST /v1/backup");
    let v: Value = r.json().expect("backup answer");
    PathBuf::from(v["path"].as_str().expect("path"))
}

fn cli_backup(ws: &Workspace, dest: &Path) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["backup", dest.to_str().expect("utf-8"), "--config", ws.config_path().to_str().expect("utf-8")])
        .output()
        .expect("backup runs");
    assert!(o.status.success(), "zonewatch backup: {}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("taken by the running daemon"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// Unique `webhook-id`s at the receiver, and how many requests carried each.
fn ids(rx: &Receiver) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in rx.received() {
        *m.entry(r.header("webhook-id").unwrap_or("").to_string()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backups_taken_during_ingest_and_delivery_are_whole_and_restore() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, delay: RECEIVER_DELAY, ..Default::default() }), None)
        .await
        .expect("receiver");
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: rect(-71.6, 42.1, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw") }],
        "",
        "every = \"1h\"",
    );
    let spec = CountySpec { seed: 21, parcels: PARCELS, origin: [-71.5, 42.2], blocks_per_row: 12 };
    let mut parcels = generate_county(&spec);
    let v1 = publish(&ws, &parcels);
    let d = tokio::task::block_in_place(|| Daemon::start(&ws));
    let c = client();
    let auth = format!("Bearer {}", d.token);

    let (copies, v2, v3) = tokio::task::block_in_place(|| {
        // Baseline (the daemon's first scheduled run).
        let start = Instant::now();
        loop {
            let s: Value = c.get(d.url("/v1/sources")).header("authorization", &auth).send().expect("sources").json().expect("json");
            if s["items"][0]["last_verdict"] == "baseline" {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(120), "no baseline: {s}");
            std::thread::sleep(Duration::from_millis(100));
        }
        // v2: rezonings → deliveries to the slow receiver start.
        rezone(&mut parcels, 2, REZONED_V2);
        let v2 = publish(&ws, &parcels);
        let r: Value = c.post(d.url("/v1/sources/s1/run")).header("authorization", &auth).send().expect("run v2").json().expect("json");
        assert_eq!(r["run"]["verdict"], "run", "{r}");
        assert_eq!(r["run"]["queued"].as_u64(), Some(REZONED_V2 as u64), "{r}");

        // v3 ingest in the background while v2 is still being delivered; back up throughout.
        rezone(&mut parcels, 3, REZONED_V3);
        let v3 = publish(&ws, &parcels);
        let (c2, url, auth2) = (client(), d.url("/v1/sources/s1/run"), auth.clone());
        let ingest = std::thread::spawn(move || -> Value { c2.post(url).header("authorization", auth2).send().expect("run v3").json().expect("json") });
        let mut copies = Vec::new();
        let mut n = 0;
        let total = REZONED_V2 + REZONED_V3;
        while copies.len() < 6 || (!ingest.is_finished() && copies.len() < 40) {
            n += 1;
            let running = !ingest.is_finished();
            let before = ids(&rx).len();
            let (path, via) = if n % 2 == 1 {
                (api_backup(&c, &d, &format!("live-{n}.redb")), "api")
            } else {
                let dest = ws.path().join(format!("cli-{n}.redb"));
                cli_backup(&ws, &dest);
                (dest, "cli")
            };
            copies.push(Copy { path, via, ingest_running: running, delivered_before: before, delivered_after: ids(&rx).len() });
            if ids(&rx).len() >= total {
                break;
            }
        }
        let r = ingest.join().expect("ingest thread");
        assert_eq!(r["run"]["verdict"], "run", "{r}");
        (copies, v2, v3)
    });

    // The backups really were taken mid-flight.
    assert!(copies.iter().any(|c| c.ingest_running), "no backup overlapped the v3 ingest");
    assert!(
        copies.iter().any(|c| c.delivered_before > 0 && c.delivered_after < REZONED_V2 + REZONED_V3),
        "no backup overlapped delivery: {:?}",
        copies.iter().map(|c| (c.delivered_before, c.delivered_after)).collect::<Vec<_>>()
    );
    assert!(copies.iter().any(|c| c.via == "cli") && copies.iter().any(|c| c.via == "api"));

    // The live daemon was not disturbed: every event arrives, each exactly once.
    let total = REZONED_V2 + REZONED_V3;
    tokio::task::block_in_place(|| {
        let start = Instant::now();
        while ids(&rx).len() < total {
            assert!(start.elapsed() < Duration::from_secs(120), "only {} of {total} delivered", ids(&rx).len());
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(RECEIVER_DELAY * 3); // no straggler resend
    });
    let log = tokio::task::block_in_place(|| d.stop());
    assert!(log.contains("stopped cleanly"), "{log}");
    let seen = ids(&rx);
    assert_eq!(seen.len(), total);
    assert!(seen.values().all(|&n| n == 1), "a webhook-id arrived twice: {:?}", seen.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>());
    let live = ws.engine();
    assert_eq!(live.store.outbox_len().expect("outbox"), 0);
    assert_eq!(outcomes(&live).get("sent"), Some(&total));
    let report = live.store.check_consistency().expect("check");
    assert!(report.is_consistent(), "live store: {:?}", report.problems);
    let live_audit = live.store.audit(&Default::default()).expect("audit");
    let live_tables = live.store.table_names().expect("tables");
    drop(live);

    // Every copy: sound file, right schema, logically whole, one version's snapshot, a prefix
    // of the live ledger; restores into a fresh store that opens and checks out.
    let mut copies_with_pending = 0;
    let mut versions_seen = HashSet::new();
    for (i, copy) in copies.iter().enumerate() {
        let what = format!("copy {i} ({}, {})", copy.via, copy.path.display());
        zonewatch::store::backup::verify_file(&copy.path).unwrap_or_else(|e| panic!("{what}: {e}"));
        let r = zonewatch::store::check::check_file(&copy.path).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(r.is_consistent(), "{what}: {:?}", r.problems);
        assert_eq!(r.watermarks, 1, "{what}");
        // Leases live in the delivering process's memory, never in the file (or a copy).
        assert_eq!(r.leases, 0, "{what}: a lease in the file");

        // Restore into a fresh place: the library for API copies, the CLI for CLI copies.
        let fresh = Workspace::new(&[], "", "");
        if copy.via == "cli" {
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
                .args(["restore", copy.path.to_str().expect("utf-8"), "--config", fresh.config_path().to_str().expect("utf-8")])
                .output()
                .expect("restore runs");
            assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
        } else {
            zonewatch::store::backup::restore(&copy.path, &fresh.path().join("zw.redb")).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        let store = Store::open(&fresh.path().join("zw.redb")).unwrap_or_else(|e| panic!("{what}: restored store does not open: {e}"));
        assert_eq!(store.table_names().expect("tables"), live_tables, "{what}");
        assert_eq!(store.leased_len().expect("leases"), 0, "{what}: leases of the live process survive a restore");
        let r = store.check_consistency().expect("check");
        assert!(r.is_consistent(), "{what} restored: {:?}", r.problems);

        // The watermark describes exactly the snapshot the copy holds.
        let wm = store.watermark("s1").expect("watermark").unwrap_or_else(|| panic!("{what}: no watermark"));
        let run = store.runs(Some("s1"), 1000).expect("runs").into_iter().find(|r| r.run_id == wm.run_id).unwrap_or_else(|| panic!("{what}: no run {}", wm.run_id));
        let snapshot = store.snapshot_states("s1").expect("snapshot");
        assert_eq!(run.counts.parcels, snapshot.len() as u64, "{what}: run {} counted {} parcels, snapshot has {}", run.run_id, run.counts.parcels, snapshot.len());
        assert_eq!(run.digest, wm.digest, "{what}");
        let (name, version) = [("v1", &v1), ("v2", &v2), ("v3", &v3)]
            .into_iter()
            .find(|(_, v)| v.digest == wm.digest)
            .unwrap_or_else(|| panic!("{what}: the watermark's digest is none of the published versions"));
        let zoning: HashMap<String, String> = snapshot.iter().map(|(id, s)| (id.clone(), s.zoning.clone())).collect();
        assert!(zoning == version.zoning, "{what}: the snapshot is not exactly the {name} layer its watermark names");
        versions_seen.insert(name);

        // The copy's ledger is a prefix of the live one (append-only, nothing lost or reordered).
        let audit = store.audit(&Default::default()).expect("audit");
        assert!(audit.len() <= live_audit.len(), "{what}");
        assert_eq!(audit[..], live_audit[..audit.len()], "{what}: audit is not a prefix of the live ledger");
        // Queued-but-not-yet-sent in the copy = its outbox.
        let sent: HashSet<_> = audit.iter().filter(|a| a.outcome.as_str() == "sent").filter_map(|a| a.idempotency_key.clone()).collect();
        let queued: HashSet<_> = audit.iter().filter(|a| a.outcome.as_str() == "queued").filter_map(|a| a.idempotency_key.clone()).collect();
        let outbox: HashSet<_> = store.outbox().expect("outbox").into_iter().map(|e| e.key.0).collect();
        assert_eq!(outbox, queued.difference(&sent).cloned().collect::<HashSet<_>>(), "{what}: outbox ≠ queued − sent");
        copies_with_pending += usize::from(!outbox.is_empty());
    }
    assert!(copies_with_pending > 0, "no copy caught deliveries still queued");
    eprintln!(
        "backup_live: {} copies, {} with deliveries still queued, {} during the v3 ingest, {} distinct watermarks",
        copies.len(),
        copies_with_pending,
        copies.iter().filter(|c| c.ingest_running).count(),
        versions_seen.len()
    );
}

#[test]
fn a_backup_through_the_daemon_leaves_no_copy_behind_unless_copying_it_failed() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&grid(20)));
    let d = Daemon::start(&ws);
    let backups = ws.path().join("backups");
    let in_backups = || -> Vec<PathBuf> {
        std::fs::read_dir(&backups).map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default()
    };
    let dest = ws.path().join("copy.redb");
    cli_backup(&ws, &dest);
    zonewatch::store::backup::verify_file(&dest).expect("the copy verifies");
    assert_eq!(in_backups(), Vec::<PathBuf>::new(), "the daemon's copy is removed once the copy at DEST is verified");

    // DEST cannot be written: the daemon's copy is the only one, so it stays, and is named.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["backup", ws.path().join("no-such-folder/copy.redb").to_str().expect("utf-8"), "--config", ws.config_path().to_str().expect("utf-8")])
        .output()
        .expect("backup runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "a folder that does not exist stays so on a retry: {err}");
    assert!(err.contains("no-such-folder"), "{err}");
    let kept = in_backups();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(err.contains(&format!("kept at {}", kept[0].display())), "{err}");
    // Renamed out of the hand-off name, so the daemon's sweep of leftovers keeps it.
    let name = kept[0].file_name().expect("a file").to_string_lossy().into_owned();
    assert!(name.starts_with("zonewatch-") && !name.starts_with(zonewatch::store::backup::HANDOFF_PREFIX), "{name}");
    assert_eq!(zonewatch::store::backup::sweep_leftovers(&backups, std::time::SystemTime::now() + zonewatch::store::backup::LEFTOVER_AGE * 2), 0);
    zonewatch::store::backup::verify_file(&kept[0]).expect("the kept copy verifies");
    d.stop();
}

/// The README's bare-binary set-up: `serve --config zonewatch.toml` started in its folder,
/// `backup` run from elsewhere with the config's full path. The daemon's relative store path is
/// not the client's: the backup still lands at DEST and leaves no copy behind.
#[test]
fn a_backup_through_a_daemon_started_with_a_relative_config_works_from_anywhere() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&grid(20)));
    let d = Daemon::start_in_its_folder(&ws);
    let dest = ws.path().join("copy.redb");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .current_dir(elsewhere.path())
        .args(["backup", dest.to_str().expect("utf-8"), "--config", ws.config_path().to_str().expect("utf-8")])
        .output()
        .expect("backup runs");
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("taken by the running daemon") && out.contains("removed"), "{out}");
    zonewatch::store::backup::verify_file(&dest).expect("the copy verifies");
    let left: Vec<_> = std::fs::read_dir(ws.path().join("backups")).map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    assert!(left.is_empty(), "the daemon's copy is left: {left:?}");
    d.stop();
}
