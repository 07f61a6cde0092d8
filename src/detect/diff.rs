//! Snapshot diff: the new layer against the stored parcel states of the same source.
//!
//! Equal content hashes mean "no change", whatever the feature order or number formatting.
//! A parcel whose zoning code differs (case-insensitively) is `rezoned`; same code but a
//! different canonical shape is `geometry_changed`; new and vanished ids are `added` and
//! `removed`. An effective-date-only difference updates the snapshot without an event: no
//! event is ever emitted whose old and new code are equal and whose shape is unchanged.
//! Parcels that were quarantined this run (their id known) are neither updated nor removed:
//! a feature we could not read is not evidence that the parcel is gone.

use super::canonical::normalize_code;
use crate::model::{ChangeKind, Parcel, ParcelState};
use std::collections::{HashMap, HashSet};

/// A change before geometries and severity are attached.
#[derive(Debug, Clone, PartialEq)]
pub struct RawChange {
    pub parcel_id: String,
    pub kind: ChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    /// Index into `DiffResult::upserts` of the new parcel (None for removals).
    pub new_index: Option<usize>,
}

/// What the snapshot must become, and the changes that describe it.
#[derive(Debug, Default)]
pub struct DiffResult {
    /// New or changed parcels (including effective-date-only changes).
    pub upserts: Vec<Parcel>,
    pub removals: Vec<String>,
    pub changes: Vec<RawChange>,
}

/// How one new parcel relates to its stored state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParcelDelta {
    /// Same content hash: nothing to write, nothing to say.
    Unchanged,
    /// Not in the snapshot.
    Added,
    /// Different content: the snapshot is updated; `Some(kind)` when it is a change worth an
    /// event (`None`: an effective-date-only difference).
    Changed(Option<ChangeKind>),
}

/// Classifies one new parcel state against its stored state (the rule of the module doc).
pub fn classify(prev: Option<&ParcelState>, new: &ParcelState) -> ParcelDelta {
    match prev {
        None => ParcelDelta::Added,
        Some(prev) if prev.content_hash == new.content_hash => ParcelDelta::Unchanged,
        Some(prev) => ParcelDelta::Changed(if normalize_code(&prev.zoning) != normalize_code(&new.zoning) {
            Some(ChangeKind::Rezoned)
        } else if prev.geom_hash != new.geom_hash {
            Some(ChangeKind::GeometryChanged)
        } else {
            None
        }),
    }
}

/// Compares `new` parcels with the `old` snapshot. `untouchable` ids (quarantined this run)
/// are left as they are. (The pipeline streams county-sized layers through [`classify`]
/// instead; this in-memory form serves derived layers and tests.)
pub fn diff(old: &HashMap<String, ParcelState>, new: Vec<Parcel>, untouchable: &HashSet<String>) -> DiffResult {
    let mut out = DiffResult::default();
    let mut seen: HashSet<String> = HashSet::with_capacity(new.len());
    for parcel in new {
        seen.insert(parcel.id.clone());
        let prev = old.get(&parcel.id);
        let kind = match classify(prev, &parcel.state) {
            ParcelDelta::Unchanged => continue,
            ParcelDelta::Added => Some(ChangeKind::Added),
            ParcelDelta::Changed(kind) => kind,
        };
        if let Some(kind) = kind {
            out.changes.push(RawChange {
                parcel_id: parcel.id.clone(),
                kind,
                from: prev.map(|p| p.zoning.clone()),
                to: Some(parcel.state.zoning.clone()),
                new_index: Some(out.upserts.len()),
            });
        }
        out.upserts.push(parcel);
    }
    let mut removed: Vec<(&String, &ParcelState)> = old
        .iter()
        .filter(|(id, _)| !seen.contains(*id) && !untouchable.contains(*id))
        .collect();
    removed.sort_by(|a, b| a.0.cmp(b.0));
    for (id, prev) in removed {
        out.removals.push(id.clone());
        out.changes.push(RawChange {
            parcel_id: id.clone(),
            kind: ChangeKind::Removed,
            from: Some(prev.zoning.clone()),
            to: None,
            new_index: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::canonical::content_hash;
    use crate::model::StoredGeometry;

    fn parcel(id: &str, zoning: &str, geom: u8) -> Parcel {
        let gh = [geom; 32];
        Parcel {
            id: id.into(),
            state: ParcelState {
                zoning: zoning.into(),
                effective_date: None,
                content_hash: content_hash(zoning, None, &gh),
                geom_hash: gh,
                area_m2: 1.0,
            },
            geometry: StoredGeometry::default(),
        }
    }

    #[test]
    fn kinds_and_quarantine_protection() {
        let old: HashMap<String, ParcelState> = [
            parcel("a", "R-1", 1),
            parcel("b", "R-1", 1),
            parcel("c", "R-1", 1),
            parcel("d", "R-1", 1),
            parcel("q", "R-1", 1),
        ]
        .into_iter()
        .map(|p| (p.id.clone(), p.state))
        .collect();
        let new = vec![parcel("a", "r-1", 1), parcel("b", "C-2", 1), parcel("c", "R-1", 2), parcel("e", "R-1", 1)];
        let untouchable: HashSet<String> = ["q".to_string()].into();
        let d = diff(&old, new, &untouchable);
        let kinds: Vec<(&str, ChangeKind)> = d.changes.iter().map(|c| (c.parcel_id.as_str(), c.kind)).collect();
        assert_eq!(
            kinds,
            vec![("b", ChangeKind::Rezoned), ("c", ChangeKind::GeometryChanged), ("e", ChangeKind::Added), ("d", ChangeKind::Removed)]
        );
        assert_eq!(d.removals, vec!["d".to_string()]);
        assert_eq!(d.upserts.len(), 3);
    }
}
