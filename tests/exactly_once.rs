//! The exactly-once properties: replay storms, concurrent claims, reprocess priming, misses
//! that cannot hide, and crashes before the commit. Real loopback receiver, temp stores.

mod common;
use common::*;
use std::time::Duration;
use zonewatch::model::{ChangeEvent, ChangeKind, Severity, Verdict};

/// A fixed instant for events rebuilt by hand and for tests on a manual clock.
const T0: u64 = 1_790_000_000_000;

fn rezone(parcels: &[P], ids: &[usize], to: &str) -> Vec<P> {
    let mut v = parcels.to_vec();
    for &i in ids {
        v[i].zone = to.to_string();
    }
    v
}

fn whole_area(target: String) -> Sub {
    Sub { id: "w1", aoi: rect(-71.2, 42.3, -71.0, 42.5), target, min_severity: "info", secret: None }
}

/// A loopback receiver answering 200, and a workspace whose one subscriber (`whole_area`)
/// posts to it.
async fn whole_area_workspace() -> (zonewatch::receiver::Receiver, Workspace) {
    let rx = receiver(200).await;
    let ws = Workspace::new(&[whole_area(rx.url("/hook"))], "", "");
    (rx, ws)
}

/// The change event the pipeline emits for a rezoning, rebuilt from its stable fields.
fn rebuilt_event(parcel: &str, from: &str, to: &str) -> ChangeEvent {
    ChangeEvent {
        source_id: "s1".into(),
        jurisdiction: "testville".into(),
        parcel_id: parcel.into(),
        kind: ChangeKind::Rezoned,
        from: Some(from.into()),
        to: Some(to.into()),
        effective_date: None,
        old_geometry: None,
        new_geometry: Some(zonewatch::model::StoredGeometry(vec![vec![vec![
            [-71.2, 42.3], [-71.0, 42.3], [-71.0, 42.5], [-71.2, 42.3],
        ]]])),
        area_m2: 100.0,
        observed_at_ms: T0,
        severity: Severity::Notice,
        // The parcel's first change since its baseline carries revision 1 (the baseline
        // primed its `added` under 0).
        revision: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_storm_sends_nothing_twice() {
    let (rx, ws) = whole_area_workspace().await;
    let v1 = grid(40);
    // Parcels 1 and 4 are C-1; 0 and 3 are R-1.
    let v2 = rezone(&v1, &[0, 3], "R-3");
    let engine = ws.engine();
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.queued), (Verdict::Run, 2, 2));
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 2);
    assert_eq!(rx.received().len(), 2);

    // The same version again: identical, nothing sent.
    let again = run(&engine, false);
    assert_eq!(again.record.verdict, Verdict::Identical);
    assert_eq!(deliver(&engine, Duration::from_secs(1)).await.attempted, 0);

    // The same bytes forced through the whole pipeline (reprocess flag off, watermark
    // bypassed by re-writing the file with different formatting): zero changes.
    ws.write_layer(&format!("{}\n\n", layer(&v2)));
    let reformatted = run(&engine, false);
    assert_eq!((reformatted.record.verdict, reformatted.record.counts.changes), (Verdict::Run, 0));

    // Re-injecting the same change events: all duplicates, nothing sent.
    let events = vec![rebuilt_event("P0000", "R-1", "R-3"), rebuilt_event("P0003", "R-1", "R-3")];
    let claims = engine.claims_for(&events);
    assert_eq!(claims.len(), 2);
    let counts = engine.store.enqueue(&events, &claims, "reinject", engine.now(), 86_400_000).unwrap();
    assert_eq!((counts.queued, counts.duplicates), (0, 2));
    assert_eq!(deliver(&engine, Duration::from_secs(1)).await.attempted, 0);
    assert_eq!(rx.received().len(), 2, "no second delivery of any event");
    let o = outcomes(&engine);
    assert_eq!(o.get("sent"), Some(&2));
    assert_eq!(o.get("duplicate"), Some(&2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_of_one_key_have_one_winner() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = std::sync::Arc::new(ws.engine());
    for round in 0..25 {
        // Odd rounds merge the key journal after every claiming commit, so the losing claim
        // may look the key up before, during or after the winner's merge.
        engine.store.set_key_journal_merge_rows(round % 2);
        let events = vec![rebuilt_event(&format!("R{round}"), "R-1", "C-2")];
        let claims = engine.claims_for(&events);
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let (engine, barrier, events, claims) = (engine.clone(), barrier.clone(), events.clone(), claims.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    engine.store.enqueue(&events, &claims, &format!("task-{t}"), engine.now(), 86_400_000).unwrap()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let queued: u64 = results.iter().map(|c| c.queued).sum();
        let dups: u64 = results.iter().map(|c| c.duplicates).sum();
        assert_eq!((queued, dups), (1, 1), "round {round}: {results:?}");
    }
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(rx.received().len(), 25);
    let o = outcomes(&engine);
    assert_eq!((o.get("queued"), o.get("sent"), o.get("duplicate")), (Some(&25), Some(&25), Some(&25)));
    // One `sent` per key.
    let rows = engine.store.audit(&Default::default()).unwrap();
    let mut sent_keys: Vec<_> = rows.iter().filter(|r| r.outcome.as_str() == "sent").filter_map(|r| r.idempotency_key.clone()).collect();
    sent_keys.sort();
    sent_keys.dedup();
    assert_eq!(sent_keys.len(), 25);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reprocess_primes_and_later_runs_deduplicate() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = ws.engine();
    let v1 = grid(40);
    let v2 = rezone(&v1, &[0, 3, 6], "C3");
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    ws.write_layer(&layer(&v2));
    let r = run(&engine, true);
    assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.suppressed, r.record.counts.queued), (Verdict::Reprocessed, 3, 3, 0));
    // Back to v1 silently: still nothing sent.
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, true).record.counts.suppressed, 3);
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty(), "reprocess must never send");
    // Then v2 for real: subscribers were never told v2 (nor anything since v1), so it is
    // news. Its keys carry revisions the primed changes did not (`detect::diff::step`);
    // before the thirty-second session this was a `duplicate` of the first reprocess, the
    // same rule that lost a real change after a primed rollback and its primed undo.
    ws.write_layer(&layer(&v2));
    let real = run(&engine, false);
    assert_eq!((real.record.verdict, real.record.counts.changes, real.record.counts.queued, real.record.counts.duplicates), (Verdict::Run, 3, 3, 0));
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 3);
    assert_eq!(rx.received().len(), 3, "the real run's three changes, once each");
    let suppressed: Vec<_> = engine.store.audit(&Default::default()).unwrap().into_iter().filter(|r| r.detail == "reprocess").collect();
    assert_eq!(suppressed.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_cannot_hide() {
    for (status, reason, expected_requests) in [(503u16, "retries_exhausted", 3usize), (400, "rejected_400", 1)] {
        let rx = receiver(status).await;
        let ws = Workspace::new(&[whole_area(rx.url("/hook"))], "", "");
        let engine = ws.engine();
        let v1 = grid(20);
        ws.write_layer(&layer(&v1));
        run(&engine, false);
        ws.write_layer(&layer(&rezone(&v1, &[0], "M-1")));
        assert_eq!(run(&engine, false).record.counts.queued, 1);
        let stats = deliver(&engine, Duration::from_secs(5)).await;
        assert_eq!(stats.dead, 1, "status {status}");
        assert_eq!(rx.received().len(), expected_requests, "status {status}: attempts");
        let dead = engine.store.dead_letters().unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].reason, reason);
        assert_eq!(dead[0].entry.parcel_id, "P0000");
        let rows = engine.store.audit(&Default::default()).unwrap();
        let dl: Vec<_> = rows.iter().filter(|r| r.outcome.as_str() == "dead_letter").collect();
        assert_eq!(dl.len(), 1);
        assert_eq!(dl[0].detail, reason);
        assert_eq!(dl[0].idempotency_key.as_deref(), Some(dead[0].entry.key.0.as_str()));
        assert_eq!(engine.store.outbox_len().unwrap(), 0, "nothing left half-done");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_before_commit_leaves_nothing_and_the_rerun_sends_once() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = ws.engine();
    let v1 = grid(40);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let wm_before = engine.store.watermark("s1").unwrap().unwrap();
    let audit_before = engine.store.audit(&Default::default()).unwrap().len();

    ws.write_layer(&layer(&rezone(&v1, &[0, 3], "C3")));
    engine.store.fail_next_commit();
    let err = engine.run_source_id("s1", Default::default()).unwrap_err();
    assert!(err.to_string().contains("simulated failure"), "{err}");
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap(), wm_before, "watermark must not move");
    assert_eq!(engine.store.audit(&Default::default()).unwrap().len(), audit_before, "no audit rows of the failed run");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0000"].zoning, "R-1");
    let failed = engine.store.runs(Some("s1"), 1).unwrap();
    assert_eq!(failed[0].verdict, Verdict::Failed);

    // Reopen the store as a restarted process would, then rerun.
    drop(engine);
    let engine = ws.engine();
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.queued), (2, 2));
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(run(&engine, false).record.verdict, Verdict::Identical);
    deliver(&engine, Duration::from_secs(1)).await;
    assert_eq!(rx.received().len(), 2, "each event exactly once");
}

/// A store error in the middle of a run's transaction, while the other thread of the commit
/// is blocked handing over the next chunks (the failing write pauses first, so the channel
/// is full): the run fails whole (no parcel, key, outbox or audit row of it; the watermark
/// where it was), the preparing thread stops instead of hanging (a watchdog fails the test
/// after 60 s), and the rerun commits everything and sends each event once. Both for a
/// baseline (events built on the preparing thread) and for a run of rezonings (events built
/// by the writer from the stored geometries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_error_mid_commit_leaves_nothing_and_the_rerun_sends_once() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = std::sync::Arc::new(ws.engine());
    let failing_run = |engine: &std::sync::Arc<zonewatch::pipeline::Engine>| {
        engine.store.fail_snapshot_write(1, Duration::from_millis(300));
        let e = engine.clone();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(e.run_source_id("s1", Default::default()).map(|r| r.record.verdict));
        });
        let outcome = done_rx.recv_timeout(Duration::from_secs(60)).expect("the failing run returns instead of hanging");
        let err = outcome.expect_err("the injected store error fails the run");
        assert!(err.to_string().contains("simulated failure"), "{err}");
    };
    // 12,800 parcels: four chunks of the commit (4,096 each, then 512).
    let v1 = grid(12_800);
    ws.write_layer(&layer(&v1));
    failing_run(&engine);
    assert_eq!(engine.store.watermark("s1").unwrap(), None, "no watermark for a failed baseline");
    assert!(engine.store.snapshot_states("s1").unwrap().is_empty(), "no parcel of the failed baseline");
    assert!(engine.store.audit(&Default::default()).unwrap().is_empty(), "no audit row of the failed baseline");
    assert_eq!(engine.store.runs(Some("s1"), 1).unwrap()[0].verdict, Verdict::Failed);
    let base = run(&engine, false);
    assert_eq!((base.record.verdict, base.record.counts.parcels), (Verdict::Baseline, 12_800));
    let wm = engine.store.watermark("s1").unwrap().unwrap();
    let audit_before = engine.store.audit(&Default::default()).unwrap().len();
    assert!(audit_before > 0, "the baseline primed the AOI's keys, with audit rows");

    // 5,000 rezonings (two chunks). The AOI holds the grid's rows 0 to 140 (row 140 touches
    // its edge): 2,820 parcels.
    let changed: Vec<usize> = (0..5_000).collect();
    ws.write_layer(&layer(&rezone(&v1, &changed, "C3")));
    failing_run(&engine);
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap(), wm, "watermark must not move");
    assert_eq!(engine.store.outbox_len().unwrap(), 0, "nothing queued by the failed run");
    assert_eq!(engine.store.audit(&Default::default()).unwrap().len(), audit_before, "no audit rows of the failed run");
    let states = engine.store.snapshot_states("s1").unwrap();
    assert!(changed.iter().all(|&i| states[&v1[i].id].zoning == v1[i].zone), "the snapshot is the baseline's");

    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.queued), (5_000, 2_820));
    deliver(&engine, Duration::from_secs(20)).await;
    assert_eq!(run(&engine, false).record.verdict, Verdict::Identical);
    let got = rx.received();
    assert_eq!(got.len(), 2_820, "each event in the AOI exactly once");
    let parcels: std::collections::HashSet<String> =
        got.iter().filter_map(|r| r.json()).map(|j| j["data"]["parcel_id"].as_str().unwrap_or("").to_string()).collect();
    assert_eq!(parcels.len(), 2_820, "2,820 distinct parcels");
}

/// A layer that does not list its parcels in id order (here: reversed) has its snapshot rows
/// put in key order before they are written (`detect/row_sort.rs`): the baseline stores
/// every parcel, and a later run finds exactly its changes and sends each once, including a
/// parcel redrawn out of the AOI, which only its stored (old) shape matches: read before the
/// held-back rows replace it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_out_of_id_order_commits_whole_and_diffs_exactly() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = ws.engine();
    let v1 = grid(9_000);
    let reversed = |v: &[P]| v.iter().rev().cloned().collect::<Vec<P>>();
    ws.write_layer(&layer(&reversed(&v1)));
    let base = run(&engine, false);
    assert_eq!((base.record.verdict, base.record.counts.parcels), (Verdict::Baseline, 9_000));
    let states = engine.store.snapshot_states("s1").unwrap();
    assert_eq!(states.len(), 9_000);
    assert!(v1.iter().all(|p| states[&p.id].zoning == p.zone), "every parcel stored as published");
    // Rezonings spread over the layer (rows 0-140 of the grid are in the AOI), and P0005
    // redrawn east of the AOI.
    let changed = [0, 19, 2_000, 2_819, 2_820, 8_999];
    let mut v2 = rezone(&v1, &changed, "C3");
    v2[5] = square("P0005", &v1[5].zone, -70.5, 42.36, 0.0009);
    ws.write_layer(&layer(&reversed(&v2)));
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.queued), (7, 5), "{}", r.line());
    deliver(&engine, Duration::from_secs(5)).await;
    let mut got: Vec<String> = rx.received().iter().filter_map(|r| Some(r.json()?["data"]["parcel_id"].as_str()?.to_string())).collect();
    got.sort();
    assert_eq!(got, ["P0000", "P0005", "P0019", "P2000", "P2819"]);
    let states = engine.store.snapshot_states("s1").unwrap();
    assert!(changed.iter().all(|&i| states[&v1[i].id].zoning == "C3"));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Identical);
}

/// A county larger than one sort run (65,536 rows), listed in a scrambled order: its rows go
/// through run files and the merge (`detect/row_sort.rs`), and the snapshot is whole and
/// exact: the same layer in another order is identical parcel for parcel (0 changes).
#[test]
fn a_county_larger_than_a_sort_run_out_of_order_is_stored_whole() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let n = 70_000usize;
    let lots: Vec<P> = (0..n)
        .map(|k| (k * 7_919) % n)
        .map(|i| {
            let zone = ["R-1", "C-1", "R-2"][i % 3];
            square(&format!("P{i:05}"), zone, -71.9 + (i % 350) as f64 * 0.004, 42.05 + (i / 350) as f64 * 0.004, 0.003)
        })
        .collect();
    ws.write_layer(&layer(&lots));
    let base = run(&engine, false);
    assert_eq!((base.record.verdict, base.record.counts.parcels, base.record.counts.quarantined), (Verdict::Baseline, n as u64, 0));
    let states = engine.store.snapshot_states("s1").unwrap();
    assert_eq!(states.len(), n);
    assert!(lots.iter().all(|p| states[&p.id].zoning == p.zone), "every parcel stored with its own zoning");
    let reordered: Vec<P> = lots.iter().rev().cloned().collect();
    ws.write_layer(&layer(&reordered));
    let again = run(&engine, false);
    assert_eq!((again.record.verdict, again.record.counts.changes), (Verdict::Run, 0), "{}", again.line());
}

/// Idempotency keys expire after their TTL, but never while their event is undelivered or
/// dead-lettered (a re-claim then would let a re-detection and a replay both send it): the
/// sweep re-arms those for another TTL. Time is a manual clock, so nothing sleeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_after_their_ttl_but_never_while_their_event_can_still_be_sent() {
    // P0001's receiver rejects it (400: dead letter); everything else is accepted.
    let rx = zonewatch::receiver::Receiver::start(
        std::sync::Arc::new(|_, r: &zonewatch::receiver::Received| if String::from_utf8_lossy(&r.body).contains("P0001") { 400 } else { 200 }),
        None,
    )
    .await
    .expect("receiver");
    let ws = Workspace::new(&[whole_area(rx.url("/hook"))], "", "");
    let clock = zonewatch::clock::ManualClock::at(T0);
    let engine = ws.engine_at(clock.clone());
    let hour = Duration::from_secs(3600);
    let ttl = hour.as_millis() as u64;
    let events = vec![rebuilt_event("P0000", "R-1", "R-3"), rebuilt_event("P0001", "R-1", "R-3")];
    let claims = engine.claims_for(&events);
    assert_eq!(engine.store.enqueue(&events, &claims, "first", engine.now(), ttl).unwrap().queued, 2);

    // Two hours on, both keys are past their TTL but neither event was delivered: kept.
    clock.advance(2 * hour);
    assert_eq!(engine.store.sweep_expired_keys(engine.now(), 100).unwrap(), 0);
    assert_eq!(engine.store.enqueue(&events, &claims, "again", engine.now(), ttl).unwrap().duplicates, 2);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dead), (1, 1));
    assert_eq!(engine.store.dead_letters().unwrap().len(), 1);

    // The sweep re-armed both keys for one more hour: not yet.
    clock.advance(hour / 2);
    assert_eq!(engine.store.sweep_expired_keys(engine.now(), 100).unwrap(), 0);
    // Past it: the sent key goes; the dead-lettered one stays (its dead letter can be replayed).
    clock.advance(hour);
    assert_eq!(engine.store.sweep_expired_keys(engine.now(), 100).unwrap(), 1);
    let c = engine.store.enqueue(&events, &claims, "after", engine.now(), ttl).unwrap();
    assert_eq!((c.queued, c.duplicates), (1, 1), "after its TTL the sent event is new again; the dead-lettered one is not");

    // A replayed dead letter is a new outbox row under the same key: the key follows it and
    // stays while the replay is queued.
    let dead = engine.store.dead_letters().unwrap().remove(0);
    let replayed = engine.store.replay_dead_letter(dead.entry.id, engine.now(), 5, Ok(())).unwrap();
    assert!(matches!(replayed, zonewatch::store::ReplayOutcome::Requeued { .. }), "{replayed:?}");
    clock.advance(3 * hour);
    assert_eq!(engine.store.sweep_expired_keys(engine.now(), 100).unwrap(), 0, "both events are queued again");
    let later = engine.store.enqueue(&events, &claims, "later", engine.now(), ttl).unwrap();
    assert_eq!(later.duplicates, 2, "{later:?} {:?}", engine.store.outbox().unwrap().iter().map(|e| (&e.parcel_id, e.id)).collect::<Vec<_>>());
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dead), (1, 1));
    clock.advance(3 * hour);
    assert_eq!(engine.store.sweep_expired_keys(engine.now(), 100).unwrap(), 1, "the sent key goes, the dead-lettered one stays");
    let report = engine.store.check_consistency().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// Keys are claimed in key order inside a commit (for locality), but the outcome must be the
/// same as in claim order: of two claims with one key in a batch, the first wins and the
/// second is a duplicate, and the audit rows follow the claims' order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_keys_in_one_batch_first_claim_wins_in_claim_order() {
    let (_rx, ws) = whole_area_workspace().await;
    let engine = ws.engine();
    let events: Vec<ChangeEvent> = ["P0009", "P0001", "P0009", "P0005", "P0001"].iter().map(|p| rebuilt_event(p, "R-1", "R-3")).collect();
    let claims = engine.claims_for(&events);
    assert_eq!(claims.len(), 5);
    let c = engine.store.enqueue(&events, &claims, "batch", T0, 86_400_000).unwrap();
    assert_eq!((c.queued, c.duplicates), (3, 2));
    let rows: Vec<(String, String)> = engine
        .store
        .audit(&Default::default())
        .expect("audit")
        .into_iter()
        .map(|r| (r.parcel_id.unwrap_or_default(), r.outcome.as_str().to_string()))
        .collect();
    let want: Vec<(String, String)> = [("P0009", "queued"), ("P0001", "queued"), ("P0009", "duplicate"), ("P0005", "queued"), ("P0001", "duplicate")]
        .iter()
        .map(|(p, o)| (p.to_string(), o.to_string()))
        .collect();
    assert_eq!(rows, want);
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 3);
}

/// The `webhook-id` of every request the receiver got, in order.
fn ids_received(rx: &zonewatch::receiver::Receiver) -> Vec<String> {
    rx.received().iter().map(|r| r.header("webhook-id").unwrap_or_default().to_string()).collect()
}

/// A change that happens again is news again: a parcel rezoned R-1 → R-3, back and to R-3
/// again, and one removed, published again, removed and published again, all within the key
/// TTL, are told of every change, each under a key of its own (a receiver deduplicating on
/// `webhook-id` keeps them all). A rollback taken silently (a reprocess back to the old
/// version) and undone by the next real run tells the receiver nothing twice: it was told
/// R-3 and still believes it. The change after that is news again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_happens_again_is_told_again() {
    let (rx, ws) = whole_area_workspace().await;
    let engine = ws.engine();
    let v1 = grid(40);
    let v2 = rezone(&v1, &[0], "R-3");
    let without: Vec<P> = v2.iter().filter(|p| p.id != "P0005").cloned().collect();
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    for (i, v) in [&v2, &v1, &v2, &without, &v2, &without, &v2].into_iter().enumerate() {
        ws.write_layer(&layer(v));
        let r = run(&engine, false);
        assert_eq!((r.record.counts.changes, r.record.counts.queued, r.record.counts.duplicates), (1, 1, 0), "change {i}");
    }
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 7);
    let ids = ids_received(&rx);
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 7, "seven changes, seven keys: {ids:?}");
    // Delivery order is not run order (more severe first): compare them sorted.
    let mut told: Vec<String> = rx
        .received()
        .iter()
        .filter_map(|r| r.json())
        .map(|j| format!("{} {} {}→{}", j["data"]["parcel_id"], j["data"]["change"], j["data"]["from"], j["data"]["to"]))
        .collect();
    told.sort();
    assert_eq!(
        told,
        vec![
            r#""P0000" "rezoned" "R-1"→"R-3""#,
            r#""P0000" "rezoned" "R-1"→"R-3""#,
            r#""P0000" "rezoned" "R-3"→"R-1""#,
            r#""P0005" "added" null→"R-2""#,
            r#""P0005" "added" null→"R-2""#,
            r#""P0005" "removed" "R-2"→null"#,
            r#""P0005" "removed" "R-2"→null"#,
        ]
    );
    // The parcel's first change carries revision 1, so its key is the one rebuilt from its
    // fields and its source (a source first ingested by this build names itself in its keys).
    // (A parcel stored by a zonewatch without revisions has revision 0, and its first change
    // the key that zonewatch gave it: `notify::idem`'s tests pin the algorithm.)
    let scope = zonewatch::notify::idem::KeyScope { source: Some("s1"), epoch: 0 };
    let first = zonewatch::notify::idem::key_in("w1", &rebuilt_event("P0000", "R-1", "R-3"), scope);
    assert!(ids.contains(&first.0), "{ids:?}");

    // A silent rollback, then the real version again: a duplicate of the third change.
    ws.write_layer(&layer(&v1));
    let rollback = run(&engine, true);
    assert_eq!((rollback.record.counts.changes, rollback.record.counts.suppressed), (1, 1));
    ws.write_layer(&layer(&v2));
    let back = run(&engine, false);
    assert_eq!((back.record.counts.changes, back.record.counts.queued, back.record.counts.duplicates), (1, 0, 1));
    assert_eq!(deliver(&engine, Duration::from_secs(1)).await.attempted, 0);
    assert_eq!(rx.received().len(), 7, "the receiver already believes R-3");

    // R-3 → R-1 for real: news.
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, false).record.counts.queued, 1);
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 1);
    let ids = ids_received(&rx);
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 8, "{ids:?}");
    let o = outcomes(&engine);
    assert_eq!((o.get("sent"), o.get("duplicate")), (Some(&8), Some(&1)));
}

/// A source given a new id (the same layer moved to a portal, say) counts its parcels'
/// revisions afresh: its real change R-1 → R-3, after the old source told R-1 → R-3 and back,
/// took the key the old source had used for it, and was audited `duplicate` and never sent
/// (found by a black-box tester). Keys of a source ingested by this build name the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_source_tells_a_change_its_old_name_told_before() {
    let (rx, ws) = whole_area_workspace().await;
    let v1 = grid(40);
    let v2 = rezone(&v1, &[0], "R-3");
    {
        let engine = ws.engine();
        for v in [&v1, &v2, &v1] {
            ws.write_layer(&layer(v));
            run(&engine, false);
        }
        assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 2);
    }
    ws.edit_config("id = \"s1\"", "id = \"s2\"");
    let engine = ws.engine();
    let rerun = |engine: &zonewatch::pipeline::Engine| engine.run_source_id("s2", Default::default()).expect("run");
    let baseline = rerun(&engine);
    assert_eq!((baseline.record.verdict, baseline.record.counts.duplicates), (Verdict::Baseline, 0), "the new source's baseline primes keys of its own");
    ws.write_layer(&layer(&v2));
    let r = rerun(&engine);
    assert_eq!((r.record.counts.queued, r.record.counts.duplicates), (1, 0), "R-1 → R-3 again, under the new name: told");
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 1);
    let ids = ids_received(&rx);
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 3, "{ids:?}");
}

/// After `zonewatch restore`, a store counts revisions from the backup's: a change sent after
/// the backup was taken is not in it, and the same change made again after the restore took
/// its key, so a receiver deduplicating on `webhook-id` dropped it (found by a black-box
/// tester). A restore moves the store's key epoch on: every key claimed after it is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_after_a_restore_never_takes_the_key_of_one_sent_since_the_backup() {
    let (_rx, ws) = whole_area_workspace().await;
    let v1 = grid(40);
    let v2 = rezone(&v1, &[0], "R-3");
    let backup = ws.path().join("backup.redb");
    let lost_key = {
        let engine = ws.engine();
        ws.write_layer(&layer(&v1));
        run(&engine, false);
        engine.store.backup_to(&backup).expect("backup");
        ws.write_layer(&layer(&v2));
        assert_eq!(run(&engine, false).record.counts.queued, 1);
        engine.store.outbox().expect("outbox")[0].key.clone()
    };
    let store = ws.path().join("zw.redb");
    zonewatch::store::backup::restore(&backup, &store).expect("restore");
    let engine = ws.engine();
    assert_ne!(engine.store.key_scope().epoch, 0);
    assert_eq!(run(&engine, false).record.counts.queued, 1, "the restored store has not seen R-1 → R-3");
    let key = engine.store.outbox().expect("outbox")[0].key.clone();
    assert_ne!(key, lost_key, "the change after the restore has a key of its own");
}

/// A district layer of three 0.01° districts side by side (area mode: no parcel base), the
/// first coded `first`.
fn districts(first: &str) -> String {
    let d = |i: usize, zone: &str| square(&format!("D{i}"), zone, -71.15 + 0.01 * i as f64, 42.35, 0.01);
    layer(&[d(0, first), d(1, "R-2"), d(2, "C-1")])
}

/// A workspace whose source `s1` is a district layer in area mode, watched whole.
async fn area_workspace() -> (zonewatch::receiver::Receiver, Workspace) {
    let rx = receiver(200).await;
    let ws = Workspace::new(&[whole_area(rx.url("/hook"))], "", "layer = \"districts\"\nmin_change_area_m2 = 200\ntolerance_m = 3");
    (rx, ws)
}

/// Area mode keeps the promise parcel layers keep: a district going R-1 → C-2, back and to
/// C-2 again within the key TTL is told three times under three keys (its region is named by
/// its codes and shape, so the third change used to have the first one's key: a
/// `duplicate`, never sent). A silent rollback (a reprocess) undone by the next real run is a
/// duplicate of what the receiver was told; the change after that is news.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_area_that_changes_again_is_told_again() {
    let (rx, ws) = area_workspace().await;
    let engine = ws.engine();
    ws.write_layer(&districts("R-1"));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    for (i, zone) in ["C-2", "R-1", "C-2"].into_iter().enumerate() {
        ws.write_layer(&districts(zone));
        let r = run(&engine, false);
        assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.queued, r.record.counts.duplicates), (Verdict::Run, 1, 1, 0), "change {i}: {}", r.line());
    }
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 3);
    let ids = ids_received(&rx);
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 3, "three changes, three keys: {ids:?}");
    let mut told: Vec<String> =
        rx.received().iter().filter_map(|r| r.json()).map(|j| format!("{} {}→{}", j["data"]["change"], j["data"]["from"], j["data"]["to"])).collect();
    told.sort();
    assert_eq!(told, vec![r#""area_rezoned" "C-2"→"R-1""#, r#""area_rezoned" "R-1"→"C-2""#, r#""area_rezoned" "R-1"→"C-2""#]);

    // A silent rollback, then the real version again: a duplicate of the third change.
    ws.write_layer(&districts("R-1"));
    let rollback = run(&engine, true);
    assert_eq!((rollback.record.counts.changes, rollback.record.counts.suppressed), (1, 1));
    ws.write_layer(&districts("C-2"));
    let back = run(&engine, false);
    assert_eq!((back.record.counts.changes, back.record.counts.queued, back.record.counts.duplicates), (1, 0, 1), "{}", back.line());
    assert_eq!(deliver(&engine, Duration::from_secs(1)).await.attempted, 0);
    assert_eq!(rx.received().len(), 3, "the receiver already believes C-2");

    // C-2 → R-1 for real: news (not the primed rollback's key).
    ws.write_layer(&districts("R-1"));
    assert_eq!(run(&engine, false).record.counts.queued, 1);
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 1);
    assert_eq!(ids_received(&rx).iter().collect::<std::collections::HashSet<_>>().len(), 4);
    let o = outcomes(&engine);
    assert_eq!((o.get("sent"), o.get("duplicate")), (Some(&4), Some(&1)));
    assert!(engine.store.check_consistency().expect("check").is_consistent());
}

/// Held area-mode runs: a released hold's places are the source's from then on (so the flip
/// after two released flips is news), a primed hold's are not (so undoing a primed rollback
/// is a duplicate of what was announced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_area_changes_step_their_places_as_they_are_resolved() {
    let (rx, ws) = area_workspace().await;
    // One district of three changing is a spike: every change below is held.
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 0.2");
    let engine = ws.engine();
    ws.write_layer(&districts("R-1"));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    let resolve = |zone: &str, prime: bool| {
        ws.write_layer(&districts(zone));
        let held = run(&engine, false);
        assert_eq!(held.record.verdict, Verdict::Held, "{}", held.line());
        let r = engine.resolve_hold(held.record.hold_id.expect("a hold"), prime).expect("resolved");
        (r.counts.queued, r.counts.duplicates, r.counts.suppressed)
    };
    assert_eq!(resolve("C-2", false), (1, 0, 0));
    assert_eq!(resolve("R-1", false), (1, 0, 0));
    assert_eq!(resolve("C-2", false), (1, 0, 0), "the third flip is news: the releases moved the place on");
    assert_eq!(resolve("R-1", true), (0, 0, 1), "a primed rollback");
    assert_eq!(resolve("C-2", false), (0, 1, 0), "undone: the receiver was told C-2 already");
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 3);
    assert_eq!(ids_received(&rx).iter().collect::<std::collections::HashSet<_>>().len(), 3);
    // A primed rollback and its undo primed as well, then the place really goes back to
    // R-1: the receiver, last told C-2, is told (it reused the primed rollback's key before:
    // a primed hold's places did not move their revisions).
    assert_eq!(resolve("R-1", true), (0, 0, 1), "a primed rollback");
    let (_, duplicates, suppressed) = resolve("C-2", true);
    assert_eq!(duplicates + suppressed, 1, "its undo, primed");
    assert_eq!(resolve("R-1", false), (1, 0, 0), "then R-1 for real: news");
    assert_eq!(deliver(&engine, Duration::from_secs(5)).await.sent, 1);
    assert_eq!(ids_received(&rx).iter().collect::<std::collections::HashSet<_>>().len(), 4);
    assert!(engine.store.check_consistency().expect("check").is_consistent());
}

/// In area mode a district left out of an export makes its area lose its zoning: an `info`
/// change, alerted only to `info` subscribers, and it counts toward the change spike like
/// any other, so an export missing most of its districts is held (a black-box tester: a
/// half-missing layer sent 129 alerts, a lat/lon-swapped one 263, neither held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_area_layer_missing_a_district_counts_toward_the_spike() {
    let (rx, ws) = area_workspace().await;
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 0.2");
    let engine = ws.engine();
    ws.write_layer(&districts("R-1"));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    let d = |i: usize, zone: &str| square(&format!("D{i}"), zone, -71.15 + 0.01 * i as f64, 42.35, 0.01);
    ws.write_layer(&layer(&[d(0, "R-1"), d(1, "R-2")]));
    let r = run(&engine, false);
    assert_eq!(r.record.verdict, Verdict::Held, "{}", r.line());
    assert!(r.hold_reason.as_deref().is_some_and(|h| h.starts_with("change_spike")), "{:?}", r.hold_reason);
    assert_eq!(deliver(&engine, Duration::from_secs(1)).await.attempted, 0);
    assert!(rx.received().is_empty());
}
