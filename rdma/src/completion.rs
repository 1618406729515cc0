//! Work requests in flight on one queue pair, matched to their completions
//! by id. Up to `depth` are in flight at once; each has a deadline. On RC a
//! failed completion (or one that never comes) leaves the queue pair in the
//! error state: the tracker then fails every request in flight, refuses new
//! ones, and the owner tears the queue pair down and reconnects or falls
//! back to TCP. Nobody waits for ever.
//!
//! Memory a request hands to the NIC (`hold`) is kept until its completion
//! arrives, or, for requests that timed out or were failed, until the owner
//! has destroyed the queue pair ([`Tracker::take_limbo`]): the NIC may still
//! touch it before then.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::Counters;

/// Anything the NIC reads or writes for a request, kept alive for it.
pub type Hold = Box<dyn std::any::Any + Send>;

/// One work completion as the device reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    /// 0 is success (IBV_WC_SUCCESS); anything else an error status.
    pub status: u32,
    pub bytes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdmaError {
    #[error("RDMA work request timed out after {0:?}")]
    Timeout(Duration),
    #[error("RDMA queue pair broken: {0}")]
    Broken(String),
    #[error("RDMA work request failed with status {0}")]
    Failed(u32),
    #[error("RDMA post failed: {0}")]
    Post(String),
}

/// Polls a completion queue (the device's, or a stand-in in tests).
pub trait CompletionSource {
    /// Appends the completions ready now; Err if the queue itself failed.
    fn poll(&mut self, out: &mut Vec<Wc>) -> Result<(), String>;
}

struct Pending {
    deadline: Instant,
    tx: oneshot::Sender<Result<u32, RdmaError>>,
    hold: Option<Hold>,
}

struct Inner {
    next: u64,
    pending: HashMap<u64, Pending>,
    broken: Option<String>,
    limbo: Vec<Hold>,
}

pub struct Tracker {
    inner: Mutex<Inner>,
    slots: Arc<Semaphore>,
    depth: usize,
    timeout: Duration,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("depth", &self.depth).field("in_flight", &self.in_flight()).finish()
    }
}

/// A request posted (or about to be): its id, and the way to its outcome.
#[derive(Debug)]
pub struct Ticket {
    pub wr_id: u64,
    rx: oneshot::Receiver<Result<u32, RdmaError>>,
}

/// Requests taken together ([`Tracker::begin_many`]): their tickets, and the
/// depth slots they hold until all are resolved.
#[derive(Debug)]
pub struct Slots {
    tickets: Vec<Ticket>,
    deadline: Instant,
    _permit: OwnedSemaphorePermit,
}

impl Slots {
    pub fn ids(&self) -> Vec<u64> {
        self.tickets.iter().map(|t| t.wr_id).collect()
    }

    /// The bytes each completion reported, or the first failure. The polling
    /// thread enforces deadlines; should it be gone, this gives up a second
    /// after the deadline on its own (the caller then breaks the link).
    pub async fn wait(self) -> Result<Vec<u32>, RdmaError> {
        let timeout = self.deadline.saturating_duration_since(Instant::now());
        let backstop = tokio::time::Instant::from_std(self.deadline + Duration::from_secs(1));
        let mut out = Vec::with_capacity(self.tickets.len());
        let mut first_err = None;
        for t in self.tickets {
            let r = match tokio::time::timeout_at(backstop, t.rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(RdmaError::Broken("tracker dropped".into())),
                Err(_) => Err(RdmaError::Timeout(timeout)),
            };
            match r {
                Ok(n) => out.push(n),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(out), Err)
    }
}

impl Tracker {
    pub fn new(depth: usize, timeout: Duration, counters: Arc<Counters>) -> Tracker {
        Tracker {
            inner: Mutex::new(Inner { next: 1, pending: HashMap::new(), broken: None, limbo: Vec::new() }),
            slots: Arc::new(Semaphore::new(depth.max(1))),
            depth: depth.max(1),
            timeout,
            counters,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One request: [`Tracker::begin_many`] of one.
    pub async fn begin(&self, hold: Option<Hold>) -> Result<Slots, RdmaError> {
        self.begin_many(vec![hold]).await
    }

    /// Takes `holds.len()` of the `depth` slots at once (at most `depth`;
    /// waiting at most the timeout, so two transfers sharing the queue pair
    /// never hold part of what each needs) and an id per request about to
    /// be posted. Ids are never reused, so a late completion cannot be taken
    /// for another request. A wait that times out breaks the queue pair:
    /// something in flight on it is stuck.
    pub async fn begin_many(&self, holds: Vec<Option<Hold>>) -> Result<Slots, RdmaError> {
        let n = holds.len().clamp(1, self.depth) as u32;
        if holds.len() > self.depth {
            return Err(RdmaError::Post(format!("{} requests at once over a depth of {}", holds.len(), self.depth)));
        }
        if let Some(b) = &self.lock().broken {
            return Err(RdmaError::Broken(b.clone()));
        }
        let permit = match tokio::time::timeout(self.timeout, self.slots.clone().acquire_many_owned(n)).await {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => return Err(RdmaError::Broken("closed".into())),
            Err(_) => {
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                self.break_all("no work request slot freed in time");
                return Err(RdmaError::Timeout(self.timeout));
            }
        };
        let mut g = self.lock();
        if let Some(b) = &g.broken {
            return Err(RdmaError::Broken(b.clone()));
        }
        let deadline = Instant::now() + self.timeout;
        let mut tickets = Vec::with_capacity(holds.len());
        for hold in holds {
            let wr_id = g.next;
            g.next += 1;
            let (tx, rx) = oneshot::channel();
            g.pending.insert(wr_id, Pending { deadline, tx, hold });
            tickets.push(Ticket { wr_id, rx });
        }
        Ok(Slots { tickets, deadline, _permit: permit })
    }

    /// A post failed: no completion will come for what it carried. The
    /// queue pair is not trusted after that.
    pub fn post_failed(&self, why: &str) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        self.break_all(&format!("post failed: {why}"));
    }

    /// Hands a completion to its request. False for an id not in flight (a
    /// late completion of a request that timed out).
    pub fn complete(&self, wc: &Wc) -> bool {
        let mut g = self.lock();
        let Some(p) = g.pending.remove(&wc.wr_id) else { return false };
        if wc.status == 0 {
            drop(g);
            self.counters.completions.fetch_add(1, Ordering::Relaxed);
            let _ = p.tx.send(Ok(wc.bytes));
            drop(p.hold);
            return true;
        }
        // An error completion: this request failed, and the queue pair is in
        // the error state: the rest will flush.
        // Counted, and the queue pair marked broken, before anyone hears.
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        let why = format!("work completion status {}", wc.status);
        if g.broken.is_none() {
            g.broken = Some(why.clone());
            self.counters.qp_broken.fetch_add(1, Ordering::Relaxed);
        }
        let _ = p.tx.send(Err(RdmaError::Failed(wc.status)));
        drop(p.hold);
        Self::fail_locked(&mut g, &why, &self.counters, true);
        true
    }

    /// Marks the queue pair broken (counted in `qp_broken` when `counted`:
    /// a failure, not a close) and fails every request in flight.
    fn fail_locked(g: &mut Inner, why: &str, counters: &Counters, counted: bool) {
        if g.broken.is_none() {
            g.broken = Some(why.to_string());
            if counted {
                counters.qp_broken.fetch_add(1, Ordering::Relaxed);
            }
        }
        for (_, p) in g.pending.drain() {
            let _ = p.tx.send(Err(RdmaError::Broken(why.to_string())));
            if let Some(h) = p.hold {
                g.limbo.push(h);
            }
        }
    }

    /// Fails every request in flight and refuses new ones: a failure.
    pub fn break_all(&self, why: &str) {
        Self::fail_locked(&mut self.lock(), why, &self.counters, true);
    }

    /// The same for a queue pair closed on purpose (its connection closed,
    /// replaced): not counted as broken.
    pub fn close(&self, why: &str) {
        Self::fail_locked(&mut self.lock(), why, &self.counters, false);
    }

    /// Fails requests past their deadline; then the queue pair is broken
    /// (the device may still be working on them). Returns how many expired.
    pub fn expire(&self, now: Instant) -> usize {
        let mut g = self.lock();
        let late: Vec<u64> = g.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(&id, _)| id).collect();
        if late.is_empty() {
            return 0;
        }
        // Counted before anyone hears of it.
        self.counters.timeouts.fetch_add(late.len() as u64, Ordering::Relaxed);
        if g.broken.is_none() {
            g.broken = Some("a work request timed out".into());
            self.counters.qp_broken.fetch_add(1, Ordering::Relaxed);
        }
        for id in &late {
            let p = g.pending.remove(id).expect("listed");
            let _ = p.tx.send(Err(RdmaError::Timeout(self.timeout)));
            if let Some(h) = p.hold {
                g.limbo.push(h);
            }
        }
        Self::fail_locked(&mut g, "a work request timed out", &self.counters, true);
        late.len()
    }

    /// Polls `source` once and hands out what it found; a failed queue
    /// breaks the tracker. Returns the completions taken.
    pub fn drive(&self, source: &mut dyn CompletionSource, buf: &mut Vec<Wc>) -> usize {
        buf.clear();
        if let Err(e) = source.poll(buf) {
            self.break_all(&format!("completion queue: {e}"));
            return 0;
        }
        buf.iter().filter(|wc| self.complete(wc)).count()
    }

    pub fn broken(&self) -> Option<String> {
        self.lock().broken.clone()
    }

    pub fn in_flight(&self) -> usize {
        self.lock().pending.len()
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Memory of failed requests, to drop once the queue pair is destroyed.
    pub fn take_limbo(&self) -> Vec<Hold> {
        std::mem::take(&mut self.lock().limbo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A stand-in completion queue fed by the test.
    #[derive(Default)]
    struct FakeCq {
        ready: VecDeque<Wc>,
        fail: Option<String>,
    }
    impl CompletionSource for FakeCq {
        fn poll(&mut self, out: &mut Vec<Wc>) -> Result<(), String> {
            if let Some(e) = self.fail.take() {
                return Err(e);
            }
            out.extend(self.ready.drain(..));
            Ok(())
        }
    }

    fn tracker(depth: usize, ms: u64) -> (Arc<Tracker>, Arc<Counters>) {
        let c = Arc::new(Counters::default());
        (Arc::new(Tracker::new(depth, Duration::from_millis(ms), c.clone())), c)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    #[test]
    fn completions_reach_their_requests_in_any_order() {
        rt().block_on(async {
            let (t, c) = tracker(8, 5_000);
            let mut tickets = Vec::new();
            for _ in 0..2 {
                tickets.push(t.begin(None).await.unwrap());
            }
            tickets.push(t.begin_many(vec![None, None, None]).await.unwrap());
            let ids: Vec<u64> = tickets.iter().flat_map(|t| t.ids()).collect();
            assert_eq!(ids, [1, 2, 3, 4, 5]);
            let mut cq = FakeCq::default();
            for &id in ids.iter().rev() {
                cq.ready.push_back(Wc { wr_id: id, status: 0, bytes: id as u32 * 100 });
            }
            cq.ready.push_back(Wc { wr_id: 99, status: 0, bytes: 1 }); // a stray
            let mut buf = Vec::new();
            assert_eq!(t.drive(&mut cq, &mut buf), 5);
            let mut got = Vec::new();
            for tk in tickets {
                got.extend(tk.wait().await.unwrap());
            }
            assert_eq!(got, ids.iter().map(|&id| id as u32 * 100).collect::<Vec<_>>());
            assert_eq!(c.completions.load(Ordering::Relaxed), 5);
            assert_eq!(t.in_flight(), 0);
            assert!(t.broken().is_none());
        });
    }

    #[test]
    fn depth_bounds_requests_in_flight() {
        rt().block_on(async {
            let (t, c) = tracker(3, 50);
            let a = t.begin(None).await.unwrap();
            let _b = t.begin(None).await.unwrap();
            // More than the depth at once is refused up front.
            assert!(matches!(t.begin_many(vec![None, None, None, None]).await, Err(RdmaError::Post(_))));
            // Two more wait for two slots together: a slot freed does not
            // let them through half-way.
            let t2 = t.clone();
            let waiter = tokio::spawn(async move { t2.begin_many(vec![None, None]).await });
            tokio::time::sleep(Duration::from_millis(10)).await;
            t.complete(&Wc { wr_id: a.ids()[0], status: 0, bytes: 0 });
            assert_eq!(a.wait().await, Ok(vec![0]));
            let w = waiter.await.unwrap().unwrap();
            assert_eq!(w.ids(), vec![3, 4]);
            // No slot freed in time: a timeout, and the queue pair is broken.
            assert_eq!(t.begin(None).await.unwrap_err(), RdmaError::Timeout(Duration::from_millis(50)));
            assert!(t.broken().is_some());
            assert_eq!(c.qp_broken.load(Ordering::Relaxed), 1);
        });
    }

    #[test]
    fn a_timeout_breaks_the_queue_pair_and_keeps_memory_until_teardown() {
        rt().block_on(async {
            let (t, c) = tracker(4, 20);
            let held = Arc::new(());
            let a = t.begin(Some(Box::new(held.clone()))).await.unwrap();
            let b = t.begin(None).await.unwrap();
            assert_eq!(t.expire(Instant::now()), 0, "not yet due");
            let later = Instant::now() + Duration::from_millis(25);
            assert_eq!(t.expire(later), 2);
            assert!(matches!(a.wait().await, Err(RdmaError::Timeout(_))));
            assert!(matches!(b.wait().await, Err(RdmaError::Timeout(_))));
            assert_eq!(c.timeouts.load(Ordering::Relaxed), 2);
            assert_eq!(c.qp_broken.load(Ordering::Relaxed), 1);
            assert!(matches!(t.begin(None).await, Err(RdmaError::Broken(_))));
            // A late completion is not taken for anything.
            assert!(!t.complete(&Wc { wr_id: 1, status: 0, bytes: 0 }));
            // The NIC may still write into the held memory: kept until the
            // owner destroyed the queue pair.
            assert_eq!(Arc::strong_count(&held), 2);
            drop(t.take_limbo());
            assert_eq!(Arc::strong_count(&held), 1);
        });
    }

    #[test]
    fn an_error_completion_fails_the_rest_and_a_dead_queue_too() {
        rt().block_on(async {
            let (t, c) = tracker(4, 5_000);
            let a = t.begin(None).await.unwrap();
            let b = t.begin(None).await.unwrap();
            let mut cq = FakeCq::default();
            cq.ready.push_back(Wc { wr_id: a.ids()[0], status: 12, bytes: 0 }); // IBV_WC_RETRY_EXC_ERR
            let mut buf = Vec::new();
            assert_eq!(t.drive(&mut cq, &mut buf), 1);
            assert_eq!(a.wait().await, Err(RdmaError::Failed(12)));
            assert!(matches!(b.wait().await, Err(RdmaError::Broken(w)) if w.contains("status 12")));
            assert_eq!(c.errors.load(Ordering::Relaxed), 1);
            assert_eq!(c.qp_broken.load(Ordering::Relaxed), 1);
            // A queue pair closed on purpose is not counted as broken.
            let (t, c) = tracker(4, 5_000);
            let a = t.begin(None).await.unwrap();
            t.close("connection closed");
            assert!(matches!(a.wait().await, Err(RdmaError::Broken(_))));
            assert_eq!(c.qp_broken.load(Ordering::Relaxed), 0);

            let (t, c) = tracker(4, 5_000);
            let a = t.begin(None).await.unwrap();
            let mut cq = FakeCq { fail: Some("ibv_poll_cq failed".into()), ..Default::default() };
            assert_eq!(t.drive(&mut cq, &mut buf), 0);
            assert!(matches!(a.wait().await, Err(RdmaError::Broken(w)) if w.contains("ibv_poll_cq")));
            assert_eq!(c.qp_broken.load(Ordering::Relaxed), 1);
            let (t, _c) = tracker(4, 5_000);
            let a = t.begin(None).await.unwrap();
            t.post_failed("ENOMEM");
            assert!(matches!(a.wait().await, Err(RdmaError::Broken(w)) if w.contains("ENOMEM")));
        });
    }
}
