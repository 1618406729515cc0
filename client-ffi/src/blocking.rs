//! The blocking facade the C ABI (and any synchronous caller) uses: the
//! async core driven by a small runtime owned by the handle. Calls may come
//! from any number of threads at once.

use std::sync::Arc;

use kv_common::page::Geometry;
use kv_common::status::Status;

use crate::client::Client;
use crate::members::Member;
use crate::options::Options;

pub struct BlockingClient {
    /// Dropped (stopped) before the runtime and the core.
    discovery: std::sync::Mutex<Option<crate::discovery::Discovery>>,
    rt: tokio::runtime::Runtime,
    pub core: Arc<Client>,
}

impl BlockingClient {
    pub fn new(members: Vec<Member>, geo: Geometry, opts: Options) -> std::io::Result<BlockingClient> {
        BlockingClient::over(Client::new(members, geo, opts))
    }

    /// A blocking client around `core` (e.g. one from [`Client::with_rdma`]).
    pub fn over(core: Client) -> std::io::Result<BlockingClient> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvclient-io")
            .enable_all()
            .build()?;
        Ok(BlockingClient { discovery: std::sync::Mutex::new(None), rt, core: Arc::new(core) })
    }

    /// Starts (or restarts) MDS discovery; see `kv_start_mds_discovery`.
    /// `Ok(Ok(epoch))`: the first view is applied; `Ok(Err(why))`: no MDS
    /// answered yet, discovery keeps trying in the background.
    pub fn start_discovery(
        &self,
        endpoints: Vec<String>,
        group: String,
        poll: std::time::Duration,
    ) -> std::io::Result<Result<u64, (kv_common::status::Status, String)>> {
        let mut slot = self.discovery.lock().unwrap_or_else(|e| e.into_inner());
        // Stop the previous discovery before the new one applies views.
        drop(slot.take());
        let first_wait = self.core.opts.connect_timeout * 2 + std::time::Duration::from_secs(1);
        let (d, first) = crate::discovery::start(self.core.clone(), endpoints, group, poll, first_wait)?;
        *slot = Some(d);
        Ok(first)
    }

    pub fn set_members(&self, members: Vec<Member>) -> u64 {
        self.core.set_members(members)
    }

    pub fn putv(&self, key: &[u8], bufs: &[&[u8]]) -> Status {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| self.rt.block_on(self.core.putv(key, bufs)));
        self.core.metrics.timed("put", t0);
        r
    }

    pub fn getv(&self, key: &[u8], bufs: &mut [&mut [u8]]) -> Result<usize, (Status, usize)> {
        let t0 = std::time::Instant::now();
        // On the caller's thread where it can be (see `small.rs`).
        let r = crate::call::scoped(|| match self.core.getv_blocking(key, bufs) {
            Some(r) => r,
            None => self.rt.block_on(self.core.getv(key, bufs)),
        });
        self.core.metrics.timed("get", t0);
        r
    }

    pub fn delete(&self, key: &[u8]) -> Status {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| self.rt.block_on(self.core.delete(key)));
        self.core.metrics.timed("delete", t0);
        r
    }

    /// On the caller's thread (no runtime hop): see `small.rs`.
    pub fn exist(&self, key: &[u8]) -> Status {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| {
            if self.core.exists_want_async(&[key]) {
                self.rt.block_on(self.core.exist(key))
            } else {
                self.core.exist_blocking(key)
            }
        });
        self.core.metrics.timed("exist", t0);
        r
    }

    /// On the caller's thread (no runtime hop): see `small.rs`.
    pub fn batch_exist(&self, keys: &[&[u8]]) -> Vec<Status> {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| {
            if self.core.exists_want_async(keys) {
                self.rt.block_on(self.core.batch_exist(keys))
            } else {
                self.core.batch_exist_blocking(keys)
            }
        });
        self.core.metrics.timed("batch_exist", t0);
        r
    }

    /// Per-key Ok or Miss: one BATCH_DELETE frame per owner where nodes
    /// take it (see `Client::batch_delete`).
    pub fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Status> {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| self.rt.block_on(self.core.batch_delete(keys)));
        self.core.metrics.timed("batch_delete", t0);
        r
    }

    pub fn batch_putv(&self, items: &[(&[u8], Vec<&[u8]>)]) -> Vec<Status> {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| self.rt.block_on(self.core.batch_putv(items)));
        self.core.metrics.timed("batch_put", t0);
        r
    }

    pub fn batch_getv(&self, items: &mut [crate::client::GetItem<'_, '_>]) -> Vec<(Status, usize)> {
        let t0 = std::time::Instant::now();
        let r = crate::call::scoped(|| self.rt.block_on(self.core.batch_getv(items)));
        self.core.metrics.timed("batch_get", t0);
        r
    }

    /// OpenMetrics text: counters, latency histograms and per-peer state.
    pub fn stats_text(&self) -> String {
        let topo = self.core.topology();
        let peers = topo
            .nodes
            .iter()
            .map(|n| crate::metrics::PeerSnapshot {
                id: n.id.clone(),
                addr: n.addr.to_string(),
                up: !n.cooling(),
                idle_conns: n.idle_conns() as u64,
                opened: n.opened.load(std::sync::atomic::Ordering::Relaxed),
                moved: n.moved.load(std::sync::atomic::Ordering::Relaxed),
                failures: n.failures.load(std::sync::atomic::Ordering::Relaxed),
                went_down: n.went_down.load(std::sync::atomic::Ordering::Relaxed),
                came_back: n.came_back.load(std::sync::atomic::Ordering::Relaxed),
            })
            .collect();
        let now = std::time::Instant::now();
        let open = topo.previous.iter().filter(|p| p.until > now).count() as u64;
        self.core.metrics.handoff.sets.store(open, std::sync::atomic::Ordering::Relaxed);
        self.core.metrics.render(topo.epoch, self.core.discovery_error(), peers, self.core.fabric.counters())
    }
}
