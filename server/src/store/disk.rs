//! One disk: a data file of extents, an LRU index, and the index journal.
//!
//! Locking: `state` (index, allocator, used bytes) is held only for in-memory
//! work and journal appends, never across data I/O. Journal appends that
//! describe the index (PUT on insert, DEL on evict/delete) happen under
//! `state`, so the journal order is the index order. Lock order: state, then
//! journal.
//!
//! Readers pin a record's extent through an `Arc<Extent>`; eviction only
//! drops the index's reference, and the space goes back to the allocator
//! when the last pin is dropped, so space is never reused under a reader.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::stats::DiskStats;
use lru::LruCache;

use super::alloc::Allocator;
use super::buf::{align_up, BufPool, PooledBuf, ALIGN};
use super::device::Device;
use super::journal::{self, Journal, Replayed};

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
    Stored,
    Duplicate,
}

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
}

/// Milliseconds since the first call in this process: the recency clock of
/// index entries (a coarse clock read, no shared counter on the get path).
pub fn use_tick() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1
}

/// A live record as a checkpoint copies it: key, header, offset, extent length.
type LiveRecord = (Arc<[u8]>, [u8; HEADER_LEN], u64, u64);

struct State {
    index: LruCache<Arc<[u8]>, Entry>,
    alloc: Allocator,
    /// Bytes of allocated extents, pinned-but-evicted ones included.
    used: u64,
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
    _lock: File,
}

/// Puts on media waiting for the one that writes them together: while one
/// put writes a run, the others queue here, and the next to lead takes them
/// all (up to a flusher's batch).
#[derive(Default)]
struct Gather {
    st: Mutex<GatherState>,
    /// A run answered: its puts return, and the next may lead.
    cv: Condvar,
}

#[derive(Default)]
struct GatherState {
    pending: Vec<Arc<Pending>>,
    writing: bool,
}

/// One put waiting in [`Gather`], and its answer once given.
struct Pending {
    rec: Arc<PooledBuf>,
    key: Box<[u8]>,
    header: PageHeader,
    out: Mutex<Option<Result<PutResult, DiskError>>>,
}

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
                        h.check_key(&key).is_ok()
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
                    index.put(Arc::from(key), Entry { ext, header: h, header_bytes: header, used: 0 });
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
            state: Mutex::new(State { index, alloc, used }),
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

    /// Evicts the least recently used record. False when the index is empty.
    fn evict_one(&self, st: &mut State) -> bool {
        let Some((key, entry)) = st.index.pop_lru() else {
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

    /// Stores a validated record (`rec` holds exactly its bytes, zero-padded
    /// to the extent alignment: [`PooledBuf::pad_to_align`]).
    pub fn put(&self, rec: &PooledBuf, key: &[u8], header: &PageHeader) -> Result<PutResult, DiskError> {
        let r = self.write_and_enter(rec, key, header)?;
        if matches!(r, PutResult::Stored) {
            self.commit()?;
        }
        Ok(r)
    }

    /// Stores several records with one group commit for them all (a
    /// write-behind flusher's batch): each is written and entered in the
    /// index as by [`Disk::put`], then one data flush and one journal flush
    /// cover every one of them. A record is `Stored` only once that commit
    /// succeeded.
    pub fn put_many(&self, items: &[(&PooledBuf, &[u8], &PageHeader)]) -> Vec<Result<PutResult, DiskError>> {
        let mut out = self.enter_many(items);
        self.commit_many(&mut out);
        out
    }

    /// Writes and enters several records: one run when they fit in one
    /// ([`Disk::write_and_enter_run`]), else one by one.
    fn enter_many(&self, items: &[(&PooledBuf, &[u8], &PageHeader)]) -> Vec<Result<PutResult, DiskError>> {
        self.write_and_enter_run(items)
            .unwrap_or_else(|| items.iter().map(|(rec, key, header)| self.write_and_enter(rec, key, header)).collect())
    }

    /// The group commit of records just entered: a record is `Stored`
    /// only once it succeeded.
    fn commit_many(&self, out: &mut [Result<PutResult, DiskError>]) {
        if out.iter().any(|r| matches!(r, Ok(PutResult::Stored))) {
            if let Err(e) = self.commit() {
                tracing::debug!(disk = %self.id, error = %e, "batch commit failed");
                for r in out.iter_mut().filter(|r| matches!(r, Ok(PutResult::Stored))) {
                    *r = Err(DiskError::Failed(self.id.clone()));
                }
            }
        }
    }

    /// The records of the largest size gathered ([`Disk::put_gathered`]):
    /// larger ones are written alone, several at once.
    pub const GATHER_BELOW: usize = 1 << 20;

    /// A put acknowledged on media, written together with the others
    /// waiting: while one put writes a run of records and its journal
    /// entries, puts arriving queue; the next to lead takes all that queued
    /// (up to a flusher's batch) as one run, so a burst of small puts
    /// becomes a few large writes instead of one small write each. The
    /// leader commits its run (one group commit) and answers each put in it.
    /// A record of [`Disk::GATHER_BELOW`] or more, or a disk whose writes
    /// are on media as they return, goes straight to [`Disk::put`].
    pub fn put_gathered(&self, rec: &Arc<PooledBuf>, key: &[u8], header: &PageHeader) -> Result<PutResult, DiskError> {
        if self.journal_group.is_none() || rec.len() >= Self::GATHER_BELOW {
            return self.put(rec, key, header);
        }
        let me = Arc::new(Pending { rec: rec.clone(), key: key.into(), header: *header, out: Mutex::new(None) });
        let mut g = lock(&self.gather.st);
        g.pending.push(me.clone());
        loop {
            if let Some(r) = lock(&me.out).take() {
                return r;
            }
            if !g.writing && !g.pending.is_empty() {
                // Lead: take what waits (this put among it, unless a leader
                // before took it and answers it soon).
                g.writing = true;
                let mut bytes = 0;
                let n = g
                    .pending
                    .iter()
                    .take_while(|p| {
                        let fits = bytes < super::FLUSH_BATCH_BYTES;
                        bytes += p.rec.len() as u64;
                        fits
                    })
                    .count()
                    .min(super::FLUSH_BATCH);
                let run: Vec<Arc<Pending>> = g.pending.drain(..n.max(1)).collect();
                drop(g);
                self.write_gathered(run);
                g = lock(&self.gather.st);
                continue;
            }
            g = self.gather.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A leader's part of [`Disk::put_gathered`]: the run written, entered
    /// and committed, then each put answered and the next leader let in
    /// (holding the lead through the commit lets the puts arriving
    /// meanwhile form the next run). A panic on the way still answers every
    /// put and lets the next lead.
    fn write_gathered(&self, run: Vec<Arc<Pending>>) {
        struct Answer<'a> {
            disk: &'a Disk,
            run: Vec<Arc<Pending>>,
            out: Vec<Result<PutResult, DiskError>>,
        }
        impl Drop for Answer<'_> {
            fn drop(&mut self) {
                let mut out = std::mem::take(&mut self.out).into_iter();
                for p in &self.run {
                    let r = out.next().unwrap_or_else(|| Err(DiskError::Failed(self.disk.id.clone())));
                    *lock(&p.out) = Some(r);
                }
                // Under the lock, so a put that checks its answer and then
                // waits cannot miss this wake-up.
                lock(&self.disk.gather.st).writing = false;
                self.disk.gather.cv.notify_all();
            }
        }
        let mut a = Answer { disk: self, run, out: Vec::new() };
        let items: Vec<(&PooledBuf, &[u8], &PageHeader)> =
            a.run.iter().map(|p| (&*p.rec, &p.key[..], &p.header)).collect();
        let mut out = self.enter_many(&items);
        drop(items);
        self.commit_many(&mut out);
        a.out = out;
    }

    /// The first part of a put: the record written to a new extent and
    /// entered in the journal and the index (served from then on), not yet
    /// made durable ([`Disk::commit`]).
    fn write_and_enter(&self, rec: &PooledBuf, key: &[u8], header: &PageHeader) -> Result<PutResult, DiskError> {
        if self.is_failed() {
            return Err(DiskError::Failed(self.id.clone()));
        }
        let alloc_len = align_up(rec.len() as u64);
        if alloc_len > self.cap {
            return Err(DiskError::TooLarge(rec.len() as u64));
        }
        let off = {
            let mut st = lock(&self.state);
            self.drain_released(&mut st);
            if st.index.contains(key) {
                return Ok(PutResult::Duplicate);
            }
            while st.used + alloc_len > self.cap {
                if !self.evict_one(&mut st) {
                    break;
                }
            }
            let off = loop {
                if st.used + alloc_len <= self.cap {
                    if let Some(off) = st.alloc.alloc(alloc_len) {
                        break off;
                    }
                }
                if !self.evict_one(&mut st) {
                    // Everything evicted is still pinned by readers.
                    return Err(DiskError::Full(self.id.clone()));
                }
            };
            st.used += alloc_len;
            off
        };
        let padded = alloc_len as usize;
        // With a journal group (acks on media) the data and the journal
        // entry are made durable together below; otherwise the write is.
        let written = if self.journal_group.is_some() {
            self.dev.write_deferred(rec.prefix(padded), off)
        } else {
            self.dev.write_at(rec.prefix(padded), off)
        };
        if let Err(e) = written {
            self.give_back(off, alloc_len);
            return Err(self.data_write_failed(&e));
        }
        let mut header_bytes = [0u8; HEADER_LEN];
        header_bytes.copy_from_slice(&rec.as_slice()[..HEADER_LEN]);
        let ext =
            Arc::new(Extent { off, len: alloc_len, verified: AtomicBool::new(true), shared: self.shared.clone() });
        let mut st = lock(&self.state);
        if st.index.contains(key) || self.is_failed() {
            // A concurrent put of the same key won (write-once), or the disk
            // failed meanwhile; our extent goes back when `ext` drops.
            drop(ext);
            self.drain_released(&mut st);
            return if self.is_failed() { Err(DiskError::Failed(self.id.clone())) } else { Ok(PutResult::Duplicate) };
        }
        let appended = self.journal_append(journal::Entry::Put { off, alloc_len, header: &header_bytes, key });
        if let Err(e) = appended {
            drop(ext);
            self.drain_released(&mut st);
            drop(st);
            return Err(self.io_failed("index journal write", &e));
        }
        self.appends_since_sync.fetch_add(1, Ordering::Relaxed);
        st.index.put(key.into(), Entry { ext, header: *header, header_bytes, used: use_tick() });
        drop(st);
        Ok(PutResult::Stored)
    }

    /// [`Disk::write_and_enter`] for several records at once, when their
    /// writes are deferred to a group commit: the records not stored yet
    /// take one run of the data file, cut in one extent each, written with
    /// one vectored write (a batch of 64 KiB records is one large write,
    /// which a disk takes several times faster than as many small ones),
    /// and their journal entries are one append. None, before anything is
    /// written, when no free run holds them all: the caller writes them one
    /// by one.
    fn write_and_enter_run(
        &self,
        items: &[(&PooledBuf, &[u8], &PageHeader)],
    ) -> Option<Vec<Result<PutResult, DiskError>>> {
        if items.len() < 2 || self.journal_group.is_none() {
            return None;
        }
        if self.is_failed() {
            return Some(items.iter().map(|_| Err(DiskError::Failed(self.id.clone()))).collect());
        }
        let lens: Vec<u64> = items.iter().map(|(rec, _, _)| align_up(rec.len() as u64)).collect();
        let mut out: Vec<Result<PutResult, DiskError>> = items.iter().map(|_| Ok(PutResult::Duplicate)).collect();
        // The records to write: not in the index, each key once.
        let (base, total, fresh) = {
            let mut st = lock(&self.state);
            self.drain_released(&mut st);
            let mut fresh: Vec<usize> = Vec::with_capacity(items.len());
            for (i, (_, key, _)) in items.iter().enumerate() {
                if !st.index.contains(*key) && !fresh.iter().any(|&j| items[j].1 == *key) {
                    fresh.push(i);
                }
            }
            if fresh.is_empty() {
                return Some(out);
            }
            let total: u64 = fresh.iter().map(|&i| lens[i]).sum();
            if total > self.cap {
                return None;
            }
            while st.used + total > self.cap {
                if !self.evict_one(&mut st) {
                    return None;
                }
            }
            let base = st.alloc.alloc(total)?;
            st.used += total;
            (base, total, fresh)
        };
        let bufs: Vec<&[u8]> = fresh.iter().map(|&i| items[i].0.prefix(lens[i] as usize)).collect();
        if let Err(e) = self.dev.write_deferred_vectored(&bufs, base) {
            self.give_back(base, total);
            let err = self.data_write_failed(&e);
            for &i in &fresh {
                out[i] = Err(match &err {
                    DiskError::Full(d) => DiskError::Full(d.clone()),
                    _ => DiskError::Failed(self.id.clone()),
                });
            }
            return Some(out);
        }
        // One extent a record, so each is evicted and freed on its own.
        let mut off = base;
        let mut placed: Vec<(usize, Arc<Extent>, [u8; HEADER_LEN])> = Vec::with_capacity(fresh.len());
        for &i in &fresh {
            let mut header_bytes = [0u8; HEADER_LEN];
            header_bytes.copy_from_slice(&items[i].0.as_slice()[..HEADER_LEN]);
            let ext =
                Arc::new(Extent { off, len: lens[i], verified: AtomicBool::new(true), shared: self.shared.clone() });
            placed.push((i, ext, header_bytes));
            off += lens[i];
        }
        let mut st = lock(&self.state);
        if self.is_failed() {
            drop(placed);
            self.drain_released(&mut st);
            for &i in &fresh {
                out[i] = Err(DiskError::Failed(self.id.clone()));
            }
            return Some(out);
        }
        // A concurrent put of the same key won meanwhile (write-once): that
        // record's extent goes back when it drops.
        placed.retain(|(i, _, _)| !st.index.contains(items[*i].1));
        self.drain_released(&mut st);
        let entries = placed.iter().map(|(i, ext, header)| journal::Entry::Put {
            off: ext.off,
            alloc_len: ext.len,
            header,
            key: items[*i].1,
        });
        let appended = match self.journal_errno.load(Ordering::Relaxed) {
            0 => lock(&self.journal).append_many(entries),
            errno => Err(io::Error::from_raw_os_error(errno)),
        };
        if let Err(e) = appended {
            self.io_failed("index journal write", &e);
            for (i, _, _) in &placed {
                out[*i] = Err(DiskError::Failed(self.id.clone()));
            }
            drop(placed);
            self.drain_released(&mut st);
            return Some(out);
        }
        self.appends_since_sync.fetch_add(placed.len() as u64, Ordering::Relaxed);
        for (i, ext, header_bytes) in placed {
            let (_, key, header) = items[i];
            st.index.put(key.into(), Entry { ext, header: *header, header_bytes, used: use_tick() });
            out[i] = Ok(PutResult::Stored);
        }
        drop(st);
        Some(out)
    }

    /// Returns an extent allocated for a write that failed.
    fn give_back(&self, off: u64, len: u64) {
        let mut st = lock(&self.state);
        st.alloc.free(off, len);
        st.used -= len;
    }

    /// What a failed data write means: the disk is full, or it is taken out
    /// of service.
    fn data_write_failed(&self, e: &io::Error) -> DiskError {
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => DiskError::Full(self.id.clone()),
            _ => self.io_failed("data write", e),
        }
    }

    /// The second part of a put: the data, then the entries, on media before
    /// the answer: one group commit (a data flush and a journal flush) for
    /// every put entered before it began, so concurrent puts share both
    /// flushes. Readers may serve a record meanwhile (its bytes are written,
    /// if not yet durable). An entry that reaches media before its data (the
    /// kernel writes the journal back when it likes) and then loses it to a
    /// power cut names a record that fails its checksum on read and is
    /// dropped: never served.
    fn commit(&self) -> Result<(), DiskError> {
        if let Some(g) = &self.journal_group {
            if let Err(e) = g.sync_after(|| {
                let file = lock(&self.journal).file();
                self.dev.commit(&file)
            }) {
                return Err(self.io_failed("data and index journal sync", &e));
            }
            // A flush outside the group commit (the journal's periodic one)
            // may have been told of a write-back error: nothing on a failed
            // disk is acknowledged.
            if self.is_failed() {
                return Err(DiskError::Failed(self.id.clone()));
            }
        }
        Ok(())
    }

    /// Reads a record. With `geo`, a record of another geometry is a
    /// mismatch and is not read. `promote` refreshes its recency.
    pub fn get(&self, key: &[u8], geo: Option<&Geometry>, pool: &BufPool, promote: bool) -> Result<Lookup, DiskError> {
        if self.is_failed() {
            return Ok(Lookup::Miss);
        }
        let (ext, header, header_bytes) = {
            let mut st = lock(&self.state);
            let e = if promote {
                st.index.get_mut(key).map(|e| {
                    e.used = use_tick();
                    &*e
                })
            } else {
                st.index.peek(key)
            };
            match e {
                None => return Ok(Lookup::Miss),
                Some(e) if geo.is_some_and(|g| !g.matches(&e.header)) => return Ok(Lookup::Mismatch),
                Some(e) => (e.ext.clone(), e.header, e.header_bytes),
            }
        };
        let mut buf = pool.get(ext.len as usize);
        let n = ext.len as usize;
        if let Err(e) = self.dev.read_at(&mut buf.full_mut()[..n], ext.off) {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                self.drop_damaged(key, &ext, "record cut short");
                return Ok(Lookup::Damaged);
            }
            return Err(self.io_failed("data read", &e));
        }
        buf.set_len(header.record_len() as usize);
        let rec = buf.as_slice();
        let key_ok = &rec[HEADER_LEN..HEADER_LEN + key.len()] == key;
        if rec[..HEADER_LEN] != header_bytes || !key_ok {
            self.drop_damaged(key, &ext, "stored header or key differs from the index");
            return Ok(Lookup::Damaged);
        }
        // Every read from disk is checked, not only records recovered after
        // a crash: a record damaged on the device after it was written (or
        // after a clean stop) is dropped here, so get and exist agree that
        // it is gone, instead of being sent to clients that reject it.
        let payload = &rec[HEADER_LEN + key.len()..];
        if crc32fast::hash(payload) != header.payload_crc {
            self.drop_damaged(key, &ext, "payload checksum failed");
            return Ok(Lookup::Damaged);
        }
        ext.mark_verified();
        Ok(Lookup::Hit(buf))
    }

    fn drop_damaged(&self, key: &[u8], ext: &Arc<Extent>, why: &str) {
        let mut st = lock(&self.state);
        let same = st.index.peek(key).is_some_and(|e| Arc::ptr_eq(&e.ext, ext));
        if same {
            st.index.pop(key);
            self.corrupt_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(disk = %self.id, key = %String::from_utf8_lossy(key), why, "damaged record dropped");
            if let Err(e) = self.journal_append(journal::Entry::Del { key }) {
                self.fail(&format!("index journal write: {e}"));
            }
        }
    }

    /// Some(true) present, Some(false) another geometry, None absent.
    /// From memory only.
    pub fn exist(&self, key: &[u8], geo: Option<&Geometry>) -> Option<bool> {
        if self.is_failed() {
            return None;
        }
        let st = lock(&self.state);
        st.index.peek(key).map(|e| geo.is_none_or(|g| g.matches(&e.header)))
    }

    /// The index lock if it is free now (a poisoned lock is taken as is,
    /// as [`lock`] does); Busy otherwise.
    fn try_state(&self) -> Result<std::sync::MutexGuard<'_, State>, Busy> {
        match self.state.try_lock() {
            Ok(g) => Ok(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => Err(Busy),
        }
    }

    /// As [`Disk::exist`], but gives up instead of waiting for the lock, so
    /// async code can fall back to the blocking pool.
    pub fn try_exist(&self, key: &[u8], geo: Option<&Geometry>) -> Result<Option<bool>, Busy> {
        if self.is_failed() {
            return Ok(None);
        }
        let st = self.try_state()?;
        Ok(st.index.peek(key).map(|e| geo.is_none_or(|g| g.matches(&e.header))))
    }

    /// [`Disk::try_exist`] for many keys under one lock acquisition: fills
    /// `out[i]` for every key still `None` there. Err when the lock is busy.
    pub fn try_exist_many(&self, keys: &[&[u8]], geo: Option<&Geometry>, out: &mut [Option<bool>]) -> Result<(), Busy> {
        if self.is_failed() {
            return Ok(());
        }
        let st = self.try_state()?;
        for (k, o) in keys.iter().zip(out.iter_mut()) {
            if o.is_none() {
                *o = st.index.peek(*k).map(|e| geo.is_none_or(|g| g.matches(&e.header)));
            }
        }
        Ok(())
    }

    /// Length of the stored record for `key` (memory only).
    pub fn record_len(&self, key: &[u8]) -> Option<u64> {
        if self.is_failed() {
            return None;
        }
        lock(&self.state).index.peek(key).map(|e| e.header.record_len())
    }

    /// As [`Disk::record_len`], but gives up instead of waiting for the
    /// lock (a put's journal write, an eviction cascade, a checkpoint copy).
    pub fn try_record_len(&self, key: &[u8]) -> Result<Option<u64>, Busy> {
        if self.is_failed() {
            return Ok(None);
        }
        let st = self.try_state()?;
        Ok(st.index.peek(key).map(|e| e.header.record_len()))
    }

    /// Every key in the index, most recently used first (a copy).
    pub fn keys_by_recency(&self) -> Vec<(Arc<[u8]>, u64)> {
        lock(&self.state).index.iter().map(|(k, e)| (k.clone(), e.used)).collect()
    }

    /// Every key in the index (a copy; for taking a disk back into service).
    pub fn keys(&self) -> Vec<Arc<[u8]>> {
        lock(&self.state).index.iter().map(|(k, _)| k.clone()).collect()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        !self.is_failed() && lock(&self.state).index.contains(key)
    }

    /// As [`Disk::contains`], but gives up instead of waiting for the lock.
    pub fn try_contains(&self, key: &[u8]) -> Result<bool, Busy> {
        Ok(!self.is_failed() && self.try_state()?.index.contains(key))
    }

    /// Removes a record. True when it was present.
    pub fn delete(&self, key: &[u8]) -> bool {
        if self.is_failed() {
            return false;
        }
        let mut st = lock(&self.state);
        let Some(entry) = st.index.pop(key) else {
            return false;
        };
        if let Err(e) = self.journal_append(journal::Entry::Del { key }) {
            self.fail(&format!("index journal write: {e}"));
            return true;
        }
        drop(entry);
        self.drain_released(&mut st);
        true
    }

    /// Up to `max` keys recovered after an unclean stop and not yet scrubbed
    /// (some may have been read, evicted or deleted since: checking them again
    /// is harmless).
    pub fn take_unscrubbed(&self, max: usize) -> Vec<Arc<[u8]>> {
        let mut q = lock(&self.scrub_queue);
        let n = q.len().min(max);
        let at = q.len() - n;
        q.split_off(at)
    }

    /// Flushes the journal; rewrites it when superseded entries dominate;
    /// notices a vanished directory; frees a failed disk's index.
    pub fn maintain(&self) -> io::Result<()> {
        if self.is_failed() {
            let mut st = lock(&self.state);
            if !st.index.is_empty() {
                st.index.clear();
                self.drain_released(&mut st);
            }
            return Ok(());
        }
        if !self.dir.join(MARKER_FILE).exists() {
            self.fail("disk directory or its marker vanished");
            return Ok(());
        }
        let live = lock(&self.state).index.len() as u64;
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
            let st = lock(&self.state);
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

    /// Where a record lives (tests and tools): (offset, extent length).
    pub fn locate(&self, key: &[u8]) -> Option<(u64, u64)> {
        lock(&self.state).index.peek(key).map(|e| (e.ext.off, e.ext.len))
    }
}
