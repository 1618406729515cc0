//! `--conn-threads` (docs/ARCHITECTURE.md, "Connections and the reactor"):
//! connections spread over single-threaded runtimes, or served on the
//! node's work-stealing runtime (0), serve the same pages, and a stop
//! answers what clients already sent and ends cleanly either way.

use std::time::Duration;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_e2e::Node;
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 3, page_size: 16, dtype_tag: 1, tp_size: 1, layer_num: 2, ..Default::default() }
}

fn page(t: usize, i: usize) -> Vec<u8> {
    (0..65_536).map(|j| ((t * 131 + i * 31 + j * 7) % 251) as u8).collect()
}

#[test]
fn connections_on_any_number_of_threads_serve_every_page_and_stop_cleanly() {
    let t = tempfile::tempdir().unwrap();
    for threads in ["0", "1", "3"] {
        let dir = t.path().join(format!("n{threads}"));
        let args = ["--dir", dir.to_str().unwrap(), "--cap", "256M", "--no-sync", "--conn-threads", threads];
        let node = Node::start(&args);
        let members = format!("n1={}", node.addr);
        // Several client threads, each with connections of its own, so the
        // node spreads them over its threads.
        std::thread::scope(|s| {
            for c in 0..4 {
                let members = &members;
                s.spawn(move || {
                    let opts = Options::parse("batch_concurrency=2").unwrap();
                    let client = BlockingClient::new(parse_members(members).unwrap(), geo(), opts).unwrap();
                    let keys: Vec<String> = (0..24).map(|i| format!("ct{threads}-{c}-{i}")).collect();
                    for (i, k) in keys.iter().enumerate() {
                        assert_eq!(client.putv(k.as_bytes(), &[&page(c, i)]), Status::Ok, "{k}");
                    }
                    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
                    assert!(client.batch_exist(&refs).iter().all(|s| *s == Status::Ok));
                    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 65_536]).collect();
                    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
                        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (k.as_bytes(), vec![&mut b[..]])).collect();
                    let res = client.batch_getv(&mut items);
                    drop(items);
                    for (i, b) in bufs.iter().enumerate() {
                        assert_eq!(res[i], (Status::Ok, 65_536), "--conn-threads {threads}: item {i}");
                        assert!(*b == page(c, i), "--conn-threads {threads}: item {i} bytes");
                    }
                });
            }
        });
        // The connections were spread: every connection thread served
        // (each wait for a socket is a voluntary switch; an unused thread
        // sleeps once), and with 0 there are none.
        let served = conn_thread_switches(node.pid());
        let want: usize = threads.parse().unwrap();
        assert_eq!(served.len(), want, "--conn-threads {threads}: threads {served:?}");
        assert!(served.iter().all(|&n| n > 10), "--conn-threads {threads}: a thread served nothing: {served:?}");
        node.signal(libc::SIGTERM);
        let (status, lines) = node.wait_exit_lines(Duration::from_secs(30));
        assert!(status.success(), "--conn-threads {threads}: {status:?}\n{}", lines.join("\n"));
    }
    // A value past the bound is refused with one clear line.
    let (code, _, err) =
        kv_e2e::run("kv-server", &["--listen", "127.0.0.1:0", "--dir", "x", "--cap", "1M", "--conn-threads", "5000"]);
    assert_ne!(code, 0);
    assert!(err.contains("--conn-threads"), "{err}");
}

/// Voluntary context switches of each of the node's connection threads
/// (named `kv-conn-N`; their blocking pools' threads are `kv-server-conn-io`).
fn conn_thread_switches(pid: i32) -> Vec<u64> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with("kv-conn-") {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let n = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        out.push(n);
    }
    out
}
