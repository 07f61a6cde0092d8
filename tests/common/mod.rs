//! Shared test scaffolding: temp workspaces with a config, small hand-made layers, and the real
//! loopback webhook receiver from `zonewatch::receiver`.
#![allow(dead_code)]

pub mod fuzz;

use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zonewatch::config::Config;
use zonewatch::notify::delivery::{Deliverer, PassStats};
use zonewatch::pipeline::{Engine, RunOptions, SourceReport};

/// A temp folder with `layer.geojson`, `aoi/` and a config pointing at them.
pub struct Workspace {
    pub dir: tempfile::TempDir,
}

/// One parcel of a hand-made layer: id, zoning, closed ring.
#[derive(Clone, Debug)]
pub struct P {
    pub id: String,
    pub zone: String,
    pub ring: Vec<[f64; 2]>,
}

/// A square parcel of side `s` degrees with its south-west corner at (x, y).
pub fn square(id: &str, zone: &str, x: f64, y: f64, s: f64) -> P {
    P { id: id.into(), zone: zone.into(), ring: vec![[x, y], [x + s, y], [x + s, y + s], [x, y + s], [x, y]] }
}

/// A grid of `n` 0.001° squares starting at (-71.10, 42.36), zones cycling R-1/C-1/R-2.
pub fn grid(n: usize) -> Vec<P> {
    let zones = ["R-1", "C-1", "R-2"];
    (0..n)
        .map(|i| {
            let (cx, cy) = ((i % 20) as f64, (i / 20) as f64);
            square(&format!("P{i:04}"), zones[i % 3], -71.10 + cx * 0.001, 42.36 + cy * 0.001, 0.0009)
        })
        .collect()
}

/// A FeatureCollection with `APN`, `ZONE_CODE` (or `zone_field`) properties.
pub fn layer_with_field(parcels: &[P], zone_field: &str) -> String {
    let features: Vec<_> = parcels
        .iter()
        .map(|p| {
            let mut props = serde_json::Map::new();
            props.insert("APN".into(), json!(p.id));
            props.insert(zone_field.into(), json!(p.zone));
            json!({"type": "Feature", "properties": props, "geometry": {"type": "Polygon", "coordinates": [p.ring]}})
        })
        .collect();
    json!({"type": "FeatureCollection", "features": features}).to_string()
}

pub fn layer(parcels: &[P]) -> String {
    layer_with_field(parcels, "ZONE_CODE")
}

/// A subscriber entry for `Workspace::new`.
pub struct Sub {
    pub id: &'static str,
    pub aoi: serde_json::Value,
    pub target: String,
    pub min_severity: &'static str,
    pub secret: Option<&'static str>,
}

pub fn rect(x0: f64, y0: f64, x1: f64, y1: f64) -> serde_json::Value {
    json!({"type": "Polygon", "coordinates": [[[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]]})
}

impl Workspace {
    /// Writes a config with one file source `s1` and the given subscribers. `extra_delivery`
    /// is appended to `[delivery]`, `extra_source` to the `[[source]]` table.
    pub fn new(subs: &[Sub], extra_delivery: &str, extra_source: &str) -> Workspace {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("aoi")).expect("aoi dir");
        let mut toml = format!(
            r#"
[store]
path = "zw.redb"
[control]
listen = "127.0.0.1:0"
[delivery]
concurrency = 4
max_attempts = 3
base_delay_ms = 20
max_delay_ms = 100
timeout_ms = 2000
run_wait = "5s"
allow_private_targets = true
{extra_delivery}
[[source]]
id = "s1"
jurisdiction = "testville"
kind = "file"
path = "layer.geojson"
bbox = [-72.0, 42.0, -70.0, 43.0]
max_change_ratio = 0.5
{extra_source}
[source.fields]
parcel_id = "APN"
zoning = "ZONE_CODE"
"#
        );
        for s in subs {
            let aoi = format!("aoi/{}.geojson", s.id);
            std::fs::write(dir.path().join(&aoi), s.aoi.to_string()).expect("aoi");
            toml.push_str(&format!(
                "[[subscriber]]\nid = \"{}\"\naoi = \"{aoi}\"\ntarget = \"{}\"\nmin_severity = \"{}\"\n",
                s.id, s.target, s.min_severity
            ));
            if let Some(secret) = s.secret {
                toml.push_str(&format!("secret = \"{secret}\"\n"));
            }
        }
        std::fs::write(dir.path().join("zonewatch.toml"), toml).expect("config");
        Workspace { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("zonewatch.toml")
    }

    pub fn write_layer(&self, text: &str) {
        std::fs::write(self.dir.path().join("layer.geojson"), text).expect("layer");
    }

    /// Writes the layer as raw bytes (not necessarily UTF-8: a damaged feed).
    pub fn write_layer_bytes(&self, bytes: &[u8]) {
        std::fs::write(self.dir.path().join("layer.geojson"), bytes).expect("layer");
    }

    pub fn config(&self) -> Config {
        Config::load(&self.config_path()).expect("config loads")
    }

    pub fn engine(&self) -> Engine {
        Engine::open(self.config()).expect("engine opens")
    }

    /// An engine whose time is `clock` (a manual clock: the test moves time itself).
    pub fn engine_at(&self, clock: zonewatch::clock::SharedClock) -> Engine {
        Engine::open_with_clock(self.config(), clock).expect("engine opens")
    }

    /// Rewrites the config text with a replacement (e.g. to map a renamed field).
    pub fn edit_config(&self, from: &str, to: &str) {
        let text = std::fs::read_to_string(self.config_path()).expect("read config");
        assert!(text.contains(from), "config has no {from:?}");
        std::fs::write(self.config_path(), text.replace(from, to)).expect("write config");
    }
}

/// Runs source `s1` once.
pub fn run(engine: &Engine, reprocess: bool) -> SourceReport {
    engine.run_source_id("s1", RunOptions { reprocess, ..Default::default() }).expect("run succeeds")
}

/// Delivers until the outbox is empty or `wait` passes.
pub async fn deliver(engine: &Engine, wait: Duration) -> PassStats {
    let d = Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone())
        .expect("deliverer")
        .with_clock(engine.clock.clone());
    d.drain(Instant::now() + wait).await.expect("drain")
}

/// A receiver answering every request with `status`.
pub async fn receiver(status: u16) -> zonewatch::receiver::Receiver {
    zonewatch::receiver::Receiver::start(Arc::new(move |_, _| status), None).await.expect("receiver starts")
}

/// Counts audit rows by outcome name.
pub fn outcomes(engine: &Engine) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for r in engine.store.audit(&Default::default()).expect("audit") {
        *m.entry(r.outcome.as_str().to_string()).or_insert(0) += 1;
    }
    m
}

/// A running `zonewatch serve` child process with its control port address and token.
pub struct Daemon {
    pub child: std::process::Child,
    pub addr: String,
    pub token: String,
}

impl Daemon {
    /// Starts `zonewatch serve` for the workspace and waits for its control port.
    pub fn start(ws: &Workspace) -> Daemon {
        Daemon::spawn(ws, std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["serve", "--config", ws.config_path().to_str().expect("utf-8 path")]))
    }

    /// Starts `zonewatch serve` as an operator in the workspace's folder would, with a
    /// relative `--config` (so its store's path is relative to its own working directory).
    pub fn start_in_its_folder(ws: &Workspace) -> Daemon {
        let name = ws.config_path().file_name().expect("config file name").to_owned();
        Daemon::spawn(ws, std::process::Command::new(env!("CARGO_BIN_EXE_zonewatch")).current_dir(ws.path()).arg("serve").arg("--config").arg(name))
    }

    fn spawn(ws: &Workspace, command: &mut std::process::Command) -> Daemon {
        // Owned by a Daemon from the start, so that if the wait below panics (no control
        // port in time, no token file) its Drop kills and reaps the child rather than
        // leaving a running `serve` behind.
        let mut daemon = Daemon {
            child: command
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("serve starts"),
            addr: String::new(),
            token: String::new(),
        };
        let addr_file = ws.path().join("zw.control-addr");
        let start = Instant::now();
        loop {
            if let Ok(a) = std::fs::read_to_string(&addr_file) {
                if !a.trim().is_empty() {
                    daemon.token = std::fs::read_to_string(ws.path().join("control.token")).expect("token file").trim().to_string();
                    daemon.addr = a.trim().to_string();
                    return daemon;
                }
            }
            assert!(start.elapsed() < Duration::from_secs(20), "serve did not open its control port");
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Sends SIGTERM and waits for a clean exit; returns the stderr log.
    pub fn stop(mut self) -> String {
        let pid = self.child.id().to_string();
        let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                break s;
            }
            assert!(start.elapsed() < Duration::from_secs(15), "serve did not stop after SIGTERM");
            std::thread::sleep(Duration::from_millis(30));
        };
        let mut log = String::new();
        use std::io::Read;
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut log);
        }
        assert!(status.success(), "serve exited with {status:?}\n{log}");
        log
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
