//! A run's snapshot rows put in key order before they are written, in bounded memory: rows
//! are gathered into runs of up to [`RUN_ROWS`] rows or [`RUN_BYTES`], each run sorted and
//! (when there is more than one) written to an anonymous temporary file next to the store,
//! and the runs merged back (one open file per run: ~900 for 60M rows).
//!
//! Why it exists: redb inserts rows in key order several times faster than in any other
//! order. A county's layer rarely lists its parcels in id order: measured with redb alone
//! (issue 7, when a parcel was two rows), 1M parcels' rows took 1.7 s to insert and commit in
//! key order and 7.9 s in a shuffled order; 2.5M took 4.4 s and 23.7 s. Since the snapshot is
//! stored in blocks (`store/blocks.rs`), rows in key order also fill a block at a time, where
//! rows in any order would rewrite a block for every few rows.

use crate::store::SnapshotRow;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Rows sorted in memory at a time (~250 bytes each for a county's lots: ~16 MiB)...
pub const RUN_ROWS: usize = 65_536;
/// ...or fewer, when their bytes (with ~100 bytes of bookkeeping a row) reach this first:
/// parcels with many vertices.
pub const RUN_BYTES: usize = 32 << 20;

/// Errors of the sort's temporary files (disk full, unreadable temp dir).
#[derive(Debug, thiserror::Error)]
pub enum RowSortError {
    #[error("sorting snapshot rows: {0}")]
    Io(std::io::Error),
    #[error("sorting snapshot rows: a run file is damaged")]
    Damaged,
}

impl From<std::io::Error> for RowSortError {
    /// Notes a file-size limit met by a run file beside the store (`store::note_io_error`).
    fn from(e: std::io::Error) -> RowSortError {
        crate::store::note_io_error(&e);
        RowSortError::Io(e)
    }
}

/// Gathers rows (in any order) and gives them back in key order.
pub struct RowSorter {
    dir: PathBuf,
    run: Vec<SnapshotRow>,
    run_bytes: usize,
    /// Run files with the number of rows each holds (checked when merging).
    runs: Vec<(File, u64)>,
    run_rows: usize,
}

impl RowSorter {
    /// A sorter whose run files (if it needs any) go in `dir`.
    pub fn new(dir: &Path) -> RowSorter {
        RowSorter::with_run_rows(dir, RUN_ROWS)
    }

    /// With a chosen run size (tests use small runs to exercise the merge).
    pub fn with_run_rows(dir: &Path, run_rows: usize) -> RowSorter {
        RowSorter { dir: dir.to_path_buf(), run: Vec::new(), run_bytes: 0, runs: Vec::new(), run_rows: run_rows.max(1) }
    }

    /// Rows to sort, in any order.
    pub fn push(&mut self, rows: Vec<SnapshotRow>) -> Result<(), RowSortError> {
        for r in rows {
            self.run_bytes += r.id.len() + r.record.len() + 100;
            self.run.push(r);
            if self.run.len() >= self.run_rows || self.run_bytes >= RUN_BYTES {
                self.write_run()?;
            }
        }
        Ok(())
    }

    fn write_run(&mut self) -> Result<(), RowSortError> {
        self.run.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let mut out = BufWriter::with_capacity(1 << 20, tempfile::tempfile_in(&self.dir)?);
        let rows = self.run.len() as u64;
        self.run_bytes = 0;
        for r in self.run.drain(..) {
            for part in [r.id.as_bytes(), &r.record] {
                let len = u32::try_from(part.len()).map_err(|_| std::io::Error::other("row part larger than 4 GiB"))?;
                out.write_all(&len.to_le_bytes())?;
                out.write_all(part)?;
            }
        }
        let mut file = out.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        self.runs.push((file, rows));
        Ok(())
    }

    /// The rows in key order, `chunk` at a time.
    pub fn finish(mut self, chunk: usize) -> Result<SortedRows, RowSortError> {
        let chunk = chunk.max(1);
        if self.runs.is_empty() {
            self.run.sort_unstable_by(|a, b| a.id.cmp(&b.id));
            return Ok(SortedRows { source: Source::Memory(self.run.into_iter()), chunk });
        }
        if !self.run.is_empty() {
            self.write_run()?;
        }
        let mut readers = Vec::with_capacity(self.runs.len());
        let mut heap = BinaryHeap::with_capacity(self.runs.len());
        for (i, (file, rows)) in self.runs.into_iter().enumerate() {
            let mut reader = RunReader { input: BufReader::with_capacity(64 * 1024, file), left: rows };
            if let Some(row) = reader.next_row()? {
                heap.push(Reverse(Head { row, run: i }));
            }
            readers.push(reader);
        }
        Ok(SortedRows { source: Source::Merge { readers, heap }, chunk })
    }
}

/// Row parts up to this size are read into a buffer allocated at their stated length (a
/// damaged length costs at most this much); longer ones grow as they are read. A read to
/// the end through `take` costs an extra probing read per part, two per row.
const EXACT_READ_MAX: u64 = 1 << 20;

/// One run file being merged, with the rows it still holds.
struct RunReader {
    input: BufReader<File>,
    left: u64,
}

impl RunReader {
    /// The next row, or None once the run's rows are all read (a file that ends early, or
    /// holds more than it should, is `Damaged`).
    fn next_row(&mut self) -> Result<Option<SnapshotRow>, RowSortError> {
        if self.left == 0 {
            let mut probe = [0u8; 1];
            return match self.input.read(&mut probe)? {
                0 => Ok(None),
                _ => Err(RowSortError::Damaged),
            };
        }
        let damaged = |e: std::io::Error| if e.kind() == std::io::ErrorKind::UnexpectedEof { RowSortError::Damaged } else { e.into() };
        let mut parts: [Vec<u8>; 2] = Default::default();
        for part in parts.iter_mut() {
            let mut len = [0u8; 4];
            self.input.read_exact(&mut len).map_err(damaged)?;
            let len = u32::from_le_bytes(len) as u64;
            if len <= EXACT_READ_MAX {
                // The common case, read in one call into a buffer of the right size.
                part.resize(len as usize, 0);
                self.input.read_exact(part).map_err(damaged)?;
            } else {
                // Read through `take`, so a damaged length cannot make it allocate gigabytes.
                (&mut self.input).take(len).read_to_end(part)?;
                if part.len() as u64 != len {
                    return Err(RowSortError::Damaged);
                }
            }
        }
        self.left -= 1;
        let [id, record] = parts;
        let id = String::from_utf8(id).map_err(|_| RowSortError::Damaged)?;
        Ok(Some(SnapshotRow { id, record }))
    }
}

/// A run's smallest unread row, ordered by key (then run, so equal keys keep run order).
struct Head {
    row: SnapshotRow,
    run: usize,
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.row.id == other.row.id && self.run == other.run
    }
}
impl Eq for Head {}
impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Head {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.row.id.cmp(&other.row.id).then(self.run.cmp(&other.run))
    }
}

enum Source {
    Memory(std::vec::IntoIter<SnapshotRow>),
    Merge { readers: Vec<RunReader>, heap: BinaryHeap<Reverse<Head>> },
}

/// The sorted rows, read back a chunk at a time.
pub struct SortedRows {
    source: Source,
    chunk: usize,
}

impl SortedRows {
    /// The next chunk in key order (empty at the end).
    pub fn next_chunk(&mut self) -> Result<Vec<SnapshotRow>, RowSortError> {
        let mut out = Vec::with_capacity(self.chunk.min(4096));
        match &mut self.source {
            Source::Memory(rows) => out.extend(rows.by_ref().take(self.chunk)),
            Source::Merge { readers, heap } => {
                while out.len() < self.chunk {
                    let Some(Reverse(Head { row, run })) = heap.pop() else { break };
                    if let Some(next) = readers[run].next_row()? {
                        heap.push(Reverse(Head { row: next, run }));
                    }
                    out.push(row);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> SnapshotRow {
        SnapshotRow { id: id.to_string(), record: [id.as_bytes(), &[id.len() as u8; 3]].concat() }
    }

    /// Whatever the run size (one run in memory, or 5 or 52 merged from files), every row comes
    /// back once, in key order, with its bytes.
    #[test]
    fn rows_come_back_in_key_order_in_memory_and_merged() {
        let dir = tempfile::tempdir().unwrap();
        // A shuffled order (a permutation), ids of varied length (string order, not numeric).
        let ids: Vec<String> = (0..5_000u64).map(|i| format!("P-{}", (i * 7_919) % 5_000)).collect();
        let mut want = ids.clone();
        want.sort();
        for run_rows in [RUN_ROWS, 1_000, 97] {
            let mut s = RowSorter::with_run_rows(dir.path(), run_rows);
            for part in ids.chunks(333) {
                s.push(part.iter().map(|i| row(i)).collect()).unwrap();
            }
            let mut sorted = s.finish(500).unwrap();
            let mut got = Vec::new();
            loop {
                let c = sorted.next_chunk().unwrap();
                if c.is_empty() {
                    break;
                }
                assert!(c.len() <= 500);
                for r in c {
                    assert_eq!(r.record, [r.id.as_bytes(), &[r.id.len() as u8; 3][..]].concat());
                    got.push(r.id);
                }
            }
            assert_eq!(got, want, "run size {run_rows}");
        }
        let empty = RowSorter::new(dir.path()).finish(10).unwrap().next_chunk().unwrap();
        assert!(empty.is_empty());
    }

    /// A run file that lost its last row (cut at a row boundary) is reported, not merged
    /// as if complete.
    #[test]
    fn a_run_file_cut_short_is_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = RowSorter::with_run_rows(dir.path(), 3);
        s.push(["c", "a", "b", "f", "e", "d"].iter().map(|i| row(i)).collect()).unwrap();
        let (file, rows) = &s.runs[0];
        assert_eq!(*rows, 3);
        // Each row of this run is 2 × 4 length bytes + a 1-byte id + a 4-byte record: cut
        // after its second row.
        file.set_len(2 * 13).unwrap();
        let mut sorted = s.finish(100).unwrap();
        assert!(matches!(sorted.next_chunk(), Err(RowSortError::Damaged)));
    }

    /// Records longer than the exact-read limit merge back whole; a run file whose long
    /// record was cut short, or whose record is cut mid-way, is damaged, on either read path.
    #[test]
    fn long_records_merge_and_cut_records_are_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let long = |id: &str, n: usize| SnapshotRow { id: id.to_string(), record: vec![id.as_bytes()[0]; n] };
        let big = EXACT_READ_MAX as usize + 5;
        let mut s = RowSorter::with_run_rows(dir.path(), 2);
        s.push(vec![long("b", big), long("a", 7), long("d", 9), long("c", big)]).unwrap();
        let got = s.finish(10).unwrap().next_chunk().unwrap();
        assert_eq!(got, vec![long("a", 7), long("b", big), long("c", big), long("d", 9)]);

        for (cut_long, keep) in [(true, 2 * 4 + 1 + big as u64 / 2), (false, 2 * 4 + 1 + 3)] {
            let mut s = RowSorter::with_run_rows(dir.path(), 2);
            s.push(if cut_long { vec![long("b", big), long("a", 7)] } else { vec![long("b", 9), long("a", 7)] }).unwrap();
            s.push(vec![long("x", 5)]).unwrap();
            // The first run's first row is "a" (7 bytes) when the other is long: cut its
            // second row, or cut "a" itself mid-record.
            let cut = if cut_long { 2 * 4 + 1 + 7 + keep } else { keep };
            s.runs[0].0.set_len(cut).unwrap();
            // The merge reads each run's first row as it starts.
            let merged = s.finish(10).and_then(|mut sorted| sorted.next_chunk());
            assert!(matches!(merged, Err(RowSortError::Damaged)), "cut_long {cut_long}");
        }
    }

    /// A run that cannot be written (its folder is gone) is the sort's error, from `push`
    /// or `finish`, whichever comes first.
    #[test]
    fn a_run_that_cannot_be_written_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone");
        for rows in [2usize, 9] {
            let mut s = RowSorter::with_run_rows(&gone, 2);
            let pushed = s.push((0..rows).map(|i| row(&format!("r{i}"))).collect());
            let err = match pushed {
                Err(e) => e,
                Ok(()) => s.finish(10).err().expect("a sort whose runs cannot be written fails"),
            };
            match err {
                RowSortError::Io(e) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{rows} rows: {e}"),
                other => panic!("{rows} rows: {other}"),
            }
        }
    }

    /// A run file whose part says it is ~4 GiB long but holds a few bytes is damaged. (Such
    /// a length is over the exact-read limit, so it is read through `take`, which grows the
    /// buffer as bytes arrive; this test checks the outcome, not the allocation.)
    #[test]
    fn a_lying_part_length_is_damaged_not_allocated() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = tempfile::tempfile_in(dir.path()).unwrap();
        file.write_all(&(u32::MAX - 7).to_le_bytes()).unwrap();
        file.write_all(b"short").unwrap();
        file.seek(SeekFrom::Start(0)).unwrap();
        let mut s = RowSorter::with_run_rows(dir.path(), 2);
        s.runs.push((file, 1));
        assert!(matches!(s.finish(10).and_then(|mut sorted| sorted.next_chunk()), Err(RowSortError::Damaged)));
    }
}
