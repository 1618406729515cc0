//! A connection to a node after the hello: the client's one connection type
//! and its framing (docs/PROTOCOL.md §2). [`Conn`] numbers requests, writes
//! their frames and checks that an answer is the one awaited, the same way
//! over either socket it may hold:
//!
//! - [`Blocking`], a socket driven on the caller's own thread: the tools'
//!   client (kvctl, tests; requests may be pipelined with [`Conn::send`] /
//!   [`Conn::recv`]) and the core's small requests (small.rs), which wake
//!   the caller straight from its socket;
//! - [`Async`], a tokio socket: the async core (exchange.rs), which also
//!   keeps the connection's reach into the node for payloads that do not
//!   travel inline (its RDMA queue pair, rdma.rs).
//!
//! The operations a request carries are above this: the tools' here, the
//! core's in exchange.rs and small.rs.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use kv_common::auth::Token;
use kv_common::page::{parse_record, Geometry, PageHeader, HEADER_LEN};
use kv_common::stats::NodeStats;
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, ReqHeader, RspHeader, FLAG_CHECK_GEOMETRY};
use kv_common::wire::{FRAME_HEADER_LEN, RSP_FLAG_DUPLICATE, WIRE_VERSION};

use crate::error::OpError;
use crate::hello::{self, Step};

/// A connection after the hello, over a [`Blocking`] socket (the default)
/// or an [`Async`] one.
pub struct Conn<S = Blocking> {
    pub(crate) socket: S,
    next_id: u64,
    max_record: u64,
    /// The protocol version the hello agreed on.
    version: u16,
}

/// A blocking socket, with its read and write timeouts as last set (each
/// setsockopt is a system call: they are set only when they must change).
pub struct Blocking {
    stream: TcpStream,
    read_timeout: Duration,
    write_timeout: Duration,
}

/// A tokio socket, and the connection's remote-memory transport once one
/// was set up (None: the payloads of this connection go inline).
pub struct Async {
    pub(crate) stream: tokio::net::TcpStream,
    pub(crate) remote: Option<crate::rdma::Remote>,
}

/// A response: header and body.
#[derive(Debug)]
pub struct Reply {
    pub header: RspHeader,
    pub body: Vec<u8>,
}

/// Outcome of a get: a status and, on hit, the payload.
#[derive(Debug, PartialEq, Eq)]
pub enum GetResult {
    Hit(Vec<u8>),
    NotServed(Status),
}

impl<S> Conn<S> {
    fn new(socket: S, max_record: u64, version: u16) -> Conn<S> {
        Conn { socket, next_id: 1, max_record, version }
    }

    /// Whether the node takes batch frames (BATCH_GET) on this connection.
    pub(crate) fn batches(&self) -> bool {
        self.version >= kv_common::wire::WIRE_VERSION_BATCH
    }

    /// Whether the node takes BATCH_PUT and BATCH_DELETE on this connection.
    pub(crate) fn batch_writes(&self) -> bool {
        self.version >= kv_common::wire::WIRE_VERSION_BATCH_WRITE
    }

    /// Largest record the node accepts (told in its hello).
    pub fn max_record(&self) -> u64 {
        self.max_record
    }

    /// The next request's id and its frame header.
    pub(crate) fn header(&mut self, op: Op, flags: u8, body_len: usize) -> (u64, [u8; FRAME_HEADER_LEN]) {
        self.header_aged(op, flags, 0, body_len)
    }

    /// As [`Conn::header`], with bytes 2..4 set: a handoff copy's age
    /// (`kv_common::wire::encode_copy_age`).
    pub(crate) fn header_aged(
        &mut self,
        op: Op,
        flags: u8,
        copy_age: u16,
        body_len: usize,
    ) -> (u64, [u8; FRAME_HEADER_LEN]) {
        let req_id = self.next_id;
        self.next_id += 1;
        (req_id, ReqHeader { op, flags, copy_age, body_len: body_len as u32, req_id }.encode())
    }
}

/// The answer header in `hb`, which must answer request `req_id` (one
/// request in flight at a time on a connection, or answers in order).
pub(crate) fn answer_to(hb: &[u8], req_id: u64) -> Result<RspHeader, OpError> {
    let mut b = [0u8; FRAME_HEADER_LEN];
    b.copy_from_slice(&hb[..FRAME_HEADER_LEN]);
    let h = RspHeader::decode(&b);
    if h.req_id != req_id {
        return Err(OpError::Protocol(format!("answer to request {} while waiting for {req_id}", h.req_id)));
    }
    Ok(h)
}

/// A socket read or write that failed: a timeout, or the I/O error.
pub(crate) fn timeout_or_io(e: std::io::Error) -> OpError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => OpError::Timeout,
        _ => OpError::Io(e),
    }
}

/// Whether a failure on a pooled connection says it was stale (the node
/// closed it while it sat idle): the request may go again on a new one.
pub(crate) fn is_stale(e: &OpError) -> bool {
    matches!(e, OpError::Io(io) if matches!(io.kind(),
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionAborted))
}

impl Conn<Blocking> {
    /// The socket's descriptor (to wait for several answers at once).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.stream.as_raw_fd()
    }

    /// Connects and exchanges hellos, with no auth token. `timeout` bounds
    /// connect and each I/O.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Conn, OpError> {
        Conn::connect_with(addr, timeout, None)
    }

    /// Connects, agrees on a protocol version and presents `token`.
    pub fn connect_with(addr: &str, timeout: Duration, token: Option<&Token>) -> Result<Conn, OpError> {
        let unreachable = |source| OpError::Connect { addr: addr.to_string(), source };
        Conn::<Blocking>::open(addr, timeout, token, WIRE_VERSION, unreachable).map(|(c, _)| c)
    }

    /// Connects to the first of `addr`'s addresses that answers (resolved
    /// now: a name may point elsewhere since the last connection) and says
    /// hello, starting in `version`: the connection and the version agreed.
    /// A failure to reach the node at all becomes `unreachable`'s error.
    pub(crate) fn open(
        addr: &str,
        timeout: Duration,
        token: Option<&Token>,
        mut version: u16,
        unreachable: impl Fn(std::io::Error) -> OpError,
    ) -> Result<(Conn, u16), OpError> {
        for _ in 0..hello::MAX_TRIES {
            let mut stream = dial(addr, timeout).map_err(&unreachable)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
            match hello::say_sync(&mut stream, version, token)? {
                Step::Done { version, max_record } => {
                    let socket = Blocking { stream, read_timeout: timeout, write_timeout: timeout };
                    return Ok((Conn::new(socket, max_record, version), version));
                }
                Step::Again(v) => version = v,
            }
        }
        Err(hello::unsettled())
    }

    /// Sends one request frame (header, then each body part); returns its id.
    pub fn send(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<u64, OpError> {
        self.send_aged(op, flags, 0, body)
    }

    /// As [`Conn::send`], with a handoff copy's age in the header
    /// (`kv_common::wire::encode_copy_age`).
    pub fn send_aged(&mut self, op: Op, flags: u8, copy_age: u16, body: &[&[u8]]) -> Result<u64, OpError> {
        let len: usize = body.iter().map(|b| b.len()).sum();
        let (req_id, h) = self.header_aged(op, flags, copy_age, len);
        self.socket.stream.write_all(&h)?;
        for part in body {
            self.socket.stream.write_all(part)?;
        }
        Ok(req_id)
    }

    /// Reads the next response frame.
    pub fn recv(&mut self) -> Result<Reply, OpError> {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        self.socket.stream.read_exact(&mut hb)?;
        let header = RspHeader::decode(&hb);
        if header.body_len as u64 > self.max_record.max(16 << 20) {
            return Err(OpError::Protocol(format!("response body of {} bytes", header.body_len)));
        }
        let mut body = vec![0u8; header.body_len as usize];
        self.socket.stream.read_exact(&mut body)?;
        Ok(Reply { header, body })
    }

    fn call(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<Reply, OpError> {
        let id = self.send(op, flags, body)?;
        let r = self.recv()?;
        if r.header.req_id != id {
            return Err(OpError::Protocol(format!("answer to request {} while waiting for {id}", r.header.req_id)));
        }
        Ok(r)
    }

    /// Stores `payload` under `key`. Returns Ok(true) when newly stored,
    /// Ok(false) when the key was already there (write-once).
    pub fn put(&mut self, geo: &Geometry, key: &[u8], payload: &[u8]) -> Result<bool, OpError> {
        let h = PageHeader::new(*geo, key, payload.len() as u64, crc32fast::hash(payload));
        self.put_parts(&[&h.encode(), key, payload])
    }

    /// Sends a record given as parts (header, key, payload) without joining them.
    pub fn put_parts(&mut self, parts: &[&[u8]]) -> Result<bool, OpError> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if len > self.max_record {
            // The node would close the connection on such a frame: refuse here.
            let why = format!("record of {len} bytes exceeds the node's limit of {}", self.max_record);
            return Err(OpError::Node(Status::Rejected, why));
        }
        let r = self.call(Op::Put, 0, parts)?;
        match r.header.status {
            Status::Ok => Ok(r.header.flags & RSP_FLAG_DUPLICATE == 0),
            status => Err(OpError::refused(status, &r.body)),
        }
    }

    /// The raw record for `key` (no checks beyond the node's).
    pub fn get_record(&mut self, geo: Option<&Geometry>, key: &[u8]) -> Result<(Status, Vec<u8>), OpError> {
        let g = geo.copied().unwrap_or_default();
        let flags = if geo.is_some() { FLAG_CHECK_GEOMETRY } else { 0 };
        let r = self.call(Op::Get, flags, &[&KeyRequest::encode(&g, key)])?;
        Ok((r.header.status, r.body))
    }

    /// Gets and verifies a page (docs/PROTOCOL.md §3): header, key, geometry, payload CRC.
    pub fn get(&mut self, geo: &Geometry, key: &[u8]) -> Result<GetResult, OpError> {
        let (st, rec) = self.get_record(Some(geo), key)?;
        if st != Status::Ok {
            return Ok(GetResult::NotServed(st));
        }
        Ok(verify(geo, key, &rec))
    }

    pub fn exist(&mut self, geo: Option<&Geometry>, key: &[u8]) -> Result<Status, OpError> {
        let g = geo.copied().unwrap_or_default();
        let flags = if geo.is_some() { FLAG_CHECK_GEOMETRY } else { 0 };
        Ok(self.call(Op::Exist, flags, &[&KeyRequest::encode(&g, key)])?.header.status)
    }

    pub fn batch_exist<K: AsRef<[u8]>>(&mut self, geo: &Geometry, keys: &[K]) -> Result<Vec<Status>, OpError> {
        let r = self.call(Op::BatchExist, FLAG_CHECK_GEOMETRY, &[&wire::encode_batch_exist(geo, keys)])?;
        if r.header.status != Status::Ok {
            return Err(OpError::refused(r.header.status, &r.body));
        }
        let st = wire::decode_batch_status(&r.body).map_err(|e| OpError::Protocol(e.to_string()))?;
        if st.len() != keys.len() {
            return Err(OpError::Protocol("batch answer has the wrong count".into()));
        }
        Ok(st)
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<Status, OpError> {
        Ok(self.call(Op::Delete, 0, &[key])?.header.status)
    }

    pub fn stats(&mut self) -> Result<NodeStats, OpError> {
        let r = self.call(Op::Stats, 0, &[])?;
        serde_json::from_slice(&r.body).map_err(|e| OpError::Protocol(format!("stats: {e}")))
    }

    pub fn ping(&mut self, data: &[u8]) -> Result<Vec<u8>, OpError> {
        Ok(self.call(Op::Ping, 0, &[data])?.body)
    }

    /// Direct access for tests that write raw bytes.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.socket.stream
    }

    /// Writes one request frame whole within `io`: its id.
    pub(crate) fn write_frame(&mut self, op: Op, flags: u8, body: &[u8], io: Duration) -> Result<u64, OpError> {
        self.set_write_timeout(io)?;
        let (req_id, h) = self.header(op, flags, body.len());
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
        frame.extend_from_slice(&h);
        frame.extend_from_slice(body);
        self.socket.stream.write_all(&frame).map_err(timeout_or_io)?;
        Ok(req_id)
    }

    fn set_write_timeout(&mut self, t: Duration) -> std::io::Result<()> {
        if t != self.socket.write_timeout {
            self.socket.stream.set_write_timeout(Some(t))?;
            self.socket.write_timeout = t;
        }
        Ok(())
    }

    /// Makes a read give up no earlier than `left` and at most `slack`
    /// after it. The timeout set is `left + slack/2` (at most `cap`), so the
    /// microseconds by which `left` differs between requests do not cost a
    /// setsockopt each.
    fn set_read_timeout(&mut self, left: Duration, slack: Duration, cap: Duration) -> std::io::Result<()> {
        let s = &mut self.socket;
        if left > s.read_timeout || left + slack < s.read_timeout {
            let t = (left + slack / 2).min(cap).max(left).max(Duration::from_micros(1));
            s.stream.set_read_timeout(Some(t))?;
            s.read_timeout = t;
        }
        Ok(())
    }

    /// Past a read's deadline: the bytes already there, without waiting
    /// (Timeout when none are). An answer that came in time but is read
    /// late, behind another owner's that never came, is still taken; a
    /// peer can make the reader wait no longer.
    fn recv_ready(&mut self, buf: &mut [u8]) -> Result<usize, OpError> {
        // SAFETY: the pointer and length are those of `buf`, a live mutable
        // slice the kernel writes at most `buf.len()` bytes of.
        let n = unsafe {
            libc::recv(self.socket.stream.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
        };
        match n {
            0 => Err(OpError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            n if n > 0 => Ok(n as usize),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    Ok(0)
                } else {
                    Err(timeout_or_io(e))
                }
            }
        }
    }

    /// Fills `buf` by `deadline` (each read's timeout recomputed, so a peer
    /// trickling bytes cannot hold the caller past it).
    pub(crate) fn read_full(
        &mut self,
        buf: &mut [u8],
        deadline: Instant,
        slack: Duration,
        cap: Duration,
    ) -> Result<(), OpError> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                got += self.recv_ready(&mut buf[got..])?;
                continue;
            }
            self.set_read_timeout(left, slack, cap)?;
            let want = &mut buf[got..];
            // MSG_WAITALL: the kernel gathers the whole buffer before the
            // call returns (or the timeout or a signal ends it early, with
            // what came so far), so a body that arrives in several segments
            // costs one call, not one a segment.
            // SAFETY: the pointer and length are those of `want`, a live
            // mutable slice the kernel writes at most `want.len()` bytes of.
            let n = unsafe {
                libc::recv(self.socket.stream.as_raw_fd(), want.as_mut_ptr().cast(), want.len(), libc::MSG_WAITALL)
            };
            match n {
                0 => return Err(OpError::Io(std::io::ErrorKind::UnexpectedEof.into())),
                n if n > 0 => got += n as usize,
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(timeout_or_io(e));
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads at least `min` bytes into `buf`, and whatever more has come
    /// (up to its length): the bytes read.
    pub(crate) fn read_at_least(
        &mut self,
        buf: &mut [u8],
        min: usize,
        deadline: Instant,
        slack: Duration,
        cap: Duration,
    ) -> Result<usize, OpError> {
        let mut got = 0;
        while got < min {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                got += self.recv_ready(&mut buf[got..])?;
                continue;
            }
            self.set_read_timeout(left, slack, cap)?;
            match self.socket.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(OpError::Io(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(timeout_or_io(e)),
            }
        }
        Ok(got)
    }

    /// Reads and discards `n` bytes (the rest of an answer not served, so
    /// the connection stays in step).
    pub(crate) fn skip(
        &mut self,
        mut n: usize,
        deadline: Instant,
        slack: Duration,
        cap: Duration,
    ) -> Result<(), OpError> {
        let mut sink = [0u8; 8192];
        while n > 0 {
            let k = n.min(sink.len());
            self.read_full(&mut sink[..k], deadline, slack, cap)?;
            n -= k;
        }
        Ok(())
    }
}

/// Connects to the first of `addr`'s addresses that answers.
fn dial(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = None;
    for a in crate::members::resolve(addr)? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()))
}

impl Conn<Async> {
    /// Connects to `addr` and says hello in `version`: the connection and the
    /// version agreed, or (Err) the version the node asks for instead (this
    /// connection is then closed). The caller bounds the time.
    pub(crate) async fn open(
        addr: &str,
        token: Option<&Token>,
        version: u16,
    ) -> Result<Result<(Conn<Async>, u16), u16>, OpError> {
        let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(OpError::Io)?;
        stream.set_nodelay(true).map_err(OpError::Io)?;
        // Keep-alive probes notice a peer that vanished without a FIN.
        set_keepalive(&stream);
        Ok(match hello::say_async(&mut stream, version, token).await? {
            Step::Done { version, max_record } => {
                Ok((Conn::new(Async { stream, remote: None }, max_record, version), version))
            }
            Step::Again(v) => Err(v),
        })
    }

    /// Writes all of `parts` with vectored writes.
    pub(crate) async fn write_parts(&mut self, parts: &[&[u8]]) -> Result<(), OpError> {
        Ok(kv_common::io::write_all_parts(&mut self.socket.stream, parts).await?)
    }

    /// Sends one request frame (header, then each body part): its id.
    pub(crate) async fn send(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<u64, OpError> {
        self.send_aged(op, flags, 0, body).await
    }

    /// As [`Conn::send`], with a handoff copy's age in the header.
    pub(crate) async fn send_aged(&mut self, op: Op, flags: u8, copy_age: u16, body: &[&[u8]]) -> Result<u64, OpError> {
        let len: usize = body.iter().map(|b| b.len()).sum();
        let (req_id, h) = self.header_aged(op, flags, copy_age, len);
        let mut parts: Vec<&[u8]> = Vec::with_capacity(body.len() + 1);
        parts.push(&h);
        parts.extend_from_slice(body);
        self.write_parts(&parts).await?;
        Ok(req_id)
    }

    /// Reads the header of the answer to `req_id`.
    pub(crate) async fn recv_header(&mut self, req_id: u64) -> Result<RspHeader, OpError> {
        use tokio::io::AsyncReadExt;
        let mut hb = [0u8; FRAME_HEADER_LEN];
        self.socket.stream.read_exact(&mut hb).await?;
        answer_to(&hb, req_id)
    }

    /// Reads the body of an answer that is not a record (at most `max` bytes).
    pub(crate) async fn recv_small(&mut self, h: &RspHeader, max: u32) -> Result<Vec<u8>, OpError> {
        use tokio::io::AsyncReadExt;
        if h.body_len > max {
            return Err(OpError::Protocol(format!("unexpected {}-byte answer", h.body_len)));
        }
        let mut body = vec![0u8; h.body_len as usize];
        self.socket.stream.read_exact(&mut body).await?;
        Ok(body)
    }
}

/// Turns on TCP keep-alive (idle 30 s) on the socket.
fn set_keepalive(stream: &tokio::net::TcpStream) -> bool {
    let fd = stream.as_raw_fd();
    let on: libc::c_int = 1;
    let idle: libc::c_int = 30;
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: setsockopt on a valid socket descriptor owned by `stream`, with
    // pointers to live c_ints and their exact size.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, &on as *const _ as *const libc::c_void, len) == 0
            && libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_KEEPIDLE,
                &idle as *const _ as *const libc::c_void,
                len,
            ) == 0
    }
}

/// Checks a served record against the request (docs/PROTOCOL.md §3).
pub fn verify(geo: &Geometry, key: &[u8], rec: &[u8]) -> GetResult {
    let Ok((h, k)) = parse_record(rec) else {
        return GetResult::NotServed(Status::Corrupt);
    };
    if k != key || !geo.matches(&h) {
        return GetResult::NotServed(Status::Mismatch);
    }
    let payload = &rec[HEADER_LEN + k.len()..];
    if crc32fast::hash(payload) != h.payload_crc {
        return GetResult::NotServed(Status::Corrupt);
    }
    GetResult::Hit(payload.to_vec())
}
