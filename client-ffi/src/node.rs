//! One cache node as the client sees it: an address, its connections (at
//! most `max_conns_per_node` open at once, for the async core and the
//! caller-thread path together: one slot count and one idle list, whose
//! connections either path takes), and health (a
//! cool-down after an I/O failure, during which its keys answer
//! KV_UNAVAILABLE at once without touching the network).

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_common::auth::Token;
use kv_common::wire::{Op, WIRE_VERSION};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::conn::{Async, Conn};
use crate::error::OpError;
use crate::rdma::{Answered, Offer, Setup};
use crate::remote::RemoteMemory;

/// A connection of the async core.
pub type AsyncConn = Conn<Async>;

pub struct Node {
    pub id: String,
    /// `host:port` as the member list gave it, resolved on every connect.
    pub addr: String,
    pub weight: u32,
    /// Idle connections of both paths, oldest first.
    idle: Mutex<Vec<Idle>>,
    max_conns: usize,
    /// The node's connection slots, taken by async and blocking requests
    /// alike: at most `max_conns` requests hold a connection at once.
    slots: Arc<Semaphore>,
    /// Nanoseconds since `epoch` until which the node is avoided (0: healthy).
    cool_until: AtomicU64,
    /// Nanoseconds since `epoch` until which handoff asks skip this node
    /// (one failed; 0: ask it).
    handoff_skip_until: AtomicU64,
    epoch: Instant,
    pub failures: AtomicU64,
    /// Times the node went into its cool-down, and answered again after one.
    pub went_down: AtomicU64,
    pub came_back: AtomicU64,
    /// Connections opened to the node (hello agreed), by either path.
    pub opened: AtomicU64,
    /// Idle connections one path took from the other (moved between the
    /// runtime's reactor and the caller's thread).
    pub moved: AtomicU64,
    /// The group's auth token, sent in every hello.
    pub token: Option<Token>,
    /// The protocol version the last hello with this node agreed on: the
    /// next connection starts with it (see hello.rs), and batches choose
    /// their frames by it.
    proto: AtomicU16,
    /// When a hello last had to step down from a newer version (ns since
    /// `epoch`): [`STEP_UP_AFTER`] later, new connections try the newest
    /// again (the node may have been upgraded).
    stepped_down: AtomicU64,
    /// Whether its connections ask for RDMA (until it says it offers none).
    pub offer: Offer,
}

/// An idle connection, of the kind its last request used. A request of the
/// other kind takes it when none of its own kind is idle: moving a socket
/// between the runtime's reactor and the caller's thread costs a few system
/// calls (`Conn::into_async`, `Conn::into_blocking`), far less than a new
/// connection and its hello, and the node's open connections stay within
/// one cap without closing either kind's.
enum Idle {
    Async(AsyncConn),
    Blocking(Conn),
}

/// A connection checked out of a node's pool. It goes back to the pool only
/// through [`Checkout::release`], after a request completed cleanly; dropped
/// any other way (an error, a timeout cancelling the request mid-frame) it is
/// closed, so a connection whose framing is in doubt is never reused.
pub struct Checkout {
    node: Arc<Node>,
    pub conn: Option<AsyncConn>,
    /// True when the connection came from the pool (it may be stale).
    pub reused: bool,
    _slot: OwnedSemaphorePermit,
}

impl Checkout {
    pub fn conn(&mut self) -> &mut AsyncConn {
        self.conn.as_mut().expect("connection present until discarded")
    }

    /// The request completed and the connection is between frames: pool it.
    pub fn release(mut self) {
        if let Some(c) = self.conn.take() {
            self.node.pool(Idle::Async(c));
        }
    }
}

/// A blocking-connection slot, with the pooled connection taken with it (if
/// any) and the one to pool when it is freed. Freed on drop: the connection
/// pooled under one lock, then the slot handed to the next waiter of either
/// path (the semaphore's queue, first come first served).
pub struct SyncSlot {
    node: Arc<Node>,
    idle: Option<Conn>,
    back: Option<Conn>,
    /// Released after the connection is pooled (in drop).
    permit: Option<OwnedSemaphorePermit>,
}

impl SyncSlot {
    /// The pooled connection taken with the slot (None: none was idle).
    pub fn take_idle(&mut self) -> Option<Conn> {
        self.idle.take()
    }

    /// Closes the pooled connection taken with the slot (a stale one's
    /// fellows are suspect).
    pub fn discard_idle(&mut self) {
        self.idle = None;
    }

    /// Pools `c` (between frames, after a clean exchange) when the slot is freed.
    pub fn keep(&mut self, c: Conn) {
        self.back = Some(c);
    }
}

impl Drop for SyncSlot {
    fn drop(&mut self) {
        for c in [self.back.take(), self.idle.take()].into_iter().flatten() {
            self.node.pool(Idle::Blocking(c));
        }
        // Released after the pool's lock (a release takes the semaphore's
        // own lock, and wakes the next waiter).
        drop(self.permit.take());
    }
}

/// How long after a hello had to step down to an older version new
/// connections keep starting in it before they try the newest again.
pub const STEP_UP_AFTER: Duration = Duration::from_secs(60);

impl Node {
    pub fn new(id: String, addr: String, weight: u32, max_conns: usize, token: Option<Token>, offer: Offer) -> Node {
        Node {
            id,
            addr,
            weight,
            idle: Mutex::new(Vec::new()),
            max_conns,
            slots: Arc::new(Semaphore::new(max_conns)),
            cool_until: AtomicU64::new(0),
            handoff_skip_until: AtomicU64::new(0),
            epoch: Instant::now(),
            failures: AtomicU64::new(0),
            went_down: AtomicU64::new(0),
            came_back: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            token,
            proto: AtomicU16::new(WIRE_VERSION),
            stepped_down: AtomicU64::new(0),
            offer,
        }
    }

    /// The version a new connection says hello in first: the one the node
    /// last agreed on, or this client's newest once [`STEP_UP_AFTER`] has
    /// passed since a hello had to step down (a node upgraded in a rolling
    /// upgrade is then spoken to in the newest version it speaks; one that
    /// was not costs one refused hello a period).
    pub fn hello_version(&self) -> u16 {
        self.hello_version_at(self.epoch.elapsed().as_nanos() as u64)
    }

    /// [`Node::hello_version`] at `now` (ns since `epoch`).
    fn hello_version_at(&self, now: u64) -> u16 {
        let v = self.proto.load(Ordering::Relaxed);
        let since = now.saturating_sub(self.stepped_down.load(Ordering::Relaxed));
        if v < WIRE_VERSION && since > STEP_UP_AFTER.as_nanos() as u64 {
            WIRE_VERSION
        } else {
            v
        }
    }

    /// The version the node's last hello agreed on (what batch frames
    /// follow).
    pub fn speaks(&self) -> u16 {
        self.proto.load(Ordering::Relaxed)
    }

    /// Remembers the version a hello that started at `started` agreed on.
    pub fn agreed_version(&self, started: u16, v: u16) {
        if v < started {
            self.stepped_down.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        self.proto.store(v, Ordering::Relaxed);
    }

    /// Whether the node is in its cool-down now.
    pub fn cooling(&self) -> bool {
        let until = self.cool_until.load(Ordering::Relaxed);
        until != 0 && (self.epoch.elapsed().as_nanos() as u64) < until
    }

    /// Whether handoff asks skip this node now (one failed in its window).
    pub fn handoff_skipped(&self) -> bool {
        let until = self.handoff_skip_until.load(Ordering::Relaxed);
        until != 0 && (self.epoch.elapsed().as_nanos() as u64) < until
    }

    /// A handoff ask failed: skip this node for handoff asks until `until`
    /// (the end of the window of the set that named it), or until it joins
    /// the current set again. Its own keys are not affected: no cool-down
    /// starts.
    pub fn skip_handoff(&self, until: Instant) {
        let at = until.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.handoff_skip_until.fetch_max(at.max(1), Ordering::Relaxed);
    }

    /// Starts (or extends) the cool-down after an I/O failure.
    pub fn mark_failed(&self, cooldown: Duration) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let until = (self.epoch.elapsed() + cooldown).as_nanos() as u64;
        if self.cool_until.swap(until.max(1), Ordering::Relaxed) == 0 {
            self.went_down.fetch_add(1, Ordering::Relaxed);
        }
        // Idle connections to a failing node are suspect too.
        self.drop_idle();
    }

    pub fn mark_ok(&self) {
        if self.cool_until.load(Ordering::Relaxed) != 0 && self.cool_until.swap(0, Ordering::Relaxed) != 0 {
            self.came_back.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends a handoff skip (the node joined the current set again: a
    /// restart that came back).
    pub fn clear_handoff_skip(&self) {
        if self.handoff_skip_until.load(Ordering::Relaxed) != 0 {
            self.handoff_skip_until.store(0, Ordering::Relaxed);
        }
    }

    /// Takes one of the node's blocking-connection slots, and an idle
    /// connection if there is one, waiting up to `wait` for a slot to free
    /// (None then: a local timeout).
    pub fn sync_slot(self: &Arc<Node>, wait: Duration) -> Option<SyncSlot> {
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::Closed) => return None,
            // Every slot taken: wait in the semaphore's own queue, behind
            // the async requests already waiting and before later ones (a
            // freed slot goes to the queue's head, so a caller that only
            // tried again would never get one while async requests wait).
            // The caller's thread is no runtime's: it parks until woken.
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                let deadline = Instant::now() + wait;
                let waker = kv_common::driver::thread_waker();
                let mut cx = std::task::Context::from_waker(&waker);
                let mut acquire = std::pin::pin!(self.slots.clone().acquire_owned());
                loop {
                    match std::future::Future::poll(acquire.as_mut(), &mut cx) {
                        std::task::Poll::Ready(Ok(p)) => break p,
                        std::task::Poll::Ready(Err(_)) => return None,
                        std::task::Poll::Pending => {
                            let left = deadline.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                // Dropping the future leaves the queue.
                                return None;
                            }
                            std::thread::park_timeout(left);
                        }
                    }
                }
            }
        };
        let idle = match self.take_idle(|c| matches!(c, Idle::Blocking(_))) {
            Some(Idle::Blocking(c)) => Some(c),
            // Off the reactor; one that cannot be is closed (a new one is opened).
            Some(Idle::Async(c)) => self.moved(c.into_blocking()),
            None => None,
        };
        Some(SyncSlot { node: self.clone(), idle, back: None, permit: Some(permit) })
    }

    /// A connection moved to the other path (counted), if it could be.
    fn moved<S>(&self, c: std::io::Result<Conn<S>>) -> Option<Conn<S>> {
        let c = c.ok()?;
        self.moved.fetch_add(1, Ordering::Relaxed);
        Some(c)
    }

    /// The newest idle connection of the kind `mine` accepts, else the
    /// newest of the other kind.
    fn take_idle(&self, mine: impl Fn(&Idle) -> bool) -> Option<Idle> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        match idle.iter().rposition(mine) {
            Some(i) => Some(idle.remove(i)),
            None => idle.pop(),
        }
    }

    /// Pools a connection between frames (within the cap: one over it, a
    /// moment's replacement of a stale one, is closed).
    fn pool(&self, c: Idle) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_conns {
            idle.push(c);
            return;
        }
        drop(idle);
        drop(c);
    }

    /// Idle connections, of both paths.
    pub fn idle_conns(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn in_use(&self, max: usize) -> usize {
        max - self.slots.available_permits()
    }

    /// Before a connection is opened for a held slot: closes the oldest
    /// idle connections until the slots held and the idle connections are
    /// at most `max_conns`, so the new one keeps the node's open
    /// connections within it (but for a moment while a stale one is
    /// replaced). They are closed after the list's lock is released.
    pub fn make_room(&self) {
        let in_use = self.max_conns - self.slots.available_permits().min(self.max_conns);
        let closing: Vec<Idle> = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let over = (in_use + idle.len()).saturating_sub(self.max_conns).min(idle.len());
            idle.drain(..over).collect()
        };
        drop(closing);
    }

    /// Waits for a connection slot (local: no network involved).
    pub async fn slot(&self) -> Result<OwnedSemaphorePermit, OpError> {
        self.slots.clone().acquire_owned().await.map_err(|_| OpError::Unavailable)
    }

    /// A connection for a held slot: an idle one if any (unless `fresh`),
    /// else a new one (hello exchanged).
    pub async fn checkout(
        self: &Arc<Node>,
        slot: OwnedSemaphorePermit,
        connect_timeout: Duration,
        fresh: bool,
    ) -> Result<Checkout, OpError> {
        if !fresh {
            let conn = match self.take_idle(|c| matches!(c, Idle::Async(_))) {
                Some(Idle::Async(c)) => Some(c),
                // Onto the reactor; one that cannot be is closed (a new
                // one is opened).
                Some(Idle::Blocking(c)) => self.moved(c.into_async()),
                None => None,
            };
            if let Some(conn) = conn {
                return Ok(Checkout { node: self.clone(), conn: Some(conn), reused: true, _slot: slot });
            }
        }
        self.make_room();
        let conn = tokio::time::timeout(connect_timeout, connect(self)).await.map_err(|_| OpError::Timeout)??;
        Ok(Checkout { node: self.clone(), conn: Some(conn), reused: false, _slot: slot })
    }

    /// A pooled connection turned out stale (the node restarted or closed
    /// idle connections): the other idle ones share its fate.
    pub fn drop_idle(&self) {
        let closing = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|e| e.into_inner()));
        drop(closing);
    }
}

/// Resolves the node's address again (a name may point elsewhere since the
/// last connection), connects to the first address that answers, agrees
/// on a protocol version (hello.rs) and sets up the connection's RDMA when
/// the node is asked for it.
async fn connect(node: &Node) -> Result<AsyncConn, OpError> {
    let started = node.hello_version();
    let mut version = started;
    for _ in 0..crate::hello::MAX_TRIES {
        match Conn::<Async>::open(&node.addr, node.token.as_ref(), version).await? {
            Ok((mut conn, version)) => {
                node.agreed_version(started, version);
                node.opened.fetch_add(1, Ordering::Relaxed);
                let name = format!("{} ({})", node.id, node.addr);
                let Some(mut setup) = node.offer.start(&name) else { return Ok(conn) };
                match ask_remote(&mut conn, &mut setup, &name).await {
                    Ok(remote) => {
                        conn.remote = remote;
                        return Ok(conn);
                    }
                    // A node from before RDMA closes on the unknown op:
                    // connect again, without asking.
                    Err(e) => setup.closed(&name, &e),
                }
            }
            Err(v) => version = v,
        }
    }
    Err(crate::hello::unsettled())
}

/// Sets the connection's queue pair up (RDMA_CONNECT): Some when
/// connected, None when the connection goes on over TCP, Err when the
/// connection failed.
async fn ask_remote(
    conn: &mut AsyncConn,
    setup: &mut Setup<'_>,
    name: &str,
) -> Result<Option<Box<dyn RemoteMemory>>, OpError> {
    loop {
        let id = conn.request(Op::RdmaConnect, 0, 0, &[&setup.request()]).await?;
        let h = conn.answer(id, 0).await?;
        let body = conn.answer_body(&h, 4096).await?;
        match setup.answered(h.status, &body, name) {
            Answered::Connected(remote) => return Ok(Some(Box::new(remote))),
            Answered::Again => continue,
            Answered::Tcp => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;
    use crate::rdma::Fabric;

    #[test]
    fn a_node_that_stepped_down_is_asked_the_newest_version_again_after_a_while() {
        let node = Node::new("n1".into(), "127.0.0.1:9".into(), 1, 1, None, Fabric::start(&Options::default()).offer());
        assert_eq!((node.hello_version(), node.speaks()), (WIRE_VERSION, WIRE_VERSION));
        // A v3 node refused the newest: v3 from now on, for a while.
        node.agreed_version(WIRE_VERSION, 3);
        assert_eq!((node.hello_version(), node.speaks()), (3, 3));
        // A connection that started in v3 and got it changes nothing.
        node.agreed_version(3, 3);
        assert_eq!(node.hello_version(), 3);
        // The period passed: new connections try the newest again, while
        // batches still follow what the node last agreed on.
        let later = node.stepped_down.load(Ordering::Relaxed) + STEP_UP_AFTER.as_nanos() as u64 + 1;
        assert_eq!((node.hello_version_at(later), node.speaks()), (WIRE_VERSION, 3));
        assert_eq!(node.hello_version_at(later - 2), 3, "not before");
        // The upgraded node agrees: the newest from now on.
        node.agreed_version(WIRE_VERSION, WIRE_VERSION);
        assert_eq!((node.hello_version(), node.speaks()), (WIRE_VERSION, WIRE_VERSION));
    }

    /// While async requests keep the one slot busy, each queued before the
    /// other frees it, a caller-thread request still gets the slot in its
    /// turn: a freed slot goes to the semaphore's queue head, so one that
    /// only tried again would wait out its whole deadline.
    #[test]
    fn a_caller_thread_waits_its_turn_among_async_requests() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let node = Arc::new(Node::new(
            "n1".into(),
            "127.0.0.1:9".into(),
            1,
            1,
            None,
            Fabric::start(&Options::default()).offer(),
        ));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for _ in 0..2 {
            let (node, stop) = (node.clone(), stop.clone());
            rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let slot = node.slot().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    drop(slot);
                }
            });
        }
        // Both async loops running: one holds the slot, the other waits.
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..5 {
            let t0 = Instant::now();
            let slot = node.sync_slot(Duration::from_secs(3));
            assert!(slot.is_some(), "no slot within 3 s");
            assert!(t0.elapsed() < Duration::from_millis(500), "waited {:?}", t0.elapsed());
        }
        stop.store(true, Ordering::Relaxed);
    }
}
