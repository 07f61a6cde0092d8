//! The HTTP transport of the portal source kinds. It exists so that every portal protocol
//! (`geojson_url`, `arcgis`, `ogcapi`, `socrata`) gets the same discipline:
//!
//! * retry only 408/429/5xx, timeouts and connection errors (a truncated body is a connection
//!   error); any other 4xx fails fast;
//! * capped exponential backoff with full jitter, bounded by `max_attempts` per request **and**
//!   by one wall-clock budget per source run ([`Session`]); `Retry-After` (seconds or HTTP-date)
//!   is a floor, and a `Retry-After` beyond the budget fails at once;
//! * a per-host token bucket shared by every source of the process (`rate_per_host`);
//! * `gzip` / `deflate` bodies are asked for and decoded while they stream in
//!   ([`super::decode`]): the bytes on the wire are capped at `max_response_bytes` and the
//!   decoded bytes at `max_decompressed_bytes`, so a gzip bomb stops at the cap; a corrupt
//!   stream is a permanent error; other encodings (`br`, `zstd`) are refused;
//! * HTML / WAF pages where JSON was expected fail with the status, content type and first bytes;
//! * redirects are followed by hand (at most 5) so every hop passes the private-target guard.

use super::decode::{BodyDecoder, DecodeError, Encoding};
use super::numbers::quote_unreadable_numbers;
use super::source::DigestingWriter;
use super::settings::IngestConfig;
use crate::notify::delivery::parse_retry_after;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Why a portal request failed. Every variant names the URL it is about.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{url}: HTTP {status} (not retryable){detail}")]
    Status { url: String, status: u16, detail: String },
    #[error("{url}: gave up after {attempts} attempt(s): {last}")]
    RetriesExhausted { url: String, attempts: u32, last: String },
    #[error("{url}: gave up after {attempts} attempt(s): the run's failed attempts and waits to retry would pass its retry budget of {budget_ms} ms ([ingest] retry_budget): {last}")]
    BudgetExhausted { url: String, attempts: u32, budget_ms: u64, last: String },
    #[error("{url}: expected JSON but got HTTP {status} content-type {content_type:?}, body starts {first_bytes:?}")]
    NotJson { url: String, status: u16, content_type: String, first_bytes: String },
    #[error("{url}: response is larger than the configured cap of {limit} bytes ([ingest] max_response_bytes)")]
    TooLarge { url: String, limit: u64 },
    #[error("{url}: response is content-encoded ({encoding}), which zonewatch does not decode (it asks for gzip, deflate or identity); refused")]
    Encoded { url: String, encoding: String },
    #[error("{url}: refused: {host} resolves to private address {ip} (set [ingest] allow_private_targets = true to allow)")]
    PrivateTarget { url: String, host: String, ip: IpAddr },
    #[error("{url}: bad URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("{url}: invalid JSON: {reason}")]
    BadJson { url: String, reason: String },
    #[error("{url}: ArcGIS error {code}: {message}")]
    Arcgis { url: String, code: i64, message: String },
    #[error("{url}: ArcGIS authentication error {code}: {message}")]
    Auth { url: String, code: i64, message: String },
    #[error("{url}: {reason}")]
    Protocol { url: String, reason: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    /// A stop was requested while the fetch ran (`crate::run_stop`): it was dropped.
    #[error("stopped: zonewatch is shutting down; nothing of this run was committed, and the next run fetches the layer again")]
    Stopped,
    /// The fetch could not run to an answer for a reason inside zonewatch (its runtime would
    /// not start, or its thread panicked): a bug or an exhausted machine, never the portal's
    /// doing, and said so rather than blamed on the HTTP client. Nothing was committed.
    #[error("the fetch stopped on an internal error: {0} (not the portal's doing; nothing of this run was committed)")]
    Internal(String),
    #[error("{url}: {encoding} response decodes to more than the configured cap of {limit} bytes ([ingest] max_decompressed_bytes); stopped after {wire_bytes} bytes on the wire")]
    DecodedTooLarge { url: String, encoding: String, limit: u64, wire_bytes: u64 },
    #[error("{url}: {reason}")]
    Corrupt { url: String, reason: String },
    #[error("{url}: the layer's pages add up to more than the configured cap of {limit} bytes ([ingest] max_layer_bytes); stopped after {read} bytes")]
    LayerTooLarge { url: String, limit: u64, read: u64 },
    #[error("the fetched layer on disk in {dir}: {source}")]
    Spool { dir: std::path::PathBuf, source: std::io::Error },
    #[error("{url}: the fetch has gone on for {elapsed_s} s, past the configured limit of {limit_s} s ([ingest] max_fetch_time); {stopped}")]
    FetchTooLong { url: String, limit_s: u64, elapsed_s: u64, stopped: &'static str },
}

impl FetchError {
    /// An error of the fetched layer's file in `dir` (a body or a paged layer's collection).
    /// A file-size limit met there is the store's limit too (`store::note_io_error`).
    pub(super) fn spool(dir: &std::path::Path, source: std::io::Error) -> FetchError {
        crate::store::note_io_error(&source);
        FetchError::Spool { dir: dir.to_path_buf(), source }
    }
}

/// One received response (2xx or 304).
#[derive(Debug, Clone)]
pub struct Response {
    pub url: String,
    pub status: u16,
    pub content_type: String,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    /// The `Content-Crs` header (OGC API – Features Part 2: the CRS of the coordinates).
    pub content_crs: Option<String>,
    /// The body; for one streamed to a [`BodyFile`] ([`Session::get_to_file`]) or spilled
    /// to disk, only up to a KiB of it from its first byte that is not whitespace (what
    /// [`Response::expect_json`] looks at).
    pub body: Vec<u8>,
    /// True when the body went to the caller's [`BodyFile`]: the parsing methods then refuse.
    pub streamed: bool,
    /// The body, when it was larger than [`Session::page_in_memory`]: in a temp file, read
    /// back by the parsing methods.
    pub spilled: Option<Spilled>,
}

/// A body too large to hold, received into an anonymous temp file in the session's
/// `spool_dir` (gone when the last handle is closed, also after a crash).
#[derive(Debug, Clone)]
pub struct Spilled {
    file: std::sync::Arc<std::fs::File>,
    size: u64,
}

/// A response body as JSON text to parse.
enum JsonText<'a> {
    Held(std::borrow::Cow<'a, [u8]>),
    /// Read back from its spool file, the byte order mark skipped and the numbers a `Value`
    /// cannot hold quoted on the way.
    Spilled(std::io::BufReader<super::numbers::QuotingReader<std::io::BufReader<std::fs::File>>>),
}

/// Where [`Session::get_to_file`] streams a body: a temp file in `dir`, digested as it is
/// written and started over on every attempt, so a county's GeoJSON download never sits in
/// memory and a retried attempt never leaves the bytes of a failed one behind.
pub struct BodyFile {
    out: DigestingWriter<std::fs::File>,
    dir: std::path::PathBuf,
    /// The file's name when it has one ([`BodyFile::named`]; removed when dropped).
    name: Option<tempfile::TempPath>,
    head: Vec<u8>,
}

/// A body received whole: its file at its first byte, the file's name when it has one (so it
/// can be renamed into place instead of copied; removed when dropped), its hex sha256 and
/// size.
#[derive(Debug)]
pub struct ReceivedBody {
    pub file: std::fs::File,
    pub name: Option<tempfile::TempPath>,
    /// The folder the body's file is in: the staging directory when it is named there, the
    /// scratch directory when it is not.
    pub dir: std::path::PathBuf,
    pub digest: String,
    pub size: u64,
}

/// How much of a streamed body [`Response::body`] keeps.
const BODY_HEAD: usize = 1024;

impl BodyFile {
    /// An anonymous temp file in `dir` (gone when its last handle is closed, also after a
    /// crash).
    pub fn new(dir: &std::path::Path) -> Result<BodyFile, FetchError> {
        let file = tempfile::tempfile_in(dir).map_err(|e| FetchError::spool(dir, e))?;
        Ok(BodyFile { out: DigestingWriter::new(file), dir: dir.to_path_buf(), name: None, head: Vec::new() })
    }

    /// A body file that is the named temp file `tmp` (in `dir`), removed when dropped unless
    /// its name is kept ([`ReceivedBody::name`]).
    pub fn named(tmp: tempfile::NamedTempFile, dir: &std::path::Path) -> BodyFile {
        let (file, name) = tmp.into_parts();
        BodyFile { out: DigestingWriter::new(file), dir: dir.to_path_buf(), name: Some(name), head: Vec::new() }
    }

    fn restart(&mut self) -> std::io::Result<()> {
        use std::io::Seek;
        self.out.get_mut().set_len(0)?;
        self.out.get_mut().seek(std::io::SeekFrom::Start(0))?;
        self.out.restart();
        self.head.clear();
        Ok(())
    }

    pub(super) fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.out.write_all(bytes)?;
        // The head starts at the first byte that is not whitespace, however far in: a WAF
        // page after a run of blank lines is still seen as HTML.
        let text = if self.head.is_empty() { bytes.iter().position(|b| !b.is_ascii_whitespace()).map_or(&[][..], |i| &bytes[i..]) } else { bytes };
        let room = BODY_HEAD.saturating_sub(self.head.len()).min(text.len());
        self.head.extend_from_slice(&text[..room]);
        Ok(())
    }

    fn error(&self, source: std::io::Error) -> FetchError {
        FetchError::spool(&self.dir, source)
    }

    /// The body written, its file at its first byte.
    pub fn finish(self) -> Result<ReceivedBody, FetchError> {
        use std::io::Seek;
        let BodyFile { out, dir, name, .. } = self;
        let (mut file, digest, size) = out.finish();
        file.seek(std::io::SeekFrom::Start(0)).map_err(|e| FetchError::spool(&dir, e))?;
        Ok(ReceivedBody { file, name, dir, digest, size })
    }
}

impl std::fmt::Debug for BodyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyFile").field("dir", &self.dir).finish()
    }
}

impl Response {
    /// Checks the body looks like JSON (not an HTML / WAF page) and reads the first element
    /// of the array it must be, skipping the rest unparsed ([`super::page::first_element`]).
    pub fn first_element(&self) -> Result<Option<serde_json::Value>, FetchError> {
        use serde_json::Deserializer;
        match self.json_text()? {
            JsonText::Held(body) => super::page::first_element(&self.url, Deserializer::from_slice(&body)),
            JsonText::Spilled(reader) => super::page::first_element(&self.url, Deserializer::from_reader(reader)),
        }
    }

    /// The body's size in bytes (decoded), held or spilled.
    pub fn size(&self) -> u64 {
        self.spilled.as_ref().map_or(self.body.len() as u64, |s| s.size)
    }

    /// Checks the body looks like JSON and reads it as a page of features, handing each to
    /// `each` as it is parsed and keeping the other members named in `keep`
    /// ([`super::page::read_features`]: the page is never one tree).
    pub fn features(&self, keep: &[&str], each: impl FnMut(serde_json::Value) -> Result<(), FetchError>) -> Result<super::page::PageHead, FetchError> {
        use serde_json::Deserializer;
        match self.json_text()? {
            JsonText::Held(body) => super::page::read_features(&self.url, Deserializer::from_slice(&body), keep, each),
            JsonText::Spilled(reader) => super::page::read_features(&self.url, Deserializer::from_reader(reader), keep, each),
        }
    }

    /// The members named in `keep` of a JSON object answer (layer metadata, a count), read
    /// as a page is: a `features` array in it (a server that answers a whole layer where a
    /// count was asked) is parsed one feature at a time and dropped.
    pub fn members(&self, keep: &[&str]) -> Result<serde_json::Value, FetchError> {
        Ok(self.features(keep, |_| Ok(()))?.members)
    }

    /// The body as JSON text to parse: refused when it was streamed to the caller's file or
    /// looks like HTML, without a UTF-8 byte order mark (some Windows-hosted portals send one;
    /// it is not JSON but says nothing either, and is skipped as a file layer's is), and with
    /// the numbers a `Value` cannot hold quoted ([`quote_unreadable_numbers`]).
    fn json_text(&self) -> Result<JsonText<'_>, FetchError> {
        if self.streamed {
            return Err(FetchError::Protocol { url: self.url.clone(), reason: "the body was streamed to disk, not kept to be parsed".into() });
        }
        self.expect_json()?;
        if let Some(spilled) = &self.spilled {
            use std::io::{Read, Seek, SeekFrom};
            let unreadable = |e: std::io::Error| FetchError::Protocol { url: self.url.clone(), reason: format!("cannot read the body back from its spool file: {e}") };
            // A second handle on the file, at the first byte after a byte order mark: a
            // parse reads from the start every time. (It shares the file's offset with the
            // first: parses of one response run one after another, never two at once.)
            let mut file = spilled.file.try_clone().map_err(unreadable)?;
            let mut bom = [0u8; 3];
            file.seek(SeekFrom::Start(0)).map_err(unreadable)?;
            let start = match file.read_exact(&mut bom) {
                Ok(()) if bom == *b"\xEF\xBB\xBF" => 3,
                _ => 0,
            };
            file.seek(SeekFrom::Start(start)).map_err(unreadable)?;
            // serde_json reads a byte at a time: the outer buffer serves those from memory.
            let quoting = super::numbers::QuotingReader::new(std::io::BufReader::with_capacity(1 << 16, file));
            return Ok(JsonText::Spilled(std::io::BufReader::with_capacity(1 << 16, quoting)));
        }
        let body = self.body_after_bom();
        Ok(JsonText::Held(quote_unreadable_numbers(body).map_or(std::borrow::Cow::Borrowed(body), std::borrow::Cow::Owned)))
    }

    /// The body without a leading UTF-8 byte order mark.
    fn body_after_bom(&self) -> &[u8] {
        self.body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&self.body)
    }

    /// Refuses HTML (by content type or by a leading `<`) where JSON was expected.
    pub fn expect_json(&self) -> Result<(), FetchError> {
        let first = self.body_after_bom().iter().find(|b| !b.is_ascii_whitespace()).copied();
        if self.content_type.to_ascii_lowercase().contains("html") || first == Some(b'<') {
            return Err(FetchError::NotJson {
                url: self.url.clone(),
                status: self.status,
                content_type: self.content_type.clone(),
                first_bytes: first_bytes(&self.body),
            });
        }
        Ok(())
    }
}

fn first_bytes(body: &[u8]) -> String {
    let s: String = String::from_utf8_lossy(&body[..body.len().min(120)]).chars().filter(|c| !c.is_control()).collect();
    s
}

/// A token bucket: `rate` tokens per second, at most `burst` saved.
struct Bucket {
    tokens: f64,
    last: Instant,
}

fn buckets() -> &'static Mutex<HashMap<String, Bucket>> {
    static B: OnceLock<Mutex<HashMap<String, Bucket>>> = OnceLock::new();
    B.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The host map is pruned of refilled buckets when it holds this many.
const PRUNE_BUCKETS_ABOVE: usize = 256;

/// Reserves one request on `host`'s bucket and returns how long to wait before sending it.
/// Reservations go negative, so concurrent callers queue fairly instead of racing.
pub fn reserve(host: &str, rate: f64, now: Instant) -> Duration {
    let Ok(mut map) = buckets().lock() else { return Duration::ZERO };
    reserve_in(&mut map, host, rate, now)
}

fn reserve_in(map: &mut HashMap<String, Bucket>, host: &str, rate: f64, now: Instant) -> Duration {
    let burst = rate.max(1.0);
    if map.len() >= PRUNE_BUCKETS_ABOVE {
        // A bucket idle long enough to be full again is the same as a new one: drop it, so a
        // daemon that met many hosts (or tests with many loopback ports) keeps a bounded map.
        map.retain(|_, b| b.tokens + now.saturating_duration_since(b.last).as_secs_f64() * rate < burst);
    }
    let b = map.entry(host.to_string()).or_insert(Bucket { tokens: burst, last: now });
    let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
    b.tokens = (b.tokens + elapsed * rate).min(burst);
    b.last = now;
    b.tokens -= 1.0;
    if b.tokens >= 0.0 {
        Duration::ZERO
    } else {
        // (A rate is at least `MIN_RATE_PER_HOST`; a wait past what a Duration holds is never.)
        Duration::try_from_secs_f64(-b.tokens / rate).unwrap_or(Duration::MAX)
    }
}

/// Capped exponential backoff with full jitter: uniform in `[0, min(max, base·2^(attempt-1))]`;
/// `Retry-After` is a floor.
pub fn backoff(cfg: &IngestConfig, attempt: u32, retry_after: Option<Duration>) -> Duration {
    crate::util::full_jitter_backoff(cfg.base_delay, cfg.max_delay, attempt, retry_after)
}

/// One source run's view of the transport: the client, the settings and the run's retry
/// budget. Requests made through one session share the budget.
pub struct Session {
    /// The SSRF guard `client` was built with.
    guard: crate::netguard::Guard,
    client: reqwest::Client,
    pub cfg: IngestConfig,
    /// Time the run has spent on failed attempts and on waits before retrying them (ms):
    /// what `retry_budget` bounds. A paged scan of a large layer that answers every request
    /// spends none of it, however long it runs (`max_fetch_time` bounds that).
    retry_spent_ms: std::sync::atomic::AtomicU64,
    /// Time spent waiting for a host's rate (ms): taken out of a failed attempt's time before
    /// it is counted against the retry budget.
    rate_waited_ms: std::sync::atomic::AtomicU64,
    started: Instant,
    /// The run's time at `started` (ms since the epoch).
    started_ms: u64,
    /// Requests sent (every attempt), for reports and tests.
    pub requests: std::sync::atomic::AtomicU32,
    /// Bytes received on the wire by every request of the fetch, for its progress.
    received: std::sync::atomic::AtomicU64,
    /// Where the fetch's progress goes (`zonewatch run`): requests and bytes received, as
    /// they arrive; a county's portal fetch takes minutes.
    pub progress: Option<std::sync::Arc<crate::progress::IngestProgress>>,
    /// Where a paged scan collects its features ([`super::collect`]): the system's temp
    /// directory unless set; a run sets its store's directory (on disk, where `/tmp` may be
    /// memory). A response larger than `page_in_memory` is received into a temp file here.
    pub spool_dir: std::path::PathBuf,
    /// The most bytes of one response held in memory ([`PAGE_IN_MEMORY`] unless set): past
    /// it, the body moves to a temp file as it arrives and is parsed from there, so a server
    /// that ignores the page size asked for and answers a whole county in one page costs
    /// disk, not memory.
    pub page_in_memory: u64,
}

/// [`Session::page_in_memory`]'s default: 16 MiB, eight times a 2,000-feature page of county
/// parcels.
pub const PAGE_IN_MEMORY: u64 = 16 << 20;

/// What made an attempt fail in a way worth retrying.
struct Retryable {
    why: String,
    retry_after: Option<Duration>,
}

impl Session {
    /// A session for one run that started at `now_ms` (the run's time, from its clock).
    pub fn new(cfg: &IngestConfig, now_ms: u64) -> Result<Session, FetchError> {
        // Names are checked by the resolver, on the addresses connected to (`netguard`).
        let guard = crate::netguard::Guard::new(cfg.allow_private_targets);
        let client = guard
            .client(reqwest::Client::builder())
            .redirect(reqwest::redirect::Policy::none())
            // `timeout_ms` is how long a response may go silent (waiting for its head, or
            // between two reads of its body), not how long all of it may take: a county's
            // 1 GB GeoJSON takes minutes to arrive. Each request's total is what is left of
            // `max_fetch_time` (set per request below).
            .read_timeout(cfg.timeout)
            .connect_timeout(cfg.timeout.min(Duration::from_secs(15)))
            .user_agent(concat!("zonewatch/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| FetchError::Client(e.to_string()))?;
        let now = Instant::now();
        Ok(Session { client, guard, cfg: cfg.clone(), retry_spent_ms: Default::default(), rate_waited_ms: Default::default(), started: now, started_ms: now_ms, requests: Default::default(), received: Default::default(), progress: None, spool_dir: std::env::temp_dir(), page_in_memory: PAGE_IN_MEMORY })
    }

    /// Waits before retry `attempt` (1-based count of failures so far) or fails when attempts
    /// or the run's budget are spent.
    pub async fn pause_before_retry(&self, url: &str, attempt: u32, why: &str, retry_after: Option<Duration>) -> Result<(), FetchError> {
        if attempt >= self.cfg.max_attempts {
            return Err(FetchError::RetriesExhausted { url: url.to_string(), attempts: attempt, last: why.to_string() });
        }
        let delay = backoff(&self.cfg, attempt, retry_after);
        let spent = Duration::from_millis(self.retry_spent_ms.load(std::sync::atomic::Ordering::Relaxed));
        if spent.saturating_add(delay) > self.cfg.retry_budget {
            return Err(FetchError::BudgetExhausted {
                url: url.to_string(),
                attempts: attempt,
                budget_ms: self.cfg.retry_budget.as_millis() as u64,
                last: match retry_after {
                    Some(ra) => format!("{why}; the server asked to wait {} ms (Retry-After, read up to a day)", ra.as_millis()),
                    None => format!("{why}; next wait {} ms", delay.as_millis()),
                },
            });
        }
        self.spend_on_retries(delay);
        tokio::time::sleep(delay).await;
        Ok(())
    }

    /// The fetch has run `elapsed`, up to (or past) `max_fetch_time`: no request to `url`
    /// (`during`: the request to `url` was cut at the limit, its answer not whole).
    fn too_long(&self, url: &str, elapsed: Duration, during: bool) -> FetchError {
        let stopped = if during { "stopped during this request (its answer was cut at the limit)" } else { "stopped before this request" };
        FetchError::FetchTooLong { url: url.to_string(), limit_s: self.cfg.max_fetch_time.as_secs(), elapsed_s: elapsed.as_secs(), stopped }
    }

    /// Counts `d` against the run's retry budget (a failed attempt's time, a wait to retry).
    fn spend_on_retries(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let _ = self.retry_spent_ms.fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |v| Some(v.saturating_add(ms)));
    }

    /// Time spent since the session started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The run's time now: its start plus the (monotonic) time spent since.
    pub fn now_ms(&self) -> u64 {
        self.started_ms + self.started.elapsed().as_millis() as u64
    }

    /// GET with retries; returns a 2xx or 304 response. `headers` are sent as given.
    pub async fn get(&self, url: &str, headers: &[(&str, String)]) -> Result<Response, FetchError> {
        self.get_with(url, headers, None).await
    }

    /// [`Session::get`], the body streamed to `body` instead of held (the response keeps up
    /// to a KiB of it from its first non-whitespace byte, for the HTML check); each attempt
    /// starts the file over. The caps are the same.
    pub async fn get_to_file(&self, url: &str, headers: &[(&str, String)], body: &mut BodyFile) -> Result<Response, FetchError> {
        self.get_with(url, headers, Some(body)).await
    }

    async fn get_with(&self, url: &str, headers: &[(&str, String)], mut sink: Option<&mut BodyFile>) -> Result<Response, FetchError> {
        let mut attempt = 0u32;
        loop {
            // Every request of the run counts against its fetch time: a server that keeps
            // answering (fresh junk under a huge count, slowly) is stopped, not paged for days.
            let elapsed = self.started.elapsed();
            if elapsed > self.cfg.max_fetch_time {
                return Err(self.too_long(url, elapsed, false));
            }
            attempt += 1;
            let tried = Instant::now();
            let paced_before = self.rate_waited_ms.load(std::sync::atomic::Ordering::Relaxed);
            match self.get_once(url, headers, sink.as_deref_mut()).await? {
                Ok(resp) => return Ok(resp),
                Err(r) => {
                    let elapsed = self.started.elapsed();
                    if elapsed >= self.cfg.max_fetch_time {
                        // The attempt was cut at the fetch's limit: that, not the retries, ended it.
                        return Err(self.too_long(url, elapsed, true));
                    }
                    let paced = self.rate_waited_ms.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(paced_before);
                    self.spend_on_retries(tried.elapsed().saturating_sub(Duration::from_millis(paced)));
                    self.pause_before_retry(url, attempt, &r.why, r.retry_after).await?
                }
            }
        }
    }

    /// One attempt (following redirects). Outer error: permanent; inner error: retryable.
    async fn get_once(&self, url: &str, headers: &[(&str, String)], mut sink: Option<&mut BodyFile>) -> Result<Result<Response, Retryable>, FetchError> {
        let mut current = reqwest::Url::parse(url).map_err(|e| FetchError::BadUrl { url: url.to_string(), reason: e.to_string() })?;
        for _hop in 0..6 {
            let shown = current.to_string();
            if !matches!(current.scheme(), "http" | "https") {
                return Err(FetchError::BadUrl { url: shown, reason: "only http and https are fetched".into() });
            }
            let host = current.host_str().unwrap_or("").trim_matches(['[', ']']).to_string();
            if let Err(retry) = self.guard(&shown, &host, current.port_or_known_default().unwrap_or(443)).await? {
                return Ok(Err(retry));
            }
            let wait = reserve(&format!("{host}:{}", current.port_or_known_default().unwrap_or(0)), self.cfg.rate_per_host, Instant::now());
            if !wait.is_zero() {
                // A wait for the host's rate is paced work, not a retry: bounded by the
                // fetch's own limit.
                let elapsed = self.started.elapsed();
                if elapsed.saturating_add(wait) > self.cfg.max_fetch_time {
                    return Err(self.too_long(&shown, elapsed, false));
                }
                tokio::time::sleep(wait).await;
                self.rate_waited_ms.fetch_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
            }
            let left = self.cfg.max_fetch_time.saturating_sub(self.started.elapsed()).max(Duration::from_millis(1));
            let mut req = self.client.get(current.clone()).timeout(left).header("accept-encoding", "gzip, deflate");
            for (k, v) in headers {
                req = req.header(*k, v.as_str());
            }
            self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut resp = match req.send().await {
                Ok(r) => r,
                Err(e) if e.is_timeout() => return Ok(Err(Retryable { why: "timeout".into(), retry_after: None })),
                Err(e) => {
                    if let Some(refused) = crate::netguard::refusal(&e) {
                        return Err(FetchError::PrivateTarget { url: shown, host: refused.host.clone(), ip: refused.ip });
                    }
                    return Ok(Err(Retryable { why: format!("connection: {}", crate::util::error_chain(&e)), retry_after: None }));
                }
            };
            let status = resp.status().as_u16();
            let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
            if (300..400).contains(&status) && status != 304 {
                let Some(loc) = header("location") else {
                    return Err(FetchError::Status { url: shown, status, detail: ": redirect without Location".into() });
                };
                current = current.join(&loc).map_err(|e| FetchError::BadUrl { url: loc.clone(), reason: e.to_string() })?;
                continue;
            }
            if status == 408 || status == 429 || (500..600).contains(&status) {
                // An HTTP-date Retry-After is read against the server's own `Date` (no skew
                // between the two clocks), else against the run's time.
                let now = header("date")
                    .and_then(|d| httpdate::parse_http_date(&d).ok())
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or_else(|| self.now_ms());
                let retry_after = header("retry-after").and_then(|v| parse_retry_after(&v, now));
                return Ok(Err(Retryable { why: format!("HTTP {status}"), retry_after }));
            }
            let content_type = header("content-type").unwrap_or_default();
            if !(200..300).contains(&status) && status != 304 {
                let encoding = Encoding::from_header(header("content-encoding").as_deref());
                let body = error_body(&mut resp, encoding).await;
                return Err(FetchError::Status {
                    url: shown,
                    status,
                    detail: format!(", content-type {content_type:?}, body starts {:?}", first_bytes(&body)),
                });
            }
            let content_encoding = header("content-encoding");
            let Some(encoding) = Encoding::from_header(content_encoding.as_deref()) else {
                return Err(FetchError::Encoded { url: shown, encoding: content_encoding.unwrap_or_default() });
            };
            let etag = header("etag");
            let last_modified = header("last-modified");
            let content_crs = header("content-crs");
            let cap = self.cfg.max_response_bytes;
            if resp.content_length().is_some_and(|n| n > cap) {
                return Err(FetchError::TooLarge { url: shown, limit: cap });
            }
            let mut decoder = BodyDecoder::new(encoding, self.cfg.max_decompressed_bytes);
            let mut to = match sink.as_deref_mut() {
                Some(file) => {
                    file.restart().map_err(|e| file.error(e))?;
                    Sink::File(file)
                }
                None => Sink::Memory { limit: self.page_in_memory, dir: &self.spool_dir, spilled: None },
            };
            let received = |n: u64| {
                let all = self.received.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
                if let Some(p) = &self.progress {
                    p.fetching(u64::from(self.requests.load(std::sync::atomic::Ordering::Relaxed)), all);
                }
            };
            let read = read_decoded(&mut resp, cap, &mut decoder, &mut to, &received).await;
            let wire_bytes = decoder.wire_bytes();
            let mut spilled = None;
            let body = match read.and_then(|()| decoder.finish().map_err(ReadError::Decode)) {
                Ok(rest) => match to {
                    Sink::Memory { spilled: None, .. } => rest,
                    Sink::File(file) => {
                        file.write(&rest).map_err(|e| file.error(e))?;
                        file.head.clone()
                    }
                    Sink::Memory { spilled: Some(mut file), .. } => {
                        file.write(&rest).map_err(|e| file.error(e))?;
                        let head = file.head.clone();
                        let received = file.finish()?;
                        spilled = Some(Spilled { file: std::sync::Arc::new(received.file), size: received.size });
                        head
                    }
                },
                Err(ReadError::Sink(e)) => return Err(e),
                Err(ReadError::TooLarge) => return Err(FetchError::TooLarge { url: shown, limit: cap }),
                Err(ReadError::Timeout) => return Ok(Err(Retryable { why: "timeout reading the body".into(), retry_after: None })),
                Err(ReadError::Broken(e)) => return Ok(Err(Retryable { why: format!("body cut short: {e}"), retry_after: None })),
                Err(ReadError::Decode(DecodeError::TooLarge { limit })) => {
                    return Err(FetchError::DecodedTooLarge {
                        url: shown,
                        encoding: encoding.as_str().to_string(),
                        limit,
                        wire_bytes,
                    })
                }
                Err(ReadError::Decode(e @ DecodeError::Corrupt { .. })) => {
                    return Err(FetchError::Corrupt { url: shown, reason: format!("{e} (content-encoding {})", encoding.as_str()) })
                }
            };
            return Ok(Ok(Response { url: shown, status, content_type, etag, last_modified, content_crs, body, streamed: sink.is_some(), spilled }));
        }
        Err(FetchError::Protocol { url: url.to_string(), reason: "more than 5 redirects".into() })
    }

    /// The SSRF guard's check before a request (`netguard::Guard::check`); names are refused
    /// by the client's resolver when they resolve to a private address. A name that does not
    /// resolve now (checked here only through a proxy) is retried, as a resolver failure is.
    async fn guard(&self, url: &str, host: &str, port: u16) -> Result<Result<(), Retryable>, FetchError> {
        match self.guard.check(host, port, self.cfg.timeout).await {
            Ok(()) => Ok(Ok(())),
            Err(crate::netguard::Refused::Private(p)) => Err(FetchError::PrivateTarget { url: url.to_string(), host: p.host, ip: p.ip }),
            Err(e @ crate::netguard::Refused::Dns { .. }) => Ok(Err(Retryable { why: format!("connection: {e}"), retry_after: None })),
        }
    }
}

enum ReadError {
    /// The body could not be written to its [`BodyFile`].
    Sink(FetchError),
    TooLarge,
    Timeout,
    Broken(String),
    Decode(DecodeError),
}

/// Where [`read_decoded`] puts a body as it is decoded.
enum Sink<'a> {
    /// The caller's file ([`Session::get_to_file`]).
    File(&'a mut BodyFile),
    /// Memory, up to `limit` bytes; past it, a temp file in `dir` made then
    /// ([`Session::page_in_memory`]). Boxed: a `BodyFile` is ~200 bytes and is made only
    /// for the rare body that spills.
    Memory { limit: u64, dir: &'a std::path::Path, spilled: Option<Box<BodyFile>> },
}

impl Sink<'_> {
    /// Moves what `decoder` has decoded on to the file, once there is one: the caller's, or
    /// the temp file made when the body grows past the memory limit.
    fn drain(&mut self, decoder: &mut BodyDecoder) -> Result<(), FetchError> {
        let file = match self {
            Sink::File(file) => &mut **file,
            Sink::Memory { limit, dir, spilled } => {
                if spilled.is_none() && decoder.decoded_so_far().len() as u64 > *limit {
                    *spilled = Some(Box::new(BodyFile::new(dir)?));
                }
                match spilled {
                    Some(file) => &mut **file,
                    None => return Ok(()),
                }
            }
        };
        file.write(&decoder.take_decoded()).map_err(|e| file.error(e))
    }
}

/// Streams the body into `decoder`: on-wire bytes capped at `wire_cap`, decoded bytes at the
/// decoder's own cap (checked chunk by chunk, so a bomb never expands past it). Once `sink`
/// has a file, what is decoded goes on to it chunk by chunk instead of collecting in the
/// decoder.
async fn read_decoded(resp: &mut reqwest::Response, wire_cap: u64, decoder: &mut BodyDecoder, sink: &mut Sink<'_>, received: &(dyn Fn(u64) + Sync)) -> Result<(), ReadError> {
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                received(c.len() as u64);
                if decoder.wire_bytes() + c.len() as u64 > wire_cap {
                    return Err(ReadError::TooLarge);
                }
                decoder.push(&c).map_err(ReadError::Decode)?;
                sink.drain(decoder).map_err(ReadError::Sink)?;
            }
            Ok(None) => return Ok(()),
            Err(e) if e.is_timeout() => return Err(ReadError::Timeout),
            Err(e) => return Err(ReadError::Broken(crate::util::error_chain(&e))),
        }
    }
}

/// The start of an error response's body, decoded when it is compressed (best effort: it
/// only serves the error message).
async fn error_body(resp: &mut reqwest::Response, encoding: Option<Encoding>) -> Vec<u8> {
    let raw = read_capped(resp, 16 * 1024).await.unwrap_or_default();
    match encoding {
        Some(Encoding::Identity) | None => raw,
        Some(enc) => {
            let mut d = BodyDecoder::new(enc, 64 * 1024);
            // A cut-off stream still yields what was decoded before the cut.
            let _ = d.push(&raw);
            d.decoded_so_far().to_vec()
        }
    }
}

async fn read_capped(resp: &mut reqwest::Response, cap: u64) -> Result<Vec<u8>, ReadError> {
    let mut out = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                if out.len() as u64 + c.len() as u64 > cap {
                    return Err(ReadError::TooLarge);
                }
                out.extend_from_slice(&c);
            }
            Ok(None) => return Ok(out),
            Err(e) if e.is_timeout() => return Err(ReadError::Timeout),
            Err(e) => return Err(ReadError::Broken(crate::util::error_chain(&e))),
        }
    }
}

/// Runs an async portal fetch to completion on its own thread and runtime, so the synchronous
/// pipeline can call it from anywhere (a plain thread, `spawn_blocking`, `block_in_place`).
pub fn block_on<T: Send>(fut: impl std::future::Future<Output = T> + Send) -> Result<T, FetchError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| FetchError::Internal(format!("cannot start its runtime: {e}")))?;
            let out = rt.block_on(fut);
            // Not waiting for blocking tasks: a name lookup (getaddrinfo) left running by a
            // fetch a stop dropped would hold the stop for the resolver's timeouts.
            rt.shutdown_background();
            Ok(out)
        })
        .join()
        .unwrap_or_else(|payload| Err(FetchError::Internal(format!("its thread panicked: {}", panic_text(payload.as_ref())))))
    })
}

/// What a panic said, when it said it as text (`panic!("...")` gives a `&str` or a `String`).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_fetch_is_an_internal_error_that_says_what_panicked() {
        let e = block_on::<()>(async { panic!("page {} lost", 3) }).err();
        let said = e.as_ref().map(ToString::to_string).unwrap_or_default();
        assert!(matches!(e, Some(FetchError::Internal(_))), "{said}");
        assert!(said.contains("panicked: page 3 lost") && !said.contains("HTTP client"), "{said}");
        assert_eq!(block_on(async { 7 }).ok(), Some(7));
    }

    /// A streamed body's head starts at its first byte that is not whitespace, so HTML
    /// after any run of blank lines is still refused; a restart forgets the head, the
    /// digest and the bytes of the attempt before.
    #[test]
    fn a_body_file_keeps_the_head_an_html_check_needs_and_starts_over_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = BodyFile::new(dir.path()).unwrap();
        f.write(b"half of a first attempt").unwrap();
        f.restart().unwrap();
        f.write(&vec![b'\n'; 3000]).unwrap();
        f.write(b"  <html>blocked</html>").unwrap();
        assert!(f.head.starts_with(b"<html>"), "{:?}", String::from_utf8_lossy(&f.head));
        let resp = Response { url: "u".into(), status: 200, content_type: "application/json".into(), etag: None, last_modified: None, content_crs: None, body: f.head.clone(), streamed: true, spilled: None };
        assert!(matches!(resp.expect_json(), Err(FetchError::NotJson { .. })));
        assert!(resp.members(&[]).is_err(), "a streamed response is not parsed from its head");
        let mut body = f.finish().unwrap();
        let mut all = Vec::new();
        std::io::Read::read_to_end(&mut body.file, &mut all).unwrap();
        let mut want = vec![b'\n'; 3000];
        want.extend_from_slice(b"  <html>blocked</html>");
        assert_eq!((all.as_slice(), body.digest, body.size), (want.as_slice(), super::super::source::digest(&want), want.len() as u64));
        assert!(body.name.is_none());
    }

    #[test]
    fn host_map_stays_bounded_and_keeps_busy_buckets() {
        let mut map = HashMap::new();
        let t0 = Instant::now();
        reserve_in(&mut map, "busy:1", 1.0, t0);
        assert_eq!(reserve_in(&mut map, "busy:1", 1.0, t0), Duration::from_secs(1), "two reserved at once: the second waits");
        for i in 0..PRUNE_BUCKETS_ABOVE {
            reserve_in(&mut map, &format!("h{i}:1"), 1.0, t0);
        }
        assert!(map.len() > PRUNE_BUCKETS_ABOVE);
        // Half a second on, nothing has refilled: nothing is dropped, the busy host still waits.
        assert_eq!(reserve_in(&mut map, "busy:1", 1.0, t0 + Duration::from_millis(500)), Duration::from_millis(1500));
        assert!(map.len() > PRUNE_BUCKETS_ABOVE);
        // A minute on, every bucket has refilled: the map is pruned to the one just used.
        assert_eq!(reserve_in(&mut map, "new:1", 1.0, t0 + Duration::from_secs(60)), Duration::ZERO);
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn backoff_capped_with_retry_after_floor() {
        let cfg = IngestConfig { base_delay: Duration::from_millis(10), max_delay: Duration::from_millis(100), ..Default::default() };
        for a in 1..40 {
            assert!(backoff(&cfg, a, None) <= Duration::from_millis(100));
        }
        assert!(backoff(&cfg, 1, Some(Duration::from_secs(2))) >= Duration::from_secs(2));
    }

    #[test]
    fn bucket_spaces_requests_per_host() {
        let t0 = Instant::now();
        let host = "bucket-test.invalid:1";
        assert_eq!(reserve(host, 2.0, t0), Duration::ZERO);
        assert_eq!(reserve(host, 2.0, t0), Duration::ZERO);
        // Burst of 2 spent: the third waits half a second, the fourth a second.
        assert_eq!(reserve(host, 2.0, t0), Duration::from_millis(500));
        assert_eq!(reserve(host, 2.0, t0), Duration::from_millis(1000));
        // Another host is not affected.
        assert_eq!(reserve("other-host.invalid:1", 2.0, t0), Duration::ZERO);
    }

    #[test]
    fn html_is_refused_with_status_and_first_bytes() {
        let r = Response {
            url: "http://x/".into(),
            status: 200,
            content_type: "text/html".into(),
            etag: None,
            last_modified: None,
            content_crs: None,
            body: b"  <html><title>Access Denied</title>".to_vec(),
            streamed: false,
            spilled: None,
        };
        let e = r.members(&[]).unwrap_err().to_string();
        assert!(e.contains("200") && e.contains("text/html") && e.contains("Access Denied"), "{e}");
    }
}
