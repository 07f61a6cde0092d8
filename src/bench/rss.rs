//! Peak resident memory of this process, read from `/proc/self/status` (`VmHWM`), and a reset
//! of that peak (`/proc/self/clear_refs`, value 5, Linux ≥ 4.0) so one process can measure
//! several phases; and the bytes this process has sent to storage (`/proc/self/io`,
//! `write_bytes`), which tells how much a commit writes per event. Elsewhere they return
//! `None`: the bench prints `null` rather than a guess.

/// Peak resident set size since start (or the last [`reset_peak`]), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// Current resident set size, in bytes.
pub fn current_rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

/// Resets the kernel's peak-RSS counter to the current RSS. Returns false where unsupported.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", b"5").is_ok()
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// Bytes this process has caused to be written to storage so far (`write_bytes`).
pub fn written_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines().find_map(|l| l.strip_prefix("write_bytes:")).and_then(|v| v.trim().parse().ok())
}

/// CPU time this process has used so far (user + system, all threads), in seconds, from
/// `/proc/self/stat` (fields 14 and 15, in USER_HZ = 100 ticks per second, which Linux fixes
/// for what it reports there). Wall-clock rates on a machine whose disk flush times vary
/// from minute to minute are noisy; CPU per event is what a code change moves.
pub fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// CPU seconds used since `before` (a [`cpu_seconds`] reading; None off Linux).
pub fn cpu_seconds_since(before: Option<f64>) -> Option<f64> {
    Some(cpu_seconds()? - before?)
}

/// CPU microseconds per item between two [`cpu_seconds`] readings (None off Linux).
pub fn cpu_us_per(before: Option<f64>, items: u64) -> Option<f64> {
    let used = cpu_seconds_since(before)?;
    Some((used * 1e6 / items.max(1) as f64 * 10.0).round() / 10.0)
}

/// Bytes → MiB rounded to one decimal, for the JSON lines.
pub fn mib(bytes: Option<u64>) -> Option<f64> {
    bytes.map(|b| (b as f64 / (1024.0 * 1024.0) * 10.0).round() / 10.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_own_rss_on_linux() {
        if cfg!(target_os = "linux") {
            let peak = super::peak_rss_bytes().expect("VmHWM on linux");
            let cur = super::current_rss_bytes().expect("VmRSS on linux");
            assert!(peak >= cur / 2 && cur > 0);
            let before = super::cpu_seconds().expect("utime and stime on linux");
            let mut x = 0u64;
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_millis(60) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            let used = super::cpu_seconds().expect("again") - before;
            assert!((0.02..5.0).contains(&used), "a 60 ms busy loop used {used} s of CPU");
        }
    }
}
