//! Idempotency keys: sha256 over `watcher | jurisdiction | parcel | kind | old code | new code
//! | effective date`. Only stable fields go in (never a timestamp or a run id), so the same
//! change for the same watcher always has the same key, across runs and restarts.

use crate::detect::canonical::normalize_code;
use crate::model::{ChangeEvent, IdemKey};
use sha2::{Digest, Sha256};

/// The key of one (watcher, change) pair.
pub fn key_for(watcher_id: &str, event: &ChangeEvent) -> IdemKey {
    let fields = [
        watcher_id.to_string(),
        event.jurisdiction.clone(),
        event.parcel_id.clone(),
        event.kind.as_str().to_string(),
        event.from.as_deref().map(normalize_code).unwrap_or_default(),
        event.to.as_deref().map(normalize_code).unwrap_or_default(),
        event.effective_date.clone().unwrap_or_default(),
    ];
    let mut h = Sha256::new();
    for (i, f) in fields.iter().enumerate() {
        if i > 0 {
            h.update(b"|");
        }
        // Escape the separator so that field boundaries cannot be forged.
        h.update(f.replace('\\', "\\\\").replace('|', "\\|").as_bytes());
    }
    IdemKey(crate::util::hex(&h.finalize()))
}
