//! Ring handoff end to end (docs/ARCHITECTURE.md, "Ring transitions"): a
//! real etcd, kv-mds with a handoff window, real nodes, and clients that
//! follow the group. After a join, two joins, a graceful stop or a restart
//! every page written before is still a hit; deletes stay deleted; a dead
//! previous owner costs one short timeout; handoff off is the old behaviour.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_common::mds::MdsClient;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_common::wire::{Op, FLAG_HANDOFF};
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::Node;
use kvclient::{BlockingClient, Conn, Options};

/// One cluster at a time: each runs etcd, kv-mds and several nodes on a
/// 3 s lease.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const PAGES: usize = 240;

fn geo() -> Geometry {
    Geometry { model_hash: 11, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

fn key(i: usize) -> Vec<u8> {
    format!("handoff-page-{i}").into_bytes()
}

fn page(i: usize) -> Vec<u8> {
    (0..8192).map(|j| (i * 131 + j * 7) as u8).collect()
}

struct Group {
    t: tempfile::TempDir,
    _etcd: Etcd,
    mds: Mds,
}

impl Group {
    fn new(handoff_secs: &str) -> Group {
        let t = tempfile::tempdir().expect("tempdir");
        let etcd = Etcd::start(t.path().to_path_buf());
        let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--handoff-secs", handoff_secs]);
        Group { t, _etcd: etcd, mds }
    }

    fn node(&self, id: &str, extra: &[&str]) -> Node {
        let d = self.t.path().join(id);
        let mut args = vec!["--no-sync", "--log-level", "info"];
        args.extend_from_slice(extra);
        Node::member("kv-server", "127.0.0.1:0", d.to_str().unwrap(), &self.mds.addr, "g", id, &args)
    }

    /// A node on a given listen address (a restart keeps its address).
    fn node_at(&self, listen: &str, id: &str) -> Node {
        let d = self.t.path().join(id);
        Node::member("kv-server", listen, d.to_str().unwrap(), &self.mds.addr, "g", id, &["--no-sync"])
    }

    fn client(&self, opts: &str) -> BlockingClient {
        self.client_geo(opts, geo())
    }

    fn client_geo(&self, opts: &str, g: Geometry) -> BlockingClient {
        let base = "io_timeout_ms=3000,connect_timeout_ms=500,handoff_timeout_ms=400";
        let o = Options::parse(&format!("{base},{opts}")).unwrap();
        let c = BlockingClient::new(Vec::new(), g, o).expect("client");
        let first = c.start_discovery(vec![self.mds.addr.clone()], "g".into(), Duration::from_millis(500));
        assert!(first.expect("discovery thread").is_ok());
        c
    }

    fn await_ids(&self, c: &BlockingClient, ids: &[&str]) {
        wait_until(Duration::from_secs(20), &format!("the client to route to {ids:?}"), || {
            let mut now: Vec<String> = c.core.topology().nodes.iter().map(|n| n.id.clone()).collect();
            now.sort();
            now.iter().map(String::as_str).eq(ids.iter().copied()).then_some(())
        });
    }
}

/// Nodes n1 and n2, every page written through a client that follows the
/// group, then n3 joins: (n1 and n2, that client, n3).
fn written_then_n3_joins(g: &Group) -> (Vec<Node>, BlockingClient, Node) {
    let old = vec![g.node("n1", &[]), g.node("n2", &[])];
    let c = g.client("");
    g.await_ids(&c, &["n1", "n2"]);
    write_all(&c);
    let n3 = g.node("n3", &[]);
    g.await_ids(&c, &["n1", "n2", "n3"]);
    (old, c, n3)
}

fn write_all(c: &BlockingClient) {
    for i in 0..PAGES {
        assert_eq!(c.putv(&key(i), &[&page(i)]), Status::Ok, "put {i}");
    }
}

/// Every page: get (bytes compared), exist, and one batch exist; returns
/// the pages that were not hits.
fn misses(c: &BlockingClient) -> Vec<usize> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 8192];
    for i in 0..PAGES {
        match c.getv(&key(i), &mut [&mut buf[..]]) {
            Ok(n) => assert_eq!(&buf[..n], &page(i)[..], "page {i} served with other bytes"),
            Err(_) => out.push(i),
        }
    }
    let keys: Vec<Vec<u8>> = (0..PAGES).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    for (i, s) in c.batch_exist(&refs).into_iter().enumerate() {
        if s != Status::Ok && !out.contains(&i) {
            out.push(i);
        }
    }
    for i in 0..PAGES {
        if c.exist(&key(i)) != Status::Ok && !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

/// Which pages each id owns in the client's current ring.
fn owner(c: &BlockingClient, i: usize) -> String {
    let t = c.core.topology();
    t.nodes[t.ring.owner(&key(i)).unwrap()].id.clone()
}

fn node_stats(addr: &str) -> kv_common::stats::NodeStats {
    Conn::connect(addr, Duration::from_secs(2)).unwrap().stats().unwrap()
}

#[test]
fn after_a_join_every_page_still_hits_and_moves_to_its_new_owner() {
    let _s = serial();
    let g = Group::new("120");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    let _n3 = g.node("n3", &[]);
    let c = g.client("");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    write_all(&c);
    let n4 = g.node("n4", &[]);
    g.await_ids(&c, &["n1", "n2", "n3", "n4"]);
    let moved: Vec<usize> = (0..PAGES).filter(|&i| owner(&c, i) == "n4").collect();
    assert!(moved.len() > PAGES / 8, "about a quarter of the pages move to n4: {}", moved.len());
    // The view carries the previous set; the client holds it.
    let v = MdsClient::new(vec![g.mds.addr.clone()], Duration::from_secs(2)).view("g").unwrap();
    // Newest first (the group's bring-up left earlier sets too).
    assert!(!v.previous.is_empty(), "{v:?}");
    assert_eq!(v.previous[0].joined, ["n4"]);
    assert!(v.previous[0].left.is_empty());
    assert!(v.previous[0].remaining_ms > 100_000 && v.handoff_ms == Some(120_000), "{v:?}");
    assert!(!c.core.topology().previous.is_empty());

    assert_eq!(misses(&c), Vec::<usize>::new(), "every page written before the join is a hit");
    let h = &c.core.metrics.handoff;
    // The gets found each moved page at its previous owner (the exists may
    // already find the background copies at n4).
    assert!(h.hits.load(Ordering::Relaxed) >= moved.len() as u64);
    // The gets copied the moved pages to n4 in the background.
    wait_until(Duration::from_secs(10), "the background copies", || {
        (h.copies_stored.load(Ordering::Relaxed) >= moved.len() as u64).then_some(())
    });
    let mut direct = Conn::connect(&n4.addr, Duration::from_secs(2)).unwrap();
    for &i in &moved {
        assert_eq!(direct.exist(Some(&geo()), &key(i)).unwrap(), Status::Ok, "page {i} at its new owner");
    }
    let st = node_stats(&n4.addr);
    assert_eq!(st.handoff_copies, moved.len() as u64);
    assert_eq!(st.handoff_too_old, 0, "fresh copies carry a young age");
    // Found at the new owner now: a client without handoff hits them all.
    let off = g.client("handoff_ms=0");
    g.await_ids(&off, &["n1", "n2", "n3", "n4"]);
    assert!(off.core.topology().previous.is_empty());
    assert_eq!(misses(&off), Vec::<usize>::new());
    let snap = c.stats_text();
    assert!(snap.contains("kvclient_handoff_copies_total{result=\"stored\"}"), "{snap}");
    assert!(snap.contains("kvclient_handoff_copies_expired_total 0"), "{snap}");
}

#[test]
fn a_batch_get_across_a_join_finds_every_page_through_batch_frames() {
    let _s = serial();
    let g = Group::new("120");
    let (old, c, n3) = written_then_n3_joins(&g);
    let moved: Vec<usize> = (0..PAGES).filter(|&i| owner(&c, i) == "n3").collect();
    assert!(!moved.is_empty());
    let asks_before: u64 = old.iter().map(|n| node_stats(&n.addr).handoff_asks).sum();
    // One batch of every page: the moved ones miss at n3 and are asked, as
    // one BATCH_GET frame with FLAG_HANDOFF a lane, at their previous owners.
    let keys: Vec<Vec<u8>> = (0..PAGES).map(key).collect();
    let mut bufs: Vec<Vec<u8>> = (0..PAGES).map(|_| vec![0u8; 8192]).collect();
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (&k[..], vec![&mut b[..]])).collect();
    let res = c.batch_getv(&mut items);
    drop(items);
    for (i, (s, n)) in res.iter().enumerate() {
        assert_eq!(*s, Status::Ok, "page {i} in the batch (moved: {})", moved.contains(&i));
        assert_eq!(&bufs[i][..*n], &page(i)[..], "page {i} bytes");
    }
    let asks: u64 = old.iter().map(|n| node_stats(&n.addr).handoff_asks).sum::<u64>() - asks_before;
    assert_eq!(asks, moved.len() as u64, "each moved page asked once, at its previous owner");
    let frames = |addr: &str, op: &str| node_stats(addr).latency.iter().find(|l| l.op == op).map_or(0, |l| l.count);
    assert!(frames(&n3.addr, "batch_get") > 0, "n3 was asked by batch frames");
    assert!(old.iter().all(|n| frames(&n.addr, "get") == 0), "no single GET reached the previous owners");
}

#[test]
fn two_joins_inside_one_window_lose_no_hit() {
    let _s = serial();
    let g = Group::new("120");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    let c = g.client("");
    g.await_ids(&c, &["n1", "n2"]);
    write_all(&c);
    let _n3 = g.node("n3", &[]);
    g.await_ids(&c, &["n1", "n2", "n3"]);
    let _n4 = g.node("n4", &[]);
    g.await_ids(&c, &["n1", "n2", "n3", "n4"]);
    assert!(c.core.topology().previous.len() >= 2);
    // A fresh client learns both previous sets from the view alone.
    let fresh = g.client("");
    g.await_ids(&fresh, &["n1", "n2", "n3", "n4"]);
    let epochs = |c: &BlockingClient| c.core.topology().previous.iter().map(|p| p.epoch).collect::<Vec<_>>();
    assert!(epochs(&fresh).len() >= 2);
    assert_eq!(epochs(&fresh)[..2], epochs(&c)[..2], "the same two sets, newest first");
    // Pages that moved n1/n2 -> n3 -> n4 are found two sets back.
    assert_eq!(misses(&fresh), Vec::<usize>::new());
    assert_eq!(misses(&c), Vec::<usize>::new());
}

#[test]
fn a_graceful_stop_inside_its_drain_loses_no_hit_and_a_restart_gets_its_keys_back() {
    let _s = serial();
    let g = Group::new("120");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    // The pull path alone: the push is tested on its own below.
    let n3 = g.node("n3", &["--drain-secs", "30", "--no-drain-push"]);
    let c = g.client("");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    write_all(&c);
    let on_n3: Vec<usize> = (0..PAGES).filter(|&i| owner(&c, i) == "n3").collect();
    let addr = n3.addr.clone();
    n3.signal(libc::SIGTERM);
    g.await_ids(&c, &["n1", "n2"]);
    // Draining: it refuses puts, serves gets.
    let st = node_stats(&addr);
    assert!(st.draining, "the node says it drains");
    let mut direct = Conn::connect(&addr, Duration::from_secs(2)).unwrap();
    assert!(direct.put(&geo(), b"new-during-drain", b"x").is_err(), "a draining node takes no put");
    assert_eq!(misses(&c), Vec::<usize>::new(), "the stopped node's pages are read through the handoff");
    assert!(c.core.metrics.handoff.hits.load(Ordering::Relaxed) >= on_n3.len() as u64);
    // The drain ends with a second signal; the node comes back under the
    // same id and address and owns its keys again (its disk kept them).
    let status = n3.terminate(Duration::from_secs(20));
    assert!(status.success(), "clean exit after the drain: {status:?}");
    let _n3 = g.node_at(&addr, "n3");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    assert_eq!(misses(&c), Vec::<usize>::new());
}

#[test]
fn a_draining_node_pushes_its_pages_to_their_new_owners() {
    let _s = serial();
    let g = Group::new("120");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    let n3 = g.node("n3", &["--drain-secs", "4"]);
    let c = g.client("");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    write_all(&c);
    let on_n3 = (0..PAGES).filter(|&i| owner(&c, i) == "n3").count() as u64;
    let addr = n3.addr.clone();
    n3.signal(libc::SIGTERM);
    g.await_ids(&c, &["n1", "n2"]);
    // Nobody reads during the drain; the node pushes, then exits by itself.
    let st = wait_until(Duration::from_secs(10), "the push", || {
        Conn::connect(&addr, Duration::from_secs(1)).ok()?.stats().ok().filter(|s| s.drain_pushed == on_n3)
    });
    assert_eq!(st.drain_push_failed, 0);
    assert!(n3.wait_exit(Duration::from_secs(20)).success());
    // The node is gone; every page is at its new owner.
    let off = g.client("handoff_ms=0");
    g.await_ids(&off, &["n1", "n2"]);
    assert_eq!(misses(&off), Vec::<usize>::new(), "the pushed pages are hits at their new owners");
}

#[test]
fn a_dead_previous_owner_costs_one_short_timeout_then_fast_misses_and_no_cool_down() {
    let _s = serial();
    let g = Group::new("120");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    let n3 = g.node("n3", &[]);
    let c = g.client("handoff_timeout_ms=300");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    // Pages written now land on n1..n3; new pages (never written) miss.
    let _n4 = g.node("n4", &[]);
    g.await_ids(&c, &["n1", "n2", "n3", "n4"]);
    // Keys n4 owns now whose previous owner was n3: asked at n3.
    let asked_at_n3: Vec<usize> = (0..4000)
        .filter(|&i| owner(&c, i) == "n4")
        .filter(|&i| {
            let t = c.core.topology();
            let p = &t.previous[0];
            p.nodes[p.ring.owner(&key(i)).unwrap()].id == "n3"
        })
        .take(20)
        .collect();
    assert!(asked_at_n3.len() >= 10);
    // n3 stops answering (SIGSTOP: connections hang, the worst case).
    n3.signal(libc::SIGSTOP);
    let mut buf = vec![0u8; 8192];
    let t0 = Instant::now();
    assert_eq!(c.getv(&key(asked_at_n3[0]), &mut [&mut buf[..]]).unwrap_err().0, Status::Miss);
    let first = t0.elapsed();
    assert!(first < Duration::from_millis(1500), "one handoff timeout at most: {first:?}");
    let t1 = Instant::now();
    for &i in &asked_at_n3[1..] {
        assert_eq!(c.getv(&key(i), &mut [&mut buf[..]]).unwrap_err().0, Status::Miss);
        assert_eq!(c.exist(&key(i)), Status::Miss);
    }
    let rest = t1.elapsed();
    assert!(rest < Duration::from_millis(1500), "then fast misses: {rest:?} for {}", asked_at_n3.len() - 1);
    assert_eq!(c.core.metrics.handoff.failures.load(Ordering::Relaxed), 1, "n3 skipped after one failure");
    let t = c.core.topology();
    let n3_node = t.nodes.iter().find(|n| n.id == "n3").unwrap();
    assert!(!n3_node.cooling(), "a failed handoff ask starts no cool-down for n3's own keys");
    n3.signal(libc::SIGCONT);
    // kill -9: refused connections, the same: a miss, no cool-down.
    n3.kill9();
    let k = (0..4000)
        .find(|&i| {
            owner(&c, i) == "n1" && {
                let p = &t.previous[0];
                p.nodes[p.ring.owner(&key(i)).unwrap()].id == "n1"
            }
        })
        .unwrap();
    assert_eq!(c.putv(&key(k), &[&page(k)]), Status::Ok, "n1 serves its own keys");
}

#[test]
fn handoff_off_is_the_old_behaviour() {
    let _s = serial();
    let g = Group::new("0");
    let _n1 = g.node("n1", &[]);
    let _n2 = g.node("n2", &[]);
    let _n3 = g.node("n3", &[]);
    let c = g.client("");
    let off = g.client("handoff_ms=0");
    g.await_ids(&c, &["n1", "n2", "n3"]);
    write_all(&c);
    let _n4 = g.node("n4", &[]);
    g.await_ids(&c, &["n1", "n2", "n3", "n4"]);
    g.await_ids(&off, &["n1", "n2", "n3", "n4"]);
    let moved: Vec<usize> = (0..PAGES).filter(|&i| owner(&c, i) == "n4").collect();
    // kv-mds --handoff-secs 0 turns it off for its clients, and so does
    // the client option.
    let v = MdsClient::new(vec![g.mds.addr.clone()], Duration::from_secs(2)).view("g").unwrap();
    assert!(v.previous.is_empty() && v.handoff_ms == Some(0), "{v:?}");
    assert!(c.core.topology().previous.is_empty());
    let mut m = misses(&c);
    m.sort();
    assert_eq!(m, moved, "exactly the moved pages miss");
    let mut m = misses(&off);
    m.sort();
    assert_eq!(m, moved);
    assert_eq!(c.core.metrics.handoff.asks.load(Ordering::Relaxed), 0);
}

#[test]
fn a_page_of_another_geometry_at_a_previous_owner_is_a_mismatch_never_served() {
    let _s = serial();
    let g = Group::new("120");
    let (_old, c, _n3) = written_then_n3_joins(&g);
    let other = Geometry { model_hash: 12, ..geo() };
    let o = g.client_geo("", other);
    g.await_ids(&o, &["n1", "n2", "n3"]);
    let i = (0..PAGES).find(|&i| owner(&c, i) == "n3").unwrap();
    let mut buf = vec![0xAAu8; 8192];
    assert_eq!(o.getv(&key(i), &mut [&mut buf[..]]).unwrap_err().0, Status::Mismatch);
    assert!(buf.iter().all(|&b| b == 0xAA), "nothing written into the caller's buffer");
    assert_eq!(o.exist(&key(i)), Status::Mismatch);
    assert_eq!(o.core.metrics.handoff.copies_stored.load(Ordering::Relaxed), 0);
}

#[test]
fn a_page_deleted_after_a_join_stays_deleted_also_with_a_copy_in_flight() {
    let _s = serial();
    let g = Group::new("120");
    let (_old, c, n3) = written_then_n3_joins(&g);
    let moved: Vec<usize> = (0..PAGES).filter(|&i| owner(&c, i) == "n3").collect();
    let mut buf = vec![0u8; 8192];
    // A get starts a background copy; the delete follows at once.
    for &i in &moved {
        assert!(c.getv(&key(i), &mut [&mut buf[..]]).is_ok());
        assert_eq!(c.delete(&key(i)), Status::Ok, "deleted at the previous owner");
    }
    let h = &c.core.metrics.handoff;
    wait_until(Duration::from_secs(10), "the copies to settle", || {
        (h.inflight_bytes.load(Ordering::Relaxed) == 0).then_some(())
    });
    for &i in &moved {
        assert_eq!(c.exist(&key(i)), Status::Miss, "page {i} stays deleted");
        assert!(c.getv(&key(i), &mut [&mut buf[..]]).is_err());
    }
    // A handoff copy of a deleted key is refused by the node.
    let mut direct = Conn::connect(&n3.addr, Duration::from_secs(2)).unwrap();
    let k = key(moved[0]);
    let p = page(moved[0]);
    let header = kv_common::page::PageHeader::new(geo(), &k, p.len() as u64, crc32fast::hash(&p)).encode();
    direct.send(Op::Put, FLAG_HANDOFF, &[&header, &k, &p]).unwrap();
    let r = direct.recv().unwrap();
    assert_eq!(r.header.status, Status::Rejected, "{}", String::from_utf8_lossy(&r.body));
    let st = node_stats(&n3.addr);
    assert!(st.handoff_refused >= 1 && st.tombstones >= moved.len() as u64, "{st:?}");
    // A key never deleted: its copy is stored.
    let k2 = b"never-deleted".to_vec();
    let header = kv_common::page::PageHeader::new(geo(), &k2, p.len() as u64, crc32fast::hash(&p)).encode();
    direct.send(Op::Put, FLAG_HANDOFF, &[&header, &k2, &p]).unwrap();
    assert_eq!(direct.recv().unwrap().header.status, Status::Ok);
}

#[test]
fn static_member_lists_hand_off_too() {
    let _s = serial();
    let t = tempfile::tempdir().unwrap();
    let nodes = Node::cluster(&t, 3, &["--no-sync"]);
    let members = |n: usize| Node::members(&nodes[..n]);
    let c = BlockingClient::new(
        kvclient::members::parse_members(&members(2)).unwrap(),
        geo(),
        Options::parse("io_timeout_ms=3000").unwrap(),
    )
    .unwrap();
    write_all(&c);
    c.set_members(kvclient::members::parse_members(&members(3)).unwrap());
    assert_eq!(c.core.topology().previous.len(), 1);
    assert_eq!(misses(&c), Vec::<usize>::new());
}

/// Without --mds there is no group to leave and no view to push by: the
/// node still drains (clients whose member lists drop it read its pages
/// through the handoff meanwhile), says so, and pushes nothing.
#[test]
fn a_node_without_mds_drains_without_a_group_or_a_push() {
    let _s = serial();
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("alone");
    let args = ["--dir", d.to_str().unwrap(), "--cap", "64M", "--no-sync", "--log-level", "info", "--drain-secs", "1"];
    let n = Node::start(&args);
    let c = BlockingClient::new(
        kvclient::members::parse_members(&format!("alone={}", n.addr)).unwrap(),
        geo(),
        Options::parse("io_timeout_ms=3000").unwrap(),
    )
    .unwrap();
    assert_eq!(c.putv(&key(0), &[&page(0)]), Status::Ok);
    let addr = n.addr.clone();
    n.signal(libc::SIGTERM);
    // Draining: still read, no longer written.
    wait_until(Duration::from_secs(10), "the drain", || node_stats(&addr).draining.then_some(()));
    let mut buf = vec![0u8; 8192];
    assert_eq!(c.getv(&key(0), &mut [&mut buf[..]]).ok(), Some(8192), "a draining node is still read");
    let (status, lines) = n.wait_exit_lines(Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
    let log = lines.join("\n");
    assert!(log.contains("no --mds: no group to leave, pages are not pushed"), "{log}");
    assert!(!log.contains("leaving the group"), "{log}");
    assert!(!log.contains("drain push"), "{log}");
    assert!(log.contains("drain over: shutting down"), "{log}");
}

#[test]
fn views_with_four_previous_sets_at_1000_members_stay_small() {
    let _s = serial();
    let t = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "120s", &["--handoff-secs", "120"]);
    // 1,000 members registered through the API (records only: nobody
    // dials them), from a few threads.
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for th in 0..8 {
            let addr = mds.addr.clone();
            s.spawn(move || {
                let mut m = MdsClient::new(vec![addr], Duration::from_secs(10));
                for i in (th..1000).step_by(8) {
                    let req = kv_common::mds::RegisterRequest {
                        addr: format!("gpu-node-{i:04}.cluster.example:7700"),
                        weight: 1 + (i % 3) as u32,
                        instance: String::new(),
                        metrics_addr: Some(format!("gpu-node-{i:04}.cluster.example:9700")),
                    };
                    // A slow etcd (a loaded machine) answers 503: a node
                    // registering retries, and so does this.
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        match m.register("big", &format!("gpu-node-{i:04}"), &req) {
                            Ok(_) => break,
                            Err(e) if Instant::now() < deadline => {
                                let _ = e;
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            Err(e) => panic!("register: {e:?}"),
                        }
                    }
                }
            });
        }
    });
    let registered = t0.elapsed();
    // Four changes: three leaves and a join.
    let mut m = MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(10));
    for id in ["gpu-node-0001", "gpu-node-0500", "gpu-node-0999"] {
        m.deregister("big", id, "").unwrap();
    }
    let req = kv_common::mds::RegisterRequest {
        addr: "gpu-node-1000.cluster.example:7700".into(),
        weight: 1,
        instance: String::new(),
        metrics_addr: None,
    };
    m.register("big", "gpu-node-1000", &req).unwrap();
    let v = m.view("big").unwrap();
    assert_eq!(v.members.len(), 998);
    assert_eq!(v.previous.len(), kv_common::mds::MAX_PREVIOUS_SETS, "{:?}", v.previous);
    assert_eq!(v.previous[0].joined, ["gpu-node-1000"]);
    assert_eq!(v.previous[3].left.len(), 3, "three sets back: before the three leaves");
    let json = serde_json::to_vec(&v).unwrap();
    let bare = serde_json::to_vec(&kv_common::mds::View { previous: vec![], ..v.clone() }).unwrap();
    println!(
        "handoff view size: {} bytes at 998 members with 4 previous sets ({} without them); 1,000 registrations in {registered:?}",
        json.len(),
        bare.len()
    );
    assert!(json.len() < bare.len() + 4096, "previous sets travel as small deltas");
    assert!(json.len() < kv_common::mds::MAX_REPLY / 64, "far below the client's reply limit");
    // A client following the group takes all four.
    let c = BlockingClient::new(Vec::new(), geo(), Options::default()).unwrap();
    let first = c.start_discovery(vec![mds.addr.clone()], "big".into(), Duration::from_millis(500)).unwrap();
    assert!(first.is_ok(), "{first:?}: {:?}", c.core.discovery_error());
    assert_eq!(c.core.topology().previous.len(), 4);
    assert_eq!(c.core.topology().previous[3].nodes.len(), 1000);
}
