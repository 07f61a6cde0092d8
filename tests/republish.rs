//! A county re-publishing the same layer (reordered, reformatted, rotated) changes nothing.

mod common;
use common::*;
use std::time::Duration;
use zonewatch::model::Verdict;

/// A workspace watching the synthetic county (1,500 parcels) with one `info` subscriber over
/// all of it, and the county's first layer (not written yet).
fn synthetic_county(hook: String) -> (Workspace, String) {
    let ws = Workspace::new(&[Sub { id: "all", aoi: rect(-94.0, 44.0, -93.0, 46.0), target: hook, min_severity: "info", secret: None }], "", "");
    ws.edit_config("bbox = [-72.0, 42.0, -70.0, 43.0]", "bbox = [-94.0, 44.0, -93.0, 46.0]");
    let county = zonewatch::synth::generate_county(&zonewatch::synth::CountySpec { parcels: 1500, ..Default::default() });
    (ws, zonewatch::synth::to_geojson(&county, "2026-01-01"))
}

/// Every number of `v` that is not whole, mapped by `f` (coordinates; a layer's ids and codes are strings).
fn map_numbers(v: &mut serde_json::Value, f: &dyn Fn(f64) -> f64) {
    match v {
        serde_json::Value::Number(n) => {
            if let Some(x) = n.as_f64().filter(|x| x.fract() != 0.0) {
                *v = serde_json::json!(f(x));
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| map_numbers(x, f)),
        serde_json::Value::Object(o) => o.iter_mut().for_each(|(_, x)| map_numbers(x, f)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republish_yields_zero_changes() {
    let rx = receiver(200).await;
    let (ws, v1) = synthetic_county(rx.url("/hook"));
    let engine = ws.engine();
    ws.write_layer(&v1);
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    for seed in [1u64, 2, 3] {
        let again = zonewatch::synth::republish(v1.as_bytes(), seed).unwrap();
        assert_ne!(again, v1.as_bytes(), "the re-publish must differ byte-wise");
        let text = String::from_utf8(again).unwrap();
        assert!(text.contains('e'), "some numbers are in exponent form");
        ws.write_layer(&text);
        let r = run(&engine, false);
        assert_eq!((r.record.verdict, r.record.counts.features, r.record.counts.changes), (Verdict::Run, 1500, 0), "seed {seed}");
    }
    deliver(&engine, Duration::from_secs(1)).await;
    assert!(rx.received().is_empty());
}

/// A layer in which one feature lost its id (and one parcel really went): the stored
/// parcel lying under the id-less feature is kept, not alerted as removed; the parcel that
/// went is. A feature with neither an id nor a geometry cannot be placed: the run says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feature_that_lost_its_id_is_not_alerted_as_a_removed_parcel() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "all", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "",
    );
    let engine = ws.engine();
    let v1 = grid(40);
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);

    // P0005's feature comes without its APN; P0006 is gone from the layer.
    let mut doc: serde_json::Value = serde_json::from_str(&layer(&v1)).unwrap();
    let features = doc["features"].as_array_mut().unwrap();
    features[5]["properties"].as_object_mut().unwrap().remove("APN");
    features.remove(6);
    ws.write_layer(&doc.to_string());
    let r = run(&engine, false);
    assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.quarantined), (Verdict::Run, 1, 1));
    let warning = r.record.warnings.iter().find(|w| w.contains("kept, not removed")).expect("the run names the kept parcel");
    assert!(warning.contains("\"P0005\"") && warning.contains("positions 5 of the layer"), "{warning}");
    assert!(engine.store.snapshot_states("s1").unwrap().contains_key("P0005"));
    deliver(&engine, Duration::from_secs(5)).await;
    let got: Vec<(String, String)> = rx
        .received()
        .iter()
        .filter_map(|r| {
            let j = r.json()?;
            Some((j["data"]["parcel_id"].as_str()?.to_string(), j["data"]["change"].as_str().unwrap_or("?").to_string()))
        })
        .collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, "P0006");

    // The next layer names P0005 again, unchanged: nothing to say about it.
    let mut v3 = v1.clone();
    v3.remove(6);
    ws.write_layer(&layer(&v3));
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.quarantined), (0, 0));

    // A feature with no id and no geometry cannot be placed: P0007, gone, is removed, and
    // the run says the unplaceable feature might have been it.
    let mut doc: serde_json::Value = serde_json::from_str(&layer(&v3)).unwrap();
    let features = doc["features"].as_array_mut().unwrap();
    features.remove(6);
    features.push(serde_json::json!({"type": "Feature", "properties": {"ZONE_CODE": "R-1"}, "geometry": null}));
    ws.write_layer(&doc.to_string());
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.quarantined), (1, 1));
    assert!(r.record.warnings.iter().any(|w| w.contains("without a parcel id or a readable geometry") && w.contains("1 parcel(s) were removed")), "{:?}", r.record.warnings);
    assert!(!engine.store.snapshot_states("s1").unwrap().contains_key("P0007"));
}

/// Every coordinate of a layer written out again at 8 decimals (a tool's default): the 1e-7°
/// rounding of the hash lands on the other side of a step for about one coordinate in twenty,
/// and many parcels' hashes move (a reviewer: a whole layer so was a change spike, a part of
/// one false `geometry_changed` alerts). Their shapes are the stored ones but for that
/// rounding: no change. A parcel moved by a metre and one rezoned in the same layer are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_written_again_with_fewer_decimals_changes_nothing_but_what_changed() {
    let rx = receiver(200).await;
    let (ws, v1) = synthetic_county(rx.url("/hook"));
    // The synthetic county's coordinates have few decimals: given full ones (each value
    // moved within one grid step, the same value the same way, so parcels still share their
    // corners), as a county's GIS writes them.
    let mut doc: serde_json::Value = serde_json::from_str(&v1).unwrap();
    map_numbers(&mut doc["features"], &|x| x + (x.to_bits() % 9973) as f64 * 1e-11);
    let engine = ws.engine();
    ws.write_layer(&doc.to_string());
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    let mut features = doc["features"].as_array().unwrap().clone();
    let hash = |f: &serde_json::Value| {
        let g: geojson::Geometry = serde_json::from_value(f["geometry"].clone()).unwrap();
        let mp: geo::MultiPolygon<f64> = match geo::Geometry::<f64>::try_from(g.value).unwrap() {
            geo::Geometry::Polygon(p) => geo::MultiPolygon::new(vec![p]),
            geo::Geometry::MultiPolygon(mp) => mp,
            other => panic!("{other:?}"),
        };
        zonewatch::detect::canonical::geometry_hash(&mp)
    };
    let before: Vec<[u8; 32]> = features.iter().map(hash).collect();
    for f in features.iter_mut() {
        map_numbers(&mut f["geometry"], &|x| (x * 1e8).round() / 1e8);
    }
    let moved = features.iter().zip(&before).filter(|(f, h)| hash(f) != **h).count();
    assert!(moved * 10 > features.len(), "many parcels' hashes move: {moved} of {}", features.len());
    // One parcel shifted by ~1 m east, one rezoned.
    map_numbers(&mut features[10]["geometry"], &|x| if x < -90.0 { x + 1e-5 } else { x });
    let zone = features[20]["properties"]["ZONE_CODE"].as_str().unwrap_or_default().to_string();
    features[20]["properties"]["ZONE_CODE"] = serde_json::json!(format!("{zone}-X"));
    ws.write_layer(&serde_json::json!({"type": "FeatureCollection", "features": features}).to_string());
    let r = run(&engine, false);
    assert_eq!((r.record.verdict, r.record.counts.features, r.record.counts.changes), (Verdict::Run, 1500, 2), "{}", r.line());
    // Read again (its bytes moved: one more parcel rezoned), the rounded shapes are still
    // the stored ones, which stand. (With dates that moved, through a hold: the next test.)
    features[30]["properties"]["ZONE_CODE"] = serde_json::json!("Z-9");
    ws.write_layer(&serde_json::json!({"type": "FeatureCollection", "features": features}).to_string());
    let r = run(&engine, false);
    assert_eq!((r.record.verdict, r.record.counts.changes), (Verdict::Run, 1), "{}", r.line());
    deliver(&engine, Duration::from_secs(5)).await;
    let mut kinds: Vec<String> = rx.received().iter().map(|m| serde_json::from_slice::<serde_json::Value>(&m.body).unwrap()["data"]["change"].as_str().unwrap_or_default().to_string()).collect();
    kinds.sort();
    assert_eq!(kinds, vec!["geometry_changed", "rezoned", "rezoned"]);
}

/// Two parcels written under a placeholder id (`ROW`) in the next layer, their shapes as they
/// were, and one parcel really gone: the copies of `ROW` are quarantined `duplicate_id` and
/// stand where the two parcels lie, which are kept, not alerted as removed (a reviewer: a
/// feature without an id kept its parcel, a copy of a repeated one did not). The one gone is
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parcels_written_under_a_repeated_placeholder_id_are_not_alerted_as_removed() {
    let rx = receiver(200).await;
    let ws = Workspace::new(&[Sub { id: "all", aoi: rect(-72.0, 42.0, -70.0, 43.0), target: rx.url("/hook"), min_severity: "info", secret: None }], "", "");
    let engine = ws.engine();
    let v1 = grid(100);
    ws.write_layer(&layer(&v1));
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    let mut v2 = v1.clone();
    v2[5].id = "ROW".into();
    v2[6].id = "ROW".into();
    v2.remove(10);
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!((r.record.verdict, r.record.counts.changes, r.record.counts.quarantined), (Verdict::Run, 1, 2), "{}", r.line());
    assert!(r.record.warnings.iter().any(|w| w.starts_with("2 stored parcel(s) missing from the layer were kept") && w.contains("a copy of a parcel id the layer repeats")), "{:?}", r.record.warnings);
    let stored = engine.store.snapshot_states("s1").unwrap();
    assert!(stored.contains_key("P0005") && stored.contains_key("P0006") && !stored.contains_key("P0010"));
    deliver(&engine, Duration::from_secs(5)).await;
    let received = rx.received();
    assert_eq!(received.len(), 1);
    let body: serde_json::Value = serde_json::from_slice(&received[0].body).unwrap();
    assert_eq!((body["data"]["parcel_id"].as_str(), body["data"]["change"].as_str()), (Some("P0010"), Some("removed")));
}

/// The rounded-again layer of the test above, with every effective date moved and five
/// parcels rezoned (a change spike: held), then released: the rounded parcels store the new
/// date with their stored shape, hash and area, and the release announces only the five
/// rezonings (it classified a rounded parcel's moved hash as `geometry_changed`, and marked
/// an announcement that was never sent: a reviewer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rounded_layer_with_new_dates_keeps_the_stored_shapes_through_a_held_release() {
    let rx = receiver(200).await;
    let (ws, v1) = synthetic_county(rx.url("/hook"));
    ws.edit_config("zoning = \"ZONE_CODE\"", "zoning = \"ZONE_CODE\"\neffective_date = \"EFF_DATE\"");
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 0.001");
    let mut doc: serde_json::Value = serde_json::from_str(&v1).unwrap();
    map_numbers(&mut doc["features"], &|x| x + (x.to_bits() % 9973) as f64 * 1e-11);
    let engine = ws.engine();
    ws.write_layer(&doc.to_string());
    assert_eq!(run(&engine, false).record.verdict, Verdict::Baseline);
    let before = engine.store.snapshot_states("s1").unwrap();

    let mut features = doc["features"].as_array().unwrap().clone();
    for (i, f) in features.iter_mut().enumerate() {
        map_numbers(&mut f["geometry"], &|x| (x * 1e8).round() / 1e8);
        f["properties"]["EFF_DATE"] = serde_json::json!("2026-06-01");
        if i % 300 == 7 {
            f["properties"]["ZONE_CODE"] = serde_json::json!("Z-9");
        }
    }
    ws.write_layer(&serde_json::json!({"type": "FeatureCollection", "features": features}).to_string());
    let held = run(&engine, false);
    assert_eq!((held.record.verdict, held.record.counts.changes), (Verdict::Held, 5), "{}", held.line());
    engine.resolve_hold(held.record.hold_id.expect("a hold"), false).expect("released");
    let after = engine.store.snapshot_states("s1").unwrap();
    let kept = after.iter().filter(|(id, s)| s.zoning != "Z-9" && s.geom_hash == before[*id].geom_hash && s.announced == before[*id].announced).count();
    assert_eq!(kept, 1495, "every parcel not rezoned keeps its stored shape and announcement");
    assert!(after.values().all(|s| s.effective_date.as_deref() == Some("2026-06-01")), "the new dates are stored");
    deliver(&engine, Duration::from_secs(5)).await;
    let kinds: Vec<String> = rx.received().iter().map(|m| serde_json::from_slice::<serde_json::Value>(&m.body).unwrap()["data"]["change"].as_str().unwrap_or_default().to_string()).collect();
    assert_eq!(kinds, vec!["rezoned"; 5]);
}
