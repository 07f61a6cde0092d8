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

/// A tmpfs of `size` mounted on `dir` for one test, unmounted when dropped; `None` where this
/// process may not mount (not root, no CAP_SYS_ADMIN in a container).
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &std::path::Path, size: &str) -> Option<SmallDisk> {
        std::fs::create_dir_all(dir).expect("mount point");
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"]).arg(dir).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        ok.then(|| SmallDisk(dir.to_path_buf()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system of `dir` to the last byte (a file of `dir` written until ENOSPC).
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).expect("filler");
    let block = vec![0u8; 64 * 1024];
    let mut size = block.len();
    while size > 0 {
        match f.write(&block[..size]) {
            Ok(0) => size /= 2,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => size /= 2,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    path
}

/// A `zonewatch serve` child whose stderr is read as it comes (a full pipe never blocks it),
/// killed and reaped if the test ends without stopping it.
struct Serving {
    child: std::process::Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    /// The thread reading its stderr, joined once it has exited (its last lines read).
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Serving {
    fn start(config: &str) -> Serving {
        let mut child = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["serve", "--config", config]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("serve starts");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (mut stderr, sink) = (child.stderr.take().expect("stderr"), log.clone());
        let reader = std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Serving { child, log, reader: Some(reader) }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Its exit status once it has exited, waiting up to `within`.
    fn exited_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return Some(s);
            }
            if start.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, and its exit status (within 15 s).
    fn stop(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let status = self.exited_within(Duration::from_secs(15));
        status.unwrap_or_else(|| panic!("serve did not stop after SIGTERM:\n{}", self.log()))
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A full disk under a running `serve` (a tmpfs of its own holding the store; root only):
/// the rezoning published meanwhile is not lost. Its run fails, nothing of it committed, and
/// either `serve` goes on (the failure recorded: the run's spill file, beside the store, is what
/// meets the full disk first, as in this test's runs) or, once redb refuses the file after an
/// I/O error, stops by itself with exit 1 (the packaged unit restarts it). Once there is room
/// again the rezoning is delivered exactly once, and the store is consistent throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_a_full_disk_loses_nothing_and_goes_on_once_there_is_room() {
    let rx = receiver(200).await;
    let ws = Workspace::new(
        &[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: rx.url("/hook"), min_severity: "info", secret: None }],
        "",
        "every = \"1s\"",
    );
    let Some(_disk) = SmallDisk::mount(&ws.path().join("disk"), "16m") else {
        eprintln!("SKIPPED serve_on_a_full_disk_loses_nothing_and_goes_on_once_there_is_room: cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)");
        return;
    };
    ws.edit_config("path = \"zw.redb\"", "path = \"disk/zw.redb\"");
    let cfg = ws.config_path();
    let cfg = cfg.to_str().unwrap();
    let v1 = grid(400);
    ws.write_layer(&layer(&v1));
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["run", "--config", cfg]).output().expect("run");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("baseline features=400"), "{}", String::from_utf8_lossy(&o.stderr));

    let mut serving = Serving::start(cfg);
    assert!(serving.exited_within(Duration::from_millis(1500)).is_none(), "serve started:\n{}", serving.log());
    let filler = fill(&ws.path().join("disk"));
    let mut v2 = v1.clone();
    v2[7].zone = "C3".into();
    ws.write_layer(&layer(&v2));
    // Several scheduled runs on the full disk: each fails, or serve stops.
    let stopped = serving.exited_within(Duration::from_secs(6));
    assert!(rx.received().is_empty(), "nothing is sent of a run that could not commit");
    eprintln!("on the full disk serve {}", if stopped.is_some() { "stopped by itself" } else { "went on" });
    std::fs::remove_file(&filler).expect("room again");
    // The log of a serve that stopped by itself (then started again).
    let mut earlier = String::new();
    if let Some(status) = stopped {
        earlier = serving.log();
        assert_eq!(status.code(), Some(1), "{earlier}");
        assert!(earlier.contains("the store refuses work after an I/O error (a full disk?) until it is opened again"), "{earlier}");
        // What the service manager does: start it again.
        serving = Serving::start(cfg);
    }
    let start = Instant::now();
    while rx.received().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(30), "the rezoning was never delivered once there was room:\n{}", serving.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let status = serving.stop();
    let log = format!("{earlier}{}", serving.log());
    assert!(status.success(), "{log}");
    if stopped.is_none() {
        // It stayed up: its runs on the full disk failed, saying why.
        assert!(log.contains("No space left on device"), "{log}");
    }
    let received = rx.received();
    assert_eq!(received.len(), 1, "exactly once: {received:?}");
    let body = String::from_utf8_lossy(&received[0].body);
    assert!(body.contains("\"C3\""), "{body}");
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["check", "--config", cfg, "--store"]).output().expect("check");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("consistent"), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}
