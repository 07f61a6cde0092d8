//! `detect/`: from two versions of a layer to the changes that matter.
//!
//! * [`canonical`] hashes a parcel so that re-publishes (reordered, reformatted, rotated
//!   rings) hash the same;
//! * [`diff`] compares a new layer with the stored snapshot and emits [`crate::model::ChangeEvent`]s;
//! * [`stream`] is the streaming diff of a whole layer (normalise, look up, classify, spill);
//! * [`unidentified`] keeps a stored parcel that lies under a feature quarantined without
//!   an id from being taken for removed;
//! * [`spill`] keeps a run's delta on disk between the streaming diff and the commit;
//! * [`derived_delta`] does the same for a derived (district / overlay) run;
//! * [`row_sort`] puts a run's snapshot rows in key order for the commit (redb inserts them
//!   several times faster so, and they fill the snapshot's blocks a block at a time);
//! * [`gate`] decides whether a run's events may be published (baseline, reprocess, holds);
//! * [`severity`] ranks a change;
//! * [`overlay`] derives a parcel's zoning from district polygons (largest share, R-tree);
//! * [`area`] compares two versions of a district layer by area (area mode): which regions
//!   changed code, with a noise filter.

pub mod canonical;
pub mod diff;
pub mod gate;
pub mod area;
pub mod overlay;
pub mod severity;
pub mod row_sort;
pub mod spill;
pub mod derived_delta;
pub mod stream;
pub mod unidentified;
