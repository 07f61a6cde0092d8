//! Request/response plumbing for the control port: JSON responses, JSON errors that name the
//! problem, size-limited body reading and query-string parsing.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use std::collections::HashMap;

/// Every control-port response: the whole body in memory (the port's answers are small, or
/// paged), so handlers build one value and return it.
pub type Resp = Response<Full<Bytes>>;

/// The error response a helper hands back when it refuses a request (bad JSON, bad query
/// parameter), for the handler to return as is. Boxed: a `Resp` is ~144 bytes, and unboxed
/// it would make every `Result` carrying it that large on the success path too.
pub type Refusal = Box<Resp>;

/// A refusal: the [`error`] response, boxed for a `Result`.
pub fn refuse(status: StatusCode, code: &str, message: impl Into<String>) -> Refusal {
    Box::new(error(status, code, message))
}

/// A JSON response.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Resp {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

/// A JSON error: `{"error": {"code": ..., "message": ...}}`.
pub fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Resp {
    json(status, &serde_json::json!({"error": {"code": code, "message": message.into()}}))
}

/// A response with an explicit content type.
pub fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    r
}

/// How long a request body may take to arrive in full by default (`[control] body_timeout`):
/// a client trickling a body a byte at a time would otherwise hold its connection (and a
/// task) open for as long as it likes. The headers have their own 10 s limit (`control/mod.rs`).
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads a request body of at most `limit` bytes arriving within `within`: too large → 413
/// (the rest drained, up to 16 MiB, so the client reads the 413 instead of a reset), too
/// slow → 408 (413 when its Content-Length was already too large), broken → 400.
/// `expects_continue`: the client waits for `100 Continue` before it sends the body.
pub async fn read_body(mut body: hyper::body::Incoming, limit: usize, within: std::time::Duration, expects_continue: bool) -> Result<Bytes, Resp> {
    const DRAIN_CAP: usize = 16 << 20;
    // A body announced (Content-Length) larger than the limit is refused before it is read
    // when reading it would not help: past the drain cap (the connection is closed unread),
    // or from a client waiting for `100 Continue` (which it does not get). Otherwise it is
    // drained as one that turns out too large, so that a client still sending reads the 413
    // rather than a reset.
    let announced = hyper::body::Body::size_hint(&body).lower();
    let too_large = || error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("request body exceeds {limit} bytes"));
    if announced > limit as u64 && (announced > DRAIN_CAP as u64 || expects_continue) {
        return Err(too_large());
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut total = 0usize;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) if announced > limit as u64 || total > limit => return Err(too_large()),
            Err(_) => {
                let secs = within.as_secs_f64();
                return Err(error(StatusCode::REQUEST_TIMEOUT, "body_timeout", format!("the request body did not arrive within {secs} s")));
            }
        };
        let frame = frame.map_err(|e| error(StatusCode::BAD_REQUEST, "bad_body", format!("cannot read the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            total += data.len();
            if total <= limit {
                buf.extend_from_slice(&data);
            } else if total > DRAIN_CAP {
                break;
            }
        }
    }
    if total > limit {
        return Err(too_large());
    }
    Ok(Bytes::from(buf))
}

/// Parses a JSON body into `T` (unknown fields are errors when `T` says so).
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Refusal> {
    // Every body of this API is an object; serde would also take a struct written as an
    // array and answer in its own words ("expected struct SubscriberBody with 5 elements").
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(refuse(StatusCode::BAD_REQUEST, "bad_json", "invalid JSON body: it must be a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|e| refuse(StatusCode::BAD_REQUEST, "bad_json", format!("invalid JSON body: {e}")))
}

/// Parses a body that may be left out: an empty (or all-whitespace) body is `T::default()`,
/// anything else must be a JSON object as for [`parse_json`].
pub fn parse_optional_json<T: serde::de::DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, Refusal> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    parse_json(bytes)
}

/// Decodes `a=1&b=x%20y` into a map. A name is taken once: a repeated one
/// (`?state=open&state=released`) is a 400, where taking the last value answered a question
/// the operator had not asked (`state` and `outcome` take a comma-separated list).
pub fn query(q: Option<&str>) -> Result<HashMap<String, String>, Refusal> {
    let mut out = HashMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(k, true);
        if out.contains_key(&name) {
            return Err(refuse(StatusCode::BAD_REQUEST, "bad_query", format!("query parameter {name:?} is given more than once; give it once (state and outcome take a comma-separated list)")));
        }
        out.insert(name, percent_decode(v, true));
    }
    Ok(out)
}

/// [`query`], refusing any name not in `accepted` (the parameters the route reads, as its
/// OpenAPI entry lists them). An unknown one was ignored: `GET /v1/holds?sate=open` listed
/// every hold as if no filter had been asked for, a wrong answer that looks right.
pub fn query_of_route(q: Option<&str>, path: &str, accepted: &[&str]) -> Result<HashMap<String, String>, Refusal> {
    let params = query(q)?;
    let mut unknown: Vec<&String> = params.keys().filter(|k| !accepted.contains(&k.as_str())).collect();
    unknown.sort();
    match unknown.first() {
        None => Ok(params),
        Some(name) if accepted.is_empty() => Err(refuse(StatusCode::BAD_REQUEST, "bad_query", format!("{path} takes no query parameters; got {name:?}"))),
        Some(name) => Err(refuse(StatusCode::BAD_REQUEST, "bad_query", format!("unknown query parameter {name:?} for {path}; it takes {}", accepted.join(", ")))),
    }
}

/// Decodes one segment of a path (`/v1/sources/{id}/run`): `%XX` escapes only. A `+` is a
/// `+` and an `&` or `=` is itself, not a query string's separator: `parks&rec` names the
/// source `parks&rec`, never `parks`.
pub fn path_segment(s: &str) -> String {
    percent_decode(s, false)
}

/// `%XX` escapes decoded (a malformed one kept as it is); `+` is a space in a query string.
fn percent_decode(s: &str, plus_is_space: bool) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
            // Two hex digits exactly (`from_str_radix` took a sign: `%+F` was 0x0F).
            b'%' if i + 2 < bytes.len() && bytes[i + 1].is_ascii_hexdigit() && bytes[i + 2].is_ascii_hexdigit() => {
                match u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A query parameter parsed as a number; a bad value is a 400 naming the parameter.
pub fn query_u64(q: &HashMap<String, String>, name: &str) -> Result<Option<u64>, Refusal> {
    match q.get(name) {
        None => Ok(None),
        Some(v) => v
            .parse::<u64>()
            .map(Some)
            .map_err(|_| refuse(StatusCode::BAD_REQUEST, "bad_query", format!("query parameter {name} must be a non-negative integer, got {v:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = query(Some("parcel=12%2D3&watcher=a+b&x&bad=%zz&tail=%4")).unwrap();
        assert_eq!(q["parcel"], "12-3");
        assert_eq!(q["watcher"], "a b");
        assert_eq!(q["x"], "");
        assert_eq!(q["bad"], "%zz");
        assert_eq!(q["tail"], "%4");
        // Two hex digits or nothing: a sign is not a digit.
        assert_eq!(query(Some("a=%+F&b=%-1&c=%4a")).unwrap().into_iter().collect::<std::collections::BTreeMap<_, _>>(), [("a", "% F"), ("b", "%-1"), ("c", "J")].map(|(k, v)| (k.to_string(), v.to_string())).into());
        assert!(query_u64(&query(Some("limit=abc")).unwrap(), "limit").is_err());
        assert_eq!(query_u64(&query(Some("limit=5")).unwrap(), "limit").unwrap(), Some(5));
    }

    fn refusal_message(r: Resp) -> String {
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let bytes = rt.block_on(r.into_body().collect()).unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["code"], "bad_query");
        v["error"]["message"].as_str().unwrap().to_string()
    }

    /// A name given twice, or one the route does not read, is refused naming it; the
    /// names the route reads pass, escaped or not.
    #[test]
    fn repeated_and_unknown_query_parameters_are_refused() {
        let holds = ["state", "limit"];
        let twice = query(Some("state=open&limit=5&state=released")).unwrap_err();
        assert!(refusal_message(*twice).contains("\"state\" is given more than once"));
        let typo = query_of_route(Some("sate=open"), "/v1/holds", &holds).unwrap_err();
        assert!(refusal_message(*typo).contains("unknown query parameter \"sate\" for /v1/holds; it takes state, limit"));
        let none = query_of_route(Some("force=1"), "/v1/sources/s/run", &[]).unwrap_err();
        assert!(refusal_message(*none).contains("/v1/sources/s/run takes no query parameters; got \"force\""));
        let ok = query_of_route(Some("st%61te=open&limit=5"), "/v1/holds", &holds).unwrap();
        assert_eq!((ok["state"].as_str(), ok["limit"].as_str()), ("open", "5"));
        assert!(query_of_route(None, "/v1/sources", &[]).unwrap().is_empty());
    }

    /// A path segment is the id it spells: no query-string separators, no `+` for a space.
    #[test]
    fn path_segments_decode_escapes_only() {
        assert_eq!(path_segment("parks&rec"), "parks&rec");
        assert_eq!(path_segment("5&x=7"), "5&x=7");
        assert_eq!(path_segment("a+b"), "a+b");
        assert_eq!(path_segment("a%20b%26c"), "a b&c");
        assert_eq!(path_segment("bad%zz%4"), "bad%zz%4");
    }
}
