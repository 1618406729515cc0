//! The membership service's HTTP/JSON API (docs/PROTOCOL.md, "MDS API"):
//! the types on the wire and a small blocking client with failover among
//! MDS replicas, used by kv-server (register, heartbeat), the client
//! library (views) and kvctl.
//!
//! The client speaks plain HTTP/1.1, one request per connection
//! (`Connection: close`), so it needs no HTTP crate and no runtime.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where a group's records live in etcd.
pub const ETCD_ROOT: &str = "/kvcellar/v1/groups/";

/// The longest long-poll an MDS accepts; longer waits are cut to this.
pub const MAX_WAIT_MS: u64 = 60_000;

/// One node as the membership service records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub id: String,
    /// The data-plane address clients and tools dial (`host:port`).
    pub addr: String,
    pub weight: u32,
    /// Where the node serves `/metrics` and its dashboard (`host:port`), if
    /// it does. Not part of the epoch: changing it changes no placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
}

/// A group's member set and the epoch that names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub group: String,
    /// An etcd revision; 0 for a group that never had a member.
    pub epoch: u64,
    /// Sorted by id.
    pub members: Vec<MemberRecord>,
}

/// The body of a register request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub addr: String,
    pub weight: u32,
    /// A token naming this run of the node (new at every start), so the MDS
    /// can tell two nodes given the same id apart. Empty: not checked.
    #[serde(default)]
    pub instance: String,
    /// See [`MemberRecord::metrics_addr`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
}

/// The body of a heartbeat.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    #[serde(default)]
    pub instance: String,
}

/// The answer to register and heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseReply {
    /// The lease's time to live; heartbeat every third of it.
    pub ttl_ms: u64,
    /// True when this replica did not hold the node's lease and took the
    /// node over (granted a new lease, rewrote the record).
    #[serde(default)]
    pub took_over: bool,
    /// The group's epoch after the call (register and deregister only).
    #[serde(default)]
    pub epoch: u64,
}

/// Every non-2xx answer carries this body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// A group or node id: 1..=64 of `[A-Za-z0-9._-]`, so it is safe in etcd
/// keys and URLs as is.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Why an MDS call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MdsError {
    /// The node is not registered (its lease expired or it never was):
    /// register again.
    NotRegistered(String),
    /// The request itself is wrong (4xx); no replica will accept it.
    Rejected(String),
    /// The node id is held by another node (409): two nodes share an id.
    Taken(String),
    /// No replica answered usefully; each reason is listed.
    Unavailable(String),
    /// The call was aborted by [`MdsClient::abort`].
    Aborted,
    /// The MDS refused the auth token (401): missing or wrong for the group.
    Denied(String),
}

impl std::fmt::Display for MdsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MdsError::NotRegistered(m) => write!(f, "not registered: {m}"),
            MdsError::Rejected(m) => write!(f, "rejected: {m}"),
            MdsError::Taken(m) => write!(f, "id taken: {m}"),
            MdsError::Unavailable(m) => write!(f, "no MDS answered: {m}"),
            MdsError::Aborted => write!(f, "aborted"),
            MdsError::Denied(m) => write!(f, "access denied: {m}"),
        }
    }
}

impl std::error::Error for MdsError {}

/// Parses `host:port[,host:port...]` (an `http://` prefix is accepted).
pub fn parse_endpoints(csv: &str) -> Result<Vec<String>, String> {
    let eps: Vec<String> = csv
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("http://").unwrap_or(e).trim_end_matches('/').to_string())
        .collect();
    if eps.is_empty() {
        return Err("no MDS endpoint given (expected host:port[,host:port...])".into());
    }
    for e in &eps {
        let Some((host, port)) = e.rsplit_once(':') else {
            return Err(format!("MDS endpoint {e:?} is not host:port"));
        };
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(format!("MDS endpoint {e:?} is not host:port"));
        }
    }
    Ok(eps)
}

/// A blocking client for a list of MDS replicas. Calls go to the replica
/// that answered last; on a transport error or a 5xx the next one is
/// tried, each at most once per call.
#[derive(Debug)]
pub struct MdsClient {
    endpoints: Vec<String>,
    current: usize,
    /// Connect and per-read timeout (a long-poll adds its wait on top).
    pub timeout: Duration,
    /// The socket of the call in progress, so another thread can abort it.
    in_flight: Arc<Mutex<Option<TcpStream>>>,
    aborted: Arc<std::sync::atomic::AtomicBool>,
    /// Sent as `Authorization: Bearer` on every call.
    token: Option<crate::auth::Token>,
    /// Times a call moved on to the next replica.
    pub failovers: u64,
}

/// Aborts calls of an [`MdsClient`] from another thread.
#[derive(Debug, Clone)]
pub struct AbortHandle {
    in_flight: Arc<Mutex<Option<TcpStream>>>,
    aborted: Arc<std::sync::atomic::AtomicBool>,
}

impl AbortHandle {
    /// Fails the call in progress and every later call with `Aborted`.
    pub fn abort(&self) {
        // Under the lock: a call either sees the flag when it registers its
        // socket, or has registered it and has it shut down here.
        let g = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        self.aborted.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(s) = g.as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl MdsClient {
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> MdsClient {
        MdsClient {
            endpoints,
            current: 0,
            timeout,
            in_flight: Arc::default(),
            aborted: Arc::default(),
            token: None,
            failovers: 0,
        }
    }

    /// Sends `token` with every call (the group's auth token).
    pub fn with_token(mut self, token: Option<crate::auth::Token>) -> MdsClient {
        self.token = token;
        self
    }

    /// From a comma list, see [`parse_endpoints`].
    pub fn from_csv(csv: &str, timeout: Duration) -> Result<MdsClient, String> {
        Ok(MdsClient::new(parse_endpoints(csv)?, timeout))
    }

    /// The replica the next call goes to first.
    pub fn current(&self) -> &str {
        &self.endpoints[self.current]
    }

    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { in_flight: self.in_flight.clone(), aborted: self.aborted.clone() }
    }

    /// The group's view now.
    pub fn view(&mut self, group: &str) -> Result<View, MdsError> {
        self.call_json("GET", &format!("/v1/groups/{group}/view"), None, Duration::ZERO)
    }

    /// The group's view once its epoch is past `after`, or after `wait`
    /// (then the view as it is).
    pub fn wait_view(&mut self, group: &str, after: u64, wait: Duration) -> Result<View, MdsError> {
        let ms = (wait.as_millis() as u64).min(MAX_WAIT_MS);
        let path = format!("/v1/groups/{group}/view?after={after}&wait_ms={ms}");
        self.call_json("GET", &path, None, Duration::from_millis(ms))
    }

    pub fn register(&mut self, group: &str, id: &str, req: &RegisterRequest) -> Result<LeaseReply, MdsError> {
        let body = serde_json::to_vec(req).map_err(|e| MdsError::Rejected(e.to_string()))?;
        self.call_json("POST", &format!("/v1/groups/{group}/members/{id}"), Some(&body), Duration::ZERO)
    }

    pub fn heartbeat(&mut self, group: &str, id: &str, instance: &str) -> Result<LeaseReply, MdsError> {
        let body = serde_json::to_vec(&HeartbeatRequest { instance: instance.to_string() })
            .map_err(|e| MdsError::Rejected(e.to_string()))?;
        self.call_json("POST", &format!("/v1/groups/{group}/members/{id}/heartbeat"), Some(&body), Duration::ZERO)
    }

    /// Removes the node's record, if `instance` (when not empty) holds it.
    pub fn deregister(&mut self, group: &str, id: &str, instance: &str) -> Result<LeaseReply, MdsError> {
        let q = if instance.is_empty() { String::new() } else { format!("?instance={instance}") };
        self.call_json("DELETE", &format!("/v1/groups/{group}/members/{id}{q}"), None, Duration::ZERO)
    }

    fn call_json<T: serde::de::DeserializeOwned>(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        extra: Duration,
    ) -> Result<T, MdsError> {
        let (status, body) = self.call(method, path, body, extra)?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&body)
                .map_err(|e| MdsError::Rejected(format!("{} answered {path} with bad JSON: {e}", self.current())));
        }
        let msg = serde_json::from_slice::<ErrorReply>(&body)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
        if status == 401 {
            Err(MdsError::Denied(msg))
        } else if status == 404 {
            Err(MdsError::NotRegistered(msg))
        } else if status == 409 {
            Err(MdsError::Taken(msg))
        } else {
            Err(MdsError::Rejected(format!("{} answered {status}: {msg}", self.current())))
        }
    }

    /// One request with failover: the status and body of the first replica
    /// that answered below 500.
    pub fn call(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        extra: Duration,
    ) -> Result<(u16, Vec<u8>), MdsError> {
        let mut why = Vec::new();
        for _ in 0..self.endpoints.len() {
            if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(MdsError::Aborted);
            }
            let ep = self.endpoints[self.current].clone();
            match self.request(&ep, method, path, body, extra) {
                Ok((status, reply)) if status < 500 => return Ok((status, reply)),
                Ok((status, reply)) => {
                    let msg = serde_json::from_slice::<ErrorReply>(&reply)
                        .map(|e| e.error)
                        .unwrap_or_else(|_| String::from_utf8_lossy(&reply).into_owned());
                    why.push(format!("{ep}: {status} {msg}"));
                }
                Err(e) => why.push(format!("{ep}: {e}")),
            }
            if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(MdsError::Aborted);
            }
            self.current = (self.current + 1) % self.endpoints.len();
            self.failovers += 1;
        }
        Err(MdsError::Unavailable(why.join("; ")))
    }

    /// One request to one endpoint, no failover: its status and body
    /// whatever they are (probes and tests use it).
    pub fn request(
        &self,
        ep: &str,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        extra: Duration,
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let addr = resolve(ep)?;
        let mut s = TcpStream::connect_timeout(&addr, self.timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.timeout + extra))?;
        s.set_write_timeout(Some(self.timeout))?;
        {
            let mut g = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "aborted"));
            }
            *g = Some(s.try_clone()?);
        }
        let result = exchange(&mut s, ep, method, path, body, self.token.as_ref());
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = None;
        result
    }
}

fn resolve(ep: &str) -> std::io::Result<SocketAddr> {
    ep.to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "resolves to no address"))
}

/// The largest answer accepted (a view of thousands of members fits).
const MAX_REPLY: usize = 16 << 20;

fn exchange(
    s: &mut TcpStream,
    host: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    token: Option<&crate::auth::Token>,
) -> std::io::Result<(u16, Vec<u8>)> {
    let body = body.unwrap_or(b"");
    // A token is visible ASCII (checked when it was read): safe in a header.
    let auth =
        token.map_or(String::new(), |t| format!("Authorization: Bearer {}\r\n", String::from_utf8_lossy(t.as_bytes())));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut reply = Vec::new();
    s.take(MAX_REPLY as u64 + 1).read_to_end(&mut reply)?;
    parse_reply(&reply)
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

/// Status and body of an HTTP/1.1 answer read to its end (public for the
/// fuzz targets).
pub fn parse_reply(reply: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    if reply.len() > MAX_REPLY {
        return Err(bad("answer too large"));
    }
    let split = reply.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("answer cut short"))?;
    let head = std::str::from_utf8(&reply[..split]).map_err(|_| bad("answer head is not text"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next().unwrap_or("").starts_with("HTTP/1.") {
        return Err(bad("not an HTTP answer"));
    }
    let status: u16 = parts.next().and_then(|c| c.parse().ok()).ok_or_else(|| bad("bad status line"))?;
    let mut len = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse::<usize>().ok();
            } else if k.trim().eq_ignore_ascii_case("transfer-encoding") && !v.trim().eq_ignore_ascii_case("identity") {
                return Err(bad("chunked answers are not expected from an MDS"));
            }
        }
    }
    let body = &reply[split + 4..];
    let body = match len {
        Some(n) if body.len() < n => return Err(bad("answer body cut short")),
        Some(n) => &body[..n],
        None => body,
    };
    Ok((status, body.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(parse_endpoints("a:1, http://b:2/").unwrap(), vec!["a:1", "b:2"]);
        assert!(parse_endpoints("").is_err());
        assert!(parse_endpoints("a").unwrap_err().contains("host:port"));
        assert!(parse_endpoints("a:x").is_err());
    }

    #[test]
    fn names() {
        assert!(valid_name("node-1.a_b"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(65)));
    }

    #[test]
    fn replies_parse() {
        let (s, b) = parse_reply(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((s, b.as_slice()), (200, &b"{}"[..]));
        assert!(parse_reply(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{}").is_err());
        assert!(parse_reply(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse_reply(b"HTTP/1.1 200").is_err());
    }

    proptest::proptest! {
        /// Whatever a peer sends back, parsing returns, never panics.
        #[test]
        fn any_reply_parses_or_errs(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
                                    head in 0usize..3) {
            let mut reply = match head {
                0 => b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n".to_vec(),
                1 => b"HTTP/1.1 ".to_vec(),
                _ => Vec::new(),
            };
            reply.extend_from_slice(&bytes);
            let _ = parse_reply(&reply);
        }
    }

    #[test]
    fn dead_endpoints_fail_over_and_report_each() {
        // Two ports nobody listens on (bound, then closed).
        let ports: Vec<u16> =
            (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
        let mut c =
            MdsClient::new(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect(), Duration::from_millis(500));
        match c.view("g") {
            Err(MdsError::Unavailable(m)) => assert_eq!(m.matches("127.0.0.1").count(), 2, "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
