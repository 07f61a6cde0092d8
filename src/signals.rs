//! What zonewatch does on SIGINT and SIGTERM: one watcher, on its own thread.
//!
//! `run` and `serve` stop gracefully on the first signal (what is in flight finishes, the
//! outbox keeps the rest) and die at once on a second (the outbox makes that safe): [`watch`].
//! The commands that copy a whole store (`backup`, `restore`, `check --store` on a file that
//! needs repair) have no graceful stop: a signal first removes the unfinished copy they
//! registered with [`scratch`], so a Ctrl-C on a 2 GB backup does not leave a 2 GB temp file
//! beside it; past their point of no return (a rename into place, see [`committing`]) the
//! signal waits until the command has finished and said what it did: [`on_signal_remove_scratch`].
//!
//! Rules shared by both:
//! - `run` and `serve` watch SIGINT and SIGTERM only: SIGHUP is not caught, so `nohup` keeps
//!   working. The copying commands watch SIGHUP too (a lost ssh session left a whole store's
//!   copy behind) and die by it (129). A signal the process inherited as ignored (a non-interactive shell starts a background
//!   job, `zonewatch serve &`, with SIGINT ignored) gets no handler.
//! - A command ended by a signal dies *by that signal* (its handler reset, the signal raised
//!   again), not by `exit(130)`: a shell script running it then stops too (bash stops a
//!   script on Ctrl-C only when the child was killed by SIGINT), and a service manager counts
//!   a SIGTERM stop as clean. The shell reports it as 130 (SIGINT) or 143 (SIGTERM).
//!   `serve`'s graceful stop exits 0: the daemon finished everything it had begun.
//! - The watcher runs on a thread of its own, not on the command's runtime: it answers while
//!   that runtime shuts down and waits for its blocking tasks (a backup being written).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

/// Which stopping signal arrived first, if any: the exit code it stands for (130 SIGINT,
/// 143 SIGTERM), or 0 while none has. Shared between the watcher thread and the command.
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

/// Watches SIGINT and SIGTERM for a command with a graceful stop. The first calls `stop`
/// (which must not block: it flips a watch channel), then prints `stopping` as a status line —
/// stop first, so a stalled stderr cannot hold the stop up. A second signal removes any
/// registered unfinished copy, prints one line and dies by that signal. Fails only if the
/// handlers cannot be installed.
pub fn watch(stopping: &'static str, stop: impl Fn() + Send + 'static) -> std::io::Result<StopSignal> {
    let signal = StopSignal::default();
    let seen = signal.clone();
    spawn_watcher(false, move |code| {
        if seen.first(code) {
            stop();
            crate::say::line(crate::say::Level::Status, format_args!("{stopping}"));
        } else {
            die_by(code, Some("exiting now (the outbox makes this safe)"));
        }
    })?;
    Ok(signal)
}

/// What the process must clean up or finish if a signal comes.
struct State {
    /// Unfinished copies of a store, each with what to say if it is not there yet.
    scratch: Vec<(PathBuf, Option<String>)>,
    /// [`on_signal_remove_scratch`] is watching (only then does [`committing`] defer signals).
    watching: bool,
    /// The command is past its point of no return: a signal waits for [`Finish`].
    committed: bool,
    /// A signal that came while committed, for [`Finish`] to die by.
    pending: Option<i32>,
    /// A signal is removing the copies before the process dies: nothing may commit now.
    dying: bool,
}

static STATE: Mutex<State> = Mutex::new(State { scratch: Vec::new(), watching: false, committed: false, pending: None, dying: false });

fn state() -> std::sync::MutexGuard<'static, State> {
    // Nothing panics while holding it; a poisoned lock still holds a usable list.
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An unfinished copy registered with [`scratch`]: removed if a signal ends the process;
/// forgotten when this is dropped — by then the copy was renamed into place or removed by its
/// own `tempfile` guard. (Between a temp file's creation and its registration, a few
/// instructions, a signal still leaves it.)
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
    state().scratch.push((path.to_path_buf(), if_missing));
    Scratch(path.to_path_buf())
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let mut state = state();
        if let Some(at) = state.scratch.iter().rposition(|(p, _)| *p == self.0) {
            state.scratch.swap_remove(at);
        }
    }
}

/// Removes the registered unfinished copies, saying so (and what it could not remove).
fn remove_scratch() {
    let paths = std::mem::take(&mut state().scratch);
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
}

/// The point of no return of a command watched by [`on_signal_remove_scratch`]: what follows
/// puts a finished copy in place (a rename, keeping the replaced store aside first). A signal
/// from now on waits until the command has finished and printed what it did ([`Finish`]), so
/// it never stops a restore between keeping the old store aside and renaming the new one in,
/// and never reports a finished backup as interrupted. Does nothing where no such watcher runs
/// (the daemon's own backups).
pub fn committing() {
    let mut state = state();
    if state.dying {
        // The watcher is removing this command's copy and will end the process: never start
        // putting a copy in place that is being removed.
        drop(state);
        loop {
            std::thread::park();
        }
    }
    if state.watching {
        state.committed = true;
    }
}

/// Held by a command watched by [`on_signal_remove_scratch`] until it has printed its result:
/// a signal that arrived after [`committing`] then ends the process — by [`exit`], once the
/// command has returned and closed what it opened.
#[derive(Debug)]
pub struct Finish(());

impl Drop for Finish {
    fn drop(&mut self) {
        let pending = {
            let mut state = state();
            state.watching = false;
            // A signal from now on is not deferred: nothing would answer it.
            state.committed = false;
            state.pending.take()
        };
        if let Some(code) = pending {
            end_by(code);
        }
    }
}

/// The signal (as its exit code) the process must die by once the command has returned.
static END_BY: AtomicI32 = AtomicI32::new(0);

/// Records that the command, once returned, ends by the signal `code` stands for (130 / 143)
/// rather than by an exit code (see [`exit`]); returns `code`.
pub fn end_by(code: i32) -> i32 {
    END_BY.store(code, Ordering::SeqCst);
    code
}

/// How `main` ends the process after the command returned `code` (its store closed on the
/// way): by the signal recorded with [`end_by`] if any, so the parent sees a death by that
/// signal; otherwise with `code`.
pub fn exit(code: i32) -> ! {
    if state().dying {
        // The watcher is removing this command's copy and ends the process by its signal:
        // an error the command met meanwhile (its copy gone under it) must not end it first.
        loop {
            std::thread::park();
        }
    }
    match END_BY.load(Ordering::SeqCst) {
        0 => std::process::exit(code),
        signal => {
            die_by(signal, None)
        }
    }
}

/// For a command without a graceful stop that copies a store: on SIGINT / SIGTERM / SIGHUP, remove the
/// registered unfinished copies, say so, and die by the signal — or, past [`committing`], let
/// the command finish first. If the watcher cannot start, a signal kills as before (a warning
/// says now that an interrupted copy would be left).
pub fn on_signal_remove_scratch() -> Finish {
    state().watching = true;
    // SIGHUP too (a lost ssh session): these commands have no `nohup` use, and a copy left
    // by one is a whole store, signing secrets included (found by a black-box tester).
    let started = spawn_watcher(true, |code| {
        {
            let mut state = state();
            if state.committed {
                state.pending.get_or_insert(code);
                drop(state);
                crate::say::line(crate::say::Level::Status, format_args!("signal received: finishing first (the copy is being put in place)"));
                return;
            }
            state.dying = true;
        }
        die_by(code, None);
    });
    if let Err(e) = started {
        crate::say::line(crate::say::Level::Warning, format_args!("cannot watch for signals ({e}): an interrupted copy leaves its temp file behind"));
    }
    Finish(())
}

/// Starts the watcher thread and waits until its handlers are installed (so the work does not
/// start unwatched). `on_signal` gets each arrival's exit code (130 / 143).
fn spawn_watcher(with_hangup: bool, mut on_signal: impl FnMut(i32) + Send + 'static) -> std::io::Result<()> {
    let (ready_tx, ready) = std::sync::mpsc::channel::<std::io::Result<()>>();
    std::thread::Builder::new().name("zonewatch-signals".into()).spawn(move || {
        let rt = match crate::util::async_runtime(false) {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        rt.block_on(async move {
            let mut arrivals = match Arrivals::install(with_hangup) {
                Ok(a) => a,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            loop {
                let code = arrivals.next().await;
                on_signal(code);
            }
        });
    })?;
    ready.recv().map_err(|_| std::io::Error::other("the signal thread stopped"))?
}

/// Ends the process by the signal `code` stands for (130 SIGINT, 143 SIGTERM): both
/// signals' handlers reset to the default first (if what follows blocks on a stalled stderr,
/// the next signal kills), then the registered unfinished copies removed, `last_line` said,
/// and the signal raised, so the parent sees a death by it. Falls back to exiting with `code`
/// if that did not end it.
fn die_by(code: i32, last_line: Option<&str>) -> ! {
    use std::io::Write as _;
    reset_to_default(code);
    remove_scratch();
    if let Some(line) = last_line {
        crate::say::line(crate::say::Level::Status, format_args!("{line}"));
    }
    let _ = std::io::stdout().flush();
    #[cfg(unix)]
    {
        extern "C" {
            fn raise(signum: std::os::raw::c_int) -> std::os::raw::c_int;
        }
        if let Some(number) = signal_number(code) {
            // SAFETY: `raise` takes a plain integer and is callable from any thread.
            unsafe {
                raise(number);
            }
        }
    }
    std::process::exit(code)
}

/// Ignores `SIGXFSZ`, whose default action ends the process without a word when a write
/// passes the process's file-size limit (`ulimit -f`, systemd `LimitFSIZE=`): ignored, the
/// write fails with `EFBIG` instead, and the store says what stops it and exits 2
/// (`store::FILE_SIZE_LIMIT`), which a service manager told not to restart on 2 respects.
/// Found by a black-box tester: `run` and `serve` died silently (exit 153) and the unit
/// restarted in a loop. Called first thing by the binary.
pub fn report_file_size_limit() {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn signal(signum: std::os::raw::c_int, handler: usize) -> usize;
        }
        /// `SIGXFSZ` on Linux, and `SIG_IGN`.
        const SIGXFSZ: std::os::raw::c_int = 25;
        const SIG_IGN: usize = 1;
        // SAFETY: `signal` with SIG_IGN installs no Rust code as a handler; it takes two
        // integers and is callable from any thread.
        unsafe {
            signal(SIGXFSZ, SIG_IGN);
        }
    }
}

/// Puts back the default action (ending the process) of both signals we watch, `code`'s
/// first. Called only on the way out ([`die_by`]).
fn reset_to_default(code: i32) {
    #[cfg(unix)]
    {
        extern "C" {
            fn signal(signum: std::os::raw::c_int, handler: usize) -> usize;
        }
        /// `SIG_DFL`: the null handler on every unix.
        const SIG_DFL: usize = 0;
        let inherited = inherited_ignored_at_start();
        for number in signal_number(code).into_iter().chain([2, 15, 1]) {
            // A signal inherited as ignored has no handler of ours: leave it ignored.
            if inherited & (1 << (number - 1)) != 0 {
                continue;
            }
            // SAFETY: `signal` with SIG_DFL installs no Rust code as a handler; it takes two
            // integers and is callable from any thread.
            unsafe {
                signal(number, SIG_DFL);
            }
        }
    }
    #[cfg(not(unix))]
    let _ = code;
}

/// The signal number behind an exit code we use for one (129 → 1, 130 → 2, 143 → 15).
#[cfg(unix)]
fn signal_number(code: i32) -> Option<std::os::raw::c_int> {
    match code {
        129 => Some(1),
        130 => Some(2),
        143 => Some(15),
        _ => None,
    }
}

/// The installed handlers, yielding each arrival's exit code. A signal the process inherited
/// as ignored gets no handler (the convention for programs that catch signals): installing
/// one would undo what the parent asked.
#[cfg(unix)]
struct Arrivals {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
    /// Watched only for the copying commands (`on_signal_remove_scratch`).
    hangup: Option<tokio::signal::unix::Signal>,
}

#[cfg(unix)]
impl Arrivals {
    fn install(with_hangup: bool) -> std::io::Result<Arrivals> {
        use tokio::signal::unix::{signal, SignalKind};
        let ignored = inherited_ignored_at_start();
        // tokio's signal driver makes a socket pair the first time and panics if it cannot
        // (a tester's `ulimit -n 8`: exit 101 and a backtrace): tried here first, so that
        // the caller gets the error and says it; a panic all the same is caught as one.
        drop(std::os::unix::net::UnixStream::pair()?);
        let watched = |number: u32, kind: SignalKind| -> std::io::Result<Option<tokio::signal::unix::Signal>> {
            match ignored & (1 << (number - 1)) {
                0 => std::panic::catch_unwind(|| signal(kind))
                    .unwrap_or_else(|_| Err(std::io::Error::other("the signal driver could not start (out of file descriptors?)")))
                    .map(Some),
                _ => Ok(None),
            }
        };
        let hangup = if with_hangup { watched(1, SignalKind::hangup())? } else { None };
        Ok(Arrivals { interrupt: watched(2, SignalKind::interrupt())?, terminate: watched(15, SignalKind::terminate())?, hangup })
    }

    async fn next(&mut self) -> i32 {
        tokio::select! {
            Some(_) = recv(&mut self.interrupt) => 130,
            Some(_) = recv(&mut self.terminate) => 143,
            Some(_) = recv(&mut self.hangup) => 129,
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
/// Read once, before the first handler: later the mask no longer shows what was inherited.
#[cfg(unix)]
fn inherited_ignored_at_start() -> u64 {
    static MASK: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MASK.get_or_init(|| std::fs::read_to_string("/proc/self/status").ok().as_deref().and_then(ignored_mask).unwrap_or(0))
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
    fn install(_with_hangup: bool) -> std::io::Result<Arrivals> {
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
