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
    load(path, false).map(|(aoi, _)| aoi)
}

/// [`load_aoi`], with what its repair did when the rings as written were not a valid polygon
/// (see [`repair_note`]): `check`, `run` and `serve` warn of it.
pub fn load_aoi_noted(path: &Path) -> Result<(MultiPolygon<f64>, Option<String>), AoiError> {
    load(path, true)
}

fn load(path: &Path, noted: bool) -> Result<(MultiPolygon<f64>, Option<String>), AoiError> {
    let text = std::fs::read_to_string(path).map_err(|e| AoiError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    parse_new(&text, noted).map_err(|message| AoiError::Invalid { path: path.display().to_string(), message })
}

/// Parses an AOI coming in (a config file, a control-port body) into a valid MultiPolygon,
/// refusing coordinates outside WGS84 longitude/latitude: an AOI in a projected system (feet,
/// metres) or typed wrong would match nothing, silently.
pub fn parse_new_aoi(text: &str) -> Result<MultiPolygon<f64>, String> {
    parse_new(text, false).map(|(aoi, _)| aoi)
}

/// [`parse_new_aoi`], with what its repair did when the rings as written were not a valid
/// polygon ([`repair_note`]): the control port answers it with the subscriber it stored.
pub fn parse_new_aoi_noted(text: &str) -> Result<(MultiPolygon<f64>, Option<String>), String> {
    parse_new(text, true)
}

fn parse_new(text: &str, noted: bool) -> Result<(MultiPolygon<f64>, Option<String>), String> {
    let (aoi, note) = parse_within(text, Some(crate::ingest::normalize::WGS84_DEGREES), crate::ingest::valid::WORK_BUDGET, noted)?;
    new_aoi_sanity(&aoi)?;
    Ok((aoi, note))
}

/// What the repair of an invalid AOI did, in the terms its author drew it in: the area its
/// rings enclose as written (less their holes) and the area it covers once repaired. A hole
/// that is not inside its own ring, or rings that cross, have no one meaning, and the repair's
/// may not be the author's (a black-box tester's AOI whose hole held its whole ring became the
/// hole less the ring: the very ground drawn as left out), so `check` says it.
fn repair_note(written: &MultiPolygon<f64>, repaired: &MultiPolygon<f64>) -> String {
    use geo::{GeodesicArea, Polygon, Winding};
    // Each ring's own area, whichever way it was written (a clockwise ring's geodesic area is
    // the rest of the globe's).
    let area = |ring: &geo::LineString<f64>| {
        let mut ring = ring.clone();
        ring.make_ccw_winding();
        Polygon::new(ring, vec![]).geodesic_area_unsigned()
    };
    // Whole square metres; a ring whose halves cancel (a bowtie) encloses 0, not "-0".
    let m2 = |a: f64| format!("{:.0}", a.round().abs());
    let rings: f64 = written.0.iter().map(|p| area(p.exterior())).sum();
    let holes: f64 = written.0.iter().flat_map(|p| p.interiors()).map(area).sum();
    format!(
        "its rings are not a valid polygon (a hole not inside its own ring, rings that cross or overlap, a ring that touches itself) and were repaired: as written they enclose {} m² less {} m² of holes; repaired, the AOI covers {} m² in {} polygon(s). If that is not the area meant, draw it again: a hole lies inside its ring",
        m2(rings),
        m2(holes),
        m2(repaired.geodesic_area_unsigned()),
        repaired.0.len()
    )
}

/// What a new AOI must also be to mean what its author meant: some area (three points on a
/// line match nothing, silently), and no ring read the long way round the globe. A ring
/// written across the antimeridian (170°E → 170°W) is read as spanning 340° of longitude:
/// every place but the strip meant, so it matched counties on the other side of the world.
/// Only a ring that sits at the antimeridian (every vertex 90° or more from Greenwich) is
/// taken for one: a wide AOI with a vertex nearer Greenwich (-170 to 40) is read as written
/// (a reviewer found such configs refused), and one that reaches both -180 and 180 (a
/// world-wide band) is taken as meant.
fn new_aoi_sanity(aoi: &MultiPolygon<f64>) -> Result<(), String> {
    use geo::{Area, BoundingRect};
    if aoi.unsigned_area() == 0.0 {
        return Err("it has no area (its points lie on a line, or repeat): it would match nothing".into());
    }
    for p in &aoi.0 {
        let Some(r) = p.bounding_rect() else { continue };
        let (west, east) = (r.min().x, r.max().x);
        let at_the_antimeridian = p.exterior().0.iter().all(|c| c.x.abs() >= 90.0);
        if east - west > 180.0 && at_the_antimeridian && !(west <= -180.0 && east >= 180.0) {
            return Err(format!(
                "a polygon spans {:.0}° of longitude ({west} to {east}) with every vertex near the antimeridian: a ring crossing the antimeridian must be split there into two (RFC 7946 §3.1.9), as written it covers the other side of the globe; an AOI meant to cover (nearly) every longitude is written from -180 to 180",
                east - west
            ));
        }
    }
    Ok(())
}

/// Parses AOI GeoJSON text into a valid MultiPolygon as it was accepted when stored (an API
/// subscriber's AOI stored before the WGS84 check, an event's geometry re-validated on
/// replay): without the range check nor the validity check's work budget, so nothing that
/// matched before stops matching (a subscriber whose AOI no longer parses matches nothing).
pub fn parse_aoi(text: &str) -> Result<MultiPolygon<f64>, String> {
    parse_within(text, None, u64::MAX, false).map(|(aoi, _)| aoi)
}

/// An AOI's polygons, cleaned (and repaired) by [`crate::ingest::normalize::clean_geometry_within`],
/// which returns only a valid geometry; with [`repair_note`] when it had to be repaired and
/// `noted` asks for it (`check`, `run`, `serve` and the control port say it; replay and matching
/// would throw it away).
fn parse_within(text: &str, bounds: Option<[f64; 4]>, budget: u64, noted: bool) -> Result<(MultiPolygon<f64>, Option<String>), String> {
    let clean = crate::ingest::geojson::sanitize_non_finite(text.as_bytes());
    let value: serde_json::Value = serde_json::from_slice(&clean).map_err(|e| format!("not JSON: {e}"))?;
    // A new AOI whose `crs` names another system: its coordinates are not lon/lat, whatever
    // their range. (One stored before this check keeps matching.)
    if let Some(name) = bounds.and(value.get("crs")).and_then(crate::ingest::geojson::crs_name) {
        if !crate::ingest::geojson::crs_is_wgs84(&name) {
            return Err(format!("its crs is {name:?}: an AOI is in WGS84 longitude/latitude (RFC 7946), without a crs member or with CRS84 / EPSG:4326"));
        }
    }
    let mut polys = Vec::new();
    let mut unsaid = Unsaid::default();
    collect(&value, &mut polys, &mut unsaid, 0)?;
    if polys.is_empty() {
        return Err("no Polygon or MultiPolygon found (expected Polygon, MultiPolygon, Feature or FeatureCollection)".into());
    }
    let mp = MultiPolygon::new(polys);
    let written = noted.then(|| mp.clone());
    let (clean, repaired) = crate::ingest::normalize::clean_geometry_within(mp, bounds, budget).map_err(|(reason, detail)| match reason {
        crate::model::QuarantineReason::OutOfBounds => {
            "coordinates outside longitude -180..180 / latitude -90..90: an AOI is in WGS84 degrees".to_string()
        }
        _ => format!("{}: {detail}", reason.as_str()),
    })?;
    let mut notes: Vec<String> = written.filter(|_| repaired).map(|written| repair_note(&written, &clean)).into_iter().collect();
    if noted && unsaid.open_rings > 0 {
        notes.push(format!("{} ring(s) do not end where they start (RFC 7946 rings are closed): read as closed, each with a side from its last point back to its first", unsaid.open_rings));
    }
    if noted && unsaid.left_out > 0 {
        notes.push(format!("{} member(s) of a GeometryCollection are points or lines, not areas: left out (an AOI matches by its area; draw a corridor or a buffer around a point as a Polygon)", unsaid.left_out));
    }
    Ok((clean, (!notes.is_empty()).then(|| notes.join("; "))))
}

/// What the geometry reader takes without a word, and an AOI's note says, counted by
/// [`collect`] on each geometry it reads, in one walk:
/// * rings that end elsewhere than where they start: read as closed (the geometry library
///   closes them), said, since the side it adds may not be the one meant (a black-box
///   tester's unclosed ring was taken without a word);
/// * members of a GeometryCollection that are points or lines: left out (an AOI drawn as a
///   parcel and the road beside it would match the parcel only, and nothing said so).
#[derive(Default)]
struct Unsaid {
    open_rings: usize,
    left_out: usize,
}

impl Unsaid {
    fn count(&mut self, v: &serde_json::Value, depth: usize) {
        let open_in = |rings: &serde_json::Value| -> usize {
            rings.as_array().map_or(0, |rings| rings.iter().filter_map(|r| r.as_array()).filter(|r| r.len() > 1 && r.first() != r.last()).count())
        };
        if depth > 8 {
            return;
        }
        match v.get("type").and_then(|t| t.as_str()) {
            Some("GeometryCollection") => {
                for member in v.get("geometries").and_then(|g| g.as_array()).into_iter().flatten() {
                    match member.get("type").and_then(|t| t.as_str()) {
                        Some("Point" | "MultiPoint" | "LineString" | "MultiLineString") => self.left_out += 1,
                        _ => self.count(member, depth + 1),
                    }
                }
            }
            Some("Polygon") => self.open_rings += v.get("coordinates").map_or(0, open_in),
            Some("MultiPolygon") => self.open_rings += v.get("coordinates").and_then(|c| c.as_array()).map_or(0, |ps| ps.iter().map(open_in).sum()),
            _ => {}
        }
    }
}

fn collect(v: &serde_json::Value, out: &mut Vec<geo::Polygon<f64>>, unsaid: &mut Unsaid, depth: usize) -> Result<(), String> {
    if depth > 8 {
        return Err("nested too deeply".into());
    }
    match v.get("type").and_then(|t| t.as_str()) {
        Some("FeatureCollection") => {
            let features = v.get("features").and_then(|f| f.as_array()).ok_or("FeatureCollection without features")?;
            for f in features {
                collect(f, out, unsaid, depth + 1)?;
            }
            Ok(())
        }
        Some("Feature") => match v.get("geometry") {
            Some(g) if !g.is_null() => collect(g, out, unsaid, depth + 1),
            _ => Err("Feature without geometry".into()),
        },
        Some("Polygon") | Some("MultiPolygon") | Some("GeometryCollection") => {
            let mp = crate::ingest::normalize::parse_geometry(&v.to_string())
                .map_err(|(reason, detail)| format!("{}: {detail}", reason.as_str()))?;
            out.extend(mp.0);
            unsaid.count(v, depth);
            Ok(())
        }
        Some(other) => Err(format!("{other} is not an area (use Polygon or MultiPolygon)")),
        None => Err("missing \"type\"".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring that does not end where it starts is read as closed, and said.
    #[test]
    fn an_unclosed_ring_is_read_as_closed_and_said() {
        let open = r#"{"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1]]]}}"#;
        let (aoi, note) = parse_new_aoi_noted(open).unwrap();
        assert!(note.is_some_and(|n| n.starts_with("1 ring(s) do not end where they start")));
        let closed = r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1],[0,0]]]}"#;
        let (same, none) = parse_new_aoi_noted(closed).unwrap();
        assert_eq!((aoi, none), (same, None));
    }

    /// The points and lines of a GeometryCollection AOI are left out, and said; its polygons
    /// are the AOI. A collection of polygons only says nothing.
    #[test]
    fn a_collections_points_and_lines_are_left_out_and_said() {
        let square = r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1],[0,0]]]}"#;
        let mixed = format!(
            r#"{{"type":"Feature","geometry":{{"type":"GeometryCollection","geometries":[{square},{{"type":"LineString","coordinates":[[2,2],[3,3]]}},{{"type":"GeometryCollection","geometries":[{{"type":"Point","coordinates":[5,5]}}]}}]}}}}"#
        );
        let (aoi, note) = parse_new_aoi_noted(&mixed).unwrap();
        assert_eq!(aoi, parse_new_aoi(square).unwrap(), "the polygon is the AOI");
        assert!(note.as_deref().is_some_and(|n| n.starts_with("2 member(s) of a GeometryCollection are points or lines")), "{note:?}");
        let polygons_only = format!(r#"{{"type":"GeometryCollection","geometries":[{square}]}}"#);
        assert_eq!(parse_new_aoi_noted(&polygons_only).unwrap().1, None);
    }

    /// A new AOI is checked within the validity work budget; a stored one, accepted before
    /// by a build that may have had none, is not held to it (so it keeps matching).
    #[test]
    fn only_new_aois_are_held_to_the_validity_budget() {
        let square = r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1],[0,0]]]}"#;
        let starved = parse_within(square, None, 1, false).unwrap_err();
        assert!(starved.contains("too complex to check"), "{starved}");
        assert!(parse_within(square, None, u64::MAX, false).is_ok());
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

    /// A new AOI with no area, written across the antimeridian, or in another crs is refused
    /// with a line that says why; a stored one still parses (it keeps matching).
    #[test]
    fn a_new_aoi_must_mean_an_area_in_lon_lat() {
        for (text, why) in [
            (r#"{"type":"Polygon","coordinates":[[[0,0],[1,1],[2,2],[0,0]]]}"#, "no area"),
            (r#"{"type":"Polygon","coordinates":[[[170,40],[-170,40],[-170,45],[170,45],[170,40]]]}"#, "antimeridian"),
            // Nearly the whole world, but not to ±180: ambiguous, and the line says both ways out.
            (r#"{"type":"Polygon","coordinates":[[[-179.9,-80],[179.9,-80],[179.9,80],[-179.9,80],[-179.9,-80]]]}"#, "written from -180 to 180"),
            (r#"{"type":"Polygon","crs":{"type":"name","properties":{"name":"EPSG:3857"}},"coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}"#, "EPSG:3857"),
            (r#"{"type":"FeatureCollection","crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:EPSG::2249"}},"features":[{"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}]}"#, "2249"),
        ] {
            let e = parse_new_aoi(text).unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
        assert!(parse_aoi(r#"{"type":"Polygon","coordinates":[[[170,40],[-170,40],[-170,45],[170,45],[170,40]]]}"#).is_ok());
        // CRS84 named, a world-wide band, and an ordinary county box are fine.
        for ok in [
            r#"{"type":"Polygon","crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:OGC:1.3:CRS84"}},"coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}"#,
            r#"{"type":"Polygon","coordinates":[[[-180,-60],[180,-60],[180,60],[-180,60],[-180,-60]]]}"#,
            r#"{"type":"Polygon","coordinates":[[[-71.2,42.3],[-71.0,42.3],[-71.0,42.5],[-71.2,42.5],[-71.2,42.3]]]}"#,
            // Wide, with vertices near Greenwich: read as written (a reviewer found it refused).
            r#"{"type":"Polygon","coordinates":[[[-170,-50],[40,-50],[40,50],[-170,50],[-170,-50]]]}"#,
        ] {
            assert!(parse_new_aoi(ok).is_ok(), "{ok}: {:?}", parse_new_aoi(ok));
        }
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
