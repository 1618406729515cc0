//! Batch writes (docs/PROTOCOL.md §2.5, BATCH_PUT and BATCH_DELETE,
//! protocol v4) against real kv-server processes: a batch answers every
//! item as single frames do, a malformed batch is refused whole without
//! costing the connection or storing anything, and a refused token or a
//! stopped node fails a batch as it fails single requests.

use std::time::Duration;

use kv_common::page::{build_record, Geometry};
use kv_common::status::Status;
use kv_common::wire::{self, BatchItem, ItemHead, Op, PutItemHead, ITEM_DUPLICATE};
use kv_e2e::Node;
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Conn, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 21, page_size: 16, dtype_tag: 1, tp_size: 1, layer_num: 2, ..Default::default() }
}

fn client(members: &str, opts: &str) -> BlockingClient {
    BlockingClient::new(parse_members(members).unwrap(), geo(), Options::parse(opts).unwrap()).unwrap()
}

fn page(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((i * 37 + j * 11) % 253) as u8).collect()
}

/// A batch write sent raw: the answer's status, and on OK each item's head
/// and message, else the frame's message.
fn raw(conn: &mut Conn, op: Op, body: &[u8]) -> (Status, Vec<(ItemHead, String)>, String) {
    let id = conn.send(op, 0, &[body]).unwrap();
    let r = conn.recv().unwrap();
    assert_eq!((r.header.req_id, r.header.op), (id, op as u8));
    if r.header.status != Status::Ok {
        return (r.header.status, Vec::new(), String::from_utf8_lossy(&r.body).into_owned());
    }
    let n = wire::decode_batch_answer_head(r.body[..8].try_into().unwrap());
    let items = wire::decode_batch_answer(&r.body, n).unwrap();
    (Status::Ok, items.into_iter().map(|(h, m)| (h, String::from_utf8_lossy(m).into_owned())).collect(), String::new())
}

fn put_body(records: &[&[u8]]) -> Vec<u8> {
    let items: Vec<(PutItemHead, &[u8])> =
        records.iter().map(|r| (PutItemHead { flags: 0, copy_age: 0, record_len: r.len() as u32 }, *r)).collect();
    wire::encode_batch_put(&items)
}

fn read(c: &BlockingClient, key: &str, cap: usize) -> Result<Vec<u8>, Status> {
    let mut buf = vec![0u8; cap];
    c.getv(key.as_bytes(), &mut [&mut buf[..]]).map(|n| buf[..n].to_vec()).map_err(|e| e.0)
}

#[test]
fn a_batch_put_answers_every_item_as_single_puts_do_on_memory_and_media_acks() {
    let t = tempfile::tempdir().unwrap();
    for (name, extra) in [("media", &[][..]), ("memory", &["--mem-cap", "64M", "--ack", "memory"][..])] {
        let dir = t.path().join(name);
        let mut args = vec!["--dir", dir.to_str().unwrap(), "--cap", "256M", "--max-record", "1M"];
        args.extend_from_slice(extra);
        let node = Node::start(&args);
        let members = format!("n1={}", node.addr);
        let c = client(&members, "batch_concurrency=2");
        let keys: Vec<String> = (0..24).map(|i| format!("bw-{name}-{i}")).collect();
        let mut pages: Vec<Vec<u8>> = (0..24).map(|i| page(i, 1000 + i * 9001)).collect();
        pages[7] = page(7, 2 << 20); // over --max-record
        assert_eq!(c.putv(keys[3].as_bytes(), &[&pages[3]]), Status::Ok, "stored before the batch");
        let items: Vec<(&[u8], Vec<&[u8]>)> =
            keys.iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
        let batch = c.batch_putv(&items);
        let mut want = vec![Status::Ok; 24];
        want[7] = Status::Rejected;
        assert_eq!(batch, want, "{name}");
        // What single puts of the same items answer (write-once: Ok again).
        let single: Vec<Status> = items.iter().map(|(k, v)| c.putv(k, v)).collect();
        assert_eq!(batch, single, "{name}: batch against single");
        for (i, k) in keys.iter().enumerate() {
            if i != 7 {
                assert_eq!(read(&c, k, 300_000).as_deref(), Ok(&pages[i][..]), "{name}: {k}");
            }
        }
        // Raw: the node's own verdict per item, and the duplicate flag.
        let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
        let good = build_record(geo(), b"raw-good", b"raw page");
        let mut bad_header = build_record(geo(), b"raw-bad-header", b"x");
        bad_header[0] ^= 0xff;
        let mut bad_payload = build_record(geo(), b"raw-bad-payload", b"payload bytes");
        *bad_payload.last_mut().unwrap() ^= 1;
        let dup = build_record(geo(), keys[0].as_bytes(), &pages[0]);
        let body = put_body(&[&good, &bad_header, &bad_payload, &dup]);
        let (status, got, _) = raw(&mut conn, Op::BatchPut, &body);
        assert_eq!(status, Status::Ok);
        let st: Vec<(Status, u8)> = got.iter().map(|(h, _)| (h.status, h.flags)).collect();
        assert_eq!(
            st,
            [(Status::Ok, 0), (Status::BadRequest, 0), (Status::Corrupt, 0), (Status::Ok, ITEM_DUPLICATE)],
            "{name}: {got:?}"
        );
        assert!(got[1].1.starts_with("invalid record"), "{name}: {}", got[1].1);
        assert_eq!(read(&c, "raw-good", 64).as_deref(), Ok(&b"raw page"[..]));
        assert_eq!(read(&c, "raw-bad-payload", 64), Err(Status::Miss), "a damaged record is not stored");
        let stats = conn.stats().unwrap();
        let frames = |op: &str| stats.latency.iter().find(|l| l.op == op).map_or(0, |l| l.count);
        // The client's batch went as a few frames (two lanes, each split at
        // half of --max-record; the record over it refused by the client,
        // as a single put refuses it), one more raw; the single puts as 23
        // PUTs plus the one before.
        assert!((3..=12).contains(&frames("batch_put")), "{name}: {:?}", stats.latency);
        assert_eq!(frames("put"), 24, "{name}: {:?}", stats.latency);
        node.terminate(Duration::from_secs(20));
    }
}

#[test]
fn a_batch_delete_answers_every_key_as_single_deletes_do() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let a = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--no-sync"]);
    let dir2 = t.path().join("e");
    let b = Node::start(&["--dir", dir2.to_str().unwrap(), "--cap", "64M", "--no-sync"]);
    let c = client(&format!("n1={},n2={}", a.addr, b.addr), "");
    let keys: Vec<String> = (0..30).map(|i| format!("bd-{i}")).collect();
    for k in &keys[..20] {
        assert_eq!(c.putv(k.as_bytes(), &[k.as_bytes()]), Status::Ok);
    }
    let ks: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let mut want = vec![Status::Ok; 20];
    want.extend([Status::Miss; 10]);
    assert_eq!(c.batch_delete(&ks), want);
    assert_eq!(c.batch_exist(&ks), vec![Status::Miss; 30], "every key gone");
    assert_eq!(c.batch_delete(&ks), vec![Status::Miss; 30], "as single deletes answer now");
    assert!(ks.iter().all(|k| c.delete(k) == Status::Miss));
    // A key no frame can carry fails only itself.
    assert_eq!(c.putv(b"bd-keep", &[b"kept"]), Status::Ok);
    let long = vec![b'k'; 2000];
    let odd: [&[u8]; 3] = [b"bd-keep", b"", &long];
    let st = c.batch_delete(&odd);
    assert_eq!(st[0], Status::Ok, "{st:?}");
    assert!(st[1] != Status::Ok && st[2] != Status::Ok, "{st:?}");
    // Raw, with a malformed frame between good ones.
    let mut conn = Conn::connect(&a.addr, Duration::from_secs(10)).unwrap();
    let list = [
        BatchItem { flags: 0, key: b"x", segs: &[], spread: 0 },
        BatchItem { flags: 0, key: b"y", segs: &[], spread: 0 },
    ];
    let good = wire::encode_batch_delete(&list);
    let mut lie = good.clone();
    lie[0..4].copy_from_slice(&3u32.to_le_bytes());
    let (status, _, msg) = raw(&mut conn, Op::BatchDelete, &lie);
    assert_eq!(status, Status::BadRequest);
    assert!(msg.contains("batch_delete"), "{msg}");
    assert_eq!(conn.ping(b"here").unwrap(), b"here");
    let (status, items, _) = raw(&mut conn, Op::BatchDelete, &good);
    assert_eq!(status, Status::Ok);
    assert!(items.iter().all(|(h, _)| h.status == Status::Miss));
    a.terminate(Duration::from_secs(20));
    b.terminate(Duration::from_secs(20));
}

#[test]
fn a_malformed_batch_put_stores_nothing_and_the_connection_stays_usable() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--no-sync"]);
    let c = client(&format!("n1={}", node.addr), "");
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let rec = build_record(geo(), b"mal-0", b"page zero");
    let good = put_body(&[&rec]);
    let mut lie = good.clone();
    lie[0..4].copy_from_slice(&2u32.to_le_bytes()); // two items announced, one sent
    let mut trailing = good.clone();
    trailing.extend_from_slice(b"tail");
    let mut long = good.clone();
    long[8 + 4..8 + 8].copy_from_slice(&(rec.len() as u32 + 1).to_le_bytes()); // past the frame's end
    let mut none = good.clone();
    none[0..4].copy_from_slice(&0u32.to_le_bytes());
    for (what, body) in [
        ("count", &lie[..]),
        ("trailing bytes", &trailing[..]),
        ("a record past the end", &long[..]),
        ("no items", &none[..]),
        ("short", &good[..5]),
    ] {
        let (status, _, msg) = raw(&mut conn, Op::BatchPut, body);
        assert_eq!(status, Status::BadRequest, "{what}");
        assert!(msg.contains("batch_put"), "{what}: {msg}");
        assert_eq!(conn.ping(b"still here").unwrap(), b"still here", "{what}: the connection stays usable");
        assert_eq!(read(&c, "mal-0", 64), Err(Status::Miss), "{what}: nothing stored");
    }
    let (status, items, _) = raw(&mut conn, Op::BatchPut, &good);
    assert_eq!((status, items[0].0.status), (Status::Ok, Status::Ok));
    assert_eq!(read(&c, "mal-0", 64).as_deref(), Ok(&b"page zero"[..]));
    // A frame over the op's limit is not read: the node closes it alone.
    {
        use std::io::{Read, Write};
        let mut over = std::net::TcpStream::connect(&node.addr).unwrap();
        over.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        over.write_all(&wire::client_hello(wire::WIRE_VERSION, None)).unwrap();
        let mut hello = [0u8; wire::HELLO_LEN];
        over.read_exact(&mut hello).unwrap();
        let body_len = wire::MAX_BATCH_PUT_BODY + 1;
        let h = wire::ReqHeader { op: Op::BatchPut, flags: 0, copy_age: 0, body_len, req_id: 1 };
        over.write_all(&h.encode()).unwrap();
        let mut rest = Vec::new();
        let _ = over.read_to_end(&mut rest);
        assert!(rest.is_empty(), "closed without an answer");
    }
    assert_eq!(conn.ping(b"x").unwrap(), b"x", "other connections unaffected");
    node.terminate(Duration::from_secs(20));
}

#[test]
fn a_batch_put_larger_than_the_memory_budget_is_refused_whole_and_the_client_splits_it() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&[
        "--dir",
        dir.to_str().unwrap(),
        "--cap",
        "64M",
        "--no-sync",
        "--max-record",
        "1M",
        "--max-inflight",
        "1M",
    ]);
    let keys: Vec<String> = (0..6).map(|i| format!("budget-{i}")).collect();
    let pages: Vec<Vec<u8>> = (0..6).map(|i| page(i, 400_000)).collect();
    let records: Vec<Vec<u8>> = keys.iter().zip(&pages).map(|(k, p)| build_record(geo(), k.as_bytes(), p)).collect();
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let refs: Vec<&[u8]> = records.iter().map(|r| &r[..]).collect();
    let (status, _, msg) = raw(&mut conn, Op::BatchPut, &put_body(&refs[..3]));
    assert_eq!(status, Status::Rejected, "{msg}");
    assert!(msg.contains("--max-inflight"), "{msg}");
    assert_eq!(conn.ping(b"ok").unwrap(), b"ok", "the connection stays usable");
    // The client keeps a frame within half of max_record: all stored.
    let c = client(&format!("n1={}", node.addr), "batch_concurrency=1");
    let items: Vec<(&[u8], Vec<&[u8]>)> = keys.iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert_eq!(c.batch_putv(&items), [Status::Ok; 6]);
    for (k, p) in keys.iter().zip(&pages) {
        assert_eq!(read(&c, k, 400_000).as_deref(), Ok(&p[..]), "{k}");
    }
    node.terminate(Duration::from_secs(20));
}

#[test]
fn a_denied_or_stopped_node_fails_a_batch_write_as_single_writes() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let tok = t.path().join("token");
    std::fs::write(&tok, "writes-token").unwrap();
    let node =
        Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--auth-token-file", tok.to_str().unwrap()]);
    let members = format!("n1={}", node.addr);
    let keys: [&[u8]; 3] = [b"dw-0", b"dw-1", b"dw-2"];
    let items: Vec<(&[u8], Vec<&[u8]>)> = keys.iter().map(|k| (*k, vec![&b"some page"[..]])).collect();
    let wrong = t.path().join("wrong");
    std::fs::write(&wrong, "not-the-token").unwrap();
    let denied = client(&members, &format!("auth_token_file={}", wrong.display()));
    assert_eq!(denied.batch_putv(&items), [Status::Edenied; 3]);
    assert_eq!(denied.putv(keys[0], &items[0].1), Status::Edenied);
    assert_eq!(denied.batch_delete(&keys), [Status::Edenied; 3]);
    assert_eq!(denied.delete(keys[0]), Status::Edenied);
    let slow = client(&members, &format!("auth_token_file={},io_timeout_ms=300", tok.display()));
    assert_eq!(slow.batch_putv(&items), [Status::Ok; 3], "pools connections while the node runs");
    node.signal(libc::SIGSTOP);
    let t0 = std::time::Instant::now();
    let puts = slow.batch_putv(&items);
    let took = t0.elapsed();
    // The timeout starts the node's cool-down: a batch delete then fails
    // fast, as a single delete does.
    let dels = (slow.batch_delete(&keys), slow.delete(keys[0]));
    node.signal(libc::SIGCONT);
    assert_eq!(puts, [Status::Timeout; 3], "after {took:?}");
    assert!(took < Duration::from_secs(3), "bounded by the I/O timeout: {took:?}");
    assert_eq!(dels, (vec![Status::Unavailable; 3], Status::Unavailable));
    let fresh = client(&members, &format!("auth_token_file={},io_timeout_ms=300", tok.display()));
    assert_eq!(fresh.batch_delete(&keys), [Status::Ok; 3], "pools a connection while the node runs");
    node.signal(libc::SIGSTOP);
    let t0 = std::time::Instant::now();
    let dels = fresh.batch_delete(&keys);
    let took = t0.elapsed();
    node.signal(libc::SIGCONT);
    assert_eq!(dels, [Status::Timeout; 3], "after {took:?}");
    assert!(took < Duration::from_secs(3), "bounded by the I/O timeout: {took:?}");
    let ok = client(&members, &format!("auth_token_file={}", tok.display()));
    assert_eq!(ok.batch_putv(&items), [Status::Ok; 3], "the node carries on");
    assert_eq!(ok.batch_delete(&keys), [Status::Ok; 3]);
    node.terminate(Duration::from_secs(20));
}

#[test]
fn handoff_copies_in_a_batch_put_follow_a_single_copys_rules() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--no-sync", "--handoff-secs", "60"]);
    let c = client(&format!("n1={}", node.addr), "");
    assert_eq!(c.putv(b"hc-deleted", &[b"stale page"]), Status::Ok);
    assert_eq!(c.delete(b"hc-deleted"), Status::Ok, "its tombstone lasts the window");
    let copy = |key: &[u8], age: Duration, payload: &[u8]| {
        let rec = build_record(geo(), key, payload);
        let head = PutItemHead {
            flags: wire::ITEM_HANDOFF,
            copy_age: wire::encode_copy_age(age),
            record_len: rec.len() as u32,
        };
        (head, rec)
    };
    let items = [
        copy(b"hc-deleted", Duration::ZERO, b"stale page"),
        copy(b"hc-fresh", Duration::from_secs(2), b"fresh copy"),
        copy(b"hc-old", Duration::from_secs(40), b"old copy"),
    ];
    // A plain put of the deleted key beside them is taken: the tombstone
    // refuses copies, never a caller's put.
    let plain = build_record(geo(), b"hc-deleted", b"new page");
    let mut list: Vec<(PutItemHead, &[u8])> = items.iter().map(|(h, r)| (*h, &r[..])).collect();
    list.push((PutItemHead { flags: 0, copy_age: 0, record_len: plain.len() as u32 }, &plain[..]));
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let (status, got, _) = raw(&mut conn, Op::BatchPut, &wire::encode_batch_put(&list));
    assert_eq!(status, Status::Ok);
    let st: Vec<Status> = got.iter().map(|(h, _)| h.status).collect();
    assert_eq!(st, [Status::Rejected, Status::Ok, Status::Rejected, Status::Ok], "{got:?}");
    assert!(got[0].1.contains("deleted"), "{}", got[0].1);
    assert!(got[2].1.contains("too old"), "{}", got[2].1);
    assert_eq!(read(&c, "hc-fresh", 64).as_deref(), Ok(&b"fresh copy"[..]));
    assert_eq!(read(&c, "hc-old", 64), Err(Status::Miss));
    assert_eq!(read(&c, "hc-deleted", 64).as_deref(), Ok(&b"new page"[..]));
    node.terminate(Duration::from_secs(20));
}

/// Items that name segments of the client's memory (ITEM_RDMA) on a
/// connection with no RDMA queue pair: a put item is answered UNAVAILABLE
/// with ITEM_RDMA_FAILED and stores nothing (the client sends it again
/// inline), a get item is answered inline, a bad segment list is that put
/// item's BAD_REQUEST or the whole get frame's, and the other items of the
/// frames are served.
#[test]
fn items_naming_segments_without_rdma_are_answered_as_single_rdma_requests_are() {
    use kv_common::page::{PageHeader, HEADER_LEN};
    use kv_common::wire::{Segment, ITEM_RDMA, ITEM_RDMA_FAILED};
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--no-sync"]);
    let c = client(&format!("n1={}", node.addr), "");
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let payload = page(5, 32 << 10);
    let named = |key: &[u8], segs: &[Segment]| {
        let h = PageHeader::new(geo(), key, payload.len() as u64, crc32fast::hash(&payload));
        let mut rec = h.encode().to_vec();
        rec.extend_from_slice(key);
        wire::encode_segments(segs, &mut rec);
        rec
    };
    let seg = Segment { addr: 0x7f00_0000_0000, rkey: 3, len: payload.len() as u32 };
    let remote = named(b"seg-0", &[seg]);
    let short = named(b"seg-1", &[Segment { len: 100, ..seg }]);
    let plain = build_record(geo(), b"seg-2", b"inline");
    let item = |flags, r: &[u8]| (PutItemHead { flags, copy_age: 0, record_len: r.len() as u32 }, r.to_vec());
    let list = [item(ITEM_RDMA, &remote), item(ITEM_RDMA, &short), item(0, &plain)];
    let body = wire::encode_batch_put(&list.iter().map(|(h, r)| (*h, &r[..])).collect::<Vec<_>>());
    let (status, items, _) = raw(&mut conn, Op::BatchPut, &body);
    assert_eq!(status, Status::Ok);
    assert_eq!((items[0].0.status, items[0].0.flags), (Status::Unavailable, ITEM_RDMA_FAILED), "{items:?}");
    assert!(items[0].1.contains("rdma"), "{items:?}");
    assert_eq!(items[1].0.status, Status::BadRequest, "{items:?}");
    assert!(items[1].1.contains("add up"), "{items:?}");
    assert_eq!(items[2].0.status, Status::Ok);
    assert_eq!(read(&c, "seg-0", 64 << 10), Err(Status::Miss), "nothing stored");
    assert_eq!(read(&c, "seg-2", 64).as_deref(), Ok(&b"inline"[..]));
    assert!(remote.len() > HEADER_LEN);

    // A get item naming segments: answered inline (the whole record).
    let mut segs = Vec::new();
    wire::encode_segments(&[seg], &mut segs);
    let get = wire::encode_batch_get(
        &geo(),
        &[
            BatchItem { flags: ITEM_RDMA, key: b"seg-2", segs: &segs, spread: 0 },
            BatchItem { flags: 0, key: b"nope", segs: &[], spread: 0 },
        ],
    );
    let id = conn.send(Op::BatchGet, wire::FLAG_CHECK_GEOMETRY, &[&get]).unwrap();
    let r = conn.recv().unwrap();
    assert_eq!((r.header.req_id, r.header.status), (id, Status::Ok));
    let answer = wire::decode_batch_answer(&r.body, 2).unwrap();
    assert_eq!((answer[0].0.status, answer[0].0.flags), (Status::Ok, 0));
    assert_eq!(answer[0].1, &plain[..], "the record inline");
    assert_eq!(answer[1].0.status, Status::Miss);
    // A get item with an empty segment list: the whole frame refused.
    let mut empty = Vec::new();
    wire::encode_segments(&[Segment { len: 0, ..seg }], &mut empty);
    let bad = wire::encode_batch_get(&geo(), &[BatchItem { flags: ITEM_RDMA, key: b"seg-2", segs: &empty, spread: 0 }]);
    conn.send(Op::BatchGet, wire::FLAG_CHECK_GEOMETRY, &[&bad]).unwrap();
    let r = conn.recv().unwrap();
    assert_eq!(r.header.status, Status::BadRequest);
    assert!(String::from_utf8_lossy(&r.body).contains("malformed batch_get"), "{:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(conn.ping(b"still").unwrap(), b"still", "the connection stays usable");
    node.terminate(Duration::from_secs(20));
}
