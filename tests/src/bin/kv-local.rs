//! `kv-local`: a kvcellar cluster on loopback, the one way the quickstart,
//! the benchmarks and the browser test start one (the end-to-end tests use
//! the same code as a library: `kv_e2e::cluster`).
//!
//! ```text
//! kv-local --work DIR [--nodes 3] [--disks 1] [--mds 2] [--group local]
//!          [--id-prefix n] [--first 1] [--weights 1,1,2] [--metrics] [--env K=V]...
//!          [--wait-arena] [--bin-dir DIR] [-- NODE_FLAGS...]
//! ```
//!
//! Starts etcd and `--mds` kv-mds replicas (none with `--mds 0`: the nodes
//! then stand alone and clients name them with `members=`), then the nodes,
//! each with `--disks` dirs under `DIR/<id>/` and NODE_FLAGS; waits until
//! each listens, the group lists them all, and (`--wait-arena`) each has
//! faulted its memory tier in. Then it prints one line per part and
//! `ready`, and keeps the cluster up until SIGTERM or SIGINT, when it stops
//! the nodes (SIGTERM: they deregister and drain), the replicas and etcd.
//! Logs go to `DIR/<part>.log`. Every process it starts is its own child,
//! ended by its PID and reaped.
//!
//! Output (stdout), for scripts to read:
//! ```text
//! etcd 127.0.0.1:PORT
//! mds ADDR,ADDR
//! node ID ADDR pid=PID[ metrics=ADDR]
//! members ID=ADDR,...
//! ready
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_e2e::cluster::{free_port, Etcd, Mds};
use kv_e2e::Node;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

struct Args {
    work: PathBuf,
    nodes: usize,
    disks: usize,
    mds: usize,
    group: String,
    id_prefix: String,
    first: usize,
    weights: Vec<u32>,
    metrics: bool,
    env: Vec<(String, String)>,
    wait_arena: bool,
    bin_dir: Option<PathBuf>,
    node_flags: Vec<String>,
}

const USAGE: &str = "usage: kv-local --work DIR [--nodes N] [--disks N] [--mds N] [--group NAME] \
[--id-prefix P] [--first N] [--weights W,...] [--metrics] [--env K=V]... [--wait-arena] [--bin-dir DIR] [-- NODE_FLAGS...]";

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        work: PathBuf::new(),
        nodes: 3,
        disks: 1,
        mds: 2,
        group: "local".into(),
        id_prefix: "n".into(),
        first: 1,
        weights: Vec::new(),
        metrics: false,
        env: Vec::new(),
        wait_arena: false,
        bin_dir: None,
        node_flags: Vec::new(),
    };
    let num = |v: Option<String>, what: &str| -> Result<usize, String> {
        v.and_then(|v| v.parse().ok()).ok_or_else(|| format!("{what} needs a number"))
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--work" => a.work = it.next().ok_or("--work needs a dir")?.into(),
            "--nodes" => a.nodes = num(it.next(), "--nodes")?,
            "--disks" => a.disks = num(it.next(), "--disks")?.max(1),
            "--mds" => a.mds = num(it.next(), "--mds")?,
            "--group" => a.group = it.next().ok_or("--group needs a name")?,
            "--id-prefix" => a.id_prefix = it.next().ok_or("--id-prefix needs a prefix")?,
            "--first" => a.first = num(it.next(), "--first")?,
            "--weights" => {
                let v = it.next().ok_or("--weights needs W,W,...")?;
                a.weights = v
                    .split(',')
                    .map(|w| w.parse().map_err(|_| format!("--weights: {w:?}")))
                    .collect::<Result<_, _>>()?;
            }
            "--metrics" => a.metrics = true,
            "--env" => {
                let kv = it.next().ok_or("--env needs K=V")?;
                let (k, v) = kv.split_once('=').ok_or_else(|| format!("--env: {kv:?} is not K=V"))?;
                a.env.push((k.into(), v.into()));
            }
            "--wait-arena" => a.wait_arena = true,
            "--bin-dir" => a.bin_dir = Some(it.next().ok_or("--bin-dir needs a dir")?.into()),
            "--" => a.node_flags.extend(it.by_ref()),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            f => return Err(format!("unknown flag {f:?}\n{USAGE}")),
        }
    }
    if a.work.as_os_str().is_empty() {
        return Err(format!("--work is required\n{USAGE}"));
    }
    Ok(a)
}

/// A workspace binary: from `--bin-dir` when given, else beside kv-local.
fn binary(args: &Args, name: &str) -> String {
    match &args.bin_dir {
        Some(d) => d.join(name).to_string_lossy().into_owned(),
        None => name.to_string(),
    }
}

fn main() {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    // A part that does not come up ends the run with one line saying why
    // (what was started is killed and reaped as it is dropped).
    std::panic::set_hook(Box::new(|info| {
        let why = kv_common::cli::panic_message(info);
        eprintln!("kv-local: {}", if why.is_empty() { "a part did not start" } else { why });
    }));
    // SAFETY: installs an async-signal-safe handler (one atomic store) for
    // SIGTERM and SIGINT; children get the default action back at exec.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    std::fs::create_dir_all(&args.work).unwrap_or_else(|e| panic!("--work {}: {e}", args.work.display()));
    // A stop asked for while starting ends the start at the next step (what
    // was started is then killed and reaped as it is dropped).
    let (etcd, replicas) = membership(&args);
    let nodes = if stopping() { Vec::new() } else { start_nodes(&args, &replicas) };
    if !stopping() {
        let members: Vec<String> = nodes.iter().map(|(id, n, _)| format!("{id}={}", n.addr)).collect();
        println!("members {}", members.join(","));
        if args.wait_arena {
            for (id, _, _) in &nodes {
                wait_arena(&log_path(&args.work, id), id);
            }
        }
        println!("ready");
    }
    while !stopping() {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Nodes first, all at once (they leave the group and drain), then
    // kv-mds, then etcd.
    for (_, n, _) in &nodes {
        n.signal(libc::SIGTERM);
    }
    for (_, n, _) in nodes {
        let _ = n.wait_exit(Duration::from_secs(60));
    }
    drop(replicas);
    drop(etcd);
}

fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// `DIR/<part>.log`, emptied: a reused work dir's old lines would read as
/// this run's.
fn log_path(work: &Path, part: &str) -> PathBuf {
    work.join(format!("{part}.log"))
}

fn fresh_log(work: &Path, part: &str) -> PathBuf {
    let p = log_path(work, part);
    let _ = std::fs::remove_file(&p);
    p
}

/// etcd and the kv-mds replicas (none with `--mds 0`).
fn membership(args: &Args) -> (Option<Etcd>, Vec<Mds>) {
    if args.mds == 0 {
        return (None, Vec::new());
    }
    let dir = args.work.join("etcd");
    let _ = std::fs::remove_dir_all(dir.join("etcd"));
    let etcd = Etcd::start(dir);
    println!("etcd {}", etcd.endpoint());
    let replicas: Vec<Mds> = (0..args.mds)
        .take_while(|_| !stopping())
        .map(|i| {
            let log = fresh_log(&args.work, &format!("mds-{}", i + 1));
            Mds::start_logged(&binary(args, "kv-mds"), &etcd.endpoint(), "10s", &log)
        })
        .collect();
    println!("mds {}", replicas.iter().map(|m| m.addr.as_str()).collect::<Vec<_>>().join(","));
    (Some(etcd), replicas)
}

/// The nodes: (id, node, metrics address).
fn start_nodes(args: &Args, replicas: &[Mds]) -> Vec<(String, Node, Option<String>)> {
    let eps = replicas.iter().map(|m| m.addr.as_str()).collect::<Vec<_>>().join(",");
    let mut out = Vec::new();
    for i in 0..args.nodes {
        if stopping() {
            return out;
        }
        let id = format!("{}{}", args.id_prefix, i + args.first);
        let dirs: Vec<String> = (0..args.disks)
            .map(|d| args.work.join(&id).join(format!("disk{d}")).to_string_lossy().into_owned())
            .collect();
        let dirs = dirs.join(",");
        let mut flags: Vec<String> = vec!["--dir".into(), dirs];
        let metrics = args.metrics.then(|| format!("127.0.0.1:{}", free_port()));
        if let Some(m) = &metrics {
            flags.extend(["--metrics-listen".into(), m.clone()]);
        }
        if args.mds > 0 {
            let weight = args.weights.get(i).copied().unwrap_or(1);
            flags.extend([
                "--mds".into(),
                eps.clone(),
                "--group".into(),
                args.group.clone(),
                "--id".into(),
                id.clone(),
            ]);
            flags.extend(["--advertise".into(), "127.0.0.1:0".into(), "--weight".into(), weight.to_string()]);
        }
        flags.extend(args.node_flags.iter().cloned());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let node = Node::start_logged(&binary(args, "kv-server"), &flags, &args.env, &fresh_log(&args.work, &id));
        println!(
            "node {id} {} pid={}{}",
            node.addr,
            node.pid(),
            metrics.as_ref().map(|m| format!(" metrics={m}")).unwrap_or_default()
        );
        out.push((id, node, metrics));
    }
    if !replicas.is_empty() && !stopping() {
        wait_for_group(&eps, &args.group, args.nodes);
    }
    out
}

/// Waits (up to 30 s) until the group's view lists `n` members.
fn wait_for_group(eps: &str, group: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut c = kv_common::mds::MdsClient::from_csv(eps, Duration::from_secs(2)).expect("kv-mds addresses");
        if stopping() || c.view(group).is_ok_and(|v| v.members.len() == n) {
            return;
        }
        assert!(Instant::now() < deadline, "the group {group} did not list {n} members within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (up to 60 s) for the node's log line saying its memory tier is
/// faulted in (a node's first seconds are not its steady state); past that
/// it says so and goes on.
fn wait_arena(log: &Path, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stopping() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("memory arena faulted in")) {
            let ms = line.split_whitespace().find_map(|w| w.strip_prefix("ms=")).unwrap_or("?");
            println!("node {id}: memory arena faulted in in {ms} ms");
            return;
        }
        if Instant::now() >= deadline {
            println!("node {id}: memory arena not faulted in within 60 s (going on; see {})", log.display());
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
