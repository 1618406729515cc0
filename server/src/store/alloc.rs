//! Best-fit extent allocator over `[0, limit)`: one disk's data file, or
//! the memory arena (`arena.rs`).
//!
//! Free space is kept twice: by offset (to coalesce neighbours on free) and
//! by (size, offset) (to find the smallest extent that fits). With the uniform
//! page sizes of one model, a freed extent is exactly what the next put needs,
//! so fragmentation stays low; mixed sizes coalesce as neighbours free.

use std::collections::{BTreeMap, BTreeSet};

/// Alignment (and length granularity) of direct I/O, and of every extent.
pub const ALIGN: usize = 4096;

/// Rounds `n` up to a multiple of [`ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

#[derive(Debug, Default)]
pub struct Allocator {
    by_off: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl Allocator {
    /// Everything in `[0, limit)` free.
    pub fn new(limit: u64) -> Allocator {
        let mut a = Allocator::default();
        if limit > 0 {
            a.insert(0, limit);
        }
        a
    }

    fn insert(&mut self, off: u64, len: u64) {
        self.by_off.insert(off, len);
        self.by_size.insert((len, off));
        self.free_bytes += len;
    }

    fn remove(&mut self, off: u64, len: u64) {
        self.by_off.remove(&off);
        self.by_size.remove(&(len, off));
        self.free_bytes -= len;
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Takes `len` bytes from the smallest free extent that holds them.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let &(flen, off) = self.by_size.range((len, 0)..).next()?;
        self.remove(off, flen);
        if flen > len {
            self.insert(off + len, flen - len);
        }
        Some(off)
    }

    /// Marks `[off, off+len)` used during recovery. False when any of it is
    /// not free (an overlap: the caller drops that record).
    pub fn reserve(&mut self, off: u64, len: u64) -> bool {
        let Some((&foff, &flen)) = self.by_off.range(..=off).next_back() else {
            return false;
        };
        if foff + flen < off + len {
            return false;
        }
        self.remove(foff, flen);
        if foff < off {
            self.insert(foff, off - foff);
        }
        if off + len < foff + flen {
            self.insert(off + len, foff + flen - off - len);
        }
        true
    }

    /// The free extents (offset, length) that start before `end`, in order.
    pub fn free_extents_before(&self, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_off.range(..end).map(|(&o, &l)| (o, l))
    }

    /// Returns an extent, merging it with free neighbours.
    pub fn free(&mut self, mut off: u64, mut len: u64) {
        if let Some((&poff, &plen)) = self.by_off.range(..off).next_back() {
            debug_assert!(poff + plen <= off, "double free");
            if poff + plen == off {
                self.remove(poff, plen);
                off = poff;
                len += plen;
            }
        }
        if let Some(&nlen) = self.by_off.get(&(off + len)) {
            self.remove(off + len, nlen);
            len += nlen;
        }
        self.insert(off, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_split_and_coalesce() {
        let mut a = Allocator::new(100);
        assert_eq!(a.alloc(10), Some(0));
        assert_eq!(a.alloc(20), Some(10));
        assert_eq!(a.alloc(30), Some(30));
        assert_eq!(a.free_bytes(), 40);
        a.free(10, 20);
        // Best fit: the 20-byte hole, not the 40-byte tail.
        assert_eq!(a.alloc(15), Some(10));
        assert_eq!(a.alloc(50), None);
        a.free(0, 10);
        a.free(10, 15);
        a.free(30, 30);
        assert_eq!(a.free_bytes(), 100);
        assert_eq!(a.alloc(100), Some(0), "all neighbours coalesced");
    }

    #[test]
    fn reserve_detects_overlap() {
        let mut a = Allocator::new(100);
        assert!(a.reserve(40, 10));
        assert!(!a.reserve(45, 10));
        assert!(a.reserve(0, 40));
        assert!(a.reserve(50, 50));
        assert_eq!(a.free_bytes(), 0);
        assert!(!a.reserve(99, 2));
    }
}
