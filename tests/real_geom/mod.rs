//! Independent planar geometry for the real-data cross-checks (`tests/districts_real.rs`,
//! `tests/sanjose_cross.rs`): parsing GeoJSON with `serde_json::Value`, even-odd
//! point-in-polygon, distances in local metres and the "deepest point" of a region. It exists so
//! that what those tests expect is computed without any `zonewatch::detect` / `geo` overlay code:
//! a bug in production's overlay cannot hide behind the same bug in the check.
#![allow(dead_code)]

use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, AABB};
use serde_json::Value;
use std::path::Path;

/// Every ring of a geometry (exteriors and holes alike), as lon/lat pairs.
pub type Rings = Vec<Vec<[f64; 2]>>;

/// Metres per degree of longitude / latitude at `lat` (equirectangular, fine within a city).
pub fn metres_per_degree(lat: f64) -> (f64, f64) {
    (111_320.0 * lat.to_radians().cos(), 110_540.0)
}

/// The polygons of a Polygon / MultiPolygon geometry, each as its rings.
pub fn polygons_of(geometry: &Value) -> Vec<Rings> {
    let polys: Vec<&Value> = match geometry["type"].as_str() {
        Some("Polygon") => vec![&geometry["coordinates"]],
        Some("MultiPolygon") => geometry["coordinates"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
        _ => vec![],
    };
    polys
        .into_iter()
        .map(|p| {
            p.as_array()
                .into_iter()
                .flatten()
                .map(|ring| {
                    ring.as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|c| Some([c.get(0)?.as_f64()?, c.get(1)?.as_f64()?]))
                        .collect::<Vec<[f64; 2]>>()
                })
                .filter(|r| r.len() >= 4)
                .collect::<Rings>()
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// All rings of a geometry, flattened (for the even-odd rule).
pub fn rings_of(geometry: &Value) -> Rings {
    polygons_of(geometry).into_iter().flatten().collect()
}

/// Even-odd rule over every ring: right for polygons with holes and for disjoint parts.
pub fn inside(rings: &Rings, x: f64, y: f64) -> bool {
    let mut c = false;
    for r in rings {
        let n = r.len();
        let mut j = n - 1;
        for i in 0..n {
            let (xi, yi) = (r[i][0], r[i][1]);
            let (xj, yj) = (r[j][0], r[j][1]);
            if (yi > y) != (yj > y) && x < (xj - xi) * (y - yi) / (yj - yi) + xi {
                c = !c;
            }
            j = i;
        }
    }
    c
}

pub fn bbox(rings: &Rings) -> [f64; 4] {
    let mut b = [f64::MAX, f64::MAX, f64::MIN, f64::MIN];
    for p in rings.iter().flatten() {
        b[0] = b[0].min(p[0]);
        b[1] = b[1].min(p[1]);
        b[2] = b[2].max(p[0]);
        b[3] = b[3].max(p[1]);
    }
    b
}

/// Area in m² by the shoelace formula in local metres; even-odd (holes subtract whatever their
/// winding).
pub fn area_m2(polys: &[Rings]) -> f64 {
    let lat = polys.first().and_then(|p| p.first()).and_then(|r| r.first()).map(|p| p[1]).unwrap_or(0.0);
    let (kx, ky) = metres_per_degree(lat);
    let ring_area = |r: &Vec<[f64; 2]>| {
        let mut s = 0.0;
        for w in r.windows(2) {
            s += (w[0][0] * kx) * (w[1][1] * ky) - (w[1][0] * kx) * (w[0][1] * ky);
        }
        (s / 2.0).abs()
    };
    polys
        .iter()
        .map(|p| {
            let ext = p.first().map(ring_area).unwrap_or(0.0);
            let holes: f64 = p.iter().skip(1).map(ring_area).sum();
            (ext - holes).max(0.0)
        })
        .sum()
}

/// Distance in metres from (x, y) to the nearest ring segment.
pub fn boundary_distance_m(rings: &Rings, x: f64, y: f64) -> f64 {
    let (kx, ky) = metres_per_degree(y);
    let (px, py) = (x * kx, y * ky);
    let mut best = f64::MAX;
    for r in rings {
        for w in r.windows(2) {
            let (ax, ay, bx, by) = (w[0][0] * kx, w[0][1] * ky, w[1][0] * kx, w[1][1] * ky);
            let (dx, dy) = (bx - ax, by - ay);
            let len2 = dx * dx + dy * dy;
            let t = if len2 > 0.0 { (((px - ax) * dx + (py - ay) * dy) / len2).clamp(0.0, 1.0) } else { 0.0 };
            let (qx, qy) = (ax + t * dx - px, ay + t * dy - py);
            best = best.min((qx * qx + qy * qy).sqrt());
        }
    }
    best
}

/// The deepest point found inside a region (the point farthest from its boundary) and that
/// depth in metres — half the width of the region's widest part. A grid sized to put a few
/// hundred points inside the region, then hill-climbing from the best one with a shrinking
/// step. `None` when no sample falls inside (a region narrower than ~0.2 m).
pub fn deep_point(rings: &Rings, area_m2: f64) -> Option<([f64; 2], f64)> {
    let b = bbox(rings);
    let (kx, ky) = metres_per_degree((b[1] + b[3]) / 2.0);
    let (w, h) = ((b[2] - b[0]) * kx, (b[3] - b[1]) * ky);
    let mut step_m = (area_m2.max(1.0) / 400.0).sqrt().max(0.2);
    // At most ~400k grid points over the bounding box.
    while (w / step_m) * (h / step_m) > 400_000.0 {
        step_m *= 1.5;
    }
    let mut best: Option<([f64; 2], f64)> = None;
    let (nx, ny) = ((w / step_m).ceil() as usize + 1, (h / step_m).ceil() as usize + 1);
    for i in 0..nx {
        for j in 0..ny {
            let x = b[0] + (i as f64 + 0.5) * step_m / kx;
            let y = b[1] + (j as f64 + 0.5) * step_m / ky;
            if x > b[2] || y > b[3] || !inside(rings, x, y) {
                continue;
            }
            let d = boundary_distance_m(rings, x, y);
            if best.is_none_or(|(_, bd)| d > bd) {
                best = Some(([x, y], d));
            }
        }
    }
    let (mut p, mut d) = best?;
    let mut s = step_m / 2.0;
    while s > 0.05 {
        let mut moved = false;
        for (dx, dy) in [(1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0), (0.7, 0.7), (-0.7, 0.7), (0.7, -0.7), (-0.7, -0.7)] {
            let q = [p[0] + dx * s / kx, p[1] + dy * s / ky];
            if inside(rings, q[0], q[1]) {
                let dq = boundary_distance_m(rings, q[0], q[1]);
                if dq > d {
                    (p, d, moved) = (q, dq, true);
                }
            }
        }
        if !moved {
            s /= 2.0;
        }
    }
    Some((p, d))
}

/// One feature of a raw layer: its code (trimmed, upper-cased), optional id, rings, area.
pub struct RawFeature {
    pub code: String,
    pub id: Option<String>,
    pub rings: Rings,
    pub area_m2: f64,
}

/// A raw layer read with `serde_json` only, with an R-tree over feature bounding boxes.
pub struct RawLayer {
    pub features: Vec<RawFeature>,
    tree: RTree<GeomWithData<Rectangle<[f64; 2]>, usize>>,
}

impl RawLayer {
    /// Reads `path`; `code_field` / `id_field` are looked up exactly, then case-insensitively.
    /// Features without a polygon are skipped (production quarantines them).
    pub fn load(path: &Path, code_field: &str, id_field: Option<&str>) -> RawLayer {
        let doc: Value = serde_json::from_slice(&std::fs::read(path).expect("read layer")).expect("layer json");
        let prop = |props: &Value, name: &str| -> Option<Value> {
            if let Some(v) = props.get(name) {
                return Some(v.clone());
            }
            props.as_object()?.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
        };
        let text = |v: Option<Value>| -> Option<String> {
            match v? {
                Value::String(s) => Some(s),
                Value::Number(n) => Some(n.to_string()),
                _ => None,
            }
        };
        let mut features = Vec::new();
        for f in doc["features"].as_array().expect("features") {
            let props = &f["properties"];
            let code = text(prop(props, code_field)).unwrap_or_default().trim().to_uppercase();
            let id = id_field.and_then(|k| text(prop(props, k)));
            let polys = polygons_of(&f["geometry"]);
            if polys.is_empty() {
                continue;
            }
            let area_m2 = area_m2(&polys);
            features.push(RawFeature { code, id, rings: polys.into_iter().flatten().collect(), area_m2 });
        }
        let tree = RTree::bulk_load(
            features
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let b = bbox(&f.rings);
                    GeomWithData::new(Rectangle::from_corners([b[0], b[1]], [b[2], b[3]]), i)
                })
                .collect(),
        );
        RawLayer { features, tree }
    }

    /// Indexes of the features containing (x, y).
    pub fn at(&self, x: f64, y: f64) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .tree
            .locate_in_envelope_intersecting(AABB::from_point([x, y]))
            .filter(|c| inside(&self.features[c.data].rings, x, y))
            .map(|c| c.data)
            .collect();
        out.sort();
        out
    }

    /// The codes of the features containing (x, y), sorted, deduplicated.
    pub fn codes_at(&self, x: f64, y: f64) -> Vec<String> {
        let mut c: Vec<String> = self.at(x, y).into_iter().map(|i| self.features[i].code.clone()).collect();
        c.sort();
        c.dedup();
        c
    }

    /// Distance in metres from (x, y) to the nearest boundary of a feature coded `code`
    /// within `radius_m` (`f64::MAX` when none is that close).
    pub fn code_boundary_distance_m(&self, code: &str, x: f64, y: f64, radius_m: f64) -> f64 {
        let (kx, ky) = metres_per_degree(y);
        let (rx, ry) = (radius_m / kx, radius_m / ky);
        self.tree
            .locate_in_envelope_intersecting(AABB::from_corners([x - rx, y - ry], [x + rx, y + ry]))
            .filter(|c| self.features[c.data].code == code)
            .map(|c| boundary_distance_m(&self.features[c.data].rings, x, y))
            .fold(f64::MAX, f64::min)
    }
}

/// Normalised code as both tests compare them.
pub fn norm(code: &str) -> String {
    code.trim().to_uppercase()
}
