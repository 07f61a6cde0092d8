//! The publication gate: renamed fields and change spikes are held, never sent blindly;
//! holds are released or primed by an operator; a newer run supersedes an older hold.

mod common;
use common::*;
use std::time::Duration;
use zonewatch::model::{HoldState, Outcome, Verdict};
use zonewatch::pipeline::PipelineError;

fn with_zones(v: &[P], ids: &[usize], to: &str) -> Vec<P> {
    let mut out = v.to_vec();
    for &i in ids {
        out[i].zone = to.into();
    }
    out
}

/// A loopback receiver answering 200, a workspace whose one subscriber (`w`) watches the
/// whole test grid with `max_change_ratio` at `ratio`, and its engine.
async fn watched_grid(ratio: f64) -> (zonewatch::receiver::Receiver, Workspace, zonewatch::pipeline::Engine) {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "",
    );
    if ratio != 0.5 {
        ws.edit_config("max_change_ratio = 0.5", &format!("max_change_ratio = {ratio}"));
    }
    let engine = ws.engine();
    (rx, ws, engine)
}

/// A zoning field that came to hold long text (a publisher moved the description into it, or
/// the config maps a description column): every value past the 1,024-byte cap is quarantined
/// `field_too_long`, and, more than half the layer so, the run is held as for a missing
/// field; nothing is sent, every parcel keeps its stored state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zoning_field_of_long_text_is_held_not_alerted() {
    let (rx, ws, engine) = watched_grid(0.5).await;
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let text = "Residential district permitting one-family detached dwellings; ".repeat(20);
    let all: Vec<usize> = (0..100).collect();
    ws.write_layer(&layer(&with_zones(&v1, &all, &text)));
    let held = run(&engine, false);
    assert_eq!(held.record.verdict, Verdict::Held);
    let reason = held.hold_reason.clone().unwrap_or_default();
    assert!(reason.starts_with("quarantine_spike: 100 of 100") && reason.contains("field_too_long"), "{reason}");
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 100);
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty());
}

/// `parcel_id` mapped to a field that is not unique (a town's name, a zoning code) makes
/// nearly every feature a copy of another's id: the run is held as a quarantine spike, not
/// committed with every stored parcel missing (removed), and each copy's quarantine row
/// names a few copies and counts the rest (every row listed every copy: quadratic, a county's
/// layer so mapped ran out of memory; a reviewer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parcel_id_mapped_to_a_shared_field_is_held_not_alerted() {
    let (rx, ws, engine) = watched_grid(0.5).await;
    let v1 = grid(300);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let shared: Vec<P> = v1.iter().map(|p| P { id: p.zone.clone(), ..p.clone() }).collect();
    ws.write_layer(&layer(&shared));
    let held = run(&engine, false);
    assert_eq!(held.record.verdict, Verdict::Held);
    let reason = held.hold_reason.clone().unwrap_or_default();
    assert!(reason.starts_with("quarantine_spike: 300 of 300") && reason.contains("duplicate_id"), "{reason}");
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 300, "no parcel removed");
    let q = engine.store.quarantine().unwrap();
    assert_eq!(q.len(), 300);
    assert!(q.iter().all(|q| q.detail.ends_with("and 90 more)") && q.detail.contains("appears 100 times") && q.raw.len() < 200), "{:?}", q[0]);
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty());

    // A first ingest so mapped is held too (it was a baseline of three parcels, the copies
    // quarantined).
    let (_rx, first, engine) = watched_grid(0.5).await;
    first.write_layer(&layer(&shared));
    let held = run(&engine, false);
    assert_eq!(held.record.verdict, Verdict::Held);
    assert!(held.hold_reason.clone().unwrap_or_default().starts_with("quarantine_spike: 300 of 300"), "{:?}", held.hold_reason);
    assert!(engine.store.snapshot_states("s1").unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renamed_zoning_field_is_held_until_mapped() {
    let (rx, ws, engine) = watched_grid(0.5).await;
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let wm = engine.store.watermark("s1").unwrap().unwrap();

    // The county renames ZONE_CODE to ZONING and, in the same publication, rezones 3 parcels.
    let v2 = with_zones(&v1, &[0, 3, 6], "C3");
    ws.write_layer(&layer_with_field(&v2, "ZONING"));
    let held = run(&engine, false);
    assert_eq!(held.record.verdict, Verdict::Held);
    let reason = held.hold_reason.clone().unwrap();
    assert!(reason.starts_with("quarantine_spike"), "{reason}");
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap(), wm, "watermark unchanged");
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 100, "no parcel removed");
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty());
    let holds = engine.store.holds().unwrap();
    assert_eq!((holds.len(), &holds[0].state), (1, &HoldState::Open));

    // Re-reading the same bytes does not create a second hold.
    let still = run(&engine, false);
    assert_eq!((still.record.verdict, still.record.hold_id), (Verdict::Held, Some(holds[0].run_id)));
    assert_eq!(engine.store.holds().unwrap().len(), 1);

    // The operator maps the new field name; the next run sends only the real changes.
    ws.edit_config("zoning = \"ZONE_CODE\"", "zoning = \"ZONING\"");
    let engine = { drop(engine); ws.engine() };
    let fixed = run(&engine, false);
    assert_eq!((fixed.record.verdict, fixed.record.counts.changes, fixed.record.counts.queued), (Verdict::Run, 3, 3));
    deliver(&engine, Duration::from_secs(5)).await;
    let mut got: Vec<String> = rx.received().iter().filter_map(|r| r.json()?["data"]["parcel_id"].as_str().map(String::from)).collect();
    got.sort();
    assert_eq!(got, vec!["P0000", "P0003", "P0006"]);
    let old = engine.store.hold(holds[0].run_id).unwrap().unwrap();
    assert!(matches!(old.state, HoldState::Superseded { .. }), "{:?}", old.state);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_spike_is_held_then_released_and_superseded_holds_stay_closed() {
    let (rx, ws, engine) = watched_grid(0.05).await;
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);

    // Version A: 20 of 100 parcels rezoned → held.
    let a = with_zones(&v1, &(0..20).collect::<Vec<_>>(), "M-1");
    ws.write_layer(&layer(&a));
    let ra = run(&engine, false);
    assert_eq!(ra.record.verdict, Verdict::Held);
    assert!(ra.hold_reason.as_deref().unwrap().starts_with("change_spike"));
    let hold_a = ra.record.hold_id.unwrap();

    // Version B (also a spike) supersedes A.
    let b = with_zones(&v1, &(0..30).collect::<Vec<_>>(), "I-2");
    ws.write_layer(&layer(&b));
    let rb = run(&engine, false);
    let hold_b = rb.record.hold_id.unwrap();
    assert!(matches!(engine.store.hold(hold_a).unwrap().unwrap().state, HoldState::Superseded { by_run, .. } if by_run == rb.record.run_id));
    let open: Vec<u64> = engine.store.open_holds(None).unwrap().iter().map(|h| h.run_id).collect();
    assert_eq!(open, vec![hold_b], "the index of open holds names B alone");
    match engine.resolve_hold(hold_a, false) {
        Err(PipelineError::HoldNotOpen { id, state }) => assert_eq!((id, state.as_str()), (hold_a, "superseded")),
        other => panic!("releasing a superseded hold must fail, got {other:?}"),
    }
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty(), "held runs send nothing");

    // Releasing B delivers its 30 changes and advances the watermark to B.
    std::thread::sleep(Duration::from_millis(20));
    let released = engine.resolve_hold(hold_b, false).unwrap();
    assert_eq!((released.counts.changes, released.counts.queued), (30, 30));
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(rx.received().len(), 30);
    // The body's `timestamp` is the change's `observed_at`, the held run's time, not the
    // release's (a black-box tester: it was the release's).
    for r in rx.received() {
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["timestamp"], body["data"]["observed_at"], "{body}");
        assert!(body["timestamp"].as_str().unwrap() < zonewatch::util::rfc3339(released.finished_ms).as_str(), "{body}");
    }
    assert!(matches!(engine.store.hold(hold_b).unwrap().unwrap().state, HoldState::Released { .. }));
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap().digest, engine.store.hold(hold_b).unwrap().unwrap().digest);
    assert_eq!(run(&engine, false).record.verdict, Verdict::Identical);
    assert!(engine.resolve_hold(hold_b, false).is_err(), "a hold is resolved once");
    assert!(engine.store.open_holds(Some("s1")).unwrap().is_empty());
    assert!(engine.store.check_consistency().unwrap().is_consistent());

    // Past the retention, the superseded hold goes; the released one (an operator's decision)
    // stays.
    let day = 86_400_000;
    assert_eq!(engine.store.sweep_superseded_holds(engine.now() + day, 30 * day, 100).unwrap(), 0, "inside the retention");
    assert_eq!(engine.store.sweep_superseded_holds(engine.now() + 31 * day, 30 * day, 100).unwrap(), 1);
    assert!(engine.store.hold(hold_a).unwrap().is_none());
    assert!(matches!(engine.store.hold(hold_b).unwrap().unwrap().state, HoldState::Released { .. }));
    assert!(engine.store.check_consistency().unwrap().is_consistent());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primed_hold_is_accepted_silently() {
    let (rx, ws, engine) = watched_grid(0.05).await;
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let v2 = with_zones(&v1, &(0..50).collect::<Vec<_>>(), "C-9");
    ws.write_layer(&layer(&v2));
    let h = run(&engine, false).record.hold_id.unwrap();
    let primed = engine.resolve_hold(h, true).unwrap();
    assert_eq!((primed.counts.queued, primed.counts.suppressed), (0, 50));
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty());
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0001"].zoning, "C-9");
    assert_eq!(run(&engine, false).record.verdict, Verdict::Identical);
}

/// A source's first ingest held by the gate (most features outside its bbox: a wrong bbox or
/// a datum drift) is a baseline: releasing it stores the snapshot and primes the keys, and
/// sends nothing, as a baseline does. Its record's counts add up to what the held run read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_held_first_ingest_sends_nothing() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: rect(-72.0, 42.0, -68.0, 43.0), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "",
    );
    let engine = ws.engine();
    let mut v1 = grid(100);
    for p in v1.iter_mut().take(60) {
        for c in &mut p.ring {
            c[0] += 2.0; // east of the source's bbox [-72, 42, -70, 43]
        }
    }
    ws.write_layer(&layer(&v1));
    let held = run(&engine, false);
    assert_eq!(held.record.verdict, Verdict::Held, "{}", held.line());
    assert!(held.hold_reason.clone().unwrap_or_default().starts_with("quarantine_spike"), "{:?}", held.hold_reason);
    let released = engine.resolve_hold(held.record.hold_id.unwrap(), false).unwrap();
    assert_eq!(released.counts.queued, 0, "{:?}", released.counts);
    // Its record is the source's baseline (not a reprocess, whose changes the metrics count),
    // and so are its primed keys' audit rows (not listed as recent changes).
    assert_eq!(released.verdict, Verdict::Baseline);
    let primed: Vec<String> =
        engine.store.audit(&Default::default()).unwrap().into_iter().filter(|r| r.outcome == Outcome::Suppressed).map(|r| r.detail).collect();
    assert!(released.counts.suppressed > 0 && primed.len() as u64 == released.counts.suppressed, "{primed:?}");
    assert!(primed.iter().all(|d| d == "baseline"), "{primed:?}");
    assert!(released.warnings.iter().any(|w| w.contains("first ingest")), "{:?}", released.warnings);
    let c = &released.counts;
    assert_eq!((c.features, c.parcels, c.quarantined), (100, 40, 60));
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty(), "a baseline sends nothing");
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 40);
    assert!(engine.store.watermark("s1").unwrap().is_some());

    // A later version of the established source, still quarantine-spiked (60 of 100 out of
    // bbox) and so held again, released, does send (and counts add up).
    let mut v2 = v1.clone();
    for p in v2.iter_mut().skip(60).take(10) {
        p.zone = "C-9".into();
    }
    ws.write_layer(&layer(&v2));
    let spike = run(&engine, false);
    assert_eq!(spike.record.verdict, Verdict::Held, "{}", spike.line());
    let sent = engine.resolve_hold(spike.record.hold_id.unwrap(), false).unwrap();
    assert_eq!((sent.verdict, sent.counts.queued), (Verdict::Run, 10), "{:?}", sent.counts);
    assert!(!sent.warnings.iter().any(|w| w.contains("first ingest")), "{:?}", sent.warnings);
    assert_eq!(sent.counts.features, sent.counts.parcels + sent.counts.quarantined);
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(rx.received().len(), 10);
}

/// A release that read its hold as open while a newer run of the source superseded it is
/// refused inside its own transaction: committing it would set the watermark back to the
/// held version's over the newer run's snapshot.
#[test]
fn a_hold_superseded_after_it_was_read_is_not_resolved() {
    let ws = Workspace::new(&[], "", "");
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 0.05");
    let engine = ws.engine();
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let committed = engine.store.watermark("s1").unwrap().unwrap();
    ws.write_layer(&layer(&with_zones(&v1, &(0..50).collect::<Vec<_>>(), "C-9")));
    let h = run(&engine, false).record.hold_id.unwrap();
    let read = engine.store.hold(h).unwrap().unwrap();
    assert_eq!(read.state, HoldState::Open);
    // The publisher goes back to v1: that run supersedes the hold.
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    assert!(matches!(engine.store.hold(h).unwrap().unwrap().state, HoldState::Superseded { .. }));
    let late = engine.store.begin_run("s1", zonewatch::store::CommitMode::ResolveHold { hold_id: h, prime: false }, read.watermark.clone(), 1, 3_600_000);
    let err = late.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("no longer open"), "{err}");
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap().digest, committed.digest, "watermark not set back");
}

/// On a 100-parcel grid: the baseline, P0000 rezoned R-3 for real (told), then a publisher's
/// rollback of P0000 to R-1 with 50 other parcels, held as a spike. Returns the first two
/// versions and the hold.
async fn told_r3_then_rolled_back(ws: &Workspace, engine: &zonewatch::pipeline::Engine) -> (Vec<P>, Vec<P>, u64) {
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    assert_eq!(run(engine, false).record.verdict, Verdict::Baseline);
    let v2 = with_zones(&v1, &[0], "R-3");
    ws.write_layer(&layer(&v2));
    assert_eq!(run(engine, false).record.counts.queued, 1);
    assert_eq!(deliver(engine, Duration::from_secs(5)).await.sent, 1);
    let rollback = with_zones(&v1, &(50..100).collect::<Vec<_>>(), "C-9");
    ws.write_layer(&layer(&rollback));
    let h = run(engine, false).record.hold_id.expect("a spike is held");
    (v1, v2, h)
}

/// A primed hold announces nothing, so its parcels keep what subscribers were last told: a
/// publisher's rollback held (a spike) and primed, then undone by the next version (held,
/// and released), sends the parcel the receiver was told of no second alert. (The parcels
/// the rollback changed away from their first ingest are told of their return: nothing was
/// ever announced of them to return to.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primed_rollback_undone_tells_no_one_twice() {
    let (rx, ws, engine) = watched_grid(0.05).await;
    let (_, v2, h) = told_r3_then_rolled_back(&ws, &engine).await;
    let primed = engine.resolve_hold(h, true).unwrap();
    assert_eq!((primed.counts.queued, primed.counts.suppressed), (0, 51));
    // And undoes it: held again, released.
    ws.write_layer(&layer(&v2));
    let h = run(&engine, false).record.hold_id.expect("a spike is held");
    let released = engine.resolve_hold(h, false).unwrap();
    assert_eq!((released.counts.changes, released.counts.queued, released.counts.duplicates), (51, 50, 1));
    deliver(&engine, Duration::from_secs(5)).await;
    let p0000: Vec<_> = rx.received().iter().filter_map(|r| r.json()).filter(|j| j["data"]["parcel_id"] == "P0000").collect();
    assert_eq!(p0000.len(), 1, "P0000's R-3 was told once: {p0000:?}");
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0000"].zoning, "R-3");
}

/// The same rollback, primed, and its undo primed as well (subscribers were told R-3 and see
/// no need to hear it again): P0000 is R-3 again, and nothing was sent. When P0000 then goes
/// back to R-1 for real, subscribers — last told R-3 — are told. (Before the fix, the real
/// change carried the revision the primed rollback's R-3 → R-1 key had claimed, and was
/// counted a `duplicate` of it: a real zoning change never sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_change_after_a_primed_rollback_and_a_primed_undo_is_told() {
    let (rx, ws, engine) = watched_grid(0.05).await;
    let (v1, v2, h) = told_r3_then_rolled_back(&ws, &engine).await;
    engine.resolve_hold(h, true).unwrap();
    ws.write_layer(&layer(&v2));
    let h = run(&engine, false).record.hold_id.expect("a spike is held");
    let undo = engine.resolve_hold(h, true).unwrap();
    assert_eq!(undo.counts.queued, 0);
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0000"].zoning, "R-3");
    // Now P0000 really goes back to R-1 (a one-parcel change, delivered).
    ws.write_layer(&layer(&v1));
    let real = run(&engine, false);
    assert_eq!((real.record.verdict, real.record.counts.changes), (Verdict::Run, 1));
    deliver(&engine, Duration::from_secs(5)).await;
    let told: Vec<String> = rx
        .received()
        .iter()
        .filter_map(|r| r.json())
        .filter(|j| j["data"]["parcel_id"] == "P0000")
        .map(|j| j["data"]["to"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!((real.record.counts.queued, real.record.counts.duplicates, told), (1, 0, vec!["R-3".to_string(), "R-1".to_string()]));
}

/// A `--reprocess` the gate holds (here: most features lost their zoning field) sends
/// nothing when an operator then releases it: the operator ran it to send nothing, and the
/// gate held it only for what it read. Its release primes (the run record says why), so it
/// announces nothing: a later real change back to what subscribers were last told is a
/// `duplicate`, and the change after that is news.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reprocess_released_sends_nothing() {
    let (rx, ws, engine) = watched_grid(0.5).await;
    let v1 = grid(40);
    let c = with_zones(&v1, &[0], "C-9");
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    for v in [&c, &v1] {
        ws.write_layer(&layer(v));
        assert_eq!(run(&engine, false).record.counts.queued, 1);
    }
    // P0000 to C-9 again, in a layer where 21 of 40 features lost their zoning field: a
    // reprocess run, held as a quarantine spike, then released.
    let text = layer(&c);
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    for f in doc["features"].as_array_mut().unwrap().iter_mut().skip(19) {
        let code = f["properties"]["ZONE_CODE"].take();
        f["properties"]["OLD_ZONE"] = code;
        f["properties"].as_object_mut().unwrap().remove("ZONE_CODE");
    }
    ws.write_layer(&doc.to_string());
    let held = run(&engine, true);
    let h = held.record.hold_id.expect("a quarantine spike is held");
    let listed = engine.store.hold(h).unwrap().expect("the hold");
    assert!(listed.reprocess, "the hold knows it holds a reprocess");
    let released = engine.resolve_hold(h, false).unwrap();
    assert_eq!((released.counts.queued, released.counts.suppressed), (0, 1), "P0000 to C-9, primed: {:?}", released.warnings);
    assert!(released.warnings.iter().any(|w| w.contains("--reprocess")), "{:?}", released.warnings);
    // Back to R-1 for real: subscribers were last told R-1.
    ws.write_layer(&layer(&v1));
    let back = run(&engine, false);
    assert_eq!((back.record.counts.changes, back.record.counts.queued, back.record.counts.duplicates), (1, 0, 1));
    // And C-9 for real: news.
    ws.write_layer(&layer(&c));
    assert_eq!(run(&engine, false).record.counts.queued, 1);
    deliver(&engine, Duration::from_secs(5)).await;
    let ids: std::collections::HashSet<String> = rx.received().iter().map(|r| r.header("webhook-id").unwrap_or_default().to_string()).collect();
    assert_eq!(ids.len(), 3, "three changes told, three keys");
    assert_eq!(rx.received().len(), 3);
}

/// A source's first ingest run as a `--reprocess` is its baseline: verdict `baseline`, its keys
/// primed with the baseline's audit detail, nothing sent; the next real change is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_ingest_run_as_a_reprocess_is_the_baseline() {
    let rx = receiver(200).await;
    let ws = Workspace::new(&[Sub { id: "w", aoi: rect(-72.0, 42.0, -68.0, 43.0), target: rx.url("/hook"), min_severity: "info", secret: None }], "", "");
    let engine = ws.engine();
    let v1 = grid(20);
    ws.write_layer(&layer(&v1));
    let first = run(&engine, true);
    assert_eq!((first.record.verdict, first.record.counts.queued), (Verdict::Baseline, 0), "{}", first.line());
    let rows = engine.store.audit(&Default::default()).unwrap();
    assert!(rows.iter().filter(|r| r.outcome == Outcome::Suppressed).all(|r| r.detail == "baseline"));
    assert_eq!(rows.iter().filter(|r| r.outcome == Outcome::Suppressed).count() as u64, first.record.counts.suppressed);
    ws.write_layer(&layer(&with_zones(&v1, &[0], "C-9")));
    assert_eq!(run(&engine, false).record.counts.queued, 1);
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(rx.received().len(), 1);
}

/// A district layer joined to the parcel layer, exported half missing: the parcels its
/// missing districts covered lose their coverage (not alerted), and those they were next to
/// take their neighbour's code. The lost coverage counts toward the change spike, against
/// the parcels a district covered (here half the base: against the whole base, 25% would
/// pass the 40% ratio), so the run is held, not sent (a black-box tester: 541 false
/// `rezoned` went out for Cambridge, and 541 more when the whole layer came back). The whole
/// layer back: nothing is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_district_layer_exported_half_missing_is_held() {
    let rx = receiver(200).await;
    let ws = Workspace::new(&[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }], "", "");
    ws.write_layer(&layer(&grid(100)));
    let strips = |codes: &[(&str, f64, f64)]| {
        let features: Vec<_> = codes
            .iter()
            .map(|(code, x0, x1)| serde_json::json!({"type": "Feature", "properties": {"DISTRICT": code}, "geometry": rect(*x0, 42.359, *x1, 42.37)}))
            .collect();
        serde_json::json!({"type": "FeatureCollection", "features": features}).to_string()
    };
    // The western half of the grid's 20 columns.
    let all = [("R-1", -71.1005, -71.0955), ("R-2", -71.0955, -71.0905)];
    let districts = ws.path().join("districts.geojson");
    std::fs::write(&districts, strips(&all)).unwrap();
    let mut config = std::fs::read_to_string(ws.config_path()).unwrap();
    config.push_str(&format!(
        "\n[[source]]\nid = \"zoning\"\njurisdiction = \"town\"\nkind = \"file\"\npath = \"{}\"\nlayer = \"districts\"\nparcels = \"s1\"\nmax_change_ratio = 0.4\n[source.fields]\nzoning = \"DISTRICT\"\n",
        districts.display()
    ));
    std::fs::write(ws.config_path(), config).unwrap();
    let engine = ws.engine();
    let zoning = |engine: &zonewatch::pipeline::Engine| engine.run_source_id("zoning", Default::default()).expect("district run");
    run(&engine, false);
    assert_eq!(zoning(&engine).record.verdict, Verdict::Baseline);

    std::fs::write(&districts, strips(&all[..1])).unwrap();
    let half = zoning(&engine);
    assert_eq!(half.record.verdict, Verdict::Held, "{:?}", half.record);
    let reason = half.hold_reason.unwrap_or_default();
    assert!(reason.starts_with("change_spike") && reason.contains("parcels a district covered") && reason.contains("lost their district coverage"), "{reason}");

    std::fs::write(&districts, strips(&all)).unwrap();
    zoning(&engine);
    deliver(&engine, Duration::from_secs(2)).await;
    assert!(rx.received().is_empty(), "nothing sent: {:?}", rx.received().len());
    assert!(engine.store.check_consistency().unwrap().is_consistent());
}

/// An effective-date field that no feature has (renamed in the export) is said on the run's
/// line; it was silently null for every parcel (a black-box tester).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effective_date_field_no_feature_has_is_said() {
    let (_rx, ws, engine) = watched_grid(0.5).await;
    drop(engine);
    ws.edit_config(r#"zoning = "ZONE_CODE""#, "zoning = \"ZONE_CODE\"\neffective_date = \"EFF_DATE\"");
    let engine = ws.engine();
    ws.write_layer(&layer(&grid(10)));
    let r = run(&engine, false);
    assert!(r.record.warnings.iter().any(|w| w.starts_with(r#"no feature has a value in field "EFF_DATE""#)), "{:?}", r.record.warnings);
}

/// A parcel layer exported without its geometry (every `geometry` null) or with centroids
/// for polygons is held: more than half its stored parcels could not be read. It was committed with every feature quarantined and exit 0, and a rezoning
/// published in that form was never alerted (a black-box tester). Features that never had a
/// polygon (a tax roll's condo units) are not stored parcels: a first ingest with them is a
/// baseline, and so is not held for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parcel_layer_without_its_polygons_is_held() {
    let (_rx, ws, engine) = watched_grid(0.5).await;
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let text = layer(&with_zones(&v1, &[0], "M-1"));
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (i, f) in doc["features"].as_array_mut().unwrap().iter_mut().enumerate() {
        f["geometry"] = if i % 2 == 0 { serde_json::Value::Null } else { serde_json::json!({"type": "Point", "coordinates": [-71.09, 42.36]}) };
    }
    ws.write_layer(&doc.to_string());
    let r = run(&engine, false);
    assert_eq!(r.record.verdict, Verdict::Held, "{:?}", r.record);
    assert!(r.hold_reason.as_deref().is_some_and(|h| h.starts_with("quarantine_spike: 100 of 100 stored parcels could not be read")), "{:?}", r.hold_reason);

    // A tax roll whose condo units have no geometry, in every version: a baseline, and a
    // rezoning among its parcels goes out.
    let (_rx2, ws2, engine2) = watched_grid(0.5).await;
    let condos = |v: &[P]| {
        let mut doc: serde_json::Value = serde_json::from_str(&layer(v)).unwrap();
        let features = doc["features"].as_array_mut().unwrap();
        for i in 0..150 {
            features.push(serde_json::json!({"type": "Feature", "properties": {"APN": format!("U{i:04}"), "ZONE_CODE": "R-1"}, "geometry": null}));
        }
        doc.to_string()
    };
    ws2.write_layer(&condos(&v1));
    assert_eq!(run(&engine2, false).record.verdict, Verdict::Baseline);
    ws2.write_layer(&condos(&with_zones(&v1, &[0], "M-1")));
    let r = run(&engine2, false);
    assert_eq!((r.record.verdict, r.record.counts.queued), (Verdict::Run, 1), "{:?}", r.hold_reason);
}
