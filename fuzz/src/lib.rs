//! Fuzz targets: every parser that reads bytes a peer, a file or a user
//! chose. Each target takes arbitrary bytes, must return (never panic, never
//! allocate what the input merely claims) and checks the invariants its
//! parser promises. `src/main.rs` drives them with a bounded mutation loop
//! over the committed corpus (`corpus/<target>/`); `cargo test -p kv-fuzz`
//! replays the corpus and every past finding (`regressions/<target>/`).
//!
//! Why not cargo-fuzz: it needs a nightly toolchain and libFuzzer's
//! coverage instrumentation, neither of which the CI machines have (stable
//! Rust only, no toolchain downloads). The targets are plain functions, so
//! a `cargo fuzz` harness can call them unchanged where nightly exists.

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::wire::{self, ClientHello, Hello, KeyRequest, Limits, Op, ReqHeader, RspHeader};

/// A target: its name (the corpus directory) and its function.
pub type Target = (&'static str, fn(&[u8]));

pub const TARGETS: &[Target] = &[
    ("frame", frame),
    ("page", page),
    ("mds_request", mds_request),
    ("config", config),
    ("client_reply", client_reply),
    ("rdma", rdma),
];

/// The node's frame decoder: hello, request header, and the body decoder of
/// the op it names. A header that decodes never claims more than the limits.
pub fn frame(data: &[u8]) {
    let limits = Limits { max_record: 1 << 20 };
    if data.len() >= wire::HELLO_LEN {
        let h: &[u8; wire::HELLO_LEN] = data[..wire::HELLO_LEN].try_into().expect("16 bytes");
        if let Ok(hello) = Hello::decode(h) {
            if let ClientHello::Speak { token_len, .. } = ClientHello::judge(&hello) {
                assert!(token_len <= kv_common::auth::MAX_TOKEN_LEN);
            }
            let _ = wire::judge_hello(2, &hello);
        }
    }
    let Some(h) = data.get(..wire::FRAME_HEADER_LEN) else {
        return;
    };
    let h: &[u8; wire::FRAME_HEADER_LEN] = h.try_into().expect("16 bytes");
    let Ok(req) = ReqHeader::decode(h, &limits) else {
        return;
    };
    let max = match req.op {
        Op::Put => limits.max_record,
        Op::BatchExist => wire::MAX_BATCH_BODY as u64,
        Op::BatchGet => wire::MAX_BATCH_GET_BODY as u64,
        Op::BatchPut => wire::MAX_BATCH_PUT_BODY as u64,
        Op::BatchDelete => wire::MAX_BATCH_DELETE_BODY as u64,
        _ => wire::MAX_SMALL_BODY as u64,
    };
    assert!(u64::from(req.body_len) <= max, "{req:?} passes a body over its limit");
    let body = &data[wire::FRAME_HEADER_LEN..];
    match req.op {
        Op::Get | Op::Exist => {
            if let Ok(r) = KeyRequest::decode(body) {
                assert!(!r.key.is_empty() && r.key.len() <= kv_common::page::MAX_KEY_LEN);
            }
        }
        Op::BatchExist => {
            if let Ok((_, keys)) = wire::decode_batch_exist(body) {
                assert!(keys.len() <= wire::MAX_BATCH_KEYS);
            }
        }
        Op::BatchGet => {
            // What decodes is within the limits and encodes back to the
            // same bytes but for the reserved ones.
            if let Ok((geo, items)) = wire::decode_batch_get(body) {
                assert!(!items.is_empty() && items.len() <= wire::MAX_BATCH_ITEMS);
                assert!(items.iter().all(|i| !i.key.is_empty() && i.key.len() <= kv_common::page::MAX_KEY_LEN));
                for i in &items {
                    // An item naming segments names 1..=MAX_ITEM_SEGMENTS.
                    let n = i.segments().len();
                    assert_eq!(i.flags & wire::ITEM_RDMA != 0, (1..=wire::MAX_ITEM_SEGMENTS).contains(&n));
                }
                let again = wire::encode_batch_get(&geo, &items);
                assert_eq!(again.len(), body.len(), "a batch re-encodes to its length");
                assert_eq!(wire::decode_batch_get(&again).expect("re-encoded batch").1, items);
            }
        }
        Op::BatchPut => {
            // The items' heads and records are what the node reads; each
            // record is then checked as a PUT's body is.
            if let Ok(items) = wire::decode_batch_put(body) {
                assert!(!items.is_empty() && items.len() <= wire::MAX_BATCH_ITEMS);
                assert_eq!(wire::encode_batch_put(&items).len(), body.len(), "a batch put re-encodes to its length");
                for (head, record) in items {
                    if head.flags & wire::ITEM_RDMA == 0 {
                        page(record);
                        continue;
                    }
                    // A header, key and segment list, as the node reads it.
                    if let Ok(h) = kv_common::page::PageHeader::decode(record) {
                        let rest = &record[kv_common::page::HEADER_LEN..];
                        if let Ok(segs) = wire::remote_put_segments(&h, rest, wire::MAX_ITEM_SEGMENTS) {
                            assert!(!segs.is_empty() && segs.len() <= wire::MAX_ITEM_SEGMENTS);
                        }
                    }
                }
            }
        }
        Op::BatchDelete => {
            if let Ok(items) = wire::decode_batch_delete(body) {
                assert!(!items.is_empty() && items.len() <= wire::MAX_BATCH_ITEMS);
                let again = wire::encode_batch_delete(&items);
                assert_eq!(again.len(), body.len(), "a batch delete re-encodes to its length");
            }
        }
        Op::Put => page(body),
        _ => {
            let _ = wire::decode_key(body);
        }
    }
}

/// The RDMA bootstrap and segment lists (docs/PROTOCOL.md §2.8): the node
/// decodes a client's endpoint and segments, the client the node's answer.
/// What decodes re-encodes to the same bytes and stays within its limits.
pub fn rdma(data: &[u8]) {
    use kv_rdma::bootstrap::{Answer, Endpoint};
    if let Ok(e) = Endpoint::decode_request(data) {
        assert_eq!(e.encode_request(), data, "an endpoint re-encodes byte for byte");
        assert!(e.qpn < 1 << 24 && e.psn < 1 << 24 && (1..=5).contains(&e.mtu));
    }
    if let Ok(a) = Answer::decode(data) {
        assert_eq!(Answer::decode(&a.encode()).as_ref(), Ok(&a), "an answer round-trips");
    }
    use kv_common::wire::{split_segments, MAX_SEGMENTS, SEGMENT_LEN};
    if let Ok((segs, rest)) = split_segments(data) {
        assert!(!segs.is_empty() && segs.len() <= MAX_SEGMENTS);
        assert_eq!(rest.len() + 2 + segs.len() * SEGMENT_LEN, data.len());
        assert!(segs.iter().all(|s| s.len > 0 && s.addr.checked_add(u64::from(s.len)).is_some()));
    }
}

/// The page record (docs/PROTOCOL.md §3): header, key and payload. What parses holds
/// together: the key fits the record, the lengths agree.
pub fn page(data: &[u8]) {
    if let Ok((h, key)) = kv_common::page::parse_record(data) {
        assert_eq!(h.record_len() as usize, data.len(), "record length");
        assert!(HEADER_LEN + key.len() <= data.len());
        let payload = &data[HEADER_LEN + key.len()..];
        // The check a reader makes; any outcome, never a panic.
        let _ = crc32fast::hash(payload) == h.payload_crc;
        let _ = Geometry::default().matches(&h);
    }
    if data.len() >= HEADER_LEN {
        let _ = PageHeader::decode(&data[..HEADER_LEN]);
    }
}

/// kv-mds request parsing: the first byte picks a method, the first line is
/// `path?query`, the rest a register and heartbeat body.
pub fn mds_request(data: &[u8]) {
    let method = ["GET", "POST", "DELETE", "PUT"][usize::from(data.first().copied().unwrap_or(0) % 4)];
    let rest = data.get(1..).unwrap_or(&[]);
    let (line, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let line = String::from_utf8_lossy(line);
    let (path, query) = line.split_once('?').unwrap_or((&line, ""));
    if let Ok(call) = kv_mds::http::parse_call(method, path, query) {
        use kv_mds::http::Call;
        match call {
            Call::View { group, wait_ms, .. } => {
                assert!(kv_common::mds::valid_name(group));
                assert!(wait_ms <= kv_common::mds::MAX_WAIT_MS);
            }
            Call::SetPlacement { group } | Call::Quotas { group } => assert!(kv_common::mds::valid_name(group)),
            Call::SetQuota { group, tenant, .. } => {
                assert!(kv_common::mds::valid_name(group) && kv_common::mds::valid_name(tenant));
            }
            Call::Register { group, id } | Call::Heartbeat { group, id } | Call::Deregister { group, id, .. } => {
                assert!(kv_common::mds::valid_name(group) && kv_common::mds::valid_name(id));
            }
            Call::Health | Call::Live | Call::Metrics | Call::Dashboard | Call::Groups => {}
        }
    }
    if let Ok(r) = kv_mds::http::parse_register(body) {
        assert!((1..=kv_common::ring::MAX_WEIGHT).contains(&r.weight));
    }
    let _ = kv_mds::http::parse_heartbeat(body);
    // A quota, and a table of them, parse or give one line; a parsed one
    // prints back to itself.
    let text = String::from_utf8_lossy(body);
    if let Ok(q) = kv_common::quota::Quotas::parse_list(&text) {
        assert_eq!(kv_common::quota::Quotas::parse_list(&q.to_list()).as_ref().map(|p| p.0.len()), Ok(q.0.len()));
    }
}

/// Configuration text: kv-server's TOML (then every check of its values),
/// the client's options and member list, sizes, MDS endpoints, tokens.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(mut file) = kv_server::config::parse_file(&text) {
        // Never open a file the input names (it could be /dev/stdin).
        file.auth_token_file = None;
        if let Ok(c) = kv_server::config::ServerConfig::resolve_with(Default::default(), file) {
            assert!(c.max_record >= 4096 && c.max_inflight >= c.max_record && c.max_conns >= 1);
            assert!(c.store.disks.iter().all(|d| d.cap >= 1 << 20));
        }
    }
    // Options without the one key that reads a file.
    let opts: String =
        text.split(',').filter(|kv| !kv.trim_start().starts_with("auth_token_file")).collect::<Vec<_>>().join(",");
    if let Ok(o) = kvclient::Options::parse(&opts) {
        assert!(o.max_conns_per_node >= 1 && o.batch_concurrency >= 1);
    }
    if let Ok(members) = kvclient::members::parse_members(&text) {
        // A weight the ring can hold: bounded, so placement cannot abort.
        assert!(members.iter().all(|m| (1..=kv_common::ring::MAX_WEIGHT).contains(&m.weight)));
    }
    let _ = kv_common::size::parse_size(&text);
    let _ = kv_common::mds::parse_endpoints(&text);
    if let Ok(t) = kv_common::auth::Token::new(data) {
        assert!(t.matches(data));
    }
}

/// What a client reads from a node or an MDS: response headers, batch
/// statuses, the STATS body, the node's hello, an MDS HTTP answer and view.
pub fn client_reply(data: &[u8]) {
    if let Some(h) = data.get(..wire::FRAME_HEADER_LEN) {
        let _ = RspHeader::decode(h.try_into().expect("16 bytes"));
    }
    if let Ok(st) = wire::decode_batch_status(data) {
        assert!(st.len() <= data.len());
    }
    // A BATCH_GET answer's heads: the body's, then each item's.
    if let Some(h) = data.get(..wire::BATCH_ITEM_HEAD) {
        let h: &[u8; wire::BATCH_ITEM_HEAD] = h.try_into().expect("8 bytes");
        let _ = wire::decode_batch_answer_head(h);
        let item = wire::ItemHead::decode(h);
        assert_eq!(wire::ItemHead::decode(&item.encode()), item);
    }
    // A BATCH_PUT or BATCH_DELETE answer: what decodes re-encodes.
    if let Some(&n) = data.first() {
        if let Ok(items) = wire::decode_batch_answer(data, usize::from(n)) {
            assert_eq!(wire::encode_batch_answer(&items).len(), data.len());
        }
    }
    let _ = serde_json::from_slice::<kv_common::stats::NodeStats>(data);
    if let Some(h) = data.get(..wire::HELLO_LEN) {
        if let Ok(hello) = Hello::decode(h.try_into().expect("16 bytes")) {
            let _ = wire::judge_hello(1, &hello);
            let _ = wire::judge_hello(2, &hello);
            let _ = wire::judge_hello(3, &hello);
        }
    }
    // MDS answers (HTTP itself is hyper's): their JSON bodies.
    let _ = serde_json::from_slice::<kv_common::mds::View>(data);
    let _ = serde_json::from_slice::<kv_common::mds::LeaseReply>(data);
    let _ = serde_json::from_slice::<kv_common::mds::ErrorReply>(data);
}

#[cfg(test)]
mod tests {
    /// Every committed input of every target (corpus and past findings)
    /// still runs clean.
    #[test]
    fn corpus_and_regressions_replay_clean() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for (name, f) in super::TARGETS {
            for sub in ["corpus", "regressions"] {
                let dir = root.join(sub).join(name);
                let Ok(rd) = std::fs::read_dir(&dir) else { continue };
                for e in rd.flatten() {
                    let data = std::fs::read(e.path()).unwrap();
                    f(&data);
                    n += 1;
                }
            }
        }
        assert!(n >= 5, "the corpus is committed ({n} inputs found)");
    }
}
