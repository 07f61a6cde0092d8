//! A request to abandon source runs before their commit: how a graceful stop reaches a fetch
//! or a scan that would otherwise run on for minutes.
//!
//! Why it exists: `serve` and `run` stop gracefully on SIGINT / SIGTERM (what is in flight
//! finishes). A commit takes seconds, but a county's portal fetch takes minutes, and up to
//! `[ingest] max_fetch_time` from a slow server, while a service manager kills a stop that
//! outlasts its timeout (systemd: 90 s). Nothing of a run is in the store until its one write
//! transaction commits, so a fetch or a scan has nothing to lose by stopping: the next run
//! fetches and reads the layer again, and the watermark still describes the stored data.
//!
//! * a fetch is dropped at its next wake-up (a received chunk, a retry's wait, a rate-limit
//!   wait) and at the latest within [`POLL`]; its temp files go with it;
//! * a scan stops at its next read of the layer (a 1 MiB window);
//! * a derived (`districts` / `overlays`) run stops before its next stretch of the base and
//!   before its commit (`Engine::stopped` in `derived.rs`);
//! * a commit that has begun finishes: it is one transaction, and the stop waits for it.
//!
//! The run ends with [`crate::ingest::IngestError::Stopped`] and is recorded as failed with
//! that reason, so `/v1/runs` and the dashboard say why the source has no newer run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a waiting fetch looks at the request.
pub const POLL: Duration = Duration::from_millis(50);

/// Shared by an engine and whoever may stop it (a signal watcher, `serve`'s shutdown).
/// Once requested it stays requested: an engine that is stopping starts no new fetch.
#[derive(Debug, Clone, Default)]
pub struct RunStop(Arc<AtomicBool>);

impl RunStop {
    /// Asks every run of this engine to stop before its commit. Never blocks.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Resolves once a stop is requested (looked at every [`POLL`]).
    pub async fn requested_wait(&self) {
        while !self.requested() {
            tokio::time::sleep(POLL).await;
        }
    }
}

/// A reader that fails once a stop is requested, so a scan reading it stops at its next read.
pub struct StopReader<R> {
    inner: R,
    stop: RunStop,
}

impl<R> StopReader<R> {
    pub fn new(inner: R, stop: &RunStop) -> StopReader<R> {
        StopReader { inner, stop: stop.clone() }
    }
}

impl<R: std::io::Read> std::io::Read for StopReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.stop.requested() {
            return Err(std::io::Error::other(Stopped));
        }
        self.inner.read(buf)
    }
}

/// The error a [`StopReader`] fails with: a run is told stopped by this, never by the flag
/// alone (a scan that failed on its own while a stop was asked is still that failure).
#[derive(Debug)]
struct Stopped;

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped: zonewatch is shutting down")
    }
}

impl std::error::Error for Stopped {}

/// Whether `e` is a [`StopReader`]'s refusal to read on.
pub fn is_stop(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Stopped>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_reader_fails_once_a_stop_is_requested_and_a_waiter_wakes() {
        let stop = RunStop::default();
        let mut r = StopReader::new(&b"abcdef"[..], &stop);
        let mut buf = [0u8; 3];
        assert_eq!(r.read(&mut buf).unwrap(), 3);
        stop.clone().request();
        let err = r.read(&mut buf).unwrap_err();
        assert!(is_stop(&err));
        assert!(!is_stop(&std::io::Error::other("disk full")));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let woke = rt.block_on(async { tokio::time::timeout(POLL * 4, stop.requested_wait()).await.is_ok() });
        assert!(woke);
    }
}
