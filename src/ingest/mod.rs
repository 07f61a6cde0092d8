//! `ingest/`: getting a layer's bytes and turning them into normalised parcels.
//!
//! * [`source`] reads the bytes of a configured source and digests them;
//! * [`geojson`] streams the features of a FeatureCollection without building a document tree;
//! * [`normalize`] turns one raw feature into a [`crate::model::Parcel`] or a quarantine reason,
//!   validating and repairing its geometry;
//! * [`districts`] reads district / overlay layers (code + polygon, no stable id).

pub mod districts;
pub mod geojson;
pub mod normalize;
pub mod source;

/// Errors that stop a whole layer (a single bad feature is quarantined instead).
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("cannot read {path}: {source}")]
    Read { path: std::path::PathBuf, source: std::io::Error },
    #[error("layer is not a GeoJSON FeatureCollection: {0}")]
    Malformed(String),
    #[error("layer uses CRS {0:?}; zonewatch reads RFC 7946 GeoJSON in EPSG:4326 / CRS84 only")]
    UnsupportedCrs(String),
}
