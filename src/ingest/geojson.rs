//! Streaming reader for GeoJSON FeatureCollections.
//!
//! The document is read through a fixed-size window (any `Read`: a file, a staged payload, a
//! byte slice): a small scanner walks the top-level object, and each element of `features` is
//! handed to a callback as the exact text of that one feature, then forgotten. So a county
//! layer of millions of parcels is read in memory bounded by its largest feature, never as a
//! whole-document tree or even a whole-document buffer.
//!
//! The scanner only finds value boundaries (strings, escapes, nesting); each feature's JSON is
//! parsed by the callback, so a feature that is malformed but balanced is *that feature's*
//! problem (it is quarantined) while the rest of the layer ingests. Only a document that is
//! not a FeatureCollection at all (wrong type, no `features`, foreign CRS, truncated,
//! trailing garbage) fails the layer.
//!
//! Feeds written by Python often contain bare `NaN` / `Infinity` tokens, which are not JSON.
//! [`sanitize_non_finite`] rewrites them to `null` outside strings so that the one feature that
//! carries them can be quarantined (`non_finite`) while the rest of the layer ingests.

use super::IngestError;
use std::borrow::Cow;
use std::io::Read;

/// One feature as it appeared in the document.
#[derive(Debug, Clone, Copy)]
pub struct FeatureText<'a> {
    /// 0-based position in `features`.
    pub index: u64,
    /// The feature's JSON text (non-finite tokens already replaced by `null`; bytes that are
    /// not UTF-8 replaced by U+FFFD, so the feature can still be quarantined with its text).
    pub json: &'a str,
    /// Whether bytes of the feature were not UTF-8 (and so replaced in `json`): its codes and
    /// id are not what the publisher wrote, so the feature must be quarantined, never diffed.
    pub not_utf8: bool,
    /// Bytes of the document consumed so far (for progress reporting).
    pub offset: u64,
}

/// A single value larger than this fails the layer: no real parcel comes near it, and it keeps
/// a hostile document from growing the window without bound.
pub const MAX_VALUE_BYTES: usize = 256 * 1024 * 1024;

const WINDOW: usize = 1 << 20;

/// How far past the first guess at a broken feature's end the second may look
/// ([`Scanner::settle_feature_end`]): closers and whitespace left over, no more.
const SECOND_GUESS_SLACK: usize = 256;

/// Calls `on_feature` for each feature of the FeatureCollection read from `reader`.
/// Returns the number of features seen.
pub fn for_each_feature_in<R, F>(reader: R, mut on_feature: F) -> Result<u64, IngestError>
where
    R: Read,
    F: FnMut(FeatureText<'_>),
{
    let mut sc = Scanner { reader, buf: vec![0; WINDOW], start: 0, end: 0, base: 0, eof: false, saw_non_finite: false };
    let mut kind: Option<String> = None;
    let mut crs: Option<String> = None;
    // What says the document is one page of a larger layer (ArcGIS's exceededTransferLimit,
    // OGC API's numberMatched and "next" link): reading it as the whole layer would make
    // every parcel on the other pages a removal.
    let mut page_of_more: Option<String> = None;
    let mut number_matched: Option<u64> = None;
    let mut saw_features = false;
    let mut count = 0u64;
    sc.skip_byte_order_mark()?;
    match sc.next_non_ws()? {
        Some(b'{') => {}
        None => return Err(sc.error("the document is empty (expected a FeatureCollection)")),
        // What it most likely is, when that is plain from its first bytes (a tester's gzip file
        // was told only "not a JSON object").
        Some(0x1f) if sc.buf[sc.start..sc.end].get(1) == Some(&0x8b) => {
            return Err(sc.error("the document is gzip-compressed (expected a FeatureCollection): a layer is read as plain GeoJSON; gunzip the file, or serve it over HTTP with Content-Encoding: gzip, which is decoded"))
        }
        Some(b'[') => return Err(sc.error("the document is a JSON array (expected a FeatureCollection object)")),
        Some(_) => return Err(sc.error("the document is not a JSON object (expected a FeatureCollection)")),
    }
    sc.start += 1;
    let mut first = true;
    loop {
        match sc.next_non_ws()? {
            Some(b'}') if first => {
                sc.start += 1;
                break;
            }
            Some(b'"') => {}
            _ => return Err(sc.error("expected a member name in the top-level object")),
        }
        first = false;
        let (a, b) = sc.value_span()?;
        let key: String = serde_json::from_slice(&sc.buf[a..b]).map_err(|e| sc.error(&format!("member name: {e}")))?;
        sc.start = b;
        if sc.next_non_ws()? != Some(b':') {
            return Err(sc.error("expected ':' after a member name"));
        }
        sc.start += 1;
        if sc.next_non_ws()?.is_none() {
            return Err(sc.error("document ends after a member name"));
        }
        if key == "features" {
            if saw_features {
                return Err(sc.error("\"features\" appears twice"));
            }
            saw_features = true;
            if sc.next_non_ws()? != Some(b'[') {
                return Err(sc.error("\"features\" is not an array"));
            }
            sc.start += 1;
            if sc.next_non_ws()? == Some(b']') {
                sc.start += 1;
            } else {
                loop {
                    if sc.next_non_ws()?.is_none() {
                        return Err(sc.error("document ends inside \"features\""));
                    }
                    let (a, b) = sc.value_span()?;
                    let len = sc.settle_feature_end(b - a)?;
                    let (a, b) = (sc.start, sc.start + len);
                    let offset = sc.base + b as u64;
                    {
                        let raw = &sc.buf[a..b];
                        let clean: Cow<'_, [u8]> = if sc.saw_non_finite { sanitize_non_finite(raw) } else { Cow::Borrowed(raw) };
                        // Sanitising only replaces ASCII tokens with ASCII, so UTF-8 stays UTF-8.
                        let (text, not_utf8): (Cow<'_, str>, bool) = match std::str::from_utf8(&clean) {
                            Ok(t) => (Cow::Borrowed(t), false),
                            Err(_) => (Cow::Owned(String::from_utf8_lossy(&clean).into_owned()), true),
                        };
                        on_feature(FeatureText { index: count, json: &text, offset, not_utf8 });
                    }
                    count += 1;
                    sc.start = b;
                    match sc.next_non_ws()? {
                        Some(b',') => sc.start += 1,
                        Some(b']') => {
                            sc.start += 1;
                            break;
                        }
                        _ => return Err(sc.error("expected ',' or ']' after a feature")),
                    }
                }
            }
        } else {
            let (a, b) = sc.value_span()?;
            match key.as_str() {
                "type" => {
                    kind = Some(serde_json::from_slice(&sc.buf[a..b]).map_err(|e| sc.error(&format!("\"type\": {e}")))?);
                }
                "crs" => {
                    let v: serde_json::Value =
                        serde_json::from_slice(&sanitize_non_finite(&sc.buf[a..b])).map_err(|e| sc.error(&format!("\"crs\": {e}")))?;
                    // A named crs, or the older {"type":"EPSG","properties":{"code":N}}; any
                    // other crs object is not known to be WGS84, and is refused with it.
                    crs = crs_name(&v);
                }
                "exceededTransferLimit" | "properties" | "numberMatched" | "links" => {
                    let v: serde_json::Value = serde_json::from_slice(&sanitize_non_finite(&sc.buf[a..b])).map_err(|e| sc.error(&format!("\"{key}\": {e}")))?;
                    match key.as_str() {
                        "exceededTransferLimit" | "properties" => {
                            let flag = if key == "properties" { v.get("exceededTransferLimit") } else { Some(&v) };
                            if flag.and_then(serde_json::Value::as_bool) == Some(true) {
                                page_of_more = Some("\"exceededTransferLimit\": true, an ArcGIS query's first page".into());
                            }
                        }
                        // Only a count above the features here says anything (a page of more);
                        // one that is no count says nothing, as in a file it never did.
                        "numberMatched" => number_matched = super::page::whole_count(Some(&v)).ok().flatten(),
                        _ => {
                            let next = v.as_array().is_some_and(|links| links.iter().any(|l| l.get("rel").and_then(serde_json::Value::as_str) == Some("next")));
                            if next {
                                page_of_more = Some("a \"next\" link, an OGC API page".into());
                            }
                        }
                    }
                }
                _ => {}
            }
            sc.start = b;
        }
        match sc.next_non_ws()? {
            Some(b',') => sc.start += 1,
            Some(b'}') => {
                sc.start += 1;
                break;
            }
            _ => return Err(sc.error("expected ',' or '}' in the top-level object")),
        }
    }
    if let Some(next) = sc.next_non_ws()? {
        if next == b'{' {
            return Err(sc.error("another JSON object after the document (expected one FeatureCollection: newline-delimited GeoJSON, one feature a line, is not read)"));
        }
        return Err(sc.error("trailing characters after the document"));
    }
    match kind.as_deref() {
        Some("FeatureCollection") => {}
        Some(other) => return Err(IngestError::Malformed(format!("\"type\" is {other:?}, expected \"FeatureCollection\""))),
        None => {
            return Err(IngestError::Malformed(
                "the document has no \"type\" member (a GeoJSON FeatureCollection has \"type\": \"FeatureCollection\"; Esri JSON is read from an ArcGIS service, kind = \"arcgis\")".into(),
            ))
        }
    }
    if !saw_features {
        return Err(IngestError::Malformed("no \"features\" array".into()));
    }
    if let Some(crs) = &crs {
        if !crs_is_wgs84(crs) {
            return Err(IngestError::Malformed(format!("unsupported crs {crs}")));
        }
    }
    if page_of_more.is_none() {
        if let Some(n) = number_matched.filter(|&n| n > count) {
            page_of_more = Some(format!("\"numberMatched\": {n} with {count} feature(s) here, an OGC API page"));
        }
    }
    if let Some(why) = page_of_more {
        return Err(IngestError::Malformed(format!(
            "the document says it is one page of a larger layer ({why}): read as the whole layer, every parcel on the other pages would be a removal; point the source at the service (kind = \"arcgis\" or \"ogcapi\") so that every page is read"
        )));
    }
    Ok(count)
}

/// [`for_each_feature_in`] over bytes already in memory.
pub fn for_each_feature<F>(bytes: &[u8], on_feature: F) -> Result<u64, IngestError>
where
    F: FnMut(FeatureText<'_>),
{
    for_each_feature_in(bytes, on_feature)
}

/// The window over the document: `buf[start..end]` is read but not consumed; `base` is the
/// document offset of `buf[0]`.
struct Scanner<R> {
    reader: R,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    base: u64,
    eof: bool,
    /// The last value scanned has an `N` or `I` outside strings: it may carry a bare `NaN` /
    /// `Infinity` (those are the only JSON-ish tokens with these letters), so it needs
    /// [`sanitize_non_finite`]. Saves a pass over every clean feature.
    saw_non_finite: bool,
}

impl<R: Read> Scanner<R> {
    fn error(&self, what: &str) -> IngestError {
        IngestError::Malformed(format!("{what} (at byte {})", self.base + self.start as u64))
    }

    /// Reads more input, first moving the unconsumed part to the front (growing the window
    /// when a single value fills it). False at end of input.
    fn fill(&mut self) -> Result<bool, IngestError> {
        if self.eof {
            return Ok(false);
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.base += self.start as u64;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            if self.buf.len() >= MAX_VALUE_BYTES {
                return Err(self.error(&format!("a single value is larger than {} MiB", MAX_VALUE_BYTES >> 20)));
            }
            let grown = (self.buf.len() * 2).min(MAX_VALUE_BYTES);
            self.buf.resize(grown, 0);
        }
        loop {
            match self.reader.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.end += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(IngestError::Malformed(format!("reading the document: {e}"))),
            }
        }
    }

    /// Skips whitespace; returns the next byte without consuming it (None at end of input).
    /// Steps over a UTF-8 byte order mark at the start of the document: Windows tools and
    /// some GIS exports write one, and it is no reason to refuse a layer.
    fn skip_byte_order_mark(&mut self) -> Result<(), IngestError> {
        while self.end - self.start < 3 && self.fill()? {}
        if self.buf[self.start..self.end].starts_with(&[0xEF, 0xBB, 0xBF]) {
            self.start += 3;
        }
        Ok(())
    }

    /// Skips whitespace (consuming it); returns the next byte without consuming it.
    fn next_non_ws(&mut self) -> Result<Option<u8>, IngestError> {
        let (at, b) = self.non_ws_from(0)?;
        self.start += at;
        Ok(b)
    }

    /// The span `buf[a..b]` of the JSON value starting at `start` (which must not be
    /// whitespace). Only boundaries are found here; the value is parsed by whoever needs it.
    ///
    /// This runs on the one thread that reads the document while the workers parse, so it
    /// jumps between the bytes that matter with `memchr` instead of looking at every byte:
    /// an object's end is found by counting only braces, an array's only brackets (a feature
    /// whose brackets do not pair gets a second look: [`Scanner::settle_feature_end`]), and a
    /// string's end by its unescaped quote.
    fn value_span(&mut self) -> Result<(usize, usize), IngestError> {
        let first = self.buf[self.start];
        self.saw_non_finite = false;
        let (open, close) = match first {
            b'{' => (b'{', b'}'),
            b'[' => (b'[', b']'),
            b'"' => (0, 0),
            _ => return self.scalar_span(),
        };
        let mut i = 0usize; // offset from `start`, stable across `fill`
        let mut depth = 0u32;
        let mut in_string = false;
        let mut escaped = false;
        loop {
            while self.start + i < self.end {
                let rest = &self.buf[self.start + i..self.end];
                if in_string {
                    if escaped {
                        escaped = false;
                        i += 1;
                        continue;
                    }
                    match memchr::memchr2(b'"', b'\\', rest) {
                        None => i += rest.len(),
                        Some(k) if rest[k] == b'\\' => {
                            escaped = true;
                            i += k + 1;
                        }
                        Some(k) => {
                            in_string = false;
                            i += k + 1;
                            if depth == 0 {
                                return Ok((self.start, self.start + i));
                            }
                        }
                    }
                } else {
                    // Outside strings, only quotes and this value's own brackets matter;
                    // the stretch before the next of them is checked for `NaN` / `Infinity`.
                    let hit = if open == 0 { memchr::memchr(b'"', rest) } else { memchr::memchr3(b'"', open, close, rest) };
                    let stretch = &rest[..hit.unwrap_or(rest.len())];
                    self.saw_non_finite |= memchr::memchr2(b'N', b'I', stretch).is_some();
                    match hit {
                        None => i += rest.len(),
                        Some(k) => {
                            let b = rest[k];
                            i += k + 1;
                            if b == b'"' {
                                in_string = true;
                            } else if b == open {
                                depth += 1;
                            } else {
                                depth -= 1;
                                if depth == 0 {
                                    return Ok((self.start, self.start + i));
                                }
                            }
                        }
                    }
                }
            }
            if !self.fill()? {
                return Err(self.error("document ends inside a value (truncated?)"));
            }
        }
    }

    /// The length of the feature starting at `start`, given the `len` [`Scanner::value_span`]
    /// found. A feature is followed by `,` or `]`; when it is not, its brackets do not pair
    /// and its end is a guess. Counting braces only misreads an object with an array closed
    /// by a brace (`{"c":[1,2}},...`: the end found is one short) or with an object closed by
    /// a bracket (`{"x":{"b":1]},...`: the end found is far past). So the other count (any
    /// closer closes any opener) is tried too, for an object or array only, and taken when a
    /// `,` or `]` follows it and it ends before the first guess or past it by closers and
    /// whitespace alone: never by swallowing what follows (a valid feature taken into a
    /// broken one would read as removed). Otherwise the first guess stands, and the layer
    /// fails as it did. The second count looks no further than a little past the first end,
    /// so it never holds more of the document than the first did.
    fn settle_feature_end(&mut self, len: usize) -> Result<usize, IngestError> {
        if matches!(self.non_ws_from(len)?.1, Some(b',' | b']')) || !matches!(self.buf[self.start], b'{' | b'[') {
            return Ok(len);
        }
        if let Some(other) = self.any_closer_len(len + SECOND_GUESS_SLACK)? {
            let past = self.buf[self.start + len.min(other)..self.start + other].iter().all(|&b| matches!(b, b'}' | b']') || is_ws(b));
            if (other < len || past) && matches!(self.non_ws_from(other)?.1, Some(b',' | b']')) {
                return Ok(other);
            }
        }
        // The first end stands (its non-finite flag, scanned again).
        self.value_span()?;
        Ok(len)
    }

    /// The first byte at or after `from` bytes past `start` that is not whitespace, with its
    /// offset from `start` (None, and the offset of the end, at the end of input). Nothing
    /// is consumed; offsets from `start` stay valid across [`Scanner::fill`].
    fn non_ws_from(&mut self, from: usize) -> Result<(usize, Option<u8>), IngestError> {
        let mut i = from;
        loop {
            while self.start + i < self.end {
                let b = self.buf[self.start + i];
                if !is_ws(b) {
                    return Ok((i, Some(b)));
                }
                i += 1;
            }
            if !self.fill()? {
                return Ok((i, None));
            }
        }
    }

    /// The length of the object or array at `start` when any closer closes any opener (the
    /// count this scanner used before it counted only the value's own kind), if it ends
    /// within `limit` bytes. Byte by byte; it runs only for a feature whose brackets do not
    /// pair. Sets the non-finite flag for that span.
    fn any_closer_len(&mut self, limit: usize) -> Result<Option<usize>, IngestError> {
        let mut i = 0usize;
        let mut depth = 0u32;
        let (mut in_string, mut escaped) = (false, false);
        self.saw_non_finite = false;
        loop {
            while self.start + i < self.end {
                if i >= limit {
                    return Ok(None);
                }
                let b = self.buf[self.start + i];
                i += 1;
                if in_string {
                    if escaped {
                        escaped = false;
                    } else if b == b'\\' {
                        escaped = true;
                    } else if b == b'"' {
                        in_string = false;
                    }
                    continue;
                }
                match b {
                    b'"' => in_string = true,
                    b'N' | b'I' => self.saw_non_finite = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Ok(Some(i));
                        }
                    }
                    _ => {}
                }
            }
            if i >= limit || !self.fill()? {
                return Ok(None);
            }
        }
    }

    /// The span of a number, `true`, `false` or `null` (or a bare word that is none of them,
    /// for the parser to refuse): it ends at the next delimiter or at the end of input.
    fn scalar_span(&mut self) -> Result<(usize, usize), IngestError> {
        let mut i = 0usize;
        loop {
            while self.start + i < self.end {
                let b = self.buf[self.start + i];
                if matches!(b, b',' | b']' | b'}') || is_ws(b) {
                    return Ok((self.start, self.start + i));
                }
                self.saw_non_finite |= b == b'N' || b == b'I';
                i += 1;
            }
            if !self.fill()? {
                if i > 0 {
                    return Ok((self.start, self.start + i));
                }
                return Err(self.error("document ends inside a value (truncated?)"));
            }
        }
    }
}

/// JSON's whitespace.
fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

/// The name of a `crs` member's value (`None` for null): its `properties.name`, or the older
/// `{"type":"EPSG","properties":{"code":N}}` as `EPSG:N`; any other crs object as its text
/// (not known to be WGS84, so refused with it).
pub fn crs_name(v: &serde_json::Value) -> Option<String> {
    if v.is_null() {
        return None;
    }
    Some(match (v.pointer("/properties/name").and_then(|n| n.as_str()), v.pointer("/properties/code")) {
        (Some(name), _) => name.to_string(),
        (None, Some(code)) => format!("EPSG:{}", code.as_str().map_or_else(|| code.to_string(), str::to_string)),
        (None, None) => crate::util::truncate_text(&v.to_string(), 200),
    })
}

/// True for the names GeoJSON producers use for lon/lat WGS84 (`…CRS84`, `EPSG:4326`,
/// `urn:…:EPSG::4326`, `…/EPSG/0/4326`).
pub fn crs_is_wgs84(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    n.ends_with("CRS84") || n.ends_with(":4326") || n.ends_with("/4326")
}

/// Replaces bare `NaN`, `Infinity` and `-Infinity` tokens outside strings with `null`
/// Borrows when there is nothing to replace.
pub fn sanitize_non_finite(bytes: &[u8]) -> Cow<'_, [u8]> {
    // Fast path: neither token can occur without these letters.
    if !bytes.windows(3).any(|w| w == b"NaN" || w == b"Inf") {
        return Cow::Borrowed(bytes);
    }
    let rebuilt = rebuild_with_nulls(bytes);
    if rebuilt.as_slice() == bytes {
        Cow::Borrowed(bytes)
    } else {
        Cow::Owned(rebuilt)
    }
}

fn rebuild_with_nulls(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let mut in_string = false;
    let mut escaped = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            out.push(b);
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            i += 1;
            continue;
        }
        if b == b'"' {
            in_string = true;
            out.push(b);
            i += 1;
        } else if bytes[i..].starts_with(b"NaN") {
            out.extend_from_slice(b"null");
            i += 3;
        } else if bytes[i..].starts_with(b"-Infinity") {
            out.extend_from_slice(b"null");
            i += 9;
        } else if bytes[i..].starts_with(b"Infinity") {
            out.extend_from_slice(b"null");
            i += 8;
        } else {
            out.push(b);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_features_and_counts() {
        let doc = br#"{"features":[{"a":1},{"b":2}],"type":"FeatureCollection","extra":{"x":[1,2]}}"#;
        let mut seen = vec![];
        let n = for_each_feature(doc, |f| seen.push((f.index, f.json.to_string()))).unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen[1], (1, r#"{"b":2}"#.to_string()));
    }

    #[test]
    fn rejects_non_collections_and_foreign_crs() {
        assert!(for_each_feature(br#"{"type":"Feature","features":[]}"#, |_| {}).is_err());
        assert!(for_each_feature(br#"[1,2]"#, |_| {}).is_err());
        assert!(for_each_feature(b"{\"type\":\"FeatureCollection\",\"features\":[", |_| {}).is_err());
        let crs = br#"{"type":"FeatureCollection","crs":{"type":"name","properties":{"name":"EPSG:2227"}},"features":[]}"#;
        assert!(for_each_feature(crs, |_| {}).unwrap_err().to_string().contains("2227"));
        let ok = br#"{"type":"FeatureCollection","crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:OGC:1.3:CRS84"}},"features":[]}"#;
        assert_eq!(for_each_feature(ok, |_| {}).unwrap(), 0);
        // The older crs object, by code: 4326 is WGS84, anything else is refused.
        let by_code = br#"{"type":"FeatureCollection","crs":{"type":"EPSG","properties":{"code":2227}},"features":[]}"#;
        assert!(for_each_feature(by_code, |_| {}).unwrap_err().to_string().contains("EPSG:2227"));
        let wgs84 = br#"{"type":"FeatureCollection","crs":{"type":"EPSG","properties":{"code":4326}},"features":[]}"#;
        assert_eq!(for_each_feature(wgs84, |_| {}).unwrap(), 0);
        let odd = br#"{"type":"FeatureCollection","crs":{"type":"link","properties":{"href":"x"}},"features":[]}"#;
        assert!(for_each_feature(odd, |_| {}).unwrap_err().to_string().contains("unsupported crs"));
    }

    /// What a document that is not one FeatureCollection most likely is, when its bytes say
    /// it plainly: gzip, an array, newline-delimited features.
    #[test]
    fn a_document_that_is_not_a_collection_says_what_it_looks_like() {
        let says = |doc: &[u8]| for_each_feature(doc, |_| {}).unwrap_err().to_string();
        assert!(says(&[0x1f, 0x8b, 0x08, 0x00, 0x00]).contains("gzip-compressed"));
        assert!(says(br#"[{"type":"Feature"}]"#).contains("a JSON array"));
        let lines = "{\"type\":\"Feature\",\"properties\":{},\"geometry\":null}\n{\"type\":\"Feature\",\"properties\":{},\"geometry\":null}\n";
        assert!(says(lines.as_bytes()).contains("newline-delimited"));
        assert!(says(b"{\"type\":\"FeatureCollection\",\"features\":[]} x").contains("trailing characters"));
    }

    /// A document that says it is one page of a larger layer (an ArcGIS query's or an OGC
    /// API items page given as a plain GeoJSON URL) is refused: read as the whole layer, the
    /// other pages' parcels would all be removals.
    #[test]
    fn one_page_of_a_larger_layer_is_refused() {
        let f = r#"{"type":"Feature","properties":{},"geometry":null}"#;
        for (doc, says) in [
            (format!(r#"{{"type":"FeatureCollection","features":[{f}],"exceededTransferLimit":true}}"#), "exceededTransferLimit"),
            (format!(r#"{{"type":"FeatureCollection","properties":{{"exceededTransferLimit":true}},"features":[{f}]}}"#), "exceededTransferLimit"),
            (format!(r#"{{"type":"FeatureCollection","numberMatched":5,"features":[{f}]}}"#), "numberMatched"),
            (format!(r#"{{"type":"FeatureCollection","features":[{f}],"links":[{{"rel":"self","href":"a"}},{{"rel":"next","href":"b"}}]}}"#), "next"),
        ] {
            let err = for_each_feature(doc.as_bytes(), |_| {}).unwrap_err().to_string();
            assert!(err.contains("one page of a larger layer") && err.contains(says), "{doc}: {err}");
        }
        // The same members saying the page is all there is: read as usual.
        for doc in [
            format!(r#"{{"type":"FeatureCollection","features":[{f}],"exceededTransferLimit":false,"properties":{{"exceededTransferLimit":false}}}}"#),
            format!(r#"{{"type":"FeatureCollection","numberMatched":1,"numberReturned":1,"features":[{f}],"links":[{{"rel":"self","href":"a"}}]}}"#),
        ] {
            assert_eq!(for_each_feature(doc.as_bytes(), |_| {}).unwrap(), 1, "{doc}");
        }
    }

    #[test]
    fn non_finite_tokens_become_null_outside_strings() {
        let doc = br#"{"type":"FeatureCollection","features":[{"p":"NaN Infinity","c":[NaN,-Infinity,Infinity]}]}"#;
        let mut raw = String::new();
        for_each_feature(doc, |f| raw = f.json.to_string()).unwrap();
        assert_eq!(raw, r#"{"p":"NaN Infinity","c":[null,null,null]}"#);
    }

    /// A reader that hands out one byte per call: every value crosses a window refill.
    struct Trickle<'a>(&'a [u8]);
    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            match (self.0.split_first(), out.first_mut()) {
                (Some((b, rest)), Some(slot)) => {
                    *slot = *b;
                    self.0 = rest;
                    Ok(1)
                }
                _ => Ok(0),
            }
        }
    }

    #[test]
    fn values_split_across_reads_and_tricky_strings() {
        let doc = br#" { "bbox" : [1, 2.5e3, -3], "exceededTransferLimit": false, "n": 12,
            "features" : [ {"p":"a } ] { \" quote","q":[[1,2],[3]]} , {"x":null} ],
            "type":"FeatureCollection" } "#;
        let mut seen = vec![];
        let n = for_each_feature_in(Trickle(doc), |f| seen.push(f.json.to_string())).unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen[0], r#"{"p":"a } ] { \" quote","q":[[1,2],[3]]}"#);
        assert_eq!(seen[1], r#"{"x":null}"#);
    }

    #[test]
    fn a_broken_feature_is_handed_over_not_fatal_but_truncation_and_garbage_are() {
        let doc = br#"{"type":"FeatureCollection","features":[{"a":1,,},{"b":2}]}"#;
        let mut seen = vec![];
        assert_eq!(for_each_feature(doc, |f| seen.push(f.json.to_string())).unwrap(), 2);
        assert_eq!(seen[0], r#"{"a":1,,}"#);
        let truncated = br#"{"type":"FeatureCollection","features":[{"a":1},{"b":"#;
        assert!(for_each_feature(truncated, |_| {}).unwrap_err().to_string().contains("truncated"));
        let trailing = br#"{"type":"FeatureCollection","features":[]} x"#;
        assert!(for_each_feature(trailing, |_| {}).is_err());
        let no_features = br#"{"type":"FeatureCollection"}"#;
        assert!(for_each_feature(no_features, |_| {}).is_err());
        assert!(for_each_feature(b"", |_| {}).is_err());
        assert!(for_each_feature(br#"{"type":"FeatureCollection","features":{}}"#, |_| {}).is_err());
    }

    /// A byte order mark is stepped over (also when it arrives a byte at a time); bytes that
    /// are not UTF-8 are flagged on their feature; an empty document and one without a
    /// `type` say so.
    #[test]
    fn byte_order_marks_bad_bytes_and_empty_documents() {
        let doc = b"\xEF\xBB\xBF {\"type\":\"FeatureCollection\",\"features\":[{\"a\":\"R-\xff1\"},{\"b\":2}]}";
        for trickle in [false, true] {
            let mut seen = vec![];
            let on = |f: FeatureText<'_>| seen.push((f.json.to_string(), f.not_utf8));
            let n = if trickle { for_each_feature_in(Trickle(doc), on) } else { for_each_feature(doc, on) };
            assert_eq!(n.unwrap(), 2);
            assert_eq!(seen, vec![("{\"a\":\"R-\u{fffd}1\"}".to_string(), true), (r#"{"b":2}"#.to_string(), false)]);
        }
        for empty in [&b""[..], b"  \n", b"\xEF\xBB\xBF"] {
            assert!(for_each_feature(empty, |_| {}).unwrap_err().to_string().contains("the document is empty"));
        }
        let esri = br#"{"geometryType":"esriGeometryPolygon","features":[]}"#;
        assert!(for_each_feature(esri, |_| {}).unwrap_err().to_string().contains("no \"type\" member"));
    }

    /// A reader that hands out `n` bytes per call.
    struct Chunks<'a>(&'a [u8], usize);
    impl Read for Chunks<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let n = self.1.min(out.len()).min(self.0.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    /// Random JSON with what makes boundaries hard: strings holding quotes, backslashes,
    /// braces, brackets and the letters of `NaN` / `Infinity`, nesting of both kinds.
    /// With `non_finite`, some scalars are bare `NaN` / `Infinity` tokens (not JSON).
    fn random_value(seed: &mut u64, depth: u32, non_finite: bool, out: &mut String) {
        let mut next = |m: u64| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed % m
        };
        let scalars = ["-93.2972075", "44.95", "0", "1e3", "true", "null", "NaN", "-Infinity", "Infinity"];
        match if depth >= 4 { next(4) } else { next(7) } {
            0 => out.push_str(scalars[next(if non_finite { 9 } else { 6 }) as usize]),
            1..=3 => {
                out.push('"');
                for _ in 0..next(6) {
                    out.push_str(["a", "\\\"", "\\\\", "{", "}", "[", "]", "NaN", "I", "\\u00e9", ","][next(11) as usize]);
                }
                out.push('"');
            }
            4 | 5 => {
                out.push('{');
                for k in 0..next(4) {
                    if k > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("\"k{k}\" : "));
                    random_value(seed, depth + 1, non_finite, out);
                }
                out.push('}');
            }
            _ => {
                out.push('[');
                for k in 0..next(4) {
                    if k > 0 {
                        out.push_str(" ,\n");
                    }
                    random_value(seed, depth + 1, non_finite, out);
                }
                out.push(']');
            }
        }
    }

    /// Property: for any document, at any read size, the features handed over are exactly
    /// the texts it was built from (and, when it is JSON, the texts serde_json finds); a
    /// feature is flagged for the non-finite rewrite exactly when a byte outside its strings
    /// is `N` or `I`.
    #[test]
    fn spans_match_the_features_at_every_read_size() {
        #[derive(serde::Deserialize)]
        struct Doc<'a> {
            #[serde(borrow)]
            features: Vec<&'a serde_json::value::RawValue>,
        }
        fn letters_outside_strings(text: &str) -> bool {
            let (mut in_string, mut escaped) = (false, false);
            text.bytes().any(|b| {
                if in_string {
                    if escaped {
                        escaped = false;
                    } else if b == b'\\' {
                        escaped = true;
                    } else if b == b'"' {
                        in_string = false;
                    }
                    false
                } else {
                    in_string = b == b'"';
                    b == b'N' || b == b'I'
                }
            })
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut flagged = 0;
        for case in 0..600 {
            let non_finite = case % 2 == 1;
            let mut doc = String::from("{\"bbox\": [1, [2, {\"x\": \"]\"}]], \"type\": \"FeatureCollection\", \"features\": [");
            let mut texts = vec![];
            for k in 0..(case % 7) {
                if k > 0 {
                    doc.push_str(",\n ");
                }
                let mut value = String::new();
                random_value(&mut seed, 1, non_finite, &mut value);
                // Features are objects; a scalar or array member of `features` is streamed
                // too (the parser refuses it later).
                let text = if k % 3 == 2 { value } else { format!("{{\"type\":\"Feature\",\"properties\":{value}}}") };
                doc.push_str(&text);
                texts.push(text);
            }
            doc.push_str("], \"crs\": {\"properties\": {\"name\": \"EPSG:4326\"}}}");
            if !non_finite {
                let parsed: Doc<'_> = serde_json::from_str(&doc).unwrap_or_else(|e| panic!("{e}: {doc}"));
                assert_eq!(parsed.features.iter().map(|r| r.get()).collect::<Vec<_>>(), texts);
            }
            for size in [1, 2, 3, 7, 64, 1 << 20] {
                let mut seen = vec![];
                let count = for_each_feature_in(Chunks(doc.as_bytes(), size), |f| seen.push(f.json.to_string())).unwrap_or_else(|e| panic!("{e}: {doc}"));
                assert_eq!(count as usize, texts.len());
                // Non-finite tokens come out as `null`; the rest is as written.
                let cleaned: Vec<String> = texts.iter().map(|t| String::from_utf8(sanitize_non_finite(t.as_bytes()).into_owned()).unwrap()).collect();
                assert_eq!(seen, cleaned, "read size {size}: {doc}");
            }
            // The flag, checked on the spans themselves.
            let mut sc = Scanner { reader: doc.as_bytes(), buf: vec![0; WINDOW], start: 0, end: 0, base: 0, eof: false, saw_non_finite: false };
            sc.fill().unwrap();
            let mut at = 0;
            for text in &texts {
                at += doc[at..].find(text.as_str()).unwrap();
                sc.start = at;
                let (a, b) = sc.value_span().unwrap();
                assert_eq!(&doc[a..b], text);
                assert_eq!(sc.saw_non_finite, letters_outside_strings(text), "{text}");
                flagged += usize::from(sc.saw_non_finite);
                at = b;
            }
        }
        assert!(flagged > 20, "the generator made too few features with non-finite tokens: {flagged}");
    }

    /// A feature whose brackets do not pair is handed over broken (to be quarantined) and the
    /// features after it stream as usual, whichever way they fail to pair: an array never
    /// closed, a stray closer, an array closed by a brace, an object closed by a bracket. At
    /// every read size (the second guess re-reads across refills).
    #[test]
    fn unpaired_brackets_break_one_feature_not_the_layer() {
        let cases: [(&str, &[&str]); 4] = [
            (r#"[{"a":[1,2},{"b":2}]"#, &[r#"{"a":[1,2}"#, r#"{"b":2}"#]),
            (r#"[{"c":3]} , {"d":1}]"#, &[r#"{"c":3]}"#, r#"{"d":1}"#]),
            (r#"[{"c":[1,2}},{"d":1}]"#, &[r#"{"c":[1,2}}"#, r#"{"d":1}"#]),
            (r#"[{"x":{"b":1]},{"d":1}]"#, &[r#"{"x":{"b":1]}"#, r#"{"d":1}"#]),
        ];
        for (features, want) in cases {
            let doc = format!(r#"{{"type":"FeatureCollection","features":{features}}}"#);
            for size in [1, 2, 5, 1 << 20] {
                let mut seen = vec![];
                let n = for_each_feature_in(Chunks(doc.as_bytes(), size), |f| seen.push(f.json.to_string())).unwrap_or_else(|e| panic!("{e}: {doc}"));
                assert_eq!((n as usize, seen.as_slice()), (want.len(), want.iter().map(|w| w.to_string()).collect::<Vec<_>>().as_slice()), "{doc} at {size}");
            }
        }
        // Nothing pairs, or pairing would swallow the features after it: the layer fails
        // (nothing is taken for removed), as it did.
        for features in [r#"[{"a":[}}}]"#, r#"[{"a":1},"junk" x,{"id":"b"},{"id":"c"}]"#, r#"[{"a":1},5 6,{"id":"b"}]"#, r#"[{"a":[1} x,{"id":"b"},{"c":1]}]"#] {
            let doc = format!(r#"{{"type":"FeatureCollection","features":{features}}}"#);
            let mut seen = vec![];
            assert!(for_each_feature(doc.as_bytes(), |f| seen.push(f.json.to_string())).is_err(), "{doc}: {seen:?}");
            assert!(!seen.iter().any(|f| f.contains(r#""id":"b""#) && f != r#"{"id":"b"}"#), "a valid feature swallowed: {seen:?}");
        }
    }

    #[test]
    fn offsets_grow_to_the_document_length() {
        let doc = br#"{"type":"FeatureCollection","features":[{"a":1},{"b":2}]}"#;
        let mut last = 0;
        for_each_feature(doc, |f| last = f.offset).unwrap();
        assert_eq!(&doc[..last as usize], br#"{"type":"FeatureCollection","features":[{"a":1},{"b":2}"#);
    }
}
