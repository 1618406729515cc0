//! Hot keys' reads spread over nodes (docs/ARCHITECTURE.md, "Hot keys").
//!
//! A key's owner marks it hot in its answers, with a spread: the nodes its
//! reads should go to, the owner first and then the next distinct members
//! on the ring ([`kv_common::ring::Ring::owners`]), all computable from the
//! view alone. This handle remembers the keys its owners marked (at most
//! [`MAX_HOT_KEYS`], each for [`HOT_TTL`] after the owner last said so, and
//! forgotten at once when the owner answers it unmarked) and sends their
//! reads to those nodes in turn. A read at the owner tells it the spread,
//! so that the owner goes on counting the key's reads as they are.
//!
//! Any node of the spread holds the page once one read there missed and
//! the page was read at the owner: the client copies it there as a
//! handoff copy (a PUT with FLAG_HANDOFF), which the node refuses when the
//! key was deleted meanwhile. A key names its bytes for good, so a copy is
//! the page, and every copy read is checked as any page is.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::HotCounters;

/// Hot keys one handle remembers at once; past it, a key newly marked is
/// not spread by this handle (its reads go to its owner, as today).
pub const MAX_HOT_KEYS: usize = 4096;

/// How long a key stays hot for this handle after its owner last marked it.
pub const HOT_TTL: Duration = Duration::from_secs(5);

/// How often, at most, the keys past their hold are dropped all at once
/// (while any are held): a key no longer read leaves within this after
/// its hold, so a handle whose keys all cooled is back to one relaxed
/// load a read and its batches to no routing per item.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Entry {
    spread: u8,
    until: Instant,
    /// Reads routed so far: the next goes to node `turn % spread`.
    turn: u32,
}

/// The keys this handle spreads the reads of.
pub(crate) struct HotKeys {
    map: Mutex<HashMap<Box<[u8]>, Entry>>,
    /// Entries in the map (read without the lock: a handle with no hot key
    /// pays one relaxed load a read).
    len: AtomicUsize,
    /// Entries in the map per slot of their key's hash (changed under the
    /// map's lock, read without it): a read of a key whose slot is empty,
    /// nearly every cold key while a few are hot, takes no lock.
    slots: Box<[AtomicU16]>,
    counters: Arc<HotCounters>,
    /// When the next sweep of expired keys is due, in ns after `base`.
    sweep_at: AtomicU64,
    base: Instant,
}

/// Slots of [`HotKeys::slots`] (32 KiB a handle).
const FILTER_SLOTS: usize = 1 << 14;

fn slot_of(key: &[u8]) -> usize {
    (kv_common::ring::key_point(key) % FILTER_SLOTS as u64) as usize
}

impl HotKeys {
    pub(crate) fn new(counters: Arc<HotCounters>) -> HotKeys {
        HotKeys {
            map: Mutex::new(HashMap::new()),
            len: AtomicUsize::new(0),
            slots: (0..FILTER_SLOTS).map(|_| AtomicU16::new(0)).collect(),
            counters,
            sweep_at: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    /// Drops the keys past their hold, at most once per [`SWEEP_EVERY`]
    /// (callers only while some key is held).
    fn sweep_if_due(&self, now: Instant) {
        let at = self.sweep_at.load(Ordering::Relaxed);
        let since = now.saturating_duration_since(self.base).as_nanos() as u64;
        if since < at {
            return;
        }
        let next = since + SWEEP_EVERY.as_nanos() as u64;
        // One caller sweeps; the others go on.
        if self.sweep_at.compare_exchange(at, next, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return;
        }
        let mut map = self.lock();
        self.drop_expired(&mut map, now);
    }

    /// Under the map's lock: drops the keys past their hold.
    fn drop_expired(&self, map: &mut HashMap<Box<[u8]>, Entry>, now: Instant) {
        let before = map.len();
        map.retain(|k, e| {
            let keep = e.until > now;
            if !keep {
                self.count(k, false);
            }
            keep
        });
        if map.len() != before {
            self.publish(map.len());
        }
    }

    /// Whether `key` may be in the map (false: it is not), without the lock.
    fn may_hold(&self, key: &[u8]) -> bool {
        self.len.load(Ordering::Relaxed) > 0 && self.slots[slot_of(key)].load(Ordering::Relaxed) > 0
    }

    /// Under the map's lock: `key` entered the map, or left it.
    fn count(&self, key: &[u8], entered: bool) {
        let s = &self.slots[slot_of(key)];
        if entered {
            s.fetch_add(1, Ordering::Relaxed);
        } else {
            s.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<[u8]>, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, n: usize) {
        self.len.store(n, Ordering::Relaxed);
        self.counters.keys.store(n as u64, Ordering::Relaxed);
    }

    /// What the owner of `key` answered a read with: hot with `spread`
    /// (kept for [`HOT_TTL`] more), or not hot (0: forgotten now).
    pub(crate) fn noted(&self, key: &[u8], spread: u8) {
        if spread == 0 && !self.may_hold(key) {
            return;
        }
        let now = Instant::now();
        let mut map = self.lock();
        if spread == 0 {
            if map.remove(key).is_some() {
                self.count(key, false);
                self.publish(map.len());
            }
            return;
        }
        if let Some(e) = map.get_mut(key) {
            e.spread = spread;
            e.until = now + HOT_TTL;
            return;
        }
        if map.len() >= MAX_HOT_KEYS {
            self.drop_expired(&mut map, now);
            if map.len() >= MAX_HOT_KEYS {
                return;
            }
        }
        // Turns start at 1: the read that follows a mark goes to another
        // node than the owner, which has just been read.
        map.insert(key.into(), Entry { spread, until: now + HOT_TTL, turn: 1 });
        self.count(key, true);
        self.publish(map.len());
    }

    /// For a read of `key` now: its spread and this read's turn, or None
    /// when the key is not hot (or no longer).
    pub(crate) fn turn(&self, key: &[u8]) -> Option<(u8, u32)> {
        if !self.may_hold(key) {
            return None;
        }
        let now = Instant::now();
        self.sweep_if_due(now);
        let mut map = self.lock();
        let e = map.get_mut(key)?;
        if e.until <= now {
            map.remove(key);
            self.count(key, false);
            self.publish(map.len());
            return None;
        }
        let t = e.turn;
        e.turn = e.turn.wrapping_add(1);
        Some((e.spread, t))
    }

    /// Whether this handle holds any key hot (one relaxed load when none
    /// is; with some held, keys past their hold are dropped first, once a
    /// second at most).
    pub(crate) fn any(&self) -> bool {
        if self.len.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.sweep_if_due(Instant::now());
        self.len.load(Ordering::Relaxed) > 0
    }

    /// Whether `key` is hot for this handle (no turn taken).
    pub(crate) fn is_hot(&self, key: &[u8]) -> bool {
        if !self.may_hold(key) {
            return false;
        }
        self.lock().get(key).is_some_and(|e| e.until > Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_kept_turned_forgotten_and_bounded() {
        let h = HotKeys::new(Arc::default());
        assert_eq!(h.turn(b"k"), None);
        h.noted(b"k", 0);
        assert_eq!(h.turn(b"k"), None, "an unmarked answer adds nothing");
        h.noted(b"k", 4);
        assert!(h.is_hot(b"k"));
        let turns: Vec<u32> = (0..5).map(|_| h.turn(b"k").unwrap().1).collect();
        assert_eq!(turns, [1, 2, 3, 4, 5], "each read takes the next turn");
        h.noted(b"k", 3);
        assert_eq!(h.turn(b"k"), Some((3, 6)), "a new spread keeps the turns going");
        h.noted(b"k", 0);
        assert_eq!(h.turn(b"k"), None, "the owner says it is no longer hot");
        assert_eq!(h.counters.keys.load(Ordering::Relaxed), 0);
        assert!(h.slots.iter().all(|s| s.load(Ordering::Relaxed) == 0), "its slot emptied");
        for i in 0..MAX_HOT_KEYS + 10 {
            h.noted(format!("k{i}").as_bytes(), 2);
        }
        assert_eq!(h.len.load(Ordering::Relaxed), MAX_HOT_KEYS, "bounded");
        assert!(!h.is_hot(format!("k{}", MAX_HOT_KEYS + 1).as_bytes()));
        // Expired entries make room.
        h.lock().values_mut().for_each(|e| e.until = Instant::now());
        h.noted(b"new", 2);
        assert!(h.is_hot(b"new"));
        assert_eq!(h.len.load(Ordering::Relaxed), 1);
        let held: u32 = h.slots.iter().map(|s| u32::from(s.load(Ordering::Relaxed))).sum();
        assert_eq!(held, 1, "the slots count the keys held");
        // A key never read again leaves by the sweep, not by its own read.
        h.lock().values_mut().for_each(|e| e.until = Instant::now());
        h.sweep_at.store(0, Ordering::Relaxed);
        assert!(!h.any(), "every key past its hold: none held");
        assert_eq!(h.counters.keys.load(Ordering::Relaxed), 0);
        assert!(h.slots.iter().all(|s| s.load(Ordering::Relaxed) == 0));
    }

    /// The routing rule over a member list (no network): a hot key's reads
    /// go in turn to the first `spread` members from its owner, the owner
    /// told the spread; a node cooling down is passed over; with the
    /// handoff off nothing is spread.
    #[test]
    fn a_hot_keys_reads_take_the_members_from_its_owner_in_turn() {
        let members =
            crate::members::parse_members("a=127.0.0.1:9,b=127.0.0.1:9,c=127.0.0.1:9,d=127.0.0.1:9,e=127.0.0.1:9")
                .unwrap();
        let c = crate::Client::new(members.clone(), kv_common::page::Geometry::default(), Default::default());
        let t = c.topology();
        let order = t.ring.owners(b"k", 3);
        let owner = order[0];
        let cold = c.read_route(&t, b"k").unwrap();
        assert_eq!((cold.owner, cold.copy, cold.weight), (owner, None, 0));
        c.note_hot(b"k", 3);
        let seen: Vec<(Option<usize>, u8)> = (0..6)
            .map(|_| {
                let r = c.read_route(&t, b"k").unwrap();
                (r.copy, r.weight)
            })
            .collect();
        let (o1, o2) = (Some(order[1]), Some(order[2]));
        let want = [(o1, 0), (o2, 0), (None, 3), (o1, 0), (o2, 0), (None, 3)];
        assert_eq!(seen, want, "the owner's successors, then the owner told the spread, in turn");
        assert_eq!(c.read_route(&t, b"other").unwrap().copy, None, "other keys stay at their owners");
        // A spread wider than the group is the group: the owner's turn
        // comes every 5th read and stands for 5.
        c.note_hot(b"wide", 64);
        let weights: Vec<u8> = (0..5).map(|_| c.read_route(&t, b"wide").unwrap().weight).collect();
        assert_eq!(weights, [0, 0, 0, 0, 5]);
        // A member cooling down: its turns go to the owner, as one read
        // each (the owner's own turn still stands for the spread).
        t.nodes[order[1]].mark_failed(std::time::Duration::from_secs(60));
        let seen: Vec<(Option<usize>, u8)> = (0..3)
            .map(|_| {
                let r = c.read_route(&t, b"k").unwrap();
                (r.copy, r.weight)
            })
            .collect();
        assert_eq!(seen.iter().filter(|s| s.0 == Some(order[1])).count(), 0, "{seen:?}");
        assert!(seen.contains(&(Some(order[2]), 0)));
        assert!(seen.contains(&(None, 0)) && seen.contains(&(None, 3)), "{seen:?}");
        // Handoff off: nothing is noted or spread.
        let off = crate::Options { handoff: std::time::Duration::ZERO, ..Default::default() };
        let c = crate::Client::new(members, kv_common::page::Geometry::default(), off);
        c.note_hot(b"k", 3);
        let t = c.topology();
        assert!((0..4).all(|_| c.read_route(&t, b"k").unwrap().copy.is_none()));
        assert!(!c.is_hot_key(b"k"));
    }
}
