//! Measure 7, idle `serve`: a real `zonewatch serve` child with 100 file sources and 10k
//! subscribers (config-file subscribers, one AOI file each). Once every source has run its
//! baseline, the child is left alone and its CPU time (`/proc/PID/stat` utime + stime) and
//! resident memory (`/proc/PID/status` VmRSS, VmHWM) are read before and after the idle window.
//!
//! Why it exists: an edge box runs `serve` for months and nearly all of that time nothing is
//! due. It must not poll busily (CPU over the window ≈ 0) and must stay small (target RSS ≤ 50
//! MiB). Linux only (`/proc`); elsewhere the measure reports an error line instead of guessing.

use super::{emit, gen, rss, BenchCtx, BenchError, Scale, COUNTY_FIELDS};
use crate::synth::{write_feature, CountyIter, CountySpec};
use serde_json::json;
use std::io::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Parcels per source layer (small layers: the measure is about the daemon, not ingest).
const PARCELS_PER_SOURCE: usize = 200;
/// Linux's USER_HZ: /proc reports CPU times in these ticks (100 on every mainstream arch).
const TICKS_PER_S: f64 = 100.0;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    if !Path::new("/proc/self/stat").exists() {
        return Err(BenchError::Failed("idle: needs Linux /proc to read a child's CPU time and RSS".into()));
    }
    let (sources, subscribers, idle_s) = match ctx.scale {
        Scale::Test => (100, 10_000, 2.0),
        Scale::Small | Scale::Full => (100, 10_000, 10.0),
    };
    let dir = ctx.work.join("idle-serve");
    let _ = std::fs::remove_dir_all(&dir);
    let t = Instant::now();
    write_setup(&dir, sources, subscribers, ctx.seed)?;
    let setup_s = t.elapsed().as_secs_f64();

    let exe = std::env::current_exe().map_err(|e| BenchError::io("current_exe", e))?;
    let log_path = dir.join("serve.log");
    let log = std::fs::File::create(&log_path).map_err(|e| BenchError::io(&log_path, e))?;
    let child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(dir.join("zonewatch.toml"))
        .env("ZONEWATCH_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| BenchError::io("zonewatch serve", e))?;
    let mut guard = ChildGuard(Some(child));
    let pid = guard.pid();
    let started = Instant::now();

    // Wait for every source's baseline (one `<id>: baseline features=` line each).
    let deadline = Duration::from_secs(300);
    loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let done = text.matches(": baseline features=").count();
        if done >= sources {
            break;
        }
        if let Some(status) = guard.try_wait() {
            return Err(BenchError::Failed(format!("serve exited with {status}: {}", tail(&text))));
        }
        if started.elapsed() > deadline {
            return Err(BenchError::Failed(format!("serve: {done} of {sources} baselines after {deadline:?}: {}", tail(&text))));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let busy_s = started.elapsed().as_secs_f64();
    let rss_after_runs = proc_status_kib(pid, "VmRSS:");
    // Let the daemon settle (blocking-pool threads finish their work), then watch it idle.
    std::thread::sleep(Duration::from_secs(1));
    let cpu0 = proc_cpu_s(pid).ok_or_else(|| BenchError::Failed("cannot read /proc/PID/stat".into()))?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(idle_s));
    let cpu1 = proc_cpu_s(pid).ok_or_else(|| BenchError::Failed("cannot read /proc/PID/stat".into()))?;
    let window = t0.elapsed().as_secs_f64();
    let rss_idle = proc_status_kib(pid, "VmRSS:");
    let hwm = proc_status_kib(pid, "VmHWM:");
    let threads = proc_status_kib(pid, "Threads:");
    let cpu = cpu1 - cpu0;
    let stopped_cleanly = guard.stop();
    let to_mib = |k: Option<u64>| rss::mib(k.map(|k| k * 1024));
    emit(
        "idle",
        json!({
            "sources": sources,
            "subscribers": subscribers,
            "parcels_per_source": PARCELS_PER_SOURCE,
            "setup_s": (setup_s * 1000.0).round() / 1000.0,
            "baselines_s": (busy_s * 1000.0).round() / 1000.0,
            "idle_window_s": (window * 1000.0).round() / 1000.0,
            "idle_cpu_s": (cpu * 1000.0).round() / 1000.0,
            "idle_cpu_percent": ((cpu / window.max(1e-9)) * 100.0 * 1000.0).round() / 1000.0,
            "rss_after_baselines_mib": to_mib(rss_after_runs),
            "rss_idle_mib": to_mib(rss_idle),
            "peak_rss_mib": to_mib(hwm),
            "threads": threads,
            "stopped_cleanly": stopped_cleanly,
            "target_rss_mib": 50,
        }),
    );
    Ok(())
}

/// Kills the child if the measure fails half-way.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn pid(&self) -> u32 {
        self.0.as_ref().map(|c| c.id()).unwrap_or(0)
    }
    fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
    /// SIGTERM (a clean `serve` stop), then up to 20 s for it to exit; true when it exited 0.
    fn stop(&mut self) -> bool {
        let Some(mut child) = self.0.take() else { return false };
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// utime + stime of `pid`, in seconds.
fn proc_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: field 3 is index 0, so utime (14) is index 11 and stime (15) index 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / TICKS_PER_S)
}

/// A `kB` (or plain number) field of `/proc/PID/status`.
fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// The config, `sources` small layers and `subscribers` AOI files.
fn write_setup(dir: &Path, sources: usize, subscribers: usize, seed: u64) -> Result<(), BenchError> {
    let layers = dir.join("layers");
    let aois = dir.join("aoi");
    for d in [&layers, &aois] {
        std::fs::create_dir_all(d).map_err(|e| BenchError::io(d, e))?;
    }
    let mut toml = String::from(
        "[store]\npath = \"zonewatch.redb\"\n[control]\nlisten = \"127.0.0.1:0\"\n[delivery]\nallow_private_targets = true\n",
    );
    // All sources cover one synthetic county split into `sources` stretches of lots.
    let spec: CountySpec = gen::county_spec(sources * PARCELS_PER_SOURCE, seed);
    let mut lots = CountyIter::new(&spec);
    let mut buf = String::new();
    for s in 0..sources {
        let path = layers.join(format!("src-{s}.geojson"));
        buf.clear();
        buf.push_str("{\"type\":\"FeatureCollection\",\"features\":[\n");
        for (i, lot) in lots.by_ref().take(PARCELS_PER_SOURCE).enumerate() {
            if i > 0 {
                buf.push_str(",\n");
            }
            write_feature(&mut buf, &lot, "2026-01-01", None);
        }
        buf.push_str("\n]}\n");
        std::fs::write(&path, &buf).map_err(|e| BenchError::io(&path, e))?;
        toml.push_str(&format!(
            "[[source]]\nid = \"src-{s}\"\njurisdiction = \"bench\"\nkind = \"file\"\npath = \"layers/src-{s}.geojson\"\nevery = \"1h\"\n{COUNTY_FIELDS}"
        ));
    }
    // AOI sizes as in the matching measure: a lot meets ~1.6 of 10k AOIs on average.
    let max_side = super::matching::calibrate_max_side(&spec);
    for (i, aoi) in gen::aois(&spec, subscribers, super::matching::MIN_SIDE_M, max_side, seed).into_iter().enumerate() {
        let path = aois.join(format!("w{i}.geojson"));
        let ring: Vec<[f64; 2]> = aoi.0.first().map(|p| p.exterior().0.iter().map(|c| [c.x, c.y]).collect()).unwrap_or_default();
        let body = json!({"type": "Polygon", "coordinates": [ring]}).to_string();
        std::fs::write(&path, body).map_err(|e| BenchError::io(&path, e))?;
        toml.push_str(&format!(
            "[[subscriber]]\nid = \"w{i}\"\naoi = \"aoi/w{i}.geojson\"\ntarget = \"http://127.0.0.1:9/hook/{i}\"\nsecret = \"whsec_YmVuY2gtc2VjcmV0LWJlbmNoLXNlY3JldA==\"\nmin_severity = \"notice\"\n"
        ));
    }
    let cfg = dir.join("zonewatch.toml");
    let mut f = std::fs::File::create(&cfg).map_err(|e| BenchError::io(&cfg, e))?;
    f.write_all(toml.as_bytes()).map_err(|e| BenchError::io(&cfg, e))?;
    Ok(())
}
