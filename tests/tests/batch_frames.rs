//! Batch frames (docs/PROTOCOL.md §2.5, BATCH_GET) against real kv-server
//! processes: a batch answers every item as single frames do, a malformed
//! batch is refused without costing the connection, and an answer stops at
//! its byte bound while the client splits its batches by bytes.

use std::time::Duration;

use kv_common::page::{parse_record, Geometry, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, BatchItem, ItemHead, Op, FLAG_CHECK_GEOMETRY};
use kv_e2e::Node;
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Conn, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 11, page_size: 16, dtype_tag: 1, tp_size: 1, layer_num: 2, ..Default::default() }
}

fn client(members: &str, opts: &str, geo: Geometry) -> BlockingClient {
    BlockingClient::new(parse_members(members).unwrap(), geo, Options::parse(opts).unwrap()).unwrap()
}

fn page(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((i * 31 + j * 7) % 251) as u8).collect()
}

/// Each item of a BATCH_GET answer: its head and bytes.
type Items = Vec<(ItemHead, Vec<u8>)>;

/// A BATCH_GET sent raw: the answer's status, on OK each item, else the
/// message.
fn raw_batch(conn: &mut Conn, flags: u8, body: &[u8]) -> (Status, Items, Vec<u8>) {
    let id = conn.send(Op::BatchGet, flags, &[body]).unwrap();
    let r = conn.recv().unwrap();
    assert_eq!((r.header.req_id, r.header.op), (id, Op::BatchGet as u8));
    if r.header.status != Status::Ok {
        return (r.header.status, Vec::new(), r.body);
    }
    let b = &r.body;
    let n = wire::decode_batch_answer_head(b[..8].try_into().unwrap());
    let mut at = 8;
    let mut items = Vec::new();
    for _ in 0..n {
        let h = ItemHead::decode(b[at..at + 8].try_into().unwrap());
        at += 8;
        items.push((h, b[at..at + h.len as usize].to_vec()));
        at += h.len as usize;
    }
    assert_eq!(at, b.len(), "the answer ends after its last item");
    (Status::Ok, items, Vec::new())
}

#[test]
fn a_batch_answers_every_item_as_single_frames_do_from_memory_and_from_disk() {
    let t = tempfile::tempdir().unwrap();
    for (name, extra) in [("disk", &[][..]), ("memory", &["--mem-cap", "64M"][..])] {
        let dir = t.path().join(name);
        let mut args = vec!["--dir", dir.to_str().unwrap(), "--cap", "256M", "--no-sync"];
        args.extend_from_slice(extra);
        let node = Node::start(&args);
        let members = format!("n1={}", node.addr);
        let c = client(&members, "batch_concurrency=1", geo());
        let keys: Vec<String> = (0..12).map(|i| format!("bf-{name}-{i}")).collect();
        let pages: Vec<Vec<u8>> = (0..12).map(|i| page(i, 3000 + i * 4111)).collect();
        for (k, p) in keys.iter().zip(&pages) {
            assert_eq!(c.putv(k.as_bytes(), &[p]), Status::Ok);
        }
        let other = client(&members, "", Geometry { model_hash: 12, ..geo() });
        assert_eq!(other.putv(b"bf-foreign", &[b"another model's page"]), Status::Ok);
        let mut asked: Vec<String> = keys.clone();
        asked.push("bf-never".into());
        asked.push("bf-foreign".into());
        let mut caps: Vec<usize> = asked.iter().map(|_| 60_000).collect();
        caps[5] = 100; // too small for its page
        let batch = {
            let mut bufs: Vec<Vec<u8>> = caps.iter().map(|&n| vec![0u8; n]).collect();
            let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
                asked.iter().zip(bufs.iter_mut()).map(|(k, b)| (k.as_bytes(), vec![&mut b[..]])).collect();
            let res = c.batch_getv(&mut items);
            drop(items);
            res.into_iter().zip(bufs).collect::<Vec<_>>()
        };
        for (i, k) in asked.iter().enumerate() {
            let mut buf = vec![0u8; caps[i]];
            let single = match c.getv(k.as_bytes(), &mut [&mut buf[..]]) {
                Ok(n) => (Status::Ok, n),
                Err(e) => e,
            };
            let ((status, len), got) = &batch[i];
            assert_eq!((*status, *len), single, "{name}: item {i} ({k}) batch against single");
            if *status == Status::Ok {
                assert!(got[..*len] == pages[i][..] && buf[..*len] == pages[i][..], "{name}: item {i} bytes");
            }
        }
        let st: Vec<Status> = batch.iter().map(|((s, _), _)| *s).collect();
        assert_eq!(st[5], Status::TooSmall, "{name}");
        assert_eq!(&st[12..], &[Status::Miss, Status::Mismatch], "{name}");
        assert!(st.iter().filter(|s| **s == Status::Ok).count() == 11, "{name}: {st:?}");

        // The same items raw, as the node answers them: the geometry is
        // checked per item, the records are the stored bytes.
        let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
        let list: Vec<BatchItem<'_>> =
            asked.iter().map(|k| BatchItem { flags: 0, key: k.as_bytes(), segs: &[], spread: 0 }).collect();
        let (status, items, _) = raw_batch(&mut conn, FLAG_CHECK_GEOMETRY, &wire::encode_batch_get(&geo(), &list));
        assert_eq!(status, Status::Ok);
        for (i, (h, bytes)) in items.iter().enumerate() {
            match i {
                12 => assert_eq!((h.status, h.len), (Status::Miss, 0)),
                13 => assert_eq!((h.status, h.len), (Status::Mismatch, 0)),
                _ => {
                    assert_eq!(h.status, Status::Ok, "{name}: raw item {i}");
                    let (ph, key) = parse_record(bytes).unwrap();
                    assert_eq!(key, keys[i].as_bytes());
                    assert!(
                        bytes[HEADER_LEN + key.len()..] == pages[i][..] && ph.payload_len as usize == pages[i].len()
                    );
                }
            }
        }
        // Without the geometry check the foreign page is served as stored.
        let (_, items, _) = raw_batch(&mut conn, 0, &wire::encode_batch_get(&geo(), &list[13..]));
        assert_eq!(items[0].0.status, Status::Ok);
        let stats = conn.stats().unwrap();
        assert!(stats.hits > 2 * 11, "{name}: every item counted as a get: {stats:?}");
        let frames = |op: &str| stats.latency.iter().find(|l| l.op == op).map_or(0, |l| l.count);
        // The client's batch went as one frame (one lane, 14 items), the
        // raw ones as two more; the single gets as 14 GETs.
        assert_eq!((frames("batch_get"), frames("get")), (3, 14), "{name}: {:?}", stats.latency);
        node.terminate(Duration::from_secs(20));
    }
}

#[test]
fn a_malformed_batch_is_refused_and_the_connection_stays_usable() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--no-sync"]);
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let good = wire::encode_batch_get(
        &geo(),
        &[
            BatchItem { flags: 0, key: b"a", segs: &[], spread: 0 },
            BatchItem { flags: 0, key: b"b", segs: &[], spread: 0 },
        ],
    );
    let mut lies = good.clone();
    lies[32..36].copy_from_slice(&5u32.to_le_bytes()); // five items announced, two sent
    let mut trailing = good.clone();
    trailing.push(0);
    let empty = wire::encode_batch_get(&geo(), &[]);
    for (what, body) in
        [("count", &lies), ("trailing bytes", &trailing), ("no items", &empty), ("short", &good[..20].to_vec())]
    {
        let (status, _, msg) = raw_batch(&mut conn, FLAG_CHECK_GEOMETRY, body);
        assert_eq!(status, Status::BadRequest, "{what}");
        assert!(String::from_utf8_lossy(&msg).contains("batch_get"), "{what}: {}", String::from_utf8_lossy(&msg));
        assert_eq!(conn.ping(b"still here").unwrap(), b"still here", "{what}: the connection stays usable");
    }
    let (status, items, _) = raw_batch(&mut conn, FLAG_CHECK_GEOMETRY, &good);
    assert_eq!(status, Status::Ok);
    assert!(items.iter().all(|(h, _)| h.status == Status::Miss));
    // A frame over the op's limit is not read: the node closes.
    let mut over = Conn::connect(&node.addr, Duration::from_secs(10)).unwrap();
    let huge = vec![0u8; wire::MAX_BATCH_GET_BODY as usize + 1];
    let _ = over.send(Op::BatchGet, 0, &[&huge]);
    assert!(over.recv().is_err(), "closed without an answer");
    assert_eq!(conn.ping(b"x").unwrap(), b"x", "other connections unaffected");
    node.terminate(Duration::from_secs(20));
}

#[test]
fn an_answer_stops_at_its_byte_bound_and_the_client_splits_by_bytes() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let node = Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "256M", "--no-sync", "--mem-cap", "128M"]);
    let members = format!("n1={}", node.addr);
    let c = client(&members, "batch_concurrency=1", geo());
    const MIB8: usize = 8 << 20;
    let keys: Vec<String> = (0..9).map(|i| format!("big-{i}")).collect();
    let pages: Vec<Vec<u8>> = (0..9).map(|i| page(i, MIB8)).collect();
    for (k, p) in keys.iter().zip(&pages) {
        assert_eq!(c.putv(k.as_bytes(), &[p]), Status::Ok);
    }
    // Raw: seven 8 MiB records fit under 64 MiB, the eighth would pass it.
    let mut conn = Conn::connect(&node.addr, Duration::from_secs(30)).unwrap();
    let list: Vec<BatchItem<'_>> =
        keys.iter().map(|k| BatchItem { flags: 0, key: k.as_bytes(), segs: &[], spread: 0 }).collect();
    let (status, items, _) = raw_batch(&mut conn, FLAG_CHECK_GEOMETRY, &wire::encode_batch_get(&geo(), &list));
    assert_eq!(status, Status::Ok);
    let st: Vec<Status> = items.iter().map(|(h, _)| h.status).collect();
    assert_eq!(st, [[Status::Ok; 7].as_slice(), &[Status::Rejected; 2]].concat());
    assert!(String::from_utf8_lossy(&items[8].1).contains("64 MiB"));
    let again: Vec<bool> = items.iter().map(|(h, _)| h.flags & wire::ITEM_AGAIN != 0).collect();
    assert_eq!(
        again,
        [[false; 7].as_slice(), &[true; 2]].concat(),
        "only the items past the bound are to be asked again"
    );
    // A record alone may pass the bound: the first item always goes.
    let (_, one, _) = raw_batch(&mut conn, FLAG_CHECK_GEOMETRY, &wire::encode_batch_get(&geo(), &list[..1]));
    assert_eq!(one[0].0.status, Status::Ok);
    // The client splits the nine into frames by their buffers' bytes: all served.
    let mut bufs: Vec<Vec<u8>> = (0..9).map(|_| vec![0u8; MIB8]).collect();
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (k.as_bytes(), vec![&mut b[..]])).collect();
    let res = c.batch_getv(&mut items);
    drop(items);
    for i in 0..9 {
        assert_eq!(res[i], (Status::Ok, MIB8), "item {i}");
        assert!(bufs[i] == pages[i], "item {i} bytes");
    }
    // Buffers smaller than their records: the frame (sized by the buffers)
    // meets the node's bound, and the items past it are asked again, so
    // every item gets what a single get answers (too small, and the size).
    let mut small: Vec<Vec<u8>> = (0..9).map(|_| vec![0u8; 1 << 20]).collect();
    let single: Vec<(Status, usize)> = keys
        .iter()
        .zip(small.iter_mut())
        .map(|(k, b)| c.getv(k.as_bytes(), &mut [&mut b[..]]).map_or_else(|e| e, |n| (Status::Ok, n)))
        .collect();
    assert_eq!(single[0].0, Status::TooSmall, "{single:?}");
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(small.iter_mut()).map(|(k, b)| (k.as_bytes(), vec![&mut b[..]])).collect();
    assert_eq!(c.batch_getv(&mut items), single, "each item as a single get");
    node.terminate(Duration::from_secs(30));
}

#[test]
fn a_denied_or_stopped_node_answers_a_batch_as_it_answers_single_gets() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("d");
    let tok = t.path().join("token");
    std::fs::write(&tok, "batch-token").unwrap();
    let node =
        Node::start(&["--dir", dir.to_str().unwrap(), "--cap", "64M", "--auth-token-file", tok.to_str().unwrap()]);
    let members = format!("n1={}", node.addr);
    let good = client(&members, &format!("auth_token_file={}", tok.display()), geo());
    assert_eq!(good.putv(b"bd-0", &[b"page zero"]), Status::Ok);
    assert_eq!(good.putv(b"bd-1", &[b"page one"]), Status::Ok);
    let keys = [&b"bd-0"[..], b"bd-1", b"bd-none"];
    let both = |c: &BlockingClient| -> (Vec<Status>, Vec<Status>) {
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 64]).collect();
        let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
            keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (*k, vec![&mut b[..]])).collect();
        let batch = c.batch_getv(&mut items).into_iter().map(|r| r.0).collect();
        let single = keys
            .iter()
            .map(|k| {
                let mut b = [0u8; 64];
                c.getv(k, &mut [&mut b[..]]).map_or_else(|e| e.0, |_| Status::Ok)
            })
            .collect();
        (batch, single)
    };
    let (batch, single) = both(&good);
    assert_eq!(batch, [Status::Ok, Status::Ok, Status::Miss]);
    assert_eq!(batch, single);
    // A key no frame can carry fails only its own item, batch or not.
    let long = vec![b'k'; 2000];
    let odd = [&b"bd-0"[..], b"", &long, b"bd-1"];
    let mut bufs: Vec<Vec<u8>> = odd.iter().map(|_| vec![0u8; 64]).collect();
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        odd.iter().zip(bufs.iter_mut()).map(|(k, b)| (*k, vec![&mut b[..]])).collect();
    let st: Vec<Status> = good.batch_getv(&mut items).into_iter().map(|r| r.0).collect();
    drop(items);
    let one = |k: &[u8]| good.getv(k, &mut [&mut [0u8; 64][..]]).map_or_else(|e| e.0, |_| Status::Ok);
    assert_eq!(st, odd.iter().map(|k| one(k)).collect::<Vec<_>>());
    assert_eq!((st[0], st[3]), (Status::Ok, Status::Ok), "{st:?}");
    assert!(st[1] != Status::Ok && st[2] != Status::Ok, "{st:?}");
    // The wrong token: every item denied, batch or not.
    let wrong = t.path().join("wrong");
    std::fs::write(&wrong, "not-the-token").unwrap();
    let denied = client(&members, &format!("auth_token_file={}", wrong.display()), geo());
    let (batch, single) = both(&denied);
    assert_eq!(batch, [Status::Edenied; 3]);
    assert_eq!(batch, single);
    // A stopped node: every item times out, batch or not, within the bound.
    let slow = client(&members, &format!("auth_token_file={},io_timeout_ms=300", tok.display()), geo());
    let (batch, _) = both(&slow); // pools connections while the node runs
    assert_eq!(batch, [Status::Ok, Status::Ok, Status::Miss]);
    node.signal(libc::SIGSTOP);
    let t0 = std::time::Instant::now();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 64]).collect();
    let mut items: Vec<(&[u8], Vec<&mut [u8]>)> =
        keys.iter().zip(bufs.iter_mut()).map(|(k, b)| (*k, vec![&mut b[..]])).collect();
    let batch: Vec<Status> = slow.batch_getv(&mut items).into_iter().map(|r| r.0).collect();
    drop(items);
    let took = t0.elapsed();
    node.signal(libc::SIGCONT);
    assert_eq!(batch, [Status::Timeout; 3], "after {took:?}");
    assert!(took < Duration::from_secs(3), "bounded by the I/O timeout: {took:?}");
    node.terminate(Duration::from_secs(20));
}
