//! One attempt: the row's subscriber and its `SendPlan` (target and signers made once), the
//! SSRF check, the signed POST, and what its answer means (sent, a retry, a dead letter, a
//! 410, or deferred for want of this process's own resources).

use crate::model::{AttemptRecord, OutboxEntry};
use crate::notify::signing;
use crate::store::{DeadCause, DeliveryResult};
use super::client::{LOCAL_FAILURE_PAUSE_MAX, closed_under_request, local_failure};
use super::retry::{next_retry, parse_retry_after};
use super::{DEFERRED_PREFIX, Deliverer, HTTP_410, HTTP_410_GONE};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What every attempt to one endpoint needs and that changes only when the subscriber does:
/// the target parsed once, the signers keyed once. Parsing the target and decoding and keying
/// the secrets on every attempt cost more than a tenth of an attempt's own instructions
/// (callgrind, issue 7). A plan is used only while the subscriber's target and secrets are
/// the ones it was made from; otherwise it is made again.
pub(super) struct SendPlan {
    target: String,
    secret: Option<String>,
    secret_old: Option<String>,
    /// The target as a URL, or why it is not one (a dead letter).
    url: Result<reqwest::Url, String>,
    /// The signers, new secret first (both sign during a rotation), or why a secret is bad
    /// (a dead letter).
    signers: Result<Vec<signing::Signer>, String>,
}

impl SendPlan {
    fn new(target: &str, secret: Option<&str>, secret_old: Option<&str>) -> SendPlan {
        let url = reqwest::Url::parse(target).map_err(|e| format!("bad_target: {e}"));
        // An old secret that is the new one written another way (`whsec_` left off, a space
        // after it) signs nothing more: one key, one signature.
        let signers = secret
            .into_iter()
            .chain(secret_old.filter(|_| signing::rotating(secret, secret_old)))
            .map(signing::Signer::from_secret)
            .collect::<Result<Vec<_>, String>>()
            .map_err(|e| format!("bad_secret: {e}"));
        SendPlan {
            target: target.to_string(),
            secret: secret.map(str::to_string),
            secret_old: secret_old.map(str::to_string),
            url,
            signers,
        }
    }

    fn made_from(&self, target: &str, secret: Option<&str>, secret_old: Option<&str>) -> bool {
        self.target == target && self.secret.as_deref() == secret && self.secret_old.as_deref() == secret_old
    }
}

/// The dead-letter reason of a row whose subscriber no longer exists when delivery takes it
/// (removed from the config, or deleted over the control port while a send was in flight).
const SUBSCRIBER_GONE: &str = "subscriber_gone";

/// How soon a send must fail on a connection closed under it to be sent again at once (at
/// most half the delivery timeout): the kept-alive race fails in milliseconds.
const RESEND_WITHIN: Duration = Duration::from_secs(1);

/// How long a send that failed for want of this process's own resources waits before it is
/// tried again at least, and at most [`LOCAL_FAILURE_PAUSE_MAX`] ([`Deliverer::deferred`]; jitter
/// of up to as much again comes on top).
const LOCAL_FAILURE_PAUSE: Duration = Duration::from_secs(2);

/// Plans kept at most; past this (subscribers come and go) the cache starts again.
const MAX_PLANS: usize = 100_000;

/// Header names and values that are the same on every webhook, made once.
static CONTENT_TYPE: reqwest::header::HeaderValue = reqwest::header::HeaderValue::from_static("application/json");
static WEBHOOK_ID: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-id");
static WEBHOOK_TIMESTAMP: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-timestamp");
static WEBHOOK_SIGNATURE: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-signature");

/// Why a target was not sent to.
enum TargetCheck {
    /// Never deliverable as it stands: a dead letter.
    Refused(String),
    /// Not resolvable right now: a retry.
    Unresolved(String),
    /// Not looked up for want of this process's own resources (the [`local_failure`] found in
    /// the lookup's error): deferred.
    Local(std::io::Error),
}

/// How much of a response body the attempt log keeps.
const RESPONSE_HEAD_BYTES: usize = 2048;

/// Reads at most `max` bytes of a response body (lossy UTF-8); the rest is not read.
async fn read_head(resp: &mut reqwest::Response, max: usize) -> String {
    let mut buf = Vec::new();
    while buf.len() < max {
        match resp.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk[..chunk.len().min(max - buf.len())]),
            _ => break,
        }
    }
    // Valid UTF-8 (the usual case) is kept as read, without a second copy.
    String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl Deliverer {
    /// One try of one entry: its outcome and the attempt log row that goes with it.
    pub(super) async fn attempt(&self, entry: &OutboxEntry) -> (DeliveryResult, AttemptRecord) {
        let started = Instant::now();
        let mut rec = AttemptRecord {
            key: entry.key.0.clone(),
            outbox_id: entry.id,
            attempt: entry.attempts.saturating_add(1),
            ts_ms: self.clock.now_ms(),
            duration_ms: 0,
            status: None,
            result: String::new(),
            error: None,
            response_head: String::new(),
            next_attempt_ms: None,
            target: None,
            decided_ms: None,
        };
        let result = self.try_send(entry, &mut rec).await;
        rec.duration_ms = started.elapsed().as_millis() as u64;
        match &result {
            DeliveryResult::Sent { .. } => rec.result = "sent".into(),
            DeliveryResult::Retry { next_attempt_ms, error, .. } => {
                rec.result = "retry".into();
                rec.next_attempt_ms = Some(*next_attempt_ms);
                rec.error = Some(error.clone());
            }
            DeliveryResult::Gone { .. } => {
                rec.result = "retry".into();
                rec.next_attempt_ms = Some(rec.ts_ms);
                rec.error = Some(HTTP_410_GONE.into());
            }
            DeliveryResult::Deferred { next_attempt_ms, error, .. } => {
                // Not logged as an attempt (`DeliveryResult::Deferred`); filled in all the same.
                rec.result = "deferred".into();
                rec.next_attempt_ms = Some(*next_attempt_ms);
                rec.error = Some(error.clone());
            }
            DeliveryResult::Dead { reason, .. } => {
                rec.result = "dead_letter".into();
                // Keep what this try got (timeout, http_503) beside why it is final.
                rec.error = Some(match rec.error.take() {
                    Some(e) if e != *reason => format!("{e}; {reason}"),
                    _ => reason.clone(),
                });
            }
        }
        (result, rec)
    }

    async fn try_send(&self, entry: &OutboxEntry, rec: &mut AttemptRecord) -> DeliveryResult {
        let id = entry.id;
        let Some(plan) = self.plan_for(entry) else {
            // Neither the config nor the store has its subscriber any more: nothing to send
            // it to (the row's target is a URL someone removed) and no secret to sign with.
            // A dead letter, replayable should the subscriber come back.
            return DeliveryResult::Dead { id, reason: SUBSCRIBER_GONE.into(), cause: DeadCause::NotSent };
        };
        let url = match &plan.url {
            Ok(url) => url,
            Err(reason) => return DeliveryResult::Dead { id, reason: reason.clone(), cause: DeadCause::NotSent },
        };
        // No retry later than `max_retry_window` after the event was queued, however long it
        // waited (an open breaker, a daemon that was down, a `run` cadence): checked when the
        // retry is taken, not only when it is scheduled. The row that got a 410 goes out once
        // an operator enables its endpoint, as the README says; a row whose last send was
        // deferred (it never left: `deferred`) is sent too, as it stood before (reviewer: a
        // 410 row deferred once after its endpoint was enabled was dead-lettered here).
        // Steps forward of the wall clock are not time the row waited (`store::clock_forward`).
        let waits_without_charge = entry.last_error.as_deref().is_some_and(|e| e == HTTP_410_GONE || e.starts_with(DEFERRED_PREFIX));
        if entry.attempts > 0 && !waits_without_charge && self.past_retry_window(entry, self.now_watched()) {
            return DeliveryResult::Dead { id, reason: "retry_window_exceeded".into(), cause: DeadCause::NotSent };
        }
        // The attempt, its lookup through a proxy included, takes at most `timeout`.
        let attempt_started = Instant::now();
        match self.check_target(url).await {
            Ok(()) => {}
            Err(TargetCheck::Refused(reason)) => return DeliveryResult::Dead { id, reason, cause: DeadCause::NotSent },
            // A name that does not resolve now (through a proxy, checked here) is retried like
            // one the client's resolver cannot resolve: DNS has bad minutes.
            Err(TargetCheck::Unresolved(error)) => return self.retry_or_dead(entry, rec, None, error),
            Err(TargetCheck::Local(local)) => return self.deferred(entry, local),
        }
        // A lookup (through a proxy) that took most of the attempt's time leaves the request
        // none: reqwest fails a zero timeout before it connects, which would read as the
        // endpoint's timeout (a reviewer). It is the name's slowness: retried as DNS is.
        let looked_up = attempt_started.elapsed();
        if looked_up > self.cfg.timeout / 2 {
            return self.retry_or_dead(entry, rec, None, format!("connection: dns: the lookup took {} ms of the {} ms timeout", looked_up.as_millis(), self.cfg.timeout.as_millis()));
        }
        let signers = match &plan.signers {
            Ok(signers) => signers,
            Err(reason) => return DeliveryResult::Dead { id, reason: reason.clone(), cause: DeadCause::NotSent },
        };
        let ts = (self.clock.now_ms() / 1000).to_string();
        let body = bytes::Bytes::from(entry.body());
        // Signed before the body moves into the request (no second copy of it per attempt).
        // During a rotation both signatures go out, space-separated, new one first.
        let mut signature = String::new();
        for signer in signers {
            if !signature.is_empty() {
                signature.push(' ');
            }
            signature.push_str(&signing::sign_with(signer, &entry.key.0, &ts, &body));
        }
        let request = || {
            let req = self
                .client
                .post(url.clone())
                .header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE.clone())
                .header(WEBHOOK_ID.clone(), entry.key.0.as_str())
                .header(WEBHOOK_TIMESTAMP.clone(), ts.as_str())
                .body(body.clone());
            if signature.is_empty() { req } else { req.header(WEBHOOK_SIGNATURE.clone(), signature.as_str()) }
        };
        // The target this try went to: a 410 from one the subscriber has left disables
        // nothing, and a disabled endpoint remembers the target it was disabled for.
        rec.target = Some(plan.target.clone());
        let started = Instant::now();
        let mut sent = request().timeout(self.cfg.timeout.saturating_sub(attempt_started.elapsed())).send().await;
        let failed_after = started.elapsed();
        if failed_after < RESEND_WITHIN.min(self.cfg.timeout / 2) && sent.as_ref().err().is_some_and(closed_under_request) {
            // A connection closed under the request at once: most often a kept-alive one the
            // receiver closed as this request went out on it (it answered the last request
            // without `Connection: close`, then hung up). The same request once more, on a
            // fresh connection, as part of this attempt and within its timeout (a lease
            // outlives no attempt: `lease_ms_for`). It carries the same `webhook-id` a retry
            // would; only the backoff and the breaker's count are spared. A receiver that
            // takes the request and hangs up later (a server's own write timeout) is not sent
            // it again here: that is a failed attempt.
            tracing::info!(id, key = %entry.key.0, url = %crate::util::url_for_display(url.as_str()), "connection closed under the request at once; sending it again on a fresh connection");
            sent = request().timeout(self.cfg.timeout.saturating_sub(attempt_started.elapsed())).send().await;
        }
        let (retry_after, error) = match sent {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                rec.status = Some(status);
                let ra = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| parse_retry_after(v, self.clock.now_ms()));
                rec.response_head = read_head(&mut resp, RESPONSE_HEAD_BYTES).await;
                if (200..300).contains(&status) {
                    crate::telemetry::delivery_latency()
                        .observe(Duration::from_millis(self.clock.now_ms().saturating_sub(entry.created_ms)));
                    return DeliveryResult::Sent { id, status };
                }
                if status == 410 {
                    // Gone: the store disables the endpoint in the transaction that records
                    // this, and the event waits for re-enable, whatever attempts or window it
                    // has left; due at once, so it goes out as soon as an operator enables it
                    // (the disabled endpoint holds it until then). Unless the target that
                    // answered is not its stored subscriber's (a `PUT` moved it meanwhile, a
                    // config subscriber hides a stored one of its id): the commit compares,
                    // and then records this attempt as the failure it otherwise is.
                    let otherwise = Box::new(self.retry_or_dead(entry, rec, ra, HTTP_410.into()));
                    rec.decided_ms = Some(self.clock.now_ms());
                    return DeliveryResult::Gone { id, otherwise };
                } else if !(status == 408 || status == 429 || (500..600).contains(&status)) {
                    return DeliveryResult::Dead { id, reason: format!("rejected_{status}"), cause: DeadCause::Endpoint };
                } else {
                    (ra, format!("http_{status}"))
                }
            }
            Err(e) if e.is_timeout() => (None, "timeout".to_string()),
            Err(e) => {
                if let Some(refused) = crate::netguard::refusal(&e) {
                    return DeliveryResult::Dead { id, reason: format!("private_target_refused: {refused}"), cause: DeadCause::NotSent };
                }
                if let Some(local) = local_failure(&e) {
                    return self.deferred(entry, local);
                }
                // Without the URL: the row names its target, which is shown elsewhere with any
                // password masked (`util::url_for_display`); the error text is stored as it is.
                (None, format!("connection: {}", crate::util::error_chain(&e.without_url())))
            }
        };
        self.retry_or_dead(entry, rec, retry_after, error)
    }

    /// A send this process could not make for want of a resource of its own: queued again
    /// after a pause (plus up to as much jitter, so that a backlog does not come back all at
    /// once), its attempts and its endpoint's health untouched. The pause is
    /// [`LOCAL_FAILURE_PAUSE`], and half of how long the shortage has lasted once that is
    /// more, up to [`LOCAL_FAILURE_PAUSE_MAX`]: a limit that stays is not met by the whole
    /// backlog every few seconds (reviewer). Said once a minute at most, as an error: an
    /// operator must raise the limit (`LimitNOFILE=`).
    fn deferred(&self, entry: &OutboxEntry, local: std::io::Error) -> DeliveryResult {
        static LAST_SAID_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let now = self.clock.now_ms();
        let lasted = self.shortage.lasted(now);
        // On the monotonic clock: after a step back of the wall clock it was silent until the
        // clock passed its old value again.
        if crate::util::now_and_then(&LAST_SAID_MS, 60_000) {
            tracing::error!(
                error = %local,
                "a webhook could not be sent: this process is out of a resource of its own (raise its open-file limit: ulimit -n, or LimitNOFILE= in the service unit); the alerts stay queued and are sent once it has room, nothing is charged to their subscribers"
            );
        }
        let pause = (LOCAL_FAILURE_PAUSE.as_millis() as u64).max(lasted / 2).min(LOCAL_FAILURE_PAUSE_MAX.as_millis() as u64);
        let next_attempt_ms = now.saturating_add(pause).saturating_add(rand::random_range(0..=pause));
        DeliveryResult::Deferred { id: entry.id, next_attempt_ms, error: format!("{DEFERRED_PREFIX}{local}") }
    }

    /// Whether `at_ms` is later than `max_retry_window` after `entry` was queued, the wall
    /// clock's steps forward between the two not counted.
    fn past_retry_window(&self, entry: &OutboxEntry, at_ms: u64) -> bool {
        crate::store::elapsed_ms(&self.store.forward_steps(), entry.created_ms, at_ms) > self.cfg.max_retry_window.as_millis() as u64
    }

    /// A failed try: retried after the schedule's delay (at least `retry_after`), or a dead
    /// letter once the attempts or the retry window are used up.
    fn retry_or_dead(&self, entry: &OutboxEntry, rec: &mut AttemptRecord, retry_after: Option<Duration>, error: String) -> DeliveryResult {
        let id = entry.id;
        let attempts_after = entry.attempts.saturating_add(1);
        rec.error = Some(error.clone());
        let now = self.now_watched();
        match next_retry(&self.cfg, attempts_after, retry_after) {
            None => DeliveryResult::Dead { id, reason: "retries_exhausted".into(), cause: DeadCause::Endpoint },
            Some(delay) => {
                let next = now.saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
                rec.decided_ms = Some(now);
                if self.past_retry_window(entry, next) {
                    return DeliveryResult::Dead { id, reason: "retry_window_exceeded".into(), cause: DeadCause::Endpoint };
                }
                DeliveryResult::Retry { id, next_attempt_ms: next, error }
            }
        }
    }

    /// The SSRF guard's check before a request (`netguard::Guard::check`) on the plan's
    /// parsed target: one without a host or naming a private IP literal is refused here; a
    /// name is checked by the client's resolver on the addresses connected to (through a
    /// proxy, here by a lookup).
    async fn check_target(&self, url: &reqwest::Url) -> Result<(), TargetCheck> {
        let host = url.host_str().ok_or_else(|| TargetCheck::Refused("bad_target: no host".into()))?;
        let port = url.port_or_known_default().unwrap_or(443);
        match self.guard.check(host, port, self.cfg.timeout).await {
            Ok(()) => Ok(()),
            Err(crate::netguard::Refused::Private(p)) => Err(TargetCheck::Refused(format!("private_target_refused: {p}"))),
            // A lookup this process could not make (out of descriptors) is deferred, as a
            // send that could not connect so is (reviewer: through a proxy it was charged).
            Err(e @ crate::netguard::Refused::Dns { .. }) => Err(match e.lookup_error().and_then(|source| local_failure(source)) {
                Some(local) => TargetCheck::Local(local),
                None => TargetCheck::Unresolved(format!("connection: dns: {e}")),
            }),
        }
    }

    /// The [`SendPlan`] for `entry`'s endpoint: the subscriber's current target and secrets;
    /// None for a subscriber since removed (from the config, or deleted over the control
    /// port), whose rows are dead letters `subscriber_gone`.
    fn plan_for(&self, entry: &OutboxEntry) -> Option<Arc<SendPlan>> {
        let sub = self.subscribers.get(&entry.watcher_id)?;
        let (target, secret, secret_old) = (sub.target.as_str(), sub.secret.as_deref(), sub.secret_old.as_deref());
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(plan) = plans.get(&entry.watcher_id) {
            if plan.made_from(target, secret, secret_old) {
                return Some(plan.clone());
            }
        }
        if plans.len() >= MAX_PLANS {
            plans.clear();
        }
        let plan = Arc::new(SendPlan::new(target, secret, secret_old));
        plans.insert(entry.watcher_id.clone(), plan.clone());
        Some(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeliveryConfig;
    use crate::model::OutboxEntry;
    use crate::notify::matcher::SubscriberIndex;
    use crate::store::Store;

    /// A plan is made once per endpoint and made again when the subscriber's target or
    /// secrets change (the control port edits subscribers while `serve` delivers).
    #[test]
    fn send_plans_follow_subscriber_changes() {
        use crate::model::{IdemKey, OutboxPayload, Severity};
        use crate::notify::matcher::Subscriber;
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
        const A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        const B: &str = "whsec_dGhpcyBpcyBhIHNlY29uZCBzZWNyZXQga2V5";
        let sub = |target: &str, secret: Option<&str>, secret_old: Option<&str>| Subscriber {
            id: "w1".into(),
            target: target.into(),
            secret: secret.map(Into::into),
            min_severity: Severity::Info,
            aoi: geo::MultiPolygon::new(vec![]),
            secret_old: secret_old.map(Into::into),
        };
        let subs = Arc::new(SubscriberIndex::build(vec![sub("http://example.com/a", Some(A), None)]));
        let d = Deliverer::new(store, subs.clone(), DeliveryConfig::default()).unwrap();
        let entry = OutboxEntry {
            id: 1,
            key: IdemKey("k".into()),
            watcher_id: "w1".into(),
            target: "http://example.com/queued".into(),
            source_id: "s".into(),
            parcel_id: "p".into(),
            lineage_id: "l".into(),
            severity: Severity::Info,
            payload: OutboxPayload::Built(b"{}".to_vec()),
            attempts: 0,
            created_ms: 0,
            next_attempt_ms: 0,
            last_error: None,
        };
        let first = d.plan_for(&entry).unwrap();
        assert!(Arc::ptr_eq(&first, &d.plan_for(&entry).unwrap()), "made once, then reused");
        assert_eq!(first.url.as_ref().unwrap().as_str(), "http://example.com/a");
        assert_eq!(first.signers.as_ref().unwrap().len(), 1);
        // A rotation: both secrets sign.
        subs.edit().upsert(sub("http://example.com/a", Some(B), Some(A)));
        let rotated = d.plan_for(&entry).unwrap();
        assert!(!Arc::ptr_eq(&first, &rotated));
        assert_eq!(rotated.signers.as_ref().unwrap().len(), 2);
        // The "old" secret is the new one written another way: one key, one signature.
        for old in ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", " whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw "] {
            subs.edit().upsert(sub("http://example.com/a", Some(A), Some(old)));
            assert_eq!(d.plan_for(&entry).unwrap().signers.as_ref().unwrap().len(), 1, "{old:?}");
        }
        // A new target; then a bad secret and a bad target are reasons, not panics.
        subs.edit().upsert(sub("http://example.com/b", Some(B), None));
        assert_eq!(d.plan_for(&entry).unwrap().url.as_ref().unwrap().as_str(), "http://example.com/b");
        subs.edit().upsert(sub("not a url", Some("whsec_%%%"), None));
        let bad = d.plan_for(&entry).unwrap();
        assert!(bad.url.as_ref().unwrap_err().starts_with("bad_target"));
        assert!(bad.signers.as_ref().unwrap_err().starts_with("bad_secret"));
        // A subscriber since removed: no plan (the row is dead-lettered `subscriber_gone`,
        // never sent unsigned to the URL it was queued with).
        subs.edit().remove("w1");
        assert!(d.plan_for(&entry).is_none());
    }
}
