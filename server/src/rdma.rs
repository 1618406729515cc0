//! The node's RDMA transport ([`crate::transport`] over the `kv-rdma`
//! engine): sets up a queue pair per connection that asks
//! (docs/PROTOCOL.md §2.8), reads put payloads from and writes get payloads
//! into the client's memory, and keeps the RDMA counters (always present:
//! a node without RDMA counts the clients it sent over TCP).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_common::wire::Segment;
use kv_rdma::bootstrap::{self, Answer, Endpoint};
use kv_rdma::engine::{Link, Runtime, WrOp};
use kv_rdma::Counters;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::store::{PooledBuf, Store};
use crate::transport::{Fabric, RemoteMemory, Setup, Transfer};

/// RDMA on a node: the engine when devices were named and usable (else TCP
/// only, with the reason told to clients that ask).
pub struct Rdma {
    counters: Arc<Counters>,
    rt: Option<Arc<Runtime>>,
    /// Work requests in flight this node grants a queue pair at most.
    depth: u32,
    off: String,
}

impl Rdma {
    /// No device named: TCP only.
    pub fn unconfigured() -> Rdma {
        Rdma {
            counters: Arc::new(Counters::default()),
            rt: None,
            depth: kv_rdma::DEFAULT_DEPTH,
            off: "no RDMA device named on this node (--rdma-dev)".into(),
        }
    }

    /// Starts RDMA when `settings` name devices: the memory tier of `store`
    /// is registered whole, and heap buffers are registered on first use and
    /// forgotten before they are freed. Anything in the way means TCP, one
    /// log line and the fallback counter at 1.
    pub fn start(settings: &kv_rdma::Settings, store: &Store) -> Rdma {
        let mut me = Rdma { depth: settings.depth, ..Rdma::unconfigured() };
        if settings.devices.is_empty() {
            return me;
        }
        // The node pairs each client with its rail (same device or subnet),
        // so NUMA choice is the clients' (the node's threads are not pinned).
        let settings = &kv_rdma::Settings { numa_local: false, ..settings.clone() };
        let log = |line: &str| tracing::warn!("RDMA: {line}");
        let timeout = std::time::Duration::from_secs(5);
        let Some(rt) = kv_rdma::start(settings, kv_rdma::Role::Node, &me.counters, 4 << 30, timeout, log) else {
            if let Some(why) = me.counters.fallback_reason() {
                me.off = format!("this node serves over TCP only: {why}");
            }
            return me;
        };
        rt.set_logger(Box::new(|line| tracing::warn!("RDMA: {line}")));
        if let Err(why) = me.serve(rt, store) {
            me.off = format!("this node serves over TCP only: {why}");
            return me;
        }
        let devices: Vec<&str> = me.rt.iter().flat_map(|rt| rt.rails()).map(|r| r.device.as_str()).collect();
        tracing::info!(rails = %devices.join(":"), depth = settings.depth, "RDMA serving");
        me
    }

    /// Serves over an engine already started (the stand-in fabric in tests),
    /// with its counters.
    pub fn over(rt: Arc<Runtime>, store: &Store) -> Rdma {
        let mut me = Rdma { counters: rt.counters().clone(), ..Rdma::unconfigured() };
        if let Err(why) = me.serve(rt, store) {
            me.off = format!("this node serves over TCP only: {why}");
        }
        me
    }

    /// Registers the memory tier whole and hooks buffer frees; Err: why not
    /// (the registration failure turned RDMA off, counted as the fallback).
    fn serve(&mut self, rt: Arc<Runtime>, store: &Store) -> Result<(), String> {
        if let Some((addr, len)) = store.pool().arena_range() {
            if rt.pin(addr, len).is_err() {
                return Err(self.counters.fallback_reason().unwrap_or_default());
            }
        }
        let weak = Arc::downgrade(&rt);
        store.pool().set_free_hook(Box::new(move |addr, len| {
            if let Some(rt) = weak.upgrade() {
                rt.invalidate(addr, len);
            }
        }));
        self.rt = Some(rt);
        Ok(())
    }

    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }
}

impl Fabric for Rdma {
    fn connect(&self, peer: SocketAddr, body: &[u8]) -> Result<Setup, String> {
        let fallback = || self.counters.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
        let mut remote = None;
        let answer = match Endpoint::decode_request(body) {
            Err(bootstrap::BootstrapError::Version { .. }) => {
                fallback();
                Answer::VersionRefused(bootstrap::BOOTSTRAP_VERSION)
            }
            Err(e) => return Err(e.to_string()),
            Ok(theirs) => match self.rt.as_ref().filter(|rt| !rt.is_off()) {
                None => {
                    fallback();
                    match self.counters.fallback_reason() {
                        Some(why) if self.rt.is_some() => Answer::NotOffered(why),
                        _ => Answer::NotOffered(self.off.clone()),
                    }
                }
                Some(rt) => {
                    let depth = u32::from(theirs.depth).min(self.depth);
                    match rt.link(rt.rail_for(&theirs), depth).and_then(|l| l.connect(&theirs).map(|()| l)) {
                        Ok(link) => {
                            let mut local = link.local().clone();
                            local.depth = depth as u16;
                            // A client of an older release is answered in
                            // its version: 2 without batch segments, 1
                            // without the read limits either.
                            local.batches &= theirs.batches;
                            if theirs.reads.is_none() {
                                local.reads = None;
                            }
                            tracing::debug!(%peer, device = %local.device, qpn = local.qpn, remote_qpn = theirs.qpn, "RDMA queue pair connected");
                            remote = Some(Arc::new(QueuePair(link)) as Arc<dyn RemoteMemory>);
                            Answer::Accepted(local)
                        }
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "cannot set up an RDMA queue pair");
                            fallback();
                            Answer::SetupFailed(e)
                        }
                    }
                }
            },
        };
        Ok(Setup { answer: answer.encode(), remote })
    }

    fn built(&self) -> &'static str {
        kv_rdma::build_transports()
    }

    fn encode_metrics(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        for f in self.counters.families() {
            let kind = if f.counter { MetricType::Counter } else { MetricType::Gauge };
            let mut m = e.encode_descriptor(f.name, f.help, None, kind)?;
            for (labels, v) in &f.series {
                if labels.is_empty() {
                    match kind {
                        MetricType::Counter => ConstCounter::new(*v).encode(m)?,
                        _ => ConstGauge::new(*v).encode(m)?,
                    }
                    break;
                }
                match kind {
                    MetricType::Counter => ConstCounter::new(*v).encode(m.encode_family(labels)?)?,
                    _ => ConstGauge::new(*v).encode(m.encode_family(labels)?)?,
                }
            }
        }
        Ok(())
    }
}

/// A connection's queue pair.
struct QueuePair(Link);

impl RemoteMemory for QueuePair {
    fn usable(&self) -> bool {
        self.0.broken().is_none() && !self.0.runtime().is_off()
    }

    fn fill<'a>(&'a self, mut buf: PooledBuf, at: usize, len: usize, segs: &'a [Segment]) -> Transfer<'a, PooledBuf> {
        Box::pin(async move {
            let addr = buf.full_mut().as_mut_ptr() as usize + at;
            // The device writes into the buffer: it is kept in the cell (and,
            // if the transfer fails, by the engine until the queue pair is gone).
            let cell = Arc::new(std::sync::Mutex::new(Some(buf)));
            self.0.transfer(WrOp::Read, addr, len, segs, cell.clone()).await.map_err(|e| e.to_string())?;
            // No lock guard lives on past this statement, so none is held
            // across an await; nothing else takes the buffer.
            let buf = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
            buf.ok_or_else(|| "internal error: put buffer gone".to_string())
        })
    }

    fn deliver<'a>(&'a self, rec: Arc<PooledBuf>, at: usize, segs: &'a [Segment]) -> Transfer<'a, ()> {
        Box::pin(async move {
            let payload = &rec.as_slice()[at..];
            let (addr, n) = (payload.as_ptr() as usize, payload.len());
            self.0.transfer(WrOp::Write, addr, n, segs, rec.clone()).await.map_err(|e| e.to_string())
        })
    }

    fn close(&self) {
        self.0.close();
    }
}
