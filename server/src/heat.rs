//! Hot keys (docs/ARCHITECTURE.md, "Hot keys"): the node counts the reads
//! it serves per key in windows of `--hot-window-ms`, and a key read at
//! least a window's threshold is *hot*: its answers carry a mark and a
//! spread, the number of nodes its reads should be spread over
//! (docs/PROTOCOL.md §2.3 and §2.5). The threshold follows the node's own
//! load: a quarter of the reads of the keys that are not hot in the
//! window before (so a key is hot when it alone is a sizeable part of a
//! node's work), at least `--hot-reads`. A hot key's spread is its reads
//! over that threshold, so every copy carries about a threshold's reads.
//! A key stays hot while it is read that much, and is forgotten after
//! [`LINGER_WINDOWS`] windows below it.
//!
//! Counting costs a get two relaxed atomic additions (a count-min sketch
//! of two rows) and, while some key is hot, one lookup under a lock; the
//! hot set is bounded by [`MAX_HOT_KEYS`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Counters a row of the sketch has.
const WIDTH: usize = 1 << 13;
/// Keys held hot at once, at most; past it a key that turns hot is not
/// marked (and counted in `hot_refused`).
pub const MAX_HOT_KEYS: usize = 1024;
/// The largest spread a node asks for.
pub const MAX_SPREAD: u8 = 64;
/// Windows a hot key may be read less than the threshold before it is
/// forgotten.
pub const LINGER_WINDOWS: u32 = 5;
/// The share of the node's reads of keys not hot that makes one key hot.
const HOT_SHARE: f64 = 0.25;

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
    reads: AtomicU64,
    threshold: AtomicU32,
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
        Heat {
            cfg,
            rows: (0..2 * WIDTH).map(|_| AtomicU32::new(0)).collect(),
            reads: AtomicU64::new(0),
            threshold: AtomicU32::new(cfg.min_reads.max(1)),
            hot: Mutex::new(HashMap::new()),
            hot_len: AtomicUsize::new(0),
            window: Mutex::new(Window { started: Instant::now() }),
            hot_reads: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// A read of `key` served: counted; the spread to mark its answer with
    /// (0: not hot).
    pub fn read(&self, key: &[u8]) -> u8 {
        if self.cfg.min_reads == 0 {
            return 0;
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        let h = kv_common::page::key_hash(key);
        let a = (h as usize) % WIDTH;
        let b = WIDTH + ((h >> 32) as usize) % WIDTH;
        let est = (self.rows[a].fetch_add(1, Ordering::Relaxed).saturating_add(1))
            .min(self.rows[b].fetch_add(1, Ordering::Relaxed).saturating_add(1));
        let threshold = self.threshold.load(Ordering::Relaxed);
        if self.hot_len.load(Ordering::Relaxed) == 0 && est < threshold {
            return 0;
        }
        let mut hot = lock(&self.hot);
        if let Some(k) = hot.get_mut(key) {
            k.reads = k.reads.saturating_add(1);
            self.hot_reads.fetch_add(1, Ordering::Relaxed);
            return k.spread;
        }
        if est < threshold {
            return 0;
        }
        if hot.len() >= MAX_HOT_KEYS {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        let spread = spread_of(u64::from(est), u64::from(threshold));
        hot.insert(key.into(), HotKey { spread, reads: est, cool: 0 });
        self.hot_len.store(hot.len(), Ordering::Relaxed);
        self.marked.fetch_add(1, Ordering::Relaxed);
        self.hot_reads.fetch_add(1, Ordering::Relaxed);
        spread
    }

    /// The spread a key is marked with now (0: not hot), without counting
    /// a read: for exists.
    pub fn spread(&self, key: &[u8]) -> u8 {
        if self.hot_len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        lock(&self.hot).get(key).map_or(0, |k| k.spread)
    }

    /// Ends the window when it is due (the node's upkeep calls it every
    /// second): the next threshold from this window's reads, each hot
    /// key's spread from its reads, and the keys read less forgotten.
    pub fn tick(&self, now: Instant) {
        let mut w = lock(&self.window);
        if now.saturating_duration_since(w.started) < self.cfg.window {
            return;
        }
        w.started = now;
        let reads = self.reads.swap(0, Ordering::Relaxed);
        for c in self.rows.iter() {
            c.store(0, Ordering::Relaxed);
        }
        let mut hot = lock(&self.hot);
        let hot_reads: u64 = hot.values().map(|k| u64::from(k.reads)).sum();
        let cold = reads.saturating_sub(hot_reads);
        let threshold =
            ((cold as f64 * HOT_SHARE) as u64).clamp(u64::from(self.cfg.min_reads.max(1)), u64::from(u32::MAX));
        hot.retain(|_, k| {
            if u64::from(k.reads) >= threshold {
                k.spread = spread_of(u64::from(k.reads), threshold);
                k.cool = 0;
            } else {
                k.cool += 1;
            }
            k.reads = 0;
            k.cool < LINGER_WINDOWS
        });
        self.hot_len.store(hot.len(), Ordering::Relaxed);
        self.threshold.store(threshold as u32, Ordering::Relaxed);
    }

    pub fn stats(&self) -> HeatStats {
        HeatStats {
            hot_keys: self.hot_len.load(Ordering::Relaxed) as u64,
            hot_reads: self.hot_reads.load(Ordering::Relaxed),
            hot_marked: self.marked.load(Ordering::Relaxed),
            hot_refused: self.refused.load(Ordering::Relaxed),
            threshold: u64::from(self.threshold.load(Ordering::Relaxed)),
        }
    }
}

/// Nodes to spread `reads` over so each gets about `threshold`: 2 to
/// [`MAX_SPREAD`].
fn spread_of(reads: u64, threshold: u64) -> u8 {
    reads.div_ceil(threshold.max(1)).clamp(2, u64::from(MAX_SPREAD)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heat(min_reads: u32) -> Heat {
        Heat::new(HeatConfig { window: Duration::from_secs(1), min_reads })
    }

    #[test]
    fn a_key_read_past_the_threshold_is_marked_and_others_are_not() {
        let h = heat(10);
        for _ in 0..9 {
            assert_eq!(h.read(b"hot"), 0);
            assert_eq!(h.read(b"cold"), 0);
        }
        assert_eq!(h.read(b"hot"), 2, "the 10th read makes it hot, spread at least 2");
        assert_eq!(h.spread(b"hot"), 2);
        assert_eq!(h.spread(b"cold"), 0);
        let s = h.stats();
        assert_eq!((s.hot_keys, s.hot_marked, s.hot_reads), (1, 1, 1));
    }

    #[test]
    fn the_spread_follows_the_reads_against_the_nodes_other_load_and_hot_state_expires() {
        let h = heat(4);
        let t0 = Instant::now();
        // Window 1: 400 reads of "p", 100 of 100 other keys.
        for i in 0..100 {
            h.read(format!("k{i}").as_bytes());
        }
        for _ in 0..400 {
            h.read(b"p");
        }
        h.tick(t0 + Duration::from_secs(1));
        // Threshold: a quarter of the 100 cold reads = 25; "p": 400/25 = 16.
        assert_eq!(h.stats().threshold, 25);
        assert_eq!(h.spread(b"p"), 16);
        // Read less: the spread shrinks with the reads.
        for _ in 0..60 {
            h.read(b"p");
        }
        for i in 0..100 {
            h.read(format!("k{i}").as_bytes());
        }
        h.tick(t0 + Duration::from_secs(2));
        assert_eq!(h.spread(b"p"), 3, "60 reads over a threshold of 25");
        // Not read at all: forgotten after LINGER_WINDOWS windows.
        for w in 0..LINGER_WINDOWS {
            assert_eq!(h.spread(b"p"), 3, "still hot in window {w}");
            h.tick(t0 + Duration::from_secs(3 + u64::from(w)));
        }
        assert_eq!(h.spread(b"p"), 0);
        assert_eq!(h.stats().hot_keys, 0);
        // A tick before the window ends changes nothing.
        h.read(b"q");
        h.tick(t0 + Duration::from_secs(3 + u64::from(LINGER_WINDOWS)) + Duration::from_millis(10));
        assert_eq!(h.stats().threshold, 4, "no cold reads: the floor");
    }

    #[test]
    fn the_hot_set_is_bounded_and_marking_can_be_off() {
        let h = heat(1);
        for i in 0..MAX_HOT_KEYS + 10 {
            h.read(format!("k{i}").as_bytes());
        }
        let s = h.stats();
        assert_eq!(s.hot_keys, MAX_HOT_KEYS as u64);
        assert_eq!(s.hot_refused, 10);
        let off = heat(0);
        for _ in 0..1000 {
            assert_eq!(off.read(b"p"), 0);
        }
        assert_eq!(off.stats(), HeatStats { threshold: 1, ..HeatStats::default() });
    }
}
