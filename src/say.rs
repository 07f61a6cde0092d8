//! The lines a command prints on stderr for a person — `error: …`, `warning: …`, `note: …`
//! — written in the log format the operator chose. With `--log-format json` a log collector
//! reads every stderr line as JSON, so these lines are JSON objects of the shape
//! `tracing-subscriber` writes (`timestamp`, `level`, `fields.message`, `target`), not text
//! that would break its parser on the one line that says why zonewatch stopped. They do not
//! go through the log filter: `ZONEWATCH_LOG=off` must not hide why a command failed.
//!
//! Writing never panics (a closed stderr is ignored): the signal and store handlers that
//! print here run where a panic would take the process down.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static JSON: AtomicBool = AtomicBool::new(false);

/// How serious a line is; its text prefix and its JSON `level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Error,
    Warning,
    Note,
    /// What the daemon is doing about a signal (`zonewatch: stopping …`).
    Status,
    /// Why the daemon stops by itself (`zonewatch: the store …; stopping`).
    Stopping,
}

/// Chooses JSON lines (`--log-format json`): `cli::dispatch` sets it once, first. The
/// progress reporters read it too (`progress.rs`): stderr carrying JSON takes nothing else.
pub fn use_json(on: bool) {
    JSON.store(on, Ordering::Relaxed);
}

/// Whether stderr carries JSON lines.
pub fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// The line for `message` at `level`, as it is printed (without the newline).
pub fn format(level: Level, message: &str, now_ms: u64, json: bool) -> String {
    if json {
        let level = match level {
            Level::Error => "ERROR",
            Level::Warning => "WARN",
            Level::Note | Level::Status => "INFO",
            Level::Stopping => "ERROR",
        };
        serde_json::json!({
            "timestamp": crate::util::rfc3339(now_ms),
            "level": level,
            "fields": {"message": message},
            "target": "zonewatch",
        })
        .to_string()
    } else {
        let prefix = match level {
            Level::Error => "error: ",
            Level::Warning => "warning: ",
            Level::Note => "note: ",
            Level::Status | Level::Stopping => "zonewatch: ",
        };
        format!("{prefix}{message}")
    }
}

/// Prints one line on stderr. Use the macros: `error_line!`, `warning_line!`, `note_line!`.
pub fn line(level: Level, message: std::fmt::Arguments<'_>) {
    let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let text = format(level, &message.to_string(), now, json());
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_json_lines() {
        assert_eq!(format(Level::Error, "no source \"x\"", 0, false), "error: no source \"x\"");
        assert_eq!(format(Level::Stopping, "stopping", 0, false), "zonewatch: stopping");
        let v: serde_json::Value = serde_json::from_str(&format(Level::Warning, "a \"quoted\"\nline", 1_000, true)).unwrap();
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["fields"]["message"], "a \"quoted\"\nline");
        assert_eq!(v["timestamp"], "1970-01-01T00:00:01.000Z");
        assert_eq!(v["target"], "zonewatch");
    }
}
