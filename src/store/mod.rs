//! `store/` owns every redb table and every transaction. Nothing outside this module opens a
//! table, so the invariants below can be checked here:
//!
//! * one write transaction commits a run's new snapshot, its watermark (and history row), its
//!   run record, the claimed idempotency keys, the outbox rows and their `queued` audit rows;
//! * the audit ledger is append-only with a monotonic `seq`;
//! * an idempotency key's record is in exactly one of `idem_key_journal` (new keys) and
//!   `idem_keys` (merged in key order; `key_journal.rs`);
//! * an outbox row leaves the outbox only in the same transaction that writes its terminal
//!   audit row (`sent` or `dead_letter`), so every claimed key ends in exactly one terminal state.
//!
//! Values are postcard-encoded with a leading version byte (see [`codec`]). A schema-version
//! record in `meta` lets the file format evolve; opening a file of an unknown version fails.

pub mod backup;
pub mod check;
pub mod codec;
pub mod guard;
mod clock_forward;
mod clock_step;
mod delivery;
mod derived;
mod dlq;
mod endpoints;
mod idem;
mod key_journal;
mod key_scope;
mod expiry;
mod blocks;
mod floor;
mod held_rows;
mod leases;
mod outbox;
mod outbox_rows;
mod watermark_rows;
mod queries;
mod runs;
mod snapshot;
mod subscribers;
mod tombstones;
mod area_places;
mod probe;
mod repair;
mod tables;
mod totals;
mod history_index;
mod run_retention;
mod holds;
mod quarantine_rows;

pub use delivery::{Claim, ClaimCounts, ClaimMode, DeadCause, DeliveryResult, RecordedOutcomes};
pub use leases::{LeaseStep, LeasedBatch, MIN_PASS_OVER};
pub use dlq::{ReleaseOutcome, ReplayOutcome, SUBSCRIBER_RECREATED};
pub use endpoints::{DisabledBacklog, EndpointEnabled, HealthPolicy};
pub use key_scope::KeyScopeRecord;
pub use clock_step::{say_moved, DueTimesMoved, CLOCK_STEP_TOLERANCE_MS};
pub use clock_forward::{elapsed_ms, say_forward_step, ForwardStep, FORWARD_STEP_TOLERANCE_MS};
/// What one bounded sweep call did: the rows it removed, and whether it stopped at its bound
/// with work left. A batch can do work and remove nothing (keys re-armed because their event
/// is still pending, run records read past because they are kept), so `serve`'s periodic
/// sweep goes on while either says so: it stopped at the first batch that removed nothing,
/// and what lay behind such a batch waited for the next period (a reviewer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepBatch {
    pub removed: usize,
    pub more: bool,
}

impl SweepBatch {
    /// A sweep that cannot tell work left from rows removed: more while it removes.
    pub fn of_removed(removed: usize) -> SweepBatch {
        SweepBatch { removed, more: removed > 0 }
    }
}

pub use queries::{AuditFilter, DeadLetterList, KeptCounts, ReplayPick, SnapshotView, StoreStats};
pub use derived::BaseStretch;
pub use runs::{CommitMode, HeldChunk, QuarantineDraft, RunCommit, RunNote, RunWriter};
pub use snapshot::SnapshotRow;
pub use tombstones::Tombstone;
pub use area_places::PlaceState;
pub use subscribers::{StoredSubscriber, SubscriberDeleted, SubscriberPut, SUBSCRIBER_DELETED};
pub use delivery::RowsDeadLettered;
pub use endpoints::ENABLED_BY_OPERATOR;
pub use probe::{PortalSignals, UnchangedRun};
pub use check::ConsistencyReport;
pub use repair::OpenInfo;
pub use floor::WriteFloor;
pub use totals::SourceRunTotals;
pub use history_index::{is_baseline_prime, BASELINE_DETAIL};

use redb::{Database, ReadableDatabase, ReadableTable};
use std::path::{Path, PathBuf};
use tables::*;

/// The file format version this build writes.
///
/// 14: the open holds are indexed by source (`open_holds`, `holds.rs`), and superseded holds
/// are removed past `[store] run_retention`; a version 13 build would open and resolve holds
/// without the index, whose runs would then not see a hold it opened. The open holds are
/// indexed by the upgrade.
/// 13: run records that committed nothing may be removed past `[store] run_retention`, their
/// counts kept in `runs_swept` (`run_retention.rs`); a version 12 build's `check --store` would
/// find the run totals above the records. A disabled endpoint remembers the target it was
/// disabled for (`endpoint_disabled_targets`, `endpoints.rs`), which a version 12 build would
/// leave behind when it enables one. Nothing is rewritten.
/// 12: control-port subscribers at record version 2 (`secret_old`, `subscribers.rs`) and
/// quarantine records may name the reason `field_too_long`; a version 11 build would fail on
/// both (its start on the first, its quarantine listing on the second) instead of refusing
/// the file. Nothing is rewritten.
/// 11: the audit rows indexed by outcome and the run records by source (`history_index.rs`).
/// 10: running totals of the audit ledger and the run records (`totals.rs`).
/// 9: tombstones are indexed by removal time (`parcel_tombstone_ages`, `tombstones.rs`), and
/// area-mode sources remember each announced place (`area_places`, `held_area_places`,
/// `area_places.rs`); a version 8 build would write tombstones without index rows, which would
/// then never be swept, and give a place that changes again its first change's key.
/// 8: snapshot records at version 2 carry the parcel's revision, removed parcels leave a
/// tombstone (`parcel_tombstones`), and change events' keys include the revision
/// (`snapshot.rs`, `tombstones.rs`, `notify::idem`); a version 7 build could not read the
/// records, nor keep the revisions the keys depend on.
/// 7: the snapshot's parcels are packed a block of up to 32 to a row of `parcel_blocks`
/// (`blocks.rs`); a version 6 build would find no snapshot and take every parcel as new.
/// 6: a parcel's state and geometry are one row of `parcel_snapshot` (`snapshot.rs`); a
/// version 5 build would find no snapshot and take every parcel as new.
/// 5: fresh outbox rows have no due-index entry (their ids give the order) and retries live in
/// `outbox_retry` (`outbox.rs`); a version 4 build would never lease the fresh rows.
/// 4: the keys' expiry index is bucketed (`idem_expiry_buckets`, `expiry.rs`); a version 3
/// build would sweep (and back up) only the per-key table.
/// 3: new idempotency keys are claimed into `idem_key_journal` first (`key_journal.rs`); a
/// zonewatch of version 2 would not look there, so it must refuse the file.
/// 2: outbox rows, dead letters and idempotency keys at record version 2 (`outbox_rows`,
/// `idem`), the attempt log keyed by outbox row. A version 1 file is upgraded in place when
/// it is opened; an older zonewatch then refuses the file instead of failing on its records.
pub const SCHEMA_VERSION: u32 = 14;
/// The oldest file format this build opens (and upgrades).
pub const OLDEST_SCHEMA_VERSION: u32 = 1;

/// Everything that can go wrong in the store layer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {message}")]
    Open { path: PathBuf, message: String },
    #[error("store {path}: upgrading it from schema version {from} to {to} failed, and nothing of the upgrade was kept (the release that wrote the file still opens it): {message}")]
    Upgrade { path: PathBuf, from: u32, to: u32, message: String },
    #[error("store {path} is in use by another zonewatch process (only one may open a store at a time; while `serve` runs, its control port answers instead: /v1/audit, /v1/holds, /v1/deadletters, /v1/endpoints, `zonewatch backup`)")]
    InUse { path: PathBuf },
    /// redb panicked reading the file, or cannot repair it: its pages are damaged. Nothing
    /// but a backup brings the data back, so the message says so.
    #[error("store {path} is damaged (redb: {message}); check it with `zonewatch check --config FILE --store {path}`, and if it is, restore a backup: zonewatch restore BACKUP --config FILE")]
    Damaged { path: PathBuf, message: String },
    #[error("store file {path} has schema version {found}; this zonewatch opens versions {oldest} to {expected}. Use the zonewatch release that wrote it, or restore a backup: zonewatch restore BACKUP --config FILE", oldest = OLDEST_SCHEMA_VERSION)]
    SchemaVersion { path: PathBuf, found: u32, expected: u32 },
    #[error("database error: {0}")]
    Db(redb::Error),
    #[error("cannot decode a stored record in table {table}: {message} (a store written by a newer zonewatch, or a damaged file; if this zonewatch is not older than the one that wrote it, restore a backup: zonewatch restore BACKUP --config FILE)")]
    Codec { table: &'static str, message: String },
    /// A file step outside the store failed (copying a backup in, making a temp file):
    /// `what` names the files.
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// Writing a backup failed (its folder missing, its disk full): the backup's file is
    /// named, not the store's.
    #[error("backup {dest}: {source}")]
    Backup { dest: PathBuf, source: Box<StoreError> },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("simulated failure before commit: {0}")]
    Injected(String),
}

impl From<redb::Error> for StoreError {
    fn from(e: redb::Error) -> Self {
        // Any I/O error latches redb's failure flag: from then on the open file answers
        // `PreviousIo` to everything.
        if matches!(e, redb::Error::PreviousIo | redb::Error::Io(_)) && OTHER_FILE.with(|n| n.get()) == 0 {
            if matches!(&e, redb::Error::Io(io) if is_file_size_limit(io)) {
                FILE_SIZE_LIMIT_MET.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            reopen_needed();
        }
        StoreError::Db(e)
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self { StoreError::from(redb::Error::from(e)) }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

impl StoreError {
    /// Whether the error is one that passes by itself, so a command failing on it exits 1
    /// (which the packaged unit retries) rather than 2 (a config or a damaged store, which a
    /// restart would only repeat): another zonewatch holds the store for now, the disk or
    /// the quota is full, or an earlier I/O error left the open file refusing work until it
    /// is opened again.
    pub fn passes(&self) -> bool {
        match self {
            StoreError::InUse { .. } => true,
            StoreError::Db(redb::Error::PreviousIo) => true,
            StoreError::Db(redb::Error::Io(e)) => is_out_of_space(e),
            StoreError::Backup { source, .. } => source.passes(),
            StoreError::Io { source, .. } => is_out_of_space(source),
            _ => false,
        }
    }
}

impl StoreError {
    /// The I/O error under this one, if it is one.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            StoreError::Db(redb::Error::Io(e)) => Some(e),
            StoreError::Io { source, .. } => Some(source),
            StoreError::Backup { source, .. } => source.io_error(),
            _ => None,
        }
    }
}

/// A file that may not grow past a limit (`EFBIG`): a process file-size limit (`ulimit -f`,
/// systemd `LimitFSIZE=`) or the file system's largest file. Waiting does not lift it, so a
/// command failing on it exits 2, as for a config error, with this said.
pub fn is_file_size_limit(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::FileTooLarge || e.raw_os_error() == Some(27)
}

/// Set when a write to the store's own file (or a file beside it: [`note_io_error`])
/// failed on [`is_file_size_limit`]: the errors
/// after it are redb's "previous I/O error", which no longer say why, so `run` and `serve`
/// read this to exit 2 with [`FILE_SIZE_LIMIT`] rather than 1 as for a full disk.
static FILE_SIZE_LIMIT_MET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Notes an I/O error on a file zonewatch writes beside its store (a run's spill, sort and
/// delta files, a portal layer's body and staged copy): a file-size limit there is the
/// store's limit too ([`FILE_SIZE_LIMIT_MET`]).
pub fn note_io_error(e: &std::io::Error) {
    if is_file_size_limit(e) {
        FILE_SIZE_LIMIT_MET.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether this process's store file met a file-size limit ([`FILE_SIZE_LIMIT_MET`]).
pub fn file_size_limit_met() -> bool {
    FILE_SIZE_LIMIT_MET.load(std::sync::atomic::Ordering::SeqCst)
}

/// What to do about [`is_file_size_limit`].
pub const FILE_SIZE_LIMIT: &str = "the store (or a file zonewatch writes beside it: a run's temp files, a portal layer's download) cannot grow: a file-size limit stops it (`ulimit -f`, systemd `LimitFSIZE=`, or the file system's largest file); raise or remove the limit, or move the store to a file system that allows larger files";

/// A full disk or an exhausted quota (`ENOSPC`, `EDQUOT`).
pub fn is_out_of_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || e.kind() == std::io::ErrorKind::QuotaExceeded || matches!(e.raw_os_error(), Some(28) | Some(122))
}

/// What a store file of 0 bytes is, and the way out (`Store::open` refuses one; `check` says
/// so before a start).
pub const EMPTY_STORE_FILE: &str = "the file is empty (0 bytes), not a store: a crash or an interrupted copy leaves this. Restore a backup (zonewatch restore BACKUP --config FILE), or remove the file to start a new store, whose first run of each source is a silent baseline";

/// What a long-running process does once redb refuses work after an I/O error
/// ([`on_reopen_needed`]).
type ReopenHandler = Box<dyn Fn() + Send>;
static ON_REOPEN_NEEDED: std::sync::Mutex<Option<ReopenHandler>> = std::sync::Mutex::new(None);

/// Sets what to do when redb reports an I/O error, or answers "Previous I/O error occurred.
/// Please close and re-open the database": after an I/O error (a full disk, a failing
/// device) redb refuses every read and write of the open file until it is opened again, even
/// once the cause is gone. `serve` cannot reopen the file under its running tasks, so it
/// stops and exits 1, and the service manager starts it again on a reopened file; left
/// running, it would fail every run and delivery while its health check said ok. The
/// handler must only signal.
pub fn on_reopen_needed(handler: impl Fn() + Send + 'static) {
    *ON_REOPEN_NEEDED.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(handler));
}

thread_local! {
    /// Above zero while this thread works on another redb file than the store's own.
    static OTHER_FILE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A redb backend on another handle of `file` (redb takes the file it is given): files
/// opened once and then used through their handle (a backup's copy, a restore's check, a key
/// scope's epoch), never by name again.
fn backend_of(file: &std::fs::File) -> std::io::Result<redb::backends::FileBackend> {
    redb::backends::FileBackend::new(file.try_clone()?).map_err(std::io::Error::other)
}

/// Runs `work` on another redb file than the store's own (a backup being written, a copy
/// being verified): an I/O error there (a full backup disk) says nothing about the store's
/// open file, and must not stop `serve` ([`on_reopen_needed`]).
pub(crate) fn on_other_file<T>(work: impl FnOnce() -> T) -> T {
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            OTHER_FILE.with(|n| n.set(n.get().saturating_sub(1)));
        }
    }
    OTHER_FILE.with(|n| n.set(n.get() + 1));
    let _scope = Scope;
    work()
}

fn reopen_needed() {
    if let Some(handler) = ON_REOPEN_NEEDED.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        handler();
    }
}

/// The one redb file holding everything zonewatch remembers.
pub struct Store {
    db: Database,
    path: PathBuf,
    /// Test hook: when set, the next run commit fails just before `commit()` (crash simulation).
    fail_next_commit: std::sync::atomic::AtomicBool,
    /// Test hook: snapshot chunk writes to count down (the one that takes it to zero fails)
    /// and how long that write waits before it fails.
    fail_snapshot_write: std::sync::Mutex<(u32, std::time::Duration)>,
    /// Durable commits save redb's allocator state (see `repair.rs`).
    quick_repair: std::sync::atomic::AtomicBool,
    open_info: OpenInfo,
    /// Finds keys in `idem_key_journal` (see `key_journal.rs`).
    key_index: key_journal::KeyIndex,
    /// Outbox rows in flight (see `leases.rs`).
    leases: leases::Leases,
    /// The store file as it was opened, held to ask whether it still has a name (see
    /// [`Store::file_gone`]); `None` where it could not be opened for that.
    handle: Option<std::fs::File>,
    /// What this store's idempotency keys name besides the change (`key_scope.rs`), read
    /// (and first written) at open: only a restore, with the store closed, changes it.
    key_scope: KeyScopeRecord,
    /// The wall clock's steps forward, and the last look at it (see `clock_forward.rs`).
    clock_watch: clock_forward::ClockWatch,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

/// redb's page cache by default (`[store] cache_mib` changes it). redb's own default (1 GiB)
/// would let a county-sized store grow the daemon's resident memory to a gigabyte, and the
/// cache never shrinks, so it sets the floor of an idle `serve`'s RSS; beyond it the OS page
/// cache serves reads anyway. Measured (issue 7): 16 MiB instead of 64 MiB took an idle
/// `serve` (100 sources, 10k subscribers) from 52 to 48 MiB; 8 MiB instead of 16 took it from
/// 49.4-50.4 to 41.5-43.7 MiB (the cache was full), with ingest at 1M parcels, delivery and
/// group commit unchanged within noise (interleaved runs, ninth session; docs/PERFORMANCE.md).
pub const STORE_CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Creates `path` as an empty file of mode 0600 if there is no file there yet (true when it
/// did); warns of an existing store that others may read (a store made by an older release,
/// or copied), which is left as the operator set it.
#[cfg(unix)]
fn create_private(path: &Path) -> Result<bool, StoreError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if let Ok(meta) = std::fs::metadata(path) {
                let mode = meta.permissions().mode();
                if mode & 0o077 != 0 {
                    tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "the store holds subscribers' signing secrets and others may read it: chmod 600 it");
                }
            }
            Ok(false)
        }
        Err(e) => Err(StoreError::Open { path: path.to_path_buf(), message: format!("cannot create the store file: {e}") }),
    }
}

#[cfg(not(unix))]
fn create_private(path: &Path) -> Result<bool, StoreError> {
    Ok(!path.exists())
}

impl Store {
    /// Opens (or creates) the store at `path`, creating missing tables and checking the schema.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Store::open_with_cache(path, STORE_CACHE_BYTES)
    }

    /// Like [`Store::open`] with a page cache of `cache_bytes`.
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> Result<Store, StoreError> {
        // The store's folder is not made here: a mistyped `[store] path` would otherwise
        // become a new, empty store whose first runs are silent baselines, every change since
        // the real store's last run unsaid. (The packaged unit's StateDirectory makes the
        // folder; a first start elsewhere makes it with mkdir.)
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.is_dir() {
                return Err(StoreError::Open {
                    path: path.to_path_buf(),
                    message: format!("its folder {} does not exist: check `[store] path` in the config, or create the folder (mkdir -p) for a new store", parent.display()),
                });
            }
        }
        // A new store is created readable by its owner only: it holds subscribers' signing
        // secrets. redb would initialise any empty file as a new database: one that was
        // there already is a store cut to nothing (a crash, a failed copy), and taking it for
        // a new store would make the next run a silent baseline over lost history.
        if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return Err(StoreError::Open { path: path.to_path_buf(), message: "it is a folder: `[store] path` names the store file (it is created there)".into() });
        }
        let created = create_private(path)?;
        if !created && std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            // Another zonewatch making this store this very moment holds redb's lock on it:
            // in use, not cut short.
            if std::fs::File::open(path).is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock))) {
                return Err(StoreError::InUse { path: path.to_path_buf() });
            }
            return Err(StoreError::Open { path: path.to_path_buf(), message: EMPTY_STORE_FILE.into() });
        }
        // A file of a schema this build does not open is refused before the writable open:
        // that marks the file open (rewrites its header), and a refused file is left as it
        // was, byte for byte (invariant 8; a black-box tester found an older build's refusals
        // changing the file's bytes). A file redb cannot open read-only (not closed cleanly)
        // is checked after the writable open, as before.
        if !created {
            refuse_schema_read_only(path)?;
        }
        // The repair callback is called only when redb has to rebuild the file's allocator
        // state (an unclean shutdown without a quick-repair record).
        let full_repair = std::rc::Rc::new(std::cell::Cell::new(false));
        let flag = full_repair.clone();
        let opened = std::time::Instant::now();
        let db = Database::builder().set_cache_size(cache_bytes).set_repair_callback(move |_| flag.set(true)).create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse { path: path.to_path_buf() },
            // Not damage: restoring a backup would not help.
            redb::DatabaseError::Storage(redb::StorageError::Io(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => StoreError::Open {
                path: path.to_path_buf(),
                message: format!("{e}: this user may not write the store file (zonewatch reads and writes it, and makes temp files in its folder); run zonewatch as the file's owner, or give that user the file; a file that must stay read-only can be copied with `zonewatch backup DEST` and the copy read"),
            },
            redb::DatabaseError::Storage(redb::StorageError::Io(source)) if is_out_of_space(&source) => {
                StoreError::Io { what: format!("store {}: cannot open it", path.display()), source }
            }
            // Not damage either: the same file opens once its file system is writable.
            redb::DatabaseError::Storage(redb::StorageError::Io(e)) if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem => StoreError::Open {
                path: path.to_path_buf(),
                message: format!(
                    "{e}: the store's file system is mounted read-only, and zonewatch writes its store even to read it (redb marks the file open); mount it writable, or check a copy of it with zonewatch check --store FILE"
                ),
            },
            other => StoreError::Open {
                path: path.to_path_buf(),
                message: format!(
                    "{other}. If the file is damaged, restore a backup: zonewatch restore BACKUP --config FILE"
                ),
            },
        });
        let db = match db {
            Ok(db) => db,
            Err(e) => {
                // The empty file this call made is not left behind, where it would read as a
                // store cut short at the next start.
                if created {
                    let _ = std::fs::remove_file(path);
                }
                return Err(e);
            }
        };
        let open_info = OpenInfo { full_repair: full_repair.get(), open_s: opened.elapsed().as_secs_f64() };
        if open_info.full_repair {
            tracing::warn!(seconds = open_info.open_s, "store was not shut down cleanly: redb rebuilt it (full repair)");
        }
        let mut store = Store {
            db,
            path: path.to_path_buf(),
            fail_next_commit: std::sync::atomic::AtomicBool::new(false),
            fail_snapshot_write: std::sync::Mutex::new((0, std::time::Duration::ZERO)),
            quick_repair: std::sync::atomic::AtomicBool::new(true),
            open_info,
            key_index: key_journal::KeyIndex::default(),
            leases: leases::Leases::default(),
            handle: std::fs::File::open(path).ok(),
            key_scope: KeyScopeRecord::default(),
            clock_watch: clock_forward::ClockWatch::default(),
        };
        if store.init_schema()? {
            store.compact_after_upgrade()?;
        }
        store.key_scope = key_scope::ensure(&store.db, store.quick_repair())?;
        store.clock_watch = clock_forward::ClockWatch::load(&store.db)?;
        Ok(store)
    }

    /// An error unless there is a store file at `path`: the commands that read or steer what
    /// runs wrote (`audit`, `holds`, `dlq`, `endpoints`) call it before opening, so a wrong
    /// `[store] path` does not read as an empty ledger, nor leave an empty store behind.
    pub fn require_existing(path: &Path) -> Result<(), StoreError> {
        match path.try_exists() {
            Ok(true) => Ok(()),
            Ok(false) => Err(StoreError::Open {
                path: path.to_path_buf(),
                message: "no store there (check `[store] path` in the config; `zonewatch run` or `serve` creates it)".into(),
            }),
            Err(e) => Err(StoreError::Open { path: path.to_path_buf(), message: format!("cannot look for the store: {e}") }),
        }
    }

    /// [`Store::open`] for a store that must exist already (see [`Store::require_existing`]).
    pub fn open_existing(path: &Path) -> Result<Store, StoreError> {
        Store::require_existing(path)?;
        Store::open(path)
    }

    /// Gives back the pages an upgrade freed. Moving an older snapshot into blocks
    /// (`snapshot.rs` from schema 5, `blocks.rs` from schema 6) writes every parcel again and
    /// frees the old tables, which doubles the file (2.5M parcels of schema 6: 1.13 → 2.27
    /// GB) until runs reuse the pages. redb's compaction moved that file to 0.50 GB in 3.1 s
    /// (measured; the commit after it grows the file again to 1.0 GB, half of it free). The
    /// upgrade leaves a `compact_pending` mark, removed only once a compaction succeeded, so
    /// an open cut short compacts on the next one. A failed compaction leaves a valid, larger
    /// file.
    ///
    /// redb's compaction commits without a quick-repair record, so a durable commit follows
    /// it either way: a crash afterwards still reopens in milliseconds (`repair.rs`).
    fn compact_after_upgrade(&mut self) -> Result<(), StoreError> {
        let before = std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0);
        let started = std::time::Instant::now();
        let compacted = match self.db.compact() {
            Ok(_) => {
                let after = std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0);
                tracing::info!(before, after, seconds = started.elapsed().as_secs_f64(), "store file compacted after its upgrade");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "store file not compacted after its upgrade (it stays valid, only larger; the next start tries again)");
                false
            }
        };
        let follow_up = || -> Result<(), StoreError> {
            let mut wtx = self.db.begin_write()?;
            self.durable_commit_settings(&mut wtx);
            if compacted {
                wtx.open_table(META)?.remove(META_COMPACT_PENDING)?;
            }
            wtx.commit()?;
            Ok(())
        };
        // A compaction cut short by an I/O error leaves redb refusing writes until the file
        // is opened again (and repaired): then this process cannot use the store.
        follow_up().map_err(|e| StoreError::Open {
            path: self.path.clone(),
            message: format!("the upgrade is kept, but the commit after compacting the file failed ({e}); start zonewatch again: opening repairs the file and compacts it if that is still due"),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What this store's idempotency keys name besides the change (`key_scope.rs`).
    pub fn key_scope(&self) -> &KeyScopeRecord {
        &self.key_scope
    }

    /// Why the store's path no longer names the file this process has open, if it does not:
    /// the file (or its folder) was removed, or another file took its name, while zonewatch
    /// had it open (a temp cleaner, a wrong `rm`, a restore behind a running daemon's back).
    /// redb goes on writing the open file, and all of it is lost when the process ends;
    /// `serve` asks every few seconds and stops. `None` also where it cannot be told (the
    /// path cannot be read for another reason): that is no evidence.
    pub fn file_gone(&self) -> Option<String> {
        // The open file's own link count, not the path's device and inode (which some
        // network and FUSE file systems do not keep stable): 0 once its last name is gone,
        // removed or renamed over.
        let open = self.handle.as_ref()?.metadata().ok()?;
        if link_count(&open)? == 0 {
            return Some(format!("the store {} was removed or replaced (or its folder removed) while zonewatch had it open", self.path.display()));
        }
        match std::fs::metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Some(format!("the store {} was moved away (or its folder was) while zonewatch had it open", self.path.display()))
            }
            // The open file still has a name (moved aside, or another hard link) and another
            // file has its path (`mv zw.redb zw.old && cp backup.redb zw.redb`): the two are
            // compared as they are now, not with what they were at open, so a file system
            // that renumbers files over time cannot make this fire.
            Ok(now) if file_identity(&now) != file_identity(&open) => Some(format!(
                "the store {} is another file now (the one zonewatch has open was moved aside or renamed over) while zonewatch had it open",
                self.path.display()
            )),
            _ => None,
        }
    }

    /// Creates missing tables, checks the file's schema version and upgrades an older file.
    /// Returns whether the file is to be compacted (an upgrade freed much of it).
    fn init_schema(&self) -> Result<bool, StoreError> {
        // Check first with a read transaction so that a newer file is never modified.
        let mut upgrading_from = None;
        {
            let rtx = self.db.begin_read()?;
            match rtx.open_table(META) {
                Ok(meta) => {
                    if let Some(v) = meta.get(META_SCHEMA)? {
                        let found = decode_u32(v.value());
                        upgrading_from = Some(found).filter(|&v| v < SCHEMA_VERSION);
                        opens_schema(found, &self.path)?;
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let (compact, merged_on_open) = self.create_tables_and_upgrade().map_err(|e| match upgrading_from {
            // redb can fail a commit after its header is on disk: say "nothing kept" only
            // when the file still reads as the older version.
            Some(from) if self.schema_on_file().ok().flatten() == Some(from) => {
                StoreError::Upgrade { path: self.path.clone(), from, to: SCHEMA_VERSION, message: e.to_string() }
            }
            _ => e,
        })?;
        if let Some(max_seq) = merged_on_open {
            self.key_index.forget_through(max_seq);
        }
        // Said whatever the migrations had to move (a tester saw no line for a 13 to 14
        // upgrade of a file without open holds, where the README says an upgrade logs what
        // it did), and by every command: one-shot commands log warnings only, and an upgrade
        // is what makes an older release refuse the file from now on.
        if let Some(from) = upgrading_from {
            note_line!("store {} upgraded from schema {from} to {SCHEMA_VERSION} (an older release refuses it from now on)", self.path.display());
        }
        // Only one process can hold the file, so a lease found in it (written by a build of
        // schema 4 or older) belongs to a process that died mid-delivery: its entries go back
        // to the queue (at-least-once, same key). Leases of this build are never written.
        let reclaimed = self.drop_file_leases()?;
        if reclaimed > 0 {
            tracing::warn!(reclaimed, "in-flight deliveries of a stopped process returned to the queue");
        }
        Ok(compact)
    }

    /// The schema version the file holds now (None: no record yet).
    fn schema_on_file(&self) -> Result<Option<u32>, StoreError> {
        schema_in(&self.db.begin_read()?)
    }

    /// The write half of [`Store::init_schema`]: every table created, every migration of an
    /// older file and the schema version in one transaction, so an upgrade is kept whole or
    /// not at all. Returns whether to compact, and the key journal rows merged on the way.
    fn create_tables_and_upgrade(&self) -> Result<(bool, Option<u64>), StoreError> {
        let mut wtx = self.db.begin_write()?;
        self.durable_commit_settings(&mut wtx);
        // A file without the history indexes (schema 10 or older) has its rows indexed below.
        let history_indexed = has_table(&wtx, redb::TableHandle::name(&AUDIT_BY_OUTCOME))?;
        // A file without the index of open holds (schema 13 or older) has them indexed below.
        let holds_indexed = has_table(&wtx, redb::TableHandle::name(&OPEN_HOLDS))?;
        {
            wtx.open_table(META)?;
            wtx.open_table(WATERMARKS)?;
            wtx.open_table(WATERMARK_HISTORY)?;
            wtx.open_table(PARCEL_BLOCKS)?;
            wtx.open_table(PARCEL_TOMBSTONES)?;
            wtx.open_table(PARCEL_TOMBSTONE_AGES)?;
            wtx.open_table(AREA_PLACES)?;
            wtx.open_table(HELD_AREA_PLACES)?;
            wtx.open_table(IDEM_KEYS)?;
            wtx.open_table(IDEM_EXPIRY_BUCKETS)?;
            wtx.open_table(IDEM_KEY_JOURNAL)?;
            wtx.open_table(OUTBOX)?;
            wtx.open_table(OUTBOX_RETRY)?;
            wtx.open_table(AUDIT)?;
            wtx.open_table(DEAD_LETTERS)?;
            wtx.open_table(QUARANTINE)?;
            wtx.open_table(RUNS)?;
            wtx.open_table(HOLDS)?;
            wtx.open_table(HELD_PARCELS)?;
            wtx.open_table(HELD_EVENTS)?;
            wtx.open_table(SUBSCRIBERS)?;
            wtx.open_table(DERIVED_SHARES)?;
            wtx.open_table(HELD_SHARES)?;
            wtx.open_table(OUTBOX_LEASES)?;
            wtx.open_table(OUTBOX_RETRY_DUE)?;
            wtx.open_table(DELIVERY_ATTEMPTS)?;
            wtx.open_table(DELIVERY_ATTEMPTS_BY_ROW)?;
            wtx.open_table(DLQ_REPLAYS)?;
            wtx.open_table(DLQ_QUARANTINE)?;
            wtx.open_table(ENDPOINTS)?;
            wtx.open_table(AUDIT_TOTALS)?;
            wtx.open_table(RUN_TOTALS)?;
            wtx.open_table(AUDIT_BY_OUTCOME)?;
            wtx.open_table(RUNS_BY_SOURCE)?;
            wtx.open_table(RUNS_SWEPT)?;
            wtx.open_table(ENDPOINT_DISABLED_TARGETS)?;
            wtx.open_table(OPEN_HOLDS)?;
        }
        // The journal's index lives in memory: rebuilt from its rows. Rows whose fingerprints
        // clash (never written so) are merged into `idem_keys`, where no index is needed.
        let mut merged_on_open = None;
        if !self.key_index.rebuild(&wtx.open_table(IDEM_KEY_JOURNAL)?)? {
            merged_on_open = Some(key_journal::merge_in(&wtx, &self.key_index)?.through_seq);
        }
        let moved = expiry::migrate_per_key_index(&wtx)?;
        if moved > 0 {
            tracing::info!(moved, "idempotency key expiry index moved into buckets");
        }
        let moved = outbox::migrate_due_index(&wtx)?;
        if moved > 0 {
            tracing::info!(moved, "outbox rows waiting for a retry moved to outbox_retry; the fresh due index is dropped");
        }
        blocks::refuse_mixed_layouts(&wtx)?;
        let joined = snapshot::migrate_split_tables(&wtx)?;
        if joined.parcels > 0 {
            tracing::info!(parcels = joined.parcels, "parcel states and geometries joined into one snapshot record each, packed into blocks (schema 5 to 7)");
        }
        if joined.without_geometry > 0 {
            tracing::warn!(parcels = joined.without_geometry, "parcel states without a geometry row kept with an empty geometry; the source's next run stores their shapes again only if they change");
        }
        let packed = blocks::migrate_parcel_rows(&wtx)?;
        if packed > 0 {
            tracing::info!(parcels = packed, "parcel snapshot rows packed into blocks (schema 6 to 7)");
        }
        let indexed = tombstones::index_by_age(&wtx)?;
        if indexed > 0 {
            tracing::info!(indexed, "parcel tombstones indexed by removal time (schema 8 to 9)");
        }
        let (audit_rows, run_records) = totals::count_missing(&wtx)?;
        if audit_rows > 0 || run_records > 0 {
            tracing::info!(audit_rows, run_records, "audit ledger and run records counted into running totals for /metrics (schema 9 to 10)");
        }
        let (audit_rows, run_records) = if history_indexed { (0, 0) } else { history_index::index_missing(&wtx)? };
        if audit_rows > 0 || run_records > 0 {
            tracing::info!(audit_rows, run_records, "audit ledger indexed by outcome and run records by source, for the pages the dashboard polls (schema 10 to 11)");
        }
        let indexed = if holds_indexed { 0 } else { holds::index_missing(&wtx)? };
        if indexed > 0 {
            tracing::info!(indexed, "open holds indexed by source (schema 13 to 14)");
        }
        let migrated = idem::migrate_pending(&wtx)?;
        if migrated > 0 {
            tracing::info!(migrated, "idempotency keys of pending events now name their outbox row (record version 2)");
        }
        // Upgraded in the same transaction as the migration: both or neither.
        wtx.open_table(META)?.insert(META_SCHEMA, SCHEMA_VERSION.to_le_bytes().as_slice())?;
        let compact = wtx.open_table(META)?.get(META_COMPACT_PENDING)?.is_some();
        wtx.commit()?;
        Ok((compact, merged_on_open))
    }

    /// Test hook for crash-before-commit: the next run commit builds its whole transaction and
    /// then aborts instead of committing, exactly as if the process had died there.
    pub fn fail_next_commit(&self) {
        self.fail_next_commit.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn take_injected_failure(&self) -> bool {
        self.fail_next_commit.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Test hook for a store error in the middle of a run's write transaction: the `n`-th
    /// chunk of snapshot rows written from now on (1 = the next) fails, as a full disk would,
    /// after a `pause` that gives the preparing thread time to fill its channel and block.
    /// (A held run writes no snapshot rows: the hook stays armed through it.)
    #[doc(hidden)]
    pub fn fail_snapshot_write(&self, n: u32, pause: std::time::Duration) {
        if let Ok(mut armed) = self.fail_snapshot_write.lock() {
            *armed = (n, pause);
        }
    }

    /// Whether the armed snapshot write failure is due now (after its pause).
    fn take_injected_write_failure(&self) -> bool {
        let pause = match self.fail_snapshot_write.lock() {
            Ok(mut armed) if armed.0 > 0 => {
                armed.0 -= 1;
                (armed.0 == 0).then_some(armed.1)
            }
            _ => None,
        };
        pause.map(std::thread::sleep).is_some()
    }

    /// Writes the file's schema version (used by tests of the version check).
    #[doc(hidden)]
    pub fn force_schema_version(&self, version: u32) -> Result<(), StoreError> {
        let wtx = self.db.begin_write()?;
        wtx.open_table(META)?.insert(META_SCHEMA, version.to_le_bytes().as_slice())?;
        wtx.commit()?;
        Ok(())
    }
}

/// Whether this build opens a file of schema `found` (at `path`): the rule `Store::open`, its
/// read-only pre-check, `check --store` and restore's check of the backup refuse a file by.
/// (`backup_read_only` copies only files whose tables are this build's, a narrower range.)
pub(super) fn opens_schema(found: u32, path: &Path) -> Result<(), StoreError> {
    if (OLDEST_SCHEMA_VERSION..=SCHEMA_VERSION).contains(&found) {
        return Ok(());
    }
    Err(StoreError::SchemaVersion { path: path.to_path_buf(), found, expected: SCHEMA_VERSION })
}

/// The refusal of the file at `path` when its schema is one this build does not open, read
/// through a read-only open (which writes nothing); `Ok` when it is not, or cannot be read so.
fn refuse_schema_read_only(path: &Path) -> Result<(), StoreError> {
    let Ok(db) = redb::Builder::new().open_read_only(path) else { return Ok(()) };
    match db.begin_read().ok().and_then(|rtx| schema_in(&rtx).ok().flatten()) {
        Some(found) => opens_schema(found, path),
        None => Ok(()),
    }
}

/// Whether the file of write transaction `wtx` has a table of that name (an older schema's
/// file lacks the tables later ones added; the upgrade fills those it creates).
fn has_table(wtx: &redb::WriteTransaction, name: &str) -> Result<bool, StoreError> {
    use redb::TableHandle;
    Ok(wtx.list_tables()?.any(|t| t.name() == name))
}

/// The schema version a file's read transaction shows (None: no `meta` table, or no version
/// record in it): for the store's own open, and for files read beside it (a backup being
/// verified, a read-only store being copied).
pub(super) fn schema_in(rtx: &redb::ReadTransaction) -> Result<Option<u32>, StoreError> {
    let meta = match rtx.open_table(META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let version = meta.get(META_SCHEMA)?.map(|v| decode_u32(v.value()));
    Ok(version)
}

fn decode_u32(bytes: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = bytes.len().min(4);
    b[..n].copy_from_slice(&bytes[..n]);
    u32::from_le_bytes(b)
}

/// A file's device and inode (`None` off Unix, where nothing is compared).
fn file_identity(m: &std::fs::Metadata) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Some((m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = m;
        None
    }
}

/// How many names a file has (`None` off Unix).
fn link_count(m: &std::fs::Metadata) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Some(m.nlink())
    }
    #[cfg(not(unix))]
    {
        let _ = m;
        None
    }
}

#[cfg(test)]
mod file_gone_tests {
    use super::Store;

    /// The store's path taken by another file while the old one keeps a name: moved aside and
    /// a backup copied in, or another file renamed over a name the store has a second link
    /// to (found by a reviewer: only a link count of 0 or a missing path was noticed).
    #[test]
    fn another_file_at_the_store_path_is_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let store = Store::open(&path).unwrap();
        assert_eq!(store.file_gone(), None, "untouched");
        std::fs::rename(&path, dir.path().join("z.old")).unwrap();
        std::fs::copy(dir.path().join("z.old"), &path).unwrap();
        let why = store.file_gone().expect("moved aside and replaced");
        assert!(why.contains("is another file now"), "{why}");
        drop(store);

        let path = dir.path().join("y.redb");
        let store = Store::open(&path).unwrap();
        std::fs::hard_link(&path, dir.path().join("y.link")).unwrap();
        std::fs::write(dir.path().join("y.new"), b"other").unwrap();
        std::fs::rename(dir.path().join("y.new"), &path).unwrap();
        assert!(store.file_gone().is_some_and(|why| why.contains("is another file now")));
    }
}
