//! `notify/`: from change events to webhooks a subscriber can trust.
//!
//! * [`aoi`] loads and validates subscribers' areas of interest;
//! * [`matcher`] finds the subscribers a change touches (R-tree, then exact `intersects`);
//! * [`idem`] derives the idempotency key of a (subscriber, change) pair;
//! * [`payload`] builds the Standard Webhooks body; [`signing`] signs it;
//! * [`delivery`] runs the delivery workers against the store's outbox.

pub mod aoi;
pub mod delivery;
mod closed_gates;
mod failure_log;
pub mod idem;
pub mod matcher;
pub mod payload;
pub mod signing;
pub mod replay;
#[cfg(test)]
mod delivery_races;
