//! A drain: passes of the pump until nothing is due or a deadline passes (`run`'s
//! `run_wait`, a replay's end), waiting for retries and breaker probes that fall due before
//! it, never for one after it.

use super::{Deliverer, DeliveryError, PassStats, stopped};
use std::time::{Duration, Instant};

impl Deliverer {
    /// Delivers until the outbox is empty, waiting for retries and open breakers' probes that
    /// fall due before `deadline`; later ones (and a disabled endpoint's rows) are left for
    /// the next run or for `serve`.
    pub async fn drain(&self, deadline: Instant) -> Result<PassStats, DeliveryError> {
        self.drain_until(deadline, None).await
    }

    /// [`Deliverer::drain`] that stops once `stop` reads true (`run` on a signal): nothing
    /// more is leased or sent and no retry is waited for; the sends already begun finish and
    /// their outcomes are committed before it returns (see [`Deliverer::pump_until`]). What
    /// is left stays queued for the next run.
    pub async fn drain_until(&self, deadline: Instant, stop: Option<&tokio::sync::watch::Receiver<bool>>) -> Result<PassStats, DeliveryError> {
        let this = Deliverer { rate_deadline: Some(deadline), ..self.clone() };
        this.drain_paced(deadline, stop).await
    }

    async fn drain_paced(&self, deadline: Instant, stop: Option<&tokio::sync::watch::Receiver<bool>>) -> Result<PassStats, DeliveryError> {
        let is_stopped = || stop.is_some_and(|s| *s.borrow());
        // Sleeps `wait`, or until a stop, whichever comes first.
        let pause = |wait: Duration| async move {
            match stop {
                Some(s) => {
                    let mut s = s.clone();
                    let _ = tokio::time::timeout(wait, stopped(&mut s)).await;
                }
                None => tokio::time::sleep(wait).await,
            }
        };
        let mut total = PassStats::default();
        // The deadline on the deliverer's clock: rows due after it are not leased, even while
        // slow sends keep a pass going (a run must not keep retrying long past `run_wait`).
        // Read again at each pass: a wall clock stepped forward meanwhile put every retry due
        // after the first reading, and the drain ended with its alerts queued (bb29).
        // Not past the deadline, though: a pass ending after it must not lease the retries
        // fallen due meanwhile (a reviewer).
        let due_by_now = || self.clock.now_ms().saturating_add(deadline.saturating_duration_since(Instant::now()).as_millis() as u64);
        let mut due_by = due_by_now();
        // Pumps in a row that sent nothing because their last lease pass stopped at its
        // pass-over bound (a held backlog ahead of rows that may go out): the drain goes on
        // at once until such pumps have read past every queued row once, or it would end with
        // a sendable row behind the backlog (`zonewatch run` would never reach it).
        let mut capped_in_a_row = 0u64;
        loop {
            if is_stopped() {
                break;
            }
            if Instant::now() < deadline {
                due_by = due_by_now();
            }
            let pass_from = self.clock.now_ms();
            let pass = self.pump_until(stop, Some(due_by)).await?;
            total += pass;
            if is_stopped() {
                break;
            }
            if pass.attempted > 0 || !pass.lease_capped {
                capped_in_a_row = 0;
            } else {
                capped_in_a_row += 1;
                let sweep = self.store.outbox_len()? / crate::store::MIN_PASS_OVER as u64 + 2;
                if capped_in_a_row <= sweep && Instant::now() < deadline {
                    continue;
                }
            }
            let Some(next) = self.store.next_due_ms()? else { break };
            let now = self.clock.now_ms();
            // A row that fell due after the pass looked is not held back: another pass takes it
            // (a clock that moves in steps, a manual one in tests, showed the drain ending
            // with it due and unsent).
            if pass.attempted == 0 && next <= now && next > pass_from {
                continue;
            }
            if pass.attempted == 0 && next <= now {
                // Every due row is held back. Wait for whichever comes first before the
                // deadline: an open breaker's probe (a short cool-down must not strand a
                // run's alerts until the next run) or a retry falling due later, perhaps of
                // an endpoint that is not held. A disabled endpoint's rows wait for an
                // operator.
                // Only a time by `due_by` can let anything through: the pump looks at the
                // clock capped there. (After a wall-clock step ahead, a breaker can open until
                // a time between `due_by` and now: waiting for it would be no wait at all, a
                // spin of lease passes until the deadline.)
                let later_retry = self.store.next_retry_due_after_ms(now)?;
                let wake = [pass.held_until_ms, later_retry].into_iter().flatten().min();
                match wake {
                    Some(at) if at <= due_by && Instant::now() + Duration::from_millis(at.saturating_sub(now)) <= deadline => {
                        pause(Duration::from_millis(at.saturating_sub(now))).await;
                        // Rows may have fallen due anywhere in the queue: a new sweep.
                        capped_in_a_row = 0;
                        continue;
                    }
                    _ => break,
                }
            }
            if next > now {
                let wait = Duration::from_millis(next - now);
                if Instant::now() + wait > deadline {
                    break;
                }
                pause(wait).await;
                capped_in_a_row = 0;
            }
        }
        Ok(total)
    }
}
