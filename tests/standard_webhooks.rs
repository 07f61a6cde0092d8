//! Signing checked by the official verifier: real deliveries go to a loopback receiver written
//! in Python around the `standardwebhooks` package from PyPI (installed by `scripts/test` into
//! `target/pyvenv` at a pinned version). A subscriber in secret rotation gets both signatures,
//! each verifying with its own secret; a tampered body fails; a plain subscriber's old secret
//! does not verify.

mod common;
use common::*;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const NEW: &str = "whsec_em9uZXdhdGNoLXJvdGF0aW9uLW5ldy1rZXktMQ==";
const OLD: &str = "whsec_em9uZXdhdGNoLXJvdGF0aW9uLW9sZC1rZXktMA==";
const PLAIN: &str = "whsec_em9uZXdhdGNoLXBsYWluLXN1YnNjcmliZXItMg==";

/// The Python with `standardwebhooks`: `ZONEWATCH_PYTHON`, else `target/pyvenv/bin/python`.
fn python() -> String {
    let py = std::env::var("ZONEWATCH_PYTHON")
        .unwrap_or_else(|_| format!("{}/target/pyvenv/bin/python", env!("CARGO_MANIFEST_DIR")));
    let ok = Command::new(&py)
        .args(["-c", "import standardwebhooks.webhooks"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "{py} cannot import standardwebhooks: run scripts/test (it installs the pinned verifier into target/pyvenv)");
    py
}

struct Peer {
    child: Child,
    port: u16,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_peer(new: &str, old: &str, out: &std::path::Path) -> Peer {
    let script = format!("{}/tests/peers/sw_verify_receiver.py", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(python())
        .args([script.as_str(), "--new", new, "--old", old, "--out", out.to_str().expect("utf-8")])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python receiver starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("port line");
    let port = line.trim().strip_prefix("PORT ").and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("bad port line {line:?}"));
    Peer { child, port }
}

fn records(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_verifier_accepts_rotated_and_plain_signatures_and_rejects_tampering() {
    let dir = tempfile::tempdir().unwrap();
    let (out_rot, out_plain) = (dir.path().join("rot.jsonl"), dir.path().join("plain.jsonl"));
    let rot = start_peer(NEW, OLD, &out_rot);
    let plain = start_peer(PLAIN, OLD, &out_plain);
    let area = rect(-71.2, 42.3, -71.0, 42.5);
    let ws = Workspace::new(
        &[
            Sub { id: "rot", aoi: area.clone(), target: format!("http://127.0.0.1:{}/hook", rot.port), min_severity: "info", secret: Some(NEW) },
            Sub { id: "plain", aoi: area, target: format!("http://127.0.0.1:{}/hook", plain.port), min_severity: "info", secret: Some(PLAIN) },
        ],
        "",
        "",
    );
    ws.edit_config(&format!("secret = \"{NEW}\""), &format!("secret = \"{NEW}\"\nsecret_old = \"{OLD}\""));
    let engine = ws.engine();
    let v1 = grid(30);
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let mut v2 = v1.clone();
    for i in [0, 4, 8] {
        v2[i].zone = "C3".into();
    }
    ws.write_layer(&layer(&v2));
    assert_eq!(run(&engine, false).record.counts.queued, 6);
    let stats = deliver(&engine, Duration::from_secs(10)).await;
    // The receivers answer 200 only when the official verifier accepted the new signature.
    assert_eq!((stats.sent, stats.dead), (6, 0), "{stats:?}");

    let rot_recs = records(&out_rot);
    assert_eq!(rot_recs.len(), 3);
    for r in &rot_recs {
        assert_eq!(r["signatures"], 2, "rotation sends both signatures: {r}");
        assert_eq!(r["new_ok"], true, "{r}");
        assert_eq!(r["old_ok"], true, "the old secret still verifies during rotation: {r}");
        assert_eq!(r["tampered_differs"], true);
        assert_eq!(r["tampered_ok"], false, "a tampered body must fail: {r}");
    }
    let plain_recs = records(&out_plain);
    assert_eq!(plain_recs.len(), 3);
    for r in &plain_recs {
        assert_eq!(r["signatures"], 1, "{r}");
        assert_eq!(r["new_ok"], true, "{r}");
        assert_eq!(r["old_ok"], false, "another secret must not verify: {r}");
        assert_eq!(r["tampered_ok"], false, "{r}");
    }
}

#[test]
fn secret_old_without_secret_is_a_config_error() {
    let ws = Workspace::new(
        &[Sub { id: "x", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: "http://127.0.0.1:9/h".into(), min_severity: "info", secret: None }],
        "",
        "",
    );
    ws.edit_config("min_severity = \"info\"", &format!("min_severity = \"info\"\nsecret_old = \"{OLD}\""));
    let err = zonewatch::config::Config::load(&ws.config_path()).unwrap_err().to_string();
    assert!(err.contains("secret_old needs `secret`"), "{err}");
}
