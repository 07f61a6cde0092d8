//! Unit tests of delivery across its files: drains past held backlogs, 410s.

use super::*;

/// A held backlog ahead of a row that may go out: the drain's lease passes stop at their
/// pass-over bound having found nothing, and the drain goes on until it has read past every
/// queued row once, so the row behind is sent. (It used to end the drain there, and each
/// `zonewatch run` after it, which starts from the earliest retry again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_reaches_a_retry_behind_a_held_backlog() {
    drain_past_a_held_backlog(-4).await;
}

/// The same with the row falling due while the drain waits for it: the wait starts a
/// new sweep of the backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_reaches_a_retry_that_falls_due_behind_a_held_backlog_while_it_waits() {
    drain_past_a_held_backlog(1_500).await;
}

/// A disabled endpoint's 8,202 due retries ahead of one of another endpoint, due `b_due`
/// ms from now: a drain sends that one.
async fn drain_past_a_held_backlog(b_due: i64) {
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::notify::matcher::Subscriber;
    use crate::store::{Claim, HealthPolicy, MIN_PASS_OVER};
    let rx = crate::receiver::Receiver::start(Arc::new(|_, _| 200), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let n = 2 * MIN_PASS_OVER + 10;
    let watcher = |i: usize| if i == n { "b" } else { "a" };
    let events: Vec<_> = (0..=n).map(|i| sample_event(&format!("P{i:05}"))).collect();
    let claims: Vec<Claim> = (0..=n)
        .map(|i| Claim { event: i, watcher_id: watcher(i).into(), target: rx.url("/h"), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
        .collect();
    // Queued now (a retry past `max_retry_window` after its event was queued is a dead
    // letter, not a send).
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    store.enqueue(&events, &claims, "l", now - 10, 3_600_000).unwrap();
    // Every row failed once: a's are due 5 ms ago (the first answered 410, which disables
    // a: its rows wait for an operator), b's at `b_due`, behind all of them.
    let failed: Vec<DeliveryResult> = store
        .outbox()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let due = if e.watcher_id == "b" { now.saturating_add_signed(b_due) } else { now - 5 };
            let failed = DeliveryResult::Retry { id: e.id, next_attempt_ms: due, error: "http_503".into() };
            if i == 0 {
                DeliveryResult::Gone { id: e.id, otherwise: Box::new(failed) }
            } else {
                failed
            }
        })
        .collect();
    store.record_outcomes_with(&failed, &[], now - 8, Some(&HealthPolicy::default())).unwrap();
    assert!(store.endpoints().unwrap().iter().any(|(id, e)| id == "a" && e.disabled));
    let sub = |id: &str| Subscriber { id: id.into(), target: rx.url("/h"), secret: None, min_severity: Severity::Info, aoi: geo::MultiPolygon::new(vec![]), secret_old: None };
    let subs = Arc::new(SubscriberIndex::build(vec![sub("a"), sub("b")]));
    let cfg = DeliveryConfig { allow_private_targets: true, ..DeliveryConfig::default() };
    let d = Deliverer::new(store.clone(), subs, cfg).unwrap();
    let stats = d.drain(Instant::now() + Duration::from_secs(20)).await.unwrap();
    assert_eq!((stats.sent, rx.received().len()), (1, 1), "{stats:?}");
    assert_eq!(store.outbox_len().unwrap(), n as u64, "a's rows wait for an operator");
}

/// A row answered 410 waits for an operator past its retry window; once its endpoint is
/// enabled, a send deferred for want of this process's own resources leaves it as it
/// stood, and the next take sends it (reviewer: it was dead-lettered `retry_window_exceeded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_row_whose_send_was_deferred_is_sent_not_dead_lettered() {
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::notify::matcher::Subscriber;
    use crate::store::{Claim, HealthPolicy};
    let rx = crate::receiver::Receiver::start(Arc::new(|_, _| 200), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let cfg = DeliveryConfig { allow_private_targets: true, ..DeliveryConfig::default() };
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let created = now - cfg.max_retry_window.as_millis() as u64 - 60_000;
    let claim = Claim { event: 0, watcher_id: "a".into(), target: rx.url("/h"), min_severity: Severity::Info, key: IdemKey("k".into()) };
    store.enqueue(&[sample_event("P1")], &[claim], "l", created, 30 * 86_400_000).unwrap();
    let id = store.outbox().unwrap()[0].id;
    let gone = DeliveryResult::Gone { id, otherwise: Box::new(DeliveryResult::Retry { id, next_attempt_ms: created + 10, error: HTTP_410.into() }) };
    store.record_outcomes_with(&[gone], &[], created + 5, Some(&HealthPolicy::default())).unwrap();
    assert!(store.enable_endpoint("a", now - 20).unwrap().was_disabled);
    let deferred = DeliveryResult::Deferred { id, next_attempt_ms: now - 5, error: format!("{DEFERRED_PREFIX}Too many open files (os error 24)") };
    store.record_outcomes_with(&[deferred], &[], now - 10, Some(&HealthPolicy::default())).unwrap();
    let sub = Subscriber { id: "a".into(), target: rx.url("/h"), secret: None, min_severity: Severity::Info, aoi: geo::MultiPolygon::new(vec![]), secret_old: None };
    let d = Deliverer::new(store.clone(), Arc::new(SubscriberIndex::build(vec![sub])), cfg).unwrap();
    let stats = d.drain(Instant::now() + Duration::from_secs(20)).await.unwrap();
    assert_eq!((stats.sent, stats.dead, rx.received().len()), (1, 0, 1), "{stats:?}");
}

/// A config subscriber hiding a stored one of the same id, whose target answers 410: the
/// store takes that 410 as not its endpoint's (the stored target differs), so the endpoint
/// is not disabled, and each such 410 is the failure it otherwise is, on the retry
/// schedule and dead-lettered past `max_attempts` (a reviewer: they were resent at once,
/// without end, until the breaker opened, and then for days).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_not_from_its_stored_target_is_an_ordinary_failure() {
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::notify::matcher::Subscriber;
    use crate::store::{Claim, StoredSubscriber};
    let rx = crate::receiver::Receiver::start(Arc::new(|_, _| 410), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let stored = StoredSubscriber { id: "a".into(), target: "https://stored.example/h".into(), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: now - 20, updated_ms: now - 20, secret_old: None };
    store.put_subscriber(&stored, now - 20).unwrap();
    let claim = Claim { event: 0, watcher_id: "a".into(), target: rx.url("/h"), min_severity: Severity::Info, key: IdemKey("k".into()) };
    store.enqueue(&[sample_event("P1")], &[claim], "l", now - 10, 3_600_000).unwrap();
    let sub = Subscriber { id: "a".into(), target: rx.url("/h"), secret: None, min_severity: Severity::Info, aoi: geo::MultiPolygon::new(vec![]), secret_old: None };
    let cfg = DeliveryConfig {
        allow_private_targets: true,
        max_attempts: 3,
        retry_schedule: vec![Duration::from_millis(10), Duration::from_millis(20)],
        retry_jitter: 0.0,
        ..DeliveryConfig::default()
    };
    let d = Deliverer::new(store.clone(), Arc::new(SubscriberIndex::build(vec![sub])), cfg).unwrap();
    let stats = d.drain(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(rx.received().len(), 3, "max_attempts sends, not one after another without end");
    let dead = store.dead_letters().unwrap();
    assert_eq!(dead.iter().map(|d| d.reason.as_str()).collect::<Vec<_>>(), vec!["retries_exhausted"]);
    // Counted and logged as the failures they were, not as gones (no endpoint disabled).
    assert_eq!((stats.gone, stats.retried, stats.dead), (0, 2, 1), "{stats:?}");
    let log: Vec<(String, Option<String>)> = store.attempts("k").unwrap().into_iter().map(|a| (a.result, a.error)).collect();
    let retry = ("retry".to_string(), Some(HTTP_410.to_string()));
    assert_eq!(log, vec![retry.clone(), retry, ("dead_letter".to_string(), Some(format!("{HTTP_410}; retries_exhausted")))]);
    assert!(!store.endpoints().unwrap().iter().any(|(id, e)| id == "a" && e.disabled), "not disabled for the stored target");
}

/// A 410 from the old target answered to a send in flight during a `PUT` (here: a
/// deliverer whose index still has it) is a failure, and the row goes on to the new
/// target; when the new target, the stored subscriber's own, answers 410 too, that one
/// disables the endpoint and the row waits for an operator (a reviewer: with a marker on
/// the row, that second 410 was taken as an ordinary failure and dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_from_the_new_target_after_one_from_the_old_disables_the_endpoint() {
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::notify::matcher::Subscriber;
    use crate::store::{Claim, StoredSubscriber};
    let old = crate::receiver::Receiver::start(Arc::new(|_, _| 410), None).await.unwrap();
    let new = crate::receiver::Receiver::start(Arc::new(|_, _| 410), None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let stored = StoredSubscriber { id: "a".into(), target: new.url("/h"), secret: None, min_severity: Severity::Info, aoi_geojson: "{}".into(), created_ms: now - 20, updated_ms: now - 20, secret_old: None };
    store.put_subscriber(&stored, now - 20).unwrap();
    let claim = Claim { event: 0, watcher_id: "a".into(), target: old.url("/h"), min_severity: Severity::Info, key: IdemKey("k".into()) };
    store.enqueue(&[sample_event("P1")], &[claim], "l", now - 10, 3_600_000).unwrap();
    let cfg = DeliveryConfig { allow_private_targets: true, max_attempts: 3, retry_schedule: vec![Duration::from_millis(1)], retry_jitter: 0.0, ..DeliveryConfig::default() };
    let deliverer = |target: String| {
        let sub = Subscriber { id: "a".into(), target, secret: None, min_severity: Severity::Info, aoi: geo::MultiPolygon::new(vec![]), secret_old: None };
        Deliverer::new(store.clone(), Arc::new(SubscriberIndex::build(vec![sub])), cfg.clone()).unwrap()
    };
    deliverer(old.url("/h")).deliver_due().await.unwrap();
    assert_eq!(old.received().len(), 1);
    assert!(!store.endpoints().unwrap().iter().any(|(id, e)| id == "a" && e.disabled), "not disabled for the old target's 410");
    tokio::time::sleep(Duration::from_millis(5)).await;
    deliverer(new.url("/h")).deliver_due().await.unwrap();
    assert_eq!(new.received().len(), 1);
    assert!(store.endpoints().unwrap().iter().any(|(id, e)| id == "a" && e.disabled), "the new target's 410 disables it");
    assert_eq!((store.outbox_len().unwrap(), store.dead_letters().unwrap().len()), (1, 0), "the row waits for an operator");
}
