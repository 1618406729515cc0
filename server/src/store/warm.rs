//! Prefetch warming (docs/ARCHITECTURE.md, "Prefetch warming"): engines ask
//! a batch exist over a prefix, then get the leading hits a few
//! milliseconds later. A page an exist found only on disk is read into the
//! memory tier meanwhile by a warmer thread, so the get is served from
//! memory. Bounded: at most `budget` bytes held in all, counting the packed
//! keys of each exist batch from when it is queued until it is sorted out,
//! and each page from when it is queued until its read is over (its record
//! length plus its key, held twice: in the queue and in the pending set).
//! Past the budget a batch or page is not warmed (its gets read the disk,
//! as without warming); at most [`MAX_BATCHES`] batches wait to be sorted.
//! Only the set of warmed keys kept for the warmed-then-read counter is
//! outside the budget, bounded by [`WARMED_KEYS`] keys.
//!
//! The memory tier is an LRU and a warmed page enters it as the most
//! recent: it evicts the least recently used pages, each of which was last
//! used before this page was asked for.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
struct State {
    /// Keys an exist found present, not yet sorted out (each buffer a run
    /// of u16 length + key): the warmers look up which are only on disk,
    /// off the reactor. Bounded by [`MAX_BATCHES`] and counted in `bytes`.
    batches: VecDeque<Vec<u8>>,
    queue: VecDeque<(Box<[u8]>, u64)>,
    /// Keys queued or being read (a key asked twice is warmed once).
    pending: HashSet<Box<[u8]>>,
    /// Bytes held, within the budget: batches queued or being sorted
    /// (their packed length) and pages queued or being read ([`page_cost`]).
    bytes: u64,
    /// Keys warmed and not yet read by a get (bounded by [`WARMED_KEYS`]).
    warmed: HashSet<Box<[u8]>>,
}

/// Exist batches waiting to be sorted out, at most (besides the budget on
/// their bytes); past it a batch is not warmed.
const MAX_BATCHES: usize = 64;

/// What a page queued or being read holds against the budget: its record,
/// and its key in the queue (then on the warmer reading it) and in the
/// pending set.
fn page_cost(key_len: usize, len: u64) -> u64 {
    len + 2 * key_len as u64
}

/// Fruitless batches in a row before batches are sampled.
const IDLE_AFTER: u64 = 8;
/// One batch in this many is sorted while warming finds nothing to do.
const SAMPLE: u64 = 32;

/// What a warmer does next.
pub enum Work {
    /// Keys found present: which are only on disk ([`decode_keys`]).
    Sort(Vec<u8>),
    /// A page to read into the memory tier, and its record length.
    Read(Box<[u8]>, u64),
}

/// Packs `keys` for [`Warmer::offer_keys`], in a buffer of exactly its
/// length (what the budget counts is what is held).
pub fn encode_keys<'a>(keys: impl Iterator<Item = &'a [u8]> + Clone) -> Vec<u8> {
    let fits = |k: &&[u8]| u16::try_from(k.len()).is_ok();
    let mut out = Vec::with_capacity(keys.clone().filter(fits).map(|k| 2 + k.len()).sum());
    for k in keys {
        let Ok(n) = u16::try_from(k.len()) else { continue };
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(k);
    }
    out
}

/// The keys packed by [`encode_keys`].
pub fn decode_keys(mut b: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while b.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([b[0], b[1]]));
        let Some(k) = b.get(2..2 + n) else { break };
        out.push(k);
        b = &b[2 + n..];
    }
    out
}

/// Warmed keys remembered for the warmed-then-read counter; past it the set
/// starts over (the counter then undercounts, nothing else changes).
const WARMED_KEYS: usize = 65_536;

#[derive(Default)]
pub struct Counters {
    /// Pages read into the memory tier after an exist found them on disk.
    pub warmed: AtomicU64,
    /// Gets served from memory of a page warmed and not read since.
    pub warmed_read: AtomicU64,
    /// Pages not warmed, and batches dropped whole: the budget was spent
    /// (or, for a batch, the queue was busy or full).
    pub skipped: AtomicU64,
}

pub struct Warmer {
    budget: u64,
    st: Mutex<State>,
    work: Condvar,
    /// Keys in `warmed`, read without the lock on every memory hit.
    outstanding: AtomicU64,
    /// Batches sorted in a row that had nothing to warm (every page already
    /// in memory): past [`IDLE_AFTER`] only one batch in [`SAMPLE`] is
    /// looked at, so a node whose tier holds what is asked spends nearly
    /// nothing on warming; one page to warm brings back every batch.
    fruitless: AtomicU64,
    offered: AtomicU64,
    pub c: Counters,
}

/// How long an idle warmer sleeps before it looks whether its store is gone.
pub const IDLE_WAKE: Duration = Duration::from_millis(200);

impl Warmer {
    pub fn new(budget: u64) -> Warmer {
        Warmer {
            budget,
            st: Mutex::new(State::default()),
            work: Condvar::new(),
            outstanding: AtomicU64::new(0),
            fruitless: AtomicU64::new(0),
            offered: AtomicU64::new(0),
            c: Counters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `key` (a record of `len` bytes) for warming (on a warmer
    /// thread, after sorting a batch: it may wait for the lock).
    pub fn offer(&self, key: &[u8], len: u64) {
        let mut st = self.lock();
        if st.pending.contains(key) {
            return;
        }
        let cost = page_cost(key.len(), len);
        if st.bytes + cost > self.budget {
            drop(st);
            self.c.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        st.bytes += cost;
        st.pending.insert(key.into());
        st.queue.push_back((key.into(), len));
        drop(st);
        self.work.notify_one();
    }

    /// Queues keys an exist found present (packed by `pack`, with
    /// [`encode_keys`], only when the batch is taken) for a warmer to sort
    /// out; never waits (this runs on the reactor). Its bytes are held
    /// against the budget until [`Warmer::sorted`]; a batch that would pass
    /// the budget is dropped.
    pub fn offer_keys(&self, pack: impl FnOnce() -> Vec<u8>) {
        let n = self.offered.fetch_add(1, Ordering::Relaxed);
        if self.fruitless.load(Ordering::Relaxed) >= IDLE_AFTER && n % SAMPLE != 0 {
            return;
        }
        let packed = pack();
        let Ok(mut st) = self.st.try_lock() else {
            self.c.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let cost = packed.capacity() as u64;
        if st.batches.len() >= MAX_BATCHES || st.bytes + cost > self.budget {
            drop(st);
            drop(packed);
            self.c.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        st.bytes += cost;
        st.batches.push_back(packed);
        drop(st);
        self.work.notify_one();
    }

    /// A batch (from [`Work::Sort`]) was sorted: `queued` of its pages were
    /// offered for reading. Lets its bytes go.
    pub fn sorted(&self, packed: Vec<u8>, queued: usize) {
        let cost = packed.capacity() as u64;
        self.lock().bytes -= cost;
        drop(packed);
        if queued == 0 {
            self.fruitless.fetch_add(1, Ordering::Relaxed);
        } else {
            self.fruitless.store(0, Ordering::Relaxed);
        }
    }

    /// The next thing to do (pages to read first), or None after
    /// [`IDLE_WAKE`] with nothing queued.
    pub fn next(&self) -> Option<Work> {
        let mut st = self.lock();
        loop {
            if let Some((k, len)) = st.queue.pop_front() {
                return Some(Work::Read(k, len));
            }
            if let Some(b) = st.batches.pop_front() {
                return Some(Work::Sort(b));
            }
            let (g, t) = self.work.wait_timeout(st, IDLE_WAKE).unwrap_or_else(|e| e.into_inner());
            st = g;
            if t.timed_out() && st.queue.is_empty() && st.batches.is_empty() {
                return None;
            }
        }
    }

    /// The read of `key` (from [`Warmer::next`]) is over; `warmed` if it
    /// entered the memory tier.
    pub fn done(&self, key: &[u8], len: u64, warmed: bool) {
        let mut st = self.lock();
        st.bytes -= page_cost(key.len(), len);
        st.pending.remove(key);
        let mut dropped = None;
        if warmed {
            if st.warmed.len() >= WARMED_KEYS {
                // Freed after the lock is let go.
                dropped = Some(std::mem::take(&mut st.warmed));
            }
            st.warmed.insert(key.into());
            self.outstanding.store(st.warmed.len() as u64, Ordering::Relaxed);
            self.c.warmed.fetch_add(1, Ordering::Relaxed);
        }
        drop(st);
        drop(dropped);
    }

    /// A get served `key` from memory: counts it once if it was warmed.
    /// Never waits (it runs on the reactor): a busy lock leaves it uncounted.
    pub fn note_read(&self, key: &[u8]) {
        if self.outstanding.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Ok(mut st) = self.st.try_lock() else { return };
        if st.warmed.remove(key) {
            self.outstanding.store(st.warmed.len() as u64, Ordering::Relaxed);
            self.c.warmed_read.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Bytes held against the budget: batches queued or being sorted, pages
    /// queued or being read.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_once_per_key_and_counted() {
        // Each page holds 4 bytes of record and its 1-byte key twice.
        let w = Warmer::new(14);
        w.offer(b"a", 4);
        w.offer(b"a", 4);
        w.offer(b"b", 4);
        w.offer(b"c", 4);
        assert_eq!(w.bytes(), 12, "a once, b, and c past the budget");
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 1);
        let Some(Work::Read(k, len)) = w.next() else { panic!("a read first") };
        assert_eq!((&*k, len), (&b"a"[..], 4));
        w.done(&k, len, true);
        let Some(Work::Read(k, len)) = w.next() else { panic!("a read") };
        w.done(&k, len, false);
        assert_eq!(w.bytes(), 0);
        w.note_read(b"b");
        w.note_read(b"a");
        w.note_read(b"a");
        assert_eq!(w.c.warmed.load(Ordering::Relaxed), 1);
        assert_eq!(w.c.warmed_read.load(Ordering::Relaxed), 1, "counted once, warmed keys only");
        assert!(w.next().is_none());
        let packed = encode_keys([&b"x"[..], &b"yz"[..]].into_iter());
        assert_eq!(decode_keys(&packed), vec![&b"x"[..], &b"yz"[..]]);
        w.offer_keys(|| packed);
        let Some(Work::Sort(b)) = w.next() else { panic!("a batch to sort") };
        assert_eq!(w.bytes(), 7, "held until sorted");
        w.sorted(b, 0);
        assert_eq!(w.bytes(), 0);
    }

    /// Exist batches waiting for a warmer are held within the budget: past
    /// it a batch is dropped and counted; a batch sorted lets its bytes go.
    #[test]
    fn queued_batches_are_held_within_the_budget() {
        let budget = 1 << 20;
        let w = Warmer::new(budget);
        let keys: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 1000]).collect();
        let batch = || encode_keys(keys.iter().map(|k| &k[..]));
        let size = batch().capacity() as u64;
        assert_eq!(size, 64 * 1002, "packed in a buffer of its length");
        // No warmer runs: every batch offered stays queued, or is dropped.
        for _ in 0..50 {
            w.offer_keys(batch);
        }
        let held = budget / size;
        assert_eq!(held, 16);
        assert_eq!(w.bytes(), held * size);
        assert!(w.bytes() <= budget);
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 50 - held, "the excess dropped and counted");
        // A batch being sorted still holds its bytes; once sorted, room
        // for one more.
        let Some(Work::Sort(b)) = w.next() else { panic!("a batch to sort") };
        w.offer_keys(batch);
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 51 - held);
        w.sorted(b, 1);
        assert_eq!(w.bytes(), (held - 1) * size);
        w.offer_keys(batch);
        assert_eq!(w.bytes(), held * size);
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 51 - held);
        // Pages offered by a sort share the budget with the batches held.
        w.offer(b"page", budget);
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 52 - held);
        // Small batches are still bounded by count.
        let w = Warmer::new(budget);
        for _ in 0..MAX_BATCHES + 3 {
            w.offer_keys(|| encode_keys([&b"k"[..]].into_iter()));
        }
        assert_eq!(w.bytes(), MAX_BATCHES as u64 * 3);
        assert_eq!(w.c.skipped.load(Ordering::Relaxed), 3);
    }
}
