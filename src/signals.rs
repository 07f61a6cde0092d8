//! The one answer to SIGINT and SIGTERM for the commands that run a while (`run`, `serve`).
//!
//! Why one watcher, on tokio: both commands already run a tokio runtime, and both want the
//! same thing of a signal — the first stops the work gracefully (what is in flight finishes,
//! the outbox keeps the rest), a second exits at once (the outbox makes that safe). Only
//! SIGINT and SIGTERM are watched: a SIGHUP that `nohup` (or a service manager) told the
//! process to ignore stays ignored, so a daemon started from a terminal outlives it.
//!
//! The exit code a signal leaves is the shell's (128 + its number: 130 for SIGINT, 143 for
//! SIGTERM); the command decides whether a graceful stop reports it (`run`: yes, so a timer
//! unit sees the pass was cut short) or exits 0 (`serve`: a service manager's stop is a clean
//! stop).
//!
//! The commands that copy a whole store (`backup`, `restore`, `check --store` on a file that
//! needs repair) have no graceful stop: a signal ends them as it always did, but first removes
//! the unfinished copy they registered with [`scratch`], so a Ctrl-C on a 2 GB backup does not
//! leave a 2 GB temp file beside it (`remove_scratch_on_signal`).

use std::sync::atomic::{AtomicI32, Ordering};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Which stopping signal arrived first, if any: the exit code it stands for (130 SIGINT,
/// 143 SIGTERM), or 0 while none has. Shared between the watcher task and the command.
#[derive(Debug, Clone, Default)]
pub struct StopSignal(Arc<AtomicI32>);

impl StopSignal {
    /// The exit code of the first stopping signal, or `None` if none arrived.
    pub fn code(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            code => Some(code),
        }
    }

    /// Records `code` if it is the first; says whether it was.
    fn first(&self, code: i32) -> bool {
        self.0.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

/// Watches SIGINT and SIGTERM on `rt`. The first calls `stop` (which must not block: it flips
/// a watch channel) and then prints `stopping` as a status line — stop first, so a stalled
/// stderr cannot hold the stop up. A second signal prints one line and exits the process at
/// once with that signal's code. Fails only if the handlers cannot be installed.
pub fn watch(rt: &tokio::runtime::Runtime, stopping: &'static str, stop: impl Fn() + Send + 'static) -> std::io::Result<StopSignal> {
    let signal = StopSignal::default();
    let _entered = rt.enter();
    let mut arrivals = Arrivals::install()?;
    let seen = signal.clone();
    rt.spawn(async move {
        loop {
            let code = arrivals.next().await;
            if seen.first(code) {
                stop();
                crate::say::line(crate::say::Level::Status, format_args!("{stopping}"));
            } else {
                crate::say::line(crate::say::Level::Status, format_args!("exiting now (the outbox makes this safe)"));
                std::process::exit(code);
            }
        }
    });
    Ok(signal)
}

/// Files a signal must not leave behind (unfinished copies of a store), each with what to say
/// if it is not there yet.
static SCRATCH: Mutex<Vec<(PathBuf, Option<String>)>> = Mutex::new(Vec::new());

/// An unfinished copy registered with [`scratch`]: removed if a signal ends the process
/// (after [`remove_scratch_on_signal`]); forgotten when this is dropped — by then the copy was
/// renamed into place or removed by its own `tempfile` guard.
#[derive(Debug)]
pub struct Scratch(PathBuf);

/// Registers `path` as an unfinished copy until the returned guard is dropped.
pub fn scratch(path: &Path) -> Scratch {
    register(path, None)
}

/// Registers `path` as a copy another process (the daemon) is writing for this one: removed
/// if it exists when a signal arrives; if it does not exist yet, `if_missing` is printed, to
/// say what will be left and where.
pub fn scratch_of_another(path: &Path, if_missing: String) -> Scratch {
    register(path, Some(if_missing))
}

fn register(path: &Path, if_missing: Option<String>) -> Scratch {
    if let Ok(mut paths) = SCRATCH.lock() {
        paths.push((path.to_path_buf(), if_missing));
    }
    Scratch(path.to_path_buf())
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Ok(mut paths) = SCRATCH.lock() {
            if let Some(at) = paths.iter().rposition(|(p, _)| *p == self.0) {
                paths.swap_remove(at);
            }
        }
    }
}

/// For a command without a runtime of its own that copies a store: on SIGINT / SIGTERM,
/// remove the registered unfinished copies, say so, and exit with the signal's code (130 /
/// 143, what a shell reports for a command those signals killed). A signal inherited as
/// ignored stays ignored. If the watcher cannot start, a signal kills as before (the copy is
/// left: a warning says so now, not after).
pub fn remove_scratch_on_signal() {
    let (ready_tx, ready) = std::sync::mpsc::channel::<std::io::Result<()>>();
    let started = std::thread::Builder::new().name("zonewatch-signals".into()).spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_io().build() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        rt.block_on(async move {
            let mut arrivals = match Arrivals::install() {
                Ok(a) => a,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            let code = arrivals.next().await;
            let paths = SCRATCH.lock().map(|p| p.clone()).unwrap_or_default();
            for (path, if_missing) in paths {
                match std::fs::remove_file(&path) {
                    Ok(()) => crate::say::line(crate::say::Level::Status, format_args!("interrupted: removed the unfinished copy {}", path.display())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        if let Some(note) = if_missing {
                            crate::say::line(crate::say::Level::Warning, format_args!("interrupted: {note}"));
                        }
                    }
                    Err(e) => crate::say::line(crate::say::Level::Warning, format_args!("interrupted: cannot remove the unfinished copy {}: {e}", path.display())),
                }
            }
            std::process::exit(code);
        });
    });
    // Wait until the handlers are in place, so the copy does not start unwatched.
    let failed = match started {
        Ok(_) => ready.recv().map_err(|_| std::io::Error::other("the signal thread stopped")).and_then(|r| r).err(),
        Err(e) => Some(e),
    };
    if let Some(e) = failed {
        crate::say::line(crate::say::Level::Warning, format_args!("cannot watch for signals ({e}): an interrupted copy leaves its temp file behind"));
    }
}

/// The installed handlers, yielding each arrival's exit code. A signal the process inherited
/// as ignored gets no handler — the convention for programs that catch signals: a
/// non-interactive shell starts a background job (`zonewatch serve &`) with SIGINT ignored so
/// that a Ctrl-C meant for the foreground does not reach it, and installing a handler would
/// undo that.
#[cfg(unix)]
struct Arrivals {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

#[cfg(unix)]
impl Arrivals {
    fn install() -> std::io::Result<Arrivals> {
        use tokio::signal::unix::{signal, SignalKind};
        let ignored = inherited_ignored();
        let watch = |number: u32, kind: SignalKind| -> std::io::Result<Option<tokio::signal::unix::Signal>> {
            match ignored & (1 << (number - 1)) {
                0 => signal(kind).map(Some),
                _ => Ok(None),
            }
        };
        Ok(Arrivals { interrupt: watch(2, SignalKind::interrupt())?, terminate: watch(15, SignalKind::terminate())? })
    }

    async fn next(&mut self) -> i32 {
        tokio::select! {
            Some(_) = recv(&mut self.interrupt) => 130,
            Some(_) = recv(&mut self.terminate) => 143,
            else => std::future::pending().await,
        }
    }
}

/// Waits for `signal`'s next arrival; never resolves for a signal not watched.
#[cfg(unix)]
async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match signal {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

/// The signals this process inherited as ignored, as the kernel's mask (bit n-1 for signal
/// n), read from `/proc/self/status` before any handler is installed. Where that file does
/// not exist (not Linux) nothing counts as ignored and both signals are watched.
#[cfg(unix)]
fn inherited_ignored() -> u64 {
    std::fs::read_to_string("/proc/self/status").ok().as_deref().and_then(ignored_mask).unwrap_or(0)
}

/// The `SigIgn:` mask of a `/proc/<pid>/status` text.
#[cfg(unix)]
fn ignored_mask(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|line| line.strip_prefix("SigIgn:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Elsewhere only Ctrl-C exists (a console's Ctrl-Break and close events are not handled).
#[cfg(not(unix))]
struct Arrivals;

#[cfg(not(unix))]
impl Arrivals {
    fn install() -> std::io::Result<Arrivals> {
        Ok(Arrivals)
    }

    async fn next(&mut self) -> i32 {
        match tokio::signal::ctrl_c().await {
            Ok(()) => 130,
            // The handler could not be installed: never report a signal that did not come.
            Err(_) => std::future::pending().await,
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::ignored_mask;

    #[test]
    fn the_ignored_mask_is_read_from_proc_status() {
        let status = "Name:\tzonewatch\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000001002\nSigCgt:\t0000000180004002\n";
        let mask = ignored_mask(status).expect("mask");
        assert_ne!(mask & (1 << (2 - 1)), 0, "SIGINT (2) is ignored");
        assert_eq!(mask & (1 << (15 - 1)), 0, "SIGTERM (15) is not");
        assert_eq!(ignored_mask("Name:\tx\n"), None);
        assert_eq!(ignored_mask("SigIgn:\tnot-hex\n"), None);
    }
}
