//! Two indexes of the append-only history, so that what the dashboard polls costs a page and
//! not the history:
//!
//! * `audit_by_outcome`: (outcome, seq) for every audit row but the `suppressed` rows a
//!   baseline primed ([`AuditClass`] says why those are not).
//! * `runs_by_source`: (source id, run id) for every run record.
//!
//! Why they exist: the dashboard asks every 5 s for
//! `/v1/audit?order=desc&limit=20&outcome=queued,sent,duplicate,dead_letter,held` and for
//! `/v1/changes/recent`. Both read the ledger back from its newest row until a page was full,
//! so when fewer rows matched than a page, they read the whole ledger on every poll. That is
//! the normal state of a new install: a county baseline writes one `suppressed` row per parcel
//! an AOI touches (hundreds of thousands), and the first real change comes days later. In the
//! same way `/v1/runs?source=X` read back through every other source's runs (100 sources
//! probed every 5 minutes write ~29,000 run records a day).
//!
//! Invariant: an entry is written in the transaction that appends its row (`append_audits`,
//! `append_run`, the one way each is written), so in every committed state each row (but a
//! baseline's primed one) has exactly one entry and each entry names its row. `check --store`
//! compares them. A store written before schema 11 is indexed once when it is opened
//! ([`index_missing`]).

use super::codec::decode;
use super::tables::{AUDIT, AUDIT_BY_OUTCOME, RUNS, RUNS_BY_SOURCE};
use super::StoreError;
use crate::model::{AuditRow, Outcome, RunRecord};
use redb::{ReadableTable, ReadableTableMetadata, WriteTransaction};

/// The `detail` of the `suppressed` rows a baseline primes (a first ingest, or a held one
/// resolved): one per parcel an AOI touches, the bulk of a ledger.
pub const BASELINE_DETAIL: &str = "baseline";

/// Whether a row is one of the `suppressed` rows a baseline primed.
pub fn is_baseline_prime(outcome: Outcome, detail: &str) -> bool {
    outcome == Outcome::Suppressed && detail == BASELINE_DETAIL
}

/// What `audit_by_outcome` is keyed by: a row's outcome. The `suppressed` rows a baseline
/// primed are not indexed: they are the bulk of a ledger (one per parcel an AOI touches, every
/// baseline), an entry each would cost a county baseline's commit time, and a walk of the
/// ledger meets them densely. So a query that leaves them out (the dashboard's, the map of
/// recent changes) reads only the index, and one that wants them walks the ledger.
/// The codes are stored: never renumber one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AuditClass(u8);

impl AuditClass {
    /// The class of a row with this outcome and detail (None: a baseline's primed row, not
    /// indexed).
    pub fn of(outcome: Outcome, detail: &str) -> Option<AuditClass> {
        (!is_baseline_prime(outcome, detail)).then(|| AuditClass::of_outcome(outcome))
    }

    fn of_outcome(outcome: Outcome) -> AuditClass {
        AuditClass(match outcome {
            Outcome::Queued => 0,
            Outcome::Sent => 1,
            Outcome::Duplicate => 2,
            Outcome::Suppressed => 3,
            Outcome::DeadLetter => 4,
            Outcome::Quarantined => 5,
            Outcome::Held => 6,
            Outcome::EndpointDisabled => 7,
            Outcome::EndpointEnabled => 8,
            Outcome::Released => 9,
        })
    }

    /// The classes holding every row of these outcomes, or None when the index cannot serve
    /// them: `suppressed` wanted with the baseline's primed rows.
    pub fn covering(outcomes: &[Outcome], without_baseline_primes: bool) -> Option<Vec<AuditClass>> {
        if outcomes.contains(&Outcome::Suppressed) && !without_baseline_primes {
            return None;
        }
        let mut out: Vec<AuditClass> = outcomes.iter().map(|o| AuditClass::of_outcome(*o)).collect();
        out.sort();
        out.dedup();
        Some(out)
    }
}

/// Indexes one appended audit row (in the transaction that appends it); a baseline's primed
/// row is not indexed.
pub(super) fn index_audit_row(t: &mut redb::Table<(u8, u64), ()>, seq: u64, outcome: Outcome, detail: &str) -> Result<(), StoreError> {
    if let Some(class) = AuditClass::of(outcome, detail) {
        t.insert((class.0, seq), ())?;
    }
    Ok(())
}

/// Indexes one appended run record (in the transaction that appends it).
pub(super) fn index_run(wtx: &WriteTransaction, source_id: &str, run_id: u64) -> Result<(), StoreError> {
    wtx.open_table(RUNS_BY_SOURCE)?.insert((source_id, run_id), ())?;
    Ok(())
}

/// Walks the seqs of the audit rows of `classes` with `from <= seq < before`, merged into
/// ledger order (newest first when `desc`), until `visit` answers false. Reads one index entry
/// per row visited, whatever the ledger holds of other classes.
pub(super) fn walk_audit_classes(
    index: &impl ReadableTable<(u8, u64), ()>,
    classes: &[AuditClass],
    from: u64,
    before: Option<u64>,
    desc: bool,
    mut visit: impl FnMut(u64) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    let end = before.unwrap_or(u64::MAX);
    if from >= end {
        return Ok(());
    }
    let mut ranges = Vec::with_capacity(classes.len());
    for c in classes {
        // `before = None` ends below u64::MAX, which no seq reaches (they count from 1).
        ranges.push(index.range((c.0, from)..(c.0, end))?);
    }
    let step = |r: &mut redb::Range<'_, (u8, u64), ()>| -> Result<Option<u64>, StoreError> {
        let item = if desc { r.next_back() } else { r.next() };
        Ok(match item {
            Some(item) => Some(item?.0.value().1),
            None => None,
        })
    };
    let mut heads = Vec::with_capacity(ranges.len());
    for r in &mut ranges {
        heads.push(step(r)?);
    }
    loop {
        // The next seq in ledger order among the classes' heads (a handful of classes).
        let next = heads
            .iter()
            .enumerate()
            .filter_map(|(i, h)| h.map(|seq| (i, seq)))
            .reduce(|a, b| if (b.1 > a.1) == desc { b } else { a });
        let Some((i, seq)) = next else { return Ok(()) };
        if !visit(seq)? {
            return Ok(());
        }
        heads[i] = step(&mut ranges[i])?;
    }
}

/// Walks the run ids of `source_id` below `before`, newest first, until `visit` answers false.
pub(super) fn walk_source_runs(
    index: &impl ReadableTable<(&'static str, u64), ()>,
    source_id: &str,
    before: u64,
    mut visit: impl FnMut(u64) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    for item in index.range((source_id, 0)..(source_id, before))?.rev() {
        if !visit(item?.0.value().1)? {
            break;
        }
    }
    Ok(())
}

/// Indexes the ledger and the run records of a store written before schema 11, which had no
/// indexes (the caller knows: the tables did not exist). Rows that do not decode are left out
/// with a warning (`check --store` names them). Returns the audit rows and run records
/// indexed.
pub(super) fn index_missing(wtx: &WriteTransaction) -> Result<(u64, u64), StoreError> {
    let mut audit_rows = 0u64;
    {
        let mut index = wtx.open_table(AUDIT_BY_OUTCOME)?;
        let mut unreadable = 0u64;
        for item in wtx.open_table(AUDIT)?.iter()? {
            let (k, v) = item?;
            match decode::<AuditRow>(v.value()) {
                Ok(row) => {
                    if AuditClass::of(row.outcome, &row.detail).is_some() {
                        audit_rows += 1;
                    }
                    index_audit_row(&mut index, k.value(), row.outcome, &row.detail)?;
                }
                Err(_) => unreadable += 1,
            }
        }
        if unreadable > 0 {
            tracing::warn!(unreadable, "audit rows that do not decode are not in the outcome index (zonewatch check --store names them)");
        }
    }
    let mut run_records = 0u64;
    {
        let mut index = wtx.open_table(RUNS_BY_SOURCE)?;
        let mut unreadable = 0u64;
        for item in wtx.open_table(RUNS)?.iter()? {
            let (k, v) = item?;
            match decode::<RunRecord>(v.value()) {
                Ok(r) => {
                    index.insert((r.source_id.as_str(), k.value()), ())?;
                    run_records += 1;
                }
                Err(_) => unreadable += 1,
            }
        }
        if unreadable > 0 {
            tracing::warn!(unreadable, "run records that do not decode are not in the per-source index (zonewatch check --store names them)");
        }
    }
    Ok((audit_rows, run_records))
}

/// What `check --store` says of the two indexes: every decodable row in its index under the
/// right key, and no entry more. Fed one row at a time by the check's own passes over the
/// ledger and the run records (nothing is collected per row: those grow for ever), then
/// [`IndexCheck::finish`]ed. Absent tables (a file before schema 11) are not checked.
pub(super) struct IndexCheck {
    audit: Option<redb::ReadOnlyTable<(u8, u64), ()>>,
    runs: Option<redb::ReadOnlyTable<(&'static str, u64), ()>>,
    audit_found: u64,
    runs_found: u64,
    /// Rows named already as not decoding: an entry naming one is not named again.
    undecodable_audit: std::collections::HashSet<u64>,
    undecodable_runs: std::collections::HashSet<u64>,
    out: Vec<String>,
    max: usize,
}

impl IndexCheck {
    pub(super) fn open(rtx: &redb::ReadTransaction, max: usize) -> Result<Self, StoreError> {
        Ok(IndexCheck {
            audit: super::check::open_optional(rtx, AUDIT_BY_OUTCOME)?,
            runs: super::check::open_optional(rtx, RUNS_BY_SOURCE)?,
            audit_found: 0,
            runs_found: 0,
            undecodable_audit: Default::default(),
            undecodable_runs: Default::default(),
            out: Vec::new(),
            max,
        })
    }

    fn say(&mut self, text: String) {
        if self.out.len() < self.max {
            self.out.push(text);
        }
    }

    /// One decodable audit row: its entry must be there (a baseline's primed row has none).
    pub(super) fn audit_row(&mut self, seq: u64, row: &AuditRow) -> Result<(), StoreError> {
        let (Some(index), Some(class)) = (&self.audit, AuditClass::of(row.outcome, &row.detail)) else { return Ok(()) };
        if index.get((class.0, seq))?.is_some() {
            self.audit_found += 1;
        } else {
            self.say(format!("audit row {seq} is not in the outcome index (audit_by_outcome) under its outcome; outcome-filtered pages miss it"));
        }
        Ok(())
    }

    pub(super) fn audit_undecodable(&mut self, seq: u64) {
        self.undecodable_audit.insert(seq);
    }

    /// One decodable run record: its entry must be there.
    pub(super) fn run(&mut self, run_id: u64, source: &str) -> Result<(), StoreError> {
        let Some(index) = &self.runs else { return Ok(()) };
        if index.get((source, run_id))?.is_some() {
            self.runs_found += 1;
        } else {
            self.say(format!("run record {run_id} is not in the per-source run index (runs_by_source); /v1/runs?source={source} misses it"));
        }
        Ok(())
    }

    pub(super) fn run_undecodable(&mut self, run_id: u64) {
        self.undecodable_runs.insert(run_id);
    }

    /// The entries that name no row of theirs: looked for only when an index holds more
    /// entries than rows were found in it (damage), each looked up in its table.
    pub(super) fn finish(mut self, rtx: &redb::ReadTransaction) -> Result<Vec<String>, StoreError> {
        if let Some(index) = self.audit.take() {
            if index.len()? != self.audit_found {
                let ledger = rtx.open_table(AUDIT)?;
                for item in index.iter()? {
                    if self.out.len() >= self.max {
                        break;
                    }
                    let (class, seq) = item?.0.value();
                    if self.undecodable_audit.contains(&seq) {
                        continue;
                    }
                    let row = ledger.get(seq)?.map(|v| decode::<AuditRow>(v.value()));
                    match row.map(|r| r.map(|r| AuditClass::of(r.outcome, &r.detail))) {
                        Some(Ok(Some(c))) if c.0 == class => {}
                        Some(Ok(Some(_))) => self.say(format!("the outcome index names audit row {seq} under another outcome than the row's")),
                        Some(Ok(None)) => self.say(format!("the outcome index names audit row {seq}, a baseline's primed row (those are not indexed)")),
                        Some(Err(_)) | None => self.say(format!("the outcome index names audit row {seq}, which is not in the ledger")),
                    }
                }
            }
        }
        if let Some(index) = self.runs.take() {
            if index.len()? != self.runs_found {
                let records = rtx.open_table(RUNS)?;
                for item in index.iter()? {
                    if self.out.len() >= self.max {
                        break;
                    }
                    let (k, _) = item?;
                    let (source, run_id) = k.value();
                    if self.undecodable_runs.contains(&run_id) {
                        continue;
                    }
                    let record = records.get(run_id)?.map(|v| decode::<RunRecord>(v.value()));
                    match record {
                        Some(Ok(r)) if r.source_id == source => {}
                        Some(Ok(_)) => self.say(format!("the per-source run index names run {run_id} under source {source:?}, not the record's")),
                        Some(Err(_)) | None => self.say(format!("the per-source run index names run {run_id}, which is not a run record")),
                    }
                }
            }
        }
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::runs::append_audits;
    use crate::store::{AuditFilter, RunNote, Store};
    use crate::model::Verdict;

    /// A small deterministic generator (xorshift64*), so a failure names its seed.
    struct Dice(u64);
    impl Dice {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
        }
    }

    /// A ledger of mostly baseline primes with rarer outcomes between them, appended in
    /// batches of varied size.
    fn ledger(store: &Store, dice: &mut Dice, rows: u64) {
        let mut written = 0;
        while written < rows {
            let batch = (1 + dice.below(40)).min(rows - written);
            let wtx = store.db.begin_write().expect("write");
            let mut batch: Vec<AuditRow> = (0..batch)
                .map(|_| {
                    let mut row = crate::model::sample_audit_row(0, Outcome::Suppressed);
                    let pick = dice.below(20);
                    if pick < 12 {
                        row.detail = BASELINE_DETAIL.into();
                    } else {
                        row.outcome = Outcome::ALL[dice.below(Outcome::ALL.len() as u64) as usize];
                        row.detail = ["", "reprocess", "hold_primed", "below_min_severity: info < notice"][dice.below(4) as usize].into();
                    }
                    row.watcher_id = Some(["w1", "w2"][dice.below(2) as usize].into());
                    row
                })
                .collect();
            written += batch.len() as u64;
            append_audits(&wtx, &mut batch).expect("append");
            wtx.commit().expect("commit");
        }
    }

    /// Every filter a page can have, read through the index, equals the ledger read whole and
    /// filtered: any subset of outcomes, with and without the baseline primes, ascending from
    /// a seq or descending below one, with another filter on top, stopped at any page size.
    #[test]
    fn pages_read_through_the_outcome_index_equal_the_ledger_filtered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let mut dice = Dice(0x005E_ED0F_1DE5);
        ledger(&store, &mut dice, 3_000);
        let all = store.audit(&AuditFilter::default()).expect("whole ledger");
        assert_eq!(all.len(), 3_000);
        for round in 0..400 {
            let outcomes: Vec<Outcome> = Outcome::ALL.into_iter().filter(|_| dice.below(3) == 0).collect();
            let without_baseline_primes = dice.below(2) == 0;
            let watcher = (dice.below(4) == 0).then(|| "w2".to_string());
            let desc = dice.below(2) == 0;
            let bound = 1 + dice.below(3_100);
            let page = 1 + dice.below(60) as usize;
            let filter = AuditFilter {
                outcomes: Some(outcomes.clone()),
                without_baseline_primes,
                watcher: watcher.clone(),
                since_seq: (!desc).then_some(bound),
                ..Default::default()
            };
            let mut got = Vec::new();
            store
                .audit_walk(&filter, desc, desc.then_some(bound), |r| {
                    got.push(r.seq);
                    got.len() < page
                })
                .expect("walk");
            let wanted = |r: &&AuditRow| {
                outcomes.contains(&r.outcome)
                    && !(without_baseline_primes && is_baseline_prime(r.outcome, &r.detail))
                    && watcher.as_ref().is_none_or(|w| r.watcher_id.as_ref() == Some(w))
                    && if desc { r.seq < bound } else { r.seq >= bound }
            };
            let expected: Vec<u64> = if desc {
                all.iter().rev().filter(wanted).take(page).map(|r| r.seq).collect()
            } else {
                all.iter().filter(wanted).take(page).map(|r| r.seq).collect()
            };
            assert_eq!(got, expected, "round {round}: {outcomes:?} without primes {without_baseline_primes}, desc {desc} from {bound}");
        }
    }

    /// One source's runs, paged through the per-source index, equal every run record read
    /// back and filtered; and a store written before schema 11 (rows, no indexes) is indexed
    /// when it is opened, which `check --store` confirms. A missing or extra entry is named.
    #[test]
    fn runs_by_source_page_like_the_records_and_an_older_store_is_indexed_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zw.redb");
        let store = Store::open(&path).expect("open");
        let mut dice = Dice(77);
        for i in 0..300u64 {
            let source = ["a", "b", "c", "rare"][if dice.below(50) == 0 { 3 } else { dice.below(3) as usize }];
            let note = RunNote { verdict: Verdict::Skip, digest: "", hold_id: None, error: None };
            store.record_run_note(source, i, i + 1, note).expect("note");
        }
        ledger(&store, &mut dice, 500);
        let pages = |store: &Store| {
            let mut out = Vec::new();
            for source in ["a", "b", "rare", "never"] {
                let mut before = u64::MAX;
                loop {
                    let page = store.runs_before(Some(source), before, 7).expect("page");
                    out.push((source, page.iter().map(|r| r.run_id).collect::<Vec<_>>()));
                    match page.last() {
                        Some(r) if page.len() == 7 => before = r.run_id,
                        _ => break,
                    }
                }
            }
            out
        };
        let through_index = pages(&store);
        let all = store.runs(None, usize::MAX).expect("runs");
        for (source, _) in &through_index {
            let paged: Vec<u64> = through_index.iter().filter(|(s, _)| s == source).flat_map(|(_, p)| p.clone()).collect();
            let filtered: Vec<u64> = all.iter().filter(|r| r.source_id == *source).map(|r| r.run_id).collect();
            assert_eq!(paged, filtered, "{source}");
        }
        let primes = AuditFilter { outcomes: Some(vec![Outcome::Suppressed]), ..Default::default() };
        let before_upgrade = store.audit(&primes).expect("audit");

        // A store of schema 10: the same rows, no indexes.
        let wtx = store.db.begin_write().expect("write");
        wtx.delete_table(AUDIT_BY_OUTCOME).expect("drop");
        wtx.delete_table(RUNS_BY_SOURCE).expect("drop");
        wtx.commit().expect("commit");
        drop(store);
        let store = Store::open(&path).expect("reopen");
        assert_eq!(pages(&store), through_index, "indexed when opened");
        assert_eq!(store.audit(&primes).expect("audit"), before_upgrade);
        let report = store.check_consistency().expect("check");
        assert!(report.is_consistent(), "{:?}", report.problems);

        // Damage: an entry missing, one naming no row, one under the wrong source.
        let wtx = store.db.begin_write().expect("write");
        {
            let mut audit = wtx.open_table(AUDIT_BY_OUTCOME).expect("index");
            let first = audit.first().expect("first").map(|(k, _)| k.value()).expect("an entry");
            audit.remove(first).expect("remove");
            audit.insert((1u8, 999_999u64), ()).expect("insert");
            let mut runs = wtx.open_table(RUNS_BY_SOURCE).expect("index");
            runs.insert(("a", 100_000u64), ()).expect("insert");
            let b = all.iter().find(|r| r.source_id == "b").expect("a run of b").run_id;
            runs.remove(("b", b)).expect("remove");
            runs.insert(("c", b), ()).expect("insert");
        }
        wtx.commit().expect("commit");
        let all_problems = store.check_consistency().expect("check").problems.join("\n");
        for said in [
            "is not in the outcome index",
            "names audit row 999999, which is not in the ledger",
            "names run 100000, which is not a run record",
            "is not in the per-source run index",
            "under source \"c\", not the record's",
        ] {
            assert!(all_problems.contains(said), "{said}: {all_problems}");
        }
        // An open of a store that has its indexes does not read the history again (a ledger
        // of only a baseline's primed rows has an empty index): the damage is still there.
        drop(store);
        let store = Store::open(&path).expect("reopen");
        assert_eq!(store.check_consistency().expect("check").problems.join("\n"), all_problems);
        // Pages pass over the damage instead of failing, and are still filled: the stray
        // entry ("a", 100000) is the newest of a's, yet a page of 7 has 7.
        assert_eq!(store.runs_before(Some("a"), u64::MAX, 7).expect("a").len(), 7);
        assert!(store.runs_before(Some("c"), u64::MAX, 1_000).expect("c").iter().all(|r| r.source_id == "c"));
        let sent = AuditFilter { outcomes: Some(vec![Outcome::Sent]), ..Default::default() };
        assert!(store.audit(&sent).expect("sent").iter().all(|r| r.outcome == Outcome::Sent));
    }
}
