//! The `zonewatch` binary: parse the command line, set up logging, dispatch.

use clap::{CommandFactory, FromArgMatches};
use std::io::IsTerminal;
use zonewatch::cli::{dispatch, Cli, LogFormat};

fn main() {
    zonewatch::signals::report_file_size_limit();
    // `--version` names the store schema this build writes (a black-box tester: two builds
    // said the same `zonewatch 0.1.0`, and an operator could not tell, before the first start
    // upgraded the store for good, which one would). Built once, for the process's life.
    let version: &'static str = Box::leak(format!("{} (store schema {})", env!("CARGO_PKG_VERSION"), zonewatch::store::SCHEMA_VERSION).into_boxed_str());
    let cli = Cli::from_arg_matches(&Cli::command().version(version).get_matches()).unwrap_or_else(|e| e.exit());
    // `serve` is a service: it logs what it does. One-shot commands print their own report.
    let default_level = if matches!(cli.command, zonewatch::cli::Command::Serve { .. }) { "info" } else { "warn" };
    // geo's own warnings ("polygon had no winding order. Results are undefined.", once per
    // zero-area part it relates) are about a publisher's degenerate rings, which the validity
    // check and the quarantine already decide on: ~27 lines a run of Chicago's layer, nothing
    // an operator can act on (a black-box tester). `geo::algorithm`, not `geo`: a target
    // directive is a prefix, and `geo` would take in `geojson` and `geo_types` too.
    let filter = tracing_subscriber::EnvFilter::try_from_env("ZONEWATCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{default_level},geo::algorithm=error")));
    // Colours only for a person at a terminal (not in journald or a log file), and never
    // with NO_COLOR set (https://no-color.org).
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    // A log line that cannot be written (stderr a file on a full disk, `2>/dev/full`) is
    // dropped: tracing-subscriber would report it with `eprintln!`, which panics on such a
    // stderr (`serve` ended with exit 101 on its first log line: a black-box tester). The
    // status lines of `say.rs` likewise ignore a stderr that cannot be written.
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).log_internal_errors(false);
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Human => builder.init(),
    }
    quiet_on_closed_stdout();
    // Unwinding out of a command closes the store on the way (a process exit would not).
    let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dispatch(cli))) {
        Ok(code) => code,
        Err(_) if STDOUT_CLOSED.load(std::sync::atomic::Ordering::SeqCst) => 141,
        Err(_) if STDOUT_FAILED.get().is_some() => {
            let why = STDOUT_FAILED.get().map(String::as_str).unwrap_or_default();
            zonewatch::say::line(zonewatch::say::Level::Error, format_args!("cannot write this command's report to stdout ({why}); the command stopped there, and what it had committed by then stays in the store"));
            1
        }
        Err(payload) => std::panic::resume_unwind(payload),
    };
    // A command a signal stopped dies by that signal (see `signals.rs`).
    zonewatch::signals::exit(code);
}

/// Set when a command stopped because its stdout was closed.
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Why a command stopped because its stdout could not be written otherwise (a full disk under
/// a cron job's log file, `>/dev/full`).
static STDOUT_FAILED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `zonewatch audit | head` closes stdout early: the command stops there, quietly, and exits
/// 141 as a Unix tool killed by SIGPIPE does (so `set -o pipefail` and cron still see that it
/// did not finish), instead of printing "failed printing to stdout: Broken pipe" with a
/// backtrace. The panic unwinds to `main`, so the store is closed cleanly on the way. Any
/// other failure to write stdout (a full disk) stops the command the same way, and `main`
/// says why in one `error:` line, exit 1. A panic of the geometry library that its caller
/// catches (`util::catch_geometry_panic`) is a debug log line. Every other panic is reported
/// as before.
fn quiet_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload().downcast_ref::<String>().map(String::as_str).unwrap_or("");
        if let Some(why) = message.strip_prefix("failed printing to stdout: ") {
            if why.contains("Broken pipe") {
                STDOUT_CLOSED.store(true, std::sync::atomic::Ordering::SeqCst);
            } else {
                let _ = STDOUT_FAILED.set(why.to_string());
            }
            return;
        }
        if zonewatch::util::panic_is_caught_geometry() {
            // Caught and turned into a quarantine reason or a counted failure by the caller.
            tracing::debug!(panic = %info, "the geometry library panicked; caught");
            return;
        }
        report(info);
    }));
}
