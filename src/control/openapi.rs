//! The OpenAPI 3 document for the control port, served at `/v1/openapi.json`. It is checked
//! against the live port by schemathesis in the test suite (`tests/control_api.py`), so it
//! must describe every route, parameter, status code and response shape the handlers produce.

use crate::model::{ChangeKind, Outcome, Severity};
use serde_json::{json, Value};

fn err_ref() -> Value {
    json!({"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn ok(desc: &str, schema: Value) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": schema}}})
}

fn list_of(item: &str) -> Value {
    json!({"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {"$ref": format!("#/components/schemas/{item}")}}}})
}

fn page_of(item: &str) -> Value {
    json!({"type": "object", "required": ["items", "next_cursor"], "properties": {
        "items": {"type": "array", "items": {"$ref": format!("#/components/schemas/{item}")}},
        "next_cursor": {"type": ["string", "null"]}}})
}

/// Standard error responses for an authenticated operation, plus extra codes. Every one
/// may answer 400: a query parameter it does not take is refused (`bad_query`), and a body
/// where none is read (`unexpected_body`); 415 to a compressed body (`unsupported_encoding`);
/// and 500 when the store fails it (`internal`).
fn with_errors(mut responses: Value, extra: &[&str]) -> Value {
    if let Some(m) = responses.as_object_mut() {
        for code in ["400", "401", "408", "413", "415", "500"].iter().chain(extra) {
            m.insert(code.to_string(), err_ref());
        }
    }
    responses
}

fn path_param(name: &str, schema: Value) -> Value {
    json!({"name": name, "in": "path", "required": true, "schema": schema})
}

fn query_param(name: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "schema": schema})
}

/// The document.
pub fn document() -> Value {
    let s = |t: &str| json!({"type": t});
    let ns = |t: &str| json!({"type": [t, "null"]});
    let src_id = path_param("id", json!({"type": "string"}));
    let run_id = path_param("run", json!({"type": "integer", "minimum": 0}));
    let sub_id = path_param("id", json!({"type": "string"}));
    let limit = query_param("limit", json!({"type": "integer", "minimum": 1, "maximum": 1000}));
    let cursor = query_param("cursor", json!({"type": "integer", "minimum": 0}));
    let page_limit = query_param("limit", json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000}));
    // Every outcome the ledger holds is a filter (`Outcome::ALL`, as the handler checks).
    let one_outcome = format!("({})", Outcome::ALL.map(Outcome::as_str).join("|"));
    let outcome_pattern = format!("^{one_outcome}(,{one_outcome})*$");
    json!({
        "openapi": "3.1.0",
        "info": {"title": "zonewatch control port", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Operate a zonewatch appliance. Every route except /healthz and the dashboard shell (/) needs `Authorization: Bearer <token>`."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        // What zonewatch sends to a subscriber's target (the README's "What a subscriber
        // receives"): a receiver's contract, generated clients included.
        "webhooks": {"zoningChange": {"post": {"operationId": "zoningChange", "security": [],
            "summary": "one change of one parcel (or district region) for one subscriber; retried with the same webhook-id and body until a 2xx, a 410 (the endpoint is disabled) or a dead letter",
            "parameters": [
                {"name": "webhook-id", "in": "header", "required": true, "schema": s("string"), "description": "the idempotency key (data.idempotency_key): deduplicate on it"},
                {"name": "webhook-timestamp", "in": "header", "required": true, "schema": s("string"), "description": "this attempt's time, epoch seconds"},
                {"name": "webhook-signature", "in": "header", "required": false, "schema": s("string"), "description": "v1,<base64 HMAC-SHA256 of id.timestamp.body> when the subscriber has a secret; during a rotation two, space-separated"}],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WebhookBody"}}}},
            "responses": {
                "2XX": {"description": "delivered: a status and headers within delivery.timeout_ms (a later 2xx is a timeout, and retried)"},
                "410": {"description": "gone: the endpoint is disabled and its events wait for an operator"},
                "default": {"description": "408, 429 and 5xx are retried (Retry-After is a floor); any other status dead-letters the event"}}}}},
        "paths": {
            "/healthz": {"get": {"operationId": "healthz", "security": [], "responses": {
                "200": ok("alive", json!({"type": "object", "required": ["status"], "properties": {"status": s("string"), "version": s("string"), "uptime_s": s("integer")}}))}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": with_errors(json!({
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}), &[])}},
            "/v1/openapi.json": {"get": {"operationId": "openapi", "responses": with_errors(json!({"200": ok("this document", json!({"type": "object"}))}), &[])}},
            "/v1/sources": {"get": {"operationId": "listSources", "responses": with_errors(json!({"200": ok("sources", list_of("Source"))}), &[])}},
            "/v1/sources/{id}/run": {"post": {"operationId": "runSource", "parameters": [src_id.clone()], "responses": with_errors(json!({
                "200": ok("the run's record", json!({"type": "object", "required": ["status", "run"], "properties": {"status": s("string"), "run": {"$ref": "#/components/schemas/Run"}, "hold_reason": ns("string")}})),
                "409": ok("a run of this source is in progress (skipped_overlap)", json!({"type": "object", "required": ["status"], "properties": {"status": s("string"), "source_id": s("string"), "message": s("string")}}))
            }), &["404", "422", "429", "503"])}},
            "/v1/sources/{id}/watermarks": {"get": {"operationId": "sourceWatermarks", "parameters": [src_id], "responses": with_errors(json!({
                "200": ok("watermark history, oldest first", json!({"type": "object", "required": ["source_id", "items"], "properties": {"source_id": s("string"), "items": {"type": "array", "items": {"$ref": "#/components/schemas/Watermark"}}}}))}), &["404"])}},
            "/v1/runs": {"get": {"operationId": "listRuns", "parameters": [query_param("source", s("string")), limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("runs, newest first", page_of("Run"))}), &["400", "404"])}},
            "/v1/holds": {"get": {"operationId": "listHolds",
                "parameters": [query_param("state", json!({"type": "string", "description": "comma-separated: open, released, primed, superseded"})), limit.clone()],
                "responses": with_errors(json!({"200": ok("holds, oldest first (with limit: the newest of them)", list_of("Hold"))}), &["400"])}},
            "/v1/holds/{run}/release": {"post": {"operationId": "releaseHold", "parameters": [run_id.clone()], "responses": with_errors(json!({
                "200": ok("released (the held run was committed and its alerts queued) or primed (a held first ingest or --reprocess: committed silently, as status says)", json!({"type": "object", "required": ["status", "run"], "properties": {"status": s("string"), "run": {"$ref": "#/components/schemas/Run"}}}))}), &["400", "404", "409", "429", "503"])}},
            "/v1/holds/{run}/changes": {"get": {"operationId": "heldChanges", "parameters": [run_id.clone(), limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("an open hold's changes, in the order the run found them, each with the subscribers it would go to now (a resolved hold keeps none)",
                    json!({"type": "object", "required": ["hold", "release_sends", "items", "next_cursor"], "properties": {"hold": {"$ref": "#/components/schemas/Hold"}, "release_sends": s("boolean"),
                        "items": {"type": "array", "items": {"$ref": "#/components/schemas/HeldChange"}}, "next_cursor": ns("string")}}))}), &["404"])}},
            "/v1/holds/{run}/prime": {"post": {"operationId": "primeHold", "parameters": [run_id], "responses": with_errors(json!({
                "200": ok("primed: committed silently", json!({"type": "object", "required": ["status", "run"], "properties": {"status": s("string"), "run": {"$ref": "#/components/schemas/Run"}}}))}), &["400", "404", "409", "429", "503"])}},
            "/v1/subscribers": {
                "get": {"operationId": "listSubscribers", "parameters": [page_limit.clone(), query_param("cursor", json!({"type": "string", "description": "the id the page comes after: the previous page's next_cursor"}))],
                    "responses": with_errors(json!({"200": ok("subscribers, the config's and the control port's together, in id order, a page after the id `cursor` (`next_cursor`: null after the last)", page_of("Subscriber"))}), &["400"])},
                "post": {"operationId": "createSubscriber", "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SubscriberInput"}}}},
                    "responses": with_errors(json!({"201": ok("created", json!({"$ref": "#/components/schemas/Subscriber"}))}), &["400", "409"])}
            },
            "/v1/subscribers/{id}": {
                "get": {"operationId": "getSubscriber", "parameters": [sub_id.clone()], "responses": with_errors(json!({"200": ok("subscriber", json!({"$ref": "#/components/schemas/Subscriber"}))}), &["404"])},
                "put": {"operationId": "putSubscriber", "parameters": [sub_id.clone()], "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SubscriberInput"}}}},
                    "responses": with_errors(json!({"200": ok("replaced", json!({"$ref": "#/components/schemas/Subscriber"})), "201": ok("created", json!({"$ref": "#/components/schemas/Subscriber"}))}), &["400", "409"])},
                "delete": {"operationId": "deleteSubscriber", "parameters": [sub_id.clone()], "responses": with_errors(json!({
                    "200": ok("deleted; its queued events are dead letters `subscriber_deleted` (those with a send in flight get that send's outcome)",
                        json!({"type": "object", "required": ["deleted", "dead_lettered", "in_flight"], "properties": {
                            "deleted": s("string"), "dead_lettered": s("integer"), "in_flight": s("integer")}}))}), &["404", "409"])}
            },
            "/v1/endpoints": {"get": {"operationId": "listEndpoints", "responses": with_errors(json!({"200": ok("every subscriber's endpoint and its health", list_of("Endpoint"))}), &[])}},
            "/v1/endpoints/{id}/enable": {"post": {"operationId": "enableEndpoint", "parameters": [sub_id], "responses": with_errors(json!({
                "200": ok("re-enabled (breaker and history cleared; audited endpoint_enabled when it was disabled)", json!({"type": "object", "required": ["was_disabled", "retries_due_now", "endpoint"], "properties": {
                    "retries_due_now": s("integer"),
                    "was_disabled": s("boolean"), "endpoint": {"$ref": "#/components/schemas/Endpoint"}}}))}), &["404"])}},
            "/v1/audit": {"get": {"operationId": "audit", "parameters": [
                    query_param("parcel", s("string")), query_param("watcher", s("string")), query_param("source", s("string")),
                    query_param("key", s("string")), query_param("lineage", s("string")),
                    query_param("since", json!({"type": "string", "format": "date-time"})),
                    query_param("order", json!({"type": "string", "enum": ["asc", "desc"]})),
                    query_param("outcome", json!({"type": "string", "pattern": outcome_pattern, "description": "comma-separated outcomes"})),
                    limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("audit rows in ledger order", page_of("AuditRow"))}), &["400"])}},
            "/v1/changes/recent": {"get": {"operationId": "recentChanges", "parameters": [limit.clone()],
                "responses": with_errors(json!({"200": ok("latest changed parcels with their current geometry", json!({"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
                    "type": "object", "required": ["source_id", "parcel_id", "ts", "outcome"], "properties": {"source_id": s("string"), "parcel_id": s("string"), "ts": s("string"), "outcome": s("string"), "detail": s("string"), "geometry": {"type": ["object", "null"]}}}}}}))}), &["400"])}},
            "/v1/deadletters": {"get": {"operationId": "listDeadLetters", "parameters": [page_limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("dead letters in id order, a page after the id `cursor` (`next_cursor`: null after the last)", page_of("DeadLetter"))}), &["400"])}},
            "/v1/deadletters/replay": {"post": {"operationId": "replayDeadLetters",
                "requestBody": {"required": false, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": false, "properties": {
                    "ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
                    "since": {"type": ["string", "null"], "format": "date-time"}, "until": {"type": ["string", "null"], "format": "date-time"}}}}}},
                "responses": with_errors(json!({"200": ok("what each dead letter became", json!({"type": "object", "required": ["requeued", "duplicates", "quarantined", "items"], "properties": {
                    "requeued": s("integer"), "duplicates": s("integer"), "quarantined": s("integer"), "not_found": s("integer"), "no_subscriber": s("integer"), "items_left_out": s("integer"), "items": {"type": "array", "items": {"type": "object", "required": ["id", "outcome"], "properties": {
                        "id": s("integer"), "outcome": {"type": "string", "enum": ["requeued", "duplicate", "quarantined", "not_found", "no_subscriber"]}, "watcher_id": s("string")}}}}}))}), &["400", "429", "503"])}},
            "/v1/deadletters/quarantined": {"get": {"operationId": "listQuarantinedDeadLetters", "parameters": [page_limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("dead letters set aside for a person (replayed past max_replays, invalid geometry), in id order, a page after the id `cursor`", page_of("DeadLetter"))}), &["400"])}},
            "/v1/deadletters/release": {"post": {"operationId": "releaseQuarantinedDeadLetters",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": false, "required": ["ids"], "properties": {
                    "ids": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}}}}},
                "responses": with_errors(json!({"200": ok("what each id became: released (a dead letter again, replay count reset) or not_found", json!({"type": "object", "required": ["released", "not_found", "items"], "properties": {
                    "released": s("integer"), "not_found": s("integer"), "items": {"type": "array", "items": {"type": "object", "required": ["id", "outcome"], "properties": {
                        "id": s("integer"), "outcome": {"type": "string", "enum": ["released", "not_found"]}, "quarantine_reason": s("string")}}}}}))}), &["400", "409"])}},
            "/v1/quarantine": {"get": {"operationId": "listQuarantine", "parameters": [limit.clone(), cursor.clone()],
                "responses": with_errors(json!({"200": ok("quarantined features, oldest first, a page after the row `cursor` (kept until [store] run_retention has passed; their audit rows stay)", page_of("Quarantined"))}), &["400"])}},
            "/v1/backup": {"post": {"operationId": "backup",
                "requestBody": {"required": false, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": false, "properties": {"name": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"},
                    "store": {"type": ["object", "null"], "additionalProperties": false, "required": ["dev", "ino"], "description": "the store file meant (device and inode numbers); a daemon serving another file answers 409 other_store", "properties": {"dev": s("integer"), "ino": s("integer")}}}}}}},
                "responses": with_errors(json!({"201": ok("backup written", json!({"type": "object", "required": ["path", "bytes", "tables", "rows", "store"], "properties": {"path": s("string"), "bytes": s("integer"), "tables": s("integer"), "rows": s("integer"), "store": s("string")}}))}), &["400", "409", "429"])}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {"code": s("string"), "message": s("string")}}}},
                "Source": {"type": "object", "required": ["id", "jurisdiction", "every_s", "running", "open_holds"], "properties": {
                    "id": s("string"), "jurisdiction": s("string"), "every_s": s("integer"), "last_verdict": ns("string"), "last_run_id": ns("integer"),
                    "last_run": ns("string"), "age_s": ns("integer"), "last_change": ns("string"), "next_run": ns("string"), "running": s("boolean"), "open_holds": s("integer")}},
                "Run": {"type": "object", "required": ["run_id", "source_id", "lineage_id", "verdict"], "properties": {
                    "run_id": s("integer"), "source_id": s("string"), "lineage_id": s("string"), "started": s("string"), "finished": s("string"),
                    "verdict": {"type": "string", "enum": ["baseline", "run", "identical", "skip", "held", "reprocessed", "failed", "skipped_overlap"]},
                    "digest": s("string"), "features": s("integer"), "parcels": s("integer"), "quarantined": s("integer"), "repaired": s("integer"),
                    "changes": s("integer"), "queued": s("integer"), "duplicates": s("integer"), "suppressed": s("integer"), "below_min_severity": s("integer"),
                    "hold_id": ns("integer"), "warnings": {"type": "array", "items": s("string")}, "error": ns("string")}},
                "Watermark": {"type": "object", "required": ["run_id", "digest"], "properties": {
                    "run_id": s("integer"), "digest": s("string"), "size": s("integer"), "consumed_at": s("string"), "content_changed_at": s("string"),
                    "publisher_ts": ns("string"), "etag": ns("string"), "last_modified": ns("string"), "probe_ts": ns("string")}},
                "HeldChange": {"type": "object", "required": ["n", "parcel_id", "kind", "severity", "subscribers", "below_min_severity"], "properties": {
                    "n": s("integer"), "parcel_id": s("string"), "kind": {"type": "string", "enum": ChangeKind::ALL.map(ChangeKind::as_str)}, "from": ns("string"), "to": ns("string"),
                    "effective_date": ns("string"), "severity": {"type": "string", "enum": Severity::ALL.map(Severity::as_str)}, "area_m2": s("number"), "observed_at": s("string"),
                    "subscribers": {"type": "array", "items": s("string")}, "below_min_severity": {"type": "array", "items": s("string")}}},
                "Hold": {"type": "object", "required": ["run_id", "source_id", "state", "reason"], "properties": {
                    "run_id": s("integer"), "source_id": s("string"), "lineage_id": s("string"), "created": s("string"), "reason": s("string"),
                    "state": {"type": "string", "enum": ["open", "released", "primed", "superseded"]}, "resolved": {"type": ["object", "null"]},
                    "digest": s("string"), "changes": s("integer"), "features": s("integer"),
                    "reprocess": {"type": "boolean", "description": "the held run was a --reprocess: releasing it primes"}}},
                "SubscriberInput": {"type": "object", "additionalProperties": false, "required": ["target", "aoi"], "properties": {
                    "id": {"type": ["string", "null"], "pattern": "^(?!\\.+$)[A-Za-z0-9._-]{1,64}$", "description": "required by POST /v1/subscribers (400 missing_field without it); a PUT takes it from the path, and one given must match it"}, "target": {"type": "string", "format": "uri", "description": "a password in it is sent as basic auth and listed as ***; a PUT of the target exactly as listed keeps the stored password, another URL with *** for a password is refused (400 masked_password)"},
                    "secret": {"type": ["string", "null"], "description": "whsec_ + base64 of at least 16 bytes; left out, a PUT keeps the stored one; null: deliveries are no longer signed"},
                    "secret_old": {"type": ["string", "null"], "description": "the secret being rotated out: deliveries carry both signatures while it is set (needs a secret); left out, a PUT keeps the stored one; null ends the rotation"},
                    "min_severity": {"type": ["string", "null"], "enum": ["info", "notice", "material", "critical", null]},
                    "aoi": {"type": "object", "description": "GeoJSON Polygon, MultiPolygon, Feature or FeatureCollection"}}},
                "Subscriber": {"type": "object", "required": ["id", "target", "signed", "min_severity", "managed_by"], "properties": {
                    "id": s("string"), "target": s("string"), "signed": s("boolean"), "rotating": {"type": "boolean", "description": "a secret_old is set beside the secret: deliveries carry both signatures"}, "min_severity": s("string"), "aoi": {},
                    "managed_by": {"type": "string", "enum": ["config", "api"]},
                    "warnings": {"type": "array", "items": s("string"), "description": "in the answer to a POST or PUT: what the repair made of an aoi whose rings are not a valid polygon (it is stored as written and matched as repaired), and rings that do not end where they start (read as closed)"}}},
                "Endpoint": {"type": "object", "required": ["id", "managed_by", "target", "state", "breaker", "last_success", "disabled_reason", "disabled_at"], "properties": {
                    "id": s("string"), "managed_by": {"type": "string", "enum": ["config", "api"]}, "target": s("string"),
                    "state": {"type": "string", "enum": ["enabled", "disabled"]}, "breaker": {"type": "string", "enum": ["closed", "open", "half_open"]},
                    "last_success": ns("string"), "disabled_reason": ns("string"), "disabled_at": ns("string")}},
                "AuditRow": {"type": "object", "required": ["seq", "ts", "outcome", "detail"], "properties": {
                    "seq": s("integer"), "ts": s("string"),
                    "outcome": {"type": "string", "enum": Outcome::ALL.map(Outcome::as_str)},
                    "idempotency_key": ns("string"), "watcher_id": ns("string"), "source_id": ns("string"), "parcel_id": ns("string"),
                    "lineage_id": ns("string"), "detail": s("string")}},
                "DeadLetter": {"type": "object", "required": ["id", "idempotency_key", "reason"], "properties": {
                    "id": s("integer"), "idempotency_key": s("string"), "watcher_id": s("string"), "target": s("string"), "source_id": s("string"),
                    "parcel_id": s("string"), "lineage_id": s("string"), "severity": s("string"), "attempts": s("integer"), "reason": s("string"),
                    "dead_at": s("string"), "last_error": ns("string")}},
                "WebhookBody": {"type": "object", "additionalProperties": false, "required": ["type", "timestamp", "data"], "properties": {
                    "type": {"type": "string", "const": "zoning.change"},
                    "timestamp": {"type": "string", "format": "date-time", "description": "the change's observed_at, the same at every attempt"},
                    "data": {"type": "object", "additionalProperties": false,
                        "required": ["idempotency_key", "watcher_id", "source_id", "jurisdiction", "parcel_id", "change", "from", "to", "severity", "effective_date", "lineage_id", "observed_at", "area_m2", "geometry"],
                        "properties": {
                            "idempotency_key": s("string"), "watcher_id": s("string"), "source_id": s("string"), "jurisdiction": s("string"),
                            "parcel_id": {"type": "string", "description": "area:<content hash> for an area_rezoned region"},
                            "change": {"type": "string", "enum": ChangeKind::ALL.map(ChangeKind::as_str)},
                            "from": {"type": ["string", "null"], "description": "null for an addition, an overlay_added, and a layer without zoning values"},
                            "to": {"type": ["string", "null"], "description": "null for a removal, an overlay_removed, and a layer without zoning values"},
                            "severity": {"type": "string", "enum": Severity::ALL.map(Severity::as_str)},
                            "effective_date": ns("string"), "lineage_id": s("string"),
                            "observed_at": {"type": "string", "format": "date-time", "description": "the run that found the change (also for a held change released later); order a parcel's events by it, and an overlay's by it and the overlay"},
                            "area_m2": s("number"),
                            "geometry": {"type": ["object", "null"], "description": "GeoJSON Polygon or MultiPolygon: the new shape, the old one for a removal"}}}}},
                "Quarantined": {"type": "object", "required": ["id", "source_id", "reason"], "properties": {
                    "id": s("integer"), "source_id": s("string"), "run_id": s("integer"), "lineage_id": s("string"), "feature_index": s("integer"), "parcel_id": ns("string"),
                    "reason": s("string"), "detail": s("string"), "raw": s("string"), "ts": s("string")}}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    /// The document lists, for every route, exactly the query parameters the server accepts:
    /// a receiver's generated client must not send one the server refuses, nor miss one.
    #[test]
    fn documented_query_parameters_are_the_accepted_ones() {
        let doc = super::document();
        let paths = doc["paths"].as_object().unwrap();
        for (path, ops) in paths {
            let seg: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
            for (method, op) in ops.as_object().unwrap() {
                let method = hyper::Method::from_bytes(method.to_ascii_uppercase().as_bytes()).unwrap();
                let mut accepted: Vec<&str> = super::super::routes::accepted_query(&method, &seg).to_vec();
                accepted.sort_unstable();
                let mut documented: Vec<&str> = op["parameters"].as_array().into_iter().flatten().filter(|p| p["in"] == "query").filter_map(|p| p["name"].as_str()).collect();
                documented.sort_unstable();
                assert_eq!(documented, accepted, "{method} {path}");
            }
        }
        assert!(paths.contains_key("/v1/holds"));
    }

    /// The webhook body's schema names exactly the fields a built body has, for every kind
    /// of change (a receiver's generated model must neither miss one nor expect one more).
    #[test]
    fn the_webhook_schema_is_the_body_sent() {
        use crate::model::{sample_event, ChangeFields, ChangeKind, OutboxEntry, OutboxPayload};
        let doc = super::document();
        let schema = &doc["components"]["schemas"]["WebhookBody"];
        let keys = |v: &serde_json::Value| -> Vec<String> {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        let mut required: Vec<String> = schema["properties"]["data"]["required"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        required.sort();
        assert_eq!(required, keys(&schema["properties"]["data"]["properties"]));
        for kind in ChangeKind::ALL {
            let mut event = sample_event("P1");
            event.kind = kind;
            let entry = OutboxEntry {
                id: 1,
                key: crate::model::IdemKey("k".into()),
                watcher_id: "w".into(),
                target: "https://h/".into(),
                source_id: "s".into(),
                parcel_id: "P1".into(),
                lineage_id: "l".into(),
                severity: event.severity,
                payload: OutboxPayload::Change(ChangeFields::of(&event, 5)),
                attempts: 0,
                created_ms: 5,
                next_attempt_ms: 5,
                last_error: None,
            };
            let body: serde_json::Value = serde_json::from_slice(&entry.body()).unwrap();
            assert_eq!(keys(&body), keys(&schema["properties"]), "{kind:?}");
            assert_eq!(keys(&body["data"]), required, "{kind:?}");
            assert_eq!(body["data"]["change"], kind.as_str());
        }
    }
}
