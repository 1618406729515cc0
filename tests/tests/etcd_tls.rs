//! kv-mds against etcd as production runs it (docs/DEPLOY.md §3): TLS with
//! client certificates (made by openssl here) and etcd's user/password
//! authentication with a role limited to kvcellar's keys.

use std::time::Duration;

use kv_common::mds::MdsClient;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{wait_until, Etcd, EtcdTls, Mds};
use kv_e2e::Node;
use kvclient::{BlockingClient, Options};

fn healthz(addr: &str) -> u16 {
    let c = MdsClient::new(vec![addr.to_string()], Duration::from_secs(3));
    c.request(addr, "GET", "/healthz", None, Duration::ZERO).map(|(s, _)| s).unwrap_or(0)
}

#[test]
fn kv_mds_uses_etcd_over_tls_with_a_user() {
    let t = tempfile::tempdir().unwrap();
    let tls = EtcdTls::make(t.path(), "kv-mds-host");
    let etcd = Etcd::start_tls(t.path().to_path_buf(), tls.clone());
    // etcd's authentication: root, and a user for kv-mds that may touch
    // /kvcellar/ only.
    for cmd in [
        &["user", "add", "root:root-pw"][..],
        &["role", "add", "kvcellar"],
        &["role", "grant-permission", "kvcellar", "--prefix=true", "readwrite", "/kvcellar/"],
        &["user", "add", "kvmds:mds-pw"],
        &["user", "grant-role", "kvmds", "kvcellar"],
        &["auth", "enable"],
    ] {
        let (ok, out) = etcd.etcdctl(cmd);
        assert!(ok, "etcdctl {cmd:?}: {out}");
    }
    let pw = t.path().join("etcd.pw");
    std::fs::write(&pw, "mds-pw\n").unwrap();
    let wrong_pw = t.path().join("wrong.pw");
    std::fs::write(&wrong_pw, "not-it").unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (ca, cert, key) = (path(&tls.ca), path(&tls.client_cert), path(&tls.client_key));
    let secure: Vec<&str> =
        vec!["--etcd-cacert", &ca, "--etcd-cert", &cert, "--etcd-key", &key, "--etcd-user", "kvmds"];
    let pw_s = path(&pw);
    let mut args = secure.clone();
    args.extend_from_slice(&["--etcd-password-file", &pw_s]);
    let mds = Mds::start_with("127.0.0.1:0", &etcd.endpoint(), "3s", &args);
    assert_eq!(healthz(&mds.addr), 200, "kv-mds reaches etcd over TLS as kvmds");

    // The whole path works: a node registers, a client discovers, pages round-trip.
    let d = t.path().join("n1");
    let _n1 = Node::member("kv-server", "127.0.0.1:0", d.to_str().unwrap(), &mds.addr, "g", "n1", &["--no-sync"]);
    wait_until(Duration::from_secs(20), "n1 registered through TLS etcd", || {
        MdsClient::new(vec![mds.addr.clone()], Duration::from_secs(2)).view("g").ok().filter(|v| v.members.len() == 1)
    });
    let geo = Geometry { model_hash: 3, page_size: 16, tp_size: 1, ..Geometry::default() };
    let c = BlockingClient::new(Vec::new(), geo, Options::default()).unwrap();
    assert!(c.start_discovery(vec![mds.addr.clone()], "g".into(), Duration::from_millis(500)).unwrap().is_ok());
    let page: Vec<u8> = (0..10_000).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.putv(b"tls-page", &[&page]), Status::Ok);
    let mut buf = vec![0u8; page.len()];
    assert_eq!(c.getv(b"tls-page", &mut [&mut buf[..]]), Ok(page.len()));
    assert_eq!(buf, page);
    // The record really is in the TLS etcd (read as root).
    let (ok, out) = etcd.etcdctl(&["--user=root:root-pw", "get", "--prefix", "--keys-only", "/kvcellar/v1/groups/g/"]);
    assert!(ok && out.contains("/kvcellar/v1/groups/g/members/n1"), "{out}");

    // A wrong password is a clear start-up error, not a hang.
    let wrong_s = path(&wrong_pw);
    let endpoint = etcd.endpoint();
    let mut bad = vec!["--listen", "127.0.0.1:0", "--etcd", &endpoint];
    bad.extend_from_slice(&secure);
    bad.extend_from_slice(&["--etcd-password-file", &wrong_s]);
    let (code, out, err) = kv_e2e::run("kv-mds", &bad);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("authentication failed"), "{err}");
    // Without the CA (plain HTTP to a TLS port) nothing is served as healthy.
    let plain = Mds::start(&endpoint, "3s");
    assert_eq!(healthz(&plain.addr), 503, "no TLS: etcd unreachable, /healthz says so");
    // TLS without a client certificate: etcd refuses the handshake; kv-mds
    // waits to authenticate and says why (it does not announce itself).
    let no_cert = [
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        &endpoint,
        "--etcd-cacert",
        &ca,
        "--etcd-user",
        "kvmds",
        "--etcd-password-file",
        &pw_s,
    ];
    let mut child = std::process::Command::new(kv_e2e::bin("kv-mds"))
        .args(no_cert)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    // It says why and waits (etcd refused the handshake: "waiting to
    // authenticate"), or exits with the error; it never serves.
    let mut log = Vec::new();
    let outcome = wait_until(Duration::from_secs(30), "kv-mds waits or exits with the reason", || {
        log.extend(rx.try_iter());
        if log.iter().any(|l| l.contains("waiting to authenticate")) {
            return Some("waits");
        }
        match child.try_wait().unwrap() {
            Some(st) if !st.success() => Some("exited"),
            Some(st) => panic!("kv-mds exited with {st} without a client certificate"),
            None => None,
        }
    });
    if outcome == "waits" {
        // A stop while it waits for etcd ends it there, cleanly.
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let st = wait_until(Duration::from_secs(10), "kv-mds stopping on SIGTERM while it waits", || {
            child.try_wait().unwrap()
        });
        assert!(st.success(), "a clean stop, not death by the signal: {st:?}");
    } else {
        let _ = child.kill();
        let _ = child.wait();
    }
    // The reader thread drains what is left once the pipe closes.
    std::thread::sleep(Duration::from_millis(200));
    log.extend(rx.try_iter());
    assert!(!log.iter().any(|l| l.contains("serving")), "served without a client certificate: {log:#?}");
    if outcome == "waits" {
        assert!(log.iter().any(|l| l.contains("signal received while connecting to etcd")), "{log:#?}");
    }
    if outcome == "exited" {
        assert!(log.iter().any(|l| l.contains("etcd")), "the exit names etcd: {log:#?}");
    }
}
