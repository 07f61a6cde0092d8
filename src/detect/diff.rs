//! Snapshot diff: the new layer against the stored parcel states of the same source.
//!
//! Equal content hashes mean "no change", whatever the feature order or number formatting.
//! A parcel whose zoning code differs (case-insensitively) is `rezoned`; same code but a
//! different canonical shape is `geometry_changed` (the streaming diff of a parcel layer first
//! reads the stored shape of such a parcel: one the same but for the 1e-7° rounding is not a
//! change, and the stored shape stands, `stream.rs` `rounded_again`); new and vanished ids are `added` and
//! `removed`. An effective-date-only difference updates the snapshot without an event: no
//! event is ever emitted whose old and new code are equal and whose shape is unchanged.
//! Parcels that were quarantined this run (their id known) are neither updated nor removed:
//! a feature we could not read is not evidence that the parcel is gone.

use super::canonical::normalize_code;
use crate::model::{Announced, ChangeKind, Parcel, ParcelState, ABSENT_CONTENT};
use crate::store::{StoreError, Tombstone};
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
    /// The revision the change's key carries ([`Step::key_revision`]).
    pub revision: u32,
}

/// What a parcel's record says before a change: its stored state's, or its tombstone's,
/// revision and last announcement (`Prior::default()`: never stored, or not within the key TTL).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prior {
    pub revision: u32,
    pub announced: Option<Announced>,
}

impl Prior {
    /// The prior of a stored state.
    pub fn of(state: &ParcelState) -> Prior {
        Prior { revision: state.revision, announced: state.announced }
    }

    /// The prior of a removed parcel, from its tombstone.
    pub fn buried(t: &Tombstone) -> Prior {
        Prior { revision: t.revision, announced: t.announced }
    }
}

/// How [`diff`] steps each change: whether the run announces it, and where a parcel not
/// stored may have left a tombstone.
pub struct Steps<'a> {
    /// Whether the run announces this change (a derived layer: only a change that alerts).
    pub announces: &'a dyn Fn(&RawChange) -> bool,
    /// The prior of a parcel the snapshot does not hold (its tombstone's, or nothing).
    pub buried: &'a dyn Fn(&str) -> Result<Prior, StoreError>,
}

#[cfg(test)]
impl Steps<'_> {
    /// Every change announced (`announce`) or none, no tombstones (tests).
    pub fn all(announce: bool) -> Steps<'static> {
        fn yes(_: &RawChange) -> bool {
            true
        }
        fn no(_: &RawChange) -> bool {
            false
        }
        fn none(_: &str) -> Result<Prior, StoreError> {
            Ok(Prior::default())
        }
        Steps { announces: if announce { &yes } else { &no }, buried: &none }
    }
}

/// One change of a parcel, as its key and its record see it (see [`step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The revision the change's idempotency key carries.
    pub key_revision: u32,
    /// The parcel's [`ParcelState::revision`] after it (a removal's tombstone keeps it).
    pub revision: u32,
    /// The parcel's [`ParcelState::announced`] after it.
    pub announced: Option<Announced>,
}

/// The key revision of a change to `content` (a state's [`content_of`], or
/// [`ABSENT_CONTENT`] for a removal) from `prior`, and what the parcel remembers after it.
///
/// The rule keeps one promise to a receiver, who deduplicates on the key: a change it has not
/// been told of has a key it has never seen, and a change to what it was last told has the
/// key that told it. So:
/// * every change carries the prior revision and moves the revision on by one, so no later
///   change of the parcel can carry a key revision an earlier one used (a key it primed
///   included) — but for one case:
/// * an announced change back to the last announced content carries that announcement's key
///   revision: after an unannounced detour (a publisher's rollback primed, a reprocess back
///   to an old version), the return is a `duplicate` of what was sent, not a second alert;
/// * an announced change (its run delivers) records what it announced; an unannounced one
///   (a baseline, a reprocess, a primed hold, an effective-date-only update that has no
///   event) leaves the last announcement as it was: the receiver still knows what it knew.
///   A parcel going R-1 → C-2, back, and to C-2 again is told three times, under three keys;
///   told C-2, primed back to R-1 and primed to C-2 again (a rollback and its undo, both
///   held and primed), then really back to R-1, it is told that too: the primed rollback's
///   key carried an older revision.
///
/// Its key revision is the same whenever the same change is found from the same record, so
/// a change found twice (a held run released, a reprocess) has one key. A return to the
/// announced content by another way (a silent removal and then the parcel published again,
/// a silent detour through a third code) has another kind or another `from`, so another
/// key: it is told, once more than needed, never lost.
pub fn step(prior: Prior, content: [u8; 16], announce: bool) -> Step {
    let revision = prior.revision.saturating_add(1);
    if !announce {
        return Step { key_revision: prior.revision, revision, announced: prior.announced };
    }
    let key_revision = match prior.announced {
        Some(a) if a.content == content => a.key_revision,
        _ => prior.revision,
    };
    Step { key_revision, revision, announced: Some(Announced { content, key_revision }) }
}

/// What [`step`] compares a state by: the first half of its content hash (zoning, effective
/// date and geometry).
pub fn content_of(state: &ParcelState) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&state.content_hash[..16]);
    out
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
/// are left as they are. Each change takes a [`step`] as `steps` says (announced or not; a
/// parcel not stored from its tombstone); an effective-date-only update is never announced.
/// (The pipeline streams county-sized layers through [`classify`] and [`step`] instead; this
/// in-memory form serves derived layers and tests.)
pub fn diff(old: &HashMap<String, ParcelState>, new: Vec<Parcel>, untouchable: &HashSet<String>, steps: &Steps<'_>) -> Result<DiffResult, StoreError> {
    let mut out = DiffResult::default();
    let mut seen: HashSet<String> = HashSet::with_capacity(new.len());
    for mut parcel in new {
        seen.insert(parcel.id.clone());
        let prev = old.get(&parcel.id);
        let kind = match classify(prev, &parcel.state) {
            ParcelDelta::Unchanged => continue,
            ParcelDelta::Added => Some(ChangeKind::Added),
            ParcelDelta::Changed(kind) => kind,
        };
        let prior = match prev {
            Some(p) => Prior::of(p),
            None => (steps.buried)(&parcel.id)?,
        };
        let change = kind.map(|kind| RawChange {
            parcel_id: parcel.id.clone(),
            kind,
            from: prev.map(|p| p.zoning.clone()),
            to: Some(parcel.state.zoning.clone()),
            new_index: Some(out.upserts.len()),
            revision: 0,
        });
        let s = step(prior, content_of(&parcel.state), change.as_ref().is_some_and(|c| (steps.announces)(c)));
        (parcel.state.revision, parcel.state.announced) = (s.revision, s.announced);
        if let Some(mut change) = change {
            change.revision = s.key_revision;
            out.changes.push(change);
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
        let mut change = RawChange { parcel_id: id.clone(), kind: ChangeKind::Removed, from: Some(prev.zoning.clone()), to: None, new_index: None, revision: 0 };
        change.revision = step(Prior::of(prev), ABSENT_CONTENT, (steps.announces)(&change)).key_revision;
        out.changes.push(change);
    }
    Ok(out)
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
                revision: 0,
                announced: None,
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
        let d = diff(&old, new, &untouchable, &Steps::all(true)).unwrap();
        let kinds: Vec<(&str, ChangeKind)> = d.changes.iter().map(|c| (c.parcel_id.as_str(), c.kind)).collect();
        assert_eq!(
            kinds,
            vec![("b", ChangeKind::Rezoned), ("c", ChangeKind::GeometryChanged), ("e", ChangeKind::Added), ("d", ChangeKind::Removed)]
        );
        assert_eq!(d.removals, vec!["d".to_string()]);
        assert_eq!(d.upserts.len(), 3);
    }

    /// Plays changes through [`step`] the way runs would, from a parcel never stored, and
    /// returns the key revision of each announced one.
    fn announced_keys(changes: &[(u8, bool)]) -> Vec<u32> {
        let mut prior = Prior::default();
        let mut keys = Vec::new();
        for &(content, announce) in changes {
            let s = step(prior, [content; 16], announce);
            if announce {
                keys.push(s.key_revision);
            }
            prior = Prior { revision: s.revision, announced: s.announced };
        }
        keys
    }

    /// The receiver's promise of [`step`], case by case (content 0 is a removal).
    #[test]
    fn a_change_has_a_new_key_unless_it_returns_to_what_was_announced() {
        // Baseline R (silent, primed under 0), then R → C, C → R, R → C, all announced: three keys.
        assert_eq!(announced_keys(&[(1, false), (2, true), (1, true), (2, true)]), vec![1, 2, 3]);
        // R → C announced, back to R silently (a rollback primed), C again: the key that told
        // C, then a new one for the next real change back to R.
        assert_eq!(announced_keys(&[(1, false), (2, true), (1, false), (2, true), (1, true)]), vec![1, 1, 4]);
        // R → C announced, back to R primed (C → R under 2), the undo to C primed as well,
        // then back to R for real: told, under a revision the primed rollback did not use.
        assert_eq!(announced_keys(&[(1, false), (2, true), (1, false), (2, false), (1, true)]), vec![1, 4]);
        // A reprocess to C and back (R → C primed under 1), then C for real: a new key.
        assert_eq!(announced_keys(&[(1, false), (2, false), (1, false), (2, true)]), vec![3]);
        // Removed, added back, removed, added back (announced): four keys.
        assert_eq!(announced_keys(&[(1, false), (0, true), (1, true), (0, true), (1, true)]), vec![1, 2, 3, 4]);
        // A silent detour to a third state and back, then a real change: still new.
        assert_eq!(announced_keys(&[(1, false), (2, true), (3, false), (2, false), (1, true)]), vec![1, 4]);
        // A parcel first seen by a delivering run: 0, then on.
        assert_eq!(announced_keys(&[(5, true), (6, true), (5, true)]), vec![0, 1, 2]);
    }

    /// An unannounced change moves the revision on (the key it primed is never a later
    /// change's) and keeps the last announcement; the revision never wraps.
    #[test]
    fn an_unannounced_change_keeps_the_announcement() {
        let prior = Prior { revision: 7, announced: Some(Announced { content: [3; 16], key_revision: 4 }) };
        assert_eq!(step(prior, [9; 16], false), Step { key_revision: 7, revision: 8, announced: prior.announced });
        let top = Prior { revision: u32::MAX, announced: None };
        assert_eq!(step(top, [9; 16], true).revision, u32::MAX);
    }

    /// The in-memory diff takes the same steps: every change carries the prior revision and
    /// moves it on, and only an announced run's changes are remembered as announced.
    #[test]
    fn the_diff_takes_steps() {
        let mut stored = parcel("b", "R-1", 1).state;
        stored.revision = 3;
        let old: HashMap<String, ParcelState> = [("b".to_string(), stored.clone()), ("d".to_string(), stored)].into();
        let d = diff(&old, vec![parcel("b", "C-2", 1)], &HashSet::new(), &Steps::all(true)).unwrap();
        assert_eq!(d.changes.iter().map(|c| c.revision).collect::<Vec<_>>(), vec![3, 3]);
        assert_eq!((d.upserts[0].state.revision, d.upserts[0].state.announced.map(|a| a.key_revision)), (4, Some(3)));
        let quiet = diff(&old, vec![parcel("b", "C-2", 1)], &HashSet::new(), &Steps::all(false)).unwrap();
        assert_eq!(quiet.changes.iter().map(|c| c.revision).collect::<Vec<_>>(), vec![3, 3]);
        assert_eq!((quiet.upserts[0].state.revision, quiet.upserts[0].state.announced), (4, None));
    }

    /// The diff steps a parcel it does not hold from its tombstone, and announces only the
    /// changes its caller says the run announces (a derived layer: those that alert).
    #[test]
    fn the_diff_reads_tombstones_and_announces_what_it_is_told() {
        let old: HashMap<String, ParcelState> = [("b".to_string(), parcel("b", "R-1", 1).state)].into();
        let buried = |id: &str| Ok(if id == "e" { Prior { revision: 4, announced: Some(Announced { content: ABSENT_CONTENT, key_revision: 3 }) } } else { Prior::default() });
        let only_rezonings = |c: &RawChange| c.kind == ChangeKind::Rezoned;
        let steps = Steps { announces: &only_rezonings, buried: &buried };
        let d = diff(&old, vec![parcel("b", "C-2", 1), parcel("e", "R-1", 1), parcel("f", "R-1", 1)], &HashSet::new(), &steps).unwrap();
        let by_id: HashMap<&str, (u32, Option<Announced>)> = d.upserts.iter().map(|p| (p.id.as_str(), (p.state.revision, p.state.announced))).collect();
        assert_eq!(by_id["b"], (1, Some(Announced { content: content_of(&parcel("b", "C-2", 1).state), key_revision: 0 })), "announced");
        assert_eq!(by_id["e"], (5, Some(Announced { content: ABSENT_CONTENT, key_revision: 3 })), "back from its tombstone, unannounced");
        assert_eq!(by_id["f"], (1, None), "never stored, unannounced");
        let keys: Vec<(&str, u32)> = d.changes.iter().map(|c| (c.parcel_id.as_str(), c.revision)).collect();
        assert_eq!(keys, vec![("b", 0), ("e", 4), ("f", 0)]);
        // A store error reading a tombstone fails the diff.
        let failing = |_: &str| Err(StoreError::Conflict("unreadable".into()));
        assert!(diff(&old, vec![parcel("e", "R-1", 1)], &HashSet::new(), &Steps { announces: &only_rezonings, buried: &failing }).is_err());
    }
}
