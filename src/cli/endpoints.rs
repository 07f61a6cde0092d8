//! `zonewatch endpoints list|enable`: each subscriber endpoint's health (config subscribers and
//! those created over the control port) and the audited way to re-enable one.

use crate::util::rfc3339;
use super::open::{close_before_printing, open_existing_engine};
use clap::Subcommand;
use std::path::PathBuf;

/// The `endpoints` subcommands.
#[derive(Subcommand, Debug)]
pub enum EndpointsAction {
    /// Every subscriber endpoint: enabled or disabled (and why), breaker, last success.
    List {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Re-enable a disabled endpoint (by subscriber id); its alerts waiting for a retry are due
    /// now, and the next `run` (or `serve`) sends them.
    Enable {
        id: String,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
}

/// Runs an `endpoints` subcommand; returns the exit code.
pub(super) fn cmd_endpoints(action: EndpointsAction) -> i32 {
    match action {
        EndpointsAction::List { config } => {
            let engine = match open_existing_engine(&config) {
                Ok(e) => e,
                Err(c) => return c,
            };
            // Config subscribers first, then those created over the control port (the
            // columns are unchanged: operators' scripts parse them).
            let listing = match engine.endpoint_listing() {
                Ok(l) => l,
                Err(e) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            let now = engine.now();
            close_before_printing(engine);
            println!("id	state	breaker	last_success	reason	target");
            for ep in &listing {
                println!(
                    "{}	{}	{}	{}	{}	{}",
                    ep.id,
                    ep.state_str(),
                    ep.breaker_str(now),
                    ep.state.last_success_ms.map(rfc3339).unwrap_or_else(|| "-".into()),
                    ep.state.disabled_reason.as_deref().unwrap_or_default(),
                    crate::util::url_for_display(&ep.target)
                );
            }
            0
        }
        EndpointsAction::Enable { id, config } => {
            let engine = match open_existing_engine(&config) {
                Ok(e) => e,
                Err(c) => return c,
            };
            match engine.subscriber_managed_by(&id) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    error_line!("no subscriber {id:?} in the config or the store");
                    return 1;
                }
                Err(e) => {
                    error_line!("{e}");
                    return 2;
                }
            }
            match engine.store.enable_endpoint(&id, engine.now()) {
                Ok(done) => {
                    if done.was_disabled {
                        println!("endpoint {id} enabled");
                    } else {
                        println!("endpoint {id} was not disabled (breaker and history reset)");
                    }
                    if done.retries_due_now > 0 {
                        println!("{} alert(s) waiting for a later retry are due now", done.retries_due_now);
                    }
                    0
                }
                Err(e) => {
                    error_line!("{e}");
                    2
                }
            }
        }
    }
}
