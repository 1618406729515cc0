//! `kv-mds-size`: what one kv-mds replica's memory grows by per member of a
//! group, per waiting long-poll and per kept connection (docs/DEPLOY.md,
//! "Sizing the membership tier": the formula its figures give).
//!
//! ```text
//! kv-mds-size [--members 1000] [--long-polls 4000] [--conns 2000] [--changes 3] [--json FILE]
//! ```
//!
//! Starts a real etcd and one kv-mds (its caps raised above the run's
//! counts), then in steps, reading the replica's resident memory (VmRSS,
//! settled: two reads 300 ms apart within 1 %) after each:
//! 1. idle, after one plain poll of the empty group;
//! 2. `--members` nodes registered (one lease each; the TTL is long, so no
//!    heartbeats run);
//! 3. `--long-polls` long-polls waiting, each on its own connection with the
//!    epoch it holds (deltas on), as engines' clients wait;
//! 4. `--changes` joins, each answered to every waiter, which polls again at
//!    once (the peak of RSS sampled every 20 ms is what a replica must hold:
//!    every answer in flight at once);
//! 5. `--conns` more connections, each having made one call and kept
//!    (nodes' and plain pollers' connections between calls).
//!
//! It prints each step's RSS, the cost per unit, and the formula. Every
//! process it starts is its child, ended by its PID and reaped.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kv_common::mds::{MdsClient, RegisterRequest};
use kv_e2e::cluster::{Etcd, Mds};

struct Args {
    members: usize,
    long_polls: usize,
    conns: usize,
    changes: usize,
    json: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args { members: 1000, long_polls: 4000, conns: 2000, changes: 3, json: None };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut num = |what: &str| -> Result<usize, String> {
            it.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("{what} needs a number"))
        };
        match k.as_str() {
            "--members" => a.members = num("--members")?,
            "--long-polls" => a.long_polls = num("--long-polls")?,
            "--conns" => a.conns = num("--conns")?,
            "--changes" => a.changes = num("--changes")?.max(1),
            "--json" => a.json = Some(it.next().ok_or("--json needs a file")?),
            _ => {
                return Err(format!(
                "unknown argument {k}\nusage: kv-mds-size [--members N] [--long-polls N] [--conns N] [--changes N] [--json FILE]"
            ))
            }
        }
    }
    Ok(a)
}

/// Resident memory of `pid` in bytes.
fn rss(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// RSS once two reads 300 ms apart agree within 1 % (at most 10 s).
fn settled(pid: i32) -> u64 {
    let end = Instant::now() + Duration::from_secs(10);
    let mut last = rss(pid);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = rss(pid);
        if now.abs_diff(last) * 100 <= last || Instant::now() >= end {
            return now;
        }
        last = now;
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// One HTTP/1.1 request on `s`, its answer read whole (Content-Length).
fn call(s: &mut TcpStream, path: &str) -> std::io::Result<Vec<u8>> {
    write!(s, "GET {path} HTTP/1.1\r\nHost: kv-mds\r\n\r\n")?;
    read_answer(s)
}

fn read_answer(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b)? == 0 {
            return Err(std::io::Error::other("closed"));
        }
        head.push(b[0]);
    }
    let h = String::from_utf8_lossy(&head).to_ascii_lowercase();
    if !h.starts_with("http/1.1 200") {
        return Err(std::io::Error::other(h.lines().next().unwrap_or("").to_string()));
    }
    let len: usize =
        h.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

fn epoch_of(body: &[u8]) -> u64 {
    serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| v["epoch"].as_u64()).unwrap_or(0)
}

fn metric(addr: &str, name: &str) -> f64 {
    let Ok(mut s) = TcpStream::connect(addr) else { return -1.0 };
    let body = call(&mut s, "/metrics").unwrap_or_default();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let end = Instant::now() + limit;
    while !f() {
        if Instant::now() >= end {
            return Err(format!("timed out waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn register(addr: &str, from: usize, n: usize) -> Result<u64, String> {
    let mut epoch = 0;
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let addr = addr.to_string();
            std::thread::spawn(move || -> Result<u64, String> {
                let mut c = MdsClient::new(vec![addr], Duration::from_secs(10));
                let mut e = 0;
                for i in (from + t..from + n).step_by(8) {
                    let req = RegisterRequest {
                        addr: format!("10.{}.{}.{}:7700", i >> 16 & 255, i >> 8 & 255, i & 255),
                        weight: 1,
                        instance: format!("size-{i}"),
                        metrics_addr: None,
                    };
                    e = e.max(c.register("g", &format!("node-{i:05}"), &req).map_err(|e| e.to_string())?.epoch);
                }
                Ok(e)
            })
        })
        .collect();
    for t in threads {
        epoch = epoch.max(t.join().map_err(|_| "a register thread panicked".to_string())??);
    }
    Ok(epoch)
}

fn run(a: &Args) -> Result<serde_json::Value, String> {
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let etcd = Etcd::start(work.path().to_path_buf());
    let cap = (a.long_polls + a.conns + 1000).to_string();
    let mds =
        Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "600s", &["--max-long-polls", &cap, "--max-conns", &cap]);
    let pid = mds.pid();
    let addr = mds.addr.clone();
    let mut c0 = TcpStream::connect(&addr).map_err(|e| e.to_string())?;
    call(&mut c0, "/v1/groups/g/view").map_err(|e| e.to_string())?;
    let idle = settled(pid);
    println!("idle                                   RSS {:7.1} MiB", mib(idle));

    register(&addr, 0, a.members)?;
    let view = call(&mut c0, "/v1/groups/g/view").map_err(|e| e.to_string())?;
    let epoch = epoch_of(&view);
    let with_members = settled(pid);
    let per_member = with_members.saturating_sub(idle) / a.members.max(1) as u64;
    println!(
        "{:5} members (view {:6} B)            RSS {:7.1} MiB   {:6.1} KiB a member",
        a.members,
        view.len(),
        mib(with_members),
        per_member as f64 / 1024.0
    );

    let poll = |e: u64| format!("/v1/groups/g/view?after={e}&wait_ms=120000&delta=1");
    let mut waiters: Vec<TcpStream> = Vec::with_capacity(a.long_polls);
    for i in 0..a.long_polls {
        let mut s = TcpStream::connect(&addr).map_err(|e| format!("long-poll {i}: {e}"))?;
        write!(s, "GET {} HTTP/1.1\r\nHost: kv-mds\r\n\r\n", poll(epoch)).map_err(|e| e.to_string())?;
        waiters.push(s);
    }
    let want = a.long_polls as f64;
    wait_for("every long-poll to wait", Duration::from_secs(60), || metric(&addr, "kvmds_long_polls_waiting") >= want)?;
    let with_polls = settled(pid);
    let per_poll = with_polls.saturating_sub(with_members) / a.long_polls.max(1) as u64;
    println!(
        "{:5} long-polls waiting                 RSS {:7.1} MiB   {:6.1} KiB a long-poll",
        a.long_polls,
        mib(with_polls),
        per_poll as f64 / 1024.0
    );

    // Changes: every waiter is answered and polls again at once; the peak
    // is every answer and every new poll in flight together.
    let mut peak = with_polls;
    let mut e = epoch;
    for j in 0..a.changes {
        let sampler = {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (s2, p) = (stop.clone(), pid);
            (
                stop,
                std::thread::spawn(move || {
                    let mut m = 0;
                    while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                        m = m.max(rss(p));
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    m
                }),
            )
        };
        let joined = register(&addr, a.members + j, 1)?;
        for (i, s) in waiters.iter_mut().enumerate() {
            s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
            let body = read_answer(s).map_err(|err| format!("waiter {i} after change {j}: {err}"))?;
            let got = epoch_of(&body);
            if got < joined {
                return Err(format!("waiter {i} was answered epoch {got}, not {joined}"));
            }
            write!(s, "GET {} HTTP/1.1\r\nHost: kv-mds\r\n\r\n", poll(got)).map_err(|e| e.to_string())?;
        }
        e = joined;
        wait_for("the long-polls to wait again", Duration::from_secs(60), || {
            metric(&addr, "kvmds_long_polls_waiting") >= want
        })?;
        sampler.0.store(true, std::sync::atomic::Ordering::Relaxed);
        peak = peak.max(sampler.1.join().unwrap_or(0));
    }
    let per_poll_peak = peak.saturating_sub(with_members) / a.long_polls.max(1) as u64;
    println!(
        "{} changes answered to every waiter      peak {:6.1} MiB   {:6.1} KiB a long-poll at the peak (epoch {e})",
        a.changes,
        mib(peak),
        per_poll_peak as f64 / 1024.0
    );
    let after_changes = settled(pid);

    let mut kept: Vec<TcpStream> = Vec::with_capacity(a.conns);
    for i in 0..a.conns {
        let mut s = TcpStream::connect(&addr).map_err(|e| format!("connection {i}: {e}"))?;
        call(&mut s, "/livez").map_err(|e| format!("connection {i}: {e}"))?;
        kept.push(s);
    }
    let with_conns = settled(pid);
    let per_conn = with_conns.saturating_sub(after_changes) / a.conns.max(1) as u64;
    println!(
        "{:5} kept connections                   RSS {:7.1} MiB   {:6.1} KiB a connection",
        a.conns,
        mib(with_conns),
        per_conn as f64 / 1024.0
    );
    let base = idle;
    println!(
        "formula: RSS <= {:.0} MiB + {:.1} KiB x members + {:.1} KiB x long-polls + {:.1} KiB x other connections",
        mib(base).ceil(),
        per_member as f64 / 1024.0,
        per_poll_peak as f64 / 1024.0,
        per_conn as f64 / 1024.0
    );
    drop(kept);
    drop(waiters);
    drop(mds);
    drop(etcd);
    Ok(serde_json::json!({
        "members": a.members, "long_polls": a.long_polls, "conns": a.conns, "changes": a.changes,
        "rss_idle": idle, "rss_members": with_members, "rss_long_polls": with_polls, "rss_peak": peak,
        "rss_conns": with_conns,
        "per_member": per_member, "per_long_poll": per_poll, "per_long_poll_peak": per_poll_peak,
        "per_conn": per_conn,
    }))
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    match run(&a) {
        Ok(v) => {
            if let Some(f) = &a.json {
                if let Err(e) = std::fs::write(f, v.to_string()) {
                    eprintln!("cannot write {f}: {e}");
                    std::process::exit(1);
                }
            }
        }
        Err(e) => {
            eprintln!("kv-mds-size: {e}");
            std::process::exit(1);
        }
    }
}
