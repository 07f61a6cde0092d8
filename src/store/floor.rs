//! What redb alone costs to write a source's snapshot: its blocks (`blocks.rs`) copied byte
//! for byte into a fresh scratch file in one durable transaction (with the store's commit
//! settings), with the time spent reading them left out.
//!
//! Why it exists: a baseline commit writes every parcel (its state and geometry, packed into
//! the snapshot's blocks) and nothing can make it cheaper than redb inserting those blocks.
//! The ingest bench prints this beside the baseline so a reader sees, measured in the same
//! run, how much of the baseline is the store's floor.
//!
//! What it leaves out, so it is a floor and not the baseline's whole store cost: the blocks
//! go in key order, finished (a baseline builds them from rows in the layer's order, merging
//! rows that do not sort like the features into blocks already written: the bench's
//! `DC-nnnnnn` ids stop doing so past 999,999), and the baseline's primed keys and their audit
//! rows are not written.

use super::blocks::for_each_block;
use super::tables::PARCEL_BLOCKS;
use super::{Store, StoreError, STORE_CACHE_BYTES};
use redb::{Database, ReadableDatabase};
use std::path::Path;
use std::time::{Duration, Instant};

/// Rows (blocks) copied per batch.
const BATCH: usize = 4096;

/// The measured floor.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteFloor {
    /// Parcels copied.
    pub parcels: u64,
    /// Rows written: the source's snapshot blocks (`blocks.rs`), up to 32 parcels each.
    pub rows: u64,
    /// Time in redb's inserts.
    pub insert: Duration,
    /// Time in the durable commit.
    pub commit: Duration,
}

impl Store {
    /// Copies `source_id`'s snapshot into a new redb file at `scratch` (refused if something
    /// is there; the file is left for the caller to remove): its blocks as stored, byte for
    /// byte, in key order and in batches, one durable commit with the store's settings
    /// (quick-repair). Returns the time redb took. A run also decodes, merges and encodes
    /// blocks, and a layer not in id order leaves them part-full; this is only redb's part.
    pub fn snapshot_write_floor(&self, source_id: &str, scratch: &Path) -> Result<WriteFloor, StoreError> {
        if scratch.exists() {
            return Err(StoreError::Conflict(format!("{} exists; the floor is measured in a new file", scratch.display())));
        }
        let db = Database::builder().set_cache_size(STORE_CACHE_BYTES).create(scratch).map_err(|e| StoreError::Open {
            path: scratch.to_path_buf(),
            message: e.to_string(),
        })?;
        let rtx = self.db.begin_read()?;
        let mut wtx = db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut floor = WriteFloor::default();
        {
            let mut out = wtx.open_table(PARCEL_BLOCKS)?;
            let mut batch: Vec<(String, Vec<u8>)> = Vec::with_capacity(BATCH);
            for_each_block(&rtx.open_table(PARCEL_BLOCKS)?, source_id, |key, bytes, entries| {
                floor.parcels += entries.len() as u64;
                batch.push((key.to_string(), bytes.to_vec()));
                if batch.len() == BATCH {
                    insert_timed(&mut out, source_id, &mut batch, &mut floor)?;
                }
                Ok(())
            })?;
            insert_timed(&mut out, source_id, &mut batch, &mut floor)?;
        }
        let t = Instant::now();
        wtx.commit()?;
        floor.commit = t.elapsed();
        Ok(floor)
    }
}

/// Inserts a batch of copied rows (and empties it), timing only the inserts.
fn insert_timed(
    out: &mut redb::Table<(&'static str, &'static str), &'static [u8]>,
    source_id: &str,
    batch: &mut Vec<(String, Vec<u8>)>,
    floor: &mut WriteFloor,
) -> Result<(), StoreError> {
    let t = Instant::now();
    for (id, record) in batch.iter() {
        out.insert((source_id, id.as_str()), record.as_slice())?;
    }
    floor.insert += t.elapsed();
    floor.rows += batch.len() as u64;
    batch.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;
    use crate::store::CommitMode;

    /// Every parcel of the source, and only that source's, is copied.
    #[test]
    fn copies_one_sources_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let state = ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 1.0, revision: 0, announced: None };
        let geometry = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
        for (source, n) in [("a", 5000), ("b", 7)] {
            let parcels: Vec<Parcel> = (0..n).map(|i| Parcel { id: format!("p{i}"), state: state.clone(), geometry: geometry.clone() }).collect();
            let mut w = store.begin_run(source, CommitMode::Baseline, Watermark::default(), 1, 1_000).unwrap();
            w.upserts(parcels.iter().map(Parcel::borrowed)).unwrap();
            w.finish(1, 1, RunCounts::default(), vec![]).unwrap();
        }
        let floor = store.snapshot_write_floor("a", &dir.path().join("floor.redb")).unwrap();
        assert_eq!(floor.parcels, 5000);
        assert!(store.snapshot_write_floor("a", &dir.path().join("floor.redb")).is_err(), "an existing file is refused");
        let copy = Store::open(&dir.path().join("floor.redb")).unwrap();
        assert_eq!(copy.snapshot_states("a").unwrap().len(), 5000);
        assert!(copy.snapshot_states("b").unwrap().is_empty());
        assert_eq!(copy.parcel_geometries("a", ["p4999"]).unwrap()["p4999"], geometry);
    }
}
