//! Failed sends and dead letters said in the log, per endpoint, at most once a minute.
//!
//! Why it exists: an endpoint's circuit breaker opens only after 10 attempts (and logs it),
//! a 410 disables it (and logs it); short of those, a receiver refusing a small town's two
//! alerts, and the alerts then dead-lettered, left no line at all in `serve`'s log, only a
//! gauge of the outbox's depth (found by a black-box tester playing an operator). One log per
//! deliverer, shared by its passes (`serve` runs a pass after another; one log per pass said
//! each pass's first failure at once, hundreds of lines a minute: a reviewer): an endpoint's
//! failure is said at once when nothing was said of it in the last minute, and what follows
//! is counted and said once that minute is over (at the next outcome commit, or the end of
//! the pass), and when the deliverer goes (`run`'s end), so a receiver down under a county's
//! backlog writes a line a minute, not one per alert.

use crate::store::DeliveryResult;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// The shortest time between two lines about one endpoint.
const EVERY: Duration = Duration::from_secs(60);

/// Failures not said yet, and when each endpoint's were last said.
#[derive(Debug, Default)]
pub struct FailureLog {
    endpoints: HashMap<String, Tally>,
}

/// One endpoint's failures since its last line.
#[derive(Debug, Default)]
struct Tally {
    /// Sends that failed and wait for a retry.
    retried: u64,
    /// When the last of those is tried again (the earliest could be past by the time the
    /// line is said, while the last is what the endpoint waits for: a tester's line named a
    /// retry a second gone when the next was an hour off).
    next_retry_ms: Option<u64>,
    /// Alerts dead-lettered, by reason.
    dead: BTreeMap<String, u64>,
    /// The last failure's error (a connection error, `http_503`, …).
    last_error: Option<String>,
    said_at: Option<Instant>,
}

impl FailureLog {
    /// Counts the outcome of a send to `endpoint` (a sent, deferred or 410 one is not a
    /// failure said here: a 410 is said when it disables the endpoint), and says the
    /// endpoint's count when it has not been said in the last minute.
    pub fn note(&mut self, endpoint: &str, result: &DeliveryResult, error: Option<&str>, now: Instant) {
        if !matches!(result, DeliveryResult::Retry { .. } | DeliveryResult::Dead { .. }) {
            return;
        }
        // The endpoint's name is copied the first time only.
        if !self.endpoints.contains_key(endpoint) {
            self.endpoints.insert(endpoint.to_string(), Tally::default());
        }
        let Some(tally) = self.endpoints.get_mut(endpoint) else { return };
        match result {
            DeliveryResult::Retry { next_attempt_ms, .. } => {
                tally.retried += 1;
                tally.next_retry_ms = Some(*next_attempt_ms);
            }
            DeliveryResult::Dead { reason, .. } => *tally.dead.entry(reason.clone()).or_default() += 1,
            _ => {}
        }
        if let Some(e) = error {
            tally.last_error = Some(e.to_string());
        }
        if tally.said_at.is_none_or(|at| now.saturating_duration_since(at) >= EVERY) {
            tally.say(endpoint);
            tally.said_at = Some(now);
        }
    }

    /// Says what was counted of each endpoint whose last line is a minute old (the end of a
    /// pass).
    pub fn say_due(&mut self, now: Instant) {
        for (endpoint, tally) in &mut self.endpoints {
            if tally.said_at.is_none_or(|at| now.saturating_duration_since(at) >= EVERY) && !tally.is_empty() {
                tally.say(endpoint);
                tally.said_at = Some(now);
            }
        }
    }

    /// Says whatever was counted and not said yet.
    pub fn say_all(&mut self) {
        for (endpoint, tally) in &mut self.endpoints {
            tally.say(endpoint);
        }
    }
}

/// The deliverer is going (the end of `run`, of a replay, of `serve`): nothing counted stays
/// unsaid.
impl Drop for FailureLog {
    fn drop(&mut self) {
        self.say_all();
    }
}

impl Tally {
    fn is_empty(&self) -> bool {
        self.retried == 0 && self.dead.is_empty()
    }

    /// Writes the counts as warnings and starts them again from zero.
    fn say(&mut self, endpoint: &str) {
        let error = crate::util::terminal_safe(self.last_error.as_deref().unwrap_or("no error text"));
        if self.retried > 0 {
            let next = self.next_retry_ms.map(crate::util::rfc3339).unwrap_or_default();
            tracing::warn!(
                endpoint,
                failed = self.retried,
                "delivery to {endpoint}: {} send(s) failed ({error}); the last of them is tried again at {next} (once the receiver is mended, `zonewatch endpoints enable {endpoint}`, or POST /v1/endpoints/{endpoint}/enable under serve, sends what waits now)",
                self.retried
            );
        }
        if !self.dead.is_empty() {
            let n: u64 = self.dead.values().sum();
            let reasons: Vec<String> = self.dead.iter().map(|(r, k)| format!("{r} x{k}")).collect();
            tracing::warn!(
                endpoint,
                dead_lettered = n,
                "delivery to {endpoint}: {n} alert(s) dead-lettered ({}; last error: {error}): `zonewatch dlq list` (GET /v1/deadletters under serve) shows them; `dlq replay` sends them again once the cause is mended",
                reasons.join(", ")
            );
        }
        self.retried = 0;
        self.next_retry_ms = None;
        self.dead.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::DeadCause;

    /// The first failure is said at once and resets the count; the next ones within the
    /// minute are counted, not said; a minute on, they are; `say_all` says the rest.
    #[test]
    fn an_endpoints_failures_are_said_at_once_then_once_a_minute() {
        let t0 = Instant::now();
        let mut log = FailureLog::default();
        let retry = |id| DeliveryResult::Retry { id, next_attempt_ms: 5_000 + id, error: "connection: refused".into() };
        log.note("w", &retry(1), Some("connection: refused"), t0);
        assert_eq!(log.endpoints["w"].retried, 0, "said at once");
        log.note("w", &retry(2), Some("connection: refused"), t0 + Duration::from_secs(1));
        log.note("w", &DeliveryResult::Dead { id: 3, reason: "retries_exhausted".into(), cause: DeadCause::Endpoint }, None, t0 + Duration::from_secs(2));
        log.note("w", &DeliveryResult::Sent { id: 4, status: 200 }, None, t0 + Duration::from_secs(3));
        let w = &log.endpoints["w"];
        assert_eq!((w.retried, w.next_retry_ms, w.dead.get("retries_exhausted").copied()), (1, Some(5_002), Some(1)), "counted within the minute");
        log.note("w", &retry(5), None, t0 + Duration::from_secs(61));
        assert!(log.endpoints["w"].retried == 0 && log.endpoints["w"].dead.is_empty(), "a minute on: said");
        log.note("w", &retry(6), None, t0 + Duration::from_secs(62));
        log.say_due(t0 + Duration::from_secs(100));
        assert_eq!(log.endpoints["w"].retried, 1, "its last line is under a minute old");
        log.say_due(t0 + Duration::from_secs(121));
        assert_eq!(log.endpoints["w"].retried, 0, "a minute on");
        log.note("w", &retry(7), None, t0 + Duration::from_secs(122));
        log.say_all();
        assert_eq!(log.endpoints["w"].retried, 0);
        assert_eq!(log.endpoints["w"].last_error.as_deref(), Some("connection: refused"), "the last error text is kept for the next line");
    }
}
