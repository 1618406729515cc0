//! `kv-mds-load`: a fleet's membership traffic (docs/BENCHMARKS.md,
//! "Membership at scale") against real kv-mds replicas and a real etcd
//! cluster, all on loopback.
//!
//! ```text
//! kv-mds-load run [--nodes 1000] [--clients 10000] [--real-clients 200]
//!     [--replicas 2] [--etcd 3] [--joins 5] [--gap-ms 6000] [--wait-ms 1000]
//!     [--pollers-pct 5] [--poll-every-ms 5000] [--legacy] [--placement RULE]
//!     [--mds-bin PATH] [--ttl 30s] [--per-proc 6000] [--json FILE] [--work DIR]
//! ```
//!
//! `run` starts `--etcd` etcd members and `--replicas` kv-mds replicas
//! (their caps raised for the run, and said so), then worker processes of
//! this same binary:
//! - `nodes`: every node registers (32 at once, as a fleet coming up) and
//!   heartbeats every TTL/3, to a random first replica with failover, on
//!   a connection kept as kv-server's MDS client keeps it (reused while
//!   idle for less than 20 s);
//! - `clients`: up to `--per-proc` simulated clients each (one socket each
//!   at most), from their own 127.0.0.x source addresses, doing what the
//!   client library's discovery does: a long-poll of `--wait-ms` holding the
//!   epoch they have (deltas on), a random wait of up to min(wait/4, 1 s)
//!   after a change, a random first replica with failover, the connection
//!   kept between calls; `--pollers-pct` of them plain-poll every
//!   `--poll-every-ms` instead. `--legacy` makes them the previous
//!   release's clients: first replica, no jitter, whole views, a new
//!   connection per call;
//! - `real`: `--real-clients` clients of the client library itself
//!   (`kvclient::discovery`), the epoch each holds sampled every 2 ms.
//!
//! Once every client holds the view, it registers `--joins` new nodes
//! `--gap-ms` apart and measures how long until 50/99/100 % of the clients
//! hold each new epoch, heartbeat and register latency, kv-mds CPU, RSS and
//! fds, etcd's committed proposals and database size, bytes of views, the
//! workers' own CPU and timer lag (a lagging generator makes the run
//! invalid: CPU at 90 % of a core or more, or timer lag p99 of 1 s or more;
//! a lagging one only makes the times upper bounds), and errors by kind. It prints a report and
//! (`--json`) writes the figures. Every process it starts is its child,
//! stopped by its PID and reaped.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_e2e::cluster::{etcd_bin, free_port};
use serde_json::{json, Value};

/// CLOCK_MONOTONIC in ns: one clock for every process of the run.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A small xorshift generator seeded from the clock and a salt.
struct Rng(u64);

impl Rng {
    fn new(salt: u64) -> Rng {
        Rng((mono_ns() ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

fn flags(args: &[String]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut i = 0;
    while i < args.len() {
        let k = args[i].trim_start_matches("--").to_string();
        match args.get(i + 1).filter(|v| !v.starts_with("--")) {
            Some(v) => {
                out.insert(k, v.clone());
                i += 2;
            }
            None => {
                out.insert(k, "1".into());
                i += 1;
            }
        }
    }
    out
}

fn num(f: &HashMap<String, String>, k: &str, default: u64) -> u64 {
    f.get(k).map(|v| v.parse().unwrap_or_else(|_| panic!("--{k}: {v:?} is not a number"))).unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(mode) = args.first() else {
        eprintln!("usage: kv-mds-load run [flags] (see the source's header)");
        std::process::exit(2);
    };
    let f = flags(&args[1..]);
    match mode.as_str() {
        "run" => run(&f),
        "nodes" => worker(&f, Role::Nodes),
        "clients" => worker(&f, Role::Clients),
        "real" => real_worker(&f),
        m => {
            eprintln!("kv-mds-load: unknown mode {m:?}");
            std::process::exit(2);
        }
    }
}

// ---------------------------------------------------------------- workers

#[derive(Clone, Copy, PartialEq)]
enum Role {
    Nodes,
    Clients,
}

/// The epochs one client came to hold, and when (monotonic ns).
type Held = Vec<(u64, u64)>;

/// What every worker counts.
#[derive(Default)]
struct Tally {
    /// (when, latency in µs) of registrations and heartbeats.
    registers: Mutex<Vec<(u64, u32)>>,
    heartbeats: Mutex<Vec<(u64, u32)>>,
    /// Per client, the epochs it came to hold and when.
    epochs: Mutex<Vec<Held>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Bytes of view answers: all, and those that brought a new epoch.
    bytes: AtomicU64,
    change_bytes: AtomicU64,
    answers: AtomicU64,
    ready: AtomicU64,
    /// Clients 0..pollers plain-poll instead of long-polling.
    pollers: AtomicU64,
}

impl Tally {
    fn error(&self, kind: impl Into<String>) {
        *self.errors.lock().unwrap().entry(kind.into()).or_default() += 1;
    }
}

/// Why one HTTP exchange failed.
fn io_kind(e: &std::io::Error) -> String {
    format!("{:?}", e.kind())
}

/// A connection kept between calls, as the MDS client keeps it: reused
/// while idle for less than its `idle` (`kv_common::mds::KEEP_IDLE`, nodes'
/// `NODE_KEEP_IDLE`).
struct Kept(Option<(SocketAddr, tokio::net::TcpStream, Instant)>, Duration);

/// One HTTP/1.1 request, as today's MDS client sends it: on the kept
/// connection when it is to `ep` and fresh enough (once more on a new one
/// when the replica closed it before answering), else on a new connection
/// from `src`, which is kept unless the answer says `connection: close`.
async fn http_kept(
    kept: &mut Kept,
    src: Ipv4Addr,
    ep: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    answer_within: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {ep}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let reuse = kept.0.take().filter(|(to, _, idle)| *to == ep && idle.elapsed() < kept.1);
    if let Some((_, mut s, _)) = reuse {
        match tokio::time::timeout(answer_within, exchange_kept(&mut s, &req, body)).await {
            Ok(Ok((status, reply, keep))) => {
                if keep {
                    kept.0 = Some((ep, s, Instant::now()));
                }
                return Ok((status, reply));
            }
            // Closed before an answer: once more, on a new connection.
            Ok(Err((e, false))) => drop(e),
            Ok(Err((e, true))) => return Err(format!("answer: {}", io_kind(&e))),
            Err(_) => return Err("answer: timeout".into()),
        }
    }
    let mut s = connect_from(src, ep).await?;
    match tokio::time::timeout(answer_within, exchange_kept(&mut s, &req, body)).await {
        Ok(Ok((status, reply, keep))) => {
            if keep {
                kept.0 = Some((ep, s, Instant::now()));
            }
            Ok((status, reply))
        }
        Ok(Err((e, _))) => Err(format!("answer: {}", io_kind(&e))),
        Err(_) => Err("answer: timeout".into()),
    }
}

/// Writes a request and reads its answer on a kept-alive connection: the
/// status, the body and whether the connection may be kept; an error says
/// whether any of the answer had arrived.
async fn exchange_kept(
    s: &mut tokio::net::TcpStream,
    req: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>, bool), (std::io::Error, bool)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    s.write_all(req.as_bytes()).await.map_err(|e| (e, false))?;
    s.write_all(body).await.map_err(|e| (e, false))?;
    let mut raw = Vec::with_capacity(1024);
    let mut buf = [0u8; 16384];
    let head_end = loop {
        let n = s.read(&mut buf).await.map_err(|e| (e, !raw.is_empty()))?;
        if n == 0 {
            let started = !raw.is_empty();
            return Err((std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"), started));
        }
        raw.extend_from_slice(&buf[..n]);
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).and_then(|c| c.parse::<u16>().ok()).ok_or_else(|| (bad("no status"), true))?;
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .ok_or_else(|| (bad("no content-length"), true))?;
    let keep = !head.lines().any(|l| l.starts_with("connection:") && l.contains("close"));
    let mut reply = raw[head_end + 4..].to_vec();
    while reply.len() < len {
        let n = s.read(&mut buf).await.map_err(|e| (e, true))?;
        if n == 0 {
            return Err((std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed mid-answer"), true));
        }
        reply.extend_from_slice(&buf[..n]);
    }
    reply.truncate(len);
    Ok((status, reply, keep))
}

/// A new connection to `ep` from `src` (within 3 s).
async fn connect_from(src: Ipv4Addr, ep: SocketAddr) -> Result<tokio::net::TcpStream, String> {
    let sock = tokio::net::TcpSocket::new_v4().map_err(|e| format!("socket: {}", io_kind(&e)))?;
    // Ports are chosen per destination, not per source address alone.
    const IP_BIND_ADDRESS_NO_PORT: libc::c_int = 24;
    let one: libc::c_int = 1;
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid socket fd and a c_int option value of the right size.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IP,
                IP_BIND_ADDRESS_NO_PORT,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    sock.bind(SocketAddr::new(IpAddr::V4(src), 0)).map_err(|e| format!("bind: {}", io_kind(&e)))?;
    let s = tokio::time::timeout(Duration::from_secs(3), sock.connect(ep))
        .await
        .map_err(|_| "connect: timeout".to_string())?
        .map_err(|e| format!("connect: {}", io_kind(&e)))?;
    s.set_nodelay(true).map_err(|e| format!("nodelay: {}", io_kind(&e)))?;
    Ok(s)
}

/// One HTTP/1.1 request on a new connection from `src` (Connection: close,
/// as the previous release's MDS client): the status and body.
async fn http(
    src: Ipv4Addr,
    ep: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    answer_within: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let mut s = connect_from(src, ep).await?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {ep}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        s.write_all(req.as_bytes()).await?;
        s.write_all(body).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    let raw = tokio::time::timeout(answer_within, exchange)
        .await
        .map_err(|_| "answer: timeout".to_string())?
        .map_err(|e| format!("answer: {}", io_kind(&e)))?;
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("answer: no header end")?;
    let status = std::str::from_utf8(&raw[..head_end.min(64)])
        .ok()
        .and_then(|h| h.split(' ').nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or("answer: no status")?;
    Ok((status, raw[head_end + 4..].to_vec()))
}

/// The number after `"key":` in a JSON body (views put `epoch` first).
fn json_u64(body: &[u8], key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let at = body.windows(pat.len()).position(|w| w == pat.as_bytes())? + pat.len();
    let digits: Vec<u8> =
        body[at..].iter().copied().skip_while(|b| *b == b' ').take_while(u8::is_ascii_digit).collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

fn error_kind(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let why = if text.contains("long-poll cap") {
        " long-poll cap"
    } else if text.contains("connections") || text.contains("max-conns") {
        " connection cap"
    } else if text.contains("no epoch settled") || text.contains("changes too fast") || text.contains("changed during")
    {
        " conflict"
    } else if text.contains("etcd") {
        " etcd"
    } else {
        ""
    };
    format!("http {status}{why}")
}

fn worker(f: &HashMap<String, String>, role: Role) {
    let eps: Vec<SocketAddr> =
        f["mds"].split(',').map(|e| e.parse().unwrap_or_else(|_| panic!("--mds: {e:?} is not ip:port"))).collect();
    let group = f.get("group").cloned().unwrap_or_else(|| "g".into());
    let srcs: Vec<Ipv4Addr> = f["src"].split(',').map(|s| s.parse().expect("--src: IPv4 addresses")).collect();
    let from = num(f, "from", 0);
    let count = num(f, "count", 0);
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let lag = Arc::new(Mutex::new(Vec::<u32>::new()));
    rt.block_on(async {
        // Timer lag: how late a 50 ms tick fires (a saturated worker lags).
        {
            let (lag, stop) = (lag.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let late = t0.elapsed().saturating_sub(Duration::from_millis(50));
                    lag.lock().unwrap().push(late.as_micros() as u32);
                }
            });
        }
        match role {
            Role::Nodes => {
                let slots = Arc::new(tokio::sync::Semaphore::new(32));
                let ttl = Duration::from_millis(num(f, "ttl-ms", 30_000));
                for i in from..from + count {
                    let (eps, group, tally, stop, slots) =
                        (eps.clone(), group.clone(), tally.clone(), stop.clone(), slots.clone());
                    let src = srcs[(i as usize) % srcs.len()];
                    tokio::spawn(async move { node(i, src, eps, group, ttl, tally, stop, slots).await });
                }
            }
            Role::Clients => {
                let wait = Duration::from_millis(num(f, "wait-ms", 1000));
                let pollers = num(f, "pollers-pct", 0);
                let every = Duration::from_millis(num(f, "poll-every-ms", 5000));
                let legacy = f.contains_key("legacy");
                let jitter = Duration::from_millis(num(f, "jitter-cap-ms", 1000));
                tally.epochs.lock().unwrap().resize(count as usize, Vec::new());
                tally
                    .pollers
                    .store((0..count).filter(|i| (i * 100 / count.max(1)) < pollers).count() as u64, Ordering::Relaxed);
                for i in 0..count {
                    let (eps, group, tally, stop) = (eps.clone(), group.clone(), tally.clone(), stop.clone());
                    let src = srcs[(i as usize) % srcs.len()];
                    let poller = (i * 100 / count.max(1)) < pollers;
                    // A fleet's clients do not all start in the same ms.
                    let start = Duration::from_micros(Rng::new(i).below(2_000_000));
                    tokio::spawn(async move {
                        tokio::time::sleep(start).await;
                        client(i as usize, src, eps, group, wait, poller.then_some(every), legacy, jitter, tally, stop)
                            .await
                    });
                }
            }
        }
        // Ready once every node registered / every client holds a view.
        let mut said = false;
        let stdin_lines = {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            rx
        };
        let mut lines = stdin_lines;
        loop {
            if !said && tally.ready.load(Ordering::Relaxed) >= count {
                println!("ready");
                let _ = std::io::stdout().flush();
                said = true;
            }
            tokio::select! {
                line = lines.recv() => {
                    let Some(line) = line else { break };
                    if let Some(rest) = line.strip_prefix("stop ") {
                        let w: Vec<u64> = rest.split(' ').filter_map(|v| v.parse().ok()).collect();
                        let (t0, t1) = (w.first().copied().unwrap_or(0), w.get(1).copied().unwrap_or(u64::MAX));
                        stop.store(true, Ordering::Relaxed);
                        let report = worker_report(&tally, &lag, t0, t1);
                        println!("{report}");
                        let _ = std::io::stdout().flush();
                        break;
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    });
    rt.shutdown_timeout(Duration::from_millis(200));
}

/// CPU seconds this process used (user + system).
fn own_cpu_secs() -> f64 {
    let mut ru: libc::rusage = unsafe_zeroed_rusage();
    // SAFETY: getrusage fills one rusage at a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn unsafe_zeroed_rusage() -> libc::rusage {
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

fn worker_report(tally: &Tally, lag: &Mutex<Vec<u32>>, t0: u64, t1: u64) -> Value {
    let within = |v: &[(u64, u32)]| v.iter().filter(|(t, _)| *t >= t0 && *t <= t1).map(|(_, l)| *l).collect::<Vec<_>>();
    let registers: Vec<u32> = tally.registers.lock().unwrap().iter().map(|(_, l)| *l).collect();
    let hb = within(&tally.heartbeats.lock().unwrap());
    let epochs = tally.epochs.lock().unwrap().clone();
    let mut lag = lag.lock().unwrap().clone();
    lag.sort_unstable();
    json!({
        "registers_us": registers,
        "heartbeats_us": hb,
        "epochs": epochs,
        "errors": *tally.errors.lock().unwrap(),
        "bytes": tally.bytes.load(Ordering::Relaxed),
        "change_bytes": tally.change_bytes.load(Ordering::Relaxed),
        "answers": tally.answers.load(Ordering::Relaxed),
        "cpu_secs": own_cpu_secs(),
        "lag_p99_ms": pct_u32(&lag, 99.0) as f64 / 1000.0,
        "pollers": tally.pollers.load(Ordering::Relaxed),
    })
}

fn pct_u32(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[allow(clippy::too_many_arguments)]
async fn node(
    i: u64,
    src: Ipv4Addr,
    eps: Vec<SocketAddr>,
    group: String,
    ttl: Duration,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    slots: Arc<tokio::sync::Semaphore>,
) {
    let id = format!("gpu-{i:04}");
    let mut rng = Rng::new(i + 1);
    let mut at = rng.below(eps.len() as u64) as usize;
    let instance = format!("load-{}-{i}", std::process::id());
    let reg = json!({
        "addr": format!("10.{}.{}.{}:7700", (i >> 16) & 255, (i >> 8) & 255, i & 255),
        "weight": 1,
        "instance": instance,
        "metrics_addr": format!("10.{}.{}.{}:9700", (i >> 16) & 255, (i >> 8) & 255, i & 255),
    })
    .to_string();
    let hb = json!({ "instance": instance }).to_string();
    let mut registered = false;
    let mut first = true;
    let mut kept = Kept(None, kv_common::mds::NODE_KEEP_IDLE);
    while !stop.load(Ordering::Relaxed) {
        let (path, body) = if registered {
            (format!("/v1/groups/{group}/members/{id}/heartbeat"), hb.as_bytes())
        } else {
            (format!("/v1/groups/{group}/members/{id}"), reg.as_bytes())
        };
        let _slot = if registered { None } else { slots.clone().acquire_owned().await.ok() };
        let t0 = Instant::now();
        let r = http_kept(&mut kept, src, eps[at], "POST", &path, body, Duration::from_secs(3)).await;
        let lat = t0.elapsed().as_micros() as u32;
        drop(_slot);
        match r {
            Ok((200, _)) => {
                let list = if registered { &tally.heartbeats } else { &tally.registers };
                list.lock().unwrap().push((mono_ns(), lat));
                if !registered && first {
                    tally.ready.fetch_add(1, Ordering::Relaxed);
                    first = false;
                }
                // Heartbeats every TTL/3, the first at a random point of it
                // (a fleet's nodes did not all start in the same second).
                let period = ttl / 3;
                let d = if registered { period } else { Duration::from_micros(rng.below(period.as_micros() as u64)) };
                registered = true;
                tokio::time::sleep(d).await;
            }
            Ok((404, _)) => {
                tally.error("heartbeat 404: registers again");
                registered = false;
            }
            Ok((status, body)) => {
                tally.error(error_kind(status, &body));
                if status >= 500 {
                    at = (at + 1) % eps.len();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                tally.error(e);
                at = (at + 1) % eps.len();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn client(
    i: usize,
    src: Ipv4Addr,
    eps: Vec<SocketAddr>,
    group: String,
    wait: Duration,
    poll_every: Option<Duration>,
    legacy: bool,
    jitter_cap: Duration,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = Rng::new(i as u64 + 7);
    let mut at = if legacy { 0 } else { rng.below(eps.len() as u64) as usize };
    let mut epoch: Option<u64> = None;
    let wait_ms = wait.as_millis() as u64;
    let rules = "ketama,multiprobe";
    let mut kept = Kept(None, kv_common::mds::KEEP_IDLE);
    while !stop.load(Ordering::Relaxed) {
        let path = match (epoch, poll_every, legacy) {
            (None, _, _) | (_, Some(_), _) => format!("/v1/groups/{group}/view?rules={rules}"),
            (Some(e), None, true) => format!("/v1/groups/{group}/view?after={e}&wait_ms={wait_ms}&rules={rules}"),
            (Some(e), None, false) => {
                format!("/v1/groups/{group}/view?after={e}&wait_ms={wait_ms}&rules={rules}&delta=1")
            }
        };
        let within = Duration::from_secs(3) + if poll_every.is_none() { wait } else { Duration::ZERO };
        let r = if legacy {
            http(src, eps[at], "GET", &path, b"", within).await
        } else {
            http_kept(&mut kept, src, eps[at], "GET", &path, b"", within).await
        };
        match r {
            Ok((200, body)) => {
                tally.answers.fetch_add(1, Ordering::Relaxed);
                tally.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                let Some(got) = json_u64(&body, "epoch") else {
                    tally.error("view without an epoch");
                    continue;
                };
                // A delta against another epoch than ours: ask whole.
                if let Some(base) = json_u64(&body, "base") {
                    if Some(base) != epoch {
                        tally.error("delta against another base");
                        epoch = None;
                        continue;
                    }
                }
                if epoch.is_some_and(|e| got < e) {
                    tally.error("went back to an older epoch");
                }
                let changed = epoch != Some(got);
                if changed {
                    if epoch.is_none() {
                        tally.ready.fetch_add(1, Ordering::Relaxed);
                    } else if poll_every.is_none() {
                        // What a long-poll client is sent for a change
                        // (plain polls always get the whole view).
                        tally.change_bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                    }
                    tally.epochs.lock().unwrap()[i].push((got, mono_ns()));
                    epoch = Some(got);
                }
                match poll_every {
                    Some(p) => tokio::time::sleep(p).await,
                    None if changed && !legacy => {
                        let cap = (wait / 4).min(jitter_cap);
                        tokio::time::sleep(Duration::from_micros(rng.below(cap.as_micros() as u64 + 1))).await;
                    }
                    None => {}
                }
            }
            Ok((status, body)) => {
                tally.error(error_kind(status, &body));
                if status >= 500 {
                    at = (at + 1) % eps.len();
                }
                tokio::time::sleep(wait.min(Duration::from_secs(1))).await;
            }
            Err(e) => {
                tally.error(e);
                at = (at + 1) % eps.len();
                tokio::time::sleep(wait.min(Duration::from_secs(1))).await;
            }
        }
    }
}

/// Clients of the client library itself: its discovery thread per client.
fn real_worker(f: &HashMap<String, String>) {
    let eps: Vec<String> = f["mds"].split(',').map(str::to_string).collect();
    let group = f.get("group").cloned().unwrap_or_else(|| "g".into());
    let count = num(f, "count", 0) as usize;
    let wait = Duration::from_millis(num(f, "wait-ms", 1000));
    let geo = kv_common::page::Geometry::default();
    let mut cores = Vec::new();
    let mut discoveries = Vec::new();
    let t_cpu = own_cpu_secs();
    for _ in 0..count {
        let core = Arc::new(kvclient::Client::new(Vec::new(), geo, kvclient::Options::default()));
        match kvclient::discovery::start(core.clone(), eps.clone(), group.clone(), wait, Duration::from_secs(30)) {
            Ok((d, _)) => discoveries.push(d),
            Err(e) => eprintln!("kv-mds-load: discovery thread: {e}"),
        }
        cores.push(core);
    }
    let epochs: Arc<Mutex<Vec<Held>>> = Arc::new(Mutex::new(vec![Vec::new(); count]));
    let errors: BTreeMap<String, u64> = BTreeMap::new();
    let stop = Arc::new(AtomicBool::new(false));
    let lag = Arc::new(Mutex::new(Vec::<u32>::new()));
    let back = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (cores, epochs, stop, lag, back) = (cores.clone(), epochs.clone(), stop.clone(), lag.clone(), back.clone());
        std::thread::spawn(move || {
            let mut seen: Vec<u64> = vec![u64::MAX; cores.len()];
            let mut said = false;
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                for (i, c) in cores.iter().enumerate() {
                    let r = c.metrics.ring_rebuilds.load(Ordering::Relaxed);
                    if r != seen[i] {
                        seen[i] = r;
                        let e = c.epoch();
                        let mut ep = epochs.lock().unwrap();
                        if ep[i].last().is_some_and(|l| e < l.0) {
                            back.fetch_add(1, Ordering::Relaxed);
                        }
                        if r > 0 && ep[i].last().map(|l| l.0) != Some(e) {
                            ep[i].push((e, mono_ns()));
                        }
                    }
                }
                if !said && epochs.lock().unwrap().iter().all(|e| !e.is_empty()) {
                    println!("ready");
                    let _ = std::io::stdout().flush();
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(2));
                let late = t0.elapsed().saturating_sub(Duration::from_millis(2));
                lag.lock().unwrap().push(late.as_micros() as u32);
            }
        })
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.starts_with("stop") {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let errors_total: u64 = cores.iter().map(|c| c.metrics.mds_errors.load(Ordering::Relaxed)).sum();
    let mut errs = errors;
    if errors_total > 0 {
        errs.insert("library discovery errors".into(), errors_total);
    }
    if back.load(Ordering::Relaxed) > 0 {
        errs.insert("went back to an older epoch".into(), back.load(Ordering::Relaxed));
    }
    let mut lag = lag.lock().unwrap().clone();
    lag.sort_unstable();
    let report = json!({
        "registers_us": [], "heartbeats_us": [],
        "epochs": *epochs.lock().unwrap(),
        "errors": errs,
        "bytes": 0, "change_bytes": 0, "answers": 0,
        "cpu_secs": own_cpu_secs() - t_cpu,
        "lag_p99_ms": pct_u32(&lag, 99.0) as f64 / 1000.0,
    });
    println!("{report}");
    let _ = std::io::stdout().flush();
    drop(discoveries);
}

// ------------------------------------------------------------ coordinator

/// A worker's pipe held by a reader thread that has not seen `ready` yet.
type LateReader = std::sync::mpsc::Receiver<(bool, String, BufReader<ChildStdout>)>;

struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Option<BufReader<ChildStdout>>,
    late: Option<LateReader>,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: signals our own child by its PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(name: &str, cmd: &mut Command, log: &Path, piped: bool) -> Proc {
    let err = std::fs::File::create(log).expect("log file");
    if piped {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    } else {
        cmd.stdin(Stdio::null()).stdout(err.try_clone().expect("log"));
    }
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
        // A child outlives no coordinator that was killed.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            })
        };
    }
    let mut child = cmd.stderr(err).spawn().unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().map(BufReader::new);
    Proc { name: name.to_string(), child, stdin, stdout, late: None }
}

/// A blocking GET on a fresh connection: status and body.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        if t0.elapsed() > limit {
            panic!("kv-mds-load: {what} not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Prometheus sample's value (the first series of that name).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name || k.starts_with(&format!("{name}{{"))).then(|| v.parse().ok()).flatten()
    })
}

/// The `q` quantile of a histogram's observations between two scrapes of
/// each replica (`before[i]`, `after[i]`), as the upper bound of its bucket.
fn histogram_quantile(after: &[String], before: &[String], name: &str, q: f64) -> Option<f64> {
    let buckets = |text: &str| -> BTreeMap<u64, f64> {
        let prefix = format!("{name}_bucket{{le=\"");
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(&prefix)?;
                let (le, n) = rest.split_once("\"} ")?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some(((le * 1e9).min(u64::MAX as f64) as u64, n.parse().ok()?))
            })
            .collect()
    };
    let mut total: BTreeMap<u64, f64> = BTreeMap::new();
    for (a, b) in after.iter().zip(before) {
        let b = buckets(b);
        for (le, n) in buckets(a) {
            *total.entry(le).or_default() += n - b.get(&le).copied().unwrap_or(0.0);
        }
    }
    let all = total.values().copied().fold(0.0, f64::max);
    if all <= 0.0 {
        return None;
    }
    // Past the last finite bucket: unknown (None).
    total.into_iter().find(|(_, n)| *n >= q * all).filter(|(le, _)| *le != u64::MAX).map(|(le, _)| le as f64 / 1e6)
}

/// CPU ticks, RSS bytes and open fds of a process.
fn proc_usage(pid: u32) -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches(" kB").trim().parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
    Some((ticks, rss_kb * 1024, fds))
}

fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf reads a constant.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// Peak and mean of a replica's usage over the measured window.
#[derive(Default, Clone)]
struct Usage {
    cpu_pct_mean: f64,
    cpu_pct_peak: f64,
    rss_peak: u64,
    fds_peak: u64,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[i.min(v.len() - 1)]
}

fn run(f: &HashMap<String, String>) {
    let nodes = num(f, "nodes", 1000);
    let clients = num(f, "clients", 10_000);
    let real = num(f, "real-clients", 200).min(clients);
    let replicas = num(f, "replicas", 2) as usize;
    let etcd_n = num(f, "etcd", 3) as usize;
    let joins = num(f, "joins", 5);
    let gap = Duration::from_millis(num(f, "gap-ms", 6000));
    let wait_ms = num(f, "wait-ms", 1000);
    let per_proc = num(f, "per-proc", 6000).max(1);
    let legacy = f.contains_key("legacy");
    let ttl = f.get("ttl").cloned().unwrap_or_else(|| "30s".into());
    let placement = f.get("placement").cloned();
    let work = match f.get("work") {
        Some(w) => PathBuf::from(w),
        None => std::env::temp_dir().join(format!("kv-mds-load-{}", std::process::id())),
    };
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("work dir");
    let me = std::env::current_exe().expect("own path");
    let mds_bin = f.get("mds-bin").map(PathBuf::from).unwrap_or_else(|| me.with_file_name("kv-mds"));
    let simulated = clients - real;

    // etcd: --etcd members on loopback.
    let peers: Vec<(u16, u16)> = (0..etcd_n).map(|_| (free_port(), free_port())).collect();
    let cluster =
        peers.iter().enumerate().map(|(i, (_, p))| format!("e{i}=http://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let mut etcds = Vec::new();
    for (i, (c, p)) in peers.iter().enumerate() {
        let client = format!("http://127.0.0.1:{c}");
        let peer = format!("http://127.0.0.1:{p}");
        let mut cmd = Command::new(etcd_bin());
        cmd.args(["--name", &format!("e{i}"), "--data-dir"])
            .arg(work.join(format!("etcd{i}")))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &cluster, "--initial-cluster-state", "new"])
            .args(["--log-level", "error", "--logger", "zap"]);
        etcds.push(spawn(&format!("etcd{i}"), &mut cmd, &work.join(format!("etcd{i}.log")), false));
    }
    let etcd_eps: Vec<String> = peers.iter().map(|(c, _)| format!("127.0.0.1:{c}")).collect();
    for ep in &etcd_eps {
        wait_for("etcd healthy", Duration::from_secs(60), || {
            get(ep, "/health").is_some_and(|(s, b)| s == 200 && b.contains("true"))
        });
    }

    // kv-mds replicas, caps raised for the run.
    let help = Command::new(&mds_bin).arg("--help").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let has_poll_cap = help.as_deref().unwrap_or("").contains("--max-long-polls");
    let long_polls = (clients / replicas.max(1) as u64 + 1000).max(2048);
    let max_conns = long_polls + 2000;
    let mut mdss = Vec::new();
    let mut mds_eps = Vec::new();
    for r in 0..replicas {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(&mds_bin);
        cmd.args(["--listen", &addr, "--etcd", &etcd_eps.join(","), "--lease-ttl", &ttl, "--log-level", "warn"])
            .args(["--max-conns", &max_conns.to_string()]);
        if has_poll_cap {
            cmd.args(["--max-long-polls", &long_polls.to_string()]);
        }
        mdss.push(spawn(&format!("kv-mds{r}"), &mut cmd, &work.join(format!("kv-mds{r}.log")), false));
        wait_for("kv-mds up", Duration::from_secs(30), || get(&addr, "/livez").is_some_and(|(s, _)| s == 200));
        mds_eps.push(addr);
    }
    let caps = if has_poll_cap {
        format!("--max-conns {max_conns} --max-long-polls {long_polls}")
    } else {
        format!("--max-conns {max_conns} (long-poll cap fixed at 2048 in this build)")
    };
    let eps = mds_eps.join(",");
    let ttl_ms = kv_common_ttl_ms(&ttl);
    eprintln!("kv-mds-load: etcd {} members, {replicas} kv-mds replicas ({caps}); registering {nodes} nodes", etcd_n);

    // Nodes (one process: their sockets are short-lived).
    let mut workers: Vec<Proc> = Vec::new();
    let mut cmd = Command::new(&me);
    cmd.args(["nodes", "--mds", &eps, "--src", "127.0.0.2,127.0.0.3", "--from", "0", "--count", &nodes.to_string()])
        .args(["--ttl-ms", &ttl_ms.to_string()]);
    workers.push(spawn("nodes", &mut cmd, &work.join("nodes.log"), true));
    let t_reg = Instant::now();
    let mut not_ready: Vec<String> = Vec::new();
    if !await_ready(&mut workers[0], Duration::from_secs(600)) {
        not_ready.push("nodes".into());
    }
    let reg_secs = t_reg.elapsed().as_secs_f64();
    eprintln!("kv-mds-load: {nodes} nodes registered in {reg_secs:.1} s");
    if let Some(p) = &placement {
        let rule = kv_common::ring::Placement::parse(p).unwrap_or_else(|e| panic!("--placement: {e}"));
        let mut m = kv_common::mds::MdsClient::from_csv(&eps, Duration::from_secs(5)).expect("endpoints");
        m.set_placement("g", rule).expect("set placement");
    }

    // Clients: the library's own, then simulated ones in processes of per_proc.
    if real > 0 {
        let mut cmd = Command::new(&me);
        cmd.args(["real", "--mds", &eps, "--count", &real.to_string(), "--wait-ms", &wait_ms.to_string()]);
        workers.push(spawn("real", &mut cmd, &work.join("real.log"), true));
    }
    let procs = simulated.div_ceil(per_proc);
    for p in 0..procs {
        let n = (simulated - p * per_proc).min(per_proc);
        let srcs: Vec<String> = (0..4).map(|k| format!("127.0.{}.{}", 10 + p, 10 + k)).collect();
        let mut cmd = Command::new(&me);
        cmd.args(["clients", "--mds", &eps, "--src", &srcs.join(","), "--count", &n.to_string()])
            .args(["--wait-ms", &wait_ms.to_string()])
            .args(["--pollers-pct", &num(f, "pollers-pct", 5).to_string()])
            .args(["--poll-every-ms", &num(f, "poll-every-ms", 5000).to_string()])
            .args(["--jitter-cap-ms", &num(f, "jitter-cap-ms", 1000).to_string()]);
        if legacy {
            cmd.arg("--legacy");
        }
        workers.push(spawn(&format!("clients{p}"), &mut cmd, &work.join(format!("clients{p}.log")), true));
    }
    for w in workers.iter_mut().skip(1) {
        if !await_ready(w, Duration::from_secs(180)) {
            not_ready.push(w.name.clone());
        }
    }
    eprintln!("kv-mds-load: {clients} clients hold the view; measuring {joins} joins {gap:?} apart");

    // Measure: joins under load, usage sampled every 250 ms.
    let sample_stop = Arc::new(AtomicBool::new(false));
    let pids: Vec<u32> = mdss.iter().map(Proc::pid).chain(workers.iter().map(Proc::pid)).collect();
    let sampler = {
        let stop = sample_stop.clone();
        std::thread::spawn(move || {
            let mut series: Vec<Vec<(Instant, u64, u64, u64)>> = vec![Vec::new(); pids.len()];
            while !stop.load(Ordering::Relaxed) {
                for (i, pid) in pids.iter().enumerate() {
                    if let Some((t, rss, fds)) = proc_usage(*pid) {
                        series[i].push((Instant::now(), t, rss, fds));
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            series
        })
    };
    let etcd_before: Vec<String> =
        etcd_eps.iter().map(|e| get(e, "/metrics").map(|r| r.1).unwrap_or_default()).collect();
    let mds_before: Vec<String> = mds_eps.iter().map(|e| get(e, "/metrics").map(|r| r.1).unwrap_or_default()).collect();
    let t_start = mono_ns();
    let wall0 = Instant::now();
    let mut changes: Vec<(u64, u64, u32)> = Vec::new(); // (sent at, epoch, register µs)
    let join_stop = Arc::new(AtomicBool::new(false));
    let join_ids: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    // The joined nodes heartbeat like the others, so none expires mid-run.
    let join_beats = {
        let (stop, ids, eps) = (join_stop.clone(), join_ids.clone(), eps.clone());
        std::thread::spawn(move || {
            let mut m = kv_common::mds::MdsClient::from_csv(&eps, Duration::from_secs(5)).expect("endpoints");
            let mut next = Instant::now() + Duration::from_millis(ttl_ms / 3);
            while !stop.load(Ordering::Relaxed) {
                if Instant::now() >= next {
                    for (id, inst) in ids.lock().unwrap().clone() {
                        let _ = m.heartbeat("g", &id, &inst);
                    }
                    next = Instant::now() + Duration::from_millis(ttl_ms / 3);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    std::thread::sleep(gap / 2);
    let (mut failed_joins, mut failed_attempts) = (0u64, 0u64);
    for k in 0..joins {
        let id = format!("join-{k:03}");
        let mut m = kv_common::mds::MdsClient::from_csv(&eps, Duration::from_secs(5)).expect("endpoints");
        let req = kv_common::mds::RegisterRequest {
            addr: format!("10.200.0.{k}:7700"),
            weight: 1,
            instance: format!("join-{k}"),
            metrics_addr: None,
        };
        // A replica that cannot reach etcd in time answers 503: try again
        // for up to 20 s (the change counts from the attempt that made it).
        let tried = Instant::now();
        loop {
            let sent = mono_ns();
            let t0 = Instant::now();
            match m.register("g", &id, &req) {
                Ok(r) => {
                    changes.push((sent, r.epoch, t0.elapsed().as_micros() as u32));
                    break;
                }
                Err(e) if tried.elapsed() > Duration::from_secs(20) => {
                    eprintln!("kv-mds-load: join {id} not registered within 20 s: {e}");
                    failed_joins += 1;
                    break;
                }
                Err(_) => {
                    failed_attempts += 1;
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        join_ids.lock().unwrap().push((id, req.instance.clone()));
        std::thread::sleep(gap);
    }
    join_stop.store(true, Ordering::Relaxed);
    let _ = join_beats.join();
    let t_end = mono_ns();
    let wall = wall0.elapsed().as_secs_f64();
    let etcd_after: Vec<String> =
        etcd_eps.iter().map(|e| get(e, "/metrics").map(|r| r.1).unwrap_or_default()).collect();
    let mds_after: Vec<String> = mds_eps.iter().map(|e| get(e, "/metrics").map(|r| r.1).unwrap_or_default()).collect();
    sample_stop.store(true, Ordering::Relaxed);
    let series = sampler.join().expect("sampler");

    // Collect the workers' figures.
    let mut reports: Vec<(String, Value)> = Vec::new();
    for w in workers.iter_mut() {
        if let Some(stdin) = w.stdin.as_mut() {
            let _ = writeln!(stdin, "stop {t_start} {t_end}");
            let _ = stdin.flush();
        }
        let mut line = String::new();
        if let Some(late) = w.late.take() {
            // Its `ready` comes before the figures, unless it never was.
            if let Ok((_, first, reader)) = late.recv_timeout(Duration::from_secs(30)) {
                w.stdout = Some(reader);
                if first.trim_start().starts_with('{') {
                    reports.push((w.name.clone(), serde_json::from_str(first.trim()).unwrap_or(Value::Null)));
                    continue;
                }
            }
        }
        loop {
            line.clear();
            match w.stdout.as_mut().map(|o| o.read_line(&mut line)) {
                Some(Ok(n)) if n > 0 => {
                    if line.trim_start().starts_with('{') {
                        break;
                    }
                }
                _ => break,
            }
        }
        let v: Value = serde_json::from_str(line.trim()).unwrap_or(Value::Null);
        reports.push((w.name.clone(), v));
    }
    drop(workers);

    // Figures.
    let lat = |key: &str| -> Vec<f64> {
        reports
            .iter()
            .flat_map(|(_, v)| v[key].as_array().cloned().unwrap_or_default())
            .filter_map(|x| x.as_f64())
            .map(|us| us / 1000.0)
            .collect()
    };
    let mut reg = lat("registers_us");
    let mut hb = lat("heartbeats_us");
    let mut joins_ms: Vec<f64> = changes.iter().map(|c| c.2 as f64 / 1000.0).collect();
    // Per change: when each client first held an epoch >= it.
    // (plain poller?, epochs held and when) per client.
    let all_epochs: Vec<(bool, Vec<(u64, u64)>)> = reports
        .iter()
        .flat_map(|(_, v)| {
            let pollers = v["pollers"].as_u64().unwrap_or(0) as usize;
            v["epochs"].as_array().cloned().unwrap_or_default().into_iter().enumerate().map(move |(i, c)| {
                let pairs = c
                    .as_array()
                    .map(|a| {
                        a.iter().filter_map(|p| Some((p.get(0)?.as_u64()?, p.get(1)?.as_u64()?))).collect::<Vec<_>>()
                    })
                    .unwrap_or_default();
                (i < pollers, pairs)
            })
        })
        .collect();
    let mut prop = Vec::new();
    for ((sent, epoch, _), polling) in changes.iter().flat_map(|c| [(c, false), (c, true)]) {
        let mut t: Vec<f64> = Vec::new();
        let mut missing = 0;
        for (_, pairs) in all_epochs.iter().filter(|(p, _)| *p == polling) {
            match pairs.iter().find(|(e, _)| e >= epoch) {
                Some((_, at)) => t.push(at.saturating_sub(*sent) as f64 / 1e6),
                None => missing += 1,
            }
        }
        let n = t.len() + missing;
        let p50 = percentile(&mut t, 50.0);
        let p99 = percentile(&mut t, 99.0);
        let p100 = if missing > 0 { f64::INFINITY } else { percentile(&mut t, 100.0) };
        let within_1s = t.iter().filter(|x| **x <= 1000.0).count() as f64 / n.max(1) as f64;
        let within_3s = t.iter().filter(|x| **x <= 3000.0).count() as f64 / n.max(1) as f64;
        if n == 0 {
            continue;
        }
        prop.push(json!({"epoch": epoch, "plain_polls": polling, "p50_ms": p50, "p99_ms": p99, "p100_ms": p100, "missing": missing,
            "within_1s": within_1s, "within_3s": within_3s, "clients": n}));
    }
    let tck = ticks_per_sec();
    let usage: Vec<Usage> = series
        .iter()
        .map(|s| {
            let mut u = Usage::default();
            let mut pcts = Vec::new();
            for w in s.windows(2) {
                let dt = w[1].0.duration_since(w[0].0).as_secs_f64();
                if dt > 0.0 {
                    pcts.push((w[1].1 - w[0].1) as f64 / tck / dt * 100.0);
                }
            }
            if let (Some(a), Some(b)) = (s.first(), s.last()) {
                let dt = b.0.duration_since(a.0).as_secs_f64();
                u.cpu_pct_mean = if dt > 0.0 { (b.1 - a.1) as f64 / tck / dt * 100.0 } else { 0.0 };
            }
            u.cpu_pct_peak = pcts.iter().cloned().fold(0.0, f64::max);
            u.rss_peak = s.iter().map(|x| x.2).max().unwrap_or(0);
            u.fds_peak = s.iter().map(|x| x.3).max().unwrap_or(0);
            u
        })
        .collect();
    let proposals =
        |t: &[String]| t.iter().filter_map(|m| metric(m, "etcd_server_proposals_committed_total")).fold(0.0, f64::max);
    let proposals_per_s = (proposals(&etcd_after) - proposals(&etcd_before)) / wall;
    let db_size = etcd_after.iter().filter_map(|m| metric(m, "etcd_mvcc_db_total_size_in_bytes")).fold(0.0, f64::max);
    let mds_delta = |name: &str| -> f64 {
        mds_after
            .iter()
            .zip(&mds_before)
            .map(|(a, b)| metric(a, name).unwrap_or(0.0) - metric(b, name).unwrap_or(0.0))
            .sum()
    };
    let change_bytes: f64 = reports.iter().map(|(_, v)| v["change_bytes"].as_f64().unwrap_or(0.0)).sum();
    let all_bytes: f64 = reports.iter().map(|(_, v)| v["bytes"].as_f64().unwrap_or(0.0)).sum();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for (_, v) in &reports {
        if let Some(o) = v["errors"].as_object() {
            for (k, n) in o {
                *errors.entry(k.clone()).or_default() += n.as_u64().unwrap_or(0);
            }
        }
    }
    let gen: Vec<Value> = reports
        .iter()
        .zip(usage.iter().skip(mdss.len()))
        .map(|((name, v), u)| {
            json!({"worker": name, "cpu_pct_mean": u.cpu_pct_mean, "cpu_pct_peak": u.cpu_pct_peak,
                "fds_peak": u.fds_peak, "lag_p99_ms": v["lag_p99_ms"]})
        })
        .collect();
    let saturated: Vec<String> = gen
        .iter()
        .filter(|g| {
            g["lag_p99_ms"].as_f64().unwrap_or(0.0) >= 1000.0 || g["cpu_pct_mean"].as_f64().unwrap_or(0.0) >= 90.0
        })
        .map(|g| g["worker"].as_str().unwrap_or("").to_string())
        .collect();
    let p = |v: &mut Vec<f64>, q: f64| percentile(v, q);
    let summary = json!({
        "nodes": nodes, "clients": clients, "real_clients": real, "simulated_clients": simulated,
        "client_processes": procs, "replicas": replicas, "etcd_members": etcd_n, "wait_ms": wait_ms,
        "legacy_clients": legacy, "placement": placement.clone().unwrap_or_else(|| "ketama".into()),
        "mds_bin": mds_bin.display().to_string(), "mds_caps": caps, "lease_ttl": ttl,
        "register_cold_ms": {"p50": p(&mut reg, 50.0), "p99": p(&mut reg, 99.0), "n": reg.len(), "all_secs": reg_secs},
        "register_join_ms": {"p50": p(&mut joins_ms, 50.0), "p99": p(&mut joins_ms, 99.0), "n": joins_ms.len()},
        "heartbeat_ms": {"p50": p(&mut hb, 50.0), "p99": p(&mut hb, 99.0), "n": hb.len()},
        "propagation": prop,
        "mds": mds_eps.iter().zip(&usage).map(|(e, u)| json!({"addr": e, "cpu_pct_mean": u.cpu_pct_mean,
            "cpu_pct_peak": u.cpu_pct_peak, "rss_peak_mib": u.rss_peak as f64 / 1048576.0, "fds_peak": u.fds_peak})).collect::<Vec<_>>(),
        "etcd": {"proposals_per_s": proposals_per_s, "db_size_mib": db_size / 1048576.0},
        "view_bytes_per_change": if changes.is_empty() { 0.0 } else { change_bytes / changes.len() as f64 },
        "view_bytes_per_s": all_bytes / wall,
        "mds_view_encodings": mds_delta("kvmds_view_encodings_total"),
        "mds_etcd_view_reads": mds_delta("kvmds_view_reads_total"),
        // Over the whole run: most come while the fleet starts.
        "mds_settle_retries": mds_after.iter().map(|a| metric(a, "kvmds_epoch_settle_retries_total").unwrap_or(0.0)).sum::<f64>(),
        "mds_etcd_call_ms": {
            "p50": histogram_quantile(&mds_after, &mds_before, "kvmds_etcd_request_duration_seconds", 0.5),
            "p99": histogram_quantile(&mds_after, &mds_before, "kvmds_etcd_request_duration_seconds", 0.99),
        },
        "errors": errors,
        "generator": gen,
        "valid": saturated.is_empty(),
        "not_ready_workers": not_ready,
        "joins_failed": failed_joins,
        "join_attempts_refused": failed_attempts,
        "saturated_workers": saturated,
        "measured_secs": wall,
    });
    print_report(&summary);
    if let Some(path) = f.get("json") {
        std::fs::write(path, serde_json::to_string_pretty(&summary).unwrap_or_default()).expect("--json file");
    }
    drop(mdss);
    drop(etcds);
    if !f.contains_key("keep") {
        let _ = std::fs::remove_dir_all(&work);
    }
}

fn kv_common_ttl_ms(ttl: &str) -> u64 {
    let t = ttl.trim();
    if let Some(ms) = t.strip_suffix("ms") {
        ms.parse().unwrap_or(30_000)
    } else if let Some(s) = t.strip_suffix('s') {
        s.parse::<u64>().map(|s| s * 1000).unwrap_or(30_000)
    } else {
        t.parse::<u64>().map(|s| s * 1000).unwrap_or(30_000)
    }
}

/// Waits for a worker's `ready`; false when it did not come within `limit`
/// (the worker goes on; what it never did shows in its figures).
fn await_ready(p: &mut Proc, limit: Duration) -> bool {
    let name = p.name.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    // Read one line on a helper thread so the limit holds.
    // The reader thread owns the pipe until it reads a line; it is handed
    // back through the channel.
    let mut reader = p.stdout.take().expect("piped worker");
    std::thread::spawn(move || {
        let mut line = String::new();
        let r = reader.read_line(&mut line);
        let _ = tx.send((r.is_ok(), line, reader));
    });
    match rx.recv_timeout(limit) {
        Ok((true, l, reader)) if l.trim() == "ready" => {
            p.stdout = Some(reader);
            true
        }
        Ok((_, l, _)) => panic!("kv-mds-load: worker {name} said {l:?} instead of ready"),
        Err(_) => {
            eprintln!("kv-mds-load: worker {name} not ready within {limit:?}: measuring anyway");
            p.late = Some(rx);
            false
        }
    }
}

fn print_report(s: &Value) {
    let ms = |v: &Value| match v.as_f64() {
        Some(x) if x.is_finite() => format!("{x:.0} ms"),
        Some(_) => "never (some clients)".into(),
        None => "-".into(),
    };
    println!(
        "membership load: {} nodes, {} clients ({} simulated in {} processes, {} of the client library), {} kv-mds replicas, {} etcd members",
        s["nodes"], s["clients"], s["simulated_clients"], s["client_processes"], s["real_clients"], s["replicas"], s["etcd_members"]
    );
    println!(
        "  long-poll wait {} ms, {} clients, placement {}, kv-mds {} ({}), lease TTL {}",
        s["wait_ms"],
        if s["legacy_clients"].as_bool() == Some(true) { "legacy" } else { "current" },
        s["placement"].as_str().unwrap_or(""),
        s["mds_bin"].as_str().unwrap_or(""),
        s["mds_caps"].as_str().unwrap_or(""),
        s["lease_ttl"].as_str().unwrap_or("")
    );
    let r = &s["register_cold_ms"];
    println!(
        "  register (fleet start, 32 at once): p50 {} p99 {} ({} nodes in {:.1} s)",
        ms(&r["p50"]),
        ms(&r["p99"]),
        r["n"],
        r["all_secs"].as_f64().unwrap_or(0.0)
    );
    let r = &s["register_join_ms"];
    println!(
        "  register (joins under load):       p50 {} p99 {} ({} attempts refused first, {} joins never made)",
        ms(&r["p50"]),
        ms(&r["p99"]),
        s["join_attempts_refused"],
        s["joins_failed"]
    );
    if let Some(n) = s["not_ready_workers"].as_array().filter(|n| !n.is_empty()) {
        println!("  not every client of {n:?} held a view before the joins (3 minutes)");
    }
    let r = &s["heartbeat_ms"];
    println!("  heartbeat while measuring:         p50 {} p99 {} (n={})", ms(&r["p50"]), ms(&r["p99"]), r["n"]);
    let e = &s["mds_etcd_call_ms"];
    println!(
        "  kv-mds's etcd calls meanwhile:     p50 <= {} p99 <= {} (histogram buckets)",
        ms(&e["p50"]),
        ms(&e["p99"])
    );
    for p in s["propagation"].as_array().cloned().unwrap_or_default() {
        println!(
            "  epoch {} ({}): 50% {} 99% {} 100% {}; within 1 s {:.2}%, within 3 s {:.2}% of {} clients{}",
            p["epoch"],
            if p["plain_polls"].as_bool() == Some(true) { "plain polls" } else { "long-polls" },
            ms(&p["p50_ms"]),
            ms(&p["p99_ms"]),
            ms(&p["p100_ms"]),
            p["within_1s"].as_f64().unwrap_or(0.0) * 100.0,
            p["within_3s"].as_f64().unwrap_or(0.0) * 100.0,
            p["clients"],
            match p["missing"].as_u64() {
                Some(m) if m > 0 => format!(" ({m} never within the run)"),
                _ => String::new(),
            }
        );
    }
    for m in s["mds"].as_array().cloned().unwrap_or_default() {
        println!(
            "  kv-mds {}: CPU mean {:.0}% peak {:.0}%, RSS peak {:.1} MiB, fds peak {}",
            m["addr"].as_str().unwrap_or(""),
            m["cpu_pct_mean"].as_f64().unwrap_or(0.0),
            m["cpu_pct_peak"].as_f64().unwrap_or(0.0),
            m["rss_peak_mib"].as_f64().unwrap_or(0.0),
            m["fds_peak"]
        );
    }
    println!(
        "  etcd: {:.1} committed proposals/s, db {:.1} MiB; kv-mds etcd view reads {}, view encodings {}; epoch settle retries in the run {}",
        s["etcd"]["proposals_per_s"].as_f64().unwrap_or(0.0),
        s["etcd"]["db_size_mib"].as_f64().unwrap_or(0.0),
        s["mds_etcd_view_reads"],
        s["mds_view_encodings"],
        s["mds_settle_retries"]
    );
    println!(
        "  view bytes per epoch change to long-poll clients: {:.0} ({:.1} MB); all views: {:.1} MB/s",
        s["view_bytes_per_change"].as_f64().unwrap_or(0.0),
        s["view_bytes_per_change"].as_f64().unwrap_or(0.0) / 1e6,
        s["view_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e6
    );
    for g in s["generator"].as_array().cloned().unwrap_or_default() {
        println!(
            "  generator {}: CPU mean {:.0}% peak {:.0}%, fds peak {}, timer lag p99 {} ms",
            g["worker"].as_str().unwrap_or(""),
            g["cpu_pct_mean"].as_f64().unwrap_or(0.0),
            g["cpu_pct_peak"].as_f64().unwrap_or(0.0),
            g["fds_peak"],
            g["lag_p99_ms"]
        );
    }
    let errors = s["errors"].as_object().cloned().unwrap_or_default();
    if errors.is_empty() {
        println!("  errors: none");
    } else {
        let list: Vec<String> = errors.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!("  errors: {}", list.join(", "));
    }
    let lag = s["generator"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|g| g["lag_p99_ms"].as_f64())
        .fold(0.0, f64::max);
    if s["valid"].as_bool() == Some(true) {
        println!(
            "  run valid: no generator process saturated (CPU under 90% of a core, timer lag p99 under 1 s); its timer lag p99 ({lag:.0} ms) is included in the times above: they are upper bounds"
        );
    } else {
        println!(
            "  RUN INVALID: generator saturated ({:?}): its figures measure the generator, not kv-mds",
            s["saturated_workers"]
        );
    }
}
