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
//! The system clock can step back (NTP correcting a clock that ran ahead, a VM restored from
//! a snapshot). Every due time zonewatch stored before such a step — a retry, an expiry, an
//! open breaker's probe — would then lie that much further off, and a retry due in five
//! seconds waited an hour after a one-hour step. So within a process [`SystemClock`] never
//! goes back by more than [`STEP_BACK_TOLERANCE_MS`]: after a larger step it counts on from
//! the time before the step by the monotonic clock until the wall clock catches up, and says
//! so once. Forward steps are followed as they come (a lease also waits out its elapsed
//! time, `store::leases`).

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

/// The operating system's wall clock, which within a process does not step back (see the
/// module doc): what every production process uses.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

/// A step back of the wall clock up to this is followed as it comes (NTP slewing, a little
/// jitter between threads); a larger one is held off until the wall clock catches up.
pub const STEP_BACK_TOLERANCE_MS: u64 = 2_000;

/// What [`SystemClock`] last said, and when by the monotonic clock.
#[derive(Debug, Clone, Copy)]
struct Reading {
    ms: u64,
    at: std::time::Instant,
    /// Counting on from before a step back: the wall clock is behind `ms`.
    holding: bool,
}

/// The process's last reading (one for every `SystemClock`: they are the one clock).
static LAST: std::sync::Mutex<Option<Reading>> = std::sync::Mutex::new(None);

/// The rule of [`SystemClock`]: the time to give at monotonic instant `at` when the wall
/// clock says `wall`, after `last`; and whether the clock is now held off a step back.
fn steady(last: Option<Reading>, wall: u64, at: std::time::Instant) -> Reading {
    let Some(last) = last else { return Reading { ms: wall, at, holding: false } };
    let elapsed = u64::try_from(at.saturating_duration_since(last.at).as_millis()).unwrap_or(u64::MAX);
    let floor = last.ms.saturating_add(elapsed);
    let behind = if last.holding { wall < floor } else { wall.saturating_add(STEP_BACK_TOLERANCE_MS) < floor };
    if behind {
        Reading { ms: floor, at, holding: true }
    } else {
        Reading { ms: wall, at, holding: false }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        let (now, stepped_back_by) = {
            let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
            let wall = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
            let before = *last;
            let now = steady(before, wall, std::time::Instant::now());
            *last = Some(now);
            let started_holding = now.holding && !before.is_some_and(|b| b.holding);
            (now.ms, started_holding.then(|| now.ms.saturating_sub(wall)))
        };
        // Said outside the lock: a log line may itself ask for the time.
        if let Some(by) = stepped_back_by {
            tracing::warn!(
                seconds = by / 1000,
                "the system clock stepped back; zonewatch counts on from the time before the step until the clock catches up, so that retries and expiries fall due when they were meant to (times it records meanwhile are that far ahead of the clock)"
            );
        }
        now
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

    /// The wall clock followed while it runs on (or slews back a little); after a step back
    /// past the tolerance, the time before the step counted on by the monotonic clock until
    /// the wall clock catches up; a forward step followed at once.
    #[test]
    fn the_system_clock_does_not_step_back() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        const B: u64 = 1_800_000_000_000;
        let r = steady(None, B, at(0));
        assert_eq!((r.ms, r.holding), (B, false));
        let r = steady(Some(r), B + 1_000, at(1_000));
        assert_eq!((r.ms, r.holding), (B + 1_000, false));
        // Slewed back 500 ms: followed.
        let r = steady(Some(r), B + 1_500, at(2_000));
        assert_eq!((r.ms, r.holding), (B + 1_500, false));
        // Stepped back an hour: the time before the step, counted on.
        let hour = 3_600_000;
        let r = steady(Some(r), B + 2_500 - hour, at(3_000));
        assert_eq!((r.ms, r.holding), (B + 2_500, true));
        let r = steady(Some(r), B + 12_500 - hour, at(13_000));
        assert_eq!((r.ms, r.holding), (B + 12_500, true));
        // Within the tolerance of the count but still behind it: held, not stepped back.
        let r = steady(Some(r), B + 13_500 - 1_000, at(14_000));
        assert_eq!((r.ms, r.holding), (B + 13_500, true));
        // Caught up: the wall clock again.
        let r = steady(Some(r), B + 14_600, at(15_000));
        assert_eq!((r.ms, r.holding), (B + 14_600, false));
        // A step forward is followed at once.
        let r = steady(Some(r), B + hour, at(16_000));
        assert_eq!((r.ms, r.holding), (B + hour, false));
        // And the real clock, read twice, never goes back.
        let (a, b) = (SystemClock.now_ms(), SystemClock.now_ms());
        assert!(b >= a);
    }

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
