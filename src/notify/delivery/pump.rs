//! The pump: leases due outbox rows in batches, sends each within its endpoint's slots and
//! rate, and hands every outcome to one committer that records them in group commits. Leasing,
//! sending and recording overlap; a stop lets what is in flight finish.

use crate::model::AttemptRecord;
use crate::store::{DeliveryResult, LeaseStep};
use super::{Deliverer, DeliveryError, PassStats, now_watched, stopped};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Rows leased per lease transaction by [`Deliverer::pump`].
const PIPE_LEASE_BATCH: usize = 1_024;

/// At most this many leased entries wait for their outcome commit in [`Deliverer::pump`].
const PIPE_MAX_OUTSTANDING: usize = 4_096;

/// At most this many outcomes per group commit.
const PIPE_COMMIT_MAX: usize = 8_192;

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

impl Deliverer {
    /// How long a lease must last when up to `outstanding` leased entries may be ahead of an
    /// entry's outcome commit: every slot timing out in turn, globally and per endpoint, plus
    /// a rate-limited endpoint's whole share.
    ///
    /// The bound holds for any `outstanding` a caller passes, so callers pass the most a pass
    /// can lease (its fresh limit plus its retry floor). Saturating throughout: a huge
    /// `timeout_ms` or a tiny `endpoint_rate` gives a long lease, never a wrapped short one.
    pub(super) fn lease_ms_for(&self, outstanding: usize) -> u64 {
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
        let gates: Arc<crate::notify::closed_gates::ClosedGates> = Default::default();
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

    /// [`crate::store::Store::lease_step`] from an async task: at once when the lease map is free, else
    /// off the runtime's threads (a subscriber's delete holds it through its commit). A step
    /// that could not be taken (its blocking task failed) is a send that does not begin.
    pub(super) async fn lease_step(&self, id: u64, lease_until: u64, step: LeaseStep) -> bool {
        if let Some(done) = self.store.try_lease_step(id, lease_until, step) {
            return done;
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.lease_step(id, lease_until, step)).await.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeliveryConfig;
    use crate::notify::matcher::SubscriberIndex;
    use crate::store::Store;

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
}
