//! Endpoints whose gate closed during one delivery pump (a 410 Gone, a circuit breaker that
//! opened, an endpoint disabled for failing too long), and which of their leased rows must
//! therefore not be sent.
//!
//! It exists because a pump leases ahead: one endpoint may have its share of the window
//! (1,024 rows or more) leased and waiting for its slots when its gate closes. The store
//! closes it in the commit that records the outcome that closed it, but every row already
//! leased would still be sent: one more request each to a receiver that said it is gone, or
//! that the breaker was opened to spare (and one more attempt used up by each row). So:
//!
//! * from a 410 answer until the commit that disables its endpoint lands, no row of that
//!   endpoint is leased and no leased row of it is sent;
//! * once a commit has closed an endpoint's gate, rows leased by a pass that *began* before
//!   that commit are not sent (that pass's snapshot may predate it); passes that begin later
//!   read the gate from the store: closed, its rows are held there (a breaker lets its probe
//!   through when its cool-down ends); opened again (an operator's enable), they are leased
//!   and sent as usual.
//!
//! A row not sent gives its lease back (`Store::lease_step`) and stays queued as it was:
//! no outcome, no attempt, nothing lost.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One pump's record of closed gates (see the module doc).
#[derive(Default)]
pub(crate) struct ClosedGates {
    /// Endpoint → the number of the first lease pass that began after the latest commit that
    /// closed its gate (`None`: it answered 410 and that commit has not landed).
    marks: Mutex<HashMap<String, Option<u64>>>,
    /// Lease passes begun in this pump; a pass takes its number before opening its snapshot.
    passes: AtomicU64,
}

impl ClosedGates {
    /// Numbers a lease pass; call before the pass opens its read snapshot.
    pub(crate) fn begin_pass(&self) -> u64 {
        self.passes.fetch_add(1, Ordering::SeqCst)
    }

    /// A send of `endpoint` was answered 410 Gone.
    pub(crate) fn answered_gone(&self, endpoint: &str) {
        self.lock().insert(endpoint.to_string(), None);
    }

    /// A commit that closed `endpoint`'s gate (or recorded its 410) has landed.
    pub(crate) fn closed_by_commit(&self, endpoint: &str) {
        // Read after the commit: every pass numbered from here opens its snapshot later.
        let cutoff = self.passes.load(Ordering::SeqCst);
        self.lock().insert(endpoint.to_string(), Some(cutoff));
    }

    /// The commit recorded `endpoint`'s 410s as failures (the target that answered was not
    /// its stored subscriber's: `DeliveryResult::Gone`), and closed nothing: its rows go out
    /// as usual, leased before the commit or after.
    pub(crate) fn not_closed(&self, endpoint: &str) {
        self.lock().remove(endpoint);
    }

    /// Endpoints none of whose rows a lease pass may take now (their disable not committed).
    pub(crate) fn held_back(&self) -> HashSet<String> {
        self.lock().iter().filter(|(_, m)| m.is_none()).map(|(id, _)| id.clone()).collect()
    }

    /// Whether a row of `endpoint` leased by pass `leased_in` must not be sent.
    pub(crate) fn skips(&self, endpoint: &str, leased_in: u64) -> bool {
        match self.lock().get(endpoint) {
            None => false,
            Some(None) => true,
            Some(Some(cutoff)) => leased_in < *cutoff,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<u64>>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_leased_before_a_gate_closed_are_skipped_and_later_passes_decide_from_the_store() {
        let gone = ClosedGates::default();
        let early = gone.begin_pass();
        assert!(!gone.skips("w", early), "no 410 yet");
        gone.answered_gone("w");
        assert!(gone.skips("w", early) && !gone.skips("v", early));
        assert_eq!(gone.held_back(), HashSet::from(["w".to_string()]));
        let during = gone.begin_pass();
        assert!(gone.skips("w", during), "not committed: nothing of w is sent");
        gone.closed_by_commit("w");
        assert!(gone.held_back().is_empty(), "the store's gate holds w now");
        assert!(gone.skips("w", early) && gone.skips("w", during), "passes begun before the commit");
        let after = gone.begin_pass();
        assert!(!gone.skips("w", after), "a pass begun after the commit read the disable (or a re-enable)");
        // A second 410 (a row that was already in flight) holds it back again until its commit.
        gone.answered_gone("w");
        assert!(gone.skips("w", after));
        gone.closed_by_commit("w");
        assert!(!gone.skips("w", gone.begin_pass()));
        // A 410 the commit took as a failure (not the stored subscriber's target): nothing of
        // w is held back any more, not even a row leased before.
        let before = gone.begin_pass();
        gone.answered_gone("w");
        gone.not_closed("w");
        assert!(!gone.skips("w", before) && gone.held_back().is_empty());
        // A breaker that opened: no 410 before it, the commit alone.
        let early = gone.begin_pass();
        gone.closed_by_commit("v");
        assert!(gone.skips("v", early) && !gone.skips("v", gone.begin_pass()) && gone.held_back().is_empty());
    }
}
