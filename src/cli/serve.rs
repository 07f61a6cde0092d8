//! `zonewatch serve`: the long-running daemon. Sources on their schedules, continuous
//! delivery, the control port, the periodic sweeps and store-file checks, and a graceful stop
//! on SIGINT/SIGTERM (in-flight sends and commits finish; a source being read is left).

use crate::config::Config;
use crate::notify::delivery::Deliverer;
use crate::pipeline::RunOptions;
use crate::store::SweepBatch;
use super::backup::backup_dir;
use super::open::{open_engine_after, runtime};
use super::run::engine_disabled_backlog;
use super::sweeps::{RUN_SWEEP_BATCH, SWEEP_BATCH, sweep_in_batches};
use std::path::PathBuf;
use std::sync::Arc;

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

pub(super) fn cmd_serve(config: &std::path::Path) -> i32 {
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

/// How often `serve` makes sure its store's path still names the file it has open.
const STORE_FILE_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// Where the running daemon writes its control port address (beside the store).
pub(super) fn control_addr_file(cfg: &Config) -> PathBuf {
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
