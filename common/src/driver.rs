//! The request driver every data-plane client shares (docs/ARCHITECTURE.md,
//! "One request pipeline"): a [`Conn`] numbers requests, writes their frames
//! (docs/PROTOCOL.md §2) and reads answers through a small buffer, over a
//! [`Socket`] that is either a tokio stream (the client's async core) or a
//! [`Blocking`] socket driven on the caller's own thread (the client's
//! caller-thread path and tools, the node's drain push).
//!
//! The code above a `Conn` is written once, as `async fn`s generic over the
//! socket. A blocking socket's futures do their system call when they are
//! made and are ready at once, so [`block_on`] runs such an exchange on the
//! calling thread with no runtime and no extra wake-up.
//!
//! Reads go through the connection's buffer of [`READ_AHEAD`] bytes: a read
//! takes whatever the socket has up to what the caller said it may use
//! (a frame header with the page header and key behind it, say), so an
//! answer's heads cost one system call. Bytes read past an answer stay
//! buffered for the next. A payload goes from the socket straight into the
//! caller's buffer once the buffer is empty, so no payload byte is copied
//! twice beyond the few that came with the heads.

use std::future::Future;
use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::wire::{Op, ReqHeader, RspHeader, FRAME_HEADER_LEN};

/// Bytes of a connection's read buffer: an answer's frame header, a batch
/// item's head and a page header with the longest key.
pub const READ_AHEAD: usize = FRAME_HEADER_LEN + 16 + crate::page::HEADER_LEN + crate::page::MAX_KEY_LEN;

/// Largest request body sent as one copied buffer rather than its parts.
const SMALL_FRAME: usize = 4096;

/// A byte stream a [`Conn`] drives. A read of 0 bytes is the peer's end.
pub trait Socket: Send {
    /// Writes every byte of `parts` in order.
    fn write_parts(&mut self, parts: &[&[u8]]) -> impl Future<Output = io::Result<()>> + Send;
    /// Reads some bytes into `dst` (at least one, or 0 at the end).
    fn read_some(&mut self, dst: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send;
    /// Fills all of `dst`.
    fn read_exact(&mut self, dst: &mut [u8]) -> impl Future<Output = io::Result<()>> + Send;
}

impl Socket for tokio::net::TcpStream {
    async fn write_parts(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        if let [one] = parts {
            // std's send, under tokio's write, passes MSG_NOSIGNAL.
            return self.write_all(one).await;
        }
        let mut slices: Vec<io::IoSlice<'_>> =
            parts.iter().filter(|p| !p.is_empty()).map(|p| io::IoSlice::new(p)).collect();
        let mut rest: &mut [io::IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            self.writable().await?;
            let fd = self.as_raw_fd();
            match self.try_io(tokio::io::Interest::WRITABLE, || send_parts(fd, rest)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => io::IoSlice::advance_slices(&mut rest, n),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        AsyncReadExt::read(self, dst).await
    }

    async fn read_exact(&mut self, dst: &mut [u8]) -> io::Result<()> {
        AsyncReadExt::read_exact(self, dst).await.map(|_| ())
    }
}

/// A blocking socket driven on the caller's thread. Its reads end by the
/// deadline set with [`Blocking::bound`] (each read's timeout recomputed,
/// so a peer trickling bytes cannot hold the caller past it), or without
/// one by the socket's own timeouts. Its read and write timeouts are set
/// only when they must change (each setsockopt is a system call).
pub struct Blocking {
    stream: TcpStream,
    read_timeout: Duration,
    write_timeout: Duration,
    /// The current exchange's deadline, the slack a read may end past it
    /// (rather than pay a setsockopt per answer) and the longest timeout.
    deadline: Option<(Instant, Duration, Duration)>,
}

impl Blocking {
    /// Takes a connected stream whose read and write timeouts are `timeout`.
    pub fn new(stream: TcpStream, timeout: Duration) -> io::Result<Blocking> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Blocking { stream, read_timeout: timeout, write_timeout: timeout, deadline: None })
    }

    /// Takes a connected stream whose timeouts are not known (a socket the
    /// async core had): made blocking, its timeouts set by the first
    /// [`Blocking::bound`].
    pub fn adopt(stream: TcpStream) -> io::Result<Blocking> {
        stream.set_nonblocking(false)?;
        Ok(Blocking { stream, read_timeout: Duration::ZERO, write_timeout: Duration::ZERO, deadline: None })
    }

    /// The stream, to be a socket of another kind.
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// The stream (to write raw bytes, or to wait for it with poll).
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// The socket's descriptor.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    /// Bounds the exchange that starts now by `io`: each write by `io`, the
    /// reads by a deadline `io` from now (a read may end up to 1/16 of `io`
    /// past it).
    pub fn bound(&mut self, io: Duration) -> io::Result<()> {
        self.set_write_timeout(io)?;
        self.deadline = Some((Instant::now() + io, io / 16, io));
        Ok(())
    }

    /// Sets the read and write timeouts (and drops the deadline of [`Blocking::bound`]).
    pub fn set_timeouts(&mut self, t: Duration) -> io::Result<()> {
        self.deadline = None;
        if t != self.write_timeout {
            self.stream.set_write_timeout(Some(t))?;
            self.write_timeout = t;
        }
        if t != self.read_timeout {
            self.stream.set_read_timeout(Some(t))?;
            self.read_timeout = t;
        }
        Ok(())
    }

    /// Makes a write give up no earlier than `t` and at most 1/16 of it
    /// later: an exchange's bound shrinks by the microseconds spent before
    /// it, which should not cost a setsockopt a request.
    fn set_write_timeout(&mut self, t: Duration) -> io::Result<()> {
        if t > self.write_timeout || t + t / 16 < self.write_timeout {
            let t = (t + t / 32).max(Duration::from_micros(1));
            self.stream.set_write_timeout(Some(t))?;
            self.write_timeout = t;
        }
        Ok(())
    }

    /// Before a read: Ok(true) when the deadline has passed (the read then
    /// takes only what is there), else the read timeout made to end no
    /// earlier than the deadline and at most the slack after it.
    fn before_read(&mut self) -> io::Result<bool> {
        let Some((deadline, slack, cap)) = self.deadline else { return Ok(false) };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(true);
        }
        if left > self.read_timeout || left + slack < self.read_timeout {
            let t = (left + slack / 2).min(cap).max(left).max(Duration::from_micros(1));
            self.stream.set_read_timeout(Some(t))?;
            self.read_timeout = t;
        }
        Ok(false)
    }

    /// One recv into `dst` with `flags` (MSG_WAITALL, MSG_DONTWAIT): the
    /// bytes read (0 on EINTR), an UnexpectedEof at the peer's end.
    fn recv(&mut self, dst: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
        // SAFETY: the pointer and length are those of `dst`, a live mutable
        // slice the kernel writes at most `dst.len()` bytes of.
        let n = unsafe { libc::recv(self.stream.as_raw_fd(), dst.as_mut_ptr().cast(), dst.len(), flags) };
        match n {
            0 if !dst.is_empty() => Err(io::ErrorKind::UnexpectedEof.into()),
            n if n >= 0 => Ok(n as usize),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    Ok(0)
                } else {
                    Err(timed_out(e))
                }
            }
        }
    }

    /// Some bytes into `dst`, by the deadline: past it only those already
    /// there (an answer that came in time but is read late, behind another
    /// owner's that never came, is still taken).
    fn read_now(&mut self, dst: &mut [u8], all: bool) -> io::Result<usize> {
        loop {
            let late = self.before_read()?;
            let flags = if late {
                libc::MSG_DONTWAIT
            } else if all {
                // The kernel gathers the whole buffer before the call
                // returns (or the timeout or a signal ends it early), so a
                // body that comes in several segments costs one call.
                libc::MSG_WAITALL
            } else {
                0
            };
            let n = self.recv(dst, flags)?;
            if n > 0 {
                return Ok(n);
            }
        }
    }

    fn write_now(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        if let [one] = parts {
            // std's send passes MSG_NOSIGNAL.
            return self.stream.write_all(one).map_err(timed_out);
        }
        let mut slices: Vec<io::IoSlice<'_>> =
            parts.iter().filter(|p| !p.is_empty()).map(|p| io::IoSlice::new(p)).collect();
        let mut rest: &mut [io::IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            match send_parts(self.stream.as_raw_fd(), rest) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => io::IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(timed_out(e)),
            }
        }
        Ok(())
    }
}

/// One vectored send of `slices` (at most 1024 of them, IOV_MAX) on socket
/// `fd` with MSG_NOSIGNAL: a peer that reset the connection is an EPIPE
/// error, never a SIGPIPE that would end a host process that does not
/// ignore it (`writev` has no such flag). The bytes sent.
fn send_parts(fd: std::os::fd::RawFd, slices: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is a valid empty one (null pointers, zero
    // lengths); only its iovec fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix (std's documented
    // guarantee); the kernel only reads through the pointer.
    msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = slices.len().min(1024) as _;
    // SAFETY: `msg` points at `slices`, live for the call, whose iovecs
    // name live buffers the kernel reads at most their lengths of.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A socket timeout reads as TimedOut (the kernel says EAGAIN).
fn timed_out(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock => io::ErrorKind::TimedOut.into(),
        _ => e,
    }
}

impl Socket for Blocking {
    fn write_parts(&mut self, parts: &[&[u8]]) -> impl Future<Output = io::Result<()>> + Send {
        std::future::ready(self.write_now(parts))
    }

    fn read_some(&mut self, dst: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send {
        std::future::ready(if dst.is_empty() { Ok(0) } else { self.read_now(dst, false) })
    }

    fn read_exact(&mut self, dst: &mut [u8]) -> impl Future<Output = io::Result<()>> + Send {
        let mut got = 0;
        let mut r = Ok(());
        while got < dst.len() {
            match self.read_now(&mut dst[got..], true) {
                Ok(n) => got += n,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        std::future::ready(r)
    }
}

/// Wakes a thread parked in [`block_on`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

thread_local! {
    /// The calling thread's waker, made once per thread (no allocation a request).
    static THREAD_WAKER: Waker = Arc::new(Unpark(std::thread::current())).into();
}

/// A waker that unparks the calling thread (for a thread that polls a
/// future by hand and parks while it is pending).
pub fn thread_waker() -> Waker {
    // try_with: during thread teardown the cached one may be gone.
    THREAD_WAKER.try_with(Waker::clone).unwrap_or_else(|_| Arc::new(Unpark(std::thread::current())).into())
}

/// Runs `f` to its end on the calling thread. Over a [`Blocking`] socket
/// every step is ready at once, so this is one poll; anything else that
/// waits parks the thread until it is woken.
pub fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let waker = thread_waker();
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// An answer's body that is not what it should be: the connection's bytes
/// can no longer be trusted.
pub fn out_of_step(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// A connection after the hello: the one place a request frame is written
/// and an answer's bytes are read, over either socket.
pub struct Conn<S> {
    pub socket: S,
    next_id: u64,
    max_record: u64,
    /// The protocol version the hello agreed on.
    version: u16,
    buf: Box<[u8; READ_AHEAD]>,
    at: usize,
    end: usize,
}

impl<S: Socket> Conn<S> {
    pub fn new(socket: S, max_record: u64, version: u16) -> Conn<S> {
        Conn { socket, next_id: 1, max_record, version, buf: Box::new([0u8; READ_AHEAD]), at: 0, end: 0 }
    }

    /// The same connection over another kind of socket made from this one
    /// (`f`), its request ids, version and buffered bytes kept.
    pub fn map_socket<T>(self, f: impl FnOnce(S) -> io::Result<T>) -> io::Result<Conn<T>> {
        let Conn { socket, next_id, max_record, version, buf, at, end } = self;
        Ok(Conn { socket: f(socket)?, next_id, max_record, version, buf, at, end })
    }

    /// The protocol version agreed in the hello.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// Largest record the node accepts (told in its hello).
    pub fn max_record(&self) -> u64 {
        self.max_record
    }

    /// The next request's id and its frame header, with bytes 2..4 set to
    /// `copy_age` (a handoff copy's age, `wire::encode_copy_age`; else 0).
    pub fn header(&mut self, op: Op, flags: u8, copy_age: u16, body_len: usize) -> (u64, [u8; FRAME_HEADER_LEN]) {
        let req_id = self.next_id;
        self.next_id += 1;
        (req_id, ReqHeader { op, flags, copy_age, body_len: body_len as u32, req_id }.encode())
    }

    /// Writes one request frame, its body given as parts in order (with
    /// vectored writes, straight from the caller's buffers): its id.
    pub async fn send(&mut self, op: Op, flags: u8, copy_age: u16, body: &[&[u8]]) -> io::Result<u64> {
        let len: usize = body.iter().map(|b| b.len()).sum();
        if u32::try_from(len).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a body of {len} bytes does not fit a frame"),
            ));
        }
        let (req_id, h) = self.header(op, flags, copy_age, len);
        if len <= SMALL_FRAME {
            // A small frame is copied whole and written with one plain
            // send: cheaper in the kernel than a vectored write.
            let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + len);
            frame.extend_from_slice(&h);
            body.iter().for_each(|b| frame.extend_from_slice(b));
            self.socket.write_parts(&[&frame]).await?;
            return Ok(req_id);
        }
        let mut parts: Vec<&[u8]> = Vec::with_capacity(body.len() + 1);
        parts.push(&h);
        parts.extend_from_slice(body);
        self.socket.write_parts(&parts).await?;
        Ok(req_id)
    }

    /// Writes several request frames (op, flags, body) with one write, in
    /// order: their ids.
    pub async fn send_all(&mut self, frames: &[(Op, u8, &[u8])]) -> io::Result<Vec<u64>> {
        let mut out = Vec::with_capacity(frames.iter().map(|f| FRAME_HEADER_LEN + f.2.len()).sum());
        let mut ids = Vec::with_capacity(frames.len());
        for &(op, flags, body) in frames {
            let (id, h) = self.header(op, flags, 0, body.len());
            out.extend_from_slice(&h);
            out.extend_from_slice(body);
            ids.push(id);
        }
        self.socket.write_parts(&[&out]).await?;
        Ok(ids)
    }

    /// Reads the next answer's frame header, taking up to `ahead` more
    /// bytes with it when the socket has them (what the caller reads next).
    pub async fn recv_header(&mut self, ahead: usize) -> io::Result<RspHeader> {
        self.fill(FRAME_HEADER_LEN, FRAME_HEADER_LEN + ahead).await?;
        let mut b = [0u8; FRAME_HEADER_LEN];
        b.copy_from_slice(&self.buf[self.at..self.at + FRAME_HEADER_LEN]);
        self.at += FRAME_HEADER_LEN;
        Ok(RspHeader::decode(&b))
    }

    /// As [`Conn::recv_header`], for the answer to `req_id` (one request in
    /// flight, or answers in order).
    pub async fn answer(&mut self, req_id: u64, ahead: usize) -> io::Result<RspHeader> {
        let h = self.recv_header(ahead).await?;
        if h.req_id != req_id {
            return Err(out_of_step(format!("answer to request {} while waiting for {req_id}", h.req_id)));
        }
        Ok(h)
    }

    /// The body of an answer that is not a record, read whole (at most `max` bytes).
    pub async fn recv_body(&mut self, h: &RspHeader, max: u32) -> io::Result<Vec<u8>> {
        if h.body_len > max {
            return Err(out_of_step(format!("unexpected {}-byte answer", h.body_len)));
        }
        let mut body = vec![0u8; h.body_len as usize];
        self.exact(&mut body).await?;
        Ok(body)
    }

    /// Has the buffer hold at least `min` bytes (at most its size), reading
    /// up to `want` in all when the socket has them.
    pub async fn fill(&mut self, min: usize, want: usize) -> io::Result<()> {
        let min = min.min(READ_AHEAD);
        let want = want.clamp(min, READ_AHEAD);
        if self.end - self.at >= min {
            return Ok(());
        }
        if self.at > 0 {
            self.buf.copy_within(self.at..self.end, 0);
            (self.end, self.at) = (self.end - self.at, 0);
        }
        while self.end < min {
            let n = self.socket.read_some(&mut self.buf[self.end..want]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.end += n;
        }
        Ok(())
    }

    /// Bytes buffered and not yet taken.
    pub fn buffered(&self) -> usize {
        self.end - self.at
    }

    /// Some bytes into `dst`: from the buffer if it holds any, else one
    /// read straight from the socket.
    pub async fn some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.at < self.end {
            let k = (self.end - self.at).min(dst.len());
            dst[..k].copy_from_slice(&self.buf[self.at..self.at + k]);
            self.at += k;
            return Ok(k);
        }
        match self.socket.read_some(dst).await? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            n => Ok(n),
        }
    }

    /// Fills all of `dst`: what is buffered, then the rest from the socket.
    pub async fn exact(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let k = (self.end - self.at).min(dst.len());
        dst[..k].copy_from_slice(&self.buf[self.at..self.at + k]);
        self.at += k;
        if k < dst.len() {
            self.socket.read_exact(&mut dst[k..]).await?;
        }
        Ok(())
    }

    /// Reads and drops `n` bytes (the rest of an answer not taken, so the
    /// connection stays in step).
    pub async fn skip(&mut self, mut n: u64) -> io::Result<()> {
        let mut sink = [0u8; 8192];
        while n > 0 {
            let k = n.min(sink.len() as u64) as usize;
            self.exact(&mut sink[..k]).await?;
            n -= k as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn answer(id: u64, body: &[u8]) -> Vec<u8> {
        let h = RspHeader { status: Status::Ok, op: 1, flags: 0, body_len: body.len() as u32, req_id: id };
        [&h.encode()[..], body].concat()
    }

    #[test]
    fn answers_read_ahead_stay_buffered_for_the_next_and_a_payload_lands_whole() {
        let (a, mut b) = pair();
        let mut c = Conn::new(Blocking::new(a, Duration::from_secs(5)).unwrap(), 1 << 20, 4);
        let big: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        b.write_all(&[answer(1, b"short"), answer(2, &big)].concat()).unwrap();
        let h = block_on(c.answer(1, READ_AHEAD)).unwrap();
        assert_eq!(block_on(c.recv_body(&h, 64)).unwrap(), b"short");
        assert!(c.buffered() > 0, "the next answer's bytes came with the first");
        let h = block_on(c.answer(2, 0)).unwrap();
        let mut got = vec![0u8; h.body_len as usize];
        block_on(c.exact(&mut got)).unwrap();
        assert_eq!(got, big);
        assert_eq!(c.buffered(), 0);
    }

    #[test]
    fn an_answer_to_another_request_or_a_closed_peer_is_an_error_not_a_hang() {
        let (a, mut b) = pair();
        let mut c = Conn::new(Blocking::new(a, Duration::from_secs(5)).unwrap(), 1 << 20, 4);
        b.write_all(&answer(7, b"")).unwrap();
        let e = block_on(c.answer(1, 0)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        drop(b);
        let e = block_on(c.recv_header(0)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_silent_peer_ends_a_bounded_read_by_its_deadline() {
        let (a, _b) = pair();
        let mut c = Conn::new(Blocking::new(a, Duration::from_secs(30)).unwrap(), 1 << 20, 4);
        c.socket.bound(Duration::from_millis(100)).unwrap();
        let t0 = Instant::now();
        let e = block_on(c.recv_header(0)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    /// A vectored frame to a peer that is gone is an error, not a SIGPIPE:
    /// with the signal's default action (a C host's), the process lives.
    #[test]
    fn a_write_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = pair();
        let mut c = Conn::new(Blocking::new(a, Duration::from_secs(5)).unwrap(), 1 << 20, 4);
        drop(b);
        // SAFETY: signal() with a valid signal number and SIG_DFL / the
        // handler it returned; no handler code of ours runs.
        let before = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let big = vec![7u8; 64 << 10];
        let end = Instant::now() + Duration::from_secs(10);
        let failed = loop {
            match block_on(c.send(Op::Ping, 0, 0, &[&big, &big])) {
                Err(e) => break e,
                Ok(_) => assert!(Instant::now() < end, "writes to a closed peer kept succeeding"),
            }
        };
        // SAFETY: as above, putting the previous disposition back.
        unsafe { libc::signal(libc::SIGPIPE, before) };
        assert!(matches!(failed.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset), "{failed}");
    }

    #[test]
    fn frames_are_numbered_and_written_whole() {
        let (a, mut b) = pair();
        let mut c = Conn::new(Blocking::new(a, Duration::from_secs(5)).unwrap(), 1 << 20, 4);
        let id = block_on(c.send(Op::Ping, 0, 0, &[b"ab", b"", b"c"])).unwrap();
        let ids = block_on(c.send_all(&[(Op::Ping, 0, b"x"), (Op::Ping, 0, b"")])).unwrap();
        assert_eq!((id, ids), (1, vec![2, 3]));
        let mut got = vec![0u8; 3 * FRAME_HEADER_LEN + 4];
        b.read_exact(&mut got).unwrap();
        let h = ReqHeader::decode(got[..FRAME_HEADER_LEN].try_into().unwrap(), &crate::wire::Limits::default());
        assert_eq!(h.unwrap().body_len, 3);
        assert_eq!(&got[FRAME_HEADER_LEN..FRAME_HEADER_LEN + 3], b"abc");
    }
}
