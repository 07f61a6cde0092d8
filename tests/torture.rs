//! Kill -9 torture: `zonewatch serve` runs as a child process against a real loopback receiver
//! (slow-ish, sometimes 503) while layer versions producing a few hundred alerts for three
//! subscribers are published; the child is killed with SIGKILL at random moments and restarted
//! each time. At the end every expected (subscriber, change) pair was received at least once,
//! every duplicate carries the same `webhook-id`, the outbox is empty and no lease is left, and
//! the audit ledger holds exactly one terminal row per queued key.
//!
//! The suite runs a short version (6 kills). The long version:
//!
//! ```sh
//! ZONEWATCH_TORTURE_KILLS=30 cargo test --release --test torture -- --nocapture
//! ```
//! (or `scripts/torture 30`). `ZONEWATCH_TORTURE_SEED` repeats a run's kill timing.

mod common;
use common::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zonewatch::receiver::{Receiver, Reply};

/// Tiny deterministic generator so a failing run can be repeated with its seed.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        lo + (self.0 >> 33) % (hi - lo + 1)
    }
}

fn start_serve(ws: &Workspace, n: usize) -> Child {
    let log = std::fs::File::create(ws.path().join(format!("serve-{n}.log"))).expect("log file");
    Command::new(env!("CARGO_BIN_EXE_zonewatch"))
        .args(["serve", "--config", ws.config_path().to_str().expect("utf-8 path")])
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("serve starts")
}

fn serve_log(ws: &Workspace, n: usize) -> String {
    std::fs::read_to_string(ws.path().join(format!("serve-{n}.log"))).unwrap_or_default()
}

/// Whether this log shows a committed (or already-committed) run of the current file.
fn committed_in(log: &str) -> bool {
    log.lines().any(|l| l.contains("s1: baseline") || l.contains("s1: run") || l.contains("s1: identical"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_torture_loses_nothing_and_duplicates_carry_the_same_id() {
    let kills: usize = std::env::var("ZONEWATCH_TORTURE_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(6);
    let seed: u64 = std::env::var("ZONEWATCH_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| zonewatch::clock::Clock::now_ms(&zonewatch::clock::SystemClock));
    println!("torture: kills={kills} seed={seed}");
    let mut rng = Lcg(seed);

    // Slow-ish answers (5–40 ms) and every 10th request a 503, so kills land mid-request and
    // retries are in the outbox when they do.
    let rx = Receiver::start_replies(
        Arc::new(|n, _| Reply {
            status: if n % 10 == 7 { 503 } else { 200 },
            delay: Duration::from_millis(5 + (n as u64 * 7919) % 36),
            ..Default::default()
        }),
        None,
    )
    .await
    .expect("receiver");
    let url = rx.url("/hook");
    // grid(300): 20 columns × 15 rows of 0.001° cells from (-71.10, 42.36), squares of 0.0009°.
    let subs = [
        Sub { id: "all", aoi: rect(-71.2, 42.3, -71.0, 42.5), target: url.clone(), min_severity: "info", secret: None },
        Sub { id: "west", aoi: rect(-71.2, 42.3, -71.09005, 42.5), target: url.clone(), min_severity: "info", secret: None },
        Sub { id: "south", aoi: rect(-71.2, 42.3, -71.0, 42.36695), target: url.clone(), min_severity: "info", secret: None },
    ];
    let ws = Workspace::new(
        &subs,
        "retry_schedule = [\"50ms\", \"100ms\", \"200ms\", \"300ms\"]",
        "every = \"1s\"",
    );
    ws.edit_config("max_attempts = 3", "max_attempts = 40");
    let matches = |sub: &str, i: usize| -> bool {
        let (col, row) = (i % 20, i / 20);
        match sub {
            "all" => true,
            "west" => col < 10,
            _ => row < 7,
        }
    };

    // v1 baseline; each later version rezones one third of the parcels to a new code (the
    // long version publishes more versions so deliveries keep flowing through more kills).
    let codes = ["C3", "M-1", "R-5", "C-2", "I-1", "R-7", "M-2", "C-4", "B-1", "R-9"];
    let n_versions = (1 + kills / 4).clamp(2, codes.len());
    let mut versions = vec![grid(300)];
    let mut expected: BTreeSet<(String, String, String)> = BTreeSet::new();
    for (k, code) in codes.iter().enumerate().take(n_versions) {
        let mut v = versions[k].clone();
        for i in (k % 3..300).step_by(3) {
            v[i].zone = code.to_string();
            for s in &subs {
                if matches(s.id, i) {
                    expected.insert((s.id.to_string(), v[i].id.clone(), code.to_string()));
                }
            }
        }
        versions.push(v);
    }
    let versions: Vec<String> = versions.iter().map(|v| layer(v)).collect();
    let write_version = |k: usize| {
        let tmp = ws.path().join("layer.geojson.tmp");
        std::fs::write(&tmp, &versions[k]).expect("write layer");
        std::fs::rename(&tmp, ws.path().join("layer.geojson")).expect("rename layer");
    };

    let mut stage = 0;
    write_version(0);
    let mut starts = 0;
    let mut kills_mid_delivery = 0;
    let started = Instant::now();
    for _ in 0..kills {
        let mut child = start_serve(&ws, starts);
        let before = rx.received().len();
        let sleep = rng.next(150, 900);
        tokio::time::sleep(Duration::from_millis(sleep)).await;
        let during = rx.received().len();
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        if during > before {
            kills_mid_delivery += 1;
        }
        let log = serve_log(&ws, starts);
        if committed_in(&log) && stage + 1 < versions.len() {
            stage += 1;
            write_version(stage);
        }
        starts += 1;
    }
    // Make sure every version gets published, still killing now and then.
    while stage + 1 < versions.len() {
        let mut child = start_serve(&ws, starts);
        let t = Instant::now();
        while !committed_in(&serve_log(&ws, starts)) {
            assert!(t.elapsed() < Duration::from_secs(30), "serve never committed a run:\n{}", serve_log(&ws, starts));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        stage += 1;
        write_version(stage);
        starts += 1;
    }

    // Let a final process finish the work, then stop it cleanly and inspect the store.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut child = start_serve(&ws, starts);
        let t = Instant::now();
        loop {
            let got: BTreeSet<_> = rx.received().iter().filter_map(pair_of).collect();
            if committed_in(&serve_log(&ws, starts)) && expected.is_subset(&got) {
                break;
            }
            if t.elapsed() > Duration::from_secs(30) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Give outcomes of the last requests time to be recorded, then SIGTERM.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let pid = child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().expect("kill -TERM");
        child.wait().expect("reap");
        starts += 1;
        let engine = ws.engine();
        let left = engine.store.outbox_len().expect("outbox");
        drop(engine);
        if left == 0 || Instant::now() > deadline {
            break;
        }
    }

    // ---- the proof ----
    let received = rx.received();
    let mut ids_by_pair: BTreeMap<(String, String, String), BTreeSet<String>> = BTreeMap::new();
    let mut body_by_id: HashMap<String, Vec<u8>> = HashMap::new();
    let mut acked: BTreeSet<(String, String, String)> = BTreeSet::new();
    for (n, r) in received.iter().enumerate() {
        let pair = pair_of(r).expect("every request is a zoning.change body");
        if n % 10 != 7 {
            acked.insert(pair.clone());
        }
        let id = r.header("webhook-id").expect("webhook-id header").to_string();
        if let Some(b) = body_by_id.insert(id.clone(), r.body.clone()) {
            assert_eq!(b, r.body, "a resend of {id} must carry the same bytes");
        }
        ids_by_pair.entry(pair).or_default().insert(id);
    }
    let missing: Vec<_> = expected.iter().filter(|p| !acked.contains(*p)).collect();
    assert!(missing.is_empty(), "{} expected pairs never received with a 200, e.g. {:?}", missing.len(), missing.first());
    let unexpected: Vec<_> = ids_by_pair.keys().filter(|p| !expected.contains(*p)).collect();
    assert!(unexpected.is_empty(), "unexpected deliveries: {unexpected:?}");
    for (pair, ids) in &ids_by_pair {
        assert_eq!(ids.len(), 1, "{pair:?} was sent under more than one webhook-id: {ids:?}");
    }
    let engine = ws.engine();
    assert_eq!(engine.store.outbox_len().unwrap(), 0, "the outbox is empty");
    assert_eq!(engine.store.check_consistency().unwrap().leases, 0, "no lease in the file");
    let rows = engine.store.audit(&Default::default()).unwrap();
    let mut queued: BTreeMap<String, usize> = BTreeMap::new();
    let mut terminal: BTreeMap<String, usize> = BTreeMap::new();
    let (mut sent, mut dead) = (0, 0);
    for r in &rows {
        let Some(k) = r.idempotency_key.clone() else { continue };
        match r.outcome.as_str() {
            "queued" => *queued.entry(k).or_default() += 1,
            "sent" => {
                sent += 1;
                *terminal.entry(k).or_default() += 1
            }
            "dead_letter" => {
                dead += 1;
                *terminal.entry(k).or_default() += 1
            }
            _ => {}
        }
    }
    assert_eq!(queued.len(), expected.len(), "one queued key per expected pair");
    for (k, n) in &queued {
        assert_eq!(*n, 1, "key {k} queued {n} times");
        assert_eq!(terminal.get(k), Some(&1), "key {k} must have exactly one terminal row");
    }
    assert_eq!(terminal.len(), queued.len(), "no terminal row without a queued claim");
    assert_eq!(dead, 0, "the receiver always answers 200 eventually: nothing may be dead-lettered");
    // Every webhook-id that arrived is a claimed key.
    for id in body_by_id.keys() {
        assert!(queued.contains_key(id), "received id {id} was never claimed");
    }
    let duplicates = received.len() - body_by_id.len();
    println!(
        "torture: kills={kills} (mid-delivery {kills_mid_delivery}) starts={starts} expected_pairs={} requests={} unique_ids={} \
         resends(503 retries + crash duplicates)={duplicates} sent={sent} dead_letters={dead} elapsed={:.1}s",
        expected.len(),
        received.len(),
        body_by_id.len(),
        started.elapsed().as_secs_f64()
    );
}

/// (subscriber, parcel, new zoning) of a received webhook.
fn pair_of(r: &zonewatch::receiver::Received) -> Option<(String, String, String)> {
    let v = r.json()?;
    let d = v.get("data")?;
    Some((
        d.get("watcher_id")?.as_str()?.to_string(),
        d.get("parcel_id")?.as_str()?.to_string(),
        d.get("to")?.as_str()?.to_string(),
    ))
}
