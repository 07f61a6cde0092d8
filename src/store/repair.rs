//! Crash recovery cost of the store file. After an unclean shutdown (SIGKILL, power loss)
//! redb must repair the file before it can be used: without more, that walks every page of
//! every tree to verify checksums and rebuild the allocator state — seconds for a file of a few
//! GB, during which nothing is delivered. redb's **quick-repair** saves the allocator state
//! with every commit (and commits in two phases), so the next open after a crash loads it
//! instead of rebuilding it. It costs each durable commit a little more; delivery outcomes are
//! group-committed (thousands per transaction), so that cost is paid per batch, not per event.
//! `zonewatch bench --only recovery` measures both sides; see docs/ARCHITECTURE.md (invariant
//! on recovery) for the choice.
//!
//! Every write transaction is durable. Outbox leases, the one state that may be lost in a
//! crash without consequence, are not written at all (they live in memory, `leases.rs`).

use super::Store;
use redb::WriteTransaction;
use std::sync::atomic::Ordering;

/// What the last [`Store::open`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpenInfo {
    /// The file had not been closed cleanly and redb rebuilt its allocator state by walking
    /// the trees (a full repair). With quick-repair records this stays false after a crash.
    pub full_repair: bool,
    /// Wall time of the redb open itself (repair included), seconds.
    pub open_s: f64,
}

impl Store {
    /// Whether durable commits save redb's allocator state (quick-repair). On by default.
    pub fn quick_repair(&self) -> bool {
        self.quick_repair.load(Ordering::Relaxed)
    }

    /// Turns quick-repair records on or off for later commits (the bench compares both).
    pub fn set_quick_repair(&self, on: bool) {
        self.quick_repair.store(on, Ordering::Relaxed);
    }

    /// What the open of this store found (full repair or not, and how long it took).
    pub fn open_info(&self) -> OpenInfo {
        self.open_info
    }

    /// Settings every durable write transaction of the store gets (quick-repair).
    pub(super) fn durable_commit_settings(&self, wtx: &mut WriteTransaction) {
        wtx.set_quick_repair(self.quick_repair());
    }
}

impl Store {
    /// The wall time of opening `path` with a forced full repair (every tree walked, checksums
    /// verified, allocator state rebuilt): what an open after a crash costs when the last
    /// commit left no quick-repair record. The store must not be open.
    pub fn full_repair_seconds(path: &std::path::Path) -> Result<f64, super::StoreError> {
        let t = std::time::Instant::now();
        let db = redb::Database::builder().set_check_integrity_on_open(true).create(path)?;
        let s = t.elapsed().as_secs_f64();
        drop(db);
        Ok((s * 1000.0).round() / 1000.0)
    }

    /// One small durable commit with the store's current settings (the bench's measure of
    /// what quick-repair adds to a commit). Writes a counter under its own `meta` key.
    #[doc(hidden)]
    pub fn probe_commit(&self, value: u64) -> Result<(), super::StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        wtx.open_table(super::tables::META)?.insert("bench_commit_probe", value.to_le_bytes().as_slice())?;
        wtx.commit()?;
        Ok(())
    }
}
