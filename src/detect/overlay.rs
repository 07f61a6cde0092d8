//! Per-parcel zoning derived by overlay: which district code covers the largest share of each
//! parcel, and which overlay districts cover a meaningful share of it.
//!
//! Most cities publish zoning as district polygons, not as a code per parcel. A parcel's code
//! is the code whose polygons cover the largest part of its area; ties (equal areas within a
//! relative 1e-9) go to the lexicographically smallest normalised code so that the result
//! never depends on feature order. Candidate districts come from an R-tree over the bounding
//! rectangles of the individual district polygons — a parcel is never compared with every
//! district — and the exact intersection area comes from geo's `BooleanOps`.
//!
//! Areas are planar in degrees: a share is a ratio inside one small parcel, where the
//! lon/lat scale is constant, so the planar ratio equals the geodesic one.

use crate::detect::canonical::normalize_code;
use geo::{Area, BooleanOps, BoundingRect, Coord, LineString, MultiPolygon, Polygon, Rect};
use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, AABB};
use std::collections::BTreeMap;

type Entry = GeomWithData<Rectangle<[f64; 2]>, u32>;

/// One indexed district polygon.
struct Piece {
    /// Normalised code (the aggregation key).
    key: String,
    polygon: Polygon<f64>,
    rect: Rect<f64>,
}

/// An R-tree over the polygons of a district layer, with their codes.
pub struct DistrictIndex {
    tree: RTree<Entry>,
    pieces: Vec<Piece>,
    /// Normalised code → the code as first published (deterministic: layer order).
    display: BTreeMap<String, String>,
}

/// The code covering the largest share of a parcel. `code` is empty when no district covers
/// any of it (streets, water, outside the layer).
#[derive(Debug, Clone, PartialEq)]
pub struct DerivedZoning {
    pub code: String,
    /// Covered share of the parcel's area, 0..=1.
    pub share: f64,
}

/// Every code (or overlay name) touching a parcel with its share, largest first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Coverage {
    pub shares: Vec<(String, f64)>,
    /// Intersections that a geometry algorithm could not compute (counted, not guessed).
    pub failed: u32,
}

impl DistrictIndex {
    /// Indexes `(code, geometry)` pairs. Each polygon of a MultiPolygon is its own entry so
    /// that envelopes stay tight.
    pub fn build<'a>(districts: impl IntoIterator<Item = (&'a str, &'a MultiPolygon<f64>)>) -> DistrictIndex {
        let mut pieces = Vec::new();
        let mut display = BTreeMap::new();
        for (code, mp) in districts {
            let key = normalize_code(code);
            display.entry(key.clone()).or_insert_with(|| code.trim().to_string());
            for p in &mp.0 {
                if let Some(rect) = p.bounding_rect() {
                    pieces.push(Piece { key: key.clone(), polygon: p.clone(), rect });
                }
            }
        }
        let entries: Vec<Entry> = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| {
                GeomWithData::new(
                    Rectangle::from_corners([p.rect.min().x, p.rect.min().y], [p.rect.max().x, p.rect.max().y]),
                    i as u32,
                )
            })
            .collect();
        DistrictIndex { tree: RTree::bulk_load(entries), pieces, display }
    }

    /// Number of indexed polygons.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The shares of every code intersecting `parcel`, largest first (ties by code).
    pub fn coverage(&self, parcel: &MultiPolygon<f64>) -> Coverage {
        let mut out = Coverage::default();
        let total = parcel.unsigned_area();
        let Some(prect) = parcel.bounding_rect() else { return out };
        // No area to share out: zero, or NaN from a degenerate parcel (NaN must stop here too).
        if total.is_nan() || total <= 0.0 {
            return out;
        }
        let env = AABB::from_corners([prect.min().x, prect.min().y], [prect.max().x, prect.max().y]);
        let mut by_code: BTreeMap<&str, f64> = BTreeMap::new();
        for cand in self.tree.locate_in_envelope_intersecting(env) {
            let Some(piece) = self.pieces.get(cand.data as usize) else { continue };
            let area = match clipped_area(&piece.polygon, &piece.rect, &prect, parcel, total) {
                Some(a) => a,
                None => {
                    out.failed += 1;
                    0.0
                }
            };
            if area > 0.0 {
                *by_code.entry(piece.key.as_str()).or_default() += area;
            }
        }
        let mut shares: Vec<(String, f64)> = by_code
            .into_iter()
            .map(|(k, a)| {
                let code = self.display.get(k).cloned().unwrap_or_else(|| k.to_string());
                (code, (a / total).min(1.0))
            })
            .collect();
        // Largest share first; equal shares (within 1e-9) by normalised code.
        shares.sort_by(|a, b| {
            if (a.1 - b.1).abs() <= 1e-9 {
                normalize_code(&a.0).cmp(&normalize_code(&b.0))
            } else {
                b.1.total_cmp(&a.1)
            }
        });
        out.shares = shares;
        out
    }

    /// Reference implementation for tests and benchmarks: the same shares computed by
    /// intersecting the parcel with every whole district polygon (no clipping, no R-tree).
    pub fn coverage_unclipped(&self, parcel: &MultiPolygon<f64>) -> Vec<(String, f64)> {
        let total = parcel.unsigned_area();
        let mut by_code: BTreeMap<&str, f64> = BTreeMap::new();
        for piece in &self.pieces {
            let one = MultiPolygon::new(vec![piece.polygon.clone()]);
            let a = parcel.intersection(&one).unsigned_area();
            if a > 0.0 {
                *by_code.entry(piece.key.as_str()).or_default() += a;
            }
        }
        by_code.into_iter().map(|(k, a)| (k.to_string(), (a / total).min(1.0))).collect()
    }

    /// The winning code of a parcel (largest share, deterministic tie-break).
    pub fn derive(&self, parcel: &MultiPolygon<f64>) -> DerivedZoning {
        let cov = self.coverage(parcel);
        match cov.shares.into_iter().next() {
            Some((code, share)) => DerivedZoning { code, share },
            None => DerivedZoning { code: String::new(), share: 0.0 },
        }
    }
}

/// Area of `parcel ∩ district`, computed on the part of the district inside the parcel's
/// bounding box only: the district's rings are clipped to that rectangle first
/// (Sutherland–Hodgman is exact against a convex clip window, whatever the subject's shape),
/// so the exact overlay only sees a handful of vertices instead of a whole district boundary.
/// When the clipped district fills the whole rectangle, the parcel is inside it. None when the
/// overlay algorithm failed on this input.
fn clipped_area(
    district: &Polygon<f64>,
    drect: &Rect<f64>,
    prect: &Rect<f64>,
    parcel: &MultiPolygon<f64>,
    total: f64,
) -> Option<f64> {
    // Widen the window a little so that parcel edges lying on the window are not degenerate.
    let w = (prect.width().max(prect.height()) * 1e-6).max(1e-12);
    let win = Rect::new(
        Coord { x: prect.min().x - w, y: prect.min().y - w },
        Coord { x: prect.max().x + w, y: prect.max().y + w },
    );
    if drect.min().x >= win.min().x && drect.max().x <= win.max().x && drect.min().y >= win.min().y && drect.max().y <= win.max().y {
        // The district is small and inside the window: no clipping needed.
        let one = MultiPolygon::new(vec![district.clone()]);
        return crate::util::catch_geometry_panic(|| parcel.intersection(&one).unsigned_area()).ok().filter(|a| a.is_finite());
    }
    let ext = clip_ring(district.exterior(), &win);
    if ext.0.len() < 4 {
        return Some(0.0);
    }
    let holes: Vec<LineString<f64>> = district
        .interiors()
        .iter()
        .map(|r| clip_ring(r, &win))
        .filter(|r| r.0.len() >= 4)
        .collect();
    let clipped = Polygon::new(ext, holes);
    let clipped_area = clipped.unsigned_area();
    if clipped_area <= 0.0 {
        return Some(0.0);
    }
    if (clipped_area - win.unsigned_area()).abs() <= win.unsigned_area() * 1e-9 && clipped.interiors().is_empty() {
        // The district covers the whole window, hence the whole parcel.
        return Some(total);
    }
    let one = MultiPolygon::new(vec![clipped]);
    crate::util::catch_geometry_panic(|| parcel.intersection(&one).unsigned_area()).ok().filter(|a| a.is_finite())
}

/// Sutherland–Hodgman clip of a closed ring against an axis-aligned rectangle. The result is a
/// closed ring (possibly with zero-width connecting edges, which carry no area).
fn clip_ring(ring: &LineString<f64>, win: &Rect<f64>) -> LineString<f64> {
    let mut pts: Vec<Coord<f64>> = ring.0.clone();
    if pts.len() > 1 && pts.first() == pts.last() {
        pts.pop();
    }
    let (x0, y0, x1, y1) = (win.min().x, win.min().y, win.max().x, win.max().y);
    // (inside test, intersection with the boundary line) for each of the four edges.
    type Inside = fn(&Coord<f64>, f64) -> bool;
    let edges: [(Inside, f64, bool); 4] = [
        (|c, v| c.x >= v, x0, true),
        (|c, v| c.x <= v, x1, true),
        (|c, v| c.y >= v, y0, false),
        (|c, v| c.y <= v, y1, false),
    ];
    for (inside, v, vertical) in edges {
        if pts.is_empty() {
            break;
        }
        let input = std::mem::take(&mut pts);
        let n = input.len();
        for i in 0..n {
            let cur = input[i];
            let prev = input[(i + n - 1) % n];
            let (ci, pi) = (inside(&cur, v), inside(&prev, v));
            if ci != pi {
                let t = if vertical { (v - prev.x) / (cur.x - prev.x) } else { (v - prev.y) / (cur.y - prev.y) };
                let p = if vertical {
                    Coord { x: v, y: prev.y + t * (cur.y - prev.y) }
                } else {
                    Coord { x: prev.x + t * (cur.x - prev.x), y: v }
                };
                pts.push(p);
            }
            if ci {
                pts.push(cur);
            }
        }
    }
    pts.dedup();
    while pts.len() > 1 && pts.first() == pts.last() {
        pts.pop();
    }
    if pts.len() < 3 {
        return LineString::new(vec![]);
    }
    pts.push(pts[0]);
    LineString::new(pts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use geo::polygon;

    fn sq(x: f64, y: f64, s: f64) -> MultiPolygon<f64> {
        MultiPolygon::new(vec![polygon![(x: x, y: y), (x: x + s, y: y), (x: x + s, y: y + s), (x: x, y: y + s)]])
    }

    #[test]
    fn largest_share_wins_and_ties_are_deterministic() {
        let a = sq(0.0, 0.0, 10.0);
        let b = sq(10.0, 0.0, 10.0);
        let idx = DistrictIndex::build([("R-1", &a), ("C-2", &b)]);
        // 70% in R-1, 30% in C-2.
        let d = idx.derive(&sq(3.0, 0.0, 10.0));
        assert_eq!(d.code, "R-1");
        assert!((d.share - 0.7).abs() < 1e-9, "{d:?}");
        // Exactly half and half: the smaller normalised code wins, in either index order.
        let p = sq(5.0, 0.0, 10.0);
        assert_eq!(idx.derive(&p).code, "C-2");
        let idx2 = DistrictIndex::build([("C-2", &b), ("R-1", &a)]);
        assert_eq!(idx2.derive(&p).code, "C-2");
        // Fully inside.
        assert_eq!(idx.derive(&sq(1.0, 1.0, 2.0)), DerivedZoning { code: "R-1".into(), share: 1.0 });
        // Nowhere.
        assert_eq!(idx.derive(&sq(50.0, 50.0, 1.0)).code, "");
    }

    #[test]
    fn split_polygons_of_one_code_add_up() {
        // The same code published as two pieces (a split) gives the same answer as one piece.
        let left = sq(0.0, 0.0, 5.0);
        let right = sq(5.0, 0.0, 5.0);
        let other = sq(0.0, 5.0, 10.0);
        let idx = DistrictIndex::build([("BA", &left), ("ba", &right), ("R-1", &other)]);
        let d = idx.derive(&sq(2.0, 2.0, 6.0));
        assert_eq!(d.code, "BA");
        assert!((d.share - 0.5).abs() < 1e-9);
    }

    #[test]
    fn clipping_matches_whole_polygon_overlay_on_a_concave_district() {
        // A U-shaped district with a hole; parcels straddling its arms and its hole.
        let u = Polygon::new(
            LineString::from(vec![(0.0, 0.0), (9.0, 0.0), (9.0, 9.0), (6.0, 9.0), (6.0, 3.0), (3.0, 3.0), (3.0, 9.0), (0.0, 9.0), (0.0, 0.0)]),
            vec![LineString::from(vec![(1.0, 1.0), (2.0, 1.0), (2.0, 2.0), (1.0, 2.0), (1.0, 1.0)])],
        );
        let mp = MultiPolygon::new(vec![u]);
        let idx = DistrictIndex::build([("U", &mp)]);
        for (x, y, s) in [(2.0, 2.0, 5.0), (0.5, 0.5, 2.0), (-1.0, -1.0, 11.0), (4.0, 5.0, 1.0), (2.5, 8.0, 4.0), (1.0, 1.0, 1.0)] {
            let p = sq(x, y, s);
            let fast = idx.coverage(&p).shares.first().map(|c| c.1).unwrap_or(0.0);
            let slow = idx.coverage_unclipped(&p).first().map(|c| c.1).unwrap_or(0.0);
            assert!((fast - slow).abs() < 1e-9, "square ({x},{y},{s}): {fast} vs {slow}");
        }
    }
}
