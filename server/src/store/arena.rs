//! A memory arena for the buffers the memory tier holds (`--mem-cap`),
//! faulted in ahead of use by background threads.
//!
//! Without it every put while the memory tier fills needs fresh memory (the
//! tier keeps the put's own buffer), and fresh memory costs a page fault and
//! a kernel page clear per 4 KiB: on the VMs measured here that held puts to
//! a third of the disk's speed until the tier was full. The arena is one
//! anonymous mapping of the tier's size plus the buffer pool's, touched once
//! at start by a few threads while the disks recover (the node listens only
//! when they are done: docs/ARCHITECTURE.md, "Starting"); buffers are carved
//! from it best-fit (4 KiB granularity, free neighbours merged) and fall back
//! to the heap when it has no room.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::alloc::{Allocator, ALIGN};

/// Threads that fault the arena in at start, at most (fewer on a machine
/// with fewer cores).
const WARM_THREADS: usize = 4;

pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    /// Free ranges: the disks' best-fit extent allocator, over the mapping.
    free: Mutex<Allocator>,
    /// Bytes faulted in so far by the warm-up threads.
    warmed: AtomicUsize,
    stop: AtomicBool,
    /// The kernel does not know MADV_POPULATE_WRITE.
    no_populate: AtomicBool,
    /// Set (and waiters woken) when the warm-up has ended, done or not.
    over: Mutex<bool>,
    over_cv: Condvar,
}

// SAFETY: the arena hands out disjoint ranges (under its lock); the mapping
// itself is plain memory owned by the arena until drop.
unsafe impl Send for Arena {}
// SAFETY: as above; all shared state is behind a Mutex or atomics.
unsafe impl Sync for Arena {}

impl Arena {
    /// The mapping: `(address, length)`.
    pub fn range(&self) -> (usize, usize) {
        (self.base.as_ptr() as usize, self.len)
    }

    /// Maps `len` bytes (rounded up to [`ALIGN`]) and starts faulting them
    /// in on background threads. None when the mapping fails (the caller
    /// then uses the heap only).
    pub fn new(len: usize) -> Option<Arc<Arena>> {
        let len = len.div_ceil(ALIGN).checked_mul(ALIGN)?;
        if len == 0 {
            return None;
        }
        // Faulting in more than the machine has would get the node killed
        // at start; then the tier faults in as it fills, as without an arena.
        let warm = match available_memory() {
            Some(avail) if len as u64 > avail / 10 * 9 => {
                tracing::warn!(
                    arena_bytes = len,
                    available_bytes = avail,
                    "the memory tier is larger than the memory available: not faulting it in ahead"
                );
                false
            }
            _ => true,
        };
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched. The result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // Huge pages where the kernel offers them: fewer faults. Advice only.
        // SAFETY: the range is the mapping just made.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let base = NonNull::new(p as *mut u8)?;
        let free = Allocator::new(len as u64);
        let a = Arc::new(Arena {
            base,
            len,
            free: Mutex::new(free),
            warmed: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            no_populate: AtomicBool::new(false),
            over: Mutex::new(false),
            over_cv: Condvar::new(),
        });
        if !warm {
            a.warm_up_over();
            return Some(a);
        }
        // Several threads (page clearing is CPU work), each taking the next
        // 4 MiB step, holding only a weak reference between steps so
        // dropping the store is not delayed. The last one to end says so.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, WARM_THREADS);
        let (next, running) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(threads)));
        let started = std::time::Instant::now();
        for i in 0..threads {
            let (w, next, left) = (Arc::downgrade(&a), next.clone(), running.clone());
            let spawned = std::thread::Builder::new().name(format!("kv-arena-warm-{i}")).spawn(move || {
                const STEP: usize = 4 << 20;
                loop {
                    let Some(a) = w.upgrade() else { return };
                    let off = next.fetch_add(STEP, Ordering::Relaxed);
                    let end = (off + STEP).min(len);
                    let ended = off >= len || a.stop.load(Ordering::Relaxed);
                    let failed = if ended { None } else { a.populate(off, end).err() };
                    if let Some(e) = &failed {
                        tracing::warn!(error = %e, at = off, "stopped faulting in the memory arena");
                    }
                    if !ended && failed.is_none() {
                        a.warmed.fetch_add(end - off, Ordering::AcqRel);
                        continue;
                    }
                    if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                        let done = a.warmed.load(Ordering::Acquire);
                        if done == len {
                            tracing::info!(
                                bytes = len,
                                threads,
                                ms = started.elapsed().as_millis() as u64,
                                "memory arena faulted in (the memory tier fills without page faults)"
                            );
                        }
                        a.warm_up_over();
                    }
                    return;
                }
            });
            if spawned.is_err() {
                tracing::warn!("cannot start an arena warm-up thread: part of the tier faults in on first use");
                if running.fetch_sub(1, Ordering::AcqRel) == 1 {
                    a.warm_up_over();
                }
            }
        }
        Some(a)
    }

    fn warm_up_over(&self) {
        *self.over.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.over_cv.notify_all();
    }

    /// Waits up to `limit` for the warm-up to end: true when it has (all
    /// faulted in, or given up as logged), false at the limit.
    pub fn wait_warm_up(&self, limit: Duration) -> bool {
        let g = self.over.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self.over_cv.wait_timeout_while(g, limit, |over| !*over).unwrap_or_else(|e| e.into_inner());
        *g
    }

    /// Faults in [off, end). MADV_POPULATE_WRITE (Linux 5.14+) maps the
    /// pages writable without changing their contents, so it is safe over
    /// buffers in use; where the kernel does not know it (EINVAL), each free
    /// page's first byte is written under the free-list lock instead. Any
    /// other failure (ENOMEM: the memory is not there) ends the warm-up.
    fn populate(&self, off: usize, end: usize) -> std::io::Result<()> {
        if !self.no_populate.load(Ordering::Relaxed) {
            // SAFETY: the range lies inside the mapping; the advice changes
            // no byte of it.
            let r = unsafe {
                libc::madvise(self.base.as_ptr().add(off) as *mut libc::c_void, end - off, libc::MADV_POPULATE_WRITE)
            };
            if r == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
            self.no_populate.store(true, Ordering::Relaxed);
        }
        // Old kernels: 1 MiB under the lock at a time, so allocations wait
        // briefly at most.
        let mut at = off;
        while at < end {
            let to = (at + (1 << 20)).min(end);
            let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            for (f_off, f_len) in free.free_extents_before(to as u64) {
                let (f_off, f_len) = (f_off as usize, f_len as usize);
                let (a, b) = (f_off.max(at), (f_off + f_len).min(to));
                let mut p = a;
                while p < b {
                    // SAFETY: p is inside the mapping and inside a free
                    // range, which nobody reads or writes while the lock is
                    // held (ranges are handed out under this lock). A
                    // volatile write of 0 is not elided, and free memory's
                    // contents do not matter.
                    unsafe { std::ptr::write_volatile(self.base.as_ptr().add(p), 0) };
                    p += 4096;
                }
            }
            drop(free);
            at = to;
        }
        Ok(())
    }

    /// A range of `len` bytes (a multiple of [`ALIGN`]), or None when the
    /// arena has no free range that large.
    pub(super) fn alloc(&self, len: usize) -> Option<NonNull<u8>> {
        debug_assert!(len % ALIGN == 0 && len > 0);
        let off = self.free.lock().unwrap_or_else(|e| e.into_inner()).alloc(len as u64)? as usize;
        // SAFETY: off + len <= self.len (the free list only holds ranges of
        // the mapping), so the pointer is inside the mapping and non-null.
        Some(unsafe { NonNull::new_unchecked(self.base.as_ptr().add(off)) })
    }

    /// Returns a range from [`Arena::alloc`].
    ///
    /// # Safety
    /// `ptr` and `len` are exactly a range [`Arena::alloc`] of this arena
    /// returned and not yet released, and nothing uses it any more.
    pub(super) unsafe fn release(&self, ptr: NonNull<u8>, len: usize) {
        let off = ptr.as_ptr() as usize - self.base.as_ptr() as usize;
        debug_assert!(off + len <= self.len);
        self.free.lock().unwrap_or_else(|e| e.into_inner()).free(off as u64, len as u64);
    }

    /// Bytes faulted in by the warm-up so far, and in all.
    #[cfg(test)]
    pub fn warmed(&self) -> (usize, usize) {
        (self.warmed.load(Ordering::Acquire), self.len)
    }

    #[cfg(test)]
    pub fn free_bytes(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).free_bytes() as usize
    }
}

/// Bytes of memory this process may still use: MemAvailable, or the
/// cgroup's limit less its usage when that is lower. None when unknown.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let mut avail = kib.saturating_mul(1024);
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    if let (Some(max), Some(cur)) = (read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")) {
        avail = avail.min(max.saturating_sub(cur));
    }
    Some(avail)
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Every buffer holds an Arc to the arena, so none is alive here.
        // SAFETY: unmapping exactly the mapping made in `new`.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_split_and_merge() {
        let a = Arena::new(16 * ALIGN).unwrap();
        let x = a.alloc(4 * ALIGN).unwrap();
        let y = a.alloc(4 * ALIGN).unwrap();
        let z = a.alloc(8 * ALIGN).unwrap();
        assert!(a.alloc(ALIGN).is_none(), "full");
        // SAFETY: a range from alloc, released once (likewise below).
        unsafe { a.release(y, 4 * ALIGN) };
        assert_eq!(a.free_bytes(), 4 * ALIGN);
        assert!(a.alloc(8 * ALIGN).is_none(), "no 8-page hole yet");
        // SAFETY: as above.
        unsafe { a.release(x, 4 * ALIGN) };
        // x and y merged: an 8-page range at the start.
        let w = a.alloc(8 * ALIGN).unwrap();
        assert_eq!(w, x);
        // SAFETY: as above.
        unsafe { a.release(w, 8 * ALIGN) };
        // SAFETY: as above.
        unsafe { a.release(z, 8 * ALIGN) };
        assert_eq!(a.free_bytes(), 16 * ALIGN);
        assert_eq!(a.free.lock().unwrap().free_extents_before(u64::MAX).count(), 1, "all merged into one range");
        // Writable memory.
        let p = a.alloc(ALIGN).unwrap();
        // SAFETY: p is a fresh ALIGN-byte range of the arena.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 7, ALIGN) };
        // SAFETY: as above.
        unsafe { a.release(p, ALIGN) };
    }

    #[test]
    fn warms_up() {
        let a = Arena::new(8 << 20).unwrap();
        assert!(a.wait_warm_up(Duration::from_secs(30)), "warm-up did not finish");
        assert_eq!(a.warmed().0, a.warmed().1, "every byte faulted in");
    }
}
