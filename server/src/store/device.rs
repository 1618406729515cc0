//! The block device a disk store writes to: a trait so the engine can be
//! tested with injected faults, and the real implementation over one data
//! file opened with O_DIRECT, with a group-committed fdatasync so that an
//! acknowledged write is on media even with a volatile device cache.

use std::fs::{File, OpenOptions};
use std::io;
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
struct GroupSync {
    state: Mutex<SyncState>,
    done: Condvar,
}

#[derive(Default)]
struct SyncState {
    issued: u64,
    synced: u64,
    running: bool,
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
    fn sync_after_write(&self, file: &File) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.issued += 1;
        let ticket = st.issued;
        loop {
            if let Some(v) = st.verdict(ticket) {
                return v;
            }
            if !st.running {
                st.running = true;
                let target = st.issued;
                drop(st);
                let r = file.sync_data();
                st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                st.running = false;
                match r {
                    // After a failure nothing more is acknowledged, even if
                    // this (later) flush succeeded.
                    Ok(()) if st.failed.is_none() => st.synced = st.synced.max(target),
                    Ok(()) => {}
                    Err(e) => st.failed = st.failed.or(Some(e.raw_os_error().unwrap_or(libc::EIO))),
                }
                self.done.notify_all();
                continue;
            }
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl FileDevice {
    /// Opens (creating) `path`. With `sync`, writes are on media when they return.
    pub fn open(path: &Path, sync: bool) -> io::Result<FileDevice> {
        let group = sync.then(|| GroupSync { state: Mutex::new(SyncState::default()), done: Condvar::new() });
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
}

#[cfg(test)]
mod group_sync_tests {
    use super::SyncState;

    #[test]
    fn after_a_failed_flush_no_write_is_acknowledged() {
        // Up to ticket 5 flushed, then a flush failed: 6.. never succeed,
        // including a write whose ticket came after the failed flush began
        // (its pages may have been in that flush, and the error is told once).
        let st = SyncState { issued: 11, synced: 5, running: false, failed: Some(libc::EIO) };
        assert!(st.verdict(4).unwrap().is_ok(), "flushed before the failure");
        for t in 6..=11 {
            assert_eq!(st.verdict(t).unwrap().unwrap_err().raw_os_error(), Some(libc::EIO), "ticket {t}");
        }
        let ok = SyncState { issued: 11, synced: 5, running: false, failed: None };
        assert!(ok.verdict(6).is_none(), "not flushed yet: wait");
    }
}
