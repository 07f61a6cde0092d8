//! How a command loads its config and opens its store, and the exit code of each way that can
//! fail (1: it passes by itself, try again later; 2: fix the config or the store). Shared by
//! every command that reads the store, so they all refuse, say and exit alike.

use crate::config::Config;
use crate::pipeline::Engine;

pub(super) fn load_config(path: &std::path::Path) -> Result<Config, i32> {
    Config::load(path).map_err(|e| {
        error_line!("{e}");
        2
    })
}

pub(super) fn open_engine(path: &std::path::Path) -> Result<Engine, i32> {
    open_engine_after(path, &mut |_| Ok(()))
}

/// [`open_engine`], with `before_store` run on the loaded config before the store is opened
/// or created (`serve` binds its control port there: a port held by another program must not
/// leave a new store file behind).
pub(super) fn open_engine_after(path: &std::path::Path, before_store: &mut dyn FnMut(&Config) -> Result<(), i32>) -> Result<Engine, i32> {
    let engine = engine_by(path, before_store, Engine::open)?;
    // A run writes its spill and sort files beside the store: a folder it may not write in
    // fails here, at start, not at the first real change hours later.
    if let Err(source) = tempfile::tempfile_in(engine.scratch_dir()) {
        let e = crate::store::StoreError::Io {
            what: format!("cannot make temp files in the store's folder {} (runs write their spill files there; give this user write access to it)", engine.scratch_dir().display()),
            source,
        };
        error_line!("{e}");
        return Err(store_exit_code(&e));
    }
    for (id, note) in &engine.aoi_repairs {
        warning_line!("subscriber {id}: {note}");
    }
    // What `check` calls an error, said at start too: every alert of such a subscriber is
    // dead-lettered `private_target_refused`, and a service started without `check` would
    // say nothing of it until someone reads the dead letters (found by a black-box tester).
    if !engine.config.delivery.allow_private_targets {
        for s in engine.config.subscribers.iter().filter(|s| crate::netguard::url_written_private(&s.target)) {
            warning_line!(
                "subscriber {}: target {} is a private address and delivery.allow_private_targets is false: every alert to it will be dead-lettered private_target_refused",
                s.id,
                crate::util::url_for_display(&s.target)
            );
        }
    }
    Ok(engine)
}

/// [`open_engine`] for a command that steers what runs wrote: the store must exist.
pub(super) fn open_existing_engine(path: &std::path::Path) -> Result<Engine, i32> {
    engine_by(path, &mut |_| Ok(()), Engine::open_existing)
}

fn engine_by(
    path: &std::path::Path,
    before_store: &mut dyn FnMut(&Config) -> Result<(), i32>,
    open: fn(Config) -> Result<Engine, crate::pipeline::PipelineError>,
) -> Result<Engine, i32> {
    let config = load_config(path)?;
    for advice in config.advisories() {
        tracing::warn!("{advice}");
    }
    before_store(&config)?;
    let store_path = config.store_path.clone();
    open(config).map_err(|e| {
        match &e {
            crate::pipeline::PipelineError::Store(se) => error_line!("{}", store_error_text(&store_path, se)),
            _ => error_line!("{e}"),
        }
        // Another process holding the store (an operator's `zonewatch backup` while the
        // service restarts, say) lets go of it, and a full disk is freed: exit 1, which the
        // packaged unit retries, as `restore` does. Every other open error is the config's or
        // the store's: exit 2.
        match e {
            crate::pipeline::PipelineError::Store(e) => store_exit_code(&e),
            _ => 2,
        }
    })
}

/// A store error as the operator reads it: redb's own words (`database error: ...`) say not
/// which file, and a full disk would read as a broken store, so they are given the store's.
pub(super) fn store_error_text(store: &std::path::Path, e: &crate::store::StoreError) -> String {
    let text = match e {
        crate::store::StoreError::Db(_) => format!("store {}: {e}", store.display()),
        _ => e.to_string(),
    };
    match e.io_error() {
        Some(io) if crate::store::is_file_size_limit(io) => format!("{text}: {}", crate::store::FILE_SIZE_LIMIT),
        _ => text,
    }
}

/// The exit code of a command stopped by a store error: 1 when it passes by itself (the store
/// in use, a full disk; `StoreError::passes`), else 2.
pub(super) fn store_exit_code(e: &crate::store::StoreError) -> i32 {
    if e.passes() {
        1
    } else {
        2
    }
}

pub(super) fn runtime() -> Result<tokio::runtime::Runtime, i32> {
    crate::util::async_runtime(true).map_err(|e| {
        let hint = if matches!(e.raw_os_error(), Some(23 | 24)) { ": this process is out of file descriptors; raise its limit (ulimit -n, or LimitNOFILE= in the service unit)" } else { "" };
        error_line!("cannot start the async runtime: {e}{hint}");
        1
    })
}

/// A listing reads everything it shows first, then closes the store, then prints: a reader
/// that stops early (`| head`) ends the command in a panic that unwinds to `main` (exit
/// 141), and redb leaves a store dropped while panicking to be repaired on its next open.
pub(super) fn close_before_printing(engine: Engine) {
    drop(engine);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that may not grow past a file-size limit is said so (waiting does not lift it:
    /// exit 2); a full disk keeps its own words (it passes: exit 1).
    #[test]
    fn a_file_size_limit_is_named_as_such() {
        let store = std::path::Path::new("zw.redb");
        let efbig = crate::store::StoreError::Db(redb::Error::Io(std::io::Error::from_raw_os_error(27)));
        let text = store_error_text(store, &efbig);
        assert!(text.starts_with("store zw.redb: database error: I/O error") && text.contains("ulimit -f") && text.contains("LimitFSIZE"), "{text}");
        assert!(!efbig.passes());
        let enospc = crate::store::StoreError::Db(redb::Error::Io(std::io::Error::from_raw_os_error(28)));
        assert!(!store_error_text(store, &enospc).contains("ulimit") && enospc.passes());
    }
}
