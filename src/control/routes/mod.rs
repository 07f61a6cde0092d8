//! The control port's routes. Each handler validates its input, does its work (blocking store
//! work on the blocking pool) and answers JSON. Unknown routes are 404, wrong methods 405.
//!
//! This file holds the dispatch (`handle`: authentication, methods, query and body limits),
//! which answers `/`, `/healthz`, `/metrics` and `/v1/openapi.json` itself, paging and the
//! long-request places; the other handlers live by resource: `sources`, `holds`,
//! `subscribers`, `dead_letters`, `audit`, `backup`.

use super::http::{error, json, query_of_route, query_u64, read_body, refuse, text, Refusal, Resp};
use super::{auth, ControlState};
use crate::store::DeadLetterList;
use hyper::{Method, Request, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;

mod audit;
mod backup;
mod dead_letters;
mod holds;
mod sources;
mod subscribers;

pub use backup::FileIdentity;
use audit::recent_changes;
use sources::{list_runs, list_sources, quarantine_list, run_source, watermarks};
use holds::{held_changes, list_holds, resolve_hold};
use subscribers::{delete_subscriber, enable_endpoint, get_subscriber, list_endpoints, list_subscribers, put_subscriber};
use dead_letters::{dead_letter_list, release_quarantined, replay_dead_letters};

const DASHBOARD: &str = include_str!("../dashboard.html");

/// Entry point for every request.
pub async fn handle(state: Arc<ControlState>, req: Request<hyper::body::Incoming>) -> Resp {
    // A Content-Length above 0, or chunked: answers given before it is read say so.
    let has_body = !hyper::body::Body::is_end_stream(req.body());
    // A HEAD is answered as its GET is, and hyper leaves the body out (an uptime checker may
    // probe `/healthz` so; it was 405).
    let method = if req.method() == Method::HEAD { Method::GET } else { req.method().clone() };
    let path = req.uri().path().to_string();
    let segments: Vec<String> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).map(crate::control::http::path_segment).collect();
    let seg: Vec<&str> = segments.iter().map(String::as_str).collect();

    // Known path, unsupported method → 405 with `Allow`; unknown path → 404.
    match allowed_methods(&seg) {
        None => return before_body(has_body, error(StatusCode::NOT_FOUND, "not_found", format!("no route {path}"))),
        Some(allow) if !allow.split(", ").any(|m| m == method.as_str()) => {
            let allow = if allow.starts_with("GET") { allow.replacen("GET", "GET, HEAD", 1) } else { allow.to_string() };
            let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("{} is not allowed on {path}; allowed: {allow}", req.method()));
            if let Ok(v) = hyper::header::HeaderValue::from_str(&allow) {
                r.headers_mut().insert(hyper::header::ALLOW, v);
            }
            return before_body(has_body, r);
        }
        Some(_) => {}
    }

    // Public: liveness and the dashboard shell (static HTML holding no data; its script asks
    // the API with the token the operator gives it, kept in the URL fragment, never sent).
    match (&method, seg.as_slice()) {
        (&Method::GET, ["healthz"]) => {
            let uptime_s = state.started.elapsed().as_secs();
            return before_body(has_body, json(StatusCode::OK, &json!({"status": "ok", "version": env!("CARGO_PKG_VERSION"), "uptime_s": uptime_s})));
        }
        (&Method::GET, []) => return before_body(has_body, text(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD)),
        _ => {}
    }
    let authz = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if !auth::authorized(&state.token, authz) {
        let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token from control.token_file>)");
        r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
        return before_body(has_body, r);
    }
    // A compressed body is not read: refused as such, where it was "invalid JSON" (bb25).
    if let Some(encoding) = req.headers().get(hyper::header::CONTENT_ENCODING).filter(|v| has_body && !v.as_bytes().eq_ignore_ascii_case(b"identity")) {
        let shown = String::from_utf8_lossy(encoding.as_bytes()).chars().take(40).collect::<String>();
        return before_body(has_body, error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_encoding", format!("Content-Encoding {shown:?} is not read: send the body uncompressed")));
    }
    let q = match query_of_route(req.uri().query(), &path, accepted_query(&method, &seg)) {
        Ok(q) => q,
        Err(r) => return before_body(has_body, *r),
    };
    let limit = state.engine.config.control.max_body_bytes;
    let expects_continue = req.headers().get(hyper::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let body = match read_body(req.into_body(), limit, state.engine.config.control.body_timeout, expects_continue).await {
        Ok(b) => b,
        // Too slow, too large (drained, or past the drain cap / waiting for `100 Continue`
        // unread), or broken: the connection is closed after the answer.
        Err(r) => return before_body(true, r),
    };
    // A body where none is read is refused, as a query parameter is: ignored, it answered
    // another question than the one asked (`{"reprocess": true}` to a source's run ran a
    // plain pass: an integrator, bb25). Empty, `{}` or `null` is no body.
    // (Parsed only on those routes: a subscriber's body of up to 1 MiB is parsed by its handler.)
    let no_body = || body.trim_ascii().is_empty() || serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_null() || v.as_object().is_some_and(|m| m.is_empty()));
    if method == Method::POST && takes_no_body(&seg) && !no_body() {
        return error(StatusCode::BAD_REQUEST, "unexpected_body", format!("POST {path} takes no body ({} byte{} sent): nothing in it would be read", body.len(), if body.len() == 1 { "" } else { "s" }));
    }
    let st = state.clone();
    let result = match (&method, seg.as_slice()) {
        (&Method::GET, ["metrics"]) => blocking(move || match super::metrics::render(&st.engine) {
            Ok(t) => text(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", t),
            Err(e) => internal(e),
        })
        .await,
        (&Method::GET, ["v1", "openapi.json"]) => json(StatusCode::OK, &super::openapi::document()),
        (&Method::GET, ["v1", "sources"]) => blocking(move || list_sources(&st)).await,
        (&Method::POST, ["v1", "sources", id, "run"]) => run_source(state.clone(), id.to_string()).await,
        (&Method::GET, ["v1", "sources", id, "watermarks"]) => {
            let id = id.to_string();
            blocking(move || watermarks(&st, &id)).await
        }
        (&Method::GET, ["v1", "runs"]) => blocking(move || list_runs(&st, &q)).await,
        (&Method::GET, ["v1", "holds"]) => blocking(move || list_holds(&st, &q)).await,
        (&Method::GET, ["v1", "holds", run, "changes"]) => match run.parse::<u64>() {
            Ok(id) => blocking(move || held_changes(&st, id, &q)).await,
            Err(_) => error(StatusCode::BAD_REQUEST, "bad_path", format!("hold id must be a run id (integer), got {run:?}")),
        },
        (&Method::POST, ["v1", "holds", run, action @ ("release" | "prime")]) => {
            let prime = *action == "prime";
            match run.parse::<u64>() {
                Ok(id) => resolve_hold(state.clone(), id, prime).await,
                Err(_) => error(StatusCode::BAD_REQUEST, "bad_path", format!("hold id must be a run id (integer), got {run:?}")),
            }
        }
        (&Method::GET, ["v1", "subscribers"]) => blocking(move || list_subscribers(&st, &q)).await,
        (&Method::POST, ["v1", "subscribers"]) => blocking(move || put_subscriber(&st, None, &body)).await,
        (&Method::GET, ["v1", "subscribers", id]) => {
            let id = id.to_string();
            blocking(move || get_subscriber(&st, &id)).await
        }
        (&Method::PUT, ["v1", "subscribers", id]) => {
            let id = id.to_string();
            blocking(move || put_subscriber(&st, Some(id), &body)).await
        }
        (&Method::DELETE, ["v1", "subscribers", id]) => {
            let id = id.to_string();
            blocking(move || delete_subscriber(&st, &id)).await
        }
        (&Method::GET, ["v1", "endpoints"]) => blocking(move || list_endpoints(&st)).await,
        (&Method::POST, ["v1", "endpoints", id, "enable"]) => {
            let id = id.to_string();
            let r = blocking(move || enable_endpoint(&st, &id)).await;
            state.wake.notify_one();
            r
        }
        (&Method::GET, ["v1", "audit"]) => blocking(move || audit::audit(&st, &q)).await,
        (&Method::GET, ["v1", "changes", "recent"]) => blocking(move || recent_changes(&st, &q)).await,
        (&Method::GET, ["v1", "deadletters"]) => blocking(move || dead_letter_list(&st, DeadLetterList::Waiting, &q)).await,
        (&Method::GET, ["v1", "quarantine"]) => blocking(move || quarantine_list(&st, &q)).await,
        (&Method::POST, ["v1", "backup"]) => blocking_long(&state, move || backup::backup(&st, &body)).await,
        (&Method::GET, ["v1", "deadletters", "quarantined"]) => blocking(move || dead_letter_list(&st, DeadLetterList::Quarantined, &q)).await,
        (&Method::POST, ["v1", "deadletters", "release"]) => blocking(move || release_quarantined(&st, &body)).await,
        (&Method::POST, ["v1", "deadletters", "replay"]) => {
            let r = blocking_long(&state, move || replay_dead_letters(&st, &body)).await;
            state.wake.notify_one();
            r
        }
        _ => error(StatusCode::NOT_FOUND, "not_found", format!("no route {path}")),
    };
    result
}

/// An answer given before the request's body was read to its end (no such route, a wrong
/// method, no token, a body refused as it arrived) says `Connection: close`. Hyper reads no
/// further into a body its handler left: unless the rest is already in its buffer, it closes
/// the connection after the answer. Unannounced, that close let a keep-alive client pool the
/// connection and fail its next request on it ("connection closed before message
/// completed", seen with reqwest after a 401 to a 200 kB body); announced, the client opens
/// a new one.
fn before_body(has_body: bool, mut r: Resp) -> Resp {
    if has_body {
        r.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    }
    r
}

/// The `POST` routes that read no body.
fn takes_no_body(seg: &[&str]) -> bool {
    matches!(seg, ["v1", "sources", _, "run"] | ["v1", "holds", _, "release" | "prime"] | ["v1", "endpoints", _, "enable"])
}

/// The methods a known path accepts (None: no such route).
fn allowed_methods(seg: &[&str]) -> Option<&'static str> {
    Some(match seg {
        [] | ["healthz"] | ["metrics"] => "GET",
        ["v1", "openapi.json"] | ["v1", "sources"] | ["v1", "runs"] | ["v1", "holds"] | ["v1", "audit"] => "GET",
        ["v1", "deadletters"] | ["v1", "quarantine"] | ["v1", "changes", "recent"] | ["v1", "sources", _, "watermarks"] => "GET",
        ["v1", "sources", _, "run"] | ["v1", "holds", _, "release" | "prime"] | ["v1", "backup"] => "POST",
        ["v1", "holds", _, "changes"] => "GET",
        ["v1", "deadletters", "replay" | "release"] | ["v1", "endpoints", _, "enable"] => "POST",
        ["v1", "deadletters", "quarantined"] => "GET",
        ["v1", "endpoints"] => "GET",
        ["v1", "subscribers"] => "GET, POST",
        ["v1", "subscribers", _] => "GET, PUT, DELETE",
        _ => return None,
    })
}

/// The query parameters each route's `GET` reads (no other method reads one); any other is
/// refused (`http::query_of_route`).
/// The OpenAPI document lists the same (a test holds the two equal).
pub(super) fn accepted_query(method: &Method, seg: &[&str]) -> &'static [&'static str] {
    if method != Method::GET {
        return &[];
    }
    match seg {
        ["v1", "runs"] => &["source", "limit", "cursor"],
        ["v1", "holds"] => &["state", "limit"],
        ["v1", "audit"] => &["parcel", "watcher", "source", "key", "lineage", "since", "order", "outcome", "limit", "cursor"],
        ["v1", "changes", "recent"] => &["limit"],
        ["v1", "deadletters"] | ["v1", "deadletters", "quarantined"] | ["v1", "quarantine"] | ["v1", "holds", _, "changes"] | ["v1", "subscribers"] => &["limit", "cursor"],
        _ => &[],
    }
}

async fn blocking<F: FnOnce() -> Resp + Send + 'static>(f: F) -> Resp {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("handler failed: {e}")),
    }
}

/// [`blocking`] holding one of the long-request places ([`LongRequest`]) while `f` runs, or
/// `429 busy` at once when every place is taken.
async fn blocking_long<F: FnOnce() -> Resp + Send + 'static>(st: &Arc<ControlState>, f: F) -> Resp {
    let place = match LongRequest::take(st) {
        Ok(p) => p,
        Err(busy) => return *busy,
    };
    blocking(move || {
        let _place = place;
        f()
    })
    .await
}

fn internal(e: impl std::fmt::Display) -> Resp {
    tracing::error!("control port: {e}");
    error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

/// A page's `limit` (`default` without one) and `cursor` (the key its page comes after).
fn page_of(q: &std::collections::HashMap<String, String>, default: usize) -> Result<(usize, Option<u64>), Refusal> {
    Ok((limit_or(q, default)?, query_u64(q, "cursor")?))
}

/// The most rows a page of any list route holds.
const MAX_PAGE: usize = 1000;

/// `limit=N` (1 to [`MAX_PAGE`]), or `default` when there is none.
fn limit_or(q: &std::collections::HashMap<String, String>, default: usize) -> Result<usize, Refusal> {
    match query_u64(q, "limit")? {
        None => Ok(default),
        Some(n) if (1..=MAX_PAGE as u64).contains(&n) => Ok(n as usize),
        Some(n) => Err(refuse(StatusCode::BAD_REQUEST, "bad_query", format!("limit must be between 1 and {MAX_PAGE}, got {n}"))),
    }
}

/// How many requests that can take long may be under way at once: hold releases and primes
/// (waiting for a run of their source, up to [`holds::RELEASE_WAIT`], then committing), source runs
/// (a county's takes minutes), backups (a copy of the whole store each) and dead-letter
/// replays (a commit per dead letter), each on a connection of its own. Without a cap, a
/// script releasing holds in a loop, or running every source now, would fill the control
/// port's [`super::MAX_CONNECTIONS`] and shut out `/healthz` and the operator (a reviewer:
/// only releases were capped). Past it: `429 busy`.
pub const MAX_LONG_REQUESTS: usize = 8;

/// A place among the [`MAX_LONG_REQUESTS`], given back when dropped.
struct LongRequest(Arc<ControlState>);

impl LongRequest {
    /// A place, or the `429 busy` answer when there is none.
    fn take(st: &Arc<ControlState>) -> Result<LongRequest, Refusal> {
        use std::sync::atomic::Ordering::SeqCst;
        if st.long_requests.fetch_update(SeqCst, SeqCst, |n| (n < MAX_LONG_REQUESTS).then_some(n + 1)).is_ok() {
            return Ok(LongRequest(st.clone()));
        }
        let mut r = error(
            StatusCode::TOO_MANY_REQUESTS,
            "busy",
            format!("{MAX_LONG_REQUESTS} long requests (hold releases or primes, source runs, backups, replays) are already under way; try again in a few seconds"),
        );
        r.headers_mut().insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from_static("5"));
        Err(Box::new(r))
    }
}

impl Drop for LongRequest {
    fn drop(&mut self) {
        self.0.long_requests.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
