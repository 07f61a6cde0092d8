//! OGC validity of a (multi)polygon, without geo's all-pairs tests.
//!
//! Why it exists: geo's `Validation::is_valid` tests every pair of segments of a ring for a
//! self-intersection. Municipal zoning polygons carry thousands of vertices (a San José
//! district ring has up to ~20,000), so that one check took 88% of the time to read the city's
//! 9.7 MB layer — about 20 s, on one core, per publication. This module gives the same answer
//! (same rules, same predicates, checked against geo on generated shapes in the tests) but
//! only tests segment pairs whose bounding boxes meet, found with an R-tree (O(n log n) for a
//! ring). A hole's containment in its exterior uses geo's own `Relate`, as geo does; the rule
//! that no two parts (or holes) overlap relates only the pairs whose boundaries meet, and
//! decides the others with a point-in-polygon test ([`any_pair_overlaps`]).
//!
//! Some shapes stay quadratic for any checker of this kind, so every step spends from a work
//! budget ([`WORK_BUDGET`]) and a geometry past it is [`Validity::TooComplex`]: quarantined by
//! the feed, refused as an AOI, never allowed to hold a scan worker for minutes.

use geo::coordinate_position::CoordPos;
use geo::dimensions::Dimensions;
use geo::{BoundingRect, HasDimensions, Intersects, Line, LineString, MultiPolygon, Polygon, PreparedGeometry, Relate, RemoveRepeatedPoints};
use rstar::primitives::{GeomWithData, Rectangle};
use rstar::{RTree, RTreeObject, AABB};

/// Rings with fewer segments than this are checked pair by pair: cheaper than a tree.
const BRUTE_FORCE_SEGMENTS: usize = 64;

/// How much checking one geometry may cost, in units of about one segment-pair or
/// point-segment test (10-30 ns each on the 2-core machine this is built on, so about a
/// second of one core at the limit). Real municipal layers need far less
/// (`real_layers_stay_far_below_the_validity_budget` in `tests/real_data.rs`), but some shapes
/// are quadratic for any checker of this kind: thousands of parts nested in one another's
/// holes or touching at one point, a ring of thousands of spikes around one point (40,000
/// spikes took 21 s to check before this budget). A feed's feature or an AOI past the budget
/// is refused as [`Validity::TooComplex`], so it cannot hold a scan worker (or the control
/// port) for minutes.
pub const WORK_BUDGET: u64 = 50_000_000;

/// The answer of [`check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Valid,
    Invalid,
    /// Not decided within [`WORK_BUDGET`]: to be quarantined (or refused), never repaired.
    TooComplex,
}

/// Work spent so far against a budget; `Err` once it runs out.
struct Work {
    left: u64,
    /// How many pairs of parts whose boxes meet may be held at once (memory): the budget
    /// over [`UNITS_PER_HELD_PAIR`].
    pair_cap: usize,
}

/// The budget ran out (see [`WORK_BUDGET`]).
struct OverBudget;

impl Work {
    fn spend(&mut self, units: u64) -> Result<(), OverBudget> {
        self.left = self.left.checked_sub(units).ok_or(OverBudget)?;
        Ok(())
    }
}

/// One held pair of parts whose bounding boxes meet counts as this many units against the
/// pairs a check may hold: [`WORK_BUDGET`] allows 2.5M pairs (20 MB); more is
/// [`Validity::TooComplex`]. Real layers have a few hundred at most (a Cambridge parcel's
/// holes: 784), and 2,000 parts nested in one another's holes (2M pairs) are still checked.
/// An unlimited budget (a stored AOI) holds any number.
const UNITS_PER_HELD_PAIR: u64 = 20;

/// A `Relate` costs this many units per segment of the two geometries (it builds a graph of
/// both, with their intersections, before it answers).
const RELATE_UNITS_PER_SEGMENT: u64 = 20;

/// Whether `mp` is a valid multipolygon by the rules geo's `Validation` applies, within
/// [`WORK_BUDGET`].
pub fn check(mp: &MultiPolygon<f64>) -> Validity {
    check_within(mp, WORK_BUDGET).0
}

/// [`check`] with a budget of `budget` units; also returns the units spent.
pub fn check_within(mp: &MultiPolygon<f64>, budget: u64) -> (Validity, u64) {
    let mut work = Work { left: budget, pair_cap: usize::try_from(budget / UNITS_PER_HELD_PAIR).unwrap_or(usize::MAX) };
    let verdict = (|| -> Result<bool, OverBudget> {
        for p in &mp.0 {
            if !polygon_is_valid(p, &mut work)? {
                return Ok(false);
            }
        }
        Ok(!any_pair_overlaps(&mp.0, &mut work)?)
    })();
    let spent = budget - work.left;
    match verdict {
        Ok(true) => (Validity::Valid, spent),
        Ok(false) => (Validity::Invalid, spent),
        Err(OverBudget) => (Validity::TooComplex, spent),
    }
}

/// Whether `mp` is valid ([`check`]); a geometry too complex to decide is not.
pub fn is_valid(mp: &MultiPolygon<f64>) -> bool {
    check(mp) == Validity::Valid
}

/// geo's rule for the parts of a multipolygon and for the holes of a polygon: no two overlap
/// on an area or share a line (touching at points is allowed).
///
/// Relating every pair of parts whose bounding boxes meet, as geo does, is quadratic in the
/// parts: 2,000 nested rings (each part inside the hole of the one around it, so every box
/// meets every other) took 110 s in one subscriber's area, and a feed's feature can be as
/// complex. So the pairs are sorted out first:
/// * pairs whose bounding boxes meet are found with an R-tree of the boxes (none: done, as
///   for most multi-part parcels, without looking at a segment);
/// * among them, those whose boundaries meet (a segment of one intersects a segment of the
///   other, touching included) are found from one R-tree of the segments of the parts
///   concerned, and only they are related with geo's `Relate`: they may touch at points,
///   share a line or cross;
/// * the others overlap exactly when one lies inside the other, which one vertex of each
///   tells (a point-in-polygon test against the other, holes included; no vertex can be on
///   the other's boundary).
///
/// Same answers as relating every pair (tests: `agrees_with_geo_on_generated_shapes`,
/// `nested_and_touching_parts`). Still quadratic in the worst case (every box meeting every
/// other), with a cost per pair of a point-in-polygon test instead of a `Relate`: each pair,
/// segment pair and test is paid from `work`, which also caps the pairs held (`Work::pair_cap`).
fn any_pair_overlaps(polys: &[Polygon<f64>], work: &mut Work) -> Result<bool, OverBudget> {
    use geo::coordinate_position::CoordinatePosition;
    use std::collections::HashSet;
    if polys.len() < 2 {
        return Ok(false);
    }
    let segments_of = |p: &Polygon<f64>| std::iter::once(p.exterior()).chain(p.interiors()).map(|r| r.0.len() as u64).sum::<u64>();
    work.spend(polys.len() as u64)?;
    let boxes: Vec<GeomWithData<Rectangle<[f64; 2]>, usize>> = polys
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.bounding_rect().map(|r| GeomWithData::new(Rectangle::from_corners([r.min().x, r.min().y], [r.max().x, r.max().y]), i)))
        .collect();
    let box_tree = RTree::bulk_load(boxes);
    // Pairs (lower index first) whose boxes meet, at most `pair_cap` of them (memory).
    let mut candidates: Vec<(u32, u32)> = Vec::new();
    for b in box_tree.iter() {
        let i = b.data;
        for j in box_tree.locate_in_envelope_intersecting(b.geom().envelope()).map(|c| c.data).filter(|&j| j > i) {
            work.spend(1)?;
            if candidates.len() >= work.pair_cap {
                return Err(OverBudget);
            }
            candidates.push((u32::try_from(i).map_err(|_| OverBudget)?, u32::try_from(j).map_err(|_| OverBudget)?));
        }
    }
    if candidates.is_empty() {
        return Ok(false);
    }
    let concerned: HashSet<usize> = candidates.iter().flat_map(|&(i, j)| [i as usize, j as usize]).collect();
    /// A segment's box, with its part and the segment.
    type PartSegment = GeomWithData<Rectangle<[f64; 2]>, (usize, Line<f64>)>;
    work.spend(concerned.iter().map(|&i| segments_of(&polys[i])).sum())?;
    let segments: Vec<PartSegment> = concerned
        .iter()
        .flat_map(|&i| std::iter::once(polys[i].exterior()).chain(polys[i].interiors()).flat_map(move |r| r.lines().map(move |l| (i, l))))
        .map(|(i, l)| GeomWithData::new(Rectangle::from_corners([l.start.x, l.start.y], [l.end.x, l.end.y]), (i, l)))
        .collect();
    let segment_tree = RTree::bulk_load(segments);
    // Pairs (lower index first) whose boundaries meet.
    let mut meeting: HashSet<(usize, usize)> = HashSet::new();
    for s in segment_tree.iter() {
        let (i, a) = s.data;
        for c in segment_tree.locate_in_envelope_intersecting(s.geom().envelope()) {
            work.spend(1)?;
            let (j, b) = c.data;
            if j > i && !meeting.contains(&(i, j)) && a.intersects(&b) {
                meeting.insert((i, j));
            }
        }
    }
    let related = |a: &Polygon<f64>, b: &Polygon<f64>| {
        let im = a.relate(b);
        im.get(CoordPos::Inside, CoordPos::Inside) == Dimensions::TwoDimensional
            || im.get(CoordPos::OnBoundary, CoordPos::OnBoundary) == Dimensions::OneDimensional
    };
    for &(i, j) in &meeting {
        work.spend(RELATE_UNITS_PER_SEGMENT.saturating_mul(segments_of(&polys[i]) + segments_of(&polys[j])))?;
        if related(&polys[i], &polys[j]) {
            return Ok(true);
        }
    }
    let inside = |point: Option<&geo::Coord<f64>>, p: &Polygon<f64>| point.is_some_and(|c| p.coordinate_position(c) == CoordPos::Inside);
    for (i, j) in candidates.iter().map(|&(i, j)| (i as usize, j as usize)).filter(|pair| !meeting.contains(pair)) {
        work.spend(segments_of(&polys[i]) + segments_of(&polys[j]))?;
        if inside(polys[i].exterior().0.first(), &polys[j]) || inside(polys[j].exterior().0.first(), &polys[i]) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// One polygon: every ring has enough points, no self-intersection and finite coordinates;
/// holes lie inside the exterior and do not share a line with it or overlap one another.
fn polygon_is_valid(polygon: &Polygon<f64>, work: &mut Work) -> Result<bool, OverBudget> {
    if polygon.is_empty() {
        return Ok(true);
    }
    for ring in std::iter::once(polygon.exterior()).chain(polygon.interiors()) {
        if ring.0.is_empty() {
            continue;
        }
        if ring.remove_repeated_points().0.len() < 4
            || ring.0.iter().any(|c| !(c.x.is_finite() && c.y.is_finite()))
            || ring_self_intersects(ring, work)?
        {
            return Ok(false);
        }
    }
    if polygon.interiors().iter().all(|r| r.0.is_empty()) {
        return Ok(true);
    }
    let exterior_len = polygon.exterior().0.len() as u64;
    work.spend(RELATE_UNITS_PER_SEGMENT.saturating_mul(exterior_len))?;
    // What the relates below will meet where holes cross the exterior: every pair of an
    // exterior and a hole segment whose boxes meet (a comb of holes across a comb of an
    // exterior gives millions of crossings for geo to put in its graph), paid up front.
    spend_on_meeting_segments(polygon.exterior(), polygon.interiors(), work)?;
    let exterior = Polygon::new(polygon.exterior().clone(), vec![]);
    let prepared_exterior = PreparedGeometry::from(&exterior);
    let holes: Vec<Polygon<f64>> = polygon.interiors().iter().filter(|r| !r.0.is_empty()).map(|r| Polygon::new(r.clone(), vec![])).collect();
    for hole in &holes {
        // Each relate copies the prepared exterior's graph and places the hole against the
        // whole exterior: two units per exterior segment, on top of the hole's own.
        work.spend(RELATE_UNITS_PER_SEGMENT.saturating_mul(hole.exterior().0.len() as u64).saturating_add(2 * exterior_len))?;
        let im = prepared_exterior.relate(hole);
        if !im.is_contains() || im.get(CoordPos::OnBoundary, CoordPos::OnBoundary) == Dimensions::OneDimensional {
            return Ok(false);
        }
    }
    Ok(!any_pair_overlaps(&holes, work)?)
}

/// Spends one unit per pair of an `exterior` segment and a `holes` segment whose boxes meet
/// (found with an R-tree of the exterior's segments), deciding nothing: the cost of the
/// crossings the relates of the holes will compute.
///
/// When even every pair meeting (exterior segments × hole segments) fits in what is left of
/// the budget, nothing is counted: most holed polygons (a parcel around a courtyard) need no
/// tree for this.
fn spend_on_meeting_segments(exterior: &LineString<f64>, holes: &[LineString<f64>], work: &mut Work) -> Result<(), OverBudget> {
    let hole_segments: u64 = holes.iter().map(|h| h.0.len() as u64).sum();
    if (exterior.0.len() as u64).saturating_mul(hole_segments) <= work.left {
        return Ok(());
    }
    let segment_box = |l: &Line<f64>| AABB::from_corners([l.start.x.min(l.end.x), l.start.y.min(l.end.y)], [l.start.x.max(l.end.x), l.start.y.max(l.end.y)]);
    work.spend(exterior.0.len() as u64)?;
    let tree = RTree::bulk_load(exterior.lines().map(|l| Rectangle::from_aabb(segment_box(&l))).collect::<Vec<_>>());
    for l in holes.iter().flat_map(|h| h.lines()) {
        work.spend(1)?;
        for _ in tree.locate_in_envelope_intersecting(segment_box(&l)) {
            work.spend(1)?;
        }
    }
    Ok(())
}

/// geo's rule: two distinct segments of the ring intersect, and not merely where one ends and
/// the other begins. (The rule is symmetric, so each unordered pair is tested once.)
fn ring_self_intersects(ring: &LineString<f64>, work: &mut Work) -> Result<bool, OverBudget> {
    let lines: Vec<Line<f64>> = ring.lines().collect();
    let offends = |a: &Line<f64>, b: &Line<f64>| a.intersects(b) && a.start != b.end && a.end != b.start;
    if lines.len() < BRUTE_FORCE_SEGMENTS {
        work.spend((lines.len() * lines.len() / 2) as u64)?;
        return Ok(lines.iter().enumerate().any(|(i, a)| lines[i + 1..].iter().any(|b| offends(a, b))));
    }
    work.spend(lines.len() as u64)?;
    let boxes: Vec<GeomWithData<Rectangle<[f64; 2]>, usize>> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| GeomWithData::new(Rectangle::from_corners([l.start.x, l.start.y], [l.end.x, l.end.y]), i))
        .collect();
    let tree = RTree::bulk_load(boxes);
    for (i, a) in lines.iter().enumerate() {
        let env = AABB::from_corners([a.start.x.min(a.end.x), a.start.y.min(a.end.y)], [a.start.x.max(a.end.x), a.start.y.max(a.end.y)]);
        for c in tree.locate_in_envelope_intersecting(env) {
            work.spend(1)?;
            if c.data > i && offends(a, &lines[c.data]) {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// The size of the work a repair of `mp` would do: its segments, and the pairs of segments
/// that cross (meet at one point inside both). An overlay has to split the rings at every
/// crossing and its result can have about a face per crossing, so this is what a repair's time
/// and memory grow with (`normalize::repair_cost_within`). Other meetings cost an overlay
/// little and are not counted: measured, a ring of 2,401 segments running back and forth along
/// one line (2.9M pairs of segments lying along each other) came out of the union in 34 µs and
/// of `MakeValid` in 0.27 ms, and 10,000 squares sharing their sides (196,446 pairs meeting) were
/// unioned in 2.7 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tangle {
    pub segments: u64,
    pub crossings: u64,
}

/// What one crossing costs a repair, in segments' worth of units: the union's result has
/// about a face per crossing (measured: stars whose segments cross one another 4,949 / 19,899 /
/// 79,799 times repaired in 67 ms / 0.25 s / 1.5 s, where a ring of 1M segments with one
/// crossing took 1.7 s).
pub const UNITS_PER_CROSSING: u64 = 25;

impl Tangle {
    /// The units a repair of a geometry this tangled would cost.
    pub fn repair_units(&self) -> u64 {
        self.segments.saturating_add(self.crossings.saturating_mul(UNITS_PER_CROSSING))
    }
}

/// Why [`tangle_within`] stopped counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TangleStop {
    /// The tangle's repair units passed the cap.
    TooTangled,
    /// The pair tests spent the budget before the count was done.
    OverBudget,
}

/// Counts [`Tangle`], spending a unit per segment and per pair of segments whose boxes meet
/// (each unordered pair is found from both sides: about two units a pair) from `budget`, and
/// stopping once its [`Tangle::repair_units`] pass `max_units`. A star of 401 points (each
/// segment crossing nearly every other: 79,799 crossings, whose repair took 1.5 s) stops after
/// a twenty-fifth of the cap's worth of crossings.
pub fn tangle_within(mp: &MultiPolygon<f64>, max_units: u64, budget: u64) -> Result<Tangle, TangleStop> {
    tangle_of_rings(mp.0.iter().flat_map(rings), max_units, budget)
}

/// A polygon's rings, exterior first.
fn rings(p: &Polygon<f64>) -> impl Iterator<Item = &LineString<f64>> {
    std::iter::once(p.exterior()).chain(p.interiors())
}

/// A polygon's segments: each ring's points less one (its closing point).
pub fn segment_count(p: &Polygon<f64>) -> u64 {
    rings(p).map(|r| r.0.len().saturating_sub(1) as u64).sum()
}

/// [`tangle_within`] over any rings (the polygons of an overlay are not copied into one
/// multipolygon to be counted).
fn tangle_of_rings<'a>(rings: impl Iterator<Item = &'a LineString<f64>>, max_units: u64, budget: u64) -> Result<Tangle, TangleStop> {
    use geo::line_intersection::line_intersection;
    let mut work = Work { left: budget, pair_cap: 0 };
    let lines: Vec<Line<f64>> = rings.flat_map(|r| r.lines()).collect();
    let mut tangle = Tangle { segments: lines.len() as u64, crossings: 0 };
    work.spend(tangle.segments).map_err(|_| TangleStop::OverBudget)?;
    if tangle.repair_units() > max_units {
        return Err(TangleStop::TooTangled);
    }
    let boxes: Vec<GeomWithData<Rectangle<[f64; 2]>, usize>> =
        lines.iter().enumerate().map(|(i, l)| GeomWithData::new(Rectangle::from_corners([l.start.x, l.start.y], [l.end.x, l.end.y]), i)).collect();
    let tree = RTree::bulk_load(boxes);
    for s in tree.iter() {
        for c in tree.locate_in_envelope_intersecting(s.geom().envelope()) {
            work.spend(1).map_err(|_| TangleStop::OverBudget)?;
            // Consecutive segments of a ring meet at their shared end: never a proper crossing.
            if c.data > s.data && line_intersection(lines[s.data], lines[c.data]).is_some_and(|x| x.is_proper()) {
                tangle.crossings += 1;
                if tangle.repair_units() > max_units {
                    return Err(TangleStop::TooTangled);
                }
            }
        }
    }
    Ok(tangle)
}

/// Whether an overlay of `polys` (each valid, so only boundaries of different polygons can
/// cross) fits in `max_units` of [`Tangle::repair_units`]: the guard of the overlays that
/// compare two versions of a district layer, whose inputs passed the validity check one by one
/// but may cross each other anywhere (two combs at right angles: every tooth across every
/// tooth). Counted with [`tangle_within`] within [`WORK_BUDGET`] only when the polygons have
/// enough pairs of segments between them to pass the cap.
pub fn overlay_fits(polys: &[&Polygon<f64>], max_units: u64) -> bool {
    let sizes: Vec<u128> = polys.iter().map(|p| u128::from(segment_count(p))).collect();
    let total: u128 = sizes.iter().sum();
    let between = (total * total - sizes.iter().map(|s| s * s).sum::<u128>()) / 2;
    let bound = total.saturating_add(between.saturating_mul(u128::from(UNITS_PER_CROSSING)));
    if bound <= u128::from(max_units) {
        return true;
    }
    tangle_of_rings(polys.iter().flat_map(|p| rings(p)), max_units, WORK_BUDGET).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use geo::{Coord, Validation};

    /// A small deterministic generator (no extra crate for tests).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// A star-shaped ring around (cx, cy) with `n` vertices; `jitter` > 0 scrambles the
    /// angles so that some rings cross themselves; coordinates on a coarse grid so that
    /// touching vertices and collinear overlaps happen too.
    fn ring(rng: &mut Lcg, cx: f64, cy: f64, n: usize, jitter: f64) -> LineString<f64> {
        let mut pts: Vec<Coord<f64>> = (0..n)
            .map(|k| {
                let a = (k as f64 + jitter * (rng.next() - 0.5) * 6.0) / n as f64 * std::f64::consts::TAU;
                let r = 1.0 + rng.next() * 3.0;
                Coord { x: ((cx + r * a.cos()) * 4.0).round() / 4.0, y: ((cy + r * a.sin()) * 4.0).round() / 4.0 }
            })
            .collect();
        if let Some(&first) = pts.first() {
            pts.push(first);
        }
        LineString(pts)
    }

    #[test]
    fn agrees_with_geo_on_generated_shapes() {
        let mut rng = Lcg(7);
        let (mut valid, mut invalid) = (0, 0);
        for case in 0..3_000 {
            let n = [4, 5, 8, 20, 70, 150][case % 6];
            let jitter = [0.0, 0.3, 1.0][case % 3];
            let mut polys = vec![Polygon::new(ring(&mut rng, 0.0, 0.0, n, jitter), vec![])];
            if case % 4 == 1 {
                // A hole, inside or poking out.
                let (hx, hy) = (rng.next() - 0.5, rng.next() - 0.5);
                let hole = ring(&mut rng, hx, hy, 6, 0.0);
                let scaled = LineString(hole.0.iter().map(|c| Coord { x: c.x * 0.3, y: c.y * 0.3 }).collect());
                polys[0] = Polygon::new(polys[0].exterior().clone(), vec![scaled]);
            }
            if case % 5 == 2 {
                // A second part, apart or overlapping.
                let cx = 3.0 + rng.next() * 6.0;
                polys.push(Polygon::new(ring(&mut rng, cx, 0.0, n.min(20), 0.0), vec![]));
            }
            if case % 7 == 3 {
                // Parts nested in one another's holes, some crossing or inside the part
                // around them (the pairs whose boundaries do not meet).
                for k in 0..2 + case % 3 {
                    let r = 0.4 + 0.2 * k as f64 + rng.next() * 0.15;
                    let square = |r: f64, dx: f64| LineString::from(vec![(dx - r, -r), (dx + r, -r), (dx + r, r), (dx - r, r), (dx - r, -r)]);
                    let dx = 12.0 + (rng.next() - 0.5) * 0.1;
                    let hole = if rng.next() < 0.8 { vec![square(r - 0.08, dx)] } else { vec![] };
                    polys.push(Polygon::new(square(r, dx), hole));
                }
            }
            let mp = MultiPolygon(polys);
            let ours = is_valid(&mp);
            assert_eq!(ours, mp.is_valid(), "case {case}: {mp:?}");
            if ours {
                valid += 1;
            } else {
                invalid += 1;
            }
        }
        assert!(valid > 300 && invalid > 300, "the generator must produce both kinds: {valid} valid, {invalid} invalid");
    }

    /// A square ring of half-side `r` around (x, 0).
    fn square_ring(x: f64, r: f64) -> LineString<f64> {
        LineString::from(vec![(x - r, -r), (x + r, -r), (x + r, r), (x - r, r), (x - r, -r)])
    }

    #[test]
    fn shapes_quadratic_for_any_checker_are_too_complex_not_slow() {
        let annulus = |r: f64| Polygon::new(square_ring(0.0, r), vec![square_ring(0.0, r - 0.5)]);
        // More parts nested in one another's holes than the budget lets a check hold pairs of.
        let nested = MultiPolygon((1..=3_000).map(|k| annulus(k as f64)).collect());
        assert_eq!(check(&nested), Validity::TooComplex);
        // A fan of triangles that all touch at one point (valid: touching at points is
        // allowed), so every pair's boundaries meet and each pair would be related.
        let fan = |n: usize| {
            MultiPolygon(
                (0..n)
                    .map(|k| {
                        let (a, b) = (k as f64 / n as f64 * std::f64::consts::TAU, (k as f64 + 0.5) / n as f64 * std::f64::consts::TAU);
                        Polygon::new(LineString::from(vec![(0.0, 0.0), (a.cos(), a.sin()), (b.cos(), b.sin()), (0.0, 0.0)]), vec![])
                    })
                    .collect(),
            )
        };
        assert_eq!(check(&fan(8)), Validity::Valid);
        assert!(fan(8).is_valid());
        assert_eq!(check(&fan(1_000)), Validity::TooComplex);
        // One ring of thousands of spikes around a small circle: every spike's box holds the
        // middle, so the segment pairs to test grow with the square of the spikes.
        let star = |n: usize| {
            let mut pts: Vec<(f64, f64)> = (0..2 * n)
                .map(|k| {
                    let a = k as f64 / (2 * n) as f64 * std::f64::consts::TAU;
                    let r = if k % 2 == 0 { 1.0 } else { 1e-3 };
                    (r * a.cos(), r * a.sin())
                })
                .collect();
            pts.push(pts[0]);
            MultiPolygon(vec![Polygon::new(LineString::from(pts), vec![])])
        };
        assert_eq!(check(&star(100)), Validity::Valid);
        let spiky = star(10_000);
        assert_eq!(check(&spiky), Validity::TooComplex);
        // is_valid counts what it could not decide as not valid.
        assert!(!is_valid(&spiky));
        // Holes: a hole zigzagging across a zigzag exterior thousands of times (millions of
        // crossings for a relate to build), and thousands of holes in an exterior of
        // thousands of vertices (each relate goes over the whole exterior).
        let zigzag = |n: usize, vertical: bool| {
            let mut pts: Vec<(f64, f64)> = (0..n).map(|k| { let (a, b) = (k as f64 / n as f64, if k % 2 == 0 { 0.0 } else { 1.0 }); if vertical { (a, b) } else { (b, a) } }).collect();
            pts.push(if vertical { (1.0, -1.0) } else { (-1.0, 1.0) });
            pts.push(if vertical { (0.0, -1.0) } else { (-1.0, 0.0) });
            pts.push(pts[0]);
            LineString::from(pts)
        };
        let crossed = MultiPolygon(vec![Polygon::new(zigzag(8_000, true), vec![zigzag(8_000, false)])]);
        assert_eq!(check(&crossed), Validity::TooComplex);
        let circle = |cx: f64, cy: f64, r: f64, n: usize| LineString::from((0..=n).map(|k| { let a = (k % n) as f64 / n as f64 * std::f64::consts::TAU; (cx + r * a.cos(), cy + r * a.sin()) }).collect::<Vec<_>>());
        let holes: Vec<LineString<f64>> = (0..10_000).map(|k| { let a = k as f64 / 10_000.0 * std::f64::consts::TAU; circle(500.0 * a.cos(), 500.0 * a.sin(), 0.01, 4) }).collect();
        let swiss = MultiPolygon(vec![Polygon::new(circle(0.0, 0.0, 1_000.0, 20_000), holes)]);
        assert_eq!(check(&swiss), Validity::TooComplex);
        // The budget is what decides: the same shape with room enough is decided.
        let (verdict, spent) = check_within(&fan(300), u64::MAX);
        assert_eq!(verdict, Validity::Valid);
        assert_eq!(check_within(&fan(300), spent - 1).0, Validity::TooComplex);
        assert_eq!(check_within(&fan(300), spent), (Validity::Valid, spent));
    }

    #[test]
    fn nested_and_touching_parts() {
        let annulus = |r: f64| Polygon::new(square_ring(0.0, r), vec![square_ring(0.0, r - 0.5)]);
        // Rings nested in one another's holes: every bounding box meets every other, no two
        // parts overlap. 2,000 of them took 110 s when every such pair was related.
        let nested = |n: usize| MultiPolygon((1..=n).map(|k| annulus(k as f64)).collect());
        for n in [2, 3, 12] {
            assert!(is_valid(&nested(n)) && nested(n).is_valid(), "{n} nested annuli");
        }
        // The same rotated a quarter turn (diamonds): every segment's box now holds the
        // segments of the rings inside, the segment tree's worst case.
        let diamond = |r: f64| LineString::from(vec![(0.0, -r), (r, 0.0), (0.0, r), (-r, 0.0), (0.0, -r)]);
        let diamonds = |n: usize| MultiPolygon((1..=n).map(|k| Polygon::new(diamond(k as f64), vec![diamond(k as f64 - 0.5)])).collect());
        assert!(is_valid(&diamonds(12)) && diamonds(12).is_valid());
        // Not a timing test: a generous bound that only a return to all-pairs relating misses
        // (2,000 annuli in a release build, fewer in a debug one; a quarter as many diamonds,
        // whose segment pairs still grow with the square of the parts).
        let n = if cfg!(debug_assertions) { 400 } else { 2_000 };
        let started = std::time::Instant::now();
        assert!(is_valid(&nested(n)) && is_valid(&diamonds(n / 4)));
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{n} nested annuli and {} diamonds took {:?}", n / 4, started.elapsed());
        // One of them filled in: the part inside it now overlaps it.
        let mut filled = nested(12);
        filled.0[6] = Polygon::new(square_ring(0.0, 7.0), vec![]);
        assert!(!is_valid(&filled) && !filled.is_valid());
        // A part inside another's area (not its hole), each way round.
        for parts in [vec![Polygon::new(square_ring(0.0, 3.0), vec![]), Polygon::new(square_ring(0.5, 1.0), vec![])],
                      vec![Polygon::new(square_ring(0.5, 1.0), vec![]), Polygon::new(square_ring(0.0, 3.0), vec![])]] {
            let mp = MultiPolygon(parts);
            assert!(!is_valid(&mp) && !mp.is_valid());
        }
        // Touching at a corner is allowed; sharing an edge or crossing is not.
        let corner = MultiPolygon(vec![Polygon::new(square_ring(0.0, 1.0), vec![]), Polygon::new(square_ring(2.0, 1.0), vec![])]);
        assert_eq!(is_valid(&corner), corner.is_valid());
        let unit = |x: f64, y: f64| Polygon::new(LineString::from(vec![(x, y), (x + 1.0, y), (x + 1.0, y + 1.0), (x, y + 1.0), (x, y)]), vec![]);
        let at_point = MultiPolygon(vec![unit(0.0, 0.0), unit(1.0, 1.0)]);
        assert!(is_valid(&at_point) && at_point.is_valid());
        let shared_edge = MultiPolygon(vec![unit(0.0, 0.0), unit(1.0, 0.0)]);
        assert!(!is_valid(&shared_edge) && !shared_edge.is_valid());
        let crossing = MultiPolygon(vec![unit(0.0, 0.0), unit(0.5, 0.5)]);
        assert!(!is_valid(&crossing) && !crossing.is_valid());
        // Holes of one polygon follow the same rule.
        let holes = |inner: Vec<LineString<f64>>| MultiPolygon(vec![Polygon::new(square_ring(0.0, 10.0), inner)]);
        let apart = holes(vec![square_ring(-4.0, 1.0), square_ring(4.0, 1.0)]);
        assert!(is_valid(&apart) && apart.is_valid());
        let hole_in_hole = holes(vec![square_ring(0.0, 4.0), square_ring(0.0, 1.0)]);
        assert!(!is_valid(&hole_in_hole) && !hole_in_hole.is_valid());
    }

    #[test]
    fn spikes_touches_and_long_rings() {
        let sq = |pts: &[(f64, f64)]| MultiPolygon(vec![Polygon::new(LineString::from(pts.to_vec()), vec![])]);
        // A bow-tie.
        let bowtie = sq(&[(0.0, 0.0), (2.0, 2.0), (2.0, 0.0), (0.0, 2.0), (0.0, 0.0)]);
        assert!(!is_valid(&bowtie) && !bowtie.is_valid());
        // A ring touching itself at a vertex.
        let touch = sq(&[(0.0, 0.0), (4.0, 0.0), (2.0, 2.0), (3.0, 4.0), (2.0, 2.0), (0.0, 4.0), (0.0, 0.0)]);
        assert_eq!(is_valid(&touch), touch.is_valid());
        // A long valid ring (a 5,000-gon) and the same with one crossing, through the tree path.
        let n = 5_000;
        let circle: Vec<(f64, f64)> = (0..=n).map(|k| {
            let a = (k % n) as f64 / n as f64 * std::f64::consts::TAU;
            (a.cos(), a.sin())
        }).collect();
        assert!(is_valid(&sq(&circle)));
        let mut crossed = circle.clone();
        crossed.swap(100, 2_600);
        assert!(!is_valid(&sq(&crossed)));
        assert!(!sq(&crossed).is_valid());
    }

    /// A star ring of `n` points visiting every `k`-th point of a circle: its segments cross
    /// one another wherever the star's chords do.
    fn star(n: usize, k: usize) -> MultiPolygon<f64> {
        let pts: Vec<(f64, f64)> = (0..=n)
            .map(|i| {
                let a = ((i * k) % n) as f64 / n as f64 * std::f64::consts::TAU;
                (a.cos(), a.sin())
            })
            .collect();
        MultiPolygon(vec![Polygon::new(LineString::from(pts), vec![])])
    }

    #[test]
    fn a_tangle_counts_segments_and_where_they_cross() {
        let sq = |pts: &[(f64, f64)]| MultiPolygon(vec![Polygon::new(LineString::from(pts.to_vec()), vec![])]);
        let tangle = |mp: &MultiPolygon<f64>| tangle_within(mp, u64::MAX, u64::MAX).map(|t| (t.segments, t.crossings));
        assert_eq!(tangle(&MultiPolygon(vec![Polygon::new(square_ring(0.0, 1.0), vec![])])), Ok((4, 0)));
        assert_eq!(tangle(&sq(&[(0.0, 0.0), (2.0, 2.0), (2.0, 0.0), (0.0, 2.0), (0.0, 0.0)])), Ok((4, 1)), "a bow-tie");
        assert_eq!(tangle(&star(5, 2)), Ok((5, 5)), "a pentagram");
        // Two parts overlapping: their boundaries cross twice; a hole across its exterior, likewise.
        let overlapping = MultiPolygon(vec![Polygon::new(square_ring(0.0, 1.0), vec![]), Polygon::new(square_ring(1.0, 0.5), vec![])]);
        assert_eq!(tangle(&overlapping), Ok((8, 2)));
        let hole_across = MultiPolygon(vec![Polygon::new(square_ring(0.0, 1.0), vec![square_ring(1.0, 0.5)])]);
        assert_eq!(tangle(&hole_across), Ok((8, 2)));
        // Touching and shared stretches are not crossings.
        let sharing = MultiPolygon(vec![Polygon::new(square_ring(0.0, 1.0), vec![]), Polygon::new(square_ring(2.0, 1.0), vec![])]);
        assert_eq!(tangle(&sharing), Ok((8, 0)));
        let touch = sq(&[(0.0, 0.0), (4.0, 0.0), (2.0, 2.0), (3.0, 4.0), (2.0, 2.0), (0.0, 4.0), (0.0, 0.0)]);
        assert_eq!(tangle(&touch), Ok((6, 0)));
        // Every chord of a star of 101 points (step 50) crosses every chord it does not share a
        // point with: 101 × 98 / 2.
        assert_eq!(tangle(&star(101, 50)), Ok((101, 4_949)));
        // Past the cap, or past the budget of pair tests, it is not counted.
        let units = 101 + 4_949 * UNITS_PER_CROSSING;
        assert_eq!(tangle_within(&star(101, 50), units - 1, u64::MAX), Err(TangleStop::TooTangled));
        assert_eq!(tangle_within(&star(101, 50), units, u64::MAX).map(|t| t.repair_units()), Ok(units));
        assert_eq!(tangle_within(&star(101, 50), u64::MAX, 1_000), Err(TangleStop::OverBudget));
    }

    #[test]
    fn an_overlay_fits_unless_the_polygons_cross_each_other_too_often() {
        let p = |mp: MultiPolygon<f64>| mp.0.into_iter().next().unwrap();
        // Two overlapping squares fit (counted: their bound of 408 units is over the cap of 100,
        // their 2 crossings are not); two large circles that touch or cross twice fit too.
        let (a, b) = (Polygon::new(square_ring(0.0, 1.0), vec![]), Polygon::new(square_ring(1.5, 1.0), vec![]));
        assert!(overlay_fits(&[&a, &b], 100));
        let circle = |cx: f64| {
            let ring: Vec<(f64, f64)> = (0..=2_000).map(|k| {
                let t = (k % 2_000) as f64 / 2_000.0 * std::f64::consts::TAU;
                (cx + t.cos(), t.sin())
            }).collect();
            Polygon::new(LineString::from(ring), vec![])
        };
        assert!(overlay_fits(&[&circle(0.0), &circle(2.0)], 10_000), "touching at one point, no crossing");
        assert!(overlay_fits(&[&circle(0.0), &circle(1.0)], 10_000), "two crossings");
        // Past the bound of pairs between them (105 + 404 × 25 units), the count finds the
        // star's own crossings (valid polygons have none, which the bound assumes).
        assert!(!overlay_fits(&[&p(star(101, 50)), &a], 5_000));
        assert!(overlay_fits(&[&p(star(101, 50)), &a], u64::MAX));
    }
}
