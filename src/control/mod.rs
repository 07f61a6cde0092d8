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

/// Serves the control port until `shutdown` flips.
pub async fn serve(listener: TcpListener, state: Arc<ControlState>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("control port accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(routes::handle(state, req).await) }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!("control connection ended: {e}");
            }
        });
    }
}
