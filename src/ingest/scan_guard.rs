//! Bounds on one paged scan of a portal layer *as a whole*. Each response is already capped
//! (`max_response_bytes`, `max_decompressed_bytes`), but a hostile or broken server can keep
//! answering full pages — the same page again and again, or ever-new junk under a huge
//! claimed row count — and a pager that trusts it would read on for hours, holding every page
//! in memory. Two guards close that:
//!
//! * [`LayerBytes`]: the decoded bytes of every page of one scan add up to at most
//!   `[ingest] max_layer_bytes`; past it the run fails naming the cap and the key;
//! * [`SeenRows`]: which rows the scan already holds, by identity, kept as 64-bit hashes (never
//!   copies of the rows), so a page that brings nothing new is noticed at once.
//!
//! Both are per scan pass: a rescan (the row count moved) starts afresh, like the rows it holds.

use super::http::FetchError;
use serde_json::Value;
use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher, RandomState};

/// The running byte total of one scan against `[ingest] max_layer_bytes`.
#[derive(Debug, Clone)]
pub struct LayerBytes {
    limit: u64,
    read: u64,
}

impl LayerBytes {
    /// A fresh total for one scan pass with the configured cap.
    pub fn new(limit: u64) -> LayerBytes {
        LayerBytes { limit, read: 0 }
    }

    /// Counts one page's (decoded) body of `n` bytes read from `url`; fails once the scan's
    /// pages add up to more than the cap.
    pub fn add(&mut self, url: &str, n: u64) -> Result<(), FetchError> {
        self.read = self.read.saturating_add(n);
        if self.read > self.limit {
            return Err(FetchError::LayerTooLarge { url: url.to_string(), limit: self.limit, read: self.read });
        }
        Ok(())
    }

    /// Bytes counted so far.
    pub fn read(&self) -> u64 {
        self.read
    }
}

/// The identities of the rows one scan holds, as keyed 64-bit hashes (SipHash with a random
/// key per scan, so a server cannot aim collisions at it). A row's identity is its own id
/// when it carries one — a GeoJSON feature `id`, or SODA's `:id` system field (present when
/// the resource URL selects `:*`) — and otherwise the row's whole JSON ([`PageRows::is_new`]
/// tells identical rows on one page apart).
#[derive(Debug, Default)]
pub struct SeenRows {
    key: RandomState,
    seen: HashSet<u64>,
    /// Rows are known by their bytes only, never by an id they carry (a server whose ids
    /// are not unique must not lose rows to them).
    by_content: bool,
}

impl SeenRows {
    /// An empty set for one scan pass.
    pub fn new() -> SeenRows {
        SeenRows::default()
    }

    /// An empty set that knows rows by their bytes only (OGC API features, whose `id` a
    /// server may derive from a field that is not unique).
    pub fn by_content() -> SeenRows {
        SeenRows { by_content: true, ..SeenRows::default() }
    }

    /// Starts one page: its rows are then recorded one at a time ([`PageRows::is_new`]), as
    /// the page is parsed.
    pub fn on_page(&mut self) -> PageRows<'_> {
        PageRows { seen: self, on_page: std::collections::HashMap::new() }
    }

    /// How many distinct rows are held.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// True when no row is held.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    fn identity(&self, row: &Value) -> u64 {
        let mut w = HashWriter(self.key.build_hasher());
        let own_id = row
            .get("id")
            .or_else(|| row.get(":id"))
            .or_else(|| row.get("properties").and_then(|p| p.get(":id")))
            .filter(|v| !v.is_null() && !self.by_content);
        // Writing into a hasher cannot fail; if serde_json ever reported an error here the
        // partial hash would still be a valid (if weaker) identity.
        match (own_id, row) {
            (Some(id), _) => {
                w.0.write_u8(b'i');
                write_id(&mut w, id);
            }
            // A row's `id` counts by its text: a server that wrote `8` on one page and `"8"`
            // on the next for the same feature (pages that overlap) made two rows of it, and
            // the overlap went unseen (a black-box tester); normalize reads both as one id.
            (None, Value::Object(members)) => {
                w.0.write_u8(b'o');
                for (name, value) in members {
                    let _ = serde_json::to_writer(&mut w, name);
                    match name.as_str() {
                        "id" => write_id(&mut w, value),
                        _ => {
                            let _ = serde_json::to_writer(&mut w, value);
                        }
                    }
                }
            }
            (None, _) => {
                w.0.write_u8(b'r');
                let _ = serde_json::to_writer(&mut w, row);
            }
        }
        w.0.finish()
    }
}

/// An id as the text normalize reads it as (`8`, `8.0` and `"8"` alike).
fn write_id<H: Hasher>(w: &mut HashWriter<H>, id: &Value) {
    let _ = match id {
        Value::Number(n) => serde_json::to_writer(w, &crate::ingest::normalize::number_text(n)),
        other => serde_json::to_writer(w, other),
    };
}

/// One page's rows being recorded. Rows are told apart within the page too: the second of
/// two identical rows on one page is a row of the layer (a server does not repeat a row
/// inside a page), while the same rows on a later page — a page served twice, pages that
/// overlap — are repeats. So a layer that holds two identical rows keeps both, and an
/// overlap is still caught.
pub struct PageRows<'a> {
    seen: &'a mut SeenRows,
    /// How often each identity came on this page so far.
    on_page: std::collections::HashMap<u64, u64>,
}

impl PageRows<'_> {
    /// Records the page's next row; true when the scan did not hold it yet.
    pub fn is_new(&mut self, row: &Value) -> bool {
        let h = self.seen.identity(row);
        let nth = self.on_page.entry(h).or_insert(0);
        let key = if *nth == 0 { h } else { self.seen.key.hash_one((h, *nth)) };
        *nth += 1;
        self.seen.seen.insert(key)
    }
}

/// Feeds serialised JSON straight into a hasher: the row is hashed without a copy of its text.
struct HashWriter<H: Hasher>(H);

impl<H: Hasher> std::io::Write for HashWriter<H> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn layer_bytes_fail_past_the_cap_naming_the_key() {
        let mut b = LayerBytes::new(100);
        assert!(b.add("http://x/p?0", 60).is_ok());
        assert!(b.add("http://x/p?1", 40).is_ok(), "exactly the cap is allowed");
        let e = b.add("http://x/p?2", 1).unwrap_err().to_string();
        assert!(e.contains("http://x/p?2") && e.contains("100 bytes") && e.contains("[ingest] max_layer_bytes"), "{e}");
        assert_eq!(b.read(), 101);
        let mut huge = LayerBytes::new(u64::MAX);
        assert!(huge.add("u", u64::MAX).is_ok() && huge.add("u", 5).is_ok(), "saturates, never wraps");
    }

    /// Records `row` as a page of its own; true when the scan did not hold it yet.
    fn insert(s: &mut SeenRows, row: &Value) -> bool {
        s.on_page().is_new(row)
    }

    #[test]
    fn rows_are_known_by_their_id_or_their_bytes() {
        let mut s = SeenRows::new();
        let a = json!({"type": "Feature", "properties": {"APN": "1"}, "geometry": null});
        let b = json!({"type": "Feature", "properties": {"APN": "2"}, "geometry": null});
        assert!(insert(&mut s, &a) && insert(&mut s, &b));
        assert!(!insert(&mut s, &a.clone()), "the same bytes again are not new");
        // Rows that carry an id are known by it, whatever else changed.
        assert!(insert(&mut s, &json!({"id": 7, "properties": {"v": 1}})));
        assert!(!insert(&mut s, &json!({"id": 7, "properties": {"v": 2}})));
        assert!(!insert(&mut s, &json!({"id": "7", "properties": {"v": 2}})), "an id counts by its text");
        // Known by content, a row's id counts by its text too (a server wrote 8, then "8").
        let mut c = SeenRows::by_content();
        assert!(insert(&mut c, &json!({"id": 8, "properties": {"v": 1}})));
        assert!(!insert(&mut c, &json!({"id": "8", "properties": {"v": 1}})));
        assert!(!insert(&mut c, &json!({"id": 8.0, "properties": {"v": 1}})));
        assert!(insert(&mut c, &json!({"id": "8", "properties": {"v": 2}})), "other content is another row");
        assert!(insert(&mut s, &json!({":id": "row-1", "v": 1})));
        assert!(!insert(&mut s, &json!({":id": "row-1", "v": 2})));
        assert!(insert(&mut s, &json!({"properties": {":id": "row-2", "v": 1}})));
        assert!(!insert(&mut s, &json!({"properties": {":id": "row-2", "v": 2}})));
        // A null id is no id: such rows are known by their bytes.
        assert!(insert(&mut s, &json!({"id": null, "v": 1})));
        assert!(insert(&mut s, &json!({"id": null, "v": 2})));
        // An id and a whole row with the same text are different identities.
        assert!(insert(&mut s, &json!(7)));
        assert_eq!(s.len(), 8);
    }

    fn page(s: &mut SeenRows, rows: &[Value]) -> Vec<bool> {
        let mut p = s.on_page();
        rows.iter().map(|r| p.is_new(r)).collect()
    }

    #[test]
    fn identical_rows_on_one_page_are_rows_and_on_a_later_page_repeats() {
        let mut s = SeenRows::new();
        let a = json!({"type": "Feature", "properties": {"APN": "1"}, "geometry": null});
        let b = json!({"type": "Feature", "properties": {"APN": "2"}, "geometry": null});
        assert_eq!(page(&mut s, &[a.clone(), a.clone(), b.clone()]), vec![true, true, true]);
        // The same page again: all repeats; an overlap of one row: that row only.
        assert_eq!(page(&mut s, &[a.clone(), a.clone(), b.clone()]), vec![false, false, false]);
        let c = json!({"type": "Feature", "properties": {"APN": "3"}, "geometry": null});
        assert_eq!(page(&mut s, &[b, c]), vec![false, true]);
        assert_eq!(s.len(), 4);
        // Known by content only, two rows with one id are two rows.
        let mut by_content = SeenRows::by_content();
        assert_eq!(page(&mut by_content, &[json!({"id": 1, "v": 1}), json!({"id": 1, "v": 2})]), vec![true, true]);
        assert_eq!(page(&mut by_content, &[json!({"id": 1, "v": 2})]), vec![false]);
    }
}
