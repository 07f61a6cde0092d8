//! Measure 3, claim + outbox + audit commit: how many matched events per second the store
//! can make durable, by events per write transaction (group commit).
//!
//! Why it exists: every alert is an idempotency claim, an outbox row (with its webhook body)
//! and an audit row, written with an fsync'd redb commit. One commit per event is bounded by
//! the disk's flush rate; the run commit and delivery outcomes therefore batch. This measure
//! goes through the store's real claim path (`Store::enqueue` → `claim_in_txn`, the function
//! `Store::commit_run` calls) on a fresh store per batch size, one claim per event, every key
//! new, default durability (each commit is flushed to disk).

use super::{emit, gen, per_s, secs, BenchCtx, BenchError, Scale};
use crate::model::{ChangeEvent, ChangeKind, Severity, StoredGeometry};
use crate::notify::idem;
use crate::store::{Claim, Store};
use crate::synth::CountyIter;
use serde_json::json;
use std::time::Instant;

const TTL_MS: u64 = 7 * 24 * 3600 * 1000;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    // (events per commit, commits)
    let plan: Vec<(usize, usize)> = match ctx.scale {
        Scale::Test => vec![(1, 10), (100, 5), (1_000, 2)],
        Scale::Small => vec![(1, 300), (100, 200), (1_000, 100), (10_000, 10)],
        Scale::Full => vec![(1, 1_000), (100, 500), (1_000, 200), (10_000, 50)],
    };
    let most = plan.iter().map(|(b, c)| b * c).max().unwrap_or(0);
    let spec = gen::county_spec(most.max(1), ctx.seed);
    let events: Vec<ChangeEvent> = CountyIter::new(&spec)
        .take(most)
        .map(|lot| ChangeEvent {
            source_id: "bench-county".into(),
            jurisdiction: "bench".into(),
            parcel_id: lot.id,
            kind: ChangeKind::Rezoned,
            from: Some(lot.zoning),
            to: Some("M-1".into()),
            effective_date: Some("2026-01-01".into()),
            old_geometry: Some(StoredGeometry(vec![vec![lot.ring.clone()]])),
            new_geometry: Some(StoredGeometry(vec![vec![lot.ring]])),
            area_m2: 1_400.0,
            observed_at_ms: 1_780_000_000_000,
            severity: Severity::Critical,
            revision: 0,
        })
        .collect();
    for (batch, commits) in plan {
        measure(ctx, &events, batch, commits)?;
    }
    Ok(())
}

fn measure(ctx: &BenchCtx, events: &[ChangeEvent], batch: usize, commits: usize) -> Result<(), BenchError> {
    let dir = ctx.fresh_dir(&format!("commit-store-{batch}"))?;
    let path = dir.join("bench.redb");
    let store = Store::open(&path).map_err(|e| BenchError::Failed(format!("open store: {e}")))?;
    let total = (batch * commits).min(events.len());
    let mut queued = 0u64;
    let written_before = super::rss::written_bytes();
    let cpu_before = super::rss::cpu_seconds();
    let mut slowest = 0f64;
    let t = Instant::now();
    for (n, chunk) in events[..total].chunks(batch.max(1)).enumerate() {
        let claims: Vec<Claim> = chunk
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let watcher = format!("bench-sub-{}", i % 97);
                Claim {
                    event: i,
                    key: idem::key_for(&watcher, e),
                    watcher_id: watcher,
                    target: "http://127.0.0.1:9/hook".into(),
                    min_severity: Severity::Info,
                }
            })
            .collect();
        // The clock is read per commit, as a run's commit does: expiry entries (expires at,
        // key) then follow each other instead of all sharing one instant.
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let one = Instant::now();
        let c = store
            .enqueue(chunk, &claims, &format!("bench-county:{n}:0123456789ab"), now, TTL_MS)
            .map_err(|e| BenchError::Failed(format!("enqueue: {e}")))?;
        queued += c.queued;
        slowest = slowest.max(one.elapsed().as_secs_f64());
    }
    let wall = t.elapsed();
    let cpu_us_per_event = super::rss::cpu_us_per(cpu_before, total as u64);
    let written = written_before.zip(super::rss::written_bytes()).map(|(a, b)| b.saturating_sub(a));
    if queued != total as u64 {
        return Err(BenchError::Failed(format!("{queued} queued of {total} claims")));
    }
    let journal_rows = store.key_journal_len().map_err(|e| BenchError::Failed(format!("key journal: {e}")))?;
    let journal_merges = store.key_journal_merges();
    let stats = store.stats().map_err(|e| BenchError::Failed(format!("stats: {e}")))?;
    drop(store);
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    emit(
        "commit",
        json!({
            "events_per_commit": batch,
            "commits": total.div_ceil(batch.max(1)),
            "events": total,
            "wall_s": secs(wall),
            "events_per_s": per_s(total as u64, wall.as_secs_f64()),
            "commits_per_s": per_s(total.div_ceil(batch.max(1)) as u64, wall.as_secs_f64()),
            "outbox_rows": stats.outbox,
            "store_mib": super::rss::mib(Some(bytes)),
            // What the durable commits wrote to disk, per event: the write amplification of
            // the store's B-trees (copy-on-write pages) at this batch size.
            "written_bytes_per_event": written.map(|w| w / total.max(1) as u64),
            // CPU (user + system, the bench's key hashing included) per event: steadier than
            // the rate on a disk whose flush times vary, so what a change to the claim path moves.
            "cpu_us_per_event": cpu_us_per_event,
            // New keys go to the key journal and are merged into the key table in key order
            // every `MERGE_ROWS`: the merges are inside the wall time above.
            "key_journal_merges": journal_merges,
            // The longest commit (with a journal merge, if one ran): how long delivery may
            // wait for the write lock behind a claim commit at this batch size.
            "slowest_commit_s": (slowest * 1000.0).round() / 1000.0,
            "key_journal_rows_left": journal_rows,
            "durable": true,
            "target_events_per_s": 100_000,
        }),
    );
    Ok(())
}
