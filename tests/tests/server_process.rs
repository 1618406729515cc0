//! The real `kv-server` binary: crash safety and its command-line contract.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_common::page::Geometry;
use kv_e2e::{run, Node};
use kvclient::conn::GetResult;
use kvclient::Conn;

fn geo() -> Geometry {
    Geometry {
        model_hash: 77,
        page_size: 32,
        dtype_tag: 3,
        tp_size: 1,
        layer_num: 4,
        head_num: 8,
        head_dim: 128,
        ..Default::default()
    }
}

fn payload(i: usize) -> Vec<u8> {
    let len = 4096 + (i * 7919) % (300 << 10);
    (0..len).map(|j| ((i * 131 + j * 7) % 256) as u8).collect()
}

/// Two disk dirs in `t`, and the `--dir` value naming both.
fn two_dirs(t: &tempfile::TempDir) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let (d0, d1) = (t.path().join("d0"), t.path().join("d1"));
    let arg = format!("{},{}", d0.display(), d1.display());
    (d0, d1, arg)
}

fn conn(addr: &str) -> Conn {
    Conn::connect(addr, Duration::from_secs(20)).expect("connect")
}

#[test]
fn sigkill_then_restart_serves_every_acknowledged_record() {
    let t = tempfile::tempdir().unwrap();
    let (d0, d1, dirs) = two_dirs(&t);
    let args = ["--dir", dirs.as_str(), "--cap", "256M", "--log-level", "warn"];
    let node = Node::start(&args);

    // Two writers stream puts; the node is killed in the middle of it.
    let acked = Arc::new(Mutex::new(Vec::<usize>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (addr, acked, stop) = (node.addr.clone(), acked.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut c = conn(&addr);
                let mut i = w;
                while !stop.load(Ordering::Relaxed) && i < 100_000 {
                    match c.put(&geo(), format!("page-{i}").as_bytes(), &payload(i)) {
                        Ok(_) => acked.lock().unwrap().push(i),
                        Err(_) => return, // the node died under us
                    }
                    i += 2;
                }
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while acked.lock().unwrap().len() < 300 {
        assert!(std::time::Instant::now() < deadline, "writers too slow");
        std::thread::sleep(Duration::from_millis(10));
    }
    node.kill9();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let acked = acked.lock().unwrap().clone();

    let node = Node::start(&args);
    let mut c = conn(&node.addr);
    for &i in &acked {
        match c.get(&geo(), format!("page-{i}").as_bytes()).unwrap() {
            GetResult::Hit(v) => assert!(v == payload(i), "page-{i} differs after restart"),
            other => panic!("acknowledged page-{i} lost after SIGKILL: {other:?}"),
        }
    }
    let st = c.stats().unwrap();
    assert!(st.objects >= acked.len() as u64, "{} objects, {} acked", st.objects, acked.len());
    // The records recovered after the crash get their payloads checked; a
    // clean stop is only marked once that is done.
    wait_for(Duration::from_secs(60), || c.stats().unwrap().unverified == 0, "the scrub to finish");

    // SIGTERM: clean exit 0, and the next start finds a clean store.
    drop(c);
    let status = node.terminate(Duration::from_secs(30));
    assert!(status.success(), "SIGTERM exit: {status:?}");
    assert!(d0.join("clean").exists() && d1.join("clean").exists());
    let node = Node::start(&args);
    let mut c = conn(&node.addr);
    let i = acked[acked.len() / 2];
    assert!(matches!(c.get(&geo(), format!("page-{i}").as_bytes()).unwrap(), GetResult::Hit(_)));
    assert!(node.terminate(Duration::from_secs(30)).success());
}

fn wait_for(limit: Duration, mut ok: impl FnMut() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + limit;
    while !ok() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bytes a record occupies on disk: header, key and payload, 4 KiB aligned.
fn extent_len(key: &str, payload: usize) -> u64 {
    (64 + key.len() + payload).div_ceil(4096) as u64 * 4096
}

#[test]
fn sigkill_during_eviction_and_compaction_keeps_the_newest_records() {
    let t = tempfile::tempdir().unwrap();
    let (_, _, dirs) = two_dirs(&t);
    // 4 MiB per disk and ~40 KiB pages: about 100 live records per disk, so
    // thousands of puts evict constantly and the journal is compacted
    // (more than 2 x live + 4096 entries) while they run.
    let cap: u64 = 4 << 20;
    let args = ["--dir", dirs.as_str(), "--cap", "4M", "--log-level", "info"];
    let node = Node::start(&args);
    fn size(i: usize) -> usize {
        16_384 + (i * 7919) % 49_152
    }
    fn page(i: usize) -> Vec<u8> {
        (0..size(i)).map(|j| ((i * 31 + j * 13) % 251) as u8).collect()
    }
    let acked = Arc::new(Mutex::new(Vec::<usize>::new()));
    let writer = {
        let (addr, acked) = (node.addr.clone(), acked.clone());
        std::thread::spawn(move || {
            let mut c = conn(&addr);
            for i in 0..100_000 {
                if c.put(&geo(), format!("ev-{i}").as_bytes(), &page(i)).is_err() {
                    return;
                }
                acked.lock().unwrap().push(i);
            }
        })
    };
    let mut log = Vec::new();
    wait_for(
        Duration::from_secs(120),
        || {
            log.extend(node.stderr_lines.try_iter());
            acked.lock().unwrap().len() >= 6000 && log.iter().any(|l| l.contains("index journal compacted"))
        },
        "6000 puts and a journal compaction",
    );
    node.kill9();
    writer.join().unwrap();
    let acked = acked.lock().unwrap().clone();

    let node = Node::start(&args);
    let mut c = conn(&node.addr);
    // Where each key lives: docs/PROTOCOL.md §4 over disk0 and disk1 (weight 1 each).
    let ring = kv_common::Ring::new(vec![
        kv_common::ring::RingMember { id: "disk0".into(), weight: 1 },
        kv_common::ring::RingMember { id: "disk1".into(), weight: 1 },
    ]);
    // One writer: insertion order is ack order. Eviction is LRU, so each disk
    // keeps the newest records; how many bytes of them depends on
    // fragmentation (mixed sizes sometimes evict an extra record or two to
    // find a contiguous extent; a store test measured at most 1.6 records
    // here), plus one record that may have been in flight. So the newest
    // records within the cap less four of the largest extents must all be
    // there; older ones may be evicted, but nothing is ever served wrong.
    let mut room = [cap - 4 * extent_len("ev-000000", 65_536); 2];
    let (mut must, mut served) = (0, 0);
    for &i in acked.iter().rev() {
        let k = format!("ev-{i}");
        let disk = ring.owner(k.as_bytes()).unwrap();
        let need = extent_len(&k, size(i));
        let required = room[disk] >= need;
        room[disk] = room[disk].saturating_sub(need);
        match c.get(&geo(), k.as_bytes()).unwrap() {
            GetResult::Hit(v) => {
                assert!(v == page(i), "{k} served with wrong bytes");
                served += 1;
            }
            other => assert!(!required, "{k} is among the newest that fit, yet: {other:?}"),
        }
        must += usize::from(required);
    }
    assert!(must > 100 && served >= must, "must {must}, served {served}");
    let st = c.stats().unwrap();
    assert!(st.evictions == 0, "no eviction needed at restart");
    assert!(st.used_bytes <= st.capacity_bytes);
    drop(c);
    assert!(node.terminate(Duration::from_secs(30)).success());
}

fn one_clear_line(code: i32, err: &str, want: &str) {
    assert_ne!(code, 0);
    let err = err.trim_end();
    assert!(!err.contains('\n'), "exactly one line: {err}");
    assert!(err.contains(want), "stderr should say {want:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "no panic trace: {err}");
}

#[test]
fn bad_flags_and_unusable_resources_give_one_clear_line() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let dir_s = dir.to_str().unwrap();
    let (code, _, err) = run("kv-server", &["--listen", "127.0.0.1:0", "--dir", dir_s, "--cap", "lots"]);
    one_clear_line(code, &err, "--cap: invalid size");
    assert_eq!(code, 2);
    let (code, _, err) = run("kv-server", &["--dir", dir_s, "--cap", "1G"]);
    one_clear_line(code, &err, "--listen is required");
    let (code, _, err) = run("kv-server", &["--bogus"]);
    one_clear_line(code, &err, "--bogus");
    assert_eq!(code, 2);
    // A regular file where a directory should be.
    let file = t.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let (code, _, err) = run("kv-server", &["--listen", "127.0.0.1:0", "--dir", file.to_str().unwrap(), "--cap", "1G"]);
    one_clear_line(code, &err, "disk dir");
    // A port in use.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = holder.local_addr().unwrap().to_string();
    let (code, _, err) = run("kv-server", &["--listen", &busy, "--dir", dir_s, "--cap", "1G"]);
    one_clear_line(code, &err, "cannot listen on");
    // A dir already served by another kv-server.
    let node = Node::start(&["--dir", dir_s, "--cap", "64M"]);
    let (code, _, err) = run("kv-server", &["--listen", "127.0.0.1:0", "--dir", dir_s, "--cap", "64M"]);
    one_clear_line(code, &err, "in use by another kv-server");
    drop(node);
    let (code, out, _) = run("kv-server", &["--version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("kv-server "));
}

#[test]
fn kvctl_round_trip_and_exit_codes() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M"]);
    let a = node.addr.as_str();
    let (code, out, _) = run("kvctl", &["put", "--node", a, "greeting", "hello kvcellar"]);
    assert_eq!((code, out.trim()), (0, "ok"));
    let (code, out, _) = run("kvctl", &["get", "--node", a, "greeting"]);
    assert_eq!((code, out.as_str()), (0, "hello kvcellar"));
    let (code, _, _) = run("kvctl", &["get", "--node", a, "greeting", "--model-hash", "5"]);
    assert_eq!(code, 1, "another geometry is not served");
    let (code, out, _) = run("kvctl", &["exist", "--node", a, "nothing", "--json"]);
    assert_eq!(code, 1);
    assert!(out.contains("\"miss\""));
    let (code, out, _) = run("kvctl", &["stat", a, "--json"]);
    assert_eq!(code, 0);
    assert!(out.contains("\"objects\": 1"), "{out}");
    let (code, _, err) = run("kvctl", &["get", "--node", "127.0.0.1:1", "greeting"]);
    assert_eq!(code, 1, "not served is a miss-like exit");
    assert!(err.contains("unavailable: node n1 (127.0.0.1:1)"), "the reason names the node: {err}");
    let (code, _, err) = run("kvctl", &["stat", "127.0.0.1:1"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot connect"), "{err}");
}
