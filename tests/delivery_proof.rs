//! Delivery behaviour against real loopback endpoints that misbehave in the known ways:
//! flapping, slow past the timeout, 410, 429 with `Retry-After`; the per-attempt log; leases
//! and the fresh-ahead-of-retries split; dead-letter replay under the original key (absorbed
//! by the receiver as a duplicate when it had in fact arrived), `max_replays` → quarantine,
//! and `dlq recover`, driven through the real `zonewatch` binary.

mod common;
use common::*;
use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use zonewatch::receiver::{Receiver, Reply};

fn area() -> serde_json::Value {
    rect(-71.2, 42.3, -71.0, 42.5)
}

/// A workspace with one subscriber at `url`, a fast retry schedule and `extra` delivery keys.
fn ws_for(url: String, extra: &str) -> Workspace {
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: area(), target: url, min_severity: "info", secret: None }],
        &format!("retry_schedule = [\"50ms\", \"50ms\", \"50ms\", \"50ms\"]\n{extra}"),
        "",
    );
    ws.edit_config("max_attempts = 3", "max_attempts = 5");
    ws
}

/// Baseline, then rezone parcels `ids`: queues one event per id (with one subscriber).
fn queue(ws: &Workspace, engine: &zonewatch::pipeline::Engine, ids: &[usize]) {
    assert_eq!(rezone(ws, engine, ids), ids.len() as u64);
}

/// Baseline, then rezone parcels `ids` of a grid of 30 (of twice the ids past it, so that
/// the change stays under the spike hold's ratio); returns how many events the second run
/// queued.
fn rezone(ws: &Workspace, engine: &zonewatch::pipeline::Engine, ids: &[usize]) -> u64 {
    let v1 = grid(ids.iter().max().map_or(30, |&m| if m < 30 { 30 } else { 2 * (m + 1) }));
    ws.write_layer(&layer(&v1));
    run(engine, false);
    let mut v2 = v1.clone();
    for &i in ids {
        v2[i].zone = "C3".into();
    }
    ws.write_layer(&layer(&v2));
    run(engine, false).record.counts.queued
}

fn zonewatch(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(args).output().expect("zonewatch runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_endpoint_gets_everything_and_every_attempt_is_logged() {
    // 503, 200, 503, 200, ...
    let rx = Receiver::start_replies(
        Arc::new(|n, _| if n % 2 == 0 { Reply { status: 503, body: "busy".into(), ..Default::default() } } else { Reply { status: 200, body: "ok".into(), ..Default::default() } }),
        None,
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    ws.edit_config("concurrency = 4", "concurrency = 1");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8]);
    let stats = deliver(&engine, Duration::from_secs(10)).await;
    assert_eq!((stats.sent, stats.dead), (3, 0), "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    let keys: BTreeSet<String> = rx.received().iter().filter_map(|r| r.header("webhook-id").map(String::from)).collect();
    assert_eq!(keys.len(), 3);
    let mut logged = 0;
    for k in &keys {
        let attempts = engine.store.attempts(k).unwrap();
        assert!(!attempts.is_empty());
        let last = attempts.last().unwrap();
        assert_eq!((last.result.as_str(), last.status, last.response_head.as_str()), ("sent", Some(200), "ok"));
        for a in &attempts[..attempts.len() - 1] {
            assert_eq!((a.result.as_str(), a.status, a.response_head.as_str()), ("retry", Some(503), "busy"));
            assert!(a.next_attempt_ms.is_some());
        }
        for (i, a) in attempts.iter().enumerate() {
            assert_eq!(a.attempt as usize, i + 1);
        }
        logged += attempts.len();
    }
    assert_eq!(logged, rx.received().len(), "one log row per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_head_is_cut_at_2_kib() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 500, body: "x".repeat(5000), ..Default::default() }), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    deliver(&engine, Duration::from_secs(5)).await;
    let key = rx.received()[0].header("webhook-id").unwrap().to_string();
    let attempts = engine.store.attempts(&key).unwrap();
    assert_eq!(attempts.len(), 5, "max_attempts = 5");
    assert!(attempts.iter().all(|a| a.response_head.len() == 2048 && a.status == Some(500)));
    assert_eq!(attempts.last().unwrap().result, "dead_letter");
    assert_eq!(engine.store.dead_letters().unwrap()[0].reason, "retries_exhausted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_429_with_retry_after_2_waits_at_least_2s() {
    let rx = Receiver::start_replies(
        Arc::new(|n, _| {
            if n == 0 {
                Reply { status: 429, headers: vec![("Retry-After".into(), "2".into())], ..Default::default() }
            } else {
                Reply::status(200)
            }
        }),
        None,
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_secs(10)).await;
    assert_eq!((stats.sent, stats.retried), (1, 1));
    let key = rx.received()[0].header("webhook-id").unwrap().to_string();
    let a = engine.store.attempts(&key).unwrap();
    assert_eq!(a[0].status, Some(429));
    // The schedule says 50 ms; Retry-After: 2 is the floor.
    let scheduled = a[0].next_attempt_ms.unwrap();
    assert!(scheduled >= a[0].ts_ms + 2000, "next try scheduled {} ms after the 429", scheduled - a[0].ts_ms);
    assert!(a[1].ts_ms >= scheduled, "the retry did not go out before Retry-After");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_410_disables_the_endpoint_and_its_events_wait_for_enable() {
    let back = Arc::new(AtomicBool::new(false));
    let b = back.clone();
    // The 410 asks for an hour's wait: the events still go out as soon as the endpoint is
    // enabled (a disabled endpoint holds them; no backoff is added on top).
    let rx = Receiver::start_replies(
        Arc::new(move |_, _| {
            if b.load(Ordering::SeqCst) {
                Reply::status(200)
            } else {
                Reply { status: 410, headers: vec![("Retry-After".into(), "3600".into())], ..Default::default() }
            }
        }),
        None,
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4]);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    // Both rows go out at once; a row whose send had not begun when the first 410 came back
    // is not sent (`a_410_stops_the_sends_of_rows_already_leased`).
    let asked = rx.received().len() as u64;
    assert_eq!((stats.sent, stats.dead, stats.retried, stats.gone), (0, 0, 0, asked), "a 410 is counted as gone, not retried: {stats:?}");
    assert!((1..=2).contains(&asked), "no further tries once the endpoint is gone: {asked}");
    assert_eq!(engine.store.outbox_len().unwrap(), 2, "events wait, they are not dropped");
    let eps = engine.store.endpoints().unwrap();
    assert_eq!(eps.len(), 1);
    assert!(eps[0].1.disabled && eps[0].1.disabled_reason.as_deref() == Some("http_410_gone"), "{eps:?}");
    drop(engine);
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    let (ok, out, _) = zonewatch(&["endpoints", "list", "--config", cfg]);
    assert!(ok && out.contains("w\tdisabled\t") && out.contains("http_410_gone"), "{out}");
    // `run` and `check --store` say what waits and how it goes out (a tester fixed the
    // config's target and waited without a word).
    let (ok, out, err) = zonewatch(&["run", "--config", cfg]);
    assert!(ok && out.contains("outbox_remaining=2"), "{out}{err}");
    assert!(err.contains("note: 2 alert(s) wait for disabled endpoint(s): w (2 alert(s); disabled since ") && err.contains(": http_410_gone)") && err.contains("zonewatch endpoints enable ID"), "{err}");
    let (_, out, _) = zonewatch(&["check", "--config", cfg, "--store"]);
    assert!(out.contains("warning: store ") && out.contains("2 alert(s) wait for disabled endpoint(s): w (2 alert(s)"), "{out}");
    back.store(true, Ordering::SeqCst);
    let (ok, out, err) = zonewatch(&["endpoints", "enable", "w", "--config", cfg]);
    assert!(ok && out.contains("enabled"), "{out}{err}");
    let engine = ws.engine();
    assert!(!engine.store.endpoints().unwrap()[0].1.disabled);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(stats.sent, 2, "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    let o = outcomes(&engine);
    assert_eq!((o.get("endpoint_disabled"), o.get("endpoint_enabled"), o.get("sent")), (Some(&1), Some(&1), Some(&2)));
}

/// A config subscriber's endpoint disabled by a 410, its `target` then changed in the config
/// file: the next `run` enables it (audited, saying the target changed) and its alerts go to
/// the new target (a tester fixed the URL and its alerts waited; only `endpoints enable` or
/// a control-port `PUT` enabled one). The old target kept in the config keeps it disabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_target_in_the_config_enables_an_endpoint_disabled_for_the_old_one() {
    let old = Receiver::start_replies(Arc::new(|_, _| Reply::status(410)), None).await.unwrap();
    let new = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.unwrap();
    let ws = ws_for(old.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4]);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert!(stats.gone >= 1 && engine.store.endpoints().unwrap()[0].1.disabled, "{stats:?}");
    drop(engine);
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    // The same target: still disabled, nothing sent.
    let (ok, out, err) = zonewatch(&["run", "--config", cfg]);
    assert!(ok && out.contains("outbox_remaining=2"), "{out}{err}");
    ws.edit_config(&old.url("/hook"), &new.url("/hook"));
    let (ok, out, err) = zonewatch(&["run", "--config", cfg]);
    assert!(ok && out.contains("sent=2") && out.contains("outbox_remaining=0"), "{out}{err}");
    assert_eq!(new.received().len(), 2);
    let engine = ws.engine();
    assert!(!engine.store.endpoints().unwrap()[0].1.disabled);
    let enabled: Vec<_> = engine.store.audit(&Default::default()).unwrap().into_iter().filter(|r| r.outcome == zonewatch::model::Outcome::EndpointEnabled).collect();
    assert_eq!(enabled.len(), 1, "{enabled:?}");
    assert!(enabled[0].detail.contains("target changed in the config"), "{}", enabled[0].detail);
    let report = engine.store.check_consistency().unwrap();
    assert!(report.is_consistent(), "{:?}", report.problems);
}

/// A 410 stops the sends of its endpoint's rows already leased (a pump leases up to the
/// endpoint's share of the window ahead of its slots): with one slot and 60 rows, the
/// receiver that said it is gone is asked once. Every row stays queued (none dead, none
/// lost, no lease kept), and all go out once the endpoint is enabled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_stops_the_sends_of_rows_already_leased() {
    let back = Arc::new(AtomicBool::new(false));
    let b = back.clone();
    let rx = Receiver::start_replies(Arc::new(move |_, _| Reply::status(if b.load(Ordering::SeqCst) { 200 } else { 410 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_concurrency = 1");
    let engine = ws.engine();
    let ids: Vec<usize> = (0..60).collect();
    queue(&ws, &engine, &ids);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(rx.received().len(), 1, "one request to the endpoint that said it is gone: {stats:?}");
    assert_eq!((stats.sent, stats.dead, stats.gone), (0, 0, 1), "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 60, "every row waits");
    assert_eq!(engine.store.leased_len().unwrap(), 0, "a row not sent keeps no lease");
    let report = engine.store.check_consistency().unwrap();
    assert!(report.is_consistent(), "{:?}", report.problems);
    back.store(true, Ordering::SeqCst);
    engine.store.enable_endpoint("w", engine.now()).unwrap();
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(stats.sent, 60, "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    assert_eq!(rx.received().len(), 61);
}

/// A circuit breaker that opens stops the sends of its endpoint's rows already leased: with
/// one slot and 60 rows of an endpoint answering 500 (20 ms late), the breaker opens after 10
/// failures and the rows still leased are not sent (no attempt of theirs used up): they wait,
/// queued and unleased, for the breaker's probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opening_breaker_stops_the_sends_of_rows_already_leased() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 500, delay: Duration::from_millis(20), ..Default::default() }), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_concurrency = 1\nbreaker_cooldown = \"1h\"");
    let engine = ws.engine();
    let ids: Vec<usize> = (0..60).collect();
    queue(&ws, &engine, &ids);
    let stats = deliver(&engine, Duration::from_secs(3)).await;
    let asked = rx.received().len();
    assert!((10..30).contains(&asked), "the breaker opens after 10 failures; {asked} requests: {stats:?}");
    assert_eq!(stats.dead, 0, "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 60, "every row waits");
    assert_eq!(engine.store.leased_len().unwrap(), 0, "a row not sent keeps no lease");
    let eps = engine.store.endpoints().unwrap();
    assert!(eps[0].1.breaker_open_until_ms.is_some_and(|t| t > engine.now()), "{eps:?}");
    let report = engine.store.check_consistency().unwrap();
    assert!(report.is_consistent(), "{:?}", report.problems);
}

/// A 410 on the last attempt the schedule allows still disables the endpoint, and the event
/// waits for an operator, also past `max_retry_window`: a Gone is never a dead letter on its
/// own account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_on_the_last_allowed_attempt_disables_the_endpoint_and_the_event_waits() {
    let back = Arc::new(AtomicBool::new(false));
    let b = back.clone();
    // 500 four times (attempts 1-4 of 5), then 410 until the endpoint is back.
    let rx = Receiver::start_replies(Arc::new(move |n, _| Reply::status(if b.load(Ordering::SeqCst) { 200 } else if n < 4 { 500 } else { 410 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "max_retry_window = \"1s\"");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dead, stats.retried, stats.gone), (0, 0, 4, 1), "{stats:?}");
    assert_eq!(rx.received().len(), 5);
    assert_eq!(engine.store.outbox_len().unwrap(), 1, "the event waits");
    let eps = engine.store.endpoints().unwrap();
    assert!(eps[0].1.disabled && eps[0].1.disabled_reason.as_deref() == Some("http_410_gone"), "{eps:?}");
    // Past the retry window, an operator enables the endpoint: the event goes out.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    back.store(true, Ordering::SeqCst);
    engine.store.enable_endpoint("w", engine.now()).unwrap();
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dead), (1, 0), "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
}

/// A retry taken after `max_retry_window` (it waited on an open breaker, a daemon that was
/// down, a `run` cadence) is dead-lettered `retry_window_exceeded` when it is taken, never
/// sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_taken_past_max_retry_window_is_dead_lettered_not_sent() {
    let rx = Receiver::start_replies(Arc::new(|n, _| Reply::status(if n == 0 { 500 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "max_retry_window = \"10s\"");
    let clock = zonewatch::clock::ManualClock::at(1_800_000_000_000);
    let engine = ws.engine_at(clock.clone());
    queue(&ws, &engine, &[0]);
    // The first try fails; its retry falls due 50 ms later on a clock that does not move.
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!((stats.sent, stats.retried), (0, 1), "{stats:?}");
    clock.advance(Duration::from_secs(20));
    let stats = deliver(&engine, Duration::from_secs(2)).await;
    assert_eq!((stats.sent, stats.dead), (0, 1), "{stats:?}");
    assert_eq!(rx.received().len(), 1, "the retry past the window is not sent");
    let dead = engine.store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "retry_window_exceeded");
}

/// A retry scheduled while the wall clock ran an hour ahead goes out after what was left of
/// its wait once the clock is put right (NTP stepping it back), not an hour later: the
/// deliverer moves the stored due times back by the step before its pass (`store::clock_step`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_scheduled_before_the_clock_stepped_back_keeps_its_wait() {
    let rx = Receiver::start_replies(Arc::new(|n, _| Reply::status(if n == 0 { 503 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    let right: u64 = 1_800_000_000_000;
    let clock = zonewatch::clock::ManualClock::at(right + 3_600_000);
    let engine = ws.engine_at(clock.clone());
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!((stats.sent, stats.retried), (0, 1), "{stats:?}");
    // The clock is stepped back an hour. The pass moves the retry to "now + what was left";
    // the clock (a manual one) stands still, so it is not due yet.
    clock.set(right);
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!(stats.attempted, 0, "{stats:?}");
    let due = engine.store.outbox().unwrap()[0].next_attempt_ms;
    assert!(due > right && due <= right + 1_000, "due {} ms after the corrected clock", due as i64 - right as i64);
    clock.advance(Duration::from_secs(1));
    let stats = deliver(&engine, Duration::from_secs(2)).await;
    assert_eq!(stats.sent, 1, "the retry went out a second after the step, not an hour: {stats:?}");
    assert_eq!(rx.received().len(), 2);
}

/// A wall clock put right years forward (an edge box without a real-time clock, NTP catching
/// up after boot) is not time an alert waited nor time its endpoint failed: the retry queued
/// before the step goes out after it, the endpoint stays enabled, and a process opened after
/// the step knows it too (`store::clock_forward`; before, the retry was dead-lettered
/// `retry_window_exceeded` unsent and the endpoint disabled by `disable_after`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_forward_years_neither_dead_letters_nor_disables() {
    let rx = Receiver::start_replies(Arc::new(|n, _| Reply::status(if n < 2 { 503 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "max_retry_window = \"1h\"\ndisable_after = \"10m\"");
    let clock = zonewatch::clock::ManualClock::at(1_000_000_000_000);
    let engine = ws.engine_at(clock.clone());
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!((stats.sent, stats.retried), (0, 1), "{stats:?}");
    clock.step_forward(Duration::from_secs(10 * 365 * 86_400));
    clock.advance(Duration::from_secs(1));
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!((stats.attempted, stats.retried, stats.dead), (1, 1, 0), "the retry after the step is sent: {stats:?}");
    assert!(engine.store.endpoints().unwrap().iter().all(|(_, e)| !e.disabled), "the endpoint failed for a second, not ten years");
    drop(engine);
    let engine = ws.engine_at(clock.clone());
    clock.advance(Duration::from_secs(1));
    let stats = deliver(&engine, Duration::from_secs(2)).await;
    assert_eq!((stats.sent, stats.dead), (1, 0), "a process opened after the step knows it: {stats:?}");
    assert_eq!(rx.received().len(), 3);
    assert!(engine.store.dead_letters().unwrap().is_empty());
}

/// A step forward taken while a `run` ingests, after it queued its alerts and before its
/// delivery looked at the clock, is seen all the same: the engine looks as it opens the store
/// (a reviewer: the first look was the delivery's, after the step, and the failed first send
/// was dead-lettered `retry_window_exceeded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_forward_during_a_runs_ingest_is_seen_by_its_delivery() {
    let rx = Receiver::start_replies(Arc::new(|n, _| Reply::status(if n == 0 { 503 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "max_retry_window = \"1h\"");
    let clock = zonewatch::clock::ManualClock::at(1_000_000_000_000);
    let engine = ws.engine_at(clock.clone());
    queue(&ws, &engine, &[0]);
    clock.step_forward(Duration::from_secs(10 * 365 * 86_400));
    let stats = deliver(&engine, Duration::from_millis(300)).await;
    assert_eq!((stats.retried, stats.dead), (1, 0), "the failed first send is retried: {stats:?}");
    clock.advance(Duration::from_secs(1));
    let stats = deliver(&engine, Duration::from_secs(2)).await;
    assert_eq!((stats.sent, stats.dead), (1, 0), "{stats:?}");
    assert_eq!(rx.received().len(), 2);
}

/// A drain whose clock steps forward under it goes on waiting for the retries scheduled after
/// the step (bb29: its deadline on the wall clock was read once, before the step, and every
/// retry scheduled after it fell past that: `run` ended with the alerts queued).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_goes_on_after_the_clock_steps_forward_under_it() {
    let clock = zonewatch::clock::ManualClock::at(1_000_000_000_000);
    // The step comes while the first request is out (taken by the receiver as it answers).
    let stepped = clock.clone();
    let rx = Receiver::start_replies(
        Arc::new(move |n, _| {
            if n == 0 {
                stepped.step_forward(Duration::from_secs(10 * 365 * 86_400));
                Reply::status(503)
            } else {
                Reply::status(200)
            }
        }),
        None,
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "max_retry_window = \"1h\"");
    let engine = ws.engine_at(clock.clone());
    queue(&ws, &engine, &[0]);
    // Time passes 50 ms at a time, so that the retry falls due.
    let ticker = tokio::spawn({
        let clock = clock.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                clock.advance(Duration::from_millis(50));
            }
        }
    });
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    ticker.abort();
    assert_eq!((stats.sent, stats.dead), (1, 0), "{stats:?}");
    assert_eq!(rx.received().len(), 2);
}


/// A step forward seen by `serve`'s regular look at the clock (or as it stops, or as `run`
/// ends) is stored then, not only by a later delivery outcome: a process stopped before one
/// forgot it (bb29), and the next start dead-lettered the alerts queued before it.
#[test]
fn a_step_seen_by_a_look_at_the_clock_is_stored_at_once() {
    let ws = ws_for("http://127.0.0.1:9/hook".into(), "");
    let clock = zonewatch::clock::ManualClock::at(1_000_000_000_000);
    let engine = ws.engine_at(clock.clone());
    clock.advance(Duration::from_secs(1));
    clock.step_forward(Duration::from_secs(10 * 365 * 86_400));
    engine.settle_clock_watch();
    drop(engine);
    let engine = ws.engine_at(clock.clone());
    assert_eq!(engine.store.forward_steps().len(), 1, "the next process knows the step");
}

/// A replay with no dead letter to requeue sends nothing: it drained the whole outbox (the
/// alerts a stopped `run` had left queued), past its `--rate`, and counted them as its own
/// (found by a black-box tester).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_with_nothing_to_requeue_sends_nothing() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4]);
    let deliverer = zonewatch::notify::delivery::Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).unwrap();
    let r = zonewatch::notify::replay::replay(&engine.store, &deliverer, Vec::new(), 5.0, 3, std::time::Instant::now() + Duration::from_secs(2)).await.unwrap();
    assert_eq!((r.requeued, r.delivery.attempted), (0, 0), "{r:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 2, "left for `serve` or the next `run`");
    assert!(rx.received().is_empty());
}

/// `run`'s deadline bounds retries even while slow sends keep a pass going: the first tries
/// all go out, a retry falling due after the deadline is left queued for the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_takes_no_retry_that_falls_due_after_its_deadline_while_slow_sends_run() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 503, delay: Duration::from_millis(300), ..Default::default() }), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_concurrency = 1");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8]);
    let stats = deliver(&engine, Duration::from_millis(200)).await;
    assert_eq!((stats.attempted, stats.retried), (3, 3), "{stats:?}");
    assert_eq!(rx.received().len(), 3, "only the first tries");
    assert_eq!(engine.store.outbox_len().unwrap(), 3, "the retries wait for the next run");
}

/// `run_wait` bounds a rate-limited endpoint's backlog too: a row whose rate token comes
/// after the deadline is left queued for the next run, not waited for (bb30: with
/// `endpoint_rate = 0.01` a `run` whose `run_wait` was 1 s paced its sends for minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_does_not_wait_past_its_deadline_for_rate_tokens() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_rate = 0.2");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8]);
    let stats = deliver(&engine, Duration::from_secs(1)).await;
    assert_eq!((stats.sent, stats.dead), (1, 0), "one token by the deadline (the next is 5 s away): {stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 2, "left for the next run, unsent and not dead");
    assert_eq!(rx.received().len(), 1);
}

/// A failed connection's attempt row says what failed under reqwest's "error sending
/// request" (here: nothing listens), so `dlq show` tells a refused connection from a
/// protocol error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connection_says_why_in_the_attempt_log() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let ws = ws_for(format!("http://127.0.0.1:{port}/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(stats.dead, 1, "{stats:?}");
    let key = engine.store.dead_letters().unwrap()[0].entry.key.0.clone();
    let attempts = engine.store.attempts(&key).unwrap();
    let error = attempts[0].error.as_deref().unwrap_or("");
    assert!(error.starts_with("connection: ") && error.to_lowercase().contains("refused"), "{error}");
}

/// Reads one HTTP/1.1 request (its head, then Content-Length bytes of body) off `conn`,
/// keeping what follows it in `buf`; its `webhook-id`, or None once the peer is gone.
async fn read_request(conn: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    /// More bytes onto `buf`; false once the peer is gone.
    async fn more(conn: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> bool {
        use tokio::io::AsyncReadExt;
        let mut chunk = [0u8; 4096];
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if !more(conn, buf).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let field = |name: &str| head.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()));
    let len: usize = field("content-length:").and_then(|v| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + len {
        if !more(conn, buf).await {
            return None;
        }
    }
    buf.drain(..head_end + len);
    Some(field("webhook-id:").unwrap_or_default())
}

/// A raw loopback receiver. On each connection it answers the first request 200 (kept
/// alive, no `Connection: close`) when `answer_first` is set, then reads one more request and
/// hangs up on it after `hang_up_after`: at once, the race a real receiver loses when it
/// closes an idle kept-alive connection as a request arrives on it; later, a server's own
/// write timeout. Returns its port and the `webhook-id`s it read, answered (`true`) or not.
async fn hang_up_receiver(answer_first: bool, hang_up_after: Duration) -> (u16, Arc<std::sync::Mutex<Vec<(String, bool)>>>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if answer_first {
                    let Some(key) = read_request(&mut conn, &mut buf).await else { return };
                    log.lock().unwrap().push((key, true));
                    conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
                }
                let Some(key) = read_request(&mut conn, &mut buf).await else { return };
                log.lock().unwrap().push((key, false));
                tokio::time::sleep(hang_up_after).await;
                // Dropped here: this request gets no answer.
            });
        }
    });
    (port, seen)
}

/// A request that goes out on a kept-alive connection the receiver closes under it is sent
/// again at once on a fresh one, as the same attempt: no retry, no backoff, the same
/// `webhook-id`, one attempt row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_connection_closed_under_it_goes_again_at_once_as_the_same_attempt() {
    let (port, seen) = hang_up_receiver(true, Duration::ZERO).await;
    let ws = ws_for(format!("http://127.0.0.1:{port}/hook"), "");
    ws.edit_config("concurrency = 4", "concurrency = 1");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8, 12]);
    let stats = deliver(&engine, Duration::from_secs(10)).await;
    assert_eq!((stats.sent, stats.retried, stats.dead), (4, 0, 0), "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    let hung_up: Vec<&String> = seen.iter().filter(|(_, answered)| !answered).map(|(k, _)| k).collect();
    assert!(!hung_up.is_empty(), "the receiver hung up on a reused connection at least once: {seen:?}");
    let answered: BTreeSet<&String> = seen.iter().filter(|(_, answered)| *answered).map(|(k, _)| k).collect();
    assert_eq!(answered.len(), 4, "{seen:?}");
    for key in hung_up {
        assert!(answered.contains(key), "{key} was sent again under the same webhook-id: {seen:?}");
    }
    for key in answered {
        let attempts = engine.store.attempts(key).unwrap();
        assert_eq!(attempts.len(), 1, "{key}: {attempts:?}");
        assert_eq!((attempts[0].result.as_str(), attempts[0].status), ("sent", Some(200)));
    }
}

/// A receiver that takes the request and hangs up on it only later (a server whose own write
/// timeout is shorter than ours) is not sent it again within the attempt: each request it
/// read is one attempt in the log, a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_hung_up_on_late_is_a_failed_attempt_not_sent_again_at_once() {
    let (port, seen) = hang_up_receiver(false, Duration::from_millis(1200)).await;
    let ws = ws_for(format!("http://127.0.0.1:{port}/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_secs(3)).await;
    assert!(stats.retried >= 1 && stats.sent == 0, "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    let key = seen.first().map(|(k, _)| k.clone()).expect("a request");
    let attempts = engine.store.attempts(&key).unwrap();
    assert_eq!(seen.len(), attempts.len(), "one request per attempt: {seen:?} {attempts:?}");
    assert!(attempts.iter().all(|a| a.error.as_deref().is_some_and(|e| e.starts_with("connection: "))), "{attempts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_breaker_opens_probes_half_open_and_closes() {
    let healthy = Arc::new(AtomicBool::new(false));
    let h = healthy.clone();
    let rx = Receiver::start_replies(Arc::new(move |_, _| Reply::status(if h.load(Ordering::SeqCst) { 200 } else { 503 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "breaker_cooldown = \"1s\"");
    ws.edit_config("concurrency = 4", "concurrency = 16");
    ws.edit_config("max_attempts = 5", "max_attempts = 20");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]);
    let d = zonewatch::notify::delivery::Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).unwrap();
    assert_eq!(d.deliver_due().await.unwrap().retried, 12, "12 of 12 failed: the breaker opens");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(d.deliver_due().await.unwrap().attempted, 0, "open: nothing goes out although retries are due");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(d.deliver_due().await.unwrap().attempted, 1, "half-open: one probe");
    assert_eq!(d.deliver_due().await.unwrap().attempted, 0, "the failed probe re-opened it");
    healthy.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let probe = d.deliver_due().await.unwrap();
    assert_eq!((probe.attempted, probe.sent), (1, 1), "a successful probe closes the breaker");
    assert_eq!(d.deliver_due().await.unwrap().sent, 11, "closed: the rest go out");
    assert_eq!(rx.received().len(), 12 + 1 + 1 + 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_breaker_probe_that_comes_before_its_deadline() {
    // The first 12 requests fail, which opens the breaker; every later one succeeds.
    let seen = Arc::new(AtomicU64::new(0));
    let s = seen.clone();
    let rx = Receiver::start_replies(Arc::new(move |_, _| Reply::status(if s.fetch_add(1, Ordering::SeqCst) < 12 { 503 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "breaker_cooldown = \"1s\"");
    ws.edit_config("concurrency = 4", "concurrency = 16");
    ws.edit_config("max_attempts = 5", "max_attempts = 20");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]);

    // The probe would come after the deadline: the drain stops, the rows stay queued, and
    // the stats say when the breaker lets its probe through.
    let short = deliver(&engine, Duration::from_millis(400)).await;
    assert_eq!((short.attempted, short.sent), (12, 0), "{short:?}");
    assert!(short.held_until_ms.is_some(), "{short:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 12);

    // The probe comes before the deadline: the drain waits for it, the probe closes the
    // breaker, and every row is sent in the same drain.
    let long = deliver(&engine, Duration::from_secs(10)).await;
    assert_eq!(long.sent, 12, "{long:?}");
    assert_eq!(long.held_until_ms, None, "{long:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    assert_eq!(rx.received().len(), 12 + 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_later_retry_while_another_endpoint_is_disabled() {
    // "/gone" answers 410 (its endpoint is disabled and its row waits for an operator);
    // "/flaky" fails its first request and takes the retry.
    let flaky = Arc::new(AtomicU64::new(0));
    let f = flaky.clone();
    let rx = Receiver::start(
        Arc::new(move |_, r: &zonewatch::receiver::Received| {
            if r.path == "/gone" {
                410
            } else if f.fetch_add(1, Ordering::SeqCst) == 0 {
                503
            } else {
                200
            }
        }),
        None,
    )
    .await
    .unwrap();
    let ws = Workspace::new(
        &[
            Sub { id: "gone", aoi: area(), target: rx.url("/gone"), min_severity: "info", secret: None },
            Sub { id: "flaky", aoi: area(), target: rx.url("/flaky"), min_severity: "info", secret: None },
        ],
        "retry_schedule = [\"300ms\", \"300ms\"]",
        "",
    );
    let engine = ws.engine();
    assert_eq!(rezone(&ws, &engine, &[0]), 2, "one event, two subscribers");

    // The disabled endpoint's row is due and held back while the retry is not due yet: the
    // drain waits for the retry instead of stopping at the held row.
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.attempted, stats.sent), (3, 1), "{stats:?}");
    assert_eq!(engine.store.outbox_len().unwrap(), 1, "the disabled endpoint's row waits");
    let gone = engine.store.endpoints().unwrap().into_iter().find(|(id, _)| id == "gone").unwrap().1;
    assert!(gone.disabled, "{gone:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_endpoint_dead_letter_replays_under_the_original_key_and_the_receiver_absorbs_it() {
    // Slow past the 300 ms timeout until `fixed`; the receiver records (and would process)
    // every request it gets, so the dead letter had in fact been delivered.
    let fixed = Arc::new(AtomicBool::new(false));
    let f = fixed.clone();
    let rx = Receiver::start_replies(
        Arc::new(move |_, _| Reply { status: 200, delay: if f.load(Ordering::SeqCst) { Duration::ZERO } else { Duration::from_millis(1500) }, ..Default::default() }),
        None,
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    ws.edit_config("timeout_ms = 2000", "timeout_ms = 300");
    ws.edit_config("max_attempts = 5", "max_attempts = 2");
    let engine = ws.engine();
    queue(&ws, &engine, &[0]);
    let stats = deliver(&engine, Duration::from_secs(10)).await;
    assert_eq!(stats.dead, 1);
    let dl = engine.store.dead_letters().unwrap().remove(0);
    assert_eq!(dl.reason, "retries_exhausted");
    let attempts = engine.store.attempts(&dl.entry.key.0).unwrap();
    assert!(attempts.iter().all(|a| a.error.as_deref() == Some("timeout") || a.result == "dead_letter"), "{attempts:?}");
    let before = rx.received();
    assert_eq!(before.len(), 2, "both timed-out requests reached the receiver");
    drop(engine);

    fixed.store(true, Ordering::SeqCst);
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = zonewatch(&["dlq", "replay", &dl.entry.id.to_string(), "--config", cfg, "--rate", "50"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("requeued=1") && out.contains("sent=1"), "{out}");
    let after = rx.received();
    assert_eq!(after.len(), 3);
    let replayed = &after[2];
    assert_eq!(replayed.header("webhook-id"), Some(dl.entry.key.0.as_str()), "replay uses the original key");
    assert_eq!(replayed.body, before[0].body, "and the original bytes");
    // A receiver deduplicating on webhook-id processes the event once.
    let unique: BTreeSet<_> = after.iter().filter_map(|r| r.header("webhook-id")).collect();
    assert_eq!(unique.len(), 1);
    // An id that is not a dead letter (any more) fails the command, saying which.
    let (ok, out, err) = zonewatch(&["dlq", "replay", &dl.entry.id.to_string(), "--config", cfg]);
    assert!(!ok && err.contains(&format!("no dead letter {}", dl.entry.id)), "{out}{err}");

    // The ledger tells the whole story for the key: queued, dead_letter, queued (replay), sent.
    let (ok, out, _) = zonewatch(&["audit", "--config", cfg, "--key", &dl.entry.key.0, "--format", "csv"]);
    assert!(ok);
    let outcomes: Vec<&str> = out.lines().skip(1).filter_map(|l| l.split(',').nth(2)).collect();
    assert_eq!(outcomes, ["queued", "dead_letter", "queued", "sent"], "{out}");
    // `dlq show` prints every attempt of the event.
    let (ok, out, err) = zonewatch(&["dlq", "show", &dl.entry.key.0, "--config", cfg]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().filter(|l| l.contains("\ttimeout\t")).count(), 1, "{out}");
    assert!(out.contains("\tsent\t200\t"), "{out}");
    // The attempt log follows the key from its dead letter to the replayed row, counting on.
    let engine = ws.engine();
    let attempts = engine.store.attempts(&dl.entry.key.0).unwrap();
    let seen: Vec<(u32, &str)> = attempts.iter().map(|a| (a.attempt, a.result.as_str())).collect();
    assert_eq!(seen, [(1, "retry"), (2, "dead_letter"), (3, "sent")]);
    assert_ne!(attempts[1].outbox_id, attempts[2].outbox_id, "the replay is a new outbox row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_beyond_max_replays_go_to_quarantine_until_released_and_recover_is_capped() {
    let rx = receiver(400).await;
    let ws = ws_for(rx.url("/hook"), "max_replays = 2");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8]);
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(engine.store.dead_letters().unwrap().len(), 3);
    drop(engine);
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();

    // recover: the window holds 3, --max 2 re-queues the oldest two (they fail again).
    let (ok, out, err) = zonewatch(&["dlq", "recover", "--config", cfg, "--since", "1h", "--max", "2", "--rate", "100"]);
    assert!(ok, "{out}{err}");
    assert!(out.starts_with("recover: ") && out.contains("requeued=2") && out.contains("dead_letters=2"), "{out}");
    assert!(err.contains("recovering the oldest 2"), "{err}");
    // The dead letters are said in the log, with why and where to look (they were not: only
    // the command's counts said so, and `serve` said nothing at all).
    assert!(err.contains("alert(s) dead-lettered (") && err.contains("GET /v1/deadletters"), "{err}");
    // Two more replays of everything: the two recovered keys hit max_replays (2) on the
    // second round and are quarantined; the third key is replayed twice.
    for _ in 0..2 {
        let (ok, out, err) = zonewatch(&["dlq", "replay", "--config", cfg, "--rate", "100"]);
        assert!(ok, "{out}{err}");
    }
    let engine = ws.engine();
    let q = engine.store.dlq_quarantine().unwrap();
    assert_eq!(q.len(), 2, "{q:?}");
    assert!(q.iter().all(|d| d.reason.contains("max_replays 2")));
    assert_eq!(engine.store.dead_letters().unwrap().len(), 1);
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    let o = outcomes(&engine);
    assert_eq!(o.get("quarantined"), Some(&2));
    drop(engine);
    let (ok, out, _) = zonewatch(&["dlq", "list", "--config", cfg]);
    assert!(ok);
    assert_eq!(out.lines().filter(|l| l.contains("\tquarantined\t")).count(), 2, "{out}");
    assert_eq!(out.lines().filter(|l| l.contains("\tdead\t")).count(), 1, "{out}");
    // Replaying a quarantined one by id says it is quarantined, not that it does not exist.
    let q_id = out.lines().find(|l| l.contains("\tquarantined\t")).and_then(|l| l.split('\t').next()).expect("a quarantined row").to_string();
    let (ok, _, err) = zonewatch(&["dlq", "replay", "--config", cfg, &q_id]);
    assert!(!ok && err.contains(&format!("dead letter {q_id} is quarantined")), "{err}");
    // Its way out: released, it is a dead letter again with its replays counted from 0, so a
    // replay queues it (the receiver still refuses it: a dead letter again). A dead letter
    // that is not quarantined, and an unknown id, fail the command after the others.
    let d_id = out.lines().find(|l| l.contains("\tdead\t")).and_then(|l| l.split('\t').next()).expect("a dead row").to_string();
    let (ok, released, err) = zonewatch(&["dlq", "release", &q_id, &d_id, "999999", "--config", cfg]);
    assert!(!ok, "{released}{err}");
    assert!(released.contains(&format!("released {q_id} (was: replayed 2 times (max_replays 2))")), "{released}");
    assert!(err.contains(&format!("dead letter {d_id} is not quarantined")) && err.contains("no quarantined dead letter 999999"), "{err}");
    let (ok, out, err) = zonewatch(&["dlq", "replay", &q_id, "--config", cfg, "--rate", "100"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("requeued=1") && out.contains("quarantined=0") && out.contains("dead_letters=1"), "{out}");
    let engine = ws.engine();
    assert_eq!(engine.store.dlq_quarantine().unwrap().len(), 1, "the other one stays quarantined");
    assert!(engine.store.check_consistency().unwrap().is_consistent());
    drop(engine);
    let (ok, _, err) = zonewatch(&["dlq", "release", "--config", cfg]);
    assert!(!ok && err.contains("<IDS>"), "an id is required: {err}");
    let (ok, _, err) = zonewatch(&["dlq", "recover", "--config", cfg, "--since", "yesterday-ish"]);
    assert!(!ok && err.contains("--since"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_hide_in_flight_entries_and_fresh_events_go_ahead_of_retries() {
    // A dead endpoint builds a retry backlog ...
    let dead = receiver(503).await;
    let live = receiver(200).await;
    let ws = Workspace::new(
        &[
            Sub { id: "dead", aoi: area(), target: dead.url("/hook"), min_severity: "info", secret: None },
            Sub { id: "live", aoi: rect(-71.2, 42.3, -71.0995, 42.3605), target: live.url("/hook"), min_severity: "info", secret: None },
        ],
        "retry_schedule = [\"1ms\", \"1ms\", \"1ms\"]",
        "",
    );
    ws.edit_config("max_attempts = 3", "max_attempts = 4");
    ws.edit_config("concurrency = 4", "concurrency = 16");
    let engine = ws.engine();
    let v1 = grid(40);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let mut v2 = v1.clone();
    for p in v2.iter_mut().take(10).skip(1) {
        p.zone = "C3".into();
    }
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    let engine = { drop(engine); ws.engine() };
    ws.write_layer(&layer(&v2));
    assert_eq!(run(&engine, false).record.counts.queued, 9, "parcels 1..10 only match `dead` (9 < 10: the breaker stays closed)");
    let d = zonewatch::notify::delivery::Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).unwrap();
    assert_eq!(d.deliver_due().await.unwrap().retried, 9);
    // ... then a live alert arrives (parcel 0 matches both subscribers).
    let mut v3 = v2.clone();
    v3[0].zone = "C3".into();
    ws.write_layer(&layer(&v3));
    assert_eq!(run(&engine, false).record.counts.queued, 2);
    let now = engine.now() + 1000;
    let batch = engine.store.lease_due(now, 60_000, 4, 1).unwrap();
    assert_eq!(batch.fresh, 2, "both fresh entries first");
    assert_eq!(batch.entries.len(), 4, "then retries fill the rest");
    assert!(batch.entries[..2].iter().all(|e| e.attempts == 0) && batch.entries[2..].iter().all(|e| e.attempts == 1));
    // Leased entries are invisible to another pass until the lease expires ...
    let again = engine.store.lease_due(now, 60_000, 100, 1).unwrap();
    assert_eq!(again.entries.len(), 7);
    assert!(again.entries.iter().all(|e| !batch.entries.iter().any(|b| b.id == e.id)));
    assert_eq!(engine.store.lease_due(now, 60_000, 100, 1).unwrap().entries.len(), 0);
    assert_eq!(engine.store.leased_len().unwrap(), 11);
    // ... or the process that held them dies: reopening the store returns them to the queue.
    drop(d);
    drop(engine);
    let engine = ws.engine();
    assert_eq!(engine.store.leased_len().unwrap(), 0);
    assert_eq!(engine.store.lease_due(now, 200, 100, 1).unwrap().entries.len(), 11);
    // Expired leases are taken over without a restart: once their clock time has passed and
    // as much time has elapsed (a wall clock stepped ahead alone does not end them).
    assert_eq!(engine.store.lease_due(now + 60_001, 60_000, 100, 1).unwrap().entries.len(), 0);
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(engine.store.lease_due(now + 60_001, 60_000, 100, 1).unwrap().entries.len(), 11);
    assert_eq!(engine.store.reclaim_leases(now + 120_001).unwrap(), 11);
    // And a real pass delivers the live alert even with the dead backlog in front of it.
    let d = zonewatch::notify::delivery::Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).unwrap();
    d.deliver_due().await.unwrap();
    assert_eq!(live.received().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_endpoint_concurrency_and_rate_limits_hold() {
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = arrivals.clone();
    let rx = Receiver::start_replies(
        Arc::new(|_, _| Reply { status: 200, delay: Duration::from_millis(300), ..Default::default() }),
        Some(Arc::new(move |_| a.lock().unwrap().push(std::time::Instant::now()))),
    )
    .await
    .unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_concurrency = 2");
    ws.edit_config("concurrency = 4", "concurrency = 16");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 2, 4, 6, 8, 10]);
    assert_eq!(deliver(&engine, Duration::from_secs(10)).await.sent, 6);
    let t = arrivals.lock().unwrap().clone();
    assert_eq!(t.len(), 6);
    // Two at a time: the third request only starts once one of the first two answered.
    for i in 2..6 {
        assert!(t[i] - t[i - 2] >= Duration::from_millis(250), "request {i} overlapped {} others", 2);
    }
    drop(engine);

    let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = arrivals.clone();
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), Some(Arc::new(move |_| a.lock().unwrap().push(std::time::Instant::now())))).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "endpoint_rate = 5.0");
    ws.edit_config("concurrency = 4", "concurrency = 16");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 2, 4, 6, 8, 10]);
    assert_eq!(deliver(&engine, Duration::from_secs(10)).await.sent, 6);
    let t = arrivals.lock().unwrap().clone();
    // 5 per second with a burst of 1: six requests span at least 5 × 200 ms.
    assert!(t[5] - t[0] >= Duration::from_millis(950), "{:?}", t[5] - t[0]);
}

/// A rate-limited endpoint whose sends wait for a global permit held by a slow endpoint does
/// not store up rate tokens while it waits, so once the permit comes free it still sends at
/// its rate, not in a burst (the token is taken after the permit, just before the send).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_endpoint_waiting_for_permits_does_not_burst() {
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = arrivals.clone();
    let rx = Receiver::start_replies(
        Arc::new(|_, r| Reply { status: 200, delay: Duration::from_millis(if r.path == "/slow" { 1500 } else { 0 }), ..Default::default() }),
        Some(Arc::new(move |r| a.lock().unwrap().push((r.path.clone(), std::time::Instant::now())))),
    )
    .await
    .unwrap();
    let ws = Workspace::new(
        &[
            // Inside parcel P0000 only: one row, sent while the fast endpoint's rows wait.
            Sub { id: "slow", aoi: rect(-71.0998, 42.3602, -71.0992, 42.3608), target: rx.url("/slow"), min_severity: "info", secret: None },
            Sub { id: "fast", aoi: area(), target: rx.url("/fast"), min_severity: "info", secret: None },
        ],
        "endpoint_rate = 5.0\nendpoint_concurrency = 4",
        "",
    );
    // One global permit: the slow endpoint's send holds it for 1.5 s while the fast
    // endpoint's four rows wait for it (without the order, they took a token each meanwhile
    // and then went out within milliseconds of one another).
    ws.edit_config("concurrency = 4", "concurrency = 1");
    let engine = ws.engine();
    assert_eq!(rezone(&ws, &engine, &[0, 2, 4, 6]), 5);
    assert_eq!(deliver(&engine, Duration::from_secs(20)).await.sent, 5);
    let fast: Vec<std::time::Instant> = arrivals.lock().unwrap().iter().filter(|(p, _)| p == "/fast").map(|(_, t)| *t).collect();
    assert_eq!(fast.len(), 4);
    // 5 per second with a burst of 1: every request of the endpoint at least ~200 ms after the one before.
    for i in 1..fast.len() {
        assert!(fast[i] - fast[i - 1] >= Duration::from_millis(180), "request {i} came {:?} after the one before", fast[i] - fast[i - 1]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_sweeps_attempts_but_keeps_those_of_dead_letters() {
    let rx = Receiver::start_replies(Arc::new(|n, _| Reply::status(if n == 0 { 400 } else { 200 })), None).await.unwrap();
    let ws = ws_for(rx.url("/hook"), "");
    ws.edit_config("concurrency = 4", "concurrency = 1");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4, 8]);
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dead), (2, 1));
    let dead_key = engine.store.dead_letters().unwrap()[0].entry.key.0.clone();
    let keys: Vec<String> = rx.received().iter().filter_map(|r| r.header("webhook-id").map(String::from)).collect();
    let now = engine.now();
    assert_eq!(engine.store.sweep_attempts(now - 60_000, 100).unwrap(), 0, "nothing is older than the horizon");
    // Bounded: one row per call at most.
    assert_eq!(engine.store.sweep_attempts(now + 1, 1).unwrap(), 1);
    assert_eq!(engine.store.sweep_attempts(now + 1, 100).unwrap(), 1);
    assert_eq!(engine.store.sweep_attempts(now + 1, 100).unwrap(), 0);
    for k in &keys {
        let left = engine.store.attempts(k).unwrap().len();
        assert_eq!(left, usize::from(*k == dead_key), "key {k}");
    }
}

/// The SSRF guard refuses a name on the addresses it resolves to, at connect time, and a
/// private IP literal before any connection: both end as dead letters the receiver never saw,
/// without counting against the endpoint's health.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_targets_are_refused_by_name_and_by_literal() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, body: "ok".into(), ..Default::default() }), None).await.unwrap();
    let literal = rx.url("/hook");
    let port = literal.rsplit(':').next().and_then(|p| p.split('/').next()).unwrap().to_string();
    for (target, host) in [(format!("http://localhost:{port}/hook"), "localhost"), (literal.clone(), "127.0.0.1")] {
        let ws = ws_for(target, "");
        ws.edit_config("allow_private_targets = true", "allow_private_targets = false");
        let engine = ws.engine();
        queue(&ws, &engine, &[0]);
        let stats = deliver(&engine, Duration::from_secs(5)).await;
        assert_eq!((stats.sent, stats.dead), (0, 1), "{host}: {stats:?}");
        let dead = engine.store.dead_letters().unwrap();
        assert!(dead[0].reason.starts_with(&format!("private_target_refused: {host} resolves to ")), "{}", dead[0].reason);
        assert!(rx.received().is_empty(), "{host}: nothing reached the receiver");
        // A refusal is this side's decision, not the endpoint's failure: its health is untouched.
        let health = engine.store.endpoints().unwrap();
        assert!(health.iter().all(|(_, h)| !h.disabled && h.breaker_open_until_ms.is_none()), "{host}: {health:?}");
        assert!(health.iter().all(|(_, h)| h.recent.is_empty() && h.failing_since_ms.is_none()), "{host}: {health:?}");
    }
}

/// A subscriber as the control port stores it (`POST /v1/subscribers`), over the whole area.
fn api_subscriber(id: &str, target: String) -> zonewatch::store::StoredSubscriber {
    zonewatch::store::StoredSubscriber {
        id: id.into(),
        target,
        secret: None,
        min_severity: zonewatch::model::Severity::Info,
        aoi_geojson: area().to_string(),
        created_ms: 0,
        updated_ms: 0,
        secret_old: None,
    }
}

/// A workspace without config subscribers whose store holds one API subscriber `api-1`
/// posting to `url`; returns it with its engine.
fn ws_with_api_subscriber(url: String) -> (Workspace, zonewatch::pipeline::Engine) {
    let ws = Workspace::new(&[], "retry_schedule = [\"50ms\", \"50ms\", \"50ms\", \"50ms\"]", "");
    let engine = ws.engine();
    let rec = api_subscriber("api-1", url);
    let aoi = zonewatch::notify::aoi::parse_new_aoi(&rec.aoi_geojson).unwrap();
    engine.edit_subscribers().put(&rec, aoi).unwrap();
    (ws, engine)
}

/// `zonewatch endpoints list|enable` cover subscribers created over the control port, not
/// only the config's: one disabled by a 410 is listed (same columns) and re-enabled, and its
/// waiting events go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_subscriber_disabled_by_410_is_listed_and_enabled_from_the_command_line() {
    let back = Arc::new(AtomicBool::new(false));
    let b = back.clone();
    let rx = Receiver::start_replies(Arc::new(move |_, _| Reply::status(if b.load(Ordering::SeqCst) { 200 } else { 410 })), None).await.unwrap();
    let (ws, engine) = ws_with_api_subscriber(rx.url("/hook"));
    queue(&ws, &engine, &[0, 4]);
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(engine.store.outbox_len().unwrap(), 2, "events wait for an enable");
    drop(engine);
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = zonewatch(&["endpoints", "list", "--config", cfg]);
    assert!(ok, "{out}{err}");
    assert_eq!(out.lines().next(), Some("id\tstate\tbreaker\tlast_success\treason\ttarget"), "{out}");
    let row = out.lines().find(|l| l.starts_with("api-1\t")).unwrap_or_else(|| panic!("api-1 not listed:\n{out}"));
    assert!(row.starts_with("api-1\tdisabled\t") && row.contains("\thttp_410_gone\t") && row.ends_with(&rx.url("/hook")), "{row}");
    back.store(true, Ordering::SeqCst);
    let (ok, out, err) = zonewatch(&["endpoints", "enable", "api-1", "--config", cfg]);
    assert!(ok && out.contains("endpoint api-1 enabled"), "{out}{err}");
    let (ok, _, err) = zonewatch(&["endpoints", "enable", "nobody", "--config", cfg]);
    assert!(!ok && err.contains("no subscriber \"nobody\""), "{err}");
    let engine = ws.engine();
    let stats = deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!((stats.sent, engine.store.outbox_len().unwrap()), (2, 0), "{stats:?}");
    let o = outcomes(&engine);
    assert_eq!((o.get("endpoint_disabled"), o.get("endpoint_enabled")), (Some(&1), Some(&1)));
    let enabled = engine.store.audit(&Default::default()).unwrap().into_iter().find(|r| r.outcome.as_str() == "endpoint_enabled").unwrap();
    assert_eq!(enabled.detail, "enabled by operator");
}

/// A config subscriber removed from the config while its endpoint is disabled (410) and its
/// events wait: delivery dead-letters them `subscriber_gone` (nothing is sent, no row waits
/// forever behind the disabled endpoint); with the subscriber back, `dlq replay` delivers
/// them to its current target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_a_subscriber_removed_from_the_config_are_dead_lettered_as_gone_and_replayable() {
    let rx = receiver(410).await;
    let ws = ws_for(rx.url("/hook"), "");
    let engine = ws.engine();
    queue(&ws, &engine, &[0, 4]);
    deliver(&engine, Duration::from_secs(5)).await;
    assert_eq!(engine.store.outbox_len().unwrap(), 2);
    // The second row is not sent if the first one's 410 came back before its send began.
    let asked = rx.received().len();
    assert!((1..=2).contains(&asked), "{asked}");
    drop(engine);
    let text = std::fs::read_to_string(ws.config_path()).unwrap();
    let at = text.find("[[subscriber]]").unwrap();
    std::fs::write(ws.config_path(), &text[..at]).unwrap();
    let engine = ws.engine();
    let stats = deliver(&engine, Duration::from_secs(2)).await;
    assert_eq!((stats.dead, engine.store.outbox_len().unwrap()), (2, 0), "{stats:?}");
    assert_eq!(rx.received().len(), asked, "nothing sent for a subscriber that is gone");
    let dead = engine.store.dead_letters().unwrap();
    assert!(dead.len() == 2 && dead.iter().all(|d| d.reason == "subscriber_gone"), "{dead:?}");
    assert_eq!(outcomes(&engine).get("dead_letter"), Some(&2));
    assert!(engine.store.check_consistency().unwrap().is_consistent());
    drop(engine);
    // While no subscriber of that id exists, a replay leaves them as they are: it would only
    // dead-letter them again and count a replay toward max_replays. Named, it exits 1.
    let cfg = ws.config_path();
    let (ok, out, err) = zonewatch(&["dlq", "replay", "--config", cfg.to_str().unwrap()]);
    assert!(ok && out.contains("requeued=0") && out.contains("no_subscriber=2"), "{out}{err}");
    assert!(err.contains("2 dead letter(s) not replayed: no subscriber of their id exists"), "{err}");
    let named = dead[0].entry.id.to_string();
    let (ok, out, err) = zonewatch(&["dlq", "replay", &named, "--config", cfg.to_str().unwrap()]);
    assert!(!ok && out.contains("no_subscriber=1") && err.contains(&format!("dead letter {named}: no subscriber \"w\" exists")), "{out}{err}");
    let engine = ws.engine();
    assert_eq!(engine.store.dead_letters().unwrap().len(), 2);
    for d in &dead {
        assert_eq!(engine.store.replay_count(&d.entry.key.0).unwrap(), 0, "no replay used up");
    }
    drop(engine);
    // The subscriber comes back at a new URL (its endpoint is still disabled from the 410:
    // a config edit is not an enable): once enabled, a replay sends to the new URL.
    let good = receiver(200).await;
    std::fs::write(ws.config_path(), text.replace(&rx.url("/hook"), &good.url("/new"))).unwrap();
    let (ok, out, err) = zonewatch(&["endpoints", "enable", "w", "--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = zonewatch(&["dlq", "replay", "--config", cfg.to_str().unwrap()]);
    assert!(ok && out.contains("requeued=2") && out.contains("sent=2"), "{out}{err}");
    assert_eq!(good.received().len(), 2);
}

/// One endpoint that hangs (every answer 5 s late) with thousands of events queued ahead of
/// another endpoint's one event does not hold that event back: the slow endpoint may fill a
/// quarter of the deliverer's window, not all of it, so the other's row is leased in the
/// same pass and sent at once. (Before, the window's 4,096 rows all went to the slow
/// endpoint and the other waited for ~3,000 of its answers.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoints_backlog_does_not_hold_back_another_endpoints_event() {
    let slow = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, delay: Duration::from_secs(5), ..Default::default() }), None).await.unwrap();
    let fast = receiver(200).await;
    let n = 4_200;
    let last = grid(n).pop().unwrap();
    let [x, y] = last.ring[0];
    let ws = Workspace::new(
        &[
            Sub { id: "slow", aoi: rect(-71.2, 42.3, -71.0, 42.7), target: slow.url("/hook"), min_severity: "info", secret: None },
            // Only the last parcel: its row comes after every one of `slow`'s.
            Sub { id: "fast", aoi: rect(x + 0.0001, y + 0.0001, x + 0.0002, y + 0.0002), target: fast.url("/hook"), min_severity: "info", secret: None },
        ],
        "",
        "",
    );
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    // More requests in flight than one endpoint's 8 slots, as in production (the workspace's
    // 4 would let the hanging endpoint's sends take every one of them).
    ws.edit_config("concurrency = 4", "concurrency = 64");
    let engine = ws.engine();
    let v1 = grid(n);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let mut v2 = v1.clone();
    for p in &mut v2 {
        p.zone = "C3".into();
    }
    ws.write_layer(&layer(&v2));
    assert_eq!(run(&engine, false).record.counts.queued, n as u64 + 1);
    let d = zonewatch::notify::delivery::Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).unwrap();
    let pump = tokio::spawn(async move { d.drain(std::time::Instant::now() + Duration::from_secs(60)).await });
    let t = std::time::Instant::now();
    while fast.received().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(4), "the other endpoint's event waited behind the hanging one's backlog");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pump.abort();
}
