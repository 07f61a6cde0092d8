//! Domain types shared by every layer: what a parcel looks like once normalised, what a change
//! is, and the records the store keeps (watermarks, runs, holds, outbox rows, audit rows).
//! They are plain data so that `store/` can encode them and `ingest/`, `detect/` and `notify/`
//! can pass them along without knowing about each other.

use geo::{Coord, LineString, MultiPolygon, Polygon};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How much a change matters to a subscriber. Ordered: `Info < Notice < Material < Critical`.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Hash)]
pub enum Severity {
    Info,
    Notice,
    Material,
    Critical,
}

impl Severity {
    /// Every severity, lowest first (the OpenAPI document's webhook schema lists them).
    pub const ALL: [Severity; 4] = [Severity::Info, Severity::Notice, Severity::Material, Severity::Critical];

    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Notice => "notice",
            Severity::Material => "material",
            Severity::Critical => "critical",
        }
    }
    pub fn parse(s: &str) -> Option<Severity> {
        match s.trim().to_ascii_lowercase().as_str() {
            "info" => Some(Severity::Info),
            "notice" => Some(Severity::Notice),
            "material" => Some(Severity::Material),
            "critical" => Some(Severity::Critical),
            _ => None,
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happened to one parcel between two versions of a layer.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Hash)]
pub enum ChangeKind {
    /// The zoning code changed.
    Rezoned,
    /// The parcel id is new in this version.
    Added,
    /// The parcel id disappeared from this version.
    Removed,
    /// Same zoning code, different shape.
    GeometryChanged,
    /// Area mode (district layer, no parcel base): a connected region changed code.
    AreaRezoned,
    /// An overlay district now covers a meaningful share of the parcel.
    OverlayAdded,
    /// An overlay district no longer covers a meaningful share of the parcel.
    OverlayRemoved,
}

impl ChangeKind {
    /// Every kind of change a webhook can carry (the OpenAPI document's webhook schema).
    pub const ALL: [ChangeKind; 7] = [
        ChangeKind::Rezoned,
        ChangeKind::Added,
        ChangeKind::Removed,
        ChangeKind::GeometryChanged,
        ChangeKind::AreaRezoned,
        ChangeKind::OverlayAdded,
        ChangeKind::OverlayRemoved,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Rezoned => "rezoned",
            ChangeKind::Added => "added",
            ChangeKind::Removed => "removed",
            ChangeKind::GeometryChanged => "geometry_changed",
            ChangeKind::AreaRezoned => "area_rezoned",
            ChangeKind::OverlayAdded => "overlay_added",
            ChangeKind::OverlayRemoved => "overlay_removed",
        }
    }
}

impl fmt::Display for ChangeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A (multi)polygon as stored: polygons → rings → `[lon, lat]` positions, rings closed.
/// Kept separate from `geo::MultiPolygon` so its encoding is ours and stable.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug, Default)]
pub struct StoredGeometry(pub Vec<Vec<Vec<[f64; 2]>>>);

/// An axis-aligned rectangle as `(min, max)` corners, `[lon, lat]` each.
pub type Envelope = ([f64; 2], [f64; 2]);

/// Grows `acc` to take in `p`.
fn extend_envelope(acc: &mut Option<Envelope>, p: [f64; 2]) {
    *acc = Some(match *acc {
        None => (p, p),
        Some((lo, hi)) => ([lo[0].min(p[0]), lo[1].min(p[1])], [hi[0].max(p[0]), hi[1].max(p[1])]),
    });
}

impl StoredGeometry {
    /// The bounding rectangle of the exterior rings, as `geo` computes it for the
    /// [`StoredGeometry::to_geo`] form (parts without rings dropped, holes not looked at);
    /// `None` when there is no exterior point. Stored coordinates are finite (ingest
    /// quarantines NaN and infinite ones); a NaN would be skipped here where geo's rectangle
    /// would turn NaN.
    pub fn exterior_envelope(&self) -> Option<Envelope> {
        let mut acc = None;
        for p in self.0.iter().filter_map(|rings| rings.first()).flatten() {
            extend_envelope(&mut acc, *p);
        }
        acc
    }

    pub fn from_geo(mp: &MultiPolygon<f64>) -> Self {
        StoredGeometry(
            mp.0.iter()
                .map(|p| {
                    std::iter::once(p.exterior())
                        .chain(p.interiors())
                        .map(|ring| ring.0.iter().map(|c| [c.x, c.y]).collect())
                        .collect()
                })
                .collect(),
        )
    }

    pub fn to_geo(&self) -> MultiPolygon<f64> {
        MultiPolygon::new(
            self.0
                .iter()
                .filter(|rings| !rings.is_empty())
                .map(|rings| {
                    let mut it = rings.iter().map(|r| {
                        LineString::new(r.iter().map(|p| Coord { x: p[0], y: p[1] }).collect())
                    });
                    let exterior = it.next().unwrap_or_else(|| LineString::new(vec![]));
                    Polygon::new(exterior, it.collect())
                })
                .collect(),
        )
    }

    /// GeoJSON geometry object (`MultiPolygon`, or `Polygon` when there is one part).
    pub fn to_geojson(&self) -> serde_json::Value {
        serde_json::to_value(self.geojson()).unwrap_or(serde_json::Value::Null)
    }

    /// The same GeoJSON object as [`StoredGeometry::to_geojson`], serialised straight from
    /// the coordinates: a webhook body is built at every attempt, and building a JSON value
    /// tree first cost an allocation per position.
    pub fn geojson(&self) -> GeoJsonGeometry<'_> {
        GeoJsonGeometry(self)
    }
}

/// A [`StoredGeometry`]'s [`StoredGeometry::exterior_envelope`], read from its serialised
/// form without building it: no allocation. A run's commit asks this of every new
/// parcel to find the few whose envelope touches a subscriber's; only those are decoded.
pub struct ExteriorEnvelope(pub Option<Envelope>);

impl<'de> Deserialize<'de> for ExteriorEnvelope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{DeserializeSeed, SeqAccess, Visitor};
        /// Positions of one ring, folded into the envelope or (`fold: false`) only read.
        struct Ring<'a> {
            acc: &'a mut Option<Envelope>,
            fold: bool,
        }
        impl<'de> DeserializeSeed<'de> for Ring<'_> {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_seq(self)
            }
        }
        impl<'de> Visitor<'de> for Ring<'_> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a ring of positions")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                while let Some(p) = seq.next_element::<[f64; 2]>()? {
                    if self.fold {
                        extend_envelope(self.acc, p);
                    }
                }
                Ok(())
            }
        }
        /// The rings of one polygon: its first (exterior) folded.
        struct Rings<'a>(&'a mut Option<Envelope>);
        impl<'de> DeserializeSeed<'de> for Rings<'_> {
            type Value = ();
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_seq(self)
            }
        }
        impl<'de> Visitor<'de> for Rings<'_> {
            type Value = ();
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a polygon's rings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                let mut fold = true;
                while seq.next_element_seed(Ring { acc: &mut *self.0, fold })?.is_some() {
                    fold = false;
                }
                Ok(())
            }
        }
        /// The geometry: a newtype around its polygons.
        struct Polygons;
        impl<'de> Visitor<'de> for Polygons {
            type Value = Option<Envelope>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a stored geometry")
            }
            fn visit_newtype_struct<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_seq(self)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut acc = None;
                while seq.next_element_seed(Rings(&mut acc))?.is_some() {}
                Ok(acc)
            }
        }
        d.deserialize_newtype_struct("StoredGeometry", Polygons).map(ExteriorEnvelope)
    }
}

/// A [`StoredGeometry`] serialised as a GeoJSON geometry object, keys in the order
/// `to_geojson` has always written them (sorted: `coordinates`, then `type`), so a body
/// built by either is the same bytes.
pub struct GeoJsonGeometry<'a>(&'a StoredGeometry);

impl Serialize for GeoJsonGeometry<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(2))?;
        match self.0 .0.as_slice() {
            [polygon] => {
                map.serialize_entry("coordinates", polygon)?;
                map.serialize_entry("type", "Polygon")?;
            }
            parts => {
                map.serialize_entry("coordinates", parts)?;
                map.serialize_entry("type", "MultiPolygon")?;
            }
        }
        map.end()
    }
}

/// The stored state of one parcel in a source's snapshot (its row holds the geometry after it).
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct ParcelState {
    /// Zoning code as published (trimmed). Compared case-insensitively.
    pub zoning: String,
    pub effective_date: Option<String>,
    /// Canonical hash of zoning + effective date + geometry: equal hashes mean "no change".
    pub content_hash: [u8; 32],
    /// Canonical hash of the geometry alone, to tell `rezoned` from `geometry_changed`.
    pub geom_hash: [u8; 32],
    /// Geodesic area in square metres.
    pub area_m2: f64,
    /// How many changes of this parcel id were announced (committed by a run that delivers,
    /// as opposed to a baseline, a reprocess or a primed hold) since this store first stored
    /// it: the revision a key of its next change carries (`notify::idem`). 0 for a parcel as
    /// its first ingest found it. Records written before it existed read as 0.
    pub revision: u32,
    /// What subscribers were last told of this parcel, when a change was announced: its
    /// content then and the revision its key carried. A change back to that content (after
    /// an unannounced detour: a restatement primed, a reprocess) gets that key again, so it
    /// is a `duplicate`, not news. See [`crate::detect::diff::step`].
    pub announced: Option<Announced>,
}

/// The last announced state of a parcel (or its removal): see [`ParcelState::announced`].
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub struct Announced {
    /// The first 16 bytes of the announced state's content hash ([`ABSENT_CONTENT`] for a
    /// removal).
    pub content: [u8; 16],
    /// The revision the announcing change's key carried.
    pub key_revision: u32,
}

/// The content an announced removal leaves in [`Announced::content`] (no content hash is all
/// zeros in practice: a sha256 prefix).
pub const ABSENT_CONTENT: [u8; 16] = [0; 16];

/// One parcel as read from a feed, normalised and validated.
#[derive(Clone, Debug)]
pub struct Parcel {
    pub id: String,
    pub state: ParcelState,
    pub geometry: StoredGeometry,
}

/// A parcel borrowed from wherever it is held (a run's upserts, a spilled chunk): what the
/// snapshot and the staging rows are written from, without copying it first.
#[derive(Clone, Copy, Debug)]
pub struct ParcelRef<'a> {
    /// The parcel id (the snapshot's key within its source).
    pub id: &'a str,
    /// What the diff compares: zoning, effective date, hashes, area.
    pub state: &'a ParcelState,
    /// The normalised geometry, as stored.
    pub geometry: &'a StoredGeometry,
}

impl Parcel {
    /// This parcel as a [`ParcelRef`], for writing it to the store.
    pub fn borrowed(&self) -> ParcelRef<'_> {
        ParcelRef { id: &self.id, state: &self.state, geometry: &self.geometry }
    }
}

/// A real change to one parcel, detected by the diff. Subscriber-independent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ChangeEvent {
    pub source_id: String,
    pub jurisdiction: String,
    pub parcel_id: String,
    pub kind: ChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    pub effective_date: Option<String>,
    pub old_geometry: Option<StoredGeometry>,
    pub new_geometry: Option<StoredGeometry>,
    /// Geodesic area (m²) of the current parcel (the old one for `removed`).
    pub area_m2: f64,
    pub observed_at_ms: u64,
    pub severity: Severity,
    /// The revision its idempotency key carries (part of the key when not 0): the parcel's
    /// [`ParcelState::revision`] before the change, or, for a change back to what
    /// subscribers were last told, the revision of the key that told them
    /// ([`crate::detect::diff::step`]). Events held before it existed read as 0.
    pub revision: u32,
}

impl ChangeEvent {
    /// The geometry a subscriber is shown: the new shape, or the old one for a removal.
    pub fn display_geometry(&self) -> Option<&StoredGeometry> {
        self.new_geometry.as_ref().or(self.old_geometry.as_ref())
    }
}

/// The first attempt of outbox row `row` (key `key`) at `ts_ms`, with `result` (`sent`: a
/// 200, anything else: a 500), for unit tests.
#[cfg(test)]
pub(crate) fn sample_attempt(key: &str, row: u64, result: &str, ts_ms: u64) -> AttemptRecord {
    AttemptRecord {
        key: key.into(),
        outbox_id: row,
        attempt: 1,
        ts_ms,
        duration_ms: 1,
        status: Some(if result == "sent" { 200 } else { 500 }),
        result: result.into(),
        error: None,
        response_head: String::new(),
        next_attempt_ms: None,
        target: None,
        decided_ms: None,
    }
}

/// An audit row of source `s` with `outcome` and nothing else, for unit tests.
#[cfg(test)]
pub(crate) fn sample_audit_row(seq: u64, outcome: Outcome) -> AuditRow {
    AuditRow {
        seq,
        ts_ms: 1,
        outcome,
        idempotency_key: None,
        watcher_id: None,
        source_id: Some("s".into()),
        parcel_id: None,
        lineage_id: None,
        detail: String::new(),
    }
}

/// A `rezoned` R-1 → C-2 event of parcel `parcel` without geometry, for unit tests.
#[cfg(test)]
pub(crate) fn sample_event(parcel: &str) -> ChangeEvent {
    ChangeEvent {
        source_id: "s".into(),
        jurisdiction: "j".into(),
        parcel_id: parcel.into(),
        kind: ChangeKind::Rezoned,
        from: Some("R-1".into()),
        to: Some("C-2".into()),
        effective_date: None,
        old_geometry: None,
        new_geometry: None,
        area_m2: 1.0,
        observed_at_ms: 0,
        severity: Severity::Critical,
        revision: 0,
    }
}

/// Idempotency key: hex sha256 over the stable fields of (watcher, change). Never volatile.
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct IdemKey(pub String);

impl fmt::Display for IdemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Terminal and intermediate outcomes recorded in the audit ledger.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Outcome {
    Queued,
    Sent,
    Duplicate,
    Suppressed,
    DeadLetter,
    Quarantined,
    Held,
    /// An endpoint was disabled (HTTP 410, failing longer than `disable_after`).
    EndpointDisabled,
    /// An operator re-enabled an endpoint.
    EndpointEnabled,
    /// An operator took a quarantined dead letter back to the dead letters (`dlq release`).
    Released,
}

impl Outcome {
    /// Every outcome, in the order the API documents them: the control port's `outcome`
    /// filter and its OpenAPI enum are built from this list, so neither can miss one.
    pub const ALL: [Outcome; 10] = [
        Outcome::Queued,
        Outcome::Sent,
        Outcome::Duplicate,
        Outcome::Suppressed,
        Outcome::DeadLetter,
        Outcome::Quarantined,
        Outcome::Held,
        Outcome::EndpointDisabled,
        Outcome::EndpointEnabled,
        Outcome::Released,
    ];

    /// A comma-separated list of outcome names (the control port's and `zonewatch audit`'s
    /// `outcome` filter); an unknown name is refused with the list of known ones.
    pub fn parse_list(list: &str) -> Result<Vec<Outcome>, String> {
        list.split(',')
            .map(str::trim)
            .map(|name| {
                Outcome::ALL.into_iter().find(|o| o.as_str() == name).ok_or_else(|| {
                    format!("outcome {name:?} is not one of {}", Outcome::ALL.map(Outcome::as_str).join(", "))
                })
            })
            .collect()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Queued => "queued",
            Outcome::Sent => "sent",
            Outcome::Duplicate => "duplicate",
            Outcome::Suppressed => "suppressed",
            Outcome::DeadLetter => "dead_letter",
            Outcome::Quarantined => "quarantined",
            Outcome::Held => "held",
            Outcome::EndpointDisabled => "endpoint_disabled",
            Outcome::EndpointEnabled => "endpoint_enabled",
            Outcome::Released => "released",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One immutable row of the audit ledger. `seq` is the ledger's monotonic key.
/// `store::runs::AuditRowRef` writes the same row from borrowed text: keep the two in step.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct AuditRow {
    pub seq: u64,
    pub ts_ms: u64,
    pub outcome: Outcome,
    pub idempotency_key: Option<String>,
    pub watcher_id: Option<String>,
    pub source_id: Option<String>,
    pub parcel_id: Option<String>,
    pub lineage_id: Option<String>,
    pub detail: String,
}

impl AuditRow {
    /// An audit row about one outbox entry (its key, watcher, source, parcel and lineage).
    pub fn for_entry(entry: &OutboxEntry, outcome: Outcome, ts_ms: u64, detail: String) -> AuditRow {
        AuditRow {
            seq: 0,
            ts_ms,
            outcome,
            idempotency_key: Some(entry.key.0.clone()),
            watcher_id: Some(entry.watcher_id.clone()),
            source_id: Some(entry.source_id.clone()),
            parcel_id: Some(entry.parcel_id.clone()),
            lineage_id: Some(entry.lineage_id.clone()),
            detail,
        }
    }
}

/// A webhook waiting to be delivered. What it says is fixed when the key is claimed
/// ([`OutboxPayload`]), so a retry sends the same bytes; the signature and
/// `webhook-timestamp` are made at each attempt.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct OutboxEntry {
    pub id: u64,
    pub key: IdemKey,
    pub watcher_id: String,
    pub target: String,
    pub source_id: String,
    pub parcel_id: String,
    pub lineage_id: String,
    pub severity: Severity,
    pub payload: OutboxPayload,
    pub attempts: u32,
    pub created_ms: u64,
    pub next_attempt_ms: u64,
    pub last_error: Option<String>,
}

impl OutboxEntry {
    /// The webhook body: the same bytes for every attempt of this entry.
    pub fn body(&self) -> Vec<u8> {
        match &self.payload {
            OutboxPayload::Built(body) => body.clone(),
            OutboxPayload::Change(change) => crate::notify::payload::body_for(self, change),
        }
    }
}

/// What an outbox row's webhook says. Rows keep the change's own fields and the body is
/// built from them at send time: a pre-built JSON body was ~1.2 KB a row, written and
/// fsync'd at claim time, and building it was a tenth of the claim commit (issue 7). The
/// build is deterministic, so every attempt sends the same bytes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum OutboxPayload {
    /// A body built when the row was queued (rows written before record version 2).
    Built(Vec<u8>),
    /// The change's fields; the body is built from them by `notify::payload`.
    Change(ChangeFields),
}

/// The subscriber-independent fields of a change that its webhook body shows, as queued.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ChangeFields {
    pub jurisdiction: String,
    pub kind: ChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    pub effective_date: Option<String>,
    pub observed_at_ms: u64,
    /// Rounded to 0.1 m², as the body shows it.
    pub area_m2: f64,
    /// The shape shown: the new one, or the old one for a removal.
    pub geometry: Option<StoredGeometry>,
    /// When the key was claimed (kept across dead-letter replays): a held change's release.
    /// Shown as the body's `timestamp` before December 2026; the body shows `observed_at` now,
    /// as the README always said (a black-box tester: a released hold's alerts differed).
    pub queued_ms: u64,
}

impl ChangeFields {
    pub fn of(event: &ChangeEvent, queued_ms: u64) -> Self {
        ChangeFields {
            jurisdiction: event.jurisdiction.clone(),
            kind: event.kind,
            from: event.from.clone(),
            to: event.to.clone(),
            effective_date: event.effective_date.clone(),
            observed_at_ms: event.observed_at_ms,
            area_m2: (event.area_m2 * 10.0).round() / 10.0,
            geometry: event.display_geometry().cloned(),
            queued_ms,
        }
    }
}

/// An outbox entry that will not be delivered without a person: kept until resolved.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct DeadLetter {
    pub entry: OutboxEntry,
    pub reason: String,
    pub dead_at_ms: u64,
}

/// Why a feature could not be taken into the snapshot.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum QuarantineReason {
    MissingField,
    OutOfBounds,
    DuplicateId,
    NonFinite,
    EmptyGeometry,
    NotPolygonal,
    InvalidGeometry,
    Unrepairable,
    MalformedFeature,
    /// An id, a zoning or district code or an effective date past
    /// `ingest::normalize::MAX_FIELD_BYTES`: a field pointed at a long text column most often
    /// (so systemic, as a missing one), else a broken or hostile feed. Last, so the stored
    /// index of every older reason stays.
    FieldTooLong,
}

impl QuarantineReason {
    pub fn as_str(self) -> &'static str {
        match self {
            QuarantineReason::MissingField => "missing_field",
            QuarantineReason::OutOfBounds => "out_of_bounds",
            QuarantineReason::DuplicateId => "duplicate_id",
            QuarantineReason::NonFinite => "non_finite",
            QuarantineReason::EmptyGeometry => "empty_geometry",
            QuarantineReason::NotPolygonal => "not_polygonal",
            QuarantineReason::InvalidGeometry => "invalid_geometry",
            QuarantineReason::Unrepairable => "unrepairable",
            QuarantineReason::MalformedFeature => "malformed_feature",
            QuarantineReason::FieldTooLong => "field_too_long",
        }
    }

    /// Reasons that point at a systematic feed problem (a renamed field, a datum drift)
    /// rather than one bad feature: these count towards the quarantine-spike gate. (A
    /// feature without a polygon is not one of them: a tax roll may carry condo units without
    /// geometry in every version. A stored parcel that loses its polygon counts toward the
    /// change spike instead, `gate::Silent::Unreadable`.)
    pub fn is_systemic(self) -> bool {
        matches!(self, QuarantineReason::MissingField | QuarantineReason::OutOfBounds | QuarantineReason::FieldTooLong)
    }
}

/// A feature set aside with its reason; the rest of the layer carries on without it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct QuarantineRecord {
    pub source_id: String,
    pub run_id: u64,
    pub lineage_id: String,
    pub feature_index: u64,
    pub parcel_id: Option<String>,
    pub reason: QuarantineReason,
    pub detail: String,
    /// The feature's JSON, truncated to 16 KiB.
    pub raw: String,
    pub ts_ms: u64,
}

/// What one run concluded about a source.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verdict {
    /// First ingest: snapshot stored, keys primed, nothing sent.
    Baseline,
    /// New content diffed and committed; alerts queued.
    Run,
    /// Same bytes as the watermark's digest: nothing to do.
    Identical,
    /// Probe said nothing moved (HTTP sources).
    Skip,
    /// Held by the publication gate until an operator decides.
    Held,
    /// `--reprocess`: committed with keys primed and nothing sent. Also a hold resolved by
    /// priming it. A source's first ingest is a `Baseline` in both cases (and when run as a
    /// `--reprocess`).
    Reprocessed,
    /// The run failed before committing; nothing of it exists but this record.
    Failed,
    /// Triggered while a run of the same source was still going: not run.
    SkippedOverlap,
}

impl Verdict {
    /// Whether a committed run of this verdict primed its keys and sent nothing: a first
    /// ingest, a `--reprocess`, and a hold resolution that primed (whether an operator asked
    /// for it, or the held run was a first ingest or a `--reprocess`).
    pub fn primed(self) -> bool {
        matches!(self, Verdict::Baseline | Verdict::Reprocessed)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Baseline => "baseline",
            Verdict::Run => "run",
            Verdict::Identical => "identical",
            Verdict::Skip => "skip",
            Verdict::Held => "held",
            Verdict::Reprocessed => "reprocessed",
            Verdict::Failed => "failed",
            Verdict::SkippedOverlap => "skipped_overlap",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per source: what was last consumed. The watermark never describes data not yet committed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct Watermark {
    pub digest: String,
    pub size: u64,
    pub run_id: u64,
    pub consumed_at_ms: u64,
    /// When the content (digest) last changed.
    pub content_changed_at_ms: u64,
    pub publisher_ts_ms: Option<u64>,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    /// Fingerprint of how the bytes were read (field mapping, bbox): the same bytes read
    /// with a different mapping are not "identical".
    pub read_fingerprint: String,
    /// ArcGIS: hash of the layer's `fields[]` (names and types) at the last fetch.
    pub schema_hash: Option<String>,
    /// The publisher timestamp the portal reported at the last fetch, when it is older than
    /// `publisher_ts_ms`: the same content came under an older timestamp, and the watermark
    /// keeps the newer one (so older content under the older timestamp is still seen as
    /// restated). The probe compares against this one ([`Watermark::probe_ts`]): while the
    /// portal keeps saying it, nothing moved, and the run is a `skip`. Record version 2.
    pub probe_ts_ms: Option<u64>,
}

/// How far ahead of this machine's clock a publisher timestamp may be and still be taken as
/// the version's time. Portals and this machine disagree by seconds to hours (clock drift, a
/// local time written as UTC); a timestamp further ahead is a publisher's clock or data error
/// (a year-2099 `lastEditDate`), and believing it would make every later, honest version look
/// restated (older than the watermark's) and be held until an operator steps in.
pub const PUBLISHER_CLOCK_SKEW_MS: u64 = 24 * 3_600_000;

impl Watermark {
    /// The watermark a run that read `digest` (`size` bytes) at `now_ms` commits. The time the
    /// content last changed carries over from `previous` when the digest is the same.
    pub fn for_read(digest: &str, size: u64, now_ms: u64, previous: Option<&Watermark>, read_fingerprint: String) -> Watermark {
        Watermark {
            digest: digest.to_string(),
            size,
            run_id: 0,
            consumed_at_ms: now_ms,
            content_changed_at_ms: match previous {
                Some(w) if w.digest == digest => w.content_changed_at_ms,
                _ => now_ms,
            },
            publisher_ts_ms: None,
            etag: None,
            last_modified: None,
            read_fingerprint,
            schema_hash: None,
            probe_ts_ms: None,
        }
    }

    /// True when publisher timestamp `ts_ms` is further ahead of `now_ms` than
    /// [`PUBLISHER_CLOCK_SKEW_MS`]: a time that cannot have happened yet, so no evidence of
    /// which version is newer.
    pub fn from_the_future(ts_ms: u64, now_ms: u64) -> bool {
        ts_ms > now_ms.saturating_add(PUBLISHER_CLOCK_SKEW_MS)
    }

    /// The "now" a publisher timestamp is held against: this machine's clock, or the time this
    /// watermark was consumed if that is later (a clock set back, an edge box without a
    /// real-time clock booting at an old time, must not make every honest timestamp look
    /// like one from the future and so turn restatement holds off).
    pub fn clock_floor(prev: Option<&Watermark>, now_ms: u64) -> u64 {
        prev.map_or(now_ms, |w| now_ms.max(w.consumed_at_ms))
    }

    /// The run's warning when a publisher timestamp is [`Watermark::from_the_future`]: the
    /// portal's `new` one (recorded, so its probe can still tell "nothing moved", but not
    /// trusted to order versions), or the watermark's `old` one that `new` went back from (no
    /// restatement).
    pub fn future_timestamp_warning(old: Option<u64>, new: u64, now_ms: u64) -> Option<String> {
        let now = crate::util::rfc3339(now_ms);
        if Self::from_the_future(new, now_ms) {
            return Some(format!(
                "publisher timestamp {} is more than a day ahead of this machine's clock ({now}): recorded, but not trusted to order versions",
                crate::util::rfc3339(new)
            ));
        }
        let old = old.filter(|&old| new < old && Self::from_the_future(old, now_ms))?;
        Some(format!(
            "publisher timestamp went back to {} from {}, which was more than a day ahead of this machine's clock ({now}): not held as a restatement",
            crate::util::rfc3339(new),
            crate::util::rfc3339(old)
        ))
    }

    /// The publisher timestamp the portal reported at the last fetch: what a probe that
    /// finds nothing moved reports again. None for a read whose removals were withheld
    /// ([`Watermark::withheld`]): the next run must read the layer, not skip it.
    pub fn probe_ts(&self) -> Option<u64> {
        if self.withheld() {
            return None;
        }
        self.probe_ts_ms.or(self.publisher_ts_ms)
    }

    /// What the digest of a read whose removals were withheld ends with
    /// (`Engine::confirm_removals`): no digest of bytes ends so, so no read is settled by it.
    pub const WITHHELD_MARK: &'static str = "~removals-withheld";

    /// Whether this read's removals were withheld (its digest carries [`Self::WITHHELD_MARK`]).
    pub fn withheld(&self) -> bool {
        self.digest.ends_with(Self::WITHHELD_MARK)
    }

    /// The digest of the bytes read, without the withheld mark (a watermark's or a hold's).
    pub fn bytes_digest(digest: &str) -> &str {
        digest.strip_suffix(Self::WITHHELD_MARK).unwrap_or(digest)
    }
}

/// Counts a run produced; also what `run` prints per source.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct RunCounts {
    pub features: u64,
    pub parcels: u64,
    pub quarantined: u64,
    pub repaired: u64,
    pub changes: u64,
    pub queued: u64,
    pub duplicates: u64,
    pub suppressed: u64,
    pub below_min_severity: u64,
}

/// The record of one run of one source (small). Kept for good when the run committed data or
/// was held; one that committed nothing for `[store] run_retention` (`store/run_retention.rs`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RunRecord {
    pub run_id: u64,
    pub source_id: String,
    pub lineage_id: String,
    pub started_ms: u64,
    pub finished_ms: u64,
    pub verdict: Verdict,
    pub digest: String,
    pub counts: RunCounts,
    /// The hold this run created or is waiting on.
    pub hold_id: Option<u64>,
    pub warnings: Vec<String>,
    pub error: Option<String>,
}

/// What became of a held run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum HoldState {
    Open,
    Released { at_ms: u64, run_id: u64 },
    Primed { at_ms: u64, run_id: u64 },
    Superseded { at_ms: u64, by_run: u64 },
}

impl HoldState {
    /// Every [`HoldState::label`].
    pub const LABELS: [&'static str; 4] = ["open", "released", "primed", "superseded"];

    pub fn label(&self) -> &'static str {
        match self {
            HoldState::Open => "open",
            HoldState::Released { .. } => "released",
            HoldState::Primed { .. } => "primed",
            HoldState::Superseded { .. } => "superseded",
        }
    }
}

/// A run the publication gate stopped. Its staged snapshot delta and change events are kept
/// beside it until an operator releases (deliver) or primes (accept silently) it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Hold {
    pub run_id: u64,
    pub source_id: String,
    pub lineage_id: String,
    pub created_ms: u64,
    pub reason: String,
    pub state: HoldState,
    pub digest: String,
    /// The watermark the source gets if the hold is released or primed.
    pub watermark: Watermark,
    pub changes: u64,
    pub features: u64,
    /// The held run was a `--reprocess` (it sends nothing): releasing it primes, as the
    /// operator asked when running it. Hold record version 3 (older rows read as `false`,
    /// `store::watermark_rows`).
    pub reprocess: bool,
}

/// One delivery attempt as logged: kept per idempotency key so an operator can see exactly
/// what each try of an event got back (`zonewatch dlq show`, `zonewatch attempts`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct AttemptRecord {
    pub key: String,
    pub outbox_id: u64,
    /// 1-based attempt number.
    pub attempt: u32,
    pub ts_ms: u64,
    pub duration_ms: u64,
    /// HTTP status, when a response came back.
    pub status: Option<u16>,
    /// `sent`, `retry` or `dead_letter`.
    pub result: String,
    /// Timeout, connection error, refusal reason or dead-letter reason.
    pub error: Option<String>,
    /// The first 2 KiB of the response body (lossy UTF-8).
    pub response_head: String,
    /// When the next try is due (retries only).
    pub next_attempt_ms: Option<u64>,
    /// The target a try was sent to, for the outcome commit only (not stored: the stored bytes
    /// are unchanged). A 410 from a target that is no longer the subscriber's (a `PUT` moved
    /// it while the request was in flight) does not disable the endpoint, and an endpoint
    /// disabled remembers the target it was disabled for.
    #[serde(skip)]
    pub target: Option<String>,
    /// The clock a retry's `next_attempt_ms` was computed on, for the outcome commit only (not
    /// stored): a clock that stepped back before that commit shows as this time ahead of the
    /// commit's (`store::clock_step::retry_due`).
    #[serde(skip)]
    pub decided_ms: Option<u64>,
}

/// The health of one subscriber endpoint, kept by the store: a disabled endpoint's events wait
/// in the outbox; an open circuit breaker holds them until its cool-down ends.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct EndpointState {
    pub disabled: bool,
    pub disabled_reason: Option<String>,
    pub disabled_at_ms: Option<u64>,
    pub last_success_ms: Option<u64>,
    /// First failure since the last success (drives `disable_after`).
    pub failing_since_ms: Option<u64>,
    /// Recent attempt outcomes, newest last (true = success), at most 20.
    pub recent: Vec<bool>,
    /// Breaker open until then; after it one half-open probe is let through.
    pub breaker_open_until_ms: Option<u64>,
}
