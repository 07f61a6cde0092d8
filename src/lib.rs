#![recursion_limit = "512"]
//! zonewatch watches municipal GIS zoning and parcel layers, detects real zoning changes
//! parcel by parcel, and alerts exactly the subscribers whose areas of interest they touch —
//! once. Everything it remembers lives in one redb file. See `docs/ARCHITECTURE.md`.

pub mod bench;
pub mod cli;
pub mod clock;
pub mod cli_dlq;
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
pub mod schedule;
pub mod store;
pub mod synth;
pub mod telemetry;
pub mod util;
