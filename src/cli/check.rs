//! `zonewatch check`: the config, every AOI file, what `run` and `serve` would refuse, and with
//! `--store` the store's cross-table consistency (read-only). Run after every config edit.

use super::open::load_config;
use super::run::disabled_backlog_text;

/// `store`: `None` without `--store`; `Some(None)` for the config's store; `Some(Some(path))`.
pub(super) fn cmd_check(config: &std::path::Path, store: Option<Option<&std::path::Path>>) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // "read", not "ok": the lines below may still find problems in what it names (bb27).
    println!("config {}: read", config.display());
    // Warnings are said, not counted as problems: they may not stop a start, and `check` is
    // also run as another user than the daemon's. The last line says there were some.
    // What `run` and `serve` as this user would refuse in the store (`refusals`) is a warning
    // too, unless this user is the daemon's: the one its store's folder belongs to (the
    // package's `zonewatch`, or whoever runs zonewatch from a folder of their own). There it
    // is a problem: `check` run as the service user said "all good", exit 0, over a start
    // that would fail. (A control token this user may not read stays a warning: only `serve`
    // reads it, and `run` from cron needs none: a reader.)
    let mut warnings = 0usize;
    let mut refusals = 0usize;
    for advice in cfg.advisories() {
        warnings += 1;
        println!("warning: {advice}");
    }
    println!("delivery: {}", cfg.delivery.describe());
    println!("store: {}", cfg.store_path.display());
    let mut bad = 0;
    for s in &cfg.sources {
        let path = match &s.kind {
            crate::config::SourceKind::File { path } => path,
            other => {
                println!(
                    "source {}: {} every={} floor={} stale_after={} max_change_ratio={} fields: {}",
                    s.id,
                    crate::ingest::settings::describe_kind(other),
                    crate::util::format_duration(s.every),
                    crate::util::format_duration(s.floor),
                    crate::util::format_duration(s.stale_after),
                    s.max_change_ratio,
                    s.fields.describe()
                );
                // A private address written in the URL is refused at every fetch unless allowed.
                // The layer's object-id field is known only from the portal (a run refuses it
                // then); the names ArcGIS gives it are warned of here, before a first start
                // fails on them (found by a black-box tester).
                if matches!(other, crate::config::SourceKind::Arcgis { .. }) && ["OBJECTID", "OBJECTID_1", "FID", "OID"].iter().any(|n| s.fields.parcel_id.eq_ignore_ascii_case(n)) {
                    warnings += 1;
                    println!(
                        "warning: source {}: fields.parcel_id = {:?} is the name ArcGIS gives a layer's object-id field; if it is this layer's, every run is refused (object ids are reassigned on republish): configure a stable id field",
                        s.id, s.fields.parcel_id
                    );
                }
                if let Some(url) = crate::ingest::settings::kind_url(other).filter(|u| !cfg.ingest.allow_private_targets && crate::netguard::url_written_private(u)) {
                    bad += 1;
                    println!(
                        "source {}: ERROR url {url} is a private address: every fetch would be refused (set ingest.allow_private_targets = true to read it)",
                        s.id
                    );
                }
                continue;
            }
        };
        // Opened, not only looked for: a layer this user may not read fails every run.
        let (readable, state) = match std::fs::File::open(path) {
            Ok(_) => (true, "exists".to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (false, "MISSING".to_string()),
            Err(e) => (false, format!("NOT READABLE: {e}")),
        };
        println!(
            "source {}: {}kind=file path={} ({state}) every={} max_change_ratio={} fields: {}",
            s.id,
            if readable { "" } else { "ERROR " },
            path.display(),
            crate::util::format_duration(s.every),
            s.max_change_ratio,
            s.fields.describe()
        );
        if !readable {
            bad += 1;
        }
    }
    for s in &cfg.subscribers {
        match crate::notify::aoi::load_aoi_noted(&s.aoi_path) {
            Ok((mp, repaired)) => {
                use geo::{BoundingRect, GeodesicArea};
                // A polygon half the globe wide or more has no meaningful ring area (one from
                // -180 to 180 read as 0 m²: found by a black-box tester): its extent is said.
                // Polygon by polygon: an AOI split at the antimeridian, as it must be, or two
                // far-apart parts are as wide as the globe together, not each.
                let (mut m2, mut wide) = (0.0, Vec::new());
                for polygon in &mp.0 {
                    match polygon.bounding_rect() {
                        Some(r) if r.width() >= 180.0 => wide.push(format!("{:.0}° of longitude by {:.0}° of latitude", r.width(), r.height())),
                        _ => m2 += polygon.geodesic_area_unsigned(),
                    }
                }
                let size = match (wide.is_empty(), m2 > 0.0) {
                    (true, _) => format!("{m2:.0} m²"),
                    (false, false) => wide.join(", "),
                    (false, true) => format!("{m2:.0} m² and {}", wide.join(", ")),
                };
                println!(
                    "subscriber {}: aoi ok ({} polygon(s), {size}) target={} min_severity={} signed={}",
                    s.id,
                    mp.0.len(),
                    crate::util::url_for_display(&s.target),
                    s.min_severity,
                    s.secret.is_some()
                );
                if let Some(note) = repaired {
                    warnings += 1;
                    println!("warning: subscriber {}: AOI {}: {note}", s.id, s.aoi_path.display());
                }
            }
            Err(e) => {
                bad += 1;
                println!("subscriber {}: ERROR {e}", s.id);
            }
        }
        // A private address written in the target is refused at every delivery unless allowed.
        if !cfg.delivery.allow_private_targets && crate::netguard::url_written_private(&s.target) {
            bad += 1;
            println!(
                "subscriber {}: ERROR target {} is a private address: every delivery would be refused (set delivery.allow_private_targets = true to deliver there)",
                s.id,
                crate::util::url_for_display(&s.target)
            );
        }
    }
    // The control token `serve` will use: one that is not a token (too short) is a problem;
    // one this user may not read, or cannot create, a warning (`check` is also run as another
    // user than the daemon's, and only `serve` reads it).
    // Plain HTTP with a bearer token: on an address other machines reach, the token crosses
    // the network in clear (a tester's 0.0.0.0 passed without a word).
    if !cfg.control.listen.ip().is_loopback() {
        warnings += 1;
        println!(
            "warning: control.listen {} is reachable from other machines: the control port is plain HTTP, so its token crosses the network in clear; listen on 127.0.0.1 (or ::1) and reach it through an SSH tunnel or a TLS proxy",
            cfg.control.listen
        );
    }
    let token = &cfg.control.token_file;
    match crate::control::auth::read_token(token) {
        Ok(crate::control::auth::TokenFile::Token(_)) => {
            println!("control: {} token {} ok", cfg.control.listen, token.display());
            if let Some(mode) = crate::control::auth::others_may_read(token) {
                warnings += 1;
                println!("warning: control token {}: every user may read it (mode {mode:o}), and with it steer zonewatch: chmod o-rwx it", token.display());
            }
        }
        Ok(crate::control::auth::TokenFile::Missing) => {
            let folder = crate::util::folder_of(token);
            // A folder not there yet is made by `serve` (as far as it may): not judged here.
            match if folder.is_dir() { tempfile::tempfile_in(folder).map(drop) } else { Ok(()) } {
                Ok(()) => println!("control: {} token {} (created on first start)", cfg.control.listen, token.display()),
                Err(e) => {
                    warnings += 1;
                    println!(
                        "warning: control token {}: not there yet, and this user cannot create it in {} ({e}): `serve` as this user would refuse to start (create the token, or give the service user that folder)",
                        token.display(),
                        folder.display()
                    );
                }
            }
        }
        // Counted: under the package `serve` may not write there, and it would not start
        // (bb27: `all good` without a warning counted).
        Ok(crate::control::auth::TokenFile::Empty) => {
            warnings += 1;
            println!(
                "warning: control {} token {} holds no token (a first start cut short?): `serve` writes a new one in its place where it may write in that folder; otherwise (the package's /etc/zonewatch) remove it and reinstall or reconfigure the package (dpkg-reconfigure zonewatch), which writes one",
                cfg.control.listen,
                token.display()
            )
        }
        Err(e) if std::fs::File::open(token).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) => {
            warnings += 1;
            println!(
                "warning: control token {}: this user may not read it ({e}): `serve` as this user would refuse to start (check may be run as another user than the service's)",
                token.display()
            );
        }
        Err(e) => {
            bad += 1;
            println!("control: ERROR {e}");
        }
    }
    // Where the store goes, without opening it: a `[store] path` naming a folder, or an empty
    // file (a store cut to nothing, which `run` and `serve` refuse), fails here already.
    match std::fs::metadata(&cfg.store_path) {
        Ok(m) if m.is_dir() => {
            bad += 1;
            println!("store: ERROR {} is a folder; `[store] path` names the store file (it is created there)", cfg.store_path.display());
        }
        Ok(m) if m.len() == 0 => {
            bad += 1;
            println!("store: ERROR {}: {}", cfg.store_path.display(), crate::store::EMPTY_STORE_FILE);
        }
        // Not there yet: `run` and `serve` create it, but only in a folder that exists (a
        // mistyped path must not become a new, empty store). Not asked when `--store PATH`
        // checks another file (a backup on another machine than the config's).
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) && !matches!(store, Some(Some(_))) => {
            let folder = crate::util::folder_of(&cfg.store_path);
            match std::fs::metadata(folder) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    bad += 1;
                    println!("store: ERROR {}: {} is not a folder", cfg.store_path.display(), folder.display());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bad += 1;
                    println!(
                        "store: ERROR {}: its folder {} does not exist (`run` and `serve` would refuse it): check `[store] path`, or create the folder (mkdir -p) for a new store",
                        cfg.store_path.display(),
                        folder.display()
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                    bad += 1;
                    println!("store: ERROR {}: a part of its folder {} is a file, not a folder", cfg.store_path.display(), folder.display());
                }
                // Another user than the daemon's may not see the folder: not counted.
                Err(_) => {}
            }
        }
        _ => {}
    }
    // What `run` and `serve` as this user need of the config's store besides its folder
    // (above): reading and writing the file, and making temp files beside it.
    if !matches!(store, Some(Some(_))) {
        for w in store_access_warnings(&cfg.store_path) {
            refusals += 1;
            println!("warning: {w}");
        }
    }
    // The store part is asked for: `check --config` alone is the config check an operator
    // runs after every edit, which must stay quick: it looks at where the store goes
    // (above), never into it.
    match store {
        None => {}
        Some(None) => bad += check_store(&cfg, &cfg.store_path, false, &mut warnings),
        Some(Some(p)) => bad += check_store(&cfg, p, true, &mut warnings),
    }
    if refusals > 0 && runs_as_folder_owner(&cfg.store_path) {
        println!("store: ERROR {refusals} of the store warnings above would stop `run` and `serve`: this user owns the store's folder, and is taken as the user they run as");
        bad += refusals;
    } else {
        warnings += refusals;
    }
    if bad > 0 {
        error_line!("{bad} problem(s) found");
        2
    } else {
        let seen = match warnings {
            0 => String::new(),
            n => format!(" ({n} warning(s) above)"),
        };
        println!("all good: {} source(s), {} subscriber(s){seen}", cfg.sources.len(), cfg.subscribers.len());
        0
    }
}

/// Whether this process runs as the user that owns the folder of the store at `path`: taken
/// as the user `run` and `serve` are run as. False when the folder cannot be read.
fn runs_as_folder_owner(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(crate::util::folder_of(path)).is_ok_and(|folder| folder.uid() == crate::util::effective_uid())
}

/// What `run` and `serve` as this user would refuse at start in the config's store, besides
/// its folder's existence (the config check's ERROR): a file this user may not read or
/// write, a folder it cannot make temp files in (runs spill there). Warnings, not problems:
/// `check` is also run as another user than the daemon's (an operator's own account), where
/// they say nothing about the service.
fn store_access_warnings(path: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let refused = "`run` and `serve` as this user would refuse to start";
    let denied = |e: &std::io::Error| e.kind() == std::io::ErrorKind::PermissionDenied;
    match std::fs::File::open(path) {
        Err(e) if denied(&e) => out.push(format!("store {}: this user may not read it ({e}): {refused}", path.display())),
        Ok(_) => {
            match std::fs::OpenOptions::new().read(true).write(true).open(path) {
                Err(e) if denied(&e) => out.push(format!("store {}: this user may not write it ({e}): {refused}", path.display())),
                _ => {}
            }
        }
        Err(_) => {}
    }
    let folder = crate::util::folder_of(path);
    if folder.is_dir() {
        if let Err(e) = tempfile::tempfile_in(folder) {
            out.push(format!("store {}: this user cannot make files in {} ({e}): {refused} (runs write their spill files there)", path.display(), folder.display()));
        }
    }
    out
}

/// `check --store`'s part: the cross-table consistency check (`store::check`) on the file,
/// opened read-only (nothing in it changes, an older schema included). Returns the number of
/// problems found. A file not closed cleanly is checked through a temporary copy that redb
/// repairs; one that cannot be repaired, or that redb panics reading, is damaged: a problem.
/// Not checked, and not counted as a problem: a store that a running zonewatch holds open
/// (redb allows one process: check a backup of it instead), one this user may not read, and
/// the config's store before it is first created. A file named on the command line
/// (`explicit`) must exist. Also warns (not a problem) of subscribers created over the
/// control port that a config subscriber of the same id hides.
fn check_store(cfg: &crate::config::Config, path: &std::path::Path, explicit: bool, warnings: &mut usize) -> usize {
    // `check` is also run as another user than the daemon's: a store (or a folder on its
    // path) it may not read is noted (the config's store was warned of already), not
    // counted as a problem.
    match std::fs::File::open(path) {
        // An empty file: the config check said so of the config's store (once, not again in
        // redb's words); one named on the command line is said so here.
        Ok(f) if f.metadata().is_ok_and(|m| m.is_file() && m.len() == 0) => {
            if !explicit {
                return 0;
            }
            println!("store {}: ERROR {}", path.display(), crate::store::EMPTY_STORE_FILE);
            return 1;
        }
        Ok(_) => {}
        // (A folder that is missing or not one is the config check's ERROR, said once.)
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) && !explicit => {
            println!("store {}: not created yet", path.display());
            return 0;
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            if explicit {
                *warnings += 1;
                println!("warning: store {}: not readable by this user, consistency not checked ({e})", path.display());
            } else {
                println!("store {}: consistency not checked (not readable by this user)", path.display());
            }
            return 0;
        }
        Err(e) => {
            println!("store {}: ERROR {e}", path.display());
            return 1;
        }
    }
    // A file that needs repair is checked on a copy in TMPDIR: an interrupted check removes it.
    let _finish = crate::signals::on_signal_remove_scratch();
    // A file damaged so that redb panics reading it is an error like any other.
    let checked = crate::store::guard::guarded(|| crate::store::check::check_file(path)).unwrap_or_else(|p| Err(p.at(path)));
    if matches!(&checked, Ok(r) if r.checked_repaired_copy) {
        println!(
            "store {}: was not closed cleanly; checked a temporary copy that redb repaired (the file itself is unchanged; the next `zonewatch run` or `serve` repairs it the same way)",
            path.display()
        );
    }
    if let Ok(r) = &checked {
        // Not counted as a problem: the control port refuses such a target now, one stored
        // before it did only dead-letters its own events, and the daemon must still start.
        for (id, target) in &r.api_subscriber_targets {
            if !cfg.delivery.allow_private_targets && crate::netguard::url_written_private(target) && !cfg.has_subscriber(id) {
                *warnings += 1;
                println!(
                    "warning: subscriber {id:?} (created over the control port) has target {}, a private address: every delivery to it is refused (delivery.allow_private_targets is false); PUT a new target or DELETE it",
                    crate::util::url_for_display(target)
                );
            }
        }
        if let Some(text) = disabled_backlog_text(&r.disabled_backlog, &|id| cfg.has_subscriber(id) || r.api_subscribers.iter().any(|a| a == id)) {
            *warnings += 1;
            println!("warning: store {}: {text}", path.display());
        }
        for id in crate::pipeline::shadowed_subscribers(cfg, r.api_subscribers.iter().cloned()) {
            *warnings += 1;
            println!(
                "warning: subscriber {id:?} of the config replaces the one of the same id created over the control port (stored in {}): the stored definition is not used",
                path.display()
            );
        }
    }
    match checked {
        Ok(r) if r.is_consistent() => {
            println!(
                "store {}: consistent ({} queued outbox row(s), {} audit row(s), {} watermark(s), {} run(s), {} snapshot parcel(s))",
                path.display(),
                r.outbox_rows,
                r.audit_rows,
                r.watermarks,
                r.runs,
                r.snapshot_parcels
            );
            0
        }
        Ok(r) => {
            for p in &r.problems {
                println!("store {}: PROBLEM {p}", path.display());
            }
            r.problems.len()
        }
        Err(crate::store::StoreError::InUse { .. }) => {
            // A warning, so the last line does not read as a store checked (a black-box
            // tester read "all good" so, and the advice then failed under a `run`).
            *warnings += 1;
            println!(
                "warning: store {}: in use by a running zonewatch, consistency not checked: check again once a `run` holding it has finished; under `serve`, check a copy (`zonewatch backup --config ... COPY`, then `zonewatch check --config ... --store COPY`)",
                path.display()
            );
            0
        }
        Err(crate::store::StoreError::Damaged { message, .. }) => {
            println!("store {}: ERROR damaged (redb: {message}); restore a backup: zonewatch restore BACKUP --config FILE", path.display());
            1
        }
        Err(e) => {
            println!("store {}: ERROR {e}", path.display());
            1
        }
    }
}
