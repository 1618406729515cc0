//! `kv-fuzz`: a bounded mutation driver for the targets in `lib.rs`.
//!
//! ```text
//! kv-fuzz run [--seconds N] [--seed S] [TARGET...]   mutate the corpus for N s per target (default 20)
//! kv-fuzz seeds                                      (re)write the seed corpus from valid encodings
//! ```
//!
//! Each round takes a corpus input (or a past finding), applies 1 to 8
//! mutations (bit flips, interesting bytes and integers at random offsets,
//! inserted, deleted and duplicated ranges, splices with another input) and
//! runs the target under `catch_unwind`. A panic writes the input to
//! `fuzz/artifacts/<target>/` and ends the run with exit code 1; copy it to
//! `fuzz/regressions/<target>/` once fixed, so `cargo test -p kv-fuzz`
//! replays it for ever. Deterministic for a given `--seed`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kv_fuzz::TARGETS;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x3ff,
    0x400,
    0x401,
    0x1000,
    0xffff,
    0x1_0000,
    0x10_0000,
    0x1000_0000,
    0x7fff_ffff,
    0xffff_ffff,
    u64::MAX,
    u64::MAX / 2,
];

fn mutate(rng: &mut Rng, data: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..1 + rng.below(8) {
        let len = data.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = INTERESTING[rng.below(6)] as u8;
            }
            2 if len > 0 => {
                // An integer at a random offset, 2/4/8 bytes, little-endian.
                let w = [2, 4, 8][rng.below(3)];
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let i = rng.below(len);
                let n = w.min(len - i);
                data[i..i + n].copy_from_slice(&v[..n]);
            }
            3 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                data.splice(i..i, bytes);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                data.drain(i..i + n);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let copy = data[i..i + n].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, copy);
            }
            6 if !other.is_empty() => {
                // Splice: our head, the other input's tail.
                let cut = rng.below(len + 1);
                let from = rng.below(other.len());
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            _ => {
                if len > 1 {
                    let cut = rng.below(len);
                    data.truncate(cut.max(1));
                }
            }
        }
    }
    data.truncate(1 << 20);
}

fn load(dir: &Path) -> Vec<Vec<u8>> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter_map(|e| std::fs::read(e.path()).ok().map(|d| (e.path(), d))).collect())
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(|(_, d)| d).collect()
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn run(names: &[String], seconds: u64, seed: u64) -> bool {
    // Panics are findings, reported once by the loop, not by the hook.
    std::panic::set_hook(Box::new(|_| {}));
    let mut clean = true;
    for (name, f) in TARGETS {
        if !names.is_empty() && !names.iter().any(|n| n == name) {
            continue;
        }
        let mut inputs = load(&root().join("corpus").join(name));
        inputs.extend(load(&root().join("regressions").join(name)));
        if inputs.is_empty() {
            inputs.push(Vec::new());
        }
        let mut rng = Rng(seed ^ fnv(name.as_bytes()) | 1);
        let start = Instant::now();
        let mut execs = 0u64;
        let budget = Duration::from_secs(seconds);
        let mut found = None;
        while start.elapsed() < budget {
            for _ in 0..256 {
                let base = &inputs[rng.below(inputs.len())];
                let other = &inputs[rng.below(inputs.len())];
                let mut data = base.clone();
                mutate(&mut rng, &mut data, other);
                execs += 1;
                if std::panic::catch_unwind(|| f(&data)).is_err() {
                    found = Some(data);
                    break;
                }
            }
            if found.is_some() {
                break;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        match found {
            None => println!(
                "fuzz {name}: {execs} executions in {secs:.1} s ({:.0}/s), {} corpus inputs, no finding",
                execs as f64 / secs,
                inputs.len()
            ),
            Some(data) => {
                clean = false;
                let dir = root().join("artifacts").join(name);
                let _ = std::fs::create_dir_all(&dir);
                let p = dir.join(format!("crash-{:016x}", fnv(&data)));
                let _ = std::fs::write(&p, &data);
                let _ = std::panic::take_hook();
                let msg = std::panic::catch_unwind(|| f(&data)).err().map(|p| {
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                });
                println!("fuzz {name}: FINDING after {execs} executions: {msg:?}; input saved to {}", p.display());
                std::panic::set_hook(Box::new(|_| {}));
            }
        }
    }
    clean
}

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = root().join("corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(name), data).expect("write seed");
}

/// Valid encodings of every input kind, so mutations start deep.
fn seeds() {
    use kv_common::page::{build_record, Geometry};
    use kv_common::wire::{self, Hello, KeyRequest, Op, ReqHeader, RspHeader};
    let geo = Geometry { model_hash: 7, page_size: 64, tp_size: 2, layer_num: 4, ..Geometry::default() };
    let rec = build_record(geo, b"page-key-1", &(0..300u32).map(|i| i as u8).collect::<Vec<_>>());
    let hdr = |op, body: &[u8]| {
        let mut v =
            ReqHeader { op, flags: wire::FLAG_CHECK_GEOMETRY, copy_age: 0, body_len: body.len() as u32, req_id: 9 }
                .encode()
                .to_vec();
        v.extend_from_slice(body);
        v
    };
    write("frame", "put", &hdr(Op::Put, &rec));
    write("frame", "get", &hdr(Op::Get, &KeyRequest::encode(&geo, b"page-key-1")));
    write("frame", "exist", &hdr(Op::Exist, &KeyRequest::encode(&geo, b"k")));
    write("frame", "batch_exist", &hdr(Op::BatchExist, &wire::encode_batch_exist(&geo, &[b"a".as_slice(), b"bb"])));
    write("frame", "delete", &hdr(Op::Delete, b"\x01\x00k"));
    write("frame", "hello_v2", &wire::client_hello(2, Some(b"token")));
    write("frame", "hello_v3", &wire::client_hello(3, Some(b"token")));
    let items = [
        wire::BatchItem { flags: 0, key: b"page-key-1", segs: &[], spread: 0 },
        wire::BatchItem { flags: wire::ITEM_HANDOFF, key: b"page-key-2", segs: &[], spread: 0 },
    ];
    write("frame", "batch_get", &hdr(Op::BatchGet, &wire::encode_batch_get(&geo, &items)));
    write("frame", "hello_v4", &wire::client_hello(4, Some(b"token")));
    let puts = [
        (wire::PutItemHead { flags: 0, copy_age: 0, record_len: rec.len() as u32 }, &rec[..]),
        (wire::PutItemHead { flags: wire::ITEM_HANDOFF, copy_age: 12, record_len: rec.len() as u32 }, &rec[..]),
    ];
    write("frame", "batch_put", &hdr(Op::BatchPut, &wire::encode_batch_put(&puts)));
    write("frame", "batch_delete", &hdr(Op::BatchDelete, &wire::encode_batch_delete(&items)));
    {
        // Items naming segments of the client's memory (ITEM_RDMA).
        let mut segs = Vec::new();
        wire::encode_segments(&[wire::Segment { addr: 0x7f00_0000_0000, rkey: 5, len: 4 }], &mut segs);
        let named = [
            wire::BatchItem { flags: wire::ITEM_RDMA, key: b"page-key-1", segs: &segs, spread: 0 },
            wire::BatchItem { flags: 0, key: b"page-key-2", segs: &[], spread: 0 },
        ];
        write("frame", "batch_get_rdma", &hdr(Op::BatchGet, &wire::encode_batch_get(&geo, &named)));
        let h = kv_common::page::PageHeader::new(geo, b"k", 4, 0);
        let mut remote = h.encode().to_vec();
        remote.extend_from_slice(b"k");
        remote.extend_from_slice(&segs);
        let puts = [
            (wire::PutItemHead { flags: wire::ITEM_RDMA, copy_age: 0, record_len: remote.len() as u32 }, &remote[..]),
            (wire::PutItemHead { flags: 0, copy_age: 0, record_len: rec.len() as u32 }, &rec[..]),
        ];
        write("frame", "batch_put_rdma", &hdr(Op::BatchPut, &wire::encode_batch_put(&puts)));
    }
    {
        use kv_common::wire::{encode_segments, Segment};
        use kv_rdma::bootstrap::{Answer, Endpoint};
        let ep = Endpoint {
            depth: 32,
            port: 1,
            mtu: 5,
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 2, 0xc9, 0xff, 0xfe, 0, 0, 1],
            qpn: 0x1234,
            psn: 0xab_cdef,
            device: "mlx5_0".into(),
            reads: None,
            batches: false,
        };
        write("frame", "rdma_connect", &hdr(Op::RdmaConnect, &ep.encode_request()));
        write("rdma", "endpoint", &ep.encode_request());
        write("rdma", "answer_accepted", &Answer::Accepted(ep).encode());
        write("rdma", "answer_not_offered", &Answer::NotOffered("no RDMA device named".into()).encode());
        let mut segs = Vec::new();
        let s = |addr| Segment { addr, rkey: 9, len: 4096 };
        encode_segments(&[s(0x7f00_0000_0000), s(0x7f00_0010_0000)], &mut segs);
        segs.extend_from_slice(&KeyRequest::encode(&geo, b"key"));
        write("rdma", "segments_then_key", &segs);
    }
    write("page", "record", &rec);
    write("page", "record_empty_payload", &build_record(geo, b"k", &[]));
    write("mds_request", "view", b"\x00/v1/groups/prod/view?after=41&wait_ms=1000\n");
    write(
        "mds_request",
        "register",
        b"\x01/v1/groups/prod/members/n1\n{\"addr\":\"10.0.0.7:7700\",\"weight\":3,\"instance\":\"1-abc\"}",
    );
    write("mds_request", "heartbeat", b"\x01/v1/groups/g/members/n1/heartbeat\n{\"instance\":\"x\"}");
    write("mds_request", "deregister", b"\x02/v1/groups/g/members/n1?instance=x\n");
    write("mds_request", "health", b"\x00/healthz\n");
    write(
        "config",
        "server_toml",
        br#"listen = "127.0.0.1:7700"
dirs = ["/mnt/a", "/mnt/b:1T"]
cap = "16G"
mem_cap = "1G"
max_conns = 1024
idle_timeout = 120
max_record = "256M"
max_inflight = "1G"
mds = "10.0.0.1:7480,10.0.0.2:7480"
group = "prod"
id = "gpu-7"
advertise = "10.0.0.7:7700"
weight = 4
"#,
    );
    write("config", "options", b"connect_timeout_ms=3000,io_timeout_ms=10000,max_conns_per_node=16,peer_cooldown_ms=0");
    write("config", "members", b"n1=10.0.0.7:7700@2,n2=host-b:7700,n3=[::1]:7700@10000");
    write("config", "size", b"512G");
    let rsp = |st, body: &[u8]| {
        let mut v = RspHeader { status: st, op: 2, flags: 0, body_len: body.len() as u32, req_id: 3 }.encode().to_vec();
        v.extend_from_slice(body);
        v
    };
    write("client_reply", "get_hit", &rsp(kv_common::Status::Ok, &rec));
    write(
        "client_reply",
        "batch_status",
        &wire::encode_batch_status(&[kv_common::Status::Ok, kv_common::Status::Miss]),
    );
    let mut answer = wire::encode_batch_answer_head(1).to_vec();
    answer.extend_from_slice(
        &wire::ItemHead { status: kv_common::Status::Ok, flags: 0, spread: 0, len: rec.len() as u32 }.encode(),
    );
    answer.extend_from_slice(&rec);
    write("client_reply", "batch_get_answer", &answer);
    let heads = [
        (wire::ItemHead { status: kv_common::Status::Ok, flags: wire::ITEM_DUPLICATE, spread: 0, len: 0 }, &b""[..]),
        (wire::ItemHead { status: kv_common::Status::Rejected, flags: 0, spread: 0, len: 4 }, &b"full"[..]),
    ];
    // Its first byte is its count (2), as the target reads it.
    write("client_reply", "batch_put_answer", &wire::encode_batch_answer(&heads));
    write("client_reply", "stats", serde_json::to_string(&kv_common::stats::NodeStats::default()).unwrap().as_bytes());
    write("client_reply", "hello", &Hello { version: 2, status: 0, max_record: 1 << 28 }.encode());
    write(
        "client_reply",
        "mds_view",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 93\r\n\r\n{\"group\":\"g\",\"epoch\":41,\"members\":[{\"id\":\"n1\",\"addr\":\"127.0.0.1:7701\",\"weight\":1}]}  ",
    );
    println!("seeds written under {}", root().join("corpus").display());
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("seeds") => {
            seeds();
            std::process::ExitCode::SUCCESS
        }
        Some("run") => {
            let mut seconds = 20;
            let mut seed = 0x6b76_6365_6c6c_6172; // "kvcellar"
            let mut names = Vec::new();
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--seconds" => seconds = it.next().and_then(|v| v.parse().ok()).unwrap_or(seconds),
                    "--seed" => seed = it.next().and_then(|v| v.parse().ok()).unwrap_or(seed),
                    n if TARGETS.iter().any(|(t, _)| *t == n) => names.push(n.to_string()),
                    other => {
                        eprintln!("kv-fuzz: unknown argument {other:?}");
                        return std::process::ExitCode::from(2);
                    }
                }
            }
            if run(&names, seconds, seed) {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            }
        }
        _ => {
            eprintln!("usage: kv-fuzz run [--seconds N] [--seed S] [TARGET...] | kv-fuzz seeds");
            std::process::ExitCode::from(2)
        }
    }
}
