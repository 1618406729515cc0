//! A rolling upgrade's mixed versions (docs/DEPLOY.md §9, PROTOCOL.md §2.1):
//! binaries of earlier releases beside this release's, in one group, with
//! every page checked byte for byte. `scripts/prev-release.sh` builds them
//! and `scripts/test.sh` names them: KVCELLAR_PREV_BIN_DIR holds the
//! protocol v1 release (the last commit before protocol v2),
//! KVCELLAR_PREV2_BIN_DIR the protocol v2 release (the last commit before
//! protocol v3 and its batch frames), KVCELLAR_PREV3_BIN_DIR the protocol
//! v3 release (the last commit before protocol v4 and its batch writes).
//!
//! Without a directory its test says so and passes, unless
//! KVCELLAR_REQUIRE_PREV=1 (or KVCELLAR_REQUIRE_PREV2=1,
//! KVCELLAR_REQUIRE_PREV3=1), which scripts/test.sh sets when the build
//! worked.

use std::time::Duration;

use kv_common::mds::MdsClient;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::{run, Node};
use kvclient::{BlockingClient, Options};

fn prev_bin(name: &str) -> Option<String> {
    release_bin("KVCELLAR_PREV_BIN_DIR", "KVCELLAR_REQUIRE_PREV", name)
}

fn release_bin(var: &str, require: &str, name: &str) -> Option<String> {
    let dir = match std::env::var(var) {
        Ok(d) if !d.is_empty() => d,
        _ => {
            assert!(std::env::var(require).as_deref() != Ok("1"), "{var} is not set (scripts/prev-release.sh)");
            eprintln!("mixed versions: {var} not set: skipped (run scripts/prev-release.sh)");
            return None;
        }
    };
    let p = std::path::Path::new(&dir).join(name);
    assert!(p.is_file(), "{} missing", p.display());
    Some(p.to_str().unwrap().to_string())
}

fn geo() -> Geometry {
    Geometry { model_hash: 5, page_size: 16, dtype_tag: 2, tp_size: 1, ..Geometry::default() }
}

/// Content derived from the key: every byte read back is checked.
fn page(key: &str) -> Vec<u8> {
    let seed = key.bytes().fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..20_000u32).map(|i| (seed.wrapping_add(i.wrapping_mul(2_654_435_761)) >> 13) as u8).collect()
}

/// One batch get of `keys`, every page checked byte for byte.
fn batch_reads_every_page(c: &BlockingClient, keys: &[String]) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 20_000]).collect();
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (k.as_bytes(), vec![&mut b[..]])).collect();
    let res = c.batch_getv(&mut items);
    drop(items);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(res[i], (Status::Ok, 20_000), "{k} in a batch");
        assert!(bufs[i] == page(k), "{k}: wrong bytes in a batch");
    }
}

#[test]
fn previous_and_this_release_serve_one_group() {
    let (Some(old_server), Some(old_mds), Some(old_kvctl)) =
        (prev_bin("kv-server"), prev_bin("kv-mds"), prev_bin("kvctl"))
    else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(t.path().to_path_buf());
    // One replica of each release, sharing etcd.
    let mds_new = Mds::start(&etcd.endpoint(), "3s");
    let mds_old = Mds::start_bin(&old_mds, "127.0.0.1:0", &etcd.endpoint(), "3s", &[]);
    let eps = format!("{},{}", mds_old.addr, mds_new.addr);
    let d_old = t.path().join("old");
    let d_new = t.path().join("new");
    let quiet = ["--no-sync", "--log-level", "info"];
    let old = Node::member(&old_server, "127.0.0.1:0", d_old.to_str().unwrap(), &eps, "g", "old", &quiet);
    let drains = ["--no-sync", "--log-level", "info", "--drain-secs", "30", "--no-drain-push"];
    let new = Node::member("kv-server", "127.0.0.1:0", d_new.to_str().unwrap(), &eps, "g", "new", &drains);
    for replica in [&mds_old.addr, &mds_new.addr] {
        wait_until(Duration::from_secs(20), "both nodes in the view of each replica", || {
            MdsClient::new(vec![replica.clone()], Duration::from_secs(2))
                .view("g")
                .ok()
                .filter(|v| v.members.len() == 2)
        });
    }

    // This release's client, discovering through the old replica, with a
    // token (the old node checks none): keys on both nodes, all intact.
    let tok = t.path().join("token");
    std::fs::write(&tok, "rolling-upgrade-token").unwrap();
    let opts = format!("auth_token_file={},io_timeout_ms=5000", tok.display());
    let c = BlockingClient::new(Vec::new(), geo(), Options::parse(&opts).unwrap()).unwrap();
    let first = c.start_discovery(vec![mds_old.addr.clone()], "g".into(), Duration::from_millis(500)).unwrap();
    assert!(first.is_ok(), "{first:?}");
    let keys: Vec<String> = (0..40).map(|i| format!("mixed-{i}")).collect();
    for k in &keys {
        assert_eq!(c.putv(k.as_bytes(), &[&page(k)]), Status::Ok, "{k}");
    }
    let mut buf = vec![0u8; 20_000];
    for k in &keys {
        assert_eq!(c.getv(k.as_bytes(), &mut [&mut buf[..]]), Ok(buf.len()), "{k}");
        assert!(buf == page(k), "{k}: wrong bytes");
    }
    // One batch over both nodes: BATCH_GET frames to this release's node,
    // one GET an item to the previous release's (it agreed on v1).
    batch_reads_every_page(&c, &keys);
    let on = |addr: &str| {
        let mut conn = kvclient::Conn::connect(addr, Duration::from_secs(5)).unwrap();
        conn.stats().unwrap()
    };
    let (objs_old, objs_new) = (on(&old.addr).objects, on(&new.addr).objects);
    assert!(objs_old > 0 && objs_new > 0, "keys on both nodes: old {objs_old}, new {objs_new}");

    // The previous release's kvctl (a v1 client) against this release's node.
    let (code, out, err) = run(&old_kvctl, &["put", "--node", &new.addr, "from-old-kvctl", "hello-v1"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(&old_kvctl, &["get", "--node", &new.addr, "from-old-kvctl"]);
    assert_eq!((code, out.as_str()), (0, "hello-v1"), "{err}");
    let s = on(&new.addr);
    assert!(s.v1_connections >= 2, "the node counted the v1 clients: {s:?}");
    // This release's kvctl against the previous release's node.
    let (code, out, err) =
        run("kvctl", &["--auth-token-file", tok.to_str().unwrap(), "put", "--node", &old.addr, "from-new", "v2"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(&old_kvctl, &["get", "--node", &old.addr, "from-new"]);
    assert_eq!((code, out.as_str()), (0, "v2"), "{err}");

    // The previous release's kvctl through this release's kv-mds: the view's
    // new fields (previous sets, handoff_ms) are ignored.
    let (code, out, err) = run(&old_kvctl, &["ring", "--mds", &mds_new.addr, "--group", "g"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("old") && out.contains("new"), "{out}");
    let (code, out, err) = run(&old_kvctl, &["put", "--mds", &mds_new.addr, "--group", "g", "old-via-new-mds", "x"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(&old_kvctl, &["get", "--mds", &mds_new.addr, "--group", "g", "old-via-new-mds"]);
    assert_eq!((code, out.as_str()), (0, "x"), "{err}");

    // This release's client follows the old replica, whose views have no
    // previous sets: it keeps the set it held itself, so a node of this
    // release stopping (it drains) loses no hit.
    let on_new: Vec<&String> = keys
        .iter()
        .filter(|k| {
            let t = c.core.topology();
            t.nodes[t.ring.owner(k.as_bytes()).unwrap()].id == "new"
        })
        .collect();
    assert!(!on_new.is_empty());
    new.signal(libc::SIGTERM);
    wait_until(Duration::from_secs(20), "the client to drop the stopped node", || {
        (c.core.topology().nodes.len() == 1).then_some(())
    });
    assert_eq!(c.core.topology().previous.len(), 1, "the set it held, kept without the view's help");
    for k in &keys {
        assert_eq!(c.getv(k.as_bytes(), &mut [&mut buf[..]]), Ok(buf.len()), "{k} after the stop");
        assert!(buf == page(k), "{k}: wrong bytes");
    }
    assert!(c.core.metrics.handoff.hits.load(std::sync::atomic::Ordering::Relaxed) >= on_new.len() as u64);

    // A node of this release with a token refuses the old client clearly.
    let d_tok = t.path().join("tok");
    let guarded =
        Node::start(&["--dir", d_tok.to_str().unwrap(), "--cap", "64M", "--auth-token-file", tok.to_str().unwrap()]);
    let (code, out, err) = run(&old_kvctl, &["put", "--node", &guarded.addr, "k", "v"]);
    assert_ne!(code, 0, "{out}{err}");
    // (The previous release words it as a protocol mismatch: "node speaks
    // protocol v4", the node's newest version, which carries a token.)
    assert!(err.contains("protocol v4"), "{err}");
    let (code, out, err) =
        run("kvctl", &["--auth-token-file", tok.to_str().unwrap(), "put", "--node", &guarded.addr, "k", "v"]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn the_v2_release_and_this_one_serve_one_group_with_tokens() {
    one_group_with_tokens("v2", "KVCELLAR_PREV2_BIN_DIR", "KVCELLAR_REQUIRE_PREV2");
}

#[test]
fn the_v3_release_and_this_one_serve_one_group_with_tokens() {
    one_group_with_tokens("v3", "KVCELLAR_PREV3_BIN_DIR", "KVCELLAR_REQUIRE_PREV3");
}

/// A group of one node of the release `label` (protocol v2 or v3) and one
/// of this release, both with a token, and a kv-mds of each: this
/// release's client writes and deletes in batches (BATCH_PUT and
/// BATCH_DELETE frames to the new node, single frames to the old one) and
/// reads in one batch, and each release's kvctl works against the other's
/// node and kv-mds.
fn one_group_with_tokens(label: &str, var: &str, require: &str) {
    let bin = |n| release_bin(var, require, n);
    let (Some(old_server), Some(old_mds), Some(old_kvctl)) = (bin("kv-server"), bin("kv-mds"), bin("kvctl")) else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let tok = t.path().join("token");
    std::fs::write(&tok, "rolling-upgrade-token").unwrap();
    let tok_s = tok.to_str().unwrap();
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds_new = Mds::start(&etcd.endpoint(), "3s");
    let mds_old = Mds::start_bin(&old_mds, "127.0.0.1:0", &etcd.endpoint(), "3s", &[]);
    let eps = format!("{},{}", mds_old.addr, mds_new.addr);
    let (d_old, d_new) = (t.path().join("old"), t.path().join("new"));
    let args = ["--no-sync", "--log-level", "info", "--auth-token-file", tok_s];
    let old = Node::member(&old_server, "127.0.0.1:0", d_old.to_str().unwrap(), &eps, "g", "old", &args);
    let new = Node::member("kv-server", "127.0.0.1:0", d_new.to_str().unwrap(), &eps, "g", "new", &args);
    for replica in [&mds_old.addr, &mds_new.addr] {
        wait_until(Duration::from_secs(20), "both nodes in the view of each replica", || {
            MdsClient::new(vec![replica.clone()], Duration::from_secs(2))
                .view("g")
                .ok()
                .filter(|v| v.members.len() == 2)
        });
    }
    // This release's client, through the old replica: the old node refuses
    // its hello and takes the older version with the token.
    let opts = format!("auth_token_file={tok_s},io_timeout_ms=5000");
    let c = BlockingClient::new(Vec::new(), geo(), Options::parse(&opts).unwrap()).unwrap();
    let first = c.start_discovery(vec![mds_old.addr.clone()], "g".into(), Duration::from_millis(500)).unwrap();
    assert!(first.is_ok(), "{first:?}");
    let keys: Vec<String> = (0..40).map(|i| format!("{label}-mixed-{i}")).collect();
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page(k)).collect();
    let items: Vec<(&[u8], Vec<&[u8]>)> = keys.iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert_eq!(c.batch_putv(&items), vec![Status::Ok; 40], "a batch put over both nodes");
    batch_reads_every_page(&c, &keys);
    let stats = |addr: &str| {
        let token = kv_common::auth::Token::new(b"rolling-upgrade-token").unwrap();
        let mut conn = kvclient::Conn::connect_with(addr, Duration::from_secs(5), Some(&token)).unwrap();
        conn.stats().unwrap()
    };
    let (objs_old, objs_new) = (stats(&old.addr).objects, stats(&new.addr).objects);
    assert!(objs_old > 0 && objs_new > 0, "keys on both nodes: old {objs_old}, new {objs_new}");
    let frames = |addr: &str, op: &str| stats(addr).latency.iter().find(|l| l.op == op).map_or(0, |l| l.count);
    assert!(frames(&new.addr, "batch_put") > 0, "batch frames to this release's node");
    assert_eq!(frames(&old.addr, "put"), objs_old, "single puts to the {label} node");
    // A batch delete of ten keys over both nodes, and one of keys gone.
    let gone: Vec<&[u8]> = keys[..10].iter().map(|k| k.as_bytes()).collect();
    assert_eq!(c.batch_delete(&gone), vec![Status::Ok; 10]);
    assert_eq!(c.batch_delete(&gone), vec![Status::Miss; 10], "deleted already");
    assert_eq!(c.batch_exist(&gone), vec![Status::Miss; 10]);
    batch_reads_every_page(&c, &keys[10..]);
    // Each release's kvctl against the other's node, with the token.
    let tokf = ["--auth-token-file", tok_s];
    let (code, out, err) =
        run(&old_kvctl, &[&tokf[..], &["put", "--node", &new.addr, "from-old", "hello-old"]].concat());
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run("kvctl", &[&tokf[..], &["get", "--node", &new.addr, "from-old"]].concat());
    assert_eq!((code, out.as_str()), (0, "hello-old"), "{err}");
    let (code, out, err) = run("kvctl", &[&tokf[..], &["put", "--node", &old.addr, "from-new", "hello-new"]].concat());
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(&old_kvctl, &[&tokf[..], &["get", "--node", &old.addr, "from-new"]].concat());
    assert_eq!((code, out.as_str()), (0, "hello-new"), "{err}");
    // The old kvctl through this release's kv-mds, over both nodes.
    let (code, out, err) =
        run(&old_kvctl, &[&tokf[..], &["put", "--mds", &mds_new.addr, "--group", "g", "via-mds", "x"]].concat());
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) =
        run(&old_kvctl, &[&tokf[..], &["get", "--mds", &mds_new.addr, "--group", "g", "via-mds"]].concat());
    assert_eq!((code, out.as_str()), (0, "x"), "{err}");
}
