//! Access control end to end (docs/DEPLOY.md, "Access control"): a real
//! etcd, a kv-mds with a token per group, nodes of two groups, the client
//! library, kvctl and raw hellos. Also the protocol v1 hello a node of this
//! release still serves when it has no token, and the roles of a
//! credential table (engines, nodes, admins).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kv_common::mds::{MdsClient, MdsError};
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_common::wire::{Hello, HELLO_ACCEPTED, HELLO_DENIED, HELLO_LEN};
use kv_e2e::cluster::{wait_until, Etcd, Mds};
use kv_e2e::{run, Node};
use kvclient::{BlockingClient, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 11, page_size: 16, dtype_tag: 1, tp_size: 1, ..Geometry::default() }
}

fn write_token(dir: &std::path::Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.to_str().unwrap().to_string()
}

fn node(t: &std::path::Path, eps: &str, group: &str, id: &str, token: Option<&str>) -> Node {
    let dir = t.join(id);
    let mut extra = vec!["--no-sync", "--log-level", "info"];
    if let Some(tok) = token {
        extra.extend_from_slice(&["--auth-token-file", tok]);
    }
    Node::member("kv-server", "127.0.0.1:0", dir.to_str().unwrap(), eps, group, id, &extra)
}

fn client(opts: &str, members: &str) -> BlockingClient {
    let members = kvclient::members::parse_members(members).unwrap();
    BlockingClient::new(members, geo(), Options::parse(opts).unwrap()).unwrap()
}

/// A raw hello: what the node answers (None: it closed without a hello).
fn raw_hello(addr: &str, bytes: &[u8]) -> Option<Hello> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h).ok()?;
    Hello::decode(&h).ok()
}

#[test]
fn tokens_keep_strangers_and_other_groups_out() {
    let t = tempfile::tempdir().unwrap();
    let tok_a = write_token(t.path(), "a.token", "\n  token-of-group-a \n");
    let tok_b = write_token(t.path(), "b.token", "token-of-group-b");
    let wrong = write_token(t.path(), "wrong.token", "token-of-group-x");
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with(
        "127.0.0.1:0",
        &etcd.endpoint(),
        "3s",
        &["--group-token-file", &format!("ga={tok_a}"), "--group-token-file", &format!("gb={tok_b}")],
    );
    let eps = mds.addr.clone();
    let na = node(t.path(), &eps, "ga", "na", Some(&tok_a));
    let nb = node(t.path(), &eps, "gb", "nb", Some(&tok_b));
    // A node without the token, and one with another group's, cannot join.
    let stranger = node(t.path(), &eps, "ga", "stranger", None);
    let impostor = node(t.path(), &eps, "ga", "impostor", Some(&tok_b));
    let token_a = kv_common::auth::read_token_file(std::path::Path::new(&tok_a)).unwrap();
    let view_a = |token: Option<kv_common::auth::Token>| {
        MdsClient::new(vec![eps.clone()], Duration::from_secs(2)).with_token(token).view("ga")
    };
    wait_until(Duration::from_secs(20), "na in ga's view", || {
        view_a(Some(token_a.clone())).ok().filter(|v| v.members.iter().any(|m| m.id == "na"))
    });
    for n in [&stranger, &impostor] {
        wait_until(Duration::from_secs(10), "the refused node logs why", || {
            n.stderr_lines.try_iter().find(|l| l.contains("refuses this node's credential"))
        });
    }
    let v = view_a(Some(token_a.clone())).unwrap();
    assert_eq!(v.members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["na"], "{v:?}");

    // The MDS API: no token, or the wrong group's, is a 401 (Denied).
    assert!(matches!(view_a(None), Err(MdsError::Denied(_))));
    let token_b = kv_common::auth::read_token_file(std::path::Path::new(&tok_b)).unwrap();
    assert!(matches!(view_a(Some(token_b)), Err(MdsError::Denied(_))), "group B's token opens group A");
    // The probes need no token.
    let probe = MdsClient::new(vec![eps.clone()], Duration::from_secs(2));
    let (code, _) = probe.request(&eps, "GET", "/healthz", None, Duration::ZERO).unwrap();
    assert_eq!(code, 200);
    let (code, body) = probe.request(&eps, "GET", "/metrics", None, Duration::ZERO).unwrap();
    let body = String::from_utf8_lossy(&body).to_string();
    assert_eq!(code, 200);
    let denied_calls: u64 =
        body.lines().find_map(|l| l.strip_prefix("kvmds_denied_requests_total ")).and_then(|v| v.parse().ok()).unwrap();
    assert!(denied_calls >= 2, "{body}");
    // The dashboard's data shows a protected group's members only with its
    // token: to anyone else, its epoch and member count.
    let groups = |c: &MdsClient| {
        let (code, body) = c.request(&eps, "GET", "/api/groups", None, Duration::ZERO).unwrap();
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let g = |name: &str| v["groups"].as_array().unwrap().iter().find(|g| g["group"] == name).unwrap().clone();
        (g("ga"), g("gb"), String::from_utf8_lossy(&body).to_string())
    };
    let (ga, gb, body) = groups(&probe);
    for g in [&ga, &gb] {
        assert_eq!(g["hidden"], true, "{body}");
        assert_eq!(g["member_count"], 1, "{body}");
        assert_eq!(g["members"].as_array().unwrap().len(), 0, "{body}");
    }
    assert!(!body.contains(&na.addr) && !body.contains(&nb.addr), "addresses shown without a token: {body}");
    let (ga, gb, body) =
        groups(&MdsClient::new(vec![eps.clone()], Duration::from_secs(2)).with_token(Some(token_a.clone())));
    assert_eq!(ga["hidden"], false, "{body}");
    assert_eq!(ga["members"][0]["id"], "na", "{body}");
    assert_eq!(gb["hidden"], true, "group A's token does not show group B: {body}");

    // Discovery with the token serves; without it (or with B's) it is KV_EDENIED.
    let opts_a = format!("auth_token_file={tok_a},io_timeout_ms=3000,connect_timeout_ms=1000");
    let c = BlockingClient::new(Vec::new(), geo(), Options::parse(&opts_a).unwrap()).unwrap();
    assert!(c.start_discovery(vec![eps.clone()], "ga".into(), Duration::from_millis(500)).unwrap().is_ok());
    let page: Vec<u8> = (0..8192).map(|i| (i * 7) as u8).collect();
    assert_eq!(c.putv(b"page-a", &[&page]), Status::Ok);
    let mut buf = vec![0u8; page.len()];
    assert_eq!(c.getv(b"page-a", &mut [&mut buf[..]]), Ok(page.len()));
    assert_eq!(buf, page);
    for opts in ["io_timeout_ms=3000".to_string(), format!("auth_token_file={tok_b}")] {
        let c = BlockingClient::new(Vec::new(), geo(), Options::parse(&opts).unwrap()).unwrap();
        let first = c.start_discovery(vec![eps.clone()], "ga".into(), Duration::from_millis(500)).unwrap();
        assert!(matches!(&first, Err((Status::Edenied, m)) if m.contains("denied")), "{opts}: {first:?}");
    }

    // The data plane: each node serves its own group's token only.
    let members_a = format!("na={}", na.addr);
    let members_b = format!("nb={}", nb.addr);
    let a_on_a = client(&opts_a, &members_a);
    assert_eq!(a_on_a.exist(b"page-a"), Status::Ok);
    for (opts, members, what) in [
        ("io_timeout_ms=3000".to_string(), &members_a, "no token"),
        (format!("auth_token_file={wrong}"), &members_a, "a wrong token"),
        (opts_a.clone(), &members_b, "group A's token at group B's node"),
    ] {
        let c = client(&opts, members);
        assert_eq!(c.exist(b"page-a"), Status::Edenied, "{what}");
        assert_eq!(c.putv(b"page-x", &[&page]), Status::Edenied, "{what}");
        assert_eq!(c.getv(b"page-a", &mut [&mut buf[..]]), Err((Status::Edenied, 0)), "{what}");
        let st = c.batch_exist(&[b"page-a".as_slice(), b"page-b".as_slice()]);
        assert_eq!(st, [Status::Edenied, Status::Edenied], "{what}");
        // A refusal is not a peer failure: no cool-down, the next call asks again.
        assert_eq!(c.core.metrics.peer_failures.load(std::sync::atomic::Ordering::Relaxed), 0, "{what}");
    }
    // Nothing the strangers sent was stored.
    assert_eq!(a_on_a.exist(b"page-x"), Status::Miss);

    // Raw hellos: v2 with the token is accepted; v1 (no token) and a
    // wrong token are denied; an oversized token length is cut off.
    let hello = |v, tok: &[u8]| kv_common::wire::client_hello(v, Some(tok));
    assert_eq!(raw_hello(&na.addr, &hello(2, b"token-of-group-a")).unwrap().status, HELLO_ACCEPTED);
    assert_eq!(raw_hello(&na.addr, &hello(2, b"token-of-group-b")).unwrap().status, HELLO_DENIED);
    assert_eq!(raw_hello(&na.addr, &hello(1, b"")).unwrap().status, HELLO_DENIED);
    let mut long = Hello { version: 2, status: 5000, max_record: 0 }.encode().to_vec();
    long.extend_from_slice(&[b'x'; 64]);
    assert_eq!(raw_hello(&na.addr, &long), None, "a 5000-byte token length is refused before reading it");
    // The node counted the refusals (asked with the token) and logged them
    // a line per 10 s at most.
    let mut conn = kvclient::Conn::connect_with(&na.addr, Duration::from_secs(5), Some(&token_a)).unwrap();
    let s = conn.stats().unwrap();
    assert!(s.denied_connections >= 10, "{s:?}");
    let logged = na.stderr_lines.try_iter().filter(|l| l.contains("refused a client")).count();
    assert!((1..=2).contains(&logged), "{logged} refusal lines logged");

    // kvctl: with the token it works; without, one line and exit 2.
    let (code, out, err) = run("kvctl", &["--auth-token-file", &tok_a, "ring", "--mds", &eps, "--group", "ga"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("na"), "{out}");
    let (code, out, err) = run("kvctl", &["ring", "--mds", &eps, "--group", "ga"]);
    assert_eq!(code, 2, "{out}{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("access denied"), "{err}");
    let (code, _, err) = run("kvctl", &["--auth-token-file", &tok_a, "put", "--node", &nb.addr, "k", "v"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("access denied") && err.trim().lines().count() == 1, "{err}");
    let (code, out, err) =
        run("kvctl", &["--auth-token-file", &tok_a, "get", "--mds", &eps, "--group", "ga", "page-a"]);
    assert_eq!(code, 1, "a miss for kvctl's geometry, not a refusal: {out}{err}");
    let (code, _, err) = run("kvctl", &["--auth-token-file", &tok_a, "stat", &nb.addr]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("access denied"), "{err}");
}

#[test]
fn a_node_without_a_token_serves_protocol_v1_clients() {
    let t = tempfile::tempdir().unwrap();
    let n = Node::cluster(&t, 1, &["--no-sync"]).remove(0);
    // v1, the previous release's hello: accepted, then frames as before.
    let mut s = TcpStream::connect(&n.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&Hello { version: 1, status: 0, max_record: 0 }.encode()).unwrap();
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h).unwrap();
    let reply = Hello::decode(&h).unwrap();
    assert_eq!((reply.version, reply.status), (1, HELLO_ACCEPTED));
    let body = b"v1-ping";
    let req = kv_common::wire::ReqHeader {
        op: kv_common::wire::Op::Ping,
        flags: 0,
        copy_age: 0,
        body_len: body.len() as u32,
        req_id: 1,
    };
    s.write_all(&req.encode()).unwrap();
    s.write_all(body).unwrap();
    let mut rh = [0u8; 16];
    s.read_exact(&mut rh).unwrap();
    let rsp = kv_common::wire::RspHeader::decode(&rh);
    assert_eq!((rsp.status, rsp.req_id), (Status::Ok, 1));
    // A client of this release with a token talks to a node without one.
    let tok = write_token(t.path(), "t", "some-token");
    let c = client(&format!("auth_token_file={tok}"), &format!("n0={}", n.addr));
    assert_eq!(c.putv(b"k", &[b"v"]), Status::Ok);
    let mut conn = kvclient::Conn::connect(&n.addr, Duration::from_secs(5)).unwrap();
    assert!(conn.stats().unwrap().v1_connections >= 1);
}

/// A credential table: an engine's token reads the view and serves pages
/// but may not change the group or register a node (403, not 401); a node
/// credential bound to one id registers that node only; an unbound one any;
/// only an admin's sets the placement rule, and kvctl presents it with
/// `--admin-token-file`.
#[test]
fn roles_keep_engines_from_changing_the_group() {
    use kv_common::mds::RegisterRequest;
    let t = tempfile::tempdir().unwrap();
    let table = write_token(
        t.path(),
        "group.tokens",
        "# the group's credentials\n\
         eng-token   role=engine tenant=team-a\n\
         n1-token    role=node node=n1\n\
         nodes-token role=node\n\
         adm-token   role=admin\n",
    );
    let eng = write_token(t.path(), "eng.token", "eng-token\n");
    let adm = write_token(t.path(), "adm.token", "adm-token role=admin\n");
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--group-token-file", &format!("g={table}")]);
    let eps = mds.addr.clone();
    // Every node holds the whole table: n1 presents its own credential,
    // n2 the unbound node one.
    let n1 = node(t.path(), &eps, "g", "n1", Some(&table));
    let n2 = node(t.path(), &eps, "g", "n2", Some(&table));
    let tok = |text: &[u8]| Some(kv_common::auth::Token::new(text).unwrap());
    let mds_as = |text: &[u8]| MdsClient::new(vec![eps.clone()], Duration::from_secs(2)).with_token(tok(text));
    wait_until(Duration::from_secs(20), "n1 and n2 in the view", || {
        mds_as(b"eng-token").view("g").ok().filter(|v| v.members.len() == 2)
    });

    // An engine's token reads pages at the nodes.
    let opts = format!("auth_token_file={eng},io_timeout_ms=3000,connect_timeout_ms=1000");
    let c = BlockingClient::new(Vec::new(), geo(), Options::parse(&opts).unwrap()).unwrap();
    assert!(c.start_discovery(vec![eps.clone()], "g".into(), Duration::from_millis(500)).unwrap().is_ok());
    let page: Vec<u8> = (0..8192).map(|i| (i * 3) as u8).collect();
    assert_eq!(c.putv(b"page", &[&page]), Status::Ok);
    let mut buf = vec![0u8; page.len()];
    assert_eq!(c.getv(b"page", &mut [&mut buf[..]]), Ok(page.len()));

    // It may not change the placement, nor register a node: 403, with why.
    let rule = kv_common::ring::Placement::parse("multiprobe").unwrap();
    match mds_as(b"eng-token").set_placement("g", rule) {
        Err(MdsError::Forbidden(m)) => assert!(m.contains("needs an admin credential") && m.contains("engine"), "{m}"),
        other => panic!("an engine's token set the placement: {other:?}"),
    }
    let req = RegisterRequest { addr: "127.0.0.1:9".into(), weight: 1, instance: String::new(), metrics_addr: None };
    match mds_as(b"eng-token").register("g", "n9", &req) {
        Err(MdsError::Forbidden(m)) => assert!(m.contains("only a node or admin credential"), "{m}"),
        other => panic!("an engine's token registered a node: {other:?}"),
    }
    // A node credential bound to n1 acts for n1 only.
    match mds_as(b"n1-token").register("g", "n9", &req) {
        Err(MdsError::Forbidden(m)) => assert!(m.contains("bound to node n1, not n9"), "{m}"),
        other => panic!("n1's credential registered n9: {other:?}"),
    }
    match mds_as(b"n1-token").deregister("g", "n2", "") {
        Err(MdsError::Forbidden(_)) => {}
        other => panic!("n1's credential removed n2: {other:?}"),
    }
    // A token of no line is still a 401.
    assert!(matches!(mds_as(b"nobody").view("g"), Err(MdsError::Denied(_))));
    assert_eq!(mds_as(b"eng-token").view("g").unwrap().members.len(), 2, "nothing changed");

    // kvctl: with the engine's token, one line and exit 2; with the admin's
    // (--admin-token-file), a new epoch under the new rule.
    let (code, out, err) = run(
        "kvctl",
        &["--auth-token-file", &eng, "ring", "--mds", &eps, "--group", "g", "--set-placement", "multiprobe"],
    );
    assert_eq!(code, 2, "{out}{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not allowed") && err.contains("--admin-token-file"), "{err}");
    let args = [
        "--auth-token-file",
        &eng,
        "--admin-token-file",
        &adm,
        "ring",
        "--mds",
        &eps,
        "--group",
        "g",
        "--set-placement",
        "multiprobe",
    ];
    let (code, out, err) = run("kvctl", &args);
    assert_eq!(code, 0, "{out}{err}");
    wait_until(Duration::from_secs(10), "the view under multiprobe", || {
        mds_as(b"eng-token").view("g").ok().filter(|v| v.placement().map(|p| p.name()) == Ok("multiprobe"))
    });

    let probe = MdsClient::new(vec![eps.clone()], Duration::from_secs(2));
    let (_, body) = probe.request(&eps, "GET", "/metrics", None, Duration::ZERO).unwrap();
    let body = String::from_utf8_lossy(&body).to_string();
    let forbidden: u64 = body
        .lines()
        .find_map(|l| l.strip_prefix("kvmds_forbidden_requests_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(forbidden >= 5, "{body}");
    drop((n1, n2));
}

/// Tokens rotate without a restart: the table rewritten on kv-mds's and the
/// node's hosts and a SIGHUP to each, and the new engine token is served
/// while the removed one is refused (401 at kv-mds, "denied" at the node);
/// a file that no longer parses leaves the previous table in use.
#[test]
fn a_sighup_reads_the_credentials_again() {
    let t = tempfile::tempdir().unwrap();
    let before = "old-engine role=engine\nnodes role=node\n";
    let table = write_token(t.path(), "group.tokens", before);
    let etcd = Etcd::start(t.path().to_path_buf());
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &["--group-token-file", &format!("g={table}")]);
    let eps = mds.addr.clone();
    let n1 = node(t.path(), &eps, "g", "n1", Some(&table));
    let view_as = |text: &[u8]| {
        MdsClient::new(vec![eps.clone()], Duration::from_secs(2))
            .with_token(Some(kv_common::auth::Token::new(text).unwrap()))
            .view("g")
    };
    wait_until(Duration::from_secs(20), "n1 in the view", || {
        view_as(b"old-engine").ok().filter(|v| v.members.len() == 1)
    });
    let hello = |tok: &[u8]| raw_hello(&n1.addr, &kv_common::wire::client_hello(2, Some(tok))).unwrap().status;
    assert_eq!(hello(b"old-engine"), HELLO_ACCEPTED);
    assert_eq!(hello(b"new-engine"), HELLO_DENIED);

    // Rotated: the new token in, the old one out, on both hosts.
    std::fs::write(&table, "new-engine role=engine\nnodes role=node\n").unwrap();
    mds.signal(libc::SIGHUP);
    n1.signal(libc::SIGHUP);
    wait_until(Duration::from_secs(10), "kv-mds to take the new table", || view_as(b"new-engine").ok());
    wait_until(Duration::from_secs(10), "the node to take the new table", || {
        (hello(b"new-engine") == HELLO_ACCEPTED).then_some(())
    });
    assert!(matches!(view_as(b"old-engine"), Err(MdsError::Denied(_))));
    assert_eq!(hello(b"old-engine"), HELLO_DENIED);
    // The node stays in its group (its own credential did not change).
    assert_eq!(view_as(b"new-engine").unwrap().members.len(), 1);

    // A table that no longer parses: one error line, the previous in use.
    std::fs::write(&table, "new-engine role=wizard\n").unwrap();
    mds.signal(libc::SIGHUP);
    n1.signal(libc::SIGHUP);
    for lines in [&mds.stderr_lines, &n1.stderr_lines] {
        wait_until(Duration::from_secs(10), "the refused reload logged", || {
            lines.try_iter().find(|l| l.contains("not replaced") && l.contains("wizard"))
        });
    }
    assert!(view_as(b"new-engine").is_ok());
    assert_eq!(hello(b"new-engine"), HELLO_ACCEPTED);
}
