//! The parcel snapshot's record: a parcel's state and then its geometry, one record per
//! parcel, stored in the blocks of `parcel_blocks` (`blocks.rs`; schema 6 kept a row per
//! record in `parcel_snapshot`).
//!
//! Why one record and not two: a baseline commit writes every parcel of a county, and redb's
//! cost is per row. Schema 5 and older kept states (`parcels`) and geometries
//! (`parcel_geoms`) in two tables so the diff's scan read only the small states. Measured on
//! the bench store's rows (1M parcels, 88-byte states, 87-byte geometries, key order): two
//! tables cost 1.48–1.50 s of inserts, one table 0.97–0.99 s; the diff's full scan costs
//! 112–119 ms against 136–149 ms. The scan is paid on every run of a source, the insert only
//! when its parcels change, but the insert saves thirteen times what the scan loses.
//!
//! The layout is `[version] ++ postcard(ParcelState) ++ postcard(StoredGeometry)`: the
//! state comes first so the diff decodes it from the front of the record and never touches
//! the geometry's bytes. Version 2 ([`SNAPSHOT_RECORD_VERSION`], schema 8) added
//! `ParcelState::revision` and `ParcelState::announced` as the state's last fields; version 1
//! records (the state without them) are read as revision 0, nothing announced and stay as they are until their parcel changes. The fields
//! before it are laid out alike in both, so the diff's index reads either version the same.

use super::codec::{split_version, unknown_version};
use super::blocks::{with_record, BlockPacker, BlockTable};
use super::tables::{LEGACY_PARCELS, LEGACY_PARCEL_GEOMS, META, META_COMPACT_PENDING, PARCEL_BLOCKS};
use super::StoreError;
use crate::model::{Envelope, ExteriorEnvelope, ParcelRef, ParcelState, StoredGeometry};
use redb::{ReadableTable, TableHandle, WriteTransaction};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The version byte of the snapshot records this build writes (see the module doc).
pub const SNAPSHOT_RECORD_VERSION: u8 = 2;

/// The version byte of snapshot records written before `ParcelState::revision` (schema 7 and
/// older; the schema 5 and 6 upgrades still write them, copying states of that shape).
pub(super) const SNAPSHOT_RECORD_V1: u8 = 1;

/// `ParcelState` as version 1 records hold it: without its revision.
#[derive(Serialize, Deserialize)]
pub(super) struct ParcelStateV1 {
    zoning: String,
    effective_date: Option<String>,
    content_hash: [u8; 32],
    geom_hash: [u8; 32],
    area_m2: f64,
}

impl ParcelStateV1 {
    /// `state` as a version 1 record held it (tests write such records).
    #[cfg(test)]
    pub(super) fn of(state: &ParcelState) -> ParcelStateV1 {
        ParcelStateV1 {
            zoning: state.zoning.clone(),
            effective_date: state.effective_date.clone(),
            content_hash: state.content_hash,
            geom_hash: state.geom_hash,
            area_m2: state.area_m2,
        }
    }
}

impl From<ParcelStateV1> for ParcelState {
    fn from(v: ParcelStateV1) -> Self {
        ParcelState { zoning: v.zoning, effective_date: v.effective_date, content_hash: v.content_hash, geom_hash: v.geom_hash, area_m2: v.area_m2, revision: 0, announced: None }
    }
}

/// One parcel's snapshot row, encoded as [`RunWriter::upserts`](super::RunWriter::upserts)
/// writes it. A baseline writes millions: encoding them on another thread than the one
/// holding the write transaction shortens the time the write lock is held.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    /// The parcel id (the key within its source).
    pub id: String,
    /// The encoded [`ParcelRef`]: state, then geometry.
    pub record: Vec<u8>,
}

impl SnapshotRow {
    pub fn encode(p: ParcelRef<'_>) -> SnapshotRow {
        SnapshotRow { id: p.id.to_string(), record: encode_record(p.state, p.geometry) }
    }

    /// The row of a parcel whose state and geometry are already encoded: `body` is
    /// `postcard(ParcelState) ++ postcard(StoredGeometry)`, as a spilled parcel carries them
    /// (`SpillReader::last_parcel_body`). A baseline's million rows are copied off the spill
    /// this way, not encoded a second time; the bytes are [`SnapshotRow::encode`]'s (tested).
    pub fn from_body(id: String, body: &[u8]) -> SnapshotRow {
        let mut record = Vec::with_capacity(1 + body.len());
        record.push(SNAPSHOT_RECORD_VERSION);
        record.extend_from_slice(body);
        SnapshotRow { id, record }
    }

    /// The [`StoredGeometry::exterior_envelope`] of such a body's geometry, read without
    /// decoding the body (the state is skipped borrowed, the geometry walked): no
    /// allocation. An error if `body` is not exactly one state and one geometry.
    pub fn body_envelope(body: &[u8]) -> Result<Option<Envelope>, String> {
        body_parts::<StateRef<'_>, ExteriorEnvelope>(body).map(|(_, envelope)| envelope.0)
    }

    /// Such a body decoded: an error if it is not exactly one state and one geometry.
    pub fn decode_body(body: &[u8]) -> Result<(ParcelState, StoredGeometry), String> {
        body_parts(body)
    }
}

/// A record body read as its two halves, with nothing after the second.
fn body_parts<'a, S: Deserialize<'a>, G: Deserialize<'a>>(body: &'a [u8]) -> Result<(S, G), String> {
    let (state, rest) = postcard::take_from_bytes::<S>(body).map_err(|e| e.to_string())?;
    let (geometry, after) = postcard::take_from_bytes::<G>(rest).map_err(|e| e.to_string())?;
    if !after.is_empty() {
        return Err(format!("{} bytes after the geometry", after.len()));
    }
    Ok((state, geometry))
}

/// The record as it is written; serde encodes a reference as what it refers to.
#[derive(Serialize)]
struct RecordRef<'a> {
    state: &'a ParcelState,
    geometry: &'a StoredGeometry,
}

/// A borrowed view of the state at the front of a record: the same fields in the same order
/// (postcard writes a nested struct's fields in place, so the version 1 fields first, then
/// the ones version 2 added), so postcard skips it without allocating to reach the geometry.
#[derive(Deserialize)]
struct StateRef<'a> {
    #[allow(dead_code)]
    #[serde(borrow)]
    front: StateRefV1<'a>,
    #[allow(dead_code)]
    revision: u32,
    #[allow(dead_code)]
    announced: Option<crate::model::Announced>,
}

/// [`StateRef`] of a version 1 record (no revision).
#[derive(Deserialize)]
struct StateRefV1<'a> {
    #[allow(dead_code)]
    zoning: &'a str,
    #[allow(dead_code)]
    effective_date: Option<&'a str>,
    #[allow(dead_code)]
    content_hash: [u8; 32],
    #[allow(dead_code)]
    geom_hash: [u8; 32],
    #[allow(dead_code)]
    area_m2: f64,
}

/// The front of a state up to its content hash: all the diff's index needs of each row
/// (postcard reads fields in order, so it stops there).
#[derive(Deserialize)]
pub(super) struct HashRef<'a> {
    #[allow(dead_code)]
    zoning: &'a str,
    #[allow(dead_code)]
    effective_date: Option<&'a str>,
    pub(super) content_hash: [u8; 32],
}

/// Encodes a snapshot record (at [`SNAPSHOT_RECORD_VERSION`]).
pub(super) fn encode_record(state: &ParcelState, geometry: &StoredGeometry) -> Vec<u8> {
    super::codec::encode_versioned(SNAPSHOT_RECORD_VERSION, &RecordRef { state, geometry })
}

/// A record's version byte and its postcard bytes (an error for a version this build cannot
/// read).
pub(super) fn record_parts(bytes: &[u8]) -> Result<(u8, &[u8]), String> {
    match split_version(bytes)? {
        (v @ (SNAPSHOT_RECORD_V1 | SNAPSHOT_RECORD_VERSION), rest) => Ok((v, rest)),
        (v, _) => Err(unknown_version(v, "parcel snapshot", SNAPSHOT_RECORD_VERSION)),
    }
}

/// The state at the front of a record's postcard bytes of `version`, and what follows it.
fn take_state(version: u8, bytes: &[u8]) -> Result<(ParcelState, &[u8]), String> {
    let taken = match version {
        SNAPSHOT_RECORD_V1 => postcard::take_from_bytes::<ParcelStateV1>(bytes).map(|(s, rest)| (s.into(), rest)),
        _ => postcard::take_from_bytes::<ParcelState>(bytes),
    };
    taken.map_err(|e| e.to_string())
}

/// What follows the state at the front of a record's postcard bytes of `version` (the state
/// skipped borrowed, without allocating).
fn skip_state(version: u8, bytes: &[u8]) -> Result<&[u8], String> {
    let skipped = match version {
        SNAPSHOT_RECORD_V1 => postcard::take_from_bytes::<StateRefV1<'_>>(bytes).map(|(_, rest)| rest),
        _ => postcard::take_from_bytes::<StateRef<'_>>(bytes).map(|(_, rest)| rest),
    };
    skipped.map_err(|e| e.to_string())
}

/// The content hash of a record's state, borrowed (the fields up to it are alike in every
/// version).
pub(super) fn decode_hash_ref(bytes: &[u8]) -> Result<HashRef<'_>, String> {
    postcard::take_from_bytes(record_parts(bytes)?.1).map(|(s, _)| s).map_err(|e| e.to_string())
}

/// The state of a record (its geometry is not decoded).
pub(super) fn decode_state(bytes: &[u8]) -> Result<ParcelState, String> {
    let (version, rest) = record_parts(bytes)?;
    take_state(version, rest).map(|(s, _)| s)
}

/// The state of a record and its geometry's [`StoredGeometry::exterior_envelope`] (the
/// geometry walked, not built).
pub(super) fn decode_state_envelope(bytes: &[u8]) -> Result<(ParcelState, Option<Envelope>), String> {
    let (version, rest) = record_parts(bytes)?;
    let (state, rest) = take_state(version, rest)?;
    let (envelope, after) = postcard::take_from_bytes::<ExteriorEnvelope>(rest).map_err(|e| e.to_string())?;
    if !after.is_empty() {
        return Err(format!("{} bytes after the geometry", after.len()));
    }
    Ok((state, envelope.0))
}

/// Both halves of a record (the geometry as [`decode_geometry`] gives it).
pub(super) fn decode_record(bytes: &[u8]) -> Result<(ParcelState, Option<StoredGeometry>), String> {
    let (version, rest) = record_parts(bytes)?;
    let (state, rest) = take_state(version, rest)?;
    Ok((state, known_geometry(rest)?))
}

/// The geometry of a record (its state is skipped without allocating). `None` for the empty
/// geometry the schema 6 upgrade gave a parcel whose geometry row was missing: unknown, as
/// it was before the upgrade (every geometry a run stores has a polygon).
pub(super) fn decode_geometry(bytes: &[u8]) -> Result<Option<StoredGeometry>, String> {
    let (version, rest) = record_parts(bytes)?;
    known_geometry(skip_state(version, rest)?)
}

/// The stored geometries of the given parcels of a source, from a snapshot table opened in a
/// read or a write transaction; parcels without one are left out.
pub(super) fn geometries_of<'a, T: BlockTable>(
    table: &T,
    source_id: &str,
    ids: impl IntoIterator<Item = &'a str>,
) -> Result<HashMap<String, StoredGeometry>, StoreError> {
    let mut out = HashMap::new();
    for id in ids {
        if let Some(geometry) = with_record(table, source_id, id, decode_geometry)? {
            if let Some(g) = geometry.map_err(|m| super::runs::codec_err("parcel_blocks", m))? {
                out.insert(id.to_string(), g);
            }
        }
    }
    Ok(out)
}

fn known_geometry(bytes: &[u8]) -> Result<Option<StoredGeometry>, String> {
    let g: StoredGeometry = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
    Ok((!g.0.is_empty()).then_some(g))
}

/// What moving a schema 5 snapshot into `parcel_blocks` found.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Migrated {
    /// Parcels moved.
    pub parcels: u64,
    /// States with no geometry row (never written so; kept with an empty geometry, which
    /// geometry lookups report as no geometry, as before: the parcel stays in the snapshot
    /// and the next run's diff still sees it).
    pub without_geometry: u64,
}

/// Once per store of schema 5 or older: each parcel's state (`parcels`) and geometry
/// (`parcel_geoms`) become one snapshot record, packed into the blocks of `parcel_blocks`
/// (`blocks::BlockPacker`; schema 6's row per parcel is skipped, so the file holds the old
/// tables and the blocks, not a third copy), and the two tables are dropped. Both are keyed
/// alike, so they are read side by side in key order. Runs inside the opening transaction,
/// with the schema upgrade: both or neither. Marks the file for compaction when it moved
/// any parcel.
pub(super) fn migrate_split_tables(wtx: &WriteTransaction) -> Result<Migrated, StoreError> {
    let legacy = |name: &str| name == LEGACY_PARCELS.name() || name == LEGACY_PARCEL_GEOMS.name();
    if !wtx.list_tables()?.any(|t| legacy(t.name())) {
        return Ok(Migrated::default());
    }
    let mut migrated = Migrated::default();
    {
        let states = wtx.open_table(LEGACY_PARCELS)?;
        let geoms = wtx.open_table(LEGACY_PARCEL_GEOMS)?;
        let mut out = wtx.open_table(PARCEL_BLOCKS)?;
        let mut packer = BlockPacker::new();
        let mut geom_rows = geoms.iter()?.peekable();
        let mut record = Vec::new();
        for item in states.iter()? {
            let (k, state) = item?;
            let key = k.value();
            // Geometry rows of parcels with no state (never written so) are passed over.
            while geom_rows.peek().is_some_and(|g| g.as_ref().map(|(gk, _)| gk.value() < key).unwrap_or(false)) {
                geom_rows.next();
            }
            let geometry = geom_rows.next_if(|g| g.as_ref().map(|(gk, _)| gk.value() == key).unwrap_or(true)).transpose()?;
            // Stored bytes are copied, not decoded and re-encoded: a state and a geometry of
            // record version 1 are exactly the two halves of a snapshot record.
            // Both were written by `codec::encode` (version 1, the state without a revision).
            let state = legacy_postcard(state.value()).map_err(|m| super::runs::codec_err("parcels", m))?;
            record.clear();
            record.push(SNAPSHOT_RECORD_V1);
            record.extend_from_slice(state);
            match &geometry {
                Some((_, g)) => record.extend_from_slice(legacy_postcard(g.value()).map_err(|m| super::runs::codec_err("parcel_geoms", m))?),
                None => {
                    record.extend(postcard::to_allocvec(&StoredGeometry(Vec::new())).map_err(|e| super::runs::codec_err("parcel_geoms", e.to_string()))?);
                    migrated.without_geometry += 1;
                }
            }
            packer.push(&mut out, key.0, key.1, &record)?;
        }
        migrated.parcels = packer.finish(&mut out)?;
    }
    wtx.delete_table(LEGACY_PARCELS)?;
    wtx.delete_table(LEGACY_PARCEL_GEOMS)?;
    if migrated.parcels > 0 {
        // Every parcel was written again and the old tables freed: the file is about twice
        // what it needs, until compacted (`Store::compact_after_upgrade`).
        wtx.open_table(META)?.insert(META_COMPACT_PENDING, [1u8].as_slice())?;
    }
    Ok(migrated)
}

/// The postcard bytes of a schema 5 state or geometry row (record version 1).
fn legacy_postcard(bytes: &[u8]) -> Result<&[u8], String> {
    match split_version(bytes)? {
        (1, rest) => Ok(rest),
        (v, _) => Err(unknown_version(v, "parcel states and geometries", 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::codec::encode;
    use crate::store::Store;
    use crate::store::blocks::for_each_parcel;
    use crate::store::tables::{LEGACY_PARCEL_ROWS, META_SCHEMA};
    use redb::{ReadableDatabase, ReadableTableMetadata};

    /// A body's envelope, walked off its bytes, is the decoded geometry's, for every shape
    /// of stored geometry (holes, several parts, parts without rings or with an empty
    /// exterior, none at all); a body that is cut short or runs on is an error.
    #[test]
    fn a_body_envelope_is_the_decoded_geometrys() {
        let ring = |x: f64, y: f64, s: f64| vec![[x, y], [x + s, y], [x + s, y + s * 0.5], [x, y]];
        let state = ParcelState { zoning: "R-1".into(), effective_date: Some("2026-03-01".into()), content_hash: [5; 32], geom_hash: [6; 32], area_m2: 9.0, revision: 0, announced: None };
        let shapes = vec![
            StoredGeometry(vec![vec![ring(1.0, 2.0, 0.5)]]),
            StoredGeometry(vec![vec![ring(1.0, 2.0, 0.5), ring(-9.0, -9.0, 20.0)]]),
            StoredGeometry(vec![vec![ring(1.0, 2.0, 0.5)], vec![ring(-3.0, 7.0, 0.25)]]),
            StoredGeometry(vec![vec![], vec![ring(4.0, 4.0, 1.0)]]),
            StoredGeometry(vec![vec![vec![], ring(0.0, 0.0, 100.0)], vec![ring(4.0, 4.0, 1.0)]]),
            StoredGeometry(vec![vec![vec![], ring(0.0, 0.0, 100.0)]]),
            StoredGeometry(vec![vec![]]),
            StoredGeometry(vec![]),
        ];
        for g in shapes {
            let row = SnapshotRow::encode(ParcelRef { id: "p", state: &state, geometry: &g });
            let body = &row.record[1..];
            assert_eq!(SnapshotRow::body_envelope(body), Ok(g.exterior_envelope()), "{g:?}");
            assert!(SnapshotRow::body_envelope(&body[..body.len() - 1]).is_err() || g.0.is_empty(), "cut short: {g:?}");
            assert!(SnapshotRow::body_envelope(&[body, &[0][..]].concat()).is_err(), "runs on: {g:?}");
        }
        assert_eq!(StoredGeometry(vec![vec![ring(1.0, 2.0, 0.5)], vec![ring(-3.0, 7.0, 0.25)]]).exterior_envelope(), Some(([-3.0, 2.0], [1.5, 7.125])));
    }

    fn state(zoning: &str, n: u8) -> ParcelState {
        ParcelState { zoning: zoning.into(), effective_date: Some("2026-01-01".into()), content_hash: [n; 32], geom_hash: [n + 1; 32], area_m2: 412.5, revision: 0, announced: None }
    }

    fn square(x: f64) -> StoredGeometry {
        StoredGeometry(vec![vec![vec![[x, 0.0], [x + 1.0, 0.0], [x + 1.0, 1.0], [x, 0.0]]]])
    }

    /// A version 1 record (schema 7 and older): the state without its revision.
    fn v1_record(s: &ParcelState, g: &StoredGeometry) -> Vec<u8> {
        let mut bytes = vec![SNAPSHOT_RECORD_V1];
        bytes.extend(postcard::to_allocvec(&ParcelStateV1::of(s)).unwrap());
        bytes.extend(postcard::to_allocvec(g).unwrap());
        bytes
    }

    /// Each half of a record decodes on its own, and the borrowed hash agrees, with and
    /// without an effective date, at every revision; a version 1 record (no revision) reads
    /// the same way, as revision 0.
    #[test]
    fn a_record_gives_back_its_state_and_its_geometry() {
        let (mut s, g) = (state("R-1", 3), square(2.0));
        let told = Some(crate::model::Announced { content: [7; 16], key_revision: 299 });
        for (effective_date, revision, announced) in
            [(None, 0, None), (Some("2026-01-01".to_string()), 0, None), (None, 1, told), (None, 300, told), (Some("2026-02-01".to_string()), u32::MAX, told)]
        {
            s.effective_date = effective_date;
            s.revision = revision;
            s.announced = announced;
            let bytes = encode_record(&s, &g);
            assert_eq!(bytes[0], SNAPSHOT_RECORD_VERSION);
            assert_eq!(decode_state(&bytes).unwrap(), s);
            assert_eq!(decode_geometry(&bytes).unwrap(), Some(g.clone()));
            assert_eq!(decode_record(&bytes).unwrap(), (s.clone(), Some(g.clone())));
            assert_eq!(decode_state_envelope(&bytes).unwrap(), (s.clone(), g.exterior_envelope()));
            assert_eq!(decode_hash_ref(&bytes).unwrap().content_hash, [3; 32]);
            // The row a spilled parcel's body gives is the same bytes.
            assert_eq!(SnapshotRow::from_body("p".into(), &bytes[1..]).record, bytes);

            let old = v1_record(&s, &g);
            let as_read = ParcelState { revision: 0, announced: None, ..s.clone() };
            assert_eq!(decode_state(&old).unwrap(), as_read);
            assert_eq!(decode_geometry(&old).unwrap(), Some(g.clone()));
            assert_eq!(decode_record(&old).unwrap(), (as_read.clone(), Some(g.clone())));
            assert_eq!(decode_state_envelope(&old).unwrap(), (as_read, g.exterior_envelope()));
            assert_eq!(decode_hash_ref(&old).unwrap().content_hash, [3; 32]);
        }
        let bytes = encode_record(&s, &g);
        let mut future = bytes.clone();
        future[0] = 9;
        assert!(decode_state(&future).unwrap_err().contains("version 9"));
        assert!(decode_geometry(&bytes[..bytes.len() - 3]).is_err(), "a cut record is an error, not a short geometry");
    }

    type Legacy = Vec<(&'static str, &'static str, ParcelState, StoredGeometry)>;

    /// Four parcels of two sources in the schema 5 layout, written into `wtx`: `a/p3` has
    /// lost its geometry row, and geometry rows without a state sit before the first state,
    /// between two states, between the sources and after the last state.
    fn write_legacy(wtx: &WriteTransaction) -> Legacy {
        let parcels: Legacy = vec![
            ("a", "p1", state("R-1", 1), square(0.0)),
            ("a", "p2", state("C-2", 2), square(5.0)),
            ("a", "p3", state("I-1", 3), square(9.0)),
            ("b", "p1", state("OS", 4), square(20.0)),
        ];
        let mut states = wtx.open_table(LEGACY_PARCELS).unwrap();
        let mut geoms = wtx.open_table(LEGACY_PARCEL_GEOMS).unwrap();
        for (src, id, s, g) in &parcels {
            states.insert((*src, *id), encode(&ParcelStateV1::of(s)).as_slice()).unwrap();
            if (*src, *id) != ("a", "p3") {
                geoms.insert((*src, *id), encode(g).as_slice()).unwrap();
            }
        }
        for orphan in [("a", "a0"), ("a", "p25"), ("a", "z9"), ("c", "x")] {
            geoms.insert(orphan, encode(&square(7.0)).as_slice()).unwrap();
        }
        parcels
    }

    /// A store file at `path` as an older release left it: a current store with `older`
    /// applied in one committed transaction.
    fn older_store(path: &std::path::Path, older: impl FnOnce(&WriteTransaction)) {
        let store = Store::open(path).unwrap();
        let wtx = store.db.begin_write().unwrap();
        older(&wtx);
        wtx.commit().unwrap();
    }

    /// The schema 5 layout of [`write_legacy`]: no `parcel_blocks` (nor schema 6's
    /// `parcel_snapshot`), version 5.
    fn as_schema_5(wtx: &WriteTransaction) {
        wtx.open_table(META).unwrap().insert(META_SCHEMA, 5u32.to_le_bytes().as_slice()).unwrap();
        wtx.delete_table(PARCEL_BLOCKS).unwrap();
    }

    /// The join itself: every state gets its own geometry (orphans in any position are
    /// passed over), a state without one is counted and kept, the old tables are dropped.
    #[test]
    fn the_join_pairs_each_state_with_its_own_geometry() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("z.redb")).unwrap();
        let wtx = store.db.begin_write().unwrap();
        let parcels = write_legacy(&wtx);
        let migrated = migrate_split_tables(&wtx).unwrap();
        assert_eq!(migrated, Migrated { parcels: 4, without_geometry: 1 });
        assert!(wtx.open_table(META).unwrap().get(META_COMPACT_PENDING).unwrap().is_some(), "marked for compaction");
        assert!(!wtx.list_tables().unwrap().any(|t| t.name() == "parcels" || t.name() == "parcel_geoms"));
        {
            let t = wtx.open_table(PARCEL_BLOCKS).unwrap();
            let mut rows: Vec<((String, String), Vec<u8>)> = Vec::new();
            for source in ["a", "b", "c"] {
                for_each_parcel(&t, source, |id, record| {
                    rows.push(((source.to_string(), id.to_string()), record.to_vec()));
                    Ok(())
                })
                .unwrap();
            }
            assert_eq!(rows.len(), 4, "one record per state, none for an orphan geometry");
            for ((src, id), record) in &rows {
                let (_, _, s, g) = parcels.iter().find(|p| (p.0, p.1) == (src.as_str(), id.as_str())).unwrap();
                assert_eq!(&decode_state(record).unwrap(), s, "{src}/{id}");
                let want = if (src.as_str(), id.as_str()) == ("a", "p3") { None } else { Some(g.clone()) };
                assert_eq!(decode_geometry(record).unwrap(), want, "{src}/{id}");
            }
        }
        assert!(!wtx.list_tables().unwrap().any(|t| t.name() == LEGACY_PARCEL_ROWS.name()), "no row per parcel on the way");
        assert_eq!(migrate_split_tables(&wtx).unwrap(), Migrated::default(), "once only");
    }

    /// A schema 5 store opens as the current schema, compacted, with what the store reads
    /// back unchanged: every state, every geometry, and no geometry for the parcel that had
    /// none (as before the upgrade).
    #[test]
    fn a_schema_5_store_is_upgraded_and_compacted_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let mut parcels = Vec::new();
        older_store(&path, |wtx| {
            parcels = write_legacy(wtx);
            as_schema_5(wtx);
        });
        let store = Store::open(&path).unwrap();
        {
            let rtx = store.db.begin_read().unwrap();
            let names: Vec<String> = rtx.list_tables().unwrap().map(|t| t.name().to_string()).collect();
            assert!(!names.iter().any(|n| n == "parcels" || n == "parcel_geoms"), "old tables dropped: {names:?}");
            let meta = rtx.open_table(META).unwrap();
            assert_eq!(meta.get(META_SCHEMA).unwrap().unwrap().value(), crate::store::SCHEMA_VERSION.to_le_bytes());
            assert!(meta.get(META_COMPACT_PENDING).unwrap().is_none(), "compacted, so the mark is gone");
            assert!(!names.iter().any(|n| n == LEGACY_PARCEL_ROWS.name()), "schema 6's rows packed into blocks: {names:?}");
            let mut parcels = 0;
            for source in ["a", "b"] {
                parcels += for_each_parcel(&rtx.open_table(PARCEL_BLOCKS).unwrap(), source, |_, _| Ok(())).unwrap();
            }
            assert_eq!(parcels, 4);
        }
        for (src, id, s, g) in &parcels {
            assert_eq!(&store.snapshot_states(src).unwrap()[*id], s, "{src}/{id}");
            let geoms = store.parcel_geometries(src, [*id]).unwrap();
            if (*src, *id) == ("a", "p3") {
                assert!(geoms.is_empty(), "no geometry, as before the upgrade");
            } else {
                assert_eq!(&geoms[*id], g, "{src}/{id}");
            }
        }
        assert_eq!(store.snapshot_states("a").unwrap().len(), 3);
        assert!(store.snapshot_states("c").unwrap().is_empty(), "an orphan geometry is no parcel");
        let base: Vec<(String, ParcelState, StoredGeometry)> = store.snapshot_parcels("a").unwrap();
        let want: Vec<(String, ParcelState, StoredGeometry)> =
            parcels[..2].iter().map(|(_, id, s, g)| (id.to_string(), s.clone(), g.clone())).collect();
        assert_eq!(base, want, "a whole base in id order, without the parcel that has no geometry");
        let report = store.check_consistency().unwrap();
        assert!(report.is_consistent(), "{:?}", report.problems);
    }

    /// An upgrade that cannot finish (here a legacy state of an unknown record version) fails
    /// the open with an error that says so, and leaves the file as the older release wrote it.
    #[test]
    fn a_failed_upgrade_is_reported_and_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        older_store(&path, |wtx| {
            write_legacy(wtx);
            let mut future = encode(&state("R-9", 9));
            future[0] = 7;
            wtx.open_table(LEGACY_PARCELS).unwrap().insert(("b", "p2"), future.as_slice()).unwrap();
            as_schema_5(wtx);
        });
        let err = Store::open(&path).unwrap_err();
        assert!(matches!(err, crate::store::StoreError::Upgrade { from: 5, to: crate::store::SCHEMA_VERSION, .. }), "{err:?}");
        assert!(err.to_string().contains("version 7"), "names the cause: {err}");
        let db = redb::Database::open(&path).unwrap();
        let rtx = db.begin_read().unwrap();
        assert_eq!(rtx.open_table(META).unwrap().get(META_SCHEMA).unwrap().unwrap().value(), 5u32.to_le_bytes());
        assert_eq!(rtx.open_table(LEGACY_PARCELS).unwrap().len().unwrap(), 5, "the old tables are still there");
        assert!(!rtx.list_tables().unwrap().any(|t| [LEGACY_PARCEL_ROWS.name(), PARCEL_BLOCKS.name()].contains(&t.name())), "and no new one");
    }

    /// The schema 6 layout: `parcels` written as a row per parcel in `parcel_snapshot`, no
    /// `parcel_blocks`, version 6.
    fn as_schema_6(wtx: &WriteTransaction, parcels: &[(&str, &str, ParcelState, StoredGeometry)]) {
        let mut rows = wtx.open_table(LEGACY_PARCEL_ROWS).unwrap();
        for (src, id, s, g) in parcels {
            rows.insert((*src, *id), encode_record(s, g).as_slice()).unwrap();
        }
        drop(rows);
        wtx.open_table(META).unwrap().insert(META_SCHEMA, 6u32.to_le_bytes().as_slice()).unwrap();
        wtx.delete_table(PARCEL_BLOCKS).unwrap();
    }

    /// A schema 6 store opens as the current schema, its rows packed into blocks and the
    /// file compacted, with what the store reads back unchanged.
    #[test]
    fn a_schema_6_store_is_packed_into_blocks_and_compacted_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        let ids: Vec<String> = (0..100).map(|i| format!("p{i:03}")).collect();
        let mut parcels: Vec<(&str, &str, ParcelState, StoredGeometry)> =
            ids.iter().enumerate().map(|(i, id)| ("a", id.as_str(), state("R-1", i as u8), square(i as f64))).collect();
        parcels.push(("a2", "p000", state("C-2", 200), square(-1.0)));
        older_store(&path, |wtx| as_schema_6(wtx, &parcels));
        let store = Store::open(&path).unwrap();
        {
            let rtx = store.db.begin_read().unwrap();
            assert!(!rtx.list_tables().unwrap().any(|t| t.name() == LEGACY_PARCEL_ROWS.name()), "the rows are gone");
            let meta = rtx.open_table(META).unwrap();
            assert_eq!(meta.get(META_SCHEMA).unwrap().unwrap().value(), crate::store::SCHEMA_VERSION.to_le_bytes());
            assert!(meta.get(META_COMPACT_PENDING).unwrap().is_none(), "compacted, so the mark is gone");
            assert!(rtx.open_table(PARCEL_BLOCKS).unwrap().len().unwrap() < 10, "100 parcels in a few blocks");
        }
        let want: Vec<(String, ParcelState, StoredGeometry)> =
            parcels[..100].iter().map(|(_, id, s, g)| (id.to_string(), s.clone(), g.clone())).collect();
        assert_eq!(store.snapshot_parcels("a").unwrap(), want);
        assert_eq!(store.snapshot_states("a2").unwrap()["p000"], state("C-2", 200));
        assert_eq!(store.parcel_geometries("a", ["p042"]).unwrap()["p042"], square(42.0));
        assert!(store.check_consistency().unwrap().is_consistent());
    }

    /// A file where blocks and schema 6's rows both hold parcels (no zonewatch writes one) is
    /// refused on open, with both layouts named, and left as it was; so is one where schema
    /// 5's tables and schema 6's rows both do.
    #[test]
    fn a_store_with_two_snapshot_layouts_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (name, older) in [
            ("blocks and rows", Box::new(|wtx: &WriteTransaction| {
                let mut w = wtx.open_table(PARCEL_BLOCKS).unwrap();
                let mut buf = Vec::new();
                let record = encode_record(&state("R-1", 1), &square(0.0));
                crate::store::blocks::encode_block(&[("p1", record.as_slice())], &mut buf).unwrap();
                w.insert(("a", "p1"), buf.as_slice()).unwrap();
                drop(w);
                wtx.open_table(LEGACY_PARCEL_ROWS).unwrap().insert(("a", "p2"), record.as_slice()).unwrap();
            }) as Box<dyn Fn(&WriteTransaction)>),
            ("split tables and rows", Box::new(|wtx: &WriteTransaction| {
                write_legacy(wtx);
                as_schema_5(wtx);
                wtx.open_table(LEGACY_PARCEL_ROWS).unwrap().insert(("a", "p2"), encode_record(&state("R-1", 1), &square(0.0)).as_slice()).unwrap();
            })),
        ] {
            let path = dir.path().join(format!("{}.redb", name.replace(' ', "-")));
            older_store(&path, |wtx| older(wtx));
            let err = Store::open(&path).unwrap_err().to_string();
            assert!(err.contains("more than one snapshot layout") && err.contains("parcel_snapshot"), "{name}: {err}");
            let db = redb::Database::open(&path).unwrap();
            let rtx = db.begin_read().unwrap();
            assert_eq!(rtx.open_table(LEGACY_PARCEL_ROWS).unwrap().len().unwrap(), 1, "{name}: left as it was");
        }
    }

    /// A schema 6 row of a record version this build cannot read fails the upgrade, which
    /// keeps nothing: the file stays at schema 6 with its rows.
    #[test]
    fn a_schema_6_row_it_cannot_read_fails_the_upgrade() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        older_store(&path, |wtx| {
            as_schema_6(wtx, &[("a", "p1", state("R-1", 1), square(0.0)), ("a", "p2", state("R-1", 2), square(1.0))]);
            let mut future = encode_record(&state("R-9", 9), &square(2.0));
            future[0] = 7;
            wtx.open_table(LEGACY_PARCEL_ROWS).unwrap().insert(("a", "p3"), future.as_slice()).unwrap();
        });
        let err = Store::open(&path).unwrap_err();
        assert!(matches!(err, crate::store::StoreError::Upgrade { from: 6, .. }), "{err:?}");
        assert!(err.to_string().contains("a/p3") && err.to_string().contains("version 7"), "names the row and the cause: {err}");
        let db = redb::Database::open(&path).unwrap();
        let rtx = db.begin_read().unwrap();
        assert_eq!(rtx.open_table(META).unwrap().get(META_SCHEMA).unwrap().unwrap().value(), 6u32.to_le_bytes());
        assert_eq!(rtx.open_table(LEGACY_PARCEL_ROWS).unwrap().len().unwrap(), 3, "the rows are still there");
        assert!(!rtx.list_tables().unwrap().any(|t| t.name() == PARCEL_BLOCKS.name()), "and no blocks");
    }

    /// An open cut short after the upgrade's commit (the mark left) compacts on the next one.
    #[test]
    fn a_pending_compaction_is_done_on_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.redb");
        older_store(&path, |wtx| {
            wtx.open_table(META).unwrap().insert(META_COMPACT_PENDING, [1u8].as_slice()).unwrap();
        });
        let store = Store::open(&path).unwrap();
        let rtx = store.db.begin_read().unwrap();
        assert!(rtx.open_table(META).unwrap().get(META_COMPACT_PENDING).unwrap().is_none());
    }
}
