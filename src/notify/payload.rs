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
    geometry: Option<crate::model::GeoJsonGeometry<'a>>,
}

/// Builds the JSON body of an outbox entry from the change fields it was queued with.
/// Deterministic: the same entry always gives the same bytes (every retry sends them).
pub fn body_for(entry: &OutboxEntry, change: &ChangeFields) -> Vec<u8> {
    let body = Body {
        kind: "zoning.change",
        // When the change was observed (Standard Webhooks: when the event occurred), the same
        // at every attempt; a held change's release is later, and its queueing with it.
        timestamp: crate::util::rfc3339(change.observed_at_ms),
        data: Data {
            idempotency_key: &entry.key.0,
            watcher_id: &entry.watcher_id,
            source_id: &entry.source_id,
            jurisdiction: &change.jurisdiction,
            parcel_id: &entry.parcel_id,
            change: change.kind.as_str(),
            // A layer without a zoning value (no zoning field, an empty one) has none: null,
            // as `from` of an addition and `to` of a removal are.
            from: change.from.as_deref().filter(|z| !z.is_empty()),
            to: change.to.as_deref().filter(|z| !z.is_empty()),
            severity: entry.severity.as_str(),
            effective_date: change.effective_date.as_deref(),
            lineage_id: &entry.lineage_id,
            observed_at: crate::util::rfc3339(change.observed_at_ms),
            area_m2: change.area_m2,
            geometry: change.geometry.as_ref().map(|g| g.geojson()),
        },
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use crate::model::StoredGeometry;

    /// The GeoJSON of a body as it was written before bodies were serialised straight from
    /// the coordinates: through a `serde_json::Value` tree.
    fn through_value(g: &StoredGeometry) -> Vec<u8> {
        let value = if g.0.len() == 1 {
            serde_json::json!({"type": "Polygon", "coordinates": g.0[0]})
        } else {
            serde_json::json!({"type": "MultiPolygon", "coordinates": g.0})
        };
        serde_json::to_vec(&value).unwrap()
    }

    /// A retry queued by an older build must send the same bytes: the direct serialisation
    /// writes what the value tree wrote, for one part, several parts, none, and odd numbers.
    #[test]
    fn geometry_bytes_match_the_value_tree() {
        let ring = vec![[-71.1, 42.37], [-71.099_999_999_9, 42.370_000_1], [1e-7, -0.0], [123_456.789, f64::NAN], [-71.1, 42.37]];
        let hole = vec![[0.5, 0.5], [0.6, 0.5], [0.6, 0.6], [0.5, 0.5]];
        let cases = [
            StoredGeometry(vec![vec![ring.clone()]]),
            StoredGeometry(vec![vec![ring.clone(), hole.clone()], vec![hole.clone()]]),
            StoredGeometry(vec![]),
            StoredGeometry(vec![vec![]]),
        ];
        for g in &cases {
            let direct = serde_json::to_vec(&g.geojson()).unwrap();
            assert_eq!(String::from_utf8_lossy(&direct), String::from_utf8_lossy(&through_value(g)));
            assert_eq!(g.to_geojson(), serde_json::from_slice::<serde_json::Value>(&through_value(g)).unwrap());
        }
    }
}
