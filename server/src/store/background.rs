//! Background work: the write-behind flushers (`ack = "memory"`) and the
//! prefetch warmers (docs/ARCHITECTURE.md, "Prefetch warming").

use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::{behind, warm, Lookup, PooledBuf, Presence, Store};

impl Store {
    /// Runs a flusher of the write-behind (`ack = "memory"`) until the
    /// store stops or is dropped (it holds the store only while it writes).
    /// A flusher takes up to [`FLUSH_BATCH`](super::FLUSH_BATCH) records
    /// ([`FLUSH_BATCH_BYTES`](super::FLUSH_BATCH_BYTES)) at once and commits
    /// each disk's share of them together.
    fn flusher(store: std::sync::Weak<Store>, b: Arc<behind::WriteBehind>) {
        loop {
            let batch = b.next_batch();
            if batch.is_empty() {
                if b.stopping() || store.strong_count() == 0 {
                    return;
                }
                continue;
            }
            // Lets go of the keys whatever happens below (a delete of one
            // waits until then).
            struct Release<'a>(&'a behind::WriteBehind, Vec<(&'a [u8], bool)>);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    self.0.done_batch(self.1.iter().map(|&(k, w)| (k, w)));
                }
            }
            let mut release = Release(&b, batch.iter().map(|(k, _)| (&k[..], false)).collect());
            let Some(s) = store.upgrade() else { return };
            for ((key, written), r) in release.1.iter_mut().zip(s.put_on_disk_many(&batch)) {
                *written = match r {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(key = %String::from_utf8_lossy(key), error = %e, "write-behind: page not written: it now misses");
                        false
                    }
                };
            }
            drop(s);
            drop(release);
        }
    }

    /// After an exist: hands the keys `found` present to a warmer, which
    /// reads those only on disk into the memory tier. On the reactor: one
    /// buffer and a lock never waited for.
    pub fn warm(&self, keys: &[&[u8]], found: &[Presence]) {
        let Some(w) = &self.warmer else { return };
        if !found.contains(&Presence::Present) {
            return;
        }
        w.offer_keys(|| {
            warm::encode_keys(keys.iter().zip(found).filter(|(_, p)| **p == Presence::Present).map(|(k, _)| *k))
        });
    }

    /// On a warmer: queues the keys of `packed` that are only on disk; how
    /// many.
    fn sort_for_warming(&self, w: &warm::Warmer, packed: &[u8]) -> usize {
        let Some(m) = &self.mem else { return 0 };
        let keys = warm::decode_keys(packed);
        let mut in_mem = vec![false; keys.len()];
        m.contains_many(&keys, &mut in_mem);
        let v = self.view();
        let mut queued = 0;
        for (k, held) in keys.into_iter().zip(in_mem) {
            if held || self.behind.as_ref().is_some_and(|b| b.contains(k)) {
                continue;
            }
            if let Some(len) = v.live().find_map(|d| d.record_len(k)) {
                w.offer(k, len);
                queued += 1;
            }
        }
        queued
    }

    /// Reads `key` from its disk into the memory tier; true when it entered.
    fn warm_one(&self, key: &[u8]) -> bool {
        let Some(m) = &self.mem else { return false };
        let generation = m.generation();
        match self.read_cold(key) {
            Some(buf) => {
                m.insert(key, Arc::new(buf), generation);
                true
            }
            None => false,
        }
    }

    /// A record read from the disk holding it, without refreshing its
    /// recency, filling the memory tier or counting a get (warming, the
    /// drain's push). None when no disk holds it whole.
    pub(super) fn read_cold(&self, key: &[u8]) -> Option<PooledBuf> {
        for d in self.view().live() {
            match d.get(key, None, &self.pool, false) {
                Ok(Lookup::Hit(buf)) => return Some(buf),
                Ok(Lookup::Miss) => {}
                Ok(_) => return None,
                Err(_) => {
                    self.rebuild_ring();
                    return None;
                }
            }
        }
        None
    }

    fn warmer(store: std::sync::Weak<Store>, w: Arc<warm::Warmer>) {
        loop {
            let Some(work) = w.next() else {
                if store.strong_count() == 0 {
                    return;
                }
                continue;
            };
            let Some(s) = store.upgrade() else { return };
            match work {
                warm::Work::Sort(packed) => {
                    let queued = s.sort_for_warming(&w, &packed);
                    w.sorted(packed, queued);
                }
                warm::Work::Read(key, len) => {
                    let warmed = s.warm_one(&key);
                    w.done(&key, len, warmed);
                }
            }
            drop(s);
        }
    }

    /// Waits (up to `timeout`) until every put acknowledged from memory is
    /// on its disk, without refusing new ones (a draining node refuses them
    /// itself). The number of pages still held.
    pub fn flush_behind(&self, timeout: Duration) -> usize {
        self.behind.as_ref().map_or(0, |b| b.wait_empty(timeout))
    }

    /// Starts `n` warmer threads when there is a memory tier.
    pub fn start_warmers(store: &Arc<Store>, n: usize) -> io::Result<()> {
        let Some(w) = &store.warmer else { return Ok(()) };
        for i in 0..n.max(1) {
            let (s, w) = (Arc::downgrade(store), w.clone());
            std::thread::Builder::new().name(format!("warm-{i}")).spawn(move || Store::warmer(s, w))?;
        }
        Ok(())
    }

    /// Starts `n` flusher threads when puts are acknowledged from memory.
    pub fn start_flushers(store: &Arc<Store>, n: usize) -> io::Result<()> {
        let Some(b) = &store.behind else { return Ok(()) };
        for i in 0..n.max(1) {
            let (w, b) = (Arc::downgrade(store), b.clone());
            std::thread::Builder::new().name(format!("flush-{i}")).spawn(move || Store::flusher(w, b))?;
        }
        Ok(())
    }
}
