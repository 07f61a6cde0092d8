//! What an idempotency key is scoped to besides the change itself: its source, and the
//! store's restore epoch (`notify::idem::KeyScope`).
//!
//! Why it exists (found by a black-box tester, both lost alerts):
//! * A key named the jurisdiction, not the source, while the revision that tells a change
//!   apart from an earlier one of the same parcel is counted per source. A source given a new
//!   id (moved to a portal) starts counting again, so its parcel's real change R-1 → M-1 took
//!   the key the old source had used for the same change earlier: audited `duplicate`, never
//!   sent. Keys of a source this build ingested first now name the source.
//! * A restored store counts revisions from the backup's, so a change made after the restore
//!   took the key a change sent after the backup had used (the store lost it): receivers that
//!   deduplicate on `webhook-id` dropped it. `zonewatch restore` writes a new random epoch
//!   into the restored file, and every key claimed after it names the epoch: a change found
//!   again after a restore is told again, under a new id, and none is lost.
//!
//! Keys are stored: changing how the keys of sources already ingested are computed would let
//! their changes be claimed again after an upgrade (a restatement primed before it and undone
//! after it would be told again, parcel by parcel). So the first open by this build records
//! the sources that already have a watermark as *legacy*; their keys stay what they were
//! until a restore moves the epoch on.

use super::codec::{decode, encode};
use super::tables::{META, META_KEY_SCOPE, WATERMARKS};
use super::StoreError;
use redb::{Database, ReadableTable};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// The stored scope record (`meta` → `key_scope`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyScopeRecord {
    /// Sources that had a watermark when this build first opened the store: their keys do
    /// not name the source.
    pub legacy_sources: BTreeSet<String>,
    /// 0 until a restore; then a random number, new at each restore.
    pub epoch: u64,
}

impl KeyScopeRecord {
    /// The scope of `source_id`'s keys.
    pub fn for_source<'a>(&'a self, source_id: &'a str) -> crate::notify::idem::KeyScope<'a> {
        crate::notify::idem::KeyScope { source: (!self.legacy_sources.contains(source_id)).then_some(source_id), epoch: self.epoch }
    }
}

/// The record in `db`, written first if it is not there (the sources with a watermark become
/// legacy). An unreadable record is an error: guessing would change keys.
/// `quick_repair`: the store's setting, so that a crash right after this first write does not
/// cost a full repair at the next open.
pub(super) fn ensure(db: &Database, quick_repair: bool) -> Result<KeyScopeRecord, StoreError> {
    if let Some(found) = read(db)? {
        return Ok(found);
    }
    let mut wtx = db.begin_write()?;
    wtx.set_quick_repair(quick_repair);
    let record = {
        let mut meta = wtx.open_table(META)?;
        let found: Option<KeyScopeRecord> = match meta.get(META_KEY_SCOPE)? {
            Some(v) => Some(decode(v.value()).map_err(|m| super::runs::codec_err("meta key_scope", m))?),
            None => None,
        };
        match found {
            Some(record) => record,
            None => {
                let mut legacy = BTreeSet::new();
                for item in wtx.open_table(WATERMARKS)?.iter()? {
                    legacy.insert(item?.0.value().to_string());
                }
                let record = KeyScopeRecord { legacy_sources: legacy, epoch: 0 };
                meta.insert(META_KEY_SCOPE, encode(&record).as_slice())?;
                record
            }
        }
    };
    wtx.commit()?;
    Ok(record)
}

/// The record, if written.
fn read(db: &Database) -> Result<Option<KeyScopeRecord>, StoreError> {
    use redb::ReadableDatabase;
    let rtx = db.begin_read()?;
    let meta = match rtx.open_table(META) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    match meta.get(META_KEY_SCOPE)? {
        Some(v) => Ok(Some(decode(v.value()).map_err(|m| super::runs::codec_err("meta key_scope", m))?)),
        None => Ok(None),
    }
}

/// Moves the epoch of the store file open as `file` (named `path` in errors) on (a restore,
/// before the file is put in place): keys claimed from now on differ from every key the lost
/// timeline claimed. Through the handle, not the name: a restore run as root works in the
/// service user's folder, where that user could put a link in the name's place.
pub(super) fn new_epoch(file: &std::fs::File, path: &std::path::Path) -> Result<u64, StoreError> {
    let open_err = |message: String| StoreError::Open { path: path.to_path_buf(), message };
    let backend = super::backend_of(file).map_err(|e| open_err(e.to_string()))?;
    let db = Database::builder().create_with_backend(backend).map_err(|e| open_err(e.to_string()))?;
    let mut record = ensure(&db, true)?;
    let mut epoch = record.epoch;
    while epoch == record.epoch || epoch == 0 {
        epoch = rand::random::<u64>();
    }
    record.epoch = epoch;
    let mut wtx = db.begin_write()?;
    wtx.set_quick_repair(true);
    wtx.open_table(META)?.insert(META_KEY_SCOPE, encode(&record).as_slice())?;
    wtx.commit()?;
    Ok(epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store first opened by this build after older builds ingested a source keeps that
    /// source's keys as they were (legacy); a source ingested later names itself. A restore's
    /// new epoch keeps the legacy list and is never 0 nor the old epoch.
    #[test]
    fn sources_ingested_before_stay_legacy_and_a_new_epoch_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        {
            let db = Database::create(&path).unwrap();
            let wtx = db.begin_write().unwrap();
            wtx.open_table(WATERMARKS).unwrap().insert("county", [1u8].as_slice()).unwrap();
            wtx.commit().unwrap();
            let record = ensure(&db, true).unwrap();
            assert_eq!(record.legacy_sources.iter().collect::<Vec<_>>(), vec!["county"]);
            assert_eq!(record.for_source("county").source, None);
            assert_eq!(record.for_source("city").source, Some("city"));
            // Written once: a source ingested since does not become legacy.
            let wtx = db.begin_write().unwrap();
            wtx.open_table(WATERMARKS).unwrap().insert("city", [1u8].as_slice()).unwrap();
            wtx.commit().unwrap();
            assert_eq!(ensure(&db, true).unwrap(), record);
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let first = new_epoch(&file, &path).unwrap();
        let second = new_epoch(&file, &path).unwrap();
        assert!(first != 0 && second != 0 && first != second);
        let record = ensure(&Database::create(&path).unwrap(), true).unwrap();
        assert_eq!((record.epoch, record.legacy_sources.len()), (second, 1));
    }
}
