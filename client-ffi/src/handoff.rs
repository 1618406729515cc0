//! Ring handoff (docs/ARCHITECTURE.md, "Ring transitions"): a key that
//! misses at its owner is asked at its owners in the previous member sets
//! the client holds (at most [`MAX_HANDOFF_ASKS`] distinct nodes, newest set
//! first), each ask within `handoff_timeout_ms` and without a cool-down for
//! the node asked. A get served there is copied to the current owner in the
//! background, within the handle's byte budget; a delete inside a window
//! also goes to every previous owner.
//!
//! Every hit found this way is checked as any hit is (header, key,
//! geometry, CRC): the handoff changes where a page is looked for, never
//! what may be served.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use kv_common::page::PageHeader;
use kv_common::status::Status;
use kv_common::wire::{encode_copy_age, FLAG_FILL, FLAG_HANDOFF, MAX_BATCH_KEYS, MAX_SPREAD};

use crate::conn::is_stale;
use crate::error::OpError;
use crate::exchange::{self, GetReply};
use crate::node::Node;
use crate::pipeline::{BatchExistX, Exchange, GetItem, GetManyX, GetX, Pipeline, PIPELINE_WINDOW};
use crate::topology::Topology;

/// Most previous owners asked for one key.
pub const MAX_HANDOFF_ASKS: usize = 2;

/// Background handoff copies one handle writes at once.
pub const HANDOFF_COPIES_AT_ONCE: usize = 4;

/// A previous owner to ask, and the end of the window of the set naming it.
pub(crate) type Candidate = (Arc<Node>, Instant);

/// A node that may hold a copy of a key being deleted, when a failed ask
/// there stops being skipped, and whether the delete must reach it.
pub(crate) type Holder = (Arc<Node>, Instant, bool);

/// A handle's handoff state, kept across requests.
pub(crate) struct Handoffs {
    /// Background copies writing at once (the rest wait, within the byte
    /// budget), so copies hold few of an owner's connections.
    copy_slots: Arc<tokio::sync::Semaphore>,
    /// The handoff window this client knows now, in ms (the latest view's
    /// `handoff_ms`, else the `handoff_ms` option, as the client's install
    /// resolves it): a background copy older than half of it is given up.
    window_ms: Arc<AtomicU64>,
    /// The copies in flight, by node address and key: a second copy of a
    /// page to the same node is not sent while the first is on its way
    /// (reads that keep missing there until it lands would each send one).
    in_flight: CopiesInFlight,
}

/// The copies in flight, by node address and key.
type CopiesInFlight = Arc<Mutex<HashSet<(String, Vec<u8>)>>>;

/// A copy's place among the copies in flight, given up when dropped.
struct InFlight {
    set: CopiesInFlight,
    entry: (String, Vec<u8>),
}

impl InFlight {
    /// The copy of `key` to `addr`, unless one is in flight already.
    fn claim(set: &CopiesInFlight, addr: &str, key: &[u8]) -> Option<InFlight> {
        let entry = (addr.to_string(), key.to_vec());
        let fresh = set.lock().unwrap_or_else(|e| e.into_inner()).insert(entry.clone());
        fresh.then(|| InFlight { set: set.clone(), entry })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.entry);
    }
}

impl Handoffs {
    pub(crate) fn new(window: Duration) -> Handoffs {
        let h = Handoffs {
            copy_slots: Arc::new(tokio::sync::Semaphore::new(HANDOFF_COPIES_AT_ONCE)),
            window_ms: Arc::new(AtomicU64::new(0)),
            in_flight: Arc::new(Mutex::new(HashSet::new())),
        };
        h.set_window(window);
        h
    }

    /// Whether the handoff is on (its window not zero).
    pub(crate) fn window_open(&self) -> bool {
        self.window_ms.load(Ordering::Relaxed) > 0
    }

    /// The window of the member set installed now.
    pub(crate) fn set_window(&self, window: Duration) {
        self.window_ms.store(u64::try_from(window.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// The handoff as a layer over a handle's request pipeline: what a miss
/// at the owner asks of the previous owners, and the copies it writes.
pub(crate) struct Handoff<'c> {
    pipe: Pipeline<'c>,
    state: &'c Handoffs,
}

impl<'c> Handoff<'c> {
    pub(crate) fn over(pipe: Pipeline<'c>, state: &'c Handoffs) -> Handoff<'c> {
        Handoff { pipe, state }
    }

    /// The previous owners to ask for `key`, which missed at `owner`:
    /// distinct nodes other than the owner, newest set first, leaving out
    /// nodes in their cool-down and nodes whose handoff ask failed in their
    /// window.
    pub(crate) fn candidates(&self, topo: &Topology, key: &[u8], owner: &Node) -> Vec<Candidate> {
        let now = Instant::now();
        let mut out: Vec<Candidate> = Vec::new();
        for p in &topo.previous {
            if out.len() == MAX_HANDOFF_ASKS {
                break;
            }
            if p.until <= now {
                continue;
            }
            let Some(i) = p.ring.owner(key) else { continue };
            let n = &p.nodes[i];
            let is_owner = n.id == owner.id && n.addr == owner.addr;
            if is_owner || out.iter().any(|(c, _)| Arc::ptr_eq(c, n)) || n.handoff_skipped() || n.cooling() {
                continue;
            }
            out.push((n.clone(), p.until));
        }
        out
    }

    /// The owner of `key` in the current set (None: no members).
    fn owner_node(&self, topo: &Topology, key: &[u8]) -> Option<Arc<Node>> {
        topo.ring.owner(key).map(|i| topo.nodes[i].clone())
    }

    /// Runs a handoff ask on `node` within `handoff_timeout_ms`. A failure
    /// starts no cool-down: the node is skipped for handoff asks until
    /// `until` and the caller keeps its miss.
    pub(crate) async fn ask<X: Exchange>(&self, node: &Arc<Node>, until: Instant, mut x: X) -> Option<X::Out> {
        self.ask_on(node, until, &mut x).await
    }

    /// As [`Handoff::ask`], with the exchange borrowed (its buffers
    /// are read after it).
    pub(crate) async fn ask_on<X: Exchange>(&self, node: &Arc<Node>, until: Instant, x: &mut X) -> Option<X::Out> {
        match self.pipe.run_short(node, self.pipe.opts.handoff_timeout, x).await {
            Ok(out) => Some(out),
            // All of the node's connections busy: a local wait, not the node's fault.
            Err(OpError::LocalTimeout) => None,
            Err(e) => {
                self.pipe.metrics.handoff.failures.fetch_add(1, Ordering::Relaxed);
                if e.is_peer_failure() {
                    node.skip_handoff(until);
                }
                None
            }
        }
    }

    /// A get that missed at `owner`, asked at the previous owners. Some:
    /// a hit (its page is in `bufs`, and a copy goes to `owner`), or
    /// another answer worth more than the miss (a mismatch, too small).
    pub(crate) async fn get(
        &self,
        topo: &Topology,
        owner: &Arc<Node>,
        key: &[u8],
        bufs: &mut [&mut [u8]],
    ) -> Option<GetReply> {
        let mut better = None;
        for (node, until) in self.candidates(topo, key, owner) {
            self.pipe.metrics.handoff.asks.fetch_add(1, Ordering::Relaxed);
            let mut x = GetX { key, bufs: &mut *bufs, extra: FLAG_HANDOFF, weight: 0 };
            // The page is read at most this long ago once the answer is in.
            let asked_at = Instant::now();
            match self.ask_on(&node, until, &mut x).await {
                Some(r @ GetReply { status: Status::Ok, len, .. }) => {
                    self.pipe.metrics.handoff.hits.fetch_add(1, Ordering::Relaxed);
                    self.copy_later(owner.clone(), key, bufs, len, asked_at, false);
                    return Some(r);
                }
                Some(r @ GetReply { status: Status::TooSmall, .. }) => return Some(r),
                Some(r @ GetReply { status: Status::Mismatch, .. }) => better = Some(r),
                _ => {}
            }
        }
        better
    }

    /// Exists that missed at their owners (`out[i] == Miss`), asked at the
    /// previous owners: a round per candidate rank, each a batch per node,
    /// nodes concurrently. A hit there is KV_OK; a page there with another
    /// geometry is KV_MISMATCH.
    pub(crate) async fn exist(&self, topo: &Topology, keys: &[&[u8]], out: &mut [Status]) {
        let cands = self.candidates_of_misses(topo, keys.iter().copied(), out);
        // A page of another geometry at one previous owner does not stop
        // the asks (another may hold this client's); it is the answer when
        // none does.
        let mut mismatch = vec![false; out.len()];
        for round in 0..MAX_HANDOFF_ASKS {
            let groups = asks_of_round(&cands, round, |i| out[i] == Status::Miss);
            if groups.is_empty() {
                break;
            }
            let jobs = groups.into_iter().flat_map(|(node, until, idx)| {
                idx.chunks(MAX_BATCH_KEYS).map(|c| (node.clone(), until, c.to_vec())).collect::<Vec<_>>()
            });
            let results = join_all(jobs.map(|(node, until, idx)| async move {
                self.pipe.metrics.handoff.asks.fetch_add(idx.len() as u64, Ordering::Relaxed);
                let mut x = BatchExistX { keys: idx.iter().map(|&i| keys[i]).collect(), extra: FLAG_HANDOFF };
                (idx, self.ask_on(&node, until, &mut x).await)
            }))
            .await;
            for (idx, r) in results {
                let Some(st) = r else { continue };
                for (i, s) in idx.into_iter().zip(st) {
                    if s == Status::Ok {
                        self.pipe.metrics.handoff.hits.fetch_add(1, Ordering::Relaxed);
                        out[i] = Status::Ok;
                    } else if s == Status::Mismatch {
                        mismatch[i] = true;
                    }
                }
            }
        }
        for (o, m) in out.iter_mut().zip(mismatch) {
            if m && *o == Status::Miss {
                *o = Status::Mismatch;
            }
        }
    }

    /// For each key whose status is a miss, its handoff candidates (an
    /// empty list for the others).
    pub(crate) fn candidates_of_misses<'k>(
        &self,
        topo: &Topology,
        keys: impl Iterator<Item = &'k [u8]>,
        out: &[Status],
    ) -> Vec<Vec<Candidate>> {
        keys.enumerate()
            .map(|(i, key)| {
                if out[i] != Status::Miss {
                    return Vec::new();
                }
                match self.owner_node(topo, key) {
                    Some(owner) => self.candidates(topo, key, &owner),
                    None => Vec::new(),
                }
            })
            .collect()
    }

    /// Batch-get items that missed at their owners, asked at the previous
    /// owners (pipelined per node); hits are copied to their owners. Counts
    /// the final outcome of every item that missed.
    pub(crate) async fn get_many(&self, topo: &Topology, items: &mut [GetItem<'_, '_>], out: &mut [(Status, usize)]) {
        let missed: Vec<Status> = out.iter().map(|r| r.0).collect();
        let cands = self.candidates_of_misses(topo, items.iter().map(|(k, _)| *k), &missed);
        let mut mismatch = vec![false; out.len()];
        for round in 0..MAX_HANDOFF_ASKS {
            let groups = asks_of_round(&cands, round, |i| out[i].0 == Status::Miss);
            if groups.is_empty() {
                break;
            }
            let mut slots: Vec<Option<&mut GetItem<'_, '_>>> = items.iter_mut().map(Some).collect();
            let mut lanes = Vec::new();
            for (node, until, idx) in groups {
                let lane: Vec<(usize, &mut GetItem<'_, '_>)> =
                    idx.into_iter().filter_map(|i| slots[i].take().map(|it| (i, it))).collect();
                lanes.push((node, until, lane));
            }
            let results = join_all(lanes.into_iter().map(|(node, until, mut lane)| async move {
                let mut got = Vec::with_capacity(lane.len());
                for window in lane.chunks_mut(PIPELINE_WINDOW) {
                    self.pipe.metrics.handoff.asks.fetch_add(window.len() as u64, Ordering::Relaxed);
                    let idx: Vec<usize> = window.iter().map(|(i, _)| *i).collect();
                    let mut x = GetManyX {
                        items: window.iter_mut().map(|(_, item)| (item.0, &mut item.1[..])).collect(),
                        extra: FLAG_HANDOFF,
                        weights: Vec::new(),
                    };
                    let asked_at = Instant::now();
                    let Some(replies) = self.ask_on(&node, until, &mut x).await else { break };
                    for ((i, r), (_, item)) in idx.into_iter().zip(replies).zip(window.iter()) {
                        if r.status == Status::Ok {
                            self.pipe.metrics.handoff.hits.fetch_add(1, Ordering::Relaxed);
                            if let Some(owner) = self.owner_node(topo, item.0) {
                                self.copy_later(owner, item.0, &item.1, r.len, asked_at, false);
                            }
                        }
                        got.push((i, r));
                    }
                }
                got
            }))
            .await;
            for (i, r) in results.into_iter().flatten() {
                match r.status {
                    Status::Ok | Status::TooSmall => out[i] = (r.status, r.len),
                    Status::Mismatch => mismatch[i] = true,
                    _ => {}
                }
            }
        }
        for (o, m) in out.iter_mut().zip(mismatch) {
            if m && o.0 == Status::Miss {
                *o = (Status::Mismatch, 0);
            }
        }
        for (r, m) in out.iter().zip(missed) {
            if m == Status::Miss {
                let bytes = if r.0 == Status::Ok { r.1 as u64 } else { 0 };
                self.pipe.metrics.count_get(r.0, bytes, r.1);
            }
        }
    }

    /// The nodes other than `owner` that may hold a copy of `key`: its
    /// owner in every previous set of the window and, when `spread` (hot
    /// keys' reads are spread, docs/ARCHITECTURE.md "Hot keys"), the first
    /// [`MAX_SPREAD`] distinct members from it in the current set and in
    /// every previous one. Each with when a failed ask stops being
    /// skipped, and whether the delete fails when that node cannot be
    /// reached: a previous owner must be reached (a handoff ask would find
    /// its page); a node that holds at most a hot key's copy need not (a
    /// dead node must not fail every delete; the copy it may keep is the
    /// key's own bytes, docs/ARCHITECTURE.md "Hot keys"). Previous owners
    /// skipped for asks are named too; a node that may hold only a copy is
    /// left out while it cools down or is skipped (it failed lately: a
    /// delete does not wait a timeout on it).
    pub(crate) fn holders(&self, topo: &Topology, key: &[u8], owner: &Node, spread: bool) -> Vec<Holder> {
        let now = Instant::now();
        let mut out: Vec<Holder> = Vec::new();
        let mut add = |n: &Arc<Node>, until: Instant, must: bool| {
            if n.id == owner.id && n.addr == owner.addr {
                return;
            }
            match out.iter_mut().find(|h| Arc::ptr_eq(&h.0, n)) {
                Some(h) => h.2 |= must,
                None => out.push((n.clone(), until, must)),
            }
        };
        let r = if spread { usize::from(MAX_SPREAD) } else { 1 };
        if spread {
            let until = now + self.pipe.opts.peer_cooldown;
            for i in topo.ring.owners(key, r) {
                add(&topo.nodes[i], until, false);
            }
        }
        for p in topo.previous.iter().filter(|p| p.until > now) {
            for (rank, i) in p.ring.owners(key, r).into_iter().enumerate() {
                add(&p.nodes[i], p.until, rank == 0);
            }
        }
        out.retain(|(n, _, must)| *must || !(n.cooling() || n.handoff_skipped()));
        out
    }

    /// Writes a page found at a previous owner to its owner in the
    /// background, from a copy of `bufs` (the caller may reuse them at
    /// once), when the handle's copy budget allows; the owner refuses it if
    /// the key was deleted meanwhile. `read_at`: when the page was read
    /// (the ask was sent). The copy is given up once older than half the
    /// handoff window the client knows ([`copy_deadline`]): its wait for a
    /// copy slot ends there, and it carries its age to the owner, which
    /// refuses it past half its own window (docs/PROTOCOL.md §2.9).
    ///
    /// `fill`: a copy of a hot page to a node of its spread that missed it
    /// (docs/ARCHITECTURE.md, "Hot keys"), counted among the fills; the
    /// node takes it as any handoff copy.
    ///
    /// A copy of the same key to the same node already in flight makes
    /// this one redundant: it is not sent, and not counted.
    pub(crate) fn copy_later(
        &self,
        owner: Arc<Node>,
        key: &[u8],
        bufs: &[&mut [u8]],
        len: usize,
        read_at: Instant,
        fill: bool,
    ) {
        let h = self.pipe.metrics.handoff.clone();
        let hot = self.pipe.metrics.hot.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            h.copies_failed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(claim) = InFlight::claim(&self.state.in_flight, &owner.addr, key) else {
            return;
        };
        let budget = self.pipe.opts.handoff_budget;
        let n = len as u64;
        let taken = h
            .inflight_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| (cur + n <= budget).then_some(cur + n));
        if taken.is_err() {
            h.budget_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut data = Vec::with_capacity(len);
        for b in bufs {
            let take = b.len().min(len - data.len());
            data.extend_from_slice(&b[..take]);
            if data.len() == len {
                break;
            }
        }
        let header = PageHeader::new(*self.pipe.geo, key, n, crc32fast::hash(&data)).encode();
        let key = key.to_vec();
        let (connect, io) = (self.pipe.opts.connect_timeout, self.pipe.opts.io_timeout);
        let gate = self.state.copy_slots.clone();
        let window = self.state.window_ms.clone();
        rt.spawn(async move {
            let _claim = claim;
            // A few copies at once per handle: they wait here, not in the
            // owner's connection queue ahead of the caller's own requests;
            // no longer than the copy stays young enough to be sent.
            let turn = tokio::time::timeout_at(copy_deadline(read_at, &window).into(), gate.acquire_owned()).await.ok();
            // The window may have changed while it waited: judged by the
            // one known now.
            if turn.is_none() || Instant::now() >= copy_deadline(read_at, &window) {
                h.copies_expired.fetch_add(1, Ordering::Relaxed);
                h.inflight_bytes.fetch_sub(n, Ordering::AcqRel);
                return;
            }
            let put = async {
                let mut fresh = false;
                loop {
                    let slot = owner.slot().await?;
                    let mut co = owner.checkout(slot, connect, fresh).await?;
                    let reused = co.reused;
                    let age = encode_copy_age(read_at.elapsed());
                    let flags = if fill { FLAG_HANDOFF | FLAG_FILL } else { FLAG_HANDOFF };
                    match exchange::put(co.conn(), &header, &key, &[&data], flags, age).await {
                        Ok(_) => {
                            co.release();
                            return Ok(());
                        }
                        Err(e) if reused && !fresh && is_stale(&e) => {
                            owner.drop_idle();
                            fresh = true;
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            let (stored, refused, failed) = match fill {
                true => (&hot.fills_stored, &hot.fills_refused, &hot.fills_failed),
                false => (&h.copies_stored, &h.copies_refused, &h.copies_failed),
            };
            match tokio::time::timeout(io, put).await {
                Ok(Ok(())) => {
                    stored.fetch_add(1, Ordering::Relaxed);
                    h.copy_bytes.fetch_add(n, Ordering::Relaxed);
                }
                Ok(Err(OpError::Node(Status::Rejected, _))) => {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            h.inflight_bytes.fetch_sub(n, Ordering::AcqRel);
        });
    }
}

/// When a background copy of a page read at `read_at` is given up unsent:
/// half the handoff window known now (`window`, in ms) after the read. A
/// node refuses a copy older than half its own window; the other half is
/// the margin for what the age does not count (the copy's way there, a
/// window that differs between client and node), so a copy never lands
/// after the tombstone of a delete that followed its read expired
/// (docs/ARCHITECTURE.md, "Ring transitions").
pub(crate) fn copy_deadline(read_at: Instant, window: &AtomicU64) -> Instant {
    let half = Duration::from_millis(window.load(Ordering::Relaxed) / 2);
    read_at.checked_add(half).unwrap_or(read_at + Duration::from_secs(86_400 * 365))
}

/// The asks of one round: items that `still` need one and have a candidate
/// of that rank, grouped by node.
pub(crate) fn asks_of_round(
    cands: &[Vec<Candidate>],
    round: usize,
    still: impl Fn(usize) -> bool,
) -> Vec<(Arc<Node>, Instant, Vec<usize>)> {
    let mut groups: Vec<(Arc<Node>, Instant, Vec<usize>)> = Vec::new();
    for (i, c) in cands.iter().enumerate() {
        let Some((node, until)) = c.get(round) else { continue };
        if !still(i) {
            continue;
        }
        match groups.iter_mut().find(|g| Arc::ptr_eq(&g.0, node)) {
            Some(g) => g.2.push(i),
            None => groups.push((node.clone(), *until, vec![i])),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;
    use crate::Client;
    use kv_common::page::Geometry;

    #[test]
    fn a_copy_expires_half_the_window_it_knows_after_its_read() {
        let read = Instant::now();
        let window = AtomicU64::new(600_000);
        assert_eq!(copy_deadline(read, &window), read + Duration::from_secs(300));
        // A view with another window: judged by the one known now.
        window.store(1_000, Ordering::Relaxed);
        assert_eq!(copy_deadline(read, &window), read + Duration::from_millis(500));
        window.store(0, Ordering::Relaxed);
        assert_eq!(copy_deadline(read, &window), read, "no window: nothing to copy");
        window.store(u64::MAX, Ordering::Relaxed);
        assert!(copy_deadline(read, &window) > read + Duration::from_secs(86_400), "no overflow");
    }

    /// Polls `f` until it holds, for up to 10 s.
    fn eventually(what: &str, f: impl Fn() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A queued copy is given up unsent once older than half the window:
    /// one already too old when queued, and one whose turn never comes
    /// (every copy slot held) before its deadline. Neither touches the
    /// owner (an address nothing listens on: a send would count a failure).
    #[test]
    fn an_expired_queued_copy_is_dropped_and_counted() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let _in = rt.enter();
        let opts = Options { handoff: Duration::from_millis(400), ..Options::default() };
        let c = Client::new(Vec::new(), Geometry::default(), opts);
        let owner = Arc::new(Node::new("n1".into(), "127.0.0.1:9".into(), 1, 4, None, c.fabric.offer()));
        let h = c.metrics.handoff.clone();
        let mut page = vec![5u8; 4096];
        // Read a second ago: past half of 400 ms already.
        c.handoff().copy_later(
            owner.clone(),
            b"k1",
            &[&mut page[..]],
            4096,
            Instant::now() - Duration::from_secs(1),
            false,
        );
        eventually("the stale copy to be dropped", || h.copies_expired.load(Ordering::Relaxed) == 1);
        // Fresh, but every copy slot is taken and stays taken.
        let held = rt.block_on(c.handoff().state.copy_slots.clone().acquire_many_owned(HANDOFF_COPIES_AT_ONCE as u32));
        let queued = Instant::now();
        c.handoff().copy_later(owner, b"k2", &[&mut page[..]], 4096, queued, false);
        eventually("the waiting copy to expire", || h.copies_expired.load(Ordering::Relaxed) == 2);
        assert!(queued.elapsed() >= Duration::from_millis(200), "it waited until its deadline");
        drop(held);
        eventually("the budget back", || h.inflight_bytes.load(Ordering::Relaxed) == 0);
        let sent = h.copies_stored.load(Ordering::Relaxed)
            + h.copies_failed.load(Ordering::Relaxed)
            + h.copies_refused.load(Ordering::Relaxed);
        assert_eq!(sent, 0, "nothing was sent");
        let snap = c.metrics.render(0, None, Vec::new(), c.fabric.counters());
        assert!(snap.contains("kvclient_handoff_copies_expired_total 2"), "{snap}");
    }

    /// A second copy of a key to the node a first one is on its way to is
    /// not sent (reads that miss there until the first lands would each
    /// send one); once the first has ended, a copy may go again.
    #[test]
    fn a_copy_already_in_flight_to_the_node_is_not_sent_twice() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let _in = rt.enter();
        let opts = Options { handoff: Duration::from_millis(400), ..Options::default() };
        let c = Client::new(Vec::new(), Geometry::default(), opts);
        let n1 = Arc::new(Node::new("n1".into(), "127.0.0.1:9".into(), 1, 4, None, c.fabric.offer()));
        let n2 = Arc::new(Node::new("n2".into(), "127.0.0.1:10".into(), 1, 4, None, c.fabric.offer()));
        let h = c.metrics.handoff.clone();
        let mut page = vec![5u8; 4096];
        // Every copy slot held: the copies wait until their deadline.
        let held = rt.block_on(c.handoff().state.copy_slots.clone().acquire_many_owned(HANDOFF_COPIES_AT_ONCE as u32));
        for _ in 0..3 {
            c.handoff().copy_later(n1.clone(), b"k", &[&mut page[..]], 4096, Instant::now(), true);
        }
        c.handoff().copy_later(n1.clone(), b"other", &[&mut page[..]], 4096, Instant::now(), true);
        c.handoff().copy_later(n2, b"k", &[&mut page[..]], 4096, Instant::now(), true);
        assert_eq!(h.inflight_bytes.load(Ordering::Relaxed), 3 * 4096, "one copy a key and node");
        eventually("the waiting copies to expire", || h.copies_expired.load(Ordering::Relaxed) == 3);
        eventually("the budget back", || h.inflight_bytes.load(Ordering::Relaxed) == 0);
        c.handoff().copy_later(n1, b"k", &[&mut page[..]], 4096, Instant::now(), true);
        assert_eq!(h.inflight_bytes.load(Ordering::Relaxed), 4096, "the key may be copied there again");
        eventually("it to expire too", || h.copies_expired.load(Ordering::Relaxed) == 4);
        drop(held);
    }
}
