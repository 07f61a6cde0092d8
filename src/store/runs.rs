//! Run commits: the one write transaction per source run, holds and their resolution.

use super::blocks::{self, Change};
use super::watermark_rows::{decode_watermark, encode_watermark};
use super::codec::{decode, encode};
use super::delivery::{claim_in_txn, Claim, ClaimCounts, ClaimMode};
use super::held_rows::{decode_held_event, decode_staged, encode_held_event, encode_staged};
use super::tombstones::Tombstone;
use super::history_index::BASELINE_DETAIL;
use crate::detect::diff::{content_of, step, Prior};
use super::snapshot::{decode_state, geometries_of, SnapshotRow};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::*;
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};
use serde::Serialize;
use std::collections::HashMap;

/// How a run's events are treated when it commits.
#[derive(Debug, Clone, PartialEq)]
pub enum CommitMode {
    /// First ingest of a source: snapshot stored, keys primed, nothing sent.
    Baseline,
    /// Normal run: new keys are queued for delivery.
    Deliver,
    /// `--reprocess`: snapshot updated, keys primed, audit `suppressed`, nothing sent.
    Reprocess,
    /// The publication gate held the run: stage its delta and events, touch nothing else.
    /// `reprocess`: the run was a `--reprocess`, whose release primes (`Hold::reprocess`).
    Hold { reason: String, reprocess: bool },
    /// An operator resolves hold `hold_id`: `prime = false` delivers it, `true` accepts silently.
    ResolveHold { hold_id: u64, prime: bool },
}

impl CommitMode {
    /// Whether the run's changes are announced to subscribers, which records them as the
    /// last announcement (`detect::diff::step`; every change moves the revision on): a delivering run, a released hold, and a
    /// held run's removal events and area places (its parcels are stepped again when it is
    /// resolved: [`RunWriter::upserts`]) — unless the held run is a `--reprocess`, whose
    /// release primes.
    pub fn announces(&self) -> bool {
        matches!(self, CommitMode::Deliver | CommitMode::Hold { reprocess: false, .. } | CommitMode::ResolveHold { prime: false, .. })
    }
}

/// A feature the run could not take, before it gets its run and lineage ids.
#[derive(Debug, Clone)]
pub struct QuarantineDraft {
    pub feature_index: u64,
    pub parcel_id: Option<String>,
    pub reason: QuarantineReason,
    pub detail: String,
    pub raw: String,
}

/// Everything one run wants to commit, atomically.
#[derive(Debug, Clone)]
pub struct RunCommit {
    pub source_id: String,
    pub started_ms: u64,
    pub now_ms: u64,
    pub mode: CommitMode,
    /// The watermark the source gets (its `run_id` is filled in by the store).
    pub watermark: Watermark,
    pub upserts: Vec<Parcel>,
    pub removals: Vec<String>,
    pub events: Vec<ChangeEvent>,
    pub claims: Vec<Claim>,
    /// An area-mode run's places ([`RunWriter::places`]); empty for any other run.
    pub places: Vec<(String, super::PlaceState)>,
    pub quarantine: Vec<QuarantineDraft>,
    pub counts: RunCounts,
    pub warnings: Vec<String>,
    pub idem_ttl_ms: u64,
}

/// What [`Store::record_run_note`] records about a run that committed nothing.
#[derive(Debug, Clone)]
pub struct RunNote<'a> {
    pub verdict: Verdict,
    /// The digest of the content the run read ("" when it read none).
    pub digest: &'a str,
    /// The open hold whose content the run re-read.
    pub hold_id: Option<u64>,
    /// Why the run failed.
    pub error: Option<String>,
}

/// The key after a table's last (`table` names it in the error): a damaged or crafted store
/// whose last key is `u64::MAX` is refused, where the add wrapped to 0 and every later row of
/// the table overwrote the one before.
pub(super) fn next_key(table: &'static str, last: Option<u64>) -> Result<u64, StoreError> {
    match last {
        None => Ok(1),
        Some(k) => k.checked_add(1).ok_or_else(|| codec_err(table, format!("its last key is {k}, the largest there can be"))),
    }
}

pub(super) fn append_audit(
    wtx: &WriteTransaction,
    row: &mut AuditRow,
) -> Result<u64, StoreError> {
    append_audits(wtx, std::slice::from_mut(row))
}

/// Appends rows to the ledger with consecutive `seq`s, opening the table and reading the last
/// key once (a run may append thousands). Returns the last `seq` written.
pub(super) fn append_audits<R: LedgerRow>(wtx: &WriteTransaction, rows: &mut [R]) -> Result<u64, StoreError> {
    let mut audit = wtx.open_table(AUDIT)?;
    let mut index = wtx.open_table(AUDIT_BY_OUTCOME)?;
    let mut seq = audit.last()?.map(|(k, _)| k.value()).unwrap_or(0);
    let mut tally = super::totals::OutcomeTally::default();
    for row in rows {
        seq = next_key("audit", Some(seq))?;
        row.set_seq(seq);
        tally.count(row.outcome());
        audit.insert(seq, encode(row).as_slice())?;
        super::history_index::index_audit_row(&mut index, seq, row.outcome(), row.detail())?;
    }
    drop((audit, index));
    tally.commit_to(wtx)?;
    Ok(seq)
}

/// A row [`append_audits`] can write: stored as an [`AuditRow`], numbered as it is appended.
pub(super) trait LedgerRow: Serialize {
    fn set_seq(&mut self, seq: u64);
    /// What the row records (counted in `audit_totals`, indexed in `audit_by_outcome`).
    fn outcome(&self) -> Outcome;
    /// Its detail (a baseline's primed rows, detail `baseline`, are not in `audit_by_outcome`).
    fn detail(&self) -> &str;
}

impl LedgerRow for AuditRow {
    fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }
    fn outcome(&self) -> Outcome {
        self.outcome
    }
    fn detail(&self) -> &str {
        &self.detail
    }
}

impl LedgerRow for AuditRowRef<'_> {
    fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }
    fn outcome(&self) -> Outcome {
        self.outcome
    }
    fn detail(&self) -> &str {
        &self.detail
    }
}

/// An [`AuditRow`] whose text is borrowed, for the claims of a run: serde encodes a `&str`
/// as the `String` it stands for, so the stored bytes are an `AuditRow`'s (its fields must
/// stay those of `AuditRow`, in the same order: a unit test checks the bytes). A baseline writes
/// one per parcel an AOI touches; building owned rows copied five strings for each.
#[derive(Serialize)]
pub(super) struct AuditRowRef<'a> {
    pub seq: u64,
    pub ts_ms: u64,
    pub outcome: Outcome,
    pub idempotency_key: Option<&'a str>,
    pub watcher_id: Option<&'a str>,
    pub source_id: Option<&'a str>,
    pub parcel_id: Option<&'a str>,
    pub lineage_id: Option<&'a str>,
    pub detail: std::borrow::Cow<'a, str>,
}

pub(super) fn lineage_for(source_id: &str, run_id: u64, digest: &str) -> String {
    let short: String = digest.chars().take(12).collect();
    format!("{source_id}:{run_id}:{short}")
}

impl Store {
    /// Commits one run in one write transaction (see the module invariants).
    pub fn commit_run(&self, run: RunCommit) -> Result<RunRecord, StoreError> {
        let mut w = self.begin_run(&run.source_id, run.mode.clone(), run.watermark, run.now_ms, run.idem_ttl_ms)?;
        w.quarantine(&run.quarantine)?;
        w.upserts(run.upserts.iter().map(Parcel::borrowed))?;
        // Its one caller is area mode, whose rows are district polygons keyed by position: no
        // removal of one is an event, so none is announced (as its held release has it).
        w.removals(&run.removals, false)?;
        w.events(&run.events, &run.claims)?;
        w.places(&run.places)?;
        w.finish(run.started_ms, run.now_ms, run.counts, run.warnings)
    }

    /// Opens the one write transaction of a run. The caller feeds it in chunks (quarantine,
    /// upserts, removals, events with their claims, a derived run's shares) and then
    /// [`RunWriter::finish`]es it; dropping the writer unfinished aborts the transaction, so
    /// nothing of the run is visible.
    /// Older open holds of the source are closed here (superseded, or resolved by this run).
    pub fn begin_run(
        &self,
        source_id: &str,
        mode: CommitMode,
        mut watermark: Watermark,
        now_ms: u64,
        idem_ttl_ms: u64,
    ) -> Result<RunWriter<'_>, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let run_id = {
            let runs = wtx.open_table(RUNS)?;
            let last = runs.last()?.map(|(k, _)| k.value());
            next_key("runs", last)?
        };
        let lineage = lineage_for(source_id, run_id, &watermark.digest);
        watermark.run_id = run_id;
        let resolving = match mode {
            CommitMode::ResolveHold { hold_id, .. } => Some(hold_id),
            _ => None,
        };
        {
            let to_update = super::holds::open_of_source(&wtx, source_id)?;
            // Checked inside this transaction: a run of the source that committed after the
            // caller read the hold as open has superseded it (and cleared what it staged), and
            // resolving it now would set the watermark back to the held version's.
            if let Some(id) = resolving {
                if !to_update.iter().any(|h| h.run_id == id) {
                    return Err(StoreError::Conflict(format!("hold {id} of source {source_id} is no longer open (a later run of the source has resolved or superseded it)")));
                }
            }
            for mut hold in to_update {
                let id = hold.run_id;
                hold.state = if Some(id) == resolving {
                    match mode {
                        CommitMode::ResolveHold { prime: true, .. } => HoldState::Primed { at_ms: now_ms, run_id },
                        _ => HoldState::Released { at_ms: now_ms, run_id },
                    }
                } else {
                    HoldState::Superseded { at_ms: now_ms, by_run: run_id }
                };
                super::holds::write_resolved(&wtx, &hold)?;
                // A released area-mode hold's places become the source's (its events are
                // claimed as announced); a primed one's move their revisions on (its events'
                // keys are claimed as primed); a superseded one's are dropped.
                match hold.state {
                    HoldState::Released { .. } => super::area_places::release(&wtx, id, source_id, now_ms)?,
                    HoldState::Primed { .. } => super::area_places::prime(&wtx, id, source_id, now_ms)?,
                    _ => {}
                }
                clear_staged(&wtx, id)?;
            }
        }
        let next_quarantine = next_key("quarantine", wtx.open_table(QUARANTINE)?.last()?.map(|(k, _)| k.value()))?;
        // A hold resolution that primes the source's first ingest is its baseline (read in this
        // transaction: the watermark is written by every commit that writes parcels).
        let first_ingest = matches!(mode, CommitMode::ResolveHold { prime: true, .. }) && wtx.open_table(WATERMARKS)?.get(source_id)?.is_none();
        Ok(RunWriter {
            first_ingest,
            wtx,
            store: self,
            run_id,
            lineage,
            source_id: source_id.to_string(),
            mode,
            watermark,
            now_ms,
            idem_ttl_ms,
            claims: ClaimCounts::default(),
            events: 0,
            next_quarantine,
        })
    }

    /// Records a run whose bytes matched the watermark's digest: only the consumed time moves.
    pub fn commit_identical(
        &self,
        source_id: &str,
        started_ms: u64,
        now_ms: u64,
        features_hint: u64,
    ) -> Result<RunRecord, StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut wm: Watermark = {
            let t = wtx.open_table(WATERMARKS)?;
            let v = t
                .get(source_id)?
                .ok_or_else(|| StoreError::NotFound(format!("source {source_id} has no watermark")))?;
            decode_watermark(v.value()).map_err(|m| codec_err("watermarks", m))?
        };
        let run_id = next_key("runs", wtx.open_table(RUNS)?.last()?.map(|(k, _)| k.value()))?;
        wm.consumed_at_ms = now_ms;
        wtx.open_table(WATERMARKS)?.insert(source_id, encode_watermark(&wm).as_slice())?;
        let record = RunRecord {
            run_id,
            source_id: source_id.to_string(),
            lineage_id: lineage_for(source_id, run_id, &wm.digest),
            started_ms,
            finished_ms: now_ms,
            verdict: Verdict::Identical,
            digest: wm.digest.clone(),
            counts: RunCounts { features: features_hint, ..Default::default() },
            hold_id: None,
            warnings: vec![],
            error: None,
        };
        // Content identical to what was committed: any open hold is stale (the publisher
        // went back to the committed version), so it is superseded.
        supersede_open_holds(&wtx, source_id, run_id, now_ms)?;
        super::totals::append_run(&wtx, &record)?;
        // An identical run is a run commit too: the crash hook fires here as well.
        if self.take_injected_failure() {
            wtx.abort()?;
            return Err(StoreError::Injected(format!("identical run {run_id} of {source_id}")));
        }
        wtx.commit()?;
        Ok(record)
    }

    /// Records a run that changed nothing because it re-read the content of an open hold, or
    /// that failed before committing. Such runs leave the watermark and snapshot alone.
    pub fn record_run_note(&self, source_id: &str, started_ms: u64, finished_ms: u64, note: RunNote<'_>) -> Result<RunRecord, StoreError> {
        let RunNote { verdict, digest, hold_id, error } = note;
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let run_id = next_key("runs", wtx.open_table(RUNS)?.last()?.map(|(k, _)| k.value()))?;
        let record = RunRecord {
            run_id,
            source_id: source_id.to_string(),
            lineage_id: lineage_for(source_id, run_id, digest),
            started_ms,
            finished_ms,
            verdict,
            digest: digest.to_string(),
            counts: RunCounts::default(),
            hold_id,
            warnings: vec![],
            error,
        };
        super::totals::append_run(&wtx, &record)?;
        wtx.commit()?;
        Ok(record)
    }

    /// Feeds a hold's staged snapshot delta, then its change events, then its derived shares
    /// (a district or overlay source's), to `feed` in chunks of at most `chunk` items, in
    /// staging order, from one read snapshot. A held county-sized delta is never in memory at
    /// once: releasing a hold streams it into the release's run writer like a run streams
    /// its layer.
    pub fn for_each_held(
        &self,
        hold_id: u64,
        chunk: usize,
        mut feed: impl FnMut(HeldChunk) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let chunk = chunk.max(1);
        let rtx = self.db.begin_read()?;
        let staged = rtx.open_table(HELD_PARCELS)?;
        let mut upserts = Vec::new();
        let mut removals = Vec::new();
        for item in staged.range((hold_id, "")..)? {
            let (k, v) = item?;
            let (h, pid) = k.value();
            if h != hold_id {
                break;
            }
            let s = decode_staged(v.value()).map_err(|m| codec_err("held_parcels", m))?;
            match s.0 {
                Some((state, geometry)) => upserts.push(Parcel { id: pid.to_string(), state, geometry }),
                None => removals.push(pid.to_string()),
            }
            if upserts.len() + removals.len() >= chunk {
                feed(HeldChunk::Parcels { upserts: std::mem::take(&mut upserts), removals: std::mem::take(&mut removals) })?;
            }
        }
        if !upserts.is_empty() || !removals.is_empty() {
            feed(HeldChunk::Parcels { upserts, removals })?;
        }
        let events_t = rtx.open_table(HELD_EVENTS)?;
        let mut events = Vec::new();
        for item in events_t.range((hold_id, 0u64)..=(hold_id, u64::MAX))? {
            let (_, v) = item?;
            events.push(decode_held_event(v.value()).map_err(|m| codec_err("held_events", m))?);
            if events.len() >= chunk {
                feed(HeldChunk::Events(std::mem::take(&mut events)))?;
            }
        }
        if !events.is_empty() {
            feed(HeldChunk::Events(events))?;
        }
        let shares_t = rtx.open_table(HELD_SHARES)?;
        let mut shares = Vec::new();
        for item in shares_t.range((hold_id, "")..)? {
            let (k, v) = item?;
            let (h, pid) = k.value();
            if h != hold_id {
                break;
            }
            shares.push((pid.to_string(), decode(v.value()).map_err(|m| codec_err("held_shares", m))?));
            if shares.len() >= chunk {
                feed(HeldChunk::Shares(std::mem::take(&mut shares)))?;
            }
        }
        if !shares.is_empty() {
            feed(HeldChunk::Shares(shares))?;
        }
        Ok(())
    }
}

/// One piece of a held run, as [`Store::for_each_held`] hands it out.
#[derive(Debug)]
pub enum HeldChunk {
    Parcels { upserts: Vec<Parcel>, removals: Vec<String> },
    Events(Vec<ChangeEvent>),
    /// Derived shares staged by a held derived run.
    Shares(Vec<(String, f64)>),
}

/// One run's write transaction, fed in chunks so a county-sized delta never has to sit in
/// memory at once (see [`Store::begin_run`]). Everything it writes becomes visible together
/// at [`RunWriter::finish`], or not at all.
pub struct RunWriter<'s> {
    wtx: WriteTransaction,
    store: &'s Store,
    run_id: u64,
    lineage: String,
    source_id: String,
    mode: CommitMode,
    watermark: Watermark,
    now_ms: u64,
    idem_ttl_ms: u64,
    claims: ClaimCounts,
    /// Events of the run so far: written, or counted as matching no one
    /// ([`RunWriter::unmatched_events`]). Held events are numbered by it.
    events: u64,
    next_quarantine: u64,
    /// A hold resolution that primes the source's first ingest: its claims and its record
    /// are the baseline's (audit detail `baseline`, verdict `Baseline`).
    first_ingest: bool,
}

impl RunWriter<'_> {
    pub fn run_id(&self) -> u64 {
        self.run_id
    }

    pub fn lineage(&self) -> &str {
        &self.lineage
    }

    /// Quarantined features: a record and an audit row each.
    pub fn quarantine(&mut self, drafts: &[QuarantineDraft]) -> Result<(), StoreError> {
        if drafts.is_empty() {
            return Ok(());
        }
        {
            let mut q = self.wtx.open_table(QUARANTINE)?;
            for draft in drafts {
                let rec = QuarantineRecord {
                    source_id: self.source_id.clone(),
                    run_id: self.run_id,
                    lineage_id: self.lineage.clone(),
                    feature_index: draft.feature_index,
                    parcel_id: draft.parcel_id.clone(),
                    reason: draft.reason,
                    detail: draft.detail.clone(),
                    raw: draft.raw.clone(),
                    ts_ms: self.now_ms,
                };
                q.insert(self.next_quarantine, encode(&rec).as_slice())?;
                self.next_quarantine += 1;
            }
        }
        let mut rows: Vec<AuditRow> = drafts
            .iter()
            .map(|draft| AuditRow {
                seq: 0,
                ts_ms: self.now_ms,
                outcome: Outcome::Quarantined,
                idempotency_key: None,
                watcher_id: None,
                source_id: Some(self.source_id.clone()),
                parcel_id: draft.parcel_id.clone(),
                lineage_id: Some(self.lineage.clone()),
                detail: format!("{}: {}", draft.reason.as_str(), draft.detail),
            })
            .collect();
        append_audits(&self.wtx, &mut rows)?;
        Ok(())
    }

    /// The stored geometries of these parcels as they are *before* this run's upserts
    /// (read them for a chunk before calling [`RunWriter::upserts`] on it).
    pub fn old_geometries<'a>(&self, ids: impl IntoIterator<Item = &'a str>) -> Result<HashMap<String, StoredGeometry>, StoreError> {
        geometries_of(&self.wtx.open_table(PARCEL_BLOCKS)?, &self.source_id, ids)
    }

    /// New or changed parcels whose snapshot rows were made already, off the writing thread
    /// ([`SnapshotRow::encode`], or [`SnapshotRow::from_body`] from a spilled parcel's
    /// bytes): into the snapshot. A held run stages its parcels instead and must use
    /// [`RunWriter::upserts`].
    pub fn upserts_encoded(&mut self, rows: &[SnapshotRow]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        if matches!(self.mode, CommitMode::Hold { .. }) {
            return Err(StoreError::Conflict("a held run stages its parcels; it has no snapshot rows to write".into()));
        }
        if self.store.take_injected_write_failure() {
            return Err(StoreError::Injected(format!("snapshot write of run {} of {}", self.run_id, self.source_id)));
        }
        let mut changes: Vec<Change<'_>> = rows.iter().map(|r| (r.id.as_str(), Some(r.record.as_slice()))).collect();
        blocks::apply(&mut self.wtx.open_table(PARCEL_BLOCKS)?, &self.source_id, &mut changes)
    }

    /// New or changed parcels: into the snapshot, or staged with the hold. (A hold's
    /// resolution writes its staged parcels through [`RunWriter::upserts_held`], which knows
    /// what the source announces.)
    pub fn upserts<'p>(&mut self, parcels: impl IntoIterator<Item = ParcelRef<'p>>) -> Result<(), StoreError> {
        if matches!(self.mode, CommitMode::Hold { .. }) {
            let mut staged = self.wtx.open_table(HELD_PARCELS)?;
            for p in parcels {
                staged.insert((self.run_id, p.id), encode_staged(Some((p.state, p.geometry))).as_slice())?;
            }
        } else if matches!(self.mode, CommitMode::ResolveHold { .. }) {
            return Err(StoreError::Conflict("a hold's resolution writes its staged parcels with upserts_held".into()));
        } else {
            let rows: Vec<SnapshotRow> = parcels.into_iter().map(SnapshotRow::encode).collect();
            self.upserts_encoded(&rows)?;
        }
        Ok(())
    }

    /// A resolved hold's staged parcels into the snapshot. They were staged as the held run's
    /// scan stepped them (`detect::diff::step`), before anyone chose how to resolve it; each
    /// is stepped again here from the record it has now — the one the held run diffed
    /// against (any later commit of the source would have superseded the hold) — as this
    /// resolution announces it: a primed hold nothing; a released one the changes
    /// `announces(stored state, staged state)` says its source announces (a parcel layer:
    /// every change but an effective-date-only one; a derived layer: those that alert); a held
    /// `--reprocess` is resolved as a prime (`Engine::resolve_hold`). Rows staged before
    /// revisions existed get theirs the same way.
    pub fn upserts_held<'p>(
        &mut self,
        parcels: impl IntoIterator<Item = ParcelRef<'p>>,
        announces: &dyn Fn(Option<&ParcelState>, &ParcelState) -> bool,
    ) -> Result<(), StoreError> {
        let CommitMode::ResolveHold { prime, .. } = self.mode else {
            return Err(StoreError::Conflict("only the resolution of a hold writes held parcels".into()));
        };
        let blocks = self.wtx.open_table(PARCEL_BLOCKS)?;
        let tombstones = self.wtx.open_table(PARCEL_TOMBSTONES)?;
        let mut rows = Vec::new();
        for p in parcels {
            let (prior, stored) = prior_in(&blocks, &tombstones, &self.source_id, p.id)?;
            let taken = step(prior, content_of(p.state), !prime && announces(stored.as_ref(), p.state));
            let state = ParcelState { revision: taken.revision, announced: taken.announced, ..p.state.clone() };
            rows.push(SnapshotRow::encode(ParcelRef { id: p.id, state: &state, geometry: p.geometry }));
        }
        drop((blocks, tombstones));
        self.upserts_encoded(&rows)
    }

    /// Parcels gone from the layer: out of the snapshot, or staged with the hold. `announced`:
    /// whether the source announces a removal when its run does (a parcel layer does; a
    /// derived layer never does), for the tombstone's step.
    pub fn removals(&mut self, ids: &[String], announced: bool) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        if matches!(self.mode, CommitMode::Hold { .. }) {
            let mut staged = self.wtx.open_table(HELD_PARCELS)?;
            for id in ids {
                staged.insert((self.run_id, id.as_str()), encode_staged(None).as_slice())?;
            }
        } else {
            let mut table = self.wtx.open_table(PARCEL_BLOCKS)?;
            // Each removed parcel's revision and announcement go on in its tombstone
            // (`tombstones.rs`), stepped as the run's removal event was: read before the
            // blocks lose them. An id not stored leaves nothing to remember.
            let announce = announced && self.mode.announces();
            let mut buried = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(state) = blocks::with_record(&table, &self.source_id, id, decode_state)? {
                    let state = state.map_err(|m| codec_err("parcel_blocks", m))?;
                    let gone = step(Prior::of(&state), ABSENT_CONTENT, announce);
                    buried.push((id.as_str(), Tombstone { revision: gone.revision, announced: gone.announced, removed_ms: self.now_ms }));
                }
            }
            let mut changes: Vec<Change<'_>> = ids.iter().map(|id| (id.as_str(), None)).collect();
            blocks::apply(&mut table, &self.source_id, &mut changes)?;
            drop(table);
            super::tombstones::bury(&self.wtx, &self.source_id, &buried)?;
            super::derived::remove_shares(&self.wtx, &self.source_id, ids)?;
        }
        Ok(())
    }

    /// Derived shares that moved (see `store::derived`): written, or staged with the hold. A
    /// removed parcel's share goes with it ([`RunWriter::removals`]).
    pub fn shares(&mut self, shares: &[(String, f64)]) -> Result<(), StoreError> {
        if matches!(self.mode, CommitMode::Hold { .. }) {
            super::derived::stage_shares(&self.wtx, self.run_id, shares)
        } else {
            super::derived::write_shares(&self.wtx, &self.source_id, shares)
        }
    }

    /// An area-mode run's places, as `detect::diff::step` left them (`store::area_places`):
    /// staged with the hold when it is held (its release writes them, its prime moves their
    /// revisions on), written otherwise — an unannounced run's too (a reprocess), whose
    /// steps move revisions on and keep announcements, so that no later change of a place
    /// reuses a key it primed (ARCHITECTURE invariant 26).
    pub fn places(&mut self, places: &[(String, super::PlaceState)]) -> Result<(), StoreError> {
        match self.mode {
            CommitMode::Hold { .. } => super::area_places::stage(&self.wtx, self.run_id, places),
            _ => super::area_places::write(&self.wtx, &self.source_id, places),
        }
    }

    /// Change events and the subscribers' claims on them (`Claim::event` indexes `events`):
    /// keys claimed, outbox rows and audit rows written — or, for a hold, the events staged.
    pub fn events(&mut self, events: &[ChangeEvent], claims: &[Claim]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        if matches!(self.mode, CommitMode::Hold { .. }) {
            let mut held = self.wtx.open_table(HELD_EVENTS)?;
            for (i, e) in events.iter().enumerate() {
                held.insert((self.run_id, self.events + i as u64), encode_held_event(e).as_slice())?;
            }
        } else {
            let claim_mode = match self.mode {
                CommitMode::Baseline => ClaimMode::Prime { detail: BASELINE_DETAIL },
                CommitMode::Reprocess => ClaimMode::Prime { detail: "reprocess" },
                CommitMode::ResolveHold { prime: true, .. } if self.first_ingest => ClaimMode::Prime { detail: BASELINE_DETAIL },
                CommitMode::ResolveHold { prime: true, .. } => ClaimMode::Prime { detail: "hold_primed" },
                _ => ClaimMode::Deliver,
            };
            let c = claim_in_txn(&self.store.key_index, &self.wtx, events, claims, &self.lineage, claim_mode, self.now_ms, self.idem_ttl_ms)?;
            self.claims.queued += c.queued;
            self.claims.duplicates += c.duplicates;
            self.claims.suppressed += c.suppressed;
            self.claims.below_min_severity += c.below_min_severity;
        }
        self.events += events.len() as u64;
        Ok(())
    }

    /// Counts events that match no subscriber and so write nothing (new parcels outside
    /// every subscriber's envelope, whose events the commit does not build): they are the
    /// run's changes all the same. Not for a held run, which keeps every event.
    pub fn unmatched_events(&mut self, n: u64) {
        // A held run numbers its kept events by this count: it must count only those.
        debug_assert!(n == 0 || !matches!(self.mode, CommitMode::Hold { .. }), "a held run keeps every event");
        self.events += n;
    }

    /// Writes the hold (if held) or the watermark, and the run record, and commits.
    /// `counts.changes` is taken from the events written and counted.
    pub fn finish(self, started_ms: u64, finished_ms: u64, mut counts: RunCounts, warnings: Vec<String>) -> Result<RunRecord, StoreError> {
        let RunWriter { wtx, store, run_id, lineage, source_id, mode, watermark, now_ms, idem_ttl_ms, claims, events, first_ingest, .. } = self;
        let mut verdict = match mode {
            CommitMode::Baseline => Verdict::Baseline,
            CommitMode::Deliver => Verdict::Run,
            CommitMode::Reprocess => Verdict::Reprocessed,
            CommitMode::Hold { .. } => Verdict::Held,
            CommitMode::ResolveHold { .. } => Verdict::Run,
        };
        let mut hold_id = None;
        match &mode {
            CommitMode::Hold { reason, reprocess } => {
                hold_id = Some(run_id);
                let hold = Hold {
                    run_id,
                    source_id: source_id.clone(),
                    lineage_id: lineage.clone(),
                    created_ms: now_ms,
                    reason: reason.clone(),
                    state: HoldState::Open,
                    digest: watermark.digest.clone(),
                    watermark: watermark.clone(),
                    changes: events,
                    features: counts.features,
                    reprocess: *reprocess,
                };
                super::holds::insert_open(&wtx, &hold)?;
                append_audit(
                    &wtx,
                    &mut AuditRow {
                        seq: 0,
                        ts_ms: now_ms,
                        outcome: Outcome::Held,
                        idempotency_key: None,
                        watcher_id: None,
                        source_id: Some(source_id.clone()),
                        parcel_id: None,
                        lineage_id: Some(lineage.clone()),
                        detail: format!("hold {run_id}: {reason}"),
                    },
                )?;
            }
            mode => {
                write_watermark(&wtx, &source_id, &watermark)?;
                // Tombstones older than the key TTL have outlived every key they could tell
                // apart (`tombstones.rs`).
                let swept = super::tombstones::sweep(&wtx, &source_id, now_ms.saturating_sub(idem_ttl_ms))?;
                if swept > 0 {
                    tracing::debug!(source = %source_id, swept, "tombstones past the key TTL removed");
                }
                // Likewise an area-mode source's places (`area_places.rs`).
                let swept = super::area_places::sweep(&wtx, &source_id, now_ms.saturating_sub(idem_ttl_ms))?;
                if swept > 0 {
                    tracing::debug!(source = %source_id, swept, "area places past the key TTL removed");
                }
                counts.queued = claims.queued;
                counts.duplicates = claims.duplicates;
                counts.suppressed = claims.suppressed;
                counts.below_min_severity = claims.below_min_severity;
                if let CommitMode::ResolveHold { hold_id: h, prime } = mode {
                    hold_id = Some(*h);
                    if *prime {
                        verdict = if first_ingest { Verdict::Baseline } else { Verdict::Reprocessed };
                    }
                }
            }
        }
        counts.changes = events;
        let record = RunRecord {
            run_id,
            source_id: source_id.clone(),
            lineage_id: lineage,
            started_ms,
            finished_ms,
            verdict,
            digest: watermark.digest.clone(),
            counts,
            hold_id,
            warnings,
            error: None,
        };
        super::totals::append_run(&wtx, &record)?;
        if store.take_injected_failure() {
            wtx.abort()?;
            return Err(StoreError::Injected(format!("run {run_id} of {source_id}")));
        }
        wtx.commit()?;
        store.merge_key_journal_if_full();
        Ok(record)
    }
}

pub(super) fn write_watermark(wtx: &WriteTransaction, source_id: &str, wm: &Watermark) -> Result<(), StoreError> {
    let bytes = encode_watermark(wm);
    wtx.open_table(WATERMARKS)?.insert(source_id, bytes.as_slice())?;
    wtx.open_table(WATERMARK_HISTORY)?.insert((source_id, wm.run_id), bytes.as_slice())?;
    Ok(())
}

pub(super) fn supersede_open_holds(
    wtx: &WriteTransaction,
    source_id: &str,
    by_run: u64,
    now_ms: u64,
) -> Result<(), StoreError> {
    for mut hold in super::holds::open_of_source(wtx, source_id)? {
        hold.state = HoldState::Superseded { at_ms: now_ms, by_run };
        super::holds::write_resolved(wtx, &hold)?;
        clear_staged(wtx, hold.run_id)?;
    }
    Ok(())
}

fn clear_staged(wtx: &WriteTransaction, hold_id: u64) -> Result<(), StoreError> {
    let mut staged = wtx.open_table(HELD_PARCELS)?;
    staged.retain_in((hold_id, "")..(hold_id + 1, ""), |_, _| false)?;
    let mut events = wtx.open_table(HELD_EVENTS)?;
    events.retain_in((hold_id, 0u64)..(hold_id + 1, 0u64), |_, _| false)?;
    let mut shares = wtx.open_table(HELD_SHARES)?;
    shares.retain_in((hold_id, "")..(hold_id + 1, ""), |_, _| false)?;
    super::area_places::clear_staged(wtx, hold_id)
}

/// What a parcel's record says before a change, read in a run's transaction: its stored
/// state's revision and announcement (and the state), or its tombstone's, or nothing (never
/// stored).
fn prior_in<B: blocks::BlockTable, T: ReadableTable<(&'static str, &'static str), &'static [u8]>>(
    blocks: &B,
    tombstones: &T,
    source_id: &str,
    parcel_id: &str,
) -> Result<(Prior, Option<ParcelState>), StoreError> {
    if let Some(state) = blocks::with_record(blocks, source_id, parcel_id, decode_state)? {
        let state = state.map_err(|m| codec_err("parcel_blocks", m))?;
        return Ok((Prior::of(&state), Some(state)));
    }
    let buried = super::tombstones::find(tombstones, source_id, parcel_id)?;
    Ok((buried.as_ref().map(Prior::buried).unwrap_or_default(), None))
}

pub(super) fn codec_err(table: &'static str, message: String) -> StoreError {
    StoreError::Codec { table, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::sample_event;

    /// A table whose last key is the largest there can be is refused, not wrapped to 0.
    #[test]
    fn the_key_after_the_largest_is_an_error() {
        assert_eq!(next_key("runs", None).unwrap(), 1);
        assert_eq!(next_key("runs", Some(41)).unwrap(), 42);
        assert!(next_key("runs", Some(u64::MAX)).unwrap_err().to_string().contains("the largest there can be"));
    }

    /// A claim's borrowed audit row is stored as the owned row it stands for, and read back
    /// as one.
    #[test]
    fn a_borrowed_audit_row_is_stored_as_an_owned_one() {
        let owned = AuditRow {
            seq: 7,
            ts_ms: 1_700_000_000_123,
            outcome: Outcome::Suppressed,
            idempotency_key: Some("ab".repeat(32)),
            watcher_id: Some("w-1".into()),
            source_id: None,
            parcel_id: Some("P|1".into()),
            lineage_id: Some("s:3:0123456789ab".into()),
            detail: "baseline".into(),
        };
        let key = "ab".repeat(32);
        let borrowed = AuditRowRef {
            seq: 7,
            ts_ms: 1_700_000_000_123,
            outcome: Outcome::Suppressed,
            idempotency_key: Some(&key),
            watcher_id: Some("w-1"),
            source_id: None,
            parcel_id: Some("P|1"),
            lineage_id: Some("s:3:0123456789ab"),
            detail: std::borrow::Cow::Borrowed("baseline"),
        };
        let bytes = encode(&borrowed);
        assert_eq!(bytes, encode(&owned));
        assert_eq!(decode::<AuditRow>(&bytes).unwrap(), owned);
    }

    fn parcel(id: &str) -> Parcel {
        Parcel {
            id: id.into(),
            state: ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 1.0, revision: 0, announced: None },
            geometry: StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]),
        }
    }

    /// A held delta comes back whole, in staging order, never more than `chunk` at a time.
    #[test]
    fn held_runs_are_read_back_in_bounded_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let mut w = store.begin_run("s", CommitMode::Hold { reason: "test".into(), reprocess: false }, Watermark::default(), 1, 1_000).unwrap();
        let ids: Vec<String> = (0..7).map(|i| format!("p{i}")).collect();
        let parcels: Vec<Parcel> = ids.iter().map(|id| parcel(id)).collect();
        w.upserts(parcels.iter().map(Parcel::borrowed)).unwrap();
        w.removals(&["q0".to_string(), "q1".to_string()], true).unwrap();
        w.events(&ids.iter().take(5).map(|id| sample_event(id)).collect::<Vec<_>>(), &[]).unwrap();
        w.shares(&[("p0".to_string(), 0.75), ("p1".to_string(), 1.0), ("p2".to_string(), 0.5)]).unwrap();
        let rec = w.finish(1, 1, RunCounts::default(), vec![]).unwrap();
        let hold = rec.hold_id.unwrap();
        // Another source's hold, staged after it: its rows must not be mixed in.
        let mut other = store.begin_run("t", CommitMode::Hold { reason: "test".into(), reprocess: false }, Watermark::default(), 1, 1_000).unwrap();
        other.upserts([parcel("x0")].iter().map(Parcel::borrowed)).unwrap();
        other.removals(&["x1".to_string()], true).unwrap();
        other.events(&[sample_event("x0")], &[]).unwrap();
        other.shares(&[("x0".to_string(), 0.25)]).unwrap();
        assert!(other.finish(1, 1, RunCounts::default(), vec![]).unwrap().hold_id.unwrap() > hold);

        let (mut upserts, mut removals, mut events, mut shares, mut largest) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
        store
            .for_each_held(hold, 2, |chunk| {
                match chunk {
                    HeldChunk::Parcels { upserts: u, removals: r } => {
                        largest = largest.max(u.len() + r.len());
                        upserts.extend(u.into_iter().map(|p| p.id));
                        removals.extend(r);
                    }
                    HeldChunk::Events(e) => {
                        largest = largest.max(e.len());
                        events.extend(e.into_iter().map(|e| e.parcel_id));
                    }
                    HeldChunk::Shares(s) => {
                        largest = largest.max(s.len());
                        shares.extend(s);
                    }
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(largest, 2);
        assert_eq!(upserts, ids);
        assert_eq!(removals, ["q0", "q1"]);
        assert_eq!(events, ids[..5]);
        assert_eq!(shares, [("p0".to_string(), 0.75), ("p1".to_string(), 1.0), ("p2".to_string(), 0.5)]);
        // An unknown hold yields nothing.
        let mut n = 0;
        store.for_each_held(hold + 100, 2, |_| { n += 1; Ok(()) }).unwrap();
        assert_eq!(n, 0);
    }

    /// A parcel with zoning `zoning` (its content hash follows the code) at `revision`.
    fn zoned(id: &str, zoning: &str, revision: u32) -> Parcel {
        let mut p = parcel(id);
        p.state.zoning = zoning.into();
        p.state.content_hash = crate::detect::canonical::content_hash(zoning, None, &p.state.geom_hash);
        p.state.revision = revision;
        p
    }

    /// What the store holds of a parcel: its state's revision and announcement, or its
    /// tombstone's.
    fn remembered(store: &Store, id: &str) -> (u32, Option<Announced>) {
        let view = store.snapshot_view("s").unwrap();
        match view.get(id).unwrap() {
            Some(state) => (state.revision, state.announced),
            None => view.tombstone(id).unwrap().map(|t| (t.revision, t.announced)).expect("a tombstone"),
        }
    }

    /// A removal's tombstone is stepped as its caller says the source announces removals (a
    /// derived source never does) and as the run's mode allows; a resolved hold's parcels
    /// are stepped again from their records, as the resolution and the source's rule say.
    #[test]
    fn removals_and_resolved_holds_step_as_their_source_announces() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let mut w = store.begin_run("s", CommitMode::Baseline, Watermark::default(), 1, 1_000_000).unwrap();
        let base: Vec<Parcel> = ["a", "b", "c", "d"].iter().map(|id| zoned(id, "R-1", 0)).collect();
        w.upserts(base.iter().map(Parcel::borrowed)).unwrap();
        w.finish(1, 1, RunCounts::default(), vec![]).unwrap();

        let mut w = store.begin_run("s", CommitMode::Deliver, Watermark::default(), 2, 1_000_000).unwrap();
        w.removals(&["a".to_string()], true).unwrap();
        w.removals(&["b".to_string()], false).unwrap();
        w.finish(2, 2, RunCounts::default(), vec![]).unwrap();
        assert_eq!(remembered(&store, "a"), (1, Some(Announced { content: ABSENT_CONTENT, key_revision: 0 })), "announced");
        assert_eq!(remembered(&store, "b"), (1, None), "a derived removal tells no one (and moves the revision on)");

        // A hold of c and d rezoned, released: c by a rule that announces, d by one that does not.
        let mut w = store.begin_run("s", CommitMode::Hold { reason: "test".into(), reprocess: false }, Watermark::default(), 3, 1_000_000).unwrap();
        let staged = [zoned("c", "C-2", 9), zoned("d", "C-2", 9)];
        w.upserts(staged.iter().map(Parcel::borrowed)).unwrap();
        let hold = w.finish(3, 3, RunCounts::default(), vec![]).unwrap().hold_id.unwrap();
        let mut w = store.begin_run("s", CommitMode::ResolveHold { hold_id: hold, prime: false }, Watermark::default(), 4, 1_000_000).unwrap();
        w.upserts_held(staged[..1].iter().map(Parcel::borrowed), &|_, _| true).unwrap();
        w.upserts_held(staged[1..].iter().map(Parcel::borrowed), &|_, _| false).unwrap();
        w.finish(4, 4, RunCounts::default(), vec![]).unwrap();
        let told_c2 = Announced { content: crate::detect::diff::content_of(&staged[0].state), key_revision: 0 };
        assert_eq!(remembered(&store, "c"), (1, Some(told_c2)), "stepped from its record (revision 0), not the staged 9");
        assert_eq!(remembered(&store, "d"), (1, None), "told nothing, the revision moved on");
        assert!(store.begin_run("s", CommitMode::Deliver, Watermark::default(), 5, 1).unwrap().upserts_held(staged.iter().map(Parcel::borrowed), &|_, _| true).is_err());
    }
}
