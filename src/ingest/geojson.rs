//! Streaming reader for GeoJSON FeatureCollections.
//!
//! The document is walked with serde's visitor API: each element of `features` is handed to a
//! callback as a borrowed raw JSON slice and dropped afterwards, so no whole-document tree is
//! ever built. A feature that fails to parse is the callback's problem (it is quarantined);
//! only a document that is not a FeatureCollection at all fails the layer.
//!
//! Feeds written by Python often contain bare `NaN` / `Infinity` tokens, which are not JSON.
//! [`sanitize_non_finite`] rewrites them to `null` outside strings so that the one feature that
//! carries them can be quarantined (`non_finite`) while the rest of the layer ingests.

use super::IngestError;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// Calls `on_feature(index, raw_json)` for each feature of the collection in `bytes`.
/// Returns the number of features seen.
pub fn for_each_feature<F>(bytes: &[u8], mut on_feature: F) -> Result<u64, IngestError>
where
    F: FnMut(u64, &RawValue),
{
    let clean = sanitize_non_finite(bytes);
    let mut de = serde_json::Deserializer::from_slice(&clean);
    let seed = CollectionSeed { on_feature: &mut on_feature, count: 0, crs: None, kind: None, saw_features: false };
    let out = de.deserialize_map(seed).map_err(|e| IngestError::Malformed(e.to_string()))?;
    de.end().map_err(|e| IngestError::Malformed(e.to_string()))?;
    Ok(out)
}

struct CollectionSeed<'f, F> {
    on_feature: &'f mut F,
    count: u64,
    crs: Option<String>,
    kind: Option<String>,
    saw_features: bool,
}

impl<'de, F: FnMut(u64, &RawValue)> Visitor<'de> for CollectionSeed<'_, F> {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a GeoJSON FeatureCollection object")
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<u64, A::Error> {
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "type" => self.kind = Some(map.next_value::<String>()?),
                "features" => {
                    let seq = FeatureSeq { on_feature: &mut *self.on_feature, count: &mut self.count };
                    map.next_value_seed(seq)?;
                    self.saw_features = true;
                }
                "crs" => {
                    let v: serde_json::Value = map.next_value()?;
                    self.crs = v
                        .pointer("/properties/name")
                        .and_then(|n| n.as_str())
                        .map(str::to_string);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if self.kind.as_deref() != Some("FeatureCollection") {
            return Err(serde::de::Error::custom(format!(
                "\"type\" is {:?}, expected \"FeatureCollection\"",
                self.kind.unwrap_or_default()
            )));
        }
        if !self.saw_features {
            return Err(serde::de::Error::custom("no \"features\" array"));
        }
        if let Some(crs) = &self.crs {
            if !crs_is_wgs84(crs) {
                return Err(serde::de::Error::custom(format!("unsupported crs {crs}")));
            }
        }
        Ok(self.count)
    }
}

impl<'de, F: FnMut(u64, &RawValue)> DeserializeSeed<'de> for CollectionSeed<'_, F> {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        d.deserialize_map(self)
    }
}

struct FeatureSeq<'a, F> {
    on_feature: &'a mut F,
    count: &'a mut u64,
}

impl<'de, F: FnMut(u64, &RawValue)> Visitor<'de> for FeatureSeq<'_, F> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of features")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(raw) = seq.next_element::<&'de RawValue>()? {
            (self.on_feature)(*self.count, raw);
            *self.count += 1;
        }
        Ok(())
    }
}

impl<'de, F: FnMut(u64, &RawValue)> DeserializeSeed<'de> for FeatureSeq<'_, F> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

/// True for the names GeoJSON producers use for lon/lat WGS84.
pub fn crs_is_wgs84(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    n.ends_with("CRS84") || n.ends_with("EPSG::4326") || n == "EPSG:4326" || n.ends_with("EPSG:4326")
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
        let n = for_each_feature(doc, |i, raw| seen.push((i, raw.get().to_string()))).unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen[1], (1, r#"{"b":2}"#.to_string()));
    }

    #[test]
    fn rejects_non_collections_and_foreign_crs() {
        assert!(for_each_feature(br#"{"type":"Feature","features":[]}"#, |_, _| {}).is_err());
        assert!(for_each_feature(br#"[1,2]"#, |_, _| {}).is_err());
        assert!(for_each_feature(b"{\"type\":\"FeatureCollection\",\"features\":[", |_, _| {}).is_err());
        let crs = br#"{"type":"FeatureCollection","crs":{"type":"name","properties":{"name":"EPSG:2227"}},"features":[]}"#;
        assert!(for_each_feature(crs, |_, _| {}).unwrap_err().to_string().contains("2227"));
        let ok = br#"{"type":"FeatureCollection","crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:OGC:1.3:CRS84"}},"features":[]}"#;
        assert_eq!(for_each_feature(ok, |_, _| {}).unwrap(), 0);
    }

    #[test]
    fn non_finite_tokens_become_null_outside_strings() {
        let doc = br#"{"type":"FeatureCollection","features":[{"p":"NaN Infinity","c":[NaN,-Infinity,Infinity]}]}"#;
        let mut raw = String::new();
        for_each_feature(doc, |_, r| raw = r.get().to_string()).unwrap();
        assert_eq!(raw, r#"{"p":"NaN Infinity","c":[null,null,null]}"#);
    }
}
