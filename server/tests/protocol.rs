//! An in-process server on port 0 answering real TCP clients.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kv_common::page::{build_record, Geometry};
use kv_common::status::Status;
use kv_common::wire::{encode_copy_age, Hello, Op, ReqHeader, FLAG_HANDOFF, HELLO_LEN, WIRE_VERSION};
use kv_server::server::{self, NodeSettings, Shared};
use kv_server::store::{DiskSpec, Store, StoreConfig};
use kvclient::conn::GetResult;
use kvclient::Conn;

/// Two 64 MiB disks, writes not synced (tests only).
fn store_config(dirs: &[PathBuf]) -> StoreConfig {
    StoreConfig {
        disks: dirs.iter().map(|d| DiskSpec { dir: d.clone(), cap: 64 << 20 }).collect(),
        mem_cap: 0,
        sync_writes: false,
        pool_bytes: 16 << 20,
        ack_memory_max: None,
        flushers: 0,
        warmers: 0,
    }
}

struct TestServer {
    addr: SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    dirs: Vec<PathBuf>,
    tmp: Option<tempfile::TempDir>,
}

impl TestServer {
    fn start() -> TestServer {
        TestServer::start_with(16)
    }

    fn start_with(max_conns: usize) -> TestServer {
        TestServer::start_idle(max_conns, None)
    }

    /// `idle`: the node's idle timeout (None: the default, 120 s).
    fn start_idle(max_conns: usize, idle: Option<Duration>) -> TestServer {
        TestServer::start_tuned(max_conns, idle, None)
    }

    /// `frame`: the node's frame timeout (None: the default, 30 s).
    fn start_tuned(max_conns: usize, idle: Option<Duration>, frame: Option<Duration>) -> TestServer {
        TestServer::start_node(max_conns, |defaults| NodeSettings {
            idle_timeout: idle.or(defaults.idle_timeout),
            frame_timeout: frame.unwrap_or(defaults.frame_timeout),
            ..defaults
        })
        .0
    }

    /// A node with the settings `tune` makes of the defaults, and its
    /// shared state (for the test hooks).
    fn start_node(max_conns: usize, tune: impl FnOnce(NodeSettings) -> NodeSettings) -> (TestServer, Arc<Shared>) {
        let tmp = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("d{i}"))).collect();
        let (store, _) = Store::open(&store_config(&dirs)).unwrap();
        let settings = tune(NodeSettings::new(8 << 20, 64 << 20));
        let shared = Shared::new(store, settings);
        let shared = Arc::new(shared);
        let kept = shared.clone();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = tokio::sync::watch::channel(false);
        let thread = std::thread::spawn(move || rt.block_on(server::run(listener, shared, max_conns, Vec::new(), rx)));
        (TestServer { addr, stop, thread: Some(thread), dirs, tmp: Some(tmp) }, kept)
    }

    fn conn(&self) -> Conn {
        Conn::connect(&self.addr.to_string(), Duration::from_secs(10)).unwrap()
    }

    /// Stops the server; returns how `run` ended and the (kept) temp dir.
    fn shutdown(mut self) -> (std::io::Result<()>, tempfile::TempDir) {
        // The stop may have been sent already, and the server gone with its
        // receiver: a send to no receiver is no error here.
        let _ = self.stop.send(true);
        let r = self.thread.take().unwrap().join().unwrap();
        (r, self.tmp.take().unwrap())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn geo() -> Geometry {
    Geometry {
        model_hash: 9,
        page_size: 16,
        dtype_tag: 2,
        tp_size: 4,
        tp_rank: 1,
        layer_num: 8,
        head_num: 2,
        head_dim: 64,
        flags: 0,
    }
}

#[test]
fn every_op_round_trips() {
    let s = TestServer::start();
    let mut c = s.conn();
    let g = geo();
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
    assert!(c.put(&g, b"page-1", &payload).unwrap(), "newly stored");
    assert!(!c.put(&g, b"page-1", b"other").unwrap(), "write-once: duplicate flagged");
    assert_eq!(c.get(&g, b"page-1").unwrap(), GetResult::Hit(payload.clone()));
    assert_eq!(c.get(&g, b"nope").unwrap(), GetResult::NotServed(Status::Miss));
    let mut other = g;
    other.tp_rank = 2;
    assert_eq!(c.get(&other, b"page-1").unwrap(), GetResult::NotServed(Status::Mismatch));
    assert_eq!(c.exist(Some(&g), b"page-1").unwrap(), Status::Ok);
    assert_eq!(c.exist(Some(&other), b"page-1").unwrap(), Status::Mismatch);
    assert_eq!(c.exist(None, b"page-1").unwrap(), Status::Ok);
    let keys: Vec<String> = (0..128).map(|i| format!("b{i}")).collect();
    for k in keys.iter().step_by(2) {
        c.put(&g, k.as_bytes(), b"x").unwrap();
    }
    let st = c.batch_exist(&g, &keys).unwrap();
    for (i, s) in st.iter().enumerate() {
        assert_eq!(*s, if i % 2 == 0 { Status::Ok } else { Status::Miss }, "key {i}");
    }
    assert_eq!(c.delete(b"page-1").unwrap(), Status::Ok);
    assert_eq!(c.delete(b"page-1").unwrap(), Status::Miss);
    assert_eq!(c.ping(b"hello").unwrap(), b"hello");
    let stats = c.stats().unwrap();
    assert_eq!(stats.objects, 64);
    assert_eq!(stats.hits, 1);
    assert_eq!(stats.put_duplicates, 1);
    assert_eq!(stats.disks.len(), 2);
    assert!(stats.bytes_written >= payload.len() as u64);
    assert_eq!(stats.connections, 1);
}

#[test]
fn requests_pipeline_on_one_connection() {
    let s = TestServer::start();
    let mut c = s.conn();
    let g = geo();
    let recs: Vec<Vec<u8>> =
        (0..20).map(|i| build_record(g, format!("p{i}").as_bytes(), &vec![i as u8; 100_000])).collect();
    let ids: Vec<u64> = recs.iter().map(|r| c.send(Op::Put, 0, &[r]).unwrap()).collect();
    let mut got: Vec<u64> = (0..20)
        .map(|_| {
            let r = c.recv().unwrap();
            assert_eq!(r.header.status, Status::Ok);
            r.header.req_id
        })
        .collect();
    got.sort();
    assert_eq!(got, ids);
    // Gets in flight together all come back, matched by id.
    let ids: Vec<(u64, usize)> = (0..20)
        .map(|i| {
            let body = kv_common::wire::KeyRequest::encode(&g, format!("p{i}").as_bytes());
            (c.send(Op::Get, kv_common::wire::FLAG_CHECK_GEOMETRY, &[&body]).unwrap(), i)
        })
        .collect();
    for _ in 0..20 {
        let r = c.recv().unwrap();
        let i = ids.iter().find(|(id, _)| *id == r.header.req_id).unwrap().1;
        assert_eq!(r.body, recs[i]);
    }
}

fn raw_hello(addr: SocketAddr) -> TcpStream {
    let mut t = TcpStream::connect(addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    t.write_all(&Hello { version: WIRE_VERSION, status: 0, max_record: 0 }.encode()).unwrap();
    let mut h = [0u8; HELLO_LEN];
    t.read_exact(&mut h).unwrap();
    t
}

/// True when the server closed the connection (EOF or reset).
fn closed_by_server(t: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match t.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn garbage_closes_only_its_own_connection() {
    let s = TestServer::start();
    let mut good = s.conn();
    let g = geo();
    good.put(&g, b"steady", b"value").unwrap();

    // 1. Not a kvcellar peer at all.
    let mut t = TcpStream::connect(s.addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    t.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(closed_by_server(&mut t));
    // 2. Unknown op after a good hello.
    let mut t = raw_hello(s.addr);
    let mut h = ReqHeader { op: Op::Ping, flags: 0, copy_age: 0, body_len: 0, req_id: 1 }.encode();
    h[0] = 99;
    t.write_all(&h).unwrap();
    assert!(closed_by_server(&mut t));
    // 3. A put claiming 4 GiB: refused from the header, nothing allocated.
    let mut t = raw_hello(s.addr);
    let mut h = ReqHeader { op: Op::Put, flags: 0, copy_age: 0, body_len: 0, req_id: 1 }.encode();
    h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    t.write_all(&h).unwrap();
    assert!(closed_by_server(&mut t));
    // 4. A frame cut short, then the peer vanishes.
    let mut t = raw_hello(s.addr);
    t.write_all(&h[..7]).unwrap();
    drop(t);
    // 5. Unsupported version: refused with the server's version, then closed.
    let mut t = TcpStream::connect(s.addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    t.write_all(&Hello { version: 77, status: 0, max_record: 0 }.encode()).unwrap();
    let mut hb = [0u8; HELLO_LEN];
    t.read_exact(&mut hb).unwrap();
    let reply = Hello::decode(&hb).unwrap();
    assert_eq!((reply.version, reply.status), (WIRE_VERSION, 1));
    assert!(closed_by_server(&mut t));

    // Through all of it the good connection kept working.
    assert_eq!(good.get(&g, b"steady").unwrap(), GetResult::Hit(b"value".to_vec()));
    assert_eq!(good.stats().unwrap().objects, 1);
}

#[test]
fn an_invalid_record_is_refused_and_the_connection_carries_on() {
    let s = TestServer::start();
    let mut c = s.conn();
    let g = geo();
    let mut rec = build_record(g, b"k", b"payload");
    rec[12] ^= 0xFF; // header CRC no longer holds
    let err = c.put_parts(&[&rec]).unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
    let mut rec = build_record(g, b"k", b"payload");
    rec[64] = b'X'; // key differs from its hash
    let err = c.put_parts(&[&rec]).unwrap_err();
    assert!(matches!(err, kvclient::OpError::Node(Status::BadRequest, _)), "{err}");
    // A header claiming an absurd payload length (its CRC valid): refused,
    // nothing overflows, the connection carries on.
    let mut h = kv_common::page::PageHeader::new(g, b"k", 0, 0);
    h.payload_len = u64::MAX - 900;
    let mut rec = h.encode().to_vec();
    rec.extend_from_slice(&[b'k'; 36]);
    let err = c.put_parts(&[&rec]).unwrap_err();
    assert!(matches!(err, kvclient::OpError::Node(Status::BadRequest, _)), "{err}");
    let mut rec = build_record(g, b"k", b"payload");
    let last = rec.len() - 1;
    rec[last] ^= 1; // payload no longer matches its CRC: damaged on the way
    let err = c.put_parts(&[&rec]).unwrap_err();
    assert!(err.to_string().contains("payload checksum"), "{err}");
    assert!(matches!(err, kvclient::OpError::Node(Status::Corrupt, _)), "{err}");
    // A record over the node's max_record (8 MiB here) is refused up front.
    let err = c.put(&g, b"big", &vec![0u8; 9 << 20]).unwrap_err();
    assert!(matches!(err, kvclient::OpError::Node(Status::Rejected, _)), "{err}");
    assert!(c.put(&g, b"ok", b"fine").unwrap());
    assert_eq!(c.exist(None, b"k").unwrap(), Status::Miss);
    // Malformed small bodies: BAD_REQUEST, connection stays.
    let id = c.send(Op::Get, 0, &[b"short"]).unwrap();
    let r = c.recv().unwrap();
    assert_eq!((r.header.req_id, r.header.status), (id, Status::BadRequest));
    let id = c.send(Op::BatchExist, 0, &[&[0u8; 40]]).unwrap();
    let r = c.recv().unwrap();
    assert_eq!((r.header.req_id, r.header.status), (id, Status::BadRequest));
    assert_eq!(c.ping(b"still here").unwrap(), b"still here");
}

#[test]
fn shutdown_finishes_requests_in_flight_and_checkpoints() {
    let s = TestServer::start();
    let mut c = s.conn();
    let g = geo();
    let recs: Vec<Vec<u8>> = (0..8).map(|i| build_record(g, format!("s{i}").as_bytes(), &vec![7u8; 500_000])).collect();
    for r in &recs {
        c.send(Op::Put, 0, &[r]).unwrap();
    }
    // Wait until the first answer arrives so the requests are in flight.
    let first = c.recv().unwrap();
    assert_eq!(first.header.status, Status::Ok);
    let dirs = s.dirs.clone();
    let stop = s.stop.clone();
    stop.send(true).unwrap();
    for _ in 1..8 {
        let r = c.recv().unwrap();
        assert_eq!(r.header.status, Status::Ok, "every request sent before shutdown is answered");
    }
    assert!(closed_by_server(c.stream()));
    let (r, _keep) = s.shutdown();
    r.unwrap();
    for d in &dirs {
        assert!(d.join("clean").exists(), "clean marker written at shutdown");
    }
    // Everything answered before the stop is there after it.
    let (store, reports) = Store::open(&store_config(&dirs)).unwrap();
    assert!(reports.iter().all(|r| r.clean));
    for (i, want) in recs.iter().enumerate() {
        match store.get(format!("s{i}").as_bytes(), Some(&g)) {
            kv_server::store::GetOutcome::Hit(rec) => assert_eq!(rec.as_slice(), &want[..]),
            _ => panic!("s{i} missing after a clean stop"),
        }
    }
}

#[test]
fn idle_connections_are_closed_and_free_their_slots() {
    // Two silent peers (hello, then nothing) fill a cap of two; a third
    // client is served once the node closes them as idle.
    let s = TestServer::start_idle(2, Some(Duration::from_millis(300)));
    let mut silent = [raw_hello(s.addr), raw_hello(s.addr)];
    let t0 = std::time::Instant::now();
    // Refused ("busy") until the node closes the idle ones.
    let mut c = kv_e2e_wait_conn(s.addr);
    c.ping(b"after the idle ones").unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "served after {:?}", t0.elapsed());
    for t in &mut silent {
        assert!(closed_by_server(t), "an idle connection stayed open");
    }
    // A connection in use is not idle: requests spaced below the timeout.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(150));
        c.ping(b"busy").unwrap();
    }
}

#[test]
fn connections_beyond_the_cap_are_refused_clearly() {
    let s = TestServer::start_with(2);
    let mut a = s.conn();
    let _b = s.conn();
    // A third connection gets a hello saying "busy" at once, then EOF...
    let mut t = TcpStream::connect(s.addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    t.write_all(&Hello { version: WIRE_VERSION, status: 0, max_record: 0 }.encode()).unwrap();
    let mut hb = [0u8; HELLO_LEN];
    t.read_exact(&mut hb).unwrap();
    assert_eq!(Hello::decode(&hb).unwrap().status, kv_common::wire::HELLO_BUSY);
    assert!(closed_by_server(&mut t));
    // ...the client library says why...
    let e = Conn::connect(&s.addr.to_string(), Duration::from_secs(5)).err().unwrap();
    assert!(e.to_string().contains("connection cap"), "{e}");
    let st = a.stats().unwrap();
    assert_eq!((st.connections, st.refused_connections), (2, 2), "{st:?}");
    // ...and a new connection is served once one closes.
    drop(a);
    let mut c = kv_e2e_wait_conn(s.addr);
    c.ping(b"a slot again").unwrap();
}

/// Sockets that never say hello hold no connection slot: however many are
/// open, clients that do say hello get in, up to the cap, and the stats
/// count only them. (Before, each silent socket held a slot for the whole
/// frame timeout, so a few refreshed every 30 s locked every client out.)
#[test]
fn silent_sockets_cannot_lock_clients_out() {
    let s = TestServer::start_with(2);
    let silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(s.addr).unwrap()).collect();
    let mut a = s.conn();
    let _b = s.conn();
    let st = a.stats().unwrap();
    assert_eq!((st.connections, st.refused_connections), (2, 0), "{st:?}");
    // The cap still holds for clients that said hello.
    let e = Conn::connect(&s.addr.to_string(), Duration::from_secs(5)).err().unwrap();
    assert!(e.to_string().contains("connection cap"), "{e}");
    drop(silent);
}

/// Connects until the node has a free slot again (it frees one when a
/// closed connection's task ends, a moment after the close).
fn kv_e2e_wait_conn(addr: SocketAddr) -> Conn {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match Conn::connect(&addr.to_string(), Duration::from_secs(5)) {
            Ok(c) => return c,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("no slot freed: {e}"),
        }
    }
}

#[test]
fn slow_clients_hold_only_their_slot_and_their_timeout() {
    // Frame timeout 400 ms (30 s in production), so each stall ends fast.
    let s = TestServer::start_tuned(8, None, Some(Duration::from_millis(400)));
    let mut good = s.conn();
    let t0 = std::time::Instant::now();
    // 1. A hello never finished.
    let mut half = TcpStream::connect(s.addr).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    half.write_all(&Hello { version: WIRE_VERSION, status: 0, max_record: 0 }.encode()[..5]).unwrap();
    // 2. A 1 MiB batch-exist body dribbled a byte at a time: the node holds
    //    what arrived (not the MiB claimed) until 400 ms + 1 s per MiB.
    let mut dribble = raw_hello(s.addr);
    let req = ReqHeader { op: Op::BatchExist, flags: 0, copy_age: 0, body_len: 1 << 20, req_id: 1 };
    dribble.write_all(&req.encode()).unwrap();
    let dribble_t0 = std::time::Instant::now();
    // 3. A reader that never reads: 40 gets of a 4 MiB page, answers never taken.
    let page = vec![7u8; 4 << 20];
    good.put(&geo(), b"big", &page).unwrap();
    let mut deaf = raw_hello(s.addr);
    for i in 0..40u64 {
        let body = kv_common::wire::KeyRequest::encode(&geo(), b"big");
        let h = ReqHeader { op: Op::Get, flags: 0, copy_age: 0, body_len: body.len() as u32, req_id: 100 + i };
        deaf.write_all(&h.encode()).unwrap();
        deaf.write_all(&body).unwrap();
    }
    // Meanwhile everyone else is served at once: no worker is held.
    for i in 0..20 {
        // Bytes only well inside its allowance (1.4 s): on a loaded machine
        // the steps above may take a good part of it.
        if i < 10 && dribble_t0.elapsed() < Duration::from_millis(900) {
            dribble.write_all(&[0u8]).unwrap();
        }
        let t = std::time::Instant::now();
        good.ping(b"still here").unwrap();
        assert!(t.elapsed() < Duration::from_millis(500), "a ping took {:?}", t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed_by_server(&mut half), "the half hello was cut off");
    assert!(closed_by_server(&mut dribble), "the dribbler was cut off");
    // The deaf reader is cut off once a response waits past 400 ms + 4 s;
    // reading what the kernel buffered then ends in EOF.
    deaf.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert!(closed_by_server(&mut deaf), "the deaf reader was cut off");
    assert!(t0.elapsed() < Duration::from_secs(15), "took {:?}", t0.elapsed());
    // Their slots are free again: the cap of 8 serves 7 new connections.
    let more: Vec<Conn> = (0..7).map(|_| s.conn()).collect();
    for mut c in more {
        c.ping(b"a freed slot").unwrap();
    }
}

/// A ring-handoff copy (PUT with FLAG_HANDOFF) of `key`.
fn copy_record(key: &[u8], payload: &[u8]) -> Vec<u8> {
    build_record(geo(), key, payload)
}

/// The copy's second tombstone check (docs/ARCHITECTURE.md, "Ring
/// transitions") held by the node's test hook until a delete and a normal
/// put of the same key were answered: the check takes out only the copy's
/// own record, so the acknowledged put stays readable.
#[test]
fn a_copys_recheck_spares_a_put_acknowledged_after_the_delete() {
    let (s, shared) = TestServer::start_node(16, |d| d);
    let (stored_tx, stored_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let hook: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let _ = stored_tx.send(());
        let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(60));
    });
    assert!(shared.handoff.after_copy_stored.set(hook).is_ok());
    let g = geo();
    let (copied, acked) = (vec![7u8; 5_000], vec![9u8; 6_000]);
    let mut copier = s.conn();
    copier.send(Op::Put, FLAG_HANDOFF, &[&copy_record(b"moved", &copied)]).unwrap();
    stored_rx.recv_timeout(Duration::from_secs(30)).expect("the copy reached its re-check");
    let mut c = s.conn();
    assert_eq!(c.get(&g, b"moved").unwrap(), GetResult::Hit(copied), "the copy is stored");
    assert_eq!(c.delete(b"moved").unwrap(), Status::Ok, "the delete removes the copy");
    assert!(c.put(&g, b"moved", &acked).unwrap(), "a normal put after the delete is stored");
    go_tx.send(()).unwrap();
    let r = copier.recv().unwrap();
    assert_eq!(r.header.status, Status::Rejected, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(c.get(&g, b"moved").unwrap(), GetResult::Hit(acked), "the acknowledged put survives the re-check");
    let st = c.stats().unwrap();
    assert_eq!((st.handoff_refused, st.handoff_copies, st.handoff_too_old), (1, 0, 0), "{st:?}");
}

/// A copy carries its age (docs/PROTOCOL.md §2.9): one read longer ago
/// than half the node's handoff window is refused and counted apart from
/// the tombstone refusals; a younger one, and one of a previous-release
/// client (age 0), is stored.
#[test]
fn a_copy_older_than_half_the_window_is_refused_and_counted() {
    let (s, _shared) = TestServer::start_node(16, |d| NodeSettings { handoff_window: Duration::from_secs(600), ..d });
    let mut c = s.conn();
    let p = vec![3u8; 2_000];
    let mut copy = |key: &[u8], age: u16| {
        c.send_aged(Op::Put, FLAG_HANDOFF, age, &[&copy_record(key, &p)]).unwrap();
        c.recv().unwrap()
    };
    for (key, age) in [(&b"old"[..], Duration::from_secs(301)), (b"ancient", Duration::from_secs(10 * 3600))] {
        let r = copy(key, encode_copy_age(age));
        assert_eq!(r.header.status, Status::Rejected, "{age:?}");
        assert!(String::from_utf8_lossy(&r.body).contains("too old"), "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(copy(b"saturated", u16::MAX).header.status, Status::Rejected);
    assert_eq!(copy(b"young", encode_copy_age(Duration::from_secs(299))).header.status, Status::Ok);
    assert_eq!(copy(b"previous-release", 0).header.status, Status::Ok);
    // The age means nothing on a normal put.
    c.send_aged(Op::Put, 0, u16::MAX, &[&copy_record(b"plain", &p)]).unwrap();
    assert_eq!(c.recv().unwrap().header.status, Status::Ok);
    let g = geo();
    for key in [&b"old"[..], b"ancient", b"saturated"] {
        assert_eq!(c.get(&g, key).unwrap(), GetResult::NotServed(Status::Miss));
    }
    for key in [&b"young"[..], b"previous-release", b"plain"] {
        assert_eq!(c.get(&g, key).unwrap(), GetResult::Hit(p.clone()));
    }
    let st = c.stats().unwrap();
    assert_eq!((st.handoff_too_old, st.handoff_refused, st.handoff_copies), (3, 0, 2), "{st:?}");
}

/// A key deleted twice (found or not) refuses its copies, as one deleted
/// once; a key never deleted takes them.
#[test]
fn a_copy_of_a_key_deleted_twice_is_refused() {
    let (s, _shared) = TestServer::start_node(16, |d| d);
    let mut c = s.conn();
    let g = geo();
    assert!(c.put(&g, b"twice", b"page").unwrap());
    assert_eq!(c.delete(b"twice").unwrap(), Status::Ok);
    assert_eq!(c.delete(b"twice").unwrap(), Status::Miss);
    c.send(Op::Put, FLAG_HANDOFF, &[&copy_record(b"twice", b"stale")]).unwrap();
    let r = c.recv().unwrap();
    assert_eq!(r.header.status, Status::Rejected);
    assert_eq!(String::from_utf8_lossy(&r.body), "handoff copy of a key deleted within the handoff window");
    assert_eq!(c.get(&g, b"twice").unwrap(), GetResult::NotServed(Status::Miss));
    c.send(Op::Put, FLAG_HANDOFF, &[&copy_record(b"never-deleted", b"page")]).unwrap();
    assert_eq!(c.recv().unwrap().header.status, Status::Ok);
    let st = c.stats().unwrap();
    assert_eq!((st.handoff_refused, st.handoff_copies, st.tombstones), (1, 1, 1), "{st:?}");
}

/// Hot keys (docs/ARCHITECTURE.md, "Hot keys"): a key read past the
/// node's threshold in a window is marked in its GET and BATCH_GET answers
/// with a spread; a key read less is not; the mark goes once the reads stop.
/// A read a client spreads stands for as many reads as its spread, at the
/// owner: one weighted GET (bytes 2..4) or BATCH_GET item (`ITEM_HOT` and
/// its spread byte) is as many reads as its weight; an unweighted one is one.
#[test]
fn a_weighted_read_counts_as_the_spread_it_stands_for() {
    use kv_common::wire::{self, BatchItem, KeyRequest, ITEM_HOT};
    let heat = kv_server::heat::HeatConfig { window: Duration::from_millis(200), min_reads: 16 };
    let (s, _shared) = TestServer::start_node(16, |d| NodeSettings { heat, ..d });
    let g = geo();
    let mut c = s.conn();
    for k in [&b"weighted"[..], b"batched", b"plain"] {
        assert!(c.put(&g, k, &vec![5u8; 1_000]).unwrap());
    }
    // Nothing is marked before the node's first window has ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.stats().unwrap().hot_threshold == 0 {
        assert!(std::time::Instant::now() < deadline, "no window ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    let get = |c: &mut Conn, key: &[u8], weight: u16| {
        c.send_aged(Op::Get, 0, weight, &[&KeyRequest::encode(&g, key)]).unwrap();
        let r = c.recv().unwrap();
        assert_eq!(r.header.status, Status::Ok);
        wire::spread_of_flags(r.header.flags)
    };
    assert_eq!(get(&mut c, b"plain", 0), 0, "one read is not hot");
    assert!(get(&mut c, b"weighted", 16) >= 2, "one read standing for 16 reaches the threshold");
    let items = [BatchItem { flags: ITEM_HOT, key: b"batched", segs: &[], spread: 16 }];
    c.send(Op::BatchGet, 0, &[&wire::encode_batch_get(&g, &items)]).unwrap();
    let r = c.recv().unwrap();
    let answer = wire::decode_batch_answer(&r.body, 1).unwrap();
    assert_ne!(answer[0].0.flags & ITEM_HOT, 0, "{:?}", answer[0].0);
    let st = c.stats().unwrap();
    assert_eq!((st.hot_keys, st.hot_reads), (2, 2), "two reads served, two keys hot: {st:?}");
}

#[test]
fn a_key_read_past_the_threshold_is_marked_hot_until_its_reads_stop() {
    use kv_common::wire::{self, BatchItem, KeyRequest, ITEM_HOT};
    let heat = kv_server::heat::HeatConfig { window: Duration::from_secs(1), min_reads: 20 };
    let (s, shared) = TestServer::start_node(16, |d| NodeSettings { heat, ..d });
    let g = geo();
    let mut c = s.conn();
    for k in [&b"prompt"[..], b"other"] {
        assert!(c.put(&g, k, &vec![3u8; 4_000]).unwrap());
    }
    let get_flags = |c: &mut Conn, key: &[u8]| {
        c.send(Op::Get, 0, &[&KeyRequest::encode(&g, key)]).unwrap();
        let r = c.recv().unwrap();
        assert_eq!(r.header.status, Status::Ok);
        r.header.flags
    };
    // A few reads of "other": not hot. "prompt" read until marked: once
    // the node's first window (1 s) has ended, within the next one.
    for _ in 0..5 {
        assert_eq!(get_flags(&mut c, b"other"), 0);
    }
    let mut reads = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let f = loop {
        let f = get_flags(&mut c, b"prompt");
        reads += 1;
        if f != 0 || std::time::Instant::now() > deadline {
            break f;
        }
    };
    assert_ne!(f & wire::RSP_FLAG_HOT, 0, "flags {f:#x} after {reads} reads");
    assert!(reads >= 20, "marked after {reads} reads, fewer than the threshold");
    assert!(wire::spread_of_flags(f) >= 2, "flags {f:#x}");
    // A BATCH_GET marks the hot item and only it.
    let items = [
        BatchItem { flags: 0, key: b"prompt", segs: &[], spread: 0 },
        BatchItem { flags: 0, key: b"other", segs: &[], spread: 0 },
    ];
    c.send(Op::BatchGet, 0, &[&wire::encode_batch_get(&g, &items)]).unwrap();
    let r = c.recv().unwrap();
    assert_eq!(r.header.status, Status::Ok);
    let answer = wire::decode_batch_answer(&r.body, 2).unwrap();
    assert_eq!(answer[0].0.status, Status::Ok);
    assert_ne!(answer[0].0.flags & ITEM_HOT, 0, "{:?}", answer[0].0);
    assert!(answer[0].0.spread >= 2, "{:?}", answer[0].0);
    assert_eq!((answer[1].0.flags & ITEM_HOT, answer[1].0.spread), (0, 0), "{:?}", answer[1].0);
    let st = c.stats().unwrap();
    assert_eq!((st.hot_keys, st.hot_marked), (1, 1), "{st:?}");
    assert!(st.hot_reads >= 2, "{st:?}");
    // No more reads: the mark goes after its lingering windows.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while shared.heat.spread(b"prompt") > 0 {
        assert!(std::time::Instant::now() < deadline, "the hot mark never expired");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.stats().unwrap().hot_keys, 0);
    assert_eq!(get_flags(&mut c, b"prompt"), 0, "one read after the reads stopped is not hot");
}
