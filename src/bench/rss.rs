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
        }
    }
}
