//! The streaming diff: a layer of any size goes through normalise → look up the stored state →
//! [`classify`] in bounded memory, on every core.
//!
//! One thread scans the document ([`geojson::for_each_feature_in`]) into batches of feature
//! text; meanwhile another reads the stored snapshot once, in order, into a sorted index of
//! (id fingerprint, content hash) — 32 bytes a parcel, no allocation per row, plus a directory
//! by fingerprint prefix ([`SnapshotIndex`]). Worker threads normalise each feature and look
//! its id up in that index: an equal hash is
//! "unchanged", a missing id is "added", and only a changed parcel costs a point lookup in the
//! [`SnapshotView`] (one read transaction, so the whole run compares against one snapshot);
//! one whose shape's hash moved while its zoning did not, a read of its stored geometry too
//! (a shape rounded across a grid step is the stored one: [`rounded_again`]).
//! The calling thread puts
//! the results back in document order and writes what must be committed — new and changed
//! parcels, quarantined features — to a [`Spill`] file. Unchanged parcels (the vast majority
//! of a re-publish) leave nothing behind but a 20-byte fingerprint of their id.
//!
//! After the scan, the stored ids are walked once in order: an id that was not seen (and was
//! not quarantined this run, nor lies under a feature quarantined without an id:
//! [`super::unidentified`]) is a removal. When every stored id was seen as a valid feature
//! (the common case), there can be no removal and that walk is skipped. Duplicate ids are found by sorting the
//! fingerprints; every copy is quarantined and the parcel is left as it is stored.
//!
//! Memory: the snapshot index (32 bytes a stored parcel, and 4–8 bytes of directory) and the
//! seen-id fingerprints (24 bytes a feature) — ~155 MB at 2.5M parcels — the removals, the quarantined ids, and a few batches
//! in flight. Everything else is on disk.

use super::canonical::content_hash;
use super::diff::{classify, content_of, step, ParcelDelta, Prior};
use super::unidentified::Unidentified;
use super::spill::{frame_parcel, Spill, SpillEntry, SpillError, SpillReader, SpilledParcel};
use crate::ingest::geojson::{self, FeatureText};
use crate::ingest::normalize::{normalize_feature, NormalizeRules, Rejected};
use crate::ingest::IngestError;
use crate::model::{ChangeKind, Envelope, ParcelState, QuarantineReason};
use crate::store::{QuarantineDraft, SnapshotView, StoreError};
use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// The [`SnapshotIndex`] directory's largest size, in prefix bits: 2^24 buckets, 64 MiB.
const MAX_DIRECTORY_BITS: u32 = 24;

/// The stored snapshot as (id fingerprint, first 16 bytes of the content hash), sorted, with
/// a directory by the fingerprint's top bits.
///
/// Every feature of a layer is looked up here. A binary search over millions of 32-byte
/// entries was ~20 dependent cache misses, ~0.4 µs a feature, a fifth of a re-publish's
/// scan. Fingerprints are uniform hashes, so the directory (one `u32` per bucket, one to two
/// buckets per entry, at most 2^24 buckets: 64 MiB) puts a look-up within a bucket of about
/// one entry: two cache misses.
struct SnapshotIndex {
    entries: Vec<([u64; 2], [u8; 16])>,
    /// `dir[b]..dir[b + 1]`: the entries whose fingerprint starts with the bits `b`.
    dir: Vec<u32>,
    /// Fingerprint bits below the directory's prefix (`64` for an empty index).
    shift: u32,
}

impl SnapshotIndex {
    /// Sorts `entries` and builds the directory.
    fn new(entries: Vec<([u64; 2], [u8; 16])>) -> Result<SnapshotIndex, String> {
        Self::with_max_bits(entries, MAX_DIRECTORY_BITS)
    }

    /// [`SnapshotIndex::new`] with the directory capped at `2^max_bits` buckets (the tests
    /// use a small cap to exercise the buckets of many entries a huge layer gets).
    fn with_max_bits(mut entries: Vec<([u64; 2], [u8; 16])>, max_bits: u32) -> Result<SnapshotIndex, String> {
        if entries.len() >= u32::MAX as usize {
            return Err(format!("{} stored parcels in one source is more than the diff can index", entries.len()));
        }
        entries.sort_unstable();
        // About one entry per bucket (2^bits ≥ len), at most 2^max_bits buckets: beyond
        // that a bucket holds several entries, binary-searched.
        let bits = (usize::BITS - entries.len().leading_zeros()).min(max_bits);
        let shift = 64 - bits;
        let buckets = 1usize << bits;
        let mut dir = Vec::with_capacity(buckets + 1);
        let mut i = 0usize;
        for b in 0..buckets {
            while i < entries.len() && Self::bucket(entries[i].0, shift) < b {
                i += 1;
            }
            dir.push(i as u32);
        }
        dir.push(entries.len() as u32);
        Ok(SnapshotIndex { entries, dir, shift })
    }

    fn bucket(print: [u64; 2], shift: u32) -> usize {
        // `checked_shr`: an empty index has no prefix bits (a shift by 64).
        print[0].checked_shr(shift).unwrap_or(0) as usize
    }

    /// The stored content hash prefix of the parcel with this id fingerprint.
    fn get(&self, print: [u64; 2]) -> Option<[u8; 16]> {
        let b = Self::bucket(print, self.shift);
        let (lo, hi) = (*self.dir.get(b)? as usize, *self.dir.get(b + 1)? as usize);
        let bucket = self.entries.get(lo..hi)?;
        bucket.binary_search_by_key(&print, |e| e.0).ok().map(|i| bucket[i].1)
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

fn build_index(view: &SnapshotView) -> Result<SnapshotIndex, String> {
    let started = std::time::Instant::now();
    let mut entries = Vec::new();
    view.for_each_hash(|pid, hash| {
        let mut h = [0u8; 16];
        h.copy_from_slice(&hash[..16]);
        entries.push((fingerprint(pid), h));
    })
    .map_err(|e| e.to_string())?;
    let read_ms = started.elapsed().as_millis() as u64;
    let index = SnapshotIndex::new(entries)?;
    tracing::debug!(parcels = index.len(), read_ms, total_ms = started.elapsed().as_millis() as u64, "snapshot index built");
    Ok(index)
}

/// Errors of the streaming diff.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error(transparent)]
    Ingest(#[from] IngestError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Spill(#[from] SpillError),
    #[error(transparent)]
    RowSort(#[from] super::row_sort::RowSortError),
    #[error("a diff worker thread failed: {0}")]
    Worker(String),
}

/// What the scan found; the delta itself is in `spill`.
pub struct ScanResult {
    pub spill: SpillReader,
    /// Features in the document.
    pub features: u64,
    /// Valid parcels (duplicate-id copies excluded).
    pub parcels: u64,
    pub repaired: u64,
    /// Quarantined features, duplicate-id copies included.
    pub quarantined: u64,
    /// Quarantined for a reason that points at the whole layer (see `QuarantineReason`).
    pub systemic: u64,
    /// Stored parcels whose feature was quarantined this run and no valid feature updated
    /// (each keeps its stored state).
    pub unreadable_known: u64,
    /// Change events the run will emit: changed and added parcels plus removals.
    pub changes: u64,
    /// Warnings for the run record (fields matched case-insensitively).
    pub warnings: Vec<String>,
    /// Ids that appear more than once: every copy is quarantined, the stored parcel kept.
    pub duplicate_ids: HashSet<String>,
    /// Quarantine drafts for the duplicate copies (written with the spill's).
    pub duplicate_drafts: Vec<QuarantineDraft>,
    /// Stored parcels absent from the layer, in id order, with their stored state.
    pub removed: Vec<(String, ParcelState)>,
    /// Parcels in the stored snapshot before this run.
    pub previous_parcels: u64,
}

/// Features per batch handed to a worker.
const BATCH: usize = 512;

/// The stored geometry of a parcel whose shape's hash moved (its zoning did not), when its new
/// shape is that one but for the grid's rounding (`canonical::same_but_for_rounding`: a layer
/// written out again with fewer decimals); `None` when the shape did change (or none is
/// stored to compare). The stored shape then stands: such a parcel is unchanged, or only its
/// effective date moved. A layer that keeps the rounded form pays this read for each such
/// parcel at every run that reads it (its hash never matches the stored one).
fn rounded_again(view: &SnapshotView, p: &crate::model::Parcel) -> Result<Option<crate::model::StoredGeometry>, crate::store::StoreError> {
    let Some(stored) = view.geometry(&p.id)? else { return Ok(None) };
    Ok(crate::detect::canonical::same_but_for_rounding(&stored.to_geo(), &p.geometry.to_geo()).then_some(stored))
}

/// How many copies of a duplicated id each copy's quarantine row names (the rest are counted).
const DUPLICATES_NAMED: usize = 10;

struct FeatureBatch {
    seq: u64,
    text: String,
    items: Vec<(u64, usize, usize)>,
    /// Indexes of the batch's features whose bytes were not UTF-8 (rare; ascending): checked
    /// for damage in the fields the diff reads.
    not_utf8: Vec<u64>,
}

impl FeatureBatch {
    fn new(seq: u64) -> FeatureBatch {
        FeatureBatch { seq, text: String::with_capacity(BATCH * 300), items: Vec::with_capacity(BATCH), not_utf8: Vec::new() }
    }
}

enum Outcome {
    /// The id's fingerprint (computed once, by the worker that looked it up).
    Unchanged { index: u64, print: [u64; 2] },
    /// A new or changed parcel, its spill record framed by the worker in the batch's
    /// `framed` bytes (so the collecting thread neither encodes it nor frees it).
    Upsert { print: [u64; 2], index: u64, stored: bool, change: bool, framed: std::ops::Range<usize> },
    /// A quarantined feature, with where it lies if it has no id ([`Rejected::footprint`]).
    Rejected { draft: QuarantineDraft, footprint: Option<Envelope> },
}

struct ResultBatch {
    seq: u64,
    outcomes: Vec<Outcome>,
    /// The spill records of the batch's `Upsert`s, back to back.
    framed: Vec<u8>,
    repaired: u64,
    /// Features read with an effective date.
    dated: u64,
    folded: Vec<(String, String)>,
}

/// 128-bit fingerprint of a parcel id (two SipHash passes with fixed keys): collisions are
/// out of reach for any layer size (≈ n²/2¹²⁹).
fn fingerprint(id: &str) -> [u64; 2] {
    let mut a = std::hash::DefaultHasher::new();
    id.hash(&mut a);
    let mut b = std::hash::DefaultHasher::new();
    0x9E37_79B9u32.hash(&mut b);
    id.hash(&mut b);
    [a.finish(), b.finish()]
}


/// Whether a feature's text is not JSON and has `"Feature"` more than once: every GeoJSON
/// feature says
/// `"type": "Feature"`, so a broken feature that does has taken the features after it into
/// itself (the scanner's guess at where it ends could not be right). Quarantining it would
/// leave those parcels unseen, so read as removed.
fn holds_more_than_one_feature(json: &str) -> bool {
    memchr::memmem::find_iter(json.as_bytes(), b"\"Feature\"").nth(1).is_some() && serde_json::from_str::<serde::de::IgnoredAny>(json).is_err()
}

/// Worker threads to use: every core, at most 8.
pub fn default_workers() -> usize {
    crate::util::cores().clamp(1, 8)
}

/// The layer as the scanning thread reads it: no more once `cancel` is set (the scan failed;
/// its own failure is what it reports).
struct UntilCancelled<'a, R> {
    inner: R,
    cancel: &'a AtomicBool,
}

impl<R: Read> Read for UntilCancelled<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the scan stopped"));
        }
        self.inner.read(buf)
    }
}

/// Streams the layer read from `reader` through normalise + diff against `view`, spilling
/// the delta into a temporary file in `spill_dir`. `announce`: whether the run is to tell
/// subscribers of its changes (not a baseline, not a reprocess): each changed parcel's
/// revision and key revision follow from it ([`step`]). `progress(bytes, features)` is
/// called from the scanning thread as the document is read.
pub fn scan_layer<R: Read + Send>(
    reader: R,
    rules: &NormalizeRules,
    view: &SnapshotView,
    announce: bool,
    spill_dir: &Path,
    workers: usize,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<ScanResult, ScanError> {
    let workers = workers.max(1);
    let mut spill = Spill::create(spill_dir)?;
    let (feat_tx, feat_rx) = sync_channel::<FeatureBatch>(workers * 2);
    let feat_rx = Mutex::new(feat_rx);
    let (res_tx, res_rx) = sync_channel::<Result<ResultBatch, ScanError>>(workers * 2);

    let mut seen: Vec<([u64; 2], u64)> = Vec::new();
    let mut untouchable: HashSet<String> = HashSet::new();
    let mut unidentified = Unidentified::default();
    let mut folded: Vec<(String, String)> = Vec::new();
    let (mut repaired, mut quarantined, mut systemic, mut changes) = (0u64, 0u64, 0u64, 0u64);
    let mut dated = 0u64;
    // Valid features whose id is in the stored snapshot (each stored id at most once when
    // there are no duplicates): when it equals the snapshot's size, nothing was removed.
    let mut known_seen = 0u64;

    let index: OnceLock<Result<SnapshotIndex, String>> = OnceLock::new();
    let cancel_flag = AtomicBool::new(false);
    let cancel = &cancel_flag;
    let scanned: Result<u64, ScanError> = std::thread::scope(|scope| {
        // Whoever asks first builds the index; this thread asks at once, so it is read while
        // the first batches are being normalised.
        scope.spawn(|| index.get_or_init(|| build_index(view)));
        let scanner = scope.spawn(move || {
            let mut seq = 0u64;
            let mut batch = FeatureBatch::new(seq);
            let mut hung_up = false;
            let mut last_offset = 0u64;
            // Once the scan has failed (or a worker did), the rest of the layer is not read:
            // on a county's layer that was minutes before the run could report its failure.
            let reader = UntilCancelled { inner: reader, cancel };
            let n = geojson::for_each_feature_in(reader, |f: FeatureText<'_>| {
                last_offset = f.offset;
                if hung_up || cancel.load(Ordering::Relaxed) {
                    hung_up = true;
                    return;
                }
                let start = batch.text.len();
                batch.text.push_str(f.json);
                batch.items.push((f.index, start, batch.text.len()));
                if f.not_utf8 {
                    batch.not_utf8.push(f.index);
                }
                if batch.items.len() >= BATCH {
                    seq += 1;
                    let next = FeatureBatch::new(seq);
                    if feat_tx.send(std::mem::replace(&mut batch, next)).is_err() {
                        hung_up = true;
                    }
                    if let Some(p) = progress {
                        p(f.offset, f.index + 1);
                    }
                }
            });
            if !batch.items.is_empty() && !hung_up {
                let _ = feat_tx.send(batch);
            }
            if let (Some(p), Ok(n)) = (progress, &n) {
                p(last_offset, *n);
            }
            n
        });
        for _ in 0..workers {
            let res_tx = res_tx.clone();
            let (feat_rx, index) = (&feat_rx, &index);
            scope.spawn(move || worker(feat_rx, res_tx, rules, view, announce, index, cancel));
        }
        drop(res_tx);

        // Put results back in document order and spill them.
        let mut pending: BTreeMap<u64, ResultBatch> = BTreeMap::new();
        let mut next_seq = 0u64;
        let mut failure: Option<ScanError> = None;
        for msg in res_rx.iter() {
            match msg {
                Ok(b) => {
                    pending.insert(b.seq, b);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                    break;
                }
            }
            while let Some(b) = pending.remove(&next_seq) {
                next_seq += 1;
                repaired += b.repaired;
                dated += b.dated;
                for f in b.folded {
                    if !folded.contains(&f) {
                        folded.push(f);
                    }
                }
                for o in b.outcomes {
                    let r = match o {
                        Outcome::Unchanged { index, print } => {
                            seen.push((print, index));
                            known_seen += 1;
                            Ok(())
                        }
                        Outcome::Upsert { print, index, stored, change, framed } => {
                            seen.push((print, index));
                            known_seen += u64::from(stored);
                            changes += u64::from(change);
                            spill.push_framed_parcel(&b.framed[framed])
                        }
                        Outcome::Rejected { draft: q, footprint } => {
                            quarantined += 1;
                            systemic += u64::from(q.reason.is_systemic());
                            match &q.parcel_id {
                                Some(id) => {
                                    untouchable.insert(id.clone());
                                }
                                None => unidentified.add(q.feature_index, footprint),
                            }
                            spill.push_quarantine(q)
                        }
                    };
                    if let Err(e) = r {
                        failure.get_or_insert(e.into());
                    }
                }
            }
            if failure.is_some() {
                break;
            }
        }
        // Stop the producers: the scanner sees `cancel`, workers stop working and drain.
        cancel.store(true, Ordering::Relaxed);
        drop(res_rx);
        // Workers that died (redb panicking on a damaged page of the store) drain nothing: the
        // scanner could wait forever on a full channel before it sees `cancel`. Drain it here
        // too until the scanner has hung up; their panic then reaches the caller.
        while !scanner.is_finished() {
            let rx = feat_rx.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Err(std::sync::mpsc::RecvTimeoutError::Disconnected) = rx.recv_timeout(std::time::Duration::from_millis(10)) {
                break;
            }
        }
        let scanned = scanner.join().map_err(|_| ScanError::Worker("the scanning thread panicked".into()))?;
        if let Some(e) = failure {
            return Err(e);
        }
        Ok(scanned?)
    });
    let features = scanned?;

    // Duplicate ids: equal fingerprints sit next to each other once sorted, their feature
    // indexes in order (one pass: a layer whose id field is mis-mapped to a town's name has
    // runs of millions of copies).
    seen.sort_unstable();
    let mut dup_prints: BTreeMap<[u64; 2], Vec<u64>> = BTreeMap::new();
    for run in seen.chunk_by(|a, b| a.0 == b.0).filter(|run| run.len() > 1) {
        dup_prints.insert(run[0].0, run.iter().map(|&(_, i)| i).collect());
    }
    let is_seen = |id: &str| seen.binary_search_by(|probe| probe.0.cmp(&fingerprint(id))).is_ok();
    let mut reader = spill.finish()?;

    // Duplicates: find the ids of new ones in the spill and correct the counts. Each copy
    // stands where a stored parcel may lie that the layer wrote under that id (a county's
    // placeholder, `0` or `ROW`, on parcels that keep their shape): its footprint keeps such
    // a parcel from reading as removed, as a feature without an id does (a reviewer).
    let mut duplicate_ids: HashSet<String> = HashSet::new();
    if !dup_prints.is_empty() {
        // Heads, and the envelope of each copy's geometry (the commit reads the bodies, and
        // checks them, on its own pass).
        while let Some(entry) = reader.next_entry()? {
            if let SpillEntry::Parcel(p) = entry {
                if dup_prints.contains_key(&fingerprint(&p.id)) {
                    changes -= u64::from(p.kind.is_some());
                    if let Ok(Some(envelope)) = crate::store::SnapshotRow::body_envelope(reader.last_parcel_body()) {
                        unidentified.add_copy(envelope);
                    }
                    duplicate_ids.insert(p.id);
                }
            }
        }
        reader.rewind()?;
    }

    // Removals (and the ids of duplicates that were stored before).
    let mut removed = Vec::new();
    let mut gone: Vec<String> = Vec::new();
    let stored = match index.get() {
        Some(Ok(i)) => Some(i.len() as u64),
        _ => None,
    };
    // Stored parcels whose feature could not be read this run and that no valid feature of
    // the layer updated (a parent id shared by a parcel's polygon and its units' rows without
    // geometry is read: a reviewer): each keeps its stored state (`GateInput::unreadable_stored`).
    let unreadable_known = match index.get() {
        Some(Ok(i)) => untouchable.iter().filter(|id| !is_seen(id) && i.get(fingerprint(id)).is_some()).count() as u64,
        _ => 0,
    };
    drop(index);
    let previous_parcels = match stored {
        // Every stored id was seen once as a valid feature: no removal, no stored duplicate;
        // the second ordered pass over the snapshot is skipped.
        Some(n) if dup_prints.is_empty() && known_seen == n => n,
        _ => view.for_each_hash(|pid, _| {
            if !dup_prints.is_empty() && dup_prints.contains_key(&fingerprint(pid)) {
                duplicate_ids.insert(pid.to_string());
            } else if !is_seen(pid) && !untouchable.contains(pid) {
                gone.push(pid.to_string());
            }
        })?,
    };
    // A stored parcel where a feature without an id (or a copy of a repeated id) lies, nearly
    // the same box, may be that feature: it is not taken for removed on this layer's word (it
    // keeps its stored state, as a quarantined feature with an id does). Its envelope is read
    // only when there are such features.
    let footprints = unidentified.footprints();
    let mut withheld: Vec<String> = Vec::new();
    for pid in gone {
        let found = match &footprints {
            Some(_) => view.get_with_envelope(&pid)?,
            None => view.get(&pid)?.map(|state| (state, None)),
        };
        let Some((state, envelope)) = found else { continue };
        if envelope.zip(footprints.as_ref()).is_some_and(|(e, f)| f.cover(e)) {
            withheld.push(pid);
        } else {
            removed.push((pid, state));
        }
    }
    changes += removed.len() as u64;

    // The quarantine rows of the duplicates (one per copy).
    let mut duplicate_drafts = Vec::new();
    let mut dup_copies = 0u64;
    if !dup_prints.is_empty() {
        let mut ids: Vec<&String> = duplicate_ids.iter().collect();
        ids.sort();
        for id in ids {
            let Some(indexes) = dup_prints.get(&fingerprint(id)) else { continue };
            dup_copies += indexes.len() as u64;
            // Each copy's row names the first few copies and how many there are: listing every
            // copy in every row was quadratic (100k copies of one id: 80 GB of details).
            let named = &indexes[..indexes.len().min(DUPLICATES_NAMED)];
            let more = indexes.len() - named.len();
            let detail = format!(
                "parcel id {id:?} appears {} times in this layer (features {named:?}{})",
                indexes.len(),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            );
            let raw = serde_json::json!({"parcel_id": crate::util::truncate_text(id, 1024), "copies": indexes.len(), "feature_indexes": named}).to_string();
            for &i in indexes {
                duplicate_drafts.push(QuarantineDraft { feature_index: i, parcel_id: Some(id.clone()), reason: QuarantineReason::DuplicateId, detail: detail.clone(), raw: raw.clone() });
            }
        }
    }
    let mut warnings = crate::ingest::normalize::folded_field_warnings(&folded);
    // A configured effective-date field that no feature has, in any case: renamed or left
    // out of the export, most likely; every parcel's date is then null, said nowhere (a
    // black-box tester; a zoning field so is quarantined, and a case-folded match is said).
    if let Some(field) = rules.fields.effective_date.as_deref() {
        if dated == 0 && seen.len() as u64 > dup_copies {
            warnings.push(format!("no feature has a value in field {field:?} (effective_date): every parcel's effective date is null this run (renamed, or left out of the export?)"));
        }
    }
    warnings.extend(unidentified.warnings(&withheld, removed.len()));
    Ok(ScanResult {
        spill: reader,
        features,
        parcels: seen.len() as u64 - dup_copies,
        repaired,
        quarantined: quarantined + dup_copies,
        // Copies of ids count towards the quarantine-spike hold: a layer more than half of
        // whose features share ids is a `parcel_id` mapped to the wrong field, or a feed
        // that lost its ids, not a few data-entry errors.
        systemic: systemic + dup_copies,
        unreadable_known,
        changes,
        warnings,
        duplicate_ids,
        duplicate_drafts,
        removed,
        previous_parcels,
    })
}

fn worker(
    feat_rx: &Mutex<Receiver<FeatureBatch>>,
    res_tx: std::sync::mpsc::SyncSender<Result<ResultBatch, ScanError>>,
    rules: &NormalizeRules,
    view: &SnapshotView,
    announce: bool,
    snapshot: &OnceLock<Result<SnapshotIndex, String>>,
    cancel: &AtomicBool,
) {
    // After a failure (ours, or the collector gone) the worker keeps taking batches without
    // working on them, so the scanning thread can never block on a full channel: it sees
    // `cancel` and stops, and the channel drains.
    let mut failed = false;
    loop {
        let batch = match feat_rx.lock() {
            Ok(rx) => match rx.recv() {
                Ok(b) => b,
                Err(_) => return,
            },
            Err(_) => return,
        };
        if failed || cancel.load(Ordering::Relaxed) {
            failed = true;
            continue;
        }
        let mut out = ResultBatch { seq: batch.seq, outcomes: Vec::with_capacity(batch.items.len()), framed: Vec::new(), repaired: 0, dated: 0, folded: Vec::new() };
        for &(index, a, b) in &batch.items {
            let json = &batch.text[a..b];
            let mut normalized = normalize_feature(json, rules);
            if batch.not_utf8.binary_search(&index).is_ok() {
                use crate::ingest::normalize::damaged_text;
                normalized = match normalized {
                    // An id with bytes that are not UTF-8 names no stored parcel (`Stra\xDFe-12`
                    // read as `Stra\u{FFFD}e-12` is not `Straße-12`): the feature is taken
                    // without an id, where it lies, so that the parcel it was is kept by place
                    // rather than read as removed and alerted.
                    Ok(n) => match (damaged_text(&[Some(&n.parcel.id)]), damaged_text(&[Some(&n.parcel.state.zoning), n.parcel.state.effective_date.as_deref()])) {
                        (Some(detail), _) => Err(Rejected { parcel_id: None, reason: QuarantineReason::MalformedFeature, detail, footprint: n.parcel.geometry.exterior_envelope() }),
                        // Kept under its id, so that parcel keeps its stored state.
                        (None, Some(detail)) => Err(Rejected { parcel_id: Some(n.parcel.id), reason: QuarantineReason::MalformedFeature, detail, footprint: None }),
                        (None, None) => Ok(n),
                    },
                    Err(rej) if damaged_text(&[rej.parcel_id.as_deref()]).is_some() => {
                        let footprint = rej.footprint.or_else(|| crate::ingest::normalize::footprint_of_feature(json));
                        Err(Rejected { parcel_id: None, footprint, ..rej })
                    }
                    other => other,
                };
            }
            match normalized {
                Ok(n) => {
                    out.repaired += u64::from(n.repaired);
                    out.dated += u64::from(n.parcel.state.effective_date.is_some());
                    for f in n.folded_fields {
                        if !out.folded.contains(&f) {
                            out.folded.push(f);
                        }
                    }
                    let mut p = n.parcel;
                    let stored = match snapshot.get_or_init(|| build_index(view)) {
                        Ok(i) => i,
                        Err(e) => {
                            let _ = res_tx.send(Err(StoreError::Conflict(format!("reading the snapshot: {e}")).into()));
                            cancel.store(true, Ordering::Relaxed);
                            break;
                        }
                    };
                    let print = fingerprint(&p.id);
                    let known = stored.get(print);
                    let prev = match known {
                        None => None,
                        Some(h) if h[..] == p.state.content_hash[..16] => {
                            out.outcomes.push(Outcome::Unchanged { index, print });
                            continue;
                        }
                        Some(_) => match view.get(&p.id) {
                            Ok(prev) => prev,
                            Err(e) => {
                                let _ = res_tx.send(Err(e.into()));
                                cancel.store(true, Ordering::Relaxed);
                                break;
                            }
                        },
                    };
                    let mut delta = classify(prev.as_ref(), &p.state);
                    if let (ParcelDelta::Changed(Some(ChangeKind::GeometryChanged)), Some(prev)) = (&delta, &prev) {
                        match rounded_again(view, &p) {
                            Ok(Some(stored)) => {
                                // The stored shape stands (its hash, area and coordinates), so
                                // only a moved effective date is left to store (not announced,
                                // also when a held run is released: `classify` sees the same
                                // shape then too).
                                p.state.geom_hash = prev.geom_hash;
                                p.state.area_m2 = prev.area_m2;
                                p.state.content_hash = content_hash(&p.state.zoning, p.state.effective_date.as_deref(), &prev.geom_hash);
                                p.geometry = stored;
                                delta = classify(Some(prev), &p.state);
                            }
                            Ok(None) => {}
                            Err(e) => {
                                let _ = res_tx.send(Err(e.into()));
                                cancel.store(true, Ordering::Relaxed);
                                break;
                            }
                        }
                    }
                    let (kind, keep) = match delta {
                        ParcelDelta::Unchanged => (None, false),
                        ParcelDelta::Added => (Some(ChangeKind::Added), true),
                        ParcelDelta::Changed(kind) => (kind, true),
                    };
                    if keep {
                        let mut state = p.state;
                        let prior = match &prev {
                            Some(s) => Prior::of(s),
                            None => match view.prior_of_absent(&p.id) {
                                Ok(prior) => prior,
                                Err(e) => {
                                    let _ = res_tx.send(Err(e.into()));
                                    cancel.store(true, Ordering::Relaxed);
                                    break;
                                }
                            },
                        };
                        let taken = step(prior, content_of(&state), announce && kind.is_some());
                        (state.revision, state.announced) = (taken.revision, taken.announced);
                        let parcel = SpilledParcel {
                            feature_index: index,
                            id: p.id,
                            state,
                            geometry: p.geometry,
                            kind,
                            from: prev.map(|s| s.zoning),
                            key_revision: taken.key_revision,
                        };
                        let start = out.framed.len();
                        if let Err(e) = frame_parcel(&mut out.framed, &parcel) {
                            let _ = res_tx.send(Err(e.into()));
                            cancel.store(true, Ordering::Relaxed);
                            break;
                        }
                        let (was_stored, is_change) = (parcel.from.is_some(), parcel.kind.is_some());
                        out.outcomes.push(Outcome::Upsert { print, index, stored: was_stored, change: is_change, framed: start..out.framed.len() });
                    } else {
                        out.outcomes.push(Outcome::Unchanged { index, print });
                    }
                }
                Err(rej) if rej.reason == QuarantineReason::MalformedFeature && holds_more_than_one_feature(json) => {
                    let message = format!(
                        "feature {index} is not valid JSON and its text holds more than one \"Feature\" (an unescaped quote or an unpaired bracket joined the features after it to it): the layer is refused rather than have the parcels inside it read as removed"
                    );
                    let _ = res_tx.send(Err(IngestError::JoinedFeatures(message).into()));
                    cancel.store(true, Ordering::Relaxed);
                    break;
                }
                Err(rej) => out.outcomes.push(Outcome::Rejected {
                    draft: QuarantineDraft {
                        feature_index: index,
                        parcel_id: rej.parcel_id,
                        reason: rej.reason,
                        detail: rej.detail,
                        raw: crate::util::truncate_text(json, 16 * 1024),
                    },
                    footprint: rej.footprint,
                }),
            }
        }
        if cancel.load(Ordering::Relaxed) || res_tx.send(Ok(out)).is_err() {
            cancel.store(true, Ordering::Relaxed);
            failed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> ([u64; 2], [u8; 16]) {
        (fingerprint(&format!("P-{i}")), [(i % 251) as u8; 16])
    }

    #[test]
    fn snapshot_index_finds_every_stored_id_and_nothing_else() {
        for n in [0u64, 1, 2, 3, 7, 8, 1000, 4096, 5000] {
            let index = SnapshotIndex::new((0..n).map(entry).collect()).unwrap();
            assert_eq!(index.len() as u64, n);
            for i in 0..n {
                assert_eq!(index.get(entry(i).0), Some(entry(i).1), "n={n} i={i}");
            }
            for i in n..n + 500 {
                assert_eq!(index.get(entry(i).0), None, "n={n} absent {i}");
            }
        }
        // Extremes of the fingerprint space land in the first and the last bucket.
        let edges = vec![([0, 0], [1; 16]), ([0, 5], [2; 16]), ([u64::MAX, 0], [3; 16]), ([u64::MAX, u64::MAX], [4; 16])];
        let index = SnapshotIndex::new(edges.clone()).unwrap();
        for (print, hash) in edges {
            assert_eq!(index.get(print), Some(hash));
        }
        assert_eq!(index.get([u64::MAX, 1]), None);
        assert_eq!(index.get([1, 0]), None);
    }

    #[test]
    fn a_capped_directory_still_finds_everything_in_its_larger_buckets() {
        // What a layer of more than 2^24 parcels gets, at a size a test can afford: 5,000
        // entries over 2^4 buckets, ~300 entries in each.
        let index = SnapshotIndex::with_max_bits((0..5000).map(entry).collect(), 4).unwrap();
        assert_eq!(index.dir.len(), 17);
        for i in 0..5000 {
            assert_eq!(index.get(entry(i).0), Some(entry(i).1), "{i}");
        }
        for i in 5000..5500 {
            assert_eq!(index.get(entry(i).0), None, "absent {i}");
        }
    }
}
