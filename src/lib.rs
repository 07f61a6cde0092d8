#![recursion_limit = "512"]
//! zonewatch watches municipal GIS zoning and parcel layers, detects real zoning changes
//! parcel by parcel, and alerts exactly the subscribers whose areas of interest they touch —
//! once. Everything it remembers lives in one redb file. See `docs/ARCHITECTURE.md`.

/// `error: …` on stderr (a JSON line with `--log-format json`): see `say.rs`.
macro_rules! error_line {
    ($($t:tt)*) => { $crate::say::line($crate::say::Level::Error, format_args!($($t)*)) };
}
/// `warning: …` on stderr: see `say.rs`.
macro_rules! warning_line {
    ($($t:tt)*) => { $crate::say::line($crate::say::Level::Warning, format_args!($($t)*)) };
}
/// `note: …` on stderr: see `say.rs`.
macro_rules! note_line {
    ($($t:tt)*) => { $crate::say::line($crate::say::Level::Note, format_args!($($t)*)) };
}

pub mod bench;
pub mod cli;
pub mod clock;
pub mod config;
pub mod control;
pub mod demo;
pub mod derived;
pub mod detect;
pub mod ingest;
pub mod model;
pub mod netguard;
pub mod notify;
pub mod pipeline;
pub mod progress;
pub mod receiver;
pub mod run_stop;
pub mod say;
pub mod signals;
pub mod schedule;
pub mod sd_notify;
pub mod store;
pub mod subscriber_edit;
pub mod synth;
pub mod telemetry;
pub mod util;
