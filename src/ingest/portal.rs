//! The HTTP source kinds end to end: probe cheaply, fetch only when something moved, and hand
//! the pipeline one GeoJSON FeatureCollection, on disk (one response's body streamed to a
//! temp file, or a paged layer's features collected there, [`LayerBody`]) plus the signals
//! the watermark records. Also the
//! pure watermark decisions (floor, restated, stale) so they are testable without a network.
//!
//! * `geojson_url`: conditional GET (`If-None-Match` / `If-Modified-Since`); 304 → skip.
//! * `arcgis`: see [`super::arcgis`].
//! * `ogcapi`: `…/items?limit=N`, then `links[rel=next]` until absent (never self-built offsets,
//!   never to another host than the one that served the page); the features must add up to
//!   `numberMatched`, and a pass during which it moved is run again.
//! * `socrata`: probe `rowsUpdatedAt` from `/api/views/{id}.json`, then page `$limit`/`$offset`
//!   ordered by `:id` until `count(*)` rows are held (a server that refuses the count: until an
//!   empty page; a count that cannot be had otherwise fails the run).
//!   A page that brings no row not already held stops the scan (the count decides between a
//!   rescan and a "no progress" error), and every paged kind's pages together are capped by
//!   `[ingest] max_layer_bytes` ([`super::scan_guard`]).

use super::arcgis;
use super::collect::FeatureSpool;
use super::http::{BodyFile, FetchError, ReceivedBody, Session};
use super::staging;
use super::scan_guard::{LayerBytes, SeenRows};
use super::settings::IngestConfig;
use crate::config::{SourceConfig, SourceKind};
use crate::model::Watermark;
use serde_json::Value;
use std::collections::HashSet;
use std::time::Duration;

/// What a portal said about the version it served.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PortalMeta {
    pub publisher_ts_ms: Option<u64>,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
    pub schema_hash: Option<String>,
    /// Requests sent, pages read (for the run line and tests).
    pub requests: u32,
    pub pages: u32,
}

/// The result of a portal fetch.
#[derive(Debug)]
pub enum PortalFetch {
    /// The probe says nothing moved: recorded as `skip`, nothing fetched.
    Skip { reason: String, meta: PortalMeta },
    /// A whole layer.
    Layer { body: LayerBody, meta: PortalMeta },
}

/// A fetched layer as the fetch holds it.
#[derive(Debug)]
pub enum LayerBody {
    /// One response's body streamed to a temp file in the staging directory, to be renamed
    /// into the staged payload (or, when that directory cannot be used, to an anonymous temp
    /// file next to the store) (`geojson_url`; capped by `[ingest] max_response_bytes` /
    /// `max_decompressed_bytes`).
    File(ReceivedBody),
    /// A paged layer's features on disk, to be written as one sorted FeatureCollection
    /// ([`FeatureSpool::write_collection`]).
    Features(Box<FeatureSpool>),
}

/// True when the floor interval has passed since the last fetch (or there is none). A fetch
/// recorded ahead of the clock means the clock stepped back since: how long ago the fetch was
/// is not known, and waiting until the clock passes it again would leave the layer unread
/// for the size of the step, so the floor is due.
pub fn floor_due(prev: Option<&Watermark>, now_ms: u64, floor: Duration) -> bool {
    match prev {
        None => true,
        Some(w) if w.consumed_at_ms > now_ms.saturating_add(crate::store::CLOCK_STEP_TOLERANCE_MS) => true,
        Some(w) => now_ms.saturating_sub(w.consumed_at_ms) >= floor.as_millis() as u64,
    }
}

/// `Some(reason)` when the publisher timestamp went backwards: the layer was restated. A
/// watermark timestamp from the future ([`Watermark::from_the_future`], as of `now_ms`) is no
/// evidence: going back from it is no restatement ([`future_timestamp_warning`] says so).
pub fn restated(prev: Option<&Watermark>, meta: &PortalMeta, now_ms: u64) -> Option<String> {
    let (Some(old), Some(new)) = (prev.and_then(|w| w.publisher_ts_ms), meta.publisher_ts_ms) else { return None };
    (new < old && !Watermark::from_the_future(old, Watermark::clock_floor(prev, now_ms))).then(|| {
        format!(
            "restated: publisher timestamp went backwards from {} to {}",
            crate::util::rfc3339(old),
            crate::util::rfc3339(new)
        )
    })
}

/// `Some(warning)` when a publisher timestamp involved in this run is from the future
/// ([`Watermark::future_timestamp_warning`]).
pub fn future_timestamp_warning(prev: Option<&Watermark>, meta: &PortalMeta, now_ms: u64) -> Option<String> {
    Watermark::future_timestamp_warning(prev.and_then(|w| w.publisher_ts_ms), meta.publisher_ts_ms?, Watermark::clock_floor(prev, now_ms))
}

/// `Some(warning)` when the content has not changed for longer than `stale_after`.
pub fn stale(prev: Option<&Watermark>, now_ms: u64, stale_after: Duration) -> Option<String> {
    let w = prev?;
    let age = now_ms.saturating_sub(w.content_changed_at_ms);
    (w.content_changed_at_ms > 0 && age > stale_after.as_millis() as u64).then(|| {
        format!(
            "stale: content unchanged for {} (stale_after {})",
            crate::util::format_duration(Duration::from_millis(age - age % 1000)),
            crate::util::format_duration(stale_after)
        )
    })
}

/// The scheduler's next wait: `every` ± 10 % (uniform), so sources configured alike do not
/// hit one county server in lock-step. Only `serve` calls this (it owns the wall clock).
pub fn jittered(every: Duration) -> Duration {
    let ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
    let spread = ms / 10;
    // Saturating: an `every` of centuries ("never", written as a huge number) wrapped to a
    // wait of moments.
    Duration::from_millis((ms - spread).saturating_add(rand::random_range(0..=spread.saturating_mul(2))))
}

/// Probes and (when needed) fetches an HTTP source. `force` skips the probe shortcut
/// (`--reprocess`). A paged layer is collected in a temp file in `spool_dir`; a
/// `geojson_url` body is written in the staging directory of the store at `store_path`
/// ([`staging::body_file`]). `Ok(None)` for kinds that are not HTTP. A `stop` requested
/// meanwhile drops the fetch where it waits: [`FetchError::Stopped`].
#[allow(clippy::too_many_arguments)]
pub fn fetch(
    src: &SourceConfig,
    cfg: &IngestConfig,
    prev: Option<&Watermark>,
    now_ms: u64,
    force: bool,
    store_path: &std::path::Path,
    spool_dir: &std::path::Path,
    stop: &crate::run_stop::RunStop,
    progress: Option<std::sync::Arc<crate::progress::IngestProgress>>,
) -> Result<Option<PortalFetch>, FetchError> {
    if matches!(src.kind, SourceKind::File { .. }) {
        return Ok(None);
    }
    let due = force || floor_due(prev, now_ms, src.floor);
    let mut session = Session::new(cfg, now_ms)?;
    session.spool_dir = spool_dir.to_path_buf();
    session.progress = progress;
    if stop.requested() {
        return Err(FetchError::Stopped);
    }
    let out = super::http::block_on(async {
        let work = async {
            let mut r = match &src.kind {
                SourceKind::File { .. } => unreachable_file(),
                SourceKind::GeojsonUrl { url } => geojson_url(&session, url, prev, due, staging::body_file(store_path, &src.id, spool_dir)?).await,
                SourceKind::Arcgis { url, page_size, format } => arcgis_source(&session, url, *page_size, *format, &src.fields, prev, due).await,
                SourceKind::Ogcapi { url, limit } => ogcapi(&session, url, *limit, &src.fields.parcel_id).await,
                SourceKind::Socrata { url, page_size } => socrata(&session, url, *page_size, &src.fields.parcel_id, prev, due).await,
            }?;
            let n = session.requests.load(std::sync::atomic::Ordering::Relaxed);
            match &mut r {
                PortalFetch::Skip { meta, .. } | PortalFetch::Layer { meta, .. } => meta.requests = n,
            }
            Ok(r)
        };
        // A stop drops the fetch where it waits (its temp files are removed with it).
        tokio::select! {
            r = work => r,
            () = stop.requested_wait() => Err(FetchError::Stopped),
        }
    })??;
    Ok(Some(out))
}

fn unreachable_file() -> Result<PortalFetch, FetchError> {
    Err(FetchError::Protocol { url: String::new(), reason: "a file source is not fetched over HTTP".into() })
}

async fn geojson_url(session: &Session, url: &str, prev: Option<&Watermark>, due: bool, mut body: BodyFile) -> Result<PortalFetch, FetchError> {
    let mut headers = vec![("accept", "application/geo+json, application/json;q=0.9".to_string())];
    if !due {
        if let Some(w) = prev {
            if let Some(e) = &w.etag {
                headers.push(("if-none-match", e.clone()));
            }
            if let Some(lm) = &w.last_modified {
                headers.push(("if-modified-since", lm.clone()));
            }
        }
    }
    let conditional = headers.iter().any(|(name, _)| name.starts_with("if-"));
    let resp = session.get_to_file(url, &headers, &mut body).await?;
    let meta = PortalMeta { etag: resp.etag.clone(), last_modified: resp.last_modified.clone(), pages: 1, ..Default::default() };
    if resp.status == 304 && !conditional {
        // "Not modified" since nothing: a broken server or cache. Taken as a skip, the source
        // would never get a baseline (or never be fetched on its floor) and say nothing.
        return Err(FetchError::Protocol {
            url: url.to_string(),
            reason: "304 Not Modified to a request without If-None-Match or If-Modified-Since; the server (or a cache in front of it) answers no real content".into(),
        });
    }
    if resp.status == 304 {
        let meta = PortalMeta {
            etag: prev.and_then(|w| w.etag.clone()),
            last_modified: prev.and_then(|w| w.last_modified.clone()),
            ..meta
        };
        return Ok(PortalFetch::Skip { reason: "304 Not Modified".into(), meta });
    }
    resp.expect_json()?;
    Ok(PortalFetch::Layer { body: LayerBody::File(body.finish()?), meta })
}

async fn arcgis_source(
    session: &Session,
    url: &str,
    page_size: u32,
    format: arcgis::ArcgisFormat,
    fields: &crate::config::FieldMap,
    prev: Option<&Watermark>,
    due: bool,
) -> Result<PortalFetch, FetchError> {
    let id_field = fields.parcel_id.as_str();
    let probe = arcgis::probe(session, url, id_field).await?;
    arcgis::check_attribute_fields(&probe, url, fields)?;
    let meta = PortalMeta { publisher_ts_ms: probe.publisher_ts_ms, schema_hash: Some(probe.schema_hash.clone()), ..Default::default() };
    if !due {
        if let Some(w) = prev {
            if probe.publisher_ts_ms.is_some() && w.probe_ts() == probe.publisher_ts_ms && w.schema_hash.as_deref() == Some(probe.schema_hash.as_str()) {
                let ts = probe.publisher_ts_ms.map(crate::util::rfc3339).unwrap_or_default();
                return Ok(PortalFetch::Skip { reason: format!("dataLastEditDate unchanged ({ts}) and fields unchanged"), meta });
            }
        }
    }
    let scan = arcgis::scan_as(session, url, &probe, page_size, id_field, format).await?;
    Ok(PortalFetch::Layer { body: LayerBody::Features(Box::new(scan.layer)), meta: PortalMeta { pages: scan.pages, ..meta } })
}

async fn ogcapi(session: &Session, collection_url: &str, limit: u32, id_field: &str) -> Result<PortalFetch, FetchError> {
    let refused = |r: UnsettledPass| FetchError::Protocol { url: collection_url.to_string(), reason: unsettled_reason(r) };
    let (mut limit, mut shifted) = (limit, false);
    for _ in 0..4 {
        match ogcapi_pass(session, collection_url, limit, id_field).await? {
            Ok(fetch) => return Ok(fetch),
            // The collection was edited while it was paged (its `numberMatched` moved): the
            // pages may have shifted under the scan. Scan again, as ArcGIS and Socrata do
            // when their count moves.
            Err(r @ UnsettledPass { matched: Some(before), moved_to: Some(after), .. }) => {
                tracing::info!(url = collection_url, before, after, got = r.got, "numberMatched moved during the scan; scanning again");
            }
            // Features repeated: pages that overlapped, or identical features a page
            // boundary fell between. A pass with other boundaries tells the two apart.
            Err(r) if r.repeated > 0 && !shifted && limit > 1 => {
                tracing::info!(url = collection_url, repeated = r.repeated, "features repeated across pages; scanning again with pages of {}", limit - 1);
                shifted = true;
                limit -= 1;
            }
            Err(r) => return Err(refused(r)),
        }
    }
    Err(FetchError::Protocol { url: collection_url.to_string(), reason: "numberMatched kept moving from one scan to the next; try again later".into() })
}

/// Why a scan whose pages do not add up is refused.
fn unsettled_reason(r: UnsettledPass) -> String {
    match r.matched {
        Some(m) => format!("incomplete scan: {} distinct features collected ({} served twice) but numberMatched says {m}; refusing a partial layer", r.got, r.repeated),
        None => format!("pages overlapped ({} features served twice) and the server gives no numberMatched to check the layer against: features may have been skipped; refusing a partial layer", r.repeated),
    }
}

/// An OGC API pass that another pass may settle: its pages served some features twice and
/// do not add up, or the collection's `numberMatched` moved while it was paged.
#[derive(Debug, Clone, Copy)]
struct UnsettledPass {
    got: u64,
    repeated: u64,
    /// `numberMatched` on the first page.
    matched: Option<u64>,
    /// `numberMatched` on the last page that gave one, when it differs from the first's.
    moved_to: Option<u64>,
}

/// One pass over an OGC API collection with pages of `limit`: the layer, or
/// `Err(UnsettledPass)` when features came twice and the pages do not add up, or the
/// collection's size moved during the pass.
async fn ogcapi_pass(session: &Session, collection_url: &str, limit: u32, id_field: &str) -> Result<Result<PortalFetch, UnsettledPass>, FetchError> {
    let accept = [("accept", "application/geo+json, application/json;q=0.9".to_string())];
    let mut next = Some(ogc_items_url(collection_url, limit));
    let mut seen = HashSet::new();
    let mut features = FeatureSpool::new(&session.spool_dir)?;
    let mut pages = 0;
    let mut first_meta = PortalMeta::default();
    let mut layer_bytes = LayerBytes::new(session.cfg.max_layer_bytes);
    let mut rows = SeenRows::by_content();
    let mut repeated = 0u64;
    // The server's `numberMatched` on the first page, when it gives one: the layer's size;
    // and the one a later page gave, when it is another (the collection was edited).
    let mut matched: Option<u64> = None;
    let mut moved_to: Option<u64> = None;
    while let Some(url) = next.take() {
        if !seen.insert(url.clone()) {
            return Err(FetchError::Protocol { url, reason: "links[rel=next] points back to a page already read".into() });
        }
        let resp = session.get(&url, &accept).await?;
        layer_bytes.add(&url, resp.size())?;
        if pages == 0 {
            first_meta.etag = resp.etag.clone();
            first_meta.last_modified = resp.last_modified.clone();
        }
        pages += 1;
        // Features the scan already holds (a page served again under another URL, pages
        // that overlap) are not taken twice; a page of nothing new ends the paging.
        let NewRows { head: v, served, fresh } = take_new_rows(&resp, &["numberMatched", "links", "crs"], &mut features, &mut rows, id_field)?;
        ogc_page_crs(&url, resp.content_crs.as_deref(), v.get("crs"))?;
        // Where the page came from, after redirects: its links are relative to it, and stay on its host.
        let page_url = resp.url.clone();
        drop(resp);
        let number_matched = super::page::whole_count(v.get("numberMatched"))
            .map_err(|found| FetchError::Protocol { url: url.clone(), reason: format!("numberMatched is {found}, not a count of features: the scan cannot be checked against it; refusing the layer") })?;
        if pages == 1 {
            matched = number_matched;
        } else if matched.is_some() && number_matched.is_some() && number_matched != matched {
            moved_to = number_matched;
        }
        repeated += served - fresh;
        if served == 0 {
            break;
        }
        if fresh == 0 {
            return Err(FetchError::Protocol {
                url,
                reason: format!("no progress: the page returned {served} features, all already held; the server's next links do not advance, refusing to page on"),
            });
        }
        next = v
            .get("links")
            .and_then(Value::as_array)
            .and_then(|links| {
                links.iter().find(|l| {
                    l.get("rel").and_then(Value::as_str) == Some("next")
                        && l.get("type").and_then(Value::as_str).is_none_or(|t| t.contains("json"))
                })
            })
            .and_then(|l| l.get("href").and_then(Value::as_str))
            .map(|href| reqwest::Url::parse(&page_url).and_then(|base| base.join(href)).map(|u| u.to_string()).unwrap_or_else(|_| href.to_string()));
        if let Some(link) = next.take() {
            if let Some(elsewhere) = other_host(&page_url, &link) {
                return Err(FetchError::Protocol {
                    url,
                    reason: format!("links[rel=next] leads to another host ({elsewhere}: {link}); next links are followed only on the host that served their page ({page_url}), refusing to follow it"),
                });
            }
            next = Some(keep_https(&page_url, link));
        }
    }
    // The pages must add up to the layer: a next link dropped early, or pages that overlap
    // and skip features, would otherwise look like parcels removed.
    // A collection edited during the pass is read again even when its pages add up to the
    // first page's count: features may have shifted across page boundaries.
    let got = features.len() as u64;
    let unsettled = UnsettledPass { got, repeated, matched, moved_to };
    match matched {
        _ if moved_to.is_some() => return Ok(Err(unsettled)),
        Some(m) if got != m && repeated > 0 => return Ok(Err(unsettled)),
        Some(m) if got != m => return Err(FetchError::Protocol { url: collection_url.to_string(), reason: unsettled_reason(unsettled) }),
        None if repeated > 0 => return Ok(Err(unsettled)),
        _ => {}
    }
    Ok(Ok(PortalFetch::Layer { body: LayerBody::Features(Box::new(features)), meta: PortalMeta { pages, ..first_meta } }))
}

/// The host (and port, when it is not the scheme's default) of `link` when they are not those
/// of `page_url`, the page that carried the link as it was finally served (after redirects: a
/// collection that moved to another host pages on there); `None` when they are, or when
/// either is not an absolute URL (the request then fails on it as a bad URL). A next link is
/// the page's content: followed to another host, it would have zonewatch ask whatever server
/// a page names and take its answer as this collection's parcels (the private-target guard
/// stops private addresses only). The scheme may differ: a server behind a TLS proxy may link
/// `http` pages of its `https` self (they are asked over `https` all the same: [`keep_https`]).
fn other_host(page_url: &str, link: &str) -> Option<String> {
    let (Ok(base), Ok(next)) = (reqwest::Url::parse(page_url), reqwest::Url::parse(link)) else { return None };
    // `port()` is `None` for the scheme's default port; hosts are lower-cased when parsed.
    if (base.host_str(), base.port()) == (next.host_str(), next.port()) {
        return None;
    }
    let host = next.host_str().unwrap_or("no host");
    Some(next.port().map_or_else(|| host.to_string(), |port| format!("{host}:{port}")))
}

/// `link` (on its page's host: [`other_host`]) asked over `https` when its page was: a server behind a TLS proxy often links `http` pages of its `https` self, and
/// following them as written would fetch the rest of the layer in clear text, where it can be
/// altered on the way. A link that is not an absolute URL is returned as it is (its request
/// fails on it).
fn keep_https(page_url: &str, link: String) -> String {
    let (Ok(base), Ok(mut next)) = (reqwest::Url::parse(page_url), reqwest::Url::parse(&link)) else { return link };
    if base.scheme() == "https" && next.scheme() == "http" && next.set_scheme("https").is_ok() {
        return next.to_string();
    }
    link
}

/// `https://host/resource/abcd-1234.geojson` → `https://host/api/views/abcd-1234.json`.
pub fn socrata_views_url(resource_url: &str) -> Option<String> {
    let mut u = reqwest::Url::parse(resource_url).ok()?;
    let (prefix, id) = soda_resource(u.path())?;
    let path = format!("{prefix}/api/views/{id}.json");
    u.set_path(&path);
    u.set_query(None);
    u.set_fragment(None);
    Some(u.to_string())
}

/// A SODA resource path's prefix (a portal under a path) and dataset id:
/// `/x/resource/abcd-1234.geojson` → (`/x`, `abcd-1234`). The last `/resource/` names it, as
/// `check` reads it (`settings::http_kind`); `None` without an id.
pub fn soda_resource(path: &str) -> Option<(&str, &str)> {
    let (prefix, resource) = path.rsplit_once("/resource/")?;
    let id = resource.split('.').next()?.trim_matches('/');
    (!id.is_empty()).then_some((prefix, id))
}

/// The view metadata's `rowsUpdatedAt` (epoch seconds) in epoch ms; `None` when it is not a
/// whole number of seconds, or too large to be one in ms (a server can answer any number:
/// multiplied unchecked it would overflow, a panic where overflow is checked and a wrapped,
/// meaningless publisher timestamp where it is not).
fn rows_updated_ms(view: &Value) -> Option<u64> {
    view.get("rowsUpdatedAt").and_then(Value::as_u64).and_then(|s| s.checked_mul(1000))
}

/// The dataset's `rowsUpdatedAt` (ms), read from its view metadata at `views`.
async fn rows_updated_at(session: &Session, views: &str) -> Result<Option<u64>, FetchError> {
    Ok(rows_updated_ms(&session.get(views, &[]).await?.members(&["rowsUpdatedAt"])?))
}

async fn socrata(session: &Session, url: &str, page_size: u32, id_field: &str, prev: Option<&Watermark>, due: bool) -> Result<PortalFetch, FetchError> {
    let views = socrata_views_url(url)
        .ok_or_else(|| FetchError::BadUrl { url: url.to_string(), reason: "expected a SODA resource URL like https://host/resource/abcd-1234.geojson".into() })?;
    let publisher_ts_ms = rows_updated_at(session, &views).await?;
    let meta = PortalMeta { publisher_ts_ms, ..Default::default() };
    if !due {
        if let (Some(w), Some(ts)) = (prev, publisher_ts_ms) {
            if w.probe_ts() == Some(ts) {
                return Ok(PortalFetch::Skip { reason: format!("rowsUpdatedAt unchanged ({})", crate::util::rfc3339(ts)), meta });
            }
        }
    }
    // A short page alone never ends the scan when the server says how many rows there are
    // (a server whose row cap is below `page_size` answers short pages all along): the scan
    // runs until it holds `count(*)` rows. If the count moved while paging, scan again.
    // A page that brings nothing new stops the scan early; as for ArcGIS, the count then
    // decides: if it moved, rows moved under the scan and it runs again; if not, the server
    // is not paging (it ignores `$offset` or `$order`) and the run fails saying where.
    let mut expected = socrata_count(session, url).await?;
    let mut page_size = page_size;
    let mut shifted = false;
    // rowsUpdatedAt as last read (the probe's, then each re-read's).
    let mut edited_ms = publisher_ts_ms;
    for _ in 0..4 {
        let SodaScan { features, pages, repeated, stalled } = socrata_scan(session, url, page_size, id_field, expected).await?;
        let got = features.len() as u64;
        if stalled.is_none() && repeated > 0 && expected != Some(got) && !shifted && page_size > 1 {
            // Rows known by content repeat either because pages overlapped or because the
            // resource holds identical rows and a page boundary fell between them: a pass
            // with other boundaries tells the two apart.
            tracing::info!(url, repeated, "rows repeated across pages; scanning again with pages of {}", page_size - 1);
            shifted = true;
            page_size -= 1;
            continue;
        }
        // Without a count, overlapping pages are the only sign that rows were skipped.
        if stalled.is_none() && expected.is_none() && repeated > 0 {
            return Err(FetchError::Protocol {
                url: url.to_string(),
                reason: format!("pages overlapped ({repeated} rows served twice) and there is no count(*) to check the layer against: rows may have been skipped; refusing a partial layer"),
            });
        }
        if stalled.is_none() && expected.is_none_or(|c| got == c) {
            // As for ArcGIS: rows edited under the scan can leave the count where it was and
            // shift a row past every page (it would read as removed). rowsUpdatedAt, read
            // again, says whether anything changed since: then scan again.
            if edited_ms.is_some() {
                let now = rows_updated_at(session, &views).await?;
                if now != edited_ms {
                    tracing::info!(url, before = ?edited_ms, after = ?now, "rows were updated during the scan; scanning again");
                    edited_ms = now;
                    let known = expected.is_some();
                    expected = socrata_count(session, url).await?;
                    // A count known before and not read now (a 5xx, the retry budget spent):
                    // the next scan would end at its first short page (a reader).
                    if known && expected.is_none() {
                        return Err(FetchError::Protocol {
                            url: url.to_string(),
                            reason: "rows were updated during the scan, and count(*) could not be read again to check the next scan against; refusing a layer that cannot be checked (the next run tries again)".into(),
                        });
                    }
                    continue;
                }
            }
            return Ok(PortalFetch::Layer { body: LayerBody::Features(Box::new(features)), meta: PortalMeta { pages, ..meta } });
        }
        drop(features);
        if let Some(c) = expected {
            let after = socrata_count(session, url).await?;
            if after.is_some() && after != expected {
                tracing::info!(url, before = c, after = ?after, "row count moved during the scan; scanning again");
                expected = after;
                // The date the next scan is checked against is this moment's.
                if edited_ms.is_some() {
                    edited_ms = rows_updated_at(session, &views).await?;
                }
                continue;
            }
        }
        return Err(match (stalled, expected) {
            (Some(stall), _) => stall,
            (None, c) => FetchError::Protocol {
                url: url.to_string(),
                reason: format!(
                    "paging returned {got} distinct rows ({repeated} served twice) but count(*) says {} (and did not move); refusing a partial layer",
                    c.unwrap_or_default()
                ),
            },
        });
    }
    Err(FetchError::Protocol { url: url.to_string(), reason: "the rows kept changing from one scan to the next (their count or rowsUpdatedAt moved); try again later".into() })
}

/// A page read into the scan's features ([`take_new_rows`]).
struct NewRows {
    /// The page's members asked for (`keep`), as one JSON object.
    head: Value,
    /// Features on the page.
    served: u64,
    /// Of those, the ones the scan did not hold yet (taken).
    fresh: u64,
}

/// Reads the page `resp` one feature at a time, adding those `seen` does not hold yet to
/// `features`, and keeping the page's members named in `keep`. A page without a `features`
/// array is refused.
fn take_new_rows(resp: &super::http::Response, keep: &[&str], features: &mut FeatureSpool, seen: &mut SeenRows, id_field: &str) -> Result<NewRows, FetchError> {
    let (mut served, mut fresh) = (0, 0);
    let mut rows = seen.on_page();
    let head = resp.features(keep, |row| {
        served += 1;
        if rows.is_new(&row) {
            features.push(None, &row, id_field)?;
            fresh += 1;
        }
        Ok(())
    })?;
    if head.features.is_none() {
        return Err(FetchError::Protocol { url: resp.url.clone(), reason: "answer has no features[]".into() });
    }
    Ok(NewRows { head: head.members, served, fresh })
}

/// The first items page of the collection at `collection_url`: `/items` added to its path
/// (unless it ends so already), its own query kept (an access token) but for `f` and
/// `limit`, which are zonewatch's. A url with a query had `/items?…` appended to the query
/// (a black-box tester: `…/collections/c?token=abc` asked `?token=abc/items?f=json…`, 404).
fn ogc_items_url(collection_url: &str, limit: u32) -> String {
    let Ok(mut url) = reqwest::Url::parse(collection_url) else {
        return format!("{collection_url}/items?f=json&limit={limit}");
    };
    let path = url.path().trim_end_matches('/').to_string();
    // (A collection whose id is `items` is a collection.)
    if !path.ends_with("/items") || path.ends_with("/collections/items") {
        url.set_path(&format!("{path}/items"));
    }
    // The operator's own parameters as written (not decoded and encoded again).
    let kept = without_query_params(url.as_str(), &["f", "limit"]);
    let sep = if kept.contains('?') { '&' } else { '?' };
    format!("{kept}{sep}f=json&limit={limit}")
}

/// Refuses an OGC API page whose coordinates are not longitude/latitude WGS84 (CRS84, what
/// zonewatch asks for by asking for no other): its `Content-Crs` header (Part 2), or a
/// GeoJSON `crs` member naming another CRS. A page in Web Mercator was read as degrees and
/// quarantined whole as `out_of_bounds`; one in EPSG:4326, latitude first, was read with its
/// axes swapped, inside the default bounds near the equator's mirror (a black-box tester:
/// only the change-spike hold stopped 30 false alerts).
fn ogc_page_crs(url: &str, content_crs: Option<&str>, member: Option<&Value>) -> Result<(), FetchError> {
    // zonewatch asks for no `crs`, so a server following the standard answers in CRS84; one
    // that does not cannot be read by it.
    let fix = "zonewatch asks for no other CRS, and reads CRS84 (longitude then latitude, in degrees), the default OGC API – Features servers answer in: this server does not follow it for this collection";
    if let Some(header) = content_crs {
        let crs = header.trim().trim_start_matches(['<', '[']).trim_end_matches(['>', ']']).trim();
        if !is_crs84(crs) {
            let axes = if super::geojson::crs_is_wgs84(crs) { " (EPSG:4326 puts latitude first)" } else { "" };
            return Err(FetchError::Protocol { url: url.to_string(), reason: format!("the page's coordinates are in {crs} (its Content-Crs header){axes}; {fix}") });
        }
    }
    // A GeoJSON `crs` member (of the 2008 format; OGC API has none) that names anything but
    // CRS84: its axis order is the server's guess (GeoServer writes latitude first under
    // `urn:ogc:def:crs:EPSG::4326`, longitude first under `EPSG:4326`: a black-box tester).
    if let Some(name) = member.and_then(super::geojson::crs_name) {
        if !is_crs84(&name) {
            return Err(FetchError::Protocol { url: url.to_string(), reason: format!("the page's \"crs\" is {name}; {fix}") });
        }
    }
    Ok(())
}

/// Whether a `Content-Crs` value names CRS84 (OGC's URI or URN in any version, `OGC:CRS84`,
/// WMS's `CRS:84`, and CRS84h, their 3D form), in any case.
fn is_crs84(crs: &str) -> bool {
    let upper = crs.to_ascii_uppercase();
    upper.ends_with("CRS84") || upper.ends_with("CRS84H") || upper == "CRS:84"
}

/// One pass over a SODA resource.
struct SodaScan {
    features: FeatureSpool,
    pages: u32,
    /// Rows served again on a later page (pages that overlap), not taken twice.
    repeated: u64,
    /// Set when a non-empty page brought no row the scan did not already hold: the "no
    /// progress" error, naming the page URL and its offset. The scan stopped there.
    stalled: Option<FetchError>,
}

/// Pages a SODA resource with `$limit`/`$offset` ordered by `:id`. With `expected` (the
/// server's `count(*)`), paging goes on until that many rows are held, never past an empty
/// page and never more than `expected + 10` pages; without it, until an empty page (a short
/// page is not the end: a server's row cap below the page size answers short pages all
/// along, and ending there committed a partial layer: a black-box tester).
/// Either way a non-empty page of rows all already held stops it (`stalled`), and the pages'
/// bytes together fail the scan past `[ingest] max_layer_bytes`.
async fn socrata_scan(session: &Session, url: &str, page_size: u32, id_field: &str, expected: Option<u64>) -> Result<SodaScan, FetchError> {
    // The resource URL's own paging and order give way to the scan's (a parameter given
    // twice is an error to SODA, or one of the two is taken).
    let url = without_query_params(url, &["$limit", "$offset", "$order"]);
    let sep = if url.contains('?') { '&' } else { '?' };
    let mut features = FeatureSpool::new(&session.spool_dir)?;
    let mut offset: u64 = 0;
    let mut pages: u32 = 0;
    let max_pages = expected.map(|c| c.saturating_add(10)).unwrap_or(u64::MAX);
    let mut layer_bytes = LayerBytes::new(session.cfg.max_layer_bytes);
    let mut seen = SeenRows::new();
    let mut repeated = 0u64;
    while (pages as u64) < max_pages {
        let page_url = format!("{url}{sep}$limit={page_size}&$offset={offset}&$order=:id");
        let resp = session.get(&page_url, &[]).await?;
        layer_bytes.add(&page_url, resp.size())?;
        pages += 1;
        // A row the scan already holds (pages that overlap) is not taken twice: counted,
        // so the scan is not mistaken for a complete one.
        let NewRows { served: n, fresh, .. } = take_new_rows(&resp, &[], &mut features, &mut seen, id_field)?;
        drop(resp);
        repeated += n - fresh;
        if n > 0 && fresh == 0 {
            let reason = format!(
                "no progress: the page at $offset={offset} returned {n} rows, all already held ({} distinct rows so far{}); the server ignores $offset or $order, refusing to page on",
                seen.len(),
                expected.map(|c| format!(" of a claimed count(*) of {c}")).unwrap_or_default()
            );
            return Ok(SodaScan { features, pages, repeated, stalled: Some(FetchError::Protocol { url: page_url, reason }) });
        }
        offset += n;
        let done = match expected {
            Some(c) => n == 0 || offset >= c,
            None => n == 0,
        };
        if done {
            break;
        }
    }
    Ok(SodaScan { features, pages, repeated, stalled: None })
}

/// The SODA `count(*)` URL of a resource: its JSON endpoint with the resource URL's own
/// query (a `$where` filter counts the same rows) and `$select=count(*)`.
pub fn socrata_count_url(resource_url: &str) -> Option<String> {
    let mut u = reqwest::Url::parse(resource_url).ok()?;
    let (prefix, id) = soda_resource(u.path())?;
    let path = format!("{prefix}/resource/{id}.json");
    u.set_path(&path);
    // Its own `$select` (`:*,*` to get `:id`), order and paging are the rows', not the count's.
    let kept = without_query_params(u.as_ref(), &["$select", "$order", "$limit", "$offset"]);
    let sep = if kept.contains('?') { '&' } else { '?' };
    Some(format!("{kept}{sep}$select=count(*)"))
}

/// `url` without the query parameters named `keys` (in any case; SoQL's `$` also
/// percent-encoded); the other parameters are kept as they were written.
/// A fragment (`#…`, never sent) is dropped: parameters appended after it would not be sent
/// either (a reader: the count's `$select` went after one, and the count URL asked for rows).
fn without_query_params(url: &str, keys: &[&str]) -> String {
    let url = url.split('#').next().unwrap_or_default();
    let Some((base, query)) = url.split_once('?') else { return url.to_string() };
    let named = |part: &str| {
        let key = part.split('=').next().unwrap_or_default().replace("%24", "$");
        keys.iter().any(|k| k.eq_ignore_ascii_case(&key))
    };
    let kept: Vec<&str> = query.split('&').filter(|part| !part.is_empty() && !named(part)).collect();
    if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// The row count the server reports, or `None` when it will not say: it refuses the count
/// query as one it does not take (400, 404, 405, 410, 422; then the scan pages on to an empty
/// page, and a warning says that a row the server leaves out cannot be told from a removed
/// one). Any other status fails the run: a 401, 403 or 407 there, after the view's metadata
/// was read, is a gate in the way (a WAF's challenge, a proxy), not a server without counts
/// (a reader). Any other failure fails the run: an
/// answer that is not a count (`-1`, `300.5`, `[{}]`), or a count that could not be asked for
/// (a 5xx after the retries, an HTML page, the retry budget spent, no connection). Taken as
/// no count, a scan a page short ended at that page and alerted the rows past it `removed`
/// (two readers; a black-box tester: 117 false removals of Cambridge's parcels with the count
/// endpoint down). The next run asks again.
async fn socrata_count(session: &Session, url: &str) -> Result<Option<u64>, FetchError> {
    let Some(count_url) = socrata_count_url(url) else { return Ok(None) };
    let answer = match session.get(&count_url, &[]).await.and_then(|r| r.first_element()) {
        Ok(answer) => answer,
        Err(FetchError::Status { status: status @ (400 | 404 | 405 | 410 | 422), .. }) => {
            tracing::warn!(url, status, "the server refuses count(*): the scan pages on to an empty page, and a row it leaves out of every page would read as removed");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let value = answer.as_ref().and_then(|v| {
        let first = v.as_object()?;
        first.get("count").or_else(|| first.values().next()).cloned()
    });
    let refused = |reason: String| Err(FetchError::Protocol { url: count_url.clone(), reason: format!("{reason}: the scan cannot be checked against it; refusing the layer") });
    match super::page::whole_count(value.as_ref()) {
        Ok(Some(n)) => Ok(Some(n)),
        Ok(None) => refused(format!("count(*) was answered without a count ({})", crate::util::truncate_text(&answer.map(|v| v.to_string()).unwrap_or_default(), 80))),
        Err(found) => refused(format!("count(*) is {found}, not a count of rows")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wm(ts: Option<u64>, consumed: u64, changed: u64) -> Watermark {
        Watermark { publisher_ts_ms: ts, consumed_at_ms: consumed, content_changed_at_ms: changed, ..Default::default() }
    }

    /// An `every` of centuries (a way to write "never") waits at least 90% of it: the wait
    /// wrapped to moments half the time.
    #[test]
    fn a_huge_every_does_not_wrap_to_a_short_wait() {
        for every in [Duration::from_millis(u64::MAX), Duration::MAX, Duration::from_secs(60)] {
            let least = Duration::from_millis(u64::try_from(every.as_millis()).unwrap_or(u64::MAX) / 10 * 9);
            for _ in 0..200 {
                assert!(jittered(every) >= least, "{every:?}");
            }
        }
    }

    #[test]
    fn ogc_items_url_keeps_the_query() {
        assert_eq!(ogc_items_url("http://h:1/collections/c", 10), "http://h:1/collections/c/items?f=json&limit=10");
        assert_eq!(ogc_items_url("http://h/collections/c/", 10), "http://h/collections/c/items?f=json&limit=10");
        assert_eq!(ogc_items_url("http://h/collections/items", 10), "http://h/collections/items/items?f=json&limit=10");
        assert_eq!(ogc_items_url("http://h/collections/c?token=abc", 10), "http://h/collections/c/items?token=abc&f=json&limit=10");
        assert_eq!(ogc_items_url("http://h/collections/c/items?token=a%26b&limit=5&f=html", 7), "http://h/collections/c/items?token=a%26b&f=json&limit=7");
    }

    #[test]
    fn socrata_count_url_keeps_the_filter() {
        assert_eq!(
            socrata_count_url("https://data.example.gov/resource/abcd-1234.geojson").as_deref(),
            Some("https://data.example.gov/resource/abcd-1234.json?$select=count(*)")
        );
        let with_where = socrata_count_url("https://h/x/resource/abcd-1234.geojson?$where=zone='R1'").unwrap_or_default();
        assert!(with_where.starts_with("https://h/x/resource/abcd-1234.json?$where="), "{with_where}");
        assert!(with_where.ends_with("&$select=count(*)"), "{with_where}");
        assert_eq!(socrata_count_url("https://h/resource/"), None);
        // The resource's own $select (to get :id), order and paging are not the count's.
        assert_eq!(
            socrata_count_url("https://h/resource/abcd-1234.geojson?%24select=:*,*&$where=a=1&$ORDER=x&$limit=5").as_deref(),
            Some("https://h/resource/abcd-1234.json?$where=a=1&$select=count(*)")
        );
        assert_eq!(without_query_params("https://h/r.geojson?$select=:*,*&$limit=5&$offset=9&$order=a", &["$limit", "$offset", "$order"]), "https://h/r.geojson?$select=:*,*");
        assert_eq!(without_query_params("https://h/r.geojson?$limit=5", &["$limit"]), "https://h/r.geojson");
        assert_eq!(socrata_count_url("https://h/resource/x.geojson?$where=a=1#f").as_deref(), Some("https://h/resource/x.json?$where=a=1&$select=count(*)"));
        // The last `/resource/` names the dataset, for the count and the views as for `check`.
        assert_eq!(socrata_count_url("https://h/resource/x/resource/abcd-1234.geojson").as_deref(), Some("https://h/resource/x/resource/abcd-1234.json?$select=count(*)"));
        assert_eq!(socrata_views_url("https://h/resource/x/resource/abcd-1234.geojson#f").as_deref(), Some("https://h/resource/x/api/views/abcd-1234.json"));
    }

    #[test]
    fn decisions() {
        let day = Duration::from_secs(86_400);
        assert!(floor_due(None, 5, day));
        assert!(!floor_due(Some(&wm(None, 1_000, 0)), 1_000 + 3_600_000, day));
        assert!(floor_due(Some(&wm(None, 1_000, 0)), 1_000 + 86_400_000, day));
        // Fetched "an hour from now": the clock went back since, so the floor is due.
        assert!(floor_due(Some(&wm(None, 1_000 + 3_600_000, 0)), 1_000, day));
        assert!(!floor_due(Some(&wm(None, 1_000 + 1_000, 0)), 1_000, day), "within the tolerance: no step");
        let m = |ts| PortalMeta { publisher_ts_ms: ts, ..Default::default() };
        let now = 10_000;
        assert!(restated(Some(&wm(Some(2_000), 0, 0)), &m(Some(1_000)), now).is_some());
        assert!(restated(Some(&wm(Some(2_000), 0, 0)), &m(Some(2_000)), now).is_none());
        assert!(restated(Some(&wm(None, 0, 0)), &m(Some(1_000)), now).is_none());
        assert!(restated(None, &m(Some(1)), now).is_none());
        assert_eq!(future_timestamp_warning(Some(&wm(Some(2_000), 0, 0)), &m(Some(1_000)), now), None);
        assert_eq!(future_timestamp_warning(None, &m(Some(now)), now), None);
        // A watermark timestamp from the future is no evidence: going back from it is not a
        // restatement, and the run says why.
        let ahead = now + crate::model::PUBLISHER_CLOCK_SKEW_MS;
        assert!(restated(Some(&wm(Some(ahead), 0, 0)), &m(Some(1_000)), now).is_some(), "a day ahead is still believed");
        assert!(future_timestamp_warning(Some(&wm(Some(ahead), 0, 0)), &m(Some(1_000)), now).is_none());
        let future = ahead + 1;
        assert!(restated(Some(&wm(Some(future), 0, 0)), &m(Some(1_000)), now).is_none());
        assert!(restated(Some(&wm(Some(u64::MAX), 0, 0)), &m(Some(1_000)), now).is_none());
        let said = future_timestamp_warning(Some(&wm(Some(future), 0, 0)), &m(Some(1_000)), now).unwrap_or_default();
        assert!(said.contains("not held as a restatement"), "{said}");
        // The portal's own timestamp from the future: recorded with a warning.
        let said = future_timestamp_warning(Some(&wm(Some(2_000), 0, 0)), &m(Some(u64::MAX)), now).unwrap_or_default();
        assert!(said.contains("not trusted to order versions"), "{said}");
        // Once this machine's clock catches up, the same timestamp is believed again.
        assert!(restated(Some(&wm(Some(future), 0, 0)), &m(Some(1_000)), future).is_some());
        // A clock set back behind the last run's: timestamps are held against that run's time.
        assert!(restated(Some(&wm(Some(future), future, 0)), &m(Some(1_000)), now).is_some());
        assert_eq!(future_timestamp_warning(Some(&wm(Some(2_000), future, 0)), &m(Some(future)), now), None);
        let d45 = Duration::from_secs(45 * 86_400);
        assert!(stale(Some(&wm(None, 0, 1)), 46 * 86_400_000, d45).is_some());
        assert!(stale(Some(&wm(None, 0, 1)), 44 * 86_400_000, d45).is_none());
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        for _ in 0..100 {
            let d = jittered(Duration::from_secs(100));
            assert!(d >= Duration::from_secs(90) && d <= Duration::from_secs(110));
        }
    }

    /// A next link is followed on the collection's host only (the scheme may change); a
    /// page linking to another host, another port of it, or something that is no HTTP URL
    /// is refused before anything is asked of it.
    #[test]
    fn next_links_stay_on_the_collections_host() {
        let c = "https://gis.example.gov/ogc/collections/parcels";
        for same in ["https://gis.example.gov/ogc/collections/parcels/items?offset=10", "http://GIS.example.gov:80/x", "https://gis.example.gov:443/y"] {
            assert_eq!(other_host(c, same), None, "{same}");
        }
        for (elsewhere, named) in [
            ("http://203.0.113.1/collections/parcels/items?offset=0", "203.0.113.1"),
            ("https://gis.example.gov:8443/ogc/collections/parcels/items", "gis.example.gov:8443"),
            ("https://evil.example.com/ogc/collections/parcels/items", "evil.example.com"),
            ("http://127.0.0.1:39475/collections/parcels/items", "127.0.0.1:39475"),
            ("file:///etc/passwd", "no host"),
        ] {
            assert_eq!(other_host(c, elsewhere).as_deref(), Some(named), "{elsewhere}");
        }
        assert_eq!(other_host("http://127.0.0.1:8080/c", "http://127.0.0.1:8081/c/items").as_deref(), Some("127.0.0.1:8081"));
    }

    /// An `http` next link of an `https` collection is asked over `https`; nothing else moves.
    #[test]
    fn next_links_of_an_https_collection_stay_https() {
        let c = "https://gis.example.gov/ogc/collections/parcels";
        assert_eq!(keep_https(c, "http://gis.example.gov/ogc/collections/parcels/items?offset=10".into()), "https://gis.example.gov/ogc/collections/parcels/items?offset=10");
        assert_eq!(keep_https(c, "http://gis.example.gov:80/x".into()), "https://gis.example.gov/x");
        assert_eq!(keep_https(c, "https://gis.example.gov/y".into()), "https://gis.example.gov/y");
        assert_eq!(keep_https("http://127.0.0.1:8080/c", "http://127.0.0.1:8080/c/items".into()), "http://127.0.0.1:8080/c/items");
        assert_eq!(keep_https(c, "not a url".into()), "not a url");
    }

    /// `rowsUpdatedAt` past what fits in ms (a hostile portal's `u64::MAX`) is no timestamp,
    /// not an overflow.
    #[test]
    fn rows_updated_at_too_large_for_ms_is_no_timestamp() {
        let at = |v: Value| rows_updated_ms(&serde_json::json!({ "rowsUpdatedAt": v }));
        assert_eq!(at(serde_json::json!(1_700_000_000)), Some(1_700_000_000_000));
        assert_eq!(at(serde_json::json!(u64::MAX / 1000)), Some(u64::MAX / 1000 * 1000));
        assert_eq!(at(serde_json::json!(u64::MAX / 1000 + 1)), None);
        assert_eq!(at(serde_json::json!(u64::MAX)), None);
        for odd in [serde_json::json!(-5), serde_json::json!(1.5), serde_json::json!("1700000000"), Value::Null] {
            assert_eq!(at(odd.clone()), None, "{odd}");
        }
    }

    #[test]
    fn socrata_url() {
        assert_eq!(
            socrata_views_url("https://data.example.gov/resource/abcd-1234.geojson").as_deref(),
            Some("https://data.example.gov/api/views/abcd-1234.json")
        );
        assert_eq!(socrata_views_url("https://data.example.gov/other"), None);
    }
}
