//! Claims (idempotency keys → outbox rows) and delivery outcomes. An outbox row is removed
//! only in the transaction that writes its terminal audit row.

use super::idem::{is_pending, IdemRecord, IdemState};
use super::expiry::ExpiryIndex;
use super::key_journal::{KeyIndex, KeyTables, Place};
use super::outbox_rows::{decode_entry, encode_dead, encode_entry};
use super::runs::{append_audits, codec_err, AuditRowRef};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::*;
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};
use std::borrow::Cow;
use std::collections::HashSet;

/// Test events for `parcels` and one claim each for subscriber `w` (key `key-<parcel>`,
/// an unroutable loopback target), as the store tests queue them.
#[cfg(test)]
pub(crate) fn sample_claims(parcels: &[&str]) -> (Vec<crate::model::ChangeEvent>, Vec<Claim>) {
    let events = parcels.iter().map(|p| crate::model::sample_event(p)).collect();
    let claims = parcels
        .iter()
        .enumerate()
        .map(|(i, p)| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: crate::model::Severity::Info, key: crate::model::IdemKey(format!("key-{p}")) })
        .collect();
    (events, claims)
}

/// One (change event, subscriber) pair the matcher found.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// Index into the commit's `events`.
    pub event: usize,
    pub watcher_id: String,
    pub target: String,
    pub min_severity: Severity,
    pub key: IdemKey,
}

/// Whether claimed keys are queued for delivery or only primed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClaimMode {
    Deliver,
    /// Claim the key and audit `suppressed` with this detail; nothing is sent.
    Prime { detail: &'static str },
}

/// What the claims of one commit came to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimCounts {
    pub queued: u64,
    pub duplicates: u64,
    pub suppressed: u64,
    pub below_min_severity: u64,
}

/// What a delivery attempt came to, recorded by [`Store::record_deliveries`].
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryResult {
    Sent { id: u64, status: u16 },
    Retry { id: u64, next_attempt_ms: u64, error: String },
    Dead { id: u64, reason: String, cause: DeadCause },
    /// The request never left this machine: this process ran out of a resource of its own
    /// (file descriptors, socket buffers, memory; `local_failure` in `notify/delivery/client.rs`). The
    /// row goes out again at `next_attempt_ms` with its attempts as they were; neither its
    /// retries nor its endpoint's health are charged, and no attempt row is logged (it would
    /// be one every few seconds for as long as the limit lasts). A tester's `ulimit -n 20`
    /// dead-lettered 250 alerts to a receiver that answered 200, and opened its breaker.
    Deferred { id: u64, next_attempt_ms: u64, error: String },
    /// The receiver answered 410 Gone. The commit recording it disables the endpoint and
    /// keeps the row, due at once, for an operator to enable it, whatever its attempts or
    /// window; unless the target that answered is not its stored subscriber's (a `PUT` moved
    /// it while the request was in flight, or a config subscriber hides a stored one of the
    /// id: `StoredTargets::moved_from`), and then the commit records `otherwise`, the
    /// ordinary failure the deliverer worked out for the attempt (a retry on the schedule, a
    /// dead letter past `max_attempts`; a reviewer: such a row was resent at once without end).
    Gone { id: u64, otherwise: Box<DeliveryResult> },
}

impl DeliveryResult {
    /// The outbox row this is the outcome of.
    pub fn id(&self) -> u64 {
        match self {
            DeliveryResult::Sent { id, .. }
            | DeliveryResult::Retry { id, .. }
            | DeliveryResult::Dead { id, .. }
            | DeliveryResult::Deferred { id, .. }
            | DeliveryResult::Gone { id, .. } => *id,
        }
    }

    /// The receiver answered 410 Gone (its endpoint is disabled by the commit recording it).
    pub fn is_gone(&self) -> bool {
        matches!(self, DeliveryResult::Gone { .. })
    }
}

/// The attempt record of a 410 recorded as the failure `otherwise` is (its retry, or its dead
/// letter with the reason beside the 410).
fn logged_as(rec: &AttemptRecord, otherwise: &DeliveryResult) -> AttemptRecord {
    let http_410 = crate::notify::delivery::HTTP_410;
    let (result, error, next_attempt_ms) = match otherwise {
        DeliveryResult::Dead { reason, .. } => ("dead_letter", format!("{http_410}; {reason}"), None),
        DeliveryResult::Retry { next_attempt_ms, .. } => ("retry", http_410.to_string(), Some(*next_attempt_ms)),
        _ => ("retry", http_410.to_string(), rec.next_attempt_ms),
    };
    AttemptRecord { result: result.into(), error: Some(error), next_attempt_ms, ..rec.clone() }
}

/// What [`Store::record_outcomes_with`] committed beyond the results as given.
#[derive(Debug, Default)]
pub struct RecordedOutcomes {
    /// Endpoints whose gate the commit closed (a breaker opened, an endpoint disabled).
    pub closed: Vec<String>,
    /// Rows whose 410 was recorded as the failure it otherwise is (the target that answered is
    /// not its stored subscriber's), each with whether that failure dead-lettered it.
    pub not_gone: Vec<(u64, bool)>,
}

/// Whose doing a dead letter is. Only what the endpoint did counts against its health
/// (circuit breaker, `disable_after`); a row that never reached it says nothing about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadCause {
    /// The endpoint rejected the event, or kept failing until the attempts or the retry
    /// window ran out.
    Endpoint,
    /// Nothing went out: the target or secret is unusable, the address is private and
    /// refused, or no subscriber is left to send to.
    NotSent,
}

/// How many earlier rows a key record names at most (a change that keeps coming back after
/// its TTL would otherwise grow its record without bound; older attempts are still found by
/// the log scan once they are no longer named).
pub(super) const MAX_EARLIER_ROWS: usize = 32;

/// Claims `claims` inside `wtx`: keys (found through `index` in the key journal or the key
/// table), outbox rows for the winners, an audit row for every claim.
#[allow(clippy::too_many_arguments)] // the transaction, its key index and one run's context
pub(super) fn claim_in_txn(
    index: &KeyIndex,
    wtx: &WriteTransaction,
    events: &[ChangeEvent],
    claims: &[Claim],
    lineage: &str,
    mode: ClaimMode,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<ClaimCounts, StoreError> {
    let mut counts = ClaimCounts::default();
    let mut keys = KeyTables::open(wtx, index)?;
    let mut expiry = ExpiryIndex::open(wtx)?;
    // Fresh rows need no due entry: their ids are the fresh queue's order (`outbox.rs`).
    let mut outbox = wtx.open_table(OUTBOX)?;
    let retry_rows = wtx.open_table(OUTBOX_RETRY)?;
    let dead = wtx.open_table(DEAD_LETTERS)?;
    let quarantine = wtx.open_table(DLQ_QUARANTINE)?;
    let mut meta = wtx.open_table(META)?;
    let mut next_id = meta
        .get(META_NEXT_OUTBOX_ID)?
        .map(|v| read_next_outbox_id(v.value()))
        .transpose()?
        .unwrap_or(1);
    let mut pending_audit = Vec::with_capacity(claims.len());
    for claim in claims {
        if events.get(claim.event).is_none() {
            return Err(StoreError::Conflict(format!(
                "claim for watcher {} points at event {} of {}",
                claim.watcher_id,
                claim.event,
                events.len()
            )));
        }
    }

    // Pass 1, in key order: look up and claim the keys. Keys are hashes, so in claim order
    // every lookup and insert would land on a random page of the two key tables; sorted, they
    // sweep each tree once from left to right (measured, issue 7). A stable sort keeps the
    // first of two equal keys in a batch the winner, as in claim order.
    let expires_ms = now_ms.saturating_add(ttl_ms);
    let state = match mode {
        ClaimMode::Deliver => IdemState::Queued,
        ClaimMode::Prime { .. } => IdemState::Suppressed,
    };
    let mut order: Vec<usize> = (0..claims.len()).filter(|&i| events[claims[i].event].severity >= claims[i].min_severity).collect();
    order.sort_by(|&a, &b| claims[a].key.0.cmp(&claims[b].key.0));
    let mut held_by: Vec<Option<String>> = vec![None; claims.len()];
    let mut wins = vec![false; claims.len()];
    // Rows of an expired key's earlier cycles: the new record keeps naming them, so the
    // key's whole attempt history stays reachable (`Store::attempts`).
    let mut history: Vec<Vec<u64>> = vec![Vec::new(); claims.len()];
    // Where a winning claim's expired record lives (None: a new key, for the journal).
    let mut place: Vec<Option<Place>> = vec![None; claims.len()];
    // The previous key in key order and who holds it after its first claim (None: this run).
    let mut previous: Option<(&str, Option<String>)> = None;
    for &i in &order {
        let key = claims[i].key.0.as_str();
        if let Some((_, holder)) = previous.as_ref().filter(|(k, _)| *k == key) {
            // The same key again in one batch: held by whoever holds it after the first
            // claim (stable sort: the first in claim order) — this run, or an earlier one.
            held_by[i] = Some(holder.clone().unwrap_or_else(|| lineage.to_string()));
            continue;
        }
        previous = Some((key, None));
        if let Some((found_in, rec)) = keys.find(key)? {
            // Past its TTL but not swept yet, a key is free again, unless its event can still
            // be sent (queued, dead-lettered): the sweep would re-arm it, and claiming it now
            // would send the event twice.
            if rec.expires_ms > now_ms || is_pending(&rec, &[&outbox, &retry_rows, &dead, &quarantine])? {
                previous = Some((key, Some(rec.lineage_id.clone())));
                held_by[i] = Some(rec.lineage_id);
                continue;
            }
            // Its old expiry entry stays in its bucket: the sweep skips it (the record no
            // longer expires then).
            place[i] = Some(found_in);
            history[i] = rec.rows().collect();
            let keep_from = history[i].len().saturating_sub(MAX_EARLIER_ROWS);
            history[i].drain(..keep_from);
        }
        wins[i] = true;
    }
    // Outbox ids go to the winning claims in claim order (the order rows are delivered in).
    let mut row_of: Vec<Option<u64>> = vec![None; claims.len()];
    if mode == ClaimMode::Deliver {
        let first_id = next_id;
        for (i, won) in wins.iter().enumerate() {
            if *won {
                row_of[i] = Some(next_id);
                next_id = next_id.checked_add(1).ok_or_else(|| codec_err("meta", "the next outbox id is at its largest value".into()))?;
            }
        }
        // The batch's ids are one stretch: one look in each queue (not one per claim) says
        // whether a damaged counter handed out ids a queued row holds.
        if let Some(id) = id_held_in(&[&outbox, &retry_rows], first_id..next_id)? {
            return Err(id_in_use(id));
        }
    }
    let mut claimed_keys: Vec<&str> = Vec::new();
    for &i in &order {
        if !wins[i] {
            continue;
        }
        let key = claims[i].key.0.as_str();
        let rec = IdemRecord { claimed_ms: now_ms, expires_ms, lineage_id: lineage.to_string(), state, outbox_id: row_of[i], ttl_ms, earlier_rows: std::mem::take(&mut history[i]) };
        match place[i] {
            Some(found_in) => keys.update(found_in, key, &rec)?,
            None => keys.insert_new(key, &rec)?,
        }
        claimed_keys.push(key);
    }
    expiry.add(expires_ms, &claimed_keys)?;

    // Pass 2, in claim order: outbox rows for the claimed keys, an audit row for every claim.
    for (i, claim) in claims.iter().enumerate() {
        let event = &events[claim.event];
        let (outcome, detail) = if event.severity < claim.min_severity {
            counts.below_min_severity += 1;
            let detail = format!("below_min_severity: {} < {}", event.severity.as_str(), claim.min_severity.as_str());
            (Outcome::Suppressed, Cow::Owned(detail))
        } else if let Some(holder) = held_by[i].take() {
            counts.duplicates += 1;
            (Outcome::Duplicate, Cow::Owned(format!("key claimed by {holder}")))
        } else {
            match mode {
                ClaimMode::Prime { detail } => {
                    counts.suppressed += 1;
                    (Outcome::Suppressed, Cow::Borrowed(detail))
                }
                ClaimMode::Deliver => {
                    let Some(id) = row_of[i] else {
                        return Err(StoreError::Conflict(format!("claim {i} won its key but has no outbox row")));
                    };
                    let entry = OutboxEntry {
                        id,
                        key: claim.key.clone(),
                        watcher_id: claim.watcher_id.clone(),
                        target: claim.target.clone(),
                        source_id: event.source_id.clone(),
                        parcel_id: event.parcel_id.clone(),
                        lineage_id: lineage.to_string(),
                        severity: event.severity,
                        payload: OutboxPayload::Change(ChangeFields::of(event, now_ms)),
                        attempts: 0,
                        created_ms: now_ms,
                        next_attempt_ms: now_ms,
                        last_error: None,
                    };
                    outbox.insert(id, encode_entry(&entry).as_slice())?;
                    counts.queued += 1;
                    (Outcome::Queued, Cow::Owned(format!("{} {}", event.kind.as_str(), event.severity.as_str())))
                }
            }
        };
        pending_audit.push(AuditRowRef {
            seq: 0,
            ts_ms: now_ms,
            outcome,
            idempotency_key: Some(claim.key.0.as_str()),
            watcher_id: Some(claim.watcher_id.as_str()),
            source_id: Some(event.source_id.as_str()),
            parcel_id: Some(event.parcel_id.as_str()),
            lineage_id: Some(lineage),
            detail,
        });
    }
    meta.insert(META_NEXT_OUTBOX_ID, next_id.to_le_bytes().as_slice())?;
    drop((keys, expiry, outbox, retry_rows, dead, quarantine, meta));
    append_audits(wtx, &mut pending_audit)?;
    Ok(counts)
}

/// The stored next outbox id: exactly 8 little-endian bytes. Anything else is damage, and
/// an error: read leniently (zero-padded), a damaged counter would hand out ids of rows
/// still queued, and their inserts would replace those rows (their events lost).
pub(super) fn read_next_outbox_id(bytes: &[u8]) -> Result<u64, StoreError> {
    let b: [u8; 8] = bytes.try_into().map_err(|_| codec_err("meta", format!("the next outbox id is {} bytes, not 8", bytes.len())))?;
    Ok(u64::from_le_bytes(b))
}

/// The first id of `ids` a row of one of `queues` holds.
pub(super) fn id_held_in<T: ReadableTable<u64, &'static [u8]>>(queues: &[&T], ids: std::ops::Range<u64>) -> Result<Option<u64>, StoreError> {
    let mut first: Option<u64> = None;
    for q in queues {
        if let Some(item) = q.range(ids.clone())?.next() {
            let id = item?.0.value();
            first = Some(first.map_or(id, |f| f.min(id)));
        }
    }
    Ok(first)
}

/// The error of a new outbox row whose id a queued row holds: only a damaged counter gives
/// one, and writing it would replace that row (its event lost).
pub(super) fn id_in_use(id: u64) -> StoreError {
    StoreError::Conflict(format!("outbox id {id} already holds a queued row: the store's next-outbox-id counter is damaged (`zonewatch check --store` says so); nothing was written (restore the store from a backup)"))
}

/// What [`dead_letter_rows`] did with one subscriber's outbox rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowsDeadLettered {
    /// Rows moved to the dead letters (each with its `dead_letter` audit row).
    pub dead_lettered: u64,
    /// Rows left alone because a send of theirs has begun in this process: that send's
    /// outcome is recorded as usual, but one that would leave the row queued (a retry, a
    /// deferral) dead-letters it `subscriber_deleted` (`Lease::revoked`).
    pub in_flight: u64,
}

/// The outbox rows (both queues) of `watcher`, read in `wtx`. Reads the whole outbox (an
/// operator's action on a subscriber, not a delivery path): done before the lease lock is
/// taken, since the write transaction already keeps every row as read.
pub(super) fn outbox_rows_of(wtx: &WriteTransaction, watcher: &str) -> Result<Vec<(super::outbox::Queue, OutboxEntry)>, StoreError> {
    let mut rows = Vec::new();
    for (table, queue, name) in [(OUTBOX, super::outbox::Queue::Fresh, "outbox"), (OUTBOX_RETRY, super::outbox::Queue::Retry, "outbox_retry")] {
        for item in wtx.open_table(table)?.iter()? {
            let (k, v) = item?;
            // Another subscriber's row is passed over on its leading fields, not decoded whole
            // (a delete held the write lock while it decoded every change of the outbox).
            if super::outbox_rows::entry_watcher(v.value()).is_ok_and(|w| w != watcher) {
                continue;
            }
            // A row that cannot be decoded is left where it is (delivery passes over it too,
            // and `check --store` names it): it must not stop every subscriber's delete.
            let entry = match decode_entry(v.value()) {
                Ok(entry) => entry,
                Err(why) => {
                    tracing::error!(row = k.value(), "{name} row {} cannot be read and is left in place: {why}", k.value());
                    continue;
                }
            };
            if entry.watcher_id == watcher {
                rows.push((queue, entry));
            }
        }
    }
    Ok(rows)
}

/// Dead-letters `rows` (read by [`outbox_rows_of`] in the same `wtx`) with `reason`, each
/// with its terminal `dead_letter` audit row (invariant 3). Rows for which `in_flight` is
/// true (their send has begun) are skipped: asked under the lease lock, whose holder commits
/// before releasing it. Returns the counts and the ids dead-lettered.
pub(super) fn dead_letter_rows(
    wtx: &WriteTransaction,
    rows: Vec<(super::outbox::Queue, OutboxEntry)>,
    reason: &str,
    now_ms: u64,
    in_flight: &dyn Fn(u64) -> bool,
) -> Result<(RowsDeadLettered, Vec<u64>, Vec<u64>), StoreError> {
    let mut done = RowsDeadLettered::default();
    let mut pending = Vec::with_capacity(rows.len());
    let mut ids = Vec::with_capacity(rows.len());
    let mut left_sending = Vec::new();
    {
        let mut outbox = super::outbox::OutboxTables::open(wtx)?;
        let mut dead = wtx.open_table(DEAD_LETTERS)?;
        for (queue, entry) in rows {
            if in_flight(entry.id) {
                done.in_flight += 1;
                left_sending.push(entry.id);
                continue;
            }
            ids.push(entry.id);
            pending.push(dead_letter_in(&mut outbox, &mut dead, queue, entry, reason, now_ms)?);
            done.dead_lettered += 1;
        }
    }
    append_audits(wtx, &mut pending)?;
    Ok((done, ids, left_sending))
}

/// Moves one outbox row from `queue` to the dead letters with `reason`; returns its terminal
/// `dead_letter` audit row, for the caller to append with its batch. The one way a row
/// becomes a dead letter, for delivery outcomes and operator actions alike.
fn dead_letter_in(
    outbox: &mut super::outbox::OutboxTables<'_>,
    dead: &mut redb::Table<'_, u64, &'static [u8]>,
    queue: super::outbox::Queue,
    entry: OutboxEntry,
    reason: &str,
    now_ms: u64,
) -> Result<AuditRow, StoreError> {
    outbox.remove(queue, &entry)?;
    let audit = AuditRow::for_entry(&entry, Outcome::DeadLetter, now_ms, reason.to_string());
    let dl = DeadLetter { entry, reason: reason.to_string(), dead_at_ms: now_ms };
    dead.insert(dl.entry.id, encode_dead(&dl).as_slice())?;
    Ok(audit)
}

impl Store {
    /// Claims keys and queues deliveries for already-detected events outside a run (the path
    /// used to re-inject events, and by tests of the claim race). One transaction.
    pub fn enqueue(
        &self,
        events: &[ChangeEvent],
        claims: &[Claim],
        lineage: &str,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<ClaimCounts, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let counts = claim_in_txn(&self.key_index, &wtx, events, claims, lineage, ClaimMode::Deliver, now_ms, ttl_ms)?;
        wtx.commit()?;
        self.merge_key_journal_if_full();
        Ok(counts)
    }

    /// Outbox entries due at `now_ms` (fresh first, then retries, each oldest due first),
    /// skipping ids in `exclude`. Read-only: delivery itself leases with [`Store::lease_due`].
    pub fn due_outbox(
        &self,
        now_ms: u64,
        limit: usize,
        exclude: &HashSet<u64>,
    ) -> Result<Vec<OutboxEntry>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut out = Vec::new();
        for item in rtx.open_table(OUTBOX)?.iter()? {
            if out.len() >= limit {
                return Ok(out);
            }
            let (k, v) = item?;
            if !exclude.contains(&k.value()) {
                out.push(decode_entry(v.value()).map_err(|m| codec_err("outbox", m))?);
            }
        }
        let retry = rtx.open_table(OUTBOX_RETRY)?;
        for item in rtx.open_table(OUTBOX_RETRY_DUE)?.range(..(now_ms.saturating_add(1), 0u64))? {
            if out.len() >= limit {
                break;
            }
            let (k, _) = item?;
            let (_, id) = k.value();
            if exclude.contains(&id) {
                continue;
            }
            if let Some(v) = retry.get(id)? {
                out.push(decode_entry(v.value()).map_err(|m| codec_err("outbox_retry", m))?);
            }
        }
        Ok(out)
    }

    /// When the earliest outbox entry (fresh or retry) falls due (None when the outbox is empty).
    pub fn next_due_ms(&self) -> Result<Option<u64>, StoreError> {
        let rtx = self.db.begin_read()?;
        // A fresh row is due from its claim on. One that cannot be decoded (lease passes skip
        // it, `check` names it) reads as due already, as every fresh row is: failing here
        // would stop every drain, and every `run`, on it.
        let fresh = rtx.open_table(OUTBOX)?.first()?.map(|(_, v)| decode_entry(v.value()).map_or(0, |e| e.next_attempt_ms));
        let retry = rtx.open_table(OUTBOX_RETRY_DUE)?.first()?.map(|(k, _)| k.value().0);
        Ok(match (fresh, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// The earliest retry that falls due after `after_ms` (fresh rows are all due already).
    /// A drain whose due rows are all held back waits for this, or for a breaker's probe.
    pub fn next_retry_due_after_ms(&self, after_ms: u64) -> Result<Option<u64>, StoreError> {
        let rtx = self.db.begin_read()?;
        let due = rtx.open_table(OUTBOX_RETRY_DUE)?;
        let next = due.range((after_ms.saturating_add(1), 0u64)..)?.next();
        Ok(match next {
            Some(item) => Some(item?.0.value().0),
            None => None,
        })
    }

    /// Records a batch of delivery outcomes in one transaction (group commit).
    pub fn record_deliveries(&self, results: &[DeliveryResult], now_ms: u64) -> Result<(), StoreError> {
        self.record_outcomes(results, &[], now_ms)
    }

    /// Records a batch of delivery outcomes and their attempt log rows in one transaction
    /// (group commit). Each entry's lease is dropped once the transaction has committed.
    pub fn record_outcomes(&self, results: &[DeliveryResult], attempts: &[AttemptRecord], now_ms: u64) -> Result<(), StoreError> {
        self.record_outcomes_with(results, attempts, now_ms, None).map(|_| ())
    }

    /// [`Store::record_outcomes`], also folding each result into its endpoint's health
    /// (circuit breaker, 410, `disable_after`) when `health` is given. Returns the endpoints
    /// whose gate this commit closed (a breaker opened, an endpoint disabled): rows of theirs
    /// leased before it are not to be sent (`notify::closed_gates`); and the 410s recorded as
    /// the failures they otherwise are ([`DeliveryResult::Gone`]).
    pub fn record_outcomes_with(
        &self,
        results: &[DeliveryResult],
        attempts: &[AttemptRecord],
        now_ms: u64,
        health: Option<&super::endpoints::HealthPolicy>,
    ) -> Result<RecordedOutcomes, StoreError> {
        if results.is_empty() && attempts.is_empty() {
            return Ok(RecordedOutcomes::default());
        }
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        // A clock that stepped back since the last outcome commit: the due times that commit
        // left are moved first, as this one writes its own clock (`clock_step.rs`).
        let moved = super::clock_step::move_if_stepped_in(&wtx, now_ms)?;
        // Each table is opened once for the whole batch: a group commit carries thousands of
        // outcomes and per-row table opens would dominate it.
        let mut pending: Vec<AuditRow> = Vec::with_capacity(results.len());
        // The target each 410 was sent to (only those attempts carry one): a 410 from one
        // that is no longer its subscriber's (a `PUT` moved it while the request was in
        // flight) does not disable the endpoint as it is now (it still counts as a failure).
        let sent_to: std::collections::HashMap<u64, &str> = attempts.iter().filter(|a| a.result != "sent").filter_map(|a| Some((a.outbox_id, a.target.as_deref()?))).collect();
        // Endpoints this commit disables, with the target each was disabled for.
        let mut disabled_for: Vec<(String, String)> = Vec::new();
        // The clock each retry's due time was computed on.
        let decided: std::collections::HashMap<u64, u64> = attempts.iter().filter_map(|a| Some((a.outbox_id, a.decided_ms?))).collect();
        // Rows whose subscriber was deleted while they were sent: not left queued.
        let revoked = self.leases.revoked(results.iter().filter(|r| !matches!(r, DeliveryResult::Sent { .. })).map(DeliveryResult::id));
        // 410s recorded as the failures they otherwise are, by row.
        let mut not_gone: std::collections::HashMap<u64, &DeliveryResult> = std::collections::HashMap::new();
        let closed = {
            let mut outbox = super::outbox::OutboxTables::open(&wtx)?;
            let mut dead = wtx.open_table(DEAD_LETTERS)?;
            let mut endpoints = wtx.open_table(ENDPOINTS)?;
            let mut targets = super::subscribers::StoredTargets::new(&wtx);
            let mut health_batch = super::endpoints::HealthBatch::new(&mut endpoints, self.forward_steps());
            for result in results {
                let id = result.id();
                // Already resolved (e.g. by a concurrent recovery): nothing to record.
                let Some((queue, entry)) = outbox.get(id)? else { continue };
                // A 410 from a target that is not its stored subscriber's (the old one, after a
                // `PUT`) is the failure it otherwise is, not a "gone"; so is every 410 recorded
                // without a health policy, which disables nothing (kept due at once, the row
                // would be sent again without end).
                let result = match result {
                    DeliveryResult::Gone { otherwise, .. } if health.is_none() || targets.moved_from(&entry.watcher_id, sent_to.get(&id).copied())? => {
                        not_gone.insert(id, otherwise.as_ref());
                        otherwise.as_ref()
                    }
                    result => result,
                };
                // A deleted subscriber's health was forgotten with it, not started again.
                if let Some(policy) = health.filter(|_| !revoked.contains(&id)) {
                    let (success, gone, local) = match result {
                        DeliveryResult::Sent { .. } => (true, false, false),
                        DeliveryResult::Retry { .. } => (false, false, false),
                        DeliveryResult::Gone { .. } => (false, true, false),
                        DeliveryResult::Dead { cause, .. } => (false, false, *cause == DeadCause::NotSent),
                        DeliveryResult::Deferred { .. } => (false, false, true),
                    };
                    if !local {
                        if let Some(row) = health_batch.observe(&entry.watcher_id, success, gone, now_ms, policy)? {
                            pending.push(row);
                            if let Some(target) = sent_to.get(&id) {
                                disabled_for.push((entry.watcher_id.clone(), target.to_string()));
                            }
                        }
                    }
                }
                let attempts = entry.attempts.saturating_add(1);
                let mut audit = AuditRow::for_entry(&entry, Outcome::Sent, now_ms, String::new());
                match result {
                    DeliveryResult::Sent { status, .. } => {
                        outbox.remove(queue, &entry)?;
                        audit.detail = format!("http_{status} attempt {attempts}");
                        pending.push(audit);
                    }
                    DeliveryResult::Dead { reason, .. } => {
                        let mut dead_entry = entry.clone();
                        dead_entry.attempts = attempts;
                        // Its subscriber was deleted while it was sent: the letter says so, as
                        // the delete marked those it found (a replay sets it aside should a
                        // config subscriber take the id: a reviewer).
                        let reason = if revoked.contains(&id) { super::subscribers::marked_deleted(reason) } else { reason.clone() };
                        pending.push(dead_letter_in(&mut outbox, &mut dead, queue, dead_entry, &reason, now_ms)?);
                    }
                    DeliveryResult::Retry { .. } | DeliveryResult::Deferred { .. } | DeliveryResult::Gone { .. } if revoked.contains(&id) => {
                        let mut dead_entry = entry.clone();
                        // A deferral was no attempt (nothing reached the endpoint).
                        if !matches!(result, DeliveryResult::Deferred { .. }) {
                            dead_entry.attempts = attempts;
                        }
                        pending.push(dead_letter_in(&mut outbox, &mut dead, queue, dead_entry, super::subscribers::SUBSCRIBER_DELETED, now_ms)?);
                    }
                    DeliveryResult::Retry { next_attempt_ms, error, .. } => {
                        let mut updated = entry.clone();
                        updated.attempts = attempts;
                        updated.next_attempt_ms = super::clock_step::retry_due(*next_attempt_ms, decided.get(&id).copied(), now_ms);
                        updated.last_error = Some(error.clone());
                        outbox.move_to_retry(queue, &entry, &updated)?;
                    }
                    DeliveryResult::Gone { .. } => {
                        // Due at once: it goes out as soon as an operator enables the endpoint.
                        let mut updated = entry.clone();
                        updated.attempts = attempts;
                        updated.next_attempt_ms = now_ms;
                        updated.last_error = Some(crate::notify::delivery::HTTP_410_GONE.into());
                        outbox.move_to_retry(queue, &entry, &updated)?;
                    }
                    DeliveryResult::Deferred { next_attempt_ms, error, .. } => {
                        let updated = OutboxEntry { next_attempt_ms: *next_attempt_ms, last_error: Some(error.clone()), ..entry.clone() };
                        outbox.move_to_retry(queue, &entry, &updated)?;
                    }
                }
            }
            health_batch.finish()?
        };
        {
            // The attempts, as their outcomes were recorded: a 410 taken as a failure is logged
            // as that failure (`http_410`, its retry or its dead letter), not as a gone.
            let deferred: std::collections::HashSet<u64> = results.iter().filter(|r| matches!(r, DeliveryResult::Deferred { .. })).map(DeliveryResult::id).collect();
            let mut log = wtx.open_table(DELIVERY_ATTEMPTS_BY_ROW)?;
            for rec in attempts.iter().filter(|rec| !deferred.contains(&rec.outbox_id)) {
                match not_gone.get(&rec.outbox_id) {
                    Some(otherwise) => super::leases::log_attempt_in(&mut log, &logged_as(rec, otherwise))?,
                    None => super::leases::log_attempt_in(&mut log, rec)?,
                }
            }
        }
        if !disabled_for.is_empty() {
            let mut t = wtx.open_table(ENDPOINT_DISABLED_TARGETS)?;
            for (id, target) in &disabled_for {
                t.insert(id.as_str(), target.as_str())?;
            }
        }
        append_audits(&wtx, &mut pending)?;
        // The clock these retry and breaker times were computed on (`clock_step.rs`).
        super::clock_step::note_due_clock_in(&wtx, now_ms)?;
        // Steps forward of the clock found since the last commit (`clock_forward.rs`).
        let steps_written = super::clock_forward::save_steps_in(self, &wtx)?;
        // The leases are dropped after the commit, never before (see `leases::Leases`: a lease
        // pass that no longer finds the lease opens its snapshot after this commit), marked
        // settling while it lands (see `Leases::commit_and_release`).
        let ids: Vec<u64> = results.iter().map(DeliveryResult::id).collect();
        self.leases.commit_and_release(wtx, &ids)?;
        self.forward_steps_saved(steps_written);
        if let Some(m) = moved {
            super::clock_step::say_moved(&m);
        }
        Ok(RecordedOutcomes { closed, not_gone: not_gone.into_iter().map(|(id, otherwise)| (id, matches!(otherwise, DeliveryResult::Dead { .. }))).collect() })
    }

    /// Deletes idempotency keys that expired before `now_ms`, at most `max` expiry entries per
    /// call, so the sweep never holds the write lock for long. Returns the keys deleted.
    ///
    /// A key whose event has not reached a final outcome yet (still queued, or dead-lettered
    /// and so replayable) is never deleted: that would let a re-detection of the same event
    /// claim it again while the first copy can still be sent. Its expiry is re-armed for one
    /// more TTL from `now_ms` instead, so it expires once its event is sent or suppressed.
    pub fn sweep_expired_keys(&self, now_ms: u64, max: usize) -> Result<usize, StoreError> {
        self.sweep_expired_keys_batch(now_ms, max).map(|b| b.removed)
    }

    /// [`Store::sweep_expired_keys`], saying too whether the batch took as many expiry
    /// entries as it could (`more`: others may be due behind them, re-armed ones included).
    /// A removed key's replay count goes with it: a later claim of the key (a new TTL cycle)
    /// starts its replays from 0, and the table does not grow by a row per replayed key.
    pub fn sweep_expired_keys_batch(&self, now_ms: u64, max: usize) -> Result<super::SweepBatch, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut n = 0;
        let more;
        {
            let mut expiry = ExpiryIndex::open(&wtx)?;
            let mut keys = KeyTables::open(&wtx, &self.key_index)?;
            let holding = [wtx.open_table(OUTBOX)?, wtx.open_table(OUTBOX_RETRY)?, wtx.open_table(DEAD_LETTERS)?, wtx.open_table(DLQ_QUARANTINE)?];
            let holding: Vec<_> = holding.iter().collect();
            let mut replays = wtx.open_table(DLQ_REPLAYS)?;
            let victims = expiry.take_due(now_ms, max)?;
            more = victims.len() >= max;
            // Re-armed keys by their new expiry (keys claimed with different TTLs differ).
            let mut rearmed: std::collections::BTreeMap<u64, Vec<String>> = std::collections::BTreeMap::new();
            for (t, key) in victims {
                // Only act on the key if this expiry entry is still its current one.
                let current = match keys.find(key.as_str()) {
                    Ok(found) => found,
                    Err(StoreError::Codec { message, .. }) => {
                        // Left in place for `zonewatch check` to report; never guessed at.
                        tracing::warn!(key = %key, "idempotency key record unreadable, not swept: {message}");
                        None
                    }
                    Err(e) => return Err(e),
                };
                let Some((found_in, mut rec)) = current.filter(|(_, r)| r.expires_ms == t) else { continue };
                if is_pending(&rec, &holding)? {
                    rec.expires_ms = now_ms.saturating_add(rec.ttl_ms.max(1));
                    keys.update(found_in, key.as_str(), &rec)?;
                    rearmed.entry(rec.expires_ms).or_default().push(key);
                } else {
                    keys.remove(found_in, key.as_str())?;
                    replays.remove(key.as_str())?;
                    n += 1;
                }
            }
            for (expires_ms, group) in &rearmed {
                expiry.add(*expires_ms, &group.iter().map(String::as_str).collect::<Vec<_>>())?;
            }
        }
        wtx.commit()?;
        Ok(super::SweepBatch { removed: n, more })
    }
}
