//! The RDMA engine both ends use: rails (one device each), a registration
//! cache per rail, queue-pair links with their completion trackers, and one
//! polling thread. The verbs sit behind [`Backend`]: `sideway` in the `rdma`
//! build ([`super::verbs`]), and in tests a stand-in fabric that copies
//! memory in-process (so the whole path, from request to completion, runs
//! here without a device).
//!
//! Who moves the bytes: the node. For a get it RDMA-WRITEs the payload into
//! the caller's registered buffers; for a put it RDMA-READs the payload from
//! them. The client posts no work requests at all; it registers memory and
//! names it in its requests (docs/ARCHITECTURE.md, "Transports", argues the
//! choice).

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use kv_common::wire::Segment;

use super::bootstrap::Endpoint;
use super::completion::{CompletionSource, Hold, RdmaError, Tracker, Wc};
use super::regcache::{RegCache, Region, Registrar};
use super::{Counters, RailCounters, RailSpec, Settings};

/// What a work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOp {
    /// Local memory to the peer's.
    Write,
    /// The peer's memory to local memory.
    Read,
}

/// One work request: `len` bytes between local `(lkey, laddr)` and remote
/// `(rkey, raddr)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wr {
    pub wr_id: u64,
    pub op: WrOp,
    pub lkey: u32,
    pub laddr: u64,
    pub len: u32,
    pub rkey: u32,
    pub raddr: u64,
}

/// A memory registration with a device; dropping `keep` deregisters it.
pub struct Mr {
    pub lkey: u32,
    pub rkey: u32,
    pub keep: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr").field("lkey", &self.lkey).field("rkey", &self.rkey).finish()
    }
}

/// One queue pair of a backend.
pub trait QueuePair: Send + Sync {
    /// This end, to send to the peer.
    fn local(&self) -> Endpoint;
    /// Takes the queue pair to ready-to-send against the peer's endpoint.
    fn connect(&self, remote: &Endpoint) -> Result<(), String>;
    /// Posts work requests (each signaled).
    fn post(&self, wrs: &[Wr]) -> Result<(), String>;
    /// Appends the completions ready now.
    fn poll(&self, out: &mut Vec<Wc>) -> Result<(), String>;
    /// The RDMA READs this queue pair may have in flight, once connected
    /// (its own initiator limit and the peer's responder limit).
    fn read_depth(&self) -> Option<u8> {
        None
    }
}

/// A device family: registers memory and makes queue pairs, per rail.
/// A client's backend registers memory for remote access (the node writes
/// and reads it); a node's registers it for local access only, so no peer
/// can reach the node's memory.
pub trait Backend: Send + Sync {
    /// Registers `[addr, addr+len)`. A client's backend lets the peer
    /// `access` it; a node's ignores `access` (local access only).
    fn register(&self, rail: usize, addr: usize, len: usize, access: PeerAccess) -> Result<Mr, String>;
    fn create_qp(&self, rail: usize, depth: u32) -> Result<Box<dyn QueuePair>, String>;
    /// The rail's GID (to match a peer's rail; zero when unknown).
    fn gid(&self, rail: usize) -> [u8; 16];
}

/// Whether a registration failed because pinned memory ran out (ENOMEM,
/// the memlock limit): then every later one would fail too.
fn out_of_pinned_memory(e: &str) -> bool {
    e.contains("os error 12") || e.contains("Cannot allocate memory")
}

/// The rail of `rails` (device name, GID) to pair with a peer's endpoint:
/// the same subnet (InfiniBand: the 64-bit GID prefix; RoCE with IPv4: the
/// /24 of the address in the GID), else the same device name (hosts built
/// alike name their rails alike), else None (any rail: round-robin). On
/// rail-optimised fabrics a rail only reaches the same rail elsewhere, and
/// a subnet set for each rail says which one that is. A GID that says
/// nothing (zero, or the link-local prefix fe80::/64, the default subnet
/// prefix every InfiniBand port has unless the subnet manager sets another)
/// is no subnet: those pair by name.
pub fn match_rail(peer: &Endpoint, rails: &[(String, [u8; 16])]) -> Option<usize> {
    let v4 = |g: &[u8; 16]| g[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
    let zero = |g: &[u8; 16]| g.iter().all(|&b| b == 0) || g[..8] == [0xfe, 0x80, 0, 0, 0, 0, 0, 0];
    if !zero(&peer.gid) {
        let subnet = rails.iter().position(|(_, g)| {
            !zero(g) && if v4(&peer.gid) { v4(g) && g[12..15] == peer.gid[12..15] } else { g[..8] == peer.gid[..8] }
        });
        if subnet.is_some() {
            return subnet;
        }
    }
    rails.iter().position(|(d, _)| *d == peer.device)
}

/// What the peer does with a client's buffer: writes into it (a get's
/// destination, and regions the caller pins) or only reads it (a put's
/// source). A read-only registration needs no write permission on the
/// memory, so a put from a read-only mapping (`mmap(PROT_READ)`) goes by
/// RDMA too; asking for write access there is refused by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAccess {
    Writes,
    Reads,
}

struct RailRegistrar {
    backend: Arc<dyn Backend>,
    rail: usize,
    access: PeerAccess,
}

impl Registrar for RailRegistrar {
    type Mr = Mr;
    fn register(&self, addr: usize, len: usize) -> Result<Mr, String> {
        self.backend.register(self.rail, addr, len, self.access)
    }
}

/// A registration in use by an operation (kept alive while it runs).
pub type Registration = Arc<Region<Mr>>;

struct LinkCore {
    /// Destroyed before the memory of failed requests is let go (Drop).
    qp: Mutex<Option<Box<dyn QueuePair>>>,
    tracker: Arc<Tracker>,
}

impl Drop for LinkCore {
    fn drop(&mut self) {
        let qp = self.qp.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        destroy_then_release(qp, &self.tracker);
    }
}

/// Destroys a queue pair, then lets go of the memory of its failed requests
/// (the device no longer touches it). A destroy that fails (the verbs
/// layer panics) is caught so it takes no caller down, and that memory is
/// then leaked instead: the queue pair may still be live and DMA into it,
/// so it must never be reused. False when the destroy failed.
fn destroy_then_release(qp: Option<Box<dyn QueuePair>>, tracker: &Tracker) -> bool {
    let destroyed = match qp {
        None => true,
        Some(qp) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(qp))).is_ok(),
    };
    let limbo = tracker.take_limbo();
    if destroyed {
        drop(limbo);
    } else {
        std::mem::forget(limbo);
    }
    destroyed
}

struct QpSource<'a>(&'a LinkCore);

impl CompletionSource for QpSource<'_> {
    fn poll(&mut self, out: &mut Vec<Wc>) -> Result<(), String> {
        match &*self.0.qp.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(qp) => qp.poll(out),
            // Closed: its requests were failed when it was.
            None => Ok(()),
        }
    }
}

/// The polling thread's shared state.
struct Poll {
    links: Mutex<Vec<Weak<LinkCore>>>,
    posted: Mutex<u64>,
    wake: Condvar,
    stop: AtomicBool,
    /// The polling thread is gone (it panicked): no new links.
    dead: AtomicBool,
}

impl Poll {
    fn kick(&self) {
        *self.posted.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.wake.notify_one();
    }

    /// The polling thread: [`Poll::run`], and should it panic, every link
    /// fails at once rather than waiting for completions nobody takes.
    fn thread(self: Arc<Poll>) {
        let p = self.clone();
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || p.run())).is_err() {
            self.dead.store(true, Ordering::Relaxed);
            let links: Vec<Arc<LinkCore>> =
                self.links.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect();
            for l in links {
                l.tracker.break_all("the RDMA polling thread stopped");
            }
        }
    }

    fn run(self: Arc<Poll>) {
        let mut buf = Vec::new();
        let mut last_expire = Instant::now();
        let mut seen = 0u64;
        let mut idle_spins = 0u32;
        while !self.stop.load(Ordering::Relaxed) {
            let links: Vec<Arc<LinkCore>> = {
                let mut g = self.links.lock().unwrap_or_else(|e| e.into_inner());
                g.retain(|w| w.strong_count() > 0);
                g.iter().filter_map(Weak::upgrade).collect()
            };
            let busy = links.iter().any(|l| l.tracker.in_flight() > 0);
            if !busy {
                // Hold no link while asleep: a closed one goes at once.
                drop(links);
                // Sleep until something is posted (or a while passes).
                let g = self.posted.lock().unwrap_or_else(|e| e.into_inner());
                if *g == seen {
                    let (g, _) =
                        self.wake.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner());
                    seen = *g;
                } else {
                    seen = *g;
                }
                continue;
            }
            let mut got = 0;
            for l in &links {
                got += l.tracker.drive(&mut QpSource(l), &mut buf);
            }
            if last_expire.elapsed() >= Duration::from_millis(5) {
                let now = Instant::now();
                for l in &links {
                    l.tracker.expire(now);
                }
                last_expire = now;
            }
            drop(links);
            if got == 0 {
                idle_spins += 1;
                if idle_spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            } else {
                idle_spins = 0;
            }
        }
    }
}

/// The RDMA side of one client handle or one node process.
pub struct Runtime {
    backend: Arc<dyn Backend>,
    rails: Vec<RailSpec>,
    rail_counters: Vec<Arc<RailCounters>>,
    /// Per rail: registrations the peer may write (and the pinned regions),
    /// and those it may only read (put sources not inside the former).
    caches: Vec<Mutex<RegCache<RailRegistrar>>>,
    read_caches: Vec<Mutex<RegCache<RailRegistrar>>>,
    counters: Arc<Counters>,
    settings: Settings,
    next: AtomicUsize,
    poll: Arc<Poll>,
    timeout: Duration,
    /// Set once a registration failed: RDMA is off for the rest of the
    /// process (or handle), which serves over TCP.
    off: AtomicBool,
    logger: OnceLock<Logger>,
}

/// Where a runtime's one line goes (the node's log, a client's stderr).
pub type Logger = Box<dyn Fn(&str) + Send + Sync>;

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("rails", &self.rails).finish()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.poll.stop.store(true, Ordering::Relaxed);
        self.poll.kick();
    }
}

/// A connected (or connecting) queue pair, owned by one data connection.
pub struct Link {
    core: Arc<LinkCore>,
    rt: Arc<Runtime>,
    rail: usize,
    local: Endpoint,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("rail", &self.rail).field("local", &self.local).finish()
    }
}

impl Runtime {
    /// A runtime over `rails` of `backend`. `cache_cap`: bytes of cached
    /// (not pinned) registrations per rail; `timeout`: per work request.
    pub fn with_backend(
        backend: Arc<dyn Backend>,
        rails: Vec<RailSpec>,
        settings: Settings,
        counters: Arc<Counters>,
        cache_cap: usize,
        timeout: Duration,
    ) -> Result<Arc<Runtime>, String> {
        let rail_counters = rails.iter().map(|r| counters.rail(&r.device)).collect();
        let caches_for = |access| {
            (0..rails.len())
                .map(|rail| {
                    let reg = RailRegistrar { backend: backend.clone(), rail, access };
                    Mutex::new(RegCache::new(reg, cache_cap, counters.clone()))
                })
                .collect()
        };
        let caches = caches_for(PeerAccess::Writes);
        let read_caches = caches_for(PeerAccess::Reads);
        let poll = Arc::new(Poll {
            links: Mutex::new(Vec::new()),
            posted: Mutex::new(0),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            dead: AtomicBool::new(false),
        });
        let p = poll.clone();
        std::thread::Builder::new()
            .name("kv-rdma-poll".into())
            .spawn(move || p.thread())
            .map_err(|e| format!("cannot start the RDMA polling thread: {e}"))?;
        Ok(Arc::new(Runtime {
            backend,
            rails,
            rail_counters,
            caches,
            read_caches,
            counters,
            settings,
            next: AtomicUsize::new(0),
            poll,
            timeout,
            off: AtomicBool::new(false),
            logger: OnceLock::new(),
        }))
    }

    /// Where the one line goes when RDMA is turned off after start.
    pub fn set_logger(&self, f: Logger) {
        let _ = self.logger.set(f);
    }

    /// Turns RDMA off for good (a registration failed: pinned memory is
    /// exhausted or the memory is not registrable): one log line, one
    /// fallback counted; from then on everything goes over TCP.
    pub fn turn_off(&self, why: &str) {
        if !self.off.swap(true, Ordering::AcqRel) {
            let reason = format!("RDMA turned off: {why}");
            self.counters.fell_back(&reason);
            if let Some(log) = self.logger.get() {
                log(&format!("using TCP: {reason}"));
            }
        }
    }

    /// One line to the logger set by [`Runtime::set_logger`] (if any).
    fn log(&self, line: &str) {
        if let Some(log) = self.logger.get() {
            log(line);
        }
    }

    /// Whether RDMA was turned off after start.
    pub fn is_off(&self) -> bool {
        self.off.load(Ordering::Relaxed)
    }

    pub fn rails(&self) -> &[RailSpec] {
        &self.rails
    }

    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The rail to pair with a peer's queue pair ([`match_rail`]), else the
    /// next one round-robin.
    pub fn rail_for(&self, peer: &Endpoint) -> usize {
        let rails: Vec<(String, [u8; 16])> =
            self.rails.iter().enumerate().map(|(i, r)| (r.device.clone(), self.backend.gid(i))).collect();
        match_rail(peer, &rails).unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed) % self.rails.len().max(1))
    }

    /// The rail for the next connection (spread, NUMA-local first).
    pub fn next_rail(&self) -> usize {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let node = if self.settings.numa_local { super::current_numa_node() } else { None };
        super::pick_rail(&self.rails, n, node, self.settings.numa_local).unwrap_or(0)
    }

    fn cache(&self, rail: usize) -> std::sync::MutexGuard<'_, RegCache<RailRegistrar>> {
        self.caches[rail].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a long-lived region on every rail (`kv_register_memory`).
    /// A failure turns RDMA off ([`Runtime::turn_off`]).
    pub fn pin(&self, addr: usize, len: usize) -> Result<(), String> {
        for rail in 0..self.rails.len() {
            if let Err(e) = self.cache(rail).pin(addr, len) {
                for r in 0..rail {
                    self.cache(r).unpin(addr);
                }
                let e = format!("{}: cannot register {len} bytes: {e}", self.rails[rail].device);
                self.turn_off(&e);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Drops a region [`Runtime::pin`] registered. False if none starts there.
    pub fn unpin(&self, addr: usize) -> bool {
        (0..self.rails.len()).fold(false, |any, rail| self.cache(rail).unpin(addr) | any)
    }

    /// Memory at `[addr, addr+len)` is being freed: forget cached
    /// registrations of it.
    pub fn invalidate(&self, addr: usize, len: usize) {
        for rail in 0..self.rails.len() {
            self.cache(rail).invalidate(addr, len);
            self.read_caches[rail].lock().unwrap_or_else(|e| e.into_inner()).invalidate(addr, len);
        }
    }

    /// The registration covering a buffer on `rail` that the peer may write
    /// (cached or new; a node's are local only).
    pub fn registration(&self, rail: usize, addr: usize, len: usize) -> Result<Registration, String> {
        self.registration_for(rail, addr, len, PeerAccess::Writes)
    }

    /// The registration covering a buffer on `rail` for `access`: for a
    /// read, a pinned or cached writable one covering it if there is one,
    /// else a read-only one. Pinned memory running out (ENOMEM: the memlock
    /// limit is spent) turns RDMA off ([`Runtime::turn_off`]); any other
    /// failure is this buffer's alone (its request goes over TCP).
    pub fn registration_for(
        &self,
        rail: usize,
        addr: usize,
        len: usize,
        access: PeerAccess,
    ) -> Result<Registration, String> {
        if self.is_off() {
            return Err("RDMA is off".into());
        }
        let r = match access {
            PeerAccess::Writes => self.cache(rail).get(addr, len),
            PeerAccess::Reads => match self.cache(rail).lookup(addr, len) {
                Some(r) => Ok(r),
                None => self.read_caches[rail].lock().unwrap_or_else(|e| e.into_inner()).get(addr, len),
            },
        };
        if let Err(e) = &r {
            if out_of_pinned_memory(e) {
                self.turn_off(&format!("{}: memory registration failed: {e}", self.rails[rail].device));
            }
        }
        r
    }

    /// A segment naming a buffer the peer writes into, and the registration
    /// to keep while the request that names it runs.
    pub fn segment(&self, rail: usize, addr: usize, len: usize) -> Result<(Segment, Registration), String> {
        self.segment_for(rail, addr, len, PeerAccess::Writes)
    }

    /// A segment naming a buffer for the peer to `access`.
    pub fn segment_for(
        &self,
        rail: usize,
        addr: usize,
        len: usize,
        access: PeerAccess,
    ) -> Result<(Segment, Registration), String> {
        let len32 = u32::try_from(len).map_err(|_| "buffer over 4 GiB".to_string())?;
        let r = self.registration_for(rail, addr, len, access)?;
        Ok((Segment { addr: addr as u64, rkey: r.mr.rkey, len: len32 }, r))
    }

    /// A new queue pair on `rail` asking for `depth` requests in flight; it
    /// is connected once the peer's endpoint is known ([`Link::connect`]).
    pub fn link(self: &Arc<Self>, rail: usize, depth: u32) -> Result<Link, String> {
        if self.poll.dead.load(Ordering::Relaxed) {
            return Err("the RDMA polling thread stopped".into());
        }
        if self.is_off() {
            return Err("RDMA was turned off (a memory registration failed)".into());
        }
        let depth = depth.clamp(1, super::MAX_DEPTH);
        let qp = self.backend.create_qp(rail, depth)?;
        let local = qp.local();
        let core = Arc::new(LinkCore {
            qp: Mutex::new(Some(qp)),
            tracker: Arc::new(Tracker::new(depth as usize, self.timeout, self.counters.clone())),
        });
        self.poll.links.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&core));
        Ok(Link { core, rt: self.clone(), rail, local })
    }
}

impl Link {
    pub fn local(&self) -> &Endpoint {
        &self.local
    }

    /// The RDMA READs this queue pair may have in flight (once connected).
    pub fn read_depth(&self) -> Option<u8> {
        self.core.qp.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|q| q.read_depth())
    }

    pub fn rail(&self) -> usize {
        self.rail
    }

    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    /// Connects to the peer; the depth used is the smaller of both asks.
    pub fn connect(&self, remote: &Endpoint) -> Result<(), String> {
        let g = self.core.qp.lock().unwrap_or_else(|e| e.into_inner());
        let qp = g.as_ref().ok_or("queue pair destroyed")?;
        qp.connect(remote)?;
        self.rt.rail_counters[self.rail].qps_connected.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Why this link can no longer be used, if it cannot.
    pub fn broken(&self) -> Option<String> {
        self.core.tracker.broken()
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.core.tracker.in_flight()
    }

    /// Moves `len` bytes between the local buffer at `laddr` and the peer's
    /// `remote` segments, in order (a write may leave the tail of the last
    /// segment untouched; a read must fill `len` exactly). Work requests go
    /// out in chunks of at most `depth`, each chunk posted at once. `hold`
    /// keeps the local memory alive until the device is done with it, which
    /// may be after this returns an error: the link is then broken, and the
    /// caller closes it ([`Link::close`]) before answering.
    pub async fn transfer(
        &self,
        op: WrOp,
        laddr: usize,
        len: usize,
        remote: &[Segment],
        hold: Arc<dyn Any + Send + Sync>,
    ) -> Result<(), RdmaError> {
        let room: u64 = remote.iter().map(|s| u64::from(s.len)).sum();
        if (op == WrOp::Write && room < len as u64) || (op == WrOp::Read && room != len as u64) {
            return Err(RdmaError::Post(format!("{len} bytes do not fit segments of {room}")));
        }
        if len == 0 {
            return Ok(());
        }
        let reg = self.rt.registration(self.rail, laddr, len).map_err(RdmaError::Post)?;
        let keep: Arc<dyn Any + Send + Sync> = Arc::new((hold, reg.clone()));
        // (local address, length, remote key, remote address) per request.
        let mut pieces = Vec::with_capacity(remote.len());
        let mut off = 0usize;
        for seg in remote {
            if off == len {
                break;
            }
            let n = (seg.len as usize).min(len - off);
            pieces.push(((laddr + off) as u64, n as u32, seg.rkey, seg.addr));
            off += n;
        }
        let tracker = &self.core.tracker;
        for chunk in pieces.chunks(tracker.depth()) {
            let holds: Vec<Option<Hold>> = chunk.iter().map(|_| Some(Box::new(keep.clone()) as Hold)).collect();
            let slots = tracker.begin_many(holds).await?;
            let wrs: Vec<Wr> = chunk
                .iter()
                .zip(slots.ids())
                .map(|(&(laddr, len, rkey, raddr), wr_id)| Wr { wr_id, op, lkey: reg.mr.lkey, laddr, len, rkey, raddr })
                .collect();
            let posted = match &*self.core.qp.lock().unwrap_or_else(|e| e.into_inner()) {
                Some(qp) => qp.post(&wrs),
                None => Err("queue pair closed".into()),
            };
            if let Err(e) = posted {
                tracker.post_failed(&e);
                return Err(RdmaError::Post(e));
            }
            self.rt.poll.kick();
            if let Err(e) = slots.wait().await {
                // Already broken by the completion, the expiry or the poll
                // thread's end; broken here too should the backstop fire.
                tracker.break_all(&e.to_string());
                return Err(e);
            }
        }
        let rc = &self.rt.rail_counters[self.rail];
        match op {
            WrOp::Write => rc.written_bytes.fetch_add(len as u64, Ordering::Relaxed),
            WrOp::Read => rc.read_bytes.fetch_add(len as u64, Ordering::Relaxed),
        };
        Ok(())
    }

    /// Tears the queue pair down now: requests in flight fail, the queue
    /// pair is destroyed (so the device stops touching memory: a peer's
    /// writes into this end's memory are refused from here on), then the
    /// memory of failed requests is let go. Not counted as broken unless it
    /// broke before.
    pub fn close(&self) {
        self.core.tracker.close("queue pair closed");
        let qp = self.core.qp.lock().unwrap_or_else(|e| e.into_inner()).take();
        if !destroy_then_release(qp, &self.core.tracker) {
            self.rt.log(
                "a queue pair could not be destroyed: the memory of its failed requests is kept (leaked), never reused",
            );
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close();
    }
}

/// The stand-in fabric for tests (its own file).
#[cfg(any(test, feature = "testing"))]
pub mod fake;

#[cfg(test)]
mod tests {
    use super::fake::*;
    use super::*;
    use crate::bootstrap::{Answer, Endpoint};

    fn spec(d: &str) -> RailSpec {
        RailSpec { device: d.into(), port: 1, gid_index: 0, numa_node: None, link_layer: "InfiniBand".into() }
    }

    /// A client's (remote access) or a node's runtime on the fabric.
    fn runtime(net: &FakeNet, devs: &[&str], timeout_ms: u64) -> Arc<Runtime> {
        runtime_as(net, devs, timeout_ms, true)
    }

    fn node_runtime(net: &FakeNet, devs: &[&str], timeout_ms: u64) -> Arc<Runtime> {
        runtime_as(net, devs, timeout_ms, false)
    }

    fn runtime_as(net: &FakeNet, devs: &[&str], timeout_ms: u64, remote_access: bool) -> Arc<Runtime> {
        let backend = Arc::new(FakeBackend {
            net: net.clone(),
            devices: devs.iter().map(|d| d.to_string()).collect(),
            remote_access,
        });
        Runtime::with_backend(
            backend,
            devs.iter().map(|d| spec(d)).collect(),
            Settings { devices: devs.iter().map(|d| d.to_string()).collect(), depth: 4, numa_local: false },
            Arc::new(Counters::default()),
            1 << 30,
            Duration::from_millis(timeout_ms),
        )
        .unwrap()
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    /// Bootstraps a link pair as the two ends of a connection would: the
    /// client's endpoint travels in RDMA_CONNECT, the node's in the answer.
    fn pair(client: &Arc<Runtime>, node: &Arc<Runtime>) -> (Link, Link) {
        let c = client.link(client.next_rail(), 8).unwrap();
        let req = Endpoint::decode_request(&c.local().encode_request()).unwrap();
        let n = node.link(node.rail_for(&req), u32::from(req.depth)).unwrap();
        n.connect(&req).unwrap();
        let Answer::Accepted(theirs) = Answer::decode(&Answer::Accepted(n.local().clone()).encode()).unwrap() else {
            panic!()
        };
        c.connect(&theirs).unwrap();
        (c, n)
    }

    #[test]
    fn a_get_lands_in_the_callers_buffers_and_a_put_is_read_from_them() {
        rt().block_on(async {
            let net = FakeNet::default();
            let client = runtime(&net, &["mlx5_0", "mlx5_1"], 5_000);
            let node = node_runtime(&net, &["mlx5_0"], 5_000);
            let (c, n) = pair(&client, &node);
            assert_eq!(c.rail(), 0);
            // The caller's pool, registered once; two scattered buffers in it.
            let mut pool = vec![0u8; 1 << 16];
            client.pin(pool.as_mut_ptr() as usize, pool.len()).unwrap();
            let (k, v) = pool.split_at_mut(1 << 15);
            let (s1, _r1) = client.segment(c.rail(), k.as_mut_ptr() as usize, 1000).unwrap();
            let (s2, _r2) = client.segment(c.rail(), v.as_mut_ptr() as usize, 3000).unwrap();
            assert_eq!(s1.rkey, s2.rkey, "both inside the pinned pool");
            // The node's record payload, written into both.
            let payload: Arc<Vec<u8>> = Arc::new((0..3500u32).map(|i| (i % 251) as u8).collect());
            n.transfer(WrOp::Write, payload.as_ptr() as usize, payload.len(), &[s1, s2], payload.clone())
                .await
                .unwrap();
            assert_eq!(&pool[..1000], &payload[..1000]);
            assert_eq!(&pool[1 << 15..(1 << 15) + 2500], &payload[1000..]);
            // A put: the node reads the caller's bytes into its buffer.
            let mut landing = Arc::new(std::sync::Mutex::new(vec![0u8; 3500]));
            let addr = Arc::get_mut(&mut landing).unwrap().get_mut().unwrap().as_mut_ptr() as usize;
            let (s3, _r3) = client.segment(c.rail(), pool.as_ptr() as usize, 3500).unwrap();
            n.transfer(WrOp::Read, addr, 3500, &[s3], landing.clone()).await.unwrap();
            assert_eq!(&landing.lock().unwrap()[..], &pool[..3500]);
            let rc = &node.counters().rails()[0];
            assert_eq!(rc.written_bytes.load(Ordering::Relaxed), 3500);
            assert_eq!(rc.read_bytes.load(Ordering::Relaxed), 3500);
            assert_eq!(node.counters().completions.load(Ordering::Relaxed), 3);
            // Too little room, or a read that does not fill: refused up front.
            assert!(n.transfer(WrOp::Write, addr, 3500, &[s1], landing.clone()).await.is_err());
            assert!(n.broken().is_none());
        });
    }

    #[test]
    fn many_requests_in_flight_share_one_queue_pair() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap();
        rt.block_on(async {
            let net = FakeNet::default();
            let client = runtime(&net, &["mlx5_0"], 5_000);
            let node = node_runtime(&net, &["mlx5_0"], 5_000);
            let (c, n) = pair(&client, &node);
            let n = Arc::new(n);
            let mut dst = vec![0u8; 64 * 1024];
            let base = dst.as_mut_ptr() as usize;
            let mut tasks = Vec::new();
            for i in 0..64usize {
                let (seg, reg) = client.segment(c.rail(), base + i * 1024, 1024).unwrap();
                let n = n.clone();
                tasks.push(tokio::spawn(async move {
                    let src = Arc::new(vec![i as u8; 1024]);
                    n.transfer(WrOp::Write, src.as_ptr() as usize, 1024, &[seg], src.clone()).await.map(|()| reg)
                }));
            }
            for t in tasks {
                t.await.unwrap().unwrap();
            }
            for i in 0..64 {
                assert!(dst[i * 1024..(i + 1) * 1024].iter().all(|&b| b == i as u8), "request {i}");
            }
            assert_eq!(n.in_flight(), 0);
        });
    }

    #[test]
    fn a_failing_or_silent_queue_pair_breaks_without_a_hang() {
        rt().block_on(async {
            let net = FakeNet::default();
            let client = runtime(&net, &["mlx5_0"], 200);
            let node = node_runtime(&net, &["mlx5_0"], 200);
            let (c, n) = pair(&client, &node);
            let mut dst = vec![0u8; 4096];
            let (seg, _reg) = client.segment(c.rail(), dst.as_mut_ptr() as usize, 4096).unwrap();
            let src = Arc::new(vec![7u8; 4096]);
            // A key the client never registered: the device refuses it.
            let bad = Segment { rkey: 9999, ..seg };
            let e = n.transfer(WrOp::Write, src.as_ptr() as usize, 4096, &[bad], src.clone()).await.unwrap_err();
            assert_eq!(e, RdmaError::Failed(10));
            assert!(n.broken().is_some());
            assert!(matches!(
                n.transfer(WrOp::Write, src.as_ptr() as usize, 4096, &[seg], src.clone()).await,
                Err(RdmaError::Broken(_))
            ));
            // A fresh link (the reconnect); then completions stop coming.
            let (_c2, n2) = pair(&client, &node);
            net.swallow_all();
            let t0 = Instant::now();
            let e = n2.transfer(WrOp::Write, src.as_ptr() as usize, 4096, &[seg], src.clone()).await.unwrap_err();
            assert_eq!(e, RdmaError::Timeout(Duration::from_millis(200)));
            assert!(t0.elapsed() < Duration::from_secs(3));
            assert_eq!(node.counters().timeouts.load(Ordering::Relaxed), 1);
            assert_eq!(node.counters().qp_broken.load(Ordering::Relaxed), 2);
            // The source stays alive until the queue pair is gone.
            assert!(Arc::strong_count(&src) > 1);
            drop(n2);
            // The polling thread may hold the queue pair for one more pass.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Arc::strong_count(&src) > 1 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(Arc::strong_count(&src), 1);
            drop(dst);
        });
    }

    /// A queue pair whose destroy fails may still be live: the memory of
    /// its failed requests is leaked, never freed for reuse (before, it was
    /// freed anyway), and the failure takes no caller down.
    #[test]
    fn a_queue_pair_that_cannot_be_destroyed_keeps_its_memory() {
        rt().block_on(async {
            let net = FakeNet::default();
            let client = runtime(&net, &["mlx5_0"], 200);
            let node = node_runtime(&net, &["mlx5_0"], 200);
            let (_c, n) = pair(&client, &node);
            let mut dst = vec![0u8; 4096];
            let (seg, _reg) = client.segment(0, dst.as_mut_ptr() as usize, 4096).unwrap();
            let src = Arc::new(vec![7u8; 4096]);
            net.swallow_all();
            let e = n.transfer(WrOp::Write, src.as_ptr() as usize, 4096, &[seg], src.clone()).await.unwrap_err();
            assert_eq!(e, RdmaError::Timeout(Duration::from_millis(200)));
            assert!(Arc::strong_count(&src) > 1, "held while the queue pair lives");
            net.fail_destroys();
            n.close();
            assert_eq!(Arc::strong_count(&src), 2, "kept: the device may still write from it");
            drop(n);
        });
    }

    #[test]
    fn node_memory_is_out_of_peers_reach_and_big_transfers_go_in_chunks() {
        rt().block_on(async {
            let net = FakeNet::default();
            let client = runtime(&net, &["mlx5_0"], 2_000);
            let node = node_runtime(&net, &["mlx5_0"], 2_000);
            let (c, n) = pair(&client, &node);
            // The node's memory is registered for local access only: a peer
            // holding its key (here handed over) still cannot write it.
            let secret = Arc::new(vec![1u8; 4096]);
            let (nseg, _r) = node.segment(0, secret.as_ptr() as usize, 4096).unwrap();
            let src = Arc::new(vec![9u8; 4096]);
            let e = c.transfer(WrOp::Write, src.as_ptr() as usize, 4096, &[nseg], src.clone()).await.unwrap_err();
            assert_eq!(e, RdmaError::Failed(10));
            assert!(secret.iter().all(|&b| b == 1));
            // 100 segments over a depth of 8: chunks of 8, no stall.
            let mut dst = vec![0u8; 100 * 64];
            // Registrations held while the request runs, as the client does (a
            // wider one may replace a cached one; the held one stays valid).
            let (segs, _regs): (Vec<Segment>, Vec<Registration>) =
                (0..100).map(|i| client.segment(0, dst.as_mut_ptr() as usize + i * 64, 64).unwrap()).unzip();
            let src: Arc<Vec<u8>> = Arc::new((0..6400u32).map(|i| (i % 241) as u8).collect());
            let t0 = Instant::now();
            n.transfer(WrOp::Write, src.as_ptr() as usize, src.len(), &segs, src.clone()).await.unwrap();
            assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
            assert_eq!(&dst[..], &src[..]);
            // Closing a link on purpose is not a broken queue pair.
            let before = node.counters().qp_broken.load(Ordering::Relaxed);
            n.close();
            assert!(n.broken().is_some());
            assert_eq!(node.counters().qp_broken.load(Ordering::Relaxed), before);
        });
    }

    /// Each end's queue pair issues no more READs at once than its own
    /// device and the peer's serve: a node whose card allows 16 facing a
    /// client whose card serves 4 issues 4 (before, each end clamped only
    /// to its own device, and the 5th READ in flight broke the queue pair).
    #[test]
    fn queue_pairs_issue_no_more_reads_than_the_peer_serves() {
        let net = FakeNet::default();
        net.set_read_limits("cx-client", 4, 8);
        net.set_read_limits("cx-node", 16, 16);
        let client = runtime(&net, &["cx-client"], 5_000);
        let node = node_runtime(&net, &["cx-node"], 5_000);
        let (c, n) = pair(&client, &node);
        assert_eq!(n.read_depth(), Some(4), "the node reads no faster than the client's card serves");
        assert_eq!(c.read_depth(), Some(8), "the client's own initiator limit");
    }

    #[test]
    fn a_node_pairs_a_peer_with_the_same_rail() {
        let ep = |device: &str, gid: [u8; 16]| Endpoint {
            depth: 1,
            port: 1,
            mtu: 5,
            lid: 0,
            gid,
            qpn: 1,
            psn: 1,
            device: device.into(),
            reads: None,
            batches: false,
        };
        let ib = |prefix: u8, id: u8| {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[7] = prefix;
            g[15] = id;
            g
        };
        let v4 = |a: u8, b: u8, c: u8, d: u8| {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(&[a, b, c, d]);
            g
        };
        let rails = vec![("mlx5_0".to_string(), ib(1, 1)), ("mlx5_1".to_string(), ib(2, 1))];
        assert_eq!(match_rail(&ep("mlx5_1", ib(9, 9)), &rails), Some(1), "same name when no subnet matches");
        assert_eq!(match_rail(&ep("mlx5_0", ib(2, 7)), &rails), Some(1), "the subnet before the name");
        assert_eq!(match_rail(&ep("mlx5_0", [0; 16]), &rails), Some(0), "the name when the GID says nothing");
        // The default subnet prefix (fe80::/64) on every port says nothing
        // either: pairing by it would put every peer on the first rail.
        let local = |id: u8| {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = id;
            g
        };
        let default = vec![("mlx5_0".to_string(), local(1)), ("mlx5_1".to_string(), local(2))];
        assert_eq!(match_rail(&ep("mlx5_1", local(9)), &default), Some(1), "by name under the default prefix");
        assert_eq!(match_rail(&ep("ibp1", ib(2, 7)), &rails), Some(1), "same subnet prefix");
        assert_eq!(match_rail(&ep("ibp1", ib(3, 7)), &rails), None);
        let roce = vec![("eth0".to_string(), v4(10, 0, 1, 5)), ("eth1".to_string(), v4(10, 0, 2, 5))];
        assert_eq!(match_rail(&ep("rocep1", v4(10, 0, 2, 9)), &roce), Some(1), "same /24");
        assert_eq!(match_rail(&ep("rocep1", v4(10, 0, 3, 9)), &roce), None);
        assert_eq!(match_rail(&ep("x", [0; 16]), &roce), None);
    }

    #[test]
    fn pins_span_every_rail_and_invalidation_drops_cached_ones() {
        let net = FakeNet::default();
        let client = runtime(&net, &["a", "b"], 1000);
        let pool = vec![0u8; 8192];
        client.pin(pool.as_ptr() as usize, pool.len()).unwrap();
        assert_eq!(net.registrations(), 2);
        let other = Box::new([0u8; 100]);
        let (_, r) = client.segment(1, other.as_ptr() as usize, 100).unwrap();
        drop(r);
        assert_eq!(net.registrations(), 3);
        client.invalidate(other.as_ptr() as usize, 100);
        assert_eq!(net.registrations(), 2);
        assert!(client.unpin(pool.as_ptr() as usize));
        assert_eq!(net.registrations(), 0);
        assert_eq!(client.counters().registrations.load(Ordering::Relaxed), 3);
    }
}
