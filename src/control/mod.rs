//! `control/`: the operator's HTTP port, served by `zonewatch serve`.
//!
//! * [`auth`] — the bearer token (file-backed, constant-time comparison);
//! * [`http`] — request/response plumbing: size-limited bodies, JSON errors, query strings;
//! * [`routes`] — the `/v1` API, `/healthz`, `/metrics` and the dashboard at `/`;
//! * [`metrics`] — Prometheus text exposition (the delivery latency histogram it reports is
//!   kept by `crate::telemetry`);
//! * [`openapi`] — the OpenAPI 3 document served at `/v1/openapi.json`.
//!
//! Every handler returns a response; none panics on input, and a request body never reaches a
//! handler unread or unbounded.

pub mod auth;
pub mod http;
pub mod metrics;
pub mod openapi;
pub mod routes;

use crate::pipeline::Engine;
use crate::schedule::SourceRuns;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// Everything a handler may touch.
pub struct ControlState {
    pub engine: Arc<Engine>,
    pub token: String,
    pub runs: Arc<SourceRuns>,
    /// Wakes the delivery loop after something was queued.
    pub wake: Arc<tokio::sync::Notify>,
    pub started_ms: u64,
}

/// Binds the control port. Port 0 picks a free port; the bound address is returned.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// The most connections served at once. Each costs a file descriptor the process shares
/// with its runs and deliveries: a flood of idle connections (each held up to the 10 s
/// header timeout) would otherwise make every portal fetch and webhook fail with EMFILE.
/// Past it a new connection is closed at once; an operator's next request gets through.
pub const MAX_CONNECTIONS: usize = 64;

/// Serves the control port until `shutdown` flips; then each open connection finishes the
/// request it is serving and closes (no new request is read from a kept-alive one).
pub async fn serve(listener: TcpListener, state: Arc<ControlState>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("control port accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if warned.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(60)) {
                tracing::warn!(%peer, "control port: {MAX_CONNECTIONS} connections open already; closing new ones until some end (said once a minute)");
                warned = Some(std::time::Instant::now());
            }
            drop(stream);
            continue;
        };
        let state = state.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(routes::handle(state, req).await) }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc);
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!("control connection ended: {e}");
            }
        });
    }
}
