//! `GET /v1/deadletters[/quarantined]` and `POST /v1/deadletters/replay|release`: dead letters
//! and quarantined ones, and the way back into the outbox, with the same rules as
//! `zonewatch dlq`.

use crate::control::ControlState;
use crate::control::http::{error, json, parse_json, parse_optional_json, refuse, Refusal, Resp};
use crate::model::*;
use crate::store::DeadLetterList;
use crate::util::rfc3339;
use super::{MAX_PAGE, internal, page_of};
use hyper::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

/// `{"items": [...], "next_cursor": ...}`: a page of dead letters (or quarantined ones) in id
/// order, `limit` of them (at most and by default 1,000) after the id `cursor`. A receiver
/// down for a day can leave hundreds of thousands, each with its payload: the whole list in
/// one answer was built in memory by a daemon meant to idle in 50 MiB.
pub(super) fn dead_letter_list(st: &ControlState, list: DeadLetterList, q: &std::collections::HashMap<String, String>) -> Resp {
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
pub(super) fn replay_dead_letters(st: &ControlState, body: &[u8]) -> Resp {
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
pub(super) fn release_quarantined(st: &ControlState, body: &[u8]) -> Resp {
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
