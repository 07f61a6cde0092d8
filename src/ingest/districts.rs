//! Reading a district (or overlay) layer: polygons with a zoning code and no stable id.
//!
//! Zoning-district layers are published without ids that survive a re-publish, so a feature
//! is only its code and its shape here. Field names are matched case-insensitively when the
//! exact configured name is absent (with a note for the run record); empty, null or broken
//! geometries are rejected with a quarantine reason exactly as parcels are.

use super::geojson;
use super::normalize::{clean_layer_geometry, feature_properties, parse_geometry, prop_text_folding};
use super::IngestError;
use crate::model::QuarantineReason;
use geo::MultiPolygon;
use serde::Deserialize;
use serde_json::value::RawValue;

/// One district polygon as read.
#[derive(Debug, Clone)]
pub struct District {
    /// Zoning code as published (trimmed).
    pub code: String,
    pub geometry: MultiPolygon<f64>,
    /// Position of the feature in the file (for messages).
    pub feature_index: u64,
}

/// A district feature that could not be read, with why and its raw JSON (truncated).
#[derive(Debug, Clone)]
pub struct RejectedDistrict {
    pub feature_index: u64,
    pub reason: QuarantineReason,
    pub detail: String,
    pub raw: String,
    /// Where the feature lies (its exterior rings' bounding rectangle), when its geometry
    /// can be read: the parcels there keep their derived zoning rather than be derived as if
    /// the district had gone (`Engine::derive_pass`).
    pub footprint: Option<crate::model::Envelope>,
}

/// A whole district layer.
#[derive(Debug, Default)]
pub struct DistrictLayer {
    pub districts: Vec<District>,
    pub rejected: Vec<RejectedDistrict>,
    pub features: u64,
    pub repaired: u64,
    /// (configured field, field actually used) when matched case-insensitively.
    pub folded_fields: Vec<(String, String)>,
}

#[derive(Deserialize)]
struct RawFeature<'a> {
    #[serde(borrow, default)]
    properties: Option<&'a RawValue>,
    #[serde(borrow, default)]
    geometry: Option<&'a RawValue>,
}


/// Reads every feature of a district layer; `code_field` names the zoning-code property.
pub fn read_districts(bytes: &[u8], code_field: &str, bbox: Option<[f64; 4]>) -> Result<DistrictLayer, IngestError> {
    let mut out = DistrictLayer::default();
    let features = geojson::for_each_feature(bytes, |f| {
        let (index, raw) = (f.index, f.json);
        let reject = |reason, detail: String| RejectedDistrict {
            feature_index: index,
            reason,
            detail,
            raw: crate::util::truncate_text(raw, 16 * 1024),
            footprint: crate::ingest::normalize::footprint_of_feature(raw),
        };
        let feature: RawFeature = match serde_json::from_str(raw) {
            Ok(f) => f,
            Err(e) => {
                out.rejected.push(reject(QuarantineReason::MalformedFeature, format!("feature is not a JSON object: {e}")));
                return;
            }
        };
        let props = match feature_properties(feature.properties) {
            Ok(p) => p,
            Err(e) => {
                out.rejected.push(reject(QuarantineReason::MalformedFeature, e));
                return;
            }
        };
        let Some(code) = prop_text_folding(&props, code_field, &mut out.folded_fields) else {
            out.rejected.push(reject(QuarantineReason::MissingField, format!("missing {code_field}")));
            return;
        };
        if let Some(detail) = crate::ingest::normalize::overlong(code_field, "a district code", &code) {
            out.rejected.push(reject(QuarantineReason::FieldTooLong, detail));
            return;
        }
        if let Some(detail) = f.not_utf8.then(|| crate::ingest::normalize::damaged_text(&[Some(&code)])).flatten() {
            out.rejected.push(reject(QuarantineReason::MalformedFeature, detail));
            return;
        }
        let Some(graw) = feature.geometry else {
            out.rejected.push(reject(QuarantineReason::EmptyGeometry, "geometry is null".into()));
            return;
        };
        let parsed = parse_geometry(graw.get()).and_then(|g| clean_layer_geometry(g, bbox));
        match parsed {
            Ok((geometry, repaired)) => {
                out.repaired += u64::from(repaired);
                out.districts.push(District { code, geometry, feature_index: index });
            }
            Err((reason, detail)) => out.rejected.push(reject(reason, detail)),
        }
    })?;
    out.features = features;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_geometries_are_rejected_and_fields_fold() {
        let layer = br#"{"type":"FeatureCollection","features":[
            {"type":"Feature","properties":{"ZONE_CLASS":"RS-3"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}},
            {"type":"Feature","properties":{"zone_class":"B3-2"},"geometry":{"type":"MultiPolygon","coordinates":[]}},
            {"type":"Feature","properties":{"zone_class":"B3-2"},"geometry":null},
            {"type":"Feature","properties":{"other":"x"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}
        ]}"#;
        let l = read_districts(layer, "zone_class", None).unwrap();
        assert_eq!(l.features, 4);
        assert_eq!(l.districts.len(), 1);
        assert_eq!(l.districts[0].code, "RS-3");
        assert_eq!(l.folded_fields, vec![("zone_class".to_string(), "ZONE_CLASS".to_string())]);
        let reasons: Vec<QuarantineReason> = l.rejected.iter().map(|r| r.reason).collect();
        assert_eq!(
            reasons,
            vec![QuarantineReason::EmptyGeometry, QuarantineReason::EmptyGeometry, QuarantineReason::MissingField]
        );
    }

    #[test]
    fn a_code_past_the_cap_is_rejected() {
        let code = "B".repeat(crate::ingest::normalize::MAX_FIELD_BYTES + 1);
        let layer = format!(
            r#"{{"type":"FeatureCollection","features":[{{"type":"Feature","properties":{{"zone_class":"{code}"}},"geometry":{{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}}}]}}"#
        );
        let l = read_districts(layer.as_bytes(), "zone_class", None).unwrap();
        assert!(l.districts.is_empty());
        assert_eq!(l.rejected.len(), 1);
        assert_eq!(l.rejected[0].reason, QuarantineReason::FieldTooLong);
        assert!(l.rejected[0].detail.starts_with("zone_class is 1025 bytes"), "{}", l.rejected[0].detail);
    }
}
