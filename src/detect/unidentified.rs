//! Features quarantined without a parcel id, and the stored parcels they may be.
//!
//! A feature whose id field is missing (or whose properties cannot be read) cannot be
//! matched to a stored parcel by id. Its stored parcel, unseen, would otherwise look removed,
//! and its subscribers would be told a parcel vanished because one feature of the layer was
//! damaged. A quarantined feature with an id already keeps its parcel's stored state; this
//! does the same, by place, for one without: a stored parcel missing from the layer whose
//! bounding rectangle and the feature's are nearly the same one (each covers at least half
//! of the other) is withheld from the removals (kept as stored, no event) and the run says
//! so. A large id-less polygon (a road right-of-way, water, a common area: county layers
//! carry them in every version) covers parcels' rectangles but is not nearly the same as
//! any, so it never withholds their removals. A parcel that really went under a feature of
//! its own size is removed by the next layer without that feature.
//!
//! The footprints kept are capped at [`MAX_FOOTPRINTS`] (32 bytes each); past the cap a
//! feature counts as one that cannot be placed: it withholds nothing and the run says so.

use crate::model::Envelope;
use rstar::primitives::Rectangle;
use rstar::{RTree, AABB};

/// The most unidentified features whose footprints are kept: 32 bytes each, 3 MiB.
pub const MAX_FOOTPRINTS: usize = 100_000;

/// How many unidentified features' indexes a warning names.
const NAMED: usize = 5;

/// The unidentified features of one scan, gathered as they are quarantined.
#[derive(Debug, Default)]
pub struct Unidentified {
    /// Where the located ones lie (up to [`MAX_FOOTPRINTS`]).
    footprints: Vec<Envelope>,
    /// Located ones past the cap.
    overflow: u64,
    /// Located ones, kept or not.
    located: u64,
    /// Ones with no readable geometry: they cannot be placed.
    unlocated: u64,
    /// The first few feature indexes, for the warning.
    first: Vec<u64>,
    /// Copies of ids the layer repeats whose footprints are kept beside these ([`Unidentified::add_copy`]).
    copies: u64,
}

/// The footprints of a scan's unidentified features, indexed for the removal walk.
pub struct Footprints {
    tree: RTree<Rectangle<[f64; 2]>>,
}

impl Unidentified {
    /// Notes one feature quarantined without an id, with its footprint if it has one.
    pub fn add(&mut self, feature_index: u64, footprint: Option<Envelope>) {
        if self.first.len() < NAMED {
            self.first.push(feature_index);
        }
        self.located += u64::from(footprint.is_some());
        match footprint {
            Some(e) if self.footprints.len() < MAX_FOOTPRINTS => self.footprints.push(e),
            Some(_) => self.overflow += 1,
            None => self.unlocated += 1,
        }
    }

    /// Notes the footprint of a copy of an id the layer repeats (quarantined `duplicate_id`):
    /// it may stand for a stored parcel the layer wrote under that id, as a feature without an
    /// id may (a copy equal to its id's stored parcel is not spilled, and is not noted). Within
    /// the same cap; past it, it is left out, without a warning of its own.
    pub fn add_copy(&mut self, footprint: Envelope) {
        if self.footprints.len() < MAX_FOOTPRINTS {
            self.footprints.push(footprint);
            self.copies += 1;
        }
    }

    /// The footprints to check the removals against; `None` when no unidentified feature
    /// could be placed (removals go ahead as they are).
    pub fn footprints(&mut self) -> Option<Footprints> {
        if self.footprints.is_empty() {
            return None;
        }
        let rects = std::mem::take(&mut self.footprints).into_iter().map(|(lo, hi)| Rectangle::from_corners(lo, hi)).collect();
        Some(Footprints { tree: RTree::bulk_load(rects) })
    }

    /// The run's warnings: the parcels withheld from removal, and unidentified features that
    /// could not be placed (no readable geometry, or past the cap) when the run removes
    /// parcels (one of those features may be one of them).
    pub fn warnings(&self, withheld: &[String], removed: usize) -> Vec<String> {
        let mut out = Vec::new();
        let total = self.located + self.unlocated;
        let more = if total > self.first.len() as u64 { ", …" } else { "" };
        let positions: Vec<String> = self.first.iter().map(u64::to_string).collect();
        let named = format!("features at positions {}{more} of the layer, counting from 0", positions.join(", "));
        if !withheld.is_empty() {
            let names: Vec<String> = withheld.iter().take(NAMED).map(|id| format!("{id:?}")).collect();
            let more = if withheld.len() > NAMED { ", …" } else { "" };
            let mut lies = Vec::new();
            if self.located > self.overflow {
                lies.push(format!("a feature without a parcel id of its size lies ({} such feature(s) placed; {named})", self.located - self.overflow));
            }
            if self.copies > 0 {
                lies.push(format!("a copy of a parcel id the layer repeats lies ({} such copies placed)", self.copies));
            }
            out.push(format!(
                "{} stored parcel(s) missing from the layer were kept, not removed ({}{more}): each lies where {}; a later layer without such a feature removes them if they are gone",
                withheld.len(),
                names.join(", "),
                lies.join(", or where "),
            ));
        }
        let unplaced = self.unlocated + self.overflow;
        if unplaced > 0 && removed > 0 {
            let why = match (self.unlocated, self.overflow) {
                (0, n) => format!("{n} feature(s) without a parcel id past the {MAX_FOOTPRINTS} this run places"),
                (n, 0) => format!("{n} feature(s) without a parcel id or a readable geometry"),
                (n, m) => format!("{n} feature(s) without a parcel id or a readable geometry and {m} past the {MAX_FOOTPRINTS} this run places"),
            };
            out.push(format!("{why} ({named}): {removed} parcel(s) were removed, and one of those features may be one of them"));
        }
        out
    }
}

impl Footprints {
    /// Whether a stored parcel with this envelope lies where one footprint lies, nearly the
    /// same rectangle: their overlap is at least half of each. (Degenerate rectangles, a
    /// line or a point: when they touch and the other is degenerate too.)
    pub fn cover(&self, parcel: Envelope) -> bool {
        let (lo, hi) = parcel;
        let area = (hi[0] - lo[0]) * (hi[1] - lo[1]);
        self.tree.locate_in_envelope_intersecting(AABB::from_corners(lo, hi)).any(|r| {
            let (flo, fhi) = (r.lower(), r.upper());
            let footprint = (fhi[0] - flo[0]) * (fhi[1] - flo[1]);
            let w = hi[0].min(fhi[0]) - lo[0].max(flo[0]);
            let h = hi[1].min(fhi[1]) - lo[1].max(flo[1]);
            if area > 0.0 && footprint > 0.0 {
                let overlap = w.max(0.0) * h.max(0.0);
                overlap * 2.0 >= area && overlap * 2.0 >= footprint
            } else {
                area <= 0.0 && footprint <= 0.0 && w >= 0.0 && h >= 0.0
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(x0: f64, y0: f64, x1: f64, y1: f64) -> Envelope {
        ([x0, y0], [x1, y1])
    }

    #[test]
    fn a_parcel_mostly_under_a_footprint_is_covered_and_its_neighbours_are_not() {
        let mut u = Unidentified::default();
        u.add(3, Some(env(0.0, 0.0, 1.0, 1.0)));
        let f = u.footprints().expect("one footprint");
        // The same lot, drawn a little differently.
        assert!(f.cover(env(0.05, 0.0, 1.0, 1.02)));
        // A small lot inside it: not the same parcel (a large id-less polygon, a road or
        // a common area, must not keep every lot under it from being removed).
        assert!(!f.cover(env(0.2, 0.2, 0.4, 0.4)));
        // A lot twice its size around it: not the same either.
        assert!(!f.cover(env(-0.5, -0.5, 1.5, 1.5)));
        // The neighbour sharing an edge, and one overlapping a tenth of its area.
        assert!(!f.cover(env(1.0, 0.0, 2.0, 1.0)));
        assert!(!f.cover(env(0.9, 0.0, 1.9, 1.0)));
        // Far away.
        assert!(!f.cover(env(5.0, 5.0, 6.0, 6.0)));
        // A degenerate envelope touching it: not the same shape.
        assert!(!f.cover(env(1.0, 0.5, 1.0, 0.5)));
    }

    #[test]
    fn what_cannot_be_placed_withholds_nothing_and_is_named() {
        let mut none = Unidentified::default();
        none.add(0, None);
        assert!(none.footprints().is_none());
        let w = none.warnings(&[], 2);
        assert!(w.len() == 1 && w[0].contains("1 feature(s) without a parcel id or a readable geometry") && w[0].contains("positions 0 of the layer"), "{w:?}");
        assert!(none.warnings(&[], 0).is_empty(), "named only when parcels were removed");

        // Past the cap, features are not placed: they withhold nothing, and are named.
        let mut many = Unidentified::default();
        for i in 0..=MAX_FOOTPRINTS as u64 {
            many.add(i, Some(env(i as f64, 0.0, i as f64 + 0.5, 0.5)));
        }
        let f = many.footprints().expect("footprints");
        assert!(f.cover(env(7.0, 0.0, 7.5, 0.5)), "one within the cap still holds its parcel");
        assert!(!f.cover(env(MAX_FOOTPRINTS as f64, 0.0, MAX_FOOTPRINTS as f64 + 0.5, 0.5)), "the one past it does not");
        let w = many.warnings(&[], 3);
        assert!(w[0].contains("1 feature(s) without a parcel id past the 100000 this run places"), "{w:?}");
    }
}
