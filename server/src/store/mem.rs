//! The optional DRAM tier (`--mem-cap`): recently written and read records,
//! held as the same buffers the disk path filled (no extra copy), bounded
//! exactly by the bytes those buffers occupy.

use std::sync::{Arc, Mutex};

use lru::LruCache;

use super::buf::PooledBuf;
use super::shares::Shares;

pub struct MemTier {
    cap: u64,
    inner: Mutex<Inner>,
}

struct Inner {
    lru: LruCache<Arc<[u8]>, Arc<PooledBuf>>,
    /// Tenants' shares of the tier (super::shares; empty: one LRU).
    shares: Shares,
    used: u64,
    /// Bumped by every removal. A reader that fetched a record from disk
    /// inserts it only if no removal happened since it started, so a delete
    /// racing with a get or put cannot be undone by the memory tier.
    removals: u64,
}

impl MemTier {
    pub fn new(cap: u64) -> MemTier {
        MemTier {
            cap,
            inner: Mutex::new(Inner { lru: LruCache::unbounded(), shares: Shares::default(), used: 0, removals: 0 }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The removal count to pass to [`MemTier::insert`], taken before the
    /// disk operation whose result will be inserted.
    pub fn generation(&self) -> u64 {
        self.lock().removals
    }

    /// Keeps `rec` under `key`, evicting the least recent to stay within cap;
    /// skipped when a removal happened since `generation` was taken.
    pub fn insert(&self, key: &[u8], rec: Arc<PooledBuf>, generation: u64) {
        self.store(key, rec, generation, false)
    }

    /// As [`MemTier::insert`], replacing a copy already held (a put that
    /// just stored `rec` on disk: what memory holds under the key is older).
    pub fn replace(&self, key: &[u8], rec: Arc<PooledBuf>, generation: u64) {
        self.store(key, rec, generation, true)
    }

    fn store(&self, key: &[u8], rec: Arc<PooledBuf>, generation: u64, replace: bool) {
        let size = rec.capacity() as u64;
        let mut g = self.lock();
        if replace {
            // Dropping the older copy is always right, whatever happens next.
            if let Some(old) = g.lru.pop(key) {
                g.used -= old.capacity() as u64;
                g.shares.left(tenant_of(key), key);
            }
        }
        if g.removals != generation || g.lru.contains(key) || size > self.cap {
            return;
        }
        let putter = tenant_of(key);
        while g.used + size > self.cap {
            let victim = g.shares.victim(putter, size).map(|v| v.key);
            let named = victim.and_then(|k| {
                let e = g.lru.pop_entry(&k[..]);
                if e.is_none() {
                    // Never expected (the lists follow the LRU): forget it.
                    g.shares.left(tenant_of(&k), &k);
                }
                e
            });
            let old = named.or_else(|| g.lru.pop_lru());
            match old {
                Some((k, old)) => {
                    g.used -= old.capacity() as u64;
                    g.shares.left(tenant_of(&k), &k);
                }
                None => break,
            }
        }
        g.used += size;
        let key: Arc<[u8]> = key.into();
        if g.shares.active() {
            g.shares.entered(putter, key.clone(), size);
        }
        g.lru.put(key, rec);
    }

    pub fn get(&self, key: &[u8]) -> Option<Arc<PooledBuf>> {
        let mut g = self.lock();
        let rec = g.lru.get(key).cloned();
        if rec.is_some() && g.shares.active() {
            g.shares.used(tenant_of(key), key);
        }
        rec
    }

    /// Sets the tenants' shares of the tier: bytes by tenant id (empty: off).
    pub fn set_shares(&self, share: std::collections::HashMap<u32, u64>) {
        let g = &mut *self.lock();
        let lru = &g.lru;
        g.shares.set(share, || lru.iter().rev().map(|(k, b)| (tenant_of(k), k.clone(), b.capacity() as u64)).collect());
    }

    /// Sets `out[i]` for each of `keys` held, under one lock (no recency
    /// change, no buffer reference taken).
    pub fn contains_many(&self, keys: &[&[u8]], out: &mut [bool]) {
        let g = self.lock();
        for (k, o) in keys.iter().zip(out.iter_mut()) {
            *o = g.lru.contains(*k);
        }
    }

    /// Looks without refreshing recency.
    pub fn peek(&self, key: &[u8]) -> Option<Arc<PooledBuf>> {
        self.lock().lru.peek(key).cloned()
    }

    /// True when the key was held.
    pub fn remove(&self, key: &[u8]) -> bool {
        let mut g = self.lock();
        g.removals += 1;
        match g.lru.pop(key) {
            Some(old) => {
                g.used -= old.capacity() as u64;
                g.shares.left(tenant_of(key), key);
                true
            }
            None => false,
        }
    }

    pub fn used(&self) -> u64 {
        self.lock().used
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }
}

fn tenant_of(key: &[u8]) -> u32 {
    crate::tenant::split(key).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::buf::BufPool;
    use crate::tenant::ns_key;

    #[test]
    fn the_memory_tier_keeps_a_tenant_below_its_share() {
        let pool = BufPool::new(16 << 20);
        let rec = || Arc::new(pool.copy_of(&[7u8; 4096]));
        let size = rec().capacity() as u64;
        let tier = MemTier::new(40 * size);
        tier.set_shares([(7, 20 * size), (9, 20 * size)].into_iter().collect());
        let put = |t: u32, i: usize| tier.insert(&ns_key(t, format!("k{i}").as_bytes()), rec(), tier.generation());
        let held =
            |t: u32, n: usize| (0..n).filter(|i| tier.get(&ns_key(t, format!("k{i}").as_bytes())).is_some()).count();
        for i in 0..8 {
            put(9, i);
        }
        // Tenant 7 floods: it keeps at most the rest, never 9's pages.
        for i in 0..100 {
            put(7, i);
        }
        assert_eq!(held(9, 8), 8, "tenant 9 below its share keeps every page");
        assert_eq!(held(7, 100), 32, "tenant 7 holds its share and 9's idle rest");
        assert_eq!(tier.used(), 40 * size);
        // Tenant 9's next puts take the lent room back from 7.
        for i in 8..18 {
            put(9, i);
        }
        assert_eq!(held(9, 18), 18);
        assert_eq!(held(7, 100), 22);
        // Off: one LRU again.
        tier.set_shares(Default::default());
        for i in 100..140 {
            put(7, i);
        }
        assert_eq!(held(9, 18), 0, "without shares the flood takes everything");
    }
}
