//! One disk: a data file of extents, an LRU index, and the index journal.
//!
//! Locking: `state` (index, allocator, used bytes) is held only for in-memory
//! work and journal appends, never across data I/O. Journal appends that
//! describe the index (PUT on insert, DEL on evict/delete) happen under
//! `state`, so the journal order is the index order. Lock order: state, then
//! journal; `touched` (memory-tier reads waiting for the index) is a leaf,
//! taken alone or under `state`.
//!
//! Readers pin a record's extent through an `Arc<Extent>`; eviction only
//! drops the index's reference, and the space goes back to the allocator
//! when the last pin is dropped, so space is never reused under a reader.
//!
//! The write path is in `write`; reads, and the index's lookups and
//! deletes, in `read`.

mod read;
mod write;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kv_common::page::{PageHeader, HEADER_LEN};
use kv_common::stats::DiskStats;
use lru::LruCache;

use super::alloc::Allocator;
use super::buf::{align_up, PooledBuf, ALIGN};
use super::device::Device;
use super::journal::{self, Journal, Replayed};

use write::Gather;

pub const DATA_FILE: &str = "data.kvc";
pub const MARKER_FILE: &str = "KVCELLAR_DISK";
pub const CLEAN_FILE: &str = "clean";
const LOCK_FILE: &str = "lock";
const MARKER_TEXT: &str = "kvcellar disk format 1\n";

/// Why a disk operation did not complete.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk {0} is out of service")]
    Failed(String),
    #[error("no space on disk {0}")]
    Full(String),
    #[error("record of {0} bytes exceeds the disk cap")]
    TooLarge(u64),
}

/// A lock was held by someone else (see [`Disk::try_exist`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// Result of a put on one disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutResult {
    /// Stored, and the stamp its index entry carries ([`Disk::delete_if_stamp`]).
    Stored(u64),
    Duplicate,
}

/// Where each disk's stamps start: every disk opened in this process (a
/// revival opens it again) takes its own range of 2^40, so a stamp names one
/// record of one disk's index. Stamps live in memory only; a record
/// recovered from the journal carries 0, which no put is given.
static STAMP_RANGES: AtomicU64 = AtomicU64::new(1);

/// Result of a lookup on one disk.
pub enum Lookup {
    Hit(PooledBuf),
    Mismatch,
    Miss,
    /// The record was found damaged and dropped (answered as a miss).
    Damaged,
}

/// What every extent of a disk shares with the disk.
#[derive(Default)]
struct Shared {
    /// Extents whose last pin dropped, for the allocator to take back.
    released: Mutex<Vec<(u64, u64)>>,
    /// Records recovered after an unclean stop whose payload is unchecked.
    unverified: AtomicU64,
}

/// Space a record occupies; returned to the allocator when the last pin drops.
struct Extent {
    off: u64,
    len: u64,
    /// False for records recovered after an unclean stop until their payload
    /// CRC has been checked once.
    verified: AtomicBool,
    shared: Arc<Shared>,
}

impl Extent {
    /// Marks the payload checked; true the first time.
    fn mark_verified(&self) -> bool {
        let first = !self.verified.swap(true, Ordering::AcqRel);
        if first {
            self.shared.unverified.fetch_sub(1, Ordering::Relaxed);
        }
        first
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        if !*self.verified.get_mut() {
            self.shared.unverified.fetch_sub(1, Ordering::Relaxed);
        }
        lock(&self.shared.released).push((self.off, self.len));
    }
}

struct Entry {
    ext: Arc<Extent>,
    header: PageHeader,
    header_bytes: [u8; HEADER_LEN],
    /// When it was last stored or read ([`use_tick`]; 0: recovered, not
    /// used since): orders one node's disks' keys by recency together.
    used: u64,
    /// Which put stored it ([`STAMP_RANGES`]); in memory only, never journalled.
    stamp: u64,
}

/// Milliseconds since the first call in this process: the recency clock of
/// index entries (a coarse clock read, no shared counter on the get path).
pub fn use_tick() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1
}

/// A live record as a checkpoint copies it: key, header, offset, extent length.
type LiveRecord = (Arc<[u8]>, [u8; HEADER_LEN], u64, u64);

/// What one tenant holds on a disk, and its records evicted there
/// (crate::tenant; the default tenant is id 0).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TenantUse {
    /// Bytes of its records' extents, and the records.
    pub bytes: u64,
    pub objects: u64,
    /// Its records evicted for room since the disk opened.
    pub evictions: u64,
    /// Of those, the ones evicted for another tenant's put (capacity it
    /// borrowed taken back; without quotas, any tenant's put).
    pub evicted_for_others: u64,
}

impl TenantUse {
    pub fn add(&mut self, o: &TenantUse) {
        self.bytes += o.bytes;
        self.objects += o.objects;
        self.evictions += o.evictions;
        self.evicted_for_others += o.evicted_for_others;
    }
}

struct State {
    /// Entries go in and out through [`State::enter`], [`State::remove`],
    /// [`State::evict_lru`] and [`State::clear`], which keep `tenants`.
    index: LruCache<Arc<[u8]>, Entry>,
    alloc: Allocator,
    /// Bytes of allocated extents, pinned-but-evicted ones included.
    used: u64,
    /// The stamp the next record entered gets.
    next_stamp: u64,
    /// What each tenant holds in `index`, by tenant id.
    tenants: std::collections::HashMap<u32, TenantUse>,
    /// Tenants' shares of this disk (empty without quotas), and their
    /// records' recency when there are some.
    shares: super::shares::Shares,
}

impl State {
    fn stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        self.next_stamp += 1;
        s
    }

    /// Each tenant's holding, counted from the index (at open).
    fn tally(index: &LruCache<Arc<[u8]>, Entry>) -> std::collections::HashMap<u32, TenantUse> {
        let mut t: std::collections::HashMap<u32, TenantUse> = std::collections::HashMap::new();
        for (k, e) in index.iter() {
            let u = t.entry(crate::tenant::split(k).0).or_default();
            u.bytes += e.ext.len;
            u.objects += 1;
        }
        t
    }

    fn enter(&mut self, key: Arc<[u8]>, e: Entry) {
        let tenant = crate::tenant::split(&key).0;
        let len = e.ext.len;
        if self.shares.active() {
            self.shares.entered(tenant, key.clone(), len);
        }
        if let Some(old) = self.index.put(key, e) {
            self.left(tenant, &old);
        }
        let u = self.tenants.entry(tenant).or_default();
        u.bytes += len;
        u.objects += 1;
    }

    fn left(&mut self, tenant: u32, e: &Entry) {
        if let Some(u) = self.tenants.get_mut(&tenant) {
            u.bytes = u.bytes.saturating_sub(e.ext.len);
            u.objects = u.objects.saturating_sub(1);
        }
    }

    fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let e = self.index.pop(key)?;
        let tenant = crate::tenant::split(key).0;
        self.left(tenant, &e);
        self.shares.left(tenant, key);
        Some(e)
    }

    /// The record to make room for a put of `need` bytes by `putter`:
    /// the least recently used, or with tenants' shares the one they name
    /// (super::shares).
    fn evict_for(&mut self, putter: u32, need: u64) -> Option<(Arc<[u8]>, Entry)> {
        let named = self.shares.victim(putter, need).and_then(|v| match self.index.pop(&v.key[..]) {
            Some(e) => Some((v.key, e, v.for_another)),
            None => {
                // Never expected: the lists follow the index. Forget the
                // key and fall back to the index's LRU rather than fail.
                self.shares.left(crate::tenant::split(&v.key).0, &v.key);
                None
            }
        });
        let (k, e, for_another) = match named {
            Some(n) => n,
            None => {
                let (k, e) = self.index.pop_lru()?;
                let other = crate::tenant::split(&k).0 != putter;
                (k, e, other)
            }
        };
        let tenant = crate::tenant::split(&k).0;
        self.left(tenant, &e);
        self.shares.left(tenant, &k);
        let u = self.tenants.entry(tenant).or_default();
        u.evictions += 1;
        if for_another {
            u.evicted_for_others += 1;
        }
        Some((k, e))
    }

    /// A read made the record the most recent (of its tenant too).
    fn touch(&mut self, key: &[u8], now: u64) -> Option<&mut Entry> {
        if self.shares.active() {
            self.shares.used(crate::tenant::split(key).0, key);
        }
        let e = self.index.get_mut(key)?;
        e.used = now;
        Some(e)
    }

    /// Whether eviction depends on which tenant puts (tenants' shares).
    fn by_tenant(&self) -> bool {
        self.shares.active()
    }

    /// Sets the tenants' shares of this disk (bytes by tenant id; empty: off).
    fn set_shares(&mut self, share: std::collections::HashMap<u32, u64>) {
        let index = &self.index;
        self.shares.set(share, || {
            index.iter().rev().map(|(k, e)| (crate::tenant::split(k).0, k.clone(), e.ext.len)).collect()
        });
    }

    fn clear(&mut self) {
        self.shares.clear();
        self.index.clear();
        for u in self.tenants.values_mut() {
            u.bytes = 0;
            u.objects = 0;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What recovery found on one disk.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub records: u64,
    pub clean: bool,
    pub reclaimed: u64,
    pub stray_temp_files: u64,
    pub torn_journal_bytes: u64,
}

/// Writes the format marker and puts it on media (the directory entry is
/// synced by the caller's `sync_dir`): a marker left empty by a power loss
/// would make the next start refuse the disk.
fn write_marker(path: &Path) -> io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(MARKER_TEXT.as_bytes())?;
    f.sync_all()
}

pub struct Disk {
    pub id: String,
    pub dir: PathBuf,
    cap: u64,
    dev: Box<dyn Device>,
    state: Mutex<State>,
    shared: Arc<Shared>,
    journal: Mutex<Journal>,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    evictions: AtomicU64,
    corrupt_dropped: AtomicU64,
    appends_since_sync: AtomicU64,
    /// With a device that acknowledges writes on media: the group commit
    /// that puts each put's journal entry on media before its answer.
    journal_group: Option<super::device::GroupSync>,
    journal_errno: std::sync::atomic::AtomicI32,
    /// Puts waiting to be written together ([`Disk::put_gathered`]).
    gather: Gather,
    /// One checkpoint at a time.
    checkpointing: Mutex<()>,
    /// Keys recovered after an unclean stop, waiting for a payload check.
    scrub_queue: Mutex<Vec<Arc<[u8]>>>,
    /// Keys read from the memory tier since the index last saw them
    /// ([`Disk::touch_later`]), each once, in the order of their last
    /// read: applied to the index's recency before anything is evicted. A
    /// leaf lock: never held while `state` is taken.
    touched: Mutex<LruCache<Box<[u8]>, ()>>,
    _lock: File,
}

/// Keys read from the memory tier a disk remembers for its index's recency
/// between two evictions (or two [`Disk::maintain`] calls) at most; past
/// it the key read longest ago is forgotten (its page then keeps the
/// recency its disk last saw).
pub const MAX_TOUCHED: usize = 1 << 16;

fn take_dir_lock(dir: &Path) -> io::Result<File> {
    let f = OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(LOCK_FILE))?;
    // SAFETY: flock on a descriptor we own for the lifetime of the call.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{} is in use by another kv-server", dir.display()),
        ));
    }
    Ok(f)
}

impl Disk {
    /// Opens (initialising if empty) the disk at `dir` and recovers its index.
    pub fn open(id: String, dir: &Path, cap: u64, dev: Box<dyn Device>) -> io::Result<(Disk, RecoveryReport)> {
        let lockf = take_dir_lock(dir)?;
        let marker = dir.join(MARKER_FILE);
        match std::fs::read_to_string(&marker) {
            Ok(t) if t == MARKER_TEXT => {}
            // A marker cut short by a crash or power loss right after it was
            // made (before its write reached media): ours; write it again.
            Ok(t) if MARKER_TEXT.starts_with(&t) => {
                tracing::warn!(dir = %dir.display(), "disk marker cut short (a crash when it was made): rewritten");
                write_marker(&marker)?;
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} holds an unknown kvcellar disk format", dir.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if dir.join(journal::JOURNAL_FILE).exists() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{} has an index but no {MARKER_FILE} marker: refusing to guess", dir.display()),
                    ));
                }
                write_marker(&marker)?;
            }
            Err(e) => return Err(e),
        }
        let mut report = RecoveryReport::default();
        let clean_path = dir.join(CLEAN_FILE);
        report.clean = clean_path.exists();
        if report.clean {
            std::fs::remove_file(&clean_path)?;
        }
        for e in std::fs::read_dir(dir)? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                std::fs::remove_file(&p)?;
                report.stray_temp_files += 1;
            }
        }
        journal::sync_dir(dir)?;

        let limit = cap / ALIGN as u64 * ALIGN as u64;
        let replay = Journal::replay(dir)?;
        report.torn_journal_bytes = replay.torn_bytes;
        let (replay_len, replay_entries) = (replay.valid_len, replay.entries.len() as u64);
        let shared = Arc::new(Shared::default());
        let mut index: LruCache<Arc<[u8]>, Entry> = LruCache::unbounded();
        let file_len = dev.file_len()?;
        for e in replay.entries {
            match e {
                Replayed::Put { off, alloc_len, header, key } => {
                    let ok = PageHeader::decode(&header).ok().filter(|h| {
                        h.check_key(crate::tenant::client_key(&key)).is_ok()
                            && off % ALIGN as u64 == 0
                            && alloc_len == align_up(h.record_len())
                            && off + alloc_len <= file_len.min(limit)
                    });
                    let Some(h) = ok else {
                        report.reclaimed += 1;
                        index.pop(&key[..]);
                        continue;
                    };
                    let ext = Arc::new(Extent {
                        off,
                        len: alloc_len,
                        verified: AtomicBool::new(true),
                        shared: shared.clone(),
                    });
                    index.put(Arc::from(key), Entry { ext, header: h, header_bytes: header, used: 0, stamp: 0 });
                }
                Replayed::Del { key } => {
                    index.pop(&key[..]);
                }
            }
        }
        // Carve the live extents out of free space; an overlap (only possible
        // after a lost DEL) keeps the newer record.
        let mut alloc = Allocator::new(limit);
        let mut by_age: Vec<(Arc<[u8]>, u64, u64)> =
            index.iter().map(|(k, e)| (k.clone(), e.ext.off, e.ext.len)).collect();
        by_age.reverse(); // oldest first
        let mut used = 0;
        let mut order: Vec<usize> = (0..by_age.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(i)); // newest first wins overlaps
        for i in order {
            let (k, off, len) = &by_age[i];
            if alloc.reserve(*off, *len) {
                used += len;
            } else {
                index.pop(&k[..]);
                report.reclaimed += 1;
            }
        }
        // The extents just dropped were never reserved; forget their releases.
        lock(&shared.released).clear();
        // After an unclean stop every survivor awaits a payload check.
        if !report.clean {
            for (_, e) in index.iter() {
                e.ext.verified.store(false, Ordering::Relaxed);
            }
            shared.unverified.store(index.len() as u64, Ordering::Relaxed);
        }
        if file_len != limit {
            dev.set_len(limit)?;
        }
        report.records = index.len() as u64;
        let scrub_queue = if report.clean { Vec::new() } else { index.iter().map(|(k, _)| k.clone()).collect() };
        // The journal is reused as it is (a torn tail cut) unless recovery
        // dropped records it still names, or it is mostly superseded entries:
        // then it is rewritten from the recovered index.
        let reusable = report.reclaimed == 0 && replay_len > 0 && replay_entries <= 2 * report.records + 4096;
        let journal = if reusable {
            Journal::reopen(dir, replay_len, replay_entries)?
        } else {
            Journal::rewrite(
                dir,
                index.iter().rev().map(|(k, e)| journal::Entry::Put {
                    off: e.ext.off,
                    alloc_len: e.ext.len,
                    header: &e.header_bytes,
                    key: k,
                }),
            )?
        };
        let acks_on_media = dev.acks_on_media();
        let disk = Disk {
            id,
            dir: dir.to_path_buf(),
            cap: limit,
            dev,
            state: Mutex::new(State {
                tenants: State::tally(&index),
                shares: Default::default(),
                index,
                alloc,
                used,
                next_stamp: STAMP_RANGES.fetch_add(1, Ordering::Relaxed) << 40,
            }),
            shared,
            journal: Mutex::new(journal),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            evictions: AtomicU64::new(0),
            corrupt_dropped: AtomicU64::new(0),
            appends_since_sync: AtomicU64::new(0),
            journal_group: acks_on_media.then(super::device::GroupSync::default),
            journal_errno: std::sync::atomic::AtomicI32::new(0),
            gather: Gather::default(),
            checkpointing: Mutex::new(()),
            scrub_queue: Mutex::new(scrub_queue),
            touched: Mutex::new(LruCache::new(
                std::num::NonZeroUsize::new(MAX_TOUCHED).unwrap_or(std::num::NonZeroUsize::MIN),
            )),
            _lock: lockf,
        };
        Ok((disk, report))
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Takes the disk out of service (idempotent). Returns true the first time.
    ///
    /// Takes no lock but `failure`, so it may be called with `state` or
    /// `journal` held. Every operation checks the flag first; the index's
    /// memory is released by the next [`Disk::maintain`].
    pub fn fail(&self, reason: &str) -> bool {
        if self.failed.swap(true, Ordering::AcqRel) {
            return false;
        }
        tracing::error!(disk = %self.id, dir = %self.dir.display(), reason, "disk taken out of service");
        *lock(&self.failure) = Some(reason.to_string());
        true
    }

    /// Appends to the journal; the journal lock is released before returning.
    fn journal_append(&self, e: journal::Entry<'_>) -> io::Result<()> {
        match self.journal_errno.load(Ordering::Relaxed) {
            0 => lock(&self.journal).append(e),
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// Test hook: journal appends fail with `errno` while it is non-zero.
    #[doc(hidden)]
    pub fn inject_journal_errno(&self, errno: i32) {
        self.journal_errno.store(errno, Ordering::Relaxed);
    }

    fn io_failed(&self, what: &str, e: &io::Error) -> DiskError {
        self.fail(&format!("{what}: {e}"));
        DiskError::Failed(self.id.clone())
    }

    fn drain_released(&self, st: &mut State) {
        let mut r = lock(&self.shared.released);
        for (off, len) in r.drain(..) {
            st.alloc.free(off, len);
            st.used -= len;
        }
    }

    /// Notes a read of `key` served from the memory tier: its record here
    /// becomes the most recent before the next eviction, as a read from
    /// this disk would have made it at once (docs/ARCHITECTURE.md,
    /// "Eviction and readers"). Cheap enough for the memory tier's path: no
    /// index lock is taken.
    pub fn touch_later(&self, key: &[u8]) {
        let mut t = lock(&self.touched);
        // A key read again moves to the end; only a new one is copied.
        if t.get(key).is_none() {
            t.put(key.into(), ());
        }
    }

    /// Applies the reads [`Disk::touch_later`] noted, oldest first.
    fn apply_touched(&self, st: &mut State) {
        let keys: Vec<Box<[u8]>> = {
            let mut t = lock(&self.touched);
            if t.is_empty() {
                return;
            }
            let mut keys = Vec::with_capacity(t.len());
            while let Some((k, ())) = t.pop_lru() {
                keys.push(k);
            }
            keys
        };
        let now = use_tick();
        for k in &keys {
            st.touch(k, now);
        }
    }

    /// Evicts a record to make room for a put of `need` bytes by tenant
    /// `putter` (after the memory tier's reads are applied): the least
    /// recently used, or the one the tenants' shares name
    /// ([`State::evict_for`]). False when the index is empty.
    fn evict_one(&self, st: &mut State, putter: u32, need: u64) -> bool {
        self.apply_touched(st);
        let Some((key, entry)) = st.evict_for(putter, need) else {
            return false;
        };
        self.evictions.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.journal_append(journal::Entry::Del { key: &key }) {
            self.fail(&format!("index journal write: {e}"));
        }
        drop(entry);
        self.drain_released(st);
        true
    }

    /// Flushes the journal; rewrites it when superseded entries dominate;
    /// notices a vanished directory; frees a failed disk's index.
    pub fn maintain(&self) -> io::Result<()> {
        if self.is_failed() {
            let mut st = lock(&self.state);
            if !st.index.is_empty() {
                st.clear();
                self.drain_released(&mut st);
            }
            lock(&self.touched).clear();
            return Ok(());
        }
        if !self.dir.join(MARKER_FILE).exists() {
            self.fail("disk directory or its marker vanished");
            return Ok(());
        }
        let live = {
            let mut st = lock(&self.state);
            self.apply_touched(&mut st);
            st.index.len() as u64
        };
        let entries = lock(&self.journal).entries();
        let compacted = if entries > 2 * live + 4096 { self.checkpoint() } else { Ok(()) };
        if self.appends_since_sync.swap(0, Ordering::Relaxed) > 0 {
            // fdatasync outside the journal lock: appends carry on meanwhile.
            let file = lock(&self.journal).file();
            if let Err(e) = self.dev.sync_journal(&file) {
                self.fail(&format!("index journal sync: {e}"));
                return Err(e);
            }
        }
        compacted
    }

    /// Rewrites the journal from the live index, oldest first, with no file
    /// I/O under a lock: the index is copied under `state` (keys are shared
    /// `Arc`s), the snapshot written and synced with no lock, the entries
    /// appended meanwhile carried over in a synced round, and only the last
    /// few written (buffered) and the rename done under the journal lock.
    pub fn checkpoint(&self) -> io::Result<()> {
        let _one = lock(&self.checkpointing);
        let live: Vec<LiveRecord> = {
            let mut st = lock(&self.state);
            // The snapshot keeps the recency order a restart recovers.
            self.apply_touched(&mut st);
            lock(&self.journal).begin_snapshot();
            st.index.iter().rev().map(|(k, e)| (k.clone(), e.header_bytes, e.ext.off, e.ext.len)).collect()
        };
        let written = Journal::write_snapshot(
            &self.dir,
            live.iter().map(|(k, h, off, len)| journal::Entry::Put { off: *off, alloc_len: *len, header: h, key: k }),
        );
        let live_count = live.len();
        drop(live);
        let mut snap = match written {
            Ok(s) => s,
            Err(e) => {
                lock(&self.journal).abort_snapshot();
                return Err(e);
            }
        };
        let (extra, n) = lock(&self.journal).drain_since_snapshot();
        if let Err(e) = snap.append_raw(&extra, n).and_then(|()| snap.sync()) {
            lock(&self.journal).abort_snapshot();
            snap.discard();
            return Err(e);
        }
        let file = lock(&self.journal).install(snap)?;
        self.appends_since_sync.store(0, Ordering::Relaxed);
        tracing::info!(disk = %self.id, records = live_count, "index journal compacted");
        // The new journal is in place; make its tail and the rename durable.
        if let Err(e) = file.sync_data().and_then(|()| journal::sync_dir(&self.dir)) {
            self.fail(&format!("index journal sync after compaction: {e}"));
            return Err(e);
        }
        Ok(())
    }

    /// Clean stop: data and journal on media, then the marker that lets the
    /// next start trust every record without re-checking payloads. The marker
    /// is withheld while records recovered after a crash await their check.
    pub fn close(&self) -> io::Result<()> {
        if self.is_failed() {
            return Ok(());
        }
        self.dev.sync()?;
        self.checkpoint()?;
        let unchecked = self.unverified();
        if unchecked > 0 {
            tracing::info!(disk = %self.id, unchecked, "records recovered after a crash not yet checked: next start checks them");
            return Ok(());
        }
        std::fs::write(self.dir.join(CLEAN_FILE), b"clean\n")?;
        journal::sync_dir(&self.dir)
    }

    /// Sets the tenants' shares of this disk: bytes by tenant id (empty:
    /// no quotas, one LRU for all).
    pub fn set_shares(&self, share: std::collections::HashMap<u32, u64>) {
        lock(&self.state).set_shares(share);
    }

    /// What each tenant holds on this disk now (none on a failed one),
    /// and its evictions here.
    pub fn tenant_use(&self) -> Vec<(u32, TenantUse)> {
        let st = lock(&self.state);
        st.tenants.iter().map(|(t, u)| (*t, *u)).collect()
    }

    pub fn stats(&self) -> DiskStats {
        let mut st = lock(&self.state);
        self.drain_released(&mut st);
        DiskStats {
            id: self.id.clone(),
            dir: self.dir.display().to_string(),
            used_bytes: st.used,
            capacity_bytes: self.cap,
            objects: if self.is_failed() { 0 } else { st.index.len() as u64 },
            evictions: self.evictions.load(Ordering::Relaxed),
            failed: self.is_failed(),
            failure: lock(&self.failure).clone(),
            unverified: self.unverified(),
        }
    }

    /// Records recovered after an unclean stop whose payload is unchecked.
    pub fn unverified(&self) -> u64 {
        if self.is_failed() {
            0
        } else {
            self.shared.unverified.load(Ordering::Relaxed)
        }
    }

    pub fn corrupt_dropped(&self) -> u64 {
        self.corrupt_dropped.load(Ordering::Relaxed)
    }
}
