//! A county re-publishing the same layer (reordered, reformatted, rotated) changes nothing.

mod common;
use common::*;
use std::time::Duration;
use zonewatch::model::Verdict;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republish_yields_zero_changes() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "all", aoi: rect(-94.0, 44.0, -93.0, 46.0), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "",
    );
    ws.edit_config("bbox = [-72.0, 42.0, -70.0, 43.0]", "bbox = [-94.0, 44.0, -93.0, 46.0]");
    let county = zonewatch::synth::generate_county(&zonewatch::synth::CountySpec { parcels: 1500, ..Default::default() });
    let v1 = zonewatch::synth::to_geojson(&county, "2026-01-01");
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
