//! Tests of delivery against what changes while a send is in flight: a subscriber moved to a
//! new target, an endpoint that answers 410 to a replay. Each started as a reviewer's scratch
//! test that showed the defect; they now check the fix.

use crate::clock::{Clock, SystemClock};
use crate::config::DeliveryConfig;
use crate::model::{sample_event, ChangeEvent, IdemKey, Outcome, Severity, StoredGeometry};
use crate::notify::delivery::Deliverer;
use crate::notify::matcher::{Subscriber, SubscriberIndex};
use crate::receiver::{Receiver, Reply};
use crate::store::{Claim, Store, StoredSubscriber};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn sub(target: String) -> Subscriber {
    Subscriber { id: "w".into(), target, secret: None, min_severity: Severity::Info, aoi: geo::MultiPolygon::new(vec![]), secret_old: None }
}

fn stored(target: String, now: u64) -> StoredSubscriber {
    StoredSubscriber { id: "w".into(), target, secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: now, updated_ms: now, secret_old: None }
}

/// Queues `n` events for subscriber `w`, keys `{prefix}{i}`.
fn enqueue(store: &Store, prefix: &str, n: usize, now: u64) {
    // With a parcel's shape: a replay checks the geometry it sends.
    let lot = vec![[0.0, 0.0], [0.001, 0.0], [0.001, 0.001], [0.0, 0.001], [0.0, 0.0]];
    let events: Vec<_> = (0..n)
        .map(|i| ChangeEvent { new_geometry: Some(StoredGeometry(vec![vec![lot.clone()]])), ..sample_event(&format!("{prefix}{i}")) })
        .collect();
    let claims: Vec<Claim> = (0..n)
        .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/queued".into(), min_severity: Severity::Info, key: IdemKey(format!("{prefix}{i}")) })
        .collect();
    store.enqueue(&events, &claims, "l", now, 7 * 86_400_000).expect("enqueue");
}

fn cfg() -> DeliveryConfig {
    DeliveryConfig { allow_private_targets: true, ..DeliveryConfig::default() }
}

/// The operator moves a subscriber to a new URL (`PUT /v1/subscribers/w`) while a request to
/// the old URL is in flight, and the old URL answers 410. That 410 is the old URL's: it must
/// not disable the endpoint, which now points at the new, healthy URL (before the fix it did,
/// and every event waited for `endpoints enable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_410_from_the_old_target_leaves_the_new_target_enabled() {
    let old = Receiver::start_replies(Arc::new(|_, _| Reply { status: 410, delay: Duration::from_millis(600), ..Default::default() }), None).await.unwrap();
    let new = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let now = SystemClock.now_ms();
    store.put_subscriber(&stored(old.url("/h"), now), now).unwrap();
    let subs = Arc::new(SubscriberIndex::build(vec![sub(old.url("/h"))]));
    enqueue(&store, "k", 1, now);
    let d = Deliverer::new(store.clone(), subs.clone(), cfg()).unwrap();
    let pump = tokio::spawn({
        let d = d.clone();
        async move { d.pump().await }
    });
    while old.received().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What `SubscriberEdit::put` does: the store first, then the live index. The edit's time
    // does not matter (the route takes it before it waits for the store's write lock, so it
    // can be earlier than the attempt's start): the target the attempt used is compared.
    let edited = SystemClock.now_ms() - 60_000;
    let put = store.put_subscriber(&stored(new.url("/h"), edited), edited).unwrap();
    assert!(!put.re_enabled, "not disabled yet when the PUT commits");
    subs.edit().upsert(sub(new.url("/h")));
    pump.await.unwrap().unwrap();
    let eps = store.endpoints().unwrap();
    assert!(!eps.iter().any(|(_, e)| e.disabled), "the old URL's 410 did not disable the new one: {eps:?}");
    // The event goes to the new URL, and no `endpoint_disabled` row was written.
    d.drain(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(new.received().len(), 1, "the new URL got the event");
    assert_eq!(store.outbox_len().unwrap(), 0);
    let rows = store.audit(&Default::default()).unwrap();
    assert!(!rows.iter().any(|r| r.outcome == Outcome::EndpointDisabled), "{rows:?}");
    assert_eq!(rows.iter().filter(|r| r.outcome == Outcome::Sent).count(), 1);

    // An attempt that began after the edit is the endpoint's own: its 410 disables it.
    let gone_now = Receiver::start_status(410).await.unwrap();
    let t = SystemClock.now_ms();
    store.put_subscriber(&stored(gone_now.url("/h"), t), t).unwrap();
    subs.edit().upsert(sub(gone_now.url("/h")));
    tokio::time::sleep(Duration::from_millis(5)).await;
    enqueue(&store, "m", 1, SystemClock.now_ms());
    d.pump().await.unwrap();
    assert!(store.endpoints().unwrap().iter().any(|(_, e)| e.disabled), "a 410 of the current target disables it");
}

/// `n` dead letters of subscriber `w` (its receiver answered 400), with the receiver (whose
/// answer `status` sets from then on), the store (in its folder) and a deliverer with one
/// slot per endpoint. Ten 400s open the endpoint's breaker, so a breaker's cooldown of 50 ms
/// lets the drain reach all `n` (with the default minute, the rows the pump had not sent
/// before the commit that opened it waited out the drain's deadline: 15–19 of 20 dead
/// letters in 3 of 24 loaded runs).
async fn with_dead_letters(n: usize) -> (Receiver, Arc<AtomicU16>, tempfile::TempDir, Arc<Store>, Deliverer, Vec<crate::model::DeadLetter>) {
    let status = Arc::new(AtomicU16::new(400));
    let s = status.clone();
    let rx = Receiver::start_replies(Arc::new(move |_, _| Reply::status(s.load(Ordering::SeqCst))), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let subs = Arc::new(SubscriberIndex::build(vec![sub(rx.url("/h"))]));
    let d = Deliverer::new(store.clone(), subs, DeliveryConfig { endpoint_concurrency: 1, breaker_cooldown: Duration::from_millis(50), ..cfg() }).unwrap();
    enqueue(&store, "dead", n, SystemClock.now_ms());
    d.drain(Instant::now() + Duration::from_secs(5)).await.unwrap();
    let letters = store.dead_letters().unwrap();
    assert_eq!(letters.len(), n);
    (rx, status, dir, store, d, letters)
}

/// `dlq replay` delivers each replayed row as `serve` does: an endpoint that answers 410
/// gets one request (its endpoint concurrency), not one per due row of its backlog (the
/// one-pass `deliver_due` it used sent every row it had leased: 21 here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_stops_sending_to_an_endpoint_that_answers_410() {
    // One dead letter (400 is not retried) ...
    let (rx, status, _dir, store, d, letters) = with_dead_letters(1).await;
    // ... then the receiver is gone, with 20 rows of a backlog due.
    status.store(410, Ordering::SeqCst);
    enqueue(&store, "due", 20, SystemClock.now_ms());
    let before = rx.received().len();
    let report = crate::notify::replay::replay(&store, &d, letters, 100.0, 3, Instant::now()).await.unwrap();
    assert_eq!(report.requeued, 1, "{report:?}");
    let sent_to_gone = rx.received().len() - before;
    assert_eq!(sent_to_gone, 1, "one request, then the 410 closed the endpoint's gate: {report:?}");
    assert!(store.endpoints().unwrap().iter().any(|(_, e)| e.disabled));
    assert_eq!(store.outbox_len().unwrap(), 21, "the rest wait for `endpoints enable`");
}

/// After an endpoint answers 410 in the middle of a replay, its other letters are requeued
/// (they wait in the outbox for `endpoints enable`, as before) without waiting for tokens:
/// at one token per 1,000 s the 19 letters behind the first took 19,000 s (bb28: a large
/// replay took its whole time and sent nothing). The 410 still gets one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_does_not_pace_the_letters_of_an_endpoint_it_found_disabled() {
    let (rx, status, _dir, store, d, letters) = with_dead_letters(20).await;
    // Twenty 400s opened the breaker: closed again, as an operator's enable does.
    store.enable_endpoint("w", SystemClock.now_ms()).unwrap();
    status.store(410, Ordering::SeqCst);
    let before = rx.received().len();
    let replay = crate::notify::replay::replay(&store, &d, letters, 0.001, 3, Instant::now());
    let report = tokio::time::timeout(Duration::from_secs(30), replay).await.expect("the replay finishes").unwrap();
    assert_eq!((report.requeued, rx.received().len() - before), (20, 1), "{report:?}");
    assert!(store.dead_letters().unwrap().is_empty());
    assert_eq!(store.outbox_len().unwrap(), 20, "they wait for `endpoints enable`");
}

/// Letters of one change to a live and a disabled endpoint come in turn (oldest observation
/// first): the disabled one's are requeued inside the batch, which goes on, so the live
/// letters whose tokens are there go out in one pass (a reviewer: ending the batch at each
/// disabled letter made a pass, a send and a durable commit, per live letter again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_keeps_its_batch_when_a_disabled_endpoints_letters_come_between() {
    use crate::store::{DeadCause, DeliveryResult, HealthPolicy};
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let now = SystemClock.now_ms();
    let lot = vec![[0.0, 0.0], [0.001, 0.0], [0.001, 0.001], [0.0, 0.001], [0.0, 0.0]];
    let events: Vec<_> = (0..21).map(|i| ChangeEvent { new_geometry: Some(StoredGeometry(vec![vec![lot.clone()]])), ..sample_event(&format!("P{i}")) }).collect();
    let claims: Vec<Claim> = (0..20)
        .flat_map(|i| ["w", "x"].map(|w| Claim { event: i, watcher_id: w.into(), target: rx.url("/h"), min_severity: Severity::Info, key: IdemKey(format!("{w}{i}")) }))
        .chain([Claim { event: 20, watcher_id: "x".into(), target: rx.url("/h"), min_severity: Severity::Info, key: IdemKey("gone".into()) }])
        .collect();
    store.enqueue(&events, &claims, "l", now, 7 * 86_400_000).unwrap();
    // Forty dead letters, in turn w, x, w, x, …; and x disabled by a 410.
    let rows = store.outbox().unwrap();
    let gone = rows.iter().find(|e| e.key.0 == "gone").map(|e| e.id).unwrap();
    let mut results: Vec<DeliveryResult> = rows.iter().filter(|e| e.id != gone).map(|e| DeliveryResult::Dead { id: e.id, reason: "retries_exhausted".into(), cause: DeadCause::NotSent }).collect();
    results.push(DeliveryResult::Gone { id: gone, otherwise: Box::new(DeliveryResult::Retry { id: gone, next_attempt_ms: now + 60_000, error: "http_410".into() }) });
    store.record_outcomes_with(&results, &[], now, Some(&HealthPolicy::default())).unwrap();
    assert_eq!(store.disabled_endpoints().unwrap().into_iter().collect::<Vec<_>>(), ["x"]);
    let letters = store.dead_letters().unwrap();
    assert_eq!(letters.len(), 40);
    let subs = Arc::new(SubscriberIndex::build(["w", "x"].map(|id| Subscriber { id: id.into(), ..sub(rx.url("/h")) }).to_vec()));
    let d = Deliverer::new(store.clone(), subs, cfg()).unwrap();
    let report = crate::notify::replay::replay(&store, &d, letters, 1_000.0, 3, Instant::now()).await.unwrap();
    assert_eq!((report.requeued, report.delivery.sent, rx.received().len()), (40, 20, 20), "{report:?}");
    assert!(report.delivery.commits <= 3, "the twenty live letters went out together, not a pass each: {report:?}");
    assert_eq!(store.outbox_len().unwrap(), 21, "x's wait for `endpoints enable`");
}

/// A wall clock stepped forward past a lease while its request is in flight (a VM resumed,
/// NTP correcting a wrong clock at boot) must not let the same pump take the row over and
/// send it again: one request, one `sent` (before the fix: two requests, the second outcome
/// dropped as already resolved, and `sent=2` in the pass counts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_step_does_not_send_an_in_flight_row_again() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, delay: Duration::from_millis(1500), ..Default::default() }), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let clock = crate::clock::ManualClock::at(1_800_000_000_000);
    enqueue(&store, "k", 1, clock.now_ms());
    let subs = Arc::new(SubscriberIndex::build(vec![sub(rx.url("/h"))]));
    let d = Deliverer::new(store.clone(), subs, DeliveryConfig { timeout: Duration::from_secs(5), ..cfg() }).unwrap().with_clock(clock.clone());
    let pump = tokio::spawn({
        let d = d.clone();
        async move { d.pump().await }
    });
    while rx.received().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clock.step_forward(Duration::from_secs(6 * 3600));
    let stats = pump.await.unwrap().unwrap();
    assert_eq!(rx.received().len(), 1, "one row, one request: {stats:?}");
    assert_eq!(stats.sent, 1);
    let sent = store.audit(&Default::default()).unwrap().into_iter().filter(|a| a.outcome == Outcome::Sent).count();
    assert_eq!(sent, 1);
}
