//! The state a node's connections share ([`Shared`]), built once from the
//! node's configuration ([`NodeSettings`]), and the one statistics record
//! every reader takes from it ([`Shared::stats`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kv_common::stats::NodeStats;
use kv_common::wire::Limits;
use tokio::sync::Semaphore;

use crate::store::Store;

/// State every connection shares.
pub struct Shared {
    pub store: Arc<Store>,
    pub limits: Limits,
    /// Bytes of put bodies held at once, in 4 KiB units.
    pub inflight_bytes: Arc<Semaphore>,
    /// `inflight_bytes`' size in 4 KiB units: no request asks for more.
    pub inflight_units: u32,
    /// Store operations running in the blocking pool at once.
    pub io_slots: Semaphore,
    pub connections: AtomicU64,
    /// A connection with no request in flight and none arriving for this
    /// long is closed (None: never).
    pub idle_timeout: Option<std::time::Duration>,
    /// Time for the hello, for a begun frame (plus 1 s per MiB) and for a
    /// response to be taken (30 s; tests shorten it).
    pub frame_timeout: std::time::Duration,
    /// The group's credentials: a client must present one of their
    /// tokens in its hello (replaced on SIGHUP; None: open).
    pub token: Option<Arc<kv_common::auth::Reloadable<kv_common::auth::Credentials>>>,
    /// Hellos refused for the token, and accepted in protocol v1.
    pub denied: AtomicU64,
    pub v1_accepted: AtomicU64,
    /// Connections refused at the connection cap.
    pub refused: AtomicU64,
    /// The last statistics gathered ([`Shared::stats`]).
    pub snapshot: Fresh<NodeStats>,
    /// Which tenants the statistics name, and `other`'s counters.
    tenant_rank: std::sync::Mutex<crate::tenant_rank::Ranking>,
    /// What the data port's accept loop counts (connections closed before
    /// their hello).
    pub listener: Arc<kv_common::listen::Counters>,
    /// When a refused peer was last logged (one line per 10 s at most) and
    /// how many refusals went unlogged since.
    pub denied_log: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
    /// Requests answered, by op and status, and their service time.
    pub ops: crate::op_metrics::OpMetrics,
    /// What recovery found at start (for `/metrics`).
    pub recovery: Recovery,
    /// `--id` and `--group` when the node joins a group.
    pub node_id: Option<String>,
    pub group: Option<String>,
    /// The transport that reaches clients' memory ([`crate::transport`]):
    /// sets up a connection's when asked, and counts.
    pub fabric: Arc<dyn crate::transport::Fabric>,
    /// Tombstones and counters of ring handoff (docs/ARCHITECTURE.md).
    pub handoff: crate::handoff::Handoff,
    /// Reads per key and the keys marked hot (docs/ARCHITECTURE.md, "Hot keys").
    pub heat: crate::heat::Heat,
    /// True from a SIGTERM until the drain ends: the node has left its group
    /// and answers gets, exists and deletes, never puts.
    pub draining: std::sync::atomic::AtomicBool,
}

/// A value gathered at most once at a time and shared by every caller that
/// waited for that gather. Gathering the node's statistics takes each
/// disk's index lock: with this, any number of scrapers and dashboards cost
/// the puts at most one gather in flight, and each caller still gets values
/// taken after its call began (never a stale copy).
pub struct Fresh<T> {
    last: std::sync::Mutex<Option<(std::time::Instant, Arc<T>)>>,
    /// Gathers run, and callers between taking their start time and the lock.
    pub gathers: AtomicU64,
    pub waiting: AtomicU64,
}

impl<T> Default for Fresh<T> {
    fn default() -> Fresh<T> {
        Fresh { last: std::sync::Mutex::new(None), gathers: AtomicU64::new(0), waiting: AtomicU64::new(0) }
    }
}

impl<T> Fresh<T> {
    /// The value of a gather that began after this call did: the last one
    /// when it qualifies, else a new one by `gather` (blocking).
    pub fn get(&self, gather: impl FnOnce() -> T) -> Arc<T> {
        let asked = std::time::Instant::now();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut g = self.last.lock().unwrap_or_else(|e| e.into_inner());
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        if let Some((began, v)) = &*g {
            if *began >= asked {
                return v.clone();
            }
        }
        let began = std::time::Instant::now();
        let v = Arc::new(gather());
        self.gathers.fetch_add(1, Ordering::Relaxed);
        *g = Some((began, v.clone()));
        v
    }
}

/// What a node is configured with, for the state its connections share
/// ([`Shared::new`]). [`NodeSettings::new`] has the defaults of the
/// configuration keys (docs/DEPLOY.md).
#[derive(Clone)]
pub struct NodeSettings {
    /// The largest record taken (`--max-record`), told in the hello.
    pub max_record: u64,
    /// Bytes of put bodies and unsent get records held at once (`--max-inflight`).
    pub max_inflight: u64,
    /// A connection idle this long is closed (`--idle-timeout`; None: never).
    pub idle_timeout: Option<std::time::Duration>,
    /// Time for a begun frame and for a response to be taken (tests shorten it).
    pub frame_timeout: std::time::Duration,
    /// The group's credentials (`--auth-token-file`).
    pub token: Option<kv_common::auth::Credentials>,
    /// How long a deleted key's copies are refused (`--handoff-secs`).
    pub handoff_window: std::time::Duration,
    /// `--id` and `--group` when the node joins a group.
    pub node_id: Option<String>,
    pub group: Option<String>,
    /// What the disks' recovery found at start.
    pub recovery: Recovery,
    /// The transport that reaches clients' memory (`--rdma-dev`:
    /// [`crate::rdma::Rdma::start`]; none named: TCP only).
    pub fabric: Arc<dyn crate::transport::Fabric>,
    /// How hot keys are marked (`--hot-reads`, `--hot-window-ms`).
    pub heat: crate::heat::HeatConfig,
}

impl NodeSettings {
    /// The defaults, with these limits.
    pub fn new(max_record: u64, max_inflight: u64) -> NodeSettings {
        NodeSettings {
            max_record,
            max_inflight,
            idle_timeout: Some(std::time::Duration::from_secs(120)),
            frame_timeout: crate::frame::FRAME_TIMEOUT,
            token: None,
            handoff_window: std::time::Duration::from_secs(600),
            node_id: None,
            group: None,
            recovery: Recovery::default(),
            fabric: Arc::new(crate::rdma::Rdma::unconfigured()),
            heat: crate::heat::HeatConfig::default(),
        }
    }
}

/// What the disks' recovery found at start, summed over the disks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recovery {
    pub records: u64,
    pub reclaimed: u64,
    pub seconds: f64,
}

impl Shared {
    /// The state of a node over `store`, built from its settings.
    pub fn new(store: Arc<Store>, settings: NodeSettings) -> Shared {
        let NodeSettings {
            max_record,
            max_inflight,
            idle_timeout,
            frame_timeout,
            token,
            handoff_window,
            node_id,
            group,
            recovery,
            fabric,
            heat,
        } = settings;
        let units = max_inflight.div_ceil(4096).min(Semaphore::MAX_PERMITS as u64).min(u64::from(u32::MAX)) as usize;
        Shared {
            store,
            limits: Limits { max_record },
            inflight_bytes: Arc::new(Semaphore::new(units)),
            inflight_units: units as u32,
            io_slots: Semaphore::new(64),
            connections: AtomicU64::new(0),
            idle_timeout,
            frame_timeout,
            token: token.map(|t| Arc::new(kv_common::auth::Reloadable::new(t))),
            denied: AtomicU64::new(0),
            v1_accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            listener: Arc::default(),
            snapshot: Fresh::default(),
            tenant_rank: Default::default(),
            denied_log: std::sync::Mutex::new((None, 0)),
            ops: crate::op_metrics::OpMetrics::default(),
            recovery,
            node_id,
            group,
            fabric,
            handoff: crate::handoff::Handoff::new(handoff_window),
            heat: crate::heat::Heat::new(heat),
            draining: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The node's statistics, as of a moment after the call began: the one
    /// record the STATS op, `/metrics`, `/api/stats`, the health checks and
    /// the dashboard all read ([`Fresh`]: one gather at a time, shared by
    /// the callers that waited for it). Blocking: call it off the reactor.
    pub fn stats(&self) -> Arc<NodeStats> {
        self.snapshot.get(|| self.gather())
    }

    /// Each tenant's holding, quota, gets and puts, named from the
    /// credential table in use and the quotas: the largest
    /// [`kv_common::stats::MAX_TENANTS_SHOWN`] by bytes one by one, the
    /// rest summed as `other` (logged once: more tenants than a node
    /// shows), whose counters never go down ([`crate::tenant_rank`]).
    fn tenant_stats(&self) -> Vec<kv_common::stats::TenantStats> {
        use kv_common::stats::{TenantStats, MAX_TENANTS_SHOWN};
        use std::collections::BTreeMap;
        let mut names: std::collections::HashMap<u32, String> = match &self.token {
            Some(t) => t.get().entries().iter().filter_map(|c| c.tenant.clone().map(|n| (c.tenant_id(), n))).collect(),
            None => Default::default(),
        };
        let quotas = self.store.quotas();
        for n in quotas.0.keys() {
            names.insert(kv_common::quota::tenant_id_of(n), n.clone());
        }
        let name = |id: u32| match id {
            crate::tenant::DEFAULT => "default".to_string(),
            id => names.get(&id).cloned().unwrap_or_else(|| format!("id-{id:08x}")),
        };
        let mut by_id: BTreeMap<u32, TenantStats> = BTreeMap::new();
        for (id, u) in self.store.tenants() {
            let t = by_id.entry(id).or_default();
            t.bytes = u.bytes;
            t.objects = u.objects;
            t.evictions = u.evictions;
            t.evicted_for_others = u.evicted_for_others;
        }
        for (id, b) in self.store.quota_bytes() {
            by_id.entry(id).or_default().quota = b;
        }
        let mut counted_apart = None;
        for (id, [hits, misses, puts]) in self.store.tenant_ops() {
            if id == crate::store::tenants::OTHER {
                counted_apart = Some(TenantStats { hits, misses, puts, ..Default::default() });
                continue;
            }
            let t = by_id.entry(id).or_default();
            (t.hits, t.misses, t.puts) = (hits, misses, puts);
        }
        let mut all: Vec<(u32, TenantStats)> = by_id.into_iter().collect();
        // A tenant with nothing held nor done here is left out.
        all.retain(|(id, t)| *id == crate::tenant::DEFAULT || *t != TenantStats::default());
        if all.len() > MAX_TENANTS_SHOWN {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(tenants = all.len(), shown = MAX_TENANTS_SHOWN, "more tenants hold pages here than the statistics name one by one: the smallest are summed as `other`");
            });
        }
        let (named, other) = self.tenant_rank.lock().unwrap_or_else(|e| e.into_inner()).rank(all, counted_apart);
        let mut out: Vec<TenantStats> =
            named.into_iter().map(|(id, t)| TenantStats { tenant: name(id), ..t }).collect();
        out.extend(other);
        out
    }

    fn gather(&self) -> NodeStats {
        let mut s = self.store.stats();
        s.connections = self.connections.load(Ordering::Relaxed);
        s.denied_connections = self.denied.load(Ordering::Relaxed);
        s.v1_connections = self.v1_accepted.load(Ordering::Relaxed);
        s.refused_connections = self.refused.load(Ordering::Relaxed);
        s.closed_before_hello = self.listener.openings_closed.load(Ordering::Relaxed);
        s.node_id = self.node_id.clone();
        s.group = self.group.clone();
        s.latency = self.ops.latencies();
        s.draining = self.draining.load(Ordering::Relaxed);
        let h = &self.handoff;
        s.handoff_asks = h.asks.load(Ordering::Relaxed);
        s.handoff_hits = h.hits.load(Ordering::Relaxed);
        s.handoff_copies = h.copies.load(Ordering::Relaxed);
        s.handoff_copy_bytes = h.copy_bytes.load(Ordering::Relaxed);
        s.handoff_refused = h.refused.load(Ordering::Relaxed);
        s.handoff_too_old = h.too_old.load(Ordering::Relaxed);
        s.tombstones = h.tombstones();
        s.drain_pushed = h.pushed.load(Ordering::Relaxed);
        s.drain_pushed_bytes = h.pushed_bytes.load(Ordering::Relaxed);
        s.drain_push_failed = h.push_failed.load(Ordering::Relaxed);
        s.drain_push_owner_failed = h.push_failed_owner.load(Ordering::Relaxed);
        s.drain_push_left = h.push_left.load(Ordering::Relaxed);
        s.drain_push_owners = h.push_owners.load(Ordering::Relaxed);
        let heat = self.heat.stats();
        s.hot_keys = heat.hot_keys;
        s.hot_reads = heat.hot_reads;
        s.hot_marked = heat.hot_marked;
        s.hot_refused = heat.hot_refused;
        s.hot_threshold = heat.threshold;
        s.hot_fills = h.fills.load(Ordering::Relaxed);
        s.hot_copies_held = h.copies_held(|k| self.store.record_size(k).is_some());
        s.tenants = self.tenant_stats();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Callers that arrive while a gather runs wait for the next one and
    /// share it: eight scrapers during one slow gather cost one more gather,
    /// not seven, and every one of them gets values taken after it asked.
    #[test]
    fn callers_during_a_gather_share_the_next_one() {
        let fresh = Arc::new(Fresh::<u64>::default());
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let first = {
            let fresh = fresh.clone();
            std::thread::spawn(move || {
                *fresh.get(|| {
                    entered_tx.send(()).expect("signal");
                    release_rx.recv().expect("release");
                    1
                })
            })
        };
        entered_rx.recv().expect("the first gather runs");
        let late: Vec<_> = (0..7)
            .map(|_| {
                let fresh = fresh.clone();
                std::thread::spawn(move || *fresh.get(|| 2))
            })
            .collect();
        let t0 = std::time::Instant::now();
        while fresh.waiting.load(Ordering::SeqCst) < 7 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the late callers wait");
            std::thread::yield_now();
        }
        release_tx.send(()).expect("release");
        assert_eq!(first.join().expect("join"), 1);
        for t in late {
            assert_eq!(t.join().expect("join"), 2, "a late caller never gets the gather that began before it");
        }
        assert_eq!(fresh.gathers.load(Ordering::Relaxed), 2);
    }
}
