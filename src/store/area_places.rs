//! Area places: what an area-mode source (a district layer with no parcel base) remembers of
//! each place whose zoning it announced, in `area_places`, keyed by (source id, place id).
//!
//! Why it exists: an area-mode event is named by its content (`area:<hash>` of its codes and
//! its shape snapped to the tolerance grid), so a place going A → B, back to A, and to B again
//! within the key TTL gave its third change the first one's key: audited `duplicate`, never
//! sent, and the receivers left believing A. A parcel layer solves this with the revision in
//! each parcel's record (`detect::diff::step`); an area-mode source has no per-place record
//! (its snapshot is the district polygons, keyed by position), so this table is that record:
//! the place id is the hash of the snapped shape alone, and its [`PlaceState`] carries the
//! revision and the last announcement the same rule steps. Every run that is not held writes
//! its places' steps, announced or not (an unannounced step moves the revision on and keeps
//! the announcement), so the table holds a row per place the source changed within the TTL.
//!
//! A held area run stages its places' steps (`held_area_places`, by hold id); releasing the
//! hold moves them into place, priming it moves their revisions on with their announcements
//! kept ([`prime`]), superseding it drops them. Nothing else writes the
//! source's places between the held run and its resolution (any run of the source supersedes
//! the hold), so the staged steps are the ones the release would compute.
//!
//! Places overlap: a district changed alone, then together with its neighbour as one region,
//! is two places. When a region's change is announced, every other stored place whose extent
//! (bounding box) overlaps the region's forgets its announcement (its revision stays), so its next change cannot take
//! the key of a change that a later one over the same ground has since contradicted. (Extents
//! are coarse: a place merely near the region can forget too; that costs at most one alert
//! told again after a silent detour, never one lost.)
//!
//! A place is swept by a committing run of its source once it last moved (an announcement, a
//! release, a forgetting) longer ago than the key TTL: the keys it told apart have expired by
//! then.
//!
//! Record: `[1] ++ postcard(PlaceState)`.

use super::codec::{decode, encode};
use super::tables::{AREA_PLACES, HELD_AREA_PLACES};
use super::{Store, StoreError};
use crate::model::Announced;
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What an area-mode source last told its subscribers about one place.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Default)]
pub struct PlaceState {
    /// How many of the place's changes were announced (`ParcelState::revision`'s rule).
    pub revision: u32,
    /// What the last announced change said the place became, and its key revision. Cleared
    /// when a change of another place that overlaps this one is announced: what subscribers
    /// were last told about this ground is then no longer one thing.
    pub announced: Option<Announced>,
    /// When the place last moved (this machine's clock): its announcement was committed or
    /// released, or it forgot it; the sweep's age.
    pub changed_ms: u64,
    /// The place's extent, `[min x, min y, max x, max y]` in degrees, to find the places an
    /// announced region overlaps.
    pub extent: [f64; 4],
}

impl Store {
    /// The places `source_id` has announced (an area-mode source; empty for any other). A
    /// row that does not decode is left out, logged: its place starts again from revision 0,
    /// which at worst makes its next change look like one already sent (`check --store`
    /// names the row).
    pub fn area_places(&self, source_id: &str) -> Result<HashMap<String, PlaceState>, StoreError> {
        let rtx = self.db.begin_read()?;
        let table = rtx.open_table(AREA_PLACES)?;
        let mut out = HashMap::new();
        super::queries::for_each_source_row(&table, source_id, |place, bytes| {
            match decode::<PlaceState>(bytes) {
                Ok(state) => {
                    out.insert(place.to_string(), state);
                }
                Err(e) => tracing::warn!(source = source_id, place, error = %e, "area_places: a row that does not decode is ignored"),
            }
            Ok(())
        })?;
        Ok(out)
    }
}

/// Writes the places a run stepped.
pub(super) fn write(wtx: &WriteTransaction, source_id: &str, places: &[(String, PlaceState)]) -> Result<(), StoreError> {
    if places.is_empty() {
        return Ok(());
    }
    let mut table = wtx.open_table(AREA_PLACES)?;
    for (place, state) in places {
        table.insert((source_id, place.as_str()), encode(state).as_slice())?;
    }
    Ok(())
}

/// Stages the places a held run would announce, with its hold.
pub(super) fn stage(wtx: &WriteTransaction, hold_id: u64, places: &[(String, PlaceState)]) -> Result<(), StoreError> {
    if places.is_empty() {
        return Ok(());
    }
    let mut table = wtx.open_table(HELD_AREA_PLACES)?;
    for (place, state) in places {
        table.insert((hold_id, place.as_str()), encode(state).as_slice())?;
    }
    Ok(())
}

/// A hold's staged places that decode (a row that does not is left out, logged, as a live
/// one is read as absent: its place starts again, which at worst tells its next return once
/// more); what `resolution` names in the log line.
fn staged(wtx: &WriteTransaction, hold_id: u64, resolution: &str) -> Result<Vec<(String, PlaceState)>, StoreError> {
    let table = wtx.open_table(HELD_AREA_PLACES)?;
    let mut out = Vec::new();
    if table.is_empty()? {
        return Ok(out);
    }
    for item in table.range((hold_id, "")..(hold_id + 1, ""))? {
        let (k, v) = item?;
        match decode::<PlaceState>(v.value()) {
            Ok(state) => out.push((k.value().1.to_string(), state)),
            Err(e) => tracing::warn!(hold = hold_id, place = k.value().1, error = %e, "held_area_places: a row that does not decode is not {resolution}"),
        }
    }
    Ok(out)
}

/// A released hold's staged places, into `source_id`'s places (before its staged rows are
/// cleared). Their announcement time becomes the release's, when the keys are claimed.
pub(super) fn release(wtx: &WriteTransaction, hold_id: u64, source_id: &str, now_ms: u64) -> Result<(), StoreError> {
    let released: Vec<_> = staged(wtx, hold_id, "released")?.into_iter().map(|(place, state)| (place, PlaceState { changed_ms: now_ms, ..state })).collect();
    write(wtx, source_id, &released)
}

/// A primed hold's staged places, into `source_id`'s places: each moves its revision on as
/// the held run stepped it, but keeps what its subscribers were last told (the held run
/// stepped them as announced; priming announces nothing, and a place an announced region
/// made forget its announcement forgets nothing). Without it a place told A → B, primed back
/// to A and primed to B again, then really back to A, reused the primed rollback's key.
pub(super) fn prime(wtx: &WriteTransaction, hold_id: u64, source_id: &str, now_ms: u64) -> Result<(), StoreError> {
    let held = staged(wtx, hold_id, "primed")?;
    if held.is_empty() {
        return Ok(());
    }
    let mut primed = Vec::with_capacity(held.len());
    {
        let live = wtx.open_table(AREA_PLACES)?;
        for (place, staged) in held {
            let stored = live.get((source_id, place.as_str()))?.and_then(|v| decode::<PlaceState>(v.value()).ok());
            let (revision, announced) = match stored {
                Some(s) => (staged.revision.max(s.revision), s.announced),
                None => (staged.revision, None),
            };
            primed.push((place, PlaceState { revision, announced, changed_ms: now_ms, extent: staged.extent }));
        }
    }
    write(wtx, source_id, &primed)
}

/// Drops a resolved or superseded hold's staged places.
pub(super) fn clear_staged(wtx: &WriteTransaction, hold_id: u64) -> Result<(), StoreError> {
    let mut table = wtx.open_table(HELD_AREA_PLACES)?;
    if !table.is_empty()? {
        table.retain_in((hold_id, "")..(hold_id + 1, ""), |_, _| false)?;
    }
    Ok(())
}

/// Removes `source_id`'s places last announced before `before_ms`, and any that does not
/// decode; returns how many went. (A source's places are its announced regions within the
/// TTL, few: walking them is cheap, and a source that is not in area mode has none.)
pub(super) fn sweep(wtx: &WriteTransaction, source_id: &str, before_ms: u64) -> Result<u64, StoreError> {
    let mut table = wtx.open_table(AREA_PLACES)?;
    if table.is_empty()? {
        return Ok(0);
    }
    let mut expired = Vec::new();
    super::queries::for_each_source_row(&table, source_id, |place, bytes| {
        if decode::<PlaceState>(bytes).map_or(true, |p| p.changed_ms < before_ms) {
            expired.push(place.to_string());
        }
        Ok(())
    })?;
    for place in &expired {
        table.remove((source_id, place.as_str()))?;
    }
    Ok(expired.len() as u64)
}

/// Every place row (live or staged) that does not decode, for `zonewatch check --store`.
pub(super) fn problems(rtx: &redb::ReadTransaction) -> Result<Vec<String>, StoreError> {
    use super::check::undecodable;
    let mut out = undecodable::<_, PlaceState>(rtx, AREA_PLACES, |(source, place)| format!("area place {source}/{place}"))?;
    out.extend(undecodable::<_, PlaceState>(rtx, HELD_AREA_PLACES, |(hold, place)| format!("staged area place {place} of hold {hold}"))?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Watermark;
    use crate::store::CommitMode;

    fn told(revision: u32, changed_ms: u64) -> PlaceState {
        PlaceState { revision, announced: Some(Announced { content: [revision as u8; 16], key_revision: revision - 1 }), changed_ms, extent: [0.0, 0.0, 1.0, 1.0] }
    }

    fn places(v: &[(&str, PlaceState)]) -> Vec<(String, PlaceState)> {
        v.iter().map(|(p, s)| (p.to_string(), *s)).collect()
    }

    /// Each mode of a run does with its places what its events are: a delivering run or a
    /// reprocess writes them (as `step` left them: a reprocess's keep their announcement), a
    /// held run stages them; releasing the hold writes the staged ones (at the release's
    /// time), priming it moves their revisions on and keeps their announcements; a sweep takes the source's
    /// places older than its cut-off and damaged ones, and `check` names a damaged row.
    #[test]
    fn places_follow_their_runs_and_holds() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let commit = |mode: CommitMode, at: u64, v: &[(&str, PlaceState)]| {
            let mut w = store.begin_run("a", mode, Watermark::for_read("d", 1, at, None, String::new()), at, 1_000).unwrap();
            w.places(&places(v)).unwrap();
            w.finish(at, at, Default::default(), vec![]).unwrap()
        };
        commit(CommitMode::Deliver, 10, &[("p1", told(1, 10)), ("p2", told(1, 10))]);
        // A reprocess's step: the revision moved on, the announcement as it was.
        let reprocessed = PlaceState { revision: 2, ..told(1, 20) };
        commit(CommitMode::Reprocess, 20, &[("p1", reprocessed)]);
        assert_eq!(store.area_places("a").unwrap(), places(&[("p1", reprocessed), ("p2", told(1, 10))]).into_iter().collect());
        assert!(store.area_places("b").unwrap().is_empty());

        let held = commit(CommitMode::Hold { reason: "change_spike".into(), reprocess: false }, 30, &[("p1", told(2, 30)), ("p3", told(1, 30))]);
        assert_eq!(store.area_places("a").unwrap().len(), 2, "a held run's places wait for its release");
        commit(CommitMode::ResolveHold { hold_id: held.run_id, prime: false }, 40, &[]);
        let now = store.area_places("a").unwrap();
        assert_eq!((now["p1"], now["p2"], now["p3"]), (told(2, 40), told(1, 10), told(1, 40)), "released: the staged steps, at the release's time");

        let held = commit(CommitMode::Hold { reason: "change_spike".into(), reprocess: false }, 50, &[("p1", told(3, 50)), ("p4", told(1, 50))]);
        commit(CommitMode::ResolveHold { hold_id: held.run_id, prime: true }, 60, &[]);
        let now = store.area_places("a").unwrap();
        assert_eq!(now["p1"], PlaceState { revision: 3, ..told(2, 60) }, "primed: the revision moves on, the announcement stays");
        assert_eq!(now["p4"], PlaceState { announced: None, ..told(1, 60) }, "primed, never told: nothing announced");
        let rtx = store.db.begin_read().unwrap();
        assert!(rtx.open_table(HELD_AREA_PLACES).unwrap().is_empty().unwrap(), "nothing staged is left behind");
        drop(rtx);

        // Another source's place, and a damaged row of this one.
        let wtx = store.db.begin_write().unwrap();
        write(&wtx, "b", &places(&[("p1", told(1, 0))])).unwrap();
        wtx.open_table(AREA_PLACES).unwrap().insert(("a", "p9"), [7u8, 1].as_slice()).unwrap();
        wtx.commit().unwrap();
        assert_eq!(store.area_places("a").unwrap().len(), 4, "a damaged row is left out");
        let all = store.check_consistency().unwrap().problems.join("\n");
        assert!(all.contains("area place a/p9 does not decode: "), "{all}");

        // A run at 1,035 with a TTL of 1,000 sweeps what was announced before 35.
        commit(CommitMode::Deliver, 1_035, &[]);
        let left = store.area_places("a").unwrap();
        assert_eq!(left.keys().map(String::as_str).collect::<std::collections::BTreeSet<_>>(), ["p1", "p3", "p4"].into());
        assert_eq!(store.area_places("b").unwrap().len(), 1, "another source's are left");
        assert!(store.check_consistency().unwrap().is_consistent());
    }
}
