//! When each source runs next, as `serve`'s scheduler decided; shown by the control port.
//! (The per-source run lease itself lives with the pipeline: `ingest::staging::try_lease`.)

use std::collections::HashMap;
use std::sync::Mutex;

/// Next-run times per source (in-memory; a restart schedules afresh).
#[derive(Debug, Default)]
pub struct SourceRuns {
    next_run_ms: Mutex<HashMap<String, u64>>,
}

impl SourceRuns {
    pub fn set_next_run(&self, source: &str, at_ms: u64) {
        if let Ok(mut g) = self.next_run_ms.lock() {
            g.insert(source.to_string(), at_ms);
        }
    }

    pub fn next_run(&self, source: &str) -> Option<u64> {
        self.next_run_ms.lock().ok()?.get(source).copied()
    }
}
