//! Matching is exact: the R-tree only narrows candidates; `intersects` decides.

mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

const X0: f64 = -71.10;
const Y0: f64 = 42.36;
const U: f64 = 0.01;

/// An L: the unit square [0,2]x[0,2] minus the notch [1,2]x[1,2].
fn l_shape() -> serde_json::Value {
    let p = |x: f64, y: f64| json!([X0 + x * U, Y0 + y * U]);
    json!({"type": "Polygon", "coordinates": [[p(0.,0.), p(2.,0.), p(2.,1.), p(1.,1.), p(1.,2.), p(0.,2.), p(0.,0.)]]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l_shaped_aoi_matches_exactly() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "l-watcher", aoi: l_shape(), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "",
    );
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    let s = 0.3 * U;
    let parcels = vec![
        // Inside the notch, inside the L's bounding box, not touching the L.
        square("NOTCH", "R-1", X0 + 1.4 * U, Y0 + 1.4 * U, s),
        // Touches the L's inner edge x = 1 from the notch side.
        square("TOUCH", "R-1", X0 + 1.0 * U, Y0 + 1.5 * U, s),
        // Well inside the L.
        square("INSIDE", "R-1", X0 + 0.2 * U, Y0 + 0.2 * U, s),
        // Far away.
        square("AWAY", "R-1", X0 + 5.0 * U, Y0 + 5.0 * U, s),
    ];
    let engine = ws.engine();
    ws.write_layer(&layer(&parcels));
    run(&engine, false);
    let mut v2 = parcels.clone();
    for p in &mut v2 {
        p.zone = "R-2".into();
    }
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!(r.record.counts.changes, 4);
    deliver(&engine, Duration::from_secs(5)).await;
    let mut got: Vec<String> = rx
        .received()
        .iter()
        .filter_map(|r| r.json()?["data"]["parcel_id"].as_str().map(str::to_string))
        .collect();
    got.sort();
    assert_eq!(got, vec!["INSIDE".to_string(), "TOUCH".to_string()]);
}

/// A parcel redrawn out of an area of interest is still that area's change: the event
/// carries the stored (old) shape, read before the run's upsert replaces it, and matching
/// tests both shapes. One redrawn into the area matches by its new shape; one redrawn
/// elsewhere outside it matches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parcel_redrawn_out_of_an_aoi_matches_by_its_old_shape() {
    let rx = receiver(200).await;
    // The AOI: the unit square at the origin.
    let aoi = rect(X0, Y0, X0 + U, Y0 + U);
    let ws = Workspace::new(&[Sub { id: "w", aoi, target: rx.url("/hook"), min_severity: "info", secret: None }], "", "");
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    let s = 0.3 * U;
    let v1 = vec![
        square("OUT", "R-1", X0 + 0.2 * U, Y0 + 0.2 * U, s),
        square("IN", "R-1", X0 + 5.0 * U, Y0 + 5.0 * U, s),
        square("ELSEWHERE", "R-1", X0 + 7.0 * U, Y0 + 7.0 * U, s),
        square("STILL", "R-1", X0 + 9.0 * U, Y0 + 9.0 * U, s),
    ];
    let engine = ws.engine();
    ws.write_layer(&layer(&v1));
    run(&engine, false);
    let v2 = vec![
        square("OUT", "R-1", X0 + 3.0 * U, Y0 + 3.0 * U, s),
        square("IN", "R-1", X0 + 0.5 * U, Y0 + 0.5 * U, s),
        square("ELSEWHERE", "R-1", X0 + 8.0 * U, Y0 + 8.0 * U, s),
        v1[3].clone(),
    ];
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.queued), (3, 2), "{}", r.line());
    deliver(&engine, Duration::from_secs(5)).await;
    let mut got: Vec<(String, String)> = rx
        .received()
        .iter()
        .filter_map(|r| {
            let j = r.json()?;
            Some((j["data"]["parcel_id"].as_str()?.to_string(), j["data"]["change"].as_str()?.to_string()))
        })
        .collect();
    got.sort();
    let want = |id: &str| (id.to_string(), "geometry_changed".to_string());
    assert_eq!(got, vec![want("IN"), want("OUT")]);
}

#[test]
fn index_finds_candidates_by_envelope_then_tests_exactly() {
    use zonewatch::notify::aoi::parse_aoi;
    use zonewatch::notify::matcher::{Subscriber, SubscriberIndex};
    let sub = Subscriber {
        id: "l".into(),
        target: "http://127.0.0.1:9/".into(),
        secret: None,
        min_severity: zonewatch::model::Severity::Info,
        aoi: parse_aoi(&l_shape().to_string()).unwrap(),
        secret_old: None,
    };
    let idx = SubscriberIndex::build(vec![sub]);
    let notch = parse_aoi(&rect(X0 + 1.4 * U, Y0 + 1.4 * U, X0 + 1.7 * U, Y0 + 1.7 * U).to_string()).unwrap();
    let touch = parse_aoi(&rect(X0 + 1.0 * U, Y0 + 1.5 * U, X0 + 1.3 * U, Y0 + 1.8 * U).to_string()).unwrap();
    assert!(idx.matching(&[&notch]).is_empty());
    assert_eq!(idx.matching(&[&touch]).len(), 1);
    // Old geometry in, new geometry out of the AOI: still matched.
    assert_eq!(idx.matching(&[&notch, &touch]).len(), 1);
}
