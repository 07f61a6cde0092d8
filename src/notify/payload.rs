//! The webhook body, in the Standard Webhooks payload shape:
//! `{"type": "zoning.change", "timestamp": RFC 3339, "data": {...}}`.

use crate::model::{ChangeEvent, IdemKey};
use serde::Serialize;

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    timestamp: String,
    data: Data<'a>,
}

#[derive(Serialize)]
struct Data<'a> {
    idempotency_key: &'a str,
    watcher_id: &'a str,
    source_id: &'a str,
    jurisdiction: &'a str,
    parcel_id: &'a str,
    change: &'static str,
    from: Option<&'a str>,
    to: Option<&'a str>,
    severity: &'static str,
    effective_date: Option<&'a str>,
    lineage_id: &'a str,
    observed_at: String,
    area_m2: f64,
    geometry: serde_json::Value,
}

/// Builds the JSON body for one (watcher, change) delivery.
pub fn build_body(event: &ChangeEvent, watcher_id: &str, key: &IdemKey, lineage_id: &str, now_ms: u64) -> Vec<u8> {
    let body = Body {
        kind: "zoning.change",
        timestamp: crate::util::rfc3339(now_ms),
        data: Data {
            idempotency_key: &key.0,
            watcher_id,
            source_id: &event.source_id,
            jurisdiction: &event.jurisdiction,
            parcel_id: &event.parcel_id,
            change: event.kind.as_str(),
            from: event.from.as_deref(),
            to: event.to.as_deref(),
            severity: event.severity.as_str(),
            effective_date: event.effective_date.as_deref(),
            lineage_id,
            observed_at: crate::util::rfc3339(event.observed_at_ms),
            area_m2: (event.area_m2 * 10.0).round() / 10.0,
            geometry: event.display_geometry().map(|g| g.to_geojson()).unwrap_or(serde_json::Value::Null),
        },
    };
    serde_json::to_vec(&body).unwrap_or_default()
}
