//! Lifecycle edges of issue 6: `serve` keeps a SIGHUP / SIGINT it inherited as ignored, a
//! second signal makes `serve` exit at once (the outbox makes
//! that safe: nothing in flight is lost), a signal stops `run` without waiting out its
//! retries, and a damaged store or one of an unknown format
//! version is refused with a message pointing at `zonewatch restore`.

mod common;
use common::*;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zonewatch::receiver::{Receiver, Reply};

fn zonewatch_run(ws: &Workspace) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["run", "--config", ws.config_path().to_str().expect("utf-8")])
        .output()
        .expect("binary runs");
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The exit status as a shell reports it: the exit code, or 128 + the signal that killed it.
fn shell_code(status: std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.code().or(status.signal().map(|s| 128 + s))
}

/// Waits (at most `within`) for `child` to exit, failing with `what` if it does not: its exit
/// status and what it wrote on stderr.
fn wait_exit(child: &mut std::process::Child, within: Duration, what: &str) -> (std::process::ExitStatus, String) {
    let since = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(since.elapsed() < within, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).expect("stderr");
    }
    (status, err)
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().expect("kill runs").success();
    assert!(ok, "kill {sig}");
}

/// A workspace whose one subscriber `w` posts to `url`, its layer's baseline run, and then a
/// version with three rezonings written for the next run to alert on.
fn three_rezonings_pending(url: String, extra_delivery: &str, extra_source: &str) -> Workspace {
    let ws = Workspace::new(&[Sub { id: "w", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: url, min_severity: "info", secret: None }], extra_delivery, extra_source);
    let v1 = grid(40);
    ws.write_layer(&layer(&v1));
    run(&ws.engine(), false);
    let mut v2 = v1.clone();
    for p in v2.iter_mut().take(3) {
        p.zone = "M-1".into();
    }
    ws.write_layer(&layer(&v2));
    ws
}

/// Waits (at most 30 s) until `rx` has `n` requests.
fn wait_received(rx: &Receiver, n: usize) {
    let start = Instant::now();
    while rx.received().len() < n {
        assert!(start.elapsed() < Duration::from_secs(30), "deliveries never started ({} received)", rx.received().len());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `zonewatch run`, sends it `sig` once `rx` has `after` requests, and waits (at
/// most 8 s) for it to exit: its exit code, stdout and stderr.
fn run_signalled(ws: &Workspace, rx: &Receiver, after: usize, sig: &str) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["run", "--config", ws.config_path().to_str().expect("utf-8")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run starts");
    wait_received(rx, after);
    signal(&child, sig);
    let (status, err) = wait_exit(&mut child, Duration::from_secs(8), &format!("run kept going 8 s after {sig}"));
    use std::io::Read;
    let mut out = String::new();
    child.stdout.take().expect("stdout").read_to_string(&mut out).expect("stdout");
    (status, out, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once_and_loses_nothing() {
    // A receiver that takes far longer than the test waits: deliveries stay in flight.
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, delay: Duration::from_secs(60), ..Default::default() }), None)
        .await
        .expect("receiver");
    // Baseline before the daemon starts, then a version with three rezonings.
    let ws = three_rezonings_pending(rx.url("/hook"), "", "every = \"1h\"");
    ws.edit_config("timeout_ms = 2000", "timeout_ms = 120000");
    let mut child = Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["serve", "--config", ws.config_path().to_str().expect("utf-8")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    tokio::task::block_in_place(|| wait_received(&rx, 3));
    // First signal: the daemon starts a graceful stop and waits for its in-flight sends
    // (up to a minute here). Second signal: it exits at once.
    signal(&child, "-TERM");
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().expect("wait").is_none(), "the first signal must not kill in-flight sends at once");
    signal(&child, "-TERM");
    let (status, log) = wait_exit(&mut child, Duration::from_secs(10), "serve did not exit after a second signal");
    // Killed by the second signal, as a shell sees it (143: SIGTERM).
    use std::os::unix::process::ExitStatusExt;
    assert_eq!((status.code(), status.signal()), (None, Some(15)), "{log}");
    assert!(log.contains("stopping") && log.contains("exiting now"), "{log}");

    // Nothing lost: the three events are still queued (their leases died with the process),
    // the store is consistent, and nothing was recorded as sent.
    let engine = ws.engine();
    assert_eq!(engine.store.outbox_len().expect("outbox"), 3);
    let report = engine.store.check_consistency().expect("check");
    assert!(report.is_consistent() && report.leases == 0, "{:?}", report.problems);
    assert_eq!(outcomes(&engine).get("sent"), None);
    let report = engine.store.check_consistency().expect("check");
    assert!(report.is_consistent(), "{:?}", report.problems);
}

/// `serve` started the way `nohup` or a non-interactive shell's `&` start it — SIGHUP and
/// SIGINT inherited as ignored — keeps them ignored (a terminal's hangup or a Ctrl-C meant for
/// the foreground must not stop a daemon), and still stops cleanly on SIGTERM: exit 0, what
/// was sent recorded as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_keeps_inherited_ignores_and_stops_cleanly_on_sigterm() {
    let rx = Receiver::start(Arc::new(|_, _| 200), None).await.expect("receiver");
    let ws = three_rezonings_pending(rx.url("/hook"), "", "every = \"1h\"");
    let mut child = Command::new("sh")
        .args(["-c", "trap '' HUP INT; exec \"$0\" serve --config \"$1\"", env!("CARGO_BIN_EXE_zonewatch"), ws.config_path().to_str().expect("utf-8")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    tokio::task::block_in_place(|| wait_received(&rx, 3));
    signal(&child, "-HUP");
    signal(&child, "-INT");
    std::thread::sleep(Duration::from_millis(700));
    assert!(child.try_wait().expect("wait").is_none(), "an inherited ignore of SIGHUP / SIGINT was overridden");
    signal(&child, "-TERM");
    let (status, log) = wait_exit(&mut child, Duration::from_secs(10), "serve did not stop on SIGTERM");
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("stopping") && !log.contains("exiting now"), "{log}");
    let engine = ws.engine();
    assert_eq!(outcomes(&engine).get("sent"), Some(&3), "{log}");
    assert_eq!(engine.store.outbox_len().expect("outbox"), 0);
}

/// A signal while `run` waits for retries (here ten seconds off, with a minute of
/// `run_wait`) stops it at once: it dies by SIGINT (a shell's 130), saying so; the failed sends' outcomes are
/// committed and their rows stay queued for the next run; nothing is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_stops_run_without_waiting_for_its_retries() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(503)), None).await.expect("receiver");
    let ws = three_rezonings_pending(rx.url("/hook"), "retry_schedule = [\"10s\"]", "");
    ws.edit_config("run_wait = \"5s\"", "run_wait = \"60s\"");
    let (status, out, err) = tokio::task::block_in_place(|| run_signalled(&ws, &rx, 3, "-INT"));
    // Killed by SIGINT once its store is closed, not `exit(130)`: a script running it stops too.
    use std::os::unix::process::ExitStatusExt;
    assert_eq!((status.code(), status.signal()), (None, Some(2)), "{out}{err}");
    assert!(err.contains("zonewatch: stopping") && err.contains("stopped on a signal"), "{err}");
    assert!(out.contains("s1: ") && out.contains("delivery: sent=0 retried=3 "), "{out}");
    assert_eq!(rx.received().len(), 3, "no retry was sent");
    let engine = ws.engine();
    assert_eq!(engine.store.outbox_len().expect("outbox"), 3, "the events wait for the next run");
    let report = engine.store.check_consistency().expect("check");
    assert!(report.is_consistent(), "{:?}", report.problems);
}

/// A SIGTERM while `run` sends to a slow endpoint one at a time: the send begun finishes and
/// is recorded, the rows leased behind it are not sent (they wait for the next run), exit
/// 143. The next run delivers them, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_leaves_rows_whose_send_has_not_begun_queued() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply { status: 200, delay: Duration::from_secs(1), ..Default::default() }), None).await.expect("receiver");
    let ws = three_rezonings_pending(rx.url("/hook"), "endpoint_concurrency = 1", "");
    let config = ws.config_path();
    let config = config.to_str().expect("utf-8");
    let (status, out, err) = tokio::task::block_in_place(|| run_signalled(&ws, &rx, 1, "-TERM"));
    assert_eq!(shell_code(status), Some(143), "{out}{err}");
    assert!(out.contains("delivery: sent=1 retried=0 dead_letters=0 outbox_remaining=2 "), "{out}");
    assert!(err.contains("2 queued alert(s) wait for the next run"), "{err}");
    assert_eq!(rx.received().len(), 1);
    // The next run sends the two left, and nothing twice.
    let o = Command::new(env!("CARGO_BIN_EXE_zonewatch")).args(["run", "--config", config]).output().expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ids: std::collections::BTreeSet<String> = rx.received().iter().filter_map(|r| r.header("webhook-id").map(str::to_string)).collect();
    assert_eq!((rx.received().len(), ids.len()), (3, 3));
}

#[test]
fn a_damaged_or_foreign_store_is_refused_pointing_at_restore() {
    let ws = Workspace::new(&[], "", "");
    ws.write_layer(&layer(&grid(200)));
    let store_path = ws.path().join("zw.redb");
    assert_eq!(zonewatch_run(&ws).0, Some(0));
    let good = std::fs::read(&store_path).expect("store bytes");

    // Unknown format version.
    {
        let store = zonewatch::store::Store::open(&store_path).expect("open");
        store.force_schema_version(99).expect("force");
    }
    let (code, err) = zonewatch_run(&ws);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("schema version 99") && err.contains("zonewatch restore"), "{err}");
    {
        // Refused, not migrated or rewritten: the version record still says 99.
        let err = zonewatch::store::Store::open(&store_path).expect_err("still refused");
        assert!(err.to_string().contains("99"), "{err}");
    }

    // Not a store at all.
    std::fs::write(&store_path, b"this is not a redb file, it is a text file that got in the way").expect("write");
    let (code, err) = zonewatch_run(&ws);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("zonewatch restore"), "{err}");

    // A real store with its header zeroed, and one cut short.
    let mut damaged = good.clone();
    for b in damaged.iter_mut().take(4096) {
        *b = 0;
    }
    std::fs::write(&store_path, &damaged).expect("write");
    let (code, err) = zonewatch_run(&ws);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("zonewatch restore"), "{err}");
    std::fs::write(&store_path, &good[..good.len() / 3]).expect("write");
    let (code, err) = zonewatch_run(&ws);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("zonewatch restore"), "{err}");
}

/// The same behind a rate limit (one send every 5 s): the rows waiting for a rate token are
/// not sent, and the run does not wait out their tokens before it stops. (`run_wait` is long
/// here: a token past it is not waited for anyway, and the run would end before the signal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_does_not_wait_out_a_rate_limit() {
    let rx = Receiver::start_replies(Arc::new(|_, _| Reply::status(200)), None).await.expect("receiver");
    let ws = three_rezonings_pending(rx.url("/hook"), "endpoint_rate = 0.2", "");
    ws.edit_config("run_wait = \"5s\"", "run_wait = \"60s\"");
    let (status, out, err) = tokio::task::block_in_place(|| run_signalled(&ws, &rx, 1, "-INT"));
    assert_eq!(shell_code(status), Some(130), "{out}{err}");
    assert!(out.contains("delivery: sent=1 retried=0 dead_letters=0 outbox_remaining=2 "), "{out}");
    assert_eq!(rx.received().len(), 1);
}
