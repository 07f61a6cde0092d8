//! Bad input never panics and never loses the rest of the layer.

mod common;
use common::*;
use zonewatch::model::{QuarantineReason, Verdict};

#[test]
fn bowtie_repaired_and_nan_quarantined_while_the_rest_ingests() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let mut parcels = grid(10);
    parcels.push(P {
        id: "BOWTIE".into(),
        zone: "R-1".into(),
        ring: vec![[-71.05, 42.40], [-71.05, 42.41], [-71.04, 42.40], [-71.04, 42.41], [-71.05, 42.40]],
    });
    let mut text = layer(&parcels);
    // A feature with NaN coordinates, written the way Python's json module writes them.
    let nan_feature = r#"{"type":"Feature","properties":{"APN":"NANLOT","ZONE_CODE":"R-1"},"geometry":{"type":"Polygon","coordinates":[[[-71.0,42.0],[NaN,42.0],[-71.0,42.1],[-71.0,42.0]]]}}"#;
    text = text.replacen("\"features\":[", &format!("\"features\":[{nan_feature},"), 1);
    ws.write_layer(&text);
    let r = run(&engine, false);
    assert_eq!(r.record.verdict, Verdict::Baseline);
    assert_eq!((r.record.counts.features, r.record.counts.parcels, r.record.counts.quarantined, r.record.counts.repaired), (12, 11, 1, 1));
    let snap = engine.store.snapshot_states("s1").unwrap();
    assert!(snap.contains_key("BOWTIE"));
    assert!(!snap.contains_key("NANLOT"));
    let q = engine.store.quarantine().unwrap();
    assert_eq!(q.len(), 1);
    assert_eq!((q[0].reason, q[0].parcel_id.as_deref()), (QuarantineReason::NonFinite, Some("NANLOT")));
    assert!(q[0].raw.contains("NANLOT"));
    let geoms = engine.store.parcel_geometries("s1", ["BOWTIE"]).unwrap();
    assert_eq!(geoms["BOWTIE"].0.len(), 2, "the bowtie becomes two triangles");
    assert_eq!(outcomes(&engine).get("quarantined"), Some(&1));
}

#[test]
fn duplicate_ids_out_of_bounds_and_missing_fields_are_quarantined() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let mut parcels = grid(20);
    parcels.push(square("P0001", "C-1", -71.0, 42.45, 0.001)); // duplicate id
    parcels.push(square("FAR", "C-1", -80.0, 42.45, 0.001)); // outside bbox
    let mut text = layer(&parcels);
    text = text.replacen("\"features\":[", "\"features\":[{\"type\":\"Feature\",\"properties\":{\"APN\":\"NOZONE\"},\"geometry\":null},", 1);
    ws.write_layer(&text);
    let r = run(&engine, false);
    assert_eq!(r.record.counts.quarantined, 4, "two duplicates, one out of bounds, one missing field");
    let mut reasons: Vec<_> = engine.store.quarantine().unwrap().iter().map(|q| q.reason.as_str()).collect();
    reasons.sort();
    assert_eq!(reasons, vec!["duplicate_id", "duplicate_id", "missing_field", "out_of_bounds"]);
    assert!(!engine.store.snapshot_states("s1").unwrap().contains_key("P0001"));
}

/// A feature whose bytes are not UTF-8 is quarantined under the id it seems to have, and
/// that parcel keeps its stored state: no rezoning to a code with U+FFFD in it is alerted.
/// A layer that starts with a byte order mark reads as any other.
#[test]
fn a_feature_whose_bytes_are_not_utf8_is_quarantined_and_keeps_its_parcel() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let mut parcels = grid(10);
    parcels[3].zone = "ZZ-1".into();
    let text = layer(&parcels);
    std::fs::write(ws.path().join("layer.geojson"), [&b"\xEF\xBB\xBF"[..], text.as_bytes()].concat()).unwrap();
    assert_eq!(run(&engine, false).record.counts.parcels, 10);
    let bad = text.replacen("ZZ-1", "ZZ-\u{1}", 1).into_bytes();
    let bad: Vec<u8> = bad.into_iter().map(|b| if b == 1 { 0xFF } else { b }).collect();
    std::fs::write(ws.path().join("layer.geojson"), bad).unwrap();
    let r = run(&engine, false);
    assert_eq!((r.record.counts.quarantined, r.record.counts.changes), (1, 0), "{:?}", r.record.counts);
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0003"].zoning, "ZZ-1");
    let q = engine.store.quarantine().unwrap();
    assert_eq!((q[0].reason, q[0].parcel_id.as_deref()), (QuarantineReason::MalformedFeature, Some("P0003")));
    assert!(q[0].detail.contains("not UTF-8"), "{}", q[0].detail);

    // A bad byte outside the fields the diff reads (an owner's name in Latin-1) is let
    // through: the parcel's rezoning is still seen.
    let mut moved = parcels.clone();
    moved[3].zone = "ZZ-2".into();
    let latin1 = layer(&moved).replacen("\"ZONE_CODE\":\"ZZ-2\"", "\"OWNER\":\"M\u{1}ller\",\"ZONE_CODE\":\"ZZ-2\"", 1).into_bytes();
    let latin1: Vec<u8> = latin1.into_iter().map(|b| if b == 1 { 0xFC } else { b }).collect();
    std::fs::write(ws.path().join("layer.geojson"), latin1).unwrap();
    let r = run(&engine, false);
    assert_eq!((r.record.counts.quarantined, r.record.counts.changes), (0, 1), "{:?}", r.record.counts);
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0003"].zoning, "ZZ-2");
}

/// A feature whose *id* holds a byte that is not UTF-8 (`P0\xFF03` for `P0003`) names no
/// stored parcel: it is quarantined without an id, where it lies, and the parcel it was keeps
/// its stored state instead of being read as removed and alerted (so also when its geometry
/// is broken too, by where its raw text says it lies).
#[test]
fn a_feature_whose_id_is_not_utf8_keeps_the_parcel_it_was() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let parcels = grid(10);
    let text = layer(&parcels);
    ws.write_layer(&text);
    assert_eq!(run(&engine, false).record.counts.parcels, 10);
    let damage = |text: String| -> Vec<u8> { text.replacen("\"P0003\"", "\"P0\u{1}03\"", 1).into_bytes().into_iter().map(|b| if b == 1 { 0xFF } else { b }).collect() };
    std::fs::write(ws.path().join("layer.geojson"), damage(text.clone())).unwrap();
    let r = run(&engine, false);
    let c = &r.record.counts;
    assert_eq!((c.features, c.parcels, c.quarantined, c.changes), (10, 9, 1, 0), "{}", r.line());
    assert_eq!(engine.store.snapshot_states("s1").unwrap()["P0003"].zoning, parcels[3].zone, "kept, not removed");
    let q = engine.store.quarantine().unwrap();
    assert_eq!((q[0].reason, q[0].parcel_id.as_deref()), (QuarantineReason::MalformedFeature, None));
    assert!(q[0].detail.contains("not UTF-8"), "{}", q[0].detail);
    assert!(engine.store.audit(&Default::default()).unwrap().iter().all(|a| a.outcome.as_str() != "queued"), "nothing alerted");

    // The same with a geometry the repair cannot save (a ring of two points): the feature
    // is rejected for its geometry, still without the damaged id, placed by its raw text.
    let mut broken = parcels.clone();
    broken[3].ring = vec![parcels[3].ring[0], parcels[3].ring[2], parcels[3].ring[0]];
    std::fs::write(ws.path().join("layer.geojson"), damage(layer(&broken))).unwrap();
    let r = run(&engine, false);
    let c = &r.record.counts;
    assert_eq!((c.features, c.parcels, c.quarantined, c.changes), (10, 9, 1, 0), "{}", r.line());
    assert!(engine.store.snapshot_states("s1").unwrap().contains_key("P0003"), "kept, not removed");
}

#[test]
fn malformed_feed_fails_the_run_cleanly() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    ws.write_layer(&layer(&grid(10)));
    run(&engine, false);
    let wm = engine.store.watermark("s1").unwrap();
    for bad in ["{\"type\":\"FeatureCollection\",\"features\":[", "<html>502 Bad Gateway</html>", "{\"type\":\"Topology\"}", ""] {
        ws.write_layer(bad);
        let err = engine.run_source_id("s1", Default::default()).unwrap_err();
        assert!(err.to_string().contains("GeoJSON FeatureCollection"), "{err}");
        assert_eq!(engine.store.watermark("s1").unwrap(), wm, "watermark untouched by {bad:?}");
    }
    assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 10);
}

/// Features whose quotes or brackets are broken so that the scanner's guess at where one ends
/// takes the next ones into it (a quote left unescaped beside a bracket, an object closed by
/// a bracket): quarantining that one feature would leave the parcels inside it unseen, and
/// they would be alerted as removed. The layer is refused instead, saying why, and nothing
/// moves. One broken feature that takes nothing in is quarantined alone, as before.
#[test]
fn a_broken_feature_that_swallows_others_fails_the_layer_instead_of_removing_them() {
    let ws = Workspace::new(&[], "", "");
    let engine = ws.engine();
    let text = layer(&grid(10));
    ws.write_layer(&text);
    run(&engine, false);
    let wm = engine.store.watermark("s1").unwrap();
    let features: Vec<String> = serde_json::from_str::<serde_json::Value>(&text).unwrap()["features"].as_array().unwrap().iter().map(|f| f.to_string()).collect();
    let doc = |parts: Vec<String>| format!("{{\"type\":\"FeatureCollection\",\"features\":[{}]}}", parts.join(","));
    let rest = features[2..].to_vec();
    // Two notes with a quote left unescaped, one beside a bracket: P0000 falls between them.
    let quotes = [vec![r#"{"type":"Feature","properties":{"NOTE":"6" [x"}}"#.to_string(), features[0].clone(), r#"{"type":"Feature","properties":{"NOTE":"1" y"}}"#.to_string(), features[1].clone()], rest.clone()].concat();
    // An object closed by a bracket, a brace too many after P0000.
    let bracket = [vec![r#"{"type":"Feature","properties":{"NOTE":{"b":1]}}"#.to_string(), format!("{}}}", features[0]), features[1].clone()], rest.clone()].concat();
    for broken in [quotes, bracket] {
        let broken = doc(broken);
        ws.write_layer(&broken);
        let err = engine.run_source_id("s1", Default::default()).unwrap_err();
        assert!(err.to_string().contains("holds more than one \"Feature\""), "{broken}: {err}");
        assert_eq!(engine.store.watermark("s1").unwrap(), wm, "watermark untouched");
        assert_eq!(engine.store.snapshot_states("s1").unwrap().len(), 10, "nothing removed");
    }
    let alone = r#"{"type":"Feature","properties":{"APN":"BAD","NOTE":"a "quoted" word"},"geometry":null}"#;
    ws.write_layer(&doc([vec![alone.to_string()], features].concat()));
    let r = run(&engine, false);
    assert_eq!((r.record.counts.quarantined, r.record.counts.changes), (1, 0), "{:?}", r.record.counts);
}
