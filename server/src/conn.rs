//! One client connection: the hello, then a loop that reads frames and runs
//! each request as its own task, so one connection can carry several
//! requests at once (the responses carry the request id and may come back in
//! any order). Each request's task writes its own response under the
//! connection's write lock.
//!
//! Framing errors (bad hello, unknown op, an oversized length) close the
//! connection with a logged reason; a well-framed but invalid request gets a
//! BAD_REQUEST answer and the connection carries on.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kv_common::page::{PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, Hello, KeyRequest, Op, ReqHeader, RspHeader, WireError};
use kv_common::wire::{ClientHello, HELLO_ACCEPTED, HELLO_BUSY, HELLO_DENIED, HELLO_VERSION_REFUSED};
use kv_common::wire::{FLAG_CHECK_GEOMETRY, FRAME_HEADER_LEN, HELLO_LEN, RSP_FLAG_DUPLICATE, WIRE_VERSION};
use kv_common::wire::{FLAG_HANDOFF, FLAG_RDMA, RSP_FLAG_RDMA, RSP_FLAG_RDMA_FAILED};
use kv_rdma::bootstrap::{self, Answer, Endpoint, Segment};
use kv_rdma::engine::{Link, WrOp};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::server::Shared;
use crate::store::{GetOutcome, Held, PooledBuf, Presence, PutOutcome, StoreError};

/// Time allowed for the hello, for a frame once its first byte arrived (plus
/// [`frame_allowance`] for its body), and for a response to be taken: the
/// default of [`Shared::frame_timeout`].
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// Extra time a frame's body may take: one second per MiB (a peer slower
/// than 1 MiB/s is treated as stuck).
fn frame_allowance(body_len: u32) -> Duration {
    Duration::from_secs(u64::from(body_len) >> 20)
}
/// Requests one connection may have in flight.
const MAX_INFLIGHT_PER_CONN: usize = 64;
/// At shutdown: longest wait for the next frame the peer already sent.
const DRAIN_GAP: Duration = Duration::from_millis(200);
/// At shutdown: longest time a connection keeps taking frames.
const DRAIN_MAX: Duration = Duration::from_secs(5);

enum Body {
    Empty,
    Bytes(Vec<u8>),
    Record(Arc<PooledBuf>),
}

struct Response {
    header: [u8; FRAME_HEADER_LEN],
    /// The wire status in `header` (for the request counters).
    status: u8,
    body: Body,
    /// The share of `--max-inflight` this response's body holds until written.
    budget: Option<OwnedSemaphorePermit>,
}

fn respond(req: &ReqHeader, status: Status, flags: u16, body: Body) -> Response {
    let len = match &body {
        Body::Empty => 0,
        Body::Bytes(b) => b.len(),
        Body::Record(r) => r.len(),
    };
    let h = RspHeader { status, op: req.op as u8, flags, body_len: len as u32, req_id: req.req_id };
    Response { header: h.encode(), status: status.to_wire(), body, budget: None }
}

/// Counts an answered request and its service time (from `t0`, when the
/// whole request was in hand).
fn counted(shared: &Shared, op: Op, t0: Instant, r: Response) -> Response {
    shared.ops.record(op, r.status, t0.elapsed());
    r
}

fn error_response(req: &ReqHeader, status: Status, msg: &str) -> Response {
    respond(req, status, 0, Body::Bytes(msg.as_bytes().to_vec()))
}

/// The one place internal store errors become wire statuses.
fn store_error_status(e: &StoreError) -> Status {
    match e {
        StoreError::BadRecord(_) => Status::BadRequest,
        // The client computed the CRC over what it meant to send: bytes
        // damaged on the way (not a caller error; the put may be retried).
        StoreError::BadPayload => Status::Corrupt,
        StoreError::NoDisk => Status::Unavailable,
        StoreError::Full(_) | StoreError::TooLarge(_) => Status::Rejected,
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out inside a frame")]
    Timeout,
}

async fn read_exact_by(rd: &mut BufReader<OwnedReadHalf>, buf: &mut [u8], deadline: Instant) -> Result<(), ConnError> {
    match tokio::time::timeout_at(deadline, rd.read_exact(buf)).await {
        Ok(r) => r.map(|_| ()).map_err(ConnError::from),
        Err(_) => Err(ConnError::Timeout),
    }
}

/// Fills `buf` by `deadline` like [`read_exact_by`], but past the bytes
/// already buffered it reads straight from the socket into `buf`: a page's
/// body then costs no copy out of the read buffer (which otherwise takes
/// every read shorter than its 64 KiB capacity, the whole of a small page).
async fn read_body_by(rd: &mut BufReader<OwnedReadHalf>, buf: &mut [u8], deadline: Instant) -> Result<(), ConnError> {
    let held = rd.buffer();
    let k = held.len().min(buf.len());
    buf[..k].copy_from_slice(&held[..k]);
    rd.consume(k);
    if k == buf.len() {
        return Ok(());
    }
    match tokio::time::timeout_at(deadline, rd.get_mut().read_exact(&mut buf[k..])).await {
        Ok(r) => r.map(|_| ()).map_err(ConnError::from),
        Err(_) => Err(ConnError::Timeout),
    }
}

/// The write half, shared by the tasks answering this connection's requests:
/// each writes its own response (no hand-off to a writer task, so an answer
/// costs no extra task wake-up). Each response must be written within 30 s
/// plus 1 s per MiB; a peer that stops reading is cut off (its responses'
/// memory freed) instead of holding the connection, and a shutdown, forever.
struct Out {
    w: tokio::sync::Mutex<BufWriter<tokio::net::tcp::OwnedWriteHalf>>,
    dead: watch::Sender<bool>,
    peer: SocketAddr,
    /// [`Shared::frame_timeout`].
    timeout: Duration,
    /// This connection's RDMA queue pair, once RDMA_CONNECT set one up.
    rdma: std::sync::Mutex<Option<Arc<Link>>>,
}

impl Out {
    /// The queue pair, if there is one and it still works (a broken one is
    /// dropped here: the client reconnects or goes on over TCP).
    fn link(&self) -> Option<Arc<Link>> {
        let mut g = self.rdma.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|l| l.broken().is_some() || l.runtime().is_off()) {
            *g = None;
        }
        g.clone()
    }

    /// A transfer on `link` failed: tear its queue pair down now (the
    /// device stops touching memory) and stop using it on this connection,
    /// before the answer goes out over TCP.
    fn drop_link(&self, link: &Arc<Link>) {
        link.close();
        let mut g = self.rdma.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
            *g = None;
        }
    }
}

/// A connection's response buffer: smaller responses are written from it,
/// larger bodies straight from their own buffer.
const WRITE_BUFFER: usize = 64 * 1024;

/// Writes all of `a` then `b` with vectored writes.
async fn write_all_vectored(
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    mut a: &[u8],
    mut b: &[u8],
) -> std::io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = w.write_vectored(&[std::io::IoSlice::new(a), std::io::IoSlice::new(b)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

impl Out {
    async fn send(&self, r: Response) {
        if *self.dead.borrow() {
            return;
        }
        let len = match &r.body {
            Body::Empty => 0,
            Body::Bytes(b) => b.len(),
            Body::Record(rec) => rec.len(),
        };
        // The lock first, then the check: a sender that timed out inside a
        // frame marks the connection dead before it lets go of the writer,
        // so no whole frame is ever written after a partial one.
        let mut w = self.w.lock().await;
        if *self.dead.borrow() {
            return;
        }
        let deadline = Instant::now() + self.timeout + frame_allowance(len as u32);
        let res = tokio::time::timeout_at(deadline, async {
            let body: &[u8] = match &r.body {
                Body::Empty => &[],
                Body::Bytes(b) => b,
                Body::Record(rec) => rec.as_slice(),
            };
            if w.buffer().is_empty() && body.len() >= WRITE_BUFFER {
                // A body the buffer cannot hold: header and body in one
                // vectored write (one system call, not one for the header
                // and one for the body), straight from the record's buffer.
                write_all_vectored(w.get_mut(), &r.header, body).await?;
            } else {
                w.write_all(&r.header).await?;
                w.write_all(body).await?;
            }
            w.flush().await
        })
        .await;
        let failed = match res {
            Ok(Ok(())) => false,
            Ok(Err(e)) => {
                tracing::debug!(peer = %self.peer, error = %e, "write failed");
                true
            }
            Err(_) => {
                tracing::warn!(peer = %self.peer, "closing connection: peer stopped reading responses");
                true
            }
        };
        if failed {
            // The reader stops too; later responses are dropped unsent.
            self.dead.send_replace(true);
        }
        drop(w);
    }

    async fn close(&self) {
        let mut w = self.w.lock().await;
        if *self.dead.borrow() {
            // The peer stopped reading: what is still buffered would never
            // go out, and flushing it could wait for ever. Just send the FIN.
            let _ = w.get_mut().shutdown().await;
            return;
        }
        let flushed = tokio::time::timeout(self.timeout, async {
            w.flush().await?;
            w.shutdown().await
        })
        .await;
        if flushed.is_err() {
            let _ = w.get_mut().shutdown().await;
        }
    }
}

/// Serves one connection until the peer closes, it misbehaves, or shutdown.
/// TCP keepalive on a client socket: a peer host that vanished (crash,
/// partition) is found out after about 60 + 3 x 10 s of silence, and its
/// connection slot freed, even with requests in flight.
fn keepalive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    for (level, opt, val) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let v: libc::c_int = val;
        // SAFETY: `fd` is the open socket `stream` owns for this call; the
        // option value is a c_int on the stack, passed with its size.
        let _ = unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// What the wait for the next frame found.
enum Next {
    /// Bytes of a frame are there.
    Frame,
    /// The peer closed, the node stopped draining, a reply could not be
    /// written, or the connection was idle: close it.
    Close,
    /// The node is shutting down: drain what the peer already sent.
    Shutdown,
    /// The idle timer fired while requests are in flight: wait again.
    Busy,
    Failed(std::io::Error),
}

impl Next {
    fn read(r: std::io::Result<&[u8]>) -> Next {
        match r {
            Ok([]) => Next::Close,
            Ok(_) => Next::Frame,
            Err(e) => Next::Failed(e),
        }
    }
}

/// Serves one connection of the data port: the hello, then frames until
/// the peer closes, the connection idles out or the node shuts down.
pub async fn serve(conn: kv_common::listen::Accepted, shared: Arc<Shared>) {
    let kv_common::listen::Accepted { stream, peer, opening, mut shutdown } = conn;
    let _ = stream.set_nodelay(true);
    keepalive(&stream);
    let (rd, wr) = stream.into_split();
    // Small: what the reader buffers past a frame's header is copied once
    // more into the record's buffer (a 64 KiB buffer copied nearly every
    // 64 KiB put twice, 13 % of the node's time); bodies are read straight
    // into their buffers past it, and small frames still come in batches.
    let mut rd = BufReader::with_capacity(8 * 1024, rd);
    let mut wr = BufWriter::with_capacity(WRITE_BUFFER, wr);
    match handshake(&mut rd, &mut wr, &shared, peer, &opening).await {
        Ok(Greeted::Accepted) => {}
        Ok(Greeted::Denied | Greeted::Closed) => return,
        Ok(Greeted::Busy) => {
            // Close after the peer's FIN, so the answer is not lost to a
            // reset; the accept loop's hello deadline bounds the wait.
            let _ = wr.shutdown().await;
            let mut sink = [0u8; 4096];
            while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
            return;
        }
        Err(e) => {
            tracing::warn!(%peer, reason = %e, "closing connection: bad hello");
            return;
        }
    }
    shared.connections.fetch_add(1, Ordering::Relaxed);
    serve_frames(rd, wr, peer, &shared, &mut shutdown).await;
    shared.connections.fetch_sub(1, Ordering::Relaxed);
}

/// The frames of an admitted connection, until it ends.
async fn serve_frames(
    mut rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    shutdown: &mut watch::Receiver<bool>,
) {
    let (dead, mut dead_rx) = watch::channel(false);
    let tx = Arc::new(Out {
        w: tokio::sync::Mutex::new(wr),
        dead,
        peer,
        timeout: shared.frame_timeout,
        rdma: std::sync::Mutex::new(None),
    });
    let inflight = Arc::new(tokio::sync::Semaphore::new(MAX_INFLIGHT_PER_CONN));
    let mut draining_until: Option<Instant> = None;
    // Far enough to never fire when idle connections are kept forever.
    let idle = shared.idle_timeout.unwrap_or(Duration::from_secs(100 * 365 * 86_400));
    loop {
        // Waiting for the next frame is the only point where shutdown cuts in:
        // a frame that has begun is read and answered. After the signal, the
        // frames the peer already sent are still taken (each must start
        // within DRAIN_GAP, all within DRAIN_MAX), so a pipelining client
        // gets an answer for everything it sent before the node stopped.
        let next = async {
            match draining_until {
                None => tokio::select! {
                    biased;
                    _ = crate::server::stopped(shutdown) => Next::Shutdown,
                    // A response could not be written: stop reading too.
                    _ = crate::server::stopped(&mut dead_rx) => Next::Close,
                    r = rd.fill_buf() => Next::read(r),
                    // Nothing arrived for `idle`: close unless requests are
                    // still being answered (then the connection is busy).
                    _ = tokio::time::sleep(idle) => {
                        if inflight.available_permits() == MAX_INFLIGHT_PER_CONN {
                            tracing::debug!(%peer, "closing an idle connection");
                            Next::Close
                        } else {
                            Next::Busy
                        }
                    },
                },
                Some(deadline) if Instant::now() >= deadline => Next::Close,
                Some(deadline) => {
                    let gap = DRAIN_GAP.min(deadline.saturating_duration_since(Instant::now()));
                    match tokio::time::timeout(gap, rd.fill_buf()).await {
                        Ok(r) => Next::read(r),
                        Err(_) => Next::Close,
                    }
                }
            }
        };
        match next.await {
            Next::Shutdown => {
                draining_until = Some(Instant::now() + DRAIN_MAX);
                continue;
            }
            Next::Busy => continue,
            Next::Close => break,
            Next::Frame => {}
            Next::Failed(e) => {
                tracing::debug!(%peer, error = %e, "read failed");
                break;
            }
        }
        let Ok(permit) = inflight.clone().acquire_owned().await else { break };
        if let Err(e) = read_request(&mut rd, &tx, shared, permit).await {
            match e {
                ConnError::Io(ref io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                    tracing::debug!(%peer, "peer closed inside a frame")
                }
                e => tracing::warn!(%peer, reason = %e, "closing connection"),
            }
            break;
        }
    }
    // Let requests in flight finish and their answers go out, then close.
    let _ = inflight.acquire_many(MAX_INFLIGHT_PER_CONN as u32).await;
    tx.close().await;
}

/// How a hello ended (each but an error was answered).
enum Greeted {
    Accepted,
    /// A missing or wrong token: the caller closes.
    Denied,
    /// The node is at its connection cap: the caller closes gracefully.
    Busy,
    /// The connection was closed before it could be admitted: no answer.
    Closed,
}

/// The hello (docs/PROTOCOL.md §1): agrees on a version, checks the auth
/// token, then takes one of the node's connection slots (a client that may
/// connect but finds none is told "busy").
async fn handshake(
    rd: &mut BufReader<OwnedReadHalf>,
    wr: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    shared: &Shared,
    peer: SocketAddr,
    opening: &kv_common::listen::Opening,
) -> Result<Greeted, ConnError> {
    let deadline = Instant::now() + shared.frame_timeout;
    let mut h = [0u8; HELLO_LEN];
    read_exact_by(rd, &mut h, deadline).await?;
    let hello = Hello::decode(&h)?;
    let (version, token_len) = match ClientHello::judge(&hello) {
        ClientHello::Speak { version, token_len } => (version, token_len),
        ClientHello::Unsupported(v) => {
            // Name our newest version: an older client cannot use it, a
            // newer one says hello again in it.
            let reply = Hello { version: WIRE_VERSION, status: HELLO_VERSION_REFUSED, max_record: 0 };
            wr.write_all(&reply.encode()).await?;
            wr.flush().await?;
            return Err(WireError::Version(v).into());
        }
        ClientHello::TokenTooLong(_) => return Err(WireError::Malformed("hello (token over 1024 bytes)").into()),
    };
    let mut offered = vec![0u8; token_len];
    read_exact_by(rd, &mut offered, deadline).await?;
    let allowed = match &shared.token {
        None => true,
        // A v1 hello carries no token: a node with a token refuses it (the
        // client then says hello in v2).
        Some(t) => version >= 2 && t.matches(&offered),
    };
    use kv_common::listen::Admission;
    let greeted = match allowed {
        false => Greeted::Denied,
        true => match opening.admit() {
            Admission::Admitted => Greeted::Accepted,
            Admission::Full => Greeted::Busy,
            // Closed to make room, or the node is stopping: no answer.
            Admission::Closed => return Ok(Greeted::Closed),
        },
    };
    let reply = match greeted {
        Greeted::Accepted => Hello { version, status: HELLO_ACCEPTED, max_record: shared.limits.max_record },
        // A refused v1 client is told the version that carries a token (the
        // previous release's client then prints "node speaks protocol v2").
        Greeted::Denied => Hello { version: WIRE_VERSION, status: HELLO_DENIED, max_record: shared.limits.max_record },
        Greeted::Busy => Hello { version: WIRE_VERSION, status: HELLO_BUSY, max_record: 0 },
        Greeted::Closed => return Ok(Greeted::Closed),
    };
    wr.write_all(&reply.encode()).await?;
    wr.flush().await?;
    match greeted {
        Greeted::Denied => {
            shared.denied.fetch_add(1, Ordering::Relaxed);
            log_denied(shared, peer, version, token_len > 0);
        }
        Greeted::Busy => {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            log_busy(peer);
        }
        Greeted::Accepted if version < 2 => {
            shared.v1_accepted.fetch_add(1, Ordering::Relaxed);
        }
        Greeted::Accepted | Greeted::Closed => {}
    }
    Ok(greeted)
}

/// Logs a connection refused at the cap: one line a minute at most.
fn log_busy(peer: SocketAddr) {
    static LOGGED: kv_common::daemon::Throttle = kv_common::daemon::Throttle::new(Duration::from_secs(60));
    if LOGGED.ready() {
        tracing::warn!(%peer, "connection cap reached: refusing connections (--max-conns; one line a minute at most)");
    }
}

/// Logs a refused peer: one line per 10 s at most, with the count of
/// refusals not logged since (a misconfigured fleet cannot flood the log).
fn log_denied(shared: &Shared, peer: SocketAddr, version: u16, had_token: bool) {
    let mut g = shared.denied_log.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    if g.0.is_some_and(|t| now.duration_since(t) < Duration::from_secs(10)) {
        g.1 += 1;
        return;
    }
    let unlogged = std::mem::take(&mut g.1);
    g.0 = Some(now);
    drop(g);
    let why = if had_token { "wrong auth token" } else { "no auth token" };
    tracing::warn!(%peer, protocol = version, unlogged_since_last = unlogged, "refused a client: {why}");
}

async fn read_request(
    rd: &mut BufReader<OwnedReadHalf>,
    tx: &Arc<Out>,
    shared: &Arc<Shared>,
    permit: OwnedSemaphorePermit,
) -> Result<(), ConnError> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    let started = Instant::now();
    read_exact_by(rd, &mut hb, started + shared.frame_timeout).await?;
    let req = ReqHeader::decode(&hb, &shared.limits)?;
    let deadline = started + shared.frame_timeout + frame_allowance(req.body_len);
    if req.op == Op::Put {
        return read_put(rd, tx, shared, req, permit, deadline).await;
    }
    // Memory follows the bytes that arrive, not the length claimed: a peer
    // that announces a 4 MiB batch and dribbles it holds what it sent. Small
    // bodies (every GET, EXIST, DELETE; at most 64 KiB) are read in one go.
    let body = if req.body_len <= wire::MAX_SMALL_BODY {
        let mut body = vec![0u8; req.body_len as usize];
        read_exact_by(rd, &mut body, deadline).await?;
        body
    } else {
        let mut body = Vec::with_capacity(wire::MAX_SMALL_BODY as usize);
        match tokio::time::timeout_at(deadline, (&mut *rd).take(u64::from(req.body_len)).read_to_end(&mut body)).await {
            Ok(Ok(n)) if n == req.body_len as usize => {}
            Ok(Ok(_)) => return Err(ConnError::from(std::io::Error::from(std::io::ErrorKind::UnexpectedEof))),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(ConnError::Timeout),
        }
        body
    };
    let t0 = Instant::now();
    let shared = shared.clone();
    let tx = tx.clone();
    match req.op {
        Op::Get => {
            tokio::spawn(async move {
                let r = handle_get(&shared, &tx, &req, &body).await;
                if req.flags & FLAG_HANDOFF != 0 {
                    shared.handoff.count_asks(1, usize::from(r.status == Status::Ok.to_wire()));
                }
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                drop(permit);
            });
        }
        Op::RdmaConnect => {
            // Creating and connecting a queue pair are system calls.
            tokio::spawn(async move {
                let (s2, tx2) = (shared.clone(), tx.clone());
                let r = tokio::task::spawn_blocking(move || rdma_connect(&s2, &tx2, &req, &body))
                    .await
                    .unwrap_or_else(|_| error_response(&req, Status::Internal, "internal error"));
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                drop(permit);
            });
        }
        Op::Delete => {
            // Delete appends to the index journal: a syscall, so off the reactor.
            tokio::spawn(async move {
                let r = match wire::decode_key(&body) {
                    Ok(k) => {
                        // The tombstone first: a handoff copy stored meanwhile
                        // is then removed by this delete or by itself.
                        shared.handoff.deleted(kv_common::page::key_hash(k));
                        let (store, k) = (shared.store.clone(), k.to_vec());
                        // Blocking-pool work waits for an I/O slot like a get does.
                        let _io = shared.io_slots.acquire().await.expect("semaphore open");
                        match tokio::task::spawn_blocking(move || store.delete(&k)).await {
                            Ok(true) => respond(&req, Status::Ok, 0, Body::Empty),
                            Ok(false) => respond(&req, Status::Miss, 0, Body::Empty),
                            Err(_) => error_response(&req, Status::Internal, "internal error"),
                        }
                    }
                    Err(e) => error_response(&req, Status::BadRequest, &e.to_string()),
                };
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                drop(permit);
            });
        }
        _ => match handle_small(&shared, &req, &body) {
            Some(r) => {
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                drop(permit);
            }
            None => {
                // An index lock was busy (a put, a checkpoint copy) or the op
                // must take locks: answer from the blocking pool instead of
                // making the reactor wait.
                tokio::spawn(async move {
                    let s2 = shared.clone();
                    let r = {
                        // Blocking-pool work waits for an I/O slot like a get does.
                        let _io = shared.io_slots.acquire().await.expect("semaphore open");
                        tokio::task::spawn_blocking(move || handle_blocking(&s2, &req, &body))
                            .await
                            .unwrap_or_else(|_| error_response(&req, Status::Internal, "internal error"))
                    };
                    let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                    drop(permit);
                });
            }
        },
    }
    Ok(())
}

async fn read_put(
    rd: &mut BufReader<OwnedReadHalf>,
    tx: &Arc<Out>,
    shared: &Arc<Shared>,
    req: ReqHeader,
    permit: OwnedSemaphorePermit,
    deadline: Instant,
) -> Result<(), ConnError> {
    let len = req.body_len as usize;
    let rdma = req.flags & FLAG_RDMA != 0;
    // Validate the page header before taking memory for the body.
    let mut head = [0u8; HEADER_LEN];
    let n = len.min(HEADER_LEN);
    read_exact_by(rd, &mut head[..n], deadline).await?;
    let verdict = match PageHeader::decode(&head[..n]) {
        Ok(h) if !rdma && h.record_len() == len as u64 => Ok(h),
        Ok(_) if !rdma => Err("record length disagrees with the frame length".to_string()),
        // An RDMA put carries the header, the key and a segment list.
        Ok(h) => match (len - HEADER_LEN).checked_sub(usize::from(h.key_len)) {
            Some(s)
                if (2 + bootstrap::SEGMENT_LEN..=2 + bootstrap::SEGMENT_LEN * bootstrap::MAX_SEGMENTS).contains(&s) =>
            {
                Ok(h)
            }
            _ => Err("RDMA put body is not header, key and segment list".to_string()),
        },
        Err(e) => Err(e.to_string()),
    };
    let h = match verdict {
        Ok(h) => h,
        Err(msg) => {
            // Skip the rest of the frame; the connection stays usable.
            let mut rest = (len - n) as u64;
            let mut sink = [0u8; 8192];
            while rest > 0 {
                let k = rest.min(sink.len() as u64) as usize;
                read_exact_by(rd, &mut sink[..k], deadline).await?;
                rest -= k as u64;
            }
            let r = error_response(&req, Status::BadRequest, &format!("invalid record: {msg}"));
            let _ = tx.send(counted(shared, req.op, Instant::now(), r)).await;
            return Ok(());
        }
    };
    if rdma {
        return read_put_rdma(rd, tx, shared, req, permit, deadline, head, h).await;
    }
    let units = (len as u64).div_ceil(4096).max(1) as u32;
    let mem = shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
    // Waiting for memory is the node's doing, not the peer's: the body's
    // time starts now.
    let deadline = deadline.max(Instant::now() + shared.frame_timeout + frame_allowance(req.body_len));
    let mut buf = shared.store.pool().get(len);
    buf.full_mut()[..HEADER_LEN].copy_from_slice(&head);
    read_body_by(rd, &mut buf.full_mut()[HEADER_LEN..len], deadline).await?;
    buf.set_len(len);
    let t0 = Instant::now();
    let shared = shared.clone();
    let tx = tx.clone();
    tokio::spawn(store_put(shared, tx, req, buf, mem, permit, t0));
    Ok(())
}

/// The rest of an RDMA put: key and segments arrive on the connection, the
/// payload is read from the client's memory by RDMA READ into the record's
/// buffer (no copy), then stored as any put. Without a working queue pair
/// the answer says so (RSP_FLAG_RDMA_FAILED) and the client sends the
/// payload inline.
#[allow(clippy::too_many_arguments)]
async fn read_put_rdma(
    rd: &mut BufReader<OwnedReadHalf>,
    tx: &Arc<Out>,
    shared: &Arc<Shared>,
    req: ReqHeader,
    permit: OwnedSemaphorePermit,
    deadline: Instant,
    head: [u8; HEADER_LEN],
    h: PageHeader,
) -> Result<(), ConnError> {
    let mut rest = vec![0u8; req.body_len as usize - HEADER_LEN];
    read_exact_by(rd, &mut rest, deadline).await?;
    let key_len = usize::from(h.key_len);
    let segs = match bootstrap::decode_segments(&rest[key_len..]) {
        Ok(s) if s.iter().map(|s| u64::from(s.len)).sum::<u64>() == h.payload_len => s,
        Ok(_) => {
            let r = error_response(&req, Status::BadRequest, "RDMA put: segments do not add up to the payload length");
            let _ = tx.send(counted(shared, req.op, Instant::now(), r)).await;
            return Ok(());
        }
        Err(e) => {
            let r = error_response(&req, Status::BadRequest, &e.to_string());
            let _ = tx.send(counted(shared, req.op, Instant::now(), r)).await;
            return Ok(());
        }
    };
    let record_len = h.record_len();
    if record_len > shared.limits.max_record {
        let r = error_response(&req, Status::Rejected, "record over the node's --max-record");
        let _ = tx.send(counted(shared, req.op, Instant::now(), r)).await;
        return Ok(());
    }
    let t0 = Instant::now();
    let shared = shared.clone();
    let tx = tx.clone();
    tokio::spawn(async move {
        let Some(link) = tx.link() else {
            let r = rdma_failed(&req, "no RDMA queue pair on this connection");
            let _ = tx.send(counted(&shared, req.op, t0, r)).await;
            return;
        };
        let units = record_len.div_ceil(4096).max(1) as u32;
        let mem = shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
        let len = record_len as usize;
        let pre = HEADER_LEN + key_len;
        let mut buf = shared.store.pool().get(len);
        buf.full_mut()[..HEADER_LEN].copy_from_slice(&head);
        buf.full_mut()[HEADER_LEN..pre].copy_from_slice(&rest[..key_len]);
        let addr = buf.full_mut().as_mut_ptr() as usize + pre;
        // The device writes into the buffer: it is kept in the cell (and, if
        // the transfer fails, by the engine until the queue pair is gone).
        let cell = Arc::new(std::sync::Mutex::new(Some(buf)));
        match link.transfer(WrOp::Read, addr, len - pre, &segs, cell.clone()).await {
            Ok(()) => match take_buf(&cell) {
                Some(mut buf) => {
                    buf.set_len(len);
                    store_put(shared, tx, req, buf, mem, permit, t0).await;
                }
                // Nothing else takes it; should that change, an error, not a panic.
                None => {
                    let r = error_response(&req, Status::Internal, "internal error: put buffer gone");
                    let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                }
            },
            Err(e) => {
                tracing::warn!(peer = %tx.peer, error = %e, "RDMA read of a put failed; the client sends it over TCP");
                tx.drop_link(&link);
                let r = rdma_failed(&req, &e.to_string());
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
            }
        }
    });
    Ok(())
}

/// The put's buffer back from the cell the device wrote through (no lock
/// guard lives on past this call, so none is held across an await).
fn take_buf(cell: &std::sync::Mutex<Option<PooledBuf>>) -> Option<PooledBuf> {
    cell.lock().unwrap_or_else(|e| e.into_inner()).take()
}

fn rdma_failed(req: &ReqHeader, why: &str) -> Response {
    respond(req, Status::Unavailable, RSP_FLAG_RDMA_FAILED, Body::Bytes(format!("rdma: {why}").into_bytes()))
}

/// Sets up the connection's queue pair (docs/PROTOCOL.md, RDMA_CONNECT).
fn rdma_connect(shared: &Shared, tx: &Out, req: &ReqHeader, body: &[u8]) -> Response {
    let answer = match Endpoint::decode_request(body) {
        Err(bootstrap::BootstrapError::Version { .. }) => {
            shared.rdma_counters.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
            Answer::VersionRefused(bootstrap::BOOTSTRAP_VERSION)
        }
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
        Ok(remote) => match shared.rdma.as_ref().filter(|rt| !rt.is_off()) {
            None => {
                shared.rdma_counters.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
                match shared.rdma_counters.fallback_reason() {
                    Some(why) if shared.rdma.is_some() => Answer::NotOffered(why),
                    _ => Answer::NotOffered(shared.rdma_off.clone()),
                }
            }
            Some(rt) => {
                let depth = u32::from(remote.depth).min(shared.rdma_depth);
                match rt.link(rt.rail_for(&remote), depth).and_then(|l| l.connect(&remote).map(|()| l)) {
                    Ok(link) => {
                        let mut local = link.local().clone();
                        local.depth = depth as u16;
                        if remote.reads.is_none() {
                            // A client of the previous release: answered in
                            // its version (1), without the read limits.
                            local.reads = None;
                        }
                        tracing::debug!(peer = %tx.peer, device = %local.device, qpn = local.qpn, remote_qpn = remote.qpn, "RDMA queue pair connected");
                        *tx.rdma.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(link));
                        Answer::Accepted(local)
                    }
                    Err(e) => {
                        tracing::warn!(peer = %tx.peer, error = %e, "cannot set up an RDMA queue pair");
                        shared.rdma_counters.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
                        Answer::SetupFailed(e)
                    }
                }
            }
        },
    };
    respond(req, Status::Ok, 0, Body::Bytes(answer.encode()))
}

/// Stores a received record and answers the put.
async fn store_put(
    shared: Arc<Shared>,
    tx: Arc<Out>,
    req: ReqHeader,
    buf: PooledBuf,
    mem: OwnedSemaphorePermit,
    permit: OwnedSemaphorePermit,
    t0: Instant,
) {
    {
        if shared.draining.load(Ordering::Relaxed) {
            let r = error_response(&req, Status::Rejected, "the node is draining (shutting down): it takes no puts");
            let _ = tx.send(counted(&shared, req.op, t0, r)).await;
            return;
        }
        // A handoff copy of a key deleted within the window is refused
        // (handoff.rs); `copy` is its key and payload length.
        let copy = (req.flags & FLAG_HANDOFF != 0).then(|| record_key(buf.as_slice())).flatten();
        if let Some((key, _)) = &copy {
            if shared.handoff.refuses(kv_common::page::key_hash(key)) {
                shared.handoff.refused.fetch_add(1, Ordering::Relaxed);
                let r = error_response(&req, Status::Rejected, COPY_OF_DELETED);
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                return;
            }
        }
        let store = shared.store.clone();
        // Err: why the put's task failed (a panic), answered as Internal.
        let res: Result<Result<PutOutcome, StoreError>, String> = if store.acks_in_memory() {
            // Most puts end in memory (held for a flusher): on this task,
            // without the hop to a blocking thread and back. A record too
            // large to check here, or a disk lock busy now, takes the hop.
            let held = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.try_put_held(buf)));
            match held {
                Ok(Ok(Held::Done(r))) => Ok(r),
                Ok(Ok(Held::ToMedia(p))) => {
                    let _io = shared.io_slots.acquire().await.expect("semaphore open");
                    tokio::task::spawn_blocking(move || store.put_to_media(p)).await.map_err(|e| e.to_string())
                }
                Ok(Err(buf)) => {
                    let _io = shared.io_slots.acquire().await.expect("semaphore open");
                    tokio::task::spawn_blocking(move || store.put(buf)).await.map_err(|e| e.to_string())
                }
                Err(_) => Err("a put panicked".to_string()),
            }
        } else {
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            tokio::task::spawn_blocking(move || store.put(buf)).await.map_err(|e| e.to_string())
        };
        drop(mem);
        if let (Some((key, len)), Ok(Ok(stored))) = (&copy, &res) {
            // Only what this copy stored is taken out again: a duplicate is
            // a page put after the delete (or one the delete removes itself).
            if *stored == PutOutcome::Stored && shared.handoff.refuses(kv_common::page::key_hash(key)) {
                // Deleted while it was being stored: take it out again.
                let (store, k) = (shared.store.clone(), key.clone());
                let _ = tokio::task::spawn_blocking(move || store.delete(&k)).await;
                shared.handoff.refused.fetch_add(1, Ordering::Relaxed);
                let r = error_response(&req, Status::Rejected, COPY_OF_DELETED);
                let _ = tx.send(counted(&shared, req.op, t0, r)).await;
                drop(permit);
                return;
            }
            shared.handoff.copies.fetch_add(1, Ordering::Relaxed);
            shared.handoff.copy_bytes.fetch_add(*len, Ordering::Relaxed);
        }
        let r = match res {
            Ok(Ok(PutOutcome::Stored)) => respond(&req, Status::Ok, 0, Body::Empty),
            Ok(Ok(PutOutcome::Duplicate)) => respond(&req, Status::Ok, RSP_FLAG_DUPLICATE, Body::Empty),
            Ok(Err(e)) => error_response(&req, store_error_status(&e), &e.to_string()),
            Err(e) => {
                tracing::error!(error = %e, "put task failed");
                error_response(&req, Status::Internal, "internal error")
            }
        };
        let _ = tx.send(counted(&shared, req.op, t0, r)).await;
        drop(permit);
    }
}

/// Answers a get hit: by RDMA into the request's segments when it asked so
/// and the connection's queue pair works (the body then holds the header
/// and key only), else with the whole record inline.
async fn answer_hit(
    tx: &Out,
    req: &ReqHeader,
    rec: Arc<PooledBuf>,
    segs: &[Segment],
    budget: Option<OwnedSemaphorePermit>,
) -> Response {
    let inline = |rec: Arc<PooledBuf>, budget| {
        let mut r = respond(req, Status::Ok, 0, Body::Record(rec));
        r.budget = budget;
        r
    };
    if segs.is_empty() {
        return inline(rec, budget);
    }
    let Some(link) = tx.link() else { return inline(rec, budget) };
    let Ok(h) = PageHeader::decode(rec.as_slice()) else { return inline(rec, budget) };
    let pre = HEADER_LEN + usize::from(h.key_len);
    let payload = &rec.as_slice()[pre..];
    let room: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
    if payload.len() as u64 > room {
        // As over TCP: the caller learns the size it needs.
        return respond(req, Status::TooSmall, 0, Body::Bytes(rec.as_slice()[..pre].to_vec()));
    }
    let (addr, n) = (payload.as_ptr() as usize, payload.len());
    match link.transfer(WrOp::Write, addr, n, segs, rec.clone()).await {
        Ok(()) => respond(req, Status::Ok, RSP_FLAG_RDMA, Body::Bytes(rec.as_slice()[..pre].to_vec())),
        Err(e) => {
            tracing::warn!(peer = %tx.peer, error = %e, "RDMA write of a get failed; answering over TCP");
            tx.drop_link(&link);
            inline(rec, budget)
        }
    }
}

async fn handle_get(shared: &Arc<Shared>, tx: &Out, req: &ReqHeader, body: &[u8]) -> Response {
    let (segs, body) = if req.flags & FLAG_RDMA != 0 {
        match bootstrap::split_segments(body) {
            Ok(s) => s,
            Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
        }
    } else {
        (Vec::new(), body)
    };
    let kr = match KeyRequest::decode(body) {
        Ok(k) => k,
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
    };
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    let geo = kr.geometry;
    // A page in the memory tier is answered here, without a hop to the
    // blocking pool (its buffer is shared, not copied; it is bounded by
    // --mem-cap, not by the in-flight budget).
    match shared.store.get_cached(kr.key, check.then_some(&geo)) {
        Some(GetOutcome::Hit(rec)) => return answer_hit(tx, req, rec, &segs, None).await,
        Some(GetOutcome::Mismatch) => return respond(req, Status::Mismatch, 0, Body::Empty),
        _ => {}
    }
    // The record's bytes count against --max-inflight until written out.
    // Its size comes from the index without blocking this reactor thread
    // behind a put, an eviction or a checkpoint holding the index lock.
    let size = match shared.store.try_record_size(kr.key) {
        Some(s) => s,
        None => {
            let (store, key) = (shared.store.clone(), kr.key.to_vec());
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            tokio::task::spawn_blocking(move || store.record_size(&key)).await.unwrap_or(None)
        }
    };
    let Some(size) = size else {
        shared.store.count_miss();
        return respond(req, Status::Miss, 0, Body::Empty);
    };
    let units = size.div_ceil(4096).clamp(1, shared.limits.max_record.div_ceil(4096)) as u32;
    let budget = shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
    let key = kr.key.to_vec();
    let store = shared.store.clone();
    let res = {
        let _io = shared.io_slots.acquire().await.expect("semaphore open");
        tokio::task::spawn_blocking(move || store.get(&key, check.then_some(&geo))).await
    };
    match res {
        Ok(GetOutcome::Hit(rec)) => answer_hit(tx, req, rec, &segs, Some(budget)).await,
        Ok(GetOutcome::Mismatch) => respond(req, Status::Mismatch, 0, Body::Empty),
        Ok(GetOutcome::Miss) => respond(req, Status::Miss, 0, Body::Empty),
        Err(e) => {
            tracing::error!(error = %e, "get task failed");
            error_response(req, Status::Internal, "internal error")
        }
    }
}

/// Why a handoff copy is refused (REJECTED).
const COPY_OF_DELETED: &str = "handoff copy of a key deleted within the handoff window";

/// Counts a handoff ask's keys (EXIST, BATCH_EXIST with FLAG_HANDOFF).
fn count_handoff(shared: &Shared, req: &ReqHeader, found: &[Presence]) {
    if req.flags & FLAG_HANDOFF != 0 {
        let hits = found.iter().filter(|p| matches!(p, Presence::Present)).count();
        shared.handoff.count_asks(found.len(), hits);
    }
}

/// The key of a received record and its payload length (None: not a
/// record; the store refuses it with the reason).
fn record_key(rec: &[u8]) -> Option<(Vec<u8>, u64)> {
    let h = PageHeader::decode(rec).ok()?;
    let key = rec.get(HEADER_LEN..HEADER_LEN + usize::from(h.key_len))?;
    Some((key.to_vec(), h.payload_len))
}

fn presence_status(p: Presence) -> Status {
    match p {
        Presence::Present => Status::Ok,
        Presence::Mismatch => Status::Mismatch,
        Presence::Absent => Status::Miss,
    }
}

/// Requests answered from memory alone, inline on the reactor; None when
/// that would mean waiting for a lock (then [`handle_blocking`] answers).
fn handle_small(shared: &Shared, req: &ReqHeader, body: &[u8]) -> Option<Response> {
    let store = &shared.store;
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    Some(match req.op {
        Op::Exist => match KeyRequest::decode(body) {
            Ok(kr) => {
                let p = store.try_exist(kr.key, check.then_some(&kr.geometry))?;
                count_handoff(shared, req, std::slice::from_ref(&p));
                store.warm(&[kr.key], std::slice::from_ref(&p));
                respond(req, presence_status(p), 0, Body::Empty)
            }
            Err(e) => error_response(req, Status::BadRequest, &e.to_string()),
        },
        Op::BatchExist => match wire::decode_batch_exist(body) {
            Ok((geo, keys)) => {
                let found = store.try_exist_batch(&keys, check.then_some(&geo))?;
                count_handoff(shared, req, &found);
                store.warm(&keys, &found);
                let st: Vec<Status> = found.into_iter().map(presence_status).collect();
                respond(req, Status::Ok, 0, Body::Bytes(wire::encode_batch_status(&st)))
            }
            Err(e) => error_response(req, Status::BadRequest, &e.to_string()),
        },
        Op::Ping => respond(req, Status::Ok, 0, Body::Bytes(body.to_vec())),
        Op::Stats => return None,
        Op::Put | Op::Get | Op::Delete | Op::RdmaConnect => error_response(req, Status::Internal, "misrouted op"),
    })
}

/// The same requests, allowed to wait for locks (blocking pool only).
fn handle_blocking(shared: &Shared, req: &ReqHeader, body: &[u8]) -> Response {
    let store = &shared.store;
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    match req.op {
        Op::Exist => match KeyRequest::decode(body) {
            Ok(kr) => {
                let p = store.exist(kr.key, check.then_some(&kr.geometry));
                count_handoff(shared, req, std::slice::from_ref(&p));
                store.warm(&[kr.key], std::slice::from_ref(&p));
                respond(req, presence_status(p), 0, Body::Empty)
            }
            Err(e) => error_response(req, Status::BadRequest, &e.to_string()),
        },
        Op::BatchExist => match wire::decode_batch_exist(body) {
            Ok((geo, keys)) => {
                let found: Vec<Presence> = keys.iter().map(|k| store.exist(k, check.then_some(&geo))).collect();
                count_handoff(shared, req, &found);
                store.warm(&keys, &found);
                let st: Vec<Status> = found.into_iter().map(presence_status).collect();
                respond(req, Status::Ok, 0, Body::Bytes(wire::encode_batch_status(&st)))
            }
            Err(e) => error_response(req, Status::BadRequest, &e.to_string()),
        },
        Op::Stats => {
            let json = serde_json::to_vec(&*shared.stats()).unwrap_or_default();
            respond(req, Status::Ok, 0, Body::Bytes(json))
        }
        _ => handle_small(shared, req, body).unwrap_or_else(|| error_response(req, Status::Internal, "misrouted op")),
    }
}
