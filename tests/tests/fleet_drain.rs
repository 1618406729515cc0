//! A drain at fleet size (docs/ARCHITECTURE.md, "Draining"): 22 real nodes
//! of one small disk each, no memory tier, a real etcd and kv-mds. One
//! node drains and exits; its push must reach every owner of its pages
//! (not a few of them), name each in its log, never push to itself, and
//! leave its pages hits at their new owners once it is gone.
//!
//! Its own test binary: nothing else shares the machine's cores with these
//! 22 nodes while it runs.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::Node;
use kvclient::{BlockingClient, Conn, Options};

const NODES: usize = 22;
/// About 60 pages a node.
const PAGES: usize = NODES * 60;
const PAGE_LEN: usize = 16 << 10;

fn geo() -> Geometry {
    Geometry { model_hash: 38, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

fn key(i: usize) -> Vec<u8> {
    format!("fleet-drain-page-{i}").into_bytes()
}

fn page(i: usize) -> Vec<u8> {
    (0..PAGE_LEN).map(|j| (i * 131 + j * 7 + j / 251) as u8).collect()
}

fn id(i: usize) -> String {
    format!("n{i:02}")
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

/// `key=value` of a log line (tracing's text format).
fn field<'l>(line: &'l str, name: &str) -> Option<&'l str> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..].split_whitespace().next()
}

#[test]
fn a_drained_node_of_a_22_node_group_leaves_every_page_a_hit_at_its_new_owner() {
    let t = tempfile::tempdir().expect("tempdir");
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--handoff-secs", "600"]);
    let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
    for i in 1..=NODES {
        let d = t.path().join(id(i));
        let args = ["--no-sync", "--log-level", "info", "--cap", "32M", "--drain-secs", "8"];
        let n = Node::member("kv-server", "127.0.0.1:0", d.to_str().expect("utf-8"), &mds.addr, "g", &id(i), &args);
        nodes.insert(id(i), n);
    }
    let c = client(&mds.addr, "");
    routes_to(&c, NODES);
    for i in 0..PAGES {
        assert_eq!(c.putv(&key(i), &[&page(i)]), Status::Ok, "put {i}");
    }
    // The node holding the most pages drains.
    let mut held: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for i in 0..PAGES {
        held.entry(owner(&c, &key(i))).or_default().push(i);
    }
    let (victim, mine) = held.iter().max_by_key(|(_, v)| v.len()).map(|(k, v)| (k.clone(), v.clone())).expect("pages");
    let node = nodes.remove(&victim).expect("victim");
    let addr = node.addr.clone();
    node.signal(libc::SIGTERM);
    routes_to(&c, NODES - 1);
    // Where its pages belong now, by the group without it.
    let want: BTreeSet<String> = mine.iter().map(|&i| owner(&c, &key(i))).collect();
    assert!(!want.contains(&victim));
    // Nobody reads meanwhile; the node pushes, then exits at its drain's end.
    let st = wait_until(Duration::from_secs(30), "the push to end", || {
        let s = Conn::connect(&addr, Duration::from_secs(1)).ok()?.stats().ok()?;
        (s.drain_pushed + s.drain_push_failed + s.drain_push_owner_failed >= mine.len() as u64).then_some(s)
    });
    assert_eq!(st.drain_pushed, mine.len() as u64, "every page pushed: {st:?}");
    assert_eq!((st.drain_push_failed, st.drain_push_owner_failed, st.drain_push_left), (0, 0, 0));
    assert_eq!(st.drain_push_owners, want.len() as u64, "owners with pages");
    let (status, lines) = node.wait_exit_lines(Duration::from_secs(30));
    assert!(status.success(), "clean exit after the drain: {status:?}");
    // Its log names every owner it pushed to, each once, never itself.
    let mut named: BTreeMap<String, u64> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.contains("drain: pushed to owner")) {
        let o = field(l, "owner").expect("owner field").to_string();
        let pushed: u64 = field(l, "pushed").and_then(|v| v.parse().ok()).expect("pushed field");
        assert!(named.insert(o, pushed).is_none(), "one line per owner: {l}");
    }
    assert!(!named.contains_key(&victim), "never pushed to itself");
    assert_eq!(named.keys().cloned().collect::<BTreeSet<_>>(), want, "the push log names every new owner");
    assert_eq!(named.values().sum::<u64>(), mine.len() as u64);
    let total = lines.iter().find(|l| l.contains("drain push:")).expect("the push's closing line");
    assert!(
        total.contains(&format!("{} of {} pages pushed to {} owners", mine.len(), mine.len(), want.len())),
        "{total}"
    );
    assert!(total.contains("0 left"), "{total}");
    // Gone: its pages are hits at their new owners (no handoff asks), and
    // every other page too, each with its own bytes.
    let off = client(&mds.addr, "handoff_ms=0");
    routes_to(&off, NODES - 1);
    let mut buf = vec![0u8; PAGE_LEN];
    let mut missed = Vec::new();
    for i in 0..PAGES {
        match off.getv(&key(i), &mut [&mut buf[..]]) {
            Ok(n) => assert_eq!(&buf[..n], &page(i)[..], "page {i} served with other bytes"),
            Err(_) => missed.push(i),
        }
    }
    let lost: Vec<usize> = missed.iter().copied().filter(|i| mine.contains(i)).collect();
    // At least 99 % of its pages; with owners far from full, all of them.
    assert!(lost.len() * 100 <= mine.len(), "{} of its {} pages missed: {lost:?}", lost.len(), mine.len());
    assert_eq!(missed, lost, "pages of other nodes missed");
    assert!(lost.is_empty(), "owners at a fraction of their caps keep every pushed page: {lost:?}");
    drop(etcd);
}
