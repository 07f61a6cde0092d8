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
//!
//! A clock also tells its monotonic time ([`Clock::mono_ms`]): time that passed, which a step
//! of the wall clock (NTP putting a wrong clock right, an operator's `date -s`) does not move.
//! Comparing the two is how a step forward is told from time passing (`store::clock_forward`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Milliseconds of monotonic time since an arbitrary start: it only moves as time passes,
    /// never with a step of the wall clock. Not a timestamp; never stored.
    fn mono_ms(&self) -> u64;
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

    /// Since this process first asked (Linux's `CLOCK_MONOTONIC`, which does not count time
    /// the machine was suspended: a suspend reads as a step forward of its length).
    fn mono_ms(&self) -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_millis() as u64
    }
}

/// The system clock behind the shared handle.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that only moves when told to: tests set it and advance it explicitly. Setting it
/// forward or advancing it is time passing (its monotonic time moves as much); setting it back
/// and [`ManualClock::step_forward`] are steps of the wall clock (its monotonic time stays).
#[derive(Debug)]
pub struct ManualClock {
    now_ms: AtomicU64,
    mono_ms: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn at(now_ms: u64) -> Arc<ManualClock> {
        Arc::new(ManualClock { now_ms: AtomicU64::new(now_ms), mono_ms: AtomicU64::new(0) })
    }

    /// Moves the clock to `now_ms`: forward as time passing, backwards as a step of the wall
    /// clock (that is for the tests to decide).
    /// (Monotonic time moves first, and is read second: a look between the two writes sees
    /// time passing, never a step.)
    pub fn set(&self, now_ms: u64) {
        let before = self.now_ms.load(Ordering::SeqCst);
        self.mono_ms.fetch_add(now_ms.saturating_sub(before), Ordering::SeqCst);
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the clock forward by `by`, as time passing.
    pub fn advance(&self, by: std::time::Duration) {
        let ms = by.as_millis() as u64;
        self.mono_ms.fetch_add(ms, Ordering::SeqCst);
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Steps the wall clock forward by `by` without time passing: what NTP does to a clock
    /// that was years behind.
    pub fn step_forward(&self, by: std::time::Duration) {
        self.now_ms.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn mono_ms(&self) -> u64 {
        self.mono_ms.load(Ordering::SeqCst)
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
        // Time passed: 2 s advanced and 0 s of setting back; a step forward passes none.
        assert_eq!(c.mono_ms(), 2_000);
        c.set(1_010);
        c.step_forward(Duration::from_secs(3_600));
        assert_eq!((c.now_ms(), c.mono_ms()), (3_601_010, 3_000));
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
