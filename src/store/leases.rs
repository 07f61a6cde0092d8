//! Outbox leases and the priority split. A delivery in flight holds a lease that outlives
//! its request timeout; the lease is dropped once the transaction that records the outcome
//! has committed. Leases are kept in memory, not in the file: a lease never outlives its
//! process (redb's file lock proves a dead holder, and a new process starts with none), so
//! writing them cost a write transaction per leased batch and two B-tree writes per webhook
//! for nothing a restart could use (issue 7). An expired lease is taken over in a live process.
//! Fresh entries (`OUTBOX`, in claim order) are leased ahead of retries (`OUTBOX_RETRY` by
//! `OUTBOX_RETRY_DUE`), so one dead
//! endpoint's backlog never delays live alerts to others. The per-attempt log lives here too.

use super::codec::{decode, encode};
use super::runs::codec_err;
use super::tables::*;
use super::{Store, StoreError};
use crate::model::{AttemptRecord, OutboxEntry};
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// The leases of this process: outbox id → [`Lease`].
///
/// Ordering with outcome commits, which is what keeps a row from going out twice: a lease
/// pass holds the lock from before it opens its read snapshot until its leases are in, and an
/// outcome drops its leases only after its commit. So a pass either sees the row still
/// leased, or opens its snapshot after the commit that resolved the row.
#[derive(Debug, Default)]
pub(super) struct Leases(Mutex<LeaseState>);

/// What [`Leases`] guards.
#[derive(Debug, Default)]
pub(super) struct LeaseState {
    /// Outbox id → its lease.
    by_row: HashMap<u64, Lease>,
    /// Where the next pass starts reading the fresh queue: just past the last fresh row the
    /// previous pass read. A draining backlog keeps hundreds to thousands of leased rows at
    /// the front of the queue (in flight, their outcomes not yet committed); reading from the
    /// front stepped over all of them on every pass. A pass that reaches the end of the queue
    /// before its limit wraps to the front, so a row passed over (a held endpoint, a lease
    /// that expired) is read again at least once per sweep of the queue.
    fresh_resume: u64,
    /// Where the next pass starts reading the due retries (a key of `outbox_retry_due`;
    /// `None`: from the earliest): just past the last one the previous pass read, when it
    /// stopped before the end. For the same reason as `fresh_resume`: after an outage, an
    /// endpoint whose breaker is open can hold a backlog of due retries that every pass
    /// would otherwise read whole (a point lookup each) before the retries behind it.
    retry_resume: Option<(u64, u64)>,
    /// Outbox rows a lease pass could not decode (a damaged page, a bug): skipped by every
    /// pass, left in place for `zonewatch check`, and reported once each.
    unreadable: std::collections::HashSet<u64>,
}

/// One row's lease. It expires once both its wall-clock time (`until_ms`, the deliverer's
/// clock, which tests drive by hand) and as much elapsed time as it was taken for (`until`,
/// monotonic) have passed: a wall clock stepped forward (a VM resumed, NTP correcting a wrong
/// clock at boot) must not let a later pass of this process take over a row whose send is
/// still in flight and send it again (invariant 9).
#[derive(Debug, Clone, Copy)]
pub(super) struct Lease {
    until_ms: u64,
    /// `None`: further off than an `Instant` reaches (a huge `timeout_ms`).
    until: Option<std::time::Instant>,
    /// Its send has begun ([`Store::lease_step`]), or that of the lease it took over: until then the row only waits in the
    /// deliverer for a slot, and an operator's action may still resolve it
    /// ([`Leases::while_held`]).
    sending: bool,
    /// Its subscriber was deleted while its send was under way ([`Leases::while_held`]): an
    /// answer that would leave the row queued (a retry, a deferral) dead-letters it
    /// `subscriber_deleted` instead, and no later pass leases it meanwhile, so it never goes
    /// to a subscriber of that id created again.
    revoked: bool,
    /// The outcome of its send is being committed ([`Leases::commit_and_release`]): once the
    /// commit lands the row is as the outcome left it, so an operator's action takes it as not
    /// sending, and no lease pass takes it over, however long the commit takes (a pass's
    /// snapshot may be from before the commit, where the row is still queued).
    settling: bool,
}

impl Lease {
    fn new(now_ms: u64, lease_ms: u64) -> Self {
        Lease { until_ms: now_ms.saturating_add(lease_ms), until: std::time::Instant::now().checked_add(std::time::Duration::from_millis(lease_ms)), sending: false, revoked: false, settling: false }
    }

    fn held_at(&self, now_ms: u64) -> bool {
        self.until_ms > now_ms || self.until.is_none_or(|until| std::time::Instant::now() < until)
    }
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, LeaseState> {
        // A panic while holding the lock leaves whole entries: each is a row id and an expiry.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` (a write transaction that resolves outbox rows outside delivery) with the
    /// lease map locked, telling it which rows are sending: a lease whose send has begun
    /// ([`Store::lease_step`]), also one past its expiry (a lease is dropped only once its
    /// outcome is committed, and an outcome may wait in the group committer past the lease's
    /// time), but not one whose outcome is being committed ([`Lease::settling`]: the row is
    /// as that commit left it). `f` returns the rows it resolved: their leases (rows leased but not yet sending,
    /// waiting in the deliverer for a slot) are dropped under the same lock once it has
    /// committed, so their sends never begin (a tester's `DELETE` of a subscriber counted 40
    /// rows in flight where 8 were sending; the other 32 then went out, or to a subscriber of
    /// that id created again); and the rows it left to their sends, whose leases are marked
    /// revoked (see [`Lease::revoked`]). Held until `f` returns, so `f` should commit inside: a lease
    /// pass then either leased a row before `f` looked or opens its snapshot after the commit
    /// (and no longer finds the row). Lock order: the write transaction first, then this lock
    /// (no lease pass waits for a write lock while holding it).
    pub(super) fn while_held<R, E>(&self, f: impl FnOnce(&dyn Fn(u64) -> bool) -> Result<(R, Vec<u64>, Vec<u64>), E>) -> Result<R, E> {
        let mut state = self.lock();
        let (out, resolved, left_sending) = f(&|id| state.by_row.get(&id).is_some_and(|l| l.sending && !l.settling))?;
        for id in resolved {
            state.by_row.remove(&id);
        }
        for id in left_sending {
            if let Some(lease) = state.by_row.get_mut(&id) {
                lease.revoked = true;
            }
        }
        Ok(out)
    }

    /// Of rows `ids`, those whose subscriber was deleted while their send was under way
    /// ([`Lease::revoked`]).
    pub(super) fn revoked(&self, ids: impl IntoIterator<Item = u64>) -> std::collections::HashSet<u64> {
        let state = self.lock();
        ids.into_iter().filter(|id| state.by_row.get(id).is_some_and(|l| l.revoked)).collect()
    }

    /// Commits `wtx`, which records the outcomes of rows `ids`, and then drops their leases.
    /// Just before the commit (the write lock held, so no operator's action runs meanwhile)
    /// their leases are marked settling: an operator's action that takes the write lock as
    /// soon as the commit lands, before the leases are dropped ([`Leases::while_held`]), takes
    /// such a row as not sending, and resolves it as the commit left it (a second reader: a
    /// subscriber's delete marked the lease of a row whose send had ended revoked, the release
    /// then dropped the mark, and the row its retry left queued could go to a subscriber of
    /// that id created again). The lock is not held through the commit: a lease pass or a send
    /// about to begin never waits for an outcome commit's fsync (invariant 17; holding it
    /// halved the delivery bench's rate). A settling lease is not taken over by a lease pass
    /// (a fourth reader: a pass whose snapshot predates the commit took over an expired one,
    /// cleared its mark and sent the row again). A commit that fails (or unwinds) keeps the
    /// leases, unmarked; the marks are cleared after the failed commit has let the write lock
    /// go, which no operator's write can use meanwhile: redb refuses every write transaction
    /// after a commit's I/O error, until the store is opened again (`serve` exits for that).
    pub(super) fn commit_and_release(&self, wtx: redb::WriteTransaction, ids: &[u64]) -> Result<(), StoreError> {
        /// Clears the marks unless the commit landed.
        struct Unmark<'a>(&'a Leases, &'a [u64], bool);
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                if self.2 {
                    self.0.mark_settling(self.1, false);
                }
            }
        }
        self.mark_settling(ids, true);
        let mut unmark = Unmark(self, ids, true);
        wtx.commit()?;
        unmark.2 = false;
        let mut state = self.lock();
        for id in ids {
            state.by_row.remove(id);
        }
        Ok(())
    }

    pub(super) fn mark_settling(&self, ids: &[u64], settling: bool) {
        let mut state = self.lock();
        for id in ids {
            if let Some(lease) = state.by_row.get_mut(id) {
                lease.settling = settling;
            }
        }
    }
}

/// The fewest rows a lease pass passes over (held back by their endpoint's gate or share,
/// or leased) in its fresh or its retry part before it stops where it is; the next pass
/// goes on from there. More when the pass asks for more rows (4 × its limit).
pub const MIN_PASS_OVER: usize = 4_096;

/// What [`Store::lease_due`] handed out.
#[derive(Debug, Clone, Default)]
pub struct LeasedBatch {
    pub entries: Vec<OutboxEntry>,
    /// How many of `entries` are first attempts (the rest are retries).
    pub fresh: usize,
    pub lease_until_ms: u64,
    /// Endpoints (subscriber ids) whose half-open breaker probe is in this batch.
    pub probes: Vec<String>,
    /// The pass stopped at its pass-over bound ([`MIN_PASS_OVER`] rows or more passed over
    /// in its fresh or its retry part): rows past that point were not read, and the next pass
    /// goes on from there.
    pub capped: bool,
    /// The earliest time (ms) an open breaker that held back a due row of this pass lets
    /// its probe through; `None` when no row was held by a breaker (rows of a disabled
    /// endpoint wait for an operator, not for a time).
    pub held_until_ms: Option<u64>,
}

impl Store {
    /// Leases due outbox entries from one read snapshot: first up to `fresh_limit` fresh
    /// entries, then retries filling the rest of `fresh_limit` but always at least
    /// `retry_floor` (so retries are never starved entirely). Entries under an unexpired lease
    /// are skipped; an expired lease is simply taken over. Takes no write lock.
    pub fn lease_due(
        &self,
        now_ms: u64,
        lease_ms: u64,
        fresh_limit: usize,
        retry_floor: usize,
    ) -> Result<LeasedBatch, StoreError> {
        self.lease_due_probing(now_ms, lease_ms, fresh_limit, retry_floor, &std::collections::HashSet::new(), &|_| true, &|_| usize::MAX)
    }

    /// [`Store::lease_due`] for a deliverer that keeps several batches in flight: endpoints in
    /// `probing` already have their half-open probe out, so no second one is leased.
    /// `subscribed` says whether a row's subscriber still exists: the rows of one that does
    /// not are leased whatever its endpoint's health (a disabled endpoint's would otherwise
    /// wait forever for an enable no one can give), and delivery dead-letters them
    /// (`subscriber_gone`). `room` says how many more rows an endpoint may have leased: one
    /// slow endpoint's backlog must not fill the deliverer's whole window while another
    /// endpoint's rows wait behind it (its rows past its room are passed over, left queued).
    #[allow(clippy::too_many_arguments)]
    pub fn lease_due_probing(
        &self,
        now_ms: u64,
        lease_ms: u64,
        fresh_limit: usize,
        retry_floor: usize,
        probing: &std::collections::HashSet<String>,
        subscribed: &dyn Fn(&str) -> bool,
        room: &dyn Fn(&str) -> usize,
    ) -> Result<LeasedBatch, StoreError> {
        let lease = Lease::new(now_ms, lease_ms);
        let until = lease.until_ms;
        // Held until the batch is leased (see `Leases`): taken before the snapshot is opened.
        let mut leases = self.leases.lock();
        let rtx = self.db.begin_read()?;
        let mut batch = LeasedBatch { lease_until_ms: until, ..Default::default() };
        // Each endpoint's gate, from its health read when the pass first meets it (reading
        // every endpoint's on each pass cost ~2.5k instructions per endpoint, per pass,
        // whether it had rows or not); `now_ms` is fixed for the pass.
        let endpoints = rtx.open_table(ENDPOINTS)?;
        // With it, the rows the endpoint may still take in this pass (`room`, less what it took).
        let mut gates: HashMap<String, (super::endpoints::Gate, usize)> = HashMap::new();
        let mut probed = std::collections::HashSet::new();
        let mut held_until: Option<u64> = None;
        let fresh_rows = rtx.open_table(OUTBOX)?;
        let retry_rows = rtx.open_table(OUTBOX_RETRY)?;
        // Rows of this pass that could not be decoded: (table, id, why).
        let mut unreadable: Vec<(&'static str, u64, String)> = Vec::new();
        // Whether row `id` (decoded from `bytes`) may go out now; leases it if so. A row that
        // cannot be decoded is skipped, not an error: one damaged row must not stop delivery
        // of every other (every pass would fail on it, for ever).
        let mut take = |by_row: &mut HashMap<u64, Lease>, id: u64, bytes: &[u8], table: &'static str, out: &mut Vec<OutboxEntry>| -> Result<bool, StoreError> {
            if by_row.get(&id).is_some_and(|l| l.held_at(now_ms) || l.revoked || l.settling) {
                return Ok(false);
            }
            // Gated by its endpoint before it is decoded whole (see `entry_watcher`).
            let watcher = match super::outbox_rows::entry_watcher(bytes) {
                Ok(watcher) => watcher,
                Err(why) => {
                    unreadable.push((table, id, why));
                    return Ok(false);
                }
            };
            // Disabled endpoints and open breakers hold their entries back; a
            // half-open breaker lets one probe through.
            if !gates.contains_key(watcher) {
                let gate = if subscribed(watcher) {
                    // An unreadable health record holds nothing back (the next outcome
                    // commit writes it afresh): one damaged record must not stop delivery.
                    let health = super::endpoints::load(&endpoints, watcher).unwrap_or_else(|why| {
                        tracing::error!(endpoint = %watcher, "endpoint health record cannot be read ({why}); its rows are not held back");
                        None
                    });
                    super::endpoints::gate(health.as_ref(), now_ms)
                } else {
                    super::endpoints::Gate::Open
                };
                gates.insert(watcher.to_string(), (gate, room(watcher)));
            }
            let Some((gate, left)) = gates.get_mut(watcher) else { return Ok(false) };
            let gate = *gate;
            match gate {
                super::endpoints::Gate::Disabled => return Ok(false),
                super::endpoints::Gate::Cooling(until) => {
                    held_until = Some(held_until.map_or(until, |h| h.min(until)));
                    return Ok(false);
                }
                super::endpoints::Gate::Probe => {
                    if probing.contains(watcher) || probed.contains(watcher) {
                        return Ok(false);
                    }
                }
                super::endpoints::Gate::Open => {}
            }
            if *left == 0 {
                return Ok(false);
            }
            let entry: OutboxEntry = match super::outbox_rows::decode_entry(bytes) {
                Ok(entry) => entry,
                Err(why) => {
                    unreadable.push((table, id, why));
                    return Ok(false);
                }
            };
            if gate == super::endpoints::Gate::Probe {
                probed.insert(entry.watcher_id.clone());
            }
            *left -= 1;
            // A lease taken over keeps saying that a send of the row began (second reader: the
            // earlier send may have gone out, its outcome not yet committed; a subscriber's
            // delete must leave the row to it, not dead-letter a delivered alert).
            let sending = by_row.get(&id).is_some_and(|l| l.sending);
            by_row.insert(id, Lease { sending, revoked: false, settling: false, ..lease });
            out.push(entry);
            Ok(true)
        };
        // Fresh rows in claim (id) order, all due: from where the last pass stopped to the
        // end, then (when that did not fill the batch) from the front up to that point.
        let resume = leases.fresh_resume;
        let mut next_resume = 0;
        if fresh_limit > 0 {
            let mut taken = 0;
            // Rows passed over (held back by their endpoint's gate or share) before the pass
            // stops where it is and the next goes on from there: a backlog of 300,000 rows of
            // one endpoint at its share is not read whole on every pass (under the lease
            // lock), while the rows behind it are still reached within a few passes.
            let mut passed_over = 0usize;
            let pass_over_max = fresh_limit.saturating_mul(4).max(MIN_PASS_OVER);
            use std::ops::Bound::{Excluded, Included, Unbounded};
            let wrap = (resume > 0).then_some((Included(0), Excluded(resume)));
            'scan: for range in std::iter::once((Included(resume), Unbounded)).chain(wrap) {
                for item in fresh_rows.range::<u64>(range)? {
                    let (k, v) = item?;
                    let id = k.value();
                    if take(&mut leases.by_row, id, v.value(), "outbox", &mut batch.entries)? {
                        taken += 1;
                        if taken >= fresh_limit {
                            next_resume = id.saturating_add(1);
                            break 'scan;
                        }
                    } else {
                        passed_over += 1;
                        if passed_over >= pass_over_max {
                            next_resume = id.saturating_add(1);
                            batch.capped = true;
                            break 'scan;
                        }
                    }
                }
            }
        }
        leases.fresh_resume = next_resume;
        batch.fresh = batch.entries.len();
        // Retries by due time, from where the last pass stopped to the last one due, then
        // from the earliest up to that point; at most `pass_over_max` passed over per pass,
        // as for fresh rows.
        let retry_limit = fresh_limit.saturating_sub(batch.fresh).max(retry_floor);
        let mut next_retry_resume = None;
        if retry_limit > 0 {
            use std::ops::Bound::{Excluded, Included, Unbounded};
            let mut taken = 0;
            let mut passed_over = 0usize;
            let pass_over_max = retry_limit.saturating_mul(4).max(MIN_PASS_OVER);
            let due_end = (now_ms.saturating_add(1), 0u64);
            let resume = leases.retry_resume.filter(|r| *r < due_end);
            let due = rtx.open_table(OUTBOX_RETRY_DUE)?;
            let first = (resume.map_or(Unbounded, Included), Excluded(due_end));
            let wrap = resume.map(|r| (Unbounded, Excluded(r)));
            'retries: for range in std::iter::once(first).chain(wrap) {
                for item in due.range::<(u64, u64)>(range)? {
                    let (k, _) = item?;
                    let (at, id) = k.value();
                    let Some(v) = retry_rows.get(id)? else { continue };
                    let stop = if take(&mut leases.by_row, id, v.value(), "outbox_retry", &mut batch.entries)? {
                        taken += 1;
                        taken >= retry_limit
                    } else {
                        passed_over += 1;
                        let capped = passed_over >= pass_over_max;
                        batch.capped |= capped;
                        capped
                    };
                    if stop {
                        next_retry_resume = Some((at, id.saturating_add(1)));
                        break 'retries;
                    }
                }
            }
        }
        leases.retry_resume = next_retry_resume;
        for (table, id, why) in unreadable {
            if leases.unreadable.insert(id) {
                tracing::error!(table, id, "outbox row cannot be read ({why}); delivery skips it and leaves it in place: `zonewatch check` reports the store's damage");
            }
        }
        batch.probes = probed.into_iter().collect();
        batch.held_until_ms = held_until;
        Ok(batch)
    }

    /// Drops every lease whose wall-clock time ends at or before `before_ms` (`u64::MAX`: all
    /// of them), so those entries are due again, whatever time has elapsed (an explicit
    /// reclaim). Returns how many were dropped.
    pub fn reclaim_leases(&self, before_ms: u64) -> Result<usize, StoreError> {
        let mut state = self.leases.lock();
        let n = state.by_row.len();
        state.by_row.retain(|_, lease| lease.until_ms > before_ms);
        Ok(n - state.by_row.len())
    }

    /// Takes `step` on leased row `id`, whose lease this pass took (`lease_until`, its batch's):
    ///
    /// * [`LeaseStep::BeginSend`]: marks its send begun, if that lease is still there; false
    ///   when an operator's action resolved the row meanwhile ([`Leases::while_held`]) or a
    ///   later pass took the lease over. The row must then not be sent.
    /// * [`LeaseStep::GiveBack`]: drops the lease of a row whose send did not begin and never
    ///   will in this pass (its endpoint's gate closed meanwhile: `notify::closed_gates`, or
    ///   `BeginSend` said no): nothing was sent and it has no outcome, so the next pass that
    ///   may send it can lease it. Only that lease: one a later pass took over (after the clock
    ///   stepped past it) belongs to that pass's send. Always true.
    /// * [`LeaseStep::Check`]: whether that lease is still there, changing nothing.
    pub fn lease_step(&self, id: u64, lease_until: u64, step: LeaseStep) -> bool {
        Self::lease_step_in(&mut self.leases.lock(), id, lease_until, step)
    }

    /// [`Store::lease_step`] without waiting: `None` when the lease map is locked (a lease
    /// pass, or an operator's transaction committing under it: the deliverer then takes the
    /// step off the async runtime's threads, which must not block on it).
    pub fn try_lease_step(&self, id: u64, lease_until: u64, step: LeaseStep) -> Option<bool> {
        let mut state = match self.leases.0.try_lock() {
            Ok(state) => state,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Self::lease_step_in(&mut state, id, lease_until, step))
    }

    fn lease_step_in(state: &mut LeaseState, id: u64, lease_until: u64, step: LeaseStep) -> bool {
        let ours = state.by_row.get(&id).is_some_and(|l| l.until_ms == lease_until);
        // A revoked lease (a take-over of a row whose earlier send was under way when its
        // subscriber was deleted) is that earlier send's: this holder does not send (a
        // reviewer: it went on to send, to a subscriber of that id created meanwhile), and
        // does not give it back either; that send's outcome commit drops it.
        let revoked = state.by_row.get(&id).is_some_and(|l| l.revoked);
        match step {
            LeaseStep::BeginSend => {
                let begins = ours && !revoked;
                if let Some(lease) = state.by_row.get_mut(&id).filter(|_| begins) {
                    lease.sending = true;
                }
                begins
            }
            LeaseStep::GiveBack => {
                if ours && !revoked {
                    state.by_row.remove(&id);
                }
                true
            }
            LeaseStep::Check => ours && !revoked,
        }
    }

    /// How many outbox entries this process has leased right now (in flight, or expired and
    /// not taken over yet).
    pub fn leased_len(&self) -> Result<u64, StoreError> {
        Ok(self.leases.lock().by_row.len() as u64)
    }

    /// Stores written before leases moved to memory (schema 5) may hold leases of a process
    /// that died: dropped on open (their holder is gone). Returns how many.
    pub(super) fn drop_file_leases(&self) -> Result<u64, StoreError> {
        let n = self.db.begin_read()?.open_table(OUTBOX_LEASES)?.len()?;
        if n > 0 {
            let mut wtx = self.db.begin_write()?;
            self.durable_commit_settings(&mut wtx);
            wtx.delete_table(OUTBOX_LEASES)?;
            wtx.open_table(OUTBOX_LEASES)?;
            wtx.commit()?;
        }
        Ok(n)
    }

    /// Every logged delivery attempt of one idempotency key, in attempt order, numbered
    /// 1.. across the key's outbox rows (a replayed dead letter keeps counting).
    pub fn attempts(&self, key: &str) -> Result<Vec<AttemptRecord>, StoreError> {
        let rtx = self.db.begin_read()?;
        let legacy = rtx.open_table(DELIVERY_ATTEMPTS)?;
        let log = rtx.open_table(DELIVERY_ATTEMPTS_BY_ROW)?;
        // A read racing a journal merge may miss the key (its index entry already dropped, its
        // snapshot of `idem_keys` older than the merge): it then takes the log-scan branch
        // below, which finds the same attempts, only slower.
        let (journal, main) = (rtx.open_table(IDEM_KEY_JOURNAL)?, rtx.open_table(IDEM_KEYS)?);
        // The key names every row it was queued as (across replays and TTL cycles).
        let named: Option<Vec<u64>> = super::key_journal::find(&self.key_index, &journal, &main, key)?.map(|(_, rec)| rec.rows().collect());
        let mut out = named_attempts(&legacy, &log, key, named.iter().flatten().copied())?;
        if named.is_none() {
            // A key swept after its TTL: its attempts stay until the retention sweep, found
            // by a scan of the log (an operator's lookup, not a delivery path).
            for item in log.iter()? {
                let (_, v) = item?;
                let rec: AttemptRecord = decode(v.value()).map_err(|m| codec_err("delivery_attempts_by_row", m))?;
                if rec.key == key {
                    out.push(rec);
                }
            }
        }
        for (n, rec) in out.iter_mut().enumerate() {
            rec.attempt = n as u32 + 1;
        }
        Ok(out)
    }
}

/// What the deliverer does to a leased row's lease just before its send, or instead of it
/// ([`Store::lease_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStep {
    /// The send is about to begin: a subscriber's delete leaves the row to it from now on.
    BeginSend,
    /// The send will not begin in this pass: the row is free for the next one.
    GiveBack,
    /// Nothing changes: whether the lease is still this pass's (a row an operator resolved
    /// while it waited for its endpoint's slot need not wait for a permit and a rate token).
    Check,
}

/// How many attempt-log rows the retention sweep may read per row it may delete.
const SWEEP_SCAN_PER_VICTIM: usize = 4;

impl Store {
    /// Retention sweep of the attempt log: deletes at most `max` attempt rows older than
    /// `before_ms`, except those of events still in the dead letters or the delivery quarantine
    /// (they stay until resolved). Bounded per call so the write lock is never held for long:
    /// the by-row log is read from its oldest row, at most `SWEEP_SCAN_PER_VICTIM` × `max`
    /// rows, never through its whole young tail.
    pub fn sweep_attempts(&self, before_ms: u64, max: usize) -> Result<usize, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut n = 0;
        // An attempt that cannot be read, said once an hour at most: every batch steps over it.
        let mut damaged: Option<String> = None;
        {
            let mut keep = std::collections::HashSet::new();
            let mut keep_rows = std::collections::HashSet::new();
            for table in [DEAD_LETTERS, DLQ_QUARANTINE] {
                for item in wtx.open_table(table)?.iter()? {
                    let (k, v) = item?;
                    // One that cannot be read keeps its own row's attempts (its id is the
                    // table's key) and does not stop the sweep for ever.
                    keep_rows.insert(k.value());
                    if let Ok(d) = super::outbox_rows::decode_dead(v.value()) {
                        keep_rows.insert(d.entry.id);
                        keep.insert(d.entry.key.0);
                    }
                }
            }
            // Every row a dead-lettered key was queued as (a replayed dead letter's earlier
            // rows), not only the dead letter's own: its whole history stays until resolved.
            {
                let keys = super::key_journal::KeyTables::open(&wtx, &self.key_index)?;
                for key in &keep {
                    if let Some((_, rec)) = keys.find(key.as_str())? {
                        keep_rows.extend(rec.rows());
                    }
                }
            }
            let mut t = wtx.open_table(DELIVERY_ATTEMPTS)?;
            let mut victims = Vec::new();
            for item in t.iter()? {
                if victims.len() >= max {
                    break;
                }
                let (k, v) = item?;
                let (key, n) = k.value();
                if keep.contains(key) {
                    continue;
                }
                // One that cannot be read is stepped over (`check --store` names it): an error
                // here stopped every later sweep at it, and the log grew without end.
                match decode::<AttemptRecord>(v.value()) {
                    Ok(rec) if rec.ts_ms < before_ms => victims.push((key.to_string(), n)),
                    Ok(_) => {}
                    Err(m) => damaged = Some(format!("attempt {n} of key {key}: {m}")),
                }
            }
            for (key, a) in victims {
                t.remove((key.as_str(), a))?;
                n += 1;
            }
            // The log is in outbox-row order, which is claim order, so its old attempts are at
            // the front and the young tail (most of a busy log) follows. The walk steps over
            // young attempts but reads at most `SWEEP_SCAN_PER_VICTIM` × `max` rows a call, so
            // it never reads the whole tail: an old attempt behind more young ones than that
            // (a row that waited behind a disabled endpoint, then was tried late) waits until
            // they age out. Rows kept for their dead letters are stepped over too.
            let mut log = wtx.open_table(DELIVERY_ATTEMPTS_BY_ROW)?;
            let mut old_rows = Vec::new();
            let scan_limit = max.saturating_mul(SWEEP_SCAN_PER_VICTIM);
            for (read, item) in log.iter()?.enumerate() {
                if n + old_rows.len() >= max || read >= scan_limit {
                    break;
                }
                let (k, v) = item?;
                let (row, a) = k.value();
                if keep_rows.contains(&row) {
                    continue;
                }
                match decode::<AttemptRecord>(v.value()) {
                    Ok(rec) if rec.ts_ms < before_ms => old_rows.push((row, a)),
                    Ok(_) => {}
                    Err(m) => damaged = Some(format!("attempt {a} of outbox row {row}: {m}")),
                }
            }
            for k in old_rows {
                log.remove(k)?;
                n += 1;
            }
        }
        if let Some(what) = damaged {
            static SAID_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            if crate::util::now_and_then(&SAID_MS, 3_600_000) {
                tracing::warn!("the attempt retention sweep steps over attempts that cannot be read ({what}, the last of this batch); check --store names them");
            }
        }
        if n == 0 {
            wtx.abort()?;
        } else {
            wtx.commit()?;
        }
        Ok(n)
    }
}

/// The attempts logged for `key` under the key itself (stores written before the by-row log)
/// and on the outbox rows `rows` (the ones its record names), in that order. Read through
/// the caller's open tables, in a read or a write transaction.
pub(super) fn named_attempts(
    legacy: &impl ReadableTable<(&'static str, u32), &'static [u8]>,
    log: &impl ReadableTable<(u64, u32), &'static [u8]>,
    key: &str,
    rows: impl IntoIterator<Item = u64>,
) -> Result<Vec<AttemptRecord>, StoreError> {
    let mut out = Vec::new();
    for item in legacy.range((key, 0u32)..=(key, u32::MAX))? {
        out.push(decode(item?.1.value()).map_err(|m| codec_err("delivery_attempts", m))?);
    }
    for row in rows {
        for item in log.range((row, 0u32)..=(row, u32::MAX))? {
            out.push(decode(item?.1.value()).map_err(|m| codec_err("delivery_attempts_by_row", m))?);
        }
    }
    Ok(out)
}

/// Writes one attempt row inside an outcome transaction, on its open
/// `delivery_attempts_by_row` table, under the row's next attempt number (normally the
/// entry's own count; a lease reclaimed after a crash never overwrites an earlier row).
pub(super) fn log_attempt_in(t: &mut redb::Table<(u64, u32), &[u8]>, rec: &AttemptRecord) -> Result<(), StoreError> {
    let last = t.range((rec.outbox_id, 0u32)..=(rec.outbox_id, u32::MAX))?.next_back().transpose()?.map(|(k, _)| k.value().1);
    let n = last.map(|n| n.saturating_add(1)).unwrap_or(1);
    t.insert((rec.outbox_id, n), encode(rec).as_slice())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::model::{sample_attempt, sample_event, IdemKey, Severity};
    use crate::store::{Claim, DeliveryResult, LeaseStep, Store};

    /// An outbox row that cannot be decoded (a damaged page, a bug) is skipped by every lease
    /// pass and left in place; the other rows go out as before. (It used to fail every pass:
    /// delivery stopped for the whole store, and rows leased earlier in the pass kept leases.)
    #[test]
    fn an_unreadable_row_is_skipped_and_the_others_go_out() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let (events, claims) = super::super::delivery::sample_claims(&["A", "B"]);
        store.enqueue(&events, &claims, "l1", 0, 3_600_000).unwrap();
        let rows: Vec<u64> = store.outbox().unwrap().into_iter().map(|e| e.id).collect();
        let damaged = rows[0];
        // The endpoint's health record damaged too: it holds nothing back, and the outcome
        // commit writes it afresh instead of failing.
        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(super::OUTBOX).unwrap().insert(damaged, [0xFFu8, 0x01, 0x02].as_slice()).unwrap();
        wtx.open_table(super::ENDPOINTS).unwrap().insert("w", [0xFFu8, 0xFF].as_slice()).unwrap();
        wtx.commit().unwrap();
        for pass in 0..3 {
            let batch = store.lease_due(pass, 60_000, 10, 1).unwrap();
            let ids: Vec<u64> = batch.entries.iter().map(|e| e.id).collect();
            assert_eq!(ids, if pass == 0 { vec![rows[1]] } else { vec![] }, "pass {pass}");
        }
        assert_eq!(store.leased_len().unwrap(), 1, "only the readable row is leased");
        store.record_outcomes(&[DeliveryResult::Sent { id: rows[1], status: 200 }], &[sample_attempt("key-B", rows[1], "sent", 5)], 5).unwrap();
        // When the next row falls due reads past the damaged first row too.
        assert!(store.next_due_ms().unwrap().is_some());
        let fresh = redb::ReadableDatabase::begin_read(&store.db).unwrap().open_table(super::OUTBOX).unwrap();
        assert!(fresh.get(rows[1]).unwrap().is_none(), "the readable row went out");
        let raw = fresh.get(damaged).unwrap().map(|v| v.value().to_vec());
        assert_eq!(raw.as_deref(), Some([0xFFu8, 0x01, 0x02].as_slice()), "the damaged one is left in place");
    }

    /// Two deliverers lease and record outcomes against one store at the same time: leasing
    /// reads a snapshot without the write lock, so only the order of lease release (after the
    /// outcome commit) keeps a resolved row from being leased again. Every row is leased
    /// exactly once and the outbox ends empty.
    #[test]
    fn concurrent_lease_passes_never_hand_out_a_row_twice() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(Store::open(&dir.path().join("z.redb")).unwrap());
        let events: Vec<_> = (0..3_000).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..events.len())
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let batch = store.lease_due(10, 3_600_000, 64, 0).unwrap();
                        if batch.entries.is_empty() {
                            if store.outbox_len().unwrap() == 0 {
                                return mine;
                            }
                            std::thread::yield_now();
                            continue;
                        }
                        let sent: Vec<DeliveryResult> = batch.entries.iter().map(|e| DeliveryResult::Sent { id: e.id, status: 200 }).collect();
                        mine.extend(batch.entries.iter().map(|e| e.id));
                        store.record_outcomes(&sent, &[], 10).unwrap();
                    }
                })
            })
            .collect();
        let mut all: Vec<u64> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
        let leased = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!((leased, all.len()), (events.len(), events.len()), "every row leased exactly once");
        assert_eq!(store.leased_len().unwrap(), 0);
        let r = store.check_consistency().unwrap();
        assert!(r.is_consistent(), "{:?}", r.problems);
    }

    /// A store with 10,000 rows of endpoint "slow" queued ahead of one of "fast" (as retries
    /// due at 5 and 6 when `retries`), and the number of 64-row lease passes that leave "slow"
    /// no room until one leases the "fast" row (at most 4).
    fn passes_to_reach_the_row_behind_a_backlog(retries: bool) -> (Store, tempfile::TempDir, usize) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let n = 10_000;
        let events: Vec<_> = (0..=n).map(|i| sample_event(&format!("P{i:05}"))).collect();
        let claims: Vec<Claim> = (0..=n)
            .map(|i| {
                let w = if i == n { "fast" } else { "slow" };
                Claim { event: i, watcher_id: w.into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) }
            })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
        if retries {
            let failed: Vec<DeliveryResult> = store
                .outbox()
                .unwrap()
                .iter()
                .map(|e| DeliveryResult::Retry { id: e.id, next_attempt_ms: if e.watcher_id == "fast" { 6 } else { 5 }, error: "http_503".into() })
                .collect();
            store.record_outcomes(&failed, &[], 2).unwrap();
        }
        let no_room_for_slow = |w: &str| if w == "slow" { 0 } else { usize::MAX };
        let mut passes = 0;
        let found = loop {
            passes += 1;
            assert!(passes <= 4, "the other endpoint's row is reached within a few passes");
            let retry_floor = if retries { 64 } else { 0 };
            let batch = store.lease_due_probing(10, 60_000, 64, retry_floor, &std::collections::HashSet::new(), &|_| true, &no_room_for_slow).unwrap();
            assert!(batch.entries.iter().all(|e| e.watcher_id == "fast"), "no row of the endpoint without room");
            if let Some(e) = batch.entries.first() {
                break e.parcel_id.clone();
            }
        };
        assert_eq!(found, format!("P{n:05}"));
        (store, dir, passes)
    }

    /// An endpoint at its share (no room) has its rows passed over, and the rows of another
    /// endpoint behind them are leased; a pass reads at most a bounded stretch of passed-over
    /// rows (not a whole backlog under the lease lock) and the next goes on from there.
    #[test]
    fn rows_of_an_endpoint_without_room_are_passed_over_a_bounded_stretch_per_pass() {
        let (_, _dir, passes) = passes_to_reach_the_row_behind_a_backlog(false);
        assert!(passes >= 2, "10,000 rows passed over are more than one pass reads");
    }

    /// The same for due retries: an endpoint without room (or held back) with 10,000 due
    /// retries does not have them all read on every pass, and another endpoint's retry due
    /// after them is leased within a few passes.
    #[test]
    fn due_retries_of_an_endpoint_without_room_are_passed_over_a_bounded_stretch_per_pass() {
        let (store, _dir, passes) = passes_to_reach_the_row_behind_a_backlog(true);
        assert!(passes >= 2, "10,000 retries passed over are more than one pass reads");
        // With room again, the slow endpoint's retries are all leased, from wherever the
        // passes stopped, wrapping to the earliest.
        let mut leased = 0;
        for _ in 0..200 {
            leased += store.lease_due(10, 60_000, 64, 64).unwrap().entries.len();
        }
        assert_eq!(leased, 10_000, "every due retry of the slow endpoint once");
    }

    /// A row given back drops only the lease its own pass took: one a later pass took over
    /// (the first expired, a clock that stepped ahead) belongs to that pass's send.
    #[test]
    fn a_lease_given_back_is_only_the_one_its_pass_took() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let claims = [Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey("k".into()) }];
        store.enqueue(&[sample_event("P")], &claims, "l", 0, 3_600_000).unwrap();
        let first = store.lease_due(10, 100, 10, 0).unwrap();
        let id = first.entries[0].id;
        // A lease ends once its clock time and as much elapsed time have passed.
        assert!(store.lease_due(500, 100, 10, 0).unwrap().entries.is_empty(), "the clock alone does not end it");
        std::thread::sleep(std::time::Duration::from_millis(120));
        let second = store.lease_due(500, 100, 10, 0).unwrap();
        assert_eq!(second.entries[0].id, id, "the first lease expired: taken over");
        store.lease_step(id, first.lease_until_ms, LeaseStep::GiveBack);
        assert_eq!(store.leased_len().unwrap(), 1, "the later pass's lease stays");
        store.lease_step(id, second.lease_until_ms, LeaseStep::GiveBack);
        assert_eq!(store.leased_len().unwrap(), 0);
    }

    /// A pass starts reading the fresh queue where the last one stopped, and wraps to the
    /// front when it reaches the end: rows whose lease expired behind that point are leased
    /// again in the same pass that finds the end of the queue, and every row is handed out.
    #[test]
    fn fresh_leasing_resumes_where_it_stopped_and_wraps_to_the_front() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let events: Vec<_> = (0..10).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..events.len())
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
        let ids: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        let lease = |now: u64, n: usize| -> Vec<u64> { store.lease_due(now, 100, n, 0).unwrap().entries.iter().map(|e| e.id).collect() };
        // Short leases (100 ms) on the first four rows, then a long run of passes.
        assert_eq!(lease(10, 4), ids[..4]);
        assert_eq!(lease(20, 3), ids[4..7], "resumes after the last row read");
        // At 150 the first four leases have expired (their 100 ms elapsed too): the pass
        // reads 7..10, reaches the end, and wraps to the front for the rest of its batch.
        std::thread::sleep(std::time::Duration::from_millis(120));
        let wrapped = lease(150, 6);
        assert_eq!(wrapped[..3], ids[7..], "the tail first");
        assert_eq!(wrapped[3..], ids[..3], "then the front, up to where it stopped");
        // Resumes after row 3; row 4 (expired) and 5, 6 (expired at 120) follow, then the
        // wrap finds nothing new before row 3 that is not leased again.
        assert_eq!(lease(160, 10), [ids[3], ids[4], ids[5], ids[6]]);
        assert!(lease(170, 10).is_empty(), "everything is leased");
        // Completed rows leave the queue; the rest come back after their leases expire.
        let done: Vec<DeliveryResult> = ids[..5].iter().map(|&id| DeliveryResult::Sent { id, status: 200 }).collect();
        store.record_outcomes(&done, &[], 200).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(120));
        let mut rest = lease(1_000, 10);
        rest.sort_unstable();
        assert_eq!(rest, ids[5..]);
    }

    /// The retention sweep reads the log in row order, steps over attempts inside retention,
    /// and reads at most 4 rows per row it may delete: an old attempt behind more young ones
    /// than that waits for a call with a larger budget (or for them to age out); nothing young
    /// is deleted.
    #[test]
    fn the_attempt_sweep_steps_over_young_attempts_within_its_scan_budget() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let stamps = [10u64, 1_000, 1_000, 1_000, 1_000, 1_000, 20];
        let events: Vec<_> = (0..stamps.len()).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..stamps.len())
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
        let rows: Vec<(String, u64)> = store.outbox().unwrap().into_iter().map(|e| (e.key.0, e.id)).collect();
        // Rows 2-6 were delivered late (ts 1,000); rows 1 and 7 early.
        for ((key, id), ts) in rows.iter().zip(stamps) {
            let rec = sample_attempt(key, *id, "sent", ts);
            store.record_outcomes(&[DeliveryResult::Sent { id: *id, status: 200 }], &[rec], ts).unwrap();
        }
        let left = |store: &Store| -> Vec<usize> { rows.iter().map(|(k, _)| store.attempts(k).unwrap().len()).collect() };
        assert_eq!(store.sweep_attempts(500, 1).unwrap(), 1, "row 1, the oldest");
        assert_eq!(store.sweep_attempts(500, 1).unwrap(), 0, "row 7 is behind five young rows, past a budget of 4");
        assert_eq!(left(&store), [0, 1, 1, 1, 1, 1, 1]);
        assert_eq!(store.sweep_attempts(500, 100).unwrap(), 1, "a larger budget reaches it");
        assert_eq!(left(&store), [0, 1, 1, 1, 1, 1, 0]);
        assert_eq!(store.sweep_attempts(2_000, 100).unwrap(), 5);
        assert_eq!(left(&store), [0; 7]);
    }

    /// An attempt row that cannot be read is stepped over, not the end of every later sweep
    /// (the log grew without end behind it), and `check --store` names it.
    #[test]
    fn an_attempt_that_cannot_be_read_does_not_stop_the_sweep() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let events: Vec<_> = (0..2).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..2)
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
        let rows: Vec<(String, u64)> = store.outbox().unwrap().into_iter().map(|e| (e.key.0, e.id)).collect();
        for (key, id) in &rows {
            store.record_outcomes(&[DeliveryResult::Sent { id: *id, status: 200 }], &[sample_attempt(key, *id, "sent", 10)], 10).unwrap();
        }
        // The first row's attempt damaged, in the by-row log and in the log by key.
        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(crate::store::tables::DELIVERY_ATTEMPTS_BY_ROW).unwrap().insert((rows[0].1, 1u32), [0xffu8, 0xff].as_slice()).unwrap();
        wtx.open_table(crate::store::tables::DELIVERY_ATTEMPTS).unwrap().insert(("k-old", 1u32), [0xffu8, 0xff].as_slice()).unwrap();
        wtx.commit().unwrap();
        assert_eq!(store.sweep_attempts(500, 100).unwrap(), 1, "the readable attempt behind it");
        assert_eq!(store.attempts(&rows[1].0).unwrap().len(), 0);
        let problems = store.check_consistency().unwrap().problems;
        assert!(problems.iter().any(|p| p.contains(&format!("delivery attempt 1 of outbox row {}", rows[0].1))), "{problems:?}");
        assert!(problems.iter().any(|p| p.contains("delivery attempt 1 of key k-old")), "{problems:?}");
    }
}
