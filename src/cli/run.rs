//! `zonewatch run`: one pass over every (or one) source, then delivery until the outbox is
//! empty or `run_wait` is up; its result lines, the notes about alerts left waiting that
//! `serve` and `check` say too, and the delivery line's `deferred=N` and exit code that
//! `holds release` shares.

use crate::notify::delivery::Deliverer;
use crate::pipeline::{Engine, RunOptions};
use super::open::{open_engine, runtime};
use super::sweeps::end_of_run_sweeps;
use std::sync::Arc;
use std::time::Instant;

pub(super) fn cmd_run(config: &std::path::Path, only: Option<&str>, reprocess: bool, from_staging: bool) -> i32 {
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
pub(super) fn deferred_field(s: &crate::notify::delivery::PassStats) -> String {
    if s.deferred > 0 {
        format!(" deferred={}", s.deferred)
    } else {
        String::new()
    }
}

/// [`disabled_backlog_text`] of an open engine's store (`run`, `serve`); a store that cannot
/// be read here says nothing (the commands themselves report that).
pub(super) fn engine_disabled_backlog(engine: &Engine) -> Option<String> {
    engine.store.disabled_backlog().ok().and_then(|b| disabled_backlog_text(&b, &|id| engine.subscribers.get(id).is_some()))
}

/// What waits for disabled endpoints, as an operator reads it (`run`'s note, `serve`'s start,
/// `check --store`'s warning); None when nothing does. Only endpoints whose subscriber
/// `exists`: the rows of one removed are dead-lettered `subscriber_gone`, not held for an
/// enable (second reader).
pub(super) fn disabled_backlog_text(backlog: &[crate::store::DisabledBacklog], exists: &dyn Fn(&str) -> bool) -> Option<String> {
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
pub(super) fn deferred_exit(store: &crate::store::Store, s: &crate::notify::delivery::PassStats) -> i32 {
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
