//! Derived shares: how much of each parcel its derived zoning code covers. Kept beside the
//! derived snapshot (a district source's parcel states) so that an operator can see how
//! confident each derived code is; written in the run's own transaction, staged with holds.

use super::codec::{decode, encode};
use super::runs::codec_err;
use super::tables::{DERIVED_SHARES, HELD_SHARES};
use super::{Store, StoreError};
use redb::{ReadableDatabase, WriteTransaction};
use std::collections::HashMap;

/// Replaces the stored shares of `source_id` by `shares` (no-op when empty).
pub(super) fn write_shares(wtx: &WriteTransaction, source_id: &str, shares: &[(String, f64)]) -> Result<(), StoreError> {
    if shares.is_empty() {
        return Ok(());
    }
    let mut t = wtx.open_table(DERIVED_SHARES)?;
    t.retain_in((source_id, "")..=(source_id, "\u{10FFFF}"), |_, _| false)?;
    for (pid, share) in shares {
        t.insert((source_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

/// Stages the shares of a held run.
pub(super) fn stage_shares(wtx: &WriteTransaction, hold_id: u64, shares: &[(String, f64)]) -> Result<(), StoreError> {
    let mut t = wtx.open_table(HELD_SHARES)?;
    for (pid, share) in shares {
        t.insert((hold_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

impl Store {
    /// The stored derived shares of a source, by parcel id.
    pub fn derived_shares(&self, source_id: &str) -> Result<HashMap<String, f64>, StoreError> {
        self.source_rows(DERIVED_SHARES, "derived_shares", source_id)
    }

    /// The staged shares of a held run, in parcel order.
    pub fn held_shares(&self, hold_id: u64) -> Result<Vec<(String, f64)>, StoreError> {
        let rtx = self.db.begin_read()?;
        let t = rtx.open_table(HELD_SHARES)?;
        let mut out = Vec::new();
        for item in t.range((hold_id, "")..)? {
            let (k, v) = item?;
            let (h, pid) = k.value();
            if h != hold_id {
                break;
            }
            out.push((pid.to_string(), decode(v.value()).map_err(|m| codec_err("held_shares", m))?));
        }
        Ok(out)
    }
}
