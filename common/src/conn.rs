//! A blocking data-plane connection (docs/PROTOCOL.md §2: the hello, then
//! frames answered by request id, several in flight at once), on the
//! request driver every client shares ([`crate::driver`]), and a bounded
//! pool of them keyed by node address.
//!
//! The node's drain push (docs/ARCHITECTURE.md, "Draining") sends its pages
//! through these; anything else that talks to nodes from plain threads can
//! share them. Every read and write has a deadline (`io_timeout`), so a hung
//! peer costs its caller that long at most, never a thread for good.

use std::collections::VecDeque;
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use crate::driver::{self, block_on, Blocking, Socket};
use crate::status::Status;
use crate::wire::{self, Hello, HelloVerdict, Op, HELLO_LEN, WIRE_VERSION};

/// Largest answer body read from a node (a STATS body, an error message,
/// a GET's record up to `max_record` is asked for by the caller).
pub const MAX_SMALL_ANSWER: u32 = 1 << 20;

/// One answer read from a connection.
#[derive(Debug)]
pub struct Answer {
    pub req_id: u64,
    pub status: Status,
    pub flags: u16,
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as text (a node's error message), cut to a log line.
    pub fn message(&self) -> String {
        let s = String::from_utf8_lossy(&self.body);
        s.chars().take(200).collect()
    }
}

/// A connection to one node, hello done: the request driver's connection
/// ([`driver::Conn`]) over a blocking socket, with what a pool needs to
/// know of it.
pub struct DataConn {
    link: driver::Conn<Blocking>,
    addr: String,
    /// The id of the last request sent (answers name one at most this).
    last_id: u64,
    in_flight: usize,
    /// An I/O error or an answer out of step happened: the stream's
    /// framing can no longer be trusted (a pool closes it).
    broken: bool,
    /// Taken from a pool's idle list (its node may have closed it since).
    pub reused: bool,
    /// The tenant the node bound it to at the hello (0: the credential's).
    tenant: u32,
}

fn err(msg: String) -> io::Error {
    io::Error::other(msg)
}

impl DataConn {
    /// Connects to `addr` and says hello (this release's protocol, with `token`).
    pub fn connect(
        addr: &str,
        token: Option<&[u8]>,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> io::Result<DataConn> {
        DataConn::connect_for(addr, token, 0, connect_timeout, io_timeout)
    }

    /// As [`DataConn::connect`], acting for `tenant` (not 0: `token` is a
    /// node's or an admin's). A node that does not bind the connection to
    /// it (an earlier release) is an error of kind `Unsupported`: nothing
    /// is sent that it would keep as the credential's tenant's.
    pub fn connect_for(
        addr: &str,
        token: Option<&[u8]>,
        tenant: u32,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> io::Result<DataConn> {
        let sa = addr.to_socket_addrs()?.next().ok_or_else(|| err(format!("{addr} resolves to no address")))?;
        let s = TcpStream::connect_timeout(&sa, connect_timeout)?;
        s.set_nodelay(true)?;
        let mut socket = Blocking::new(s, io_timeout)?;
        let mut hb = [0u8; HELLO_LEN];
        block_on(async {
            socket.write_parts(&[&wire::client_hello_for(WIRE_VERSION, token, tenant)]).await?;
            socket.read_exact(&mut hb).await
        })?;
        let reply = Hello::decode(&hb).map_err(|e| err(format!("{addr}: {e}")))?;
        if tenant != 0 && reply.status == wire::HELLO_ACCEPTED {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{addr} does not take pages for a tenant (an earlier release)"),
            ));
        }
        match wire::judge_hello(WIRE_VERSION, &reply) {
            HelloVerdict::Accepted { max_record } => Ok(DataConn {
                link: driver::Conn::new(socket, max_record, WIRE_VERSION),
                addr: addr.to_string(),
                last_id: 0,
                in_flight: 0,
                broken: false,
                reused: false,
                tenant,
            }),
            HelloVerdict::Denied => Err(err(format!("{addr} refused this node's auth token"))),
            HelloVerdict::Retry(v) => Err(err(format!("{addr} speaks protocol v{v} only"))),
            HelloVerdict::Refused(why) => Err(err(format!("{addr}: {why}"))),
        }
    }

    /// The node's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The largest record the node takes in a PUT.
    pub fn max_record(&self) -> u64 {
        self.link.max_record()
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Sets the deadline of each read and write from now on.
    pub fn set_io_timeout(&mut self, d: Duration) -> io::Result<()> {
        self.link.socket.set_timeouts(d)
    }

    fn broke<T>(&mut self, r: io::Result<T>) -> io::Result<T> {
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    /// Sends one request whose body is `parts` in order; `copy_age` is the
    /// header's age of a handoff copy ([`wire::encode_copy_age`], 0
    /// otherwise; docs/PROTOCOL.md). Returns its id.
    pub fn send(&mut self, op: Op, flags: u8, copy_age: u16, parts: &[&[u8]]) -> io::Result<u64> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if u32::try_from(len).is_err() {
            // Refused before a byte is written: the connection stays usable.
            return Err(err(format!("a body of {len} bytes does not fit a frame")));
        }
        let sent = block_on(self.link.send(op, flags, copy_age, parts));
        let req_id = self.broke(sent)?;
        self.last_id = req_id;
        self.in_flight += 1;
        Ok(req_id)
    }

    /// Reads the next answer (any of those in flight), its body at most
    /// `max_body` bytes (more: the connection is out of step, an error).
    pub fn recv(&mut self, max_body: u32) -> io::Result<Answer> {
        if self.in_flight == 0 {
            return Err(err("no request in flight to answer".into()));
        }
        let got = block_on(self.link.recv_header(0));
        let r = self.broke(got)?;
        if r.body_len > max_body || r.req_id == 0 || r.req_id > self.last_id {
            let e = err(format!("{}: an answer out of step (id {}, {} bytes)", self.addr, r.req_id, r.body_len));
            return self.broke(Err(e));
        }
        let got = block_on(self.link.recv_body(&r, max_body));
        let body = self.broke(got)?;
        self.in_flight -= 1;
        Ok(Answer { req_id: r.req_id, status: r.status, flags: r.flags, body })
    }
}

/// Idle connections kept for reuse, keyed by node address: at most `max_idle`
/// in all (the least recently returned one is closed past it), so a caller
/// that talks to a thousand nodes in turn holds a bounded number of sockets.
pub struct ConnPool {
    idle: Mutex<VecDeque<DataConn>>,
    max_idle: usize,
    token: Option<Vec<u8>>,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl ConnPool {
    pub fn new(max_idle: usize, token: Option<&[u8]>, connect_timeout: Duration, io_timeout: Duration) -> ConnPool {
        ConnPool {
            idle: Mutex::new(VecDeque::new()),
            max_idle,
            token: token.map(<[u8]>::to_vec),
            connect_timeout,
            io_timeout,
        }
    }

    /// An idle connection to `addr` (marked `reused`), else a new one.
    pub fn take(&self, addr: &str) -> io::Result<DataConn> {
        self.take_for(addr, 0)
    }

    /// As [`ConnPool::take`], acting for `tenant` ([`DataConn::connect_for`]).
    pub fn take_for(&self, addr: &str, tenant: u32) -> io::Result<DataConn> {
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = idle.iter().rposition(|c| c.addr == addr && c.tenant == tenant) {
                if let Some(mut c) = idle.remove(i) {
                    c.reused = true;
                    return Ok(c);
                }
            }
        }
        DataConn::connect_for(addr, self.token.as_deref(), tenant, self.connect_timeout, self.io_timeout)
    }

    /// A new connection to `addr`, never an idle one (after a reused one
    /// failed: its node may have closed it while it sat idle).
    pub fn fresh(&self, addr: &str) -> io::Result<DataConn> {
        self.fresh_for(addr, 0)
    }

    /// As [`ConnPool::fresh`], acting for `tenant`.
    pub fn fresh_for(&self, addr: &str, tenant: u32) -> io::Result<DataConn> {
        self.drop_idle(addr);
        DataConn::connect_for(addr, self.token.as_deref(), tenant, self.connect_timeout, self.io_timeout)
    }

    /// Gives a connection back for reuse; one with answers still owed, or
    /// one that failed, is closed instead (its stream is out of step for
    /// the next user).
    pub fn give(&self, c: DataConn) {
        if c.in_flight > 0 || c.broken || self.max_idle == 0 {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push_back(c);
        while idle.len() > self.max_idle {
            idle.pop_front();
        }
    }

    /// Closes the idle connections to `addr`.
    pub fn drop_idle(&self, addr: &str) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).retain(|c| c.addr != addr);
    }

    /// Idle connections held now.
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ReqHeader, RspHeader, FRAME_HEADER_LEN};
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A node stand-in on loopback: accepts `conns` connections, answers
    /// the hello, then every request with OK echoing its id.
    fn echo_node(conns: usize) -> (String, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            for _ in 0..conns {
                let (mut s, _) = l.accept().unwrap();
                let mut h = [0u8; HELLO_LEN];
                s.read_exact(&mut h).unwrap();
                s.write_all(&Hello { version: 2, status: 0, max_record: 1 << 20 }.encode()).unwrap();
                loop {
                    let mut rb = [0u8; FRAME_HEADER_LEN];
                    if s.read_exact(&mut rb).is_err() {
                        break;
                    }
                    let q = ReqHeader::decode(&rb, &wire::Limits::default()).unwrap();
                    let mut body = vec![0u8; q.body_len as usize];
                    s.read_exact(&mut body).unwrap();
                    let r = RspHeader { status: Status::Ok, op: q.op as u8, flags: 0, body_len: 0, req_id: q.req_id };
                    s.write_all(&r.encode()).unwrap();
                }
            }
        });
        (addr, t)
    }

    #[test]
    fn requests_pipeline_and_connections_are_reused_within_the_cap() {
        let (addr, t) = echo_node(1);
        let pool = ConnPool::new(1, None, Duration::from_secs(2), Duration::from_secs(2));
        let mut c = pool.take(&addr).unwrap();
        assert_eq!(c.max_record(), 1 << 20);
        let ids: Vec<u64> = (0..3).map(|_| c.send(Op::Ping, 0, 7, &[b"ab", b"c"]).unwrap()).collect();
        assert_eq!(c.in_flight(), 3);
        let got: Vec<u64> = (0..3).map(|_| c.recv(MAX_SMALL_ANSWER).unwrap().req_id).collect();
        assert_eq!(got, ids);
        assert!(c.recv(MAX_SMALL_ANSWER).is_err(), "nothing left in flight");
        pool.give(c);
        assert_eq!(pool.idle(), 1);
        let c = pool.take(&addr).unwrap();
        assert!(c.reused);
        drop(c);
        t.join().unwrap();
    }

    #[test]
    fn a_node_that_does_not_act_for_a_tenant_gets_nothing_of_its() {
        // The stand-in answers HELLO_ACCEPTED, as an earlier release does to
        // a hello naming a tenant: refused before any request, as Unsupported.
        let (addr, t) = echo_node(2);
        let pool = ConnPool::new(2, None, Duration::from_secs(2), Duration::from_secs(2));
        let e = pool.take_for(&addr, 7).err().expect("refused");
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("does not take pages for a tenant"), "{e}");
        // The default tenant's connection is as before.
        assert!(pool.take(&addr).is_ok());
        t.join().unwrap();
    }

    #[test]
    fn a_connection_owing_answers_is_not_kept() {
        let (addr, _t) = echo_node(1);
        let pool = ConnPool::new(4, None, Duration::from_secs(2), Duration::from_secs(2));
        let mut c = pool.take(&addr).unwrap();
        c.send(Op::Ping, 0, 0, &[]).unwrap();
        pool.give(c);
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn a_silent_peer_costs_the_io_timeout_at_most() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t0 = std::time::Instant::now();
        let r = DataConn::connect(&addr, None, Duration::from_secs(1), Duration::from_millis(200));
        assert!(r.is_err());
        assert!(t0.elapsed() < Duration::from_secs(5));
        drop(l);
    }
}
