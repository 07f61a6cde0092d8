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
    /// Where the feature lies: one bounding rectangle per polygon, of the exterior ring's
    /// positions that can be read ([`places_of`]); empty when none can. The parcels there keep
    /// their derived zoning (`derived::KeptPlaces`), and in area mode the ground there its
    /// stored zoning (`detect::area::KeptCoverage`), rather than be read as if the district
    /// had gone.
    pub places: Vec<crate::model::Envelope>,
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

impl DistrictLayer {
    /// Every place of the features that could not be read ([`RejectedDistrict::places`]).
    pub fn rejected_places(&self) -> Vec<crate::model::Envelope> {
        self.rejected.iter().flat_map(|r| r.places.iter().copied()).collect()
    }

    /// The features that could not be read and have no readable position (nothing can be
    /// kept for them).
    pub fn placeless(&self) -> usize {
        self.rejected.iter().filter(|r| r.places.is_empty()).count()
    }

    /// The features that count toward the quarantine-spike hold: a systemic reason, or no
    /// readable position, which counts as a missing field does (more than half the layer so,
    /// geometry dropped by an export, is held: a tester's 17 of 32 districts with a null
    /// geometry sent 58 false alerts).
    pub fn systemic_rejected(&self) -> u64 {
        self.rejected.iter().filter(|r| r.reason.is_systemic() || r.places.is_empty()).count() as u64
    }
}

#[derive(Deserialize)]
struct RawFeature<'a> {
    #[serde(borrow, default)]
    properties: Option<&'a RawValue>,
    #[serde(borrow, default)]
    geometry: Option<&'a RawValue>,
}


/// Where a district feature that could not be read lies ([`RejectedDistrict::places`]), read
/// leniently from its JSON text: one rectangle per polygon over its exterior ring's positions
/// that are two finite numbers (within `bbox` when the source sets one), skipping the rest.
/// A position that cannot be read (a `NaN` written by a Python exporter, a stray `[0, 0]`)
/// is what quarantines a feature; it must not also take away where the feature lies, nor
/// stretch the rectangle over the whole county.
pub fn places_of(raw: &str, bbox: Option<[f64; 4]>) -> Vec<crate::model::Envelope> {
    use serde_json::Value;
    fn position(v: &Value, bbox: Option<[f64; 4]>) -> Option<[f64; 2]> {
        let p = v.as_array()?;
        let (x, y) = (p.first()?.as_f64()?, p.get(1)?.as_f64()?);
        let inside = bbox.is_none_or(|b| x >= b[0] && y >= b[1] && x <= b[2] && y <= b[3]);
        (x.is_finite() && y.is_finite() && inside).then_some([x, y])
    }
    fn ring_box(ring: &Value, bbox: Option<[f64; 4]>) -> Option<crate::model::Envelope> {
        let mut points = ring.as_array()?.iter().filter_map(|p| position(p, bbox));
        let first = points.next()?;
        Some(points.fold((first, first), |(lo, hi), p| ([lo[0].min(p[0]), lo[1].min(p[1])], [hi[0].max(p[0]), hi[1].max(p[1])])))
    }
    fn walk(g: &Value, bbox: Option<[f64; 4]>, out: &mut Vec<crate::model::Envelope>, depth: u32) {
        let coords = g.get("coordinates").and_then(Value::as_array);
        match (g.get("type").and_then(Value::as_str), coords) {
            (Some("Polygon"), Some(rings)) => out.extend(rings.first().and_then(|r| ring_box(r, bbox))),
            (Some("MultiPolygon"), Some(polys)) => {
                out.extend(polys.iter().filter_map(|p| p.as_array().and_then(|rings| rings.first()).and_then(|r| ring_box(r, bbox))))
            }
            (Some("GeometryCollection"), _) if depth < 4 => {
                for part in g.get("geometries").and_then(Value::as_array).into_iter().flatten() {
                    walk(part, bbox, out, depth + 1);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    // A number past a float's range (`1e400`) fails a parse of the whole text: quoted, it
    // is a string here, a position that cannot be read and is skipped.
    let quoted = crate::ingest::numbers::quote_unreadable_numbers(raw.as_bytes());
    let text = quoted.as_deref().unwrap_or(raw.as_bytes());
    if let Some(geometry) = serde_json::from_slice::<Value>(text).ok().as_ref().and_then(|f| f.get("geometry")) {
        walk(geometry, bbox, &mut out, 0);
    }
    out
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
            places: places_of(raw, bbox),
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

    /// Where a rejected district lies is read past what rejected it: a position of nulls (a
    /// `NaN` as the scanner hands it on) or outside the source's box is skipped, each polygon
    /// of a multipolygon has its own rectangle, and a feature with no readable position has
    /// none.
    #[test]
    fn a_rejected_district_keeps_the_places_that_can_be_read() {
        let square = "[[[0,0],[1,0],[null,0.5],[1,1],[0,1],[0,0]]]";
        let far = "[[[5,5],[6,5],[6,6],[0,0],[5,5]]]";
        let feature = |geometry: &str| format!(r#"{{"type":"Feature","properties":{{"Z":"R-1"}},"geometry":{geometry}}}"#);
        let poly = feature(&format!(r#"{{"type":"Polygon","coordinates":{square}}}"#));
        assert_eq!(places_of(&poly, None), vec![([0.0, 0.0], [1.0, 1.0])]);
        let multi = feature(&format!(r#"{{"type":"MultiPolygon","coordinates":[{square},{far}]}}"#));
        assert_eq!(places_of(&multi, None), vec![([0.0, 0.0], [1.0, 1.0]), ([0.0, 0.0], [6.0, 6.0])]);
        assert_eq!(places_of(&multi, Some([0.5, 0.5, 10.0, 10.0])), vec![([1.0, 1.0], [1.0, 1.0]), ([5.0, 5.0], [6.0, 6.0])]);
        assert_eq!(places_of(&feature("null"), None), vec![]);
        let huge = feature(r#"{"type":"Polygon","coordinates":[[[0,0],[1e400,0],[1,1],[0,0]]]}"#);
        assert_eq!(places_of(&huge, None), vec![([0.0, 0.0], [1.0, 1.0])], "a number past a float's range is skipped");
        assert_eq!(places_of(r#"{"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[0,0],[1,"#, None), vec![]);
        // Read as a layer: the damaged polygon is rejected with its place.
        let layer = format!(r#"{{"type":"FeatureCollection","features":[{poly}]}}"#);
        let l = read_districts(layer.as_bytes(), "Z", None).unwrap();
        assert_eq!((l.districts.len(), l.rejected.len()), (0, 1));
        assert_eq!(l.rejected[0].places, vec![([0.0, 0.0], [1.0, 1.0])]);
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
