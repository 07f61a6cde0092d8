//! The `zonewatch` binary: parse the command line, set up logging, dispatch.

use clap::Parser;
use zonewatch::cli::{dispatch, Cli, LogFormat};

fn main() {
    let cli = Cli::parse();
    // `serve` is a service: it logs what it does. One-shot commands print their own report.
    let default_level = if matches!(cli.command, zonewatch::cli::Command::Serve { .. }) { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("ZONEWATCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Human => builder.init(),
    }
    std::process::exit(dispatch(cli));
}
