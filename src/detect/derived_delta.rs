//! A derived (district / overlay) run's delta, on disk between the derive pass and the
//! commit. The derive pass reads the base a stretch at a time and must know the whole run's
//! counts before the gate decides how to commit it; keeping what it found here instead of in
//! `Vec`s is what lets a county's district run work in memory bounded by one stretch.
//!
//! Records are length-prefixed (u32 LE) postcard with a leading version byte, like the spill
//! of a parcel run. The file is anonymous, next to the store, and vanishes when dropped, also
//! on a crash.

use crate::model::{ChangeEvent, ParcelRef, ParcelState, StoredGeometry};
use super::spill::{frame_record, read_frame, FrameError};
use crate::store::SnapshotRow;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

const DELTA_VERSION: u8 = 1;

/// Errors of the delta file (disk full, unreadable temp dir, a damaged record).
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("derived delta file: {0}")]
    Io(std::io::Error),
    #[error("derived delta record: {0}")]
    Codec(String),
}

impl From<std::io::Error> for DeltaError {
    /// Notes a file-size limit met by the delta file beside the store (`store::note_io_error`).
    fn from(e: std::io::Error) -> DeltaError {
        crate::store::note_io_error(&e);
        DeltaError::Io(e)
    }
}

impl From<FrameError> for DeltaError {
    fn from(e: FrameError) -> DeltaError {
        match e {
            FrameError::Io(e) => DeltaError::Io(e),
            FrameError::Cut(m) => DeltaError::Codec(m),
        }
    }
}

/// One thing the commit must do.
#[derive(Debug, PartialEq)]
pub enum DeltaItem {
    /// A new or changed derived parcel, as its snapshot row: the commit writes these bytes
    /// as they are (a held run decodes them to stage the parcel).
    Upsert(SnapshotRow),
    /// A derived parcel gone with its base parcel.
    Removal(String),
    /// A change that alerts.
    Event(ChangeEvent),
    /// A parcel's new winning share.
    Share(String, f64),
}

/// A record as written, from borrowed parts. An upsert's state and geometry come last, so
/// that their encoding is the body of the parcel's snapshot row (see [`ItemHead`]).
#[derive(Serialize)]
enum DeltaItemRef<'a> {
    Upsert { id: &'a str, state: &'a ParcelState, geometry: &'a StoredGeometry },
    Removal(&'a str),
    Event(&'a ChangeEvent),
    Share(&'a str, f64),
}

/// A record read up to an upsert's body: the same variants in the same order as
/// [`DeltaItemRef`], an upsert's state and geometry left encoded after its id.
#[derive(Deserialize)]
enum ItemHead {
    Upsert { id: String },
    Removal(String),
    Event(ChangeEvent),
    Share(String, f64),
}

/// The writer side; [`DeltaFile::finish`] turns it into a reader.
pub struct DeltaFile {
    out: BufWriter<File>,
    buf: Vec<u8>,
    written: u64,
}

impl DeltaFile {
    /// A new anonymous delta file in `dir`.
    pub fn create(dir: &Path) -> Result<DeltaFile, DeltaError> {
        Ok(DeltaFile { out: BufWriter::with_capacity(1 << 20, tempfile::tempfile_in(dir)?), buf: Vec::with_capacity(512), written: 0 })
    }

    fn put(&mut self, item: &DeltaItemRef<'_>) -> Result<(), DeltaError> {
        self.buf.clear();
        frame_record(&mut self.buf, DELTA_VERSION, item).map_err(DeltaError::Codec)?;
        self.out.write_all(&self.buf)?;
        self.written += 1;
        Ok(())
    }

    /// Records written so far (the reader expects as many).
    pub fn written(&self) -> u64 {
        self.written
    }

    pub fn upsert(&mut self, p: ParcelRef<'_>) -> Result<(), DeltaError> {
        self.put(&DeltaItemRef::Upsert { id: p.id, state: p.state, geometry: p.geometry })
    }

    pub fn removal(&mut self, id: &str) -> Result<(), DeltaError> {
        self.put(&DeltaItemRef::Removal(id))
    }

    pub fn event(&mut self, e: &ChangeEvent) -> Result<(), DeltaError> {
        self.put(&DeltaItemRef::Event(e))
    }

    pub fn share(&mut self, id: &str, share: f64) -> Result<(), DeltaError> {
        self.put(&DeltaItemRef::Share(id, share))
    }

    /// Flushes and rewinds: the records can now be read back in the order written.
    pub fn finish(self) -> Result<DeltaReader, DeltaError> {
        let mut file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        Ok(DeltaReader { input: BufReader::with_capacity(1 << 20, file), buf: Vec::new(), read: 0, expected: self.written })
    }
}

/// Reads the delta back, in the order written.
pub struct DeltaReader {
    input: BufReader<File>,
    buf: Vec<u8>,
    read: u64,
    /// Records the writer wrote: a file that ends before as many were read is an error.
    expected: u64,
}

impl DeltaReader {
    /// The next record, or None at the end. A record cut short or of another version, and a
    /// file that ends (even between records) before every record written was read, are
    /// errors: the commit must fail whole rather than leave part of the delta out.
    pub fn next_item(&mut self) -> Result<Option<DeltaItem>, DeltaError> {
        if !read_frame(&mut self.input, &mut self.buf, self.read, self.expected)? {
            return Ok(None);
        }
        self.read += 1;
        let codec = |m: String| DeltaError::Codec(m);
        let body = match self.buf.split_first() {
            Some((&DELTA_VERSION, body)) => body,
            _ => return Err(codec("unknown derived delta record version".into())),
        };
        let (head, rest) = postcard::take_from_bytes::<ItemHead>(body).map_err(|e| codec(e.to_string()))?;
        let item = match head {
            // An upsert's body is the rest of its record, stored as it is: it must be exactly
            // one state and one geometry.
            ItemHead::Upsert { id } => {
                SnapshotRow::body_envelope(rest).map_err(codec)?;
                DeltaItem::Upsert(SnapshotRow::from_body(id, rest))
            }
            _ if !rest.is_empty() => return Err(codec(format!("{} bytes after a record", rest.len()))),
            ItemHead::Removal(id) => DeltaItem::Removal(id),
            ItemHead::Event(e) => DeltaItem::Event(e),
            ItemHead::Share(id, share) => DeltaItem::Share(id, share),
        };
        Ok(Some(item))
    }

    /// Records read so far.
    pub fn read(&self) -> u64 {
        self.read
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn state(code: &str) -> ParcelState {
        ParcelState { zoning: code.into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 12.5, revision: 0, announced: None }
    }

    /// Every kind of record reads back as written, in order; the end is `None`.
    #[test]
    fn records_read_back_in_the_order_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = DeltaFile::create(dir.path()).unwrap();
        let geometry = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
        let st = state("R-1");
        f.upsert(ParcelRef { id: "p1", state: &st, geometry: &geometry }).unwrap();
        f.removal("p0").unwrap();
        let event = crate::model::sample_event("p1");
        f.event(&event).unwrap();
        f.share("p1", 0.625).unwrap();
        assert_eq!(f.written(), 4);
        let mut r = f.finish().unwrap();
        let row = SnapshotRow::encode(ParcelRef { id: "p1", state: &st, geometry: &geometry });
        assert_eq!(r.next_item().unwrap(), Some(DeltaItem::Upsert(row)), "an upsert reads back as its snapshot row");
        assert_eq!(r.next_item().unwrap(), Some(DeltaItem::Removal("p0".into())));
        assert_eq!(r.next_item().unwrap(), Some(DeltaItem::Event(event)));
        assert_eq!(r.next_item().unwrap(), Some(DeltaItem::Share("p1".into(), 0.625)));
        assert_eq!(r.next_item().unwrap(), None);
        assert_eq!(r.read(), 4, "every record counted as read, upserts too");
    }

    /// A damaged file is an error, never a short delta: a record cut inside its length or its
    /// body, a length far beyond the file, another version.
    #[test]
    fn damaged_records_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let whole = {
            let mut f = DeltaFile::create(dir.path()).unwrap();
            f.removal("p0").unwrap();
            let mut r = f.finish().unwrap();
            let mut bytes = Vec::new();
            r.input.read_to_end(&mut bytes).unwrap();
            bytes
        };
        let read = |bytes: &[u8]| {
            let mut file = tempfile::tempfile_in(dir.path()).unwrap();
            file.write_all(bytes).unwrap();
            file.seek(SeekFrom::Start(0)).unwrap();
            DeltaReader { input: BufReader::new(file), buf: Vec::new(), read: 0, expected: 1 }.next_item()
        };
        assert!(matches!(read(&whole), Ok(Some(DeltaItem::Removal(_)))));
        assert!(read(&whole[..2]).is_err(), "cut inside the length");
        assert!(read(&whole[..whole.len() - 1]).is_err(), "cut inside the body");
        let mut huge = whole.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read(&huge).is_err(), "a length beyond the file");
        let mut other = whole.clone();
        other[4] = DELTA_VERSION + 1;
        assert!(read(&other).is_err(), "another version");
        // A file that ends between records, before every record written was read.
        let mut short = {
            let mut file = tempfile::tempfile_in(dir.path()).unwrap();
            file.write_all(&whole).unwrap();
            file.seek(SeekFrom::Start(0)).unwrap();
            DeltaReader { input: BufReader::new(file), buf: Vec::new(), read: 0, expected: 2 }
        };
        assert!(matches!(short.next_item(), Ok(Some(DeltaItem::Removal(_)))));
        assert!(short.next_item().is_err(), "one record of two written");
        let mut longer = whole.clone();
        longer.push(0);
        let len = u32::from_le_bytes(longer[..4].try_into().unwrap()) + 1;
        longer[..4].copy_from_slice(&len.to_le_bytes());
        assert!(read(&longer).is_err(), "a byte after a record");
        // An upsert whose body is not one state and one geometry is an error, not a row.
        let upsert = {
            let mut f = DeltaFile::create(dir.path()).unwrap();
            let geometry = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
            f.upsert(ParcelRef { id: "p1", state: &state("R-1"), geometry: &geometry }).unwrap();
            let mut r = f.finish().unwrap();
            let mut bytes = Vec::new();
            r.input.read_to_end(&mut bytes).unwrap();
            bytes
        };
        assert!(matches!(read(&upsert), Ok(Some(DeltaItem::Upsert(_)))));
        let mut cut = upsert[..upsert.len() - 3].to_vec();
        let len = u32::from_le_bytes(cut[..4].try_into().unwrap()) - 3;
        cut[..4].copy_from_slice(&len.to_le_bytes());
        assert!(read(&cut).is_err(), "an upsert whose geometry is cut short");
        let mut extra = upsert.clone();
        extra.push(7);
        let len = u32::from_le_bytes(extra[..4].try_into().unwrap()) + 1;
        extra[..4].copy_from_slice(&len.to_le_bytes());
        assert!(read(&extra).is_err(), "an upsert with a byte after its geometry");
    }
}
