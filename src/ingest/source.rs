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
