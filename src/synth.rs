//! Synthetic counties, deterministic from a seed: blocks of lots 10–60 m wide, some large
//! parcels, a zoning mix by neighbourhood. Used to make the bundled demo county
//! (`zonewatch synth demo`), by tests, and (later) by `zonewatch bench`.
//!
//! Also holds [`republish`]: the same layer as a county re-publishes it — features shuffled,
//! numbers reformatted, ring start points rotated and orientation flipped — which must
//! produce zero changes.
//!
//! The PRNG is a local SplitMix64 so that a seed means the same county in every version of
//! zonewatch, whatever the `rand` crate does.

use serde_json::{json, Value};
use std::fmt::Write as _;

/// Deterministic pseudo-random numbers (SplitMix64).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// One synthetic parcel: id, zoning code, closed exterior ring in lon/lat.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthParcel {
    pub id: String,
    pub zoning: String,
    pub ring: Vec<[f64; 2]>,
}

/// Parameters of a synthetic county.
#[derive(Debug, Clone)]
pub struct CountySpec {
    pub seed: u64,
    pub parcels: usize,
    /// South-west corner of the county.
    pub origin: [f64; 2],
    /// Blocks per east–west row (12 for the long, narrow demo county; the bench squares it).
    pub blocks_per_row: usize,
}

impl Default for CountySpec {
    fn default() -> Self {
        CountySpec { seed: 7, parcels: 2_000, origin: [-93.30, 44.95], blocks_per_row: 12 }
    }
}

const METRES_PER_DEG_LAT: f64 = 111_320.0;

fn q7(v: f64) -> f64 {
    (v * 1e7).round() / 1e7
}

/// Zoning for a neighbourhood cell: mostly residential, a commercial spine, an industrial edge.
fn zoning_for(col: usize, row: usize, rng: &mut SplitMix64) -> &'static str {
    let r = rng.unit();
    match (col % 6, row % 5) {
        (5, _) => if r < 0.5 { "M-1" } else { "I-2" },
        (_, 2) => if r < 0.4 { "C-1" } else if r < 0.8 { "C-2" } else { "C3" },
        _ => if r < 0.5 { "R-1" } else if r < 0.85 { "R-2" } else { "R-3" },
    }
}

/// Generates a county of about `spec.parcels` lots.
pub fn generate_county(spec: &CountySpec) -> Vec<SynthParcel> {
    let mut parcels = Vec::with_capacity(spec.parcels);
    parcels.extend(CountyIter::new(spec));
    parcels
}

/// The same county as [`generate_county`], one lot at a time, so that a county of millions
/// of parcels can be written to disk without holding it (the bench's generator).
#[derive(Debug, Clone)]
pub struct CountyIter {
    spec: CountySpec,
    rng: SplitMix64,
    m_lon: f64,
    emitted: usize,
    block: usize,
    /// Lots of the current block not handed out yet.
    pending: std::collections::VecDeque<SynthParcel>,
}

const BLOCK_LEN: f64 = 220.0;
const BLOCK_DEPTH: f64 = 70.0;
const STREET: f64 = 14.0;

impl CountyIter {
    pub fn new(spec: &CountySpec) -> Self {
        let m_lon = METRES_PER_DEG_LAT * spec.origin[1].to_radians().cos();
        CountyIter { spec: spec.clone(), rng: SplitMix64::new(spec.seed), m_lon, emitted: 0, block: 0, pending: Default::default() }
    }

    /// Lays out the next block's lots (two rows of lots 10–60 m wide, or one large parcel).
    fn next_block(&mut self) {
        let spec = &self.spec;
        let blocks_per_row = spec.blocks_per_row.max(1);
        let (bx, by) = (self.block % blocks_per_row, self.block / blocks_per_row);
        let x0 = bx as f64 * (BLOCK_LEN + STREET);
        let y0 = by as f64 * (BLOCK_DEPTH + STREET);
        let zone = zoning_for(bx / 2, by / 2, &mut self.rng);
        let big = self.rng.unit() < 0.04;
        let (origin, m_lon) = (spec.origin, self.m_lon);
        let to_ll = |mx: f64, my: f64| [q7(origin[0] + mx / m_lon), q7(origin[1] + my / METRES_PER_DEG_LAT)];
        let mut n = self.emitted;
        for half in 0..2 {
            let ya = y0 + half as f64 * BLOCK_DEPTH / 2.0;
            let yb = ya + BLOCK_DEPTH / 2.0;
            let mut x = x0;
            while x < x0 + BLOCK_LEN - 5.0 && n < spec.parcels {
                let width = if big { BLOCK_LEN } else { self.rng.range(10.0, 60.0).min(x0 + BLOCK_LEN - x) };
                let xe = (x + width).min(x0 + BLOCK_LEN);
                // Counter-clockwise; some lots get a fifth vertex (a bent back line).
                let mut ring = vec![to_ll(x, ya), to_ll(xe, ya)];
                if self.rng.unit() < 0.2 {
                    ring.push(to_ll(xe, (ya + yb) / 2.0));
                    ring.push(to_ll(xe - 1.5, yb));
                } else {
                    ring.push(to_ll(xe, yb));
                }
                ring.push(to_ll(x, yb));
                ring.push(ring[0]);
                let zoning = if big && zone.starts_with('R') { "R-1" } else { zone };
                n += 1;
                self.pending.push_back(SynthParcel { id: format!("DC-{n:06}"), zoning: zoning.to_string(), ring });
                x = xe;
            }
        }
        self.block += 1;
    }

    /// South-west and north-east corners (lon/lat) of a county of `spec.parcels` lots: an
    /// estimate from the block layout, for placing subscriber AOIs over it.
    pub fn extent(spec: &CountySpec) -> ([f64; 2], [f64; 2]) {
        let lots_per_block = 2.0 * BLOCK_LEN / 35.0 * 0.96 + 0.04; // mean lot width 35 m; 4% big
        let blocks = (spec.parcels as f64 / lots_per_block).ceil().max(1.0);
        let per_row = spec.blocks_per_row.max(1) as f64;
        let rows = (blocks / per_row).ceil();
        let m_lon = METRES_PER_DEG_LAT * spec.origin[1].to_radians().cos();
        let w = per_row.min(blocks) * (BLOCK_LEN + STREET);
        let h = rows * (BLOCK_DEPTH + STREET);
        (spec.origin, [spec.origin[0] + w / m_lon, spec.origin[1] + h / METRES_PER_DEG_LAT])
    }
}

impl Iterator for CountyIter {
    type Item = SynthParcel;
    fn next(&mut self) -> Option<SynthParcel> {
        while self.pending.is_empty() && self.emitted < self.spec.parcels {
            self.next_block();
        }
        let p = self.pending.pop_front()?;
        self.emitted += 1;
        Some(p)
    }
}

/// The layer as GeoJSON (fields `APN`, `ZONE_CODE`, `EFF_DATE`).
pub fn to_geojson(parcels: &[SynthParcel], eff_date: &str) -> String {
    let features: Vec<Value> = parcels
        .iter()
        .map(|p| {
            json!({
                "type": "Feature",
                "properties": {"APN": p.id, "ZONE_CODE": p.zoning, "EFF_DATE": eff_date},
                "geometry": {"type": "Polygon", "coordinates": [p.ring]},
            })
        })
        .collect();
    let fc = json!({"type": "FeatureCollection", "name": "demo-county-parcels", "features": features});
    let mut s = String::new();
    s.push_str("{\"type\":\"FeatureCollection\",\"name\":\"demo-county-parcels\",\"features\":[\n");
    if let Some(arr) = fc["features"].as_array() {
        for (i, f) in arr.iter().enumerate() {
            if i > 0 {
                s.push_str(",\n");
            }
            s.push_str(&f.to_string());
        }
    }
    s.push_str("\n]}\n");
    s
}

/// A rezoning applied to make a new version.
#[derive(Debug, Clone, PartialEq)]
pub struct Rezoning {
    pub id: String,
    pub from: String,
    pub to: String,
}

/// Picks `n` parcels and rezones them with a realistic mix: residential → industrial on a
/// large parcel, residential → commercial, commercial → residential, residential → residential.
pub fn rezone(parcels: &mut [SynthParcel], seed: u64, n: usize) -> Vec<Rezoning> {
    let mut rng = SplitMix64::new(seed ^ 0xA5A5);
    let mut done = Vec::new();
    let targets = ["M-1", "C3", "R-2", "C-2", "R-3", "I-2"];
    let mut tries = 0;
    while done.len() < n && tries < 100_000 {
        tries += 1;
        let i = rng.below(parcels.len());
        if done.iter().any(|r: &Rezoning| r.id == parcels[i].id) {
            continue;
        }
        let to = targets[done.len() % targets.len()];
        if parcels[i].zoning == to {
            continue;
        }
        let from = std::mem::replace(&mut parcels[i].zoning, to.to_string());
        done.push(Rezoning { id: parcels[i].id.clone(), from, to: to.to_string() });
    }
    done
}

/// Re-publishes a FeatureCollection: shuffled features, reformatted numbers, rotated ring
/// starts and flipped orientation. The content is unchanged.
pub fn republish(geojson: &[u8], seed: u64) -> Result<Vec<u8>, String> {
    let mut fc: Value = serde_json::from_slice(geojson).map_err(|e| e.to_string())?;
    let mut features = match fc.get_mut("features").map(Value::take) {
        Some(Value::Array(a)) => a,
        _ => return Err("not a FeatureCollection".into()),
    };
    let mut rng = SplitMix64::new(seed);
    for i in (1..features.len()).rev() {
        let j = rng.below(i + 1);
        features.swap(i, j);
    }
    let mut out = String::with_capacity(geojson.len() * 2);
    out.push_str("{\n  \"features\": [\n");
    for (i, f) in features.iter().enumerate() {
        if i > 0 {
            out.push_str(",\n");
        }
        out.push_str("    {\"properties\": ");
        out.push_str(&f.get("properties").cloned().unwrap_or(Value::Null).to_string());
        out.push_str(", \"type\": \"Feature\", \"geometry\": ");
        write_geometry(&mut out, f.get("geometry").unwrap_or(&Value::Null), &mut rng);
        out.push('}');
    }
    out.push_str("\n  ],\n  \"type\": \"FeatureCollection\"\n}\n");
    Ok(out.into_bytes())
}

fn write_number(out: &mut String, v: f64, rng: &mut SplitMix64) {
    let _ = match rng.below(3) {
        0 => write!(out, "{v:.12}"),
        1 => write!(out, "{v:e}"),
        _ => write!(out, "{v}"),
    };
}

fn write_ring(out: &mut String, ring: &[Value], rng: &mut SplitMix64) {
    let pts: Vec<[f64; 2]> = ring
        .iter()
        .filter_map(|p| Some([p.get(0)?.as_f64()?, p.get(1)?.as_f64()?]))
        .collect();
    write_ring_restated(out, pts, rng);
}

/// Writes a closed ring as a re-publication would: its start point rotated, its direction
/// flipped half the time, its numbers reformatted (the same ring to the diff).
fn write_ring_restated(out: &mut String, mut pts: Vec<[f64; 2]>, rng: &mut SplitMix64) {
    if pts.len() > 3 && pts.first() == pts.last() {
        pts.pop();
        let k = rng.below(pts.len());
        pts.rotate_left(k);
        if rng.unit() < 0.5 {
            pts.reverse();
        }
        pts.push(pts[0]);
    }
    out.push('[');
    for (i, p) in pts.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('[');
        write_number(out, p[0], rng);
        out.push_str(", ");
        write_number(out, p[1], rng);
        out.push(']');
    }
    out.push(']');
}

fn write_polygon(out: &mut String, rings: &[Value], rng: &mut SplitMix64) {
    out.push('[');
    for (i, r) in rings.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_ring(out, r.as_array().map(Vec::as_slice).unwrap_or(&[]), rng);
    }
    out.push(']');
}

fn write_geometry(out: &mut String, g: &Value, rng: &mut SplitMix64) {
    let kind = g.get("type").and_then(Value::as_str).unwrap_or("");
    let coords = g.get("coordinates").and_then(Value::as_array);
    match (kind, coords) {
        ("Polygon", Some(rings)) => {
            out.push_str("{\"coordinates\": ");
            write_polygon(out, rings, rng);
            out.push_str(", \"type\": \"Polygon\"}");
        }
        ("MultiPolygon", Some(polys)) => {
            out.push_str("{\"coordinates\": [");
            for (i, p) in polys.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_polygon(out, p.as_array().map(Vec::as_slice).unwrap_or(&[]), rng);
            }
            out.push_str("], \"type\": \"MultiPolygon\"}");
        }
        _ => out.push_str(&g.to_string()),
    }
}

/// Writes one lot as a GeoJSON Feature, the way `to_geojson` does (fields `APN`, `ZONE_CODE`,
/// `EFF_DATE`). With `republish`, the way a county re-publishes it: keys reordered, numbers
/// reformatted, ring start rotated and orientation flipped — the same content.
pub fn write_feature(out: &mut String, p: &SynthParcel, eff_date: &str, republish: Option<&mut SplitMix64>) {
    match republish {
        None => {
            let _ = write!(
                out,
                "{{\"type\":\"Feature\",\"properties\":{{\"APN\":\"{}\",\"ZONE_CODE\":\"{}\",\"EFF_DATE\":\"{}\"}},\"geometry\":{{\"type\":\"Polygon\",\"coordinates\":[[",
                p.id, p.zoning, eff_date
            );
            for (i, c) in p.ring.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "[{},{}]", c[0], c[1]);
            }
            out.push_str("]]}}");
        }
        Some(rng) => {
            let _ = write!(
                out,
                "{{\"properties\": {{\"ZONE_CODE\": \"{}\", \"EFF_DATE\": \"{}\", \"APN\": \"{}\"}}, \"type\": \"Feature\", \"geometry\": {{\"coordinates\": [",
                p.zoning, eff_date, p.id
            );
            write_ring_restated(out, p.ring.clone(), rng);
            out.push_str("], \"type\": \"Polygon\"}}");
        }
    }
}

/// A rectangle AOI as GeoJSON around lon/lat bounds.
pub fn rect_aoi(min: [f64; 2], max: [f64; 2]) -> Value {
    json!({"type": "Polygon", "coordinates": [[[min[0], min[1]], [max[0], min[1]], [max[0], max[1]], [min[0], max[1]], [min[0], min[1]]]]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_sized() {
        let spec = CountySpec { parcels: 300, ..Default::default() };
        let a = generate_county(&spec);
        assert_eq!(a.len(), 300);
        assert_eq!(a, generate_county(&spec));
        let mut b = a.clone();
        let r = rezone(&mut b, 1, 5);
        assert_eq!(r.len(), 5);
        assert_eq!(a.iter().zip(&b).filter(|(x, y)| x.zoning != y.zoning).count(), 5);
    }
}

/// What `write_demo_fixtures` produced.
#[derive(Debug, Clone)]
pub struct DemoFixtures {
    pub rezonings: Vec<Rezoning>,
    pub parcels: usize,
}

/// Writes the bundled demo county: `county-v1.geojson`, `county-v2.geojson` (a handful of
/// rezonings) and `aoi/*.geojson` (three subscribers placed so that some rezonings touch
/// them and some do not).
pub fn write_demo_fixtures(dir: &std::path::Path) -> std::io::Result<DemoFixtures> {
    let spec = CountySpec::default();
    let v1 = generate_county(&spec);
    let mut v2 = v1.clone();
    let width = |p: &SynthParcel| p.ring.iter().map(|c| c[0]).fold(f64::MIN, f64::max) - p.ring.iter().map(|c| c[0]).fold(f64::MAX, f64::min);
    let mut rezonings = Vec::new();
    // One large residential parcel goes industrial: the critical case.
    if let Some(i) = (0..v2.len()).filter(|&i| v2[i].zoning.starts_with('R')).max_by(|&a, &b| width(&v2[a]).total_cmp(&width(&v2[b]))) {
        let from = std::mem::replace(&mut v2[i].zoning, "M-1".to_string());
        rezonings.push(Rezoning { id: v2[i].id.clone(), from, to: "M-1".into() });
    }
    let mut more = rezone(&mut v2, spec.seed, 5);
    more.retain(|r| !rezonings.iter().any(|x| x.id == r.id));
    rezonings.extend(more);

    std::fs::create_dir_all(dir.join("aoi"))?;
    std::fs::write(dir.join("county-v1.geojson"), to_geojson(&v1, "2026-01-15"))?;
    std::fs::write(dir.join("county-v2.geojson"), to_geojson(&v2, "2026-01-15"))?;

    let find = |id: &str| v1.iter().find(|p| p.id == id);
    let bounds = |p: &SynthParcel| {
        let xs = p.ring.iter().map(|c| c[0]);
        let ys = p.ring.iter().map(|c| c[1]);
        ([xs.clone().fold(f64::MAX, f64::min), ys.clone().fold(f64::MAX, f64::min)], [xs.fold(f64::MIN, f64::max), ys.fold(f64::MIN, f64::max)])
    };
    let pad = 0.0004;
    // portfolio-7: a box around the first two rezoned parcels.
    let mut aoi_min = [f64::MAX, f64::MAX];
    let mut aoi_max = [f64::MIN, f64::MIN];
    for r in rezonings.iter().take(2) {
        if let Some(p) = find(&r.id) {
            let (lo, hi) = bounds(p);
            aoi_min = [aoi_min[0].min(lo[0] - pad), aoi_min[1].min(lo[1] - pad)];
            aoi_max = [aoi_max[0].max(hi[0] + pad), aoi_max[1].max(hi[1] + pad)];
        }
    }
    let portfolio = json!({"type": "Feature", "properties": {"name": "Portfolio 7 holdings"}, "geometry": rect_aoi(aoi_min, aoi_max)});
    std::fs::write(dir.join("aoi/portfolio-7.geojson"), serde_json::to_string_pretty(&portfolio)?)?;
    // neighbours-3: a small box around the third rezoned parcel.
    if let Some(p) = rezonings.get(2).and_then(|r| find(&r.id)) {
        let (lo, hi) = bounds(p);
        let g = rect_aoi([lo[0] - 0.0002, lo[1] - 0.0002], [hi[0] + 0.0002, hi[1] + 0.0002]);
        std::fs::write(dir.join("aoi/neighbours-3.geojson"), serde_json::to_string_pretty(&g)?)?;
    }
    // county-planning: everything, but only material and critical changes.
    let (mut lo, mut hi) = ([f64::MAX, f64::MAX], [f64::MIN, f64::MIN]);
    for p in &v1 {
        let (a, b) = bounds(p);
        lo = [lo[0].min(a[0]), lo[1].min(a[1])];
        hi = [hi[0].max(b[0]), hi[1].max(b[1])];
    }
    let fc = json!({"type": "FeatureCollection", "features": [{"type": "Feature", "properties": {}, "geometry": rect_aoi(lo, hi)}]});
    std::fs::write(dir.join("aoi/county-planning.geojson"), serde_json::to_string_pretty(&fc)?)?;
    Ok(DemoFixtures { rezonings, parcels: v1.len() })
}
