//! The verbs backend (cargo feature `rdma`), over the `sideway` crate, which
//! resolves libibverbs at run time. One protection domain per rail; one
//! completion queue per queue pair; reliable-connected queue pairs taken
//! INIT -> RTR -> RTS with the peer's endpoint from the bootstrap.
//!
//! Not run on hardware yet: docs/ARCHITECTURE.md, "Transports", lists what
//! has and has not run, and the test plan for the first site with RDMA.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::RegisterMemoryRegionErrorKind;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::bootstrap::{Endpoint, ReadLimits};
use super::completion::Wc;
use super::engine::{Backend, Mr, PeerAccess, QueuePair, Wr, WrOp};
use super::RailSpec;

/// Reads (RDMA READ) a queue pair may have outstanding as initiator, and
/// accept as responder.
const READ_ATOMIC: u8 = 16;

struct Rail {
    spec: RailSpec,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    gid: [u8; 16],
    lid: u16,
    mtu: u8,
    /// Outstanding reads as responder (max_qp_rd_atom) and as initiator
    /// (max_qp_init_rd_atom), clamped to [`READ_ATOMIC`].
    rd_atom: u8,
    init_rd_atom: u8,
}

/// Opened devices, one per rail.
pub struct Verbs {
    rails: Vec<Rail>,
    /// A client's registrations and queue pairs let the node write and read
    /// them; a node's are local only, so no peer reaches the node's memory.
    remote_access: bool,
}

impl Verbs {
    /// `remote_access`: true for a client, false for a node.
    pub fn new(remote_access: bool) -> Verbs {
        Verbs { rails: Vec::new(), remote_access }
    }

    /// Opens a device for a rail: context, port attributes, GID, PD.
    pub fn open(&mut self, spec: &RailSpec) -> Result<(), String> {
        let list = DeviceList::new().map_err(|e| format!("cannot list RDMA devices: {e}"))?;
        let dev = list
            .iter()
            .find(|d| d.name() == spec.device)
            .ok_or_else(|| "libibverbs does not list it (is its driver loaded?)".to_string())?;
        let ctx = dev.open().map_err(|e| format!("cannot open it: {e}"))?;
        let port = ctx.query_port(spec.port).map_err(|e| format!("cannot query port {}: {e}", spec.port))?;
        let gid: Gid = ctx
            .query_gid(spec.port, u32::from(spec.gid_index))
            .map_err(|e| format!("cannot read GID {}: {e}", spec.gid_index))?;
        let dev_attr = ctx.query_device().map_err(|e| format!("cannot query the device: {e}"))?;
        let clamp = |n: i32| n.clamp(1, i32::from(READ_ATOMIC)) as u8;
        let pd = ctx.alloc_pd().map_err(|e| format!("cannot allocate a protection domain: {e}"))?;
        let mtu = port.active_mtu() as u32 as u8;
        self.rails.push(Rail {
            spec: spec.clone(),
            ctx,
            pd,
            gid: gid.raw,
            lid: port.lid(),
            mtu: mtu.clamp(1, 5),
            rd_atom: clamp(dev_attr.max_qp_rd_atom()),
            init_rd_atom: clamp(dev_attr.max_qp_init_rd_atom()),
        });
        Ok(())
    }

    /// A client lets its peer write (a get's destination, pinned pools) or
    /// only read (a put's source: no write permission needed, so read-only
    /// mappings register); a node's memory is local only.
    fn access(&self, peer: PeerAccess) -> AccessFlags {
        match (self.remote_access, peer) {
            (true, PeerAccess::Writes) => AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            (true, PeerAccess::Reads) => AccessFlags::RemoteRead,
            (false, _) => AccessFlags::LocalWrite,
        }
    }
}

/// A starting packet sequence number (24 bits), different per queue pair.
fn psn() -> u32 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut b = [0u8; 20];
    b[..8].copy_from_slice(&t.to_le_bytes());
    b[8..16].copy_from_slice(&n.to_le_bytes());
    b[16..].copy_from_slice(&std::process::id().to_le_bytes());
    (xxhash_rust::xxh3::xxh3_64(&b) & 0xff_ffff) as u32
}

impl Backend for Verbs {
    fn register(&self, rail: usize, addr: usize, len: usize, access: PeerAccess) -> Result<Mr, String> {
        let r = &self.rails[rail];
        // SAFETY: the caller guarantees `[addr, addr+len)` stays mapped while
        // the registration lives: the client's callers by the
        // kv_register_memory contract and by holding their buffers for the
        // call, the node by keeping the buffer (or arena) alive in the
        // operation's hold, and by invalidating cached registrations before
        // it frees memory.
        let mr = unsafe { r.pd.reg_mr(addr, len, self.access(access)) }.map_err(|e| {
            // The errno's text ("Cannot allocate memory (os error 12)" when
            // pinned memory ran out) is what the engine tells apart.
            let why = match &e.0 {
                RegisterMemoryRegionErrorKind::Ibverbs(io) => io.to_string(),
                other => other.to_string(),
            };
            format!("cannot register {len} bytes on {}: {why} (is RLIMIT_MEMLOCK unlimited?)", r.spec.device)
        })?;
        Ok(Mr { lkey: mr.lkey(), rkey: mr.rkey(), keep: Box::new(mr) })
    }

    fn create_qp(&self, rail: usize, depth: u32) -> Result<Box<dyn QueuePair>, String> {
        let r = &self.rails[rail];
        let cq = r
            .ctx
            .create_cq_builder()
            .setup_cqe(depth * 2 + 2)
            .build()
            .map_err(|e| format!("cannot create a CQ: {e}"))?;
        let mut qp =
            r.pd.create_qp_builder()
                .setup_max_send_wr(depth)
                .setup_max_recv_wr(1)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_send_cq(cq.clone())
                .setup_recv_cq(cq.clone())
                .build()
                .map_err(|e| format!("cannot create a queue pair: {e}"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(r.spec.port)
            .setup_access_flags(self.access(PeerAccess::Writes));
        qp.modify(&attr).map_err(|e| format!("cannot take the queue pair to INIT: {e}"))?;
        let local = Endpoint {
            depth: depth as u16,
            port: r.spec.port,
            mtu: r.mtu,
            lid: r.lid,
            gid: r.gid,
            qpn: qp.qp_number(),
            psn: psn(),
            device: r.spec.device.clone(),
            reads: Some(ReadLimits { responder: r.rd_atom, initiator: r.init_rd_atom }),
            batches: true,
        };
        Ok(Box::new(VerbsQp {
            qp: ManuallyDrop::new(Mutex::new(qp)),
            cq: ManuallyDrop::new(cq),
            local,
            gid_index: r.spec.gid_index,
            rd_atom: r.rd_atom,
            init_rd_atom: r.init_rd_atom,
            read_depth: std::sync::atomic::AtomicU8::new(0),
        }))
    }

    fn gid(&self, rail: usize) -> [u8; 16] {
        self.rails[rail].gid
    }
}

struct VerbsQp {
    /// Destroyed by hand ([`Drop`]): the queue pair first, then its
    /// completion queue, and neither when the queue pair's destroy fails.
    qp: ManuallyDrop<Mutex<BasicQueuePair>>,
    cq: ManuallyDrop<Arc<BasicCompletionQueue>>,
    local: Endpoint,
    gid_index: u8,
    rd_atom: u8,
    init_rd_atom: u8,
    /// The READs it may issue at once (0 until connected).
    read_depth: std::sync::atomic::AtomicU8,
}

impl Drop for VerbsQp {
    /// `sideway` panics when a destroy fails. A queue pair that could not be
    /// destroyed still holds its completion queue, whose destroy would then
    /// fail and panic again while the first unwinds (an abort): so the queue
    /// pair's destroy is caught, and on failure the completion queue is
    /// leaked with it (the engine leaks the failed requests' memory too),
    /// and the panic goes on to the engine, which catches it.
    fn drop(&mut self) {
        // SAFETY: `qp` is taken exactly once, here, and not used after.
        let qp = unsafe { ManuallyDrop::take(&mut self.qp) };
        let destroyed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(qp)));
        match destroyed {
            Ok(()) => {
                // SAFETY: `cq` is taken exactly once, here, and not used after.
                drop(unsafe { ManuallyDrop::take(&mut self.cq) });
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl QueuePair for VerbsQp {
    fn local(&self) -> Endpoint {
        self.local.clone()
    }

    fn connect(&self, remote: &Endpoint) -> Result<(), String> {
        // READs in flight: no more than this device issues and the peer's
        // serves (an older peer says nothing: the smaller local limit).
        let depth = ReadLimits { responder: self.rd_atom, initiator: self.init_rd_atom }.initiator_depth(remote.reads);
        let mut qp = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(u32::from(self.local.mtu.min(remote.mtu))))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.rd_atom)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid).setup_port(self.local.port).setup_service_level(0);
        if remote.gid.iter().any(|&b| b != 0) {
            // RoCE always, InfiniBand across subnets: route by GID.
            ah.setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_src_gid_index(self.gid_index)
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        qp.modify(&attr).map_err(|e| format!("cannot take the queue pair to RTR: {e}"))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(depth);
        qp.modify(&attr).map_err(|e| format!("cannot take the queue pair to RTS: {e}"))?;
        self.read_depth.store(depth, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn read_depth(&self) -> Option<u8> {
        Some(self.read_depth.load(std::sync::atomic::Ordering::Relaxed)).filter(|&d| d > 0)
    }

    fn post(&self, wrs: &[Wr]) -> Result<(), String> {
        let mut qp = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let mut guard = qp.start_post_send();
        for wr in wrs {
            let h = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled);
            let h = match wr.op {
                WrOp::Write => h.setup_write(wr.rkey, wr.raddr),
                WrOp::Read => h.setup_read(wr.rkey, wr.raddr),
            };
            // SAFETY: the local range lies inside the registration `lkey`
            // names, which the engine keeps alive (with the memory) until
            // this work request completes or the queue pair is destroyed.
            unsafe { h.setup_sge(wr.lkey, wr.laddr, wr.len) };
        }
        guard.post().map_err(|e| e.to_string())
    }

    fn poll(&self, out: &mut Vec<Wc>) -> Result<(), String> {
        match self.cq.start_poll() {
            Ok(poller) => {
                for wc in poller {
                    out.push(Wc { wr_id: wc.wr_id(), status: wc.status(), bytes: wc.byte_len() });
                }
                Ok(())
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verbs path that runs without a device: libibverbs absent (calls
    /// fail cleanly) or present with nothing to list. Either way opening a
    /// device is an error with a reason, never a panic.
    #[test]
    fn opening_an_absent_device_is_an_error_not_a_crash() {
        let spec = RailSpec {
            device: "mlx5_9".into(),
            port: 1,
            gid_index: 0,
            numa_node: None,
            link_layer: "InfiniBand".into(),
        };
        let mut v = Verbs::new(true);
        let e = v.open(&spec).unwrap_err();
        assert!(e.contains("cannot list RDMA devices") || e.contains("does not list it"), "{e}");
        assert!(v.rails.is_empty());
    }
}
