//! `GET /v1/holds`, `GET /v1/holds/{run}/changes` and `POST /v1/holds/{run}/release|prime`:
//! the publication gate steered over the port, waiting a while for a run of the source to end.

use crate::control::ControlState;
use crate::control::http::{error, json, Resp};
use crate::model::*;
use crate::pipeline::PipelineError;
use crate::util::rfc3339;
use super::sources::run_json;
use super::{blocking_long, internal, limit_or, page_of};
use hyper::StatusCode;
use serde_json::{json, Value};
use std::sync::Arc;

fn hold_json(h: &Hold) -> Value {
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

/// `GET /v1/holds/{run}/changes`: what an open hold would send, a page at a time (`limit`, 100
/// by default; `cursor`): each held change with the subscribers it would go to now (their
/// AOI touches it and its severity reaches their `min_severity`) and those it touches below
/// their `min_severity`. Matched when asked, against the subscribers of the moment, as a
/// release matches them. Before it, an operator chose between release and prime knowing
/// only how many changes there were (found by a black-box tester playing an operator).
pub(super) fn held_changes(st: &ControlState, hold_id: u64, q: &std::collections::HashMap<String, String>) -> Resp {
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

/// `GET /v1/holds`: every hold, oldest first, or (`state=open,superseded`, `limit=N`) the
/// newest `N` of those states, still oldest first. A source whose layer changes at every poll
/// while it is held supersedes a hold per poll (a soak tester's had 62 in 2.5 minutes, the
/// dashboard polling them all every 5 s): the dashboard asks for the open ones and the latest
/// resolved ones.
pub(super) fn list_holds(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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

/// How long a hold's release or prime waits for a run of its source to end.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

pub(super) async fn resolve_hold(st: Arc<ControlState>, id: u64, prime: bool) -> Resp {
    let st2 = st.clone();
    let r = blocking_long(&st, move || {
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
