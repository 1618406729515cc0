//! Store benchmark: put and get of 4 MiB and 256 KiB records with several
//! threads, beside the raw throughput of the same disk measured in the same
//! run with plain aligned O_DIRECT writes and reads of the same sizes. Also
//! times recovery of 100k records after a clean stop and after a crash.
//!
//! cargo bench -p kv-server --bench store -- [--dir DIR] [--threads N]
//!     [--mib TOTAL_PER_CASE] [--runs N] [--recovery N]
//!
//! DIR must be on the disk to measure (default: a temp dir under $TMPDIR).
//! Figures are medians over --runs.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_server::store::{AlignedBuf, DiskSpec, GetOutcome, Store, StoreConfig};

struct Opts {
    dir: Option<PathBuf>,
    threads: usize,
    mib: usize,
    runs: usize,
    recovery: usize,
}

fn opts() -> Opts {
    let mut o = Opts { dir: None, threads: 4, mib: 2048, runs: 3, recovery: 100_000 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--dir" => o.dir = Some(PathBuf::from(val())),
            "--threads" => o.threads = val().parse().expect("--threads N"),
            "--mib" => o.mib = val().parse().expect("--mib N"),
            "--runs" => o.runs = val().parse().expect("--runs N"),
            "--recovery" => o.recovery = val().parse().expect("--recovery N"),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    o
}

fn geo() -> Geometry {
    Geometry {
        model_hash: 1,
        page_size: 64,
        dtype_tag: 1,
        tp_size: 1,
        tp_rank: 0,
        layer_num: 61,
        head_num: 1,
        head_dim: 576,
        flags: 1,
    }
}

const PATTERN_MARK: u64 = 0x6b76_6365_6c6c_6172;

/// Fills the payload once per buffer (the pool hands back warm buffers that
/// already hold it), then writes this key's header and key.
fn fill_record(buf: &mut AlignedBuf, key: &[u8], payload_len: usize, crc: u32) {
    let start = HEADER_LEN + key.len();
    let full = buf.full_mut();
    let p = &mut full[start..start + payload_len];
    if p[..8] != PATTERN_MARK.to_le_bytes() {
        pattern(p);
    }
    let h = PageHeader::new(geo(), key, payload_len as u64, crc);
    full[..HEADER_LEN].copy_from_slice(&h.encode());
    full[HEADER_LEN..start].copy_from_slice(key);
    buf.set_len(start + payload_len);
}

fn pattern(p: &mut [u8]) {
    for (i, c) in p.chunks_mut(8).enumerate() {
        let v = if i == 0 { PATTERN_MARK } else { i as u64 * 0x9E37_79B9 };
        c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
    }
}

/// Runs `per_thread` on `threads` threads; returns elapsed seconds.
fn parallel(threads: usize, f: impl Fn(usize) + Sync) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for i in 0..threads {
            let f = &f;
            s.spawn(move || f(i));
        }
    });
    t.elapsed().as_secs_f64()
}

/// Raw disk: aligned O_DIRECT writes then reads of `size` bytes, `count` in all.
fn raw(dir: &Path, size: usize, count: usize, threads: usize) -> (f64, f64) {
    let path = dir.join("raw.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("open raw file");
    f.set_len((size * count) as u64).expect("size raw file");
    let next = AtomicUsize::new(0);
    let io = |write: bool| {
        let mut b = AlignedBuf::new(size);
        pattern(&mut b.full_mut()[..size]);
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                break;
            }
            let off = (i * size) as u64;
            if write {
                f.write_all_at(b.prefix(size), off).expect("raw write");
            } else {
                f.read_exact_at(&mut b.full_mut()[..size], off).expect("raw read");
            }
        }
    };
    let w = parallel(threads, |_| io(true));
    next.store(0, Ordering::Relaxed);
    let r = parallel(threads, |_| io(false));
    drop(f);
    let _ = std::fs::remove_file(&path);
    let bytes = (size * count) as f64;
    (bytes / w / 1e9, bytes / r / 1e9)
}

fn store_cfg(dir: &Path, cap: u64, sync: bool) -> StoreConfig {
    StoreConfig {
        disks: vec![DiskSpec { dir: dir.to_path_buf(), cap }],
        mem_cap: 0,
        sync_writes: sync,
        pool_bytes: 512 << 20,
        ack_memory_max: None,
        flushers: 0,
        warmers: 0,
    }
}

/// Store put then get of `count` records of `payload` bytes.
fn store_case(dir: &Path, payload: usize, count: usize, threads: usize) -> (f64, f64) {
    let d = dir.join("store");
    let _ = std::fs::remove_dir_all(&d);
    let rec_len = payload + HEADER_LEN + 24;
    let cap = ((rec_len + 8192) * count) as u64 + (64 << 20);
    let (store, _) = Store::open(&store_cfg(&d, cap, true)).expect("open store");
    let mut scratch = vec![0u8; payload];
    pattern(&mut scratch);
    let crc = crc32fast::hash(&scratch);
    let per = count / threads;
    let w = parallel(threads, |t| {
        for i in 0..per {
            let key = format!("bench-{t:02}-{i:08}");
            let mut b = store.pool().get(HEADER_LEN + key.len() + payload);
            fill_record(&mut b, key.as_bytes(), payload, crc);
            store.put(b).expect("put");
        }
    });
    let r = parallel(threads, |t| {
        for i in 0..per {
            // Visit in a scrambled order so reads are not one sequential stream.
            let j = (i * 7919) % per;
            let key = format!("bench-{t:02}-{j:08}");
            match store.get(key.as_bytes(), Some(&geo())) {
                GetOutcome::Hit(b) => assert_eq!(b.len(), HEADER_LEN + key.len() + payload),
                _ => panic!("bench record {key} missing"),
            }
        }
    });
    drop(store);
    let _ = std::fs::remove_dir_all(&d);
    let bytes = (payload * per * threads) as f64;
    (bytes / w / 1e9, bytes / r / 1e9)
}

fn recovery(dir: &Path, n: usize, threads: usize) -> (f64, f64) {
    let d = dir.join("recovery");
    let _ = std::fs::remove_dir_all(&d);
    let cfg = store_cfg(&d, (n as u64 + 1024) * 8192, false);
    let (store, _) = Store::open(&cfg).expect("open");
    let payload = vec![5u8; 1024];
    let crc = crc32fast::hash(&payload);
    let per = n / threads;
    parallel(threads, |t| {
        for i in 0..per {
            let key = format!("rec-{t:02}-{i:08}");
            let mut b = store.pool().get(HEADER_LEN + key.len() + payload.len());
            fill_record(&mut b, key.as_bytes(), payload.len(), crc);
            b.full_mut()[HEADER_LEN + key.len()..HEADER_LEN + key.len() + payload.len()].copy_from_slice(&payload);
            store.put(b).expect("put");
        }
    });
    store.close().expect("close");
    drop(store);
    let t = Instant::now();
    let (store, rep) = Store::open(&cfg).expect("reopen");
    let clean = t.elapsed().as_secs_f64();
    assert_eq!(rep[0].records as usize, per * threads);
    drop(store); // a crash: no checkpoint, no clean marker
    let t = Instant::now();
    let (store, rep) = Store::open(&cfg).expect("reopen after crash");
    let crash = t.elapsed().as_secs_f64();
    assert_eq!(rep[0].records as usize, per * threads);
    assert!(!rep[0].clean);
    drop(store);
    let _ = std::fs::remove_dir_all(&d);
    (clean, crash)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn main() {
    let o = opts();
    let tmp;
    let dir = match &o.dir {
        Some(d) => {
            std::fs::create_dir_all(d).expect("create --dir");
            d.clone()
        }
        None => {
            tmp = tempfile::tempdir().expect("temp dir");
            tmp.path().to_path_buf()
        }
    };
    let dir = Arc::new(dir);
    println!(
        "kvcellar store benchmark: dir {}, {} threads, {} MiB per case, median of {} runs",
        dir.display(),
        o.threads,
        o.mib,
        o.runs
    );
    println!("store writes: O_DIRECT + group-committed fdatasync (on media when acknowledged), payload CRC checked; raw: plain O_DIRECT");
    println!("{:<10} {:<4} {:>11} {:>9} {:>7}   runs (store GB/s)", "record", "op", "store GB/s", "raw GB/s", "ratio");
    for (name, payload) in [("4 MiB", 4usize << 20), ("256 KiB", 256 << 10)] {
        let count = ((o.mib << 20) / payload / o.threads).max(1) * o.threads;
        let (mut sw, mut sr, mut rw, mut rr) = (vec![], vec![], vec![], vec![]);
        for _ in 0..o.runs {
            let (a, b) = raw(&dir, payload, count, o.threads);
            rw.push(a);
            rr.push(b);
            let (a, b) = store_case(&dir, payload, count, o.threads);
            sw.push(a);
            sr.push(b);
        }
        let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
        let (mw, mr, mrw, mrr) = (median(sw.clone()), median(sr.clone()), median(rw.clone()), median(rr.clone()));
        println!("{name:<10} {:<4} {mw:>11.2} {mrw:>9.2} {:>6.0}%   {}", "put", 100.0 * mw / mrw, fmt(&sw));
        println!("{name:<10} {:<4} {mr:>11.2} {mrr:>9.2} {:>6.0}%   {}", "get", 100.0 * mr / mrr, fmt(&sr));
    }
    if o.recovery > 0 {
        let (mut c, mut k) = (vec![], vec![]);
        for _ in 0..o.runs {
            let (a, b) = recovery(&dir, o.recovery, o.threads);
            c.push(a);
            k.push(b);
        }
        println!(
            "recovery of {} records: {:.3} s after a clean stop, {:.3} s after a crash (target < 2 s)",
            o.recovery,
            median(c),
            median(k)
        );
    }
}
