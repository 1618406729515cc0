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
    /// Of `bytes`, those of records waiting for a flusher (not being
    /// written), and how many.
    waiting_bytes: u64,
    waiting: usize,
    /// Batches being written now.
    writing: usize,
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
    /// A batch: at most this many records, and no more once their bytes
    /// reach `batch_bytes` (a record that large goes alone).
    batch: usize,
    batch_bytes: u64,
    /// While fewer batches than this are being written, a flusher takes
    /// what waits at once; past it, only a full batch (or what waited
    /// [`LINGER`]), so under load records gather into large writes.
    eager: usize,
    st: Mutex<State>,
    /// Work queued, a flush finished, or stopping.
    changed: Condvar,
    pub c: Counters,
}

/// How long an idle flusher sleeps before it looks whether its store is gone.
pub const IDLE_WAKE: Duration = Duration::from_millis(200);

/// The longest a record waits for a batch to fill while other batches are
/// being written.
pub const LINGER: Duration = Duration::from_millis(2);

impl WriteBehind {
    /// Batches of one record, taken at once (tests).
    pub fn new(max_bytes: u64) -> WriteBehind {
        WriteBehind::with_batches(max_bytes, 1, 0, usize::MAX)
    }

    /// Up to `max_bytes` held; flushers take batches of up to `batch`
    /// records and `batch_bytes`, at once while fewer than `eager` batches
    /// are being written (say, one a disk), else once a batch is full.
    pub fn with_batches(max_bytes: u64, batch: usize, batch_bytes: u64, eager: usize) -> WriteBehind {
        WriteBehind {
            max_bytes,
            batch: batch.max(1),
            batch_bytes,
            eager: eager.max(1),
            st: Mutex::new(State::default()),
            changed: Condvar::new(),
            c: Counters::default(),
        }
    }

    /// Whether a flusher should take what waits now.
    fn ready(&self, st: &State) -> bool {
        st.waiting > 0
            && (st.stopping
                || st.writing < self.eager
                || st.waiting >= self.batch
                || st.waiting_bytes >= self.batch_bytes)
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
        st.waiting_bytes += size;
        st.waiting += 1;
        st.held.insert(key.into(), Held { rec, writing: false });
        st.queue.push_back(key.into());
        // A flusher waiting for more is woken only once it would take the
        // batch; one that lingers wakes by itself.
        let wake = self.ready(&st);
        drop(st);
        self.c.acked.fetch_add(1, Ordering::Relaxed);
        if wake {
            self.changed.notify_one();
        }
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
                st.waiting_bytes -= h.rec.capacity() as u64;
                st.waiting -= 1;
                drop(st);
                self.changed.notify_all();
                true
            }
            None => false,
        }
    }

    /// The next batch's first record (tests: with [`WriteBehind::new`] a
    /// batch is one record), finished by [`WriteBehind::done`].
    #[cfg(test)]
    pub fn next(&self) -> Option<(Box<[u8]>, Arc<PooledBuf>)> {
        self.next_batch().into_iter().next()
    }

    /// A batch to write, in the order the records were acknowledged, each
    /// marked as being written: at least one, then more up to the batch's
    /// count and bytes. Taken at once while few batches are being written;
    /// otherwise when a batch is full, or what waits has waited [`LINGER`].
    /// Finished by [`WriteBehind::done_batch`]. Empty once stopping with
    /// nothing left, or after [`IDLE_WAKE`] with nothing to do.
    pub fn next_batch(&self) -> Vec<(Box<[u8]>, Arc<PooledBuf>)> {
        let mut st = self.lock();
        let mut lingered = false;
        loop {
            if (lingered && st.waiting > 0) || self.ready(&st) {
                let out = self.take(&mut st, self.batch);
                if !out.is_empty() {
                    return out;
                }
            }
            if st.stopping && st.waiting == 0 {
                return Vec::new();
            }
            let wait = if st.waiting > 0 { LINGER } else { IDLE_WAKE };
            let (g, timeout) = self.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner());
            st = g;
            if timeout.timed_out() {
                if st.waiting == 0 {
                    return Vec::new();
                }
                lingered = true;
            }
        }
    }

    /// Takes up to `max` waiting records (and `batch_bytes`) off the queue
    /// as one batch being written.
    fn take(&self, st: &mut State, max: usize) -> Vec<(Box<[u8]>, Arc<PooledBuf>)> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        while let Some(key) = st.queue.pop_front() {
            let Some(h) = st.held.get_mut(&key) else { continue };
            if h.writing {
                continue;
            }
            h.writing = true;
            let rec = h.rec.clone();
            bytes += rec.capacity() as u64;
            out.push((key, rec));
            if out.len() >= max || bytes >= self.batch_bytes {
                break;
            }
        }
        st.waiting -= out.len();
        st.waiting_bytes -= bytes;
        if !out.is_empty() {
            st.writing += 1;
        }
        out
    }

    /// A flusher is done with the batch of one `key` ([`WriteBehind::next`]).
    #[cfg(test)]
    pub fn done(&self, key: &[u8], written: bool) {
        self.done_batch([(key, written)]);
    }

    /// A flusher is done with a batch: each key written, or given up on.
    pub fn done_batch<'k>(&self, keys: impl IntoIterator<Item = (&'k [u8], bool)>) {
        let ok = !std::thread::panicking();
        let (mut written, mut failed) = (0, 0);
        let mut st = self.lock();
        for (key, w) in keys {
            if let Some(h) = st.held.remove(key) {
                st.bytes -= h.rec.capacity() as u64;
            }
            if w && ok {
                written += 1;
            } else {
                failed += 1;
            }
        }
        st.writing = st.writing.saturating_sub(1);
        drop(st);
        self.c.flushed.fetch_add(written, Ordering::Relaxed);
        self.c.flush_failed.fetch_add(failed, Ordering::Relaxed);
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
        let keys = |v: Vec<(Box<[u8]>, Arc<PooledBuf>)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let wb = WriteBehind::with_batches(64 * 4096, 2, 1 << 20, usize::MAX);
        for k in [&b"a"[..], b"b", b"c", b"d", b"e"] {
            assert!(wb.hold(k, rec(&pool, 4096)));
        }
        assert!(wb.remove(b"b"));
        assert_eq!(keys(wb.next_batch()), vec![b"a"[..].into(), b"c"[..].into()], "two at most, a removed key skipped");
        assert_eq!(keys(wb.next_batch()), vec![b"d"[..].into(), b"e"[..].into()]);
        wb.done_batch([(&b"a"[..], true), (b"c", true)]);
        wb.done_batch([(&b"d"[..], true), (b"e", false)]);
        assert_eq!(wb.bytes(), 0);
        assert_eq!(wb.c.flushed.load(Ordering::Relaxed), 3);
        assert_eq!(wb.c.flush_failed.load(Ordering::Relaxed), 1);
        assert!(wb.next_batch().is_empty(), "idle: back after IDLE_WAKE");
        // By bytes: a record as large as a batch goes alone.
        let big = rec(&pool, 4096).capacity() as u64;
        let wb = WriteBehind::with_batches(64 * 4096, 16, big, usize::MAX);
        assert!(wb.hold(b"x", rec(&pool, 4096)));
        assert!(wb.hold(b"y", rec(&pool, 4096)));
        assert_eq!(keys(wb.next_batch()), vec![b"x"[..].into()], "past the bytes after one");
        assert_eq!(keys(wb.next_batch()), vec![b"y"[..].into()]);
    }

    /// While a batch is being written, the next is taken only once full, or
    /// after it waited LINGER: under load, records gather into large writes.
    #[test]
    fn under_load_records_gather_into_full_batches() {
        let pool = BufPool::new(0);
        let keys = |v: Vec<(Box<[u8]>, Arc<PooledBuf>)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let wb = WriteBehind::with_batches(64 * 4096, 3, 1 << 20, 1);
        assert!(wb.hold(b"a", rec(&pool, 4096)));
        assert_eq!(keys(wb.next_batch()), vec![b"a"[..].into()], "nothing being written: taken at once");
        assert!(wb.hold(b"b", rec(&pool, 4096)));
        let t = std::time::Instant::now();
        assert_eq!(keys(wb.next_batch()), vec![b"b"[..].into()], "alone after lingering");
        assert!(t.elapsed() >= LINGER, "waited for more: {:?}", t.elapsed());
        for k in [&b"c"[..], b"d", b"e", b"f"] {
            assert!(wb.hold(k, rec(&pool, 4096)));
        }
        assert_eq!(keys(wb.next_batch()), vec![b"c"[..].into(), b"d"[..].into(), b"e"[..].into()], "a full batch");
        wb.done_batch([(&b"a"[..], true)]);
        wb.done_batch([(&b"b"[..], true)]);
        wb.done_batch([(&b"c"[..], true), (b"d", true), (b"e", true)]);
        assert_eq!(keys(wb.next_batch()), vec![b"f"[..].into()], "nothing being written again: at once");
        wb.done_batch([(&b"f"[..], true)]);
        assert_eq!(wb.bytes(), 0);
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
