//! A paged layer's features, collected on disk as its pages come in.
//!
//! A portal layer (ArcGIS, OGC API, Socrata) arrives a page at a time, and a run needs it
//! whole — complete, deduplicated and in an order that does not depend on paging — before
//! its digest means anything. Held in memory, a county's layer took several times its text
//! (3.5 GiB as `serde_json::Value`s for a 1M-parcel layer of 259 MiB, ~2.5× as strings).
//! A [`FeatureSpool`] writes each feature's JSON text to an anonymous temp file next to the
//! store as its page arrives; memory keeps 24 bytes per feature (where its text is) and its
//! id field's value (the sort key), plus a 64-bit hash per object id when pages are
//! deduplicated. [`FeatureSpool::write_collection`] then writes the FeatureCollection in
//! order (a long run of equal ids takes some 32–50 bytes per feature more while it is
//! sorted), and the run scans what it wrote as it scans a local file.
//!
//! The order (by the id field's value as bytes, then by the feature's text) and the bytes
//! (each feature as `serde_json` writes it compactly, `,` between, no whitespace) are the
//! layer's identity: its digest must not move from one fetch of the same data to the next.

use super::http::FetchError;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Where one feature's text lies in the spool file, and its sort key in the id arena.
#[derive(Debug, Clone, Copy)]
struct Entry {
    id_at: u64,
    at: u64,
    id_len: u32,
    len: u32,
}

/// The features of one scan pass, text on disk, index in memory (see the module doc).
pub struct FeatureSpool {
    file: BufWriter<File>,
    /// The directory of the temp file, for error messages.
    dir: PathBuf,
    /// Bytes written to the file so far: where the next record starts.
    end: u64,
    /// The id field values, end to end; entries point into it.
    ids: Vec<u8>,
    entries: Vec<Entry>,
    /// Object id → entry, for a scan that deduplicates: the key's 64-bit hash (keyed per
    /// spool, so a server cannot aim collisions at it) maps to the entry that holds it. The
    /// key's text is in the file just before its feature, so a hit is checked against it;
    /// a key whose hash another key took lives in `overflow` by its text.
    keys: HashMap<u64, u32>,
    overflow: HashMap<String, u32>,
    hasher: std::collections::hash_map::RandomState,
    /// Reused for each feature's text.
    text: Vec<u8>,
}

impl std::fmt::Debug for FeatureSpool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeatureSpool").field("dir", &self.dir).field("features", &self.entries.len()).field("bytes", &self.end).finish()
    }
}

impl FeatureSpool {
    /// An empty spool whose temp file lives in `dir` (removed when the spool is dropped,
    /// and by the OS if the process dies).
    pub fn new(dir: &Path) -> Result<FeatureSpool, FetchError> {
        let file = tempfile::tempfile_in(dir).map_err(|e| FetchError::spool(dir, e))?;
        Ok(FeatureSpool {
            file: BufWriter::with_capacity(1 << 20, file),
            dir: dir.to_path_buf(),
            end: 0,
            ids: Vec::new(),
            entries: Vec::new(),
            keys: HashMap::new(),
            overflow: HashMap::new(),
            hasher: Default::default(),
            text: Vec::new(),
        })
    }

    /// Features held (a replaced one counts once).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no feature is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds a feature; its sort key is the value of `id_field` in its properties (a string
    /// as it is, anything else as JSON, empty when absent). With a `key` (an ArcGIS object
    /// id), a feature already held under the same key is replaced by this one — a page read
    /// twice — and `false` is returned; otherwise `true`.
    pub fn push(&mut self, key: Option<&str>, feature: &Value, id_field: &str) -> Result<bool, FetchError> {
        let slot = match key {
            Some(k) => self.slot_of(k)?,
            None => None,
        };
        let id_at = self.ids.len() as u64;
        match feature.get("properties").and_then(|p| p.get(id_field)) {
            Some(Value::String(s)) => self.ids.extend_from_slice(s.as_bytes()),
            Some(v) => serde_json::to_writer(&mut self.ids, v).map_err(|e| FetchError::spool(&self.dir, e.into()))?,
            None => {}
        }
        let id_len = self.ids.len() as u64 - id_at;
        if let Some(k) = key {
            let key_len = u32::try_from(k.len()).map_err(|_| FetchError::spool(&self.dir, std::io::Error::other("an object id is larger than 4 GiB")))?;
            self.write(k.as_bytes())?;
            self.write(&key_len.to_le_bytes())?;
        }
        self.text.clear();
        serde_json::to_writer(&mut self.text, feature).map_err(|e| FetchError::spool(&self.dir, e.into()))?;
        let at = self.end;
        self.file.write_all(&self.text).map_err(|e| FetchError::spool(&self.dir, e))?;
        self.end += self.text.len() as u64;
        let (Ok(id_len), Ok(len)) = (u32::try_from(id_len), u32::try_from(self.text.len())) else {
            return Err(FetchError::spool(&self.dir, std::io::Error::other("a feature or its id is larger than 4 GiB")));
        };
        let entry = Entry { id_at, at, id_len, len };
        match slot {
            Some(i) => {
                self.entries[i as usize] = entry;
                Ok(false)
            }
            None => {
                let i = u32::try_from(self.entries.len()).map_err(|_| FetchError::spool(&self.dir, std::io::Error::other("more than 4 billion features")))?;
                if let Some(k) = key {
                    let h = self.hasher.hash_one(k);
                    if let std::collections::hash_map::Entry::Vacant(v) = self.keys.entry(h) {
                        v.insert(i);
                    } else {
                        self.overflow.insert(k.to_string(), i);
                    }
                }
                self.entries.push(entry);
                Ok(true)
            }
        }
    }

    /// The entry already holding `key`, if any.
    fn slot_of(&mut self, key: &str) -> Result<Option<u32>, FetchError> {
        let h = self.hasher.hash_one(key);
        let Some(&i) = self.keys.get(&h) else { return Ok(None) };
        if self.stored_key(i)? == key.as_bytes() {
            return Ok(Some(i));
        }
        Ok(self.overflow.get(key).copied())
    }

    /// The key written before entry `i`'s text: `[key][key length, u32 LE][text]`.
    fn stored_key(&mut self, i: u32) -> Result<Vec<u8>, FetchError> {
        self.file.flush().map_err(|e| FetchError::spool(&self.dir, e))?;
        let at = self.entries[i as usize].at;
        let mut len = [0u8; 4];
        let len_at = at.checked_sub(4).ok_or_else(|| FetchError::spool(&self.dir, corrupt()))?;
        read_at(self.file.get_ref(), len_at, &mut len).map_err(|e| FetchError::spool(&self.dir, e))?;
        let len = u32::from_le_bytes(len) as u64;
        let key_at = len_at.checked_sub(len).ok_or_else(|| FetchError::spool(&self.dir, corrupt()))?;
        let mut key = vec![0u8; len as usize];
        read_at(self.file.get_ref(), key_at, &mut key).map_err(|e| FetchError::spool(&self.dir, e))?;
        Ok(key)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), FetchError> {
        self.file.write_all(bytes).map_err(|e| FetchError::spool(&self.dir, e))?;
        self.end += bytes.len() as u64;
        Ok(())
    }

    /// Writes the features as one FeatureCollection to `out`, sorted by their id field's
    /// value (bytes), then by their text; returns the bytes written. Features with equal
    /// ids (a shared APN, or many features whose id is null or missing) are ordered by
    /// their texts read back from the file, never by loading them all ([`sort_by_text`]).
    pub fn write_collection<W: Write>(self, out: &mut W) -> std::io::Result<u64> {
        let FeatureSpool { file, dir, ids, mut entries, keys, overflow, text, .. } = self;
        // The object-id maps served the pages' dedup only, and the push buffer holds the
        // largest feature: free them before sorting.
        drop((keys, overflow, text));
        // An error of the spool's own file says so (the caller names where it was writing).
        let spool_err = |e: std::io::Error| std::io::Error::new(e.kind(), format!("reading the collected features back from a temp file in {}: {e}", dir.display()));
        let file = file.into_inner().map_err(|e| spool_err(e.into_error()))?;
        let id = |e: &Entry| &ids[e.id_at as usize..(e.id_at + e.id_len as u64) as usize];
        entries.sort_unstable_by(|a, b| id(a).cmp(id(b)));
        let mut buffers = SortBuffers::default();
        let mut start = 0;
        while start < entries.len() {
            let key = id(&entries[start]);
            let run = entries[start..].iter().take_while(|e| id(e) == key).count();
            sort_by_text(&file, &mut entries[start..start + run], &mut buffers).map_err(spool_err)?;
            start += run;
        }
        const HEAD: &[u8] = b"{\"type\":\"FeatureCollection\",\"features\":[";
        out.write_all(HEAD)?;
        let mut written = HEAD.len() as u64;
        let mut text = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if i > 0 {
                out.write_all(b",")?;
                written += 1;
            }
            text_of(&file, e, &mut text).map_err(spool_err)?;
            out.write_all(&text)?;
            written += text.len() as u64;
        }
        out.write_all(b"]}")?;
        Ok(written + 2)
    }

    /// The collection as bytes (tests and small layers).
    pub fn into_bytes(self) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.end as usize + 64);
        self.write_collection(&mut out)?;
        Ok(out)
    }
}

/// Runs of equal ids up to this long are sorted by reading two texts per comparison.
const SHORT_RUN: usize = 32;

/// How many times a group of features tied on their keys is keyed again, further into
/// their texts, before it is merge-sorted by reading texts back (bounds the passes a
/// hostile layer of texts sharing ever longer prefixes can cause).
const KEY_ROUNDS: u32 = 6;

/// Buffers reused from one run of equal ids to the next.
#[derive(Default)]
struct SortBuffers {
    left: Vec<u8>,
    right: Vec<u8>,
    merged: Vec<Entry>,
}

/// Orders a run of features with equal ids by their texts (bytes). A short run reads both
/// texts back at every comparison. A long one (a layer whose id is missing or null for many
/// features) would need O(n log n) reads that way — most of a 22–29 s run for a 1M-feature
/// layer without ids, measured — so it is keyed instead ([`key_group`]): read twice in file
/// order, once for the prefix all its texts share (say `{"geometry":{"coordinates":[[[`),
/// once for the 8 bytes after it, which order it in memory. Features tied on those 8 bytes form
/// groups; a group longer than [`SHORT_RUN`] is keyed again, past its own shared prefix (one
/// feature of another shape in the run — a MultiPolygon, a null geometry — shortens the run's
/// prefix to where the shapes differ, and the next round finds where the group's texts do),
/// up to [`KEY_ROUNDS`] times; then it, and every short group, is merge-sorted by texts.
fn sort_by_text(file: &File, run: &mut [Entry], buf: &mut SortBuffers) -> std::io::Result<()> {
    let SortBuffers { left, right, merged } = buf;
    let mut by_text = |a: &Entry, b: &Entry| -> std::io::Result<std::cmp::Ordering> {
        text_of(file, a, left)?;
        text_of(file, b, right)?;
        Ok(left.as_slice().cmp(right.as_slice()))
    };
    // Groups of `run` still to be ordered: (start, length, rounds of keying so far).
    let mut todo = vec![(0, run.len(), 0u32)];
    while let Some((start, len, round)) = todo.pop() {
        let group = &mut run[start..start + len];
        if len <= SHORT_RUN || round == KEY_ROUNDS {
            merge_sort(group, merged, &mut by_text)?;
            continue;
        }
        for (at, tied) in key_group(file, group)? {
            todo.push((start + at, tied, round + 1));
        }
    }
    Ok(())
}

/// Orders `group` by the 8 bytes that follow the prefix all its texts share (see
/// [`sort_by_text`]) and returns the stretches of it (start, length) tied on those bytes,
/// each longer than one feature, still to be ordered; none when every text is the same (any
/// order writes the same bytes). A text ending inside its 8 bytes is padded with zeros; the
/// padding never decides an order, since no text is a strict prefix of another (each is one
/// JSON object) — and two texts whose keys tie while one ends inside them are equal, as
/// compact JSON has no NUL byte.
fn key_group(file: &File, group: &mut [Entry]) -> std::io::Result<Vec<(usize, usize)>> {
    group.sort_unstable_by_key(|e| e.at);
    let mut first: Option<Vec<u8>> = None;
    let (mut shared, mut all_equal) = (0, true);
    for_each_text(file, group, |_, text| {
        match &first {
            None => {
                shared = text.len();
                first = Some(text.to_vec());
            }
            Some(first) => {
                shared = first[..shared].iter().zip(text).take_while(|(a, b)| a == b).count();
                all_equal &= text.len() == first.len() && shared == first.len();
            }
        }
        Ok(())
    })?;
    drop(first);
    if all_equal {
        return Ok(Vec::new());
    }
    let mut keyed: Vec<(u64, Entry)> = Vec::with_capacity(group.len());
    for_each_text(file, group, |e, text| {
        let tail = text.get(shared..).unwrap_or_default();
        let mut key = [0u8; 8];
        let n = tail.len().min(8);
        key[..n].copy_from_slice(&tail[..n]);
        keyed.push((u64::from_be_bytes(key), *e));
        Ok(())
    })?;
    keyed.sort_unstable_by_key(|&(key, _)| key);
    for (slot, &(_, e)) in group.iter_mut().zip(&keyed) {
        *slot = e;
    }
    let mut ties = Vec::new();
    let mut start = 0;
    while start < keyed.len() {
        let tied = keyed[start..].iter().take_while(|(key, _)| *key == keyed[start].0).count();
        if tied > 1 {
            ties.push((start, tied));
        }
        start += tied;
    }
    Ok(ties)
}

/// Calls `f` with each entry's text, `entries` in file order: one read covers as many
/// consecutive entries as end within 1 MiB of the first one's start and lie at most 1 KiB
/// after the one before, so a stretch of adjacent features costs one read and features
/// apart one read each. The bytes read are at most the entries' texts and 1 KiB per entry
/// (a tied group scattered through the file is not read with the file between its members).
fn for_each_text<F>(file: &File, entries: &[Entry], mut f: F) -> std::io::Result<()>
where
    F: FnMut(&Entry, &[u8]) -> std::io::Result<()>,
{
    const WINDOW: u64 = 1 << 20;
    const GAP: u64 = 1 << 10;
    let mut buf = Vec::new();
    let mut i = 0;
    while i < entries.len() {
        let start = entries[i].at;
        let mut end = start + entries[i].len as u64;
        let mut j = i + 1;
        while let Some(e) = entries.get(j) {
            let e_end = e.at + e.len as u64;
            if e.at < start || e_end - start > WINDOW || e.at > end + GAP {
                break;
            }
            end = end.max(e_end);
            j += 1;
        }
        buf.resize((end - start) as usize, 0);
        read_at(file, start, &mut buf)?;
        #[cfg(test)]
        BYTES_READ_IN_WINDOWS.with(|n| n.set(n.get() + buf.len() as u64));
        for e in &entries[i..j] {
            let from = (e.at - start) as usize;
            f(e, &buf[from..from + e.len as usize])?;
        }
        i = j;
    }
    Ok(())
}

/// Sorts `v` (stable) with a comparison that can fail (it reads texts back from the spool):
/// the first error ends the sort and is returned. The standard sorts take an infallible
/// comparison, and one that papered over an error would not be a total order.
fn merge_sort<F>(v: &mut [Entry], merged: &mut Vec<Entry>, cmp: &mut F) -> std::io::Result<()>
where
    F: FnMut(&Entry, &Entry) -> std::io::Result<std::cmp::Ordering>,
{
    let n = v.len();
    if n < 2 {
        return Ok(());
    }
    let mid = n / 2;
    merge_sort(&mut v[..mid], merged, cmp)?;
    merge_sort(&mut v[mid..], merged, cmp)?;
    merged.clear();
    let (mut i, mut j) = (0, mid);
    while i < mid && j < n {
        if cmp(&v[j], &v[i])? == std::cmp::Ordering::Less {
            merged.push(v[j]);
            j += 1;
        } else {
            merged.push(v[i]);
            i += 1;
        }
    }
    merged.extend_from_slice(&v[i..mid]);
    merged.extend_from_slice(&v[j..]);
    v.copy_from_slice(merged);
    Ok(())
}

/// Reads entry `e`'s text into `buf`.
fn text_of(file: &File, e: &Entry, buf: &mut Vec<u8>) -> std::io::Result<()> {
    #[cfg(test)]
    TEXTS_READ_ONE_BY_ONE.with(|n| n.set(n.get() + 1));
    buf.resize(e.len as usize, 0);
    read_at(file, e.at, buf)
}

#[cfg(unix)]
fn read_at(file: &File, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

#[cfg(not(unix))]
fn read_at(mut file: &File, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(at))?;
    let read = file.read_exact(buf);
    // Appends go on at the end: put the cursor back whatever the read did.
    file.seek(SeekFrom::End(0))?;
    read
}

#[cfg(test)]
thread_local! {
    /// Texts read back one at a time on this thread ([`text_of`]), for the tests to see
    /// which way a run was sorted.
    static TEXTS_READ_ONE_BY_ONE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Bytes [`for_each_text`] read on this thread.
    static BYTES_READ_IN_WINDOWS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn corrupt() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, "the spool file does not hold what its index says")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn feature(apn: Value, zone: &str) -> Value {
        json!({"type": "Feature", "properties": {"APN": apn, "ZONE": zone}, "geometry": null})
    }

    /// The reference: every feature's text in memory, sorted by (id, text).
    fn reference(features: &[Value]) -> Vec<u8> {
        let mut pairs: Vec<(Vec<u8>, String)> = features
            .iter()
            .map(|f| {
                let id = match f["properties"].get("APN") {
                    Some(Value::String(s)) => s.as_bytes().to_vec(),
                    Some(v) => v.to_string().into_bytes(),
                    None => Vec::new(),
                };
                (id, f.to_string())
            })
            .collect();
        pairs.sort();
        let texts: Vec<String> = pairs.into_iter().map(|(_, t)| t).collect();
        format!("{{\"type\":\"FeatureCollection\",\"features\":[{}]}}", texts.join(",")).into_bytes()
    }

    /// Calls `check` with `features` in six arrival orders (rotated by `step`, every other
    /// one reversed).
    fn in_arrival_orders(features: &mut [Value], step: usize, mut check: impl FnMut(usize, &[Value])) {
        for round in 0..6 {
            features.rotate_left(step);
            if round % 2 == 1 {
                features.reverse();
            }
            check(round, features);
        }
    }

    #[test]
    fn the_collection_is_sorted_by_id_then_text_whatever_the_arrival_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut features = vec![
            feature(json!("b"), "R1"),
            feature(json!("a"), "R2"),
            feature(json!("a"), "C1"),
            feature(json!(12), "R1"),
            feature(json!("ä"), "R1"),
            json!({"type": "Feature", "properties": {"ZONE": "X"}, "geometry": null}),
            json!({"type": "Feature", "properties": {"ZONE": "W"}, "geometry": null}),
            feature(json!("a"), "C1"),
        ];
        // A long run of equal ids, in no order: sorted by text through its keys.
        features.extend((0..37).map(|k| feature(json!("same"), &format!("Z{}", (k * 17) % 37))));
        let want = reference(&features);
        in_arrival_orders(&mut features, 3, |round, features| {
            let mut spool = FeatureSpool::new(dir.path()).unwrap();
            for f in features {
                assert!(spool.push(None, f, "APN").unwrap());
            }
            assert_eq!(spool.len(), features.len());
            let got = spool.into_bytes().unwrap();
            assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want), "round {round}");
            let _: Value = serde_json::from_slice(&got).expect("valid JSON");
        });
        let empty = FeatureSpool::new(dir.path()).unwrap().into_bytes().unwrap();
        assert_eq!(empty, b"{\"type\":\"FeatureCollection\",\"features\":[]}");
    }

    /// A long run of features without the id field (what a layer with many missing ids
    /// makes) goes through the in-memory 8-byte keys: texts that tie on those bytes, and
    /// texts that differ only in their last bytes (and end inside their keys) must still
    /// come out in byte order, as the reference sorts them.
    #[test]
    fn a_long_run_of_missing_ids_is_sorted_by_text_through_its_keys() {
        let dir = tempfile::tempdir().unwrap();
        let short = |k: u32| json!({"type": "Feature", "properties": {"ZONE": "Q"}, "geometry": null, "x": k});
        // Alone in their run, these share all but their last 2–4 bytes.
        let mut nearly_equal: Vec<Value> = (0..40).map(|k| short((k * 13) % 101)).collect();
        nearly_equal.push(json!({"type": "Feature", "properties": {"ZONE": "Q"}, "geometry": null}));
        let mut features: Vec<Value> = [1, 10, 100, 2, 20, 9, 0, 11].into_iter().map(short).collect();
        // Ties on the 8 bytes, told apart far later.
        for k in 0..30 {
            let zone = format!("Q{}-a-long-common-middle-{}", k % 4, (k * 7) % 30);
            features.push(json!({"type": "Feature", "properties": {"ZONE": zone}, "geometry": null}));
        }
        // Texts longer than a read's 1 MiB window, between the others.
        for zone in ["B".repeat(1_500_000), "C".repeat(1 << 20)] {
            features.insert(features.len() / 2, json!({"type": "Feature", "properties": {"ZONE": zone}, "geometry": null}));
        }
        // Identical texts, and two features that do have an id.
        features.push(json!({"type": "Feature", "properties": {"ZONE": "Q"}, "geometry": null, "x": 2}));
        features.push(feature(json!("a"), "R1"));
        features.push(feature(json!(""), "R1"));
        for mut features in [features, nearly_equal] {
            let want = reference(&features);
            in_arrival_orders(&mut features, 5, |round, features| {
                let mut spool = FeatureSpool::new(dir.path()).unwrap();
                for (i, f) in features.iter().enumerate() {
                    // Object ids, so the file holds keys between the texts the reads skip.
                    assert!(spool.push(Some(&i.to_string()), f, "APN").unwrap());
                }
                let got = spool.into_bytes().unwrap();
                assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want), "round {round}");
            });
        }
    }

    /// A run whose texts differ early for a few features (a null geometry, MultiPolygons
    /// among Polygons) is keyed again past each tied group's own shared prefix: few texts are
    /// read back one by one (the output's one read per feature, and short tied groups'),
    /// where a single keying would merge-sort nearly the whole run by reading texts back;
    /// and a tied group scattered through the file is read without the bytes between its
    /// members (each round reads about the run's texts twice, not the file once per group).
    #[test]
    fn a_long_run_of_mixed_shapes_is_keyed_again_not_read_back_per_comparison() {
        let dir = tempfile::tempdir().unwrap();
        let n = 2000u64;
        let mut features: Vec<Value> = (0..n)
            .map(|i| {
                // Lots along a street, first vertices 0.00001° apart in a scrambled order.
                let x = -122.0 - ((i * 7919) % n) as f64 * 0.00001;
                let ring = json!([[x, 37.3], [x + 0.0001, 37.3], [x + 0.0001, 37.3001], [x, 37.3]]);
                let geometry = if i % 50 == 0 { json!({"type": "MultiPolygon", "coordinates": [[ring]]}) } else { json!({"type": "Polygon", "coordinates": [ring]}) };
                json!({"type": "Feature", "properties": {"ZONE": "R1"}, "geometry": geometry})
            })
            .collect();
        features.push(json!({"type": "Feature", "properties": {"ZONE": "R1"}, "geometry": null}));
        // Identical texts, more than a short group's worth: written, never compared.
        features.extend(std::iter::repeat_n(json!({"type": "Feature", "properties": {}, "geometry": null}), 200));
        let want = reference(&features);
        let mut spool = FeatureSpool::new(dir.path()).unwrap();
        for f in &features {
            spool.push(None, f, "APN").unwrap();
        }
        let spooled = spool.end;
        let before = (TEXTS_READ_ONE_BY_ONE.with(|c| c.get()), BYTES_READ_IN_WINDOWS.with(|c| c.get()));
        let got = spool.into_bytes().unwrap();
        let read = TEXTS_READ_ONE_BY_ONE.with(|c| c.get()) - before.0;
        let windows = BYTES_READ_IN_WINDOWS.with(|c| c.get()) - before.1;
        assert!(windows <= 8 * spooled, "{windows} bytes read in windows from a {spooled}-byte spool");
        assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want));
        let total = features.len() as u64;
        assert!(read < total + total / 4, "{read} texts read one by one for {total} features");
    }

    /// The digest of this collection as the in-memory collector before the spool wrote it
    /// (`9135d68`, `arcgis::feature_collection`): a layer's digest is its version's
    /// identity, so an upgrade must not make an unchanged portal layer look new.
    #[test]
    fn the_collection_has_the_bytes_the_in_memory_collector_had() {
        let features: Vec<Value> = serde_json::from_str(
            r#"[{"type":"Feature","properties":{"APN":"b-2","ZONE":"R1"},"geometry":{"type":"Point","coordinates":[-71.1,42.3]}},
                {"type":"Feature","properties":{"APN":12,"ZONE":"C"},"geometry":null},
                {"type":"Feature","properties":{"APN":"Ä-1","ZONE":"Wohn"},"geometry":null},
                {"type":"Feature","properties":{"ZONE":"none"},"geometry":null},
                {"type":"Feature","properties":{"APN":"a","ZONE":"R2"},"geometry":null},
                {"type":"Feature","properties":{"APN":"a","ZONE":"C1"},"geometry":null},
                {"type":"Feature","properties":{"APN":null,"ZONE":"x"},"geometry":null},
                {"type":"Feature","properties":{"APN":"","ZONE":"e"},"geometry":null},
                {"type":"Feature","properties":{"APN":"a","ZONE":"C1"},"geometry":null}]"#,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut spool = FeatureSpool::new(dir.path()).unwrap();
        for f in &features {
            spool.push(None, f, "APN").unwrap();
        }
        let bytes = spool.into_bytes().unwrap();
        assert_eq!(
            super::super::source::digest(&bytes),
            "1e950720dcd23889e755e09ee7d67f1490ea6668befdc7155b0f5a67babb13c9",
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }

    #[test]
    fn a_key_seen_again_replaces_its_feature_and_colliding_hashes_stay_apart() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = FeatureSpool::new(dir.path()).unwrap();
        assert!(spool.push(Some("1"), &feature(json!("p1"), "R1"), "APN").unwrap());
        assert!(spool.push(Some("2"), &feature(json!("p2"), "R1"), "APN").unwrap());
        // The same object id again (a page read twice): its newer text wins, counted once.
        assert!(!spool.push(Some("1"), &feature(json!("p1"), "C2"), "APN").unwrap());
        // Force a hash collision: "3"'s hash is made to point at "2"'s entry, whose stored
        // key is "2". "3" must still be a new feature, and "2" and "3" each be found again
        // as themselves.
        let i2 = spool.keys[&spool.hasher.hash_one("2")];
        spool.keys.insert(spool.hasher.hash_one("3"), i2);
        assert!(spool.push(Some("3"), &feature(json!("p3"), "R1"), "APN").unwrap());
        assert!(!spool.push(Some("3"), &feature(json!("p3"), "R9"), "APN").unwrap());
        assert!(!spool.push(Some("2"), &feature(json!("p2"), "R7"), "APN").unwrap());
        assert_eq!(spool.len(), 3);
        let text = String::from_utf8(spool.into_bytes().unwrap()).unwrap();
        let want = reference(&[feature(json!("p1"), "C2"), feature(json!("p2"), "R7"), feature(json!("p3"), "R9")]);
        assert_eq!(text, String::from_utf8(want).unwrap());
    }

    #[test]
    fn a_spool_that_cannot_be_made_says_where() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-dir");
        let err = FeatureSpool::new(&missing).unwrap_err().to_string();
        assert!(err.contains("no-such-dir"), "{err}");
    }
}
