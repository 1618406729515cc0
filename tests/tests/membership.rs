//! Membership end to end: a real etcd, real kv-mds replicas, real kv-server
//! nodes, and the client library's discovery, with a 3 s lease TTL.
//!
//! Timings printed with `membership timing:` are the figures recorded in
//! docs/BENCHMARKS.md (run with `--nocapture` to see them).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_common::mds::{MdsClient, View};
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::{run, Node};
use kvclient::{BlockingClient, Options};

const TTL: &str = "3s";

/// These tests each run etcd, MDS replicas and nodes with a 3 s lease: run
/// them one at a time so a starved heartbeat on a busy 2-core machine does
/// not expire a lease.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
const TTL_D: Duration = Duration::from_secs(3);
const POLL: Duration = Duration::from_millis(1000);

fn geo() -> Geometry {
    Geometry { model_hash: 7, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

struct Tier {
    t: tempfile::TempDir,
    etcd: Etcd,
    mds: Vec<Mds>,
}

impl Tier {
    fn new(replicas: usize) -> Tier {
        let t = tempfile::tempdir().expect("tempdir");
        let etcd = Etcd::start(t.path().to_path_buf());
        let mds = (0..replicas).map(|_| Mds::start(&etcd.endpoint(), TTL)).collect();
        Tier { t, etcd, mds }
    }

    /// The live replicas as a `--mds` list (the first one first).
    fn eps(&self) -> String {
        self.mds.iter().filter(|m| !m.addr.is_empty()).map(|m| m.addr.clone()).collect::<Vec<_>>().join(",")
    }

    fn node(&self, id: &str, weight: u32) -> Node {
        self.node_at("127.0.0.1:0", id, weight)
    }

    fn node_at(&self, listen: &str, id: &str, weight: u32) -> Node {
        self.node_in(id, listen, id, weight)
    }

    /// A node whose disk dirs are named after `dirs` rather than its id.
    fn node_in(&self, dirs: &str, listen: &str, id: &str, weight: u32) -> Node {
        let a = self.t.path().join(format!("{dirs}-a"));
        let b = self.t.path().join(format!("{dirs}-b"));
        let dirs = format!("{},{}", a.display(), b.display());
        let w = weight.to_string();
        let eps = self.eps();
        Node::member("kv-server", listen, &dirs, &eps, "g", id, &["--no-sync", "--log-level", "info", "--weight", &w])
    }

    /// The view as replica `i` gives it, without the time left in the
    /// handoff windows of its previous sets (that depends on when it was
    /// read; everything else is the same on every replica).
    fn view(&self, i: usize) -> Option<View> {
        let mut v = MdsClient::new(vec![self.mds[i].addr.clone()], Duration::from_secs(2)).view("g").ok()?;
        v.previous.iter_mut().for_each(|p| p.remaining_ms = 0);
        Some(v)
    }

    /// Waits until replica `i` lists exactly `ids`; returns that view.
    fn await_members(&self, i: usize, ids: &[&str], limit: Duration) -> View {
        wait_until(limit, &format!("members {ids:?} on replica {i}"), || {
            self.view(i).filter(|v| v.members.iter().map(|m| m.id.as_str()).eq(ids.iter().copied()))
        })
    }

    fn client(&self, eps: &str) -> BlockingClient {
        let c = BlockingClient::new(
            Vec::new(),
            geo(),
            Options::parse("io_timeout_ms=2000,connect_timeout_ms=500").unwrap(),
        )
        .expect("client");
        let eps = kv_common::mds::parse_endpoints(eps).unwrap();
        let first = c.start_discovery(eps, "g".into(), POLL).expect("discovery thread");
        assert!(first.is_ok(), "first view: {first:?}");
        c
    }
}

fn rebuilds(c: &BlockingClient) -> u64 {
    c.core.metrics.ring_rebuilds.load(Ordering::Relaxed)
}

fn ids(c: &BlockingClient) -> Vec<String> {
    let mut v: Vec<String> = c.core.topology().nodes.iter().map(|n| n.id.clone()).collect();
    v.sort();
    v
}

fn page(i: usize) -> Vec<u8> {
    (0..4096).map(|j| (i * 31 + j) as u8).collect()
}

#[test]
fn join_same_epoch_everywhere_and_weight_change_shows_in_shares() {
    let _serial = serial();
    let tier = Tier::new(2);
    let _n1 = tier.node("n1", 1);
    let _n2 = tier.node("n2", 1);
    let n3 = tier.node("n3", 2);
    let v0 = tier.await_members(0, &["n1", "n2", "n3"], Duration::from_secs(20));
    let v1 = tier.await_members(1, &["n1", "n2", "n3"], Duration::from_secs(20));
    assert_eq!(v0, v1, "both replicas give the same view with the same epoch");
    assert!(v0.epoch > 0);

    let (code, out, err) = run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g", "--json"]);
    assert_eq!(code, 0, "{err}");
    let ring: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ring["epoch"].as_u64(), Some(v0.epoch));
    let share = |r: &serde_json::Value, id: &str| {
        r["members"].as_array().unwrap().iter().find(|m| m["id"] == id).unwrap()["share"].as_f64().unwrap()
    };
    assert!((share(&ring, "n3") - 0.5).abs() < 0.06, "weight 2 of 4: {out}");
    assert_eq!(ring["members"][2]["vnodes"].as_u64(), Some(320));
    let fullest = ring["max_over_fair"].as_f64().unwrap();
    assert!((1.0..1.2).contains(&fullest), "{out}");
    // stat --all: a row per node and a TOTAL; an unreachable node is marked (exit 1).
    let (code, out, err) = run("kvctl", &["stat", "--all", "--mds", &tier.eps(), "--group", "g", "--json"]);
    assert_eq!(code, 0, "{err}");
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((st["nodes"].as_array().unwrap().len(), st["total"]["unreachable"].as_u64()), (3, Some(0)), "{out}");
    let dead = format!("n1={},gone=127.0.0.1:1", v0.members[0].addr);
    let (code, text, _) = run("kvctl", &["stat", "--all", "--members", &dead]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("UNREACHABLE") && text.contains("TOTAL"), "{text}");
    let (code, text, _) = run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g"]);
    assert_eq!(code, 0);
    assert!(text.starts_with(&format!("group g  epoch {}", v0.epoch)), "{text}");
    assert!(text.contains("fullest member: ") && text.contains("x the share its weight asks for"), "{text}");

    // Heartbeats (every TTL/3) for two TTLs: the epoch stays.
    std::thread::sleep(TTL_D * 2);
    assert_eq!(tier.view(1).unwrap().epoch, v0.epoch, "heartbeats must not advance the epoch");

    // n3 comes back with weight 1: a new epoch, and its share drops to a third.
    assert!(n3.terminate(Duration::from_secs(20)).success());
    let _n3 = tier.node("n3", 1);
    let v = wait_until(Duration::from_secs(20), "n3 at weight 1", || {
        tier.view(0).filter(|v| v.members.len() == 3 && v.members.iter().all(|m| m.weight == 1))
    });
    assert!(v.epoch > v0.epoch);
    let (_, out, _) = run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g", "--json"]);
    let ring: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!((share(&ring, "n3") - 1.0 / 3.0).abs() < 0.06, "{out}");
}

#[test]
fn kill_and_leave_change_the_view_and_clients_reroute() {
    let _serial = serial();
    let tier = Tier::new(2);
    let n1 = tier.node("n1", 1);
    let n2 = tier.node("n2", 1);
    let _n3 = tier.node("n3", 1);
    tier.await_members(0, &["n1", "n2", "n3"], Duration::from_secs(20));
    let c = tier.client(&tier.eps());
    assert_eq!(ids(&c), ["n1", "n2", "n3"]);
    assert_eq!(rebuilds(&c), 1, "the first view builds the ring once");
    for i in 0..60 {
        assert_eq!(c.putv(format!("k{i}").as_bytes(), &[&page(i)]), Status::Ok);
    }

    // SIGKILL: gone from the view within TTL + one poll (plus etcd's expiry tick).
    let t = Instant::now();
    n1.kill9();
    wait_until(TTL_D + POLL + Duration::from_secs(3), "n1 gone from the client's ring", || {
        (ids(&c) == ["n2", "n3"]).then_some(())
    });
    let kill_seen = t.elapsed();
    eprintln!("membership timing: SIGKILL of a node seen by a client after {kill_seen:?} (TTL 3 s, poll 1 s)");
    assert_eq!(rebuilds(&c), 2, "one rebuild for one change");
    // Every key routes to a live node: n1's keys miss (recompute), the rest hit.
    let mut hits = 0;
    for i in 0..60 {
        let mut buf = vec![0u8; 4096];
        match c.getv(format!("k{i}").as_bytes(), &mut [&mut buf[..]]) {
            Ok(_) => hits += 1,
            Err((Status::Miss, _)) => {}
            Err(other) => panic!("key k{i}: {other:?} after the view dropped n1"),
        }
        assert_eq!(c.putv(format!("k{i}").as_bytes(), &[&page(i)]), Status::Ok);
    }
    assert!(hits > 20 && hits < 60, "n1's keys miss, the others hit: {hits}");

    // SIGTERM: deregistered at once.
    let t = Instant::now();
    assert!(n2.terminate(Duration::from_secs(20)).success());
    let stopped = t.elapsed();
    wait_until(Duration::from_secs(3), "n2 gone after a graceful stop", || (ids(&c) == ["n3"]).then_some(()));
    eprintln!(
        "membership timing: graceful leave seen by a client {:?} after SIGTERM (the node took {stopped:?} to stop)",
        t.elapsed()
    );
    assert_eq!(rebuilds(&c), 3);
    // Quiet period: heartbeats only, no rebuild.
    std::thread::sleep(TTL_D);
    assert_eq!(rebuilds(&c), 3, "heartbeats must not rebuild the ring");
    let (code, _, err) = run("kvctl", &["stat", "--all", "--mds", &tier.eps(), "--group", "g"]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_long_poll_sees_a_join_within_a_second() {
    let _serial = serial();
    let tier = Tier::new(1);
    let _n1 = tier.node("n1", 1);
    tier.await_members(0, &["n1"], Duration::from_secs(20));
    // Long polls of 5 s: only the long-poll can make the join visible early.
    let c = BlockingClient::new(Vec::new(), geo(), Options::default()).unwrap();
    let eps = kv_common::mds::parse_endpoints(&tier.eps()).unwrap();
    assert!(c.start_discovery(eps, "g".into(), Duration::from_secs(5)).unwrap().is_ok());
    let c = std::sync::Arc::new(c);
    let watcher = {
        let c = c.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if ids(&c) == ["n1", "n2"] {
                    return Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            None
        })
    };
    let spawned = Instant::now();
    let n2 = tier.node("n2", 1);
    let registered = wait_until(Duration::from_secs(20), "n2's registered line", || {
        n2.stderr_lines.try_iter().find(|l| l.contains("registered")).map(|_| Instant::now())
    });
    let seen = watcher.join().unwrap().expect("the client sees n2 within 30 s");
    // The node logs "registered" once the MDS answered, and the MDS answers
    // after the epoch moved: the client may see the join before the line.
    let lag = seen.saturating_duration_since(registered);
    eprintln!(
        "membership timing: join seen by a long-polling client {:?} after the node process was started \
         (start, recovery, registration and propagation included)",
        seen - spawned
    );
    assert!(lag < Duration::from_secs(1), "join seen {lag:?} after registration");
}

#[test]
fn killing_the_replica_holding_the_leases_keeps_nodes_and_clients() {
    let _serial = serial();
    let mut tier = Tier::new(2);
    // Nodes start on a random replica; the one killed holds at least one lease.
    let _n1 = tier.node("n1", 1);
    let _n2 = tier.node("n2", 1);
    let v = tier.await_members(1, &["n1", "n2"], Duration::from_secs(20));
    let c = tier.client(&tier.eps());
    let registrations = |i: usize| -> u64 {
        let m = MdsClient::new(vec![tier.mds[i].addr.clone()], Duration::from_secs(2));
        let (_, text) = m.request(&tier.mds[i].addr, "GET", "/metrics", None, Duration::ZERO).unwrap();
        String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix("kvmds_registrations_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let (holder, survivor) = if registrations(0) > 0 { (0, 1) } else { (1, 0) };
    tier.mds[holder].kill9();
    // Past two TTLs, with traffic all along: nothing expires, nothing changes.
    let until = Instant::now() + TTL_D * 2 + Duration::from_secs(1);
    let mut i = 0;
    while Instant::now() < until {
        assert_eq!(c.putv(format!("x{i}").as_bytes(), &[&page(i)]), Status::Ok);
        let mut buf = vec![0u8; 4096];
        assert!(c.getv(format!("x{i}").as_bytes(), &mut [&mut buf[..]]).is_ok());
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let now = tier.view(survivor).expect("the surviving replica answers");
    assert_eq!(now, v, "the other replica took the leases over: same members, same epoch");
    assert_eq!(rebuilds(&c), 1);
    // Each node is now held by the surviving replica: taken over, unless it
    // had registered there in the first place.
    let m = MdsClient::new(vec![tier.mds[survivor].addr.clone()], Duration::from_secs(2));
    let (_, text) = m.request(&tier.mds[survivor].addr, "GET", "/metrics", None, Duration::ZERO).unwrap();
    let text = String::from_utf8_lossy(&text);
    let count = |name: &str| -> u64 {
        text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    };
    assert_eq!(count("kvmds_takeovers_total ") + count("kvmds_registrations_total "), 2, "{text}");
    assert!(count("kvmds_takeovers_total ") >= 1, "the killed replica held a lease: {text}");
}

#[test]
fn with_every_mds_down_clients_keep_their_ring_then_resume() {
    let _serial = serial();
    let mut tier = Tier::new(2);
    let _n1 = tier.node("n1", 1);
    let _n2 = tier.node("n2", 1);
    tier.await_members(0, &["n1", "n2"], Duration::from_secs(20));
    let eps = tier.eps();
    let addr0 = tier.mds[0].addr.clone();
    let c = tier.client(&eps);
    tier.mds[0].kill9();
    tier.mds[1].kill9();
    // Longer than a TTL without any MDS: the client serves on its last ring.
    let until = Instant::now() + TTL_D + Duration::from_secs(1);
    let mut i = 0;
    while Instant::now() < until {
        assert_eq!(c.putv(format!("y{i}").as_bytes(), &[&page(i)]), Status::Ok);
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(ids(&c), ["n1", "n2"]);
    wait_until(Duration::from_secs(5), "the client to report the MDS down", || {
        (c.core.metrics.mds_up.load(Ordering::Relaxed) == 0).then_some(())
    });
    assert!(c.stats_text().contains("kvclient_mds_last_error_info"));

    // One replica back on its address: nodes re-register, a new node joins,
    // and the client's discovery picks it all up.
    tier.mds[0] = Mds::try_start_at(&addr0, &tier.etcd.endpoint(), TTL, 3).expect("the MDS back on its address");
    tier.mds[1].addr.clear();
    let _n3 = tier.node("n3", 1);
    // The leases lapsed meanwhile, so the first views are empty or partial
    // while nodes register again: an empty one must never replace the ring.
    let mut ever_empty = false;
    wait_until(Duration::from_secs(20), "the client to see n1, n2 and n3", || {
        let now = ids(&c);
        ever_empty |= now.is_empty();
        (now == ["n1", "n2", "n3"]).then_some(())
    });
    assert!(!ever_empty, "an empty view replaced the client's ring");
    assert_eq!(c.core.metrics.mds_up.load(Ordering::Relaxed), 1);
}

#[test]
fn etcd_restart_is_reported_and_recovered_from() {
    let _serial = serial();
    let mut tier = Tier::new(1);
    // Revisions spent before the group's first epoch, so that the epochs of
    // the wiped etcd below (its revisions start again at 1) are lower.
    for i in 0..12 {
        let (ok, out) = tier.etcd.etcdctl(&["put", "/unrelated", &i.to_string()]);
        assert!(ok, "{out}");
    }
    let n1 = tier.node("n1", 1);
    let n2 = tier.node("n2", 1);
    let v = tier.await_members(0, &["n1", "n2"], Duration::from_secs(20));
    let c = tier.client(&tier.eps());
    tier.etcd.stop();
    // The MDS answers with a clear error, and logs it once. Until its etcd
    // watch has seen the stream end (the kill reaches it asynchronously), a
    // plain poll may still be answered from the view the watch held.
    let m = MdsClient::new(vec![tier.mds[0].addr.clone()], Duration::from_secs(10));
    let ep = tier.mds[0].addr.clone();
    let body = wait_until(Duration::from_secs(10), "a view poll answered 503", || {
        match m.request(&ep, "GET", "/v1/groups/g/view", None, Duration::ZERO).expect("the MDS answers") {
            (503, body) => Some(body),
            (200, _) => None,
            (s, body) => panic!("view poll answered {s}: {}", String::from_utf8_lossy(&body)),
        }
    });
    assert!(String::from_utf8_lossy(&body).contains("etcd unavailable"), "{}", String::from_utf8_lossy(&body));
    let (hc, _) = m.request(&ep, "GET", "/healthz", None, Duration::ZERO).unwrap();
    assert_eq!(hc, 503);
    // Alive all the same: a liveness probe does not restart it for etcd.
    let (lc, lb) = m.request(&ep, "GET", "/livez", None, Duration::ZERO).unwrap();
    assert_eq!((lc, String::from_utf8_lossy(&lb).into_owned()), (200, "ok\n".to_string()));
    // Clients keep serving meanwhile.
    assert_eq!(c.putv(b"during-outage", &[&page(1)]), Status::Ok);

    tier.etcd.restart(false);
    let after = tier.await_members(0, &["n1", "n2"], Duration::from_secs(30));
    assert_eq!(after, v, "leases survive an etcd restart: same members, same epoch");
    wait_until(Duration::from_secs(10), "healthz ok", || {
        matches!(m.request(&ep, "GET", "/healthz", None, Duration::ZERO), Ok((200, _))).then_some(())
    });
    let log = tier.mds[0].log().join("\n");
    assert!(log.contains("etcd unavailable"), "{log}");
    assert!(log.contains("etcd reachable again"), "{log}");
    assert_eq!(ids(&c), ["n1", "n2"]);

    // etcd's state lost: the next heartbeats are told the node is unknown,
    // and the nodes register again.
    tier.etcd.restart(true);
    eprintln!("etcd wiped and restarted");
    tier.await_members(0, &["n1", "n2"], Duration::from_secs(30));
    for n in [&n1, &n2] {
        wait_until(Duration::from_secs(10), "a node logging its re-registration", || {
            n.stderr_lines.try_iter().any(|l| l.contains("registering again")).then_some(())
        });
    }
    // The client follows the new etcd's (lower) epoch within a poll, and
    // says that it went back.
    let wiped = wait_until(Duration::from_secs(10), "the client on the new epoch", || {
        let now = tier.view(0).map(|v| v.epoch).unwrap_or(0);
        (c.core.epoch() == now).then_some(now)
    });
    assert!(wiped < v.epoch, "the wiped etcd's epoch {wiped} is below {}", v.epoch);
    assert!(c.core.metrics.mds_epoch_regressions.load(Ordering::Relaxed) >= 1);
    assert!(!c.stats_text().contains("kvclient_mds_epoch_regressions_total 0"));
    assert_eq!(c.putv(b"after-wipe", &[&page(2)]), Status::Ok);
}

#[test]
fn a_node_started_before_any_mds_serves_and_registers_when_one_comes() {
    let _serial = serial();
    let t = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds_addr = format!("127.0.0.1:{}", kv_e2e::cluster::free_port());
    let dir = t.path().join("n1");
    let node = Node::start(&[
        "--dir",
        dir.to_str().unwrap(),
        "--cap",
        "64M",
        "--no-sync",
        "--mds",
        &mds_addr,
        "--group",
        "g",
        "--id",
        "n1",
        "--advertise",
        "127.0.0.1:0",
    ]);
    // Serving already, through a static member list.
    let c = BlockingClient::new(
        kvclient::members::parse_members(&format!("n1={}", node.addr)).unwrap(),
        geo(),
        Options::default(),
    )
    .unwrap();
    assert_eq!(c.putv(b"early", &[&page(0)]), Status::Ok);
    let mds = Mds::start_at(&mds_addr, &etcd.endpoint(), TTL);
    let v = wait_until(Duration::from_secs(15), "n1 registered once the MDS is up", || {
        MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(2)).view("g").ok().filter(|v| v.members.len() == 1)
    });
    assert_eq!(v.members[0].addr, node.addr, "port 0 in --advertise means the listen port");
}

#[test]
fn bad_requests_and_bad_flags_get_one_clear_error() {
    let _serial = serial();
    let tier = Tier::new(1);
    let addr = tier.mds[0].addr.clone();
    let m = MdsClient::new(vec![addr.clone()], Duration::from_secs(5));
    /// method, path, body, expected status, text the error must contain
    type Case<'a> = (&'a str, &'a str, Option<&'a [u8]>, u16, &'a str);
    let cases: [Case; 7] = [
        ("POST", "/v1/groups/g/members/n1", Some(b"not json"), 400, "body is not"),
        ("POST", "/v1/groups/g/members/n1", Some(br#"{"addr":"h:1","weight":0}"#), 400, "weight"),
        ("POST", "/v1/groups/g/members/n1", Some(br#"{"addr":"nohostport","weight":1}"#), 400, "host:port"),
        ("POST", "/v1/groups/bad%2Fname/members/n1", Some(b"{}"), 400, "group"),
        ("GET", "/v1/groups/g/view?after=x&wait_ms=1", None, 400, "not a whole number"),
        ("POST", "/v1/groups/g/members/ghost/heartbeat", Some(b"{}"), 404, "register again"),
        ("GET", "/nowhere", None, 404, "no such call"),
    ];
    for (method, path, body, want, text) in cases {
        let (status, reply) = m.request(&addr, method, path, body, Duration::ZERO).expect("an answer");
        let reply = String::from_utf8_lossy(&reply);
        assert_eq!(status, want, "{method} {path}: {reply}");
        assert!(reply.contains(text), "{method} {path}: {reply}");
    }
    // Garbage on the port: that connection ends, the replica serves on.
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(b"\x00\x01garbage\r\n\r\n\xff\xfe");
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    assert!(tier.view(0).is_some(), "the replica still answers");

    // The daemon's own flags.
    let (code, _, err) = run("kv-mds", &["--lease-ttl", "soon"]);
    assert_eq!(code, 2);
    assert!(err.contains("not a duration") && err.lines().count() <= 2, "{err}");
    let (code, _, err) = run("kv-mds", &["--listen", &addr, "--etcd", &tier.etcd.endpoint()]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot listen"), "{err}");
    let (code, _, err) =
        run("kv-server", &["--listen", "127.0.0.1:0", "--dir", "unused-dir", "--cap", "1G", "--mds", "h:1"]);
    assert_eq!(code, 2);
    assert!(err.contains("--id is required"), "{err}");
}

#[test]
fn a_replica_at_its_limits_refuses_clearly_and_serves_on() {
    use std::io::{Read, Write};
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), TTL, &["--max-conns", "3"]);
    let m = MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(5));
    let ok = || m.request(&mds.addr, "GET", "/v1/groups/g/view", None, Duration::ZERO).map(|(s, _)| s).ok();
    assert_eq!(ok(), Some(200));

    // Silent connections (no bytes yet) hold no slot: calls are still served.
    let silent: Vec<std::net::TcpStream> = (0..6).map(|_| std::net::TcpStream::connect(&mds.addr).unwrap()).collect();
    assert_eq!(ok(), Some(200), "silent sockets cannot crowd callers out");
    // Three kept-alive connections, each answered once, fill the cap: the
    // next one is told so (503).
    let held: Vec<std::net::TcpStream> = (0..3).map(|_| kv_e2e::cluster::held_http_connection(&mds.addr)).collect();
    let (status, body) = wait_until(Duration::from_secs(5), "a 503 at the cap", || {
        m.request(&mds.addr, "GET", "/v1/groups/g/view", None, Duration::ZERO).ok().filter(|(s, _)| *s == 503)
    });
    assert_eq!(status, 503);
    assert!(String::from_utf8_lossy(&body).contains("connection cap (3)"), "{}", String::from_utf8_lossy(&body));
    drop(held);
    drop(silent);
    wait_until(Duration::from_secs(5), "served again below the cap", || (ok() == Some(200)).then_some(()));

    // A body announced and never sent: 408 within the read timeout (10 s),
    // not a task and a connection held for ever.
    let mut s = std::net::TcpStream::connect(&mds.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"POST /v1/groups/g/members/n1 HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{").unwrap();
    let t0 = Instant::now();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(t0.elapsed() < Duration::from_secs(15), "answered after {:?}", t0.elapsed());
    assert_eq!(ok(), Some(200));
}

#[test]
fn two_nodes_given_one_id_the_later_holds_it_and_the_other_is_told() {
    let _serial = serial();
    let tier = Tier::new(1);
    let first = tier.node_in("first", "127.0.0.1:0", "dup", 1);
    let v = tier.await_members(0, &["dup"], Duration::from_secs(20));
    assert_eq!(v.members[0].addr, first.addr);
    // A second node with the same id (a configuration mistake, or a restart
    // elsewhere): the latest registration holds the id...
    let second = tier.node_in("second", "127.0.0.1:0", "dup", 1);
    wait_until(Duration::from_secs(10), "the id to move to the second node", || {
        tier.view(0).filter(|v| v.members.len() == 1 && v.members[0].addr == second.addr)
    });
    // ...and the first is told at its next heartbeat, once, and does not
    // take the id back (no flapping).
    wait_until(Duration::from_secs(10), "the first node told its id is taken", || {
        first.stderr_lines.try_iter().any(|l| l.contains("id is taken by another node")).then_some(())
    });
    std::thread::sleep(TTL_D);
    let now = tier.view(0).unwrap();
    assert_eq!(now.members[0].addr, second.addr, "the first node must not take the id back");
    // The first one stopping does not remove the second's record.
    assert!(first.terminate(Duration::from_secs(20)).success());
    assert_eq!(tier.view(0).unwrap(), now);
    // The holder leaving frees the id.
    assert!(second.terminate(Duration::from_secs(20)).success());
    tier.await_members(0, &[], Duration::from_secs(10));
}

/// `kv-local`, the loopback-cluster starter of the quickstart and the
/// benchmarks: etcd, a replica and two nodes that join the group, a line
/// per part and `ready`; a page round trip through the group it started;
/// on SIGTERM every process it started is gone and it exits cleanly.
#[test]
fn kv_local_starts_a_group_and_stops_every_part_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let _g = serial();
    let work = tempfile::tempdir().unwrap();
    let mut child = Command::new(kv_e2e::bin("kv-local"))
        .args(["--work", work.path().to_str().unwrap(), "--nodes", "2", "--mds", "1", "--group", "g"])
        .args(["--", "--cap", "64M", "--drain-secs", "0", "--log-level", "warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kv-local");
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while lines.last().map(String::as_str) != Some("ready") {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kv-local not ready within 90 s: {lines:?}");
            }
        }
    }
    let field = |p: &str| lines.iter().find_map(|l| l.strip_prefix(p)).map(str::to_string);
    let mds = field("mds ").expect("an mds line");
    assert!(field("etcd ").is_some(), "{lines:?}");
    let pids: Vec<i32> = lines
        .iter()
        .filter(|l| l.starts_with("node "))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("pid=")).and_then(|p| p.parse().ok()))
        .collect();
    assert_eq!(pids.len(), 2, "{lines:?}");
    // The group it started serves: a page through discovery.
    let c = BlockingClient::new(Vec::new(), geo(), Options::default()).unwrap();
    let eps = kv_common::mds::parse_endpoints(&mds).unwrap();
    assert!(c.start_discovery(eps, "g".into(), Duration::from_secs(1)).unwrap().is_ok());
    wait_until(Duration::from_secs(20), "the view", || (ids(&c) == ["n1", "n2"]).then_some(()));
    assert_eq!(c.putv(b"local", &[&[7u8; 8192]]), Status::Ok);
    let mut buf = vec![0u8; 8192];
    assert_eq!(c.getv(b"local", &mut [&mut buf[..]]), Ok(8192));
    assert!(buf.iter().all(|&b| b == 7));
    drop(c);
    // SAFETY: kill(2) on the pid of the child this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = kv_e2e::wait_deadline(&mut child, Duration::from_secs(60));
    assert!(st.success(), "kv-local exit: {st:?}");
    for p in pids {
        // SAFETY: signal 0 only asks whether the pid exists.
        let alive = unsafe { libc::kill(p, 0) } == 0;
        assert!(!alive, "node pid {p} outlived kv-local");
    }
}

/// A replica's counter from its /metrics (0 when absent).
/// A node's calls ride one connection, served on the replica's nodes'
/// runtime; a connection that only says it is a node's call, and is never
/// answered 2xx, is closed within the read timeout like any other.
#[test]
fn a_node_keeps_one_connection_and_a_silent_node_call_is_closed() {
    use std::io::{Read, Write};
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), TTL, &[]);
    let mut node =
        MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(5)).with_keep_idle(kv_common::mds::NODE_KEEP_IDLE);
    let req = kv_common::mds::RegisterRequest {
        addr: "127.0.0.1:1".into(),
        weight: 1,
        instance: "i-1".into(),
        metrics_addr: None,
    };
    node.register("g", "n1", &req).expect("registered");
    for _ in 0..3 {
        node.heartbeat("g", "n1", "i-1").expect("a heartbeat");
    }
    assert_eq!(mds_counter(&mds.addr, "kvmds_node_connections_total"), 1, "one connection for four calls");
    assert_eq!(mds_counter(&mds.addr, "kvmds_heartbeats_total"), 3);

    let mut s = std::net::TcpStream::connect(&mds.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"POST /v1/groups/").unwrap();
    let t0 = Instant::now();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(t0.elapsed() < Duration::from_secs(15), "closed after {:?}", t0.elapsed());
    assert_eq!(mds_counter(&mds.addr, "kvmds_node_connections_total"), 2);
    // The node's connection, idle meanwhile (its lease lapsed: the test's
    // TTL is short), is still the one it had.
    node.register("g", "n1", &req).expect("registered again");
    assert_eq!(mds_counter(&mds.addr, "kvmds_node_connections_total"), 2);
}

fn mds_counter(addr: &str, name: &str) -> u64 {
    let m = MdsClient::new(vec![addr.to_string()], Duration::from_secs(2));
    let (_, text) = m.request(addr, "GET", "/metrics", None, Duration::ZERO).unwrap();
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_string))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn long_polls_holding_the_current_epoch_read_nothing_from_etcd() {
    let _serial = serial();
    let tier = Tier::new(1);
    let _n1 = tier.node("n1", 1);
    let v = tier.await_members(0, &["n1"], Duration::from_secs(20));
    let addr = tier.mds[0].addr.clone();
    // One long-poll first: the replica holds the view from then on.
    MdsClient::new(vec![addr.clone()], Duration::from_secs(3))
        .wait_view("g", v.epoch, Duration::from_millis(200))
        .unwrap();
    let reads0 = mds_counter(&addr, "kvmds_view_reads_total");
    let cached0 = mds_counter(&addr, "kvmds_long_polls_from_cache_total");
    // 16 clients, 3 long-polls each, every one to its deadline: no change.
    let polls: Vec<_> = (0..16)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut c = MdsClient::new(vec![addr], Duration::from_secs(3));
                (0..3).map(|_| c.wait_view("g", v.epoch, Duration::from_millis(300)).unwrap().epoch).collect::<Vec<_>>()
            })
        })
        .collect();
    for p in polls {
        assert_eq!(p.join().unwrap(), vec![v.epoch; 3]);
    }
    let reads = mds_counter(&addr, "kvmds_view_reads_total") - reads0;
    let cached = mds_counter(&addr, "kvmds_long_polls_from_cache_total") - cached0;
    assert_eq!(cached, 48, "every long-poll started from the held view");
    assert!(reads <= 1, "48 long-polls read etcd {reads} times");
    // A change still wakes them, and a long-poll from an older epoch is
    // answered at once with the new view.
    let waiting = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            MdsClient::new(vec![addr], Duration::from_secs(3)).wait_view("g", v.epoch, Duration::from_secs(20)).unwrap()
        })
    };
    wait_until(Duration::from_secs(10), "the long-poll waiting", || {
        (mds_counter(&addr, "kvmds_long_polls_waiting") >= 1).then_some(())
    });
    let _n2 = tier.node("n2", 1);
    let after = waiting.join().unwrap();
    assert!(after.epoch > v.epoch && after.members.len() == 2, "{after:?}");
    let mut c = MdsClient::new(vec![addr], Duration::from_secs(3));
    let t0 = Instant::now();
    assert_eq!(c.wait_view("g", v.epoch, Duration::from_secs(5)).unwrap().epoch, after.epoch);
    assert!(t0.elapsed() < Duration::from_secs(2));
}

/// A group switched to the multi-probe rule: a new epoch naming the rule,
/// the Ketama set kept as a previous set, every page still found; a client
/// that does not name the rule, or meets one this build does not know,
/// refuses the group with one clear error instead of guessing.
#[test]
fn a_placement_switch_keeps_pages_and_unknown_rules_are_refused() {
    let _serial = serial();
    let tier = Tier::new(1);
    let _nodes: Vec<Node> = ["n1", "n2", "n3"].iter().map(|id| tier.node(id, 1)).collect();
    let v0 = tier.await_members(0, &["n1", "n2", "n3"], Duration::from_secs(20));
    assert_eq!(v0.placement, None, "a group is placed by Ketama until told otherwise");
    let c = tier.client(&tier.eps());
    let keys: Vec<String> = (0..40).map(|i| format!("pm-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(c.putv(k.as_bytes(), &[&page(i)]), Status::Ok);
    }

    let (code, out, err) =
        run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g", "--set-placement", "multiprobe"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("places keys by multiprobe") && out.contains("placement multiprobe"), "{out}");
    let v1 = tier.view(0).unwrap();
    assert_eq!(v1.placement.as_deref(), Some("multiprobe"));
    assert!(v1.epoch > v0.epoch, "a rule switch is a new epoch");
    assert_eq!(v1.members, v0.members);
    let p = &v1.previous[0];
    assert_eq!((p.epoch, p.placement.as_deref(), p.joined.len(), p.left.len()), (v0.epoch, None, 0, 0), "{v1:?}");
    wait_until(Duration::from_secs(10), "the client on the new epoch", || (c.core.epoch() == v1.epoch).then_some(()));
    assert_eq!(c.core.topology().ring.placement(), kv_common::ring::Placement::MultiProbe);
    for (i, k) in keys.iter().enumerate() {
        let mut buf = vec![0u8; 4096];
        assert_eq!(c.getv(k.as_bytes(), &mut [&mut buf]), Ok(4096), "{k} after the switch");
        assert_eq!(buf, page(i));
    }

    // A client of the previous release names no rules: one clear error.
    let raw = MdsClient::new(vec![tier.mds[0].addr.clone()], Duration::from_secs(2));
    let (status, body) = raw.request(&tier.mds[0].addr, "GET", "/v1/groups/g/view", None, Duration::ZERO).unwrap();
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("multiprobe") && body.contains("upgrade"), "{body}");

    // A rule this build does not know (written by a newer release).
    let (ok, out) = tier.etcd.etcdctl(&["put", "/kvcellar/v1/groups/g/placement", "rendezvous-v9"]);
    assert!(ok, "{out}");
    // The reason is the latest poll's: on a loaded machine one poll may
    // time out in between, so wait for the refusal's own.
    wait_until(Duration::from_secs(10), "the client refusing the group", || {
        let why = c.core.discovery_error().unwrap_or_default();
        (c.core.topology().nodes.is_empty() && why.contains("rendezvous-v9")).then_some(())
    });
    assert_eq!(c.exist(keys[0].as_bytes()), Status::Unavailable);
    let why = c.core.discovery_error().unwrap_or_default();
    assert!(why.contains("rendezvous-v9") && why.contains("upgrade"), "{why}");
    let fresh = BlockingClient::new(Vec::new(), geo(), Options::default()).unwrap();
    let eps = kv_common::mds::parse_endpoints(&tier.eps()).unwrap();
    match fresh.start_discovery(eps, "g".into(), POLL).expect("discovery thread") {
        Err((st, msg)) => assert!(st == Status::Einval && msg.contains("rendezvous-v9"), "{st:?} {msg}"),
        Ok(e) => panic!("a group placed by an unknown rule was followed at epoch {e}"),
    }
    let (code, _, err) = run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g"]);
    assert!(code == 2 && err.contains("rendezvous-v9"), "{code} {err}");

    // Back to Ketama: the client follows the group again and finds every page.
    let (code, _, err) = run("kvctl", &["ring", "--mds", &tier.eps(), "--group", "g", "--set-placement", "ketama"]);
    assert_eq!(code, 0, "{err}");
    wait_until(Duration::from_secs(10), "the client back on the group", || {
        (c.core.topology().nodes.len() == 3).then_some(())
    });
    assert_eq!(c.core.topology().ring.placement(), kv_common::ring::Placement::Ketama);
    for k in &keys {
        assert_eq!(c.exist(k.as_bytes()), Status::Ok, "{k} back under Ketama");
    }
    // A client of the previous release follows the group again, and is not
    // sent the sets placed by rules it does not know (it would build their
    // rings by Ketama); this release's clients get them.
    let (status, body) = raw.request(&tier.mds[0].addr, "GET", "/v1/groups/g/view", None, Duration::ZERO).unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let old: View = serde_json::from_slice(&body).unwrap();
    assert!(!old.previous.is_empty() && old.previous.iter().all(|p| p.placement.is_none()), "{old:?}");
    let now = tier.view(0).unwrap();
    assert!(now.previous.iter().any(|p| p.placement.as_deref() == Some("multiprobe")), "{now:?}");
}

/// Long-polls that take deltas get the change against the epoch they hold
/// (a few hundred bytes, not the member list), made once and shared by
/// every waiter; one that holds no epoch the replica knows gets it whole.
#[test]
fn an_epoch_change_reaches_waiters_as_one_shared_delta() {
    let _serial = serial();
    let tier = Tier::new(1);
    let _n1 = tier.node("n1", 1);
    let _n2 = tier.node("n2", 1);
    let v = tier.await_members(0, &["n1", "n2"], Duration::from_secs(20));
    let addr = tier.mds[0].addr.clone();
    let mut c = MdsClient::new(vec![addr.clone()], Duration::from_secs(3));
    // At its deadline with nothing new: a change of nothing.
    let same = c.wait_view_delta("g", v.epoch, Duration::from_millis(200)).unwrap();
    assert_eq!(same.delta.as_ref().map(|d| (d.base, d.put.len(), d.removed.len(), d.count)), Some((v.epoch, 0, 0, 2)));
    assert_eq!(same.resolve(Some((v.epoch, &v.members))).unwrap().members, v.members);

    let enc0 = mds_counter(&addr, "kvmds_view_encodings_total");
    let deltas0 = mds_counter(&addr, "kvmds_views_delta_total");
    let waiters: Vec<_> = (0..24)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                MdsClient::new(vec![addr], Duration::from_secs(3))
                    .wait_view_delta("g", v.epoch, Duration::from_secs(30))
                    .unwrap()
            })
        })
        .collect();
    wait_until(Duration::from_secs(10), "24 long-polls waiting", || {
        (mds_counter(&addr, "kvmds_long_polls_waiting") >= 24).then_some(())
    });
    let _n3 = tier.node("n3", 1);
    for w in waiters {
        let got = w.join().unwrap();
        let d = got.delta.clone().expect("a delta");
        assert_eq!((d.base, d.put.len(), d.removed.len(), d.count), (v.epoch, 1, 0, 3), "{got:?}");
        assert_eq!(d.put[0].id, "n3");
        let whole = got.resolve(Some((v.epoch, &v.members))).unwrap();
        assert_eq!(whole.members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["n1", "n2", "n3"]);
    }
    let encodings = mds_counter(&addr, "kvmds_view_encodings_total") - enc0;
    assert_eq!(mds_counter(&addr, "kvmds_views_delta_total") - deltas0, 24);
    assert!(encodings <= 2, "24 waiters answered from {encodings} encodings");
    // An epoch this replica never served: the whole view.
    let full = c.wait_view_delta("g", 1, Duration::from_secs(5)).unwrap();
    assert!(full.delta.is_none() && full.members.len() == 3, "{full:?}");
    // Clients of the previous release never get a delta.
    let old = c.wait_view("g", v.epoch, Duration::from_secs(5)).unwrap();
    assert!(old.delta.is_none() && old.members.len() == 3);
}

/// A fleet coming up registers dozens of nodes at once on every replica,
/// each registration settling an epoch that names its node while the others
/// keep moving it: every one is answered with such an epoch, none is told
/// to retry, and both replicas end on one view naming them all.
#[test]
fn a_fleet_registering_at_once_on_two_replicas_is_never_told_to_retry() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    // A long TTL: these nodes never heartbeat.
    let mds: Vec<Mds> = (0..2).map(|_| Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "60s", &[])).collect();
    const N: usize = 96;
    let regs: Vec<_> = (0..N)
        .map(|i| {
            let addr = mds[i % 2].addr.clone();
            std::thread::spawn(move || {
                let mut c = MdsClient::new(vec![addr], Duration::from_secs(5));
                let req = kv_common::mds::RegisterRequest {
                    addr: format!("127.0.0.1:{}", 20000 + i),
                    weight: 1,
                    instance: format!("i-{i}"),
                    metrics_addr: None,
                };
                c.register("g", &format!("n{i:03}"), &req)
            })
        })
        .collect();
    let mut newest = 0;
    for (i, r) in regs.into_iter().enumerate() {
        let reply = r.join().unwrap().unwrap_or_else(|e| panic!("node {i}: {e}"));
        assert!(reply.epoch > 0, "node {i} answered without an epoch");
        newest = newest.max(reply.epoch);
    }
    let view = |m: &Mds| {
        let mut v = MdsClient::new(vec![m.addr.clone()], Duration::from_secs(5)).view("g").ok()?;
        v.previous.iter_mut().for_each(|p| p.remaining_ms = 0);
        Some(v)
    };
    let v = wait_until(Duration::from_secs(10), "one view on both replicas", || {
        let (a, b) = (view(&mds[0])?, view(&mds[1])?);
        (a == b && a.members.len() == N).then_some(a)
    });
    assert!(v.epoch >= newest, "{} < {newest}", v.epoch);
    // One replica's calls settle one at a time, one read serving every call
    // that came before it: only the two replicas race for the epoch key.
    let sum = |name: &str| mds.iter().map(|m| mds_counter(&m.addr, name)).sum::<u64>();
    let (retries, shared) = (sum("kvmds_epoch_settle_retries_total"), sum("kvmds_view_reads_shared_total"));
    println!("{N} registrations at once on 2 replicas: {shared} shared a read, {retries} settle rounds begun again");
    assert!(retries < N as u64 / 4, "{retries} settle rounds begun again for {N} registrations");
}

/// The live etcd leases, as `etcdctl lease list` counts them.
fn live_leases(etcd: &Etcd) -> usize {
    let (ok, out) = etcd.etcdctl(&["lease", "list"]);
    assert!(ok, "{out}");
    out.lines()
        .find_map(|l| l.strip_prefix("found ").and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()))
        .unwrap_or_else(|| panic!("no lease count in {out:?}"))
}

/// Every member-set change writes a history key on a lease of the handoff
/// window and trims the history to the newest 4 keys: the trimmed keys'
/// leases are revoked with them, so live leases stay at the members' plus
/// at most 4, however many changes a long window sees.
#[test]
fn trimmed_history_keys_take_their_leases_with_them() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    // A day's window and a long TTL (these nodes never heartbeat).
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "60s", &["--handoff-secs", "86400"]);
    let mut c = MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(5));
    let reg = |c: &mut MdsClient, id: &str, weight: u32| {
        let req = kv_common::mds::RegisterRequest {
            addr: format!("127.0.0.1:{}", 20000 + weight),
            weight,
            instance: id.to_string(),
            metrics_addr: None,
        };
        c.register("g", id, &req).unwrap_or_else(|e| panic!("register {id}: {e}")).epoch
    };
    let mut last = reg(&mut c, "a", 1);
    reg(&mut c, "b", 1);
    // "b" joining wrote the first history key; each weight change of "a"
    // (a new lease for it, its old one revoked) writes one more.
    const CHANGES: u32 = 12;
    for w in 2..=CHANGES + 1 {
        let epoch = reg(&mut c, "a", w);
        assert!(epoch > last, "a weight change is a new epoch");
        last = epoch;
        let leases = live_leases(&etcd);
        assert!(leases <= 2 + 4, "after {} changes: {leases} live leases (2 members, at most 4 history keys)", w);
    }
    let v = c.view("g").unwrap();
    assert_eq!(v.previous.len(), 4, "{v:?}");
    assert_eq!(live_leases(&etcd), 2 + 4);
    let history = CHANGES as u64 + 1;
    assert_eq!(mds_counter(&mds.addr, "kvmds_history_leases_revoked_total"), history - 4);
}

/// A member record for a node that never runs (discovery does not dial
/// members): registering it through `c` changes the member set.
fn register_fake(c: &mut MdsClient, id: &str, port: u16) -> u64 {
    let req = kv_common::mds::RegisterRequest {
        addr: format!("127.0.0.1:{port}"),
        weight: 1,
        instance: id.to_string(),
        metrics_addr: None,
    };
    c.register("g", id, &req).unwrap_or_else(|e| panic!("register {id}: {e}")).epoch
}

/// A replica whose held view lags the group (its watch frozen by the
/// test-only hook, as a watch that has not delivered a change yet) answers
/// a plain poll with `min_epoch` from etcd; and a client whose poll after a
/// 422 lands on it never takes the older view back.
#[test]
fn a_replica_holding_an_older_view_never_steps_a_client_back() {
    let _serial = serial();
    let t = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(t.path().join("etcd"));
    let mut fresh = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "60s", &[]);
    let mut via_fresh = MdsClient::new(vec![fresh.addr.clone()], Duration::from_secs(5));
    let e1 = register_fake(&mut via_fresh, "a", 21001);
    // A client on both replicas, the frozen one not up yet: whichever it
    // tries first, it follows the group on the fresh one.
    let frozen_addr = format!("127.0.0.1:{}", kv_e2e::cluster::free_port());
    let c = BlockingClient::new(Vec::new(), geo(), Options::parse("connect_timeout_ms=500").unwrap()).expect("client");
    let eps = kv_common::mds::parse_endpoints(&format!("{},{frozen_addr}", fresh.addr)).unwrap();
    let first = c.start_discovery(eps, "g".into(), POLL).expect("discovery thread");
    assert_eq!(first, Ok(e1));
    let frozen = Mds::start_env(&frozen_addr, &etcd.endpoint(), "60s", &[("KVMDS_TEST_FREEZE_HELD_VIEW", "1")]);
    let mut via_frozen = MdsClient::new(vec![frozen.addr.clone()], Duration::from_secs(5));
    // The frozen replica's first view of the group is the one it keeps.
    assert_eq!(via_frozen.view("g").unwrap().epoch, e1);
    let e2 = register_fake(&mut via_fresh, "b", 21002);
    assert!(e2 > e1);
    // Until its watch runs a replica reads etcd for every poll; from then
    // on it answers plain polls with the view it holds: e1.
    wait_until(Duration::from_secs(10), "the frozen replica answering its held view", || {
        (via_frozen.view("g").unwrap().epoch == e1).then_some(())
    });

    // (a) min_epoch: the held view is older, so etcd is read.
    let behind = mds_counter(&frozen.addr, "kvmds_polls_behind_min_epoch_total");
    let path = format!("/v1/groups/g/view?min_epoch={e2}");
    let (code, body) = via_frozen.request(&frozen.addr, "GET", &path, None, Duration::ZERO).unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let v: View = serde_json::from_slice(&body).unwrap();
    assert_eq!(v.epoch, e2, "a plain poll with min_epoch={e2}");
    assert_eq!(via_frozen.view_at_least("g", e2).unwrap().epoch, e2);
    assert_eq!(mds_counter(&frozen.addr, "kvmds_polls_behind_min_epoch_total"), behind + 2);
    let (code, _) =
        via_frozen.request(&frozen.addr, "GET", "/v1/groups/g/view?min_epoch=x", None, Duration::ZERO).unwrap();
    assert_eq!(code, 400);
    assert_eq!(via_frozen.view("g").unwrap().epoch, e1, "without min_epoch, still the held view");

    // (b) The client, on the fresh replica, takes e2.
    wait_until(Duration::from_secs(10), "the client on e2", || (c.core.epoch() == e2).then_some(()));
    // MDS epochs the client is seen on (while it refuses the group it has
    // no ring, and a local epoch).
    let mut seen = vec![e2];
    let mut look = |c: &BlockingClient| {
        let topo = c.core.topology();
        if !topo.nodes.is_empty() && seen.last() != Some(&topo.epoch) {
            seen.push(topo.epoch);
        }
    };
    // The group placed by a rule no build knows: every view is a 422, and
    // the client asks for a whole view again after each.
    let placement = format!("{}g/placement", kv_common::mds::ETCD_ROOT);
    let (ok, out) = etcd.etcdctl(&["put", &placement, "no-such-rule"]);
    assert!(ok, "{out}");
    let e3 = register_fake(&mut via_fresh, "c", 21003);
    wait_until(Duration::from_secs(10), "the client refusing the group", || {
        look(&c);
        c.core.discovery_error().filter(|e| e.contains("no-such-rule")).map(|_| ())
    });
    // Its next poll after the 422 fails over to the frozen replica, which
    // holds e1 (and would answer it to a plain poll): it must read etcd.
    let failovers = c.core.metrics.mds_failovers.load(Ordering::Relaxed);
    fresh.kill9();
    let (ok, out) = etcd.etcdctl(&["del", &placement]);
    assert!(ok, "{out}");
    let e4 = register_fake(&mut via_frozen, "d", 21004);
    assert!(e4 > e3 && e3 > e2);
    wait_until(Duration::from_secs(10), "the client on the frozen replica's fresh read", || {
        look(&c);
        (c.core.epoch() == e4).then_some(())
    });
    assert!(c.core.metrics.mds_failovers.load(Ordering::Relaxed) > failovers, "the client moved to the frozen replica");
    assert!(!seen.contains(&e1), "the client took the frozen replica's older view: {seen:?}");
    assert_eq!(c.core.metrics.mds_epoch_regressions.load(Ordering::Relaxed), 0);
    assert!(c.stats_text().contains("kvclient_mds_epoch_regressions_total 0"));
    assert_eq!(via_frozen.view("g").unwrap().epoch, e1, "the frozen replica still held e1");
}
