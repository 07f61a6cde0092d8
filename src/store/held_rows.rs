//! The stored shape of what a held run keeps until an operator resolves it: its staged
//! parcels (`held_parcels`) and its change events (`held_events`). Record version 2
//! (schema 8) added the parcel's revision and last announcement to staged parcels
//! (`ParcelState::revision`, `ParcelState::announced`) and the key revision to events
//! (`ChangeEvent::revision`), so that releasing a hold claims the keys the run would have
//! claimed had it not been held. Rows of either version are read (a version 1 row as
//! revision 0, the keys a zonewatch of that time gave them); every row this build writes is
//! version 2.

use super::codec::{decode_migrating, encode_versioned};
use super::snapshot::ParcelStateV1;
use crate::model::{ChangeEvent, ChangeKind, ParcelState, Severity, StoredGeometry};
use serde::{Deserialize, Serialize};

/// The version byte of staged parcels and held events written now.
pub const HELD_RECORD_VERSION: u8 = 2;

/// The record family a decoding error names.
const STAGED_FAMILY: &str = "held parcels";
const EVENTS_FAMILY: &str = "held events";

/// One staged parcel of a held run: `None` removes the parcel.
#[derive(Serialize, Deserialize)]
pub(super) struct StagedParcel(pub Option<(ParcelState, StoredGeometry)>);

/// [`StagedParcel`] written from borrowed parts: serde encodes a reference as what it
/// refers to, so the bytes are the same.
#[derive(Serialize)]
struct StagedParcelRef<'a>(Option<(&'a ParcelState, &'a StoredGeometry)>);

/// [`StagedParcel`] as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct StagedParcelV1(Option<(ParcelStateV1, StoredGeometry)>);

impl From<StagedParcelV1> for StagedParcel {
    fn from(v: StagedParcelV1) -> Self {
        StagedParcel(v.0.map(|(state, geometry)| (state.into(), geometry)))
    }
}

/// The row of a staged upsert (`Some`) or removal (`None`).
pub(super) fn encode_staged(parcel: Option<(&ParcelState, &StoredGeometry)>) -> Vec<u8> {
    encode_versioned(HELD_RECORD_VERSION, &StagedParcelRef(parcel))
}

pub(super) fn decode_staged(bytes: &[u8]) -> Result<StagedParcel, String> {
    decode_migrating::<StagedParcelV1, _>(bytes, HELD_RECORD_VERSION, STAGED_FAMILY)
}

/// `ChangeEvent` as record version 1 wrote it.
#[derive(Serialize, Deserialize)]
struct ChangeEventV1 {
    source_id: String,
    jurisdiction: String,
    parcel_id: String,
    kind: ChangeKind,
    from: Option<String>,
    to: Option<String>,
    effective_date: Option<String>,
    old_geometry: Option<StoredGeometry>,
    new_geometry: Option<StoredGeometry>,
    area_m2: f64,
    observed_at_ms: u64,
    severity: Severity,
}

impl From<ChangeEventV1> for ChangeEvent {
    fn from(v: ChangeEventV1) -> Self {
        ChangeEvent {
            source_id: v.source_id,
            jurisdiction: v.jurisdiction,
            parcel_id: v.parcel_id,
            kind: v.kind,
            from: v.from,
            to: v.to,
            effective_date: v.effective_date,
            old_geometry: v.old_geometry,
            new_geometry: v.new_geometry,
            area_m2: v.area_m2,
            observed_at_ms: v.observed_at_ms,
            severity: v.severity,
            revision: 0,
        }
    }
}

pub(super) fn encode_held_event(event: &ChangeEvent) -> Vec<u8> {
    encode_versioned(HELD_RECORD_VERSION, event)
}

pub(super) fn decode_held_event(bytes: &[u8]) -> Result<ChangeEvent, String> {
    decode_migrating::<ChangeEventV1, _>(bytes, HELD_RECORD_VERSION, EVENTS_FAMILY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::sample_event;
    use crate::store::codec::encode;

    fn state(revision: u32) -> ParcelState {
        ParcelState { zoning: "R-1".into(), effective_date: Some("2026-01-01".into()), content_hash: [1; 32], geom_hash: [2; 32], area_m2: 3.5, revision, announced: None }
    }

    /// Staging from borrowed parts writes the bytes `StagedParcel` reads back.
    #[test]
    fn a_staged_parcel_encodes_the_same_from_borrowed_parts() {
        let g = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
        let owned = encode_versioned(HELD_RECORD_VERSION, &StagedParcel(Some((state(2), g.clone()))));
        assert_eq!(encode_staged(Some((&state(2), &g))), owned);
        assert_eq!(encode_staged(None), encode_versioned(HELD_RECORD_VERSION, &StagedParcel(None)));
    }

    /// Rows a schema 7 zonewatch staged (record version 1) read as revision 0, field for
    /// field; rows written now keep their revision; an unknown version is an error naming it.
    #[test]
    fn held_rows_of_either_version_read_back() {
        let g = StoredGeometry(vec![vec![vec![[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]]]);
        let s = state(0);
        let v1 = ParcelStateV1::of(&s);
        let old = decode_staged(&encode(&StagedParcelV1(Some((v1, g.clone()))))).unwrap();
        assert_eq!(old.0, Some((s, g.clone())));
        assert_eq!(decode_staged(&encode(&StagedParcelV1(None))).unwrap().0, None);
        let now = decode_staged(&encode_staged(Some((&state(7), &g)))).unwrap();
        assert_eq!(now.0, Some((state(7), g)));
        assert_eq!(decode_staged(&encode_staged(None)).unwrap().0, None);

        let mut e = sample_event("P-1");
        let e1 = ChangeEventV1 {
            source_id: e.source_id.clone(),
            jurisdiction: e.jurisdiction.clone(),
            parcel_id: e.parcel_id.clone(),
            kind: e.kind,
            from: e.from.clone(),
            to: e.to.clone(),
            effective_date: e.effective_date.clone(),
            old_geometry: None,
            new_geometry: None,
            area_m2: e.area_m2,
            observed_at_ms: e.observed_at_ms,
            severity: e.severity,
        };
        assert_eq!(decode_held_event(&encode(&e1)).unwrap(), e);
        e.revision = 3;
        assert_eq!(decode_held_event(&encode_held_event(&e)).unwrap(), e);
        let mut future = encode_held_event(&e);
        future[0] = 9;
        assert!(decode_held_event(&future).unwrap_err().contains("version 9"));
    }
}
