//! The stored shape of watermarks (the `watermarks` and `watermark_history` tables) and of
//! holds (the `holds` table: a hold carries the watermark its release writes). Record version
//! 2 added `probe_ts_ms` to the watermark, the publisher timestamp a portal reported at the
//! last fetch when the watermark keeps a newer one (`Watermark::probe_ts_ms`). Rows of either
//! version are read; every row this build writes is version 2. Holds went on to record
//! version 3, which adds `Hold::reprocess` (whether the held run was a `--reprocess`); a hold
//! of version 1 or 2 reads as not one.

use super::codec::{decode_migrating, decode_postcard, encode_versioned, split_version, unknown_version};
use crate::model::{Hold, HoldState, Watermark};
use serde::{Deserialize, Serialize};

/// The version byte of watermark rows written now.
pub const WATERMARK_RECORD_VERSION: u8 = 2;

/// The version byte of hold rows written now.
pub const HOLD_RECORD_VERSION: u8 = 3;

/// `Watermark` as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct WatermarkV1 {
    digest: String,
    size: u64,
    run_id: u64,
    consumed_at_ms: u64,
    content_changed_at_ms: u64,
    publisher_ts_ms: Option<u64>,
    etag: Option<String>,
    last_modified: Option<String>,
    read_fingerprint: String,
    schema_hash: Option<String>,
}

impl From<WatermarkV1> for Watermark {
    fn from(v: WatermarkV1) -> Self {
        Watermark {
            digest: v.digest,
            size: v.size,
            run_id: v.run_id,
            consumed_at_ms: v.consumed_at_ms,
            content_changed_at_ms: v.content_changed_at_ms,
            publisher_ts_ms: v.publisher_ts_ms,
            etag: v.etag,
            last_modified: v.last_modified,
            read_fingerprint: v.read_fingerprint,
            schema_hash: v.schema_hash,
            probe_ts_ms: None,
        }
    }
}

/// `Hold` as record version 1 wrote it (its watermark a version 1 one).
#[derive(Serialize, Deserialize)]
struct HoldV1 {
    run_id: u64,
    source_id: String,
    lineage_id: String,
    created_ms: u64,
    reason: String,
    state: HoldState,
    digest: String,
    watermark: WatermarkV1,
    changes: u64,
    features: u64,
}

impl From<HoldV1> for HoldV2 {
    fn from(v: HoldV1) -> Self {
        HoldV2 {
            run_id: v.run_id,
            source_id: v.source_id,
            lineage_id: v.lineage_id,
            created_ms: v.created_ms,
            reason: v.reason,
            state: v.state,
            digest: v.digest,
            watermark: v.watermark.into(),
            changes: v.changes,
            features: v.features,
        }
    }
}

/// `Hold` as record version 2 wrote it (before `reprocess`).
#[derive(Serialize, Deserialize)]
struct HoldV2 {
    run_id: u64,
    source_id: String,
    lineage_id: String,
    created_ms: u64,
    reason: String,
    state: HoldState,
    digest: String,
    watermark: Watermark,
    changes: u64,
    features: u64,
}

impl From<HoldV2> for Hold {
    fn from(v: HoldV2) -> Self {
        Hold {
            run_id: v.run_id,
            source_id: v.source_id,
            lineage_id: v.lineage_id,
            created_ms: v.created_ms,
            reason: v.reason,
            state: v.state,
            digest: v.digest,
            watermark: v.watermark,
            changes: v.changes,
            features: v.features,
            reprocess: false,
        }
    }
}

pub(super) fn encode_hold(hold: &Hold) -> Vec<u8> {
    encode_versioned(HOLD_RECORD_VERSION, hold)
}

pub(super) fn decode_hold(bytes: &[u8]) -> Result<Hold, String> {
    match split_version(bytes)? {
        (1, rest) => decode_postcard::<HoldV1>(rest).map(HoldV2::from).map(Into::into),
        (2, rest) => decode_postcard::<HoldV2>(rest).map(Into::into),
        (HOLD_RECORD_VERSION, rest) => decode_postcard(rest),
        (v, _) => Err(unknown_version(v, "holds", HOLD_RECORD_VERSION)),
    }
}

/// Hold row `run_id` decoded, or `None` (logged) when it cannot be: the passes over every
/// hold (each run's, the gate's, the stats) skip a damaged row rather than fail on it, or one
/// such row would stop every run of every source. `zonewatch check --store` reports it.
pub(super) fn readable_hold(run_id: u64, bytes: &[u8]) -> Option<Hold> {
    /// Hold rows already reported by this process: every run and every stats poll meets them.
    static REPORTED: std::sync::Mutex<std::collections::BTreeSet<u64>> = std::sync::Mutex::new(std::collections::BTreeSet::new());
    decode_hold(bytes)
        .map_err(|why| {
            if REPORTED.lock().map_or(true, |mut seen| seen.insert(run_id)) {
                tracing::error!(hold = run_id, "hold row cannot be read ({why}); skipped: `zonewatch check --store` reports the store's damage");
            }
        })
        .ok()
}

pub(super) fn encode_watermark(wm: &Watermark) -> Vec<u8> {
    encode_versioned(WATERMARK_RECORD_VERSION, wm)
}

pub(super) fn decode_watermark(bytes: &[u8]) -> Result<Watermark, String> {
    decode_migrating::<WatermarkV1, _>(bytes, WATERMARK_RECORD_VERSION, "watermarks")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_1_watermark_reads_without_a_probe_timestamp_and_is_written_as_version_2() {
        let v1 = WatermarkV1 {
            digest: "ab".into(),
            size: 3,
            run_id: 9,
            consumed_at_ms: 10,
            content_changed_at_ms: 5,
            publisher_ts_ms: Some(7),
            etag: Some("\"e\"".into()),
            last_modified: None,
            read_fingerprint: "f".into(),
            schema_hash: Some("s".into()),
        };
        let old = encode_versioned(1, &v1);
        let wm = decode_watermark(&old).expect("version 1 reads");
        assert_eq!((wm.digest.as_str(), wm.run_id, wm.publisher_ts_ms, wm.probe_ts_ms), ("ab", 9, Some(7), None));
        assert_eq!(wm.etag.as_deref(), Some("\"e\""));
        let new = Watermark { probe_ts_ms: Some(6), ..wm };
        let bytes = encode_watermark(&new);
        assert_eq!(bytes[0], WATERMARK_RECORD_VERSION);
        assert_eq!(decode_watermark(&bytes).expect("version 2 reads"), new);
        let e = decode_watermark(&[3, 0]).unwrap_err();
        assert!(e.contains("version 3") && e.contains("watermarks"), "{e}");

        // A hold written before carries a version 1 watermark: it reads whole, whatever its
        // counts (postcard's varints would otherwise run into the new field).
        for changes in [0, 1, 37, 1 << 40] {
            let v1_hold = HoldV1 {
                run_id: 4,
                source_id: "s".into(),
                lineage_id: "l".into(),
                created_ms: 11,
                reason: "change_spike".into(),
                state: HoldState::Open,
                digest: "ab".into(),
                watermark: WatermarkV1 { run_id: 4, ..clone_v1(&v1) },
                changes,
                features: 99,
            };
            let hold = decode_hold(&encode_versioned(1, &v1_hold)).expect("a version 1 hold reads");
            assert_eq!((hold.run_id, hold.changes, hold.features, hold.watermark.publisher_ts_ms, hold.watermark.probe_ts_ms), (4, changes, 99, Some(7), None));
            assert!(!hold.reprocess);
            // As version 2 wrote it, it reads the same.
            let v2_hold = HoldV2 {
                run_id: hold.run_id,
                source_id: hold.source_id.clone(),
                lineage_id: hold.lineage_id.clone(),
                created_ms: hold.created_ms,
                reason: hold.reason.clone(),
                state: hold.state.clone(),
                digest: hold.digest.clone(),
                watermark: hold.watermark.clone(),
                changes: hold.changes,
                features: hold.features,
            };
            assert_eq!(decode_hold(&encode_versioned(2, &v2_hold)).expect("a version 2 hold reads"), hold);
            let held_reprocess = Hold { reprocess: true, ..hold };
            let bytes = encode_hold(&held_reprocess);
            assert_eq!(bytes[0], HOLD_RECORD_VERSION);
            assert_eq!(decode_hold(&bytes).expect("version 3 reads"), held_reprocess);
        }
        let e = decode_hold(&[4, 0]).unwrap_err();
        assert!(e.contains("version 4") && e.contains("holds"), "{e}");
    }

    fn clone_v1(v: &WatermarkV1) -> WatermarkV1 {
        WatermarkV1 {
            digest: v.digest.clone(),
            size: v.size,
            run_id: v.run_id,
            consumed_at_ms: v.consumed_at_ms,
            content_changed_at_ms: v.content_changed_at_ms,
            publisher_ts_ms: v.publisher_ts_ms,
            etag: v.etag.clone(),
            last_modified: v.last_modified.clone(),
            read_fingerprint: v.read_fingerprint.clone(),
            schema_hash: v.schema_hash.clone(),
        }
    }
}
