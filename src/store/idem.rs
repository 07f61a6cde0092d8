//! Idempotency key records: what a claimed key remembers, how it is stored, and how the TTL
//! sweep tells a key whose event is still pending from one that is done.
//!
//! Record version 2 (this build) names the outbox row the key was claimed for, and a
//! delivery outcome no longer rewrites the key: keys are hashes, so each rewrite dirtied a
//! random page of the largest table in every outcome commit (issue 7). Instead the sweep asks
//! the tables themselves: a key whose row is still in the outbox, the dead letters or the
//! delivery quarantine is pending. Version 1 records (no row id; state rewritten to `Sent` /
//! `DeadLetter` by outcomes) are still read, and [`migrate_pending`] gives the pending ones
//! their row id once, when a store written before version 2 is first opened.

use super::codec::{decode_migrating, encode_versioned};
use super::key_journal::{KeyIndex, KeyTables};
use super::runs::codec_err;
use super::tables::*;
use super::StoreError;
use redb::{ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};

/// Version byte of key records written now.
pub const IDEM_RECORD_VERSION: u8 = 2;
/// META flag: pending version 1 key records have been given their outbox row id.
const META_IDEM_V2: &str = "idem_records_v2";

/// Where a claimed key's event stands: whether it is still to be delivered (a new claim on
/// it is a duplicate even past its TTL) or was only primed (baseline, reprocess, a primed hold).
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Debug)]
pub(super) enum IdemState {
    /// Claimed for delivery: pending while its outbox row (or dead letter) exists.
    Queued,
    /// Written by version 1 only: the outcome recorded `sent`.
    Sent,
    /// Claimed without delivery (baseline priming): never pending.
    Suppressed,
    /// Written by version 1 only: the outcome dead-lettered the event.
    DeadLetter,
}

/// What a claimed idempotency key remembers.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(super) struct IdemRecord {
    pub(super) claimed_ms: u64,
    pub(super) expires_ms: u64,
    pub(super) lineage_id: String,
    pub(super) state: IdemState,
    /// The outbox row queued for this key (a dead-letter replay moves it to the new row).
    /// `None` for primed keys and for version 1 records.
    pub(super) outbox_id: Option<u64>,
    /// The TTL the key was claimed with: a sweep that finds its event still pending re-arms
    /// it for this long again.
    pub(super) ttl_ms: u64,
    /// Outbox rows the key had before `outbox_id` (dead letters since replayed), oldest
    /// first: their attempt log rows are the key's too.
    pub(super) earlier_rows: Vec<u64>,
}

impl IdemRecord {
    /// Every outbox row this key was queued as, oldest first.
    pub(super) fn rows(&self) -> impl Iterator<Item = u64> + '_ {
        self.earlier_rows.iter().copied().chain(self.outbox_id)
    }
}

/// `IdemRecord` as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct IdemRecordV1 {
    claimed_ms: u64,
    expires_ms: u64,
    lineage_id: String,
    state: IdemState,
}

pub(super) fn encode_idem(rec: &IdemRecord) -> Vec<u8> {
    encode_versioned(IDEM_RECORD_VERSION, rec)
}

pub(super) fn decode_idem(bytes: &[u8]) -> Result<IdemRecord, String> {
    decode_migrating::<IdemRecordV1, _>(bytes, IDEM_RECORD_VERSION, "idempotency keys")
}

impl From<IdemRecordV1> for IdemRecord {
    fn from(v: IdemRecordV1) -> Self {
        IdemRecord {
            claimed_ms: v.claimed_ms,
            expires_ms: v.expires_ms,
            lineage_id: v.lineage_id,
            state: v.state,
            outbox_id: None,
            ttl_ms: v.expires_ms.saturating_sub(v.claimed_ms),
            earlier_rows: Vec::new(),
        }
    }
}

/// Whether the event `rec` was claimed for may still be sent: its row is in one of the tables
/// `holding` — queued (`outbox`, `outbox_retry`), dead-lettered (`dead_letters`: replayable)
/// or in the delivery quarantine (`dlq_quarantine`: a person may replay it). The tables are
/// passed in because callers already hold them open.
pub(super) fn is_pending<T: ReadableTable<u64, &'static [u8]>>(rec: &IdemRecord, holding: &[&T]) -> Result<bool, StoreError> {
    match (rec.state, rec.outbox_id) {
        (IdemState::Suppressed | IdemState::Sent, _) => Ok(false),
        (IdemState::Queued | IdemState::DeadLetter, Some(id)) => {
            for table in holding {
                if table.get(id)?.is_some() {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        // A version 1 record that was not migrated (its row was already gone): its state is
        // all there is, read as version 1 meant it.
        (IdemState::Queued | IdemState::DeadLetter, None) => Ok(true),
    }
}

/// Points `key`'s record at outbox row `outbox_id` (a dead-letter replay requeued it).
pub(super) fn repoint(index: &KeyIndex, wtx: &WriteTransaction, key: &str, outbox_id: u64) -> Result<(), StoreError> {
    let mut keys = KeyTables::open(wtx, index)?;
    if let Some((place, mut rec)) = keys.find(key)? {
        rec.state = IdemState::Queued;
        if let Some(previous) = rec.outbox_id.replace(outbox_id) {
            rec.earlier_rows.push(previous);
            // Bounded as a claim bounds it: released and replayed again and again, a key
            // would otherwise name ever more rows (each one a read in `key_was_sent`).
            let keep_from = rec.earlier_rows.len().saturating_sub(super::delivery::MAX_EARLIER_ROWS);
            rec.earlier_rows.drain(..keep_from);
        }
        keys.update(place, key, &rec)?;
    }
    Ok(())
}

/// Once per store: gives every version 1 key record (all in `idem_keys`: version 1 files
/// have no key journal) whose event is still pending (its row in
/// the outbox, the dead letters or the delivery quarantine) that row's id, so outcomes need
/// not rewrite keys any more. Costs one pass over the pending rows, not over the keys.
/// Returns how many records were rewritten.
pub(super) fn migrate_pending(wtx: &WriteTransaction) -> Result<usize, StoreError> {
    let mut meta = wtx.open_table(META)?;
    if meta.get(META_IDEM_V2)?.is_some() {
        return Ok(0);
    }
    let mut pending: Vec<(String, u64)> = Vec::new();
    for table in [OUTBOX, OUTBOX_RETRY] {
        for item in wtx.open_table(table)?.iter()? {
            let (k, v) = item?;
            let e = super::outbox_rows::decode_entry(v.value()).map_err(|m| codec_err("outbox", m))?;
            pending.push((e.key.0, k.value()));
        }
    }
    for table in [DEAD_LETTERS, DLQ_QUARANTINE] {
        for item in wtx.open_table(table)?.iter()? {
            let (k, v) = item?;
            let d = super::outbox_rows::decode_dead(v.value()).map_err(|m| codec_err("dead_letters", m))?;
            pending.push((d.entry.key.0, k.value()));
        }
    }
    // The newest row of a key wins (a replay's row has a higher id than its dead letter's).
    pending.sort();
    let mut keys = wtx.open_table(IDEM_KEYS)?;
    let mut n = 0;
    for (i, (key, id)) in pending.iter().enumerate() {
        if pending.get(i + 1).is_some_and(|(next, _)| next == key) {
            continue;
        }
        let current = match keys.get(key.as_str())? {
            Some(v) => Some(decode_idem(v.value()).map_err(|m| codec_err("idem_keys", m))?),
            None => None,
        };
        if let Some(mut rec) = current.filter(|r| r.outbox_id.is_none() && r.state != IdemState::Suppressed) {
            // Its row is pending, whatever version 1 last wrote (`Sent` only where an expired
            // key was claimed again while its dead letter existed).
            rec.state = IdemState::Queued;
            rec.outbox_id = Some(*id);
            keys.insert(key.as_str(), encode_idem(&rec).as_slice())?;
            n += 1;
        }
    }
    meta.insert(META_IDEM_V2, [1u8].as_slice())?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::store::{Claim, DeliveryResult, Store};
    use redb::ReadableDatabase;

    const HOUR: u64 = 3_600_000;

    /// A store written before record version 2 (keys without their row, rewritten by each
    /// outcome) keeps its exactly-once guarantees after the upgrade: opening it gives the
    /// pending keys their row once, and from then on the sweep asks the rows.
    #[test]
    fn version_1_keys_of_pending_events_are_migrated_once_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let events = vec![sample_event("A"), sample_event("B")];
        let claims: Vec<Claim> = events
            .iter()
            .enumerate()
            .map(|(i, e)| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("key-{}", e.parcel_id)) })
            .collect();
        {
            let store = Store::open(&path).unwrap();
            assert_eq!(store.enqueue(&events, &claims, "l", 0, HOUR).unwrap().queued, 2);
            // Version 1 files have no key journal: the keys go to `idem_keys` first.
            store.merge_key_journal().unwrap();
            // Rewrite both keys as version 1 wrote them and forget the migration.
            let wtx = store.db.begin_write().unwrap();
            {
                let mut keys = wtx.open_table(IDEM_KEYS).unwrap();
                for c in &claims {
                    let v1 = IdemRecordV1 { claimed_ms: 0, expires_ms: HOUR, lineage_id: "l".into(), state: IdemState::Queued };
                    keys.insert(c.key.0.as_str(), super::super::codec::encode(&v1).as_slice()).unwrap();
                }
                let mut meta = wtx.open_table(META).unwrap();
                meta.remove(META_IDEM_V2).unwrap();
                meta.insert(META_SCHEMA, 1u32.to_le_bytes().as_slice()).unwrap();
            }
            wtx.commit().unwrap();
        }
        let store = Store::open(&path).unwrap();
        {
            let rtx = store.db.begin_read().unwrap();
            let meta = rtx.open_table(META).unwrap();
            let v = meta.get(META_SCHEMA).unwrap().unwrap().value().to_vec();
            assert_eq!(v, super::super::SCHEMA_VERSION.to_le_bytes(), "the file is upgraded with its keys");
        }
        let rows: Vec<(String, u64)> = store.outbox().unwrap().into_iter().map(|e| (e.key.0, e.id)).collect();
        {
            let rtx = store.db.begin_read().unwrap();
            let keys = rtx.open_table(IDEM_KEYS).unwrap();
            for (key, id) in &rows {
                let rec = decode_idem(keys.get(key.as_str()).unwrap().unwrap().value()).unwrap();
                assert_eq!(rec.outbox_id, Some(*id), "{key} names its row after the upgrade");
            }
        }
        // A is delivered; past the TTL its key goes and B's (still queued) stays.
        let a = rows.iter().find(|(k, _)| k == "key-A").unwrap().1;
        let attempt = crate::model::sample_attempt("key-A", a, "sent", 10);
        store.record_outcomes(&[DeliveryResult::Sent { id: a, status: 200 }], std::slice::from_ref(&attempt), 10).unwrap();
        assert_eq!(store.sweep_expired_keys(2 * HOUR, 100).unwrap(), 1);
        // Swept, the key's attempts are still found (by a scan of the log)...
        assert_eq!(store.attempts("key-A").unwrap().len(), 1);
        let again = store.enqueue(&events, &claims, "l2", 2 * HOUR, HOUR).unwrap();
        assert_eq!((again.queued, again.duplicates), (1, 1));
        // A key claimed again after its TTL but before the sweep carries its rows over, so
        // the earlier cycle's attempts stay reachable through the new record.
        let b_row = rows.iter().find(|(k, _)| k == "key-B").unwrap().1;
        let attempt_b = crate::model::AttemptRecord { key: "key-B".into(), outbox_id: b_row, ..attempt.clone() };
        store.record_outcomes(&[DeliveryResult::Sent { id: b_row, status: 200 }], &[attempt_b], 3 * HOUR).unwrap();
        let third = store.enqueue(&events[1..], &claims[..1].iter().map(|c| Claim { key: IdemKey("key-B".into()), ..c.clone() }).collect::<Vec<_>>(), "l3", 9 * HOUR, HOUR).unwrap();
        assert_eq!(third.queued, 1, "key-B is past its (re-armed) TTL and its event was sent");
        let seen: Vec<u64> = store.attempts("key-B").unwrap().iter().map(|r| r.outbox_id).collect();
        assert_eq!(seen, [b_row]);
        // The migration ran once: a second open does not redo it.
        drop(store);
        let store = Store::open(&path).unwrap();
        let wtx = store.db.begin_write().unwrap();
        assert_eq!(migrate_pending(&wtx).unwrap(), 0);
    }
}
