//! Reading a source's bytes and their content digest (sha256 over the exact bytes).

use super::IngestError;
use crate::config::{SourceConfig, SourceKind};
use sha2::{Digest, Sha256};

/// The bytes of one fetched layer version and what identifies them.
#[derive(Debug, Clone)]
pub struct FetchedLayer {
    pub bytes: Vec<u8>,
    /// Hex sha256 of `bytes`.
    pub digest: String,
}

/// Hex sha256 of a byte slice.
pub fn digest(bytes: &[u8]) -> String {
    crate::util::hex(&Sha256::digest(bytes))
}

/// Hex sha256 and size of a file, read in 1 MiB pieces (a county layer never sits in memory).
pub fn digest_file(path: &std::path::Path) -> Result<(String, u64), IngestError> {
    use std::io::Read;
    let read_err = |e| IngestError::Read { path: path.to_path_buf(), source: e };
    let mut file = std::fs::File::open(path).map_err(read_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_err(e)),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((crate::util::hex(&hasher.finalize()), size))
}

/// Reads the current version of a source.
pub fn fetch(source: &SourceConfig) -> Result<FetchedLayer, IngestError> {
    match &source.kind {
        SourceKind::File { path } => {
            let bytes = std::fs::read(path).map_err(|e| IngestError::Read { path: path.clone(), source: e })?;
            let digest = digest(&bytes);
            Ok(FetchedLayer { bytes, digest })
        }
        // HTTP kinds are fetched by `ingest::portal` (probe, paging, retries).
        _ => Err(IngestError::Malformed(format!("source {} is an HTTP source; it is fetched by ingest::portal", source.id))),
    }
}
