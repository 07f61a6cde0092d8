//! Features quarantined without a parcel id, and the stored parcels they may be.
//!
//! A feature whose id field is missing (or whose properties cannot be read) cannot be
//! matched to a stored parcel by id. Its stored parcel, unseen, would otherwise look removed,
//! and its subscribers would be told a parcel vanished because one feature of the layer was
//! damaged. A quarantined feature with an id already keeps its parcel's stored state; this
//! does the same, by place, for one without: a stored parcel lying mostly under such a
//! feature's bounding rectangle is withheld from the removals (kept as stored, no event) and
//! the run says so. A parcel that really went is removed by the next layer that has no
//! unidentified feature over it.
//!
//! Memory is bounded: past [`MAX_FOOTPRINTS`] unidentified features (a renamed id field, which
//! the gate's quarantine-spike hold catches anyway), the layer cannot say where its parcels
//! are, and every removal of the run is withheld.

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
}

/// The footprints of a scan's unidentified features, indexed for the removal walk.
pub struct Footprints {
    tree: RTree<Rectangle<[f64; 2]>>,
    /// Too many to keep: every stored parcel counts as covered.
    everywhere: bool,
}

impl Unidentified {
    /// Notes one feature quarantined without an id, with its footprint if it has one.
    pub fn add(&mut self, feature_index: u64, footprint: Option<Envelope>) {
        if self.first.len() < NAMED {
            self.first.push(feature_index);
        }
        self.located += u64::from(footprint.is_some());
        match footprint {
            Some(_) if self.footprints.len() >= MAX_FOOTPRINTS => self.overflow += 1,
            Some(e) => self.footprints.push(e),
            None => self.unlocated += 1,
        }
    }

    /// The footprints to check the removals against; `None` when no unidentified feature
    /// could be placed (removals go ahead as they are).
    pub fn footprints(&mut self) -> Option<Footprints> {
        if self.footprints.is_empty() && self.overflow == 0 {
            return None;
        }
        let rects = std::mem::take(&mut self.footprints).into_iter().map(|(lo, hi)| Rectangle::from_corners(lo, hi)).collect();
        Some(Footprints { tree: RTree::bulk_load(rects), everywhere: self.overflow > 0 })
    }

    /// The run's warnings: the parcels withheld from removal, and unidentified features that
    /// could not be placed when the run removes parcels (one of those may be one of them).
    pub fn warnings(&self, withheld: &[String], removed: usize) -> Vec<String> {
        let mut out = Vec::new();
        let features = || {
            let more = if self.total() > self.first.len() as u64 { ", …" } else { "" };
            let list: Vec<String> = self.first.iter().map(u64::to_string).collect();
            format!("{} feature(s) without a parcel id (features {}{more})", self.total(), list.join(", "))
        };
        if !withheld.is_empty() {
            let names: Vec<String> = withheld.iter().take(NAMED).map(|id| format!("{id:?}")).collect();
            let more = if withheld.len() > NAMED { ", …" } else { "" };
            let why = if self.overflow > 0 {
                format!("more than {MAX_FOOTPRINTS} features have no parcel id, so none of the layer's removals can be trusted")
            } else {
                format!("they lie under {}", features())
            };
            out.push(format!(
                "{} stored parcel(s) missing from the layer were kept, not removed ({}{more}): {why}; a later layer without such features removes them if they are gone",
                withheld.len(),
                names.join(", ")
            ));
        }
        if self.unlocated > 0 && removed > 0 {
            out.push(format!(
                "{} without a readable geometry: {removed} parcel(s) were removed, and one of those features may be one of them",
                features()
            ));
        }
        out
    }

    fn total(&self) -> u64 {
        self.located + self.unlocated
    }
}

impl Footprints {
    /// Whether a stored parcel with this envelope lies mostly (half its envelope's area or
    /// more) under one footprint; a degenerate envelope (a line or a point), whether it
    /// touches one.
    pub fn cover(&self, parcel: Envelope) -> bool {
        if self.everywhere {
            return true;
        }
        let (lo, hi) = parcel;
        let area = (hi[0] - lo[0]) * (hi[1] - lo[1]);
        self.tree.locate_in_envelope_intersecting(AABB::from_corners(lo, hi)).any(|r| {
            let (flo, fhi) = (r.lower(), r.upper());
            let w = hi[0].min(fhi[0]) - lo[0].max(flo[0]);
            let h = hi[1].min(fhi[1]) - lo[1].max(flo[1]);
            if area > 0.0 {
                w * h * 2.0 >= area
            } else {
                w >= 0.0 && h >= 0.0
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
        // A lot merged into the footprint's larger one.
        assert!(f.cover(env(0.2, 0.2, 0.4, 0.4)));
        // The neighbour sharing an edge, and one overlapping a tenth of its area.
        assert!(!f.cover(env(1.0, 0.0, 2.0, 1.0)));
        assert!(!f.cover(env(0.9, 0.0, 1.9, 1.0)));
        // Far away.
        assert!(!f.cover(env(5.0, 5.0, 6.0, 6.0)));
        // A degenerate envelope touching it.
        assert!(f.cover(env(1.0, 0.5, 1.0, 0.5)));
    }

    #[test]
    fn nothing_placed_means_nothing_withheld_and_too_many_means_everything() {
        let mut none = Unidentified::default();
        none.add(0, None);
        assert!(none.footprints().is_none());
        assert_eq!(none.warnings(&[], 2).len(), 1, "unplaceable features are named when parcels were removed");
        assert!(none.warnings(&[], 0).is_empty());

        let mut many = Unidentified::default();
        for i in 0..=MAX_FOOTPRINTS as u64 {
            many.add(i, Some(env(0.0, 0.0, 1e-6, 1e-6)));
        }
        let f = many.footprints().expect("footprints");
        assert!(f.cover(env(50.0, 50.0, 51.0, 51.0)));
        let w = many.warnings(&["a".into()], 0);
        assert!(w[0].contains("none of the layer's removals can be trusted"), "{w:?}");
    }
}
