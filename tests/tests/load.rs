//! Load held (a benchmark, not a CI test: `scripts/bench-load.sh` runs it
//! against release binaries). Three nodes take mixed load from 64 client
//! threads (16 client handles) while 1,050 more connections sit open and
//! idle (engine processes with pools), for `KVCELLAR_LOAD_SECS` (default
//! 60). Printed: throughput, latency percentiles against the I/O timeout,
//! and each node's RSS and open fds before, at peak and after.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::Node;
use kvclient::{BlockingClient, Options};

fn proc_stat(pid: i32) -> (u64, u64) {
    let rss_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
    (rss_kib, fds)
}

fn page(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(17u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len).map(|i| (i as u8).wrapping_mul(seed | 1) ^ seed).collect()
}

#[test]
#[ignore]
fn load_held_by_64_threads_and_1000_idle_connections() {
    let secs: u64 = std::env::var("KVCELLAR_LOAD_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let t = tempfile::tempdir().unwrap();
    let nodes: Vec<Node> = (0..3)
        .map(|i| {
            let d = t.path().join(format!("n{i}"));
            Node::start(&["--dir", d.to_str().unwrap(), "--cap", "2G", "--log-level", "warn"])
        })
        .collect();
    let members = Node::members(&nodes);
    let pids: Vec<i32> = nodes.iter().map(Node::pid).collect();
    let idle: Vec<(u64, u64)> = pids.iter().map(|&p| proc_stat(p)).collect();
    let geo = Geometry { model_hash: 1, page_size: 16, tp_size: 1, ..Geometry::default() };
    let io_timeout = Duration::from_secs(10);
    let opts = format!("io_timeout_ms={},max_conns_per_node=16", io_timeout.as_millis());
    let len = 128 << 10;
    let keys: Vec<String> = (0..1500).map(|i| format!("load-{i}")).collect();
    // The idle crowd: hello exchanged, then silence.
    let mut held = Vec::new();
    for i in 0..1050 {
        let addr = &nodes[i % 3].addr;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(&kv_common::wire::client_hello(2, None)).unwrap();
        let mut h = [0u8; 16];
        s.read_exact(&mut h).unwrap();
        held.push(s);
    }
    let clients: Vec<BlockingClient> = (0..16)
        .map(|_| {
            BlockingClient::new(
                kvclient::members::parse_members(&members).unwrap(),
                geo,
                Options::parse(&opts).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let stop = AtomicBool::new(false);
    let (ops, bytes, errors) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let lat: Mutex<Vec<u32>> = Mutex::default();
    let peak: Mutex<Vec<(u64, u64)>> = Mutex::new(idle.clone());
    let start = Instant::now();
    std::thread::scope(|s| {
        for th in 0..64 {
            let (c, keys, stop, ops, bytes, errors, lat) =
                (&clients[th / 4], &keys, &stop, &ops, &bytes, &errors, &lat);
            s.spawn(move || {
                let mut x = 0x9E37_79B9u64 + th as u64;
                let mut buf = vec![0u8; len];
                let mut mine = Vec::with_capacity(1 << 16);
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let k = &keys[(x % keys.len() as u64) as usize];
                    let t = Instant::now();
                    let st = match x % 10 {
                        0..=6 => match c.getv(k.as_bytes(), &mut [&mut buf[..]]) {
                            Ok(n) => {
                                assert!(buf[..n] == page(k, len)[..], "{k}: wrong page");
                                bytes.fetch_add(n as u64, Ordering::Relaxed);
                                Status::Ok
                            }
                            Err((Status::Miss, _)) => {
                                let st = c.putv(k.as_bytes(), &[&page(k, len)]);
                                bytes.fetch_add(len as u64, Ordering::Relaxed);
                                st
                            }
                            Err((st, _)) => st,
                        },
                        7 | 8 => c.putv(k.as_bytes(), &[&page(k, len)]),
                        _ => match c.exist(k.as_bytes()) {
                            Status::Miss => Status::Ok,
                            st => st,
                        },
                    };
                    mine.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    if st != Status::Ok {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                lat.lock().unwrap().extend(mine);
            });
        }
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                let mut p = peak.lock().unwrap();
                for (i, &pid) in pids.iter().enumerate() {
                    let (r, f) = proc_stat(pid);
                    p[i] = (p[i].0.max(r), p[i].1.max(f));
                }
            }
        });
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::SeqCst);
    });
    let elapsed = start.elapsed().as_secs_f64();
    drop(clients);
    drop(held);
    // Back to idle: every connection closed by the clients is gone.
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let now: Vec<(u64, u64)> = pids.iter().map(|&p| proc_stat(p)).collect();
        if now.iter().zip(&idle).all(|(n, i)| n.1 <= i.1 + 2) || Instant::now() > deadline {
            break now;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut lat = lat.into_inner().unwrap();
    lat.sort_unstable();
    let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0) as f64 / 1e3;
    let n = ops.load(Ordering::Relaxed);
    println!("load held: 3 nodes, 64 client threads (16 handles), 1050 idle connections held, {elapsed:.0} s");
    println!(
        "  {n} ops, {:.0} ops/s, {:.0} MB/s; not ok: {}; latency ms p50 {:.2} p99 {:.2} p99.9 {:.2} max {:.1} (timeout {} ms)",
        n as f64 / elapsed,
        bytes.load(Ordering::Relaxed) as f64 / elapsed / 1e6,
        errors.load(Ordering::Relaxed),
        pct(0.5),
        pct(0.99),
        pct(0.999),
        pct(1.0),
        io_timeout.as_millis()
    );
    let peak = peak.into_inner().unwrap();
    for i in 0..3 {
        println!(
            "  node {i}: RSS MiB idle {:.0}, peak {:.0}, after {:.0}; open fds idle {}, peak {}, after {}",
            idle[i].0 as f64 / 1024.0,
            peak[i].0 as f64 / 1024.0,
            after[i].0 as f64 / 1024.0,
            idle[i].1,
            peak[i].1,
            after[i].1
        );
    }
    assert!(pct(1.0) < io_timeout.as_millis() as f64, "a request waited past the timeout");
    for i in 0..3 {
        assert!(after[i].1 <= idle[i].1 + 2, "node {i}: fds back to idle ({} vs {})", after[i].1, idle[i].1);
        assert!(peak[i].1 >= idle[i].1 + 300, "node {i}: the idle crowd was held ({} fds at peak)", peak[i].1);
    }
}
