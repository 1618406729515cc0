//! The block device a disk store writes to: a trait so the engine can be
//! tested with injected faults, and the real implementation over one data
//! file opened with O_DIRECT, with a group-committed fdatasync so that an
//! acknowledged write is on media even with a volatile device cache.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Positional, aligned I/O on one disk's data file.
pub trait Device: Send + Sync {
    /// Writes all of `buf` (aligned address, length and offset) at `off`.
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Fills all of `buf` (aligned) from `off`; a short file is `UnexpectedEof`.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Current length of the data file.
    fn file_len(&self) -> io::Result<u64>;
    /// Sets the length of the data file (sparse growth).
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;
    /// Whether `write_at` returns only once the write is on media (then the
    /// store makes each put's journal entry durable before its answer too).
    fn acks_on_media(&self) -> bool {
        false
    }
    /// Makes the index journal `f` durable (a seam, so a power loss drill
    /// can know what of the journal reached media).
    fn sync_journal(&self, f: &File) -> io::Result<()> {
        f.sync_data()
    }
    /// Writes as [`Device::write_at`], but on a device that acks on media
    /// the write may be durable only after the next [`Device::commit`]: the
    /// store then makes a put's data and its journal entry durable in one
    /// group commit instead of two in a row.
    fn write_deferred(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.write_at(buf, off)
    }
    /// Writes `bufs` back to back from `off` as [`Device::write_deferred`]
    /// of each in turn would (the real device: one `pwritev` for each 64
    /// buffers).
    fn write_deferred_vectored(&self, bufs: &[&[u8]], off: u64) -> io::Result<()> {
        let mut at = off;
        for b in bufs {
            self.write_deferred(b, at)?;
            at += b.len() as u64;
        }
        Ok(())
    }
    /// Makes every deferred write finished before the call durable, then the
    /// journal `f` (data first: an entry is never on media before its data
    /// through this call).
    fn commit(&self, f: &File) -> io::Result<()> {
        self.sync()?;
        self.sync_journal(f)
    }
}

/// The real device: one file, O_DIRECT when the filesystem supports it.
///
/// Durability (`sync`): a write returns only once it is on media. Rather
/// than O_DSYNC (one device flush, and on a fresh extent one filesystem
/// journal commit, per write), writes are plain O_DIRECT followed by a
/// group commit: one `fdatasync` covers every write that finished before it
/// started, so concurrent puts share a flush.
pub struct FileDevice {
    file: File,
    direct: bool,
    group: Option<GroupSync>,
}

/// Leader/follower fdatasync: a writer takes a ticket after its write; the
/// first waiter with no flush running flushes for everyone up to the newest
/// ticket, the others wait for a flush that started after their write.
/// Used for the data file here and for the index journal (the `disk` module).
///
/// Waiters sleep on one of two condition variables by the flush that will
/// cover them (the one running, or the next), so a finished flush wakes the
/// writers it covered and one writer of the next round to lead it, not every
/// writer waiting (on small puts that cost a dozen futex calls a page).
pub struct GroupSync {
    state: Mutex<SyncState>,
    /// Indexed by round parity.
    done: [Condvar; 2],
}

impl Default for GroupSync {
    fn default() -> Self {
        GroupSync { state: Mutex::new(SyncState::default()), done: [Condvar::new(), Condvar::new()] }
    }
}

#[derive(Default)]
struct SyncState {
    issued: u64,
    synced: u64,
    running: bool,
    /// Flushes started so far; the running one (if any) is round `rounds`.
    rounds: u64,
    /// The newest ticket the running flush covers.
    target: u64,
    /// Set by the first failed flush, for good: the kernel may have dropped
    /// the dirty pages of any write not yet proven on media (and reports
    /// that error once), so no later flush may acknowledge such a write.
    /// Writes synced before it stay acknowledged; the store takes the disk
    /// out of service.
    failed: Option<i32>,
}

impl SyncState {
    /// What the writer of `ticket` is told, or None while it must wait.
    fn verdict(&self, ticket: u64) -> Option<io::Result<()>> {
        if self.synced >= ticket {
            return Some(Ok(()));
        }
        self.failed.map(|errno| Err(io::Error::from_raw_os_error(errno)))
    }
}

impl GroupSync {
    /// Returns once a flush that began after this call (or a later one) has
    /// succeeded: every write finished before the call is then on media.
    pub fn sync_after_write(&self, file: &File) -> io::Result<()> {
        self.sync_after(|| file.sync_data())
    }

    /// As [`GroupSync::sync_after_write`], with the flush given (its file
    /// may change between flushes, as the journal's does at compaction).
    pub fn sync_after(&self, flush: impl Fn() -> io::Result<()>) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.issued += 1;
        let ticket = st.issued;
        loop {
            if let Some(v) = st.verdict(ticket) {
                return v;
            }
            if !st.running {
                st.running = true;
                st.rounds += 1;
                let round = st.rounds;
                let target = st.issued;
                st.target = target;
                drop(st);
                let r = flush();
                st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                st.running = false;
                match r {
                    // After a failure nothing more is acknowledged, even if
                    // this (later) flush succeeded.
                    Ok(()) if st.failed.is_none() => st.synced = st.synced.max(target),
                    Ok(()) => {}
                    Err(e) => st.failed = st.failed.or(Some(e.raw_os_error().unwrap_or(libc::EIO))),
                }
                // Everyone this round covered; and, if writers wait for the
                // next round, one of them to lead it (all, after a failure).
                self.done[(round % 2) as usize].notify_all();
                let next = &self.done[((round + 1) % 2) as usize];
                if st.failed.is_some() {
                    next.notify_all();
                } else if st.issued > st.synced {
                    next.notify_one();
                }
                continue;
            }
            // A flush runs: it covers this ticket if it began after it;
            // otherwise the next round will.
            let round = if ticket <= st.target { st.rounds } else { st.rounds + 1 };
            st = self.done[(round % 2) as usize].wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Buffers a `pwritev` takes at most (a run of more is written in chunks).
const MAX_IOV: usize = 64;

impl FileDevice {
    /// One `pwritev` of `bufs` (at most [`MAX_IOV`]) at `off`; what a short
    /// write left, one buffer at a time.
    fn pwritev_all(&self, bufs: &[&[u8]], off: u64) -> io::Result<()> {
        match bufs {
            [] => return Ok(()),
            [b] => return self.file.write_all_at(b, off),
            _ => {}
        }
        let iov: Vec<libc::iovec> =
            bufs.iter().map(|b| libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() }).collect();
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let written = loop {
            // SAFETY: every iovec points into a slice of `bufs`, borrowed for
            // the whole call; pwritev only reads them. The count is at most
            // MAX_IOV (the caller's chunks), far below IOV_MAX.
            let n = unsafe {
                libc::pwritev(self.file.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int, off as libc::off_t)
            };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        if written == total {
            return Ok(());
        }
        let (mut skip, mut at) = (written, off);
        for b in bufs {
            if skip >= b.len() {
                skip -= b.len();
            } else {
                self.file.write_all_at(&b[skip..], at + skip as u64)?;
                skip = 0;
            }
            at += b.len() as u64;
        }
        Ok(())
    }

    /// Opens (creating) `path`. With `sync`, writes are on media when they return.
    pub fn open(path: &Path, sync: bool) -> io::Result<FileDevice> {
        let group = sync.then(GroupSync::default);
        let base = 0;
        let open = |flags: i32| {
            OpenOptions::new().read(true).write(true).create(true).truncate(false).custom_flags(flags).open(path)
        };
        match open(base | libc::O_DIRECT) {
            Ok(file) => Ok(FileDevice { file, direct: true, group }),
            // Filesystems without O_DIRECT refuse it with EINVAL: fall back to
            // buffered I/O (the group fdatasync still makes writes durable).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "O_DIRECT unsupported here; using buffered I/O");
                Ok(FileDevice { file: open(base)?, direct: false, group })
            }
            Err(e) => Err(e),
        }
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }
}

impl Device for FileDevice {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.write_all_at(buf, off)?;
        match &self.group {
            Some(g) => g.sync_after_write(&self.file),
            None => Ok(()),
        }
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, off)
    }

    fn file_len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn acks_on_media(&self) -> bool {
        self.group.is_some()
    }

    fn write_deferred(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.write_all_at(buf, off)
    }

    /// The whole run in `pwritev` calls of up to [`MAX_IOV`] buffers each (a
    /// flusher's batch of small records becomes a few large O_DIRECT
    /// writes).
    fn write_deferred_vectored(&self, bufs: &[&[u8]], off: u64) -> io::Result<()> {
        let mut at = off;
        for chunk in bufs.chunks(MAX_IOV) {
            self.pwritev_all(chunk, at)?;
            at += chunk.iter().map(|b| b.len() as u64).sum::<u64>();
        }
        Ok(())
    }

    fn commit(&self, f: &File) -> io::Result<()> {
        self.file.sync_data()?;
        f.sync_data()
    }
}

/// A device wrapper whose I/O can be made to fail (tests, fault drills).
pub struct FaultyDevice {
    inner: Box<dyn Device>,
    errno: Arc<AtomicI32>,
}

impl FaultyDevice {
    /// Wraps `inner`. While the returned switch holds a non-zero errno
    /// (`libc::EIO`, `libc::ENOSPC`, ...), reads and writes fail with it.
    pub fn wrap(inner: Box<dyn Device>) -> (FaultyDevice, Arc<AtomicI32>) {
        let errno = Arc::new(AtomicI32::new(0));
        (FaultyDevice { inner, errno: errno.clone() }, errno)
    }

    fn check(&self) -> io::Result<()> {
        match self.errno.load(Ordering::Relaxed) {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
}

impl Device for FaultyDevice {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.check()?;
        self.inner.write_at(buf, off)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.check()?;
        self.inner.read_at(buf, off)
    }

    fn file_len(&self) -> io::Result<u64> {
        self.inner.file_len()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync(&self) -> io::Result<()> {
        self.check()?;
        self.inner.sync()
    }

    fn acks_on_media(&self) -> bool {
        self.inner.acks_on_media()
    }

    fn sync_journal(&self, f: &File) -> io::Result<()> {
        self.check()?;
        self.inner.sync_journal(f)
    }

    fn write_deferred(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.check()?;
        self.inner.write_deferred(buf, off)
    }

    fn write_deferred_vectored(&self, bufs: &[&[u8]], off: u64) -> io::Result<()> {
        self.check()?;
        self.inner.write_deferred_vectored(bufs, off)
    }

    fn commit(&self, f: &File) -> io::Result<()> {
        self.check()?;
        self.inner.commit(f)
    }
}

/// A power-loss drill (tests): a device that knows which of its writes, and
/// how much of the journal, a flush has put on media, and can "lose power":
/// from then every write and flush fails, and [`PowerCut::apply`] makes the
/// files look as after a power loss (every write no flush covered is
/// garbage, the journal is cut back to its last flushed length). `kill -9`
/// cannot show this: the page cache survives it.
pub struct PowerLossDevice {
    inner: FileDevice,
    group: GroupSync,
    st: Arc<Mutex<PowerState>>,
}

#[derive(Default)]
struct PowerState {
    cut: bool,
    /// Writes begun and not yet covered by a flush: (id, offset, length,
    /// finished). A flush covers only the writes finished when it began.
    pending: Vec<(u64, u64, usize, bool)>,
    next_id: u64,
    /// The journal's length at the start of its last successful flush.
    journal_len: Option<u64>,
}

/// The switch of a [`PowerLossDevice`].
#[derive(Clone)]
pub struct PowerCut {
    st: Arc<Mutex<PowerState>>,
}

impl PowerCut {
    /// Cuts the power now.
    pub fn cut(&self) {
        self.st.lock().unwrap_or_else(|e| e.into_inner()).cut = true;
    }

    /// After [`PowerCut::cut`] and once the store is gone: overwrites every
    /// unflushed write in `data` with garbage and cuts `journal` back to its
    /// last flushed length (as of its first flush, if `baseline` is given and
    /// none happened). Returns (garbled writes, journal bytes dropped).
    pub fn apply(&self, data: &Path, journal: &Path, baseline: u64) -> io::Result<(usize, u64)> {
        let st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let f = OpenOptions::new().write(true).open(data)?;
        for &(_, off, len, _) in &st.pending {
            f.write_all_at(&vec![0xA5; len], off)?;
        }
        f.sync_data()?;
        let keep = st.journal_len.unwrap_or(baseline);
        let j = OpenOptions::new().write(true).open(journal)?;
        let had = j.metadata()?.len();
        j.set_len(keep.min(had))?;
        j.sync_data()?;
        Ok((st.pending.len(), had.saturating_sub(keep)))
    }
}

impl PowerLossDevice {
    pub fn open(path: &Path) -> io::Result<(PowerLossDevice, PowerCut)> {
        let st = Arc::new(Mutex::new(PowerState::default()));
        let d = PowerLossDevice { inner: FileDevice::open(path, false)?, group: GroupSync::default(), st: st.clone() };
        Ok((d, PowerCut { st }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PowerState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn off() -> io::Error {
        io::Error::from_raw_os_error(libc::EIO)
    }

    fn flush(&self) -> io::Result<()> {
        let covered: Vec<u64> = {
            let st = self.lock();
            if st.cut {
                return Err(Self::off());
            }
            st.pending.iter().filter(|p| p.3).map(|p| p.0).collect()
        };
        self.inner.sync()?;
        let mut st = self.lock();
        if st.cut {
            return Err(Self::off());
        }
        st.pending.retain(|p| !covered.contains(&p.0));
        Ok(())
    }
}

impl Device for PowerLossDevice {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.write_deferred(buf, off)?;
        self.group.sync_after(|| self.flush())
    }

    fn write_deferred(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let id = {
            let mut st = self.lock();
            if st.cut {
                return Err(Self::off());
            }
            // Recorded before the write: a write cut short is garbage too.
            st.next_id += 1;
            let id = st.next_id;
            st.pending.push((id, off, buf.len(), false));
            id
        };
        self.inner.write_at(buf, off)?;
        if let Some(p) = self.lock().pending.iter_mut().find(|p| p.0 == id) {
            p.3 = true;
        }
        Ok(())
    }

    fn commit(&self, f: &File) -> io::Result<()> {
        self.flush()?;
        self.sync_journal(f)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.inner.read_at(buf, off)
    }

    fn file_len(&self) -> io::Result<u64> {
        self.inner.file_len()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync(&self) -> io::Result<()> {
        self.flush()
    }

    fn acks_on_media(&self) -> bool {
        true
    }

    fn sync_journal(&self, f: &File) -> io::Result<()> {
        let len = {
            let st = self.lock();
            if st.cut {
                return Err(Self::off());
            }
            f.metadata()?.len()
        };
        f.sync_data()?;
        let mut st = self.lock();
        if st.cut {
            return Err(Self::off());
        }
        st.journal_len = Some(st.journal_len.map_or(len, |l| l.max(len)));
        Ok(())
    }
}

#[cfg(test)]
mod group_sync_tests {
    use super::SyncState;

    #[test]
    fn after_a_failed_flush_no_write_is_acknowledged() {
        // Up to ticket 5 flushed, then a flush failed: 6.. never succeed,
        // including a write whose ticket came after the failed flush began
        // (its pages may have been in that flush, and the error is told once).
        let st = SyncState { issued: 11, synced: 5, running: false, failed: Some(libc::EIO), ..Default::default() };
        assert!(st.verdict(4).unwrap().is_ok(), "flushed before the failure");
        for t in 6..=11 {
            assert_eq!(st.verdict(t).unwrap().unwrap_err().raw_os_error(), Some(libc::EIO), "ticket {t}");
        }
        let ok = SyncState { issued: 11, synced: 5, running: false, failed: None, ..Default::default() };
        assert!(ok.verdict(6).is_none(), "not flushed yet: wait");
    }
}

#[cfg(test)]
mod group_commit_tests {
    use super::GroupSync;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Many writers at once: every call returns only after a flush that
    /// began after it was called, and flushes are shared.
    #[test]
    fn every_writer_waits_for_a_flush_begun_after_it_and_flushes_are_shared() {
        let g = Arc::new(GroupSync::default());
        let started = Arc::new(AtomicU64::new(0));
        let finished = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (g, started, finished) = (g.clone(), started.clone(), finished.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let before = started.load(Ordering::SeqCst);
                        g.sync_after(|| {
                            started.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            finished.fetch_add(1, Ordering::SeqCst);
                            Ok(())
                        })
                        .unwrap();
                        // A flush that started after this call began has finished.
                        assert!(finished.load(Ordering::SeqCst) > before);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let flushes = finished.load(Ordering::SeqCst);
        assert!(flushes < 1600, "flushes shared: {flushes} for 1,600 calls");
    }
}

#[cfg(test)]
mod vectored_tests {
    use super::{Device, FileDevice, MAX_IOV};
    use crate::store::BufPool;

    /// A run of more buffers than one `pwritev` takes lands whole, each
    /// buffer where the run puts it (aligned buffers: the file may be
    /// O_DIRECT).
    #[test]
    fn a_run_longer_than_one_pwritev_lands_whole() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open(&dir.path().join("data"), false).unwrap();
        let pool = BufPool::new(0);
        // Two full calls and a last of one buffer.
        let n = 2 * MAX_IOV + 1;
        let bufs: Vec<_> = (0..n)
            .map(|i| {
                let mut b = pool.get(4096);
                b.full_mut()[..4096].fill((i % 251) as u8 + 1);
                b.set_len(4096);
                b
            })
            .collect();
        let slices: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        dev.write_deferred_vectored(&slices, 8192).unwrap();
        let mut back = pool.get(4096);
        for (i, b) in bufs.iter().enumerate() {
            dev.read_at(&mut back.full_mut()[..4096], 8192 + 4096 * i as u64).unwrap();
            assert_eq!(&back.full_mut()[..4096], b.as_slice(), "buffer {i}");
        }
    }
}
