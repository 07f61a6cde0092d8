//! `zonewatch holds list|release|prime`: the operator's side of the publication gate. A held
//! run sent nothing and did not advance its watermark until one of these says so.

use crate::model::HoldState;
use crate::notify::delivery::Deliverer;
use crate::util::rfc3339;
use super::open::{open_existing_engine, runtime};
use super::run::{deferred_exit, deferred_field};
use clap::Subcommand;
use std::path::PathBuf;
use std::time::Instant;

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

pub(super) fn cmd_holds(action: HoldAction) -> i32 {
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
            super::open::close_before_printing(engine);
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
