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
//! held across the store. "What it stored" is the record its store
//! stamped (`Store::delete_if_stamp`), never whatever holds the key by
//! then: a put acknowledged after the delete stays.
//!
//! A tombstone lasts the window; a copy is refused once older than half of
//! it (its age travels in the request header, docs/PROTOCOL.md §2.9), so a
//! copy read before a delete cannot arrive after that delete's tombstone
//! expired.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most tombstones kept; past it the oldest goes, and every handoff copy is
/// refused until that one would have expired (never a page brought back).
pub const MAX_TOMBSTONES: usize = 1 << 20;

/// Most fills tracked to count the copies held ([`Handoff::copies_held`]);
/// past it a new fill is stored but not tracked (the count falls short).
pub const MAX_FILLS_TRACKED: usize = 1 << 16;

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
    /// Copies stored (new or already there), their payload bytes, copies
    /// refused for a delete within the window, and copies refused for
    /// their age (over half the window).
    pub copies: AtomicU64,
    pub copy_bytes: AtomicU64,
    pub refused: AtomicU64,
    pub too_old: AtomicU64,
    /// Of the copies stored, those that fill a node of a hot key's spread
    /// (FLAG_FILL).
    pub fills: AtomicU64,
    /// The keys of fills stored here, by key hash, while this process runs
    /// (at most [`MAX_FILLS_TRACKED`]): the copies of hot pages held are
    /// those of them still stored ([`Handoff::copies_held`]).
    filled: Mutex<HashMap<u64, Box<[u8]>>>,
    /// Tests only: run (on a blocking thread) between a copy's store and
    /// its second tombstone check, to force a delete and a put in between.
    #[doc(hidden)]
    pub after_copy_stored: std::sync::OnceLock<std::sync::Arc<dyn Fn() + Send + Sync>>,
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
            too_old: AtomicU64::new(0),
            fills: AtomicU64::new(0),
            filled: Mutex::default(),
            after_copy_stored: std::sync::OnceLock::new(),
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

    /// Counts a fill stored here: a copy of the hot page `key`
    /// (docs/ARCHITECTURE.md, "Hot keys").
    pub fn filled(&self, key_hash: u64, key: &[u8]) {
        self.fills.fetch_add(1, Ordering::Relaxed);
        let mut f = self.filled.lock().unwrap_or_else(|e| e.into_inner());
        if f.len() < MAX_FILLS_TRACKED || f.contains_key(&key_hash) {
            f.insert(key_hash, key.into());
        }
    }

    /// The copies of hot pages this node holds: the fills stored since it
    /// started whose keys `held` still finds (evicted and deleted ones are
    /// forgotten here). Blocking (`held` asks the store): call it off the
    /// reactor. A copy recovered after a restart counts as a page of its own.
    pub fn copies_held(&self, held: impl Fn(&[u8]) -> bool) -> u64 {
        let keys: Vec<(u64, Box<[u8]>)> = {
            let f = self.filled.lock().unwrap_or_else(|e| e.into_inner());
            f.iter().map(|(h, k)| (*h, k.clone())).collect()
        };
        let gone: Vec<u64> = keys.iter().filter(|(_, k)| !held(k)).map(|(h, _)| *h).collect();
        let mut f = self.filled.lock().unwrap_or_else(|e| e.into_inner());
        for h in &gone {
            f.remove(h);
        }
        f.len() as u64
    }

    /// Records a delete of the key whose hash is `key_hash` (before the key
    /// is removed from the store).
    pub fn deleted(&self, key_hash: u64) {
        self.deleted_at(key_hash, Instant::now())
    }

    /// [`Handoff::deleted`] at `now` (calls come in time order).
    fn deleted_at(&self, key_hash: u64, now: Instant) {
        if self.window.is_zero() {
            return;
        }
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
        self.refuses_at(key_hash, Instant::now())
    }

    /// [`Handoff::refuses`] at `now`.
    fn refuses_at(&self, key_hash: u64, now: Instant) -> bool {
        if self.window.is_zero() {
            return true;
        }
        let mut t = self.tombs.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut t, now);
        // An entry not yet expired by the bounded sweep is judged by its time.
        t.refuse_until.is_some() || t.at.get(&key_hash).is_some_and(|&at| now.duration_since(at) < self.window)
    }

    /// Whether a copy of this age (since its page was read) is too old to
    /// take: over half the window. A tombstone lasts the whole window, so
    /// the other half is the margin for what the age leaves out (its way
    /// here, a coarse or saturated encoding).
    pub fn too_old(&self, age: Duration) -> bool {
        age > self.window / 2
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_refuses_copies_for_the_window() {
        let h = Handoff::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!h.refuses_at(7, t0));
        h.deleted_at(7, t0);
        assert!(h.refuses_at(7, t0) && !h.refuses_at(8, t0));
        assert!(h.refuses_at(7, t0 + Duration::from_millis(9_999)));
        assert!(!h.refuses_at(7, t0 + Duration::from_secs(10)));
        assert_eq!(h.tombstones(), 0, "swept once expired");
    }

    /// A key deleted twice refuses copies until the window after its second
    /// delete, though its first tombstone expires (and is swept) before.
    #[test]
    fn a_later_delete_of_the_same_key_keeps_its_tombstone() {
        let h = Handoff::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        h.deleted_at(7, at(0));
        h.deleted_at(7, at(6));
        h.deleted_at(8, at(6));
        assert!(h.refuses_at(7, at(5)));
        assert!(h.refuses_at(7, at(11)), "the first delete's tombstone expired; the second holds");
        assert!(h.refuses_at(7, at(15)));
        assert!(!h.refuses_at(7, at(17)), "both expired");
        assert!(!h.refuses_at(8, at(17)));
        assert!(!h.refuses_at(9, at(1)), "never deleted");
    }

    /// The age limit is half the window.
    #[test]
    fn copies_older_than_half_the_window_are_too_old() {
        let h = Handoff::new(Duration::from_secs(600));
        assert!(!h.too_old(Duration::from_secs(300)));
        assert!(h.too_old(Duration::from_millis(300_001)));
        assert!(h.too_old(kv_common::wire::decode_copy_age(u16::MAX)), "saturated: at least that old");
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

    /// The copies held are the fills still stored: a fill evicted or
    /// deleted drops out when counted; a fill of a key filled before counts
    /// once; past the bound, fills are counted but not tracked.
    #[test]
    fn copies_held_are_the_fills_still_stored() {
        let h = Handoff::new(Duration::from_secs(60));
        let held = std::sync::Mutex::new(std::collections::HashSet::<Vec<u8>>::new());
        for k in [&b"a"[..], b"b", b"c", b"a"] {
            held.lock().unwrap().insert(k.to_vec());
            h.filled(kv_common::page::key_hash(k), k);
        }
        let holds = |k: &[u8]| held.lock().unwrap().contains(k);
        assert_eq!(h.fills.load(Ordering::Relaxed), 4);
        assert_eq!(h.copies_held(holds), 3);
        held.lock().unwrap().remove(&b"b"[..]);
        assert_eq!(h.copies_held(holds), 2, "evicted or deleted");
        held.lock().unwrap().insert(b"b".to_vec());
        assert_eq!(h.copies_held(holds), 2, "a page stored again is not a fill");
        for k in 0..MAX_FILLS_TRACKED as u64 {
            h.filled(k << 8 | 1, &k.to_le_bytes());
        }
        assert_eq!(h.copies_held(|_| true), MAX_FILLS_TRACKED as u64, "bounded");
    }
}
