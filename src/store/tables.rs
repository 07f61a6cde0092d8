//! The redb table definitions. Keys are chosen so the common scans are range scans:
//! a source's snapshot is the `(source, *)` range, the fresh outbox is ordered by id (claim
//! order), the retry due index by time.

use redb::TableDefinition;

/// Schema version and counters.
pub const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
pub const META_SCHEMA: &str = "schema_version";
pub const META_NEXT_OUTBOX_ID: &str = "next_outbox_id";
/// Present from an upgrade that freed much of the file until the file is compacted.
pub const META_COMPACT_PENDING: &str = "compact_pending";
/// The clock of the last delivery-outcome commit, which wrote the stored retry and breaker
/// times (`clock_step.rs`): a clock reading behind it has stepped back.
pub const META_DUE_CLOCK: &str = "due_clock_ms";
/// The steps forward of the wall clock seen by zonewatch (`clock_forward.rs`): elapsed-time
/// limits leave them out. Absent: none seen.
pub const META_FORWARD_STEPS: &str = "forward_steps";
/// What idempotency keys are scoped to besides the change (`key_scope.rs`).
pub const META_KEY_SCOPE: &str = "key_scope";
/// Run id below which the run retention sweep has looked at every record (u64 LE;
/// `run_retention.rs`).
pub const META_RUNS_SWEPT_BELOW: &str = "runs_swept_below";
/// What the run retention sweep must read again below its cursor (`run_retention::Waiting`):
/// the lowest id and earliest time of the records it stepped over as written a day or more
/// ahead of its clock, read again once that time is past the horizon, and where such a reading
/// that ran out of reads stopped. Absent: none.
pub const META_RUNS_FUTURE_FROM: &str = "runs_future_from";

/// source id → current `Watermark`.
pub const WATERMARKS: TableDefinition<&str, &[u8]> = TableDefinition::new("watermarks");
/// (source id, run id) → `Watermark` as committed by that run (append-only history).
pub const WATERMARK_HISTORY: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("watermark_history");
/// (source id, first parcel id) → a block of up to 32 parcels of the source in id order, each
/// its id and its snapshot record: `ParcelState`, then `StoredGeometry` (`blocks.rs`,
/// `snapshot.rs`).
pub const PARCEL_BLOCKS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("parcel_blocks");
/// (source id, parcel id) → `Tombstone`: the revision a removed parcel had reached
/// (`store::tombstones`; schema 8).
pub const PARCEL_TOMBSTONES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("parcel_tombstones");
/// (source id, removed at, parcel id) → (): the tombstones of each source by age, so that a
/// run's sweep reads only those past the key TTL, not every tombstone of its source (schema 9).
pub const PARCEL_TOMBSTONE_AGES: TableDefinition<(&str, u64, &str), ()> = TableDefinition::new("parcel_tombstone_ages");
/// (area-mode source id, place id) → `PlaceState`: the revision and last announcement of each
/// place whose change the source announced (`store::area_places`; schema 9).
pub const AREA_PLACES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("area_places");
/// (hold id, place id) → `PlaceState`: the places a held area-mode run would announce, moved
/// into `area_places` if the hold is released (schema 9).
pub const HELD_AREA_PLACES: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("held_area_places");
/// Schema 6: (source id, parcel id) → the parcel's snapshot record, a row per parcel. Read
/// once, by the schema 6 → 7 migration into `parcel_blocks`.
pub const LEGACY_PARCEL_ROWS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("parcel_snapshot");
/// Schema 5 and older: (source id, parcel id) → `ParcelState`. Read once, by the migration.
pub const LEGACY_PARCELS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("parcels");
/// Schema 5 and older: (source id, parcel id) → `StoredGeometry`. Read once, by the migration.
pub const LEGACY_PARCEL_GEOMS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("parcel_geoms");
/// idempotency key → `IdemRecord`.
pub const IDEM_KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("idem_keys");
/// Newly claimed keys, by sequence number, until merged into `idem_keys` (`key_journal.rs`).
pub const IDEM_KEY_JOURNAL: TableDefinition<u64, &[u8]> = TableDefinition::new("idem_key_journal");
/// (expires at, bucket number) → up to 16 keys expiring then (`expiry.rs`); swept periodically.
pub const IDEM_EXPIRY_BUCKETS: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("idem_expiry_buckets");
/// (expires at, key) → (): the per-key expiry index of stores written before buckets (schema
/// 3 and older); moved into buckets on open.
pub const IDEM_EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("idem_expiry");
/// outbox id → `OutboxEntry` never tried yet: the fresh queue, in claim order (`outbox.rs`).
pub const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox");
/// outbox id → `OutboxEntry` waiting for a retry (tried and failed, or a replayed dead
/// letter); each has its `OUTBOX_RETRY_DUE` entry. A row is in this table or `OUTBOX`.
pub const OUTBOX_RETRY: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox_retry");
/// (next attempt at ms, outbox id) → (): the fresh rows' due index of stores written before
/// schema 5 (the ids give that order); dropped on open (`outbox::migrate_due_index`).
pub const OUTBOX_DUE: TableDefinition<(u64, u64), ()> = TableDefinition::new("outbox_due");
/// seq → `AuditRow` (append-only).
pub const AUDIT: TableDefinition<u64, &[u8]> = TableDefinition::new("audit");
/// outbox id → `DeadLetter`.
pub const DEAD_LETTERS: TableDefinition<u64, &[u8]> = TableDefinition::new("dead_letters");
/// seq → `QuarantineRecord`.
pub const QUARANTINE: TableDefinition<u64, &[u8]> = TableDefinition::new("quarantine");
/// run id → `RunRecord`.
pub const RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("runs");
/// run id → `Hold`.
pub const HOLDS: TableDefinition<u64, &[u8]> = TableDefinition::new("holds");
/// (source id, hold run id) → (): the holds whose state is open (`holds.rs`; schema 14), so
/// that a run reads its source's open holds and not every hold ever made.
pub const OPEN_HOLDS: TableDefinition<(&str, u64), ()> = TableDefinition::new("open_holds");
/// (hold run id, parcel id) → `StagedParcel` (the held snapshot delta).
pub const HELD_PARCELS: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("held_parcels");
/// (hold run id, n) → `ChangeEvent` (the held events).
pub const HELD_EVENTS: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("held_events");
/// subscriber id → `StoredSubscriber` (subscribers managed through the control port).
pub const SUBSCRIBERS: TableDefinition<&str, &[u8]> = TableDefinition::new("subscribers");
/// (source id, parcel id) → share (f64 record) of the winning derived code of a parcel
/// (districts) or the largest overlay share (overlays). Written as a delta by each derived run
/// (the shares that moved); a parcel's share goes with its snapshot row.
pub const DERIVED_SHARES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("derived_shares");
/// (hold run id, parcel id) → share: the derived shares of a held run.
pub const HELD_SHARES: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("held_shares");

/// outbox id → lease expiry (ms), as builds of schema 4 and older wrote leases. Leases now
/// live in memory (`leases.rs`); this table stays empty and is cleared on open.
pub const OUTBOX_LEASES: TableDefinition<u64, u64> = TableDefinition::new("outbox_leases");
/// (next attempt at ms, outbox id) → () for the rows of `OUTBOX_RETRY`. Kept apart from the
/// fresh queue so live alerts are served ahead of late retries.
pub const OUTBOX_RETRY_DUE: TableDefinition<(u64, u64), ()> = TableDefinition::new("outbox_retry_due");
/// (idempotency key, attempt number) → `AttemptRecord`: the attempt log as stores written
/// before it moved to `DELIVERY_ATTEMPTS_BY_ROW` kept it; still read, swept by retention.
pub const DELIVERY_ATTEMPTS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("delivery_attempts");
/// (outbox id, attempt number within that row) → `AttemptRecord`: one row per delivery
/// attempt. Keyed by the outbox row, not the (hash) key, so an outcome commit appends instead
/// of dirtying a random page (issue 7); a key finds its rows through its key record.
pub const DELIVERY_ATTEMPTS_BY_ROW: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("delivery_attempts_by_row");
/// idempotency key → how many times its dead letter was replayed (u32 LE).
pub const DLQ_REPLAYS: TableDefinition<&str, u32> = TableDefinition::new("dlq_replays");
/// outcome label (`Outcome::as_str`) → audit rows of that outcome (`totals.rs`; schema 10).
pub const AUDIT_TOTALS: TableDefinition<&str, u64> = TableDefinition::new("audit_totals");
/// source id → `SourceRunTotals`: its runs per verdict, changes, latest layer size (`totals.rs`).
pub const RUN_TOTALS: TableDefinition<&str, &[u8]> = TableDefinition::new("run_totals");
/// (outcome, seq) → (): every audit row by its outcome, but a baseline's primed rows
/// (`history_index.rs`; schema 11).
pub const AUDIT_BY_OUTCOME: TableDefinition<(u8, u64), ()> = TableDefinition::new("audit_by_outcome");
/// (source id, run id) → (): every run record by its source (`history_index.rs`; schema 11).
pub const RUNS_BY_SOURCE: TableDefinition<(&str, u64), ()> = TableDefinition::new("runs_by_source");
/// outbox id → `DeadLetter` set aside for a person (replayed too often, invalid geometry).
pub const DLQ_QUARANTINE: TableDefinition<u64, &[u8]> = TableDefinition::new("dlq_quarantine");
/// subscriber id → `EndpointState` (disabled flag, circuit breaker, recent outcomes).
pub const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
/// subscriber id → the target its endpoint was disabled for (a 410, `disable_after`; schema 13):
/// a config subscriber whose target has changed since is enabled when the config is next
/// loaded (`endpoints.rs`). Removed when the endpoint is enabled.
pub const ENDPOINT_DISABLED_TARGETS: TableDefinition<&str, &str> = TableDefinition::new("endpoint_disabled_targets");
/// source id → `SweptRuns`: what the run retention sweep removed of the source's run records
/// (`run_retention.rs`; schema 13), so its totals still add up.
pub const RUNS_SWEPT: TableDefinition<&str, &[u8]> = TableDefinition::new("runs_swept");

/// Calls macro `$m` with `$args` followed by every table of the current schema, so that what
/// must see each one — a backup copies it, `check` reads it whole — names them in one place:
/// a table added to the store and here is backed up and checked (`tests/backup.rs` checks
/// that a backup holds every table a store has).
macro_rules! every_table {
    ($m:ident!($($args:tt)*)) => {
        $m!(
            $($args)* META, WATERMARKS, WATERMARK_HISTORY, PARCEL_BLOCKS, IDEM_KEYS, IDEM_KEY_JOURNAL, IDEM_EXPIRY_BUCKETS, OUTBOX,
            OUTBOX_RETRY, AUDIT, DEAD_LETTERS, QUARANTINE, RUNS, HOLDS, HELD_PARCELS, HELD_EVENTS, SUBSCRIBERS,
            DERIVED_SHARES, HELD_SHARES, OUTBOX_LEASES, OUTBOX_RETRY_DUE, DELIVERY_ATTEMPTS, DLQ_REPLAYS,
            DLQ_QUARANTINE, ENDPOINTS, DELIVERY_ATTEMPTS_BY_ROW, PARCEL_TOMBSTONES, PARCEL_TOMBSTONE_AGES,
            AREA_PLACES, HELD_AREA_PLACES, AUDIT_TOTALS, RUN_TOTALS, AUDIT_BY_OUTCOME, RUNS_BY_SOURCE, RUNS_SWEPT,
            ENDPOINT_DISABLED_TARGETS, OPEN_HOLDS,
        )
    };
}
pub(super) use every_table;
