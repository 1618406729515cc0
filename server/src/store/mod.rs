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
pub mod warm;

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kv_common::page::{parse_record, Geometry, HeaderError, PageHeader};
use kv_common::ring::{Ring, RingMember};
use kv_common::stats::NodeStats;

pub use buf::{set_free_hook, AlignedBuf, BufPool, PooledBuf};
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
    /// `ack = "memory"`: puts are answered once held in memory, at most
    /// this many bytes held and not yet on a disk (needs a memory tier).
    /// None: answered once on media (`ack = "media"`).
    pub ack_memory_max: Option<u64>,
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

/// A disk's place in the store: in service, or out of service with every
/// file of it closed (so its filesystem can be unmounted and repaired).
#[derive(Clone)]
enum Slot {
    Live(Arc<Disk>),
    Down(Arc<DownDisk>),
}

/// A disk taken out of service: what it was and why.
struct DownDisk {
    id: String,
    dir: PathBuf,
    cap: u64,
    failure: String,
    /// Why the last attempt to take it back failed (logged once per change).
    last_attempt: Mutex<Option<String>>,
    /// When it was taken out, and the mount its directory was on then.
    since: Instant,
    mount: Option<u64>,
    /// Its marker was unreadable at a check since (the filesystem went away).
    seen_gone: std::sync::atomic::AtomicBool,
}

/// Whether the disk marker in `dir` can be opened and read (a filesystem
/// shut down answers `stat` from its caches but fails every open with EIO).
fn marker_readable(dir: &Path) -> bool {
    std::fs::read(dir.join(disk::MARKER_FILE)).is_ok_and(|t| !t.is_empty())
}

/// The id of the mount `dir` is on (`/proc/self/mountinfo`): a new id after
/// an unmount and mount. None when it cannot be told.
fn mount_id(dir: &Path) -> Option<u64> {
    let dir = std::path::absolute(dir).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let id = f.next()?.parse::<u64>().ok()?;
            let point = f.nth(3)?.replace("\\040", " ");
            dir.starts_with(&point).then_some((point.len(), id))
        })
        .max()
        .map(|(_, id)| id)
}

/// The disks as operations see them: the slots and the placement over the
/// disks in service. Replaced whole (one read lock per operation).
struct View {
    slots: Vec<Slot>,
    /// Per slot: evictions and damaged records dropped by the disk's
    /// earlier incarnations (counters stay monotonic across a revival);
    /// in the view, so a scrape never counts a disk twice.
    carried: Vec<[u64; 2]>,
    ring: Ring,
    /// Ring member index -> slot index.
    disk_of: Vec<usize>,
}

impl View {
    fn new(carried: Vec<[u64; 2]>, slots: Vec<Slot>) -> View {
        let mut members = Vec::new();
        let mut disk_of = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            if let Slot::Live(d) = s {
                if !d.is_failed() {
                    members.push(RingMember { id: d.id.clone(), weight: disk_weight(d.cap()) });
                    disk_of.push(i);
                }
            }
        }
        View { ring: Ring::new(members), disk_of, slots, carried }
    }

    fn live(&self) -> impl Iterator<Item = &Arc<Disk>> {
        self.slots.iter().filter_map(|s| match s {
            Slot::Live(d) => Some(d),
            Slot::Down(_) => None,
        })
    }

    /// A disk out of service or failing (not yet closed).
    fn any_out(&self) -> bool {
        self.slots.iter().any(|s| match s {
            Slot::Live(d) => d.is_failed(),
            Slot::Down(_) => true,
        })
    }
}

/// Keys deleted while a disk was out of service (as 64-bit hashes: a
/// collision only makes a disk taken back forget one more key): a disk taken
/// back forgets them, its index still holds them. Bounded; past the bound a
/// disk taken back starts empty.
///
/// A revival scans a disk's keys against a snapshot of the set (an `Arc`,
/// taken under the lock in O(1)), not under the lock: deletes go on during
/// the scan, and those recorded meanwhile are also kept by key in
/// `since_snapshot` and applied to the revived disk when it is put back.
#[derive(Default)]
struct DownDeletes {
    keys: Arc<HashSet<u64>>,
    hasher: std::hash::RandomState,
    overflowed: bool,
    /// During a revival's scan: the keys deleted since its snapshot (None
    /// past [`SINCE_SNAPSHOT_MAX`]: the revived disks are then checked whole).
    since_snapshot: Option<Option<Vec<Vec<u8>>>>,
}

/// Keys deleted during a revival's scan that are kept by key.
const SINCE_SNAPSHOT_MAX: usize = 1 << 16;

impl DownDeletes {
    fn hash(&self, key: &[u8]) -> u64 {
        std::hash::BuildHasher::hash_one(&self.hasher, key)
    }
}

const DOWN_DELETES_MAX: usize = 1 << 20;

/// The largest record [`Store::try_put_held`] checks on an async thread:
/// its payload CRC takes tens of microseconds; a larger record's CRC (a
/// 256 MiB record's takes tens of milliseconds) runs on a blocking thread.
pub const INLINE_PUT_MAX: usize = 1 << 20;

/// Records a write-behind flusher takes at once, and their bytes (past
/// which it takes no more): each disk's share of them is one vectored write
/// and one group commit. Records of 1 MiB and more go alone, so the
/// flushers keep several large writes in flight. While a batch a disk is
/// being written, the next waits until it is full (or has waited
/// `behind::LINGER`): under load, small records gather into large writes.
pub const FLUSH_BATCH: usize = 16;
pub const FLUSH_BATCH_BYTES: u64 = 1 << 20;

/// Whether a record held in memory would be a hit for `geo`.
fn presence_of(rec: &PooledBuf, geo: Option<&Geometry>) -> Presence {
    match (geo, PageHeader::decode(rec.as_slice())) {
        (Some(g), Ok(h)) if !g.matches(&h) => Presence::Mismatch,
        _ => Presence::Present,
    }
}

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
    misses_corrupt: AtomicU64,
    /// Kept apart (not derived by subtraction) so each exported counter is
    /// monotonic even when read while gets run.
    misses_absent: AtomicU64,
    disk_hits: AtomicU64,
}

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
    /// Opens the store on real files. A disk taken out of service closes
    /// its files; its directory is checked every [`REVIVE_EVERY`] and the
    /// disk is taken back once its marker can be read again (the same
    /// filesystem repaired and remounted).
    pub fn open(cfg: &StoreConfig) -> Result<(Store, Vec<RecoveryReport>), String> {
        let (mut s, r) = Store::open_with(cfg, &file_device)?;
        s.reopen = Some(Arc::new(file_device));
        Ok((s, r))
    }

    /// Opens every disk (in parallel) with devices from `make`.
    pub fn open_with(cfg: &StoreConfig, make: DeviceFactory<'_>) -> Result<(Store, Vec<RecoveryReport>), String> {
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
            view: RwLock::new(Arc::new(View::new(vec![[0, 0]; slots.len()], slots))),
            specs: cfg.disks.clone(),
            sync_writes: cfg.sync_writes,
            reopen: None,
            last_revive: Mutex::new(Instant::now()),
            down_deletes: Mutex::new(DownDeletes::default()),
            revival_hook: Mutex::new(None),
            mem: (cfg.mem_cap > 0).then(|| mem::MemTier::new(cfg.mem_cap)),
            behind: cfg.ack_memory_max.map(|max| {
                Arc::new(behind::WriteBehind::with_batches(max, FLUSH_BATCH, FLUSH_BATCH_BYTES, cfg.disks.len()))
            }),
            warmer: (cfg.mem_cap > 0).then(|| Arc::new(warm::Warmer::new(warm_budget(cfg.mem_cap)))),
            pool: BufPool::with_arena(cfg.pool_bytes, arena),
            c: Counters::default(),
            started: Instant::now(),
        };
        Ok((store, reports))
    }

    /// Places keys over the disks in service.
    fn rebuild_ring(&self) {
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        *w = Arc::new(View::new(w.carried.clone(), w.slots.clone()));
    }

    fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The disk (index) that owns `key` among disks in service.
    pub fn owner(&self, key: &[u8]) -> Option<usize> {
        let v = self.view();
        v.ring.owner(key).map(|m| v.disk_of[m])
    }

    // Lookups search every disk in service, in order: a probe is an
    // in-memory hash lookup, cheaper than computing placement (an xxh3 hash
    // and a ring search), and searching all disks keeps records findable
    // after a disk failure or a cap change moved placement. Placement only
    // decides where a put goes.

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

    /// Stores a whole record held in `rec`. Blocking. With `ack = "memory"`
    /// it returns once the record is held for a flusher (or, past the
    /// bound, once on media).
    pub fn put(&self, rec: PooledBuf) -> Result<PutOutcome, StoreError> {
        let held = match self.held_with(rec, true, |d, k| Ok::<_, std::convert::Infallible>(d.contains(k))) {
            Ok(h) => h,
            Err((_, never)) => match never {},
        };
        match held {
            Held::Done(r) => r,
            Held::ToMedia(p) => self.put_to_media(p),
        }
    }

    /// Stores a ring-handoff copy (docs/ARCHITECTURE.md, "Ring
    /// transitions"): as [`Store::put`], but always on media before it
    /// returns (never acknowledged from memory, whatever `ack` says), and
    /// with the stamp of the record it stored, so that the copy, and
    /// nothing stored under its key since, can be taken out again
    /// ([`Store::delete_if_stamp`]). Blocking.
    pub fn put_copy(&self, rec: PooledBuf) -> Result<(PutOutcome, Option<Stamp>), StoreError> {
        let held = match self.held_with(rec, false, |d, k| Ok::<_, std::convert::Infallible>(d.contains(k))) {
            Ok(h) => h,
            Err((_, never)) => match never {},
        };
        match held {
            Held::Done(r) => r.map(|o| (o, None)),
            Held::ToMedia(p) => self.put_to_media_stamped(p),
        }
    }

    /// Removes `key` from the disks and the memory tier only if its record
    /// is still the one that `stamp` names (a put acknowledged after that
    /// record was deleted keeps its own). Journalled as any delete. True
    /// when it removed it.
    pub fn delete_if_stamp(&self, key: &[u8], stamp: Stamp) -> bool {
        // As in `delete`: disks first, then memory. While the disk's entry
        // carried the stamp no other put of the key could be stored (write-
        // once), so what memory holds under it is this record; a put stored
        // after the disk's removal loses at most its memory copy (it is on
        // its disk, or held for a flusher, still).
        let removed = self.view().live().any(|d| d.delete_if_stamp(key, stamp.0));
        if removed {
            if let Some(m) = &self.mem {
                m.remove(key);
            }
        }
        removed
    }

    /// Whether puts may be acknowledged from memory (`ack = "memory"`):
    /// then [`Store::try_put_held`] finishes most puts without disk I/O, on
    /// the caller's thread.
    pub fn acks_in_memory(&self) -> bool {
        self.behind.is_some()
    }

    /// The part of a put that needs no disk I/O, for async code: the
    /// payload's CRC, the duplicate check and, with `ack = "memory"`,
    /// holding the page for a flusher. Done when that settled it; ToMedia
    /// when the put must reach media first ([`Store::put_to_media`], which
    /// blocks). It never waits: a record over [`INLINE_PUT_MAX`] (its CRC
    /// alone would hold the caller's thread too long) or a disk index lock
    /// busy now (a flusher or a checkpoint holds it across I/O) gives the
    /// record back, for [`Store::put`] on a blocking thread (which checks
    /// the CRC again: a busy lock is rare, and a record up to 1 MiB costs
    /// tens of microseconds).
    pub fn try_put_held(&self, rec: PooledBuf) -> Result<Held, PooledBuf> {
        if rec.len() > INLINE_PUT_MAX {
            return Err(rec);
        }
        self.held_with(rec, true, Disk::try_contains).map_err(|(rec, disk::Busy)| rec)
    }

    /// [`Store::try_put_held`] with `contains` asking a disk whether it
    /// holds a key: Err (the record back, and why) only when `contains`
    /// gave up. `may_hold`: whether the put may be acknowledged from memory.
    fn held_with<E>(
        &self,
        mut rec: PooledBuf,
        may_hold: bool,
        contains: impl Fn(&Disk, &[u8]) -> Result<bool, E>,
    ) -> Result<Held, (PooledBuf, E)> {
        let (header, key) = match parse_record(rec.as_slice()) {
            Ok(hk) => hk,
            Err(e) => return Ok(Held::Done(Err(e.into()))),
        };
        // The node refuses a page whose payload does not match its CRC, so
        // nothing it stores can fail the reader's check through its writer.
        let payload = &rec.as_slice()[kv_common::page::HEADER_LEN + key.len()..];
        if crc32fast::hash(payload) != header.payload_crc {
            return Ok(Held::Done(Err(StoreError::BadPayload)));
        }
        let key = key.to_vec();
        // Held for a flusher first: a flusher lets go of a key only once its
        // disk has it, so this order never misses a key between the two.
        let mut present = self.behind.as_ref().is_some_and(|b| b.contains(&key));
        if !present {
            for d in self.view().live() {
                match contains(d.as_ref(), &key) {
                    Ok(false) => {}
                    Ok(true) => {
                        present = true;
                        break;
                    }
                    Err(e) => return Err((rec, e)),
                }
            }
        }
        if present {
            self.c.put_duplicates.fetch_add(1, Ordering::Relaxed);
            return Ok(Held::Done(Ok(PutOutcome::Duplicate)));
        }
        let generation = self.mem.as_ref().map_or(0, |m| m.generation());
        rec.pad_to_align();
        let rec = Arc::new(rec);
        if let Some(b) = self.behind.as_ref().filter(|_| may_hold && self.can_store(&key, rec.len() as u64)) {
            if b.hold(&key, rec.clone()) {
                self.c.puts.fetch_add(1, Ordering::Relaxed);
                self.c.bytes_written.fetch_add(rec.len() as u64, Ordering::Relaxed);
                if let Some(m) = &self.mem {
                    m.replace(&key, rec, generation);
                }
                return Ok(Held::Done(Ok(PutOutcome::Stored)));
            }
            if b.contains(&key) {
                self.c.put_duplicates.fetch_add(1, Ordering::Relaxed);
                return Ok(Held::Done(Ok(PutOutcome::Duplicate)));
            }
            if !b.stopping() {
                b.c.fallbacks.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(Held::ToMedia(ToMedia { rec, key, header, generation }))
    }

    /// The rest of a put [`Store::try_put_held`] did not settle: the record on
    /// its disk (acknowledged once on media), then in the memory tier.
    pub fn put_to_media(&self, p: ToMedia) -> Result<PutOutcome, StoreError> {
        self.put_to_media_stamped(p).map(|(o, _)| o)
    }

    /// [`Store::put_to_media`], with the stamp of the record stored.
    fn put_to_media_stamped(&self, p: ToMedia) -> Result<(PutOutcome, Option<Stamp>), StoreError> {
        let ToMedia { rec, key, header, generation } = p;
        let out = self.put_on_disk(&rec, &key, &header);
        match out {
            Ok((PutOutcome::Stored, _)) => {
                self.c.puts.fetch_add(1, Ordering::Relaxed);
                self.c.bytes_written.fetch_add(rec.len() as u64, Ordering::Relaxed);
                if let Some(m) = &self.mem {
                    // A copy still held from before the disk evicted
                    // the key must not shadow the page just stored.
                    m.replace(&key, rec, generation);
                }
            }
            Ok((PutOutcome::Duplicate, _)) => {
                self.c.put_duplicates.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.c.put_rejected.fetch_add(1, Ordering::Relaxed);
            }
        }
        out
    }

    /// Whether a disk in service owns `key` and can hold a record of `len`
    /// bytes (what a put acknowledged from memory must be able to become;
    /// otherwise the put takes the media path and gets its error).
    fn can_store(&self, key: &[u8], len: u64) -> bool {
        let v = self.view();
        match v.ring.owner(key).map(|m| &v.slots[v.disk_of[m]]) {
            Some(Slot::Live(d)) => !d.is_failed() && buf::align_up(len) <= d.cap(),
            _ => false,
        }
    }

    /// Writes a padded record to the disk that owns its key (another, once,
    /// if that disk fails meanwhile).
    fn put_on_disk(
        &self,
        rec: &Arc<PooledBuf>,
        key: &[u8],
        header: &PageHeader,
    ) -> Result<(PutOutcome, Option<Stamp>), StoreError> {
        for _ in 0..2 {
            let v = self.view();
            let Some(Slot::Live(disk)) = v.ring.owner(key).map(|m| &v.slots[v.disk_of[m]]) else {
                return Err(StoreError::NoDisk);
            };
            match Self::put_outcome(disk.put_gathered(rec, key, header)) {
                Some(r) => return r,
                None => self.rebuild_ring(),
            }
        }
        Err(StoreError::NoDisk)
    }

    /// A disk's answer to a put, as the store's (with the stored record's
    /// stamp); None when the disk failed (the caller rebuilds the ring and
    /// places the record again).
    fn put_outcome(r: Result<PutResult, DiskError>) -> Option<Result<(PutOutcome, Option<Stamp>), StoreError>> {
        Some(match r {
            Ok(PutResult::Duplicate) => Ok((PutOutcome::Duplicate, None)),
            Ok(PutResult::Stored(s)) => Ok((PutOutcome::Stored, Some(Stamp(s)))),
            Err(DiskError::Failed(_)) => return None,
            Err(DiskError::Full(d)) => Err(StoreError::Full(d)),
            Err(DiskError::TooLarge(n)) => Err(StoreError::TooLarge(format!("{n} bytes exceed the disk cap"))),
        })
    }

    /// Writes a flusher's batch: the records of each disk with one group
    /// commit for them all ([`Disk::put_many`]); a record on a disk that
    /// failed meanwhile is placed again alone ([`Store::put_on_disk`]).
    fn put_on_disk_many(&self, batch: &[(Box<[u8]>, Arc<PooledBuf>)]) -> Vec<Result<PutOutcome, StoreError>> {
        let mut out: Vec<Result<PutOutcome, StoreError>> = Vec::with_capacity(batch.len());
        let v = self.view();
        // Items by the disk that owns them (index into the view's slots),
        // each with its header; a record without an owner is not written.
        let mut groups: Vec<(usize, Vec<(usize, PageHeader)>)> = Vec::new();
        for (i, (key, rec)) in batch.iter().enumerate() {
            let header = match PageHeader::decode(rec.as_slice()) {
                Ok(h) => h,
                Err(e) => {
                    out.push(Err(StoreError::BadRecord(e)));
                    continue;
                }
            };
            out.push(Err(StoreError::NoDisk));
            let Some(m) = v.ring.owner(key) else { continue };
            let slot = v.disk_of[m];
            match groups.iter_mut().find(|g| g.0 == slot) {
                Some(g) => g.1.push((i, header)),
                None => groups.push((slot, vec![(i, header)])),
            }
        }
        for (slot, items) in groups {
            let Slot::Live(disk) = &v.slots[slot] else { continue };
            let recs: Vec<(&PooledBuf, &[u8], &PageHeader)> =
                items.iter().map(|(i, h)| (&*batch[*i].1, &batch[*i].0[..], h)).collect();
            for ((i, h), r) in items.iter().zip(disk.put_many(&recs)) {
                out[*i] = Self::put_outcome(r)
                    .unwrap_or_else(|| {
                        // Its disk failed meanwhile: placed again alone.
                        self.rebuild_ring();
                        self.put_on_disk(&batch[*i].1, &batch[*i].0, h)
                    })
                    .map(|(o, _)| o);
            }
        }
        out
    }

    /// Runs a flusher of the write-behind (`ack = "memory"`) until the
    /// store stops or is dropped (it holds the store only while it writes).
    /// A flusher takes up to [`FLUSH_BATCH`] records ([`FLUSH_BATCH_BYTES`])
    /// at once and commits each disk's share of them together.
    fn flusher(store: std::sync::Weak<Store>, b: Arc<behind::WriteBehind>) {
        loop {
            let batch = b.next_batch();
            if batch.is_empty() {
                if b.stopping() || store.strong_count() == 0 {
                    return;
                }
                continue;
            }
            // Lets go of the keys whatever happens below (a delete of one
            // waits until then).
            struct Release<'a>(&'a behind::WriteBehind, Vec<(&'a [u8], bool)>);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    self.0.done_batch(self.1.iter().map(|&(k, w)| (k, w)));
                }
            }
            let mut release = Release(&b, batch.iter().map(|(k, _)| (&k[..], false)).collect());
            let Some(s) = store.upgrade() else { return };
            for ((key, written), r) in release.1.iter_mut().zip(s.put_on_disk_many(&batch)) {
                *written = match r {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(key = %String::from_utf8_lossy(key), error = %e, "write-behind: page not written: it now misses");
                        false
                    }
                };
            }
            drop(s);
            drop(release);
        }
    }

    /// After an exist: hands the keys `found` present to a warmer, which
    /// reads those only on disk into the memory tier. On the reactor: one
    /// buffer and a lock never waited for.
    pub fn warm(&self, keys: &[&[u8]], found: &[Presence]) {
        let Some(w) = &self.warmer else { return };
        if !found.contains(&Presence::Present) {
            return;
        }
        w.offer_keys(|| {
            warm::encode_keys(keys.iter().zip(found).filter(|(_, p)| **p == Presence::Present).map(|(k, _)| *k))
        });
    }

    /// On a warmer: queues the keys of `packed` that are only on disk; how
    /// many.
    fn sort_for_warming(&self, w: &warm::Warmer, packed: &[u8]) -> usize {
        let Some(m) = &self.mem else { return 0 };
        let keys = warm::decode_keys(packed);
        let mut in_mem = vec![false; keys.len()];
        m.contains_many(&keys, &mut in_mem);
        let v = self.view();
        let mut queued = 0;
        for (k, held) in keys.into_iter().zip(in_mem) {
            if held || self.behind.as_ref().is_some_and(|b| b.contains(k)) {
                continue;
            }
            if let Some(len) = v.live().find_map(|d| d.record_len(k)) {
                w.offer(k, len);
                queued += 1;
            }
        }
        queued
    }

    /// Reads `key` from its disk into the memory tier; true when it entered.
    fn warm_one(&self, key: &[u8]) -> bool {
        let Some(m) = &self.mem else { return false };
        let generation = m.generation();
        match self.read_cold(key) {
            Some(buf) => {
                m.insert(key, Arc::new(buf), generation);
                true
            }
            None => false,
        }
    }

    /// A record read from the disk holding it, without refreshing its
    /// recency, filling the memory tier or counting a get (warming, the
    /// drain's push). None when no disk holds it whole.
    fn read_cold(&self, key: &[u8]) -> Option<PooledBuf> {
        for d in self.view().live() {
            match d.get(key, None, &self.pool, false) {
                Ok(Lookup::Hit(buf)) => return Some(buf),
                Ok(Lookup::Miss) => {}
                Ok(_) => return None,
                Err(_) => {
                    self.rebuild_ring();
                    return None;
                }
            }
        }
        None
    }

    fn warmer(store: std::sync::Weak<Store>, w: Arc<warm::Warmer>) {
        loop {
            let Some(work) = w.next() else {
                if store.strong_count() == 0 {
                    return;
                }
                continue;
            };
            let Some(s) = store.upgrade() else { return };
            match work {
                warm::Work::Sort(packed) => {
                    let queued = s.sort_for_warming(&w, &packed);
                    w.sorted(packed, queued);
                }
                warm::Work::Read(key, len) => {
                    let warmed = s.warm_one(&key);
                    w.done(&key, len, warmed);
                }
            }
            drop(s);
        }
    }

    /// Waits (up to `timeout`) until every put acknowledged from memory is
    /// on its disk, without refusing new ones (a draining node refuses them
    /// itself). The number of pages still held.
    pub fn flush_behind(&self, timeout: Duration) -> usize {
        self.behind.as_ref().map_or(0, |b| b.wait_empty(timeout))
    }

    /// Starts `n` warmer threads when there is a memory tier.
    pub fn start_warmers(store: &Arc<Store>, n: usize) -> io::Result<()> {
        let Some(w) = &store.warmer else { return Ok(()) };
        for i in 0..n.max(1) {
            let (s, w) = (Arc::downgrade(store), w.clone());
            std::thread::Builder::new().name(format!("warm-{i}")).spawn(move || Store::warmer(s, w))?;
        }
        Ok(())
    }

    /// Starts `n` flusher threads when puts are acknowledged from memory.
    pub fn start_flushers(store: &Arc<Store>, n: usize) -> io::Result<()> {
        let Some(b) = &store.behind else { return Ok(()) };
        for i in 0..n.max(1) {
            let (w, b) = (Arc::downgrade(store), b.clone());
            std::thread::Builder::new().name(format!("flush-{i}")).spawn(move || Store::flusher(w, b))?;
        }
        Ok(())
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
        if let Some(w) = &self.warmer {
            w.note_read(key);
        }
        Some(GetOutcome::Hit(rec))
    }

    /// A record read for the drain's push: from its disk, without
    /// refreshing its recency or filling the memory tier (the pages clients
    /// still read through the handoff keep their place there), and without
    /// counting a get. None when no disk holds it (deleted, evicted).
    pub fn read_for_push(&self, key: &[u8]) -> Option<PooledBuf> {
        self.read_cold(key)
    }

    /// Counts a get answered as a miss without calling [`Store::get`].
    pub fn count_miss(&self) {
        self.c.misses_absent.fetch_add(1, Ordering::Relaxed);
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
                if let Some(w) = &self.warmer {
                    w.note_read(key);
                }
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

    /// Periodic upkeep: journal flush and compaction, vanished-dir checks;
    /// a failed disk's files are closed; every [`REVIVE_EVERY`], disks out
    /// of service are checked for a repaired filesystem.
    pub fn maintain(&self) {
        let v = self.view();
        let mut failed = Vec::new();
        for (i, s) in v.slots.iter().enumerate() {
            let Slot::Live(d) = s else { continue };
            if let Err(e) = d.maintain() {
                tracing::warn!(disk = %d.id, error = %e, "index maintenance failed");
            }
            if d.is_failed() {
                failed.push(i);
            }
        }
        let mut any_down = false;
        for s in &v.slots {
            if let Slot::Down(dd) = s {
                any_down = true;
                // Every tick (one stat): catches a filesystem away for a moment.
                if !marker_readable(&dd.dir) {
                    dd.seen_gone.store(true, Ordering::Relaxed);
                }
            }
        }
        drop(v);
        if !failed.is_empty() {
            self.take_down(&failed);
        }
        let due = {
            let mut last = lock(&self.last_revive);
            let due = last.elapsed() >= REVIVE_EVERY;
            if due {
                *last = Instant::now();
            }
            due
        };
        if any_down && due {
            self.revive_disks();
        }
    }

    /// Replaces failed disks by their description: once the operations in
    /// flight let go of them, their files (data, journal, lock) are closed.
    fn take_down(&self, slots: &[usize]) {
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        let mut next = w.slots.clone();
        let mut carried = w.carried.clone();
        for &i in slots {
            let Slot::Live(d) = &next[i] else { continue };
            if !d.is_failed() {
                continue;
            }
            let st = d.stats();
            carried[i][0] += st.evictions;
            carried[i][1] += d.corrupt_dropped();
            tracing::warn!(
                disk = %d.id, dir = %d.dir.display(), every_s = REVIVE_EVERY.as_secs(),
                "disk out of service: its files are closed; its directory is checked for a repaired filesystem"
            );
            next[i] = Slot::Down(Arc::new(DownDisk {
                id: d.id.clone(),
                dir: d.dir.clone(),
                cap: d.cap(),
                failure: st.failure.unwrap_or_else(|| "failed".into()),
                last_attempt: Mutex::new(None),
                since: Instant::now(),
                mount: mount_id(&d.dir),
                // A filesystem shut down or gone: its marker does not read.
                seen_gone: std::sync::atomic::AtomicBool::new(!marker_readable(&d.dir)),
            }));
        }
        *w = Arc::new(View::new(carried, next));
    }

    /// Calls `hook` at the start of each disk's revival scan (for tests of
    /// what may run meanwhile).
    #[doc(hidden)]
    pub fn on_revival_scan(&self, hook: RevivalHook) {
        *lock(&self.revival_hook) = Some(hook);
    }

    /// Takes disks out of service back when their directory holds the disk
    /// marker again and the disk opens (its index recovered as at a start).
    /// A disk is tried once its filesystem was remounted (the marker was
    /// unreadable at a check, or the directory's mount changed), or else
    /// after a back-off (1 minute, doubling with each time the slot was
    /// taken back, up to an hour), so a disk failing on a bad sector does not
    /// flap. A disk taken back forgets the keys deleted while it was out and
    /// the keys stored on another disk meanwhile (the newer copy wins); the
    /// scan runs against a snapshot of the deletes recorded, with neither the
    /// store's view nor the deletes locked (deletes go on meanwhile), and
    /// only the deletes recorded since, kept by key, are applied under the
    /// lock. Never creates a directory
    /// or a marker: a mount point with nothing mounted stays out. Returns
    /// how many disks came back.
    pub fn revive_disks(&self) -> usize {
        let Some(reopen) = &self.reopen else { return 0 };
        let v = self.view();
        let mut opened = Vec::new();
        for (i, s) in v.slots.iter().enumerate() {
            let Slot::Down(dd) = s else { continue };
            let spec = &self.specs[i];
            if !marker_readable(&spec.dir) {
                dd.seen_gone.store(true, Ordering::Relaxed);
                continue;
            }
            let remounted =
                dd.seen_gone.load(Ordering::Relaxed) || (dd.mount.is_some() && mount_id(&spec.dir) != dd.mount);
            let backoff = REVIVE_BACKOFF * 2u32.pow(self.revivals[i].load(Ordering::Relaxed).min(6));
            if !remounted && dd.since.elapsed() < backoff.min(Duration::from_secs(3600)) {
                continue;
            }
            let t0 = Instant::now();
            let r = reopen(&spec.dir.join(disk::DATA_FILE), self.sync_writes)
                .and_then(|dev| Disk::open(dd.id.clone(), &spec.dir, spec.cap, dev));
            match r {
                Ok((d, rep)) => opened.push((i, d, rep, t0)),
                Err(e) => {
                    let e = e.to_string();
                    let mut last = lock(&dd.last_attempt);
                    if last.as_deref() != Some(e.as_str()) {
                        tracing::warn!(disk = %dd.id, dir = %dd.dir.display(), error = %e, "disk not taken back yet");
                        *last = Some(e);
                    }
                }
            }
        }
        drop(v);
        if opened.is_empty() {
            return 0;
        }
        // The scan, with the view and the deletes unlocked: operations go on
        // meanwhile. It checks against a snapshot of the deletes recorded;
        // those recorded during it are kept by key and applied below.
        let (snapshot, hasher, overflowed) = {
            let mut dd = lock(&self.down_deletes);
            dd.since_snapshot = Some(Some(Vec::new()));
            (dd.keys.clone(), dd.hasher.clone(), dd.overflowed)
        };
        // Deletes stop being kept by key when this revival ends, however.
        struct EndSince<'a>(&'a Mutex<DownDeletes>);
        impl Drop for EndSince<'_> {
            fn drop(&mut self) {
                lock(self.0).since_snapshot = None;
            }
        }
        let _end = EndSince(&self.down_deletes);
        let hash = |k: &[u8]| std::hash::BuildHasher::hash_one(&hasher, k);
        let mut scanned = Vec::new();
        for (i, d, rep, t0) in opened {
            if let Some(hook) = &*lock(&self.revival_hook) {
                hook();
            }
            let others = self.view();
            let mut forgot = 0u64;
            for k in d.keys() {
                if overflowed || snapshot.contains(&hash(&k)) || others.live().any(|o| o.contains(&k)) {
                    d.delete(&k);
                    forgot += 1;
                }
            }
            scanned.push((i, d, rep, t0, forgot));
        }
        drop(snapshot);
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        let mut dd = lock(&self.down_deletes);
        let since = dd.since_snapshot.take().flatten();
        let mut next = w.slots.clone();
        let n = scanned.len();
        for (i, d, rep, t0, mut forgot) in scanned {
            // Deletes recorded during the scan (few, by key); past their
            // bound, or past the set's, the disk is checked whole.
            match &since {
                Some(keys) if !dd.overflowed => {
                    for k in keys {
                        if d.delete(k) {
                            forgot += 1;
                        }
                    }
                }
                _ => {
                    for k in d.keys() {
                        if dd.overflowed || dd.keys.contains(&dd.hash(&k)) {
                            d.delete(&k);
                            forgot += 1;
                        }
                    }
                }
            }
            tracing::warn!(
                disk = %d.id, dir = %d.dir.display(), records = rep.records.saturating_sub(forgot), forgot,
                reclaimed = rep.reclaimed, ms = t0.elapsed().as_millis() as u64, "disk back in service"
            );
            self.revivals[i].fetch_add(1, Ordering::Relaxed);
            next[i] = Slot::Live(Arc::new(d));
        }
        let view = View::new(w.carried.clone(), next);
        if !view.any_out() {
            *dd = DownDeletes::default();
        }
        *w = Arc::new(view);
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

    pub fn stats(&self) -> NodeStats {
        let v = self.view();
        let disks: Vec<_> = v
            .slots
            .iter()
            .zip(&v.carried)
            .map(|(s, c)| {
                let mut st = match s {
                    Slot::Live(d) => d.stats(),
                    Slot::Down(dd) => kv_common::stats::DiskStats {
                        id: dd.id.clone(),
                        dir: dd.dir.display().to_string(),
                        used_bytes: 0,
                        capacity_bytes: dd.cap,
                        objects: 0,
                        evictions: 0,
                        failed: true,
                        failure: Some(dd.failure.clone()),
                        unverified: 0,
                    },
                };
                st.evictions += c[0];
                st
            })
            .collect();
        let corrupt_dropped = v
            .slots
            .iter()
            .zip(&v.carried)
            .map(|(s, c)| {
                c[1] + match s {
                    Slot::Live(d) => d.corrupt_dropped(),
                    Slot::Down(_) => 0,
                }
            })
            .sum();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeStats {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_secs: self.started.elapsed().as_secs(),
            used_bytes: disks.iter().map(|d| d.used_bytes).sum(),
            capacity_bytes: disks.iter().map(|d| d.capacity_bytes).sum(),
            objects: disks.iter().map(|d| d.objects).sum(),
            evictions: disks.iter().map(|d| d.evictions).sum(),
            failed_disks: disks.iter().filter(|d| d.failed).count() as u64,
            corrupt_dropped,
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
            closed_before_hello: 0,
            misses_corrupt: ld(&self.c.misses_corrupt),
            misses_absent: ld(&self.c.misses_absent),
            disk_hits: ld(&self.c.disk_hits),
            node_id: None,
            group: None,
            latency: Vec::new(),
            disks,
            ack_memory: self.behind.is_some(),
            acked_in_memory: self.behind.as_ref().map_or(0, |b| ld(&b.c.acked)),
            unflushed_bytes: self.behind.as_ref().map_or(0, |b| b.bytes()),
            unflushed_max_bytes: self.behind.as_ref().map_or(0, |b| b.max_bytes()),
            ack_fallbacks: self.behind.as_ref().map_or(0, |b| ld(&b.c.fallbacks)),
            flushed: self.behind.as_ref().map_or(0, |b| ld(&b.c.flushed)),
            flush_failed: self.behind.as_ref().map_or(0, |b| ld(&b.c.flush_failed)),
            warmed: self.warmer.as_ref().map_or(0, |w| ld(&w.c.warmed)),
            warmed_read: self.warmer.as_ref().map_or(0, |w| ld(&w.c.warmed_read)),
            warm_skipped: self.warmer.as_ref().map_or(0, |w| ld(&w.c.skipped)),
            ..NodeStats::default()
        }
    }
}
