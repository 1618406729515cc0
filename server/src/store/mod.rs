//! The multi-disk page store: placement among disks (docs/PROTOCOL.md §4), an
//! optional memory tier, counters. Blocking API: the server calls the
//! I/O methods from the blocking pool, never on the async reactor.
//!
//! Layers: [`device::Device`] (aligned positional I/O, faults injectable),
//! [`alloc::Allocator`] (extents), [`journal::Journal`] (index log),
//! [`disk::Disk`] (one disk: index, eviction, recovery), [`mem::MemTier`].

pub mod alloc;
pub mod arena;
pub mod behind;
pub mod buf;
pub mod device;
pub mod disk;
pub mod journal;
pub mod mem;
pub mod shares;
pub mod warm;

mod background;
mod health;
mod put;
mod read;
mod stats;
pub mod tenants;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kv_common::page::{HeaderError, PageHeader};

pub use buf::{AlignedBuf, BufPool, FreeHook, PooledBuf};
pub use device::{Device, FileDevice};
pub use disk::{Disk, DiskError, Lookup, PutResult, RecoveryReport};

use health::{DownDeletes, Slot, View, DOWN_DELETES_MAX, SINCE_SNAPSHOT_MAX};
use stats::Counters;

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
    /// `ack = "memory"`: puts are answered once held in memory, at most
    /// this many bytes held and not yet on a disk (needs a memory tier).
    /// None: answered once on media (`ack = "media"`).
    pub ack_memory_max: Option<u64>,
    /// Threads [`Store::open`] starts: write-behind flushers (when puts are
    /// acknowledged from memory) and prefetch warmers (with a memory tier).
    /// Zero starts none: a test that wants pages held starts them itself
    /// ([`Store::start_flushers`], [`Store::start_warmers`]).
    pub flushers: usize,
    pub warmers: usize,
}

impl StoreConfig {
    /// Write-behind flushers for `disks` disks: eight a disk (their puts
    /// share each disk's group commits: with two, a group held at most two
    /// records and the queue drained slower), 8 to 64.
    pub fn default_flushers(disks: usize) -> usize {
        (8 * disks).clamp(8, 64)
    }
}

/// Prefetch warmers a node runs.
pub const WARMERS: usize = 2;

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
    /// A key too long for a tenant's namespace (crate::tenant).
    #[error("{0}")]
    TenantKey(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    Duplicate,
}

/// Names the record one put stored ([`Store::put_copy`]), so that it alone
/// can be removed later ([`Store::delete_if_stamp`]): a record stored under
/// the same key since carries another stamp. In memory only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp(u64);

/// How far [`Store::try_put_held`] got with a put.
pub enum Held {
    /// Settled without disk I/O: refused, a duplicate, or acknowledged
    /// from memory.
    Done(Result<PutOutcome, StoreError>),
    /// It must reach media first: pass it to [`Store::put_to_media`].
    ToMedia(ToMedia),
}

/// A put checked and padded, on its way to media.
pub struct ToMedia {
    rec: Arc<PooledBuf>,
    key: Vec<u8>,
    header: PageHeader,
    generation: u64,
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

/// The largest record [`Store::try_put_held`] checks on an async thread:
/// its payload CRC takes tens of microseconds; a larger record's CRC (a
/// 256 MiB record's takes tens of milliseconds) runs on a blocking thread.
pub const INLINE_PUT_MAX: usize = 1 << 20;

/// Records a write-behind flusher takes at once, and their bytes (past
/// which it takes no more): each disk's share of them is one vectored write
/// and one group commit. The record that reaches the bytes closes a batch
/// (records of 1 to 4 MiB share a run of up to four; one of 4 MiB or more
/// at the queue's head goes alone), so the flushers keep several large
/// writes in flight. While a batch a disk is
/// being written, the next waits until it is full (or has waited
/// `behind::LINGER`): under load, small records gather into large writes.
/// Each disk write and commit costs the node a sleep and a wake-up (and, in
/// a VM, an exit to the host): 64 records of 64 KiB a batch cost a
/// memory-acked 64 KiB put about a fifth less CPU than 16 did
/// (docs/BENCHMARKS.md, Set AJ); 128 and 256 measured no better.
pub const FLUSH_BATCH: usize = 64;
pub const FLUSH_BATCH_BYTES: u64 = 4 << 20;

/// Bytes all prefetch warming holds at once, at most: an eighth of the
/// memory tier, up to 256 MiB. It covers the packed keys of exist batches
/// queued or being sorted and the pages (records and keys) queued or being
/// read (docs/ARCHITECTURE.md, "Prefetch warming").
pub fn warm_budget(mem_cap: u64) -> u64 {
    (mem_cap / 8).min(256 << 20)
}

/// How long closing the store waits for the flushers to write what was
/// acknowledged from memory.
pub const FLUSH_AT_CLOSE: Duration = Duration::from_secs(60);

/// How often the directories of disks out of service are checked for a
/// repaired filesystem.
pub const REVIVE_EVERY: Duration = Duration::from_secs(5);

/// How long a disk out of service whose filesystem was not remounted waits
/// before it is tried again (doubling with each revival of its slot).
pub const REVIVE_BACKOFF: Duration = Duration::from_secs(60);

/// Opens a disk's data file again when the disk is taken back into service.
pub type Reopen = Arc<dyn Fn(&Path, bool) -> io::Result<Box<dyn Device>> + Send + Sync>;

pub struct Store {
    view: RwLock<Arc<View>>,
    specs: Vec<DiskSpec>,
    sync_writes: bool,
    /// None: disks taken out of service stay out until the next start.
    reopen: Option<Reopen>,
    last_revive: Mutex<Instant>,
    /// Per slot: times its disk was taken back into service (the back-off).
    revivals: Vec<std::sync::atomic::AtomicU32>,
    down_deletes: Mutex<DownDeletes>,
    /// Called at the start of each disk's revival scan (tests).
    revival_hook: Mutex<Option<RevivalHook>>,
    mem: Option<mem::MemTier>,
    /// Puts acknowledged from memory and not yet on a disk.
    behind: Option<Arc<behind::WriteBehind>>,
    /// Reads pages an exist found on disk into the memory tier.
    warmer: Option<Arc<warm::Warmer>>,
    /// Tenants' quotas in force ([`Store::set_quotas`]).
    quotas: Mutex<kv_common::quota::Quotas>,
    /// Each tenant's gets and puts.
    tenant_ops: tenants::TenantOps,
    pool: BufPool,
    c: Counters,
    started: Instant,
}

/// See [`Store::on_revival_scan`].
pub type RevivalHook = Box<dyn Fn() + Send + Sync>;

/// A device factory: the real one opens `data.kvc` with O_DIRECT.
pub type DeviceFactory<'a> = &'a (dyn Fn(&Path, bool) -> io::Result<Box<dyn Device>> + Sync);

fn file_device(path: &Path, sync: bool) -> io::Result<Box<dyn Device>> {
    Ok(Box::new(FileDevice::open(path, sync)?))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Weight of a disk in placement: its cap in GiB, at least 1 (docs/PROTOCOL.md §4).
pub fn disk_weight(cap: u64) -> u32 {
    (cap >> 30).clamp(1, u32::MAX as u64) as u32
}

impl Store {
    /// Opens the store on real files, and starts the threads `cfg` asks
    /// for. A disk taken out of service closes its files; its directory is
    /// checked every [`REVIVE_EVERY`] and the disk is taken back once its
    /// marker can be read again (the same filesystem repaired and
    /// remounted).
    pub fn open(cfg: &StoreConfig) -> Result<(Arc<Store>, Vec<RecoveryReport>), String> {
        Store::open_on(cfg, &file_device, Some(Arc::new(file_device)))
    }

    /// Opens every disk (in parallel) with devices from `make` (a disk
    /// taken out of service stays out), and starts the threads `cfg` asks
    /// for.
    pub fn open_with(cfg: &StoreConfig, make: DeviceFactory<'_>) -> Result<(Arc<Store>, Vec<RecoveryReport>), String> {
        Store::open_on(cfg, make, None)
    }

    fn open_on(
        cfg: &StoreConfig,
        make: DeviceFactory<'_>,
        reopen: Option<Reopen>,
    ) -> Result<(Arc<Store>, Vec<RecoveryReport>), String> {
        if cfg.disks.is_empty() {
            return Err("no --dir given".into());
        }
        if cfg.ack_memory_max.is_some() && cfg.mem_cap == 0 {
            return Err("ack = \"memory\" needs a memory tier (--mem-cap)".into());
        }
        // With a memory tier, buffers come from an arena of its size (plus
        // the pool's), faulted in by its own thread while the disks recover.
        let arena = match (cfg.mem_cap > 0).then(|| (cfg.mem_cap as usize).checked_add(cfg.pool_bytes)).flatten() {
            Some(len) => arena::Arena::new(len),
            None => None,
        };
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
        let mut slots = Vec::new();
        let mut reports = Vec::new();
        for r in opened {
            let (d, rep) = r?;
            slots.push(Slot::Live(Arc::new(d)));
            reports.push(rep);
        }
        let store = Store {
            revivals: slots.iter().map(|_| Default::default()).collect(),
            view: RwLock::new(Arc::new(View::new(health::Carried::new(slots.len()), slots))),
            specs: cfg.disks.clone(),
            sync_writes: cfg.sync_writes,
            reopen,
            last_revive: Mutex::new(Instant::now()),
            down_deletes: Mutex::new(DownDeletes::default()),
            revival_hook: Mutex::new(None),
            mem: (cfg.mem_cap > 0).then(|| mem::MemTier::new(cfg.mem_cap)),
            behind: cfg.ack_memory_max.map(|max| {
                Arc::new(behind::WriteBehind::with_batches(max, FLUSH_BATCH, FLUSH_BATCH_BYTES, cfg.disks.len()))
            }),
            warmer: (cfg.mem_cap > 0).then(|| Arc::new(warm::Warmer::new(warm_budget(cfg.mem_cap)))),
            quotas: Mutex::new(Default::default()),
            tenant_ops: Default::default(),
            pool: BufPool::with_arena(cfg.pool_bytes, arena),
            c: Counters::default(),
            started: Instant::now(),
        };
        let store = Arc::new(store);
        if cfg.flushers > 0 {
            Store::start_flushers(&store, cfg.flushers)
                .map_err(|e| format!("cannot start the write-behind flushers: {e}"))?;
        }
        if cfg.warmers > 0 {
            Store::start_warmers(&store, cfg.warmers).map_err(|e| format!("cannot start the prefetch warmers: {e}"))?;
        }
        Ok((store, reports))
    }

    /// The disk (index) that owns `key` among disks in service.
    pub fn owner(&self, key: &[u8]) -> Option<usize> {
        let v = self.view();
        v.ring.owner(key).map(|m| v.disk_of[m])
    }

    /// Waits up to `limit` until the memory tier's arena is faulted in, so
    /// that a node starts serving at full speed (docs/ARCHITECTURE.md,
    /// "Starting"): true when it is (or there is none), false at the limit.
    pub fn wait_memory_ready(&self, limit: std::time::Duration) -> bool {
        self.pool.arena().is_none_or(|a| a.wait_warm_up(limit))
    }

    pub fn pool(&self) -> &BufPool {
        &self.pool
    }

    /// The disks in service, in `--dir` order (a disk out of service is
    /// left out, so indices shift while one is out).
    pub fn disks(&self) -> Vec<Arc<Disk>> {
        self.view().live().cloned().collect()
    }

    /// Every key stored, most recently used first across the node's disks
    /// (by when each was last stored or read from its disk; a get served
    /// by the memory tier does not refresh its disk's entry).
    pub fn keys_by_recency(&self) -> Vec<Arc<[u8]>> {
        let lists: Vec<Vec<(Arc<[u8]>, u64)>> = self.view().live().map(|d| d.keys_by_recency()).collect();
        let mut out = Vec::with_capacity(lists.iter().map(Vec::len).sum());
        let mut its: Vec<_> = lists.into_iter().map(Vec::into_iter).collect();
        // Disks interleaved (the order among keys of one tick, and among
        // keys recovered and not used since), then by when each key was
        // last stored or read, across the node's disks.
        loop {
            let before = out.len();
            for it in &mut its {
                out.extend(it.next());
            }
            if out.len() == before {
                break;
            }
        }
        out.sort_by_key(|(_, used)| std::cmp::Reverse(*used));
        out.into_iter().map(|(k, _)| k).collect()
    }

    /// Removes a key from every tier. True when something was removed.
    pub fn delete(&self, key: &[u8]) -> bool {
        // Disks first, then memory: the memory removal bumps the generation
        // after the record is gone from disk, so a get that read it from
        // disk before the delete cannot put it back into memory after.
        // Not yet on its disk first: this waits for a flush of the key in
        // progress, so the disks' delete below comes after its write.
        let mut any = self.behind.as_ref().is_some_and(|b| b.remove(key));
        let v = self.view();
        for d in v.live() {
            any |= d.delete(key);
        }
        any |= self.mem.as_ref().is_some_and(|m| m.remove(key));
        if v.any_out() {
            // The disk out of service may still hold the key: it must not
            // come back with it.
            {
                let mut dd = lock(&self.down_deletes);
                if dd.keys.len() < DOWN_DELETES_MAX {
                    let h = dd.hash(key);
                    // Copies the set only when a revival's scan holds a snapshot.
                    Arc::make_mut(&mut dd.keys).insert(h);
                } else {
                    dd.overflowed = true;
                }
                if let Some(since) = &mut dd.since_snapshot {
                    match since {
                        Some(keys) if keys.len() < SINCE_SNAPSHOT_MAX => keys.push(key.to_vec()),
                        _ => *since = None,
                    }
                }
            }
            // A disk taken back between our view and the record above did
            // not see the key: delete it there too.
            let now = self.view();
            if !Arc::ptr_eq(&v, &now) {
                for d in now.live() {
                    any |= d.delete(key);
                }
            }
        }
        any
    }

    /// Checks records recovered after an unclean stop, reading about
    /// `max_bytes` in all; drops the damaged ones. Returns how many were checked.
    pub fn scrub(&self, max_bytes: u64) -> usize {
        let mut n = 0;
        let mut left = max_bytes;
        for d in self.view().live() {
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

    /// Clean stop: every disk checkpoints and marks itself clean.
    pub fn close(&self) -> io::Result<()> {
        if let Some(b) = &self.behind {
            // What was acknowledged from memory goes to its disks first.
            let held = b.bytes();
            let left = b.stop_and_flush(FLUSH_AT_CLOSE);
            if left > 0 {
                tracing::error!(pages = left, "write-behind not flushed in time: those pages are lost");
            } else if held > 0 {
                tracing::info!(bytes = held, "write-behind flushed");
            }
        }
        let mut first_err = None;
        for d in self.view().live() {
            if let Err(e) = d.close() {
                tracing::error!(disk = %d.id, error = %e, "checkpoint at shutdown failed");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
