//! `zonewatch backup` and `zonewatch restore`: a consistent copy of the one store file, taken
//! directly when no daemon holds it or by asking the running `serve` over its control port,
//! and put back only over a store no zonewatch has open.

use crate::config::Config;
use super::open::{load_config, runtime, store_exit_code};
use super::serve::control_addr_file;
use std::path::PathBuf;

/// Where `POST /v1/backup` writes backups (beside the store).
pub fn backup_dir(cfg: &Config) -> PathBuf {
    cfg.store_path.parent().map(|p| p.join("backups")).unwrap_or_else(|| PathBuf::from("backups"))
}

pub(super) fn cmd_backup(config: &std::path::Path, dest: &std::path::Path) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if dest.exists() {
        error_line!("{} exists; choose a new file name", dest.display());
        return 2;
    }
    // An interrupted backup leaves no half-written temp file beside DEST; one killed outright
    // left one there, removed once an hour old.
    let _finish = crate::signals::on_signal_remove_scratch();
    // Only this user's: a temp file this process made is owned so.
    crate::store::backup::sweep_backup_leftovers(crate::util::folder_of(dest), crate::util::effective_uid(), std::time::SystemTime::now());
    // A file this user may read but not write: copied through a read-only open (a `Store`
    // writes even to read).
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(&cfg.store_path) {
        if matches!(e.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem) {
            return match crate::store::backup::backup_read_only(&cfg.store_path, dest) {
                Ok(info) => {
                    println!("backup: {} ({} bytes, {} tables, {} rows; the store file is read-only here: copied as it is)", info.path.display(), info.bytes, info.tables, info.rows);
                    0
                }
                Err(crate::store::StoreError::InUse { .. }) => backup_via_daemon(&cfg, dest),
                Err(e) => {
                    error_line!("{e}");
                    store_exit_code(&e)
                }
            };
        }
    }
    // A wrong `[store] path` must not back up a new, empty store and report success.
    match crate::store::Store::open_existing(&cfg.store_path) {
        Ok(store) => match store.backup_to(dest) {
            Ok(info) => {
                println!("backup: {} ({} bytes, {} tables, {} rows)", info.path.display(), info.bytes, info.tables, info.rows);
                0
            }
            Err(e) => {
                error_line!("{e}");
                store_exit_code(&e)
            }
        },
        Err(crate::store::StoreError::InUse { .. }) => backup_via_daemon(&cfg, dest),
        Err(e) => {
            error_line!("{e}");
            2
        }
    }
}

/// The store is open in a running `serve`: ask it for a backup over the control port, then
/// copy the file it wrote to `dest` and check it.
fn backup_via_daemon(cfg: &Config, dest: &std::path::Path) -> i32 {
    // The address `serve` wrote, or else the configured one (a `serve` that could not write
    // it, on a full disk, listens there all the same unless its port is 0).
    let addr = match std::fs::read_to_string(control_addr_file(cfg)).ok().and_then(|a| a.trim().parse::<std::net::SocketAddr>().ok()) {
        Some(a) => a.to_string(),
        None => cfg.control.listen.to_string(),
    };
    let token = match std::fs::read_to_string(&cfg.control.token_file) {
        Ok(t) => t.trim().to_string(),
        // No token at all: no `serve` ever ran with this config, so what holds the store is a
        // `run` or another command (a black-box tester read the token's "No such file" as the
        // fault).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            error_line!("the store is in use by another zonewatch: a `run` or another command still going; try again when it has finished");
            return 1;
        }
        Err(e) => {
            error_line!(
                "the store is in use by another zonewatch: a `run` or another command still going (try again when it has finished), or a `serve` whose control token {} cannot be read by this user ({e})",
                cfg.control.token_file.display()
            );
            // No permission stays so on a retry; no token yet most likely means a `run`.
            return if e.kind() == std::io::ErrorKind::PermissionDenied { 2 } else { 1 };
        }
    };
    // The name is ours, so the daemon's copy is known before it answers: a signal while it
    // writes, or while this command copies it, removes it (or says where it will be left).
    // A hand-off name: the daemon's sweep removes the copy if this command never comes back
    // for it (killed), and it is renamed out of that when it is the only copy kept.
    let stamp = format!("{}-{}.redb", crate::util::rfc3339(crate::clock::Clock::now_ms(&crate::clock::SystemClock)).replace([':', '.'], "-"), std::process::id());
    let name = format!("{}{stamp}", crate::store::backup::HANDOFF_PREFIX);
    let daemon_copy = backup_dir(cfg).join(&name);
    let mut unfinished = crate::signals::scratch_of_another(
        &daemon_copy,
        format!("the running daemon may still be writing its backup {}: remove that file once it appears", daemon_copy.display()),
    );
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(c) => return c,
    };
    let result: Result<String, String> = rt.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().map_err(|e| e.to_string())?;
        // The store meant, by identity: a daemon of another install on this address (sharing
        // the token, its address file left by a stop) refuses rather than copy its own.
        let store = crate::control::routes::FileIdentity::of(&cfg.store_path).ok();
        let ask = || client.post(format!("http://{addr}/v1/backup")).bearer_auth(&token).header("content-type", "application/json").body(serde_json::json!({ "name": name, "store": store }).to_string()).send();
        let mut sent = ask().await;
        // A connection the daemon closed before it answered, with no copy begun: a full control
        // port made room with it before reading the request (it closes none that is being
        // answered), so asking again starts nothing twice (a black-box tester saw one backup
        // in six fail so under a flood of connections).
        for _ in 0..3 {
            match &sent {
                Err(e) if !e.is_connect() && !e.is_timeout() && !daemon_copy.exists() => {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    sent = ask().await;
                }
                _ => break,
            }
        }
        let resp = sent
            .map_err(|e| match e.is_connect() {
                true => format!("the store is in use by another zonewatch, and no daemon answered on its control port {addr} ({e}): a `run` or another command is still going, or a `serve` that has not written its address beside the store yet (it tries every few seconds, as on a full disk); try again in a moment"),
                // The request went out: the daemon may be writing the backup (and stopping).
                false => format!("the daemon on {addr} did not answer the backup request ({e}); if it started the backup, it will be at {}", daemon_copy.display()),
            })?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.map_err(|e| e.to_string())?;
        if body["error"]["code"] == "other_store" {
            return Err(format!(
                "the daemon answering on {addr} is not this store's ({}): {} is in use by another zonewatch (a `run` or another command still going, or a `serve` that has not written its address beside the store yet); try again in a moment",
                body["error"]["message"].as_str().unwrap_or_default(),
                std::path::absolute(&cfg.store_path).unwrap_or_else(|_| cfg.store_path.clone()).display()
            ));
        }
        if !status.is_success() {
            return Err(format!("daemon refused the backup ({status}): {body}"));
        }
        body["path"].as_str().map(str::to_string).ok_or_else(|| "daemon answer lacks path".to_string())
    });
    // The daemon's answer is its own path to the copy; this command's view of the store's
    // folder finds the same file even where the two see the file system differently.
    let src = match result {
        Ok(_) if daemon_copy.exists() => daemon_copy.clone(),
        Ok(p) => {
            let p = PathBuf::from(p);
            unfinished = crate::signals::scratch(&p);
            p
        }
        Err(e) => {
            error_line!("{e}");
            return 1;
        }
    };
    match copy_daemon_backup(&src, dest).map_err(|(e, code)| (format!("cannot copy {} to {}: {e}", src.display(), dest.display()), code)) {
        Ok(bytes) => {
            // The operator has a verified copy at `dest`: the daemon's copy would only fill
            // the disk, one whole store per backup.
            let daemon_copy = match std::fs::remove_file(&src) {
                Ok(()) => format!("its copy at {} removed", src.display()),
                Err(e) => format!("its copy stays at {}: cannot remove it: {e}", src.display()),
            };
            println!("backup: {} ({bytes} bytes, taken by the running daemon; {daemon_copy})", dest.display());
            0
        }
        Err((e, code)) => {
            // The only copy of this backup now: no signal may remove it, and it is renamed
            // out of the hand-off name, which the daemon's sweep would remove in an hour.
            drop(unfinished);
            let kept = src.with_file_name(format!("zonewatch-{stamp}"));
            let kept = match std::fs::rename(&src, &kept) {
                Ok(()) => kept,
                Err(rename) if rename.kind() == std::io::ErrorKind::NotFound => {
                    error_line!("{e}; the daemon's backup {} is gone as well (removed meanwhile): take the backup again", src.display());
                    return code;
                }
                Err(rename) => {
                    warning_line!("cannot rename {} to {} ({rename}): the daemon removes it an hour after it was written", src.display(), kept.display());
                    src.clone()
                }
            };
            error_line!("{e}; the daemon's backup is kept at {} (the only copy of this backup)", kept.display());
            code
        }
    }
}

/// Copies the daemon's backup `src` to `dest` (which must not exist) through a temp file
/// beside `dest`, verifies the copy and renames it into place. Returns its size, or why not
/// with the exit code it makes (1 when trying again can succeed: a full disk). `src` is only
/// read.
fn copy_daemon_backup(src: &std::path::Path, dest: &std::path::Path) -> Result<u64, (String, i32)> {
    if dest.exists() {
        return Err(("the destination already exists".into(), 2));
    }
    let parent = crate::util::folder_of(dest);
    let copy = crate::store::backup::verified_copy(src, parent, crate::store::backup::TEMP_PREFIX).map_err(|e| (e.to_string(), store_exit_code(&e)))?;
    let bytes = copy.bytes;
    crate::signals::committing();
    copy.tmp.persist_noclobber(dest).map_err(|e| {
        let e = crate::store::StoreError::Io { what: "cannot move the copy into place".into(), source: e.error };
        (e.to_string(), store_exit_code(&e))
    })?;
    Ok(bytes)
}

pub(super) fn cmd_restore(config: &std::path::Path, src: &std::path::Path) -> i32 {
    let cfg = match load_config(config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // An interrupted restore leaves the store as it was, and no temp copy beside it.
    let _finish = crate::signals::on_signal_remove_scratch();
    match crate::store::backup::restore(src, &cfg.store_path) {
        Ok(info) => {
            println!("restored {} to {}", src.display(), cfg.store_path.display());
            println!("changes found again since the backup are told again, under new webhook-ids (what was sent after the backup is not in it)");
            if let Some(kept) = &info.kept {
                println!("the replaced store is kept at {}", kept.display());
            }
            for warning in &info.warnings {
                warning_line!("{warning}");
            }
            // Found by a black-box tester: a hold open in the backup, released after the
            // restore, sent its 45 alerts a second time under new webhook-ids.
            match &info.open_holds {
                Ok(held) if held.is_empty() => {}
                Ok(held) => {
                    let ids: Vec<String> = held.iter().map(u64::to_string).collect();
                    warning_line!(
                        "the backup has {} open hold(s) (run {}): releasing one sends its alerts under new webhook-ids, also any that subscribers got after the backup was taken; if they did, prime it instead (`zonewatch holds prime RUN_ID --config FILE`)",
                        held.len(),
                        ids.join(", ")
                    );
                }
                Err(e) => warning_line!(
                    "the backup's holds could not be read ({e}): see `zonewatch holds list` before releasing one (releasing a hold of the backup sends its alerts under new webhook-ids)"
                ),
            }
            0
        }
        Err(e) => {
            error_line!("{e}");
            // In use (stop the daemon first) or a full disk: 1. A backup that is not a
            // healthy store, or is not there: 2, trying again would not help.
            match e {
                crate::store::StoreError::Conflict(_) => 1,
                e => store_exit_code(&e),
            }
        }
    }
}
