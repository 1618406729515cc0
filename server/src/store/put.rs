//! The put path: checks, the duplicate check, holding for a flusher, and
//! placing records on their disks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_common::page::{parse_record, PageHeader};

use super::health::Slot;
use super::{
    buf, disk, Disk, DiskError, Held, PooledBuf, PutOutcome, PutResult, Stamp, Store, StoreError, ToMedia,
    INLINE_PUT_MAX,
};

impl Store {
    /// Stores a whole record held in `rec`. Blocking. With `ack = "memory"`
    /// it returns once the record is held for a flusher (or, past the
    /// bound, once on media).
    pub fn put(&self, rec: PooledBuf) -> Result<PutOutcome, StoreError> {
        self.put_in(rec, crate::tenant::DEFAULT)
    }

    /// [`Store::put`] in `tenant`'s namespace (crate::tenant).
    pub fn put_in(&self, rec: PooledBuf, tenant: u32) -> Result<PutOutcome, StoreError> {
        let held = match self.held_with(rec, tenant, true, |d, k| Ok::<_, std::convert::Infallible>(d.contains(k))) {
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
    /// `tenant`: whose namespace it is stored in (crate::tenant).
    pub fn put_copy(&self, rec: PooledBuf, tenant: u32) -> Result<(PutOutcome, Option<Stamp>), StoreError> {
        let held = match self.held_with(rec, tenant, false, |d, k| Ok::<_, std::convert::Infallible>(d.contains(k))) {
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
    /// `tenant`: whose namespace it is stored in (crate::tenant).
    pub fn try_put_held(&self, rec: PooledBuf, tenant: u32) -> Result<Held, PooledBuf> {
        if rec.len() > INLINE_PUT_MAX {
            return Err(rec);
        }
        self.held_with(rec, tenant, true, Disk::try_contains).map_err(|(rec, disk::Busy)| rec)
    }

    /// [`Store::try_put_held`] with `contains` asking a disk whether it
    /// holds a key: Err (the record back, and why) only when `contains`
    /// gave up. `may_hold`: whether the put may be acknowledged from memory.
    fn held_with<E>(
        &self,
        mut rec: PooledBuf,
        tenant: u32,
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
        if let Some(why) = crate::tenant::key_refused(tenant, key) {
            return Ok(Held::Done(Err(StoreError::TenantKey(why))));
        }
        let key = crate::tenant::ns_key(tenant, key).into_owned();
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
                self.tenant_ops.of(&key, |c| c.puts.fetch_add(1, Ordering::Relaxed));
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
                self.tenant_ops.of(&key, |c| c.puts.fetch_add(1, Ordering::Relaxed));
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
        match v.owner_slot(key) {
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
            let Some(Slot::Live(disk)) = v.owner_slot(key) else {
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
    pub(super) fn put_on_disk_many(
        &self,
        batch: &[(Box<[u8]>, Arc<PooledBuf>)],
    ) -> Vec<Result<PutOutcome, StoreError>> {
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
}
