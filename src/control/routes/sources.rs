//! `GET /v1/sources`, `POST /v1/sources/{id}/run`, `GET /v1/sources/{id}/watermarks`,
//! `GET /v1/runs` and `GET /v1/quarantine`: what each source did and when, the features its
//! runs set aside, and a run asked for now.

use crate::control::ControlState;
use crate::control::http::{error, json, Resp};
use crate::model::*;
use crate::pipeline::RunOptions;
use crate::util::rfc3339;
use super::{blocking_long, internal, page_of};
use hyper::StatusCode;
use serde_json::{json, Value};
use std::sync::Arc;

fn verdict_str(v: Verdict) -> &'static str {
    v.as_str()
}

pub(super) fn run_json(r: &RunRecord) -> Value {
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

pub(super) fn list_sources(st: &ControlState) -> Resp {
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

pub(super) async fn run_source(st: Arc<ControlState>, id: String) -> Resp {
    if st.engine.config.source(&id).is_none() {
        return error(StatusCode::NOT_FOUND, "unknown_source", format!("no source {id:?}"));
    }
    let st2 = st.clone();
    let r = blocking_long(&st, move || {
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

pub(super) fn watermarks(st: &ControlState, id: &str) -> Resp {
    if st.engine.config.source(id).is_none() {
        return error(StatusCode::NOT_FOUND, "unknown_source", format!("no source {id:?}"));
    }
    match st.engine.store.watermark_history(id) {
        Ok(h) => json(StatusCode::OK, &json!({"source_id": id, "items": h.iter().map(watermark_json).collect::<Vec<_>>()})),
        Err(e) => internal(e),
    }
}

pub(super) fn list_runs(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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

/// `{"items": [...], "next_cursor": ...}`: a page of quarantined features, oldest first,
/// `limit` of them (100 by default, at most 1,000) after the row `cursor`. Each keeps up to
/// 16 KiB of the feature's text, and one run of a county whose `parcel_id` was mistyped
/// quarantines most of it: the whole table was built into one answer before.
pub(super) fn quarantine_list(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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
