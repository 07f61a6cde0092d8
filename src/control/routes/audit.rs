//! `GET /v1/audit`: the ledger a page at a time, filtered and in either order, in the JSON
//! shape `zonewatch audit --format jsonl` writes; and `GET /v1/changes/recent`, the latest
//! changed parcels read off the ledger for the dashboard's map.

use crate::cli::audit_json;
use crate::control::ControlState;
use crate::control::http::{error, json, Refusal, Resp};
use crate::model::*;
use crate::store::AuditFilter;
use crate::util::rfc3339;
use super::{internal, limit_or, page_of};
use hyper::StatusCode;
use serde_json::{json, Value};

pub(super) fn audit(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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
pub(super) fn recent_changes(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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

fn limit_of(q: &std::collections::HashMap<String, String>) -> Result<usize, Refusal> {
    limit_or(q, 100)
}
