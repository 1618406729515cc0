//! Hot keys (docs/ARCHITECTURE.md, "Hot keys"): the node counts the reads
//! it serves per key in windows of `--hot-window-ms`, and a key read at
//! least a window's threshold is *hot*: its answers carry a mark and a
//! spread, the number of nodes its reads should be spread over
//! (docs/PROTOCOL.md §2.3 and §2.5). The threshold follows the node's own
//! load: an eighth of all its reads in the window before (so a key is hot
//! when it alone is a sizeable part of the node's work, and reads spread
//! evenly over many keys mark none), at least `--hot-reads`; nothing is
//! marked before a first window has ended. A hot key's spread is its reads
//! over an eighth of the node's other reads ([`spread_of`]); a read a client
//! spreads counts as the reads it stands for. A key stays hot while it is
//! read that much, and is forgotten after [`LINGER_WINDOWS`] windows below it.
//!
//! Counting costs a get three relaxed atomic additions (the window's reads
//! and a count-min sketch of two rows) and a bit test (a filter of the hot
//! keys' hashes); only a key whose bit is set, or whose count crossed the
//! threshold, takes the lock of the hot set, which is bounded by
//! [`MAX_HOT_KEYS`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Counters a row of the sketch has.
const WIDTH: usize = 1 << 13;
/// Keys held hot at once, at most; past it a key that turns hot is not
/// marked (each such read is counted in `hot_refused`). A key must take an
/// eighth of the reads, so under steady load at most 8 keys turn hot a
/// window (more while the load grows, and lingering keys add up): the
/// bound is a safety net.
pub const MAX_HOT_KEYS: usize = 1024;
/// The largest spread a node asks for.
pub use kv_common::wire::MAX_SPREAD;
/// Windows a hot key may be read less than the threshold before it is
/// forgotten.
pub const LINGER_WINDOWS: u32 = 5;
/// The share of a node's reads in a window that makes one key hot (1/8).
const HOT_SHARE_DIV: u64 = 8;
/// Bits of the filter of hot keys' hashes.
const FILTER_BITS: usize = 1 << 14;

/// How a node marks hot keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeatConfig {
    pub window: Duration,
    /// Reads of one key in a window that make it hot at least (0: the
    /// node marks no key).
    pub min_reads: u32,
}

impl Default for HeatConfig {
    fn default() -> Self {
        HeatConfig { window: Duration::from_secs(1), min_reads: 64 }
    }
}

struct HotKey {
    spread: u8,
    /// Reads served in the current window.
    reads: u32,
    /// Windows in a row below the threshold.
    cool: u32,
}

struct Window {
    started: Instant,
}

/// What [`Heat`] counted, for STATS and `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HeatStats {
    pub hot_keys: u64,
    pub hot_reads: u64,
    pub hot_marked: u64,
    pub hot_refused: u64,
    pub threshold: u64,
}

pub struct Heat {
    cfg: HeatConfig,
    rows: Box<[AtomicU32]>,
    /// A bit per hash slot of a hot key (false positives only).
    filter: Box<[AtomicU64]>,
    reads: AtomicU64,
    /// Reads in the window before.
    last_reads: AtomicU64,
    threshold: AtomicU32,
    max_keys: usize,
    hot: Mutex<HashMap<Box<[u8]>, HotKey>>,
    hot_len: AtomicUsize,
    window: Mutex<Window>,
    hot_reads: AtomicU64,
    marked: AtomicU64,
    refused: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Heat {
    pub fn new(cfg: HeatConfig) -> Heat {
        Heat::with_max_keys(cfg, MAX_HOT_KEYS)
    }

    fn with_max_keys(cfg: HeatConfig, max_keys: usize) -> Heat {
        Heat {
            max_keys,
            cfg,
            rows: (0..2 * WIDTH).map(|_| AtomicU32::new(0)).collect(),
            filter: (0..FILTER_BITS / 64).map(|_| AtomicU64::new(0)).collect(),
            reads: AtomicU64::new(0),
            last_reads: AtomicU64::new(0),
            // No key is hot before a window has shown the node's load.
            threshold: AtomicU32::new(u32::MAX),
            hot: Mutex::new(HashMap::new()),
            hot_len: AtomicUsize::new(0),
            window: Mutex::new(Window { started: Instant::now() }),
            hot_reads: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// A read of `key` served, standing for `weight` reads (a client that
    /// spreads a hot key's reads over that many nodes sends its owner one
    /// of them; 1 otherwise): counted; the spread to mark its answer with
    /// (0: not hot).
    pub fn read(&self, key: &[u8], weight: u8) -> u8 {
        if self.cfg.min_reads == 0 {
            return 0;
        }
        let w = u32::from(weight.max(1));
        let so_far = self.reads.fetch_add(u64::from(w), Ordering::Relaxed) + u64::from(w);
        let h = kv_common::page::key_hash(key);
        let a = (h as usize) % WIDTH;
        let b = WIDTH + ((h >> 32) as usize) % WIDTH;
        let est = (self.rows[a].fetch_add(w, Ordering::Relaxed).saturating_add(w))
            .min(self.rows[b].fetch_add(w, Ordering::Relaxed).saturating_add(w));
        // The window before's threshold, or an eighth of this window's reads
        // so far if more: at the onset of load, reads spread over many keys
        // mark none.
        let threshold =
            self.threshold.load(Ordering::Relaxed).max((so_far / HOT_SHARE_DIV).min(u64::from(u32::MAX)) as u32);
        let bit = filter_bit(h);
        if est < threshold && self.filter[bit / 64].load(Ordering::Relaxed) & (1 << (bit % 64)) == 0 {
            return 0;
        }
        let mut hot = lock(&self.hot);
        if let Some(k) = hot.get_mut(key) {
            k.reads = k.reads.saturating_add(w);
            self.hot_reads.fetch_add(1, Ordering::Relaxed);
            return k.spread;
        }
        if est < threshold {
            return 0;
        }
        if hot.len() >= self.max_keys {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        // The node's reads in a window: the window before's, or this
        // one's so far if more.
        let base = self.last_reads.load(Ordering::Relaxed).max(so_far);
        let spread = spread_of(u64::from(est), base);
        hot.insert(key.into(), HotKey { spread, reads: est, cool: 0 });
        self.filter[bit / 64].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        self.hot_len.store(hot.len(), Ordering::Relaxed);
        self.marked.fetch_add(1, Ordering::Relaxed);
        self.hot_reads.fetch_add(1, Ordering::Relaxed);
        spread
    }

    /// The spread a key is marked with now (0: not hot), without counting
    /// a read (for tests and tools: exists are not marked).
    pub fn spread(&self, key: &[u8]) -> u8 {
        if self.hot_len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        lock(&self.hot).get(key).map_or(0, |k| k.spread)
    }

    /// Ends the window when it is due (the node calls it every 50 ms): the
    /// next threshold from this window's reads, each hot key's spread from
    /// its reads, and the keys read less than the threshold for
    /// [`LINGER_WINDOWS`] windows forgotten.
    pub fn tick(&self, now: Instant) {
        let mut w = lock(&self.window);
        if now.saturating_duration_since(w.started) < self.cfg.window {
            return;
        }
        w.started = now;
        let reads = self.reads.swap(0, Ordering::Relaxed);
        self.last_reads.store(reads, Ordering::Relaxed);
        for c in self.rows.iter() {
            c.store(0, Ordering::Relaxed);
        }
        let mut hot = lock(&self.hot);
        // Below u32::MAX, which stands for "no window ended yet".
        let threshold = (reads / HOT_SHARE_DIV).max(u64::from(self.cfg.min_reads.max(1))).min(u64::from(u32::MAX - 1));
        hot.retain(|_, k| {
            // A key cooling down is asked to be spread less at once.
            k.spread = spread_of(u64::from(k.reads), reads);
            if u64::from(k.reads) >= threshold {
                k.cool = 0;
            } else {
                k.cool += 1;
            }
            k.reads = 0;
            k.cool < LINGER_WINDOWS
        });
        for f in self.filter.iter() {
            f.store(0, Ordering::Relaxed);
        }
        for key in hot.keys() {
            let bit = filter_bit(kv_common::page::key_hash(key));
            self.filter[bit / 64].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        }
        self.hot_len.store(hot.len(), Ordering::Relaxed);
        self.threshold.store(threshold as u32, Ordering::Relaxed);
    }

    pub fn stats(&self) -> HeatStats {
        HeatStats {
            hot_keys: self.hot_len.load(Ordering::Relaxed) as u64,
            hot_reads: self.hot_reads.load(Ordering::Relaxed),
            hot_marked: self.marked.load(Ordering::Relaxed),
            hot_refused: self.refused.load(Ordering::Relaxed),
            threshold: match self.threshold.load(Ordering::Relaxed) {
                _ if self.cfg.min_reads == 0 => 0,
                u32::MAX => 0,
                t => u64::from(t),
            },
        }
    }
}

/// The bit of the hot keys' filter for a key of hash `h`.
fn filter_bit(h: u64) -> usize {
    (h >> 16) as usize % FILTER_BITS
}

/// Nodes to spread a key's `reads` over, of a node's `total` in the same
/// window, so that each of them serves at most an eighth of what the node
/// serves besides (the key's reads over an eighth of the others'): 2 to
/// [`MAX_SPREAD`]. The node's other reads stand for a node's fair load,
/// since keys are placed evenly; a key that is all a node serves (a
/// thundering herd) asks for the widest spread.
fn spread_of(reads: u64, total: u64) -> u8 {
    let others = total.saturating_sub(reads) / HOT_SHARE_DIV;
    reads.div_ceil(others.max(1)).clamp(2, u64::from(MAX_SPREAD)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracker whose first window has ended (with no reads), and when.
    fn heat(min_reads: u32) -> (Heat, Instant) {
        let h = Heat::new(HeatConfig { window: Duration::from_secs(1), min_reads });
        let t0 = Instant::now() + Duration::from_secs(1);
        h.tick(t0);
        (h, t0)
    }

    #[test]
    fn the_largest_floor_ends_windows_without_a_panic() {
        let (h, t0) = heat(u32::MAX);
        h.read(b"p", 1);
        h.tick(t0 + Duration::from_secs(1));
        assert_eq!(h.stats().threshold, u64::from(u32::MAX - 1));
    }

    #[test]
    fn nothing_is_hot_before_a_first_window_has_ended() {
        let h = Heat::new(HeatConfig { window: Duration::from_secs(1), min_reads: 4 });
        for _ in 0..100 {
            assert_eq!(h.read(b"p", 1), 0);
        }
        assert_eq!(h.stats().threshold, 0, "none yet");
    }

    #[test]
    fn a_key_read_past_the_threshold_is_marked_and_others_are_not() {
        let (h, _) = heat(10);
        for _ in 0..9 {
            assert_eq!(h.read(b"hot", 1), 0);
            assert_eq!(h.read(b"cold", 1), 0);
        }
        // Its 10 reads over an eighth of the 9 others' (1, at least).
        assert_eq!(h.read(b"hot", 1), 10, "the 10th read makes it hot");
        assert_eq!(h.spread(b"hot"), 10);
        assert_eq!(h.spread(b"cold"), 0);
        let s = h.stats();
        assert_eq!((s.hot_keys, s.hot_marked, s.hot_reads, s.threshold), (1, 1, 1, 10));
    }

    #[test]
    fn the_spread_follows_the_reads_against_the_nodes_load_and_hot_state_expires() {
        let (h, t0) = heat(4);
        // Window 2: 400 reads of "p", 400 spread over 100 other keys.
        for r in 0..4 {
            for i in 0..100 {
                assert_eq!(h.read(format!("k{i}").as_bytes(), 1), 0, "round {r}");
            }
        }
        for _ in 0..400 {
            h.read(b"p", 1);
        }
        h.tick(t0 + Duration::from_secs(1));
        // Threshold: an eighth of the 800 reads = 100. "p" took 400, the
        // others 400: spread over 400 / (400 / 8) = 8 nodes.
        assert_eq!(h.stats().threshold, 100);
        assert_eq!(h.spread(b"p"), 8);
        assert_eq!(h.stats().hot_keys, 1, "keys read 4 times are not hot");
        // Read less: the spread shrinks with the reads.
        for _ in 0..250 {
            h.read(b"p", 1);
        }
        for i in 0..100 {
            h.read(format!("k{i}").as_bytes(), 1);
        }
        h.tick(t0 + Duration::from_secs(2));
        assert_eq!(h.stats().threshold, 43, "350 reads / 8");
        assert_eq!(h.spread(b"p"), 21, "250 reads over an eighth of the other 100 (12)");
        // Not read at all: forgotten after LINGER_WINDOWS windows.
        for w in 0..LINGER_WINDOWS {
            let want = if w == 0 { 21 } else { 2 };
            assert_eq!(h.spread(b"p"), want, "still hot in window {w}, spread less once unread");
            h.tick(t0 + Duration::from_secs(3 + u64::from(w)));
        }
        assert_eq!(h.spread(b"p"), 0);
        assert_eq!(h.stats().hot_keys, 0);
        // A tick before the window ends changes nothing.
        h.read(b"q", 1);
        h.tick(t0 + Duration::from_secs(2 + u64::from(LINGER_WINDOWS)) + Duration::from_millis(10));
        assert_eq!(h.stats().threshold, 4, "no reads: the floor");
    }

    #[test]
    fn a_weighted_read_counts_as_the_reads_it_stands_for() {
        let (h, t0) = heat(8);
        // One read a client spreads over 8 nodes stands for 8: it alone
        // reaches the floor.
        assert_eq!(h.read(b"p", 8), 8, "all the node serves: spread as wide as its reads");
        for i in 0..16 {
            h.read(format!("k{i}").as_bytes(), 1);
        }
        for _ in 0..3 {
            h.read(b"p", 8);
        }
        h.tick(t0 + Duration::from_secs(1));
        // 48 reads of which "p" 32: spread 32 / (16 / 8).
        assert_eq!(h.spread(b"p"), 16);
        assert_eq!(h.stats().hot_reads, 4, "reads served, not the weights");
    }

    #[test]
    fn reads_spread_evenly_over_many_keys_mark_none() {
        let (h, t0) = heat(4);
        for w in 0..3u64 {
            for r in 0..50 {
                for i in 0..40 {
                    assert_eq!(h.read(format!("k{i}").as_bytes(), 1), 0, "window {w} round {r}");
                }
            }
            h.tick(t0 + Duration::from_secs(1 + w));
        }
        // 50 reads a key a window, 2,000 in all: the threshold is 250.
        assert_eq!(h.stats(), HeatStats { threshold: 250, ..HeatStats::default() });
    }

    #[test]
    fn the_hot_set_is_bounded_and_marking_can_be_off() {
        let h = Heat::with_max_keys(HeatConfig { window: Duration::from_secs(1), min_reads: 1 }, 4);
        h.tick(Instant::now() + Duration::from_secs(1));
        // 8 keys read in turn: each is an eighth of the reads, so each is
        // hot; 4 are marked, the others' reads counted as refused.
        let mut marked = std::collections::HashSet::new();
        for _ in 0..10 {
            for i in 0..8 {
                if h.read(format!("k{i}").as_bytes(), 1) > 0 {
                    marked.insert(i);
                }
            }
        }
        let s = h.stats();
        assert_eq!((s.hot_keys, marked.len()), (4, 4), "{s:?}");
        assert_eq!(s.hot_refused, 40, "{s:?}");
        let (off, _) = heat(0);
        for _ in 0..1000 {
            assert_eq!(off.read(b"p", 1), 0);
        }
        assert_eq!(off.stats(), HeatStats::default(), "marking off: no threshold");
    }
}
