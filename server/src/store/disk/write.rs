//! The write path of one disk: a record written to a new extent, entered
//! in the journal and the index, then committed (alone, in a flusher's
//! batch, or gathered with the puts waiting).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use kv_common::page::{PageHeader, HEADER_LEN};

use super::super::buf::{align_up, PooledBuf};
use super::super::journal;
use super::{lock, use_tick, Disk, DiskError, Entry, Extent, PutResult};

/// Puts on media waiting for the one that writes them together: while one
/// put writes a run, the others queue here, and the next to lead takes them
/// all (up to a flusher's batch).
#[derive(Default)]
pub(super) struct Gather {
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

impl Disk {
    /// Stores a validated record (`rec` holds exactly its bytes, zero-padded
    /// to the extent alignment: [`PooledBuf::pad_to_align`]).
    pub fn put(&self, rec: &PooledBuf, key: &[u8], header: &PageHeader) -> Result<PutResult, DiskError> {
        let r = self.write_and_enter(rec, key, header)?;
        if matches!(r, PutResult::Stored(_)) {
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
    /// ([`Disk::write_and_enter_run`]), else each half as a run of its own
    /// (a full disk's free space in pieces may hold no run of a whole
    /// batch, but runs of its halves), down to one by one.
    fn enter_many(&self, items: &[(&PooledBuf, &[u8], &PageHeader)]) -> Vec<Result<PutResult, DiskError>> {
        if let Some(out) = self.write_and_enter_run(items) {
            return out;
        }
        if items.len() >= 4 {
            let (a, b) = items.split_at(items.len() / 2);
            let mut out = self.enter_many(a);
            out.extend(self.enter_many(b));
            return out;
        }
        items.iter().map(|(rec, key, header)| self.write_and_enter(rec, key, header)).collect()
    }

    /// The group commit of records just entered: a record is `Stored`
    /// only once it succeeded.
    fn commit_many(&self, out: &mut [Result<PutResult, DiskError>]) {
        if out.iter().any(|r| matches!(r, Ok(PutResult::Stored(_)))) {
            if let Err(e) = self.commit() {
                tracing::debug!(disk = %self.id, error = %e, "batch commit failed");
                for r in out.iter_mut().filter(|r| matches!(r, Ok(PutResult::Stored(_)))) {
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
                        let fits = bytes < super::super::FLUSH_BATCH_BYTES;
                        bytes += p.rec.len() as u64;
                        fits
                    })
                    .count()
                    .min(super::super::FLUSH_BATCH);
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
            let putter = crate::tenant::split(key).0;
            while st.used + alloc_len > self.cap {
                if !self.evict_one(&mut st, putter, alloc_len) {
                    break;
                }
            }
            let off = loop {
                if st.used + alloc_len <= self.cap {
                    if let Some(off) = st.alloc.alloc(alloc_len) {
                        break off;
                    }
                }
                if !self.evict_one(&mut st, putter, alloc_len) {
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
        let stamp = st.stamp();
        st.enter(key.into(), Entry { ext, header: *header, header_bytes, used: use_tick(), stamp });
        drop(st);
        Ok(PutResult::Stored(stamp))
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
            // Under tenants' shares, room is made for one tenant's put at a
            // time: a run of several tenants' records (the write-behind
            // flushers' queue mixes them) is written one by one.
            let putter = crate::tenant::split(items[fresh[0]].1).0;
            if st.by_tenant() && fresh.iter().any(|&i| crate::tenant::split(items[i].1).0 != putter) {
                return None;
            }
            while st.used + total > self.cap {
                if !self.evict_one(&mut st, putter, total) {
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
            let stamp = st.stamp();
            st.enter(key.into(), Entry { ext, header: *header, header_bytes, used: use_tick(), stamp });
            out[i] = Ok(PutResult::Stored(stamp));
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
}
