//! `ingest/`: getting a layer's bytes and turning them into normalised parcels.
//!
//! * [`source`] reads the bytes of a configured source and digests them;
//! * [`geojson`] streams the features of a FeatureCollection without building a document tree;
//! * [`normalize`] turns one raw feature into a [`crate::model::Parcel`] or a quarantine reason,
//!   validating and repairing its geometry (OGC validity checked by [`valid`]);
//! * [`portal`], [`arcgis`] and [`http`] fetch the HTTP source kinds (probe, page, retry,
//!   rate-limit) and hand back one FeatureCollection, a paged layer's features collected on
//!   disk by [`collect`]; [`settings`] holds their config keys;
//!   [`staging`] keeps the last payload on disk and the per-source run lease;
//!   [`scan_guard`] bounds one paged scan as a whole (total bytes, pages that bring nothing new);
//!   [`page`] reads a page's features one at a time (a page is never one JSON tree);
//!   [`decode`] decodes gzip / deflate bodies with the decoded size capped.
//! * [`districts`] reads district / overlay layers (code + polygon, no stable id).

pub mod districts;
pub mod geojson;
pub mod normalize;
pub mod source;
pub mod arcgis;
pub mod collect;
pub mod http;
pub mod portal;
pub mod settings;
pub mod staging;
pub mod valid;
pub mod decode;
pub mod scan_guard;
pub mod page;
pub mod numbers;

/// Errors that stop a whole layer (a single bad feature is quarantined instead).
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("cannot read {path}: {source}")]
    Read { path: std::path::PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: std::path::PathBuf, source: std::io::Error },
    #[error("layer is not a GeoJSON FeatureCollection: {0}")]
    Malformed(String),
    /// A feature whose broken text swallowed the features after it (found by a worker, not
    /// by the reader: so never taken for the reader's own failure).
    #[error("layer is not a GeoJSON FeatureCollection: {0}")]
    JoinedFeatures(String),
    #[error("layer uses CRS {0:?}; zonewatch reads RFC 7946 GeoJSON in EPSG:4326 / CRS84 only")]
    UnsupportedCrs(String),
    /// A layer's file on disk is not what was written for it: a received body or a paged
    /// layer's collection read back by the scan, a staged payload against its sidecar.
    #[error("{0}")]
    Changed(String),
    #[error("fetch failed: {0}")]
    Fetch(#[from] http::FetchError),
    /// A stop was requested (`crate::run_stop`) before the run could commit.
    #[error("stopped before its commit: zonewatch is shutting down; nothing of this run was committed, and the next run reads the layer again")]
    Stopped,
}

impl IngestError {
    /// A write to a file beside the store (a staged layer, its sidecar, a run's scratch file)
    /// failed. A file-size limit met there is the store's limit too (`store::note_io_error`):
    /// `run` and `serve` then name it and exit 2 rather than retry.
    pub fn write(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> IngestError {
        crate::store::note_io_error(&source);
        IngestError::Write { path: path.into(), source }
    }
}
