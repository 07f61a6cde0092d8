//! Derived shares: how much of each parcel its derived zoning code covers. Kept beside the
//! derived snapshot (a district source's parcel states) so that an operator can see how
//! confident each derived code is; written in the run's own transaction, staged with holds.
//!
//! Also the read side of a derived run: the base's parcels and the derived source's stored
//! states and shares, merged in parcel id order and handed out a stretch at a time
//! ([`Store::for_each_base_stretch`]), so that deriving a county never holds its whole base.

use super::blocks::ParcelRows;
use super::codec::{decode, encode};
use super::runs::codec_err;
use super::snapshot::{decode_record, decode_state};
use super::tables::{DERIVED_SHARES, HELD_SHARES, PARCEL_BLOCKS};
use super::{Store, StoreError};
use crate::model::{ParcelState, StoredGeometry};
use redb::{AccessGuard, ReadableDatabase, ReadableTable, WriteTransaction};
use std::collections::HashMap;

/// Writes shares of a derived source's parcels (new or changed ones; a removed parcel's share
/// goes with its row, see `RunWriter::removals`).
pub(super) fn write_shares(wtx: &WriteTransaction, source_id: &str, shares: &[(String, f64)]) -> Result<(), StoreError> {
    if shares.is_empty() {
        return Ok(());
    }
    let mut t = wtx.open_table(DERIVED_SHARES)?;
    for (pid, share) in shares {
        t.insert((source_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

/// Removes the shares of parcels gone from a source's snapshot (a parcel source has none:
/// one look at the table says so).
pub(super) fn remove_shares(wtx: &WriteTransaction, source_id: &str, ids: &[String]) -> Result<(), StoreError> {
    let mut t = wtx.open_table(DERIVED_SHARES)?;
    if t.range((source_id, "")..)?.next().transpose()?.is_none_or(|(k, _)| k.value().0 != source_id) {
        return Ok(());
    }
    for id in ids {
        t.remove((source_id, id.as_str()))?;
    }
    Ok(())
}

/// Stages shares with a held run.
pub(super) fn stage_shares(wtx: &WriteTransaction, hold_id: u64, shares: &[(String, f64)]) -> Result<(), StoreError> {
    if shares.is_empty() {
        return Ok(());
    }
    let mut t = wtx.open_table(HELD_SHARES)?;
    for (pid, share) in shares {
        t.insert((hold_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

/// One stretch of a derived run's read ([`Store::for_each_base_stretch`]): a run of parcel
/// ids, and for it the base's parcels and what the derived source has stored.
#[derive(Debug, Default)]
pub struct BaseStretch {
    /// Base parcels with their geometry, in id order (a base parcel without one is left out,
    /// as it has nothing to derive from).
    pub parcels: Vec<(String, ParcelState, StoredGeometry)>,
    /// The derived source's stored share of each of `parcels` (same order; `None`: none
    /// stored, or one that cannot be decoded, which the run then computes and writes again).
    pub parcel_shares: Vec<Option<f64>>,
    /// The derived source's stored states over the same ids.
    pub derived: HashMap<String, ParcelState>,
    /// Ids with a stored share but neither a stored derived state nor a base parcel to
    /// derive (none is written so; an older build could leave some): the run removes them.
    /// A share whose id has a derived state but no base parcel goes with that state's removal.
    pub orphan_shares: Vec<String>,
    /// Stored shares that could not be decoded.
    pub unreadable_shares: u64,
}

type Row<'t> = (AccessGuard<'t, (&'static str, &'static str)>, AccessGuard<'t, &'static [u8]>);

/// Rows of one source in a `(source id, parcel id)`-keyed table (the derived shares; the
/// snapshot's parcels come from `blocks::ParcelRows`), read in id order with one row of
/// look-ahead (the merge takes the smallest id of several). Rows are handed out as redb's
/// guards: nothing is copied that the caller does not decode.
struct SourceRows<'t> {
    range: redb::Range<'t, (&'static str, &'static str), &'static [u8]>,
    source_id: &'t str,
    next: Option<Row<'t>>,
    /// The source's rows are all read (the range has reached another source or the end).
    done: bool,
}

impl<'t> SourceRows<'t> {
    fn new<T>(table: &'t T, source_id: &'t str) -> Result<SourceRows<'t>, StoreError>
    where
        T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
    {
        let mut rows = SourceRows { range: table.range((source_id, "")..)?, source_id, next: None, done: false };
        rows.advance()?;
        Ok(rows)
    }

    /// Reads the next row of the source into `next` (`None` past its last).
    fn advance(&mut self) -> Result<(), StoreError> {
        self.next = None;
        if self.done {
            return Ok(());
        }
        match self.range.next().transpose()? {
            Some(row) if row.0.value().0 == self.source_id => self.next = Some(row),
            // The next source's rows, or the end of the table.
            _ => self.done = true,
        }
        Ok(())
    }

    fn next_id(&self) -> Option<&str> {
        self.next.as_ref().map(|(k, _)| k.value().1)
    }

    /// The next row, reading the one after it.
    fn take(&mut self) -> Result<Option<Row<'t>>, StoreError> {
        let row = self.next.take();
        self.advance()?;
        Ok(row)
    }
}

impl Store {
    /// Reads a derived run's inputs from one read snapshot, a stretch at a time: the ids of
    /// the base `base_id` and of the derived source `derived_id` (its states and its shares)
    /// merged in id order, at most `stretch` distinct ids a stretch, and for those ids the
    /// base's parcels and the derived source's stored states and shares (see
    /// [`BaseStretch`]). Every id lands in exactly one stretch, with all it has in each of
    /// the three, so a diff of each stretch is the diff of the whole; and a stretch is
    /// bounded whatever the ids (a base emptied or re-keyed leaves a long run of stored ids
    /// that are no base's, read a stretch at a time too). `each` is called at least once
    /// (with nothing, for an empty base and source). Returns how many derived rows were
    /// stored. Stops at the first error.
    pub fn for_each_base_stretch<E: From<StoreError>>(
        &self,
        base_id: &str,
        derived_id: &str,
        stretch: usize,
        mut each: impl FnMut(BaseStretch) -> Result<(), E>,
    ) -> Result<u64, E> {
        let stretch = stretch.max(1);
        let rtx = self.db.begin_read().map_err(StoreError::from)?;
        let snapshot = rtx.open_table(PARCEL_BLOCKS).map_err(StoreError::from)?;
        let shares_t = match rtx.open_table(DERIVED_SHARES) {
            Ok(t) => Some(t),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(StoreError::from(e).into()),
        };
        let mut base = ParcelRows::new(&snapshot, base_id)?;
        let mut derived = ParcelRows::new(&snapshot, derived_id)?;
        let mut shares = match &shares_t {
            Some(t) => Some(SourceRows::new(t, derived_id)?),
            None => None,
        };
        let mut stored = 0u64;
        loop {
            let mut out = BaseStretch::default();
            let mut ids = 0;
            while ids < stretch {
                // The smallest id any of the three has next; all three give what they have of it.
                let (in_base, in_derived, in_shares) = {
                    let share_next = shares.as_ref().and_then(|s| s.next_id());
                    let Some(min) = [base.next_id(), derived.next_id(), share_next].into_iter().flatten().min() else { break };
                    (base.next_id() == Some(min), derived.next_id() == Some(min), share_next == Some(min))
                };
                ids += 1;
                let base_row = if in_base { base.take()? } else { None };
                let derived_row = if in_derived { derived.take()? } else { None };
                let share_row = match shares.as_mut() {
                    Some(s) if in_shares => s.take()?,
                    _ => None,
                };
                let derived_here = derived_row.is_some();
                if let Some((id, record)) = derived_row {
                    out.derived.insert(id, decode_state(&record).map_err(|m| codec_err("parcel_blocks", m))?);
                    stored += 1;
                }
                let share = share_row.map(|(k, v)| match decode::<f64>(v.value()) {
                    Ok(share) => (k, Some(share)),
                    Err(_) => {
                        out.unreadable_shares += 1;
                        (k, None)
                    }
                });
                let mut derivable = false;
                if let Some((id, record)) = base_row {
                    if let (state, Some(geometry)) = decode_record(&record).map_err(|m| codec_err("parcel_blocks", m))? {
                        out.parcels.push((id, state, geometry));
                        out.parcel_shares.push(share.as_ref().and_then(|s| s.1));
                        derivable = true;
                    }
                }
                if let Some((k, _)) = share {
                    if !derivable && !derived_here {
                        out.orphan_shares.push(k.value().1.to_string());
                    }
                }
            }
            each(out)?;
            if base.next_id().is_none() && derived.next_id().is_none() && shares.as_ref().is_none_or(|s| s.next.is_none()) {
                return Ok(stored);
            }
        }
    }

    /// Writes `bytes` as the stored share of `parcel_id` (tests of what older builds or a
    /// damaged file can leave behind).
    #[cfg(test)]
    pub(crate) fn put_raw_share(&self, source_id: &str, parcel_id: &str, bytes: &[u8]) {
        let wtx = self.db.begin_write().expect("write");
        wtx.open_table(DERIVED_SHARES).expect("table").insert((source_id, parcel_id), bytes).expect("insert");
        wtx.commit().expect("commit");
    }

    /// The stored derived shares of a source, by parcel id.
    pub fn derived_shares(&self, source_id: &str) -> Result<HashMap<String, f64>, StoreError> {
        self.source_rows(DERIVED_SHARES, "derived_shares", source_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Parcel, RunCounts, Watermark};
    use crate::store::CommitMode;
    use crate::synth::SplitMix64;
    use std::collections::BTreeSet;

    fn parcel(id: &str, with_geometry: bool) -> Parcel {
        let ring = vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]];
        Parcel {
            id: id.into(),
            state: ParcelState { zoning: format!("Z{id}"), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 1.0, revision: 0, announced: None },
            geometry: StoredGeometry(if with_geometry { vec![vec![ring]] } else { vec![] }),
        }
    }

    /// Writes `parcels` to `source`'s snapshot and `shares` as its shares, in one run.
    fn write(store: &Store, source: &str, parcels: &[Parcel], shares: &[(String, f64)]) {
        let mut w = store.begin_run(source, CommitMode::Baseline, Watermark::default(), 1, 1_000).unwrap();
        w.upserts(parcels.iter().map(Parcel::borrowed)).unwrap();
        w.shares(shares).unwrap();
        w.finish(1, 1, RunCounts::default(), vec![]).unwrap();
    }

    /// Random bases and derived sources (ids in runs and gaps, base parcels without a
    /// geometry, shares without a derived row, neighbours whose names extend the sources'),
    /// read with random stretch sizes: every id lands in exactly one stretch with everything
    /// it has in each of the three, stretches follow each other in id order, no stretch has
    /// more than `stretch` ids, and a source's neighbours never leak in.
    #[test]
    fn every_id_lands_in_exactly_one_bounded_stretch() {
        let mut rng = SplitMix64::new(42);
        for trial in 0..60 {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(&dir.path().join("z.redb")).unwrap();
            let universe = 1 + rng.below(120);
            let pick = |rng: &mut SplitMix64, p: usize| -> BTreeSet<String> {
                // Runs of present ids and long gaps: ids in a window that moves.
                let lo = rng.below(universe);
                (0..universe).filter(|i| (*i >= lo || rng.below(4) == 0) && rng.below(100) < p).map(|i| format!("p{i:04}")).collect()
            };
            let (p_base, p_derived) = (rng.below(101), rng.below(101));
            let base_ids = pick(&mut rng, p_base);
            let derived_ids = pick(&mut rng, p_derived);
            let mut share_ids: BTreeSet<String> = derived_ids.iter().filter(|_| rng.below(10) > 0).cloned().collect();
            share_ids.extend(pick(&mut rng, 10));
            let no_geometry: BTreeSet<String> = base_ids.iter().filter(|_| rng.below(8) == 0).cloned().collect();
            let base: Vec<Parcel> = base_ids.iter().map(|id| parcel(id, !no_geometry.contains(id))).collect();
            let derived: Vec<Parcel> = derived_ids.iter().map(|id| parcel(id, true)).collect();
            let shares: Vec<(String, f64)> = share_ids.iter().map(|id| (id.clone(), id.len() as f64 / 10.0)).collect();
            write(&store, "base", &base, &[]);
            write(&store, "zoning", &derived, &shares);
            // Neighbours in key order on both sides of each source.
            for n in ["bas", "base-x", "zonin", "zoning-x"] {
                write(&store, n, &[parcel("p0000", true), parcel("zzz", true)], &[("p0000".to_string(), 0.5)]);
            }
            let stretch = 1 + rng.below(9);
            let mut calls = 0;
            let (mut got_base, mut got_derived, mut got_shares) = (Vec::new(), Vec::new(), Vec::new());
            let mut previous_last: Option<String> = None;
            let stored = store
                .for_each_base_stretch::<StoreError>("base", "zoning", stretch, |s| {
                    calls += 1;
                    assert_eq!(s.parcel_shares.len(), s.parcels.len(), "trial {trial}: one stored share slot per parcel");
                    let ids: BTreeSet<String> = s
                        .parcels
                        .iter()
                        .map(|p| p.0.clone())
                        .chain(s.derived.keys().cloned())
                        .chain(s.orphan_shares.iter().cloned())
                        .collect();
                    assert!(ids.len() <= stretch, "trial {trial}: {} ids in a stretch of {stretch}", ids.len());
                    if let (Some(first), Some(prev)) = (ids.first(), &previous_last) {
                        assert!(first > prev, "trial {trial}: stretches out of order");
                    }
                    if let Some(last) = ids.last() {
                        previous_last = Some(last.clone());
                    }
                    // Everything an id has is in its stretch.
                    for id in &ids {
                        assert_eq!(s.derived.contains_key(id), derived_ids.contains(id), "trial {trial}: {id}");
                        let with_geometry = base_ids.contains(id) && !no_geometry.contains(id);
                        assert_eq!(s.parcels.iter().any(|p| &p.0 == id), with_geometry, "trial {trial}: {id}");
                    }
                    // Every stored share is where the run needs it: beside its parcel, or gone
                    // with its derived row, or listed to be removed.
                    for (p, share) in s.parcels.iter().zip(&s.parcel_shares) {
                        assert_eq!(share.is_some(), share_ids.contains(&p.0), "trial {trial}: share of {}", p.0);
                        if share.is_some() {
                            got_shares.push(p.0.clone());
                        }
                    }
                    for id in s.derived.keys().filter(|id| share_ids.contains(*id) && !s.parcels.iter().any(|p| &p.0 == *id)) {
                        got_shares.push(id.clone());
                    }
                    for id in &s.orphan_shares {
                        assert!(share_ids.contains(id) && !derived_ids.contains(id), "trial {trial}: orphan {id}");
                        got_shares.push(id.clone());
                    }
                    got_base.extend(s.parcels.into_iter().map(|p| p.0));
                    got_derived.extend(s.derived.into_keys());
                    Ok(())
                })
                .unwrap();
            assert!(calls >= 1);
            assert_eq!(stored, derived_ids.len() as u64);
            let with_geometry: Vec<String> = base_ids.iter().filter(|id| !no_geometry.contains(*id)).cloned().collect();
            assert_eq!(got_base, with_geometry, "trial {trial}: base parcels once each, in order");
            got_derived.sort();
            got_shares.sort();
            assert_eq!(got_derived, derived_ids.iter().cloned().collect::<Vec<_>>(), "trial {trial}: derived rows once each");
            assert_eq!(got_shares, share_ids.iter().cloned().collect::<Vec<_>>(), "trial {trial}: every share accounted for once");
        }
    }

    /// A stored share that cannot be decoded reads as none and is counted (the run computes
    /// it again), not a failed run.
    #[test]
    fn an_unreadable_share_is_counted_and_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        write(&store, "base", &[parcel("a", true), parcel("b", true)], &[]);
        write(&store, "zoning", &[parcel("a", true), parcel("b", true)], &[("a".to_string(), 0.5), ("b".to_string(), 1.0)]);
        {
            let wtx = store.db.begin_write().unwrap();
            wtx.open_table(DERIVED_SHARES).unwrap().insert(("zoning", "b"), [9u8, 9, 9].as_slice()).unwrap();
            wtx.commit().unwrap();
        }
        let mut seen = Vec::new();
        store
            .for_each_base_stretch::<StoreError>("base", "zoning", 10, |s| {
                seen.push((s.parcel_shares.clone(), s.unreadable_shares, s.derived.len()));
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, [(vec![Some(0.5), None], 1, 2)]);
    }
}
