//! One client connection: the hello, then a loop that reads frames and runs
//! each request as its own task, so one connection can carry several
//! requests at once (the responses carry the request id and may come back in
//! any order). Each request's task writes its own response under the
//! connection's write lock. The frames themselves are [`crate::frame`]; what
//! each request does is [`crate::ops`].
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
use kv_common::wire::{self, Hello, Op, ReqHeader, WireError};
use kv_common::wire::{ClientHello, HELLO_ACCEPTED, HELLO_BUSY, HELLO_DENIED, HELLO_VERSION_REFUSED};
use kv_common::wire::{FLAG_RDMA, FRAME_HEADER_LEN, HELLO_LEN, MAX_SEGMENTS, SEGMENT_LEN, WIRE_VERSION};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::frame::{
    error_response, frame_allowance, keepalive, read_body_by, read_exact_by, ConnError, Out, WRITE_BUFFER,
};
use crate::ops::{self, Payload, Session};
use crate::state::Shared;

pub use crate::frame::FRAME_TIMEOUT;

/// Requests one connection may have in flight.
const MAX_INFLIGHT_PER_CONN: usize = 64;
/// At shutdown: longest wait for the next frame the peer already sent.
const DRAIN_GAP: Duration = Duration::from_millis(200);
/// At shutdown: longest time a connection keeps taking frames.
const DRAIN_MAX: Duration = Duration::from_secs(5);

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
    let tenant = match handshake(&mut rd, &mut wr, &shared, peer, &opening).await {
        Ok(Greeted::Accepted(tenant, _)) => tenant,
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
    };
    shared.connections.fetch_add(1, Ordering::Relaxed);
    serve_frames(rd, wr, peer, tenant, &shared, &mut shutdown).await;
    shared.connections.fetch_sub(1, Ordering::Relaxed);
}

/// The frames of an admitted connection, until it ends.
async fn serve_frames(
    mut rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    peer: SocketAddr,
    tenant: u32,
    shared: &Arc<Shared>,
    shutdown: &mut watch::Receiver<bool>,
) {
    let (dead, mut dead_rx) = watch::channel(false);
    let out = Out::new(wr, dead, peer, shared.frame_timeout);
    let session = Arc::new(Session { out, remote: Default::default(), tenant });
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
                    _ = kv_common::listen::stopped(shutdown) => Next::Shutdown,
                    // A response could not be written: stop reading too.
                    _ = kv_common::listen::stopped(&mut dead_rx) => Next::Close,
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
        if let Err(e) = read_request(&mut rd, &session, shared, permit).await {
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
    session.out.close().await;
}

/// How a hello ended (each but an error was answered).
enum Greeted {
    /// Admitted, bound to this tenant (crate::tenant; 0: the default);
    /// true when it is the one the hello named (a node acting for it).
    Accepted(u32, bool),
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
    // The tenant is the credential's: what the hello's own tenant field
    // says is taken only from a node or admin credential, acting for that
    // tenant (a draining node's push; docs/PROTOCOL.md §2.1).
    let named = if version >= kv_common::wire::WIRE_VERSION_BATCH { hello.max_record as u32 } else { 0 };
    let allowed = match &shared.token {
        None => Some((crate::tenant::DEFAULT, false)),
        // A v1 hello carries no token: a node with a token refuses it (the
        // client then says hello in v2).
        Some(t) => t.get().find(&offered).filter(|_| version >= 2).map(|c| match c.role {
            kv_common::auth::Role::Node | kv_common::auth::Role::Admin if named != 0 => (named, true),
            _ => (c.tenant_id(), false),
        }),
    };
    use kv_common::listen::Admission;
    let greeted = match allowed {
        None => Greeted::Denied,
        Some((tenant, acting)) => match opening.admit() {
            Admission::Admitted => Greeted::Accepted(tenant, acting),
            Admission::Full => Greeted::Busy,
            // Closed to make room, or the node is stopping: no answer.
            Admission::Closed => return Ok(Greeted::Closed),
        },
    };
    let reply = match greeted {
        Greeted::Accepted(_, acting) => Hello {
            version,
            status: if acting { kv_common::wire::HELLO_ACCEPTED_FOR_TENANT } else { HELLO_ACCEPTED },
            max_record: shared.limits.max_record,
        },
        // A refused v1 client is told the newest version, which carries a
        // token (a v1 client then prints "node speaks protocol v3").
        Greeted::Denied => Hello { version: WIRE_VERSION, status: HELLO_DENIED, max_record: shared.limits.max_record },
        Greeted::Busy => Hello { version: WIRE_VERSION, status: HELLO_BUSY, max_record: 0 },
        Greeted::Closed => return Ok(Greeted::Closed),
    };
    // Counted before the answer leaves: a client told "busy" or "denied"
    // that then reads the node's statistics finds its refusal counted.
    match greeted {
        Greeted::Denied => {
            shared.denied.fetch_add(1, Ordering::Relaxed);
            log_denied(shared, peer, version, token_len > 0);
        }
        Greeted::Busy => {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            log_busy(peer);
        }
        Greeted::Accepted(..) if version < 2 => {
            shared.v1_accepted.fetch_add(1, Ordering::Relaxed);
        }
        Greeted::Accepted(..) | Greeted::Closed => {}
    }
    wr.write_all(&reply.encode()).await?;
    wr.flush().await?;
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

/// Reads one request's frame and hands it to its operation.
async fn read_request(
    rd: &mut BufReader<OwnedReadHalf>,
    session: &Arc<Session>,
    shared: &Arc<Shared>,
    permit: OwnedSemaphorePermit,
) -> Result<(), ConnError> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    let started = Instant::now();
    read_exact_by(rd, &mut hb, started + shared.frame_timeout).await?;
    let req = ReqHeader::decode(&hb, &shared.limits)?;
    let deadline = started + shared.frame_timeout + frame_allowance(req.body_len);
    if req.op == Op::Put {
        return read_put(rd, session, shared, req, permit, deadline).await;
    }
    if req.op == Op::BatchPut {
        return read_batch_put(rd, session, shared, req, permit, deadline).await;
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
    ops::dispatch(shared, session, req, body, permit).await;
    Ok(())
}

/// Reads a PUT's frame: the page header first (checked before memory is
/// taken for the body), then either the payload, straight into the
/// record's buffer, or (with FLAG_RDMA) the key and the segments of the
/// client's memory the payload is to be filled from. An inline record
/// takes its first step here ([`ops::put_step`]) and, when that settles it
/// (most memory-acked puts), is answered from this task; otherwise the put
/// goes on in [`ops::put`].
async fn read_put(
    rd: &mut BufReader<OwnedReadHalf>,
    session: &Arc<Session>,
    shared: &Arc<Shared>,
    req: ReqHeader,
    permit: OwnedSemaphorePermit,
    deadline: Instant,
) -> Result<(), ConnError> {
    let len = req.body_len as usize;
    let remote = req.flags & FLAG_RDMA != 0;
    let mut head = [0u8; HEADER_LEN];
    let n = len.min(HEADER_LEN);
    read_exact_by(rd, &mut head[..n], deadline).await?;
    let verdict = match PageHeader::decode(&head[..n]) {
        Ok(h) if !remote && h.record_len() == len as u64 => Ok(h),
        Ok(_) if !remote => Err("record length disagrees with the frame length".to_string()),
        // A put from the client's memory carries the header, the key and a
        // segment list.
        Ok(h) => match (len - HEADER_LEN).checked_sub(usize::from(h.key_len)) {
            Some(s) if (2 + SEGMENT_LEN..=2 + SEGMENT_LEN * MAX_SEGMENTS).contains(&s) => Ok(h),
            _ => Err("RDMA put body is not header, key and segment list".to_string()),
        },
        Err(e) => Err(e.to_string()),
    };
    let h = match verdict {
        Ok(h) => h,
        Err(msg) => {
            // Skip the rest of the frame; the connection stays usable.
            skip(rd, (len - n) as u64, deadline).await?;
            refuse(shared, session, &req, Status::BadRequest, &format!("invalid record: {msg}")).await;
            return Ok(());
        }
    };
    let session = session.clone();
    if !remote {
        let (mut buf, mem) = ops::reserve(shared, len, &head).await;
        // Waiting for memory is the node's doing, not the peer's: the
        // body's time starts now.
        let deadline = deadline.max(Instant::now() + shared.frame_timeout + frame_allowance(req.body_len));
        read_body_by(rd, &mut buf.full_mut()[HEADER_LEN..len], deadline).await?;
        buf.set_len(len);
        let t0 = Instant::now();
        // Most memory-acked puts are answered here, from this task.
        match ops::put_step(shared, session.tenant, &req, buf) {
            ops::PutStep::Done(r) => {
                drop(mem);
                session.out.send(ops::counted(shared, req.op, t0, r)).await;
                drop(permit);
            }
            step => {
                tokio::spawn(ops::put(shared.clone(), session, req, Payload::Stepped(step, mem), permit, t0));
            }
        }
        return Ok(());
    }
    let mut rest = vec![0u8; len - HEADER_LEN];
    read_exact_by(rd, &mut rest, deadline).await?;
    let key_len = usize::from(h.key_len);
    let segs = match wire::remote_put_segments(&h, &rest, MAX_SEGMENTS) {
        Ok(s) => s,
        Err(e) => {
            refuse(shared, &session, &req, Status::BadRequest, &e).await;
            return Ok(());
        }
    };
    if h.record_len() > shared.limits.max_record {
        refuse(shared, &session, &req, Status::Rejected, "record over the node's --max-record").await;
        return Ok(());
    }
    let mut pre = head.to_vec();
    pre.extend_from_slice(&rest[..key_len]);
    let payload = Payload::Remote { pre, segs, record_len: h.record_len() as usize };
    tokio::spawn(ops::put(shared.clone(), session, req, payload, permit, Instant::now()));
    Ok(())
}

/// Reads a BATCH_PUT's frame (docs/PROTOCOL.md §2.5): its count, the
/// frame's share of `--max-inflight` (refused whole when the budget
/// cannot hold it), then each item's head and page header, and its record straight
/// into a buffer of its own. A record that fails its header's checks is
/// that item's refusal; a frame whose items do not fill its body exactly
/// is refused whole (BAD_REQUEST, nothing stored), and the connection
/// stays usable: its length delimits it. Each record takes its first step
/// here ([`crate::batch::put_now`]); a batch all settled is answered from
/// this task, any other goes on in [`crate::batch::put`].
async fn read_batch_put(
    rd: &mut BufReader<OwnedReadHalf>,
    session: &Arc<Session>,
    shared: &Arc<Shared>,
    req: ReqHeader,
    permit: OwnedSemaphorePermit,
    deadline: Instant,
) -> Result<(), ConnError> {
    use crate::batch::PutItem;
    use wire::{PutFrame, BATCH_HEAD, BATCH_ITEM_HEAD};
    let len = u64::from(req.body_len);
    let mut frame = PutFrame::open(len);
    let count = match &mut frame {
        Ok(f) => {
            let mut hb = [0u8; BATCH_HEAD];
            read_exact_by(rd, &mut hb, deadline).await?;
            f.count(&hb)
        }
        Err(why) => Err(*why),
    };
    let count = match count {
        Ok(n) => n,
        Err(why) => {
            skip(rd, frame.map_or(len, |f| f.left()), deadline).await?;
            refuse(shared, session, &req, Status::BadRequest, &format!("malformed batch_put body: {why}")).await;
            return Ok(());
        }
    };
    let mut frame = frame.expect("a frame with a count");
    // The frame's share of --max-inflight: its bytes, and a unit more an
    // item for the rounding of each record's buffer. A frame the whole
    // budget cannot hold is refused whole (its records would pass it).
    let units = len.div_ceil(4096) + count as u64;
    if units > u64::from(shared.inflight_units) {
        skip(rd, frame.left(), deadline).await?;
        let why = format!(
            "batch_put of {len} bytes in {count} items over this node's --max-inflight: send it in smaller frames"
        );
        refuse(shared, session, &req, Status::Rejected, &why).await;
        return Ok(());
    }
    let mut mem = shared.inflight_bytes.clone().acquire_many_owned(units as u32).await.expect("semaphore open");
    // Waiting for memory is the node's doing, not the peer's.
    let deadline = deadline.max(Instant::now() + shared.frame_timeout + frame_allowance(req.body_len));
    let mut items: Vec<PutItem> = Vec::with_capacity(count);
    let mut malformed = None;
    loop {
        match frame.more() {
            Ok(true) => {}
            Ok(false) => break,
            Err(why) => {
                malformed = Some(why);
                break;
            }
        }
        let mut ib = [0u8; BATCH_ITEM_HEAD];
        read_exact_by(rd, &mut ib, deadline).await?;
        let ih = match frame.item(&ib) {
            Ok(ih) => ih,
            Err(why) => {
                malformed = Some(why);
                break;
            }
        };
        // The record's bytes are read (or skipped) here, whatever its verdict.
        let n = ih.record_len as usize;
        if ih.flags & wire::ITEM_RDMA != 0 {
            // The header, key and segments of a payload in the client's memory.
            if !(HEADER_LEN..=MAX_REMOTE_ITEM).contains(&n) {
                skip(rd, n as u64, deadline).await?;
                let why = format!("invalid record: an RDMA item of {n} bytes is not a header, key and segment list");
                items.push(PutItem::Refused(Status::BadRequest, why));
                continue;
            }
            let mut rec = vec![0u8; n];
            read_exact_by(rd, &mut rec, deadline).await?;
            items.push(remote_item(shared, &ih, rec));
            continue;
        }
        let mut head = [0u8; HEADER_LEN];
        let hn = n.min(HEADER_LEN);
        read_exact_by(rd, &mut head[..hn], deadline).await?;
        let verdict = match PageHeader::decode(&head[..hn]) {
            Ok(h) if h.record_len() != n as u64 => Err("record length disagrees with the item's length".to_string()),
            Ok(_) if n as u64 > shared.limits.max_record => Ok(false),
            Ok(_) => Ok(true),
            Err(e) => Err(e.to_string()),
        };
        match verdict {
            Ok(true) => {
                let mut buf = shared.store.pool().get(n);
                buf.full_mut()[..HEADER_LEN].copy_from_slice(&head);
                read_body_by(rd, &mut buf.full_mut()[HEADER_LEN..n], deadline).await?;
                buf.set_len(n);
                let want = (n as u64).div_ceil(4096) as usize;
                let share = mem.split(want.min(mem.num_permits())).expect("within the permit's count");
                items.push(PutItem::Record { flags: ih.flags, copy_age: ih.copy_age, buf, mem: share });
            }
            Ok(false) => {
                skip(rd, (n - hn) as u64, deadline).await?;
                items.push(PutItem::Refused(Status::Rejected, "record over the node's --max-record".into()));
            }
            Err(msg) => {
                skip(rd, (n - hn) as u64, deadline).await?;
                items.push(PutItem::Refused(Status::BadRequest, format!("invalid record: {msg}")));
            }
        }
    }
    if malformed.is_none() {
        malformed = frame.end().err();
    }
    if let Some(why) = malformed {
        skip(rd, frame.left(), deadline).await?;
        drop(items);
        refuse(shared, session, &req, Status::BadRequest, &format!("malformed batch_put body: {why}")).await;
        return Ok(());
    }
    let t0 = Instant::now();
    // Most memory-acked batches are answered here, from this task.
    match crate::batch::put_now(shared, session.tenant, &req, items) {
        Ok(answer) => {
            drop(mem);
            session.out.send(ops::counted(shared, req.op, t0, answer)).await;
            drop(permit);
        }
        Err(items) => {
            tokio::spawn(crate::batch::put(shared.clone(), session.clone(), req, items, mem, permit, t0));
        }
    }
    Ok(())
}

/// Longest BATCH_PUT item naming segments: a header, the longest key and
/// the most segments an item names.
const MAX_REMOTE_ITEM: usize = HEADER_LEN + kv_common::page::MAX_KEY_LEN + 2 + SEGMENT_LEN * wire::MAX_ITEM_SEGMENTS;

/// A BATCH_PUT item with `ITEM_RDMA` (its bytes `rec`: header, key and
/// segment list): the put to fill from the client's memory, or the item's
/// refusal.
fn remote_item(shared: &Shared, ih: &wire::PutItemHead, rec: Vec<u8>) -> crate::batch::PutItem {
    use crate::batch::PutItem;
    let h = match PageHeader::decode(&rec) {
        Ok(h) => h,
        Err(e) => return PutItem::Refused(Status::BadRequest, format!("invalid record: {e}")),
    };
    let segs = match wire::remote_put_segments(&h, &rec[HEADER_LEN..], wire::MAX_ITEM_SEGMENTS) {
        Ok(segs) => segs,
        Err(e) => return PutItem::Refused(Status::BadRequest, format!("invalid record: {e}")),
    };
    if h.record_len() > shared.limits.max_record {
        return PutItem::Refused(Status::Rejected, "record over the node's --max-record".into());
    }
    let mut pre = rec;
    pre.truncate(HEADER_LEN + usize::from(h.key_len));
    PutItem::Remote { flags: ih.flags, copy_age: ih.copy_age, pre, segs, record_len: h.record_len() as usize }
}

/// Reads and drops `n` bytes of a frame by `deadline`.
async fn skip(rd: &mut BufReader<OwnedReadHalf>, mut n: u64, deadline: Instant) -> Result<(), ConnError> {
    let mut sink = [0u8; 8192];
    while n > 0 {
        let k = n.min(sink.len() as u64) as usize;
        read_exact_by(rd, &mut sink[..k], deadline).await?;
        n -= k as u64;
    }
    Ok(())
}

/// Answers a request refused before its operation began.
async fn refuse(shared: &Shared, session: &Session, req: &ReqHeader, status: Status, why: &str) {
    let r = ops::counted(shared, req.op, Instant::now(), error_response(req, status, why));
    session.out.send(r).await;
}
