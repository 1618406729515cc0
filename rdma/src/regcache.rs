//! The memory registration cache. A region the caller registers once
//! (`kv_register_memory`: the engine's host pool) is pinned: kept until the
//! caller drops it. Any other buffer an operation uses is registered on
//! first use and kept, up to a byte cap, least recently used first out, so
//! an engine that reuses its buffers registers each once.
//!
//! A registration is handed out as an `Arc`: the cache forgetting it (an
//! eviction, an unpin, a wider registration replacing it) never deregisters
//! memory an operation in flight still uses; the last holder's drop does.
//!
//! A cached registration pins the pages mapped when it was made. A caller
//! that frees a buffer and maps new memory at the same address would have
//! RDMA land in the old pages; the payload CRC (checked over the caller's
//! buffers after every RDMA get, and by the node after every RDMA put)
//! catches it, and the client then forgets those registrations
//! ([`RegCache::invalidate`]) and does the request once more inline: never a
//! wrong page. Callers should register long-lived pools; `cap` 0 turns
//! caching of other buffers off (registered per operation, dropped after).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Counters;

/// Registers memory with a device. Dropping a registration deregisters it.
pub trait Registrar {
    type Mr: Send + Sync;
    /// Registers `[addr, addr + len)`; the memory must stay mapped while the
    /// registration lives.
    fn register(&self, addr: usize, len: usize) -> Result<Self::Mr, String>;
}

/// A registration and the range it covers.
#[derive(Debug)]
pub struct Region<M> {
    pub addr: usize,
    pub len: usize,
    pub mr: M,
}

impl<M> Region<M> {
    pub fn covers(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr && addr.saturating_add(len) <= self.addr + self.len
    }
}

struct Entry<M> {
    region: Arc<Region<M>>,
    pinned: bool,
    last_use: u64,
}

/// Granularity cached registrations are widened to.
const PAGE: usize = 4096;

pub struct RegCache<R: Registrar> {
    reg: R,
    /// Keyed by start address; regions may overlap.
    map: BTreeMap<usize, Vec<Entry<R::Mr>>>,
    cached_bytes: usize,
    cap: usize,
    tick: u64,
    /// The longest region ever held: a region starting more than this
    /// below an address cannot reach it (bounds the overlap search).
    max_len: usize,
    counters: Arc<Counters>,
}

impl<R: Registrar> std::fmt::Debug for RegCache<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegCache").field("cached_bytes", &self.cached_bytes).field("cap", &self.cap).finish()
    }
}

impl<R: Registrar> RegCache<R> {
    /// `cap`: bytes of cached (not pinned) registrations kept.
    pub fn new(reg: R, cap: usize, counters: Arc<Counters>) -> RegCache<R> {
        RegCache { reg, map: BTreeMap::new(), cached_bytes: 0, cap, tick: 0, max_len: 0, counters }
    }

    pub fn registrar(&self) -> &R {
        &self.reg
    }

    fn do_register(&mut self, addr: usize, len: usize) -> Result<Arc<Region<R::Mr>>, String> {
        match self.reg.register(addr, len) {
            Ok(mr) => {
                self.max_len = self.max_len.max(len);
                self.counters.registrations.fetch_add(1, Ordering::Relaxed);
                self.counters.registered_bytes.fetch_add(len as u64, Ordering::Relaxed);
                Ok(Arc::new(Region { addr, len, mr }))
            }
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn forget(&mut self, start: usize, idx: usize) -> Entry<R::Mr> {
        let v = self.map.get_mut(&start).expect("entry present");
        let e = v.remove(idx);
        if v.is_empty() {
            self.map.remove(&start);
        }
        if !e.pinned {
            self.cached_bytes -= e.region.len;
        }
        self.dropped(&e.region);
        e
    }

    fn dropped(&self, r: &Region<R::Mr>) {
        // Counted when the cache lets go; the device deregisters when the
        // last operation using it does too.
        self.counters.deregistrations.fetch_add(1, Ordering::Relaxed);
        self.counters.registered_bytes.fetch_sub(r.len as u64, Ordering::Relaxed);
    }

    /// Entries overlapping `[addr, addr+len)`: (start, index, pinned, covers).
    fn overlapping(&self, addr: usize, len: usize) -> Vec<(usize, usize, bool, bool)> {
        let end = addr.saturating_add(len);
        let mut out = Vec::new();
        for (&start, v) in self.map.range(addr.saturating_sub(self.max_len)..end) {
            for (i, e) in v.iter().enumerate() {
                if e.region.addr + e.region.len > addr {
                    out.push((start, i, e.pinned, e.region.covers(addr, len)));
                }
            }
        }
        out
    }

    /// Forgets the cached registrations among `over` that `region` covers
    /// whole (it serves them now). Registrations stay valid for operations
    /// holding them.
    fn forget_covered(&mut self, over: &[(usize, usize, bool, bool)], region: &Region<R::Mr>) {
        let mut covered: Vec<(usize, usize)> = over
            .iter()
            .filter(|&&(s, i, pinned, _)| !pinned && region.covers(s, self.map[&s][i].region.len))
            .map(|&(s, i, _, _)| (s, i))
            .collect();
        // Highest index first, so the indices left stay right.
        covered.sort_by(|a, b| b.cmp(a));
        for (s, i) in covered {
            self.forget(s, i);
        }
    }

    /// Registers a caller region for good (`kv_register_memory`). Cached
    /// registrations inside it are dropped (the pinned one serves them); a
    /// region already pinned whole is not registered again.
    pub fn pin(&mut self, addr: usize, len: usize) -> Result<(), String> {
        if len == 0 {
            return Err("cannot register an empty region".into());
        }
        if addr.checked_add(len).is_none() {
            return Err("region wraps the address space".into());
        }
        let over = self.overlapping(addr, len);
        if over.iter().any(|&(_, _, pinned, covers)| pinned && covers) {
            return Ok(());
        }
        let region = self.do_register(addr, len)?;
        self.forget_covered(&over, &region);
        self.tick += 1;
        self.map.entry(addr).or_default().push(Entry { region, pinned: true, last_use: self.tick });
        Ok(())
    }

    /// Drops the pinned region starting at `addr`. False if there is none.
    pub fn unpin(&mut self, addr: usize) -> bool {
        let Some(i) = self.map.get(&addr).and_then(|v| v.iter().position(|e| e.pinned)) else {
            return false;
        };
        self.forget(addr, i);
        true
    }

    /// A pinned or cached registration covering `[addr, addr+len)`, without
    /// registering anything.
    pub fn lookup(&mut self, addr: usize, len: usize) -> Option<Arc<Region<R::Mr>>> {
        if len == 0 || addr.checked_add(len).is_none() {
            return None;
        }
        let over = self.overlapping(addr, len);
        let (s, i) = over
            .iter()
            .filter(|o| o.3)
            .min_by_key(|&&(s, i, pinned, _)| (!pinned, self.map[&s][i].region.len))
            .map(|&(s, i, _, _)| (s, i))?;
        self.tick += 1;
        let e = &mut self.map.get_mut(&s).expect("present")[i];
        e.last_use = self.tick;
        Some(e.region.clone())
    }

    /// The registration covering `[addr, addr+len)`: a pinned or cached one,
    /// else a new cached one (widened to whole pages, replacing cached ones
    /// it covers), evicting least recently used cached ones over the cap.
    pub fn get(&mut self, addr: usize, len: usize) -> Result<Arc<Region<R::Mr>>, String> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err("bad buffer range".into());
        }
        self.tick += 1;
        let over = self.overlapping(addr, len);
        // A pinned region first, then the smallest cached one.
        let best = over
            .iter()
            .filter(|o| o.3)
            .min_by_key(|&&(s, i, pinned, _)| (!pinned, self.map[&s][i].region.len))
            .map(|&(s, i, _, _)| (s, i));
        if let Some((s, i)) = best {
            let e = &mut self.map.get_mut(&s).expect("present")[i];
            e.last_use = self.tick;
            return Ok(e.region.clone());
        }
        let start = addr & !(PAGE - 1);
        let end = addr.saturating_add(len).checked_next_multiple_of(PAGE).unwrap_or(usize::MAX);
        let region = self.do_register(start, end - start)?;
        if self.cap == 0 {
            // Not cached: registered for this operation only.
            self.dropped(&region);
            return Ok(region);
        }
        self.forget_covered(&over, &region);
        self.cached_bytes += region.len;
        self.map.entry(start).or_default().push(Entry { region: region.clone(), pinned: false, last_use: self.tick });
        while self.cached_bytes > self.cap {
            let victim = self
                .map
                .iter()
                .flat_map(|(&s, v)| v.iter().enumerate().map(move |(i, e)| (s, i, e)))
                .filter(|(_, _, e)| !e.pinned && !Arc::ptr_eq(&e.region, &region))
                .min_by_key(|(_, _, e)| e.last_use)
                .map(|(s, i, _)| (s, i));
            let Some((s, i)) = victim else { break };
            self.forget(s, i);
        }
        Ok(region)
    }

    /// Forgets cached registrations overlapping `[addr, addr+len)`: that
    /// memory is being freed, and new memory mapped there later must not be
    /// reached through a registration of the old pages. Pinned ones stay
    /// (their owner unpins them).
    pub fn invalidate(&mut self, addr: usize, len: usize) -> usize {
        let mut hit: Vec<(usize, usize)> =
            self.overlapping(addr, len).into_iter().filter(|o| !o.2).map(|(s, i, _, _)| (s, i)).collect();
        hit.sort_by(|a, b| b.cmp(a));
        let n = hit.len();
        for (s, i) in hit {
            self.forget(s, i);
        }
        n
    }

    /// Bytes of cached (not pinned) registrations.
    pub fn cached_bytes(&self) -> usize {
        self.cached_bytes
    }

    /// Registrations held: (pinned, cached).
    pub fn count(&self) -> (usize, usize) {
        let all = self.map.values().flatten();
        let pinned = all.clone().filter(|e| e.pinned).count();
        (pinned, self.map.values().flatten().count() - pinned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A stand-in device: counts live registrations; fails on request.
    #[derive(Default)]
    struct Fake {
        live: Arc<AtomicUsize>,
        fail_over: Option<usize>,
    }

    struct FakeMr(Arc<AtomicUsize>);
    impl Drop for FakeMr {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Registrar for Fake {
        type Mr = FakeMr;
        fn register(&self, _addr: usize, len: usize) -> Result<FakeMr, String> {
            if self.fail_over.is_some_and(|m| len > m) {
                return Err("cannot pin that much (RLIMIT_MEMLOCK?)".into());
            }
            self.live.fetch_add(1, Ordering::SeqCst);
            Ok(FakeMr(self.live.clone()))
        }
    }

    fn cache(cap: usize) -> (RegCache<Fake>, Arc<AtomicUsize>, Arc<Counters>) {
        let f = Fake::default();
        let live = f.live.clone();
        let c = Arc::new(Counters::default());
        (RegCache::new(f, cap, c.clone()), live, c)
    }

    #[test]
    fn pinned_regions_serve_every_buffer_inside_them() {
        let (mut rc, live, c) = cache(1 << 20);
        rc.pin(0x10_0000, 1 << 24).unwrap();
        rc.pin(0x10_0000, 1 << 24).unwrap(); // again: no second registration
        let a = rc.get(0x10_0000 + 4096, 8192).unwrap();
        let b = rc.get(0x10_0000 + (1 << 24) - 10, 10).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!((a.addr, a.len), (0x10_0000, 1 << 24));
        assert_eq!(live.load(Ordering::SeqCst), 1);
        assert_eq!(c.registrations.load(Ordering::Relaxed), 1);
        // Straddling the end of the pinned region: a cached one.
        let s = rc.get(0x10_0000 + (1 << 24) - 10, 20).unwrap();
        assert!(!Arc::ptr_eq(&s, &a));
        assert_eq!(rc.count(), (1, 1));
        assert!(rc.pin(5, 0).is_err());
        assert!(rc.get(usize::MAX - 1, 4).is_err());
    }

    #[test]
    fn cached_registrations_are_reused_widened_and_evicted_lru() {
        let (mut rc, live, c) = cache(3 * 4096);
        let a = rc.get(0x1000 + 100, 200).unwrap();
        assert_eq!((a.addr, a.len), (0x1000, 4096), "widened to the page");
        assert!(Arc::ptr_eq(&a, &rc.get(0x1000 + 300, 10).unwrap()));
        let _b = rc.get(0x10000, 4096).unwrap();
        let _c = rc.get(0x20000, 4096).unwrap();
        assert_eq!(rc.cached_bytes(), 3 * 4096);
        rc.get(0x1000, 1).unwrap(); // a is now the most recent
        let _d = rc.get(0x30000, 4096).unwrap(); // evicts b, the least recent
        assert_eq!(rc.count(), (0, 3));
        assert_eq!(c.deregistrations.load(Ordering::Relaxed), 1);
        assert!(Arc::ptr_eq(&a, &rc.get(0x1000, 1).unwrap()));
        // b's registration is gone (nobody holds it)...
        drop(_b);
        assert_eq!(live.load(Ordering::SeqCst), 3);
        // ...but one an operation still holds lives until it lets go.
        let held = rc.get(0x40000, 4096).unwrap();
        for k in 0..4 {
            rc.get(0x50000 + k * 0x10000, 4096).unwrap();
        }
        assert_eq!(rc.count(), (0, 3));
        assert_eq!(held.len, 4096);
        let before = live.load(Ordering::SeqCst);
        drop(held);
        assert_eq!(live.load(Ordering::SeqCst), before - 1, "deregistered at the last drop");
        assert_eq!(c.registered_bytes.load(Ordering::Relaxed), rc.cached_bytes() as u64);
    }

    #[test]
    fn overlaps_merge_and_pins_absorb_cached_ones() {
        let (mut rc, _live, _c) = cache(1 << 20);
        rc.get(0x2000, 10).unwrap();
        rc.get(0x3000, 10).unwrap();
        // A wider request covering both replaces them.
        let w = rc.get(0x2000, 2 * 4096).unwrap();
        assert_eq!((w.addr, w.len), (0x2000, 8192));
        assert_eq!(rc.count(), (0, 1));
        // A pin over it absorbs it.
        rc.pin(0, 1 << 16).unwrap();
        assert_eq!(rc.count(), (1, 0));
        assert_eq!(rc.cached_bytes(), 0);
        assert!(rc.unpin(0));
        assert!(!rc.unpin(0));
        // Freed memory: its cached registrations go, pinned ones stay.
        rc.get(0x8000, 100).unwrap();
        rc.get(0x9000, 100).unwrap();
        rc.pin(0x8000, 64).unwrap();
        assert_eq!(rc.invalidate(0x8000 + 10, 20), 1);
        assert_eq!(rc.count(), (1, 1));
        assert!(rc.unpin(0x8000));
        assert_eq!(rc.invalidate(0, usize::MAX / 2), 1);
        assert_eq!(rc.count(), (0, 0));
    }

    #[test]
    fn registration_failures_and_a_zero_cap() {
        let f = Fake { fail_over: Some(8192), ..Default::default() };
        let live = f.live.clone();
        let c = Arc::new(Counters::default());
        let mut rc = RegCache::new(f, 0, c.clone());
        let e = rc.pin(0, 1 << 20).unwrap_err();
        assert!(e.contains("RLIMIT_MEMLOCK"));
        assert_eq!(c.errors.load(Ordering::Relaxed), 1);
        // cap 0: registered for the operation, gone with it.
        let r = rc.get(0x1000, 100).unwrap();
        assert_eq!(rc.count(), (0, 0));
        assert_eq!(live.load(Ordering::SeqCst), 1);
        drop(r);
        assert_eq!(live.load(Ordering::SeqCst), 0);
        assert_eq!(c.registered_bytes.load(Ordering::Relaxed), 0);
    }
}
