//! The multi-disk page store: placement among disks (DESIGN.md §3), an
//! optional memory tier, counters. Blocking API: the server calls the
//! I/O methods from the blocking pool, never on the async reactor.
//!
//! Layers: [`device::Device`] (aligned positional I/O, faults injectable),
//! [`alloc::Allocator`] (extents), [`journal::Journal`] (index log),
//! [`disk::Disk`] (one disk: index, eviction, recovery), [`mem::MemTier`].

pub mod alloc;
pub mod arena;
pub mod buf;
pub mod device;
pub mod disk;
pub mod journal;
pub mod mem;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use kv_common::page::{parse_record, Geometry, HeaderError, PageHeader};
use kv_common::ring::{Ring, RingMember};
use kv_common::stats::NodeStats;

pub use buf::{AlignedBuf, BufPool, PooledBuf};
pub use device::{Device, FileDevice};
pub use disk::{Disk, DiskError, Lookup, PutResult, RecoveryReport};

/// One `--dir` with its byte cap.
#[derive(Debug, Clone)]
pub struct DiskSpec {
    pub dir: PathBuf,
    pub cap: u64,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub disks: Vec<DiskSpec>,
    /// Bytes of the memory tier; 0 turns it off.
    pub mem_cap: u64,
    /// O_DSYNC data writes (on media when acknowledged). Tests may turn it off.
    pub sync_writes: bool,
    /// Bytes of idle I/O buffers kept for reuse.
    pub pool_bytes: usize,
}

/// Why a store operation failed (mapped to a wire status in one place).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid record: {0}")]
    BadRecord(#[from] HeaderError),
    #[error("invalid record: payload checksum does not match the header")]
    BadPayload,
    #[error("no disk in service")]
    NoDisk,
    #[error("store full: {0}")]
    Full(String),
    #[error("record too large: {0}")]
    TooLarge(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    Duplicate,
}

pub enum GetOutcome {
    Hit(Arc<PooledBuf>),
    Mismatch,
    Miss,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    Present,
    Mismatch,
    Absent,
}

struct DiskRing {
    ring: Ring,
    /// Ring member index -> disk index.
    disk_of: Vec<usize>,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    mismatches: AtomicU64,
    puts: AtomicU64,
    put_duplicates: AtomicU64,
    put_rejected: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    mem_hits: AtomicU64,
}

pub struct Store {
    disks: Vec<Arc<Disk>>,
    ring: RwLock<Arc<DiskRing>>,
    mem: Option<mem::MemTier>,
    pool: BufPool,
    c: Counters,
    started: Instant,
}

/// A device factory: the real one opens `data.kvc` with O_DIRECT.
pub type DeviceFactory<'a> = &'a (dyn Fn(&Path, bool) -> io::Result<Box<dyn Device>> + Sync);

fn file_device(path: &Path, sync: bool) -> io::Result<Box<dyn Device>> {
    Ok(Box::new(FileDevice::open(path, sync)?))
}

/// Weight of a disk in placement: its cap in GiB, at least 1 (DESIGN §3).
pub fn disk_weight(cap: u64) -> u32 {
    (cap >> 30).clamp(1, u32::MAX as u64) as u32
}

impl Store {
    pub fn open(cfg: &StoreConfig) -> Result<(Store, Vec<RecoveryReport>), String> {
        Store::open_with(cfg, &file_device)
    }

    /// Opens every disk (in parallel) with devices from `make`.
    pub fn open_with(cfg: &StoreConfig, make: DeviceFactory<'_>) -> Result<(Store, Vec<RecoveryReport>), String> {
        if cfg.disks.is_empty() {
            return Err("no --dir given".into());
        }
        let opened: Vec<Result<(Disk, RecoveryReport), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = cfg
                .disks
                .iter()
                .enumerate()
                .map(|(i, spec)| {
                    s.spawn(move || {
                        let dir = &spec.dir;
                        let ctx = |e: io::Error| format!("disk dir {}: {e}", dir.display());
                        std::fs::create_dir_all(dir).map_err(ctx)?;
                        let dev = make(&dir.join(disk::DATA_FILE), cfg.sync_writes).map_err(ctx)?;
                        Disk::open(format!("disk{i}"), dir, spec.cap, dev).map_err(ctx)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("disk recovery panicked".into()))).collect()
        });
        let mut disks = Vec::new();
        let mut reports = Vec::new();
        for r in opened {
            let (d, rep) = r?;
            disks.push(Arc::new(d));
            reports.push(rep);
        }
        let store = Store {
            disks,
            ring: RwLock::new(Arc::new(DiskRing { ring: Ring::default(), disk_of: vec![] })),
            mem: (cfg.mem_cap > 0).then(|| mem::MemTier::new(cfg.mem_cap)),
            // With a memory tier, buffers come from an arena of its size
            // (plus the pool's) faulted in ahead of use.
            pool: BufPool::with_arena(
                cfg.pool_bytes,
                match (cfg.mem_cap > 0).then(|| (cfg.mem_cap as usize).checked_add(cfg.pool_bytes)).flatten() {
                    Some(len) => arena::Arena::new(len),
                    None => None,
                },
            ),
            c: Counters::default(),
            started: Instant::now(),
        };
        store.rebuild_ring();
        Ok((store, reports))
    }

    /// Places keys over the disks in service.
    fn rebuild_ring(&self) {
        let mut members = Vec::new();
        let mut disk_of = Vec::new();
        for (i, d) in self.disks.iter().enumerate() {
            if !d.is_failed() {
                members.push(RingMember { id: d.id.clone(), weight: disk_weight(d.cap()) });
                disk_of.push(i);
            }
        }
        let r = Arc::new(DiskRing { ring: Ring::new(members), disk_of });
        *self.ring.write().unwrap_or_else(|e| e.into_inner()) = r;
    }

    fn ring(&self) -> Arc<DiskRing> {
        self.ring.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The disk (index) that owns `key` among disks in service.
    pub fn owner(&self, key: &[u8]) -> Option<usize> {
        let r = self.ring();
        r.ring.owner(key).map(|m| r.disk_of[m])
    }

    /// Disk indices to search for `key`: every disk, in order. A probe is an
    /// in-memory hash lookup, cheaper than computing placement (an xxh3 hash
    /// and a ring search), and searching all disks keeps records findable
    /// after a disk failure or a cap change moved placement. Placement only
    /// decides where a put goes.
    fn search_order(&self, _key: &[u8]) -> std::ops::Range<usize> {
        0..self.disks.len()
    }

    pub fn pool(&self) -> &BufPool {
        &self.pool
    }

    pub fn disks(&self) -> &[Arc<Disk>] {
        &self.disks
    }

    /// Stores a whole record held in `rec`. Blocking.
    pub fn put(&self, mut rec: PooledBuf) -> Result<PutOutcome, StoreError> {
        let (header, key) = parse_record(rec.as_slice())?;
        // The node refuses a page whose payload does not match its CRC, so
        // nothing it stores can fail the reader's check through its writer.
        let payload = &rec.as_slice()[kv_common::page::HEADER_LEN + key.len()..];
        if crc32fast::hash(payload) != header.payload_crc {
            return Err(StoreError::BadPayload);
        }
        let key = key.to_vec();
        if self.disks.iter().any(|d| d.contains(&key)) {
            self.c.put_duplicates.fetch_add(1, Ordering::Relaxed);
            return Ok(PutOutcome::Duplicate);
        }
        let generation = self.mem.as_ref().map_or(0, |m| m.generation());
        for _attempt in 0..2 {
            let Some(i) = self.owner(&key) else {
                self.c.put_rejected.fetch_add(1, Ordering::Relaxed);
                return Err(StoreError::NoDisk);
            };
            match self.disks[i].put(&mut rec, &key, &header) {
                Ok(PutResult::Duplicate) => {
                    self.c.put_duplicates.fetch_add(1, Ordering::Relaxed);
                    return Ok(PutOutcome::Duplicate);
                }
                Ok(PutResult::Stored) => {
                    self.c.puts.fetch_add(1, Ordering::Relaxed);
                    self.c.bytes_written.fetch_add(rec.len() as u64, Ordering::Relaxed);
                    if let Some(m) = &self.mem {
                        // A copy still held from before the disk evicted
                        // the key must not shadow the page just stored.
                        m.replace(&key, Arc::new(rec), generation);
                    }
                    return Ok(PutOutcome::Stored);
                }
                Err(DiskError::Failed(_)) => self.rebuild_ring(),
                Err(DiskError::Full(d)) => {
                    self.c.put_rejected.fetch_add(1, Ordering::Relaxed);
                    return Err(StoreError::Full(d));
                }
                Err(DiskError::TooLarge(n)) => {
                    self.c.put_rejected.fetch_add(1, Ordering::Relaxed);
                    return Err(StoreError::TooLarge(format!("{n} bytes exceed the disk cap")));
                }
            }
        }
        self.c.put_rejected.fetch_add(1, Ordering::Relaxed);
        Err(StoreError::NoDisk)
    }

    /// Reads a record. With `geo`, a record of another geometry is a mismatch.
    pub fn get(&self, key: &[u8], geo: Option<&Geometry>) -> GetOutcome {
        let out = self.lookup(key, geo);
        match &out {
            GetOutcome::Hit(b) => {
                self.c.hits.fetch_add(1, Ordering::Relaxed);
                self.c.bytes_read.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
            GetOutcome::Mismatch => {
                self.c.mismatches.fetch_add(1, Ordering::Relaxed);
            }
            GetOutcome::Miss => {
                self.c.misses.fetch_add(1, Ordering::Relaxed);
            }
        }
        out
    }

    /// A get served from the memory tier alone (no I/O, never blocks on a
    /// disk): None when the record is not held in memory.
    pub fn get_cached(&self, key: &[u8], geo: Option<&Geometry>) -> Option<GetOutcome> {
        let rec = self.mem.as_ref()?.get(key)?;
        if let (Some(g), Ok(h)) = (geo, PageHeader::decode(rec.as_slice())) {
            if !g.matches(&h) {
                self.c.mismatches.fetch_add(1, Ordering::Relaxed);
                return Some(GetOutcome::Mismatch);
            }
        }
        self.c.mem_hits.fetch_add(1, Ordering::Relaxed);
        self.c.hits.fetch_add(1, Ordering::Relaxed);
        self.c.bytes_read.fetch_add(rec.len() as u64, Ordering::Relaxed);
        Some(GetOutcome::Hit(rec))
    }

    /// Counts a get answered as a miss without calling [`Store::get`].
    pub fn count_miss(&self) {
        self.c.misses.fetch_add(1, Ordering::Relaxed);
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
                self.c.mem_hits.fetch_add(1, Ordering::Relaxed);
                return GetOutcome::Hit(rec);
            }
        }
        let generation = self.mem.as_ref().map_or(0, |m| m.generation());
        for i in self.search_order(key) {
            match self.disks[i].get(key, geo, &self.pool, true) {
                Ok(Lookup::Hit(buf)) => {
                    let rec = Arc::new(buf);
                    if let Some(m) = &self.mem {
                        m.insert(key, rec.clone(), generation);
                    }
                    return GetOutcome::Hit(rec);
                }
                Ok(Lookup::Mismatch) => return GetOutcome::Mismatch,
                Ok(Lookup::Miss) => {}
                Err(_) => self.rebuild_ring(),
            }
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
        for i in self.search_order(key) {
            match probe(&self.disks[i], key, geo)? {
                Some(true) => return Ok(Presence::Present),
                Some(false) => return Ok(Presence::Mismatch),
                None => {}
            }
        }
        // A page still in the memory tier after its disk evicted it is served.
        if let Some(rec) = self.mem.as_ref().and_then(|m| m.peek(key)) {
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
        let mut found: Vec<Option<bool>> = vec![None; keys.len()];
        for d in &self.disks {
            d.try_exist_many(keys, geo, &mut found).ok()?;
        }
        Some(
            keys.iter()
                .zip(found)
                .map(|(k, f)| match f {
                    Some(true) => Presence::Present,
                    Some(false) => Presence::Mismatch,
                    None => match self.mem.as_ref().and_then(|m| m.peek(k)) {
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

    /// Bytes a get of `key` would return, if it is stored (memory only).
    pub fn record_size(&self, key: &[u8]) -> Option<u64> {
        if let Some(rec) = self.mem.as_ref().and_then(|m| m.peek(key)) {
            return Some(rec.len() as u64);
        }
        self.search_order(key).find_map(|i| self.disks[i].record_len(key))
    }

    /// As [`Store::record_size`] without waiting: None when a disk's index
    /// lock is busy, so async code can ask again off the reactor.
    pub fn try_record_size(&self, key: &[u8]) -> Option<Option<u64>> {
        if let Some(rec) = self.mem.as_ref().and_then(|m| m.peek(key)) {
            return Some(Some(rec.len() as u64));
        }
        for i in self.search_order(key) {
            match self.disks[i].try_record_len(key) {
                Ok(Some(n)) => return Some(Some(n)),
                Ok(None) => {}
                Err(disk::Busy) => return None,
            }
        }
        Some(None)
    }

    /// Removes a key from every tier. True when something was removed.
    pub fn delete(&self, key: &[u8]) -> bool {
        // Disks first, then memory: the memory removal bumps the generation
        // after the record is gone from disk, so a get that read it from
        // disk before the delete cannot put it back into memory after.
        let mut any = false;
        for d in &self.disks {
            any |= d.delete(key);
        }
        any |= self.mem.as_ref().is_some_and(|m| m.remove(key));
        any
    }

    /// Checks records recovered after an unclean stop, reading about
    /// `max_bytes` in all; drops the damaged ones. Returns how many were checked.
    pub fn scrub(&self, max_bytes: u64) -> usize {
        let mut n = 0;
        let mut left = max_bytes;
        for d in &self.disks {
            while left > 0 {
                let keys = d.take_unscrubbed(16);
                if keys.is_empty() {
                    break;
                }
                for k in keys {
                    let Some(len) = d.record_len(&k) else { continue };
                    if d.get(&k, None, &self.pool, false).is_err() {
                        self.rebuild_ring();
                    }
                    left = left.saturating_sub(len);
                    n += 1;
                }
            }
        }
        n
    }

    /// Periodic upkeep: journal flush and compaction, vanished-dir checks.
    pub fn maintain(&self) {
        let mut changed = false;
        for d in &self.disks {
            let was = d.is_failed();
            if let Err(e) = d.maintain() {
                tracing::warn!(disk = %d.id, error = %e, "index maintenance failed");
            }
            changed |= was != d.is_failed();
        }
        if changed {
            self.rebuild_ring();
        }
    }

    /// Clean stop: every disk checkpoints and marks itself clean.
    pub fn close(&self) -> io::Result<()> {
        let mut first_err = None;
        for d in &self.disks {
            if let Err(e) = d.close() {
                tracing::error!(disk = %d.id, error = %e, "checkpoint at shutdown failed");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    pub fn stats(&self) -> NodeStats {
        let disks: Vec<_> = self.disks.iter().map(|d| d.stats()).collect();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeStats {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_secs: self.started.elapsed().as_secs(),
            used_bytes: disks.iter().map(|d| d.used_bytes).sum(),
            capacity_bytes: disks.iter().map(|d| d.capacity_bytes).sum(),
            objects: disks.iter().map(|d| d.objects).sum(),
            evictions: disks.iter().map(|d| d.evictions).sum(),
            failed_disks: disks.iter().filter(|d| d.failed).count() as u64,
            corrupt_dropped: self.disks.iter().map(|d| d.corrupt_dropped()).sum(),
            unverified: disks.iter().map(|d| d.unverified).sum(),
            hits: ld(&self.c.hits),
            misses: ld(&self.c.misses),
            mismatches: ld(&self.c.mismatches),
            puts: ld(&self.c.puts),
            put_duplicates: ld(&self.c.put_duplicates),
            put_rejected: ld(&self.c.put_rejected),
            bytes_read: ld(&self.c.bytes_read),
            bytes_written: ld(&self.c.bytes_written),
            mem_used_bytes: self.mem.as_ref().map_or(0, |m| m.used()),
            mem_capacity_bytes: self.mem.as_ref().map_or(0, |m| m.cap()),
            mem_hits: ld(&self.c.mem_hits),
            connections: 0,
            denied_connections: 0,
            v1_connections: 0,
            refused_connections: 0,
            disks,
        }
    }
}
