//! The control port's routes. Each handler validates its input, does its work (blocking store
//! work on the blocking pool) and answers JSON. Unknown routes are 404, wrong methods 405.

use super::http::{error, json, parse_json, parse_optional_json, query_of_route, query_u64, read_body, refuse, text, Refusal, Resp};
use super::{auth, ControlState};
use crate::cli::audit_json;
use crate::model::*;
use crate::pipeline::{PipelineError, RunOptions};
use crate::store::{AuditFilter, DeadLetterList, StoredSubscriber};
use crate::util::rfc3339;
use hyper::{Method, Request, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

const DASHBOARD: &str = include_str!("dashboard.html");

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
        (&Method::GET, ["v1", "audit"]) => blocking(move || audit(&st, &q)).await,
        (&Method::GET, ["v1", "changes", "recent"]) => blocking(move || recent_changes(&st, &q)).await,
        (&Method::GET, ["v1", "deadletters"]) => blocking(move || dead_letter_list(&st, DeadLetterList::Waiting, &q)).await,
        (&Method::GET, ["v1", "quarantine"]) => blocking(move || quarantine_list(&st, &q)).await,
        (&Method::POST, ["v1", "backup"]) => match LongRequest::take(&state) {
            Ok(place) => {
                blocking(move || {
                    let _place = place;
                    backup(&st, &body)
                })
                .await
            }
            Err(busy) => *busy,
        },
        (&Method::GET, ["v1", "deadletters", "quarantined"]) => blocking(move || dead_letter_list(&st, DeadLetterList::Quarantined, &q)).await,
        (&Method::POST, ["v1", "deadletters", "release"]) => blocking(move || release_quarantined(&st, &body)).await,
        (&Method::POST, ["v1", "deadletters", "replay"]) => {
            let place = match LongRequest::take(&state) {
                Ok(p) => p,
                Err(busy) => return *busy,
            };
            let r = blocking(move || {
                let _place = place;
                replay_dead_letters(&st, &body)
            })
            .await;
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

fn internal(e: impl std::fmt::Display) -> Resp {
    tracing::error!("control port: {e}");
    error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

fn verdict_str(v: Verdict) -> &'static str {
    v.as_str()
}

pub fn run_json(r: &RunRecord) -> Value {
    json!({
        "run_id": r.run_id, "source_id": r.source_id, "lineage_id": r.lineage_id,
        "started": rfc3339(r.started_ms), "finished": rfc3339(r.finished_ms),
        "verdict": verdict_str(r.verdict), "digest": r.digest,
        "features": r.counts.features, "parcels": r.counts.parcels, "quarantined": r.counts.quarantined,
        "repaired": r.counts.repaired, "changes": r.counts.changes, "queued": r.counts.queued,
        "duplicates": r.counts.duplicates, "suppressed": r.counts.suppressed,
        "below_min_severity": r.counts.below_min_severity,
        "hold_id": r.hold_id, "warnings": r.warnings, "error": r.error,
    })
}

pub fn hold_json(h: &Hold) -> Value {
    let resolved = match &h.state {
        HoldState::Open => Value::Null,
        HoldState::Released { at_ms, run_id } | HoldState::Primed { at_ms, run_id } => json!({"at": rfc3339(*at_ms), "run_id": run_id}),
        HoldState::Superseded { at_ms, by_run } => json!({"at": rfc3339(*at_ms), "run_id": by_run}),
    };
    json!({
        "run_id": h.run_id, "source_id": h.source_id, "lineage_id": h.lineage_id, "created": rfc3339(h.created_ms),
        "reason": h.reason, "state": h.state.label(), "resolved": resolved, "digest": h.digest,
        "changes": h.changes, "features": h.features, "reprocess": h.reprocess,
    })
}

fn watermark_json(w: &Watermark) -> Value {
    json!({
        "run_id": w.run_id, "digest": w.digest, "size": w.size, "consumed_at": rfc3339(w.consumed_at_ms),
        "content_changed_at": rfc3339(w.content_changed_at_ms),
        "publisher_ts": w.publisher_ts_ms.map(rfc3339), "etag": w.etag, "last_modified": w.last_modified,
        // The timestamp the portal reports now, when it went back behind `publisher_ts` with
        // the same content (the probe compares against it).
        "probe_ts": w.probe_ts_ms.map(rfc3339),
    })
}

/// `{"items": [...], "next_cursor": ...}`: a page of dead letters (or quarantined ones) in id
/// order, `limit` of them (at most and by default 1,000) after the id `cursor`. A receiver
/// down for a day can leave hundreds of thousands, each with its payload: the whole list in
/// one answer was built in memory by a daemon meant to idle in 50 MiB.
fn dead_letter_list(st: &ControlState, list: DeadLetterList, q: &std::collections::HashMap<String, String>) -> Resp {
    let (limit, cursor) = match page_of(q, MAX_PAGE) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    match st.engine.store.dead_letters_page(list, cursor, limit) {
        Ok(d) => {
            let next = if d.len() == limit { d.last().map(|d| d.entry.id.to_string()) } else { None };
            json(StatusCode::OK, &json!({"items": d.iter().map(dead_letter_json).collect::<Vec<_>>(), "next_cursor": next}))
        }
        Err(e) => internal(e),
    }
}

fn dead_letter_json(d: &DeadLetter) -> Value {
    json!({
        "id": d.entry.id, "idempotency_key": d.entry.key.0, "watcher_id": d.entry.watcher_id, "target": crate::util::url_for_display(&d.entry.target),
        "source_id": d.entry.source_id, "parcel_id": d.entry.parcel_id, "lineage_id": d.entry.lineage_id,
        "severity": d.entry.severity.as_str(), "attempts": d.entry.attempts, "reason": d.reason,
        "dead_at": rfc3339(d.dead_at_ms), "last_error": d.entry.last_error,
    })
}

/// `GET /v1/holds/{run}/changes`: what an open hold would send, a page at a time (`limit`, 100
/// by default; `cursor`): each held change with the subscribers it would go to now (their
/// AOI touches it and its severity reaches their `min_severity`) and those it touches below
/// their `min_severity`. Matched when asked, against the subscribers of the moment, as a
/// release matches them. Before it, an operator chose between release and prime knowing
/// only how many changes there were (found by a black-box tester playing an operator).
fn held_changes(st: &ControlState, hold_id: u64, q: &std::collections::HashMap<String, String>) -> Resp {
    let (limit, cursor) = match page_of(q, 100) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let hold = match st.engine.store.hold(hold_id) {
        Ok(Some(h)) => h,
        Ok(None) => return error(StatusCode::NOT_FOUND, "unknown_hold", format!("no hold {hold_id}")),
        Err(e) => return internal(e),
    };
    let page = match st.engine.store.held_changes_page(hold_id, cursor, limit) {
        Ok(p) => p,
        Err(e) => return internal(e),
    };
    let (numbers, events): (Vec<u64>, Vec<ChangeEvent>) = page.into_iter().unzip();
    let matched = st.engine.subscribers.match_batch(&events);
    let items: Vec<Value> = numbers
        .iter()
        .zip(&events)
        .zip(matched)
        .map(|((n, e), subs)| {
            let (to, below): (Vec<_>, Vec<_>) = subs.iter().partition(|s| e.severity >= s.min_severity);
            json!({
                "n": n, "parcel_id": e.parcel_id, "kind": e.kind.as_str(), "from": e.from, "to": e.to,
                "effective_date": e.effective_date, "severity": e.severity.as_str(), "area_m2": e.area_m2,
                "observed_at": rfc3339(e.observed_at_ms),
                "subscribers": to.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
                "below_min_severity": below.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            })
        })
        .collect();
    let next = if items.len() == limit { numbers.last().map(|n| n.to_string()) } else { None };
    // As `Engine::resolve_hold` decides: a held first ingest or `--reprocess` is primed by a
    // release, which sends nothing.
    let release_sends = match st.engine.store.watermark(&hold.source_id) {
        Ok(w) => w.is_some() && !hold.reprocess,
        Err(e) => return internal(e),
    };
    json(StatusCode::OK, &json!({"hold": hold_json(&hold), "release_sends": release_sends, "items": items, "next_cursor": next}))
}

/// `{"items": [...], "next_cursor": ...}`: a page of quarantined features, oldest first,
/// `limit` of them (100 by default, at most 1,000) after the row `cursor`. Each keeps up to
/// 16 KiB of the feature's text, and one run of a county whose `parcel_id` was mistyped
/// quarantines most of it: the whole table was built into one answer before.
fn quarantine_list(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let (limit, cursor) = match page_of(q, 100) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    match st.engine.store.quarantine_page(cursor, limit) {
        Ok(rows) => {
            let next = if rows.len() == limit { rows.last().map(|(k, _)| k.to_string()) } else { None };
            json(StatusCode::OK, &json!({"items": rows.iter().map(|(k, r)| quarantine_json(*k, r)).collect::<Vec<_>>(), "next_cursor": next}))
        }
        Err(e) => internal(e),
    }
}

fn quarantine_json(row: u64, q: &QuarantineRecord) -> Value {
    json!({
        "id": row, "source_id": q.source_id, "run_id": q.run_id, "lineage_id": q.lineage_id, "feature_index": q.feature_index,
        "parcel_id": q.parcel_id, "reason": q.reason.as_str(), "detail": q.detail, "raw": q.raw, "ts": rfc3339(q.ts_ms),
    })
}

/// `GET /v1/holds`: every hold, oldest first, or (`state=open,superseded`, `limit=N`) the
/// newest `N` of those states, still oldest first. A source whose layer changes at every poll
/// while it is held supersedes a hold per poll (a soak tester's had 62 in 2.5 minutes, the
/// dashboard polling them all every 5 s): the dashboard asks for the open ones and the latest
/// resolved ones.
fn list_holds(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let states: Option<Vec<&str>> = match q.get("state").filter(|s| !s.is_empty()) {
        None => None,
        Some(list) => {
            let names: Vec<&str> = list.split(',').map(str::trim).collect();
            if let Some(bad) = names.iter().find(|n| !HoldState::LABELS.contains(n)) {
                return error(StatusCode::BAD_REQUEST, "bad_query", format!("state {bad:?} is not one of {}", HoldState::LABELS.join(", ")));
            }
            Some(names)
        }
    };
    // Without a limit, every hold of those states (the answer it always gave).
    let limit = match limit_or(q, usize::MAX) {
        Ok(l) => l,
        Err(r) => return *r,
    };
    // The open ones alone (what the dashboard asks for at every poll) through their index.
    let holds = if states.as_deref() == Some(&["open"][..]) {
        st.engine.store.open_holds(None).map(|mut open| open.split_off(open.len().saturating_sub(limit)))
    } else {
        st.engine.store.newest_holds(|h| states.as_ref().is_none_or(|s| s.contains(&h.state.label())), limit)
    };
    match holds {
        Ok(holds) => json(StatusCode::OK, &json!({"items": holds.iter().map(hold_json).collect::<Vec<_>>()})),
        Err(e) => internal(e),
    }
}

fn list_sources(st: &ControlState) -> Resp {
    let now = st.engine.now();
    let mut items = Vec::new();
    let holds = match st.engine.store.open_holds(None) {
        Ok(h) => h,
        Err(e) => return internal(e),
    };
    for src in &st.engine.config.sources {
        let last = match st.engine.store.last_run(&src.id) {
            Ok(r) => r,
            Err(e) => return internal(e),
        };
        let wm = match st.engine.store.watermark(&src.id) {
            Ok(w) => w,
            Err(e) => return internal(e),
        };
        let open_holds = holds.iter().filter(|h| h.source_id == src.id).count();
        items.push(json!({
            "id": src.id, "jurisdiction": src.jurisdiction, "every_s": src.every.as_secs(),
            "last_verdict": last.as_ref().map(|r| r.verdict.as_str()),
            "last_run_id": last.as_ref().map(|r| r.run_id),
            "last_run": last.as_ref().map(|r| rfc3339(r.finished_ms)),
            "age_s": last.as_ref().map(|r| now.saturating_sub(r.finished_ms) / 1000),
            "last_change": wm.as_ref().map(|w| rfc3339(w.content_changed_at_ms)),
            "next_run": st.runs.next_run(&src.id).map(rfc3339),
            "running": crate::ingest::staging::is_leased(st.engine.store.path(), &src.id),
            "open_holds": open_holds,
        }));
    }
    json(StatusCode::OK, &json!({"items": items}))
}

async fn run_source(st: Arc<ControlState>, id: String) -> Resp {
    if st.engine.config.source(&id).is_none() {
        return error(StatusCode::NOT_FOUND, "unknown_source", format!("no source {id:?}"));
    }
    let place = match LongRequest::take(&st) {
        Ok(p) => p,
        Err(busy) => return *busy,
    };
    let st2 = st.clone();
    let r = blocking(move || {
        let _place = place;
        match st2.engine.run_source_id(&id, RunOptions::default()) {
            Ok(report) if report.record.verdict == Verdict::SkippedOverlap => {
                json(StatusCode::CONFLICT, &json!({"status": "skipped_overlap", "source_id": id, "message": "a run of this source is in progress"}))
            }
            Ok(report) => json(StatusCode::OK, &json!({"status": "done", "run": run_json(&report.record), "hold_reason": report.hold_reason})),
            // The daemon is stopping: the run was left for the next start, not failed.
            Err(e) if e.is_stopped() => error(StatusCode::SERVICE_UNAVAILABLE, "stopping", e.to_string()),
            Err(e) => error(StatusCode::UNPROCESSABLE_ENTITY, "run_failed", e.to_string()),
        }
    })
    .await;
    st.wake.notify_one();
    r
}

fn watermarks(st: &ControlState, id: &str) -> Resp {
    if st.engine.config.source(id).is_none() {
        return error(StatusCode::NOT_FOUND, "unknown_source", format!("no source {id:?}"));
    }
    match st.engine.store.watermark_history(id) {
        Ok(h) => json(StatusCode::OK, &json!({"source_id": id, "items": h.iter().map(watermark_json).collect::<Vec<_>>()})),
        Err(e) => internal(e),
    }
}

/// A page's `limit` (`default` without one) and `cursor` (the key its page comes after).
fn page_of(q: &std::collections::HashMap<String, String>, default: usize) -> Result<(usize, Option<u64>), Refusal> {
    Ok((limit_or(q, default)?, query_u64(q, "cursor")?))
}

fn limit_of(q: &std::collections::HashMap<String, String>) -> Result<usize, Refusal> {
    limit_or(q, 100)
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

fn list_runs(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let (limit, cursor) = match page_of(q, 100) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let source = q.get("source").filter(|s| !s.is_empty()).cloned();
    let page = match st.engine.store.runs_before(source.as_deref(), cursor.unwrap_or(u64::MAX), limit) {
        Ok(r) => r,
        Err(e) => return internal(e),
    };
    // A source the config does not name and no run of which is kept: a typo, said as such
    // (bb25: it read as a source that never ran). A source removed from the config keeps its
    // runs listed.
    if let Some(id) = source.as_deref().filter(|id| page.is_empty() && cursor.is_none() && st.engine.config.source(id).is_none()) {
        return error(StatusCode::NOT_FOUND, "unknown_source", format!("no source {id:?} in the config, and no run of one kept"));
    }
    let next = if page.len() == limit { page.last().map(|r| r.run_id.to_string()) } else { None };
    json(StatusCode::OK, &json!({"items": page.iter().map(run_json).collect::<Vec<_>>(), "next_cursor": next}))
}

fn audit(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let (limit, cursor) = match page_of(q, 100) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let since_ms = match q.get("since") {
        None => None,
        Some(s) => match crate::util::parse_rfc3339(s) {
            Some(t) => Some(t),
            None => return error(StatusCode::BAD_REQUEST, "bad_query", format!("since must be an RFC 3339 time, got {s:?}")),
        },
    };
    let get = |k: &str| q.get(k).filter(|s| !s.is_empty()).cloned();
    let outcomes = match q.get("outcome").map(|list| crate::model::Outcome::parse_list(list)) {
        None => None,
        Some(Ok(list)) => Some(list),
        Some(Err(bad)) => return error(StatusCode::BAD_REQUEST, "bad_query", bad),
    };
    let filter = AuditFilter {
        outcomes,
        without_baseline_primes: false,
        parcel: get("parcel"),
        watcher: get("watcher"),
        source: get("source"),
        key: get("key"),
        lineage: get("lineage"),
        // Saturating: `?cursor=18446744073709551615` (u64::MAX) wrapped `c + 1` around to 0
        // and listed the ledger from its start again (with overflow checks, a panic and a
        // 500). No row's seq reaches u64::MAX, so from there the page is empty, as it is
        // after any cursor past the last row.
        since_seq: cursor.map(|c| c.saturating_add(1)),
        limit: None,
    };
    let desc = match q.get("order").map(String::as_str) {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(other) => return error(StatusCode::BAD_REQUEST, "bad_query", format!("order must be asc or desc, got {other:?}")),
    };
    let keep = |r: &AuditRow| since_ms.is_none_or(|s| r.ts_ms >= s);
    // Oldest first after the cursor, or newest first below it: read until the page is full.
    let (walk, before) = if desc { (AuditFilter { since_seq: None, ..filter }, cursor) } else { (filter, None) };
    let mut page: Vec<AuditRow> = Vec::with_capacity(limit);
    let walked = st.engine.store.audit_walk(&walk, desc, before, |r| {
        if keep(&r) {
            page.push(r);
        }
        page.len() < limit
    });
    if let Err(e) = walked {
        return internal(e);
    }
    let next = if page.len() == limit { page.last().map(|r| r.seq.to_string()) } else { None };
    json(StatusCode::OK, &json!({"items": page.iter().map(audit_json).collect::<Vec<_>>(), "next_cursor": next}))
}

/// The latest changed parcels (from the ledger) with their current geometry, for the map.
fn recent_changes(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let limit = match limit_of(q) {
        Ok(l) => l,
        Err(r) => return *r,
    };
    // Newest first, until `limit` distinct parcels: the rows of changes are found through
    // the outcome index, past however many rows a baseline primed. At most
    // [`RECENT_ROWS_PER_PARCEL`] rows read per parcel asked for: a store whose few changed
    // parcels each matched a thousand subscribers walked the whole index at every poll of
    // the dashboard (a reviewer); the map then shows the parcels those rows name.
    let mut seen = std::collections::HashSet::new();
    let mut picked: Vec<AuditRow> = Vec::new();
    let mut read = 0usize;
    let changes = AuditFilter { outcomes: Some(vec![Outcome::Queued, Outcome::Sent, Outcome::Suppressed]), without_baseline_primes: true, ..Default::default() };
    let walked = st.engine.store.audit_walk(&changes, true, None, |r| {
        read += 1;
        if let (Some(src), Some(pid)) = (&r.source_id, &r.parcel_id) {
            if seen.insert((src.clone(), pid.clone())) {
                picked.push(r);
            }
        }
        picked.len() < limit && read < limit.saturating_mul(RECENT_ROWS_PER_PARCEL)
    });
    if let Err(e) = walked {
        return internal(e);
    }
    let mut items = Vec::with_capacity(picked.len());
    for r in picked {
        let (src, pid) = (r.source_id.clone().unwrap_or_default(), r.parcel_id.clone().unwrap_or_default());
        let geometry = match st.engine.store.parcel_geometries(&src, [pid.as_str()]) {
            Ok(mut g) => g.remove(&pid).map(|g| g.to_geojson()).unwrap_or(Value::Null),
            Err(e) => return internal(e),
        };
        items.push(json!({"source_id": src, "parcel_id": pid, "ts": rfc3339(r.ts_ms), "outcome": r.outcome.as_str(), "detail": r.detail, "geometry": geometry}));
    }
    json(StatusCode::OK, &json!({"items": items}))
}

/// How many ledger rows `GET /v1/changes/recent` reads per parcel it may list.
const RECENT_ROWS_PER_PARCEL: usize = 20;

/// How long a hold's release or prime waits for a run of its source to end.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// How many requests that can take long may be under way at once: hold releases and primes
/// (waiting for a run of their source, up to [`RELEASE_WAIT`], then committing), source runs
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

async fn resolve_hold(st: Arc<ControlState>, id: u64, prime: bool) -> Resp {
    let place = match LongRequest::take(&st) {
        Ok(p) => p,
        Err(busy) => return *busy,
    };
    let st2 = st.clone();
    let r = blocking(move || {
        let _place = place;
        let source = match st2.engine.store.hold(id) {
            Ok(Some(h)) => h.source_id,
            Ok(None) => return error(StatusCode::NOT_FOUND, "unknown_hold", format!("hold {id} does not exist")),
            Err(e) => return internal(e),
        };
        // A run of the source under way (one polled every few seconds often is) is waited
        // for, up to RELEASE_WAIT; the release then finds the hold as that run left it.
        let Some(_lease) = crate::ingest::staging::lease_within(st2.engine.store.path(), &source, RELEASE_WAIT, &st2.engine.stop) else {
            if st2.engine.stop.requested() {
                return error(StatusCode::SERVICE_UNAVAILABLE, "stopping", format!("zonewatch is stopping; the hold of {source} is left open"));
            }
            return error(
                StatusCode::CONFLICT,
                "source_busy",
                format!("a run of {source} has been in progress for {} s; try again", RELEASE_WAIT.as_secs()),
            );
        };
        match st2.engine.resolve_hold(id, prime) {
            // What the resolution did: a release of a held first ingest or `--reprocess`
            // primes (the run record's warnings say why).
            Ok(rec) => {
                let primed = rec.verdict.primed();
                json(StatusCode::OK, &json!({"status": if primed { "primed" } else { "released" }, "run": run_json(&rec)}))
            }
            Err(PipelineError::UnknownHold(_)) => error(StatusCode::NOT_FOUND, "unknown_hold", format!("hold {id} does not exist")),
            Err(e @ PipelineError::HoldNotOpen { .. }) => error(StatusCode::CONFLICT, "hold_not_open", e.to_string()),
            Err(e) => internal(e),
        }
    })
    .await;
    st.wake.notify_one();
    r
}

/// Body of `POST /v1/subscribers` and `PUT /v1/subscribers/{id}`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct SubscriberBody {
    id: Option<String>,
    target: String,
    /// Left out: a `PUT` keeps the stored secret (no `GET` shows it, so a subscriber read
    /// and sent back would otherwise lose its signing: found by a black-box tester); `null`:
    /// no longer signed.
    #[serde(default, deserialize_with = "present")]
    secret: Option<Option<String>>,
    /// The secret being rotated out (both signatures sent), as `secret_old` in the config;
    /// left out and `null` as for `secret`.
    #[serde(default, deserialize_with = "present")]
    secret_old: Option<Option<String>>,
    min_severity: Option<String>,
    aoi: Value,
}

/// A member that is there, `null` or not: `Some(None)` for `null` (with `#[serde(default)]`,
/// a member left out is `None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// `secrets`: (the secret, the `secret_old` beside it). `rotating` says whether both sign: a
/// `secret_old` that is the secret written another way does not (a tester saw `true` for one).
fn subscriber_json(id: &str, target: &str, secrets: (Option<&str>, Option<&str>), min_severity: Severity, aoi: Value, managed_by: &str) -> Value {
    let (signed, rotating) = (secrets.0.is_some(), crate::notify::signing::rotating(secrets.0, secrets.1));
    json!({"id": id, "target": crate::util::url_for_display(target), "signed": signed, "rotating": rotating, "min_severity": min_severity.as_str(), "aoi": aoi, "managed_by": managed_by})
}

/// `GET /v1/subscribers`: a page of subscribers, the config's and those managed over the
/// control port together, in id order after the id `cursor` (`limit`, 1,000 by default and
/// at most). Each comes with its AOI, so a few thousand of them made one answer of many
/// megabytes, read in one go, before there were pages.
fn list_subscribers(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
    let limit = match limit_or(q, MAX_PAGE) {
        Ok(l) => l,
        Err(r) => return *r,
    };
    let after = q.get("cursor").map(String::as_str);
    let beyond = |id: &str| after.is_none_or(|a| id > a);
    let mut from_config: Vec<_> = st.engine.config.subscribers.iter().filter(|c| beyond(&c.id)).collect();
    from_config.sort_by(|a, b| a.id.cmp(&b.id));
    from_config.truncate(limit + 1);
    let stored = match st.engine.store.stored_subscribers_page(after, limit + 1, |id| st.engine.config.has_subscriber(id)) {
        Ok(list) => list,
        Err(e) => return internal(e),
    };
    // Merge the two id-ordered lists; one more than a page says whether another follows.
    let (mut config_rows, mut stored_rows) = (from_config.into_iter().peekable(), stored.into_iter().peekable());
    let mut items = Vec::new();
    let mut last_id = None;
    while items.len() < limit {
        let take_config = match (config_rows.peek(), stored_rows.peek()) {
            (Some(c), Some(s)) => c.id < s.id,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        if take_config {
            let Some(c) = config_rows.next() else { break };
            let aoi = st.engine.subscribers.get(&c.id).map(|s| crate::model::StoredGeometry::from_geo(&s.aoi).to_geojson()).unwrap_or(Value::Null);
            items.push(subscriber_json(&c.id, &c.target, (c.secret.as_deref(), c.secret_old.as_deref()), c.min_severity, aoi, "config"));
            last_id = Some(c.id.clone());
        } else {
            let Some(s) = stored_rows.next() else { break };
            let aoi = serde_json::from_str(&s.aoi_geojson).unwrap_or(Value::Null);
            items.push(subscriber_json(&s.id, &s.target, (s.secret.as_deref(), s.secret_old.as_deref()), s.min_severity, aoi, "api"));
            last_id = Some(s.id);
        }
    }
    let more = config_rows.peek().is_some() || stored_rows.peek().is_some();
    json(StatusCode::OK, &json!({"items": items, "next_cursor": if more { last_id } else { None }}))
}

fn get_subscriber(st: &ControlState, id: &str) -> Resp {
    if let Some(c) = st.engine.config.subscribers.iter().find(|c| c.id == id) {
        let aoi = st.engine.subscribers.get(id).map(|s| crate::model::StoredGeometry::from_geo(&s.aoi).to_geojson()).unwrap_or(Value::Null);
        return json(StatusCode::OK, &subscriber_json(&c.id, &c.target, (c.secret.as_deref(), c.secret_old.as_deref()), c.min_severity, aoi, "config"));
    }
    match st.engine.store.stored_subscriber(id) {
        Ok(found) => match found {
            Some(s) => json(
                StatusCode::OK,
                &subscriber_json(&s.id, &s.target, (s.secret.as_deref(), s.secret_old.as_deref()), s.min_severity, serde_json::from_str(&s.aoi_geojson).unwrap_or(Value::Null), "api"),
            ),
            None => error(StatusCode::NOT_FOUND, "unknown_subscriber", format!("no subscriber {id:?}")),
        },
        Err(e) => internal(e),
    }
}

fn put_subscriber(st: &ControlState, path_id: Option<String>, body: &[u8]) -> Resp {
    let b: SubscriberBody = match parse_json(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let creating = path_id.is_none();
    let id = match (&path_id, &b.id) {
        (Some(p), Some(i)) if p != i => return error(StatusCode::BAD_REQUEST, "id_mismatch", format!("body id {i:?} differs from path id {p:?}")),
        (Some(p), _) => p.clone(),
        (None, Some(i)) => i.clone(),
        (None, None) => return error(StatusCode::BAD_REQUEST, "missing_field", "id is required"),
    };
    if !crate::config::valid_id(&id) {
        return error(StatusCode::BAD_REQUEST, "bad_id", format!("id must be {}", crate::config::ID_RULE));
    }
    if st.engine.config.has_subscriber(&id) {
        return error(StatusCode::CONFLICT, "managed_by_config", format!("subscriber {id:?} is defined in the config file; edit it there"));
    }
    match reqwest::Url::parse(&b.target) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => {}
        _ => return error(StatusCode::BAD_REQUEST, "bad_target", format!("target {:?} is not an http(s) URL with a host", b.target)),
    }
    // Refused here as `check` refuses it in the config: every delivery to it would be
    // refused, each event dead-lettered `private_target_refused`.
    if !st.engine.config.delivery.allow_private_targets && crate::netguard::url_written_private(&b.target) {
        return error(
            StatusCode::BAD_REQUEST,
            "private_target",
            format!(
                "target {} is a private address: every delivery would be refused (the config's delivery.allow_private_targets is false)",
                crate::util::url_for_display(&b.target)
            ),
        );
    }
    for (name, given) in [("secret", &b.secret), ("secret_old", &b.secret_old)] {
        if let Some(Some(secret)) = given {
            if let Err(e) = crate::notify::signing::decode_secret(secret) {
                return error(StatusCode::BAD_REQUEST, "bad_secret", format!("{name}: {e}"));
            }
        }
    }
    let min_severity = match &b.min_severity {
        None => Severity::Notice,
        Some(s) => match Severity::parse(s) {
            Some(v) => v,
            None => return error(StatusCode::BAD_REQUEST, "bad_min_severity", format!("min_severity {s:?} is not one of info, notice, material, critical")),
        },
    };
    let aoi_text = b.aoi.to_string();
    // An AOI whose rings are not a valid polygon is stored as written and matched as
    // repaired; the answer says what the repair made of it (a black-box tester's AOI whose
    // hole held its whole ring became the hole less the ring, without a word).
    let (aoi, repair_note) = match crate::notify::aoi::parse_new_aoi_noted(&aoi_text) {
        Ok(parsed) => parsed,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_aoi", format!("aoi: {e}")),
    };
    // From here to the index's swap, no other edit of the subscribers runs.
    let edit = st.engine.edit_subscribers();
    let existing = match edit.stored(&id) {
        Ok(found) => found,
        Err(e) => return internal(e),
    };
    if creating && existing.is_some() {
        return error(StatusCode::CONFLICT, "exists", format!("subscriber {id:?} exists; use PUT /v1/subscribers/{id}"));
    }
    // A target sent back as a listing shows it, its password as `***` (a GET, an edit of
    // another member, a PUT), keeps the stored password; it replaced it with `***`, and every
    // delivery was refused by its receiver (an integrator, bb25). Another URL with `***` for
    // a password is refused: the real one cannot be known.
    // Compared as listed: the password written `***` (or escaped, `%2A%2A%2A`).
    let as_listed = reqwest::Url::parse(&b.target).ok().filter(|u| u.password().is_some_and(|p| p == "***" || p.eq_ignore_ascii_case("%2A%2A%2A"))).map(|mut u| {
        let _ = u.set_password(Some("***"));
        u.to_string()
    });
    let shows_masked_password = as_listed.is_some();
    let target = match existing.as_ref() {
        Some(e) if as_listed.as_deref().is_some_and(|l| crate::util::url_for_display(&e.target) == l) => e.target.clone(),
        _ if shows_masked_password => {
            return error(
                StatusCode::BAD_REQUEST,
                "masked_password",
                "target: its password is `***`, as listings show a password; send the real one (a PUT of the target exactly as listed keeps the stored password)",
            )
        }
        _ => b.target.clone(),
    };
    // Left out: as stored. Stored trimmed, as it signs (a secret with a trailing space and
    // the same one without read as two, and both signatures went out: a black-box tester).
    let kept = |given: &Option<Option<String>>, stored: Option<&String>| match given {
        Some(value) => value.as_ref().map(|v| v.trim().to_string()),
        None => stored.cloned(),
    };
    let stored_secret = existing.as_ref().and_then(|e| e.secret.as_ref());
    let secret = kept(&b.secret, stored_secret);
    // A stored `secret_old` stays beside the secret it was rotated for only: a new secret
    // without one ends the rotation (a reviewer: S1 kept beside S3 after S2, and receivers
    // on S2 rejected every delivery). One equal to the secret adds no signature.
    let stored_old = existing.as_ref().and_then(|e| e.secret_old.as_ref()).filter(|_| secret.as_ref() == stored_secret);
    let secret_old = kept(&b.secret_old, stored_old).filter(|old| Some(old) != secret.as_ref());
    if secret.is_none() && secret_old.is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_secret",
            "secret_old without a secret: nothing is signed without one (send \"secret_old\": null to end a rotation, or a secret)",
        );
    }
    let now = st.engine.now();
    let rec = StoredSubscriber {
        id: id.clone(),
        target,
        secret,
        min_severity,
        aoi_geojson: aoi_text,
        created_ms: existing.as_ref().map(|e| e.created_ms).unwrap_or(now),
        updated_ms: now,
        secret_old,
    };
    // A new target re-enables a disabled endpoint (same transaction, audited).
    let put = match edit.put(&rec, aoi) {
        Ok(p) => p,
        Err(e) => return internal(e),
    };
    drop(edit);
    if put.re_enabled || put.retries_due_now > 0 {
        st.wake.notify_one();
    }
    let status = if existing.is_some() { StatusCode::OK } else { StatusCode::CREATED };
    let mut body = subscriber_json(&rec.id, &rec.target, (rec.secret.as_deref(), rec.secret_old.as_deref()), rec.min_severity, b.aoi, "api");
    if let Some(note) = repair_note {
        body["warnings"] = json!([format!("aoi: {note}")]);
    }
    let mut r = json(status, &body);
    if status == StatusCode::CREATED {
        if let Ok(v) = hyper::header::HeaderValue::from_str(&format!("/v1/subscribers/{}", rec.id)) {
            r.headers_mut().insert(hyper::header::LOCATION, v);
        }
    }
    r
}

fn delete_subscriber(st: &ControlState, id: &str) -> Resp {
    if st.engine.config.has_subscriber(id) {
        return error(StatusCode::CONFLICT, "managed_by_config", format!("subscriber {id:?} is defined in the config file; edit it there"));
    }
    // Its queued events are dead-lettered `subscriber_deleted` in the deleting transaction.
    match st.engine.edit_subscribers().delete(id) {
        Ok(Some(d)) => json(StatusCode::OK, &json!({"deleted": id, "dead_lettered": d.rows.dead_lettered, "in_flight": d.rows.in_flight})),
        Ok(None) => error(StatusCode::NOT_FOUND, "unknown_subscriber", format!("no subscriber {id:?}")),
        Err(e) => internal(e),
    }
}

fn endpoint_json(ep: &crate::pipeline::EndpointListing, now_ms: u64) -> Value {
    json!({
        "id": ep.id, "managed_by": ep.managed_by.as_str(), "target": crate::util::url_for_display(&ep.target),
        "state": ep.state_str(), "breaker": ep.breaker_str(now_ms),
        "last_success": ep.state.last_success_ms.map(rfc3339),
        "disabled_reason": ep.state.disabled_reason, "disabled_at": ep.state.disabled_at_ms.map(rfc3339),
    })
}

/// Every subscriber's endpoint with its health, as `zonewatch endpoints list` shows it.
fn list_endpoints(st: &ControlState) -> Resp {
    let now = st.engine.now();
    match st.engine.endpoint_listing() {
        Ok(list) => json(StatusCode::OK, &json!({"items": list.iter().map(|ep| endpoint_json(ep, now)).collect::<Vec<_>>()})),
        Err(e) => internal(e),
    }
}

/// Re-enables an endpoint exactly as `zonewatch endpoints enable` does (breaker and history
/// cleared; an `endpoint_enabled` audit row when it was disabled); its waiting events go out
/// (the caller wakes the delivery loop).
fn enable_endpoint(st: &ControlState, id: &str) -> Resp {
    match st.engine.subscriber_managed_by(id) {
        Ok(Some(_)) => {}
        Ok(None) => return error(StatusCode::NOT_FOUND, "unknown_subscriber", format!("no subscriber {id:?}")),
        Err(e) => return internal(e),
    }
    let done = match st.engine.store.enable_endpoint(id, st.engine.now()) {
        Ok(d) => d,
        Err(e) => return internal(e),
    };
    let now = st.engine.now();
    match st.engine.endpoint_listing() {
        Ok(list) => match list.iter().find(|ep| ep.id == id) {
            Some(ep) => json(StatusCode::OK, &json!({"was_disabled": done.was_disabled, "retries_due_now": done.retries_due_now, "endpoint": endpoint_json(ep, now)})),
            None => error(StatusCode::NOT_FOUND, "unknown_subscriber", format!("no subscriber {id:?}")),
        },
        Err(e) => internal(e),
    }
}

/// The first [`MAX_PAGE`] items of an answer, and how many more there were: the counts say it
/// all, and the items of a replay of every dead letter (100,000 after a day's outage) were
/// an answer of tens of MB.
#[derive(Default)]
struct Capped {
    items: Vec<Value>,
    left_out: usize,
}

impl Capped {
    fn push(&mut self, item: Value) {
        if self.items.len() < MAX_PAGE {
            self.items.push(item);
        } else {
            self.left_out += 1;
        }
    }
}

/// Body of `POST /v1/deadletters/replay`: which dead letters (all when both are absent).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    ids: Option<Vec<u64>>,
    since: Option<String>,
    until: Option<String>,
}

/// Re-queues dead letters under their original keys, oldest observation first. Each goes
/// through the store's replay (duplicate if already delivered, quarantine past
/// `max_replays` or with invalid geometry); the running delivery loop sends them.
fn replay_dead_letters(st: &ControlState, body: &[u8]) -> Resp {
    let b: ReplayBody = match parse_optional_json(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let time = |name: &str, v: &Option<String>| -> Result<Option<u64>, Refusal> {
        match v {
            None => Ok(None),
            Some(t) => crate::util::parse_rfc3339(t)
                .map(Some)
                .ok_or_else(|| refuse(StatusCode::BAD_REQUEST, "bad_time", format!("{name} must be an RFC 3339 time, got {t:?}"))),
        }
    };
    let (since, until) = match (time("since", &b.since), time("until", &b.until)) {
        (Ok(s), Ok(u)) => (s.unwrap_or(0), u.unwrap_or(u64::MAX)),
        (Err(r), _) | (_, Err(r)) => return *r,
    };
    // Ids and observation times only; each row is read again as it is replayed.
    let picks = match st.engine.store.replay_picks(b.ids.as_deref(), since, until) {
        Ok(p) => p,
        Err(e) => return internal(e),
    };
    let (mut requeued, mut duplicates, mut quarantined, mut not_found) = (0u64, 0u64, 0u64, 0u64);
    let mut items = Capped::default();
    // A named id that is no dead letter (in the window) is said so, as `release` and
    // `zonewatch dlq replay` say it, not dropped from the answer.
    if let Some(ids) = &b.ids {
        let found: std::collections::HashSet<u64> = picks.iter().map(|p| p.id).collect();
        let mut seen = std::collections::HashSet::new();
        for &id in ids {
            if !found.contains(&id) && seen.insert(id) {
                not_found += 1;
                items.push(json!({"id": id, "outcome": "not_found"}));
            }
        }
    }
    // Left as they are until a subscriber of their id exists (`subscriber_missing`).
    let (waiting, picks): (Vec<_>, Vec<_>) = picks.into_iter().partition(|p| crate::notify::replay::subscriber_missing(&p.watcher_id, &st.engine.subscribers));
    for p in &waiting {
        items.push(json!({"id": p.id, "outcome": "no_subscriber", "watcher_id": p.watcher_id}));
    }
    // Each dead letter is its own transaction: one that fails, or a stop of the daemon, ends
    // the replay there, and the answer still says what was replayed before (an operator
    // told only "500" would replay again, spending a replay of each).
    let mut ended: Option<(StatusCode, &str, String)> = None;
    let total = picks.len();
    for (done, p) in picks.into_iter().enumerate() {
        if st.engine.stop.requested() {
            ended = Some((StatusCode::SERVICE_UNAVAILABLE, "stopping", format!("zonewatch is stopping: {} of {total} dead letters were not replayed (replay them again)", total - done)));
            break;
        }
        // Replayed or released meanwhile (another request, `zonewatch dlq`): not found now.
        let geometry = match st.engine.store.dead_letter(p.id) {
            Ok(Some(d)) => crate::notify::replay::validate_entry_geometry(&d.entry),
            Ok(None) => Ok(()),
            Err(e) => {
                ended = Some((StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("dead letter {}: {e}; it and the {} after it were not replayed", p.id, total - done - 1)));
                break;
            }
        };
        match st.engine.store.replay_dead_letter(p.id, st.engine.now(), st.engine.config.delivery.max_replays, geometry) {
            Ok(crate::store::ReplayOutcome::Requeued { outbox_id, replay }) => {
                requeued += 1;
                items.push(json!({"id": p.id, "outcome": "requeued", "outbox_id": outbox_id, "replay": replay}));
            }
            Ok(crate::store::ReplayOutcome::Duplicate) => {
                duplicates += 1;
                items.push(json!({"id": p.id, "outcome": "duplicate"}));
            }
            Ok(crate::store::ReplayOutcome::Quarantined { reason }) => {
                quarantined += 1;
                items.push(json!({"id": p.id, "outcome": "quarantined", "reason": reason}));
            }
            Ok(crate::store::ReplayOutcome::NotFound) => {
                not_found += 1;
                items.push(json!({"id": p.id, "outcome": "not_found"}));
            }
            Err(e) => {
                ended = Some((StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("dead letter {}: {e}; it and the {} after it were not replayed", p.id, total - done - 1)));
                break;
            }
        }
    }
    let mut answer = json!({"requeued": requeued, "duplicates": duplicates, "quarantined": quarantined, "not_found": not_found, "no_subscriber": waiting.len(), "items": items.items, "items_left_out": items.left_out});
    match ended {
        None => json(StatusCode::OK, &answer),
        Some((status, code, message)) => {
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                tracing::error!("control port: replay: {message}");
            }
            answer["error"] = json!({"code": code, "message": message});
            json(status, &answer)
        }
    }
}

/// Body of `POST /v1/deadletters/release`: which quarantined dead letters (named; never all).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    ids: Vec<u64>,
}

/// Takes quarantined dead letters back to the dead letters, each in its own transaction
/// (`Store::release_quarantined`); a replay then sends them. Ids that are not quarantined
/// are listed as `not_found`.
fn release_quarantined(st: &ControlState, body: &[u8]) -> Resp {
    let b: ReleaseBody = match parse_json(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if b.ids.is_empty() {
        return error(StatusCode::BAD_REQUEST, "missing_field", "ids must name at least one quarantined dead letter");
    }
    let outcomes = match st.engine.store.release_quarantined(&b.ids, st.engine.now()) {
        Ok(o) => o,
        Err(e @ crate::store::StoreError::Conflict(_)) => return error(StatusCode::CONFLICT, "conflict", e.to_string()),
        Err(e) => return internal(e),
    };
    let (mut released, mut not_found) = (0u64, 0u64);
    let items: Vec<Value> = outcomes
        .into_iter()
        .map(|(id, outcome)| match outcome {
            crate::store::ReleaseOutcome::Released { was } => {
                released += 1;
                json!({"id": id, "outcome": "released", "quarantine_reason": was})
            }
            crate::store::ReleaseOutcome::NotFound => {
                not_found += 1;
                json!({"id": id, "outcome": "not_found"})
            }
        })
        .collect();
    json(StatusCode::OK, &json!({"released": released, "not_found": not_found, "items": items}))
}

/// Body of `POST /v1/backup` (optional).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct BackupBody {
    /// File name inside the store's `backups/` folder (letters, digits, '-', '_', '.').
    name: Option<String>,
    /// The store file the client means (`zonewatch backup` sends its config's): a daemon
    /// serving another file refuses, 409 `other_store`.
    store: Option<FileIdentity>,
}

/// A file as the file system knows it (device and inode numbers): the same however its path
/// is written, or seen from another working directory.
#[derive(Deserialize, serde::Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
}

impl FileIdentity {
    /// The identity of the file at `path`.
    pub fn of(path: &std::path::Path) -> std::io::Result<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(FileIdentity { dev: m.dev(), ino: m.ino() })
    }
}

fn backup(st: &ControlState, body: &[u8]) -> Resp {
    let b: BackupBody = match parse_optional_json(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let own = std::path::absolute(st.engine.store.path()).unwrap_or_else(|_| st.engine.store.path().to_path_buf());
    if let Some(asked) = b.store {
        // Two installs sharing a token, one stopped with its address file left, the other on
        // that port since: the client's backup must not be this daemon's store (a tester got
        // another install's store, exit 0).
        if FileIdentity::of(&own).ok() != Some(asked) {
            return error(StatusCode::CONFLICT, "other_store", format!("this daemon serves the store {}, not the file asked for", own.display()));
        }
    }
    let name = b.name.unwrap_or_else(|| format!("zonewatch-{}.redb", rfc3339(st.engine.now()).replace([':', '.'], "-")));
    if !crate::config::valid_id(&name) || name.starts_with('.') {
        return error(StatusCode::BAD_REQUEST, "bad_name", "name must be a plain file name of at most 64 characters (letters, digits, '-', '_', '.'), not starting with '.'");
    }
    let dir = crate::cli::backup_dir(&st.engine.config);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return internal(format!("cannot create {}: {e}", dir.display()));
    }
    let dest = dir.join(&name);
    match st.engine.store.backup_to(&dest) {
        // Absolute: a client's working directory is not the daemon's (a relative `[store] path`
        // resolves against the daemon's).
        Ok(info) => {
            let path = std::path::absolute(&info.path).unwrap_or(info.path);
            json(StatusCode::CREATED, &json!({"path": path.display().to_string(), "bytes": info.bytes, "tables": info.tables, "rows": info.rows, "store": own.display().to_string()}))
        }
        Err(crate::store::StoreError::Conflict(m)) => error(StatusCode::CONFLICT, "exists", m),
        Err(e) => internal(e),
    }
}
