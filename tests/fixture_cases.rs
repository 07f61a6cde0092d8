//! The hand-made hostile layer in `fixtures/cases/`: every feature is accounted for, nothing
//! panics, and the good features ingest.

mod common;
use common::*;
use std::collections::BTreeMap;

#[test]
fn hostile_layer_is_fully_accounted_for() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/cases");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("hostile-layer.expected.json")).unwrap()).unwrap();
    let ws = Workspace::new(&[], "", "");
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    ws.write_layer(&std::fs::read_to_string(root.join("hostile-layer.geojson")).unwrap());
    let engine = ws.engine();
    let r = run(&engine, false);
    let c = &r.record.counts;
    assert_eq!(c.features, expected["features"].as_u64().unwrap());
    assert_eq!(c.quarantined, expected["quarantined_total"].as_u64().unwrap());
    assert_eq!(c.parcels + c.quarantined, c.features, "every feature accounted for");

    let mut snapshot: Vec<String> = engine.store.snapshot_states("s1").unwrap().into_keys().collect();
    snapshot.sort();
    let want: Vec<String> = expected["snapshot"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert_eq!(snapshot, want);
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["12345"].zoning, "r-1", "trimmed, case kept");
    assert_eq!(c.repaired, expected["repaired"].as_array().unwrap().len() as u64);

    let q = engine.store.quarantine().unwrap();
    for (id, reason) in expected["quarantined"].as_object().unwrap() {
        let got: Vec<&str> = q.iter().filter(|x| x.parcel_id.as_deref() == Some(id.as_str())).map(|x| x.reason.as_str()).collect();
        assert!(!got.is_empty(), "{id} not quarantined");
        assert!(got.iter().all(|g| g == reason), "{id}: got {got:?}, want {reason}");
    }
    let mut without_id: BTreeMap<String, u64> = BTreeMap::new();
    for x in q.iter().filter(|x| x.parcel_id.is_none()) {
        *without_id.entry(x.reason.as_str().to_string()).or_default() += 1;
    }
    let want_without: BTreeMap<String, u64> =
        expected["quarantined_without_id"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap())).collect();
    assert_eq!(without_id, want_without);
    assert!(q.iter().all(|x| !x.raw.is_empty() && !x.detail.is_empty()), "every quarantine row keeps the feature and a reason");
}

/// A feature whose validity no checker of its kind can decide in bounded time (a ring of
/// 10,000 spikes around one point: every spike's box holds the middle) is quarantined as
/// `unrepairable` with a detail saying why, within the work budget; the layer's other
/// features ingest, and every feature is accounted for.
#[test]
fn a_feature_too_complex_to_check_is_quarantined_and_the_rest_ingest() {
    let mut parcels = grid(20);
    let (cx, cy, n) = (-71.05, 42.40, 10_000);
    let mut ring: Vec<[f64; 2]> = (0..2 * n)
        .map(|k| {
            let a = k as f64 / (2 * n) as f64 * std::f64::consts::TAU;
            let r = if k % 2 == 0 { 0.01 } else { 0.00001 };
            [cx + r * a.cos(), cy + r * a.sin()]
        })
        .collect();
    ring.push(ring[0]);
    parcels.push(P { id: "SPIKY".into(), zone: "R-1".into(), ring });
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&parcels));
    let engine = ws.engine();
    let r = run(&engine, false);
    let c = &r.record.counts;
    assert_eq!((c.features, c.parcels, c.quarantined), (21, 20, 1), "{}", r.line());
    let q = engine.store.quarantine().expect("quarantine");
    assert_eq!(q.len(), 1);
    assert_eq!((q[0].parcel_id.as_deref(), q[0].reason.as_str()), (Some("SPIKY"), "unrepairable"));
    assert!(q[0].detail.contains("too complex to check"), "{}", q[0].detail);
    assert!(!engine.store.snapshot_states("s1").expect("snapshot").contains_key("SPIKY"));
}

/// A feature whose repair would take minutes and gigabytes (a star of 2,001 points: each of
/// its segments crosses nearly every other, about two million crossings for the overlay) is
/// quarantined as `unrepairable`, "too tangled to repair in bounded time", before any repair
/// runs; the layer's other features ingest, and every feature is accounted for.
#[test]
fn a_feature_too_tangled_to_repair_is_quarantined_and_the_rest_ingest() {
    let mut parcels = grid(20);
    let (cx, cy, n) = (-71.05, 42.40, 2_001);
    let ring: Vec<[f64; 2]> = (0..=n)
        .map(|i| {
            let a = ((i * 1_000) % n) as f64 / n as f64 * std::f64::consts::TAU;
            [cx + 0.001 * a.cos(), cy + 0.001 * a.sin()]
        })
        .collect();
    parcels.push(P { id: "STAR".into(), zone: "R-1".into(), ring });
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&parcels));
    let engine = ws.engine();
    let r = run(&engine, false);
    let c = &r.record.counts;
    assert_eq!((c.features, c.parcels, c.quarantined, c.repaired), (21, 20, 1, 0), "{}", r.line());
    let q = engine.store.quarantine().expect("quarantine");
    assert_eq!(q.len(), 1);
    assert_eq!((q[0].parcel_id.as_deref(), q[0].reason.as_str()), (Some("STAR"), "unrepairable"));
    assert!(q[0].detail.starts_with("too tangled to repair in bounded time: its 2001 segments"), "{}", q[0].detail);
    assert!(!engine.store.snapshot_states("s1").expect("snapshot").contains_key("STAR"));
}
