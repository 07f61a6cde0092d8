//! A damaged store file can make redb panic inside its B-tree code ("internal error: entered
//! unreachable code") instead of returning an error. The one-shot commands run their store
//! work through [`guarded`]: a panic raised in redb's own code while a guard is up is caught
//! and handed back as a [`RedbPanic`], which the caller reports as
//! [`StoreError::Damaged`](super::StoreError::Damaged) (one line, exit 2) instead of a
//! backtrace. Any other panic (a bug of ours) is printed by the default hook and unwinds on as
//! before, so real bugs stay visible.
//!
//! `serve` runs under a guard too: its store work runs on the runtime's threads, so it sets
//! an [`on_damage`] handler that begins its shutdown at the first redb panic, and then
//! reports the damage the same way (one line, exit 2) instead of failing task after task.
//!
//! The guard is process-wide, not per thread: the diff's worker threads read the store too,
//! and a redb panic on one of them reaches the command as a second panic ("a scoped thread
//! panicked") or as a failed task. Once a redb panic has been recorded, the panics that follow
//! from it inside the same guard are kept quiet as well.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe, PanicHookInfo};
use std::path::{Component, Path};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

/// How many guards are up (nested guards count once each).
static GUARDS: AtomicUsize = AtomicUsize::new(0);
/// The first redb panic seen while a guard was up, until a guard takes it.
static REDB_PANIC: Mutex<Option<String>> = Mutex::new(None);
/// The quiet hook is installed once, the first time a guard goes up.
static HOOK: Once = Once::new();
/// Called when a redb panic is first recorded under a guard: a long-running command (`serve`)
/// whose store work runs on other threads stops on it instead of failing task after task.
type DamageHandler = Box<dyn Fn() + Send>;
static ON_DAMAGE: Mutex<Option<DamageHandler>> = Mutex::new(None);

/// redb panicked while a guard was up: the store file it was reading is damaged.
#[derive(Debug, Clone, PartialEq)]
pub struct RedbPanic {
    /// redb's panic message and where in redb it was raised.
    pub message: String,
}

impl RedbPanic {
    /// The store error to report for the file that was being read.
    pub fn at(self, path: &Path) -> super::StoreError {
        super::StoreError::Damaged { path: path.to_path_buf(), message: self.message }
    }
}

/// Runs `work`; a panic raised in redb meanwhile comes back as `Err(RedbPanic)` (also when a
/// worker thread's redb panic was absorbed and `work` returned normally: the file is damaged
/// either way). Any other panic is not caught.
pub fn guarded<T>(work: impl FnOnce() -> T) -> Result<T, RedbPanic> {
    HOOK.call_once(install_hook);
    if GUARDS.fetch_add(1, Ordering::SeqCst) == 0 {
        // Left over from a thread that panicked after the last guard came down.
        recorded().take();
    }
    let outcome = catch_unwind(AssertUnwindSafe(work));
    GUARDS.fetch_sub(1, Ordering::SeqCst);
    let redb = recorded().take();
    match (outcome, redb) {
        (_, Some(message)) => Err(RedbPanic { message }),
        (Ok(value), None) => Ok(value),
        (Err(payload), None) => resume_unwind(payload),
    }
}

fn recorded() -> MutexGuard<'static, Option<String>> {
    REDB_PANIC.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sets what to do when a redb panic is first recorded under a guard (replacing any handler
/// set before). `serve` begins its shutdown: the guard around it then reports the damage.
/// The handler runs inside the panic hook, on the panicking thread: it must only signal.
pub fn on_damage(handler: impl Fn() + Send + 'static) {
    *ON_DAMAGE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Box::new(handler));
}

/// Chains a hook in front of the one in place (the default, which prints the message and
/// backtrace): quiet for redb panics under a guard, the previous hook for everything else.
fn install_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if GUARDS.load(Ordering::SeqCst) > 0 {
            let mut seen = recorded();
            if let Some(text) = redb_panic_text(info) {
                let first = seen.is_none();
                seen.get_or_insert(text);
                drop(seen);
                if first {
                    if let Some(handler) = ON_DAMAGE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).as_ref() {
                        handler();
                    }
                }
                return;
            }
            if seen.is_some() {
                return; // a consequence of the redb panic already recorded
            }
        }
        previous(info);
    }));
}

/// The panic's message and location when it was raised in redb's source, else `None`.
fn redb_panic_text(info: &PanicHookInfo<'_>) -> Option<String> {
    let location = info.location()?;
    let file = Path::new(location.file());
    // `.../registry/src/<index>/redb-4.6.0/src/tree_store/btree_cursor.rs` (or a vendored
    // `redb/src/...`): from the crate's folder on.
    let components: Vec<Component<'_>> = file.components().collect();
    let start = redb_crate_folder(&components)?;
    let short: std::path::PathBuf = components[start..].iter().collect();
    let message = info.payload_as_str().unwrap_or("panic");
    Some(format!("{message} at {}:{}", short.display(), location.line()))
}

/// Where redb's crate folder is in a source path: `redb` or `redb-<version>` holding `src`
/// directly. A folder of that name higher up (a `CARGO_HOME` under `/srv/redb-build`) must not
/// make every dependency's panic look like redb's.
fn redb_crate_folder(components: &[Component<'_>]) -> Option<usize> {
    let is_crate_dir = |n: &str| n == "redb" || n.strip_prefix("redb-").is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()));
    components.windows(2).rposition(|w| match (w[0], w[1]) {
        (Component::Normal(name), Component::Normal(next)) => next == "src" && name.to_str().is_some_and(is_crate_dir),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a file in redb's own crate folder is redb's: not one under a folder that merely
    /// has redb in its name.
    #[test]
    fn redb_is_told_by_its_crate_folder() {
        let at = |file: &str| redb_crate_folder(&Path::new(file).components().collect::<Vec<_>>()).is_some();
        assert!(at("/root/.cargo/registry/src/index.crates.io-1/redb-4.6.0/src/tree_store/btree_cursor.rs"));
        assert!(at("vendor/redb/src/db.rs"));
        assert!(!at("/srv/redb-build/.cargo/registry/src/index.crates.io-1/geo-0.33.0/src/algorithm/area.rs"));
        assert!(!at("/srv/redb/cargo/registry/src/x/geo-0.33.0/src/lib.rs"));
    }

    #[test]
    fn a_panic_outside_redb_is_not_taken_for_damage() {
        let caught = catch_unwind(|| guarded(|| -> u32 { panic!("a bug of ours") }));
        assert!(caught.is_err(), "a panic of our own code unwinds on");
        assert_eq!(guarded(|| 7), Ok(7));
    }
}
