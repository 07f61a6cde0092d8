//! ArcGIS FeatureServer / MapServer layers. Exists because ArcGIS is the most common county
//! portal and the least honest about completeness:
//!
//! * the layer metadata (`?f=json`) is the cheap probe: `editingInfo.dataLastEditDate` is the
//!   publisher timestamp and a hash of `fields[]` detects schema edits;
//! * the scan pages `query` with `resultOffset`/`resultRecordCount`, ordered by the object-id
//!   field, **while `exceededTransferLimit` is true** (top level or under `properties`); when
//!   the flag is absent the scan is complete only when the collected features equal the
//!   `returnCountOnly` count, and a full page is never the last (a count that is too low
//!   must not end the scan early); an empty page always ends the scan (never loops forever);
//! * the count is taken before and after the scan; if it moved the layer is scanned again;
//! * one scan's pages together are capped by `[ingest] max_layer_bytes`
//!   ([`super::scan_guard::LayerBytes`]); its features are collected on disk, deduplicated
//!   by object id ([`super::collect`]), or by content on a layer without object ids (views,
//!   joined MapServer layers: [`super::scan_guard::PageRows`]), so pages that overlap
//!   leave the scan short of the count — an incomplete scan, never parcels skipped;
//! * errors arrive as HTTP 200 with `{"error":{"code":…}}`: `code >= 500` is retried with half
//!   the page size, 498/499 is an authentication error, anything else is permanent;
//! * `format = "geojson"` pages with `f=geojson` instead (servers that support it, e.g. Koop):
//!   many servers omit `exceededTransferLimit` from GeoJSON output, so a short page proves
//!   nothing and the scan ends when the distinct features equal the `returnCountOnly` count
//!   (asked with `f=json`), at an empty page, or when a page brings nothing new (a server
//!   ignoring `resultOffset`) — and is then checked against the count like any scan;
//! * Esri JSON rings are converted to GeoJSON (outer rings clockwise, holes counter-clockwise)
//!   and the object-id attribute is dropped: OBJECTIDs are reassigned on republish, so they are
//!   never a key and never part of the digest. The configured id field is the key.

use super::http::{FetchError, Session};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use super::collect::FeatureSpool;

/// Which `f=` the query pages are asked in (source key `format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ArcgisFormat {
    /// Esri JSON (`f=json`), rings converted here. The default: every server supports it.
    #[default]
    Json,
    /// GeoJSON (`f=geojson`) where the server supports it.
    Geojson,
}

impl ArcgisFormat {
    /// `"json"` / `"geojson"` as written in the config.
    pub fn parse(s: &str) -> Option<ArcgisFormat> {
        match s.trim().to_ascii_lowercase().as_str() {
            "json" => Some(ArcgisFormat::Json),
            "geojson" => Some(ArcgisFormat::Geojson),
            _ => None,
        }
    }

    /// The `f=` value.
    pub fn as_str(self) -> &'static str {
        match self {
            ArcgisFormat::Json => "json",
            ArcgisFormat::Geojson => "geojson",
        }
    }
}

/// What the layer metadata says.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerProbe {
    /// `editingInfo.dataLastEditDate` (epoch ms), when the server reports it.
    pub publisher_ts_ms: Option<u64>,
    /// Hex sha256 (16 chars) of the fields' names and types.
    pub schema_hash: String,
    pub object_id_field: Option<String>,
    pub max_record_count: Option<u32>,
    pub field_names: Vec<String>,
}

/// One complete scan of a layer.
#[derive(Debug)]
pub struct Scan {
    /// The layer's features, to be written as a GeoJSON FeatureCollection sorted by the
    /// configured id field.
    pub layer: FeatureSpool,
    pub features: usize,
    pub pages: u32,
    pub scans: u32,
}

/// Checks an ArcGIS JSON body for the `{"error":…}` form that comes with HTTP 200.
pub fn check_error(url: &str, v: &Value) -> Result<(), FetchError> {
    let Some(err) = v.get("error") else { return Ok(()) };
    let code = err.get("code").and_then(Value::as_i64).unwrap_or(500);
    let mut message = err.get("message").and_then(Value::as_str).unwrap_or("").to_string();
    if let Some(details) = err.get("details").and_then(Value::as_array) {
        let d: Vec<&str> = details.iter().filter_map(Value::as_str).collect();
        if !d.is_empty() {
            message.push_str(&format!(" ({})", d.join("; ")));
        }
    }
    Err(match code {
        498 | 499 => FetchError::Auth { url: url.to_string(), code, message },
        _ => FetchError::Arcgis { url: url.to_string(), code, message },
    })
}

fn retryable_arcgis(e: &FetchError) -> bool {
    matches!(e, FetchError::Arcgis { code, .. } if *code >= 500)
}

/// GET + JSON + ArcGIS error check, keeping the answer's members named in `keep` (and
/// `error`); ArcGIS errors with `code >= 500` are retried within the session's attempts and
/// budget.
async fn get_json(session: &Session, url: &str, keep: &[&str]) -> Result<Value, FetchError> {
    let keep: Vec<&str> = keep.iter().copied().chain(["error"]).collect();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let v = session.get(url, &[]).await?.members(&keep)?;
        match check_error(url, &v) {
            Ok(()) => return Ok(v),
            Err(e) if retryable_arcgis(&e) => session.pause_before_retry(url, attempt, &e.to_string(), None).await?,
            Err(e) => return Err(e),
        }
    }
}

/// Reads the layer metadata and checks the configured id field exists and is not the
/// object-id field.
pub async fn probe(session: &Session, layer_url: &str, id_field: &str) -> Result<LayerProbe, FetchError> {
    let url = format!("{layer_url}?f=json");
    let v = get_json(session, &url, &["fields", "objectIdField", "editingInfo", "maxRecordCount"]).await?;
    let fields = v.get("fields").and_then(Value::as_array).ok_or_else(|| FetchError::Protocol {
        url: url.clone(),
        reason: "layer metadata has no fields[] (is this a layer URL ending in the layer number?)".into(),
    })?;
    let mut h = Sha256::new();
    let mut names = Vec::new();
    let mut oid_by_type = None;
    for f in fields {
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let ty = f.get("type").and_then(Value::as_str).unwrap_or("");
        h.update(name.as_bytes());
        h.update([0]);
        h.update(ty.as_bytes());
        h.update([0]);
        if ty == "esriFieldTypeOID" {
            oid_by_type = Some(name.to_string());
        }
        names.push(name.to_string());
    }
    let object_id_field = v.get("objectIdField").and_then(Value::as_str).map(str::to_string).or(oid_by_type);
    let publisher_ts_ms = v
        .get("editingInfo")
        .and_then(|e| e.get("dataLastEditDate").or_else(|| e.get("lastEditDate")))
        .and_then(Value::as_u64);
    if object_id_field.as_deref().is_some_and(|o| o.eq_ignore_ascii_case(id_field)) {
        return Err(FetchError::Protocol {
            url,
            reason: format!("fields.parcel_id = {id_field:?} is the layer's object-id field; OBJECTIDs are reassigned on republish, configure a stable id field"),
        });
    }
    // Any case, as features' attributes are read (`prop_text_folding`).
    if !names.iter().any(|n| n.eq_ignore_ascii_case(id_field)) {
        return Err(FetchError::Protocol { url, reason: format!("the layer has no field {id_field:?} (fields.parcel_id); it has {names:?}") });
    }
    Ok(LayerProbe {
        publisher_ts_ms,
        schema_hash: crate::util::hex(&h.finalize()[..8]),
        object_id_field,
        max_record_count: v.get("maxRecordCount").and_then(Value::as_u64).map(|n| n.clamp(1, u32::MAX as u64) as u32),
        field_names: names,
    })
}

/// The zoning and effective-date fields, checked against the layer's `fields[]` as the id
/// field is by [`probe`] (any case, as features' attributes are read): a wrong name read every
/// feature as missing it, and the run was held as a quarantine spike of the whole layer (a
/// black-box tester), where a wrong id field failed at once naming the layer's fields.
pub fn check_attribute_fields(probe: &LayerProbe, layer_url: &str, fields: &crate::config::FieldMap) -> Result<(), FetchError> {
    let named = [("fields.zoning", Some(fields.zoning.as_str())), ("fields.effective_date", fields.effective_date.as_deref())];
    for (key, name) in named {
        let Some(name) = name.filter(|n| !n.trim().is_empty()) else { continue };
        if !probe.field_names.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return Err(FetchError::Protocol {
                url: format!("{layer_url}?f=json"),
                reason: format!("the layer has no field {name:?} ({key}); it has {:?}", probe.field_names),
            });
        }
    }
    Ok(())
}

/// `returnCountOnly` of the whole layer.
pub async fn count(session: &Session, layer_url: &str) -> Result<u64, FetchError> {
    let url = format!("{layer_url}/query?where=1%3D1&returnCountOnly=true&f=json");
    let v = get_json(session, &url, &["count"]).await?;
    match super::page::whole_count(v.get("count")) {
        Ok(Some(n)) => Ok(n),
        Ok(None) => Err(FetchError::Protocol { url, reason: "returnCountOnly answer has no count".into() }),
        Err(found) => Err(FetchError::Protocol { url, reason: format!("returnCountOnly answer's count is {found}, not a count of features") }),
    }
}

fn exceeded(v: &Value) -> Option<bool> {
    v.get("exceededTransferLimit")
        .or_else(|| v.get("properties").and_then(|p| p.get("exceededTransferLimit")))
        .and_then(Value::as_bool)
}

/// Scans the whole layer in Esri JSON (see the module doc) into a FeatureCollection.
pub async fn scan(session: &Session, layer_url: &str, probe: &LayerProbe, page_size: u32, id_field: &str) -> Result<Scan, FetchError> {
    scan_as(session, layer_url, probe, page_size, id_field, ArcgisFormat::Json).await
}

/// A query page's feature's object id as a dedup key, if it has one.
fn page_feature_key(format: ArcgisFormat, f: &Value, oid_field: Option<&str>) -> Option<String> {
    let found = match format {
        ArcgisFormat::Json => oid_field.and_then(|o| f.get("attributes")?.get(o)),
        ArcgisFormat::Geojson => f.get("id").filter(|v| !v.is_null()).or_else(|| oid_field.and_then(|o| f.get("properties")?.get(o))),
    };
    found.filter(|v| !v.is_null()).map(Value::to_string)
}

/// One query page's feature as a GeoJSON feature without the object id.
fn page_feature(format: ArcgisFormat, mut f: Value, oid_field: Option<&str>) -> Value {
    let mut take = |member: &str| f.get_mut(member).map(Value::take).unwrap_or(Value::Null);
    match format {
        ArcgisFormat::Json => {
            let attrs = match take("attributes") {
                Value::Object(attrs) => attrs,
                _ => Map::new(),
            };
            let geometry = take("geometry");
            esri_feature_to_geojson(attrs, (!geometry.is_null()).then_some(&geometry), oid_field)
        }
        ArcgisFormat::Geojson => {
            let mut props = match take("properties") {
                Value::Object(props) => props,
                _ => Map::new(),
            };
            if let Some(o) = oid_field {
                props.remove(o);
            }
            json!({"type": "Feature", "properties": Value::Object(props), "geometry": take("geometry")})
        }
    }
}

/// A GeoJSON page's `crs`, when it names anything but WGS 84 lon/lat (read as a GeoJSON
/// layer's is: [`super::geojson::crs_name`]).
fn foreign_crs(v: &Value) -> Option<String> {
    let name = super::geojson::crs_name(v.get("crs")?)?;
    (!super::geojson::crs_is_wgs84(&name)).then_some(name)
}

/// Scans the whole layer (see the module doc) in `format` into a FeatureCollection.
pub async fn scan_as(session: &Session, layer_url: &str, probe: &LayerProbe, page_size: u32, id_field: &str, format: ArcgisFormat) -> Result<Scan, FetchError> {
    let mut expected = count(session, layer_url).await?;
    let mut page_cap = probe.max_record_count.unwrap_or(page_size).min(page_size).max(1);
    // Set once the scan has been tried again with other page boundaries.
    let mut shifted = false;
    let mut order = probe.object_id_field.clone().unwrap_or_else(|| id_field.to_string());
    let mut pages = 0;
    // The layer's edit date as last read (the probe's, then each re-read's).
    let mut edited_ms = probe.publisher_ts_ms;
    for scan_no in 1..=4u32 {
        let mut collected = FeatureSpool::new(&session.spool_dir)?;
        let mut content_seen = super::scan_guard::SeenRows::new();
        let mut duplicates = 0u64;
        let mut offset: u64 = 0;
        let mut page = page_cap;
        let mut failures = 0;
        let mut scan_pages = 0u64;
        let mut layer_bytes = super::scan_guard::LayerBytes::new(session.cfg.max_layer_bytes);
        loop {
            let url = format!(
                "{layer_url}/query?where=1%3D1&outFields=*&outSR=4326&returnGeometry=true&f={}&orderByFields={}&resultOffset={offset}&resultRecordCount={page}",
                format.as_str(),
                urlencode(&order)
            );
            pages += 1;
            scan_pages += 1;
            if scan_pages > expected.max(collected.len() as u64).saturating_mul(2).saturating_add(10) {
                return Err(FetchError::Protocol { url, reason: format!("{scan_pages} pages without reaching the end of a {expected}-feature layer; giving up") });
            }
            let resp = session.get(&url, &[]).await?;
            layer_bytes.add(&url, resp.size())?;
            // Each feature is taken as it is parsed (the page is never one tree): known by
            // its object id when it has one, otherwise by its content (`SeenRows`). A page
            // served twice or pages that overlap repeat features, which are not taken again
            // and are counted, so the count check below sees the scan as incomplete.
            let oid_field = probe.object_id_field.as_deref();
            let (mut n, mut fresh) = (0u64, 0u64);
            let mut by_content = content_seen.on_page();
            let answer = resp.features(&["error", "exceededTransferLimit", "properties", "spatialReference", "crs"], |f| {
                n += 1;
                let taken = match page_feature_key(format, &f, oid_field) {
                    Some(key) => collected.push(Some(&key), &page_feature(format, f, oid_field), id_field)?,
                    None => by_content.is_new(&f) && collected.push(None, &page_feature(format, f, oid_field), id_field)?,
                };
                fresh += u64::from(taken);
                Ok(())
            });
            drop(resp);
            duplicates += n - fresh;
            let v = match answer.and_then(|head| check_error(&url, &head.members).map(|_| head)) {
                Ok(head) if head.features.is_some() => head.members,
                Ok(_) => return Err(FetchError::Protocol { url, reason: "query answer has no features[]".into() }),
                // A retried page must not have added features: an answer with both is refused.
                Err(e) if retryable_arcgis(&e) && n == 0 => {
                    failures += 1;
                    session.pause_before_retry(&url, failures, &e.to_string(), None).await?;
                    page = (page / 2).max(1);
                    continue;
                }
                Err(FetchError::Arcgis { url, code, message }) if n > 0 => {
                    return Err(FetchError::Protocol { url, reason: format!("the answer holds {n} features and the error {code} ({message}); refusing a page that is both") });
                }
                Err(e) => return Err(e),
            };
            let wkid = v.get("spatialReference").and_then(|sr| sr.get("latestWkid").or_else(|| sr.get("wkid"))).and_then(Value::as_i64);
            if let Some(w) = wkid.filter(|w| *w != 4326) {
                return Err(FetchError::Protocol { url, reason: format!("the server answered in spatial reference {w} although outSR=4326 was asked") });
            }
            if let Some(crs) = foreign_crs(&v) {
                return Err(FetchError::Protocol { url, reason: format!("the server answered in CRS {crs:?} although outSR=4326 was asked") });
            }
            offset += n;
            if n == 0 {
                break;
            }
            if fresh == 0 {
                // Only features already collected: the server ignores the offset or the order.
                // Stop; the count check below decides (rescan by id field, or an error).
                break;
            }
            match exceeded(&v) {
                Some(true) => continue,
                Some(false) => break,
                // Without the flag, a full last page may have more behind it (a count that
                // is too low): the scan ends at a short or empty page once it holds the
                // count, and the count check below sees any surplus.
                None if collected.len() as u64 >= expected && n < page as u64 => break,
                None => continue,
            }
        }
        let after = count(session, layer_url).await?;
        if after != expected {
            tracing::info!(url = layer_url, before = expected, after, "feature count moved during the scan; scanning again");
            expected = after;
            // The edit date the next scan is checked against is this moment's, not the probe's.
            if edited_ms.is_some() {
                edited_ms = crate::ingest::arcgis::probe(session, layer_url, id_field).await?.publisher_ts_ms;
            }
            continue;
        }
        if collected.len() as u64 != expected && duplicates > 0 && order != id_field {
            // Pages overlapped: the server does not honour the object-id ordering. Scan again
            // ordered by the configured id field.
            tracing::info!(url = layer_url, duplicates, "pages overlapped; scanning again ordered by {id_field}");
            order = id_field.to_string();
            continue;
        }
        if collected.len() as u64 != expected && duplicates > 0 && !shifted && page_cap > 1 {
            // Features known by content repeat either because pages overlapped or because
            // the layer holds identical features and a page boundary fell between them: a
            // pass with other boundaries tells the two apart.
            tracing::info!(url = layer_url, duplicates, "features repeated across pages; scanning again with pages of {}", page_cap - 1);
            shifted = true;
            page_cap -= 1;
            continue;
        }
        if collected.len() as u64 != expected {
            let what = if collected.len() as u64 > expected { "the scan does not add up" } else { "incomplete scan" };
            return Err(FetchError::Protocol {
                url: layer_url.to_string(),
                reason: format!(
                    "{what}: {} distinct features collected ({duplicates} repeated) but returnCountOnly says {expected}",
                    collected.len()
                ),
            });
        }
        // The count can hold while the layer changes under the scan (a parcel deleted from a
        // page already read and another added): every later offset shifts by one, a feature
        // is never seen, and it reads as removed. The edit date, when the server keeps one,
        // says whether anything was edited since it was last read: then scan again.
        if edited_ms.is_some() {
            let now = crate::ingest::arcgis::probe(session, layer_url, id_field).await?;
            if now.publisher_ts_ms != edited_ms {
                tracing::info!(url = layer_url, before = ?edited_ms, after = ?now.publisher_ts_ms, "the layer was edited during the scan; scanning again");
                edited_ms = now.publisher_ts_ms;
                expected = count(session, layer_url).await?;
                continue;
            }
        }
        let n = collected.len();
        return Ok(Scan { layer: collected, features: n, pages, scans: scan_no });
    }
    Err(FetchError::Protocol { url: layer_url.to_string(), reason: "the layer kept changing from one scan to the next (its feature count or its edit date moved); try again later".into() })
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// One Esri JSON feature → a GeoJSON feature (object-id attribute dropped).
pub fn esri_feature_to_geojson(mut attrs: Map<String, Value>, geometry: Option<&Value>, oid_field: Option<&str>) -> Value {
    if let Some(o) = oid_field {
        attrs.remove(o);
    }
    json!({"type": "Feature", "properties": Value::Object(attrs), "geometry": geometry.map(esri_geometry_to_geojson).unwrap_or(Value::Null)})
}

type Ring = Vec<[f64; 2]>;

fn ring_of(v: &Value) -> Option<Ring> {
    v.as_array()?
        .iter()
        .map(|p| {
            let a = p.as_array()?;
            Some([a.first()?.as_f64()?, a.get(1)?.as_f64()?])
        })
        .collect()
}

/// Twice the signed area (shoelace); negative = clockwise.
fn signed_area2(r: &Ring) -> f64 {
    r.windows(2).map(|w| w[0][0] * w[1][1] - w[1][0] * w[0][1]).sum()
}

fn point_in_ring(p: [f64; 2], r: &Ring) -> bool {
    let mut inside = false;
    let n = r.len();
    if n < 3 {
        return false;
    }
    let mut j = n - 1;
    for i in 0..n {
        let (a, b) = (r[i], r[j]);
        if (a[1] > p[1]) != (b[1] > p[1]) && p[0] < (b[0] - a[0]) * (p[1] - a[1]) / (b[1] - a[1]) + a[0] {
            inside = !inside;
        }
        j = i;
    }
    inside
}

/// Where a point lies against a ring.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Inside,
    Outside,
    /// On a vertex or an edge, within [`ON_RING`] of the point's size.
    Boundary,
}

/// How close to a ring a point is taken as on it, relative to the larger of its coordinates'
/// sizes (and 1): ~1.2e-7° at 122° of longitude, about a centimetre, the hash's own rounding.
/// A vertex a publisher put on another ring's edge is rarely exactly on it once written in
/// decimal: a tolerance of the edge's float noise alone let the crossing test decide such a
/// vertex, inside or outside by a hair (a reader).
const ON_RING: f64 = 1e-9;

/// Edges of outer rings a feature's holes may be tested against (with index work counted in
/// edge tests, [`INDEX_COST`], and each outer whose extent meets the hole's as one) before the rest of its holes
/// are left rings of their own (normalize's own work budget then bounds what is made of
/// them): a real parcel layer's worst, a right of way of 100k vertices with 5,000 holes, takes
/// about half of it; a hostile feature of 50k rings in 50k others would take minutes.
const NESTING_BUDGET: u64 = 1_000_000_000;

/// How many points of a hole (vertices and edge midpoints, spread over it) on its outer ring's
/// boundary are tested against every edge before the rest are looked up in an index of them
/// ([`off_boundary`]): a hole that is its outer ring reversed has all of them there, and
/// testing each against every edge was quadratic in the ring's size.
const BOUNDARY_PROBES: usize = 64;

/// [`ON_RING`] at coordinates of these sizes.
fn on_ring_tolerance(coordinates: &[f64]) -> f64 {
    ON_RING * coordinates.iter().fold(1.0f64, |m, v| m.max(v.abs()))
}

/// Whether `p` lies on the edge `a`–`b`, within `tolerance`.
fn on_edge(p: [f64; 2], a: [f64; 2], b: [f64; 2], tolerance: f64) -> bool {
    let (dx, dy) = (b[0] - a[0], b[1] - a[1]);
    let within = |v: f64, a: f64, b: f64| v >= a.min(b) - tolerance && v <= a.max(b) + tolerance;
    if !(within(p[0], a[0], b[0]) && within(p[1], a[1], b[1])) {
        return false;
    }
    let length = dx.hypot(dy);
    // Distance from the edge's line: |cross| / length.
    length == 0.0 || (dx * (p[1] - a[1]) - dy * (p[0] - a[0])).abs() <= tolerance * length
}

fn locate(p: [f64; 2], r: &Ring, work: &mut u64) -> Place {
    *work = work.saturating_add(r.len() as u64);
    let tolerance = on_ring_tolerance(&p);
    if r.windows(2).any(|w| on_edge(p, w[0], w[1], tolerance)) {
        Place::Boundary
    } else if point_in_ring(p, r) {
        Place::Inside
    } else {
        Place::Outside
    }
}

/// Where a hole lies against an outer ring ([`ring_within`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Nesting {
    Inside,
    Outside,
    /// Every vertex and edge midpoint of the hole is on the outer ring: it traces that ring
    /// (a hole that is its outer ring reversed, or one filled by a part of the same shape).
    Traces,
}

/// Where the ring `hole` lies against the ring `outer` (of extents `hole_extent` and
/// `outer_extent`), by its first vertex or edge midpoint that is not on `outer`'s boundary. A
/// hole may touch its outer ring at a vertex, and the crossing test puts a point on the
/// boundary inside or outside by which side it is on: holes touching the top or right of their
/// outer ring were taken as outside and became polygons of their own (a black-box tester: four
/// San José parcels came through ArcGIS as overlapping parts, repaired into other shapes,
/// 1.75% larger). [`BOUNDARY_PROBES`] points spread over the hole are tried first; when all are
/// on the boundary, every other point is, through an index of the outer ring's edges (a
/// sample let a ring leave its outer ring between two probes and be taken as inside: two
/// readers). Past the [`NESTING_BUDGET`] a hole whose probes were all on the boundary is taken
/// as inside, as the probes say.
fn ring_within(hole: &Ring, hole_extent: &[f64; 4], outer: &Ring, outer_extent: &[f64; 4], edges: &mut Option<EdgeIndex>, work: &mut u64) -> Nesting {
    let stride = hole.len().saturating_sub(1).div_ceil(BOUNDARY_PROBES / 2).max(1);
    let probes = hole.windows(2).step_by(stride).flat_map(|w| [w[0], midpoint(w[0], w[1])]);
    for p in probes.take(BOUNDARY_PROBES) {
        match locate(p, outer, work) {
            Place::Inside => return Nesting::Inside,
            Place::Outside => return Nesting::Outside,
            Place::Boundary => {}
        }
    }
    // A ring reaching past the outer ring's extent leaves it (no index needed to say so).
    let (h, o) = (hole_extent, outer_extent);
    let tolerance = on_ring_tolerance(o);
    if !(h[0] >= o[0] - tolerance && h[1] >= o[1] - tolerance && h[2] <= o[2] + tolerance && h[3] <= o[3] + tolerance) {
        return Nesting::Outside;
    }
    match off_boundary(hole, outer, edges, work) {
        Some(Place::Inside) | None => Nesting::Inside,
        Some(Place::Outside) => Nesting::Outside,
        Some(Place::Boundary) => Nesting::Traces,
    }
}

/// An outer ring's edges by their extent (an edge's index is its first vertex's).
type EdgeIndex = rstar::RTree<rstar::primitives::GeomWithData<rstar::primitives::Rectangle<[f64; 2]>, usize>>;

/// The place of `hole`'s first vertex or edge midpoint off `outer`'s boundary; `Boundary` if
/// every one is on it; `None` if the [`NESTING_BUDGET`] ran out first. An R-tree of the outer
/// ring's edges (`edges`, built on first use and kept for the feature's other holes) makes
/// each point's test a look-up, not a pass over every edge (a hole that is its 20,000-vertex
/// outer ring reversed: 40,000 points). Charged to `work` at [`INDEX_COST`] edge tests for
/// each edge indexed and each point looked up, plus the edges each look-up tests.
fn off_boundary(hole: &Ring, outer: &Ring, edges: &mut Option<EdgeIndex>, work: &mut u64) -> Option<Place> {
    let index = edges.get_or_insert_with(|| {
        *work = work.saturating_add((outer.len() as u64).saturating_mul(INDEX_COST));
        let edges = outer.windows(2).enumerate().map(|(i, w)| rstar::primitives::GeomWithData::new(rstar::primitives::Rectangle::from_corners(w[0], w[1]), i));
        rstar::RTree::bulk_load(edges.collect())
    });
    let points = hole.windows(2).flat_map(|w| [w[0], midpoint(w[0], w[1])]);
    for p in points {
        if *work > NESTING_BUDGET {
            return None;
        }
        *work = work.saturating_add(INDEX_COST);
        let tolerance = on_ring_tolerance(&p);
        let near = rstar::AABB::from_corners([p[0] - tolerance, p[1] - tolerance], [p[0] + tolerance, p[1] + tolerance]);
        let mut on = false;
        for edge in index.locate_in_envelope_intersecting(near) {
            *work = work.saturating_add(1);
            if on_edge(p, outer[edge.data], outer[edge.data + 1], tolerance) {
                on = true;
                break;
            }
        }
        if !on {
            // (The index and the pass over every edge test the same edges alike; should they
            // ever disagree, the point is taken as on the ring, and the next one decides.)
            match locate(p, outer, work) {
                Place::Boundary => {}
                off => return Some(off),
            }
        }
    }
    Some(Place::Boundary)
}

/// What indexing one edge, or looking one point up, is charged in edge tests ([`off_boundary`]):
/// a look-up costs a hundred or so nanoseconds where an edge test costs one or two.
const INDEX_COST: u64 = 128;

fn midpoint(a: [f64; 2], b: [f64; 2]) -> [f64; 2] {
    [(a[0] + b[0]) / 2.0, (a[1] + b[1]) / 2.0]
}

/// A ring's extent: min x, min y, max x, max y.
fn extent(r: &Ring) -> [f64; 4] {
    r.iter().fold([f64::INFINITY, f64::INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY], |e, p| [e[0].min(p[0]), e[1].min(p[1]), e[2].max(p[0]), e[3].max(p[1])])
}

/// Esri geometry → GeoJSON geometry. Polygons: clockwise rings are outers, counter-clockwise
/// rings are holes of the smallest outer that contains them (an island in a lake of a parcel
/// holds its own holes; a hole that only traces an outer is that outer's hole when no larger
/// one contains it; a hole inside none becomes an outer, as does every hole whose search
/// begins past the [`NESTING_BUDGET`]; a layer with no clockwise ring at all has every ring
/// as an outer).
pub fn esri_geometry_to_geojson(g: &Value) -> Value {
    if let Some(rings) = g.get("rings").and_then(Value::as_array) {
        let Some(parsed) = rings.iter().map(ring_of).collect::<Option<Vec<Ring>>>() else {
            // A point that is not two numbers (null, text, a number past f64 the number
            // reader kept as text): the rings go on as they are, so normalize quarantines the
            // feature for it as it would the same GeoJSON. Dropping the ring instead changed
            // the parcel silently: a lost hole grows it, a lost outer leaves its hole as it.
            return json!({"type": "Polygon", "coordinates": rings});
        };
        let rings: Vec<Ring> = parsed.into_iter().filter(|r| r.len() >= 4).collect();
        if rings.is_empty() {
            return Value::Null;
        }
        let any_cw = rings.iter().any(|r| signed_area2(r) < 0.0);
        let mut polys: Vec<Vec<Ring>> = Vec::new();
        let mut holes = Vec::new();
        for r in rings {
            if !any_cw || signed_area2(&r) < 0.0 {
                polys.push(vec![r]);
            } else {
                holes.push(r);
            }
        }
        // Outers smallest first: the first around a hole is the smallest. Only those whose
        // extent meets the hole's are tested. One the hole only traces is taken when no
        // other is around it (a reader: a hole filled by a part of its shape became that
        // part's hole, not its outer ring's).
        let extents: Vec<[f64; 4]> = polys.iter().map(|p| extent(&p[0])).collect();
        let mut by_area: Vec<(f64, usize)> = polys.iter().enumerate().map(|(i, p)| (signed_area2(&p[0]).abs(), i)).collect();
        by_area.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut edges: Vec<Option<EdgeIndex>> = polys.iter().map(|_| None).collect();
        // The outers by extent: a hole's candidates are found without comparing it with every
        // outer (a reader: 100k small holes away from 100k small outers took 6.6 s of
        // compares, none charged to the budget). Tried smallest first, by their rank here,
        // taken from a heap (sorting every candidate of a hole inside 100k nested outers
        // before trying the first cost k log k, uncharged; a reader).
        let mut rank = vec![0usize; by_area.len()];
        for (r, &(_, i)) in by_area.iter().enumerate() {
            rank[i] = r;
        }
        let by_extent = if holes.is_empty() {
            rstar::RTree::new()
        } else {
            rstar::RTree::bulk_load(extents.iter().enumerate().map(|(i, o)| rstar::primitives::GeomWithData::new(rstar::primitives::Rectangle::from_corners([o[0], o[1]], [o[2], o[3]]), i)).collect())
        };
        let mut work = 0u64;
        for h in holes {
            let e = extent(&h);
            let mut around = None;
            // The outer the hole traces, and its area: only a larger outer can contain it.
            let mut traced: Option<(usize, f64)> = None;
            if work <= NESTING_BUDGET {
                let mut candidates: std::collections::BinaryHeap<std::cmp::Reverse<usize>> =
                    by_extent.locate_in_envelope_intersecting(rstar::AABB::from_corners([e[0], e[1]], [e[2], e[3]])).map(|o| std::cmp::Reverse(rank[o.data])).collect();
                work = work.saturating_add(candidates.len() as u64);
                while let Some(std::cmp::Reverse(r)) = candidates.pop() {
                    let (area, i) = by_area[r];
                    if traced.is_some_and(|(_, a)| area <= a) {
                        continue;
                    }
                    match ring_within(&h, &e, &polys[i][0], &extents[i], &mut edges[i], &mut work) {
                        Nesting::Inside => {
                            around = Some(i);
                            break;
                        }
                        Nesting::Traces => traced = traced.or(Some((i, area))),
                        Nesting::Outside => {}
                    }
                }
            }
            let around = around.or(traced.map(|(i, _)| i));
            match around {
                Some(i) => polys[i].push(h),
                None => polys.push(vec![h]),
            }
        }
        return if polys.len() == 1 {
            json!({"type": "Polygon", "coordinates": polys.remove(0)})
        } else {
            json!({"type": "MultiPolygon", "coordinates": polys})
        };
    }
    if let Some(paths) = g.get("paths").and_then(Value::as_array) {
        let lines: Vec<Ring> = paths.iter().filter_map(ring_of).collect();
        return json!({"type": "MultiLineString", "coordinates": lines});
    }
    if let (Some(x), Some(y)) = (g.get("x").and_then(Value::as_f64), g.get("y").and_then(Value::as_f64)) {
        return json!({"type": "Point", "coordinates": [x, y]});
    }
    if let Some(points) = g.get("points").and_then(Value::as_array) {
        let pts: Vec<[f64; 2]> = ring_of(&Value::Array(points.clone())).unwrap_or_default();
        return json!({"type": "MultiPoint", "coordinates": pts});
    }
    Value::Null
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring with a point that is not two numbers is not dropped (the parcel would change
    /// shape silently): the feature's geometry fails normalize, and is quarantined.
    #[test]
    fn a_ring_with_a_bad_point_quarantines_the_feature_instead_of_vanishing() {
        let outer = json!([[0.0,0.0],[0.0,10.0],[10.0,10.0],[10.0,0.0],[0.0,0.0]]);
        for bad in [json!(null), json!("x"), json!("1e400")] {
            let hole = json!([[2.0,2.0],[4.0,2.0],[bad,4.0],[2.0,4.0],[2.0,2.0]]);
            let out = esri_geometry_to_geojson(&json!({"rings": [outer, hole]}));
            let parsed = crate::ingest::normalize::parse_geometry(&out.to_string());
            // Refused when read (text), or when cleaned (null reads as NaN: non_finite).
            let refused = match parsed {
                Err(_) => true,
                Ok(mp) => crate::ingest::normalize::clean_geometry_within(mp, None, crate::ingest::valid::WORK_BUDGET).is_err(),
            };
            assert!(refused, "{bad}: {out}");
        }
    }

    #[test]
    fn rings_become_polygons_with_holes() {
        // Outer clockwise square with a counter-clockwise hole, plus a second clockwise outer.
        let g = json!({"rings": [
            [[0.0,0.0],[0.0,10.0],[10.0,10.0],[10.0,0.0],[0.0,0.0]],
            [[2.0,2.0],[4.0,2.0],[4.0,4.0],[2.0,4.0],[2.0,2.0]],
            [[20.0,0.0],[20.0,5.0],[25.0,5.0],[25.0,0.0],[20.0,0.0]]
        ]});
        let out = esri_geometry_to_geojson(&g);
        assert_eq!(out["type"], "MultiPolygon");
        let polys = out["coordinates"].as_array().unwrap();
        assert_eq!(polys.len(), 2);
        assert_eq!(polys[0].as_array().unwrap().len(), 2, "hole attached to the first outer");
        assert_eq!(polys[1].as_array().unwrap().len(), 1);
        let single = esri_geometry_to_geojson(&json!({"rings": [[[0.0,0.0],[0.0,1.0],[1.0,1.0],[0.0,0.0]]]}));
        assert_eq!(single["type"], "Polygon");
        assert_eq!(esri_geometry_to_geojson(&json!({"rings": []})), Value::Null);
    }

    /// A hole touching its outer ring at a vertex stays a hole, whichever side it touches (a
    /// black-box tester: those touching the top or right side became polygons of their own),
    /// and a hole of an island in a lake goes to the island, the smallest outer around it.
    #[test]
    fn a_hole_touching_its_outer_ring_and_an_islands_hole_stay_holes() {
        let outer = json!([[0.0,0.0],[0.0,10.0],[10.0,10.0],[10.0,0.0],[0.0,0.0]]);
        // Counter-clockwise triangles with one vertex on the outer ring: bottom, left, top,
        // right, a corner, and one whose first vertex is the touching one.
        let holes = [
            json!([[5.0,0.0],[6.0,2.0],[4.0,2.0],[5.0,0.0]]),
            json!([[0.0,5.0],[2.0,4.0],[2.0,6.0],[0.0,5.0]]),
            json!([[4.0,8.0],[6.0,8.0],[5.0,10.0],[4.0,8.0]]),
            json!([[8.0,4.0],[10.0,5.0],[8.0,6.0],[8.0,4.0]]),
            json!([[8.0,7.0],[10.0,10.0],[7.0,8.0],[8.0,7.0]]),
            json!([[10.0,5.0],[8.0,6.0],[8.0,4.0],[10.0,5.0]]),
        ];
        for hole in &holes {
            let out = esri_geometry_to_geojson(&json!({"rings": [outer, hole]}));
            assert_eq!(out["type"], "Polygon", "{hole}: {out}");
            assert_eq!(out["coordinates"].as_array().unwrap().len(), 2, "{hole}: {out}");
        }
        // A parcel (0..10) with a lake (1..9) holding an island (3..7) with a pond (4..6):
        // listed pond first.
        let lake = json!([[1.0,1.0],[9.0,1.0],[9.0,9.0],[1.0,9.0],[1.0,1.0]]);
        let island = json!([[3.0,3.0],[3.0,7.0],[7.0,7.0],[7.0,3.0],[3.0,3.0]]);
        let pond = json!([[4.0,4.0],[6.0,4.0],[6.0,6.0],[4.0,6.0],[4.0,4.0]]);
        let out = esri_geometry_to_geojson(&json!({"rings": [pond, outer, lake, island]}));
        assert_eq!(out, json!({"type": "MultiPolygon", "coordinates": [[outer, lake], [island, pond]]}));
    }

    /// A hole vertex a publisher put on its outer ring's edge, a hair outside it once written
    /// in decimal, is on the boundary, not outside (a reader: the edge's float noise alone was
    /// the tolerance); and a hole that is its outer ring reversed, every vertex on it, is
    /// decided after a bounded number of probes, not one per vertex against every edge.
    #[test]
    fn a_vertex_a_hair_off_the_outer_ring_is_on_it_and_probing_is_bounded() {
        let outer: Ring = vec![[-122.0, 37.0], [-122.0, 37.001], [-121.999, 37.001], [-121.999, 37.0], [-122.0, 37.0]];
        // Counter-clockwise triangle whose first vertex is 1e-11° above the top edge.
        let hole: Ring = vec![[-121.9995, 37.001 + 1e-11], [-121.9996, 37.0005], [-121.9994, 37.0005], [-121.9995, 37.001 + 1e-11]];
        let within = |hole: &Ring, outer: &Ring, work: &mut u64| ring_within(hole, &extent(hole), outer, &extent(outer), &mut None, work);
        let mut work = 0;
        assert_eq!(within(&hole, &outer, &mut work), Nesting::Inside);
        let out = esri_geometry_to_geojson(&json!({"rings": [outer, hole]}));
        assert_eq!(out["type"], "Polygon", "{out}");
        // A 20,000-vertex ring and itself reversed.
        let n = 20_000;
        let mut big: Ring = (0..n).map(|i| { let a = -(i as f64) / n as f64 * std::f64::consts::TAU; [-122.0 + 0.01 * a.cos(), 37.0 + 0.01 * a.sin()] }).collect();
        big.push(big[0]);
        let reversed: Ring = big.iter().rev().copied().collect();
        let mut work = 0;
        assert_eq!(within(&reversed, &big, &mut work), Nesting::Traces);
        // Linear in the ring's size (every point against every edge: 40,000 × 20,000).
        assert!(work <= ((BOUNDARY_PROBES + 4 * INDEX_COST as usize) * big.len()) as u64, "{work} edge tests");
        // A ring that follows the outer ring for 100 vertices, then leaves it: not inside (the
        // first 64 probes alone, all on the boundary, took it as inside).
        let mut leaving: Ring = big[..100].to_vec();
        leaving.extend([[-121.95, 37.05], [-121.94, 37.0], big[0]]);
        let mut work = 0;
        assert_eq!(within(&leaving, &big, &mut work), Nesting::Outside);
        // ... also when it leaves between two probes (a reader: 1,000 vertices, then 3 off it).
        let mut brief: Ring = big[..1000].to_vec();
        brief.extend([[-121.95, 37.05], [-121.96, 37.05], big[0]]);
        let mut work = 0;
        assert_eq!(within(&brief, &big, &mut work), Nesting::Outside);
        // ... and when it leaves between two probes without reaching past the outer ring's
        // extent (a reader: the extent rule alone took these as inside).
        let last = big[999];
        let mut inside_box: Ring = big[..1000].to_vec();
        inside_box.extend([[-122.0 + (last[0] + 122.0) * 1.05, 37.0 + (last[1] - 37.0) * 1.05], big[0]]);
        let mut work = 0;
        assert_eq!(within(&inside_box, &big, &mut work), Nesting::Outside);
        let u: Ring = vec![[0.0, 0.0], [0.0, 3.0], [1.0, 3.0], [1.0, 1.0], [2.0, 1.0], [2.0, 3.0], [3.0, 3.0], [3.0, 0.0], [0.0, 0.0]];
        let mut along: Ring = u.iter().rev().copied().collect::<Ring>().windows(2).flat_map(|w| (0..125).map(move |k| [w[0][0] + (w[1][0] - w[0][0]) * k as f64 / 125.0, w[0][1] + (w[1][1] - w[0][1]) * k as f64 / 125.0])).collect();
        // Into the notch (outside the U) and back, between two probes.
        along.splice(500..500, [[1.5, 2.5], [1.5, 2.6]]);
        along.push(along[0]);
        let mut work = 0;
        assert_eq!(within(&along, &u, &mut work), Nesting::Outside);
    }

    /// A hole filled by a part of its own shape is its outer ring's hole, not that part's (the
    /// part minus itself would be nothing; a reader).
    #[test]
    fn a_hole_filled_by_a_part_belongs_to_the_ring_around_both() {
        let outer = json!([[0.0,0.0],[0.0,10.0],[10.0,10.0],[10.0,0.0],[0.0,0.0]]);
        let part = json!([[4.0,4.0],[4.0,6.0],[6.0,6.0],[6.0,4.0],[4.0,4.0]]);
        let hole = json!([[4.0,4.0],[6.0,4.0],[6.0,6.0],[4.0,6.0],[4.0,4.0]]);
        let out = esri_geometry_to_geojson(&json!({"rings": [outer, part, hole]}));
        assert_eq!(out, json!({"type": "MultiPolygon", "coordinates": [[outer, hole], [part]]}));
        // Alone with its hole, a part keeps it (what it traces is all there is).
        let out = esri_geometry_to_geojson(&json!({"rings": [part, hole]}));
        assert_eq!(out, json!({"type": "Polygon", "coordinates": [part, hole]}));
    }

    /// A long hole against many outer rings it does not fit in costs at most the budget: the
    /// extents are the caller's (a reader: 20,000 squares and holes of 250,000 vertices took
    /// 31 s, their extents computed again for every pair and not charged).
    #[test]
    fn many_outers_and_a_long_hole_stay_within_the_budget() {
        let square = json!([[0.0,0.0],[0.0,1.0],[1.0,1.0],[1.0,0.0],[0.0,0.0]]);
        let mut hole: Vec<[f64; 2]> = Vec::new();
        let n = 20_000;
        for side in [[[0.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 1.0]], [[1.0, 1.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 0.0]]] {
            let [a, b]: [[f64; 2]; 2] = side;
            hole.extend((0..n).map(|k| [a[0] + (b[0] - a[0]) * k as f64 / n as f64, a[1] + (b[1] - a[1]) * k as f64 / n as f64]));
        }
        hole.insert(n / 2 + 7, [0.6, -0.5]);
        hole.push(hole[0]);
        let mut rings = vec![square.clone(); 2_000];
        rings.push(json!(hole));
        let started = std::time::Instant::now();
        let out = esri_geometry_to_geojson(&json!({"rings": rings}));
        assert_eq!(out["type"], "MultiPolygon");
        assert_eq!(out["coordinates"].as_array().map(Vec::len), Some(2_001), "the hole is a ring of its own");
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
        // A hole tracing 500 copies of its 20,000-vertex outer ring is the first one's hole,
        // and the copies of the same size are not searched (a reader: each was indexed).
        let n = 20_000;
        let mut big: Ring = (0..n).map(|i| { let a = -(i as f64) / n as f64 * std::f64::consts::TAU; [-122.0 + 0.01 * a.cos(), 37.0 + 0.01 * a.sin()] }).collect();
        big.push(big[0]);
        let reversed: Ring = big.iter().rev().copied().collect();
        let mut rings = vec![json!(big); 500];
        rings.push(json!(reversed));
        let started = std::time::Instant::now();
        let out = esri_geometry_to_geojson(&json!({"rings": rings}));
        assert_eq!(out["coordinates"].as_array().map(Vec::len), Some(500));
        assert_eq!(out["coordinates"][0], json!([big, reversed]));
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
    }

    #[test]
    fn error_bodies_are_classified() {
        let e = check_error("u", &json!({"error": {"code": 498, "message": "Invalid token"}})).unwrap_err();
        assert!(matches!(e, FetchError::Auth { code: 498, .. }));
        let e = check_error("u", &json!({"error": {"code": 500, "message": "boom"}})).unwrap_err();
        assert!(retryable_arcgis(&e));
        let e = check_error("u", &json!({"error": {"code": 400, "message": "bad", "details": ["where"]}})).unwrap_err();
        assert!(!retryable_arcgis(&e) && e.to_string().contains("where"));
        assert!(check_error("u", &json!({"features": []})).is_ok());
    }

    #[test]
    fn collection_order_is_deterministic_and_drops_objectid() {
        let a = esri_feature_to_geojson(json!({"OBJECTID": 7, "APN": "b"}).as_object().unwrap().clone(), None, Some("OBJECTID"));
        let b = esri_feature_to_geojson(json!({"OBJECTID": 3, "APN": "a"}).as_object().unwrap().clone(), None, Some("OBJECTID"));
        let dir = tempfile::tempdir().unwrap();
        let collect = |features: [&Value; 2]| {
            let mut spool = FeatureSpool::new(dir.path()).unwrap();
            for f in features {
                spool.push(None, f, "APN").unwrap();
            }
            spool.into_bytes().unwrap()
        };
        let (x, y) = (collect([&a, &b]), collect([&b, &a]));
        assert_eq!(x, y);
        let text = String::from_utf8(x).unwrap();
        assert!(!text.contains("OBJECTID") && text.find("\"a\"") < text.find("\"b\""));
    }
}
