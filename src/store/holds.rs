//! The holds' rows: the index of those still open, and the retention of superseded ones.
//!
//! Why it exists: every run of a source asks for the source's open holds (bytes an open hold
//! already holds are "still held"; a run that commits supersedes them, and a release checks in
//! its own transaction that its hold is still open), and `GET /v1/sources`, `stats` and the
//! dashboard count them (`/metrics` counts every state, so it still reads every hold: as many
//! as the retention below keeps). Those passes read every hold ever made, and a source whose layer
//! changes at every poll while it is held supersedes a hold per poll (a soak tester's: 62 in
//! 2.5 minutes), so each poll of every source cost more as the weeks went by. `open_holds`
//! (schema 14) names the open ones by source, and a superseded hold, of which nothing staged is
//! left (the run that superseded it cleared that), is removed past `[store] run_retention` as
//! the quiet run records are. A released or primed hold is an operator's decision: kept.
//!
//! Invariant: a hold's index entry is written in the transaction that opens the hold and
//! removed in the one that releases, primes or supersedes it, so the index names exactly the
//! rows whose state is open (`check --store` compares them).

use super::tables::{HOLDS, OPEN_HOLDS};
use super::run_retention::{remove_rows, FUTURE_MS};
use super::watermark_rows::{encode_hold, readable_hold};
use super::{Store, StoreError};
use crate::model::{Hold, HoldState};
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};
use std::collections::BTreeSet;

/// Writes a new open hold and its index entry.
pub(super) fn insert_open(wtx: &WriteTransaction, hold: &Hold) -> Result<(), StoreError> {
    wtx.open_table(HOLDS)?.insert(hold.run_id, encode_hold(hold).as_slice())?;
    wtx.open_table(OPEN_HOLDS)?.insert((hold.source_id.as_str(), hold.run_id), ())?;
    Ok(())
}

/// Writes a hold whose state an operator or a later run has resolved, and drops its entry
/// from the index of open ones.
pub(super) fn write_resolved(wtx: &WriteTransaction, hold: &Hold) -> Result<(), StoreError> {
    debug_assert!(hold.state != HoldState::Open);
    wtx.open_table(HOLDS)?.insert(hold.run_id, encode_hold(hold).as_slice())?;
    wtx.open_table(OPEN_HOLDS)?.remove((hold.source_id.as_str(), hold.run_id))?;
    Ok(())
}

/// The open holds of `source`, oldest first, read through the index in a write transaction
/// (the run that resolves or supersedes them). An entry whose row is gone or no longer open
/// (never written so; `check --store` names it) is dropped here; one whose row does not decode
/// is left to `check` (logged once by [`readable_hold`]).
pub(super) fn open_of_source(wtx: &WriteTransaction, source_id: &str) -> Result<Vec<Hold>, StoreError> {
    let mut index = wtx.open_table(OPEN_HOLDS)?;
    let (open, stale) = read_open(&index, &wtx.open_table(HOLDS)?, Some(source_id))?;
    for id in stale {
        tracing::error!(hold = id, source = source_id, "the index of open holds named a hold that is not open; entry dropped");
        index.remove((source_id, id))?;
    }
    Ok(open)
}

/// The open holds the index names, of one source or of all (`None`), in index order; and the
/// ids of entries whose row is gone, not open or of another source (a row that does not
/// decode is neither: left to `check`, logged once by [`readable_hold`]).
fn read_open<I, R>(index: &I, rows: &R, source_id: Option<&str>) -> Result<(Vec<Hold>, Vec<u64>), StoreError>
where
    I: ReadableTable<(&'static str, u64), ()>,
    R: ReadableTable<u64, &'static [u8]>,
{
    let entries = match source_id {
        Some(s) => index.range((s, 0u64)..=(s, u64::MAX))?,
        None => index.range::<(&str, u64)>(..)?,
    };
    let (mut open, mut stale) = (Vec::new(), Vec::new());
    for item in entries {
        let (k, _) = item?;
        let (source, id) = k.value();
        match rows.get(id)? {
            None => stale.push(id),
            Some(v) => match readable_hold(id, v.value()) {
                Some(h) if h.state == HoldState::Open && h.source_id == source => open.push(h),
                Some(_) => stale.push(id),
                None => {}
            },
        }
    }
    Ok((open, stale))
}

/// Indexes the open holds of a file written before the index existed (schema 13 or older).
/// Returns how many it indexed.
pub(super) fn index_missing(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    let rows = wtx.open_table(HOLDS)?;
    let mut index = wtx.open_table(OPEN_HOLDS)?;
    let mut n = 0;
    for item in rows.iter()? {
        let (k, v) = item?;
        if let Some(h) = readable_hold(k.value(), v.value()).filter(|h| h.state == HoldState::Open) {
            index.insert((h.source_id.as_str(), h.run_id), ())?;
            n += 1;
        }
    }
    Ok(n)
}

/// What `check --store` finds wrong between the hold rows and the index of open ones: an open
/// row the index misses (its source's runs would not see it: a release would be refused and
/// a later run would not supersede it), an entry of a row that is not open or of another
/// source, an entry without a row.
pub(super) fn index_problems(rtx: &redb::ReadTransaction) -> Result<Vec<String>, StoreError> {
    let Some(index) = super::check::open_optional(rtx, OPEN_HOLDS)? else {
        return Ok(Vec::new());
    };
    let mut entries = BTreeSet::new();
    for item in index.iter()? {
        let (k, _) = item?;
        let (source, id) = k.value();
        entries.insert((source.to_string(), id));
    }
    let mut out = Vec::new();
    let rows = rtx.open_table(HOLDS)?;
    for item in rows.iter()? {
        let (k, v) = item?;
        // A row that does not decode is named by the check's own pass over the hold rows.
        let Ok(h) = super::watermark_rows::decode_hold(v.value()) else { continue };
        if h.state == HoldState::Open && !entries.contains(&(h.source_id.clone(), k.value())) {
            out.push(format!("hold {} of {} is open but not in the index of open holds (open_holds): runs of its source do not see it", k.value(), h.source_id));
        }
    }
    for (source, id) in &entries {
        let Some(v) = rows.get(*id)? else {
            out.push(format!("the index of open holds (open_holds) names hold {id} of {source}, which does not exist"));
            continue;
        };
        match super::watermark_rows::decode_hold(v.value()) {
            Ok(h) if h.state != HoldState::Open => out.push(format!("the index of open holds (open_holds) names hold {id}, which is {}", h.state.label())),
            Ok(h) if h.source_id != *source => out.push(format!("the index of open holds (open_holds) names hold {id} under {source}; it is of {}", h.source_id)),
            _ => {}
        }
    }
    Ok(out)
}

impl Store {
    /// The open holds, oldest first: of one source, or of every source (`None`). Read through
    /// the index, so the cost is the open holds', however many were resolved before.
    pub fn open_holds(&self, source_id: Option<&str>) -> Result<Vec<Hold>, StoreError> {
        let rtx = self.db.begin_read()?;
        let (mut out, _) = read_open(&rtx.open_table(OPEN_HOLDS)?, &rtx.open_table(HOLDS)?, source_id)?;
        out.sort_by_key(|h| h.run_id);
        Ok(out)
    }

    /// Removes up to `max` holds superseded more than `retention_ms` before `now_ms`, oldest
    /// first, in one transaction; returns how many. Released, primed and open holds stay, and
    /// so does a row that does not decode (`check --store` names it). The pass reads from the
    /// oldest hold and stops at the first one made after the horizon, so what it reads each
    /// time is what it removes plus the holds kept before the horizon (an operator's
    /// decisions: few). There is no cursor to lose: a clock behind the holds' times removes
    /// nothing (a hold goes when it was superseded before the horizon) and steps over those
    /// made a day or more "ahead" of it; a clock far ahead removes what it takes as old, as it
    /// does the quiet run records.
    pub fn sweep_superseded_holds(&self, now_ms: u64, retention_ms: u64, max: usize) -> Result<usize, StoreError> {
        let before_ms = now_ms.saturating_sub(retention_ms);
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut doomed = Vec::new();
        {
            let rows = wtx.open_table(HOLDS)?;
            for item in rows.iter()? {
                if doomed.len() >= max {
                    break;
                }
                let (k, v) = item?;
                let Some(hold) = readable_hold(k.value(), v.value()) else { continue };
                // Made after the horizon (and not under a clock that ran ahead): so are the
                // holds after it, but for a clock stepped back, whose holds a later pass finds.
                if hold.created_ms >= before_ms && hold.created_ms <= now_ms.saturating_add(FUTURE_MS) {
                    break;
                }
                if matches!(hold.state, HoldState::Superseded { at_ms, .. } if at_ms < before_ms) {
                    doomed.push(k.value());
                }
            }
        }
        remove_rows(wtx, HOLDS, &doomed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Watermark;

    const DAY: u64 = 86_400_000;

    fn hold(run_id: u64, source: &str, created_ms: u64, state: HoldState) -> Hold {
        Hold {
            run_id,
            source_id: source.to_string(),
            lineage_id: format!("l{run_id}"),
            created_ms,
            reason: "test".to_string(),
            state,
            digest: format!("d{run_id}"),
            watermark: Watermark::default(),
            changes: 1,
            features: 1,
            reprocess: false,
        }
    }

    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        (dir, store)
    }

    fn write(store: &Store, f: impl FnOnce(&WriteTransaction)) {
        let wtx = store.db.begin_write().expect("write");
        f(&wtx);
        wtx.commit().expect("commit");
    }

    fn check(store: &Store) -> Vec<String> {
        index_problems(&store.db.begin_read().expect("read")).expect("check")
    }

    /// Opening, superseding and resolving keep the index equal to the open rows; a source's
    /// open holds are read through it; an older file is indexed on open.
    #[test]
    fn the_index_names_exactly_the_open_holds() {
        let (dir, store) = store();
        write(&store, |wtx| {
            for (id, source) in [(1, "a"), (2, "b"), (3, "a"), (4, "a")] {
                insert_open(wtx, &hold(id, source, id, HoldState::Open)).expect("open");
            }
        });
        assert_eq!(store.open_holds(Some("a")).expect("a").iter().map(|h| h.run_id).collect::<Vec<_>>(), vec![1, 3, 4]);
        assert_eq!(store.open_holds(None).expect("all").iter().map(|h| h.run_id).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        write(&store, |wtx| {
            let open = open_of_source(wtx, "a").expect("open of a");
            assert_eq!(open.len(), 3);
            write_resolved(wtx, &Hold { state: HoldState::Superseded { at_ms: 9, by_run: 9 }, ..open[0].clone() }).expect("supersede");
            write_resolved(wtx, &Hold { state: HoldState::Released { at_ms: 9, run_id: 9 }, ..open[1].clone() }).expect("release");
        });
        assert_eq!(store.open_holds(Some("a")).expect("a").iter().map(|h| h.run_id).collect::<Vec<_>>(), vec![4]);
        assert_eq!(store.open_holds(Some("b")).expect("b").len(), 1);
        assert!(check(&store).is_empty(), "{:?}", check(&store));

        // A row written open without its entry (as a schema-13 file's are) is named by check,
        // and indexed by the upgrade.
        write(&store, |wtx| {
            wtx.open_table(HOLDS).expect("holds").insert(5u64, encode_hold(&hold(5, "b", 5, HoldState::Open)).as_slice()).expect("insert");
        });
        assert_eq!(check(&store).len(), 1, "{:?}", check(&store));
        write(&store, |wtx| {
            wtx.delete_table(OPEN_HOLDS).expect("drop");
        });
        drop(store);
        let store = Store::open(&dir.path().join("zw.redb")).expect("reopen upgrades");
        assert_eq!(store.open_holds(Some("b")).expect("b").iter().map(|h| h.run_id).collect::<Vec<_>>(), vec![2, 5]);
        assert_eq!(store.open_holds(Some("a")).expect("a").iter().map(|h| h.run_id).collect::<Vec<_>>(), vec![4]);
        assert!(check(&store).is_empty(), "{:?}", check(&store));

        // An entry of a resolved row is named, and dropped by the next run's read.
        write(&store, |wtx| {
            wtx.open_table(OPEN_HOLDS).expect("index").insert(("a", 1u64), ()).expect("insert");
        });
        assert_eq!(check(&store).len(), 1, "{:?}", check(&store));
        assert_eq!(store.open_holds(Some("a")).expect("a").len(), 1, "a stale entry is not an open hold");
        write(&store, |wtx| assert_eq!(open_of_source(wtx, "a").expect("a").len(), 1));
        assert!(check(&store).is_empty(), "{:?}", check(&store));
    }

    /// Superseded holds go past the retention, oldest first and `max` at a time; released,
    /// primed and open ones stay, and so do those superseded inside the retention; a clock far
    /// behind the holds removes nothing.
    #[test]
    fn superseded_holds_are_removed_past_the_retention() {
        let (_dir, store) = store();
        let now = 1_000 * DAY;
        let retention = 30 * DAY;
        let old = now - 40 * DAY;
        write(&store, |wtx| {
            let mut rows = wtx.open_table(HOLDS).expect("holds");
            let states = [
                HoldState::Superseded { at_ms: old + 1, by_run: 99 },
                HoldState::Released { at_ms: old + 1, run_id: 99 },
                HoldState::Superseded { at_ms: old + 2, by_run: 99 },
                HoldState::Primed { at_ms: old + 1, run_id: 99 },
                // Made before the horizon, superseded after it: kept for now.
                HoldState::Superseded { at_ms: now - DAY, by_run: 99 },
                HoldState::Superseded { at_ms: old + 3, by_run: 99 },
            ];
            for (i, state) in states.into_iter().enumerate() {
                let id = i as u64 + 1;
                rows.insert(id, encode_hold(&hold(id, "a", old, state)).as_slice()).expect("insert");
            }
            // An open one from before the horizon, and a superseded one made inside it.
            drop(rows);
            insert_open(wtx, &hold(7, "a", old, HoldState::Open)).expect("open");
            wtx.open_table(HOLDS).expect("holds").insert(8u64, encode_hold(&hold(8, "a", now - DAY, HoldState::Superseded { at_ms: now - DAY, by_run: 99 })).as_slice()).expect("insert");
            // Made before the horizon after one made inside it (a clock stepped back): a pass
            // stops at hold 8, so this one goes once 8 is past the horizon too.
            wtx.open_table(HOLDS).expect("holds").insert(9u64, encode_hold(&hold(9, "a", old, HoldState::Superseded { at_ms: old, by_run: 99 })).as_slice()).expect("insert");
        });
        let ids = |s: &Store| s.db.begin_read().expect("r").open_table(HOLDS).expect("t").iter().expect("i").map(|i| i.expect("row").0.value()).collect::<Vec<u64>>();
        // A clock a year behind the holds: nothing.
        assert_eq!(store.sweep_superseded_holds(old - 365 * DAY, retention, 10).expect("sweep"), 0);
        assert_eq!(store.sweep_superseded_holds(now, retention, 2).expect("sweep"), 2);
        assert_eq!(ids(&store), vec![2, 4, 5, 6, 7, 8, 9]);
        assert_eq!(store.sweep_superseded_holds(now, retention, 10).expect("sweep"), 1);
        assert_eq!(ids(&store), vec![2, 4, 5, 7, 8, 9]);
        assert_eq!(store.sweep_superseded_holds(now, retention, 10).expect("sweep"), 0);
        // Thirty days on, hold 8 and 5 are past it, and then 9 behind them.
        assert_eq!(store.sweep_superseded_holds(now + 31 * DAY, retention, 10).expect("sweep"), 3);
        assert_eq!(ids(&store), vec![2, 4, 7]);
        assert!(check(&store).is_empty(), "{:?}", check(&store));
        assert_eq!(store.open_holds(None).expect("open").len(), 1);
    }
}
