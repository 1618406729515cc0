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
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvclient-io")
            .enable_all()
            .build()?;
        Ok(BlockingClient {
            discovery: std::sync::Mutex::new(None),
            rt,
            core: Arc::new(Client::new(members, geo, opts)),
        })
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
        self.rt.block_on(self.core.putv(key, bufs))
    }

    pub fn getv(&self, key: &[u8], bufs: &mut [&mut [u8]]) -> Result<usize, (Status, usize)> {
        self.rt.block_on(self.core.getv(key, bufs))
    }

    pub fn delete(&self, key: &[u8]) -> Status {
        self.rt.block_on(self.core.delete(key))
    }

    /// On the caller's thread (no runtime hop): see `small.rs`.
    pub fn exist(&self, key: &[u8]) -> Status {
        self.core.exist_blocking(key)
    }

    /// On the caller's thread (no runtime hop): see `small.rs`.
    pub fn batch_exist(&self, keys: &[&[u8]]) -> Vec<Status> {
        self.core.batch_exist_blocking(keys)
    }

    pub fn batch_putv(&self, items: &[(&[u8], Vec<&[u8]>)]) -> Vec<Status> {
        self.rt.block_on(self.core.batch_putv(items))
    }

    pub fn batch_getv(&self, items: &mut [crate::client::GetItem<'_, '_>]) -> Vec<(Status, usize)> {
        self.rt.block_on(self.core.batch_getv(items))
    }

    /// Prometheus text: counters and per-peer state.
    pub fn stats_text(&self) -> String {
        let mut out = String::new();
        self.core.metrics.render(&mut out);
        let topo = self.core.topology();
        use std::fmt::Write as _;
        let _ = writeln!(out, "# HELP kvclient_ring_epoch Epoch of the ring in use.\n# TYPE kvclient_ring_epoch gauge");
        let _ = writeln!(out, "kvclient_ring_epoch {}", topo.epoch);
        if let Some(e) = self.core.discovery_error() {
            let e = e.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', " ");
            let _ = writeln!(
                out,
                "# HELP kvclient_mds_last_error_info The last discovery failure.\n# TYPE kvclient_mds_last_error_info gauge"
            );
            let _ = writeln!(out, "kvclient_mds_last_error_info{{error=\"{e}\"}} 1");
        }
        let _ =
            writeln!(out, "# HELP kvclient_peer_up 0 while a peer is in its cool-down.\n# TYPE kvclient_peer_up gauge");
        for n in &topo.nodes {
            let _ =
                writeln!(out, "kvclient_peer_up{{peer=\"{}\",addr=\"{}\"}} {}", n.id, n.addr, u8::from(!n.cooling()));
        }
        let _ = writeln!(
            out,
            "# HELP kvclient_peer_idle_conns Pooled idle connections.\n# TYPE kvclient_peer_idle_conns gauge"
        );
        for n in &topo.nodes {
            let _ = writeln!(out, "kvclient_peer_idle_conns{{peer=\"{}\"}} {}", n.id, n.idle_conns());
        }
        let _ = writeln!(
            out,
            "# HELP kvclient_peer_failures_total I/O failures per peer.\n# TYPE kvclient_peer_failures_total counter"
        );
        for n in &topo.nodes {
            let _ = writeln!(
                out,
                "kvclient_peer_failures_total{{peer=\"{}\"}} {}",
                n.id,
                n.failures.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        out
    }
}
