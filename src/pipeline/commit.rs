//! A run's commit: the spill read back in chunks of `COMMIT_CHUNK` parcels on a second thread
//! (snapshot rows copied off it, events built and matched where it can) while the writer
//! writes the chunk before, then the removals (their events and tombstones), all in the one
//! `RunWriter` transaction that also records the watermark, the run, the claims and the
//! outbox and audit rows.

use crate::config::SourceConfig;
use crate::detect::diff::{step, Prior, RawChange};
use crate::detect::row_sort::RowSorter;
use crate::detect::spill::{SpillEntry, SpillError, SpilledParcel};
use crate::detect::stream::{ScanError, ScanResult};
use crate::model::*;
use crate::notify::matcher::PinnedIndex;
use crate::store::{Claim, CommitMode, QuarantineDraft, RunWriter, SnapshotRow};
use super::{Engine, PipelineError};
use std::collections::HashMap;

/// Parcels (and quarantine drafts) per chunk of a run's commit.
pub(crate) const COMMIT_CHUNK: usize = 4096;

/// What [`Engine::commit_scan`]'s preparing thread hands the writer: quarantine drafts and
/// parcel chunks in spill order, then the snapshot rows that were held back to be put in
/// key order.
enum Prepared {
    Quarantine(Vec<QuarantineDraft>),
    Parcels(PreparedChunk),
    Rows(Vec<SnapshotRow>),
}

/// A chunk of new and changed parcels made ready for the write transaction.
struct PreparedChunk {
    /// The decoded parcels (all of a held run's; otherwise those whose events are built),
    /// when the writer still needs them: to build their events (some needed a stored
    /// geometry) or to stage them (a held run). Empty otherwise: building the events moved
    /// their contents.
    parcels: Vec<SpilledParcel>,
    /// The snapshot rows of all the chunk's parcels when they are in key order: written
    /// with the chunk. `None` for a held run (it stages its parcels), and for a chunk out of
    /// key order: its rows go through a `RowSorter` and come last, sorted
    /// (`detect/row_sort.rs`), because redb inserts in key order several times faster.
    rows: Option<Vec<SnapshotRow>>,
    /// The decoded parcels' events and claims, built on the preparing thread when the run
    /// is not held and none of them needed a stored geometry (`None`: the writer builds them).
    events: Option<(Vec<ChangeEvent>, Vec<Claim>)>,
    /// Events of the chunk that were counted, not built: new parcels outside every
    /// subscriber's envelope, which match no one and so write nothing.
    unmatched: u64,
    /// The subscriber set that decided `unmatched`: the chunk's events are matched against
    /// it, also when the writer builds them, so one chunk never sees two sets.
    pinned: PinnedIndex,
}

/// A chunk being read off the spill by [`Engine::prepare_chunks`].
#[derive(Default)]
struct ChunkDraft {
    /// The parcels decoded: all of a held run's; otherwise those whose events are built.
    parcels: Vec<SpilledParcel>,
    /// Every parcel's id and where its record body ends in `bodies` (the bodies copied off
    /// the spill back to back), in spill order; none for a held run. The rows are made from
    /// them all at once as the chunk is sent: made one by one, they interleaved long-lived
    /// rows with the decoding's short-lived allocations, which cost the allocator dearly.
    rows: Vec<(String, usize)>,
    bodies: Vec<u8>,
    /// Events counted, not built ([`PreparedChunk::unmatched`]).
    unmatched: u64,
}

impl ChunkDraft {
    /// Parcels read into the chunk (duplicated ids left out): it is sent at [`COMMIT_CHUNK`].
    /// A held run decodes every parcel and keeps no rows; any other keeps a row for each.
    fn len(&self) -> usize {
        self.rows.len().max(self.parcels.len())
    }

    /// The snapshot rows read so far, made from their bodies (which are cleared).
    fn take_rows(&mut self) -> Vec<SnapshotRow> {
        let mut start = 0;
        let rows = self
            .rows
            .drain(..)
            .map(|(id, end)| {
                let row = SnapshotRow::from_body(id, &self.bodies[start..end]);
                start = end;
                row
            })
            .collect();
        self.bodies.clear();
        rows
    }
}

/// Why [`Engine::prepare_chunks`] stopped before the end.
enum PrepareStop {
    /// Reading, sorting or preparing failed: the writer is told.
    Failed(PipelineError),
    /// The writer hung up (it failed itself).
    WriterGone,
}

impl<E: Into<PipelineError>> From<E> for PrepareStop {
    fn from(e: E) -> PrepareStop {
        PrepareStop::Failed(e.into())
    }
}

/// What the writer is done with, sent back to the preparing thread to be freed there.
/// glibc frees another thread's allocation under that thread's arena lock: at a baseline's
/// rate, freeing the chunks on the writing thread took a quarter of its time. (A baseline's
/// chunk is all the preparing thread's; a chunk whose events the writer built is mixed.)
struct Spent {
    _rows: Option<Vec<SnapshotRow>>,
    _events: Vec<ChangeEvent>,
    _claims: Vec<Claim>,
}

impl Engine {
    /// Commits a scanned layer in one write transaction, fed in chunks: a second thread
    /// ([`Engine::prepare_chunks`]) reads the spill back, copies off it the snapshot rows,
    /// counts the events that cannot match anyone and builds and matches the others it can;
    /// this thread reads the stored geometries the other events need, updates the snapshot
    /// (or the hold's staging) and writes the claims, then the removals, then finishes.
    pub(super) fn commit_scan(
        &self,
        src: &SourceConfig,
        scan: ScanResult,
        mode: CommitMode,
        watermark: Watermark,
        started: u64,
        now: u64,
    ) -> Result<RunRecord, PipelineError> {
        let hold = matches!(mode, CommitMode::Hold { .. });
        let announce = mode.announces();
        let counts = RunCounts {
            features: scan.features,
            parcels: scan.parcels,
            quarantined: scan.quarantined,
            repaired: scan.repaired,
            ..Default::default()
        };
        let mut w = self.store.begin_run(&src.id, mode, watermark, now, self.config.delivery.idem_ttl.as_millis() as u64)?;
        w.quarantine(&scan.duplicate_drafts)?;
        // The spill is read back, and each chunk's rows copied off it and (unless held or a
        // stored geometry is needed) its events built and matched, on a second thread, while
        // this one writes the previous chunk: the write lock is held for the writing. Chunks
        // arrive in spill order through a channel of two; what this thread is done with goes
        // back through another, to be freed over there. The snapshot rows of chunks out of
        // key order come last, sorted: every stored geometry an event needs has been read by
        // then.
        let ScanResult { spill, duplicate_ids, removed, warnings, .. } = scan;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Prepared, PipelineError>>(2);
        let (spent_tx, spent_rx) = std::sync::mpsc::channel::<Spent>();
        std::thread::scope(|scope| -> Result<(), PipelineError> {
            // `tx` moves into the thread: the loop below ends when that thread drops it.
            scope.spawn(move || {
                // An error is the writer's to report; a writer that hung up has one of its own.
                if let Err(PrepareStop::Failed(e)) = self.prepare_chunks(src, spill, &duplicate_ids, hold, now, &tx, spent_rx) {
                    let _ = tx.send(Err(e));
                }
            });
            // `rx` is dropped when this closure returns, also on an error: the preparing
            // thread's next send fails and it stops. If that thread panics, the channel
            // closes early and this loop ends, but the scope re-raises the panic on leaving:
            // nothing after it (removals, the commit) runs, so no partial run is committed.
            for prepared in rx {
                match prepared? {
                    Prepared::Quarantine(drafts) => w.quarantine(&drafts)?,
                    Prepared::Parcels(chunk) => {
                        let spent = self.commit_upserts(&mut w, src, chunk, hold, now)?;
                        // Once the preparing thread has stopped, what is left is freed here.
                        let _ = spent_tx.send(spent);
                    }
                    Prepared::Rows(rows) => {
                        w.upserts_encoded(&rows)?;
                        let _ = spent_tx.send(Spent { _rows: Some(rows), _events: Vec::new(), _claims: Vec::new() });
                    }
                }
            }
            Ok(())
        })?;
        for chunk in removed.chunks(COMMIT_CHUNK) {
            let mut old_geoms = w.old_geometries(chunk.iter().map(|(id, _)| id.as_str()))?;
            let events: Vec<ChangeEvent> = chunk
                .iter()
                .map(|(id, prev)| {
                    let change = RawChange {
                        parcel_id: id.clone(),
                        kind: ChangeKind::Removed,
                        from: Some(prev.zoning.clone()),
                        to: None,
                        new_index: None,
                        revision: step(Prior::of(prev), ABSENT_CONTENT, announce).key_revision,
                    };
                    self.change_event(src, change, None, old_geoms.remove(id), prev.area_m2, prev.effective_date.clone(), now)
                })
                .collect();
            let claims = if hold { vec![] } else { self.claims_for(&events) };
            let ids: Vec<String> = chunk.iter().map(|(id, _)| id.clone()).collect();
            w.removals(&ids, true)?;
            w.events(&events, &claims)?;
        }
        Ok(w.finish(started, self.now(), counts, warnings)?)
    }

    /// The preparing side of [`Engine::commit_scan`]: reads the spill in order and sends
    /// quarantine drafts and parcel chunks, each chunk with its snapshot rows when they are
    /// in key order (unless held) and its events and claims when the run is not held and
    /// none of its parcels needs its stored geometry (a baseline's are all added). Unless
    /// the run is held, a new parcel whose envelope touches no subscriber's is not decoded
    /// and its event is only counted (it would match no one, and an event without a claim
    /// writes nothing); a snapshot-only update has no event. Gathers
    /// the rows of chunks out of key order in a `RowSorter` and sends them last, sorted.
    /// Frees what the writer sends back as spent. Stops at the first error (returned, for
    /// the caller to send on) or when the writer hangs up.
    #[allow(clippy::too_many_arguments)]
    fn prepare_chunks(
        &self,
        src: &SourceConfig,
        mut spill: crate::detect::spill::SpillReader,
        duplicate_ids: &std::collections::HashSet<String>,
        hold: bool,
        now: u64,
        tx: &std::sync::mpsc::SyncSender<Result<Prepared, PipelineError>>,
        spent: std::sync::mpsc::Receiver<Spent>,
    ) -> Result<(), PrepareStop> {
        let send = |out: Prepared| tx.send(Ok(out)).map_err(|_| PrepareStop::WriterGone);
        let mut chunk = ChunkDraft::default();
        let mut quarantine: Vec<QuarantineDraft> = Vec::new();
        let mut sorter = RowSorter::new(self.scratch_dir());
        // The subscriber set this chunk is matched against, from its first parcel on.
        let mut pinned = self.subscribers.pinned();
        // Sends the chunk read so far (its buffers kept for the next), matched against
        // `pinned`.
        let mut prepare = |chunk: &mut ChunkDraft, pinned: PinnedIndex| -> Result<Prepared, PipelineError> {
            spent.try_iter().for_each(drop);
            let parcels = std::mem::replace(&mut chunk.parcels, Vec::with_capacity(COMMIT_CHUNK));
            let unmatched = std::mem::take(&mut chunk.unmatched);
            let mut rows = None;
            if !hold {
                let encoded = chunk.take_rows();
                if encoded.windows(2).all(|w| w[0].id < w[1].id) {
                    rows = Some(encoded);
                } else {
                    sorter.push(encoded).map_err(ScanError::from)?;
                }
            }
            let needs_stored = parcels.iter().any(SpilledParcel::needs_stored_geometry);
            if needs_stored || hold {
                // The writer builds the events after reading the stored geometries, or
                // stages the parcels first (a held run, which matches nothing): it needs them.
                return Ok(Prepared::Parcels(PreparedChunk { parcels, rows, events: None, unmatched, pinned }));
            }
            let events = Some(self.chunk_events(src, parcels, &mut HashMap::new(), hold, now, &pinned));
            Ok(Prepared::Parcels(PreparedChunk { parcels: Vec::new(), rows, events, unmatched, pinned }))
        };
        while let Some(entry) = spill.next_entry().map_err(ScanError::from)? {
            match entry {
                SpillEntry::Quarantine(d) => {
                    quarantine.push(d);
                    if quarantine.len() >= COMMIT_CHUNK {
                        send(Prepared::Quarantine(std::mem::take(&mut quarantine)))?;
                    }
                }
                SpillEntry::Parcel(head) if duplicate_ids.contains(&head.id) => {}
                SpillEntry::Parcel(head) => {
                    if hold {
                        // A held run stages every parcel and keeps every event: all decoded.
                        let (state, geometry) = spill.decode_last_body().map_err(ScanError::from)?;
                        chunk.parcels.push(SpilledParcel::from_head(head, state, geometry));
                    } else {
                        // The row is the spilled state and geometry as they are.
                        let body = spill.last_parcel_body();
                        chunk.bodies.extend_from_slice(body);
                        // A new parcel outside every subscriber's envelope matches no one,
                        // and an event that matches no one writes nothing: it is counted,
                        // not built. A snapshot-only update has no event. Both bodies are
                        // walked (a damaged one fails the commit before it is stored); any
                        // other parcel is decoded, which checks its body.
                        let eventless = match head.kind {
                            None | Some(ChangeKind::Added) => {
                                let envelope = SnapshotRow::body_envelope(body).map_err(|e| ScanError::from(SpillError::Codec(e)))?;
                                head.kind.is_none() || !envelope.is_some_and(|e| pinned.may_touch(e))
                            }
                            Some(_) => false,
                        };
                        let end = chunk.bodies.len();
                        if eventless {
                            chunk.unmatched += u64::from(head.kind.is_some());
                            chunk.rows.push((head.id, end));
                        } else {
                            let (state, geometry) = spill.decode_last_body().map_err(ScanError::from)?;
                            chunk.rows.push((head.id.clone(), end));
                            chunk.parcels.push(SpilledParcel::from_head(head, state, geometry));
                        }
                    }
                    if chunk.len() >= COMMIT_CHUNK {
                        let next = self.subscribers.pinned();
                        send(prepare(&mut chunk, std::mem::replace(&mut pinned, next))?)?;
                    }
                }
            }
        }
        send(Prepared::Quarantine(quarantine))?;
        send(prepare(&mut chunk, pinned)?)?;
        let mut sorted = sorter.finish(COMMIT_CHUNK).map_err(ScanError::from)?;
        loop {
            spent.try_iter().for_each(drop);
            let rows = sorted.next_chunk().map_err(ScanError::from)?;
            if rows.is_empty() {
                return Ok(());
            }
            send(Prepared::Rows(rows))?;
        }
    }

    /// The change events of a chunk of new and changed parcels (in spill order; their
    /// contents move into the events) and the subscribers' claims on them (none for a held
    /// run). `stored` holds the stored geometry of each changed parcel (taken out as used).
    fn chunk_events(
        &self,
        src: &SourceConfig,
        chunk: Vec<SpilledParcel>,
        stored: &mut HashMap<String, StoredGeometry>,
        hold: bool,
        now: u64,
        index: &PinnedIndex,
    ) -> (Vec<ChangeEvent>, Vec<Claim>) {
        let mut events = Vec::with_capacity(chunk.len());
        for p in chunk {
            let Some(kind) = p.kind else { continue };
            let old_geometry = stored.remove(&p.id);
            let ParcelState { zoning, area_m2, effective_date, .. } = p.state;
            let change = RawChange { parcel_id: p.id, kind, from: p.from, to: Some(zoning), new_index: None, revision: p.key_revision };
            events.push(self.change_event(src, change, Some(p.geometry), old_geometry, area_m2, effective_date, now));
        }
        let claims = if hold { vec![] } else { self.claims_with(index, &events) };
        (events, claims)
    }

    /// One prepared chunk of new and changed parcels into the run's transaction: the stored
    /// geometries of changed parcels read (when the preparing thread could not build the
    /// events without them), the chunk's snapshot rows written if it has them (or a held
    /// run's parcels staged), the claims written. Returns what it is done with, to be freed
    /// on the preparing thread.
    fn commit_upserts(&self, w: &mut RunWriter<'_>, src: &SourceConfig, chunk: PreparedChunk, hold: bool, now: u64) -> Result<Spent, PipelineError> {
        let PreparedChunk { parcels, rows, events, unmatched, pinned } = chunk;
        w.unmatched_events(unmatched);
        let t = std::time::Instant::now();
        // The stored geometries are read before this chunk's upserts replace them (a parcel
        // is in one chunk only; rows held back for sorting are written after every chunk).
        let mut stored = match events {
            Some(_) => HashMap::new(),
            None => w.old_geometries(parcels.iter().filter(|p| p.needs_stored_geometry()).map(|p| p.id.as_str()))?,
        };
        let t_stored = t.elapsed();
        match &rows {
            Some(rows) => w.upserts_encoded(rows)?,
            None if hold => w.upserts(parcels.iter().map(SpilledParcel::borrowed))?,
            None => {}
        }
        let t_upsert = t.elapsed() - t_stored;
        let (events, claims) = match events {
            Some(built) => built,
            None => self.chunk_events(src, parcels, &mut stored, hold, now, &pinned),
        };
        let t_events = t.elapsed() - t_stored - t_upsert;
        w.events(&events, &claims)?;
        tracing::trace!(
            stored_us = t_stored.as_micros() as u64,
            upsert_us = t_upsert.as_micros() as u64,
            events_us = t_events.as_micros() as u64,
            claim_us = (t.elapsed() - t_stored - t_upsert - t_events).as_micros() as u64,
            claims = claims.len(),
            "chunk"
        );
        Ok(Spent { _rows: rows, _events: events, _claims: claims })
    }
}
