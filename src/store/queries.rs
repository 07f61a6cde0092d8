//! Read-only queries: snapshots for the diff, the audit ledger, holds, runs, dead letters,
//! quarantine and summary counts. Each uses one read transaction (a consistent view).

use super::blocks::{for_each_parcel, with_record};
use super::codec::decode;
use super::runs::codec_err;
use super::watermark_rows::{decode_hold, decode_watermark, readable_hold};
use super::snapshot::{decode_hash_ref, decode_record, decode_state, decode_state_envelope, geometries_of};
use super::tables::*;
use super::tombstones::Tombstone;
use super::history_index::{is_baseline_prime, walk_audit_classes, AuditClass};
use super::{Store, StoreError};
use crate::model::*;
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata};
use std::collections::HashMap;

/// Every readable hold of a file's read transaction (a row that cannot be read is logged and
/// skipped): the store's, or a backup's being restored (`backup::restore` warns of those open;
/// a backup old enough to have no holds table has none).
pub(super) fn holds_in(rtx: &redb::ReadTransaction) -> Result<Vec<Hold>, StoreError> {
    let t = match rtx.open_table(HOLDS) {
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        t => t?,
    };
    let mut out = Vec::new();
    for item in t.iter()? {
        let (k, v) = item?;
        out.extend(readable_hold(k.value(), v.value()));
    }
    Ok(out)
}

/// The two lists of dead letters an operator pages through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterList {
    /// Dead letters waiting for a replay (`GET /v1/deadletters`).
    Waiting,
    /// Dead letters set aside for a person (`GET /v1/deadletters/quarantined`).
    Quarantined,
}

impl DeadLetterList {
    fn table(self) -> redb::TableDefinition<'static, u64, &'static [u8]> {
        match self {
            DeadLetterList::Waiting => DEAD_LETTERS,
            DeadLetterList::Quarantined => DLQ_QUARANTINE,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            DeadLetterList::Waiting => "dead letter",
            DeadLetterList::Quarantined => "quarantined dead letter",
        }
    }
}

/// What a replay needs to order and choose a dead letter before it reads the row itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayPick {
    pub id: u64,
    /// When its change was observed (the replay's order), see `notify::replay::observed_ms`.
    pub observed_ms: u64,
    pub watcher_id: String,
}

impl ReplayPick {
    pub fn of(d: &DeadLetter) -> ReplayPick {
        ReplayPick { id: d.entry.id, observed_ms: crate::notify::replay::observed_ms(d), watcher_id: d.entry.watcher_id.clone() }
    }
}

/// Up to `limit` rows of `table` after the key `after`, each decoded by `decode`; a row that
/// does not decode is left out with an error log naming it as a `noun` (`check --store` names
/// it too): one damaged row must not hide every other.
pub(super) fn read_page<T>(
    table: &impl ReadableTable<u64, &'static [u8]>,
    after: Option<u64>,
    limit: usize,
    decode: impl Fn(&[u8]) -> Result<T, String>,
    noun: &str,
) -> Result<Vec<(u64, T)>, StoreError> {
    let Some(start) = first_after(after) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for item in table.range(start..)? {
        if out.len() >= limit {
            break;
        }
        let (k, v) = item?;
        match decode(v.value()) {
            Ok(row) => out.push((k.value(), row)),
            Err(why) => tracing::error!(row = k.value(), "{noun} {} cannot be read and is left out: {why}", k.value()),
        }
    }
    Ok(out)
}

/// The first key of a page read after the key `after` (from the start without one); `None`
/// after the last key there can be (a cursor of `u64::MAX`: `+ 1` would overflow).
pub(super) fn first_after(after: Option<u64>) -> Option<u64> {
    match after {
        None => Some(0),
        Some(a) => a.checked_add(1),
    }
}

/// Filters for the audit ledger; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct AuditFilter {
    pub parcel: Option<String>,
    pub watcher: Option<String>,
    pub source: Option<String>,
    pub key: Option<String>,
    pub lineage: Option<String>,
    /// Only rows of these outcomes. Read through the ledger's outcome index, so a page costs
    /// what it returns however many rows of other outcomes lie between (`history_index.rs`).
    pub outcomes: Option<Vec<Outcome>>,
    /// Leave out the `suppressed` rows a baseline primed (one per parcel an AOI touches).
    pub without_baseline_primes: bool,
    pub since_seq: Option<u64>,
    pub limit: Option<usize>,
}

impl AuditFilter {
    fn matches(&self, row: &AuditRow) -> bool {
        fn eq(f: &Option<String>, v: &Option<String>) -> bool {
            f.as_ref().is_none_or(|f| v.as_deref() == Some(f.as_str()))
        }
        eq(&self.parcel, &row.parcel_id)
            && eq(&self.watcher, &row.watcher_id)
            && eq(&self.source, &row.source_id)
            && eq(&self.key, &row.idempotency_key)
            && eq(&self.lineage, &row.lineage_id)
            && self.outcomes.as_ref().is_none_or(|list| list.contains(&row.outcome))
            && !(self.without_baseline_primes && is_baseline_prime(row.outcome, &row.detail))
    }
}

/// Totals for summaries (the demo's table, `/metrics` later).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreStats {
    pub runs: u64,
    pub changes: u64,
    pub queued: u64,
    pub sent: u64,
    pub duplicates: u64,
    pub suppressed: u64,
    pub dead_letters: u64,
    pub quarantined: u64,
    pub held: u64,
    pub outbox: u64,
    pub open_holds: u64,
}

/// A consistent read view of one source's stored parcel states, for the streaming diff:
/// point lookups by parcel id (shared by the diff's worker threads) and an ordered scan.
/// Taken once per run, so the whole diff compares against one snapshot even if the store is
/// written meanwhile (the run lease keeps this source's snapshot itself unchanged).
pub struct SnapshotView {
    table: redb::ReadOnlyTable<(&'static str, &'static str), &'static [u8]>,
    source_id: String,
    /// Removed parcels' tombstones (`tombstones.rs`), from the same read transaction;
    /// `None` when the source has none (then no parcel is looked up).
    tombstones: Option<redb::ReadOnlyTable<(&'static str, &'static str), &'static [u8]>>,
}

impl SnapshotView {
    /// A removed parcel's tombstone, if it has one (a parcel not in the snapshot that has
    /// none was never stored, or not within the key TTL). Looked up only for a parcel the
    /// snapshot does not hold: a point read, and none at all while the store has no
    /// tombstone (a first ingest's millions of new parcels).
    pub fn tombstone(&self, parcel_id: &str) -> Result<Option<Tombstone>, StoreError> {
        match &self.tombstones {
            Some(table) => super::tombstones::find(table, &self.source_id, parcel_id),
            None => Ok(None),
        }
    }

    /// What the record of a parcel the snapshot does not hold says before a change
    /// (`detect::diff::step`): its tombstone's revision and announcement, or nothing.
    pub fn prior_of_absent(&self, parcel_id: &str) -> Result<crate::detect::diff::Prior, StoreError> {
        Ok(self.tombstone(parcel_id)?.as_ref().map(crate::detect::diff::Prior::buried).unwrap_or_default())
    }

    /// Whether the source has any parcel stored.
    pub fn has_parcels(&self) -> Result<bool, StoreError> {
        match self.table.range((self.source_id.as_str(), "")..)?.next() {
            Some(item) => Ok(item?.0.value().0 == self.source_id),
            None => Ok(false),
        }
    }

    /// The stored state of one parcel.
    pub fn get(&self, parcel_id: &str) -> Result<Option<ParcelState>, StoreError> {
        match with_record(&self.table, &self.source_id, parcel_id, decode_state)? {
            Some(state) => Ok(Some(state.map_err(|m| codec_err("parcel_blocks", m))?)),
            None => Ok(None),
        }
    }

    /// The stored state of one parcel and the bounding rectangle of its geometry's exterior
    /// rings (`None` for a parcel stored without a geometry).
    pub fn get_with_envelope(&self, parcel_id: &str) -> Result<Option<(ParcelState, Option<Envelope>)>, StoreError> {
        match with_record(&self.table, &self.source_id, parcel_id, decode_state_envelope)? {
            Some(found) => Ok(Some(found.map_err(|m| codec_err("parcel_blocks", m))?)),
            None => Ok(None),
        }
    }

    /// The stored geometry of one parcel (`None` for a parcel not stored, or stored without
    /// one; its state is skipped): what a change of shape is measured against
    /// (`canonical::same_but_for_rounding`).
    pub fn geometry(&self, parcel_id: &str) -> Result<Option<StoredGeometry>, StoreError> {
        match with_record(&self.table, &self.source_id, parcel_id, super::snapshot::decode_geometry)? {
            Some(found) => found.map_err(|m| codec_err("parcel_blocks", m)),
            None => Ok(None),
        }
    }

    /// Every stored parcel's id and content hash, in id order, borrowed (one list of entries
    /// per block is all it allocates): the streaming diff builds its in-memory index from
    /// this. Returns how many there are.
    pub fn for_each_hash(&self, mut f: impl FnMut(&str, &[u8; 32])) -> Result<u64, StoreError> {
        for_each_parcel(&self.table, &self.source_id, |pid, bytes| {
            let state = decode_hash_ref(bytes).map_err(|m| codec_err("parcel_blocks", m))?;
            f(pid, &state.content_hash);
            Ok(())
        })
    }

    /// Every stored parcel of the source in id order; returns how many there are.
    pub fn for_each(&self, mut f: impl FnMut(&str, ParcelState)) -> Result<u64, StoreError> {
        for_each_parcel(&self.table, &self.source_id, |pid, bytes| {
            f(pid, decode_state(bytes).map_err(|m| codec_err("parcel_blocks", m))?);
            Ok(())
        })
    }
}

/// Calls `each` with the parcel id and stored bytes of every row of `source_id` in a
/// `(source id, parcel id)`-keyed table, in parcel id order (the source's key range); returns
/// how many rows there were. Stops at the first error.
pub(super) fn for_each_source_row<T>(
    table: &T,
    source_id: &str,
    mut each: impl FnMut(&str, &[u8]) -> Result<(), StoreError>,
) -> Result<u64, StoreError>
where
    T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
{
    let mut n = 0;
    for item in table.range((source_id, "")..)? {
        let (k, v) = item?;
        let (s, pid) = k.value();
        if s != source_id {
            break;
        }
        each(pid, v.value())?;
        n += 1;
    }
    Ok(n)
}

/// What [`Store::kept_counts`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptCounts {
    pub dead_letters: u64,
    pub parked_dead_letters: u64,
    pub quarantined_features: u64,
}

impl Store {
    pub fn watermark(&self, source_id: &str) -> Result<Option<Watermark>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(WATERMARKS)?;
        match t.get(source_id)? {
            Some(v) => Ok(Some(decode_watermark(v.value()).map_err(|m| codec_err("watermarks", m))?)),
            None => Ok(None),
        }
    }

    /// The watermark history of a source, oldest first.
    pub fn watermark_history(&self, source_id: &str) -> Result<Vec<Watermark>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(WATERMARK_HISTORY)?;
        let mut out = Vec::new();
        for item in t.range((source_id, 0u64)..)? {
            let (k, v) = item?;
            if k.value().0 != source_id {
                break;
            }
            out.push(decode_watermark(v.value()).map_err(|m| codec_err("watermark_history", m))?);
        }
        Ok(out)
    }

    /// A read view of a source's snapshot for the streaming diff. While the source has no
    /// tombstone (a first ingest, a source that never lost a parcel), the view looks none up.
    pub fn snapshot_view(&self, source_id: &str) -> Result<SnapshotView, StoreError> {
        let rtx = self.db.begin_read()?;
        let tombstones = rtx.open_table(PARCEL_TOMBSTONES)?;
        let has_any = match tombstones.range((source_id, "")..)?.next() {
            Some(item) => item?.0.value().0 == source_id,
            None => false,
        };
        let tombstones = has_any.then_some(tombstones);
        Ok(SnapshotView { table: rtx.open_table(PARCEL_BLOCKS)?, source_id: source_id.to_string(), tombstones })
    }

    /// The stored parcel states of a source (no geometries), keyed by parcel id.
    pub fn snapshot_states(&self, source_id: &str) -> Result<HashMap<String, ParcelState>, StoreError> {
        let mut out = HashMap::new();
        self.snapshot_view(source_id)?.for_each(|pid, state| {
            out.insert(pid.to_string(), state);
        })?;
        Ok(out)
    }

    /// Every row of a `(source id, parcel id)`-keyed table for one source, keyed by parcel id.
    pub(super) fn source_rows<T: serde::de::DeserializeOwned>(
        &self,
        table: redb::TableDefinition<(&str, &str), &[u8]>,
        name: &'static str,
        source_id: &str,
    ) -> Result<HashMap<String, T>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut out = HashMap::new();
        for_each_source_row(&rtx.open_table(table)?, source_id, |pid, bytes| {
            out.insert(pid.to_string(), decode(bytes).map_err(|m| codec_err(name, m))?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Every parcel of a source with its state and geometry, in id order, from one scan, in
    /// memory (tests and the bench; a derived run reads its base a stretch at a time,
    /// [`Store::for_each_base_stretch`]). A parcel without a geometry (see
    /// [`Store::parcel_geometries`]) is left out.
    pub fn snapshot_parcels(&self, source_id: &str) -> Result<Vec<(String, ParcelState, StoredGeometry)>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut out = Vec::new();
        for_each_parcel(&rtx.open_table(PARCEL_BLOCKS)?, source_id, |pid, bytes| {
            if let (state, Some(geometry)) = decode_record(bytes).map_err(|m| codec_err("parcel_blocks", m))? {
                out.push((pid.to_string(), state, geometry));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Stored geometries of the given parcels of a source.
    pub fn parcel_geometries<'a>(
        &self,
        source_id: &str,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<HashMap<String, StoredGeometry>, StoreError> {
        let rtx = self.db.begin_read()?;
        geometries_of(&rtx.open_table(PARCEL_BLOCKS)?, source_id, ids)
    }

    /// Walks the audit rows matching `filter` (its `limit` ignored) one at a time, oldest
    /// first from `since_seq`, or newest first from below `before_seq` when `desc`, until
    /// `visit` answers false. Nothing is collected: a page of a ledger of millions of rows
    /// (the dashboard asks for one every few seconds) costs what it reads, not the ledger.
    ///
    /// With `filter.outcomes` (and not the baseline's primed rows), the rows are found through
    /// the outcome index: a page of rare outcomes behind a county baseline's primed rows reads
    /// the page, not the baseline.
    pub fn audit_walk(&self, filter: &AuditFilter, desc: bool, before_seq: Option<u64>, mut visit: impl FnMut(AuditRow) -> bool) -> Result<(), StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(AUDIT)?;
        let from = filter.since_seq.unwrap_or(0);
        // Ok(true): go on.
        let mut offer = |key: u64, bytes: &[u8]| -> Result<bool, StoreError> {
            // A row that does not decode is damage: left out with an error log (`check
            // --store` names it), so that one damaged row does not hide the whole ledger from
            // `zonewatch audit` and the control port (it answered 500 to every page).
            let row: AuditRow = match decode(bytes) {
                Ok(row) => row,
                Err(error) => {
                    // Once a process at error level (the dashboard reads the ledger every
                    // few seconds), then at debug.
                    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                    if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::debug!(key, %error, "audit row does not decode; left out");
                    } else {
                        tracing::error!(key, %error, "audit row does not decode; left out (zonewatch check --store names every such row)");
                    }
                    return Ok(true);
                }
            };
            // A row is read by its `seq` (cursors, `zonewatch audit`'s pages go on from it):
            // one stored under another key is damage, left out with an error log rather than
            // read (`check --store` names it).
            if row.seq != key {
                tracing::error!(key, seq = row.seq, "audit row stored under another key than its seq; left out");
                return Ok(true);
            }
            Ok(!filter.matches(&row) || visit(row))
        };
        if let Some(classes) = filter.outcomes.as_ref().and_then(|o| AuditClass::covering(o, filter.without_baseline_primes)) {
            let index = rtx.open_table(AUDIT_BY_OUTCOME)?;
            return walk_audit_classes(&index, &classes, from, before_seq, desc, |seq| match t.get(seq)? {
                Some(v) => offer(seq, v.value()),
                // Damage (`check --store` names it): the entry is passed over.
                None => {
                    tracing::error!(seq, "the outcome index names an audit row the ledger does not have; left out");
                    Ok(true)
                }
            });
        }
        let mut rows = match before_seq {
            Some(b) => t.range(from..b.max(from))?,
            None => t.range(from..)?,
        };
        loop {
            let item = if desc { rows.next_back() } else { rows.next() };
            let Some(item) = item else { return Ok(()) };
            let (k, v) = item?;
            if !offer(k.value(), v.value())? {
                return Ok(());
            }
        }
    }

    /// Audit rows matching `filter`, in ledger order.
    pub fn audit(&self, filter: &AuditFilter) -> Result<Vec<AuditRow>, StoreError> {
        let limit = filter.limit.unwrap_or(usize::MAX);
        let mut out = Vec::new();
        if limit > 0 {
            self.audit_walk(filter, false, None, |row| {
                out.push(row);
                out.len() < limit
            })?;
        }
        Ok(out)
    }

    pub fn holds(&self) -> Result<Vec<Hold>, StoreError> {
        holds_in(&self.db.begin_read()?)
    }

    /// The newest `limit` holds that `keep` accepts, oldest first: read back from the newest
    /// and no further than needed (the dashboard's latest resolved holds, however many a
    /// source held for days superseded).
    pub fn newest_holds(&self, keep: impl Fn(&Hold) -> bool, limit: usize) -> Result<Vec<Hold>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(HOLDS)?;
        let mut out = Vec::new();
        for item in t.iter()?.rev() {
            if out.len() >= limit {
                break;
            }
            let (k, v) = item?;
            out.extend(readable_hold(k.value(), v.value()).filter(|h| keep(h)));
        }
        out.reverse();
        Ok(out)
    }

    pub fn hold(&self, run_id: u64) -> Result<Option<Hold>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(HOLDS)?;
        match t.get(run_id)? {
            Some(v) => Ok(Some(decode_hold(v.value()).map_err(|m| codec_err("holds", m))?)),
            None => Ok(None),
        }
    }

    /// The record of run `run_id`, if there is one.
    pub fn run_record(&self, run_id: u64) -> Result<Option<RunRecord>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(RUNS)?;
        let v = t.get(run_id)?;
        v.map(|v| decode(v.value()).map_err(|m| codec_err("runs", m))).transpose()
    }

    /// Run records, newest first, optionally for one source.
    pub fn runs(&self, source_id: Option<&str>, limit: usize) -> Result<Vec<RunRecord>, StoreError> {
        self.runs_before(source_id, u64::MAX, limit)
    }

    /// [`Self::runs`] with run ids below `before` (a page after a cursor): reads back from
    /// there, never the runs above it.
    /// One source's runs are found through the per-source index, not by reading back through
    /// every other source's.
    pub fn runs_before(&self, source_id: Option<&str>, before: u64, limit: usize) -> Result<Vec<RunRecord>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(RUNS)?;
        let mut out = Vec::new();
        if let Some(source) = source_id {
            if limit > 0 {
                // A damaged entry (`check --store` names it) is passed over; the page is still
                // filled, so a short page means there is no more.
                super::history_index::walk_source_runs(&rtx.open_table(RUNS_BY_SOURCE)?, source, before, |run_id| {
                    match t.get(run_id)? {
                        Some(v) => {
                            let record: RunRecord = decode(v.value()).map_err(|m| codec_err("runs", m))?;
                            if record.source_id == source {
                                out.push(record);
                            } else {
                                tracing::error!(run_id, source, "the per-source run index names a run record of another source; left out");
                            }
                        }
                        None => tracing::error!(run_id, source, "the per-source run index names a run record that is not there; left out"),
                    }
                    Ok(out.len() < limit)
                })?;
            }
            return Ok(out);
        }
        for item in t.range(..before)?.rev() {
            if out.len() >= limit {
                break;
            }
            let (_, v) = item?;
            out.push(decode(v.value()).map_err(|m| codec_err("runs", m))?);
        }
        Ok(out)
    }

    /// The dead letters. One that cannot be decoded is left out with an error log naming it
    /// (`zonewatch check --store` lists it too): one damaged row must not stop an operator
    /// from listing and replaying every other.
    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(DEAD_LETTERS)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (k, v) = item?;
            match super::outbox_rows::decode_dead(v.value()) {
                Ok(d) => out.push(d),
                Err(why) => tracing::error!(dead_letter = k.value(), "dead letter {} cannot be read and is left out: {why}", k.value()),
            }
        }
        Ok(out)
    }

    /// Up to `limit` dead letters of `list` whose ids come after `after`, in id order. A dead
    /// letter's id is its outbox row's, given when its change was claimed, so one that dies
    /// after a page was read may have an id below that page's cursor (the README says to list
    /// from the start again to see every one). A row that cannot be decoded is left out with
    /// an error log, as in [`Store::dead_letters`].
    pub fn dead_letters_page(&self, list: DeadLetterList, after: Option<u64>, limit: usize) -> Result<Vec<DeadLetter>, StoreError> {
        let rtx = self.db.begin_read()?;
        let page = read_page(&rtx.open_table(list.table())?, after, limit, super::outbox_rows::decode_dead, list.noun())?;
        Ok(page.into_iter().map(|(_, d)| d).collect())
    }

    /// What a replay of the dead letters chooses from, one small [`ReplayPick`] a dead letter
    /// of the window (`dead_at` within `since..=until`; of `ids` only, when given), oldest
    /// observation first: a replay of every dead letter holds these, not the rows with their
    /// payloads (100,000 dead letters of a few KiB each would be hundreds of MiB).
    pub fn replay_picks(&self, ids: Option<&[u64]>, since_ms: u64, until_ms: u64) -> Result<Vec<ReplayPick>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(DEAD_LETTERS)?;
        let wanted: Option<std::collections::HashSet<u64>> = ids.map(|i| i.iter().copied().collect());
        let mut out = Vec::new();
        let keep = |v: &[u8], out: &mut Vec<ReplayPick>| match super::outbox_rows::decode_dead(v) {
            Ok(d) if d.dead_at_ms >= since_ms && d.dead_at_ms <= until_ms => out.push(ReplayPick::of(&d)),
            Ok(_) => {}
            Err(why) => tracing::error!("a dead letter cannot be read and is left out of the replay: {why}"),
        };
        match &wanted {
            // Named ids are point reads: naming three of a million reads three.
            Some(w) => {
                for id in w {
                    if let Some(v) = t.get(*id)? {
                        keep(v.value(), &mut out);
                    }
                }
            }
            None => {
                for item in t.iter()? {
                    let (_, v) = item?;
                    keep(v.value(), &mut out);
                }
            }
        }
        out.sort_by_key(|p| (p.observed_ms, p.id));
        Ok(out)
    }

    /// Up to `limit` of the change events hold `hold_id` keeps (an open hold's: resolving it
    /// clears them), after the event number `after`, in the order the run found them, each
    /// with its number (the next page's cursor). What an operator reads to decide between a
    /// release and a prime. An event that does not decode is left out with an error log.
    pub fn held_changes_page(&self, hold_id: u64, after: Option<u64>, limit: usize) -> Result<Vec<(u64, ChangeEvent)>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(HELD_EVENTS)?;
        let Some(start) = first_after(after) else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for item in t.range((hold_id, start)..=(hold_id, u64::MAX))? {
            if out.len() >= limit {
                break;
            }
            let (k, v) = item?;
            let n = k.value().1;
            match super::held_rows::decode_held_event(v.value()) {
                Ok(e) => out.push((n, e)),
                Err(why) => tracing::error!(hold = hold_id, event = n, "held event {n} of hold {hold_id} cannot be read and is left out: {why}"),
            }
        }
        Ok(out)
    }

    /// One dead letter, if `id` is one (not a quarantined one).
    pub fn dead_letter(&self, id: u64) -> Result<Option<DeadLetter>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(DEAD_LETTERS)?;
        match t.get(id)? {
            None => Ok(None),
            Some(v) => super::outbox_rows::decode_dead(v.value()).map(Some).map_err(|m| codec_err("dead_letters", m)),
        }
    }

    /// How many dead letters and quarantined features are kept (counted, not decoded).
    /// What waits for an operator: dead letters, dead letters parked past `max_replays`
    /// (`dlq_quarantine`: never sent again without `dlq release`), quarantined features.
    pub fn kept_counts(&self) -> Result<KeptCounts, StoreError> {
        let rtx = self.db.begin_read()?;
        Ok(KeptCounts {
            dead_letters: rtx.open_table(DEAD_LETTERS)?.len()?,
            parked_dead_letters: rtx.open_table(DLQ_QUARANTINE)?.len()?,
            quarantined_features: rtx.open_table(QUARANTINE)?.len()?,
        })
    }

    pub fn quarantine(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(QUARANTINE)?;
        let mut out = Vec::new();
        for item in t.iter()? {
            let (_, v) = item?;
            out.push(decode(v.value()).map_err(|m| codec_err("quarantine", m))?);
        }
        Ok(out)
    }

    pub fn outbox(&self) -> Result<Vec<OutboxEntry>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut out = Vec::new();
        for (table, name) in [(OUTBOX, "outbox"), (OUTBOX_RETRY, "outbox_retry")] {
            for item in rtx.open_table(table)?.iter()? {
                let (_, v) = item?;
                out.push(super::outbox_rows::decode_entry(v.value()).map_err(|m| codec_err(name, m))?);
            }
        }
        out.sort_by_key(|e| e.id);
        Ok(out)
    }

    /// Rows queued whose last send was deferred (`last_error` beginning with `prefix`): read
    /// one at a time from the retry queue, where a deferral puts them (`run`'s exit code;
    /// the whole outbox decoded at once held every payload in memory).
    pub fn deferred_rows(&self, prefix: &str) -> Result<u64, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut n = 0;
        for item in rtx.open_table(OUTBOX_RETRY)?.iter()? {
            let (_, v) = item?;
            let entry = super::outbox_rows::decode_entry(v.value()).map_err(|m| codec_err("outbox_retry", m))?;
            n += u64::from(entry.last_error.is_some_and(|e| e.starts_with(prefix)));
        }
        Ok(n)
    }

    /// Rows queued for delivery: fresh and waiting for a retry.
    pub fn outbox_len(&self) -> Result<u64, StoreError> {
        let rtx = self.db.begin_read()?;
        super::outbox::len(&rtx.open_table(OUTBOX)?, &rtx.open_table(OUTBOX_RETRY)?)
    }

    /// Totals over runs, the audit ledger, the outbox and holds: the runs and the ledger from
    /// their running totals (`totals.rs`), not by reading them.
    pub fn stats(&self) -> Result<StoreStats, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut s = StoreStats::default();
        for (_, t) in super::totals::read_run_totals(&rtx.open_table(RUN_TOTALS)?)? {
            s.runs += t.runs();
            s.changes += t.changes;
        }
        for (outcome, n) in super::totals::read_audit_totals(&rtx.open_table(AUDIT_TOTALS)?)? {
            match outcome {
                Outcome::Queued => s.queued = n,
                Outcome::Sent => s.sent = n,
                Outcome::Duplicate => s.duplicates = n,
                Outcome::Suppressed => s.suppressed = n,
                Outcome::DeadLetter => s.dead_letters = n,
                Outcome::Quarantined => s.quarantined = n,
                Outcome::Held => s.held = n,
                _ => {}
            }
        }
        s.outbox = super::outbox::len(&rtx.open_table(OUTBOX)?, &rtx.open_table(OUTBOX_RETRY)?)?;
        s.open_holds = rtx.open_table(OPEN_HOLDS)?.len()?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The newest holds of the states asked for, oldest first, as a filter of every hold
    /// would give them (the dashboard's latest resolved holds).
    #[test]
    fn the_newest_holds_are_those_of_every_hold_filtered() {
        use crate::model::{Hold, HoldState, Watermark};
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let wtx = store.db.begin_write().expect("write");
        {
            let mut t = wtx.open_table(HOLDS).expect("holds");
            for run_id in 1..=40u64 {
                let state = match run_id % 4 {
                    0 => HoldState::Open,
                    1 => HoldState::Superseded { at_ms: run_id, by_run: run_id + 1 },
                    2 => HoldState::Released { at_ms: run_id, run_id: run_id + 1 },
                    _ => HoldState::Primed { at_ms: run_id, run_id: run_id + 1 },
                };
                let hold = Hold {
                    run_id,
                    source_id: "s".into(),
                    lineage_id: String::new(),
                    created_ms: run_id,
                    reason: "change_spike".into(),
                    state,
                    digest: String::new(),
                    watermark: Watermark::default(),
                    changes: 1,
                    features: 1,
                    reprocess: false,
                };
                t.insert(run_id, super::super::watermark_rows::encode_hold(&hold).as_slice()).expect("insert");
            }
        }
        wtx.commit().expect("commit");
        let all = store.holds().expect("holds");
        for (states, limit) in [(vec!["open"], 3), (vec!["released", "superseded"], 7), (vec!["primed"], 100), (vec!["open", "primed", "released", "superseded"], 40)] {
            let keep = |h: &Hold| states.contains(&h.state.label());
            let filtered: Vec<&Hold> = all.iter().filter(|h| keep(h)).collect();
            let expected: Vec<u64> = filtered[filtered.len().saturating_sub(limit)..].iter().map(|h| h.run_id).collect();
            let got: Vec<u64> = store.newest_holds(keep, limit).expect("newest").iter().map(|h| h.run_id).collect();
            assert_eq!(got, expected, "{states:?} {limit}");
        }
    }

    /// A damaged audit row is left out of a read of the ledger, in both directions, and the
    /// rows around it are read (the read failed whole).
    #[test]
    fn a_damaged_audit_row_hides_only_itself() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("zw.redb")).expect("open");
        let wtx = store.db.begin_write().expect("write");
        {
            let mut audit = wtx.open_table(AUDIT).expect("audit");
            for seq in [1u64, 3] {
                audit.insert(seq, super::super::codec::encode(&sample_audit_row(seq, Outcome::Held)).as_slice()).expect("insert");
            }
            audit.insert(2u64, [0xFFu8, 1, 2].as_slice()).expect("insert");
        }
        wtx.commit().expect("commit");
        let seqs = |rows: Vec<AuditRow>| rows.into_iter().map(|r| r.seq).collect::<Vec<_>>();
        assert_eq!(seqs(store.audit(&AuditFilter::default()).expect("audit")), vec![1, 3]);
        let mut back = Vec::new();
        store.audit_walk(&AuditFilter::default(), true, None, |r| {
            back.push(r);
            true
        })
        .expect("walk");
        assert_eq!(seqs(back), vec![3, 1]);
    }
}
