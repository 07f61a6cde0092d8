//! Stored due times put right after the wall clock stepped back.
//!
//! Why it exists: retries (`outbox_retry_due`) and breaker probes (`endpoints`) are stored as
//! wall-clock times, computed from the clock of the outcome commit that scheduled them. When
//! that clock was ahead and is then stepped back (NTP correcting it, an edge box without a
//! real-time clock booting at an old time, an operator's `date -s`), every one of them lies that
//! much further off: a retry due in 5 s waits the size of the step, hours or years. Holding the
//! clock back instead was tried (thirty-second session) and reverted: it never catches up, and
//! the `webhook-timestamp` it signs would run ahead of the receiver's clock.
//!
//! How: every outcome commit also writes its own `now` to `meta` (`META_DUE_CLOCK`). A clock
//! reading more than [`CLOCK_STEP_TOLERANCE_MS`] behind that value can only be a clock that went
//! back since the commit, by at least the difference. [`Store::move_due_times_back`] then moves
//! every retry and breaker time still ahead by that difference (never before now) and writes
//! the new `now`, all in one transaction, so a second look finds nothing to move. The deliverer
//! looks before each pass (`notify::delivery`), so the same holds for `serve`, `run` and
//! `deliver`, and for a step taken while zonewatch was stopped.
//!
//! The difference is a lower bound of the step (the clock kept running between the commit and
//! the step): a moved retry waits at most what was left of its wait at that commit, never the
//! step. Left as they are: idempotency-key expiries (a key claimed before the step is kept
//! that much longer, which is the safe side) and the times rows and runs were recorded at.

use super::outbox_rows::{decode_entry, encode_entry};
use super::runs::codec_err;
use super::tables::{ENDPOINTS, META, META_DUE_CLOCK, OUTBOX_RETRY, OUTBOX_RETRY_DUE};
use super::{Store, StoreError};
use crate::model::EndpointState;
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};

/// How far behind the last outcome commit the clock may read before it counts as a step back:
/// outcome commits of concurrent workers read the clock a few milliseconds apart, and a
/// second's step costs a retry no more than a second.
pub const CLOCK_STEP_TOLERANCE_MS: u64 = 2_000;

/// Version byte of the `META_DUE_CLOCK` value (then the time, 8 bytes little-endian).
const DUE_CLOCK_VERSION: u8 = 1;

/// What one [`Store::move_due_times_back`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DueTimesMoved {
    /// How far the clock went back, at least (ms): the last outcome commit's time minus now.
    pub step_ms: u64,
    /// Retries whose due time moved.
    pub retries: u64,
    /// Endpoints whose breaker probe (or `disable_after` start) moved.
    pub endpoints: u64,
}

/// Records `now_ms` as the clock of the due times this transaction writes.
pub(super) fn note_due_clock_in(wtx: &WriteTransaction, now_ms: u64) -> Result<(), StoreError> {
    let mut value = [0u8; 9];
    value[0] = DUE_CLOCK_VERSION;
    value[1..].copy_from_slice(&now_ms.to_le_bytes());
    wtx.open_table(META)?.insert(META_DUE_CLOCK, value.as_slice())?;
    Ok(())
}

/// The stored clock of the last outcome commit. A value this build cannot read counts as none:
/// the next outcome commit writes it afresh, and nothing depends on it but this repair.
fn due_clock(meta: &impl ReadableTable<&'static str, &'static [u8]>) -> Result<Option<u64>, StoreError> {
    let Some(v) = meta.get(META_DUE_CLOCK)? else { return Ok(None) };
    let bytes = v.value();
    Ok(match (bytes.first(), bytes.get(1..9).and_then(|b| <[u8; 8]>::try_from(b).ok())) {
        (Some(&DUE_CLOCK_VERSION), Some(t)) if bytes.len() == 9 => Some(u64::from_le_bytes(t)),
        _ => None,
    })
}

/// The step, when `now_ms` reads further behind `seen` than the tolerance.
fn step_back(seen: Option<u64>, now_ms: u64) -> Option<u64> {
    seen.filter(|&seen| seen > now_ms.saturating_add(CLOCK_STEP_TOLERANCE_MS)).map(|seen| seen - now_ms)
}

/// `t` moved back by `step`, but not before `now_ms` (it was still ahead).
fn moved(t: u64, step: u64, now_ms: u64) -> u64 {
    t.saturating_sub(step).max(now_ms)
}

/// The due time an outcome commit at `now_ms` stores for a retry its attempt scheduled at
/// `next_ms` on the clock it read when it decided (`decided_ms`, when known). A clock that
/// stepped back between that decision and this commit shows as a decision time ahead of the
/// commit's: the due time moves back as much (never before now), as the stored ones do. The
/// commit's own look at the stored clock cannot see it: its batch is not stored yet, and the
/// clock it writes erases the evidence (found by a reviewer: a commit held up behind a long
/// run commit is a wide window).
pub(super) fn retry_due(next_ms: u64, decided_ms: Option<u64>, now_ms: u64) -> u64 {
    match step_back(decided_ms, now_ms) {
        Some(step) if next_ms > now_ms => moved(next_ms, step, now_ms),
        _ => next_ms,
    }
}

impl Store {
    /// Whether the clock reads behind the last outcome commit by more than the tolerance (one
    /// read, cheap enough for every delivery pass). Returns the step.
    pub fn clock_stepped_back(&self, now_ms: u64) -> Result<Option<u64>, StoreError> {
        let rtx = self.db.begin_read()?;
        let meta = match rtx.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(step_back(due_clock(&meta)?, now_ms))
    }

    /// Moves every retry due time and breaker time still ahead of `now_ms` back by the step the
    /// clock took (see the module doc), in one durable transaction that also records `now_ms`.
    /// `None` when the clock did not step back (nothing is written).
    pub fn move_due_times_back(&self, now_ms: u64) -> Result<Option<DueTimesMoved>, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        // Looked at again under the write lock: a concurrent caller may have moved them.
        let Some(done) = move_if_stepped_in(&wtx, now_ms)? else { return Ok(None) };
        note_due_clock_in(&wtx, now_ms)?;
        wtx.commit()?;
        Ok(Some(done))
    }
}

/// In `wtx`: when the stored clock shows a step back at `now_ms`, moves the due times (see
/// [`Store::move_due_times_back`]) and returns what moved. Every outcome commit calls it
/// before it writes its own clock, which would otherwise erase the evidence of a step taken
/// while a delivery pass was running (found by a reviewer).
pub(super) fn move_if_stepped_in(wtx: &WriteTransaction, now_ms: u64) -> Result<Option<DueTimesMoved>, StoreError> {
    let Some(step_ms) = step_back(due_clock(&wtx.open_table(META)?)?, now_ms) else { return Ok(None) };
    let mut done = DueTimesMoved { step_ms, ..Default::default() };
    {
        let mut due = wtx.open_table(OUTBOX_RETRY_DUE)?;
        let mut retry = wtx.open_table(OUTBOX_RETRY)?;
        let ahead: Vec<(u64, u64)> = due
            .range((now_ms.saturating_add(1), 0u64)..)?
            .map(|item| item.map(|(k, _)| k.value()))
            .collect::<Result<_, _>>()?;
        for (at, id) in ahead {
            let mut entry = match retry.get(id)? {
                Some(v) => match decode_entry(v.value()) {
                    Ok(e) => e,
                    // Left for `zonewatch check` to name; its index entry stays with it.
                    Err(m) => {
                        tracing::warn!(id, "outbox_retry row unreadable, its due time not moved: {}", codec_err("outbox_retry", m));
                        continue;
                    }
                },
                None => continue,
            };
            if entry.next_attempt_ms != at {
                continue;
            }
            entry.next_attempt_ms = moved(at, step_ms, now_ms);
            due.remove((at, id))?;
            due.insert((entry.next_attempt_ms, id), ())?;
            retry.insert(id, encode_entry(&entry).as_slice())?;
            done.retries += 1;
        }
    }
    {
        let mut endpoints = wtx.open_table(ENDPOINTS)?;
        let mut changed: Vec<(String, EndpointState)> = Vec::new();
        for item in endpoints.iter()? {
            let (k, v) = item?;
            // An unreadable record starts afresh at its next outcome (`endpoints.rs`).
            let Ok(mut s) = super::codec::decode::<EndpointState>(v.value()) else { continue };
            let mut touched = false;
            if let Some(t) = s.breaker_open_until_ms.filter(|&t| t > now_ms) {
                s.breaker_open_until_ms = Some(moved(t, step_ms, now_ms));
                touched = true;
            }
            // The start of a failure streak recorded ahead of now: `disable_after` counts
            // from it, and would count that much longer.
            if let Some(t) = s.failing_since_ms.filter(|&t| t > now_ms) {
                s.failing_since_ms = Some(t.saturating_sub(step_ms).min(now_ms));
                touched = true;
            }
            if touched {
                changed.push((k.value().to_string(), s));
            }
        }
        for (id, s) in &changed {
            endpoints.insert(id.as_str(), super::codec::encode(s).as_slice())?;
        }
        done.endpoints = changed.len() as u64;
    }
    Ok(Some(done))
}

/// The log line for a move (from a delivery pass, or from the outcome commit that found it).
pub fn say_moved(m: &DueTimesMoved) {
    tracing::warn!(
        step_s = m.step_ms / 1000,
        retries = m.retries,
        endpoints = m.endpoints,
        "the system clock went back at least {} s since the last delivery outcome: the due times of {} retries and the health times of {} endpoints moved back as much, so they keep their wait",
        m.step_ms / 1000,
        m.retries,
        m.endpoints
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, AttemptRecord, IdemKey, Severity};
    use crate::store::{Claim, DeliveryResult, HealthPolicy};

    const T: u64 = 1_800_000_000_000;
    const HOUR: u64 = 3_600_000;

    /// A new store with `n` rows queued (one event, `n` keys); the folder lives as long as it.
    fn queued(n: usize) -> (tempfile::TempDir, Store, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let claims: Vec<Claim> = (0..n)
            .map(|i| Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&[sample_event("A")], &claims, "l", T, 86_400_000).unwrap();
        let ids = store.outbox().unwrap().iter().map(|e| e.id).collect();
        (dir, store, ids)
    }

    /// A failed try of row `id`, due again at `at`.
    fn retry(id: u64, at: u64) -> DeliveryResult {
        DeliveryResult::Retry { id, next_attempt_ms: at, error: "http_503".into() }
    }

    fn due_of(store: &Store, id: u64) -> u64 {
        store.outbox().unwrap().into_iter().find(|e| e.id == id).unwrap().next_attempt_ms
    }

    /// Retries and a breaker scheduled on a clock an hour ahead fall due, after the clock is
    /// put right, after what was left of their wait (not an hour later); a retry already due
    /// stays due; the index agrees with the rows; a second look moves nothing.
    #[test]
    fn due_times_scheduled_ahead_of_a_clock_stepped_back_keep_their_wait() {
        let (_dir, store, ids) = queued(3);
        let ahead = T + HOUR;
        let policy = HealthPolicy { breaker_min: 2, breaker_ratio: 0.5, breaker_cooldown_ms: 60_000, ..Default::default() };
        store.record_outcomes_with(&[retry(ids[0], ahead + 5_000), retry(ids[1], ahead + 600_000), retry(ids[2], T - 1_000)], &[], ahead, Some(&policy)).unwrap();
        let breaker = store.endpoints().unwrap()[0].1.breaker_open_until_ms.unwrap();
        assert_eq!(breaker, ahead + 60_000);
        assert_eq!(store.clock_stepped_back(ahead + 1_000).unwrap(), None, "a clock going on is no step");
        assert_eq!(store.move_due_times_back(ahead).unwrap(), None);

        // The clock is put right: an hour back.
        assert_eq!(store.clock_stepped_back(T).unwrap(), Some(HOUR));
        let done = store.move_due_times_back(T).unwrap().unwrap();
        assert_eq!(done, DueTimesMoved { step_ms: HOUR, retries: 2, endpoints: 1 });
        assert_eq!(due_of(&store, ids[0]), T + 5_000);
        assert_eq!(due_of(&store, ids[1]), T + 600_000);
        assert_eq!(due_of(&store, ids[2]), T - 1_000, "due already: left alone");
        let ep = &store.endpoints().unwrap()[0].1;
        assert_eq!(ep.breaker_open_until_ms, Some(T + 60_000));
        assert_eq!(ep.failing_since_ms, Some(T));
        assert!(store.check_consistency().unwrap().is_consistent(), "the due index moved with its rows");
        assert_eq!(store.next_retry_due_after_ms(T).unwrap(), Some(T + 5_000), "the due index was moved with the rows");

        // Seen and moved once: the same clock (or one a second on) finds nothing more.
        assert_eq!(store.clock_stepped_back(T).unwrap(), None);
        assert_eq!(store.move_due_times_back(T + 1_000).unwrap(), None);
        assert_eq!(due_of(&store, ids[1]), T + 600_000);
    }

    /// A step taken while a delivery pass runs: the pass's next outcome commit (on the
    /// corrected clock) moves the earlier retries before it writes its own clock, which would
    /// otherwise erase the evidence (a reviewer found the pass-start check alone missed it).
    #[test]
    fn an_outcome_commit_after_a_step_moves_the_due_times_it_would_hide() {
        let (_dir, store, ids) = queued(2);
        let ahead = T + HOUR;
        store.record_outcomes(&[retry(ids[0], ahead + 5_000)], &[], ahead).unwrap();
        // The clock is put right; the pass's next outcome (another row's) commits at T.
        store.record_outcomes(&[retry(ids[1], T + 7_000)], &[], T).unwrap();
        assert_eq!(due_of(&store, ids[0]), T + 5_000, "moved by the commit that found the step");
        assert_eq!(due_of(&store, ids[1]), T + 7_000, "this commit's own retry is on the corrected clock");
        assert_eq!(store.clock_stepped_back(T).unwrap(), None);
        assert!(store.check_consistency().unwrap().is_consistent());
    }

    /// A step taken between an attempt and the commit that records it: the attempt's due
    /// time, computed on the clock before the step, keeps its wait; one decided on the
    /// corrected clock, or with no attempt record, is stored as given.
    #[test]
    fn a_retry_decided_before_a_step_in_the_same_commit_keeps_its_wait() {
        let (_dir, store, ids) = queued(3);
        let ahead = T + HOUR;
        let attempt = |id: u64, decided_ms: u64| AttemptRecord {
            key: format!("k{id}"),
            outbox_id: id,
            attempt: 1,
            ts_ms: decided_ms - 250,
            duration_ms: 250,
            status: Some(503),
            result: "retry".into(),
            error: None,
            response_head: String::new(),
            next_attempt_ms: None,
            target: None,
            decided_ms: Some(decided_ms),
        };
        store
            .record_outcomes(&[retry(ids[0], ahead + 5_000), retry(ids[1], T + 7_000), retry(ids[2], ahead + 9_000)], &[attempt(ids[0], ahead), attempt(ids[1], T - 300)], T)
            .unwrap();
        assert_eq!(due_of(&store, ids[0]), T + 5_000, "decided an hour ahead of the commit");
        assert_eq!(due_of(&store, ids[1]), T + 7_000, "decided on the corrected clock");
        assert_eq!(due_of(&store, ids[2]), ahead + 9_000, "no attempt record: nothing tells when it was decided");
        assert!(store.check_consistency().unwrap().is_consistent());
        assert_eq!(retry_due(T + 5_000, Some(T + 1_900), T), T + 5_000, "within the tolerance");
        assert_eq!(retry_due(T - 5, Some(T + HOUR), T), T - 5, "already due");
    }

    /// A step bigger than a wait: the retry is due at once, not before "now"; an unreadable
    /// stored clock is no step (and the next outcome commit writes it afresh).
    #[test]
    fn a_step_longer_than_the_wait_makes_it_due_now_and_an_unreadable_clock_is_none() {
        let (_dir, store, ids) = queued(1);
        let years_ahead = T + 5 * 365 * 86_400_000;
        store.record_outcomes(&[retry(ids[0], years_ahead + 30_000)], &[], years_ahead).unwrap();
        let done = store.move_due_times_back(T).unwrap().unwrap();
        assert_eq!(done.retries, 1);
        assert_eq!(due_of(&store, ids[0]), T + 30_000);

        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(META).unwrap().insert(META_DUE_CLOCK, [9u8, 1, 2].as_slice()).unwrap();
        wtx.commit().unwrap();
        assert_eq!(store.clock_stepped_back(0).unwrap(), None);
        assert_eq!(store.move_due_times_back(0).unwrap(), None);
    }
}
