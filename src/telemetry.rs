//! In-process measurements that are not in the store: the delivery latency histogram (time
//! from the commit that queued an alert to the receiver's 2xx). Process-global so that the
//! delivery workers can record without knowing who reads it (the control port's `/metrics`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds (Prometheus `le`).
pub const LATENCY_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0];

/// A fixed-bucket histogram with atomic counters.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// (cumulative bucket counts, count, sum in seconds).
    pub fn read(&self) -> (Vec<u64>, u64, f64) {
        (
            self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
            self.count.load(Ordering::Relaxed),
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        )
    }
}

/// Commit-to-receipt latency of successful deliveries.
pub fn delivery_latency() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(Histogram::default)
}
