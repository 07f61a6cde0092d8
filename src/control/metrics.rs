//! `/metrics` in the Prometheus text exposition format (version 0.0.4). Counts come from the
//! store (so they survive restarts and agree with the audit ledger); the latency histogram
//! comes from [`crate::telemetry`].

use crate::model::HoldState;
use crate::pipeline::Engine;
use crate::store::StoreError;
use std::collections::BTreeMap;
use std::fmt::Write as _;

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders every metric.
pub fn render(engine: &Engine) -> Result<String, StoreError> {
    let store = &engine.store;
    let mut out = String::with_capacity(4096);

    // Running totals kept beside the run records and the ledger: a scrape reads a few rows,
    // not every run and audit row ever written.
    let mut by_verdict: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
    let mut changes: BTreeMap<String, u64> = BTreeMap::new();
    let mut features: BTreeMap<String, u64> = BTreeMap::new();
    for src in &engine.config.sources {
        changes.entry(src.id.clone()).or_default();
    }
    for (source, totals) in store.run_totals()? {
        for (verdict, n) in &totals.verdicts {
            *by_verdict.entry((source.clone(), verdict.as_str())).or_default() += n;
        }
        *changes.entry(source.clone()).or_default() += totals.changes;
        if totals.latest_features > 0 {
            features.insert(source, totals.latest_features);
        }
    }
    header(&mut out, "zonewatch_runs_total", "counter", "Source runs by verdict.");
    for ((source, verdict), n) in &by_verdict {
        let _ = writeln!(out, "zonewatch_runs_total{{source=\"{}\",verdict=\"{verdict}\"}} {n}", esc(source));
    }
    header(&mut out, "zonewatch_source_features", "gauge", "Features in the latest ingested version of each source.");
    for (source, n) in &features {
        let _ = writeln!(out, "zonewatch_source_features{{source=\"{}\"}} {n}", esc(source));
    }
    // Alert on `time() - it` growing past a source's `every`: a source that stopped running
    // (a scheduler stuck, a daemon paused) shows nowhere else (bb27).
    header(&mut out, "zonewatch_source_last_run_timestamp_seconds", "gauge", "When each source's latest run ended (Unix time), whatever its verdict.");
    for src in &engine.config.sources {
        if let Some(run) = store.last_run(&src.id)? {
            let _ = writeln!(out, "zonewatch_source_last_run_timestamp_seconds{{source=\"{}\"}} {}", esc(&src.id), run.finished_ms / 1000);
        }
    }
    header(&mut out, "zonewatch_changes_total", "counter", "Change events committed, per source.");
    for (source, n) in &changes {
        let _ = writeln!(out, "zonewatch_changes_total{{source=\"{}\"}} {n}", esc(source));
    }

    let stats = store.stats()?;
    header(&mut out, "zonewatch_outcomes_total", "counter", "Audit ledger rows by outcome.");
    for (outcome, n) in [
        ("queued", stats.queued),
        ("sent", stats.sent),
        ("duplicate", stats.duplicates),
        ("suppressed", stats.suppressed),
        ("dead_letter", stats.dead_letters),
        ("quarantined", stats.quarantined),
        ("held", stats.held),
    ] {
        let _ = writeln!(out, "zonewatch_outcomes_total{{outcome=\"{outcome}\"}} {n}");
    }
    header(&mut out, "zonewatch_outbox_depth", "gauge", "Deliveries waiting in the outbox.");
    let _ = writeln!(out, "zonewatch_outbox_depth {}", stats.outbox);
    header(&mut out, "zonewatch_dead_letters", "gauge", "Dead letters kept for an operator.");
    let kept = store.kept_counts()?;
    let _ = writeln!(out, "zonewatch_dead_letters {}", kept.dead_letters);
    // Dead letters replayed past `max_replays`: parked, never sent again without `dlq
    // release`. Not in `zonewatch_dead_letters`, so an alert on that gauge went quiet exactly
    // when one was parked (found by a black-box tester).
    header(&mut out, "zonewatch_dead_letters_parked", "gauge", "Dead letters parked past max_replays (sent only after dlq release).");
    let _ = writeln!(out, "zonewatch_dead_letters_parked {}", kept.parked_dead_letters);
    header(&mut out, "zonewatch_quarantine", "gauge", "Quarantined features kept for an operator.");
    let _ = writeln!(out, "zonewatch_quarantine {}", kept.quarantined_features);

    let holds = store.holds()?;
    header(&mut out, "zonewatch_holds", "gauge", "Holds by state.");
    for state in ["open", "released", "primed", "superseded"] {
        let n = holds.iter().filter(|h| h.state.label() == state).count();
        let _ = writeln!(out, "zonewatch_holds{{state=\"{state}\"}} {n}");
    }
    header(&mut out, "zonewatch_holds_open", "gauge", "Runs held by the publication gate, waiting for an operator.");
    let _ = writeln!(out, "zonewatch_holds_open {}", holds.iter().filter(|h| h.state == HoldState::Open).count());

    let (buckets, count, sum) = crate::telemetry::delivery_latency().read();
    header(&mut out, "zonewatch_delivery_latency_seconds", "histogram", "Time from the commit that queued an alert to the receiver's 2xx.");
    for (le, n) in crate::telemetry::LATENCY_BUCKETS.iter().zip(&buckets) {
        let _ = writeln!(out, "zonewatch_delivery_latency_seconds_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(out, "zonewatch_delivery_latency_seconds_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "zonewatch_delivery_latency_seconds_sum {sum}");
    let _ = writeln!(out, "zonewatch_delivery_latency_seconds_count {count}");

    header(&mut out, "zonewatch_endpoint_breaker_state", "gauge", "Per-endpoint circuit breaker: 0 closed, 1 open, 2 half-open (cool-down over), 3 disabled.");
    let now = engine.now();
    // A health record outliving its subscriber (a send in flight when it was deleted) is not
    // an endpoint any more.
    for (id, e) in store.endpoints()?.into_iter().filter(|(id, _)| engine.subscribers.get(id).is_some()) {
        let state = if e.disabled {
            3
        } else {
            match e.breaker_open_until_ms {
                Some(t) if t > now => 1,
                Some(_) => 2,
                None => 0,
            }
        };
        let _ = writeln!(out, "zonewatch_endpoint_breaker_state{{endpoint=\"{}\"}} {state}", esc(&id));
    }
    header(&mut out, "zonewatch_subscribers", "gauge", "Subscribers in the matching index.");
    let _ = writeln!(out, "zonewatch_subscribers {}", engine.subscribers.subscribers().len());
    Ok(out)
}
