//! Tombstones: what a removed parcel leaves behind in `parcel_tombstones`, keyed like the
//! snapshot by (source id, parcel id), so that a parcel removed and then published again is
//! not mistaken for one never seen.
//!
//! Why it exists: a change event's idempotency key includes a revision taken from its
//! parcel's record (`ParcelState::revision`, `detect::diff::step`), so that a parcel going R-1 → C-2, back, and to
//! C-2 again is alerted three times, under three keys. The snapshot holds a parcel's revision
//! while the parcel is there; once it is removed, only its tombstone remembers it. Without
//! one, a parcel removed, added back, removed again and added back within the key TTL would
//! start again from revision 0 each time, and its second removal and addition would have the
//! first ones' keys: audited `duplicate`, never sent, and the receiver left believing the
//! parcel gone.
//!
//! A tombstone is needed only while a key of the parcel's earlier life can still be live: it
//! is swept, by a committing run of its source, once it is older than the key TTL (the keys
//! of that life were claimed before the removal, so they have expired by then — unless the
//! TTL was lowered since, or a key was kept past it because its event is still pending, a
//! dead letter not replayed: then the parcel, back, may be audited `duplicate` of that key).
//! The sweep walks the source's tombstones in the run's write transaction: as many as its
//! removals within the TTL. A tombstone
//! left in place after its parcel came back is harmless: the parcel's state carries the
//! revision from there on, and its next removal writes a new tombstone over it.
//!
//! Record: `[1] ++ postcard(Tombstone)`.

use super::codec::{decode, encode};
use super::tables::PARCEL_TOMBSTONES;
use super::StoreError;
use redb::{ReadableTable, WriteTransaction};
use crate::model::Announced;
use serde::{Deserialize, Serialize};

/// The table name errors and logs give.
const TABLE: &str = "parcel_tombstones";

/// What a removed parcel's record said after its removal, and when it was removed.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tombstone {
    /// The parcel's revision after the removal (`ParcelState::revision`).
    pub revision: u32,
    /// Its last announcement after the removal (`ParcelState::announced`).
    pub announced: Option<Announced>,
    /// When the removing run committed (this machine's clock).
    pub removed_ms: u64,
}

/// Writes a tombstone for each parcel removed from `source_id`'s snapshot in this
/// transaction (over any tombstone the parcel had).
pub(super) fn bury(wtx: &WriteTransaction, source_id: &str, removed: &[(&str, Tombstone)]) -> Result<(), StoreError> {
    if removed.is_empty() {
        return Ok(());
    }
    let mut table = wtx.open_table(PARCEL_TOMBSTONES)?;
    for (id, tombstone) in removed {
        table.insert((source_id, *id), encode(tombstone).as_slice())?;
    }
    Ok(())
}

/// One parcel's tombstone, from a table opened in a read or a write transaction. A row that
/// does not decode reads as none, logged: its parcel, back, starts again from revision 0,
/// which at worst makes a change of it look like one already sent; it never stops a run
/// (`zonewatch check --store` names the row).
pub(super) fn find<T>(table: &T, source_id: &str, parcel_id: &str) -> Result<Option<Tombstone>, StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    let Some(row) = table.get((source_id, parcel_id))? else { return Ok(None) };
    match decode::<Tombstone>(row.value()) {
        Ok(t) => Ok(Some(t)),
        Err(e) => {
            tracing::warn!(source = source_id, parcel = parcel_id, error = %e, "{TABLE}: a row that does not decode is ignored");
            Ok(None)
        }
    }
}

/// Removes `source_id`'s tombstones written before `before_ms`, and any that does not
/// decode; returns how many went.
pub(super) fn sweep(wtx: &WriteTransaction, source_id: &str, before_ms: u64) -> Result<u64, StoreError> {
    let mut table = wtx.open_table(PARCEL_TOMBSTONES)?;
    let mut expired = Vec::new();
    super::queries::for_each_source_row(&table, source_id, |id, bytes| {
        if decode::<Tombstone>(bytes).map_or(true, |t| t.removed_ms < before_ms) {
            expired.push(id.to_string());
        }
        Ok(())
    })?;
    for id in &expired {
        table.remove((source_id, id.as_str()))?;
    }
    Ok(expired.len() as u64)
}

/// Every tombstone row that does not decode, as `source/parcel: message` (for `check`).
pub(super) fn unreadable<T>(table: &T) -> Result<Vec<String>, StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    let mut out = Vec::new();
    for item in table.iter()? {
        let (k, v) = item?;
        if let Err(m) = decode::<Tombstone>(v.value()) {
            let (source, id) = k.value();
            out.push(format!("{source}/{id}: {m}"));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use redb::ReadableDatabase;

    /// A tombstone of a parcel whose removal was announced.
    fn buried(revision: u32, removed_ms: u64) -> Tombstone {
        Tombstone { revision, announced: Some(Announced { content: [0; 16], key_revision: revision.saturating_sub(1) }), removed_ms }
    }

    /// Buried parcels are found by source; a sweep takes only the source's tombstones older
    /// than its cut-off (and damaged ones), and a reading skips a damaged row.
    #[test]
    fn tombstones_are_kept_per_source_and_swept_by_age() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        bury(&wtx, "a", &[("p1", buried(2, 1_000)), ("p2", buried(5, 1_000))]).unwrap();
        bury(&wtx, "a", &[("p3", buried(1, 5_000))]).unwrap();
        bury(&wtx, "b", &[("p1", buried(9, 1_000))]).unwrap();
        wtx.open_table(PARCEL_TOMBSTONES).unwrap().insert(("a", "p4"), [7u8, 1, 2].as_slice()).unwrap();
        wtx.commit().unwrap();

        let rtx = store.db.begin_read().unwrap();
        let table = rtx.open_table(PARCEL_TOMBSTONES).unwrap();
        assert_eq!(find(&table, "a", "p1").unwrap(), Some(buried(2, 1_000)));
        assert_eq!(find(&table, "a", "p2").unwrap(), Some(buried(5, 1_000)));
        assert_eq!(find(&table, "a", "p3").unwrap(), Some(buried(1, 5_000)));
        assert_eq!(find(&table, "b", "p1").unwrap(), Some(buried(9, 1_000)));
        assert_eq!(find(&table, "c", "p1").unwrap(), None);
        assert_eq!(find(&table, "a", "p4").unwrap(), None, "a damaged row reads as none");
        assert_eq!(find(&table, "a", "p9").unwrap(), None);
        let bad = unreadable(&table).unwrap();
        assert_eq!(bad.len(), 1);
        assert!(bad[0].starts_with("a/p4: "), "{bad:?}");
        drop((table, rtx));

        let wtx = store.db.begin_write().unwrap();
        assert_eq!(sweep(&wtx, "a", 2_000).unwrap(), 3, "p1 and p2 are older, p4 is damaged");
        wtx.commit().unwrap();
        let rtx = store.db.begin_read().unwrap();
        let table = rtx.open_table(PARCEL_TOMBSTONES).unwrap();
        assert_eq!((find(&table, "a", "p1").unwrap(), find(&table, "a", "p2").unwrap()), (None, None));
        assert_eq!(find(&table, "a", "p3").unwrap(), Some(buried(1, 5_000)));
        assert_eq!(find(&table, "b", "p1").unwrap(), Some(buried(9, 1_000)), "another source's are left");
    }
}
