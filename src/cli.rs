//! The command line: `demo`, `run`, `serve`, `check`, `audit`, `holds`, `backup`, `restore`
//! (and the hidden `synth` that makes the demo fixtures); `bench`, `dlq` and `endpoints` are
//! dispatched to their own modules. Each command is a function returning an exit code;
//! `main` only parses and dispatches.

use crate::config::Config;
use crate::model::{AuditRow, HoldState};
use crate::notify::delivery::Deliverer;
use crate::pipeline::{Engine, RunOptions};
use crate::store::{AuditFilter, Store, StoreError, SweepBatch};
use crate::util::rfc3339;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The whole command line as clap parses it: the global options and one command. The names
/// here are what operators' scripts call, so they are kept as they are.
#[derive(Parser, Debug)]
#[command(name = "zonewatch", version, about = "Watch municipal zoning layers; alert subscribers of real changes, exactly once.", long_about = None)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// How logs are written to stderr: for a person at a terminal, or one JSON object a line
/// for a log collector.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum LogFormat {
    Human,
    Json,
}

/// How `zonewatch audit` prints the ledger: a table to read, or JSON lines / CSV for other
/// tools.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum AuditFormat {
    Table,
    Jsonl,
    Csv,
}

/// The commands, one variant each, with their options.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Self-contained tour: temp store, bundled demo county, built-in webhook receiver.
    Demo,
    /// One pass: ingest every (or one) source, then deliver until the outbox is empty.
    Run {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        source: Option<String>,
        /// Update snapshots and prime idempotency keys without sending anything.
        #[arg(long)]
        reprocess: bool,
        /// Re-process the payload staged by the source's last HTTP fetch (needs --source).
        #[arg(long, requires = "source")]
        from_staging: bool,
    },
    /// Long-running: re-ingest each source every `every`, deliver continuously.
    Serve {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate the config and every AOI file; with --store, also check a store's cross-table
    /// consistency (read-only)
    Check {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        /// Also check the store's consistency: the config's store, or the file given (a
        /// backup, say). Reads the whole file; a store a running zonewatch holds, or one not
        /// closed cleanly, is noted and not checked
        #[arg(long, value_name = "PATH", num_args = 0..=1)]
        store: Option<Option<PathBuf>>,
    },
    /// Show the audit ledger (one row per outcome).
    Audit {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        parcel: Option<String>,
        #[arg(long)]
        watcher: Option<String>,
        #[arg(long)]
        source: Option<String>,
        /// One event: every outcome of this idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// One source run: every outcome of this lineage id.
        #[arg(long)]
        lineage: Option<String>,
        /// Only these outcomes, comma-separated (e.g. `sent,dead_letter`); found through the
        /// ledger's outcome index, past however many rows of other outcomes.
        #[arg(long, value_name = "OUTCOME,...")]
        outcome: Option<String>,
        #[arg(long, value_enum, default_value_t = AuditFormat::Table)]
        format: AuditFormat,
    },
    /// List, release or prime runs held by the publication gate.
    Holds {
        #[command(subcommand)]
        action: HoldAction,
    },
    /// Write a consistent copy of the store to DEST (works while `serve` runs: it asks the
    /// running daemon over the control port).
    Backup {
        dest: PathBuf,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Replace the store with a backup. Refuses while a zonewatch is using the store.
    Restore {
        src: PathBuf,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Dead letters: list, show (with every attempt), replay, recover, release from quarantine.
    Dlq {
        #[command(subcommand)]
        action: crate::cli_dlq::DlqAction,
    },
    /// Subscriber endpoints: list health, re-enable a disabled one.
    Endpoints {
        #[command(subcommand)]
        action: crate::cli_dlq::EndpointsAction,
    },
    /// Generate synthetic data (the demo county fixtures).
    #[command(hide = true)]
    Synth {
        #[command(subcommand)]
        what: SynthWhat,
    },
    /// Measure ingest, matching, commit, delivery, recovery, overlay and idle cost on
    /// synthetic counties; one JSON line per result (see docs/PERFORMANCE.md).
    Bench(crate::bench::BenchArgs),
}

/// What `zonewatch holds` does with the publication gate's held runs.
#[derive(Subcommand, Debug)]
pub enum HoldAction {
    /// Runs held by the publication gate: source, state, when, how many changes, and why.
    List {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Deliver a held run.
    Release {
        run_id: u64,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Accept a held run silently (snapshot and keys updated, nothing sent).
    Prime {
        run_id: u64,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
}

/// What the hidden `synth` command writes (the bundled demo fixtures are made with it).
#[derive(Subcommand, Debug)]
pub enum SynthWhat {
    /// Write the demo county fixtures into a folder.
    Demo {
        #[arg(long)]
        out: PathBuf,
    },
}

/// Exit codes: 0 ok, 1 runtime failure (a source failed, delivery error), 2 config/store error.
///
/// The one-shot commands that read the store run under `store::guard`: a store damaged so
/// that redb panics reading it is reported as one line (`store FILE is damaged (redb: ...);
/// restore a backup ...`) with exit 2, not a backtrace. So does `serve`, whose store work runs
/// on the runtime's threads: the first redb panic begins its shutdown (`guard::on_damage`).
pub fn dispatch(cli: Cli) -> i32 {
    crate::say::use_json(cli.log_format == LogFormat::Json);
    let Some(config) = cli.command.store_config().map(std::path::Path::to_path_buf) else {
        return run_command(cli.command);
    };
    match crate::store::guard::guarded(|| run_command(cli.command)) {
        Ok(code) => code,
        Err(panic) => {
            // The config loaded before the store was opened, so it loads again here.
            let store = Config::load(&config).map(|c| c.store_path).unwrap_or(config);
            error_line!("{}", panic.at(&store));
            2
        }
    }
}

impl Command {
    /// The config of a command that reads the store (what `dispatch` guards), so a damaged
    /// store can be named; `None` for the commands without a store (`demo` and `bench` make
    /// their own).
    fn store_config(&self) -> Option<&std::path::Path> {
        use crate::cli_dlq::{DlqAction, EndpointsAction};
        match self {
            Command::Run { config, .. }
            | Command::Check { config, .. }
            | Command::Audit { config, .. }
            | Command::Backup { config, .. }
            | Command::Restore { config, .. } => Some(config),
            Command::Holds { action: HoldAction::List { config } | HoldAction::Release { config, .. } | HoldAction::Prime { config, .. } } => Some(config),
            Command::Dlq {
                action:
                    DlqAction::List { config, .. }
                    | DlqAction::Show { config, .. }
                    | DlqAction::Replay { config, .. }
                    | DlqAction::Recover { config, .. }
                    | DlqAction::Release { config, .. },
            } => Some(config),
            Command::Endpoints { action: EndpointsAction::List { config, .. } | EndpointsAction::Enable { config, .. } } => Some(config),
            Command::Serve { config } => Some(config),
            Command::Demo | Command::Synth { .. } | Command::Bench(_) => None,
        }
    }
}

/// One command, its exit code.
fn run_command(command: Command) -> i32 {
    match command {
        Command::Demo => match crate::demo::run_demo() {
            Ok(()) => 0,
            Err(e) => {
                error_line!("demo failed: {e:#}");
                1
            }
        },
        Command::Run { config, source, reprocess, from_staging } => cmd_run(&config, source.as_deref(), reprocess, from_staging),
        Command::Serve { config } => cmd_serve(&config),
        Command::Check { config, store } => cmd_check(&config, store.as_ref().map(Option::as_deref)),
        Command::Audit { config, parcel, watcher, source, key, lineage, outcome, format } => {
            let outcomes = match outcome.as_deref().map(crate::model::Outcome::parse_list).transpose() {
                Ok(o) => o,
                Err(why) => {
                    error_line!("--outcome: {why}");
                    return 2;
                }
            };
            let filter = AuditFilter { parcel, watcher, source, key, lineage, outcomes, ..Default::default() };
            cmd_audit(&config, filter, format)
        }
        Command::Holds { action } => cmd_holds(action),
        Command::Backup { dest, config } => cmd_backup(&config, &dest),
        Command::Restore { src, config } => cmd_restore(&config, &src),
        Command::Dlq { action } => crate::cli_dlq::cmd_dlq(action),
        Command::Bench(args) => crate::bench::cmd_bench(args),
        Command::Endpoints { action } => crate::cli_dlq::cmd_endpoints(action),
        Command::Synth { what: SynthWhat::Demo { out } } => match crate::synth::write_demo_fixtures(&out) {
            Ok(f) => {
                println!("wrote {} parcels and {} rezonings to {}", f.parcels, f.rezonings.len(), out.display());
                for r in f.rezonings {
                    println!("  {} {} -> {}", r.id, r.from, r.to);
                }
                0
            }
            Err(e) => {
                error_line!("{e}");
                1
            }
        },
    }
}

fn load_config(path: &std::path::Path) -> Result<Config, i32> {
    Config::load(path).map_err(|e| {
        error_line!("{e}");
        2
    })
}

fn open_engine(path: &std::path::Path) -> Result<Engine, i32> {
    open_engine_after(path, &mut |_| Ok(()))
}

/// [`open_engine`], with `before_store` run on the loaded config before the store is opened
/// or created (`serve` binds its control port there: a port held by another program must not
/// leave a new store file behind).
fn open_engine_after(path: &std::path::Path, before_store: &mut dyn FnMut(&Config) -> Result<(), i32>) -> Result<Engine, i32> {
    let engine = engine_by(path, before_store, Engine::open)?;
    // A run writes its spill and sort files beside the store: a folder it may not write in
    // fails here, at start, not at the first real change hours later.
    if let Err(source) = tempfile::tempfile_in(engine.scratch_dir()) {
        let e = crate::store::StoreError::Io {
            what: format!("cannot make temp files in the store's folder {} (runs write their spill files there; give this user write access to it)", engine.scratch_dir().display()),
            source,
        };
        error_line!("{e}");
        return Err(store_exit_code(&e));
    }
    for (id, note) in &engine.aoi_repairs {
        warning_line!("subscriber {id}: {note}");
    }
    // What `check` calls an error, said at start too: every alert of such a subscriber is
    // dead-lettered `private_target_refused`, and a service started without `check` would
    // say nothing of it until someone reads the dead letters (found by a black-box tester).
    if !engine.config.delivery.allow_private_targets {
        for s in engine.config.subscribers.iter().filter(|s| crate::netguard::url_written_private(&s.target)) {
            warning_line!(
                "subscriber {}: target {} is a private address and delivery.allow_private_targets is false: every alert to it will be dead-lettered private_target_refused",
                s.id,
                crate::util::url_for_display(&s.target)
            );
        }
    }
    Ok(engine)
}

/// [`open_engine`] for a command that steers what runs wrote: the store must exist.
pub(crate) fn open_existing_engine(path: &std::path::Path) -> Result<Engine, i32> {
    engine_by(path, &mut |_| Ok(()), Engine::open_existing)
}

fn engine_by(
    path: &std::path::Path,
    before_store: &mut dyn FnMut(&Config) -> Result<(), i32>,
    open: fn(Config) -> Result<Engine, crate::pipeline::PipelineError>,
) -> Result<Engine, i32> {
    let config = load_config(path)?;
    for advice in config.advisories() {
        tracing::warn!("{advice}");
    }
    before_store(&config)?;
    let store_path = config.store_path.clone();
    open(config).map_err(|e| {
        match &e {
            crate::pipeline::PipelineError::Store(se) => error_line!("{}", store_error_text(&store_path, se)),
            _ => error_line!("{e}"),
        }
        // Another process holding the store (an operator's `zonewatch backup` while the
        // service restarts, say) lets go of it, and a full disk is freed: exit 1, which the
        // packaged unit retries, as `restore` does. Every other open error is the config's or
        // the store's: exit 2.
        match e {
            crate::pipeline::PipelineError::Store(e) => store_exit_code(&e),
            _ => 2,
        }
    })
}

/// A store error as the operator reads it: redb's own words (`database error: ...`) say not
/// which file, and a full disk would read as a broken store, so they are given the store's.
pub(crate) fn store_error_text(store: &std::path::Path, e: &crate::store::StoreError) -> String {
    let text = match e {
        crate::store::StoreError::Db(_) => format!("store {}: {e}", store.display()),
        _ => e.to_string(),
    };
    match e.io_error() {
        Some(io) if crate::store::is_file_size_limit(io) => format!("{text}: {}", crate::store::FILE_SIZE_LIMIT),
        _ => text,
    }
}

/// The exit code of a command stopped by a store error: 1 when it passes by itself (the store
/// in use, a full disk; `StoreError::passes`), else 2.
pub(crate) fn store_exit_code(e: &crate::store::StoreError) -> i32 {
    if e.passes() {
        1
    } else {
        2
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, i32> {
    crate::util::async_runtime(true).map_err(|e| {
        let hint = if matches!(e.raw_os_error(), Some(23 | 24)) { ": this process is out of file descriptors; raise its limit (ulimit -n, or LimitNOFILE= in the service unit)" } else { "" };
        error_line!("cannot start the async runtime: {e}{hint}");
        1
    })
}

fn cmd_run(config: &std::path::Path, only: Option<&str>, reprocess: bool, from_staging: bool) -> i32 {
    let engine = match open_engine(config) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let sources: Vec<_> = match only {
        Some(id) => match engine.config.source(id) {
            Some(s) => vec![s.clone()],
            None => {
                error_line!("no source {id:?} in {}", config.display());
                return 2;
            }
        },
        // A district or overlay layer after the parcel layer it is derived onto: on a new
        // store, one listed before its base failed its first run ("run the base first"),
        // while `check` said all good (bb27). `serve` waits for the base's first ingest.
        None => {
            let (bases, derived): (Vec<_>, Vec<_>) = engine.config.sources.iter().cloned().partition(|s| s.parcels.is_none());
            bases.into_iter().chain(derived).collect()
        }
    };
    if from_staging {
        // Only an HTTP fetch stages a payload; a file source's file is its own copy.
        if let Some(src) = sources.iter().find(|s| matches!(s.kind, crate::config::SourceKind::File { .. })) {
            error_line!("--from-staging re-processes the payload an HTTP source's last fetch staged; {:?} is a file source (run it without --from-staging)", src.id);
            return 2;
        }
    }
    // SIGINT / SIGTERM (Ctrl-C, a timer's unit being stopped): the source being fetched or
    // read is abandoned (nothing of it is committed; a commit already begun finishes, see
    // `run_stop.rs`), no other starts, sends already begun finish and nothing more is sent or
    // waited for; then, the store closed, it dies by that signal (a shell's 130 / 143). See
    // `signals.rs`.
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(c) => return c,
    };
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let runs_stop = engine.stop.clone();
    let signal = match crate::signals::watch(
        "stopping: the source being fetched or read is left for the next run (one already committing finishes), no other starts, sends already begun finish; queued alerts wait for the next run (signal again to exit at once)",
        move || {
            runs_stop.request();
            let _ = stop_tx.send(true);
        },
    ) {
        Ok(signal) => Some(signal),
        Err(e) => {
            warning_line!("cannot watch for signals ({e}): a signal stops this run at once");
            None
        }
    };
    let interrupted = || *stop.borrow();
    let mut failed = 0;
    let mut lines = ResultLines::default();
    for src in &sources {
        if interrupted() {
            lines.line(format_args!("{}: skipped (interrupted)", src.id));
            continue;
        }
        let progress = Arc::new(crate::progress::IngestProgress::start(&src.id, crate::progress::file_size(src)));
        let opts = RunOptions { reprocess, progress: Some(progress.clone()) };
        let result = if from_staging {
            engine.run_source_from_staging(src, opts)
        } else {
            engine.run_source(src, opts)
        };
        progress.finish();
        match result {
            Ok(report) => lines.line(format_args!("{}", report.line())),
            Err(e) if e.is_stopped() => lines.line(format_args!("{}: stopped (interrupted before its commit; nothing of this run was committed, the next run reads it again)", src.id)),
            Err(e) => {
                failed += 1;
                lines.line(format_args!("{}: failed error={:?}", src.id, e.to_string()));
            }
        }
    }
    let code = rt.block_on(async {
        let deliverer = match Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).map(|d| d.with_clock(engine.clock.clone())) {
            Ok(d) => d,
            Err(e) => {
                error_line!("{e}");
                return 1;
            }
        };
        match deliverer.drain_until(Instant::now() + engine.config.delivery.run_wait, Some(&stop)).await {
            Ok(s) => {
                let left = engine.store.outbox_len().unwrap_or(0);
                lines.line(format_args!("delivery: sent={} retried={} dead_letters={} outbox_remaining={} gone={}{}", s.sent, s.retried, s.dead, left, s.gone, deferred_field(&s)));
                if left > 0 {
                    if let Some(text) = engine_disabled_backlog(&engine) {
                        note_line!("{text}");
                    }
                }
                deferred_exit(&engine.store, &s)
            }
            Err(e) => {
                error_line!("delivery: {e}");
                1
            }
        }
    });
    engine.settle_clock_watch();
    // Not when stopped by a signal: what remains is to exit.
    if !interrupted() {
        end_of_run_sweeps(&engine);
    }
    if interrupted() {
        let queued = engine.store.outbox_len().unwrap_or(0);
        crate::say::line(crate::say::Level::Status, format_args!("stopped on a signal; what was committed stays, {queued} queued alert(s) wait for the next run"));
    }
    if failed > 0 {
        error_line!("{failed} of {} sources failed (see above); their watermarks did not move", sources.len());
        if crate::store::file_size_limit_met() {
            // Waiting does not lift a limit: exit 2, which the packaged unit does not retry.
            error_line!("store {}: {}", engine.config.store_path.display(), crate::store::FILE_SIZE_LIMIT);
            return 2;
        }
        return 1;
    }
    match lines.failed {
        // The reader stopped early: as a Unix tool stopped by SIGPIPE.
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe && code == 0 => return 141,
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            error_line!("cannot write this command's report to stdout ({e}); the run went on, and what it did is in the store (`zonewatch audit`, `/v1/runs`)");
            return 1;
        }
        _ => {}
    }
    // A failure outranks the signal; the signal outranks success: the process then dies by
    // it once the store is closed (a shell reports 130 for SIGINT, 143 for SIGTERM).
    match signal.and_then(|s| s.code()) {
        Some(signal) if code == 0 => crate::signals::end_by(signal),
        _ => code,
    }
}

/// `run`'s result lines on stdout, each written as its source finishes. A stdout that cannot
/// be written (a closed pipe, a cron job's log on a full disk) does not stop the run: the
/// other sources run and delivery drains (the work is in the store either way), and the
/// command says so at its end, once. `println!` would panic there instead, and a panic
/// leaves the store not closed cleanly (redb repairs it at the next open).
#[derive(Default)]
struct ResultLines {
    failed: Option<std::io::Error>,
}

impl ResultLines {
    fn line(&mut self, text: std::fmt::Arguments<'_>) {
        use std::io::Write;
        if self.failed.is_none() {
            let mut out = std::io::stdout().lock();
            if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
                self.failed = Some(e);
            }
        }
    }
}

/// The delivery line's `deferred=N` (sends this process could not make for want of its own
/// resources: `DeliveryResult::Deferred`), only when there were any.
fn deferred_field(s: &crate::notify::delivery::PassStats) -> String {
    if s.deferred > 0 {
        format!(" deferred={}", s.deferred)
    } else {
        String::new()
    }
}

/// [`disabled_backlog_text`] of an open engine's store (`run`, `serve`); a store that cannot
/// be read here says nothing (the commands themselves report that).
fn engine_disabled_backlog(engine: &Engine) -> Option<String> {
    engine.store.disabled_backlog().ok().and_then(|b| disabled_backlog_text(&b, &|id| engine.subscribers.get(id).is_some()))
}

/// What waits for disabled endpoints, as an operator reads it (`run`'s note, `serve`'s start,
/// `check --store`'s warning); None when nothing does. Only endpoints whose subscriber
/// `exists`: the rows of one removed are dead-lettered `subscriber_gone`, not held for an
/// enable (second reader).
fn disabled_backlog_text(backlog: &[crate::store::DisabledBacklog], exists: &dyn Fn(&str) -> bool) -> Option<String> {
    let backlog: Vec<&crate::store::DisabledBacklog> = backlog.iter().filter(|b| exists(&b.endpoint)).collect();
    if backlog.is_empty() {
        return None;
    }
    let total: u64 = backlog.iter().map(|b| b.waiting).sum();
    let each: Vec<String> = backlog
        .iter()
        .map(|b| {
            let since = b.since_ms.map(|t| format!(" since {}", crate::util::rfc3339(t))).unwrap_or_default();
            let why = b.reason.as_deref().map(|r| format!(": {}", crate::util::terminal_safe(r))).unwrap_or_default();
            format!("{} ({} alert(s); disabled{since}{why})", crate::util::terminal_safe(&b.endpoint), b.waiting)
        })
        .collect();
    Some(format!(
        "{total} alert(s) wait for disabled endpoint(s): {}. They go out once it is enabled: `zonewatch endpoints enable ID` when its receiver takes them again (or a new target in the config file, which enables it when zonewatch next starts)",
        each.join(", ")
    ))
}

/// The exit code of a command's delivery that went through: 1 when alerts are still queued
/// because their last send was deferred for want of this process's own resources (the error
/// log said which limit; they wait for the next run), else 0. Rows queued for another reason
/// (a retry of an endpoint's 503 falling due later) are not these (reviewer).
fn deferred_exit(store: &crate::store::Store, s: &crate::notify::delivery::PassStats) -> i32 {
    if s.deferred == 0 {
        return 0;
    }
    let waiting = match store.deferred_rows(crate::notify::delivery::DEFERRED_PREFIX) {
        Ok(n) => n,
        Err(e) => {
            error_line!("alerts were deferred for want of this process's own resources, and the queue cannot be read to count those left: {e}");
            return 1;
        }
    };
    if waiting > 0 {
        error_line!("{waiting} alert(s) could not be sent: this process ran out of open files or sockets (raise its limit: ulimit -n, or LimitNOFILE= in the service unit); they stay queued for the next run or serve, nothing was charged to their subscribers");
        1
    } else {
        0
    }
}

/// Binds `serve`'s control port, or says why not and gives the exit code.
fn bind_control(addr: std::net::SocketAddr) -> Result<std::net::TcpListener, i32> {
    crate::control::bind(addr).map_err(|e| {
        error_line!("cannot listen on control.listen {addr}: {e}");
        // A port held by another program for now passes: exit 1, which the packaged unit
        // restarts. Anything else (an address this machine does not have, no permission for
        // the port) is the config's: exit 2, not restarted.
        match e.kind() {
            std::io::ErrorKind::AddrInUse => 1,
            _ => 2,
        }
    })
}

/// After the control port could not be bound: when another process holds the store, that is
/// most likely the `serve` already running on it, whose port this is; said, so that an
/// operator looks for that daemon rather than at the port (a tester's second `serve` was told
/// only "Address already in use").
fn say_if_already_served(cfg: &Config) {
    if let Err(redb::DatabaseError::DatabaseAlreadyOpen) = redb::Builder::new().open_read_only(&cfg.store_path) {
        error_line!(
            "the store {} is open in another zonewatch (a `serve` already running with this config holds it and, most likely, this port): one serve per store; `systemctl status zonewatch`, or stop the other one first",
            cfg.store_path.display()
        );
    }
}

fn cmd_serve(config: &std::path::Path) -> i32 {
    crate::util::limit_allocator_arenas();
    // The control port is bound before the store is opened: on a port another program holds,
    // `serve` fails without creating a store file (it created one, and its token, before).
    let mut bound = None;
    let engine = match open_engine_after(config, &mut |cfg| {
        bound = Some(bind_control(cfg.control.listen).inspect_err(|_| say_if_already_served(cfg))?);
        Ok(())
    }) {
        Ok(e) => Arc::new(e),
        Err(code) => return code,
    };
    let Some(bound) = bound else {
        error_line!("the control port was not bound");
        return 2;
    };
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(c) => return c,
    };
    let (tx, rx) = tokio::sync::watch::channel(false);
    let tx = Arc::new(tx);
    {
        // A damaged store (redb panicked on one of the runtime's threads) stops the daemon:
        // `dispatch`'s guard then says so in one line, exit 2. Left running, every pass of
        // every task would fail on the same pages.
        let tx = tx.clone();
        crate::store::guard::on_damage(move || {
            // Inside the panic hook: nothing here may panic (`say::line` ignores a closed stderr).
            crate::say::line(crate::say::Level::Stopping, format_args!("the store file is damaged (redb panicked reading it); stopping"));
            let _ = tx.send(true);
        });
    }
    // After an I/O error (a full disk) redb refuses all work on the open file until it is
    // opened again: stop and exit 1, so the packaged unit restarts the daemon on a reopened
    // file, instead of failing every run and delivery while `/healthz` says ok.
    let reopen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Set when the store file is found removed or replaced (the task below): exit 2.
    let store_gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let (tx, reopen) = (tx.clone(), reopen.clone());
        crate::store::on_reopen_needed(move || {
            if !reopen.swap(true, std::sync::atomic::Ordering::SeqCst) {
                if crate::store::file_size_limit_met() {
                    crate::say::line(crate::say::Level::Stopping, format_args!("the store's files cannot grow past a file-size limit; stopping (exit 2)"));
                } else {
                    crate::say::line(
                        crate::say::Level::Stopping,
                        format_args!("the store refuses work after an I/O error (a full disk?) until it is opened again; stopping (exit 1: the service manager restarts zonewatch)"),
                    );
                }
                let _ = tx.send(true);
            }
        });
    }
    // SIGINT / SIGTERM (Ctrl-C, the service manager's stop): in-flight work finishes (a source
    // being fetched or read is left for the next start: `run_stop.rs`), then
    // exit 0; a second signal exits at once. SIGHUP is left alone (`nohup`). See `signals.rs`.
    {
        let tx = tx.clone();
        if let Err(e) = crate::signals::watch("stopping (sends and commits under way finish, a source being fetched or read is left for the next start; signal again to exit at once)", move || {
            let _ = tx.send(true);
        }) {
            error_line!("cannot install the signal handlers: {e}");
            return 1;
        }
    }
    let failed_start: Option<i32> = rt.block_on(async {
        let deliverer = match Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).map(|d| d.with_clock(engine.clock.clone())) {
            Ok(d) => d,
            Err(e) => {
                error_line!("{e}");
                return Some(1);
            }
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        let runs = Arc::new(crate::schedule::SourceRuns::default());
        let mut tasks = tokio::task::JoinSet::new();
        // The control port.
        let token = match crate::control::auth::load_or_create_token(&engine.config.control.token_file) {
            Ok(t) => t,
            Err(e) => {
                error_line!("{}", e.message);
                // A full disk passes (exit 1, retried); an unreadable or short token is the
                // operator's to fix (exit 2).
                return Some(if e.passes { 1 } else { 2 });
            }
        };
        let listener = match crate::control::listener(bound) {
            Ok(l) => l,
            Err(e) => {
                error_line!("cannot listen on control.listen {}: {e}", engine.config.control.listen);
                return Some(1);
            }
        };
        let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
        // Written again by the store-file check below until it is written (a full disk).
        let addr_written = Arc::new(std::sync::atomic::AtomicBool::new(write_control_addr(&engine.config, &addr, true)));
        tracing::info!(%addr, "control port listening");
        {
            let state = Arc::new(crate::control::ControlState {
                engine: engine.clone(),
                token,
                runs: runs.clone(),
                wake: wake.clone(),
                started: std::time::Instant::now(),
                long_requests: Default::default(),
            });
            tasks.spawn(crate::control::serve(listener, state, rx.clone()));
        }
        {
            let d = deliverer.clone();
            let rx = rx.clone();
            let wake = wake.clone();
            tasks.spawn(async move { d.run(rx, wake).await });
        }
        // Source runs are CPU-bound and commit one at a time: running more at once than there
        // are cores only spreads them over more threads and allocator arenas (measured, issue 7:
        // 100 sources × 200 parcels starting together left an idle `serve` at 56 MiB RSS, against
        // 25 MiB for the same daemon without sources).
        let run_slots = Arc::new(tokio::sync::Semaphore::new(crate::util::cores()));
        for src in engine.config.sources.clone() {
            let run_slots = run_slots.clone();
            let engine = engine.clone();
            let mut rx = rx.clone();
            let wake = wake.clone();
            let runs = runs.clone();
            let stop_all = tx.clone();
            tasks.spawn(async move {
                loop {
                    if *rx.borrow() {
                        break;
                    }
                    // A derived source waits for its parcel base's first ingest: at a first start
                    // both are due at once, and a run before the base's baseline has committed
                    // only fails ("run the base first", a failed run in the totals for good: a
                    // black-box tester). Not once the base has run without a baseline (failed,
                    // held): then the derived run fails and says why, as before. Nor when the
                    // store cannot say (a read error): the run goes ahead and fails saying it,
                    // where a wait would be silent, and for good.
                    if let Some(base) = src.parcels.as_deref() {
                        let no_base = matches!(engine.store.watermark(base), Ok(None));
                        if no_base && (crate::ingest::staging::is_leased(engine.store.path(), base) || matches!(engine.store.last_run(base), Ok(None))) {
                            tokio::select! {
                                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                                _ = rx.changed() => {}
                            }
                            continue;
                        }
                    }
                    let e = engine.clone();
                    let s = src.clone();
                    let permit = run_slots.clone().acquire_owned().await.ok();
                    if *rx.borrow() {
                        break;
                    }
                    let outcome = tokio::task::spawn_blocking(move || {
                        let r = e.run_source(&s, RunOptions::default());
                        crate::util::release_free_memory();
                        r
                    })
                    .await;
                    drop(permit);
                    match outcome {
                        Ok(Ok(report)) if report.record.verdict == crate::model::Verdict::SkippedOverlap => {
                            tracing::warn!(source = %src.id, "skipped_overlap: a run of this source is still going")
                        }
                        // A held run waits for an operator: a warning, where a journal
                        // filtered to warnings shows it at 3 a.m. (bb27's quick reference).
                        Ok(Ok(report)) if report.record.verdict == crate::model::Verdict::Held => {
                            tracing::warn!("{} (release or prime it: zonewatch holds list, GET /v1/holds/{{run}}/changes)", report.line());
                        }
                        Ok(Ok(report)) => {
                            tracing::info!("{}", report.line());
                            wake.notify_one();
                        }
                        Ok(Err(err)) if err.is_stopped() => {
                            tracing::info!(source = %src.id, "run stopped by the shutdown before its commit: nothing of it was committed, and the next start runs it again")
                        }
                        Ok(Err(err)) => {
                            tracing::error!(source = %src.id, "run failed: {err}");
                            // A file-size limit met by a run's spill file beside the store
                            // fails every run until it is raised: stop, exit 2 (below).
                            if crate::store::file_size_limit_met() && !*rx.borrow() {
                                crate::say::line(crate::say::Level::Stopping, format_args!("the store's files cannot grow past a file-size limit; stopping (exit 2)"));
                                let _ = stop_all.send(true);
                            }
                        }
                        Err(err) => tracing::error!(source = %src.id, "run task failed: {err}"),
                    }
                    // The wait drawn once: the time shown (`next_run`) is the one slept to.
                    let wait = crate::ingest::portal::jittered(src.every);
                    runs.set_next_run(&src.id, engine.now().saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = rx.changed() => {}
                    }
                }
            });
        }
        {
            // The store file removed or replaced under the daemon (a temp cleaner, a wrong
            // `rm`): redb goes on writing the open file, and all of it would be lost when the
            // process ends, while `/healthz` said ok. Stop, exit 2: a restart would begin an
            // empty store (or find no folder), so it is for an operator to put one back.
            let store = engine.store.clone();
            let (tx, gone) = (tx.clone(), store_gone.clone());
            let mut rx = rx.clone();
            let (config, addr, addr_written) = (engine.config.clone(), addr.clone(), addr_written.clone());
            let watcher = engine.clone();
            tasks.spawn(async move {
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(STORE_FILE_CHECK) => {}
                        _ = rx.changed() => break,
                    }
                    if !addr_written.load(std::sync::atomic::Ordering::Relaxed) && write_control_addr(&config, &addr, false) {
                        addr_written.store(true, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(path = %control_addr_file(&config).display(), "control port address written");
                    }
                    let store = store.clone();
                    // A stat hung on a network file system does not hold up a shutdown.
                    let found = tokio::select! {
                        r = tokio::task::spawn_blocking(move || store.file_gone()) => r,
                        _ = rx.changed() => break,
                    };
                    if let Ok(Some(why)) = found {
                        crate::say::line(
                            crate::say::Level::Stopping,
                            format_args!("{why}; what zonewatch writes now is lost with it: stopping (exit 2: put the store back, restore a backup if it is gone, and start zonewatch again)"),
                        );
                        gone.store(true, std::sync::atomic::Ordering::SeqCst);
                        let _ = tx.send(true);
                        break;
                    }
                    // A step forward of the clock seen and stored within seconds, however idle
                    // delivery is (`Engine::settle_clock_watch`); after the file check, and not
                    // holding up a shutdown (its commit may wait for a run's).
                    let w = watcher.clone();
                    tokio::select! {
                        _ = tokio::task::spawn_blocking(move || w.settle_clock_watch()) => {}
                        _ = rx.changed() => break,
                    }
                }
            });
        }
        {
            let store = engine.store.clone();
            let clock = engine.clock.clone();
            let retention = engine.config.delivery.retention;
            let run_retention = engine.config.run_retention;
            let backups = backup_dir(&engine.config);
            let mut rx = rx.clone();
            tasks.spawn(async move {
                loop {
                    // What killed backups left in `backups/` (at start too: a daemon killed
                    // while writing one, a `zonewatch backup` killed before it took its copy).
                    let dir = backups.clone();
                    let _ = tokio::task::spawn_blocking(move || crate::store::backup::sweep_leftovers(&dir, std::time::SystemTime::now())).await;
                    tokio::select! {
                        _ = tokio::time::sleep(std::time::Duration::from_secs(600)) => {}
                        _ = rx.changed() => break,
                    }
                    let now = clock.now_ms();
                    let n = sweep_in_batches(&store, "key sweep", move |s, max| s.sweep_expired_keys_batch(now, max), SWEEP_BATCH, &rx).await;
                    if n > 0 {
                        tracing::info!(swept = n, "expired idempotency keys removed");
                    }
                    let horizon = clock.now_ms().saturating_sub(retention.as_millis() as u64);
                    let n = sweep_in_batches(&store, "attempt retention sweep", move |s, max| s.sweep_attempts(horizon, max).map(SweepBatch::of_removed), SWEEP_BATCH, &rx).await;
                    if n > 0 {
                        tracing::info!(swept = n, "delivery attempts past retention removed");
                    }
                    let (now, keep) = (clock.now_ms(), run_retention.as_millis() as u64);
                    let n = sweep_in_batches(&store, "run retention sweep", move |s, max| s.sweep_quiet_runs_batch(now, keep, max), RUN_SWEEP_BATCH, &rx).await;
                    if n > 0 {
                        tracing::info!(swept = n, "run records that committed nothing removed past run_retention");
                    }
                    let n = sweep_in_batches(&store, "hold retention sweep", move |s, max| s.sweep_superseded_holds(now, keep, max).map(SweepBatch::of_removed), RUN_SWEEP_BATCH, &rx).await;
                    if n > 0 {
                        tracing::info!(swept = n, "superseded holds removed past run_retention");
                    }
                    let n = sweep_in_batches(&store, "quarantine retention sweep", move |s, max| s.sweep_quarantine(now, keep, max).map(SweepBatch::of_removed), RUN_SWEEP_BATCH, &rx).await;
                    if n > 0 {
                        tracing::info!(swept = n, "quarantined features' rows removed past run_retention (their audit rows stay)");
                    }
                }
            });
        }
        {
            // However the daemon is stopping (a signal, its store gone), a source run under way
            // is abandoned before its commit rather than fetched to the end (`run_stop.rs`).
            let stop = engine.stop.clone();
            let mut rx = rx.clone();
            tasks.spawn(async move {
                while !*rx.borrow() {
                    if rx.changed().await.is_err() {
                        break;
                    }
                }
                crate::sd_notify::notify("STOPPING=1");
                stop.request();
            });
        }
        tracing::info!(sources = engine.config.sources.len(), subscribers = engine.subscribers.subscribers().len(), "zonewatch serving");
        // Not after a stop began (a signal in the start's last moments): systemd would read
        // READY=1 after STOPPING=1.
        if !*rx.borrow() {
            crate::sd_notify::notify("READY=1");
        }
        if let Some(text) = engine_disabled_backlog(&engine) {
            tracing::warn!("{text}");
        }
        while tasks.join_next().await.is_some() {}
        let e = engine.clone();
        let _ = tokio::task::spawn_blocking(move || e.settle_clock_watch()).await;
        None
    });
    // Dropping the runtime waits for its blocking tasks (a backup a client asked for is
    // written to the end); a second signal still ends the process meanwhile.
    drop(rt);
    if let Some(code) = failed_start {
        return code;
    }
    if store_gone.load(std::sync::atomic::Ordering::SeqCst) {
        tracing::error!("zonewatch stopped: its store file was removed or replaced while it ran");
        return 2;
    }
    if reopen.load(std::sync::atomic::Ordering::SeqCst) || crate::store::file_size_limit_met() {
        if crate::store::file_size_limit_met() {
            // Restarting would meet the same limit: exit 2, which the packaged unit does not
            // restart (a tester saw it restart in a loop when SIGXFSZ killed the process).
            error_line!("store {}: {}", engine.config.store_path.display(), crate::store::FILE_SIZE_LIMIT);
            return 2;
        }
        tracing::error!("zonewatch stopped: the store must be opened again after an I/O error");
        return 1;
    }
    tracing::info!("zonewatch stopped cleanly");
    0
}

/// What `run` sweeps once its sources and delivery are done (`serve` sweeps every 10
/// minutes): expired idempotency keys, delivery attempts past `retention`, run records that
/// committed nothing, superseded holds and quarantined features' rows past `run_retention`;
/// one batch each.
fn end_of_run_sweeps(engine: &Engine) {
    if let Err(e) = engine.store.sweep_expired_keys(engine.now(), 10_000) {
        warning_line!("sweeping expired idempotency keys failed: {e}");
    }
    let horizon = engine.now().saturating_sub(engine.config.delivery.retention.as_millis() as u64);
    if let Err(e) = engine.store.sweep_attempts(horizon, 10_000) {
        warning_line!("retention sweep of delivery attempts failed: {e}");
    }
    let keep = engine.config.run_retention.as_millis() as u64;
    if let Err(e) = engine.store.sweep_quiet_runs(engine.now(), keep, RUN_SWEEP_BATCH) {
        warning_line!("retention sweep of run records failed: {e}");
    }
    if let Err(e) = engine.store.sweep_superseded_holds(engine.now(), keep, RUN_SWEEP_BATCH) {
        warning_line!("retention sweep of superseded holds failed: {e}");
    }
    if let Err(e) = engine.store.sweep_quarantine(engine.now(), keep, RUN_SWEEP_BATCH) {
        warning_line!("retention sweep of quarantined features failed: {e}");
    }
}

/// How often `serve` makes sure its store's path still names the file it has open.
const STORE_FILE_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// Rows one sweep call may delete: bounds how long a sweep holds the write lock.
const SWEEP_BATCH: usize = 10_000;
/// Run records one retention sweep call may remove (each with its index entry and history
/// row): smaller than [`SWEEP_BATCH`], the catch-up of a store upgraded with years of records
/// leaves the write lock to outcome and run commits more often.
const RUN_SWEEP_BATCH: usize = 2_000;
/// Batches one sweep period may run back to back.
const SWEEP_BATCHES_PER_PERIOD: usize = 100;

/// Runs bounded sweeps one after another while each deletes something, with a pause between so
/// delivery and source runs get the write lock in between: a backlog larger than one batch
/// (a county's baseline keys expiring together, a busy week's attempts) is worked off in this
/// period instead of one batch per period, which a steady high rate could outgrow. Returns
/// the rows deleted; a failure is logged and ends the period, and so does a shutdown (the
/// batch under way commits; the rest waits for the next start).
async fn sweep_in_batches(
    store: &Arc<Store>,
    what: &'static str,
    sweep: impl Fn(&Store, usize) -> Result<crate::store::SweepBatch, StoreError> + Send + Copy + 'static,
    batch: usize,
    shutdown: &tokio::sync::watch::Receiver<bool>,
) -> usize {
    let mut total = 0;
    for _ in 0..SWEEP_BATCHES_PER_PERIOD {
        if *shutdown.borrow() {
            break;
        }
        let s = store.clone();
        match tokio::task::spawn_blocking(move || sweep(&s, batch)).await {
            Ok(Ok(batch)) => {
                total += batch.removed;
                // Until a batch removes nothing and stopped short of its bound: a batch can
                // remove fewer than it took (keys re-armed because their event is pending,
                // stale expiry entries, attempts kept for dead letters, kept run records read
                // past) and still leave work behind it.
                if batch.removed == 0 && !batch.more {
                    break;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!("{what} failed: {e}");
                break;
            }
            Err(e) => {
                tracing::warn!("{what} stopped: {e}");
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    total
}

/// Where the running daemon writes its control port address (beside the store).
pub fn control_addr_file(cfg: &Config) -> PathBuf {
    cfg.store_path.with_extension("control-addr")
}

/// Writes `serve`'s control port address for the commands that ask the daemon (`backup`):
/// whole or not at all (a temp file renamed over it), so a full disk leaves no empty file
/// (a tester's `backup` then asked `http:///v1/backup` for as long as that `serve` ran).
/// Says why it could not; `serve` tries again every few seconds.
fn write_control_addr(cfg: &Config, addr: &str, say: bool) -> bool {
    let path = control_addr_file(cfg);
    match crate::util::write_atomic(&path, addr.as_bytes()) {
        Ok(()) => true,
        Err(e) => {
            if say {
                tracing::warn!("cannot write {} (tried again every {} s): {e}", path.display(), STORE_FILE_CHECK.as_secs());
            }
            // An older daemon's address would send `backup` to the wrong port.
            let _ = std::fs::remove_file(&path);
            false
        }
    }
}

/// Where `POST /v1/backup` writes backups (beside the store).
pub fn backup_dir(cfg: &Config) -> PathBuf {
    cfg.store_path.parent().map(|p| p.join("backups")).unwrap_or_else(|| PathBuf::from("backups"))
}

fn cmd_backup(config: &std::path::Path, dest: &std::path::Path) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if dest.exists() {
        error_line!("{} exists; choose a new file name", dest.display());
        return 2;
    }
    // An interrupted backup leaves no half-written temp file beside DEST; one killed outright
    // left one there, removed once an hour old.
    let _finish = crate::signals::on_signal_remove_scratch();
    // Only this user's: a temp file this process made is owned so.
    crate::store::backup::sweep_backup_leftovers(crate::util::folder_of(dest), crate::util::effective_uid(), std::time::SystemTime::now());
    // A file this user may read but not write: copied through a read-only open (a `Store`
    // writes even to read).
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(&cfg.store_path) {
        if matches!(e.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem) {
            return match crate::store::backup::backup_read_only(&cfg.store_path, dest) {
                Ok(info) => {
                    println!("backup: {} ({} bytes, {} tables, {} rows; the store file is read-only here: copied as it is)", info.path.display(), info.bytes, info.tables, info.rows);
                    0
                }
                Err(crate::store::StoreError::InUse { .. }) => backup_via_daemon(&cfg, dest),
                Err(e) => {
                    error_line!("{e}");
                    store_exit_code(&e)
                }
            };
        }
    }
    // A wrong `[store] path` must not back up a new, empty store and report success.
    match crate::store::Store::open_existing(&cfg.store_path) {
        Ok(store) => match store.backup_to(dest) {
            Ok(info) => {
                println!("backup: {} ({} bytes, {} tables, {} rows)", info.path.display(), info.bytes, info.tables, info.rows);
                0
            }
            Err(e) => {
                error_line!("{e}");
                store_exit_code(&e)
            }
        },
        Err(crate::store::StoreError::InUse { .. }) => backup_via_daemon(&cfg, dest),
        Err(e) => {
            error_line!("{e}");
            2
        }
    }
}

/// The store is open in a running `serve`: ask it for a backup over the control port, then
/// copy the file it wrote to `dest` and check it.
fn backup_via_daemon(cfg: &Config, dest: &std::path::Path) -> i32 {
    // The address `serve` wrote, or else the configured one (a `serve` that could not write
    // it, on a full disk, listens there all the same unless its port is 0).
    let addr = match std::fs::read_to_string(control_addr_file(cfg)).ok().and_then(|a| a.trim().parse::<std::net::SocketAddr>().ok()) {
        Some(a) => a.to_string(),
        None => cfg.control.listen.to_string(),
    };
    let token = match std::fs::read_to_string(&cfg.control.token_file) {
        Ok(t) => t.trim().to_string(),
        // No token at all: no `serve` ever ran with this config, so what holds the store is a
        // `run` or another command (a black-box tester read the token's "No such file" as the
        // fault).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            error_line!("the store is in use by another zonewatch: a `run` or another command still going; try again when it has finished");
            return 1;
        }
        Err(e) => {
            error_line!(
                "the store is in use by another zonewatch: a `run` or another command still going (try again when it has finished), or a `serve` whose control token {} cannot be read by this user ({e})",
                cfg.control.token_file.display()
            );
            // No permission stays so on a retry; no token yet most likely means a `run`.
            return if e.kind() == std::io::ErrorKind::PermissionDenied { 2 } else { 1 };
        }
    };
    // The name is ours, so the daemon's copy is known before it answers: a signal while it
    // writes, or while this command copies it, removes it (or says where it will be left).
    // A hand-off name: the daemon's sweep removes the copy if this command never comes back
    // for it (killed), and it is renamed out of that when it is the only copy kept.
    let stamp = format!("{}-{}.redb", crate::util::rfc3339(crate::clock::Clock::now_ms(&crate::clock::SystemClock)).replace([':', '.'], "-"), std::process::id());
    let name = format!("{}{stamp}", crate::store::backup::HANDOFF_PREFIX);
    let daemon_copy = backup_dir(cfg).join(&name);
    let mut unfinished = crate::signals::scratch_of_another(
        &daemon_copy,
        format!("the running daemon may still be writing its backup {}: remove that file once it appears", daemon_copy.display()),
    );
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(c) => return c,
    };
    let result: Result<String, String> = rt.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().map_err(|e| e.to_string())?;
        // The store meant, by identity: a daemon of another install on this address (sharing
        // the token, its address file left by a stop) refuses rather than copy its own.
        let store = crate::control::routes::FileIdentity::of(&cfg.store_path).ok();
        let ask = || client.post(format!("http://{addr}/v1/backup")).bearer_auth(&token).header("content-type", "application/json").body(serde_json::json!({ "name": name, "store": store }).to_string()).send();
        let mut sent = ask().await;
        // A connection the daemon closed before it answered, with no copy begun: a full control
        // port made room with it before reading the request (it closes none that is being
        // answered), so asking again starts nothing twice (a black-box tester saw one backup
        // in six fail so under a flood of connections).
        for _ in 0..3 {
            match &sent {
                Err(e) if !e.is_connect() && !e.is_timeout() && !daemon_copy.exists() => {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    sent = ask().await;
                }
                _ => break,
            }
        }
        let resp = sent
            .map_err(|e| match e.is_connect() {
                true => format!("the store is in use by another zonewatch, and no daemon answered on its control port {addr} ({e}): a `run` or another command is still going, or a `serve` that has not written its address beside the store yet (it tries every few seconds, as on a full disk); try again in a moment"),
                // The request went out: the daemon may be writing the backup (and stopping).
                false => format!("the daemon on {addr} did not answer the backup request ({e}); if it started the backup, it will be at {}", daemon_copy.display()),
            })?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.map_err(|e| e.to_string())?;
        if body["error"]["code"] == "other_store" {
            return Err(format!(
                "the daemon answering on {addr} is not this store's ({}): {} is in use by another zonewatch (a `run` or another command still going, or a `serve` that has not written its address beside the store yet); try again in a moment",
                body["error"]["message"].as_str().unwrap_or_default(),
                std::path::absolute(&cfg.store_path).unwrap_or_else(|_| cfg.store_path.clone()).display()
            ));
        }
        if !status.is_success() {
            return Err(format!("daemon refused the backup ({status}): {body}"));
        }
        body["path"].as_str().map(str::to_string).ok_or_else(|| "daemon answer lacks path".to_string())
    });
    // The daemon's answer is its own path to the copy; this command's view of the store's
    // folder finds the same file even where the two see the file system differently.
    let src = match result {
        Ok(_) if daemon_copy.exists() => daemon_copy.clone(),
        Ok(p) => {
            let p = PathBuf::from(p);
            unfinished = crate::signals::scratch(&p);
            p
        }
        Err(e) => {
            error_line!("{e}");
            return 1;
        }
    };
    match copy_daemon_backup(&src, dest).map_err(|(e, code)| (format!("cannot copy {} to {}: {e}", src.display(), dest.display()), code)) {
        Ok(bytes) => {
            // The operator has a verified copy at `dest`: the daemon's copy would only fill
            // the disk, one whole store per backup.
            let daemon_copy = match std::fs::remove_file(&src) {
                Ok(()) => format!("its copy at {} removed", src.display()),
                Err(e) => format!("its copy stays at {}: cannot remove it: {e}", src.display()),
            };
            println!("backup: {} ({bytes} bytes, taken by the running daemon; {daemon_copy})", dest.display());
            0
        }
        Err((e, code)) => {
            // The only copy of this backup now: no signal may remove it, and it is renamed
            // out of the hand-off name, which the daemon's sweep would remove in an hour.
            drop(unfinished);
            let kept = src.with_file_name(format!("zonewatch-{stamp}"));
            let kept = match std::fs::rename(&src, &kept) {
                Ok(()) => kept,
                Err(rename) if rename.kind() == std::io::ErrorKind::NotFound => {
                    error_line!("{e}; the daemon's backup {} is gone as well (removed meanwhile): take the backup again", src.display());
                    return code;
                }
                Err(rename) => {
                    warning_line!("cannot rename {} to {} ({rename}): the daemon removes it an hour after it was written", src.display(), kept.display());
                    src.clone()
                }
            };
            error_line!("{e}; the daemon's backup is kept at {} (the only copy of this backup)", kept.display());
            code
        }
    }
}

/// Copies the daemon's backup `src` to `dest` (which must not exist) through a temp file
/// beside `dest`, verifies the copy and renames it into place. Returns its size, or why not
/// with the exit code it makes (1 when trying again can succeed: a full disk). `src` is only
/// read.
fn copy_daemon_backup(src: &std::path::Path, dest: &std::path::Path) -> Result<u64, (String, i32)> {
    if dest.exists() {
        return Err(("the destination already exists".into(), 2));
    }
    let parent = crate::util::folder_of(dest);
    let copy = crate::store::backup::verified_copy(src, parent, crate::store::backup::TEMP_PREFIX).map_err(|e| (e.to_string(), store_exit_code(&e)))?;
    let bytes = copy.bytes;
    crate::signals::committing();
    copy.tmp.persist_noclobber(dest).map_err(|e| {
        let e = crate::store::StoreError::Io { what: "cannot move the copy into place".into(), source: e.error };
        (e.to_string(), store_exit_code(&e))
    })?;
    Ok(bytes)
}

fn cmd_restore(config: &std::path::Path, src: &std::path::Path) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // An interrupted restore leaves the store as it was, and no temp copy beside it.
    let _finish = crate::signals::on_signal_remove_scratch();
    match crate::store::backup::restore(src, &cfg.store_path) {
        Ok(info) => {
            println!("restored {} to {}", src.display(), cfg.store_path.display());
            println!("changes found again since the backup are told again, under new webhook-ids (what was sent after the backup is not in it)");
            if let Some(kept) = &info.kept {
                println!("the replaced store is kept at {}", kept.display());
            }
            for warning in &info.warnings {
                warning_line!("{warning}");
            }
            // Found by a black-box tester: a hold open in the backup, released after the
            // restore, sent its 45 alerts a second time under new webhook-ids.
            match &info.open_holds {
                Ok(held) if held.is_empty() => {}
                Ok(held) => {
                    let ids: Vec<String> = held.iter().map(u64::to_string).collect();
                    warning_line!(
                        "the backup has {} open hold(s) (run {}): releasing one sends its alerts under new webhook-ids, also any that subscribers got after the backup was taken; if they did, prime it instead (`zonewatch holds prime RUN_ID --config FILE`)",
                        held.len(),
                        ids.join(", ")
                    );
                }
                Err(e) => warning_line!(
                    "the backup's holds could not be read ({e}): see `zonewatch holds list` before releasing one (releasing a hold of the backup sends its alerts under new webhook-ids)"
                ),
            }
            0
        }
        Err(e) => {
            error_line!("{e}");
            // In use (stop the daemon first) or a full disk: 1. A backup that is not a
            // healthy store, or is not there: 2, trying again would not help.
            match e {
                crate::store::StoreError::Conflict(_) => 1,
                e => store_exit_code(&e),
            }
        }
    }
}

/// `store`: `None` without `--store`; `Some(None)` for the config's store; `Some(Some(path))`.
fn cmd_check(config: &std::path::Path, store: Option<Option<&std::path::Path>>) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // "read", not "ok": the lines below may still find problems in what it names (bb27).
    println!("config {}: read", config.display());
    // Warnings are said, not counted as problems: they may not stop a start, and `check` is
    // also run as another user than the daemon's. The last line says there were some.
    // What `run` and `serve` as this user would refuse in the store (`refusals`) is a warning
    // too, unless this user is the daemon's: the one its store's folder belongs to (the
    // package's `zonewatch`, or whoever runs zonewatch from a folder of their own). There it
    // is a problem: `check` run as the service user said "all good", exit 0, over a start
    // that would fail. (A control token this user may not read stays a warning: only `serve`
    // reads it, and `run` from cron needs none: a reader.)
    let mut warnings = 0usize;
    let mut refusals = 0usize;
    for advice in cfg.advisories() {
        warnings += 1;
        println!("warning: {advice}");
    }
    println!("delivery: {}", cfg.delivery.describe());
    println!("store: {}", cfg.store_path.display());
    let mut bad = 0;
    for s in &cfg.sources {
        let path = match &s.kind {
            crate::config::SourceKind::File { path } => path,
            other => {
                println!(
                    "source {}: {} every={} floor={} stale_after={} max_change_ratio={} fields: {}",
                    s.id,
                    crate::ingest::settings::describe_kind(other),
                    crate::util::format_duration(s.every),
                    crate::util::format_duration(s.floor),
                    crate::util::format_duration(s.stale_after),
                    s.max_change_ratio,
                    s.fields.describe()
                );
                // A private address written in the URL is refused at every fetch unless allowed.
                // The layer's object-id field is known only from the portal (a run refuses it
                // then); the names ArcGIS gives it are warned of here, before a first start
                // fails on them (found by a black-box tester).
                if matches!(other, crate::config::SourceKind::Arcgis { .. }) && ["OBJECTID", "OBJECTID_1", "FID", "OID"].iter().any(|n| s.fields.parcel_id.eq_ignore_ascii_case(n)) {
                    warnings += 1;
                    println!(
                        "warning: source {}: fields.parcel_id = {:?} is the name ArcGIS gives a layer's object-id field; if it is this layer's, every run is refused (object ids are reassigned on republish): configure a stable id field",
                        s.id, s.fields.parcel_id
                    );
                }
                if let Some(url) = crate::ingest::settings::kind_url(other).filter(|u| !cfg.ingest.allow_private_targets && crate::netguard::url_written_private(u)) {
                    bad += 1;
                    println!(
                        "source {}: ERROR url {url} is a private address: every fetch would be refused (set ingest.allow_private_targets = true to read it)",
                        s.id
                    );
                }
                continue;
            }
        };
        // Opened, not only looked for: a layer this user may not read fails every run.
        let (readable, state) = match std::fs::File::open(path) {
            Ok(_) => (true, "exists".to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (false, "MISSING".to_string()),
            Err(e) => (false, format!("NOT READABLE: {e}")),
        };
        println!(
            "source {}: {}kind=file path={} ({state}) every={} max_change_ratio={} fields: {}",
            s.id,
            if readable { "" } else { "ERROR " },
            path.display(),
            crate::util::format_duration(s.every),
            s.max_change_ratio,
            s.fields.describe()
        );
        if !readable {
            bad += 1;
        }
    }
    for s in &cfg.subscribers {
        match crate::notify::aoi::load_aoi_noted(&s.aoi_path) {
            Ok((mp, repaired)) => {
                use geo::{BoundingRect, GeodesicArea};
                // A polygon half the globe wide or more has no meaningful ring area (one from
                // -180 to 180 read as 0 m²: found by a black-box tester): its extent is said.
                // Polygon by polygon: an AOI split at the antimeridian, as it must be, or two
                // far-apart parts are as wide as the globe together, not each.
                let (mut m2, mut wide) = (0.0, Vec::new());
                for polygon in &mp.0 {
                    match polygon.bounding_rect() {
                        Some(r) if r.width() >= 180.0 => wide.push(format!("{:.0}° of longitude by {:.0}° of latitude", r.width(), r.height())),
                        _ => m2 += polygon.geodesic_area_unsigned(),
                    }
                }
                let size = match (wide.is_empty(), m2 > 0.0) {
                    (true, _) => format!("{m2:.0} m²"),
                    (false, false) => wide.join(", "),
                    (false, true) => format!("{m2:.0} m² and {}", wide.join(", ")),
                };
                println!(
                    "subscriber {}: aoi ok ({} polygon(s), {size}) target={} min_severity={} signed={}",
                    s.id,
                    mp.0.len(),
                    crate::util::url_for_display(&s.target),
                    s.min_severity,
                    s.secret.is_some()
                );
                if let Some(note) = repaired {
                    warnings += 1;
                    println!("warning: subscriber {}: AOI {}: {note}", s.id, s.aoi_path.display());
                }
            }
            Err(e) => {
                bad += 1;
                println!("subscriber {}: ERROR {e}", s.id);
            }
        }
        // A private address written in the target is refused at every delivery unless allowed.
        if !cfg.delivery.allow_private_targets && crate::netguard::url_written_private(&s.target) {
            bad += 1;
            println!(
                "subscriber {}: ERROR target {} is a private address: every delivery would be refused (set delivery.allow_private_targets = true to deliver there)",
                s.id,
                crate::util::url_for_display(&s.target)
            );
        }
    }
    // The control token `serve` will use: one that is not a token (too short) is a problem;
    // one this user may not read, or cannot create, a warning (`check` is also run as another
    // user than the daemon's, and only `serve` reads it).
    // Plain HTTP with a bearer token: on an address other machines reach, the token crosses
    // the network in clear (a tester's 0.0.0.0 passed without a word).
    if !cfg.control.listen.ip().is_loopback() {
        warnings += 1;
        println!(
            "warning: control.listen {} is reachable from other machines: the control port is plain HTTP, so its token crosses the network in clear; listen on 127.0.0.1 (or ::1) and reach it through an SSH tunnel or a TLS proxy",
            cfg.control.listen
        );
    }
    let token = &cfg.control.token_file;
    match crate::control::auth::read_token(token) {
        Ok(crate::control::auth::TokenFile::Token(_)) => {
            println!("control: {} token {} ok", cfg.control.listen, token.display());
            if let Some(mode) = crate::control::auth::others_may_read(token) {
                warnings += 1;
                println!("warning: control token {}: every user may read it (mode {mode:o}), and with it steer zonewatch: chmod o-rwx it", token.display());
            }
        }
        Ok(crate::control::auth::TokenFile::Missing) => {
            let folder = crate::util::folder_of(token);
            // A folder not there yet is made by `serve` (as far as it may): not judged here.
            match if folder.is_dir() { tempfile::tempfile_in(folder).map(drop) } else { Ok(()) } {
                Ok(()) => println!("control: {} token {} (created on first start)", cfg.control.listen, token.display()),
                Err(e) => {
                    warnings += 1;
                    println!(
                        "warning: control token {}: not there yet, and this user cannot create it in {} ({e}): `serve` as this user would refuse to start (create the token, or give the service user that folder)",
                        token.display(),
                        folder.display()
                    );
                }
            }
        }
        // Counted: under the package `serve` may not write there, and it would not start
        // (bb27: `all good` without a warning counted).
        Ok(crate::control::auth::TokenFile::Empty) => {
            warnings += 1;
            println!(
                "warning: control {} token {} holds no token (a first start cut short?): `serve` writes a new one in its place where it may write in that folder; otherwise (the package's /etc/zonewatch) remove it and reinstall or reconfigure the package (dpkg-reconfigure zonewatch), which writes one",
                cfg.control.listen,
                token.display()
            )
        }
        Err(e) if std::fs::File::open(token).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) => {
            warnings += 1;
            println!(
                "warning: control token {}: this user may not read it ({e}): `serve` as this user would refuse to start (check may be run as another user than the service's)",
                token.display()
            );
        }
        Err(e) => {
            bad += 1;
            println!("control: ERROR {e}");
        }
    }
    // Where the store goes, without opening it: a `[store] path` naming a folder, or an empty
    // file (a store cut to nothing, which `run` and `serve` refuse), fails here already.
    match std::fs::metadata(&cfg.store_path) {
        Ok(m) if m.is_dir() => {
            bad += 1;
            println!("store: ERROR {} is a folder; `[store] path` names the store file (it is created there)", cfg.store_path.display());
        }
        Ok(m) if m.len() == 0 => {
            bad += 1;
            println!("store: ERROR {}: {}", cfg.store_path.display(), crate::store::EMPTY_STORE_FILE);
        }
        // Not there yet: `run` and `serve` create it, but only in a folder that exists (a
        // mistyped path must not become a new, empty store). Not asked when `--store PATH`
        // checks another file (a backup on another machine than the config's).
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) && !matches!(store, Some(Some(_))) => {
            let folder = crate::util::folder_of(&cfg.store_path);
            match std::fs::metadata(folder) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    bad += 1;
                    println!("store: ERROR {}: {} is not a folder", cfg.store_path.display(), folder.display());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bad += 1;
                    println!(
                        "store: ERROR {}: its folder {} does not exist (`run` and `serve` would refuse it): check `[store] path`, or create the folder (mkdir -p) for a new store",
                        cfg.store_path.display(),
                        folder.display()
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                    bad += 1;
                    println!("store: ERROR {}: a part of its folder {} is a file, not a folder", cfg.store_path.display(), folder.display());
                }
                // Another user than the daemon's may not see the folder: not counted.
                Err(_) => {}
            }
        }
        _ => {}
    }
    // What `run` and `serve` as this user need of the config's store besides its folder
    // (above): reading and writing the file, and making temp files beside it.
    if !matches!(store, Some(Some(_))) {
        for w in store_access_warnings(&cfg.store_path) {
            refusals += 1;
            println!("warning: {w}");
        }
    }
    // The store part is asked for: `check --config` alone is the config check an operator
    // runs after every edit, which must stay quick: it looks at where the store goes
    // (above), never into it.
    match store {
        None => {}
        Some(None) => bad += check_store(&cfg, &cfg.store_path, false, &mut warnings),
        Some(Some(p)) => bad += check_store(&cfg, p, true, &mut warnings),
    }
    if refusals > 0 && runs_as_folder_owner(&cfg.store_path) {
        println!("store: ERROR {refusals} of the store warnings above would stop `run` and `serve`: this user owns the store's folder, and is taken as the user they run as");
        bad += refusals;
    } else {
        warnings += refusals;
    }
    if bad > 0 {
        error_line!("{bad} problem(s) found");
        2
    } else {
        let seen = match warnings {
            0 => String::new(),
            n => format!(" ({n} warning(s) above)"),
        };
        println!("all good: {} source(s), {} subscriber(s){seen}", cfg.sources.len(), cfg.subscribers.len());
        0
    }
}

/// Whether this process runs as the user that owns the folder of the store at `path`: taken
/// as the user `run` and `serve` are run as. False when the folder cannot be read.
fn runs_as_folder_owner(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(crate::util::folder_of(path)).is_ok_and(|folder| folder.uid() == crate::util::effective_uid())
}

/// What `run` and `serve` as this user would refuse at start in the config's store, besides
/// its folder's existence (the config check's ERROR): a file this user may not read or
/// write, a folder it cannot make temp files in (runs spill there). Warnings, not problems:
/// `check` is also run as another user than the daemon's (an operator's own account), where
/// they say nothing about the service.
fn store_access_warnings(path: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let refused = "`run` and `serve` as this user would refuse to start";
    let denied = |e: &std::io::Error| e.kind() == std::io::ErrorKind::PermissionDenied;
    match std::fs::File::open(path) {
        Err(e) if denied(&e) => out.push(format!("store {}: this user may not read it ({e}): {refused}", path.display())),
        Ok(_) => {
            match std::fs::OpenOptions::new().read(true).write(true).open(path) {
                Err(e) if denied(&e) => out.push(format!("store {}: this user may not write it ({e}): {refused}", path.display())),
                _ => {}
            }
        }
        Err(_) => {}
    }
    let folder = crate::util::folder_of(path);
    if folder.is_dir() {
        if let Err(e) = tempfile::tempfile_in(folder) {
            out.push(format!("store {}: this user cannot make files in {} ({e}): {refused} (runs write their spill files there)", path.display(), folder.display()));
        }
    }
    out
}

/// `check --store`'s part: the cross-table consistency check (`store::check`) on the file,
/// opened read-only (nothing in it changes, an older schema included). Returns the number of
/// problems found. A file not closed cleanly is checked through a temporary copy that redb
/// repairs; one that cannot be repaired, or that redb panics reading, is damaged: a problem.
/// Not checked, and not counted as a problem: a store that a running zonewatch holds open
/// (redb allows one process: check a backup of it instead), one this user may not read, and
/// the config's store before it is first created. A file named on the command line
/// (`explicit`) must exist. Also warns (not a problem) of subscribers created over the
/// control port that a config subscriber of the same id hides.
fn check_store(cfg: &crate::config::Config, path: &std::path::Path, explicit: bool, warnings: &mut usize) -> usize {
    // `check` is also run as another user than the daemon's: a store (or a folder on its
    // path) it may not read is noted (the config's store was warned of already), not
    // counted as a problem.
    match std::fs::File::open(path) {
        // An empty file: the config check said so of the config's store (once, not again in
        // redb's words); one named on the command line is said so here.
        Ok(f) if f.metadata().is_ok_and(|m| m.is_file() && m.len() == 0) => {
            if !explicit {
                return 0;
            }
            println!("store {}: ERROR {}", path.display(), crate::store::EMPTY_STORE_FILE);
            return 1;
        }
        Ok(_) => {}
        // (A folder that is missing or not one is the config check's ERROR, said once.)
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) && !explicit => {
            println!("store {}: not created yet", path.display());
            return 0;
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            if explicit {
                *warnings += 1;
                println!("warning: store {}: not readable by this user, consistency not checked ({e})", path.display());
            } else {
                println!("store {}: consistency not checked (not readable by this user)", path.display());
            }
            return 0;
        }
        Err(e) => {
            println!("store {}: ERROR {e}", path.display());
            return 1;
        }
    }
    // A file that needs repair is checked on a copy in TMPDIR: an interrupted check removes it.
    let _finish = crate::signals::on_signal_remove_scratch();
    // A file damaged so that redb panics reading it is an error like any other.
    let checked = crate::store::guard::guarded(|| crate::store::check::check_file(path)).unwrap_or_else(|p| Err(p.at(path)));
    if matches!(&checked, Ok(r) if r.checked_repaired_copy) {
        println!(
            "store {}: was not closed cleanly; checked a temporary copy that redb repaired (the file itself is unchanged; the next `zonewatch run` or `serve` repairs it the same way)",
            path.display()
        );
    }
    if let Ok(r) = &checked {
        // Not counted as a problem: the control port refuses such a target now, one stored
        // before it did only dead-letters its own events, and the daemon must still start.
        for (id, target) in &r.api_subscriber_targets {
            if !cfg.delivery.allow_private_targets && crate::netguard::url_written_private(target) && !cfg.has_subscriber(id) {
                *warnings += 1;
                println!(
                    "warning: subscriber {id:?} (created over the control port) has target {}, a private address: every delivery to it is refused (delivery.allow_private_targets is false); PUT a new target or DELETE it",
                    crate::util::url_for_display(target)
                );
            }
        }
        if let Some(text) = disabled_backlog_text(&r.disabled_backlog, &|id| cfg.has_subscriber(id) || r.api_subscribers.iter().any(|a| a == id)) {
            *warnings += 1;
            println!("warning: store {}: {text}", path.display());
        }
        for id in crate::pipeline::shadowed_subscribers(cfg, r.api_subscribers.iter().cloned()) {
            *warnings += 1;
            println!(
                "warning: subscriber {id:?} of the config replaces the one of the same id created over the control port (stored in {}): the stored definition is not used",
                path.display()
            );
        }
    }
    match checked {
        Ok(r) if r.is_consistent() => {
            println!(
                "store {}: consistent ({} queued outbox row(s), {} audit row(s), {} watermark(s), {} run(s), {} snapshot parcel(s))",
                path.display(),
                r.outbox_rows,
                r.audit_rows,
                r.watermarks,
                r.runs,
                r.snapshot_parcels
            );
            0
        }
        Ok(r) => {
            for p in &r.problems {
                println!("store {}: PROBLEM {p}", path.display());
            }
            r.problems.len()
        }
        Err(crate::store::StoreError::InUse { .. }) => {
            // A warning, so the last line does not read as a store checked (a black-box
            // tester read "all good" so, and the advice then failed under a `run`).
            *warnings += 1;
            println!(
                "warning: store {}: in use by a running zonewatch, consistency not checked: check again once a `run` holding it has finished; under `serve`, check a copy (`zonewatch backup --config ... COPY`, then `zonewatch check --config ... --store COPY`)",
                path.display()
            );
            0
        }
        Err(crate::store::StoreError::Damaged { message, .. }) => {
            println!("store {}: ERROR damaged (redb: {message}); restore a backup: zonewatch restore BACKUP --config FILE", path.display());
            1
        }
        Err(e) => {
            println!("store {}: ERROR {e}", path.display());
            1
        }
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The audit row as the JSON object `audit --format jsonl` prints.
pub fn audit_json(r: &AuditRow) -> serde_json::Value {
    serde_json::json!({
        "seq": r.seq, "ts": rfc3339(r.ts_ms), "outcome": r.outcome.as_str(),
        "idempotency_key": r.idempotency_key, "watcher_id": r.watcher_id, "source_id": r.source_id,
        "parcel_id": r.parcel_id, "lineage_id": r.lineage_id, "detail": r.detail,
    })
}

fn cmd_audit(config: &std::path::Path, filter: AuditFilter, format: AuditFormat) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let store = match crate::store::Store::open_existing(&cfg.store_path) {
        Ok(s) => s,
        Err(e) => {
            error_line!("{}", store_error_text(&cfg.store_path, &e));
            return store_exit_code(&e);
        }
    };
    // Written through a handle whose errors are seen: `audit | head` closing the pipe ends
    // the command here, with the store closed cleanly (a panic would leave it to repair).
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = if format == AuditFormat::Table {
        // A table's columns are as wide as their widest cell: every row is read first.
        match store.audit(&filter) {
            Ok(rows) => write_audit_table(&mut out, &rows),
            Err(e) => {
                error_line!("{e}");
                return store_exit_code(&e);
            }
        }
    } else {
        match write_audit_pages(&mut out, &store, &filter, format, AUDIT_PAGE_ROWS) {
            Ok(written) => written,
            Err(e) => {
                // The rows before the one that stopped the read are written; it is named.
                let _ = std::io::Write::flush(&mut out);
                error_line!("{e}");
                return store_exit_code(&e);
            }
        }
    };
    match written.and_then(|()| std::io::Write::flush(&mut out)) {
        Ok(()) => 0,
        // The reader stopped early: as a Unix tool stopped by SIGPIPE.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            error_line!("writing the audit rows: {e}");
            1
        }
    }
}

/// Rows `zonewatch audit` reads per read transaction in its line formats.
const AUDIT_PAGE_ROWS: usize = 10_000;

/// The columns of `zonewatch audit`'s table and CSV.
const AUDIT_COLUMNS: [&str; 9] = ["seq", "ts", "outcome", "idempotency_key", "watcher_id", "source_id", "parcel_id", "lineage_id", "detail"];

/// One audit row's cells, in [`AUDIT_COLUMNS`] order.
fn audit_cells(r: &AuditRow) -> Vec<String> {
    vec![
        r.seq.to_string(),
        rfc3339(r.ts_ms),
        r.outcome.as_str().to_string(),
        r.idempotency_key.clone().unwrap_or_default(),
        r.watcher_id.clone().unwrap_or_default(),
        r.source_id.clone().unwrap_or_default(),
        r.parcel_id.clone().unwrap_or_default(),
        r.lineage_id.clone().unwrap_or_default(),
        r.detail.clone(),
    ]
}

/// The rows matching `filter` as lines of `format` (JSON lines or CSV), read `page_rows` at a
/// time, each page in a read transaction of its own that is closed before the page is
/// written: a ledger of millions of rows is never held in memory, and a reader that stops
/// (`audit | less`) does not hold a snapshot of the store open (redb could not reuse the
/// pages later commits free meanwhile). The ledger is append-only, so the pages join up into
/// one consistent prefix of it. The outer error is the store's (a row that does not decode),
/// the inner one the output's.
fn write_audit_pages(
    out: &mut impl std::io::Write,
    store: &crate::store::Store,
    filter: &AuditFilter,
    format: AuditFormat,
    page_rows: usize,
) -> Result<std::io::Result<()>, crate::store::StoreError> {
    if let Err(e) = write_audit_header(out, format) {
        return Ok(Err(e));
    }
    let page_rows = page_rows.max(1);
    let mut next_seq = filter.since_seq.unwrap_or(0);
    loop {
        let mut page = Vec::with_capacity(page_rows);
        let page_filter = AuditFilter { since_seq: Some(next_seq), ..filter.clone() };
        let read = store.audit_walk(&page_filter, false, None, |row| {
            next_seq = row.seq.saturating_add(1);
            page.push(row);
            page.len() < page_rows
        });
        if let Err(e) = page.iter().try_for_each(|row| write_audit_line(out, row, format)) {
            return Ok(Err(e));
        }
        read?;
        if page.len() < page_rows {
            return Ok(Ok(()));
        }
    }
}

/// What comes before the rows of a line format: the CSV header (nothing for JSON lines).
fn write_audit_header(out: &mut impl std::io::Write, format: AuditFormat) -> std::io::Result<()> {
    if format == AuditFormat::Csv {
        writeln!(out, "{}", AUDIT_COLUMNS.join(","))?;
    }
    Ok(())
}

/// One audit row as a line of `format` (JSON lines or CSV).
fn write_audit_line(out: &mut impl std::io::Write, r: &AuditRow, format: AuditFormat) -> std::io::Result<()> {
    match format {
        AuditFormat::Csv => writeln!(out, "{}", audit_cells(r).iter().map(|c| csv_field(c)).collect::<Vec<_>>().join(",")),
        _ => writeln!(out, "{}", audit_json(r)),
    }
}

/// The audit rows as an aligned table, then their count.
fn write_audit_table(out: &mut impl std::io::Write, rows: &[AuditRow]) -> std::io::Result<()> {
    // Cells hold text from feeds (parcel ids, codes): shown escaped, never interpreted.
    let mut table: Vec<Vec<String>> = rows.iter().map(|r| audit_cells(r).iter().map(|c| crate::util::terminal_safe(c).into_owned()).collect()).collect();
    for row in &mut table {
        if row[3].chars().count() > 16 {
            row[3] = format!("{}…", row[3].chars().take(16).collect::<String>());
        }
    }
    let mut widths: Vec<usize> = AUDIT_COLUMNS.iter().map(|c| c.len()).collect();
    for row in &table {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| cells.iter().enumerate().map(|(i, c)| format!("{:<w$}", c, w = widths[i])).collect::<Vec<_>>().join("  ");
    writeln!(out, "{}", line(AUDIT_COLUMNS.iter().map(|c| c.to_string()).collect()))?;
    for row in table {
        writeln!(out, "{}", line(row))?;
    }
    writeln!(out, "({} row{})", rows.len(), if rows.len() == 1 { "" } else { "s" })
}

fn cmd_holds(action: HoldAction) -> i32 {
    let (config, op) = match &action {
        HoldAction::List { config } => (config, None),
        HoldAction::Release { run_id, config } => (config, Some((*run_id, false))),
        HoldAction::Prime { run_id, config } => (config, Some((*run_id, true))),
    };
    let engine = match open_existing_engine(config) {
        Ok(e) => e,
        Err(code) => return code,
    };
    match op {
        None => {
            let holds = match engine.store.holds() {
                Ok(h) => h,
                Err(e) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            crate::cli_dlq::close_before_printing(engine);
            println!("{:<8} {:<24} {:<11} {:<25} {:>8}  reason", "run_id", "source", "state", "created", "changes");
            for h in &holds {
                // A held reprocess primes when released: say so where the choice is made.
                let marker = if h.reprocess { "(--reprocess: releasing it primes) " } else { "" };
                println!(
                    "{:<8} {:<24} {:<11} {:<25} {:>8}  {}{}",
                    h.run_id,
                    crate::util::terminal_safe(&h.source_id),
                    h.state.label(),
                    rfc3339(h.created_ms),
                    h.changes,
                    marker,
                    crate::util::terminal_safe(&h.reason)
                );
            }
            println!("({} holds, {} open)", holds.len(), holds.iter().filter(|h| h.state == HoldState::Open).count());
            0
        }
        Some((run_id, prime)) => match engine.resolve_hold(run_id, prime) {
            Ok(rec) => {
                // A release of a held first ingest or `--reprocess` primes.
                let prime = rec.verdict.primed();
                println!(
                    "hold {run_id} {}: run {} committed, {} changes, {} queued, {} duplicates, {} suppressed, {} below min_severity",
                    if prime { "primed" } else { "released" },
                    rec.run_id,
                    rec.counts.changes,
                    rec.counts.queued,
                    rec.counts.duplicates,
                    rec.counts.suppressed,
                    rec.counts.below_min_severity
                );
                // Why a release primed (a held first ingest, a held reprocess).
                for note in rec.warnings.iter().filter(|w| w.starts_with("the held run was")) {
                    println!("note: {note}");
                }
                if prime {
                    return 0;
                }
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(c) => return c,
                };
                let code = rt.block_on(async {
                    match Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).map(|d| d.with_clock(engine.clock.clone())) {
                        Ok(d) => match d.drain(Instant::now() + engine.config.delivery.run_wait).await {
                            Ok(s) => {
                                let remaining = engine.store.outbox_len().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                                println!("delivery: sent={} retried={} dead_letters={} gone={}{} outbox_remaining={remaining}", s.sent, s.retried, s.dead, s.gone, deferred_field(&s));
                                deferred_exit(&engine.store, &s)
                            }
                            Err(e) => {
                                error_line!("delivery: {e}");
                                1
                            }
                        },
                        Err(e) => {
                            error_line!("{e}");
                            1
                        }
                    }
                });
                // A step of the clock its delivery saw is stored (`Engine::settle_clock_watch`).
                engine.settle_clock_watch();
                code
            }
            Err(e) => {
                error_line!("{e}");
                // A release stopped after its commit (a kill, a reboot) left its alerts
                // queued, and no listing said so (bb26): they wait in the outbox.
                if matches!(&e, crate::pipeline::PipelineError::HoldNotOpen { state, .. } if state == "released") {
                    if let Ok(n @ 1..) = engine.store.outbox_len() {
                        note_line!("{n} alert(s) wait in the outbox (a release stopped before it delivered them, or their retries): `zonewatch run` or `serve` sends them");
                    }
                }
                1
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, IdemKey, Severity};
    use crate::store::{Claim, Store};

    /// A store that may not grow past a file-size limit is said so (waiting does not lift it:
    /// exit 2); a full disk keeps its own words (it passes: exit 1).
    #[test]
    fn a_file_size_limit_is_named_as_such() {
        let store = std::path::Path::new("zw.redb");
        let efbig = crate::store::StoreError::Db(redb::Error::Io(std::io::Error::from_raw_os_error(27)));
        let text = store_error_text(store, &efbig);
        assert!(text.starts_with("store zw.redb: database error: I/O error") && text.contains("ulimit -f") && text.contains("LimitFSIZE"), "{text}");
        assert!(!efbig.passes());
        let enospc = crate::store::StoreError::Db(redb::Error::Io(std::io::Error::from_raw_os_error(28)));
        assert!(!store_error_text(store, &enospc).contains("ulimit") && enospc.passes());
    }

    /// `zonewatch audit`'s line formats, read a page at a time, equal the ledger read whole:
    /// for every page size, with a filter that matches some rows only, and from a `seq`.
    #[test]
    fn audit_lines_read_a_page_at_a_time_equal_the_ledger_read_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("z.redb")).expect("open");
        let events: Vec<_> = (0..25).map(|i| sample_event(&format!("P{i}"))).collect();
        let claims: Vec<Claim> = (0..25)
            .map(|i| Claim {
                event: i,
                watcher_id: if i % 3 == 0 { "a" } else { "b" }.into(),
                target: "http://127.0.0.1:9/h".into(),
                min_severity: Severity::Info,
                key: IdemKey(format!("k{i}")),
            })
            .collect();
        store.enqueue(&events, &claims, "l", 0, 3_600_000).expect("enqueue");
        assert_eq!(store.audit(&AuditFilter::default()).expect("audit").len(), 25);
        let filters = [AuditFilter::default(), AuditFilter { watcher: Some("a".into()), ..Default::default() }, AuditFilter { since_seq: Some(5), ..Default::default() }];
        for filter in filters {
            for format in [AuditFormat::Jsonl, AuditFormat::Csv] {
                let mut whole = Vec::new();
                write_audit_header(&mut whole, format).expect("header");
                for row in store.audit(&filter).expect("audit") {
                    write_audit_line(&mut whole, &row, format).expect("line");
                }
                for page_rows in [1, 7, 25, 1000] {
                    let mut paged = Vec::new();
                    write_audit_pages(&mut paged, &store, &filter, format, page_rows).expect("read").expect("write");
                    assert_eq!(String::from_utf8_lossy(&paged), String::from_utf8_lossy(&whole), "{filter:?} {format:?} {page_rows}");
                }
            }
        }
    }
}
