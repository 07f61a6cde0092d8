//! Progress of long ingests when stdout is not a terminal: plain `progress:` lines on stderr,
//! rate-limited, none for a short run, never mixed into the result lines on stdout and never
//! raw text among JSON logs.

mod common;
use common::*;
use std::process::{Command, Output};
use zonewatch::synth::{generate_county, to_geojson, CountySpec};

fn run_cli(ws: &Workspace, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zonewatch"));
    c.args(extra).args(["run", "--config", ws.config_path().to_str().expect("utf-8 path")]);
    c.env_remove("ZONEWATCH_LOG").env_remove("ZONEWATCH_PROGRESS_EVERY");
    for (k, v) in env {
        c.env(k, v);
    }
    // `output()` pipes stdout and stderr: neither is a terminal.
    c.output().expect("binary runs")
}

/// A synthetic county of `n` parcels inside the workspace's bbox.
fn county(n: usize) -> String {
    let parcels = generate_county(&CountySpec { seed: 11, parcels: n, origin: [-71.5, 42.2], blocks_per_row: 12 });
    to_geojson(&parcels, "2024-01-01")
}

#[test]
fn plain_progress_lines_on_stderr_keep_stdout_clean() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&county(20_000));
    // A short interval so the test does not depend on how fast this machine parses.
    let o = run_cli(&ws, &[], &[("ZONEWATCH_PROGRESS_EVERY", "1ms")]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");

    // stdout: exactly the result lines scripts parse, untouched.
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("s1: baseline features=20000 ") && lines[0].contains(" queued=0 "), "{out}");
    assert!(lines[1].starts_with("delivery: sent=0"), "{out}");
    assert!(!out.contains("progress"), "{out}");

    // stderr: at least one in-flight line and one done line, each a whole line, positions
    // non-decreasing and the done line last with the full count.
    let progress: Vec<&str> = err.lines().filter(|l| l.starts_with("progress: s1 ")).collect();
    assert!(progress.len() >= 2, "no progress lines:\n{err}");
    assert!(err.lines().all(|l| l.starts_with("progress: s1 ")), "only progress lines expected on stderr:\n{err}");
    let count = |l: &str| -> u64 {
        let rest = l.trim_start_matches("progress: s1 ").trim_start_matches("done: ");
        rest.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no feature count in {l:?}"))
    };
    let counts: Vec<u64> = progress.iter().map(|l| count(l)).collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    let last = progress.last().expect("a line");
    assert!(last.starts_with("progress: s1 done: 20000 features, "), "{last}");
    assert!(last.contains("(100%)") || last.contains("(99%)"), "{last}");
    for l in &progress[..progress.len() - 1] {
        assert!(l.contains(" MiB of ") && l.contains("%)"), "{l}");
    }
}

#[test]
fn a_short_run_prints_no_progress_and_json_logs_stay_json() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&grid(50)));
    // Default interval (seconds): a 50-parcel run is over long before the first line is due.
    let o = run_cli(&ws, &[], &[]);
    assert!(o.status.success());
    assert!(!String::from_utf8_lossy(&o.stderr).contains("progress"), "{}", String::from_utf8_lossy(&o.stderr));

    // JSON logs: progress becomes structured events, every stderr line is a JSON object.
    ws.write_layer(&county(20_000));
    let o = run_cli(&ws, &["--log-format", "json"], &[("ZONEWATCH_PROGRESS_EVERY", "1ms"), ("ZONEWATCH_LOG", "info")]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.lines().next().unwrap_or("").starts_with("s1: ") && out.contains("features=20000"), "{out}");
    let mut progress_events = 0;
    for l in err.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("stderr line is not JSON ({e}): {l:?}"));
        if v["fields"]["message"].as_str().is_some_and(|m| m.starts_with("ingest progress")) {
            assert_eq!(v["fields"]["source"], "s1", "{l}");
            assert!(v["fields"]["features"].as_u64().is_some(), "{l}");
            progress_events += 1;
        }
    }
    assert!(progress_events >= 2, "no progress events among the JSON logs:\n{err}");

    // A run that fails says why in a JSON line too (not an `error:` text line a log
    // collector cannot parse), also with the log filter off; as text without the flag.
    std::fs::write(ws.path().join("layer.geojson"), "{\"type\": \"FeatureCollection\", \"features\": [").unwrap();
    let o = run_cli(&ws, &["--log-format", "json"], &[("ZONEWATCH_LOG", "off")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let lines: Vec<serde_json::Value> =
        err.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("stderr line is not JSON ({e}): {l:?}"))).collect();
    assert!(lines.iter().any(|v| v["level"] == "ERROR" && v["fields"]["message"].as_str().is_some_and(|m| m.contains("sources failed"))), "{err}");
    let o = run_cli(&ws, &[], &[]);
    assert!(String::from_utf8_lossy(&o.stderr).lines().any(|l| l.starts_with("error: ") && l.contains("sources failed")), "{}", String::from_utf8_lossy(&o.stderr));
}
