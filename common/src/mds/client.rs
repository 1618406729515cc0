//! The blocking MDS client: hyper's HTTP/1.1 client on a current-thread
//! runtime of its own, so callers stay blocking and need no runtime. It
//! keeps its connection open between calls (a fleet's clients re-poll
//! after every change: without it each would reconnect at the same
//! moment). The types it sends and receives are in the parent module.

use std::sync::Arc;
use std::time::Duration;

use super::*;

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

/// A blocking client for a list of MDS replicas. The first call goes to a
/// replica chosen at random (so a fleet's clients spread over the
/// replicas instead of all taking the first one listed); later calls go to
/// the replica that answered last; on a transport error or a 5xx the next
/// one is tried, each at most once per call.
///
/// HTTP is hyper's client (HTTP/1.1), driven by a runtime of the client's
/// own on the calling thread, so callers need no runtime and a call in
/// progress can be aborted from another thread. Calls reuse the last
/// connection while it is idle for less than [`KEEP_IDLE`] (nodes:
/// [`NODE_KEEP_IDLE`]); a call that
/// finds it closed by the replica before any answer is sent once more on a
/// new connection (the replica never saw it).
#[derive(Debug)]
pub struct MdsClient {
    endpoints: Vec<String>,
    current: usize,
    /// Connect timeout, and the time an answer may take (a long-poll adds
    /// its wait on top).
    pub timeout: Duration,
    /// The runtime that drives calls; Err (why it could not be made, say
    /// no file descriptor left for its epoll) fails each call clearly.
    rt: Result<Option<tokio::runtime::Runtime>, String>,
    /// True once aborted: the call in progress ends and later calls fail.
    abort: Arc<tokio::sync::watch::Sender<bool>>,
    /// Sent as `Authorization: Bearer` on every call.
    token: Option<crate::auth::Token>,
    /// Times a call moved on to the next replica.
    pub failovers: u64,
    /// The connection of the last call, while it may be reused.
    kept: Option<Kept>,
    /// Reuse `kept` while idle for less than this.
    keep_idle: Duration,
}

/// Reuse a connection idle at most this long. Replicas close a connection
/// that sends nothing for 10 s (their header timeout); well inside that, a
/// reused connection is seldom one the replica is closing.
pub const KEEP_IDLE: Duration = Duration::from_secs(5);

/// [`KEEP_IDLE`] of a node's client ([`MdsClient::with_keep_idle`]):
/// replicas keep a connection that opened with a node's call for 30 s, so
/// heartbeats a third of the lease TTL apart (10 s at the default 30 s)
/// reuse it.
pub const NODE_KEEP_IDLE: Duration = Duration::from_secs(20);

type HttpBody = http_body_util::Full<hyper::body::Bytes>;
type HttpConn = hyper::client::conn::http1::Connection<hyper_util::rt::TokioIo<tokio::net::TcpStream>, HttpBody>;

/// An open connection to one replica. Its I/O is driven only during a call
/// (in the call's future), so between calls it costs a socket and nothing
/// else, and dropping it closes the socket at once.
struct Kept {
    ep: String,
    send: hyper::client::conn::http1::SendRequest<HttpBody>,
    /// None once the connection ended (dropped at once: a request queued
    /// on it is then cancelled rather than left waiting).
    conn: Option<std::pin::Pin<Box<HttpConn>>>,
    idle_since: std::time::Instant,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept").field("ep", &self.ep).finish_non_exhaustive()
    }
}

/// How a call on a connection failed.
enum ConnError {
    /// The request was never sent (the connection had ended: on a reused
    /// one, the replica closed it while idle), or it is one that may be
    /// sent again whatever happened to it (a view, a heartbeat).
    Unanswered(std::io::Error),
    /// Anything else: possibly done by the replica, so not sent again.
    Failed(std::io::Error),
}

impl ConnError {
    fn into_io(self) -> std::io::Error {
        match self {
            ConnError::Unanswered(e) | ConnError::Failed(e) => e,
        }
    }
}

/// Aborts calls of an [`MdsClient`] from another thread.
#[derive(Debug, Clone)]
pub struct AbortHandle {
    abort: Arc<tokio::sync::watch::Sender<bool>>,
}

impl AbortHandle {
    /// Fails the call in progress and every later call with `Aborted`.
    pub fn abort(&self) {
        self.abort.send_replace(true);
    }
}

/// A number in `0..n` (0 when `n` is 0), different in every process and
/// call: std's per-instance random hash keys, with the time mixed in. For
/// spreading load (first replicas, re-poll jitter), not for secrets.
pub fn random_below(n: usize) -> usize {
    use std::hash::{BuildHasher, Hasher};
    if n == 0 {
        return 0;
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    (h.finish() % n as u64) as usize
}

/// The largest answer accepted (a view of thousands of members fits).
pub const MAX_REPLY: usize = 16 << 20;

impl MdsClient {
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> MdsClient {
        // A current-thread runtime: it drives a call only while the caller
        // waits for it (name lookups use its blocking pool, started lazily).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map(Some)
            .map_err(|e| format!("cannot start the MDS client's I/O runtime: {e}"));
        MdsClient {
            current: random_below(endpoints.len()),
            endpoints,
            timeout,
            rt,
            abort: Arc::new(tokio::sync::watch::channel(false).0),
            token: None,
            failovers: 0,
            kept: None,
            keep_idle: KEEP_IDLE,
        }
    }

    /// Sends `token` with every call (the group's auth token).
    pub fn with_token(mut self, token: Option<crate::auth::Token>) -> MdsClient {
        self.token = token;
        self
    }

    /// Reuses a connection while idle for less than `idle` (default
    /// [`KEEP_IDLE`]; zero: a new connection per call).
    pub fn with_keep_idle(mut self, idle: Duration) -> MdsClient {
        self.keep_idle = idle;
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
        AbortHandle { abort: self.abort.clone() }
    }

    fn aborted(&self) -> bool {
        *self.abort.borrow()
    }

    /// The group's view now. Every view call names the placement rules
    /// this build knows (`rules=`): a replica refuses (422) a group placed
    /// by another.
    pub fn view(&mut self, group: &str) -> Result<View, MdsError> {
        let path = format!("/v1/groups/{group}/view?rules={}", crate::ring::Placement::known());
        self.call_json("GET", &path, None, Duration::ZERO)
    }

    /// The group's view with an epoch of at least `min_epoch`, unless etcd
    /// itself went back (its data restored from a backup or wiped: its
    /// revisions, hence epochs, restart lower), which is then the answer.
    ///
    /// The plain poll carries `min_epoch=` (docs/PROTOCOL.md §6): a replica
    /// whose held view is older reads etcd. A replica of an earlier release
    /// ignores the parameter and may answer an older view it holds; such an
    /// answer is checked once more with a long-poll holding `min_epoch`
    /// (a millisecond's wait), which replicas answer from etcd when the
    /// view they hold is another.
    pub fn view_at_least(&mut self, group: &str, min_epoch: u64) -> Result<View, MdsError> {
        let rules = crate::ring::Placement::known();
        let path = format!("/v1/groups/{group}/view?min_epoch={min_epoch}&rules={rules}");
        let v: View = self.call_json("GET", &path, None, Duration::ZERO)?;
        if v.epoch >= min_epoch {
            return Ok(v);
        }
        self.wait_view(group, min_epoch, Duration::from_millis(1))
    }

    /// The group's view once its epoch is past `after`, or after `wait`
    /// (then the view as it is).
    pub fn wait_view(&mut self, group: &str, after: u64, wait: Duration) -> Result<View, MdsError> {
        self.long_poll(group, after, wait, false)
    }

    /// As [`MdsClient::wait_view`], but the replica may answer with the
    /// members as a change against `after`'s ([`View::resolve`] applies it).
    pub fn wait_view_delta(&mut self, group: &str, after: u64, wait: Duration) -> Result<View, MdsError> {
        self.long_poll(group, after, wait, true)
    }

    fn long_poll(&mut self, group: &str, after: u64, wait: Duration, delta: bool) -> Result<View, MdsError> {
        let ms = (wait.as_millis() as u64).min(MAX_WAIT_MS);
        let rules = crate::ring::Placement::known();
        let d = if delta { "&delta=1" } else { "" };
        let path = format!("/v1/groups/{group}/view?after={after}&wait_ms={ms}&rules={rules}{d}");
        self.call_json("GET", &path, None, Duration::from_millis(ms))
    }

    /// Sets the group's placement rule (docs/PROTOCOL.md §4): a membership
    /// transition, answered with the epoch that names the group under it.
    pub fn set_placement(&mut self, group: &str, rule: crate::ring::Placement) -> Result<PlacementReply, MdsError> {
        let body = serde_json::to_vec(&PlacementRequest { placement: rule.name().to_string() })
            .map_err(|e| MdsError::Rejected(e.to_string()))?;
        self.call_json("PUT", &format!("/v1/groups/{group}/placement"), Some(&body), Duration::ZERO)
    }

    /// The group's tenants' quotas (docs/DEPLOY.md, "Tenants").
    pub fn quotas(&mut self, group: &str) -> Result<super::QuotasReply, MdsError> {
        self.call_json("GET", &format!("/v1/groups/{group}/tenants"), None, Duration::ZERO)
    }

    /// Sets (`Some(share)`, e.g. `40%` or `200G`) or removes a tenant's
    /// quota (an admin's call); answered with the group's quotas after it.
    pub fn set_quota(
        &mut self,
        group: &str,
        tenant: &str,
        quota: Option<&str>,
    ) -> Result<super::QuotasReply, MdsError> {
        let path = format!("/v1/groups/{group}/tenants/{tenant}");
        match quota {
            Some(q) => {
                let body = serde_json::to_vec(&super::QuotaRequest { quota: q.to_string() })
                    .map_err(|e| MdsError::Rejected(e.to_string()))?;
                self.call_json("PUT", &path, Some(&body), Duration::ZERO)
            }
            None => self.call_json("DELETE", &path, None, Duration::ZERO),
        }
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
        } else if status == 403 {
            Err(MdsError::Forbidden(msg))
        } else if status == 404 {
            Err(MdsError::NotRegistered(msg))
        } else if status == 409 {
            Err(MdsError::Taken(msg))
        } else if status == 422 {
            Err(MdsError::Unsupported(msg))
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
            if self.aborted() {
                return Err(MdsError::Aborted);
            }
            let ep = self.endpoints[self.current].clone();
            match self.request_kept(&ep, method, path, body, extra) {
                Ok((status, reply)) if status < 500 => return Ok((status, reply)),
                Ok((status, reply)) => {
                    let msg = serde_json::from_slice::<ErrorReply>(&reply)
                        .map(|e| e.error)
                        .unwrap_or_else(|_| String::from_utf8_lossy(&reply).into_owned());
                    why.push(format!("{ep}: {status} {msg}"));
                }
                Err(e) => why.push(format!("{ep}: {e}")),
            }
            if self.aborted() {
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
        let mut abort = self.listen_abort()?;
        let req = build_request(ep, method, path, body, self.token.as_ref(), false)?;
        let (connect, answer) = (self.timeout, self.timeout + extra);
        let rt = self.runtime()?;
        rt.block_on(async move {
            // A connection of its own, closed with the call.
            let call = async {
                let mut k = open(ep, connect).await?;
                let (status, reply, _) = on_conn(&mut k, req, false, answer).await.map_err(ConnError::into_io)?;
                Ok((status, reply))
            };
            tokio::select! {
                r = call => r,
                _ = abort.wait_for(|a| *a) => Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "aborted")),
            }
        })
    }
}

impl MdsClient {
    /// The abort signal, for a call about to start (Err: aborted already).
    fn listen_abort(&self) -> std::io::Result<tokio::sync::watch::Receiver<bool>> {
        let mut abort = self.abort.subscribe();
        if *abort.borrow_and_update() {
            return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "aborted"));
        }
        Ok(abort)
    }

    /// The runtime that drives calls, or why there is none.
    fn runtime(&self) -> std::io::Result<&tokio::runtime::Runtime> {
        match &self.rt {
            Ok(Some(rt)) => Ok(rt),
            Ok(None) => Err(std::io::Error::other("the MDS client is closed")),
            Err(e) => Err(std::io::Error::other(e.clone())),
        }
    }

    /// As [`MdsClient::request`], on the kept connection when it is to `ep`
    /// and fresh enough, keeping the connection for the next call.
    fn request_kept(
        &mut self,
        ep: &str,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        extra: Duration,
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let mut abort = self.listen_abort()?;
        // Taken out: a call that fails or is aborted closes it.
        let kept = self.kept.take().filter(|k| {
            k.ep == ep && k.idle_since.elapsed() < self.keep_idle && k.conn.is_some() && !k.send.is_closed()
        });
        let (connect, answer) = (self.timeout, self.timeout + extra);
        let token = self.token.as_ref();
        let req = || build_request(ep, method, path, body, token, true);
        // Calls that may be sent twice: views, and heartbeats (a lease
        // keep-alive; a replica that closed the connection as the request
        // crossed its close, say one of an earlier release that keeps idle
        // connections 10 s, never saw it).
        let again = method == "GET" || path.ends_with("/heartbeat");
        let rt = self.runtime()?;
        let r = rt.block_on(async move {
            let call = async {
                if let Some(mut k) = kept {
                    // A connection the replica closed while it sat idle is
                    // left before anything is sent on it.
                    if still_open(&mut k).await {
                        match on_conn(&mut k, req()?, again, answer).await {
                            Ok((status, reply, reusable)) => return Ok((status, reply, reusable.then_some(k))),
                            // Not sent, or a GET: once more, on a new
                            // connection.
                            Err(ConnError::Unanswered(_)) => {}
                            Err(ConnError::Failed(e)) => return Err(e),
                        }
                    }
                }
                let mut k = open(ep, connect).await?;
                let (status, reply, reusable) =
                    on_conn(&mut k, req()?, again, answer).await.map_err(ConnError::into_io)?;
                Ok((status, reply, reusable.then_some(k)))
            };
            tokio::select! {
                r = call => r,
                _ = abort.wait_for(|a| *a) => Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "aborted")),
            }
        });
        let (status, reply, kept) = r?;
        self.kept = kept.map(|mut k| {
            k.idle_since = std::time::Instant::now();
            k
        });
        Ok((status, reply))
    }
}

/// Whether a kept connection is still open: what arrived on it while it
/// sat idle (a close, say) is read first, so a request is not written to a
/// connection the replica already closed (hyper would send it, then report
/// the close as if the request had been cut short).
async fn still_open(k: &mut Kept) -> bool {
    // One turn of the runtime polls its reactor, which sees the socket's
    // pending events.
    tokio::task::yield_now().await;
    let Some(conn) = k.conn.as_mut() else { return false };
    let open =
        std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(conn.as_mut(), cx).is_pending()))
            .await;
    if !open {
        k.conn = None;
    }
    open && !k.send.is_closed()
}

/// A new connection to `ep` (within `connect`), ready for a request.
async fn open(ep: &str, connect: Duration) -> std::io::Result<Kept> {
    let stream = tokio::time::timeout(connect, tokio::net::TcpStream::connect(ep))
        .await
        .map_err(|_| io_err(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    stream.set_nodelay(true)?;
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| io_err(std::io::ErrorKind::InvalidData, e))?;
    Ok(Kept { ep: ep.to_string(), send, conn: Some(Box::pin(conn)), idle_since: std::time::Instant::now() })
}

/// Sends `req` on `k` and reads the whole answer (within `answer`, at most
/// [`MAX_REPLY`] bytes): its status, its body, and whether the connection
/// may carry another call. `again`: the request may be sent again after
/// any failure before its answer.
async fn on_conn(
    k: &mut Kept,
    req: hyper::Request<HttpBody>,
    again: bool,
    answer: Duration,
) -> Result<(u16, Vec<u8>, bool), ConnError> {
    use http_body_util::BodyExt;
    let aborted = |e: hyper::Error| io_err(std::io::ErrorKind::InvalidData, e);
    let Kept { send, conn, .. } = k;
    let exchange = async {
        let result = async {
            send.ready().await.map_err(|e| ConnError::Unanswered(aborted(e)))?;
            let rsp = send.send_request(req).await.map_err(|e| {
                // Cancelled: the connection ended with the request still
                // queued, unsent.
                if e.is_canceled() || again {
                    ConnError::Unanswered(aborted(e))
                } else {
                    ConnError::Failed(aborted(e))
                }
            })?;
            let status = rsp.status().as_u16();
            let close = rsp
                .headers()
                .get(hyper::header::CONNECTION)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            let body = http_body_util::Limited::new(rsp.into_body(), MAX_REPLY)
                .collect()
                .await
                .map_err(|e| ConnError::Failed(io_err(std::io::ErrorKind::InvalidData, e)))?
                .to_bytes();
            Ok((status, body.to_vec(), !close))
        };
        tokio::pin!(result);
        // The connection's I/O is driven beside the request. Once it ends
        // (the replica closed it, say while it was idle) it is dropped, so
        // a request still queued on it is cancelled at once, and the
        // request's own outcome decides.
        let first = match conn.as_mut() {
            Some(c) => tokio::select! {
                biased;
                r = &mut result => Some(r),
                _ = c.as_mut() => None,
            },
            None => {
                Some(Err(ConnError::Unanswered(io_err(std::io::ErrorKind::ConnectionAborted, "connection closed"))))
            }
        };
        match first {
            Some(r) => r,
            None => {
                *conn = None;
                result.await.map(|(status, reply, _)| (status, reply, false))
            }
        }
    };
    tokio::time::timeout(answer, exchange)
        .await
        .unwrap_or_else(|_| Err(ConnError::Failed(io_err(std::io::ErrorKind::TimedOut, "answer timed out"))))
}

impl Drop for MdsClient {
    /// Without waiting for anything, so a client may be dropped anywhere,
    /// an async context included (dropping a runtime there would panic).
    fn drop(&mut self) {
        self.kept = None;
        if let Ok(rt) = &mut self.rt {
            if let Some(rt) = rt.take() {
                rt.shutdown_background();
            }
        }
    }
}

fn io_err(kind: std::io::ErrorKind, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(kind, e.to_string())
}

fn build_request(
    host: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    token: Option<&crate::auth::Token>,
    keep: bool,
) -> std::io::Result<hyper::Request<HttpBody>> {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if !keep {
        b = b.header(hyper::header::CONNECTION, "close");
    }
    if let Some(t) = token {
        // A token is visible ASCII (checked when it was read): a valid header value.
        let mut v = b"Bearer ".to_vec();
        v.extend_from_slice(t.as_bytes());
        b = b.header(hyper::header::AUTHORIZATION, v);
    }
    let body = hyper::body::Bytes::copy_from_slice(body.unwrap_or(b""));
    b.body(http_body_util::Full::new(body)).map_err(|e| io_err(std::io::ErrorKind::InvalidInput, e))
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

    /// A peer that answers garbage, or closes at once: one clear error each.
    #[test]
    fn a_peer_speaking_something_else_gives_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            for reply in [&b"SSH-2.0-OpenSSH\r\n"[..], b""] {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 1024];
                let _ = std::io::Read::read(&mut s, &mut buf);
                let _ = std::io::Write::write_all(&mut s, reply);
            }
        });
        let c = MdsClient::new(vec![addr.clone()], Duration::from_secs(2));
        for _ in 0..2 {
            let e = c.request(&addr, "GET", "/healthz", None, Duration::ZERO).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        }
        server.join().unwrap();
    }

    /// Calls share one connection; when the replica closed it while it
    /// was idle, the next call (a POST: it was never sent) goes out again
    /// on a new connection and succeeds, with no failover.
    #[test]
    fn calls_reuse_the_connection_and_survive_its_close() {
        use std::io::{BufRead, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let port = l.local_addr().unwrap().port();
        let (returned, two_returned) = std::sync::mpsc::channel::<()>();
        let (closed, one_closed) = std::sync::mpsc::channel::<()>();
        // Connection 1 answers two requests, then (once the client has the
        // second answer) closes without saying so; connection 2 answers
        // one. Each answer is the connection's number and the request's
        // number on it.
        let server = std::thread::spawn(move || {
            for (conn, answers) in [(1, 2), (2, 1)] {
                let (s, _) = l.accept().unwrap();
                let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                let mut w = s;
                for n in 1..=answers {
                    let mut head = String::new();
                    while r.read_line(&mut head).unwrap() > 0 && !head.ends_with("\r\n\r\n") {}
                    assert!(!head.to_ascii_lowercase().contains("connection: close"), "{head}");
                    let body = format!("{{\"epoch\":{conn}{n}}}");
                    write!(w, "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
                }
                if conn == 1 {
                    two_returned.recv().unwrap();
                    drop((r, w));
                    closed.send(()).unwrap();
                }
            }
        });
        let mut c = MdsClient::new(vec![addr], Duration::from_secs(2));
        let mut epochs = Vec::new();
        for (i, method) in ["GET", "GET", "POST"].into_iter().enumerate() {
            if i == 2 {
                returned.send(()).unwrap();
                one_closed.recv().unwrap();
                // Until the client's socket has the FIN (CLOSE_WAIT).
                let t0 = std::time::Instant::now();
                while !close_wait_towards(port) {
                    assert!(t0.elapsed() < Duration::from_secs(10), "the close never reached the client");
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            let (status, body) = c.call(method, "/v1/groups/g/view", Some(b"{}"), Duration::ZERO).unwrap();
            assert_eq!(status, 200);
            epochs.push(json_epoch(&body));
        }
        assert_eq!(epochs, [11, 12, 21], "two calls on the first connection, the third on a new one");
        assert_eq!(c.failovers, 0);
        server.join().unwrap();
    }

    /// Whether a local TCP socket connected to `port` is in CLOSE_WAIT.
    fn close_wait_towards(port: u16) -> bool {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
        table.lines().skip(1).any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[2].ends_with(&format!(":{port:04X}")) && f[3] == "08"
        })
    }

    fn json_epoch(body: &[u8]) -> u64 {
        serde_json::from_slice::<serde_json::Value>(body).unwrap()["epoch"].as_u64().unwrap()
    }

    /// A client dropped inside an async context (a daemon's start-up) does
    /// not panic.
    #[test]
    fn a_client_dropped_in_an_async_context_does_not_panic() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let c = MdsClient::new(vec!["127.0.0.1:1".into()], Duration::from_millis(100));
            drop(c);
        });
    }

    /// A long-poll aborted from another thread ends at once.
    #[test]
    fn a_call_in_progress_is_aborted_from_another_thread() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        // Accepts and never answers.
        let _server = std::thread::spawn(move || {
            let held = l.accept();
            std::thread::sleep(Duration::from_secs(20));
            drop(held);
        });
        let mut c = MdsClient::new(vec![addr], Duration::from_secs(10));
        let h = c.abort_handle();
        let t0 = std::time::Instant::now();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            h.abort();
        });
        assert_eq!(c.wait_view("g", 1, Duration::from_secs(30)), Err(MdsError::Aborted));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        aborter.join().unwrap();
        assert_eq!(c.view("g"), Err(MdsError::Aborted), "later calls fail too");
    }

    #[test]
    fn clients_start_on_replicas_spread_at_random() {
        let eps: Vec<String> = (0..4).map(|i| format!("127.0.0.{}:7480", i + 1)).collect();
        let mut first = [0u32; 4];
        for _ in 0..400 {
            let c = MdsClient::new(eps.clone(), Duration::from_secs(1));
            let i = eps.iter().position(|e| e == c.current()).unwrap();
            first[i] += 1;
        }
        // 100 each expected; below 50 is a binomial tail of about 1e-9.
        assert!(first.iter().all(|&n| n >= 50), "{first:?}");
        assert_eq!(random_below(0), 0);
        assert!((0..1000).all(|_| random_below(3) < 3));
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

    #[test]
    fn a_delta_rebuilds_the_members_and_refuses_another_base() {
        let rec = |id: &str, addr: &str, w: u32| MemberRecord {
            id: id.into(),
            addr: addr.into(),
            weight: w,
            metrics_addr: None,
        };
        let base = vec![rec("a", "h:1", 1), rec("b", "h:2", 1), rec("c", "h:3", 1)];
        let now = vec![rec("a", "h:1", 1), rec("b", "h:2", 2), rec("d", "h:4", 1)];
        let d = ViewDelta::between(7, &base, &now, None);
        assert_eq!((d.put.len(), d.removed.clone(), d.count), (2, vec!["c".to_string()], 3));
        let v = View {
            group: "g".into(),
            epoch: 9,
            members: vec![],
            previous: vec![],
            handoff_ms: None,
            placement: None,
            delta: Some(d),
        };
        let wire = serde_json::to_string(&v).unwrap();
        let back: View = serde_json::from_str(&wire).unwrap();
        assert_eq!(back.clone().resolve(Some((7, &base))).unwrap().members, now);
        assert!(back.clone().resolve(Some((8, &base))).unwrap_err().contains("against epoch 7"));
        assert!(back.clone().resolve(None).is_err());
        // A base that is not what the replica diffed against shows in the count.
        assert!(back.clone().resolve(Some((7, &base[1..]))).unwrap_err().contains("gives 2 members, not the 3"));
        // Same count, other members: the digest tells.
        let other = vec![rec("a", "h:1", 1), rec("b", "h:2", 1), rec("e", "h:9", 1)];
        assert!(back.resolve(Some((7, &other))).is_err());
        let same = View { delta: Some(ViewDelta::between(9, &now, &now, None)), ..v.clone() };
        assert!(serde_json::to_string(&same).unwrap().len() < 160, "an unchanged view is a few bytes");
        assert_eq!(same.resolve(Some((9, &now))).unwrap().members, now);
    }
}
