//! Measure 4, delivery: sustained webhooks/s from the outbox to a real loopback receiver
//! (hyper on 127.0.0.1) with durable completion — a webhook counts only once its `sent`
//! outcome and audit row are committed in redb — and the latency from the outbox row's commit
//! to its receipt.
//!
//! Three phases, one JSON line:
//! * **backlog**: N rows are queued through the store's real claim path (`Store::enqueue`,
//!   1,000 per transaction), then the real [`Deliverer`] drains them (`drain`, as `zonewatch
//!   run` does). `sent / wall_s` is the sustained rate; the outbox must end empty with exactly N
//!   `sent` audit rows.
//! * **latency**: the deliverer runs as in `serve` (`Deliverer::run`, woken on each commit)
//!   while a producer commits batches of 100 rows at an offered rate below the measured
//!   capacity; each row's latency is its receipt at the receiver minus the moment its
//!   enqueue transaction returned. A backlog's queueing time would say nothing about the
//!   deliverer, which is why the percentiles are not taken from the backlog phase.
//!
//! * **HTTP only** (the reference, like ingest's parse-only pass; run first, best of two):
//!   the same client ([`http_client`]), receiver, body and headers, 64 in flight, and nothing
//!   else — no store, no body building, no signing. `per_s / http_only_per_s` says how much of the
//!   machine's bare HTTP exchange rate the durable pipeline keeps.
//!
//! Runs in a child process (its own runtime; the parent only relays the line).

use super::{emit, per_s, secs, BenchCtx, BenchError, Scale};
use crate::config::DeliveryConfig;
use crate::model::{ChangeEvent, ChangeKind, IdemKey, Severity, StoredGeometry};
use crate::notify::delivery::{http_client, Deliverer};
use crate::notify::matcher::{Subscriber, SubscriberIndex};
use crate::receiver::Receiver;
use crate::store::{Claim, Store};
use crate::synth::{CountyIter, SynthParcel};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The target, webhooks/s.
pub const TARGET_PER_S: f64 = 30_000.0;
/// Subscribers (endpoints) the queued rows are spread over.
pub const ENDPOINTS: usize = 100;
/// Rows per enqueue transaction while building a backlog.
const QUEUE_BATCH: usize = 1_000;
/// Requests in flight, as the reqwest → hyper reference (64 in flight).
pub const CONCURRENCY: usize = 64;

const SECRET: &str = "whsec_YmVuY2gtc2VjcmV0LWJlbmNoLXNlY3JldA==";

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    if !ctx.in_process {
        return ctx.run_child("delivery", &[]);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Failed(format!("tokio runtime: {e}")))?;
    rt.block_on(measure(ctx))
}

/// Backlog size per scale.
fn rows(scale: Scale) -> usize {
    match scale {
        Scale::Test => 3_000,
        Scale::Small | Scale::Full => 200_000,
    }
}

/// Requests of the HTTP-only reference pass per scale.
fn http_only_requests(scale: Scale) -> usize {
    match scale {
        Scale::Test => 2_000,
        Scale::Small | Scale::Full => 100_000,
    }
}

/// Longest one reference pass may take (each request is bounded by the client's timeout, but
/// a receiver answering slowly would otherwise hold the bench for hours).
const HTTP_ONLY_LIMIT: Duration = Duration::from_secs(300);

/// One pass of the reference: `n` POSTs of `body` with delivery's headers, `CONCURRENCY` in flight, through
/// delivery's own client to a sink receiver of their own; requests/s. Every request must be
/// answered 200 and received once.
async fn http_only(n: usize, body: Vec<u8>) -> Result<f64, BenchError> {
    // The receiver does what the measured pass's does per request (`Receipts`), so the ratio
    // compares the sending sides only.
    let receipts = Arc::new(Receipts::default());
    let receiver = Receiver::start_sink(receipts.on_id()).await.map_err(|e| BenchError::io("receiver", e))?;
    let client = http_client(&delivery_config()).map_err(|e| BenchError::Failed(e.to_string()))?;
    let url = receiver.url("/hook/0");
    let body = bytes::Bytes::from(body);
    // One signature of the right shape for every request: the reference leaves signing out.
    let key = crate::notify::signing::decode_secret(SECRET).map_err(BenchError::Failed)?;
    let signature = crate::notify::signing::sign(&key, "http-only", 1_780_000_000, &body);
    let sem = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    let failed = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let deadline = t + HTTP_ONLY_LIMIT;
    for i in 0..n {
        // A failed request or a stalled receiver ends the pass: the reference is void.
        if failed.load(Ordering::Relaxed) != 0 || Instant::now() > deadline {
            break;
        }
        let permit = sem.clone().acquire_owned().await.map_err(|e| BenchError::Failed(e.to_string()))?;
        let (client, url, body, failed, signature) = (client.clone(), url.clone(), body.clone(), failed.clone(), signature.clone());
        let id = format!("http-only-{i}");
        tasks.spawn(async move {
            let sent = client
                .post(&url)
                .header("content-type", "application/json")
                .header("webhook-id", id)
                .header("webhook-timestamp", "1780000000")
                .header("webhook-signature", signature)
                .body(body)
                .send()
                .await;
            match sent {
                Ok(resp) if resp.status().is_success() => {
                    let _ = resp.bytes().await;
                }
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let wall = t.elapsed().as_secs_f64();
    let (bad, got, repeats) = (failed.load(Ordering::Relaxed), receipts.unique(), receipts.repeats.load(Ordering::Relaxed));
    if bad != 0 || got != n || repeats != 0 {
        return Err(BenchError::Failed(format!(
            "http-only pass: {bad} requests failed, {got} of {n} distinct requests received, {repeats} repeats (limit {} s)",
            HTTP_ONLY_LIMIT.as_secs()
        )));
    }
    Ok(per_s(n as u64, wall))
}

/// Receipts seen by the bench receiver: first receipt time per `webhook-id`, and repeats.
#[derive(Default)]
pub(super) struct Receipts {
    pub first: Mutex<HashMap<String, Instant>>,
    pub total: AtomicU64,
    pub repeats: AtomicU64,
}

impl Receipts {
    pub fn on_id(self: &Arc<Self>) -> crate::receiver::OnId {
        let me = self.clone();
        Arc::new(move |id: &str| {
            let now = Instant::now();
            me.total.fetch_add(1, Ordering::Relaxed);
            let mut g = me.first.lock().unwrap_or_else(|p| p.into_inner());
            if g.contains_key(id) {
                me.repeats.fetch_add(1, Ordering::Relaxed);
            } else {
                g.insert(id.to_string(), now);
            }
        })
    }
    pub fn unique(&self) -> usize {
        self.first.lock().map(|g| g.len()).unwrap_or(0)
    }
}

/// Subscribers in the deliverer's index, as in the idle measure's county: `ENDPOINTS` of them
/// receive the bench's webhooks, the rest are the county's other subscribers (delivery looks
/// each webhook's subscriber up among all of them).
pub const SUBSCRIBERS: usize = 10_000;

/// The bench's subscribers: `ENDPOINTS` signed endpoints on the receiver spread evenly among
/// other subscribers (up to `SUBSCRIBERS` in all) that are never sent to.
pub(super) fn subscribers(receiver: &Receiver) -> Arc<SubscriberIndex> {
    let every = (SUBSCRIBERS / ENDPOINTS).max(1);
    let subs = (0..SUBSCRIBERS.max(ENDPOINTS))
        .map(|i| Subscriber {
            id: if i % every == every - 1 && i / every < ENDPOINTS { format!("bench-ep-{}", i / every) } else { format!("bench-other-{i}") },
            target: receiver.url(&format!("/hook/{}", (i / every) % ENDPOINTS)),
            secret: Some(SECRET.into()),
            secret_old: None,
            min_severity: Severity::Info,
            aoi: geo::MultiPolygon(vec![]),
        })
        .collect();
    Arc::new(SubscriberIndex::build(subs))
}

/// Delivery settings of the bench: loopback allowed, `CONCURRENCY` in flight.
pub(super) fn delivery_config() -> DeliveryConfig {
    DeliveryConfig { concurrency: CONCURRENCY, allow_private_targets: true, ..Default::default() }
}

/// Queues rows through the store's real claim path: one `rezoned` event per synthetic parcel
/// (real lot shapes, so bodies have realistic sizes), for endpoint `parcel % ENDPOINTS`.
/// Parcels are numbered from `first`; `batch` rows per transaction. Calls `after_commit` with
/// the keys of each committed batch.
pub(super) struct Queuer {
    lots: CountyIter,
    next: usize,
    targets: Vec<String>,
}

impl Queuer {
    pub fn new(seed: u64, total: usize, receiver_url: &str) -> Queuer {
        let spec = super::gen::county_spec(total.max(1), seed);
        Queuer {
            lots: CountyIter::new(&spec),
            next: 0,
            targets: (0..ENDPOINTS).map(|i| format!("{receiver_url}/hook/{i}")).collect(),
        }
    }

    /// Commits the next `n` rows in one transaction; returns their keys (empty when the
    /// synthetic county is used up).
    pub fn queue(&mut self, store: &Store, n: usize) -> Result<Vec<IdemKey>, BenchError> {
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let mut events = Vec::with_capacity(n);
        let mut claims = Vec::with_capacity(n);
        for lot in self.lots.by_ref().take(n) {
            let i = self.next;
            self.next += 1;
            let ev = event_for(&lot, now);
            let watcher = format!("bench-ep-{}", i % ENDPOINTS);
            let key = crate::notify::idem::key_for(&watcher, &ev);
            claims.push(Claim {
                event: events.len(),
                watcher_id: watcher,
                target: self.targets[i % ENDPOINTS].clone(),
                min_severity: Severity::Info,
                key,
            });
            events.push(ev);
        }
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let lineage = format!("bench:{}", self.next);
        let counts = store
            .enqueue(&events, &claims, &lineage, now, 7 * 86_400_000)
            .map_err(|e| BenchError::Failed(format!("enqueue: {e}")))?;
        if counts.queued as usize != claims.len() {
            return Err(BenchError::Failed(format!("enqueue queued {} of {}", counts.queued, claims.len())));
        }
        Ok(claims.into_iter().map(|c| c.key).collect())
    }

    /// Queues `total` rows, `QUEUE_BATCH` per transaction.
    pub fn queue_all(&mut self, store: &Store, total: usize) -> Result<usize, BenchError> {
        let mut done = 0;
        while done < total {
            let got = self.queue(store, QUEUE_BATCH.min(total - done))?.len();
            if got == 0 {
                break;
            }
            done += got;
        }
        Ok(done)
    }
}

/// The webhook body of the first row a `Queuer` with these arguments queues (same event,
/// subscriber and body builder; only the key's lineage differs).
fn sample_body(seed: u64, total: usize, receiver_url: &str) -> Result<Vec<u8>, BenchError> {
    let spec = super::gen::county_spec(total.max(1), seed);
    let Some(lot) = CountyIter::new(&spec).next() else {
        return Err(BenchError::Failed("the synthetic county has no parcel to build a sample body from".into()));
    };
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let event = event_for(&lot, now);
    let watcher = "bench-ep-0".to_string();
    let entry = crate::model::OutboxEntry {
        id: 1,
        key: crate::notify::idem::key_for(&watcher, &event),
        target: format!("{receiver_url}/hook/0"),
        watcher_id: watcher,
        source_id: event.source_id.clone(),
        parcel_id: event.parcel_id.clone(),
        lineage_id: "bench:1000".into(),
        severity: event.severity,
        payload: crate::model::OutboxPayload::Change(crate::model::ChangeFields::of(&event, now)),
        attempts: 0,
        created_ms: now,
        next_attempt_ms: now,
        last_error: None,
    };
    Ok(entry.body())
}

fn event_for(lot: &SynthParcel, now_ms: u64) -> ChangeEvent {
    let geom = StoredGeometry(vec![vec![lot.ring.clone()]]);
    let to = if lot.zoning == "M-1" { "C-2" } else { "M-1" };
    ChangeEvent {
        source_id: "bench-county".into(),
        jurisdiction: "bench".into(),
        parcel_id: lot.id.clone(),
        kind: ChangeKind::Rezoned,
        from: Some(lot.zoning.clone()),
        to: Some(to.into()),
        effective_date: Some("2026-01-01".into()),
        old_geometry: Some(geom.clone()),
        new_geometry: Some(geom),
        area_m2: 1_000.0,
        observed_at_ms: now_ms,
        severity: Severity::Material,
        revision: 0,
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    (sorted[i.min(sorted.len() - 1)] * 100.0).round() / 100.0
}

async fn measure(ctx: &BenchCtx) -> Result<(), BenchError> {
    let n = rows(ctx.scale);
    let dir = ctx.fresh_dir("delivery-store")?;
    let store = Arc::new(Store::open(&dir.join("bench.redb")).map_err(|e| BenchError::Failed(format!("open: {e}")))?);
    let receipts = Arc::new(Receipts::default());
    let receiver = Receiver::start_sink(receipts.on_id()).await.map_err(|e| BenchError::io("receiver", e))?;
    let subs = subscribers(&receiver);
    let base = format!("http://{}", receiver.addr);
    let latency_rows = (n / 4).max(500);
    let mut queuer = Queuer::new(ctx.seed, n + latency_rows, &base);

    // The reference first, on a machine not yet busy writing the backlog back to disk: the best
    // of two passes (a ceiling), with the body of the first row the backlog will queue.
    let body = sample_body(ctx.seed, n + latency_rows, &base)?;
    let mut http_only_per_s: f64 = 0.0;
    let mut http_only_cpu_us: Option<f64> = None;
    for _ in 0..2 {
        let requests = http_only_requests(ctx.scale);
        let cpu = super::rss::cpu_seconds();
        let rate = http_only(requests, body.clone()).await?;
        if rate > http_only_per_s {
            http_only_per_s = rate;
            http_only_cpu_us = super::rss::cpu_us_per(cpu, requests as u64);
        }
    }

    // Backlog phase.
    let t = Instant::now();
    let st = store.clone();
    let (queued, mut queuer) = tokio::task::spawn_blocking(move || queuer.queue_all(&st, n).map(|q| (q, queuer)))
        .await
        .map_err(|e| BenchError::Failed(format!("queue task: {e}")))??;
    let queue_s = secs(t.elapsed());
    let deliverer = Deliverer::new(store.clone(), subs, delivery_config()).map_err(|e| BenchError::Failed(e.to_string()))?;
    let t = Instant::now();
    let cpu = super::rss::cpu_seconds();
    let stats = deliverer
        .drain(Instant::now() + Duration::from_secs(600))
        .await
        .map_err(|e| BenchError::Failed(format!("drain: {e}")))?;
    let wall = t.elapsed();
    let cpu_us_per_webhook = super::rss::cpu_us_per(cpu, queued as u64);
    let wall_s = wall.as_secs_f64();
    let outbox = store.outbox_len().map_err(|e| BenchError::Failed(e.to_string()))?;
    let sent_audit = store.stats().map_err(|e| BenchError::Failed(e.to_string()))?.sent;
    if outbox != 0 || sent_audit != queued as u64 || stats.sent != queued as u64 {
        return Err(BenchError::Failed(format!(
            "backlog: queued {queued}, pass reported {} sent, {sent_audit} sent audit rows, {outbox} left in the outbox",
            stats.sent
        )));
    }
    if receipts.unique() != queued {
        return Err(BenchError::Failed(format!("backlog: receiver saw {} distinct webhooks of {queued}", receipts.unique())));
    }
    let capacity = per_s(queued as u64, wall_s);

    // Latency phase: the serve loop, a paced producer.
    let offered = (capacity * 0.5).clamp(500.0, TARGET_PER_S);
    let batch = 100usize;
    let interval = Duration::from_secs_f64(batch as f64 / offered);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let wake = Arc::new(tokio::sync::Notify::new());
    let runner = {
        let d = deliverer.clone();
        let wake = wake.clone();
        tokio::spawn(async move { d.run(stop_rx, wake).await })
    };
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Default::default();
    let st = store.clone();
    let wake2 = wake.clone();
    let committed2 = committed.clone();
    let t_lat = Instant::now();
    let produced = tokio::task::spawn_blocking(move || -> Result<usize, BenchError> {
        let start = Instant::now();
        let mut done = 0usize;
        let mut k = 0u32;
        while done < latency_rows {
            let keys = queuer.queue(&st, batch.min(latency_rows - done))?;
            let at = Instant::now();
            if keys.is_empty() {
                break;
            }
            done += keys.len();
            {
                let mut g = committed2.lock().unwrap_or_else(|p| p.into_inner());
                for key in keys {
                    g.insert(key.0, at);
                }
            }
            wake2.notify_one();
            k += 1;
            let next = start + interval * k;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
        }
        Ok(done)
    })
    .await
    .map_err(|e| BenchError::Failed(format!("producer task: {e}")))??;
    let produce_s = t_lat.elapsed().as_secs_f64();
    // Wait for durable completion of every latency row.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = store.outbox_len().map_err(|e| BenchError::Failed(e.to_string()))?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(BenchError::Failed(format!("latency phase: {left} rows still in the outbox after 120 s")));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let lat_wall_s = t_lat.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let _ = runner.await;

    let mut lat_ms: Vec<f64> = {
        let sent = committed.lock().unwrap_or_else(|p| p.into_inner());
        let got = receipts.first.lock().unwrap_or_else(|p| p.into_inner());
        sent.iter()
            .filter_map(|(k, at)| got.get(k).map(|r| r.saturating_duration_since(*at).as_secs_f64() * 1000.0))
            .collect()
    };
    if lat_ms.len() != produced {
        return Err(BenchError::Failed(format!("latency phase: {} of {produced} rows received", lat_ms.len())));
    }
    lat_ms.sort_by(|a, b| a.total_cmp(b));
    emit(
        "delivery",
        json!({
            "sent": queued,
            "wall_s": secs(wall),
            "per_s": capacity,
            "http_only_per_s": http_only_per_s,
            // CPU (user + system: deliverer, in-process receiver, kernel) per webhook of the
            // backlog, and per request of the reference pass that set `http_only_per_s`.
            "cpu_us_per_webhook": cpu_us_per_webhook,
            "http_only_cpu_us_per_request": http_only_cpu_us,
            // How much of the bare HTTP exchange rate the durable pipeline keeps.
            "per_s_vs_http_only": (capacity / http_only_per_s.max(1.0) * 1000.0).round() / 1000.0,
            "p50_ms": percentile(&lat_ms, 0.50),
            "p99_ms": percentile(&lat_ms, 0.99),
            "target": TARGET_PER_S,
            "concurrency": CONCURRENCY,
            "endpoints": ENDPOINTS,
            "subscribers": SUBSCRIBERS,
            "queue_s": queue_s,
            "queue_per_s": per_s(queued as u64, queue_s),
            "latency_rows": produced,
            "latency_offered_per_s": offered.round(),
            "latency_achieved_per_s": per_s(produced as u64, produce_s),
            "latency_completed_s": (lat_wall_s * 1000.0).round() / 1000.0,
            "received_total": receipts.total.load(Ordering::Relaxed),
            "received_repeats": receipts.repeats.load(Ordering::Relaxed),
        }),
    );
    Ok(())
}
