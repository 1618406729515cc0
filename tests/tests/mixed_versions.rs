//! A rolling upgrade's mixed versions (docs/DEPLOY.md §9, PROTOCOL.md §2.1):
//! binaries of earlier releases beside this release's, in one group, with
//! every page checked byte for byte. `scripts/prev-release.sh` builds them
//! and `scripts/test.sh` names them: KVCELLAR_PREV_BIN_DIR holds the
//! protocol v1 release (the last commit before protocol v2),
//! KVCELLAR_PREV2_BIN_DIR the protocol v2 release (the last commit before
//! protocol v3 and its batch frames), KVCELLAR_PREV3_BIN_DIR the protocol
//! v3 release (the last commit before protocol v4 and its batch writes),
//! KVCELLAR_PREV4_BIN_DIR the release before tenants (protocol v4, one
//! group token; no credential tables, namespaces or quotas).
//!
//! Without a directory its test says so and passes, unless
//! KVCELLAR_REQUIRE_PREV=1 (or KVCELLAR_REQUIRE_PREV2=1, ..._PREV3=1,
//! ..._PREV4=1), which scripts/test.sh sets when the build worked.

use std::time::Duration;

use kv_common::mds::MdsClient;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::{run, Node};
use kvclient::members::Member;
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

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.to_str().unwrap().to_string()
}

/// A client of the library holding the token in `token_file`, on the
/// static member list `members` (id, address).
fn static_client(token_file: &str, members: &[(&str, &str)]) -> BlockingClient {
    let opts = Options::parse(&format!("auth_token_file={token_file},io_timeout_ms=5000")).unwrap();
    let m = members.iter().map(|(id, a)| Member { id: id.to_string(), addr: a.to_string(), weight: 1 }).collect();
    BlockingClient::new(m, geo(), opts).unwrap()
}

/// The page `key` reads as: its bytes, or the status.
fn read(c: &BlockingClient, key: &str) -> Result<Vec<u8>, Status> {
    let mut buf = vec![0u8; 20_000];
    c.getv(key.as_bytes(), &mut [&mut buf[..]]).map(|n| buf[..n].to_vec()).map_err(|e| e.0)
}

/// Tenant A's page for `key` (other bytes than the default tenant's).
fn a_page(key: &str) -> Vec<u8> {
    page(&format!("team-a/{key}"))
}

/// The release before tenants beside this one, in one group: the group
/// token of that release is this release's node credential, and tenant A
/// holds an engine token only this release's node knows. Pages of both
/// releases' disks are read back by the other release, byte for byte.
#[test]
fn the_release_before_tenants_and_this_one_serve_one_group() {
    let bin = |n| release_bin("KVCELLAR_PREV4_BIN_DIR", "KVCELLAR_REQUIRE_PREV4", n);
    let (Some(old_server), Some(old_mds), Some(old_kvctl)) = (bin("kv-server"), bin("kv-mds"), bin("kvctl")) else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let group_tok = write(t.path(), "group.token", "upgrade-group-token");
    let table =
        write(t.path(), "group.tokens", "upgrade-group-token role=node\nteam-a-token role=engine tenant=team-a\n");
    let a_tok = write(t.path(), "a.token", "team-a-token");
    let etcd = Etcd::start(t.path().to_path_buf());
    // Each replica with its release's form of the credentials.
    let mds_new = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--auth-token-file", &table]);
    let mds_old = Mds::start_bin(&old_mds, "127.0.0.1:0", &etcd.endpoint(), "3s", &["--auth-token-file", &group_tok]);
    let group_token = kv_common::auth::Token::new(b"upgrade-group-token").unwrap();
    let eps = format!("{},{}", mds_old.addr, mds_new.addr);
    let (d_old, d_new) = (t.path().join("old"), t.path().join("new"));
    let old_args = ["--no-sync", "--log-level", "info", "--auth-token-file", &group_tok, "--drain-secs", "0"];
    let old = Node::member(&old_server, "127.0.0.1:0", d_old.to_str().unwrap(), &eps, "g", "old", &old_args);
    let new_args = ["--no-sync", "--log-level", "info", "--auth-token-file", &table, "--drain-secs", "20"];
    let new = Node::member("kv-server", "127.0.0.1:0", d_new.to_str().unwrap(), &eps, "g", "new", &new_args);
    for replica in [&mds_old.addr, &mds_new.addr] {
        wait_until(Duration::from_secs(20), "both nodes in the view of each replica", || {
            MdsClient::new(vec![replica.clone()], Duration::from_secs(2))
                .with_token(Some(group_token.clone()))
                .view("g")
                .ok()
                .filter(|v| v.members.len() == 2)
        });
    }
    let discover = |tok: &str, replica: &str| {
        let o = Options::parse(&format!("auth_token_file={tok},io_timeout_ms=5000")).unwrap();
        let c = BlockingClient::new(Vec::new(), geo(), o).unwrap();
        assert!(c.start_discovery(vec![replica.to_string()], "g".into(), Duration::from_millis(500)).unwrap().is_ok());
        wait_until(Duration::from_secs(20), "the client to route to both nodes", || {
            (c.core.topology().nodes.len() == 2).then_some(())
        });
        c
    };

    // The default tenant (the group token), through the old replica: a
    // batch over both nodes, every page intact.
    let d = discover(&group_tok, &mds_old.addr);
    let keys: Vec<String> = (0..40).map(|i| format!("v4-mixed-{i}")).collect();
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page(k)).collect();
    let items: Vec<(&[u8], Vec<&[u8]>)> = keys.iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert_eq!(d.batch_putv(&items), vec![Status::Ok; 40], "a batch put over both releases' nodes");
    batch_reads_every_page(&d, &keys);
    let owner = |k: &String| {
        let t = d.core.topology();
        t.nodes[t.ring.owner(k.as_bytes()).unwrap()].id.clone()
    };
    let (on_new, on_old): (Vec<&String>, Vec<&String>) = keys.iter().partition(|k| owner(k) == "new");
    assert!(!on_new.is_empty() && !on_old.is_empty(), "keys on both nodes");

    // Tenant A, through the new replica, writes the same key names: this
    // release's node keeps them in A's namespace; the previous release's
    // node does not know A's token and refuses it (nothing lands in the
    // default tenant's pages). DEPLOY.md: tenant tokens once every node
    // runs this release.
    let a = discover(&a_tok, &mds_new.addr);
    for k in &on_new {
        assert_eq!(a.putv(k.as_bytes(), &[&a_page(k)]), Status::Ok, "{k}");
        assert_eq!(read(&a, k), Ok(a_page(k)), "{k}: A reads its own page");
        assert_eq!(read(&d, k), Ok(page(k)), "{k}: the default tenant still reads its own");
    }
    assert_eq!(
        a.putv(on_old[0].as_bytes(), &[&a_page(on_old[0])]),
        Status::Edenied,
        "the older node refuses A's token"
    );
    assert_eq!(read(&d, on_old[0]), Ok(page(on_old[0])), "and kept the default tenant's page");
    // More of A's pages at the new node, names of its own: the drain below
    // has more than one batch (32 pages) of A's for the older owner.
    let a_only: Vec<String> = (0..120).map(|i| format!("v4-a-only-{i}")).filter(|k| owner(k) == "new").collect();
    for k in &a_only {
        assert_eq!(a.putv(k.as_bytes(), &[&a_page(k)]), Status::Ok, "{k}");
    }
    let a_held = on_new.len() + a_only.len();
    assert!(a_held > 32, "A holds {a_held} pages at the new node");

    // The previous release's kvctl against this release's node with the
    // group token (its node credential).
    let (code, out, err) =
        run(&old_kvctl, &["--auth-token-file", &group_tok, "put", "--node", &new.addr, "k-old", "v"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run("kvctl", &["--auth-token-file", &group_tok, "get", "--node", &new.addr, "k-old"]);
    assert_eq!((code, out.as_str()), (0, "v"), "{err}");

    // This release's node drains: it pushes the default tenant's pages to
    // the older node, and leaves A's (that node would keep them in the
    // default namespace), counted and logged once.
    let held = a_held + on_new.len() + 1;
    new.signal(libc::SIGTERM);
    let (status, lines) = new.wait_exit_lines(Duration::from_secs(60));
    assert!(status.success(), "{lines:?}");
    let closing = lines.iter().find(|l| l.contains("pages pushed to")).expect("the push's closing line");
    let defaults = on_new.len() + 1;
    assert!(
        closing.contains(&format!("{defaults} of {held} pages pushed"))
            && closing.contains("(0 refused, 0 failed, 0 left, 0 gone)")
            && closing.contains(&format!("; {a_held} pages of tenants not sent to owners of an earlier release")),
        "{closing}"
    );
    let told = lines.iter().filter(|l| l.contains("a tenant's pages are not pushed to this owner")).count();
    assert_eq!(told, 1, "{lines:?}");
    let d1 = static_client(&group_tok, &[("old", &old.addr)]);
    for k in &keys {
        assert_eq!(read(&d1, k), Ok(page(k)), "{k}: the default tenant's page at the older node");
    }
    drop(d);
    drop(a);
    assert!(old.terminate(Duration::from_secs(30)).success());

    // This release on the older release's disk: every record it wrote
    // (no tenant) is the default tenant's, and A finds none of them.
    let reopened = Node::start(&["--dir", d_old.to_str().unwrap(), "--cap", "64M", "--auth-token-file", &table]);
    let (d2, a2) =
        (static_client(&group_tok, &[("n", &reopened.addr)]), static_client(&a_tok, &[("n", &reopened.addr)]));
    for k in &keys {
        assert_eq!(read(&d2, k), Ok(page(k)), "{k}: a record of the previous release, served to the default tenant");
        assert_eq!(a2.exist(k.as_bytes()), Status::Miss, "{k}: not tenant A's");
    }
    let s = kvclient::Conn::connect_with(&reopened.addr, Duration::from_secs(5), Some(&group_token))
        .unwrap()
        .stats()
        .unwrap();
    let default = s.tenants.iter().find(|t| t.tenant == "default").expect("the default tenant's holding");
    assert_eq!((default.objects, s.tenants.len()), (s.objects, 1), "{:?}", s.tenants);
    drop(reopened);

    // The previous release on this release's disk (the default tenant's
    // pages and A's of the same names): it starts, serves the default
    // tenant's pages, and never A's bytes for those names.
    let back = Node::start_bin(
        &old_server,
        "127.0.0.1:0",
        &["--dir", d_new.to_str().unwrap(), "--cap", "64M", "--auth-token-file", &group_tok],
    );
    let d3 = static_client(&group_tok, &[("n", &back.addr)]);
    for k in &on_new {
        assert_eq!(read(&d3, k), Ok(page(k)), "{k}: this release's default page, read by the previous release");
    }
}
