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

/// A workspace with one subscriber watching `aoi`, and no change-spike hold (these tests
/// change most of their few parcels).
fn one_watcher(id: &'static str, aoi: serde_json::Value, rx: &zonewatch::receiver::Receiver) -> Workspace {
    let ws = Workspace::new(&[Sub { id, aoi, target: rx.url("/hook"), min_severity: "info", secret: None }], "", "");
    ws.edit_config("max_change_ratio = 0.5", "max_change_ratio = 1.0");
    ws
}

/// A zoned R-1 lot of side 0.3 units with its lower-left corner at (x, y) units.
fn lot(id: &str, x: f64, y: f64) -> P {
    square(id, "R-1", X0 + x * U, Y0 + y * U, 0.3 * U)
}

/// An engine on `ws` that has run its baseline of `parcels`.
fn after_baseline(ws: &Workspace, parcels: &[P]) -> zonewatch::pipeline::Engine {
    let engine = ws.engine();
    ws.write_layer(&layer(parcels));
    run(&engine, false);
    engine
}

/// (parcel id, change) of every webhook received, sorted.
fn received_changes(rx: &zonewatch::receiver::Receiver) -> Vec<(String, String)> {
    let mut got: Vec<(String, String)> = rx
        .received()
        .iter()
        .filter_map(|r| {
            let j = r.json()?;
            Some((j["data"]["parcel_id"].as_str()?.to_string(), j["data"]["change"].as_str()?.to_string()))
        })
        .collect();
    got.sort();
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l_shaped_aoi_matches_exactly() {
    let rx = receiver(200).await;
    let ws = one_watcher("l-watcher", l_shape(), &rx);
    let parcels = vec![
        // Inside the notch, inside the L's bounding box, not touching the L.
        lot("NOTCH", 1.4, 1.4),
        // Touches the L's inner edge x = 1 from the notch side.
        lot("TOUCH", 1.0, 1.5),
        // Well inside the L.
        lot("INSIDE", 0.2, 0.2),
        // Far away.
        lot("AWAY", 5.0, 5.0),
    ];
    let engine = after_baseline(&ws, &parcels);
    let mut v2 = parcels.clone();
    for p in &mut v2 {
        p.zone = "R-2".into();
    }
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!(r.record.counts.changes, 4);
    deliver(&engine, Duration::from_secs(5)).await;
    let got: Vec<String> = received_changes(&rx).into_iter().map(|(id, _)| id).collect();
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
    let ws = one_watcher("w", rect(X0, Y0, X0 + U, Y0 + U), &rx);
    let v1 = vec![lot("OUT", 0.2, 0.2), lot("IN", 5.0, 5.0), lot("ELSEWHERE", 7.0, 7.0), lot("STILL", 9.0, 9.0)];
    let engine = after_baseline(&ws, &v1);
    let v2 = vec![lot("OUT", 3.0, 3.0), lot("IN", 0.5, 0.5), lot("ELSEWHERE", 8.0, 8.0), v1[3].clone()];
    ws.write_layer(&layer(&v2));
    let r = run(&engine, false);
    assert_eq!((r.record.counts.changes, r.record.counts.queued), (3, 2), "{}", r.line());
    deliver(&engine, Duration::from_secs(5)).await;
    let want = |id: &str| (id.to_string(), "geometry_changed".to_string());
    assert_eq!(received_changes(&rx), vec![want("IN"), want("OUT")]);
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
