//! Hot keys' reads spread over nodes, end to end (docs/ARCHITECTURE.md,
//! "Hot keys"): a real etcd, kv-mds with a handoff window, real nodes that
//! mark hot keys (short windows, so a test's reads make a key hot at once)
//! and clients that follow the group. A hot page read from several nodes
//! is the same bytes everywhere; a delete reaches every copy and no late
//! fill brings it back; a join or a leave keeps it a hit; a killed copy
//! holder costs one short timeout, to single and batch gets; hot state expires when reads stop; a
//! cold workload sends no request more than it did before.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_common::page::{Geometry, PageHeader};
use kv_common::status::Status;
use kv_common::wire::{Op, FLAG_HANDOFF};
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::Node;
use kvclient::{BlockingClient, Conn, Options};

/// One cluster at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn geo() -> Geometry {
    Geometry { model_hash: 12, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

const HOT: &[u8] = b"system-prompt-block-0";

fn page(seed: usize) -> Vec<u8> {
    (0..16384).map(|j| (seed * 31 + j * 7 + j / 251) as u8).collect()
}

fn cold(i: usize) -> Vec<u8> {
    format!("cold-page-{i}").into_bytes()
}

/// The handoff timeout the clients use: the short timeout of a read of a copy.
const SHORT_MS: u64 = 400;

struct Group {
    t: tempfile::TempDir,
    _etcd: Etcd,
    mds: Mds,
}

impl Group {
    fn new() -> Group {
        let t = tempfile::tempdir().expect("tempdir");
        let etcd = Etcd::start(t.path().to_path_buf());
        let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--handoff-secs", "120"]);
        Group { t, _etcd: etcd, mds }
    }

    /// A node that marks a key hot after 8 reads in a window of 100 ms.
    fn node(&self, id: &str) -> Node {
        let d = self.t.path().join(id);
        let args = ["--no-sync", "--hot-window-ms", "100", "--hot-reads", "8"];
        Node::member("kv-server", "127.0.0.1:0", d.to_str().unwrap(), &self.mds.addr, "g", id, &args)
    }

    fn client(&self, opts: &str) -> BlockingClient {
        let base = format!("io_timeout_ms=3000,connect_timeout_ms=500,handoff_timeout_ms={SHORT_MS}");
        let o = Options::parse(&format!("{base},{opts}")).unwrap();
        let c = BlockingClient::new(Vec::new(), geo(), o).expect("client");
        let first = c.start_discovery(vec![self.mds.addr.clone()], "g".into(), Duration::from_millis(500));
        assert!(first.expect("discovery thread").is_ok());
        c
    }

    fn await_count(&self, c: &BlockingClient, n: usize) {
        wait_until(Duration::from_secs(20), &format!("the client to route to {n} nodes"), || {
            (c.core.topology().nodes.len() == n).then_some(())
        });
    }
}

fn nodes(g: &Group, n: usize) -> Vec<Node> {
    (1..=n).map(|i| g.node(&format!("n{i}"))).collect()
}

fn stats(addr: &str) -> kv_common::stats::NodeStats {
    Conn::connect(addr, Duration::from_secs(2)).unwrap().stats().unwrap()
}

/// The nodes (by address) that hold `key`, asked one by one.
fn holders(nodes: &[&str], key: &[u8]) -> Vec<String> {
    nodes
        .iter()
        .filter(|a| Conn::connect(a, Duration::from_secs(2)).unwrap().exist(Some(&geo()), key).unwrap() == Status::Ok)
        .map(|a| a.to_string())
        .collect()
}

/// One batch get of `keys`, each into its buffer.
fn batch_get(c: &BlockingClient, keys: &[Vec<u8>], bufs: &mut [Vec<u8>]) -> Vec<(Status, usize)> {
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (&k[..], vec![&mut b[..]])).collect();
    c.batch_getv(&mut items)
}

/// Reads `key` until `want` nodes hold it (its reads spread and its copies
/// filled), every read a hit with the page's bytes.
fn read_until_spread(c: &BlockingClient, addrs: &[&str], key: &[u8], want: usize, p: &[u8]) {
    let mut buf = vec![0u8; p.len()];
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        for _ in 0..50 {
            let n = c.getv(key, &mut [&mut buf[..]]).expect("a hot page is always a hit");
            assert_eq!(&buf[..n], p, "the page's bytes, from whichever node served it");
        }
        let h = &c.core.metrics.hot;
        let settled = c.core.metrics.handoff.inflight_bytes.load(Ordering::Relaxed) == 0;
        if settled && h.fills_stored.load(Ordering::Relaxed) as usize >= want - 1 && holders(addrs, key).len() >= want {
            return;
        }
        assert!(Instant::now() < end, "the page held by {want} nodes: {:?}", holders(addrs, key));
    }
}

#[test]
fn a_hot_page_is_served_from_several_nodes_byte_identical_and_a_delete_reaches_every_copy() {
    let _s = serial();
    let g = Group::new();
    let ns = nodes(&g, 5);
    let addrs: Vec<&str> = ns.iter().map(|n| n.addr.as_str()).collect();
    let c = g.client("");
    g.await_count(&c, 5);
    let p = page(1);
    assert_eq!(c.putv(HOT, &[&p]), Status::Ok);
    // Read alone, the key is all its owner serves: spread over every node.
    read_until_spread(&c, &addrs, HOT, 5, &p);
    let h = &c.core.metrics.hot;
    assert!(h.copy_hits.load(Ordering::Relaxed) > 0, "reads served by copies");
    assert_eq!(h.keys.load(Ordering::Relaxed), 1);
    // Every copy is the page: read from each node directly.
    for a in &addrs {
        let mut d = Conn::connect(a, Duration::from_secs(2)).unwrap();
        match d.get(&geo(), HOT).unwrap() {
            kvclient::conn::GetResult::Hit(got) => assert_eq!(got, p, "the copy at {a} is byte-identical"),
            other => panic!("{a}: {other:?}"),
        }
    }
    // The nodes counted hot reads; the copies arrived as handoff copies.
    let copies: u64 = addrs.iter().map(|a| stats(a).handoff_copies).sum();
    assert_eq!(copies, 4, "one fill a node of the spread");
    let fills: Vec<u64> = addrs.iter().map(|a| stats(a).hot_fills).collect();
    assert_eq!(fills.iter().sum::<u64>(), 4, "each node but the owner counts its fill: {fills:?}");
    let held: Vec<u64> = addrs.iter().map(|a| stats(a).hot_copies_held).collect();
    assert_eq!(held.iter().sum::<u64>(), 4, "each node but the owner holds its copy: {held:?}");
    assert!(addrs.iter().map(|a| stats(a).hot_reads).sum::<u64>() > 0);
    // A batch get of it beside cold keys: served, from wherever.
    for i in 0..8 {
        assert_eq!(c.putv(&cold(i), &[&page(100 + i)]), Status::Ok);
    }
    let mut bufs: Vec<Vec<u8>> = (0..9).map(|_| vec![0u8; p.len()]).collect();
    for _ in 0..4 {
        let keys: Vec<Vec<u8>> = std::iter::once(HOT.to_vec()).chain((0..8).map(cold)).collect();
        let out = batch_get(&c, &keys, &mut bufs);
        assert!(out.iter().all(|r| r.0 == Status::Ok), "{out:?}");
        assert_eq!(bufs[0], p);
        for i in 0..8 {
            assert_eq!(bufs[1 + i], page(100 + i));
        }
    }

    // Deleted: gone from every copy, for every kind of read.
    assert_eq!(c.delete(HOT), Status::Ok);
    assert_eq!(holders(&addrs, HOT), Vec::<String>::new(), "no node holds it");
    let mut buf = vec![0u8; p.len()];
    for _ in 0..20 {
        assert_eq!(c.getv(HOT, &mut [&mut buf[..]]).unwrap_err().0, Status::Miss);
    }
    assert_eq!(c.exist(HOT), Status::Miss);
    assert_eq!(c.batch_exist(&[HOT, &cold(0)]), [Status::Miss, Status::Ok]);
    // A late fill (a copy read before the delete) is refused everywhere.
    let header = PageHeader::new(geo(), HOT, p.len() as u64, crc32fast::hash(&p)).encode();
    for a in &addrs {
        let mut d = Conn::connect(a, Duration::from_secs(2)).unwrap();
        d.send(Op::Put, FLAG_HANDOFF, &[&header, HOT, &p]).unwrap();
        assert_eq!(d.recv().unwrap().header.status, Status::Rejected, "{a} keeps the delete's tombstone");
    }
    assert_eq!(holders(&addrs, HOT), Vec::<String>::new());
    assert_eq!(addrs.iter().map(|a| stats(a).hot_copies_held).sum::<u64>(), 0, "no copy held after the delete");
    let snap = c.stats_text();
    assert!(snap.contains("kvclient_hot_fills_total{result=\"stored\"} 4"), "{snap}");
}

#[test]
fn a_cold_workload_sends_no_extra_request_and_hot_state_expires_when_reads_stop() {
    let _s = serial();
    let g = Group::new();
    let ns = nodes(&g, 4);
    let addrs: Vec<&str> = ns.iter().map(|n| n.addr.as_str()).collect();
    let c = g.client("");
    g.await_count(&c, 4);
    for i in 0..64 {
        assert_eq!(c.putv(&cold(i), &[&page(i)]), Status::Ok);
    }
    // Reads spread evenly over many keys: none turns hot, and every read
    // is one item at one node (the hits the nodes counted), each single
    // get one GET frame.
    let served = || addrs.iter().map(|a| stats(a)).map(|s| s.hits).sum::<u64>();
    let frames = || addrs.iter().flat_map(|a| stats(a).latency).filter(|l| l.op == "get").map(|l| l.count).sum::<u64>();
    let (before, frames_before) = (served(), frames());
    let mut buf = vec![0u8; 16384];
    let mut reads = 0u64;
    for round in 0..4 {
        for i in 0..64 {
            assert!(c.getv(&cold(i), &mut [&mut buf[..]]).is_ok(), "round {round} page {i}");
            reads += 1;
        }
        let keys: Vec<Vec<u8>> = (0..64).map(cold).collect();
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 16384]).collect();
        assert!(batch_get(&c, &keys, &mut bufs).iter().all(|r| r.0 == Status::Ok));
        reads += keys.len() as u64;
        // A key's reads stay under the nodes' threshold (8 in a window of
        // 100 ms, which a loaded machine's timer stretches): 2 a round.
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(served() - before, reads, "one read at one node for each read asked");
    assert_eq!(frames() - frames_before, 4 * 64, "one GET a single get");
    let h = &c.core.metrics.hot;
    assert_eq!(h.keys.load(Ordering::Relaxed), 0);
    assert_eq!(h.copy_hits.load(Ordering::Relaxed) + h.fallbacks.load(Ordering::Relaxed), 0);
    assert_eq!(addrs.iter().map(|a| stats(a).hot_keys).sum::<u64>(), 0, "no key hot");

    // A hot key, then no reads: the owner forgets it within a few of its
    // windows, this client after its hold (5 s), and reads go to the owner.
    let p = page(7);
    assert_eq!(c.putv(HOT, &[&p]), Status::Ok);
    read_until_spread(&c, &addrs, HOT, 2, &p);
    wait_until(Duration::from_secs(5), "the nodes to forget the hot key", || {
        (addrs.iter().map(|a| stats(a).hot_keys).sum::<u64>() == 0).then_some(())
    });
    let mut next = 0usize;
    wait_until(Duration::from_secs(10), "the client to forget it", || {
        // Reads of other keys only: the key leaves the client's memory by
        // itself (a sweep past its hold), not by a read of it. Each a few
        // times a second at most: a key read 50 times a second would turn
        // hot itself at these nodes' threshold (8 reads in 100 ms).
        std::thread::sleep(Duration::from_millis(100));
        let before = h.copy_hits.load(Ordering::Relaxed) + h.fallbacks.load(Ordering::Relaxed);
        let mut bufs: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; p.len()]).collect();
        next += 2;
        let pair = [cold(next % 64), cold((next + 1) % 64)];
        assert!(batch_get(&c, &pair, &mut bufs).iter().all(|r| r.0 == Status::Ok));
        let gone = h.keys.load(Ordering::Relaxed) == 0;
        (gone && before == h.copy_hits.load(Ordering::Relaxed) + h.fallbacks.load(Ordering::Relaxed)).then_some(())
    });
    assert!(!c.core.is_hot_key(HOT));
    let t = c.core.topology();
    let owner = &t.nodes[t.ring.owner(HOT).unwrap()].addr;
    let at_owner = stats(owner).hits;
    let (spread_before, all_before) = (h.copy_hits.load(Ordering::Relaxed), served());
    for _ in 0..3 {
        assert!(c.getv(HOT, &mut [&mut buf[..]]).is_ok());
    }
    assert_eq!(stats(owner).hits - at_owner, 3, "cold again: read at its owner");
    assert_eq!(served() - all_before, 3);
    assert_eq!(h.copy_hits.load(Ordering::Relaxed), spread_before);
}

#[test]
fn a_join_and_a_killed_copy_holder_keep_a_hot_page_a_hit_at_the_cost_of_one_short_timeout() {
    let _s = serial();
    let g = Group::new();
    let mut ns = nodes(&g, 5);
    let c = g.client("");
    g.await_count(&c, 5);
    let p = page(3);
    assert_eq!(c.putv(HOT, &[&p]), Status::Ok);
    let addrs: Vec<String> = ns.iter().map(|n| n.addr.clone()).collect();
    let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    read_until_spread(&c, &refs, HOT, 5, &p);

    // A join while hot: every read a hit, the page's bytes.
    ns.push(g.node("n6"));
    g.await_count(&c, 6);
    let mut buf = vec![0u8; p.len()];
    for _ in 0..200 {
        let n = c.getv(HOT, &mut [&mut buf[..]]).expect("a hit across the join");
        assert_eq!(&buf[..n], &p[..]);
    }

    // Kill a node that holds a copy (not the owner): the reads sent to it
    // cost one short timeout at most (a refused connection costs less),
    // then it is skipped; every read is a hit.
    let t = c.core.topology();
    let owner = t.nodes[t.ring.owner(HOT).unwrap()].addr.clone();
    let victim = ns.iter().position(|n| n.addr != owner && addrs.contains(&n.addr)).unwrap();
    ns.remove(victim).kill9();
    let mut slow = 0;
    for i in 0..300 {
        let t0 = Instant::now();
        let n = c.getv(HOT, &mut [&mut buf[..]]).unwrap_or_else(|e| panic!("read {i} after the kill: {e:?}"));
        assert_eq!(&buf[..n], &p[..]);
        let took = t0.elapsed();
        assert!(took < Duration::from_millis(SHORT_MS + 1500), "read {i} took {took:?}");
        if took > Duration::from_millis(SHORT_MS / 2) {
            slow += 1;
        }
    }
    assert!(slow <= 1, "{slow} slow reads: one short timeout at most");

    // Batch gets the same: kill another copy holder, then read the page
    // in batches beside cold pages; the items sent to the dead node go to
    // their owners in the same call.
    for i in 0..8 {
        assert_eq!(c.putv(&cold(i), &[&page(200 + i)]), Status::Ok);
    }
    let victim = ns.iter().position(|n| n.addr != owner && addrs.contains(&n.addr)).unwrap();
    let dead: Vec<String> = addrs.iter().filter(|a| !ns.iter().any(|n| &n.addr == *a)).cloned().collect();
    let second = ns.remove(victim);
    let dead: Vec<String> = dead.into_iter().chain([second.addr.clone()]).collect();
    second.kill9();
    // The cold pages beside it: those whose owners are alive (a dead
    // owner's pages are not served, hot or not).
    let t = c.core.topology();
    let alive = |k: &[u8]| !dead.contains(&t.nodes[t.ring.owner(k).unwrap()].addr);
    let cold_alive: Vec<usize> = (0..8).filter(|&i| alive(&cold(i))).collect();
    let keys: Vec<Vec<u8>> = std::iter::once(HOT.to_vec()).chain(cold_alive.iter().map(|&i| cold(i))).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; p.len()]).collect();
    let fallbacks = c.core.metrics.hot.fallbacks.load(Ordering::Relaxed);
    let mut slow = 0;
    for round in 0..100 {
        let t0 = Instant::now();
        let out = batch_get(&c, &keys, &mut bufs);
        let took = t0.elapsed();
        assert!(out.iter().all(|r| r.0 == Status::Ok), "round {round}: {out:?}");
        assert_eq!(bufs[0], p);
        for (j, &i) in cold_alive.iter().enumerate() {
            assert_eq!(bufs[1 + j], page(200 + i));
        }
        assert!(took < Duration::from_millis(SHORT_MS + 1500), "round {round} took {took:?}");
        if took > Duration::from_millis(SHORT_MS / 2) {
            slow += 1;
        }
    }
    assert!(slow <= 1, "{slow} slow batches: one short timeout at most");
    let fell = c.core.metrics.hot.fallbacks.load(Ordering::Relaxed) - fallbacks;
    assert!(fell >= 1, "the dead node's turn went to the owner");

    // Once the group drops them (the 3 s lease), the reads go on as hits.
    g.await_count(&c, 4);
    for _ in 0..100 {
        assert!(c.getv(HOT, &mut [&mut buf[..]]).is_ok());
    }
}
