//! `GET|POST /v1/subscribers`, `GET|PUT|DELETE /v1/subscribers/{id}`, `GET /v1/endpoints` and
//! `POST /v1/endpoints/{id}/enable`: subscribers managed without a config edit or a restart,
//! and their endpoints' health.

use crate::control::ControlState;
use crate::control::http::{error, json, parse_json, Resp};
use crate::model::*;
use crate::store::StoredSubscriber;
use crate::util::rfc3339;
use super::{MAX_PAGE, internal, limit_or};
use hyper::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

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
pub(super) fn list_subscribers(st: &ControlState, q: &std::collections::HashMap<String, String>) -> Resp {
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

pub(super) fn get_subscriber(st: &ControlState, id: &str) -> Resp {
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

pub(super) fn put_subscriber(st: &ControlState, path_id: Option<String>, body: &[u8]) -> Resp {
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

pub(super) fn delete_subscriber(st: &ControlState, id: &str) -> Resp {
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
pub(super) fn list_endpoints(st: &ControlState) -> Resp {
    let now = st.engine.now();
    match st.engine.endpoint_listing() {
        Ok(list) => json(StatusCode::OK, &json!({"items": list.iter().map(|ep| endpoint_json(ep, now)).collect::<Vec<_>>()})),
        Err(e) => internal(e),
    }
}

/// Re-enables an endpoint exactly as `zonewatch endpoints enable` does (breaker and history
/// cleared; an `endpoint_enabled` audit row when it was disabled); its waiting events go out
/// (the caller wakes the delivery loop).
pub(super) fn enable_endpoint(st: &ControlState, id: &str) -> Resp {
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
