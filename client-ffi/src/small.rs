//! Small requests (exist, batch exist) and single gets driven on the
//! caller's own thread with blocking sockets (the exchanges are exchange.rs's,
//! run with `kv_common::driver::block_on`): the request to every owner is
//! written first, then every answer read, so the caller wakes straight from
//! its socket. Through the async core each answer costs an extra thread
//! wake-up (the runtime's worker sees the readiness and unparks the caller),
//! which on a loaded machine is most of an exist's latency and a good part
//! of a small get's. Batches of gets and puts stay on the async core, which
//! keeps every owner's connection busy at once.
//!
//! Routing, node health (cool-downs) and statuses are the core's.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_common::driver::block_on;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_common::wire::MAX_BATCH_KEYS;
use kv_common::wire::{self, KeyRequest, Op, FLAG_CHECK_GEOMETRY, FLAG_HANDOFF};

use crate::client::Client;
use crate::conn::{is_stale, Blocking, Conn};
use crate::error::OpError;
use crate::exchange::{self, GetReply};
use crate::node::{Node, SyncSlot};

/// Connects to `node` (a new blocking connection), starting in the
/// protocol version it last agreed on.
fn connect(node: &Node, timeout: Duration) -> Result<Conn, OpError> {
    let unreachable = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::TimedOut => OpError::Timeout,
        _ => OpError::Io(e),
    };
    let started = node.hello_version();
    let (conn, version) = Conn::<Blocking>::open(&node.addr, timeout, node.token.as_ref(), started, unreachable)?;
    node.agreed_version(started, version);
    node.opened.fetch_add(1, Ordering::Relaxed);
    Ok(conn)
}

/// One request in flight on one connection.
struct Pending {
    /// Holds one of the node's blocking-connection slots until dropped.
    slot: SyncSlot,
    node: Arc<Node>,
    conn: Conn,
    reused: bool,
    req_id: u64,
    op: Op,
    body: Vec<u8>,
    /// Item indices answered by this request.
    idx: Vec<usize>,
    /// Its answer is due by then (the I/O timeout from when it was sent, so
    /// a slow connect to another owner does not eat into this one's time).
    deadline: Instant,
    /// A handoff ask (FLAG_HANDOFF): the end of the window of the set that
    /// named this node. A failure then starts no cool-down (handoff.rs).
    handoff: Option<Instant>,
}

fn send(p: &mut Pending, io_timeout: Duration) -> Result<(), OpError> {
    p.deadline = Instant::now() + io_timeout;
    p.conn.bound(io_timeout)?;
    let flags = FLAG_CHECK_GEOMETRY | if p.handoff.is_some() { FLAG_HANDOFF } else { 0 };
    p.req_id = block_on(p.conn.request(p.op, flags, 0, &[&p.body]))?;
    Ok(())
}

fn recv(p: &mut Pending) -> Result<Vec<Status>, OpError> {
    let st = block_on(exchange::exist_answer(&mut p.conn, p.req_id, p.op, p.idx.len()))?;
    in_step(&p.conn)?;
    Ok(st)
}

/// One request was in flight on `conn` and its answer is read: bytes
/// beyond it are the node's fault, found now (the connection is then
/// closed, not pooled, and the node that sent them blamed) rather than by
/// the next request on it.
fn in_step(conn: &Conn) -> Result<(), OpError> {
    match conn.link.buffered() {
        0 => Ok(()),
        n => Err(OpError::Protocol(format!("{n} bytes after the answer"))),
    }
}

/// One get on `conn`, answered into `bufs` within `io`: Ok when the whole
/// answer was read, the connection then between frames and fit to pool again.
fn get_on(
    conn: &mut Conn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    io: Duration,
) -> Result<GetReply, OpError> {
    conn.bound(io)?;
    let r = block_on(exchange::get(conn, geo, key, bufs, 0, 0))?;
    in_step(conn)?;
    Ok(r)
}

impl Client {
    /// A connection for a held slot: the idle one taken with it (unless
    /// `fresh`), else a new one.
    fn sync_checkout(
        &self,
        slot: &mut SyncSlot,
        node: &Arc<Node>,
        fresh: bool,
        io: Duration,
    ) -> Result<(Conn, bool), OpError> {
        if fresh {
            slot.discard_idle();
        } else if let Some(c) = slot.take_idle() {
            return Ok((c, true));
        }
        node.make_room();
        Ok((connect(node, self.opts.connect_timeout.min(io))?, false))
    }

    /// The time one request may take: the I/O timeout, or the handoff
    /// timeout for a handoff ask.
    /// Within the call's bound (call.rs): zero once the call's time is up.
    fn io_of(&self, handoff: Option<Instant>) -> Duration {
        crate::call::clamp_io(if handoff.is_some() { self.opts.handoff_timeout } else { self.opts.io_timeout })
    }

    /// Sends `p`'s request, once more on a fresh connection when a pooled one
    /// turns out stale.
    fn send_retrying(&self, p: &mut Pending) -> Result<(), OpError> {
        let io = self.io_of(p.handoff);
        if io.is_zero() {
            return Err(OpError::LocalTimeout);
        }
        match send(p, io) {
            Err(e) if p.reused && is_stale(&e) => {
                self.metrics.stale_retries.fetch_add(1, Ordering::Relaxed);
                p.node.drop_idle();
                let (conn, _) = self.sync_checkout(&mut p.slot, &p.node, true, io)?;
                p.conn = conn;
                p.reused = false;
                send(p, io)
            }
            r => r,
        }
    }

    /// The status a chunk's keys get when its request failed: the node's
    /// failure (and its cool-down), or for a handoff ask a miss (and the
    /// node skipped for handoff asks in its window).
    fn chunk_failed(&self, node: &Node, handoff: Option<Instant>, e: OpError) -> Status {
        match handoff {
            None => self.failed_node(node, e),
            Some(until) => {
                self.metrics.handoff.failures.fetch_add(1, Ordering::Relaxed);
                if e.is_peer_failure() {
                    node.skip_handoff(until);
                }
                Status::Miss
            }
        }
    }

    /// Per-key exist statuses on the caller's thread (see the module docs).
    ///
    /// Work goes in waves: each wave writes at most `max_conns_per_node`
    /// chunks (of 4096 keys) to each owner, then reads every answer, which
    /// frees the wave's slots for the next. A batch with more chunks for
    /// one owner than it has slots thus never waits on slots it holds itself.
    pub fn batch_exist_blocking(&self, keys: &[&[u8]]) -> Vec<Status> {
        let topo = self.topology();
        let mut out = vec![Status::Unavailable; keys.len()];
        let groups = self.group(&topo, keys.iter().copied(), &mut out);
        self.exist_waves(groups.into_iter().map(|(node, idx)| (node, idx, None)).collect(), keys, &mut out);
        if !topo.previous.is_empty() {
            // Misses asked at previous owners (handoff.rs), a round per rank.
            let cands = self.handoff().candidates_of_misses(&topo, keys.iter().copied(), &out);
            let mut mismatch = vec![false; keys.len()];
            for round in 0..crate::handoff::MAX_HANDOFF_ASKS {
                let groups = crate::handoff::asks_of_round(&cands, round, |i| out[i] == Status::Miss);
                if groups.is_empty() {
                    break;
                }
                let asked: usize = groups.iter().map(|g| g.2.len()).sum();
                self.metrics.handoff.asks.fetch_add(asked as u64, Ordering::Relaxed);
                let mut there = vec![Status::Miss; keys.len()];
                self.exist_waves(
                    groups.into_iter().map(|(n, until, idx)| (n, idx, Some(until))).collect(),
                    keys,
                    &mut there,
                );
                for ((o, t), m) in out.iter_mut().zip(there).zip(mismatch.iter_mut()) {
                    if *o == Status::Miss && t == Status::Ok {
                        self.metrics.handoff.hits.fetch_add(1, Ordering::Relaxed);
                        *o = Status::Ok;
                    } else if t == Status::Mismatch {
                        *m = true;
                    }
                }
            }
            for (o, m) in out.iter_mut().zip(mismatch) {
                if m && *o == Status::Miss {
                    *o = Status::Mismatch;
                }
            }
        }
        for s in &out {
            self.metrics.count_exist(*s, 1);
        }
        out
    }

    /// Runs exist requests for `groups` (node, item indices, handoff window
    /// end for a handoff ask) in waves, statuses into `out`.
    fn exist_waves(&self, groups: Vec<(Arc<Node>, Vec<usize>, Option<Instant>)>, keys: &[&[u8]], out: &mut [Status]) {
        let mut work: Vec<(Arc<Node>, Vec<usize>, Option<Instant>)> = groups
            .into_iter()
            .flat_map(|(node, idx, h)| {
                idx.chunks(MAX_BATCH_KEYS).map(|c| (node.clone(), c.to_vec(), h)).collect::<Vec<_>>()
            })
            .collect();
        // Under a call's bound (call.rs), owners with an idle connection
        // first: a new connection waits for the node's hello before its
        // request is written, and a node that accepts but never answers
        // would hold the others' requests back for the whole time of the
        // call. (An unbounded call keeps the member order: no extra lock.)
        let bounded = crate::call::current().is_some();
        if bounded {
            work.sort_by_cached_key(|(node, _, _)| node.idle_conns() == 0);
        }
        let mut work: std::collections::VecDeque<_> = work.into();
        while !work.is_empty() {
            let mut later = std::collections::VecDeque::new();
            let mut in_wave: Vec<(*const Node, usize)> = Vec::new();
            // Write every owner's requests of this wave first...
            let mut pending: Vec<Pending> = Vec::new();
            while let Some((node, chunk, handoff)) = work.pop_front() {
                let key = Arc::as_ptr(&node);
                let n = match in_wave.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, n)) => n,
                    None => {
                        in_wave.push((key, 0));
                        &mut in_wave.last_mut().expect("just pushed").1
                    }
                };
                if *n >= self.opts.max_conns_per_node {
                    later.push_back((node, chunk, handoff));
                    continue;
                }
                // Waiting for a slot while holding others could wait on
                // another thread that holds the rest and waits for ours:
                // only the wave's first chunk may wait; the others take a
                // free slot or go to the next wave (which begins holding none).
                let may_wait = pending.is_empty();
                match self.start_chunk(&node, chunk, keys, out, handoff, may_wait) {
                    Ok(Some(p)) => {
                        *n += 1;
                        pending.push(p);
                    }
                    Ok(None) => *n += 1,
                    Err(chunk) => later.push_back((node, chunk, handoff)),
                }
            }
            // ...then read every answer (each frees its slot); under a
            // call's bound in the order they arrive (one more system call).
            if bounded && pending.len() > 1 {
                self.finish_in_arrival_order(pending, out);
            } else {
                for p in pending {
                    self.finish_chunk(p, out);
                }
            }
            work = later;
        }
    }

    /// Takes a slot and a connection for one chunk and writes its request;
    /// None when it failed (its keys' statuses then say why). Without
    /// `may_wait`, a chunk finding every slot busy is handed back (`Err`).
    fn start_chunk(
        &self,
        node: &Arc<Node>,
        chunk: Vec<usize>,
        keys: &[&[u8]],
        out: &mut [Status],
        handoff: Option<Instant>,
        may_wait: bool,
    ) -> Result<Option<Pending>, Vec<usize>> {
        let io = self.io_of(handoff);
        if io.is_zero() {
            // The call's time is up before this owner's turn: not its fault.
            let s = if handoff.is_some() { Status::Miss } else { Status::Timeout };
            chunk.iter().for_each(|&i| out[i] = s);
            return Ok(None);
        }
        let geo: Geometry = self.geo;
        let (op, body) = if chunk.len() == 1 {
            (Op::Exist, KeyRequest::encode(&geo, keys[chunk[0]]))
        } else {
            let ks: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            (Op::BatchExist, wire::encode_batch_exist(&geo, &ks))
        };
        let Some(mut slot) = node.sync_slot(if may_wait { io } else { Duration::ZERO }) else {
            if !may_wait {
                return Err(chunk);
            }
            crate::error::note(format!(
                "node {}: all {} connections busy for the whole I/O timeout",
                node.id, self.opts.max_conns_per_node
            ));
            // Every slot busy for the whole I/O timeout: local, not the node's fault.
            let s = if handoff.is_some() { Status::Miss } else { Status::Timeout };
            chunk.iter().for_each(|&i| out[i] = s);
            return Ok(None);
        };
        let (conn, reused) = match self.sync_checkout(&mut slot, node, false, io) {
            Ok(c) => c,
            Err(e) => {
                let s = self.chunk_failed(node, handoff, e);
                chunk.iter().for_each(|&i| out[i] = s);
                return Ok(None);
            }
        };
        let mut p = Pending {
            slot,
            node: node.clone(),
            conn,
            reused,
            req_id: 0,
            op,
            body,
            idx: chunk,
            deadline: Instant::now(),
            handoff,
        };
        match self.send_retrying(&mut p) {
            Ok(()) => Ok(Some(p)),
            Err(e) => {
                let s = self.chunk_failed(node, handoff, e);
                p.idx.iter().for_each(|&i| out[i] = s);
                Ok(None)
            }
        }
    }

    /// Reads a wave's answers in the order they arrive, so an owner that
    /// never answers, waited for until its deadline, cannot make the
    /// others' answers (in their sockets by then) late too.
    fn finish_in_arrival_order(&self, mut pending: Vec<Pending>, out: &mut [Status]) {
        while !pending.is_empty() {
            let mut fds: Vec<libc::pollfd> = pending
                .iter()
                .map(|p| libc::pollfd { fd: p.conn.raw_fd(), events: libc::POLLIN, revents: 0 })
                .collect();
            let until = pending.iter().map(|p| p.deadline).max().unwrap_or_else(Instant::now);
            let wait = until.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: `fds` is a live array of `fds.len()` pollfd entries,
            // which poll reads and whose `revents` it writes, nothing else.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n <= 0 {
                // Every deadline passed (or poll failed): each ends now by its own.
                for p in pending {
                    self.finish_chunk(p, out);
                }
                return;
            }
            let mut rest = Vec::with_capacity(pending.len());
            for (p, fd) in pending.into_iter().zip(&fds) {
                if fd.revents != 0 {
                    self.finish_chunk(p, out);
                } else {
                    rest.push(p);
                }
            }
            pending = rest;
        }
    }

    /// Reads one chunk's answer into `out`; the connection goes back to the
    /// pool and the slot is freed.
    fn finish_chunk(&self, mut p: Pending, out: &mut [Status]) {
        let mut r = recv(&mut p);
        if let Err(e) = &r {
            if p.reused && is_stale(e) {
                // The pooled connection was stale: once more on a new one.
                self.metrics.stale_retries.fetch_add(1, Ordering::Relaxed);
                p.node.drop_idle();
                let io = self.io_of(p.handoff);
                r = if io.is_zero() {
                    Err(OpError::LocalTimeout)
                } else {
                    self.sync_checkout(&mut p.slot, &p.node, true, io).and_then(|(conn, _)| {
                        p.conn = conn;
                        p.reused = false;
                        send(&mut p, io)?;
                        recv(&mut p)
                    })
                };
            }
        }
        match r {
            Ok(st) => {
                p.node.mark_ok();
                for (i, s) in p.idx.iter().zip(st) {
                    out[*i] = s;
                }
                p.slot.keep(p.conn);
            }
            Err(e) => {
                let s = self.chunk_failed(&p.node, p.handoff, e);
                p.idx.iter().for_each(|&i| out[i] = s);
            }
        }
    }

    /// One get on the caller's thread (see the module docs): Ok(length) on
    /// a hit, else the status (and for KV_TOO_SMALL the size needed). None
    /// when the async core must take it: the handle has RDMA, a handoff
    /// set is open (a miss then asks the previous owners), or the key is
    /// hot (its reads are spread, client.rs `read_route`).
    pub fn getv_blocking(&self, key: &[u8], bufs: &mut [&mut [u8]]) -> Option<Result<usize, (Status, usize)>> {
        if self.fabric.is_on() || self.hot.is_hot(key) {
            return None;
        }
        let topo = self.topology();
        if !topo.previous.is_empty() {
            return None;
        }
        let node = match self.route(&topo, key) {
            Ok(n) => n,
            Err(s) => return Some(Err(self.metrics.count_get(s, 0, 0))),
        };
        // One deadline for the whole get: the wait for a slot, a connect,
        // the exchange and its one retry (`io_timeout_ms` bounds a request).
        let deadline = crate::call::clamp(Instant::now() + self.opts.io_timeout);
        let left = || deadline.saturating_duration_since(Instant::now());
        let Some(mut slot) = node.sync_slot(left()) else {
            crate::error::note(format!(
                "node {}: all {} connections busy for the whole I/O timeout",
                node.id, self.opts.max_conns_per_node
            ));
            return Some(Err(self.metrics.count_get(Status::Timeout, 0, 0)));
        };
        let mut fresh = false;
        let reply = loop {
            let io = left();
            if io.is_zero() {
                return Some(Err(self.metrics.count_get(Status::Timeout, 0, 0)));
            }
            let (mut conn, reused) = match self.sync_checkout(&mut slot, &node, fresh, io) {
                Ok(c) => c,
                Err(e) => return Some(Err(self.metrics.count_get(self.failed_node(&node, e), 0, 0))),
            };
            let io = left();
            if io.is_zero() {
                // Unused: back to the pool.
                slot.keep(conn);
                return Some(Err(self.metrics.count_get(Status::Timeout, 0, 0)));
            }
            match get_on(&mut conn, &self.geo, key, bufs, io) {
                Ok(r) => {
                    node.mark_ok();
                    slot.keep(conn);
                    break r;
                }
                // A pooled connection the node has closed: once more on a
                // new one (a get may be asked twice).
                Err(e) if reused && !fresh && is_stale(&e) => {
                    self.metrics.stale_retries.fetch_add(1, Ordering::Relaxed);
                    node.drop_idle();
                    fresh = true;
                }
                Err(e) => return Some(Err(self.metrics.count_get(self.failed_node(&node, e), 0, 0))),
            }
        };
        if reply.status == Status::Ok {
            self.note_hot(key, reply.spread);
        }
        Some(match reply {
            GetReply { status: Status::Ok, len, .. } => {
                self.metrics.count_get(Status::Ok, len as u64, 0);
                Ok(len)
            }
            GetReply { status, len, .. } => Err(self.metrics.count_get(status, 0, len)),
        })
    }

    /// Whether a bounded call's exists should go through the async core:
    /// an owner of `keys` (not cooling down) has no idle blocking
    /// connection. Here connections are opened one after another, each
    /// waiting for its node's hello, so a node that accepts but never
    /// answers would make the owners after it time out too; the async
    /// core opens them all at once.
    pub fn exists_want_async(&self, keys: &[&[u8]]) -> bool {
        if crate::call::current().is_none() {
            return false;
        }
        let topo = self.topology();
        let mut seen = vec![false; topo.nodes.len()];
        for key in keys {
            if let Some(m) = topo.ring.owner(key) {
                if !std::mem::replace(&mut seen[m], true) {
                    let n = &topo.nodes[m];
                    if n.idle_conns() == 0 && !n.cooling() {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// One key's exist status on the caller's thread.
    pub fn exist_blocking(&self, key: &[u8]) -> Status {
        let st = self.batch_exist_blocking(&[key]);
        st[0]
    }
}
