//! Record encoding: one version byte, then postcard. postcard's wire format is stable and
//! documented; the version byte lets a later zonewatch read old records and migrate them.

use serde::{de::DeserializeOwned, Serialize};

/// Version byte of every record this build writes.
pub const RECORD_VERSION: u8 = 1;

/// Bytes reserved for an encoded record before it is written.
const ENCODE_CAPACITY: usize = 256;

/// Encodes a record as `[RECORD_VERSION] ++ postcard(value)`.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Room for a typical record (a parcel's state, a small geometry, an outbox row) up
    // front: growing from one byte reallocated four or five times per record, which a
    // baseline commit does for millions of them.
    let mut out = Vec::with_capacity(ENCODE_CAPACITY);
    out.push(RECORD_VERSION);
    // postcard only fails on types serde cannot describe (e.g. maps with non-string keys are
    // fine); our records are plain structs, so a failure is a programming error we surface as
    // an empty payload that `decode` will reject rather than a panic.
    postcard::to_extend(value, out).unwrap_or_default()
}

/// Encodes a record whose stored shape has moved on from [`RECORD_VERSION`] as
/// `[version] ++ postcard(value)` (see `store::outbox_rows`).
pub fn encode_versioned<T: Serialize>(version: u8, value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(ENCODE_CAPACITY);
    out.push(version);
    postcard::to_extend(value, out).unwrap_or_default()
}

/// Splits a record into its version byte and its postcard bytes.
pub fn split_version(bytes: &[u8]) -> Result<(u8, &[u8]), String> {
    bytes.split_first().map(|(v, rest)| (*v, rest)).ok_or_else(|| "empty record".to_string())
}

/// Decodes postcard bytes (after the version byte) as `T`.
pub fn decode_postcard<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    postcard::from_bytes(bytes).map_err(|e| e.to_string())
}

/// Decodes a record of a family whose stored shape changed once: version `current` as `T`,
/// version 1 as `Old` (the shape it had then) converted to `T`; any other version is an
/// error naming `family` (outbox rows, dead letters, idempotency keys, watermarks, holds).
pub fn decode_migrating<Old, T>(bytes: &[u8], current: u8, family: &str) -> Result<T, String>
where
    Old: DeserializeOwned + Into<T>,
    T: DeserializeOwned,
{
    match split_version(bytes)? {
        (1, rest) => decode_postcard::<Old>(rest).map(Into::into),
        (v, rest) if v == current => decode_postcard(rest),
        (v, _) => Err(unknown_version(v, family, current)),
    }
}

/// Decodes a record written by [`encode`], checking its version byte.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match split_version(bytes)? {
        (RECORD_VERSION, rest) => decode_postcard(rest),
        (v, _) => Err(unknown_version(v, "records", RECORD_VERSION)),
    }
}

/// The error for a record whose version byte `v` this build cannot read; `family` names the
/// records and `newest` the highest version this build reads.
pub fn unknown_version(v: u8, family: &str, newest: u8) -> String {
    format!("record version {v} is not understood by this zonewatch ({family}: up to version {newest})")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Severity, Watermark};

    #[test]
    fn round_trip_and_version_check() {
        let w = Watermark { digest: "ab".into(), size: 3, ..Default::default() };
        let bytes = encode(&w);
        assert_eq!(bytes[0], RECORD_VERSION);
        assert_eq!(decode::<Watermark>(&bytes).unwrap(), w);
        let mut future = bytes.clone();
        future[0] = 9;
        assert!(decode::<Watermark>(&future).unwrap_err().contains("version 9"));
        assert!(decode::<Severity>(&[]).is_err());
    }
}
