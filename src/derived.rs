//! Runs of district and overlay layers (`layer = "districts"` / `"overlays"`): zoning as most
//! cities publish it, polygons with a code and no stable id, joined to a parcel base.
//!
//! Ids and vertices of district polygons are not trusted at all. Each run re-derives, for every
//! parcel of the base source (`parcels = "<source id>"`), the code covering the largest share
//! of it (or, for overlays, the set of overlays covering at least `overlay_min_share` of it).
//! The derived states are stored as the district source's own parcel snapshot, so the existing
//! diff, gate, matching, severity, idempotency keys and the one-transaction commit apply
//! unchanged: a parcel whose winning code did not move produces nothing, whatever happened to
//! the polygons. Only code changes alert; a parcel that appears, disappears or changes shape in
//! the base updates the derived snapshot silently (the parcel source reports those itself).
//!
//! The read fingerprint of a derived run includes the base's watermark digest, so a re-published
//! parcel layer makes the next district run recompute instead of answering `identical`.
//!
//! A run never holds its base: the derive pass reads it a stretch of ids at a time, merged
//! with what the source has stored for the same ids, and keeps only the delta, on disk
//! (`detect::derived_delta`); the gate decides on the pass's counts; the commit streams the
//! delta into the run's one write transaction.

use crate::config::{LayerKind, SourceConfig};
use crate::detect::canonical::{content_hash, normalize_code};
use crate::detect::diff::{diff, RawChange, Steps};
use crate::detect::gate::{decide, GateInput};
use crate::detect::overlay::{Coverage, DistrictIndex};
use crate::ingest::districts::read_districts;
use crate::ingest::normalize::folded_field_warnings;
use crate::ingest::source;
use crate::model::*;
use crate::pipeline::{Engine, PipelineError, RunOptions, SourceReport};
use crate::detect::derived_delta::{DeltaFile, DeltaItem, DeltaReader};
use crate::pipeline::COMMIT_CHUNK;
use crate::store::{BaseStretch, Claim, CommitMode, QuarantineDraft, RunCommit, RunWriter, SnapshotRow};
use std::collections::HashSet;
use std::time::Instant;

/// Separator of overlay names in a derived overlay state (names never contain a newline).
const SET_SEP: char = '\n';

/// Derived zoning of every parcel of a base, ready to diff.
pub struct Derivation {
    pub parcels: Vec<Parcel>,
    /// Winning share per parcel (same order as `parcels`), for the record and for tests.
    pub shares: Vec<f64>,
    /// Parcels no district covers at all.
    pub uncovered: u64,
    /// Intersections a geometry algorithm could not compute.
    pub failed: u64,
    pub millis: u128,
}

/// Derives the zoning (`Districts`) or overlay set (`Overlays`) of every base parcel.
pub fn derive_all(
    layer: LayerKind,
    index: &DistrictIndex,
    base: Vec<(String, ParcelState, StoredGeometry)>,
    overlay_min_share: f64,
) -> Derivation {
    let t0 = Instant::now();
    let mut out = Derivation { parcels: Vec::with_capacity(base.len()), shares: Vec::with_capacity(base.len()), uncovered: 0, failed: 0, millis: 0 };
    let coverages = coverages(index, &base);
    for ((id, state, geometry), cov) in base.into_iter().zip(coverages) {
        out.failed += u64::from(cov.failed);
        let (code, share) = match layer {
            LayerKind::Overlays => {
                let mut names: Vec<(String, f64)> =
                    cov.shares.into_iter().filter(|(_, s)| *s >= overlay_min_share).collect();
                names.sort_by_cached_key(|n| normalize_code(&n.0));
                let share = names.iter().map(|n| n.1).fold(0.0, f64::max);
                (names.into_iter().map(|n| n.0).collect::<Vec<_>>().join(&SET_SEP.to_string()), share)
            }
            _ => cov.shares.into_iter().next().unwrap_or_default(),
        };
        if code.is_empty() {
            out.uncovered += 1;
        }
        let content = content_hash(&code, None, &state.geom_hash);
        out.parcels.push(Parcel {
            id,
            state: ParcelState {
                zoning: code,
                effective_date: None,
                content_hash: content,
                geom_hash: state.geom_hash,
                area_m2: state.area_m2,
                revision: 0,
                announced: None,
            },
            geometry,
        });
        out.shares.push(share);
    }
    out.millis = t0.elapsed().as_millis();
    out
}

/// Parcels per worker below which coverage is computed on the calling thread.
const MIN_PARCELS_PER_THREAD: usize = 256;

/// Every base parcel's coverage, in base order, computed on all cores (the parcels are
/// independent; the index is read-only). Same result as one thread, parcel by parcel.
fn coverages(index: &DistrictIndex, base: &[(String, ParcelState, StoredGeometry)]) -> Vec<Coverage> {
    let one = |chunk: &[(String, ParcelState, StoredGeometry)]| -> Vec<Coverage> {
        chunk.iter().map(|(_, _, g)| index.coverage(&g.to_geo())).collect()
    };
    let threads = crate::util::cores()
        .min(base.len() / MIN_PARCELS_PER_THREAD)
        .max(1);
    if threads == 1 {
        return one(base);
    }
    // Small interleaved chunks so that a slow stretch (a dense district boundary) is shared.
    let chunk = (base.len() / (threads * 16)).max(MIN_PARCELS_PER_THREAD);
    let chunks: Vec<&[(String, ParcelState, StoredGeometry)]> = base.chunks(chunk).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<Option<Vec<Coverage>>> = Vec::new();
    results.resize_with(chunks.len(), || None);
    let parts: Vec<Vec<(usize, Vec<Coverage>)>> = std::thread::scope(|scope| {
        let work = || {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = chunks.get(i) else { break };
                done.push((i, one(c)));
            }
            done
        };
        let handles: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mut parts = vec![work()];
        for h in handles {
            parts.push(h.join().unwrap_or_default());
        }
        parts
    });
    for (i, covs) in parts.into_iter().flatten() {
        if let Some(slot) = results.get_mut(i) {
            *slot = Some(covs);
        }
    }
    // A chunk is missing only if a worker panicked: compute it here.
    results.into_iter().enumerate().flat_map(|(i, r)| r.unwrap_or_else(|| one(chunks[i]))).collect()
}

fn overlay_set(s: &str) -> Vec<&str> {
    s.split(SET_SEP).filter(|n| !n.is_empty()).collect()
}

/// Whether a change of derived states alerts: a code change between two real codes
/// (districts), or overlays gained or lost (overlays). Only those are announced
/// (`detect::diff::step`); coverage gained or lost, parcels added or removed in the base, and
/// parcels reshaped there whose winning code stays, update the derived snapshot silently (a
/// reshape that moves the winning code alerts).
fn alerts(layer: LayerKind, c: &RawChange) -> bool {
    if c.kind != ChangeKind::Rezoned {
        return false;
    }
    let from = c.from.as_deref().unwrap_or("");
    let to = c.to.as_deref().unwrap_or("");
    match layer {
        LayerKind::Overlays => normalized_overlays(from) != normalized_overlays(to),
        _ => !from.is_empty() && !to.is_empty(),
    }
}

/// An overlay set's names, normalised (`normalize_code`): what tells two sets apart.
fn normalized_overlays(s: &str) -> HashSet<String> {
    overlay_set(s).iter().map(|n| normalize_code(n)).collect()
}

/// Whether a delivering run of a `layer` source announces change `c` (`detect::diff::step`):
/// a parcel layer every change, a derived layer only those that alert ([`alerts`]).
pub(crate) fn announces(layer: LayerKind, c: &RawChange) -> bool {
    match layer {
        LayerKind::Parcels => true,
        _ => alerts(layer, c),
    }
}

/// Turns the diff of derived states into the changes that alert (see [`alerts`]): a
/// district change as it is, an overlay change as one event per overlay gained or lost.
/// Also counts the code changes to or from no coverage, and the parcels that alert (what the
/// change-spike gate counts: a parcel gaining two overlays is one parcel changed, not two; a
/// black-box tester's overlay run read "8 of 4 parcels changed").
fn alerting_changes(layer: LayerKind, changes: Vec<RawChange>) -> AlertingChanges {
    let mut out = Vec::new();
    let (mut coverage_only, mut coverage_lost) = (0, 0);
    let mut parcels = 0;
    for c in changes {
        let before = out.len();
        if c.kind == ChangeKind::Rezoned && !alerts(layer, &c) && layer != LayerKind::Overlays {
            coverage_only += 1;
            coverage_lost += u64::from(c.to.as_deref().unwrap_or("").is_empty());
            continue;
        }
        push_alerting(layer, c, &mut out);
        parcels += u64::from(out.len() > before);
    }
    AlertingChanges { changes: out, coverage_only, coverage_lost, parcels }
}

/// What [`alerting_changes`] made of one run's diff.
struct AlertingChanges {
    changes: Vec<RawChange>,
    /// Code changes to or from no coverage (not alerted).
    coverage_only: u64,
    /// Of those, the parcels that lost their coverage.
    coverage_lost: u64,
    /// Parcels with at least one change that alerts.
    parcels: u64,
}

/// The alerting changes of one parcel's change `c`, pushed to `out`.
fn push_alerting(layer: LayerKind, c: RawChange, out: &mut Vec<RawChange>) {
    if c.kind != ChangeKind::Rezoned || !alerts(layer, &c) {
        return;
    }
    let from = c.from.as_deref().unwrap_or("");
    let to = c.to.as_deref().unwrap_or("");
    match layer {
        LayerKind::Overlays => {
            let old = overlay_set(from);
            let new = overlay_set(to);
            let (norm_old, norm_new) = (normalized_overlays(from), normalized_overlays(to));
            for n in &new {
                if !norm_old.contains(&normalize_code(n)) {
                    out.push(RawChange { kind: ChangeKind::OverlayAdded, from: None, to: Some(n.to_string()), ..c.clone() });
                }
            }
            for n in &old {
                if !norm_new.contains(&normalize_code(n)) {
                    out.push(RawChange { kind: ChangeKind::OverlayRemoved, from: Some(n.to_string()), to: None, ..c.clone() });
                }
            }
        }
        _ => out.push(c),
    }
}

impl Engine {
    /// `Err(Stopped)` once a stop is requested: a derived run asks between its steps (each
    /// stretch of the base, before its commit), as a parcel scan does at each read.
    fn stopped(&self) -> Result<(), PipelineError> {
        if self.stop.requested() {
            return Err(crate::ingest::IngestError::Stopped.into());
        }
        Ok(())
    }

    /// One run of a `districts` / `overlays` source (see the module doc).
    pub(crate) fn run_derived(&self, src: &SourceConfig, opts: RunOptions, started: u64) -> Result<SourceReport, PipelineError> {
        self.run_derived_in(src, opts, started, DERIVE_STRETCH)
    }

    /// [`Engine::run_derived`], reading the base `stretch` parcels at a time.
    fn run_derived_in(&self, src: &SourceConfig, opts: RunOptions, started: u64, stretch: usize) -> Result<SourceReport, PipelineError> {
        let Some(base_id) = src.parcels.clone() else {
            return self.run_area(src, opts, started);
        };
        let base_wm = self
            .store
            .watermark(&base_id)?
            .ok_or_else(|| PipelineError::BaseNotIngested { source_id: src.id.clone(), base: base_id.clone() })?;
        let fetched = source::fetch(src)?;
        let wm = self.store.watermark(&src.id)?;
        // A base read whose removals were withheld is another base than the same bytes read
        // whole, and than the same bytes read again with fewer withheld: the next run makes
        // those removals, and the derived zoning follows them (found by reviewers: a removed
        // parcel stayed in the derived snapshot). Such a base is known by its run.
        let withheld = if base_wm.withheld() { format!("{}@{}", Watermark::WITHHELD_MARK, base_wm.run_id) } else { String::new() };
        let fingerprint = format!(
            "{}:base={}:{}{withheld}:{}",
            src.read_fingerprint(),
            base_id,
            base_wm.digest.chars().take(16).collect::<String>(),
            base_wm.read_fingerprint
        );
        if !opts.reprocess {
            if let Some(report) = self.settled_by_digest(src, wm.as_ref(), None, &self.store.open_holds(Some(&src.id))?, &fetched.digest, &fingerprint, started)? {
                return Ok(report);
            }
        }

        let layer = read_districts(&fetched.bytes, &src.fields.zoning, src.bbox)?;
        let mut warnings = folded_field_warnings(&layer.folded_fields);
        let index = DistrictIndex::build(layer.districts.iter().map(|d| (d.code.as_str(), &d.geometry)));

        // The base, a stretch at a time, merged with what this source has stored (see
        // `Engine::derive_pass`); the delta goes to a file, the counts to the gate.
        let now = self.now();
        let pass_started = Instant::now();
        let announce = crate::pipeline::announces_changes(opts.reprocess, wm.as_ref(), &self.store.snapshot_view(&src.id)?)?;
        // Where a district could not be read, the parcels keep what they were derived before:
        // derived without it, they would take a neighbour's code and be alerted as rezoned
        // (found by a black-box tester, with one district's code past the length cap).
        let placeless = layer.placeless();
        let read = DistrictsRead { index: &index, kept: KeptPlaces::new(&layer.rejected_places()) };
        let DerivePass { delta, counts: pass } = self.derive_pass(src, &base_id, &read, stretch, announce, now)?;
        let pass_ms = pass_started.elapsed().as_millis() as u64;
        tracing::info!(source = %src.id, parcels = pass.parcels, polygons = index.len(), ms = pass.derive_ms as u64, "derived zoning");
        warnings.push(format!(
            "derived {} zoning for {} parcels of {base_id:?} from {} polygons in {} ms ({} uncovered)",
            src.layer.as_str(),
            pass.parcels,
            index.len(),
            pass.derive_ms,
            pass.uncovered
        ));
        if pass.failed > 0 {
            warnings.push(format!("{} parcel/district intersections could not be computed and counted as 0", pass.failed));
        }
        if pass.unreadable_shares > 0 {
            warnings.push(format!("{} stored shares could not be read (written again, or removed with their parcel)", pass.unreadable_shares));
        }
        if pass.kept > 0 {
            warnings.push(format!(
                "{} parcels keep their derived {} zoning: they lie where {} district feature(s) could not be read (quarantined)",
                pass.kept,
                src.layer.as_str(),
                layer.rejected.len() - placeless
            ));
        }
        if placeless > 0 {
            warnings.push(placeless_warning(placeless, "the parcels they covered were derived without them: a change there may be one of these features"));
        }
        if pass.coverage_only > 0 {
            warnings.push(format!("{} parcels gained or lost district coverage (not a rezoning; not alerted)", pass.coverage_only));
        }
        let systemic = layer.systemic_rejected();
        let quarantine = quarantine_drafts(layer.rejected);

        let decision = decide(GateInput {
            first_ingest: wm.is_none() && pass.previous == 0,
            reprocess: opts.reprocess,
            // A district layer's spike is measured against the parcels a district covered; an
            // overlay layer's (whose gains and losses alert) against every derived parcel.
            previous_parcels: if src.layer == LayerKind::Districts { pass.previous_covered } else { pass.previous },
            changed: pass.changed_parcels,
            silent: crate::detect::gate::Silent::Coverage(pass.coverage_lost),
            area: None,
            features: layer.features,
            unreadable_stored: 0,
            systemic_quarantined: systemic,
            max_change_ratio: src.max_change_ratio,
            restated: None,
        });
        let watermark = Watermark::for_read(&fetched.digest, fetched.bytes.len() as u64, now, wm.as_ref(), fingerprint);
        let (mode, hold_reason) = crate::pipeline::commit_mode(decision, opts.reprocess);
        let hold = matches!(mode, CommitMode::Hold { .. });
        let counts = RunCounts {
            features: layer.features,
            parcels: pass.parcels + pass.kept,
            quarantined: quarantine.len() as u64,
            repaired: layer.repaired,
            ..Default::default()
        };
        // The commit: one write transaction, fed from the delta file in chunks.
        self.stopped()?;
        let commit_started = Instant::now();
        let mut w = self.store.begin_run(&src.id, mode, watermark, now, self.config.delivery.idem_ttl.as_millis() as u64)?;
        w.quarantine(&quarantine)?;
        self.commit_delta(src, &mut w, delta, hold)?;
        let record = w.finish(started, self.now(), counts, warnings)?;
        tracing::debug!(source = %src.id, pass_ms, derive_ms = pass.derive_ms as u64, commit_ms = commit_started.elapsed().as_millis() as u64, "derived run timing");
        tracing::info!(source = %src.id, run = record.run_id, verdict = %record.verdict, changes = record.counts.changes, queued = record.counts.queued, "derived run committed");
        Ok(SourceReport { record, hold_reason })
    }

    /// The derive pass of a derived run: reads the base `base_id` `stretch` ids at a time,
    /// with what this source has stored for the same ids (one read snapshot, see
    /// [`crate::store::Store::for_each_base_stretch`]), derives each stretch's zoning, diffs it
    /// against those stored rows and writes to a delta file what the commit must do: new or
    /// changed derived parcels, removals, the events of changes that alert, and shares that
    /// moved. Memory is bounded by one stretch, whatever the size of the base.
    pub(crate) fn derive_pass(
        &self,
        src: &SourceConfig,
        base_id: &str,
        districts: &DistrictsRead<'_>,
        stretch: usize,
        announce: bool,
        now: u64,
    ) -> Result<DerivePass, PipelineError> {
        let mut file = DeltaFile::create(self.scratch_dir())?;
        let mut pass = DeriveCounts::default();
        // Where a derived parcel removed and derived again goes on from (its tombstone).
        let view = self.store.snapshot_view(&src.id)?;
        pass.previous = self.store.for_each_base_stretch(base_id, &src.id, stretch, |s: BaseStretch| -> Result<(), PipelineError> {
            // A stop is heard between stretches (a county's stretch takes about 0.1 s).
            self.stopped()?;
            let BaseStretch { mut parcels, mut parcel_shares, derived, orphan_shares, unreadable_shares } = s;
            pass.unreadable_shares += unreadable_shares;
            pass.previous_covered += derived.values().filter(|s| !s.zoning.is_empty()).count() as u64;
            let kept = districts.kept.take_from(&mut parcels, &mut parcel_shares);
            pass.kept += kept.len() as u64;
            let d = derive_all(src.layer, districts.index, parcels, src.overlay_min_share);
            pass.parcels += d.parcels.len() as u64;
            pass.uncovered += d.uncovered;
            pass.failed += d.failed;
            pass.derive_ms += d.millis;
            // `derive_all` keeps the base's order, one derived parcel per base parcel.
            if d.parcels.len() != parcel_shares.len() {
                return Err(PipelineError::Derived(
                    src.id.clone(),
                    format!("derived {} parcels from a stretch of {}", d.parcels.len(), parcel_shares.len()),
                ));
            }
            for ((p, share), stored) in d.parcels.iter().zip(&d.shares).zip(&parcel_shares) {
                // The same computation gives the same bits: only a share that moved is written.
                if stored.map(f64::to_bits) != Some(share.to_bits()) {
                    file.share(&p.id, *share)?;
                }
            }
            // A share with neither a derived row nor a parcel derived now: a removal takes it.
            for id in &orphan_shares {
                file.removal(id)?;
            }
            let announces = |c: &RawChange| announce && alerts(src.layer, c);
            let buried = |id: &str| view.prior_of_absent(id);
            let diffed = diff(&derived, d.parcels, &kept, &Steps { announces: &announces, buried: &buried })?;
            let AlertingChanges { changes, coverage_only, coverage_lost, parcels } = alerting_changes(src.layer, diffed.changes);
            pass.coverage_only += coverage_only;
            pass.coverage_lost += coverage_lost;
            pass.changed_parcels += parcels;
            let events = self.build_events(src, &changes, &diffed.upserts, &derived, now)?;
            for p in &diffed.upserts {
                file.upsert(p.borrowed())?;
            }
            for id in &diffed.removals {
                file.removal(id)?;
            }
            for e in &events {
                file.event(e)?;
            }
            Ok(())
        })?;
        Ok(DerivePass { delta: file.finish()?, counts: pass })
    }

    /// Streams a derived run's delta file into its run writer, chunk by chunk (a file that
    /// gives back fewer records than were written is an error of the reader). A second
    /// thread reads the file and matches each chunk's events while this one writes the chunk
    /// before (the write lock is held for the writing); what this thread is done with goes
    /// back to be freed over there, where it was allocated. An error on either side stops
    /// both.
    fn commit_delta(&self, src: &SourceConfig, w: &mut RunWriter<'_>, mut delta: DeltaReader, hold: bool) -> Result<(), PipelineError> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(DeltaBatch, Vec<Claim>), PipelineError>>(2);
        let (spent_tx, spent_rx) = std::sync::mpsc::channel::<DeltaBatch>();
        std::thread::scope(|scope| -> Result<(), PipelineError> {
            let reader = scope.spawn(move || {
                let send = |batch: DeltaBatch| -> bool {
                    let claims = if hold { vec![] } else { self.claims_for(&batch.events) };
                    tx.send(Ok((batch, claims))).is_ok()
                };
                let mut batch = DeltaBatch::default();
                loop {
                    match delta.next_item() {
                        Ok(Some(item)) => {
                            batch.push(item);
                            if batch.len() >= COMMIT_CHUNK && !send(std::mem::take(&mut batch)) {
                                break;
                            }
                            while let Ok(spent) = spent_rx.try_recv() {
                                drop(spent);
                            }
                        }
                        Ok(None) => {
                            send(batch);
                            break;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e.into()));
                            break;
                        }
                    }
                }
            });
            // Ends when the reader hangs up; an error returns at once (dropping `rx`, so the
            // reader's next send fails and it stops).
            for msg in rx {
                let (batch, claims) = msg?;
                self.write_batch(&src.id, w, &batch, &claims, hold)?;
                let _ = spent_tx.send(batch);
            }
            // (Had this thread failed first, the scope would re-raise the reader's panic
            // instead, as a parcel run's commit does.)
            reader.join().map_err(|panic| {
                let why = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
                PipelineError::Derived(src.id.clone(), format!("the thread reading the derived delta failed: {}", why.unwrap_or_default()))
            })
        })
    }

    /// Writes one chunk of a derived run's delta, and the claims on its events (none when
    /// held).
    fn write_batch(&self, source_id: &str, w: &mut RunWriter<'_>, batch: &DeltaBatch, claims: &[Claim], hold: bool) -> Result<(), PipelineError> {
        if hold {
            // A hold stages parcels, not snapshot rows.
            let mut parcels = Vec::with_capacity(batch.upserts.len());
            for row in &batch.upserts {
                let (state, geometry) = SnapshotRow::decode_body(row.record.get(1..).unwrap_or_default())
                    .map_err(|m| PipelineError::Derived(source_id.to_string(), format!("derived delta row {}: {m}", row.id)))?;
                parcels.push(Parcel { id: row.id.clone(), state, geometry });
            }
            w.upserts(parcels.iter().map(Parcel::borrowed))?;
        } else {
            w.upserts_encoded(&batch.upserts)?;
        }
        // Derived parcels come and go silently: their tombstones are unannounced.
        w.removals(&batch.removals, false)?;
        w.events(&batch.events, claims)?;
        w.shares(&batch.shares)?;
        Ok(())
    }
}

/// Parcel ids a derived run reads, derives and diffs at a time (base parcels with their
/// coverages and derived states, and the stored rows of the same ids): what it holds in
/// memory, whatever the size of the base and however its ids are spread.
const DERIVE_STRETCH: usize = 32_768;

/// What a derived run's derive pass found: its delta, on disk, and the counts the gate and
/// the run record need.
pub(crate) struct DerivePass {
    pub delta: DeltaReader,
    pub counts: DeriveCounts,
}

/// The counts of a derived run's derive pass.
#[derive(Default, Debug, Clone, Copy)]
pub(crate) struct DeriveCounts {
    /// Derived parcels (base parcels with a geometry).
    pub parcels: u64,
    /// Derived parcels stored before this run.
    pub previous: u64,
    /// Of those, the ones a district covered (a code, or an overlay, to lose): what the
    /// change spike of a district layer is measured against.
    pub previous_covered: u64,
    pub uncovered: u64,
    pub failed: u64,
    /// Parcels that gained or lost coverage only (not alerted).
    pub coverage_only: u64,
    /// Of those, the parcels that lost it (what the change spike counts: a district layer
    /// that newly covers annexed land is not a broken export).
    pub coverage_lost: u64,
    /// Parcels with a change that alerts (what the change-spike gate counts).
    pub changed_parcels: u64,
    /// Stored shares that could not be decoded (written again).
    pub unreadable_shares: u64,
    /// Base parcels left as stored: they lie where a district feature could not be read.
    pub kept: u64,
    /// Time spent deriving (coverages and states), over every stretch.
    pub derive_ms: u128,
}

/// What a derived run read of its district layer, for its derive pass.
pub(crate) struct DistrictsRead<'a> {
    pub(crate) index: &'a DistrictIndex,
    /// Where features could not be read.
    kept: KeptPlaces,
}

/// The quarantine rows of a district layer's features that could not be read (no parcel id:
/// districts have none).
fn quarantine_drafts(rejected: Vec<crate::ingest::districts::RejectedDistrict>) -> Vec<QuarantineDraft> {
    rejected.into_iter().map(|r| QuarantineDraft { feature_index: r.feature_index, parcel_id: None, reason: r.reason, detail: r.detail, raw: r.raw }).collect()
}

/// The run warning for district features quarantined with no position that can be read (a
/// null geometry, text that is not JSON): nothing can be kept for them.
fn placeless_warning(n: usize, what: &str) -> String {
    format!("{n} district feature(s) could not be read and have no readable position (see the quarantine): {what}")
}

/// The places of the district features a derived run could not read (a rectangle per
/// polygon, `ingest::districts::places_of`): the base parcels that meet one keep their stored
/// derived state and share (the diff leaves them, as a parcel layer's diff leaves a
/// quarantined parcel). A feature with no readable position says nowhere, keeps nothing, and
/// is named in a run warning.
struct KeptPlaces(Option<rstar::RTree<rstar::primitives::Rectangle<[f64; 2]>>>);

impl KeptPlaces {
    fn new(footprints: &[Envelope]) -> KeptPlaces {
        let rects = footprints.iter().map(|(lo, hi)| rstar::primitives::Rectangle::from_corners(*lo, *hi)).collect::<Vec<_>>();
        KeptPlaces((!rects.is_empty()).then(|| rstar::RTree::bulk_load(rects)))
    }

    /// Takes out of a stretch the parcels (and their stored shares, in step) whose exterior
    /// envelope meets a footprint; returns their ids.
    fn take_from(&self, parcels: &mut Vec<(String, ParcelState, StoredGeometry)>, shares: &mut Vec<Option<f64>>) -> HashSet<String> {
        let mut kept = HashSet::new();
        let Some(tree) = &self.0 else { return kept };
        let (mut left, mut left_shares) = (Vec::with_capacity(parcels.len()), Vec::with_capacity(shares.len()));
        for (parcel, share) in parcels.drain(..).zip(shares.drain(..)) {
            let meets = parcel.2.exterior_envelope().is_some_and(|(lo, hi)| tree.locate_in_envelope_intersecting(rstar::AABB::from_corners(lo, hi)).next().is_some());
            if meets {
                kept.insert(parcel.0);
            } else {
                left.push(parcel);
                left_shares.push(share);
            }
        }
        (*parcels, *shares) = (left, left_shares);
        kept
    }
}

/// One chunk of a derived delta on its way to the run's writer.
#[derive(Default)]
struct DeltaBatch {
    upserts: Vec<SnapshotRow>,
    removals: Vec<String>,
    events: Vec<ChangeEvent>,
    shares: Vec<(String, f64)>,
}

impl DeltaBatch {
    fn push(&mut self, item: DeltaItem) {
        match item {
            DeltaItem::Upsert(row) => self.upserts.push(row),
            DeltaItem::Removal(id) => self.removals.push(id),
            DeltaItem::Event(e) => self.events.push(e),
            DeltaItem::Share(id, share) => self.shares.push((id, share)),
        }
    }

    fn len(&self) -> usize {
        self.upserts.len() + self.removals.len() + self.events.len() + self.shares.len()
    }
}

impl Engine {
    /// Area mode: a `districts` source without a parcel base. The source's snapshot holds the
    /// district polygons themselves (key = feature position, which is not trusted to mean
    /// anything across versions); the change is computed geometrically by
    /// [`crate::detect::area::area_diff`].
    fn run_area(&self, src: &SourceConfig, opts: RunOptions, started: u64) -> Result<SourceReport, PipelineError> {
        use crate::detect::area::{area_diff, kept_coverage};
        use crate::detect::canonical::geometry_hash;
        use geo::GeodesicArea;
        let fetched = source::fetch(src)?;
        let wm = self.store.watermark(&src.id)?;
        let fingerprint = src.read_fingerprint();
        if !opts.reprocess {
            if let Some(report) = self.settled_by_digest(src, wm.as_ref(), None, &self.store.open_holds(Some(&src.id))?, &fetched.digest, &fingerprint, started)? {
                return Ok(report);
            }
        }
        let layer = read_districts(&fetched.bytes, &src.fields.zoning, src.bbox)?;
        let mut warnings = folded_field_warnings(&layer.folded_fields);
        let old_states = self.store.snapshot_states(&src.id)?;
        let mut old_ids: Vec<&String> = old_states.keys().collect();
        old_ids.sort();
        let old_geoms = self.store.parcel_geometries(&src.id, old_ids.iter().map(|s| s.as_str()))?;
        let old: Vec<(String, geo::MultiPolygon<f64>)> = old_ids
            .iter()
            .filter_map(|id| Some((old_states.get(id.as_str())?.zoning.clone(), old_geoms.get(id.as_str())?.to_geo())))
            .collect();
        let mut new: Vec<(String, geo::MultiPolygon<f64>)> = layer.districts.iter().map(|d| (d.code.clone(), d.geometry.clone())).collect();
        let first_ingest = wm.is_none() && old_states.is_empty();
        let t0 = Instant::now();
        // The ground under a district feature that could not be read keeps its stored zoning
        // (compared and stored as the old version had it), rather than read as having lost
        // its zone: `detect::area::KeptCoverage`.
        let placeless = layer.placeless();
        let kept = if first_ingest { Default::default() } else { kept_coverage(&old, &new, &layer.rejected_places()) };
        if placeless > 0 && !first_ingest {
            warnings.push(placeless_warning(placeless, "where they lay reads as having lost its zone: an area_rezoned to no zone there may be one of these features"));
        }
        if !kept.pieces.is_empty() || kept.skipped > 0 {
            warnings.push(format!(
                "{} district features could not be read: {} pieces of the stored districts within their bounding boxes keep their zoning{}",
                layer.rejected.len() - placeless,
                kept.pieces.len(),
                if kept.skipped > 0 {
                    format!(" ({} stored districts there could not be cut to them: their overlays failed or would cost too much, and nothing of them is kept)", kept.skipped)
                } else {
                    String::new()
                }
            ));
        }
        new.extend(kept.pieces.iter().cloned());
        let diff = if first_ingest { Default::default() } else { area_diff(&old, &new, src.min_change_area_m2, src.tolerance_m) };
        warnings.push(format!(
            "area mode: {} regions alert, {} dropped as noise (< {} m² or thinner than {} m), {} ms",
            diff.regions.len(),
            diff.noise,
            src.min_change_area_m2,
            src.tolerance_m,
            t0.elapsed().as_millis()
        ));
        if diff.failed > 0 {
            warnings.push(format!("{} overlay operations failed and were skipped", diff.failed));
        }
        if diff.too_tangled > 0 {
            let n = diff.too_tangled;
            tracing::warn!(source = %src.id, n, "area mode: district pieces too tangled with the other version to compare in bounded time");
            warnings.push(format!(
                "{n} district pieces or regions cross the other version's boundaries too often (more than about 300,000 crossings), or are too large, to compare in bounded time and were skipped: a change there is not alerted, now or by a later run"
            ));
        }
        let now = self.now();
        let events: Vec<ChangeEvent> = diff
            .regions
            .iter()
            .map(|r| {
                let opt = |c: &str| if c.is_empty() { None } else { Some(c.to_string()) };
                ChangeEvent {
                    source_id: src.id.clone(),
                    jurisdiction: src.jurisdiction.clone(),
                    parcel_id: format!("area:{}", r.id),
                    kind: ChangeKind::AreaRezoned,
                    from: opt(&r.from),
                    to: opt(&r.to),
                    effective_date: None,
                    old_geometry: None,
                    new_geometry: Some(StoredGeometry::from_geo(&r.geometry)),
                    area_m2: r.area_m2,
                    observed_at_ms: now,
                    severity: crate::detect::severity::rank(ChangeKind::AreaRezoned, Some(&r.from), Some(&r.to), r.area_m2, &src.severity),
                    revision: 0,
                }
            })
            .collect();
        // The new snapshot: the district polygons, keyed by position, and the kept pieces
        // (`k` and their position among them: never an `f` id).
        let row = |id: String, code: &str, geometry: &geo::MultiPolygon<f64>| {
            let gh = geometry_hash(geometry);
            Parcel {
                id,
                state: ParcelState {
                    zoning: code.to_string(),
                    effective_date: None,
                    content_hash: content_hash(code, None, &gh),
                    geom_hash: gh,
                    area_m2: geometry.geodesic_area_unsigned(),
                    revision: 0,
                    announced: None,
                },
                geometry: StoredGeometry::from_geo(geometry),
            }
        };
        let upserts: Vec<Parcel> = layer
            .districts
            .iter()
            .map(|d| row(format!("f{:07}", d.feature_index), &d.code, &d.geometry))
            .chain(kept.pieces.iter().enumerate().map(|(i, (code, geometry))| row(format!("k{i:07}"), code, geometry)))
            .collect();
        let keep: HashSet<&str> = upserts.iter().map(|p| p.id.as_str()).collect();
        let removals: Vec<String> = old_ids.iter().filter(|id| !keep.contains(id.as_str())).map(|s| (*s).clone()).collect();
        let systemic = layer.systemic_rejected();
        let quarantine = quarantine_drafts(layer.rejected);
        let decision = decide(GateInput {
            first_ingest,
            reprocess: opts.reprocess,
            previous_parcels: old_states.len() as u64,
            // Every changed place, a place that gained or lost zoning too (only `info`, so
            // alerted to few), by its area against the layer's: a district export half
            // missing, or with its coordinates swapped, changes most of it (a black-box
            // tester: 522 changes on a 289-feature layer went out to every `info` subscriber,
            // not held), while a layer dissolved to a few features a code is not held for two
            // small changes, as a count of places would (a reviewer).
            changed: events.len() as u64,
            silent: crate::detect::gate::Silent::None,
            area: Some((events.iter().map(|e| e.area_m2).sum(), old_states.values().map(|s| s.area_m2).sum())),
            features: layer.features,
            unreadable_stored: 0,
            systemic_quarantined: systemic,
            max_change_ratio: src.max_change_ratio,
            restated: None,
        });
        let watermark = Watermark::for_read(&fetched.digest, fetched.bytes.len() as u64, now, wm.as_ref(), fingerprint);
        let (mode, hold_reason) = crate::pipeline::commit_mode(decision, opts.reprocess);
        self.stopped()?;
        let (events, places) = step_places(events, &diff.regions, self.store.area_places(&src.id)?, mode.announces(), now);
        let claims = if matches!(mode, CommitMode::Hold { .. }) { vec![] } else { self.claims_for(&events) };
        let counts = RunCounts {
            features: layer.features,
            parcels: upserts.len() as u64,
            quarantined: quarantine.len() as u64,
            repaired: layer.repaired,
            changes: events.len() as u64,
            ..Default::default()
        };
        let record = self.store.commit_run(RunCommit {
            source_id: src.id.clone(),
            started_ms: started,
            now_ms: now,
            mode,
            watermark,
            upserts,
            removals,
            events,
            claims,
            places,
            quarantine,
            counts,
            warnings,
            idem_ttl_ms: self.config.delivery.idem_ttl.as_millis() as u64,
        })?;
        Ok(SourceReport { record, hold_reason })
    }
}

/// Gives each area-mode event (one per region, in the order of `regions`) the key revision of
/// its place's step (`detect::diff::step`, from what the place last announced: `stored`), and
/// returns the places the run moves, at `now_ms`: every place it steps (an unannounced step
/// moves the revision on and keeps the announcement). A place is the region's
/// snapped shape whatever its codes, so A → B, back to A and to B again are three keys, while a
/// return to what was announced after a silent detour (a primed hold, a reprocess) has the
/// announced change's key: a duplicate, not a second alert. Every other stored place that an
/// announced region overlaps forgets its announcement (`store::area_places`): what was said
/// about its ground since is another place's.
fn step_places(
    mut events: Vec<ChangeEvent>,
    regions: &[crate::detect::area::Region],
    mut stored: std::collections::HashMap<String, crate::store::PlaceState>,
    announce: bool,
    now_ms: u64,
) -> (Vec<ChangeEvent>, Vec<(String, crate::store::PlaceState)>) {
    use crate::detect::diff::{step, Prior};
    use geo::BoundingRect;
    let mut moved = std::collections::BTreeSet::new();
    let mut extents = Vec::new();
    for (event, region) in events.iter_mut().zip(regions) {
        let prior = stored.get(&region.place).map(|p| Prior { revision: p.revision, announced: p.announced }).unwrap_or_default();
        let taken = step(prior, crate::detect::area::place_content(&region.to), announce);
        event.revision = taken.key_revision;
        // (A region always has an extent; one without would overlap nothing.)
        let extent = region.geometry.bounding_rect().map(|r| [r.min().x, r.min().y, r.max().x, r.max().y]);
        // Two regions of one run on the same place step one after the other. An unannounced
        // step is kept too: it moves the revision on (its key is primed), not the announcement.
        stored.insert(
            region.place.clone(),
            crate::store::PlaceState { revision: taken.revision, announced: taken.announced, changed_ms: now_ms, extent: extent.unwrap_or([f64::NAN; 4]) },
        );
        moved.insert(region.place.clone());
        if announce {
            extents.extend(extent);
        }
    }
    // The places this run did not step, under any region it announced: their announcement is
    // stale. (A region of this run is not judged against another of it: a diff's regions do
    // not overlap, bar layers that overlap themselves.)
    if !extents.is_empty() {
        let overlaps = |a: &[f64; 4], b: &[f64; 4]| a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
        for (place, state) in stored.iter_mut() {
            if state.announced.is_some() && !moved.contains(place) && extents.iter().any(|e| overlaps(e, &state.extent)) {
                state.announced = None;
                state.changed_ms = now_ms;
                moved.insert(place.clone());
            }
        }
    }
    let places = moved.into_iter().filter_map(|place| stored.get(&place).map(|s| (place, *s))).collect();
    (events, places)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::synth::{write_feature, CountyIter, CountySpec, SynthParcel};
    use geo::{MultiPolygon, Polygon, Rect};
    use std::collections::HashMap;
    use std::path::Path;

    const SPEC: CountySpec = CountySpec { seed: 11, parcels: 600, origin: [-93.30, 44.95], blocks_per_row: 6 };
    const CUTS: [f64; 4] = [-0.5, 0.37, 0.71, 1.5];

    /// The places of `step_places` carried from run to run as the store would keep them,
    /// and each run's key revisions. Reviewer's case: D0 and D1 side
    /// by side go R-1 → C-2 one at a time, then back to R-1 together as one region (another
    /// place, overlapping both), then D0 → C-2 again: news, not the first change's key.
    #[test]
    fn an_announced_region_makes_the_places_it_overlaps_forget_what_they_were_told() {
        use crate::detect::area::Region;
        use crate::model::{ChangeKind, Severity};
        let region = |place: &str, from: &str, to: &str, x0: f64, x1: f64| Region {
            from: from.into(),
            to: to.into(),
            geometry: MultiPolygon(vec![Polygon::from(Rect::new((x0, 42.0), (x1, 42.01)))]),
            area_m2: 1.0,
            id: format!("{place}:{from}:{to}"),
            place: place.into(),
        };
        let event = || ChangeEvent {
            source_id: "a".into(),
            jurisdiction: "j".into(),
            parcel_id: String::new(),
            kind: ChangeKind::AreaRezoned,
            from: None,
            to: None,
            effective_date: None,
            old_geometry: None,
            new_geometry: None,
            area_m2: 1.0,
            observed_at_ms: 0,
            severity: Severity::Notice,
            revision: 0,
        };
        let mut stored = HashMap::new();
        let run = |stored: &mut HashMap<String, crate::store::PlaceState>, regions: Vec<Region>, announce: bool| {
            let (events, moved) = step_places(regions.iter().map(|_| event()).collect(), &regions, stored.clone(), announce, 5);
            stored.extend(moved);
            events.iter().map(|e| e.revision).collect::<Vec<u32>>()
        };
        assert_eq!(run(&mut stored, vec![region("d0", "R-1", "C-2", 0.0, 0.01)], true), vec![0]);
        assert_eq!(run(&mut stored, vec![region("d1", "R-1", "C-2", 0.01, 0.02)], true), vec![0]);
        assert!(stored["d0"].announced.is_some(), "a neighbour that only touches it leaves it as it was");
        assert_eq!(run(&mut stored, vec![region("d01", "C-2", "R-1", 0.0, 0.02)], true), vec![0]);
        assert!(stored["d0"].announced.is_none() && stored["d1"].announced.is_none());
        assert_eq!(run(&mut stored, vec![region("d0", "R-1", "C-2", 0.0, 0.01)], true), vec![1], "not the first change's key");
        // A silent detour and back on the same place is still the announced change's key.
        assert_eq!(run(&mut stored, vec![region("d0", "C-2", "R-1", 0.0, 0.01)], false), vec![2]);
        assert_eq!(run(&mut stored, vec![region("d0", "R-1", "C-2", 0.0, 0.01)], true), vec![1]);
    }

    fn write_parcels(path: &Path, lots: &[SynthParcel]) {
        let mut out = String::from("{\"type\":\"FeatureCollection\",\"features\":[");
        for (i, lot) in lots.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_feature(&mut out, lot, "2026-01-01", None);
        }
        out.push_str("]}");
        std::fs::write(path, out).unwrap();
    }

    /// A 3 × 3 grid of rectangular districts over the county, cut at `cuts` (fractions of its
    /// extent; boundaries cut through lots, so many parcels are split), coded by `code(cell)`.
    fn write_districts(path: &Path, cuts: [f64; 4], code: impl Fn(usize) -> String) {
        write_districts_over(&SPEC, path, cuts, code)
    }

    fn write_districts_over(spec: &CountySpec, path: &Path, cuts: [f64; 4], code: impl Fn(usize) -> String) {
        let (sw, ne) = CountyIter::extent(spec);
        // Cut at uneven fractions, so that the cuts do not fall on streets; the outer cells
        // reach past the county so that every lot is covered.
        let mut features = Vec::new();
        for cell in 0..9 {
            let (i, j) = (cell % 3, cell / 3);
            let x = |f: f64| sw[0] + f * (ne[0] - sw[0]);
            let y = |f: f64| sw[1] + f * (ne[1] - sw[1]);
            let rect = Rect::new((x(cuts[i]), y(cuts[j])), (x(cuts[i + 1]), y(cuts[j + 1])));
            let mp = MultiPolygon(vec![Polygon::from(rect)]);
            features.push(serde_json::json!({"type": "Feature", "properties": {"zoning": code(cell)}, "geometry": geojson::Geometry::from(&mp)}));
        }
        std::fs::write(path, serde_json::json!({"type": "FeatureCollection", "features": features}).to_string()).unwrap();
    }

    /// An engine with a parcel source `base`, a district source `zoning` on it and a
    /// subscriber whose AOI covers the whole county (every alerting change is queued once).
    fn engine(dir: &Path) -> Engine {
        let (sw, ne) = CountyIter::extent(&SPEC);
        let aoi = MultiPolygon(vec![Polygon::from(Rect::new((sw[0] - 0.1, sw[1] - 0.1), (ne[0] + 0.1, ne[1] + 0.1)))]);
        std::fs::write(dir.join("aoi.geojson"), geojson::Geometry::from(&aoi).to_string()).unwrap();
        let toml = r#"
[store]
path = "zw.redb"
[[source]]
id = "base"
jurisdiction = "testville"
kind = "file"
path = "parcels.geojson"
[source.fields]
parcel_id = "APN"
zoning = "ZONE_CODE"
[[source]]
id = "zoning"
jurisdiction = "testville"
kind = "file"
path = "districts.geojson"
layer = "districts"
parcels = "base"
max_change_ratio = 0.5
[source.fields]
zoning = "zoning"
[[source]]
id = "overlay"
jurisdiction = "testville"
kind = "file"
path = "overlays.geojson"
layer = "overlays"
parcels = "base"
max_change_ratio = 0.5
[source.fields]
zoning = "name"
[[subscriber]]
id = "all"
aoi = "aoi.geojson"
target = "http://127.0.0.1:9/hook"
min_severity = "info"
"#;
        Engine::open(Config::parse_str(toml, dir).unwrap()).unwrap()
    }

    /// What the district source must hold after a run over the current base and district
    /// file, computed the simple way: the whole base derived at once.
    fn expected(engine: &Engine, dir: &Path) -> (HashMap<String, ParcelState>, HashMap<String, u64>) {
        expected_of(engine, &dir.join("districts.geojson"), "zoning", LayerKind::Districts)
    }

    fn expected_of(engine: &Engine, file: &Path, field: &str, kind: LayerKind) -> (HashMap<String, ParcelState>, HashMap<String, u64>) {
        let layer = read_districts(&std::fs::read(file).unwrap(), field, None).unwrap();
        let index = DistrictIndex::build(layer.districts.iter().map(|d| (d.code.as_str(), &d.geometry)));
        let d = derive_all(kind, &index, engine.store.snapshot_parcels("base").unwrap(), 0.1);
        let shares = d.parcels.iter().zip(&d.shares).map(|(p, s)| (p.id.clone(), s.to_bits())).collect();
        (d.parcels.into_iter().map(|p| (p.id, p.state)).collect(), shares)
    }

    fn stored(engine: &Engine) -> (HashMap<String, ParcelState>, HashMap<String, u64>) {
        stored_of(engine, "zoning")
    }

    /// What a derived source has stored, as derivation gives it: a stored state's history
    /// (its revision and last announcement, `detect::diff::step`) is the runs', not the
    /// derivation's, and is left out.
    fn stored_of(engine: &Engine, source: &str) -> (HashMap<String, ParcelState>, HashMap<String, u64>) {
        let shares = engine.store.derived_shares(source).unwrap().into_iter().map(|(id, s)| (id, s.to_bits())).collect();
        let states = engine
            .store
            .snapshot_states(source)
            .unwrap()
            .into_iter()
            .map(|(id, s)| (id, ParcelState { revision: 0, announced: None, ..s }))
            .collect();
        (states, shares)
    }

    /// Parcels whose winning code moved from one real code to another between two derived
    /// snapshots: the changes a district run alerts on.
    fn rezoned(before: &HashMap<String, ParcelState>, after: &HashMap<String, ParcelState>) -> u64 {
        after
            .iter()
            .filter(|(id, s)| {
                before.get(*id).is_some_and(|b| {
                    !b.zoning.is_empty() && !s.zoning.is_empty() && normalize_code(&b.zoning) != normalize_code(&s.zoning)
                })
            })
            .count() as u64
    }

    /// A derived run reads its base a stretch at a time and keeps only a delta; whatever the
    /// stretch (one parcel, a few, the whole base at once), each run leaves exactly what
    /// deriving the whole base at once gives: the same derived states and the same shares,
    /// bit for bit. Across a baseline, a recoded district, a base that lost and gained
    /// parcels, and a change spike that is held and then released; the alerting changes are
    /// counted and queued as the simple derivation says.
    #[test]
    fn a_derived_run_in_stretches_leaves_what_deriving_the_whole_base_gives() {
        let codes = ["R-1", "R-2", "C-1", "R-1", "M-1", "R-3", "C-2", "OS", "R-1"];
        for stretch in [1, 7, 100_000] {
            let dir = tempfile::tempdir().unwrap();
            let engine = engine(dir.path());
            let src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
            let run = |note: &str| {
                let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
                let want = expected(&engine, dir.path());
                let got = stored(&engine);
                if r.record.verdict != Verdict::Held {
                    assert_eq!(got.0, want.0, "stretch {stretch}, {note}: derived states");
                    assert_eq!(got.1, want.1, "stretch {stretch}, {note}: shares");
                }
                (r, got.0)
            };
            let mut lots: Vec<SynthParcel> = CountyIter::new(&SPEC).collect();
            write_parcels(&dir.path().join("parcels.geojson"), &lots);
            engine.run_source_id("base", RunOptions::default()).unwrap();

            write_districts(&dir.path().join("districts.geojson"), CUTS, |c| codes[c].to_string());
            let (first, before) = run("baseline");
            assert_eq!(first.record.verdict, Verdict::Baseline);
            assert_eq!(first.record.counts.parcels, lots.len() as u64);
            let split = engine.store.derived_shares("zoning").unwrap().values().filter(|s| **s < 0.999).count();
            assert!(split > 10, "the grid cuts through lots: {split} split");

            // One district recoded: its parcels are rezoned, and queued once each.
            let recoded = |c: usize| if c == 4 { "C-3".to_string() } else { codes[c].to_string() };
            write_districts(&dir.path().join("districts.geojson"), CUTS, recoded);
            let (r, after) = run("one district recoded");
            assert_eq!(r.record.verdict, Verdict::Run, "{}", r.line());
            let want = rezoned(&before, &after);
            assert!(want > 5, "{want}");
            assert_eq!((r.record.counts.changes, r.record.counts.queued), (want, want), "{}", r.line());

            // The cuts move a little, the codes stay: shares move, and only the parcels
            // whose winning code flipped are rezoned.
            let shares_before = stored(&engine).1;
            write_districts(&dir.path().join("districts.geojson"), [-0.5, 0.375, 0.715, 1.5], recoded);
            let (r, moved) = run("cuts moved");
            let want = rezoned(&after, &moved);
            assert_eq!((r.record.counts.changes, r.record.counts.queued), (want, want), "{}", r.line());
            let shares_after = stored(&engine).1;
            let share_only =
                shares_after.iter().filter(|(id, s)| shares_before.get(*id) != Some(*s) && after.get(*id) == moved.get(*id)).count();
            assert!(share_only > 0, "some shares moved without their parcel's code");

            // The base loses every 25th lot and gains two: their derived rows and shares go
            // and come silently (the parcel source reports those itself).
            // The greatest id goes too: stored rows after the last base id are removed.
            let mut gone: Vec<String> = lots.iter().step_by(25).map(|l| l.id.clone()).collect();
            gone.extend(lots.iter().map(|l| l.id.clone()).max());
            lots.retain(|l| !gone.contains(&l.id));
            let mut extra: Vec<SynthParcel> = lots.iter().take(2).cloned().collect();
            for (k, lot) in extra.iter_mut().enumerate() {
                lot.id = format!("ZZ-{k}");
                for c in &mut lot.ring {
                    c[1] += 0.00001;
                }
            }
            lots.extend(extra);
            write_parcels(&dir.path().join("parcels.geojson"), &lots);
            assert_eq!(engine.run_source_id("base", RunOptions::default()).unwrap().record.verdict, Verdict::Run);
            let (r, after) = run("base changed");
            assert_eq!(r.record.verdict, Verdict::Run, "{}", r.line());
            assert_eq!(r.record.counts.changes, 0, "{}", r.line());
            assert_eq!(after.len(), lots.len());
            assert!(gone.iter().all(|id| !after.contains_key(id)));
            assert!(after.contains_key("ZZ-0") && after.contains_key("ZZ-1"));

            // Every district recoded: a change spike, held with its shares staged; released,
            // the snapshot and the shares are what deriving the whole base gives.
            let shares_kept = stored(&engine).1;
            write_districts(&dir.path().join("districts.geojson"), CUTS, |c| format!("X-{c}"));
            let (held, unchanged) = run("spike");
            assert_eq!(held.record.verdict, Verdict::Held, "{}", held.line());
            assert_eq!(unchanged, after, "a held run leaves the derived snapshot alone");
            assert_eq!(stored(&engine).1, shares_kept, "and the shares");
            let released = engine.resolve_hold(held.record.hold_id.unwrap(), false).unwrap();
            let want = expected(&engine, dir.path());
            let got = stored(&engine);
            assert_eq!((got.0.len(), got.1.len()), (lots.len(), lots.len()));
            assert_eq!(got, want, "stretch {stretch}: after the release");
            assert_eq!(released.counts.queued, rezoned(&after, &got.0));
        }
    }

    /// A store error half-way through a derived run's commit: 24,000 delta records (12,000
    /// shares, then 12,000 rows) make six chunks of 4,096; the first rows are in the third,
    /// whose write fails after a pause in which the thread reading the delta back puts the
    /// fourth and fifth in its channel and blocks sending the sixth. The run fails whole, the
    /// reading thread stops, nothing of the run is visible, and the next run commits it all.
    #[test]
    fn a_store_error_mid_commit_fails_a_derived_run_whole() {
        let spec = CountySpec { seed: 5, parcels: 12_000, origin: [-93.30, 44.95], blocks_per_row: 28 };
        let dir = tempfile::tempdir().unwrap();
        let engine = engine(dir.path());
        write_parcels(&dir.path().join("parcels.geojson"), &CountyIter::new(&spec).collect::<Vec<_>>());
        engine.run_source_id("base", RunOptions::default()).unwrap();
        write_districts_over(&spec, &dir.path().join("districts.geojson"), CUTS, |c| format!("Z-{}", c % 4));
        let src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
        engine.store.fail_snapshot_write(1, std::time::Duration::from_millis(300));
        let failed = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH);
        assert!(matches!(failed, Err(PipelineError::Store(_))), "{:?}", failed.map(|r| r.line()));
        assert!(engine.store.watermark("zoning").unwrap().is_none());
        assert!(engine.store.snapshot_states("zoning").unwrap().is_empty());
        assert!(engine.store.derived_shares("zoning").unwrap().is_empty());
        let again = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert_eq!(again.record.verdict, Verdict::Baseline);
        assert_eq!(stored(&engine), expected(&engine, dir.path()));
        assert_eq!(again.record.counts.parcels, 12_000);
    }

    /// A district feature that cannot be read (its code past the length cap, or a position
    /// with one number) does not take its parcels'
    /// zoning away: derived without it, they would take a neighbour's code and be alerted as
    /// rezoned (found by a black-box tester). They keep what they were derived before,
    /// whatever the stretch, while a recode of a district elsewhere in the same version is
    /// alerted (what is kept is where the feature lies, not the layer); once the district
    /// reads again, a recode of it is alerted as usual.
    #[test]
    fn parcels_under_a_district_that_cannot_be_read_keep_their_zoning() {
        let codes = ["R-1", "R-2", "C-1", "R-1", "M-1", "R-3", "C-2", "OS", "R-1"];
        let long = "M".repeat(crate::ingest::normalize::MAX_FIELD_BYTES + 1);
        for (damage, stretch) in [("long code", 7), ("long code", DERIVE_STRETCH), ("short position", DERIVE_STRETCH)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("districts.geojson");
            let engine = engine(dir.path());
            let src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
            write_parcels(&dir.path().join("parcels.geojson"), &CountyIter::new(&SPEC).collect::<Vec<_>>());
            engine.run_source_id("base", RunOptions::default()).unwrap();
            write_districts(&path, CUTS, |c| codes[c].to_string());
            engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            let before = stored(&engine);

            // The centre district damaged, the corner one across from it recoded.
            let code = |c: usize| match c {
                0 => "B-9".to_string(),
                4 if damage == "long code" => long.clone(),
                _ => codes[c].to_string(),
            };
            write_districts(&path, CUTS, code);
            if damage == "short position" {
                let mut layer: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                let position = &mut layer["features"][4]["geometry"]["coordinates"][0][0][1];
                *position = serde_json::json!([position[0].clone()]);
                std::fs::write(&path, layer.to_string()).unwrap();
            }
            let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            assert_eq!((r.record.verdict, r.record.counts.quarantined), (Verdict::Run, 1), "{damage}, stretch {stretch}: {}", r.line());
            assert!(r.record.counts.changes > 0 && r.record.counts.queued == r.record.counts.changes, "{damage}, stretch {stretch}: {}", r.line());
            assert!(r.record.warnings.iter().any(|w| w.contains("keep their derived districts zoning")), "{:?}", r.record.warnings);
            let (after, recoded) = (stored(&engine), engine.store.outbox().unwrap());
            assert!(recoded.iter().all(|e| matches!(&e.payload, crate::model::OutboxPayload::Change(c) if c.to.as_deref() == Some("B-9"))), "{damage}: only the corner's recode is alerted");
            let moved: Vec<&String> = after.0.keys().filter(|id| after.0.get(*id) != before.0.get(*id)).collect();
            assert_eq!(moved.len() as u64, r.record.counts.changes, "{damage}: the parcels under the damaged district are as they were");

            write_districts(&path, CUTS, |c| if c == 4 { "C-3".to_string() } else { code(c) });
            let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            assert!(r.record.counts.changes > 5 && r.record.counts.queued == r.record.counts.changes, "{damage}, stretch {stretch}: {}", r.line());
            assert_eq!(stored(&engine), expected(&engine, dir.path()));
        }
    }

    /// More than half of a district layer with no readable position (a null geometry, as an
    /// export that dropped them writes) is held as a quarantine spike, in both modes, instead
    /// of alerting the ground those districts covered as rezoned or gone.
    #[test]
    fn a_district_layer_mostly_without_geometry_is_held() {
        let codes = ["R-1", "R-2", "C-1", "R-1", "M-1", "R-3", "C-2", "OS", "R-1"];
        for area_mode in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let engine = engine(dir.path());
            let mut src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
            if area_mode {
                src.parcels = None;
            } else {
                write_parcels(&dir.path().join("parcels.geojson"), &CountyIter::new(&SPEC).collect::<Vec<_>>());
                engine.run_source_id("base", RunOptions::default()).unwrap();
            }
            let path = dir.path().join("districts.geojson");
            write_districts(&path, CUTS, |c| codes[c].to_string());
            engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
            let mut layer: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            for cell in 0..5 {
                layer["features"][cell]["geometry"] = serde_json::Value::Null;
            }
            std::fs::write(&path, layer.to_string()).unwrap();
            let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
            assert_eq!((r.record.verdict, r.record.counts.quarantined), (Verdict::Held, 5), "area mode {area_mode}: {}", r.line());
            assert!(engine.store.outbox().unwrap().is_empty(), "area mode {area_mode}");
        }
    }

    /// Area mode: the ground under a district feature that cannot be read keeps its stored
    /// zoning (`detect::area::KeptCoverage`): nothing is alerted while it cannot be read (it
    /// read as having lost its zone, an `area_rezoned` to no zone), in two versions in a row
    /// without the kept pieces piling up, nothing when it reads again unchanged (and nothing
    /// is kept then), and a real recode of it afterwards is alerted from its old code.
    #[test]
    fn area_mode_keeps_the_ground_of_a_district_that_cannot_be_read() {
        let codes = ["R-1", "R-2", "C-1", "R-1", "M-1", "R-3", "C-2", "OS", "R-1"];
        let dir = tempfile::tempdir().unwrap();
        let engine = engine(dir.path());
        let mut src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
        src.parcels = None;
        let path = dir.path().join("districts.geojson");
        let queued = |engine: &Engine| -> Vec<(Option<String>, Option<String>)> {
            let mut v: Vec<_> = engine
                .store
                .outbox()
                .unwrap()
                .into_iter()
                .map(|e| match e.payload {
                    crate::model::OutboxPayload::Change(c) => (c.from, c.to),
                    crate::model::OutboxPayload::Built(_) => panic!("a built body"),
                })
                .collect();
            v.sort();
            v.dedup();
            v
        };
        write_districts(&path, CUTS, |c| codes[c].to_string());
        let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert_eq!(r.record.verdict, Verdict::Baseline);

        let long = "M".repeat(crate::ingest::normalize::MAX_FIELD_BYTES + 1);
        write_districts(&path, CUTS, |c| if c == 4 { long.clone() } else { codes[c].to_string() });
        let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.quarantined), (Verdict::Run, 0, 1), "{}", r.line());
        assert!(r.record.warnings.iter().any(|w| w.contains("keep their zoning")), "{:?}", r.record.warnings);
        assert!(queued(&engine).is_empty());
        let kept_rows = |engine: &Engine| engine.store.snapshot_states("zoning").unwrap().keys().filter(|id| id.starts_with('k')).count();
        let kept = kept_rows(&engine);
        assert!(kept >= 1);
        // Still unreadable in the next version (another code past the cap): kept as it was,
        // once, not once more per run.
        let longer = "N".repeat(crate::ingest::normalize::MAX_FIELD_BYTES + 2);
        write_districts(&path, CUTS, |c| if c == 4 { longer.clone() } else { codes[c].to_string() });
        let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert_eq!((r.record.verdict, r.record.counts.changes), (Verdict::Run, 0), "{}", r.line());
        assert_eq!(kept_rows(&engine), kept, "the kept pieces do not pile up");

        write_districts(&path, CUTS, |c| codes[c].to_string());
        let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert_eq!((r.record.verdict, r.record.counts.changes), (Verdict::Run, 0), "read again unchanged: {}", r.line());
        assert_eq!(kept_rows(&engine), 0, "read again, nothing is kept in its place");

        write_districts(&path, CUTS, |c| if c == 4 { long.clone() } else { codes[c].to_string() });
        engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        write_districts(&path, CUTS, |c| if c == 4 { "C-3".to_string() } else { codes[c].to_string() });
        let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), DERIVE_STRETCH).unwrap();
        assert!(r.record.counts.changes >= 1, "{}", r.line());
        assert_eq!(queued(&engine), vec![(Some("M-1".to_string()), Some("C-3".to_string()))]);
    }

    /// A stop asked while a derived run reads its base ends the run before its commit, in
    /// both modes: nothing of it is stored, and the next run (of an engine not stopping)
    /// makes it whole.
    #[test]
    fn a_stop_ends_a_derived_run_before_its_commit() {
        let spec = CountySpec { seed: 5, parcels: 3_000, origin: [-93.30, 44.95], blocks_per_row: 28 };
        let dir = tempfile::tempdir().unwrap();
        let mut engine = engine(dir.path());
        write_parcels(&dir.path().join("parcels.geojson"), &CountyIter::new(&spec).collect::<Vec<_>>());
        engine.run_source_id("base", RunOptions::default()).unwrap();
        write_districts_over(&spec, &dir.path().join("districts.geojson"), CUTS, |c| format!("Z-{}", c % 4));
        let src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
        let mut area = src.clone();
        area.parcels = None;
        engine.stop.request();
        for (src, stretch) in [(&src, 1_000), (&src, DERIVE_STRETCH), (&area, DERIVE_STRETCH)] {
            let stopped = engine.run_derived_in(src, RunOptions::default(), engine.now(), stretch);
            assert!(matches!(&stopped, Err(e) if e.is_stopped()), "{:?}", stopped.map(|r| r.line()));
            assert!(engine.store.watermark("zoning").unwrap().is_none());
            assert!(engine.store.snapshot_states("zoning").unwrap().is_empty());
            assert!(engine.store.derived_shares("zoning").unwrap().is_empty());
        }
        engine.stop = crate::run_stop::RunStop::default();
        let again = engine.run_derived_in(&src, RunOptions::default(), engine.now(), 1_000).unwrap();
        assert_eq!(again.record.verdict, Verdict::Baseline);
        assert_eq!(stored(&engine), expected(&engine, dir.path()));
    }

    /// Shares a store can hold that no run of this build writes — one without any parcel
    /// (`ghost`), one that cannot be decoded — are put right by the next run that derives:
    /// a reprocess removes the first and writes the second again, and so does a held run
    /// once released.
    #[test]
    fn stray_and_unreadable_shares_are_put_right_by_the_next_run() {
        let dir = tempfile::tempdir().unwrap();
        let engine = engine(dir.path());
        let src = engine.config.sources.iter().find(|s| s.id == "zoning").unwrap().clone();
        let lots: Vec<SynthParcel> = CountyIter::new(&SPEC).collect();
        write_parcels(&dir.path().join("parcels.geojson"), &lots);
        engine.run_source_id("base", RunOptions::default()).unwrap();
        write_districts(&dir.path().join("districts.geojson"), CUTS, |c| format!("Z-{}", c % 4));
        engine.run_derived_in(&src, RunOptions::default(), engine.now(), 50).unwrap();
        let spoil = |engine: &Engine| {
            engine.store.put_raw_share("zoning", "ghost", &crate::store::codec::encode(&0.5f64));
            assert!(stored(engine).1.contains_key("ghost"));
            engine.store.put_raw_share("zoning", &lots[17].id, &[9, 9, 9]);
            assert!(engine.store.derived_shares("zoning").is_err(), "the share cannot be read");
        };
        spoil(&engine);
        let reprocess = RunOptions { reprocess: true, ..RunOptions::default() };
        let r = engine.run_derived_in(&src, reprocess, engine.now(), 50).unwrap();
        assert!(r.record.warnings.iter().any(|w| w.starts_with("1 stored shares could not be read")), "{:?}", r.record.warnings);
        assert_eq!(stored(&engine), expected(&engine, dir.path()), "after a reprocess");

        spoil(&engine);
        write_districts(&dir.path().join("districts.geojson"), CUTS, |c| format!("Y-{c}"));
        let held = engine.run_derived_in(&src, RunOptions::default(), engine.now(), 50).unwrap();
        assert_eq!(held.record.verdict, Verdict::Held, "{}", held.line());
        engine.resolve_hold(held.record.hold_id.unwrap(), false).unwrap();
        assert_eq!(stored(&engine), expected(&engine, dir.path()), "after a released hold");
    }

    /// Overlay sets in stretches: two overlapping overlays, one of which moves. Whatever the
    /// stretch, the stored overlay sets and shares are what deriving the whole base gives,
    /// and the run alerts once per overlay gained or lost by a parcel.
    #[test]
    fn overlay_sets_in_stretches_leave_what_deriving_the_whole_base_gives() {
        let write_overlays_named = |path: &Path, hist_south: f64, hist: &str| {
            let (sw, ne) = CountyIter::extent(&SPEC);
            let at = |fx: f64, fy: f64| (sw[0] + fx * (ne[0] - sw[0]), sw[1] + fy * (ne[1] - sw[1]));
            let feature = |name: &str, a: (f64, f64), b: (f64, f64)| {
                let mp = MultiPolygon(vec![Polygon::from(Rect::new(a, b))]);
                serde_json::json!({"type": "Feature", "properties": {"name": name}, "geometry": geojson::Geometry::from(&mp)})
            };
            let features = vec![feature("FLOOD", at(-0.5, -0.5), at(0.61, 1.5)), feature(hist, at(-0.5, hist_south), at(1.5, 1.5))];
            std::fs::write(path, serde_json::json!({"type": "FeatureCollection", "features": features}).to_string()).unwrap();
        };
        let write_overlays = |path: &Path, hist_south: f64| write_overlays_named(path, hist_south, "HIST");
        let sets = |states: &HashMap<String, ParcelState>| -> HashMap<String, HashSet<String>> {
            states.iter().map(|(id, s)| (id.clone(), overlay_set(&s.zoning).into_iter().map(normalize_code).collect())).collect()
        };
        for stretch in [1, 7, 100_000] {
            let dir = tempfile::tempdir().unwrap();
            let engine = engine(dir.path());
            let src = engine.config.sources.iter().find(|s| s.id == "overlay").unwrap().clone();
            let file = dir.path().join("overlays.geojson");
            write_parcels(&dir.path().join("parcels.geojson"), &CountyIter::new(&SPEC).collect::<Vec<_>>());
            engine.run_source_id("base", RunOptions::default()).unwrap();
            write_overlays(&file, 0.47);
            let first = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            assert_eq!(first.record.verdict, Verdict::Baseline);
            let before = stored_of(&engine, "overlay");
            assert_eq!(before, expected_of(&engine, &file, "name", LayerKind::Overlays), "stretch {stretch}: baseline");
            let both = sets(&before.0).values().filter(|s| s.len() == 2).count();
            assert!(both > 10, "the overlays overlap on {both} parcels");

            write_overlays(&file, 0.33);
            let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            assert_eq!(r.record.verdict, Verdict::Run, "{}", r.line());
            let after = stored_of(&engine, "overlay");
            assert_eq!(after, expected_of(&engine, &file, "name", LayerKind::Overlays), "stretch {stretch}: moved");
            let (old, new) = (sets(&before.0), sets(&after.0));
            let flips: usize = new.iter().map(|(id, n)| n.symmetric_difference(&old[id]).count()).sum();
            assert!(flips > 10, "{flips}");
            assert_eq!((r.record.counts.changes, r.record.counts.queued), (flips as u64, flips as u64), "{}", r.line());

            // HIST shrinks to its northern part, then is renamed there: each of its parcels
            // loses HIST and gains HIST-2, two events of one parcel. The change-spike gate
            // counts parcels (under half changed: sent), not events (over half: it held).
            write_overlays(&file, 0.5);
            assert_eq!(engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap().record.verdict, Verdict::Run);
            let before = stored_of(&engine, "overlay");
            write_overlays_named(&file, 0.5, "HIST-2");
            let r = engine.run_derived_in(&src, RunOptions::default(), engine.now(), stretch).unwrap();
            let renamed = sets(&before.0).values().filter(|s| s.contains("HIST")).count() as u64;
            let parcels = before.0.len() as u64;
            assert!(renamed * 2 < parcels && renamed * 4 > parcels, "{renamed} of {parcels} parcels under HIST");
            assert_eq!((r.record.verdict, r.record.counts.changes), (Verdict::Run, 2 * renamed), "stretch {stretch}: {}", r.line());
        }
    }
}
