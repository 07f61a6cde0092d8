//! One pass over one source: fetch → digest → decide → parse and normalise → diff → gate →
//! match → rank → one store commit. Synchronous and CPU-bound; `serve` runs it on a blocking
//! thread. Also resolves holds (release / prime) through the same commit path.

use crate::config::{Config, SourceConfig};
use crate::detect::diff::{diff, RawChange};
use crate::detect::gate::{decide, GateDecision, GateInput};
use crate::detect::severity;
use crate::ingest::normalize::{normalize_feature, NormalizeRules};
use crate::ingest::portal::{self, PortalFetch, PortalMeta};
use crate::ingest::{geojson, source, staging, IngestError};
use crate::model::*;
use crate::notify::aoi::{load_aoi, AoiError};
use crate::notify::idem;
use crate::notify::matcher::{Subscriber, SubscriberIndex};
use crate::store::{Claim, CommitMode, PortalSignals, QuarantineDraft, RunCommit, Store, StoreError};
use crate::util::now_ms;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Errors of a pipeline run.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Ingest(#[from] IngestError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Aoi(#[from] AoiError),
    #[error("unknown source {0:?}")]
    UnknownSource(String),
    #[error("hold {0} does not exist")]
    UnknownHold(u64),
    #[error("hold {id} is {state}, not open")]
    HoldNotOpen { id: u64, state: String },
    #[error("source {source_id:?} derives zoning onto parcel source {base:?}, which has not been ingested yet: run {base:?} first")]
    BaseNotIngested { source_id: String, base: String },
    #[error("source {0:?}: {1}")]
    Derived(String, String),
}

/// Options for one run.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Update the snapshot and prime keys without sending anything.
    pub reprocess: bool,
}

/// What a run did, for the per-source line `run` prints.
#[derive(Debug, Clone)]
pub struct SourceReport {
    pub record: RunRecord,
    pub hold_reason: Option<String>,
}

impl SourceReport {
    /// `cambridge-zoning: run features=2000 changes=6 queued=4 duplicates=0 quarantined=0 holds=0`
    pub fn line(&self) -> String {
        let r = &self.record;
        let c = &r.counts;
        let mut s = format!(
            "{}: {} features={} changes={} queued={} duplicates={} quarantined={} holds={}",
            r.source_id,
            r.verdict,
            c.features,
            c.changes,
            c.queued,
            c.duplicates,
            c.quarantined,
            u8::from(r.hold_id.is_some() && r.verdict == Verdict::Held)
        );
        if let (Some(h), Some(reason)) = (r.hold_id, &self.hold_reason) {
            s.push_str(&format!(" hold={h} reason={reason:?}"));
        }
        if let Some(e) = &r.error {
            s.push_str(&format!(" error={e:?}"));
        }
        for w in &r.warnings {
            s.push_str(&format!(" warning={w:?}"));
        }
        s
    }
}

/// The configured system: config, store and subscriber index.
pub struct Engine {
    pub config: Config,
    pub store: Arc<Store>,
    pub subscribers: Arc<SubscriberIndex>,
}

/// Loads every subscriber's AOI and builds the index.
pub fn load_subscribers(config: &Config) -> Result<SubscriberIndex, AoiError> {
    Ok(SubscriberIndex::build(config_subscribers(config)?))
}

fn config_subscribers(config: &Config) -> Result<Vec<Subscriber>, AoiError> {
    let mut subs = Vec::with_capacity(config.subscribers.len());
    for s in &config.subscribers {
        subs.push(Subscriber::from_config(s, load_aoi(&s.aoi_path)?));
    }
    Ok(subs)
}

/// Subscribers from the store (managed over the control port). One with an AOI that no longer
/// parses is skipped with an error log rather than taking every other subscriber down.
fn stored_subscribers(store: &Store, config: &Config) -> Result<Vec<Subscriber>, StoreError> {
    let mut out = Vec::new();
    for s in store.stored_subscribers()? {
        if config.subscribers.iter().any(|c| c.id == s.id) {
            continue; // the config file wins
        }
        match crate::notify::aoi::parse_aoi(&s.aoi_geojson) {
            Ok(aoi) => out.push(Subscriber {
                id: s.id,
                target: s.target,
                secret: s.secret,
                secret_old: None,
                min_severity: s.min_severity,
                aoi,
            }),
            Err(e) => tracing::error!(subscriber = %s.id, "stored AOI no longer valid, subscriber skipped: {e}"),
        }
    }
    Ok(out)
}

/// How the store commits a run the gate decided on, and the hold reason if it is held.
pub(crate) fn commit_mode(decision: GateDecision) -> (CommitMode, Option<String>) {
    match decision {
        GateDecision::Baseline => (CommitMode::Baseline, None),
        GateDecision::Deliver => (CommitMode::Deliver, None),
        GateDecision::Reprocess => (CommitMode::Reprocess, None),
        GateDecision::Hold(reason) => (CommitMode::Hold { reason: reason.clone() }, Some(reason)),
    }
}

/// Parsed layer: the parcels, what was quarantined, and counts.
struct ParsedLayer {
    parcels: Vec<Parcel>,
    quarantine: Vec<QuarantineDraft>,
    features: u64,
    repaired: u64,
    /// Run-record warnings (fields matched case-insensitively).
    warnings: Vec<String>,
}

fn portal_signals(m: &PortalMeta) -> PortalSignals {
    PortalSignals {
        publisher_ts_ms: m.publisher_ts_ms,
        etag: m.etag.clone(),
        last_modified: m.last_modified.clone(),
        schema_hash: m.schema_hash.clone(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn parse_layer(bytes: &[u8], src: &SourceConfig) -> Result<ParsedLayer, IngestError> {
    let rules = NormalizeRules { fields: &src.fields, bbox: src.bbox };
    let mut parcels: Vec<Parcel> = Vec::new();
    let mut quarantine = Vec::new();
    let mut repaired = 0;
    let mut raw_of: HashMap<String, (u64, String)> = HashMap::new();
    let mut folded: Vec<(String, String)> = Vec::new();
    let features = geojson::for_each_feature(bytes, |f| match normalize_feature(f.json, &rules) {
        Ok(n) => {
            repaired += u64::from(n.repaired);
            for f in n.folded_fields {
                if !folded.contains(&f) {
                    folded.push(f);
                }
            }
            raw_of.insert(n.parcel.id.clone(), (f.index, String::new()));
            parcels.push(n.parcel);
        }
        Err(rej) => quarantine.push(QuarantineDraft {
            feature_index: f.index,
            parcel_id: rej.parcel_id,
            reason: rej.reason,
            detail: rej.detail,
            raw: truncate(f.json, 16 * 1024),
        }),
    })?;
    // Duplicate ids: quarantine every copy, never guess which one is right.
    let mut count: HashMap<&str, u32> = HashMap::new();
    for p in &parcels {
        *count.entry(p.id.as_str()).or_default() += 1;
    }
    let dup: HashSet<String> = count.into_iter().filter(|(_, n)| *n > 1).map(|(id, _)| id.to_string()).collect();
    if !dup.is_empty() {
        let (bad, good): (Vec<Parcel>, Vec<Parcel>) = parcels.into_iter().partition(|p| dup.contains(&p.id));
        parcels = good;
        for p in bad {
            quarantine.push(QuarantineDraft {
                feature_index: raw_of.get(&p.id).map(|r| r.0).unwrap_or(0),
                parcel_id: Some(p.id.clone()),
                reason: QuarantineReason::DuplicateId,
                detail: format!("parcel id {:?} appears more than once in this layer", p.id),
                raw: serde_json::json!({"zoning": p.state.zoning, "geometry": p.geometry.to_geojson()}).to_string(),
            });
        }
    }
    let warnings = folded
        .iter()
        .map(|(want, got)| format!("field {want:?} is absent; matched {got:?} case-insensitively"))
        .collect();
    Ok(ParsedLayer { parcels, quarantine, features, repaired, warnings })
}

impl Engine {
    /// Opens the store and loads the subscribers of `config`.
    pub fn open(config: Config) -> Result<Engine, PipelineError> {
        let mut subs = config_subscribers(&config)?;
        let store = Arc::new(Store::open(&config.store_path)?);
        subs.extend(stored_subscribers(&store, &config)?);
        let subscribers = Arc::new(SubscriberIndex::build(subs));
        Ok(Engine { config, store, subscribers })
    }

    /// Rebuilds the subscriber index from the config and the store (after an edit over the
    /// control port). The new index is built aside and swapped in; ingest is never blocked.
    pub fn reload_subscribers(&self) -> Result<usize, PipelineError> {
        let mut subs = config_subscribers(&self.config)?;
        subs.extend(stored_subscribers(&self.store, &self.config)?);
        let n = subs.len();
        self.subscribers.replace(subs);
        Ok(n)
    }

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
    /// source's last HTTP fetch (digest re-checked) without touching the portal.
    pub fn run_source_from_staging(&self, src: &SourceConfig, opts: RunOptions) -> Result<SourceReport, PipelineError> {
        self.run_source_with(src, opts, true)
    }

    fn run_source_with(&self, src: &SourceConfig, opts: RunOptions, from_staging: bool) -> Result<SourceReport, PipelineError> {
        let started = now_ms();
        // One run per source at a time: a trigger during a run is recorded, not run.
        let Some(_lease) = staging::try_lease(self.store.path(), &src.id) else {
            let record = self.store.record_run_note(&src.id, started, Verdict::SkippedOverlap, "", None, None)?;
            return Ok(SourceReport { record, hold_reason: None });
        };
        match self.run_source_inner(src, opts, started, from_staging) {
            Ok(r) => Ok(r),
            Err(e) => {
                if let Err(note_err) = self.store.record_run_note(&src.id, started, Verdict::Failed, "", None, Some(e.to_string())) {
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
        let fetch = if from_staging {
            let (bytes, m) = staging::load(self.store.path(), &src.id)?;
            Some(PortalFetch::Layer { bytes, meta: m.portal_meta() })
        } else {
            // HTTP kinds: probe, and fetch only when something moved (or the floor is due).
            portal::fetch(src, &self.config.ingest, wm.as_ref(), started, opts.reprocess).map_err(IngestError::from)?
        };
        let (fetched, meta) = match fetch {
            None => (source::fetch(src)?, None),
            Some(PortalFetch::Skip { reason, meta }) => {
                let mut warnings = vec![format!("probe: {reason}")];
                warnings.extend(portal::stale(wm.as_ref(), started, src.stale_after));
                let signals = portal_signals(&meta);
                let record = self.store.commit_unchanged(&src.id, started, now_ms(), Verdict::Skip, &signals, 0, warnings)?;
                return Ok(SourceReport { record, hold_reason: None });
            }
            Some(PortalFetch::Layer { bytes, meta }) => {
                let digest = source::digest(&bytes);
                if !from_staging {
                    if let Err(e) = staging::stage(self.store.path(), &src.id, &bytes, &digest, &meta, started) {
                        tracing::warn!(source = %src.id, "could not stage the payload: {e}");
                    }
                }
                (source::FetchedLayer { digest, bytes }, Some(meta))
            }
        };
        let fingerprint = src.read_fingerprint();
        if !opts.reprocess {
            if let Some(w) = &wm {
                if w.digest == fetched.digest && w.read_fingerprint == fingerprint {
                    let record = match &meta {
                        None => self.store.commit_identical(&src.id, started, now_ms(), 0)?,
                        Some(m) => {
                            let warnings = portal::stale(wm.as_ref(), started, src.stale_after).into_iter().collect();
                            self.store.commit_unchanged(&src.id, started, now_ms(), Verdict::Identical, &portal_signals(m), 0, warnings)?
                        }
                    };
                    return Ok(SourceReport { record, hold_reason: None });
                }
            }
            let open_same = self
                .store
                .holds()?
                .into_iter()
                .find(|h| {
                h.source_id == src.id
                    && h.state == HoldState::Open
                    && h.digest == fetched.digest
                    && h.watermark.read_fingerprint == fingerprint
            });
            if let Some(h) = open_same {
                let record = self.store.record_run_note(&src.id, started, Verdict::Held, &fetched.digest, Some(h.run_id), None)?;
                return Ok(SourceReport { record, hold_reason: Some(format!("still held: {}", h.reason)) });
            }
        }

        let layer = parse_layer(&fetched.bytes, src)?;
        let old = self.store.snapshot_states(&src.id)?;
        let first_ingest = wm.is_none() && old.is_empty();
        let untouchable: HashSet<String> = layer.quarantine.iter().filter_map(|q| q.parcel_id.clone()).collect();
        let systemic = layer.quarantine.iter().filter(|q| q.reason.is_systemic()).count() as u64;
        let parcels_n = layer.parcels.len() as u64;
        let d = diff(&old, layer.parcels, &untouchable);

        let now = now_ms();
        let events = self.build_events(src, &d.changes, &d.upserts, &old, now)?;
        // A publisher timestamp that went backwards is a restatement: the gate holds it.
        let restated = if opts.reprocess { None } else { meta.as_ref().and_then(|m| portal::restated(wm.as_ref(), m)) };
        let decision = decide(GateInput {
            first_ingest,
            reprocess: opts.reprocess,
            previous_parcels: old.len() as u64,
            changed: events.len() as u64,
            features: layer.features,
            systemic_quarantined: systemic,
            max_change_ratio: src.max_change_ratio,
            restated,
        });
        let mut watermark = Watermark::for_read(&fetched.digest, fetched.bytes.len() as u64, now, wm.as_ref(), fingerprint);
        if let Some(m) = &meta {
            watermark.publisher_ts_ms = m.publisher_ts_ms;
            watermark.etag = m.etag.clone();
            watermark.last_modified = m.last_modified.clone();
            watermark.schema_hash = m.schema_hash.clone();
        }
        let (mode, hold_reason) = commit_mode(decision);
        let claims = if matches!(mode, CommitMode::Hold { .. }) { vec![] } else { self.claims_for(&events) };
        let counts = RunCounts {
            features: layer.features,
            parcels: parcels_n,
            quarantined: layer.quarantine.len() as u64,
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
            upserts: d.upserts,
            removals: d.removals,
            events,
            claims,
            quarantine: layer.quarantine,
            counts,
            warnings: layer.warnings,
            idem_ttl_ms: self.config.delivery.idem_ttl.as_millis() as u64,
        })?;
        tracing::info!(source = %src.id, run = record.run_id, verdict = %record.verdict, changes = record.counts.changes, queued = record.counts.queued, "run committed");
        Ok(SourceReport { record, hold_reason })
    }

    /// Attaches geometries and severity to the diff's changes.
    /// `old_states` is the snapshot the diff ran against (already loaded by the caller).
    pub(crate) fn build_events(
        &self,
        src: &SourceConfig,
        changes: &[RawChange],
        upserts: &[Parcel],
        old_states: &HashMap<String, ParcelState>,
        now: u64,
    ) -> Result<Vec<ChangeEvent>, PipelineError> {
        let need_old: Vec<&str> = changes
            .iter()
            .filter(|c| c.kind != ChangeKind::Added)
            .map(|c| c.parcel_id.as_str())
            .collect();
        let mut old_geoms = self.store.parcel_geometries(&src.id, need_old)?;
        let mut events = Vec::with_capacity(changes.len());
        for c in changes {
            let new = c.new_index.and_then(|i| upserts.get(i));
            let area = match new {
                Some(p) => p.state.area_m2,
                None => old_states.get(&c.parcel_id).map(|p| p.area_m2).unwrap_or(0.0),
            };
            let effective_date = match new {
                Some(p) => p.state.effective_date.clone(),
                None => old_states.get(&c.parcel_id).and_then(|p| p.effective_date.clone()),
            };
            events.push(ChangeEvent {
                source_id: src.id.clone(),
                jurisdiction: src.jurisdiction.clone(),
                parcel_id: c.parcel_id.clone(),
                kind: c.kind,
                from: c.from.clone(),
                to: c.to.clone(),
                effective_date,
                old_geometry: old_geoms.remove(&c.parcel_id),
                new_geometry: new.map(|p| p.geometry.clone()),
                area_m2: area,
                observed_at_ms: now,
                severity: severity::rank(c.kind, c.from.as_deref(), c.to.as_deref(), area, &src.severity),
            });
        }
        Ok(events)
    }

    /// Matches events against the current subscribers.
    pub fn claims_for(&self, events: &[ChangeEvent]) -> Vec<Claim> {
        let mut claims = Vec::new();
        let matched = self.subscribers.match_batch(events);
        for ((i, e), subs) in events.iter().enumerate().zip(matched) {
            for sub in subs {
                claims.push(Claim {
                    event: i,
                    watcher_id: sub.id.clone(),
                    target: sub.target.clone(),
                    min_severity: sub.min_severity,
                    key: idem::key_for(&sub.id, e),
                });
            }
        }
        claims
    }

    /// Releases (`prime = false`: deliver) or primes (accept silently) an open hold.
    pub fn resolve_hold(&self, hold_id: u64, prime: bool) -> Result<RunRecord, PipelineError> {
        let hold = self.store.hold(hold_id)?.ok_or(PipelineError::UnknownHold(hold_id))?;
        if hold.state != HoldState::Open {
            return Err(PipelineError::HoldNotOpen { id: hold_id, state: hold.state.label().to_string() });
        }
        let (upserts, removals, events) = self.store.held_delta(hold_id)?;
        let shares = self.store.held_shares(hold_id)?;
        let claims = self.claims_for(&events);
        let now = now_ms();
        let mut watermark = hold.watermark.clone();
        watermark.consumed_at_ms = now;
        let counts = RunCounts { features: hold.features, parcels: 0, changes: events.len() as u64, ..Default::default() };
        let record = self.store.commit_run_with(RunCommit {
            source_id: hold.source_id.clone(),
            started_ms: now,
            now_ms: now,
            mode: CommitMode::ResolveHold { hold_id, prime },
            watermark,
            upserts,
            removals,
            events,
            claims,
            quarantine: vec![],
            counts,
            warnings: vec![format!("resolves hold {hold_id} ({})", if prime { "primed" } else { "released" })],
            idem_ttl_ms: self.config.delivery.idem_ttl.as_millis() as u64,
        }, &shares)?;
        Ok(record)
    }
}
