//! The framing of a data connection (docs/PROTOCOL.md §2): reading frames
//! by a deadline, the write half every request's task answers through, and
//! the responses themselves. What the frames mean is [`crate::ops`]; the
//! connection's life (hello, read loop, drain) is [`crate::conn`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kv_common::status::Status;
use kv_common::wire::{ReqHeader, RspHeader, WireError, FRAME_HEADER_LEN};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::store::PooledBuf;

/// Time allowed for the hello, for a frame once its first byte arrived (plus
/// [`frame_allowance`] for its body), and for a response to be taken: the
/// default of [`Shared::frame_timeout`].
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// Extra time a frame's body may take: one second per MiB (a peer slower
/// than 1 MiB/s is treated as stuck).
pub fn frame_allowance(body_len: u32) -> Duration {
    Duration::from_secs(u64::from(body_len) >> 20)
}
pub enum Body {
    Empty,
    Bytes(Vec<u8>),
    Record(Arc<PooledBuf>),
    /// A body in pieces, written in order with vectored writes (a batch
    /// answer: item heads and the records themselves, never copied).
    Parts(Vec<Part>),
}

/// A piece of a [`Body::Parts`].
pub enum Part {
    Bytes(Vec<u8>),
    Record(Arc<PooledBuf>),
}

impl Part {
    fn as_slice(&self) -> &[u8] {
        match self {
            Part::Bytes(b) => b,
            Part::Record(r) => r.as_slice(),
        }
    }
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::Empty => 0,
            Body::Bytes(b) => b.len(),
            Body::Record(r) => r.len(),
            Body::Parts(p) => p.iter().map(|p| p.as_slice().len()).sum(),
        }
    }
}

pub struct Response {
    header: [u8; FRAME_HEADER_LEN],
    /// The wire status in `header` (for the request counters).
    pub status: u8,
    body: Body,
    /// The share of `--max-inflight` this response's body holds until written.
    pub budget: Option<OwnedSemaphorePermit>,
}

pub fn respond(req: &ReqHeader, status: Status, flags: u16, body: Body) -> Response {
    let len = body.len();
    let h = RspHeader { status, op: req.op as u8, flags, body_len: len as u32, req_id: req.req_id };
    Response { header: h.encode(), status: status.to_wire(), body, budget: None }
}

impl Response {
    /// This answer as one item of a batch answer: its status, its flags
    /// and its body (a message, or nothing).
    pub fn into_item(self) -> (Status, u16, Vec<u8>) {
        let flags = u16::from_le_bytes([self.header[2], self.header[3]]);
        let body = match self.body {
            Body::Bytes(b) => b,
            Body::Empty | Body::Record(_) | Body::Parts(_) => Vec::new(),
        };
        (Status::from_wire(self.status), flags, body)
    }
}

pub fn error_response(req: &ReqHeader, status: Status, msg: &str) -> Response {
    respond(req, status, 0, Body::Bytes(msg.as_bytes().to_vec()))
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out inside a frame")]
    Timeout,
}

pub async fn read_exact_by(
    rd: &mut BufReader<OwnedReadHalf>,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), ConnError> {
    match tokio::time::timeout_at(deadline, rd.read_exact(buf)).await {
        Ok(r) => r.map(|_| ()).map_err(ConnError::from),
        Err(_) => Err(ConnError::Timeout),
    }
}

/// Fills `buf` by `deadline` like [`read_exact_by`], but past the bytes
/// already buffered it reads straight from the socket into `buf`: a page's
/// body then costs no copy out of the read buffer (which otherwise takes
/// every read shorter than its 64 KiB capacity, the whole of a small page).
pub async fn read_body_by(
    rd: &mut BufReader<OwnedReadHalf>,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), ConnError> {
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
pub struct Out {
    w: tokio::sync::Mutex<BufWriter<OwnedWriteHalf>>,
    dead: watch::Sender<bool>,
    pub peer: SocketAddr,
    /// [`crate::server::Shared::frame_timeout`].
    timeout: Duration,
}

impl Out {
    /// The write half of a connection to `peer`; `dead` is set once a
    /// response cannot be written (the reader then stops too).
    pub fn new(w: BufWriter<OwnedWriteHalf>, dead: watch::Sender<bool>, peer: SocketAddr, timeout: Duration) -> Out {
        Out { w: tokio::sync::Mutex::new(w), dead, peer, timeout }
    }
}

/// A connection's response buffer: smaller responses are written from it,
/// larger bodies straight from their own buffer.
pub const WRITE_BUFFER: usize = 64 * 1024;

/// Writes all of `a` then `b` with vectored writes.
async fn write_all_vectored(w: &mut OwnedWriteHalf, mut a: &[u8], mut b: &[u8]) -> std::io::Result<()> {
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
    /// Writes `r` (dropped unsent once the connection is dead).
    pub async fn send(&self, r: Response) {
        if *self.dead.borrow() {
            return;
        }
        let len = r.body.len();
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
                Body::Parts(parts) => {
                    if len >= WRITE_BUFFER {
                        // What is buffered first, then header and pieces
                        // straight from their buffers, many a system call.
                        w.flush().await?;
                        let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
                        all.push(&r.header);
                        all.extend(parts.iter().map(Part::as_slice));
                        kv_common::io::write_all_parts(w.get_mut(), &all).await?;
                    } else {
                        w.write_all(&r.header).await?;
                        for p in parts {
                            w.write_all(p.as_slice()).await?;
                        }
                    }
                    return w.flush().await;
                }
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

    /// Flushes what is buffered and sends the FIN.
    pub async fn close(&self) {
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

/// TCP keepalive on a client socket: a peer host that vanished (crash,
/// partition) is found out after about 60 + 3 x 10 s of silence, and its
/// connection slot freed, even with requests in flight.
pub fn keepalive(stream: &TcpStream) {
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
