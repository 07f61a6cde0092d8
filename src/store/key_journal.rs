//! The idempotency key journal: where a newly claimed key is written first, and how a key is
//! found again wherever it lives.
//!
//! Why it exists (issue 7): keys are hashes, so inserting each new claim straight into
//! `idem_keys` dirtied a random page of that tree per claim. A commit of 1,000 claims rewrote
//! ~860 pages (3.8 KB written to disk per event), and the key inserts were the largest single
//! cost of the claim + outbox + audit commit. New keys are appended to `idem_key_journal`
//! instead, under a sequence number, so one commit's claims fill pages at the right edge of
//! that tree; an in-memory index (64-bit fingerprint of the key → journal sequence number)
//! finds them again. Once the journal holds [`MERGE_ROWS`] rows, one transaction moves them into
//! `idem_keys` in key order, sweeping that tree once instead of once per commit.
//!
//! Invariants:
//! * a key's record is in exactly one place: the journal or `idem_keys`. Only a key that is
//!   nowhere yet enters the journal; a record found in either place is updated or removed there.
//! * every committed journal row has its index entry: entries are added in the transaction
//!   that writes the row (before it commits), never replaced, and dropped only by a merge
//!   (after its commit, or holding the write lock when there was nothing to move).
//! * the index is a hint, never the truth: each hit is checked against the key stored in the
//!   row, so an entry whose transaction aborted, or whose row was merged or swept, reads as a
//!   miss and the lookup goes on to `idem_keys`.
//! * a new key whose fingerprint already has an entry (another key's, or a dead one) is
//!   written to `idem_keys` directly, as is every new key while the index holds
//!   [`MERGE_ROWS`] entries: that bounds the index's memory and the merge's size when one
//!   transaction claims millions of keys (a county's baseline).

use super::codec::{encode_versioned, split_version, unknown_version};
use super::idem::{decode_idem, encode_idem, IdemRecord};
use super::runs::codec_err;
use super::tables::{IDEM_KEYS, IDEM_KEY_JOURNAL};
use super::StoreError;
use redb::{ReadableTable, ReadableTableMetadata, Table, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Mutex;

/// Journal rows that trigger a merge into `idem_keys` (checked after each claiming commit).
/// Larger means fewer sweeps of the key tree and more index memory (the fingerprint table
/// takes ~2.2 MiB at this size). Measured (issue 7, 500,000 claims at 10,000 per commit):
/// 131,072 wrote 28% less per event than 65,536 at the same rate within run-to-run spread,
/// with a longer merge commit (up to 0.98 s against 0.72-0.96 s).
pub const MERGE_ROWS: usize = 65_536;

/// Version byte of journal rows.
const JOURNAL_ROW_VERSION: u8 = 1;

/// One journal row: the key and its record (an `idem_keys` value, with its own version byte).
#[derive(Serialize, Deserialize)]
struct JournalRow<'a> {
    key: &'a str,
    record: &'a [u8],
}

fn encode_row(key: &str, rec: &IdemRecord) -> Vec<u8> {
    let record = encode_idem(rec);
    encode_versioned(JOURNAL_ROW_VERSION, &JournalRow { key, record: &record })
}

fn decode_row(bytes: &[u8]) -> Result<JournalRow<'_>, String> {
    match split_version(bytes)? {
        // Borrowed from the row's bytes: a lookup compares the key without copying it.
        (JOURNAL_ROW_VERSION, rest) => postcard::from_bytes(rest).map_err(|e| e.to_string()),
        (v, _) => Err(unknown_version(v, "idempotency key journal", JOURNAL_ROW_VERSION)),
    }
}

/// Where a key's record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// `idem_key_journal` row with this sequence number.
    Journal(u64),
    /// `idem_keys`.
    Main,
}

#[derive(Default)]
struct IndexState {
    by_fingerprint: HashMap<u64, u64>,
    next_seq: u64,
}

/// The longest a failed merge waits, in claiming commits, before it is tried again.
pub(super) const MERGE_RETRY_MAX_COMMITS: u64 = 1_024;

/// Claiming commits to let pass after the `failures`-th failed merge in a row: 2, 4, 8 …,
/// capped at [`MERGE_RETRY_MAX_COMMITS`].
fn merge_retry_commits(failures: u32) -> u64 {
    1u64.checked_shl(failures.min(16)).unwrap_or(u64::MAX).min(MERGE_RETRY_MAX_COMMITS)
}

/// The in-memory index of the journal, owned by the [`super::Store`]. Fingerprints are never
/// stored (the index is rebuilt from the rows on open), so they are keyed per process: a feed
/// cannot aim keys at one fingerprint, and a collision would only send a key to `idem_keys`.
#[derive(Default)]
pub(super) struct KeyIndex {
    state: Mutex<IndexState>,
    hasher: std::hash::RandomState,
    /// Merges committed by this process (reported by the bench).
    merges: std::sync::atomic::AtomicU64,
    /// Journal size that triggers a merge: [`MERGE_ROWS`] unless a test lowers it
    /// (0 reads as `MERGE_ROWS`).
    merge_rows: std::sync::atomic::AtomicUsize,
    /// Merges that failed in a row since the last one that committed.
    merge_failures: std::sync::atomic::AtomicU32,
    /// Claiming commits still to pass before a failed merge is tried again.
    merge_skip: std::sync::atomic::AtomicU64,
}

impl KeyIndex {
    fn fingerprint(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IndexState> {
        // A panic while holding the lock cannot leave the map half-updated in a way that
        // matters: every entry is a hint checked against its row.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Index entries (dead ones included) that trigger a merge and at which new keys stop
    /// entering the journal: [`MERGE_ROWS`] unless a test lowered it.
    fn merge_threshold(&self) -> usize {
        match self.merge_rows.load(std::sync::atomic::Ordering::Relaxed) {
            0 => MERGE_ROWS,
            n => n,
        }
    }

    fn hint(&self, key: &str) -> Option<u64> {
        self.lock().by_fingerprint.get(&self.fingerprint(key)).copied()
    }

    /// Entries in the index (stale ones included until the next merge).
    pub(super) fn len(&self) -> usize {
        self.lock().by_fingerprint.len()
    }

    /// Rebuilds the index from the journal (on open). Returns `false` if two rows share a
    /// fingerprint (the invariant forbids it; a file written by hand could): the caller then
    /// merges the journal so that no row depends on the index.
    pub(super) fn rebuild<J: ReadableTable<u64, &'static [u8]>>(&self, journal: &J) -> Result<bool, StoreError> {
        let mut state = IndexState::default();
        let mut clean = true;
        for item in journal.iter()? {
            let (k, v) = item?;
            let seq = k.value();
            let row = decode_row(v.value()).map_err(|m| codec_err("idem_key_journal", m))?;
            if state.by_fingerprint.insert(self.fingerprint(row.key), seq).is_some() {
                clean = false;
            }
            state.next_seq = seq.saturating_add(1);
        }
        state.next_seq = state.next_seq.max(1);
        *self.lock() = state;
        Ok(clean)
    }

    /// Drops the entries of rows up to `max_seq` (after a committed merge removed them).
    pub(super) fn forget_through(&self, max_seq: u64) {
        let mut state = self.lock();
        state.by_fingerprint.retain(|_, seq| *seq > max_seq);
        // A merged journal's table would otherwise stay at its largest size for the life of
        // the process (~2.2 MiB at `MERGE_ROWS`), a share of an idle daemon's memory.
        if state.by_fingerprint.len() < state.by_fingerprint.capacity() / 4 {
            state.by_fingerprint.shrink_to_fit();
        }
    }
}

/// Looks `key` up wherever it lives, in any transaction (read or write).
pub(super) fn find<J, M>(index: &KeyIndex, journal: &J, main: &M, key: &str) -> Result<Option<(Place, IdemRecord)>, StoreError>
where
    J: ReadableTable<u64, &'static [u8]>,
    M: ReadableTable<&'static str, &'static [u8]>,
{
    if let Some(seq) = index.hint(key) {
        if let Some(v) = journal.get(seq)? {
            let row = decode_row(v.value()).map_err(|m| codec_err("idem_key_journal", m))?;
            if row.key == key {
                let rec = decode_idem(row.record).map_err(|m| codec_err("idem_key_journal", m))?;
                return Ok(Some((Place::Journal(seq), rec)));
            }
        }
    }
    match main.get(key)? {
        Some(v) => Ok(Some((Place::Main, decode_idem(v.value()).map_err(|m| codec_err("idem_keys", m))?))),
        None => Ok(None),
    }
}

/// Every journal row as (sequence number, key, record), in sequence order (tests and test
/// hooks: a row that does not decode is an error).
pub(super) fn rows<J: ReadableTable<u64, &'static [u8]>>(journal: &J) -> Result<Vec<(u64, String, IdemRecord)>, StoreError> {
    let mut out = Vec::new();
    for (seq, row) in rows_as_read(journal)? {
        let (key, rec) = row.map_err(|m| codec_err("idem_key_journal", m))?;
        out.push((seq, key, rec.map_err(|m| codec_err("idem_key_journal", m))?));
    }
    Ok(out)
}

/// Every journal row as the consistency check reads it (the file without an index), in
/// sequence order: the row's key and its record, or why the row does not decode (`Err`), or
/// why its record does not (`Ok((key, Err))`).
pub(super) type JournalRowRead = Result<(String, Result<IdemRecord, String>), String>;

pub(super) fn rows_as_read<J: ReadableTable<u64, &'static [u8]>>(journal: &J) -> Result<Vec<(u64, JournalRowRead)>, StoreError> {
    let mut out = Vec::new();
    for item in journal.iter()? {
        let (k, v) = item?;
        let row = decode_row(v.value()).map(|row| (row.key.to_string(), decode_idem(row.record)));
        out.push((k.value(), row));
    }
    Ok(out)
}

/// The two key tables of one write transaction, with the index that finds journal rows.
pub(super) struct KeyTables<'t> {
    main: Table<'t, &'static str, &'static [u8]>,
    journal: Table<'t, u64, &'static [u8]>,
    index: &'t KeyIndex,
}

impl<'t> KeyTables<'t> {
    pub(super) fn open(wtx: &'t WriteTransaction, index: &'t KeyIndex) -> Result<Self, StoreError> {
        Ok(KeyTables { main: wtx.open_table(IDEM_KEYS)?, journal: wtx.open_table(IDEM_KEY_JOURNAL)?, index })
    }

    pub(super) fn find(&self, key: &str) -> Result<Option<(Place, IdemRecord)>, StoreError> {
        find(self.index, &self.journal, &self.main, key)
    }

    /// Writes the record of a key that is in neither table (the caller looked it up).
    pub(super) fn insert_new(&mut self, key: &str, rec: &IdemRecord) -> Result<(), StoreError> {
        let fp = self.index.fingerprint(key);
        let mut state = self.index.lock();
        // An entry is never replaced, even one whose row this transaction does not see: the
        // row may have been removed earlier in this same transaction, and if it aborts, that
        // row is live again and needs its entry. A key whose fingerprint is taken (by a live
        // key, or a dead entry until the next merge prunes it) goes where no index is needed.
        // So does every new key once the index is full, which is what bounds its memory (and
        // the next merge) when one transaction claims millions of keys, as a county's
        // baseline does: such a transaction sweeps `idem_keys` with sorted inserts anyway.
        if state.by_fingerprint.contains_key(&fp) || state.by_fingerprint.len() >= self.index.merge_threshold() {
            drop(state);
            self.main.insert(key, encode_idem(rec).as_slice())?;
            return Ok(());
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        self.journal.insert(seq, encode_row(key, rec).as_slice())?;
        // Added before the transaction commits: a committed row always has its entry. If the
        // transaction aborts instead, the entry points at no row and reads as a miss.
        state.by_fingerprint.insert(fp, seq);
        Ok(())
    }

    /// Rewrites a key's record where it lives.
    pub(super) fn update(&mut self, place: Place, key: &str, rec: &IdemRecord) -> Result<(), StoreError> {
        match place {
            Place::Journal(seq) => self.journal.insert(seq, encode_row(key, rec).as_slice())?,
            Place::Main => self.main.insert(key, encode_idem(rec).as_slice())?,
        };
        Ok(())
    }

    /// Deletes a key's record where it lives (its index entry goes stale: a miss).
    pub(super) fn remove(&mut self, place: Place, key: &str) -> Result<(), StoreError> {
        match place {
            Place::Journal(seq) => self.journal.remove(seq)?,
            Place::Main => self.main.remove(key)?,
        };
        Ok(())
    }
}

/// What [`merge_in`] did.
pub(super) struct Merged {
    /// Journal rows moved into `idem_keys`.
    pub(super) rows: usize,
    /// Every sequence number handed out before the merge: once its transaction has committed,
    /// [`KeyIndex::forget_through`] this drops the moved rows' entries and the dead ones.
    pub(super) through_seq: u64,
}

/// Moves every journal row into `idem_keys`, in key order, and empties the journal. The
/// caller holds the write lock, so no sequence number is handed out meanwhile.
pub(super) fn merge_in(wtx: &WriteTransaction, index: &KeyIndex) -> Result<Merged, StoreError> {
    let through_seq = index.lock().next_seq.saturating_sub(1);
    let mut rows: Vec<(String, Vec<u8>)> = Vec::new();
    {
        let journal = wtx.open_table(IDEM_KEY_JOURNAL)?;
        if journal.len()? == 0 {
            return Ok(Merged { rows: 0, through_seq });
        }
        rows.reserve(journal.len()? as usize);
        for item in journal.iter()? {
            let (_, v) = item?;
            let row = decode_row(v.value()).map_err(|m| codec_err("idem_key_journal", m))?;
            rows.push((row.key.to_string(), row.record.to_vec()));
        }
    }
    // Stable: were a key in two rows (the invariants exclude it), the newer row is inserted
    // last and wins.
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    {
        let mut main = wtx.open_table(IDEM_KEYS)?;
        for (key, record) in &rows {
            if main.insert(key.as_str(), record.as_slice())?.is_some() {
                tracing::warn!(key = %key, "idempotency key was in idem_keys and in the key journal; the journal's record is kept");
            }
        }
    }
    // Dropping the table frees its pages wholesale; it is created again, empty.
    wtx.delete_table(IDEM_KEY_JOURNAL)?;
    wtx.open_table(IDEM_KEY_JOURNAL)?;
    Ok(Merged { rows: rows.len(), through_seq })
}

impl super::Store {
    /// Merges the key journal into `idem_keys` in its own durable transaction and prunes the
    /// index. Returns the journal rows moved.
    pub fn merge_key_journal(&self) -> Result<usize, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let merged = merge_in(&wtx, &self.key_index)?;
        if merged.rows == 0 {
            // Nothing to write; the index may still hold dead entries (aborted claims, swept
            // rows), pruned while the write lock is still held.
            self.key_index.forget_through(merged.through_seq);
            wtx.abort()?;
            return Ok(0);
        }
        wtx.commit()?;
        self.key_index.forget_through(merged.through_seq);
        self.key_index.merges.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(merged.rows)
    }

    /// Called after each commit that claimed keys: merges once the journal holds
    /// [`MERGE_ROWS`] rows. The claims are already committed, so a failed merge is logged and
    /// left in place; it loses nothing (the rows stay in the journal, and new keys go to
    /// `idem_keys` while the index is full). It is tried again after 2, 4, 8 … up to
    /// [`MERGE_RETRY_MAX_COMMITS`] claiming commits, so a journal that cannot be merged (an
    /// unreadable row) costs neither a failed merge nor a warning on every commit.
    pub(super) fn merge_key_journal_if_full(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.key_index.len() < self.key_index.merge_threshold() {
            return;
        }
        let skip = self.key_index.merge_skip.load(Relaxed);
        if skip > 0 {
            self.key_index.merge_skip.store(skip - 1, Relaxed);
            return;
        }
        let started = std::time::Instant::now();
        match self.merge_key_journal() {
            Ok(n) => {
                self.key_index.merge_failures.store(0, Relaxed);
                tracing::debug!(rows = n, seconds = started.elapsed().as_secs_f64(), "idempotency key journal merged into idem_keys")
            }
            Err(e) => {
                let failures = self.key_index.merge_failures.fetch_add(1, Relaxed).saturating_add(1);
                let wait = merge_retry_commits(failures);
                self.key_index.merge_skip.store(wait, Relaxed);
                tracing::warn!(failures, "idempotency key journal merge failed (tried again after {wait} claiming commits; new keys go to idem_keys meanwhile): {e}");
            }
        }
    }

    /// Rows in the key journal, not merged yet.
    pub fn key_journal_len(&self) -> Result<u64, StoreError> {
        use redb::ReadableDatabase;
        Ok(self.db.begin_read()?.open_table(IDEM_KEY_JOURNAL)?.len()?)
    }

    /// Test hook: merge the key journal after claiming commits once it holds `rows` entries
    /// (instead of [`MERGE_ROWS`]; 0 restores it), so tests reach the automatic merge with a
    /// few claims.
    #[doc(hidden)]
    pub fn set_key_journal_merge_rows(&self, rows: usize) {
        self.key_index.merge_rows.store(rows, std::sync::atomic::Ordering::Relaxed);
    }

    /// Test hook for the invariant `zonewatch check` cannot see (it reads the file, not the
    /// process): the journal rows whose key the in-memory index does not lead back to them.
    /// Empty when every committed row is findable.
    #[doc(hidden)]
    pub fn key_journal_rows_without_entry(&self) -> Result<Vec<String>, StoreError> {
        use redb::ReadableDatabase;
        let rtx = self.db.begin_read()?;
        let journal = rtx.open_table(IDEM_KEY_JOURNAL)?;
        Ok(rows(&journal)?
            .into_iter()
            .filter(|(seq, key, _)| self.key_index.hint(key) != Some(*seq))
            .map(|(seq, key, _)| format!("{key} (row {seq})"))
            .collect())
    }

    /// Journal merges this process has committed.
    pub fn key_journal_merges(&self) -> u64 {
        self.key_index.merges.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::idem::IdemState;
    use redb::ReadableDatabase;

    fn rec(outbox_id: u64) -> IdemRecord {
        IdemRecord {
            claimed_ms: 1,
            expires_ms: 10,
            lineage_id: "l".into(),
            state: IdemState::Queued,
            outbox_id: Some(outbox_id),
            ttl_ms: 9,
            earlier_rows: Vec::new(),
        }
    }

    fn db() -> (tempfile::TempDir, redb::Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("j.redb")).unwrap();
        (dir, db)
    }

    /// A key written in an aborted transaction is not found afterwards, its stale entry
    /// does not hide a later key, and a committed row survives a rebuild of the index.
    #[test]
    fn aborted_rows_read_as_misses_and_committed_rows_survive_reopen() {
        let (_dir, db) = db();
        let index = KeyIndex::default();
        {
            let wtx = db.begin_write().unwrap();
            let mut t = KeyTables::open(&wtx, &index).unwrap();
            t.insert_new("gone", &rec(1)).unwrap();
            assert!(matches!(t.find("gone").unwrap().unwrap().0, Place::Journal(_)), "found in its own transaction");
            drop(t);
            wtx.abort().unwrap();
        }
        {
            let wtx = db.begin_write().unwrap();
            let mut t = KeyTables::open(&wtx, &index).unwrap();
            assert!(t.find("gone").unwrap().is_none(), "the aborted claim is not a claim");
            t.insert_new("kept", &rec(2)).unwrap();
            drop(t);
            wtx.commit().unwrap();
        }
        // A new process: another fingerprint key, the same answers.
        let fresh = KeyIndex::default();
        let rtx = db.begin_read().unwrap();
        let journal = rtx.open_table(IDEM_KEY_JOURNAL).unwrap();
        let main = rtx.open_table(IDEM_KEYS).unwrap();
        assert!(fresh.rebuild(&journal).unwrap());
        let (place, r) = find(&fresh, &journal, &main, "kept").unwrap().unwrap();
        assert!(matches!(place, Place::Journal(_)));
        assert_eq!(r.outbox_id, Some(2));
        assert!(find(&fresh, &journal, &main, "gone").unwrap().is_none());
    }

    /// After a merge every key is in `idem_keys`, the journal is empty, and lookups through
    /// stale index entries (before and after `forget_through`) still find each key once.
    #[test]
    fn merge_moves_every_row_to_the_key_table() {
        let (_dir, db) = db();
        let index = KeyIndex::default();
        let keys: Vec<String> = (0..500).map(|i| format!("{:016x}", (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect();
        {
            let wtx = db.begin_write().unwrap();
            let mut t = KeyTables::open(&wtx, &index).unwrap();
            for (i, k) in keys.iter().enumerate() {
                t.insert_new(k, &rec(i as u64)).unwrap();
            }
            drop(t);
            wtx.commit().unwrap();
        }
        let wtx = db.begin_write().unwrap();
        let merged = merge_in(&wtx, &index).unwrap();
        wtx.commit().unwrap();
        assert_eq!(merged.rows, keys.len());
        assert_eq!(merged.through_seq, keys.len() as u64 - 1, "rows are numbered from 0 in a fresh index");
        {
            let rtx = db.begin_read().unwrap();
            let journal = rtx.open_table(IDEM_KEY_JOURNAL).unwrap();
            let main = rtx.open_table(IDEM_KEYS).unwrap();
            assert_eq!(journal.len().unwrap(), 0);
            assert_eq!(main.len().unwrap(), keys.len() as u64);
            for (i, k) in keys.iter().enumerate() {
                let (place, r) = find(&index, &journal, &main, k).unwrap().unwrap();
                assert_eq!((place, r.outbox_id), (Place::Main, Some(i as u64)));
            }
        }
        index.forget_through(merged.through_seq);
        assert_eq!(index.len(), 0);
        let wtx = db.begin_write().unwrap();
        assert_eq!(merge_in(&wtx, &index).unwrap().rows, 0, "an empty journal is not merged");
    }

    /// Through the store: a key claimed once is a duplicate whether it sits in the journal, in
    /// the key table after a merge, or in a journal whose index was rebuilt by a reopen; the
    /// TTL sweep deletes keys on both sides, and an expired key is claimed again where it lives.
    #[test]
    fn claims_are_exactly_once_across_journal_merge_and_reopen() {
        use crate::model::{sample_event, IdemKey, Severity};
        use crate::store::{Claim, DeliveryResult, Store};
        const HOUR: u64 = 3_600_000;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let claim = |key: &str| Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(key.into()) };
        let event = [sample_event("P")];
        let once = |store: &Store, key: &str, now: u64| {
            let c = store.enqueue(&event, &[claim(key)], "l", now, HOUR).unwrap();
            (c.queued, c.duplicates)
        };
        let consistent = |store: &Store| {
            let r = store.check_consistency().unwrap();
            assert!(r.is_consistent(), "{:?}", r.problems);
        };
        {
            let store = Store::open(&path).unwrap();
            assert_eq!(once(&store, "a", 0), (1, 0));
            assert_eq!(once(&store, "a", 1), (0, 1), "found in the journal");
            assert_eq!(store.key_journal_len().unwrap(), 1);
            store.merge_key_journal().unwrap();
            assert_eq!(store.key_journal_len().unwrap(), 0);
            assert_eq!(once(&store, "a", 2), (0, 1), "found in the key table");
            assert_eq!(once(&store, "b", 3), (1, 0));
            consistent(&store);
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(once(&store, "b", 4), (0, 1), "found through the rebuilt index");
        // Deliver both, then past the TTL one key is swept from each side.
        let rows: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        let sent: Vec<DeliveryResult> = rows.iter().map(|&id| DeliveryResult::Sent { id, status: 200 }).collect();
        store.record_outcomes(&sent, &[], 5).unwrap();
        assert_eq!(store.sweep_expired_keys(2 * HOUR, 100).unwrap(), 2);
        consistent(&store);
        assert_eq!(once(&store, "a", 2 * HOUR), (1, 0), "a swept key is free again");
        // Expired but not swept: claimed again in place (the journal row is rewritten).
        let rows: Vec<u64> = store.outbox().unwrap().iter().map(|e| e.id).collect();
        store.record_outcomes(&[DeliveryResult::Sent { id: rows[0], status: 200 }], &[], 2 * HOUR + 1).unwrap();
        assert_eq!(once(&store, "a", 4 * HOUR), (1, 0));
        assert_eq!(store.key_journal_len().unwrap(), 1, "one journal row for the key, rewritten in place");
        consistent(&store);
    }

    /// A merge that fails (here: an unreadable journal row) is tried again after 2, then 4
    /// claiming commits, not after every one; claims go on meanwhile, and once the row reads
    /// again the next try merges and the backoff starts over.
    #[test]
    fn a_failed_merge_backs_off_by_claiming_commits() {
        use crate::model::{sample_event, IdemKey, Severity};
        use crate::store::{Claim, Store};
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        store.set_key_journal_merge_rows(3);
        let event = [sample_event("P")];
        let claim = |key: &str| {
            let c = Claim { event: 0, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(key.into()) };
            assert_eq!(store.enqueue(&event, &[c], "l", 0, 3_600_000).unwrap().queued, 1, "{key} claimed");
        };
        claim("a");
        claim("b");
        let (seq, good) = {
            let rtx = store.db.begin_read().unwrap();
            let journal = rtx.open_table(IDEM_KEY_JOURNAL).unwrap();
            let (k, v) = journal.first().unwrap().unwrap();
            (k.value(), v.value().to_vec())
        };
        let set_row = |bytes: &[u8]| {
            let wtx = store.db.begin_write().unwrap();
            wtx.open_table(IDEM_KEY_JOURNAL).unwrap().insert(seq, bytes).unwrap();
            wtx.commit().unwrap();
        };
        set_row(&[0xff, 0xff]);
        let failures = || store.key_index.merge_failures.load(Relaxed);
        claim("c");
        assert_eq!((failures(), store.key_journal_merges()), (1, 0), "the index is full: a merge was tried and failed");
        claim("d");
        claim("e");
        assert_eq!(failures(), 1, "two claiming commits pass without a try");
        claim("f");
        assert_eq!(failures(), 2, "then one more try");
        for k in ["g", "h", "i", "j"] {
            claim(k);
        }
        assert_eq!(failures(), 2, "four commits pass");
        set_row(&good);
        claim("k");
        assert_eq!((failures(), store.key_journal_merges()), (0, 1), "the row reads again: merged, backoff reset");
        assert_eq!(store.key_journal_len().unwrap(), 0);
        let r = store.check_consistency().unwrap();
        assert!(r.is_consistent(), "{:?}", r.problems);
    }

    /// The sequence the index must survive: a transaction removes a key's journal row (as
    /// the sweep does), claims the same key again, and aborts. The committed row is live again
    /// and must still be found: its entry was not replaced.
    #[test]
    fn remove_reinsert_abort_keeps_the_committed_row_findable() {
        let (_dir, db) = db();
        let index = KeyIndex::default();
        {
            let wtx = db.begin_write().unwrap();
            let mut t = KeyTables::open(&wtx, &index).unwrap();
            t.insert_new("k", &rec(1)).unwrap();
            drop(t);
            wtx.commit().unwrap();
        }
        {
            let wtx = db.begin_write().unwrap();
            let mut t = KeyTables::open(&wtx, &index).unwrap();
            let (place, _) = t.find("k").unwrap().unwrap();
            t.remove(place, "k").unwrap();
            assert!(t.find("k").unwrap().is_none());
            t.insert_new("k", &rec(2)).unwrap();
            assert_eq!(t.find("k").unwrap().unwrap().0, Place::Main, "its fingerprint's entry is kept");
            drop(t);
            wtx.abort().unwrap();
        }
        let wtx = db.begin_write().unwrap();
        let t = KeyTables::open(&wtx, &index).unwrap();
        let (place, r) = t.find("k").unwrap().unwrap();
        assert!(matches!(place, Place::Journal(_)));
        assert_eq!(r.outbox_id, Some(1), "the committed claim, not the aborted one");
    }

    /// Past the merge size new keys go straight to `idem_keys` (what bounds the index when one
    /// transaction claims millions of keys), and a merge with nothing to move still prunes
    /// the dead entries of aborted claims.
    #[test]
    fn a_full_index_sends_new_keys_to_the_key_table_and_empty_merges_prune() {
        let (_dir, db) = db();
        let index = KeyIndex::default();
        index.merge_rows.store(3, std::sync::atomic::Ordering::Relaxed);
        let wtx = db.begin_write().unwrap();
        let mut t = KeyTables::open(&wtx, &index).unwrap();
        for i in 0..10u64 {
            t.insert_new(&format!("k{i}"), &rec(i)).unwrap();
        }
        let places: Vec<bool> = (0..10).map(|i| matches!(t.find(&format!("k{i}")).unwrap().unwrap().0, Place::Journal(_))).collect();
        assert_eq!(places, [true, true, true, false, false, false, false, false, false, false]);
        drop(t);
        wtx.abort().unwrap();
        assert_eq!(index.len(), 3, "three dead entries");
        let wtx = db.begin_write().unwrap();
        let merged = merge_in(&wtx, &index).unwrap();
        assert_eq!(merged.rows, 0);
        wtx.abort().unwrap();
        index.forget_through(merged.through_seq);
        assert_eq!(index.len(), 0, "dead entries pruned without a commit");
    }

    /// Two live keys never depend on one index entry: a key whose fingerprint is taken goes
    /// to `idem_keys`, and both are found.
    #[test]
    fn a_taken_fingerprint_sends_the_new_key_to_the_key_table() {
        let (_dir, db) = db();
        let index = KeyIndex::default();
        let wtx = db.begin_write().unwrap();
        let mut t = KeyTables::open(&wtx, &index).unwrap();
        t.insert_new("first", &rec(1)).unwrap();
        // Simulate a collision: point "second"'s fingerprint at "first"'s live row.
        let seq = index.hint("first").unwrap();
        let fp = index.fingerprint("second");
        index.lock().by_fingerprint.insert(fp, seq);
        t.insert_new("second", &rec(2)).unwrap();
        let (place, second) = t.find("second").unwrap().unwrap();
        assert_eq!((place, second.outbox_id), (Place::Main, Some(2)));
        assert_eq!(t.find("first").unwrap().unwrap().1.outbox_id, Some(1));
    }
}
