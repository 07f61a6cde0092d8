//! The command line: clap's view of it (`Cli`, `Command`) and the dispatch of each command to
//! the file that runs it. Each command is a function returning an exit code; `main` only
//! parses and dispatches.
//!
//! One command (or a family) per file: `run`, `serve`, `check`, `audit`, `holds`,
//! `backup`/`restore`, `dlq`, `endpoints`, each with its own subcommand or format enum;
//! `open` is how they all load the config and open the store, `sweeps` the retention sweeps
//! `run` and `serve` share. `demo`, `bench` and the hidden
//! `synth` live in their own top-level modules.

mod audit;
mod backup;
mod check;
mod dlq;
mod endpoints;
mod holds;
mod open;
mod run;
mod serve;
mod sweeps;

pub use audit::audit_json;
pub use backup::backup_dir;
pub use dlq::DlqAction;
pub use audit::AuditFormat;
pub use endpoints::EndpointsAction;
pub use holds::HoldAction;

use crate::config::Config;
use crate::store::AuditFilter;
use audit::cmd_audit;
use backup::{cmd_backup, cmd_restore};
use check::cmd_check;
use holds::cmd_holds;
use run::cmd_run;
use serve::cmd_serve;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

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
        action: DlqAction,
    },
    /// Subscriber endpoints: list health, re-enable a disabled one.
    Endpoints {
        #[command(subcommand)]
        action: EndpointsAction,
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
        Command::Dlq { action } => dlq::cmd_dlq(action),
        Command::Bench(args) => crate::bench::cmd_bench(args),
        Command::Endpoints { action } => endpoints::cmd_endpoints(action),
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
