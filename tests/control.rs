//! The control port against a live `zonewatch serve`: auth, hostile requests, subscribers,
//! holds, runs, audit, metrics, backup and restore — and, when the peers are installed by
//! scripts/test, schemathesis against the OpenAPI document and a real Prometheus parser.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build().unwrap()
}

fn peer_python() -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/peers/venv/bin/python");
    if p.exists() {
        Some(p)
    } else if std::env::var_os("CI").is_some() {
        panic!("test peers missing under CI: scripts/test must install target/peers/venv");
    } else {
        eprintln!("SKIPPED (peers): target/peers/venv not found; run scripts/test to install schemathesis and prometheus_client");
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_port_end_to_end() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "cfg-watcher", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "every = \"1h\"",
    );
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 0.05");
    ws.edit_config("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:0\"\nbody_timeout = \"1s\"");
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    let d = tokio::task::block_in_place(|| Daemon::start(&ws));
    let c = client();
    let auth = format!("Bearer {}", d.token);

    tokio::task::block_in_place(|| {
        // Public and protected.
        assert_eq!(c.get(d.url("/healthz")).send().unwrap().status(), 200);
        let page = c.get(d.url("/")).send().unwrap().text().unwrap();
        assert!(page.contains("<title>zonewatch</title>") && !page.contains("http://") && !page.contains("https://"), "self-contained page");
        for path in ["/v1/sources", "/metrics", "/v1/audit", "/v1/openapi.json"] {
            let r = c.get(d.url(path)).send().unwrap();
            assert_eq!(r.status(), 401, "{path} without a token");
            let r = c.get(d.url(path)).header("authorization", "Bearer wrong-token-wrong-token").send().unwrap();
            assert_eq!(r.status(), 401, "{path} with a wrong token");
        }
        let body: Value = c.get(d.url("/v1/sources")).header("authorization", "Bearer nope").send().unwrap().json().unwrap();
        assert_eq!(body["error"]["code"], "unauthorized");

        // Wait for the baseline run.
        let start = std::time::Instant::now();
        loop {
            let s: Value = c.get(d.url("/v1/sources")).header("authorization", &auth).send().unwrap().json().unwrap();
            if s["items"][0]["last_verdict"] == "baseline" {
                assert!(s["items"][0]["next_run"].is_string());
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "no baseline: {s}");
            std::thread::sleep(Duration::from_millis(50));
        }

        // Hostile subscriber requests: 400 with a message naming the problem.
        let post = |body: &str| c.post(d.url("/v1/subscribers")).header("authorization", &auth).header("content-type", "application/json").body(body.to_string()).send().unwrap();
        let aoi = json!({"type": "Polygon", "coordinates": [[[-71.2, 42.3], [-71.0, 42.3], [-71.0, 42.5], [-71.2, 42.3]]]});
        for (body, needle) in [
            ("{not json", "invalid JSON"),
            ("[]", "must be a JSON object"),
            (r#"["x", "http://h/", {}, null, null]"#, "must be a JSON object"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": aoi, "colour": "red"}).to_string(), "unknown field"),
            (&json!({"id": "x", "target": "ftp://h/", "aoi": aoi}).to_string(), "target"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": {"type": "Point", "coordinates": [0, 0]}}).to_string(), "aoi"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": {"type": "Polygon", "coordinates": [[[0, 0], [1, 1]]]}}).to_string(), "aoi"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": {"type": "Polygon", "coordinates": [[[-200, 0], [200, 0], [200, 95], [-200, 0]]]}}).to_string(), "WGS84"),
            (&json!({"id": "../etc", "target": rx.url("/api"), "aoi": aoi}).to_string(), "id"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": aoi, "min_severity": "loud"}).to_string(), "min_severity"),
            (&json!({"id": "x", "target": rx.url("/api"), "aoi": aoi, "secret": "whsec_!!"}).to_string(), "secret"),
        ] {
            let r = post(body);
            assert_eq!(r.status(), 400, "{body}");
            let e: Value = r.json().unwrap();
            assert!(e["error"]["message"].as_str().unwrap().contains(needle), "{body} → {e}");
        }
        let huge = format!("{{\"id\":\"x\",\"pad\":\"{}\"}}", "a".repeat(2 << 20));
        assert_eq!(post(&huge).status(), 413);
        // A body that trickles in is cut off at `[control] body_timeout` (1 s here) with a 408.
        {
            use std::io::{Read, Write};
            let addr = d.url("/").trim_start_matches("http://").trim_end_matches('/').to_string();
            let mut conn = std::net::TcpStream::connect(&addr).unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(conn, "POST /v1/subscribers HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{").unwrap();
            let mut head = [0u8; 12];
            conn.read_exact(&mut head).expect("an answer before the body is complete");
            assert_eq!(&head, b"HTTP/1.1 408");
        }

        // Subscriber CRUD; the index is rebuilt live.
        let r = post(&json!({"id": "api-watcher", "target": rx.url("/api"), "aoi": aoi, "min_severity": "info"}).to_string());
        assert_eq!(r.status(), 201);
        assert_eq!(post(&json!({"id": "api-watcher", "target": rx.url("/api"), "aoi": aoi}).to_string()).status(), 409);
        let got: Value = c.get(d.url("/v1/subscribers/api-watcher")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!((got["managed_by"].as_str(), got["min_severity"].as_str()), (Some("api"), Some("info")));
        let list: Value = c.get(d.url("/v1/subscribers")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(list["items"].as_array().unwrap().len(), 2);
        assert_eq!(c.delete(d.url("/v1/subscribers/cfg-watcher")).header("authorization", &auth).send().unwrap().status(), 409);
        assert_eq!(c.get(d.url("/v1/subscribers/nobody")).header("authorization", &auth).send().unwrap().status(), 404);

        // A rezoning of 20% is held; the API shows it; releasing it delivers to both watchers.
        let mut v2 = v1.clone();
        for p in v2.iter_mut().take(20) {
            p.zone = "M-1".into();
        }
        ws.write_layer(&layer(&v2));
        let run: Value = c.post(d.url("/v1/sources/s1/run")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(run["run"]["verdict"], "held", "{run}");
        let hold_id = run["run"]["hold_id"].as_u64().unwrap();
        let holds: Value = c.get(d.url("/v1/holds")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(holds["items"][0]["state"], "open");
        assert_eq!(c.post(d.url("/v1/holds/abc/release")).header("authorization", &auth).send().unwrap().status(), 400);
        assert_eq!(c.post(d.url("/v1/holds/999999/release")).header("authorization", &auth).send().unwrap().status(), 404);
        let rel = c.post(d.url(&format!("/v1/holds/{hold_id}/release"))).header("authorization", &auth).send().unwrap();
        assert_eq!(rel.status(), 200);
        assert_eq!(c.post(d.url(&format!("/v1/holds/{hold_id}/prime"))).header("authorization", &auth).send().unwrap().status(), 409);
        let start = std::time::Instant::now();
        while rx.received().len() < 40 {
            assert!(start.elapsed() < Duration::from_secs(20), "only {} deliveries", rx.received().len());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(rx.received().iter().filter(|r| r.path == "/api").count(), 20);
        assert_eq!(c.post(d.url("/v1/sources/nope/run")).header("authorization", &auth).send().unwrap().status(), 404);

        // Runs, audit with filters and cursors, watermarks, changes.
        let runs: Value = c.get(d.url("/v1/runs?source=s1&limit=1")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(runs["items"].as_array().unwrap().len(), 1);
        let cursor = runs["next_cursor"].as_str().unwrap();
        let more: Value = c.get(d.url(&format!("/v1/runs?source=s1&limit=10&cursor={cursor}"))).header("authorization", &auth).send().unwrap().json().unwrap();
        assert!(more["items"].as_array().unwrap().iter().all(|r| r["run_id"].as_u64().unwrap() < cursor.parse::<u64>().unwrap()));
        assert_eq!(c.get(d.url("/v1/runs?limit=abc")).header("authorization", &auth).send().unwrap().status(), 400);
        // The receiver has the webhook before the deliverer commits its `sent` row (the
        // outcome commit follows the response): wait for the row, not for the receipt.
        let start = std::time::Instant::now();
        let a: Value = loop {
            let a: Value = c.get(d.url("/v1/audit?parcel=P0003&watcher=api-watcher")).header("authorization", &auth).send().unwrap().json().unwrap();
            if a["items"].as_array().unwrap().len() >= 2 || start.elapsed() > Duration::from_secs(20) {
                break a;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let outcomes: Vec<&str> = a["items"].as_array().unwrap().iter().map(|r| r["outcome"].as_str().unwrap()).collect();
        assert_eq!(outcomes, vec!["queued", "sent"]);
        let key = a["items"][0]["idempotency_key"].as_str().unwrap().to_string();
        let by_key: Value = c.get(d.url(&format!("/v1/audit?key={key}"))).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(by_key["items"].as_array().unwrap().len(), 2);
        assert_eq!(c.get(d.url("/v1/audit?since=yesterday")).header("authorization", &auth).send().unwrap().status(), 400);
        // Every outcome the ledger can hold is a filter (the endpoint ones too); others are refused.
        let sent: Value = c.get(d.url("/v1/audit?outcome=sent,endpoint_disabled,endpoint_enabled")).header("authorization", &auth).send().unwrap().json().unwrap();
        let kinds: Vec<&str> = sent["items"].as_array().unwrap().iter().map(|r| r["outcome"].as_str().unwrap()).collect();
        assert!(!kinds.is_empty() && kinds.iter().all(|k| *k == "sent"), "{kinds:?}");
        assert_eq!(c.get(d.url("/v1/audit?outcome=sent,delivered")).header("authorization", &auth).send().unwrap().status(), 400);
        let wm: Value = c.get(d.url("/v1/sources/s1/watermarks")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(wm["items"].as_array().unwrap().len(), 2);
        let ch: Value = c.get(d.url("/v1/changes/recent?limit=5")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(ch["items"].as_array().unwrap().len(), 5);
        assert!(ch["items"][0]["geometry"]["type"].is_string());

        // Metrics.
        let m = c.get(d.url("/metrics")).header("authorization", &auth).send().unwrap();
        assert!(m.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
        let text = m.text().unwrap();
        for needle in ["zonewatch_runs_total{source=\"s1\",verdict=\"baseline\"} 1", "zonewatch_outcomes_total{outcome=\"sent\"} 40", "zonewatch_outbox_depth 0",
            "zonewatch_holds{state=\"released\"} 1", "zonewatch_delivery_latency_seconds_count 40"] {
            assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
        }

        // Dead-letter replay over the API (nothing dead here: an empty, well-formed answer).
        let r: Value = c.post(d.url("/v1/deadletters/replay")).header("authorization", &auth).body("{\"since\": \"2020-01-01T00:00:00Z\"}").send().unwrap().json().unwrap();
        assert_eq!((r["requeued"].as_u64(), r["duplicates"].as_u64()), (Some(0), Some(0)), "{r}");
        assert_eq!(c.post(d.url("/v1/deadletters/replay")).header("authorization", &auth).body("{\"ids\": \"x\"}").send().unwrap().status(), 400);
        assert!(text.contains("# TYPE zonewatch_endpoint_breaker_state gauge"));

        // Unknown routes and methods.
        assert_eq!(c.get(d.url("/v1/nothing")).header("authorization", &auth).send().unwrap().status(), 404);
        assert_eq!(c.delete(d.url("/v1/sources")).header("authorization", &auth).send().unwrap().status(), 405);

        // Backup while running: over the API and with the CLI (which asks the daemon).
        let b = c.post(d.url("/v1/backup")).header("authorization", &auth).body("").send().unwrap();
        assert_eq!(b.status(), 201);
        let info: Value = b.json().unwrap();
        assert!(info["rows"].as_u64().unwrap() > 100);
        // Its path is absolute (a client's working directory is not the daemon's).
        assert!(std::path::Path::new(info["path"].as_str().unwrap()).is_absolute(), "{info}");
        // A name too long says so.
        let long = serde_json::json!({ "name": format!("{}.redb", "b".repeat(300)) }).to_string();
        let b = c.post(d.url("/v1/backup")).header("authorization", &auth).body(long).send().unwrap();
        assert_eq!(b.status(), 400);
        assert!(b.text().unwrap().contains("at most 64 characters"));
        let dest = ws.path().join("copy.redb");
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
            .args(["backup", dest.to_str().unwrap(), "--config", ws.config_path().to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        // Restore refuses while the daemon holds the store.
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
            .args(["restore", dest.to_str().unwrap(), "--config", ws.config_path().to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&o.stderr).contains("in use"), "{}", String::from_utf8_lossy(&o.stderr));

        // Real Prometheus parser and schemathesis, when installed.
        if let Some(py) = peer_python() {
            let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/check_metrics.py");
            let o = std::process::Command::new(&py).arg(&script).arg(d.url("/metrics")).arg(&d.token).output().unwrap();
            assert!(o.status.success(), "prometheus_client parse failed:\n{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            let st = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/peers/venv/bin/schemathesis");
            let o = std::process::Command::new(st)
                .args(["run", &d.url("/v1/openapi.json"), "--header", &format!("Authorization: {auth}"), "--checks", "all",
                       "--exclude-checks", "ignored_auth,positive_data_acceptance", "--max-examples", "30", "--seed", "1",
                       "--no-color"])
                .env("SCHEMATHESIS_HOOKS", "")
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "schemathesis found problems:\n{out}\n{}", String::from_utf8_lossy(&o.stderr));
            eprintln!("schemathesis:\n{}", out.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    });

    let log = tokio::task::block_in_place(|| d.stop());
    assert!(log.contains("stopped cleanly"), "{log}");

    // Stopped: the backup restores over the store and the data is all there.
    let dest = ws.path().join("copy.redb");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["restore", dest.to_str().unwrap(), "--config", ws.config_path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let engine = ws.engine();
    assert_eq!(outcomes(&engine).get("sent"), Some(&40));
    assert_eq!(engine.store.stored_subscribers().unwrap().len(), 1);
}

/// Polls `f` every 50 ms until it is true; fails naming `what` after 20 s.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// API subscribers whose endpoint answered 410: `GET /v1/endpoints` shows them disabled; a
/// `PUT` with the same target leaves it disabled, one with a new target re-enables it
/// (audited, the waiting events go to the new URL); `POST /v1/endpoints/{id}/enable` is
/// the command line's enable; `DELETE` dead-letters the subscriber's queued events
/// `subscriber_deleted` instead of leaving them in the outbox forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_endpoints_are_listed_re_enabled_by_a_new_target_and_deleted_without_stranding_events() {
    let gone = receiver(410).await;
    let good = receiver(200).await;
    // No replay allowed: a replayed dead letter goes straight to quarantine (the release below).
    let ws = Workspace::new(&[], "retry_schedule = [\"50ms\", \"50ms\"]\nmax_replays = 0", "every = \"1h\"");
    let v1 = grid(30);
    ws.write_layer(&layer(&v1));
    let d = tokio::task::block_in_place(|| Daemon::start(&ws));
    let c = client();
    let auth = format!("Bearer {}", d.token);
    tokio::task::block_in_place(|| {
        let get = |path: &str| -> Value { c.get(d.url(path)).header("authorization", &auth).send().unwrap().json().unwrap() };
        wait_for("the baseline", || get("/v1/sources")["items"][0]["last_verdict"] == "baseline");
        let aoi = json!({"type": "Polygon", "coordinates": [[[-71.2, 42.3], [-71.0, 42.3], [-71.0, 42.5], [-71.2, 42.5], [-71.2, 42.3]]]});
        for id in ["api-1", "api-2"] {
            let r = c.post(d.url("/v1/subscribers")).header("authorization", &auth).json(&json!({"id": id, "target": gone.url("/gone"), "aoi": aoi, "min_severity": "info"})).send().unwrap();
            assert_eq!(r.status(), 201);
        }
        let mut v2 = v1.clone();
        v2[0].zone = "C3".into();
        v2[4].zone = "C3".into();
        ws.write_layer(&layer(&v2));
        let run: Value = c.post(d.url("/v1/sources/s1/run")).header("authorization", &auth).send().unwrap().json().unwrap();
        assert_eq!(run["run"]["queued"], 4, "{run}");
        let state = |id: &str| -> Value {
            let eps = get("/v1/endpoints");
            eps["items"].as_array().unwrap().iter().find(|e| e["id"] == id).cloned().unwrap_or(Value::Null)
        };
        wait_for("both endpoints disabled", || state("api-1")["state"] == "disabled" && state("api-2")["state"] == "disabled");
        let e1 = state("api-1");
        assert_eq!((e1["managed_by"].as_str(), e1["disabled_reason"].as_str(), e1["target"].as_str()), (Some("api"), Some("http_410_gone"), Some(gone.url("/gone").as_str())));

        // The same target again: still disabled.
        let put = |target: String| c.put(d.url("/v1/subscribers/api-1")).header("authorization", &auth).json(&json!({"target": target, "aoi": aoi, "min_severity": "info"})).send().unwrap();
        assert_eq!(put(gone.url("/gone")).status(), 200);
        assert_eq!(state("api-1")["state"], "disabled");
        // A new target: enabled, audited with why, the two waiting events go to it.
        assert_eq!(put(good.url("/new")).status(), 200);
        wait_for("api-1's events at its new target", || good.received().len() == 2);
        assert_eq!(state("api-1")["state"], "enabled");
        let audit = get("/v1/audit?outcome=endpoint_enabled");
        let rows = audit["items"].as_array().unwrap();
        assert!(rows.len() == 1 && rows[0]["watcher_id"] == "api-1" && rows[0]["detail"].as_str().unwrap().contains("target changed"), "{audit}");

        // The control port's enable: as the command line's (not disabled now: a reset).
        let r = c.post(d.url("/v1/endpoints/api-1/enable")).header("authorization", &auth).send().unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().unwrap();
        assert_eq!((body["was_disabled"].as_bool(), body["endpoint"]["state"].as_str()), (Some(false), Some("enabled")), "{body}");
        assert_eq!(c.post(d.url("/v1/endpoints/nobody/enable")).header("authorization", &auth).send().unwrap().status(), 404);
        assert_eq!(c.get(d.url("/v1/endpoints/api-1/enable")).header("authorization", &auth).send().unwrap().status(), 405);

        // Deleting api-2 (disabled, two events waiting): they are dead letters now.
        let r = c.delete(d.url("/v1/subscribers/api-2")).header("authorization", &auth).send().unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().unwrap();
        assert_eq!((body["deleted"].as_str(), body["dead_lettered"].as_u64(), body["in_flight"].as_u64()), (Some("api-2"), Some(2), Some(0)), "{body}");
        let dead = get("/v1/deadletters");
        let dead = dead["items"].as_array().unwrap();
        assert!(dead.len() == 2 && dead.iter().all(|x| x["watcher_id"] == "api-2" && x["reason"] == "subscriber_deleted"), "{dead:?}");
        assert!(state("api-2").is_null(), "a deleted subscriber's endpoint is not listed");

        // Quarantine and its way out: a replay past max_replays (0 here) sets one aside; it
        // is listed, and released it is a dead letter again (audited), to be replayed later.
        let id0 = dead[0]["id"].as_u64().unwrap();
        let r: Value = c.post(d.url("/v1/deadletters/replay")).header("authorization", &auth).json(&json!({"ids": [id0]})).send().unwrap().json().unwrap();
        assert_eq!(r["quarantined"].as_u64(), Some(1), "{r}");
        let q = get("/v1/deadletters/quarantined");
        let q = q["items"].as_array().unwrap();
        assert!(q.len() == 1 && q[0]["id"].as_u64() == Some(id0) && q[0]["reason"].as_str().unwrap().contains("max_replays 0"), "{q:?}");
        assert_eq!(get("/v1/deadletters")["items"].as_array().unwrap().len(), 1);
        let release = |body: Value| c.post(d.url("/v1/deadletters/release")).header("authorization", &auth).json(&body).send().unwrap();
        let r = release(json!({"ids": [id0, 424242]}));
        assert_eq!(r.status(), 200);
        let r: Value = r.json().unwrap();
        assert_eq!((r["released"].as_u64(), r["not_found"].as_u64()), (Some(1), Some(1)), "{r}");
        assert!(r["items"][0]["quarantine_reason"].as_str().unwrap().contains("max_replays 0"), "{r}");
        assert_eq!(r["items"][1], json!({"id": 424242, "outcome": "not_found"}));
        assert!(get("/v1/deadletters/quarantined")["items"].as_array().unwrap().is_empty());
        let back = get("/v1/deadletters");
        let back = back["items"].as_array().unwrap();
        assert!(back.len() == 2 && back.iter().any(|x| x["id"].as_u64() == Some(id0) && x["reason"].as_str().unwrap().starts_with("released from quarantine")), "{back:?}");
        let audit = get("/v1/audit?outcome=released");
        assert!(audit["items"].as_array().unwrap().iter().any(|x| x["detail"].as_str().unwrap().contains("released from quarantine")), "{audit}");
        assert_eq!(release(json!({"ids": []})).status(), 400);
        assert_eq!(release(json!({"id": id0})).status(), 400);
        assert_eq!(c.get(d.url("/v1/deadletters/release")).header("authorization", &auth).send().unwrap().status(), 405);
        let metrics = c.get(d.url("/metrics")).header("authorization", &auth).send().unwrap().text().unwrap();
        assert!(metrics.lines().any(|l| l.starts_with("zonewatch_outbox_depth") && l.trim_end().ends_with(" 0")), "{metrics}");
    });
    let log = tokio::task::block_in_place(|| d.stop());
    drop(log);
    let engine = ws.engine();
    assert!(engine.store.check_consistency().unwrap().is_consistent());
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
}
