//! Delivery workers: take due outbox rows, POST them (signed), and record each outcome in the
//! store in batches (group commit).
//!
//! * 2xx → `sent`; 408/429/5xx, timeouts and connection errors → retry with capped
//!   exponential backoff and full jitter, honouring `Retry-After`; any other status (including
//!   3xx: redirects are never followed) → dead letter `rejected_<status>`; attempts exhausted
//!   → dead letter `retries_exhausted`; a retry taken past `max_retry_window` → dead letter
//!   `retry_window_exceeded`, not sent; 410 → the endpoint disabled, the row kept for an
//!   operator whatever its attempts or window.
//! * A request whose connection is closed under it at once (a kept-alive connection the
//!   receiver hung up as it arrived) goes once more on a fresh connection, within the same
//!   attempt and its timeout.
//! * A row whose subscriber no longer exists (removed from the config, or deleted over the
//!   control port while a send of it was in flight) is not sent: dead letter
//!   `subscriber_gone`, whatever its endpoint's health.
//! * A target resolving to a loopback, private or link-local address is refused unless
//!   `allow_private_targets` is set (`crate::netguard`: checked on the addresses connected
//!   to, so a DNS answer that changes between a check and the connect is caught too).

use crate::config::DeliveryConfig;
use crate::model::{AttemptRecord, OutboxEntry};
use crate::notify::matcher::SubscriberIndex;
use crate::notify::signing;
use crate::store::{DeadCause, DeliveryResult, LeaseStep, Store, StoreError};
use crate::clock::SharedClock;
use crate::notify::replay::TokenBucket;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Errors that stop delivery (a failed send is a retry or a dead letter, not an error).
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    /// A task of the delivery pass ended without its answer (it panicked: a store file that
    /// made redb panic, say; the command then reports the damage).
    #[error("a delivery task failed: {0}")]
    Task(String),
}

/// What one delivery pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct PassStats {
    pub attempted: u64,
    pub sent: u64,
    /// Sends that failed and will be tried again (a 410 is not one: see `gone`).
    pub retried: u64,
    pub dead: u64,
    /// Sends the receiver answered 410 Gone: the endpoint is disabled and its rows wait for
    /// an operator (`endpoints enable`, a new target), not for a retry.
    pub gone: u64,
    /// Sends that never left this machine (it ran out of file descriptors, socket buffers or
    /// memory): queued again, nothing charged to the row or its endpoint
    /// (`DeliveryResult::Deferred`).
    pub deferred: u64,
    /// Outcome transactions committed (group commits).
    pub commits: u64,
    /// When the pass ended with due rows held back by an open circuit breaker: the earliest
    /// time one of those breakers lets its probe through (ms). Summed stats keep the later
    /// pass's value: it is a fact about where a pass ended, not a count.
    pub held_until_ms: Option<u64>,
    /// The pass ended on a lease pass that found nothing to send but stopped at its
    /// pass-over bound (a held backlog): rows past that point were not read. Summed stats
    /// keep the later pass's value.
    pub lease_capped: bool,
}

impl PassStats {
    /// Counts one send's result.
    fn count(&mut self, result: &DeliveryResult) {
        self.attempted += 1;
        match result {
            DeliveryResult::Sent { .. } => self.sent += 1,
            DeliveryResult::Gone { .. } => self.gone += 1,
            DeliveryResult::Retry { .. } => self.retried += 1,
            DeliveryResult::Dead { .. } => self.dead += 1,
            DeliveryResult::Deferred { .. } => self.deferred += 1,
        }
    }

    /// Moves the 410s the commit recorded as the failures they otherwise are (`not_gone`:
    /// each row with whether it was dead-lettered) from `gone` to `retried` or `dead`: their
    /// endpoints were not disabled.
    fn not_gone(&mut self, not_gone: &[(u64, bool)]) {
        for &(_, dead) in not_gone {
            self.gone = self.gone.saturating_sub(1);
            if dead {
                self.dead += 1;
            } else {
                self.retried += 1;
            }
        }
    }
}

impl std::ops::AddAssign for PassStats {
    fn add_assign(&mut self, o: PassStats) {
        self.attempted += o.attempted;
        self.sent += o.sent;
        self.retried += o.retried;
        self.dead += o.dead;
        self.gone += o.gone;
        self.deferred += o.deferred;
        self.commits += o.commits;
        self.held_until_ms = o.held_until_ms;
        self.lease_capped = o.lease_capped;
    }
}

/// Rows leased per lease transaction by [`Deliverer::pump`].
pub const PIPE_LEASE_BATCH: usize = 1_024;
/// At most this many leased entries wait for their outcome commit in [`Deliverer::pump`].
pub const PIPE_MAX_OUTSTANDING: usize = 4_096;
/// At most this many outcomes per group commit.
pub const PIPE_COMMIT_MAX: usize = 8_192;

/// One finished attempt on its way to the committer.
struct Outcome {
    result: DeliveryResult,
    attempt: AttemptRecord,
    /// The subscriber whose endpoint it went to, when the send failed (for the failure log;
    /// not cloned for every send that went through).
    failed_endpoint: Option<String>,
    /// The endpoint whose half-open probe this was.
    probe_of: Option<String>,
    /// The endpoint, when it answered 410 Gone (its disable lands with this outcome's commit).
    gone: Option<String>,
}

/// One leased row's place in [`Deliverer::pump_until`]'s counts, given back when its send
/// task ends however it ends: its endpoint's count always; the window's (`outstanding`) only
/// when no outcome went to the committer (which counts those off after their commit). A
/// send that stopped before it began, or a task that panicked, would otherwise hold its
/// place for ever, and the pump wait on a count that never falls. (Its row keeps its lease
/// and goes out again when the lease ends: nothing is lost.)
struct Pending {
    outstanding: Arc<std::sync::atomic::AtomicUsize>,
    per_endpoint: Arc<Mutex<HashMap<String, usize>>>,
    committed: Arc<tokio::sync::Notify>,
    watcher: String,
    outcome_sent: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut g = self.per_endpoint.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = g.get_mut(&self.watcher) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                g.remove(&self.watcher);
            }
        }
        drop(g);
        if !self.outcome_sent {
            self.outstanding.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            self.committed.notify_one();
        }
    }
}

/// Sends the outbox. Cheap to clone (all shared state is behind `Arc`).
#[derive(Clone)]
pub struct Deliverer {
    store: Arc<Store>,
    subscribers: Arc<SubscriberIndex>,
    cfg: DeliveryConfig,
    client: reqwest::Client,
    /// The SSRF guard `client` was built with.
    guard: crate::netguard::Guard,
    /// Per-endpoint (subscriber) concurrency slots and token buckets.
    endpoint_slots: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
    endpoint_buckets: Arc<Mutex<HashMap<String, TokenBucket>>>,
    /// Per-endpoint [`SendPlan`]s: what every attempt to an endpoint needs, made once.
    plans: Arc<Mutex<HashMap<String, Arc<SendPlan>>>>,
    /// Where lease, due and outcome times come from (see `clock.rs`).
    clock: SharedClock,
    /// How long this deliverer has been short of its own resources ([`Deliverer::deferred`]).
    shortage: Arc<LocalShortage>,
    /// Failed sends and dead letters not said in the log yet (`failure_log.rs`), shared by
    /// every pass of this deliverer.
    failures: Arc<Mutex<super::failure_log::FailureLog>>,
    /// A drain's deadline: a row whose endpoint's rate token would come after it is left
    /// queued rather than waited for (`Deliverer::drain_until`).
    rate_deadline: Option<Instant>,
}

/// What every attempt to one endpoint needs and that changes only when the subscriber does:
/// the target parsed once, the signers keyed once. Parsing the target and decoding and keying
/// the secrets on every attempt cost more than a tenth of an attempt's own instructions
/// (callgrind, issue 7). A plan is used only while the subscriber's target and secrets are
/// the ones it was made from; otherwise it is made again.
struct SendPlan {
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
pub const SUBSCRIBER_GONE: &str = "subscriber_gone";

/// The attempt error of a 410: the store disables the endpoint on it, and the row waits for
/// an operator to enable it (never a dead letter on its own account).
pub const HTTP_410_GONE: &str = "http_410_gone";

/// The attempt error of a 410 the store did not take as its endpoint's
/// ([`DeliveryResult::Gone`]'s `otherwise`): an ordinary failure.
pub const HTTP_410: &str = "http_410";

/// Stores the steps forward of the clock not stored yet; a failure is tried again at the next
/// look, and said once an hour (the next outcome commit stores them too). Blocking.
pub(crate) fn save_forward_steps(store: &Store) {
    static SAID_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    match store.save_forward_steps() {
        Err(e) if crate::util::now_and_then(&SAID_MS, 3_600_000) => tracing::warn!("cannot store the steps forward of the system clock: {e}"),
        _ => {}
    }
}

/// Now by `clock`, looked at for a step forward by `store` (logged when one is found).
pub(crate) fn now_watched(clock: &SharedClock, store: &Store) -> u64 {
    let (now, step) = store.watch_clock_reading(|| (clock.now_ms(), clock.mono_ms()));
    if let Some(step) = step {
        crate::store::say_forward_step(&step);
    }
    now
}

/// Plans kept at most; past this (subscribers come and go) the cache starts again.
const MAX_PLANS: usize = 100_000;

/// Header names and values that are the same on every webhook, made once.
static CONTENT_TYPE: reqwest::header::HeaderValue = reqwest::header::HeaderValue::from_static("application/json");
static WEBHOOK_ID: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-id");
static WEBHOOK_TIMESTAMP: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-timestamp");
static WEBHOOK_SIGNATURE: reqwest::header::HeaderName = reqwest::header::HeaderName::from_static("webhook-signature");

impl Deliverer {
    pub fn new(store: Arc<Store>, subscribers: Arc<SubscriberIndex>, cfg: DeliveryConfig) -> Result<Deliverer, DeliveryError> {
        let guard = crate::netguard::Guard::new(cfg.allow_private_targets);
        let client = http_client_with(&cfg, guard)?;
        Ok(Deliverer {
            store,
            subscribers,
            cfg,
            client,
            guard,
            endpoint_slots: Default::default(),
            endpoint_buckets: Default::default(),
            plans: Default::default(),
            clock: crate::clock::system(),
            shortage: Arc::default(),
            failures: Arc::default(),
            rate_deadline: None,
        })
    }

    /// Puts the stored retry and breaker times right after the wall clock stepped back
    /// (`store::clock_step`). Looked at before every pass, so `serve`, `run` and `deliver` all
    /// see a step, one taken while zonewatch was stopped too. A failure here is logged and the
    /// pass goes on: the rows are still there, only late.
    /// A step forward found by an earlier look is stored here too, if no outcome commit has
    /// stored it yet (`store::clock_forward`).
    async fn settle_clock_step(&self) {
        let now = self.now_watched();
        if self.store.forward_steps_unsaved() {
            let store = self.store.clone();
            let _ = tokio::task::spawn_blocking(move || save_forward_steps(&store)).await;
        }
        match self.store.clock_stepped_back(now) {
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("cannot read the clock of the last delivery outcome: {e}");
                return;
            }
        }
        let store = self.store.clone();
        let moved = tokio::task::spawn_blocking(move || store.move_due_times_back(now)).await.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string()));
        match moved {
            Ok(Some(m)) => crate::store::say_moved(&m),
            Ok(None) => {}
            Err(e) => tracing::error!("the system clock went back, and moving the stored retry times failed: {e}"),
        }
    }

    /// Now by the deliverer's clock.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Now by the deliverer's clock, looked at for a step forward (`store::clock_forward`):
    /// where a row is held to a limit counted in elapsed time.
    fn now_watched(&self) -> u64 {
        now_watched(&self.clock, &self.store)
    }

    /// The same deliverer with time taken from `clock` (the engine's, so that tests with a
    /// manual clock see consistent due times).
    pub fn with_clock(mut self, clock: SharedClock) -> Deliverer {
        self.clock = clock;
        self
    }

    /// One pass: lease due entries (fresh ahead of retries), send them (bounded by
    /// `concurrency`), then record all outcomes and attempt log rows in one transaction.
    /// The lease outlives the worst case of the pass (every slot timing out in turn), so no
    /// other pass can take an entry that is still in flight.
    ///
    /// A step for tests that watch one pass at a time: every row it leased is sent (but one
    /// an operator's action resolved meanwhile, [`LeaseStep::BeginSend`]), even to
    /// an endpoint that answered 410 or tripped its breaker earlier in the pass. Delivery
    /// (`serve`, `run`, `dlq replay`) goes through [`Deliverer::pump_until`], which holds
    /// such rows back.
    pub async fn deliver_due(&self) -> Result<PassStats, DeliveryError> {
        let limit = self.cfg.concurrency * 4;
        let retry_floor = (limit / 4).max(1);
        // A pass leases up to `limit` rows plus at least `retry_floor` retries.
        let lease_ms = self.lease_ms_for(limit + retry_floor);
        let store = self.store.clone();
        let now = self.clock.now_ms();
        let subs = self.subscribers.clone();
        let leased = tokio::task::spawn_blocking(move || {
            store.lease_due_probing(now, lease_ms, limit, retry_floor, &HashSet::new(), &|id| subs.get(id).is_some(), &|_| usize::MAX)
        })
            .await
            .map_err(|e| DeliveryError::Task(format!("lease task: {e}")))??;
        let lease_until = leased.lease_until_ms;
        let batch = leased.entries;
        if batch.is_empty() {
            return Ok(PassStats::default());
        }
        let sem = Arc::new(Semaphore::new(self.cfg.concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        let shared = Arc::new(self.clone());
        for entry in batch.iter().cloned() {
            let this = shared.clone();
            let sem = sem.clone();
            tasks.spawn(async move {
                // The endpoint's slot first, so a slow endpoint never holds global slots idle.
                let _slot = this.endpoint_slot(&entry.watcher_id).acquire_owned().await;
                let ready = this.endpoint_rate_ready(&entry.watcher_id).await;
                let _permit = sem.acquire_owned().await;
                // Not sent if an operator resolved it meanwhile (see the pump), nor when its
                // rate token comes after a drain's deadline (its lease given back).
                if !(ready && this.endpoint_rate_wait(&entry.watcher_id).await) {
                    this.lease_step(entry.id, lease_until, LeaseStep::GiveBack).await;
                    return None;
                }
                if !this.lease_step(entry.id, lease_until, LeaseStep::BeginSend).await {
                    return None;
                }
                Some((this.attempt(&entry).await, entry.watcher_id))
            });
        }
        let mut results = Vec::with_capacity(batch.len());
        let mut log = Vec::with_capacity(batch.len());
        while let Some(r) = tasks.join_next().await {
            match r {
                Ok(Some(((res, rec), endpoint))) => {
                    self.failures.lock().unwrap_or_else(|p| p.into_inner()).note(&endpoint, &res, rec.error.as_deref(), Instant::now());
                    results.push(res);
                    log.push(rec);
                }
                Ok(None) => {}
                Err(e) => tracing::error!("delivery task failed: {e}"),
            }
        }
        self.failures.lock().unwrap_or_else(|p| p.into_inner()).say_due(Instant::now());
        let mut stats = PassStats::default();
        for r in &results {
            stats.count(r);
        }
        let store = self.store.clone();
        let policy = crate::store::HealthPolicy {
            breaker_cooldown_ms: self.cfg.breaker_cooldown.as_millis() as u64,
            disable_after_ms: self.cfg.disable_after.as_millis() as u64,
            ..Default::default()
        };
        let now = self.now_watched();
        match tokio::task::spawn_blocking(move || store.record_outcomes_with(&results, &log, now, Some(&policy))).await {
            Ok(r) => {
                stats.not_gone(&r?.not_gone);
                stats.commits += 1;
            }
            Err(e) => tracing::error!("recording deliveries failed: {e}"),
        }
        Ok(stats)
    }

    /// How long a lease must last when up to `outstanding` leased entries may be ahead of an
    /// entry's outcome commit: every slot timing out in turn, globally and per endpoint, plus
    /// a rate-limited endpoint's whole share.
    ///
    /// The bound holds for any `outstanding` a caller passes, so callers pass the most a pass
    /// can lease (its fresh limit plus its retry floor). Saturating throughout: a huge
    /// `timeout_ms` or a tiny `endpoint_rate` gives a long lease, never a wrapped short one.
    fn lease_ms_for(&self, outstanding: usize) -> u64 {
        let rounds_of = |slots: usize| u32::try_from(outstanding.div_ceil(slots.max(1))).unwrap_or(u32::MAX).saturating_add(1);
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        // Every global slot, or every slot of the one endpoint that has the whole batch,
        // timing out in turn.
        let slots_ms = ms(self.cfg.timeout.saturating_mul(rounds_of(self.cfg.concurrency)))
            .max(ms(self.cfg.timeout.saturating_mul(rounds_of(self.cfg.endpoint_concurrency))));
        // A rate-limited endpoint waits for its tokens while it holds its slots: the whole
        // batch at its rate comes on top (a float cast saturates).
        let rate_ms = if self.cfg.endpoint_rate > 0.0 { (outstanding as f64 / self.cfg.endpoint_rate * 1000.0) as u64 } else { 0 };
        slots_ms.saturating_add(rate_ms).saturating_add(5_000)
    }

    /// Pipelined delivery until nothing is due: leasing, sending and recording overlap.
    ///
    /// * the **leaser** (this task) leases batches of [`PIPE_LEASE_BATCH`] (fresh ahead of
    ///   retries) whenever fewer than [`PIPE_MAX_OUTSTANDING`] leased entries await their
    ///   outcome commit; leases live in memory and leasing takes no write lock (a lease never
    ///   outlives its process);
    /// * each leased entry is a task bounded by the global `concurrency` and the endpoint's
    ///   slots and rate, exactly as in [`Deliverer::deliver_due`];
    /// * the **committer** takes every outcome that has arrived (up to [`PIPE_COMMIT_MAX`]) and
    ///   records them — outbox row removed, terminal audit row, attempt rows, endpoint health —
    ///   in one durable transaction, then drops their leases, while the next outcomes accumulate:
    ///   a group commit whose size follows the load.
    ///
    /// Exactly-once is unchanged: an entry keeps its lease until the transaction holding its
    /// outcome commits, so a crash between the send and that commit leaves the row in the
    /// outbox (a new process holds no leases) and it is sent again under the same key.
    pub async fn pump(&self) -> Result<PassStats, DeliveryError> {
        self.pump_until(None, None).await
    }

    /// [`Deliverer::pump`] that stops leasing once `stop` reads true; the sends already begun
    /// finish and their outcomes are committed before it returns, and leased rows whose send
    /// has not begun (waiting for an endpoint slot) are left queued, unsent (a graceful stop
    /// of `serve` or `run`).
    /// With `due_by` (clock ms), only rows due by then are leased: a retry falling due later
    /// is left for the next pass, however long the sends in flight take (`run`'s `run_wait`).
    pub async fn pump_until(&self, stop: Option<&tokio::sync::watch::Receiver<bool>>, due_by: Option<u64>) -> Result<PassStats, DeliveryError> {
        self.settle_clock_step().await;
        let lease_batch = PIPE_LEASE_BATCH.max(self.cfg.concurrency * 4);
        let max_outstanding = PIPE_MAX_OUTSTANDING.max(lease_batch * 2);
        let retry_floor = (lease_batch / 4).max(1);
        // A lease pass may add its retry floor on top of what it was asked for, so up to
        // `max_outstanding + retry_floor` rows can be ahead of the last one leased.
        let lease_ms = self.lease_ms_for(max_outstanding + retry_floor);
        let outstanding = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Leased rows per endpoint whose send has not ended, and the most one endpoint may
        // have: a quarter of the window (or four rounds of its slots, if more). One slow or
        // hanging endpoint's backlog then holds at most that much of the window, and every
        // other endpoint's rows are still leased past it.
        let per_endpoint: Arc<Mutex<HashMap<String, usize>>> = Default::default();
        let endpoint_share = (max_outstanding / 4).max(self.cfg.endpoint_concurrency.saturating_mul(4));
        let committed = Arc::new(tokio::sync::Notify::new());
        let probing: Arc<Mutex<HashSet<String>>> = Default::default();
        let gates: Arc<super::closed_gates::ClosedGates> = Default::default();
        let sem = Arc::new(Semaphore::new(self.cfg.concurrency.max(1)));
        let (otx, mut orx) = tokio::sync::mpsc::unbounded_channel::<Outcome>();

        let committer = {
            let store = self.store.clone();
            let clock = self.clock.clone();
            let outstanding = outstanding.clone();
            let committed = committed.clone();
            let probing = probing.clone();
            let gates = gates.clone();
            let failures = self.failures.clone();
            let policy = crate::store::HealthPolicy {
                breaker_cooldown_ms: self.cfg.breaker_cooldown.as_millis() as u64,
                disable_after_ms: self.cfg.disable_after.as_millis() as u64,
                ..Default::default()
            };
            tokio::spawn(async move {
                let mut stats = PassStats::default();
                let mut failure: Option<DeliveryError> = None;
                while let Some(first) = orx.recv().await {
                    let mut batch = vec![first];
                    while batch.len() < PIPE_COMMIT_MAX {
                        match orx.try_recv() {
                            Ok(o) => batch.push(o),
                            Err(_) => break,
                        }
                    }
                    let n = batch.len();
                    let mut results = Vec::with_capacity(n);
                    let mut log = Vec::with_capacity(n);
                    let mut probes_done = Vec::new();
                    // (endpoint, row) of each 410 answered.
                    let mut gone_now: Vec<(String, u64)> = Vec::new();
                    {
                        let mut said = failures.lock().unwrap_or_else(|p| p.into_inner());
                        let at = Instant::now();
                        for o in &batch {
                            if let Some(endpoint) = &o.failed_endpoint {
                                said.note(endpoint, &o.result, o.attempt.error.as_deref(), at);
                            }
                        }
                        // Other endpoints' counts too, whose last line is a minute old: an
                        // endpoint that failed and then had nothing more to send waited for
                        // the end of the pump (hours, draining a county's backlog).
                        said.say_due(at);
                    }
                    for o in batch {
                        stats.count(&o.result);
                        if let Some(p) = o.probe_of {
                            probes_done.push(p);
                        }
                        gone_now.extend(o.gone.map(|endpoint| (endpoint, o.result.id())));
                        results.push(o.result);
                        log.push(o.attempt);
                    }
                    let st = store.clone();
                    let tc = Instant::now();
                    let now = now_watched(&clock, &store);
                    let r = tokio::task::spawn_blocking(move || st.record_outcomes_with(&results, &log, now, Some(&policy))).await;
                    tracing::debug!(n, ms = tc.elapsed().as_secs_f64() * 1000.0, "outcome group commit");
                    let (closed, not_gone) = match r {
                        Ok(Ok(recorded)) => {
                            stats.commits += 1;
                            stats.not_gone(&recorded.not_gone);
                            (recorded.closed, recorded.not_gone.into_iter().map(|(id, _)| id).collect::<HashSet<u64>>())
                        }
                        Ok(Err(e)) => {
                            // The entries keep their leases: they go out again (same key) once
                            // the leases expire or the store is next opened.
                            tracing::error!("recording {n} delivery outcomes failed: {e}");
                            failure.get_or_insert(DeliveryError::Store(e));
                            (Vec::new(), HashSet::new())
                        }
                        Err(e) => {
                            tracing::error!("recording deliveries failed: {e}");
                            failure.get_or_insert(DeliveryError::Task(format!("outcome task: {e}")));
                            (Vec::new(), HashSet::new())
                        }
                    };
                    // A 410 whose commit failed is let go as well: the store does not hold its
                    // endpoint, so later passes lease its rows again and the 410 that comes back
                    // is recorded then (rather than its rows held for the rest of the pump).
                    // An endpoint whose 410s were all recorded as failures (not its stored
                    // subscriber's target) closed nothing: its leased rows go out as usual.
                    let mut all_not_gone: HashMap<&str, bool> = HashMap::new();
                    for (endpoint, id) in &gone_now {
                        *all_not_gone.entry(endpoint.as_str()).or_insert(true) &= not_gone.contains(id);
                    }
                    for endpoint in &closed {
                        all_not_gone.insert(endpoint.as_str(), false);
                    }
                    for (endpoint, reopened) in all_not_gone {
                        if reopened {
                            gates.not_closed(endpoint);
                        } else {
                            gates.closed_by_commit(endpoint);
                        }
                    }
                    {
                        let mut g = probing.lock().unwrap_or_else(|p| p.into_inner());
                        for p in probes_done {
                            g.remove(&p);
                        }
                    }
                    outstanding.fetch_sub(n, std::sync::atomic::Ordering::SeqCst);
                    committed.notify_one();
                }
                failures.lock().unwrap_or_else(|p| p.into_inner()).say_due(Instant::now());
                (stats, failure)
            })
        };

        // One shared handle for the send tasks: cloning the deliverer itself copies its config.
        let shared = Arc::new(self.clone());
        let mut lease_error = None;
        let mut held_until_ms = None;
        let mut lease_capped = false;
        loop {
            if stop.is_some_and(|s| *s.borrow()) {
                break;
            }
            let out = outstanding.load(std::sync::atomic::Ordering::SeqCst);
            if out + lease_batch / 2 > max_outstanding {
                // Bounded wait, so a stop request is seen even while outcomes are slow.
                let _ = tokio::time::timeout(Duration::from_millis(100), committed.notified()).await;
                continue;
            }
            let want = lease_batch.min(max_outstanding - out);
            let store = self.store.clone();
            let skip = probing.lock().map(|g| g.clone()).unwrap_or_default();
            let tl = Instant::now();
            let now = due_by.map_or(self.clock.now_ms(), |by| self.clock.now_ms().min(by));
            let subs = self.subscribers.clone();
            let held = per_endpoint.lock().map(|g| g.clone()).unwrap_or_default();
            let held_back = gates.held_back();
            let room = move |id: &str| if held_back.contains(id) { 0 } else { endpoint_share.saturating_sub(held.get(id).copied().unwrap_or(0)) };
            let pass = gates.begin_pass();
            let leased = tokio::task::spawn_blocking(move || store.lease_due_probing(now, lease_ms, want, retry_floor, &skip, &|id| subs.get(id).is_some(), &room)).await;
            tracing::debug!(out, ms = tl.elapsed().as_secs_f64() * 1000.0, n = leased.as_ref().map(|r| r.as_ref().map(|b| b.entries.len()).unwrap_or(0)).unwrap_or(0), "lease");
            let leased = match leased {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => {
                    lease_error = Some(DeliveryError::Store(e));
                    break;
                }
                Err(e) => {
                    lease_error = Some(DeliveryError::Task(format!("lease task: {e}")));
                    break;
                }
            };
            if leased.entries.is_empty() {
                if outstanding.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    held_until_ms = leased.held_until_ms;
                    lease_capped = leased.capped;
                    break;
                }
                // Outcomes still to commit may free retries or close a breaker.
                let _ = tokio::time::timeout(Duration::from_millis(100), committed.notified()).await;
                continue;
            }
            let probes: HashSet<String> = leased.probes.into_iter().collect();
            if !probes.is_empty() {
                let mut g = probing.lock().unwrap_or_else(|p| p.into_inner());
                g.extend(probes.iter().cloned());
            }
            outstanding.fetch_add(leased.entries.len(), std::sync::atomic::Ordering::SeqCst);
            if let Ok(mut g) = per_endpoint.lock() {
                for e in &leased.entries {
                    match g.get_mut(&e.watcher_id) {
                        Some(n) => *n += 1,
                        None => {
                            g.insert(e.watcher_id.clone(), 1);
                        }
                    }
                }
            }
            let lease_until = leased.lease_until_ms;
            for entry in leased.entries {
                let pending = Pending { outstanding: outstanding.clone(), per_endpoint: per_endpoint.clone(), committed: committed.clone(), watcher: entry.watcher_id.clone(), outcome_sent: false };
                let this = shared.clone();
                let sem = sem.clone();
                let otx = otx.clone();
                let probe_of = probes.contains(&entry.watcher_id).then(|| entry.watcher_id.clone());
                let stop = stop.cloned();
                let gates = gates.clone();
                let probing = probing.clone();
                tokio::spawn(async move {
                    let mut pending = pending;
                    // `None`: its endpoint's gate closed while it waited (`notify::closed_gates`),
                    // checked once it has its endpoint's slot (the 410 or the failures that closed
                    // it came back on that slot) and before it takes a global permit or a rate
                    // token it would not use.
                    let begin = async {
                        let slot = this.endpoint_slot(&entry.watcher_id).acquire_owned().await;
                        if gates.skips(&entry.watcher_id, pass) {
                            return None;
                        }
                        // Resolved while it waited for the slot (a subscriber's delete): it
                        // waits for no permit nor rate token (the same endpoint's new rows
                        // would wait behind it for them).
                        if !this.lease_step(entry.id, lease_until, LeaseStep::Check).await {
                            return None;
                        }
                        // A rate-limited endpoint's backlog waits for its next token holding
                        // its own slot only, never a global permit another endpoint's alerts
                        // need; the token is taken once the permit is held, just before the
                        // send, so waiting for permits never stores up a burst of tokens.
                        // A token past a drain's deadline: not waited for, the row left queued.
                        if !this.endpoint_rate_ready(&entry.watcher_id).await {
                            return None;
                        }
                        let permit = sem.acquire_owned().await;
                        if !this.endpoint_rate_wait(&entry.watcher_id).await {
                            return None;
                        }
                        Some((slot, permit))
                    };
                    // Stopping: a row whose send has not begun is not sent, however long its
                    // wait for a slot or a rate token would be. It stays queued (its lease is
                    // this process's and ends with it) and has no outcome.
                    let held = match stop {
                        None => begin.await,
                        Some(mut stop) => tokio::select! {
                            biased;
                            _ = stopped(&mut stop) => return,
                            held = begin => held,
                        },
                    };
                    let held = held.filter(|_| !gates.skips(&entry.watcher_id, pass));
                    // (`BeginSend`: the row was not resolved meanwhile by an operator, a
                    // subscriber's delete, while it waited here for a slot.)
                    let begun = held.is_some() && this.lease_step(entry.id, lease_until, LeaseStep::BeginSend).await;
                    let _held = match held {
                        Some(held) if begun => held,
                        // Not sent: its lease given back (this pass's, not one a later pass took
                        // over), and a probe it was stops counting as in flight.
                        _ => {
                            this.lease_step(entry.id, lease_until, LeaseStep::GiveBack).await;
                            if let Some(endpoint) = &probe_of {
                                probing.lock().unwrap_or_else(|p| p.into_inner()).remove(endpoint);
                            }
                            return;
                        }
                    };
                    let (result, attempt) = this.attempt(&entry).await;
                    let gone_now = result.is_gone().then(|| entry.watcher_id.clone());
                    if let Some(endpoint) = &gone_now {
                        gates.answered_gone(endpoint);
                    }
                    // The committer outlives every sender (it ends when the last sender is gone).
                    let failed_endpoint = matches!(result, DeliveryResult::Retry { .. } | DeliveryResult::Dead { .. }).then(|| entry.watcher_id.clone());
                    pending.outcome_sent = otx.send(Outcome { result, attempt, failed_endpoint, probe_of, gone: gone_now }).is_ok();
                });
            }
        }
        drop(otx);
        let (mut stats, failure) = committer.await.map_err(|e| DeliveryError::Task(format!("committer: {e}")))?;
        stats.held_until_ms = held_until_ms;
        stats.lease_capped = lease_capped;
        match lease_error.or(failure) {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }

    /// Delivers until the outbox is empty, waiting for retries and open breakers' probes that
    /// fall due before `deadline`; later ones (and a disabled endpoint's rows) are left for
    /// the next run or for `serve`.
    pub async fn drain(&self, deadline: Instant) -> Result<PassStats, DeliveryError> {
        self.drain_until(deadline, None).await
    }

    /// [`Deliverer::drain`] that stops once `stop` reads true (`run` on a signal): nothing
    /// more is leased or sent and no retry is waited for; the sends already begun finish and
    /// their outcomes are committed before it returns (see [`Deliverer::pump_until`]). What
    /// is left stays queued for the next run.
    pub async fn drain_until(&self, deadline: Instant, stop: Option<&tokio::sync::watch::Receiver<bool>>) -> Result<PassStats, DeliveryError> {
        let this = Deliverer { rate_deadline: Some(deadline), ..self.clone() };
        this.drain_paced(deadline, stop).await
    }

    async fn drain_paced(&self, deadline: Instant, stop: Option<&tokio::sync::watch::Receiver<bool>>) -> Result<PassStats, DeliveryError> {
        let is_stopped = || stop.is_some_and(|s| *s.borrow());
        // Sleeps `wait`, or until a stop, whichever comes first.
        let pause = |wait: Duration| async move {
            match stop {
                Some(s) => {
                    let mut s = s.clone();
                    let _ = tokio::time::timeout(wait, stopped(&mut s)).await;
                }
                None => tokio::time::sleep(wait).await,
            }
        };
        let mut total = PassStats::default();
        // The deadline on the deliverer's clock: rows due after it are not leased, even while
        // slow sends keep a pass going (a run must not keep retrying long past `run_wait`).
        // Read again at each pass: a wall clock stepped forward meanwhile put every retry due
        // after the first reading, and the drain ended with its alerts queued (bb29).
        // Not past the deadline, though: a pass ending after it must not lease the retries
        // fallen due meanwhile (a reviewer).
        let due_by_now = || self.clock.now_ms().saturating_add(deadline.saturating_duration_since(Instant::now()).as_millis() as u64);
        let mut due_by = due_by_now();
        // Pumps in a row that sent nothing because their last lease pass stopped at its
        // pass-over bound (a held backlog ahead of rows that may go out): the drain goes on
        // at once until such pumps have read past every queued row once, or it would end with
        // a sendable row behind the backlog (`zonewatch run` would never reach it).
        let mut capped_in_a_row = 0u64;
        loop {
            if is_stopped() {
                break;
            }
            if Instant::now() < deadline {
                due_by = due_by_now();
            }
            let pass_from = self.clock.now_ms();
            let pass = self.pump_until(stop, Some(due_by)).await?;
            total += pass;
            if is_stopped() {
                break;
            }
            if pass.attempted > 0 || !pass.lease_capped {
                capped_in_a_row = 0;
            } else {
                capped_in_a_row += 1;
                let sweep = self.store.outbox_len()? / crate::store::MIN_PASS_OVER as u64 + 2;
                if capped_in_a_row <= sweep && Instant::now() < deadline {
                    continue;
                }
            }
            let Some(next) = self.store.next_due_ms()? else { break };
            let now = self.clock.now_ms();
            // A row that fell due after the pass looked is not held back: another pass takes it
            // (a clock that moves in steps, a manual one in tests, showed the drain ending
            // with it due and unsent).
            if pass.attempted == 0 && next <= now && next > pass_from {
                continue;
            }
            if pass.attempted == 0 && next <= now {
                // Every due row is held back. Wait for whichever comes first before the
                // deadline: an open breaker's probe (a short cool-down must not strand a
                // run's alerts until the next run) or a retry falling due later, perhaps of
                // an endpoint that is not held. A disabled endpoint's rows wait for an
                // operator.
                // Only a time by `due_by` can let anything through: the pump looks at the
                // clock capped there. (After a wall-clock step ahead, a breaker can open until
                // a time between `due_by` and now: waiting for it would be no wait at all, a
                // spin of lease passes until the deadline.)
                let later_retry = self.store.next_retry_due_after_ms(now)?;
                let wake = [pass.held_until_ms, later_retry].into_iter().flatten().min();
                match wake {
                    Some(at) if at <= due_by && Instant::now() + Duration::from_millis(at.saturating_sub(now)) <= deadline => {
                        pause(Duration::from_millis(at.saturating_sub(now))).await;
                        // Rows may have fallen due anywhere in the queue: a new sweep.
                        capped_in_a_row = 0;
                        continue;
                    }
                    _ => break,
                }
            }
            if next > now {
                let wait = Duration::from_millis(next - now);
                if Instant::now() + wait > deadline {
                    break;
                }
                pause(wait).await;
                capped_in_a_row = 0;
            }
        }
        Ok(total)
    }

    /// Runs until `shutdown` flips, waking when `wake` is notified or a retry falls due.
    pub async fn run(&self, mut shutdown: tokio::sync::watch::Receiver<bool>, wake: Arc<tokio::sync::Notify>) {
        loop {
            if *shutdown.borrow() {
                break;
            }
            let idle = match self.pump_until(Some(&shutdown), None).await {
                Ok(p) => p.attempted == 0,
                Err(e) => {
                    tracing::error!("delivery pass failed: {e}");
                    true
                }
            };
            // When due entries are all held back (disabled endpoint, open breaker), poll
            // once a second instead of spinning.
            let floor = if idle { 1_000 } else { 10 };
            let wait = match self.store.next_due_ms() {
                Ok(Some(next)) => Duration::from_millis(next.saturating_sub(self.clock.now_ms()).clamp(floor, 60_000)),
                Ok(None) => Duration::from_secs(60),
                Err(e) => {
                    tracing::error!("reading the outbox failed: {e}");
                    Duration::from_secs(5)
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = wake.notified() => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    /// [`Store::lease_step`] from an async task: at once when the lease map is free, else
    /// off the runtime's threads (a subscriber's delete holds it through its commit). A step
    /// that could not be taken (its blocking task failed) is a send that does not begin.
    async fn lease_step(&self, id: u64, lease_until: u64, step: LeaseStep) -> bool {
        if let Some(done) = self.store.try_lease_step(id, lease_until, step) {
            return done;
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.lease_step(id, lease_until, step)).await.unwrap_or(false)
    }

    fn endpoint_slot(&self, id: &str) -> Arc<Semaphore> {
        let mut g = self.endpoint_slots.lock().unwrap_or_else(|p| p.into_inner());
        // Looked up before inserting: the entry API would allocate the id on every webhook.
        if let Some(slot) = g.get(id) {
            return slot.clone();
        }
        g.entry(id.to_string()).or_insert_with(|| Arc::new(Semaphore::new(self.cfg.endpoint_concurrency))).clone()
    }

    /// Waits until endpoint `id` has a rate token, without taking it (see the pump: a send
    /// waits for its token before it takes a global permit, and takes it after).
    async fn endpoint_rate_ready(&self, id: &str) -> bool {
        self.endpoint_rate_until(id, |b, now| match b.until_available(now) {
            wait if wait.is_zero() => Ok(()),
            wait => Err(wait),
        })
        .await
    }

    /// Waits for and takes one of endpoint `id`'s rate tokens (`endpoint_rate`).
    async fn endpoint_rate_wait(&self, id: &str) -> bool {
        self.endpoint_rate_until(id, TokenBucket::try_take).await
    }

    /// Asks endpoint `id`'s token bucket `step` (made on first use) until it says `Ok`,
    /// sleeping as long as each `Err` says in between; at once without an `endpoint_rate`.
    /// `false` when the wait would end past a drain's deadline (`rate_deadline`): the row is
    /// then left queued, unsent (bb30: `endpoint_rate = 0.01` held a `run` whose `run_wait`
    /// was 1 s for minutes, pacing its sends).
    async fn endpoint_rate_until(&self, id: &str, step: impl Fn(&mut TokenBucket, Instant) -> Result<(), Duration>) -> bool {
        if self.cfg.endpoint_rate <= 0.0 {
            return true;
        }
        loop {
            let wait = {
                let mut g = self.endpoint_buckets.lock().unwrap_or_else(|p| p.into_inner());
                let b = g.entry(id.to_string()).or_insert_with(|| TokenBucket::new(self.cfg.endpoint_rate, 1.0, Instant::now()));
                step(b, Instant::now())
            };
            match wait {
                Ok(()) => return true,
                Err(d) if self.rate_deadline.is_some_and(|end| Instant::now() + d > end) => return false,
                Err(d) => tokio::time::sleep(d).await,
            }
        }
    }

    /// One try of one entry: its outcome and the attempt log row that goes with it.
    async fn attempt(&self, entry: &OutboxEntry) -> (DeliveryResult, AttemptRecord) {
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

/// How soon a send must fail on a connection closed under it to be sent again at once (at
/// most half the delivery timeout): the kept-alive race fails in milliseconds.
const RESEND_WITHIN: Duration = Duration::from_secs(1);

/// Whether a send failed because the connection under it was closed as the request went
/// out: hyper's "connection closed before message completed", or a reset / broken pipe on
/// an established connection. Not a connect error (a fresh connection that failed) and not a
/// timeout (the receiver had the request and took too long).
fn closed_under_request(e: &reqwest::Error) -> bool {
    if e.is_timeout() || e.is_connect() {
        return false;
    }
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if inner.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message) {
            return true;
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof) {
                return true;
            }
        }
        src = inner.source();
    }
    false
}

/// How the `last_error` of a row whose last send was deferred begins ([`Deliverer::deferred`]).
pub const DEFERRED_PREFIX: &str = "local: ";

/// How long a send that failed for want of this process's own resources waits before it is
/// tried again at least, and at most ([`Deliverer::deferred`]; jitter of up to as much again
/// comes on top).
const LOCAL_FAILURE_PAUSE: Duration = Duration::from_secs(2);
const LOCAL_FAILURE_PAUSE_MAX: Duration = Duration::from_secs(60);

/// A shortage of this process's own resources, timed from its first deferred send: it ends
/// after [`LOCAL_FAILURE_PAUSE_MAX`] without a deferred send. Not by an answered send (reviewer:
/// under a limit that lets some sends through, each answer started the timing anew and the
/// pause never grew).
#[derive(Debug, Default)]
struct LocalShortage {
    /// When it began (0: none yet) and its last deferred send.
    since_ms: std::sync::atomic::AtomicU64,
    last_ms: std::sync::atomic::AtomicU64,
}

impl LocalShortage {
    /// Notes a deferred send at `now` and returns how long the shortage has lasted (ms).
    fn lasted(&self, now: u64) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let last = self.last_ms.swap(now, Relaxed);
        let since = self.since_ms.load(Relaxed);
        if since == 0 || now.saturating_sub(last) > LOCAL_FAILURE_PAUSE_MAX.as_millis() as u64 {
            self.since_ms.store(now, Relaxed);
            return 0;
        }
        now.saturating_sub(since)
    }
}

/// The error of a send that never left this machine because this process ran out of a
/// resource of its own: file descriptors (its own limit or the system's), socket buffers or
/// memory; or whose name lookup failed so (the resolver answers `EBUSY` when it cannot make
/// its socket: a tester's `localhost` target under `ulimit -n 20` was charged and
/// dead-lettered). Anything else (refused, reset, unreachable, a name that does not resolve,
/// no route from here to an IPv6 address: `EADDRNOTAVAIL`, which is the target's as much as
/// ours, reviewer) is the endpoint's or the network's, and a retry.
pub(crate) fn local_failure(e: &(dyn std::error::Error + 'static)) -> Option<std::io::Error> {
    // Linux's numbers (the target this is built and packaged for): EMFILE, ENFILE, ENOBUFS,
    // ENOMEM, EBUSY.
    const LOCAL: [i32; 5] = [24, 23, 105, 12, 16];
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            if let Some(code) = io.raw_os_error().filter(|c| cfg!(target_os = "linux") && LOCAL.contains(c)) {
                return Some(std::io::Error::from_raw_os_error(code));
            }
        }
        src = inner.source();
    }
    None
}

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

/// The HTTP client webhooks go out with: no redirects followed (a redirect is an answer, not
/// a delivery), the configured timeouts, zonewatch's user agent. `zonewatch bench` measures
/// the bare HTTP exchange with the same client (the reference of the delivery measure).
/// Resolves once `stop` reads true; never, if its sender is gone without saying so.
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    if stop.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

pub fn http_client(cfg: &DeliveryConfig) -> Result<reqwest::Client, DeliveryError> {
    http_client_with(cfg, crate::netguard::Guard::new(cfg.allow_private_targets))
}

/// [`http_client`] with the SSRF guard already decided.
fn http_client_with(cfg: &DeliveryConfig, guard: crate::netguard::Guard) -> Result<reqwest::Client, DeliveryError> {
    guard
        .client(reqwest::Client::builder())
        .redirect(reqwest::redirect::Policy::none())
        .timeout(cfg.timeout)
        .connect_timeout(cfg.timeout.min(Duration::from_secs(10)))
        .user_agent(concat!("zonewatch/", env!("CARGO_PKG_VERSION")))
        .build()
        // reqwest's own words are "builder error"; its sources say why (no file descriptor
        // left to read the system's certificates, a tester's `ulimit -n 12`).
        .map_err(|e| DeliveryError::Client(crate::util::error_chain(&e)))
}

pub use crate::netguard::is_private;

/// `Retry-After` as seconds or an HTTP-date.
pub fn parse_retry_after(v: &str, now_ms: u64) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs.min(86_400)));
    }
    let when = httpdate::parse_http_date(v).ok()?;
    let when_ms = when.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as u64;
    Some(Duration::from_millis(when_ms.saturating_sub(now_ms)).min(Duration::from_secs(86_400)))
}

/// How much of a response body the attempt log keeps.
pub const RESPONSE_HEAD_BYTES: usize = 2048;

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

/// The delay before the next try after `attempts_done` tries, or `None` when the attempts are
/// used up. With a schedule: its `attempts_done`-th delay (its last past its end) ± `retry_jitter`; without: capped
/// exponential backoff with full jitter. `Retry-After` is a floor either way.
pub fn next_retry(cfg: &DeliveryConfig, attempts_done: u32, retry_after: Option<Duration>) -> Option<Duration> {
    if attempts_done >= cfg.max_attempts {
        return None;
    }
    if cfg.retry_schedule.is_empty() {
        return Some(backoff(cfg, attempts_done, retry_after));
    }
    // Past the schedule's end (a `max_attempts` above its length + 1), its last delay again:
    // the attempts configured are made, not cut short silently.
    let base = cfg.retry_delay(attempts_done);
    let j = cfg.retry_jitter.clamp(0.0, 0.99);
    let factor = if j > 0.0 { 1.0 + rand::random_range(-j..=j) } else { 1.0 };
    let d = Duration::from_secs_f64(base.as_secs_f64() * factor);
    Some(match retry_after {
        Some(ra) => d.max(ra),
        None => d,
    })
}

/// Capped exponential backoff with full jitter; `Retry-After` is a floor.
pub fn backoff(cfg: &DeliveryConfig, attempt: u32, retry_after: Option<Duration>) -> Duration {
    crate::util::full_jitter_backoff(cfg.base_delay, cfg.max_delay, attempt, retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_honours_retry_after() {
        let cfg = DeliveryConfig { base_delay: Duration::from_millis(100), max_delay: Duration::from_millis(1000), ..Default::default() };
        for attempt in 1..30 {
            assert!(backoff(&cfg, attempt, None) <= Duration::from_millis(1000));
        }
        assert!(backoff(&cfg, 1, Some(Duration::from_secs(5))) >= Duration::from_secs(5));
        let now = 1_445_412_470_000; // 2015-10-21T07:27:50Z
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(Duration::from_secs(10)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now + 60_000), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    /// A lease outlasts the worst case of what can be ahead of its row: every slot of the one
    /// endpoint holding the whole batch timing out in turn, plus that endpoint's rate; and it
    /// saturates rather than wrapping for absurd settings.
    #[test]
    fn leases_outlast_every_row_ahead_and_never_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
        let subs = Arc::new(SubscriberIndex::build(vec![]));
        let deliverer = |cfg: DeliveryConfig| Deliverer::new(store.clone(), subs.clone(), cfg).unwrap();
        let cfg = DeliveryConfig { concurrency: 64, endpoint_concurrency: 8, timeout: Duration::from_secs(15), endpoint_rate: 0.0, ..Default::default() };
        // 4,352 rows (the pump's 4,096 plus its retry floor of 256) behind 8 slots of one
        // endpoint: 544 rounds of 15 s, and the lease must be longer.
        let worst = 4_352u64.div_ceil(8) * 15_000;
        assert!(deliverer(cfg.clone()).lease_ms_for(4_352) > worst);
        // A rate-limited endpoint waits for its tokens on top of its slots.
        let rated = DeliveryConfig { endpoint_rate: 2.0, ..cfg.clone() };
        assert!(deliverer(rated).lease_ms_for(4_352) > worst + 4_352 * 500);
        // Absurd settings give a long lease, not a wrapped short one.
        let huge = DeliveryConfig { timeout: Duration::MAX, ..cfg.clone() };
        assert_eq!(deliverer(huge).lease_ms_for(4_352), u64::MAX);
        let crawl = DeliveryConfig { endpoint_rate: f64::MIN_POSITIVE, ..cfg };
        assert_eq!(deliverer(crawl).lease_ms_for(usize::MAX), u64::MAX);
    }

    /// A plan is made once per endpoint and made again when the subscriber's target or
    /// secrets change (the control port edits subscribers while `serve` delivers).
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

    /// A shortage of this process's own resources is timed from its first deferred send; a
    /// minute without a deferred send ends it.
    #[test]
    fn a_local_shortage_is_timed_from_its_first_deferral() {
        let shortage = LocalShortage::default();
        assert_eq!(shortage.lasted(1_000), 0);
        assert_eq!(shortage.lasted(11_000), 10_000);
        assert_eq!(shortage.lasted(40_000), 39_000);
        assert_eq!(shortage.lasted(100_000), 99_000, "within a minute of the last deferral");
        assert_eq!(shortage.lasted(200_000), 0, "a minute without a deferral starts anew");
        assert_eq!(shortage.lasted(200_500), 500);
    }

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

    #[test]
    fn schedule_with_jitter_and_retry_after() {
        let cfg = DeliveryConfig::default();
        assert_eq!(cfg.max_attempts, 8);
        let expect = [5u64, 300, 1_800, 7_200, 18_000, 36_000, 36_000];
        for _ in 0..200 {
            for (i, base) in expect.iter().enumerate() {
                let d = next_retry(&cfg, i as u32 + 1, None).unwrap().as_secs_f64();
                let b = *base as f64;
                assert!(d >= b * 0.8 - 1e-9 && d <= b * 1.2 + 1e-9, "retry {} = {d}s", i + 1);
            }
        }
        assert_eq!(next_retry(&cfg, 8, None), None, "7 retries after the first try");
        assert!(next_retry(&cfg, 1, Some(Duration::from_secs(60))).unwrap() >= Duration::from_secs(60));
        // More attempts than the schedule has delays: its last delay again, until they are used.
        let short = DeliveryConfig { retry_schedule: vec![Duration::from_secs(1), Duration::from_secs(2)], max_attempts: 5, retry_jitter: 0.0, ..cfg };
        let delays: Vec<Option<Duration>> = (1..=5).map(|n| next_retry(&short, n, None)).collect();
        assert_eq!(delays, [1, 2, 2, 2].map(|s| Some(Duration::from_secs(s))).into_iter().chain([None]).collect::<Vec<_>>());
    }
}
