//! A drain at fleet size, measured (docs/ARCHITECTURE.md, "Draining"): a
//! real etcd and kv-mds, `nodes` real nodes of one small disk each and no
//! memory tier; pages written through a client that follows the group;
//! the node holding the most pages stopped with SIGTERM; once it exited,
//! its pages read at their new owners with the handoff off. Shared by the
//! CI test (tests/tests/fleet_drain.rs, which asserts) and `kv-fleet-drain`
//! (scripts/bench-fleet.sh, which prints, also for another release's
//! kv-server).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kvclient::{BlockingClient, Conn, Options};

use crate::cluster::{wait_until, Etcd, Mds};
use crate::Node;

/// What the drain did.
#[derive(Debug, Default)]
pub struct DrainFigures {
    pub nodes: usize,
    pub pages: usize,
    /// The drained node's id, and its pages (indices).
    pub drained: String,
    pub held: Vec<usize>,
    /// The owners of its pages in the group without it.
    pub owners: BTreeSet<String>,
    /// Its stats once the push ended (or the drain did).
    pub stats: kv_common::stats::NodeStats,
    /// Owners its log names with their pushed pages (`drain: pushed to owner`).
    pub named: BTreeMap<String, u64>,
    /// Its closing push line, if it wrote one.
    pub closing: Option<String>,
    pub clean_exit: bool,
    /// After it exited: its pages that missed at their new owners, and
    /// other pages that missed; pages served with other bytes.
    pub lost: Vec<usize>,
    pub other_misses: Vec<usize>,
    pub wrong: usize,
    /// Pages the owners evicted (summed over the nodes left).
    pub evictions: u64,
}

fn geo() -> Geometry {
    Geometry { model_hash: 38, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

fn key(i: usize) -> Vec<u8> {
    format!("fleet-drain-page-{i}").into_bytes()
}

fn page(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 131 + j * 7 + j / 251) as u8).collect()
}

fn client(mds: &str, opts: &str) -> BlockingClient {
    let base = "io_timeout_ms=3000,connect_timeout_ms=500,handoff_timeout_ms=400";
    let o = Options::parse(&format!("{base},{opts}")).expect("options");
    let c = BlockingClient::new(Vec::new(), geo(), o).expect("client");
    let first = c.start_discovery(vec![mds.to_string()], "g".into(), Duration::from_millis(500));
    assert!(first.expect("discovery thread").is_ok());
    c
}

fn routes_to(c: &BlockingClient, n: usize) {
    wait_until(Duration::from_secs(60), &format!("the client to route to {n} nodes"), || {
        (c.core.topology().nodes.len() == n).then_some(())
    });
}

fn owner(c: &BlockingClient, k: &[u8]) -> String {
    let t = c.core.topology();
    t.nodes[t.ring.owner(k).expect("members")].id.clone()
}

/// Whether the child `pid` exited (a zombie not yet reaped counts).
fn exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(s) => s.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(_) => true,
    }
}

/// `key=value` of a log line (tracing's text format).
pub fn field<'l>(line: &'l str, name: &str) -> Option<&'l str> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..].split_whitespace().next()
}

/// Runs the drain: `nodes` nodes of `server` (a workspace name or a path),
/// `per_node` pages of `page_len` bytes a node on average, a drain of
/// `drain_secs`.
pub fn drain_at_scale(server: &str, nodes: usize, per_node: usize, page_len: usize, drain_secs: u32) -> DrainFigures {
    let t = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--handoff-secs", "600"]);
    let id = |i: usize| format!("n{i:02}");
    let drain = drain_secs.to_string();
    let mut started: BTreeMap<String, Node> = BTreeMap::new();
    for i in 1..=nodes {
        let d = t.path().join(id(i));
        let args = ["--no-sync", "--log-level", "info", "--cap", "32M", "--drain-secs", &drain];
        let n = Node::member(server, "127.0.0.1:0", d.to_str().expect("utf-8"), &mds.addr, "g", &id(i), &args);
        started.insert(id(i), n);
    }
    let pages = nodes * per_node;
    let c = client(&mds.addr, "");
    routes_to(&c, nodes);
    for i in 0..pages {
        assert_eq!(c.putv(&key(i), &[&page(i, page_len)]), Status::Ok, "put {i}");
    }
    let mut by_owner: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for i in 0..pages {
        by_owner.entry(owner(&c, &key(i))).or_default().push(i);
    }
    let (drained, held) =
        by_owner.iter().max_by_key(|(_, v)| v.len()).map(|(k, v)| (k.clone(), v.clone())).expect("pages");
    let node = started.remove(&drained).expect("drained node");
    let (addr, pid) = (node.addr.clone(), node.pid());
    node.signal(libc::SIGTERM);
    // The group without it (not merely one member fewer: another node
    // missing a heartbeat on a busy machine must not pass for it).
    wait_until(Duration::from_secs(60), "the client to drop the drained node", || {
        let t = c.core.topology();
        (t.nodes.len() == nodes - 1 && t.nodes.iter().all(|n| n.id != drained)).then_some(())
    });
    let owners: BTreeSet<String> = held.iter().map(|&i| owner(&c, &key(i))).collect();
    // Nobody reads meanwhile: the push ends (every page settled) or the drain does.
    let mut stats = kv_common::stats::NodeStats::default();
    wait_until(Duration::from_secs(u64::from(drain_secs) + 30), "the push to end", || {
        let Some(s) = Conn::connect(&addr, Duration::from_secs(2)).ok().and_then(|mut c| c.stats().ok()) else {
            // Gone once the process exited (the drain ended); a node too
            // busy to answer in time is asked again.
            return exited(pid).then_some(());
        };
        let settled = s.drain_pushed + s.drain_push_failed + s.drain_push_owner_failed >= held.len() as u64;
        stats = s;
        settled.then_some(())
    });
    let (status, lines) = node.wait_exit_lines(Duration::from_secs(u64::from(drain_secs) + 30));
    let mut named = BTreeMap::new();
    for l in lines.iter().filter(|l| l.contains("drain: pushed to owner")) {
        if let (Some(o), Some(p)) = (field(l, "owner"), field(l, "pushed").and_then(|v| v.parse::<u64>().ok())) {
            *named.entry(o.to_string()).or_insert(0) += p;
        }
    }
    let closing = lines.iter().find(|l| l.contains("drain push:") || l.contains("drain: pages pushed")).cloned();
    let off = client(&mds.addr, "handoff_ms=0");
    routes_to(&off, nodes - 1);
    let mut buf = vec![0u8; page_len];
    let (mut lost, mut other_misses, mut wrong) = (Vec::new(), Vec::new(), 0);
    let mine: BTreeSet<usize> = held.iter().copied().collect();
    for i in 0..pages {
        match off.getv(&key(i), &mut [&mut buf[..]]) {
            Ok(n) if buf[..n] == page(i, page_len)[..] => {}
            Ok(_) => wrong += 1,
            Err(_) if mine.contains(&i) => lost.push(i),
            Err(_) => other_misses.push(i),
        }
    }
    let evictions = started
        .values()
        .filter_map(|n| Conn::connect(&n.addr, Duration::from_secs(2)).ok().and_then(|mut c| c.stats().ok()))
        .map(|s| s.evictions)
        .sum();
    drop(started);
    drop(mds);
    drop(etcd);
    DrainFigures {
        nodes,
        pages,
        drained,
        held,
        owners,
        stats,
        named,
        closing,
        clean_exit: status.success(),
        lost,
        other_misses,
        wrong,
        evictions,
    }
}
