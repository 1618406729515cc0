//! The membership logic over etcd: node records bound to leases, and views
//! whose epoch is an etcd revision.
//!
//! Keys (docs/PROTOCOL.md §6), for a group `G`:
//! - `/kvcellar/v1/groups/G/members/ID`: a node record (JSON `MemberRecord`),
//!   bound to a lease this service granted for the node.
//! - `/kvcellar/v1/groups/G/epoch`: a digest of the member set it names.
//!
//! **Epoch.** A group's epoch is the `mod_revision` of its epoch key. The
//! key's value is a digest of the member set (sorted ids, addresses,
//! weights). Whoever reads a view compares the digest of the members it
//! read with the stored one; when they differ (a node joined, left, changed
//! weight or address, or its lease expired), it rewrites the epoch key in a
//! transaction guarded by the key's `mod_revision`. The transaction that
//! wins names the set read before it, at its own revision, even if members
//! changed in between (the next reader finds the digest stale and moves the
//! epoch again). So:
//! - the epoch advances when, and only when, the member set changes
//!   (a heartbeat, or a replica taking a node over, rewrites the record with
//!   the same content: the digest, hence the epoch, stays);
//! - of several replicas noticing the same change, one transaction wins and
//!   the others re-read: one change, one new epoch;
//! - a view is only ever served with the epoch whose digest matches its
//!   members, so the same epoch means the same view on every replica.
//!
//! **Previous sets (handoff).** Two more keys per group keep the member
//! sets a group had before, so clients can still find pages on their old
//! owners for a while (docs/ARCHITECTURE.md, "Ring transitions"):
//! - `/kvcellar/v1/groups/G/current`: the member set the epoch key names,
//!   written in the same transaction as the epoch (so its `mod_revision` is
//!   the epoch);
//! - `/kvcellar/v1/groups/G/history/EPOCH`: written when the set of epoch
//!   EPOCH is replaced, in the transaction that writes the new epoch (so its
//!   `mod_revision` is the new epoch): the delta from the new set back to
//!   the old one, on a lease of `--handoff-secs`. A transaction keeps the
//!   newest [`MAX_PREVIOUS_SETS`] and deletes older ones; once it succeeded,
//!   the replica revokes the deleted keys' leases.
//!
//! A view walks that chain back from its epoch and sends each set still
//! leased as a delta against its members, with the lease's time left.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use kv_common::mds::{MemberRecord, PreviousSet, View, ETCD_ROOT, MAX_PREVIOUS_SETS};
use serde::{Deserialize, Serialize};

/// How long a call may wait for a group's epoch to settle, its time in the
/// queue included, before it is told to retry: below the HTTP layer's etcd
/// budget (2.5 s, less what a registration spent on its lease and record),
/// so the caller gets that answer rather than "too slow".
const SETTLE_BUDGET: Duration = Duration::from_millis(1500);

/// A member record as stored: what views show, plus the registering
/// process's instance token (so two nodes given the same id are told
/// apart). Views parse it as a `MemberRecord` (the token is ignored).
#[derive(Serialize, Deserialize)]
struct Stored<'a> {
    id: &'a str,
    addr: &'a str,
    weight: u32,
    #[serde(default)]
    instance: &'a str,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metrics_addr: Option<&'a str>,
}

/// Err when the stored record was registered by another instance than the
/// caller's (an empty token on either side matches anything).
fn check_instance(group: &str, id: &str, value: &[u8], instance: &str) -> Result<(), RegError> {
    let Ok(st) = serde_json::from_slice::<Stored>(value) else { return Ok(()) };
    if instance.is_empty() || st.instance.is_empty() || st.instance == instance {
        return Ok(());
    }
    Err(RegError::Taken(format!(
        "node id {id} of group {group} is registered by another node (at {}, instance {}): two nodes share this id",
        st.addr, st.instance
    )))
}

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegError {
    #[error("etcd unavailable ({endpoints}): {source}")]
    Etcd { endpoints: String, source: etcd_client::Error },
    #[error("{0}")]
    NotRegistered(String),
    /// Transient: retry.
    #[error("{0}")]
    Conflict(String),
    /// The id is held by another instance of a node (two nodes share an id).
    #[error("{0}")]
    Taken(String),
    #[error("etcd did not answer within {0} ms")]
    Slow(u64),
    /// The request (or what etcd holds for it) is wrong: one line why.
    #[error("{0}")]
    Invalid(String),
}

#[derive(Default)]
pub struct Counters {
    pub registrations: AtomicU64,
    pub heartbeats: AtomicU64,
    pub takeovers: AtomicU64,
    pub deregistrations: AtomicU64,
    pub epoch_bumps: AtomicU64,
    pub etcd_errors: AtomicU64,
    pub views: AtomicU64,
    /// Connections refused at the connection cap (`--max-conns`).
    pub refused_conns: AtomicU64,
    /// Connections served on the nodes' runtime (opened with a node's call).
    pub node_conns: AtomicU64,
    /// Long-polls refused at the long-poll cap.
    pub refused_polls: AtomicU64,
    /// etcd calls sent again after one did not reach a member.
    pub etcd_retries: AtomicU64,
    /// Rounds of settling an epoch begun again (another replica moved it first).
    pub settle_retries: AtomicU64,
    /// View reads answered by a settling another caller began after they arrived.
    pub settles_shared: AtomicU64,
    /// API calls refused for a missing or wrong auth token.
    pub denied: AtomicU64,
    /// API calls refused because the caller's role may not make them (403).
    pub forbidden: AtomicU64,
    /// etcd leases granted (registrations and takeovers).
    pub lease_grants: AtomicU64,
    /// Heartbeats that found the node's lease expired in etcd.
    pub lease_expiries: AtomicU64,
    /// Views answered at once (`GET .../view` without a wait).
    pub views_polled: AtomicU64,
    /// Long-polls answered (on a change or at their deadline), and waiting now.
    pub views_long_polled: AtomicU64,
    /// Long-polls that started from the view held for them (no etcd read).
    pub views_from_cache: AtomicU64,
    /// Plain polls answered from the view the etcd watch holds.
    pub polls_from_cache: AtomicU64,
    /// Plain polls whose `min_epoch` was past the view held (read instead).
    pub polls_behind_min_epoch: AtomicU64,
    /// Leases of trimmed history keys revoked (the rest expire on their own).
    pub history_leases_revoked: AtomicU64,
    /// Views sent as deltas, and the bytes of view bodies sent, by kind.
    pub views_delta: AtomicU64,
    pub view_bytes_full: AtomicU64,
    pub view_bytes_delta: AtomicU64,
    /// View bodies encoded (each shared by the callers answered with it).
    pub view_encodings: AtomicU64,
    pub long_polls_waiting: AtomicU64,
}

/// (group, node id).
type NodeKey = (String, String);

pub struct Registry {
    etcd: Client,
    /// The client nodes' calls (register, heartbeat, deregister) use: one
    /// of the nodes' own runtime when kv-mds runs one (docs/ARCHITECTURE.md,
    /// "kv-mds"), so their etcd round trips do not queue behind the
    /// long-poll traffic of the main runtime.
    node_etcd: Option<Client>,
    endpoints: String,
    pub ttl: Duration,
    /// Leases this replica holds: (group, id) -> (lease id, last refreshed).
    leases: Mutex<HashMap<NodeKey, (i64, Instant)>>,
    /// One register/heartbeat/deregister at a time per node, so a retried
    /// request racing the original cannot bind the record to one lease and
    /// revoke it as another's.
    node_locks: Mutex<HashMap<NodeKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Calls waiting to settle each group's epoch ([`Registry::view_via`]):
    /// those of the main runtime, and nodes' registrations and leaves (on
    /// the nodes' runtime, so they do not queue behind the main one's).
    settles: SettleQueues,
    node_settles: SettleQueues,
    etcd_ok: AtomicBool,
    pub counters: Counters,
    /// Time of each etcd call (its retries included).
    pub etcd_latency: prometheus_client::metrics::histogram::Histogram,
    /// How long a replaced member set stays in views (`--handoff-secs`);
    /// zero: none is kept.
    pub handoff: Duration,
    /// Time left on history leases as last asked of etcd: lease id ->
    /// (when asked, seconds left then).
    lease_left: Mutex<HashMap<i64, (Instant, i64)>>,
}

/// One group's settling on this replica ([`Registry::view_via`]): callers
/// queue on `last`, which holds the last settling's answer and how many
/// callers had arrived when its read began.
#[derive(Default)]
struct SettleQueue {
    arrived: AtomicU64,
    /// Errors too: the calls a failed settling covered fail with it, rather
    /// than each trying again in turn.
    last: tokio::sync::Mutex<Option<(u64, Result<View, String>)>>,
}

type SettleQueues = Mutex<HashMap<String, Arc<SettleQueue>>>;

/// A caller's place in a group's queue; the queue is dropped with its last
/// caller, so group names that come and go leave nothing behind.
struct Queued<'a> {
    queues: &'a SettleQueues,
    group: &'a str,
    q: Arc<SettleQueue>,
}

impl<'a> Queued<'a> {
    fn join(queues: &'a SettleQueues, group: &'a str) -> Queued<'a> {
        let mut m = queues.lock().unwrap_or_else(|e| e.into_inner());
        let q = match m.get(group) {
            Some(q) => q.clone(),
            None => m.entry(group.to_string()).or_default().clone(),
        };
        drop(m);
        Queued { queues, group, q }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut m = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        // Under the map's lock nobody else can take a reference: two are
        // the map's and this one.
        if m.get(self.group).is_some_and(|q| Arc::ptr_eq(q, &self.q)) && Arc::strong_count(&self.q) == 2 {
            m.remove(self.group);
        }
    }
}

/// The one answer to a call whose group's epoch did not settle in time.
fn unsettled(group: &str) -> RegError {
    RegError::Conflict(format!(
        "group {group}: no epoch settled within {} s (members changing faster than etcd answers): retry",
        SETTLE_BUDGET.as_secs_f32()
    ))
}

/// A history key's value: the delta from the set that replaced epoch
/// `epoch`'s set back to that set.
#[derive(Serialize, Deserialize)]
struct History {
    epoch: u64,
    #[serde(default)]
    joined: Vec<String>,
    #[serde(default)]
    left: Vec<MemberRecord>,
    /// The earlier set's placement rule; absent: ketama.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    placement: Option<String>,
}

/// What the `current` key holds: the member set the epoch names, as a bare
/// array under Ketama (the form older replicas write and read) or with
/// its rule under another.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Current {
    Ketama(Vec<MemberRecord>),
    Placed { placement: String, members: Vec<MemberRecord> },
}

impl Current {
    fn new(members: Vec<MemberRecord>, placement: Option<&str>) -> Current {
        match placement {
            None => Current::Ketama(members),
            Some(p) => Current::Placed { placement: p.to_string(), members },
        }
    }

    fn into_parts(self) -> (Vec<MemberRecord>, Option<String>) {
        match self {
            Current::Ketama(m) => (m, None),
            Current::Placed { placement, members } => (members, Some(placement)),
        }
    }
}

fn group_prefix(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/")
}

fn member_key(group: &str, id: &str) -> String {
    format!("{ETCD_ROOT}{group}/members/{id}")
}

fn epoch_key(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/epoch")
}

fn placement_key(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/placement")
}

/// The group's placement rule as its keys (`kvs`, the group prefix) name
/// it: `None` for Ketama (no key, or the key says `ketama`).
fn placement_in(group: &str, kvs: &[etcd_client::KeyValue]) -> Option<String> {
    let key = placement_key(group);
    let kv = kvs.iter().find(|kv| kv.key() == key.as_bytes())?;
    let name = String::from_utf8_lossy(kv.value()).trim().to_string();
    (name != kv_common::ring::Placement::Ketama.name()).then_some(name)
}

fn tenants_key(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/tenants")
}

fn current_key(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/current")
}

fn history_prefix(group: &str) -> String {
    format!("{ETCD_ROOT}{group}/history/")
}

fn history_key(group: &str, epoch: u64) -> String {
    format!("{}{epoch:020}", history_prefix(group))
}

/// Members without what the epoch does not name (for `current` and history).
fn placement_only(members: &[MemberRecord]) -> Vec<MemberRecord> {
    members.iter().map(|m| MemberRecord { metrics_addr: None, ..m.clone() }).collect()
}

/// The group a key under [`ETCD_ROOT`] belongs to.
pub fn group_of_key(key: &[u8]) -> Option<&str> {
    let rest = key.strip_prefix(ETCD_ROOT.as_bytes())?;
    let end = rest.iter().position(|&b| b == b'/')?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The digest an epoch key holds ([`kv_common::mds::digest`]).
pub fn digest(members: &[MemberRecord], placement: Option<&str>) -> String {
    kv_common::mds::digest(members, placement)
}

fn parse_members(kvs: &[etcd_client::KeyValue]) -> Vec<MemberRecord> {
    let mut out: Vec<MemberRecord> = kvs
        .iter()
        .filter(|kv| kv.key().split(|&b| b == b'/').rev().nth(1) == Some(b"members"))
        .filter_map(|kv| match serde_json::from_slice::<MemberRecord>(kv.value()) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "ignoring a malformed member record");
                None
            }
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// Runs an etcd call, and again (four times at most) when it failed without an
/// answer from etcd: with one member down (its name gone, its port shut) the
/// client's balancer may pick it, and a retry goes to another member. Only
/// idempotent calls go through here (reads, puts, lease grants: a grant
/// applied whose answer was lost leaves a lease that expires). Transactions
/// do not: one applied whose answer was lost would fail its compare when
/// sent again and be taken for a conflict.
macro_rules! etcd_call {
    ($self:ident, $call:expr) => {{
        let mut tries = 0;
        let t0 = Instant::now();
        let r = loop {
            let r = $call;
            match &r {
                Err(e) if tries < 4 && unreachable_member(e) => {
                    tries += 1;
                    $self.counters.etcd_retries.fetch_add(1, Ordering::Relaxed);
                }
                _ => break r,
            }
        };
        $self.etcd_latency.observe(t0.elapsed().as_secs_f64());
        $self.track(r)
    }};
}

/// The call did not reach an etcd member (as opposed to etcd answering
/// with an error).
fn unreachable_member(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(st) => st.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

impl Registry {
    pub fn new(etcd: Client, endpoints: String, ttl: Duration) -> Registry {
        Registry {
            etcd,
            node_etcd: None,
            endpoints,
            ttl,
            leases: Mutex::default(),
            node_locks: Mutex::default(),
            settles: Mutex::default(),
            node_settles: Mutex::default(),
            etcd_ok: AtomicBool::new(true),
            counters: Counters::default(),
            etcd_latency: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.000_25, 2.0, 16),
            ),
            handoff: Duration::from_secs(600),
            lease_left: Mutex::default(),
        }
    }

    /// Serves nodes' calls through `etcd` (a client of the nodes' runtime).
    pub fn with_node_etcd(mut self, etcd: Client) -> Registry {
        self.node_etcd = Some(etcd);
        self
    }

    fn node_client(&self) -> Client {
        self.node_etcd.as_ref().unwrap_or(&self.etcd).clone()
    }

    /// Sets the handoff window (`--handoff-secs`; zero turns it off).
    pub fn with_handoff(mut self, window: Duration) -> Registry {
        self.handoff = window;
        self
    }

    /// The handoff window in whole seconds as leases have it (0: off).
    fn handoff_secs(&self) -> i64 {
        if self.handoff.is_zero() {
            0
        } else {
            self.handoff.as_millis().div_ceil(1000).max(1) as i64
        }
    }

    /// Milliseconds left on a history key's lease (0: gone). Asked of etcd
    /// once per lease per replica, then counted down here.
    async fn lease_ms_left(&self, etcd: &Client, lease: i64) -> u64 {
        if lease == 0 {
            return 0;
        }
        let known = self.lease_left.lock().unwrap_or_else(|e| e.into_inner()).get(&lease).copied();
        let (asked, secs) = match known {
            Some(k) => k,
            None => {
                let mut etcd = etcd.clone();
                let secs = match self.timed(etcd.lease_time_to_live(lease, None)).await {
                    Ok(r) => r.ttl(),
                    // Unknown: assume the whole window (the client's own
                    // timer bounds it too).
                    Err(_) => return self.handoff.as_millis() as u64,
                };
                let k = (Instant::now(), secs);
                self.lease_left.lock().unwrap_or_else(|e| e.into_inner()).insert(lease, k);
                k
            }
        };
        let left = Duration::from_secs(secs.max(0) as u64).saturating_sub(asked.elapsed());
        left.as_millis() as u64
    }

    /// Revokes the leases of history keys a transaction deleted. Best
    /// effort: a lease not revoked (etcd did not answer) expires at the end
    /// of its window, as before; a lease gone already is nothing to do.
    async fn revoke_trimmed(&self, etcd: &mut Client, group: &str, leases: &[i64]) {
        for &lease in leases {
            self.lease_left.lock().unwrap_or_else(|e| e.into_inner()).remove(&lease);
            match self.timed(etcd.lease_revoke(lease)).await {
                Ok(_) => {
                    self.counters.history_leases_revoked.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.to_string().contains("not found") => {}
                Err(e) => tracing::warn!(
                    group,
                    lease = format!("{lease:x}"),
                    error = %e,
                    "cannot revoke the lease of a trimmed history key: it expires at the end of its window"
                ),
            }
        }
    }

    /// The view of `members` at `epoch`, with the previous sets the history
    /// keys among `kvs` (the group's keys) still hold.
    async fn assemble(
        &self,
        etcd: &Client,
        group: &str,
        epoch: u64,
        members: Vec<MemberRecord>,
        placement: Option<String>,
        kvs: &[etcd_client::KeyValue],
    ) -> View {
        let handoff_ms = Some(self.handoff.as_millis() as u64);
        let mut previous = Vec::new();
        if self.handoff.is_zero() || epoch == 0 {
            return View { group: group.to_string(), epoch, members, previous, handoff_ms, placement, delta: None };
        }
        let hprefix = history_prefix(group);
        let history: HashMap<u64, (i64, History)> = kvs
            .iter()
            .filter(|kv| kv.key().starts_with(hprefix.as_bytes()))
            .filter_map(|kv| {
                let h: History = serde_json::from_slice(kv.value()).ok()?;
                Some((kv.mod_revision() as u64, (kv.lease(), h)))
            })
            .collect();
        let mut set = placement_only(&members);
        let mut at = epoch;
        while previous.len() < MAX_PREVIOUS_SETS {
            let Some((lease, h)) = history.get(&at) else { break };
            if h.epoch >= at {
                break; // not a step back: a damaged key
            }
            let left = self.lease_ms_left(etcd, *lease).await;
            if left == 0 {
                break;
            }
            let earlier = PreviousSet {
                epoch: h.epoch,
                remaining_ms: 0,
                joined: h.joined.clone(),
                left: h.left.clone(),
                placement: None,
            }
            .apply(&set);
            let mut p = PreviousSet::between(&members, &earlier, h.epoch, left);
            p.placement = h.placement.clone();
            previous.push(p);
            set = earlier;
            at = h.epoch;
        }
        View { group: group.to_string(), epoch, members, previous, handoff_ms, placement, delta: None }
    }

    pub fn etcd(&self) -> Client {
        self.etcd.clone()
    }

    /// Records an etcd outcome: logs once when etcd goes away and once when
    /// it comes back, instead of a line per failed call.
    fn track<T>(&self, r: Result<T, etcd_client::Error>) -> Result<T, RegError> {
        match r {
            Ok(v) => {
                if !self.etcd_ok.swap(true, Ordering::SeqCst) {
                    tracing::info!(endpoints = %self.endpoints, "etcd reachable again");
                }
                Ok(v)
            }
            Err(e) => {
                self.counters.etcd_errors.fetch_add(1, Ordering::Relaxed);
                if self.etcd_ok.swap(false, Ordering::SeqCst) {
                    tracing::error!(endpoints = %self.endpoints, error = %e, "etcd unavailable: membership calls fail until it is back");
                }
                Err(RegError::Etcd { endpoints: self.endpoints.clone(), source: e })
            }
        }
    }

    /// Every group with a key in etcd (for the dashboard and the per-group
    /// gauges), sorted.
    pub async fn group_names(&self) -> Result<Vec<String>, RegError> {
        let mut etcd = self.etcd.clone();
        let opts = GetOptions::new().with_prefix().with_keys_only();
        let got = etcd_call!(self, etcd.get(ETCD_ROOT, Some(opts.clone())).await)?;
        let mut names: Vec<String> =
            got.kvs().iter().filter_map(|kv| group_of_key(kv.key()).map(str::to_string)).collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// How long ago this replica last refreshed the node's lease; None when
    /// it does not hold it.
    pub fn heartbeat_age(&self, group: &str, id: &str) -> Option<Duration> {
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(group.to_string(), id.to_string()))
            .map(|l| l.1.elapsed())
    }

    /// Runs one etcd call and records its time.
    async fn timed<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        let t0 = Instant::now();
        let r = call.await;
        self.etcd_latency.observe(t0.elapsed().as_secs_f64());
        r
    }

    /// One read from etcd, for `/healthz` (retried as every call is).
    pub async fn probe(&self) -> Result<(), RegError> {
        let mut etcd = self.etcd.clone();
        etcd_call!(self, etcd.get("/kvcellar/v1/health", None).await).map(|_| ())
    }

    pub fn etcd_healthy(&self) -> bool {
        self.etcd_ok.load(Ordering::SeqCst)
    }

    /// The TTL in whole seconds, rounded up (etcd leases have 1 s resolution).
    fn ttl_secs(&self) -> i64 {
        self.ttl.as_millis().div_ceil(1000).max(1) as i64
    }

    /// The TTL the lease really has, for the nodes' heartbeat period.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_secs() as u64 * 1000
    }

    fn lease_of(&self, group: &str, id: &str) -> Option<i64> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner()).get(&(group.to_string(), id.to_string())).map(|l| l.0)
    }

    fn set_lease(&self, group: &str, id: &str, lease: Option<i64>) -> Option<i64> {
        let mut l = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let k = (group.to_string(), id.to_string());
        match lease {
            Some(v) => l.insert(k, (v, Instant::now())),
            None => l.remove(&k),
        }
        .map(|old| old.0)
    }

    /// Serialises the calls about one node.
    async fn node_lock(&self, group: &str, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self
            .node_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((group.to_string(), id.to_string()))
            .or_default()
            .clone();
        m.lock_owned().await
    }

    /// Forgets leases not refreshed for two TTLs (their nodes died or moved
    /// to another replica; etcd expires the leases themselves) and idle
    /// per-node locks. Called periodically.
    pub fn sweep(&self) {
        let stale = self.ttl * 2;
        self.leases.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, (_, seen)| seen.elapsed() < stale);
        let window = self.handoff + Duration::from_secs(60);
        self.lease_left.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, (asked, _)| asked.elapsed() < window);
        // A lock only this map holds is idle.
        self.node_locks.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, m| Arc::strong_count(m) > 1);
    }

    /// Registers (or re-registers) a node: a new lease, the record bound to
    /// it, and the group's epoch brought up to date.
    /// The latest registration wins: a restarted node (a new instance) must
    /// not wait for its old lease to expire. The instance it replaced is
    /// told so at its next heartbeat.
    pub async fn register(&self, group: &str, rec: &MemberRecord, instance: &str) -> Result<u64, RegError> {
        let _one = self.node_lock(group, &rec.id).await;
        let mut etcd = self.node_client();
        let lease = etcd_call!(self, etcd.lease_grant(self.ttl_secs(), None).await)?.id();
        self.counters.lease_grants.fetch_add(1, Ordering::Relaxed);
        let stored = Stored {
            id: &rec.id,
            addr: &rec.addr,
            weight: rec.weight,
            instance,
            metrics_addr: rec.metrics_addr.as_deref(),
        };
        let value = serde_json::to_vec(&stored).unwrap_or_default();
        etcd_call!(
            self,
            etcd.put(member_key(group, &rec.id), value.clone(), Some(PutOptions::new().with_lease(lease))).await
        )?;
        if let Some(old) = self.set_lease(group, &rec.id, Some(lease)) {
            if old != lease {
                // The record no longer uses it; let it go now rather than at expiry.
                let _ = etcd.lease_revoke(old).await;
            }
        }
        self.counters.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(self.view_via(self.node_client(), &self.node_settles, group).await?.epoch)
    }

    /// Keeps a node's lease alive. A replica that does not hold the lease
    /// the record is bound to takes the node over: a new lease, the same
    /// record rewritten onto it. A node with no record is told to register.
    pub async fn heartbeat(&self, group: &str, id: &str, instance: &str) -> Result<bool, RegError> {
        let _one = self.node_lock(group, id).await;
        let mut etcd = self.node_client();
        let key = member_key(group, id);
        self.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        if let Some(lease) = self.lease_of(group, id) {
            // The record first: a replaced instance's heartbeat must not
            // keep the holder's lease alive (a dead holder would linger).
            let got = etcd_call!(self, etcd.get(key.clone(), None).await)?;
            if let Some(kv) = got.kvs().first().filter(|kv| kv.lease() == lease) {
                check_instance(group, id, kv.value(), instance)?;
                if self.keep_alive(lease).await? {
                    self.set_lease(group, id, Some(lease));
                    return Ok(false);
                }
                self.counters.lease_expiries.fetch_add(1, Ordering::Relaxed);
            }
            self.set_lease(group, id, None);
        }
        // Take over: the record as it is, on a lease of ours.
        let got = etcd_call!(self, etcd.get(key.clone(), None).await)?;
        let Some(kv) = got.kvs().first() else {
            return Err(RegError::NotRegistered(format!(
                "node {id} of group {group} has no record (its lease expired or it never registered): register again"
            )));
        };
        check_instance(group, id, kv.value(), instance)?;
        let lease = etcd_call!(self, etcd.lease_grant(self.ttl_secs(), None).await)?.id();
        self.counters.lease_grants.fetch_add(1, Ordering::Relaxed);
        let txn = Txn::new()
            .when([Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision())])
            .and_then([TxnOp::put(key, kv.value().to_vec(), Some(PutOptions::new().with_lease(lease)))]);
        let done = self.track(self.timed(etcd.txn(txn)).await)?;
        if !done.succeeded() {
            let _ = etcd.lease_revoke(lease).await;
            return Err(RegError::Conflict(format!("node {id}'s record changed during the heartbeat: retry")));
        }
        self.set_lease(group, id, Some(lease));
        self.counters.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(group, id, lease = format!("{lease:x}"), "took the node over (its lease was not held here)");
        Ok(true)
    }

    /// One keep-alive round trip; false when the lease no longer exists.
    async fn keep_alive(&self, lease: i64) -> Result<bool, RegError> {
        let mut etcd = self.node_client();
        // Opening the keep-alive stream sends one keep-alive and reads its
        // answer: that is the whole round trip.
        let answer = tokio::time::timeout(Duration::from_secs(5), self.timed(etcd.lease_keep_alive(lease))).await;
        match answer {
            Ok(Ok(_)) => self.track(Ok(true)),
            // etcd answers an unknown lease (expired, or etcd's state lost)
            // with TTL 0, which the client reports as "lease not found".
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m.contains("not found") => Ok(false),
            Ok(Err(etcd_client::Error::GRpcStatus(st))) if st.message().contains("not found") => Ok(false),
            Ok(Err(e)) => self.track(Err(e)),
            Err(_) => {
                self.track(Err(etcd_client::Error::LeaseKeepAliveError("no keep-alive answer within 5 s".into())))
            }
        }
    }

    /// Removes a node at once (graceful leave).
    /// Only the instance that holds the record removes it: a node replaced
    /// by another with the same id does not delete the other's record.
    pub async fn deregister(&self, group: &str, id: &str, instance: &str) -> Result<u64, RegError> {
        let _one = self.node_lock(group, id).await;
        let mut etcd = self.node_client();
        let key = member_key(group, id);
        let got = etcd_call!(self, etcd.get(key.clone(), None).await)?;
        if let Some(kv) = got.kvs().first() {
            check_instance(group, id, kv.value(), instance)?;
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision())])
                .and_then([TxnOp::delete(key, None)]);
            if !self.track(self.timed(etcd.txn(txn)).await)?.succeeded() {
                return Err(RegError::Conflict(format!("node {id}'s record changed during the leave: retry")));
            }
        }
        if let Some(lease) = self.set_lease(group, id, None) {
            let _ = etcd.lease_revoke(lease).await;
        }
        self.counters.deregistrations.fetch_add(1, Ordering::Relaxed);
        Ok(self.view_via(self.node_client(), &self.node_settles, group).await?.epoch)
    }

    /// Sets the group's placement rule (`ketama` removes the key): the
    /// next view names the members under it with a new epoch, and keeps the
    /// set under the old rule as a previous set for the handoff window.
    pub async fn set_placement(&self, group: &str, rule: kv_common::ring::Placement) -> Result<View, RegError> {
        let mut etcd = self.etcd.clone();
        let key = placement_key(group);
        if rule == kv_common::ring::Placement::Ketama {
            etcd_call!(self, etcd.delete(key.clone(), None).await)?;
        } else {
            etcd_call!(self, etcd.put(key.clone(), rule.name(), None).await)?;
        }
        tracing::info!(group, placement = rule.name(), "placement rule set");
        self.view(group).await
    }

    /// The group's tenants' quotas (docs/DEPLOY.md, "Tenants"): one etcd
    /// key, a JSON object of tenant name to share, outside the epoch's
    /// digest (a quota changes no placement). A value that does not parse
    /// (written by hand) is one clear error; nodes keep the quotas they had.
    pub async fn quotas(&self, group: &str) -> Result<(kv_common::quota::Quotas, i64), RegError> {
        let (parsed, rev) = self.read_quotas(group).await?;
        parsed.map(|q| (q, rev)).map_err(RegError::Invalid)
    }

    /// The group's quotas as stored, or why they do not parse, with the
    /// key's revision either way (0: no key).
    async fn read_quotas(&self, group: &str) -> Result<(Result<kv_common::quota::Quotas, String>, i64), RegError> {
        let mut etcd = self.etcd.clone();
        let got = etcd_call!(self, etcd.get(tenants_key(group), None).await)?;
        let Some(kv) = got.kvs().first() else {
            return Ok((Ok(Default::default()), 0));
        };
        let parsed = serde_json::from_slice::<std::collections::BTreeMap<String, String>>(kv.value())
            .map_err(|e| e.to_string())
            .and_then(|m| kv_common::quota::Quotas::from_strings(&m))
            .map_err(|e| format!("group {group}'s quotas in etcd do not parse ({e}): set them again"));
        Ok((parsed, kv.mod_revision()))
    }

    /// Sets (`Some`) or removes (`None`) one tenant's quota, and returns
    /// the group's quotas after it. The table is read, changed and written
    /// back only if nobody changed it meanwhile (retried a few times).
    pub async fn set_quota(
        &self,
        group: &str,
        tenant: &str,
        quota: Option<kv_common::quota::Quota>,
    ) -> Result<kv_common::quota::Quotas, RegError> {
        let key = tenants_key(group);
        for _ in 0..8 {
            let (mut q, rev) = match self.read_quotas(group).await? {
                (Ok(q), rev) => (q, rev),
                // A table that does not parse is replaced by this one entry
                // (if nobody replaced it meanwhile).
                (Err(_), rev) if quota.is_some() => (Default::default(), rev),
                (Err(e), _) => return Err(RegError::Invalid(e)),
            };
            match quota {
                Some(v) => q.insert(tenant, v).map_err(RegError::Invalid)?,
                None => {
                    if q.0.remove(tenant).is_none() {
                        return Ok(q);
                    }
                }
            }
            let value = serde_json::to_vec(&q.to_strings()).unwrap_or_default();
            let txn = || {
                // Revision 0: the key is absent.
                let when = vec![Compare::mod_revision(key.clone(), CompareOp::Equal, rev)];
                let op = if q.is_empty() {
                    TxnOp::delete(key.clone(), None)
                } else {
                    TxnOp::put(key.clone(), value.clone(), None)
                };
                Txn::new().when(when).and_then([op])
            };
            let mut etcd = self.etcd.clone();
            let done = etcd_call!(self, etcd.txn(txn()).await)?;
            if done.succeeded() {
                tracing::info!(group, tenant, quota = ?quota.map(|q| q.to_string()), "tenant quota set");
                return Ok(q);
            }
        }
        Err(RegError::Conflict(format!("group {group}'s quotas kept changing under this call: retry")))
    }

    /// The group's view, its epoch brought up to date first (module docs).
    pub async fn view(&self, group: &str) -> Result<View, RegError> {
        self.view_via(self.etcd.clone(), &self.settles, group).await
    }

    /// As [`Registry::view`], through `etcd` (nodes' calls read through
    /// theirs, driven on the nodes' runtime, and queue in `queues`).
    ///
    /// Calls for one group settle one at a time in a queue, and one
    /// settling serves every call that arrived before it began (its read
    /// comes after their writes): a fleet registering 32 nodes at once on a
    /// replica costs etcd a few settlings, not 32 racing each other
    /// (docs/ARCHITECTURE.md, "kv-mds"). A call that waited SETTLE_BUDGET,
    /// in the queue or settling, is told to retry.
    async fn view_via(&self, etcd: Client, queues: &SettleQueues, group: &str) -> Result<View, RegError> {
        let deadline = tokio::time::Instant::now() + SETTLE_BUDGET;
        let queue = Queued::join(queues, group);
        let me = queue.q.arrived.fetch_add(1, Ordering::SeqCst) + 1;
        let mut last = tokio::time::timeout_at(deadline, queue.q.last.lock()).await.map_err(|_| unsettled(group))?;
        if let Some((_, r)) = last.as_ref().filter(|(covered, _)| *covered >= me) {
            self.counters.settles_shared.fetch_add(1, Ordering::Relaxed);
            return r.clone().map_err(RegError::Conflict);
        }
        let covered = queue.q.arrived.load(Ordering::SeqCst);
        let r = self.settle(etcd, group, deadline).await;
        *last = Some((covered, r.as_ref().map(View::clone).map_err(|e| e.to_string())));
        r
    }

    /// Reads the group's view, moving its epoch first when the member set
    /// changed since the epoch key was last written.
    ///
    /// A settling dropped between its lease grant and its transaction (the
    /// caller gave up) leaves that lease to expire on its own.
    async fn settle(&self, mut etcd: Client, group: &str, deadline: tokio::time::Instant) -> Result<View, RegError> {
        let ekey = epoch_key(group);
        let ckey = current_key(group);
        self.counters.views.fetch_add(1, Ordering::Relaxed);
        for round in 0u32.. {
            if round > 0 {
                // Another replica moved the epoch first. Two replicas that
                // read again at once would race again: each waits a random
                // while, longer each round, and gives up at the deadline.
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                self.counters.settle_retries.fetch_add(1, Ordering::Relaxed);
                let cap_us = 1000u64 << round.min(5);
                tokio::time::sleep(Duration::from_micros(kv_common::mds::random_below(cap_us as usize) as u64)).await;
            }
            let got = etcd_call!(self, etcd.get(group_prefix(group), Some(GetOptions::new().with_prefix())).await)?;
            let members = parse_members(got.kvs());
            let placement = placement_in(group, got.kvs());
            let want = digest(&members, placement.as_deref());
            let epoch_kv = got.kvs().iter().find(|kv| kv.key() == ekey.as_bytes());
            match epoch_kv {
                Some(e) if e.value() == want.as_bytes() => {
                    return Ok(self
                        .assemble(&etcd, group, e.mod_revision() as u64, members, placement, got.kvs())
                        .await);
                }
                None if members.is_empty() => {
                    return Ok(self.assemble(&etcd, group, 0, members, placement, got.kvs()).await);
                }
                _ => {}
            }
            let seen = epoch_kv.map(|e| e.mod_revision()).unwrap_or(0);
            let current = Current::new(placement_only(&members), placement.as_deref());
            let mut ops = vec![
                TxnOp::put(ekey.clone(), want.clone(), None),
                TxnOp::put(ckey.clone(), serde_json::to_vec(&current).unwrap_or_default(), None),
            ];
            // The set being replaced, when `current` names it (a group last
            // changed by a replica without handoff has none).
            let replaced: Option<(Vec<MemberRecord>, Option<String>)> = got
                .kvs()
                .iter()
                .find(|kv| kv.key() == ckey.as_bytes())
                .filter(|kv| seen > 0 && kv.mod_revision() == seen)
                .and_then(|kv| serde_json::from_slice::<Current>(kv.value()).ok())
                .map(Current::into_parts);
            let mut lease = None;
            // The leases of the history keys this transaction deletes: once
            // it succeeded, each is revoked (otherwise every change would
            // leave one live lease for the whole window, docs/PROTOCOL.md §6.1).
            let mut trimmed: Vec<i64> = Vec::new();
            // The history is best effort: without a lease for it, the
            // epoch still moves (clients keep the set they held themselves).
            let granted = match (&replaced, self.handoff_secs() > 0) {
                (Some(_), true) => etcd_call!(self, etcd.lease_grant(self.handoff_secs(), None).await).ok(),
                _ => None,
            };
            if let (Some((old, old_rule)), Some(g)) = (replaced, granted) {
                let l = g.id();
                lease = Some(l);
                let delta = PreviousSet::between(&placement_only(&members), &old, seen as u64, 0);
                let h = History { epoch: seen as u64, joined: delta.joined, left: delta.left, placement: old_rule };
                ops.push(TxnOp::put(
                    history_key(group, seen as u64),
                    serde_json::to_vec(&h).unwrap_or_default(),
                    Some(PutOptions::new().with_lease(l)),
                ));
                // Keep the newest sets only: this one and MAX - 1 before it.
                let hprefix = history_prefix(group);
                let mut older: Vec<&etcd_client::KeyValue> =
                    got.kvs().iter().filter(|kv| kv.key().starts_with(hprefix.as_bytes())).collect();
                older.sort_unstable_by(|a, b| b.key().cmp(a.key()));
                for kv in older.into_iter().skip(MAX_PREVIOUS_SETS - 1) {
                    ops.push(TxnOp::delete(kv.key().to_vec(), None));
                    if kv.lease() != 0 {
                        trimmed.push(kv.lease());
                    }
                }
            }
            let txn = Txn::new().when([Compare::mod_revision(ekey.clone(), CompareOp::Equal, seen)]).and_then(ops);
            let done = self.track(self.timed(etcd.txn(txn)).await)?;
            if !done.succeeded() {
                if let Some(l) = lease {
                    let _ = etcd.lease_revoke(l).await;
                }
                continue; // another replica moved the epoch: read again
            }
            // The key now names the set read above at this revision: that
            // is the view, even when members changed since the read (the
            // next reader finds the digest stale and moves the epoch again).
            let rev = done.header().map(|h| h.revision()).unwrap_or(0) as u64;
            self.counters.epoch_bumps.fetch_add(1, Ordering::Relaxed);
            tracing::info!(group, epoch = rev, members = members.len(), "member set changed: new epoch");
            self.revoke_trimmed(&mut etcd, group, &trimmed).await;
            // The history as it is now (this transaction's key included).
            let after = etcd_call!(self, etcd.get(history_prefix(group), Some(GetOptions::new().with_prefix())).await)?;
            return Ok(self.assemble(&etcd, group, rev, members, placement, after.kvs()).await);
        }
        tracing::warn!(group, "the group's members kept changing: no epoch settled within {SETTLE_BUDGET:?}");
        Err(unsettled(group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(id: &str, addr: &str, w: u32) -> MemberRecord {
        MemberRecord { id: id.into(), addr: addr.into(), weight: w, metrics_addr: None }
    }

    #[test]
    fn digest_tracks_the_member_set_and_rule_only() {
        let a = vec![m("n1", "h:1", 1), m("n2", "h:2", 1)];
        assert_eq!(digest(&a, None), digest(&a.clone(), None));
        assert_ne!(digest(&a, None), digest(&[m("n1", "h:1", 1), m("n2", "h:2", 2)], None));
        assert_ne!(digest(&a, None), digest(&[m("n1", "h:1", 1)], None));
        assert_ne!(digest(&a, None), digest(&[m("n1", "h:1", 1), m("n2", "h:3", 1)], None));
        assert_ne!(digest(&[], None), digest(&[m("n1", "h:1", 1)], None));
        assert_ne!(digest(&a, None), digest(&a, Some("multiprobe")), "a rule switch is a new epoch");
        // Ketama groups keep the digest older replicas compute.
        assert_eq!(digest(&a, None), "377458be34bc488700000002");
    }

    #[test]
    fn current_reads_both_forms() {
        let a = vec![m("n1", "h:1", 1)];
        let bare = serde_json::to_vec(&Current::new(a.clone(), None)).unwrap();
        assert!(bare.starts_with(b"["), "Ketama keeps the bare array older replicas read");
        let (got, rule) = serde_json::from_slice::<Current>(&bare).unwrap().into_parts();
        assert_eq!((got, rule), (a.clone(), None));
        let placed = serde_json::to_vec(&Current::new(a.clone(), Some("multiprobe"))).unwrap();
        let (got, rule) = serde_json::from_slice::<Current>(&placed).unwrap().into_parts();
        assert_eq!((got, rule.as_deref()), (a, Some("multiprobe")));
    }

    #[test]
    fn keys_name_their_group() {
        assert_eq!(group_of_key(member_key("g1", "n").as_bytes()), Some("g1"));
        assert_eq!(group_of_key(epoch_key("g2").as_bytes()), Some("g2"));
        assert_eq!(group_of_key(b"/other"), None);
    }
}
