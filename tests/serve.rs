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

/// After an I/O error on the store (here: a file size limit it cannot grow past), redb
/// refuses all work on the open file until it is opened again. `serve` used to go on
/// failing every run while `/healthz` said ok and exit 0 on SIGTERM; it now stops by itself,
/// and the store is whole and usable once opened again. A file-size limit does not pass by
/// waiting, so it says so and exits 2, which the packaged unit does not restart (a full disk
/// exits 1 and is restarted: the same stop, which a test cannot make without a small file
/// system of its own).
#[test]
fn serve_stops_when_the_store_must_be_opened_again_after_an_io_error() {
    let ws = Workspace::new(&[], "", "");
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    // The store made (the source fails: no layer yet), then a layer whose baseline must grow it.
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["run", "--config", cfg]).output().expect("run");
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let store = ws.path().join("zw.redb");
    // Every open commits (tables, schema), and redb's file length swings by a page or two
    // from one commit to the next: the limit is the largest length two opens leave, so that
    // serve's own open fits and only the growth a run needs fails. (`audit` opens to write.)
    let mut size = std::fs::metadata(&store).expect("store").len();
    for _ in 0..2 {
        let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["audit", "--config", cfg, "--format", "csv"]).output().expect("audit");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        size = size.max(std::fs::metadata(&store).expect("store").len());
    }
    ws.write_layer(&layer(&grid(3000)));
    // bash's `ulimit -f` counts KiB; SIGXFSZ ignored, so a write past it is an EFBIG error.
    // The limit is the largest length two opens left, so the run's growth fails. (The run's
    // spill file, in the same folder, fails first; recording the failed run then grows the
    // store past it. Were that record to fit, serve would rightly stay up and this test would
    // time out: it depends on redb's page use, and says so when it does.)
    let limited = format!("ulimit -f {}; trap '' XFSZ; exec \"$0\" serve --config \"$1\"", size.div_ceil(1024));
    let mut child = Command::new("bash")
        .args(["-c", &limited, env!("CARGO_BIN_EXE_zonewatch"), cfg])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let mut log = String::new();
            use std::io::Read;
            let _ = child.stderr.take().expect("stderr").read_to_string(&mut log);
            panic!("serve kept running on a store that refuses all work:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    use std::io::Read;
    child.stderr.take().expect("stderr").read_to_string(&mut log).expect("log");
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("cannot grow past a file-size limit; stopping (exit 2)") && log.contains("a file-size limit stops it"), "{log}");
    // Opened again (no limit now): consistent, and the run the error stopped goes through.
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["check", "--config", cfg, "--store"]).output().expect("check");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("consistent"), "{}", String::from_utf8_lossy(&o.stdout));
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["run", "--config", cfg]).output().expect("run");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("baseline features=3000"), "{out}{}", String::from_utf8_lossy(&o.stderr));
}

/// The store file removed while `serve` has it open (a temp cleaner, a wrong `rm`): redb
/// would go on writing the open file, all of it lost when the process ends, while `/healthz`
/// said ok and SIGTERM exited 0 (found by a black-box tester). `serve` notices within
/// seconds, says so, and exits 2: a restart would begin an empty store.
#[test]
fn serve_stops_with_exit_2_when_its_store_file_is_removed() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&grid(10)));
    let mut daemon = Daemon::start(&ws);
    std::fs::remove_file(ws.path().join("zw.redb")).expect("remove the store");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = daemon.child.try_wait().expect("wait") {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "serve kept running on a removed store");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    use std::io::Read;
    daemon.child.stderr.take().expect("stderr").read_to_string(&mut log).expect("log");
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("was removed or replaced (or its folder removed) while zonewatch had it open"), "{log}");
}

/// `serve` whose stderr cannot be written (a log file on a full disk; here `/dev/full`)
/// goes on and stops cleanly: its log lines are dropped. tracing-subscriber reported the
/// failed write with `eprintln!`, which panicked (exit 101 at its first log line, found by a
/// black-box tester).
#[test]
fn serve_goes_on_when_its_stderr_cannot_be_written() {
    let ws = Workspace::new(&[], "", "every = \"1s\"");
    ws.write_layer(&layer(&grid(40)));
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("SKIPPED: no /dev/full on this machine");
        return;
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["serve", "--config", ws.config_path().to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(full)
        .spawn()
        .expect("serve starts");
    // Its start, its first runs and their log lines (`serve` logs every run) go by.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(child.try_wait().expect("wait").is_none(), "serve ended on a stderr it cannot write");
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().expect("kill runs");
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(0));
}
