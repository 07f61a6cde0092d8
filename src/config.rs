//! The TOML configuration: what operators write. Parsing is strict (unknown keys are errors, so
//! a typo never silently disables a gate) and every problem is reported with the key it is
//! about. Relative paths resolve against the config file's folder.

use crate::model::Severity;
use crate::util::parse_duration;
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything that can be wrong with a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path} is not valid TOML for zonewatch: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    store: RawStore,
    #[serde(default)]
    delivery: RawDelivery,
    #[serde(default, rename = "source")]
    sources: Vec<RawSource>,
    #[serde(default, rename = "subscriber")]
    subscribers: Vec<RawSubscriber>,
    #[serde(default)]
    ingest: crate::ingest::settings::RawIngest,
    #[serde(default)]
    control: RawControl,
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
struct RawControl {
    listen: Option<String>,
    token_file: Option<PathBuf>,
    max_body_bytes: Option<usize>,
    body_timeout: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawStore {
    path: PathBuf,
    cache_mib: Option<usize>,
    run_retention: Option<String>,
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
struct RawDelivery {
    concurrency: Option<usize>,
    max_attempts: Option<u32>,
    base_delay_ms: Option<u64>,
    max_delay_ms: Option<u64>,
    timeout_ms: Option<u64>,
    idem_ttl: Option<String>,
    run_wait: Option<String>,
    allow_private_targets: Option<bool>,
    retry_schedule: Option<Vec<String>>,
    retry_jitter: Option<f64>,
    max_retry_window: Option<String>,
    max_replays: Option<u32>,
    breaker_cooldown: Option<String>,
    disable_after: Option<String>,
    endpoint_concurrency: Option<usize>,
    endpoint_rate: Option<f64>,
    retention: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawSource {
    id: String,
    jurisdiction: String,
    kind: String,
    path: Option<PathBuf>,
    every: Option<String>,
    bbox: Option<[f64; 4]>,
    max_change_ratio: Option<f64>,
    fields: RawFields,
    severity: Option<RawSeverity>,
    /// HTTP kinds: the layer / collection / resource URL.
    url: Option<String>,
    /// HTTP kinds: features per page (`arcgis`, `socrata`) or `limit` (`ogcapi`).
    page_size: Option<u32>,
    floor: Option<String>,
    stale_after: Option<String>,
    layer: Option<String>,
    parcels: Option<String>,
    min_change_area_m2: Option<f64>,
    tolerance_m: Option<f64>,
    overlay_min_share: Option<f64>,
    /// `arcgis`: `"json"` (default) or `"geojson"`: the `f=` of the query pages.
    format: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawFields {
    #[serde(default)]
    parcel_id: String,
    #[serde(default)]
    zoning: String,
    effective_date: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawSeverity {
    residential: Option<Vec<String>>,
    intensive: Option<Vec<String>>,
    large_parcel_m2: Option<f64>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawSubscriber {
    id: String,
    aoi: PathBuf,
    target: String,
    secret: Option<String>,
    min_severity: Option<String>,
    secret_old: Option<String>,
}

/// How long run records that committed nothing are kept when `[store] run_retention` is not set.
pub const DEFAULT_RUN_RETENTION: Duration = Duration::from_secs(30 * 86_400);
/// The shortest `[store] run_retention` accepted.
const MIN_RUN_RETENTION: Duration = Duration::from_secs(3_600);

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from (None for configs built in code, e.g. the demo).
    pub path: Option<PathBuf>,
    pub store_path: PathBuf,
    /// `[store] cache_mib`: redb's page cache in MiB (default 8). It is resident memory for
    /// the life of the process, so it is the main term of an idle daemon's RSS; raise it for
    /// stores of millions of parcels if commits are slow.
    pub store_cache_mib: usize,
    /// `[store] run_retention`: how long the run records that committed nothing (`identical`,
    /// `skip`, `failed`, `skipped_overlap`) are kept (default 30 days; each source's newest
    /// stays, and the run totals keep counting them: `store/run_retention.rs`).
    pub run_retention: Duration,
    pub delivery: DeliveryConfig,
    pub sources: Vec<SourceConfig>,
    pub subscribers: Vec<SubscriberConfig>,
    /// `[ingest]`: transport settings of the HTTP source kinds.
    pub ingest: crate::ingest::settings::IngestConfig,
    pub control: ControlConfig,
    /// Keys the config sets that nothing reads where they are (`floor` on a file source, an
    /// area-mode setting on a parcels layer, the exponential keys beside a `retry_schedule`),
    /// as sentences: [`Config::advisories`].
    pub ignored: Vec<String>,
}

/// `[control]`: the operator's HTTP port (served by `zonewatch serve`).
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// Default `127.0.0.1:8645`; port 0 picks a free port (written next to the store).
    pub listen: std::net::SocketAddr,
    /// File holding the bearer token; created with a random token on first start if absent.
    pub token_file: PathBuf,
    /// Largest request body accepted (default 1 MiB).
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive in full (default 30 s; a slower one gets
    /// 408): a client trickling a body must not hold a connection open at will.
    pub body_timeout: Duration,
}

/// `[delivery]`: how webhooks are sent.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    pub concurrency: usize,
    pub max_attempts: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    pub timeout: Duration,
    pub idem_ttl: Duration,
    /// How long `zonewatch run` waits for retries that fall due before it exits.
    pub run_wait: Duration,
    pub allow_private_targets: bool,
    /// Delay before each retry (after the first try). Empty: the legacy capped exponential
    /// backoff from `base_delay`/`max_delay` (used when only those keys are set).
    pub retry_schedule: Vec<Duration>,
    /// ± fraction applied to each scheduled delay (0.2 = ±20%).
    pub retry_jitter: f64,
    /// No retry is scheduled later than this after the event was queued.
    pub max_retry_window: Duration,
    /// A dead letter replayed more than this many times goes to quarantine for a person.
    pub max_replays: u32,
    /// How long an open circuit breaker waits before its half-open probe.
    pub breaker_cooldown: Duration,
    /// An endpoint failing without a success for longer than this is disabled.
    pub disable_after: Duration,
    /// At most this many requests in flight to one endpoint.
    pub endpoint_concurrency: usize,
    /// Requests per second to one endpoint (token bucket, burst 1); 0 = unlimited.
    pub endpoint_rate: f64,
    /// Delivery attempt rows (with their response heads) are swept after this; those of
    /// unresolved dead letters stay.
    pub retention: Duration,
}

impl DeliveryConfig {
    /// The delay before retry `attempt` (1: the first), jitter aside: the schedule's (its last
    /// past its end), or the exponential backoff's cap, below which full jitter draws it
    /// (`notify::delivery::next_retry` waits it).
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        match self.retry_schedule.get(attempt.saturating_sub(1) as usize).or(self.retry_schedule.last()) {
            Some(d) => *d,
            None => crate::util::backoff_cap(self.base_delay, self.max_delay, attempt),
        }
    }

    /// The delays before the retries, as configured (without jitter; the exponential
    /// backoff's cap, its full jitter drawing anything below it): those listed one by one,
    /// then the delay every later retry repeats and how many retries repeat it (past the
    /// schedule's end, or once the backoff reached its cap). Counted, not listed: a
    /// `max_attempts` of millions is a valid config.
    pub fn nominal_retry_delays(&self) -> (Vec<Duration>, Option<(Duration, u32)>) {
        let retries = self.max_attempts.saturating_sub(1);
        let mut listed = Vec::new();
        for attempt in 1..=retries {
            let delay = self.retry_delay(attempt);
            // Every later retry waits as long: past the schedule's end, or at the backoff's
            // cap (reached, or no longer doubling).
            let from_here_on = if self.retry_schedule.is_empty() {
                delay >= self.max_delay || delay.is_zero() || attempt > 20
            } else {
                attempt as usize >= self.retry_schedule.len()
            };
            let left = retries - attempt + 1;
            // A few repeats are listed; more are counted.
            if from_here_on && left > 3 {
                return (listed, Some((delay, left)));
            }
            listed.push(delay);
        }
        (listed, None)
    }

    /// How long all the retries take, as configured (the sum of [`Self::nominal_retry_delays`]).
    pub fn nominal_retry_span(&self) -> Duration {
        let (listed, repeated) = self.nominal_retry_delays();
        let tail = repeated.map_or(Duration::ZERO, |(d, n)| d.saturating_mul(n));
        listed.iter().fold(tail, |a, d| a.saturating_add(*d))
    }

    /// The retry policy in effect, in one line (`zonewatch check` prints it: a config that
    /// sets only `max_delay_ms` swaps the default schedule of a day for seconds of
    /// exponential backoff, and nothing said so).
    pub fn describe(&self) -> String {
        let (listed, repeated) = self.nominal_retry_delays();
        let mut delays: Vec<String> = listed.iter().map(|d| crate::util::format_duration(*d)).collect();
        if let Some((d, n)) = repeated {
            delays.push(format!("then {} ×{n}", crate::util::format_duration(d)));
        }
        let retries = if delays.is_empty() {
            "no retries".to_string()
        } else if self.retry_schedule.is_empty() {
            format!("retries after up to {} (exponential, full jitter)", delays.join(", "))
        } else {
            let jitter = if self.retry_jitter > 0.0 { format!(" (±{:.0}%)", self.retry_jitter * 100.0) } else { String::new() };
            format!("retries after {}{jitter}", delays.join(", "))
        };
        format!(
            "{} attempt(s), {retries}, {} in all; an alert still failing {} after it was queued is a dead letter; an endpoint failing without a success for {} is disabled",
            self.max_attempts,
            crate::util::format_duration(self.nominal_retry_span()),
            crate::util::format_duration(self.max_retry_window),
            crate::util::format_duration(self.disable_after)
        )
    }

    /// Settings that are valid but weaken a guarantee, as sentences for an operator
    /// (`zonewatch check` prints them, `run` and `serve` log them).
    pub fn advisories(&self) -> Vec<String> {
        let mut out = Vec::new();
        let span = self.nominal_retry_span();
        // A retry schedule over within a minute (the exponential keys' few seconds are a
        // choice the packaged config offers for receivers that must hear fast or not at all).
        if self.max_attempts > 1 && !self.retry_schedule.is_empty() && span < Duration::from_secs(60) {
            out.push(format!(
                "delivery: an alert's retries are all over within {} ({}): a receiver down for longer (a restart, a deploy) has its alerts dead-lettered",
                crate::util::format_duration(span),
                self.describe()
            ));
        }
        if self.max_retry_window < span {
            out.push(format!(
                "delivery.max_retry_window ({}) ends before the retries do ({} over {} attempts): an alert still failing is dead-lettered `retry_window_exceeded` before its last attempts",
                crate::util::format_duration(self.max_retry_window),
                crate::util::format_duration(span),
                self.max_attempts
            ));
        }
        // Retries ride out an outage for the shorter of the window and the schedule.
        let ridden_out = self.max_retry_window.min(span);
        if self.disable_after < ridden_out {
            out.push(format!(
                "delivery.disable_after ({}) is shorter than the retries last ({}): an endpoint down for longer than {} is disabled, its alerts waiting for `zonewatch endpoints enable`, during an outage its retries would ride out",
                crate::util::format_duration(self.disable_after),
                crate::util::format_duration(ridden_out),
                crate::util::format_duration(self.disable_after)
            ));
        }
        let needed = self.idem_ttl.saturating_add(self.max_retry_window);
        if self.retention < needed {
            out.push(format!(
                "delivery.retention ({}) is shorter than idem_ttl + max_retry_window ({}): a dead letter replayed \
                 after its key came back may not see that an earlier copy was sent, and send it again under the \
                 same webhook-id",
                crate::util::format_duration(self.retention),
                crate::util::format_duration(needed)
            ));
        }
        out
    }
}

/// The default retry schedule after the first try: 5s, 5m, 30m, 2h, 5h, 10h, 10h.
pub fn default_retry_schedule() -> Vec<Duration> {
    [5, 300, 1_800, 7_200, 18_000, 36_000, 36_000].into_iter().map(Duration::from_secs).collect()
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            concurrency: 16,
            max_attempts: 8,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_millis(30_000),
            timeout: Duration::from_millis(15_000),
            idem_ttl: Duration::from_secs(7 * 86_400),
            run_wait: Duration::from_secs(60),
            allow_private_targets: false,
            retry_schedule: default_retry_schedule(),
            retry_jitter: 0.2,
            max_retry_window: Duration::from_secs(3 * 86_400),
            max_replays: 3,
            breaker_cooldown: Duration::from_secs(60),
            disable_after: Duration::from_secs(5 * 86_400),
            endpoint_concurrency: 8,
            endpoint_rate: 0.0,
            retention: Duration::from_secs(30 * 86_400),
        }
    }
}

/// Where a source's bytes come from. Later issues add HTTP kinds.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceKind {
    File { path: PathBuf },
    /// One URL returning a FeatureCollection; conditional GET.
    GeojsonUrl { url: String },
    /// An ArcGIS FeatureServer / MapServer layer URL (ending in the layer number).
    Arcgis { url: String, page_size: u32, format: crate::ingest::arcgis::ArcgisFormat },
    /// An OGC API – Features collection URL (`…/collections/{id}`).
    Ogcapi { url: String, limit: u32 },
    /// A SODA resource URL (`…/resource/{4x4}.geojson`).
    Socrata { url: String, page_size: u32 },
}

/// Which properties carry the parcel id, zoning code and effective date.
#[derive(Debug, Clone)]
pub struct FieldMap {
    pub parcel_id: String,
    pub zoning: String,
    pub effective_date: Option<String>,
}

impl FieldMap {
    /// `id=… zoning=…`, and `effective_date=…` when one is mapped (`check`'s source lines).
    pub fn describe(&self) -> String {
        let date = self.effective_date.as_deref().map(|d| format!(" effective_date={d}")).unwrap_or_default();
        format!("id={} zoning={}{date}", self.parcel_id, self.zoning)
    }
}

/// Zoning-code classes and the area threshold used to rank severity.
#[derive(Debug, Clone)]
pub struct SeverityRules {
    /// Patterns (`R*` = prefix, otherwise exact; case-insensitive) for residential codes.
    pub residential: Vec<String>,
    /// Patterns for intensive codes (commercial C3, manufacturing, industrial).
    pub intensive: Vec<String>,
    /// Upzoning on a parcel larger than this (geodesic m²) is `critical`.
    pub large_parcel_m2: f64,
}

impl Default for SeverityRules {
    fn default() -> Self {
        SeverityRules {
            residential: vec!["R*".into()],
            // `C-3*`: codes written with a hyphen (Cambridge's C-3, C-3A, C-3B).
            intensive: vec!["C3*".into(), "C-3*".into(), "M*".into(), "I*".into()],
            large_parcel_m2: 5_000.0,
        }
    }
}

/// One `[[source]]`.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    pub id: String,
    pub jurisdiction: String,
    pub kind: SourceKind,
    pub every: Duration,
    /// `[min_lon, min_lat, max_lon, max_lat]`; features outside are quarantined.
    pub bbox: Option<[f64; 4]>,
    pub max_change_ratio: f64,
    pub fields: FieldMap,
    pub severity: SeverityRules,
    /// Fetch anyway when this long has passed since the last fetch, whatever the probe says.
    pub floor: Duration,
    /// Flag the source when its content has not changed for this long.
    pub stale_after: Duration,
    /// What the features are: parcels (default), zoning districts, or overlay districts.
    pub layer: LayerKind,
    /// For `districts` / `overlays`: the id of the `parcels` source whose parcels get derived
    /// zoning. None = area mode (districts only).
    pub parcels: Option<String>,
    /// Area mode: change regions smaller than this (m²) are re-digitisation noise.
    pub min_change_area_m2: f64,
    /// Area mode: change regions thinner than this (m) are noise; also the snapping grid of a
    /// region's content hash.
    pub tolerance_m: f64,
    /// Overlays: the share of a parcel's area an overlay must cover to count (0..1].
    pub overlay_min_share: f64,
}

/// What a source's features are. Parcels carry a stable id and their own code; districts and
/// overlays are polygons with a code and no stable id, joined to parcels (or diffed by area).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Parcels,
    Districts,
    Overlays,
}

impl LayerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::Parcels => "parcels",
            LayerKind::Districts => "districts",
            LayerKind::Overlays => "overlays",
        }
    }
}

/// One `[[subscriber]]`: who is told, about which area, how loudly.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    pub id: String,
    pub aoi_path: PathBuf,
    pub target: String,
    pub secret: Option<String>,
    pub min_severity: Severity,
    /// The previous secret during a rotation: deliveries carry both signatures.
    pub secret_old: Option<String>,
}

impl SourceConfig {
    /// Fingerprint of the settings that decide how a layer's bytes become parcels (field
    /// mapping and bbox). Stored with the watermark and with holds: the same bytes read with a
    /// new mapping are a new reading, not an identical one.
    pub fn read_fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let text = format!(
            "{}|{}|{}|{:?}",
            self.fields.parcel_id,
            self.fields.zoning,
            self.fields.effective_date.as_deref().unwrap_or(""),
            self.bbox
        );
        // Derived layers also depend on how they are joined; parcels keep their old text so
        // existing watermarks stay valid.
        let text = match self.layer {
            LayerKind::Parcels => text,
            layer => format!(
                "{text}|{}|{}|{}|{}|{}",
                layer.as_str(),
                self.parcels.as_deref().unwrap_or(""),
                self.min_change_area_m2,
                self.tolerance_m,
                self.overlay_min_share
            ),
        };
        crate::util::hex(&Sha256::digest(text.as_bytes())[..8])
    }
}

/// What an id created over the control port may be, said in errors.
pub const ID_RULE: &str = "1-64 characters of letters, digits, '-', '_' or '.' (not dots alone)";

/// What a config's source or subscriber id may be, said in errors.
pub const CONFIG_ID_RULE: &str = "1-128 bytes with no '/', '\\', control or bidirectional-override characters (and not dots alone)";

/// Whether `id` may name a subscriber created over the control port (`POST /v1/subscribers`)
/// or a backup the daemon writes: characters safe in a file name, a URL path, a metric label
/// and a table cell.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !id.chars().all(|c| c == '.')
}

/// Whether `id` may name a source or subscriber in the config. Looser than [`valid_id`], so
/// that configs written before the rule keep loading (renaming a source starts it over as a
/// baseline; renaming a subscriber dead-letters its queued rows): it refuses only what
/// breaks something — a path separator or dots alone (a source's staged file is named after
/// it), control and bidirectional-override characters (ids are printed to terminals and
/// logs), and lengths no file name takes.
pub fn usable_config_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.chars().any(|c| matches!(c, '/' | '\\') || crate::util::unsafe_on_terminal(c))
        && !id.chars().all(|c| c == '.')
}

impl Config {
    /// What `check` warns of and `run` and `serve` log as they start: the delivery settings
    /// that weaken a guarantee, and the keys set where nothing reads them.
    pub fn advisories(&self) -> Vec<String> {
        let mut out = self.delivery.advisories();
        out.extend(self.ignored.iter().cloned());
        out
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut cfg = Config::parse_str(&text, &base).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_path_buf(), message },
            ConfigError::Invalid { message, .. } => ConfigError::Invalid {
                path: path.to_path_buf(),
                message: match key_line(&text, &message) {
                    Some(n) => format!("line {n}: {message}"),
                    None => message,
                },
            },
            other => other,
        })?;
        cfg.path = Some(path.to_path_buf());
        Ok(cfg)
    }

    /// Parses config text; relative paths resolve against `base`.
    pub fn parse_str(text: &str, base: &Path) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<config>"),
            message: e.to_string(),
        })?;
        let invalid = |message: String| ConfigError::Invalid { path: PathBuf::from("<config>"), message };
        let resolve = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
        let dur = |key: &str, v: &Option<String>, default: Duration| -> Result<Duration, ConfigError> {
            match v {
                None => Ok(default),
                Some(s) => parse_duration(s).map_err(|e| invalid(format!("{key}: {e}"))),
            }
        };

        let d = DeliveryConfig::default();
        let rd = &raw.delivery;
        // An explicit schedule wins; a config that only sets the exponential keys keeps the
        // exponential backoff; otherwise the default schedule applies.
        let retry_schedule = match &rd.retry_schedule {
            Some(list) => list
                .iter()
                .map(|v| parse_duration(v).map_err(|e| invalid(format!("delivery.retry_schedule: {e}"))))
                .collect::<Result<Vec<_>, _>>()?,
            None if rd.base_delay_ms.is_some() || rd.max_delay_ms.is_some() => Vec::new(),
            None => default_retry_schedule(),
        };
        let default_attempts = if retry_schedule.is_empty() { 5 } else { retry_schedule.len() as u32 + 1 };
        let delivery = DeliveryConfig {
            concurrency: rd.concurrency.unwrap_or(d.concurrency),
            max_attempts: rd.max_attempts.unwrap_or(default_attempts),
            base_delay: rd.base_delay_ms.map(Duration::from_millis).unwrap_or(d.base_delay),
            max_delay: rd.max_delay_ms.map(Duration::from_millis).unwrap_or(d.max_delay),
            timeout: rd.timeout_ms.map(Duration::from_millis).unwrap_or(d.timeout),
            idem_ttl: dur("delivery.idem_ttl", &rd.idem_ttl, d.idem_ttl)?,
            run_wait: dur("delivery.run_wait", &rd.run_wait, d.run_wait)?,
            allow_private_targets: rd.allow_private_targets.unwrap_or(false),
            retry_jitter: rd.retry_jitter.unwrap_or(d.retry_jitter),
            max_retry_window: dur("delivery.max_retry_window", &rd.max_retry_window, d.max_retry_window)?,
            retry_schedule,
            max_replays: rd.max_replays.unwrap_or(d.max_replays),
            breaker_cooldown: dur("delivery.breaker_cooldown", &rd.breaker_cooldown, d.breaker_cooldown)?,
            disable_after: dur("delivery.disable_after", &rd.disable_after, d.disable_after)?,
            endpoint_concurrency: rd.endpoint_concurrency.unwrap_or(d.endpoint_concurrency),
            endpoint_rate: rd.endpoint_rate.unwrap_or(d.endpoint_rate),
            retention: dur("delivery.retention", &rd.retention, d.retention)?,
        };
        if delivery.endpoint_concurrency == 0 || delivery.endpoint_concurrency > 4096 {
            return Err(invalid("delivery.endpoint_concurrency must be between 1 and 4096".into()));
        }
        if !(delivery.endpoint_rate.is_finite() && (delivery.endpoint_rate == 0.0 || delivery.endpoint_rate >= 0.001)) {
            return Err(invalid("delivery.endpoint_rate must be 0 (unlimited) or at least 0.001 webhooks per second".into()));
        }
        if !(0.0..1.0).contains(&delivery.retry_jitter) {
            return Err(invalid("delivery.retry_jitter must be in [0, 1)".into()));
        }
        if rd.retry_schedule.as_ref().is_some_and(|l| l.is_empty()) {
            return Err(invalid("delivery.retry_schedule must list at least one delay".into()));
        }
        if delivery.concurrency == 0 || delivery.concurrency > 4096 {
            return Err(invalid("delivery.concurrency must be between 1 and 4096".into()));
        }
        if delivery.max_attempts == 0 {
            return Err(invalid("delivery.max_attempts must be at least 1".into()));
        }
        if delivery.max_delay < delivery.base_delay {
            return Err(invalid("delivery.max_delay_ms must be >= delivery.base_delay_ms".into()));
        }
        if delivery.timeout.is_zero() {
            return Err(invalid("delivery.timeout_ms must be positive".into()));
        }
        if delivery.idem_ttl.is_zero() {
            return Err(invalid("delivery.idem_ttl must be positive".into()));
        }
        // Zero turned retries off: one 503 dead-lettered the alert `retry_window_exceeded`.
        if delivery.max_retry_window.is_zero() {
            return Err(invalid("delivery.max_retry_window must be positive (it bounds how long an alert is retried; 0 would dead-letter it at its first failure)".into()));
        }
        // As zero: every alert whose first send failed was dead-lettered at once (`check` said
        // all good).
        if let Some(first) = delivery.retry_schedule.first().filter(|_| delivery.max_attempts > 1) {
            let earliest = first.mul_f64(1.0 - delivery.retry_jitter);
            if delivery.max_retry_window < earliest {
                return Err(invalid(format!(
                    "delivery.max_retry_window ({}) is shorter than the first retry ({} at the earliest, retry_schedule's first delay less retry_jitter): an alert whose first send failed would be dead-lettered at once",
                    crate::util::format_duration(delivery.max_retry_window),
                    crate::util::format_duration(earliest)
                )));
            }
        }
        if delivery.disable_after.is_zero() {
            return Err(invalid("delivery.disable_after must be positive (an endpoint failing without a success for longer is disabled until an operator enables it; 0 disabled it at its first failure)".into()));
        }
        let mut ignored = Vec::new();
        if rd.retry_schedule.is_some() {
            for (key, set) in [("base_delay_ms", rd.base_delay_ms.is_some()), ("max_delay_ms", rd.max_delay_ms.is_some())] {
                if set {
                    ignored.push(format!("delivery.{key} is not read: retry_schedule is set, and it alone sets the delays"));
                }
            }
        } else if delivery.retry_schedule.is_empty() && rd.retry_jitter.is_some() {
            ignored.push("delivery.retry_jitter is not read: with base_delay_ms / max_delay_ms and no retry_schedule, each delay is drawn at random below its cap (full jitter)".into());
        }

        let mut seen = HashSet::new();
        let mut sources = Vec::new();
        for (i, s) in raw.sources.iter().enumerate() {
            let at = format!("source[{i}] ({:?})", s.id);
            let id = s.id.trim().to_string();
            if !usable_config_id(&id) {
                return Err(invalid(format!("{at}: id must be {CONFIG_ID_RULE}")));
            }
            if !seen.insert(id.clone()) {
                return Err(invalid(format!("{at}: duplicate source id {id:?}")));
            }
            if s.jurisdiction.trim().is_empty() {
                return Err(invalid(format!("{at}: jurisdiction must not be empty")));
            }
            let kind = match s.kind.as_str() {
                "file" => {
                    let stray: Vec<&str> = [("url", s.url.is_some()), ("page_size", s.page_size.is_some()), ("format", s.format.is_some())]
                        .iter()
                        .filter(|(_, set)| *set)
                        .map(|(k, _)| *k)
                        .collect();
                    if !stray.is_empty() {
                        return Err(invalid(format!(
                            "{at}: {} does not apply to kind = \"file\" (an HTTP source needs kind = \"geojson_url\", \"arcgis\", \"ogcapi\" or \"socrata\")",
                            stray.join(", ")
                        )));
                    }
                    let p = s
                        .path
                        .as_ref()
                        .ok_or_else(|| invalid(format!("{at}: kind = \"file\" needs `path`")))?;
                    SourceKind::File { path: resolve(p) }
                }
                other if s.path.is_some() && matches!(other, "geojson_url" | "arcgis" | "ogcapi" | "socrata") => {
                    return Err(invalid(format!("{at}: `path` does not apply to kind = {other:?} (it reads `url`)")));
                }
                other => match crate::ingest::settings::http_kind(other, s.url.as_deref(), s.page_size, s.format.as_deref()) {
                    Ok(Some(k)) => k,
                    Ok(None) => {
                        return Err(invalid(format!(
                            "{at}: unknown kind {other:?} (supported: \"file\", \"geojson_url\", \"arcgis\", \"ogcapi\", \"socrata\")"
                        )))
                    }
                    Err(e) => return Err(invalid(format!("{at}: {e}"))),
                },
            };
            let every = dur(&format!("{at}: every"), &s.every, Duration::from_secs(3600))?;
            if s.floor.is_some() && matches!(kind, SourceKind::File { .. }) {
                ignored.push(format!("{at}: floor is not read: it bounds the probe of an HTTP source, and a file is read at every run"));
            }
            if every < Duration::from_secs(1) {
                return Err(invalid(format!("{at}: every must be at least 1s")));
            }
            if let Some(b) = s.bbox {
                if b.iter().any(|v| !v.is_finite())
                    || b[0] >= b[2]
                    || b[1] >= b[3]
                    || b[0] < -180.0
                    || b[2] > 180.0
                    || b[1] < -90.0
                    || b[3] > 90.0
                {
                    return Err(invalid(format!(
                        "{at}: bbox must be [min_lon, min_lat, max_lon, max_lat] in degrees with min < max"
                    )));
                }
            }
            let ratio = s.max_change_ratio.unwrap_or(0.05);
            if !(ratio > 0.0 && ratio <= 1.0) {
                return Err(invalid(format!("{at}: max_change_ratio must be in (0, 1]")));
            }
            let layer = match s.layer.as_deref().map(str::trim) {
                None | Some("parcels") => LayerKind::Parcels,
                Some("districts") => LayerKind::Districts,
                Some("overlays") => LayerKind::Overlays,
                Some(other) => {
                    return Err(invalid(format!(
                        "{at}: layer = {other:?} is not a layer zonewatch reads (supported: \"parcels\", \"districts\", \"overlays\")"
                    )))
                }
            };
            match layer {
                // A parcel layer needs its id; its zoning field may be absent (a pure parcel base
                // whose zoning is derived from a district layer).
                LayerKind::Parcels if s.fields.parcel_id.trim().is_empty() => {
                    return Err(invalid(format!("{at}: fields.parcel_id must be set for a parcels layer")));
                }
                LayerKind::Parcels if s.parcels.is_some() => {
                    return Err(invalid(format!("{at}: `parcels` is only for layer = \"districts\" or \"overlays\"")));
                }
                LayerKind::Districts | LayerKind::Overlays if s.fields.zoning.trim().is_empty() => {
                    return Err(invalid(format!("{at}: fields.zoning must be set for a {} layer", layer.as_str())));
                }
                LayerKind::Overlays if s.parcels.is_none() => {
                    return Err(invalid(format!("{at}: layer = \"overlays\" needs `parcels = \"<source id>\"`")));
                }
                // Every run of it would fail (a black-box tester: `check` said all good).
                LayerKind::Districts | LayerKind::Overlays if !matches!(kind, SourceKind::File { .. }) => {
                    return Err(invalid(format!(
                        "{at}: a {} layer is read from a file (kind = \"file\", path = ...); the HTTP kinds feed parcels layers only. Download the layer to a file (a cron job, say) and point `path` at it",
                        layer.as_str()
                    )));
                }
                _ => {}
            }
            let min_change_area_m2 = s.min_change_area_m2.unwrap_or(200.0);
            if !(min_change_area_m2.is_finite() && min_change_area_m2 >= 0.0) {
                return Err(invalid(format!("{at}: min_change_area_m2 must be >= 0")));
            }
            let tolerance_m = s.tolerance_m.unwrap_or(3.0);
            if !(tolerance_m.is_finite() && tolerance_m > 0.0 && tolerance_m <= 1000.0) {
                return Err(invalid(format!("{at}: tolerance_m must be in (0, 1000]")));
            }
            let overlay_min_share = s.overlay_min_share.unwrap_or(0.1);
            if !(overlay_min_share > 0.0 && overlay_min_share <= 1.0) {
                return Err(invalid(format!("{at}: overlay_min_share must be in (0, 1]")));
            }
            if layer == LayerKind::Parcels {
                for (key, set) in [("min_change_area_m2", s.min_change_area_m2.is_some()), ("tolerance_m", s.tolerance_m.is_some()), ("overlay_min_share", s.overlay_min_share.is_some())] {
                    if set {
                        ignored.push(format!("{at}: {key} is not read: it is a setting of a districts or overlays layer"));
                    }
                }
            }
            let mut severity = SeverityRules::default();
            if let Some(rs) = &s.severity {
                if let Some(r) = &rs.residential {
                    severity.residential = r.clone();
                }
                if let Some(r) = &rs.intensive {
                    severity.intensive = r.clone();
                }
                if let Some(a) = rs.large_parcel_m2 {
                    if !(a.is_finite() && a >= 0.0) {
                        return Err(invalid(format!("{at}: severity.large_parcel_m2 must be >= 0")));
                    }
                    severity.large_parcel_m2 = a;
                }
            }
            sources.push(SourceConfig {
                id,
                jurisdiction: s.jurisdiction.trim().to_string(),
                kind,
                every,
                bbox: s.bbox,
                max_change_ratio: ratio,
                fields: FieldMap {
                    parcel_id: s.fields.parcel_id.clone(),
                    zoning: s.fields.zoning.clone(),
                    effective_date: s.fields.effective_date.clone(),
                },
                severity,
                floor: dur(&format!("{at}: floor"), &s.floor, Duration::from_secs(86_400))?,
                stale_after: dur(&format!("{at}: stale_after"), &s.stale_after, Duration::from_secs(45 * 86_400))?,
                layer,
                parcels: s.parcels.as_ref().map(|p| p.trim().to_string()),
                min_change_area_m2,
                tolerance_m,
                overlay_min_share,
            });
        }

        let mut seen = HashSet::new();
        let mut subscribers = Vec::new();
        for (i, s) in raw.subscribers.iter().enumerate() {
            let at = format!("subscriber[{i}] ({:?})", s.id);
            let id = s.id.trim().to_string();
            if !usable_config_id(&id) {
                return Err(invalid(format!("{at}: id must be {CONFIG_ID_RULE}")));
            }
            if !seen.insert(id.clone()) {
                return Err(invalid(format!("{at}: duplicate subscriber id {id:?}")));
            }
            let url = reqwest::Url::parse(&s.target)
                .map_err(|e| invalid(format!("{at}: target {:?} is not a URL: {e}", crate::util::url_for_display(&s.target))))?;
            if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                return Err(invalid(format!("{at}: target must be an http(s) URL with a host")));
            }
            if let Some(secret) = &s.secret {
                crate::notify::signing::decode_secret(secret)
                    .map_err(|e| invalid(format!("{at}: secret: {e}")))?;
            }
            if let Some(old) = &s.secret_old {
                if s.secret.is_none() {
                    return Err(invalid(format!("{at}: secret_old needs `secret` (the new secret)")));
                }
                crate::notify::signing::decode_secret(old)
                    .map_err(|e| invalid(format!("{at}: secret_old: {e}")))?;
            }
            let min_severity = match &s.min_severity {
                None => Severity::Notice,
                Some(v) => Severity::parse(v).ok_or_else(|| {
                    invalid(format!("{at}: min_severity {v:?} is not one of info, notice, material, critical"))
                })?,
            };
            subscribers.push(SubscriberConfig {
                id,
                aoi_path: resolve(&s.aoi),
                target: s.target.clone(),
                secret: s.secret.clone(),
                min_severity,
                secret_old: s.secret_old.clone(),
            });
        }

        // An empty path named the config's own folder, or nothing at all when the config was
        // given by a relative path: `check` passed it and `serve` failed with "cannot write :".
        if raw.store.path.as_os_str().is_empty() {
            return Err(invalid("store.path must not be empty: it names the store file".into()));
        }
        if raw.control.token_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid("control.token_file must not be empty: it names the control token's file (leave it out for control.token beside the config)".into()));
        }
        let listen_text = raw.control.listen.clone().unwrap_or_else(|| "127.0.0.1:8645".into());
        let listen: std::net::SocketAddr = listen_text
            .parse()
            .map_err(|_| invalid(format!("control.listen {listen_text:?} is not an address like 127.0.0.1:8645")))?;
        let control = ControlConfig {
            listen,
            token_file: resolve(raw.control.token_file.as_deref().unwrap_or(Path::new("control.token"))),
            max_body_bytes: raw.control.max_body_bytes.unwrap_or(1 << 20),
            body_timeout: dur("control.body_timeout", &raw.control.body_timeout, crate::control::http::BODY_TIMEOUT)?,
        };
        if control.body_timeout.is_zero() {
            return Err(invalid("control.body_timeout must be positive".into()));
        }
        if control.max_body_bytes < 1024 {
            return Err(invalid("control.max_body_bytes must be at least 1024".into()));
        }
        for s in &sources {
            if let Some(base) = &s.parcels {
                match sources.iter().find(|o| &o.id == base) {
                    Some(o) if o.layer == LayerKind::Parcels => {}
                    Some(_) => {
                        return Err(invalid(format!(
                            "source {:?}: parcels = {base:?} must name a layer = \"parcels\" source",
                            s.id
                        )))
                    }
                    None => return Err(invalid(format!("source {:?}: parcels = {base:?} is not a configured source", s.id))),
                }
            }
        }

        Ok(Config {
            control,
            path: None,
            store_path: resolve(&raw.store.path),
            store_cache_mib: match raw.store.cache_mib {
                None => crate::store::STORE_CACHE_BYTES >> 20,
                Some(m) if (1..=65_536).contains(&m) => m,
                Some(m) => return Err(invalid(format!("[store] cache_mib = {m}: expected 1 to 65536 (MiB)"))),
            },
            run_retention: match dur("[store] run_retention", &raw.store.run_retention, DEFAULT_RUN_RETENTION)? {
                r if r < MIN_RUN_RETENTION => {
                    return Err(invalid(format!(
                        "[store] run_retention = {:?}: expected at least 1h (the run records of the last hour are what an operator looks at)",
                        raw.store.run_retention.as_deref().unwrap_or_default()
                    )))
                }
                r => r,
            },
            delivery,
            ignored,
            sources,
            subscribers,
            ingest: raw.ingest.validate().map_err(invalid)?,
        })
    }

    pub fn source(&self, id: &str) -> Option<&SourceConfig> {
        self.sources.iter().find(|s| s.id == id)
    }

    /// Whether the config file defines subscriber `id`: it then wins over one of the same id
    /// created over the control port (that one is hidden, and the API may not change it).
    pub fn has_subscriber(&self, id: &str) -> bool {
        self.subscribers.iter().any(|c| c.id == id)
    }
}

/// The line of the config text that an `Invalid` message's key names (`delivery.idem_ttl …`,
/// `source[2] ("s"): every …`, `[store] cache_mib …`), else the line of its table or array
/// element, else None: a key's value errors said the key but not where it is, where syntax
/// errors and unknown keys gave the line (a black-box tester and a reviewer). Plain `key =`
/// lines only (not inline tables or dotted keys, which are then found by their table).
fn key_line(text: &str, message: &str) -> Option<usize> {
    let word = |s: &str| -> String { s.trim_start_matches('`').chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.').collect() };
    // (table, element index for an array of tables, key)
    let (table, index, key): (&str, Option<usize>, String) = if let Some(rest) = message.strip_prefix('[') {
        let (table, rest) = rest.split_once("] ")?;
        (table, None, word(rest))
    } else if let Some((head, rest)) = message.split_once("): ").filter(|(h, _)| h.contains("] (")) {
        let (table, index) = head.split_once('[')?;
        let index: usize = index.split(']').next()?.parse().ok()?;
        (table, Some(index), word(rest))
    } else {
        let (table, rest) = message.split_once('.')?;
        if !["delivery", "control", "ingest", "store"].contains(&table) {
            return None;
        }
        (table, None, word(rest))
    };
    let key = key.rsplit('.').next().unwrap_or_default().to_string();
    let header = match index {
        Some(_) => format!("[[{table}]]"),
        None => format!("[{table}]"),
    };
    let mut seen = 0usize;
    let mut span: Option<usize> = None;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with('[') {
            // `[[ source ]]  # parcels` is `[[source]]`.
            let t: String = t.split('#').next().unwrap_or_default().chars().filter(|c| !c.is_whitespace()).collect();
            let inside = t.trim_start_matches('[').trim_end_matches(']');
            let ours = t == header && index.is_none_or(|i| {
                seen += 1;
                seen == i + 1
            });
            if ours {
                span = Some(n + 1);
            } else if span.is_some() && !inside.starts_with(&format!("{table}.")) {
                break;
            }
            continue;
        }
        if span.is_some() && !key.is_empty() && t.strip_prefix(key.as_str()).is_some_and(|r| r.trim_start().starts_with('=')) {
            return Some(n + 1);
        }
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retention_shorter_than_a_key_cycle_is_an_advisory_not_an_error() {
        assert!(DeliveryConfig::default().advisories().is_empty(), "the defaults (30 d vs 7 d + 3 d) are safe");
        let short = DeliveryConfig { retention: Duration::from_secs(86_400), ..Default::default() };
        let advice = short.advisories();
        assert_eq!(advice.len(), 1);
        assert!(advice[0].contains("delivery.retention") && advice[0].contains("webhook-id"), "{advice:?}");
    }

    #[test]
    fn ids_that_cannot_name_a_file_a_route_or_a_table_cell_are_refused() {
        let with = |source: &str, sub: &str| {
            let text = format!(
                "[store]\npath = \"zw.redb\"\n[[source]]\nid = \"{source}\"\njurisdiction = \"t\"\nkind = \"file\"\npath = \"p.geojson\"\n\
                 [source.fields]\nparcel_id = \"ML\"\nzoning = \"Z\"\n[[subscriber]]\nid = \"{sub}\"\naoi = \"a.geojson\"\ntarget = \"https://example.org/h\"\n"
            );
            Config::parse_str(&text, Path::new(".")).map(|_| ()).map_err(|e| e.to_string())
        };
        // Ids that configs written before the rule may hold keep loading.
        for ok in ["cambridge-zoning_2.v1", "Cambridge Zoning", "acme:1", "zürich"] {
            assert_eq!(with(ok, ok), Ok(()), "{ok:?}");
        }
        let long = "a".repeat(129);
        for bad in ["a/b", "a\\\\b", "..", ".", "a\\u0007b", "a\\u202eb", long.as_str()] {
            let e = with(bad, "w").unwrap_err();
            assert!(e.contains("source[0]") && e.contains("1-128 bytes"), "{bad:?}: {e}");
            let e = with("s", bad).unwrap_err();
            assert!(e.contains("subscriber[0]") && e.contains("1-128 bytes"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn district_layers_and_their_parcel_base() {
        let text = r#"
[store]
path = "zw.redb"
[[source]]
id = "p"
jurisdiction = "town"
kind = "file"
path = "p.geojson"
[source.fields]
parcel_id = "ML"
[[source]]
id = "d"
jurisdiction = "town"
kind = "file"
path = "d.geojson"
layer = "districts"
parcels = "p"
[source.fields]
zoning = "ZONE_TYPE"
[[source]]
id = "a"
jurisdiction = "town"
kind = "file"
path = "a.geojson"
layer = "districts"
tolerance_m = 5
[source.fields]
zoning = "zone_class"
"#;
        let cfg = Config::parse_str(text, Path::new(".")).unwrap();
        assert_eq!(cfg.sources[0].layer, LayerKind::Parcels);
        assert_eq!(cfg.sources[0].fields.zoning, "");
        assert_eq!(cfg.sources[1].layer, LayerKind::Districts);
        assert_eq!(cfg.sources[1].parcels.as_deref(), Some("p"));
        assert_eq!((cfg.sources[2].min_change_area_m2, cfg.sources[2].tolerance_m), (200.0, 5.0));
        assert_ne!(cfg.sources[1].read_fingerprint(), cfg.sources[2].read_fingerprint());
        // The base must exist and be a parcel layer.
        let missing = text.replace("parcels = \"p\"", "parcels = \"nope\"");
        assert!(Config::parse_str(&missing, Path::new(".")).unwrap_err().to_string().contains("nope"));
        let not_parcels = text.replace("parcels = \"p\"", "parcels = \"a\"");
        assert!(Config::parse_str(&not_parcels, Path::new(".")).is_err());
        // A districts layer needs its code field; overlays need a base.
        let no_code = text.replace("zoning = \"ZONE_TYPE\"", "");
        assert!(Config::parse_str(&no_code, Path::new(".")).unwrap_err().to_string().contains("fields.zoning"));
        let overlays = text.replace("layer = \"districts\"\ntolerance_m", "layer = \"overlays\"\ntolerance_m");
        assert!(Config::parse_str(&overlays, Path::new(".")).unwrap_err().to_string().contains("overlays"));
        // A district layer over HTTP, which every run would fail on, is refused here.
        let over_http = text.replace("kind = \"file\"\npath = \"a.geojson\"", "kind = \"geojson_url\"\nurl = \"http://127.0.0.1:9/a\"");
        assert_ne!(over_http, text);
        let err = Config::parse_str(&over_http, Path::new(".")).unwrap_err().to_string();
        assert!(err.contains("a districts layer is read from a file"), "{err}");
    }

    const GOOD: &str = r#"
[store]
path = "zw.redb"
[delivery]
idem_ttl = "7d"
allow_private_targets = true
[[source]]
id = "s1"
jurisdiction = "town"
kind = "file"
path = "layers/z.geojson"
bbox = [-72.0, 42.0, -71.0, 43.0]
[source.fields]
parcel_id = "APN"
zoning = "ZONE"
[[subscriber]]
id = "w1"
aoi = "aoi/w1.geojson"
target = "http://127.0.0.1:9/hook"
min_severity = "material"
"#;

    /// Delivery settings that disarm retries or disable endpoints at once are refused; those
    /// that cut them short are warned of; keys nothing reads are named; `check` prints the
    /// policy in effect (a reviewer: each of these said "all good").
    #[test]
    fn delivery_settings_that_defeat_retries_are_refused_or_warned_of() {
        let with = |delivery: &str, source: &str| Config::parse_str(&GOOD.replace("[delivery]\n", &format!("[delivery]\n{delivery}\n")).replace("bbox = ", &format!("{source}\nbbox = ")), Path::new("."));
        let good = with("", "").unwrap();
        assert!(good.advisories().is_empty(), "{:?}", good.advisories());
        assert_eq!(
            good.delivery.describe(),
            "8 attempt(s), retries after 5s, 5m, 30m, 2h, 5h, 10h, 10h (±20%), 1d3h35m5s in all; an alert still failing 3d after it was queued is a dead letter; an endpoint failing without a success for 5d is disabled"
        );
        let e = with("max_retry_window = \"1s\"", "").unwrap_err().to_string();
        assert!(e.contains("delivery.max_retry_window (1s) is shorter than the first retry (4s at the earliest"), "{e}");
        assert!(with("disable_after = \"0s\"", "").unwrap_err().to_string().contains("delivery.disable_after must be positive"));
        let advice = with("disable_after = \"1h\"\nmax_retry_window = \"10h\"", "").unwrap().advisories();
        assert_eq!(advice.len(), 2, "{advice:?}");
        assert!(advice[0].starts_with("delivery.max_retry_window (10h) ends before the retries do (1d3h35m5s over 8 attempts)"), "{advice:?}");
        assert!(advice[1].starts_with("delivery.disable_after (1h) is shorter than the retries last (10h)"), "{advice:?}");
        // A window past the schedule's end: retries ride out what the schedule lasts.
        assert!(with("disable_after = \"2d\"\nmax_retry_window = \"7d\"", "").unwrap().advisories().is_empty());
        // The exponential keys' seconds of retries are a choice, not warned of.
        let quick = with("max_delay_ms = 60000", "").unwrap();
        assert_eq!(quick.delivery.nominal_retry_delays(), ([500, 1000, 2000, 4000].map(Duration::from_millis).to_vec(), None));
        assert!(quick.advisories().is_empty(), "{:?}", quick.advisories());
        assert!(quick.delivery.describe().starts_with("5 attempt(s), retries after up to 500ms, 1s, 2s, 4s (exponential, full jitter), 7s500ms in all"), "{}", quick.delivery.describe());
        let short = with("retry_schedule = [\"1s\", \"5s\"]", "").unwrap();
        assert!(short.advisories()[0].starts_with("delivery: an alert's retries are all over within 6s"), "{:?}", short.advisories());
        // Millions of attempts are counted, not listed.
        let many = with("max_attempts = 4000000000", "").unwrap().delivery;
        assert_eq!(many.nominal_retry_delays().1, Some((Duration::from_secs(36_000), 3_999_999_993)));
        assert!(many.describe().contains("retries after 5s, 5m, 30m, 2h, 5h, 10h, then 10h ×3999999993 (±20%)"), "{}", many.describe());
        let ignored = with("retry_schedule = [\"1m\"]\nbase_delay_ms = 100", "floor = \"6h\"\ntolerance_m = 4").unwrap().advisories();
        assert_eq!(
            ignored,
            [
                "delivery.base_delay_ms is not read: retry_schedule is set, and it alone sets the delays",
                "source[0] (\"s1\"): floor is not read: it bounds the probe of an HTTP source, and a file is read at every run",
                "source[0] (\"s1\"): tolerance_m is not read: it is a setting of a districts or overlays layer",
            ]
        );
    }

    /// A value's error names its line: the key's, else its table's or array element's.
    #[test]
    fn a_value_error_names_its_line() {
        let text = "[store]\npath = \"zw.redb\"\ncache_mib = 0\n[delivery]\nidem_ttl = \"7d\"\n\n[[source]]\nid = \"a\"\n[source.fields]\nparcel_id = \"P\"\n[[source]]\nid = \"b\"\nevery = \"0s\"\n[source.fields]\nzoning = \"Z\"\n[[subscriber]]\nid = \"w\"\n";
        assert_eq!(key_line(text, "[store] cache_mib = 0: expected 1 to 65536 (MiB)"), Some(3));
        assert_eq!(key_line(text, "delivery.idem_ttl must be positive"), Some(5));
        assert_eq!(key_line(text, "delivery.max_retry_window (1s) is shorter than the first retry"), Some(4), "not set: its table");
        assert_eq!(key_line(text, "source[1] (\"b\"): every must be at least 1s"), Some(13));
        assert_eq!(key_line(text, "source[1] (\"b\"): fields.zoning must be set for a districts layer"), Some(15));
        assert_eq!(key_line(text, "source[0] (\"a\"): duplicate source id \"a\""), Some(7));
        assert_eq!(key_line(text, "subscriber[0] (\"w\"): target must be an http(s) URL with a host"), Some(16));
        assert_eq!(key_line(text, "source[2] (\"c\"): every must be at least 1s"), None);
        assert_eq!(key_line(text, "control.listen \"x\" is not an address"), None);
        // Headers with a comment or spaces inside the brackets are counted all the same.
        let commented = text.replace("[[source]]\nid = \"a\"", "[[ source ]]   # parcels\nid = \"a\"").replace("[delivery]", "[delivery] # retries");
        assert_eq!(key_line(&commented, "source[1] (\"b\"): every: duration \"0s\" is too short"), Some(13));
        assert_eq!(key_line(&commented, "delivery.idem_ttl must be positive"), Some(5));
    }

    #[test]
    fn parses_and_resolves_paths() {
        let cfg = Config::parse_str(GOOD, Path::new("/etc/zw")).unwrap();
        assert_eq!(cfg.store_path, PathBuf::from("/etc/zw/zw.redb"));
        assert_eq!(cfg.sources[0].kind, SourceKind::File { path: "/etc/zw/layers/z.geojson".into() });
        assert_eq!(cfg.sources[0].max_change_ratio, 0.05);
        assert_eq!(cfg.subscribers[0].min_severity, Severity::Material);
        assert_eq!(cfg.delivery.run_wait, Duration::from_secs(60));
        assert_eq!(cfg.store_cache_mib, 8, "default page cache");
        let big = GOOD.replacen("path = \"zw.redb\"", "path = \"zw.redb\"\ncache_mib = 256", 1);
        assert_eq!(Config::parse_str(&big, Path::new(".")).unwrap().store_cache_mib, 256);
        let zero = GOOD.replacen("path = \"zw.redb\"", "path = \"zw.redb\"\ncache_mib = 0", 1);
        assert!(Config::parse_str(&zero, Path::new(".")).unwrap_err().to_string().contains("cache_mib"));
        assert_eq!(cfg.run_retention, DEFAULT_RUN_RETENTION, "default run retention");
        let week = GOOD.replacen("path = \"zw.redb\"", "path = \"zw.redb\"\nrun_retention = \"7d\"", 1);
        assert_eq!(Config::parse_str(&week, Path::new(".")).unwrap().run_retention, Duration::from_secs(7 * 86_400));
        for bad in ["\"10m\"", "\"soon\"", "7"] {
            let text = GOOD.replacen("path = \"zw.redb\"", &format!("path = \"zw.redb\"\nrun_retention = {bad}"), 1);
            let err = Config::parse_str(&text, Path::new(".")).expect_err(bad).to_string();
            assert!(err.contains("run_retention"), "{bad}: {err}");
        }
    }

    #[test]
    fn rejects_unknown_keys_and_bad_values() {
        let typo = GOOD.replace("max_change_ratio", "x").replace("idem_ttl = \"7d\"", "idem_tl = \"7d\"");
        assert!(matches!(Config::parse_str(&typo, Path::new(".")), Err(ConfigError::Parse { .. })));
        let bad_bbox = GOOD.replace("[-72.0, 42.0, -71.0, 43.0]", "[-71.0, 42.0, -72.0, 43.0]");
        let err = Config::parse_str(&bad_bbox, Path::new(".")).unwrap_err().to_string();
        assert!(err.contains("bbox"), "{err}");
        let bad_sev = GOOD.replace("\"material\"", "\"loud\"");
        assert!(Config::parse_str(&bad_sev, Path::new(".")).is_err());
        let bad_layer = GOOD.replace("kind = \"file\"", "kind = \"file\"\nlayer = \"blocks\"");
        assert!(Config::parse_str(&bad_layer, Path::new(".")).unwrap_err().to_string().contains("blocks"));
        let stray_url = GOOD.replace("kind = \"file\"", "kind = \"file\"\nurl = \"http://127.0.0.1:1/x\"");
        assert!(Config::parse_str(&stray_url, Path::new(".")).unwrap_err().to_string().contains("url does not apply to kind = \"file\""));
        let stray_path = GOOD.replace("kind = \"file\"", "kind = \"geojson_url\"\nurl = \"http://127.0.0.1:1/x\"");
        assert!(Config::parse_str(&stray_path, Path::new(".")).unwrap_err().to_string().contains("`path` does not apply"));
        // Empty paths: refused when read, not at `serve`'s first write.
        let no_store = GOOD.replacen("path = \"zw.redb\"", "path = \"\"", 1);
        assert!(Config::parse_str(&no_store, Path::new("")).unwrap_err().to_string().contains("store.path must not be empty"));
        let no_token = format!("{GOOD}\n[control]\ntoken_file = \"\"\n");
        assert!(Config::parse_str(&no_token, Path::new("")).unwrap_err().to_string().contains("control.token_file must not be empty"));
        let bad_kind = GOOD.replace("kind = \"file\"", "kind = \"ftp\"");
        assert!(Config::parse_str(&bad_kind, Path::new(".")).unwrap_err().to_string().contains("ftp"));
        // Past what a semaphore holds or a wait fits: a clear error, not a panic in a sender.
        for (key, value, says) in [
            ("endpoint_concurrency", "3000000000000000000", "between 1 and 4096"),
            ("endpoint_concurrency", "0", "between 1 and 4096"),
            ("endpoint_rate", "1e-20", "at least 0.001"),
            ("max_retry_window", "\"0s\"", "must be positive"),
        ] {
            let bad = GOOD.replace("idem_ttl = \"7d\"", &format!("idem_ttl = \"7d\"\n{key} = {value}"));
            let err = Config::parse_str(&bad, Path::new(".")).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(says), "{key} = {value}: {err}");
        }
    }
}
