//! The outbox as two queues: rows never tried (`outbox`, in claim order) and rows waiting for
//! a retry (`outbox_retry`, found by due time through `outbox_retry_due`).
//!
//! Why it exists (issue 7): a fresh row is due the moment it is claimed, and outbox ids are
//! handed out in claim order, so the fresh table read in id order *is* the fresh queue. Until
//! schema 5 every fresh row also had an entry `(due at, id)` in a separate `outbox_due`
//! index: one more B-tree insert per claimed event and one more delete per delivered one,
//! for an order the ids already gave. A row moves to `outbox_retry` (and gets its due entry)
//! when its first try fails; a replayed dead letter is queued there directly, behind live
//! alerts. Every row is in exactly one of the two tables.

use super::outbox_rows::{decode_entry, encode_entry};
use super::runs::codec_err;
use super::tables::*;
use super::StoreError;
use crate::model::OutboxEntry;
use redb::{ReadableTable, ReadableTableMetadata, Table, TableHandle, WriteTransaction};

/// Which queue a row is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Queue {
    Fresh,
    Retry,
}

/// The outbox tables of one write transaction, opened once for a batch of outcomes.
pub(super) struct OutboxTables<'t> {
    fresh: Table<'t, u64, &'static [u8]>,
    retry: Table<'t, u64, &'static [u8]>,
    retry_due: Table<'t, (u64, u64), ()>,
}

impl<'t> OutboxTables<'t> {
    pub(super) fn open(wtx: &'t WriteTransaction) -> Result<Self, StoreError> {
        Ok(OutboxTables { fresh: wtx.open_table(OUTBOX)?, retry: wtx.open_table(OUTBOX_RETRY)?, retry_due: wtx.open_table(OUTBOX_RETRY_DUE)? })
    }

    /// Row `id` and the queue it is in (`None`: resolved already).
    pub(super) fn get(&self, id: u64) -> Result<Option<(Queue, OutboxEntry)>, StoreError> {
        if let Some(v) = self.fresh.get(id)? {
            return Ok(Some((Queue::Fresh, decode_entry(v.value()).map_err(|m| codec_err("outbox", m))?)));
        }
        if let Some(v) = self.retry.get(id)? {
            return Ok(Some((Queue::Retry, decode_entry(v.value()).map_err(|m| codec_err("outbox_retry", m))?)));
        }
        Ok(None)
    }

    /// Removes a resolved row (sent, dead-lettered) from its queue.
    pub(super) fn remove(&mut self, queue: Queue, entry: &OutboxEntry) -> Result<(), StoreError> {
        match queue {
            Queue::Fresh => {
                self.fresh.remove(entry.id)?;
            }
            Queue::Retry => {
                self.retry.remove(entry.id)?;
                self.retry_due.remove((entry.next_attempt_ms, entry.id))?;
            }
        }
        Ok(())
    }

    /// Puts `updated` (a row that was `was` in `queue`) in the retry queue, due at its
    /// `next_attempt_ms`.
    pub(super) fn move_to_retry(&mut self, queue: Queue, was: &OutboxEntry, updated: &OutboxEntry) -> Result<(), StoreError> {
        self.remove(queue, was)?;
        self.retry.insert(updated.id, encode_entry(updated).as_slice())?;
        self.retry_due.insert((updated.next_attempt_ms, updated.id), ())?;
        Ok(())
    }
}

/// Rows in both queues.
pub(super) fn len<T: ReadableTableMetadata>(fresh: &T, retry: &T) -> Result<u64, StoreError> {
    Ok(fresh.len()? + retry.len()?)
}

/// Once per store of schema 4 or older: rows indexed as retries (and, defensively, any row
/// that was already tried but indexed as fresh) move to `outbox_retry`; the `outbox_due`
/// index is dropped. Reads `outbox_due` (one decode per row it names, row by row) and
/// `outbox_retry_due` (its ids collected first). Returns how many rows moved.
pub(super) fn migrate_due_index(wtx: &WriteTransaction) -> Result<usize, StoreError> {
    if !wtx.list_tables()?.any(|t| t.name() == OUTBOX_DUE.name()) {
        return Ok(0);
    }
    let mut moved = 0;
    {
        let mut fresh = wtx.open_table(OUTBOX)?;
        let mut retry = wtx.open_table(OUTBOX_RETRY)?;
        let mut retry_due = wtx.open_table(OUTBOX_RETRY_DUE)?;
        // Retries: their due entries stay; the rows move.
        let ids: Vec<u64> = retry_due.iter()?.map(|item| item.map(|(k, _)| k.value().1)).collect::<Result<_, _>>()?;
        for id in ids {
            let Some(bytes) = fresh.remove(id)?.map(|v| v.value().to_vec()) else { continue };
            retry.insert(id, bytes.as_slice())?;
            moved += 1;
        }
        // Tried rows indexed as fresh (never written so; moved rather than re-sent as new).
        let old = wtx.open_table(OUTBOX_DUE)?;
        for item in old.iter()? {
            let (k, _) = item?;
            let (_, id) = k.value();
            let Some(bytes) = fresh.get(id)?.map(|v| v.value().to_vec()) else { continue };
            let entry = decode_entry(&bytes).map_err(|m| codec_err("outbox", m))?;
            if entry.attempts > 0 {
                fresh.remove(id)?;
                retry.insert(id, bytes.as_slice())?;
                retry_due.insert((entry.next_attempt_ms, id), ())?;
                moved += 1;
            }
        }
    }
    wtx.delete_table(OUTBOX_DUE)?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::store::{Claim, DeliveryResult, Store, SCHEMA_VERSION};
    use redb::ReadableDatabase;

    /// A damaged next-outbox-id counter is an error, never ids handed out again: read
    /// leniently (zero-padded), a shortened counter gave the next claims the ids of rows still
    /// queued, and their inserts replaced those rows (their events lost). A counter pointing
    /// back at a queued row is refused too, and the claim's transaction writes nothing.
    #[test]
    fn a_damaged_outbox_id_counter_fails_the_claim_and_loses_no_row() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let claim = |i: usize| Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) };
        store.enqueue(&[sample_event("A")], &[claim(0), claim(1)], "l", 0, 3_600_000).unwrap();
        let before: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        let set_counter = |bytes: &[u8]| {
            let wtx = store.db.begin_write().unwrap();
            wtx.open_table(META).unwrap().insert(META_NEXT_OUTBOX_ID, bytes).unwrap();
            wtx.commit().unwrap();
        };
        assert!(store.check_consistency().unwrap().is_consistent());
        set_counter(&[1, 0, 0]);
        let err = store.enqueue(&[sample_event("B")], &[claim(2)], "l", 0, 3_600_000).unwrap_err().to_string();
        assert!(err.contains("3 bytes, not 8"), "{err}");
        let report = store.check_consistency().unwrap();
        assert!(report.problems.iter().any(|p| p.contains("counter is damaged")), "{:?}", report.problems);
        set_counter(&before[0].to_le_bytes());
        let err = store.enqueue(&[sample_event("B")], &[claim(2)], "l", 0, 3_600_000).unwrap_err().to_string();
        assert!(err.contains("already holds a queued row"), "{err}");
        let report = store.check_consistency().unwrap();
        assert!(report.problems.iter().any(|p| p.contains("is not above outbox id")), "{:?}", report.problems);
        assert_eq!(store.outbox().unwrap().iter().map(|e| e.id).collect::<Vec<_>>(), before, "no row replaced");
        assert!(store.audit(&Default::default()).unwrap().len() == 2, "the failed claims wrote nothing");
    }

    /// A schema 4 store (every row in `outbox`, fresh ones indexed in `outbox_due`) opens as
    /// schema 5: retries (and a tried row indexed as fresh) move to `outbox_retry` with their
    /// due entries, fresh rows stay and are leased first, `outbox_due` is gone, and the store
    /// checks clean.
    #[test]
    fn a_schema_4_outbox_is_split_into_its_two_queues_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let events: Vec<_> = ["A", "B", "C"].iter().map(|p| sample_event(p)).collect();
        let claims: Vec<Claim> = (0..3)
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        let ids: Vec<u64>;
        {
            let store = Store::open(&path).unwrap();
            store.enqueue(&events, &claims, "l", 0, 3_600_000).unwrap();
            ids = store.outbox().unwrap().iter().map(|e| e.id).collect();
            store.record_outcomes(&[DeliveryResult::Retry { id: ids[1], next_attempt_ms: 500, error: "http_503".into() }], &[], 10).unwrap();
            // Rewrite as schema 4 laid it out.
            let wtx = store.db.begin_write().unwrap();
            {
                let mut fresh = wtx.open_table(OUTBOX).unwrap();
                let mut retry = wtx.open_table(OUTBOX_RETRY).unwrap();
                let mut old_due = wtx.open_table(OUTBOX_DUE).unwrap();
                let moved = retry.remove(ids[1]).unwrap().unwrap().value().to_vec();
                fresh.insert(ids[1], moved.as_slice()).unwrap();
                old_due.insert((0, ids[0]), ()).unwrap();
                // A tried row indexed as fresh (defensive case).
                let mut tried = decode_entry(fresh.get(ids[2]).unwrap().unwrap().value()).unwrap();
                tried.attempts = 1;
                tried.next_attempt_ms = 700;
                fresh.insert(ids[2], encode_entry(&tried).as_slice()).unwrap();
                old_due.insert((700, ids[2]), ()).unwrap();
                let mut meta = wtx.open_table(META).unwrap();
                meta.insert(META_SCHEMA, 4u32.to_le_bytes().as_slice()).unwrap();
            }
            wtx.delete_table(OUTBOX_RETRY).unwrap();
            wtx.commit().unwrap();
        }
        // Checked as it is (a backup of an older build): its own layout is consistent.
        let report = crate::store::check::check_file(&path).unwrap();
        assert!(report.is_consistent(), "{:?}", report.problems);
        assert_eq!(report.outbox_rows, 3);
        let store = Store::open(&path).unwrap();
        {
            let rtx = store.db.begin_read().unwrap();
            assert!(!rtx.list_tables().unwrap().any(|t| t.name() == OUTBOX_DUE.name()), "outbox_due is dropped");
            let fresh: Vec<u64> = rtx.open_table(OUTBOX).unwrap().iter().unwrap().map(|i| i.unwrap().0.value()).collect();
            let retry: Vec<u64> = rtx.open_table(OUTBOX_RETRY).unwrap().iter().unwrap().map(|i| i.unwrap().0.value()).collect();
            let due: Vec<(u64, u64)> = rtx.open_table(OUTBOX_RETRY_DUE).unwrap().iter().unwrap().map(|i| i.unwrap().0.value()).collect();
            assert_eq!((fresh, retry, due), (vec![ids[0]], vec![ids[1], ids[2]], vec![(500, ids[1]), (700, ids[2])]));
            let v = rtx.open_table(META).unwrap().get(META_SCHEMA).unwrap().unwrap().value().to_vec();
            assert_eq!(v, SCHEMA_VERSION.to_le_bytes());
        }
        let report = store.check_consistency().unwrap();
        assert!(report.is_consistent(), "{:?}", report.problems);
        assert_eq!(store.outbox_len().unwrap(), 3);
        let batch = store.lease_due(1_000, 60_000, 1, 0).unwrap();
        assert_eq!((batch.fresh, batch.entries.iter().map(|e| e.id).collect::<Vec<_>>()), (1, vec![ids[0]]), "the fresh row first");
        let batch = store.lease_due(1_000, 60_000, 10, 0).unwrap();
        assert_eq!(batch.entries.iter().map(|e| e.id).collect::<Vec<_>>(), vec![ids[1], ids[2]], "then the retries by due time");
    }
}
