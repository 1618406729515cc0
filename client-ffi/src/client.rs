//! The async client core: routing over a weighted Ketama ring (docs/PROTOCOL.md §4),
//! one exclusive pooled connection per request, zero-copy scatter/gather
//! with the payload CRC computed as bytes stream, batches fanned out to
//! their owners, and peer cool-downs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::future::join_all;
use futures_util::stream::{self, StreamExt};
use kv_common::page::{Geometry, PageHeader};
use kv_common::ring::Placement;
use kv_common::status::Status;
use kv_common::wire::{
    MAX_BATCH_ITEMS, MAX_BATCH_KEYS, MAX_BATCH_PUT_RECORDS, WIRE_VERSION_BATCH, WIRE_VERSION_BATCH_WRITE,
};

use crate::error::OpError;
use crate::exchange::{GetReply, PutItem};
use crate::handoff::{Handoff, Handoffs};
use crate::hot::HotKeys;
use crate::members::Member;
use crate::metrics::Metrics;
use crate::node::Node;
use crate::options::Options;
use crate::pipeline::{BatchExistX, DeleteManyX, DeleteX, ExistX, GetManyX, GetX, Pipeline, PutManyX, PutX};
pub use crate::pipeline::{GetItem, PIPELINE_WINDOW};
pub use crate::topology::{GivenSet, Previous, Topology};

pub struct Client {
    pub opts: Options,
    pub geo: Geometry,
    /// The transport that moves payloads between the caller's memory and
    /// the nodes' (RDMA when `rdma_devices` named usable devices; else none,
    /// and every payload travels inline over TCP).
    pub fabric: crate::rdma::Fabric,
    topo: RwLock<Arc<Topology>>,
    epochs: AtomicU64,
    /// Serialises member-set swaps (read old, build, install, as one step).
    swapping: std::sync::Mutex<()>,
    discovery_error: std::sync::Mutex<Option<String>>,
    pub metrics: Metrics,
    /// The ring handoff's own state: its window and background copies.
    handoffs: Handoffs,
    /// The keys whose reads this handle spreads (hot.rs).
    pub(crate) hot: HotKeys,
}

/// Where one read goes (docs/ARCHITECTURE.md, "Hot keys"): indices into
/// the topology's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadRoute {
    /// The key's owner.
    pub(crate) owner: usize,
    /// For a hot key, the node of its spread to ask first (None: the owner).
    pub(crate) copy: Option<usize>,
    /// The spread a hot key's read at its owner stands for, told to the
    /// owner: the key's spread on the owner's own turn, else 0 (one read).
    pub(crate) weight: u8,
}

/// Most puts one exchange of a batch put's lane carries (one BATCH_PUT
/// frame, within one I/O timeout: on media acks the node stores 8 at once).
pub const PUT_FRAME_ITEMS: usize = 64;

/// Fewest items a batch get's lane carries to a node that takes batch
/// frames (unless the node has fewer): `batch_concurrency` lanes at most.
pub const MIN_BATCH_LANE_ITEMS: usize = 4;

impl Client {
    pub fn new(members: Vec<Member>, geo: Geometry, opts: Options) -> Client {
        let fabric = crate::rdma::Fabric::start(&opts);
        Client::build(members, geo, opts, fabric)
    }

    /// A client over a given RDMA engine (its counters are the engine's):
    /// for a caller that set the engine up itself, and for tests over the
    /// in-process stand-in fabric.
    pub fn with_rdma(
        members: Vec<Member>,
        geo: Geometry,
        opts: Options,
        rdma: Arc<kv_rdma::engine::Runtime>,
    ) -> Client {
        Client::build(members, geo, opts, crate::rdma::Fabric::over(rdma))
    }

    fn build(members: Vec<Member>, geo: Geometry, opts: Options, fabric: crate::rdma::Fabric) -> Client {
        let window = opts.handoff;
        let metrics = Metrics::default();
        let hot = HotKeys::new(metrics.hot.clone());
        let c = Client {
            opts,
            geo,
            fabric,
            topo: RwLock::new(Arc::new(Topology::empty())),
            epochs: AtomicU64::new(0),
            swapping: std::sync::Mutex::new(()),
            discovery_error: std::sync::Mutex::new(None),
            metrics,
            handoffs: Handoffs::new(window),
            hot,
        };
        if !members.is_empty() {
            c.set_members(members);
        }
        c
    }

    pub fn topology(&self) -> Arc<Topology> {
        self.topo.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the member set. Safe while requests run: they finish on the
    /// topology they started with. Nodes whose id, address and weight are
    /// unchanged keep their connection pools and health.
    pub fn set_members(&self, members: Vec<Member>) -> u64 {
        self.set_members_at(members, None)
    }

    /// As [`Client::set_members`]; `epoch` is the MDS epoch of the view the
    /// members come from (None: a local swap, numbered by this client).
    pub fn set_members_at(&self, members: Vec<Member>, epoch: Option<u64>) -> u64 {
        self.install(members, self.opts.placement, epoch, Vec::new(), None)
    }

    /// Installs a member set. The set it replaces is kept as a previous set
    /// for the handoff window, with the sets still in theirs and those a
    /// kv-mds view names (`given`; its time left wins for an epoch both
    /// have). `window`: the view's `handoff_ms` (None: this client's
    /// `handoff_ms` option; zero in either turns the handoff off).
    pub fn install(
        &self,
        members: Vec<Member>,
        placement: Placement,
        epoch: Option<u64>,
        given: Vec<GivenSet>,
        window: Option<Duration>,
    ) -> u64 {
        let _one = self.swapping.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.topology();
        let local = self.epochs.fetch_add(1, Ordering::AcqRel) + 1;
        let epoch = epoch.unwrap_or(local);
        let window = if self.opts.handoff.is_zero() { Duration::ZERO } else { window.unwrap_or(self.opts.handoff) };
        self.handoffs.set_window(window);
        let next = old.next(&members, placement, epoch, given, window, |m| {
            Node::new(
                m.id.clone(),
                m.addr.clone(),
                m.weight,
                self.opts.max_conns_per_node,
                self.opts.auth_token.clone(),
                self.fabric.offer(),
            )
        });
        self.metrics.handoff.sets.store(next.previous.len() as u64, Ordering::Relaxed);
        *self.topo.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
        self.metrics.ring_rebuilds.fetch_add(1, Ordering::Relaxed);
        epoch
    }

    /// Records why discovery last failed (read by `kv_stats_snapshot`).
    pub fn set_discovery_error(&self, msg: String) {
        *self.discovery_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
    }

    pub fn discovery_error(&self) -> Option<String> {
        self.discovery_error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn epoch(&self) -> u64 {
        self.topology().epoch
    }

    /// The node owning `key`, or the status to answer without the network.
    pub(crate) fn route(&self, topo: &Topology, key: &[u8]) -> Result<Arc<Node>, Status> {
        let Some(i) = topo.ring.owner(key) else {
            crate::error::note("no members: give a member list or start discovery".into());
            return Err(Status::Unavailable);
        };
        let node = &topo.nodes[i];
        if node.cooling() {
            self.metrics.fast_unavailable.fetch_add(1, Ordering::Relaxed);
            crate::error::note(format!("node {} ({}) is cooling down after a failure", node.id, node.addr));
            return Err(Status::Unavailable);
        }
        Ok(node.clone())
    }

    /// Whether this handle spreads hot keys' reads: copies are handoff
    /// copies, so not where the handoff is off (a zero window).
    pub(crate) fn spreads(&self) -> bool {
        self.handoffs.window_open()
    }

    /// The owner's answer to a read of `key` (a hit): remembers the key hot
    /// or forgets it, as the answer says.
    pub(crate) fn note_hot(&self, key: &[u8], spread: u8) {
        if self.spreads() {
            self.hot.noted(key, spread);
        }
    }

    /// Whether this handle spreads the reads of `key` now (for tools and tests).
    pub fn is_hot_key(&self, key: &[u8]) -> bool {
        self.hot.is_hot(key)
    }

    /// Where a read of `key` goes: the one routing rule of reads
    /// (docs/ARCHITECTURE.md, "Hot keys"). A key this handle holds hot is
    /// read, in turn, at each of the first `spread` distinct members from
    /// its owner on the ring (the owner included; fewer when the set is
    /// smaller), skipping a node cooling down or whose last spread read
    /// failed; any other key at its owner. Err: the status to answer
    /// without the network (no members, or the owner cooling down and no
    /// copy to ask).
    pub(crate) fn read_route(&self, topo: &Topology, key: &[u8]) -> Result<ReadRoute, Status> {
        let Some(owner) = topo.ring.owner(key) else {
            crate::error::note("no members: give a member list or start discovery".into());
            return Err(Status::Unavailable);
        };
        let node = &topo.nodes[owner];
        let hot = if self.spreads() { self.hot.turn(key) } else { None };
        if let Some((spread, turn)) = hot {
            let n = usize::from(spread).min(topo.nodes.len());
            if n >= 2 {
                let mut pick = turn as usize % n;
                // Only the owner's own turn stands for the n reads of a
                // round; a read it takes for a copy (the copy skipped, or
                // a fallback after a copy's miss) is one read.
                let weight = if pick == 0 { n as u8 } else { 0 };
                if pick == 0 && node.cooling() {
                    pick = 1;
                }
                // The ring walked only as far as the member picked.
                let picked = if pick > 0 { topo.ring.owners(key, pick + 1).get(pick).copied() } else { None };
                if let Some(m) = picked {
                    let c = &topo.nodes[m];
                    if !c.cooling() && !c.handoff_skipped() {
                        return Ok(ReadRoute { owner, copy: Some(m), weight: 0 });
                    }
                }
                if !node.cooling() {
                    return Ok(ReadRoute { owner, copy: None, weight });
                }
            }
        }
        if node.cooling() {
            self.metrics.fast_unavailable.fetch_add(1, Ordering::Relaxed);
            crate::error::note(format!("node {} ({}) is cooling down after a failure", node.id, node.addr));
            return Err(Status::Unavailable);
        }
        Ok(ReadRoute { owner, copy: None, weight: 0 })
    }

    /// A read of a hot key's copy at `node` failed: a node at fault is
    /// skipped for spread reads for the peer cool-down, its own keys
    /// untouched (the read goes on at the owner).
    pub(crate) fn copy_failed(&self, node: &Node, e: OpError) {
        crate::error::note(format!("node {} ({}), read of a hot key's copy: {e}", node.id, node.addr));
        if e.is_peer_failure() {
            node.skip_handoff(std::time::Instant::now() + self.opts.peer_cooldown);
        }
    }

    /// Counts reads of copies that go on at the owner.
    fn fell_back(&self, n: usize) {
        self.metrics.hot.fallbacks.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The request pipeline over this handle's options, geometry and metrics.
    pub(crate) fn pipeline(&self) -> Pipeline<'_> {
        Pipeline { opts: &self.opts, geo: &self.geo, metrics: &self.metrics }
    }

    /// The ring handoff over this handle's pipeline.
    pub(crate) fn handoff(&self) -> Handoff<'_> {
        Handoff::over(self.pipeline(), &self.handoffs)
    }

    /// Records a failed request to `node`; the status its items get.
    pub(crate) fn failed_node(&self, node: &Node, e: OpError) -> Status {
        self.pipeline().failed(node, e).status()
    }

    /// Stores the payload gathered from `bufs` under `key`.
    pub async fn putv(&self, key: &[u8], bufs: &[&[u8]]) -> Status {
        let topo = self.topology();
        let node = match self.route(&topo, key) {
            Ok(n) => n,
            Err(s) => return self.metrics.count_put(s, 0),
        };
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let mut h = crc32fast::Hasher::new();
        for b in bufs {
            h.update(b);
        }
        let header = PageHeader::new(self.geo, key, len, h.finalize()).encode();
        let mut x = PutX { header, key, bufs };
        let s = match self.pipeline().run_on(&node, &mut x).await {
            Ok(()) => Status::Ok,
            Err(e) => e.status(),
        };
        self.metrics.count_put(s, len)
    }

    /// Reads the page for `key` into `bufs` in order. Ok(len) on a hit;
    /// Err((status, needed)) otherwise (`needed` is set for KV_TOO_SMALL).
    pub async fn getv(&self, key: &[u8], bufs: &mut [&mut [u8]]) -> Result<usize, (Status, usize)> {
        let topo = self.topology();
        let route = match self.read_route(&topo, key) {
            Ok(r) => r,
            Err(s) => return Err(self.metrics.count_get(s, 0, 0)),
        };
        let node = topo.nodes[route.owner].clone();
        // A hot key: its copy first, within the handoff timeout; the owner
        // after a miss or a failure there (and a copy made after a miss).
        let mut fill = None;
        if let Some(c) = route.copy {
            let copy = &topo.nodes[c];
            let asked_at = std::time::Instant::now();
            let mut x = GetX { key, bufs: &mut *bufs, extra: 0, weight: 0 };
            match self.pipeline().run_short(copy, self.opts.handoff_timeout, &mut x).await {
                Ok(r @ GetReply { status: Status::Ok | Status::TooSmall, .. }) => {
                    self.metrics.hot.copy_hits.fetch_add(1, Ordering::Relaxed);
                    return self.got(r);
                }
                Ok(GetReply { status: Status::Miss, .. }) => fill = Some((copy.clone(), asked_at)),
                Ok(_) => {}
                Err(e) => self.copy_failed(copy, e),
            }
            self.fell_back(1);
            if node.cooling() {
                return Err(self.metrics.count_get(Status::Unavailable, 0, 0));
            }
        }
        let mut x = GetX { key, bufs, extra: 0, weight: route.weight };
        let mut reply = match self.pipeline().run_on(&node, &mut x).await {
            Ok(r) => r,
            Err(e) => return Err(self.metrics.count_get(e.status(), 0, 0)),
        };
        if reply.status == Status::Ok {
            self.note_hot(key, reply.spread);
            if let Some((copy, asked_at)) = fill {
                self.handoff().copy_later(copy, key, x.bufs, reply.len, asked_at, true);
            }
        }
        if reply.status == Status::Miss && !topo.previous.is_empty() {
            reply = self.handoff().get(&topo, &node, key, x.bufs).await.unwrap_or(reply);
        }
        self.got(reply)
    }

    /// A get's outcome, counted.
    fn got(&self, reply: GetReply) -> Result<usize, (Status, usize)> {
        match reply {
            GetReply { status: Status::Ok, len, .. } => {
                self.metrics.count_get(Status::Ok, len as u64, 0);
                Ok(len)
            }
            GetReply { status, len, .. } => Err(self.metrics.count_get(status, 0, len)),
        }
    }

    /// KV_OK only where a get by this client would hit.
    pub async fn exist(&self, key: &[u8]) -> Status {
        let topo = self.topology();
        let node = match self.route(&topo, key) {
            Ok(n) => n,
            Err(s) => return s,
        };
        let mut s = match self.pipeline().run_on(&node, &mut ExistX { key }).await {
            Ok(s) => s,
            Err(e) => e.status(),
        };
        if s == Status::Miss && !topo.previous.is_empty() {
            let mut out = [s];
            self.handoff().exist(&topo, &[key], &mut out).await;
            s = out[0];
        }
        self.metrics.count_exist(s, 1)
    }

    /// Removes `key` at its owner: Ok, or Miss when it was not stored.
    pub async fn delete(&self, key: &[u8]) -> Status {
        let topo = self.topology();
        let node = match self.route(&topo, key) {
            Ok(n) => n,
            Err(s) => return self.metrics.count_delete(s),
        };
        let mut s = match self.pipeline().run_on(&node, &mut DeleteX { key }).await {
            Ok(s) => s,
            Err(e) => e.status(),
        };
        // A copy may sit elsewhere: at any previous owner inside a handoff
        // window, and at the nodes a hot key's reads were spread over
        // (Handoff::holders). Removed there too, all at once (a dead node
        // costs one handoff timeout), so no read finds it again. KV_OK when
        // one had it; a previous owner that could not be reached is the
        // answer (the delete is not done) unless the owner failed first.
        if (self.spreads() || !topo.previous.is_empty()) && matches!(s, Status::Ok | Status::Miss) {
            let handoff = self.handoff();
            let holders = handoff.holders(&topo, key, &node, self.spreads());
            let done = join_all(holders.iter().map(|(n, until, _)| handoff.ask(n, *until, DeleteX { key }))).await;
            if done.iter().zip(&holders).any(|(d, h)| d.is_none() && h.2) {
                s = Status::Unavailable;
            } else if done.contains(&Some(Status::Ok)) {
                s = Status::Ok;
            }
        }
        self.metrics.count_delete(s)
    }

    /// Per-key statuses: one BATCH_EXIST frame per owner (chunked at 4096
    /// keys), owners asked concurrently.
    pub async fn batch_exist(&self, keys: &[&[u8]]) -> Vec<Status> {
        let topo = self.topology();
        let mut out = vec![Status::Unavailable; keys.len()];
        let groups = self.group(&topo, keys.iter().copied(), &mut out);
        let jobs = groups
            .into_iter()
            .flat_map(|(node, idx)| idx.chunks(MAX_BATCH_KEYS).map(|c| (node.clone(), c.to_vec())).collect::<Vec<_>>());
        let results = join_all(jobs.map(|(node, idx)| async move {
            let mut x = BatchExistX { keys: idx.iter().map(|&i| keys[i]).collect(), extra: 0 };
            let r = self.pipeline().run_on(&node, &mut x).await;
            (idx, r)
        }))
        .await;
        for (idx, r) in results {
            match r {
                Ok(st) => {
                    for (i, s) in idx.into_iter().zip(st) {
                        out[i] = s;
                    }
                }
                Err(e) => {
                    for i in idx {
                        out[i] = e.status();
                    }
                }
            }
        }
        if !topo.previous.is_empty() {
            self.handoff().exist(&topo, keys, &mut out).await;
        }
        for s in &out {
            self.metrics.count_exist(*s, 1);
        }
        out
    }

    /// Groups item indices by owner; items with no usable owner get their
    /// status in `out` now.
    pub(crate) fn group<'k>(
        &self,
        topo: &Topology,
        keys: impl Iterator<Item = &'k [u8]>,
        out: &mut [Status],
    ) -> Vec<(Arc<Node>, Vec<usize>)> {
        // Group by ring member index; a node's Arc is cloned once per group,
        // not per key (that refcount would bounce between cores).
        let mut by_member: Vec<Vec<usize>> = vec![Vec::new(); topo.nodes.len()];
        for (i, key) in keys.enumerate() {
            match topo.ring.owner(key) {
                Some(m) => by_member[m].push(i),
                None => {
                    crate::error::note("no members: give a member list or start discovery".into());
                    out[i] = Status::Unavailable
                }
            }
        }
        let mut groups = Vec::new();
        for (m, idx) in by_member.into_iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let node = &topo.nodes[m];
            if node.cooling() {
                self.metrics.fast_unavailable.fetch_add(idx.len() as u64, Ordering::Relaxed);
                crate::error::note(format!("node {} ({}) is cooling down after a failure", node.id, node.addr));
                idx.iter().for_each(|&i| out[i] = Status::Unavailable);
            } else {
                groups.push((node.clone(), idx));
            }
        }
        groups
    }

    /// Puts many pages: items fan out to their owners. To a node that takes
    /// batch writes, an owner's items are spread over up to
    /// `batch_concurrency` lanes of at least [`MIN_BATCH_LANE_ITEMS`], each
    /// lane's items sent as BATCH_PUT frames one after another on one
    /// connection (over RDMA, a node whose bootstrap predates segments in
    /// batch items takes a lane's items one by one); to an older node, at
    /// most `batch_concurrency` single puts at once. Per-item statuses.
    pub async fn batch_putv(&self, items: &[(&[u8], Vec<&[u8]>)]) -> Vec<Status> {
        let limit = self.opts.batch_concurrency;
        let topo = self.topology();
        let mut out = vec![Status::Unavailable; items.len()];
        let groups = self.group(&topo, items.iter().map(|(k, _)| *k), &mut out);
        let (mut framed, mut single) = (Vec::new(), Vec::new());
        for (node, idx) in groups {
            if node.speaks() >= WIRE_VERSION_BATCH_WRITE {
                let lanes = limit.min(idx.len().div_ceil(MIN_BATCH_LANE_ITEMS)).max(1);
                let mut of_node: Vec<Vec<usize>> = vec![Vec::new(); lanes];
                for (n, i) in idx.into_iter().enumerate() {
                    of_node[n % lanes].push(i);
                }
                framed.extend(of_node.into_iter().map(|lane| self.put_lane(node.clone(), lane, items)));
            } else {
                single.push(
                    stream::iter(idx)
                        .map(|i| async move { (i, self.putv(items[i].0, &items[i].1).await) })
                        .buffer_unordered(limit)
                        .collect::<Vec<_>>(),
                );
            }
        }
        let (a, b) = futures_util::future::join(join_all(framed), join_all(single)).await;
        for (i, s) in a.into_iter().chain(b).flatten() {
            out[i] = s;
        }
        out
    }

    /// One lane of a batch put: its items as BATCH_PUT frames (at most
    /// [`PUT_FRAME_ITEMS`] items and 64 MiB of records an exchange), one
    /// frame at a time on one connection.
    async fn put_lane(&self, node: Arc<Node>, lane: Vec<usize>, items: &[(&[u8], Vec<&[u8]>)]) -> Vec<(usize, Status)> {
        let mut out = Vec::with_capacity(lane.len());
        let record = |i: usize| {
            let (key, bufs) = &items[i];
            let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            let mut h = crc32fast::Hasher::new();
            for b in bufs {
                h.update(b);
            }
            PutItem { header: PageHeader::new(self.geo, key, len, h.finalize()).encode(), key, bufs }
        };
        let mut at = 0;
        while at < lane.len() {
            // This frame's items: at least one, then while they fit.
            let mut x = PutManyX { items: vec![record(lane[at])] };
            let mut bytes = x.items[0].record_len();
            while at + x.items.len() < lane.len() && x.items.len() < PUT_FRAME_ITEMS {
                let next = record(lane[at + x.items.len()]);
                if bytes + next.record_len() > MAX_BATCH_PUT_RECORDS {
                    break;
                }
                bytes += next.record_len();
                x.items.push(next);
            }
            let idx = &lane[at..at + x.items.len()];
            at += x.items.len();
            let lens: Vec<u64> = x.items.iter().map(|it| it.record_len() - (64 + it.key.len()) as u64).collect();
            match self.pipeline().run_on(&node, &mut x).await {
                Ok(rs) => {
                    for ((&i, r), len) in idx.iter().zip(rs).zip(lens) {
                        let s = match r {
                            Ok(()) => self.metrics.count_put(Status::Ok, len),
                            Err(e) => self.metrics.count_put(self.failed_node(&node, e), 0),
                        };
                        out.push((i, s));
                    }
                }
                Err(e) => {
                    let s = e.status();
                    for &i in idx {
                        out.push((i, self.metrics.count_put(s, 0)));
                    }
                }
            }
        }
        out
    }

    /// Removes many keys at their owners: Ok or Miss per key. One
    /// BATCH_DELETE frame per owner and 1024 keys to a node that takes
    /// batch writes (one DELETE a key to an older one); then, as
    /// [`Client::delete`] does, at every other node that may hold a copy
    /// (previous owners, the nodes of a hot key's spread), one frame per
    /// node and 1024 keys, all at once.
    pub async fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Status> {
        let topo = self.topology();
        let fits = |k: &&[u8]| !k.is_empty() && k.len() <= kv_common::page::MAX_KEY_LEN;
        if !keys.iter().all(fits) {
            let limit = self.opts.batch_concurrency;
            return stream::iter(keys).map(|k| self.delete(k)).buffered(limit).collect().await;
        }
        let mut out = vec![Status::Unavailable; keys.len()];
        let groups = self.group(&topo, keys.iter().copied(), &mut out);
        let jobs = groups.into_iter().flat_map(|(node, idx)| {
            idx.chunks(MAX_BATCH_ITEMS).map(|c| (node.clone(), c.to_vec())).collect::<Vec<_>>()
        });
        let results = join_all(jobs.map(|(node, idx)| async move {
            let mut x = DeleteManyX { keys: idx.iter().map(|&i| keys[i]).collect() };
            let r = self.pipeline().run_on(&node, &mut x).await;
            (idx, r)
        }))
        .await;
        for (idx, r) in results {
            match r {
                Ok(st) => idx.into_iter().zip(st).for_each(|(i, s)| out[i] = s),
                Err(e) => idx.into_iter().for_each(|i| out[i] = e.status()),
            }
        }
        if self.spreads() || !topo.previous.is_empty() {
            self.delete_copies(&topo, keys, &mut out).await;
        }
        for s in &mut out {
            *s = self.metrics.count_delete(*s);
        }
        out
    }

    /// The second half of a batch delete: each key its owner removed (Ok or
    /// Miss in `out`) removed at the other nodes that may hold a copy
    /// (Handoff::holders), grouped by node. Ok when one had it; Unavailable
    /// when one the delete must reach (a previous owner) could not be.
    async fn delete_copies(&self, topo: &Topology, keys: &[&[u8]], out: &mut [Status]) {
        let handoff = self.handoff();
        // Per node: the items, each with whether the delete must reach it.
        let mut groups: Vec<DeleteGroup> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if !matches!(out[i], Status::Ok | Status::Miss) {
                continue;
            }
            let Some(o) = topo.ring.owner(key) else { continue };
            for (n, until, must) in handoff.holders(topo, key, &topo.nodes[o], self.spreads()) {
                match groups.iter_mut().find(|g| Arc::ptr_eq(&g.0, &n)) {
                    Some(g) => g.2.push((i, must)),
                    None => groups.push((n, until, vec![(i, must)])),
                }
            }
        }
        let jobs = groups.into_iter().flat_map(|(node, until, idx)| {
            idx.chunks(MAX_BATCH_ITEMS).map(|c| (node.clone(), until, c.to_vec())).collect::<Vec<_>>()
        });
        let handoff = &handoff;
        let results = join_all(jobs.map(|(node, until, idx)| async move {
            let x = DeleteManyX { keys: idx.iter().map(|&(i, _)| keys[i]).collect() };
            (idx, handoff.ask(&node, until, x).await)
        }))
        .await;
        let (mut had, mut failed) = (vec![false; keys.len()], vec![false; keys.len()]);
        for (idx, r) in results {
            match r {
                None => idx.into_iter().filter(|&(_, must)| must).for_each(|(i, _)| failed[i] = true),
                Some(st) => {
                    idx.into_iter().zip(st).filter(|(_, s)| *s == Status::Ok).for_each(|((i, _), _)| had[i] = true)
                }
            }
        }
        for (i, s) in out.iter_mut().enumerate() {
            if failed[i] {
                *s = Status::Unavailable;
            } else if had[i] {
                *s = Status::Ok;
            }
        }
    }

    /// Gets many pages into their buffers; per-item (status, length). Per
    /// node, items are spread over up to `batch_concurrency` connections
    /// (lanes); each lane pipelines its items, [`PIPELINE_WINDOW`] requests in
    /// flight on its connection at once. Items go where [`Client::read_route`]
    /// sends them: a hot key's to a node of its spread, asked within the
    /// handoff timeout, and to its owner after a miss or a failure there
    /// (a copy then written where it missed).
    pub async fn batch_getv(&self, items: &mut [GetItem<'_, '_>]) -> Vec<(Status, usize)> {
        let topo = self.topology();
        let mut early = vec![Status::Ok; items.len()];
        // Without a hot key (the common case) every item goes to its owner.
        let routes: Vec<Option<ReadRoute>> = if self.spreads() && self.hot.any() {
            items
                .iter()
                .enumerate()
                .map(|(i, (k, _))| self.read_route(&topo, k).map_err(|s| early[i] = s).ok())
                .collect()
        } else {
            Vec::new()
        };
        let weights: Vec<u8> = routes.iter().map(|r| r.map_or(0, |r| r.weight)).collect();
        let (groups, copies) = if routes.is_empty() {
            (self.group(&topo, items.iter().map(|(k, _)| *k), &mut early), Vec::new())
        } else {
            let owners = by_node(&topo, routes.iter().map(|r| r.filter(|r| r.copy.is_none()).map(|r| r.owner)));
            (owners, by_node(&topo, routes.iter().map(|r| r.and_then(|r| r.copy))))
        };
        let mut out: Vec<(Status, usize)> = early.iter().map(|&s| (s, 0)).collect();
        // Hand each group its own items (disjoint &mut borrows).
        let mut slots: Vec<Option<&mut GetItem<'_, '_>>> = items.iter_mut().map(Some).collect();
        let mut lanes_all = Vec::new();
        for (node, idx) in groups {
            lanes_all.extend(self.lanes(node, idx, &mut slots, &mut out));
        }
        let mut copy_lanes = Vec::new();
        for (node, idx) in copies {
            copy_lanes.extend(self.lanes(node, idx, &mut slots, &mut out));
        }
        let defer = !topo.previous.is_empty();
        let asked_at = std::time::Instant::now();
        let w = &weights;
        let (results, at_copies) = futures_util::future::join(
            join_all(lanes_all.into_iter().map(|(node, lane)| self.get_lane(node, lane, defer, w))),
            join_all(copy_lanes.into_iter().map(|(node, lane)| self.copy_lane(node, lane))),
        )
        .await;
        for (i, r) in results.into_iter().flatten() {
            out[i] = r;
        }
        // Copies that did not serve: their items asked at their owners.
        let mut again: Vec<(usize, bool)> = Vec::new();
        for (i, r) in at_copies.into_iter().flatten() {
            match r {
                Some(r) if matches!(r.status, Status::Ok | Status::TooSmall) => {
                    let bytes = if r.status == Status::Ok { r.len as u64 } else { 0 };
                    self.metrics.hot.copy_hits.fetch_add(1, Ordering::Relaxed);
                    self.metrics.count_get(r.status, bytes, r.len);
                    out[i] = (r.status, r.len);
                }
                r => again.push((i, r.is_some_and(|r| r.status == Status::Miss))),
            }
        }
        if !again.is_empty() {
            self.fell_back(again.len());
            self.fall_back(&topo, items, &routes, &again, asked_at, &mut out).await;
        }
        if defer && out.iter().any(|r| r.0 == Status::Miss) {
            self.handoff().get_many(&topo, items, &mut out).await;
        }
        out
    }

    /// Items of hot keys whose copies did not serve them (`again`: item,
    /// whether its copy missed), asked at their owners; a page found there
    /// is copied to the node that missed it.
    async fn fall_back(
        &self,
        topo: &Topology,
        items: &mut [GetItem<'_, '_>],
        routes: &[Option<ReadRoute>],
        again: &[(usize, bool)],
        asked_at: std::time::Instant,
        out: &mut [(Status, usize)],
    ) {
        let mut owners = vec![None; routes.len()];
        for &(i, _) in again {
            match routes[i] {
                Some(r) if !topo.nodes[r.owner].cooling() => owners[i] = Some(r.owner),
                _ => {
                    self.metrics.count_get(Status::Unavailable, 0, 0);
                    out[i] = (Status::Unavailable, 0);
                }
            }
        }
        let weights: Vec<u8> = routes.iter().map(|r| r.map_or(0, |r| r.weight)).collect();
        let mut slots: Vec<Option<&mut GetItem<'_, '_>>> = items.iter_mut().map(Some).collect();
        let mut lanes = Vec::new();
        for (node, idx) in by_node(topo, owners.into_iter()) {
            lanes.extend(self.lanes(node, idx, &mut slots, out));
        }
        let defer = !topo.previous.is_empty();
        let w = &weights;
        let results = join_all(lanes.into_iter().map(|(node, lane)| self.get_lane(node, lane, defer, w))).await;
        for (i, r) in results.into_iter().flatten() {
            out[i] = r;
        }
        for &(i, missed) in again {
            let (Some(route), (Status::Ok, len)) = (routes[i], out[i]) else { continue };
            if let (true, Some(c)) = (missed, route.copy) {
                let (key, bufs) = &items[i];
                self.handoff().copy_later(topo.nodes[c].clone(), key, bufs, len, asked_at, true);
            }
        }
    }

    /// A node's items of a batch get as lanes: to a node that takes batch
    /// frames fewer, fuller lanes (docs/BENCHMARKS.md, "Batch frames": 64
    /// KiB pages in batches of 32 over three nodes, 4 items a lane served
    /// about 1.35x what 1 or 2 a lane did, at a fifth less node CPU a
    /// page), at most `batch_concurrency`. Each item is taken from
    /// `slots`, and stays not served in `out` until its answer comes (one
    /// that a lane never answered can never read as a hit).
    #[allow(clippy::type_complexity)]
    fn lanes<'s, 'k, 'b>(
        &self,
        node: Arc<Node>,
        idx: Vec<usize>,
        slots: &mut [Option<&'s mut GetItem<'k, 'b>>],
        out: &mut [(Status, usize)],
    ) -> Vec<(Arc<Node>, Vec<(usize, &'s mut GetItem<'k, 'b>)>)> {
        let per_lane = if node.speaks() >= WIRE_VERSION_BATCH { MIN_BATCH_LANE_ITEMS } else { 1 };
        let lanes = self.opts.batch_concurrency.min(idx.len().div_ceil(per_lane)).max(1);
        let mut of_node: Vec<Vec<(usize, &mut GetItem<'_, '_>)>> = (0..lanes).map(|_| Vec::new()).collect();
        for (n, i) in idx.into_iter().enumerate() {
            out[i] = (Status::Unavailable, 0);
            of_node[n % lanes].push((i, slots[i].take().expect("each item in one group")));
        }
        of_node.into_iter().map(|lane| (node.clone(), lane)).collect()
    }

    /// One lane of a batch get: its items, pipelined on one connection.
    /// `defer_misses`: misses are counted by the handoff that follows.
    /// `weights[i]`: the spread item i's hot key is read with (empty: none).
    async fn get_lane(
        &self,
        node: Arc<Node>,
        mut lane: Vec<(usize, &mut GetItem<'_, '_>)>,
        defer_misses: bool,
        weights: &[u8],
    ) -> Vec<(usize, (Status, usize))> {
        let mut out = Vec::with_capacity(lane.len());
        for window in lane.chunks_mut(PIPELINE_WINDOW) {
            let idx: Vec<usize> = window.iter().map(|(i, _)| *i).collect();
            let w = if weights.is_empty() { Vec::new() } else { idx.iter().map(|&i| weights[i]).collect() };
            let mut x = GetManyX {
                items: window.iter_mut().map(|(_, item)| (item.0, &mut item.1[..])).collect(),
                extra: 0,
                weights: w,
            };
            let r = self.pipeline().run_on(&node, &mut x).await;
            drop(x);
            match r {
                Ok(replies) => {
                    for ((i, r), (_, item)) in idx.into_iter().zip(replies).zip(window.iter()) {
                        let key = item.0;
                        let bytes = if r.status == Status::Ok { r.len as u64 } else { 0 };
                        if r.status == Status::Ok {
                            self.note_hot(key, r.spread);
                        }
                        // A miss may still be found by the handoff: counted then.
                        if r.status != Status::Miss || !defer_misses {
                            self.metrics.count_get(r.status, bytes, r.len);
                        }
                        out.push((i, (r.status, r.len)));
                    }
                }
                Err(e) => {
                    let s = e.status();
                    for i in idx {
                        self.metrics.count_get(s, 0, 0);
                        out.push((i, (s, 0)));
                    }
                }
            }
        }
        out
    }

    /// One lane of a batch get at a node holding copies of hot keys: its
    /// items pipelined on one connection, each window within the handoff
    /// timeout. None for an item not answered (the node failed: it is
    /// skipped for spread reads, and the rest of the lane not asked).
    /// Nothing is counted here: the caller counts what is served, and asks
    /// the owners for the rest.
    async fn copy_lane(
        &self,
        node: Arc<Node>,
        mut lane: Vec<(usize, &mut GetItem<'_, '_>)>,
    ) -> Vec<(usize, Option<GetReply>)> {
        let mut out = Vec::with_capacity(lane.len());
        let mut failed = false;
        for window in lane.chunks_mut(PIPELINE_WINDOW) {
            let idx: Vec<usize> = window.iter().map(|(i, _)| *i).collect();
            if failed {
                out.extend(idx.into_iter().map(|i| (i, None)));
                continue;
            }
            let mut x = GetManyX {
                items: window.iter_mut().map(|(_, item)| (item.0, &mut item.1[..])).collect(),
                extra: 0,
                weights: Vec::new(),
            };
            match self.pipeline().run_short(&node, self.opts.handoff_timeout, &mut x).await {
                Ok(replies) => out.extend(idx.into_iter().zip(replies).map(|(i, r)| (i, Some(r)))),
                Err(e) => {
                    self.copy_failed(&node, e);
                    failed = true;
                    out.extend(idx.into_iter().map(|i| (i, None)));
                }
            }
        }
        out
    }
}

/// Item indices grouped by the node each goes to (None: none), in member
/// order; a node's Arc is cloned once per group, not per item.
fn by_node(topo: &Topology, to: impl Iterator<Item = Option<usize>>) -> Vec<(Arc<Node>, Vec<usize>)> {
    let mut by_member: Vec<Vec<usize>> = vec![Vec::new(); topo.nodes.len()];
    for (i, m) in to.enumerate() {
        if let Some(m) = m {
            by_member[m].push(i);
        }
    }
    by_member
        .into_iter()
        .enumerate()
        .filter(|(_, idx)| !idx.is_empty())
        .map(|(m, idx)| (topo.nodes[m].clone(), idx))
        .collect()
}

/// A node's share of a batch delete's second half: the node, when a failed
/// ask there stops being skipped, and its items, each with whether the
/// delete must reach it.
type DeleteGroup = (Arc<Node>, std::time::Instant, Vec<(usize, bool)>);
