//! Backup and restore. redb has no backup API and copying the open file mid-write is unsafe,
//! so a backup is a fresh redb file filled from one read transaction: a consistent snapshot
//! taken while ingest and delivery keep running (readers never block the writer).
//!
//! Every table must be listed in `copy_all`; `tests/backup.rs` checks that the backup holds
//! exactly the tables of the live store, so a table added without a line here fails the suite.

use super::tables::*;
use super::{Store, StoreError, SCHEMA_VERSION};
use redb::{ReadTransaction, ReadableDatabase, ReadableTable, TableHandle, WriteTransaction};
use std::path::{Path, PathBuf};

/// What a backup wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupInfo {
    pub path: PathBuf,
    pub bytes: u64,
    pub tables: usize,
    pub rows: u64,
}

/// Where a copy step failed: reading the store, or writing the backup. Only the store's own
/// failure says anything about the store's open file (`super::on_reopen_needed`).
enum CopyError {
    Store(redb::Error),
    Backup(redb::Error),
}

macro_rules! copy_tables {
    ($rtx:expr, $wtx:expr, $rows:expr, $older:expr, $($def:expr),* $(,)?) => {{
        let store = |e: redb::Error| CopyError::Store(e);
        let backup = |e: redb::Error| CopyError::Backup(e);
        let mut n = 0usize;
        $(
            // A table a read-only file of an older schema lacks (see `SAME_TABLES_SINCE`) is
            // left out: the copy's next open creates it, as it would the file's own. In a
            // file of this schema a missing table is damage, and the backup fails on it.
            match $rtx.open_table($def) {
                Err(redb::TableError::TableDoesNotExist(_)) if $older => {}
                Err(e) => return Err(store(e.into())),
                Ok(src) => {
                    let mut dst = $wtx.open_table($def).map_err(|e| backup(e.into()))?;
                    for item in src.iter().map_err(|e| store(e.into()))? {
                        let (k, v) = item.map_err(|e| store(e.into()))?;
                        dst.insert(k.value(), v.value()).map_err(|e| backup(e.into()))?;
                        $rows += 1;
                    }
                    n += 1;
                }
            }
        )*
        n
    }};
}

/// How a backup's temp file is named while it is written (beside its destination); a
/// process killed meanwhile (SIGKILL, a power cut) leaves it.
pub const TEMP_PREFIX: &str = ".zonewatch-backup-";

/// How the copy a running daemon writes for `zonewatch backup` is named in its `backups/`
/// folder: the command copies it to the path it was given, then removes it. A command killed
/// before that (SIGKILL, a dropped ssh session) leaves it, a whole store.
pub const HANDOFF_PREFIX: &str = "zonewatch-handoff-";

/// How long a leftover must have gone unmodified before [`sweep_leftovers`] removes it: far
/// longer than writing or copying any store takes, so a backup or a copy under way in this
/// process or another is never touched.
pub const LEFTOVER_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Removes from the daemon's `backups/` folder (`dir`) what killed backups left there: temp
/// files ([`TEMP_PREFIX`]) and hand-off copies no command came back for ([`HANDOFF_PREFIX`]),
/// unmodified for [`LEFTOVER_AGE`] at `now`. Backups an operator asked for (`POST /v1/backup`,
/// any other name) are never touched. Returns the files removed; each is logged, and one
/// that cannot be removed is logged and left for the next sweep. Without it, a cron job's
/// killed backups fill the disk one store at a time.
pub fn sweep_leftovers(dir: &Path, now: std::time::SystemTime) -> usize {
    sweep_idle(dir, now, "a killed backup", |name, _| {
        // Reading a file does not touch its time: a hand-off copy whose command is still
        // running (copying a large store to a slow disk, or past a wall-clock step) is kept.
        is_backup_temp(name) || handoff_command_gone(name)
    })
}

/// The prefix of a restore's temp copy, made beside the store.
pub const RESTORE_PREFIX: &str = ".zonewatch-restore-";

/// Removes from the store's folder the temp copies of restores killed before they finished
/// (SIGKILL, a lost ssh session), unmodified for [`LEFTOVER_AGE`]: each is a full copy of a
/// store, signing secrets included, and nothing else would ever remove it (found by a
/// black-box tester). Run when a store is opened for work (`Engine::open`).
pub fn sweep_restore_leftovers(store_path: &Path, now: std::time::SystemTime) -> usize {
    let dir = crate::util::folder_of(store_path);
    sweep_idle(dir, now, "a killed restore", |name, _| name.starts_with(RESTORE_PREFIX))
}

/// The prefix of the repaired copy `check --store` makes of a store not closed cleanly, in
/// the system's temp folder (`store::check`).
pub const CHECK_PREFIX: &str = "zonewatch-check-";

/// Removes from the temp folder `dir` the repaired copies of `check --store` runs killed
/// outright (SIGKILL; a signal removes its own), unmodified for [`LEFTOVER_AGE`] and owned by
/// `owner`: each is a full copy of a store, signing secrets included, and nothing else would
/// remove it. Another user's are left (the temp folder is shared, and its sticky bit would
/// refuse it anyway). Run by the next check that makes such a copy.
pub fn sweep_check_leftovers(dir: &Path, owner: u32, now: std::time::SystemTime) -> usize {
    use std::os::unix::fs::MetadataExt;
    sweep_idle(dir, now, "a killed check", |name, meta| meta.uid() == owner && name.starts_with(CHECK_PREFIX) && name.ends_with(".redb"))
}

/// Removes from `dir`, the folder a `zonewatch backup` writes its file to, the temp files
/// ([`TEMP_PREFIX`]) of backups to that folder killed outright (SIGKILL: a cron job's
/// `timeout -s KILL`, the OOM killer; a signal removes its own), unmodified for
/// [`LEFTOVER_AGE`] and owned by `owner`: each is a whole store, and nothing else would
/// remove it (found by a black-box tester). Run by the next backup to that folder; any other
/// file there is the operator's.
pub fn sweep_backup_leftovers(dir: &Path, owner: u32, now: std::time::SystemTime) -> usize {
    use std::os::unix::fs::MetadataExt;
    sweep_idle(dir, now, "a killed backup", |name, meta| meta.uid() == owner && is_backup_temp(name))
}

/// Whether `name` is a backup temp file as [`backup_from`] names them: [`TEMP_PREFIX`] and
/// `tempfile`'s six random letters or digits, nothing else. An operator's own
/// `.zonewatch-backup-notes.txt` is not one (a black-box tester's was removed).
fn is_backup_temp(name: &str) -> bool {
    name.strip_prefix(TEMP_PREFIX).is_some_and(|rest| rest.len() == 6 && rest.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// Removes the files of `dir` that `leftover` names (given their metadata) and that were not
/// modified for [`LEFTOVER_AGE`] at `now`, logging each (`what` left it). Returns how many.
fn sweep_idle(dir: &Path, now: std::time::SystemTime, what: &str, leftover: impl Fn(&str, &std::fs::Metadata) -> bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let idle = meta.modified().ok().and_then(|m| now.duration_since(m).ok());
        if idle.is_none_or(|idle| idle < LEFTOVER_AGE) || !leftover(&name.to_string_lossy(), &meta) {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                removed += 1;
                tracing::warn!(path = %entry.path().display(), bytes = meta.len(), "removed what {what} left (a temp file, or a copy no command came back for)");
            }
            Err(e) => tracing::warn!(path = %entry.path().display(), "cannot remove what {what} left: {e}"),
        }
    }
    removed
}

/// Whether `name` is a hand-off copy's (`zonewatch-handoff-<time>-<pid>.redb`) whose
/// `zonewatch backup` has ended: no process of its pid is left. Where that cannot be told (no
/// `/proc`, a name without a pid), it has not.
fn handoff_command_gone(name: &str) -> bool {
    let Some(pid) = name.strip_prefix(HANDOFF_PREFIX).and_then(|n| n.strip_suffix(".redb")).and_then(|n| n.rsplit_once('-')).map(|(_, pid)| pid) else { return false };
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || !Path::new("/proc/self").exists() {
        return false;
    }
    !Path::new("/proc").join(pid).exists()
}

fn copy_all(rtx: &ReadTransaction, wtx: &WriteTransaction, rows: &mut u64, older: bool) -> Result<usize, CopyError> {
    Ok(every_table!(copy_tables!(rtx, wtx, *rows, older,)))
}

impl Store {
    /// Writes a consistent copy of the store to `dest` (which must not exist). The copy is
    /// written to a temp file beside `dest`, checked, then renamed into place.
    pub fn backup_to(&self, dest: &Path) -> Result<BackupInfo, StoreError> {
        backup_from(|| Ok(self.db.begin_read()?), dest, false)
    }

    /// Names of the tables in the store (for the backup completeness check).
    pub fn table_names(&self) -> Result<Vec<String>, StoreError> {
        let rtx = self.db.begin_read()?;
        let mut names: Vec<String> = rtx.list_tables()?.map(|t| t.name().to_string()).collect();
        names.sort();
        Ok(names)
    }
}

/// The oldest schema whose tables are the ones this build copies (12 changed records, not
/// tables; 13 added `runs_swept` and `endpoint_disabled_targets`, 14 `open_holds`, which an
/// older file lacks and its copy leaves out): a
/// read-only backup copies such a file as it is, and the copy is upgraded when it is next
/// opened.
const SAME_TABLES_SINCE: u32 = 11;

/// [`Store::backup_to`] for a store file this user may read but not write (a file kept
/// read-only, a read-only mount, a forensic copy): redb opens it read-only, where a
/// [`Store`] writes even to read; the copy is checked as any backup is. Only a store whose
/// tables are this build's ([`SAME_TABLES_SINCE`]): an older one keeps tables this build's list does not copy (its snapshot
/// before the upgrade moved it, found by a reviewer: the copy would have verified without
/// its parcels), a newer one tables this build does not know. A file not closed cleanly
/// cannot be read so either: redb repairs a file only where it may write it.
pub fn backup_read_only(path: &Path, dest: &Path) -> Result<BackupInfo, StoreError> {
    let open_err = |message: String| StoreError::Open { path: path.to_path_buf(), message };
    let copy_it = "copy the file to where this user may write and back up the copy (`zonewatch backup` with a config naming it)";
    let opened = super::guard::guarded(|| redb::Builder::new().set_cache_size(16 << 20).open_read_only(path)).map_err(|p| p.at(path))?;
    let db = opened.map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse { path: path.to_path_buf() },
        redb::DatabaseError::RepairAborted => open_err(format!("was not closed cleanly, and redb repairs a file only where it may write it: {copy_it}")),
        redb::DatabaseError::Storage(redb::StorageError::Io(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            open_err(format!("{e}: this user may not read the store file; run zonewatch as the file's owner"))
        }
        other => open_err(format!("not a readable zonewatch store: {other}. If the file is damaged, restore a backup: zonewatch restore BACKUP --config FILE")),
    })?;
    let not_ours = |e: StoreError| open_err(format!("not a zonewatch store: {e}"));
    let schema = super::schema_in(&redb::ReadableDatabase::begin_read(&db)?).map_err(not_ours)?;
    let Some(schema) = schema else {
        return Err(open_err("no schema version record: not a zonewatch store".into()));
    };
    if !(SAME_TABLES_SINCE..=SCHEMA_VERSION).contains(&schema) {
        let found = schema;
        return Err(open_err(format!(
            "its format version is {found}: read-only, it cannot be upgraded, and this build ({SCHEMA_VERSION}) copies the tables of versions {SAME_TABLES_SINCE} to {SCHEMA_VERSION} only; back it up with the release that wrote it, or {copy_it}"
        )));
    }
    backup_from(|| Ok(redb::ReadableDatabase::begin_read(&db)?), dest, schema < SCHEMA_VERSION)
}

/// Writes the tables `begin_read` gives to `dest` (which must not exist): see
/// [`Store::backup_to`].
/// `older`: the file is of an older schema than this build's, whose newer tables it may lack.
fn backup_from(begin_read: impl FnOnce() -> Result<ReadTransaction, StoreError>, dest: &Path, older: bool) -> Result<BackupInfo, StoreError> {
    let exists = || StoreError::Conflict(format!("backup destination {} already exists", dest.display()));
    if dest.exists() {
        return Err(exists());
    }
    let parent = crate::util::folder_of(dest);
    let backup_err = |source: StoreError| StoreError::Backup { dest: dest.to_path_buf(), source: Box::new(source) };
    let tmp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempfile_in(parent)
        .map_err(|source| backup_err(StoreError::Io { what: format!("cannot create a temp file in {}", absolute(parent).display()), source }))?;
    let _unfinished = crate::signals::scratch(tmp.path());
    let mut rows = 0u64;
    let rtx = begin_read()?;
    // The copy's errors (a full backup disk) are the backup's, named as such, and say
    // nothing about the store; a failure reading the store is the store's, converted
    // outside the scope.
    let copied = super::on_other_file(|| -> Result<Result<usize, redb::Error>, StoreError> {
        // Through the temp file's handle, as its check is: by name, a link put in its place
        // (the folder may be the service user's, the command run as root) would have redb
        // write into the file the link names.
        let backend = super::backend_of(tmp.as_file()).map_err(|source| StoreError::Io { what: format!("cannot open the temp file {}", tmp.path().display()), source })?;
        let db = redb::Builder::new().create_with_backend(backend)?;
        let wtx = db.begin_write()?;
        match copy_all(&rtx, &wtx, &mut rows, older) {
            Ok(tables) => {
                wtx.commit()?;
                Ok(Ok(tables))
            }
            Err(CopyError::Store(e)) => Ok(Err(e)),
            Err(CopyError::Backup(e)) => Err(e.into()),
        }
    })
    .map_err(backup_err)?;
    let tables = copied?;
    // Check what we wrote before it takes the destination's name.
    verify_as(tmp.as_file(), tmp.path()).map_err(backup_err)?;
    crate::signals::committing();
    // Never over a file: two backups asked for under one name at once both found it free
    // above (a tester's two `POST /v1/backup` both answered 201, one copy replaced).
    let copy = tmp.persist_noclobber(dest).map_err(|e| match e.error.kind() {
        std::io::ErrorKind::AlreadyExists => exists(),
        _ => StoreError::Open { path: dest.to_path_buf(), message: format!("cannot move the backup into place: {e}") },
    })?;
    // The move goes by the temp file's name: a file or link put in that name's place after
    // the check (the folder may be another user's) would be what took `dest`, reported as the
    // backup that was checked (a reader). Said, not reported as a backup.
    let written = copy.metadata().map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("cannot read the backup's size: {e}") })?;
    if !is_at(dest, &written) {
        return Err(StoreError::Open {
            path: dest.to_path_buf(),
            message: "the file now at this name is not the backup that was written and checked: its temp file was replaced while the backup ran (another user writing in this folder?); do not use it".into(),
        });
    }
    sync_folder_of(dest).map_err(|e| StoreError::Open { path: dest.to_path_buf(), message: format!("the backup is in place but its folder could not be synced: {e}") })?;
    let bytes = written.len();
    Ok(BackupInfo { path: dest.to_path_buf(), bytes, tables, rows })
}

/// Opens a store file read-write, runs redb's integrity check and the schema check. The open
/// writes to the file (redb marks it open, and may repair it): check a copy of a file that
/// must stay as it is (`restore` does).
pub fn verify_file(path: &Path) -> Result<(), StoreError> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| StoreError::Open { path: path.to_path_buf(), message: format!("not a readable zonewatch store: {e}") })?;
    verify_as(&file, path)
}

/// [`verify_file`] on the open `file`, with errors naming `shown` (the file the operator
/// named, when `file` is a temporary copy of it). Through the handle: a restore run as root
/// works in the service user's folder, where that user could put a link in a name's place.
fn verify_as(file: &std::fs::File, shown: &Path) -> Result<(), StoreError> {
    super::on_other_file(|| verify_other(file, shown))
}

fn verify_other(file: &std::fs::File, shown: &Path) -> Result<(), StoreError> {
    let open_err = |message: String| StoreError::Open { path: shown.to_path_buf(), message };
    // Refused before redb is given it: redb would write a new database into an empty file (a
    // reader), where the open by name this replaces refused it.
    if file.metadata().map_err(|e| open_err(format!("not a readable zonewatch store: {e}")))?.len() == 0 {
        return Err(open_err("it is empty: not a zonewatch store".into()));
    }
    let backend = super::backend_of(file).map_err(|e| open_err(format!("not a readable zonewatch store: {e}")))?;
    let mut db = redb::Builder::new().create_with_backend(backend).map_err(|e| open_err(format!("not a readable zonewatch store: {e}")))?;
    let ok = db.check_integrity().map_err(|e| open_err(format!("integrity check failed: {e}")))?;
    if !ok {
        return Err(open_err("integrity check found damage (it was repaired in memory only)".into()));
    }
    let found = super::schema_in(&db.begin_read()?).map_err(|e| open_err(format!("not a zonewatch store: {e}")))?;
    let Some(found) = found else {
        return Err(open_err("no schema version record: not a zonewatch store".into()));
    };
    // A backup of an older format is fine to restore: the next open upgrades it.
    super::opens_schema(found, shown)
}

/// The run ids of the holds still open in the store file at `path`, read through a read-only
/// open: `restore` warns of them (releasing one sends its alerts under new `webhook-id`s,
/// also those subscribers got after the backup was taken).
fn open_holds_in(file: &std::fs::File, path: &Path) -> Result<Vec<u64>, StoreError> {
    let open_err = |e: String| StoreError::Open { path: path.to_path_buf(), message: e };
    let db = redb::Builder::new().open_read_only_with_backend(super::backend_of(file).map_err(|e| open_err(e.to_string()))?).map_err(|e| open_err(e.to_string()))?;
    let holds = super::queries::holds_in(&db.begin_read()?)?;
    Ok(holds.into_iter().filter(|h| h.state == crate::model::HoldState::Open).map(|h| h.run_id).collect())
}

/// Whether the file at `path` itself (a link there not followed) is the one of `written`: a
/// backup or restore moved into place by its temp file's name, in a folder another user may
/// write, checks it moved the file it wrote.
fn is_at(path: &Path, written: &std::fs::Metadata) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| same_file(&m, written))
}

/// Whether two files' metadata are of one file (same device and inode: a hard link, or the
/// same path written two ways).
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

/// What a restore did besides putting the backup in place, for the operator to read.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreInfo {
    /// Where the replaced store was kept (`None`: there was no store to replace). Never a
    /// name that already existed, so an earlier restore's copy is never overwritten.
    pub kept: Option<PathBuf>,
    /// What the operator must see to: the restored file could not be given the replaced
    /// store's owner (not running as root, say), so the service user may be unable to open it
    /// until it is chowned; its folder could not be synced after the rename.
    pub warnings: Vec<String>,
    /// The run ids of the holds open in the backup: open again now (see `open_holds_in`);
    /// an error when they could not be read (the restore is done all the same).
    pub open_holds: Result<Vec<u64>, String>,
}

/// Restores `src` (a backup) over the store at `dest`. Refuses when `dest` is in use by a
/// running zonewatch, and when `src` is not a healthy store of this version.
///
/// `src` is only read: it is copied to a temp file beside `dest` (same filesystem), and that
/// copy is verified (redb's open writes to the file it opens) and renamed into place. The
/// restored file takes the replaced store's mode and, where permitted, its owner and group
/// (the service user must still be able to open it); without a previous store it is 0600, and
/// restored by root into a folder of another user's (a package's `/var/lib/zonewatch`), that
/// user's.
/// The previous store, if any, is kept as `<dest>.before-restore`, or `.before-restore.1`,
/// `.2`, … when that name is taken.
pub fn restore(src: &Path, dest: &Path) -> Result<RestoreInfo, StoreError> {
    let open_err = |path: &Path, message: String| StoreError::Open { path: path.to_path_buf(), message };
    let previous = match std::fs::metadata(dest) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(open_err(dest, e.to_string())),
    };
    match std::fs::metadata(src) {
        Ok(m) if m.is_dir() => return Err(open_err(src, "it is a folder: name the backup file".into())),
        // The store given as its own backup: restoring it would only start a new key epoch
        // and keep yet another copy of it (found by a black-box tester).
        Ok(m) if previous.as_ref().is_some_and(|p| same_file(p, &m)) => {
            return Err(open_err(src, format!("it is the store itself ({}): name a backup of it", dest.display())))
        }
        _ => {}
    }
    if previous.is_some() {
        // If another process has it open, redb refuses to open it: that is our "in use" check.
        // Read-only, so the store being replaced is kept exactly as it was (a writable open
        // would repair a crashed daemon's file first). A damaged store may be replaced, also
        // one that makes redb panic.
        let probe = super::guard::guarded(|| redb::Builder::new().open_read_only(dest).map(drop));
        if let Ok(Err(redb::DatabaseError::DatabaseAlreadyOpen)) = probe {
            return Err(in_use_conflict(dest));
        }
    }
    // Held from here until the restored file is in place: without it a `run` from a timer
    // or a restarting `serve` could open the old store during the copy, go on writing it once
    // it is set aside, and a second zonewatch open the restored one: two live ledgers.
    let _held = match previous {
        Some(_) => hold_against_opens(dest)?,
        None => None,
    };
    let parent = crate::util::folder_of(dest);
    std::fs::create_dir_all(parent).map_err(|e| open_err(dest, e.to_string()))?;
    let copy = verified_copy(src, parent, RESTORE_PREFIX)?;
    let tmp = &copy.tmp;
    let folder = std::fs::metadata(parent).ok();
    let mut warnings: Vec<String> = take_identity(tmp.as_file(), previous.as_ref(), folder.as_ref()).map_err(|e| open_err(dest, format!("cannot set the restored file's mode: {e}")))?.into_iter().collect();
    // Changes made after the backup was taken were counted in a store now lost: keys claimed
    // from here on name a new epoch, so none takes the key of a change sent since the backup
    // (`key_scope.rs`).
    super::key_scope::new_epoch(tmp.as_file(), tmp.path())?;
    // Read from the copy before it takes the store's name: once it has, a `run` from a timer
    // may hold it (found by a reviewer).
    let open_holds = open_holds_in(tmp.as_file(), tmp.path()).map_err(|e| e.to_string());
    tmp.as_file().sync_all().map_err(|e| open_err(dest, format!("cannot sync the restored file: {e}")))?;
    // From here the old store is kept aside and the new one renamed in: a signal waits.
    crate::signals::committing();
    let kept = match previous {
        Some(_) => Some(keep_aside(dest)?),
        None => None,
    };
    let VerifiedCopy { tmp, _unfinished: registered, .. } = copy;
    let restored = tmp.persist(dest).map_err(|e| {
        // Where the old store went, when the restore stops between the two names.
        let kept_at = kept.as_ref().map(|k| format!(" (the replaced store is kept at {})", k.display())).unwrap_or_default();
        open_err(dest, format!("cannot move the restored store into place: {e}{kept_at}"))
    })?;
    // The renames (and the old store's second name) are entries of the folder: synced, so
    // that a power cut after "restored" cannot bring back the old name or lose the new one.
    // The restore is done either way: said, with what it did (a seventh reader: an error
    // here lost the replaced store's name and the owner warning).
    if let Err(e) = sync_folder_of(dest) {
        warnings.push(format!("the restored store is in place, but its folder could not be synced ({e}): a power cut now could bring back the replaced store under its name; run sync before relying on it"));
    }
    // The rename moved whatever had the temp file's name: in a folder another user can write,
    // that could be something else than the file restored through its handle.
    if let Ok(mine) = restored.metadata() {
        if !is_at(dest, &mine) {
            warnings.push(format!("{} is not the file this restore wrote: something changed its folder during the restore; check what is there before starting zonewatch", dest.display()));
        }
    }
    drop(registered);
    Ok(RestoreInfo { kept, warnings, open_holds })
}

/// Syncs the folder holding `path`, making a rename or a new link in it durable (the file's
/// own `sync_all` does not cover its name).
fn sync_folder_of(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// What `restore` says when the store it would replace is open in some process.
fn in_use_conflict(path: &Path) -> StoreError {
    StoreError::Conflict(format!("store {} is in use by a running zonewatch; stop it (systemctl stop zonewatch) before restoring", path.display()))
}

/// Takes the whole-file lock (`flock`) that redb also takes when it opens a store, so no
/// zonewatch can open the store at `path` while the returned file is held: redb then reports
/// it as already open ([`StoreError::InUse`]). A store some process has open already is a
/// [`StoreError::Conflict`]. `None` where the file system has no such lock (the restore goes
/// on, as it did before this lock).
fn hold_against_opens(path: &Path) -> Result<Option<std::fs::File>, StoreError> {
    let Ok(file) = std::fs::File::open(path) else { return Ok(None) };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Err(in_use_conflict(path)),
        Err(std::fs::TryLockError::Error(_)) => Ok(None),
    }
}

/// A verified copy of the store file `src` in a new temp file in `dir` (named `prefix…`),
/// synced, ready to be renamed into place there; with its size. Verified as
/// [`verify_file`] does, under the redb-panic guard, errors naming `src` (redb's open
/// writes to the file it opens: the copy is opened, `src` is only read). `restore` and the
/// command line's copy of a live backup both put a file in place this way.
pub fn verified_copy(src: &Path, dir: &Path, prefix: &str) -> Result<VerifiedCopy, StoreError> {
    let cannot = |source: std::io::Error| StoreError::Io { what: format!("cannot copy {} into {}", src.display(), absolute(dir).display()), source };
    let mut from = std::fs::File::open(src).map_err(|e| StoreError::Open { path: src.to_path_buf(), message: format!("cannot read it: {e}") })?;
    let mut tmp = tempfile::Builder::new().prefix(prefix).tempfile_in(dir).map_err(cannot)?;
    let unfinished = crate::signals::scratch(tmp.path());
    let bytes = std::io::copy(&mut from, tmp.as_file_mut()).map_err(cannot)?;
    tmp.as_file().sync_all().map_err(cannot)?;
    super::guard::guarded(|| verify_as(tmp.as_file(), src)).map_err(|p| p.at(src))??;
    Ok(VerifiedCopy { tmp, bytes, _unfinished: unfinished })
}

/// What [`verified_copy`] made: the temp file, its size, and its registration as an
/// unfinished copy that a signal removes — kept until the caller has renamed it into place
/// (or dropped it), so no signal between the copy and the rename leaves it behind.
#[derive(Debug)]
pub struct VerifiedCopy {
    pub tmp: tempfile::NamedTempFile,
    pub bytes: u64,
    _unfinished: crate::signals::Scratch,
}

/// `path` made absolute for a message (`.` says nothing), as it is when that fails.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The name the store replaced by the `n`-th restore kept beside it (0: the first free one).
fn before_restore_name(dest: &Path, n: u32) -> PathBuf {
    let mut name = dest.file_name().map(|f| f.to_os_string()).unwrap_or_default();
    name.push(".before-restore");
    if n > 0 {
        name.push(format!(".{n}"));
    }
    dest.with_file_name(name)
}

/// Gives the store at `dest` a second name that did not exist before: a hard link, so `dest`
/// stays in place until the restored file replaces it in one rename (a rename where links are
/// not supported). Returns that name.
fn keep_aside(dest: &Path) -> Result<PathBuf, StoreError> {
    let err = |message: String| StoreError::Open { path: dest.to_path_buf(), message };
    for n in 0..10_000 {
        let candidate = before_restore_name(dest, n);
        match std::fs::hard_link(dest, &candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(_) if std::fs::symlink_metadata(&candidate).is_err() => {
                std::fs::rename(dest, &candidate).map_err(|e| err(format!("cannot keep the old store as {}: {e}", candidate.display())))?;
                return Ok(candidate);
            }
            Err(e) => return Err(err(format!("cannot keep the old store as {}: {e}", candidate.display()))),
        }
    }
    Err(err("cannot keep the old store: 10,000 earlier copies of it (*.before-restore.N) are in the way".into()))
}

/// The restored file's mode: the replaced store's (0600 without one), less every group and
/// other bit when the file could not be given that store's owner and group. Those classes
/// would then hold other people than they did (the restorer's group, the old group's members
/// as "others") on a file that holds signing secrets (a sixth and a seventh reader).
fn restored_mode(old_mode: Option<u32>, identity_taken: bool) -> u32 {
    match old_mode {
        None => 0o600,
        Some(m) if identity_taken => m & 0o777,
        Some(m) => m & 0o700,
    }
}

/// Gives the restored file the replaced store's mode, owner and group, so whoever could open
/// the old store can open the new one. Changing the owner needs root: when it fails the
/// owner's bits are still set, and the returned warning says what to do. Without a replaced
/// store the file is 0600, and when root restores it into a folder of another user's, that
/// user's (a black-box tester: a root `zonewatch restore` on a fresh package install left a
/// root-owned store the service could not open).
#[cfg(unix)]
fn take_identity(file: &std::fs::File, previous: Option<&std::fs::Metadata>, folder: Option<&std::fs::Metadata>) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mine = file.metadata()?;
    let Some(old) = previous else {
        file.set_permissions(std::fs::Permissions::from_mode(restored_mode(None, true)))?;
        let Some(folder) = folder.filter(|f| mine.uid() == 0 && f.uid() != 0) else { return Ok(None) };
        return Ok(std::os::unix::fs::fchown(file, Some(folder.uid()), Some(folder.gid())).err().map(|e| {
            format!("the restored store could not be given its folder's owner {}:{} ({e}); it belongs to root: chown it before starting zonewatch as that user", folder.uid(), folder.gid())
        }));
    };
    let taken = if mine.uid() != old.uid() {
        std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid()))
    } else if mine.gid() != old.gid() {
        std::os::unix::fs::fchown(file, None, Some(old.gid()))
    } else {
        Ok(())
    };
    let warning = match &taken {
        Ok(()) => None,
        Err(e) if mine.uid() != old.uid() => Some(format!(
            "the restored store could not be given the replaced store's owner {}:{} ({e}); only its owner may use it now: chown it (and give its group back the access it had) before starting zonewatch as that user",
            old.uid(),
            old.gid()
        )),
        // The owner is already the replaced store's (a restore run as that user): zonewatch
        // running as it opens the file; only the group's and others' access is at stake (a
        // black-box tester was told to chown a file whose owner was right).
        Err(e) => (old.mode() & 0o077 != 0).then(|| {
            format!(
                "the restored store could not be given the replaced store's group {} ({e}); its owner is right, but only the owner may use it now: chgrp it and give the group back the access it had",
                old.gid()
            )
        }),
    };
    file.set_permissions(std::fs::Permissions::from_mode(restored_mode(Some(old.mode()), taken.is_ok())))?;
    Ok(warning)
}

/// Elsewhere only the read-only bit carries over.
#[cfg(not(unix))]
fn take_identity(file: &std::fs::File, previous: Option<&std::fs::Metadata>, _folder: Option<&std::fs::Metadata>) -> std::io::Result<Option<String>> {
    if let Some(old) = previous {
        file.set_permissions(old.permissions())?;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    /// The restored file keeps the replaced store's mode only with its owner and group;
    /// without them no group or other bit is left (0604 gave the old group's members, now
    /// "others", a read they did not have); without a replaced store, 0600.
    #[test]
    fn a_restored_file_keeps_group_and_other_access_only_with_the_identity() {
        assert_eq!(super::restored_mode(None, true), 0o600);
        assert_eq!(super::restored_mode(Some(0o100640), true), 0o640);
        for old in [0o640, 0o604, 0o666, 0o600] {
            assert_eq!(super::restored_mode(Some(old), false), old & 0o700, "{old:o}");
        }
    }

    use super::*;

    /// The sweep removes only what killed backups leave (temp files, hand-off copies), only
    /// once untouched for an hour, and never an operator's backup.
    #[test]
    fn the_sweep_removes_old_leftovers_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let now = std::time::SystemTime::now();
        let old = now - LEFTOVER_AGE - std::time::Duration::from_secs(5);
        let file = |name: &str, modified: std::time::SystemTime| {
            let f = std::fs::File::create(dir.path().join(name)).unwrap();
            f.set_modified(modified).unwrap();
        };
        file(".zonewatch-backup-AbC123", old);
        // The command that asked for this one has ended (no such pid) ...
        file("zonewatch-handoff-2026-12-04T10-00-00-000Z-4194305.redb", old);
        // ... this one's is still running (this test's own pid): kept, however old.
        file(&format!("zonewatch-handoff-2026-12-04T10-00-00-000Z-{}.redb", std::process::id()), old);
        file("zonewatch-handoff-2026-12-04T11-00-00-000Z-4243.redb", now);
        file(".zonewatch-backup-XyZ789", now);
        file("zonewatch-2026-12-04T09-00-00-000Z.redb", old);
        file("zonewatch-2026-12-04T09-00-00-000Z-4241.redb", old);
        file("zonewatch-handoff-notes.txt", old);
        std::fs::create_dir(dir.path().join(".zonewatch-backup-folder")).unwrap();
        assert_eq!(sweep_leftovers(dir.path(), now), 2);
        let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        let running = format!("zonewatch-handoff-2026-12-04T10-00-00-000Z-{}.redb", std::process::id());
        assert_eq!(
            left,
            [
                ".zonewatch-backup-XyZ789",
                ".zonewatch-backup-folder",
                "zonewatch-2026-12-04T09-00-00-000Z-4241.redb",
                "zonewatch-2026-12-04T09-00-00-000Z.redb",
                running.as_str(),
                "zonewatch-handoff-2026-12-04T11-00-00-000Z-4243.redb",
                "zonewatch-handoff-notes.txt",
            ]
        );
        assert_eq!(sweep_leftovers(&dir.path().join("none"), now), 0, "no folder: nothing to do");
    }

    /// A folder of empty files, each last modified just past [`LEFTOVER_AGE`] ago when
    /// marked old, else now; with that now.
    fn aged_files(files: &[(&str, bool)]) -> (tempfile::TempDir, std::time::SystemTime) {
        let dir = tempfile::tempdir().unwrap();
        let now = std::time::SystemTime::now();
        let old = now - LEFTOVER_AGE - std::time::Duration::from_secs(5);
        for &(name, is_old) in files {
            std::fs::File::create(dir.path().join(name)).unwrap().set_modified(if is_old { old } else { now }).unwrap();
        }
        (dir, now)
    }

    /// A killed restore's temp copy beside the store (a full copy of a store, secrets and
    /// all) is removed once untouched for an hour; a young one, the store and anything else
    /// stay.
    #[test]
    fn a_killed_restores_copy_beside_the_store_is_swept() {
        let (dir, now) = aged_files(&[(".zonewatch-restore-Old123", true), (".zonewatch-restore-New456", false), ("zw.redb", true), ("zw.redb.before-restore", true)]);
        assert_eq!(sweep_restore_leftovers(&dir.path().join("zw.redb"), now), 1);
        assert!(!dir.path().join(".zonewatch-restore-Old123").exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }

    /// A killed `backup`'s temp file beside its destination is removed by the next backup to
    /// that folder once untouched for an hour, if it is this user's; a young one (a backup
    /// under way) and the operator's own files stay.
    #[test]
    fn a_killed_backups_temp_file_beside_its_destination_is_swept() {
        use std::os::unix::fs::MetadataExt;
        let (dir, now) = aged_files(&[
            (".zonewatch-backup-Old123", true),
            (".zonewatch-backup-New456", false),
            ("nightly.redb", true),
            (".zonewatch-backup-notes.txt", true),
            (".zonewatch-backup-keep-this.redb", true),
        ]);
        let me = std::fs::metadata(dir.path().join("nightly.redb")).unwrap().uid();
        assert_eq!(sweep_backup_leftovers(dir.path(), me.wrapping_add(1), now), 0, "another user's file is theirs");
        assert_eq!(sweep_backup_leftovers(dir.path(), me, now), 1);
        assert!(!dir.path().join(".zonewatch-backup-Old123").exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 4, "the operator's own files named alike stay");
    }

    /// A killed `check --store`'s repaired copy in the temp folder (a full store, secrets and
    /// all) is removed once untouched for an hour, if it is this user's; a young one (a check
    /// under way) and anything else stay.
    #[test]
    fn a_killed_checks_copy_in_the_temp_folder_is_swept() {
        use std::os::unix::fs::MetadataExt;
        let (dir, now) = aged_files(&[("zonewatch-check-Old123.redb", true), ("zonewatch-check-New456.redb", false), ("zonewatch-check-notes.txt", true), ("other.redb", true)]);
        let me = std::fs::metadata(dir.path().join("other.redb")).unwrap().uid();
        assert_eq!(sweep_check_leftovers(dir.path(), me.wrapping_add(1), now), 0, "another user's copy is theirs");
        assert_eq!(sweep_check_leftovers(dir.path(), me, now), 1);
        assert!(!dir.path().join("zonewatch-check-Old123.redb").exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }

    /// While `restore` holds the store against opens, a zonewatch that tries to open it (a
    /// `run` from a timer, a restarting `serve`) is told it is in use; once the hold ends it
    /// opens. And a store already open cannot be held: that is restore's "in use" answer.
    #[test]
    fn a_held_store_cannot_be_opened_and_an_open_one_cannot_be_held() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        drop(super::super::Store::open(&path).unwrap());
        let held = hold_against_opens(&path).unwrap();
        assert!(held.is_some(), "a local file system has the lock");
        let opened = super::super::Store::open(&path);
        assert!(matches!(opened, Err(StoreError::InUse { .. })), "{:?}", opened.err());
        drop(held);
        let store = super::super::Store::open(&path).unwrap();
        let again = hold_against_opens(&path);
        assert!(matches!(&again, Err(StoreError::Conflict(m)) if m.contains("in use")), "{:?}", again.err());
        drop(store);
    }
}
