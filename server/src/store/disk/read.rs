//! The read side of one disk's index: gets (each read checked), exist
//! checks, record sizes, key listings, deletes and the scrub queue.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_common::page::{Geometry, HEADER_LEN};

use super::super::buf::BufPool;
use super::super::journal;
use super::{lock, use_tick, Busy, Disk, DiskError, Extent, Lookup, State};

impl Disk {
    /// Reads a record. With `geo`, a record of another geometry is a
    /// mismatch and is not read. `promote` refreshes its recency.
    pub fn get(&self, key: &[u8], geo: Option<&Geometry>, pool: &BufPool, promote: bool) -> Result<Lookup, DiskError> {
        if self.is_failed() {
            return Ok(Lookup::Miss);
        }
        let (ext, header, header_bytes) = {
            let mut st = lock(&self.state);
            let e = if promote { st.touch(key, use_tick()).map(|e| &*e) } else { st.index.peek(key) };
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
        // The record holds the client's key; the index, the tenant's
        // namespaced one (crate::tenant).
        let own = crate::tenant::client_key(key);
        let key_ok = rec.get(HEADER_LEN..HEADER_LEN + own.len()) == Some(own);
        if rec[..HEADER_LEN] != header_bytes || !key_ok {
            self.drop_damaged(key, &ext, "stored header or key differs from the index");
            return Ok(Lookup::Damaged);
        }
        // Every read from disk is checked, not only records recovered after
        // a crash: a record damaged on the device after it was written (or
        // after a clean stop) is dropped here, so get and exist agree that
        // it is gone, instead of being sent to clients that reject it.
        let payload = &rec[HEADER_LEN + own.len()..];
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
            st.remove(key);
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
        self.delete_where(key, None)
    }

    /// Removes the key's record only if its entry still carries `stamp`
    /// (the record a put that returned it stored, not one stored since),
    /// journalled as any delete. True when it removed it.
    pub fn delete_if_stamp(&self, key: &[u8], stamp: u64) -> bool {
        self.delete_where(key, Some(stamp))
    }

    /// Removes the key's record (only the one carrying `stamp`, if given).
    fn delete_where(&self, key: &[u8], stamp: Option<u64>) -> bool {
        if self.is_failed() {
            return false;
        }
        let mut st = lock(&self.state);
        if let Some(s) = stamp {
            if st.index.peek(key).is_none_or(|e| e.stamp != s) {
                return false;
            }
        }
        let Some(entry) = st.remove(key) else {
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

    /// Where a record lives (tests and tools): (offset, extent length).
    pub fn locate(&self, key: &[u8]) -> Option<(u64, u64)> {
        lock(&self.state).index.peek(key).map(|e| (e.ext.off, e.ext.len))
    }
}
