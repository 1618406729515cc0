//! Write-behind for `ack = "memory"` (docs/ARCHITECTURE.md, "Acknowledging
//! puts"): a put is answered once its record is held here (and in the
//! memory tier), and flusher threads write it to its disk afterwards.
//!
//! What holds: the bytes held and not yet on a disk are bounded (past the
//! bound the store writes the put itself, a media acknowledgement); a
//! record held here is served by get, exist and stat until its disk has it;
//! a delete waits for a flush of its key in progress, so a deleted page is
//! never written back after the delete; a crash loses what is held, and
//! those pages then miss (the disk never saw them, or saw a record its
//! checksum rejects on read).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::buf::PooledBuf;

/// A record held until it is on its disk.
struct Held {
    rec: Arc<PooledBuf>,
    /// A flusher is writing it now.
    writing: bool,
}

#[derive(Default)]
struct State {
    held: HashMap<Box<[u8]>, Held>,
    /// Keys in the order they were acknowledged (a key deleted meanwhile is
    /// skipped when it comes up).
    queue: VecDeque<Box<[u8]>>,
    bytes: u64,
    stopping: bool,
}

#[derive(Default)]
pub struct Counters {
    /// Puts acknowledged from memory.
    pub acked: AtomicU64,
    /// Puts acknowledged on media because the bound was reached.
    pub fallbacks: AtomicU64,
    /// Records written to their disk by a flusher.
    pub flushed: AtomicU64,
    /// Records a flusher could not write (no disk, disk full or failed):
    /// acknowledged pages that now miss.
    pub flush_failed: AtomicU64,
}

pub struct WriteBehind {
    max_bytes: u64,
    st: Mutex<State>,
    /// Work queued, a flush finished, or stopping.
    changed: Condvar,
    pub c: Counters,
}

/// How long an idle flusher sleeps before it looks whether its store is gone.
pub const IDLE_WAKE: Duration = Duration::from_millis(200);

impl WriteBehind {
    pub fn new(max_bytes: u64) -> WriteBehind {
        WriteBehind { max_bytes, st: Mutex::new(State::default()), changed: Condvar::new(), c: Counters::default() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Bytes held and not yet on a disk.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Holds `rec` under `key` for a flusher. False (nothing held) when the
    /// bound would be passed, when stopping, or when `key` is held already
    /// (the caller then writes the record itself, or finds the duplicate).
    pub fn hold(&self, key: &[u8], rec: Arc<PooledBuf>) -> bool {
        let size = rec.capacity() as u64;
        let mut st = self.lock();
        if st.stopping || st.held.contains_key(key) || st.bytes + size > self.max_bytes {
            return false;
        }
        st.bytes += size;
        st.held.insert(key.into(), Held { rec, writing: false });
        st.queue.push_back(key.into());
        drop(st);
        self.c.acked.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_all();
        true
    }

    /// The record held under `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<Arc<PooledBuf>> {
        self.lock().held.get(key).map(|h| h.rec.clone())
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.lock().held.contains_key(key)
    }

    /// Forgets `key` (a delete). Waits while a flusher writes it, so the
    /// caller's delete from the disks comes after that write. True when held.
    pub fn remove(&self, key: &[u8]) -> bool {
        let mut st = self.lock();
        while st.held.get(key).is_some_and(|h| h.writing) {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match st.held.remove(key) {
            Some(h) => {
                st.bytes -= h.rec.capacity() as u64;
                drop(st);
                self.changed.notify_all();
                true
            }
            None => false,
        }
    }

    /// The next record to write, marked as being written; None once
    /// stopping with nothing left, or after [`IDLE_WAKE`] with nothing to do.
    pub fn next(&self) -> Option<(Box<[u8]>, Arc<PooledBuf>)> {
        self.next_batch(1, 0).pop()
    }

    /// Records to write, in the order they were acknowledged, each marked
    /// as being written: at least one, then more while there are fewer than
    /// `max` and their bytes are under `max_bytes` (large records go alone,
    /// so several flushers keep several writes in flight). Waits for the
    /// first only. Empty once stopping with nothing left, or after
    /// [`IDLE_WAKE`] with nothing to do.
    pub fn next_batch(&self, max: usize, max_bytes: u64) -> Vec<(Box<[u8]>, Arc<PooledBuf>)> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let mut st = self.lock();
        loop {
            while let Some(key) = st.queue.pop_front() {
                if let Some(h) = st.held.get_mut(&key) {
                    if !h.writing {
                        h.writing = true;
                        let rec = h.rec.clone();
                        bytes += rec.capacity() as u64;
                        out.push((key, rec));
                        if out.len() >= max || bytes >= max_bytes {
                            break;
                        }
                    }
                }
            }
            if !out.is_empty() || st.stopping {
                return out;
            }
            let (g, timeout) = self.changed.wait_timeout(st, IDLE_WAKE).unwrap_or_else(|e| e.into_inner());
            st = g;
            if timeout.timed_out() && st.queue.is_empty() {
                return out;
            }
        }
    }

    /// A flusher is done with `key` (written, or given up on).
    pub fn done(&self, key: &[u8], written: bool) {
        let written = written && !std::thread::panicking();
        let mut st = self.lock();
        if let Some(h) = st.held.remove(key) {
            st.bytes -= h.rec.capacity() as u64;
        }
        drop(st);
        let c = if written { &self.c.flushed } else { &self.c.flush_failed };
        c.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_all();
    }

    /// Stops taking records; returns once every record held is written (or
    /// given up on) or `timeout` passed. The number still held.
    pub fn stop_and_flush(&self, timeout: Duration) -> usize {
        self.lock().stopping = true;
        self.changed.notify_all();
        self.wait_empty(timeout)
    }

    /// Returns once nothing is held (or `timeout` passed), without
    /// stopping: for a drain, whose puts are refused, before it lists the
    /// pages on disk. The number still held.
    pub fn wait_empty(&self, timeout: Duration) -> usize {
        let deadline = std::time::Instant::now() + timeout;
        let mut st = self.lock();
        while !st.held.is_empty() {
            let now = std::time::Instant::now();
            if now >= deadline {
                break;
            }
            st = self.changed.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        st.held.len()
    }

    /// Whether [`WriteBehind::stop_and_flush`] was called.
    pub fn stopping(&self) -> bool {
        self.lock().stopping
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BufPool;

    fn rec(pool: &BufPool, n: usize) -> Arc<PooledBuf> {
        let mut b = pool.get(n);
        b.set_len(n);
        Arc::new(b)
    }

    #[test]
    fn bounded_and_in_order() {
        let pool = BufPool::new(0);
        let wb = WriteBehind::new(3 * 4096);
        assert!(wb.hold(b"a", rec(&pool, 4096)));
        assert!(!wb.hold(b"a", rec(&pool, 4096)), "a key held once");
        assert!(wb.hold(b"b", rec(&pool, 4096)));
        assert!(wb.hold(b"c", rec(&pool, 4096)));
        assert!(!wb.hold(b"d", rec(&pool, 4096)), "past the bound");
        assert_eq!(wb.bytes(), 3 * 4096);
        assert!(wb.remove(b"b"));
        let (k, _) = wb.next().unwrap();
        assert_eq!(&*k, b"a");
        assert!(wb.get(b"a").is_some(), "served while written");
        wb.done(&k, true);
        let (k, _) = wb.next().unwrap();
        assert_eq!(&*k, b"c", "a removed key is skipped");
        wb.done(&k, false);
        assert_eq!(wb.bytes(), 0);
        assert_eq!(wb.c.flushed.load(Ordering::Relaxed), 1);
        assert_eq!(wb.c.flush_failed.load(Ordering::Relaxed), 1);
        assert!(wb.next().is_none(), "idle: back after IDLE_WAKE");
    }

    #[test]
    fn a_batch_is_bounded_by_count_and_bytes_and_keeps_the_order() {
        let pool = BufPool::new(0);
        let wb = WriteBehind::new(64 * 4096);
        for k in [&b"a"[..], b"b", b"c", b"d", b"e"] {
            assert!(wb.hold(k, rec(&pool, 4096)));
        }
        assert!(wb.remove(b"b"));
        let keys = |v: Vec<(Box<[u8]>, Arc<PooledBuf>)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let first = keys(wb.next_batch(2, 1 << 20));
        assert_eq!(first, vec![b"a"[..].into(), b"c"[..].into()], "two at most, a removed key skipped");
        let big = wb.get(b"d").unwrap().capacity() as u64;
        assert_eq!(keys(wb.next_batch(16, big)), vec![b"d"[..].into()], "past the bytes after one");
        assert!(wb.get(b"e").is_some());
        let rest = wb.next_batch(16, 0);
        assert_eq!(keys(rest), vec![b"e"[..].into()], "at least one");
        for k in [&b"a"[..], b"c", b"d", b"e"] {
            wb.done(k, true);
        }
        assert_eq!(wb.bytes(), 0);
        assert!(wb.next_batch(16, 1 << 20).is_empty(), "idle: back after IDLE_WAKE");
    }

    #[test]
    fn a_delete_waits_for_the_write_in_progress() {
        let pool = BufPool::new(0);
        let wb = WriteBehind::new(1 << 20);
        assert!(wb.hold(b"k", rec(&pool, 4096)));
        let (k, _) = wb.next().unwrap();
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                let held = wb.remove(b"k");
                order.lock().unwrap().push("removed");
                held
            });
            std::thread::sleep(Duration::from_millis(50));
            order.lock().unwrap().push("written");
            wb.done(&k, true);
            assert!(!h.join().unwrap(), "gone once written: the delete goes to the disk");
        });
        assert_eq!(*order.lock().unwrap(), vec!["written", "removed"]);
    }

    #[test]
    fn stop_waits_for_the_flushers() {
        let pool = BufPool::new(0);
        let wb = Arc::new(WriteBehind::new(1 << 20));
        for i in 0..10u8 {
            assert!(wb.hold(&[i], rec(&pool, 4096)));
        }
        let w = wb.clone();
        let flusher = std::thread::spawn(move || {
            while let Some((k, _)) = w.next() {
                w.done(&k, true);
            }
        });
        assert_eq!(wb.stop_and_flush(Duration::from_secs(10)), 0);
        assert!(!wb.hold(b"late", rec(&pool, 4096)), "nothing taken once stopping");
        flusher.join().unwrap();
        assert_eq!(wb.c.flushed.load(Ordering::Relaxed), 10);
    }
}
