//! Two small guards around a source run:
//!
//! * **staging**: the raw payload of an HTTP source's last fetch is kept on disk with its
//!   digest and portal signals (`<store>.staging/<source>.geojson` + `.json`), so
//!   `zonewatch run --source ID --from-staging` re-processes it without touching the portal
//!   (after a mapping fix, or to replay a failed parse). The digest is re-checked on read.
//! * **lease**: one run per source at a time in this process (the store file lock keeps other
//!   processes out). A trigger while a run is going is recorded as `skipped_overlap`.

use super::portal::PortalMeta;
use super::IngestError;
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

fn paths(store_path: &Path, source_id: &str) -> (PathBuf, PathBuf) {
    let dir = staging_dir(store_path);
    (dir.join(format!("{source_id}.geojson")), dir.join(format!("{source_id}.json")))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Stages a fetched payload (payload first, sidecar last: a sidecar always describes a
/// complete payload).
pub fn stage(store_path: &Path, source_id: &str, bytes: &[u8], digest: &str, meta: &PortalMeta, now_ms: u64) -> Result<(), IngestError> {
    let dir = staging_dir(store_path);
    let io = |path: &Path, e: std::io::Error| IngestError::Read { path: path.to_path_buf(), source: e };
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    let (payload, sidecar) = paths(store_path, source_id);
    write_atomic(&payload, bytes).map_err(|e| io(&payload, e))?;
    let m = StagedMeta {
        source_id: source_id.to_string(),
        digest: digest.to_string(),
        size: bytes.len() as u64,
        fetched_at_ms: now_ms,
        publisher_ts_ms: meta.publisher_ts_ms,
        etag: meta.etag.clone(),
        last_modified: meta.last_modified.clone(),
        schema_hash: meta.schema_hash.clone(),
    };
    let text = serde_json::to_vec_pretty(&m).map_err(|e| IngestError::Malformed(e.to_string()))?;
    write_atomic(&sidecar, &text).map_err(|e| io(&sidecar, e))
}

/// Reads a staged payload back and checks its digest.
pub fn load(store_path: &Path, source_id: &str) -> Result<(Vec<u8>, StagedMeta), IngestError> {
    let (payload, sidecar) = paths(store_path, source_id);
    let text = std::fs::read(&sidecar).map_err(|e| IngestError::Read { path: sidecar.clone(), source: e })?;
    let meta: StagedMeta = serde_json::from_slice(&text)
        .map_err(|e| IngestError::Malformed(format!("staged sidecar {} is unreadable: {e}", sidecar.display())))?;
    let bytes = std::fs::read(&payload).map_err(|e| IngestError::Read { path: payload.clone(), source: e })?;
    let digest = super::source::digest(&bytes);
    if digest != meta.digest {
        return Err(IngestError::Malformed(format!(
            "staged payload {} has digest {digest} but its sidecar says {}; refusing to use it",
            payload.display(),
            meta.digest
        )));
    }
    Ok((bytes, meta))
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

    #[test]
    fn staged_payload_round_trips_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("z.redb");
        let bytes = br#"{"type":"FeatureCollection","features":[]}"#;
        let d = super::super::source::digest(bytes);
        stage(&store, "s", bytes, &d, &PortalMeta { etag: Some("e".into()), ..Default::default() }, 5).unwrap();
        let (b, m) = load(&store, "s").unwrap();
        assert_eq!(b, bytes);
        assert_eq!(m.etag.as_deref(), Some("e"));
        std::fs::write(staging_dir(&store).join("s.geojson"), b"tampered").unwrap();
        assert!(load(&store, "s").unwrap_err().to_string().contains("refusing"));
        assert!(load(&store, "other").is_err());
    }
}
