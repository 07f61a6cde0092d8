//! Cross-table consistency of a store, checked from one read transaction.
//!
//! redb's own integrity check proves the file's B-trees are sound; it knows nothing of what
//! the rows mean. A backup taken while ingest and delivery run must also be *logically* whole:
//! no outbox row without its idempotency claim and `queued` audit row, no due-index entry or
//! lease pointing at a missing row, no watermark describing a run that is not there, an audit
//! ledger without gaps. `Store::check_consistency` lists every such problem (empty = whole);
//! the backup tests run it on copies taken mid-flight and on restored stores.

use super::codec::decode;
use super::idem::{decode_idem, IdemRecord, IdemState};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::{AttemptRecord, AuditRow, OutboxEntry, Outcome, RunRecord, Verdict, Watermark};
use redb::{ReadableDatabase, ReadableTable};

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;

/// What [`Store::check_consistency`] looked at, and what it found wrong.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConsistencyReport {
    pub outbox_rows: u64,
    pub leases: u64,
    pub audit_rows: u64,
    pub watermarks: u64,
    pub runs: u64,
    /// Parcels in the snapshot's readable blocks, every source.
    pub snapshot_parcels: u64,
    /// Ids of the subscribers created over the control port (not a consistency matter:
    /// `zonewatch check` compares them with the config's, whose same ids hide them).
    pub api_subscribers: Vec<String>,
    /// Their targets (those whose record decodes), for `zonewatch check` to compare with the
    /// config's `delivery.allow_private_targets`.
    pub api_subscriber_targets: Vec<(String, String)>,
    /// Disabled endpoints with alerts waiting for them (not a consistency matter: `zonewatch
    /// check` warns of them).
    pub disabled_backlog: Vec<super::endpoints::DisabledBacklog>,
    /// One sentence per violated invariant (empty: the store is consistent).
    pub problems: Vec<String>,
    /// The file was not closed cleanly: what was checked is a temporary copy that redb
    /// repaired (the file itself is as it was; the next writable open repairs it the same way).
    pub checked_repaired_copy: bool,
}

impl ConsistencyReport {
    /// No invariant is violated.
    pub fn is_consistent(&self) -> bool {
        self.problems.is_empty()
    }
}

/// redb's page cache while a store file is checked (`check_file`).
const CHECK_CACHE_BYTES: usize = 16 << 20;

/// Caps the problem list so a badly damaged store gives a readable answer.
const MAX_PROBLEMS: usize = 50;

fn problem(report: &mut ConsistencyReport, text: String) {
    if report.problems.len() < MAX_PROBLEMS {
        report.problems.push(text);
    }
}

impl Store {
    /// Checks the cross-table invariants (see the module doc) in one read transaction.
    ///
    /// * every outbox row: its key claimed in `idem_keys` or the key journal (not as sent), its last lifecycle
    ///   audit row (`queued` / `sent` / `dead_letter`) is `queued`; it is in one queue: fresh
    ///   (`outbox`, never tried, no due entry) or retry (`outbox_retry`, one `outbox_retry_due`
    ///   entry at its `next_attempt_ms`);
    /// * every due-index entry points at a retry row; a lease left in the file (written by a
    ///   build before schema 5; leases now live in memory) points at an outbox row;
    /// * every idempotency key has its expiry-index entry;
    /// * audit `seq` is 1..=n without gaps;
    /// * every watermark names a committed run of its source with the same digest, and has
    ///   its history row;
    /// * every snapshot block decodes, keeps its order and does not overlap the one before it,
    ///   and its parcels' states decode (`blocks::check_all`).
    /// * the next-outbox-id counter is 8 bytes and above every id a queued row, a dead letter
    ///   or a quarantined one holds.
    pub fn check_consistency(&self) -> Result<ConsistencyReport, StoreError> {
        check_txn(&self.db.begin_read()?)
    }
}

/// [`Store::check_consistency`] on a store file that no process has open (a backup), opened
/// read-only: nothing in it changes (no schema upgrade, not even the file leases of an older
/// build that `Store::open` would drop). Files of schema 4 and older are checked in their own
/// outbox layout; tables an older file lacks read as empty. A file a process still holds is
/// `InUse`.
///
/// A file not closed cleanly (a crashed daemon's store, a copy taken while it was open, a
/// truncated file) cannot be read until redb repairs it, which it does only in a writable
/// open. Such a file is copied to the system's temp folder (`TMPDIR`), the copy is opened
/// writable (redb repairs it) and checked, and the copy is deleted: the report then has
/// [`ConsistencyReport::checked_repaired_copy`] set. A copy redb cannot repair is `Damaged`;
/// when no copy can be made the error says so. The file itself is never written.
pub fn check_file(path: &std::path::Path) -> Result<ConsistencyReport, StoreError> {
    // A small page cache: the check reads each table once, in order, so redb's default
    // cache would only grow toward the size of the file (a 300 MiB store peaked at 226 MiB
    // of memory).
    let opened = redb::Builder::new().set_cache_size(CHECK_CACHE_BYTES).open_read_only(path);
    let db = match opened {
        Ok(db) => db,
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => return Err(StoreError::InUse { path: path.to_path_buf() }),
        Err(redb::DatabaseError::RepairAborted) => return check_repaired_copy(path),
        Err(other) => {
            return Err(StoreError::Open { path: path.to_path_buf(), message: format!("not a readable zonewatch store: {other}") })
        }
    };
    let rtx = db.begin_read()?;
    refuse_unopened_schema(&rtx, path)?;
    check_txn(&rtx)
}

/// A file of a schema this build does not open (a newer one, or a schema record no build
/// wrote, such as 0) is not checked by this build's rules, which would call it consistent, or
/// not, by tables and records it does not know (a black-box tester: an older build called a
/// newer file "consistent ... all good").
fn refuse_unopened_schema(rtx: &redb::ReadTransaction, path: &std::path::Path) -> Result<(), StoreError> {
    match super::schema_in(rtx)? {
        Some(found) => super::opens_schema(found, path),
        None => Ok(()),
    }
}

/// `check_file` for a file that needs redb's repair: a temporary copy is repaired and checked.
fn check_repaired_copy(path: &std::path::Path) -> Result<ConsistencyReport, StoreError> {
    let no_copy = |e: std::io::Error| StoreError::Open {
        path: path.to_path_buf(),
        message: format!(
            "was not closed cleanly, and no temporary copy of it could be made in {} to repair and check ({e}); consistency not checked (set TMPDIR to a folder with room for a copy)",
            std::env::temp_dir().display()
        ),
    };
    let mut copy = tempfile::Builder::new().prefix(super::backup::CHECK_PREFIX).suffix(".redb").tempfile().map_err(no_copy)?;
    let _unfinished = crate::signals::scratch(copy.path());
    // What checks killed outright left there (this one's copy is young: kept).
    if let (Some(dir), Ok(meta)) = (copy.path().parent(), copy.as_file().metadata()) {
        use std::os::unix::fs::MetadataExt;
        super::backup::sweep_check_leftovers(dir, meta.uid(), std::time::SystemTime::now());
    }
    {
        let mut from = std::fs::File::open(path).map_err(no_copy)?;
        std::io::copy(&mut from, copy.as_file_mut()).map_err(no_copy)?;
    }
    let db = redb::Builder::new().set_cache_size(CHECK_CACHE_BYTES).open(copy.path()).map_err(|e| StoreError::Damaged {
        path: path.to_path_buf(),
        message: format!("{e}; the file was not closed cleanly and a copy of it cannot be repaired"),
    })?;
    let rtx = db.begin_read()?;
    refuse_unopened_schema(&rtx, path)?;
    let mut report = check_txn(&rtx)?;
    report.checked_repaired_copy = true;
    drop(db);
    Ok(report)
}

fn check_txn(rtx: &redb::ReadTransaction) -> Result<ConsistencyReport, StoreError> {
    let mut report = ConsistencyReport::default();

    // Idempotency keys and their expiry index. Memory stays small for a county-sized store
    // (millions of keys): the expiry entries are held as 64-bit fingerprints of
    // `(expires at, key)`, not as strings (a fingerprint collision could hide one missing
    // entry, with odds of about n / 2^64), and only the key journal's rows (a bounded few) are
    // held whole; other keys are looked up in `idem_keys` when a row names them.
    let fingerprints = std::collections::hash_map::RandomState::new();
    let entry_fp = |t: u64, key: &str| fingerprints.hash_one((t, key));
    let keys = rtx.open_table(IDEM_KEYS)?;
    let mut journal_claims: HashMap<String, IdemRecord> = HashMap::new();
    // Keys whose record is in the journal but does not decode (named once, below).
    let mut damaged_keys: HashSet<String> = HashSet::new();
    {
        // A file written before expiry buckets (a backup being checked) has the per-key index.
        let mut expiry: HashSet<u64> = HashSet::new();
        match open_optional(rtx, IDEM_EXPIRY_BUCKETS)? {
            Some(buckets) => {
                for p in super::expiry::for_each_entry(&buckets, |t, key| {
                    expiry.insert(entry_fp(t, key));
                })? {
                    problem(&mut report, p);
                }
            }
            None => {
                for item in rtx.open_table(IDEM_EXPIRY)?.iter()? {
                    let (k, _) = item?;
                    let (t, key) = k.value();
                    expiry.insert(entry_fp(t, key));
                }
            }
        }
        for item in keys.iter()? {
            let (k, v) = item?;
            let rec: IdemRecord = match decode_idem(v.value()) {
                Ok(rec) => rec,
                Err(m) => {
                    problem(&mut report, format!("idempotency key {} does not decode: {m}", k.value()));
                    continue;
                }
            };
            if !expiry.contains(&entry_fp(rec.expires_ms, k.value())) {
                problem(&mut report, format!("idempotency key {} has no expiry index entry", k.value()));
            }
        }
        // New keys not merged yet (a file of schema version 2 or older has no journal).
        if let Some(journal) = open_optional(rtx, IDEM_KEY_JOURNAL)? {
            for (seq, row) in super::key_journal::rows_as_read(&journal)? {
                let (key, rec) = match row {
                    Ok((key, Ok(rec))) => (key, rec),
                    Ok((key, Err(m))) => {
                        problem(&mut report, format!("idempotency key {key} (journal row {seq}) does not decode: {m}"));
                        damaged_keys.insert(key);
                        continue;
                    }
                    Err(m) => {
                        problem(&mut report, format!("journal row {seq} does not decode: {m}"));
                        continue;
                    }
                };
                if !expiry.contains(&entry_fp(rec.expires_ms, &key)) {
                    problem(&mut report, format!("idempotency key {key} (journal row {seq}) has no expiry index entry"));
                }
                if keys.get(key.as_str())?.is_some() || journal_claims.contains_key(&key) {
                    problem(&mut report, format!("idempotency key {key} has more than one record (journal row {seq} and another)"));
                }
                journal_claims.insert(key, rec);
            }
        }
    }
    // A key's record wherever it lives (the journal's row wins, as it does for the store).
    // A record that does not decode was named above; the rows that name its key are not
    // judged against it (`Err`).
    let claim_of = |key: &str| -> Result<Result<Option<IdemRecord>, ()>, StoreError> {
        if let Some(rec) = journal_claims.get(key) {
            return Ok(Ok(Some(rec.clone())));
        }
        if damaged_keys.contains(key) {
            return Ok(Err(()));
        }
        match keys.get(key)? {
            Some(v) => Ok(decode_idem(v.value()).map(Some).map_err(|_| ())),
            None => Ok(Ok(None)),
        }
    };
    // Outbox rows whose key's last lifecycle audit row must be `queued` (checked once the
    // audit ledger has been read, below): (table, row id, key).
    let mut pending_rows: Vec<(&'static str, u64, String)> = Vec::new();

    // Outbox rows against claims, audit and the retry due index. A row is in exactly one
    // queue: fresh rows (never tried) need no due entry, retry rows have exactly one. A file
    // written before schema 5 (a backup being checked) has every row in `outbox`, fresh ones
    // indexed in `outbox_due`.
    let mut outbox_ids = HashSet::new();
    {
        // Tables a file of an older schema may lack read as empty.
        let retry_due = open_optional(rtx, OUTBOX_RETRY_DUE)?;
        let retry_rows = open_optional(rtx, OUTBOX_RETRY)?;
        let legacy_fresh_due = match retry_rows {
            Some(_) => None,
            None => open_optional(rtx, OUTBOX_DUE)?,
        };
        let mut retry_ids = HashSet::new();
        let fresh_rows = rtx.open_table(OUTBOX)?;
        let queues = std::iter::once((&fresh_rows, "outbox")).chain(retry_rows.as_ref().map(|t| (t, "outbox_retry")));
        for (table, name) in queues {
            let retry = name == "outbox_retry";
            for item in table.iter()? {
                let (k, v) = item?;
                let id = k.value();
                report.outbox_rows += 1;
                if !outbox_ids.insert(id) {
                    problem(&mut report, format!("outbox {id}: queued both as fresh and as a retry"));
                }
                let e: OutboxEntry = match super::outbox_rows::decode_entry(v.value()) {
                    Ok(e) => e,
                    Err(m) => {
                        problem(&mut report, format!("{name} {id} does not decode: {m}"));
                        // Its due entry is not another finding.
                        if retry {
                            retry_ids.insert(id);
                        }
                        continue;
                    }
                };
                match claim_of(&e.key.0)? {
                    Err(()) => {}
                    Ok(None) => problem(&mut report, format!("{name} {id}: key {} is not claimed (neither in idem_keys nor in the key journal)", e.key.0)),
                    Ok(Some(rec)) if rec.state == IdemState::Sent => {
                        problem(&mut report, format!("{name} {id}: key {} is already recorded as sent", e.key.0))
                    }
                    Ok(Some(rec)) if rec.outbox_id.is_some_and(|o| o != id) => problem(
                        &mut report,
                        format!("{name} {id}: key {} names outbox row {} as its pending row", e.key.0, rec.outbox_id.unwrap_or_default()),
                    ),
                    Ok(Some(rec)) if rec.state == IdemState::Suppressed => {
                        problem(&mut report, format!("{name} {id}: key {} was primed (suppressed), not claimed for delivery", e.key.0))
                    }
                    Ok(Some(_)) => {}
                }
                pending_rows.push((name, id, e.key.0.clone()));
                let indexed = match &retry_due {
                    Some(t) => t.get((e.next_attempt_ms, id))?.is_some(),
                    None => false,
                };
                if let Some(old) = &legacy_fresh_due {
                    // Schema 4 and older: one entry in either index.
                    let n = u8::from(indexed) + u8::from(old.get((e.next_attempt_ms, id))?.is_some());
                    if n != 1 {
                        problem(&mut report, format!("outbox {id}: {n} due-index entries at {} (expected 1)", e.next_attempt_ms));
                    }
                    if indexed {
                        retry_ids.insert(id);
                    }
                    continue;
                }
                if retry {
                    retry_ids.insert(id);
                    if !indexed {
                        problem(&mut report, format!("outbox_retry {id}: no due-index entry at {}", e.next_attempt_ms));
                    }
                } else {
                    if indexed {
                        problem(&mut report, format!("outbox {id}: a fresh row with a retry due-index entry at {}", e.next_attempt_ms));
                    }
                    if e.attempts > 0 {
                        problem(&mut report, format!("outbox {id}: tried {} times but queued as fresh", e.attempts));
                    }
                }
            }
        }
        for item in retry_due.as_ref().map(|t| t.iter()).transpose()?.into_iter().flatten() {
            let (k, _) = item?;
            let (at, id) = k.value();
            if !retry_ids.contains(&id) {
                problem(&mut report, format!("due index outbox_retry_due entry ({at}, {id}) points at no retry row"));
            }
        }
        if let Some(old) = &legacy_fresh_due {
            for item in old.iter()? {
                let (k, _) = item?;
                let (at, id) = k.value();
                if !outbox_ids.contains(&id) {
                    problem(&mut report, format!("due index outbox_due entry ({at}, {id}) points at no outbox row"));
                }
            }
        }
    }

    // Dead letters (and quarantined ones) are pending: their key must name them, or the TTL
    // sweep would delete the key while a replay can still send the event.
    for (table, name) in [(DEAD_LETTERS, "dead letter"), (DLQ_QUARANTINE, "quarantined dead letter")] {
        let Some(dead) = open_optional(rtx, table)? else { continue };
        for item in dead.iter()? {
            let (k, v) = item?;
            let id = k.value();
            let d = match super::outbox_rows::decode_dead(v.value()) {
                Ok(d) => d,
                Err(m) => {
                    problem(&mut report, format!("{name} {id} does not decode: {m}"));
                    continue;
                }
            };
            match claim_of(&d.entry.key.0)? {
                Err(()) => {}
                Ok(None) => problem(&mut report, format!("{name} {id}: key {} is not claimed (neither in idem_keys nor in the key journal)", d.entry.key.0)),
                // A version 1 key (no row named) is kept by its state.
                Ok(Some(rec)) if rec.outbox_id.is_none() && matches!(rec.state, IdemState::Queued | IdemState::DeadLetter) => {}
                Ok(Some(rec)) if rec.outbox_id != Some(id) => problem(
                    &mut report,
                    format!("{name} {id}: key {} names row {:?}, not this one", d.entry.key.0, rec.outbox_id),
                ),
                Ok(Some(_)) => {}
            }
        }
    }

    // Audit ledger: contiguous seq; the last lifecycle outcome of each pending row's key
    // (only those keys are kept: the ledger names every key ever claimed). Gaps are listed
    // first, as they were when the ledger was read first, so the cap never hides them.
    let mut unreadable_audit_rows = 0u64;
    let mut recount = super::totals::Recount::default();
    // The history indexes are checked row by row as the ledger and the run records are read.
    let mut index_check = super::history_index::IndexCheck::open(rtx, MAX_PROBLEMS)?;
    let mut last_lifecycle: HashMap<&str, Option<Outcome>> = pending_rows.iter().map(|(_, _, key)| (key.as_str(), None)).collect();
    {
        let audit = rtx.open_table(AUDIT)?;
        let mut gaps = Vec::new();
        let mut expected = 1u64;
        for item in audit.iter()? {
            let (k, v) = item?;
            let seq = k.value();
            if seq != expected && gaps.len() < MAX_PROBLEMS {
                gaps.push(format!("audit seq jumps from {} to {seq}", expected - 1));
            }
            expected = seq.saturating_add(1);
            report.audit_rows += 1;
            let row: AuditRow = match decode(v.value()) {
                Ok(row) => row,
                Err(m) => {
                    unreadable_audit_rows += 1;
                    index_check.audit_undecodable(seq);
                    if gaps.len() < MAX_PROBLEMS {
                        gaps.push(format!("audit row {seq} does not decode: {m}"));
                    }
                    continue;
                }
            };
            if row.seq != seq && gaps.len() < MAX_PROBLEMS {
                gaps.push(format!("audit row {seq} says it is row {}", row.seq));
            }
            recount.audit_row(row.outcome);
            index_check.audit_row(seq, &row)?;
            if matches!(row.outcome, Outcome::Queued | Outcome::Sent | Outcome::DeadLetter) {
                if let Some(slot) = row.idempotency_key.as_deref().and_then(|key| last_lifecycle.get_mut(key)) {
                    *slot = Some(row.outcome);
                }
            }
        }
        report.problems.splice(0..0, gaps);
        report.problems.truncate(MAX_PROBLEMS);
    }
    // (With audit rows that do not decode, a pending row's own may be one of them: said.)
    let unreadable_audit = if unreadable_audit_rows > 0 { format!(" ({unreadable_audit_rows} audit rows do not decode)") } else { String::new() };
    for (name, id, key) in &pending_rows {
        match last_lifecycle.get(key.as_str()).copied().flatten() {
            Some(Outcome::Queued) => {}
            Some(other) => problem(&mut report, format!("{name} {id}: the last audit row of key {key} is {}, not queued{unreadable_audit}", other.as_str())),
            None => problem(&mut report, format!("{name} {id}: key {key} has no queued audit row{unreadable_audit}")),
        }
    }

    // Leases: each belongs to an outbox row.
    {
        let leases = open_optional(rtx, OUTBOX_LEASES)?;
        for item in leases.as_ref().map(|t| t.iter()).transpose()?.into_iter().flatten() {
            let (k, _) = item?;
            report.leases += 1;
            if !outbox_ids.contains(&k.value()) {
                problem(&mut report, format!("orphan lease on outbox id {} (no such row)", k.value()));
            }
        }
    }

    // Every hold row reads (the passes over every hold skip one that does not), and the
    // index of open holds names exactly the open ones.
    for item in rtx.open_table(HOLDS)?.iter()? {
        let (k, v) = item?;
        if let Err(why) = super::watermark_rows::decode_hold(v.value()) {
            problem(&mut report, format!("hold {} does not decode: {why}", k.value()));
        }
    }
    for text in super::holds::index_problems(rtx)? {
        problem(&mut report, text);
    }

    // Watermarks describe committed runs.
    let mut runs_named_undecodable = HashSet::new();
    {
        let runs = rtx.open_table(RUNS)?;
        report.runs = runs.len_hint();
        let history = open_optional(rtx, WATERMARK_HISTORY)?;
        let wms = rtx.open_table(WATERMARKS)?;
        for item in wms.iter()? {
            let (k, v) = item?;
            report.watermarks += 1;
            let source = k.value();
            let wm: Watermark = match super::watermark_rows::decode_watermark(v.value()) {
                Ok(wm) => wm,
                Err(m) => {
                    problem(&mut report, format!("watermark of {source} does not decode: {m}"));
                    continue;
                }
            };
            match runs.get(wm.run_id)? {
                None => problem(&mut report, format!("watermark of {source} names run {}, which does not exist", wm.run_id)),
                Some(r) => match decode::<RunRecord>(r.value()) {
                    Err(m) => {
                        runs_named_undecodable.insert(wm.run_id);
                        problem(&mut report, format!("run {} (named by the watermark of {source}) does not decode: {m}", wm.run_id));
                    }
                    Ok(rec) => {
                        if rec.source_id != source {
                            problem(&mut report, format!("watermark of {source} names run {} of source {}", wm.run_id, rec.source_id));
                        }
                        if rec.digest != wm.digest {
                            problem(&mut report, format!("watermark of {source}: digest differs from its run {}", wm.run_id));
                        }
                        if !matches!(rec.verdict, Verdict::Baseline | Verdict::Run | Verdict::Reprocessed) {
                            problem(&mut report, format!("watermark of {source} names run {}, which is {} (not a commit)", wm.run_id, rec.verdict.as_str()));
                        }
                    }
                },
            }
            let has_history = match &history {
                Some(t) => t.get((source, wm.run_id))?.is_some(),
                None => false,
            };
            if !has_history {
                problem(&mut report, format!("watermark of {source}: no history row for run {}", wm.run_id));
            }
        }
    }
    // The snapshot's blocks (a file of schema 6 or older has none: its rows are not checked).
    if let Some(blocks) = open_optional(rtx, PARCEL_BLOCKS)? {
        let mut found = Vec::new();
        report.snapshot_parcels = super::blocks::check_all(&blocks, |p| found.push(p))?;
        for p in found {
            problem(&mut report, p);
        }
    }
    // Every tombstone reads (a run skips one that does not: its parcel would start again
    // from revision 0 if it came back).
    // and is in the index by age that the runs' sweeps read.
    if let Some(tombstones) = open_optional(rtx, PARCEL_TOMBSTONES)? {
        let ages = open_optional(rtx, PARCEL_TOMBSTONE_AGES)?;
        for p in super::tombstones::problems(&tombstones, ages.as_ref())? {
            problem(&mut report, p);
        }
    }
    // Every endpoint health record reads (delivery takes one that does not as healthy, and
    // `endpoints list` cannot show it).
    for p in undecodable::<_, crate::model::EndpointState>(rtx, ENDPOINTS, |id| format!("endpoint health record of {id}"))? {
        problem(&mut report, p);
    }
    // Every delivery attempt reads (the retention sweep steps over one that does not, and a
    // replay of its dead letter, which asks the log whether the key was sent, fails on it),
    // and every quarantined feature (`GET /v1/quarantine` leaves one that does not out).
    for p in undecodable::<_, AttemptRecord>(rtx, DELIVERY_ATTEMPTS_BY_ROW, |(row, n)| format!("delivery attempt {n} of outbox row {row}"))? {
        problem(&mut report, p);
    }
    for p in undecodable::<_, AttemptRecord>(rtx, DELIVERY_ATTEMPTS, |(key, n)| format!("delivery attempt {n} of key {key}"))? {
        problem(&mut report, p);
    }
    for p in undecodable::<_, crate::model::QuarantineRecord>(rtx, QUARANTINE, |row| format!("quarantined feature row {row}"))? {
        problem(&mut report, p);
    }
    // Every area place reads (a run skips one that does not: its place would start again).
    for p in super::area_places::problems(rtx)? {
        problem(&mut report, p);
    }
    if let Some(subs) = open_optional(rtx, SUBSCRIBERS)? {
        for item in subs.iter()? {
            let (k, v) = item?;
            report.api_subscribers.push(k.value().to_string());
            // `run` and `serve` refuse to start on a row they cannot read: a problem here too.
            match super::subscribers::decode_subscriber(v.value()) {
                Ok(s) => report.api_subscriber_targets.push((s.id, s.target)),
                Err(e) => problem(&mut report, format!("subscriber {:?} (created over the control port) cannot be read: {e}", k.value())),
            }
        }
    }
    if let Some(p) = next_outbox_id_problem(rtx)? {
        problem(&mut report, p);
    }
    report.disabled_backlog = super::endpoints::disabled_backlog_in(rtx)?;
    for p in totals_problems(rtx, recount, unreadable_audit_rows, &runs_named_undecodable, &mut index_check)? {
        problem(&mut report, p);
    }
    for p in index_check.finish(rtx)? {
        problem(&mut report, p);
    }
    read_every_table(rtx)?;
    Ok(report)
}

/// Reads every table whole, each key and each value: the checks above follow what they
/// compare, and leave pages no invariant reaches (an index, the attempt log, what only a
/// sweep at the end of the next `run` reads). A page there that redb cannot read made
/// `check` say "all good" and every `run` then end "damaged". redb reports such a page as
/// an error or panics on it, which the command's guard reports as damage.
fn read_every_table(rtx: &redb::ReadTransaction) -> Result<(), StoreError> {
    macro_rules! read_tables {
        ($rtx:expr, $($def:expr),* $(,)?) => {{
            $(
                match $rtx.open_table($def) {
                    Ok(table) => {
                        for item in table.iter()? {
                            let (k, v) = item?;
                            std::hint::black_box((k.value(), v.value()));
                        }
                    }
                    // A file of an older schema (a backup) lacks the table, or has it in its
                    // own layout, which the checks above read.
                    Err(redb::TableError::TableDoesNotExist(_) | redb::TableError::TableTypeMismatch { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            )*
        }};
    }
    super::tables::every_table!(read_tables!(rtx,));
    Ok(())
}

/// The running totals `/metrics` reads, against a recount of the run records and of the audit
/// rows (`recount`, taken while the ledger was checked). A file written before schema 10 has
/// no totals yet (they are counted when it is opened); where rows do not decode (named above)
/// the recount cannot be compared. A run record that does not decode is named here unless a
/// watermark's check named it (`named`). Each run record read is given to `index_check` (the
/// per-source index's check).
fn totals_problems(
    rtx: &redb::ReadTransaction,
    mut recount: super::totals::Recount,
    unreadable_audit_rows: u64,
    named: &HashSet<u64>,
    index_check: &mut super::history_index::IndexCheck,
) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    let mut unreadable_runs = 0u64;
    for item in rtx.open_table(RUNS)?.iter()? {
        let (k, v) = item?;
        match decode::<RunRecord>(v.value()) {
            Ok(r) => {
                index_check.run(k.value(), &r.source_id)?;
                recount.run(&r);
            }
            Err(m) => {
                unreadable_runs += 1;
                index_check.run_undecodable(k.value());
                if !named.contains(&k.value()) {
                    out.push(format!("run record {} does not decode: {m}", k.value()));
                }
            }
        }
    }
    let (Some(audit_totals), Some(run_totals)) = (open_optional(rtx, AUDIT_TOTALS)?, open_optional(rtx, RUN_TOTALS)?) else {
        return Ok(out);
    };
    // What the run retention sweep removed counts in the totals as the records did. A
    // source whose tally does not decode is named, and its totals are not compared.
    let mut swept_unreadable = Vec::new();
    if let Some(swept) = open_optional(rtx, RUNS_SWEPT)? {
        let (swept, damaged) = super::run_retention::read_swept(&swept)?;
        recount.add_swept(&swept);
        for (source, why) in damaged {
            out.push(format!("{why} (the run totals of source {source} cannot be checked against its run records without it)"));
            swept_unreadable.push(source);
        }
    }
    let mut stored = std::collections::BTreeMap::new();
    for item in run_totals.iter()? {
        let (k, v) = item?;
        stored.insert(k.value().to_string(), decode::<super::SourceRunTotals>(v.value()));
    }
    if unreadable_runs > 0 {
        stored.clear();
        recount.runs.clear();
    }
    for source in &swept_unreadable {
        stored.remove(source);
        recount.runs.remove(source);
    }
    let audit = if unreadable_audit_rows > 0 { Vec::new() } else { super::totals::read_audit_totals(&audit_totals)? };
    out.extend(recount.differences(&audit, &stored));
    Ok(out)
}

/// The next-outbox-id counter must be 8 bytes and above every id a queued row, a dead letter
/// or a quarantined one holds: otherwise the next claims would be handed ids in use (they
/// now fail instead, `delivery::id_in_use`), and this is where an operator learns why.
fn next_outbox_id_problem(rtx: &redb::ReadTransaction) -> Result<Option<String>, StoreError> {
    let mut highest: Option<u64> = None;
    for def in [OUTBOX, OUTBOX_RETRY, DEAD_LETTERS, DLQ_QUARANTINE] {
        if let Some(t) = open_optional(rtx, def)? {
            if let Some((k, _)) = t.last()? {
                highest = highest.max(Some(k.value()));
            }
        }
    }
    let Some(meta) = open_optional(rtx, META)? else { return Ok(None) };
    let Some(v) = meta.get(META_NEXT_OUTBOX_ID)? else {
        return Ok(highest.map(|h| format!("the next-outbox-id counter is missing though outbox id {h} is in use")));
    };
    Ok(match super::delivery::read_next_outbox_id(v.value()) {
        Err(e) => Some(format!("the next-outbox-id counter is damaged: {e}")),
        Ok(next) => highest.filter(|&h| next <= h).map(|h| format!("the next-outbox-id counter ({next}) is not above outbox id {h}, which is in use: new claims would fail")),
    })
}

/// `RUNS.len()` without importing the metadata trait at every call site.
trait LenHint {
    fn len_hint(&self) -> u64;
}

impl<T: redb::ReadableTableMetadata> LenHint for T {
    fn len_hint(&self) -> u64 {
        self.len().unwrap_or(0)
    }
}

/// Every row of `def` that does not decode as a `T`, `name`d by its key, as `… does not
/// decode: why`; a table the file lacks has none.
pub(super) fn undecodable<K: redb::Key + 'static, T: serde::de::DeserializeOwned>(
    rtx: &redb::ReadTransaction,
    def: redb::TableDefinition<K, &'static [u8]>,
    name: impl Fn(K::SelfType<'_>) -> String,
) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    if let Some(table) = open_optional(rtx, def)? {
        for item in table.iter()? {
            let (k, v) = item?;
            if let Err(m) = decode::<T>(v.value()) {
                out.push(format!("{} does not decode: {m}", name(k.value())));
            }
        }
    }
    Ok(out)
}

/// A table that files written by an older build may not have (`None` then).
pub(super) fn open_optional<K: redb::Key + 'static, V: redb::Value + 'static>(
    rtx: &redb::ReadTransaction,
    def: redb::TableDefinition<K, V>,
) -> Result<Option<redb::ReadOnlyTable<K, V>>, StoreError> {
    match rtx.open_table(def) {
        Ok(t) => Ok(Some(t)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::codec::encode;

    /// `check` reads every table whole: a page only the delivery attempt log uses (no
    /// invariant reads that table), zeroed in a copy of the file, is reported. It used to read
    /// "consistent", and the next `run` ended "damaged" at its retention sweep (found by a
    /// black-box tester). Every 4 KiB block after the header is zeroed in turn; wherever the
    /// attempt log can then not be read whole, `check` must not say consistent.
    #[test]
    fn a_damaged_page_that_no_invariant_reads_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("zw.redb");
        {
            let store = Store::open(&path).expect("open");
            let wtx = store.db.begin_write().expect("write");
            {
                let mut t = wtx.open_table(DELIVERY_ATTEMPTS).expect("attempts");
                let body = encode(&crate::model::sample_attempt("key", 1, "sent", 5));
                for i in 0..5_000u32 {
                    t.insert((format!("key-{i:06}").as_str(), 1u32), body.as_slice()).expect("insert");
                }
            }
            wtx.commit().expect("commit");
        }
        assert!(check_file(&path).expect("check").is_consistent());
        let clean = std::fs::read(&path).expect("read");
        let attempts_read_whole = |p: &std::path::Path| {
            let read = super::super::guard::guarded(|| -> Result<(), StoreError> {
                let db = redb::Builder::new().open_read_only(p).map_err(|e| StoreError::Open { path: p.to_path_buf(), message: e.to_string() })?;
                for item in db.begin_read()?.open_table(DELIVERY_ATTEMPTS)?.iter()? {
                    let (k, v) = item?;
                    std::hint::black_box((k.value(), v.value()));
                }
                Ok(())
            });
            matches!(read, Ok(Ok(())))
        };
        let copy = dir.path().join("copy.redb");
        let mut unreadable = 0;
        for block in (4096..clean.len()).step_by(4096) {
            let mut bytes = clean.clone();
            let end = (block + 4096).min(bytes.len());
            bytes[block..end].fill(0);
            std::fs::write(&copy, &bytes).expect("write copy");
            if attempts_read_whole(&copy) {
                continue;
            }
            unreadable += 1;
            let checked = super::super::guard::guarded(|| check_file(&copy));
            assert!(!matches!(&checked, Ok(Ok(r)) if r.is_consistent()), "block at {block}: the attempt log cannot be read whole, and check said consistent");
        }
        assert!(unreadable > 10, "{unreadable} blocks of the attempt log found");
    }

    /// A hold row that does not decode is skipped by the passes over every hold (each run's
    /// `begin_run`, the gate's `holds()`, the stats), which would otherwise fail every run of
    /// every source on it, and `check` names it.
    #[test]
    fn a_damaged_hold_stops_no_run_and_check_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(HOLDS).expect("holds").insert(7u64, [0xFFu8, 0x00].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        assert!(store.holds().expect("holds").is_empty());
        assert_eq!(store.stats().expect("stats").open_holds, 0);
        let wm = Watermark::for_read("abc", 3, 1, None, String::new());
        let w = store.begin_run("s", crate::store::CommitMode::Baseline, wm, 1, 3_600_000).expect("a run begins");
        let record = w.finish(1, 2, Default::default(), vec![]).expect("and commits");
        assert_eq!(store.watermark("s").expect("wm").map(|w| w.run_id), Some(record.run_id));
        let all = store.check_consistency().expect("check").problems.join("\n");
        assert!(all.contains("hold 7 does not decode"), "{all}");

        // Likewise a tombstone: the source's diff reads around it, `check` names it.
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(PARCEL_TOMBSTONES).expect("tombstones").insert(("t", "p9"), [0xFFu8].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        assert_eq!(store.snapshot_view("t").expect("the view opens").tombstone("p9").expect("a damaged row reads as none"), None);
        let all = store.check_consistency().expect("check").problems.join("\n");
        assert!(all.contains("tombstone t/p9: "), "{all}");

        // A control-port subscriber that does not decode stops `run` and `serve` at start:
        // `check` names it.
        let wtx = store.db.begin_write().expect("write");
        wtx.open_table(SUBSCRIBERS).expect("subscribers").insert("api-9", [0x09u8, 0x01].as_slice()).expect("insert");
        wtx.commit().expect("commit");
        assert!(store.stored_subscribers().is_err());
        let all = store.check_consistency().expect("check").problems.join("\n");
        assert!(all.contains("subscriber \"api-9\" (created over the control port) cannot be read"), "{all}");
    }

    #[test]
    fn a_fresh_store_is_consistent_and_damage_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        assert!(store.check_consistency().expect("check").is_consistent());

        // Damage three tables behind the store's back: an orphan lease, an audit gap, a
        // watermark naming a run that does not exist.
        let wtx = store.db.begin_write().expect("write");
        {
            wtx.open_table(OUTBOX_LEASES).expect("leases").insert(42u64, 1u64).expect("insert");
            let row = crate::model::sample_audit_row(5, Outcome::Held);
            wtx.open_table(AUDIT).expect("audit").insert(5u64, encode(&row).as_slice()).expect("insert");
            let wm = Watermark::for_read("abc", 3, 1, None, String::new());
            wtx.open_table(WATERMARKS).expect("wm").insert("s", super::super::watermark_rows::encode_watermark(&wm).as_slice()).expect("insert");
        }
        wtx.commit().expect("commit");
        let r = store.check_consistency().expect("check");
        let all = r.problems.join("\n");
        assert!(all.contains("orphan lease on outbox id 42"), "{all}");
        assert!(all.contains("audit seq jumps from 0 to 5"), "{all}");
        assert!(all.contains("watermark of s names run 0, which does not exist"), "{all}");
        // The row was written without its running total: /metrics would not count it.
        assert!(all.contains("audit totals: 0 held rows counted, the ledger has 1"), "{all}");
        // ... nor in the outcome index: outcome-filtered pages would miss it.
        assert!(all.contains("audit row 5 is not in the outcome index"), "{all}");
        assert_eq!(r.problems.len(), 6, "{all}"); // + the missing history row
    }

    /// A row that does not decode is a problem named with its table and key, and the check
    /// goes on to the rest of the store (it used to stop at the first, as an error).
    #[test]
    fn rows_that_do_not_decode_are_each_named_and_the_check_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let bad = [0xFFu8, 1, 2].as_slice();
        let wtx = store.db.begin_write().expect("write");
        {
            wtx.open_table(IDEM_KEYS).expect("keys").insert("k1", bad).expect("insert");
            wtx.open_table(OUTBOX).expect("outbox").insert(7u64, bad).expect("insert");
            wtx.open_table(DEAD_LETTERS).expect("dead").insert(8u64, bad).expect("insert");
            wtx.open_table(AUDIT).expect("audit").insert(1u64, bad).expect("insert");
            wtx.open_table(WATERMARKS).expect("wm").insert("s", bad).expect("insert");
            wtx.open_table(ENDPOINTS).expect("endpoints").insert("w", bad).expect("insert");
            // A retry row with its due entry (the entry is not a second finding), a journal
            // row, and a watermark of t naming a run that does not decode (its missing
            // history row is still found).
            wtx.open_table(OUTBOX_RETRY).expect("retry").insert(9u64, bad).expect("insert");
            // The counter above the ids written by hand (a missing one is a problem of its own).
            wtx.open_table(META).expect("meta").insert(META_NEXT_OUTBOX_ID, 10u64.to_le_bytes().as_slice()).expect("insert");
            wtx.open_table(OUTBOX_RETRY_DUE).expect("due").insert((5u64, 9u64), ()).expect("insert");
            wtx.open_table(IDEM_KEY_JOURNAL).expect("journal").insert(3u64, bad).expect("insert");
            wtx.open_table(RUNS).expect("runs").insert(77u64, bad).expect("insert");
            let wm = Watermark { run_id: 77, ..Watermark::for_read("abc", 3, 1, None, String::new()) };
            wtx.open_table(WATERMARKS).expect("wm").insert("t", super::super::watermark_rows::encode_watermark(&wm).as_slice()).expect("insert");
            // And an orphan lease after them all: still found.
            wtx.open_table(OUTBOX_LEASES).expect("leases").insert(42u64, 1u64).expect("insert");
        }
        wtx.commit().expect("commit");
        let r = store.check_consistency().expect("a damaged row is a finding, not an error");
        let all = r.problems.join("\n");
        for named in [
            "idempotency key k1 does not decode",
            "outbox 7 does not decode",
            "dead letter 8 does not decode",
            "audit row 1 does not decode",
            "watermark of s does not decode",
            "endpoint health record of w does not decode",
            "outbox_retry 9 does not decode",
            "journal row 3 does not decode",
            "run 77 (named by the watermark of t) does not decode",
            "watermark of t: no history row for run 77",
            "orphan lease on outbox id 42",
        ] {
            assert!(all.contains(named), "{named}: {all}");
        }
        assert_eq!(r.problems.len(), 11, "each damaged row once, nothing more: {all}");
    }

    /// The snapshot's blocks are read whole: a sound snapshot counts its parcels; a block
    /// that overlaps the one before it, one that does not decode and one holding a record
    /// whose state does not decode are each named, and the other blocks still counted.
    #[test]
    fn damaged_snapshot_blocks_are_named() {
        use crate::model::{Parcel, ParcelState, RunCounts, StoredGeometry};
        use crate::store::blocks::encode_block;
        use crate::store::CommitMode;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let state = ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 1.0, revision: 0, announced: None };
        let geometry = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
        let parcels: Vec<Parcel> = (0..100).map(|i| Parcel { id: format!("p{i:03}"), state: state.clone(), geometry: geometry.clone() }).collect();
        let mut w = store.begin_run("s", CommitMode::Baseline, Watermark::default(), 1, 1_000).expect("run");
        w.upserts(parcels.iter().map(Parcel::borrowed)).expect("upserts");
        w.finish(1, 1, RunCounts::default(), vec![]).expect("finish");
        let r = store.check_consistency().expect("check");
        assert!(r.is_consistent(), "{:?}", r.problems);
        assert_eq!(r.snapshot_parcels, 100);

        let wtx = store.db.begin_write().expect("write");
        {
            let mut t = wtx.open_table(PARCEL_BLOCKS).expect("blocks");
            let record = crate::store::snapshot::encode_record(&state, &geometry);
            let mut buf = Vec::new();
            // Inside the first block's range (p000..): overlaps it.
            encode_block(&[("p000x", record.as_slice())], &mut buf).expect("encode");
            t.insert(("s", "p000x"), buf.as_slice()).expect("insert");
            t.insert(("t", "a"), [9u8, 1, 2].as_slice()).expect("insert");
            encode_block(&[("b", &[1u8, 0xff][..])], &mut buf).expect("encode");
            t.insert(("t", "b"), buf.as_slice()).expect("insert");
        }
        wtx.commit().expect("commit");
        let r = store.check_consistency().expect("check");
        let all = r.problems.join("\n");
        assert!(all.contains("snapshot of s:") && all.contains("overlaps the block before it"), "{all}");
        assert!(all.contains("snapshot of t:") && all.contains("version 9"), "{all}");
        assert!(all.contains("parcel \"b\""), "{all}");
        assert_eq!(r.problems.len(), 3, "{all}");
    }

    /// The key checks, which hold no copy of the keys: a row whose claim is gone, a key whose
    /// last lifecycle row is not `queued`, a key without its expiry entry, a key in both the
    /// journal and `idem_keys`.
    #[test]
    fn damaged_claims_are_named() {
        use crate::model::{sample_event, IdemKey, Severity};
        use crate::store::Claim;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let events: Vec<_> = (0..4).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..events.len())
            .map(|i| Claim { event: i, watcher_id: "w".into(), target: "http://127.0.0.1:9/h".into(), min_severity: Severity::Info, key: IdemKey(format!("k{i}")) })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).expect("enqueue");
        assert!(store.check_consistency().expect("check").is_consistent());
        let wtx = store.db.begin_write().expect("write");
        {
            let mut journal = wtx.open_table(IDEM_KEY_JOURNAL).expect("journal");
            let rows = super::super::key_journal::rows(&journal).expect("rows");
            assert_eq!(rows.len(), 4, "new keys are in the journal");
            let find = |key: &str| rows.iter().find(|r| r.1 == key).cloned().expect("row");
            // k0's claim is gone.
            journal.remove(find("k0").0).expect("remove");
            // k2 is also in idem_keys; a key nobody queued has an expiry no bucket holds.
            let mut main = wtx.open_table(IDEM_KEYS).expect("keys");
            main.insert("k2", super::super::idem::encode_idem(&find("k2").2).as_slice()).expect("insert");
            let mut stray = find("k3").2;
            stray.expires_ms += 1;
            main.insert("stray", super::super::idem::encode_idem(&stray).as_slice()).expect("insert");
            // k1's last lifecycle row says sent.
            let mut audit = wtx.open_table(AUDIT).expect("audit");
            let next = audit.last().expect("last").map(|(k, _)| k.value() + 1).expect("rows");
            let row = AuditRow {
                seq: next,
                ts_ms: 1,
                outcome: Outcome::Sent,
                idempotency_key: Some("k1".into()),
                watcher_id: None,
                source_id: None,
                parcel_id: None,
                lineage_id: None,
                detail: String::new(),
            };
            audit.insert(next, encode(&row).as_slice()).expect("insert");
        }
        wtx.commit().expect("commit");
        let r = store.check_consistency().expect("check");
        let all = r.problems.join("\n");
        assert!(all.contains("key k0 is not claimed"), "{all}");
        assert!(all.contains("the last audit row of key k1 is sent, not queued"), "{all}");
        assert!(all.contains("idempotency key k2 has more than one record"), "{all}");
        assert!(all.contains("idempotency key stray has no expiry index entry"), "{all}");
        assert!(all.contains("audit totals: 0 sent rows counted, the ledger has 1"), "{all}");
        assert!(all.contains("is not in the outcome index"), "{all}");
        assert_eq!(r.problems.len(), 6, "{all}");
    }
}
