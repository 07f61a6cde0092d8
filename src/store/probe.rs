//! Runs of HTTP sources that commit no data: `skip` (the cheap probe said nothing moved) and
//! `identical` with the portal's new signals (ETag, Last-Modified, publisher timestamp, schema
//! hash). Kept apart from `runs.rs` because only the portal kinds need it.

use super::watermark_rows::{decode_watermark, encode_watermark};
use super::runs::{codec_err, lineage_for, next_key, supersede_open_holds};
use super::tables::*;
use super::{Store, StoreError};
use crate::model::*;
use redb::ReadableTable;

/// The portal signals an `identical` run moves the watermark to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PortalSignals {
    pub publisher_ts_ms: Option<u64>,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    pub schema_hash: Option<String>,
}

/// What [`Store::commit_unchanged`] records about a run that committed no data.
#[derive(Debug, Clone)]
pub struct UnchangedRun<'a> {
    /// `Verdict::Skip` or `Verdict::Identical`.
    pub verdict: Verdict,
    /// The portal's signals as this run saw them (an `identical` run moves the watermark to them).
    pub signals: &'a PortalSignals,
    /// The run record's feature count.
    pub features_hint: u64,
    /// The run record's warnings (a `stale` skip, say); the commit may add its own.
    pub warnings: Vec<String>,
}

impl Store {
    /// Records a run that committed no data, in one transaction.
    ///
    /// * `Verdict::Skip`: only the run record (with `warnings`, e.g. `stale`) is written; the
    ///   watermark stays, so the `floor` interval counts from the last real fetch.
    /// * `Verdict::Identical`: the fetched bytes matched the watermark's digest. The consumed
    ///   time and the portal signals move (the publisher timestamp never backwards: an older
    ///   one is a warning, kept as `probe_ts_ms` for the probe), a watermark history row is
    ///   appended under this
    ///   run's id, and open holds are superseded (the publisher went back to the committed
    ///   version), exactly as `commit_identical` does for files.
    pub fn commit_unchanged(&self, source_id: &str, started_ms: u64, now_ms: u64, run: UnchangedRun<'_>) -> Result<RunRecord, StoreError> {
        let UnchangedRun { verdict, signals, features_hint, mut warnings } = run;
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        let run_id = next_key("runs", wtx.open_table(RUNS)?.last()?.map(|(k, _)| k.value()))?;
        let wm: Option<Watermark> = {
            let t = wtx.open_table(WATERMARKS)?;
            let v = t.get(source_id)?;
            match v {
                Some(v) => Some(decode_watermark(v.value()).map_err(|m| codec_err("watermarks", m))?),
                None => None,
            }
        };
        let digest = wm.as_ref().map(|w| w.digest.clone()).unwrap_or_default();
        if verdict == Verdict::Identical {
            let mut wm = wm.ok_or_else(|| StoreError::NotFound(format!("source {source_id} has no watermark")))?;
            let clock = Watermark::clock_floor(Some(&wm), now_ms);
            wm.consumed_at_ms = now_ms;
            match (signals.publisher_ts_ms, wm.publisher_ts_ms) {
                // The same bytes under an older timestamp: the watermark keeps the newer one,
                // or the next restated version (older content under that older timestamp)
                // would not look restated and would be sent, not held. The older one is what
                // the portal says now: the probe compares against it, so the next runs can
                // `skip` while it keeps saying it.
                // (Unless the newer one is from the future: that is no version's time, and
                // the portal's honest one replaces it.)
                (Some(new), Some(old)) if new < old && !Watermark::from_the_future(old, clock) => {
                    if wm.probe_ts_ms != Some(new) {
                        warnings.push(format!(
                            "publisher timestamp went backwards from {} to {} with the same content; the watermark keeps {}",
                            crate::util::rfc3339(old),
                            crate::util::rfc3339(new),
                            crate::util::rfc3339(old)
                        ));
                    }
                    wm.probe_ts_ms = Some(new);
                }
                (Some(new), old) => {
                    warnings.extend(Watermark::future_timestamp_warning(old, new, clock));
                    wm.publisher_ts_ms = Some(new);
                    wm.probe_ts_ms = None;
                }
                (None, _) => wm.probe_ts_ms = None,
            }
            wm.etag = signals.etag.clone();
            wm.last_modified = signals.last_modified.clone();
            wm.schema_hash = signals.schema_hash.clone().or(wm.schema_hash);
            let bytes = encode_watermark(&wm);
            wtx.open_table(WATERMARKS)?.insert(source_id, bytes.as_slice())?;
            wtx.open_table(WATERMARK_HISTORY)?.insert((source_id, run_id), bytes.as_slice())?;
            supersede_open_holds(&wtx, source_id, run_id, now_ms)?;
        }
        let record = RunRecord {
            run_id,
            source_id: source_id.to_string(),
            lineage_id: lineage_for(source_id, run_id, &digest),
            started_ms,
            finished_ms: now_ms,
            verdict,
            digest,
            counts: RunCounts { features: features_hint, ..Default::default() },
            hold_id: None,
            warnings,
            error: None,
        };
        super::totals::append_run(&wtx, &record)?;
        wtx.commit()?;
        Ok(record)
    }
}
