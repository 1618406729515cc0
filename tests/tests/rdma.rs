//! RDMA asked for where there is none (docs/ARCHITECTURE.md, "Transports"): with the `rdma` build (and
//! without it) on a machine with no RDMA device, a node started with
//! `--rdma-dev` and a client opened with `rdma_devices` serve everything
//! over TCP, each says why in one log line, and each counts one fallback.
//! The data path itself runs over the stand-in fabric in
//! server/tests/rdma_path.rs.

use std::time::Duration;

use kv_common::mds::MdsClient;
use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::cluster::{free_port, wait_until};
use kv_e2e::{run, Node};
use kvclient::members::Member;
use kvclient::{BlockingClient, Options};

fn scrape(addr: &str) -> String {
    let c = MdsClient::new(vec![addr.to_string()], Duration::from_secs(5));
    let (code, body) = c.request(addr, "GET", "/metrics", None, Duration::ZERO).expect("HTTP answer");
    assert_eq!(code, 200);
    String::from_utf8_lossy(&body).into_owned()
}

/// The reason a build on this machine gives, by what it carries.
fn expected_reason(transports: &str) -> &'static [&'static str] {
    if transports.contains("rdma") {
        // No rdma-core here: libibverbs cannot be loaded. (Were it
        // installed, there would still be no device.)
        &["libibverbs.so.1 cannot be loaded", "no such RDMA device"]
    } else {
        &["built without the `rdma` feature"]
    }
}

#[test]
fn rdma_asked_for_without_a_device_means_tcp_one_log_line_and_one_fallback() {
    let t = tempfile::tempdir().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let d = t.path().join("d0");
    let node = Node::start(&[
        "--dir",
        d.to_str().unwrap(),
        "--cap",
        "64M",
        "--rdma-dev",
        "mlx5_0:mlx5_1",
        "--metrics-listen",
        &metrics,
    ]);
    let text = scrape(&metrics);
    let build = text.lines().find(|l| l.starts_with("kvcellar_build_info{")).expect("build_info").to_string();
    let transports = build.split("transport=\"").nth(1).and_then(|s| s.split('"').next()).unwrap().to_string();
    assert!(transports == "tcp" || transports == "tcp+rdma", "{build}");
    assert!(text.contains("kvcellar_rdma_fallbacks_total 1\n"), "{text}");
    assert!(text.contains("kvcellar_rdma_qps_connected"));

    // The node's one line saying why.
    let reasons = expected_reason(&transports);
    let line = wait_until(Duration::from_secs(10), "the node's RDMA line", || {
        node.stderr_lines.try_iter().find(|l| l.contains("RDMA"))
    });
    assert!(line.contains("using TCP:") && line.contains("mlx5_0:mlx5_1"), "{line}");
    assert!(reasons.iter().any(|r| line.contains(r)), "{line}");

    // A client that asks for RDMA: everything works, over TCP.
    let geo = Geometry { model_hash: 0x13, page_size: 8, dtype_tag: 1, tp_size: 1, ..Geometry::default() };
    let opts = Options::parse("rdma_devices=mlx5_0,rdma_depth=64").unwrap();
    let c =
        BlockingClient::new(vec![Member { id: "n0".into(), addr: node.addr.clone(), weight: 1 }], geo, opts).unwrap();
    let page: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    assert_eq!(c.putv(b"p1", &[&page[..]]), Status::Ok);
    let mut a = vec![0u8; 1 << 19];
    let mut b = vec![0u8; 1 << 19];
    assert_eq!(c.getv(b"p1", &mut [&mut a[..], &mut b[..]]), Ok(1 << 20));
    assert_eq!([a, b].concat(), page);
    assert_eq!(c.exist(b"p1"), Status::Ok);
    assert_eq!(c.batch_exist(&[b"p1", b"p2"]), vec![Status::Ok, Status::Miss]);
    let snap = c.stats_text();
    assert!(snap.contains("kvclient_rdma_fallbacks_total 1\n"), "{snap}");
    assert!(snap.contains("kvclient_rdma_completions_total 0\n"), "{snap}");
    let why = c.core.fabric.counters().fallback_reason().expect("a reason");
    assert!(
        expected_reason(if cfg!(feature = "rdma") { "rdma" } else { "tcp" }).iter().any(|r| why.contains(r)),
        "{why}"
    );
    // Nothing moved by RDMA on the node either.
    let text = scrape(&metrics);
    assert!(text.contains("kvcellar_rdma_completions_total 0\n"), "{text}");
    assert!(text.contains("kvcellar_requests_total{op=\"get\",status=\"ok\"} 1\n"), "{text}");

    // kvctl, a client in its own process: one line on stderr, and it works.
    let opts = "--options=rdma_devices=mlx5_0";
    let (code, _, err) = run("kvctl", &["put", "--node", &node.addr, opts, "k", "value"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("RDMA")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("kvcellar: RDMA: using TCP: ") && lines[0].contains("mlx5_0"), "{}", lines[0]);
    let (code, out, err) = run("kvctl", &["get", "--node", &node.addr, opts, "k"]);
    assert_eq!((code, out.trim()), (0, "value"), "{err}");
    // Every build takes the keys; a bad list is one clear error.
    let (code, _, err) = run("kvctl", &["get", "--node", &node.addr, "--options=rdma_devices=a;b", "k"]);
    assert_ne!(code, 0);
    assert!(err.contains("rdma_devices"), "{err}");
    let (code, _, err) =
        run("kv-server", &["--listen", "127.0.0.1:0", "--dir", "x", "--cap", "1G", "--rdma-dev", "a::b"]);
    assert_ne!(code, 0);
    assert!(err.contains("--rdma-dev") && err.contains("empty name"), "{err}");
}
