//! The read path: gets, exist checks and record sizes, from the memory tier,
//! the write-behind and the disks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_common::page::{Geometry, PageHeader};

use super::{disk, Disk, GetOutcome, Lookup, PooledBuf, Presence, Store};

/// Whether a record held in memory would be a hit for `geo`.
fn presence_of(rec: &PooledBuf, geo: Option<&Geometry>) -> Presence {
    match (geo, PageHeader::decode(rec.as_slice())) {
        (Some(g), Ok(h)) if !g.matches(&h) => Presence::Mismatch,
        _ => Presence::Present,
    }
}

impl Store {
    // Lookups search every disk in service, in order: a probe is an
    // in-memory hash lookup, cheaper than computing placement (an xxh3 hash
    // and a ring search), and searching all disks keeps records findable
    // after a disk failure or a cap change moved placement. Placement only
    // decides where a put goes.

    /// Reads a record. With `geo`, a record of another geometry is a mismatch.
    pub fn get(&self, key: &[u8], geo: Option<&Geometry>) -> GetOutcome {
        let out = self.lookup(key, geo);
        match &out {
            GetOutcome::Hit(b) => {
                self.c.hits.fetch_add(1, Ordering::Relaxed);
                self.c.bytes_read.fetch_add(b.len() as u64, Ordering::Relaxed);
                self.tenant_ops.of(key, |c| c.hits.fetch_add(1, Ordering::Relaxed));
            }
            GetOutcome::Mismatch => {
                self.c.mismatches.fetch_add(1, Ordering::Relaxed);
            }
            GetOutcome::Miss => {
                self.c.misses.fetch_add(1, Ordering::Relaxed);
                self.tenant_ops.of(key, |c| c.misses.fetch_add(1, Ordering::Relaxed));
            }
        }
        out
    }

    /// A get served from the memory tier alone (no I/O, never blocks on a
    /// disk): None when the record is not held in memory.
    pub fn get_cached(&self, key: &[u8], geo: Option<&Geometry>) -> Option<GetOutcome> {
        let out = self.peek_cached(key, geo)?;
        if let GetOutcome::Hit(rec) = &out {
            self.count_cached_hit(key, rec.len());
        }
        Some(out)
    }

    /// As [`Store::get_cached`], but a hit is not counted (nor noted for
    /// warming) until [`Store::count_cached_hit`]: for a caller that may
    /// still decide not to serve it (a batch past its byte bound). Its
    /// recency is refreshed either way: a client asks such an item again
    /// at once.
    pub fn peek_cached(&self, key: &[u8], geo: Option<&Geometry>) -> Option<GetOutcome> {
        let rec = self.mem.as_ref()?.get(key)?;
        if let (Some(g), Ok(h)) = (geo, PageHeader::decode(rec.as_slice())) {
            if !g.matches(&h) {
                self.c.mismatches.fetch_add(1, Ordering::Relaxed);
                return Some(GetOutcome::Mismatch);
            }
        }
        Some(GetOutcome::Hit(rec))
    }

    /// Counts a memory-tier hit found by [`Store::peek_cached`] and served.
    pub fn count_cached_hit(&self, key: &[u8], len: usize) {
        self.c.hits.fetch_add(1, Ordering::Relaxed);
        self.c.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        self.tenant_ops.of(key, |c| c.hits.fetch_add(1, Ordering::Relaxed));
        self.served_from_memory(key);
    }

    /// A read served from the memory tier: counted, noted for warming, and
    /// passed on to the disk that holds the key, whose eviction order must
    /// see it (otherwise a page read only from memory ages on its disk and
    /// is evicted before colder ones).
    fn served_from_memory(&self, key: &[u8]) {
        self.c.mem_hits.fetch_add(1, Ordering::Relaxed);
        if let Some(w) = &self.warmer {
            w.note_read(key);
        }
        let v = self.view();
        if let Some(super::Slot::Live(d)) = v.owner_slot(key) {
            d.touch_later(key);
        }
    }

    /// A record read for the drain's push: from its disk, without
    /// refreshing its recency or filling the memory tier (the pages clients
    /// still read through the handoff keep their place there), and without
    /// counting a get. None when no disk holds it (deleted, evicted).
    pub fn read_for_push(&self, key: &[u8]) -> Option<PooledBuf> {
        self.read_cold(key)
    }

    /// Counts a get of `key` answered as a miss without calling [`Store::get`].
    pub fn count_miss(&self, key: &[u8]) {
        self.c.misses_absent.fetch_add(1, Ordering::Relaxed);
        self.c.misses.fetch_add(1, Ordering::Relaxed);
        self.tenant_ops.of(key, |c| c.misses.fetch_add(1, Ordering::Relaxed));
    }

    fn lookup(&self, key: &[u8], geo: Option<&Geometry>) -> GetOutcome {
        if let Some(m) = &self.mem {
            if let Some(rec) = m.get(key) {
                let h = PageHeader::decode(rec.as_slice());
                if let (Some(g), Ok(h)) = (geo, h) {
                    if !g.matches(&h) {
                        return GetOutcome::Mismatch;
                    }
                }
                self.served_from_memory(key);
                return GetOutcome::Hit(rec);
            }
        }
        if let Some(rec) = self.behind.as_ref().and_then(|b| b.get(key)) {
            // Acknowledged from memory, not yet on its disk, and no longer
            // in the memory tier.
            if let (Some(g), Ok(h)) = (geo, PageHeader::decode(rec.as_slice())) {
                if !g.matches(&h) {
                    return GetOutcome::Mismatch;
                }
            }
            self.c.mem_hits.fetch_add(1, Ordering::Relaxed);
            return GetOutcome::Hit(rec);
        }
        let generation = self.mem.as_ref().map_or(0, |m| m.generation());
        let mut damaged = false;
        for d in self.view().live() {
            match d.get(key, geo, &self.pool, true) {
                Ok(Lookup::Hit(buf)) => {
                    self.c.disk_hits.fetch_add(1, Ordering::Relaxed);
                    let rec = Arc::new(buf);
                    if let Some(m) = &self.mem {
                        m.insert(key, rec.clone(), generation);
                    }
                    return GetOutcome::Hit(rec);
                }
                Ok(Lookup::Mismatch) => return GetOutcome::Mismatch,
                Ok(Lookup::Miss) => {}
                Ok(Lookup::Damaged) => damaged = true,
                Err(_) => self.rebuild_ring(),
            }
        }
        if damaged {
            self.c.misses_corrupt.fetch_add(1, Ordering::Relaxed);
        } else {
            self.c.misses_absent.fetch_add(1, Ordering::Relaxed);
        }
        GetOutcome::Miss
    }

    /// Whether a get with `geo` would hit (memory only, no disk I/O; may
    /// wait for a disk's index lock).
    pub fn exist(&self, key: &[u8], geo: Option<&Geometry>) -> Presence {
        self.exist_with(key, geo, |d, k, g| Ok(d.exist(k, g))).unwrap_or(Presence::Absent)
    }

    /// As [`Store::exist`] without waiting: None when a disk's index lock is
    /// busy (a put or a checkpoint copy), so async code can retry off the reactor.
    pub fn try_exist(&self, key: &[u8], geo: Option<&Geometry>) -> Option<Presence> {
        self.exist_with(key, geo, |d, k, g| d.try_exist(k, g)).ok()
    }

    fn exist_with(
        &self,
        key: &[u8],
        geo: Option<&Geometry>,
        probe: impl Fn(&Disk, &[u8], Option<&Geometry>) -> Result<Option<bool>, disk::Busy>,
    ) -> Result<Presence, disk::Busy> {
        // Held for a flusher first (see `put`), then the disks, then memory.
        if let Some(rec) = self.behind.as_ref().and_then(|b| b.get(key)) {
            return Ok(presence_of(&rec, geo));
        }
        for d in self.view().live() {
            match probe(d, key, geo)? {
                Some(true) => return Ok(Presence::Present),
                Some(false) => return Ok(Presence::Mismatch),
                None => {}
            }
        }
        // A page still in the memory tier after its disk evicted it, or not
        // yet on its disk (ack = "memory"), is served.
        if let Some(rec) = self.in_memory(key) {
            return Ok(match (geo, PageHeader::decode(rec.as_slice())) {
                (Some(g), Ok(h)) if !g.matches(&h) => Presence::Mismatch,
                _ => Presence::Present,
            });
        }
        Ok(Presence::Absent)
    }

    /// [`Store::try_exist`] for a batch: each disk's index lock is taken once
    /// for all keys. None when a lock is busy.
    pub fn try_exist_batch(&self, keys: &[&[u8]], geo: Option<&Geometry>) -> Option<Vec<Presence>> {
        // Held for a flusher first (see `put`); nothing to allocate without
        // a write-behind.
        let held: Option<Vec<Option<Presence>>> =
            self.behind.as_ref().map(|b| keys.iter().map(|k| b.get(k).map(|rec| presence_of(&rec, geo))).collect());
        let mut found: Vec<Option<bool>> = vec![None; keys.len()];
        for d in self.view().live() {
            d.try_exist_many(keys, geo, &mut found).ok()?;
        }
        for (f, h) in found.iter_mut().zip(held.iter().flatten()) {
            if let Some(p) = h {
                *f = Some(*p == Presence::Present);
            }
        }
        Some(
            keys.iter()
                .zip(found)
                .map(|(k, f)| match f {
                    Some(true) => Presence::Present,
                    Some(false) => Presence::Mismatch,
                    None => match self.in_memory(k) {
                        Some(rec) => match (geo, PageHeader::decode(rec.as_slice())) {
                            (Some(g), Ok(h)) if !g.matches(&h) => Presence::Mismatch,
                            _ => Presence::Present,
                        },
                        None => Presence::Absent,
                    },
                })
                .collect(),
        )
    }

    /// The record held in memory under `key`: in the memory tier, or held
    /// for a flusher. Recency is not refreshed.
    fn in_memory(&self, key: &[u8]) -> Option<Arc<PooledBuf>> {
        self.mem.as_ref().and_then(|m| m.peek(key)).or_else(|| self.behind.as_ref().and_then(|b| b.get(key)))
    }

    /// Bytes a get of `key` would return, if it is stored (memory only).
    pub fn record_size(&self, key: &[u8]) -> Option<u64> {
        if let Some(rec) = self.in_memory(key) {
            return Some(rec.len() as u64);
        }
        self.view().live().find_map(|d| d.record_len(key))
    }

    /// As [`Store::record_size`] without waiting: None when a disk's index
    /// lock is busy, so async code can ask again off the reactor.
    pub fn try_record_size(&self, key: &[u8]) -> Option<Option<u64>> {
        if let Some(rec) = self.in_memory(key) {
            return Some(Some(rec.len() as u64));
        }
        for d in self.view().live() {
            match d.try_record_len(key) {
                Ok(Some(n)) => return Some(Some(n)),
                Ok(None) => {}
                Err(disk::Busy) => return None,
            }
        }
        Some(None)
    }
}
