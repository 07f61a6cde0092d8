//! A real HTTP webhook receiver on loopback, used by `zonewatch demo` to show what arrives and
//! by the test suite as the peer that deliveries go to. It records every request and answers
//! with whatever status its script says (always 200, always 503, 400, a sequence, ...).

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// How the receiver answers the n-th request (0-based).
pub type Script = Arc<dyn Fn(usize, &Received) -> u16 + Send + Sync>;

/// A full answer: status, an optional delay before answering (a slow endpoint), extra
/// headers (e.g. `Retry-After`) and a body.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    pub status: u16,
    pub delay: std::time::Duration,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn status(status: u16) -> Reply {
        Reply { status, ..Default::default() }
    }
}

/// How the receiver answers the n-th request (0-based), with full control of the reply.
pub type ReplyScript = Arc<dyn Fn(usize, &Received) -> Reply + Send + Sync>;

/// Called with each request the receiver records (after the script chose its reply, before any delay).
pub type OnReceive = Arc<dyn Fn(&Received) + Send + Sync>;

/// A running receiver. Dropping it stops accepting connections.
pub struct Receiver {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    /// Starts a receiver on 127.0.0.1 (ephemeral port) that answers every request with `status`.
    pub async fn start_status(status: u16) -> std::io::Result<Receiver> {
        Receiver::start(Arc::new(move |_, _| status), None).await
    }

    /// Starts a receiver with a response script and an optional callback per request.
    pub async fn start(script: Script, on_receive: Option<OnReceive>) -> std::io::Result<Receiver> {
        Receiver::start_replies(Arc::new(move |n, r| Reply::status(script(n, r))), on_receive).await
    }

    /// Starts a receiver whose script chooses status, delay, headers and body per request.
    /// The request is recorded when it arrives, before the delay.
    pub async fn start_replies(script: ReplyScript, on_receive: Option<OnReceive>) -> std::io::Result<Receiver> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let received: Arc<Mutex<Vec<Received>>> = Arc::new(Mutex::new(Vec::new()));
        let rec = received.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let rec = rec.clone();
                let script = script.clone();
                let on_receive = on_receive.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let rec = rec.clone();
                        let script = script.clone();
                        let on_receive = on_receive.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let headers = req
                                .headers()
                                .iter()
                                .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
                                .collect();
                            let body = match Limited::new(req.into_body(), 4 << 20).collect().await {
                                Ok(b) => b.to_bytes().to_vec(),
                                Err(_) => {
                                    let mut resp = Response::new(Full::new(Bytes::from_static(b"body too large")));
                                    *resp.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                                    return Ok::<_, std::convert::Infallible>(resp);
                                }
                            };
                            let r = Received { path, headers, body };
                            let n = {
                                let mut g = rec.lock().unwrap_or_else(|p| p.into_inner());
                                g.push(r.clone());
                                g.len() - 1
                            };
                            let reply = script(n, &r);
                            if let Some(cb) = &on_receive {
                                cb(&r);
                            }
                            if !reply.delay.is_zero() {
                                tokio::time::sleep(reply.delay).await;
                            }
                            let mut resp = Response::new(Full::new(Bytes::from(reply.body)));
                            *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                            for (k, v) in &reply.headers {
                                if let (Ok(k), Ok(v)) = (hyper::header::HeaderName::from_bytes(k.as_bytes()), hyper::header::HeaderValue::from_str(v)) {
                                    resp.headers_mut().insert(k, v);
                                }
                            }
                            Ok(resp)
                        }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
        Ok(Receiver { addr, received, task })
    }

    /// The URL deliveries should go to.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().map(|g| g.clone()).unwrap_or_default()
    }
}

/// Called by a [`Receiver::start_sink`] receiver with the `webhook-id` of every request.
pub type OnId = Arc<dyn Fn(&str) + Send + Sync>;

impl Receiver {
    /// A lean receiver for load measurements (`zonewatch bench`): answers 200 to every request
    /// once its whole body is read, keeps nothing (so [`Receiver::received`] stays empty and
    /// memory stays flat over hundreds of thousands of webhooks) and calls `on_id` with the
    /// request's `webhook-id` (empty when absent).
    pub async fn start_sink(on_id: OnId) -> std::io::Result<Receiver> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let _ = stream.set_nodelay(true);
                let on_id = on_id.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let on_id = on_id.clone();
                        async move {
                            let id = req.headers().get("webhook-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                            let status = match Limited::new(req.into_body(), 4 << 20).collect().await {
                                Ok(_) => {
                                    on_id(&id);
                                    StatusCode::OK
                                }
                                Err(_) => StatusCode::PAYLOAD_TOO_LARGE,
                            };
                            let mut resp = Response::new(Full::new(Bytes::new()));
                            *resp.status_mut() = status;
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
        Ok(Receiver { addr, received: Arc::new(Mutex::new(Vec::new())), task })
    }
}
