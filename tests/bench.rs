//! `zonewatch bench --scale test` runs in the suite so the bench code cannot rot: it checks
//! that each measure runs and prints sane JSON lines, never the timings (those belong to
//! docs/PERFORMANCE.md, taken on a quiet machine).

use std::process::Command;

fn bench_lines(only: &str) -> Vec<serde_json::Value> {
    let work = tempfile::tempdir().expect("tempdir");
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["bench", "--scale", "test", "--only", only, "--work"])
        .arg(work.path())
        .output()
        .expect("zonewatch bench runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "bench --only {only} failed:\n{out}\n{err}");
    out.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn num(v: &serde_json::Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing or not a number in {v}"))
}

#[test]
fn delivery_and_recovery_measures_run_at_test_scale() {
    let lines = bench_lines("delivery,recovery");
    for l in &lines {
        assert!(l.get("error").is_none(), "a measure failed: {l}");
    }
    let delivery = lines.iter().find(|l| l["bench"] == "delivery").expect("a delivery line");
    assert!(num(delivery, "sent") > 0.0 && num(delivery, "per_s") > 0.0, "{delivery}");
    assert!(num(delivery, "wall_s") > 0.0, "{delivery}");
    let (p50, p99) = (num(delivery, "p50_ms"), num(delivery, "p99_ms"));
    assert!(p50 >= 0.0 && p99 >= p50, "{delivery}");
    assert_eq!(num(delivery, "target"), 30_000.0);
    assert!(num(delivery, "latency_rows") > 0.0, "{delivery}");

    let recovery = lines.iter().find(|l| l["bench"] == "recovery").expect("a recovery line");
    assert!(num(recovery, "outbox_rows") > 0.0 && num(recovery, "store_mib") > 0.0, "{recovery}");
    assert!(num(recovery, "open_s") > 0.0 && num(recovery, "first_delivery_s") > 0.0, "{recovery}");
    assert_eq!(recovery["repair"], "quick_repair");
    // With quick-repair records a SIGKILL never costs a full walk of the file.
    assert_eq!(recovery["full_repair_after_kill"], false, "{recovery}");
    assert!(num(recovery, "commit_ms_quick_repair") > 0.0 && num(recovery, "commit_ms_without") > 0.0, "{recovery}");
}
