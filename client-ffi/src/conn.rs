//! A connection to a node after the hello: the client's one connection
//! type, over kv-common's request driver (`kv_common::driver`, which numbers
//! requests, writes every frame and reads every answer's bytes) and either
//! socket:
//!
//! - [`Blocking`], a socket driven on the caller's own thread: the tools'
//!   client (kvctl, tests; requests may be pipelined with [`Conn::send`] /
//!   [`Conn::recv`]; the tools' operations that share the core's exchanges,
//!   `put` and `batch_exist`, are in exchange.rs) and the core's small requests (small.rs), which wake
//!   the caller straight from its socket;
//! - [`Async`], a tokio socket: the async core.
//!
//! The exchanges a request makes (exchange.rs) are written once, generic
//! over the socket; on a blocking socket they run with
//! `kv_common::driver::block_on`, one poll on the caller's thread. A
//! connection may also hold its reach into the node for payloads that do
//! not travel inline (transport.rs; an RDMA queue pair, rdma.rs: the async
//! core's only).

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

use kv_common::auth::Token;
use kv_common::driver::{self, block_on, Socket};
use kv_common::page::{parse_record, Geometry, HEADER_LEN};
use kv_common::stats::NodeStats;
use kv_common::status::Status;
use kv_common::wire::{Op, RspHeader, WIRE_VERSION};

use crate::error::OpError;
use crate::hello::{self, Step};

pub use kv_common::driver::Blocking;

/// The async core's socket.
pub type Async = tokio::net::TcpStream;

/// A connection after the hello, over a [`Blocking`] socket (the default)
/// or an [`Async`] one.
pub struct Conn<S = Blocking> {
    pub(crate) link: driver::Conn<S>,
    /// The connection's remote-memory transport once one was set up (None:
    /// every payload of this connection goes inline).
    pub(crate) remote: Option<Box<dyn crate::remote::RemoteMemory>>,
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

impl<S: Socket> Conn<S> {
    fn new(socket: S, max_record: u64, version: u16) -> Conn<S> {
        Conn { link: driver::Conn::new(socket, max_record, version), remote: None }
    }

    /// Whether the node takes batch frames (BATCH_GET) on this connection.
    pub(crate) fn batches(&self) -> bool {
        self.link.version() >= kv_common::wire::WIRE_VERSION_BATCH
    }

    /// Whether the node takes BATCH_PUT and BATCH_DELETE on this connection.
    pub(crate) fn batch_writes(&self) -> bool {
        self.link.version() >= kv_common::wire::WIRE_VERSION_BATCH_WRITE
    }

    /// Whether gets go as BATCH_GET frames here: the node takes them, and
    /// buffers named for the node (if this connection names any) can go in
    /// a batch's items.
    pub(crate) fn batch_gets(&self) -> bool {
        self.batches() && self.remote.as_ref().is_none_or(|r| r.batches())
    }

    /// Whether puts go as BATCH_PUT frames here (as [`Conn::batch_gets`]).
    pub(crate) fn batch_puts(&self) -> bool {
        self.batch_writes() && self.remote.as_ref().is_none_or(|r| r.batches())
    }

    /// Largest record the node accepts (told in its hello).
    pub fn max_record(&self) -> u64 {
        self.link.max_record()
    }

    /// Sends one request frame (header, then each body part): its id.
    pub(crate) async fn request(&mut self, op: Op, flags: u8, copy_age: u16, body: &[&[u8]]) -> Result<u64, OpError> {
        Ok(self.link.send(op, flags, copy_age, body).await?)
    }

    /// Reads the header of the answer to `req_id`, taking up to `ahead`
    /// more bytes with it when they came (its body's first bytes; any of
    /// the next answer's stay buffered for it).
    pub(crate) async fn answer(&mut self, req_id: u64, ahead: usize) -> Result<RspHeader, OpError> {
        Ok(self.link.answer(req_id, ahead).await?)
    }

    /// Reads the body of an answer that is not a record (at most `max` bytes).
    pub(crate) async fn answer_body(&mut self, h: &RspHeader, max: u32) -> Result<Vec<u8>, OpError> {
        Ok(self.link.recv_body(h, max).await?)
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
    /// This connection for the async core: made non-blocking and registered
    /// with the current runtime's reactor (Err outside a runtime), with the
    /// keep-alive the core's own connections have.
    pub(crate) fn into_async(self) -> std::io::Result<Conn<Async>> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(std::io::Error::other("no runtime to register the socket with"));
        }
        let Conn { link, remote } = self;
        let link = link.map_socket(|s| {
            let stream = s.into_stream();
            stream.set_nonblocking(true)?;
            set_keepalive(&stream);
            Async::from_std(stream)
        })?;
        Ok(Conn { link, remote })
    }

    /// The socket's descriptor (to wait for several answers at once).
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.link.socket.raw_fd()
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
            let stream = dial(addr, timeout).map_err(&unreachable)?;
            stream.set_nodelay(true)?;
            let mut socket = Blocking::new(stream, timeout)?;
            match block_on(hello::say(&mut socket, version, token))? {
                Step::Done { version, max_record } => return Ok((Conn::new(socket, max_record, version), version)),
                Step::Again(v) => version = v,
            }
        }
        Err(hello::unsettled())
    }

    /// Bounds the exchange that starts now by `io` (kv_common::driver::Blocking::bound).
    pub(crate) fn bound(&mut self, io: Duration) -> Result<(), OpError> {
        Ok(self.link.socket.bound(io)?)
    }

    /// Sends one request frame (header, then each body part); returns its id.
    pub fn send(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<u64, OpError> {
        self.send_aged(op, flags, 0, body)
    }

    /// As [`Conn::send`], with a handoff copy's age in the header
    /// (`kv_common::wire::encode_copy_age`).
    pub fn send_aged(&mut self, op: Op, flags: u8, copy_age: u16, body: &[&[u8]]) -> Result<u64, OpError> {
        block_on(self.request(op, flags, copy_age, body))
    }

    /// Reads the next response frame.
    pub fn recv(&mut self) -> Result<Reply, OpError> {
        block_on(async {
            let header = self.link.recv_header(0).await?;
            let max = self.link.max_record().max(16 << 20).min(u64::from(u32::MAX)) as u32;
            let body = self.link.recv_body(&header, max).await?;
            Ok(Reply { header, body })
        })
    }

    fn call(&mut self, op: Op, flags: u8, body: &[&[u8]]) -> Result<Reply, OpError> {
        let id = self.send(op, flags, body)?;
        let r = self.recv()?;
        if r.header.req_id != id {
            return Err(OpError::Protocol(format!("answer to request {} while waiting for {id}", r.header.req_id)));
        }
        Ok(r)
    }

    /// The raw record for `key` (no checks beyond the node's).
    pub fn get_record(&mut self, geo: Option<&Geometry>, key: &[u8]) -> Result<(Status, Vec<u8>), OpError> {
        let g = geo.copied().unwrap_or_default();
        let flags = if geo.is_some() { kv_common::wire::FLAG_CHECK_GEOMETRY } else { 0 };
        let r = self.call(Op::Get, flags, &[&kv_common::wire::KeyRequest::encode(&g, key)])?;
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
        let flags = if geo.is_some() { kv_common::wire::FLAG_CHECK_GEOMETRY } else { 0 };
        Ok(self.call(Op::Exist, flags, &[&kv_common::wire::KeyRequest::encode(&g, key)])?.header.status)
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
        self.link.socket.stream()
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
    /// This connection on the caller's thread: taken off the runtime's
    /// reactor and made blocking (its timeouts set by the first bound).
    pub(crate) fn into_blocking(self) -> std::io::Result<Conn<Blocking>> {
        let Conn { link, remote } = self;
        Ok(Conn { link: link.map_socket(|s| Blocking::adopt(s.into_std()?))?, remote })
    }

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
        Ok(match hello::say(&mut stream, version, token).await? {
            Step::Done { version, max_record } => Ok((Conn::new(stream, max_record, version), version)),
            Step::Again(v) => Err(v),
        })
    }
}

/// Turns on TCP keep-alive (idle 30 s) on the socket.
fn set_keepalive(stream: &impl AsRawFd) -> bool {
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
