//! `[ingest]` settings and the HTTP source kinds' config keys. They live here rather than in
//! `config.rs` so the portal code owns its own knobs; `config.rs` only calls in.

use super::arcgis::ArcgisFormat;
use crate::config::SourceKind;
use crate::util::parse_duration;
use serde::Deserialize;
use std::time::Duration;

/// The slowest `ingest.rate_per_host` accepted: one request per ~17 minutes. A slower one
/// would pace a paged layer over weeks (and its waits would not fit a `Duration`).
pub const MIN_RATE_PER_HOST: f64 = 0.001;

/// The raw `[ingest]` table as written.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct RawIngest {
    max_attempts: Option<u32>,
    retry_budget: Option<String>,
    base_delay_ms: Option<u64>,
    max_delay_ms: Option<u64>,
    timeout_ms: Option<u64>,
    max_response_bytes: Option<u64>,
    rate_per_host: Option<f64>,
    allow_private_targets: Option<bool>,
    max_decompressed_bytes: Option<u64>,
    max_layer_bytes: Option<u64>,
    max_fetch_time: Option<String>,
}

/// `[ingest]`: how HTTP sources talk to portals. One budget for every source; the token
/// bucket is shared per host so several sources on one county server share its budget.
#[derive(Debug, Clone, PartialEq)]
pub struct IngestConfig {
    /// Attempts per request (the first try counts).
    pub max_attempts: u32,
    /// One source run's failed attempts and waits to retry, in all (a paced request that
    /// succeeds spends none of it; `max_fetch_time` bounds the fetch as a whole).
    pub retry_budget: Duration,
    pub base_delay: Duration,
    pub max_delay: Duration,
    /// How long a response may go silent (no head, no body bytes) before the attempt fails;
    /// each request's total is what is left of `max_fetch_time`.
    pub timeout: Duration,
    /// Cap on one response body as received on the wire (compressed bytes when the portal
    /// compresses).
    pub max_response_bytes: u64,
    /// Requests per second per host (token bucket, burst = max(1, rate)).
    pub rate_per_host: f64,
    /// Allow portals on loopback / private addresses (tests, on-premise portals).
    pub allow_private_targets: bool,
    /// Cap on one response body after `gzip` / `deflate` decoding (also applies to identity
    /// bodies), so a gzip bomb fails once this many bytes have been produced.
    pub max_decompressed_bytes: u64,
    /// Cap on all the pages of one paged scan (`arcgis`, `ogcapi`, `socrata`) added up,
    /// after decoding: a server that keeps answering full pages stops here.
    pub max_layer_bytes: u64,
    /// Wall-clock limit on one run's fetch, every request and page of it: no new request
    /// is sent past it (a slow server that keeps answering would otherwise be paged on for
    /// as long as it takes to reach `max_layer_bytes`).
    pub max_fetch_time: Duration,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            max_attempts: 5,
            retry_budget: Duration::from_secs(300),
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            timeout: Duration::from_secs(60),
            max_response_bytes: 512 * 1024 * 1024,
            rate_per_host: 2.0,
            allow_private_targets: false,
            max_decompressed_bytes: 1024 * 1024 * 1024,
            max_layer_bytes: 4 * 1024 * 1024 * 1024,
            max_fetch_time: Duration::from_secs(12 * 3600),
        }
    }
}

impl RawIngest {
    /// Validates `[ingest]`; errors name the key.
    pub fn validate(&self) -> Result<IngestConfig, String> {
        let d = IngestConfig::default();
        let cfg = IngestConfig {
            max_attempts: self.max_attempts.unwrap_or(d.max_attempts),
            retry_budget: match &self.retry_budget {
                Some(s) => parse_duration(s).map_err(|e| format!("ingest.retry_budget: {e}"))?,
                None => d.retry_budget,
            },
            base_delay: self.base_delay_ms.map(Duration::from_millis).unwrap_or(d.base_delay),
            max_delay: self.max_delay_ms.map(Duration::from_millis).unwrap_or(d.max_delay),
            timeout: self.timeout_ms.map(Duration::from_millis).unwrap_or(d.timeout),
            max_response_bytes: self.max_response_bytes.unwrap_or(d.max_response_bytes),
            rate_per_host: self.rate_per_host.unwrap_or(d.rate_per_host),
            allow_private_targets: self.allow_private_targets.unwrap_or(false),
            max_decompressed_bytes: self.max_decompressed_bytes.unwrap_or(d.max_decompressed_bytes),
            max_layer_bytes: self.max_layer_bytes.unwrap_or(d.max_layer_bytes),
            max_fetch_time: match &self.max_fetch_time {
                Some(s) => parse_duration(s).map_err(|e| format!("ingest.max_fetch_time: {e}"))?,
                None => d.max_fetch_time,
            },
        };
        if cfg.max_attempts == 0 || cfg.max_attempts > 100 {
            return Err("ingest.max_attempts must be between 1 and 100".into());
        }
        if cfg.max_delay < cfg.base_delay {
            return Err("ingest.max_delay_ms must be >= ingest.base_delay_ms".into());
        }
        if cfg.timeout.is_zero() {
            return Err("ingest.timeout_ms must be positive".into());
        }
        if cfg.max_response_bytes < 1024 {
            return Err("ingest.max_response_bytes must be at least 1024".into());
        }
        if cfg.max_decompressed_bytes < 1024 {
            return Err("ingest.max_decompressed_bytes must be at least 1024".into());
        }
        if cfg.max_layer_bytes < 1024 {
            return Err("ingest.max_layer_bytes must be at least 1024".into());
        }
        if cfg.max_fetch_time.is_zero() {
            return Err("ingest.max_fetch_time must be positive".into());
        }
        if !(cfg.rate_per_host.is_finite() && cfg.rate_per_host >= MIN_RATE_PER_HOST) {
            return Err(format!("ingest.rate_per_host must be a number of requests per second of at least {MIN_RATE_PER_HOST}"));
        }
        Ok(cfg)
    }
}

/// Builds an HTTP source kind from its `kind`, `url`, `page_size` and `format` keys;
/// `Ok(None)` when `kind` is not an HTTP kind.
pub fn http_kind(kind: &str, url: Option<&str>, page_size: Option<u32>, format: Option<&str>) -> Result<Option<SourceKind>, String> {
    if !matches!(kind, "geojson_url" | "arcgis" | "ogcapi" | "socrata") {
        return Ok(None);
    }
    let arcgis_format = match format {
        None => ArcgisFormat::default(),
        Some(f) if kind == "arcgis" => ArcgisFormat::parse(f).ok_or_else(|| format!("format = {f:?}: expected \"json\" or \"geojson\""))?,
        Some(_) => return Err(format!("format applies only to kind = \"arcgis\", not {kind:?}")),
    };
    let url = url.ok_or_else(|| format!("kind = {kind:?} needs `url`"))?.trim().to_string();
    let parsed = reqwest::Url::parse(&url).map_err(|e| format!("url {url:?} is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(format!("url {url:?} must be an http(s) URL with a host"));
    }
    if page_size == Some(0) {
        return Err("page_size must be at least 1".into());
    }
    Ok(Some(match kind {
        "geojson_url" => {
            if page_size.is_some() {
                return Err("page_size does not apply to kind = \"geojson_url\"".into());
            }
            SourceKind::GeojsonUrl { url }
        }
        "arcgis" => SourceKind::Arcgis { url: url.trim_end_matches('/').to_string(), page_size: page_size.unwrap_or(1000), format: arcgis_format },
        "ogcapi" => SourceKind::Ogcapi { url: url.trim_end_matches('/').to_string(), limit: page_size.unwrap_or(10_000) },
        _ => {
            // What `run` reads: the resource's GeoJSON form. Refused here, so that `check`
            // says so too (the `.json` form answers rows without geometry, which read as
            // "invalid JSON", and a views URL as a bad URL, only once a run fetched them).
            let resource = parsed.path().rsplit_once("/resource/").map_or("", |(_, r)| r);
            if !resource.strip_suffix(".geojson").is_some_and(|id| !id.is_empty() && !id.contains('/')) {
                return Err(format!(
                    "url {url:?}: kind = \"socrata\" reads a SODA resource's GeoJSON form, a URL like https://host/resource/abcd-1234.geojson (not the .json form, whose rows carry no geometry, nor an /api/views/ URL)"
                ));
            }
            // The scan reads one row per parcel, paged by its own $limit/$offset/$order and
            // checked against count(*) of the same $where: a grouped query's rows are groups
            // (its count(*) counts each group's rows), and $query replaces the whole scan.
            for (key, _) in parsed.query_pairs() {
                if ["$group", "$having", "$query"].iter().any(|k| k.eq_ignore_ascii_case(&key)) {
                    return Err(format!(
                        "url {url:?}: {key} is not taken for kind = \"socrata\": zonewatch reads the resource's rows one per parcel and pages them itself ($where, $select and $q are taken)"
                    ));
                }
            }
            SourceKind::Socrata { url, page_size: page_size.unwrap_or(1000) }
        }
    }))
}

/// The URL an HTTP source kind reads (`None` for a file).
pub fn kind_url(kind: &SourceKind) -> Option<&str> {
    match kind {
        SourceKind::File { .. } => None,
        SourceKind::GeojsonUrl { url } | SourceKind::Arcgis { url, .. } | SourceKind::Ogcapi { url, .. } | SourceKind::Socrata { url, .. } => Some(url),
    }
}

/// `kind=arcgis url=… page_size=…` for `zonewatch check`.
pub fn describe_kind(kind: &SourceKind) -> String {
    match kind {
        SourceKind::File { path } => format!("kind=file path={}", path.display()),
        SourceKind::GeojsonUrl { url } => format!("kind=geojson_url url={url}"),
        SourceKind::Arcgis { url, page_size, format } => format!("kind=arcgis url={url} page_size={page_size} format={}", format.as_str()),
        SourceKind::Ogcapi { url, limit } => format!("kind=ogcapi url={url} limit={limit}"),
        SourceKind::Socrata { url, page_size } => format!("kind=socrata url={url} page_size={page_size}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    fn cfg(kind_lines: &str, ingest: &str) -> Result<Config, String> {
        let text = format!(
            "[store]\npath = \"z.redb\"\n{ingest}\n[[source]]\nid = \"a\"\njurisdiction = \"t\"\n{kind_lines}\n[source.fields]\nparcel_id = \"APN\"\nzoning = \"Z\"\n"
        );
        Config::parse_str(&text, Path::new("/etc")).map_err(|e| e.to_string())
    }

    #[test]
    fn http_kinds_parse_with_defaults() {
        let c = cfg("kind = \"arcgis\"\nurl = \"https://gis.example.gov/arcgis/rest/services/P/FeatureServer/0/\"", "").unwrap();
        assert_eq!(
            c.sources[0].kind,
            SourceKind::Arcgis { url: "https://gis.example.gov/arcgis/rest/services/P/FeatureServer/0".into(), page_size: 1000, format: ArcgisFormat::Json }
        );
        let g = cfg("kind = \"arcgis\"\nurl = \"https://gis.example.gov/a/FeatureServer/3\"\nformat = \"geojson\"", "[ingest]\nmax_decompressed_bytes = 2048").unwrap();
        assert!(matches!(g.sources[0].kind, SourceKind::Arcgis { format: ArcgisFormat::Geojson, .. }));
        assert_eq!(g.ingest.max_decompressed_bytes, 2048);
        assert_eq!(c.ingest.max_layer_bytes, 4 << 30, "4 GiB by default");
        let l = cfg("kind = \"socrata\"\nurl = \"https://x/resource/a.geojson\"", "[ingest]\nmax_layer_bytes = 65536").unwrap();
        assert_eq!(l.ingest.max_layer_bytes, 65536);
        // Only the GeoJSON form of a resource is read: the forms an operator may try first
        // are refused when the config is read (`check` too), not by the first run.
        for url in ["https://x/resource/a.json", "https://x/resource/a", "https://x/api/views/a", "https://x/resource/.geojson", "https://x/data/a.geojson"] {
            let err = cfg(&format!("kind = \"socrata\"\nurl = \"{url}\""), "").unwrap_err();
            assert!(err.contains("reads a SODA resource's GeoJSON form"), "{url}: {err}");
        }
        // Nor a query that makes its rows groups, or replaces the scan's paging.
        for (url, key) in [("https://x/resource/a.geojson?$group=zone", "$group"), ("https://x/resource/a.geojson?%24HAVING=1", "$HAVING"), ("https://x/resource/a.geojson?$query=select%20*", "$query")] {
            let err = cfg(&format!("kind = \"socrata\"\nurl = \"{url}\""), "").unwrap_err();
            assert!(err.contains(&format!("{key} is not taken")), "{url}: {err}");
        }
        assert!(cfg("kind = \"socrata\"\nurl = \"https://x/resource/a.geojson?$where=zone='R1'&$select=:*,*&$q=main\"", "").is_ok());
        assert_eq!(c.sources[0].floor, Duration::from_secs(86_400));
        assert_eq!(c.sources[0].stale_after, Duration::from_secs(45 * 86_400));
        assert_eq!(c.ingest, IngestConfig::default());
        let c = cfg("kind = \"geojson_url\"\nurl = \"https://x.example/l.geojson\"\nfloor = \"6h\"", "[ingest]\nrate_per_host = 0.5\nretry_budget = \"2m\"").unwrap();
        assert_eq!(c.sources[0].floor, Duration::from_secs(6 * 3600));
        assert_eq!(c.ingest.rate_per_host, 0.5);
        assert_eq!(c.ingest.retry_budget, Duration::from_secs(120));
    }

    #[test]
    fn http_kinds_reject_bad_values() {
        assert!(cfg("kind = \"arcgis\"", "").unwrap_err().contains("needs `url`"));
        assert!(cfg("kind = \"ogcapi\"\nurl = \"ftp://x/y\"", "").unwrap_err().contains("http(s)"));
        assert!(cfg("kind = \"socrata\"\nurl = \"https://x/resource/a.json\"\npage_size = 0", "").unwrap_err().contains("page_size"));
        assert!(cfg("kind = \"geojson_url\"\nurl = \"https://x/a\"", "[ingest]\nrate_per_host = 0.0").unwrap_err().contains("rate_per_host"));
        // So slow its waits would not fit a Duration (and would pace a layer over weeks).
        assert!(cfg("kind = \"geojson_url\"\nurl = \"https://x/a\"", "[ingest]\nrate_per_host = 1e-20").unwrap_err().contains("at least 0.001"));
        assert!(cfg("kind = \"geojson_url\"\nurl = \"https://x/a\"", "[ingest]\nbogus = 1").is_err());
        assert!(cfg("kind = \"arcgis\"\nurl = \"https://x/a/0\"\nformat = \"pbf\"", "").unwrap_err().contains("geojson"));
        assert!(cfg("kind = \"ogcapi\"\nurl = \"https://x/c\"\nformat = \"geojson\"", "").unwrap_err().contains("only to kind"));
        assert!(cfg("kind = \"geojson_url\"\nurl = \"https://x/a\"", "[ingest]\nmax_decompressed_bytes = 10").unwrap_err().contains("max_decompressed_bytes"));
        assert!(cfg("kind = \"socrata\"\nurl = \"https://x/resource/a.geojson\"", "[ingest]\nmax_layer_bytes = 1000").unwrap_err().contains("ingest.max_layer_bytes"));
        assert!(cfg("kind = \"socrata\"\nurl = \"https://x/resource/a.geojson\"", "[ingest]\nmax_layer_bytes = -1").is_err());
    }
}
