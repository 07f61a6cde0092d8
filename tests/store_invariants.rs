//! Property-style tests of the storage invariants, in the spirit of redb's own: random
//! sequences of layer versions, delivery outcomes and injected crashes against temp stores,
//! with the invariants checked after every step.
//!
//! * the snapshot and watermark always describe the last *committed* version;
//! * a key is queued at most once, and reaches at most one terminal state (`sent` or
//!   `dead_letter`); a key no longer in the outbox has exactly one;
//! * audit sequence numbers are contiguous and increasing;
//! * the cross-table checks of `Store::check_consistency` hold (keys in exactly one of the
//!   key journal and the key table, among others), with journal merges at random points.

mod common;
use common::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use zonewatch::synth::SplitMix64;

fn check_invariants(engine: &zonewatch::pipeline::Engine, committed: &[P], committed_digest: &str, ctx: &str) {
    let snap = engine.store.snapshot_states("s1").unwrap();
    let want: HashMap<&str, &str> = committed.iter().map(|p| (p.id.as_str(), p.zone.as_str())).collect();
    assert_eq!(snap.len(), want.len(), "{ctx}: snapshot size");
    for (id, state) in &snap {
        assert_eq!(Some(&state.zoning.as_str()), want.get(id.as_str()), "{ctx}: parcel {id}");
    }
    assert_eq!(engine.store.watermark("s1").unwrap().unwrap().digest, committed_digest, "{ctx}: watermark");
    let report = engine.store.check_consistency().unwrap();
    assert!(report.is_consistent(), "{ctx}: {:?}", report.problems);
    let unindexed = engine.store.key_journal_rows_without_entry().unwrap();
    assert!(unindexed.is_empty(), "{ctx}: journal rows the index cannot find: {unindexed:?}");

    let rows = engine.store.audit(&Default::default()).unwrap();
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.seq, i as u64 + 1, "{ctx}: audit seq contiguous");
    }
    let outbox_keys: Vec<String> = engine.store.outbox().unwrap().into_iter().map(|e| e.key.0).collect();
    let mut per_key: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    for r in &rows {
        let Some(k) = &r.idempotency_key else { continue };
        let e = per_key.entry(k.clone()).or_default();
        match r.outcome.as_str() {
            "queued" => e.0 += 1,
            "sent" | "dead_letter" => e.1 += 1,
            _ => {}
        }
    }
    for (k, (queued, terminal)) in per_key {
        if queued == 0 {
            assert_eq!(terminal, 0, "{ctx}: terminal state without a claim for {k}");
            continue;
        }
        assert_eq!(queued, 1, "{ctx}: key {k} queued twice");
        let pending = outbox_keys.contains(&k);
        assert_eq!(terminal, u32::from(!pending), "{ctx}: key {k} pending={pending} terminal={terminal}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_keep_the_invariants() {
    for seed in 1..=6u64 {
        let mut rng = SplitMix64::new(seed);
        // The receiver fails about a third of requests, with a retryable or a permanent status.
        let counter = Arc::new(AtomicU64::new(seed));
        let c = counter.clone();
        let rx = zonewatch::receiver::Receiver::start(
            Arc::new(move |_, _| {
                let mut r = SplitMix64::new(c.fetch_add(1, Ordering::SeqCst));
                match r.below(9) {
                    0 | 1 => 503,
                    2 => 400,
                    _ => 200,
                }
            }),
            None,
        )
        .await
        .unwrap();
        let ws = Workspace::new(
            &[
                Sub { id: "west", aoi: rect(-71.2, 42.3, -71.09, 42.5), target: rx.url("/w"), min_severity: "info", secret: None },
                Sub { id: "all", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/a"), min_severity: "notice", secret: None },
            ],
            // About one run in twenty, a third of requests failing opens the breaker (7 of
            // 10 recent attempts failed); a short cool-down lets the drains below wait for
            // its probe instead of leaving those rows for a later run.
            "breaker_cooldown = \"100ms\"",
            "",
        );
        ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
        let mut engine = ws.engine();
        let mut current = grid(60);
        ws.write_layer(&layer(&current));
        run(&engine, false);
        let mut committed = current.clone();
        let mut committed_digest = engine.store.watermark("s1").unwrap().unwrap().digest;
        for step in 0..10 {
            // Mutate: rezone some, drop one, add one.
            let mut next = committed.clone();
            for _ in 0..rng.below(5) {
                let i = rng.below(next.len());
                next[i].zone = ["R-1", "R-2", "C-1", "C3", "M-1"][rng.below(5)].into();
            }
            if rng.unit() < 0.3 && next.len() > 10 {
                next.remove(rng.below(next.len()));
            }
            if rng.unit() < 0.3 {
                let n = 1000 + step;
                next.push(square(&format!("N{n}"), "R-1", -71.10 + rng.unit() * 0.019, 42.40, 0.0005));
            }
            current = next;
            let text = layer(&current);
            ws.write_layer(&text);
            let crash = rng.unit() < 0.25;
            if crash {
                engine.store.fail_next_commit();
                assert!(engine.run_source_id("s1", Default::default()).is_err());
                // Half the time a restarted process; otherwise the same process goes on after
                // its failed commit (the key index then holds entries of aborted claims).
                if rng.unit() < 0.5 {
                    drop(engine);
                    engine = ws.engine();
                }
            } else {
                let r = run(&engine, false);
                committed = current.clone();
                committed_digest = r.record.digest.clone();
            }
            // New keys sit in the key journal until a merge moves them into the key table;
            // merging at random points checks that a key is found, once, on either side.
            if rng.unit() < 0.4 {
                engine.store.merge_key_journal().unwrap();
            }
            // And the automatic merge after a claiming commit, at a size a few claims reach
            // (set again on every step: a crash step restarts the engine).
            engine.store.set_key_journal_merge_rows(1 + rng.below(8));
            deliver(&engine, Duration::from_millis(300)).await;
            check_invariants(&engine, &committed, &committed_digest, &format!("seed {seed} step {step} crash={crash}"));
        }
        // Finally everything pending reaches a terminal state.
        deliver(&engine, Duration::from_secs(5)).await;
        let left = engine.store.outbox_len().unwrap();
        assert_eq!(left, 0, "seed {seed}: outbox drained");
        check_invariants(&engine, &committed, &committed_digest, &format!("seed {seed} final"));
    }
}
