//! Who may run a source right now, and when each runs next. `serve`'s scheduler and the
//! control port's "run now" share one `SourceRuns`, so two runs of one source never
//! interleave: a trigger while a run is going is refused as `skipped_overlap`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Per-source run lease and next-run time (in-memory; a restart starts with nothing running).
#[derive(Debug, Default)]
pub struct SourceRuns {
    running: Mutex<HashSet<String>>,
    next_run_ms: Mutex<HashMap<String, u64>>,
}

/// Held while a source runs; dropping it releases the source.
pub struct RunLease<'a> {
    runs: &'a SourceRuns,
    source: String,
}

impl Drop for RunLease<'_> {
    fn drop(&mut self) {
        if let Ok(mut g) = self.runs.running.lock() {
            g.remove(&self.source);
        }
    }
}

impl SourceRuns {
    /// Takes the source's lease, or None when a run of it is already going.
    pub fn try_start(&self, source: &str) -> Option<RunLease<'_>> {
        let mut g = self.running.lock().ok()?;
        if !g.insert(source.to_string()) {
            return None;
        }
        Some(RunLease { runs: self, source: source.to_string() })
    }

    pub fn is_running(&self, source: &str) -> bool {
        self.running.lock().map(|g| g.contains(source)).unwrap_or(false)
    }

    pub fn set_next_run(&self, source: &str, at_ms: u64) {
        if let Ok(mut g) = self.next_run_ms.lock() {
            g.insert(source.to_string(), at_ms);
        }
    }

    pub fn next_run(&self, source: &str) -> Option<u64> {
        self.next_run_ms.lock().ok()?.get(source).copied()
    }
}
