//! The expiry index of idempotency keys, one row per up to 16 keys that expire at the same
//! instant instead of one row per key.
//!
//! Why it exists (issue 7): the TTL sweep needs the keys in expiry order, and the claim commit
//! wrote an `(expires at, key)` row for every claim — a B-tree insert and ~90 bytes per event,
//! about 7% of the claim + outbox + audit commit (measured by leaving it out). Every claim of
//! one batch expires at the same instant, so the batch's keys share *buckets*:
//! `(expires at, bucket number) → [keys]`, at most [`BUCKET_KEYS`] keys a bucket (the sweep's
//! re-armed keys are bucketed the same way, by their new instant).
//!
//! A bucket entry is not removed when its key is claimed again after its TTL (that would
//! mean rewriting a bucket for one key): the sweep acts on a key only if its record still
//! expires at the bucket's instant, so the entry left behind is skipped and goes with its
//! bucket. Every key's current expiry has its entry (`zonewatch check` verifies it). A
//! bucket that cannot be read is left in place and reported, never guessed at.
//!
//! Stores written before buckets have the per-key table `idem_expiry`; opening one moves its
//! entries into buckets once ([`migrate_per_key_index`]).

use super::codec::{encode_versioned, split_version, unknown_version};
use super::tables::{IDEM_EXPIRY, IDEM_EXPIRY_BUCKETS};
use super::StoreError;
use redb::{ReadableTable, Table, TableHandle, WriteTransaction};
use serde::{Deserialize, Serialize};

/// Keys a bucket holds at most: ~1 KiB of hex keys, three buckets to a 4 KiB page. Measured
/// (issue 7): 8,192 (one row per batch) was slower and wrote more (a 600 KiB value takes a
/// power-of-two allocation); 32 (one bucket a page) wrote ~10% more per event than 16.
pub const BUCKET_KEYS: usize = 16;

const BUCKET_VERSION: u8 = 1;

#[derive(Serialize, Deserialize)]
struct Bucket<'a> {
    #[serde(borrow)]
    keys: Vec<&'a str>,
}

fn encode_bucket(keys: &[&str]) -> Vec<u8> {
    encode_versioned(BUCKET_VERSION, &Bucket { keys: keys.to_vec() })
}

fn decode_bucket(bytes: &[u8]) -> Result<Vec<&str>, String> {
    match split_version(bytes)? {
        (BUCKET_VERSION, rest) => postcard::from_bytes::<Bucket<'_>>(rest).map(|b| b.keys).map_err(|e| e.to_string()),
        (v, _) => Err(unknown_version(v, "idempotency key expiry buckets", BUCKET_VERSION)),
    }
}

/// The bucket table of one write transaction.
pub(super) struct ExpiryIndex<'t> {
    table: Table<'t, (u64, u64), &'static [u8]>,
}

impl<'t> ExpiryIndex<'t> {
    pub(super) fn open(wtx: &'t WriteTransaction) -> Result<Self, StoreError> {
        Ok(ExpiryIndex { table: wtx.open_table(IDEM_EXPIRY_BUCKETS)? })
    }

    /// Records that `keys` expire at `expires_ms` (a bucket per [`BUCKET_KEYS`] keys).
    pub(super) fn add(&mut self, expires_ms: u64, keys: &[&str]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        // The instant's next free bucket number, looked up once per call, not per bucket.
        let mut next = self.table.range((expires_ms, 0)..=(expires_ms, u64::MAX))?.next_back().transpose()?.map_or(0, |(k, _)| k.value().1.saturating_add(1));
        for chunk in keys.chunks(BUCKET_KEYS) {
            self.table.insert((expires_ms, next), encode_bucket(chunk).as_slice())?;
            next = next.saturating_add(1);
        }
        Ok(())
    }

    /// Takes up to `max` entries that expired before `now_ms`, oldest first, out of the index
    /// (a bucket taken in part keeps the rest).
    pub(super) fn take_due(&mut self, now_ms: u64, max: usize) -> Result<Vec<(u64, String)>, StoreError> {
        let mut out: Vec<(u64, String)> = Vec::new();
        let mut emptied = Vec::new();
        let mut rest: Option<((u64, u64), Vec<u8>)> = None;
        for item in self.table.range(..(now_ms, 0))? {
            if out.len() >= max {
                break;
            }
            let (k, v) = item?;
            let (t, n) = k.value();
            let keys = match decode_bucket(v.value()) {
                Ok(keys) => keys,
                Err(m) => {
                    // Left in place for `zonewatch check` to report; the sweep goes on past it
                    // (stopping here would stop sweeping every key for good). Said once an hour:
                    // every batch of every sweep period steps over it.
                    static SAID_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                    if crate::util::now_and_then(&SAID_MS, 3_600_000) {
                        tracing::warn!(expires_ms = t, bucket = n, "idempotency key expiry bucket unreadable, skipped (check --store names it): {m}");
                    }
                    continue;
                }
            };
            let take = keys.len().min(max - out.len());
            out.extend(keys[..take].iter().map(|key| (t, key.to_string())));
            if take == keys.len() {
                emptied.push((t, n));
            } else {
                rest = Some(((t, n), encode_bucket(&keys[take..])));
            }
        }
        for k in emptied {
            self.table.remove(k)?;
        }
        if let Some((k, v)) = rest {
            self.table.insert(k, v.as_slice())?;
        }
        Ok(out)
    }
}

/// Calls `each` with every `(expires at, key)` entry; returns a sentence per bucket that
/// cannot be read (for the consistency check, which keeps no copy of the keys).
pub(super) fn for_each_entry<T: ReadableTable<(u64, u64), &'static [u8]>>(table: &T, mut each: impl FnMut(u64, &str)) -> Result<Vec<String>, StoreError> {
    let mut unreadable = Vec::new();
    for item in table.iter()? {
        let (k, v) = item?;
        let (t, n) = k.value();
        match decode_bucket(v.value()) {
            Ok(keys) => keys.into_iter().for_each(|key| each(t, key)),
            Err(m) => unreadable.push(format!("idempotency key expiry bucket ({t}, {n}) cannot be read: {m}")),
        }
    }
    Ok(unreadable)
}

/// Once per store written before buckets: moves the per-key `idem_expiry` entries into
/// buckets and deletes that table. Returns the entries moved.
pub(super) fn migrate_per_key_index(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    if !wtx.list_tables()?.any(|t| t.name() == IDEM_EXPIRY.name()) {
        return Ok(0);
    }
    let mut moved = 0;
    {
        // Streamed, one bucket's worth of keys in memory at a time (a county-sized store has
        // millions of keys).
        let old = wtx.open_table(IDEM_EXPIRY)?;
        let mut index = ExpiryIndex::open(wtx)?;
        // Keys of the bucket being filled and their instant.
        let (mut at, mut keys): (u64, Vec<String>) = (0, Vec::with_capacity(BUCKET_KEYS));
        for item in old.iter()? {
            let (k, _) = item?;
            let (t, key) = k.value();
            if !keys.is_empty() && (t != at || keys.len() == BUCKET_KEYS) {
                index.add(at, &keys.iter().map(String::as_str).collect::<Vec<_>>())?;
                keys.clear();
            }
            at = t;
            keys.push(key.to_string());
            moved += 1;
        }
        index.add(at, &keys.iter().map(String::as_str).collect::<Vec<_>>())?;
    }
    wtx.delete_table(IDEM_EXPIRY)?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets come back oldest first, split at `max` (the rest stays for the next sweep),
    /// and batches larger than a bucket are split.
    #[test]
    fn buckets_are_taken_in_expiry_order_and_split_at_max() {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("e.redb")).unwrap();
        let wtx = db.begin_write().unwrap();
        let mut index = ExpiryIndex::open(&wtx).unwrap();
        index.add(20, &["c", "d"]).unwrap();
        index.add(10, &["a", "b"]).unwrap();
        index.add(10, &["e"]).unwrap();
        let many: Vec<String> = (0..BUCKET_KEYS + 5).map(|i| format!("m{i}")).collect();
        index.add(30, &many.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(index.take_due(5, 10).unwrap(), vec![], "nothing expired yet");
        let first = index.take_due(25, 2).unwrap();
        assert_eq!(first, vec![(10, "a".to_string()), (10, "b".to_string())]);
        let second = index.take_due(25, 2).unwrap();
        assert_eq!(second, vec![(10, "e".to_string()), (20, "c".to_string())]);
        assert_eq!(index.take_due(25, 10).unwrap(), vec![(20, "d".to_string())]);
        assert_eq!(index.take_due(31, usize::MAX).unwrap().len(), BUCKET_KEYS + 5);
        // An unreadable bucket is skipped (and kept), not a stop for every later sweep.
        index.table.insert((40, 0), [9u8, 1, 2].as_slice()).unwrap();
        index.add(41, &["after"]).unwrap();
        assert_eq!(index.take_due(50, 10).unwrap(), vec![(41, "after".to_string())]);
        drop(index);
        let unreadable = for_each_entry(&wtx.open_table(IDEM_EXPIRY_BUCKETS).unwrap(), |_, _| {}).unwrap();
        assert_eq!(unreadable.len(), 1, "kept for check to report: {unreadable:?}");
    }

    /// A store's per-key expiry index is moved into buckets once, and the old table goes.
    #[test]
    fn per_key_entries_are_migrated_into_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("e.redb")).unwrap();
        let wtx = db.begin_write().unwrap();
        {
            let mut old = wtx.open_table(IDEM_EXPIRY).unwrap();
            for (t, k) in [(5u64, "x"), (5, "y"), (9, "z")] {
                old.insert((t, k), ()).unwrap();
            }
            for i in 0..BUCKET_KEYS + 3 {
                old.insert((7, format!("w{i:03}").as_str()), ()).unwrap();
            }
        }
        assert_eq!(migrate_per_key_index(&wtx).unwrap(), 3 + BUCKET_KEYS as u64 + 3);
        let mut got = std::collections::HashSet::new();
        let unreadable = for_each_entry(&wtx.open_table(IDEM_EXPIRY_BUCKETS).unwrap(), |t, k| {
            got.insert((t, k.to_string()));
        })
        .unwrap();
        let mut want: std::collections::HashSet<(u64, String)> = [(5, "x"), (5, "y"), (9, "z")].into_iter().map(|(t, k)| (t, k.to_string())).collect();
        want.extend((0..BUCKET_KEYS + 3).map(|i| (7, format!("w{i:03}"))));
        assert_eq!(got, want);
        assert!(unreadable.is_empty());
        assert_eq!(redb::ReadableTableMetadata::len(&wtx.open_table(IDEM_EXPIRY_BUCKETS).unwrap()).unwrap(), 4, "buckets: t=5, two at t=7, t=9");
        assert_eq!(wtx.list_tables().unwrap().filter(|t| t.name() == "idem_expiry").count(), 0);
        assert_eq!(migrate_per_key_index(&wtx).unwrap(), 0, "nothing left to move");
    }
}
