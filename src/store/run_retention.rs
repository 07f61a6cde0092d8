//! Retention of the run records that committed nothing.
//!
//! Why it exists: every poll of every source writes a run record, and most polls find the
//! layer as it was (`identical`, `skip`), or could not run (`failed`, `skipped_overlap`).
//! Those records are ~130 bytes each (and a portal's `identical` run adds a watermark
//! history row), so 100 sources polled every 5 minutes grew the one file an operator backs up
//! by ~1.3 GB a year, for records nothing refers to. Past `[store] run_retention` (30 days by
//! default) the sweep removes them, a batch per transaction, from the daemon's periodic
//! sweep and at the end of `zonewatch run`.
//!
//! What is never removed: a run that committed data or was held (`baseline`, `run`,
//! `reprocessed`, `held`: their lineage ids name audit rows, holds and watermarks), a
//! source's newest run record (what `GET /v1/sources` shows as its last run; once a newer one
//! exists it goes too, `SweptRuns::held_back`), a record written under a clock more than a day
//! ahead (stepped over; `meta` `runs_future_from` keeps the lowest such id and the earliest
//! time among them: once that time is past the horizon, the sweep reads them again, stepping
//! over those still inside retention, so neither a clock that ran ahead nor one that is behind,
//! the store's records then all looking ahead of it, keeps records for good), and a
//! record that does not decode (`check --store` names it). Run ids are never reused: the
//! store's newest record is its source's newest, so it stays, and the next id is counted from
//! it.
//!
//! Invariant: a record is removed in the transaction that removes its `runs_by_source` entry
//! and its watermark history row and adds it to its source's `runs_swept` tally, so the run
//! totals `/metrics` reads still equal the records plus the tally (`check --store` compares
//! them). A hold superseded by a removed `identical` run keeps that run's id and time in its
//! own row.

use super::codec::{decode, encode};
use super::tables::{META, META_RUNS_FUTURE_FROM, META_RUNS_SWEPT_BELOW, RUNS, RUNS_BY_SOURCE, RUNS_SWEPT, WATERMARK_HISTORY};
use super::{Store, StoreError};
use crate::model::{RunRecord, Verdict};
use redb::{ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How many records the sweep may read per record it may remove: a long stretch of kept
/// records (a busy source's `run`s) is crossed over several batches, not in one transaction.
const READS_PER_REMOVAL: usize = 4;

/// What the sweep removed of one source's run records (`runs_swept`, one row per source).
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct SweptRuns {
    /// Removed records per verdict.
    pub verdicts: Vec<(Verdict, u64)>,
    /// The features of the newest removed record that read any, and its run id (0: none):
    /// the totals' `latest_features` may have come from it.
    pub latest_features: u64,
    pub latest_features_run: u64,
    /// The source's newest record when the sweep's cursor went past it (it committed
    /// nothing and finished before the horizon, but had no newer record to let it go): looked
    /// at again by every pass until it may be removed.
    pub held_back: Option<u64>,
}

impl SweptRuns {
    fn add(&mut self, record: &RunRecord) {
        super::totals::count_verdict(&mut self.verdicts, record.verdict, 1);
        if record.counts.features > 0 && record.run_id >= self.latest_features_run {
            self.latest_features = record.counts.features;
            self.latest_features_run = record.run_id;
        }
    }
}

/// Whether a run of this verdict committed nothing anything else refers to.
pub fn removable(verdict: Verdict) -> bool {
    matches!(verdict, Verdict::Identical | Verdict::Skip | Verdict::Failed | Verdict::SkippedOverlap)
}

/// What [`read_swept`] read: the tallies by source, and (source, why) of the rows that do not
/// decode.
pub(super) type SweptRead = (BTreeMap<String, SweptRuns>, Vec<(String, String)>);

/// Every source's tally of removed records, and the sources whose row does not decode, each
/// with why (their totals cannot be checked against their records; the other sources' can).
pub(super) fn read_swept<T: ReadableTable<&'static str, &'static [u8]>>(t: &T) -> Result<SweptRead, StoreError> {
    let mut out = BTreeMap::new();
    let mut damaged = Vec::new();
    for item in t.iter()? {
        let (k, v) = item?;
        match decode::<SweptRuns>(v.value()) {
            Ok(swept) => {
                out.insert(k.value().to_string(), swept);
            }
            Err(m) => damaged.push((k.value().to_string(), format!("runs_swept row of source {}: {m}", k.value()))),
        }
    }
    Ok((out, damaged))
}

fn meta_u64(wtx: &WriteTransaction, key: &str) -> Result<Option<u64>, StoreError> {
    let meta = wtx.open_table(META)?;
    let v = meta.get(key)?;
    Ok(v.and_then(|v| <[u8; 8]>::try_from(v.value()).ok()).map(u64::from_le_bytes))
}

/// The records below the sweep's cursor it must read again (`meta` `runs_future_from`): those
/// it stepped over as written ahead of its clock, and those a reading of them found still
/// inside retention.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Waiting {
    /// The lowest id of those records and the earliest time one of them finished: they are
    /// read again, from that id, once that time is past the horizon.
    still: Option<(u64, u64)>,
    /// Where a reading of them that ran out of reads stopped: the next pass goes on from there
    /// (then `still` holds what the reading has found so far).
    resume: Option<u64>,
}

impl Waiting {
    /// 24 bytes: lowest id, earliest time, resume id (`u64::MAX`: none; so are an id and a
    /// time of `u64::MAX`, which no record has).
    fn to_bytes(self) -> [u8; 24] {
        let (lowest, due) = self.still.unwrap_or((u64::MAX, u64::MAX));
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&lowest.to_le_bytes());
        out[8..16].copy_from_slice(&due.to_le_bytes());
        out[16..].copy_from_slice(&self.resume.unwrap_or(u64::MAX).to_le_bytes());
        out
    }

    /// Reads [`Waiting::to_bytes`], or the 8-byte lowest id an earlier build of this schema
    /// wrote (read again at once, as that build would have). Anything else: none (a damaged
    /// value costs records kept until `check --store` is run, never one removed early).
    fn from_bytes(bytes: &[u8]) -> Option<Waiting> {
        let word = |i: usize| bytes.get(i * 8..i * 8 + 8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_le_bytes);
        let some = |v: u64| (v != u64::MAX).then_some(v);
        match bytes.len() {
            8 => Some(Waiting { still: None, resume: word(0) }),
            24 => {
                let (lowest, due, resume) = (word(0)?, word(1)?, word(2)?);
                let w = Waiting { still: some(lowest).zip(some(due)), resume: some(resume) };
                (w.still.is_some() || w.resume.is_some()).then_some(w)
            }
            _ => None,
        }
    }
}

fn read_waiting(wtx: &WriteTransaction) -> Result<Option<Waiting>, StoreError> {
    let meta = wtx.open_table(META)?;
    let v = meta.get(META_RUNS_FUTURE_FROM)?;
    Ok(v.and_then(|v| Waiting::from_bytes(v.value())))
}

fn swept_below(wtx: &WriteTransaction) -> Result<u64, StoreError> {
    // A damaged cursor starts the sweep over from the first record: it only costs reads.
    Ok(meta_u64(wtx, META_RUNS_SWEPT_BELOW)?.unwrap_or(0))
}

/// How far ahead of the sweep's clock a record's time may be before it is taken as written
/// under a clock that ran ahead (a second reader: one such record ended every pass, so a clock
/// a year ahead for five minutes stopped the retention for a year). The hold sweep
/// (`holds.rs`) uses it too.
pub(super) const FUTURE_MS: u64 = 86_400_000;

/// Removes the rows `doomed` of `table` and commits `wtx` (aborts it when there are none);
/// returns how many: the end of the retention sweeps that remove whole rows by key.
pub(super) fn remove_rows(wtx: WriteTransaction, table: redb::TableDefinition<u64, &[u8]>, doomed: &[u64]) -> Result<usize, StoreError> {
    if doomed.is_empty() {
        wtx.abort()?;
        return Ok(0);
    }
    {
        let mut rows = wtx.open_table(table)?;
        for id in doomed {
            rows.remove(*id)?;
        }
    }
    wtx.commit()?;
    Ok(doomed.len())
}

/// Whether `record` may be removed now: it committed nothing, finished before `before_ms`, and
/// its source has a newer record.
fn due(index: &redb::Table<'_, (&str, u64), ()>, record: &RunRecord, before_ms: u64) -> Result<bool, StoreError> {
    if !removable(record.verdict) || record.finished_ms >= before_ms {
        return Ok(false);
    }
    let newer = (record.source_id.as_str(), record.run_id.saturating_add(1))..=(record.source_id.as_str(), u64::MAX);
    Ok(index.range(newer)?.next().is_some())
}

impl Store {
    /// Removes up to `max` run records that committed nothing and finished more than
    /// `retention_ms` before `now_ms`, oldest first, in one transaction (see the module doc
    /// for what stays). Returns how many it removed; 0 when there is nothing (more) to remove
    /// now.
    pub fn sweep_quiet_runs(&self, now_ms: u64, retention_ms: u64, max: usize) -> Result<usize, StoreError> {
        self.sweep_quiet_runs_batch(now_ms, retention_ms, max).map(|b| b.removed)
    }

    /// [`Store::sweep_quiet_runs`], saying too whether the batch stopped at its bound (`more`:
    /// `max` records to remove, or its read budget spent crossing kept records).
    pub fn sweep_quiet_runs_batch(&self, now_ms: u64, retention_ms: u64, max: usize) -> Result<super::SweepBatch, StoreError> {
        let before_ms = now_ms.saturating_sub(retention_ms);
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let cursor = swept_below(&wtx)?;
        // Records below the cursor stepped over as written ahead of the clock: read again,
        // from the lowest of them to the cursor, once the earliest is past the horizon (the
        // clock has caught up with a clock that ran ahead, or this clock, which was behind, is
        // right again, and the retention has gone by), or where the last such reading stopped.
        // That reading steps over what is still inside retention instead of stopping on it,
        // so it never takes the cursor back (a seventh reader: it did, to the next record of
        // the stretch), and waits for the earliest record, not the lowest id (one a century
        // ahead kept a stretch a day ahead behind it).
        let stored = read_waiting(&wtx)?;
        let (mut again, mut waiting) = match stored {
            Some(w) => match w.resume {
                Some(at) => (Some(at), w.still),
                None if w.still.is_some_and(|(_, due)| due < before_ms) => (w.still.map(|(lowest, _)| lowest), None),
                None => (None, w.still),
            },
            None => (None, None),
        };
        // Only a record that may ever be removed is waited for (a `run` a century ahead would
        // hold the lowest id read again from for good, a reader).
        let wait = |waiting: &mut Option<(u64, u64)>, id: u64, record: &RunRecord| {
            if removable(record.verdict) {
                let finished_ms = record.finished_ms;
                *waiting = Some(waiting.map_or((id, finished_ms), |(lowest, due)| (lowest.min(id), due.min(finished_ms))));
            }
        };
        // Every source's tally (a row per source that ever had a record removed or held back).
        // One that does not decode starts afresh, with an error: the totals can then no longer
        // be checked against the records (`check --store` says so), but the sweep goes on for
        // every source (a second reader: one damaged row stopped it for all of them).
        let (mut tallies, damaged) = read_swept(&wtx.open_table(RUNS_SWEPT)?)?;
        for (source, why) in damaged {
            tracing::error!(source, %why, "the tally of run records removed by the retention sweep does not decode; counted afresh (check --store names the difference)");
            tallies.insert(source, SweptRuns::default());
        }
        let mut changed: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        let mut doomed: BTreeMap<u64, RunRecord> = BTreeMap::new();
        let mut next_from = cursor;
        // The pass stopped at `max` removals or its read budget, not at the horizon.
        let mut bounded = false;
        {
            let runs = wtx.open_table(RUNS)?;
            let index = wtx.open_table(RUNS_BY_SOURCE)?;
            let record_of = |run_id: u64| -> Result<Option<RunRecord>, StoreError> { Ok(runs.get(run_id)?.and_then(|v| decode::<RunRecord>(v.value()).ok())) };
            // Records the cursor went past while each was its source's newest: removed once a
            // newer one of the source exists (a source run less often than the retention kept
            // every record otherwise).
            for (source, tally) in tallies.iter_mut() {
                let Some(id) = tally.held_back else { continue };
                match record_of(id)? {
                    Some(record) if record.source_id == *source => {
                        if due(&index, &record, before_ms)? {
                            tally.held_back = None;
                            changed.insert(source.clone());
                            doomed.insert(id, record);
                        }
                    }
                    _ => {
                        tally.held_back = None;
                        changed.insert(source.clone());
                    }
                }
            }
            // A record past the horizon: removed if its source has a newer one, else held back
            // as its source's newest (looked at again by later passes).
            let mut take = |run_id: u64, record: RunRecord, doomed: &mut BTreeMap<u64, RunRecord>| -> Result<(), StoreError> {
                if due(&index, &record, before_ms)? {
                    doomed.insert(run_id, record);
                } else if removable(record.verdict) {
                    let tally = tallies.entry(record.source_id.clone()).or_default();
                    if let Some(older) = tally.held_back.replace(run_id).filter(|older| *older != run_id) {
                        if let Some(old) = record_of(older)?.filter(|r| r.source_id == record.source_id) {
                            if due(&index, &old, before_ms)? {
                                doomed.insert(older, old);
                            }
                        }
                    }
                    changed.insert(record.source_id.clone());
                }
                Ok(())
            };
            let budget = max.saturating_mul(READS_PER_REMOVAL);
            let mut reads = 0;
            // Below the cursor, the records it went past as ahead of the clock.
            let mut resume = None;
            if let Some(from) = again {
                for item in runs.range(from..cursor)? {
                    let (k, v) = item?;
                    let run_id = k.value();
                    if doomed.len() >= max || reads >= budget {
                        resume = Some(run_id);
                        bounded = true;
                        break;
                    }
                    reads += 1;
                    match decode::<RunRecord>(v.value()) {
                        Ok(record) if record.finished_ms >= before_ms => wait(&mut waiting, run_id, &record),
                        Ok(record) => take(run_id, record, &mut doomed)?,
                        Err(_) => {}
                    }
                }
            }
            again = resume;
            // From the cursor on, once that is done.
            if again.is_none() {
                for item in runs.range(cursor..)? {
                    if doomed.len() >= max || reads >= budget {
                        bounded = true;
                        break;
                    }
                    reads += 1;
                    let (k, v) = item?;
                    let run_id = k.value();
                    match decode::<RunRecord>(v.value()) {
                        // Written under a clock that ran ahead: kept, and stepped over.
                        Ok(record) if record.finished_ms > now_ms.saturating_add(FUTURE_MS) => wait(&mut waiting, run_id, &record),
                        // Records are in run order, which is time order but for a clock stepped
                        // back: the first one inside retention ends the pass (a later one from
                        // before a step back waits for its turn, kept a little longer).
                        Ok(record) if record.finished_ms >= before_ms => break,
                        Ok(record) => take(run_id, record, &mut doomed)?,
                        Err(_) => {}
                    }
                    next_from = run_id.saturating_add(1);
                }
            }
        }
        let now_waiting = (again.is_some() || waiting.is_some()).then_some(Waiting { still: waiting, resume: again });
        if doomed.is_empty() && changed.is_empty() && next_from == cursor && now_waiting == stored {
            wtx.abort()?;
            return Ok(super::SweepBatch::default());
        }
        {
            let mut runs = wtx.open_table(RUNS)?;
            let mut index = wtx.open_table(RUNS_BY_SOURCE)?;
            let mut history = wtx.open_table(WATERMARK_HISTORY)?;
            for record in doomed.values() {
                let source = record.source_id.as_str();
                runs.remove(record.run_id)?;
                index.remove((source, record.run_id))?;
                history.remove((source, record.run_id))?;
                tallies.entry(record.source_id.clone()).or_default().add(record);
                changed.insert(record.source_id.clone());
            }
        }
        {
            let mut swept = wtx.open_table(RUNS_SWEPT)?;
            for source in &changed {
                if let Some(tally) = tallies.get(source) {
                    swept.insert(source.as_str(), encode(tally).as_slice())?;
                }
            }
        }
        {
            let mut meta = wtx.open_table(META)?;
            meta.insert(META_RUNS_SWEPT_BELOW, next_from.to_le_bytes().as_slice())?;
            match now_waiting {
                Some(w) => meta.insert(META_RUNS_FUTURE_FROM, w.to_bytes().as_slice())?,
                None => meta.remove(META_RUNS_FUTURE_FROM)?,
            };
        }
        wtx.commit()?;
        Ok(super::SweepBatch { removed: doomed.len(), more: bounded })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RunCounts, Watermark};
    use crate::store::tables::RUN_TOTALS;
    use redb::ReadableDatabase;
    use std::collections::HashSet;

    const VERDICTS: [Verdict; 8] = [
        Verdict::Identical,
        Verdict::Skip,
        Verdict::Failed,
        Verdict::SkippedOverlap,
        Verdict::Run,
        Verdict::Baseline,
        Verdict::Held,
        Verdict::Reprocessed,
    ];

    /// A small deterministic generator (the sequences must not change between runs).
    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// Appends a record as the run commits do (record, per-source index, totals), with a
    /// watermark history row under its id as a portal's `identical` run writes one.
    fn append(store: &Store, source: &str, verdict: Verdict, finished_ms: u64, features: u64) -> u64 {
        let wtx = store.db.begin_write().expect("write");
        let run_id = super::super::runs::next_key("runs", wtx.open_table(RUNS).expect("runs").last().expect("last").map(|(k, _)| k.value())).expect("next key");
        let record = RunRecord {
            run_id,
            source_id: source.to_string(),
            lineage_id: format!("{source}-{run_id}"),
            started_ms: finished_ms.saturating_sub(5),
            finished_ms,
            verdict,
            digest: "d".into(),
            counts: RunCounts { features, changes: u64::from(verdict == Verdict::Run), ..Default::default() },
            hold_id: None,
            warnings: vec![],
            error: None,
        };
        super::super::totals::append_run(&wtx, &record).expect("append");
        let wm = Watermark { run_id, ..Watermark::for_read("d", 1, finished_ms, None, String::new()) };
        wtx.open_table(WATERMARK_HISTORY).expect("history").insert((source, run_id), super::super::watermark_rows::encode_watermark(&wm).as_slice()).expect("history row");
        wtx.commit().expect("commit");
        run_id
    }

    fn all_records(store: &Store) -> Vec<RunRecord> {
        let mut all = store.runs(None, usize::MAX).expect("runs");
        all.reverse();
        all
    }

    fn history_ids(store: &Store, source: &str) -> HashSet<u64> {
        let rtx = store.db.begin_read().expect("read");
        let t = rtx.open_table(WATERMARK_HISTORY).expect("history");
        let mut out = HashSet::new();
        for item in t.range((source, 0u64)..=(source, u64::MAX)).expect("range") {
            out.insert(item.expect("row").0.value().1);
        }
        out
    }

    /// [`sweep_all`] at `now_ms` with a retention of `retention_ms`, a batch of 2.
    fn sweep_all_at(store: &Store, now_ms: u64, retention_ms: u64) -> usize {
        let mut n = 0;
        loop {
            match store.sweep_quiet_runs(now_ms, retention_ms, 2).expect("sweep") {
                0 => return n,
                removed => n += removed,
            }
        }
    }

    /// The sweep's cursor and what it waits for below it.
    fn sweep_state(store: &Store) -> (u64, Option<Waiting>) {
        let wtx = store.db.begin_write().expect("write");
        let state = (swept_below(&wtx).expect("cursor"), read_waiting(&wtx).expect("waiting"));
        wtx.abort().expect("abort");
        state
    }

    /// [`sweep_all_at`] with a retention of 0 and any batch.
    fn sweep_all(store: &Store, before_ms: u64, batch: usize) -> usize {
        sweep_all_within(store, before_ms, 0, batch)
    }

    /// Sweeps until a pass removes nothing and moves neither its cursor nor what it waits for.
    fn sweep_all_within(store: &Store, now_ms: u64, retention_ms: u64, batch: usize) -> usize {
        let mut n = 0;
        for _ in 0..10_000 {
            let state = sweep_state(store);
            let removed = store.sweep_quiet_runs(now_ms, retention_ms, batch).expect("sweep");
            n += removed;
            if removed == 0 && sweep_state(store) == state {
                return n;
            }
        }
        panic!("the sweep never settled");
    }

    /// Runs of three sources, every verdict, appended and swept in turns with varied
    /// horizons and batch sizes, the clock now and then stepped back: after every sweep the
    /// totals `/metrics` reads are what they were, `check --store` agrees with them, every run
    /// that committed data or was held is still there and so is each source's newest, a
    /// removed run's watermark history row is gone with it, and run ids are never reused.
    #[test]
    fn the_sweep_removes_only_old_quiet_runs_and_the_totals_still_add_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let mut rng = Lcg(7);
        let mut now = 1_000_000u64;
        let mut highest_id = 0u64;
        let mut removed_total = 0;
        for round in 0..12 {
            for _ in 0..(20 + rng.below(60)) {
                now += 1 + rng.below(1_000);
                // A clock stepped back now and then.
                let finished = if rng.below(15) == 0 { now.saturating_sub(rng.below(50_000)) } else { now };
                let source = ["a", "b", "c"][rng.below(3) as usize];
                let verdict = VERDICTS[rng.below(VERDICTS.len() as u64) as usize];
                let features = if rng.below(3) == 0 { 0 } else { 100 + rng.below(10) };
                let id = append(&store, source, verdict, finished, features);
                assert!(id > highest_id, "run id {id} reused (highest so far {highest_id})");
                highest_id = id;
            }
            let before: Vec<RunRecord> = all_records(&store);
            let totals_before = store.run_totals().expect("totals");
            let horizon = now.saturating_sub(rng.below(40_000));
            let batch = 1 + rng.below(25) as usize;
            let removed = sweep_all(&store, horizon, batch);
            removed_total += removed;
            let after: Vec<RunRecord> = all_records(&store);
            assert_eq!(before.len() - after.len(), removed, "round {round}");
            assert_eq!(store.run_totals().expect("totals"), totals_before, "round {round}: the totals do not move");
            let report = store.check_consistency().expect("check");
            assert!(report.is_consistent(), "round {round}: {:?}", report.problems);
            let kept: HashSet<u64> = after.iter().map(|r| r.run_id).collect();
            for source in ["a", "b", "c"] {
                let newest = before.iter().filter(|r| r.source_id == source).map(|r| r.run_id).max();
                if let Some(newest) = newest {
                    assert!(kept.contains(&newest), "round {round}: the newest run of {source} was removed");
                    assert_eq!(store.last_run(source).expect("last").map(|r| r.run_id), Some(newest));
                }
                let history = history_ids(&store, source);
                for r in before.iter().filter(|r| r.source_id == source) {
                    assert_eq!(history.contains(&r.run_id), kept.contains(&r.run_id), "round {round}: run {} and its history row", r.run_id);
                }
            }
            for r in &before {
                if !removable(r.verdict) {
                    assert!(kept.contains(&r.run_id), "round {round}: a {} run was removed", r.verdict.as_str());
                }
                if !kept.contains(&r.run_id) {
                    assert!(r.finished_ms < horizon, "round {round}: run {} finished inside retention", r.run_id);
                }
            }
            // Everything old and quiet before the first record inside retention is gone but
            // each source's newest.
            let newest: HashSet<u64> = ["a", "b", "c"].iter().filter_map(|s| before.iter().filter(|r| r.source_id == *s).map(|r| r.run_id).max()).collect();
            for r in before.iter().take_while(|r| r.finished_ms < horizon) {
                if removable(r.verdict) && !newest.contains(&r.run_id) {
                    assert!(!kept.contains(&r.run_id), "round {round}: old quiet run {} was kept", r.run_id);
                }
            }
        }
        assert!(removed_total > 100, "the sweep removed {removed_total} runs in all");
        // The store's next run after all that still gets an id above every one given.
        assert!(append(&store, "a", Verdict::Skip, now + 1, 0) > highest_id);
    }

    /// A `runs_swept` row that does not decode is named by `check --store`, and does not stop
    /// the sweep (a second reader: it stopped it for every source): counted afresh, after
    /// which the check names the counts it lost.
    #[test]
    fn a_damaged_tally_is_named_and_counted_afresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        for i in 0..4 {
            append(&store, "s", Verdict::Skip, 10 + i, 0);
            append(&store, "t", Verdict::Skip, 10 + i, 0);
        }
        assert_eq!(store.sweep_quiet_runs(12, 0, 10).expect("sweep"), 4, "those that finished before 12");
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(RUNS_SWEPT).expect("swept").insert("s", [0xFFu8, 1].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        let problems = store.check_consistency().expect("check").problems.join("\n");
        assert!(problems.contains("runs_swept row of source s"), "{problems}");
        assert_eq!(sweep_all(&store, 100, 10), 2, "both sources go on");
        assert_eq!(all_records(&store).len(), 2, "each source's newest");
        let problems = store.check_consistency().expect("check").problems.join("\n");
        assert!(problems.contains("run totals of source s differ from its run records"), "{problems}");
        assert!(!problems.contains("source t"), "{problems}");
    }

    /// A record that was its source's newest when the sweep went past it is removed once a
    /// newer one exists (a second reader: a source run less often than the retention kept
    /// every record), and a record from a clock that ran ahead does not end every pass.
    #[test]
    fn a_record_held_back_as_the_newest_goes_later_and_one_from_the_future_is_stepped_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        const HOUR: u64 = 3_600_000;
        let daily = append(&store, "daily", Verdict::Skip, 10 * HOUR, 0);
        assert_eq!(store.sweep_quiet_runs(12 * HOUR, HOUR, 10).expect("sweep"), 0, "its source's newest");
        let next = append(&store, "daily", Verdict::Skip, 34 * HOUR, 0);
        // Before the newer one is past the horizon itself: the held-back one is looked at again.
        assert_eq!(store.sweep_quiet_runs(34 * HOUR + HOUR / 2, HOUR, 10).expect("sweep"), 1);
        let ids: Vec<u64> = all_records(&store).iter().map(|r| r.run_id).collect();
        assert_eq!(ids, vec![next], "{daily} removed");
        // A year ahead for a moment, then the right time again.
        let year = 365 * 24 * HOUR;
        append(&store, "s", Verdict::Skip, 40 * HOUR + year, 0);
        for h in 41..45 {
            append(&store, "s", Verdict::Skip, h * HOUR, 0);
        }
        let future = all_records(&store)[1].run_id;
        // A host booted at its firmware's date: a run writes its record under that clock, then
        // sweeps. The sweep steps over nothing for good (it would keep every record).
        let behind = append(&store, "s", Verdict::Skip, HOUR, 0);
        assert_eq!(sweep_all_at(&store, HOUR, 0), 0);
        assert_eq!(sweep_all_at(&store, 50 * HOUR, HOUR), 4, "the four after the future one");
        let kept: Vec<u64> = all_records(&store).iter().map(|r| r.run_id).collect();
        assert_eq!(kept, vec![next, future, behind], "the future one stepped over, the newest held back");
        assert!(store.check_consistency().expect("check").is_consistent());
    }

    /// More records from a clock that ran ahead than a pass may read (a fifth reader: a few
    /// hours a year ahead at 100 sources fill a pass's 8,000 reads) do not stop the sweep: it
    /// goes past them, removes what follows, and comes back for them once the earliest of them
    /// is past the horizon.
    #[test]
    fn a_long_stretch_from_a_clock_ahead_is_gone_past_and_come_back_to() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        const HOUR: u64 = 3_600_000;
        let year = 365 * 24 * HOUR;
        for i in 0..30 {
            append(&store, "s", Verdict::Skip, year + i * HOUR, 0);
        }
        for i in 0..10 {
            append(&store, "s", Verdict::Identical, 10 * HOUR + i, 0);
        }
        append(&store, "s", Verdict::Skip, 100 * HOUR, 0);
        // Two removals, eight reads a pass: the thirty ahead take four passes to cross.
        assert_eq!(sweep_all(&store, 200 * HOUR, 2), 10, "the ten after them");
        assert_eq!(all_records(&store).len(), 31);
        // No longer ahead but inside a 10-day retention: the cursor is not taken back to them
        // (a pass would only stop on them again, a sixth reader).
        let before = sweep_state(&store).0;
        assert_eq!(store.sweep_quiet_runs(year + 31 * HOUR, 240 * HOUR, 2).expect("sweep"), 0);
        assert_eq!(sweep_state(&store).0, before);
        // Once the first of them is past the horizon, it goes, and those still inside wait
        // without taking the cursor back (a seventh reader: it went back to the second), so
        // what comes after them goes when it is due.
        let late = append(&store, "s", Verdict::Skip, year + 100 * HOUR, 0);
        append(&store, "s", Verdict::Skip, year + 300 * HOUR, 0);
        assert_eq!(sweep_all_within(&store, year + 240 * HOUR + HOUR / 2, 240 * HOUR, 2), 2, "the first of the thirty, and the one held back as the newest");
        assert_eq!(sweep_state(&store).0, before, "the cursor stays");
        assert_eq!(sweep_all_within(&store, year + 341 * HOUR, 240 * HOUR, 2), 1 + 29, "the one after them, then the 29");
        assert!(!all_records(&store).iter().any(|r| r.run_id == late));
        assert_eq!(all_records(&store).len(), 1, "the newest");
        assert_eq!(sweep_state(&store).1, None, "nothing waited for");
        assert!(store.check_consistency().expect("check").is_consistent());
    }

    /// A record a century ahead does not keep one a day ahead waiting behind it (a seventh
    /// reader: only the lowest id was waited for), and a reading below the cursor that runs
    /// out of reads goes on where it stopped.
    #[test]
    fn records_ahead_wait_for_the_earliest_not_the_lowest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        const HOUR: u64 = 3_600_000;
        let century = 100 * 365 * 24 * HOUR;
        // A run that committed data, a century ahead: never removed, so never waited for (it
        // would hold the lowest id read again from for good).
        let committed = append(&store, "s", Verdict::Run, century, 5);
        let far = append(&store, "s", Verdict::Skip, century, 0);
        let near: Vec<u64> = (0..20).map(|i| append(&store, "s", Verdict::Skip, 50 * HOUR + i, 0)).collect();
        append(&store, "s", Verdict::Skip, HOUR, 0);
        // At hour 2 all twenty-one are ahead: stepped over, and the one after them is the newest.
        assert_eq!(sweep_all_within(&store, 2 * HOUR, HOUR, 2), 0);
        assert_eq!(sweep_state(&store).1.and_then(|w| w.still), Some((far, 50 * HOUR)));
        // Past the twenty's horizon: they go, the century one waits, eight reads a pass.
        assert_eq!(sweep_all_within(&store, 60 * HOUR, HOUR, 2), 20, "{near:?}");
        let kept: Vec<u64> = all_records(&store).iter().map(|r| r.run_id).collect();
        assert_eq!(kept.len(), 3, "the committed run, the century one and the newest: {kept:?}");
        assert_eq!(kept[..2], [committed, far]);
        assert_eq!(sweep_state(&store).1, Some(Waiting { still: Some((far, century)), resume: None }));
        assert!(store.check_consistency().expect("check").is_consistent());
    }

    /// What an earlier build of this schema wrote (the lowest id, 8 bytes) is read again at
    /// once; a damaged value waits for nothing; the 24 bytes read back as written.
    #[test]
    fn the_waiting_mark_reads_what_was_written() {
        assert_eq!(Waiting::from_bytes(&7u64.to_le_bytes()), Some(Waiting { still: None, resume: Some(7) }));
        assert_eq!(Waiting::from_bytes(&[1, 2, 3]), None);
        for w in [Waiting { still: Some((3, 99)), resume: None }, Waiting { still: None, resume: Some(5) }, Waiting { still: Some((3, 99)), resume: Some(8) }] {
            assert_eq!(Waiting::from_bytes(&w.to_bytes()), Some(w));
        }
        assert_eq!(Waiting::from_bytes(&[0xFF; 24]), None);
    }

    /// A store whose totals row was damaged is counted again from its records and what the
    /// sweep removed: the totals are what they were.
    #[test]
    fn totals_counted_again_include_what_was_swept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zw.redb");
        let store = Store::open(&path).expect("open");
        append(&store, "s", Verdict::Baseline, 5, 40);
        for i in 0..6 {
            append(&store, "s", [Verdict::Identical, Verdict::Skip][i % 2], 10 + i as u64, if i % 2 == 0 { 41 } else { 0 });
        }
        append(&store, "s", Verdict::Skip, 500, 0);
        let totals = store.run_totals().expect("totals");
        assert_eq!(sweep_all(&store, 100, 4), 6);
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(RUN_TOTALS).expect("totals").insert("s", [0xFFu8, 3].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        drop(store);
        let store = Store::open(&path).expect("reopen");
        let sorted = |mut t: Vec<(String, super::super::SourceRunTotals)>| {
            for (_, t) in &mut t {
                t.verdicts.sort_by_key(|(v, _)| v.as_str());
            }
            t
        };
        assert_eq!(sorted(store.run_totals().expect("totals")), sorted(totals), "41 features, from a removed identical run");
        assert!(store.check_consistency().expect("check").is_consistent());
    }
}
