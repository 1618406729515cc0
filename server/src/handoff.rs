//! The node's side of ring handoff (docs/ARCHITECTURE.md, "Ring
//! transitions"): tombstones of keys deleted within the handoff window, so a
//! copy of a page read from a previous owner before the delete (a put with
//! FLAG_HANDOFF) is refused instead of bringing the page back; and the
//! counters of handoff asks and copies.
//!
//! A copy checks the tombstones before it is stored and again after: a
//! delete records its tombstone before it removes the key, so either the
//! copy sees the tombstone (and is refused, or removes what it stored), or
//! the delete comes after the copy was stored and removes it. No lock is
//! held across the store.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most tombstones kept; past it the oldest goes, and every handoff copy is
/// refused until that one would have expired (never a page brought back).
pub const MAX_TOMBSTONES: usize = 1 << 20;

/// Most expired tombstones dropped by one call.
const EXPIRE_STEP: usize = 1024;

#[derive(Default)]
struct Tombs {
    /// Key hash -> time of its latest delete.
    at: HashMap<u64, Instant>,
    /// Deletes in time order (key hash, time); entries superseded by a later
    /// delete of the same key are skipped when they come up.
    order: VecDeque<(u64, Instant)>,
    /// While set: copies are refused (a tombstone was dropped at the cap).
    refuse_until: Option<Instant>,
}

pub struct Handoff {
    /// How long a delete refuses copies (`--handoff-secs`); zero: the node
    /// keeps no tombstones and refuses every copy.
    pub window: Duration,
    tombs: Mutex<Tombs>,
    /// GET and EXIST keys asked with FLAG_HANDOFF, and those found.
    pub asks: AtomicU64,
    pub hits: AtomicU64,
    /// Copies stored (new or already there), their payload bytes, and
    /// copies refused for a delete within the window.
    pub copies: AtomicU64,
    pub copy_bytes: AtomicU64,
    pub refused: AtomicU64,
    /// Pages this node pushed to their new owners while it drained, their
    /// record bytes, and pushes the owners refused (drain.rs).
    pub pushed: AtomicU64,
    pub pushed_bytes: AtomicU64,
    pub push_failed: AtomicU64,
    /// Pages not delivered because their owner could not be reached or
    /// stopped answering; pages left when the drain ended; owners that had
    /// pages of this node's.
    pub push_failed_owner: AtomicU64,
    pub push_left: AtomicU64,
    pub push_owners: AtomicU64,
    /// Set when the drain ends: pushing stops.
    pub push_stop: std::sync::atomic::AtomicBool,
}

impl Handoff {
    pub fn new(window: Duration) -> Handoff {
        Handoff {
            window,
            tombs: Mutex::default(),
            asks: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            copy_bytes: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            pushed: AtomicU64::new(0),
            pushed_bytes: AtomicU64::new(0),
            push_failed: AtomicU64::new(0),
            push_failed_owner: AtomicU64::new(0),
            push_left: AtomicU64::new(0),
            push_owners: AtomicU64::new(0),
            push_stop: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Drops expired tombstones, a bounded number per call (the lock is
    /// taken on the data path; a burst of deletes expires over many calls).
    fn expire(&self, t: &mut Tombs, now: Instant) {
        for _ in 0..EXPIRE_STEP {
            let Some(&(k, at)) = t.order.front() else { break };
            if now.duration_since(at) < self.window {
                break;
            }
            t.order.pop_front();
            if t.at.get(&k) == Some(&at) {
                t.at.remove(&k);
            }
        }
        if t.refuse_until.is_some_and(|u| u <= now) {
            t.refuse_until = None;
        }
    }

    /// Records a delete of the key whose hash is `key_hash` (before the key
    /// is removed from the store).
    pub fn deleted(&self, key_hash: u64) {
        if self.window.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut t = self.tombs.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut t, now);
        t.at.insert(key_hash, now);
        t.order.push_back((key_hash, now));
        while t.order.len() > MAX_TOMBSTONES {
            let Some((k, at)) = t.order.pop_front() else { break };
            if t.at.get(&k) == Some(&at) {
                t.at.remove(&k);
                let until = at + self.window;
                t.refuse_until = Some(t.refuse_until.map_or(until, |u| u.max(until)));
            }
        }
    }

    /// Whether a handoff copy of this key must be refused.
    pub fn refuses(&self, key_hash: u64) -> bool {
        if self.window.is_zero() {
            return true;
        }
        let now = Instant::now();
        let mut t = self.tombs.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut t, now);
        // An entry not yet expired by the bounded sweep is judged by its time.
        t.refuse_until.is_some() || t.at.get(&key_hash).is_some_and(|&at| now.duration_since(at) < self.window)
    }

    /// Tombstones held now (expired ones not yet dropped included).
    pub fn tombstones(&self) -> u64 {
        let mut t = self.tombs.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut t, Instant::now());
        t.at.len() as u64
    }

    pub fn count_asks(&self, asked: usize, found: usize) {
        self.asks.fetch_add(asked as u64, Ordering::Relaxed);
        self.hits.fetch_add(found as u64, Ordering::Relaxed);
    }
}

/// The request header's age field of a copy read `age` ago
/// (docs/PROTOCOL.md §2.4).
pub fn copy_age_field(_age: Duration) -> u16 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_refuses_copies_for_the_window() {
        let h = Handoff::new(Duration::from_millis(200));
        assert!(!h.refuses(7));
        h.deleted(7);
        assert!(h.refuses(7) && !h.refuses(8));
        assert_eq!(h.tombstones(), 1);
        std::thread::sleep(Duration::from_millis(250));
        assert!(!h.refuses(7));
        assert_eq!(h.tombstones(), 0);
    }

    #[test]
    fn a_later_delete_of_the_same_key_keeps_its_tombstone() {
        let h = Handoff::new(Duration::from_millis(300));
        h.deleted(1);
        std::thread::sleep(Duration::from_millis(200));
        h.deleted(1);
        std::thread::sleep(Duration::from_millis(150));
        // The first delete's entry expired; the second's still holds.
        assert!(h.refuses(1));
        assert_eq!(h.tombstones(), 1);
    }

    #[test]
    fn off_refuses_every_copy_and_keeps_nothing() {
        let h = Handoff::new(Duration::ZERO);
        h.deleted(1);
        assert!(h.refuses(2));
        assert_eq!(h.tombstones(), 0);
    }

    #[test]
    fn past_the_cap_every_copy_is_refused_until_the_dropped_one_expires() {
        let h = Handoff::new(Duration::from_secs(60));
        for k in 0..(MAX_TOMBSTONES as u64 + 1) {
            h.deleted(k);
        }
        assert_eq!(h.tombstones(), MAX_TOMBSTONES as u64);
        assert!(h.refuses(u64::MAX), "a tombstone was dropped: nothing may come back");
    }
}
