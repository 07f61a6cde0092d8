//! `zonewatch dlq list|show|replay|recover|release`: the operator's view of dead letters and the
//! way back into the outbox.

use crate::model::DeadLetter;
use crate::notify::replay;
use crate::notify::delivery::Deliverer;
use crate::util::{parse_duration, parse_rfc3339, rfc3339};
use super::open::{close_before_printing, open_existing_engine};
use clap::Subcommand;
use std::path::PathBuf;
use std::time::Instant;

/// The `dlq` subcommands.
#[derive(Subcommand, Debug)]
pub enum DlqAction {
    /// Dead letters (and quarantined ones) with their reasons.
    List {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        /// Dead since this time (RFC 3339, or a duration meaning "ago", e.g. `2h`).
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        until: Option<String>,
    },
    /// One dead letter (by outbox id or idempotency key): its payload and every attempt.
    Show {
        id_or_key: String,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
    /// Re-submit dead letters under their original key, oldest observation first.
    Replay {
        /// Outbox ids; none means every dead letter in the time window.
        ids: Vec<u64>,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        until: Option<String>,
        /// Replays per second (token bucket).
        #[arg(long, default_value_t = 5.0)]
        rate: f64,
    },
    /// Re-queue what failed and never succeeded inside a time window, capped in count.
    Recover {
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        since: String,
        #[arg(long)]
        until: Option<String>,
        #[arg(long, default_value_t = 1000)]
        max: usize,
        #[arg(long, default_value_t = 5.0)]
        rate: f64,
    },
    /// Take quarantined dead letters back to the dead letters (their replay count starts
    /// over), once what put them there is fixed; `dlq replay` then sends them.
    Release {
        /// Outbox ids of quarantined dead letters (`dlq list` shows them).
        #[arg(required = true)]
        ids: Vec<u64>,
        /// The config file (the package's is /etc/zonewatch/zonewatch.toml)
        #[arg(long)]
        config: PathBuf,
    },
}

/// RFC 3339 time or a duration before now.
fn parse_time(flag: &str, v: &str, now_ms: u64) -> Result<u64, String> {
    if let Some(t) = parse_rfc3339(v) {
        return Ok(t);
    }
    parse_duration(v)
        .map(|d| now_ms.saturating_sub(d.as_millis() as u64))
        .map_err(|_| format!("--{flag} {v:?} is neither an RFC 3339 time nor a duration like 2h"))
}

/// The `--since` / `--until` window; relative durations count back from `now_ms` (the
/// command line is an edge of the program: it reads the system clock once and passes it in).
fn window(since: Option<&str>, until: Option<&str>, now_ms: u64) -> Result<(u64, u64), String> {
    let s = since.map(|v| parse_time("since", v, now_ms)).transpose()?.unwrap_or(0);
    let u = until.map(|v| parse_time("until", v, now_ms)).transpose()?.unwrap_or(u64::MAX);
    if s > u {
        return Err("--since is after --until".into());
    }
    Ok((s, u))
}

fn line(state: &str, d: &DeadLetter) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        d.entry.id,
        state,
        rfc3339(d.dead_at_ms),
        d.entry.watcher_id,
        crate::util::terminal_safe(&d.entry.parcel_id),
        d.entry.attempts,
        crate::util::terminal_safe(&d.reason),
        d.entry.key
    )
}

/// Runs a `dlq` subcommand; returns the exit code (0 ok, 1 failure, 2 config/store/usage).
pub(super) fn cmd_dlq(action: DlqAction) -> i32 {
    match action {
        DlqAction::List { config, since, until } => {
            let (s, u) = match window(since.as_deref(), until.as_deref(), crate::clock::Clock::now_ms(&crate::clock::SystemClock)) {
                Ok(w) => w,
                Err(e) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            let engine = match open_existing_engine(&config) {
                Ok(e) => e,
                Err(c) => return c,
            };
            let (dead, quarantined) = match (engine.store.dead_letters(), engine.store.dlq_quarantine()) {
                (Ok(d), Ok(q)) => (d, q),
                (Err(e), _) | (_, Err(e)) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            close_before_printing(engine);
            println!("id\tstate\tdead_at\twatcher\tparcel\tattempts\treason\tkey");
            for (state, list) in [("dead", &dead), ("quarantined", &quarantined)] {
                for d in list.iter().filter(|d| d.dead_at_ms >= s && d.dead_at_ms <= u) {
                    println!("{}", line(state, d));
                }
            }
            0
        }
        DlqAction::Show { id_or_key, config } => {
            let engine = match open_existing_engine(&config) {
                Ok(e) => e,
                Err(c) => return c,
            };
            let all = match (engine.store.dead_letters(), engine.store.dlq_quarantine()) {
                (Ok(d), Ok(q)) => d.into_iter().map(|d| ("dead", d)).chain(q.into_iter().map(|d| ("quarantined", d))).collect::<Vec<_>>(),
                (Err(e), _) | (_, Err(e)) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            let found = all.iter().find(|(_, d)| d.entry.id.to_string() == id_or_key || d.entry.key.0 == id_or_key);
            let key = found.map(|(_, d)| d.entry.key.0.clone()).unwrap_or_else(|| id_or_key.clone());
            let attempts = match engine.store.attempts(&key) {
                Ok(a) => a,
                Err(e) => {
                    error_line!("{e}");
                    return 2;
                }
            };
            if found.is_none() && attempts.is_empty() {
                error_line!("no dead letter or delivery attempt for {id_or_key:?}");
                return 1;
            }
            let replays = found.map(|(_, d)| engine.store.replay_count(&d.entry.key.0).unwrap_or(0)).unwrap_or(0);
            close_before_printing(engine);
            if let Some((state, d)) = found {
                println!("dead letter {} ({state})", d.entry.id);
                println!("  key:       {}", d.entry.key);
                println!("  watcher:   {}  target: {}", d.entry.watcher_id, crate::util::url_for_display(&d.entry.target));
                // Feed text (parcel ids, codes in the payload) and a receiver's answer are shown
                // escaped: neither may drive the operator's terminal.
                let safe = crate::util::terminal_safe;
                println!("  parcel:    {}  source: {}  lineage: {}", safe(&d.entry.parcel_id), safe(&d.entry.source_id), safe(&d.entry.lineage_id));
                println!("  reason:    {}  at {}", safe(&d.reason), rfc3339(d.dead_at_ms));
                println!("  replays:   {replays}");
                println!("  payload:   {}", safe(&String::from_utf8_lossy(&d.entry.body())));
            }
            println!("attempts of {key}:");
            println!("  #\tat\tresult\tstatus\tduration_ms\terror\tresponse (first 2 KiB)");
            for a in attempts {
                println!(
                    "  {}\t{}\t{}\t{}\t{}\t{}\t{}",
                    a.attempt,
                    rfc3339(a.ts_ms),
                    a.result,
                    a.status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                    a.duration_ms,
                    crate::util::terminal_safe(&a.error.unwrap_or_default()),
                    crate::util::terminal_safe(&a.response_head.replace(['\n', '\r', '\t'], " "))
                );
            }
            0
        }
        DlqAction::Replay { ids, config, since, until, rate } => run_replay(&config, ids, since, until, rate, None),
        DlqAction::Recover { config, since, until, max, rate } => run_replay(&config, vec![], Some(since), until, rate, Some(max)),
        DlqAction::Release { ids, config } => release(&config, &ids),
    }
}

/// `dlq release`: each id named, out of quarantine. An id that is not quarantined fails the
/// command after the others are released, saying what it is.
fn release(config: &std::path::Path, ids: &[u64]) -> i32 {
    let engine = match open_existing_engine(config) {
        Ok(e) => e,
        Err(c) => return c,
    };
    let outcomes = match engine.store.release_quarantined(ids, engine.now()) {
        Ok(o) => o,
        Err(e) => {
            error_line!("releasing dead letters: {}", super::open::store_error_text(&engine.config.store_path, &e));
            return super::open::store_exit_code(&e);
        }
    };
    let mut released = Vec::new();
    let mut missing = Vec::new();
    for (id, outcome) in outcomes {
        match outcome {
            crate::store::ReleaseOutcome::Released { was } => released.push((id, was)),
            crate::store::ReleaseOutcome::NotFound => missing.push(id),
        }
    }
    let dead: Vec<u64> = if missing.is_empty() { Vec::new() } else { engine.store.dead_letters().map(|d| d.iter().map(|d| d.entry.id).collect()).unwrap_or_default() };
    close_before_printing(engine);
    for (id, was) in &released {
        println!("released {id} (was: {}); `zonewatch dlq replay {id}` sends it again", crate::util::terminal_safe(was));
    }
    for id in &missing {
        if dead.contains(id) {
            error_line!("dead letter {id} is not quarantined: `zonewatch dlq replay {id}` replays it");
        } else {
            error_line!("no quarantined dead letter {id}");
        }
    }
    if missing.is_empty() {
        0
    } else {
        1
    }
}

fn run_replay(config: &std::path::Path, ids: Vec<u64>, since: Option<String>, until: Option<String>, rate: f64, cap: Option<usize>) -> i32 {
    if !(rate.is_finite() && rate > 0.0) {
        error_line!("--rate must be a positive number of replays per second");
        return 2;
    }
    let (s, u) = match window(since.as_deref(), until.as_deref(), crate::clock::Clock::now_ms(&crate::clock::SystemClock)) {
        Ok(w) => w,
        Err(e) => {
            error_line!("{e}");
            return 2;
        }
    };
    let engine = match open_existing_engine(config) {
        Ok(e) => e,
        Err(c) => return c,
    };
    let mut letters: Vec<DeadLetter> = match engine.store.dead_letters() {
        Ok(d) => d,
        Err(e) => {
            error_line!("{e}");
            return 2;
        }
    };
    letters.retain(|d| (ids.is_empty() || ids.contains(&d.entry.id)) && d.dead_at_ms >= s && d.dead_at_ms <= u);
    // An id named but not found fails the command (after the others are replayed): a script
    // must not read "done" when what it asked for was not there.
    let mut missing = 0;
    let quarantined: Vec<u64> = if ids.iter().any(|id| !letters.iter().any(|d| d.entry.id == *id)) {
        engine.store.dlq_quarantine().map(|q| q.iter().map(|d| d.entry.id).collect()).unwrap_or_default()
    } else {
        Vec::new()
    };
    for id in &ids {
        if quarantined.contains(id) {
            error_line!("dead letter {id} is quarantined (replayed past max_replays, or its geometry is invalid): replay does not take it; `dlq show {id}` shows why, `dlq release {id}` takes it out once that is fixed");
            missing += 1;
        } else if !letters.iter().any(|d| d.entry.id == *id) {
            if since.is_some() || until.is_some() {
                error_line!("no dead letter {id} in the window --since/--until give");
            } else {
                error_line!("no dead letter {id}");
            }
            missing += 1;
        }
    }
    // Dead letters whose subscriber does not exist are left as they are (`waits_for_subscriber`).
    let (waiting, mut letters): (Vec<DeadLetter>, Vec<DeadLetter>) = letters.into_iter().partition(|d| replay::waits_for_subscriber(d, &engine.subscribers));
    for d in &waiting {
        if ids.contains(&d.entry.id) {
            error_line!(
                "dead letter {}: no subscriber {:?} exists (deleted, or removed from the config): not replayed, which would only dead-letter it again and count toward max_replays; replay it once a subscriber of that id exists",
                d.entry.id,
                crate::util::terminal_safe(&d.entry.watcher_id)
            );
            missing += 1;
        }
    }
    let unnamed = waiting.iter().filter(|d| !ids.contains(&d.entry.id)).count();
    if unnamed > 0 {
        note_line!("{unnamed} dead letter(s) not replayed: no subscriber of their id exists (deleted, or removed from the config); they wait for one");
    }
    if let Some(cap) = cap {
        letters.sort_by_key(|d| (replay::observed_ms(d), d.entry.id));
        if letters.len() > cap {
            note_line!("{} dead letters in the window; recovering the oldest {cap} (--max)", letters.len());
            letters.truncate(cap);
        }
    }
    let rt = match crate::util::async_runtime(true) {
        Ok(rt) => rt,
        Err(e) => {
            error_line!("cannot start the runtime: {e}");
            return 1;
        }
    };
    let cfg = engine.config.delivery.clone();
    let code = rt.block_on(async {
        let deliverer = match Deliverer::new(engine.store.clone(), engine.subscribers.clone(), cfg.clone()).map(|d| d.with_clock(engine.clock.clone())) {
            Ok(d) => d,
            Err(e) => {
                error_line!("{e}");
                return 1;
            }
        };
        match replay::replay(&engine.store, &deliverer, letters, rate, cfg.max_replays, Instant::now() + cfg.run_wait).await {
            Ok(r) => {
                let remaining = engine.store.outbox_len().unwrap_or(0);
                println!(
                    "{}: requeued={} duplicates={} quarantined={} sent={} retried={} dead_letters={} gone={} no_subscriber={} outbox_remaining={remaining}{}",
                    // Named as the operator typed it (bb27: `dlq recover` said "replay:").
                    if cap.is_some() { "recover" } else { "replay" },
                    r.requeued,
                    r.duplicates,
                    r.quarantined,
                    r.delivery.sent,
                    r.delivery.retried,
                    r.delivery.dead,
                    r.delivery.gone,
                    waiting.len(),
                    if r.delivery.deferred > 0 { format!(" deferred={}", r.delivery.deferred) } else { String::new() }
                );
                // Requeued rows that did not go out wait in the outbox, not in the dead
                // letters: say where, and what holds them (a breaker still open after the
                // receiver was fixed, a disabled endpoint), or `dlq list` empty reads as done.
                if r.requeued > 0 && remaining > 0 {
                    let now = engine.now();
                    let held: Vec<String> = engine
                        .store
                        .endpoints()
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|(id, e)| match (e.disabled, e.breaker_open_until_ms) {
                            (true, _) => Some(format!("subscriber {0} disabled: zonewatch endpoints enable {0}", crate::util::terminal_safe(&id))),
                            (false, Some(t)) if t > now => Some(format!("subscriber {}: breaker open until {}", crate::util::terminal_safe(&id), crate::util::rfc3339(t))),
                            _ => None,
                        })
                        .collect();
                    let why = if held.is_empty() { String::from("retries not yet due") } else { held.join(", ") };
                    note_line!("{remaining} alert(s) wait in the outbox, not in the dead letters ({why}): `zonewatch serve` or the next `zonewatch run` sends them");
                }
                if missing > 0 {
                    1
                } else {
                    0
                }
            }
            Err(e) => {
                error_line!("{e}");
                1
            }
        }
    });
    // A step of the clock its delivery saw is stored (`Engine::settle_clock_watch`).
    engine.settle_clock_watch();
    code
}
