//! Damaged feeds, generated: real layers with bytes flipped, spans cut, copied or truncated,
//! and hostile tokens (non-finite and out-of-range numbers, lone surrogates, deep nesting,
//! stray brackets, invalid UTF-8) put in at random places, run one after another against one
//! store. Whatever a publisher sends, a run never panics; it either commits with every
//! feature accounted for (a parcel or a quarantine row) or fails with a message and commits
//! nothing (the watermark and the snapshot are as they were); and the store's cross-table
//! invariants hold after every run.
//!
//! The suite runs 240 versions. More, or another sequence:
//!
//! ```sh
//! ZONEWATCH_FUZZ_RUNS=5000 ZONEWATCH_FUZZ_SEED=9 cargo test --release --test feed_fuzz -- --nocapture
//! ```

mod common;
use common::fuzz::{committed, damage, Lcg, TOKENS};
use common::*;
use std::panic::AssertUnwindSafe;
use zonewatch::pipeline::RunOptions;

/// What a feed is damaged with besides [`TOKENS`]: members a feature's reading rests on.
const FEED_TOKENS: &[&str] = &[
    "\"type\":\"Point\"", "\"coordinates\":[]", "\"geometries\":[{\"type\":\"GeometryCollection\",\"geometries\":[]}]", "\"APN\":null",
    "\"APN\":\"P0001\"", "\"ZONE_CODE\":[1,2]", "\u{2028}",
];

/// The layers damaged: the hand-made hostile one, a grid of squares (some inside the
/// subscribers' areas) and the demo county.
fn base_layers() -> Vec<Vec<u8>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut grid_parcels = grid(40);
    // A shared edge, a hole and a bow-tie among them.
    grid_parcels.push(P { id: "HOLE".into(), zone: "R-1".into(), ring: vec![[-71.2, 42.5], [-71.19, 42.5], [-71.19, 42.51], [-71.2, 42.51], [-71.2, 42.5]] });
    grid_parcels.push(P { id: "BOWTIE".into(), zone: "C-1".into(), ring: vec![[-71.3, 42.5], [-71.29, 42.51], [-71.29, 42.5], [-71.3, 42.51], [-71.3, 42.5]] });
    vec![
        std::fs::read(root.join("cases/hostile-layer.geojson")).expect("hostile fixture"),
        layer(&grid_parcels).into_bytes(),
        std::fs::read(root.join("demo/county-v1.geojson")).expect("demo county"),
    ]
}

#[test]
fn damaged_feeds_never_panic_and_commit_all_or_nothing() {
    let runs: usize = std::env::var("ZONEWATCH_FUZZ_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(240);
    let seed: u64 = std::env::var("ZONEWATCH_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    let subs = [
        Sub { id: "w-grid", aoi: rect(-71.101, 42.359, -71.09, 42.365), target: "http://127.0.0.1:9/hook".into(), min_severity: "info", secret: None },
        Sub { id: "w-wide", aoi: rect(-72.0, 42.0, -70.0, 43.0), target: "http://127.0.0.1:9/hook".into(), min_severity: "info", secret: None },
    ];
    let ws = Workspace::new(&subs, "", "");
    let engine = ws.engine();
    let bases = base_layers();
    let tokens = [TOKENS, FEED_TOKENS].concat();
    let mut rng = Lcg(seed);
    let (mut commits, mut failed) = (0u32, 0u32);
    for i in 0..runs {
        let base = &bases[rng.below(bases.len())];
        // One version in six goes out undamaged, so the snapshot keeps changing both ways.
        let doc = if rng.below(6) == 0 { base.clone() } else { damage(base, &mut rng, &tokens) };
        ws.write_layer_bytes(&doc);
        let before = committed(&engine, "s1");
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| engine.run_source_id("s1", RunOptions::default())));
        let keep = || {
            let path = std::env::temp_dir().join(format!("zonewatch-fuzz-seed{seed}-run{i}.geojson"));
            let _ = std::fs::write(&path, &doc);
            path
        };
        match outcome {
            Err(_) => panic!("run {i} (seed {seed}) panicked; its layer is kept at {}", keep().display()),
            Ok(Ok(report)) => {
                commits += 1;
                let c = &report.record.counts;
                assert_eq!(
                    c.parcels + c.quarantined,
                    c.features,
                    "run {i} (seed {seed}): every feature is a parcel or a quarantine row ({c:?}); layer kept at {}",
                    keep().display()
                );
            }
            Ok(Err(e)) => {
                failed += 1;
                let message = e.to_string();
                assert!(!message.trim().is_empty(), "run {i} (seed {seed}): a failed run says why");
                // A thread of the run that panicked is reported as an error: still a bug.
                assert!(!message.contains("panicked"), "run {i} (seed {seed}): {message}; layer kept at {}", keep().display());
                assert!(
                    committed(&engine, "s1") == before,
                    "run {i} (seed {seed}) failed ({e}) but changed the watermark or the snapshot; layer kept at {}",
                    keep().display()
                );
            }
        }
        if i % 20 == 19 || i + 1 == runs {
            let report = engine.store.check_consistency().expect("check runs");
            assert!(report.is_consistent(), "after run {i} (seed {seed}): {:?}", report.problems);
        }
    }
    println!("{runs} damaged versions (seed {seed}): {commits} committed, {failed} failed with a message");
    assert!(commits > 0 && failed > 0, "the damage should make some runs fail and let others commit");
}
