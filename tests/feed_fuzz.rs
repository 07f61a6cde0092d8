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
use common::*;
use std::panic::AssertUnwindSafe;
use zonewatch::pipeline::RunOptions;

/// Tiny deterministic generator, so a failing sequence can be repeated from its seed.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    /// In `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Tokens that have broken parsers: what a damaged or hostile feed is made of.
const TOKENS: &[&str] = &[
    "{", "}", "[", "]", "\"", ",", ":", "\\", "null", "NaN", "-Infinity", "-", "1e999", "-0", "1e-330",
    "123456789012345678901234567890", "\"\\ud800\"", "\"\\u0000\"", "true", "{}", "[]", "\"type\":\"Point\"",
    "\"coordinates\":[]", "\"geometries\":[{\"type\":\"GeometryCollection\",\"geometries\":[]}]", "\"APN\":null",
    "\"APN\":\"P0001\"", "\"ZONE_CODE\":[1,2]", "\u{feff}", "\r\n", "\u{2028}", "é",
];

/// A run of `[` (or `{"a":`) deep enough to trip a recursive parser.
fn deep_nesting(rng: &mut Lcg) -> Vec<u8> {
    let depth = 50 + rng.below(400);
    if rng.below(2) == 0 { "[".repeat(depth).into_bytes() } else { "{\"a\":".repeat(depth).into_bytes() }
}

/// One to four random damages to `doc`.
fn damage(doc: &[u8], rng: &mut Lcg) -> Vec<u8> {
    let mut out = doc.to_vec();
    for _ in 0..1 + rng.below(4) {
        if out.is_empty() {
            break;
        }
        let at = rng.below(out.len());
        match rng.below(8) {
            // A byte changed, to anything (invalid UTF-8 included).
            0 => out[at] = rng.next() as u8,
            // A span cut out.
            1 => {
                let end = (at + 1 + rng.below(60)).min(out.len());
                out.drain(at..end);
            }
            // A span copied elsewhere (duplicated features, half features).
            2 => {
                let end = (at + 1 + rng.below(400)).min(out.len());
                let span = out[at..end].to_vec();
                let to = rng.below(out.len());
                out.splice(to..to, span);
            }
            // Cut short.
            3 => out.truncate(at),
            4 => {
                let nest = deep_nesting(rng);
                out.splice(at..at, nest);
            }
            // A number replaced by an extreme one, or a token put in.
            _ => {
                let token = TOKENS[rng.below(TOKENS.len())].as_bytes().to_vec();
                let digit = out[at..].iter().position(|b| b.is_ascii_digit()).map(|p| at + p);
                match digit {
                    Some(d) if rng.below(2) == 0 => {
                        let end = d + out[d..].iter().take_while(|b| b.is_ascii_digit() || **b == b'.').count();
                        out.splice(d..end, token);
                    }
                    _ => {
                        out.splice(at..at, token);
                    }
                }
            }
        }
    }
    out
}

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

/// The watermark and each parcel's (content, geometry) hashes.
type Stored = (Option<zonewatch::model::Watermark>, std::collections::BTreeMap<String, ([u8; 32], [u8; 32])>);

/// What a run commits, compared before and after a failed one: the watermark and each
/// parcel's hashes (equal hashes are equal states; an area is a float).
fn stored(engine: &zonewatch::pipeline::Engine) -> Stored {
    let watermark = engine.store.watermark("s1").expect("watermark reads");
    let states = engine.store.snapshot_states("s1").expect("snapshot reads");
    (watermark, states.into_iter().map(|(id, s)| (id, (s.content_hash, s.geom_hash))).collect())
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
    let mut rng = Lcg(seed);
    let (mut committed, mut failed) = (0u32, 0u32);
    for i in 0..runs {
        let base = &bases[rng.below(bases.len())];
        // One version in six goes out undamaged, so the snapshot keeps changing both ways.
        let doc = if rng.below(6) == 0 { base.clone() } else { damage(base, &mut rng) };
        ws.write_layer_bytes(&doc);
        let before = stored(&engine);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| engine.run_source_id("s1", RunOptions::default())));
        let keep = || {
            let path = std::env::temp_dir().join(format!("zonewatch-fuzz-seed{seed}-run{i}.geojson"));
            let _ = std::fs::write(&path, &doc);
            path
        };
        match outcome {
            Err(_) => panic!("run {i} (seed {seed}) panicked; its layer is kept at {}", keep().display()),
            Ok(Ok(report)) => {
                committed += 1;
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
                    stored(&engine) == before,
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
    println!("{runs} damaged versions (seed {seed}): {committed} committed, {failed} failed with a message");
    assert!(committed > 0 && failed > 0, "the damage should make some runs fail and let others commit");
}
