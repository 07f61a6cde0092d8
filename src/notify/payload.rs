//! The webhook body, in the Standard Webhooks payload shape:
//! `{"type": "zoning.change", "timestamp": RFC 3339, "data": {...}}`.

use crate::model::{ChangeFields, OutboxEntry};
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

/// Builds the JSON body of an outbox entry from the change fields it was queued with.
/// Deterministic: the same entry always gives the same bytes (every retry sends them).
pub fn body_for(entry: &OutboxEntry, change: &ChangeFields) -> Vec<u8> {
    let body = Body {
        kind: "zoning.change",
        timestamp: crate::util::rfc3339(change.queued_ms),
        data: Data {
            idempotency_key: &entry.key.0,
            watcher_id: &entry.watcher_id,
            source_id: &entry.source_id,
            jurisdiction: &change.jurisdiction,
            parcel_id: &entry.parcel_id,
            change: change.kind.as_str(),
            from: change.from.as_deref(),
            to: change.to.as_deref(),
            severity: entry.severity.as_str(),
            effective_date: change.effective_date.as_deref(),
            lineage_id: &entry.lineage_id,
            observed_at: crate::util::rfc3339(change.observed_at_ms),
            area_m2: change.area_m2,
            geometry: change.geometry.as_ref().map(|g| g.to_geojson()).unwrap_or(serde_json::Value::Null),
        },
    };
    serde_json::to_vec(&body).unwrap_or_default()
}
