//! Tenants' shares of one tier (a disk, or the memory tier): which record
//! makes room for a put (docs/ARCHITECTURE.md, "Tenants").
//!
//! Without shares the tier evicts its least recently used record, as it
//! always did, and this keeps nothing. With shares it keeps one recency
//! list per tenant holding records here, and picks the victim so that
//!
//! 1. a tenant over its share (its bytes and the put's beyond it) gives up
//!    its own least recently used record;
//! 2. otherwise the least recently used record of the tenants holding more
//!    than their share (borrowers; a tenant without a quota has a share of
//!    0) goes: capacity lent is taken back;
//! 3. only when no tenant is over its share (shares adding up to more than
//!    the tier) does the putter lose its own, or the tier its oldest.
//!
//! So a tenant below its share never loses a record to another tenant's
//! put while any tenant is over its own.

use std::collections::HashMap;
use std::sync::Arc;

use lru::LruCache;

/// What the list keeps of a record: its size and the tick of its last use.
#[derive(Clone, Copy)]
struct Use {
    len: u64,
    tick: u64,
}

/// A tenant's records here, least recently used first.
#[derive(Default)]
struct Held {
    order: Option<LruCache<Arc<[u8]>, Use>>,
    bytes: u64,
}

impl Held {
    fn order(&mut self) -> &mut LruCache<Arc<[u8]>, Use> {
        self.order.get_or_insert_with(LruCache::unbounded)
    }

    fn oldest_tick(&self) -> Option<u64> {
        self.order.as_ref().and_then(|o| o.peek_lru()).map(|(_, u)| u.tick)
    }
}

/// The record to evict, and whether it goes for another tenant's put.
pub struct Victim {
    pub key: Arc<[u8]>,
    /// True when its tenant is not the putter's (capacity taken back).
    pub for_another: bool,
}

#[derive(Default)]
pub struct Shares {
    /// Bytes of this tier each tenant with a quota may keep; empty: off.
    share: HashMap<u32, u64>,
    held: HashMap<u32, Held>,
    tick: u64,
}

impl Shares {
    pub fn active(&self) -> bool {
        !self.share.is_empty()
    }

    pub fn share_of(&self, tenant: u32) -> Option<u64> {
        self.share.get(&tenant).copied()
    }

    /// Sets the shares; `records` (tenant, key, bytes), least recently
    /// used first, is the tier's content, read only when shares turn on.
    pub fn set(&mut self, share: HashMap<u32, u64>, records: impl FnOnce() -> Vec<(u32, Arc<[u8]>, u64)>) {
        let was = self.active();
        self.share = share;
        if !self.active() {
            self.held.clear();
            return;
        }
        if !was {
            self.held.clear();
            for (t, k, len) in records() {
                self.entered(t, k, len);
            }
        }
    }

    pub fn entered(&mut self, tenant: u32, key: Arc<[u8]>, len: u64) {
        if !self.active() {
            return;
        }
        self.tick += 1;
        let h = self.held.entry(tenant).or_default();
        if let Some(old) = h.order().put(key, Use { len, tick: self.tick }) {
            h.bytes -= old.len;
        }
        h.bytes += len;
    }

    /// A read (or a memory-tier hit) made the record the tenant's newest.
    pub fn used(&mut self, tenant: u32, key: &[u8]) {
        if !self.active() {
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(u) = self.held.get_mut(&tenant).and_then(|h| h.order().get_mut(key)) {
            u.tick = tick;
        }
    }

    pub fn left(&mut self, tenant: u32, key: &[u8]) {
        if !self.active() {
            return;
        }
        if let Some(h) = self.held.get_mut(&tenant) {
            if let Some(u) = h.order().pop(key) {
                h.bytes -= u.len;
            }
            if h.bytes == 0 && h.order.as_ref().is_some_and(|o| o.is_empty()) {
                self.held.remove(&tenant);
            }
        }
    }

    pub fn clear(&mut self) {
        self.held.clear();
    }

    /// The record to evict for a put of `need` bytes by `putter` (module
    /// docs); None when shares are off or nothing is held. The caller
    /// removes it (and calls [`Shares::left`]).
    pub fn victim(&self, putter: u32, need: u64) -> Option<Victim> {
        if !self.active() {
            return None;
        }
        let bytes = |t: u32| self.held.get(&t).map_or(0, |h| h.bytes);
        let oldest_of = |t: u32| {
            self.held.get(&t).and_then(|h| h.order.as_ref()).and_then(|o| o.peek_lru()).map(|(k, _)| k.clone())
        };
        // 1. Over its own share: its own oldest.
        if let Some(s) = self.share_of(putter) {
            if bytes(putter) + need > s {
                if let Some(key) = oldest_of(putter) {
                    return Some(Victim { key, for_another: false });
                }
            }
        }
        // 2. The oldest of the borrowers.
        let borrower = self
            .held
            .iter()
            .filter(|(t, h)| h.bytes > self.share_of(**t).unwrap_or(0))
            .filter_map(|(t, h)| h.oldest_tick().map(|tick| (tick, *t)))
            .min();
        if let Some((_, t)) = borrower {
            return oldest_of(t).map(|key| Victim { key, for_another: t != putter });
        }
        // 3. Shares beyond the tier: the putter's own, else the oldest.
        if let Some(key) = oldest_of(putter) {
            return Some(Victim { key, for_another: false });
        }
        let (_, t) = self.held.iter().filter_map(|(t, h)| h.oldest_tick().map(|tick| (tick, *t))).min()?;
        oldest_of(t).map(|key| Victim { key, for_another: t != putter })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Arc<[u8]> {
        Arc::from(s.as_bytes())
    }

    #[test]
    fn a_tenant_over_its_share_evicts_its_own_then_borrowers_give_back() {
        let mut s = Shares::default();
        assert!(s.victim(1, 10).is_none(), "off: the tier's LRU decides");
        s.set([(1, 40), (2, 40)].into_iter().collect(), Vec::new);
        // 2 holds 20 (below 40); 1 fills the rest and more.
        s.entered(2, key("b0"), 10);
        s.entered(2, key("b1"), 10);
        for i in 0..8 {
            s.entered(1, key(&format!("a{i}")), 10);
        }
        // 1 is at 80 > 40: its puts take its own oldest.
        let v = s.victim(1, 10).unwrap();
        assert_eq!((&v.key[..], v.for_another), (&b"a0"[..], false));
        // 2 is below its share: its put takes 1's oldest (borrowed room).
        let v = s.victim(2, 10).unwrap();
        assert_eq!((&v.key[..], v.for_another), (&b"a0"[..], true));
        // A read makes a record its tenant's newest.
        s.used(1, b"a0");
        assert_eq!(&s.victim(2, 10).unwrap().key[..], b"a1");
        s.left(1, b"a1");
        assert_eq!(&s.victim(1, 10).unwrap().key[..], b"a2");
        // A tenant without a quota is a borrower of everything.
        s.entered(3, key("c0"), 10);
        s.used(1, b"a2");
        s.used(1, b"a3");
        s.used(1, b"a4");
        s.used(1, b"a5");
        s.used(1, b"a6");
        s.used(1, b"a7");
        s.used(1, b"a0");
        assert_eq!(&s.victim(2, 10).unwrap().key[..], b"c0");
        // Shares off: nothing kept.
        s.set(HashMap::new(), Vec::new);
        assert!(s.victim(1, 10).is_none());
    }

    #[test]
    fn shares_beyond_the_tier_fall_back_to_the_putters_own() {
        let mut s = Shares::default();
        s.set([(1, 100), (2, 100)].into_iter().collect(), || vec![(2, key("b0"), 30), (1, key("a0"), 30)]);
        // Nobody is over: 1's put takes 1's own, 3's (no records) the oldest.
        assert_eq!(&s.victim(1, 10).unwrap().key[..], b"a0");
        let v = s.victim(3, 10).unwrap();
        assert_eq!((&v.key[..], v.for_another), (&b"b0"[..], true));
    }
}
