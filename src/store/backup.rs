//! Backup and restore. redb has no backup API and copying the open file mid-write is unsafe,
//! so a backup is a fresh redb file filled from one read transaction: a consistent snapshot
//! taken while ingest and delivery keep running (readers never block the writer).
//!
//! Every table must be listed in `copy_all`; `tests/backup.rs` checks that the backup holds
//! exactly the tables of the live store, so a table added without a line here fails the suite.

use super::tables::*;
use super::{Store, StoreError, SCHEMA_VERSION};
use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable, TableHandle, WriteTransaction};
use std::path::{Path, PathBuf};

/// What a backup wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupInfo {
    pub path: PathBuf,
    pub bytes: u64,
    pub tables: usize,
    pub rows: u64,
}

macro_rules! copy_tables {
    ($rtx:expr, $wtx:expr, $rows:expr, $($def:expr),* $(,)?) => {{
        let mut n = 0usize;
        $(
            {
                let src = $rtx.open_table($def)?;
                let mut dst = $wtx.open_table($def)?;
                for item in src.iter()? {
                    let (k, v) = item?;
                    dst.insert(k.value(), v.value())?;
                    $rows += 1;
                }
                n += 1;
            }
        )*
        n
    }};
}

fn copy_all(rtx: &ReadTransaction, wtx: &WriteTransaction, rows: &mut u64) -> Result<usize, StoreError> {
    Ok(copy_tables!(
        rtx, wtx, *rows, META, WATERMARKS, WATERMARK_HISTORY, PARCEL_BLOCKS, IDEM_KEYS, IDEM_KEY_JOURNAL, IDEM_EXPIRY_BUCKETS, OUTBOX,
        OUTBOX_RETRY, AUDIT, DEAD_LETTERS, QUARANTINE, RUNS, HOLDS, HELD_PARCELS, HELD_EVENTS, SUBSCRIBERS,
        DERIVED_SHARES, HELD_SHARES, OUTBOX_LEASES, OUTBOX_RETRY_DUE, DELIVERY_ATTEMPTS, DLQ_REPLAYS,
        DLQ_QUARANTINE, ENDPOINTS, DELIVERY_ATTEMPTS_BY_ROW,
    ))
}

impl Store {
    /// Writes a consistent copy of the store to `dest` (which must not exist). The copy is
    /// written to a temp file beside `dest`, checked, then renamed into place.
    pub fn backup_to(&self, dest: &Path) -> Result<BackupInfo, StoreError> {
        if dest.exists() {
            return Err(StoreError::Conflict(format!("backup destination {} already exists", dest.display())));
        }
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let tmp = tempfile::Builder::new()
            .prefix(".zonewatch-backup-")
            .tempfile_in(parent)
            .map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot create a temp file: {e}") })?;
        let mut rows = 0u64;
        let tables;
        {
            let db = Database::create(tmp.path())?;
            let rtx = self.db.begin_read()?;
            let wtx = db.begin_write()?;
            tables = copy_all(&rtx, &wtx, &mut rows)?;
            wtx.commit()?;
            drop(db);
        }
        // Check what we wrote before it takes the destination's name.
        verify_file(tmp.path())?;
        tmp.persist(dest).map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot move the backup into place: {e}") })?;
        let bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
        Ok(BackupInfo { path: dest.to_path_buf(), bytes, tables, rows })
    }

    /// Names of the tables in the store (for the backup completeness check).
    pub fn table_names(&self) -> Result<Vec<String>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut names: Vec<String> = rtx.list_tables()?.map(|t| t.name().to_string()).collect();
        names.sort();
        Ok(names)
    }
}

/// Opens a store file read-write, runs redb's integrity check and the schema check.
pub fn verify_file(path: &Path) -> Result<(), StoreError> {
    let mut db = Database::open(path).map_err(|e| StoreError::Open {
        path: path.to_path_buf(),
        message: format!("not a readable zonewatch store: {e}"),
    })?;
    let ok = db.check_integrity().map_err(|e| StoreError::Open { path: path.to_path_buf(), message: format!("integrity check failed: {e}") })?;
    if !ok {
        return Err(StoreError::Open { path: path.to_path_buf(), message: "integrity check found damage (it was repaired in memory only)".into() });
    }
    let rtx = db.begin_read()?;
    let meta = rtx.open_table(META).map_err(|e| StoreError::Open { path: path.to_path_buf(), message: format!("not a zonewatch store: {e}") })?;
    let found = match meta.get(META_SCHEMA)? {
        Some(v) => {
            let b = v.value();
            let mut arr = [0u8; 4];
            let n = b.len().min(4);
            arr[..n].copy_from_slice(&b[..n]);
            u32::from_le_bytes(arr)
        }
        None => return Err(StoreError::Open { path: path.to_path_buf(), message: "no schema version record: not a zonewatch store".into() }),
    };
    // A backup of an older format is fine to restore: the next open upgrades it.
    if !(super::OLDEST_SCHEMA_VERSION..=SCHEMA_VERSION).contains(&found) {
        return Err(StoreError::SchemaVersion { path: path.to_path_buf(), found, expected: SCHEMA_VERSION });
    }
    Ok(())
}

/// Restores `src` (a backup) over the store at `dest`. Refuses when `dest` is in use by a
/// running zonewatch, and when `src` is not a healthy store of this version. The previous
/// store, if any, is kept as `<dest>.before-restore`.
pub fn restore(src: &Path, dest: &Path) -> Result<(), StoreError> {
    verify_file(src)?;
    if dest.exists() {
        // If another process has it open, redb refuses to open it: that is our "in use" check.
        match Database::open(dest) {
            Ok(db) => drop(db),
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(StoreError::Conflict(format!(
                    "store {} is in use by a running zonewatch; stop it (systemctl stop zonewatch) before restoring",
                    dest.display()
                )))
            }
            Err(_) => {} // a damaged store may be replaced
        }
    }
    let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: e.to_string() })?;
    let tmp = tempfile::Builder::new()
        .prefix(".zonewatch-restore-")
        .tempfile_in(parent)
        .map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot create a temp file: {e}") })?;
    std::fs::copy(src, tmp.path()).map_err(|e| StoreError::Open { path: src.to_path_buf(), message: format!("cannot copy: {e}") })?;
    if dest.exists() {
        let keep = dest.with_extension("redb.before-restore");
        std::fs::rename(dest, &keep).map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot keep the old store: {e}") })?;
    }
    tmp.persist(dest).map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot move the restored store into place: {e}") })?;
    Ok(())
}
