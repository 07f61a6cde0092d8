//! One pass over one source: fetch → digest → decide → parse and normalise → diff → gate →
//! match → rank → one store commit. Synchronous and CPU-bound; `serve` runs it on a blocking
//! thread. Also resolves holds (release / prime): the hold's staged delta is streamed from
//! the store into one `RunWriter` transaction, as a run's delta is from its spill.
//!
//! Files: this one holds the `Engine` (config, store, subscribers, clock) and how it opens;
//! `run` is one source run up to its commit, `commit` the commit in chunks, `events` the
//! change events and the claims they make, `holds` a held run's release or prime,
//! `subscribers` who is alerted (config and control-port subscribers) and the endpoint
//! listing. `derived.rs` adds the district and overlay runs to the same `Engine`.

use crate::clock::SharedClock;
use crate::config::Config;
use crate::detect::stream::ScanError;
use crate::ingest::IngestError;
use crate::model::*;
use crate::notify::aoi::AoiError;
use crate::notify::matcher::SubscriberIndex;
use crate::store::{Store, StoreError};
use std::sync::Arc;

mod commit;
mod events;
mod holds;
mod run;
mod subscribers;

pub(crate) use commit::COMMIT_CHUNK;
pub(crate) use run::{announces_changes, commit_mode};
pub(crate) use subscribers::shadowed_subscribers;
pub use subscribers::{EndpointListing, ManagedBy};
use subscribers::{config_subscribers, stored_subscribers, AoiRepairs};

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

    /// Where a run's scratch files go (the spill, the row sort's runs): next to the store,
    /// on its disk and with its permissions.
    pub(crate) fn scratch_dir(&self) -> &std::path::Path {
        crate::util::folder_of(self.store.path())
    }
}

#[cfg(test)]
mod tests;
