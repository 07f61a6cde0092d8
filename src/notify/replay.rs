//! Dead-letter replay driver: picks dead letters (by id or time window), oldest observation
//! first, re-validates each payload's geometry, re-queues it under its original key through a
//! token bucket (`--rate`) and delivers it. The store decides duplicate / quarantine / requeue
//! in one transaction ([`Store::replay_dead_letter`]).

use crate::model::DeadLetter;
use crate::notify::delivery::{Deliverer, DeliveryError, PassStats};
use crate::store::{ReplayOutcome, Store};
use crate::util::parse_rfc3339;
use std::time::{Duration, Instant};

/// A token bucket: `rate` tokens per second, holding at most `burst`.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket. `rate` must be positive; `burst` is at least 1.
    pub fn new(rate: f64, burst: f64, now: Instant) -> TokenBucket {
        let burst = burst.max(1.0);
        TokenBucket { rate: rate.max(1e-6), burst, tokens: burst, last: now }
    }

    /// Takes one token at `now`, or says how long to wait for one.
    pub fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }

    /// How long until a token is there at `now` (zero: one is), without taking it.
    pub fn until_available(&mut self, now: Instant) -> Duration {
        self.refill(now);
        if self.tokens >= 1.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - self.tokens) / self.rate)
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
    }

    /// Waits for and takes one token.
    pub async fn take(&mut self) {
        while let Err(wait) = self.try_take(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Checks that a dead letter's geometry is still a valid (multi)polygon: read from the row's
/// change fields, or from the `data.geometry` of a body built by an older zonewatch.
pub fn validate_entry_geometry(entry: &crate::model::OutboxEntry) -> Result<(), String> {
    match &entry.payload {
        crate::model::OutboxPayload::Change(c) => match &c.geometry {
            None => Err("payload has no geometry".into()),
            Some(g) => crate::notify::aoi::parse_aoi(&g.to_geojson().to_string()).map(|_| ()),
        },
        crate::model::OutboxPayload::Built(body) => validate_payload_geometry(body),
    }
}

/// Checks that a stored payload's `data.geometry` is still a valid (multi)polygon.
pub fn validate_payload_geometry(body: &[u8]) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("payload is not JSON: {e}"))?;
    match v.get("data").and_then(|d| d.get("geometry")) {
        None | Some(serde_json::Value::Null) => Err("payload has no geometry".into()),
        Some(g) => crate::notify::aoi::parse_aoi(&g.to_string()).map(|_| ()),
    }
}

/// When the change in a dead letter was observed (`data.observed_at`), else when it was queued.
pub fn observed_ms(dl: &DeadLetter) -> u64 {
    if let crate::model::OutboxPayload::Change(c) = &dl.entry.payload {
        return c.observed_at_ms;
    }
    serde_json::from_slice::<serde_json::Value>(&dl.entry.body())
        .ok()
        .and_then(|v| v.get("data")?.get("observed_at")?.as_str().and_then(parse_rfc3339))
        .unwrap_or(dl.entry.created_ms)
}

/// Whether a dead letter waits for its subscriber: none of its id exists (deleted over the
/// control port, or removed from the config). A replay would only dead-letter it again
/// (`subscriber_gone`) and count one more replay toward `max_replays`, so `dlq replay` and
/// `POST /v1/deadletters/replay` leave it as it is until a subscriber of that id exists.
pub fn waits_for_subscriber(dl: &DeadLetter, subscribers: &crate::notify::matcher::SubscriberIndex) -> bool {
    subscriber_missing(&dl.entry.watcher_id, subscribers)
}

/// Whether no subscriber of `watcher_id` exists (see [`waits_for_subscriber`]).
pub fn subscriber_missing(watcher_id: &str, subscribers: &crate::notify::matcher::SubscriberIndex) -> bool {
    subscribers.get(watcher_id).is_none()
}

/// The most letters requeued before a delivery pass sends them.
const REPLAY_BATCH: usize = 256;

/// What a replay came to.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplayReport {
    pub requeued: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    pub not_found: u64,
    pub delivery: PassStats,
}

/// Replays `letters` oldest observation first through a token bucket of `rate` per second,
/// delivering as it goes, then drains until `deadline` for retries.
pub async fn replay(
    store: &Store,
    deliverer: &Deliverer,
    mut letters: Vec<DeadLetter>,
    rate: f64,
    max_replays: u32,
    deadline: Instant,
) -> Result<ReplayReport, DeliveryError> {
    letters.sort_by_key(|d| (observed_ms(d), d.entry.id));
    // Up to a tenth of a second's tokens kept while a pass sends, so that they make a batch.
    let mut bucket = TokenBucket::new(rate, (rate / 10.0).clamp(1.0, REPLAY_BATCH as f64), Instant::now());
    let mut report = ReplayReport::default();
    // A letter of a disabled endpoint is requeued without a token: nothing goes to that
    // endpoint until an operator enables it (its rows wait in the outbox, as documented), so
    // pacing it only made the replay last as long as all its letters' tokens (bb28: after a
    // 410 the rest of a large replay took the whole time and sent nothing).
    let mut disabled = store.disabled_endpoints()?;
    let mut letters = letters.into_iter().peekable();
    loop {
        while let Some(dl) = letters.next_if(|d| disabled.contains(d.entry.watcher_id.as_str())) {
            requeue(store, deliverer, &dl, max_replays, &mut report)?;
        }
        let Some(first) = letters.next() else { break };
        // The letters whose tokens are there (the bucket refills while the pass below sends),
        // then one pass for all of them: a pass per letter, each a send and a durable commit
        // waited for, held a replay near 20 a second whatever `--rate` said (bb26).
        bucket.take().await;
        let mut batch = vec![first];
        while batch.len() < REPLAY_BATCH {
            // A disabled endpoint's letter among them is requeued at once, and the batch goes
            // on: letters of one change to many subscribers come in turn, and ending the batch
            // there made a pass per letter again (a reviewer).
            if let Some(dl) = letters.next_if(|d| disabled.contains(d.entry.watcher_id.as_str())) {
                requeue(store, deliverer, &dl, max_replays, &mut report)?;
                continue;
            }
            if letters.peek().is_none() || bucket.try_take(Instant::now()).is_err() {
                break;
            }
            batch.extend(letters.next());
        }
        let mut requeued = false;
        for dl in &batch {
            requeued |= requeue(store, deliverer, dl, max_replays, &mut report)?;
        }
        if requeued {
            // A pump of what is due now: it holds back the rows of an endpoint that answers
            // 410 or trips its breaker meanwhile, as `serve` does (a one-pass `deliver_due`
            // would send every leased row of a gone endpoint).
            let pass = deliverer.pump_until(None, Some(deliverer.now_ms())).await?;
            // A failure may have disabled an endpoint (410, `disable_after`).
            if pass.gone + pass.retried + pass.dead > 0 {
                disabled = store.disabled_endpoints()?;
            }
            report.delivery += pass;
        }
    }
    // Nothing requeued, nothing to wait for: a replay that found no dead letter sent the
    // other alerts a stopped `run` had left queued, past `--rate`, as its own (found by a
    // black-box tester). (The passes above, like `run`'s, send what else is due.)
    if report.requeued > 0 {
        report.delivery += deliverer.drain(deadline).await?;
    }
    Ok(report)
}

/// Replays one dead letter (geometry re-validated); whether it was requeued.
fn requeue(store: &Store, deliverer: &Deliverer, dl: &DeadLetter, max_replays: u32, report: &mut ReplayReport) -> Result<bool, DeliveryError> {
    let geometry = validate_entry_geometry(&dl.entry);
    match store.replay_dead_letter(dl.entry.id, deliverer.now_ms(), max_replays, geometry)? {
        ReplayOutcome::Requeued { .. } => {
            report.requeued += 1;
            return Ok(true);
        }
        ReplayOutcome::Duplicate => report.duplicates += 1,
        ReplayOutcome::Quarantined { .. } => report.quarantined += 1,
        ReplayOutcome::NotFound => report.not_found += 1,
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_paces_after_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, 1.0, t0);
        assert!(b.try_take(t0).is_ok());
        let wait = b.try_take(t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert!(b.try_take(t0 + Duration::from_millis(500)).is_ok());
        // Idle time refills only up to the burst.
        let later = t0 + Duration::from_secs(60);
        assert!(b.try_take(later).is_ok());
        assert!(b.try_take(later).is_err());
    }

    #[test]
    fn geometry_is_revalidated() {
        let ok = br#"{"data":{"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}}"#;
        assert!(validate_payload_geometry(ok).is_ok());
        assert!(validate_payload_geometry(br#"{"data":{"geometry":{"type":"Point","coordinates":[0,0]}}}"#).is_err());
        assert!(validate_payload_geometry(br#"{"data":{}}"#).is_err());
        assert!(validate_payload_geometry(b"not json").is_err());
    }
}
