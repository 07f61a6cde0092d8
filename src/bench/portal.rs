//! Measure 1, as a portal serves it: the bench's baseline county fetched through an `arcgis`
//! source (`format = "geojson"`, pages of 2,000) from a loopback FeatureServer that this
//! measure starts in its own process, then run through the pipeline. Reports the run's wall
//! time, CPU and peak RSS (and the RSS before it), so the memory of the portal path — pages
//! collected on disk, written to the staged payload, scanned as a file (`ingest/collect.rs`)
//! — can be read against the file path's (`--only ingest`).
//!
//! A second phase, `arcgis_one_page`, fetches the same layer from a server that ignores
//! `resultRecordCount` and answers the whole layer as one page (servers that cap nothing do
//! this): its peak RSS against `layer_mib` is what one page costs the fetch (each feature is
//! parsed and spooled as it is read, `ingest/page.rs`; the page's bytes are held).
//!
//! The server answers what zonewatch asks of an ArcGIS layer (metadata, `returnCountOnly`,
//! `query` pages ordered by object id) straight from the generated file: it holds an index
//! of where each page's features lie, never the layer. It runs in the measuring process, so
//! its runtime and the chunk in flight (at most 1 MiB: pages are read off the file as the
//! connection takes them) count in the peak RSS and its CPU in
//! `cpu_s`: a few MiB, and the wall time is shared with it on the same cores. It is a load
//! generator for this measure only; the tests fetch from real peers (Koop, pygeoapi).

use super::{COUNTY_FIELDS, emit, gen, per_s, rss, secs, BenchCtx, BenchError};
use crate::config::Config;
use crate::pipeline::{Engine, RunOptions};
use bytes::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::json;
use std::io::{BufRead, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Features per page, the layer's `maxRecordCount` and the source's `page_size`.
const PAGE: usize = 2_000;

pub fn run(ctx: &BenchCtx) -> Result<(), BenchError> {
    for n in ctx.parcel_sizes() {
        // Generated in the parent, as for the ingest measure.
        let files = gen::county_files(&ctx.work, n, ctx.seed, 0.01)?;
        if !ctx.in_process {
            ctx.run_child("portal", &["--parcels".to_string(), n.to_string()])?;
        } else {
            measure(ctx, &files.baseline, n)?;
        }
    }
    Ok(())
}

/// Where each page's features lie in the generated file (one feature per line).
struct PageIndex {
    path: PathBuf,
    /// Which pages were served whole (reported as a count of distinct pages, so a run that
    /// fetched nothing cannot pass for one).
    served: Vec<std::sync::atomic::AtomicBool>,
    /// Byte range of each page's features, from the first's `{` to the last's `}`.
    ranges: Vec<(u64, u64)>,
    features: u64,
    /// The file's size.
    bytes: u64,
    /// Answer every query with the whole layer as one page (`resultRecordCount` ignored).
    one_page: bool,
    /// Query answers that held features.
    queries: std::sync::atomic::AtomicU64,
}

fn page_index(path: &Path) -> Result<PageIndex, BenchError> {
    let file = std::fs::File::open(path).map_err(|e| BenchError::io(path, e))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let (mut line, mut pos, mut features) = (Vec::new(), 0u64, 0u64);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(|e| BenchError::io(path, e))?;
        if read == 0 {
            break;
        }
        let start = pos;
        pos += read as u64;
        if !line.starts_with(b"{\"type\":\"Feature\"") {
            continue;
        }
        let text = line.len() - line.iter().rev().take_while(|b| matches!(b, b'\n' | b'\r' | b' ' | b',')).count();
        let end = start + text as u64;
        match ranges.last_mut() {
            Some(last) if features % PAGE as u64 != 0 => last.1 = end,
            _ => ranges.push((start, end)),
        }
        features += 1;
    }
    let served = ranges.iter().map(|_| Default::default()).collect();
    Ok(PageIndex { path: path.to_path_buf(), served, ranges, features, bytes: pos, one_page: false, queries: Default::default() })
}

impl PageIndex {
    /// The answer to one HTTP request of the scan.
    fn answer(&self, path: &str, query: &str) -> (u16, PageBody) {
        let param = |name: &str| query.split('&').find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')));
        if !path.ends_with("/query") {
            let meta = json!({
                "name": "bench county", "type": "Feature Layer", "objectIdField": "OBJECTID", "maxRecordCount": PAGE,
                "editingInfo": {"dataLastEditDate": 1_700_000_000_000u64},
                "fields": [
                    {"name": "OBJECTID", "type": "esriFieldTypeOID"}, {"name": "APN", "type": "esriFieldTypeString"},
                    {"name": "ZONE_CODE", "type": "esriFieldTypeString"}, {"name": "EFF_DATE", "type": "esriFieldTypeString"}
                ]
            });
            return (200, PageBody::whole(meta.to_string()));
        }
        if param("returnCountOnly") == Some("true") {
            return (200, PageBody::whole(json!({"count": self.features}).to_string()));
        }
        let offset: usize = param("resultOffset").and_then(|v| v.parse().ok()).unwrap_or(0);
        // The pages to answer with, by number.
        let pages = match (self.one_page, offset) {
            (true, 0) => 0..self.ranges.len(),
            (true, _) => 0..0,
            (false, at) if !at.is_multiple_of(PAGE) => {
                return (200, PageBody::whole(json!({"error": {"code": 400, "message": "this bench server pages by 2000"}}).to_string()));
            }
            (false, at) => at / PAGE..(at / PAGE + 1).min(self.ranges.len()),
        };
        let more = pages.end < self.ranges.len() && !pages.is_empty();
        let tail = format!("],\"properties\":{{\"exceededTransferLimit\":{more}}}}}");
        let file = match (self.ranges.get(pages.start), pages.end.checked_sub(1).and_then(|last| self.ranges.get(last))) {
            (Some(&(start, _)), Some(&(_, end))) if !pages.is_empty() => {
                let opened = std::fs::File::open(&self.path).and_then(|mut f| f.seek(SeekFrom::Start(start)).map(|_| f));
                match opened {
                    Ok(f) => Some((f, end - start)),
                    Err(e) => return (500, PageBody::whole(e.to_string())),
                }
            }
            _ => None,
        };
        if file.is_some() {
            self.queries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        for page in pages {
            self.served[page].store(true, std::sync::atomic::Ordering::Relaxed);
        }
        (200, PageBody { head: Some(Bytes::from_static(b"{\"type\":\"FeatureCollection\",\"features\":[")), file, tail: Some(Bytes::from(tail)) })
    }
}

/// One answer's body: a head, a stretch of the generated file read a MiB at a time as the
/// connection takes it (so no page, however large, is held whole by the server), and a tail.
/// The reads block the server's runtime thread; the file is in the page cache, and this
/// server has no other work.
struct PageBody {
    head: Option<Bytes>,
    file: Option<(std::fs::File, u64)>,
    tail: Option<Bytes>,
}

impl PageBody {
    fn whole(text: String) -> PageBody {
        PageBody { head: Some(Bytes::from(text)), file: None, tail: None }
    }
}

impl hyper::body::Body for PageBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(head))));
        }
        if let Some((file, left)) = &mut self.file {
            if *left > 0 {
                let mut chunk = vec![0; (*left).min(1 << 20) as usize];
                if let Err(e) = file.read_exact(&mut chunk) {
                    return Poll::Ready(Some(Err(e)));
                }
                *left -= chunk.len() as u64;
                return Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(chunk)))));
            }
            self.file = None;
        }
        Poll::Ready(self.tail.take().map(|tail| Ok(hyper::body::Frame::data(tail))))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let len = |b: &Option<Bytes>| b.as_ref().map_or(0, |b| b.len() as u64);
        hyper::body::SizeHint::with_exact(len(&self.head) + self.file.as_ref().map_or(0, |f| f.1) + len(&self.tail))
    }
}

/// Serves `index` on 127.0.0.1 from a runtime of its own; returns the runtime (dropping it
/// stops the server) and the port.
fn serve(index: Arc<PageIndex>) -> Result<(tokio::runtime::Runtime, u16), BenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| BenchError::io("bench portal runtime", e))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| BenchError::io("bench portal listener", e))?;
    let port = listener.local_addr().map_err(|e| BenchError::io("bench portal listener", e))?.port();
    rt.spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                // Out of descriptors, say: wait rather than spin, and say why the client may
                // time out.
                Err(e) => {
                    eprintln!("bench portal: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let index = index.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let index = index.clone();
                    async move {
                        let (path, query) = (req.uri().path().to_string(), req.uri().query().unwrap_or("").to_string());
                        let (status, body) = tokio::task::spawn_blocking(move || index.answer(&path, &query))
                            .await
                            .unwrap_or_else(|e| (500, PageBody::whole(e.to_string())));
                        let mut resp = Response::new(body);
                        *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
                        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    Ok((rt, port))
}

fn measure(ctx: &BenchCtx, baseline: &Path, n: usize) -> Result<(), BenchError> {
    let paged = page_index(baseline)?;
    if paged.features != n as u64 {
        return Err(BenchError::Failed(format!("{}: {} features, expected {n}", baseline.display(), paged.features)));
    }
    let one_page = PageIndex {
        path: paged.path.clone(),
        served: paged.ranges.iter().map(|_| Default::default()).collect(),
        ranges: paged.ranges.clone(),
        one_page: true,
        queries: Default::default(),
        ..paged
    };
    measure_phase(ctx, Arc::new(paged), n, "arcgis_baseline")?;
    measure_phase(ctx, Arc::new(one_page), n, "arcgis_one_page")
}

/// One first run of the layer `index` serves, into a fresh store.
fn measure_phase(ctx: &BenchCtx, index: Arc<PageIndex>, n: usize, phase: &str) -> Result<(), BenchError> {
    let layer_bytes = index.bytes;
    let (_server, port) = serve(index.clone())?;
    let store_dir = ctx.fresh_dir(&format!("portal-store-{n}-{phase}"))?;
    let toml = format!(
        r#"
[store]
path = "bench.redb"
[ingest]
allow_private_targets = true
rate_per_host = 100000.0
timeout_ms = 120000
max_layer_bytes = {layer_cap}
max_response_bytes = {layer_cap}
max_decompressed_bytes = {layer_cap}
[[source]]
id = "bench-portal"
jurisdiction = "bench"
kind = "arcgis"
format = "geojson"
url = "http://127.0.0.1:{port}/arcgis/rest/services/County/FeatureServer/0"
page_size = {PAGE}
every = "1h"
max_change_ratio = 0.05
{COUNTY_FIELDS}"#,
        layer_cap = layer_bytes.saturating_mul(2).max(1 << 20)
    );
    let config = Config::parse_str(&toml, &store_dir).map_err(|e| BenchError::Failed(format!("bench config: {e}")))?;
    let engine = Engine::open(config).map_err(|e| BenchError::Failed(format!("open: {e}")))?;
    let rss_before = rss::current_rss_bytes();
    let peak_reset = rss::reset_peak();
    let cpu = rss::cpu_seconds();
    let t = Instant::now();
    let report = engine.run_source_id("bench-portal", RunOptions::default()).map_err(|e| BenchError::Failed(format!("portal run: {e}")))?;
    let wall = t.elapsed();
    let counts = &report.record.counts;
    if counts.parcels != n as u64 || counts.changes != n as u64 {
        return Err(BenchError::Failed(format!("portal run: {} parcels, {} changes, expected {n}: {}", counts.parcels, counts.changes, report.line())));
    }
    let staged = crate::ingest::staging::payload_path(engine.store.path(), "bench-portal");
    emit(
        "portal",
        json!({
            "parcels": n,
            "phase": phase,
            "verdict": report.record.verdict.to_string(),
            "changes": counts.changes,
            "page_size": PAGE,
            "layer_mib": rss::mib(Some(layer_bytes)),
            "staged_mib": rss::mib(std::fs::metadata(&staged).ok().map(|m| m.len())),
            "wall_s": secs(wall),
            "features_per_s": per_s(n as u64, wall.as_secs_f64()),
            "cpu_s": rss::cpu_seconds_since(cpu),
            // Without a reset the peak would include building the page index: none then.
            "peak_rss_mib": if peak_reset { rss::mib(rss::peak_rss_bytes()) } else { None },
            "peak_reset": peak_reset,
            "pages": index.ranges.len(),
            "pages_served": index.served.iter().filter(|p| p.load(std::sync::atomic::Ordering::Relaxed)).count(),
            "queries": index.queries.load(std::sync::atomic::Ordering::Relaxed),
            "rss_before_mib": rss::mib(rss_before),
            "target_peak_rss_mib": 512,
        }),
    );
    Ok(())
}
