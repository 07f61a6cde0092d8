//! Areas of interest: a GeoJSON Polygon, MultiPolygon, Feature or FeatureCollection file,
//! read into one MultiPolygon, checked for finite coordinates and repaired when invalid.

use geo::MultiPolygon;
use std::path::Path;

/// Why an AOI cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AoiError {
    #[error("cannot read AOI {path}: {message}")]
    Read { path: String, message: String },
    #[error("AOI {path}: {message}")]
    Invalid { path: String, message: String },
}

/// Loads and validates an AOI file of the config (checked as a new AOI: see [`parse_new_aoi`]).
pub fn load_aoi(path: &Path) -> Result<MultiPolygon<f64>, AoiError> {
    let text = std::fs::read_to_string(path).map_err(|e| AoiError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    parse_new_aoi(&text).map_err(|message| AoiError::Invalid { path: path.display().to_string(), message })
}


/// Parses an AOI coming in (a config file, a control-port body) into a valid MultiPolygon,
/// refusing coordinates outside WGS84 longitude/latitude: an AOI in a projected system (feet,
/// metres) or typed wrong would match nothing, silently.
pub fn parse_new_aoi(text: &str) -> Result<MultiPolygon<f64>, String> {
    parse_within(text, Some(crate::ingest::normalize::WGS84_DEGREES), crate::ingest::valid::WORK_BUDGET)
}

/// Parses AOI GeoJSON text into a valid MultiPolygon as it was accepted when stored (an API
/// subscriber's AOI stored before the WGS84 check, an event's geometry re-validated on
/// replay): without the range check nor the validity check's work budget, so nothing that
/// matched before stops matching (a subscriber whose AOI no longer parses matches nothing).
pub fn parse_aoi(text: &str) -> Result<MultiPolygon<f64>, String> {
    parse_within(text, None, u64::MAX)
}

/// An AOI's polygons, cleaned (and repaired) by [`crate::ingest::normalize::clean_geometry_within`],
/// which returns only a valid geometry.
fn parse_within(text: &str, bounds: Option<[f64; 4]>, budget: u64) -> Result<MultiPolygon<f64>, String> {
    let clean = crate::ingest::geojson::sanitize_non_finite(text.as_bytes());
    let value: serde_json::Value = serde_json::from_slice(&clean).map_err(|e| format!("not JSON: {e}"))?;
    let mut polys = Vec::new();
    collect(&value, &mut polys, 0)?;
    if polys.is_empty() {
        return Err("no Polygon or MultiPolygon found (expected Polygon, MultiPolygon, Feature or FeatureCollection)".into());
    }
    let mp = MultiPolygon::new(polys);
    let (clean, _) = crate::ingest::normalize::clean_geometry_within(mp, bounds, budget).map_err(|(reason, detail)| match reason {
        crate::model::QuarantineReason::OutOfBounds => {
            "coordinates outside longitude -180..180 / latitude -90..90: an AOI is in WGS84 degrees".to_string()
        }
        _ => format!("{}: {detail}", reason.as_str()),
    })?;
    Ok(clean)
}

fn collect(v: &serde_json::Value, out: &mut Vec<geo::Polygon<f64>>, depth: usize) -> Result<(), String> {
    if depth > 8 {
        return Err("nested too deeply".into());
    }
    match v.get("type").and_then(|t| t.as_str()) {
        Some("FeatureCollection") => {
            let features = v.get("features").and_then(|f| f.as_array()).ok_or("FeatureCollection without features")?;
            for f in features {
                collect(f, out, depth + 1)?;
            }
            Ok(())
        }
        Some("Feature") => match v.get("geometry") {
            Some(g) if !g.is_null() => collect(g, out, depth + 1),
            _ => Err("Feature without geometry".into()),
        },
        Some("Polygon") | Some("MultiPolygon") | Some("GeometryCollection") => {
            let mp = crate::ingest::normalize::parse_geometry(&v.to_string())
                .map_err(|(reason, detail)| format!("{}: {detail}", reason.as_str()))?;
            out.extend(mp.0);
            Ok(())
        }
        Some(other) => Err(format!("{other} is not an area (use Polygon or MultiPolygon)")),
        None => Err("missing \"type\"".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new AOI is checked within the validity work budget; a stored one, accepted before
    /// by a build that may have had none, is not held to it (so it keeps matching).
    #[test]
    fn only_new_aois_are_held_to_the_validity_budget() {
        let square = r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1],[0,0]]]}"#;
        let starved = parse_within(square, None, 1).unwrap_err();
        assert!(starved.contains("too complex to check"), "{starved}");
        assert!(parse_within(square, None, u64::MAX).is_ok());
        assert!(parse_new_aoi(square).is_ok() && parse_aoi(square).is_ok());
    }

    #[test]
    fn coordinates_outside_lon_lat_are_refused() {
        for bad in ["[[[-200,0],[200,0],[200,95],[-200,0]]]", "[[[0,0],[1e308,0],[1,1],[0,0]]]", "[[[500000,4000000],[500100,4000000],[500100,4000100],[500000,4000000]]]"] {
            let text = format!(r#"{{"type":"Polygon","coordinates":{bad}}}"#);
            let e = parse_new_aoi(&text).unwrap_err();
            assert!(e.contains("WGS84 degrees"), "{bad}: {e}");
            // One stored before the check still parses: it keeps matching what it matched.
            assert!(parse_aoi(&text).is_ok(), "{bad}");
        }
        assert!(parse_new_aoi(r#"{"type":"Polygon","coordinates":[[[-180,-90],[180,-90],[180,90],[-180,-90]]]}"#).is_ok());
    }

    #[test]
    fn accepts_the_four_shapes_and_rejects_others() {
        let poly = r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1],[0,0]]]}"#;
        assert!(parse_aoi(poly).is_ok());
        assert!(parse_aoi(&format!(r#"{{"type":"Feature","properties":{{}},"geometry":{poly}}}"#)).is_ok());
        assert!(parse_aoi(&format!(r#"{{"type":"FeatureCollection","features":[{{"type":"Feature","geometry":{poly}}}]}}"#)).is_ok());
        assert!(parse_aoi(r#"{"type":"MultiPolygon","coordinates":[[[[0,0],[1,0],[1,1],[0,0]]]]}"#).is_ok());
        assert!(parse_aoi(r#"{"type":"Point","coordinates":[0,0]}"#).is_err());
        assert!(parse_aoi(r#"{"type":"Polygon","coordinates":[[[0,0],[NaN,0],[1,1],[0,0]]]}"#).is_err());
        assert!(parse_aoi("nope").is_err());
    }
}
