//! Resolving a held run (`holds release` / `holds prime`): its staged delta streamed from the
//! store into one `RunWriter` transaction, as a run's delta is from its spill.

use crate::config::LayerKind;
use crate::detect::diff::{classify, ParcelDelta, RawChange};
use crate::model::*;
use crate::store::{CommitMode, HeldChunk};
use super::{Engine, PipelineError};

impl Engine {
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
