//! Observability (docs/METRICS.md): the expositions of real daemons after a known
//! workload carry exact values; every metric docs/METRICS.md names and every
//! query of the Grafana board exists in a live scrape; the dashboards are
//! self-contained; `kvctl top` reads a live group.

use std::collections::BTreeSet;
use std::time::Duration;

use kv_common::mds::MdsClient;
use kv_common::page::{Geometry, HEADER_LEN};
use kv_common::status::Status;
use kv_e2e::cluster::{free_port, wait_until, Etcd, Mds};
use kv_e2e::{run, workspace_root, Node};
use kvclient::{BlockingClient, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 0x0B5, page_size: 16, dtype_tag: 3, tp_size: 1, ..Geometry::default() }
}

/// `GET path` on `addr`: (status, body).
fn get(addr: &str, path: &str) -> (u16, String) {
    let c = MdsClient::new(vec![addr.to_string()], Duration::from_secs(5));
    let (code, body) = c.request(addr, "GET", path, None, Duration::ZERO).expect("HTTP answer");
    (code, String::from_utf8_lossy(&body).into_owned())
}

/// The value of the sample `series` (name with its labels as printed, or a
/// prefix of them ending in `{`'s contents), None when absent.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))).then(|| value.parse().ok())?
    })
}

/// Every sample line is `name{labels} value` or `name value`, the text ends
/// with `# EOF` (OpenMetrics), and every family has HELP and TYPE.
fn check_format(what: &str, text: &str) {
    assert_eq!(text.lines().last(), Some("# EOF"), "{what}: no EOF marker");
    let mut typed = BTreeSet::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap_or("").to_string());
        } else if !l.starts_with('#') {
            let (series, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("{what}: bad line {l:?}"));
            assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{what}: bad value in {l:?}");
            let name = series.split('{').next().unwrap_or("");
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{what}: bad name in {l:?}");
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
                .unwrap_or(name);
            assert!(typed.contains(family), "{what}: {name} has no TYPE line");
            assert_eq!(series.matches('{').count(), series.matches('}').count(), "{what}: {l:?}");
        }
    }
}

/// Sample and family names of an exposition.
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            out.insert(rest.split(' ').next().unwrap_or("").to_string());
        } else if !l.starts_with('#') {
            out.insert(l.split(['{', ' ']).next().unwrap_or("").to_string());
        }
    }
    out
}

/// Metric names (kvcellar_*, kvmds_*, kvclient_*) mentioned in `text`.
fn mentioned(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    for p in ["kvcellar_", "kvmds_", "kvclient_"] {
        let mut at = 0;
        while let Some(i) = text[at..].find(p) {
            let start = at + i;
            let prev_ok = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
            let mut end = start;
            while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
                end += 1;
            }
            let name = &text[start..end];
            // Prose names ending in `_` (a prefix) or `_…` are not metrics.
            if prev_ok && !name.ends_with('_') && name.len() > p.len() {
                out.insert(name.to_string());
            }
            at = end.max(start + 1);
        }
    }
    out
}

struct Tier {
    _etcd: Etcd,
    mds: Mds,
    node: Node,
    metrics: String,
    _dir: tempfile::TempDir,
}

fn tier(extra: &[&str]) -> Tier {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    let mds = Mds::start(&etcd.endpoint(), "10s");
    let metrics = format!("127.0.0.1:{}", free_port());
    let d = format!("{},{}", dir.path().join("d0").display(), dir.path().join("d1").display());
    let mut args = vec!["--metrics-listen", &metrics, "--log-level", "warn"];
    args.extend_from_slice(extra);
    let node = Node::member("kv-server", "127.0.0.1:0", &d, &mds.addr, "obs", "n1", &args);
    wait_until(Duration::from_secs(20), "the node in the view", || {
        let (_, body) = get(&mds.addr, "/api/groups");
        body.contains("\"n1\"").then_some(())
    });
    Tier { _etcd: etcd, mds, node, metrics, _dir: dir }
}

/// The three probes a deployment uses (docs/METRICS.md, docs/DEPLOY.md
/// "Kubernetes") through a stop: a draining node turns unready (`/readyz`)
/// and stays alive (`/healthz`, `/livez`), so an orchestrator neither
/// routes new work to it nor restarts it in the middle of its drain.
#[test]
fn a_draining_node_is_alive_and_not_ready() {
    let t = tier(&["--drain-secs", "30"]);
    for path in ["/healthz", "/readyz", "/livez"] {
        assert_eq!(get(&t.metrics, path), (200, "ok\n".to_string()), "{path} while serving");
    }
    // kv-mds stopped: leaving the group waits its 3 s for an answer, and
    // the second signal below arrives meanwhile.
    t.mds.signal(libc::SIGSTOP);
    t.node.signal(libc::SIGTERM);
    wait_until(Duration::from_secs(20), "/readyz turning 503", || (get(&t.metrics, "/readyz").0 == 503).then_some(()));
    assert_eq!(get(&t.metrics, "/readyz"), (503, "draining\n".to_string()));
    assert_eq!(get(&t.metrics, "/healthz"), (200, "draining\n".to_string()));
    assert_eq!(get(&t.metrics, "/livez"), (200, "ok\n".to_string()));
    // A second signal while it leaves ends the 30 s drain.
    t.node.signal(libc::SIGTERM);
    t.mds.signal(libc::SIGCONT);
    let status = t.node.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "a second signal ends the drain: {status:?}");
}

/// A SIGTERM while the node starts (its disks recovering, its memory tier
/// being faulted in) is kept: once ready the node stops cleanly without
/// joining its group, instead of dying mid-recovery or, as a container's
/// PID 1 that ignores the signal, joining and being killed later.
#[test]
fn a_signal_while_starting_stops_the_node_before_it_joins() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().join("etcd"));
    let mds = Mds::start(&etcd.endpoint(), "10s");
    let d = dir.path().join("d0");
    let d = d.to_str().unwrap();
    // A 2 GiB tier takes a good part of a second to fault in after the
    // (empty) disk is recovered: the signal lands in that window.
    let mut child = std::process::Command::new(kv_e2e::bin("kv-server"))
        .args(["--listen", "127.0.0.1:0", "--dir", d, "--cap", "64M", "--mem-cap", "2G", "--mds", &mds.addr])
        .args(["--group", "early", "--id", "n1", "--advertise", "127.0.0.1:0", "--log-level", "info"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = Vec::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        let recovered = l.contains("disk recovered");
        log.push(l);
        if recovered {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            break;
        }
    }
    log.extend(lines.map_while(Result::ok));
    let status = child.wait().unwrap();
    let log = log.join("\n");
    assert!(status.success(), "a clean stop, not death by the signal: {status:?}\n{log}");
    assert!(log.contains("signal received while starting"), "{log}");
    assert!(!log.contains("registered"), "it never joined its group:\n{log}");
    let (_, body) = get(&mds.addr, "/v1/groups/early/view");
    assert!(!body.contains("\"n1\""), "no member n1 in {body}");
}

fn payload(key: &str, len: usize) -> Vec<u8> {
    key.bytes().cycle().take(len).collect()
}

#[test]
fn a_known_workload_shows_exact_values_in_every_exposition() {
    let t = tier(&["--mem-cap", "0"]);
    let members = format!("n1={}", t.node.addr);
    let c =
        BlockingClient::new(kvclient::members::parse_members(&members).unwrap(), geo(), Options::default()).unwrap();
    let len = 10_000;
    let mut written = 0u64;
    for i in 0..10 {
        let k = format!("obs-{i}");
        assert_eq!(c.putv(k.as_bytes(), &[&payload(&k, len)]), Status::Ok);
        written += (HEADER_LEN + k.len() + len) as u64;
    }
    let mut buf = vec![0u8; len];
    for i in 0..7 {
        let k = format!("obs-{i}");
        assert_eq!(c.getv(k.as_bytes(), &mut [&mut buf]), Ok(len));
    }
    for i in 0..3 {
        let k = format!("absent-{i}");
        assert_eq!(c.getv(k.as_bytes(), &mut [&mut buf]).unwrap_err().0, Status::Miss);
    }

    // The node.
    let (code, text) = get(&t.metrics, "/metrics");
    assert_eq!(code, 200);
    check_format("node", &text);
    let node = [("node", "n1"), ("group", "obs")];
    let v = |name: &str, l: &[(&str, &str)]| {
        let all: Vec<(&str, &str)> = node.iter().chain(l).copied().collect();
        sample(&text, name, &all).unwrap_or_else(|| panic!("{name} {l:?} missing in\n{text}"))
    };
    assert_eq!(v("kvcellar_requests_total", &[("op", "put"), ("status", "ok")]), 10.0);
    assert_eq!(v("kvcellar_requests_total", &[("op", "get"), ("status", "ok")]), 7.0);
    assert_eq!(v("kvcellar_requests_total", &[("op", "get"), ("status", "miss")]), 3.0);
    assert_eq!(v("kvcellar_hits_total", &[("tier", "disk")]), 7.0);
    assert_eq!(v("kvcellar_hits_total", &[("tier", "memory")]), 0.0);
    assert_eq!(v("kvcellar_misses_total", &[("reason", "absent")]), 3.0);
    assert_eq!(v("kvcellar_misses_total", &[("reason", "corrupt")]), 0.0);
    assert_eq!(v("kvcellar_puts_total", &[]), 10.0);
    assert_eq!(v("kvcellar_objects", &[]), 10.0);
    assert_eq!(v("kvcellar_written_bytes_total", &[]), written as f64);
    assert_eq!(v("kvcellar_read_bytes_total", &[]), (written / 10 * 7) as f64, "7 of the 10 equal-length records");
    assert_eq!(v("kvcellar_request_duration_seconds_count", &[("op", "put")]), 10.0);
    assert_eq!(v("kvcellar_request_duration_seconds_count", &[("op", "get")]), 10.0);
    assert_eq!(v("kvcellar_request_duration_seconds_bucket", &[("op", "get"), ("le", "+Inf")]), 10.0);
    // The binaries under test are the build that ships (with RDMA) when the
    // tests are built so (scripts/test.sh); either way the label says which.
    let transports = if cfg!(feature = "rdma") { "tcp+rdma" } else { "tcp" };
    assert_eq!(v("kvcellar_build_info", &[("transport", transports)]), 1.0);
    assert_eq!(v("kvcellar_rdma_fallbacks_total", &[]), 0.0);
    assert_eq!(v("kvcellar_failed_disks", &[]), 0.0);
    assert_eq!(v("kvcellar_tier_capacity_bytes", &[("tier", "disk")]), (128u64 << 20) as f64);
    assert!(v("kvcellar_request_duration_seconds_sum", &[("op", "put")]) > 0.0);
    // Every sample carries the node and group labels.
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(l.contains("node=\"n1\"") && l.contains("group=\"obs\""), "unlabelled sample {l:?}");
    }
    assert_eq!(get(&t.metrics, "/healthz"), (200, "ok\n".to_string()));
    assert_eq!(get(&t.metrics, "/readyz"), (200, "ok\n".to_string()));
    assert_eq!(get(&t.metrics, "/livez"), (200, "ok\n".to_string()));
    let (code, stats) = get(&t.metrics, "/api/stats");
    assert_eq!(code, 200);
    let stats: kv_common::stats::NodeStats = serde_json::from_str(&stats).unwrap();
    let getl = stats.latency.iter().find(|l| l.op == "get").expect("get latency");
    assert_eq!((getl.count, stats.hits, stats.misses, stats.node_id.as_deref()), (10, 7, 3, Some("n1")));
    assert!(getl.quantile(0.99).unwrap() > 0.0);
    // The same numbers over the data plane (what kvctl top reads).
    let mut conn = kvclient::Conn::connect(&t.node.addr, Duration::from_secs(5)).unwrap();
    let over_wire = conn.stats().unwrap();
    assert_eq!(over_wire.latency.iter().find(|l| l.op == "put").map(|l| l.count), Some(10));

    // The client.
    let text = c.stats_text();
    check_format("client", &text);
    let cv = |name: &str, l: &[(&str, &str)]| sample(&text, name, l).unwrap_or_else(|| panic!("{name} {l:?}\n{text}"));
    assert_eq!(cv("kvclient_ops_total", &[("op", "put"), ("status", "ok")]), 10.0);
    assert_eq!(cv("kvclient_ops_total", &[("op", "get"), ("status", "ok")]), 7.0);
    assert_eq!(cv("kvclient_ops_total", &[("op", "get"), ("status", "miss")]), 3.0);
    assert_eq!(cv("kvclient_op_duration_seconds_count", &[("op", "put")]), 10.0);
    assert_eq!(cv("kvclient_op_duration_seconds_count", &[("op", "get")]), 10.0);
    assert_eq!(cv("kvclient_put_bytes_total", &[]), (10 * len) as f64);
    assert_eq!(cv("kvclient_peer_up", &[("peer", "n1")]), 1.0);
    assert_eq!(cv("kvclient_peer_state_changes_total", &[("peer", "n1"), ("to", "down")]), 0.0);

    // kv-mds: the member with its metrics address, the group's gauges.
    let (code, groups) = get(&t.mds.addr, "/api/groups");
    assert_eq!(code, 200);
    let groups: serde_json::Value = serde_json::from_str(&groups).unwrap();
    let m = &groups["groups"][0]["members"][0];
    assert_eq!((m["id"].as_str(), m["metrics_addr"].as_str()), (Some("n1"), Some(t.metrics.as_str())));
    assert!((m["share"].as_f64().unwrap() - 1.0).abs() < 1e-9);
    // One view read by a tool.
    let view = MdsClient::new(vec![t.mds.addr.clone()], Duration::from_secs(5)).view("obs").unwrap();
    assert_eq!(view.members[0].metrics_addr.as_deref(), Some(t.metrics.as_str()));
    let (code, text) = get(&t.mds.addr, "/metrics");
    assert_eq!(code, 200);
    check_format("kv-mds", &text);
    let mv = |name: &str, l: &[(&str, &str)]| sample(&text, name, l).unwrap_or_else(|| panic!("{name} {l:?}\n{text}"));
    assert_eq!(mv("kvmds_group_members", &[("group", "obs")]), 1.0);
    assert_eq!(mv("kvmds_registrations_total", &[]), 1.0);
    assert_eq!(mv("kvmds_lease_grants_total", &[]), 1.0);
    assert_eq!(mv("kvmds_etcd_up", &[]), 1.0);
    assert!(mv("kvmds_group_epoch", &[("group", "obs")]) > 0.0);
    assert!(mv("kvmds_etcd_request_duration_seconds_count", &[]) >= 3.0);
    assert_eq!(mv("kvmds_views_total", &[("kind", "poll")]), 1.0, "the one view read above");
    assert_eq!(mv("kvmds_views_total", &[("kind", "long_poll")]), 0.0);
}

#[test]
fn every_documented_metric_and_grafana_query_exists_in_a_live_scrape() {
    let t = tier(&["--mem-cap", "8M"]);
    let c = BlockingClient::new(
        kvclient::members::parse_members(&format!("n1={}", t.node.addr)).unwrap(),
        geo(),
        Options::default(),
    )
    .unwrap();
    // Some of every op, so every series exists.
    let mut buf = vec![0u8; 4096];
    for i in 0..20 {
        let k = format!("doc-{i}");
        assert_eq!(c.putv(k.as_bytes(), &[&payload(&k, 4096)]), Status::Ok);
        let _ = c.getv(k.as_bytes(), &mut [&mut buf]);
        let _ = c.exist(k.as_bytes());
    }
    let keys: Vec<&[u8]> = vec![b"doc-1", b"doc-2"];
    let _ = c.batch_exist(&keys);
    let _ = c.delete(b"doc-3");
    let _ = c.getv(b"nope", &mut [&mut buf]);
    let mut live = names(&get(&t.metrics, "/metrics").1);
    live.extend(names(&get(&t.mds.addr, "/metrics").1));
    live.extend(names(&c.stats_text()));
    // A family with no series yet (the per-rail RDMA counters without RDMA)
    // shows only its `# TYPE` line, named without `_total`.
    let exists = |n: &str| {
        live.contains(n)
            || ["_total", "_bucket", "_sum", "_count"].iter().any(|s| live.contains(&format!("{n}{s}")))
            || n.strip_suffix("_total").is_some_and(|f| live.contains(f))
    };

    let doc = std::fs::read_to_string(workspace_root().join("docs/METRICS.md")).unwrap();
    let documented = mentioned(&doc);
    assert!(documented.len() > 40, "METRICS.md names the metrics: {documented:?}");
    // Present only once discovery has failed.
    let conditional = ["kvclient_mds_last_error_info"];
    let missing: Vec<_> = documented.iter().filter(|n| !exists(n) && !conditional.contains(&n.as_str())).collect();
    assert!(missing.is_empty(), "docs/METRICS.md names metrics no daemon exports: {missing:?}");
    // And the other way: every family a daemon exports is documented.
    let undocumented: Vec<_> = live
        .iter()
        .filter(|n| {
            let family = ["_total", "_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(n);
            !documented.contains(*n) && !documented.contains(family) && !documented.contains(&format!("{n}_total"))
        })
        .collect();
    assert!(undocumented.is_empty(), "exported but not in docs/METRICS.md: {undocumented:?}");

    let board = std::fs::read_to_string(workspace_root().join("packaging/grafana/kvcellar.json")).unwrap();
    let board: serde_json::Value = serde_json::from_str(&board).expect("the Grafana board is JSON");
    let mut queries = Vec::new();
    for p in board["panels"].as_array().unwrap() {
        for q in p["targets"].as_array().into_iter().flatten() {
            queries.push(q["expr"].as_str().unwrap().to_string());
        }
    }
    for v in board["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["definition"].as_str() {
            queries.push(q.to_string());
        }
    }
    assert!(queries.len() > 20);
    for q in &queries {
        let used = mentioned(q);
        assert!(!used.is_empty(), "a query names no metric: {q}");
        for n in used {
            assert!(exists(&n), "the Grafana query {q:?} names {n}, which no daemon exports");
        }
    }
}

#[test]
fn dashboards_are_self_contained_and_kvctl_top_reads_the_group() {
    let t = tier(&[]);
    for (what, addr) in [("node", &t.metrics), ("kv-mds", &t.mds.addr)] {
        let (code, page) = get(addr, "/");
        assert_eq!(code, 200, "{what}");
        assert!(page.starts_with("<!doctype html>"), "{what}");
        for banned in ["<link", "@import", "src=\"http", "src='http", "url(http", "cdn", "googleapis"] {
            assert!(!page.contains(banned), "{what} dashboard loads something from outside: {banned}");
        }
        assert!(page.contains("<script>") && page.contains("setInterval"), "{what} refreshes itself");
    }
    let (code, hist) = get(&t.metrics, "/api/history");
    assert_eq!(code, 200);
    assert!(hist.starts_with("{\"samples\":"), "{hist}");
    let (status, out, err) =
        run("kvctl", &["top", "--mds", &t.mds.addr, "--group", "obs", "--iterations", "2", "--interval-ms", "200"]);
    assert_eq!(status, 0, "{err}");
    assert!(out.contains("n1") && out.contains("TOTAL") && out.contains("HIT%") && out.contains("GET P99"), "{out}");
    let (status, out, err) =
        run("kvctl", &["--json", "top", "--mds", &t.mds.addr, "--group", "obs", "--iterations", "1"]);
    assert_eq!(status, 0, "{err}");
    let frame: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(frame["nodes"][0]["id"], "n1");
    assert_eq!(frame["total"]["capacity_bytes"], 128u64 << 20);
    // The tenants' table: without tokens, the default tenant alone.
    let (status, out, err) = run(
        "kvctl",
        &["top", "--mds", &t.mds.addr, "--group", "obs", "--tenants", "--iterations", "2", "--interval-ms", "200"],
    );
    assert_eq!(status, 0, "{err}");
    assert!(out.contains("TENANT") && out.contains("USE OF QUOTA") && out.contains("(no quota)"), "{out}");
    let (status, out, _) = run("kvctl", &["stat", "--all", "--mds", &t.mds.addr, "--group", "obs"]);
    assert_eq!(status, 0);
    assert!(out.contains("MEM-HIT%") && out.contains("DISK-HIT%") && out.contains("FULL"), "{out}");
    // One node: how full each disk is against its cap.
    let (status, out, _) = run("kvctl", &["stat", &t.node.addr]);
    assert_eq!(status, 0);
    let disk0 = out.lines().find(|l| l.starts_with("disk0")).unwrap_or_else(|| panic!("no disk0 line: {out}"));
    assert!(out.contains(" full ") && disk0.contains("0.0%"), "{out}");
}

/// The node's metrics port holds at most 64 connections: past them a clear
/// 503, and the port serves again once they close. Silent sockets (no
/// bytes) are closed at their deadline and never hold a slot, and sockets
/// that never say hello on the data port are counted.
#[test]
fn the_metrics_port_caps_its_connections() {
    use std::io::{Read, Write};
    let t = tier(&[]);
    // 64 keep-alive connections, each answered once (so admitted), held open.
    let held: Vec<std::net::TcpStream> = (0..64).map(|_| kv_e2e::cluster::held_http_connection(&t.metrics)).collect();
    // The 65th is told why it is refused.
    let refused = wait_until(Duration::from_secs(20), "a 503 past the cap", || {
        let mut s = std::net::TcpStream::connect(&t.metrics).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.starts_with("HTTP/1.1 503").then_some(out)
    });
    assert!(refused.contains("connection cap (64)"), "{refused}");
    drop(held);
    wait_until(Duration::from_secs(20), "the port serves again", || {
        (get(&t.metrics, "/healthz").0 == 200).then_some(())
    });
    // A socket that never says hello on the data port is closed and counted.
    let mut silent = std::net::TcpStream::connect(t.node.addr.as_str()).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut b = [0u8; 1];
    assert!(matches!(silent.read(&mut b), Ok(0) | Err(_)), "closed within its hello deadline");
    let closed = wait_until(Duration::from_secs(20), "the close counted", || {
        let (_, text) = get(&t.metrics, "/metrics");
        sample(&text, "kvcellar_connections_closed_before_hello_total", &[]).filter(|v| *v >= 1.0)
    });
    assert!(closed >= 1.0);
}
