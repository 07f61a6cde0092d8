//! `zonewatch serve`: re-ingests on its schedule, delivers continuously, stops cleanly on SIGTERM.

mod common;
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_ingests_on_schedule_delivers_and_stops_on_sigterm() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "every = \"1s\"",
    );
    let v1 = grid(40);
    ws.write_layer(&layer(&v1));
    let mut child = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["serve", "--config", ws.config_path().to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    // Wait for the baseline to be committed, then publish a rezoning.
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    tokio::task::block_in_place(|| {
        wait_for("the baseline", &|| {
            // The store is locked by the serving process; the run shows up in its log instead.
            std::fs::metadata(ws.path().join("zw.redb")).is_ok()
        })
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut v2 = v1.clone();
    v2[0].zone = "C3".into();
    ws.write_layer(&layer(&v2));
    tokio::task::block_in_place(|| wait_for("the alert", &|| !rx.received().is_empty()));
    assert_eq!(rx.received().len(), 1);

    let pid = child.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().expect("kill runs");
    assert!(status.success());
    let start = Instant::now();
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "serve did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    use std::io::Read;
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(exit.success(), "exit {exit:?}\n{log}");
    assert!(log.contains("stopped cleanly"), "{log}");
    // The store is consistent and reopenable after the stop.
    let engine = ws.engine();
    assert_eq!(engine.store.outbox_len().unwrap(), 0);
    assert_eq!(outcomes(&engine).get("sent"), Some(&1));
}
