//! Change events from parcel deltas: severity ranked, matched against subscribers' AOIs
//! (envelope query, then exact intersects), and the idempotency-key claims they make.

use crate::config::SourceConfig;
use crate::detect::diff::RawChange;
use crate::detect::severity;
use crate::model::*;
use crate::notify::idem;
use crate::notify::matcher::PinnedIndex;
use crate::store::Claim;
use super::{Engine, PipelineError};
use std::collections::HashMap;

impl Engine {
    /// One change event with its geometries and severity (the change's parts move into it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn change_event(
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
    pub(super) fn claims_with(&self, index: &PinnedIndex, events: &[ChangeEvent]) -> Vec<Claim> {
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
}
