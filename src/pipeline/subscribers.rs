//! Who an engine alerts: the config's subscribers (their AOI files loaded and repaired, each
//! repair noted) and those created over the control port, a config subscriber hiding a stored
//! one of the same id; and the endpoint listing `endpoints list` prints.

use crate::config::Config;
use crate::notify::aoi::{load_aoi_noted, AoiError};
use crate::notify::matcher::Subscriber;
use super::{Engine, PipelineError};

/// (subscriber id, what the repair of its AOI did): [`Engine::aoi_repairs`].
pub(super) type AoiRepairs = Vec<(String, String)>;

/// The config's subscribers, with what was repaired of their AOIs.
pub(super) fn config_subscribers(config: &Config) -> Result<(Vec<Subscriber>, AoiRepairs), AoiError> {
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
pub(super) fn stored_subscribers(stored: Vec<crate::store::StoredSubscriber>, config: &Config) -> Vec<Subscriber> {
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
pub(crate) fn shadowed_subscribers(config: &Config, stored_ids: impl IntoIterator<Item = String>) -> Vec<String> {
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

impl Engine {
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
}
