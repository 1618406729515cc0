//! Disks and revival: a disk's place in the store (in service or out), the
//! view operations take of the disks, taking failed disks out of service and
//! back once their filesystem is repaired.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_common::ring::{Ring, RingMember};

use super::{disk, disk_weight, lock, Disk, RevivalHook, Store, REVIVE_BACKOFF, REVIVE_EVERY};

/// A disk's place in the store: in service, or out of service with every
/// file of it closed (so its filesystem can be unmounted and repaired).
#[derive(Clone)]
pub(super) enum Slot {
    Live(Arc<Disk>),
    Down(Arc<DownDisk>),
}

/// A disk taken out of service: what it was and why.
pub(super) struct DownDisk {
    pub(super) id: String,
    pub(super) dir: PathBuf,
    pub(super) cap: u64,
    pub(super) failure: String,
    /// Why the last attempt to take it back failed (logged once per change).
    last_attempt: Mutex<Option<String>>,
    /// When it was taken out, and the mount its directory was on then.
    since: Instant,
    mount: Option<u64>,
    /// Its marker was unreadable at a check since (the filesystem went away).
    seen_gone: std::sync::atomic::AtomicBool,
}

/// Whether the disk marker in `dir` can be opened and read (a filesystem
/// shut down answers `stat` from its caches but fails every open with EIO).
fn marker_readable(dir: &Path) -> bool {
    std::fs::read(dir.join(disk::MARKER_FILE)).is_ok_and(|t| !t.is_empty())
}

/// The id of the mount `dir` is on (`/proc/self/mountinfo`): a new id after
/// an unmount and mount. None when it cannot be told.
fn mount_id(dir: &Path) -> Option<u64> {
    let dir = std::path::absolute(dir).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let id = f.next()?.parse::<u64>().ok()?;
            let point = f.nth(3)?.replace("\\040", " ");
            dir.starts_with(&point).then_some((point.len(), id))
        })
        .max()
        .map(|(_, id)| id)
}

/// The disks as operations see them: the slots and the placement over the
/// disks in service. Replaced whole (one read lock per operation).
pub(super) struct View {
    pub(super) slots: Vec<Slot>,
    /// What disks taken out of service had counted (counters stay
    /// monotonic across a revival); in the view, so a scrape never counts
    /// a disk twice.
    pub(super) carried: Carried,
    pub(super) ring: Ring,
    /// Ring member index -> slot index.
    pub(super) disk_of: Vec<usize>,
}

/// Counts of disks' earlier incarnations, added to the live disks' own.
#[derive(Clone, Default)]
pub(super) struct Carried {
    /// Per slot: evictions and damaged records dropped.
    pub(super) disks: Vec<[u64; 2]>,
    /// Per tenant: its evictions, and those for another tenant's put.
    pub(super) tenants: std::collections::BTreeMap<u32, [u64; 2]>,
}

impl Carried {
    pub(super) fn new(slots: usize) -> Carried {
        Carried { disks: vec![[0, 0]; slots], tenants: Default::default() }
    }
}

impl View {
    pub(super) fn new(carried: Carried, slots: Vec<Slot>) -> View {
        let mut members = Vec::new();
        let mut disk_of = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            if let Slot::Live(d) = s {
                if !d.is_failed() {
                    members.push(RingMember { id: d.id.clone(), weight: disk_weight(d.cap()) });
                    disk_of.push(i);
                }
            }
        }
        View { ring: Ring::new(members), disk_of, slots, carried }
    }

    /// The slot of the disk placement names for `key` (None: no disk in
    /// service).
    pub(super) fn owner_slot(&self, key: &[u8]) -> Option<&Slot> {
        self.ring.owner(key).map(|m| &self.slots[self.disk_of[m]])
    }

    pub(super) fn live(&self) -> impl Iterator<Item = &Arc<Disk>> {
        self.slots.iter().filter_map(|s| match s {
            Slot::Live(d) => Some(d),
            Slot::Down(_) => None,
        })
    }

    /// A disk out of service or failing (not yet closed).
    pub(super) fn any_out(&self) -> bool {
        self.slots.iter().any(|s| match s {
            Slot::Live(d) => d.is_failed(),
            Slot::Down(_) => true,
        })
    }
}

/// Keys deleted while a disk was out of service (as 64-bit hashes: a
/// collision only makes a disk taken back forget one more key): a disk taken
/// back forgets them, its index still holds them. Bounded; past the bound a
/// disk taken back starts empty.
///
/// A revival scans a disk's keys against a snapshot of the set (an `Arc`,
/// taken under the lock in O(1)), not under the lock: deletes go on during
/// the scan, and those recorded meanwhile are also kept by key in
/// `since_snapshot` and applied to the revived disk when it is put back.
#[derive(Default)]
pub(super) struct DownDeletes {
    pub(super) keys: Arc<HashSet<u64>>,
    hasher: std::hash::RandomState,
    pub(super) overflowed: bool,
    /// During a revival's scan: the keys deleted since its snapshot (None
    /// past [`SINCE_SNAPSHOT_MAX`]: the revived disks are then checked whole).
    pub(super) since_snapshot: Option<Option<Vec<Vec<u8>>>>,
}

/// Keys deleted during a revival's scan that are kept by key.
pub(super) const SINCE_SNAPSHOT_MAX: usize = 1 << 16;

impl DownDeletes {
    pub(super) fn hash(&self, key: &[u8]) -> u64 {
        std::hash::BuildHasher::hash_one(&self.hasher, key)
    }
}

pub(super) const DOWN_DELETES_MAX: usize = 1 << 20;

impl Store {
    /// Places keys over the disks in service.
    pub(super) fn rebuild_ring(&self) {
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        *w = Arc::new(View::new(w.carried.clone(), w.slots.clone()));
    }

    pub(super) fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Periodic upkeep: journal flush and compaction, vanished-dir checks;
    /// a failed disk's files are closed; every [`REVIVE_EVERY`], disks out
    /// of service are checked for a repaired filesystem.
    pub fn maintain(&self) {
        let v = self.view();
        let mut failed = Vec::new();
        for (i, s) in v.slots.iter().enumerate() {
            let Slot::Live(d) = s else { continue };
            if let Err(e) = d.maintain() {
                tracing::warn!(disk = %d.id, error = %e, "index maintenance failed");
            }
            if d.is_failed() {
                failed.push(i);
            }
        }
        let mut any_down = false;
        for s in &v.slots {
            if let Slot::Down(dd) = s {
                any_down = true;
                // Every tick (one stat): catches a filesystem away for a moment.
                if !marker_readable(&dd.dir) {
                    dd.seen_gone.store(true, Ordering::Relaxed);
                }
            }
        }
        drop(v);
        if !failed.is_empty() {
            self.take_down(&failed);
        }
        let due = {
            let mut last = lock(&self.last_revive);
            let due = last.elapsed() >= REVIVE_EVERY;
            if due {
                *last = Instant::now();
            }
            due
        };
        if any_down && due {
            self.revive_disks();
        }
    }

    /// Replaces failed disks by their description: once the operations in
    /// flight let go of them, their files (data, journal, lock) are closed.
    fn take_down(&self, slots: &[usize]) {
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        let mut next = w.slots.clone();
        let mut carried = w.carried.clone();
        for &i in slots {
            let Slot::Live(d) = &next[i] else { continue };
            if !d.is_failed() {
                continue;
            }
            let st = d.stats();
            carried.disks[i][0] += st.evictions;
            carried.disks[i][1] += d.corrupt_dropped();
            for (t, u) in d.tenant_use() {
                let c = carried.tenants.entry(t).or_default();
                c[0] += u.evictions;
                c[1] += u.evicted_for_others;
            }
            tracing::warn!(
                disk = %d.id, dir = %d.dir.display(), every_s = REVIVE_EVERY.as_secs(),
                "disk out of service: its files are closed; its directory is checked for a repaired filesystem"
            );
            next[i] = Slot::Down(Arc::new(DownDisk {
                id: d.id.clone(),
                dir: d.dir.clone(),
                cap: d.cap(),
                failure: st.failure.unwrap_or_else(|| "failed".into()),
                last_attempt: Mutex::new(None),
                since: Instant::now(),
                mount: mount_id(&d.dir),
                // A filesystem shut down or gone: its marker does not read.
                seen_gone: std::sync::atomic::AtomicBool::new(!marker_readable(&d.dir)),
            }));
        }
        *w = Arc::new(View::new(carried, next));
    }

    /// Calls `hook` at the start of each disk's revival scan (for tests of
    /// what may run meanwhile).
    #[doc(hidden)]
    pub fn on_revival_scan(&self, hook: RevivalHook) {
        *lock(&self.revival_hook) = Some(hook);
    }

    /// Takes disks out of service back when their directory holds the disk
    /// marker again and the disk opens (its index recovered as at a start).
    /// A disk is tried once its filesystem was remounted (the marker was
    /// unreadable at a check, or the directory's mount changed), or else
    /// after a back-off (1 minute, doubling with each time the slot was
    /// taken back, up to an hour), so a disk failing on a bad sector does not
    /// flap. A disk taken back forgets the keys deleted while it was out and
    /// the keys stored on another disk meanwhile (the newer copy wins); the
    /// scan runs against a snapshot of the deletes recorded, with neither the
    /// store's view nor the deletes locked (deletes go on meanwhile), and
    /// only the deletes recorded since, kept by key, are applied under the
    /// lock. Never creates a directory
    /// or a marker: a mount point with nothing mounted stays out. Returns
    /// how many disks came back.
    pub fn revive_disks(&self) -> usize {
        let Some(reopen) = &self.reopen else { return 0 };
        let v = self.view();
        let mut opened = Vec::new();
        for (i, s) in v.slots.iter().enumerate() {
            let Slot::Down(dd) = s else { continue };
            let spec = &self.specs[i];
            if !marker_readable(&spec.dir) {
                dd.seen_gone.store(true, Ordering::Relaxed);
                continue;
            }
            let remounted =
                dd.seen_gone.load(Ordering::Relaxed) || (dd.mount.is_some() && mount_id(&spec.dir) != dd.mount);
            let backoff = REVIVE_BACKOFF * 2u32.pow(self.revivals[i].load(Ordering::Relaxed).min(6));
            if !remounted && dd.since.elapsed() < backoff.min(Duration::from_secs(3600)) {
                continue;
            }
            let t0 = Instant::now();
            let r = reopen(&spec.dir.join(disk::DATA_FILE), self.sync_writes)
                .and_then(|dev| Disk::open(dd.id.clone(), &spec.dir, spec.cap, dev));
            match r {
                Ok((d, rep)) => {
                    d.set_shares(self.disk_shares(spec.cap));
                    opened.push((i, d, rep, t0))
                }
                Err(e) => {
                    let e = e.to_string();
                    let mut last = lock(&dd.last_attempt);
                    if last.as_deref() != Some(e.as_str()) {
                        tracing::warn!(disk = %dd.id, dir = %dd.dir.display(), error = %e, "disk not taken back yet");
                        *last = Some(e);
                    }
                }
            }
        }
        drop(v);
        if opened.is_empty() {
            return 0;
        }
        // The scan, with the view and the deletes unlocked: operations go on
        // meanwhile. It checks against a snapshot of the deletes recorded;
        // those recorded during it are kept by key and applied below.
        let (snapshot, hasher, overflowed) = {
            let mut dd = lock(&self.down_deletes);
            dd.since_snapshot = Some(Some(Vec::new()));
            (dd.keys.clone(), dd.hasher.clone(), dd.overflowed)
        };
        // Deletes stop being kept by key when this revival ends, however.
        struct EndSince<'a>(&'a Mutex<DownDeletes>);
        impl Drop for EndSince<'_> {
            fn drop(&mut self) {
                lock(self.0).since_snapshot = None;
            }
        }
        let _end = EndSince(&self.down_deletes);
        let hash = |k: &[u8]| std::hash::BuildHasher::hash_one(&hasher, k);
        let mut scanned = Vec::new();
        for (i, d, rep, t0) in opened {
            if let Some(hook) = &*lock(&self.revival_hook) {
                hook();
            }
            let others = self.view();
            let mut forgot = 0u64;
            for k in d.keys() {
                if overflowed || snapshot.contains(&hash(&k)) || others.live().any(|o| o.contains(&k)) {
                    d.delete(&k);
                    forgot += 1;
                }
            }
            scanned.push((i, d, rep, t0, forgot));
        }
        drop(snapshot);
        let mut w = self.view.write().unwrap_or_else(|e| e.into_inner());
        let mut dd = lock(&self.down_deletes);
        let since = dd.since_snapshot.take().flatten();
        let mut next = w.slots.clone();
        let n = scanned.len();
        for (i, d, rep, t0, mut forgot) in scanned {
            // Deletes recorded during the scan (few, by key); past their
            // bound, or past the set's, the disk is checked whole.
            match &since {
                Some(keys) if !dd.overflowed => {
                    for k in keys {
                        if d.delete(k) {
                            forgot += 1;
                        }
                    }
                }
                _ => {
                    for k in d.keys() {
                        if dd.overflowed || dd.keys.contains(&dd.hash(&k)) {
                            d.delete(&k);
                            forgot += 1;
                        }
                    }
                }
            }
            tracing::warn!(
                disk = %d.id, dir = %d.dir.display(), records = rep.records.saturating_sub(forgot), forgot,
                reclaimed = rep.reclaimed, ms = t0.elapsed().as_millis() as u64, "disk back in service"
            );
            self.revivals[i].fetch_add(1, Ordering::Relaxed);
            next[i] = Slot::Live(Arc::new(d));
        }
        let view = View::new(w.carried.clone(), next);
        if !view.any_out() {
            *dd = DownDeletes::default();
        }
        *w = Arc::new(view);
        // Quotas set while these disks were scanned reached only the disks
        // then in service: give the revived ones the shares in force now.
        for d in w.live() {
            d.set_shares(self.disk_shares(d.cap()));
        }
        n
    }
}
