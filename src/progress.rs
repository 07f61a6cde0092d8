//! Progress of long ingests, for the operator watching `zonewatch run`.
//!
//! A county layer can be hundreds of megabytes; a silent minute looks like a hang. Where the
//! progress goes depends on who is watching:
//!
//! * stdout and stderr are a terminal, human logs → an indicatif bar on stderr;
//! * otherwise (piped, cron, systemd) → a plain `progress: …` line on stderr, the first only
//!   after a few seconds (a short run prints none) and then at most every few seconds, plus
//!   a `done` line if any progress line was printed;
//! * `--log-format json` → no bar and no raw text (stderr is a JSON stream): the same
//!   throttled reports become `tracing` events at `info` level.
//!
//! stdout is never written, so the per-source result lines scripts parse stay clean.
//! `ZONEWATCH_PROGRESS_EVERY` (a duration such as `500ms`) overrides the line interval.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default delay before the first plain line, and between lines.
const DEFAULT_EVERY: Duration = Duration::from_secs(5);
/// Bar refresh granularity for the feature count in the bar's message.
const BAR_MESSAGE_EVERY: u64 = 1024;

/// A clock giving the time elapsed since the run started (injectable for tests).
pub type Clock = Box<dyn Fn() -> Duration + Send + Sync>;

/// Where throttled plain reports go.
#[derive(Clone)]
pub enum LineSink {
    /// Plain text lines on stderr.
    Stderr,
    /// `tracing` info events (JSON logs).
    Tracing,
    /// Collected in memory (tests).
    Capture(Arc<Mutex<Vec<String>>>),
}

/// The progress of one source run. Created per source run by `zonewatch run` and handed to
/// the pipeline through `RunOptions::progress`; [`IngestProgress::at`] is cheap enough to call
/// per feature (two atomic stores and a clock read; text is produced only when a line is due).
pub struct IngestProgress {
    source_id: String,
    total_bytes: Option<u64>,
    features: AtomicU64,
    bytes: AtomicU64,
    /// A portal fetch is under way ([`IngestProgress::fetching`]): `bytes` counts what was
    /// received, `requests` the requests sent; the scan's first report ends it.
    fetching: AtomicBool,
    requests: AtomicU64,
    finished: AtomicBool,
    sink: Sink,
}

enum Sink {
    Bar(ProgressBar),
    Lines(Lines),
}

/// Throttled plain reports: the first after `every`, then at most one per `every`.
struct Lines {
    clock: Clock,
    every: Duration,
    /// Elapsed milliseconds before which no line is due (fast path, no lock).
    next_due_ms: AtomicU64,
    printed: AtomicU64,
    /// Serialises the (rare) printing path.
    print_lock: Mutex<()>,
    out: LineSink,
}

impl std::fmt::Debug for IngestProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestProgress")
            .field("source_id", &self.source_id)
            .field("total_bytes", &self.total_bytes)
            .field("features", &self.features.load(Ordering::Relaxed))
            .field("bytes", &self.bytes.load(Ordering::Relaxed))
            .finish()
    }
}

/// The line interval: `ZONEWATCH_PROGRESS_EVERY` if set and valid, else the default.
fn interval_from_env() -> Duration {
    match std::env::var("ZONEWATCH_PROGRESS_EVERY") {
        Ok(v) => match crate::util::parse_duration(&v) {
            Ok(d) if !d.is_zero() => d,
            _ => {
                tracing::warn!("ZONEWATCH_PROGRESS_EVERY={v:?} is not a positive duration; using {}s", DEFAULT_EVERY.as_secs());
                DEFAULT_EVERY
            }
        },
        Err(_) => DEFAULT_EVERY,
    }
}

impl IngestProgress {
    /// Starts reporting the run of `source_id` reading `total_bytes` (when known). Chooses a
    /// bar or throttled lines from the terminal and the log format (see the module doc).
    pub fn start(source_id: &str, total_bytes: Option<u64>) -> IngestProgress {
        // Logs on stderr are JSON (`say::use_json`): nothing else may write text there.
        let json = crate::say::json();
        let tty = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
        if tty && !json {
            return IngestProgress::with_bar(source_id, total_bytes);
        }
        let started = Instant::now();
        let sink = if json { LineSink::Tracing } else { LineSink::Stderr };
        IngestProgress::with_lines(source_id, total_bytes, interval_from_env(), Box::new(move || started.elapsed()), sink)
    }

    fn with_bar(source_id: &str, total_bytes: Option<u64>) -> IngestProgress {
        let bar = match total_bytes {
            Some(total) => {
                let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {bytes}/{total_bytes} {msg} ({elapsed}, eta {eta})") {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar
            }
            None => {
                let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template("{prefix} {spinner} {bytes} {msg} ({elapsed})") {
                    bar.set_style(style);
                }
                bar
            }
        };
        bar.set_prefix(source_id.to_string());
        bar.set_message("0 features");
        bar.enable_steady_tick(Duration::from_millis(200));
        IngestProgress::new(source_id, total_bytes, Sink::Bar(bar))
    }

    /// Throttled plain reports with an explicit clock, interval and sink (tests inject these).
    pub fn with_lines(source_id: &str, total_bytes: Option<u64>, every: Duration, clock: Clock, out: LineSink) -> IngestProgress {
        let every = every.max(Duration::from_millis(1));
        let lines = Lines {
            clock,
            every,
            next_due_ms: AtomicU64::new(every.as_millis() as u64),
            printed: AtomicU64::new(0),
            print_lock: Mutex::new(()),
            out,
        };
        IngestProgress::new(source_id, total_bytes, Sink::Lines(lines))
    }

    fn new(source_id: &str, total_bytes: Option<u64>, sink: Sink) -> IngestProgress {
        IngestProgress {
            source_id: source_id.to_string(),
            total_bytes,
            features: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            fetching: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            finished: AtomicBool::new(false),
            sink,
        }
    }

    /// Reports a portal fetch's position: `requests` sent so far and `bytes` received in all
    /// (before any scan: a county's pages take minutes to arrive). Cheap; call it per chunk.
    pub fn fetching(&self, requests: u64, bytes: u64) {
        self.fetching.store(true, Ordering::Relaxed);
        self.bytes.store(bytes, Ordering::Relaxed);
        let before = self.requests.swap(requests, Ordering::Relaxed);
        match &self.sink {
            Sink::Bar(bar) => {
                bar.set_position(bytes);
                if before != requests {
                    bar.set_message(format!("fetching: {requests} requests"));
                }
            }
            Sink::Lines(lines) => self.line_if_due(lines),
        }
    }

    /// Reports the position: `features` read so far and about `bytes` of the layer consumed.
    /// Cheap; call it per feature.
    pub fn at(&self, features: u64, bytes: u64) {
        self.fetching.store(false, Ordering::Relaxed);
        self.features.store(features, Ordering::Relaxed);
        self.bytes.store(bytes, Ordering::Relaxed);
        match &self.sink {
            Sink::Bar(bar) => {
                bar.set_position(bytes);
                if features.is_multiple_of(BAR_MESSAGE_EVERY) {
                    bar.set_message(format!("{features} features"));
                }
            }
            Sink::Lines(lines) => self.line_if_due(lines),
        }
    }

    /// A plain report, when one is due (throttled; never blocks on another thread printing).
    fn line_if_due(&self, lines: &Lines) {
        let now = (lines.clock)();
        let now_ms = now.as_millis() as u64;
        if now_ms < lines.next_due_ms.load(Ordering::Relaxed) {
            return;
        }
        let Ok(_guard) = lines.print_lock.try_lock() else { return };
        // Re-check under the lock: another thread may just have printed.
        if now_ms < lines.next_due_ms.load(Ordering::Relaxed) {
            return;
        }
        lines.next_due_ms.store(now_ms + lines.every.as_millis() as u64, Ordering::Relaxed);
        lines.printed.fetch_add(1, Ordering::Relaxed);
        self.emit(lines, false, now);
    }

    /// How many plain progress lines were emitted so far (0 for a bar).
    pub fn lines_printed(&self) -> u64 {
        match &self.sink {
            Sink::Bar(_) => 0,
            Sink::Lines(l) => l.printed.load(Ordering::Relaxed),
        }
    }

    /// Ends the report: the bar is cleared; a `done` line follows plain lines only if at least
    /// one progress line was printed (a short run stays silent). Idempotent.
    pub fn finish(&self) {
        if self.finished.swap(true, Ordering::SeqCst) {
            return;
        }
        match &self.sink {
            Sink::Bar(bar) => bar.finish_and_clear(),
            Sink::Lines(lines) => {
                if lines.printed.load(Ordering::Relaxed) > 0 {
                    let _guard = lines.print_lock.lock().unwrap_or_else(|p| p.into_inner());
                    self.emit(lines, true, (lines.clock)());
                }
            }
        }
    }

    fn emit(&self, lines: &Lines, done: bool, elapsed: Duration) {
        let features = self.features.load(Ordering::Relaxed);
        let bytes = self.bytes.load(Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        if !done && self.fetching.load(Ordering::Relaxed) {
            let requests = self.requests.load(Ordering::Relaxed);
            match &lines.out {
                LineSink::Tracing => tracing::info!(source = %self.source_id, requests, bytes, elapsed_s = secs, "ingest progress: fetching"),
                LineSink::Stderr => stderr_line(&self.fetch_line(requests, bytes, secs)),
                LineSink::Capture(v) => v.lock().unwrap_or_else(|p| p.into_inner()).push(self.fetch_line(requests, bytes, secs)),
            }
            return;
        }
        match &lines.out {
            LineSink::Tracing => {
                if done {
                    tracing::info!(source = %self.source_id, features, bytes, total_bytes = self.total_bytes, elapsed_s = secs, "ingest progress: done");
                } else {
                    tracing::info!(source = %self.source_id, features, bytes, total_bytes = self.total_bytes, elapsed_s = secs, "ingest progress");
                }
            }
            LineSink::Stderr => stderr_line(&self.line(done, features, bytes, secs)),
            LineSink::Capture(v) => {
                let line = self.line(done, features, bytes, secs);
                v.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        }
    }

    /// `progress: s1 fetching: 12 requests, 3.1 MiB received, 6s`
    fn fetch_line(&self, requests: u64, bytes: u64, secs: f64) -> String {
        format!("progress: {} fetching: {requests} requests, {} received, {secs:.0}s", self.source_id, mib(bytes))
    }

    /// `progress: s1 12000 features, 3.1 MiB of 10.0 MiB (31%), 6s`
    fn line(&self, done: bool, features: u64, bytes: u64, secs: f64) -> String {
        let size = match self.total_bytes {
            Some(t) if t > 0 => format!("{} of {} ({}%)", mib(bytes), mib(t), (u128::from(bytes.min(t)) * 100) / u128::from(t)),
            _ => mib(bytes),
        };
        if done {
            format!("progress: {} done: {features} features, {size} in {secs:.1}s", self.source_id)
        } else {
            format!("progress: {} {features} features, {size}, {secs:.0}s", self.source_id)
        }
    }
}

impl Drop for IngestProgress {
    fn drop(&mut self) {
        // A bar left running would keep redrawing over the result lines.
        if let Sink::Bar(bar) = &self.sink {
            if !bar.is_finished() {
                bar.finish_and_clear();
            }
        }
    }
}

/// The size of a file source's layer, for the bar's total (`None` for HTTP kinds: unknown
/// until fetched).
pub fn file_size(src: &crate::config::SourceConfig) -> Option<u64> {
    match &src.kind {
        crate::config::SourceKind::File { path } => std::fs::metadata(path).ok().map(|m| m.len()),
        _ => None,
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// A progress line on stderr; one that cannot be written is dropped (`eprintln!` panicked: a
/// `run` whose stderr went to a full disk ended with exit 101; reviewer).
fn stderr_line(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock the test moves by hand.
    fn manual_clock() -> (Arc<AtomicU64>, Clock) {
        let ms = Arc::new(AtomicU64::new(0));
        let m = ms.clone();
        (ms, Box::new(move || Duration::from_millis(m.load(Ordering::SeqCst))))
    }

    #[test]
    fn a_short_run_prints_nothing() {
        let (ms, clock) = manual_clock();
        let out = Arc::new(Mutex::new(Vec::new()));
        let p = IngestProgress::with_lines("s1", Some(1000), Duration::from_secs(5), clock, LineSink::Capture(out.clone()));
        for i in 1..=1000u64 {
            ms.store(i * 4, Ordering::SeqCst); // 4 s in all
            p.at(i, i);
        }
        p.finish();
        assert!(out.lock().unwrap().is_empty(), "{:?}", out.lock().unwrap());
        assert_eq!(p.lines_printed(), 0);
    }

    #[test]
    fn lines_are_rate_limited_and_end_with_done() {
        let (ms, clock) = manual_clock();
        let out = Arc::new(Mutex::new(Vec::new()));
        let p = IngestProgress::with_lines("s1", Some(100_000), Duration::from_secs(5), clock, LineSink::Capture(out.clone()));
        // 10 000 features over 23 s (2.3 ms each): lines due at 5, 10, 15, 20 s → four lines.
        for i in 1..=10_000u64 {
            ms.store(i * 23 / 10, Ordering::SeqCst);
            p.at(i, i * 10);
        }
        p.finish();
        p.finish(); // idempotent
        let lines = out.lock().unwrap().clone();
        assert_eq!(lines.len(), 5, "{lines:?}");
        assert!(lines[0].starts_with("progress: s1 2174 features, "), "{lines:?}");
        assert!(lines[0].contains("(21%)") && lines[0].ends_with(", 5s"), "{lines:?}");
        assert!(lines[3].ends_with(", 20s"), "{lines:?}");
        assert_eq!(lines[4], "progress: s1 done: 10000 features, 0.1 MiB of 0.1 MiB (100%) in 23.0s");
        assert_eq!(p.lines_printed(), 4);
    }

    /// A portal fetch reports requests and bytes received until the scan's first report.
    #[test]
    fn a_fetch_reports_requests_and_bytes_then_the_scan_features() {
        let (ms, clock) = manual_clock();
        let out = Arc::new(Mutex::new(Vec::new()));
        let p = IngestProgress::with_lines("ogc", None, Duration::from_secs(5), clock, LineSink::Capture(out.clone()));
        for i in 1..=12u64 {
            ms.store(i * 1_000, Ordering::SeqCst);
            p.fetching(i, i * 1_048_576);
        }
        ms.store(16_000, Ordering::SeqCst);
        p.at(300, 2_097_152);
        p.finish();
        let lines = out.lock().unwrap().clone();
        assert_eq!(lines[0], "progress: ogc fetching: 5 requests, 5.0 MiB received, 5s", "{lines:?}");
        assert_eq!(lines[1], "progress: ogc fetching: 10 requests, 10.0 MiB received, 10s", "{lines:?}");
        assert_eq!(lines[2], "progress: ogc 300 features, 2.0 MiB, 16s", "{lines:?}");
        assert_eq!(lines[3], "progress: ogc done: 300 features, 2.0 MiB in 16.0s", "{lines:?}");
    }

    #[test]
    fn a_stall_prints_one_line_not_a_burst() {
        let (ms, clock) = manual_clock();
        let out = Arc::new(Mutex::new(Vec::new()));
        let p = IngestProgress::with_lines("s1", None, Duration::from_secs(2), clock, LineSink::Capture(out.clone()));
        p.at(1, 10);
        ms.store(60_000, Ordering::SeqCst); // a minute with nothing, then many features at once
        for i in 2..100 {
            p.at(i, i * 10);
        }
        assert_eq!(out.lock().unwrap().len(), 1);
        assert_eq!(out.lock().unwrap()[0], "progress: s1 2 features, 0.0 MiB, 60s");
    }
}
