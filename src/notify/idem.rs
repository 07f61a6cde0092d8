//! Idempotency keys: sha256 over `watcher | jurisdiction | parcel | kind | old code | new code
//! | effective date [| revision]`. Only stable fields go in (never a timestamp or a run id),
//! so the same change for the same watcher always has the same key, across runs and
//! restarts. The key revision (`ChangeEvent::revision`: how many changes of the parcel were
//! announced before this one, kept in the snapshot, `detect::diff::step`) tells apart a
//! change that happens *again*: a parcel rezoned
//! R-1 → C-2, back to R-1 and to C-2 again within the key TTL gets three keys, not a
//! `duplicate` for the third (its receiver would be left believing R-1). The same change
//! found twice from the same snapshot (a held run released, a reprocess) has the same
//! revision, so the same key. Revision 0 (a parcel as its first ingest found it, and every
//! event of a store older than revisions) adds no field: those keys are what they were.
//!
//! Then, for a source this build ingested first, `|s` and the source id (escaped), and after
//! a restore `|e` and the store's epoch in hex ([`KeyScope`], `store::key_scope`): a source
//! counts its revisions alone, so a renamed source, or a restored store counting from a
//! backup's revisions, would otherwise give a new change the key of an older one.

use crate::detect::canonical::normalize_code;
use crate::model::{ChangeEvent, IdemKey};
use sha2::{Digest, Sha256};

/// The key of one (watcher, change) pair: sha256 over the watcher id, jurisdiction, parcel
/// id, kind, normalised from / to codes and effective date, each escaped (`\` → `\\`,
/// `|` → `\|`) and joined by `|`, so that field boundaries cannot be forged, and then, when
/// the event's revision is not 0, `|` and the revision in decimal (no escaping needed: an
/// escaped field never ends in an unescaped `|`, so no key without it can equal one with it). Each field is
/// hashed as it is escaped, not copied first (a baseline computes one key per parcel an AOI
/// touches); only the from / to codes are normalised into new strings.
pub fn key_for(watcher_id: &str, event: &ChangeEvent) -> IdemKey {
    key_in(watcher_id, event, KeyScope::default())
}

/// What a key names besides the change (see the module doc): its source's id, unless the
/// source is legacy (ingested before keys named sources), and the store's restore epoch
/// (0 before any restore).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyScope<'a> {
    pub source: Option<&'a str>,
    pub epoch: u64,
}

/// [`key_for`] in `scope`: the same fields, then `|s<source id>` and `|e<epoch, hex>` when
/// given (the letters keep them apart from a revision's digits).
pub fn key_in(watcher_id: &str, event: &ChangeEvent, scope: KeyScope<'_>) -> IdemKey {
    let from = event.from.as_deref().map(normalize_code);
    let to = event.to.as_deref().map(normalize_code);
    let fields = [
        watcher_id,
        event.jurisdiction.as_str(),
        event.parcel_id.as_str(),
        event.kind.as_str(),
        from.as_deref().unwrap_or_default(),
        to.as_deref().unwrap_or_default(),
        event.effective_date.as_deref().unwrap_or_default(),
    ];
    let mut h = Sha256::new();
    for (i, f) in fields.iter().enumerate() {
        if i > 0 {
            h.update(b"|");
        }
        update_escaped(&mut h, f);
    }
    if event.revision > 0 {
        h.update(b"|");
        h.update(event.revision.to_string().as_bytes());
    }
    if let Some(source) = scope.source {
        h.update(b"|s");
        update_escaped(&mut h, source);
    }
    if scope.epoch != 0 {
        h.update(format!("|e{:x}", scope.epoch).as_bytes());
    }
    IdemKey(crate::util::hex(&h.finalize()))
}

/// Feeds `field` to `h` with every `\` and `|` preceded by a `\`.
fn update_escaped(h: &mut Sha256, field: &str) {
    let bytes = field.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'\\' || b == b'|' {
            h.update(&bytes[start..i]);
            h.update(b"\\");
            // The byte itself starts the next stretch.
            start = i;
        }
    }
    h.update(&bytes[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sample_event, ChangeKind};

    /// Keys are stored: a change in how they are computed would let every change already
    /// claimed be claimed (and sent) again after an upgrade. These values were computed by the
    /// first implementation (and again by a few lines of Python doing what the module doc
    /// says); any rewrite must give them byte for byte.
    #[test]
    fn keys_are_what_they_were() {
        let mut e = sample_event("P-1");
        let plain = key_for("w1", &e);
        e.jurisdiction = "Town|of\\Here".into();
        e.parcel_id = "12|34\\\\5|".into();
        e.from = Some("  r-1 ".into());
        e.to = Some("c|2".into());
        e.effective_date = Some("2026-01-01".into());
        let escaped = key_for("sub\\|x", &e);
        e.from = None;
        e.effective_date = None;
        let missing = key_for("", &e);
        // Another kind, fields ending in a backslash or a pipe, text past ASCII, a code that
        // normalisation changes.
        e.kind = ChangeKind::Added;
        e.jurisdiction = "Zürich|".into();
        e.parcel_id = "日本\\".into();
        e.to = Some(" r-1 été ".into());
        let wide = key_for("wé\\", &e);
        assert_eq!(plain.0, "877ad3e31ed742671e193c56b4ff1faa21b15c1499c6e88e23f4ed2565b838b9");
        assert_eq!(escaped.0, "7a8a55cfb11678827e5ee0ab6e85bb5f5801621ac9af1d54eddda08228e3cb16");
        assert_eq!(missing.0, "7520553fefd815c23cf25fddf3cfd3c5835cdceb0038f871aa63fa432f85aca1");
        assert_eq!(wide.0, "f3b5ceba5c55334efdaa63b8d9de6a61a4254d86a27da9623404a8f0ae508fed");
    }

    /// A change that happens again (a later revision of the parcel) has a key of its own; the
    /// revision is hashed after the other fields, as `|` and its decimal digits (checked
    /// against the hash of that text, computed here field by field).
    #[test]
    fn a_later_revision_of_the_same_change_has_its_own_key() {
        let mut e = sample_event("P-1");
        let first = key_for("w1", &e);
        e.revision = 2;
        let again = key_for("w1", &e);
        e.revision = 12;
        let later = key_for("w1", &e);
        assert_ne!(first, again);
        assert_ne!(again, later);
        let by_hand = |text: &str| crate::util::hex(&Sha256::digest(text.as_bytes()));
        assert_eq!(first.0, by_hand("w1|j|P-1|rezoned|R-1|C-2|"));
        assert_eq!(again.0, by_hand("w1|j|P-1|rezoned|R-1|C-2||2"));
        assert_eq!(later.0, by_hand("w1|j|P-1|rezoned|R-1|C-2||12"));
        // An effective date that looks like a revision is escaped, so it cannot stand in for one.
        e.revision = 0;
        e.effective_date = Some("|2".into());
        assert_ne!(key_for("w1", &e), again);
    }

    /// A scoped key names its source and the restore epoch after everything else; the legacy
    /// scope (no source, epoch 0) is the old key byte for byte.
    #[test]
    fn a_scoped_key_names_its_source_and_epoch() {
        let mut e = sample_event("P-1");
        e.revision = 2;
        let by_hand = |text: &str| crate::util::hex(&Sha256::digest(text.as_bytes()));
        assert_eq!(key_in("w1", &e, KeyScope::default()), key_for("w1", &e));
        assert_eq!(key_in("w1", &e, KeyScope { source: Some("county|a"), epoch: 0 }).0, by_hand("w1|j|P-1|rezoned|R-1|C-2||2|scounty\\|a"));
        assert_eq!(key_in("w1", &e, KeyScope { source: Some("c"), epoch: 0x1f }).0, by_hand("w1|j|P-1|rezoned|R-1|C-2||2|sc|e1f"));
        assert_eq!(key_in("w1", &e, KeyScope { source: None, epoch: 0x1f }).0, by_hand("w1|j|P-1|rezoned|R-1|C-2||2|e1f"));
        assert_ne!(key_in("w1", &e, KeyScope { source: Some("a"), epoch: 0 }), key_in("w1", &e, KeyScope { source: Some("b"), epoch: 0 }));
    }
}
