//! The HTTP client delivery sends with (its SSRF guard on the addresses it connects to), and
//! how a failed request is read: a kept-alive connection closed under it, or this process
//! short of its own resources (file descriptors, sockets, memory), which is not the target's fault.

use crate::config::DeliveryConfig;
use super::DeliveryError;
use std::time::Duration;

/// The HTTP client webhooks go out with: no redirects followed (a redirect is an answer, not
/// a delivery), the configured timeouts, zonewatch's user agent. `zonewatch bench` measures
/// the bare HTTP exchange with the same client (the reference of the delivery measure).
pub fn http_client(cfg: &DeliveryConfig) -> Result<reqwest::Client, DeliveryError> {
    http_client_with(cfg, crate::netguard::Guard::new(cfg.allow_private_targets))
}

/// [`http_client`] with the SSRF guard already decided.
pub(super) fn http_client_with(cfg: &DeliveryConfig, guard: crate::netguard::Guard) -> Result<reqwest::Client, DeliveryError> {
    guard
        .client(reqwest::Client::builder())
        .redirect(reqwest::redirect::Policy::none())
        .timeout(cfg.timeout)
        .connect_timeout(cfg.timeout.min(Duration::from_secs(10)))
        .user_agent(concat!("zonewatch/", env!("CARGO_PKG_VERSION")))
        .build()
        // reqwest's own words are "builder error"; its sources say why (no file descriptor
        // left to read the system's certificates, a tester's `ulimit -n 12`).
        .map_err(|e| DeliveryError::Client(crate::util::error_chain(&e)))
}

/// Whether a send failed because the connection under it was closed as the request went
/// out: hyper's "connection closed before message completed", or a reset / broken pipe on
/// an established connection. Not a connect error (a fresh connection that failed) and not a
/// timeout (the receiver had the request and took too long).
pub(super) fn closed_under_request(e: &reqwest::Error) -> bool {
    if e.is_timeout() || e.is_connect() {
        return false;
    }
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if inner.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message) {
            return true;
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof) {
                return true;
            }
        }
        src = inner.source();
    }
    false
}

/// The error of a send that never left this machine because this process ran out of a
/// resource of its own: file descriptors (its own limit or the system's), socket buffers or
/// memory; or whose name lookup failed so (the resolver answers `EBUSY` when it cannot make
/// its socket: a tester's `localhost` target under `ulimit -n 20` was charged and
/// dead-lettered). Anything else (refused, reset, unreachable, a name that does not resolve,
/// no route from here to an IPv6 address: `EADDRNOTAVAIL`, which is the target's as much as
/// ours, reviewer) is the endpoint's or the network's, and a retry.
pub(super) fn local_failure(e: &(dyn std::error::Error + 'static)) -> Option<std::io::Error> {
    // Linux's numbers (the target this is built and packaged for): EMFILE, ENFILE, ENOBUFS,
    // ENOMEM, EBUSY.
    const LOCAL: [i32; 5] = [24, 23, 105, 12, 16];
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            if let Some(code) = io.raw_os_error().filter(|c| cfg!(target_os = "linux") && LOCAL.contains(c)) {
                return Some(std::io::Error::from_raw_os_error(code));
            }
        }
        src = inner.source();
    }
    None
}

/// How long a shortage of this process's own resources lasts past its last deferred send, and
/// the longest a deferred send waits before it is tried again (`send.rs`'s `LOCAL_FAILURE_PAUSE`
/// is the shortest).
pub(super) const LOCAL_FAILURE_PAUSE_MAX: Duration = Duration::from_secs(60);

/// A shortage of this process's own resources, timed from its first deferred send: it ends
/// after [`LOCAL_FAILURE_PAUSE_MAX`] without a deferred send. Not by an answered send (reviewer:
/// under a limit that lets some sends through, each answer started the timing anew and the
/// pause never grew).
#[derive(Debug, Default)]
pub(super) struct LocalShortage {
    /// When it began (0: none yet) and its last deferred send.
    since_ms: std::sync::atomic::AtomicU64,
    last_ms: std::sync::atomic::AtomicU64,
}

impl LocalShortage {
    /// Notes a deferred send at `now` and returns how long the shortage has lasted (ms).
    pub(super) fn lasted(&self, now: u64) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let last = self.last_ms.swap(now, Relaxed);
        let since = self.since_ms.load(Relaxed);
        if since == 0 || now.saturating_sub(last) > LOCAL_FAILURE_PAUSE_MAX.as_millis() as u64 {
            self.since_ms.store(now, Relaxed);
            return 0;
        }
        now.saturating_sub(since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shortage of this process's own resources is timed from its first deferred send; a
    /// minute without a deferred send ends it.
    #[test]
    fn a_local_shortage_is_timed_from_its_first_deferral() {
        let shortage = LocalShortage::default();
        assert_eq!(shortage.lasted(1_000), 0);
        assert_eq!(shortage.lasted(11_000), 10_000);
        assert_eq!(shortage.lasted(40_000), 39_000);
        assert_eq!(shortage.lasted(100_000), 99_000, "within a minute of the last deferral");
        assert_eq!(shortage.lasted(200_000), 0, "a minute without a deferral starts anew");
        assert_eq!(shortage.lasted(200_500), 500);
    }
}
