//! A run's delta, spilled to an anonymous temporary file while the layer streams through the
//! diff, and read back in chunks by the commit. This is what keeps a 2.5-million-parcel
//! baseline (every parcel "added") in bounded memory: between the diff and the gate decision
//! the changed parcels and quarantined features live on disk, not in a `Vec`.
//!
//! Records are length-prefixed (u32 LE) postcard with a leading version byte, like the store's
//! records. The file is created next to the store (same disk, same permissions) and vanishes
//! when dropped, also on a crash.

use crate::model::{ChangeKind, ParcelRef, ParcelState, QuarantineReason, StoredGeometry};
use crate::store::QuarantineDraft;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

const SPILL_VERSION: u8 = 1;

/// Errors of the spill file (disk full, unreadable temp dir).
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill file (a temp file in the store's folder): {0}")]
    Io(#[source] std::io::Error),
    #[error("spill file record: {0}")]
    Codec(String),
}

impl From<std::io::Error> for SpillError {
    /// Notes a file-size limit, which the command then names and exits 2 on, as for the
    /// store itself (`store::note_io_error`; a tester's `ulimit -f` met by the spill file
    /// read as a retryable failure).
    fn from(e: std::io::Error) -> SpillError {
        crate::store::note_io_error(&e);
        SpillError::Io(e)
    }
}

/// A new or changed parcel and what kind of change it is (`None`: snapshot update only).
///
/// The state and the geometry are the last two fields, in this order: encoded, they are the
/// body of the parcel's snapshot record, which the commit copies off the spill as it reads
/// it ([`SpillReader::last_parcel_body`]) instead of encoding it again.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct SpilledParcel {
    pub feature_index: u64,
    pub id: String,
    pub kind: Option<ChangeKind>,
    /// The stored zoning before this run (None for an added parcel).
    pub from: Option<String>,
    /// The revision the change's key carries (`detect::diff::Step::key_revision`).
    pub key_revision: u32,
    pub state: ParcelState,
    pub geometry: StoredGeometry,
}

impl SpilledParcel {
    /// Whether this parcel's change event needs its stored geometry (a changed parcel's old
    /// shape): everything but an addition, and a snapshot-only update, which has no event.
    pub fn needs_stored_geometry(&self) -> bool {
        matches!(self.kind, Some(k) if k != ChangeKind::Added)
    }

    /// A parcel read as its head, then its state and geometry.
    pub fn from_head(head: ParcelHead, state: ParcelState, geometry: StoredGeometry) -> SpilledParcel {
        let ParcelHead { feature_index, id, kind, from, key_revision } = head;
        SpilledParcel { feature_index, id, kind, from, key_revision, state, geometry }
    }

    /// This parcel as a [`ParcelRef`], for writing it to the store.
    pub fn borrowed(&self) -> ParcelRef<'_> {
        ParcelRef { id: &self.id, state: &self.state, geometry: &self.geometry }
    }
}

#[derive(Serialize, Deserialize)]
struct SpilledQuarantine {
    feature_index: u64,
    parcel_id: Option<String>,
    reason: QuarantineReason,
    detail: String,
    raw: String,
}

/// The front of a spill record as it is read back (written as [`RecordRef`]): a parcel up
/// to its state, which postcard leaves unread, or a whole quarantine draft.
#[derive(Deserialize)]
enum RecordHead {
    Parcel(ParcelHead),
    Quarantine(SpilledQuarantine),
}

/// A [`SpilledParcel`]'s fields before its state, in the same order: what
/// [`SpillReader::next_entry`] reads of a parcel, its state and geometry left encoded.
#[derive(Deserialize, Debug)]
pub struct ParcelHead {
    pub feature_index: u64,
    pub id: String,
    pub kind: Option<ChangeKind>,
    pub from: Option<String>,
    pub key_revision: u32,
}

/// A record as it is written, borrowing its content: serde encodes a reference as what it
/// refers to, so the bytes read back as a [`RecordHead`] followed, for a parcel, by its state
/// and geometry.
#[derive(Serialize)]
enum RecordRef<'a> {
    Parcel(&'a SpilledParcel),
    Quarantine(&'a SpilledQuarantine),
}

/// Appends one framed record to `out`: its length (u32 LE, counting the version byte and
/// the body), the version byte, the postcard body. On an error `out` is left as it was.
fn frame(out: &mut Vec<u8>, rec: &RecordRef<'_>) -> Result<(), SpillError> {
    frame_record(out, SPILL_VERSION, rec).map_err(SpillError::Codec)
}

/// The framing of a run's temporary record files (this spill, a derived run's delta):
/// appends `rec` to `out` as its length (u32 LE, counting the version byte and the body),
/// `version`, then the postcard body. On an error `out` is left as it was.
pub(crate) fn frame_record<T: Serialize>(out: &mut Vec<u8>, version: u8, rec: &T) -> Result<(), String> {
    /// Lets postcard append to a borrowed buffer.
    struct Append<'v>(&'v mut Vec<u8>);
    impl Extend<u8> for Append<'_> {
        fn extend<I: IntoIterator<Item = u8>>(&mut self, bytes: I) {
            self.0.extend(bytes);
        }
    }
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(version);
    let framed = postcard::to_extend(rec, Append(out))
        .map_err(|e| e.to_string())
        .and_then(|a| u32::try_from(a.0.len() - start - 4).map_err(|_| "record larger than 4 GiB".to_string()));
    match framed {
        Ok(len) => {
            out[start..start + 4].copy_from_slice(&len.to_le_bytes());
            Ok(())
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Why [`read_frame`] could not read a record.
#[derive(Debug)]
pub(crate) enum FrameError {
    Io(std::io::Error),
    /// The file ends inside a record, or before every record written was read.
    Cut(String),
}

/// Reads the next record framed by [`frame_record`] into `buf` (its version byte and body):
/// `Ok(false)` at the end of the file once `read` (the records framed so far: callers count
/// a record as soon as this returns `Ok(true)`) equals `expected`, the number written. A file
/// that ends before that — even between records — or inside a record, or that goes on past
/// the last record written, is an error: a run's commit must fail whole rather than leave
/// part of its records out or take in records nobody wrote. The body is read through `take`,
/// so a damaged length cannot make it allocate that much up front.
pub(crate) fn read_frame<R: Read>(input: &mut R, buf: &mut Vec<u8>, read: u64, expected: u64) -> Result<bool, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match input.read(&mut len[got..]) {
            Ok(0) if got == 0 && read == expected => return Ok(false),
            Ok(_) if read >= expected => return Err(FrameError::Cut(format!("the file goes on after the {expected} records written"))),
            Ok(0) if got == 0 => return Err(FrameError::Cut(format!("the file ends after {read} of the {expected} records written"))),
            Ok(0) => return Err(FrameError::Cut("record length cut short".into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(len) as u64;
    buf.clear();
    input.take(len).read_to_end(buf).map_err(FrameError::Io)?;
    if buf.len() as u64 != len {
        return Err(FrameError::Cut("record cut short".into()));
    }
    Ok(true)
}

impl From<FrameError> for SpillError {
    fn from(e: FrameError) -> SpillError {
        match e {
            FrameError::Io(e) => SpillError::from(e),
            FrameError::Cut(m) => SpillError::Codec(m),
        }
    }
}

/// Frames a parcel's record into `out` away from the spill (a scan worker does, so the
/// thread writing the spill neither encodes parcels nor frees them): write the bytes with
/// [`Spill::push_framed_parcel`].
pub fn frame_parcel(out: &mut Vec<u8>, p: &SpilledParcel) -> Result<(), SpillError> {
    frame(out, &RecordRef::Parcel(p))
}

/// One item read back from the spill.
#[derive(Debug)]
pub enum SpillItem {
    Parcel(SpilledParcel),
    Quarantine(QuarantineDraft),
}

/// One item read back from the spill, a parcel's state and geometry not decoded yet
/// ([`SpillReader::last_parcel_body`], [`SpillReader::decode_last_body`]).
#[derive(Debug)]
pub enum SpillEntry {
    Parcel(ParcelHead),
    Quarantine(QuarantineDraft),
}

/// The writer side; [`Spill::finish`] turns it into a reader.
pub struct Spill {
    out: BufWriter<File>,
    pub parcels: u64,
    pub quarantined: u64,
    /// Records written (the reader expects as many).
    records: u64,
    buf: Vec<u8>,
}

impl Spill {
    /// A new anonymous spill file in `dir`.
    pub fn create(dir: &Path) -> Result<Spill, SpillError> {
        let file = tempfile::tempfile_in(dir)?;
        Ok(Spill { out: BufWriter::with_capacity(1 << 20, file), parcels: 0, quarantined: 0, records: 0, buf: Vec::with_capacity(512) })
    }

    fn put(&mut self, rec: &RecordRef<'_>) -> Result<(), SpillError> {
        self.buf.clear();
        frame(&mut self.buf, rec)?;
        self.out.write_all(&self.buf)?;
        self.records += 1;
        Ok(())
    }

    pub fn push_parcel(&mut self, p: SpilledParcel) -> Result<(), SpillError> {
        self.parcels += 1;
        self.put(&RecordRef::Parcel(&p))
    }

    /// One parcel record framed by [`frame_parcel`] (written as given: the caller passes
    /// exactly one record's bytes).
    pub(crate) fn push_framed_parcel(&mut self, framed: &[u8]) -> Result<(), SpillError> {
        self.parcels += 1;
        self.out.write_all(framed)?;
        self.records += 1;
        Ok(())
    }

    pub fn push_quarantine(&mut self, q: QuarantineDraft) -> Result<(), SpillError> {
        self.quarantined += 1;
        self.put(&RecordRef::Quarantine(&SpilledQuarantine {
            feature_index: q.feature_index,
            parcel_id: q.parcel_id,
            reason: q.reason,
            detail: q.detail,
            raw: q.raw,
        }))
    }

    /// Writes a record no reader accepts (an unknown version), as a damaged spill file
    /// would read back: for tests of a commit that fails half-way through the spill.
    #[cfg(test)]
    pub(crate) fn push_damaged_record(&mut self) -> Result<(), SpillError> {
        self.out.write_all(&1u32.to_le_bytes())?;
        self.out.write_all(&[SPILL_VERSION.wrapping_add(100)])?;
        self.records += 1;
        Ok(())
    }

    /// Flushes and rewinds: the records can now be read back in the order written.
    pub fn finish(self) -> Result<SpillReader, SpillError> {
        let mut file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        Ok(SpillReader { input: BufReader::with_capacity(1 << 20, file), buf: Vec::new(), body: 0..0, read: 0, expected: self.records })
    }
}

/// Reads the spill back.
pub struct SpillReader {
    input: BufReader<File>,
    buf: Vec<u8>,
    /// Where in `buf` the state and geometry of the last parcel read are.
    body: std::ops::Range<usize>,
    /// Records read since the start (or the last rewind), and written: a file that ends
    /// before every record written was read is an error ([`read_frame`]).
    read: u64,
    expected: u64,
}

impl SpillReader {
    /// Rewinds to the first record (the commit reads the spill more than once).
    pub fn rewind(&mut self) -> Result<(), SpillError> {
        self.input.seek(SeekFrom::Start(0))?;
        self.read = 0;
        Ok(())
    }

    /// The next record, or None at the end.
    pub fn next_item(&mut self) -> Result<Option<SpillItem>, SpillError> {
        Ok(match self.next_entry()? {
            None => None,
            Some(SpillEntry::Quarantine(q)) => Some(SpillItem::Quarantine(q)),
            Some(SpillEntry::Parcel(h)) => {
                let (state, geometry) = self.decode_last_body()?;
                Some(SpillItem::Parcel(SpilledParcel::from_head(h, state, geometry)))
            }
        })
    }

    /// The next record, or None at the end; a parcel's state and geometry are left encoded
    /// (what a baseline writes of most parcels is those bytes as they are). A file that ends
    /// inside a record or before every record written was read is an error.
    pub fn next_entry(&mut self) -> Result<Option<SpillEntry>, SpillError> {
        self.body = 0..0;
        if !read_frame(&mut self.input, &mut self.buf, self.read, self.expected)? {
            return Ok(None);
        }
        self.read += 1;
        let body = match self.buf.split_first() {
            Some((&SPILL_VERSION, body)) => body,
            _ => return Err(SpillError::Codec("unknown spill record version".into())),
        };
        let (head, rest) = postcard::take_from_bytes::<RecordHead>(body).map_err(|e| SpillError::Codec(e.to_string()))?;
        Ok(Some(match head {
            RecordHead::Parcel(h) => {
                self.body = self.buf.len() - rest.len()..self.buf.len();
                SpillEntry::Parcel(h)
            }
            RecordHead::Quarantine(q) => SpillEntry::Quarantine(QuarantineDraft {
                feature_index: q.feature_index,
                parcel_id: q.parcel_id,
                reason: q.reason,
                detail: q.detail,
                raw: q.raw,
            }),
        }))
    }

    /// The state and geometry of the parcel read last: an error if its body is not exactly
    /// one state and one geometry (or the last record was not a parcel).
    pub fn decode_last_body(&self) -> Result<(ParcelState, StoredGeometry), SpillError> {
        crate::store::SnapshotRow::decode_body(self.last_parcel_body()).map_err(SpillError::Codec)
    }

    /// The state and geometry of the parcel read last, as encoded on the spill:
    /// `postcard(ParcelState) ++ postcard(StoredGeometry)`, the body of its snapshot record
    /// (empty after a quarantine draft).
    pub fn last_parcel_body(&self) -> &[u8] {
        self.buf.get(self.body.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parcel framed off the spill (by a scan worker) is the record `push_parcel` writes,
    /// and reads back in the order written among other records.
    #[test]
    fn framed_parcels_are_the_records_push_parcel_writes() {
        let dir = tempfile::tempdir().unwrap();
        let parcel = |i: u64| SpilledParcel {
            feature_index: i,
            id: format!("p{i}"),
            state: ParcelState { zoning: "R-1".into(), effective_date: Some("2026-01-01".into()), content_hash: [3; 32], geom_hash: [4; 32], area_m2: 2.5, revision: 0, announced: None },
            geometry: StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]),
            kind: Some(ChangeKind::Rezoned),
            from: Some("C-1".into()),
            key_revision: 0,
        };
        let mut framed = Vec::new();
        frame_parcel(&mut framed, &parcel(1)).unwrap();
        let first = framed.len();
        frame_parcel(&mut framed, &parcel(2)).unwrap();
        let mut direct = Spill::create(dir.path()).unwrap();
        direct.push_parcel(parcel(1)).unwrap();
        let mut direct = direct.finish().unwrap();
        let mut bytes = Vec::new();
        direct.input.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes, framed[..first], "the same bytes as push_parcel");
        // The layout the reader expects: length (version byte + body), version, body.
        let body = postcard::to_stdvec(&RecordRef::Parcel(&parcel(1))).unwrap();
        let mut layout = ((body.len() + 1) as u32).to_le_bytes().to_vec();
        layout.push(SPILL_VERSION);
        layout.extend_from_slice(&body);
        assert_eq!(framed[..first], layout[..]);

        let mut s = Spill::create(dir.path()).unwrap();
        s.push_framed_parcel(&framed[..first]).unwrap();
        s.push_quarantine(QuarantineDraft { feature_index: 9, parcel_id: None, reason: QuarantineReason::MissingField, detail: "d".into(), raw: "{}".into() }).unwrap();
        s.push_framed_parcel(&framed[first..]).unwrap();
        assert_eq!((s.parcels, s.quarantined), (2, 1));
        let mut r = s.finish().unwrap();
        let mut order = Vec::new();
        while let Some(item) = r.next_item().unwrap() {
            order.push(match item {
                SpillItem::Parcel(p) => {
                    assert_eq!((p.kind, p.from.as_deref(), p.state.area_m2), (Some(ChangeKind::Rezoned), Some("C-1"), 2.5));
                    // The body read off the spill makes the same snapshot row as encoding the parcel.
                    let row = crate::store::SnapshotRow::from_body(p.id.clone(), r.last_parcel_body());
                    assert_eq!(row, crate::store::SnapshotRow::encode(p.borrowed()));
                    p.id
                }
                SpillItem::Quarantine(q) => {
                    assert!(r.last_parcel_body().is_empty());
                    format!("q{}", q.feature_index)
                }
            });
        }
        assert_eq!(order, ["p1", "q9", "p2"]);
    }

    /// A spill file that ends early — between records, or inside a record's length or body
    /// — is an error, never a clean end: the commit must not leave the rest out silently.
    #[test]
    fn a_spill_cut_short_is_an_error_even_between_records() {
        let dir = tempfile::tempdir().unwrap();
        let quarantine = |i: u64| QuarantineDraft { feature_index: i, parcel_id: None, reason: QuarantineReason::MissingField, detail: "d".into(), raw: "{}".into() };
        let mut one = Vec::new();
        frame(&mut one, &RecordRef::Quarantine(&SpilledQuarantine { feature_index: 0, parcel_id: None, reason: QuarantineReason::MissingField, detail: "d".into(), raw: "{}".into() })).unwrap();
        let record = one.len() as u64;
        for (cut, read_before_error) in [(record, 1), (record + 2, 1), (record + 6, 1), (0, 0)] {
            let mut s = Spill::create(dir.path()).unwrap();
            for i in 0..3 {
                s.push_quarantine(quarantine(i)).unwrap();
            }
            let mut r = s.finish().unwrap();
            r.input.get_ref().set_len(cut).unwrap();
            for _ in 0..read_before_error {
                assert!(r.next_entry().unwrap().is_some());
            }
            let err = r.next_entry().unwrap_err().to_string();
            assert!(err.contains("cut short") || err.contains(&format!("after {read_before_error} of the 3")), "cut at {cut}: {err}");
        }
        // Bytes after the last record written are an error too, not a record.
        let mut s = Spill::create(dir.path()).unwrap();
        s.push_quarantine(quarantine(0)).unwrap();
        let mut r = s.finish().unwrap();
        let mut file = r.input.get_ref();
        file.seek(SeekFrom::End(0)).unwrap();
        file.write_all(&one).unwrap();
        r.rewind().unwrap();
        assert!(r.next_entry().unwrap().is_some());
        let err = r.next_entry().unwrap_err().to_string();
        assert!(err.contains("goes on after the 1 records written"), "{err}");
        // Whole, it reads to its end twice (rewound), and then ends cleanly.
        let mut s = Spill::create(dir.path()).unwrap();
        for i in 0..3 {
            s.push_quarantine(quarantine(i)).unwrap();
        }
        let mut r = s.finish().unwrap();
        for _ in 0..2 {
            let mut n = 0;
            while r.next_entry().unwrap().is_some() {
                n += 1;
            }
            assert_eq!(n, 3);
            r.rewind().unwrap();
        }
    }

    #[test]
    fn round_trips_in_order_and_rewinds() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spill::create(dir.path()).unwrap();
        let state = ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 3.5, revision: 0, announced: None };
        for i in 0..1000u64 {
            s.push_parcel(SpilledParcel {
                feature_index: i,
                id: format!("p{i}"),
                state: state.clone(),
                geometry: StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]),
                kind: Some(ChangeKind::Added),
                from: None,
                key_revision: 0,
            })
            .unwrap();
        }
        s.push_quarantine(QuarantineDraft { feature_index: 7, parcel_id: None, reason: QuarantineReason::MissingField, detail: "d".into(), raw: "{}".into() }).unwrap();
        let mut r = s.finish().unwrap();
        for pass in 0..2 {
            let mut n = 0;
            let mut q = 0;
            while let Some(item) = r.next_item().unwrap() {
                match item {
                    SpillItem::Parcel(p) => {
                        assert_eq!(p.id, format!("p{n}"));
                        n += 1;
                    }
                    SpillItem::Quarantine(d) => {
                        assert_eq!(d.feature_index, 7);
                        q += 1;
                    }
                }
            }
            assert_eq!((n, q), (1000, 1), "pass {pass}");
            r.rewind().unwrap();
        }
    }
}
