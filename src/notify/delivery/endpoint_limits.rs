//! Per-endpoint limits: `endpoint_concurrency` slots and the `endpoint_rate` token bucket, so
//! one subscriber's slow or rate-limited receiver never holds up the others.

use crate::notify::replay::TokenBucket;
use super::Deliverer;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

impl Deliverer {
    pub(super) fn endpoint_slot(&self, id: &str) -> Arc<Semaphore> {
        let mut g = self.endpoint_slots.lock().unwrap_or_else(|p| p.into_inner());
        // Looked up before inserting: the entry API would allocate the id on every webhook.
        if let Some(slot) = g.get(id) {
            return slot.clone();
        }
        g.entry(id.to_string()).or_insert_with(|| Arc::new(Semaphore::new(self.cfg.endpoint_concurrency))).clone()
    }

    /// Waits until endpoint `id` has a rate token, without taking it (see the pump: a send
    /// waits for its token before it takes a global permit, and takes it after).
    pub(super) async fn endpoint_rate_ready(&self, id: &str) -> bool {
        self.endpoint_rate_until(id, |b, now| match b.until_available(now) {
            wait if wait.is_zero() => Ok(()),
            wait => Err(wait),
        })
        .await
    }

    /// Waits for and takes one of endpoint `id`'s rate tokens (`endpoint_rate`).
    pub(super) async fn endpoint_rate_wait(&self, id: &str) -> bool {
        self.endpoint_rate_until(id, TokenBucket::try_take).await
    }

    /// Asks endpoint `id`'s token bucket `step` (made on first use) until it says `Ok`,
    /// sleeping as long as each `Err` says in between; at once without an `endpoint_rate`.
    /// `false` when the wait would end past a drain's deadline (`rate_deadline`): the row is
    /// then left queued, unsent (bb30: `endpoint_rate = 0.01` held a `run` whose `run_wait`
    /// was 1 s for minutes, pacing its sends).
    async fn endpoint_rate_until(&self, id: &str, step: impl Fn(&mut TokenBucket, Instant) -> Result<(), Duration>) -> bool {
        if self.cfg.endpoint_rate <= 0.0 {
            return true;
        }
        loop {
            let wait = {
                let mut g = self.endpoint_buckets.lock().unwrap_or_else(|p| p.into_inner());
                let b = g.entry(id.to_string()).or_insert_with(|| TokenBucket::new(self.cfg.endpoint_rate, 1.0, Instant::now()));
                step(b, Instant::now())
            };
            match wait {
                Ok(()) => return true,
                Err(d) if self.rate_deadline.is_some_and(|end| Instant::now() + d > end) => return false,
                Err(d) => tokio::time::sleep(d).await,
            }
        }
    }
}
