//! `zonewatch demo`: the whole product in thirty seconds, on a fresh machine, with nothing to
//! configure. A temp store, the bundled demo county (`fixtures/demo/`, embedded in the binary)
//! and a real webhook receiver on 127.0.0.1 that prints what it receives. Four steps — baseline,
//! re-publish, rezoning, replay — then a summary. The demo checks its own expectations and
//! exits non-zero if any step misbehaves.

use crate::config::Config;
use crate::notify::delivery::Deliverer;
use crate::notify::signing;
use crate::pipeline::{Engine, RunOptions};
use crate::receiver::{Received, Receiver};
use anyhow::{bail, Context};
use std::sync::Arc;
use std::time::{Duration, Instant};

const COUNTY_V1: &[u8] = include_bytes!("../fixtures/demo/county-v1.geojson");
const COUNTY_V2: &[u8] = include_bytes!("../fixtures/demo/county-v2.geojson");
const AOI_PORTFOLIO: &[u8] = include_bytes!("../fixtures/demo/aoi/portfolio-7.geojson");
const AOI_NEIGHBOURS: &[u8] = include_bytes!("../fixtures/demo/aoi/neighbours-3.geojson");
const AOI_COUNTY: &[u8] = include_bytes!("../fixtures/demo/aoi/county-planning.geojson");
const SECRET: &str = "whsec_ZGVtby1zZWNyZXQtZm9yLXpvbmV3YXRjaC1kZW1v";

fn print_alert(r: &Received) {
    let Some(body) = r.json() else {
        println!("    <- received a request that is not JSON ({} bytes)", r.body.len());
        return;
    };
    let d = &body["data"];
    let signed = match (r.header("webhook-id"), r.header("webhook-timestamp"), r.header("webhook-signature")) {
        (Some(id), Some(ts), Some(sig)) => {
            let ok = signing::decode_secret(SECRET)
                .ok()
                .zip(ts.parse::<u64>().ok())
                .map(|(k, ts)| signing::sign(&k, id, ts, &r.body) == sig)
                .unwrap_or(false);
            if ok { "signature ok" } else { "SIGNATURE BAD" }
        }
        _ => "unsigned",
    };
    println!(
        "    <- {:<16} {}  {:<8} {:>4} -> {:<4}  {:<8}  {:>7.0} m²  ({signed})",
        d["watcher_id"].as_str().unwrap_or("?"),
        d["parcel_id"].as_str().unwrap_or("?"),
        d["change"].as_str().unwrap_or("?"),
        d["from"].as_str().unwrap_or("-"),
        d["to"].as_str().unwrap_or("-"),
        d["severity"].as_str().unwrap_or("?"),
        d["area_m2"].as_f64().unwrap_or(0.0),
    );
}

/// Runs the demo; prints every step.
pub fn run_demo() -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir().context("creating a temp folder")?;
    let root = dir.path();
    std::fs::create_dir_all(root.join("aoi"))?;
    std::fs::write(root.join("aoi/portfolio-7.geojson"), AOI_PORTFOLIO)?;
    std::fs::write(root.join("aoi/neighbours-3.geojson"), AOI_NEIGHBOURS)?;
    std::fs::write(root.join("aoi/county-planning.geojson"), AOI_COUNTY)?;
    let layer = root.join("county.geojson");

    let rt = crate::util::async_runtime(true)?;
    rt.block_on(async move {
        let receiver = Receiver::start(Arc::new(|_, _| 200), Some(Arc::new(print_alert))).await?;
        let url = receiver.url("/hooks/zoning");
        let toml = format!(
            r#"
[store]
path = "demo.redb"
[delivery]
concurrency = 8
base_delay_ms = 100
max_delay_ms = 1000
timeout_ms = 5000
run_wait = "10s"
allow_private_targets = true   # the demo receiver is on 127.0.0.1
[[source]]
id = "demo-county-parcels"
jurisdiction = "demo-county"
kind = "file"
path = "county.geojson"
every = "1h"
bbox = [-93.40, 44.90, -93.10, 45.10]
max_change_ratio = 0.05
[source.fields]
parcel_id = "APN"
zoning = "ZONE_CODE"
effective_date = "EFF_DATE"
[[subscriber]]
id = "portfolio-7"
aoi = "aoi/portfolio-7.geojson"
target = "{url}"
secret = "{SECRET}"
min_severity = "notice"
[[subscriber]]
id = "neighbours-3"
aoi = "aoi/neighbours-3.geojson"
target = "{url}"
secret = "{SECRET}"
min_severity = "info"
[[subscriber]]
id = "county-planning"
aoi = "aoi/county-planning.geojson"
target = "{url}"
secret = "{SECRET}"
min_severity = "material"
"#
        );
        let config = Config::parse_str(&toml, root)?;
        let engine = Engine::open(config)?;
        let deliverer = Deliverer::new(engine.store.clone(), engine.subscribers.clone(), engine.config.delivery.clone()).map(|d| d.with_clock(engine.clock.clone()))?;
        println!("zonewatch demo: store {}, webhook receiver {url}", engine.store.path().display());
        println!("subscribers: portfolio-7 (notice+), neighbours-3 (info+), county-planning (whole county, material+)\n");

        let republished = crate::synth::republish(COUNTY_V1, 42).map_err(anyhow::Error::msg)?;
        let steps: [(&str, &[u8], bool); 4] = [
            ("1. baseline ingest of the county layer (v1): snapshot stored, nothing sent", COUNTY_V1, false),
            ("2. the county re-publishes v1: features reordered, numbers reformatted, rings rotated", &republished, false),
            ("3. v2 with a handful of rezonings", COUNTY_V2, true),
            ("4. v2 again (a replay)", COUNTY_V2, false),
        ];
        for (title, bytes, expect_alerts) in steps {
            println!("{title}");
            std::fs::write(&layer, bytes)?;
            let before = receiver.received().len();
            let e = &engine;
            let report = tokio::task::block_in_place(|| e.run_source_id("demo-county-parcels", RunOptions::default()))?;
            println!("   {}", report.line());
            let stats = deliverer.drain(Instant::now() + Duration::from_secs(10)).await?;
            let got = receiver.received().len() - before;
            println!("   alerts received: {got} (sent {}, retried {}, dead letters {})\n", stats.sent, stats.retried, stats.dead);
            if expect_alerts && got == 0 {
                bail!("step expected alerts but none arrived");
            }
            if !expect_alerts && got != 0 {
                bail!("step expected silence but {got} alert(s) arrived");
            }
        }

        let s = engine.store.stats()?;
        println!("summary");
        println!("  {:<14} {:>6}", "runs", s.runs);
        println!("  {:<14} {:>6}", "changes", s.changes);
        println!("  {:<14} {:>6}", "sent", s.sent);
        println!("  {:<14} {:>6}", "duplicates", s.duplicates);
        println!("  {:<14} {:>6}", "suppressed", s.suppressed);
        println!("  {:<14} {:>6}", "dead letters", s.dead_letters);
        println!("  {:<14} {:>6}", "outbox left", s.outbox);
        println!(
            "\ndone in {:.1}s. The demo's store was a temporary file and is removed now; with your own config every outcome is in the audit ledger (`zonewatch audit --config FILE`).",
            started.elapsed().as_secs_f64()
        );
        if s.outbox != 0 || s.dead_letters != 0 {
            bail!("the outbox should be empty and there should be no dead letters");
        }
        Ok(())
    })
}
