//! Running totals of the audit ledger (rows per outcome) and of the run records (runs per
//! source and verdict, changes committed, the latest layer size), written in the transaction
//! that writes the rows they count.
//!
//! They exist for `/metrics`, which a Prometheus server scrapes every few seconds. The
//! ledger and the run records only grow: a county baseline writes one audit row per parcel an
//! AOI touches, and every probe of every source writes a run record (100 sources probed every
//! 5 minutes: ~29,000 a day). Counting them per scrape decoded all of them: seconds of CPU per
//! scrape after a few county baselines, under a read transaction held as long, during which
//! redb cannot reuse the pages that commits free (the file grows). The totals are a few rows.
//!
//! Invariant: a total changes only in the write transaction that appends the rows it counts,
//! so in every committed state the totals equal a recount of the rows (`check --store`
//! recounts them). A store written before schema 10 has rows but no totals; they are counted
//! once when it is opened ([`count_missing`]), which also counts again, on every open to write,
//! a source whose totals row does not decode.

use super::codec::{decode, encode};
use super::runs::codec_err;
use super::tables::{AUDIT, AUDIT_TOTALS, RUNS, RUNS_SWEPT, RUN_TOTALS};
use super::{Store, StoreError};
use crate::model::{AuditRow, Outcome, RunRecord, Verdict};
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What one source's run records add up to (`run_totals`, one row per source).
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct SourceRunTotals {
    /// Runs per verdict, in the order each verdict first occurred (one absent: none).
    pub verdicts: Vec<(Verdict, u64)>,
    /// Change events committed by the source's `run` and `reprocessed` runs.
    pub changes: u64,
    /// Features read by the latest run that read any (0: none has).
    pub latest_features: u64,
    /// The source's latest run (`GET /v1/sources` reads it with one lookup, however many runs
    /// of other sources came after it).
    pub last_run_id: u64,
}

impl SourceRunTotals {
    /// Counts one more run record (records are added in run-id order).
    fn add(&mut self, record: &RunRecord) {
        count_verdict(&mut self.verdicts, record.verdict, 1);
        if matches!(record.verdict, Verdict::Run | Verdict::Reprocessed) {
            self.changes = self.changes.saturating_add(record.counts.changes);
        }
        if record.counts.features > 0 {
            self.latest_features = record.counts.features;
        }
        self.last_run_id = self.last_run_id.max(record.run_id);
    }

    /// Every run of the source, whatever its verdict.
    pub fn runs(&self) -> u64 {
        self.verdicts.iter().fold(0, |sum, (_, n)| sum.saturating_add(*n))
    }
}

/// Adds `n` runs of `verdict` to a list of runs per verdict (in the order each verdict first
/// occurred).
pub(super) fn count_verdict(verdicts: &mut Vec<(Verdict, u64)>, verdict: Verdict, n: u64) {
    match verdicts.iter_mut().find(|(v, _)| *v == verdict) {
        Some((_, m)) => *m = m.saturating_add(n),
        None => verdicts.push((verdict, n)),
    }
}

/// Audit rows per outcome, counted while a batch is appended and added to the totals once.
#[derive(Default)]
pub(super) struct OutcomeTally(Vec<(Outcome, u64)>);

impl OutcomeTally {
    pub(super) fn count(&mut self, outcome: Outcome) {
        match self.0.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, n)) => *n = n.saturating_add(1),
            None => self.0.push((outcome, 1)),
        }
    }

    /// Adds the tally to `audit_totals` in the transaction that appended the rows.
    pub(super) fn commit_to(&self, wtx: &WriteTransaction) -> Result<(), StoreError> {
        if self.0.is_empty() {
            return Ok(());
        }
        let mut t = wtx.open_table(AUDIT_TOTALS)?;
        for (outcome, n) in &self.0 {
            let before = t.get(outcome.as_str())?.map(|v| v.value()).unwrap_or(0);
            t.insert(outcome.as_str(), before.saturating_add(*n))?;
        }
        Ok(())
    }
}

/// Writes a run record, counts it in its source's totals and indexes it by its source: the
/// one way a run record is written.
pub(super) fn append_run(wtx: &WriteTransaction, record: &RunRecord) -> Result<(), StoreError> {
    wtx.open_table(RUNS)?.insert(record.run_id, encode(record).as_slice())?;
    super::history_index::index_run(wtx, &record.source_id, record.run_id)?;
    let source = record.source_id.as_str();
    let stored = {
        let t = wtx.open_table(RUN_TOTALS)?;
        let v = t.get(source)?;
        v.map(|v| decode::<SourceRunTotals>(v.value()))
    };
    let totals = match stored {
        Some(Ok(mut totals)) => {
            totals.add(record);
            totals
        }
        // A damaged totals row must not stop the source's runs: it is counted again from the
        // records (which include this one), and the damage is said.
        Some(Err(why)) => {
            tracing::error!(source, %why, "the run totals of this source do not decode; counted again from its run records");
            recount_source(wtx, source)?
        }
        // The source's first run (`count_missing` counted every source of an upgraded store).
        None => {
            let mut totals = SourceRunTotals::default();
            totals.add(record);
            totals
        }
    };
    wtx.open_table(RUN_TOTALS)?.insert(source, encode(&totals).as_slice())?;
    Ok(())
}

/// One source's totals counted from its run records (every record is read; a rare path).
fn recount_source(wtx: &WriteTransaction, source: &str) -> Result<SourceRunTotals, StoreError> {
    Ok(recount_sources(wtx, &[source.to_string()])?.remove(source).unwrap_or_default())
}

/// Several sources' totals counted from their run records in one pass over them, with what
/// the retention sweep removed of them added back.
fn recount_sources(wtx: &WriteTransaction, sources: &[String]) -> Result<BTreeMap<String, SourceRunTotals>, StoreError> {
    let mut recount = Recount::default();
    for source in sources {
        recount.runs.insert(source.clone(), SourceRunTotals::default());
    }
    for item in wtx.open_table(RUNS)?.iter()? {
        let (_, v) = item?;
        if let Ok(r) = decode::<RunRecord>(v.value()) {
            if recount.runs.contains_key(&r.source_id) {
                recount.run(&r);
            }
        }
    }
    let (mut swept, damaged) = super::run_retention::read_swept(&wtx.open_table(RUNS_SWEPT)?)?;
    swept.retain(|source, _| recount.runs.contains_key(source));
    recount.add_swept(&swept);
    for (source, why) in damaged.iter().filter(|(source, _)| recount.runs.contains_key(source)) {
        tracing::error!(source, %why, "run totals counted again without the records the retention sweep removed");
    }
    Ok(recount.runs)
}

/// Counts the ledger and the run records of a store that has them but no totals (written
/// before schema 10), and counts again a source whose totals row does not decode. Rows that
/// do not decode are left out with a warning (`check --store` names them). Returns the audit
/// rows and run records counted for the missing totals (0, 0: none were missing).
pub(super) fn count_missing(wtx: &WriteTransaction) -> Result<(u64, u64), StoreError> {
    let mut audit_rows = 0u64;
    if wtx.open_table(AUDIT_TOTALS)?.is_empty()? && !wtx.open_table(AUDIT)?.is_empty()? {
        let mut tally = OutcomeTally::default();
        let mut unreadable = 0u64;
        for item in wtx.open_table(AUDIT)?.iter()? {
            let (_, v) = item?;
            match decode::<AuditRow>(v.value()) {
                Ok(row) => {
                    tally.count(row.outcome);
                    audit_rows += 1;
                }
                Err(_) => unreadable += 1,
            }
        }
        if unreadable > 0 {
            tracing::warn!(unreadable, "audit rows that do not decode are not in the outcome totals (zonewatch check --store names them)");
        }
        tally.commit_to(wtx)?;
    }
    let mut run_records = 0u64;
    if wtx.open_table(RUN_TOTALS)?.is_empty()? && !wtx.open_table(RUNS)?.is_empty()? {
        let mut by_source: BTreeMap<String, SourceRunTotals> = BTreeMap::new();
        let mut unreadable = 0u64;
        for item in wtx.open_table(RUNS)?.iter()? {
            let (_, v) = item?;
            match decode::<RunRecord>(v.value()) {
                Ok(r) => {
                    by_source.entry(r.source_id.clone()).or_default().add(&r);
                    run_records += 1;
                }
                Err(_) => unreadable += 1,
            }
        }
        if unreadable > 0 {
            tracing::warn!(unreadable, "run records that do not decode are not in the run totals (zonewatch check --store names them)");
        }
        let mut t = wtx.open_table(RUN_TOTALS)?;
        for (source, totals) in &by_source {
            t.insert(source.as_str(), encode(totals).as_slice())?;
        }
    }
    // A totals row that does not decode (damage) is counted again from its source's records
    // here as well as by the source's next run: a source no longer configured has none.
    let damaged: Vec<String> = {
        let t = wtx.open_table(RUN_TOTALS)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (k, v) = item?;
            if decode::<SourceRunTotals>(v.value()).is_err() {
                out.push(k.value().to_string());
            }
        }
        out
    };
    if !damaged.is_empty() {
        tracing::warn!(sources = ?damaged, "run totals that did not decode; counted again from the run records");
        let mut t = wtx.open_table(RUN_TOTALS)?;
        for (source, totals) in recount_sources(wtx, &damaged)? {
            t.insert(source.as_str(), encode(&totals).as_slice())?;
        }
    }
    Ok((audit_rows, run_records))
}

/// Audit rows per outcome as the totals have them, every outcome in [`Outcome::ALL`] order
/// (0 where none).
pub(super) fn read_audit_totals<T: ReadableTable<&'static str, u64>>(t: &T) -> Result<Vec<(Outcome, u64)>, StoreError> {
    let mut out = Vec::with_capacity(Outcome::ALL.len());
    for outcome in Outcome::ALL {
        out.push((outcome, t.get(outcome.as_str())?.map(|v| v.value()).unwrap_or(0)));
    }
    Ok(out)
}

impl Store {
    /// Audit rows per outcome (every outcome, in [`Outcome::ALL`] order), read from the totals.
    pub fn audit_totals(&self) -> Result<Vec<(Outcome, u64)>, StoreError> {
        let rtx = self.db.begin_read()?;
        read_audit_totals(&rtx.open_table(AUDIT_TOTALS)?)
    }

    /// The source's latest run record: one lookup through its totals. A totals row that does
    /// not decode, or that names a run that is not there (damage), falls back to reading the
    /// run records back from the newest. A source without a totals row has never run (every
    /// run record writes one); it is answered without reading the records.
    pub fn last_run(&self, source: &str) -> Result<Option<RunRecord>, StoreError> {
        let found = {
            let rtx = self.db.begin_read()?;
            let totals = rtx.open_table(RUN_TOTALS)?;
            let Some(v) = totals.get(source)? else { return Ok(None) };
            match decode::<SourceRunTotals>(v.value()) {
                Ok(t) => match rtx.open_table(RUNS)?.get(t.last_run_id)? {
                    Some(r) => decode::<RunRecord>(r.value()).ok().filter(|r| r.source_id == source),
                    None => None,
                },
                Err(_) => None,
            }
        };
        match found {
            Some(run) => Ok(Some(run)),
            None => Ok(self.runs(Some(source), 1)?.into_iter().next()),
        }
    }

    /// Each source's run totals, by source id.
    pub fn run_totals(&self) -> Result<Vec<(String, SourceRunTotals)>, StoreError> {
        let rtx = self.db.begin_read()?;
        read_run_totals(&rtx.open_table(RUN_TOTALS)?)
    }
}

/// Each source's run totals, by source id. A row that does not decode is left out with an
/// error log: a counter must not fail `/metrics` (the source's next run, or the store's next
/// open to write, counts it again).
pub(super) fn read_run_totals<T: ReadableTable<&'static str, &'static [u8]>>(t: &T) -> Result<Vec<(String, SourceRunTotals)>, StoreError> {
    let mut out = Vec::new();
    for item in t.iter()? {
        let (k, v) = item?;
        match decode::<SourceRunTotals>(v.value()) {
            Ok(totals) => out.push((k.value().to_string(), totals)),
            Err(m) => tracing::error!(source = k.value(), error = %codec_err("run_totals", m), "run totals left out"),
        }
    }
    Ok(out)
}

/// What `check --store` compares: the totals recounted from the rows.
#[derive(Default)]
pub(super) struct Recount {
    pub audit: OutcomeTally,
    pub runs: BTreeMap<String, SourceRunTotals>,
    /// Per source, the run id the recount's `latest_features` came from.
    features_run: BTreeMap<String, u64>,
}

impl Recount {
    pub(super) fn audit_row(&mut self, outcome: Outcome) {
        self.audit.count(outcome);
    }

    pub(super) fn run(&mut self, record: &RunRecord) {
        self.runs.entry(record.source_id.clone()).or_default().add(record);
        if record.counts.features > 0 {
            self.features_run.insert(record.source_id.clone(), record.run_id);
        }
    }

    /// Adds back what the run retention sweep removed (`run_retention.rs`), once every record
    /// there is has been counted.
    pub(super) fn add_swept(&mut self, swept: &BTreeMap<String, super::run_retention::SweptRuns>) {
        for (source, removed) in swept {
            let totals = self.runs.entry(source.clone()).or_default();
            for (verdict, n) in &removed.verdicts {
                count_verdict(&mut totals.verdicts, *verdict, *n);
            }
            if removed.latest_features_run > self.features_run.get(source).copied().unwrap_or(0) {
                totals.latest_features = removed.latest_features;
            }
        }
    }

    /// One sentence per total that differs from the recount (`/metrics` shows the totals;
    /// the rows are the record).
    pub(super) fn differences(
        &self,
        audit_totals: &[(Outcome, u64)],
        run_totals: &BTreeMap<String, Result<SourceRunTotals, String>>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (outcome, stored) in audit_totals {
            let counted = self.audit.0.iter().find(|(o, _)| o == outcome).map(|(_, n)| *n).unwrap_or(0);
            if counted != *stored {
                out.push(format!(
                    "audit totals: {stored} {} rows counted, the ledger has {counted} (/metrics shows the totals; the ledger is the record)",
                    outcome.as_str()
                ));
            }
        }
        let empty = SourceRunTotals::default();
        for source in self.runs.keys().chain(run_totals.keys()).collect::<std::collections::BTreeSet<_>>() {
            let counted = self.runs.get(source).unwrap_or(&empty);
            match run_totals.get(source) {
                Some(Err(why)) => out.push(format!("run totals of source {source} do not decode: {why} (counted again when the store is next opened to write)")),
                Some(Ok(stored)) if !same_totals(stored, counted) => out.push(format!(
                    "run totals of source {source} differ from its run records: {} runs, {} changes counted, the records have {} runs, {} changes (/metrics shows the totals)",
                    stored.runs(),
                    stored.changes,
                    counted.runs(),
                    counted.changes
                )),
                None if counted.runs() > 0 => out.push(format!("source {source} has {} run records but no run totals", counted.runs())),
                _ => {}
            }
        }
        out
    }
}

/// Equal totals, whatever order their verdicts were first seen in.
fn same_totals(a: &SourceRunTotals, b: &SourceRunTotals) -> bool {
    let sorted = |t: &SourceRunTotals| {
        let mut v: Vec<(&'static str, u64)> = t.verdicts.iter().map(|(v, n)| (v.as_str(), *n)).collect();
        v.sort_unstable();
        v
    };
    a.changes == b.changes && a.latest_features == b.latest_features && a.last_run_id == b.last_run_id && sorted(a) == sorted(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::runs::append_audits;
    use crate::store::RunNote;

    fn row(outcome: Outcome) -> AuditRow {
        crate::model::sample_audit_row(0, outcome)
    }

    fn note(verdict: Verdict) -> RunNote<'static> {
        RunNote { verdict, digest: "", hold_id: None, error: None }
    }

    /// What the totals must equal: a recount of every run record and audit row.
    fn recounted(store: &Store) -> (Vec<(Outcome, u64)>, BTreeMap<String, SourceRunTotals>) {
        let mut tally = OutcomeTally::default();
        for r in store.audit(&Default::default()).expect("audit") {
            tally.count(r.outcome);
        }
        let audit = Outcome::ALL.iter().map(|o| (*o, tally.0.iter().find(|(t, _)| t == o).map(|(_, n)| *n).unwrap_or(0))).collect();
        let mut runs: BTreeMap<String, SourceRunTotals> = BTreeMap::new();
        let mut all = store.runs(None, usize::MAX).expect("runs");
        all.reverse();
        for r in &all {
            runs.entry(r.source_id.clone()).or_default().add(r);
        }
        (audit, runs)
    }

    fn stored(store: &Store) -> (Vec<(Outcome, u64)>, BTreeMap<String, SourceRunTotals>) {
        (store.audit_totals().expect("audit totals"), store.run_totals().expect("run totals").into_iter().collect())
    }

    /// Rows appended in varied batches, run records of several sources and verdicts: the
    /// totals equal a recount after every commit, `check --store` agrees, and a store whose
    /// totals are missing (written before schema 10) gets them counted when it is opened.
    #[test]
    fn totals_follow_every_commit_and_are_counted_for_an_older_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zw.redb");
        let store = Store::open(&path).expect("open");
        let verdicts = [Verdict::Skip, Verdict::Failed, Verdict::Held, Verdict::SkippedOverlap, Verdict::Skip];
        for i in 0..40u64 {
            let wtx = store.db.begin_write().expect("write");
            let mut rows: Vec<AuditRow> = (0..(i % 7)).map(|j| row(Outcome::ALL[((i * 3 + j) % 10) as usize])).collect();
            append_audits(&wtx, &mut rows).expect("append");
            wtx.commit().expect("commit");
            let source = ["a", "b", "c"][(i % 3) as usize];
            store.record_run_note(source, i, i + 1, note(verdicts[(i % 5) as usize])).expect("note");
            assert_eq!(stored(&store), recounted(&store), "after step {i}");
        }
        let report = store.check_consistency().expect("check");
        assert!(report.is_consistent(), "{:?}", report.problems);
        let before = stored(&store);
        assert_eq!(before.1["a"].runs(), 14);
        for source in ["a", "b", "c", "never"] {
            let walked = store.runs(Some(source), 1).expect("runs").into_iter().next().map(|r| r.run_id);
            assert_eq!(store.last_run(source).expect("last run").map(|r| r.run_id), walked, "{source}");
        }

        // A store of schema 9: the same rows, no totals.
        let wtx = store.db.begin_write().expect("write");
        wtx.delete_table(AUDIT_TOTALS).expect("drop");
        wtx.delete_table(RUN_TOTALS).expect("drop");
        wtx.commit().expect("commit");
        drop(store);
        let store = Store::open(&path).expect("reopen");
        assert_eq!(stored(&store), before, "counted when opened");
        let report = store.check_consistency().expect("check");
        assert!(report.is_consistent(), "{:?}", report.problems);
    }

    /// A damaged totals row is named by `check --store`, does not stop `/metrics` (left out)
    /// nor the source's next run, which counts the source again from its records; nor does
    /// it outlive the store's next open (a source no longer configured has no next run).
    #[test]
    fn a_damaged_run_totals_row_is_named_and_counted_again_by_the_next_run_or_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zw.redb");
        let store = Store::open(&path).expect("open");
        for i in 0..3 {
            store.record_run_note("s", i, i + 1, note(Verdict::Failed)).expect("note");
        }
        store.record_run_note("t", 9, 10, note(Verdict::Skip)).expect("note");
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(RUN_TOTALS).expect("totals").insert("s", [0xFFu8, 3].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        let all = store.check_consistency().expect("check").problems.join("\n");
        assert!(all.contains("run totals of source s do not decode"), "{all}");
        assert_eq!(store.run_totals().expect("totals").len(), 1, "the damaged row is left out, t is read");
        assert_eq!(store.stats().expect("stats").runs, 1);
        store.record_run_note("s", 5, 6, note(Verdict::Skip)).expect("a run goes on");
        assert_eq!(stored(&store), recounted(&store));
        assert!(store.check_consistency().expect("check").is_consistent());
        // Damaged again, then the store reopened: counted again on the way.
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(RUN_TOTALS).expect("totals").insert("s", [0xFFu8, 3].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        drop(store);
        let store = Store::open(&path).expect("reopen");
        assert_eq!(stored(&store), recounted(&store));
        assert!(store.check_consistency().expect("check").is_consistent());
    }
}
