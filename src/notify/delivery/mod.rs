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
//!
//! Files: this one holds the `Deliverer` and the one-pass `deliver_due` and `run` (serve's
//! loop); `pump` leases, sends and group-commits; `drain` runs pump passes to a deadline;
//! `send` is one attempt; `client` the HTTP client and how its errors read; `retry` when a
//! failed send goes again; `endpoint_limits` the per-endpoint slots and rate; `tests` the
//! unit tests that cross those files.

use crate::clock::SharedClock;
use crate::config::DeliveryConfig;
use crate::notify::matcher::SubscriberIndex;
use crate::notify::replay::TokenBucket;
use crate::store::{DeliveryResult, LeaseStep, Store, StoreError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

mod client;
mod drain;
mod endpoint_limits;
mod pump;
mod retry;
mod send;

pub use client::http_client;
pub use retry::{next_retry, parse_retry_after};
use client::{http_client_with, LocalShortage};
use send::SendPlan;

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

/// How the `last_error` of a row whose last send was deferred begins ([`Deliverer::deferred`]).
pub const DEFERRED_PREFIX: &str = "local: ";

/// Resolves once `stop` reads true; never, if its sender is gone without saying so.
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    if stop.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

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
}

#[cfg(test)]
mod tests;
