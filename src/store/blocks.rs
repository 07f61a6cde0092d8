//! The parcel snapshot on disk: a source's parcels in id order, packed up to 32 to a redb
//! row (a *block*) in `parcel_blocks`, keyed by (source id, the block's first parcel id).
//!
//! Why blocks and not a row per parcel (schema 6): redb's cost is mostly per row (a tree
//! descent, key comparisons and a leaf rebuilt per insert), not per byte, and a county's
//! first ingest writes every parcel. Measured with redb alone (1M parcels of 176 bytes, key
//! order, one durable transaction): a row each 1.23–1.35 s of inserts and 0.30–0.34 s of
//! commit; 16 a row 0.63 + 0.38 s; 32 a row 0.49–0.50 + 0.30–0.32 s. What a block costs
//! back: a changed parcel rewrites its block (up to [`BLOCK_MAX_BYTES`]) where a row per parcel
//! rewrote one row (redb rewrote that row's whole 4 KiB leaf page, though), and a look-up
//! decodes the block's list of entries. Both measured in docs/PERFORMANCE.md (section 1,
//! fifteenth session).
//!
//! The invariants every write keeps (tested against a model below, and read back by the
//! scans, which refuse a block that breaks them):
//! - a block is never empty, its entries are in strictly ascending id order, and its key is
//!   its first entry's id;
//! - a source's blocks partition its ids: every entry of a block sorts before the next
//!   block's key;
//! - a block holds at most [`BLOCK_MAX_PARCELS`] parcels and, unless it holds one parcel,
//!   at most [`BLOCK_MAX_BYTES`] of them.
//!
//! An entry's record is a snapshot record (`snapshot.rs`: version byte, state, geometry);
//! nothing here looks inside it. A block is `[RECORD_VERSION] ++ postcard(Vec<(&str,
//! &[u8])>)`: the entry count, then each id and record, length-prefixed.

use super::codec::{split_version, unknown_version, RECORD_VERSION};
use super::runs::codec_err;
use super::snapshot::record_parts;
use super::tables::{LEGACY_PARCELS, LEGACY_PARCEL_GEOMS, LEGACY_PARCEL_ROWS, META, META_COMPACT_PENDING, PARCEL_BLOCKS};
use super::StoreError;
use redb::{ReadableTable, TableHandle, WriteTransaction};
use serde::ser::{Serialize, SerializeSeq, Serializer};
use std::collections::VecDeque;
use std::ops::Bound;

/// Parcels a block holds at most. 32 took 60% off redb's insert time against one row each
/// (above, 176-byte values); more gains little and makes a changed parcel rewrite more.
/// Parcels of that size fill a block's bytes ([`BLOCK_MAX_BYTES`]) at about 20.
pub const BLOCK_MAX_PARCELS: usize = 32;

/// Bytes of entries a block holds at most (ids, records and their length prefixes), unless it
/// holds a single parcel: a block then fits one of redb's 4 KiB pages with its key and the
/// leaf's header. Measured at 1M parcels (`zonewatch bench --only ingest`): with 8 KiB
/// blocks redb wrote the baseline's in 0.53–0.58 s + 0.28–0.34 s of commit and a re-publish
/// peaked at 140–144 MiB; with blocks that fit a page, 0.45–0.47 s + 0.25–0.27 s and
/// 119–131 MiB (a row per parcel: 113–118 MiB). Real parcels with many vertices fill a block
/// before 32 do; a changed parcel rewrites at most this much of its neighbours.
pub const BLOCK_MAX_BYTES: usize = 3800;

/// The table name a block decoding error reports.
const TABLE: &str = "parcel_blocks";

/// A snapshot table as a read or a write transaction opens it.
pub(super) trait BlockTable: ReadableTable<(&'static str, &'static str), &'static [u8]> {}
impl<T: ReadableTable<(&'static str, &'static str), &'static [u8]>> BlockTable for T {}

/// The snapshot table as a write transaction opens it.
pub(super) type BlockTableMut<'t> = redb::Table<'t, (&'static str, &'static str), &'static [u8]>;

/// One parcel of a block: its id and its snapshot record.
pub(super) type Entry<'a> = (&'a str, &'a [u8]);

/// A change to one parcel: its new snapshot record, or `None` for a parcel gone.
pub(super) type Change<'a> = (&'a str, Option<&'a [u8]>);

/// Bytes are written as postcard writes a byte string (length, then the bytes), not as a
/// sequence of numbers one at a time.
struct Bytes<'a>(&'a [u8]);

impl Serialize for Bytes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// A block's entries as they are written.
struct Entries<'e, 'a>(&'e [Entry<'a>]);

impl Serialize for Entries<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for (id, record) in self.0 {
            seq.serialize_element(&(id, Bytes(record)))?;
        }
        seq.end()
    }
}

/// Encodes `entries` as one block into `out` (cleared first).
pub(super) fn encode_block(entries: &[Entry<'_>], out: &mut Vec<u8>) -> Result<(), StoreError> {
    out.clear();
    out.push(RECORD_VERSION);
    // postcard fails only on what serde cannot describe; strings and byte strings it can.
    *out = postcard::to_extend(&Entries(entries), std::mem::take(out)).map_err(|e| codec_err(TABLE, e.to_string()))?;
    Ok(())
}

/// A block's entries, borrowed from its bytes; an error if the bytes are not a block that
/// keeps the invariants (empty, out of order, an unknown version, cut short or running on).
pub(super) fn decode_block(bytes: &[u8]) -> Result<Vec<Entry<'_>>, String> {
    let rest = match split_version(bytes)? {
        (RECORD_VERSION, rest) => rest,
        (v, _) => return Err(unknown_version(v, "parcel blocks", RECORD_VERSION)),
    };
    let (entries, after): (Vec<Entry<'_>>, &[u8]) = postcard::take_from_bytes(rest).map_err(|e| e.to_string())?;
    if !after.is_empty() {
        return Err(format!("{} bytes after the last parcel", after.len()));
    }
    if entries.is_empty() {
        return Err("an empty block".into());
    }
    if let Some(pair) = entries.windows(2).find(|w| w[0].0 >= w[1].0) {
        return Err(format!("parcel {:?} is not before {:?} in its block", pair[0].0, pair[1].0));
    }
    Ok(entries)
}

/// [`decode_block`], checking that the block is stored under its first id, as a store error.
fn entries_of<'a>(key: &str, bytes: &'a [u8]) -> Result<Vec<Entry<'a>>, StoreError> {
    let entries = decode_block(bytes).map_err(|m| codec_err(TABLE, format!("block {key:?}: {m}")))?;
    if entries[0].0 != key {
        return Err(codec_err(TABLE, format!("block {key:?} starts with parcel {:?}", entries[0].0)));
    }
    Ok(entries)
}

/// Checks that a block comes after the one read before it: its key after that block's last
/// parcel (`last`, which it then becomes). Scans read a source's blocks in key order, so this
/// is what keeps them from handing out a parcel twice or out of order from a damaged file.
fn check_follows(last: &mut String, key: &str, entries: &[Entry<'_>]) -> Result<(), StoreError> {
    // Empty: no block read yet. A block that ends with the id "" holds only that parcel,
    // and every key after it sorts after "", so the test below cannot miss an overlap.
    if !last.is_empty() && key <= last.as_str() {
        return Err(codec_err(TABLE, format!("block {key:?} overlaps the block before it (which ends with parcel {last:?})")));
    }
    last.clear();
    last.push_str(entries[entries.len() - 1].0);
    Ok(())
}

/// Calls `each` with the key, the stored bytes and the entries of every block of
/// `source_id`, in key order, each checked ([`entries_of`], [`check_follows`]). Stops at the
/// first error.
pub(super) fn for_each_block<T: BlockTable>(
    table: &T,
    source_id: &str,
    mut each: impl FnMut(&str, &[u8], Vec<Entry<'_>>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut last = String::new();
    for item in table.range((source_id, "")..)? {
        let (k, v) = item?;
        let (s, key) = k.value();
        if s != source_id {
            break;
        }
        let entries = entries_of(key, v.value())?;
        check_follows(&mut last, key, &entries)?;
        each(key, v.value(), entries)?;
    }
    Ok(())
}

/// Calls `each` with the id and record of every parcel of `source_id`, in id order; returns
/// how many there were. Stops at the first error.
pub(super) fn for_each_parcel<T: BlockTable>(
    table: &T,
    source_id: &str,
    mut each: impl FnMut(&str, &[u8]) -> Result<(), StoreError>,
) -> Result<u64, StoreError> {
    let mut n = 0;
    for_each_block(table, source_id, |_, _, entries| {
        for (id, record) in entries {
            each(id, record)?;
            n += 1;
        }
        Ok(())
    })?;
    Ok(n)
}

/// Reads every block of every source, for `zonewatch check --store`: each block must decode
/// and keep the invariants, follow the source's previous block without overlapping it, and
/// hold records whose state decodes. Calls `problem` once per block that does not (and goes
/// on); returns how many parcels the readable blocks hold.
pub(super) fn check_all<T: BlockTable>(table: &T, mut problem: impl FnMut(String)) -> Result<u64, StoreError> {
    let mut parcels = 0;
    let mut source = String::new();
    let mut last = String::new();
    for item in table.iter()? {
        let (k, v) = item?;
        let (s, key) = k.value();
        if s != source {
            s.clone_into(&mut source);
            last.clear();
        }
        let checked = entries_of(key, v.value()).and_then(|entries| {
            check_follows(&mut last, key, &entries)?;
            for (id, record) in &entries {
                super::snapshot::decode_hash_ref(record).map_err(|m| codec_err(TABLE, format!("parcel {id:?}: {m}")))?;
            }
            Ok(entries.len() as u64)
        });
        match checked {
            Ok(n) => parcels += n,
            Err(e) => problem(format!("snapshot of {s}: {e}")),
        }
    }
    Ok(parcels)
}

/// Calls `f` with the record of one parcel, if the source has it.
pub(super) fn with_record<T: BlockTable, R>(
    table: &T,
    source_id: &str,
    parcel_id: &str,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<Option<R>, StoreError> {
    // The parcel's block, if it has one, is the last whose key is not after its id.
    let Some(item) = table.range((source_id, "")..=(source_id, parcel_id))?.next_back() else {
        return Ok(None);
    };
    let (k, v) = item?;
    let entries = entries_of(k.value().1, v.value())?;
    Ok(entries.binary_search_by(|(id, _)| (*id).cmp(parcel_id)).ok().map(|i| f(entries[i].1)))
}

/// A source's parcels read in id order with one parcel of look-ahead (a derived run merges
/// several sources by smallest id). A block at a time is decoded and copied out.
pub(super) struct ParcelRows<'t> {
    range: redb::Range<'t, (&'static str, &'static str), &'static [u8]>,
    source_id: &'t str,
    /// What is left of the block being read.
    block: VecDeque<(String, Vec<u8>)>,
    /// The last parcel id of the blocks read so far.
    last: String,
    /// The source's blocks are all read.
    done: bool,
}

impl<'t> ParcelRows<'t> {
    pub(super) fn new<T: BlockTable>(table: &'t T, source_id: &'t str) -> Result<ParcelRows<'t>, StoreError> {
        let mut rows = ParcelRows { range: table.range((source_id, "")..)?, source_id, block: VecDeque::new(), last: String::new(), done: false };
        rows.fill()?;
        Ok(rows)
    }

    /// Reads the next block when the one being read is used up.
    fn fill(&mut self) -> Result<(), StoreError> {
        while self.block.is_empty() && !self.done {
            match self.range.next().transpose()? {
                Some((k, v)) if k.value().0 == self.source_id => {
                    let entries = entries_of(k.value().1, v.value())?;
                    check_follows(&mut self.last, k.value().1, &entries)?;
                    self.block.extend(entries.into_iter().map(|(id, record)| (id.to_string(), record.to_vec())));
                }
                // The next source's blocks, or the end of the table.
                _ => self.done = true,
            }
        }
        Ok(())
    }

    /// The next parcel's id (`None` past the source's last).
    pub(super) fn next_id(&self) -> Option<&str> {
        self.block.front().map(|(id, _)| id.as_str())
    }

    /// The next parcel's id and record, reading ahead.
    pub(super) fn take(&mut self) -> Result<Option<(String, Vec<u8>)>, StoreError> {
        let row = self.block.pop_front();
        self.fill()?;
        Ok(row)
    }
}

/// Bytes an entry takes in a block, near enough (its two length prefixes counted as 2 bytes
/// each; a block's limit is a target, not a page size).
fn entry_bytes((id, record): &Entry<'_>) -> usize {
    id.len() + record.len() + 4
}

/// Cuts entries in id order into blocks that keep the limits: as few as the limits allow,
/// with the entries spread evenly over them, so a block split by one insert leaves two
/// half-full blocks (room for the next inserts) and a baseline's blocks are full.
fn pieces<'e, 'a>(entries: &'e [Entry<'a>]) -> Vec<&'e [Entry<'a>]> {
    let bytes: usize = entries.iter().map(entry_bytes).sum();
    let count = entries.len().div_ceil(BLOCK_MAX_PARCELS).max(bytes.div_ceil(BLOCK_MAX_BYTES)).max(1);
    let per_block = entries.len().div_ceil(count).max(1);
    let mut out = Vec::with_capacity(count);
    let mut start = 0;
    while start < entries.len() {
        let mut end = start;
        let mut used = 0;
        while end < entries.len() && end - start < per_block {
            let b = entry_bytes(&entries[end]);
            if end > start && used + b > BLOCK_MAX_BYTES {
                break;
            }
            used += b;
            end += 1;
        }
        out.push(&entries[start..end]);
        start = end;
    }
    out
}

/// Applies `changes` to a source's blocks. Changes may come in any order; for a parcel
/// changed twice the later change counts. Each block a change falls in is read, merged with
/// every change that falls in it, and written again (split when it outgrows the limits,
/// removed when emptied, stored again under its new first id when that moved); a block the
/// changes leave as it was is not written. An insert that would replace a block other than
/// the one being written (the store's blocks overlapped already) is an error, not a loss.
pub(super) fn apply(
    table: &mut BlockTableMut<'_>,
    source_id: &str,
    changes: &mut Vec<Change<'_>>,
) -> Result<(), StoreError> {
    if !changes.is_sorted_by(|a, b| a.0 < b.0) {
        // Stable, so of a parcel changed twice the later change stays last and is kept.
        changes.sort_by(|a, b| a.0.cmp(b.0));
        let mut kept: Vec<Change<'_>> = Vec::with_capacity(changes.len());
        for c in changes.drain(..) {
            match kept.last_mut() {
                Some(last) if last.0 == c.0 => *last = c,
                _ => kept.push(c),
            }
        }
        *changes = kept;
    }
    let mut buf = Vec::new();
    let mut i = 0;
    // The block `changes[i]` falls in, when the last group found it.
    let mut known: Option<Option<String>> = None;
    while i < changes.len() {
        let id = changes[i].0;
        let target = match known.take() {
            Some(target) => target,
            None => target_key(table, source_id, id)?,
        };
        // The group of changes that fall in the same block. Most often (a few changes spread
        // over a county) the next change falls in another block, and its look-up is the one
        // the next group needs; only when it falls in the same one is the block after it
        // looked up (one more page read) to find where the group ends.
        let end = match changes.get(i + 1) {
            None => i + 1,
            Some(next) => {
                let next_target = target_key(table, source_id, next.0)?;
                if next_target == target {
                    let upper = match &target {
                        Some(key) => {
                            let mut after = table.range::<(&str, &str)>((Bound::Excluded((source_id, key.as_str())), Bound::Unbounded))?;
                            match after.next().transpose()? {
                                Some((k, _)) if k.value().0 == source_id => Some(k.value().1.to_string()),
                                _ => None,
                            }
                        }
                        None => None,
                    };
                    i + changes[i..].partition_point(|c| upper.as_deref().is_none_or(|u| c.0 < u))
                } else {
                    // Writing this group's block leaves every later block as it is: the
                    // look-up stays good for the next group.
                    known = Some(next_target);
                    i + 1
                }
            }
        };
        if end == i {
            // `upper` comes after the change's id by how it is found; were it not, the loop
            // would never move on.
            return Err(StoreError::Conflict(format!("parcel {id:?} of {source_id}: no snapshot block to write it to")));
        }
        let stored: Option<(String, Vec<u8>)> = match target {
            Some(key) => match table.get((source_id, key.as_str()))? {
                Some(v) => Some((key, v.value().to_vec())),
                None => return Err(StoreError::Conflict(format!("snapshot block {key:?} of {source_id} vanished while it was written"))),
            },
            None => None,
        };
        let old = match &stored {
            Some((key, bytes)) => entries_of(key, bytes)?,
            None => Vec::new(),
        };
        let mut merged = Vec::with_capacity(old.len() + (end - i));
        merge(&old, &changes[i..end], &mut merged);
        if merged != old {
            let blocks = pieces(&merged);
            if let Some((key, _)) = &stored {
                // An insert under the same key replaces the block; any other key leaves it.
                if blocks.first().is_none_or(|b| b[0].0 != key) {
                    table.remove((source_id, key.as_str()))?;
                }
            }
            for block in blocks {
                encode_block(block, &mut buf)?;
                let replaced = table.insert((source_id, block[0].0), buf.as_slice())?.is_some();
                if replaced && stored.as_ref().is_none_or(|(key, _)| key != block[0].0) {
                    return Err(StoreError::Conflict(format!(
                        "snapshot block {:?} of {source_id} would replace another block: the stored blocks overlap (zonewatch check --store names them)",
                        block[0].0
                    )));
                }
            }
        }
        i = end;
    }
    Ok(())
}

/// The key of the block a change to `parcel_id` falls in: the last block whose key is not
/// after the id, or the source's first block when the id comes before all of them (it then
/// becomes that block's first id); `None` when the source has no blocks.
fn target_key(table: &BlockTableMut<'_>, source_id: &str, parcel_id: &str) -> Result<Option<String>, StoreError> {
    if let Some(item) = table.range((source_id, "")..=(source_id, parcel_id))?.next_back() {
        return Ok(Some(item?.0.value().1.to_string()));
    }
    match table.range((source_id, "")..)?.next().transpose()? {
        Some((k, _)) if k.value().0 == source_id => Ok(Some(k.value().1.to_string())),
        _ => Ok(None),
    }
}

/// Merges a block's entries with the changes that fall in it (both in id order, the changes
/// without repeats) into `out`: a change replaces or removes its parcel's entry.
fn merge<'a>(old: &[Entry<'a>], changes: &[Change<'a>], out: &mut Vec<Entry<'a>>) {
    let (mut o, mut c) = (0, 0);
    while o < old.len() || c < changes.len() {
        let take_change = match (old.get(o), changes.get(c)) {
            (Some(e), Some(ch)) => ch.0 <= e.0,
            (None, Some(_)) => true,
            _ => false,
        };
        if take_change {
            let (id, record) = changes[c];
            if old.get(o).is_some_and(|e| e.0 == id) {
                o += 1;
            }
            if let Some(record) = record {
                out.push((id, record));
            }
            c += 1;
        } else {
            out.push(old[o]);
            o += 1;
        }
    }
}

/// Parcels of the older layouts, given in (source id, parcel id) order, written into blocks
/// through [`apply`] a chunk at a time: what both migrations into `parcel_blocks` write with
/// (schema 5's join of two tables, `snapshot::migrate_split_tables`, and schema 6's rows,
/// [`migrate_parcel_rows`]). Parcels in id order fill their blocks.
pub(super) struct BlockPacker {
    source: String,
    chunk: Vec<(String, Vec<u8>)>,
    /// Parcels written.
    parcels: u64,
}

/// Parcels a [`BlockPacker`] hands to [`apply`] at once.
const PACK_CHUNK: usize = 4096;

impl BlockPacker {
    pub(super) fn new() -> BlockPacker {
        BlockPacker { source: String::new(), chunk: Vec::with_capacity(PACK_CHUNK), parcels: 0 }
    }

    /// Adds one parcel (copied).
    pub(super) fn push(&mut self, out: &mut BlockTableMut<'_>, source_id: &str, parcel_id: &str, record: &[u8]) -> Result<(), StoreError> {
        if source_id != self.source || self.chunk.len() == PACK_CHUNK {
            self.flush(out)?;
            if source_id != self.source {
                source_id.clone_into(&mut self.source);
            }
        }
        self.chunk.push((parcel_id.to_string(), record.to_vec()));
        self.parcels += 1;
        Ok(())
    }

    /// Writes what is left; returns how many parcels were written in all.
    pub(super) fn finish(mut self, out: &mut BlockTableMut<'_>) -> Result<u64, StoreError> {
        self.flush(out)?;
        Ok(self.parcels)
    }

    fn flush(&mut self, out: &mut BlockTableMut<'_>) -> Result<(), StoreError> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let mut changes: Vec<Change<'_>> = self.chunk.iter().map(|(id, r)| (id.as_str(), Some(r.as_slice()))).collect();
        apply(out, &self.source, &mut changes)?;
        self.chunk.clear();
        Ok(())
    }
}

/// Refuses a file where more than one snapshot layout holds parcels: schema 5's two tables,
/// schema 6's rows, the blocks. No zonewatch writes one (an older build refuses a newer
/// file before writing); a damaged file or another tool could. The migrations would merge
/// the layouts silently, one winning over the other and parcels of one coming back, so the
/// open fails instead, before any of them runs, and keeps nothing.
pub(super) fn refuse_mixed_layouts(wtx: &WriteTransaction) -> Result<(), StoreError> {
    let present: Vec<String> = wtx.list_tables()?.map(|t| t.name().to_string()).collect();
    let holds = |def: redb::TableDefinition<(&str, &str), &[u8]>| -> Result<bool, StoreError> {
        if !present.iter().any(|n| n == def.name()) {
            return Ok(false);
        }
        Ok(wtx.open_table(def)?.iter()?.next().is_some())
    };
    let layouts = [
        ("schema 5's parcels / parcel_geoms", holds(LEGACY_PARCELS)? || holds(LEGACY_PARCEL_GEOMS)?),
        ("schema 6's parcel_snapshot", holds(LEGACY_PARCEL_ROWS)?),
        ("parcel_blocks", holds(PARCEL_BLOCKS)?),
    ];
    let found: Vec<&str> = layouts.iter().filter(|(_, has)| *has).map(|(name, _)| *name).collect();
    if found.len() > 1 {
        return Err(StoreError::Conflict(format!(
            "the store holds parcels in more than one snapshot layout ({}); zonewatch never writes a file so. Restore a backup (zonewatch restore)",
            found.join(", ")
        )));
    }
    Ok(())
}

/// Once per store of schema 6: the row per parcel of `parcel_snapshot` is packed into blocks
/// of `parcel_blocks`, each record's bytes copied, and the old table dropped. Runs inside the
/// opening transaction with the schema upgrade (both or neither); marks the file for
/// compaction when it moved any parcel. Returns how many it moved.
pub(super) fn migrate_parcel_rows(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    if !wtx.list_tables()?.any(|t| t.name() == LEGACY_PARCEL_ROWS.name()) {
        return Ok(0);
    }
    let moved = {
        let rows = wtx.open_table(LEGACY_PARCEL_ROWS)?;
        let mut out = wtx.open_table(PARCEL_BLOCKS)?;
        let mut packer = BlockPacker::new();
        for item in rows.iter()? {
            let (k, v) = item?;
            let (source, id) = k.value();
            // Copied, not decoded; but a record of a version this build cannot read fails the
            // upgrade (which then keeps nothing) rather than moving into a block unread.
            record_parts(v.value()).map_err(|m| codec_err("parcel_snapshot", format!("{source}/{id}: {m}")))?;
            packer.push(&mut out, source, id, v.value())?;
        }
        packer.finish(&mut out)?
    };
    wtx.delete_table(LEGACY_PARCEL_ROWS)?;
    if moved > 0 {
        // Every parcel was written again and the old table freed: the file is about twice
        // what it needs, until compacted (`Store::compact_after_upgrade`).
        wtx.open_table(META)?.insert(META_COMPACT_PENDING, [1u8].as_slice())?;
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use crate::synth::SplitMix64;
    use redb::ReadableDatabase;
    use std::collections::BTreeMap;

    /// A block as read back: (source, key, entries of (parcel id, record)).
    type BlockDump = (String, String, Vec<(String, Vec<u8>)>);

    /// One batch of changes: (parcel id, its new record or `None` to remove it).
    type ChangeBatch = Vec<(String, Option<Vec<u8>>)>;

    /// Every block of every source, as (source, key, entries), checked against the
    /// invariants of the module doc.
    fn blocks_of(store: &Store) -> Vec<BlockDump> {
        let rtx = store.db.begin_read().unwrap();
        let t = rtx.open_table(PARCEL_BLOCKS).unwrap();
        let mut out: Vec<BlockDump> = Vec::new();
        for item in t.iter().unwrap() {
            let (k, v) = item.unwrap();
            let (source, key) = k.value();
            let entries = entries_of(key, v.value()).unwrap();
            let bytes: usize = entries.iter().map(entry_bytes).sum();
            assert!(entries.len() <= BLOCK_MAX_PARCELS, "{source}/{key}: {} parcels", entries.len());
            assert!(entries.len() == 1 || bytes <= BLOCK_MAX_BYTES, "{source}/{key}: {bytes} bytes");
            if let Some((prev_source, _, prev)) = out.last() {
                if prev_source == source {
                    assert!(prev.last().unwrap().0.as_str() < key, "{source}: blocks overlap at {key}");
                }
            }
            out.push((source.to_string(), key.to_string(), entries.iter().map(|(i, r)| (i.to_string(), r.to_vec())).collect()));
        }
        out
    }

    fn apply_in_txn(store: &Store, source: &str, changes: &[(String, Option<Vec<u8>>)]) {
        let wtx = store.db.begin_write().unwrap();
        {
            let mut t = wtx.open_table(PARCEL_BLOCKS).unwrap();
            let mut c: Vec<Change<'_>> = changes.iter().map(|(id, r)| (id.as_str(), r.as_deref())).collect();
            apply(&mut t, source, &mut c).unwrap();
        }
        wtx.commit().unwrap();
    }

    /// Random batches of inserts, updates and removals (in random order, some parcels
    /// changed twice in a batch, records from a few bytes to past a block's byte limit, ids
    /// of two sources whose names extend each other) leave exactly what a map given the same
    /// changes holds, in blocks that keep every invariant, read back alike by the scan, the
    /// point look-up and the look-ahead reader.
    #[test]
    fn blocks_hold_what_a_map_holds_after_any_changes() {
        let mut rng = SplitMix64::new(7);
        for trial in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(&dir.path().join("z.redb")).unwrap();
            let mut model: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
            let universe = 1 + rng.below(400);
            for batch in 0..(1 + rng.below(8)) {
                for source in ["s", "s2"] {
                    let n = rng.below(if batch == 0 { 600 } else { 120 });
                    let mut changes: Vec<(String, Option<Vec<u8>>)> = Vec::new();
                    for _ in 0..n {
                        let id = format!("p{}", rng.below(universe));
                        let change = if rng.below(4) == 0 {
                            None
                        } else {
                            let len = match rng.below(20) { 0 => 9000 + rng.below(3000), 1 => 2000, _ => 1 + rng.below(200) };
                            Some(vec![(trial + batch) as u8; len])
                        };
                        changes.push((id, change));
                    }
                    if rng.below(2) == 0 {
                        // In id order, as a layer in id order and the row sort give them
                        // (stable: of a parcel changed twice the later change stays last).
                        changes.sort_by(|a, b| a.0.cmp(&b.0));
                    }
                    for (id, change) in &changes {
                        match change {
                            Some(r) => model.insert((source.to_string(), id.clone()), r.clone()),
                            None => model.remove(&(source.to_string(), id.clone())),
                        };
                    }
                    apply_in_txn(&store, source, &changes);
                }
                let stored: Vec<((String, String), Vec<u8>)> =
                    blocks_of(&store).into_iter().flat_map(|(s, _, e)| e.into_iter().map(move |(id, r)| ((s.clone(), id), r))).collect();
                let want: Vec<((String, String), Vec<u8>)> = model.clone().into_iter().collect();
                assert_eq!(stored, want, "trial {trial}, batch {batch}");
                let rtx = store.db.begin_read().unwrap();
                let t = rtx.open_table(PARCEL_BLOCKS).unwrap();
                for source in ["s", "s2"] {
                    let mut scanned = Vec::new();
                    for_each_parcel(&t, source, |id, r| {
                        scanned.push(((source.to_string(), id.to_string()), r.to_vec()));
                        Ok(())
                    })
                    .unwrap();
                    let of_source: Vec<_> = want.iter().filter(|((s, _), _)| s == source).cloned().collect();
                    assert_eq!(scanned, of_source, "scan, trial {trial}");
                    let mut rows = ParcelRows::new(&t, source).unwrap();
                    let mut read = Vec::new();
                    while let Some(id) = rows.next_id().map(str::to_string) {
                        let (taken, r) = rows.take().unwrap().unwrap();
                        assert_eq!(taken, id);
                        read.push(((source.to_string(), taken), r));
                    }
                    assert_eq!(read, of_source, "look-ahead reader, trial {trial}");
                    for probe in 0..universe + 1 {
                        let id = format!("p{probe}");
                        let got = with_record(&t, source, &id, |r| r.to_vec()).unwrap();
                        assert_eq!(got.as_ref(), model.get(&(source.to_string(), id.clone())), "look-up {source}/{id}");
                    }
                }
            }
        }
    }

    /// Each step below is one batch; after it the blocks hold what the model holds and keep
    /// every invariant: the edge cases the random batches reach only by chance.
    #[test]
    fn edge_cases_keep_the_blocks_whole() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let mut model: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
        let put = |ids: &[&str], byte: u8| -> ChangeBatch { ids.iter().map(|id| (id.to_string(), Some(vec![byte; 60]))).collect() };
        let del = |ids: &[&str]| -> ChangeBatch { ids.iter().map(|id| (id.to_string(), None)).collect() };
        let many: Vec<String> = (0..100).map(|i| format!("n{i:03}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let steps: Vec<(&str, &str, ChangeBatch)> = vec![
            // A source whose name extends another's has blocks; the shorter one has none yet:
            // its first change must not take the other's first block for its own.
            ("s2", "the longer-named source first", put(&["m", "p", "q"], 1)),
            ("s", "a source with no blocks, beside one that has some", put(&["m", "x"], 2)),
            ("s", "before the first block: it becomes the block's first id", put(&["a"], 3)),
            ("s", "the empty id", put(&[""], 4)),
            ("s", "a block's first parcel removed: the block is stored again under its next id", del(&["", "a"])),
            ("s", "one batch splitting a block into four", put(&many, 5)),
            ("s", "a removal of a parcel the source never had, before its first block", del(&["0"])),
            // "0" falls back to the first block and re-keys it; "n0505" falls in a later block,
            // found before that write and used after it.
            ("s", "before the first block and in a later one, in one batch", put(&["0", "n0505"], 7)),
            ("s", "a middle block emptied in one batch", Vec::new()),
            ("s", "the whole source emptied", Vec::new()),
            ("s2", "the other source kept whole throughout", put(&["m"], 6)),
        ];
        for (source, what, mut changes) in steps {
            let before = blocks_of(&store);
            if what == "a middle block emptied in one batch" {
                let of_s: Vec<_> = before.iter().filter(|b| b.0 == "s").collect();
                assert!(of_s.len() >= 3, "{what}: {} blocks", of_s.len());
                changes = of_s[1].2.iter().map(|(id, _)| (id.clone(), None)).collect();
            }
            if what == "the whole source emptied" {
                changes = model.keys().filter(|(s, _)| s == "s").map(|(_, id)| (id.clone(), None)).collect();
            }
            for (id, change) in &changes {
                match change {
                    Some(r) => model.insert((source.to_string(), id.clone()), r.clone()),
                    None => model.remove(&(source.to_string(), id.clone())),
                };
            }
            apply_in_txn(&store, source, &changes);
            let blocks = blocks_of(&store);
            let stored: Vec<((String, String), Vec<u8>)> =
                blocks.iter().flat_map(|(s, _, e)| e.iter().map(move |(id, r)| ((s.clone(), id.clone()), r.clone()))).collect();
            assert_eq!(stored, model.clone().into_iter().collect::<Vec<_>>(), "{what}");
            if what.starts_with("one batch splitting") {
                assert!(blocks.iter().filter(|b| b.0 == "s").count() >= 4, "{what}: {} blocks", blocks.len());
            }
            if what.starts_with("a block's first parcel removed") {
                assert!(blocks.iter().any(|b| b.0 == "s" && b.1 == "m"), "{what}: re-keyed under its next id");
            }
            if what == "before the first block and in a later one, in one batch" {
                assert!(blocks.iter().any(|b| b.0 == "s" && b.1 == "0") && !blocks.iter().any(|b| b.0 == "s" && b.1 == "m"), "{what}: re-keyed under \"0\"");
            }
            if what == "a middle block emptied in one batch" {
                let middle = &before.iter().filter(|b| b.0 == "s").nth(1).unwrap().1;
                assert!(!blocks.iter().any(|b| b.0 == "s" && &b.1 == middle), "{what}: its key is gone");
                assert_eq!(blocks.len() + 1, before.len(), "{what}: one block fewer, its neighbours kept");
            }
        }
        assert!(blocks_of(&store).iter().all(|b| b.0 == "s2"), "the emptied source left no block");
    }

    /// Two blocks of a source that overlap (a damaged file: no write makes them) are refused
    /// by both scans, not read as a parcel twice or out of order.
    #[test]
    fn overlapping_blocks_are_refused_by_the_scans() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        {
            let mut t = wtx.open_table(PARCEL_BLOCKS).unwrap();
            let mut buf = Vec::new();
            encode_block(&[("a", b"1"), ("c", b"3")], &mut buf).unwrap();
            t.insert(("s", "a"), buf.as_slice()).unwrap();
            encode_block(&[("b", b"2")], &mut buf).unwrap();
            t.insert(("s", "b"), buf.as_slice()).unwrap();
        }
        wtx.commit().unwrap();
        let rtx = store.db.begin_read().unwrap();
        let t = rtx.open_table(PARCEL_BLOCKS).unwrap();
        let err = for_each_parcel(&t, "s", |_, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        let mut rows = ParcelRows::new(&t, "s").unwrap();
        let mut outcome = Ok(None);
        while rows.next_id().is_some() {
            outcome = rows.take();
            if outcome.is_err() {
                break;
            }
        }
        assert!(outcome.unwrap_err().to_string().contains("overlaps"));
    }

    /// A baseline written in chunks in id order packs full blocks: none but the last holds
    /// fewer than the limit.
    #[test]
    fn a_baseline_in_order_fills_its_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let ids: Vec<String> = (0..10_000).map(|i| format!("{i:06}")).collect();
        for chunk in ids.chunks(4096) {
            // 32 of these fit the byte limit: the parcel limit is the one that binds.
            let changes: Vec<(String, Option<Vec<u8>>)> = chunk.iter().map(|id| (id.clone(), Some(vec![1u8; 100]))).collect();
            apply_in_txn(&store, "s", &changes);
        }
        let blocks = blocks_of(&store);
        assert_eq!(blocks.iter().map(|b| b.2.len()).sum::<usize>(), 10_000);
        assert_eq!(blocks.len(), 10_000usize.div_ceil(BLOCK_MAX_PARCELS), "full blocks");
    }

    /// A block that breaks an invariant is refused with an error naming it, not read wrong.
    #[test]
    fn a_broken_block_is_an_error() {
        let mut buf = Vec::new();
        encode_block(&[("a", b"1"), ("b", b"2")], &mut buf).unwrap();
        assert_eq!(decode_block(&buf).unwrap(), vec![("a", &b"1"[..]), ("b", &b"2"[..])]);
        assert!(decode_block(&[buf.as_slice(), &[0][..]].concat()).unwrap_err().contains("after the last parcel"), "runs on");
        assert!(entries_of("b", &buf).unwrap_err().to_string().contains("starts with parcel \"a\""));
        encode_block(&[("b", b"1"), ("a", b"2")], &mut buf).unwrap();
        assert!(decode_block(&buf).unwrap_err().contains("is not before"));
        encode_block(&[], &mut buf).unwrap();
        assert!(decode_block(&buf).unwrap_err().contains("empty"));
        encode_block(&[("a", b"1")], &mut buf).unwrap();
        assert!(decode_block(&buf[..buf.len() - 1]).is_err(), "cut short");
        buf[0] = 9;
        assert!(decode_block(&buf).unwrap_err().contains("version 9"));
    }

    /// The migration packs a schema 6 table's rows, source by source, into blocks that keep
    /// the invariants, and drops the table.
    #[test]
    fn rows_are_packed_into_blocks_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        let mut want = Vec::new();
        {
            let mut rows = wtx.open_table(LEGACY_PARCEL_ROWS).unwrap();
            for (source, n, len) in [("a", 70, 100), ("a2", 1, 5), ("b", 9, 5000)] {
                for i in 0..n {
                    let (id, mut record) = (format!("p{i:03}"), vec![i as u8; len]);
                    record[0] = RECORD_VERSION;
                    rows.insert((source, id.as_str()), record.as_slice()).unwrap();
                    want.push(((source.to_string(), id), record));
                }
            }
        }
        assert_eq!(migrate_parcel_rows(&wtx).unwrap(), 80);
        assert!(!wtx.list_tables().unwrap().any(|t| t.name() == LEGACY_PARCEL_ROWS.name()));
        assert!(wtx.open_table(META).unwrap().get(META_COMPACT_PENDING).unwrap().is_some());
        assert_eq!(migrate_parcel_rows(&wtx).unwrap(), 0, "once only");
        wtx.commit().unwrap();
        let blocks = blocks_of(&store);
        let got: Vec<((String, String), Vec<u8>)> =
            blocks.iter().flat_map(|(s, _, e)| e.iter().map(move |(id, r)| ((s.clone(), id.clone()), r.clone()))).collect();
        assert_eq!(got, want);
        assert_eq!(blocks.iter().filter(|b| b.0 == "a").count(), 3, "70 parcels in three blocks (24 + 24 + 22: spread evenly)");
        assert_eq!(blocks.iter().filter(|b| b.0 == "b").count(), 9, "5000-byte records: one a block");
    }
}
