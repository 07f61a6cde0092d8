//! Dead-letter replay and quarantine. A replay re-queues a dead letter under its **original**
//! idempotency key and body (so a receiver that already has it drops it by `webhook-id`), in
//! the same transaction that audits it; a key whose attempt log shows a `sent` attempt (on
//! any row its record names) is absorbed as a `duplicate`; a dead letter replayed more than `max_replays` times, or whose geometry no
//! longer validates, is moved to the delivery quarantine for a person. That person takes one
//! back out with a release (`zonewatch dlq release`, `POST /v1/deadletters/release`): it is a
//! dead letter again, its replay count starts over (audited `released`), and the next replay
//! decides afresh.

use super::runs::{append_audit, codec_err};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::*;
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};

/// What one replay did.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayOutcome {
    /// Back in the outbox as entry `outbox_id`; this is replay number `replay`.
    Requeued { outbox_id: u64, replay: u32 },
    /// The key's attempt log shows it delivered: nothing re-sent.
    Duplicate,
    /// Set aside for a person.
    Quarantined { reason: String },
    /// No dead letter with that id.
    NotFound,
}

/// What releasing one quarantined dead letter did.
#[derive(Debug, Clone, PartialEq)]
pub enum ReleaseOutcome {
    /// A dead letter again (same id, same key, same body); `was` is why it was quarantined.
    Released { was: String },
    /// No quarantined dead letter with that id.
    NotFound,
}

fn next_outbox_id(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    let mut meta = wtx.open_table(META)?;
    let next = meta.get(META_NEXT_OUTBOX_ID)?.map(|v| super::delivery::read_next_outbox_id(v.value())).transpose()?.unwrap_or(1);
    let after = next.checked_add(1).ok_or_else(|| super::runs::codec_err("meta", "the next outbox id is at its largest value".into()))?;
    meta.insert(META_NEXT_OUTBOX_ID, after.to_le_bytes().as_slice())?;
    Ok(next)
}

/// Whether `key`'s event was delivered: a `sent` attempt on a row its record names (its
/// current row and earlier ones, across replays and TTL cycles while the record carries
/// them), or under the key in the attempt log of stores written before the by-row log.
///
/// Every outcome the deliverer records comes with its attempt row, in the same transaction,
/// so this is the ledger's `sent` rows found by key, and costs one range read per named row.
/// It used to walk the whole audit ledger under the write lock, once per replayed dead letter.
/// A send of an earlier TTL cycle whose key was swept in between is no longer named and is
/// not recognised: the replay re-sends under the same `webhook-id`, as that cycle's own first
/// delivery did.
fn key_was_sent(index: &super::key_journal::KeyIndex, wtx: &WriteTransaction, key: &str) -> Result<bool, StoreError> {
    let rows: Vec<u64> = {
        let keys = super::key_journal::KeyTables::open(wtx, index)?;
        keys.find(key)?.map(|(_, rec)| rec.rows().collect()).unwrap_or_default()
    };
    let (legacy, log) = (wtx.open_table(DELIVERY_ATTEMPTS)?, wtx.open_table(DELIVERY_ATTEMPTS_BY_ROW)?);
    Ok(super::leases::named_attempts(&legacy, &log, key, rows)?.iter().any(|a| a.result == "sent"))
}

/// The outbox row other than `except` that `key`'s record names and that is still queued, if
/// any. A store written by key records of version 1 can hold a dead letter and a newer queued
/// row of one key; replaying the dead letter then would make two live rows of one event.
fn key_queued_elsewhere(index: &super::key_journal::KeyIndex, wtx: &WriteTransaction, key: &str, except: u64) -> Result<Option<u64>, StoreError> {
    let named = {
        let keys = super::key_journal::KeyTables::open(wtx, index)?;
        keys.find(key)?.and_then(|(_, rec)| rec.outbox_id)
    };
    let Some(row) = named.filter(|&row| row != except) else { return Ok(None) };
    let queued = wtx.open_table(OUTBOX)?.get(row)?.is_some() || wtx.open_table(OUTBOX_RETRY)?.get(row)?.is_some();
    Ok(queued.then_some(row))
}

/// Takes row `id` out of `table` (the dead letters or the delivery quarantine), decoded.
fn take_dead(wtx: &WriteTransaction, table: redb::TableDefinition<u64, &[u8]>, name: &'static str, id: u64) -> Result<Option<DeadLetter>, StoreError> {
    let mut t = wtx.open_table(table)?;
    let Some(v) = t.remove(id)? else { return Ok(None) };
    let dead = super::outbox_rows::decode_dead(v.value()).map_err(|m| codec_err(name, m))?;
    Ok(Some(dead))
}

/// Why a replay quarantines a dead letter queued before its subscriber was created: the
/// subscriber it was matched to was deleted, and this one, created again under its id over
/// the control port, may be another customer's (a fleet-wide replay sent such alerts to the
/// new target: an integrator re-using ids, bb25). `zonewatch dlq release` brings one back
/// where it is this subscriber's (a release counts as that confirmation).
pub const SUBSCRIBER_RECREATED: &str = "subscriber_recreated";

/// `Err(reason)` when dead letter `dl` belongs to a subscriber deleted before the one its id
/// names now was made: queued before the control-port subscriber of its id was created, or
/// marked `subscriber_deleted` (a delete over the control port, whatever its reason was before)
/// while the id is now a config subscriber's, which has no creation time (bb28). Its replay is asked only while a
/// subscriber of the id exists (`replay::waits_for_subscriber`).
fn recreated(wtx: &WriteTransaction, dl: &DeadLetter) -> Result<Result<(), String>, StoreError> {
    let e = &dl.entry;
    let stored = {
        let t = wtx.open_table(super::tables::SUBSCRIBERS)?;
        let found = t.get(e.watcher_id.as_str())?;
        // One that cannot be read is left to delivery to say so: its letters are replayed.
        found.map(|v| super::subscribers::decode_subscriber(v.value()).map(|s| s.created_ms))
    };
    Ok(match stored {
        Some(Ok(created)) if created > e.created_ms => Err(format!(
            "{SUBSCRIBER_RECREATED}: queued before the subscriber {:?} of now was created ({}): matched to a deleted one's area",
            e.watcher_id,
            crate::util::rfc3339(created)
        )),
        None if super::subscribers::deleted_reason(&dl.reason) => {
            Err(format!("{SUBSCRIBER_RECREATED}: its subscriber was deleted over the control port, and {:?} now names another: matched to the deleted one's area", e.watcher_id))
        }
        _ => Ok(()),
    })
}

impl Store {
    /// Replays dead letter `id` (see the module doc). `geometry` is the caller's re-validation
    /// of the payload geometry. One transaction.
    pub fn replay_dead_letter(
        &self,
        id: u64,
        now_ms: u64,
        max_replays: u32,
        geometry: Result<(), String>,
    ) -> Result<ReplayOutcome, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        // Every outcome below takes the row out of the dead letters.
        let Some(dl) = take_dead(&wtx, DEAD_LETTERS, "dead_letters", id)? else {
            wtx.abort()?;
            return Ok(ReplayOutcome::NotFound);
        };
        let e = &dl.entry;
        let mut audit = AuditRow::for_entry(e, Outcome::Duplicate, now_ms, String::new());
        let replays = wtx.open_table(DLQ_REPLAYS)?.get(e.key.0.as_str())?.map(|v| v.value()).unwrap_or(0);
        let outcome = if key_was_sent(&self.key_index, &wtx, &e.key.0)? {
            audit.detail = format!("replay of dead letter {id}: already delivered");
            ReplayOutcome::Duplicate
        } else if let Some(row) = key_queued_elsewhere(&self.key_index, &wtx, &e.key.0, id)? {
            // The event is still on its way under that row, which ends it.
            audit.detail = format!("replay of dead letter {id}: its key is still queued as outbox row {row}");
            ReplayOutcome::Duplicate
        } else if let Err(reason) = recreated(&wtx, &dl)?
            .and(geometry.map_err(|m| format!("invalid_geometry: {m}")))
            .and_then(|_| {
            if replays >= max_replays {
                Err(format!("replayed {replays} time{} (max_replays {max_replays})", if replays == 1 { "" } else { "s" }))
            } else {
                Ok(())
            }
        }) {
            let q = DeadLetter { entry: e.clone(), reason: reason.clone(), dead_at_ms: now_ms };
            wtx.open_table(DLQ_QUARANTINE)?.insert(id, super::outbox_rows::encode_dead(&q).as_slice())?;
            audit.outcome = Outcome::Quarantined;
            audit.detail = format!("dead letter {id}: {reason}");
            ReplayOutcome::Quarantined { reason }
        } else {
            let new_id = next_outbox_id(&wtx)?;
            let entry = OutboxEntry {
                id: new_id,
                attempts: 0,
                created_ms: now_ms,
                next_attempt_ms: now_ms,
                last_error: None,
                ..e.clone()
            };
            if wtx.open_table(OUTBOX)?.get(new_id)?.is_some() || wtx.open_table(OUTBOX_RETRY)?.insert(new_id, super::outbox_rows::encode_entry(&entry).as_slice())?.is_some() {
                return Err(super::delivery::id_in_use(new_id));
            }
            // Replays queue behind live alerts.
            wtx.open_table(OUTBOX_RETRY_DUE)?.insert((now_ms, new_id), ())?;
            wtx.open_table(DLQ_REPLAYS)?.insert(e.key.0.as_str(), replays + 1)?;
            super::idem::repoint(&self.key_index, &wtx, &e.key.0, new_id)?;
            audit.outcome = Outcome::Queued;
            audit.detail = format!("replay {} of dead letter {id}", replays + 1);
            ReplayOutcome::Requeued { outbox_id: new_id, replay: replays + 1 }
        };
        append_audit(&wtx, &mut audit)?;
        wtx.commit()?;
        Ok(outcome)
    }

    /// Takes quarantined dead letters `ids` back to the dead letters, for a person who has
    /// fixed what put them there (a receiver that was down past `max_replays` replays, say):
    /// same row id, key and body; each one's replay count starts again from 0; one
    /// `released` audit row each, saying why it had been quarantined. A replay then decides
    /// afresh: an event whose geometry does not validate is quarantined again, one whose key
    /// shows a `sent` attempt is absorbed as a duplicate. One transaction for all of them; an
    /// id that is also a live dead letter (a damaged or hand-edited store) fails it whole.
    pub fn release_quarantined(&self, ids: &[u64], now_ms: u64) -> Result<Vec<(u64, ReleaseOutcome)>, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut out: Vec<(u64, ReleaseOutcome)> = Vec::with_capacity(ids.len());
        let mut named = std::collections::HashSet::with_capacity(ids.len());
        for &id in ids {
            if !named.insert(id) {
                continue; // named twice: one outcome
            }
            let Some(q) = take_dead(&wtx, DLQ_QUARANTINE, "dlq_quarantine", id)? else {
                out.push((id, ReleaseOutcome::NotFound));
                continue;
            };
            let mut dead_letters = wtx.open_table(DEAD_LETTERS)?;
            if dead_letters.get(id)?.is_some() {
                return Err(StoreError::Conflict(format!("dead letter {id} is both quarantined and a dead letter; run `zonewatch check --store`")));
            }
            let was = q.reason;
            // Queued again as of now: a letter set aside as `subscriber_recreated` is then the
            // current subscriber's, as the operator's release says (its retry window starts
            // at its replay either way).
            let entry = OutboxEntry { created_ms: now_ms, ..q.entry };
            let dead = DeadLetter { entry, reason: format!("released from quarantine (was: {was})"), dead_at_ms: now_ms };
            dead_letters.insert(id, super::outbox_rows::encode_dead(&dead).as_slice())?;
            drop(dead_letters);
            wtx.open_table(DLQ_REPLAYS)?.remove(dead.entry.key.0.as_str())?;
            let detail = format!("dead letter {id} released from quarantine (was: {was}); replays start again from 0");
            append_audit(&wtx, &mut AuditRow::for_entry(&dead.entry, Outcome::Released, now_ms, detail))?;
            out.push((id, ReleaseOutcome::Released { was }));
        }
        if out.iter().any(|(_, o)| matches!(o, ReleaseOutcome::Released { .. })) {
            wtx.commit()?;
        } else {
            wtx.abort()?;
        }
        Ok(out)
    }

    /// Dead letters set aside for a person (replayed too often, invalid geometry).
    pub fn dlq_quarantine(&self) -> Result<Vec<DeadLetter>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(DLQ_QUARANTINE)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (_, v) = item?;
            out.push(super::outbox_rows::decode_dead(v.value()).map_err(|m| codec_err("dlq_quarantine", m))?);
        }
        Ok(out)
    }

    /// How many times the dead letter of `key` was replayed.
    pub fn replay_count(&self, key: &str) -> Result<u32, StoreError> {
        let rtx = self.db.begin_read()?;
        Ok(rtx.open_table(DLQ_REPLAYS)?.get(key)?.map(|v| v.value()).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_attempt as attempt, sample_event, IdemKey, Severity};
    use crate::store::{Claim, DeliveryResult};

    const HOUR: u64 = 3_600_000;

    /// A replayed dead letter whose key was delivered in an earlier TTL cycle (its record
    /// still names that cycle's row) is absorbed as a duplicate; one never delivered is queued
    /// again. Found through the key's rows in the attempt log, not a walk of the ledger.
    #[test]
    fn replay_absorbs_a_key_already_sent_and_requeues_one_never_sent() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let (events, claims) = super::super::delivery::sample_claims(&["A", "B"]);
        // Cycle 1: only A's claim, delivered.
        store.enqueue(&events, &claims[..1], "l1", 0, HOUR).unwrap();
        let a1 = store.outbox().unwrap()[0].id;
        store.record_outcomes(&[DeliveryResult::Sent { id: a1, status: 200 }], &[attempt("key-A", a1, "sent", 5)], 5).unwrap();
        // Past the TTL, before the sweep: A is claimed again (its record keeps row a1), B
        // for the first time; both end as dead letters.
        assert_eq!(store.enqueue(&events, &claims, "l2", 2 * HOUR, HOUR).unwrap().queued, 2);
        let rows: Vec<(String, u64)> = store.outbox().unwrap().into_iter().map(|e| (e.key.0, e.id)).collect();
        let dead: Vec<DeliveryResult> = rows.iter().map(|(_, id)| DeliveryResult::Dead { id: *id, reason: "rejected_400".into(), cause: crate::store::DeadCause::Endpoint }).collect();
        let logged: Vec<AttemptRecord> = rows.iter().map(|(k, id)| attempt(k, *id, "dead_letter", 2 * HOUR)).collect();
        store.record_outcomes(&dead, &logged, 2 * HOUR).unwrap();
        assert_eq!(store.dead_letters().unwrap().len(), 2);
        let row_of = |k: &str| rows.iter().find(|(key, _)| key == k).unwrap().1;
        assert_eq!(store.replay_dead_letter(row_of("key-A"), 3 * HOUR, 3, Ok(())).unwrap(), ReplayOutcome::Duplicate);
        assert!(matches!(store.replay_dead_letter(row_of("key-B"), 3 * HOUR, 3, Ok(())).unwrap(), ReplayOutcome::Requeued { replay: 1, .. }));
        assert!(store.dead_letters().unwrap().is_empty());
        assert_eq!(store.outbox().unwrap().len(), 1, "only B is queued again");
    }

    /// Dead letters are read a page at a time in id order, each page after the last id of
    /// the one before, and a replay chooses from small picks: of the window, of named ids
    /// only (an id named twice once, one that is no dead letter not at all), oldest
    /// observation first.
    #[test]
    fn dead_letters_come_in_pages_and_replays_choose_from_picks() {
        use crate::store::DeadLetterList::{Quarantined, Waiting};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let names: Vec<String> = (0..5).map(|i| format!("P{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let (mut events, claims) = super::super::delivery::sample_claims(&names);
        // Observed in the reverse of their queue order.
        for (i, e) in events.iter_mut().enumerate() {
            e.observed_at_ms = 1_000 - i as u64;
        }
        store.enqueue(&events, &claims, "l1", 0, HOUR).unwrap();
        let rows: Vec<(String, u64)> = store.outbox().unwrap().into_iter().map(|e| (e.key.0, e.id)).collect();
        for (n, (k, id)) in rows.iter().enumerate() {
            let refused = DeliveryResult::Dead { id: *id, reason: "rejected_400".into(), cause: crate::store::DeadCause::Endpoint };
            store.record_outcomes(&[refused], &[attempt(k, *id, "dead_letter", 10 + n as u64)], 10 + n as u64).unwrap();
        }
        let mut ids: Vec<u64> = rows.iter().map(|r| r.1).collect();
        ids.sort();
        let page = |after: Option<u64>, limit: usize| -> Vec<u64> { store.dead_letters_page(Waiting, after, limit).unwrap().iter().map(|d| d.entry.id).collect() };
        assert_eq!(page(None, 2), ids[..2]);
        assert_eq!(page(Some(ids[1]), 2), ids[2..4]);
        assert_eq!(page(Some(ids[3]), 2), ids[4..]);
        assert!(page(Some(ids[4]), 2).is_empty());
        assert!(page(Some(u64::MAX), 2).is_empty());
        assert!(store.dead_letters_page(Quarantined, None, 10).unwrap().is_empty());

        let picks = store.replay_picks(None, 0, u64::MAX).unwrap();
        let observed: Vec<u64> = picks.iter().map(|p| p.observed_ms).collect();
        assert!(observed.windows(2).all(|w| w[0] <= w[1]) && picks.len() == 5, "oldest observation first: {picks:?}");
        let by_key: std::collections::HashMap<u64, u64> = store.dead_letters().unwrap().iter().map(|d| (d.entry.id, d.dead_at_ms)).collect();
        let window = store.replay_picks(None, 11, 12).unwrap();
        assert!(window.len() == 2 && window.iter().all(|p| (11..=12).contains(&by_key[&p.id])), "{window:?}");
        let named = store.replay_picks(Some(&[ids[0], ids[0], 424242]), 0, u64::MAX).unwrap();
        assert_eq!(named.iter().map(|p| p.id).collect::<Vec<_>>(), vec![ids[0]]);
        assert!(store.replay_picks(Some(&[]), 0, u64::MAX).unwrap().is_empty());
        assert_eq!(store.dead_letter(ids[0]).unwrap().map(|d| d.entry.id), Some(ids[0]));
        assert!(store.dead_letter(424242).unwrap().is_none());
    }

    /// A key's replay count goes when the key expires (the table grew by a row per replayed
    /// key for good, and a claim of the key in a later TTL cycle started from the old count);
    /// a sweep batch that took all it could says there may be more, though it removed nothing
    /// (keys re-armed because their event is still pending).
    #[test]
    fn an_expired_key_takes_its_replay_count_and_a_full_batch_says_more() {
        let dir = tempfile::tempdir().unwrap();
        let (store, row) = one_queued(dir.path());
        dead(&store, row, 1);
        let ReplayOutcome::Requeued { outbox_id, .. } = store.replay_dead_letter(row, 2, 3, Ok(())).unwrap() else { panic!("not requeued") };
        assert_eq!(store.replay_count("key-A").unwrap(), 1);
        store.record_outcomes(&[DeliveryResult::Sent { id: outbox_id, status: 200 }], &[attempt("key-A", outbox_id, "sent", 3)], 3).unwrap();
        let swept = store.sweep_expired_keys_batch(10 * HOUR, 10).unwrap();
        assert_eq!((swept.removed, swept.more), (1, false));
        assert_eq!(store.replay_count("key-A").unwrap(), 0, "gone with its key");
        // Two keys still queued, past their TTL: a batch of one takes one and re-arms it.
        let (events, claims) = super::super::delivery::sample_claims(&["B", "C"]);
        store.enqueue(&events, &claims, "l2", 11 * HOUR, HOUR).unwrap();
        let swept = store.sweep_expired_keys_batch(20 * HOUR, 1).unwrap();
        assert_eq!((swept.removed, swept.more), (0, true), "re-armed, and another may be due");
        assert!(store.check_consistency().unwrap().problems.is_empty());
    }

    /// A dead letter replayed past `max_replays` is quarantined; released, it is a dead
    /// letter again under the same id and key, its replay count starts over, the release is
    /// audited, and the next replay queues it. The store stays consistent throughout.
    /// A store with one event (key `key-A`) queued; returns its outbox row.
    fn one_queued(dir: &std::path::Path) -> (Store, u64) {
        let store = Store::open(&dir.join("z.redb")).unwrap();
        let claim = Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey("key-A".into()) };
        store.enqueue(&[sample_event("A")], &[claim], "l1", 0, HOUR).unwrap();
        let row = store.outbox().unwrap()[0].id;
        (store, row)
    }

    /// Outbox row `id` of `key-A` refused (400) at `at`: a dead letter.
    fn dead(store: &Store, id: u64, at: u64) {
        let refused = DeliveryResult::Dead { id, reason: "rejected_400".into(), cause: crate::store::DeadCause::Endpoint };
        store.record_outcomes(&[refused], &[attempt("key-A", id, "dead_letter", at)], at).unwrap();
    }

    #[test]
    fn a_released_dead_letter_can_be_replayed_again() {
        let dir = tempfile::tempdir().unwrap();
        let (store, row) = one_queued(dir.path());
        dead(&store, row, 1);
        // One replay allowed: the first queues it (and it dies again), the second quarantines.
        let ReplayOutcome::Requeued { outbox_id, replay: 1 } = store.replay_dead_letter(row, 2, 1, Ok(())).unwrap() else { panic!("not requeued") };
        dead(&store, outbox_id, 3);
        assert!(matches!(store.replay_dead_letter(outbox_id, 4, 1, Ok(())).unwrap(), ReplayOutcome::Quarantined { .. }));
        let released = store.release_quarantined(&[row, outbox_id, outbox_id], 5).unwrap();
        assert_eq!(released.len(), 2, "an id named twice has one outcome: {released:?}");
        assert_eq!(released[0], (row, ReleaseOutcome::NotFound), "the first row is not the quarantined one");
        let (_, ReleaseOutcome::Released { was }) = &released[1] else { panic!("not released: {released:?}") };
        assert!(was.contains("max_replays 1"), "{was}");
        assert!(store.dlq_quarantine().unwrap().is_empty());
        let back = store.dead_letters().unwrap();
        assert_eq!((back.len(), back[0].entry.id, back[0].entry.key.0.as_str(), back[0].dead_at_ms), (1, outbox_id, "key-A", 5));
        assert_eq!(store.replay_count("key-A").unwrap(), 0);
        let last = store.audit(&Default::default()).unwrap().pop().unwrap();
        assert_eq!(last.outcome, Outcome::Released);
        assert!(last.detail.contains("released from quarantine") && last.detail.contains(&outbox_id.to_string()), "{}", last.detail);
        assert!(store.check_consistency().unwrap().problems.is_empty(), "{:?}", store.check_consistency().unwrap().problems);
        assert_eq!(store.release_quarantined(&[outbox_id], 6).unwrap(), vec![(outbox_id, ReleaseOutcome::NotFound)], "released once");
        assert!(matches!(store.replay_dead_letter(outbox_id, 7, 1, Ok(())).unwrap(), ReplayOutcome::Requeued { replay: 1, .. }));
        assert!(store.check_consistency().unwrap().problems.is_empty());
    }

    /// A dead letter whose key's record names another row still queued (a store whose key
    /// records were written at version 1 can hold both) is absorbed as a duplicate when
    /// replayed: requeueing it would make two live rows, and two sends, of one event.
    #[test]
    fn replay_of_a_dead_letter_whose_key_is_still_queued_is_a_duplicate() {
        let dir = tempfile::tempdir().unwrap();
        let (store, queued) = one_queued(dir.path());
        let older = queued + 100;
        let mut entry = store.outbox().unwrap().remove(0);
        entry.id = older;
        let letter = DeadLetter { entry, reason: "retries_exhausted".into(), dead_at_ms: 1 };
        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(DEAD_LETTERS).unwrap().insert(older, super::super::outbox_rows::encode_dead(&letter).as_slice()).unwrap();
        wtx.commit().unwrap();
        assert_eq!(store.replay_dead_letter(older, 2, 3, Ok(())).unwrap(), ReplayOutcome::Duplicate);
        let outbox: Vec<u64> = store.outbox().unwrap().into_iter().map(|e| e.id).collect();
        assert_eq!(outbox, vec![queued], "no second live row");
        assert!(store.dead_letters().unwrap().is_empty());
        let last = store.audit(&Default::default()).unwrap().pop().unwrap();
        assert_eq!(last.outcome, Outcome::Duplicate);
        assert!(last.detail.contains(&format!("still queued as outbox row {queued}")), "{}", last.detail);
    }

    /// A row that is both quarantined and a live dead letter (only a damaged or hand-edited
    /// store has one) is not overwritten by a release: the release fails whole, naming it.
    #[test]
    fn a_release_never_overwrites_a_live_dead_letter() {
        let dir = tempfile::tempdir().unwrap();
        let (store, row) = one_queued(dir.path());
        dead(&store, row, 1);
        assert!(matches!(store.replay_dead_letter(row, 2, 0, Ok(())).unwrap(), ReplayOutcome::Quarantined { .. }));
        let quarantined = store.dlq_quarantine().unwrap().remove(0);
        let wtx = store.db.begin_write().unwrap();
        wtx.open_table(DEAD_LETTERS).unwrap().insert(row, super::super::outbox_rows::encode_dead(&quarantined).as_slice()).unwrap();
        wtx.commit().unwrap();
        let err = store.release_quarantined(&[row], 3).unwrap_err();
        assert!(err.to_string().contains(&format!("dead letter {row} is both quarantined and a dead letter")), "{err}");
        assert_eq!((store.dlq_quarantine().unwrap().len(), store.dead_letters().unwrap().len()), (1, 1), "nothing changed");
    }
}
