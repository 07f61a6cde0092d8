//! `GET /v1/audit`: the ledger a page at a time, filtered and in either order, in the JSON
//! shape `zonewatch audit --format jsonl` writes.

use crate::cli::audit_json;
use crate::control::ControlState;
use crate::control::http::{error, json, Resp};
use crate::model::*;
use crate::store::AuditFilter;
use super::{internal, page_of};
use hyper::StatusCode;
use serde_json::json;

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
