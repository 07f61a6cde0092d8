//! `control/`: the operator's HTTP port, served by `zonewatch serve`.
//!
//! * [`auth`] — the bearer token (file-backed, constant-time comparison);
//! * [`http`] — request/response plumbing: size-limited bodies, JSON errors, query strings;
//! * [`routes`] — the `/v1` API, `/healthz`, `/metrics` and the dashboard at `/`;
//! * [`metrics`] — Prometheus text exposition (the delivery latency histogram it reports is
//!   kept by `crate::telemetry`);
//! * [`openapi`] — the OpenAPI 3 document served at `/v1/openapi.json`.
//!
//! Every handler returns a response; none panics on input, and a request body never reaches a
//! handler unread or unbounded.

pub mod auth;
pub mod http;
pub mod metrics;
pub mod openapi;
pub mod routes;

use crate::pipeline::Engine;
use crate::schedule::SourceRuns;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// Everything a handler may touch.
pub struct ControlState {
    pub engine: Arc<Engine>,
    pub token: String,
    pub runs: Arc<SourceRuns>,
    /// Wakes the delivery loop after something was queued.
    pub wake: Arc<tokio::sync::Notify>,
    /// When `serve` started, on the monotonic clock: `/healthz`'s `uptime_s` (on the wall
    /// clock, a day's step forward added a day to it).
    pub started: std::time::Instant,
    /// Requests under way that can take long (hold releases and primes, source runs, backups,
    /// replays; at most [`routes::MAX_LONG_REQUESTS`]; each holds a connection meanwhile).
    pub long_requests: std::sync::atomic::AtomicUsize,
}

/// Binds the control port (port 0 picks a free port), outside the async runtime: `serve`
/// binds it before it opens the store.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The bound control port handed to the async runtime (called inside it).
pub fn listener(bound: std::net::TcpListener) -> std::io::Result<TcpListener> {
    TcpListener::from_std(bound)
}

/// The most connections served at once. Each costs a file descriptor the process shares
/// with its runs and deliveries: a flood of idle connections (each held up to the 10 s
/// header timeout) would otherwise make every portal fetch and webhook fail with EMFILE.
/// Past it the connection idle longest is closed to make room (see [`Connections`]); only
/// when every connection is answering a request is a new one closed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a connection picked to make room may take to close once told to: what it has
/// left to send of its last answer is flushed meanwhile. One that has begun another request
/// by then answers it: its handler is waited for whole, and an answer to the operator for as
/// long as its client keeps taking it (see [`EVICTED_ANSWER_LIMIT`]).
const EVICTION_GRACE: std::time::Duration = std::time::Duration::from_millis(200);

/// How long an answer to the operator may wait for its client to take any more of it: a
/// client that stops reading does not hold its slot for ever, one that reads slowly (a large
/// page through a tunnel) keeps it (found by a reviewer: the wait was counted from the first
/// stall, so a steady slow reader was cut after 30 s).
const EVICTED_ANSWER_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Slots beyond [`MAX_CONNECTIONS`] for connections told to close and still finishing: the
/// port accepts the newcomer at once instead of waiting for them (a reviewer found every
/// eviction held the accepting loop for its whole grace, so silent connections opened five
/// times a second kept the operator's connection in the listen queue for minutes).
const CLOSING_ROOM: usize = 16;

/// The open connections, so that a full port closes the one idle longest instead of refusing
/// everyone: 64 silent connections (any local user may open them, no token needed) shut the
/// dashboard, scrapes, backups and hold releases out for as long as they were reopened.
#[derive(Default)]
struct Connections {
    next_id: u64,
    open: std::collections::HashMap<u64, Arc<Connection>>,
    /// Requests being answered on the whole port, on a connection in `open` or on one it
    /// picked to make room, which still finishes the request it had begun (the stop waits for
    /// both: found by a reviewer).
    answering: Arc<std::sync::atomic::AtomicUsize>,
}

/// One connection as the port sees it.
struct Connection {
    /// Requests being answered now: from the moment a request's head was read until its
    /// answer's body was handed over whole ([`Answering`]).
    busy: std::sync::atomic::AtomicUsize,
    /// Since when bytes of an answer wait for the client to take them (a write the socket
    /// could not take whole; [`WatchedIo`]), if they do: such a connection is still sending.
    unsent_since: std::sync::Mutex<Option<std::time::Instant>>,
    /// Whether the last request it began carried the control token: only the operator's
    /// answers are waited for while the client takes them. A client without it that stops
    /// reading pipelined answers would otherwise keep its connection for ever (found by a
    /// reviewer: 64 such connections shut the operator out).
    operator: std::sync::atomic::AtomicBool,
    /// Whether its socket has been read and found with nothing more to give: until then a
    /// connection that has begun no request may simply not have been read yet (its task not
    /// yet run), with a whole request waiting, and is never picked to make room (found by a
    /// black-box tester: under a flood of reconnecting connections the operator's own new
    /// connection was closed with its request unread).
    waited: std::sync::atomic::AtomicBool,
    /// Requests it has begun in all: one that has never sent a request is closed at once
    /// when its slot is needed.
    requests: std::sync::atomic::AtomicU64,
    /// When it was accepted or its last request was answered.
    idle_since: std::sync::Mutex<std::time::Instant>,
    /// Notified when the port needs its slot: the connection is dropped (its socket closed).
    close: tokio::sync::Notify,
    /// The port's count of requests being answered ([`Connections::answering`]).
    port_answering: Arc<std::sync::atomic::AtomicUsize>,
}

/// A connection's place on the list, given up when its task ends.
struct Listed {
    registry: Arc<std::sync::Mutex<Connections>>,
    id: u64,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.registry.lock().unwrap_or_else(|p| p.into_inner()).open.remove(&self.id);
    }
}

impl Connections {
    fn add(&mut self) -> (u64, Arc<Connection>) {
        let id = self.next_id;
        self.next_id += 1;
        let c = Arc::new(Connection {
            busy: std::sync::atomic::AtomicUsize::new(0),
            requests: std::sync::atomic::AtomicU64::new(0),
            unsent_since: std::sync::Mutex::new(None),
            waited: std::sync::atomic::AtomicBool::new(false),
            operator: std::sync::atomic::AtomicBool::new(false),
            idle_since: std::sync::Mutex::new(std::time::Instant::now()),
            close: tokio::sync::Notify::new(),
            port_answering: self.answering.clone(),
        });
        self.open.insert(id, c.clone());
        (id, c)
    }

    /// Tells the connection idle longest (no request being answered; the least recently
    /// accepted or answered) to close, and takes it off the list; `false` when every
    /// connection is answering a request. No minimum idle time: 64 connections each asking
    /// something every 100 ms are never idle for long, and they shut every other client out
    /// while a minimum protected them (found by a reviewer). A newcomer is the most recently
    /// accepted, so it is the last one picked, and its request arrives at once.
    fn close_idlest(&mut self) -> bool {
        let idle = |c: &Connection| *c.idle_since.lock().unwrap_or_else(|p| p.into_inner());
        let idlest = self
            .open
            .iter()
            .filter(|(_, c)| c.busy.load(std::sync::atomic::Ordering::SeqCst) == 0 && !c.sending() && c.read_once())
            .min_by_key(|(_, c)| idle(c))
            .map(|(id, _)| *id);
        match idlest.and_then(|id| self.open.remove(&id)) {
            Some(c) => {
                c.close.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Serves the control port until `shutdown` flips; then each open connection finishes the
/// request it is serving and closes (no new request is read from a kept-alive one), and this
/// returns once they have ([`finish_connections`]).
pub async fn serve(listener: TcpListener, state: Arc<ControlState>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS + CLOSING_ROOM));
    let connections: Arc<std::sync::Mutex<Connections>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    let mut warned: Option<std::time::Instant> = None;
    loop {
        while tasks.try_join_next().is_some() {}
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("control port accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Full: the connection idle longest makes room. It gives its slot back when it has
        // closed; meanwhile the newcomer takes one of the closing room's, and waits (bounded,
        // so the port goes on accepting) only when that room is taken too.
        let (under_cap, room) = {
            let mut open = connections.lock().unwrap_or_else(|p| p.into_inner());
            let under_cap = open.open.len() < MAX_CONNECTIONS;
            (under_cap, under_cap || open.close_idlest())
        };
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) if room => Some(slot),
            // Bounded, and a stop is not held by it.
            Err(_) if room => tokio::select! {
                slot = tokio::time::timeout(std::time::Duration::from_secs(1), slots.clone().acquire_owned()) => slot.ok().and_then(Result::ok),
                _ = shutdown.changed() => break,
            },
            _ => None,
        };
        if !under_cap {
            // Let the tasks just started read their first request before the next newcomer
            // may pick one of them to make room.
            tokio::task::yield_now().await;
        }
        let Some(slot) = slot else {
            if warned.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(60)) {
                tracing::warn!(%peer, "control port: {MAX_CONNECTIONS} connections open, each answering a request; closing new ones until one is free (said once a minute)");
                warned = Some(std::time::Instant::now());
            }
            drop(stream);
            continue;
        };
        let (conn_id, this) = connections.lock().unwrap_or_else(|p| p.into_inner()).add();
        // Off the list however the task ends, a panic in a handler included.
        let listed = Listed { registry: connections.clone(), id: conn_id };
        let state = state.clone();
        let mut stop = shutdown.clone();
        tasks.spawn(async move {
            let _slot = slot;
            let seen = this.clone();
            let svc = service_fn(move |req| {
                let state = state.clone();
                let seen = seen.clone();
                async move {
                    // Busy until the answer's body is handed over, however this ends.
                    let operator = auth::authorized(&state.token, req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()));
                    let answering = Answering::begin(seen, operator);
                    let resp = routes::handle(state, req).await;
                    Ok::<_, std::convert::Infallible>(resp.map(|body| TrackedBody { body, _answering: answering }))
                }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(WatchedIo { io: TokioIo::new(stream), conn: this.clone() }, svc);
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
                // The port needs this connection's slot. One that never sent a request is
                // dropped now (hyper would go on waiting for its first). Otherwise it reads no
                // new request: what it is answering is answered whole (a request may have
                // begun as it was picked), what it has left to send is flushed, then it closes.
                _ = this.close.notified() => {
                    let ordering = std::sync::atomic::Ordering::SeqCst;
                    if this.requests.load(ordering) == 0 && this.busy.load(ordering) == 0 {
                        Ok(())
                    } else {
                        conn.as_mut().graceful_shutdown();
                        // Looked at again every grace: a handler still at work (a backup, a
                        // run) is waited for whole (its work goes on either way, and a cut
                        // would only lose the answer and have the client ask again); an
                        // answer to the operator while the client takes it, up to the limit
                        // `sending` keeps.
                        loop {
                            match tokio::time::timeout(EVICTION_GRACE, conn.as_mut()).await {
                                Ok(ended) => break ended,
                                Err(_) if this.busy.load(ordering) > 0 || this.sending() => {}
                                Err(_) => break Ok(()),
                            }
                        }
                    }
                }
            };
            drop(listed);
            if let Err(e) = ended {
                tracing::debug!("control connection ended: {e}");
            }
        });
    }
    finish_connections(tasks, &connections).await;
}

/// How long a stopping port waits for connections that answer nothing (idle ones, or a
/// client slow to take its answer) once none is answering a request.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The stop of the port: waits for its connections to end, each finishing the request it is
/// answering, however long that takes (a backup being written: its answer is what tells the
/// client where the copy is; a tester's `backup` during a restart lost it, the runtime
/// dropped the connection before it answered), and a connection answering nothing for
/// [`STOP_GRACE`] at most.
async fn finish_connections(mut tasks: tokio::task::JoinSet<()>, connections: &std::sync::Mutex<Connections>) {
    let answering = connections.lock().unwrap_or_else(|p| p.into_inner()).answering.clone();
    loop {
        tokio::select! {
            next = tasks.join_next() => if next.is_none() { return },
            _ = tokio::time::sleep(STOP_GRACE) => {
                if answering.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    return;
                }
            }
        }
    }
}

/// A request being answered on a [`Connection`]: counted busy from the moment its head was
/// read until the answer's body has been handed to hyper whole (or the request was dropped).
/// What hyper then has left to write, the socket not taking it yet, [`WatchedIo`] sees: the
/// port picks neither to make room.
struct Answering(Arc<Connection>);

impl Answering {
    fn begin(conn: Arc<Connection>, operator: bool) -> Answering {
        conn.operator.store(operator, std::sync::atomic::Ordering::SeqCst);
        conn.requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        conn.busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        conn.port_answering.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Answering(conn)
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = std::time::Instant::now();
        self.0.busy.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.0.port_answering.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// An answer's body that keeps its connection busy ([`Answering`]) until hyper has taken it
/// whole and dropped it.
struct TrackedBody {
    body: http_body_util::Full<bytes::Bytes>,
    _answering: Answering,
}

impl hyper::body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl Connection {
    /// It has answered a request, or its socket was read with nothing more to give: what it
    /// sent, if anything, has been seen (see `waited`).
    fn read_once(&self) -> bool {
        self.requests.load(std::sync::atomic::Ordering::SeqCst) > 0 || self.waited.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bytes of an answer to the operator wait for the client, which took some within the
    /// last [`EVICTED_ANSWER_LIMIT`] (a client that stops reading does not keep its slot for
    /// ever).
    fn sending(&self) -> bool {
        self.operator.load(std::sync::atomic::Ordering::SeqCst) && self.unsent_since.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t.elapsed() < EVICTED_ANSWER_LIMIT)
    }

    /// What a write to the socket did: `asked` bytes, `r` the socket's answer.
    fn wrote(&self, r: &std::task::Poll<std::io::Result<usize>>, asked: usize) {
        let mut unsent = self.unsent_since.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            std::task::Poll::Ready(Ok(n)) if *n >= asked => *unsent = None,
            std::task::Poll::Ready(Err(_)) => *unsent = None,
            // Some taken, the rest waits: the wait counts from now.
            std::task::Poll::Ready(Ok(n)) if *n > 0 => *unsent = Some(std::time::Instant::now()),
            _ => {
                unsent.get_or_insert_with(std::time::Instant::now);
            }
        }
    }
}

/// A connection's socket as hyper reads and writes it, noting on its [`Connection`] when an
/// answer's bytes wait for the client (hyper keeps what the socket would not take and writes
/// it when it can): the body of an answer is handed over at once, so being done with the
/// body says nothing of the client having it (found by a reviewer: a large answer to a slow
/// reader was cut when its connection was picked to make room).
struct WatchedIo {
    io: TokioIo<tokio::net::TcpStream>,
    conn: Arc<Connection>,
}

impl hyper::rt::Read for WatchedIo {
    fn poll_read(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: hyper::rt::ReadBufCursor<'_>) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if r.is_pending() {
            this.conn.waited.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        r
    }
}

impl hyper::rt::Write for WatchedIo {
    fn poll_write(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_write(cx, buf);
        this.conn.wrote(&r, buf.len());
        r
    }

    fn poll_write_vectored(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.conn.wrote(&r, bufs.iter().map(|b| b.len()).sum());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Poll;

    /// The connection picked to make room is the one idle longest among those neither
    /// answering a request nor sending the operator an answer the client has not taken yet,
    /// nor not yet read; one whose unsent bytes have waited past the limit is idle again; none picked
    /// when all are busy.
    #[test]
    fn the_idlest_connection_neither_answering_nor_sending_makes_room() {
        let mut open = Connections::default();
        let (old, oldest) = open.add();
        let (sending_id, sending) = open.add();
        let (young, young_conn) = open.add();
        let (unread_id, unread) = open.add();
        for c in [&oldest, &sending, &young_conn] {
            c.waited.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // Accepted first, never read yet: its request may be waiting whole.
        *unread.idle_since.lock().unwrap() -= std::time::Duration::from_secs(90);
        *oldest.idle_since.lock().unwrap() -= std::time::Duration::from_secs(30);
        *sending.idle_since.lock().unwrap() -= std::time::Duration::from_secs(60);
        sending.wrote(&Poll::Ready(Ok(100)), 4096);
        assert!(!sending.sending(), "an answer without the token is not waited for");
        sending.operator.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(sending.sending());
        let answering = Answering::begin(oldest.clone(), false);
        assert!(open.close_idlest());
        assert!(open.open.contains_key(&old) && open.open.contains_key(&sending_id) && open.open.contains_key(&unread_id) && !open.open.contains_key(&young), "the young idle one went");
        assert!(!open.close_idlest(), "one answering, one sending: nothing to close");
        drop(answering);
        assert!(open.close_idlest() && !open.open.contains_key(&old), "answered: idle again");
        sending.wrote(&Poll::Pending, 10);
        assert!(sending.sending(), "still waiting for the client");
        *sending.unsent_since.lock().unwrap() = Some(std::time::Instant::now() - EVICTED_ANSWER_LIMIT);
        assert!(!sending.sending(), "a client that never reads does not keep its slot");
        // A slow reader that took some of it just now keeps its slot.
        sending.wrote(&Poll::Ready(Ok(4)), 10);
        assert!(sending.sending(), "a client still reading keeps its slot");
        sending.wrote(&Poll::Pending, 6);
        assert!(sending.sending(), "a stall after progress waits from the progress");
        sending.wrote(&Poll::Ready(Ok(10)), 10);
        assert!(sending.unsent_since.lock().unwrap().is_none(), "taken whole");
        assert_eq!(oldest.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
