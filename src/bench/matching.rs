//! Measure 2, matching: change events per second against 10k and 100k subscriber AOIs.
//!
//! Why it exists: a rezoning wave or a re-drawn layer can yield tens of thousands of events in
//! one run, and every one is matched against every subscriber's area of interest before the
//! run can commit. Events are parcel-sized (the lots of a synthetic county, old geometry =
//! new geometry as for a rezoning); AOIs are squares of log-uniform side over the county's
//! extent, the largest side calibrated so that a parcel meets ~1.6 AOIs on average at 10k
//! AOIs (the measured mean is reported; at 100k AOIs the same size mix gives ~10× more).
//!
//! Reported per AOI count: the batch path the pipeline uses (`SubscriberIndex::match_batch`,
//! every core) and, as the reference, the one-event path on one thread (`matching_event`).

use super::{emit, gen, per_s, secs, BenchCtx, BenchError, Scale};
use crate::model::{ChangeEvent, ChangeKind, Severity, StoredGeometry};
use crate::notify::matcher::{Subscriber, SubscriberIndex};
use crate::synth::{CountyIter, CountySpec};
use serde_json::json;
use std::time::Instant;

/// Mean AOI matches per event the AOI sizes are calibrated for, at [`CALIBRATION_AOIS`].
const TARGET_MATCHES: f64 = 1.6;
const CALIBRATION_AOIS: usize = 10_000;
/// Smallest AOI side: about one lot.
pub(super) const MIN_SIDE_M: f64 = 30.0;
/// A synthetic lot is about this wide and deep (metres), for the calibration only.
const LOT_SIDE_M: f64 = 38.0;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    let (county, events_n, aoi_counts, reps) = match ctx.scale {
        // A county big enough for 10k AOIs of realistic sizes; only its first lots are events.
        Scale::Test => (200_000, 3_000, vec![CALIBRATION_AOIS], 1),
        Scale::Small => (200_000, 200_000, vec![CALIBRATION_AOIS, 100_000], 3),
        Scale::Full => (1_000_000, 1_000_000, vec![CALIBRATION_AOIS, 100_000], 3),
    };
    let spec = gen::county_spec(county, ctx.seed);
    let events = events_of(&spec, events_n);
    let max_side = calibrate_max_side(&spec);
    for n in aoi_counts {
        measure(ctx, &spec, &events, n, max_side, reps)?;
    }
    Ok(())
}

/// Parcel-sized rezoning events: the first `n` lots of the county.
fn events_of(spec: &CountySpec, n: usize) -> Vec<ChangeEvent> {
    CountyIter::new(spec)
        .take(n)
        .map(|lot| {
            let g = StoredGeometry(vec![vec![lot.ring.clone()]]);
            ChangeEvent {
                source_id: "bench-county".into(),
                jurisdiction: "bench".into(),
                parcel_id: lot.id,
                kind: ChangeKind::Rezoned,
                from: Some(lot.zoning),
                to: Some("M-1".into()),
                effective_date: None,
                old_geometry: Some(g.clone()),
                new_geometry: Some(g),
                area_m2: LOT_SIDE_M * LOT_SIDE_M,
                observed_at_ms: 0,
                severity: Severity::Notice,
                revision: 0,
            }
        })
        .collect()
}

/// Largest AOI side (m) such that a lot meets [`TARGET_MATCHES`] AOIs on average among
/// [`CALIBRATION_AOIS`] squares of log-uniform side in `[MIN_SIDE_M, max]` over the extent:
/// E[(side + lot)²] · n / area = target (a square and a lot meet when their centres are within
/// (side + lot)/2 of each other on both axes).
pub(super) fn calibrate_max_side(spec: &CountySpec) -> f64 {
    let (sw, ne) = CountyIter::extent(spec);
    let m_lat = 111_320.0;
    let m_lon = m_lat * sw[1].to_radians().cos();
    let area = ((ne[0] - sw[0]) * m_lon) * ((ne[1] - sw[1]) * m_lat);
    let expected = |max: f64| -> f64 {
        let (a, b) = (MIN_SIDE_M, max);
        let l = (b / a).ln();
        if l <= 0.0 {
            return (a + LOT_SIDE_M).powi(2) * CALIBRATION_AOIS as f64 / area;
        }
        let e1 = (b - a) / l;
        let e2 = (b * b - a * a) / (2.0 * l);
        (e2 + 2.0 * LOT_SIDE_M * e1 + LOT_SIDE_M * LOT_SIDE_M) * CALIBRATION_AOIS as f64 / area
    };
    let (mut lo, mut hi) = (MIN_SIDE_M, 50_000.0);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if expected(mid) < TARGET_MATCHES {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

fn measure(ctx: &BenchCtx, spec: &CountySpec, events: &[ChangeEvent], n: usize, max_side: f64, reps: usize) -> Result<(), BenchError> {
    let t = Instant::now();
    let subs: Vec<Subscriber> = gen::aois(spec, n, MIN_SIDE_M, max_side, ctx.seed)
        .into_iter()
        .enumerate()
        .map(|(i, aoi)| Subscriber {
            id: format!("bench-sub-{i}"),
            target: "http://127.0.0.1:9/hook".into(),
            secret: None,
            secret_old: None,
            min_severity: Severity::Info,
            aoi,
        })
        .collect();
    let index = SubscriberIndex::build(subs);
    let build_s = secs(t.elapsed());

    // The batch path, best of `reps` (the machine is shared; the best run is the least disturbed).
    let mut batch_runs = Vec::new();
    let mut matches = 0u64;
    for _ in 0..reps {
        let t = Instant::now();
        let out = index.match_batch(events);
        batch_runs.push(t.elapsed().as_secs_f64());
        matches = out.iter().map(|m| m.len() as u64).sum();
    }
    // The one-event path on one thread, over (at most) the first 50k events.
    let single_n = events.len().min(50_000);
    let t = Instant::now();
    let mut single_matches = 0u64;
    for e in &events[..single_n] {
        single_matches += index.matching_event(e).len() as u64;
    }
    let single_s = t.elapsed().as_secs_f64();
    let batch_prefix: u64 = index.match_batch(&events[..single_n]).iter().map(|m| m.len() as u64).sum();
    if batch_prefix != single_matches {
        return Err(BenchError::Failed(format!(
            "batch and one-by-one matching disagree: {batch_prefix} vs {single_matches} matches"
        )));
    }
    let best = batch_runs.iter().copied().fold(f64::INFINITY, f64::min);
    let n_events = events.len() as u64;
    emit(
        "matching",
        json!({
            "aois": n,
            "events": n_events,
            "aoi_side_m": [MIN_SIDE_M, (max_side * 10.0).round() / 10.0],
            "mean_matches_per_event": ((matches as f64 / n_events.max(1) as f64) * 1000.0).round() / 1000.0,
            "index_build_s": build_s,
            "batch_wall_s": (best * 1000.0).round() / 1000.0,
            "batch_events_per_s": per_s(n_events, best),
            "batch_runs_events_per_s": batch_runs.iter().map(|s| per_s(n_events, *s)).collect::<Vec<_>>(),
            "threads": crate::util::cores(),
            "single_thread_one_by_one_events_per_s": per_s(single_n as u64, single_s),
            "target_events_per_s": if n <= CALIBRATION_AOIS { 400_000 } else { 150_000 },
        }),
    );
    Ok(())
}
