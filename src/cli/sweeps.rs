//! The retention sweeps (expired keys, old attempts, quiet runs, superseded holds, old
//! quarantine): once at the end of a `run`, every ten minutes under `serve`, always in bounded
//! batches so a backlog never holds the write lock for long.

use crate::pipeline::Engine;
use crate::store::{Store, StoreError};
use std::sync::Arc;

/// What `run` sweeps once its sources and delivery are done (`serve` sweeps every 10
/// minutes): expired idempotency keys, delivery attempts past `retention`, run records that
/// committed nothing, superseded holds and quarantined features' rows past `run_retention`;
/// one batch each.
pub(super) fn end_of_run_sweeps(engine: &Engine) {
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

/// Rows one sweep call may delete: bounds how long a sweep holds the write lock.
pub(super) const SWEEP_BATCH: usize = 10_000;

/// Run records one retention sweep call may remove (each with its index entry and history
/// row): smaller than [`SWEEP_BATCH`], the catch-up of a store upgraded with years of records
/// leaves the write lock to outcome and run commits more often.
pub(super) const RUN_SWEEP_BATCH: usize = 2_000;

/// Batches one sweep period may run back to back.
const SWEEP_BATCHES_PER_PERIOD: usize = 100;

/// Runs bounded sweeps one after another while each deletes something, with a pause between so
/// delivery and source runs get the write lock in between: a backlog larger than one batch
/// (a county's baseline keys expiring together, a busy week's attempts) is worked off in this
/// period instead of one batch per period, which a steady high rate could outgrow. Returns
/// the rows deleted; a failure is logged and ends the period, and so does a shutdown (the
/// batch under way commits; the rest waits for the next start).
pub(super) async fn sweep_in_batches(
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
