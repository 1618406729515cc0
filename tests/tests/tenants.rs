//! Tenants end to end (docs/DEPLOY.md, "Tenants"): a real etcd, kv-mds and
//! nodes given one credential table, and clients of the library holding
//! one engine token each. A tenant's keys live in its own namespace at
//! every node: another tenant (or the default one) sending the same key
//! bytes reads, finds, overwrites and deletes nothing of it, by single or
//! batch calls, whatever prefix it puts in front.

use std::time::Duration;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::Node;
use kvclient::{BlockingClient, Options};

/// Two tenants' engines, the default tenant's, an admin and the nodes.
const TABLE: &str = "a-token role=engine tenant=team-a\n\
                     b-token role=engine tenant=team-b\n\
                     d-token role=engine\n\
                     adm     role=admin\n\
                     nodes   role=node\n";

fn geo() -> Geometry {
    Geometry { model_hash: 21, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.to_str().unwrap().to_string()
}

fn page(seed: u8) -> Vec<u8> {
    (0..12_288).map(|i| (i as u8).wrapping_mul(seed) ^ seed).collect()
}

/// A real etcd, kv-mds and 3 nodes of group `g`, sharing one credential
/// table. Fields drop in order: nodes, kv-mds, etcd, then their files.
struct Group {
    nodes: Vec<Node>,
    mds: Mds,
    etcd: Etcd,
    table: String,
    t: tempfile::TempDir,
}

impl Group {
    fn start(table: &str, node_args: &[&str]) -> Group {
        let t = tempfile::tempdir().unwrap();
        let table = write(t.path(), "group.tokens", table);
        let etcd = Etcd::start(t.path().to_path_buf());
        let tokens = format!("g={table}");
        let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--group-token-file", &tokens]);
        let nodes = (1..=3)
            .map(|i| {
                let id = format!("n{i}");
                let d = t.path().join(&id);
                let mut args = vec!["--no-sync", "--auth-token-file", table.as_str()];
                args.extend_from_slice(node_args);
                Node::member("kv-server", "127.0.0.1:0", d.to_str().unwrap(), &mds.addr, "g", &id, &args)
            })
            .collect();
        Group { nodes, mds, etcd, table, t }
    }

    /// A client of the library holding `token` alone, once it routes to
    /// `n` nodes.
    fn client(&self, token: &str, n: usize) -> BlockingClient {
        let f = write(self.t.path(), &format!("{token}.client"), token);
        let o = Options::parse(&format!("auth_token_file={f},io_timeout_ms=3000,connect_timeout_ms=1000")).unwrap();
        let c = BlockingClient::new(Vec::new(), geo(), o).unwrap();
        assert!(c
            .start_discovery(vec![self.mds.addr.clone()], "g".into(), Duration::from_millis(200))
            .unwrap()
            .is_ok());
        wait_until(Duration::from_secs(20), "the client to route to the group", || {
            (c.core.topology().nodes.len() == n).then_some(())
        });
        c
    }
}

/// A node's statistics, read with the table's node credential `nodes`.
fn stats(addr: &str) -> kv_common::stats::NodeStats {
    let tok = kv_common::auth::Token::new(b"nodes").unwrap();
    kvclient::Conn::connect_with(addr, Duration::from_secs(2), Some(&tok)).unwrap().stats().unwrap()
}

#[test]
fn two_tenants_sending_the_same_keys_never_touch_each_others_pages() {
    let mut g = Group::start(TABLE, &[]);
    let (t, table) = (g.t.path().to_path_buf(), g.table.clone());
    let (a, b, d) = (g.client("a-token", 3), g.client("b-token", 3), g.client("d-token", 3));
    let keys: Vec<Vec<u8>> = (0..12).map(|i| format!("shared-prefix/block-{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let get = |c: &BlockingClient, k: &[u8]| {
        let mut buf = vec![0u8; 12_288];
        c.getv(k, &mut [&mut buf[..]]).map(|n| buf[..n].to_vec())
    };

    // Tenant A writes; B and the default tenant find none of it.
    for k in &keys {
        assert_eq!(a.putv(k, &[&page(1)]), Status::Ok);
    }
    for other in [&b, &d] {
        assert!(other.batch_exist(&refs).iter().all(|s| *s == Status::Miss));
        assert_eq!(other.exist(&keys[0]), Status::Miss);
        assert_eq!(get(other, &keys[0]), Err((Status::Miss, 0)));
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 12_288]).collect();
        let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
            keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (&k[..], vec![&mut b[..]])).collect();
        assert!(other.batch_getv(&mut items).iter().all(|r| r.0 == Status::Miss));
        // Deleting the same names deletes nothing of A's.
        assert_eq!(other.delete(&keys[0]), Status::Miss);
        assert!(other.batch_delete(&refs[1..4]).iter().all(|s| *s == Status::Miss));
    }
    // B and the default tenant write the same names: their own pages, not
    // duplicates of A's.
    for k in &keys {
        assert_eq!(b.putv(k, &[&page(2)]), Status::Ok);
    }
    let p3 = page(3);
    let d_items: Vec<(&[u8], Vec<&[u8]>)> = refs.iter().map(|k| (*k, vec![&p3[..]])).collect();
    assert!(d.batch_putv(&d_items).iter().all(|s| *s == Status::Ok));
    for k in &keys {
        assert_eq!(get(&a, k).unwrap(), page(1), "A reads its own page");
        assert_eq!(get(&b, k).unwrap(), page(2), "B reads its own page");
        assert_eq!(get(&d, k).unwrap(), page(3), "the default tenant reads its own page");
    }
    // B deletes its pages: A's and the default tenant's stay.
    assert!(b.batch_delete(&refs).iter().all(|s| *s == Status::Ok));
    assert!(b.batch_exist(&refs).iter().all(|s| *s == Status::Miss));
    assert!(a.batch_exist(&refs).iter().all(|s| *s == Status::Ok));
    assert!(d.batch_exist(&refs).iter().all(|s| *s == Status::Ok));
    assert_eq!(get(&a, &keys[5]).unwrap(), page(1));
    // The nodes count what each tenant holds: 12 pages of A's, 12 of the
    // default tenant's, none of B's now (its 12 deletes were no evictions).
    let held = |name: &str| -> (u64, u64) {
        g.nodes.iter().flat_map(|n| stats(&n.addr).tenants).filter(|t| t.tenant == name).fold((0, 0), |a, t| {
            assert_eq!(t.evictions, 0, "{name}: nothing was evicted");
            (a.0 + t.objects, a.1 + t.bytes)
        })
    };
    assert_eq!(held("team-a").0, 12);
    assert_eq!(held("default").0, 12);
    assert_eq!(held("team-b").0, 0);
    assert_eq!(g.nodes.iter().map(|n| stats(&n.addr).objects).sum::<u64>(), 24);
    // kvctl shows them per node and in total.
    let nodes_token = write(&t, "nodes.file", "nodes");
    let args = ["--auth-token-file", &nodes_token, "stat", "--all", "--mds", &g.mds.addr, "--group", "g", "--tenants"];
    let (code, out, err) = kv_e2e::run("kvctl", &args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("TENANT") && out.contains("team-a") && out.contains("TOTAL"), "{out}");

    // A restart rebuilds each tenant's holding exactly, from the journal.
    let before: Vec<_> = stats(&g.nodes[0].addr).tenants;
    let old = g.nodes.remove(0);
    old.signal(libc::SIGTERM);
    assert!(old.wait_exit(Duration::from_secs(30)).success());
    let d = t.join("n1");
    let args = ["--no-sync", "--auth-token-file", table.as_str()];
    let again = Node::member("kv-server", "127.0.0.1:0", d.to_str().unwrap(), &g.mds.addr, "g", "n1", &args);
    let after: Vec<_> = stats(&again.addr).tenants;
    let sized = |v: &[kv_common::stats::TenantStats]| {
        let mut v: Vec<(String, u64, u64)> =
            v.iter().filter(|t| t.objects > 0).map(|t| (t.tenant.clone(), t.bytes, t.objects)).collect();
        v.sort();
        v
    };
    assert_eq!(sized(&after), sized(&before), "per-tenant bytes and records after a restart");
    assert!(sized(&before).iter().any(|t| t.0 == "team-a"), "{before:?}");
}

/// Quotas end to end (docs/DEPLOY.md, "Tenants"): an admin gives two
/// tenants half of every node each (`kvctl tenants --set`; an engine's
/// token gets a 403); tenant A writes three times the group's capacity
/// while tenant B reads its working set, a fifth of it, throughout. B
/// keeps every page and misses none (a read that times out on this small
/// machine is counted, and must stay under 0.1 %); A evicts its own. A
/// holds more than its half while B leaves it idle, and B's next writes
/// take that back without B losing a page.
#[test]
fn a_flooding_tenant_evicts_its_own_pages_and_lends_back() {
    const PAGE: usize = 256 << 10;
    // 3 nodes of 16 MiB: the group holds 48 MiB.
    let g = Group::start(TABLE, &["--cap", "16M"]);
    let (mds, nodes) = (&g.mds, &g.nodes);
    let files: Vec<String> =
        ["a-token", "b-token", "adm", "nodes"].iter().map(|n| write(g.t.path(), &format!("{n}.file"), n)).collect();
    let kvctl = |token: &str, args: &[&str]| {
        let mut full = vec!["--auth-token-file", token, "--admin-token-file", token, "tenants", "--mds", &mds.addr];
        full.extend_from_slice(&["--group", "g"]);
        full.extend_from_slice(args);
        kv_e2e::run("kvctl", &full)
    };
    // An engine cannot set a quota; a share that does not parse is one
    // line; kv-mds refuses one too, and keeps what it had.
    let (code, out, err) = kvctl(&files[0], &["--set", "team-a=50%"]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(err.contains("not allowed") && err.contains("admin credential"), "{err}");
    let (code, _, err) = kvctl(&files[2], &["--set", "team-a=150%"]);
    assert!(code != 0 && err.lines().count() == 1 && err.contains("at most 100%"), "{err}");
    let adm = kv_common::auth::Token::new(b"adm").unwrap();
    let mut mc = kv_common::mds::MdsClient::from_csv(&mds.addr, Duration::from_secs(3)).unwrap().with_token(Some(adm));
    let refused = mc.set_quota("g", "team-a", Some("-1G")).unwrap_err();
    assert!(refused.to_string().contains("quota"), "{refused}");
    for share in ["team-a=50%", "team-b=50%"] {
        let (code, out, err) = kvctl(&files[2], &["--set", share]);
        assert_eq!(code, 0, "{out}{err}");
    }
    let (code, out, _) = kvctl(&files[0], &[]);
    assert!(code == 0 && out.contains("team-a") && out.contains("50%"), "an engine reads the quotas: {out}");
    let tenant = |name: &str| -> kv_common::stats::TenantStats {
        let mut sum = kv_common::stats::TenantStats::default();
        for n in nodes {
            for s in stats(&n.addr).tenants.iter().filter(|s| s.tenant == name) {
                sum.add(s);
            }
        }
        sum
    };
    wait_until(Duration::from_secs(20), "every node to follow the group's quotas", || {
        (tenant("team-a").quota == 24 << 20 && tenant("team-b").quota == 24 << 20).then_some(())
    });

    let (a, b) = (g.client("a-token", 3), g.client("b-token", 3));
    let big = |seed: usize| -> Vec<u8> { (0..PAGE).map(|i| (i ^ seed.wrapping_mul(31)) as u8).collect() };
    // B's working set: 38 pages of 256 KiB, a fifth of the group.
    let b_keys: Vec<String> = (0..38).map(|i| format!("b-set/{i}")).collect();
    for (i, k) in b_keys.iter().enumerate() {
        assert_eq!(b.putv(k.as_bytes(), &[&big(i)]), Status::Ok);
    }
    // A floods 3 x 48 MiB while B reads its set throughout.
    let done = std::sync::atomic::AtomicBool::new(false);
    let (reads, misses, timeouts) = std::thread::scope(|s| {
        s.spawn(|| {
            let p = big(7);
            for i in 0..576 {
                let st = a.putv(format!("a-flood/{i}").as_bytes(), &[&p]);
                assert!(matches!(st, Status::Ok | Status::Timeout), "A's put {i}: {st:?}");
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let (mut reads, mut misses, mut timeouts) = (0u64, 0u64, 0u64);
        let mut buf = vec![0u8; PAGE];
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            for (i, k) in b_keys.iter().enumerate() {
                reads += 1;
                match b.getv(k.as_bytes(), &mut [&mut buf[..]]) {
                    Ok(n) => assert!(n == PAGE && buf == big(i), "B's page {k} is its own"),
                    Err((Status::Timeout, _)) => timeouts += 1,
                    Err((st, _)) => {
                        misses += 1;
                        eprintln!("B's read of {k}: {st:?}");
                    }
                }
            }
        }
        (reads, misses, timeouts)
    });
    eprintln!("B: {reads} reads while A flooded, {misses} misses, {timeouts} timeouts");
    assert_eq!(misses, 0, "B misses none of its pages while A floods");
    assert!(timeouts * 1000 <= reads, "{timeouts} of {reads} timed out");
    assert!(reads >= b_keys.len() as u64, "B read throughout");
    let refs: Vec<&[u8]> = b_keys.iter().map(|k| k.as_bytes()).collect();
    assert!(b.batch_exist(&refs).iter().all(|s| *s == Status::Ok), "every one of B's pages is stored");
    let (ta, tb) = (tenant("team-a"), tenant("team-b"));
    assert!(ta.evictions > 300 && ta.evicted_for_others == 0, "A evicts its own: {ta:?}");
    assert_eq!((tb.evictions, tb.misses, tb.objects), (0, 0, 38), "{tb:?}");
    assert!(ta.puts >= 570 && tb.hits >= reads - timeouts, "{ta:?} {tb:?}");
    // With B idle above its pages, A holds more than its half.
    assert!(ta.bytes > 30 << 20, "A borrows B's idle share: {ta:?}");
    // B's next writes (19 pages more) take the room back.
    for i in 38..57 {
        assert_eq!(b.putv(format!("b-set/{i}").as_bytes(), &[&big(i)]), Status::Ok);
    }
    let (ta, tb) = (tenant("team-a"), tenant("team-b"));
    assert!(ta.evicted_for_others >= 19, "{ta:?}");
    assert_eq!((tb.evictions, tb.objects), (0, 57), "{tb:?}");
    assert!(b.batch_exist(&refs).iter().all(|s| *s == Status::Ok));
    // kvctl shows the quotas and the counts per node and in total.
    let args = ["--auth-token-file", &files[3], "stat", "--all", "--mds", &mds.addr, "--group", "g", "--tenants"];
    let (code, out, err) = kv_e2e::run("kvctl", &args);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("QUOTA") && out.contains("FOR OTHERS") && out.contains("8.0 MiB"), "{out}");
    // kvctl top --tenants: the group's tenants over each refresh, B's
    // reads while it runs.
    let top = ["--auth-token-file", &files[3], "--json", "top", "--mds", &mds.addr, "--group", "g", "--tenants"];
    let top = [&top[..], &["--iterations", "3", "--interval-ms", "700"]].concat();
    let (out, b_reads) = std::thread::scope(|s| {
        let run = s.spawn(|| kv_e2e::run("kvctl", &top));
        let mut n = 0u64;
        while !run.is_finished() {
            let k = &b_keys[n as usize % b_keys.len()];
            // A hit, or a timeout on this loaded machine; never a miss.
            match b.getv(k.as_bytes(), &mut [&mut vec![0u8; 256 << 10][..]]) {
                Ok(len) => assert_eq!(len, 256 << 10),
                Err((st, _)) => assert_eq!(st, Status::Timeout, "B's read of {k}"),
            }
            n += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
        (run.join().unwrap(), n)
    });
    let (code, out, err) = out;
    assert_eq!(code, 0, "{out}{err}");
    let frame: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let row = |name: &str| frame["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == name).cloned().unwrap();
    let (ra, rb) = (row("team-a"), row("team-b"));
    assert_eq!((ra["quota"].as_u64(), rb["quota"].as_u64()), (Some(24 << 20), Some(24 << 20)), "{frame}");
    assert_eq!(rb["objects"], 57);
    assert!(rb["hits"].as_f64().unwrap() > 0.0 && rb["hit"] == 1.0, "B read {b_reads} pages: {rb}");
    assert_eq!(ra["hits"].as_f64(), Some(0.0), "{ra}");
    // Removing a quota: nodes follow; the tenant then borrows like any.
    let (code, out, err) = kvctl(&files[2], &["--unset", "team-a"]);
    assert!(code == 0 && !out.contains("team-a"), "{out}{err}");
    wait_until(Duration::from_secs(20), "every node to drop team-a's quota", || {
        (tenant("team-a").quota == 0).then_some(())
    });
    // A table in etcd that does not parse (written by hand): reading it is
    // one clear line, the nodes keep the quotas they hold, and an admin's
    // next change replaces it.
    let (ok, out) = g.etcd.etcdctl(&["put", "/kvcellar/v1/groups/g/tenants", "{not json"]);
    assert!(ok, "{out}");
    let (code, out, err) = kvctl(&files[2], &[]);
    assert!(code != 0 && err.contains("do not parse") && err.contains("set them again"), "{out}{err}");
    let (code, out, err) = kvctl(&files[2], &["--set", "team-a=40%"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("team-a") && !out.contains("team-b"), "the unreadable table replaced: {out}");
    wait_until(Duration::from_secs(20), "every node to follow the new table", || {
        (tenant("team-b").quota == 0 && tenant("team-a").quota > 0).then_some(())
    });
}

/// A draining node pushes every tenant's pages to their new owners, each
/// tenant's on connections acting for it (a node credential naming the
/// tenant in its hello): once the node is gone each tenant reads its own
/// pages there, and the same key names of another tenant stay misses.
#[test]
fn a_draining_node_pushes_each_tenants_pages_into_its_namespace() {
    let mut g = Group::start(TABLE, &["--drain-secs", "4"]);
    let (a, b) = (g.client("a-token", 3), g.client("b-token", 3));
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("drained/{i}").into_bytes()).collect();
    for k in &keys {
        assert_eq!(a.putv(k, &[&page(1)]), Status::Ok);
        assert_eq!(b.putv(k, &[&page(2)]), Status::Ok);
    }
    let leaving = g.nodes.remove(0);
    let held = stats(&leaving.addr).objects;
    assert!(held >= 8, "the leaving node holds both tenants' pages: {held}");
    leaving.signal(libc::SIGTERM);
    let (status, lines) = leaving.wait_exit_lines(Duration::from_secs(60));
    assert!(status.success());
    let closing = lines.iter().find(|l| l.contains("pages pushed to")).expect("the push's closing line");
    assert!(closing.contains(&format!("{held} of {held} pages pushed")), "{closing}");
    // A client that knows only the group as it is now: each tenant reads
    // its own page at the new owners, none of the other's.
    let (a2, b2, d2) = (g.client("a-token", 2), g.client("b-token", 2), g.client("d-token", 2));
    let mut buf = vec![0u8; 12_288];
    for k in &keys {
        assert_eq!(a2.getv(k, &mut [&mut buf[..]]), Ok(12_288), "A's page after the drain");
        assert_eq!(buf, page(1));
        assert_eq!(b2.getv(k, &mut [&mut buf[..]]), Ok(12_288), "B's page after the drain");
        assert_eq!(buf, page(2));
        assert_eq!(d2.exist(k), Status::Miss, "the default tenant finds neither");
    }
    let per: u64 =
        g.nodes.iter().flat_map(|n| stats(&n.addr).tenants).filter(|t| t.tenant == "default").map(|t| t.objects).sum();
    assert_eq!(per, 0, "nothing landed in the default tenant's namespace");
}
