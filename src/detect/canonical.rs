//! Canonical hashing of parcels. Two publications of the same parcel hash the same when they
//! differ only in feature order, number formatting, ring start point or ring orientation:
//! coordinates are rounded to 1e-7° (≈1 cm), repeated points dropped, exterior rings made
//! counter-clockwise and holes clockwise, each ring rotated to start at its smallest vertex,
//! and holes and polygons sorted.

use geo::{LineString, MultiPolygon};
use sha2::{Digest, Sha256};

type Ring = Vec<(i64, i64)>;

fn round(v: f64) -> i64 {
    (v * 1e7).round() as i64
}

/// The start of the lexicographically least rotation of a cyclic sequence of `n` elements,
/// `cmp(a, b)` comparing the elements at indices `a` and `b`. Linear: at most ~3n
/// comparisons, however often the elements repeat (the minimum-expression two-pointer scan).
/// Comparing every candidate start with the best so far, as this used to, walks the whole
/// ring per candidate when a ring repeats itself (A, B, A, B, …): quadratic in a feature's
/// size, before any work budget, so one hostile feature held a scan worker for minutes.
/// Every least rotation of a periodic ring is the same sequence, so which one is returned
/// does not change the result.
fn least_rotation(n: usize, cmp: impl Fn(usize, usize) -> std::cmp::Ordering) -> usize {
    use std::cmp::Ordering;
    let (mut i, mut j, mut k) = (0usize, 1usize, 0usize);
    while i < n && j < n && k < n {
        match cmp((i + k) % n, (j + k) % n) {
            Ordering::Equal => k += 1,
            Ordering::Greater => {
                i += k + 1;
                if i == j {
                    i += 1;
                }
                k = 0;
            }
            Ordering::Less => {
                j += k + 1;
                if i == j {
                    j += 1;
                }
                k = 0;
            }
        }
    }
    i.min(j).min(n.saturating_sub(1))
}

/// Rotates `pts` (a ring without its closing point) to its lexicographically least rotation
/// (it starts at its smallest vertex). A ring that encloses no area (its points on one line)
/// has no orientation to go by: it is also turned the way round whose least rotation is the
/// smaller, so it reads the same whichever way it was written (Koop's Esri rings reversed such
/// rings of Chicago's layer, and each was announced as `geometry_changed`).
fn least_form<T: Copy, K: Ord>(pts: &mut Vec<T>, no_area: bool, key: impl Fn(&T) -> K) {
    let n = pts.len();
    let start = least_rotation(n, |a, b| key(&pts[a]).cmp(&key(&pts[b])));
    pts.rotate_left(start);
    if no_area {
        let mut reversed: Vec<T> = pts.iter().rev().copied().collect();
        let start = least_rotation(n, |a, b| key(&reversed[a]).cmp(&key(&reversed[b])));
        reversed.rotate_left(start);
        if reversed.iter().map(&key).lt(pts.iter().map(&key)) {
            *pts = reversed;
        }
    }
}

/// Twice a ring's signed area (positive: counter-clockwise) on its vertices rounded as the
/// hash rounds them, in exact integers: the same, negated, whichever way round and from
/// whichever start the ring is written (for any coordinates a place on Earth has; far past
/// them the sum saturates, and then depends on the order). A float sum's rounding depends on the order of its
/// terms, so a ring almost without area could read as flat one way round and not the other
/// (a reader).
fn twice_area_rounded<T>(pts: &[T], xy: impl Fn(&T) -> (i64, i64)) -> i128 {
    // Each vertex rounded once (this runs on every ring of every feature), the last one
    // paired with the first.
    let Some(first) = pts.first().map(&xy) else { return 0 };
    let mut previous = first;
    let mut sum = 0i128;
    for (x2, y2) in pts[1..].iter().map(&xy).chain(std::iter::once(first)) {
        let (x1, y1) = previous;
        // Saturating: coordinates far past any on Earth (rounding saturates at i64) must not
        // overflow the sum.
        sum = sum.saturating_add(x1 as i128 * y2 as i128 - x2 as i128 * y1 as i128);
        previous = (x2, y2);
    }
    sum
}

fn canon_ring(ring: &LineString<f64>, want_ccw: bool) -> Ring {
    let mut pts: Ring = Vec::with_capacity(ring.0.len());
    for c in &ring.0 {
        let p = (round(c.x), round(c.y));
        if pts.last() != Some(&p) {
            pts.push(p);
        }
    }
    while pts.len() > 1 && pts.first() == pts.last() {
        pts.pop();
    }
    if pts.len() < 3 {
        return pts;
    }
    let twice_area = twice_area_rounded(&pts, |p| *p);
    if (twice_area > 0) != want_ccw && twice_area != 0 {
        pts.reverse();
    }
    least_form(&mut pts, twice_area == 0, |p| *p);
    pts
}

/// The same (multi)polygon with its rings in a canonical order, on the exact coordinates:
/// each ring starts at its smallest vertex, exteriors run counter-clockwise and holes
/// clockwise, holes and polygons are sorted. Used before geometry repair so that the same
/// shape, however it was written, is always repaired the same way. Works in place: it runs
/// on every feature of a layer.
pub fn canonical_order(mp: MultiPolygon<f64>) -> MultiPolygon<f64> {
    use geo::{Coord, Polygon};
    fn key(c: &Coord<f64>) -> (u64, u64) {
        // Total order on finite floats, as integers.
        let f = |v: f64| {
            let b = v.to_bits();
            if b >> 63 == 1 { !b } else { b | (1 << 63) }
        };
        (f(c.x), f(c.y))
    }
    fn ring(mut r: LineString<f64>, want_ccw: bool) -> LineString<f64> {
        // The ring without its closing point(s); fewer than 3 left: returned as it came.
        let mut n = r.0.len();
        while n > 1 && r.0.first() == r.0.get(n - 1) {
            n -= 1;
        }
        if n < 3 {
            return r;
        }
        let pts = &mut r.0;
        pts.truncate(n);
        let twice = twice_area_rounded(pts, |c| (round(c.x), round(c.y)));
        if (twice > 0) != want_ccw && twice != 0 {
            pts.reverse();
        }
        least_form(pts, twice == 0, key);
        pts.push(pts[0]);
        r
    }
    // Lexicographic order of the rings' vertex keys (what sorting by a key vector gave,
    // without building one per comparison).
    let ring_order = |a: &LineString<f64>, b: &LineString<f64>| a.0.iter().map(key).cmp(b.0.iter().map(key));
    let mut polys: Vec<Polygon<f64>> = mp
        .0
        .into_iter()
        .map(|p| {
            let (exterior, interiors) = p.into_inner();
            let mut holes: Vec<LineString<f64>> = interiors.into_iter().map(|h| ring(h, false)).collect();
            holes.sort_by(ring_order);
            Polygon::new(ring(exterior, true), holes)
        })
        .collect();
    polys.sort_by(|a, b| ring_order(a.exterior(), b.exterior()));
    MultiPolygon::new(polys)
}

/// The canonical form of a (multi)polygon: sorted polygons of [exterior, sorted holes...].
pub fn canonical_form(mp: &MultiPolygon<f64>) -> Vec<Vec<Ring>> {
    let mut polys: Vec<Vec<Ring>> = mp
        .0
        .iter()
        .map(|p| {
            let mut holes: Vec<Ring> = p.interiors().iter().map(|r| canon_ring(r, false)).collect();
            holes.sort();
            let mut rings = vec![canon_ring(p.exterior(), true)];
            rings.extend(holes);
            rings
        })
        .collect();
    polys.sort();
    polys
}

/// sha256 of the canonical geometry.
pub fn geometry_hash(mp: &MultiPolygon<f64>) -> [u8; 32] {
    let mut h = Sha256::new();
    for poly in canonical_form(mp) {
        h.update(b"P");
        for ring in poly {
            h.update(b"R");
            h.update((ring.len() as u64).to_le_bytes());
            for (x, y) in ring {
                h.update(x.to_le_bytes());
                h.update(y.to_le_bytes());
            }
        }
    }
    h.finalize().into()
}

/// Whether two (multi)polygons are one shape but for the 1e-7° rounding the hash makes: the
/// same canonical rings, vertex for vertex, each coordinate at most one grid step from the
/// other's. A layer written out again with fewer decimals (8 is a common tool default) puts
/// about one coordinate in twenty on the other side of a step, and most parcels' hashes move
/// (a reviewer); this tells such a parcel from one whose shape changed. A near tie in the
/// canonical order (two vertices of a ring, or two rings, within a step of each other) can
/// make a rounded shape read as changed, never the other way round.
pub fn same_but_for_rounding(a: &MultiPolygon<f64>, b: &MultiPolygon<f64>) -> bool {
    let (a, b) = (canonical_form(a), canonical_form(b));
    let close = |p: &(i64, i64), q: &(i64, i64)| p.0.abs_diff(q.0) <= 1 && p.1.abs_diff(q.1) <= 1;
    let same_ring = |r: &Ring, s: &Ring| r.len() == s.len() && r.iter().zip(s).all(|(p, q)| close(p, q));
    a.len() == b.len() && a.iter().zip(&b).all(|(pa, pb)| pa.len() == pb.len() && pa.iter().zip(pb).all(|(r, s)| same_ring(r, s)))
}

/// Case- and space-insensitive form of a zoning code, used for comparison and keys.
pub fn normalize_code(code: &str) -> String {
    code.trim().to_uppercase()
}

/// sha256 over the normalised zoning code, effective date and geometry hash.
pub fn content_hash(zoning: &str, effective_date: Option<&str>, geom_hash: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(normalize_code(zoning).as_bytes());
    h.update([0x1f]);
    h.update(effective_date.map(str::trim).unwrap_or("").as_bytes());
    h.update([0x1f]);
    h.update(geom_hash);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A square written again at 8 decimals is the same shape but for rounding; moved by two
    /// grid steps, or with a vertex more, it is not.
    #[test]
    fn a_shape_rounded_again_is_told_from_a_moved_one() {
        let square = |x: f64, y: f64, s: f64| MultiPolygon::new(vec![geo::Polygon::new(LineString::from(vec![(x, y), (x + s, y), (x + s, y + s), (x, y + s), (x, y)]), vec![])]);
        let eight = |v: f64| (v * 1e8).round() / 1e8;
        let a = square(-71.123_456_749_99, 42.345_678_950_01, 0.000_9);
        let b = square(eight(-71.123_456_749_99), eight(42.345_678_950_01), eight(0.000_9));
        assert_ne!(geometry_hash(&a), geometry_hash(&b), "the rounding moved the hash");
        assert!(same_but_for_rounding(&a, &b));
        assert!(!same_but_for_rounding(&a, &square(-71.123_456_549_99, 42.345_678_950_01, 0.000_9)), "two steps west");
        let mut more = a.clone();
        more.0[0].exterior_mut(|r| r.0.insert(1, geo::coord! { x: -71.123_456_3, y: 42.345_678_950_01 }));
        assert!(!same_but_for_rounding(&a, &more));
    }
    use geo::{polygon, MultiPolygon};

    /// The least rotation, against every rotation compared by brute force, on short sequences
    /// over small alphabets (many repeats, periodic ones included); and its work stays linear
    /// on the ring that made the old search quadratic.
    #[test]
    fn least_rotation_is_the_least_and_linear() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let n = 1 + (next() % 12) as usize;
            let alphabet = 1 + next() % 3;
            let s: Vec<u64> = (0..n).map(|_| next() % alphabet).collect();
            let rot = |i: usize| (0..n).map(|k| s[(i + k) % n]).collect::<Vec<_>>();
            let best = (0..n).map(rot).min().unwrap();
            let got = least_rotation(n, |a, b| s[a].cmp(&s[b]));
            assert!(got < n, "{s:?}");
            assert_eq!(rot(got), best, "{s:?}");
        }
        assert_eq!(least_rotation(0, |_, _| unreachable!()), 0);
        for n in [80_000usize, 80_001] {
            let calls = std::cell::Cell::new(0u64);
            least_rotation(n, |a, b| {
                calls.set(calls.get() + 1);
                (a % 2).cmp(&(b % 2))
            });
            assert!(calls.get() <= 3 * n as u64, "{n}: {} comparisons", calls.get());
        }
    }

    /// A ring that repeats itself (A, B, A, B, …), or encloses no area, is put in order and
    /// hashed as any other: the same shape from any start, in either direction.
    #[test]
    fn a_repeating_or_flat_ring_orders_and_hashes_the_same_from_any_start() {
        use geo::{Coord, LineString, Polygon};
        let repeating: Vec<(f64, f64)> = vec![(0.0, 0.0), (2.0, 0.0), (2.0, 1.0), (0.0, 0.0), (2.0, 0.0), (2.0, 1.0), (1.0, 3.0)];
        let flat: Vec<(f64, f64)> = vec![(0.0, 0.0), (3.0, 0.0), (1.0, 0.0), (5.0, 0.0), (2.0, 0.0)];
        let flat_repeating: Vec<(f64, f64)> = vec![(0.0, 0.0), (3.0, 0.0), (0.0, 0.0), (3.0, 0.0), (1.0, 0.0)];
        // Flat once rounded as the hash rounds, not quite in floats, on a diagonal.
        let near_flat: Vec<(f64, f64)> = vec![(0.1, 0.1), (0.3, 0.30000000000000004), (0.7, 0.7000000000000001), (0.2, 0.2), (0.9, 0.9)];
        for pts in [repeating, flat, flat_repeating, near_flat] {
            let ring_from = |start: usize, rev: bool| {
                let mut v: Vec<(f64, f64)> = (0..pts.len()).map(|k| pts[(start + k) % pts.len()]).collect();
                if rev {
                    v.reverse();
                }
                v.push(v[0]);
                MultiPolygon::new(vec![Polygon::new(LineString::new(v.into_iter().map(|(x, y)| Coord { x, y }).collect()), vec![])])
            };
            let want_hash = geometry_hash(&ring_from(0, false));
            let want_order = canonical_order(ring_from(0, false));
            for start in 0..pts.len() {
                for rev in [false, true] {
                    assert_eq!(geometry_hash(&ring_from(start, rev)), want_hash, "start {start}, reversed {rev}");
                    assert_eq!(canonical_order(ring_from(start, rev)), want_order, "start {start}, reversed {rev}");
                }
            }
        }
    }

    #[test]
    fn rotation_orientation_and_float_noise_do_not_change_the_hash() {
        let a = polygon![(x: 0.0, y: 0.0), (x: 1.0, y: 0.0), (x: 1.0, y: 1.0), (x: 0.0, y: 1.0)];
        // Same ring, clockwise, starting elsewhere, with 1e-12 noise.
        let b = polygon![(x: 1.0, y: 1.0 + 1e-12), (x: 1.0, y: 0.0), (x: 0.0, y: 0.0), (x: 0.0, y: 1.0)];
        assert_eq!(geometry_hash(&MultiPolygon::new(vec![a.clone()])), geometry_hash(&MultiPolygon::new(vec![b])));
        let moved = polygon![(x: 0.0, y: 0.0), (x: 1.0, y: 0.0), (x: 1.0, y: 1.001), (x: 0.0, y: 1.0)];
        assert_ne!(geometry_hash(&MultiPolygon::new(vec![a])), geometry_hash(&MultiPolygon::new(vec![moved])));
    }

    #[test]
    fn codes_compare_case_insensitively() {
        let g = [0u8; 32];
        assert_eq!(content_hash(" r-1 ", None, &g), content_hash("R-1", None, &g));
        assert_ne!(content_hash("R-1", None, &g), content_hash("R-2", None, &g));
        assert_ne!(content_hash("R-1", Some("2024-01-01"), &g), content_hash("R-1", None, &g));
    }
}
