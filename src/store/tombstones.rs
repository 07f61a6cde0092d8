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
//! The sweep reads only the tombstones past the TTL, through an index by removal time
//! (`parcel_tombstone_ages`, written beside every tombstone): a county that re-keyed all its
//! parcels leaves millions of tombstones, and every commit of that source for the next TTL
//! would otherwise walk them all. A tombstone left in place after its parcel came back is
//! harmless: the parcel's state carries the revision from there on, and its next removal
//! writes a new tombstone over it (and moves its index row).
//!
//! Record: `[1] ++ postcard(Tombstone)`; index row: `(source, removed_ms, parcel) → ()`.

use super::codec::{decode, encode};
use super::tables::{PARCEL_TOMBSTONES, PARCEL_TOMBSTONE_AGES};
use super::StoreError;
use redb::{ReadableTable, ReadableTableMetadata, WriteTransaction};
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
    let mut ages = wtx.open_table(PARCEL_TOMBSTONE_AGES)?;
    for (id, tombstone) in removed {
        let earlier = table.insert((source_id, *id), encode(tombstone).as_slice())?;
        // A parcel removed again: its earlier tombstone's index row goes with it. (One that
        // does not decode keeps its row, which the sweep finds in time and finds nothing.)
        if let Some(Ok(earlier)) = earlier.map(|row| decode::<Tombstone>(row.value())) {
            ages.remove((source_id, earlier.removed_ms, *id))?;
        }
        ages.insert((source_id, tombstone.removed_ms, *id), ())?;
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

/// Removes `source_id`'s tombstones written before `before_ms`; returns how many went. Reads
/// the index by age from its start to the cut-off only.
pub(super) fn sweep(wtx: &WriteTransaction, source_id: &str, before_ms: u64) -> Result<u64, StoreError> {
    let mut ages = wtx.open_table(PARCEL_TOMBSTONE_AGES)?;
    if ages.is_empty()? {
        return Ok(0);
    }
    let mut expired: Vec<(u64, String)> = Vec::new();
    for item in ages.range((source_id, 0u64, "")..(source_id, before_ms, ""))? {
        let (k, _) = item?;
        let (_, removed_ms, id) = k.value();
        expired.push((removed_ms, id.to_string()));
    }
    if expired.is_empty() {
        return Ok(0);
    }
    let mut table = wtx.open_table(PARCEL_TOMBSTONES)?;
    let mut gone = 0;
    for (removed_ms, id) in &expired {
        ages.remove((source_id, *removed_ms, id.as_str()))?;
        // The tombstone itself only if it is the one this row indexes: one written again
        // later has its own, younger row. One that does not decode goes too.
        let current = table.get((source_id, id.as_str()))?.map(|row| decode::<Tombstone>(row.value()).map(|t| t.removed_ms));
        if matches!(current, Some(Err(_))) || matches!(current, Some(Ok(ms)) if ms == *removed_ms) {
            table.remove((source_id, id.as_str()))?;
            gone += 1;
        }
    }
    Ok(gone)
}

/// Schema 8 → 9: an index row for every tombstone written before the index existed. A row
/// that does not decode is indexed at time 0, so that the next run of its source sweeps it
/// (as schema 8's sweep did). Returns how many rows were indexed. It runs at every open but
/// does its work only while the index is empty: an index that lost rows later (damage) is not
/// rebuilt, only named by `check --store`.
pub(super) fn index_by_age(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    let table = wtx.open_table(PARCEL_TOMBSTONES)?;
    let mut ages = wtx.open_table(PARCEL_TOMBSTONE_AGES)?;
    if table.is_empty()? || !ages.is_empty()? {
        return Ok(0);
    }
    let mut n = 0;
    for item in table.iter()? {
        let (k, v) = item?;
        let (source, id) = k.value();
        let removed_ms = decode::<Tombstone>(v.value()).map_or(0, |t| t.removed_ms);
        ages.insert((source, removed_ms, id), ())?;
        n += 1;
    }
    Ok(n)
}

/// What `zonewatch check --store` says is wrong with the tombstones: every row that does not
/// decode (`tombstone source/parcel: message does not decode`), and every row the index by
/// age does not hold (it would never be swept). A file without the index (`ages` is `None`:
/// schema 8, a backup taken before an upgrade, say) is not judged by it: the upgrade indexes
/// every row.
pub(super) fn problems<T, A>(table: &T, ages: Option<&A>) -> Result<Vec<String>, StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
    A: ReadableTable<(&'static str, u64, &'static str), ()>,
{
    let mut out = Vec::new();
    for item in table.iter()? {
        let (k, v) = item?;
        let (source, id) = k.value();
        match decode::<Tombstone>(v.value()) {
            Err(m) => out.push(format!("tombstone {source}/{id}: {m} does not decode")),
            Ok(t) => {
                let indexed = match ages {
                    Some(ages) => ages.get((source, t.removed_ms, id))?.is_some(),
                    None => true,
                };
                if !indexed {
                    out.push(format!("tombstone {source}/{id} has no row in parcel_tombstone_ages: no run would ever sweep it"));
                }
            }
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

    /// (source, parcel, removed_ms): a tombstone or an index row, as the tests compare them.
    type Row = (String, String, u64);

    /// Every tombstone of the store, and every index row.
    fn rows(store: &Store) -> (Vec<Row>, Vec<Row>) {
        let rtx = store.db.begin_read().unwrap();
        let table = rtx.open_table(PARCEL_TOMBSTONES).unwrap();
        let tombstones = table
            .iter()
            .unwrap()
            .map(|item| {
                let (k, v) = item.unwrap();
                let (s, id) = k.value();
                (s.to_string(), id.to_string(), decode::<Tombstone>(v.value()).map_or(u64::MAX, |t| t.removed_ms))
            })
            .collect();
        let ages = rtx.open_table(PARCEL_TOMBSTONE_AGES).unwrap();
        let indexed = ages
            .iter()
            .unwrap()
            .map(|item| {
                let (k, _) = item.unwrap();
                let (s, ms, id) = k.value();
                (s.to_string(), id.to_string(), ms)
            })
            .collect();
        (tombstones, indexed)
    }

    fn row(s: &str, id: &str, ms: u64) -> Row {
        (s.to_string(), id.to_string(), ms)
    }

    /// Buried parcels are found by source; a sweep takes only the source's tombstones older
    /// than its cut-off (a damaged one too, when its index row comes due), and a reading skips
    /// a damaged row. Each tombstone has exactly one index row, moved when the parcel is
    /// removed again.
    #[test]
    fn tombstones_are_kept_per_source_and_swept_by_age() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        bury(&wtx, "a", &[("p1", buried(2, 1_000)), ("p2", buried(5, 1_000))]).unwrap();
        bury(&wtx, "a", &[("p3", buried(1, 5_000)), ("p4", buried(1, 1_500)), ("p5", buried(1, 1_200))]).unwrap();
        bury(&wtx, "b", &[("p1", buried(9, 1_000))]).unwrap();
        // p5 removed again later: its index row moves with it.
        bury(&wtx, "a", &[("p5", buried(3, 6_000))]).unwrap();
        // p4's bytes damaged after it was written.
        wtx.open_table(PARCEL_TOMBSTONES).unwrap().insert(("a", "p4"), [7u8, 1, 2].as_slice()).unwrap();
        wtx.commit().unwrap();
        let (_, indexed) = rows(&store);
        assert_eq!(
            indexed,
            vec![row("a", "p1", 1_000), row("a", "p2", 1_000), row("a", "p4", 1_500), row("a", "p3", 5_000), row("a", "p5", 6_000), row("b", "p1", 1_000)]
        );

        let rtx = store.db.begin_read().unwrap();
        let table = rtx.open_table(PARCEL_TOMBSTONES).unwrap();
        assert_eq!(find(&table, "a", "p1").unwrap(), Some(buried(2, 1_000)));
        assert_eq!(find(&table, "a", "p2").unwrap(), Some(buried(5, 1_000)));
        assert_eq!(find(&table, "a", "p3").unwrap(), Some(buried(1, 5_000)));
        assert_eq!(find(&table, "a", "p5").unwrap(), Some(buried(3, 6_000)));
        assert_eq!(find(&table, "b", "p1").unwrap(), Some(buried(9, 1_000)));
        assert_eq!(find(&table, "c", "p1").unwrap(), None);
        assert_eq!(find(&table, "a", "p4").unwrap(), None, "a damaged row reads as none");
        assert_eq!(find(&table, "a", "p9").unwrap(), None);
        let ages = rtx.open_table(PARCEL_TOMBSTONE_AGES).unwrap();
        let bad = problems(&table, Some(&ages)).unwrap();
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert!(bad[0].starts_with("tombstone a/p4: "), "{bad:?}");
        drop((table, ages, rtx));

        let wtx = store.db.begin_write().unwrap();
        assert_eq!(sweep(&wtx, "a", 2_000).unwrap(), 3, "p1 and p2 are older, p4 is damaged and came due; p5 was removed again since");
        wtx.commit().unwrap();
        let (tombstones, indexed) = rows(&store);
        assert_eq!(tombstones, vec![row("a", "p3", 5_000), row("a", "p5", 6_000), row("b", "p1", 1_000)], "another source's are left");
        assert_eq!(indexed, vec![row("a", "p3", 5_000), row("a", "p5", 6_000), row("b", "p1", 1_000)]);
        let wtx = store.db.begin_write().unwrap();
        assert_eq!(sweep(&wtx, "a", 2_000).unwrap(), 0, "nothing more is due");
        wtx.commit().unwrap();
    }

    /// A schema 8 store's tombstones (written with no index) are indexed when the file is
    /// opened by this build, damaged ones at time 0; `check` names a tombstone the index lacks.
    #[test]
    fn tombstones_of_a_schema_8_store_are_indexed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        {
            let store = Store::open(&path).unwrap();
            let wtx = store.db.begin_write().unwrap();
            {
                let mut table = wtx.open_table(PARCEL_TOMBSTONES).unwrap();
                table.insert(("a", "p1"), encode(&buried(2, 1_000)).as_slice()).unwrap();
                table.insert(("a", "p2"), encode(&buried(2, 9_000)).as_slice()).unwrap();
                table.insert(("a", "p3"), [7u8, 1].as_slice()).unwrap();
            }
            wtx.commit().unwrap();
            let report = store.check_consistency().unwrap();
            let all = report.problems.join("\n");
            assert!(all.contains("tombstone a/p1 has no row in parcel_tombstone_ages"), "{all}");
            assert!(all.contains("tombstone a/p3: "), "{all}");
            // As a schema 8 file has it (a backup taken before the upgrade): no index at all,
            // which `check` does not hold against it.
            let wtx = store.db.begin_write().unwrap();
            assert!(wtx.delete_table(PARCEL_TOMBSTONE_AGES).unwrap());
            wtx.commit().unwrap();
            let all = store.check_consistency().unwrap().problems.join("\n");
            assert!(!all.contains("parcel_tombstone_ages") && all.contains("tombstone a/p3: "), "{all}");
            store.force_schema_version(8).unwrap();
        }
        let store = Store::open(&path).unwrap();
        let (_, indexed) = rows(&store);
        assert_eq!(indexed, vec![row("a", "p3", 0), row("a", "p1", 1_000), row("a", "p2", 9_000)]);
        assert!(!store.check_consistency().unwrap().problems.iter().any(|p| p.contains("parcel_tombstone_ages")));
        let wtx = store.db.begin_write().unwrap();
        assert_eq!(sweep(&wtx, "a", 2_000).unwrap(), 2);
        wtx.commit().unwrap();
        assert_eq!(rows(&store), (vec![row("a", "p2", 9_000)], vec![row("a", "p2", 9_000)]));
    }
}
