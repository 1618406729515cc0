//! `kvctl bench`: put/get/exist/batch-exist workloads against a cluster,
//! printed beside limits measured in the same run on this host: the raw
//! loopback limit (the same message sizes through plain TCP socket pairs,
//! same thread count) and, with `--raw-disk DIR`, plain O_DIRECT writes.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use kv_common::size::{format_size, parse_size};
use kv_common::status::Status;
use kvclient::BlockingClient;

use crate::target::{GeoArgs, Target};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Put,
    Get,
    Exist,
    BatchExist,
    /// What an engine does on a prefix hit: a batch exist, a pause of
    /// `--gap-ms`, then a batch get of the same keys (reading the stored
    /// keys once each, oldest first). The get alone is timed.
    ExistGet,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: Target,
    #[command(flatten)]
    pub geo: GeoArgs,
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Workload::Get)]
    pub op: Workload,
    /// Page payload size (put, get).
    #[arg(long, default_value = "4M")]
    pub size: String,
    /// Operations in all (batches count as one each); ignored with --duration.
    #[arg(long, default_value_t = 1000)]
    pub count: u64,
    /// Run for this many seconds instead of --count.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Client threads.
    #[arg(long, default_value_t = 8)]
    pub threads: usize,
    /// Keys per batch (put/get use kv_batch_*; batch-exist uses BATCH_EXIST).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Distinct keys to cycle through for get/exist (populated first).
    #[arg(long, default_value_t = 256)]
    pub keys: usize,
    /// Key prefix (a run id is appended so puts never collide with earlier runs).
    #[arg(long, default_value = "bench")]
    pub prefix: String,
    /// Also measure plain O_DIRECT writes of --size in this directory (put's limit).
    #[arg(long)]
    pub raw_disk: Option<std::path::PathBuf>,
    /// Skip the raw loopback measurement.
    #[arg(long)]
    pub no_raw: bool,
    /// exist-get: milliseconds between the exist and the get.
    #[arg(long, default_value_t = 5)]
    pub gap_ms: u64,
    /// exist-get: leave the exist out (the same gets, unannounced).
    #[arg(long)]
    pub no_exist: bool,
}

struct Outcome {
    /// Latency of every op, in nanoseconds (HDR histogram: 3 significant
    /// digits, 1 ns to 1 hour).
    latencies_ns: hdrhistogram::Histogram<u64>,
    statuses: BTreeMap<&'static str, u64>,
    bytes: u64,
}

fn new_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// The `p` quantile in microseconds (0 without ops).
fn percentile(h: &hdrhistogram::Histogram<u64>, p: f64) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    h.value_at_quantile(p) as f64 / 1000.0
}

/// Runs `op(thread, i)` on `threads` threads for `count` ops or `duration`.
fn drive(
    threads: usize,
    count: u64,
    duration: Option<Duration>,
    op: &(dyn Fn(usize, u64) -> (Status, u64) + Sync),
) -> (Outcome, f64) {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    // A bar on a terminal; nothing when stderr is a file or a pipe.
    let bar = match duration {
        Some(d) => indicatif::ProgressBar::new(d.as_millis() as u64),
        None => indicatif::ProgressBar::new(count),
    };
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("[{bar:30}] {percent:>3}% {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("#>."),
    );
    let progress = std::io::stderr().is_terminal().then(|| {
        let (done, stop, bar) = (done.clone(), stop.clone(), bar.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let d = done.load(Ordering::Relaxed);
                bar.set_position(match duration {
                    Some(_) => t0.elapsed().as_millis() as u64,
                    None => d,
                });
                bar.set_message(format!("{d} ops"));
                std::thread::sleep(Duration::from_millis(200));
            }
            bar.finish_and_clear();
        })
    });
    let next = AtomicU64::new(0);
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (next, done) = (&next, &done);
                s.spawn(move || {
                    let mut o = Outcome { latencies_ns: new_histogram(), statuses: BTreeMap::new(), bytes: 0 };
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let more = match duration {
                            Some(d) => t0.elapsed() < d,
                            None => i < count,
                        };
                        if !more {
                            break;
                        }
                        let t1 = Instant::now();
                        let (st, bytes) = op(t, i);
                        o.latencies_ns.saturating_record(t1.elapsed().as_nanos() as u64);
                        *o.statuses.entry(st.name()).or_default() += 1;
                        o.bytes += bytes;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    o
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.join();
    }
    let mut all = Outcome { latencies_ns: new_histogram(), statuses: BTreeMap::new(), bytes: 0 };
    for r in results {
        let _ = all.latencies_ns.add(&r.latencies_ns);
        for (k, v) in r.statuses {
            *all.statuses.entry(k).or_default() += v;
        }
        all.bytes += r.bytes;
    }
    (all, secs)
}

/// What plain sockets do on this host, for the same message pattern.
struct Raw {
    bytes_per_sec: f64,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
}

/// Plain TCP: each operation of each thread sends `send` bytes to each of
/// `fanout` peers, then reads `recv` bytes back from each (the pattern of a
/// batch spread over its owners); `count` operations in all (or for
/// `duration`). The peers do no work but echo.
fn raw_loopback(
    threads: usize,
    fanout: usize,
    send: usize,
    recv: usize,
    count: u64,
    duration: Option<Duration>,
) -> std::io::Result<Raw> {
    let fanout = fanout.max(1);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || {
        let mut hs = Vec::new();
        for _ in 0..threads * fanout {
            let Ok((mut s, _)) = listener.accept() else { break };
            hs.push(std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                let mut inb = vec![0u8; send.max(1)];
                let outb = vec![7u8; recv.max(1)];
                while s.read_exact(&mut inb[..send]).is_ok() {
                    if s.write_all(&outb[..recv]).is_err() {
                        break;
                    }
                }
            }));
        }
        for h in hs {
            let _ = h.join();
        }
    });
    let conns: Vec<std::sync::Mutex<Vec<TcpStream>>> = (0..threads)
        .map(|_| {
            let peers = (0..fanout)
                .map(|_| {
                    let s = TcpStream::connect(addr)?;
                    s.set_nodelay(true)?;
                    Ok(s)
                })
                .collect::<std::io::Result<Vec<_>>>()?;
            Ok(std::sync::Mutex::new(peers))
        })
        .collect::<std::io::Result<_>>()?;
    let bufs: Vec<std::sync::Mutex<(Vec<u8>, Vec<u8>)>> =
        (0..threads).map(|_| std::sync::Mutex::new((vec![1u8; send.max(1)], vec![0u8; recv.max(1)]))).collect();
    let (o, secs) = drive(threads, count, duration, &|t, _| {
        let mut peers = conns[t].lock().expect("conn");
        let mut b = bufs[t].lock().expect("buf");
        let (out, inb) = &mut *b;
        let mut ok = peers.iter_mut().all(|s| s.write_all(&out[..send]).is_ok());
        ok = ok && peers.iter_mut().all(|s| s.read_exact(&mut inb[..recv]).is_ok());
        (if ok { Status::Ok } else { Status::Unavailable }, (send.max(recv) * fanout) as u64)
    });
    drop(conns);
    let _ = server.join();
    Ok(Raw {
        bytes_per_sec: o.bytes as f64 / secs,
        ops_per_sec: o.latencies_ns.len() as f64 / secs,
        p50_us: percentile(&o.latencies_ns, 0.50),
        p99_us: percentile(&o.latencies_ns, 0.99),
    })
}

/// Plain aligned O_DIRECT writes of `size` bytes, `threads` at once.
fn raw_disk(dir: &std::path::Path, size: usize, threads: usize, total: u64) -> std::io::Result<f64> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let size = size.div_ceil(4096) * 4096;
    let count = (total / size as u64).max(threads as u64);
    let path = dir.join(format!("kvctl-raw-{}.bin", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    f.set_len(size as u64 * count)?;
    // O_DIRECT wants 4 KiB-aligned memory: an aligned window of a larger Vec.
    let bufs: Vec<Vec<u8>> = (0..threads).map(|_| vec![0x5au8; size + 4096]).collect();
    let (o, secs) = drive(threads, count, None, &|t, i| {
        let v = &bufs[t];
        let at = v.as_ptr().align_offset(4096);
        let ok = f.write_all_at(&v[at..at + size], i * size as u64).is_ok();
        (if ok { Status::Ok } else { Status::Unavailable }, size as u64)
    });
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(o.bytes as f64 / secs)
}

pub fn run(a: &BenchArgs, json: bool) -> Result<u8, String> {
    let size = parse_size(&a.size)? as usize;
    if a.threads == 0 || a.batch == 0 || a.keys == 0 {
        return Err("--threads, --batch and --keys must be at least 1".into());
    }
    let client = a.target.client(a.geo.geometry())?;
    // A refused token would make every request fail: say so once, up front.
    if client.exist(b"kvctl-bench-probe") == Status::Edenied {
        let why = kvclient::error::take_last_failure().unwrap_or_default();
        return Err(crate::denied_line(&why));
    }
    let members = client.core.topology().nodes.len();
    let run_id = format!("{}-{}-{}", a.prefix, std::process::id(), now_nanos());
    let key = |i: u64| format!("{run_id}-{i}");
    let duration = a.duration.map(Duration::from_secs_f64);
    let page: Vec<u8> = (0..size).map(|i| (i * 131 % 251) as u8).collect();
    let mut extra = BTreeMap::new();
    // Keys the read workloads cycle through, stored first (not measured).
    if matches!(a.op, Workload::Get | Workload::Exist | Workload::BatchExist | Workload::ExistGet) {
        let populate = a.keys.max(a.batch) as u64;
        let (o, _) = drive(a.threads.min(populate as usize), populate, None, &|_, i| {
            (client.putv(key(i).as_bytes(), &[&page]), 0)
        });
        let ok = o.statuses.get("ok").copied().unwrap_or(0);
        if ok < populate {
            return Err(format!("populating {populate} keys stored only {ok}: {:?}", o.statuses));
        }
    }
    let keys = a.keys.max(a.batch) as u64;
    // Key names made once: the loop measures the store, not string formatting.
    let names: Vec<String> = (0..keys).map(key).collect();
    let bufs: Vec<std::sync::Mutex<Vec<u8>>> = (0..a.threads).map(|_| std::sync::Mutex::new(vec![0u8; size])).collect();
    // Per-thread buffers for batch gets, reused so the loop measures the
    // store rather than page faults.
    let batch_bufs: Vec<std::sync::Mutex<Vec<Vec<u8>>>> = (0..a.threads)
        .map(|_| {
            std::sync::Mutex::new(if a.batch > 1 {
                (0..a.batch).map(|_| vec![0u8; size]).collect()
            } else {
                Vec::new()
            })
        })
        .collect();
    // exist-get: the gets alone, timed apart from the exist and the pause.
    let get_times: Vec<std::sync::Mutex<(hdrhistogram::Histogram<u64>, u64)>> =
        (0..a.threads).map(|_| std::sync::Mutex::new((new_histogram(), 0))).collect();
    let op: Box<dyn Fn(usize, u64) -> (Status, u64) + Sync> = match a.op {
        Workload::Put if a.batch == 1 => Box::new(|_, i| {
            let s = client.putv(key(i + 1_000_000_000).as_bytes(), &[&page]);
            (s, if s == Status::Ok { size as u64 } else { 0 })
        }),
        Workload::Put => Box::new(|_, i| {
            let names: Vec<String> = (0..a.batch as u64).map(|j| key(1_000_000_000 + i * a.batch as u64 + j)).collect();
            let items: Vec<(&[u8], Vec<&[u8]>)> = names.iter().map(|k| (k.as_bytes(), vec![&page[..]])).collect();
            batch_outcome(&client.batch_putv(&items).into_iter().map(|s| (s, size)).collect::<Vec<_>>())
        }),
        Workload::Get if a.batch == 1 => Box::new(|t, i| {
            let mut b = bufs[t].lock().expect("buf");
            match client.getv(names[(i % keys) as usize].as_bytes(), &mut [&mut b[..]]) {
                Ok(n) => (Status::Ok, n as u64),
                Err((s, _)) => (s, 0),
            }
        }),
        Workload::Get => {
            Box::new(|t, i| get_batch(&client, &names, i, a.batch, &mut batch_bufs[t].lock().expect("bufs")))
        }
        Workload::Exist => Box::new(|_, i| (client.exist(names[(i % keys) as usize].as_bytes()), 0)),
        Workload::BatchExist => Box::new(|_, i| {
            let refs: Vec<&[u8]> =
                (0..a.batch as u64).map(|j| names[((i * a.batch as u64 + j) % keys) as usize].as_bytes()).collect();
            let st = client.batch_exist(&refs);
            let worst = st.iter().copied().find(|s| *s != Status::Ok).unwrap_or(Status::Ok);
            (worst, 0)
        }),
        Workload::ExistGet => Box::new(|t, i| {
            let refs: Vec<&[u8]> =
                (0..a.batch as u64).map(|j| names[((i * a.batch as u64 + j) % keys) as usize].as_bytes()).collect();
            if !a.no_exist {
                let st = client.batch_exist(&refs);
                if let Some(s) = st.iter().copied().find(|s| *s != Status::Ok) {
                    return (s, 0);
                }
                std::thread::sleep(Duration::from_millis(a.gap_ms));
            }
            let t0 = Instant::now();
            let r = get_batch(&client, &names, i, a.batch, &mut batch_bufs[t].lock().expect("bufs"));
            let ns = t0.elapsed().as_nanos() as u64;
            let mut g = get_times[t].lock().expect("get times");
            let _ = g.0.record(ns.max(1));
            g.1 += ns;
            r
        }),
    };
    let (o, secs) = drive(a.threads, a.count, duration, &*op);
    let ops = o.latencies_ns.len();
    let gbps = o.bytes as f64 / secs / 1e9;
    if a.op == Workload::ExistGet {
        let mut h = new_histogram();
        let mut busy_ns = 0u64;
        for g in &get_times {
            let g = g.lock().expect("get times");
            let _ = h.add(&g.0);
            busy_ns += g.1;
        }
        extra.insert("get_p50_us", percentile(&h, 0.50));
        extra.insert("get_p99_us", percentile(&h, 0.99));
        // Bytes over the time the threads spent in gets (the pauses left out).
        let busy = busy_ns as f64 / 1e9 / a.threads as f64;
        extra.insert("get_gb_per_sec", if busy > 0.0 { o.bytes as f64 / busy / 1e9 } else { 0.0 });
    }
    // The limit on this host, in the same run: the same messages through
    // plain sockets (a get or put moves `size` bytes one way).
    if !a.no_raw {
        // A batch exist goes to every owner at once: the raw limit spreads
        // its keys over as many plain sockets.
        let fanout = if a.op == Workload::BatchExist { members.min(a.batch).max(1) } else { 1 };
        let (send, recv) = match a.op {
            Workload::Put => (size * a.batch + 16, 16),
            Workload::Get | Workload::ExistGet => (16, size * a.batch + 16),
            Workload::Exist => (80, 16),
            Workload::BatchExist => (40 + a.batch.div_ceil(fanout) * 40, 20 + a.batch.div_ceil(fanout)),
        };
        let raw_count = ops.clamp(100, 20_000);
        let raw =
            raw_loopback(a.threads, fanout, send, recv, raw_count, None).map_err(|e| format!("raw loopback: {e}"))?;
        if matches!(a.op, Workload::Put | Workload::Get | Workload::ExistGet) {
            extra.insert("raw_loopback_gb_per_sec", raw.bytes_per_sec / 1e9);
            extra.insert("ratio_loopback", gbps / (raw.bytes_per_sec / 1e9));
        } else {
            extra.insert("raw_loopback_round_trips_per_sec", raw.ops_per_sec);
            extra.insert("raw_fanout", fanout as f64);
            extra.insert("raw_p50_us", raw.p50_us);
            extra.insert("raw_p99_us", raw.p99_us);
            extra.insert("ratio_loopback", ops as f64 / secs / raw.ops_per_sec);
        }
    }
    if let (Some(dir), Workload::Put) = (&a.raw_disk, a.op) {
        let total = o.bytes.clamp(256 << 20, 4 << 30);
        let bps = raw_disk(dir, size, a.threads, total).map_err(|e| format!("raw disk: {e}"))?;
        extra.insert("raw_disk_gb_per_sec", bps / 1e9);
        extra.insert("ratio_disk", gbps / (bps / 1e9));
    }
    let lat = &o.latencies_ns;
    let errors: BTreeMap<_, _> = o.statuses.iter().filter(|(k, _)| **k != "ok").collect();
    if json {
        let mut j = serde_json::json!({
            "op": format!("{:?}", a.op).to_lowercase(), "size": size, "threads": a.threads, "batch": a.batch,
            "ops": ops, "seconds": secs, "ops_per_sec": ops as f64 / secs, "gb_per_sec": gbps,
            "p50_us": percentile(lat, 0.50), "p99_us": percentile(lat, 0.99), "p999_us": percentile(lat, 0.999),
            "statuses": o.statuses,
        });
        for (k, v) in &extra {
            j[*k] = serde_json::json!(v);
        }
        println!("{j}");
    } else {
        println!(
            "{:?} x{} size {} threads {}: {ops} ops in {secs:.2} s = {:.0} ops/s, {gbps:.3} GB/s",
            a.op,
            a.batch,
            format_size(size as u64),
            a.threads,
            ops as f64 / secs
        );
        println!(
            "latency p50 {:.0} us  p99 {:.0} us  p999 {:.0} us",
            percentile(lat, 0.50),
            percentile(lat, 0.99),
            percentile(lat, 0.999)
        );
        println!("errors: {}", if errors.is_empty() { "none".to_string() } else { format!("{errors:?}") });
        if let Some(r) = extra.get("raw_loopback_gb_per_sec") {
            println!(
                "raw loopback (same bytes, plain TCP): {r:.3} GB/s  -> ratio {:.0}%",
                100.0 * extra["ratio_loopback"]
            );
        }
        if let Some(r) = extra.get("raw_loopback_round_trips_per_sec") {
            println!(
                "raw loopback, same pattern ({} peer(s) per op, plain TCP, no work): {r:.0} ops/s, p50 {:.0} us  p99 {:.0} us  -> ratio {:.0}%",
                extra["raw_fanout"],
                extra["raw_p50_us"],
                extra["raw_p99_us"],
                100.0 * extra["ratio_loopback"]
            );
        }
        if let Some(g) = extra.get("get_gb_per_sec") {
            println!(
                "gets alone (exist and pause left out): {g:.3} GB/s, p50 {:.0} us  p99 {:.0} us",
                extra["get_p50_us"], extra["get_p99_us"]
            );
        }
        if let Some(r) = extra.get("raw_disk_gb_per_sec") {
            println!("raw disk (O_DIRECT writes): {r:.3} GB/s  -> ratio {:.0}%", 100.0 * extra["ratio_disk"]);
        }
    }
    Ok(if errors.is_empty() { 0 } else { 1 })
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

fn batch_outcome(res: &[(Status, usize)]) -> (Status, u64) {
    let bytes = res.iter().filter(|(s, _)| *s == Status::Ok).map(|(_, n)| *n as u64).sum();
    let worst = res.iter().map(|(s, _)| *s).find(|s| *s != Status::Ok).unwrap_or(Status::Ok);
    (worst, bytes)
}

fn get_batch(c: &BlockingClient, names: &[String], i: u64, batch: usize, store: &mut [Vec<u8>]) -> (Status, u64) {
    let keys = names.len() as u64;
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> = (0..batch as u64)
        .zip(store.iter_mut())
        .map(|(j, b)| (names[((i * batch as u64 + j) % keys) as usize].as_bytes(), vec![&mut b[..]]))
        .collect();
    batch_outcome(&c.batch_getv(&mut items))
}
