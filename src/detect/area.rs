//! Area mode: what changed between two versions of a district layer when there is no parcel
//! base to join to.
//!
//! Every new district polygon is intersected with the old polygons of a *different* code that
//! overlap it (R-tree candidates, clipped to the new polygon's bounding box); the pieces are
//! grouped by (old code → new code) and merged into connected regions. Coverage that appears
//! (new polygon minus every old polygon) or disappears (old minus new) forms regions with an
//! empty code on one side. A region with no connected part at least `tolerance_m` wide (a
//! morphological opening by half the tolerance) of at least `min_change_area_m2` is
//! re-digitisation noise: slivers between two differently simplified boundaries, however long,
//! and however many places they are a little wider than the tolerance. Where a layer overlaps
//! itself (two polygons of different codes stacked on one place, which real exports have), a
//! place that already carried the new code, or still carries the old one, is not a change.
//! Region ids come from their content: the codes and a hash of the region snapped to the
//! tolerance grid.

use crate::detect::canonical::{geometry_hash, normalize_code};
use crate::ingest::valid::overlay_fits;
use crate::model::ABSENT_CONTENT;
use geo::orient::{Direction, Orient};
use geo::{Area, BooleanOps, BoundingRect, Buffer, Coord, GeodesicArea, Intersects, MapCoords, MultiPolygon, Polygon, Rect};
use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, AABB};
use std::collections::BTreeMap;

type Entry = GeomWithData<Rectangle<[f64; 2]>, u32>;

/// What the overlays comparing one piece with the other version's may cost, in
/// [`crate::ingest::valid::Tangle::repair_units`]: 7.5M, about 300,000 crossings. Valid
/// districts can still cross each other anywhere; measured in one release run, two combs at
/// right angles (every tooth across every tooth above the base) recoded between versions: 150
/// teeth (72,361 crossings) compared in 0.39 s, 300 teeth (290,521) in 2.0 s and 180 MB. Past
/// it a piece is skipped and counted ([`AreaDiff::too_tangled`], a run warning) rather than
/// hold the run for minutes and gigabytes; real layers are far below it (San José and Chicago
/// versions in the tests).
const OVERLAY_BUDGET: u64 = 7_500_000;

/// One piece of changed area as [`cross`] finds it: (from code, to code, polygon), with ""
/// for no zone on that side.
type ChangePiece = (String, String, Polygon<f64>);

/// One connected change region.
#[derive(Debug, Clone)]
pub struct Region {
    /// Old code ("" = no zone before).
    pub from: String,
    /// New code ("" = no zone now).
    pub to: String,
    pub geometry: MultiPolygon<f64>,
    /// Geodesic area in m².
    pub area_m2: f64,
    /// Content id: hex of sha256 over the codes and the snapped region.
    pub id: String,
    /// Place id: hex of the snapped region's canonical hash alone, the same whatever the
    /// codes, so that a place that changes back and forth is one place
    /// (`store::area_places`).
    pub place: String,
}

/// The result of comparing two versions.
#[derive(Debug, Default)]
pub struct AreaDiff {
    /// Regions that alert (code → code, and coverage changes, which rank `info`).
    pub regions: Vec<Region>,
    /// Regions dropped as noise (too small or too thin).
    pub noise: u64,
    /// Overlay operations that failed on their input (skipped, counted).
    pub failed: u64,
    /// Pieces and regions whose overlays would cost more than [`OVERLAY_BUDGET`]: their
    /// boundaries cross the other version's (or one another's) too often, or are too large,
    /// to compare in bounded time (skipped, counted; a change there is never alerted).
    pub too_tangled: u64,
}

struct Piece<'a> {
    key: String,
    code: &'a str,
    polygon: &'a Polygon<f64>,
    rect: Rect<f64>,
    /// The other version has a polygon of the same code and the same canonical shape.
    unchanged: bool,
}

/// Marks the polygons present, code and canonical shape alike, in both versions (matched as
/// multisets). Such a polygon contributes nothing: wherever it meets a polygon of another
/// code, the place carried its code in both versions (not a change, see the overlap rule), and
/// it is covered by its twin in the other version. Skipping it is what keeps a re-publication
/// that touched a few districts cheap.
fn mark_unchanged(old: &mut [Piece], new: &mut [Piece]) {
    use std::collections::HashMap;
    let hash = |p: &Piece| (p.key.clone(), geometry_hash(&MultiPolygon::new(vec![p.polygon.clone()])));
    let mut olds: HashMap<(String, [u8; 32]), Vec<usize>> = HashMap::new();
    for (i, p) in old.iter().enumerate() {
        olds.entry(hash(p)).or_default().push(i);
    }
    for p in new.iter_mut() {
        if let Some(i) = olds.get_mut(&hash(p)).and_then(|v| v.pop()) {
            p.unchanged = true;
            old[i].unchanged = true;
        }
    }
}

fn pieces<'a>(layer: &'a [(String, MultiPolygon<f64>)]) -> Vec<Piece<'a>> {
    let mut out = Vec::new();
    for (code, mp) in layer {
        for p in &mp.0 {
            if let Some(rect) = p.bounding_rect() {
                out.push(Piece { key: normalize_code(code), code: code.as_str(), polygon: p, rect, unchanged: false });
            }
        }
    }
    out
}

fn tree(p: &[Piece]) -> RTree<Entry> {
    RTree::bulk_load(
        p.iter()
            .enumerate()
            .map(|(i, p)| GeomWithData::new(Rectangle::from_corners([p.rect.min().x, p.rect.min().y], [p.rect.max().x, p.rect.max().y]), i as u32))
            .collect(),
    )
}

fn env(r: &Rect<f64>) -> AABB<[f64; 2]> {
    AABB::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y])
}

fn guarded<F: FnOnce() -> MultiPolygon<f64> + std::panic::UnwindSafe>(f: F, failed: &mut u64) -> MultiPolygon<f64> {
    match crate::util::catch_geometry_panic(f) {
        Ok(m) => m,
        Err(_) => {
            *failed += 1;
            MultiPolygon::new(vec![])
        }
    }
}

/// For each polygon of `a`: its intersections with `b` polygons of another code, and (when
/// `uncovered`) the part of it no `b` polygon covers. Returns (from, to, piece) triples with
/// `from` the `b` code when `a_is_new`, else the other way round.
fn cross(a: &[Piece], b: &[Piece], btree: &RTree<Entry>, a_is_new: bool, with_changes: bool, failed: &mut u64, too_tangled: &mut u64) -> Vec<ChangePiece> {
    let mut out = Vec::new();
    for pa in a.iter().filter(|p| !p.unchanged) {
        let amp = MultiPolygon::new(vec![pa.polygon.clone()]);
        let cands: Vec<&Piece> = btree.locate_in_envelope_intersecting(env(&pa.rect)).filter_map(|c| b.get(c.data as usize)).collect();
        // All its overlays at once (one count; the candidates' own meetings count too).
        if !overlay_fits(&std::iter::once(pa.polygon).chain(cands.iter().map(|pb| pb.polygon)).collect::<Vec<_>>(), OVERLAY_BUDGET) {
            *too_tangled += 1;
            continue;
        }
        let mut rest = amp.clone();
        for pb in &cands {
            let bmp = MultiPolygon::new(vec![pb.polygon.clone()]);
            if with_changes && pb.key != pa.key && !pb.unchanged {
                let inter = guarded(|| amp.intersection(&bmp), failed);
                for poly in inter.0 {
                    if poly.unsigned_area() > 0.0 {
                        let (from, to) = if a_is_new { (pb.code, pa.code) } else { (pa.code, pb.code) };
                        out.push((from.to_string(), to.to_string(), poly));
                    }
                }
            }
            if !rest.0.is_empty() {
                let r = rest.clone();
                rest = guarded(move || r.difference(&bmp), failed);
            }
        }
        for poly in rest.0 {
            if poly.unsigned_area() > 0.0 {
                let (from, to) = if a_is_new { ("", pa.code) } else { (pa.code, "") };
                out.push((from.to_string(), to.to_string(), poly));
            }
        }
    }
    out
}

/// Local metres around `lat0` (equirectangular; fine over a region).
fn to_metres(mp: &MultiPolygon<f64>, lat0: f64) -> MultiPolygon<f64> {
    let kx = 111_320.0 * lat0.to_radians().cos();
    mp.map_coords(|c| Coord { x: c.x * kx, y: c.y * 110_540.0 })
}

/// Compares two versions of a district layer (`(code, geometry)` per feature).
pub fn area_diff(old: &[(String, MultiPolygon<f64>)], new: &[(String, MultiPolygon<f64>)], min_area_m2: f64, tolerance_m: f64) -> AreaDiff {
    let mut out = AreaDiff::default();
    let mut op = pieces(old);
    let mut np = pieces(new);
    mark_unchanged(&mut op, &mut np);
    let otree = tree(&op);
    let ntree = tree(&np);
    let mut raw = cross(&np, &op, &otree, true, true, &mut out.failed, &mut out.too_tangled);
    raw.extend(cross(&op, &np, &ntree, false, false, &mut out.failed, &mut out.too_tangled));

    // Group by (from, to), then connected components of touching pieces.
    let mut groups: BTreeMap<(String, String), Vec<ChangePiece>> = BTreeMap::new();
    for (f, t, p) in raw {
        groups.entry((normalize_code(&f), normalize_code(&t))).or_default().push((f, t, p));
    }
    for (_, items) in groups {
        let rects: Vec<Rect<f64>> = items.iter().filter_map(|i| i.2.bounding_rect()).collect();
        if rects.len() != items.len() {
            continue;
        }
        let gtree: RTree<Entry> = RTree::bulk_load(
            rects.iter().enumerate().map(|(i, r)| GeomWithData::new(Rectangle::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y]), i as u32)).collect(),
        );
        let mut parent: Vec<usize> = (0..items.len()).collect();
        fn find(p: &mut [usize], mut i: usize) -> usize {
            while p[i] != i {
                p[i] = p[p[i]];
                i = p[i];
            }
            i
        }
        for i in 0..items.len() {
            for c in gtree.locate_in_envelope_intersecting(env(&rects[i])) {
                let j = c.data as usize;
                if j > i && items[i].2.intersects(&items[j].2) {
                    let (a, b) = (find(&mut parent, i), find(&mut parent, j));
                    if a != b {
                        parent[a.max(b)] = a.min(b);
                    }
                }
            }
        }
        let mut comps: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for i in 0..items.len() {
            let r = find(&mut parent, i);
            comps.entry(r).or_default().push(i);
        }
        for (_, members) in comps {
            let polys: Vec<Polygon<f64>> = members.iter().map(|&i| items[i].2.clone()).collect();
            let region = if polys.len() == 1 {
                MultiPolygon::new(polys)
            } else if !overlay_fits(&polys.iter().collect::<Vec<_>>(), OVERLAY_BUDGET) {
                out.too_tangled += 1;
                continue;
            } else {
                guarded(move || geo::unary_union(polys.iter()), &mut out.failed)
            };
            if region.0.is_empty() {
                continue;
            }
            if is_noise(&region, min_area_m2, tolerance_m, &mut out.failed) {
                out.noise += 1;
                continue;
            }
            let (from, to) = (items[members[0]].0.clone(), items[members[0]].1.clone());
            // Where the layers overlap themselves, a place can carry `to` in the old version
            // too, or still carry `from` in the new one: nothing changed there.
            let region = if from.trim().is_empty() || to.trim().is_empty() {
                region
            } else {
                let (fk, tk) = (normalize_code(&from), normalize_code(&to));
                let stale = |ps: &[Piece], t: &RTree<Entry>, key: &str, r: &MultiPolygon<f64>| -> Vec<MultiPolygon<f64>> {
                    let Some(rect) = r.bounding_rect() else { return vec![] };
                    t.locate_in_envelope_intersecting(env(&rect))
                        .filter_map(|c| ps.get(c.data as usize))
                        .filter(|p| p.key == key)
                        .map(|p| MultiPolygon::new(vec![p.polygon.clone()]))
                        .collect()
                };
                let mut cover = stale(&op, &otree, &tk, &region);
                cover.extend(stale(&np, &ntree, &fk, &region));
                if !overlay_fits(&region.0.iter().chain(cover.iter().flat_map(|c| &c.0)).collect::<Vec<_>>(), OVERLAY_BUDGET) {
                    out.too_tangled += 1;
                    continue;
                }
                let mut rest = region;
                let mut cut = false;
                for c in cover {
                    let r = rest.clone();
                    let c2 = c.clone();
                    let shared = guarded(move || r.intersection(&c2), &mut out.failed);
                    if shared.unsigned_area() > 0.0 {
                        let r = rest.clone();
                        rest = guarded(move || r.difference(&c), &mut out.failed);
                        cut = true;
                    }
                }
                if cut {
                    // Exterior rings counter-clockwise again (geodesic area assumes it), and no
                    // degenerate leftovers (a zero-area ring's winding is arbitrary, and a
                    // clockwise one measures as the rest of the globe).
                    rest = rest.orient(Direction::Default);
                    rest.0.retain(|p| p.unsigned_area() > 1e-12);
                    if rest.0.is_empty() || is_noise(&rest, min_area_m2, tolerance_m, &mut out.failed) {
                        out.noise += 1;
                        continue;
                    }
                }
                rest
            };
            let area_m2 = region.geodesic_area_unsigned();
            let (id, place) = region_id(&from, &to, &region, tolerance_m);
            out.regions.push(Region { from, to, geometry: region, area_m2, id, place });
        }
    }
    out.regions.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// What a place became, as `detect::diff::step` compares it: the first half of the sha256 of
/// its normalised new code, or [`ABSENT_CONTENT`] where it lost its zone.
pub fn place_content(to: &str) -> [u8; 16] {
    use sha2::{Digest, Sha256};
    let to = normalize_code(to);
    if to.is_empty() {
        return ABSENT_CONTENT;
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&Sha256::digest(to.as_bytes())[..16]);
    out
}

/// Boundary noise: a region under `min_area_m2`, or one without a connected part at least
/// `tolerance_m` wide (what a morphological opening by half the tolerance keeps) of at least
/// `min_area_m2`. Parts are judged one by one: a long sliver that is a little wider than the
/// tolerance in a few places does not add those places up into a change.
fn is_noise(region: &MultiPolygon<f64>, min_area_m2: f64, tolerance_m: f64, failed: &mut u64) -> bool {
    if region.geodesic_area_unsigned() < min_area_m2 {
        return true;
    }
    let lat0 = region.bounding_rect().map(|r| (r.min().y + r.max().y) / 2.0).unwrap_or(0.0);
    let m = to_metres(region, lat0);
    let opened = guarded(
        move || {
            let eroded = m.buffer(-tolerance_m / 2.0);
            if eroded.0.is_empty() {
                eroded
            } else {
                eroded.buffer(tolerance_m / 2.0)
            }
        },
        failed,
    );
    !opened.0.iter().any(|p| p.unsigned_area() >= min_area_m2)
}

/// The stored coverage an area-mode run keeps where district features of the new version
/// could not be read (quarantined, with a readable place:
/// [`crate::ingest::districts::RejectedDistrict::places`]). Without it, the ground such a
/// feature covered reads as having lost its zone and is alerted `area_rezoned` to no zone,
/// and as gaining one when the feature reads again. As the derive pass does for parcels
/// (`derived::KeptPlaces`), what lies within a footprint keeps the zoning it had: the parts of
/// the old polygons inside the footprints that no readable new polygon covers are carried
/// into the new version, for the comparison and for the snapshot. Where a readable new
/// polygon covers the ground, it is compared as usual.
#[derive(Debug, Default)]
pub struct KeptCoverage {
    /// (old code, piece of its polygon) carried into the new version, each once.
    pub pieces: Vec<(String, MultiPolygon<f64>)>,
    /// Old polygons whose overlays failed on their input, or would cost more than
    /// [`OVERLAY_BUDGET`]: nothing of them is kept (a piece that could not be cut to the
    /// footprints and away from the readable polygons would sit over their changes and hide
    /// them, and pile up run after run). Their ground may read as having lost its zone.
    pub skipped: u64,
}

/// Computes the [`KeptCoverage`] of `old` under `footprints` (bounding rectangles, lon/lat),
/// leaving out what the readable `new` polygons cover. An old polygon with a twin in `new`
/// (code and canonical shape alike, as `mark_unchanged` matches them) is covered by it and
/// skipped at once.
pub fn kept_coverage(old: &[(String, MultiPolygon<f64>)], new: &[(String, MultiPolygon<f64>)], footprints: &[crate::model::Envelope]) -> KeptCoverage {
    use std::collections::HashSet;
    let mut out = KeptCoverage::default();
    if footprints.is_empty() {
        return out;
    }
    let boxes: Vec<Polygon<f64>> = footprints.iter().map(|(lo, hi)| Rect::new(Coord { x: lo[0], y: lo[1] }, Coord { x: hi[0], y: hi[1] }).to_polygon()).collect();
    let box_tree: RTree<Entry> = RTree::bulk_load(
        footprints.iter().enumerate().map(|(i, (lo, hi))| GeomWithData::new(Rectangle::from_corners(*lo, *hi), i as u32)).collect(),
    );
    let np = pieces(new);
    let ntree = tree(&np);
    let twin = |code: &str, p: &Polygon<f64>| (normalize_code(code), geometry_hash(&MultiPolygon::new(vec![p.clone()])));
    let readable: HashSet<(String, [u8; 32])> = np.iter().map(|p| twin(p.code, p.polygon)).collect();
    let mut kept: HashSet<(String, [u8; 32])> = HashSet::new();
    for (code, mp) in old {
        for polygon in &mp.0 {
            let Some(rect) = polygon.bounding_rect() else { continue };
            let under: Vec<&Polygon<f64>> = box_tree.locate_in_envelope_intersecting(env(&rect)).filter_map(|b| boxes.get(b.data as usize)).collect();
            if under.is_empty() || readable.contains(&twin(code, polygon)) {
                continue;
            }
            match kept_piece(polygon, under, &np, &ntree) {
                Some(rest) if !rest.0.is_empty() => {
                    // Once each: the same stored piece twice (two old polygons alike) would
                    // be kept twice, and again in every run after.
                    if kept.insert((normalize_code(code), geometry_hash(&rest))) {
                        out.pieces.push((code.clone(), rest));
                    }
                }
                Some(_) => {}
                None => out.skipped += 1,
            }
        }
    }
    out
}

/// The part of `polygon` within the footprint boxes `under` that no readable new polygon
/// covers (exterior rings counter-clockwise, no degenerate leftovers), or `None` when an
/// overlay failed or would cost more than [`OVERLAY_BUDGET`].
fn kept_piece(polygon: &Polygon<f64>, under: Vec<&Polygon<f64>>, np: &[Piece], ntree: &RTree<Entry>) -> Option<MultiPolygon<f64>> {
    let mut failed = 0;
    let within = MultiPolygon::new(under.into_iter().cloned().collect());
    // Footprints may overlap one another: their union first (rectangles, cheap).
    let within = if within.0.len() == 1 { within } else { guarded(move || geo::unary_union(within.0.iter()), &mut failed) };
    if failed > 0 || !overlay_fits(&std::iter::once(polygon).chain(within.0.iter()).collect::<Vec<_>>(), OVERLAY_BUDGET) {
        return None;
    }
    let whole = MultiPolygon::new(vec![polygon.clone()]);
    let mut rest = guarded(move || whole.intersection(&within), &mut failed);
    let crect = rest.bounding_rect();
    let covers: Vec<&Piece> = crect.map(|r| ntree.locate_in_envelope_intersecting(env(&r)).filter_map(|c| np.get(c.data as usize)).collect()).unwrap_or_default();
    if failed > 0 || !overlay_fits(&rest.0.iter().chain(covers.iter().map(|c| c.polygon)).collect::<Vec<_>>(), OVERLAY_BUDGET) {
        return None;
    }
    for c in covers {
        let (r, cover) = (rest.clone(), MultiPolygon::new(vec![c.polygon.clone()]));
        rest = guarded(move || r.difference(&cover), &mut failed);
        if failed > 0 {
            return None;
        }
    }
    let mut rest = rest.orient(Direction::Default);
    rest.0.retain(|p| p.unsigned_area() > 1e-12);
    Some(rest)
}

/// The region's content id, sha256 over the normalised codes and the region snapped to the
/// tolerance grid (degrees per metre at the integer latitude below the region, so the grid is
/// fixed per place), and its place id, the snapped region's canonical hash alone.
fn region_id(from: &str, to: &str, region: &MultiPolygon<f64>, tolerance_m: f64) -> (String, String) {
    use sha2::{Digest, Sha256};
    let lat_ref = region.bounding_rect().map(|r| r.min().y.floor()).unwrap_or(0.0);
    let sy = tolerance_m / 110_540.0;
    let sx = tolerance_m / (111_320.0 * lat_ref.to_radians().cos().max(0.01));
    let snapped = region.map_coords(|c| Coord { x: (c.x / sx).round() * sx, y: (c.y / sy).round() * sy });
    let shape = geometry_hash(&snapped);
    let mut h = Sha256::new();
    h.update(normalize_code(from).as_bytes());
    h.update([0x1f]);
    h.update(normalize_code(to).as_bytes());
    h.update([0x1f]);
    h.update(shape);
    (crate::util::hex(&h.finalize()[..16]), crate::util::hex(&shape[..16]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use geo::polygon;

    fn rect_mp(x0: f64, y0: f64, x1: f64, y1: f64) -> MultiPolygon<f64> {
        MultiPolygon::new(vec![polygon![(x: x0, y: y0), (x: x1, y: y0), (x: x1, y: y1), (x: x0, y: y1)]])
    }

    /// A comb of `teeth` teeth over a square of `side` degrees at (0, 42): teeth running north
    /// when `north`, else east (the same comb mirrored over the diagonal).
    fn comb(teeth: usize, side: f64, north: bool) -> MultiPolygon<f64> {
        let (d, base) = (side / teeth as f64, side / 10.0);
        let mut pts = vec![(0.0, 0.0), (side, 0.0), (side, base)];
        for i in (0..teeth).rev() {
            let x = i as f64 * d;
            pts.extend([(x + d / 2.0, base), (x + d / 2.0, side), (x, side), (x, base)]);
        }
        let at = |(x, y): (f64, f64)| if north { (x, 42.0 + y) } else { (y, 42.0 + x) };
        let ring: Vec<(f64, f64)> = pts.into_iter().map(at).collect();
        MultiPolygon::new(vec![Polygon::new(geo::LineString::from(ring), vec![])])
    }

    /// Two versions whose districts are valid one by one but cross each other everywhere (a
    /// comb of 500 teeth recoded and turned at right angles: 808,201 crossings, where 300 teeth
    /// and 290,521 took 2 s and 180 MB) are not overlaid: the pieces are skipped and counted.
    /// Combs of a few teeth are compared as before.
    #[test]
    fn districts_too_tangled_with_the_other_version_are_skipped_and_counted() {
        let d = area_diff(&[("R-1".to_string(), comb(500, 0.01, true))], &[("C-2".to_string(), comb(500, 0.01, false))], 200.0, 3.0);
        assert!(d.too_tangled >= 1 && d.regions.is_empty(), "{:?}", (d.too_tangled, d.regions.len(), d.failed));
        let d = area_diff(&[("R-1".to_string(), comb(4, 0.01, true))], &[("C-2".to_string(), comb(4, 0.01, false))], 200.0, 3.0);
        assert_eq!(d.too_tangled, 0);
        assert!(d.regions.iter().any(|r| (r.from.as_str(), r.to.as_str()) == ("R-1", "C-2")), "{:?}", d.regions.iter().map(|r| (&r.from, &r.to)).collect::<Vec<_>>());
    }

    #[test]
    fn real_change_alerts_and_boundary_noise_does_not() {
        // ~0.001° ≈ 80 m east-west, 110 m north-south at 42°.
        let old = vec![("R-1".to_string(), rect_mp(0.0, 42.0, 0.002, 42.001)), ("B-1".to_string(), rect_mp(0.002, 42.0, 0.004, 42.001))];
        // The boundary moves by ~1.6 m (noise) and a block of R-1 becomes C-1.
        let new = vec![
            ("R-1".to_string(), rect_mp(0.0, 42.0, 0.00102, 42.001)),
            ("C-1".to_string(), rect_mp(0.00102, 42.0, 0.00202, 42.001)),
            ("B-1".to_string(), rect_mp(0.00202, 42.0, 0.004, 42.001)),
        ];
        let d = area_diff(&old, &new, 200.0, 3.0);
        let alerts: Vec<(&str, &str)> = d.regions.iter().map(|r| (r.from.as_str(), r.to.as_str())).collect();
        assert_eq!(alerts, vec![("R-1", "C-1")], "{d:?}");
        assert!(d.regions[0].area_m2 > 5000.0);
        assert!(d.noise >= 1);
        // Same inputs, same ids.
        let again = area_diff(&old, &new, 200.0, 3.0);
        assert_eq!(again.regions[0].id, d.regions[0].id);
        // Nothing changed: nothing at all.
        assert!(area_diff(&old, &old, 200.0, 3.0).regions.is_empty());
        // The change undone: the same place, another region id.
        let back = area_diff(&new, &old, 200.0, 3.0);
        let undone = back.regions.iter().find(|r| (r.from.as_str(), r.to.as_str()) == ("C-1", "R-1")).expect("C-1 → R-1");
        assert_eq!(undone.place, d.regions[0].place);
        assert_ne!(undone.id, d.regions[0].id);
        // What a place became, as the step compares it: its code, normalised; no zone is absent.
        assert_eq!(place_content("C-1"), place_content(" c-1 "));
        assert_ne!(place_content("C-1"), place_content("R-1"));
        assert_eq!(place_content(""), ABSENT_CONTENT);
    }

    #[test]
    fn layers_that_overlap_themselves_do_not_swap_codes() {
        // Both versions stack an R-1 and a C-1 polygon on the same block (a digitising error
        // the Chicago files really have): neither R-1 → C-1 nor C-1 → R-1 happened.
        let block = rect_mp(0.0, 42.0, 0.001, 42.001);
        let old = vec![("R-1".to_string(), block.clone()), ("C-1".to_string(), block.clone())];
        let new = vec![("C-1".to_string(), block.clone()), ("R-1".to_string(), block.clone())];
        let d = area_diff(&old, &new, 200.0, 3.0);
        assert!(d.regions.is_empty(), "{:?}", d.regions.iter().map(|r| (&r.from, &r.to, r.area_m2)).collect::<Vec<_>>());
        // A new C-1 polygon laid over a block that stays R-1: R-1 did not go away.
        let old = vec![("R-1".to_string(), rect_mp(0.0, 42.0, 0.002, 42.001))];
        let new = vec![("R-1".to_string(), rect_mp(0.0, 42.0, 0.002, 42.001)), ("C-1".to_string(), rect_mp(0.0005, 42.0, 0.0015, 42.001))];
        assert!(area_diff(&old, &new, 200.0, 3.0).regions.is_empty());
        // Half of the stacked C-1 is really rezoned (the R-1 copy is gone there): only that
        // half alerts, with the right area.
        let old = vec![("R-1".to_string(), rect_mp(0.0, 42.0, 0.002, 42.001)), ("C-1".to_string(), rect_mp(0.0, 42.0, 0.001, 42.001))];
        let new = vec![("R-1".to_string(), rect_mp(0.0, 42.0, 0.001, 42.001)), ("B-1".to_string(), rect_mp(0.001, 42.0, 0.002, 42.001)), ("C-1".to_string(), rect_mp(0.0, 42.0, 0.001, 42.001))];
        let d = area_diff(&old, &new, 200.0, 3.0);
        let got: Vec<(&str, &str)> = d.regions.iter().map(|r| (r.from.as_str(), r.to.as_str())).collect();
        assert_eq!(got, vec![("R-1", "B-1")]);
        let expect = rect_mp(0.001, 42.0, 0.002, 42.001).geodesic_area_unsigned();
        assert!((d.regions[0].area_m2 - expect).abs() < 0.01 * expect, "{} vs {expect}", d.regions[0].area_m2);
    }

    #[test]
    fn a_sliver_a_little_wider_than_the_tolerance_in_places_is_noise() {
        // R-1 | B-1 along a north-south line. The new version moves the line 1 m west
        // (noise) and, in four places 60 m apart, 3.4 m west for 20 m: each of those bumps
        // is wider than the 3 m tolerance but only ~60 m², together ~250 m² (and the whole
        // sliver ~550 m²). No connected part is both 3 m wide and 200 m²: noise. (Summing the
        // wide parts, as the filter once did, made this a change.)
        let (mx, my) = (1.0 / (111_320.0 * 42.0f64.to_radians().cos()), 1.0 / 110_540.0);
        let x = 0.002;
        let mut edge = vec![(x - mx, 42.0)];
        for k in 0..4 {
            let y0 = 42.0 + (30.0 + 60.0 * k as f64) * my;
            let y1 = y0 + 20.0 * my;
            edge.extend([(x - mx, y0), (x - 3.4 * mx, y0), (x - 3.4 * mx, y1), (x - mx, y1)]);
        }
        edge.push((x - mx, 42.003));
        let mut west: Vec<(f64, f64)> = vec![(0.0, 42.0)];
        west.extend(edge.iter().copied());
        west.push((0.0, 42.003));
        let ring = |pts: Vec<(f64, f64)>| MultiPolygon::new(vec![Polygon::new(pts.into_iter().map(|(x, y)| Coord { x, y }).collect::<Vec<_>>().into(), vec![])]);
        let mut east_ring = vec![(0.004, 42.003)];
        east_ring.extend(edge.iter().rev().copied());
        east_ring.push((0.004, 42.0));
        let old = vec![("R-1".to_string(), rect_mp(0.0, 42.0, x, 42.003)), ("B-1".to_string(), rect_mp(x, 42.0, 0.004, 42.003))];
        let new = vec![("R-1".to_string(), ring(west).orient(Direction::Default)), ("B-1".to_string(), ring(east_ring).orient(Direction::Default))];
        let d = area_diff(&old, &new, 200.0, 3.0);
        assert!(d.regions.is_empty(), "{:?}", d.regions.iter().map(|r| (&r.from, &r.to, r.area_m2)).collect::<Vec<_>>());
        assert_eq!(d.noise, 1);
        // One bump of 3.4 m × 70 m (238 m²) is a change.
        let mut edge = vec![(x - mx, 42.0), (x - mx, 42.0 + 100.0 * my), (x - 3.4 * mx, 42.0 + 100.0 * my), (x - 3.4 * mx, 42.0 + 170.0 * my), (x - mx, 42.0 + 170.0 * my)];
        edge.push((x - mx, 42.003));
        let mut west = vec![(0.0, 42.0)];
        west.extend(edge.iter().copied());
        west.push((0.0, 42.003));
        let mut east_ring = vec![(0.004, 42.003)];
        east_ring.extend(edge.iter().rev().copied());
        east_ring.push((0.004, 42.0));
        let new = vec![("R-1".to_string(), ring(west).orient(Direction::Default)), ("B-1".to_string(), ring(east_ring).orient(Direction::Default))];
        let d = area_diff(&old, &new, 200.0, 3.0);
        let got: Vec<(&str, &str)> = d.regions.iter().map(|r| (r.from.as_str(), r.to.as_str())).collect();
        assert_eq!(got, vec![("R-1", "B-1")]);
    }

    #[test]
    fn polygons_present_in_both_versions_are_skipped_without_changing_the_answer() {
        // The R-1 block is re-published as is (ring start rotated, features reordered); the
        // B-1 block next to it becomes C-1, and a stale copy of R-1 overlapped half of it in
        // the old version only.
        let r1 = rect_mp(0.0, 42.0, 0.001, 42.001);
        let r1_rotated = MultiPolygon::new(vec![polygon![(x: 0.001, y: 42.0), (x: 0.001, y: 42.001), (x: 0.0, y: 42.001), (x: 0.0, y: 42.0)]]);
        let old = vec![("R-1".to_string(), r1), ("B-1".to_string(), rect_mp(0.001, 42.0, 0.002, 42.001)), ("R-1".to_string(), rect_mp(0.001, 42.0, 0.0015, 42.001))];
        let new = vec![("C-1".to_string(), rect_mp(0.001, 42.0, 0.002, 42.001)), ("r-1 ".to_string(), r1_rotated)];
        let d = area_diff(&old, &new, 200.0, 3.0);
        let got: Vec<(&str, &str)> = d.regions.iter().map(|r| (r.from.as_str(), r.to.as_str())).collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got.contains(&("B-1", "C-1")) && got.contains(&("R-1", "C-1")), "{got:?}");
        let whole = rect_mp(0.001, 42.0, 0.002, 42.001).geodesic_area_unsigned();
        let sum: f64 = d.regions.iter().map(|r| r.area_m2).sum();
        // The stacked half is both B-1 → C-1 and R-1 → C-1 (each code went away there).
        assert!((sum - 1.5 * whole).abs() < 0.01 * whole, "{sum} vs {}", 1.5 * whole);
        assert!(area_diff(&new, &new, 200.0, 3.0).regions.is_empty());
    }
}
