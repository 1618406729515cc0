//! 4 KiB-aligned buffers for O_DIRECT I/O, and a pool that recycles them.
//!
//! Large allocations straight from the allocator cost a page fault per 4 KiB
//! on first touch; a put or get of a 4 MiB page would spend a millisecond on
//! that alone. The pool keeps released buffers (bounded in bytes) so the hot
//! path reuses warm memory.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::arena::Arena;

pub use super::alloc::{align_up, ALIGN};

/// An owned, 4 KiB-aligned byte buffer of fixed capacity with a length,
/// from the heap or from an [`Arena`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
    arena: Option<Arc<Arena>>,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of at least `cap` bytes (rounded up to [`ALIGN`], at least one block).
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = align_up(cap.max(1) as u64) as usize;
        let layout = Layout::from_size_align(cap, ALIGN).expect("aligned layout");
        // Zeroed, so every byte of the capacity is initialised and the safe
        // accessors below never expose uninitialised memory. (The pool makes
        // this a one-time cost per buffer.)
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap, len: 0, arena: None }
    }

    /// A buffer of `align_up(cap)` bytes carved from `arena`, if it has room.
    /// Its bytes are initialised (the mapping starts zeroed and is only ever
    /// written through buffers) but hold whatever an earlier buffer left.
    pub fn in_arena(arena: &Arc<Arena>, cap: usize) -> Option<AlignedBuf> {
        let cap = align_up(cap.max(1) as u64) as usize;
        let ptr = arena.alloc(cap)?;
        Some(AlignedBuf { ptr, cap, len: 0, arena: Some(arena.clone()) })
    }

    /// `(address, length)` of a buffer from the heap (None: from an arena).
    pub fn heap_range(&self) -> Option<(usize, usize)> {
        self.arena.is_none().then_some((self.ptr.as_ptr() as usize, self.cap))
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the valid length. Panics when beyond capacity (a bug, not input).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "length beyond capacity");
        self.len = len;
    }

    /// The valid bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len bytes, all initialised (zeroed at
        // allocation, written since), and shared borrows of self forbid writes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole capacity, for filling.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes (zeroed at allocation)
        // and uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// The first `n` bytes of the capacity (aligned I/O length).
    pub fn prefix(&self, n: usize) -> &[u8] {
        assert!(n <= self.cap);
        // SAFETY: ptr is valid for cap >= n initialised bytes (zeroed at
        // allocation); shared borrows of self forbid writes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), n) }
    }

    /// Zero-fills from `len` to the next [`ALIGN`] boundary and returns that length.
    pub fn pad_to_align(&mut self) -> usize {
        let end = align_up(self.len as u64) as usize;
        let len = self.len;
        self.full_mut()[len..end].fill(0);
        end
    }
}

/// Called with `(address, length)` before the heap memory of a pool's
/// buffer is freed ([`BufPool::set_free_hook`]): the RDMA engine forgets
/// cached registrations of it, so memory the allocator maps there later is
/// never reached through the old pages.
pub type FreeHook = Box<dyn Fn(usize, usize) + Send + Sync>;

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(a) = self.arena.take() {
            // SAFETY: ptr/cap are the range `in_arena` took from this arena,
            // released once (here), and the buffer is being dropped.
            unsafe { a.release(self.ptr, self.cap) };
            return;
        }
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("aligned layout");
        // SAFETY: allocated in `new` with this same layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// A buffer borrowed from a [`BufPool`]; it goes back on drop.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<PoolInner>,
}

impl std::ops::Deref for PooledBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("buffer present until drop")
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("buffer present until drop")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

struct PoolInner {
    max_bytes: usize,
    free: Mutex<(usize, HashMap<usize, Vec<AlignedBuf>>)>,
    /// Told of each heap buffer of this pool before it is freed.
    on_free: std::sync::OnceLock<FreeHook>,
}

impl PoolInner {
    fn give_back(&self, b: AlignedBuf) {
        {
            let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if g.0 + b.capacity() <= self.max_bytes {
                g.0 += b.capacity();
                g.1.entry(b.capacity()).or_default().push(b);
                return;
            }
        }
        self.release(b);
    }

    /// Frees a buffer, telling the hook first when its memory is the heap's.
    fn release(&self, b: AlignedBuf) {
        if let (Some(hook), Some((addr, len))) = (self.on_free.get(), b.heap_range()) {
            hook(addr, len);
        }
        drop(b);
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let parked = std::mem::take(&mut self.free.get_mut().unwrap_or_else(|e| e.into_inner()).1);
        for b in parked.into_values().flatten() {
            self.release(b);
        }
    }
}

/// A pool of aligned buffers keyed by capacity, bounded in total bytes kept;
/// new buffers come from its arena while that has room, else the heap.
#[derive(Clone)]
pub struct BufPool {
    inner: Arc<PoolInner>,
    arena: Option<Arc<Arena>>,
}

impl BufPool {
    pub fn new(max_bytes: usize) -> BufPool {
        BufPool {
            inner: Arc::new(PoolInner {
                max_bytes,
                free: Mutex::new((0, HashMap::new())),
                on_free: std::sync::OnceLock::new(),
            }),
            arena: None,
        }
    }

    /// Sets what is told of each heap buffer of this pool before its memory
    /// is freed (once per pool; later calls are ignored). Buffers carved
    /// from the arena stay mapped for the pool's life and are not told.
    pub fn set_free_hook(&self, f: FreeHook) {
        let _ = self.inner.on_free.set(f);
    }

    /// As [`BufPool::new`], carving new buffers from `arena` first.
    pub fn with_arena(max_bytes: usize, arena: Option<Arc<Arena>>) -> BufPool {
        BufPool { arena, ..BufPool::new(max_bytes) }
    }

    /// The arena new buffers come from, if any.
    pub fn arena(&self) -> Option<&Arc<Arena>> {
        self.arena.as_ref()
    }

    /// A buffer with capacity `align_up(cap)` and length 0.
    pub fn get(&self, cap: usize) -> PooledBuf {
        let cap = align_up(cap.max(1) as u64) as usize;
        let reused = {
            let mut g = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
            let b = g.1.get_mut(&cap).and_then(|v| v.pop());
            if b.is_some() {
                g.0 -= cap;
            }
            b
        };
        let mut buf = reused
            .or_else(|| self.arena.as_ref().and_then(|a| AlignedBuf::in_arena(a, cap)))
            .unwrap_or_else(|| AlignedBuf::new(cap));
        buf.set_len(0);
        PooledBuf { buf: Some(buf), pool: self.inner.clone() }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn copy_of(&self, bytes: &[u8]) -> PooledBuf {
        let mut b = self.get(bytes.len());
        b.full_mut()[..bytes.len()].copy_from_slice(bytes);
        b.set_len(bytes.len());
        b
    }

    /// The memory tier's mapping `(address, length)`, if there is one (the
    /// RDMA engine registers it whole).
    pub fn arena_range(&self) -> Option<(usize, usize)> {
        self.arena.as_ref().map(|a| a.range())
    }

    /// Bytes currently parked in the pool.
    pub fn parked_bytes(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_recycled() {
        let pool = BufPool::new(1 << 20);
        let mut b = pool.get(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.prefix(0).as_ptr() as usize % ALIGN, 0);
        b.full_mut()[..3].copy_from_slice(b"abc");
        b.set_len(3);
        assert_eq!(b.pad_to_align(), 4096);
        assert_eq!(b.as_slice(), b"abc");
        drop(b);
        assert_eq!(pool.parked_bytes(), 8192);
        let b = pool.get(8192);
        assert_eq!(pool.parked_bytes(), 0);
        assert!(b.is_empty());
        drop(b);
        // Over the pool's bound: dropped, not parked.
        drop(pool.get(2 << 20));
        assert_eq!(pool.parked_bytes(), 8192);
    }

    #[test]
    fn the_pools_hook_hears_of_each_heap_buffer_freed_and_of_no_arena_buffer() {
        let told: Arc<Mutex<Vec<(usize, usize)>>> = Arc::default();
        // Room for one parked 8 KiB buffer; an arena of 16 KiB.
        let pool = BufPool::with_arena(8192, Arena::new(16 << 10));
        let t = told.clone();
        pool.set_free_hook(Box::new(move |a, n| t.lock().unwrap().push((a, n))));
        pool.set_free_hook(Box::new(|_, _| panic!("a second hook is ignored")));
        let in_arena = pool.get(16 << 10);
        let (a, b) = (pool.get(8192), pool.get(8192));
        let (ra, rb) = (a.heap_range().unwrap(), b.heap_range().unwrap());
        assert_eq!(in_arena.heap_range(), None);
        drop((in_arena, a));
        assert!(told.lock().unwrap().is_empty(), "one heap buffer parked, the arena's kept mapped");
        drop(b);
        assert_eq!(*told.lock().unwrap(), vec![rb], "past the pool's bytes: freed, and told first");
        drop(pool);
        assert_eq!(*told.lock().unwrap(), vec![rb, ra], "the parked one, when the pool goes");
    }

    #[test]
    fn arena_buffers_are_disjoint_and_fall_back_to_the_heap() {
        // An arena of 64 KiB, a pool that parks nothing: every buffer is new.
        let arena = Arena::new(64 << 10);
        assert!(arena.is_some());
        let pool = BufPool::with_arena(0, arena.clone());
        let arena = arena.unwrap();
        let base = arena.alloc(ALIGN).unwrap();
        // SAFETY: the range just taken, released at once.
        unsafe { arena.release(base, ALIGN) };
        let in_arena = |b: &AlignedBuf| {
            let p = b.prefix(0).as_ptr() as usize;
            p >= base.as_ptr() as usize && p < base.as_ptr() as usize + (64 << 10)
        };
        // Four 16 KiB buffers fill it; each keeps its own bytes.
        let mut bufs: Vec<PooledBuf> = (0..4u8)
            .map(|i| {
                let mut b = pool.get(16 << 10);
                b.full_mut().fill(i);
                b.set_len(16 << 10);
                b
            })
            .collect();
        assert!(bufs.iter().all(|b| in_arena(b)));
        assert_eq!(arena.free_bytes(), 0);
        // A fifth comes from the heap.
        let extra = pool.get(16 << 10);
        assert!(!in_arena(&extra));
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as u8), "buffer {i} overwritten");
        }
        // Released ranges are reused, and merged back into one at the end.
        bufs.remove(1);
        let again = pool.get(16 << 10);
        assert!(in_arena(&again));
        drop((bufs, again, extra));
        assert_eq!(arena.free_bytes(), 64 << 10);
    }
}
