//! Derived shares: how much of each parcel its derived zoning code covers. Kept beside the
//! derived snapshot (a district source's parcel states) so that an operator can see how
//! confident each derived code is; written in the run's own transaction, staged with holds.
//!
//! Also the read side of a derived run: the base's parcels and the derived source's stored
//! states and shares, merged in parcel id order and handed out a stretch at a time
//! ([`Store::for_each_base_stretch`]), so that deriving a county never holds its whole base.

use super::codec::{decode, encode};
use super::runs::codec_err;
use super::snapshot::{decode_record, decode_state};
use super::tables::{DERIVED_SHARES, HELD_SHARES, PARCEL_SNAPSHOT};
use super::{Store, StoreError};
use crate::model::{ParcelState, StoredGeometry};
use redb::{ReadableDatabase, ReadableTable, WriteTransaction};
use std::collections::HashMap;

/// Writes shares of a derived source's parcels (new or changed ones; a removed parcel's share
/// goes with its row, see `RunWriter::removals`).
pub(super) fn write_shares(wtx: &WriteTransaction, source_id: &str, shares: &[(String, f64)]) -> Result<(), StoreError> {
    if shares.is_empty() {
        return Ok(());
    }
    let mut t = wtx.open_table(DERIVED_SHARES)?;
    for (pid, share) in shares {
        t.insert((source_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

/// Removes the shares of parcels gone from a source's snapshot (a parcel source has none:
/// one look at the table says so).
pub(super) fn remove_shares(wtx: &WriteTransaction, source_id: &str, ids: &[String]) -> Result<(), StoreError> {
    let mut t = wtx.open_table(DERIVED_SHARES)?;
    if t.range((source_id, "")..)?.next().transpose()?.is_none_or(|(k, _)| k.value().0 != source_id) {
        return Ok(());
    }
    for id in ids {
        t.remove((source_id, id.as_str()))?;
    }
    Ok(())
}

/// Stages shares with a held run.
pub(super) fn stage_shares(wtx: &WriteTransaction, hold_id: u64, shares: &[(String, f64)]) -> Result<(), StoreError> {
    if shares.is_empty() {
        return Ok(());
    }
    let mut t = wtx.open_table(HELD_SHARES)?;
    for (pid, share) in shares {
        t.insert((hold_id, pid.as_str()), encode(share).as_slice())?;
    }
    Ok(())
}

/// One stretch of a derived run's read ([`Store::for_each_base_stretch`]): base parcels in id
/// order, and what the derived source has stored for the same stretch of ids.
#[derive(Debug, Default)]
pub struct BaseStretch {
    /// Base parcels with their geometry, in id order (a base parcel without one is left out,
    /// as it has nothing to derive from).
    pub parcels: Vec<(String, ParcelState, StoredGeometry)>,
    /// The derived source's stored states whose ids come after the previous stretch's last
    /// base id, up to and including this stretch's; the last stretch has every one left.
    pub derived: HashMap<String, ParcelState>,
    /// The derived source's stored shares over the same ids as `derived`.
    pub shares: HashMap<String, f64>,
}

/// Rows of one source in a `(source id, parcel id)`-keyed table, read in id order with one
/// row of look-ahead (the merge takes rows up to a given id).
struct SourceRows<'t> {
    range: redb::Range<'t, (&'static str, &'static str), &'static [u8]>,
    source_id: &'t str,
    next: Option<(String, Vec<u8>)>,
    /// The source's rows are all read (the range has reached another source or the end).
    done: bool,
}

impl<'t> SourceRows<'t> {
    fn new<T>(table: &'t T, source_id: &'t str) -> Result<SourceRows<'t>, StoreError>
    where
        T: ReadableTable<(&'static str, &'static str), &'static [u8]>,
    {
        let mut rows = SourceRows { range: table.range((source_id, "")..)?, source_id, next: None, done: false };
        rows.advance()?;
        Ok(rows)
    }

    /// Reads the next row of the source into `next` (`None` past its last).
    fn advance(&mut self) -> Result<(), StoreError> {
        self.next = None;
        if self.done {
            return Ok(());
        }
        match self.range.next().transpose()? {
            Some((k, v)) if k.value().0 == self.source_id => self.next = Some((k.value().1.to_string(), v.value().to_vec())),
            // The next source's rows, or the end of the table.
            _ => self.done = true,
        }
        Ok(())
    }

    /// The next row, if its id is at most `last` (any row, with `None`).
    fn take_through(&mut self, last: Option<&str>) -> Result<Option<(String, Vec<u8>)>, StoreError> {
        let due = match (&self.next, last) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some((id, _)), Some(last)) => id.as_str() <= last,
        };
        if !due {
            return Ok(None);
        }
        let row = self.next.take();
        self.advance()?;
        Ok(row)
    }
}

impl Store {
    /// Reads a derived run's inputs from one read snapshot, a stretch at a time: up to
    /// `stretch` parcels of the base `base_id` (in id order), with the states and shares the
    /// derived source `derived_id` has stored for the same stretch of ids (see
    /// [`BaseStretch`]). Every stored derived row lands in exactly one stretch, so a diff of
    /// each stretch against its own stored rows is the diff of the whole. `each` is called at
    /// least once (with no parcels, for an empty base). Returns how many derived rows were
    /// stored. Stops at the first error.
    pub fn for_each_base_stretch<E: From<StoreError>>(
        &self,
        base_id: &str,
        derived_id: &str,
        stretch: usize,
        mut each: impl FnMut(BaseStretch) -> Result<(), E>,
    ) -> Result<u64, E> {
        let stretch = stretch.max(1);
        let rtx = self.db.begin_read().map_err(StoreError::from)?;
        let snapshot = rtx.open_table(PARCEL_SNAPSHOT).map_err(StoreError::from)?;
        let shares_t = match rtx.open_table(DERIVED_SHARES) {
            Ok(t) => Some(t),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(StoreError::from(e).into()),
        };
        let mut base = SourceRows::new(&snapshot, base_id)?;
        let mut derived = SourceRows::new(&snapshot, derived_id)?;
        let mut shares = match &shares_t {
            Some(t) => Some(SourceRows::new(t, derived_id)?),
            None => None,
        };
        let mut stored = 0u64;
        loop {
            let mut out = BaseStretch::default();
            let mut last: Option<String> = None;
            let mut read = 0;
            while read < stretch {
                let Some((pid, bytes)) = base.take_through(None)? else { break };
                read += 1;
                if let (state, Some(geometry)) = decode_record(&bytes).map_err(|m| codec_err("parcel_snapshot", m))? {
                    out.parcels.push((pid.clone(), state, geometry));
                }
                last = Some(pid);
            }
            // With no base row left, the stored rows not read yet all belong to this stretch.
            let finished = base.next.is_none();
            let through = if finished { None } else { last.as_deref() };
            while let Some((pid, bytes)) = derived.take_through(through)? {
                out.derived.insert(pid, decode_state(&bytes).map_err(|m| codec_err("parcel_snapshot", m))?);
                stored += 1;
            }
            if let Some(shares) = shares.as_mut() {
                while let Some((pid, bytes)) = shares.take_through(through)? {
                    out.shares.insert(pid, decode(&bytes).map_err(|m| codec_err("derived_shares", m))?);
                }
            }
            each(out)?;
            if finished {
                return Ok(stored);
            }
        }
    }

    /// The stored derived shares of a source, by parcel id.
    pub fn derived_shares(&self, source_id: &str) -> Result<HashMap<String, f64>, StoreError> {
        self.source_rows(DERIVED_SHARES, "derived_shares", source_id)
    }
}
