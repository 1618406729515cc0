//! Store engine tests without sockets: the behaviours of a node's store that
//! docs/ARCHITECTURE.md ("The node") and docs/RELIABILITY.md describe.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use kv_common::page::{build_record, Geometry};
use kv_server::store::device::FaultyDevice;
use kv_server::store::{DiskSpec, FileDevice, GetOutcome, Presence, PutOutcome, Store, StoreConfig, StoreError};

fn geo() -> Geometry {
    Geometry {
        model_hash: 42,
        page_size: 64,
        dtype_tag: 1,
        tp_size: 1,
        layer_num: 2,
        head_num: 4,
        head_dim: 8,
        ..Default::default()
    }
}

fn cfg(dirs: &[PathBuf], cap: u64, mem_cap: u64) -> StoreConfig {
    StoreConfig {
        disks: dirs.iter().map(|d| DiskSpec { dir: d.clone(), cap }).collect(),
        mem_cap,
        sync_writes: false,
        pool_bytes: 16 << 20,
        ack_memory_max: None,
        flushers: 0,
        warmers: 0,
    }
}

fn payload(key: &str, len: usize) -> Vec<u8> {
    let seed = kv_common::page::key_hash(key.as_bytes());
    (0..len).map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8)).collect()
}

fn put(store: &Store, key: &str, len: usize) -> Result<PutOutcome, StoreError> {
    let rec = build_record(geo(), key.as_bytes(), &payload(key, len));
    store.put(store.pool().copy_of(&rec))
}

/// The payload a get returns, or None on miss/mismatch.
fn get(store: &Store, key: &str) -> Option<Vec<u8>> {
    match store.get(key.as_bytes(), Some(&geo())) {
        GetOutcome::Hit(b) => {
            let rec = b.as_slice();
            let (h, k) = kv_common::page::parse_record(rec).expect("served record validates");
            assert_eq!(k, key.as_bytes());
            let p = &rec[64 + k.len()..];
            assert_eq!(crc32fast::hash(p), h.payload_crc, "served payload is whole");
            Some(p.to_vec())
        }
        _ => None,
    }
}

fn dirs(t: &tempfile::TempDir, n: usize) -> Vec<PathBuf> {
    (0..n).map(|i| t.path().join(format!("d{i}"))).collect()
}

#[test]
fn round_trip_write_once_and_delete() {
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 2), 64 << 20, 0)).unwrap();
    for i in 0..50 {
        assert_eq!(put(&s, &format!("k{i}"), 10_000 + i).unwrap(), PutOutcome::Stored);
    }
    for i in 0..50 {
        assert_eq!(get(&s, &format!("k{i}")).unwrap(), payload(&format!("k{i}"), 10_000 + i));
    }
    // Write-once: a second put of a key is acknowledged and changes nothing.
    let other = build_record(geo(), b"k3", b"different bytes");
    assert_eq!(s.put(s.pool().copy_of(&other)).unwrap(), PutOutcome::Duplicate);
    assert_eq!(get(&s, "k3").unwrap(), payload("k3", 10_003));
    assert!(get(&s, "absent").is_none());
    // Geometry: exist and get both refuse another model's page.
    let mut g2 = geo();
    g2.model_hash += 1;
    assert_eq!(s.exist(b"k1", Some(&geo())), Presence::Present);
    assert_eq!(s.exist(b"k1", Some(&g2)), Presence::Mismatch);
    assert!(matches!(s.get(b"k1", Some(&g2)), GetOutcome::Mismatch));
    assert!(s.delete(b"k1"));
    assert_eq!(s.exist(b"k1", None), Presence::Absent);
    let st = s.stats();
    assert_eq!(st.objects, 49);
    assert!(st.disks.iter().all(|d| d.objects > 0), "both disks used: {st:?}");
    // Placement follows docs/PROTOCOL.md §4 among disk0, disk1.
    let ring = kv_common::Ring::new(vec![
        kv_common::ring::RingMember { id: "disk0".into(), weight: 1 },
        kv_common::ring::RingMember { id: "disk1".into(), weight: 1 },
    ]);
    for i in 0..50 {
        let k = format!("k{i}");
        assert_eq!(s.owner(k.as_bytes()), ring.owner(k.as_bytes()));
    }
}

#[test]
fn invalid_records_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 8 << 20, 0)).unwrap();
    let mut rec = build_record(geo(), b"key", b"payload");
    rec[10] ^= 1;
    assert!(matches!(s.put(s.pool().copy_of(&rec)), Err(StoreError::BadRecord(_))));
    let rec = build_record(geo(), b"key", &vec![1u8; 9 << 20]);
    assert!(matches!(s.put(s.pool().copy_of(&rec)), Err(StoreError::TooLarge(_))));
    assert_eq!(s.stats().objects, 0);
}

#[test]
fn a_put_after_a_disk_eviction_replaces_the_memory_copy() {
    // The disk holds 10 pages, memory all of them: k0 leaves the disk but
    // stays in memory; stored again with another geometry and payload, the
    // new page is what get and exist see, in agreement.
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 120 << 10, 1 << 20)).unwrap();
    for i in 0..13 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    assert!(s.stats().evictions >= 3);
    let mut other = geo();
    other.model_hash = 43;
    let fresh: Vec<u8> = vec![7u8; 9_000];
    let rec = build_record(other, b"k0", &fresh);
    assert_eq!(s.put(s.pool().copy_of(&rec)).unwrap(), PutOutcome::Stored, "k0 had left the disk");
    match s.get(b"k0", Some(&other)) {
        GetOutcome::Hit(b) => assert_eq!(&b.as_slice()[64 + 2..], &fresh[..], "the new page, not the old copy"),
        _ => panic!("the page just stored is not served"),
    }
    assert_eq!(s.exist(b"k0", Some(&other)), Presence::Present);
    assert!(matches!(s.get(b"k0", Some(&geo())), GetOutcome::Mismatch));
}

#[test]
fn a_delete_leaves_nothing_behind_in_memory() {
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 2), 1 << 20, 1 << 20)).unwrap();
    put(&s, "gone", 5_000).unwrap();
    assert!(get(&s, "gone").is_some());
    // Racing readers: each get during and after the delete is the page or
    // a miss, and once the delete returned, only misses.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                sc.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(p) = get(&s, "gone") {
                            assert_eq!(p, payload("gone", 5_000));
                        }
                    }
                })
            })
            .collect();
        assert!(s.delete(b"gone"));
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
    });
    assert!(get(&s, "gone").is_none(), "a deleted page came back");
    assert_eq!(s.exist(b"gone", Some(&geo())), Presence::Absent);
}

#[test]
fn eviction_is_lru_under_the_byte_cap() {
    let t = tempfile::tempdir().unwrap();
    // Each 12000-byte payload takes a 12 KiB extent: 10 fit in 120 KiB.
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 120 << 10, 0)).unwrap();
    for i in 0..10 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    // Touch k0 so that k1 is now the least recently used.
    assert!(get(&s, "k0").is_some());
    for i in 10..13 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
        let st = s.stats();
        assert!(st.used_bytes <= st.capacity_bytes, "cap held: {st:?}");
    }
    assert!(get(&s, "k0").is_some(), "recently read survives");
    for gone in ["k1", "k2", "k3"] {
        assert!(get(&s, gone).is_none(), "{gone} should be evicted first");
    }
    for kept in 4..13 {
        assert!(get(&s, &format!("k{kept}")).is_some());
    }
    assert_eq!(s.stats().evictions, 3);
}

#[test]
fn a_read_served_from_memory_keeps_its_page_on_disk_as_recent() {
    // 5 pages of 12 KiB fit on the disk and in the memory tier. k0 is the
    // oldest on disk; read from memory it becomes the most recent there
    // too, so the next puts evict k1 and k2 (true LRU order), not k0.
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 60 << 10, 60 << 10)).unwrap();
    for i in 0..5 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    let disk_hits = s.stats().disk_hits;
    assert!(get(&s, "k0").is_some());
    assert_eq!(s.stats().disk_hits, disk_hits, "k0 was served from memory");
    for i in 5..7 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    assert_eq!(s.stats().evictions, 2);
    for gone in ["k1", "k2"] {
        assert!(get(&s, gone).is_none(), "{gone} was the least recently used");
    }
    for kept in ["k0", "k3", "k4", "k5", "k6"] {
        assert!(get(&s, kept).is_some(), "{kept} is among the 5 most recent");
    }
}

#[test]
fn one_page_read_from_memory_over_and_over_leaves_room_for_the_others_reads() {
    // k0 is read from memory more times than a disk's touch log holds
    // keys; k1 once after it. Both are still recent on disk: the next two
    // puts evict k2 and k3.
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 60 << 10, 60 << 10)).unwrap();
    for i in 0..5 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    for _ in 0..kv_server::store::disk::MAX_TOUCHED + 10 {
        assert!(matches!(s.get(b"k0", None), GetOutcome::Hit(_)));
    }
    assert!(get(&s, "k1").is_some());
    for i in 5..7 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
    }
    for gone in ["k2", "k3"] {
        assert!(get(&s, gone).is_none(), "{gone} was the least recently used");
    }
    for kept in ["k0", "k1", "k4", "k5", "k6"] {
        assert!(get(&s, kept).is_some(), "{kept} is among the 5 most recent");
    }
}

#[test]
fn readers_during_eviction_get_whole_records() {
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 2 << 20, 0)).unwrap();
    let len = 60_000;
    // Writers cycle far more bytes than the cap while readers read hot and
    // just-evicted keys; every hit must be the exact page.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bad = Arc::new(Mutex::new(Vec::new()));
    let start = Arc::new(Barrier::new(4));
    let mut hs = Vec::new();
    for r in 0..3 {
        let (s, stop, bad, start) = (s.clone(), stop.clone(), bad.clone(), start.clone());
        hs.push(std::thread::spawn(move || {
            start.wait();
            let mut hits = 0;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let k = format!("k{}", (i * 7 + r) % 400);
                if let Some(p) = get(&s, &k) {
                    hits += 1;
                    if p != payload(&k, len) {
                        bad.lock().unwrap().push(k);
                    }
                }
            }
            hits
        }));
    }
    start.wait();
    for i in 0..400 {
        put(&s, &format!("k{i}"), len).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let hits: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(bad.lock().unwrap().is_empty(), "torn reads: {:?}", bad.lock().unwrap());
    let st = s.stats();
    assert!(st.evictions > 300, "the test must evict under readers: {st:?}");
    assert!(st.used_bytes <= st.capacity_bytes);
    assert!(hits > 0);
}

#[test]
fn clean_restart_recovers_index_and_recency() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    {
        let (s, _) = Store::open(&cfg(&d, 200 << 10, 0)).unwrap();
        for i in 0..10 {
            put(&s, &format!("k{i}"), 12_000).unwrap();
        }
        assert!(get(&s, "k0").is_some());
        s.close().unwrap();
    }
    let (s, reports) = Store::open(&cfg(&d, 200 << 10, 0)).unwrap();
    assert!(reports.iter().all(|r| r.clean));
    assert_eq!(reports.iter().map(|r| r.records).sum::<u64>(), 10);
    // Recency survived: fill k0's disk until it evicts once. The victim is
    // the oldest key written on that disk, never k0 (read last before stop).
    let disk = s.owner(b"k0").unwrap();
    let oldest = (1..10).map(|i| format!("k{i}")).find(|k| s.owner(k.as_bytes()) == Some(disk));
    let mut n = 0;
    while s.stats().disks[disk].evictions == 0 {
        put(&s, &format!("fill{n}"), 12_000).unwrap();
        n += 1;
    }
    assert_eq!(s.exist(b"k0", None), Presence::Present, "most recently read record survives");
    if let Some(oldest) = oldest {
        assert_eq!(s.exist(oldest.as_bytes(), None), Presence::Absent, "{oldest} was the LRU");
    }
    for i in 0..10 {
        let k = format!("k{i}");
        if let Some(p) = get(&s, &k) {
            assert_eq!(p, payload(&k, 12_000));
        }
    }
}

fn corrupt_at(dir: &Path, off: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(dir.join("data.kvc")).unwrap();
    f.write_all_at(bytes, off).unwrap();
}

#[test]
fn a_record_damaged_after_a_clean_stop_is_dropped_at_its_first_read() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    let c = cfg(&d, 4 << 20, 0);
    let off;
    {
        let (s, _) = Store::open(&c).unwrap();
        put(&s, "rot", 50_000).unwrap();
        put(&s, "fine", 50_000).unwrap();
        off = s.disks()[0].locate(b"rot").unwrap().0;
        s.close().unwrap();
    }
    // Bit rot in the payload while the node was down: the clean marker
    // says every record was whole, the header and key still match.
    corrupt_at(&d[0], off + 30_000, b"rot!");
    let (s, reports) = Store::open(&c).unwrap();
    assert!(reports[0].clean);
    assert_eq!(s.exist(b"rot", Some(&geo())), Presence::Present, "the index alone cannot know");
    assert!(get(&s, "rot").is_none(), "a damaged record is never served");
    assert_eq!(s.exist(b"rot", Some(&geo())), Presence::Absent, "get and exist agree it is gone");
    assert_eq!(s.stats().corrupt_dropped, 1);
    assert_eq!(get(&s, "fine").unwrap(), payload("fine", 50_000));
}

#[test]
fn crash_recovery_serves_no_damaged_record() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    let c = cfg(&d, 4 << 20, 0);
    let (victim_trunc, victim_header, victim_payload);
    {
        let (s, _) = Store::open(&c).unwrap();
        for i in 0..20 {
            put(&s, &format!("k{i}"), 50_000).unwrap();
        }
        let disk = s.disks()[0].clone();
        // The record at the highest offset gets cut short by a truncation.
        let mut locs: Vec<(u64, u64, String)> = (0..20)
            .map(|i| format!("k{i}"))
            .map(|k| {
                let (o, l) = disk.locate(k.as_bytes()).unwrap();
                (o, l, k)
            })
            .collect();
        locs.sort();
        victim_trunc = locs[19].clone();
        victim_header = locs[3].clone();
        victim_payload = locs[7].clone();
        // Simulated crash: no close(); the store is simply dropped.
    }
    let dir = &d[0];
    let f = std::fs::OpenOptions::new().write(true).open(dir.join("data.kvc")).unwrap();
    f.set_len(victim_trunc.0 + 30_000).unwrap();
    corrupt_at(dir, victim_header.0 + 20, &[0xEE]);
    corrupt_at(dir, victim_payload.0 + 40_000, b"garbage!");
    std::fs::write(dir.join("index.log.tmp"), b"half-written checkpoint").unwrap();
    std::fs::write(dir.join("stray.tmp"), b"x").unwrap();

    let (s, reports) = Store::open(&c).unwrap();
    let r = &reports[0];
    assert!(!r.clean);
    assert_eq!(r.stray_temp_files, 2);
    assert_eq!(r.reclaimed, 1, "the truncated record is reclaimed at open: {r:?}");
    assert!(!dir.join("stray.tmp").exists());
    for (_, _, k) in [&victim_trunc, &victim_header, &victim_payload] {
        assert!(get(&s, k).is_none(), "damaged {k} must not be served");
    }
    // The rest is intact; a scrub checks every unverified record.
    s.scrub(u64::MAX);
    assert_eq!(s.stats().unverified, 0);
    let mut served = 0;
    for i in 0..20 {
        let k = format!("k{i}");
        if let Some(p) = get(&s, &k) {
            assert_eq!(p, payload(&k, 50_000));
            served += 1;
        }
    }
    assert_eq!(served, 17);
    assert_eq!(s.stats().objects, 17, "damaged records are gone from the index");
    assert_eq!(s.stats().corrupt_dropped, 2);
}

#[test]
fn torn_journal_tail_keeps_earlier_records() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    let c = cfg(&d, 4 << 20, 0);
    {
        let (s, _) = Store::open(&c).unwrap();
        for i in 0..5 {
            put(&s, &format!("k{i}"), 5_000).unwrap();
        }
    }
    let j = d[0].join("index.log");
    let len = std::fs::metadata(&j).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&j).unwrap().set_len(len - 7).unwrap();
    let (s, reports) = Store::open(&c).unwrap();
    assert!(reports[0].torn_journal_bytes > 0);
    for i in 0..4 {
        assert!(get(&s, &format!("k{i}")).is_some());
    }
    assert!(get(&s, "k4").is_none());
    // The store keeps appending to the cut journal; a second crash keeps it all.
    put(&s, "after", 5_000).unwrap();
    drop(s);
    let (s, reports) = Store::open(&c).unwrap();
    assert_eq!(reports[0].torn_journal_bytes, 0, "the torn tail was cut, not appended after");
    for i in 0..4 {
        assert!(get(&s, &format!("k{i}")).is_some());
    }
    assert!(get(&s, "after").is_some());
}

type Switches = Arc<Mutex<Vec<(PathBuf, Arc<AtomicI32>)>>>;

fn open_faulty(c: &StoreConfig) -> (Arc<Store>, Switches) {
    let switches: Switches = Arc::new(Mutex::new(Vec::new()));
    let sw = switches.clone();
    let make = move |p: &Path, sync: bool| -> std::io::Result<Box<dyn kv_server::store::Device>> {
        let (dev, switch) = FaultyDevice::wrap(Box::new(FileDevice::open(p, sync)?));
        sw.lock().unwrap().push((p.parent().unwrap().to_path_buf(), switch));
        Ok(Box::new(dev) as Box<dyn kv_server::store::Device>)
    };
    let (s, _) = Store::open_with(c, &make).unwrap();
    (s, switches)
}

fn switch_of(sw: &Switches, dir: &Path) -> Arc<AtomicI32> {
    sw.lock().unwrap().iter().find(|(d, _)| d == dir).unwrap().1.clone()
}

#[test]
fn a_failed_disk_leaves_the_others_serving() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 3);
    let (s, switches) = open_faulty(&cfg(&d, 16 << 20, 0));
    for i in 0..60 {
        put(&s, &format!("k{i}"), 4_000).unwrap();
    }
    let on_disk1: Vec<String> = (0..60).map(|i| format!("k{i}")).filter(|k| s.owner(k.as_bytes()) == Some(1)).collect();
    assert!(!on_disk1.is_empty());
    // disk1's device starts returning EIO: the first read takes it out.
    switch_of(&switches, &d[1]).store(libc::EIO, Ordering::Relaxed);
    assert!(get(&s, &on_disk1[0]).is_none(), "a failed read is a clean miss");
    let st = s.stats();
    assert_eq!(st.failed_disks, 1, "{st:?}");
    assert!(st.disks[1].failed && st.disks[1].failure.as_deref().unwrap().contains("data read"));
    // Other disks' records are still served; new puts go to healthy disks.
    for i in 0..60 {
        let k = format!("k{i}");
        if !on_disk1.contains(&k) {
            assert!(get(&s, &k).is_some(), "{k} on a healthy disk");
        }
    }
    for i in 0..30 {
        let k = format!("new{i}");
        assert_eq!(put(&s, &k, 4_000).unwrap(), PutOutcome::Stored);
        assert_ne!(s.owner(k.as_bytes()), Some(1));
        assert!(get(&s, &k).is_some());
    }
}

#[test]
fn a_full_device_rejects_without_failing() {
    let t = tempfile::tempdir().unwrap();
    let (s, switches) = open_faulty(&cfg(&dirs(&t, 1), 16 << 20, 0));
    put(&s, "before", 4_000).unwrap();
    let sw = switch_of(&switches, &dirs(&t, 1)[0]);
    sw.store(libc::ENOSPC, Ordering::Relaxed);
    assert!(matches!(put(&s, "during", 4_000), Err(StoreError::Full(_))));
    sw.store(0, Ordering::Relaxed);
    let st = s.stats();
    assert_eq!(st.failed_disks, 0);
    assert_eq!(st.put_rejected, 1);
    assert_eq!(st.objects, 1);
    assert_eq!(put(&s, "after", 4_000).unwrap(), PutOutcome::Stored);
    assert!(get(&s, "before").is_some() && get(&s, "after").is_some());
}

#[test]
fn a_vanished_dir_fails_its_disk() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    let (s, _) = Store::open(&cfg(&d, 16 << 20, 0)).unwrap();
    std::fs::remove_file(d[0].join("KVCELLAR_DISK")).unwrap();
    s.maintain();
    let st = s.stats();
    assert!(st.disks[0].failed && !st.disks[1].failed);
    for i in 0..10 {
        let k = format!("k{i}");
        put(&s, &k, 1000).unwrap();
        assert_eq!(s.owner(k.as_bytes()), Some(1));
    }
}

#[test]
fn memory_tier_is_bounded_and_serves() {
    let t = tempfile::tempdir().unwrap();
    // 5 buffers of 12 KiB fit in 60 KiB of memory tier.
    let (s, _) = Store::open(&cfg(&dirs(&t, 1), 16 << 20, 60 << 10)).unwrap();
    for i in 0..8 {
        put(&s, &format!("k{i}"), 12_000).unwrap();
        assert!(s.stats().mem_used_bytes <= 60 << 10);
    }
    assert_eq!(s.stats().mem_used_bytes, 60 << 10);
    let before = s.stats().mem_hits;
    assert!(get(&s, "k7").is_some());
    assert_eq!(s.stats().mem_hits, before + 1);
}

#[test]
fn a_put_the_disk_rejects_never_enters_the_memory_tier() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    let (s, switches) = open_faulty(&cfg(&d, 16 << 20, 1 << 20));
    let sw = switch_of(&switches, &d[0]);
    sw.store(libc::ENOSPC, Ordering::Relaxed);
    assert!(matches!(put(&s, "refused", 4_000), Err(StoreError::Full(_))));
    sw.store(0, Ordering::Relaxed);
    assert_eq!(s.stats().mem_used_bytes, 0);
    assert!(get(&s, "refused").is_none(), "not served from memory either");
    assert_eq!(s.exist(b"refused", None), Presence::Absent);
}

#[test]
fn a_second_server_on_the_same_dir_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let c = cfg(&dirs(&t, 1), 1 << 20, 0);
    let (_s, _) = Store::open(&c).unwrap();
    let err = Store::open(&c).err().unwrap();
    assert!(err.contains("in use by another kv-server"), "{err}");
}

#[test]
fn checkpoints_during_puts_and_evictions_lose_nothing_across_a_crash() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    // 600 KiB: about 100 records of ~6 KiB fit; 800 are written, so extents
    // are evicted and reused while checkpoints copy and install the journal.
    let c = cfg(&d, 600 << 10, 0);
    let s = {
        let (s, _) = Store::open(&c).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let checkpointer = {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    s.disks()[0].checkpoint().unwrap();
                    n += 1;
                }
                n
            })
        };
        let writers: Vec<_> = (0..2)
            .map(|w| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..400 {
                        let k = format!("w{w}-{i}");
                        put(&s, &k, 5_000 + i).unwrap();
                        if i % 40 == 0 {
                            s.delete(format!("w{w}-{}", i / 2).as_bytes());
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(checkpointer.join().unwrap() > 1, "checkpoints ran during the puts");
        assert!(s.stats().evictions > 500);
        s
    };
    // What the index held at the crash is exactly what must come back.
    let before: Vec<String> = (0..2)
        .flat_map(|w| (0..400).map(move |i| format!("w{w}-{i}")))
        .filter(|k| s.exist(k.as_bytes(), None) == Presence::Present)
        .collect();
    drop(s); // a crash: no close()
    let (s, reports) = Store::open(&c).unwrap();
    assert!(!reports[0].clean);
    assert_eq!(reports[0].reclaimed, 0);
    assert_eq!(s.stats().objects as usize, before.len());
    for k in &before {
        let len = 5_000 + k.rsplit('-').next().unwrap().parse::<usize>().unwrap();
        assert_eq!(get(&s, k).as_deref(), Some(&payload(k, len)[..]), "{k}");
    }
    let st = s.stats();
    assert!(st.used_bytes <= st.capacity_bytes);
}

#[test]
fn a_failing_journal_fails_the_disk_without_hanging() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    let (s, _) = Store::open(&cfg(&d, 64 << 10, 0)).unwrap();
    for i in 0..40 {
        put(&s, &format!("k{i}"), 6_000).unwrap();
    }
    // Journal appends on disk0 fail from now on (the device is full, say).
    s.disks()[0].inject_journal_errno(libc::ENOSPC);
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        // These evict on disk0, whose DEL append fails mid-put.
        for i in 40..80 {
            let _ = put(&s2, &format!("k{i}"), 6_000);
            let _ = s2.exist(b"k1", None);
            let _ = s2.delete(format!("k{}", i - 40).as_bytes());
        }
        tx.send(s2.stats()).unwrap();
    });
    let st = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("no deadlock");
    assert!(st.disks[0].failed, "{st:?}");
    assert!(st.disks[0].failure.as_deref().unwrap().contains("index journal"));
    assert!(!st.disks[1].failed);
    // The node still serves and stores through its other disk.
    for i in 100..110 {
        assert_eq!(put(&s, &format!("k{i}"), 6_000).unwrap(), PutOutcome::Stored);
        assert!(get(&s, &format!("k{i}")).is_some());
    }
    s.maintain();
    assert_eq!(s.stats().disks[0].objects, 0);
}

/// A failed disk closes its files; once its directory holds the marker
/// again, it is taken back with the records it held, minus those deleted or
/// stored elsewhere while it was out.
#[test]
fn a_failed_disk_closes_its_files_and_is_taken_back_while_running() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    let (s, _) = Store::open(&cfg(&d, 64 << 20, 0)).unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for k in &keys {
        put(&s, k, 6_000).unwrap();
    }
    let on0: Vec<&String> = keys.iter().filter(|k| s.owner(k.as_bytes()) == Some(0)).collect();
    assert!(on0.len() > 5);
    s.disks()[0].inject_journal_errno(libc::EIO);
    // A delete fails the disk (its DEL cannot be journalled).
    s.delete(on0[0].as_bytes());
    assert!(s.stats().disks[0].failed);
    s.maintain();
    assert_eq!(s.disks().len(), 1, "the failed disk left the store's disks in service");
    assert!(s.stats().disks[0].failed);
    // Its lock file is free: another opener could take the directory.
    let lockf = std::fs::OpenOptions::new().write(true).open(d[0].join("lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lockf), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0, "the failed disk's files are closed");
    // SAFETY: as above.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lockf), libc::LOCK_UN) };
    drop(lockf);
    // While it is out: one of its keys deleted, one stored anew elsewhere.
    assert!(!s.delete(on0[1].as_bytes()), "held only by the disk out of service");
    assert_eq!(put(&s, on0[2], 7_000).unwrap(), PutOutcome::Stored);
    // Its filesystem never went away (a bad sector, say): not tried again
    // before its back-off, so a failing disk does not flap.
    assert_eq!(s.revive_disks(), 0);
    assert!(s.stats().disks[0].failed);
    // Without its marker (nothing mounted there) it stays out.
    let marker = d[0].join("KVCELLAR_DISK");
    std::fs::rename(&marker, d[0].join("marker.away")).unwrap();
    assert_eq!(s.revive_disks(), 0);
    std::fs::rename(d[0].join("marker.away"), &marker).unwrap();
    assert_eq!(s.revive_disks(), 1);
    let st = s.stats();
    assert!(!st.disks[0].failed && st.failed_disks == 0, "{st:?}");
    for k in &on0[3..] {
        assert_eq!(get(&s, k).unwrap(), payload(k, 6_000), "{k} served again from the disk taken back");
    }
    assert!(get(&s, on0[0]).is_none() && get(&s, on0[1]).is_none(), "deleted keys stay deleted");
    assert_eq!(get(&s, on0[2]).unwrap(), payload(on0[2], 7_000), "the newer copy wins");
    // New puts are placed on it again.
    let placed = (100..200).filter(|i| s.owner(format!("k{i}").as_bytes()) == Some(0)).count();
    assert!(placed > 10);
}

/// A revival's scan of a disk's keys holds no lock deletes need: a delete
/// arriving mid-scan returns at once (before, it waited for the whole scan
/// while holding one of the node's I/O slots, so a scan of a large disk and
/// a burst of deletes stalled every get and put), and the key it deleted
/// stays deleted on the disk taken back.
#[test]
fn deletes_run_during_a_revival_scan_and_stay_deleted() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    let (s, _) = Store::open(&cfg(&d, 64 << 20, 0)).unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    for k in &keys {
        put(&s, k, 6_000).unwrap();
    }
    let on0: Vec<String> = keys.iter().filter(|k| s.owner(k.as_bytes()) == Some(0)).cloned().collect();
    assert!(on0.len() > 5);
    s.disks()[0].inject_journal_errno(libc::EIO);
    s.delete(on0[0].as_bytes());
    s.maintain();
    assert!(s.stats().disks[0].failed);
    // Mid-scan, another thread deletes a key the revived disk holds.
    let weak = Arc::downgrade(&s);
    let victim = on0[1].clone();
    let returned = Arc::new(AtomicBool::new(false));
    let seen = returned.clone();
    s.on_revival_scan(Box::new(move || {
        let (weak, victim) = (weak.clone(), victim.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            if let Some(s) = weak.upgrade() {
                s.delete(victim.as_bytes());
            }
            let _ = tx.send(());
        });
        seen.store(rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok(), Ordering::SeqCst);
    }));
    let marker = d[0].join("KVCELLAR_DISK");
    std::fs::rename(&marker, d[0].join("marker.away")).unwrap();
    assert_eq!(s.revive_disks(), 0);
    std::fs::rename(d[0].join("marker.away"), &marker).unwrap();
    assert_eq!(s.revive_disks(), 1);
    assert!(returned.load(Ordering::SeqCst), "a delete during the scan returned at once");
    assert!(get(&s, &on0[1]).is_none(), "the key deleted mid-scan stays deleted");
    assert!(get(&s, &on0[0]).is_none(), "the key deleted while out stays deleted");
    for k in &on0[2..] {
        assert_eq!(get(&s, k).unwrap(), payload(k, 6_000), "{k} served again");
    }
}

/// Four writer threads put pages of 4-196 KiB under `prefix` until at
/// least 300 are acknowledged (or 30 s), then `cut` runs with puts in
/// flight and the writers stop at their first failure. Returns the pages
/// acknowledged and every page tried, as (key, payload length).
#[allow(clippy::type_complexity)]
fn storm_until_cut(s: &Store, prefix: &str, cut: impl Fn()) -> (Vec<(String, usize)>, Vec<(String, usize)>) {
    let acked: Mutex<Vec<(String, usize)>> = Mutex::default();
    let tried: Mutex<Vec<(String, usize)>> = Mutex::default();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        for th in 0..4 {
            let (acked, tried, stop) = (&acked, &tried, &stop);
            sc.spawn(move || {
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("{prefix}-{th}-{i}");
                    let len = 4096 + (i * 7919 + th * 104_729) % (192 << 10);
                    tried.lock().unwrap().push((key.clone(), len));
                    match put(s, &key, len) {
                        Ok(PutOutcome::Stored) => acked.lock().unwrap().push((key, len)),
                        Ok(PutOutcome::Duplicate) => panic!("{key} is new"),
                        Err(_) => break, // the power is off
                    }
                }
            });
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while acked.lock().unwrap().len() < 300 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        cut();
        stop.store(true, Ordering::SeqCst);
    });
    (acked.into_inner().unwrap(), tried.into_inner().unwrap())
}

/// Power loss (docs/RELIABILITY.md): through the Device seam, every write no
/// flush covered becomes garbage and the journal loses what it had not
/// flushed. Every put acknowledged before the cut must come back whole
/// (data and journal entry were both on media before the answer); a put in
/// flight is served whole or missed, never torn.
#[test]
fn after_a_power_loss_every_acknowledged_put_is_served_whole() {
    use kv_server::store::device::{PowerCut, PowerLossDevice};
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("d0");
    let mut c = cfg(std::slice::from_ref(&d), 512 << 20, 0);
    c.sync_writes = true;
    let cuts: Arc<Mutex<Vec<PowerCut>>> = Arc::default();
    let k = cuts.clone();
    let make = move |p: &Path, _sync: bool| -> std::io::Result<Box<dyn kv_server::store::Device>> {
        let (dev, cut) = PowerLossDevice::open(p)?;
        k.lock().unwrap().push(cut);
        Ok(Box::new(dev) as Box<dyn kv_server::store::Device>)
    };
    let (s, _) = Store::open_with(&c, &make).unwrap();
    let journal = d.join(kv_server::store::journal::JOURNAL_FILE);
    let baseline = std::fs::metadata(&journal).unwrap().len();
    // Cut with puts in flight on every thread.
    let (acked, tried) = storm_until_cut(&s, "pl", || cuts.lock().unwrap()[0].cut());
    drop(s); // no close(): the power is off
    let (garbled, journal_lost) =
        cuts.lock().unwrap()[0].apply(&d.join(kv_server::store::disk::DATA_FILE), &journal, baseline).unwrap();
    let c2 = cfg(std::slice::from_ref(&d), 512 << 20, 0);
    let (s2, _) = Store::open(&c2).unwrap();
    for (key, len) in &acked {
        assert_eq!(get(&s2, key).as_deref(), Some(&payload(key, *len)[..]), "acknowledged {key} lost or wrong");
    }
    let mut in_flight_served = 0;
    for (key, len) in tried.iter().filter(|k| !acked.contains(k)) {
        if let Some(p) = get(&s2, key) {
            assert_eq!(p, payload(key, *len), "{key}: a page in flight at the cut came back wrong");
            in_flight_served += 1;
        }
    }
    println!(
        "power loss: {} acknowledged (all served), {} in flight ({in_flight_served} served whole, the rest missed), \
         {garbled} unflushed writes garbled, {journal_lost} journal bytes lost",
        acked.len(),
        tried.len() - acked.len()
    );
}

/// A marker file left empty (or cut short) by a power loss right after a
/// disk was first opened is rewritten, not taken for a foreign format (found
/// by the fault suite: a loop-mounted disk shut down with xfs_io came back
/// with an empty marker, and the node refused to start).
#[test]
fn a_marker_cut_short_by_a_crash_is_rewritten() {
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 1);
    let c = cfg(&d, 64 << 20, 0);
    {
        let (s, _) = Store::open(&c).unwrap();
        put(&s, "kept", 5000).unwrap();
        s.close().unwrap();
    }
    for cut in ["", "kvcellar disk"] {
        std::fs::write(d[0].join("KVCELLAR_DISK"), cut).unwrap();
        let (s, _) = Store::open(&c).unwrap();
        assert_eq!(get(&s, "kept").as_deref(), Some(&payload("kept", 5000)[..]), "marker {cut:?}");
        s.close().unwrap();
        assert_eq!(std::fs::read_to_string(d[0].join("KVCELLAR_DISK")).unwrap(), "kvcellar disk format 1\n");
    }
    std::fs::write(d[0].join("KVCELLAR_DISK"), "kvcellar disk format 9\n").unwrap();
    assert!(Store::open(&c).err().unwrap().contains("unknown kvcellar disk format"));
}

/// A store over `ds` (256 MiB disks, a 64 MiB memory tier, flushes on)
/// acknowledging puts from memory up to `max` unflushed bytes; no flusher
/// started.
fn memory_acked_store(ds: &[PathBuf], max: u64) -> Arc<Store> {
    let mut c = cfg(ds, 256 << 20, 64 << 20);
    c.sync_writes = true;
    c.ack_memory_max = Some(max);
    Store::open(&c).unwrap().0
}

/// Waits (up to 30 s) until the flushers hold nothing.
fn wait_flushed(s: &Store) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while s.stats().unflushed_bytes > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `ack = "memory"`: a put is answered once held in memory, served at once
/// (get, exist, size) before its flush, written to its disk by a flusher,
/// and on its disk after a clean close; a delete of a page not yet flushed
/// stays deleted; past the bound a put is written before its answer.
#[test]
fn memory_acks_serve_at_once_flush_behind_and_keep_deletes() {
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 2);
    let s = memory_acked_store(&ds, 1 << 20);
    // No flusher yet: everything stays held, so the bound is reached.
    let mut stored = Vec::new();
    for i in 0..40 {
        let key = format!("m-{i}");
        assert_eq!(put(&s, &key, 60 << 10).unwrap(), PutOutcome::Stored);
        assert_eq!(get(&s, &key).as_deref(), Some(&payload(&key, 60 << 10)[..]), "{key} served at once");
        assert_eq!(s.exist(key.as_bytes(), Some(&geo())), Presence::Present);
        stored.push(key);
    }
    assert_eq!(put(&s, "m-3", 60 << 10).unwrap(), PutOutcome::Duplicate, "held keys are write-once too");
    let st = s.stats();
    assert!(st.ack_memory);
    assert!(st.unflushed_bytes > 0 && st.unflushed_bytes <= 1 << 20, "bounded: {}", st.unflushed_bytes);
    assert!(st.ack_fallbacks > 0, "past the bound puts are written before their answer");
    assert_eq!(st.acked_in_memory + st.ack_fallbacks, 40);
    // A delete of a page held and not yet flushed.
    assert!(s.delete(b"m-0"));
    assert!(get(&s, "m-0").is_none());
    Store::start_flushers(&s, 2).unwrap();
    wait_flushed(&s);
    let st = s.stats();
    assert_eq!(st.unflushed_bytes, 0, "flushed");
    assert_eq!(st.flushed, st.acked_in_memory - 1, "every held page but the deleted one written");
    assert_eq!(st.flush_failed, 0);
    s.close().unwrap();
    drop(s);
    // On its disk: a fresh store without a memory tier serves every page.
    let (s2, _) = Store::open(&cfg(&ds, 256 << 20, 0)).unwrap();
    for key in &stored[1..] {
        assert_eq!(get(&s2, key).as_deref(), Some(&payload(key, 60 << 10)[..]), "{key} on its disk");
    }
    assert!(get(&s2, "m-0").is_none(), "a delete before the flush stays deleted");
    match Store::open(&StoreConfig { ack_memory_max: Some(1 << 20), ..cfg(&ds, 256 << 20, 0) }) {
        Err(e) => assert!(e.contains("memory tier"), "{e}"),
        Ok(_) => panic!("memory acks without a memory tier must be refused"),
    }
}

/// `ack = "memory"`: the flushers write their batches a disk at a time; a
/// disk whose journal fails under a batch is taken out, and that batch's
/// records of it are placed again on the disks left, so every page
/// acknowledged from memory is still served, none lost to the failure.
#[test]
fn a_flush_batch_on_a_failing_disk_is_placed_again_on_the_others() {
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 2);
    let s = memory_acked_store(&ds, 32 << 20);
    let keys: Vec<String> = (0..60).map(|i| format!("f-{i}")).collect();
    for key in &keys {
        assert_eq!(put(&s, key, 20 << 10).unwrap(), PutOutcome::Stored);
    }
    assert!(keys.iter().filter(|k| s.owner(k.as_bytes()) == Some(0)).count() > 5, "disk0 owns some");
    assert_eq!(s.stats().acked_in_memory, 60, "all held: no flusher yet");
    s.disks()[0].inject_journal_errno(libc::EIO);
    Store::start_flushers(&s, 2).unwrap();
    wait_flushed(&s);
    let st = s.stats();
    assert_eq!(st.unflushed_bytes, 0, "flushed");
    assert!(st.disks[0].failed, "the failing disk is out");
    assert_eq!((st.flushed, st.flush_failed), (60, 0), "every page written, on the disk left");
    for key in &keys {
        assert_eq!(s.owner(key.as_bytes()), Some(1), "{key} placed on the disk left");
        assert_eq!(get(&s, key).as_deref(), Some(&payload(key, 20 << 10)[..]), "{key} served");
    }
    s.close().unwrap();
    drop(s);
    // On media: a fresh store without a memory tier serves every page.
    let (s2, _) = Store::open(&cfg(&ds, 256 << 20, 0)).unwrap();
    for key in &keys {
        assert_eq!(get(&s2, key).as_deref(), Some(&payload(key, 20 << 10)[..]), "{key} on a disk");
    }
}

/// A device that counts the vectored writes it is given (and their
/// buffers), over the real file device.
struct CountingDevice {
    inner: FileDevice,
    runs: Arc<Mutex<Vec<usize>>>,
}

impl kv_server::store::Device for CountingDevice {
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn file_len(&self) -> std::io::Result<u64> {
        self.inner.file_len()
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn acks_on_media(&self) -> bool {
        self.inner.acks_on_media()
    }
    fn write_deferred(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.inner.write_deferred(buf, off)
    }
    fn write_deferred_vectored(&self, bufs: &[&[u8]], off: u64) -> std::io::Result<()> {
        self.runs.lock().unwrap().push(bufs.len());
        self.inner.write_deferred_vectored(bufs, off)
    }
    fn commit(&self, f: &std::fs::File) -> std::io::Result<()> {
        self.inner.commit(f)
    }
}

/// A flusher's batch for one disk is one run of its data file, written
/// with one vectored write and cut in one extent a record: every record is
/// served after a restart, and a record of the run deleted frees its own
/// extent (its neighbours stay served, and records written after it too).
#[test]
fn a_flush_batch_is_one_write_cut_in_one_extent_a_record() {
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 1);
    let mut c = cfg(&ds, 256 << 20, 64 << 20);
    c.sync_writes = true;
    c.ack_memory_max = Some(32 << 20);
    let runs: Arc<Mutex<Vec<usize>>> = Arc::default();
    let r = runs.clone();
    let make = move |p: &Path, sync: bool| -> std::io::Result<Box<dyn kv_server::store::Device>> {
        Ok(Box::new(CountingDevice { inner: FileDevice::open(p, sync)?, runs: r.clone() }))
    };
    let s = Store::open_with(&c, &make).unwrap().0;
    let keys: Vec<String> = (0..48).map(|i| format!("run-{i}")).collect();
    for key in &keys {
        assert_eq!(put(&s, key, 60 << 10).unwrap(), PutOutcome::Stored);
    }
    assert_eq!(s.stats().acked_in_memory, 48, "all held: no flusher yet");
    Store::start_flushers(&s, 1).unwrap();
    wait_flushed(&s);
    let st = s.stats();
    assert_eq!((st.flushed, st.flush_failed), (48, 0));
    let seen = runs.lock().unwrap().clone();
    assert!(seen.iter().any(|&n| n > 1), "batches written as runs: {seen:?}");
    assert_eq!(seen.iter().sum::<usize>(), 48, "every record written once: {seen:?}");
    // Every other record deleted: each frees its own extent.
    for key in keys.iter().step_by(2) {
        assert!(s.delete(key.as_bytes()));
    }
    s.close().unwrap();
    drop(s);
    let reopen = || {
        let mut c2 = cfg(&ds, 256 << 20, 64 << 20);
        c2.sync_writes = true;
        c2.ack_memory_max = Some(32 << 20);
        Store::open(&c2).unwrap().0
    };
    let s = reopen();
    for (i, key) in keys.iter().enumerate() {
        let want = (i % 2 == 1).then(|| payload(key, 60 << 10));
        assert_eq!(get(&s, key), want, "{key} after the restart");
    }
    // New records after the deletes.
    let used_before = s.stats().disks[0].used_bytes;
    let more: Vec<String> = (0..24).map(|i| format!("hole-{i}")).collect();
    for key in &more {
        assert_eq!(put(&s, key, 60 << 10).unwrap(), PutOutcome::Stored);
    }
    Store::start_flushers(&s, 1).unwrap();
    wait_flushed(&s);
    assert_eq!(s.stats().flush_failed, 0);
    assert!(s.stats().disks[0].used_bytes > used_before);
    s.close().unwrap();
    drop(s);
    let (s, _) = Store::open(&cfg(&ds, 256 << 20, 0)).unwrap();
    for key in keys.iter().skip(1).step_by(2).chain(&more) {
        assert_eq!(get(&s, key).as_deref(), Some(&payload(key, 60 << 10)[..]), "{key} on media");
    }
}

/// Puts acknowledged on media from many threads at once are written
/// together: runs of several records in one vectored write, each put
/// answered only after its run's group commit, every page served after a
/// restart; a key put twice at once is stored once.
#[test]
fn concurrent_media_puts_are_gathered_into_runs() {
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 1);
    let mut c = cfg(&ds, 256 << 20, 0);
    c.sync_writes = true;
    let runs: Arc<Mutex<Vec<usize>>> = Arc::default();
    let r = runs.clone();
    let make = move |p: &Path, sync: bool| -> std::io::Result<Box<dyn kv_server::store::Device>> {
        Ok(Box::new(CountingDevice { inner: FileDevice::open(p, sync)?, runs: r.clone() }))
    };
    let s = Store::open_with(&c, &make).unwrap().0;
    let threads = 8;
    let barrier = Barrier::new(threads);
    let outcomes: Mutex<Vec<PutOutcome>> = Mutex::default();
    std::thread::scope(|sc| {
        for t in 0..threads {
            let (s, barrier, outcomes) = (&s, &barrier, &outcomes);
            sc.spawn(move || {
                barrier.wait();
                for i in 0..40 {
                    // Every thread also puts one shared key.
                    let key = if i == 20 { "same".to_string() } else { format!("g-{t}-{i}") };
                    let o = put(s, &key, 20 << 10).unwrap();
                    outcomes.lock().unwrap().push(o);
                }
            });
        }
    });
    let outcomes = outcomes.into_inner().unwrap();
    assert_eq!(outcomes.iter().filter(|o| **o == PutOutcome::Stored).count(), threads * 39 + 1);
    let seen = runs.lock().unwrap().clone();
    assert!(seen.iter().any(|&n| n > 1), "some puts written as runs: {seen:?}");
    drop(s);
    let (s, _) = Store::open(&cfg(&ds, 256 << 20, 0)).unwrap();
    for t in 0..threads {
        for i in (0..40).filter(|&i| i != 20) {
            let key = format!("g-{t}-{i}");
            assert_eq!(get(&s, &key).as_deref(), Some(&payload(&key, 20 << 10)[..]), "{key}");
        }
    }
    assert_eq!(get(&s, "same").as_deref(), Some(&payload("same", 20 << 10)[..]));
}

/// With `ack = "memory"` a put checked on an async thread never holds it:
/// a small page is settled there, a record past `INLINE_PUT_MAX` (its CRC
/// alone takes milliseconds) is handed back whole for the blocking path,
/// which then stores it.
#[test]
fn memory_acked_puts_are_settled_inline_only_when_small() {
    use kv_server::store::{Held, INLINE_PUT_MAX};
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 1);
    let mut c = cfg(&ds, 256 << 20, 64 << 20);
    c.ack_memory_max = Some(16 << 20);
    let s = Store::open(&c).unwrap().0;
    let small = build_record(geo(), b"inline-small", &payload("inline-small", 64 << 10));
    match s.try_put_held(s.pool().copy_of(&small), 0) {
        Ok(Held::Done(Ok(PutOutcome::Stored))) => {}
        _ => panic!("a small page is acknowledged from memory on the caller's thread"),
    }
    match s.try_put_held(s.pool().copy_of(&small), 0) {
        Ok(Held::Done(Ok(PutOutcome::Duplicate))) => {}
        _ => panic!("a second put of a held key is a duplicate"),
    }
    // Flushers from here on (a close waits for them to write what is held).
    Store::start_flushers(&s, 1).unwrap();
    let large = build_record(geo(), b"inline-large", &payload("inline-large", INLINE_PUT_MAX));
    let back = match s.try_put_held(s.pool().copy_of(&large), 0) {
        Err(rec) => rec,
        Ok(_) => panic!("a record over INLINE_PUT_MAX is not checked on an async thread"),
    };
    assert_eq!(back.as_slice(), &large[..], "handed back whole");
    assert_eq!(s.put(back).unwrap(), PutOutcome::Stored);
    assert_eq!(get(&s, "inline-large").as_deref(), Some(&payload("inline-large", INLINE_PUT_MAX)[..]));
    assert_eq!(get(&s, "inline-small").as_deref(), Some(&payload("inline-small", 64 << 10)[..]));
    s.close().unwrap();
}

/// `ack = "memory"` and a power loss: puts acknowledged and not yet flushed
/// are lost, and then miss; every page served after the restart is whole
/// (never torn, never another page's bytes).
#[test]
fn after_a_power_loss_memory_acks_are_served_whole_or_missed() {
    use kv_server::store::device::{PowerCut, PowerLossDevice};
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("d0");
    let mut c = cfg(std::slice::from_ref(&d), 512 << 20, 64 << 20);
    c.sync_writes = true;
    c.ack_memory_max = Some(8 << 20);
    let cuts: Arc<Mutex<Vec<PowerCut>>> = Arc::default();
    let k = cuts.clone();
    let make = move |p: &Path, _sync: bool| -> std::io::Result<Box<dyn kv_server::store::Device>> {
        let (dev, cut) = PowerLossDevice::open(p)?;
        k.lock().unwrap().push(cut);
        Ok(Box::new(dev) as Box<dyn kv_server::store::Device>)
    };
    let s = Store::open_with(&c, &make).unwrap().0;
    Store::start_flushers(&s, 2).unwrap();
    let journal = d.join(kv_server::store::journal::JOURNAL_FILE);
    let baseline = std::fs::metadata(&journal).unwrap().len();
    let (acked, _) = storm_until_cut(&s, "pm", || cuts.lock().unwrap()[0].cut());
    let unflushed = s.stats().unflushed_bytes;
    drop(s); // no close(): the power is off (the flushers fail and let go)
    cuts.lock().unwrap()[0].apply(&d.join(kv_server::store::disk::DATA_FILE), &journal, baseline).unwrap();
    // A flusher may hold the store for the write it was doing at the cut.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let s2 = loop {
        match Store::open(&cfg(std::slice::from_ref(&d), 512 << 20, 0)) {
            Ok((s2, _)) => break s2,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("reopen: {e}"),
        }
    };
    let mut served = 0;
    for (key, len) in &acked {
        if let Some(p) = get(&s2, key) {
            assert_eq!(p, payload(key, *len), "{key} came back wrong");
            served += 1;
        }
    }
    assert!(served > 0, "flushed pages survive");
    println!(
        "power loss with memory acks: {} acknowledged, {served} served whole, the rest missed ({unflushed} bytes held at the cut)",
        acked.len()
    );
}

/// Prefetch warming: an exist that finds a page only on disk has it read
/// into the memory tier, so the get that follows is served from memory and
/// counted as warmed-then-read; pages in memory are not warmed again.
#[test]
fn an_exist_warms_pages_found_only_on_disk() {
    let t = tempfile::tempdir().unwrap();
    let ds = dirs(&t, 1);
    // A tier of 4 MiB (a warming budget of 512 KiB): of 100 pages of 60
    // KiB, the first ones fall out of it.
    let s = Store::open(&cfg(&ds, 64 << 20, 4 << 20)).unwrap().0;
    Store::start_warmers(&s, 2).unwrap();
    for i in 0..100 {
        assert_eq!(put(&s, &format!("w-{i}"), 60 << 10).unwrap(), PutOutcome::Stored);
    }
    let cold: Vec<String> = (0..4).map(|i| format!("w-{i}")).collect();
    let keys: Vec<&[u8]> = cold.iter().map(|k| k.as_bytes()).collect();
    let found: Vec<Presence> = keys.iter().map(|k| s.exist(k, Some(&geo()))).collect();
    assert!(found.iter().all(|p| *p == Presence::Present));
    let before = s.stats();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while s.stats().warmed < before.warmed + 4 && std::time::Instant::now() < deadline {
        // Handing keys to the warmers never waits: a busy moment drops the
        // batch (a page already warmed is not warmed again), so offer again.
        s.warm(&keys, &found);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(s.stats().warmed, before.warmed + 4, "the 4 cold pages warmed");
    for k in &cold {
        assert_eq!(get(&s, k).as_deref(), Some(&payload(k, 60 << 10)[..]));
    }
    let after = s.stats();
    assert_eq!(after.mem_hits - before.mem_hits, 4, "served from memory");
    assert_eq!(after.warmed_read, 4, "each warmed page read once");
    // Pages in memory are not warmed again.
    s.warm(&keys, &found);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(s.stats().warmed, after.warmed);
}

/// A ring-handoff copy's second tombstone check (docs/ARCHITECTURE.md,
/// "Ring transitions") takes out only the record the copy stored, by its
/// stamp: after the copy was stored, deleted, and the key put again (and
/// acknowledged), the check leaves the new put alone. Driven step by step
/// here, with and without a memory tier, and with puts acknowledged from
/// memory (the normal put then ends in memory; the copy never does).
#[test]
fn a_copys_recheck_removes_only_the_record_it_stored() {
    let t = tempfile::tempdir().unwrap();
    let stores: Vec<(&str, Arc<Store>)> = vec![
        ("media, no memory tier", Store::open(&cfg(&dirs(&t, 2), 64 << 20, 0)).unwrap().0),
        ("media, memory tier", {
            let t2 = t.path().join("tier");
            Store::open(&cfg(&[t2.join("a"), t2.join("b")], 64 << 20, 8 << 20)).unwrap().0
        }),
        ("memory acks", {
            let t3 = t.path().join("behind");
            let s = memory_acked_store(&[t3.join("a"), t3.join("b")], 8 << 20);
            Store::start_flushers(&s, 1).unwrap();
            s
        }),
    ];
    for (what, s) in &stores {
        let copy = build_record(geo(), b"moved", &payload("copy", 6_000));
        let (stored, stamp) = s.put_copy(s.pool().copy_of(&copy), 0).unwrap();
        assert_eq!(stored, PutOutcome::Stored, "{what}");
        let stamp = stamp.expect("a stored copy has a stamp");
        assert_eq!(s.stats().unflushed_bytes, 0, "{what}: a copy is on media when put_copy returns");
        // The delete removes the copy; a normal put of the key follows and
        // is acknowledged.
        assert!(s.delete(b"moved"), "{what}");
        assert_eq!(put(s, "moved", 7_000).unwrap(), PutOutcome::Stored, "{what}");
        // The copy's late re-check: the key's record is not the copy's.
        assert!(!s.delete_if_stamp(b"moved", stamp), "{what}: the acknowledged put was taken for the copy");
        assert_eq!(get(s, "moved").as_deref(), Some(&payload("moved", 7_000)[..]), "{what}");
        wait_flushed(s);
        assert!(!s.delete_if_stamp(b"moved", stamp), "{what}: once flushed too");
        assert_eq!(get(s, "moved").as_deref(), Some(&payload("moved", 7_000)[..]), "{what}");

        // Without a delete in between, the re-check takes the copy out,
        // from the disk and the memory tier, journalled as a delete.
        let copy = build_record(geo(), b"copied", &payload("copied", 5_000));
        let (_, stamp) = s.put_copy(s.pool().copy_of(&copy), 0).unwrap();
        let stamp = stamp.unwrap();
        assert!(get(s, "copied").is_some(), "{what}");
        assert!(s.delete_if_stamp(b"copied", stamp), "{what}");
        assert!(get(s, "copied").is_none(), "{what}: the copy's record is gone");
        assert_eq!(s.exist(b"copied", None), Presence::Absent, "{what}");
        assert!(!s.delete_if_stamp(b"copied", stamp), "{what}: removed once");
        // A copy of a key already stored stores nothing and has no stamp.
        let (dup, none) = s.put_copy(s.pool().copy_of(&build_record(geo(), b"moved", b"x")), 0).unwrap();
        assert_eq!((dup, none), (PutOutcome::Duplicate, None), "{what}");
    }
    // The stamps live in memory only: after a restart the put is still
    // there, and the copy's delete was journalled.
    let (_, s) = stores.into_iter().next().unwrap();
    s.close().unwrap();
    drop(s);
    let (s, _) = Store::open(&cfg(&dirs(&t, 2), 64 << 20, 0)).unwrap();
    assert_eq!(get(&s, "moved").as_deref(), Some(&payload("moved", 7_000)[..]));
    assert!(get(&s, "copied").is_none(), "the copy's removal survives a restart");
}

/// Tenants' namespaces in the store (kv_server::tenant): the same key put by
/// two tenants and the default one is three pages, each read, deleted and
/// recovered after a clean stop and after a crash on its own; a record keeps
/// the client's key, so what is served validates as the client's page; a
/// tenant's key past 1016 bytes is refused.
#[test]
fn tenants_keep_the_same_key_apart_across_restarts() {
    use kv_server::tenant::{ns_key, MAX_TENANT_KEY};
    let t = tempfile::tempdir().unwrap();
    let d = dirs(&t, 2);
    let c = cfg(&d, 8 << 20, 1 << 20);
    let page = |who: &str| payload(who, 20_000);
    let rec = |who: &str| build_record(geo(), b"same-key", &page(who));
    let served = |s: &Store, tenant: u32| match s.get(&ns_key(tenant, b"same-key"), Some(&geo())) {
        GetOutcome::Hit(b) => {
            let (_, k) = kv_common::page::parse_record(b.as_slice()).expect("served record validates");
            assert_eq!(k, b"same-key", "the record holds the client's key");
            Some(b.as_slice()[64 + k.len()..].to_vec())
        }
        _ => None,
    };
    for crash in [false, true] {
        {
            let (s, _) = Store::open(&c).unwrap();
            for (tenant, who) in [(0, "default"), (7, "seven"), (8, "eight")] {
                let out = s.put_in(s.pool().copy_of(&rec(who)), tenant).unwrap();
                assert_eq!(out, PutOutcome::Stored, "tenant {tenant}: not a duplicate of another's");
            }
            assert_eq!(served(&s, 7).unwrap(), page("seven"));
            assert!(s.delete(&ns_key(8, b"same-key")));
            assert_eq!(served(&s, 0).unwrap(), page("default"), "another tenant's delete");
            assert_eq!(s.exist(&ns_key(9, b"same-key"), None), Presence::Absent);
            if crash {
                // No close: no clean marker, as after a crash.
                drop(s);
            } else {
                s.close().unwrap();
            }
        }
        let (s, _) = Store::open(&c).unwrap();
        assert_eq!(served(&s, 0).unwrap(), page("default"), "crash {crash}");
        assert_eq!(served(&s, 7).unwrap(), page("seven"), "crash {crash}");
        assert!(served(&s, 8).is_none(), "crash {crash}: the delete holds");
        assert_eq!(s.stats().objects, 2, "crash {crash}");
        let held = s.tenants();
        assert_eq!(held.get(&0).map(|u| u.objects), Some(1), "crash {crash}: rebuilt from the journal");
        assert_eq!(held.get(&7).map(|u| u.objects), Some(1), "crash {crash}");
        assert_eq!(held.get(&8).map_or(0, |u| u.objects), 0, "crash {crash}");
        assert_eq!(held[&7].bytes, held[&0].bytes, "crash {crash}: the same record size");
        for (tenant, _) in [(0, ()), (7, ())] {
            assert!(s.delete(&ns_key(tenant, b"same-key")));
        }
        s.close().unwrap();
    }
    let (s, _) = Store::open(&c).unwrap();
    let long = vec![b'k'; MAX_TENANT_KEY + 1];
    let r = s.put_in(s.pool().copy_of(&build_record(geo(), &long, b"x")), 7);
    assert!(matches!(r, Err(StoreError::TenantKey(ref m)) if m.contains("at most 1016")), "{r:?}");
    assert_eq!(s.put(s.pool().copy_of(&build_record(geo(), &long, b"x"))).unwrap(), PutOutcome::Stored);
    // A tenant that fills the disks is charged its own evictions.
    for i in 0..40 {
        let k = format!("flood-{i}");
        s.put_in(s.pool().copy_of(&build_record(geo(), k.as_bytes(), &payload(&k, 1 << 20))), 9).unwrap();
    }
    let held = s.tenants();
    assert!(held[&9].evictions > 0, "{held:?}");
    assert_eq!(held.get(&7).map_or(0, |u| u.evictions), 0);
    let total: u64 = held.values().map(|u| u.bytes).sum();
    assert!(total <= 16 << 20 && total == s.stats().used_bytes, "{total} {held:?}");
}

/// Two tenants with half the node each: one floods three times the node
/// while the other reads a fifth of it; the reader keeps every page (and
/// loses them without quotas); the flooder borrows what the other leaves
/// and gives it back to the other's next writes; the memory tier keeps
/// the same rule; a restart rebuilds the same holdings.
#[test]
fn quotas_evict_within_a_tenant_and_lend_what_is_idle() {
    use kv_common::quota::Quotas;
    use kv_server::tenant::ns_key;
    let (a, b) = (kv_common::auth::tenant_id("team-a"), kv_common::auth::tenant_id("team-b"));
    const PAGE: usize = 250_000; // 256 KiB with its header, aligned
    let put_as = |s: &Store, tenant: u32, key: &str| {
        let rec = build_record(geo(), key.as_bytes(), &payload(key, PAGE));
        s.put_in(s.pool().copy_of(&rec), tenant).unwrap()
    };
    let b_keys: Vec<String> = (0..12).map(|i| format!("b-{i}")).collect();
    let b_kept =
        |s: &Store| b_keys.iter().filter(|k| s.exist(&ns_key(b, k.as_bytes()), None) == Presence::Present).count();
    // 2 disks of 8 MiB: B's 12 pages are 3 MiB, a fifth of the node; A
    // writes 192 pages, three times it; B reads its set every 64 of them.
    let flood = |s: &Store| {
        for k in &b_keys {
            assert_eq!(put_as(s, b, k), PutOutcome::Stored);
        }
        for i in 0..192 {
            put_as(s, a, &format!("a-{i}"));
            if i % 64 == 63 {
                for k in &b_keys {
                    let _ = s.get(&ns_key(b, k.as_bytes()), None);
                }
            }
        }
    };
    for quotas in [false, true] {
        let t = tempfile::tempdir().unwrap();
        let c = cfg(&dirs(&t, 2), 8 << 20, 1 << 20);
        let (s, _) = Store::open(&c).unwrap();
        if quotas {
            let w = s.set_quotas(&Quotas::parse_list("team-a=50%,team-b=50%").unwrap());
            assert!(w.is_empty(), "{w:?}");
            assert_eq!(s.quota_bytes()[&a], 8 << 20);
        }
        flood(&s);
        let held = s.tenants();
        if !quotas {
            // One LRU: B's pages lose to a flood of pages newer than their
            // last read.
            assert!(b_kept(&s) < b_keys.len(), "without quotas the flood evicts B: {held:?}");
            continue;
        }
        assert_eq!(b_kept(&s), b_keys.len(), "every one of B's pages is kept: {held:?}");
        assert_eq!(held[&b].evictions, 0, "{held:?}");
        assert!(held[&a].evictions > 100, "A evicts its own: {held:?}");
        assert_eq!(held[&a].evicted_for_others, 0, "{held:?}");
        // A borrows what B leaves: more than its half of the node.
        assert!(held[&a].bytes > 10 << 20, "A uses B's idle share: {held:?}");
        // B writes 8 pages more (5 MiB in all, below its half): they take
        // A's borrowed room back, and B loses nothing.
        for i in 12..20 {
            assert_eq!(put_as(&s, b, &format!("b-{i}")), PutOutcome::Stored);
        }
        let after = s.tenants();
        assert!(after[&a].evicted_for_others >= 8, "{after:?}");
        assert_eq!(after[&b].evictions, 0, "{after:?}");
        assert_eq!(after[&b].objects, 20, "{after:?}");
        assert_eq!(b_kept(&s), b_keys.len());
        // Per-tenant gets and puts.
        let ops: std::collections::HashMap<u32, [u64; 3]> = s.tenant_ops().into_iter().collect();
        assert_eq!(ops[&b][2], 20, "B's puts");
        assert_eq!(ops[&b][0], 12 * 3, "B's hits");
        assert_eq!(ops[&b][1], 0, "B's misses");
        assert_eq!(ops[&a][2], 192, "A's puts");
        // A restart rebuilds the holdings exactly; the quotas are set again
        // by whoever holds them (the node's config or kv-mds).
        s.close().unwrap();
        drop(s);
        let (s, _) = Store::open(&c).unwrap();
        let again = s.tenants();
        for t in [a, b] {
            assert_eq!((again[&t].bytes, again[&t].objects), (after[&t].bytes, after[&t].objects));
        }
        s.set_quotas(&Quotas::parse_list("team-a=50%,team-b=50%").unwrap());
        for i in 192..260 {
            put_as(&s, a, &format!("a-{i}"));
        }
        assert_eq!(b_kept(&s), b_keys.len(), "after the restart too");
        // A quota larger than the node is held to it, with one line.
        let w = s.set_quotas(&Quotas::parse_list("team-a=1T").unwrap());
        assert!(w.len() == 1 && w[0].contains("team-a's quota 1T is larger than this node"), "{w:?}");
        assert_eq!(s.quota_bytes()[&a], 16 << 20);
    }
}

/// A tenant's evictions count on across a disk taken out of service (the
/// disk's share is carried, as the disks' own counters are): the figure a
/// node exports per tenant never goes down while it runs.
#[test]
fn a_tenants_evictions_survive_its_disk_leaving_service() {
    use kv_server::tenant::ns_key;
    let t = tempfile::tempdir().unwrap();
    let (s, _) = Store::open(&cfg(&dirs(&t, 2), 2 << 20, 0)).unwrap();
    let mut n = 0;
    while s.stats().disks.iter().any(|d| d.evictions == 0) {
        assert!(n < 1000, "the flood must evict on both disks");
        let k = format!("flood-{n}");
        s.put_in(s.pool().copy_of(&build_record(geo(), k.as_bytes(), &payload(&k, 100_000))), 9).unwrap();
        n += 1;
    }
    let before = s.tenants()[&9];
    assert!(before.evictions > 0);
    // Disk 0 fails (a delete it cannot journal) and leaves service.
    s.disks()[0].inject_journal_errno(libc::EIO);
    let on0 = (0..n)
        .map(|i| ns_key(9, format!("flood-{i}").as_bytes()).into_owned())
        .rfind(|k| s.owner(k) == Some(0) && s.exist(k, None) == Presence::Present)
        .unwrap();
    s.delete(&on0);
    s.maintain();
    assert_eq!(s.disks().len(), 1, "disk 0 out of service");
    let after = s.tenants()[&9];
    assert_eq!((after.evictions, after.evicted_for_others), (before.evictions, before.evicted_for_others));
    assert!(after.objects < before.objects, "what it holds is the disk in service's only");
    // It counts on from there.
    for i in 0..40 {
        let k = format!("more-{i}");
        s.put_in(s.pool().copy_of(&build_record(geo(), k.as_bytes(), &payload(&k, 100_000))), 9).unwrap();
    }
    assert!(s.tenants()[&9].evictions > before.evictions);
}
