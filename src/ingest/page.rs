//! A portal page read one feature at a time. A query page (ArcGIS, OGC API, Socrata) is one
//! JSON object whose `features` array is nearly all of it. Parsed into one
//! `serde_json::Value` tree, a page takes about fifteen times its bytes: a server that ignores
//! the page size asked for and answers the whole layer in one 71 MB page took the process to
//! 1.06 GB, and a page at the 512 MiB `max_response_bytes` cap would have needed ~7 GB.
//! [`read_features`] hands each feature to the caller as soon as it is parsed and keeps only
//! the other members the caller names (links, counts, flags, an error; anything else is
//! skipped unparsed), so a page costs its bytes plus one feature's tree; a page too large to
//! hold (`http::Session::page_in_memory`) is read back from its spool file, and costs one
//! feature's tree and a read buffer. The small answers
//! around a scan (layer metadata, counts) are read the same way: a server that ignores
//! `returnCountOnly` and answers a whole layer costs no more there.

use super::http::FetchError;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Deserializer, Map, Value};

/// A page without its features: the other top-level members asked for, and how many features
/// its `features` array held (`None` when it has no such array, or `features` is `null`).
#[derive(Debug, Default)]
pub struct PageHead {
    /// The page's other members asked for, as one JSON object (`links`, `numberMatched`,
    /// `exceededTransferLimit`, `spatialReference`, `error`, …).
    pub members: Value,
    pub features: Option<u64>,
}

/// A count a portal writes (`numberMatched`): a JSON integer, a whole number written as a
/// float (`300.0`: JSON Schema's `integer` allows it) or as digits in a string. `Ok(None)`
/// when it is absent or `null`; `Err` with what was found when it is anything else: a count
/// that cannot be read must not leave a scan unchecked (a black-box tester: `300.0` was read
/// as no count, and a scan one page short alerted its last 10 parcels `removed`).
pub fn whole_count(v: Option<&Value>) -> Result<Option<u64>, String> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53: every whole f64 below is exact
    let refused = |v: &Value| Err(crate::util::truncate_text(&v.to_string(), 60));
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(number @ Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
            (Some(n), _) => Ok(Some(n)),
            (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 && f <= EXACT => Ok(Some(f as u64)),
            _ => refused(number),
        },
        Some(s @ Value::String(text)) => text.trim().parse::<u64>().map(Some).or_else(|_| refused(s)),
        Some(other) => refused(other),
    }
}

/// Parses the JSON object `de` reads (from `url`: a page held in memory, or read back from
/// disk), calling `each` with every element of its `features` array in order, and keeping the
/// top-level members named in `keep` (the others are checked to be JSON and skipped). An
/// error from `each` stops the parse and is returned as it is; a body that is not a JSON
/// object, or whose `features` is neither an array nor `null`, is `BadJson`.
pub fn read_features<'de, R, F>(url: &str, mut de: Deserializer<R>, keep: &[&str], mut each: F) -> Result<PageHead, FetchError>
where
    R: serde_json::de::Read<'de>,
    F: FnMut(Value) -> Result<(), FetchError>,
{
    let mut failed = None;
    let parsed = PageSeed { each: &mut each, failed: &mut failed, keep }.deserialize(&mut de).and_then(|head| de.end().map(|()| head));
    if let Some(e) = failed {
        return Err(e);
    }
    parsed.map_err(|e| parse_error(url, e))
}

/// A parse's error: `BadJson`, or the spool file failing to read back.
fn parse_error(url: &str, e: serde_json::Error) -> FetchError {
    if e.is_io() {
        return FetchError::Protocol { url: url.to_string(), reason: format!("cannot read the body back from its spool file: {e}") };
    }
    FetchError::BadJson { url: url.to_string(), reason: e.to_string() }
}

/// The top-level object.
struct PageSeed<'a, F> {
    each: &'a mut F,
    failed: &'a mut Option<FetchError>,
    keep: &'a [&'a str],
}

impl<'de, F: FnMut(Value) -> Result<(), FetchError>> DeserializeSeed<'de> for PageSeed<'_, F> {
    type Value = PageHead;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<PageHead, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, F: FnMut(Value) -> Result<(), FetchError>> Visitor<'de> for PageSeed<'_, F> {
    type Value = PageHead;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PageHead, A::Error> {
        let mut members = Map::new();
        let mut features = None;
        let mut seen_features = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "features" {
                if seen_features {
                    return Err(de::Error::custom("the page has two `features` members"));
                }
                seen_features = true;
                features = map.next_value_seed(FeaturesSeed { each: &mut *self.each, failed: &mut *self.failed })?;
            } else if self.keep.contains(&key.as_str()) {
                let v: Value = map.next_value()?;
                members.insert(key, v);
            } else {
                map.next_value::<de::IgnoredAny>()?;
            }
        }
        Ok(PageHead { members: Value::Object(members), features })
    }
}

/// The `features` array, each element handed on as it is parsed.
struct FeaturesSeed<'a, F> {
    each: &'a mut F,
    failed: &'a mut Option<FetchError>,
}

impl<'de, F: FnMut(Value) -> Result<(), FetchError>> DeserializeSeed<'de> for FeaturesSeed<'_, F> {
    type Value = Option<u64>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, F: FnMut(Value) -> Result<(), FetchError>> Visitor<'de> for FeaturesSeed<'_, F> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of features")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<u64>, A::Error> {
        let mut n = 0u64;
        while let Some(feature) = seq.next_element::<Value>()? {
            n += 1;
            if let Err(e) = (self.each)(feature) {
                *self.failed = Some(e);
                return Err(de::Error::custom("stopped"));
            }
        }
        Ok(Some(n))
    }
}

/// The first element of the JSON array `de` reads (from `url`), the rest checked to be JSON
/// and skipped unparsed: a SODA `count(*)` answer is `[{"count": "N"}]`, and a server that
/// ignores `$select` answers rows instead, which are not kept. `None` for an empty array; a
/// body that is not a JSON array is `BadJson`.
pub fn first_element<'de, R: serde_json::de::Read<'de>>(url: &str, mut de: Deserializer<R>) -> Result<Option<Value>, FetchError> {
    struct First;
    impl<'de> Visitor<'de> for First {
        type Value = Option<Value>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON array")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Value>, A::Error> {
            let first = seq.next_element::<Value>()?;
            while seq.next_element::<de::IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    de::Deserializer::deserialize_seq(&mut de, First).and_then(|first| de.end().map(|()| first)).map_err(|e| parse_error(url, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(text: &str) -> (Result<PageHead, FetchError>, Vec<Value>) {
        let mut got = Vec::new();
        let r = read_features("http://x/p", Deserializer::from_slice(text.as_bytes()), &["type", "numberMatched", "links", "error", "count"], |f| {
            got.push(f);
            Ok(())
        });
        (r, got)
    }

    /// Counts as portals write them (a black-box tester's server wrote `300.0`).
    #[test]
    fn whole_counts() {
        for (v, want) in [(json!(300), Ok(Some(300))), (json!(300.0), Ok(Some(300))), (json!(" 300 "), Ok(Some(300))), (json!(null), Ok(None)), (json!(0.0), Ok(Some(0)))] {
            assert_eq!(whole_count(Some(&v)), want, "{v}");
        }
        assert_eq!(whole_count(None), Ok(None));
        for v in [json!(-1), json!(2.5), json!(1e300), json!("3e2"), json!(true), json!([1]), json!({"n": 1})] {
            assert!(whole_count(Some(&v)).is_err(), "{v}");
        }
    }

    #[test]
    fn features_come_one_by_one_and_the_rest_is_kept() {
        let (head, got) = read(r#"{"type":"FeatureCollection","numberMatched":2,"features":[{"id":1},{"id":2}],"links":[{"rel":"next","href":"n"}]}"#);
        let head = head.unwrap();
        assert_eq!(got, vec![json!({"id": 1}), json!({"id": 2})]);
        assert_eq!(head.features, Some(2));
        assert_eq!(head.members, json!({"type": "FeatureCollection", "numberMatched": 2, "links": [{"rel": "next", "href": "n"}]}));
        let (head, got) = read(r#"{"error":{"code":500},"features":null}"#);
        let head = head.unwrap();
        assert!(got.is_empty() && head.features.is_none() && head.members.get("error").is_some());
        assert_eq!(read(r#"{"count":3}"#).0.unwrap().features, None);
        assert_eq!(read(r#"{"features":[]}"#).0.unwrap().features, Some(0));
        // Members not asked for are skipped, not kept (a server can make them any size).
        let (head, _) = read(r#"{"junk":[[1,2],{"a":"b"}],"count":3,"features":[]}"#);
        assert_eq!(head.unwrap().members, json!({"count": 3}));
        assert!(matches!(read(r#"{"junk":[1,}],"features":[]}"#).0, Err(FetchError::BadJson { .. })), "skipped members are still JSON");
    }

    #[test]
    fn a_page_that_is_not_an_object_of_features_is_bad_json() {
        for bad in [r#"[{"id":1}]"#, r#"{"features":{"id":1}}"#, r#"{"features":[{"id":1}]"#, r#"{"features":[]} trailing"#, r#"{"features":[],"features":[]}"#] {
            let e = read(bad).0.unwrap_err();
            assert!(matches!(e, FetchError::BadJson { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("http://x/p"), "{e}");
        }
    }

    #[test]
    fn the_callers_error_stops_the_page_and_is_returned_as_it_is() {
        let mut calls = 0;
        let e = read_features("http://x/p", Deserializer::from_slice(br#"{"features":[1,2,3]}"#), &[], |_| {
            calls += 1;
            if calls == 2 {
                return Err(FetchError::Protocol { url: "u".into(), reason: "spool full".into() });
            }
            Ok(())
        })
        .unwrap_err();
        assert_eq!(calls, 2);
        assert!(matches!(&e, FetchError::Protocol { reason, .. } if reason == "spool full"), "{e}");
    }

    #[test]
    fn an_arrays_first_element_is_read_and_the_rest_skipped() {
        let first = |text: &str| first_element("http://x/c", Deserializer::from_slice(text.as_bytes()));
        assert_eq!(first(r#"[{"count":"12"}]"#).unwrap(), Some(json!({"count": "12"})));
        // A server ignoring `$select` answers rows: the first is read, the others skipped.
        assert_eq!(first(r#"[{"a":1},{"b":[1,{"c":2}]},3]"#).unwrap(), Some(json!({"a": 1})));
        assert_eq!(first("[]").unwrap(), None);
        for bad in [r#"{"count":1}"#, r#"[{"a":1},}]"#, "[1] trailing", "[1"] {
            let e = first(bad).unwrap_err();
            assert!(matches!(e, FetchError::BadJson { .. }) && e.to_string().contains("http://x/c"), "{bad}: {e}");
        }
    }
}
