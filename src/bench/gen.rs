//! Synthetic inputs for the bench, written to disk as a county would publish them: a baseline
//! layer, the same layer re-published (shuffled, reformatted: zero changes) and a version with
//! a chosen fraction of parcels rezoned. Deterministic from the seed, and reused by later runs
//! (a small manifest says what a folder holds) because writing 2.5M parcels takes a while.
//!
//! Also generates subscriber AOIs of varied sizes over a county's extent.

use super::BenchError;
use crate::synth::{write_feature, CountyIter, CountySpec, SplitMix64};
use geo::{polygon, MultiPolygon};
use std::collections::HashSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The three versions of one synthetic county on disk.
#[derive(Debug, Clone)]
pub struct CountyFiles {
    pub spec: CountySpec,
    pub baseline: PathBuf,
    pub republished: PathBuf,
    pub rezoned: PathBuf,
    /// Parcels rezoned in `rezoned`.
    pub rezoned_count: usize,
}

/// A square-ish county of `parcels` lots near the demo county's origin.
pub fn county_spec(parcels: usize, seed: u64) -> CountySpec {
    // Lots per block ≈ 12.5; a square county has as many block rows as columns × 234/84.
    let blocks = (parcels as f64 / 12.5).max(1.0);
    let per_row = ((blocks * 84.0 / 234.0).sqrt().ceil() as usize).max(1);
    CountySpec { seed, parcels, origin: [-93.30, 44.95], blocks_per_row: per_row }
}

const EFF_DATE: &str = "2026-01-01";

/// Writes (or reuses) the county files for `parcels` lots with `fraction` rezoned in v2.
pub fn county_files(work: &Path, parcels: usize, seed: u64, fraction: f64) -> Result<CountyFiles, BenchError> {
    let dir = work.join(format!("county-{parcels}-s{seed}"));
    let spec = county_spec(parcels, seed);
    let rezoned_count = ((parcels as f64) * fraction).round() as usize;
    let files = CountyFiles {
        spec: spec.clone(),
        baseline: dir.join("v1.geojson"),
        republished: dir.join("v1-republished.geojson"),
        rezoned: dir.join("v2.geojson"),
        rezoned_count,
    };
    let manifest = dir.join("manifest.json");
    let want = serde_json::json!({"format": 1, "parcels": parcels, "seed": seed, "rezoned": rezoned_count}).to_string();
    if std::fs::read_to_string(&manifest).ok().as_deref() == Some(want.as_str()) {
        return Ok(files);
    }
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
    let mut lots: Vec<crate::synth::SynthParcel> = CountyIter::new(&spec).collect();
    write_layer(&files.baseline, lots.iter(), None)?;
    // Re-publication: a shuffled order and a different rendering of the same content.
    let mut order: Vec<u32> = (0..lots.len() as u32).collect();
    let mut rng = SplitMix64::new(seed ^ 0x5EED);
    for i in (1..order.len()).rev() {
        let j = rng.below(i + 1);
        order.swap(i, j);
    }
    write_layer(&files.republished, order.iter().map(|&i| &lots[i as usize]), Some(&mut rng))?;
    // v2: `rezoned_count` distinct lots get another code.
    let mut picked = HashSet::with_capacity(rezoned_count);
    let targets = ["M-1", "C3", "R-2", "C-2", "R-3", "I-2"];
    while picked.len() < rezoned_count.min(lots.len()) {
        let i = rng.below(lots.len());
        if picked.insert(i) {
            let lot = &mut lots[i];
            let to = targets.iter().find(|t| **t != lot.zoning).copied().unwrap_or("M-1");
            let pick = targets[picked.len() % targets.len()];
            lot.zoning = if pick != lot.zoning { pick } else { to }.to_string();
        }
    }
    write_layer(&files.rezoned, lots.iter(), None)?;
    std::fs::write(&manifest, want).map_err(|e| BenchError::io(&manifest, e))?;
    Ok(files)
}

fn write_layer<'a>(
    path: &Path,
    lots: impl Iterator<Item = &'a crate::synth::SynthParcel>,
    mut republish: Option<&mut SplitMix64>,
) -> Result<(), BenchError> {
    let file = std::fs::File::create(path).map_err(|e| BenchError::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let io = |e| BenchError::io(path, e);
    let head: &[u8] = if republish.is_some() {
        b"{\n  \"name\": \"bench-county\",\n  \"features\": [\n"
    } else {
        b"{\"type\":\"FeatureCollection\",\"name\":\"bench-county\",\"features\":[\n"
    };
    w.write_all(head).map_err(io)?;
    let mut buf = String::with_capacity(512);
    for (i, lot) in lots.enumerate() {
        buf.clear();
        if i > 0 {
            buf.push_str(",\n");
        }
        write_feature(&mut buf, lot, EFF_DATE, republish.as_deref_mut());
        w.write_all(buf.as_bytes()).map_err(io)?;
    }
    let tail: &[u8] = if republish.is_some() { b"\n  ],\n  \"type\": \"FeatureCollection\"\n}\n" } else { b"\n]}\n" };
    w.write_all(tail).map_err(io)?;
    w.flush().map_err(io)?;
    Ok(())
}

/// `n` subscriber AOIs over the county `spec`: squares whose side is log-uniform between
/// `min_side_m` and `max_side_m` (a parcel-sized watch up to a neighbourhood), uniformly placed.
pub fn aois(spec: &CountySpec, n: usize, min_side_m: f64, max_side_m: f64, seed: u64) -> Vec<MultiPolygon<f64>> {
    let (sw, ne) = CountyIter::extent(spec);
    let m_lat = 111_320.0;
    let m_lon = m_lat * sw[1].to_radians().cos();
    let mut rng = SplitMix64::new(seed ^ 0xA0150);
    let (lmin, lmax) = (min_side_m.max(1.0).ln(), max_side_m.max(min_side_m).max(1.0).ln());
    (0..n)
        .map(|_| {
            let side = rng.range(lmin, lmax).exp();
            let (w, h) = (side / m_lon, side / m_lat);
            let x = rng.range(sw[0], (ne[0] - w).max(sw[0]));
            let y = rng.range(sw[1], (ne[1] - h).max(sw[1]));
            MultiPolygon(vec![polygon![(x: x, y: y), (x: x + w, y: y), (x: x + w, y: y + h), (x: x, y: y + h), (x: x, y: y)]])
        })
        .collect()
}
