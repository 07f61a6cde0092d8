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

use crate::config::{LayerKind, SourceConfig};
use crate::detect::canonical::{content_hash, normalize_code};
use crate::detect::diff::{diff, RawChange};
use crate::detect::gate::{decide, GateInput};
use crate::detect::overlay::{Coverage, DistrictIndex};
use crate::ingest::districts::read_districts;
use crate::ingest::source;
use crate::model::*;
use crate::pipeline::{Engine, PipelineError, RunOptions, SourceReport};
use crate::store::{CommitMode, QuarantineDraft, RunCommit};
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
                names.sort_by(|a, b| normalize_code(&a.0).cmp(&normalize_code(&b.0)));
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
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
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

/// Turns the diff of derived states into the changes that alert: code changes between two
/// real codes (districts), or gained / lost overlays (overlays).
fn alerting_changes(layer: LayerKind, changes: Vec<RawChange>) -> (Vec<RawChange>, u64) {
    let mut out = Vec::new();
    let mut coverage_only = 0;
    for c in changes {
        if c.kind != ChangeKind::Rezoned {
            continue;
        }
        let from = c.from.as_deref().unwrap_or("");
        let to = c.to.as_deref().unwrap_or("");
        match layer {
            LayerKind::Overlays => {
                let old = overlay_set(from);
                let new = overlay_set(to);
                let norm_old: HashSet<String> = old.iter().map(|n| normalize_code(n)).collect();
                let norm_new: HashSet<String> = new.iter().map(|n| normalize_code(n)).collect();
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
            _ => {
                if from.is_empty() || to.is_empty() {
                    coverage_only += 1;
                } else {
                    out.push(c);
                }
            }
        }
    }
    (out, coverage_only)
}

impl Engine {
    /// One run of a `districts` / `overlays` source (see the module doc).
    pub(crate) fn run_derived(&self, src: &SourceConfig, opts: RunOptions, started: u64) -> Result<SourceReport, PipelineError> {
        let Some(base_id) = src.parcels.clone() else {
            return self.run_area(src, opts, started);
        };
        let base_wm = self
            .store
            .watermark(&base_id)?
            .ok_or_else(|| PipelineError::BaseNotIngested { source_id: src.id.clone(), base: base_id.clone() })?;
        let fetched = source::fetch(src)?;
        let wm = self.store.watermark(&src.id)?;
        let fingerprint = format!(
            "{}:base={}:{}:{}",
            src.read_fingerprint(),
            base_id,
            base_wm.digest.chars().take(16).collect::<String>(),
            base_wm.read_fingerprint
        );
        if !opts.reprocess {
            if let Some(w) = &wm {
                if w.digest == fetched.digest && w.read_fingerprint == fingerprint {
                    let record = self.store.commit_identical(&src.id, started, self.now(), 0)?;
                    return Ok(SourceReport { record, hold_reason: None });
                }
            }
            let open_same = self.store.holds()?.into_iter().find(|h| {
                h.source_id == src.id
                    && h.state == HoldState::Open
                    && h.digest == fetched.digest
                    && h.watermark.read_fingerprint == fingerprint
            });
            if let Some(h) = open_same {
                let record =
                    self.store.record_run_note(&src.id, started, self.now(), Verdict::Held, &fetched.digest, Some(h.run_id), None)?;
                return Ok(SourceReport { record, hold_reason: Some(format!("still held: {}", h.reason)) });
            }
        }

        let layer = read_districts(&fetched.bytes, &src.fields.zoning, src.bbox)?;
        let mut warnings: Vec<String> = layer
            .folded_fields
            .iter()
            .map(|(want, got)| format!("field {want:?} is absent; matched {got:?} case-insensitively"))
            .collect();
        let index = DistrictIndex::build(layer.districts.iter().map(|d| (d.code.as_str(), &d.geometry)));

        // The base: every parcel of the parcel source's committed snapshot, in id order.
        let base = self.store.snapshot_parcels(&base_id)?;
        let derivation = derive_all(src.layer, &index, base, src.overlay_min_share);
        tracing::info!(source = %src.id, parcels = derivation.parcels.len(), polygons = index.len(), ms = derivation.millis as u64, "derived zoning");
        warnings.push(format!(
            "derived {} zoning for {} parcels of {base_id:?} from {} polygons in {} ms ({} uncovered)",
            src.layer.as_str(),
            derivation.parcels.len(),
            index.len(),
            derivation.millis,
            derivation.uncovered
        ));
        if derivation.failed > 0 {
            warnings.push(format!("{} parcel/district intersections could not be computed and counted as 0", derivation.failed));
        }

        let old = self.store.snapshot_states(&src.id)?;
        let first_ingest = wm.is_none() && old.is_empty();
        let parcels_n = derivation.parcels.len() as u64;
        let shares: Vec<(String, f64)> =
            derivation.parcels.iter().map(|p| p.id.clone()).zip(derivation.shares.iter().copied()).collect();
        let d = diff(&old, derivation.parcels, &HashSet::new());
        let (changes, coverage_only) = alerting_changes(src.layer, d.changes);
        if coverage_only > 0 {
            warnings.push(format!("{coverage_only} parcels gained or lost district coverage (not a rezoning; not alerted)"));
        }
        let quarantine: Vec<QuarantineDraft> = layer
            .rejected
            .into_iter()
            .map(|r| QuarantineDraft { feature_index: r.feature_index, parcel_id: None, reason: r.reason, detail: r.detail, raw: r.raw })
            .collect();
        let systemic = quarantine.iter().filter(|q| q.reason.is_systemic()).count() as u64;

        let now = self.now();
        let events = self.build_events(src, &changes, &d.upserts, &old, now)?;
        let decision = decide(GateInput {
            first_ingest,
            reprocess: opts.reprocess,
            previous_parcels: old.len() as u64,
            changed: events.len() as u64,
            features: layer.features,
            systemic_quarantined: systemic,
            max_change_ratio: src.max_change_ratio,
            restated: None,
        });
        let watermark = Watermark::for_read(&fetched.digest, fetched.bytes.len() as u64, now, wm.as_ref(), fingerprint);
        let (mode, hold_reason) = crate::pipeline::commit_mode(decision);
        let claims = if matches!(mode, CommitMode::Hold { .. }) { vec![] } else { self.claims_for(&events) };
        let counts = RunCounts {
            features: layer.features,
            parcels: parcels_n,
            quarantined: quarantine.len() as u64,
            repaired: layer.repaired,
            changes: events.len() as u64,
            ..Default::default()
        };
        let record = self.store.commit_run_with(RunCommit {
            source_id: src.id.clone(),
            started_ms: started,
            now_ms: now,
            mode,
            watermark,
            upserts: d.upserts,
            removals: d.removals,
            events,
            claims,
            quarantine,
            counts,
            warnings,
            idem_ttl_ms: self.config.delivery.idem_ttl.as_millis() as u64,
        }, &shares)?;
        tracing::info!(source = %src.id, run = record.run_id, verdict = %record.verdict, changes = record.counts.changes, queued = record.counts.queued, "derived run committed");
        Ok(SourceReport { record, hold_reason })
    }
}

impl Engine {
    /// Area mode: a `districts` source without a parcel base. The source's snapshot holds the
    /// district polygons themselves (key = feature position, which is not trusted to mean
    /// anything across versions); the change is computed geometrically by
    /// [`crate::detect::area::area_diff`].
    fn run_area(&self, src: &SourceConfig, opts: RunOptions, started: u64) -> Result<SourceReport, PipelineError> {
        use crate::detect::area::area_diff;
        use crate::detect::canonical::geometry_hash;
        use geo::GeodesicArea;
        let fetched = source::fetch(src)?;
        let wm = self.store.watermark(&src.id)?;
        let fingerprint = src.read_fingerprint();
        if !opts.reprocess {
            if let Some(w) = &wm {
                if w.digest == fetched.digest && w.read_fingerprint == fingerprint {
                    let record = self.store.commit_identical(&src.id, started, self.now(), 0)?;
                    return Ok(SourceReport { record, hold_reason: None });
                }
            }
            let open_same = self.store.holds()?.into_iter().find(|h| {
                h.source_id == src.id && h.state == HoldState::Open && h.digest == fetched.digest && h.watermark.read_fingerprint == fingerprint
            });
            if let Some(h) = open_same {
                let record = self.store.record_run_note(&src.id, started, self.now(), Verdict::Held, &fetched.digest, Some(h.run_id), None)?;
                return Ok(SourceReport { record, hold_reason: Some(format!("still held: {}", h.reason)) });
            }
        }
        let layer = read_districts(&fetched.bytes, &src.fields.zoning, src.bbox)?;
        let mut warnings: Vec<String> = layer
            .folded_fields
            .iter()
            .map(|(want, got)| format!("field {want:?} is absent; matched {got:?} case-insensitively"))
            .collect();
        let old_states = self.store.snapshot_states(&src.id)?;
        let mut old_ids: Vec<&String> = old_states.keys().collect();
        old_ids.sort();
        let old_geoms = self.store.parcel_geometries(&src.id, old_ids.iter().map(|s| s.as_str()))?;
        let old: Vec<(String, geo::MultiPolygon<f64>)> = old_ids
            .iter()
            .filter_map(|id| Some((old_states.get(id.as_str())?.zoning.clone(), old_geoms.get(id.as_str())?.to_geo())))
            .collect();
        let new: Vec<(String, geo::MultiPolygon<f64>)> = layer.districts.iter().map(|d| (d.code.clone(), d.geometry.clone())).collect();
        let first_ingest = wm.is_none() && old_states.is_empty();
        let t0 = Instant::now();
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
                }
            })
            .collect();
        // The new snapshot: the district polygons, keyed by position.
        let upserts: Vec<Parcel> = layer
            .districts
            .iter()
            .map(|d| {
                let gh = geometry_hash(&d.geometry);
                Parcel {
                    id: format!("f{:07}", d.feature_index),
                    state: ParcelState {
                        zoning: d.code.clone(),
                        effective_date: None,
                        content_hash: content_hash(&d.code, None, &gh),
                        geom_hash: gh,
                        area_m2: d.geometry.geodesic_area_unsigned(),
                    },
                    geometry: StoredGeometry::from_geo(&d.geometry),
                }
            })
            .collect();
        let keep: HashSet<&str> = upserts.iter().map(|p| p.id.as_str()).collect();
        let removals: Vec<String> = old_ids.iter().filter(|id| !keep.contains(id.as_str())).map(|s| (*s).clone()).collect();
        let quarantine: Vec<QuarantineDraft> = layer
            .rejected
            .into_iter()
            .map(|r| QuarantineDraft { feature_index: r.feature_index, parcel_id: None, reason: r.reason, detail: r.detail, raw: r.raw })
            .collect();
        let systemic = quarantine.iter().filter(|q| q.reason.is_systemic()).count() as u64;
        let decision = decide(GateInput {
            first_ingest,
            reprocess: opts.reprocess,
            previous_parcels: old_states.len() as u64,
            changed: events.iter().filter(|e| e.severity > Severity::Info).count() as u64,
            features: layer.features,
            systemic_quarantined: systemic,
            max_change_ratio: src.max_change_ratio,
            restated: None,
        });
        let watermark = Watermark::for_read(&fetched.digest, fetched.bytes.len() as u64, now, wm.as_ref(), fingerprint);
        let (mode, hold_reason) = crate::pipeline::commit_mode(decision);
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
            quarantine,
            counts,
            warnings,
            idem_ttl_ms: self.config.delivery.idem_ttl.as_millis() as u64,
        })?;
        Ok(SourceReport { record, hold_reason })
    }
}
