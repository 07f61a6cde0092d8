//! The stored shape of outbox rows and dead letters, the one record family whose shape has
//! changed: record version 1 carried a pre-built webhook body, version 2 carries the change's
//! fields (`OutboxPayload::Change`) and the body is built at send time (issue 7: the body was
//! a tenth of the claim commit's CPU and most of its bytes). Rows of either version are read;
//! every row this build writes is version 2, and a version 1 row keeps its body as
//! `OutboxPayload::Built` when it is rewritten (a retry, a dead letter).

use super::codec::{decode_migrating, encode_versioned, split_version, unknown_version};
use crate::model::{DeadLetter, IdemKey, OutboxEntry, OutboxPayload, Severity};
use serde::{Deserialize, Serialize};

/// The version byte of outbox rows, dead letters and quarantined dead letters written now.
pub const OUTBOX_RECORD_VERSION: u8 = 2;

/// `OutboxEntry` as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct OutboxEntryV1 {
    id: u64,
    key: IdemKey,
    watcher_id: String,
    target: String,
    source_id: String,
    parcel_id: String,
    lineage_id: String,
    severity: Severity,
    body: Vec<u8>,
    attempts: u32,
    created_ms: u64,
    next_attempt_ms: u64,
    last_error: Option<String>,
}

/// `DeadLetter` as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct DeadLetterV1 {
    entry: OutboxEntryV1,
    reason: String,
    dead_at_ms: u64,
}

impl From<DeadLetterV1> for DeadLetter {
    fn from(d: DeadLetterV1) -> Self {
        DeadLetter { entry: d.entry.into(), reason: d.reason, dead_at_ms: d.dead_at_ms }
    }
}

impl From<OutboxEntryV1> for OutboxEntry {
    fn from(v: OutboxEntryV1) -> Self {
        OutboxEntry {
            id: v.id,
            key: v.key,
            watcher_id: v.watcher_id,
            target: v.target,
            source_id: v.source_id,
            parcel_id: v.parcel_id,
            lineage_id: v.lineage_id,
            severity: v.severity,
            payload: OutboxPayload::Built(v.body),
            attempts: v.attempts,
            created_ms: v.created_ms,
            next_attempt_ms: v.next_attempt_ms,
            last_error: v.last_error,
        }
    }
}

pub(super) fn encode_entry(entry: &OutboxEntry) -> Vec<u8> {
    encode_versioned(OUTBOX_RECORD_VERSION, entry)
}

pub(super) fn decode_entry(bytes: &[u8]) -> Result<OutboxEntry, String> {
    decode_migrating::<OutboxEntryV1, _>(bytes, OUTBOX_RECORD_VERSION, OUTBOX_FAMILY)
}

/// The subscriber an outbox row is for, read off the row's leading fields (id, key, watcher:
/// the same in both versions) without decoding the rest, its change and geometry above all.
/// A lease pass gates each row by its endpoint first: the rows of a disabled endpoint or an
/// open breaker are passed over on every pass, and decoding each of them whole cost most of
/// a pass over a held backlog.
pub(super) fn entry_watcher(bytes: &[u8]) -> Result<&str, String> {
    /// An outbox row's leading fields, borrowed.
    #[derive(Deserialize)]
    struct Head<'a> {
        _id: u64,
        _key: &'a str,
        watcher_id: &'a str,
    }
    match split_version(bytes)? {
        (1 | OUTBOX_RECORD_VERSION, rest) => postcard::take_from_bytes::<Head<'_>>(rest).map(|(h, _)| h.watcher_id).map_err(|e| e.to_string()),
        (v, _) => Err(unknown_version(v, OUTBOX_FAMILY, OUTBOX_RECORD_VERSION)),
    }
}

pub(super) fn encode_dead(dead: &DeadLetter) -> Vec<u8> {
    encode_versioned(OUTBOX_RECORD_VERSION, dead)
}

pub(super) fn decode_dead(bytes: &[u8]) -> Result<DeadLetter, String> {
    decode_migrating::<DeadLetterV1, _>(bytes, OUTBOX_RECORD_VERSION, OUTBOX_FAMILY)
}

/// How an unknown version byte of these rows is named.
const OUTBOX_FAMILY: &str = "outbox rows";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ChangeFields, ChangeKind, StoredGeometry};

    fn v1_entry() -> OutboxEntryV1 {
        OutboxEntryV1 {
            id: 7,
            key: IdemKey("k".into()),
            watcher_id: "w".into(),
            target: "http://127.0.0.1:1/h".into(),
            source_id: "s".into(),
            parcel_id: "p".into(),
            lineage_id: "l".into(),
            severity: Severity::Material,
            body: br#"{"type":"zoning.change"}"#.to_vec(),
            attempts: 2,
            created_ms: 10,
            next_attempt_ms: 20,
            last_error: Some("http_503".into()),
        }
    }

    #[test]
    fn version_1_rows_are_read_with_their_built_body() {
        let bytes = super::super::codec::encode(&v1_entry());
        assert_eq!(bytes[0], 1);
        let e = decode_entry(&bytes).unwrap();
        assert_eq!(e.body(), br#"{"type":"zoning.change"}"#.to_vec());
        assert_eq!((e.id, e.attempts, e.last_error.as_deref()), (7, 2, Some("http_503")));
        let dl = super::super::codec::encode(&DeadLetterV1 { entry: v1_entry(), reason: "r".into(), dead_at_ms: 5 });
        let d = decode_dead(&dl).unwrap();
        assert_eq!((d.entry.id, d.reason.as_str(), d.dead_at_ms), (7, "r", 5));
        // Rewritten, a version 1 row keeps its body under the new version.
        let again = decode_entry(&encode_entry(&e)).unwrap();
        assert_eq!(again, e);
    }

    /// A layer without a zoning value (no zoning field, or an empty one) gives `null`, as the
    /// `from` of an addition does, never `""`.
    #[test]
    fn a_missing_zoning_value_is_null_in_the_body() {
        let mut e: OutboxEntry = v1_entry().into();
        for (from, to, shown) in [
            (Some(""), Some(""), (serde_json::Value::Null, serde_json::Value::Null)),
            (None, Some(""), (serde_json::Value::Null, serde_json::Value::Null)),
            (Some("R-1"), Some(""), ("R-1".into(), serde_json::Value::Null)),
            (None, Some("C-2"), (serde_json::Value::Null, "C-2".into())),
        ] {
            e.payload = OutboxPayload::Change(ChangeFields {
                jurisdiction: "j".into(),
                kind: ChangeKind::Added,
                from: from.map(String::from),
                to: to.map(String::from),
                effective_date: None,
                observed_at_ms: 0,
                area_m2: 1.0,
                geometry: None,
                queued_ms: 0,
            });
            let body: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
            assert_eq!((body["data"]["from"].clone(), body["data"]["to"].clone()), shown, "{from:?} {to:?}");
        }
    }

    #[test]
    fn version_2_rows_round_trip_and_build_the_same_body_every_time() {
        let mut e: OutboxEntry = v1_entry().into();
        e.payload = OutboxPayload::Change(ChangeFields {
            jurisdiction: "j".into(),
            kind: ChangeKind::Rezoned,
            from: Some("R-1".into()),
            to: Some("C-2".into()),
            effective_date: None,
            observed_at_ms: 1_780_000_000_000,
            area_m2: 812.3,
            geometry: Some(StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]])),
            queued_ms: 1_780_000_000_500,
        });
        let bytes = encode_entry(&e);
        assert_eq!(bytes[0], OUTBOX_RECORD_VERSION);
        let back = decode_entry(&bytes).unwrap();
        assert_eq!(back, e);
        // The watcher read off the head agrees with the whole row, in both versions.
        assert_eq!(entry_watcher(&bytes), Ok("w"));
        assert_eq!(entry_watcher(&super::super::codec::encode(&v1_entry())), Ok("w"));
        assert!(entry_watcher(&[9, 1, 2]).unwrap_err().contains("version 9"));
        assert!(entry_watcher(&bytes[..3]).is_err() && entry_watcher(&[]).is_err());
        assert_eq!(back.body(), e.body());
        let body: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(body["data"]["from"], "R-1");
        assert_eq!(body["data"]["area_m2"], 812.3);
        assert_eq!(body["data"]["geometry"]["type"], "Polygon");
        assert!(decode_entry(&[9, 1, 2]).unwrap_err().contains("version 9"));
        assert!(decode_entry(&[]).is_err());
    }
}
