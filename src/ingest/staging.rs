//! Two small guards around a source run:
//!
//! * **staging**: the raw payload of an HTTP source's last fetch is kept on disk with its
//!   digest and portal signals (`<store>.staging/<source>.geojson` + `.json`), so
//!   `zonewatch run --source ID --from-staging` re-processes it without touching the portal
//!   (after a mapping fix, or to replay a failed parse). The digest is re-checked on read.
//!   A fetched layer is put there from disk — a `geojson_url` body is received into a temp
//!   file in the staging directory and renamed into place ([`body_file`], [`stage_body`]),
//!   a paged layer is written from its on-disk collection ([`stage_features`]) — and
//!   scanned from that file, so a county layer never sits in memory whole.
//! * **lease**: one run per source at a time in this process (the store file lock keeps other
//!   processes out). A trigger while a run is going is recorded as `skipped_overlap`.

use super::collect::FeatureSpool;
use super::http::{BodyFile, FetchError, ReceivedBody};
use super::portal::PortalMeta;
use super::source::{DigestingReader, DigestingWriter};
use super::IngestError;
use std::io::{BufWriter, Seek, SeekFrom};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The sidecar describing a staged payload.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StagedMeta {
    pub source_id: String,
    pub digest: String,
    pub size: u64,
    pub fetched_at_ms: u64,
    pub publisher_ts_ms: Option<u64>,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    pub schema_hash: Option<String>,
}

/// `<store>.staging/`
pub fn staging_dir(store_path: &Path) -> PathBuf {
    let mut s = store_path.as_os_str().to_owned();
    s.push(".staging");
    PathBuf::from(s)
}

/// Where `source_id`'s staged payload is (`<store>.staging/<source>.geojson`).
pub fn payload_path(store_path: &Path, source_id: &str) -> PathBuf {
    paths(store_path, source_id).0
}

fn paths(store_path: &Path, source_id: &str) -> (PathBuf, PathBuf) {
    let dir = staging_dir(store_path);
    (dir.join(format!("{source_id}.geojson")), dir.join(format!("{source_id}.json")))
}

/// A temp file `<name>.XXXXXX.tmp` in `dir` (the names [`is_staging_temp`] sweeps, and
/// those of `util::write_atomic`, which writes the sidecars), removed unless persisted.
fn temp_beside(dir: &Path, name: &str) -> std::io::Result<tempfile::NamedTempFile> {
    tempfile::Builder::new().prefix(&format!("{name}.")).suffix(".tmp").tempfile_in(dir)
}

/// A temp file for `source_id`'s next payload in the staging directory (created if needed),
/// to be renamed into place once complete ([`put_in_place`]).
fn payload_temp(store_path: &Path, source_id: &str) -> std::io::Result<tempfile::NamedTempFile> {
    let dir = staging_dir(store_path);
    std::fs::create_dir_all(&dir)?;
    temp_beside(&dir, &format!("{source_id}.geojson"))
}

/// A layer written out for its run to scan: an open handle at its first byte, and the
/// digest and size of its bytes.
#[derive(Debug)]
pub struct StagedLayer {
    pub file: std::fs::File,
    /// Where it is: the staged payload, or the directory of the anonymous temp file it went
    /// to when staging failed (for messages).
    pub path: PathBuf,
    /// Hex sha256.
    pub digest: String,
    pub size: u64,
}

/// Writes the sidecar describing the payload just staged (payload first, sidecar last: a
/// sidecar always describes a complete payload).
fn write_sidecar(store_path: &Path, source_id: &str, digest: &str, size: u64, meta: &PortalMeta, now_ms: u64) -> Result<(), IngestError> {
    let (_, sidecar) = paths(store_path, source_id);
    let m = StagedMeta {
        source_id: source_id.to_string(),
        digest: digest.to_string(),
        size,
        fetched_at_ms: now_ms,
        publisher_ts_ms: meta.publisher_ts_ms,
        etag: meta.etag.clone(),
        last_modified: meta.last_modified.clone(),
        schema_hash: meta.schema_hash.clone(),
    };
    let text = serde_json::to_vec_pretty(&m).map_err(|e| IngestError::Malformed(e.to_string()))?;
    crate::util::write_atomic(&sidecar, &text).map_err(|e| IngestError::write(sidecar, e))
}

/// The file a `geojson_url` body of `source_id` is received into: a temp file in the staging
/// directory, named as [`is_staging_temp`] knows (one a run killed while fetching left is
/// swept first, so disk never holds two), so that [`stage_body`] renames it into the staged
/// payload instead of copying the layer. When the staging directory cannot be used, an
/// anonymous temp file in `scratch` (logged; the run then scans it unstaged).
pub fn body_file(store_path: &Path, source_id: &str, scratch: &Path) -> Result<BodyFile, FetchError> {
    let dir = staging_dir(store_path);
    sweep(store_path, Some(source_id), None);
    match payload_temp(store_path, source_id) {
        Ok(tmp) => Ok(BodyFile::named(tmp, &dir)),
        Err(e) => {
            tracing::warn!(source = source_id, "cannot receive the layer in {}: {e}; it goes to a temp file and is not staged", dir.display());
            BodyFile::new(scratch)
        }
    }
}

/// Stages a `geojson_url` body received whole ([`body_file`]): the previous staged version
/// is removed ([`forget_staged`]), then the body's file is renamed into the staged payload
/// and its sidecar written, with the digest and size it was received with (the run's scan
/// checks the bytes it reads against them). Nothing is copied. A body that could not be
/// named in the staging directory (it is in the scratch directory), or whose previous version cannot be
/// removed, is scanned where it is (logged); the previous version is removed all the same
/// when it can be, so that `--from-staging` never replays an older version than the run's.
pub fn stage_body(store_path: &Path, source_id: &str, body: ReceivedBody, meta: &PortalMeta, now_ms: u64) -> StagedLayer {
    let ReceivedBody { file, name, dir, digest, size } = body;
    let path = match name {
        // Not stageable (logged by `body_file`); what was staged before is older than this.
        None => {
            if let Err(e) = forget_staged(store_path, source_id, None) {
                tracing::warn!(source = source_id, "{e}");
            }
            dir
        }
        Some(name) => match forget_staged(store_path, source_id, Some(&name)) {
            Ok(()) => put_in_place(store_path, source_id, name, &digest, size, meta, now_ms),
            Err(e) => {
                tracing::warn!(source = source_id, "cannot stage the payload: {e}; the run reads the layer as received");
                dir
            }
        },
    };
    StagedLayer { file, path, digest, size }
}

/// Renames a complete payload's temp file into the staged payload and writes its sidecar
/// (payload first, sidecar last); returns where the payload now is — the staging directory
/// when the rename failed (the temp file is gone then; only its open handle reads it). A
/// failure is logged: the run goes on with nothing to replay.
fn put_in_place(store_path: &Path, source_id: &str, tmp: tempfile::TempPath, digest: &str, size: u64, meta: &PortalMeta, now_ms: u64) -> PathBuf {
    let (payload, _) = paths(store_path, source_id);
    match tmp.persist(&payload) {
        Ok(()) => {
            if let Err(e) = write_sidecar(store_path, source_id, digest, size, meta, now_ms) {
                tracing::warn!(source = source_id, "could not stage the payload: {e}");
            }
            payload
        }
        Err(e) => {
            tracing::warn!(source = source_id, "could not stage the payload as {}: {}", payload.display(), e.error);
            staging_dir(store_path)
        }
    }
}

/// Writes a paged layer's collection as the source's staged payload ([`stage_with`]).
pub fn stage_features(store_path: &Path, source_id: &str, features: FeatureSpool, meta: &PortalMeta, now_ms: u64, scratch: &Path) -> Result<StagedLayer, IngestError> {
    stage_with(store_path, source_id, meta, now_ms, scratch, |out| features.write_collection(out).map(|_| ()))
}

/// Removes `source_id`'s staged sidecar and payload before a new payload is written (and
/// the temp files a run killed while staging left behind): a payload is replayable only
/// once its own sidecar is written, so a staging that fails half way leaves nothing to
/// replay rather than an older version that still matches its sidecar — and the old payload
/// does not take disk space beside the new one. Both removals are tried; an error says an
/// older version may still be replayable.
///
/// `keep` is a staging temp file of this run's own (a body being staged) that the sweep spares.
fn forget_staged(store_path: &Path, source_id: &str, keep: Option<&Path>) -> Result<(), IngestError> {
    let (payload, sidecar) = paths(store_path, source_id);
    let remove = |path: &Path| match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(IngestError::write(path, e)),
        _ => Ok(()),
    };
    let (a, b) = (remove(&sidecar), remove(&payload));
    sweep(store_path, Some(source_id), keep);
    a.and(b).map_err(|e| match e {
        IngestError::Write { path, source } => IngestError::Write {
            path,
            source: std::io::Error::new(source.kind(), format!("{source} (removing the previous staged version; it may still be replayed by --from-staging)")),
        },
        other => other,
    })
}

/// Removes the staging temp files ([`staging_temp_source`]) of `only` (every source's when
/// `None`) but `keep`: what a run killed while receiving or staging left (one run per
/// source at a time, so none is another run's). Best effort: a file that cannot be removed
/// is logged and swept next time.
fn sweep(store_path: &Path, only: Option<&str>, keep: Option<&Path>) {
    let Ok(entries) = std::fs::read_dir(staging_dir(store_path)) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let text = name.to_string_lossy();
        let ours = match only {
            Some(id) => is_staging_temp(&text, id),
            None => staging_temp_source(&text).is_some(),
        };
        if !ours || keep.and_then(Path::file_name) == Some(name.as_os_str()) {
            continue;
        }
        if let Err(e) = std::fs::remove_file(entry.path()) {
            tracing::warn!("cannot remove the leftover staging file {}: {e}", entry.path().display());
        }
    }
}

/// Whether `name` is a temp file of `source_id`'s staging ([`staging_temp_source`]).
/// Exact, so that another source whose id extends this one's (`a.geojson.b`) is never
/// touched.
fn is_staging_temp(name: &str, source_id: &str) -> bool {
    staging_temp_source(name) == Some(source_id)
}

/// The source whose staging temp file `name` is: `<id>.geojson.XXXXXX.tmp` or
/// `<id>.json.XXXXXX.tmp` (six letters or digits, as `tempfile` names them), or
/// `<id>.geojson.tmp` / `<id>.json.tmp` (older builds). No staged payload or sidecar ends
/// in `.tmp`.
fn staging_temp_source(name: &str) -> Option<&str> {
    let stem = name.strip_suffix(".tmp")?;
    let stem = match stem.rsplit_once('.') {
        Some((before, random)) if random.len() == 6 && random.bytes().all(|b| b.is_ascii_alphanumeric()) => before,
        _ => stem,
    };
    stem.strip_suffix(".geojson").or_else(|| stem.strip_suffix(".json")).filter(|id| !id.is_empty())
}

/// Removes every source's staging temp files. Called when an engine opens the store, whose
/// lock keeps every other run out: each is what a killed run left, also one of a source no
/// longer in the config, which no later run of its own would sweep (a body being received
/// is a named file of up to the layer's size).
pub fn sweep_leftovers(store_path: &Path) {
    sweep(store_path, None, None);
}

/// Writes a fetched layer as the source's staged payload — `write` puts its bytes — while
/// digesting it, then its sidecar; returns the payload open at its first byte for the run's
/// scan. The previous staged version is removed first ([`forget_staged`]). When the staging
/// directory cannot be used at all, the layer goes to an anonymous temp file in `scratch`
/// instead (logged; `--from-staging` then has nothing to replay); a payload that cannot be
/// renamed into place or a sidecar that cannot be written is logged too (nothing to replay
/// either). An error when `write` itself fails (a full disk, a spool unreadable): nothing is
/// tried elsewhere, the run fails and is retried later.
fn stage_with<F>(store_path: &Path, source_id: &str, meta: &PortalMeta, now_ms: u64, scratch: &Path, write: F) -> Result<StagedLayer, IngestError>
where
    F: FnOnce(&mut DigestingWriter<BufWriter<&mut std::fs::File>>) -> std::io::Result<()>,
{
    let dir = staging_dir(store_path);
    let opened = forget_staged(store_path, source_id, None)
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|_| payload_temp(store_path, source_id));
    let (mut file, named, written_to) = match opened {
        // A named temp file in the staging directory: removed if anything below fails.
        Ok(tmp) => {
            let at = tmp.path().to_path_buf();
            let (file, path) = tmp.into_parts();
            (file, Some(path), at)
        }
        Err(e) => {
            tracing::warn!(source = source_id, "cannot stage the payload in {}: {e}; the run reads it from a temp file", dir.display());
            let file = tempfile::tempfile_in(scratch).map_err(|e| IngestError::write(scratch, e))?;
            (file, None, scratch.to_path_buf())
        }
    };
    let mut out = DigestingWriter::new(BufWriter::with_capacity(1 << 20, &mut file));
    let written = write(&mut out).and_then(|()| {
        let (buffered, digest, size) = out.finish();
        buffered.into_inner().map_err(|e| e.into_error())?;
        Ok((digest, size))
    });
    let (digest, size) = written
        .and_then(|d| file.seek(SeekFrom::Start(0)).map(|_| d))
        .map_err(|e| IngestError::write(written_to.clone(), e))?;
    let path = match named {
        Some(tmp) => put_in_place(store_path, source_id, tmp, &digest, size, meta, now_ms),
        None => written_to,
    };
    Ok(StagedLayer { file, path, digest, size })
}

/// Opens the staged payload of `source_id` and checks its digest against its sidecar; the
/// payload comes back open at its first byte (what was checked is what is scanned).
pub fn load(store_path: &Path, source_id: &str) -> Result<(StagedLayer, StagedMeta), IngestError> {
    let (payload, sidecar) = paths(store_path, source_id);
    let text = std::fs::read(&sidecar).map_err(|e| IngestError::Read { path: sidecar.clone(), source: e })?;
    let meta: StagedMeta = serde_json::from_slice(&text)
        .map_err(|e| IngestError::Changed(format!("staged sidecar {} is unreadable: {e}", sidecar.display())))?;
    let read_err = |e| IngestError::Read { path: payload.clone(), source: e };
    let mut file = std::fs::File::open(&payload).map_err(read_err)?;
    let (digest, size) = DigestingReader::new(&file).finish().map_err(read_err)?;
    if digest != meta.digest {
        return Err(IngestError::Changed(format!(
            "staged payload {} has digest {digest} but its sidecar says {}; refusing to use it",
            payload.display(),
            meta.digest
        )));
    }
    file.seek(SeekFrom::Start(0)).map_err(read_err)?;
    Ok((StagedLayer { file, path: payload, digest, size }, meta))
}

impl StagedMeta {
    /// The portal signals recorded with the staged payload.
    pub fn portal_meta(&self) -> PortalMeta {
        PortalMeta {
            publisher_ts_ms: self.publisher_ts_ms,
            etag: self.etag.clone(),
            last_modified: self.last_modified.clone(),
            schema_hash: self.schema_hash.clone(),
            ..Default::default()
        }
    }
}

fn leases() -> &'static Mutex<HashSet<(PathBuf, String)>> {
    static L: OnceLock<Mutex<HashSet<(PathBuf, String)>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Held while a source runs; released on drop.
#[derive(Debug)]
pub struct Lease {
    key: (PathBuf, String),
}

/// Takes the lease of `source_id` in the store at `store_path`, or `None` if a run holds it.
pub fn try_lease(store_path: &Path, source_id: &str) -> Option<Lease> {
    let key = (store_path.to_path_buf(), source_id.to_string());
    let mut set = leases().lock().ok()?;
    // Build the Lease only on success: dropping one would release (and re-lock) the set.
    if set.insert(key.clone()) {
        Some(Lease { key })
    } else {
        None
    }
}

/// [`try_lease`], waiting up to `wait` for a run that holds the lease to end (looked at every
/// [`crate::run_stop::POLL`]); `None` when it has not ended by then, or once `stop` is
/// requested. An operator's hold release waits so (a soak tester's release of a source polled
/// every 5 s was refused `source_busy` twice in a row).
pub fn lease_within(store_path: &Path, source_id: &str, wait: std::time::Duration, stop: &crate::run_stop::RunStop) -> Option<Lease> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if let Some(lease) = try_lease(store_path, source_id) {
            return Some(lease);
        }
        if stop.requested() || std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(crate::run_stop::POLL);
    }
}

/// Whether a run of `source_id` holds its lease right now.
pub fn is_leased(store_path: &Path, source_id: &str) -> bool {
    leases().lock().map(|s| s.contains(&(store_path.to_path_buf(), source_id.to_string()))).unwrap_or(false)
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Ok(mut set) = leases().lock() {
            set.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_is_exclusive_per_source() {
        let p = Path::new("/tmp/lease-test.redb");
        let a = try_lease(p, "s1").expect("free");
        assert!(try_lease(p, "s1").is_none());
        assert!(try_lease(p, "s2").is_some());
        drop(a);
        assert!(try_lease(p, "s1").is_some());
    }

    /// A lease taken while a run holds it waits for the run's end, not past `wait`, and not
    /// once a stop is requested.
    #[test]
    fn a_lease_waited_for_is_taken_when_the_run_ends() {
        use std::time::{Duration, Instant};
        let p = Path::new("/tmp/lease-wait-test.redb");
        let stop = crate::run_stop::RunStop::default();
        let run = try_lease(p, "s").expect("free");
        let started = Instant::now();
        assert!(lease_within(p, "s", Duration::from_millis(120), &stop).is_none(), "the run still holds it");
        assert!(started.elapsed() >= Duration::from_millis(120));
        let ends = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(run);
        });
        let waited = lease_within(p, "s", Duration::from_secs(10), &stop).expect("taken once the run ended");
        ends.join().expect("thread");
        drop(waited);
        let _run = try_lease(p, "s").expect("free");
        stop.request();
        let started = Instant::now();
        assert!(lease_within(p, "s", Duration::from_secs(10), &stop).is_none());
        assert!(started.elapsed() < Duration::from_secs(1), "a stop ends the wait at once");
    }

    /// A body received into the staging directory and staged there, as `geojson_url` does.
    fn received(store: &Path, scratch: &Path, bytes: &[u8]) -> ReceivedBody {
        let mut body = body_file(store, "s", scratch).unwrap();
        body.write(bytes).unwrap();
        body.finish().unwrap()
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn staged_payload_round_trips_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        let bytes = br#"{"type":"FeatureCollection","features":[]}"#;
        let d = super::super::source::digest(bytes);
        let body = received(&store, dir.path(), bytes);
        assert_eq!(body.name.as_deref().and_then(Path::parent), Some(staging_dir(&store).as_path()), "received in the staging directory");
        let layer = stage_body(&store, "s", body, &PortalMeta { etag: Some("e".into()), ..Default::default() }, 5);
        assert_eq!((read_all(&layer.file), layer.path.clone()), (bytes.to_vec(), staging_dir(&store).join("s.geojson")));
        assert_eq!((layer.digest.as_str(), layer.size), (d.as_str(), bytes.len() as u64));
        assert_eq!(names_in(&staging_dir(&store)), ["s.geojson", "s.json"], "renamed into place, not copied");
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let staged = std::fs::metadata(&layer.path).unwrap();
            assert_eq!(layer.file.metadata().unwrap().ino(), staged.ino(), "the run reads the very file staged");
        }
        let (mut staged, m) = load(&store, "s").unwrap();
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut staged.file, &mut b).unwrap();
        assert_eq!(b, bytes);
        assert_eq!((staged.digest.as_str(), staged.size), (d.as_str(), bytes.len() as u64));
        assert_eq!(m.etag.as_deref(), Some("e"));
        std::fs::write(staging_dir(&store).join("s.geojson"), b"tampered").unwrap();
        assert!(load(&store, "s").unwrap_err().to_string().contains("refusing"));
        assert!(load(&store, "other").is_err());
        // Staging impossible (its directory's name taken by a file): the body is received in
        // a temp file in the scratch directory and read from there; nothing to replay.
        let other = dir.path().join("y.redb");
        std::fs::write(staging_dir(&other), b"not a directory").unwrap();
        let body = received(&other, dir.path(), bytes);
        assert!(body.name.is_none());
        let layer = stage_body(&other, "s", body, &PortalMeta::default(), 5);
        assert_eq!((read_all(&layer.file), layer.path.as_path()), (bytes.to_vec(), dir.path()));
        assert!(load(&other, "s").is_err());
        // A body that could not be named (a temp file could not be made: no inodes, too many
        // open files) while an older version is staged: that version is removed all the
        // same, so `--from-staging` cannot replay something older than this run's layer.
        assert!(load(&store, "s").is_err());
        stage_body(&store, "s", received(&store, dir.path(), bytes), &PortalMeta::default(), 6);
        assert!(load(&store, "s").is_ok());
        let mut unnamed = received(&other, dir.path(), b"{}");
        unnamed.name = None;
        let layer = stage_body(&store, "s", unnamed, &PortalMeta::default(), 7);
        assert_eq!(layer.path, dir.path());
        assert!(load(&store, "s").is_err(), "the older version is not replayable");
        assert_eq!(names_in(&staging_dir(&store)), Vec::<String>::new());
    }

    /// While a body is received the previous version stays replayable (a fetch that fails
    /// or answers 304 loses nothing); a new body first sweeps what a killed run left, and
    /// staging it replaces that version and sweeps again — but never the body's own file,
    /// which has the same kind of name.
    #[test]
    fn a_received_body_replaces_the_staged_version_only_when_it_is_staged() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        let old = br#"{"type":"FeatureCollection","features":[],"v":1}"#;
        stage_body(&store, "s", received(&store, dir.path(), old), &PortalMeta::default(), 5);
        // A run killed while receiving left its body: the next body sweeps it, and a body
        // dropped (a failed fetch) leaves no file.
        std::fs::write(staging_dir(&store).join("s.geojson.a1B2c3.tmp"), b"killed run").unwrap();
        drop(received(&store, dir.path(), b"a fetch that failed"));
        assert_eq!(names_in(&staging_dir(&store)), ["s.geojson", "s.json"]);
        let new = br#"{"type":"FeatureCollection","features":[],"v":2}"#;
        let body = received(&store, dir.path(), new);
        assert_eq!(read_all(&load(&store, "s").unwrap().0.file), old, "the previous version until the new one is staged");
        assert_eq!(names_in(&staging_dir(&store)).len(), 3, "{:?}", names_in(&staging_dir(&store)));
        std::fs::write(staging_dir(&store).join("s.json.Q1w2E3.tmp"), b"killed run").unwrap();
        let layer = stage_body(&store, "s", body, &PortalMeta::default(), 6);
        assert_eq!(layer.path, staging_dir(&store).join("s.geojson"));
        assert_eq!(read_all(&load(&store, "s").unwrap().0.file), new);
        assert_eq!(names_in(&staging_dir(&store)), ["s.geojson", "s.json"]);

        // The payload's name taken by a non-empty directory: the older version cannot be
        // removed, the body is not staged, and the run still reads what it received.
        let payload = staging_dir(&store).join("s.geojson");
        std::fs::remove_file(&payload).unwrap();
        std::fs::create_dir_all(payload.join("x")).unwrap();
        let layer = stage_body(&store, "s", received(&store, dir.path(), old), &PortalMeta::default(), 7);
        assert_eq!((read_all(&layer.file), layer.path), (old.to_vec(), staging_dir(&store)));
        assert!(load(&store, "s").is_err(), "nothing to replay");
        assert_eq!(names_in(&staging_dir(&store)), ["s.geojson"], "no temp file left behind");
    }

    fn spool_of(dir: &Path, apns: &[&str]) -> FeatureSpool {
        let mut spool = FeatureSpool::new(dir).unwrap();
        for apn in apns {
            let f = serde_json::json!({"type": "Feature", "properties": {"APN": apn}, "geometry": null});
            spool.push(None, &f, "APN").unwrap();
        }
        spool
    }

    fn read_all(mut file: &std::fs::File) -> Vec<u8> {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut b).unwrap();
        b
    }

    #[test]
    fn a_paged_layer_is_staged_as_written_and_replays_from_staging() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        let want = spool_of(dir.path(), &["b", "a"]).into_bytes().unwrap();
        let meta = PortalMeta { publisher_ts_ms: Some(7), ..Default::default() };
        let layer = stage_features(&store, "s", spool_of(dir.path(), &["a", "b"]), &meta, 5, dir.path()).unwrap();
        assert_eq!((layer.digest.as_str(), layer.size), (super::super::source::digest(&want).as_str(), want.len() as u64));
        assert_eq!(read_all(&layer.file), want, "the handle is at the first byte of what was written");
        assert_eq!(layer.path, staging_dir(&store).join("s.geojson"));
        assert_eq!(std::fs::read(&layer.path).unwrap(), want);
        assert!(!staging_dir(&store).join("s.geojson.tmp").exists());
        let (replayed, m) = load(&store, "s").unwrap();
        assert_eq!((replayed.digest, m.size, m.publisher_ts_ms), (layer.digest, want.len() as u64, Some(7)));
        assert_eq!(read_all(&replayed.file), want);
    }

    #[test]
    fn an_atomic_write_that_cannot_be_put_in_place_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("taken");
        std::fs::create_dir_all(target.join("x")).unwrap();
        assert!(crate::util::write_atomic(&target, b"bytes").is_err());
        let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["taken"]);
    }

    /// The previous payload cannot be removed (its name is a directory): the run falls back
    /// to a temp file and still reads what it fetched; the older version is not replayable.
    #[test]
    fn a_staging_that_fails_leaves_no_temp_file_and_nothing_older_to_replay() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        stage_features(&store, "s", spool_of(dir.path(), &["old"]), &PortalMeta::default(), 5, dir.path()).unwrap();
        assert!(load(&store, "s").is_ok());
        // The payload's name is now taken by a non-empty directory: it can be neither
        // removed nor replaced.
        let payload = staging_dir(&store).join("s.geojson");
        std::fs::remove_file(&payload).unwrap();
        std::fs::create_dir_all(payload.join("x")).unwrap();
        let want = spool_of(dir.path(), &["new"]).into_bytes().unwrap();
        let layer = stage_features(&store, "s", spool_of(dir.path(), &["new"]), &PortalMeta::default(), 6, dir.path()).unwrap();
        assert_eq!(read_all(&layer.file), want, "the run still reads what was written");
        let err = load(&store, "s").unwrap_err().to_string();
        assert!(err.contains("s.json"), "the older version is not replayable: {err}");
        let names = || names_in(&staging_dir(&store));
        assert_eq!(names(), ["s.geojson"], "no temp file left behind");

        // Temp files of a run killed while staging are swept by the next staging of the same
        // source, and only those: another source's names that extend this one's stay.
        std::fs::remove_dir_all(&payload).unwrap();
        for stale in ["s.geojson.a1B2c3.tmp", "s.geojson.tmp", "s.json.Q1w2E3.tmp", "s.geojson.b.geojson.tmp", "s2.geojson.a1B2c3.tmp"] {
            std::fs::write(staging_dir(&store).join(stale), b"x").unwrap();
        }
        stage_features(&store, "s", spool_of(dir.path(), &["new"]), &PortalMeta::default(), 7, dir.path()).unwrap();
        assert_eq!(names(), ["s.geojson", "s.geojson.b.geojson.tmp", "s.json", "s2.geojson.a1B2c3.tmp"]);
        assert!(is_staging_temp("s.geojson.Zz9Zz9.tmp", "s") && !is_staging_temp("s.geojson.Zz9Zz.tmp", "s"));
        assert!(!is_staging_temp("s.geojson", "s") && !is_staging_temp("s.json", "s"));
    }

    /// When an engine opens the store every staging temp file is a killed run's leftover:
    /// all are removed, whichever source they belong to (one may no longer be configured),
    /// and nothing else is.
    #[test]
    fn leftovers_of_every_source_are_swept_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        sweep_leftovers(&store); // no staging directory yet: nothing to do
        std::fs::create_dir_all(staging_dir(&store)).unwrap();
        let leftovers = ["gone.geojson.a1B2c3.tmp", "s.json.Q1w2E3.tmp", "s.geojson.tmp", "a.b.json.tmp", "x.geojson.geojson.Zz9Zz9.tmp"];
        let kept = ["s.geojson", "s.json", "x.geojson.geojson", "notes.txt", ".geojson.tmp", "s.geojson.abcde.tmp", "s.tmp"];
        for name in leftovers.iter().chain(&kept) {
            std::fs::write(staging_dir(&store).join(name), b"x").unwrap();
        }
        assert_eq!(staging_temp_source("x.geojson.geojson.Zz9Zz9.tmp"), Some("x.geojson"));
        assert_eq!(staging_temp_source("a.b.json.tmp"), Some("a.b"));
        sweep_leftovers(&store);
        let mut want: Vec<&str> = kept.to_vec();
        want.sort();
        assert_eq!(names_in(&staging_dir(&store)), want);
    }

    #[test]
    fn a_paged_layer_that_cannot_be_staged_is_still_scanned_and_nothing_is_lost() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        // The staging directory's name is taken by a file: staging is impossible.
        std::fs::write(staging_dir(&store), b"not a directory").unwrap();
        let want = spool_of(dir.path(), &["a", "b"]).into_bytes().unwrap();
        let layer = stage_features(&store, "s", spool_of(dir.path(), &["b", "a"]), &PortalMeta::default(), 5, dir.path()).unwrap();
        assert_eq!(read_all(&layer.file), want, "the run reads it from a temp file");
        assert_eq!(layer.path, dir.path());
        assert!(load(&store, "s").is_err(), "nothing staged to replay");
        // Nowhere to write at all: a clear error naming where it tried.
        let nowhere = dir.path().join("missing-scratch");
        let err = stage_features(&store, "s", spool_of(dir.path(), &["a"]), &PortalMeta::default(), 5, &nowhere).unwrap_err();
        assert!(matches!(err, IngestError::Write { .. }) && err.to_string().contains("missing-scratch"), "{err}");
    }
}
