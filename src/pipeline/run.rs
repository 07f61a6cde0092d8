//! One source run, from its fetch to its commit: the per-source lease, probe and fetch (a
//! file, a `geojson_url`, a portal layer collected on disk), the digest (a run settled as
//! identical or still held, before the scan when the digest is known and again after it),
//! the streaming scan, removals confirmed, the gate (a restatement is held), then the commit
//! (`commit.rs`); a run that fails is recorded as failed.

use crate::config::{SourceConfig, SourceKind};
use crate::detect::gate::{decide, GateDecision, GateInput};
use crate::detect::stream::{default_workers, scan_layer, ScanError, ScanResult};
use crate::ingest::normalize::NormalizeRules;
use crate::ingest::portal::{self, LayerBody, PortalFetch, PortalMeta};
use crate::ingest::{source, staging, IngestError};
use crate::model::*;
use crate::store::{CommitMode, PortalSignals, RunNote, StoreError, UnchangedRun};
use super::{Engine, PipelineError, RunOptions, SourceReport};

/// Where a layer's bytes are: a local file is streamed from disk by its path; a fetched
/// layer (written to its staged payload) or a staged payload replayed is streamed through
/// the handle it was written or checked with. Never read whole into memory.
enum LayerInput {
    File(std::path::PathBuf),
    Staged(staging::StagedLayer),
}

/// Whether a run announces its changes (`detect::diff::step`): not a reprocess, and not a
/// first ingest (no watermark and nothing stored in `view`: the gate's baseline).
pub(crate) fn announces_changes(reprocess: bool, wm: Option<&Watermark>, view: &crate::store::SnapshotView) -> Result<bool, StoreError> {
    Ok(!reprocess && (wm.is_some() || view.has_parcels()?))
}

/// Scans a layer read from `file` (its path for messages) through a digesting reader:
/// returns the scan with the sha256 and size of the very bytes it read. A file that could
/// not be read is reported as such, with its path, not as a document that is not GeoJSON.
#[allow(clippy::too_many_arguments)]
pub(super) fn scan_digested<R: std::io::Read + Send>(
    file: R,
    path: &std::path::Path,
    rules: &NormalizeRules,
    view: &crate::store::SnapshotView,
    announce: bool,
    spill_dir: &std::path::Path,
    workers: usize,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
    stop: &crate::run_stop::RunStop,
) -> Result<(ScanResult, String, u64), PipelineError> {
    let read_err = |e| IngestError::Read { path: path.to_path_buf(), source: e };
    let mut reader = source::DigestingReader::new(crate::run_stop::StopReader::new(file, stop));
    // Told stopped by the reader's own refusal only: a scan that failed on its own stays
    // that failure, whatever was asked meanwhile (found by a reviewer).
    let failed = |e: std::io::Error| if crate::run_stop::is_stop(&e) { PipelineError::from(IngestError::Stopped) } else { read_err(e).into() };
    let scan = match scan_layer(&mut reader, rules, view, announce, spill_dir, workers, progress) {
        Ok(scan) => scan,
        // The reader's own error when the scan met it (it surfaces as a document that could
        // not be read); a worker's (joined features: its own variant), a spill's or the
        // store's failure stays that failure, even if the reader, still draining the layer,
        // was refused by a stop meanwhile.
        Err(e @ ScanError::Ingest(IngestError::Malformed(_))) => return Err(reader.take_error().map(failed).unwrap_or(e.into())),
        Err(e) => return Err(e.into()),
    };
    // Reads past the last feature (to the end of the bytes): a stop asked since is a stop.
    let (digest, size) = reader.finish().map_err(failed)?;
    Ok((scan, digest, size))
}

/// What a parcel source's run starts from: a local file, a portal's answer, or the payload
/// staged by an earlier fetch (`--from-staging`).
enum Fetched {
    File,
    Portal(PortalFetch),
    Staged(staging::StagedLayer, PortalMeta),
}

/// How the store commits a run the gate decided on, and the hold reason if it is held.
/// `reprocess`: the run is a `--reprocess` (a hold of it remembers so, and its release primes).
pub(crate) fn commit_mode(decision: GateDecision, reprocess: bool) -> (CommitMode, Option<String>) {
    match decision {
        GateDecision::Baseline => (CommitMode::Baseline, None),
        GateDecision::Deliver => (CommitMode::Deliver, None),
        GateDecision::Reprocess => (CommitMode::Reprocess, None),
        GateDecision::Hold(reason) => (CommitMode::Hold { reason: reason.clone(), reprocess }, Some(reason)),
    }
}

fn portal_signals(m: &PortalMeta) -> PortalSignals {
    PortalSignals {
        publisher_ts_ms: m.publisher_ts_ms,
        etag: m.etag.clone(),
        last_modified: m.last_modified.clone(),
        schema_hash: m.schema_hash.clone(),
    }
}

impl Engine {
    /// Runs one source by id.
    pub fn run_source_id(&self, id: &str, opts: RunOptions) -> Result<SourceReport, PipelineError> {
        let src = self.config.source(id).ok_or_else(|| PipelineError::UnknownSource(id.to_string()))?.clone();
        self.run_source(&src, opts)
    }

    /// Runs one source: see the module doc. Failures before the commit leave a `failed` run
    /// record and nothing else; the next run redoes the work.
    pub fn run_source(&self, src: &SourceConfig, opts: RunOptions) -> Result<SourceReport, PipelineError> {
        self.run_source_with(src, opts, false)
    }

    /// `zonewatch run --source ID --from-staging`: re-processes the payload staged by the
    /// source's last HTTP fetch (digest re-checked) without fetching it again (a paged
    /// layer's removals are still confirmed against the portal: `confirm_removals`).
    pub fn run_source_from_staging(&self, src: &SourceConfig, opts: RunOptions) -> Result<SourceReport, PipelineError> {
        self.run_source_with(src, opts, true)
    }

    fn run_source_with(&self, src: &SourceConfig, opts: RunOptions, from_staging: bool) -> Result<SourceReport, PipelineError> {
        let started = self.now();
        // One run per source at a time: a trigger during a run is recorded, not run.
        let Some(_lease) = staging::try_lease(self.store.path(), &src.id) else {
            let record = self.store.record_run_note(&src.id, started, self.now(), RunNote { verdict: Verdict::SkippedOverlap, digest: "", hold_id: None, error: None })?;
            return Ok(SourceReport { record, hold_reason: None });
        };
        match self.run_source_inner(src, opts, started, from_staging) {
            Ok(r) => Ok(r),
            Err(e) => {
                if let Err(note_err) = self.store.record_run_note(&src.id, started, self.now(), RunNote { verdict: Verdict::Failed, digest: "", hold_id: None, error: Some(e.to_string()) }) {
                    tracing::error!(source = %src.id, "could not record the failed run: {note_err}");
                }
                Err(e)
            }
        }
    }

    fn run_source_inner(&self, src: &SourceConfig, opts: RunOptions, started: u64, from_staging: bool) -> Result<SourceReport, PipelineError> {
        if src.layer != crate::config::LayerKind::Parcels {
            return self.run_derived(src, opts, started);
        }
        let wm = self.store.watermark(&src.id)?;
        // How this config reads a layer's bytes (field mapping, bbox): a reading made
        // another way is not the same one.
        let fingerprint = src.read_fingerprint();
        let fetch = if from_staging {
            let (layer, m) = staging::load(self.store.path(), &src.id)?;
            Fetched::Staged(layer, m.portal_meta())
        } else {
            // HTTP kinds: probe, and fetch only when something moved (or the floor is due). A
            // changed field mapping (or bbox) fetches at once, as a file is read at once: the
            // stored parcels were read another way, and a probe saying "unchanged" (or a 304)
            // would keep that reading until the floor. Not while an open hold already holds a
            // reading made this way: it waits for an operator, and a fetch would only find it.
            let remapped = !matches!(src.kind, crate::config::SourceKind::File { .. })
                && wm.as_ref().is_some_and(|w| w.read_fingerprint != fingerprint)
                && !self.store.open_holds(Some(&src.id))?.iter().any(|h| h.watermark.read_fingerprint == fingerprint);
            match portal::fetch(src, &self.config.ingest, wm.as_ref(), started, opts.reprocess || remapped, self.store.path(), self.scratch_dir(), &self.stop, opts.progress.clone()).map_err(IngestError::from)? {
                Some(f) => Fetched::Portal(f),
                None => Fetched::File,
            }
        };
        // A layer read page by page: its removals are confirmed by a second read. A payload
        // staged by such a read (`--from-staging`) too: it may be the very read whose
        // confirmation failed.
        let paged = match &fetch {
            Fetched::Portal(PortalFetch::Layer { body, .. }) => matches!(body, LayerBody::Features(_)),
            Fetched::Staged(..) => matches!(src.kind, SourceKind::Arcgis { .. } | SourceKind::Ogcapi { .. } | SourceKind::Socrata { .. }),
            _ => false,
        };
        // Open holds, read when a file's size or a digest needs them (never for a reprocess,
        // which is not settled by its digest).
        let mut holds: Option<Vec<Hold>> = None;
        // What the bytes could be settled by before any scan: their digest, when known.
        let (mut input, known_digest, meta) = match fetch {
            Fetched::File => {
                let path = match &src.kind {
                    crate::config::SourceKind::File { path } => path.clone(),
                    _ => return Err(PipelineError::UnknownSource(format!("{} has no file path", src.id))),
                };
                // A file is digested ahead of the scan only when it could be a version already
                // seen (the size of the watermark's or of an open hold's), so an unchanged layer
                // is settled by one read. A layer of another size cannot be one of those: it is
                // read once, by the scan, which digests the bytes it reads (as does a reprocess,
                // which is never settled by its digest).
                let could_be_seen = !opts.reprocess && match std::fs::metadata(&path) {
                    Ok(m) if wm.as_ref().is_some_and(|w| w.size == m.len()) => true,
                    Ok(m) => {
                        let open = self.store.open_holds(Some(&src.id))?;
                        let same_size = open.iter().any(|h| h.watermark.size == m.len());
                        holds = Some(open);
                        same_size
                    }
                    // Let the read below report it.
                    Err(_) => true,
                };
                let known = if could_be_seen { Some(source::digest_file(&path)?.0) } else { None };
                (LayerInput::File(path), known, None)
            }
            Fetched::Portal(PortalFetch::Skip { reason, meta }) => {
                let mut warnings = vec![format!("probe: {reason}")];
                warnings.extend(portal::stale(wm.as_ref(), started, src.stale_after));
                let signals = portal_signals(&meta);
                let record = self.store.commit_unchanged(&src.id, started, self.now(), UnchangedRun { verdict: Verdict::Skip, signals: &signals, features_hint: 0, warnings })?;
                return Ok(SourceReport { record, hold_reason: None });
            }
            Fetched::Portal(PortalFetch::Layer { body: LayerBody::File(body), meta }) => {
                let layer = staging::stage_body(self.store.path(), &src.id, body, &meta, started);
                let digest = layer.digest.clone();
                (LayerInput::Staged(layer), Some(digest), Some(meta))
            }
            Fetched::Portal(PortalFetch::Layer { body: LayerBody::Features(features), meta }) => {
                let layer = staging::stage_features(self.store.path(), &src.id, *features, &meta, started, self.scratch_dir())?;
                let digest = layer.digest.clone();
                (LayerInput::Staged(layer), Some(digest), Some(meta))
            }
            Fetched::Staged(layer, meta) => {
                let digest = layer.digest.clone();
                (LayerInput::Staged(layer), Some(digest), Some(meta))
            }
        };
        let holds = match holds {
            Some(h) => h,
            None if opts.reprocess => Vec::new(),
            None => self.store.open_holds(Some(&src.id))?,
        };
        if !opts.reprocess {
            if let Some(digest) = &known_digest {
                if let Some(report) = self.settled_by_digest(src, wm.as_ref(), meta.as_ref(), &holds, digest, &fingerprint, started)? {
                    return Ok(report);
                }
            }
        }

        // The streaming diff: normalise, look up, classify; the delta goes to a spill file.
        let rules = NormalizeRules { fields: &src.fields, bbox: src.bbox };
        let view = self.store.snapshot_view(&src.id)?;
        let announce = announces_changes(opts.reprocess, wm.as_ref(), &view)?;
        let spill_dir = self.scratch_dir();
        let workers = default_workers();
        let scan_started = std::time::Instant::now();
        let progress = opts.progress.clone().map(|p| move |bytes: u64, features: u64| p.at(features, bytes));
        let progress: Option<&(dyn Fn(u64, u64) + Sync)> = progress.as_ref().map(|f| f as _);
        let (mut scan, digest, size) = match &mut input {
            LayerInput::File(path) => {
                let file = std::fs::File::open(&*path).map_err(|e| IngestError::Read { path: path.clone(), source: e })?;
                scan_digested(file, path, &rules, &view, announce, spill_dir, workers, progress, &self.stop)?
            }
            LayerInput::Staged(layer) => {
                let read = scan_digested(&mut layer.file, &layer.path, &rules, &view, announce, spill_dir, workers, progress, &self.stop)?;
                // The digest the run records is that of the bytes it scanned.
                if read.1 != layer.digest || read.2 != layer.size {
                    return Err(IngestError::Changed(format!(
                        "{} changed between being written ({} bytes, sha256 {}) and read ({} bytes, sha256 {})",
                        layer.path.display(),
                        layer.size,
                        layer.digest,
                        read.2,
                        read.1
                    ))
                    .into());
                }
                read
            }
        };
        // A file not settled before the scan (or replaced since its digest was taken) may
        // still be a version already seen.
        if !opts.reprocess && known_digest.as_ref() != Some(&digest) {
            if let Some(report) = self.settled_by_digest(src, wm.as_ref(), meta.as_ref(), &holds, &digest, &fingerprint, started)? {
                return Ok(report);
            }
        }
        drop(view);
        // A layer that came in one page cannot have shifted between pages (a staged one may
        // have: its meta is the one staged with it).
        let withheld = paged && !scan.removed.is_empty() && meta.as_ref().is_none_or(|m| m.pages != 1) && self.confirm_removals(src, &rules, announce, &mut scan, started)?;
        drop(input);
        let first_ingest = wm.is_none() && scan.previous_parcels == 0;

        let now = self.now();
        // A publisher timestamp that went backwards is a restatement: the gate holds it.
        // One from the future (a publisher's clock or data error) is not evidence either way.
        // Not the bytes of a read whose removals were withheld, though: the same content,
        // which is identical by any timestamp (invariant 11), read again to make them (found
        // by a reviewer: a replica's older timestamp held an unchanged layer for an operator).
        let same_as_withheld = wm.as_ref().is_some_and(|w| w.withheld() && Watermark::bytes_digest(&w.digest) == digest);
        let restated = if opts.reprocess || same_as_withheld { None } else { meta.as_ref().and_then(|m| portal::restated(wm.as_ref(), m, now)) };
        scan.warnings.extend(meta.as_ref().and_then(|m| portal::future_timestamp_warning(wm.as_ref(), m, now)));
        let decision = decide(GateInput {
            first_ingest,
            reprocess: opts.reprocess,
            previous_parcels: scan.previous_parcels,
            changed: scan.changes,
            silent: crate::detect::gate::Silent::None,
            area: None,
            unreadable_stored: scan.unreadable_known,
            features: scan.features,
            systemic_quarantined: scan.systemic,
            max_change_ratio: src.max_change_ratio,
            restated,
        });
        let mut watermark = Watermark::for_read(&digest, size, now, wm.as_ref(), fingerprint);
        if let Some(m) = &meta {
            watermark.publisher_ts_ms = m.publisher_ts_ms;
            if same_as_withheld {
                // An older timestamp for the same bytes (a replica's) does not move the
                // watermark's back: a restatement after it would then pass (found by a reviewer).
                watermark.publisher_ts_ms = m.publisher_ts_ms.max(wm.as_ref().and_then(|w| w.publisher_ts_ms));
            }
            watermark.etag = m.etag.clone();
            watermark.last_modified = m.last_modified.clone();
            watermark.schema_hash = m.schema_hash.clone();
        }
        if withheld {
            // This read is not all committed (removals were withheld): nothing may settle
            // the next run by it. Neither its digest (a byte-identical read would be
            // `identical`, and a real removal whose confirming read was the stale one would
            // wait for the layer's next change) nor a probe saying nothing moved
            // (`Watermark::probe_ts` is None for it). The digest is kept with a mark no
            // read's digest has (the run's lineage id still shows it); the publisher
            // timestamp is kept, so a restatement after it is still held.
            watermark.digest.push_str(Watermark::WITHHELD_MARK);
        }
        let (mode, hold_reason) = commit_mode(decision, opts.reprocess);
        let scan_ms = scan_started.elapsed().as_millis() as u64;
        let commit_started = std::time::Instant::now();
        let record = self.commit_scan(src, scan, mode, watermark, started, now)?;
        tracing::debug!(source = %src.id, scan_ms, commit_ms = commit_started.elapsed().as_millis() as u64, "run timing");
        tracing::info!(source = %src.id, run = record.run_id, verdict = %record.verdict, changes = record.counts.changes, queued = record.counts.queued, "run committed");
        Ok(SourceReport { record, hold_reason })
    }

    /// Reads a paged layer again and keeps only the removals that read confirms. A layer
    /// paged by offset (OGC API `next` links, Socrata, ArcGIS without a usable id order) and
    /// edited between two page requests skips a feature: after a deletion on an earlier
    /// page every later page starts one feature further on. A count that still adds up (a
    /// feature added meanwhile) or none at all (`numberMatched` is optional) cannot tell, and
    /// the skipped parcel would be announced `removed` while it is still there. A parcel
    /// missing from both reads is removed; one the second read finds is kept as stored, with
    /// a warning, and the next run reads it: the watermark of a read whose removals were
    /// withheld keeps its digest only with a mark no read's digest has, and says nothing a
    /// probe could take as "not moved" (its publisher timestamp is kept, for the restatement
    /// rule), so that run is neither settled as identical nor skipped by a probe, whichever of
    /// the two reads was the stale one.
    /// Returns whether any removal was withheld. A second read that fails fails the run: nothing is
    /// committed, and the next run tries again (`--from-staging` too: its removals are
    /// confirmed against the portal, and wait for it when it does not answer).
    /// The snapshot is read afresh once the layer is fetched (no read transaction is held
    /// through the fetch, which would keep redb from reusing pages meanwhile); it is the one
    /// the first scan read, since only this run commits this source.
    fn confirm_removals(&self, src: &SourceConfig, rules: &NormalizeRules, announce: bool, scan: &mut ScanResult, started: u64) -> Result<bool, PipelineError> {
        let missing = scan.removed.len();
        let again = portal::fetch(src, &self.config.ingest, None, started, true, self.store.path(), self.scratch_dir(), &self.stop, None).map_err(|e| {
            if matches!(e, crate::ingest::http::FetchError::Stopped) {
                return IngestError::Stopped;
            }
            IngestError::Changed(format!("{missing} parcel(s) were missing from the layer, and reading it again to confirm their removal failed: {e}"))
        })?;
        let Some(PortalFetch::Layer { body: LayerBody::Features(spool), .. }) = again else {
            return Err(IngestError::Changed(format!("{missing} parcel(s) were missing from the layer, and the portal did not answer with the layer when it was read again to confirm their removal")).into());
        };
        let dir = self.scratch_dir();
        let write_err = |e: std::io::Error| IngestError::write(dir, e);
        let mut file = tempfile::tempfile_in(dir).map_err(write_err)?;
        {
            let mut out = std::io::BufWriter::new(&mut file);
            spool.write_collection(&mut out).map_err(write_err)?;
            std::io::Write::flush(&mut out).map_err(write_err)?;
        }
        std::io::Seek::rewind(&mut file).map_err(write_err)?;
        let view = self.store.snapshot_view(&src.id)?;
        let (second, _, _) = scan_digested(file, dir, rules, &view, announce, dir, default_workers(), None, &self.stop)?;
        let gone: std::collections::HashSet<&str> = second.removed.iter().map(|(id, _)| id.as_str()).collect();
        let mut seen_again: Vec<String> = Vec::new();
        scan.removed.retain(|(id, _)| {
            let confirmed = gone.contains(id.as_str());
            if !confirmed {
                seen_again.push(id.clone());
            }
            confirmed
        });
        if !seen_again.is_empty() {
            scan.changes = scan.changes.saturating_sub(seen_again.len() as u64);
            seen_again.sort();
            let shown: Vec<&str> = seen_again.iter().take(5).map(String::as_str).collect();
            let more = if seen_again.len() > shown.len() { format!(" and {} more", seen_again.len() - shown.len()) } else { String::new() };
            let warning = format!(
                "the layer changed while it was paged: {} of {missing} parcel(s) missing from this read were there when it was read again ({}{more}); they are not taken for removed, and the next run reads them",
                seen_again.len(),
                shown.join(", ")
            );
            tracing::warn!(source = %src.id, "{warning}");
            scan.warnings.push(warning);
        }
        Ok(!seen_again.is_empty())
    }

    /// Settles a run by the digest of its bytes alone, when they are the version the
    /// watermark describes (identical: only the consumed time moves) or the version an open
    /// hold is holding (still held: noted, nothing else changes). `None`: go on with the run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn settled_by_digest(
        &self,
        src: &SourceConfig,
        wm: Option<&Watermark>,
        meta: Option<&PortalMeta>,
        holds: &[Hold],
        digest: &str,
        fingerprint: &str,
        started: u64,
    ) -> Result<Option<SourceReport>, PipelineError> {
        if let Some(w) = wm {
            if w.digest == digest && w.read_fingerprint == fingerprint {
                let record = match meta {
                    None => self.store.commit_identical(&src.id, started, self.now(), 0)?,
                    Some(m) => {
                        let warnings = portal::stale(wm, started, src.stale_after).into_iter().collect();
                        self.store.commit_unchanged(&src.id, started, self.now(), UnchangedRun { verdict: Verdict::Identical, signals: &portal_signals(m), features_hint: 0, warnings })?
                    }
                };
                return Ok(Some(SourceReport { record, hold_reason: None }));
            }
        }
        self.still_held(src, holds, digest, fingerprint, started)
    }

    /// When an open hold of `src` holds exactly these bytes read this way (`digest`,
    /// `fingerprint`), records the run as still held (nothing else changes) and reports it.
    /// `None`: no such hold.
    fn still_held(&self, src: &SourceConfig, holds: &[Hold], digest: &str, fingerprint: &str, started: u64) -> Result<Option<SourceReport>, PipelineError> {
        let open_same = holds.iter().find(|h| {
            // A held read whose removals were withheld is the same read (a reviewer found each
            // poll superseding it with a new hold).
            let held = Watermark::bytes_digest(&h.digest);
            h.source_id == src.id && h.state == HoldState::Open && held == digest && h.watermark.read_fingerprint == fingerprint
        });
        let Some(h) = open_same else { return Ok(None) };
        let record = self.store.record_run_note(&src.id, started, self.now(), RunNote { verdict: Verdict::Held, digest, hold_id: Some(h.run_id), error: None })?;
        Ok(Some(SourceReport { record, hold_reason: Some(format!("still held: {}", h.reason)) }))
    }
}
