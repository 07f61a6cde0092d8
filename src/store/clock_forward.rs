//! The wall clock's steps forward, remembered so that limits counted in elapsed time do not
//! count them.
//!
//! Why it exists: two limits count wall-clock time from a stored moment, `max_retry_window`
//! from when an alert was queued (`OutboxEntry::created_ms`) and `disable_after` from an
//! endpoint's first failure (`EndpointState::failing_since_ms`). An edge box without a
//! real-time clock boots years behind, and NTP puts it right later. Counted in wall time,
//! every alert queued before that step and retried after it was dead-lettered
//! `retry_window_exceeded` without a send, and an endpoint failing across it was disabled,
//! whatever the seconds that really passed (a reviewer showed both with a clock shim). The
//! steps back are `clock_step.rs`'s.
//!
//! How: a step forward is told from time passing by the monotonic clock (`Clock::mono_ms`),
//! which a step does not move. Between two looks, the wall clock moving more than monotonic
//! time by over [`FORWARD_STEP_TOLERANCE_MS`] is a step of the difference.
//! [`Store::watch_clock`] is that look: the deliverer calls it wherever it reads the clock to
//! hold a row to a limit, and `Engine` looks once as it opens the store, so that a step during
//! a `run`'s ingest is seen. Each step is kept as a [`ForwardStep`], in memory at once, and in
//! `meta` (`forward_steps`) by the next outcome commit or pass, or by
//! `Engine::settle_clock_watch` (`serve` every 5 s and as it stops, `run` as it ends), so that
//! a later process knows it. [`elapsed_ms`] is the time from a stored moment to now, less the steps
//! taken after it.
//!
//! Which moments a step is credited to: those no later than the last reading that can have
//! come before it (`before_ms`). A clock that comes back below that reading (a board without
//! a real-time clock that boots at the same wrong time again, and lives those wall times a
//! second time) makes the step another era's: it is dropped, or every moment of the new era
//! would be credited it too, with the next boot's step on top (a reviewer). A moment whose
//! wall time the step jumped over (between `before_ms` and `at_ms`) was recorded in another
//! era, and counts wall time. The clock is read under the watch's lock, so looks are applied
//! in the order they were read.
//!
//! Not repaired (wall-clock times cannot order the moments of two eras): on a board that boots
//! twice at the same wrong time, an alert queued in the first boot after where the second
//! boot's step begins counts the wall gap and can be dead-lettered `retry_window_exceeded`;
//! and when zonewatch first looks after where the first boot's step began, a failure streak
//! moved back by `clock_step.rs` below that point is credited both boots' steps (its endpoint
//! then is not disabled by `disable_after`). Both need the first boot to have left work
//! behind at the same wall times the second boot lives again.
//!
//! Limits: only steps seen while a zonewatch process runs are known (one taken while it was
//! stopped reads as time passing). A suspended machine counts as a step (Linux's monotonic
//! clock stops meanwhile), so a suspend lengthens the limits by its length, which is the safe
//! side: alerts kept, endpoints kept. Idempotency-key expiries and the retention sweeps still
//! count wall time.

use super::tables::{META, META_FORWARD_STEPS};
use super::{Store, StoreError};
use redb::{Database, ReadableDatabase, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// How far the wall clock may run ahead of monotonic time between two looks before it counts
/// as a step: the two are read a moment apart, and a second more costs a limit a second.
pub const FORWARD_STEP_TOLERANCE_MS: u64 = 2_000;

/// Steps kept at most; past this the two oldest are merged (credited to the moments before the
/// newer of the two, so the moments between them get the older one too: their limits run
/// longer, the safe side).
const MAX_STEPS: usize = 64;

/// One step forward of the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardStep {
    /// The latest wall-clock reading that can have come before the step (ms): the last look
    /// before it plus the time that passed until the look that found it.
    pub before_ms: u64,
    /// The earliest wall-clock reading after the step (ms).
    pub at_ms: u64,
    /// How far the clock went forward, at least (ms).
    pub size_ms: u64,
}

/// Time from `since_ms` to `now_ms` (wall clock) less the steps forward taken after
/// `since_ms` (see the module doc for which).
pub fn elapsed_ms(steps: &[ForwardStep], since_ms: u64, now_ms: u64) -> u64 {
    let stepped = steps.iter().filter(|s| since_ms <= s.before_ms && since_ms < s.at_ms).fold(0u64, |sum, s| sum.saturating_add(s.size_ms));
    now_ms.saturating_sub(since_ms).saturating_sub(stepped)
}

/// The store's look at the clock: the last reading and the steps found.
#[derive(Debug, Default)]
pub(super) struct ClockWatch {
    state: Mutex<WatchState>,
}

#[derive(Debug, Default)]
struct WatchState {
    /// The last (wall, monotonic) reading looked at.
    last: Option<(u64, u64)>,
    steps: Arc<[ForwardStep]>,
    /// Steps found in this process, and how many of them are in `meta` (written by a commit).
    found: u64,
    saved: u64,
}

impl ClockWatch {
    /// The steps stored in `db` (none when the value is missing or cannot be read: a step
    /// forgotten costs what it cost before this record existed).
    pub(super) fn load(db: &Database) -> Result<ClockWatch, StoreError> {
        let rtx = db.begin_read()?;
        let meta = match rtx.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(ClockWatch::default()),
            Err(e) => return Err(e.into()),
        };
        // One that cannot be read is written afresh by the next commit (`found` ahead of
        // `saved`), not warned of at every open.
        let (steps, found) = match meta.get(META_FORWARD_STEPS)? {
            Some(v) => match super::codec::decode::<Vec<ForwardStep>>(v.value()) {
                Ok(steps) => (steps, 0),
                Err(why) => {
                    tracing::warn!("the stored steps of the wall clock cannot be read ({why}); counting from none");
                    (Vec::new(), 1)
                }
            },
            None => (Vec::new(), 0),
        };
        Ok(ClockWatch { state: Mutex::new(WatchState { steps: steps.into(), found, ..WatchState::default() }) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl WatchState {
    /// Applies one look (see [`Store::watch_clock`]).
    fn look(&mut self, wall_ms: u64, mono_ms: u64) -> Option<ForwardStep> {
        // A reading taken before the last one applied (another task's, read first and locked
        // second) would make the time between them look like a step again.
        if self.last.is_some_and(|(_, mono0)| mono_ms < mono0) {
            return None;
        }
        let found = self.last.and_then(|(wall0, mono0)| {
            let passed = mono_ms.saturating_sub(mono0);
            let step = wall_ms.saturating_sub(wall0).saturating_sub(passed);
            (step > FORWARD_STEP_TOLERANCE_MS).then(|| ForwardStep { before_ms: wall0.saturating_add(passed), at_ms: wall_ms.saturating_sub(passed), size_ms: step })
        });
        self.last = Some((wall_ms, mono_ms));
        // The clock back below where a step began: that step was another era's.
        if self.steps.iter().any(|s| s.before_ms > wall_ms.saturating_add(FORWARD_STEP_TOLERANCE_MS)) {
            self.steps = self.steps.iter().filter(|s| s.before_ms <= wall_ms.saturating_add(FORWARD_STEP_TOLERANCE_MS)).copied().collect();
            self.found += 1;
        }
        if let Some(step) = found {
            self.steps = with_step(&self.steps, step).into();
            self.found += 1;
        }
        found
    }
}

/// `steps` with `step` added, the two oldest merged while over [`MAX_STEPS`].
fn with_step(steps: &[ForwardStep], step: ForwardStep) -> Vec<ForwardStep> {
    let mut out = steps.to_vec();
    out.push(step);
    out.sort_by_key(|s| s.at_ms);
    while out.len() > MAX_STEPS {
        let older = out.remove(0);
        if let Some(newer) = out.first_mut() {
            newer.size_ms = newer.size_ms.saturating_add(older.size_ms);
        }
    }
    out
}

impl Store {
    /// Looks at the clock: `wall_ms` and `mono_ms` read together from the deliverer's clock.
    /// Returns the step forward found since the last look, if any (kept at once; stored by the
    /// next outcome commit or [`Store::save_forward_steps`]). One clock per store: readings of
    /// two clocks would differ by a step that was never taken.
    pub fn watch_clock(&self, wall_ms: u64, mono_ms: u64) -> Option<ForwardStep> {
        self.watch_clock_reading(|| (wall_ms, mono_ms)).1
    }

    /// [`Store::watch_clock`] with the clock read (wall, monotonic) under the watch's lock, so
    /// that looks are applied in the order they were read (a reviewer: a wall reading taken
    /// before a step and applied after a later look could make one step count twice).
    /// Returns the wall reading and the step found.
    pub fn watch_clock_reading(&self, read: impl FnOnce() -> (u64, u64)) -> (u64, Option<ForwardStep>) {
        let mut g = self.clock_watch.state();
        let (wall_ms, mono_ms) = read();
        (wall_ms, g.look(wall_ms, mono_ms))
    }

    /// Whether steps found (or dropped) in this process are not stored yet.
    pub fn forward_steps_unsaved(&self) -> bool {
        let g = self.clock_watch.state();
        g.found != g.saved
    }

    /// The steps forward known to this store, oldest first.
    pub fn forward_steps(&self) -> Arc<[ForwardStep]> {
        self.clock_watch.state().steps.clone()
    }

    /// Writes the steps found since the last save into `meta` in one durable transaction;
    /// nothing when there are none.
    pub fn save_forward_steps(&self) -> Result<(), StoreError> {
        if !self.forward_steps_unsaved() {
            return Ok(());
        }
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let written = save_steps_in(self, &wtx)?;
        if written.is_none() {
            // Another save stored them meanwhile: no durable commit for nothing.
            wtx.abort()?;
            return Ok(());
        }
        wtx.commit()?;
        self.forward_steps_saved(written);
        Ok(())
    }

    /// Marks the steps a commit wrote ([`save_steps_in`]'s answer) as stored.
    pub(super) fn forward_steps_saved(&self, written: Option<u64>) {
        if let Some(found) = written {
            let mut g = self.clock_watch.state();
            g.saved = g.saved.max(found);
        }
    }
}

/// In `wtx`: writes the steps when some found in this process are not stored yet. Returns how
/// many had been found then, for [`Store::forward_steps_saved`] once the commit succeeded.
pub(super) fn save_steps_in(store: &Store, wtx: &WriteTransaction) -> Result<Option<u64>, StoreError> {
    let (steps, found) = {
        let g = store.clock_watch.state();
        if g.found == g.saved {
            return Ok(None);
        }
        (g.steps.clone(), g.found)
    };
    wtx.open_table(META)?.insert(META_FORWARD_STEPS, super::codec::encode(&steps.to_vec()).as_slice())?;
    Ok(Some(found))
}

/// The log line for a step found.
pub fn say_forward_step(step: &ForwardStep) {
    tracing::warn!(
        step_s = step.size_ms / 1000,
        "the system clock went forward {} s more than time passed: retry windows and `disable_after` do not count the step",
        step.size_ms / 1000
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_800_000_000_000;
    const YEAR: u64 = 365 * 86_400_000;
    const DAY: u64 = 86_400_000;

    #[test]
    fn elapsed_time_leaves_out_the_steps_taken_after_a_moment() {
        // A year's step a second after T: the last reading before it T + 1 s, the first after
        // it T + a year + 1 s.
        let steps = [ForwardStep { before_ms: T + 1_000, at_ms: T + YEAR + 1_000, size_ms: YEAR }];
        // Recorded before the step: the year is not elapsed time.
        assert_eq!(elapsed_ms(&steps, T, T + YEAR + 6_000), 6_000);
        // Recorded after it: wall time.
        assert_eq!(elapsed_ms(&steps, T + YEAR + 1_000, T + YEAR + 9_000), 8_000);
        // A moment the clock jumped over was another era's (a boot before): wall time.
        assert_eq!(elapsed_ms(&steps, T + 30 * DAY, T + YEAR + 6_000), YEAR + 6_000 - 30 * DAY);
        // A clock behind the moment: nothing elapsed.
        assert_eq!(elapsed_ms(&steps, T, T - 10), 0);
    }

    #[test]
    fn a_step_is_told_from_time_passing_once_kept_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        {
            let store = Store::open(&path).unwrap();
            assert_eq!(store.watch_clock(T, 0), None, "a first look has nothing to compare with");
            // An hour of time passing, wall and monotonic alike, is no step; nor is a second's
            // difference between the two readings.
            assert_eq!(store.watch_clock(T + 3_600_000, 3_600_000), None);
            assert_eq!(store.watch_clock(T + 3_601_000 + 1_500, 3_601_000), None);
            // A year forward in 10 s: a step of a year (less the 1.5 s the wall clock was
            // ahead at the last look), found once.
            let step = store.watch_clock(T + 3_611_000 + YEAR, 3_611_000).unwrap();
            assert_eq!(step, ForwardStep { before_ms: T + 3_612_500, at_ms: T + 3_601_000 + YEAR, size_ms: YEAR - 1_500 });
            assert_eq!(store.watch_clock(T + 3_612_000 + YEAR, 3_612_000), None);
            // A reading taken before the last one applied is passed over, not compared.
            assert_eq!(store.watch_clock(T + 3_600_000, 3_605_000), None);
            assert_eq!(store.watch_clock(T + 3_613_000 + YEAR, 3_613_000), None, "the step is not found again");
            // A step back not below where the step began is not a step forward
            // (`clock_step.rs` has those), and the step stands.
            assert_eq!(store.watch_clock(T + YEAR / 2, 3_614_000), None);
            assert_eq!(&*store.forward_steps(), &[step]);
            assert!(store.forward_steps_unsaved());
            store.save_forward_steps().unwrap();
            assert!(!store.forward_steps_unsaved());
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.forward_steps().len(), 1, "the step is known to the next process");
        // The board boots at the same wrong time again: below where the step began, the step
        // is the other boot's, and is dropped (kept, every moment of this boot would be
        // credited it too).
        assert_eq!(store.watch_clock(T + 5_000, 0), None);
        assert!(store.forward_steps().is_empty());
        store.save_forward_steps().unwrap();
        drop(store);
        assert!(Store::open(&path).unwrap().forward_steps().is_empty());
    }

    #[test]
    fn steps_past_the_cap_are_merged_oldest_first() {
        let mut steps: Vec<ForwardStep> = Vec::new();
        for i in 0..(MAX_STEPS as u64 + 3) {
            steps = with_step(&steps, ForwardStep { before_ms: T + i * 1_000_000 - 10, at_ms: T + i * 1_000_000, size_ms: 10 });
        }
        assert_eq!(steps.len(), MAX_STEPS);
        assert_eq!(steps[0], ForwardStep { before_ms: T + 3_000_000 - 10, at_ms: T + 3_000_000, size_ms: 40 });
        let total: u64 = steps.iter().map(|s| s.size_ms).sum();
        assert_eq!(total, 10 * (MAX_STEPS as u64 + 3), "no step is forgotten");
    }
}
