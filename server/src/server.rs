//! The listener: accepts connections under a cap, hands each to
//! [`crate::conn::serve`], runs periodic store upkeep, and on shutdown stops
//! accepting, lets connections finish what they started, then checkpoints
//! the store so the next start trusts it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_common::stats::NodeStats;
use kv_common::wire::Limits;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::store::Store;

/// State every connection shares.
pub struct Shared {
    pub store: Arc<Store>,
    pub limits: Limits,
    /// Bytes of put bodies held at once, in 4 KiB units.
    pub inflight_bytes: Arc<Semaphore>,
    /// Store operations running in the blocking pool at once.
    pub io_slots: Semaphore,
    pub connections: AtomicU64,
    /// A connection with no request in flight and none arriving for this
    /// long is closed (None: never).
    pub idle_timeout: Option<std::time::Duration>,
    /// Time for the hello, for a begun frame (plus 1 s per MiB) and for a
    /// response to be taken (30 s; tests shorten it).
    pub frame_timeout: std::time::Duration,
    /// The group's auth token: a client must present it in its hello.
    pub token: Option<kv_common::auth::Token>,
    /// Hellos refused for the token, and accepted in protocol v1.
    pub denied: AtomicU64,
    pub v1_accepted: AtomicU64,
    /// Connections refused at the connection cap.
    pub refused: AtomicU64,
    /// When a refused peer was last logged (one line per 10 s at most) and
    /// how many refusals went unlogged since.
    pub denied_log: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
    /// Requests answered, by op and status, and their service time.
    pub ops: crate::metrics::OpMetrics,
    /// What recovery found at start (for `/metrics`).
    pub recovery: Recovery,
    /// `--id` and `--group` when the node joins a group.
    pub node_id: Option<String>,
    pub group: Option<String>,
    /// RDMA counters of this process (always present: a fallback counts).
    pub rdma_counters: Arc<kv_common::rdma::Counters>,
    /// The RDMA engine when devices were named and usable (else TCP only),
    /// and the depth this node grants per queue pair.
    pub rdma: Option<Arc<kv_common::rdma::engine::Runtime>>,
    pub rdma_depth: u32,
    /// Why this node offers no RDMA (told to clients that ask).
    pub rdma_off: String,
    /// Tombstones and counters of ring handoff (docs/ARCHITECTURE.md).
    pub handoff: crate::handoff::Handoff,
    /// True from a SIGTERM until the drain ends: the node has left its group
    /// and answers gets, exists and deletes, never puts.
    pub draining: std::sync::atomic::AtomicBool,
}

/// What the disks' recovery found at start, summed over the disks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recovery {
    pub records: u64,
    pub reclaimed: u64,
    pub seconds: f64,
}

impl Shared {
    pub fn new(store: Arc<Store>, max_record: u64, max_inflight: u64) -> Shared {
        let units = max_inflight.div_ceil(4096).min(Semaphore::MAX_PERMITS as u64) as usize;
        Shared {
            store,
            limits: Limits { max_record },
            inflight_bytes: Arc::new(Semaphore::new(units)),
            io_slots: Semaphore::new(64),
            connections: AtomicU64::new(0),
            idle_timeout: Some(std::time::Duration::from_secs(120)),
            frame_timeout: crate::conn::FRAME_TIMEOUT,
            token: None,
            denied: AtomicU64::new(0),
            v1_accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            denied_log: std::sync::Mutex::new((None, 0)),
            ops: crate::metrics::OpMetrics::default(),
            recovery: Recovery::default(),
            node_id: None,
            group: None,
            rdma_counters: Arc::new(kv_common::rdma::Counters::default()),
            rdma: None,
            rdma_depth: kv_common::rdma::DEFAULT_DEPTH,
            rdma_off: "no RDMA device named on this node (--rdma-dev)".into(),
            handoff: crate::handoff::Handoff::new(std::time::Duration::from_secs(600)),
            draining: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn stats(&self) -> NodeStats {
        let mut s = self.store.stats();
        s.connections = self.connections.load(Ordering::Relaxed);
        s.denied_connections = self.denied.load(Ordering::Relaxed);
        s.v1_connections = self.v1_accepted.load(Ordering::Relaxed);
        s.refused_connections = self.refused.load(Ordering::Relaxed);
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
        s.tombstones = h.tombstones();
        s.drain_pushed = h.pushed.load(Ordering::Relaxed);
        s.drain_pushed_bytes = h.pushed_bytes.load(Ordering::Relaxed);
        s.drain_push_failed = h.push_failed.load(Ordering::Relaxed);
        s
    }
}

/// Serves on `listener` until `shutdown` turns true, then drains and
/// checkpoints. Returns the checkpoint's result.
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    max_conns: usize,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let conns = Arc::new(Semaphore::new(max_conns));
    let mut tasks = tokio::task::JoinSet::new();
    let upkeep = tokio::spawn(upkeep(shared.store.clone(), shutdown.clone()));
    let mut backoff = Duration::from_millis(5);
    let refusing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut refused_logged: Option<std::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            biased;
            _ = crate::server::stopped(&mut shutdown) => break,
            a = listener.accept() => a,
        };
        let (stream, peer): (_, SocketAddr) = match accepted {
            Ok(a) => {
                backoff = Duration::from_millis(5);
                a
            }
            Err(e) => {
                // EMFILE and friends: wait and retry rather than spin or die.
                tracing::warn!(error = %e, "accept failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            // At the cap: a clear refusal (a hello saying so), not a wait in
            // the backlog. Refusals being written are bounded too.
            shared.refused.fetch_add(1, Ordering::Relaxed);
            if refused_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                refused_logged = Some(std::time::Instant::now());
                tracing::warn!(%peer, cap = max_conns, "connection cap reached: refusing connections (one line a minute at most)");
            }
            if refusing.load(Ordering::Relaxed) < 64 {
                refusing.fetch_add(1, Ordering::Relaxed);
                let refusing = refusing.clone();
                tokio::spawn(async move {
                    refuse(stream).await;
                    refusing.fetch_sub(1, Ordering::Relaxed);
                });
            }
            continue;
        };
        while tasks.try_join_next().is_some() {}
        let shared = shared.clone();
        let rx = shutdown.clone();
        tasks.spawn(async move {
            shared.connections.fetch_add(1, Ordering::Relaxed);
            crate::conn::serve(stream, peer, shared.clone(), rx).await;
            shared.connections.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    tracing::info!(connections = tasks.len(), "shutting down: finishing requests in flight");
    while tasks.join_next().await.is_some() {}
    let _ = upkeep.await;
    let store = shared.store.clone();
    let r = tokio::task::spawn_blocking(move || store.close()).await;
    r.unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Answers a connection over the cap: takes its hello, answers "busy" and
/// closes after the peer's FIN (so the answer is not lost to a reset), all
/// within a second.
async fn refuse(mut stream: tokio::net::TcpStream) {
    use kv_common::wire::{Hello, HELLO_BUSY, HELLO_LEN, WIRE_VERSION};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut h = [0u8; HELLO_LEN];
        stream.read_exact(&mut h).await?;
        stream.write_all(&Hello { version: WIRE_VERSION, status: HELLO_BUSY, max_record: 0 }.encode()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

async fn upkeep(store: Arc<Store>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = crate::server::stopped(&mut shutdown) => return,
            _ = tick.tick() => {}
        }
        let s = store.clone();
        let _ = tokio::task::spawn_blocking(move || {
            s.maintain();
            // After a crash: check recovered payloads at up to 256 MiB/s.
            s.scrub(256 << 20);
        })
        .await;
    }
}

/// Resolves once shutdown has been signalled (or its sender is gone).
pub async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await.map(|_| ());
}
