//! The quarantined features' rows: read a page at a time, and removed past retention.
//!
//! Why it exists: every committing or held run writes a row for each feature it could not
//! read, keeping up to 16 KiB of the feature's text for an operator to look at, and nothing
//! removed them. A layer whose `parcel_id` was mistyped quarantines most of a county in one
//! run, and a layer with a few bad features that is published again at every poll adds them
//! again each time, so the table only grew, and `GET /v1/quarantine` built all of it into one
//! answer. Now the route reads a page, and a row is removed past `[store] run_retention` (30
//! days by default), as the quiet run records and the superseded holds are.
//!
//! What stays: the `quarantined` audit row each feature got in the run's transaction (the
//! ledger is never swept), so what was quarantined, when and by which run is still on record;
//! only the kept text of the feature goes. The newest row stays, whatever its age: rows are
//! numbered on from the last one, so an emptied table would hand out its numbers again, and
//! a client paging with a row number as its cursor would skip the new rows (a reviewer).
//!
//! Left: the pass reads from the oldest row and steps over rows written a day ahead of the
//! clock and rows that do not decode, at most four reads per removal; more than that many of
//! them in front stop the sweep until they age out (the run records' sweep keeps a cursor for
//! this; these rows have not needed one).

use super::codec::decode;
use super::queries::read_page;
use super::run_retention::{remove_rows, FUTURE_MS};
use super::tables::QUARANTINE;
use super::{Store, StoreError};
use crate::model::QuarantineRecord;
use redb::{ReadableDatabase, ReadableTable};

impl Store {
    /// Up to `limit` quarantined features after the row `after`, oldest first, each with its
    /// row number (the next page's cursor). A row that does not decode is left out with an
    /// error log (`check --store` names it): one damaged row must not hide every other.
    pub fn quarantine_page(&self, after: Option<u64>, limit: usize) -> Result<Vec<(u64, QuarantineRecord)>, StoreError> {
        let rtx = self.db.begin_read()?;
        read_page(&rtx.open_table(QUARANTINE)?, after, limit, decode::<QuarantineRecord>, "quarantined feature")
    }

    /// Removes up to `max` quarantined features recorded before `now_ms - retention_ms`, in one
    /// transaction. Rows are numbered in the order runs wrote them, so the pass reads from the
    /// oldest and stops at the first one written after the horizon; it steps over rows written
    /// a day or more ahead of the clock (a clock stepped back: a later pass finds them) and
    /// rows that do not decode (kept for `check --store` to name). Returns the rows removed.
    pub fn sweep_quarantine(&self, now_ms: u64, retention_ms: u64, max: usize) -> Result<usize, StoreError> {
        let before_ms = now_ms.saturating_sub(retention_ms);
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let mut doomed = Vec::new();
        {
            let rows = wtx.open_table(QUARANTINE)?;
            let newest = rows.last()?.map(|(k, _)| k.value());
            // Read at most a few rows per removal, so a long stretch of stepped-over rows is
            // crossed over several passes rather than in one write transaction.
            for (read, item) in rows.iter()?.enumerate() {
                if doomed.len() >= max || read >= max.saturating_mul(4) {
                    break;
                }
                let (k, v) = item?;
                if Some(k.value()) == newest {
                    break;
                }
                let Ok(q) = decode::<QuarantineRecord>(v.value()) else { continue };
                if q.ts_ms < before_ms {
                    doomed.push(k.value());
                } else if q.ts_ms <= now_ms.saturating_add(FUTURE_MS) {
                    break;
                }
            }
        }
        remove_rows(wtx, QUARANTINE, &doomed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{QuarantineReason, QuarantineRecord};
    use crate::store::codec::encode;

    const DAY: u64 = 86_400_000;

    fn record(ts_ms: u64) -> QuarantineRecord {
        QuarantineRecord {
            source_id: "s".into(),
            run_id: 1,
            lineage_id: "l".into(),
            feature_index: 0,
            parcel_id: Some("P".into()),
            reason: QuarantineReason::MissingField,
            detail: "no zoning".into(),
            raw: "{}".into(),
            ts_ms,
        }
    }

    /// Rows (key, value) written straight into the table, as runs write them.
    fn store_with(rows: &[(u64, Vec<u8>)]) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        {
            let mut t = wtx.open_table(QUARANTINE).unwrap();
            for (k, v) in rows {
                t.insert(*k, v.as_slice()).unwrap();
            }
        }
        wtx.commit().unwrap();
        (dir, store)
    }

    fn keys(store: &Store) -> Vec<u64> {
        let rtx = store.db.begin_read().unwrap();
        let t = rtx.open_table(QUARANTINE).unwrap();
        t.iter().unwrap().map(|i| i.unwrap().0.value()).collect()
    }

    /// Rows before the horizon go, a batch at a time; a row that does not decode and one
    /// written under a clock a day ahead are stepped over; the first row inside retention
    /// ends the pass; pages leave out the damaged row and follow their cursor.
    #[test]
    fn old_quarantined_features_are_swept_and_read_in_pages() {
        let now = 100 * DAY;
        let rows = vec![
            (1, encode(&record(now - 40 * DAY))),
            (2, vec![0xff, 0xff]),
            (3, encode(&record(now + 5 * DAY))),
            (4, encode(&record(now - 35 * DAY))),
            (5, encode(&record(now - 31 * DAY))),
            (6, encode(&record(now - DAY))),
            (7, encode(&record(now - 40 * DAY))),
        ];
        let (_dir, store) = store_with(&rows);
        let page: Vec<u64> = store.quarantine_page(None, 3).unwrap().iter().map(|(k, _)| *k).collect();
        assert_eq!(page, vec![1, 3, 4], "the damaged row left out, not the page failed");
        let page: Vec<u64> = store.quarantine_page(Some(4), 3).unwrap().iter().map(|(k, _)| *k).collect();
        assert_eq!(page, vec![5, 6, 7]);
        assert!(store.quarantine_page(Some(u64::MAX), 3).unwrap().is_empty());

        assert_eq!(store.sweep_quarantine(now, 30 * DAY, 2).unwrap(), 2, "a batch of two");
        assert_eq!(keys(&store), vec![2, 3, 5, 6, 7]);
        assert_eq!(store.sweep_quarantine(now, 30 * DAY, 10).unwrap(), 1);
        assert_eq!(keys(&store), vec![2, 3, 6, 7], "stopped at row 6, inside retention: 7 waits (rows are written in time order)");
        assert_eq!(store.sweep_quarantine(now, 30 * DAY, 10).unwrap(), 0);
        // The clock moved on: what is past retention now goes, the ahead row once it is old.
        assert_eq!(store.sweep_quarantine(now + 40 * DAY, 30 * DAY, 10).unwrap(), 2);
        assert_eq!(keys(&store), vec![2, 7], "the damaged row is kept for check to name, the newest so that its number is not handed out again");
    }
}
