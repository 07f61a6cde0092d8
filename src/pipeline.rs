//! One pass over one source: fetch → digest → decide → parse and normalise → diff → gate →
//! match → rank → one store commit. Synchronous and CPU-bound; `serve` runs it on a blocking
//! thread. Also resolves holds (release / prime): the hold's staged delta is streamed from
//! the store into one `RunWriter` transaction, as a run's delta is from its spill.

use crate::config::{Config, LayerKind, SourceConfig, SourceKind};
use crate::detect::diff::{classify, step, ParcelDelta, Prior, RawChange};
use crate::detect::row_sort::RowSorter;
use crate::detect::spill::{SpillEntry, SpillError, SpilledParcel};
use crate::detect::stream::{default_workers, scan_layer, ScanError, ScanResult};
use crate::detect::gate::{decide, GateDecision, GateInput};
use crate::detect::severity;
use crate::ingest::normalize::NormalizeRules;
use crate::ingest::portal::{self, LayerBody, PortalFetch, PortalMeta};
use crate::ingest::{source, staging, IngestError};
use crate::model::*;
use crate::notify::aoi::{load_aoi_noted, AoiError};
use crate::notify::idem;
use crate::notify::matcher::{PinnedIndex, Subscriber, SubscriberIndex};
use crate::store::{Claim, CommitMode, HeldChunk, PortalSignals, QuarantineDraft, RunNote, RunWriter, SnapshotRow, Store, StoreError, UnchangedRun};
use crate::clock::SharedClock;
use std::collections::HashMap;
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
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Delta(#[from] crate::detect::derived_delta::DeltaError),
}

impl PipelineError {
    /// The run was abandoned before its commit because a stop was requested (`run_stop.rs`):
    /// not a failure of the source.
    pub fn is_stopped(&self) -> bool {
        matches!(self, PipelineError::Ingest(IngestError::Stopped | IngestError::Fetch(crate::ingest::http::FetchError::Stopped)))
    }
}

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
fn scan_digested<R: std::io::Read + Send>(
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

/// Options for one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Update the snapshot and prime keys without sending anything.
    pub reprocess: bool,
    /// Progress of this run for the operator (`zonewatch run`); `None` reports nothing.
    pub progress: Option<std::sync::Arc<crate::progress::IngestProgress>>,
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
            // Why a probe skipped the fetch (a 304, the same ETag) is how a quiet poll goes,
            // not a warning: a tester's grep of the journal for "warning" found one a poll.
            match w.strip_prefix("probe: ") {
                Some(why) => s.push_str(&format!(" probe={why:?}")),
                None => s.push_str(&format!(" warning={w:?}")),
            }
        }
        s
    }
}

/// The configured system: config, store and subscriber index.
pub struct Engine {
    pub config: Config,
    pub store: Arc<Store>,
    pub subscribers: Arc<SubscriberIndex>,
    /// Where every timestamp of a run comes from (see `clock.rs`): the system clock in
    /// production, a manual one in tests.
    pub clock: SharedClock,
    /// Asked by a graceful stop: a fetch or a scan under way is abandoned before its commit
    /// (`run_stop.rs`).
    pub stop: crate::run_stop::RunStop,
    /// (subscriber id, what its repair did) for each config AOI whose rings were not a valid
    /// polygon, matched as repaired: `run` and `serve` warn of them at every start, not only
    /// `check` (a black-box tester's AOI whose hole held its whole ring became the hole less
    /// the ring, in silence).
    pub aoi_repairs: AoiRepairs,
}

/// Loads every subscriber's AOI and builds the index.
pub fn load_subscribers(config: &Config) -> Result<SubscriberIndex, AoiError> {
    Ok(SubscriberIndex::build(config_subscribers(config)?.0))
}

/// (subscriber id, what the repair of its AOI did): [`Engine::aoi_repairs`].
type AoiRepairs = Vec<(String, String)>;

/// The config's subscribers, with what was repaired of their AOIs.
fn config_subscribers(config: &Config) -> Result<(Vec<Subscriber>, AoiRepairs), AoiError> {
    let mut subs = Vec::with_capacity(config.subscribers.len());
    let mut repairs = Vec::new();
    for s in &config.subscribers {
        let (aoi, repair_note) = load_aoi_noted(&s.aoi_path)?;
        if let Some(note) = repair_note {
            repairs.push((s.id.clone(), format!("AOI {}: {note}", s.aoi_path.display())));
        }
        subs.push(Subscriber::from_config(s, aoi));
    }
    Ok((subs, repairs))
}

/// Subscribers from the store (managed over the control port), except those a config
/// subscriber of the same id replaces (the config file wins). One with an AOI that no longer
/// parses matches nothing (an error log says so) but stays a subscriber: delivery still
/// sends its queued events to its target, signed, instead of dead-lettering them as gone.
fn stored_subscribers(stored: Vec<crate::store::StoredSubscriber>, config: &Config) -> Vec<Subscriber> {
    let mut out = Vec::new();
    for s in stored {
        if config.has_subscriber(&s.id) {
            continue; // the config file wins (warned at open: `shadowed_subscribers`)
        }
        let aoi = match crate::notify::aoi::parse_aoi(&s.aoi_geojson) {
            Ok(aoi) => aoi,
            Err(e) => {
                tracing::error!(subscriber = %s.id, "stored AOI no longer valid, the subscriber matches nothing until it is replaced: {e}");
                geo::MultiPolygon(vec![])
            }
        };
        out.push(Subscriber { id: s.id, target: s.target, secret: s.secret, secret_old: s.secret_old, min_severity: s.min_severity, aoi });
    }
    out
}

/// Ids of subscribers created over the control port that a config subscriber of the same id
/// hides: the config's definition is used, the stored one is neither matched nor deletable
/// (`managed_by_config`) until one of the two is renamed. Said at every start, and by
/// `zonewatch check --store`, because nothing else would.
pub fn shadowed_subscribers(config: &Config, stored_ids: impl IntoIterator<Item = String>) -> Vec<String> {
    stored_ids.into_iter().filter(|id| config.has_subscriber(id)).collect()
}

/// Who defines a subscriber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManagedBy {
    /// A `[[subscriber]]` of the config file.
    Config,
    /// Created over the control port, kept in the store.
    Api,
}

impl ManagedBy {
    /// As the control port's `managed_by` field spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ManagedBy::Config => "config",
            ManagedBy::Api => "api",
        }
    }
}

/// One subscriber's endpoint as operators see it (`zonewatch endpoints list`,
/// `GET /v1/endpoints`): config and API subscribers alike.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointListing {
    pub id: String,
    pub managed_by: ManagedBy,
    pub target: String,
    /// Its recorded health (the default when it has none: enabled, breaker closed).
    pub state: crate::model::EndpointState,
}

impl EndpointListing {
    /// `enabled` or `disabled`, as `endpoints list` prints it.
    pub fn state_str(&self) -> &'static str {
        if self.state.disabled {
            "disabled"
        } else {
            "enabled"
        }
    }

    /// The circuit breaker at `now_ms`: `closed`, `open` (cooling down) or `half_open` (its
    /// probe may go).
    pub fn breaker_str(&self, now_ms: u64) -> &'static str {
        match self.state.breaker_open_until_ms {
            Some(t) if t > now_ms => "open",
            Some(_) => "half_open",
            None => "closed",
        }
    }
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
    /// Opens the store and loads the subscribers of `config`.
    pub fn open(config: Config) -> Result<Engine, PipelineError> {
        Engine::open_with_clock(config, crate::clock::system())
    }

    /// Like [`Engine::open`], for the commands that only read or steer what runs wrote: the
    /// store must exist already (see [`Store::require_existing`]).
    pub fn open_existing(config: Config) -> Result<Engine, PipelineError> {
        Store::require_existing(&config.store_path)?;
        Engine::open(config)
    }

    /// Like [`Engine::open`], with time taken from `clock` (tests pass a manual clock).
    pub fn open_with_clock(config: Config, clock: SharedClock) -> Result<Engine, PipelineError> {
        let (mut subs, aoi_repairs) = config_subscribers(&config)?;
        let store = Arc::new(Store::open_with_cache(&config.store_path, config.store_cache_mib << 20)?);
        // The store's lock is held: no run of any process is staging now.
        crate::ingest::staging::sweep_leftovers(&config.store_path);
        crate::store::backup::sweep_restore_leftovers(&config.store_path, std::time::SystemTime::now());
        let stored = store.stored_subscribers()?;
        for id in shadowed_subscribers(&config, stored.iter().map(|s| s.id.clone())) {
            tracing::warn!(
                subscriber = %id,
                "subscriber {id:?} of the config file replaces the one of the same id created over the control port: the stored definition is not used (rename one of them)"
            );
        }
        subs.extend(stored_subscribers(stored, &config));
        // A config subscriber whose target was changed after its endpoint was disabled (a
        // 410 from the old URL) is enabled, as a control port `PUT` of a new target is.
        let targets: Vec<(&str, &str)> = config.subscribers.iter().map(|s| (s.id.as_str(), s.target.as_str())).collect();
        if let Err(e) = store.enable_moved_endpoints(&targets, clock.now_ms()) {
            tracing::warn!("could not enable the endpoints whose target changed in the config: {e} (zonewatch endpoints enable ID does it)");
        }
        let subscribers = Arc::new(SubscriberIndex::build(subs));
        // A first look at the clock, so that a step forward during a `run`'s ingest is seen by
        // its delivery (`store::clock_forward`).
        store.watch_clock(clock.now_ms(), clock.mono_ms());
        Ok(Engine { config, store, subscribers, clock, stop: Default::default(), aoi_repairs })
    }

    /// Who defines subscriber `id`, if anyone (the config first: it wins over the store).
    pub fn subscriber_managed_by(&self, id: &str) -> Result<Option<ManagedBy>, PipelineError> {
        if self.config.has_subscriber(id) {
            return Ok(Some(ManagedBy::Config));
        }
        Ok(self.store.stored_subscriber(id)?.map(|_| ManagedBy::Api))
    }

    /// Every subscriber's endpoint with its health: the config's in config order, then the
    /// store's (control port) by id, each id once (a config subscriber hides a stored one).
    pub fn endpoint_listing(&self) -> Result<Vec<EndpointListing>, PipelineError> {
        let mut states: std::collections::HashMap<String, crate::model::EndpointState> = self.store.endpoints()?.into_iter().collect();
        let mut out: Vec<EndpointListing> = self
            .config
            .subscribers
            .iter()
            .map(|c| EndpointListing { id: c.id.clone(), managed_by: ManagedBy::Config, target: c.target.clone(), state: states.remove(&c.id).unwrap_or_default() })
            .collect();
        for s in self.store.stored_subscribers()? {
            if self.config.has_subscriber(&s.id) {
                continue;
            }
            let state = states.remove(&s.id).unwrap_or_default();
            out.push(EndpointListing { id: s.id, managed_by: ManagedBy::Api, target: s.target, state });
        }
        Ok(out)
    }

    /// Now, in milliseconds since the epoch, by the engine's clock.
    pub fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Looks at the clock for a step forward and stores the steps not stored yet
    /// (`store::clock_forward`): `serve` every few seconds and as it stops, `run` as it ends,
    /// so that a step seen is not lost with the process when no delivery outcome follows it
    /// (bb29: a `serve` stopped before its next pass, up to a minute when idle, forgot it, and
    /// the next start dead-lettered the alerts queued before it). Blocking (a durable commit
    /// when there is something to store).
    pub fn settle_clock_watch(&self) {
        crate::notify::delivery::now_watched(&self.clock, &self.store);
        crate::notify::delivery::save_forward_steps(&self.store);
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

    /// Commits a scanned layer in one write transaction, fed in chunks: a second thread
    /// ([`Engine::prepare_chunks`]) reads the spill back, copies off it the snapshot rows,
    /// counts the events that cannot match anyone and builds and matches the others it can;
    /// this thread reads the stored geometries the other events need, updates the snapshot
    /// (or the hold's staging) and writes the claims, then the removals, then finishes.
    fn commit_scan(
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

    /// Where a run's scratch files go (the spill, the row sort's runs): next to the store,
    /// on its disk and with its permissions.
    pub(crate) fn scratch_dir(&self) -> &std::path::Path {
        crate::util::folder_of(self.store.path())
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

    /// One change event with its geometries and severity (the change's parts move into it).
    #[allow(clippy::too_many_arguments)]
    fn change_event(
        &self,
        src: &SourceConfig,
        c: RawChange,
        new_geometry: Option<StoredGeometry>,
        old_geometry: Option<StoredGeometry>,
        area_m2: f64,
        effective_date: Option<String>,
        now: u64,
    ) -> ChangeEvent {
        let severity = severity::rank(c.kind, c.from.as_deref(), c.to.as_deref(), area_m2, &src.severity);
        let revision = c.revision;
        ChangeEvent {
            source_id: src.id.clone(),
            jurisdiction: src.jurisdiction.clone(),
            parcel_id: c.parcel_id,
            kind: c.kind,
            from: c.from,
            to: c.to,
            effective_date,
            old_geometry,
            new_geometry,
            area_m2,
            observed_at_ms: now,
            severity,
            revision,
        }
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
            let old = old_geoms.remove(&c.parcel_id);
            events.push(self.change_event(src, c.clone(), new.map(|p| p.geometry.clone()), old, area, effective_date, now));
        }
        Ok(events)
    }

    /// Matches events against the current subscribers.
    pub fn claims_for(&self, events: &[ChangeEvent]) -> Vec<Claim> {
        self.claims_with(&self.subscribers.pinned(), events)
    }

    /// [`Engine::claims_for`], against a subscriber set already held.
    fn claims_with(&self, index: &PinnedIndex, events: &[ChangeEvent]) -> Vec<Claim> {
        let mut claims = Vec::new();
        let scope = self.store.key_scope();
        let matched = index.match_batch(events);
        for ((i, e), subs) in events.iter().enumerate().zip(matched) {
            for sub in subs {
                claims.push(Claim {
                    event: i,
                    watcher_id: sub.id.clone(),
                    target: sub.target.clone(),
                    min_severity: sub.min_severity,
                    key: idem::key_in(&sub.id, e, scope.for_source(&e.source_id)),
                });
            }
        }
        claims
    }

    /// Releases (`prime = false`: deliver) or primes (accept silently) an open hold.
    ///
    /// A hold of a source that has no watermark is its held first ingest (any run that
    /// commits writes one, and supersedes open holds): a baseline sends nothing, so its
    /// release primes, and the run record says so. So does a hold of a `--reprocess`
    /// (`Hold::reprocess`): the operator ran it to send nothing, and the gate held it only
    /// because of what it read (an empty layer, a quarantine spike). (The store checks again,
    /// inside the release's transaction, that the hold is still open.)
    pub fn resolve_hold(&self, hold_id: u64, prime: bool) -> Result<RunRecord, PipelineError> {
        let hold = self.store.hold(hold_id)?.ok_or(PipelineError::UnknownHold(hold_id))?;
        if hold.state != HoldState::Open {
            return Err(PipelineError::HoldNotOpen { id: hold_id, state: hold.state.label().to_string() });
        }
        let mut notes = vec![format!("resolves hold {hold_id} ({})", if prime { "primed" } else { "released" })];
        let prime = if !prime && self.store.watermark(&hold.source_id)?.is_none() {
            notes.push("the held run was the source's first ingest: a baseline sends nothing, so releasing it primes".to_string());
            true
        } else if !prime && hold.reprocess {
            notes.push("the held run was a --reprocess: it sends nothing, so releasing it primes".to_string());
            true
        } else {
            prime
        };
        // The held run's own counts of what it read: the release reads nothing again.
        // (Only its counts: a record that cannot be read does not stop the release.)
        let held = self.store.run_record(hold.run_id).ok().flatten().map(|r| r.counts).unwrap_or_default();
        let now = self.now();
        let mut watermark = hold.watermark.clone();
        watermark.consumed_at_ms = now;
        let ttl_ms = self.config.delivery.idem_ttl.as_millis() as u64;
        // What the source announces when its run delivers (a source no longer configured is
        // taken as the parcel layer it most likely was).
        let layer = self.config.sources.iter().find(|s| s.id == hold.source_id).map_or(LayerKind::Parcels, |s| s.layer);
        let announces = |stored: Option<&ParcelState>, staged: &ParcelState| {
            let kind = match classify(stored, staged) {
                ParcelDelta::Unchanged => None,
                ParcelDelta::Added => Some(ChangeKind::Added),
                ParcelDelta::Changed(kind) => kind,
            };
            kind.is_some_and(|kind| {
                let change = RawChange { parcel_id: String::new(), kind, from: stored.map(|s| s.zoning.clone()), to: Some(staged.zoning.clone()), new_index: None, revision: 0 };
                crate::derived::announces(layer, &change)
            })
        };
        let mut w = self.store.begin_run(&hold.source_id, CommitMode::ResolveHold { hold_id, prime }, watermark, now, ttl_ms)?;
        // Streamed from the staged tables into the one release transaction, chunk by chunk.
        // `begin_run` has already cleared the hold's staged rows inside that (uncommitted)
        // transaction: `for_each_held` reads its own read snapshot, taken from the last
        // commit, which still holds them. Reading through the writer would see nothing.
        const RELEASE_CHUNK: usize = 4096;
        self.store.for_each_held(hold_id, RELEASE_CHUNK, |chunk| match chunk {
            HeldChunk::Parcels { upserts, removals } => {
                w.upserts_held(upserts.iter().map(Parcel::borrowed), &announces)?;
                w.removals(&removals, layer == LayerKind::Parcels)
            }
            HeldChunk::Events(events) => {
                let claims = self.claims_for(&events);
                w.events(&events, &claims)
            }
            HeldChunk::Shares(shares) => w.shares(&shares),
        })?;
        let counts = RunCounts { features: hold.features, parcels: held.parcels, quarantined: held.quarantined, repaired: held.repaired, ..Default::default() };
        let record = w.finish(now, now, counts, notes)?;
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::spill::Spill;
    use geo::polygon;

    /// An engine over a store in `dir` with one file source, `s1`.
    fn test_engine(dir: &std::path::Path) -> Engine {
        let toml = r#"
[store]
path = "zw.redb"
[[source]]
id = "s1"
jurisdiction = "testville"
kind = "file"
path = "layer.geojson"
[source.fields]
parcel_id = "APN"
zoning = "ZONE_CODE"
"#;
        Engine::open(Config::parse_str(toml, dir).unwrap()).unwrap()
    }

    /// A layer read that fails on its own while a stop is asked meanwhile is that failure,
    /// not a stop (found by a reviewer: a store or disk error was logged as "stopped"); one
    /// the reader refused because of the stop is a stop, also when the refusal comes from the
    /// read past the last feature.
    #[test]
    fn a_scan_is_told_stopped_by_the_readers_refusal_not_by_the_flag() {
        struct FailsAndStops<'a>(&'a crate::run_stop::RunStop);
        impl std::io::Read for FailsAndStops<'_> {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                self.0.request();
                Err(std::io::Error::other("disk on fire"))
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let engine = test_engine(dir.path());
        let view = engine.store.snapshot_view("s1").unwrap();
        let src = engine.config.source("s1").unwrap().clone();
        let rules = NormalizeRules { fields: &src.fields, bbox: None };
        let stop = crate::run_stop::RunStop::default();
        let scan = |r: &mut (dyn std::io::Read + Send), stop: &crate::run_stop::RunStop| scan_digested(r, dir.path(), &rules, &view, false, dir.path(), 1, None, stop).err().unwrap();
        let err = scan(&mut FailsAndStops(&stop), &stop);
        assert!(!err.is_stopped() && err.to_string().contains("disk on fire"), "{err}");

        // Every feature read, then the stop: the read to the end of the bytes is refused.
        struct StopsAtTheEnd<'a>(&'a [u8], &'a crate::run_stop::RunStop);
        impl std::io::Read for StopsAtTheEnd<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.read(buf)?;
                if n == 0 {
                    self.1.request();
                }
                Ok(n)
            }
        }
        let stop = crate::run_stop::RunStop::default();
        let layer = br#"{"type":"FeatureCollection","features":[]}"#;
        let err = scan(&mut StopsAtTheEnd(layer, &stop), &stop);
        assert!(err.is_stopped(), "{err}");
    }

    /// A scan that failed (a broken feature that swallows the next ones fails the layer in a
    /// worker) stops reading the layer: one that never ends is not read to its end first.
    #[test]
    fn a_failed_scan_stops_reading_the_layer() {
        struct Endless {
            head: std::io::Cursor<Vec<u8>>,
            feature: Vec<u8>,
            at: usize,
        }
        impl std::io::Read for Endless {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.head.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                let n = buf.len().min(self.feature.len() - self.at);
                buf[..n].copy_from_slice(&self.feature[self.at..self.at + n]);
                self.at = (self.at + n) % self.feature.len();
                Ok(n)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let engine = test_engine(dir.path());
        let view = engine.store.snapshot_view("s1").unwrap();
        let src = engine.config.source("s1").unwrap().clone();
        let rules = NormalizeRules { fields: &src.fields, bbox: None };
        let feature = r#"{"type":"Feature","properties":{"APN":"A","ZONE_CODE":"R-1"},"geometry":{"type":"Polygon","coordinates":[[[-71.1,42.36],[-71.099,42.36],[-71.099,42.361],[-71.1,42.36]]]}}"#;
        let head = format!(r#"{{"type":"FeatureCollection","features":[{{"type":"Feature","properties":{{"NOTE":{{"b":1]}}}},{feature}}},{feature}"#);
        let reader = Endless { head: std::io::Cursor::new(head.into_bytes()), feature: format!(",{feature}").into_bytes(), at: 0 };
        let err = scan_digested(reader, dir.path(), &rules, &view, false, dir.path(), 2, None, &Default::default()).err().unwrap();
        assert!(err.to_string().contains("holds more than one \"Feature\""), "{err}");
    }

    /// What `scan_layer` would hand the commit for a first ingest whose delta is `spill`.
    fn baseline_scan(spill: Spill, duplicate_ids: std::collections::HashSet<String>) -> ScanResult {
        let parcels = spill.parcels;
        ScanResult {
            spill: spill.finish().unwrap(),
            features: parcels,
            parcels,
            repaired: 0,
            quarantined: 0,
            systemic: 0,
            unreadable_known: 0,
            changes: parcels,
            warnings: vec![],
            duplicate_ids,
            duplicate_drafts: vec![],
            removed: vec![],
            previous_parcels: 0,
        }
    }

    /// Opening an engine sweeps the staging temp files killed runs left — also those of a
    /// source no longer configured — and nothing else.
    #[test]
    fn opening_an_engine_sweeps_staging_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        drop(test_engine(dir.path()));
        let staging = crate::ingest::staging::staging_dir(&dir.path().join("zw.redb"));
        std::fs::create_dir_all(&staging).unwrap();
        for name in ["gone.geojson.a1B2c3.tmp", "s1.geojson", "s1.json"] {
            std::fs::write(staging.join(name), b"x").unwrap();
        }
        let _engine = test_engine(dir.path());
        assert!(!staging.join("gone.geojson.a1B2c3.tmp").exists());
        assert!(staging.join("s1.geojson").exists() && staging.join("s1.json").exists());
    }

    /// A spill that cannot be read back half-way through a commit (five chunks of parcels a
    /// subscriber's AOI covers, so the writer has written their primed keys and audit rows,
    /// then a damaged record): the preparing thread reports the error and stops, the commit
    /// fails whole and leaves no parcel, watermark or audit row behind.
    #[test]
    fn a_spill_read_error_mid_commit_fails_the_run_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut engine = test_engine(dir.path());
        let aoi = geo::MultiPolygon(vec![polygon![(x: -71.01, y: 41.99), (x: -70.99, y: 41.99), (x: -70.99, y: 42.01), (x: -71.01, y: 42.01)]]);
        let sub = Subscriber { id: "w1".into(), target: "http://127.0.0.1:9/hook".into(), secret: None, min_severity: Severity::Info, aoi, secret_old: None };
        engine.subscribers = Arc::new(SubscriberIndex::build(vec![sub]));
        let src = engine.config.sources[0].clone();
        let state = ParcelState { zoning: "R-1".into(), effective_date: None, content_hash: [1; 32], geom_hash: [2; 32], area_m2: 100.0, revision: 0, announced: None };
        let geometry = StoredGeometry(vec![vec![vec![[-71.0, 42.0], [-70.999, 42.0], [-70.999, 42.001], [-71.0, 42.0]]]]);
        let parcels = 5 * COMMIT_CHUNK as u64;
        let scan = |damaged: bool| {
            let mut spill = Spill::create(dir.path()).unwrap();
            for i in 0..parcels {
                let p = SpilledParcel { feature_index: i, key_revision: 0, id: format!("p{i:06}"), state: state.clone(), geometry: geometry.clone(), kind: Some(ChangeKind::Added), from: None };
                spill.push_parcel(p).unwrap();
            }
            if damaged {
                spill.push_damaged_record().unwrap();
            }
            baseline_scan(spill, Default::default())
        };
        let watermark = Watermark { digest: "d".into(), size: 1, ..Default::default() };
        let err = engine.commit_scan(&src, scan(true), CommitMode::Baseline, watermark.clone(), 1, 2).unwrap_err();
        assert!(err.to_string().contains("unknown spill record version"), "{err}");
        assert_eq!(engine.store.watermark("s1").unwrap(), None);
        assert!(engine.store.snapshot_states("s1").unwrap().is_empty(), "no parcel of the failed commit");
        assert!(engine.store.audit(&Default::default()).unwrap().is_empty(), "no audit row of the failed commit");
        // The same spill undamaged commits every parcel with an audit row each (the primed
        // keys): what the failed commit had begun to write and did not keep.
        let record = engine.commit_scan(&src, scan(false), CommitMode::Baseline, watermark, 3, 4).unwrap();
        assert_eq!(record.verdict, Verdict::Baseline);
        assert_eq!(engine.store.snapshot_states("s1").unwrap().len() as u64, parcels);
        let all = engine.store.audit(&Default::default()).unwrap();
        assert_eq!(all.len() as u64, parcels);

        // The ledger walked a page at a time, each way, is the ledger: what the control
        // port's pages read without collecting it.
        let walk = |filter: &crate::store::AuditFilter, desc: bool, before: Option<u64>, limit: usize| {
            let mut page = Vec::new();
            engine.store.audit_walk(filter, desc, before, |r| {
                page.push(r.seq);
                page.len() < limit
            }).unwrap();
            page
        };
        let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
        let (mut up, mut down) = (Vec::new(), Vec::new());
        loop {
            let page = walk(&crate::store::AuditFilter { since_seq: up.last().map(|s: &u64| s + 1), ..Default::default() }, false, None, 777);
            up.extend(&page);
            if page.len() < 777 {
                break;
            }
        }
        loop {
            let page = walk(&Default::default(), true, down.last().copied(), 777);
            down.extend(&page);
            if page.len() < 777 {
                break;
            }
        }
        down.reverse();
        assert_eq!((up.as_slice(), down.as_slice()), (seqs.as_slice(), seqs.as_slice()));
        let one = all[100].parcel_id.clone();
        let only = crate::store::AuditFilter { parcel: one.clone(), ..Default::default() };
        assert_eq!(walk(&only, true, None, 5).len(), 1, "a filter is applied as it walks");
    }

    /// A baseline's rows are copied off the spill, each beside its parcel: every parcel is
    /// stored with its own state and geometry, in chunks in key order and out of it (sorted),
    /// and the copies of a duplicated id, spread over the chunks, are skipped with their rows.
    /// Events are built only for parcels near a subscriber: every new parcel still counts as
    /// a change, and exactly the parcels an AOI touches are primed for it. Then a delivering
    /// run mixing changed and new parcels queues exactly the events an AOI touches.
    #[test]
    fn rows_are_copied_off_the_spill_and_events_built_only_where_they_can_match() {
        let dir = tempfile::tempdir().unwrap();
        let mut engine = test_engine(dir.path());
        // A triangle over part of the layer: its envelope takes in more parcels than it
        // touches, so the exact test decides some.
        // A box over parcels of the shuffled second chunk as well.
        let subscriber = |id: &str, aoi| Subscriber { id: id.into(), target: "http://127.0.0.1:9/hook".into(), secret: None, min_severity: Severity::Info, aoi, secret_old: None };
        let triangle = geo::MultiPolygon(vec![polygon![(x: -70.95, y: 41.99), (x: -70.8, y: 41.99), (x: -70.95, y: 42.01)]]);
        let boxed = geo::MultiPolygon(vec![polygon![(x: -70.55, y: 41.99), (x: -70.5, y: 41.99), (x: -70.5, y: 42.01), (x: -70.55, y: 42.01)]]);
        engine.subscribers = Arc::new(SubscriberIndex::build(vec![subscriber("w1", triangle), subscriber("w2", boxed)]));
        let src = engine.config.sources[0].clone();
        let parcel = |i: u64, id: String| {
            let x = -71.0 + i as f64 * 1e-4;
            SpilledParcel {
                feature_index: i,
                id,
                // A few snapshot-only updates among them: stored, no event.
                kind: (i % 997 != 5).then_some(ChangeKind::Added),
                from: None,
                key_revision: 0,
                state: ParcelState { zoning: format!("Z{i}"), effective_date: i.is_multiple_of(3).then(|| format!("2026-01-{:02}", i % 28 + 1)), content_hash: [i as u8; 32], geom_hash: [2; 32], area_m2: i as f64, revision: 0, announced: None },
                geometry: StoredGeometry(vec![vec![vec![[x, 42.0], [x + 1e-5, 42.0], [x, 42.0 + (i % 7 + 1) as f64 * 1e-5], [x, 42.0]]]]),
            }
        };
        // Chunk one in key order, chunk two shuffled (sorted before it is written), a third
        // partly; "dup" three times, in the first two chunks and the last.
        let n = 3 * COMMIT_CHUNK as u64 - 100;
        let id_of = |i: u64| if i < COMMIT_CHUNK as u64 { format!("p{i:06}") } else { format!("p{:06}", (i * 7_919) % n + n) };
        let mut spill = Spill::create(dir.path()).unwrap();
        let mut want = HashMap::new();
        let mut updates = std::collections::HashSet::new();
        for i in 0..n {
            if [17, COMMIT_CHUNK as u64 + 5, n - 3].contains(&i) {
                spill.push_parcel(parcel(1_000_000 + i, "dup".into())).unwrap();
            }
            let p = parcel(i, id_of(i));
            if p.kind.is_none() {
                updates.insert(p.id.clone());
            }
            want.insert(p.id.clone(), (p.state.clone(), p.geometry.clone()));
            spill.push_parcel(p).unwrap();
        }
        let watermark = Watermark { digest: "d".into(), size: 1, ..Default::default() };
        let scan = baseline_scan(spill, ["dup".to_string()].into_iter().collect());
        let record = engine.commit_scan(&src, scan, CommitMode::Baseline, watermark, 1, 2).unwrap();
        let stored = engine.store.snapshot_parcels("s1").unwrap();
        assert_eq!(stored.len(), want.len(), "every parcel once, no duplicate");
        assert!(!updates.is_empty());
        assert_eq!(record.counts.changes, (want.len() - updates.len()) as u64, "every added parcel is a change, built or counted");
        let mut touched = 0;
        for (id, state, geometry) in stored {
            assert_eq!(want.get(&id), Some(&(state, geometry.clone())), "parcel {id}");
            let matched = engine.subscribers.matching(&[&geometry.to_geo()]).len();
            assert!(matched <= 1, "the AOIs do not overlap");
            // A snapshot-only update has no event to claim.
            touched += if updates.contains(&id) { 0 } else { matched };
        }
        assert!(touched > 200 && touched < want.len() / 2, "the AOIs touch some parcels ({touched})");
        assert_eq!(engine.store.audit(&Default::default()).unwrap().len(), touched, "one primed key per touched parcel");

        // A delivering run whose chunk mixes changed parcels (their events built by the
        // writer, after it reads their stored geometry) with new ones: rezoned parcels moved
        // out of an AOI (matched by their old shape), rezoned ones outside, new ones inside
        // and outside. Every event that touches an AOI by either shape is queued.
        let mut spill = Spill::create(dir.path()).unwrap();
        let mut queued = 0;
        for i in (600..620).chain(7_000..7_010) {
            let mut p = parcel(i, id_of(i));
            let (old, _) = want.get(&p.id).cloned().unwrap();
            if i < 700 {
                p.geometry.0[0][0].iter_mut().for_each(|c| c[0] += 1.0);
            }
            p.kind = Some(ChangeKind::Rezoned);
            p.from = Some(old.zoning);
            p.state.zoning = format!("R{i}");
            let (_, old_geometry) = want.get(&p.id).cloned().unwrap();
            queued += engine.subscribers.matching(&[&old_geometry.to_geo(), &p.geometry.to_geo()]).len();
            spill.push_parcel(p).unwrap();
        }
        for j in 0..40u64 {
            let i = if j % 2 == 0 { 4_600 + j } else { 12_000 + j };
            let p = parcel(i, format!("n{j:03}"));
            queued += engine.subscribers.matching(&[&p.geometry.to_geo()]).len();
            spill.push_parcel(SpilledParcel { kind: Some(ChangeKind::Added), ..p }).unwrap();
        }
        assert!(queued >= 30, "the AOIs touch the run's changes ({queued})");
        let watermark = Watermark { digest: "e".into(), size: 2, ..Default::default() };
        let record = engine.commit_scan(&src, baseline_scan(spill, Default::default()), CommitMode::Deliver, watermark, 3, 4).unwrap();
        assert_eq!(record.counts.changes, 70);
        assert_eq!(record.counts.queued, queued as u64);
    }
}
