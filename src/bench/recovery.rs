//! Measure 5, recovery: time from a SIGKILL of `zonewatch serve` in the middle of delivering
//! a large backlog to webhooks arriving again, on a store of the issue's size (2 GB with 1M
//! queued outbox rows at full scale; 200 MB / 100k at small scale; a few MB at test scale).
//!
//! 1. The store is built through the real claim path: delivered history first (rows queued
//!    and recorded `sent`: audit rows, idempotency keys, attempt rows) until the file reaches
//!    the size target, then the backlog of queued rows.
//! 2. A child `zonewatch serve` (this binary, a config pointing at the store, loopback
//!    delivery allowed) delivers to a receiver in this process; once it has delivered a few
//!    thousand webhooks it is SIGKILLed.
//! 3. `open_s`: this process opens the killed store (`Store::open`: redb's crash recovery;
//!    the killed process's leases were in its memory only) and reports whether redb had to do a full repair. The same file
//!    is then opened with a forced full repair (`full_repair_s`: what every crash would cost
//!    without quick-repair records).
//! 4. `serve` is started again, killed again mid-delivery, and started a third time:
//!    `first_delivery_s` is process start → first webhook received.
//! 5. The quick-repair commit cost: small durable commits on the same big file with and
//!    without quick-repair records.
//! 6. `serve` is stopped with SIGTERM and the store is checked: every row is either still in
//!    the outbox or audited `sent` exactly once.

use super::delivery::{Queuer, Receipts};
use super::{emit, secs, BenchCtx, BenchError, Scale};
use crate::receiver::Receiver;
use crate::store::{DeliveryResult, Store};
use serde_json::json;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The issue's target, seconds from SIGKILL to delivering again.
pub const TARGET_S: f64 = 1.0;

/// (queued outbox rows, store size target in MiB) per scale.
fn sizes(scale: Scale) -> (usize, u64) {
    match scale {
        Scale::Test => (3_000, 8),
        Scale::Small => (100_000, 200),
        Scale::Full => (1_000_000, 2_048),
    }
}

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    if !ctx.in_process {
        return ctx.run_child("recovery", &[]);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Failed(format!("tokio runtime: {e}")))?;
    rt.block_on(measure(ctx))
}

fn failed(what: &str) -> impl Fn(crate::store::StoreError) -> BenchError + '_ {
    move |e| BenchError::Failed(format!("{what}: {e}"))
}

fn file_mib(path: &Path) -> f64 {
    let b = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    (b as f64 / (1024.0 * 1024.0) * 10.0).round() / 10.0
}

/// Delivered history until the file holds `target_mib`: rows queued, then recorded `sent`.
fn fill_history(store: &Store, queuer: &mut Queuer, path: &Path, target_mib: u64) -> Result<usize, BenchError> {
    let mut rows = 0;
    while file_mib(path) < target_mib as f64 {
        let more = fill_history_rows(store, queuer, 1_000)?;
        if more == 0 {
            break;
        }
        rows += more;
    }
    Ok(rows)
}

/// `rows` more rows of delivered history (queued, then recorded `sent`), 1,000 a commit.
fn fill_history_rows(store: &Store, queuer: &mut Queuer, rows: usize) -> Result<usize, BenchError> {
    let mut done = 0;
    let none = HashSet::new();
    while done < rows {
        let keys = queuer.queue(store, 1_000.min(rows - done))?;
        if keys.is_empty() {
            break;
        }
        let due = store.due_outbox(u64::MAX - 1, keys.len(), &none).map_err(failed("history"))?;
        let results: Vec<DeliveryResult> = due.iter().map(|e| DeliveryResult::Sent { id: e.id, status: 200 }).collect();
        store.record_deliveries(&results, crate::clock::Clock::now_ms(&crate::clock::SystemClock)).map_err(failed("history"))?;
        done += results.len();
    }
    Ok(done)
}

/// A running `zonewatch serve` child.
struct Serve {
    child: std::process::Child,
    started: Instant,
}

fn start_serve(config: &Path, log: &Path) -> Result<Serve, BenchError> {
    let exe = std::env::current_exe().map_err(|e| BenchError::io("current_exe", e))?;
    let err = std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| BenchError::io(log, e))?;
    let started = Instant::now();
    let child = std::process::Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(err)
        .spawn()
        .map_err(|e| BenchError::io("zonewatch serve", e))?;
    Ok(Serve { child, started })
}

impl Serve {
    /// SIGKILL (what `Child::kill` sends on Unix) and reap.
    fn kill9(mut self) -> Result<(), BenchError> {
        self.child.kill().map_err(|e| BenchError::io("kill serve", e))?;
        let _ = self.child.wait();
        Ok(())
    }

    /// SIGTERM (graceful stop) and reap; SIGKILL after 30 s.
    fn stop(mut self) -> Result<(), BenchError> {
        let pid = self.child.id().to_string();
        let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return self.kill9();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// Waits until the receiver has counted `n` webhooks in total; fails if `serve` exits.
async fn wait_received(receipts: &Receipts, serve: &mut Serve, n: u64, log: &Path) -> Result<Instant, BenchError> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if receipts.total.load(Ordering::SeqCst) >= n {
            return Ok(Instant::now());
        }
        if let Some(status) = serve.exited() {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            return Err(BenchError::Failed(format!("zonewatch serve exited ({status}) before delivering: {tail}")));
        }
        if Instant::now() > deadline {
            return Err(BenchError::Failed(format!("serve delivered {} of the {n} webhooks awaited in 300 s", receipts.total.load(Ordering::SeqCst))));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Mean wall time of `n` small durable commits with quick-repair records on or off.
fn commit_cost_ms(store: &Store, quick: bool, n: usize) -> Result<f64, BenchError> {
    store.set_quick_repair(quick);
    let t = Instant::now();
    for i in 0..n {
        store.probe_commit(i as u64).map_err(failed("probe commit"))?;
    }
    store.set_quick_repair(true);
    Ok((t.elapsed().as_secs_f64() * 1000.0 / n as f64 * 1000.0).round() / 1000.0)
}

async fn measure(ctx: &BenchCtx) -> Result<(), BenchError> {
    let (rows, target_mib) = sizes(ctx.scale);
    let dir = ctx.fresh_dir("recovery-store")?;
    let db = dir.join("zonewatch.redb");
    let receipts = Arc::new(Receipts::default());
    let receiver = Receiver::start_sink(receipts.on_id()).await.map_err(|e| BenchError::io("receiver", e))?;
    let base = format!("http://{}", receiver.addr);

    // 1. Build the store.
    let t = Instant::now();
    let (history, queued) = {
        let db = db.clone();
        let seed = ctx.seed;
        tokio::task::spawn_blocking(move || -> Result<(usize, usize), BenchError> {
            let mut store = Store::open(&db).map_err(failed("open"))?;
            // Enough synthetic parcels for the history and the backlog.
            let mut queuer = Queuer::new(seed, rows * 40, &base);
            let history = fill_history(&store, &mut queuer, &db, target_mib.saturating_sub(target_mib * 6 / 10))?;
            let queued = queuer.queue_all(&store, rows)?;
            let mut history = history + fill_history(&store, &mut queuer, &db, target_mib)?;
            // The open file's length is a poor gauge: redb grows it in large steps and gives
            // the trailing free pages back when it is closed. Close, measure the settled
            // file, and top up by row count (estimated from the bytes per row so far) until
            // the closed file holds the target.
            for _ in 0..6 {
                drop(store);
                let settled = file_mib(&db);
                store = Store::open(&db).map_err(failed("reopen"))?;
                if settled >= target_mib as f64 {
                    break;
                }
                let per_row = settled / (history + queued).max(1) as f64;
                let rows = (((target_mib as f64 - settled) / per_row.max(1e-6)) * 1.1) as usize;
                let more = fill_history_rows(&store, &mut queuer, rows.max(1_000))?;
                if more == 0 {
                    break;
                }
                history += more;
            }
            Ok((history, queued))
        })
        .await
        .map_err(|e| BenchError::Failed(format!("build task: {e}")))??
    };
    let build_s = secs(t.elapsed());
    let store_mib = file_mib(&db);

    let config = dir.join("zonewatch.toml");
    let mut toml = format!(
        "[store]\npath = \"zonewatch.redb\"\n[delivery]\nconcurrency = {}\nallow_private_targets = true\n[control]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"control.token\"\n",
        super::delivery::CONCURRENCY
    );
    // The endpoints the queued rows are for: a row whose subscriber is not configured is a
    // dead letter (`subscriber_gone`), not a webhook. Their AOI matches nothing here.
    let aoi = dir.join("bench-aoi.geojson");
    std::fs::write(&aoi, r#"{"type":"Polygon","coordinates":[[[0,0],[0.001,0],[0.001,0.001],[0,0.001],[0,0]]]}"#).map_err(|e| BenchError::io(&aoi, e))?;
    for i in 0..super::delivery::ENDPOINTS {
        toml.push_str(&format!(
            "[[subscriber]]\nid = \"bench-ep-{i}\"\naoi = \"bench-aoi.geojson\"\ntarget = \"http://{}/hook/{i}\"\nmin_severity = \"info\"\n",
            receiver.addr
        ));
    }
    std::fs::write(&config, toml).map_err(|e| BenchError::io(&config, e))?;
    let log = dir.join("serve.log");
    let kill_after = (rows as u64 / 20).clamp(200, 5_000);

    // 2. Deliver, SIGKILL mid-delivery.
    let mut serve = start_serve(&config, &log)?;
    wait_received(&receipts, &mut serve, kill_after, &log).await?;
    serve.kill9()?;
    let before_kill = receipts.total.load(Ordering::SeqCst);

    // 3. Open after the crash, here: redb recovery.
    let (open_s, full_repair_after_kill, full_repair_s) = {
        let db = db.clone();
        tokio::task::spawn_blocking(move || -> Result<(f64, bool, f64), BenchError> {
            let t = Instant::now();
            let store = Store::open(&db).map_err(failed("open after SIGKILL"))?;
            let open_s = secs(t.elapsed());
            let full = store.open_info().full_repair;
            drop(store);
            let full_repair_s = Store::full_repair_seconds(&db).map_err(failed("forced full repair"))?;
            Ok((open_s, full, full_repair_s))
        })
        .await
        .map_err(|e| BenchError::Failed(format!("open task: {e}")))??
    };

    // 4. Deliver again, SIGKILL again, then time a fresh start to the first webhook.
    let mut serve = start_serve(&config, &log)?;
    wait_received(&receipts, &mut serve, before_kill + kill_after, &log).await?;
    serve.kill9()?;
    let mark = receipts.total.load(Ordering::SeqCst);
    let mut serve = start_serve(&config, &log)?;
    let first = wait_received(&receipts, &mut serve, mark + 1, &log).await?;
    let first_delivery_s = secs(first.saturating_duration_since(serve.started));
    // Let it deliver a little more, then stop it cleanly.
    wait_received(&receipts, &mut serve, mark + kill_after.min(1_000), &log).await?;
    serve.stop()?;

    // 5 + 6. Commit cost of quick-repair on this file, and the exactly-once check.
    let (commit_quick_ms, commit_plain_ms, outbox_left, sent_rows) = {
        let db = db.clone();
        tokio::task::spawn_blocking(move || -> Result<(f64, f64, u64, u64), BenchError> {
            let store = Store::open(&db).map_err(failed("final open"))?;
            let n = 50;
            let plain = commit_cost_ms(&store, false, n)?;
            let quick = commit_cost_ms(&store, true, n)?;
            let outbox = store.outbox_len().map_err(failed("outbox"))?;
            let sent = store.stats().map_err(failed("stats"))?.sent;
            Ok((quick, plain, outbox, sent))
        })
        .await
        .map_err(|e| BenchError::Failed(format!("check task: {e}")))??
    };
    let backlog_sent = sent_rows.saturating_sub(history as u64);
    if outbox_left + backlog_sent != queued as u64 {
        return Err(BenchError::Failed(format!(
            "after the kills: {outbox_left} rows in the outbox + {backlog_sent} sent != {queued} queued"
        )));
    }
    // Every `sent` row was received; anything received but not recorded (sent, then killed
    // before the group commit) is still in the outbox and goes out again under its key.
    let distinct = receipts.unique() as u64;
    if distinct < backlog_sent || distinct > backlog_sent + outbox_left {
        return Err(BenchError::Failed(format!(
            "receiver saw {distinct} distinct webhooks; the ledger has {backlog_sent} sent and {outbox_left} still queued"
        )));
    }
    emit(
        "recovery",
        json!({
            "open_s": open_s,
            "first_delivery_s": first_delivery_s,
            "store_mib": store_mib,
            "outbox_rows": queued,
            "history_rows": history,
            "build_s": build_s,
            "repair": "quick_repair",
            "full_repair_after_kill": full_repair_after_kill,
            "full_repair_s": full_repair_s,
            "commit_ms_quick_repair": commit_quick_ms,
            "commit_ms_without": commit_plain_ms,
            "received_before_first_kill": before_kill,
            "received_total": receipts.total.load(Ordering::SeqCst),
            "resent_after_kills": receipts.repeats.load(Ordering::SeqCst),
            "received_not_yet_recorded": distinct - backlog_sent,
            "target_s": TARGET_S,
        }),
    );
    Ok(())
}
