//! Where "now" comes from.
//!
//! Every timestamp zonewatch stores (run records, watermarks, idempotency-key expiries,
//! outbox due times, audit rows, hold states) is taken from a [`Clock`] that is handed in,
//! never read from the system behind the caller's back. Production uses [`SystemClock`]; tests
//! use [`ManualClock`] and step time forward explicitly, so floor intervals, staleness,
//! key TTLs, retry backoff due times and retention sweeps are deterministic in tests instead of
//! depending on how fast the machine is.
//!
//! The scheduler in `serve` and the control port's uptime are the only places that ask a
//! clock unprompted; everything below them takes `now_ms` as a parameter. Measuring elapsed
//! time (timeouts, retry budgets, benchmarks) uses the monotonic `Instant`, which is not a
//! timestamp and is never stored.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// A clock shared by the engine, the deliverer and the control port.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's wall clock: what every production process uses.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

/// The system clock behind the shared handle.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that only moves when told to: tests set it and advance it explicitly.
#[derive(Debug)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn at(now_ms: u64) -> Arc<ManualClock> {
        Arc::new(ManualClock { now_ms: AtomicU64::new(now_ms) })
    }

    /// Moves the clock to `now_ms` (it may go backwards: that is for the tests to decide).
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: std::time::Duration) {
        self.now_ms.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::at(1_000);
        assert_eq!(c.now_ms(), 1_000);
        assert_eq!(c.now_ms(), 1_000);
        c.advance(Duration::from_secs(2));
        assert_eq!(c.now_ms(), 3_000);
        c.set(10);
        assert_eq!(c.now_ms(), 10);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
