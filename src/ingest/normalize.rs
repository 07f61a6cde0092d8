//! One raw feature → a normalised [`Parcel`], or a quarantine reason.
//!
//! Steps: read the configured properties (trimmed), parse the geometry into polygons, reject
//! non-finite coordinates, drop repeated points, check the sanity bbox, repair invalid
//! polygons (geo's `MakeValid`, keeping polygonal parts) and orient rings as RFC 7946 says.
//! Geometry work on untrusted input runs under `catch_unwind`: a panic inside a geometry
//! algorithm quarantines the feature instead of taking the process down.

use crate::config::FieldMap;
use crate::detect::canonical;
use super::valid::Validity;
use crate::model::{Envelope, Parcel, ParcelState, QuarantineReason, StoredGeometry};
use geo::{
    BoundingRect, Coord, GeodesicArea, LineString, MakeValid, MultiPolygon, Polygon,
};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// A feature that could not be taken, with why.
#[derive(Debug, Clone)]
pub struct Rejected {
    pub parcel_id: Option<String>,
    pub reason: QuarantineReason,
    pub detail: String,
    /// Where a feature without a parcel id lies: the bounding rectangle of its geometry's
    /// exterior rings, when that geometry can be read. The diff does not take a stored
    /// parcel lying under it for removed (it may be this feature, its id lost). `None` for a
    /// feature with an id (that parcel keeps its stored state anyway) or no readable geometry.
    pub footprint: Option<Envelope>,
}

/// What normalising needs to know about the source.
#[derive(Debug, Clone)]
pub struct NormalizeRules<'a> {
    pub fields: &'a FieldMap,
    pub bbox: Option<[f64; 4]>,
}

/// The result for one feature; `repaired` says the geometry needed repair.
#[derive(Debug)]
pub struct Normalized {
    pub parcel: Parcel,
    pub repaired: bool,
    /// Configured field names that were absent and matched case-insensitively instead, as
    /// (configured, found): the run record gets a warning.
    pub folded_fields: Vec<(String, String)>,
}

/// The run warnings for configured field names that were absent and matched
/// case-insensitively instead, as (configured, found) pairs.
pub fn folded_field_warnings(folded: &[(String, String)]) -> Vec<String> {
    folded.iter().map(|(want, got)| format!("field {want:?} is absent; matched {got:?} case-insensitively")).collect()
}

#[derive(Deserialize)]
struct RawFeature<'a> {
    #[serde(borrow, default)]
    properties: Option<&'a RawValue>,
    #[serde(borrow, default)]
    geometry: Option<&'a RawValue>,
}

/// A feature read in one pass, its geometry parsed with it. Reading the feature with the
/// geometry as raw text and then parsing that text went over the geometry (most of a
/// feature's bytes) twice. When this fails, the feature is read again as a [`RawFeature`],
/// so a malformed feature is rejected exactly as before, with its parcel id when it has one.
#[derive(Deserialize)]
struct OnePassFeature<'a> {
    #[serde(borrow, default)]
    properties: Option<&'a RawValue>,
    #[serde(borrow, default)]
    geometry: Option<RawGeometry<'a>>,
}

/// A feature's geometry: parsed already, or its text still to parse.
enum GeometryInput<'a> {
    Parsed(RawGeometry<'a>),
    Text(&'a RawValue),
}

/// Normalises one feature given as raw JSON.
pub fn normalize_feature(raw: &str, rules: &NormalizeRules) -> Result<Normalized, Rejected> {
    let reject = |pid: Option<String>, reason, detail: String| Rejected { parcel_id: pid, reason, detail, footprint: None };
    let (properties, geometry) = match serde_json::from_str::<OnePassFeature>(raw) {
        Ok(f) => (f.properties, f.geometry.map(GeometryInput::Parsed)),
        Err(_) => {
            let feature: RawFeature = serde_json::from_str(raw)
                .map_err(|e| reject(None, QuarantineReason::MalformedFeature, format!("feature is not a JSON object: {e}")))?;
            (feature.properties, feature.geometry.map(GeometryInput::Text))
        }
    };
    // A feature taken without an id still says where it lies, if it can.
    let unidentified = |reason, detail: String, geometry: Option<GeometryInput<'_>>| Rejected {
        parcel_id: None,
        reason,
        detail,
        footprint: geometry.and_then(footprint_of),
    };
    let props = match feature_properties(properties) {
        Ok(props) => props,
        Err(e) => return Err(unidentified(QuarantineReason::MalformedFeature, e, geometry)),
    };
    let mut folded_fields = Vec::new();
    let id = prop_text_folding(&props, &rules.fields.parcel_id, &mut folded_fields);
    let Some(id) = id else {
        return Err(unidentified(QuarantineReason::MissingField, format!("missing {}", rules.fields.parcel_id), geometry));
    };
    // An id past the cap names no parcel any publisher means (it would be stored in the
    // snapshot, every key, audit row and webhook): taken without an id, where it lies.
    if let Some(detail) = overlong(&rules.fields.parcel_id, "a parcel id", &id) {
        return Err(unidentified(QuarantineReason::FieldTooLong, detail, geometry));
    }
    // An empty zoning field name means a pure parcel base (zoning derived from districts).
    let zoning = if rules.fields.zoning.trim().is_empty() {
        String::new()
    } else {
        match prop_text_folding(&props, &rules.fields.zoning, &mut folded_fields) {
            Some(z) => z,
            None => {
                return Err(reject(Some(id), QuarantineReason::MissingField, format!("missing {}", rules.fields.zoning)))
            }
        }
    };
    let effective_date =
        rules.fields.effective_date.as_ref().and_then(|f| prop_text_folding(&props, f, &mut folded_fields));
    // Kept under its id, so that its parcel keeps its stored state.
    let too_long = overlong(&rules.fields.zoning, "a zoning code", &zoning).or_else(|| {
        let (field, date) = (rules.fields.effective_date.as_deref()?, effective_date.as_deref()?);
        overlong(field, "an effective date", date)
    });
    if let Some(detail) = too_long {
        return Err(reject(Some(id), QuarantineReason::FieldTooLong, detail));
    }

    let geom = match geometry {
        Some(GeometryInput::Parsed(g)) => polygons_of(g),
        Some(GeometryInput::Text(text)) => parse_geometry(text.get()),
        None => return Err(reject(Some(id), QuarantineReason::EmptyGeometry, "geometry is null".into())),
    };
    let geom = geom.map_err(|(reason, detail)| reject(Some(id.clone()), reason, detail))?;
    let (geometry, repaired) = clean_layer_geometry(geom, rules.bbox).map_err(|(reason, detail)| reject(Some(id.clone()), reason, detail))?;

    let geom_hash = canonical::geometry_hash(&geometry);
    let content_hash = canonical::content_hash(&zoning, effective_date.as_deref(), &geom_hash);
    let area_m2 = parcel_area_m2(&geometry);
    Ok(Normalized {
        parcel: Parcel {
            id,
            state: ParcelState { zoning, effective_date, content_hash, geom_hash, area_m2, revision: 0, announced: None },
            geometry: StoredGeometry::from_geo(&geometry),
        },
        repaired,
        folded_fields,
    })
}

/// Where the feature `raw` lies (its [`Rejected::footprint`]), read again from its text: for
/// a feature rejected under an id that turned out not to be one (bytes that are not UTF-8).
pub fn footprint_of_feature(raw: &str) -> Option<Envelope> {
    let feature: RawFeature = serde_json::from_str(raw).ok()?;
    feature.geometry.map(GeometryInput::Text).and_then(footprint_of)
}

/// The [`Rejected::footprint`] of a feature's geometry: the bounding rectangle of its
/// polygons' exterior rings, or `None` when the geometry cannot be read or has no finite
/// point.
fn footprint_of(geometry: GeometryInput<'_>) -> Option<Envelope> {
    let polygons = match geometry {
        GeometryInput::Parsed(g) => polygons_of(g),
        GeometryInput::Text(text) => parse_geometry(text.get()),
    };
    let rect = polygons.ok()?.bounding_rect()?;
    let (lo, hi) = (rect.min(), rect.max());
    [lo.x, lo.y, hi.x, hi.y].iter().all(|v| v.is_finite()).then_some(([lo.x, lo.y], [hi.x, hi.y]))
}

/// Area of a parcel in square metres. Parcel-sized shapes (under ~2 km across) are projected
/// onto a local plane (each vertex's parallel scaled by the WGS84 prime-vertical radius there,
/// meridian arcs by the radius at the centre: nearly equal-area) and measured with the
/// shoelace formula: within 3e-6 of the geodesic area at that size and far cheaper, which
/// matters at millions of parcels. Larger shapes get the exact geodesic area.
pub fn parcel_area_m2(mp: &MultiPolygon<f64>) -> f64 {
    let Some(rect) = mp.bounding_rect() else { return 0.0 };
    if rect.width() > 0.02 || rect.height() > 0.02 {
        return mp.geodesic_area_unsigned();
    }
    const A: f64 = 6_378_137.0;
    const F: f64 = 1.0 / 298.257_223_563;
    let e2 = F * (2.0 - F);
    let (lon0, lat0) = (rect.center().x, rect.center().y);
    let phi = lat0.to_radians();
    let w = 1.0 - e2 * phi.sin().powi(2);
    let m = A * (1.0 - e2) / w.powf(1.5);
    let n = A / w.sqrt();
    // Sinusoidal-style: x scales with each vertex's own parallel, which keeps the projection
    // (nearly) equal-area across the shape; y is the meridian arc at the centre's radius.
    let deg = std::f64::consts::PI / 180.0;
    let ky = m * deg;
    let project = |c: Coord<f64>| -> (f64, f64) {
        let p = c.y * deg;
        let n_here = n * (w / (1.0 - e2 * p.sin().powi(2))).sqrt();
        ((c.x - lon0) * deg * n_here * p.cos(), (c.y - lat0) * ky)
    };
    let ring_area = |ring: &LineString<f64>| -> f64 {
        let mut twice = 0.0;
        for l in ring.lines() {
            let (x1, y1) = project(l.start);
            let (x2, y2) = project(l.end);
            twice += x1 * y2 - x2 * y1;
        }
        (twice / 2.0).abs()
    };
    mp.0.iter()
        .map(|p| (ring_area(p.exterior()) - p.interiors().iter().map(ring_area).sum::<f64>()).max(0.0))
        .sum()
}

/// A feature's properties: names borrowed from the feature text where they have no escapes,
/// values left unparsed until asked for. A county layer carries dozens of attributes per
/// parcel and zonewatch reads three, so building a map of parsed values for every feature was
/// most of the cost of reading a layer.
#[derive(Default)]
pub struct Props<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Props<'a> {
    /// The value of `name` (the last one, if a feature repeats a name).
    fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0.iter().rev().find(|(k, _)| k == name).map(|(_, v)| *v)
    }
}

impl<'de> Deserialize<'de> for Props<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Props<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of properties")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Props<'de>, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((k, v)) = map.next_entry::<Name<'de>, &'de RawValue>()? {
                    out.push((k.0, v));
                }
                Ok(Props(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A property name, borrowed unless it had to be unescaped.
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a property name")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Parsed `properties` of a feature (absent or null → empty).
pub fn feature_properties<'a>(props: Option<&'a RawValue>) -> Result<Props<'a>, String> {
    match props {
        None => Ok(Props::default()),
        Some(p) => serde_json::from_str::<Option<Props<'a>>>(p.get())
            .map(Option::unwrap_or_default)
            .map_err(|e| format!("properties: {e}")),
    }
}

/// [`prop_text`], but when the exact name is absent a property whose name matches
/// case-insensitively is used instead (publishers rename `ZONE_CLASS` → `zone_class`), and the
/// substitution is recorded in `folded` (once per pair).
pub fn prop_text_folding(props: &Props<'_>, name: &str, folded: &mut Vec<(String, String)>) -> Option<String> {
    if let Some(v) = props.get(name) {
        return prop_text(v);
    }
    let mut keys: Vec<&str> = props.0.iter().map(|(k, _)| k.as_ref()).filter(|k| k.eq_ignore_ascii_case(name)).collect();
    keys.sort();
    let key = *keys.first()?;
    let pair = (name.to_string(), key.to_string());
    if !folded.contains(&pair) {
        folded.push(pair);
    }
    prop_text(props.get(key)?)
}

/// A property as trimmed text; numbers are written in their JSON form (an integer exactly as
/// written, however long; a number out of a float's range too), except that a whole number
/// written as a float (`12345.0`, `1.2345e4`) reads as the integer (`12345`). Empty → None.
fn prop_text(raw: &RawValue) -> Option<String> {
    // A string without escapes, borrowed (most attribute values); anything else is parsed.
    if let Ok(s) = serde_json::from_str::<&str>(raw.get()) {
        let t = s.trim();
        return (!t.is_empty()).then(|| t.to_string());
    }
    let literal = raw.get().trim();
    let numeric = literal.starts_with(|c: char| c == '-' || c.is_ascii_digit());
    // A number past the cap as written: kept so, for the cap to refuse it (a number of 1,100
    // digits read as a float kept 17 of them, under the cap: found by a black-box tester). A
    // string is measured as it decodes (`\/` and `\u00e9` are longer written than read).
    if numeric && literal.len() > MAX_FIELD_BYTES {
        return Some(literal.to_string());
    }
    // An integer is its digits as written: one past 2^64 would otherwise be read as a float
    // and lose digits (two long codes or ids could then read the same).
    let digits = literal.strip_prefix('-').unwrap_or(literal);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some(literal.to_string());
    }
    let text = match serde_json::from_str::<serde_json::Value>(literal) {
        Ok(serde_json::Value::String(s)) => s.trim().to_string(),
        Ok(serde_json::Value::Number(n)) => number_text(&n),
        Ok(serde_json::Value::Bool(b)) => b.to_string(),
        // A number too large for a float (`1e400`) is there all the same: as written, not
        // taken for a missing field.
        Err(_) if numeric => literal.to_string(),
        _ => return None,
    };
    if text.is_empty() {
        None
    } else {
        Some(text)
    }
}

/// The most bytes an id, a zoning or district code or an effective date may have. Real ones
/// are tens of bytes (a 14-digit PIN, `R-1-6`, a GUID, a date); a value past this is a
/// broken or hostile feed, and each parcel's value is copied into the snapshot, its keys,
/// audit rows and webhooks (an 8 MiB id made a 64 MiB store of a four-parcel layer).
pub const MAX_FIELD_BYTES: usize = 1024;

/// The quarantine detail of a `what` read from `field` past [`MAX_FIELD_BYTES`], or `None`.
pub fn overlong(field: &str, what: &str, value: &str) -> Option<String> {
    (value.len() > MAX_FIELD_BYTES).then(|| {
        let start = crate::util::truncate_text(value, 40);
        format!("{field} is {} bytes (it begins {start:?}): {what} is at most {MAX_FIELD_BYTES} bytes", value.len())
    })
}

/// The quarantine detail of a feature whose id, zoning code or date held bytes that are not
/// UTF-8 (read as U+FFFD): its parcel keeps its stored state, and no rezoning to a code the
/// publisher never wrote is alerted. Bad bytes elsewhere in a feature (an owner's name in
/// Latin-1) do not matter to the diff and are let through.
pub fn damaged_text(fields: &[Option<&str>]) -> Option<String> {
    fields
        .iter()
        .flatten()
        .any(|t| t.contains('\u{FFFD}'))
        .then(|| "the feature's id, zoning or date holds bytes that are not UTF-8 (shown as U+FFFD)".to_string())
}

/// A number as an id or code: one text for one value. Publishers write the same integer id
/// as `12345` in one version and `12345.0` in the next (a float column: pandas makes one of
/// an integer column with a gap), which must not read as a parcel removed and another added.
/// Whole numbers up to 2^53 (exact in a double) are written as integers; others as JSON has them.
pub(crate) fn number_text(n: &serde_json::Number) -> String {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match n.as_f64() {
        Some(x) if n.is_f64() && x.fract() == 0.0 && x.abs() <= EXACT => format!("{}", x as i64),
        _ => n.to_string(),
    }
}

/// Nested coordinate arrays of any depth; `null` (a sanitised `NaN`) reads as NaN.
///
/// Positions and arrays of positions (rings) are read straight into [`Coord`]s: a county
/// layer has tens of millions of positions, and a `Vec` per position was the largest cost of
/// parsing a geometry. Anything else keeps the general shape, so malformed coordinates are
/// rejected exactly as before (see [`Coords::into_elements`]).
enum Coords {
    Num(f64),
    /// An array whose first two elements are numbers (any further ones are ignored: a
    /// position's elevation or measure).
    Position(Coord<f64>),
    /// A non-empty array whose every element is a [`Coords::Position`]: a ring.
    Positions(Vec<Coord<f64>>),
    List(Vec<Coords>),
}

impl Coords {
    /// This array's elements in the general shape (a position as its two numbers, a ring as
    /// its positions); `None` for a number.
    fn into_elements(self) -> Option<Vec<Coords>> {
        match self {
            Coords::Num(_) => None,
            Coords::Position(c) => Some(vec![Coords::Num(c.x), Coords::Num(c.y)]),
            Coords::Positions(v) => Some(v.into_iter().map(Coords::Position).collect()),
            Coords::List(v) => Some(v),
        }
    }
}

impl<'de> Deserialize<'de> for Coords {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Coords;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number or an array of coordinates")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Coords, E> {
                Ok(Coords::Num(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Coords, E> {
                Ok(Coords::Num(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Coords, E> {
                Ok(Coords::Num(v as f64))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Coords, E> {
                Ok(Coords::Num(f64::NAN))
            }
            fn visit_none<E: de::Error>(self) -> Result<Coords, E> {
                Ok(Coords::Num(f64::NAN))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Coords, A::Error> {
                // Every element is read as `Coords`, also those a position ignores, so an
                // element of the wrong type fails the parse as it always did.
                let Some(first) = seq.next_element::<Coords>()? else { return Ok(Coords::List(Vec::new())) };
                match first {
                    Coords::Num(x) => match seq.next_element::<Coords>()? {
                        Some(Coords::Num(y)) => {
                            while seq.next_element::<Coords>()?.is_some() {}
                            Ok(Coords::Position(Coord { x, y }))
                        }
                        second => list_with_rest(std::iter::once(Coords::Num(x)).chain(second).collect(), seq),
                    },
                    Coords::Position(c) => {
                        let mut ring = Vec::with_capacity(8);
                        ring.push(c);
                        while let Some(next) = seq.next_element::<Coords>()? {
                            match next {
                                Coords::Position(c) => ring.push(c),
                                // Not a ring after all: back to the general shape.
                                other => return list_with_rest(ring.into_iter().map(Coords::Position).chain([other]).collect(), seq),
                            }
                        }
                        Ok(Coords::Positions(ring))
                    }
                    other => list_with_rest(vec![other], seq),
                }
            }
        }
        /// A general array: the elements read so far, then the rest of `seq`.
        fn list_with_rest<'de, A: SeqAccess<'de>>(mut v: Vec<Coords>, mut seq: A) -> Result<Coords, A::Error> {
            while let Some(c) = seq.next_element()? {
                v.push(c);
            }
            Ok(Coords::List(v))
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct RawGeometry<'a> {
    /// Borrowed from the feature text unless it had escapes.
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    coordinates: Option<Coords>,
    #[serde(borrow)]
    geometries: Option<Vec<RawGeometry<'a>>>,
}

type GeomError = (QuarantineReason, String);

/// Parses a GeoJSON geometry into polygons (polygonal parts of collections are kept).
pub fn parse_geometry(json: &str) -> Result<MultiPolygon<f64>, GeomError> {
    let g: RawGeometry = serde_json::from_str(json)
        .map_err(|e| (QuarantineReason::MalformedFeature, format!("geometry: {e}")))?;
    polygons_of(g)
}

/// The polygons of a parsed geometry (polygonal parts of collections are kept).
fn polygons_of(g: RawGeometry<'_>) -> Result<MultiPolygon<f64>, GeomError> {
    let mut polys = Vec::new();
    let kind = g.kind.clone();
    collect_polygons(g, &mut polys, 0)?;
    if polys.is_empty() {
        return Err((QuarantineReason::EmptyGeometry, format!("{kind} has no polygons")));
    }
    Ok(MultiPolygon::new(polys))
}

fn collect_polygons(g: RawGeometry<'_>, out: &mut Vec<Polygon<f64>>, depth: usize) -> Result<(), GeomError> {
    let malformed = |m: String| (QuarantineReason::MalformedFeature, m);
    let RawGeometry { kind, coordinates, geometries } = g;
    match kind.as_ref() {
        "Polygon" => {
            if let Some(c) = coordinates {
                if let Some(p) = polygon_from(c).map_err(malformed)? {
                    out.push(p);
                }
            }
        }
        "MultiPolygon" => {
            if let Some(c) = coordinates {
                let polys = c.into_elements().ok_or_else(|| malformed("MultiPolygon coordinates must be an array".into()))?;
                for c in polys {
                    if let Some(p) = polygon_from(c).map_err(malformed)? {
                        out.push(p);
                    }
                }
            }
        }
        "GeometryCollection" => {
            if depth > 8 {
                return Err(malformed("GeometryCollection nested too deeply".into()));
            }
            for child in geometries.into_iter().flatten() {
                match collect_polygons(child, out, depth + 1) {
                    Ok(()) => {}
                    Err((QuarantineReason::NotPolygonal, _)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        "Point" | "MultiPoint" | "LineString" | "MultiLineString" => {
            return Err((QuarantineReason::NotPolygonal, format!("{kind} is not polygonal")))
        }
        other => return Err(malformed(format!("unknown geometry type {other:?}"))),
    }
    Ok(())
}

fn polygon_from(c: Coords) -> Result<Option<Polygon<f64>>, String> {
    let rings = c.into_elements().ok_or("Polygon coordinates must be an array of rings")?;
    let mut out_rings = Vec::with_capacity(rings.len());
    for ring in rings {
        let coords = match ring {
            // The common case, read as coordinates already.
            Coords::Positions(coords) => coords,
            other => {
                let positions = other.into_elements().ok_or("a ring must be an array of positions")?;
                let mut coords = Vec::with_capacity(positions.len());
                for pos in positions {
                    let xy = match pos {
                        Coords::Position(c) => {
                            coords.push(c);
                            continue;
                        }
                        other => other.into_elements().ok_or("a position must be an array of numbers")?,
                    };
                    let num = |i: usize| match xy.get(i) {
                        Some(Coords::Num(v)) => Ok(*v),
                        _ => Err("a position needs two numbers".to_string()),
                    };
                    coords.push(Coord { x: num(0)?, y: num(1)? });
                }
                coords
            }
        };
        out_rings.push(LineString::new(coords));
    }
    let mut it = out_rings.into_iter();
    match it.next() {
        None => Ok(None),
        Some(ext) if ext.0.is_empty() => Ok(None),
        Some(ext) => Ok(Some(Polygon::new(ext, it.collect()))),
    }
}

/// Longitude / latitude bounds [min x, min y, max x, max y]: every coordinate of a feature
/// (without a source bbox) and of a new AOI lies within them.
pub const WGS84_DEGREES: [f64; 4] = [-180.0, -90.0, 180.0, 90.0];

/// [`clean_geometry`] for a feature of a layer (parcels or districts) with its source's
/// `bbox`. Without one, the bounds are the globe's: a layer in a projected system
/// (state-plane feet, UTM metres) read as degrees would otherwise be stored as garbage,
/// matching no AOI, silently. Each feature is quarantined instead (saying why), and the
/// quarantine-spike hold stops the run for an operator.
pub fn clean_layer_geometry(mp: MultiPolygon<f64>, bbox: Option<[f64; 4]>) -> Result<(MultiPolygon<f64>, bool), GeomError> {
    clean_geometry(mp, Some(bbox.unwrap_or(WGS84_DEGREES))).map_err(|(reason, detail)| match (bbox, reason) {
        (None, QuarantineReason::OutOfBounds) => (
            reason,
            detail.replace("is outside the source bbox", "is outside longitude -180..180 / latitude -90..90: a layer's coordinates must be WGS84 degrees (GeoJSON's); this one may be in a projected system (feet, metres)"),
        ),
        _ => (reason, detail),
    })
}

/// A coordinate as a quarantine detail shows it: six decimals, or in exponent form past a
/// billion, so that a hostile `1e300` is a short detail, not a 300-digit one.
fn extent_number(v: f64) -> String {
    if v.abs() < 1e9 {
        format!("{v:.6}")
    } else {
        format!("{v:.6e}")
    }
}

/// Finite check, repeated points, bbox, repair, orientation. Returns the clean geometry and
/// whether it needed repair. Validity is checked within [`super::valid::WORK_BUDGET`].
pub fn clean_geometry(mp: MultiPolygon<f64>, bbox: Option<[f64; 4]>) -> Result<(MultiPolygon<f64>, bool), GeomError> {
    clean_geometry_within(mp, bbox, super::valid::WORK_BUDGET)
}

/// [`clean_geometry`] with the validity check's work budget `budget`: `u64::MAX` for a
/// geometry accepted before (a stored AOI), which a budget it was never held to must not
/// make unusable.
pub fn clean_geometry_within(mp: MultiPolygon<f64>, bbox: Option<[f64; 4]>, budget: u64) -> Result<(MultiPolygon<f64>, bool), GeomError> {
    if mp.0.iter().any(|p| {
        std::iter::once(p.exterior()).chain(p.interiors()).any(|r| r.0.iter().any(|c| !c.x.is_finite() || !c.y.is_finite()))
    }) {
        return Err((QuarantineReason::NonFinite, "coordinates are NaN or infinite".into()));
    }
    if let (Some(b), Some(rect)) = (bbox, mp.bounding_rect()) {
        if rect.min().x < b[0] || rect.min().y < b[1] || rect.max().x > b[2] || rect.max().y > b[3] {
            return Err((
                QuarantineReason::OutOfBounds,
                format!(
                    "extent [{}, {}, {}, {}] is outside the source bbox",
                    extent_number(rect.min().x),
                    extent_number(rect.min().y),
                    extent_number(rect.max().x),
                    extent_number(rect.max().y)
                ),
            ));
        }
    }
    let tidy = tidy_rings(mp);
    if tidy.0.is_empty() {
        return Err((QuarantineReason::EmptyGeometry, "no ring with at least 3 distinct points".into()));
    }
    // Put rings in a canonical order first: the repair algorithms depend on where a ring
    // starts and which way it runs, and the same shape must always repair the same way.
    let tidy = crate::detect::canonical::canonical_order(tidy);
    let result = crate::util::catch_geometry_panic(move || -> Result<(MultiPolygon<f64>, bool), GeomError> {
        match super::valid::check_within(&tidy, budget).0 {
            Validity::Valid => Ok((orient_default(tidy), false)),
            Validity::Invalid => {
                repair_cost_within(&tidy, budget)?;
                Ok((repair(&tidy)?, true))
            }
            // Neither checked nor repaired: a repair would cost as much again, and its result
            // could not be checked either.
            Validity::TooComplex => Err((
                QuarantineReason::Unrepairable,
                format!(
                    "too complex to check in bounded time: {} parts with {} vertices, laid out so that checking their validity would take more than about a second of CPU",
                    tidy.0.len(),
                    tidy.0.iter().flat_map(|p| std::iter::once(p.exterior()).chain(p.interiors())).map(|r| r.0.len()).sum::<usize>()
                ),
            )),
        }
    });
    match result {
        Ok(r) => r,
        Err(_) => Err((QuarantineReason::Unrepairable, "geometry algorithm failed on this input".into())),
    }
}

/// How much one repair may cost, in units of about one segment that the overlays of
/// [`repair`] put into their graphs (the share of the validity check's
/// [`super::valid::WORK_BUDGET`] that a repair gets: 1M units, about a second of one core on
/// the machine this is built on). A repair's time and memory grow with the segments and, much
/// faster, with the points where they cross ([`super::valid::Tangle::repair_units`]). Measured
/// on that machine (release build): a ring of 1M segments with one bowtie repaired in 1.7 s;
/// stars whose segments cross one another 4,949 / 19,899 / 79,799 / 499,499 times in 67 ms /
/// 0.25 s / 1.5 s / 20 s (and 300 MB). Real parcels need far less
/// (`real_layers_stay_far_below_the_validity_budget` in `tests/real_data.rs`).
pub const REPAIR_BUDGET: u64 = super::valid::WORK_BUDGET / REPAIR_SHARE;

/// [`super::valid::WORK_BUDGET`] over [`REPAIR_BUDGET`]: a check with an unlimited budget (a
/// stored AOI) has an unlimited repair too.
const REPAIR_SHARE: u64 = 50;

/// Whether repairing `mp` fits the repair's share of the check's `budget`
/// ([`REPAIR_BUDGET`] for a feed's feature): `Err` (`unrepairable`, saying why) for a polygon
/// too large or too tangled to repair in bounded time, so that a hostile ring cannot hold a scan
/// worker (or the control port) for minutes nor take gigabytes. The crossings are counted only
/// when there could be too many: a ring of fewer than ~280 segments cannot have enough. In
/// all, a feature's check, count and repair take at most about three budgets' worth of CPU.
fn repair_cost_within(mp: &MultiPolygon<f64>, budget: u64) -> Result<(), GeomError> {
    use super::valid::{tangle_within, Tangle, TangleStop};
    let allowed = budget / REPAIR_SHARE;
    let segments: u64 = mp.0.iter().map(super::valid::segment_count).sum();
    if segments > allowed {
        return Err((
            QuarantineReason::Unrepairable,
            format!("too large to repair in bounded time: {segments} segments, more than the {allowed} a repair may take (about a second of CPU)"),
        ));
    }
    // Each pair of segments crosses at most once.
    let pairs = segments.saturating_mul(segments.saturating_sub(1)) / 2;
    if (Tangle { segments, crossings: pairs }).repair_units() <= allowed {
        return Ok(());
    }
    match tangle_within(mp, allowed, budget) {
        Ok(_) => Ok(()),
        Err(TangleStop::TooTangled) => Err((
            QuarantineReason::Unrepairable,
            format!(
                "too tangled to repair in bounded time: its {segments} segments cross one another so often that repairing it would take more than about a second of CPU"
            ),
        )),
        Err(TangleStop::OverBudget) => Err((
            QuarantineReason::Unrepairable,
            format!("too complex to repair in bounded time: counting where its {segments} segments meet would take more than about a second of CPU"),
        )),
    }
}

/// Repairs an invalid (multi)polygon. Three candidates: the boolean-overlay union with nothing
/// (keeps the area of a ring that only grazes itself), the union of the parts one with another
/// by their winding (`unary_union`: a part lying inside another part adds to it) and geo's
/// triangulation `MakeValid` (odd-even fill). The valid candidate whose area is closest to the
/// published rings' own area wins, so a tiny self-touch does not cost a parcel a slice of its
/// area, nor a part drawn inside another one (a black-box tester: a 6×6 part inside a 10×10
/// one became a hole, and the parcel lost 36% of its area; both other candidates fill by
/// even-odd there). `repair_cost_within` counts one overlay; with the third candidate (a
/// multipolygon only) a repair may take about half as long again.
fn repair(mp: &MultiPolygon<f64>) -> Result<MultiPolygon<f64>, GeomError> {
    use geo::{Area, BooleanOps};
    let published: f64 = mp
        .0
        .iter()
        .map(|p| Area::unsigned_area(&Polygon::new(p.exterior().clone(), vec![])) - p.interiors().iter().map(|h| Area::unsigned_area(&Polygon::new(h.clone(), vec![]))).sum::<f64>())
        .sum();
    // A candidate that is valid, with the layer's own coordinates put back where that keeps
    // it valid (see `LayerVertices`; the vertices indexed once for both candidates, and a
    // candidate the snap did not move is not checked again).
    let layer = LayerVertices::of(mp);
    let usable = |c: MultiPolygon<f64>| -> Option<MultiPolygon<f64>> {
        let c = tidy_rings(c);
        if c.0.is_empty() || !super::valid::is_valid(&c) {
            return None;
        }
        let mut snapped = c.clone();
        if !layer.snap(&mut snapped) {
            return Some(c);
        }
        let snapped = tidy_rings(snapped);
        Some(if !snapped.0.is_empty() && super::valid::is_valid(&snapped) { snapped } else { c })
    };
    let mut candidates = Vec::new();
    candidates.extend(usable(mp.union(&MultiPolygon::<f64>::new(vec![]))));
    if mp.0.len() > 1 {
        candidates.extend(usable(geo::unary_union(&mp.0)));
    }
    if let Ok(fixed) = mp.make_valid() {
        candidates.extend(usable(fixed));
    }
    // The first candidate, in the order above, whose area is nearest the published one; a
    // later one only when it is nearer by more than a billionth of that area. Candidates of
    // one shape differ in their area's last bits (vertex order; `MakeValid`'s order is not even
    // the same from one call to the next), and a plain nearest flipped between the union's
    // ring and `MakeValid`'s, which keeps the points where the parts met: the same parcel,
    // read again unchanged, was stored and alerted `geometry_changed` run after run (a
    // black-box tester: 8 to 13 of 200 two-part parcels at every read).
    let mut best: Option<(f64, MultiPolygon<f64>)> = None;
    for c in candidates {
        let area = c.unsigned_area();
        if area <= 0.0 {
            continue;
        }
        // Scaled by the larger of the two areas: holes reaching past their ring can make the
        // published area tiny or negative, and its billionth then below the candidates' noise.
        let tie = published.abs().max(area) * 1e-9;
        let off = (area - published).abs();
        if best.as_ref().is_none_or(|(b, _)| off < b - tie) {
            best = Some((off, c));
        }
    }
    let best = best.map(|(_, c)| c);
    match best {
        Some(b) => Ok(orient_default(crate::detect::canonical::canonical_order(b))),
        None => Err((QuarantineReason::Unrepairable, "no repair produced a valid polygon with area".into())),
    }
}

/// The vertices of a layer's (multi)polygon, to put its own coordinates back into a repair's
/// output. The boolean overlay computes on a fixed-point grid, so every vertex it keeps comes
/// back off by a fraction of a grid step (measured on a San José district: all 4,537 vertices
/// moved, by up to 8.2e-11°), and an AOI that touched the parcel at a vertex or along an edge,
/// which the README says gets its changes, no longer met it (a black-box tester).
struct LayerVertices {
    tree: rstar::RTree<[f64; 2]>,
    /// A hundred-millionth of the shape's extent: well above the overlay's grid step, far
    /// below any real distance between two vertices.
    tolerance: f64,
}

impl LayerVertices {
    fn of(layer: &MultiPolygon<f64>) -> Self {
        use geo::BoundingRect;
        let tolerance = layer.bounding_rect().map_or(0.0, |r| r.width().max(r.height()) * 1e-8);
        let points: Vec<[f64; 2]> = layer.0.iter().flat_map(|p| std::iter::once(p.exterior()).chain(p.interiors())).flat_map(|r| r.0.iter().map(|c| [c.x, c.y])).collect();
        LayerVertices { tree: rstar::RTree::bulk_load(points), tolerance }
    }

    /// Puts each vertex of `repaired` within the tolerance of a layer vertex back on it (the
    /// points the repair made, where rings crossed, stay as computed). Returns whether any
    /// moved.
    fn snap(&self, repaired: &mut MultiPolygon<f64>) -> bool {
        let mut moved = false;
        let mut snap = |ring: &mut LineString<f64>| {
            for c in &mut ring.0 {
                if let Some(&[x, y]) = self.tree.nearest_neighbor([c.x, c.y]) {
                    if (x, y) != (c.x, c.y) && (x - c.x).hypot(y - c.y) <= self.tolerance {
                        *c = Coord { x, y };
                        moved = true;
                    }
                }
            }
        };
        for p in &mut repaired.0 {
            p.exterior_mut(&mut snap);
            p.interiors_mut(|holes| holes.iter_mut().for_each(&mut snap));
        }
        moved
    }
}

/// geo's `orient(Direction::Default)` (exteriors counter-clockwise, holes clockwise), in
/// place: the same winding test and reversal, without copying every ring.
fn orient_default(mut mp: MultiPolygon<f64>) -> MultiPolygon<f64> {
    use geo::Winding;
    for p in &mut mp.0 {
        p.exterior_mut(|e| e.make_ccw_winding());
        p.interiors_mut(|holes| {
            for h in holes {
                h.make_cw_winding();
            }
        });
    }
    mp
}

/// Closes rings, removes consecutive repeated points, drops rings with fewer than 3 distinct
/// points and polygons whose exterior is gone. In place.
fn tidy_rings(mp: MultiPolygon<f64>) -> MultiPolygon<f64> {
    fn tidy(mut ring: LineString<f64>) -> Option<LineString<f64>> {
        let pts = &mut ring.0;
        pts.dedup();
        while pts.len() > 1 && pts.first() == pts.last() {
            pts.pop();
        }
        if pts.len() < 3 {
            return None;
        }
        pts.push(pts[0]);
        Some(ring)
    }
    MultiPolygon::new(
        mp.0.into_iter()
            .filter_map(|p| {
                let (exterior, interiors) = p.into_inner();
                let ext = tidy(exterior)?;
                Some(Polygon::new(ext, interiors.into_iter().filter_map(tidy).collect()))
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FieldMap;

    /// Two lots written as one multipolygon whose parts share an edge (invalid: parts may
    /// only touch at points) repair to the same shape at every read, in any thread. The
    /// repair's candidates tie on area but for their last bits, and `MakeValid`'s bits vary
    /// from call to call: a plain nearest flipped between its 8-vertex ring and the union's
    /// 6-vertex one, about one read in three (a black-box tester: the same parcels alerted
    /// `geometry_changed` at every unchanged read).
    #[test]
    fn a_two_part_parcel_whose_parts_share_an_edge_repairs_the_same_way_every_time() {
        use geo::polygon;
        let a = polygon![(x: -93.2691461, y: 44.95), (x: -93.2684863, y: 44.95), (x: -93.2684863, y: 44.9503144), (x: -93.2691461, y: 44.9503144), (x: -93.2691461, y: 44.95)];
        let b = polygon![(x: -93.2684863, y: 44.95), (x: -93.2679977, y: 44.95), (x: -93.2679977, y: 44.9501572), (x: -93.2680167, y: 44.9503144), (x: -93.2684863, y: 44.9503144), (x: -93.2684863, y: 44.95)];
        let mp = MultiPolygon::new(vec![a, b]);
        let (first, repaired) = clean_geometry(mp.clone(), None).unwrap();
        assert!(repaired);
        assert_eq!((first.0.len(), first.0[0].exterior().0.len()), (1, 6), "one lot, the shared edge's ends dropped: {first:?}");
        let reads: Vec<_> = (0..2).map(|_| {
            let mp = mp.clone();
            std::thread::spawn(move || (0..200).map(|_| clean_geometry(mp.clone(), None).unwrap().0).collect::<Vec<_>>())
        }).collect();
        for r in reads {
            assert!(r.join().unwrap().iter().all(|g| *g == first), "a read repaired it otherwise");
        }
    }

    fn rules(fields: &FieldMap) -> NormalizeRules<'_> {
        NormalizeRules { fields, bbox: Some([-1.0, -1.0, 20.0, 20.0]) }
    }
    fn fields() -> FieldMap {
        FieldMap { parcel_id: "APN".into(), zoning: "ZONE".into(), effective_date: None }
    }
    fn raw(s: &str) -> &str {
        s
    }

    #[test]
    fn a_feature_without_an_id_says_where_it_lies_when_it_can() {
        let f = fields();
        let square = r#""geometry":{"type":"Polygon","coordinates":[[[1,2],[3,2],[3,5],[1,5],[1,2]]]}"#;
        let no_id = normalize_feature(&format!(r#"{{"properties":{{"ZONE":"R"}},{square}}}"#), &rules(&f)).unwrap_err();
        assert_eq!((no_id.parcel_id, no_id.reason, no_id.footprint), (None, QuarantineReason::MissingField, Some(([1.0, 2.0], [3.0, 5.0]))));
        // Properties that cannot be read: no id either, still placed.
        let bad_props = normalize_feature(&format!(r#"{{"properties":[1],{square}}}"#), &rules(&f)).unwrap_err();
        assert_eq!((bad_props.reason, bad_props.footprint.is_some()), (QuarantineReason::MalformedFeature, true));
        // No geometry, or one that cannot be read: not placed.
        let bare = normalize_feature(r#"{"properties":{"ZONE":"R"},"geometry":null}"#, &rules(&f)).unwrap_err();
        assert_eq!(bare.footprint, None);
        let broken = normalize_feature(r#"{"properties":{"ZONE":"R"},"geometry":{"type":"Polygon","coordinates":"x"}}"#, &rules(&f)).unwrap_err();
        assert_eq!(broken.footprint, None);
        // A feature with an id carries none (its parcel is kept by id).
        let with_id = normalize_feature(r#"{"properties":{"APN":"a"},"geometry":null}"#, &rules(&f)).unwrap_err();
        assert_eq!((with_id.parcel_id.as_deref(), with_id.footprint), (Some("a"), None));
    }

    /// A ring that encloses no area (its points on one line, as in 128 rings of Chicago's
    /// 2024 layer) has no orientation to put it in: the same ring written the other way
    /// round is the same parcel (a black-box tester: Koop's Esri rings reversed four such
    /// rings, and each was announced as `geometry_changed`).
    #[test]
    fn a_ring_with_no_area_hashes_the_same_either_way_round() {
        let f = fields();
        let square = "[[1,1],[2,1],[2,2],[1,2],[1,1]]";
        let flat = ["[[3.19,5.25],[3.67,5.25],[3.1,5.25],[3.19,5.25]]", "[[3.19,5.25],[3.1,5.25],[3.67,5.25],[3.19,5.25]]"];
        let hash = |geometry: String| {
            let feature = format!(r#"{{"properties":{{"APN":"a","ZONE":"R"}},"geometry":{geometry}}}"#);
            normalize_feature(&feature, &rules(&f)).map(|n| n.parcel.state.geom_hash).map_err(|e| e.detail)
        };
        // Alone, as a part beside a square, as a hole of it.
        for shape in [r#"{"type":"Polygon","coordinates":[RING]}"#.to_string(), format!(r#"{{"type":"MultiPolygon","coordinates":[[{square}],[RING]]}}"#), format!(r#"{{"type":"Polygon","coordinates":[{square},RING]}}"#)] {
            let (a, b) = (hash(shape.replace("RING", flat[0])), hash(shape.replace("RING", flat[1])));
            assert_eq!(a, b, "{shape}");
        }
    }

    /// A part drawn inside another part of the same parcel adds to it, as its winding says:
    /// the parcel keeps the outer part's area, not the outer minus the inner.
    #[test]
    fn a_part_inside_another_part_is_not_made_a_hole() {
        let f = fields();
        let r = normalize_feature(
            r#"{"properties":{"APN":"n","ZONE":"R"},"geometry":{"type":"MultiPolygon","coordinates":[[[[0,0],[10,0],[10,10],[0,10],[0,0]]],[[[2,2],[8,2],[8,8],[2,8],[2,2]]]]}}"#,
            &rules(&f),
        )
        .unwrap();
        assert!(r.repaired);
        let g = r.parcel.geometry.to_geo();
        assert_eq!((g.0.len(), g.0[0].interiors().len()), (1, 0), "{g:?}");
        assert!((geo::Area::unsigned_area(&g) - 100.0).abs() < 1e-9, "{g:?}");
    }

    #[test]
    fn bowtie_is_repaired_into_polygonal_parts() {
        let f = fields();
        let r = normalize_feature(
            raw(r#"{"type":"Feature","properties":{"APN":" 7 ","ZONE":"R-1"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[0,10],[10,0],[10,10],[0,0]]]}}"#),
            &rules(&f),
        )
        .unwrap();
        assert!(r.repaired);
        assert_eq!(r.parcel.id, "7");
        assert_eq!(r.parcel.geometry.0.len(), 2);
        assert!(geo::Validation::is_valid(&r.parcel.geometry.to_geo()));
    }

    /// A repaired parcel keeps the layer's own coordinates (a black-box tester: the overlay's
    /// fixed-point grid moved every vertex of a San José district by up to 8.2e-11°, and an AOI
    /// that touched it at a vertex or along an edge, which the README says gets its changes,
    /// did not). Two overlapping parts are repaired by the overlay (the even-odd parts, closest
    /// to the published area): each corner it keeps is the layer's, exactly; the points where
    /// the parts' edges cross are new.
    #[test]
    fn a_repaired_parcel_keeps_the_layers_own_coordinates() {
        use geo::Intersects;
        let square = |x: f64, y: f64, w: f64| vec![[x, y], [x + w, y], [x + w, y + w], [x, y + w], [x, y]];
        let (a, b) = (square(-121.857709, 37.42129, 0.031), square(-121.840123, 37.43317, 0.027));
        let corners: Vec<[f64; 2]> = a.iter().chain(&b).copied().collect();
        let mp = MultiPolygon::new(vec![Polygon::new(LineString::from(a), vec![]), Polygon::new(LineString::from(b), vec![])]);
        let (repaired, was_repaired) = clean_geometry(mp, None).unwrap();
        assert!(was_repaired);
        let (mut kept, mut made) = (0, 0);
        for c in repaired.0.iter().flat_map(|p| &p.exterior().0[1..]) {
            let nearest = corners.iter().map(|k| (k[0] - c.x).hypot(k[1] - c.y)).fold(f64::MAX, f64::min);
            if nearest < 1e-7 {
                assert_eq!(nearest, 0.0, "{c:?} is {nearest:e}° off the layer's corner");
                kept += 1;
            } else {
                made += 1;
            }
        }
        assert!(kept >= 6 && made >= 2, "{kept} corners kept, {made} points made");
        // An AOI that touches the parcel only at its outer corner gets it, and so does one
        // along its edge.
        let corner = [-121.840123 + 0.027, 37.43317 + 0.027];
        let at_corner = Polygon::new(LineString::from(vec![corner, [corner[0] + 0.001, corner[1]], [corner[0] + 0.001, corner[1] + 0.001], corner]), vec![]);
        assert!(repaired.intersects(&at_corner));
        let along = Polygon::new(LineString::from(vec![[-121.857709, 37.42129], [-121.857709 + 0.01, 37.42129], [-121.857709 + 0.01, 37.42129 - 0.001], [-121.857709, 37.42129]]), vec![]);
        assert!(repaired.intersects(&along));
    }

    /// A star ring of `n` points visiting every `k`-th point of a small circle in Cambridge.
    fn star(n: usize, k: usize) -> MultiPolygon<f64> {
        let pts: Vec<Coord<f64>> = (0..=n)
            .map(|i| {
                let a = ((i * k) % n) as f64 / n as f64 * std::f64::consts::TAU;
                Coord { x: -71.1 + 0.001 * a.cos(), y: 42.37 + 0.001 * a.sin() }
            })
            .collect();
        MultiPolygon::new(vec![Polygon::new(LineString::new(pts), vec![])])
    }

    /// A repair's cost grows with the crossings of what it repairs (a star of 401 points,
    /// 79,799 crossings, took 1.5 s; one of 1,001 points 20 s and 300 MB): past the repair's
    /// budget a polygon is quarantined as unrepairable with the reason, before any overlay runs.
    #[test]
    fn a_polygon_too_tangled_to_repair_in_bounded_time_is_quarantined_unrepaired() {
        use super::super::valid::{is_valid, tangle_within};
        let tangled = "too tangled to repair in bounded time: its 401 segments cross one another so often";
        for (n, k) in [(401, 200), (1_001, 500)] {
            let (reason, detail) = clean_geometry(star(n, k), None).unwrap_err();
            assert_eq!(reason, QuarantineReason::Unrepairable);
            assert!(detail.starts_with(&tangled.replace("401", &n.to_string())), "{detail}");
        }
        // Few crossings in a long ring (counted: it has too many segments to skip the count) and
        // many in a short one (too few segments to need counting) are repaired.
        let mut circle = star(1_000, 1);
        circle.0[0].exterior_mut(|r| r.0.swap(1, 2));
        assert_eq!(tangle_within(&circle, u64::MAX, u64::MAX).map(|t| t.crossings), Ok(1));
        let (fixed, repaired) = clean_geometry(circle, None).unwrap();
        assert!(repaired && is_valid(&fixed));
        let (fixed, repaired) = clean_geometry(star(31, 15), None).unwrap();
        assert!(repaired && is_valid(&fixed));
        // A budget: too many segments are refused without counting; an unlimited one lets the
        // repair run (its bound fits without counting).
        let (reason, detail) = repair_cost_within(&star(401, 200), 100 * REPAIR_SHARE).unwrap_err();
        assert_eq!(reason, QuarantineReason::Unrepairable);
        assert!(detail.starts_with("too large to repair in bounded time: 401 segments, more than the 100 a repair may take"), "{detail}");
        assert!(repair_cost_within(&star(401, 200), u64::MAX).is_ok());
    }

    /// One number, one id: a whole number written as a float or with an exponent reads as
    /// the integer; other numbers keep their JSON form.
    #[test]
    fn numeric_ids_and_codes_read_the_same_however_written() {
        let f = fields();
        let id_of = |apn: &str, zone: &str| {
            let text = format!(r#"{{"type":"Feature","properties":{{"APN":{apn},"ZONE":{zone}}},"geometry":{{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}}}"#);
            let p = normalize_feature(&text, &rules(&f)).unwrap().parcel;
            (p.id, p.state.zoning)
        };
        for apn in ["100010", "100010.0", "1.0001e5", "100010.000", "1000100e-1"] {
            assert_eq!(id_of(apn, "3.0"), ("100010".to_string(), "3".to_string()), "{apn}");
        }
        assert_eq!(id_of("12.5", "-0.0").0, "12.5");
        assert_eq!(id_of("12345678901234567890", "1").0, "12345678901234567890");
        assert_eq!(id_of("1e300", "1").0, "1e+300", "beyond 2^53: as serde_json writes the double");
        // An integer past 2^64 keeps every digit (two such codes must not read the same); a
        // number out of a float's range is kept as written, not taken for a missing field.
        assert_eq!(id_of("1", "123456789012345678901234567890").1, "123456789012345678901234567890");
        assert_ne!(id_of("123456789012345678901234567890", "1").0, id_of("123456789012345678901234567891", "1").0);
        assert_eq!(id_of("-98765432109876543210987", "1").0, "-98765432109876543210987");
        assert_eq!(id_of("1", "1e400").1, "1e400");
    }

    #[test]
    fn parcel_area_agrees_with_the_geodesic_area() {
        use geo::{polygon, GeodesicArea};
        for (lon, lat, w, h) in [(-93.3, 44.95, 0.0004, 0.0003), (-121.9, 37.3, 0.01, 0.02), (10.0, 60.0, 0.001, 0.0005), (-71.1, 42.37, 0.04, 0.04)] {
            let mp = MultiPolygon(vec![polygon![(x: lon, y: lat), (x: lon + w, y: lat), (x: lon + w, y: lat + h), (x: lon + w / 3.0, y: lat + h * 1.2), (x: lon, y: lat)]]);
            let fast = parcel_area_m2(&mp);
            let exact = mp.geodesic_area_unsigned();
            assert!(((fast - exact) / exact).abs() < 1e-5, "{fast} vs {exact}");
        }
    }

    #[test]
    fn coordinate_shapes_parse_or_fail_with_their_reason() {
        let geom = |coords: &str| parse_geometry(&format!(r#"{{"type":"Polygon","coordinates":{coords}}}"#));
        let multi = |coords: &str| parse_geometry(&format!(r#"{{"type":"MultiPolygon","coordinates":{coords}}}"#));
        let square = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]];
        // Accepted: 2D, 3D and 4D positions (extra numbers ignored), a ring with a hole, an
        // extra element of any JSON array shape after x and y, and null read as NaN.
        for ok in [
            "[[[0,0],[1,0],[1,1],[0,0]]]",
            "[[[0,0,5],[1,0,5],[1,1,5],[0,0,5]]]",
            "[[[0,0,5,7],[1,0,5,7],[1,1,5,7],[0,0,5,7]]]",
            "[[[0,0,[9]],[1,0],[1,1],[0,0]]]",
            "[[[0,0],[1,0],[1,1],[0,0]],[[0.2,0.2],[0.4,0.2],[0.4,0.4],[0.2,0.2]]]",
        ] {
            let mp = geom(ok).unwrap_or_else(|e| panic!("{ok}: {e:?}"));
            let ext: Vec<[f64; 2]> = mp.0[0].exterior().0.iter().map(|c| [c.x, c.y]).collect();
            assert_eq!(ext, square, "{ok}");
        }
        assert!(geom("[[[0,null],[1,0],[1,1],[0,0]]]").unwrap().0[0].exterior().0[0].y.is_nan());
        assert_eq!(multi("[[[[0,0],[1,0],[1,1],[0,0]]],[[[5,5],[6,5],[6,6],[5,5]]]]").unwrap().0.len(), 2);
        assert_eq!(multi("[]").unwrap_err().0, QuarantineReason::EmptyGeometry);
        assert_eq!(geom("[]").unwrap_err(), (QuarantineReason::EmptyGeometry, "Polygon has no polygons".to_string()));
        assert_eq!(geom("[[]]").unwrap_err().0, QuarantineReason::EmptyGeometry);
        // Rejected, each with the message it always had.
        let malformed = |m: &str| Err::<MultiPolygon<f64>, _>((QuarantineReason::MalformedFeature, m.to_string()));
        assert_eq!(geom("5"), malformed("Polygon coordinates must be an array of rings"));
        assert_eq!(geom("[1,2]"), malformed("a ring must be an array of positions"));
        assert_eq!(geom("[[1,2],[3,4]]"), malformed("a position must be an array of numbers"));
        assert_eq!(geom("[[[0,0],[1,0],5,[0,0]]]"), malformed("a position must be an array of numbers"));
        assert_eq!(geom("[[[0,0],[1,0],[1,1],[0,0]],[1,2]]"), malformed("a position must be an array of numbers"));
        assert_eq!(geom("[[[0],[1,0],[1,1],[0]]]"), malformed("a position needs two numbers"));
        assert_eq!(geom("[[[0,0],[1,[0]],[1,1],[0,0]]]"), malformed("a position needs two numbers"));
        assert_eq!(geom("[[[[0,0]],[1,0],[1,1],[0,0]]]"), malformed("a position needs two numbers"));
        assert_eq!(multi("5"), malformed("MultiPolygon coordinates must be an array"));
        assert_eq!(multi("[[1,2]]"), malformed("a ring must be an array of positions"));
        let e = geom(r#"[[["a",0],[1,0],[1,1],[0,0]]]"#).unwrap_err();
        assert!(e.0 == QuarantineReason::MalformedFeature && e.1.starts_with("geometry: "), "{e:?}");
        let e = geom(r#"[[[0,0,"z"],[1,0],[1,1],[0,0]]]"#).unwrap_err();
        assert!(e.0 == QuarantineReason::MalformedFeature && e.1.starts_with("geometry: "), "{e:?}");
    }

    #[test]
    fn a_malformed_geometry_is_rejected_with_its_parcel_id_and_the_parse_error() {
        let f = fields();
        // The parcel is named, and the geometry's parse error or shape problem given.
        for (geometry, detail) in [
            (r#"{"type":"Polygon","coordinates":"x"}"#, "geometry: "),
            (r#"{"coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}"#, "geometry: missing field `type`"),
            (r#"{"type":"Polygon","coordinates":[[[0,0],["a",0],[1,1],[0,0]]]}"#, "geometry: "),
            (r#"{"type":"Polygon","coordinates":[[1,2]]}"#, "a position must be an array of numbers"),
        ] {
            let json = format!(r#"{{"type":"Feature","properties":{{"APN":"7","ZONE":"R-1"}},"geometry":{geometry}}}"#);
            let err = normalize_feature(&json, &rules(&f)).unwrap_err();
            assert_eq!((err.reason, err.parcel_id.as_deref()), (QuarantineReason::MalformedFeature, Some("7")), "{json}");
            assert!(err.detail.starts_with(detail), "{json}: {}", err.detail);
        }
        // Escaped and padded attribute values read as before.
        let json = r#"{"properties":{"APN":" 7\u0041 ","ZONE":"R\"1","EFF":2.50},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}"#;
        let fields = FieldMap { effective_date: Some("EFF".into()), ..fields() };
        let n = normalize_feature(json, &rules(&fields)).unwrap();
        assert_eq!((n.parcel.id.as_str(), n.parcel.state.zoning.as_str(), n.parcel.state.effective_date.as_deref()), ("7A", "R\"1", Some("2.5")));
    }

    #[test]
    fn bad_features_get_reasons() {
        let f = fields();
        let cases = [
            (r#"{"properties":{"ZONE":"R"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}}"#, QuarantineReason::MissingField),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[null,0],[1,1],[0,0]]]}}"#, QuarantineReason::NonFinite),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":null}"#, QuarantineReason::EmptyGeometry),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Point","coordinates":[0,0]}}"#, QuarantineReason::NotPolygonal),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Polygon","coordinates":[[[50,50],[51,50],[51,51],[50,50]]]}}"#, QuarantineReason::OutOfBounds),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Polygon","coordinates":"x"}}"#, QuarantineReason::MalformedFeature),
            (r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1,1],[0,0]]]}}"#, QuarantineReason::EmptyGeometry),
            (r#"[1]"#, QuarantineReason::MalformedFeature),
        ];
        for (json, want) in cases {
            let err = normalize_feature(raw(json), &rules(&f)).unwrap_err();
            assert_eq!(err.reason, want, "{json}: {}", err.detail);
        }
        // A value past the cap: an id is refused with the feature's place (taken without an
        // id), a zoning code or date under its id (its parcel keeps its stored state); a value
        // at the cap is read as it is.
        let geometry = r#""geometry":{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}"#;
        let at_cap = "9".repeat(MAX_FIELD_BYTES);
        let over = "9".repeat(MAX_FIELD_BYTES + 1);
        let feature = |apn: &str, zone: &str, eff: &str| format!(r#"{{"properties":{{"APN":"{apn}","ZONE":"{zone}","EFF":"{eff}"}},{geometry}}}"#);
        let dated = FieldMap { effective_date: Some("EFF".into()), ..fields() };
        let n = normalize_feature(raw(&feature(&at_cap, &at_cap, &at_cap)), &rules(&dated)).unwrap();
        assert_eq!((n.parcel.id.len(), n.parcel.state.zoning.len()), (MAX_FIELD_BYTES, MAX_FIELD_BYTES));
        let err = normalize_feature(raw(&feature(&over, "R", "")), &rules(&dated)).unwrap_err();
        assert_eq!((err.reason, err.parcel_id, err.footprint), (QuarantineReason::FieldTooLong, None, Some(([0.0, 0.0], [1.0, 1.0]))));
        assert!(err.detail.starts_with("APN is 1025 bytes (it begins \"9999") && err.detail.len() < 200, "{}", err.detail);
        for (zone, eff, field) in [(over.as_str(), "2020", "ZONE"), ("R", over.as_str(), "EFF")] {
            let err = normalize_feature(raw(&feature("7", zone, eff)), &rules(&dated)).unwrap_err();
            assert_eq!((err.reason, err.parcel_id.as_deref()), (QuarantineReason::FieldTooLong, Some("7")), "{field}");
            assert!(err.detail.starts_with(&format!("{field} is 1025 bytes")), "{}", err.detail);
        }
        // A number past the cap is refused as written, not read as a float of 17 digits.
        let long_float = format!(r#"{{"properties":{{"APN":"7","ZONE":1.{}e5}},{geometry}}}"#, "2".repeat(MAX_FIELD_BYTES));
        let err = normalize_feature(raw(&long_float), &rules(&f)).unwrap_err();
        assert_eq!((err.reason, err.parcel_id.as_deref()), (QuarantineReason::FieldTooLong, Some("7")), "{}", err.detail);
        // A string is measured as it reads: 600 escaped slashes are 1,200 bytes written and
        // 600 read. A date that is an array, however long, is no date (as it always was).
        let escaped = format!(r#"{{"properties":{{"APN":"7","ZONE":"{}","EFF":[{}0]}},{geometry}}}"#, "\\/".repeat(600), "0,".repeat(MAX_FIELD_BYTES));
        let n = normalize_feature(raw(&escaped), &rules(&dated)).unwrap();
        assert_eq!((n.parcel.state.zoning, n.parcel.state.effective_date), ("/".repeat(600), None));
        // A hostile coordinate makes a short detail (the extent in exponent form), not one of
        // 300 digits kept in the ledger for ever.
        let json = r#"{"properties":{"APN":"1","ZONE":"R"},"geometry":{"type":"Polygon","coordinates":[[[0,0],[1e300,0],[1,1],[0,0]]]}}"#;
        let err = normalize_feature(raw(json), &rules(&f)).unwrap_err();
        assert_eq!(err.reason, QuarantineReason::OutOfBounds);
        assert!(err.detail.starts_with("extent [0.000000, 0.000000, 1.000000e300, 1.000000] is outside"), "{}", err.detail);
        assert!(err.detail.len() < 400, "{}", err.detail);
    }
}
