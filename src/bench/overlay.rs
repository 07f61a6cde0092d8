//! Measure 6, overlay derive: zoning derived from district polygons for every parcel of a base.
//!
//! Why it exists: most cities publish districts, not a code per parcel, so each district run
//! intersects every parcel with the districts around it; at county scale that is the heaviest
//! geometry zonewatch does. Two workloads:
//! - **Cambridge** (real data, `../shared/data/real/`): ~13k parcels × the 2014-09-30 zoning
//!   districts and the 2013-08-15 overlays, through the real pipeline (`Engine`): the parcel
//!   baseline, then each derived run end to end (`run_s`: read, derive, diff, commit), and the
//!   derive step alone (`derive_s`: read the layer, build the R-tree, `derive_all`). When the
//!   folder is absent the measure prints a `SKIPPED` line (and a JSON line saying so).
//! - **Synthetic**: 1M parcels (scale `full`; 200k at `small`) × 5k districts tiling the county
//!   (jittered grid, wavy shared edges): the district source's whole runs through the pipeline
//!   (`synthetic_run`: the first, then one after 1% of the districts were recoded; run time, CPU
//!   and peak RSS, which a county's base must not drive), then the derive step alone (index
//!   build + `derive_all` over a base held in memory).
//!
//! Targets: < 0.5 s (Cambridge) and < 20 s (1M × 5k).

use super::{COUNTY_FIELDS, emit, gen, per_s, rss, BenchCtx, BenchError, Scale};
use crate::config::{Config, LayerKind};
use crate::derived::derive_all;
use crate::detect::overlay::DistrictIndex;
use crate::model::{ParcelState, StoredGeometry};
use crate::pipeline::{Engine, RunOptions};
use crate::synth::{CountyIter, CountySpec, SplitMix64};
use geo::{Coord, LineString, MultiPolygon, Polygon};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    cambridge(ctx)?;
    let (parcels, districts) = match ctx.scale {
        Scale::Test => (3_000, 50),
        Scale::Small => (200_000, 5_000),
        Scale::Full => (1_000_000, 5_000),
    };
    // `--parcels` sets the synthetic county's size (each one given, in turn).
    if ctx.parcels.is_empty() {
        return synthetic(ctx, parcels, districts);
    }
    for &n in &ctx.parcels {
        synthetic(ctx, n, districts)?;
    }
    Ok(())
}

/// The real-data folder: `ZONEWATCH_REAL_DATA`, else `../shared/data/real` from the working
/// directory or from the repository root of this executable (`target/release/..`).
fn real_data_dir() -> Option<PathBuf> {
    let mut cands = Vec::new();
    if let Some(p) = std::env::var_os("ZONEWATCH_REAL_DATA") {
        cands.push(PathBuf::from(p));
    }
    cands.push(PathBuf::from("../shared/data/real"));
    if let Ok(exe) = std::env::current_exe() {
        if let Some(repo) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            cands.push(repo.join("../shared/data/real"));
        }
    }
    cands
        .into_iter()
        .find(|d| d.join("cambridge-parcels-fy2014.geojson").is_file())
        .and_then(|d| std::fs::canonicalize(d).ok())
}

fn cambridge(ctx: &BenchCtx) -> Result<(), BenchError> {
    let Some(dir) = real_data_dir() else {
        eprintln!("SKIPPED bench overlay cambridge: ../shared/data/real/cambridge-parcels-fy2014.geojson not found (see SOURCES.md)");
        emit("overlay", json!({"workload": "cambridge", "skipped": "../shared/data/real not found"}));
        return Ok(());
    };
    let store_dir = ctx.fresh_dir("overlay-cambridge")?;
    let parcels = dir.join("cambridge-parcels-fy2014.geojson");
    let districts = dir.join("cambridge-zoning-districts-2014-09-30.geojson");
    let overlays = dir.join("cambridge-zoning-overlays-2013-08-15.geojson");
    let toml = format!(
        r#"
[store]
path = "bench.redb"
[[source]]
id = "cambridge-parcels"
jurisdiction = "cambridge-ma"
kind = "file"
path = "{}"
[source.fields]
parcel_id = "ML"
[[source]]
id = "cambridge-zoning"
jurisdiction = "cambridge-ma"
kind = "file"
path = "{}"
layer = "districts"
parcels = "cambridge-parcels"
[source.fields]
zoning = "ZONE_TYPE"
[[source]]
id = "cambridge-overlays"
jurisdiction = "cambridge-ma"
kind = "file"
path = "{}"
layer = "overlays"
parcels = "cambridge-parcels"
[source.fields]
zoning = "name"
"#,
        parcels.display(),
        districts.display(),
        overlays.display()
    );
    let config = Config::parse_str(&toml, &store_dir).map_err(|e| BenchError::Failed(format!("bench config: {e}")))?;
    let engine = Engine::open(config).map_err(|e| BenchError::Failed(format!("open: {e}")))?;
    let t = Instant::now();
    let base = engine
        .run_source_id("cambridge-parcels", RunOptions::default())
        .map_err(|e| BenchError::Failed(format!("parcels: {e}")))?;
    let parcels_s = t.elapsed().as_secs_f64();
    let base_rows = base_of(&engine, "cambridge-parcels")?;
    for (id, layer, path, field) in [
        ("cambridge-zoning", LayerKind::Districts, &districts, "ZONE_TYPE"),
        ("cambridge-overlays", LayerKind::Overlays, &overlays, "name"),
    ] {
        // The derive step alone: read the layer, index it, derive every parcel.
        let t = Instant::now();
        let bytes = std::fs::read(path).map_err(|e| BenchError::io(path, e))?;
        let layer_read = crate::ingest::districts::read_districts(&bytes, field, None)
            .map_err(|e| BenchError::Failed(format!("{id}: {e}")))?;
        let index = DistrictIndex::build(layer_read.districts.iter().map(|d| (d.code.as_str(), &d.geometry)));
        let d = derive_all(layer, &index, base_rows.clone(), 0.1);
        let derive_s = t.elapsed().as_secs_f64();
        // The whole derived run through the pipeline (a baseline: derive, diff, commit).
        let t = Instant::now();
        let report = engine.run_source_id(id, RunOptions::default()).map_err(|e| BenchError::Failed(format!("{id}: {e}")))?;
        let run_s = t.elapsed().as_secs_f64();
        emit(
            "overlay",
            json!({
                "workload": "cambridge",
                "layer": layer.as_str(),
                "parcels": d.parcels.len(),
                "polygons": index.len(),
                "uncovered": d.uncovered,
                "failed_intersections": d.failed,
                "derive_s": (derive_s * 1000.0).round() / 1000.0,
                "derive_all_s": d.millis as f64 / 1000.0,
                "run_s": (run_s * 1000.0).round() / 1000.0,
                "run_verdict": report.record.verdict.to_string(),
                "parcels_baseline_s": (parcels_s * 1000.0).round() / 1000.0,
                "parcels_baseline_features": base.record.counts.features,
                "parcels_per_s": per_s(d.parcels.len() as u64, derive_s),
                "threads": crate::util::cores(),
                "target_s": 0.5,
            }),
        );
    }
    drop(engine);
    let _ = std::fs::remove_dir_all(&store_dir);
    Ok(())
}

/// The committed snapshot of a parcel source, as `derive_all` takes it.
fn base_of(engine: &Engine, source: &str) -> Result<Vec<(String, ParcelState, StoredGeometry)>, BenchError> {
    engine.store.snapshot_parcels(source).map_err(|e| BenchError::Failed(format!("snapshot: {e}")))
}

fn synthetic(ctx: &BenchCtx, parcels: usize, districts: usize) -> Result<(), BenchError> {
    let spec = gen::county_spec(parcels, ctx.seed);
    let t = Instant::now();
    let layer = district_grid(&spec, districts, ctx.seed);
    let grid_s = t.elapsed().as_secs_f64();
    // The whole runs first: the derive step alone below holds the whole base in memory, and
    // the allocator keeps much of it afterwards, which would show in their peak RSS.
    whole_runs(ctx, parcels, &layer)?;
    let t = Instant::now();
    let base: Vec<(String, ParcelState, StoredGeometry)> = CountyIter::new(&spec)
        .map(|lot| {
            let state = ParcelState {
                zoning: lot.zoning,
                effective_date: None,
                content_hash: [0; 32],
                geom_hash: [0; 32],
                area_m2: 0.0,
                revision: 0,
                announced: None,
            };
            (lot.id, state, StoredGeometry(vec![vec![lot.ring]]))
        })
        .collect();
    let gen_s = grid_s + t.elapsed().as_secs_f64();
    rss::reset_peak();
    let t = Instant::now();
    let index = DistrictIndex::build(layer.iter().map(|(c, g)| (c.as_str(), g)));
    let build_s = t.elapsed().as_secs_f64();
    let n = base.len();
    let d = derive_all(LayerKind::Districts, &index, base, 0.1);
    let total_s = t.elapsed().as_secs_f64();
    if d.parcels.len() != n {
        return Err(BenchError::Failed(format!("derived {} of {n} parcels", d.parcels.len())));
    }
    let split = d.shares.iter().filter(|s| **s < 0.999_999).count();
    emit(
        "overlay",
        json!({
            "workload": "synthetic",
            "layer": "districts",
            "parcels": n,
            "districts": layer.len(),
            "polygons": index.len(),
            "parcels_split_by_a_boundary": split,
            "uncovered": d.uncovered,
            "failed_intersections": d.failed,
            "generate_s": (gen_s * 1000.0).round() / 1000.0,
            "index_build_s": (build_s * 1000.0).round() / 1000.0,
            "derive_all_s": d.millis as f64 / 1000.0,
            "derive_s": (total_s * 1000.0).round() / 1000.0,
            "parcels_per_s": per_s(n as u64, total_s),
            "peak_rss_mib": rss::mib(rss::peak_rss_bytes()),
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "target_s": 20.0,
        }),
    );
    Ok(())
}

/// The derived source's whole runs through the pipeline at the synthetic scale (read the
/// district layer, read the base, derive, diff, commit): the first (every derived state new)
/// and one after 1% of the districts were recoded (about 1% of the parcels change code; the
/// events go through the gate and the claim path). Peak RSS is per run: the base is read from
/// the store, and a county's base must not have to fit in memory.
fn whole_runs(ctx: &BenchCtx, parcels: usize, layer: &[(String, MultiPolygon<f64>)]) -> Result<(), BenchError> {
    let files = gen::county_files(&ctx.work, parcels, ctx.seed, 0.01)?;
    let dir = ctx.fresh_dir(&format!("overlay-run-{parcels}-s{}", ctx.seed))?;
    let districts = dir.join("districts.geojson");
    let toml = format!(
        r#"
[store]
path = "bench.redb"
[[source]]
id = "county"
jurisdiction = "bench-county"
kind = "file"
path = "{}"
{COUNTY_FIELDS}[[source]]
id = "county-zoning"
jurisdiction = "bench-county"
kind = "file"
path = "{}"
layer = "districts"
parcels = "county"
[source.fields]
zoning = "zoning"
"#,
        files.baseline.display(),
        districts.display()
    );
    let config = Config::parse_str(&toml, &dir).map_err(|e| BenchError::Failed(format!("bench config: {e}")))?;
    let engine = Engine::open(config).map_err(|e| BenchError::Failed(format!("open: {e}")))?;
    let t = Instant::now();
    engine.run_source_id("county", RunOptions::default()).map_err(|e| BenchError::Failed(format!("county: {e}")))?;
    let base_s = t.elapsed().as_secs_f64();
    const RECODED_EVERY: usize = 100;
    for (run, recode) in [("first", false), ("recoded_1pct", true)] {
        write_districts(&districts, layer, recode.then_some(RECODED_EVERY))?;
        let rss_before = rss::current_rss_bytes();
        rss::reset_peak();
        let cpu = rss::cpu_seconds();
        let t = Instant::now();
        let report = engine
            .run_source_id("county-zoning", RunOptions::default())
            .map_err(|e| BenchError::Failed(format!("county-zoning {run}: {e}")))?;
        let run_s = t.elapsed().as_secs_f64();
        if report.record.counts.parcels != parcels as u64 {
            return Err(BenchError::Failed(format!("{run}: derived {} of {parcels} parcels", report.record.counts.parcels)));
        }
        emit(
            "overlay",
            json!({
                "workload": "synthetic_run",
                "layer": "districts",
                "run": run,
                "parcels": parcels,
                "districts": layer.len(),
                "districts_recoded": if recode { layer.len().div_ceil(RECODED_EVERY) } else { 0 },
                "verdict": report.record.verdict.to_string(),
                "changes": report.record.counts.changes,
                "run_s": (run_s * 1000.0).round() / 1000.0,
                "cpu_s": rss::cpu_seconds_since(cpu).map(|c| (c * 1000.0).round() / 1000.0),
                "peak_rss_mib": rss::mib(rss::peak_rss_bytes()),
                "rss_before_mib": rss::mib(rss_before),
                "parcels_baseline_s": (base_s * 1000.0).round() / 1000.0,
            }),
        );
    }
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Writes the district layer as GeoJSON (`zoning` property); with `Some(n)`, every n-th
/// district gets another code.
fn write_districts(path: &Path, layer: &[(String, MultiPolygon<f64>)], recode_every: Option<usize>) -> Result<(), BenchError> {
    use std::io::Write as _;
    let io = |e| BenchError::io(path, e);
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    w.write_all(b"{\"type\":\"FeatureCollection\",\"features\":[\n").map_err(io)?;
    for (i, (code, mp)) in layer.iter().enumerate() {
        let code = match recode_every {
            Some(n) if i % n == 0 => if code == "OS" { "R-4" } else { "OS" },
            _ => code.as_str(),
        };
        let feature = json!({
            "type": "Feature",
            "properties": {"zoning": code},
            "geometry": geojson::Geometry::from(mp),
        });
        if i > 0 {
            w.write_all(b",\n").map_err(io)?;
        }
        serde_json::to_writer(&mut w, &feature).map_err(|e| BenchError::Failed(format!("{}: {e}", path.display())))?;
    }
    w.write_all(b"\n]}\n").map_err(io)?;
    w.flush().map_err(io)
}

/// About `n` districts tiling the county's extent: a grid whose inner nodes are jittered by up
/// to 20% of a cell and whose inner edges wave by up to 4% of a cell (8 segments each, shared
/// exactly by both neighbours, so the tiling has no gaps or overlaps). Codes from a zoning mix.
fn district_grid(spec: &CountySpec, n: usize, seed: u64) -> Vec<(String, MultiPolygon<f64>)> {
    const SEGMENTS: usize = 8;
    const CODES: [&str; 8] = ["R-1", "R-2", "R-3", "C-1", "C-2", "C3", "M-1", "OS"];
    let (sw, ne) = CountyIter::extent(spec);
    let (w, h) = (ne[0] - sw[0], ne[1] - sw[1]);
    let nx = ((n as f64 * w / h.max(1e-12)).sqrt().round() as usize).max(1);
    let ny = n.div_ceil(nx).max(1);
    let (cw, ch) = (w / nx as f64, h / ny as f64);
    let mut rng = SplitMix64::new(seed ^ 0xD157);
    let mut nodes = vec![Coord { x: 0.0, y: 0.0 }; (nx + 1) * (ny + 1)];
    for j in 0..=ny {
        for i in 0..=nx {
            let inner = i > 0 && i < nx && j > 0 && j < ny;
            let (jx, jy) = if inner { (rng.range(-0.2, 0.2) * cw, rng.range(-0.2, 0.2) * ch) } else { (0.0, 0.0) };
            nodes[j * (nx + 1) + i] = Coord { x: sw[0] + i as f64 * cw + jx, y: sw[1] + j as f64 * ch + jy };
        }
    }
    let node = |i: usize, j: usize| nodes[j * (nx + 1) + i];
    // An edge from a to b (excluding b), waving perpendicular unless it lies on the border.
    let edge = |a: Coord<f64>, b: Coord<f64>, border: bool, id: u64| -> Vec<Coord<f64>> {
        let mut r = SplitMix64::new(seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (dx, dy) = (b.x - a.x, b.y - a.y);
        let len = (dx * dx + dy * dy).sqrt().max(1e-15);
        let (px, py) = (-dy / len, dx / len);
        (0..SEGMENTS)
            .map(|k| {
                let t = k as f64 / SEGMENTS as f64;
                let off = if border || k == 0 { 0.0 } else { r.range(-0.04, 0.04) * cw.min(ch) };
                Coord { x: a.x + t * dx + px * off, y: a.y + t * dy + py * off }
            })
            .collect()
    };
    let h_edge = |i: usize, j: usize| edge(node(i, j), node(i + 1, j), j == 0 || j == ny, (j * (nx + 1) + i) as u64 * 2);
    let v_edge = |i: usize, j: usize| edge(node(i, j), node(i, j + 1), i == 0 || i == nx, (j * (nx + 1) + i) as u64 * 2 + 1);
    let reversed = |mut pts: Vec<Coord<f64>>, end: Coord<f64>| -> Vec<Coord<f64>> {
        // pts runs a → b excluding b; reversed it must run b → a excluding a.
        pts.push(end);
        pts.reverse();
        pts.pop();
        pts
    };
    let mut out = Vec::with_capacity(nx * ny);
    for j in 0..ny {
        for i in 0..nx {
            let mut ring = h_edge(i, j);
            ring.extend(v_edge(i + 1, j));
            ring.extend(reversed(h_edge(i, j + 1), node(i + 1, j + 1)));
            ring.extend(reversed(v_edge(i, j), node(i, j + 1)));
            ring.push(ring[0]);
            let code = CODES[rng.below(CODES.len())].to_string();
            out.push((code, MultiPolygon(vec![Polygon::new(LineString(ring), vec![])])));
        }
    }
    out
}
