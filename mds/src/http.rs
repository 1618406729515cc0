//! The MDS HTTP/JSON API (docs/PROTOCOL.md, "MDS API").
//!
//! | method | path                                      | does                         |
//! |--------|-------------------------------------------|------------------------------|
//! | POST   | /v1/groups/{g}/members/{id}               | register (body: addr, weight) |
//! | POST   | /v1/groups/{g}/members/{id}/heartbeat     | keep the lease alive          |
//! | DELETE | /v1/groups/{g}/members/{id}               | deregister                    |
//! | GET    | /v1/groups/{g}/view[?after=N&wait_ms=T]   | the view, or a long-poll      |
//! |        |   [&rules=R][&delta=1][&min_epoch=M]      | (rules known; a change only;  |
//! |        |                                           | a plain poll at least M)      |
//! | PUT    | /v1/groups/{g}/placement                  | set the placement rule        |
//! | GET    | /v1/groups/{g}/tenants                    | the tenants' quotas           |
//! | PUT    | /v1/groups/{g}/tenants/{t}                | set a tenant's quota          |
//! | DELETE | /v1/groups/{g}/tenants/{t}                | remove a tenant's quota       |
//! | GET    | /healthz, /livez, /metrics                | probes                        |
//! | GET    | /, /api/groups                            | the dashboard and its data    |
//!
//! Calls under `/v1/groups/{g}/` must carry `Authorization: Bearer TOKEN`
//! when the group has credentials (`--auth-token-file`,
//! `--group-token-file`); without one of them they get a 401, and a call
//! the credential's role may not make gets a 403 (docs/PROTOCOL.md, "MDS
//! API": engines read views, nodes also register, heartbeat and deregister,
//! only an admin sets the placement rule or a quota). The probes need none.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use kv_common::auth::Role;
use kv_common::mds::{
    valid_name, ErrorReply, HeartbeatRequest, LeaseReply, MemberRecord, RegisterRequest, MAX_WAIT_MS,
};
use tokio::net::TcpListener;

use crate::{Mds, RegError};

/// The largest request body accepted.
const MAX_BODY: usize = 64 << 10;

/// The longest a request may take to arrive: its headers (hyper's header
/// timeout, also between requests on a kept-alive connection) and its body.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// As READ_TIMEOUT, on connections served on the nodes' runtime once one of
/// their calls was answered 2xx: a node's MDS client keeps its connection
/// for heartbeats a third of the lease TTL apart (10 s at the default 30 s),
/// reusing it while idle for less than `kv_common::mds::NODE_KEEP_IDLE`
/// (20 s); the replica keeps it longer.
const NODE_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Long-polls held at once by default (`--max-long-polls`); more are answered 503 at once (the client then
/// tries another replica or polls again after its interval). Each holds a
/// task and a connection for up to `MAX_WAIT_MS`.
pub const MAX_LONG_POLLS: usize = 2048;

/// Limits of one API listener.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once; more get a 503 and are closed.
    pub max_conns: usize,
    /// Long-polls waiting at once; more get a 503.
    pub max_long_polls: usize,
    /// The credentials calls must carry, per group (replaced on SIGHUP).
    pub tokens: Arc<kv_common::auth::Reloadable<kv_common::auth::GroupTokens>>,
    /// The runtime that serves connections whose first request is a
    /// node's call (None: this one serves every connection).
    pub nodes: Option<tokio::runtime::Handle>,
}

/// The longest a call may spend on etcd (a long-poll: on top of its wait).
/// Below the callers' own timeouts (nodes: 3 s), so a slow etcd gives them
/// a 503 to fail over on rather than a timeout and a retried request.
const ETCD_BUDGET: Duration = Duration::from_millis(2500);

async fn limited<T>(extra: Duration, f: impl std::future::Future<Output = Result<T, RegError>>) -> Result<T, RegError> {
    let limit = ETCD_BUDGET + extra;
    tokio::time::timeout(limit, f).await.unwrap_or(Err(RegError::Slow(limit.as_millis() as u64)))
}

type Reply = Response<Full<Bytes>>;

fn json<T: serde::Serialize>(code: StatusCode, v: &T) -> Reply {
    let body = serde_json::to_vec(v).unwrap_or_default();
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn error(code: StatusCode, msg: impl Into<String>) -> Reply {
    json(code, &ErrorReply { error: msg.into() })
}

fn reg_error(e: RegError) -> Reply {
    match e {
        // Transient failures are 503: the caller retries or fails over.
        RegError::Etcd { .. } | RegError::Slow(_) | RegError::Conflict(_) => {
            error(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        RegError::NotRegistered(m) => error(StatusCode::NOT_FOUND, m),
        RegError::Taken(m) => error(StatusCode::CONFLICT, m),
        RegError::Invalid(m) => error(StatusCode::UNPROCESSABLE_ENTITY, m),
    }
}

fn text(code: StatusCode, body: String) -> Reply {
    Response::builder()
        .status(code)
        .header("content-type", "text/plain; version=0.0.4")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn query_str<'q>(query: &'q str, key: &str) -> Option<&'q str> {
    query.split('&').filter_map(|p| p.split_once('=')).find(|(k, _)| *k == key).map(|(_, v)| v)
}

fn query_u64(query: &str, key: &str) -> Result<Option<u64>, String> {
    for pair in query.split('&') {
        if let Some((k, v)) = pair.split_once('=') {
            if k == key {
                return v.parse().map(Some).map_err(|_| format!("query {key}={v:?} is not a whole number"));
            }
        }
    }
    Ok(None)
}

/// Serves the API until `shutdown` turns true, through the daemons' shared
/// accept loop ([`kv_common::listen`]): at most `max_conns` connections,
/// each admitted on its first bytes (within READ_TIMEOUT; up to half of
/// them waiting for those bytes at once), more answered
/// 503; on shutdown a request in flight has a second to end.
pub async fn serve(listener: TcpListener, mds: Arc<Mds>, limits: Limits, shutdown: tokio::sync::watch::Receiver<bool>) {
    let mut gate = kv_common::listen::Gate::new("API", limits.max_conns, READ_TIMEOUT, Some(Duration::from_secs(1)));
    // After an epoch change a fleet's clients all reconnect within a second:
    // on a busy replica thousands of them can be accepted before their
    // first bytes are read. Openings then get a budget of half the
    // connections (a few KiB each), so real clients are not closed as if
    // they were sockets that never speak.
    gate.max_opening = (limits.max_conns / 2).max(kv_common::listen::MAX_OPENING);
    let api = Api {
        registry: Arc::new(crate::metrics::registry(&mds)),
        polls: Arc::new(tokio::sync::Semaphore::new(limits.max_long_polls)),
        tokens: limits.tokens.clone(),
        max_conns: limits.max_conns,
        nodes: limits.nodes.clone(),
        mds,
    };
    kv_common::listen::run(listener, gate, Arc::default(), Arc::new(api), shutdown).await;
}

/// The API as a service of the shared accept loop.
struct Api {
    mds: Arc<Mds>,
    polls: Arc<tokio::sync::Semaphore>,
    tokens: Arc<kv_common::auth::Reloadable<kv_common::auth::GroupTokens>>,
    registry: Arc<prometheus_client::registry::Registry>,
    max_conns: usize,
    nodes: Option<tokio::runtime::Handle>,
}

/// Whether the first bytes of a connection are a node's call: a register,
/// heartbeat or deregister (`POST` or `DELETE` under `/v1/groups/`).
/// Routing only: whatever a connection sends is served the same way.
async fn opens_with_a_node_call(stream: &tokio::net::TcpStream) -> bool {
    const NODE_CALLS: [&[u8]; 2] = [b"POST /v1/groups/", b"DELETE /v1/groups/"];
    let mut first = [0u8; 18];
    // The request line may arrive in pieces: peek until it tells, for up
    // to 50 ms (a caller's first segment nearly always holds its head).
    for _ in 0..25 {
        let n = stream.peek(&mut first).await.unwrap_or(0);
        let got = &first[..n];
        if n == 0 || !NODE_CALLS.iter().any(|c| c.starts_with(got) || got.starts_with(c)) {
            return false;
        }
        if NODE_CALLS.iter().any(|c| got.starts_with(c)) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

/// Counts a call in progress on a connection while it lives.
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl InFlight {
    fn new(calls: Arc<std::sync::atomic::AtomicUsize>) -> InFlight {
        calls.fetch_add(1, Ordering::Relaxed);
        InFlight(calls)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Aborts a task when dropped (a connection moved to the nodes' runtime
/// ends with the accept loop's task that owns its slot).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl kv_common::listen::Service for Api {
    async fn serve(self: Arc<Self>, conn: kv_common::listen::Accepted) {
        if let Some(nodes) = self.nodes.clone() {
            if opens_with_a_node_call(&conn.stream).await {
                let kv_common::listen::Accepted { stream, peer, opening, shutdown } = conn;
                self.mds.reg.counters.node_conns.fetch_add(1, Ordering::Relaxed);
                // Moved to the nodes' runtime: its reactor drives the socket.
                let Ok(stream) = stream.into_std() else { return };
                let api = self.clone();
                let task = nodes.spawn(async move {
                    let Ok(stream) = tokio::net::TcpStream::from_std(stream) else { return };
                    let conn = kv_common::listen::Accepted { stream, peer, opening, shutdown };
                    api.serve_on(conn, true).await;
                });
                let _abort = AbortOnDrop(task.abort_handle());
                let _ = task.await;
                return;
            }
        }
        self.serve_on(conn, false).await;
    }
}

impl Api {
    /// Serves one connection's requests. Hyper's header timeout also ends a
    /// kept-alive connection idle that long: READ_TIMEOUT, or for a node's
    /// connection (`node`) NODE_READ_TIMEOUT once one of its calls was
    /// answered 2xx. Until then it has READ_TIMEOUT in all (and the call
    /// in progress then, if any, is answered first), so a peer that only
    /// says `POST /v1/groups/` holds a slot no longer than any other.
    async fn serve_on(self: Arc<Self>, conn: kv_common::listen::Accepted, node: bool) {
        let peer = conn.peer;
        let api = self.clone();
        let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (ok, calls) = (answered.clone(), busy_calls.clone());
        let svc = hyper::service::service_fn(move |req| {
            let (api, ok) = (api.clone(), ok.clone());
            let call = InFlight::new(calls.clone());
            async move {
                let tokens = api.tokens.get();
                let reply = handle(&api.mds, &api.polls, &tokens, &api.registry, peer, req).await;
                drop(call);
                if reply.status().is_success() {
                    ok.store(true, Ordering::Relaxed);
                }
                Ok::<_, Infallible>(reply)
            }
        });
        let busy = format!(
            "{{\"error\":\"kv-mds is at its connection cap ({}): retry or use another replica\"}}",
            self.max_conns
        );
        let serving =
            kv_common::listen::serve_http(conn, svc, &busy, if node { NODE_READ_TIMEOUT } else { READ_TIMEOUT });
        let end = if node {
            tokio::select! {
                end = serving => end,
                _ = async {
                    tokio::time::sleep(READ_TIMEOUT).await;
                    // A call in progress is answered first (its answer is
                    // written in the same turn of this task that ends it).
                    loop {
                        if answered.load(Ordering::Relaxed) {
                            std::future::pending::<()>().await;
                        }
                        if busy_calls.load(Ordering::Relaxed) == 0 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                } => kv_common::listen::HttpEnd::Served,
            }
        } else {
            serving.await
        };
        if end == kv_common::listen::HttpEnd::Refused {
            self.mds.reg.counters.refused_conns.fetch_add(1, Ordering::Relaxed);
            // One line a minute at most, whatever the rate of refusals.
            static LOGGED: kv_common::daemon::Throttle = kv_common::daemon::Throttle::new(Duration::from_secs(60));
            if LOGGED.ready() {
                tracing::warn!(%peer, cap = self.max_conns, "connection cap reached: refusing connections (503)");
            }
        }
    }
}

/// What a call's credential allows in its group.
#[derive(Clone, Copy)]
enum Grant<'t> {
    /// The group has no credentials: every call is allowed.
    Open,
    As(&'t kv_common::auth::Credential),
}

impl Grant<'_> {
    fn role(self) -> Role {
        match self {
            Grant::Open => Role::Admin,
            Grant::As(c) => c.role,
        }
    }

    fn may_act_for_node(self, id: &str) -> bool {
        match self {
            Grant::Open => true,
            Grant::As(c) => c.may_act_for_node(id),
        }
    }
}

/// The credential `req` carries for `group` (Open when the group needs
/// none); None when it carries none of the group's.
fn authorized<'t>(tokens: &'t kv_common::auth::GroupTokens, group: &str, req: &Request<Incoming>) -> Option<Grant<'t>> {
    let Some(creds) = tokens.for_group(group) else { return Some(Grant::Open) };
    let offered = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .unwrap_or(b"");
    creds.find(offered.trim_ascii()).map(Grant::As)
}

/// Why `grant` may not make `call`, if it may not: engines read views;
/// nodes also register, heartbeat and deregister (their own id, when the
/// credential names one); only an admin changes the group.
fn forbidden_reason(grant: Grant<'_>, call: &Call<'_>) -> Option<String> {
    let role = grant.role().name();
    match *call {
        Call::SetPlacement { group } => (grant.role() != Role::Admin)
            .then(|| format!("changing group {group}'s placement rule needs an admin credential; this one is {role}")),
        Call::SetQuota { group, tenant, .. } => (grant.role() != Role::Admin).then(|| {
            format!("changing tenant {tenant}'s quota in group {group} needs an admin credential; this one is {role}")
        }),
        Call::Register { group, id } | Call::Heartbeat { group, id } | Call::Deregister { group, id, .. } => {
            (!grant.may_act_for_node(id)).then(|| match grant {
                Grant::As(c) if c.role == Role::Node => {
                    format!(
                        "this node credential is bound to node {}, not {id}, in group {group}",
                        c.node.as_deref().unwrap_or("?")
                    )
                }
                _ => format!(
                "only a node or admin credential may register or remove node {id} in group {group}; this one is {role}"
            ),
            })
        }
        _ => None,
    }
}

/// The 403 of a call the caller's role may not make, logged once a minute
/// at most.
fn forbidden(mds: &Mds, why: String, peer: std::net::SocketAddr, req: &Request<Incoming>) -> Reply {
    static LOGGED: kv_common::daemon::Throttle = kv_common::daemon::Throttle::new(Duration::from_secs(60));
    mds.reg.counters.forbidden.fetch_add(1, Ordering::Relaxed);
    if LOGGED.ready() {
        tracing::warn!(%peer, path = req.uri().path(), "refused a call: {why} (one line a minute at most; kvmds_forbidden_requests_total counts all)");
    }
    error(StatusCode::FORBIDDEN, why)
}

/// The 401 of a refused call, logged once a minute at most.
fn denied(mds: &Mds, group: &str, peer: std::net::SocketAddr, req: &Request<Incoming>) -> Reply {
    static LOGGED: kv_common::daemon::Throttle = kv_common::daemon::Throttle::new(Duration::from_secs(60));
    mds.reg.counters.denied.fetch_add(1, Ordering::Relaxed);
    if LOGGED.ready() {
        let had = req.headers().contains_key(hyper::header::AUTHORIZATION);
        tracing::warn!(%peer, group, path = req.uri().path(), "refused a call: {} auth token (one line a minute at most; kvmds_denied_requests_total counts all)",
            if had { "wrong" } else { "no" });
    }
    let mut r = error(StatusCode::UNAUTHORIZED, format!("missing or wrong auth token for group {group}"));
    r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
    r
}

async fn handle(
    mds: &Mds,
    polls: &Arc<tokio::sync::Semaphore>,
    tokens: &kv_common::auth::GroupTokens,
    registry: &prometheus_client::registry::Registry,
    peer: std::net::SocketAddr,
    req: Request<Incoming>,
) -> Reply {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let call = match parse_call(req.method().as_str(), &path, &query) {
        Ok(c) => c,
        Err((code, msg)) => return error(StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST), msg),
    };
    let group = match &call {
        Call::Health => return health(mds).await,
        Call::Live => return text(StatusCode::OK, "ok\n".into()),
        Call::Metrics => return metrics(mds, registry).await,
        Call::Dashboard => return html(crate::metrics::DASHBOARD),
        Call::Groups => return groups(mds, tokens, &req).await,
        Call::View { group, .. }
        | Call::SetPlacement { group }
        | Call::Quotas { group }
        | Call::SetQuota { group, .. }
        | Call::Register { group, .. }
        | Call::Heartbeat { group, .. }
        | Call::Deregister { group, .. } => *group,
    };
    let Some(grant) = authorized(tokens, group, &req) else {
        return denied(mds, group, peer, &req);
    };
    if let Some(why) = forbidden_reason(grant, &call) {
        return forbidden(mds, why, peer, &req);
    }
    match call {
        Call::View { group, after, wait_ms, rules, delta, min_epoch } => {
            view(mds, polls, group, ViewAsk { after, wait: wait_ms, rules, delta, min_epoch }).await
        }
        Call::SetPlacement { group } => set_placement(mds, group, req).await,
        Call::Quotas { group } => match limited(Duration::ZERO, mds.reg.quotas(group)).await {
            Ok((q, _)) => json(StatusCode::OK, &kv_common::mds::QuotasReply { quotas: q.to_strings() }),
            Err(e) => reg_error(e),
        },
        Call::SetQuota { group, tenant, set } => set_quota(mds, group, tenant, set, req).await,
        Call::Register { group, id } => register(mds, group, id, req).await,
        Call::Heartbeat { group, id } => heartbeat(mds, group, id, req).await,
        Call::Deregister { group, id, instance } => deregister(mds, group, id, instance).await,
        // Answered above; kept whole so no arm can panic.
        Call::Health => health(mds).await,
        Call::Live => text(StatusCode::OK, "ok\n".into()),
        Call::Metrics => metrics(mds, registry).await,
        Call::Dashboard => html(crate::metrics::DASHBOARD),
        Call::Groups => groups(mds, tokens, &req).await,
    }
}

/// `/api/groups`: every group's view for the dashboard. A token-protected
/// group's members (ids, addresses, metrics addresses) are shown only to a
/// request that carries that group's token, as its view is; to anyone else
/// its epoch and member count.
async fn groups(mds: &Mds, tokens: &kv_common::auth::GroupTokens, req: &Request<Incoming>) -> Reply {
    let ov = crate::metrics::overview(mds).await;
    let mut v = match serde_json::to_value(&*ov) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode the groups: {e}")),
    };
    if let Some(groups) = v.get_mut("groups").and_then(|g| g.as_array_mut()) {
        for g in groups {
            let name = g.get("group").and_then(|n| n.as_str()).unwrap_or_default().to_string();
            if authorized(tokens, &name, req).is_none() {
                g["members"] = serde_json::Value::Array(Vec::new());
                g["hidden"] = serde_json::Value::Bool(true);
            }
        }
    }
    json(StatusCode::OK, &v)
}

/// An API call as its request line names it (see the table at the top).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call<'a> {
    Health,
    Live,
    Metrics,
    Dashboard,
    Groups,
    /// `rules`: the placement rules the caller knows, comma-separated
    /// (`ketama` when it names none); `delta`: the caller takes the
    /// members as a change against `after`; `min_epoch`: a plain poll is
    /// answered with an epoch of at least that, read from etcd when the
    /// view held is older (0: any).
    View {
        group: &'a str,
        after: Option<u64>,
        delta: bool,
        wait_ms: u64,
        rules: &'a str,
        min_epoch: u64,
    },
    SetPlacement {
        group: &'a str,
    },
    Quotas {
        group: &'a str,
    },
    /// `set`: PUT (a quota in the body); else DELETE.
    SetQuota {
        group: &'a str,
        tenant: &'a str,
        set: bool,
    },
    Register {
        group: &'a str,
        id: &'a str,
    },
    Heartbeat {
        group: &'a str,
        id: &'a str,
    },
    Deregister {
        group: &'a str,
        id: &'a str,
        instance: &'a str,
    },
}

/// Parses and checks a request line: method, path and query. Pure (no I/O),
/// so the fuzz targets drive it; errors are (HTTP status, message).
pub fn parse_call<'a>(method: &str, path: &'a str, query: &'a str) -> Result<Call<'a>, (u16, String)> {
    let bad = |msg: String| Err((400, msg));
    let parts: Vec<&'a str> = path.trim_matches('/').split('/').collect();
    let name_ok = |what: &str, v: &str| -> Result<(), (u16, String)> {
        if valid_name(v) {
            Ok(())
        } else {
            Err((400, format!("{what} {v:?} is not a name of 1-64 [A-Za-z0-9._-]")))
        }
    };
    match (method, parts.as_slice()) {
        ("GET", ["healthz"]) => Ok(Call::Health),
        // Alive: answered whenever the API serves, etcd or not (a liveness
        // probe must not restart every replica while etcd is away).
        ("GET", ["livez"]) => Ok(Call::Live),
        ("GET", ["metrics"]) => Ok(Call::Metrics),
        ("GET", [""]) => Ok(Call::Dashboard),
        ("GET", ["api", "groups"]) => Ok(Call::Groups),
        (_, ["v1", "groups", g, rest @ ..]) => {
            let group: &'a str = g;
            name_ok("group", group)?;
            match (method, rest) {
                ("GET", ["view"]) => {
                    match (query_u64(query, "after"), query_u64(query, "wait_ms"), query_u64(query, "min_epoch")) {
                        (Ok(after), Ok(w), Ok(min)) => Ok(Call::View {
                            group,
                            after,
                            wait_ms: w.unwrap_or(0).min(MAX_WAIT_MS),
                            rules: query_str(query, "rules").unwrap_or("ketama"),
                            delta: query_str(query, "delta") == Some("1"),
                            min_epoch: min.unwrap_or(0),
                        }),
                        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => bad(e),
                    }
                }
                ("PUT", ["placement"]) => Ok(Call::SetPlacement { group }),
                ("GET", ["tenants"]) => Ok(Call::Quotas { group }),
                ("PUT" | "DELETE", ["tenants", tenant]) => {
                    name_ok("tenant", tenant)?;
                    Ok(Call::SetQuota { group, tenant, set: method == "PUT" })
                }
                ("POST", ["members", id]) => {
                    name_ok("node id", id)?;
                    Ok(Call::Register { group, id })
                }
                ("POST", ["members", id, "heartbeat"]) => {
                    name_ok("node id", id)?;
                    Ok(Call::Heartbeat { group, id })
                }
                ("DELETE", ["members", id]) => {
                    name_ok("node id", id)?;
                    let instance = query_str(query, "instance").unwrap_or("");
                    check_instance(instance).map_err(|m| (400, m))?;
                    Ok(Call::Deregister { group, id, instance })
                }
                _ => Err((404, format!("no such call: {method} {path}"))),
            }
        }
        _ => Err((404, format!("no such call: {method} {path}"))),
    }
}

/// An instance token: empty, or 1-64 of `[A-Za-z0-9._-]`.
fn check_instance(instance: &str) -> Result<(), String> {
    if instance.is_empty() || valid_name(instance) {
        Ok(())
    } else {
        Err(format!("instance {instance:?} is not a name of 1-64 [A-Za-z0-9._-]"))
    }
}

/// Parses and checks a register body (an empty body reads as `{}`).
pub fn parse_register(body: &[u8]) -> Result<RegisterRequest, String> {
    let body: &[u8] = if body.is_empty() { b"{}" } else { body };
    let r: RegisterRequest =
        serde_json::from_slice(body).map_err(|e| format!("body is not {{\"addr\":..,\"weight\":..}}: {e}"))?;
    check_instance(&r.instance)?;
    if r.weight == 0 || r.weight > kv_common::ring::MAX_WEIGHT {
        return Err(format!("weight {} is outside 1..={}", r.weight, kv_common::ring::MAX_WEIGHT));
    }
    if !host_port(&r.addr) {
        return Err(format!("addr {:?} is not host:port", r.addr));
    }
    if let Some(m) = r.metrics_addr.as_deref().filter(|m| !host_port(m)) {
        return Err(format!("metrics_addr {m:?} is not host:port"));
    }
    Ok(r)
}

/// `host:port`: a port number, and a host of letters, digits and `.-_`, or
/// an IPv6 address in brackets; at most 255 bytes. Addresses are shown on
/// the dashboard and dialled by clients: nothing else gets through.
fn host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else { return false };
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => !v6.is_empty() && v6.bytes().all(|b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.')),
        None => !host.is_empty() && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')),
    };
    s.len() <= 255 && host_ok && port.parse::<u16>().is_ok()
}

/// Parses and checks a heartbeat body (an empty body reads as `{}`).
pub fn parse_heartbeat(body: &[u8]) -> Result<HeartbeatRequest, String> {
    let body: &[u8] = if body.is_empty() { b"{}" } else { body };
    let hb: HeartbeatRequest =
        serde_json::from_slice(body).map_err(|e| format!("body is not {{\"instance\":..}}: {e}"))?;
    check_instance(&hb.instance)?;
    Ok(hb)
}

async fn health(mds: &Mds) -> Reply {
    let probe = tokio::time::timeout(Duration::from_secs(2), mds.reg.probe()).await;
    match probe {
        Ok(Ok(())) => text(StatusCode::OK, "ok\n".into()),
        Ok(Err(e)) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
        Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "etcd unavailable: no answer within 2 s\n".into()),
    }
}

async fn set_placement(mds: &Mds, group: &str, req: Request<Incoming>) -> Reply {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let rule = match serde_json::from_slice::<kv_common::mds::PlacementRequest>(&body)
        .map_err(|e| format!("body is not {{\"placement\": RULE}}: {e}"))
        .and_then(|r| kv_common::ring::Placement::parse(&r.placement))
    {
        Ok(r) => r,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    match limited(Duration::ZERO, mds.set_placement(group, rule)).await {
        Ok(h) => json(
            StatusCode::OK,
            &kv_common::mds::PlacementReply { placement: rule.name().to_string(), epoch: h.view.epoch },
        ),
        Err(e) => reg_error(e),
    }
}

async fn set_quota(mds: &Mds, group: &str, tenant: &str, set: bool, req: Request<Incoming>) -> Reply {
    let quota = if set {
        let body = match read_body(req).await {
            Ok(b) => b,
            Err(reply) => return reply,
        };
        match serde_json::from_slice::<kv_common::mds::QuotaRequest>(&body)
            .map_err(|e| format!("body is not {{\"quota\": SHARE}}: {e}"))
            .and_then(|r| kv_common::quota::Quota::parse(&r.quota))
        {
            Ok(q) => Some(q),
            Err(m) => return error(StatusCode::BAD_REQUEST, m),
        }
    } else {
        None
    };
    match limited(Duration::ZERO, mds.reg.set_quota(group, tenant, quota)).await {
        Ok(q) => json(StatusCode::OK, &kv_common::mds::QuotasReply { quotas: q.to_strings() }),
        Err(e) => reg_error(e),
    }
}

/// What a view call asks for (see [`Call::View`]).
struct ViewAsk<'a> {
    after: Option<u64>,
    wait: u64,
    rules: &'a str,
    delta: bool,
    min_epoch: u64,
}

async fn view(mds: &Mds, polls: &Arc<tokio::sync::Semaphore>, group: &str, ask: ViewAsk<'_>) -> Reply {
    let ViewAsk { after, wait, rules, delta, min_epoch } = ask;
    let r = match after {
        Some(a) if wait > 0 => {
            let Ok(_slot) = polls.try_acquire() else {
                mds.reg.counters.refused_polls.fetch_add(1, Ordering::Relaxed);
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "kv-mds is at its long-poll cap: retry or use another replica",
                );
            };
            let wait = Duration::from_millis(wait);
            let c = &mds.reg.counters;
            // Counted down however the wait ends (a caller that hangs up
            // drops this future).
            struct Waiting<'a>(&'a std::sync::atomic::AtomicU64);
            impl Drop for Waiting<'_> {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::Relaxed);
                }
            }
            c.long_polls_waiting.fetch_add(1, Ordering::Relaxed);
            let waiting = Waiting(&c.long_polls_waiting);
            let r = limited(wait, mds.wait_view(group, a, wait)).await;
            drop(waiting);
            if r.is_ok() {
                c.views_long_polled.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
        _ => {
            // A long-poll's answer is never older than its `after` already;
            // `min_epoch` asks the same of a plain poll.
            let r = limited(Duration::ZERO, mds.current_view(group, min_epoch)).await;
            if r.is_ok() {
                mds.reg.counters.views_polled.fetch_add(1, Ordering::Relaxed);
            }
            r
        }
    };
    match r {
        // A caller that does not know the group's rule would place keys
        // on the wrong members: it gets one clear error instead.
        Ok(h) if !crate::knows_rule(rules, h.view.placement.as_deref()) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "group {group} places keys by rule {:?}, which this client does not know (it named {rules:?}): upgrade it (docs/PROTOCOL.md §4)",
                h.view.placement.as_deref().unwrap_or("ketama")
            ),
        ),
        Ok(h) => {
            let (body, _) = mds.encode(group, &h, after.filter(|_| delta), rules);
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(Full::new(body))
                .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
        }
        Err(e) => reg_error(e),
    }
}

/// The body of `req`, read within READ_TIMEOUT and MAX_BODY.
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Reply> {
    // A body announced and never sent holds the connection for READ_TIMEOUT at most.
    Ok(tokio::time::timeout(READ_TIMEOUT, Limited::new(req.into_body(), MAX_BODY).collect())
        .await
        .map_err(|_| error(StatusCode::REQUEST_TIMEOUT, format!("the body did not arrive within {READ_TIMEOUT:?}")))?
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("cannot read the body: {e}")))?
        .to_bytes())
}

async fn register(mds: &Mds, group: &str, id: &str, req: Request<Incoming>) -> Reply {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let r = match parse_register(&body) {
        Ok(r) => r,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let rec = MemberRecord { id: id.to_string(), addr: r.addr, weight: r.weight, metrics_addr: r.metrics_addr };
    match limited(Duration::ZERO, mds.reg.register(group, &rec, &r.instance)).await {
        Ok(epoch) => {
            tracing::info!(group, id, addr = %rec.addr, weight = rec.weight, epoch, "node registered");
            json(StatusCode::OK, &LeaseReply { ttl_ms: mds.reg.ttl_ms(), took_over: false, epoch })
        }
        Err(e) => reg_error(e),
    }
}

async fn heartbeat(mds: &Mds, group: &str, id: &str, req: Request<Incoming>) -> Reply {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let hb = match parse_heartbeat(&body) {
        Ok(h) => h,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    match limited(Duration::ZERO, mds.reg.heartbeat(group, id, &hb.instance)).await {
        Ok(took_over) => json(StatusCode::OK, &LeaseReply { ttl_ms: mds.reg.ttl_ms(), took_over, epoch: 0 }),
        Err(e) => reg_error(e),
    }
}

async fn deregister(mds: &Mds, group: &str, id: &str, instance: &str) -> Reply {
    match limited(Duration::ZERO, mds.reg.deregister(group, id, instance)).await {
        Ok(epoch) => {
            tracing::info!(group, id, epoch, "node deregistered");
            json(StatusCode::OK, &LeaseReply { ttl_ms: 0, took_over: false, epoch })
        }
        Err(e) => reg_error(e),
    }
}

async fn metrics(mds: &Mds, registry: &prometheus_client::registry::Registry) -> Reply {
    match crate::metrics::render(mds, registry).await {
        Ok(body) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
        Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n".into()),
    }
}

fn html(page: &'static str) -> Reply {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/html; charset=utf-8")
        .body(Full::new(Bytes::from_static(page.as_bytes())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_bodies_are_checked() {
        let ok = |b: &str| parse_register(b.as_bytes());
        assert!(ok(r#"{"addr":"10.0.0.1:7700","weight":1}"#).is_ok());
        assert!(ok(r#"{"addr":"node_1.cluster:7700","weight":2,"metrics_addr":"[::1]:9700"}"#).is_ok());
        assert!(ok(r#"{"addr":"10.0.0.1:7700","weight":0}"#).unwrap_err().contains("weight"));
        assert!(ok(r#"{"addr":"10.0.0.1","weight":1}"#).unwrap_err().contains("addr"));
        assert!(ok(r#"{"addr":"<b>x</b>:1","weight":1}"#).is_err());
        let e = ok(r#"{"addr":"a:1","weight":1,"metrics_addr":"\"><script>:9700"}"#).unwrap_err();
        assert!(e.contains("metrics_addr"), "{e}");
        assert!(ok(r#"{"addr":"a:1","weight":1,"metrics_addr":"a:99999"}"#).is_err());
    }

    #[test]
    fn view_calls_carry_min_epoch() {
        fn view(q: &str) -> Result<Call<'_>, (u16, String)> {
            parse_call("GET", "/v1/groups/g/view", q)
        }
        let min = |q: &str| match view(q) {
            Ok(Call::View { min_epoch, .. }) => Some(min_epoch),
            _ => None,
        };
        assert_eq!(min(""), Some(0), "absent: any view");
        assert_eq!(min("min_epoch=42&rules=ketama"), Some(42));
        assert_eq!(min("after=7&wait_ms=1000&min_epoch=9"), Some(9));
        assert!(view("min_epoch=x").is_err(), "not a number: one clear error");
        assert!(view("min_epoch=-1").is_err());
    }
}
