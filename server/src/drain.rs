//! The drain push (docs/ARCHITECTURE.md, "Draining"): a node leaving its
//! group sends its pages to their owners in the group without it, as
//! handoff copies, most recently used first across the node, until the
//! drain ends. What clients have not read from the draining node by then is
//! not lost with it, hottest first.
//!
//! Every owner is served, however large the group: a fixed number of
//! worker threads take batches of pages, each batch from the owner whose
//! next page is the most recently used among owners not at their share of
//! the workers, over connections from a bounded pool ([`ConnPool`]). An
//! owner that cannot be reached or stops answering is left for the rest of
//! the drain (its pages counted as failed); one that refuses a page (deleted
//! there within its handoff window, full, draining too) is sent the next.

use std::cmp::Reverse;
#[cfg(test)]
use std::collections::BTreeSet;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kv_common::conn::{ConnPool, DataConn, MAX_SMALL_ANSWER};
use kv_common::mds::MemberRecord;
use kv_common::ring::{Placement, Ring, RingMember};
use kv_common::status::Status;
use kv_common::wire::{Op, FLAG_HANDOFF};

use crate::handoff::Handoff;
use crate::store::Store;

/// Worker threads of a drain push (connections in use at once).
pub const PUSH_THREADS: usize = 16;
/// Most connections one owner gets at once (when few owners have pages).
const PER_OWNER_MAX: usize = 4;
/// Pages a worker takes from one owner's queue at a time.
const BATCH: usize = 32;
/// Pages of an owner's queue within which one tenant's are pushed together.
const TENANT_RUN: usize = 8 * BATCH;
/// Puts a push keeps in flight on one connection, and their bytes.
const PUSH_WINDOW: usize = 8;
const PUSH_WINDOW_BYTES: u64 = 16 << 20;
/// Connect and I/O deadlines toward an owner: a hung owner costs a worker
/// this long, then it is left.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What became of one owner's pages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerTally {
    pub id: String,
    pub addr: String,
    /// Pages it owns among this node's.
    pub pages: u64,
    /// Stored there (new, or there already).
    pub pushed: u64,
    /// Refused by it (deleted within its window, full, draining).
    pub refused: u64,
    /// Not delivered because it could not be reached or stopped answering.
    pub failed: u64,
    /// Not tried: the drain ended first.
    pub left: u64,
    /// Gone from this node before their turn (deleted, evicted).
    pub gone: u64,
    /// A tenant's pages not sent: the owner runs an earlier release, which
    /// cannot keep tenants apart (docs/DEPLOY.md, "Tenants").
    pub older: u64,
    /// Why it was left, when it was.
    pub error: Option<String>,
}

/// The push as a whole.
#[derive(Debug, Clone, Default)]
pub struct DrainReport {
    pub owners: Vec<OwnerTally>,
    /// The view named this node (it was left out).
    pub named_self: bool,
    pub elapsed: Duration,
}

impl DrainReport {
    fn sum(&self, f: impl Fn(&OwnerTally) -> u64) -> u64 {
        self.owners.iter().map(f).sum()
    }
    pub fn pages(&self) -> u64 {
        self.sum(|o| o.pages)
    }
    pub fn pushed(&self) -> u64 {
        self.sum(|o| o.pushed)
    }
    pub fn refused(&self) -> u64 {
        self.sum(|o| o.refused)
    }
    pub fn failed(&self) -> u64 {
        self.sum(|o| o.failed)
    }
    pub fn left(&self) -> u64 {
        self.sum(|o| o.left)
    }
    pub fn gone(&self) -> u64 {
        self.sum(|o| o.gone)
    }
    pub fn older(&self) -> u64 {
        self.sum(|o| o.older)
    }
    /// Owners that had pages of this node's.
    pub fn owners_with_pages(&self) -> usize {
        self.owners.iter().filter(|o| o.pages > 0).count()
    }
}

/// One owner's queue: its keys with their rank in the node's recency order.
struct Queue {
    keys: Vec<(u32, Arc<[u8]>)>,
    next: usize,
    active: usize,
    dead: bool,
    /// The owner runs an earlier release (it answered a hello naming a
    /// tenant without binding it): no more tenants' batches are sent to it.
    older: bool,
}

struct Sched {
    queues: Vec<Queue>,
    /// Owners ready for a batch, by the rank of their next key (an owner
    /// may be in it more than once; stale entries are skipped).
    ready: BinaryHeap<Reverse<(u32, usize)>>,
    tally: Vec<OwnerTally>,
    /// Batches being pushed now, over all owners.
    active: usize,
    /// Owners with pages not yet taken, and the workers.
    with_work: usize,
    threads: usize,
}

impl Sched {
    /// Workers one owner may have at once: the workers shared among the
    /// owners that still have pages (more each as owners finish), at most
    /// [`PER_OWNER_MAX`].
    fn share(&self) -> usize {
        (self.threads / self.with_work.max(1)).clamp(1, PER_OWNER_MAX)
    }

    fn has_work(q: &Queue) -> bool {
        !q.dead && q.next < q.keys.len()
    }

    fn requeue(&mut self, o: usize) {
        let per = self.share();
        let q = &self.queues[o];
        if Sched::has_work(q) && q.active < per {
            self.ready.push(Reverse((q.keys[q.next].0, o)));
        }
    }

    /// Every owner that may take another worker back in the heap (after
    /// the share grew).
    fn requeue_all(&mut self) {
        for o in 0..self.queues.len() {
            if !self.ready.iter().any(|Reverse((_, x))| *x == o) {
                self.requeue(o);
            }
        }
    }

    /// An owner's pages are all taken, or it was left: the others' share grows.
    fn owner_done(&mut self) {
        let before = self.share();
        self.with_work = self.with_work.saturating_sub(1);
        if self.share() > before {
            self.requeue_all();
        }
    }
}

/// Leaves this node out of `members`, by id and by address (a view read
/// before its own leave settled still names it): the node never pushes to
/// itself. True when it was named.
pub fn without_self(members: &mut Vec<MemberRecord>, id: Option<&str>, addr: Option<&str>) -> bool {
    let before = members.len();
    members.retain(|m| Some(m.id.as_str()) != id && Some(m.addr.as_str()) != addr);
    members.len() != before
}

/// Pushes the node's pages to their owners in `members` (the group without
/// this node) until `deadline` or `h.push_stop`, with `threads` workers.
/// Counted in `h` as it goes; the report has each owner's figures.
pub fn push_pages(
    store: &Store,
    h: &Handoff,
    members: &[MemberRecord],
    placement: Placement,
    token: Option<&kv_common::auth::Token>,
    deadline: Instant,
    threads: usize,
) -> DrainReport {
    let t0 = Instant::now();
    let mut report = DrainReport::default();
    if members.is_empty() {
        return report;
    }
    let ring = Ring::with_placement(
        members.iter().map(|m| RingMember { id: m.id.clone(), weight: m.weight }).collect(),
        placement,
    );
    let mut queues: Vec<Queue> =
        members.iter().map(|_| Queue { keys: Vec::new(), next: 0, active: 0, dead: false, older: false }).collect();
    // Owners are the client's keys' (crate::tenant); a tenant's pages go
    // on connections acting for it, in batches of one tenant's pages.
    for (rank, k) in store.keys_by_recency().into_iter().enumerate() {
        if let Some(i) = ring.owner(crate::tenant::client_key(&k)) {
            queues[i].keys.push((rank.min(u32::MAX as usize) as u32, k));
        }
    }
    // Tenants' pages interleave in recency order: within each run of
    // TENANT_RUN pages of an owner's queue they are put together by tenant
    // (a stable sort: one tenant's order kept), so batches stay full while
    // the most recent pages still go first. One tenant: nothing moves.
    for q in &mut queues {
        let mut at: Vec<_> = std::mem::take(&mut q.keys).into_iter().enumerate().collect();
        at.sort_by_key(|(i, (_, k))| (i / TENANT_RUN, crate::tenant::split(k).0));
        q.keys = at.into_iter().map(|(_, e)| e).collect();
    }
    let tally: Vec<OwnerTally> = members
        .iter()
        .zip(&queues)
        .map(|(m, q)| OwnerTally {
            id: m.id.clone(),
            addr: m.addr.clone(),
            pages: q.keys.len() as u64,
            ..Default::default()
        })
        .collect();
    let with_pages = queues.iter().filter(|q| !q.keys.is_empty()).count();
    h.push_owners.store(with_pages as u64, Ordering::Relaxed);
    let threads = threads.clamp(1, with_pages.max(1) * PER_OWNER_MAX);
    let mut sched = Sched { queues, ready: BinaryHeap::new(), tally, active: 0, with_work: with_pages, threads };
    for o in 0..members.len() {
        sched.requeue(o);
    }
    let sched = (Mutex::new(sched), Condvar::new());
    let pool = ConnPool::new(threads, token.map(|t| t.as_bytes()), CONNECT_TIMEOUT, IO_TIMEOUT);
    let stop = || h.push_stop.load(Ordering::Relaxed) || Instant::now() >= deadline;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| worker(store, h, members, &sched, &pool, &stop));
        }
    });
    let mut sched = sched.0.into_inner().unwrap_or_else(|e| e.into_inner());
    // What no worker got to: left (the drain ended) or failed (its owner was left).
    for (q, t) in sched.queues.iter().zip(sched.tally.iter_mut()) {
        let rest = (q.keys.len() - q.next) as u64;
        if q.dead {
            t.failed += rest;
        } else {
            t.left += rest;
        }
    }
    report.owners = sched.tally;
    let failed = report.failed();
    h.push_failed_owner.fetch_add(failed, Ordering::Relaxed);
    h.push_left.store(report.left() + report.older(), Ordering::Relaxed);
    report.elapsed = t0.elapsed();
    report
}

/// Takes batches until none is left or the drain ends. A worker that finds
/// no owner ready while batches are being pushed waits for one to end (an
/// owner at its share comes back then, and its share grows as others
/// finish) rather than leave.
fn worker(
    store: &Store,
    h: &Handoff,
    members: &[MemberRecord],
    sched: &(Mutex<Sched>, Condvar),
    pool: &ConnPool,
    stop: &dyn Fn() -> bool,
) {
    let (lock, turn) = sched;
    loop {
        let (o, batch, older) = {
            let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
            let o = loop {
                if stop() {
                    return;
                }
                match s.ready.pop() {
                    Some(Reverse((_, o))) => {
                        let per = s.share();
                        let q = &s.queues[o];
                        // Stale entries (taken since, owner left) are skipped.
                        if Sched::has_work(q) && q.active < per {
                            break o;
                        }
                    }
                    None if s.active == 0 => return,
                    None => {
                        // Woken when a batch ends; the timeout notices the drain's end.
                        s = turn.wait_timeout(s, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
                    }
                }
            };
            let q = &mut s.queues[o];
            // One tenant's pages a batch (they go on a connection acting
            // for it), in the queue's order.
            let tenant = crate::tenant::split(&q.keys[q.next].1).0;
            let end = q.keys[q.next..]
                .iter()
                .take(BATCH)
                .position(|(_, k)| crate::tenant::split(k).0 != tenant)
                .map_or((q.next + BATCH).min(q.keys.len()), |n| q.next + n);
            let batch: Vec<Arc<[u8]>> = q.keys[q.next..end].iter().map(|(_, k)| k.clone()).collect();
            let older = q.older && tenant != crate::tenant::DEFAULT;
            q.next = end;
            q.active += 1;
            let taken = q.next == q.keys.len();
            s.active += 1;
            if taken {
                s.owner_done();
            }
            s.requeue(o);
            (o, batch, older)
        };
        let tenant = batch.first().map_or(crate::tenant::DEFAULT, |k| crate::tenant::split(k).0);
        // An owner that could not act for one tenant cannot for any: its
        // other tenants' batches are counted without a connection each.
        let out = if older {
            BatchOut { older: batch.len() as u64, ..Default::default() }
        } else {
            push_batch(store, h, pool, &members[o].addr, tenant, &batch, stop)
        };
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        if out.older > 0 {
            s.queues[o].older = true;
        }
        let ended = stop();
        let t = &mut s.tally[o];
        t.pushed += out.pushed;
        t.refused += out.refused;
        t.gone += out.gone;
        t.left += out.unsent;
        t.older += out.older;
        match out.error {
            // The drain ended meanwhile: what this batch did not deliver
            // is left, as the rest; the owner is not to blame.
            Some(_) if ended => t.left += out.unanswered,
            Some(e) => {
                // The pages of this batch not answered went nowhere.
                t.failed += out.unanswered;
                if t.error.is_none() {
                    tracing::warn!(owner = %members[o].id, addr = %members[o].addr, error = %e, "drain: this owner is left for the rest of the drain");
                    t.error = Some(e);
                }
                let q = &mut s.queues[o];
                let had_work = q.next < q.keys.len();
                q.dead = true;
                if had_work {
                    s.owner_done();
                }
            }
            None => {}
        }
        s.queues[o].active -= 1;
        s.active -= 1;
        s.requeue(o);
        turn.notify_all();
    }
}

#[derive(Default)]
struct BatchOut {
    pushed: u64,
    refused: u64,
    gone: u64,
    /// Not sent: the drain ended.
    unsent: u64,
    /// Not sent: a tenant's pages to an owner of an earlier release.
    older: u64,
    /// Sent or about to be, unanswered when the owner failed.
    unanswered: u64,
    error: Option<String>,
    error_kind: Option<std::io::ErrorKind>,
}

/// Sends `keys` to the owner at `addr` on one pooled connection, a window
/// of puts in flight. A reused connection the owner closed while it sat
/// idle (reset, end of stream, before any answer) is replaced by a new one
/// once; a new connection that cannot be made (refused, busy at the
/// owner's `--max-conns`) is tried [`CONNECT_TRIES`] times, one to an
/// owner that does not answer within the I/O timeout once.
fn push_batch(
    store: &Store,
    h: &Handoff,
    pool: &ConnPool,
    addr: &str,
    tenant: u32,
    keys: &[Arc<[u8]>],
    stop: &dyn Fn() -> bool,
) -> BatchOut {
    let failed = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::Unsupported {
            // An owner of an earlier release cannot keep a tenant's pages
            // apart: they are left (misses there), the owner is not.
            static LOGGED: std::sync::Once = std::sync::Once::new();
            LOGGED.call_once(|| tracing::warn!(error = %e, "drain: a tenant's pages are not pushed to this owner"));
            return BatchOut { older: keys.len() as u64, ..Default::default() };
        }
        BatchOut { unanswered: keys.len() as u64, error: Some(e.to_string()), ..Default::default() }
    };
    let mut conn = match connect(pool, addr, tenant, stop, false) {
        Ok(c) => c,
        Err(e) => return failed(e),
    };
    let mut out = push_on(store, h, &mut conn, keys, stop);
    let stale = out.error_kind.is_some_and(|k| {
        use std::io::ErrorKind::*;
        matches!(k, UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe)
    });
    if stale && conn.reused && out.pushed + out.refused == 0 && !stop() {
        conn = match connect(pool, addr, tenant, stop, true) {
            Ok(c) => c,
            Err(e) => return failed(e),
        };
        out = push_on(store, h, &mut conn, keys, stop);
    }
    if out.error.is_none() {
        pool.give(conn);
    }
    out
}

/// Connections tried to an owner before it is left.
const CONNECT_TRIES: u32 = 3;

/// A connection to `addr` (a new one with `fresh`), tried a few times with
/// a short pause between, never past the drain's end.
fn connect(
    pool: &ConnPool,
    addr: &str,
    tenant: u32,
    stop: &dyn Fn() -> bool,
    fresh: bool,
) -> std::io::Result<DataConn> {
    let mut last = None;
    for i in 0..CONNECT_TRIES {
        if i > 0 {
            if stop() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100 << i));
        }
        match if fresh || i > 0 { pool.fresh_for(addr, tenant) } else { pool.take_for(addr, tenant) } {
            Ok(c) => return Ok(c),
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => return Err(e),
            // A hung owner (no hello within the I/O timeout) is not asked again.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
                return Err(e)
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the drain ended")))
}

/// The puts of `keys` on `conn`. On an I/O error the pages in flight and
/// those not yet sent are `unanswered`.
fn push_on(store: &Store, h: &Handoff, conn: &mut DataConn, keys: &[Arc<[u8]>], stop: &dyn Fn() -> bool) -> BatchOut {
    let mut out = BatchOut::default();
    // req_id -> record bytes
    let mut inflight: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut held = 0u64;
    let answer = |conn: &mut DataConn, inflight: &mut std::collections::HashMap<u64, u64>, out: &mut BatchOut| {
        let a = conn.recv(MAX_SMALL_ANSWER)?;
        let Some(len) = inflight.remove(&a.req_id) else {
            return Err(std::io::Error::other("the owner answered a request not in flight"));
        };
        if a.status == Status::Ok {
            out.pushed += 1;
            h.pushed.fetch_add(1, Ordering::Relaxed);
            h.pushed_bytes.fetch_add(len, Ordering::Relaxed);
        } else {
            out.refused += 1;
            h.push_failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(addr = conn.addr(), status = ?a.status, why = %a.message(), "drain: a page was refused");
        }
        Ok(len)
    };
    let failed = |e: std::io::Error, inflight: usize, unsent: usize, mut out: BatchOut| {
        out.unanswered = (inflight + unsent) as u64;
        out.error_kind = Some(e.kind());
        out.error = Some(e.to_string());
        out
    };
    for (i, k) in keys.iter().enumerate() {
        if stop() {
            out.unsent += (keys.len() - i) as u64;
            break;
        }
        let read = Instant::now();
        let Some(rec) = store.read_for_push(k) else {
            out.gone += 1;
            continue;
        };
        let len = rec.len() as u64;
        if len > conn.max_record() {
            out.refused += 1;
            h.push_failed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let age = kv_common::wire::encode_copy_age(read.elapsed());
        match conn.send(Op::Put, FLAG_HANDOFF, age, &[rec.as_slice()]) {
            Ok(id) => {
                inflight.insert(id, len);
            }
            // This page counts among the unsent.
            Err(e) => return failed(e, inflight.len(), keys.len() - i, out),
        }
        drop(rec);
        held += len;
        while inflight.len() >= PUSH_WINDOW || held > PUSH_WINDOW_BYTES {
            match answer(conn, &mut inflight, &mut out) {
                Ok(n) => held -= n,
                Err(e) => return failed(e, inflight.len(), keys.len() - i - 1, out),
            }
        }
    }
    if !inflight.is_empty() && stop() {
        // The drain is over: the answers still owed get a second, not the
        // full I/O timeout each.
        let _ = conn.set_io_timeout(AFTER_STOP);
    }
    while !inflight.is_empty() {
        if let Err(e) = answer(conn, &mut inflight, &mut out) {
            return failed(e, inflight.len(), 0, out);
        }
    }
    out
}

/// How long the answers owed when the drain ends are waited for.
const AFTER_STOP: Duration = Duration::from_secs(1);

/// Logs the push: one line per owner that had pages, then the totals.
pub fn log_report(r: &DrainReport) {
    for o in r.owners.iter().filter(|o| o.pages > 0) {
        tracing::info!(owner = %o.id, addr = %o.addr, pages = o.pages, pushed = o.pushed, refused = o.refused,
            failed = o.failed, left = o.left, gone = o.gone, older = o.older, error = o.error.as_deref().unwrap_or(""),
            "drain: pushed to owner");
    }
    let mut line = format!(
        "drain push: {} of {} pages pushed to {} owners ({} refused, {} failed, {} left, {} gone) in {:.1} s",
        r.pushed(),
        r.pages(),
        r.owners_with_pages(),
        r.refused(),
        r.failed(),
        r.left(),
        r.gone(),
        r.elapsed.as_secs_f64()
    );
    if r.older() > 0 {
        line += &format!(
            "; {} pages of tenants not sent to owners of an earlier release (they cannot keep tenants apart)",
            r.older()
        );
    }
    if r.left() > 0 {
        tracing::warn!(
            pages_left = r.left(),
            "{line}: the drain ended before every page was pushed (raise --drain-secs)"
        );
    } else if r.older() > 0 {
        tracing::warn!(pages_older = r.older(), "{line}");
    } else {
        tracing::info!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{DiskSpec, StoreConfig};
    use kv_common::page::{build_record, Geometry};
    use kv_common::wire::{Hello, ReqHeader, RspHeader, FRAME_HEADER_LEN, HELLO_LEN};
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::Mutex as StdMutex;

    fn m(id: &str, addr: &str) -> MemberRecord {
        MemberRecord { id: id.into(), addr: addr.into(), weight: 1, metrics_addr: None }
    }

    /// A store of one 64 MiB disk under `t`, and a geometry for its pages.
    fn one_disk(t: &tempfile::TempDir) -> (Arc<Store>, Geometry) {
        let cfg = StoreConfig {
            disks: vec![DiskSpec { dir: t.path().join("d0"), cap: 64 << 20 }],
            mem_cap: 0,
            sync_writes: false,
            pool_bytes: 16 << 20,
            ack_memory_max: None,
            flushers: 0,
            warmers: 0,
        };
        let (store, _) = Store::open(&cfg).unwrap();
        (store, Geometry { model_hash: 1, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() })
    }

    #[test]
    fn a_view_naming_the_draining_node_is_pushed_without_it() {
        let mut v = vec![m("a", "h:1"), m("me", "h:2"), m("b", "h:3")];
        assert!(without_self(&mut v, Some("me"), Some("h:9")));
        assert_eq!(v.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        // Named by its address under another id (a record not yet expired).
        let mut v = vec![m("a", "h:1"), m("old-me", "h:2")];
        assert!(without_self(&mut v, Some("me"), Some("h:2")));
        assert_eq!(v.len(), 1);
        assert!(!without_self(&mut v, Some("me"), Some("h:2")));
    }

    /// How a stand-in owner answers.
    #[derive(Clone, Copy, PartialEq)]
    enum Owner {
        Takes,
        Refuses,
        /// Accepts the connection, never says hello.
        Hangs,
    }

    /// An owner on loopback: its address and the keys it was sent.
    fn owner(kind: Owner) -> (String, Arc<StdMutex<Vec<Vec<u8>>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let got = Arc::new(StdMutex::new(Vec::new()));
        let g = got.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut h = [0u8; HELLO_LEN];
                    if s.read_exact(&mut h).is_err() {
                        return;
                    }
                    if kind == Owner::Hangs {
                        // Holds the socket open, silent, until the pusher gives up.
                        let mut sink = [0u8; 1];
                        let _ = s.read(&mut sink);
                        return;
                    }
                    s.write_all(&Hello { version: 2, status: 0, max_record: 1 << 20 }.encode()).unwrap();
                    loop {
                        let mut rb = [0u8; FRAME_HEADER_LEN];
                        if s.read_exact(&mut rb).is_err() {
                            return;
                        }
                        let q = ReqHeader::decode(&rb, &Default::default()).unwrap();
                        let mut body = vec![0u8; q.body_len as usize];
                        s.read_exact(&mut body).unwrap();
                        assert_eq!(q.flags & FLAG_HANDOFF, FLAG_HANDOFF, "pushed as a handoff copy");
                        let (_, key) = kv_common::page::parse_record(&body).unwrap();
                        let st = if kind == Owner::Takes { Status::Ok } else { Status::Rejected };
                        g.lock().unwrap().push(key.to_vec());
                        let r = RspHeader { status: st, op: q.op as u8, flags: 0, body_len: 0, req_id: q.req_id };
                        s.write_all(&r.encode()).unwrap();
                    }
                });
            }
        });
        (addr, got)
    }

    #[test]
    fn every_owner_of_a_large_group_is_served_and_a_hung_or_refusing_one_costs_only_its_pages() {
        let t = tempfile::tempdir().unwrap();
        let (store, geo) = one_disk(&t);
        let keys: Vec<Vec<u8>> = (0..600).map(|i| format!("drain-unit-{i}").into_bytes()).collect();
        for k in &keys {
            store.put(store.pool().copy_of(&build_record(geo, k, &[7u8; 2048]))).unwrap();
        }
        // 40 owners (more than the workers): one hangs, one refuses.
        let mut owners = Vec::new();
        let mut members = Vec::new();
        for i in 0..40 {
            let kind = match i {
                3 => Owner::Hangs,
                5 => Owner::Refuses,
                _ => Owner::Takes,
            };
            let (addr, got) = owner(kind);
            members.push(m(&format!("o{i}"), &addr));
            owners.push((kind, got));
        }
        let ring = Ring::with_placement(
            members.iter().map(|m| RingMember { id: m.id.clone(), weight: 1 }).collect(),
            Placement::Ketama,
        );
        let h = Handoff::new(Duration::from_secs(600));
        let r = push_pages(&store, &h, &members, Placement::Ketama, None, Instant::now() + Duration::from_secs(60), 4);
        assert_eq!(r.pages(), keys.len() as u64);
        assert_eq!(r.left(), 0);
        for (i, (kind, got)) in owners.iter().enumerate() {
            let want: BTreeSet<Vec<u8>> = keys.iter().filter(|k| ring.owner(k) == Some(i)).cloned().collect();
            let t = &r.owners[i];
            assert_eq!(t.pages, want.len() as u64);
            let sent: BTreeSet<Vec<u8>> = got.lock().unwrap().iter().cloned().collect();
            match kind {
                Owner::Takes => {
                    assert_eq!(sent, want, "owner {i} got exactly its pages");
                    assert_eq!(t.pushed, want.len() as u64);
                }
                Owner::Refuses => assert_eq!(t.refused, want.len() as u64),
                Owner::Hangs => {
                    assert_eq!(t.failed, want.len() as u64);
                    assert!(t.error.is_some());
                }
            }
        }
        let taken: u64 = r.owners.iter().map(|t| t.pushed).sum();
        assert_eq!(h.pushed.load(Ordering::Relaxed), taken);
        assert_eq!(h.push_failed.load(Ordering::Relaxed), r.refused());
        assert_eq!(h.push_failed_owner.load(Ordering::Relaxed), r.failed());
        assert_eq!(h.push_owners.load(Ordering::Relaxed), r.owners_with_pages() as u64);
    }

    #[test]
    fn a_drain_that_ends_first_says_how_many_pages_it_left() {
        let t = tempfile::tempdir().unwrap();
        let (store, geo) = one_disk(&t);
        for i in 0..50 {
            store.put(store.pool().copy_of(&build_record(geo, format!("k{i}").as_bytes(), b"x"))).unwrap();
        }
        let (addr, got) = owner(Owner::Takes);
        let h = Handoff::new(Duration::from_secs(600));
        h.push_stop.store(true, Ordering::SeqCst);
        let r = push_pages(
            &store,
            &h,
            &[m("o", &addr)],
            Placement::Ketama,
            None,
            Instant::now() + Duration::from_secs(5),
            4,
        );
        assert_eq!((r.pushed(), r.left()), (0, 50));
        assert_eq!(h.push_left.load(Ordering::Relaxed), 50);
        assert!(got.lock().unwrap().is_empty());
    }
}
