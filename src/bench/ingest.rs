//! Measure 1, ingest + diff: for each county size, a parse-only pass over the baseline file
//! (the reference: the cost of reading the file as GeoJSON at all), then the full pipeline on
//! the baseline (first ingest), a re-publication (shuffled, reformatted: zero changes) and a
//! version with 1% of the parcels rezoned, then a baseline of the shuffled file as a second
//! source (a layer not in id order). Each phase reports wall time, features/s and the peak
//! RSS of that phase alone; a summary line gives pipeline ÷ parse-only ratios.
//!
//! One child process per county size (see [`super::BenchCtx::run_child`]).

use super::{COUNTY_FIELDS, emit, gen, per_s, rss, secs, BenchCtx, BenchError};
use crate::config::{Config, SourceConfig, SourceKind};
use crate::notify::matcher::{Subscriber, SubscriberIndex};
use crate::pipeline::{Engine, RunOptions};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Subscribers attached during the ingest measure (alerts are matched as in production), sized
/// like the matching measure's AOIs (30–460 m squares).
const INGEST_SUBSCRIBERS: usize = 1_000;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    for n in ctx.parcel_sizes() {
        // Generate in the parent so the child's peak memory is the pipeline's alone.
        let t = Instant::now();
        let files = gen::county_files(&ctx.work, n, ctx.seed, 0.01)?;
        if !ctx.in_process {
            let bytes = std::fs::metadata(&files.baseline).map(|m| m.len()).unwrap_or(0);
            emit("ingest", json!({"parcels": n, "phase": "generate", "wall_s": secs(t.elapsed()), "file_mib": rss::mib(Some(bytes))}));
            ctx.run_child("ingest", &["--parcels".to_string(), n.to_string()])?;
        } else {
            measure_county(ctx, &files)?;
        }
    }
    Ok(())
}

fn measure_county(ctx: &BenchCtx, files: &gen::CountyFiles) -> Result<(), BenchError> {
    let n = files.spec.parcels;
    let parse = parse_only(&files.baseline)?;
    emit("ingest", phase_line(n, "parse_only", &parse, None));

    let store_dir = ctx.fresh_dir(&format!("ingest-store-{n}"))?;
    let toml = format!(
        r#"
[store]
path = "bench.redb"
[[source]]
id = "bench-county"
jurisdiction = "bench"
kind = "file"
path = "{}"
every = "1h"
max_change_ratio = 0.05
{COUNTY_FIELDS}"#,
        files.baseline.display()
    );
    let config = Config::parse_str(&toml, &store_dir).map_err(|e| BenchError::Failed(format!("bench config: {e}")))?;
    let mut engine = Engine::open(config).map_err(|e| BenchError::Failed(format!("open: {e}")))?;
    let subs: Vec<Subscriber> = gen::aois(&files.spec, INGEST_SUBSCRIBERS, 30.0, 460.7, ctx.seed)
        .into_iter()
        .enumerate()
        .map(|(i, aoi)| Subscriber {
            id: format!("bench-sub-{i}"),
            target: "http://127.0.0.1:9/hook".into(),
            secret: Some("whsec_YmVuY2gtc2VjcmV0LWJlbmNoLXNlY3JldA==".into()),
            secret_old: None,
            min_severity: crate::model::Severity::Info,
            aoi,
        })
        .collect();
    engine.subscribers = Arc::new(SubscriberIndex::build(subs));
    let src = engine.config.sources.first().cloned().ok_or_else(|| BenchError::Failed("no source".into()))?;

    // The last phase is a baseline of a layer that does not list its parcels in id order (the
    // shuffled re-publication, as a second source): the synthetic county lists them in id
    // order, which redb inserts several times faster than any other (see detect/row_sort.rs).
    let mut shuffled = src.clone();
    shuffled.id = "bench-county-shuffled".into();
    let mut ratios = serde_json::Map::new();
    for (phase, source, path, expect_changes) in [
        ("baseline", &src, &files.baseline, n as u64),
        ("republish", &src, &files.republished, 0),
        ("rezoned_1pct", &src, &files.rezoned, files.rezoned_count as u64),
        ("baseline_shuffled", &shuffled, &files.republished, n as u64),
    ] {
        let p = pipeline_pass(&engine, source, path)?;
        let changes = p.changes.unwrap_or(0);
        if changes != expect_changes {
            return Err(BenchError::Failed(format!("{phase}: {changes} changes, expected {expect_changes}")));
        }
        let line = phase_line(n, phase, &p, Some(&parse));
        ratios.insert(phase.into(), line["over_parse_only"].clone());
        emit("ingest", line);
        if phase == "baseline" {
            emit("ingest", store_floor_line(n, &engine, &src, &store_dir, &parse)?);
        }
    }
    emit("ingest", json!({"parcels": n, "phase": "summary", "pipeline_over_parse_only": ratios, "target_ratio": 2.0, "target_peak_rss_mib": 512}));
    Ok(())
}

/// What redb alone takes to write the baseline's snapshot blocks (see `store/floor.rs`): the
/// part of the baseline no code of ours can remove, against parse-only.
fn store_floor_line(n: usize, engine: &Engine, src: &SourceConfig, store_dir: &Path, parse: &Pass) -> Result<serde_json::Value, BenchError> {
    let scratch = store_dir.join("floor.redb");
    let floor = engine.store.snapshot_write_floor(&src.id, &scratch).map_err(|e| BenchError::Failed(format!("store floor: {e}")));
    let _ = std::fs::remove_file(&scratch);
    let floor = floor?;
    let total = (floor.insert + floor.commit).as_secs_f64();
    Ok(json!({
        "parcels": n,
        "phase": "baseline_store_floor",
        "rows": floor.rows,
        "snapshot_parcels": floor.parcels,
        "insert_s": (floor.insert.as_secs_f64() * 1000.0).round() / 1000.0,
        "commit_s": (floor.commit.as_secs_f64() * 1000.0).round() / 1000.0,
        "us_per_row": (floor.insert.as_secs_f64() * 1e6 / floor.rows.max(1) as f64 * 100.0).round() / 100.0,
        "over_parse_only": (total / parse.wall_s.max(1e-9) * 100.0).round() / 100.0,
    }))
}

/// One timed phase.
struct Pass {
    wall_s: f64,
    /// CPU time of the process (all threads) during the phase: against `wall_s`, how much
    /// of the two cores the phase kept busy.
    cpu_s: Option<f64>,
    features: u64,
    peak_rss: Option<u64>,
    verdict: Option<String>,
    changes: Option<u64>,
    queued: Option<u64>,
}

fn phase_line(n: usize, phase: &str, p: &Pass, parse: Option<&Pass>) -> serde_json::Value {
    let mut v = json!({
        "parcels": n,
        "phase": phase,
        "wall_s": p.wall_s,
        "cpu_s": p.cpu_s.map(|c| (c * 1000.0).round() / 1000.0),
        "cpu_us_per_feature": p.cpu_s.map(|c| (c * 1e6 / p.features.max(1) as f64 * 100.0).round() / 100.0),
        "features": p.features,
        "features_per_s": per_s(p.features, p.wall_s),
        "peak_rss_mib": rss::mib(p.peak_rss),
    });
    if let Some(verdict) = &p.verdict {
        v["verdict"] = json!(verdict);
        v["changes"] = json!(p.changes);
        v["queued"] = json!(p.queued);
    }
    if let Some(parse) = parse {
        v["over_parse_only"] = json!((p.wall_s / parse.wall_s.max(1e-9) * 100.0).round() / 100.0);
        // The best this phase's ratio could be with its CPU time spread perfectly over every
        // core: what bounds it when the ratio is above target and this is too.
        let cores = crate::util::cores() as f64;
        v["cores"] = json!(cores);
        v["cpu_floor_over_parse_only"] = json!(p.cpu_s.map(|c| (c / cores / parse.wall_s.max(1e-9) * 100.0).round() / 100.0));
    }
    v
}

/// The reference: stream the file and parse every feature into a `geojson::Feature`.
fn parse_only(path: &Path) -> Result<Pass, BenchError> {
    rss::reset_peak();
    let cpu = rss::cpu_seconds();
    let t = Instant::now();
    let file = std::fs::File::open(path).map_err(|e| BenchError::io(path, e))?;
    let mut bad = 0u64;
    let features = crate::ingest::geojson::for_each_feature_in(file, |f| {
        if serde_json::from_str::<geojson::Feature>(f.json).is_err() {
            bad += 1;
        }
    })
    .map_err(|e| BenchError::Failed(format!("parse-only: {e}")))?;
    if bad > 0 {
        return Err(BenchError::Failed(format!("parse-only: {bad} features did not parse")));
    }
    Ok(Pass { wall_s: secs(t.elapsed()), cpu_s: rss::cpu_seconds_since(cpu), features, peak_rss: rss::peak_rss_bytes(), verdict: None, changes: None, queued: None })
}

fn pipeline_pass(engine: &Engine, src: &SourceConfig, path: &Path) -> Result<Pass, BenchError> {
    let mut src = src.clone();
    src.kind = SourceKind::File { path: path.to_path_buf() };
    rss::reset_peak();
    let cpu = rss::cpu_seconds();
    let t = Instant::now();
    let report = engine.run_source(&src, RunOptions::default()).map_err(|e| BenchError::Failed(format!("run: {e}")))?;
    let wall_s = secs(t.elapsed());
    let r = report.record;
    Ok(Pass {
        wall_s,
        cpu_s: rss::cpu_seconds_since(cpu),
        features: r.counts.features,
        peak_rss: rss::peak_rss_bytes(),
        verdict: Some(r.verdict.to_string()),
        changes: Some(r.counts.changes),
        queued: Some(r.counts.queued),
    })
}
