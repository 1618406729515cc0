//! Small requests (exist, batch exist) and single gets driven on the
//! caller's own thread with blocking sockets: the request to every owner is
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

use kv_common::page::{Geometry, HEADER_LEN, MAX_KEY_LEN};
use kv_common::status::Status;
use kv_common::wire::MAX_BATCH_KEYS;
use kv_common::wire::{self, KeyRequest, Op, FLAG_CHECK_GEOMETRY, FLAG_HANDOFF, FRAME_HEADER_LEN};

use crate::client::Client;
use crate::conn::{answer_to, is_stale, Blocking, Conn};
use crate::error::OpError;
use crate::exchange::{check_get_head, GetReply, PayloadSink, MAX_SMALL_ANSWER};
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
    io_timeout: Duration,
    /// A handoff ask (FLAG_HANDOFF): the end of the window of the set that
    /// named this node. A failure then starts no cool-down (handoff.rs).
    handoff: Option<Instant>,
}

fn send(p: &mut Pending, io_timeout: Duration) -> Result<(), OpError> {
    p.deadline = Instant::now() + io_timeout;
    p.io_timeout = io_timeout;
    let flags = FLAG_CHECK_GEOMETRY | if p.handoff.is_some() { FLAG_HANDOFF } else { 0 };
    p.req_id = p.conn.write_frame(p.op, flags, &p.body, io_timeout)?;
    Ok(())
}

fn recv(p: &mut Pending) -> Result<Vec<Status>, OpError> {
    // A read may end up to 1/16 of the I/O timeout past the deadline rather
    // than pay a setsockopt per answer.
    let (slack, cap) = (p.io_timeout / 16, p.io_timeout);
    // One request is in flight on this connection, so whatever arrives is
    // this answer: read header and (usually) body with one call.
    let mut first = [0u8; 1024];
    let got = p.conn.read_at_least(&mut first, FRAME_HEADER_LEN, p.deadline, slack, cap)?;
    let h = answer_to(&first, p.req_id)?;
    let body_len = h.body_len as usize;
    if body_len > 1 << 20 || got > FRAME_HEADER_LEN + body_len {
        return Err(OpError::Protocol(format!("unexpected {}-byte answer", got.max(body_len))));
    }
    let mut body = vec![0u8; body_len];
    body[..got - FRAME_HEADER_LEN].copy_from_slice(&first[FRAME_HEADER_LEN..got]);
    let deadline = p.deadline;
    p.conn.read_full(&mut body[got - FRAME_HEADER_LEN..], deadline, slack, cap)?;
    match (p.op, h.status) {
        (Op::Exist, s @ (Status::Ok | Status::Miss | Status::Mismatch)) => Ok(vec![s]),
        (Op::BatchExist, Status::Ok) => {
            let st = wire::decode_batch_status(&body).map_err(|e| OpError::Protocol(e.to_string()))?;
            if st.len() != p.idx.len() {
                return Err(OpError::Protocol("batch answer has the wrong count".into()));
            }
            Ok(st)
        }
        (_, s) => Err(OpError::Node(s, String::from_utf8_lossy(&body).into_owned())),
    }
}

/// One get on `conn`, answered into `bufs` (one request in flight, so
/// whatever arrives is its answer): Ok when the whole answer was read, the
/// connection then between frames and fit to pool again.
fn get_on(
    conn: &mut Conn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    io: Duration,
) -> Result<GetReply, OpError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        // As the node answers such a GET (and before a buffer sized for
        // the longest key is sliced by it).
        let why = format!("key length {} outside 1..={MAX_KEY_LEN}", key.len());
        return Ok(GetReply { status: OpError::refused(Status::BadRequest, why.as_bytes()).status(), len: 0 });
    }
    let deadline = Instant::now() + io;
    let (slack, cap) = (io / 16, io);
    let req_id = conn.write_frame(Op::Get, FLAG_CHECK_GEOMETRY, &KeyRequest::encode(geo, key), io)?;
    // The frame header, and with it (an answer is written at once) the
    // page header and the key, in one read.
    let head = HEADER_LEN + key.len();
    let mut first = [0u8; FRAME_HEADER_LEN + HEADER_LEN + MAX_KEY_LEN];
    let first = &mut first[..FRAME_HEADER_LEN + head];
    let got = conn.read_at_least(first, FRAME_HEADER_LEN, deadline, slack, cap)?;
    let h = answer_to(first, req_id)?;
    let (body_len, have) = (h.body_len as usize, got - FRAME_HEADER_LEN);
    if have > body_len {
        return Err(OpError::Protocol(format!("{have} bytes after a {body_len}-byte answer")));
    }
    let reply = |status, len| Ok(GetReply { status, len });
    if h.status != Status::Ok {
        if h.body_len > MAX_SMALL_ANSWER {
            return Err(OpError::Protocol(format!("unexpected {body_len}-byte answer")));
        }
        let mut body = vec![0u8; body_len];
        body[..have].copy_from_slice(&first[FRAME_HEADER_LEN..got]);
        conn.read_full(&mut body[have..], deadline, slack, cap)?;
        return match h.status {
            Status::Miss | Status::Mismatch => reply(h.status, 0),
            // Read whole: this get alone is not served (a node's internal
            // failure reads as unavailable, never negative).
            s => reply(OpError::refused(s, &body).status(), 0),
        };
    }
    if body_len < head {
        conn.skip(body_len - have, deadline, slack, cap)?;
        return reply(Status::Corrupt, 0);
    }
    conn.read_full(&mut first[got..], deadline, slack, cap)?;
    let room: usize = bufs.iter().map(|b| b.len()).sum();
    let ph = match check_get_head(geo, key, body_len as u64, &first[FRAME_HEADER_LEN..], room) {
        Ok(ph) => ph,
        Err(r) => {
            conn.skip(body_len - head, deadline, slack, cap)?;
            return Ok(r);
        }
    };
    // The payload straight into the caller's buffers, a segment per read.
    let need = ph.payload_len as usize;
    let mut sink = PayloadSink::new(bufs, need);
    while let Some(dst) = sink.next() {
        let n = dst.len();
        conn.read_full(dst, deadline, slack, cap)?;
        sink.filled(n);
    }
    if !sink.verify(ph.payload_crc) {
        return reply(Status::Corrupt, 0);
    }
    reply(Status::Ok, need)
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
            let cands = self.candidates_of_misses(&topo, keys.iter().copied(), &out);
            let mut mismatch = vec![false; keys.len()];
            for round in 0..crate::client::MAX_HANDOFF_ASKS {
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
            work.sort_by_cached_key(|(node, _, _)| node.sync_idle() == 0);
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
            io_timeout: io,
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
    /// when the async core must take it: the handle has RDMA, or a handoff
    /// set is open (a miss then asks the previous owners).
    pub fn getv_blocking(&self, key: &[u8], bufs: &mut [&mut [u8]]) -> Option<Result<usize, (Status, usize)>> {
        if self.fabric.is_on() {
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
        Some(match reply {
            GetReply { status: Status::Ok, len } => {
                self.metrics.count_get(Status::Ok, len as u64, 0);
                Ok(len)
            }
            GetReply { status, len } => Err(self.metrics.count_get(status, 0, len)),
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
                    if n.sync_idle() == 0 && !n.cooling() {
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
