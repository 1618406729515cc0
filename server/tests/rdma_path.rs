//! The RDMA data path end to end, in one process, over the stand-in fabric
//! (kv_rdma::engine::fake): a real node (its connection code, store
//! and RDMA engine) and a real client (its bootstrap, registration cache and
//! verification), with only the NIC replaced by in-process copies that
//! check keys and bounds as a NIC does. What this cannot show (the verbs,
//! a real NIC's timing) is listed in docs/ARCHITECTURE.md, "Transports".

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_rdma::engine::fake::{FakeBackend, FakeNet};
use kv_rdma::engine::Runtime;
use kv_rdma::{Counters, RailSpec, Settings};
use kv_server::rdma::Rdma;
use kv_server::server::{self, NodeSettings, Shared};
use kv_server::store::{DiskSpec, Store, StoreConfig};
use kvclient::client::{Client, GetItem};
use kvclient::members::Member;
use kvclient::{BlockingClient, Options};

fn geo() -> Geometry {
    Geometry { model_hash: 0x5D, page_size: 32, dtype_tag: 2, tp_size: 1, ..Geometry::default() }
}

/// A client's engine on the fabric (its memory reachable by the node).
fn engine(net: &FakeNet, device: &str) -> Arc<Runtime> {
    engine_as(net, device, true)
}

/// A node's engine (its memory reachable by nobody).
fn node_engine(net: &FakeNet, device: &str) -> Arc<Runtime> {
    engine_as(net, device, false)
}

fn engine_as(net: &FakeNet, device: &str, remote_access: bool) -> Arc<Runtime> {
    let spec =
        RailSpec { device: device.into(), port: 1, gid_index: 0, numa_node: None, link_layer: "InfiniBand".into() };
    Runtime::with_backend(
        Arc::new(FakeBackend { net: net.clone(), devices: vec![device.into()], remote_access }),
        vec![spec],
        Settings { devices: vec![device.into()], depth: 8, numa_local: false },
        Arc::new(Counters::default()),
        1 << 30,
        Duration::from_secs(2),
    )
    .unwrap()
}

struct Node {
    addr: SocketAddr,
    fabric: Arc<Rdma>,
    shared: Arc<Shared>,
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    _tmp: tempfile::TempDir,
}

impl Node {
    /// A node with a memory tier, over `rdma` (None: a node without RDMA).
    fn start(rdma: Option<Arc<Runtime>>) -> Node {
        Node::start_with(rdma, 16 << 20)
    }

    /// `mem_cap` 0: no memory tier, so record buffers come from the heap.
    fn start_with(rdma: Option<Arc<Runtime>>, mem_cap: u64) -> Node {
        let tmp = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("d{i}"))).collect();
        let cfg = StoreConfig {
            disks: dirs.iter().map(|d| DiskSpec { dir: d.clone(), cap: 64 << 20 }).collect(),
            mem_cap,
            sync_writes: false,
            pool_bytes: 16 << 20,
            ack_memory_max: None,
            flushers: 0,
            warmers: 0,
        };
        let (store, _) = Store::open(&cfg).unwrap();
        let fabric = Arc::new(match rdma {
            Some(rt) => Rdma::over(rt, &store),
            None => Rdma::unconfigured(),
        });
        let settings = NodeSettings { fabric: fabric.clone(), ..NodeSettings::new(8 << 20, 64 << 20) };
        let shared = Arc::new(Shared::new(store, settings));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = tokio::sync::watch::channel(false);
        let s2 = shared.clone();
        let thread = Some(std::thread::spawn(move || rt.block_on(server::run(listener, s2, 64, Vec::new(), rx))));
        Node { addr, fabric, shared, stop, thread, _tmp: tmp }
    }

    fn counters(&self) -> &Counters {
        self.fabric.counters()
    }

    /// Requests of `op` ("get", "batch_get", ...) the node answered.
    fn answered(&self, op: &str) -> u64 {
        self.shared.ops.latencies().iter().filter(|l| l.op == op).map(|l| l.count).sum()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn client(node: &Node, rt: Arc<Runtime>) -> BlockingClient {
    let m = vec![Member { id: "n0".into(), addr: node.addr.to_string(), weight: 1 }];
    BlockingClient::over(Client::with_rdma(m, geo(), Options::default(), rt)).unwrap()
}

/// A fabric, a node on it with RDMA, a client engine on the same device,
/// and a client over that engine.
fn rig() -> (FakeNet, Node, Arc<Runtime>, BlockingClient) {
    let net = FakeNet::default();
    let node = Node::start(Some(node_engine(&net, "mlx5_0")));
    let crt = engine(&net, "mlx5_0");
    let c = client(&node, crt.clone());
    (net, node, crt, c)
}

fn page(tag: u32, n: usize) -> Vec<u8> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761) ^ tag) as u8).collect()
}

fn written(c: &Counters) -> u64 {
    c.rails().iter().map(|r| r.written_bytes.load(Ordering::Relaxed)).sum()
}

fn read(c: &Counters) -> u64 {
    c.rails().iter().map(|r| r.read_bytes.load(Ordering::Relaxed)).sum()
}

#[test]
fn pages_move_by_rdma_into_and_out_of_caller_memory() {
    let (_net, node, crt, c) = rig();

    // The engine's host pool, registered once (kv_register_memory).
    let mut pool = vec![0u8; 8 << 20];
    crt.pin(pool.as_ptr() as usize, pool.len()).unwrap();
    let regs_after_pin = crt.counters().registrations.load(Ordering::Relaxed);

    // A put of a 1 MiB page from the pool: the node reads it by RDMA READ.
    let p = page(1, 1 << 20);
    pool[..p.len()].copy_from_slice(&p);
    assert_eq!(c.putv(b"k1", &[&pool[..1 << 20]]), Status::Ok);
    assert_eq!(read(node.counters()), 1 << 20, "the payload came by RDMA READ");
    // A get scattered into the K and V halves, in the pool: RDMA WRITE.
    let (k, v) = pool[4 << 20..].split_at_mut(512 << 10);
    assert_eq!(c.getv(b"k1", &mut [&mut k[..], &mut v[..512 << 10]]), Ok(1 << 20));
    assert_eq!(&k[..], &p[..512 << 10]);
    assert_eq!(&v[..512 << 10], &p[512 << 10..]);
    assert_eq!(written(node.counters()), 1 << 20, "the payload went by RDMA WRITE");
    assert_eq!(crt.counters().registrations.load(Ordering::Relaxed), regs_after_pin, "no per-op registration");

    // Per-layer segments, more of them than the queue pair's depth (8 here):
    // the node writes them in chunks, without a stall.
    let mut layers: Vec<Vec<u8>> = (0..40).map(|_| vec![0u8; 32 << 10]).collect();
    let mut views: Vec<&mut [u8]> = layers.iter_mut().map(|l| &mut l[..]).collect();
    let t0 = std::time::Instant::now();
    assert_eq!(c.getv(b"k1", &mut views[..]), Ok(1 << 20));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(layers.concat()[..1 << 20], p[..]);
    let written_so_far = written(node.counters());
    assert_eq!(written_so_far, 2 << 20);

    // A buffer outside the pool is registered once and reused.
    let mut other = vec![0u8; 1 << 20];
    assert_eq!(c.getv(b"k1", &mut [&mut other[..]]), Ok(1 << 20));
    assert_eq!(c.getv(b"k1", &mut [&mut other[..]]), Ok(1 << 20));
    assert_eq!(other, p);
    assert_eq!(crt.counters().registrations.load(Ordering::Relaxed), regs_after_pin + 40 + 1);

    // Too small a buffer: the size needed, nothing written; a miss; a
    // small page goes inline (no RDMA below 16 KiB).
    let mut small = vec![0u8; 1000];
    assert_eq!(c.getv(b"k1", &mut [&mut small[..]]), Err((Status::TooSmall, 1 << 20)));
    let mut big = vec![0u8; 1 << 20];
    assert_eq!(c.getv(b"absent", &mut [&mut big[..]]), Err((Status::Miss, 0)));
    let before = (written(node.counters()), read(node.counters()));
    assert_eq!(c.putv(b"tiny", &[&page(3, 100)]), Status::Ok);
    assert_eq!(c.getv(b"tiny", &mut [&mut small[..]]), Ok(100));
    assert_eq!(&small[..100], &page(3, 100)[..]);
    assert_eq!((written(node.counters()), read(node.counters())), before);

    // A batch: several gets in flight on one connection, each placed by RDMA.
    let keys: Vec<String> = (0..6).map(|i| format!("b{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(c.putv(k.as_bytes(), &[&page(10 + i as u32, 256 << 10)]), Status::Ok);
    }
    let mut outs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 256 << 10]).collect();
    let mut items: Vec<GetItem> =
        keys.iter().zip(outs.iter_mut()).map(|(k, o)| (k.as_bytes(), vec![&mut o[..]])).collect();
    let st = c.batch_getv(&mut items);
    drop(items);
    assert!(st.iter().all(|s| *s == (Status::Ok, 256 << 10)), "{st:?}");
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o, &page(10 + i as u32, 256 << 10), "item {i}");
    }
    assert_eq!(node.counters().errors.load(Ordering::Relaxed), 0);
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 0);
    assert!(crt.unpin(pool.as_ptr() as usize));
}

#[test]
fn a_broken_queue_pair_falls_back_to_tcp_without_losing_a_page() {
    let (net, node, _crt, c) = rig();
    let p = page(7, 300 << 10);
    assert_eq!(c.putv(b"a", &[&p]), Status::Ok);
    // Every work request fails from now on (a cable pulled, a remote access
    // error): gets are answered inline, puts are sent again inline.
    net.fail_all(12);
    let mut out = vec![0u8; 300 << 10];
    assert_eq!(c.getv(b"a", &mut [&mut out[..]]), Ok(300 << 10));
    assert_eq!(out, p);
    let q = page(8, 300 << 10);
    assert_eq!(c.putv(b"b", &[&q]), Status::Ok);
    assert_eq!(c.getv(b"b", &mut [&mut out[..]]), Ok(300 << 10));
    assert_eq!(out, q);
    assert!(node.counters().qp_broken.load(Ordering::Relaxed) >= 1);
    assert!(node.counters().errors.load(Ordering::Relaxed) >= 1);

    // Completions that never come: the node gives up after its timeout,
    // answers over TCP, and nothing hangs.
    let c2 = client(&node, engine(&net, "mlx5_0"));
    assert_eq!(c2.putv(b"c", &[&page(9, 64 << 10)]), Status::Ok);
    net.swallow_all();
    let t0 = std::time::Instant::now();
    let mut out = vec![0u8; 64 << 10];
    assert_eq!(c2.getv(b"c", &mut [&mut out[..]]), Ok(64 << 10));
    assert_eq!(out, page(9, 64 << 10));
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    assert!(node.counters().timeouts.load(Ordering::Relaxed) >= 1);
}

#[test]
fn a_node_without_rdma_says_why_and_the_client_stays_on_tcp() {
    let net = FakeNet::default();
    let node = Node::start(None);
    let crt = engine(&net, "mlx5_0");
    let c = client(&node, crt.clone());
    let p = page(5, 200 << 10);
    assert_eq!(c.putv(b"x", &[&p]), Status::Ok);
    let mut out = vec![0u8; 200 << 10];
    assert_eq!(c.getv(b"x", &mut [&mut out[..]]), Ok(200 << 10));
    assert_eq!(out, p);
    // Asked once (the first connection); the node is then not asked again.
    assert_eq!(crt.counters().peer_fallbacks.load(Ordering::Relaxed), 1);
    assert_eq!(node.counters().peer_fallbacks.load(Ordering::Relaxed), 1);
    assert_eq!(read(crt.counters()) + written(crt.counters()), 0);
    let text = c.stats_text();
    assert!(text.contains("kvclient_rdma_peer_fallbacks_total 1"), "{text}");
}

#[test]
fn a_stale_registration_is_caught_by_the_crc_and_retried_inline() {
    // A caller frees a buffer and new memory is mapped at the same address:
    // the cached registration still reaches the old pages. The CRC check
    // turns that into a retry over TCP, never a wrong page, and the
    // registration is made again.
    let (net, node, crt, c) = rig();
    let old = page(20, 256 << 10);
    let mut buf = old.clone();
    assert_eq!(c.putv(b"old", &[&buf]), Status::Ok);
    let regs = crt.counters().registrations.load(Ordering::Relaxed);
    // The put: the memory under `buf` is replaced, then filled anew.
    net.replace_memory_under(buf.as_ptr() as usize);
    let new = page(21, 256 << 10);
    buf.copy_from_slice(&new);
    assert_eq!(c.putv(b"new", &[&buf]), Status::Ok, "sent again inline");
    let mut out = vec![0u8; 256 << 10];
    assert_eq!(c.getv(b"new", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, new, "the new content, not the old pages'");
    // The get: the same, on the way in.
    net.replace_memory_under(out.as_ptr() as usize);
    out.fill(0);
    assert_eq!(c.getv(b"old", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, old);
    // And in a batch (BATCH_GET naming the buffers).
    net.replace_memory_under(out.as_ptr() as usize);
    out.fill(0);
    let mut other = vec![0u8; 256 << 10];
    let mut items = vec![(&b"old"[..], vec![&mut out[..]]), (&b"new"[..], vec![&mut other[..]])];
    assert_eq!(c.batch_getv(&mut items), vec![(Status::Ok, 256 << 10), (Status::Ok, 256 << 10)]);
    drop(items);
    assert_eq!((out == old, other == new), (true, true));
    assert!(crt.counters().registrations.load(Ordering::Relaxed) > regs, "registered again");
    // Afterwards RDMA carries the pages again.
    let before = written(node.counters());
    assert_eq!(c.getv(b"new", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, new);
    assert_eq!(written(node.counters()), before + (256 << 10));
}

/// Batch frames name the caller's buffers item by item (BATCH_PUT and
/// BATCH_GET with ITEM_RDMA): the node reads and writes the payloads by
/// RDMA and answers every item in one frame. Items that cannot be named
/// (a small payload, more pieces than an item may name) go inline in the
/// same frames; a miss and a buffer too small for its page cost only
/// themselves.
#[test]
fn batch_frames_name_caller_buffers_and_pages_move_by_rdma() {
    let (_net, node, crt, c) = rig();
    const N: usize = 8;
    const LEN: usize = 256 << 10;
    let mut pool = vec![0u8; 2 * N * LEN];
    crt.pin(pool.as_ptr() as usize, pool.len()).unwrap();
    let keys: Vec<String> = (0..N).map(|i| format!("r{i}")).collect();
    for i in 0..N {
        pool[i * LEN..(i + 1) * LEN].copy_from_slice(&page(40 + i as u32, LEN));
    }
    // 70 pieces of 4 KiB: more than an item names, so inline.
    let pieces: Vec<Vec<u8>> = (0..70).map(|i| page(90 + i, 4096)).collect();
    let tiny = page(99, 100);
    let (src, dst) = pool.split_at_mut(N * LEN);
    let mut puts: Vec<(&[u8], Vec<&[u8]>)> =
        keys.iter().enumerate().map(|(i, k)| (k.as_bytes(), vec![&src[i * LEN..(i + 1) * LEN]])).collect();
    puts.push((b"pieces", pieces.iter().map(|p| &p[..]).collect()));
    puts.push((b"tiny", vec![&tiny[..]]));
    assert!(c.batch_putv(&puts).iter().all(|s| *s == Status::Ok));
    assert_eq!(read(node.counters()), (N * LEN) as u64, "the named payloads came by RDMA READ");
    assert_eq!((node.answered("batch_put") >= 1, node.answered("put")), (true, 0), "no single puts");

    let mut pieces_out: Vec<Vec<u8>> = (0..70).map(|_| vec![0u8; 4096]).collect();
    let mut tiny_out = vec![0u8; 100];
    let mut small = vec![0u8; 64 << 10];
    let mut absent = vec![0u8; LEN];
    let mut items: Vec<GetItem> = keys.iter().zip(dst.chunks_mut(LEN)).map(|(k, o)| (k.as_bytes(), vec![o])).collect();
    items.push((b"pieces", pieces_out.iter_mut().map(|p| &mut p[..]).collect()));
    items.push((b"tiny", vec![&mut tiny_out[..]]));
    items.push((b"r0", vec![&mut small[..]]));
    items.push((b"absent", vec![&mut absent[..]]));
    let st = c.batch_getv(&mut items);
    drop(items);
    assert!(st[..N + 2].iter().all(|s| s.0 == Status::Ok), "{st:?}");
    assert_eq!(st[N + 2], (Status::TooSmall, LEN), "the size it needs");
    assert_eq!(st[N + 3].0, Status::Miss);
    for i in 0..N {
        assert_eq!(&dst[i * LEN..(i + 1) * LEN], &page(40 + i as u32, LEN)[..], "item {i}");
    }
    assert_eq!(pieces_out, pieces);
    assert_eq!(tiny_out, tiny);
    assert_eq!(written(node.counters()), (N * LEN) as u64, "the named payloads went by RDMA WRITE");
    assert_eq!((node.answered("batch_get") >= 1, node.answered("get")), (true, 0), "no single gets");
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 0);
    assert!(crt.unpin(pool.as_ptr() as usize));
}

/// A queue pair that breaks under batch frames: the items the node could
/// not read are sent again inline, those it could not write are answered
/// inline, and no page is lost or wrong.
#[test]
fn a_broken_queue_pair_under_batch_frames_loses_no_page() {
    let (net, node, _crt, c) = rig();
    let pages: Vec<Vec<u8>> = (0..6).map(|i| page(60 + i, 128 << 10)).collect();
    let keys: Vec<String> = (0..12).map(|i| format!("q{i}")).collect();
    let puts: Vec<(&[u8], Vec<&[u8]>)> =
        keys[..6].iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert!(c.batch_putv(&puts).iter().all(|s| *s == Status::Ok));
    net.fail_all(12);
    // Puts after the break: read by nobody, sent again inline.
    let puts: Vec<(&[u8], Vec<&[u8]>)> =
        keys[6..].iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert!(c.batch_putv(&puts).iter().all(|s| *s == Status::Ok));
    let mut outs: Vec<Vec<u8>> = (0..12).map(|_| vec![0u8; 128 << 10]).collect();
    let mut items: Vec<GetItem> =
        keys.iter().zip(outs.iter_mut()).map(|(k, o)| (k.as_bytes(), vec![&mut o[..]])).collect();
    let st = c.batch_getv(&mut items);
    drop(items);
    assert!(st.iter().all(|s| *s == (Status::Ok, 128 << 10)), "{st:?}");
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o, &pages[i % 6], "item {i}");
    }
    assert!(node.counters().qp_broken.load(Ordering::Relaxed) >= 1);
}

#[test]
fn a_failed_registration_turns_rdma_off_with_one_fallback() {
    // Pinned memory runs out (RLIMIT_MEMLOCK) at the client: it serves over
    // TCP from then on, says so once and counts one fallback.
    let (net, node, crt, c) = rig();
    let p = page(30, 256 << 10);
    assert_eq!(c.putv(b"a", &[&p]), Status::Ok);
    assert_eq!(read(node.counters()), 256 << 10, "RDMA while registrations work");
    net.refuse_registrations(true);
    let fresh = page(31, 256 << 10); // memory never registered
    assert_eq!(c.putv(b"b", &[&fresh]), Status::Ok);
    let mut out = vec![0u8; 256 << 10];
    assert_eq!(c.getv(b"b", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, fresh);
    assert!(crt.is_off());
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 1);
    assert!(crt.counters().fallback_reason().unwrap().contains("registration failed"));
    assert_eq!(c.getv(b"a", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, p);
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 1, "counted once");
    assert!(c.stats_text().contains("kvclient_rdma_fallbacks_total 1\n"));
    assert_eq!(read(node.counters()), 256 << 10, "nothing more by RDMA");

    // At the node (no memory tier: its record buffers are registered as
    // used): the put it cannot register for is sent again inline, the node
    // turns RDMA off, answers inline, and tells a later client why.
    let net = FakeNet::default();
    let node = Node::start_with(Some(node_engine(&net, "mlx5_0")), 0);
    let c = client(&node, engine(&net, "mlx5_0"));
    net.refuse_registrations(false);
    assert_eq!(c.putv(b"x", &[&p]), Status::Ok);
    let mut out = vec![0u8; 256 << 10];
    assert_eq!(c.getv(b"x", &mut [&mut out[..]]), Ok(256 << 10));
    assert_eq!(out, p);
    assert_eq!(node.counters().fallbacks.load(Ordering::Relaxed), 1);
    assert_eq!(read(node.counters()) + written(node.counters()), 0);
    let c2 = client(&node, engine(&net, "mlx5_0"));
    assert_eq!(c2.getv(b"x", &mut [&mut out[..]]), Ok(256 << 10));
    assert!(node.counters().peer_fallbacks.load(Ordering::Relaxed) >= 1);
    assert!(c2.stats_text().contains("kvclient_rdma_peer_fallbacks_total 1\n"), "{}", c2.stats_text());
}

/// A put from read-only memory (`mmap(PROT_READ)`) goes by RDMA: its
/// buffer is registered for the node's reads only, which needs no write
/// permission (before, every registration asked for write access, the
/// kernel refused it for a read-only mapping, and that one put turned RDMA
/// off for the whole client). A get into writable memory still goes by RDMA.
#[test]
fn a_put_from_read_only_memory_goes_by_rdma_and_rdma_stays_on() {
    let (_net, node, crt, c) = rig();
    let len = 256 << 10;
    let p = page(40, len);
    // SAFETY: a fresh anonymous mapping of `len` bytes, filled, then made
    // read-only; unmapped at the end of the test after its last use.
    let ro = unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(m, libc::MAP_FAILED);
        std::ptr::copy_nonoverlapping(p.as_ptr(), m as *mut u8, len);
        assert_eq!(libc::mprotect(m, len, libc::PROT_READ), 0);
        m
    };
    // SAFETY: the mapping above, `len` bytes, readable until munmap below.
    let view: &[u8] = unsafe { std::slice::from_raw_parts(ro as *const u8, len) };
    assert_eq!(c.putv(b"ro", &[view]), Status::Ok);
    assert_eq!(read(node.counters()), len as u64, "the node read the page by RDMA");
    assert!(!crt.is_off(), "RDMA stays on");
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 0);
    let mut out = vec![0u8; len];
    assert_eq!(c.getv(b"ro", &mut [&mut out[..]]), Ok(len));
    assert_eq!(out, p);
    assert_eq!(written(node.counters()), len as u64, "the get went by RDMA too");
    drop(c);
    // SAFETY: unmapping the mapping made above; `view` is not used after.
    unsafe { libc::munmap(ro, len) };
}

/// A scripted node's connection: accepted, the client's hello read and
/// answered as accepted in `version`.
fn greeted(listener: &std::net::TcpListener, version: u16) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; kv_common::wire::HELLO_LEN];
    s.read_exact(&mut hello).unwrap();
    let reply = kv_common::wire::Hello { version, status: kv_common::wire::HELLO_ACCEPTED, max_record: 8 << 20 };
    s.write_all(&reply.encode()).unwrap();
    s
}

/// Reads a request frame (header and body) off a raw connection.
fn read_frame(s: &mut std::net::TcpStream) -> (kv_common::wire::ReqHeader, Vec<u8>) {
    use std::io::Read;
    let mut hb = [0u8; kv_common::wire::FRAME_HEADER_LEN];
    s.read_exact(&mut hb).unwrap();
    let h = kv_common::wire::ReqHeader::decode(&hb, &kv_common::wire::Limits { max_record: 64 << 20 }).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    (h, body)
}

/// Writes an OK answer with `body` to request `h`.
fn answer(s: &mut std::net::TcpStream, h: &kv_common::wire::ReqHeader, body: &[u8]) {
    use std::io::Write;
    let rh = kv_common::wire::RspHeader {
        status: Status::Ok,
        op: h.op as u8,
        flags: 0,
        body_len: body.len() as u32,
        req_id: h.req_id,
    };
    s.write_all(&rh.encode()).unwrap();
    s.write_all(body).unwrap();
}

/// A client of an older release says RDMA_CONNECT in bootstrap version 1
/// (no read limits): the node answers in version 1, byte for byte what
/// that client decodes, and its queue pair issues no more READs than the
/// smaller of its own card's limits. The previous release's version 2 is
/// answered in version 2.
#[test]
fn a_client_of_the_previous_release_is_answered_in_bootstrap_version_1() {
    use kv_rdma::bootstrap::Answer;
    use std::io::{Read, Write};
    let net = FakeNet::default();
    net.set_read_limits("mlx5_0", 8, 16);
    let node = Node::start(Some(node_engine(&net, "mlx5_0")));
    let crt = engine(&net, "mlx5_9");
    let mut s = std::net::TcpStream::connect(node.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&kv_common::wire::client_hello(2, None)).unwrap();
    let mut hello = [0u8; kv_common::wire::HELLO_LEN];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(kv_common::wire::Hello::decode(&hello).unwrap().status, kv_common::wire::HELLO_ACCEPTED);
    let link = crt.link(0, 8).unwrap();
    let mut old = link.local().clone();
    old.reads = None;
    let body = old.encode_request();
    assert_eq!(&body[0..2], &[1, 0], "what the previous release sends");
    let h = kv_common::wire::ReqHeader {
        op: kv_common::wire::Op::RdmaConnect,
        flags: 0,
        copy_age: 0,
        body_len: body.len() as u32,
        req_id: 1,
    };
    s.write_all(&h.encode()).unwrap();
    s.write_all(&body).unwrap();
    let mut rb = [0u8; kv_common::wire::FRAME_HEADER_LEN];
    s.read_exact(&mut rb).unwrap();
    let rh = kv_common::wire::RspHeader::decode(&rb);
    assert_eq!(rh.status, Status::Ok);
    let mut ab = vec![0u8; rh.body_len as usize];
    s.read_exact(&mut ab).unwrap();
    assert_eq!(&ab[0..4], &[1, 0, 0, 0], "accepted, in version 1");
    assert_eq!(ab.len(), 4 + 31 + ab[4 + 30] as usize, "no bytes past the device name");
    let Answer::Accepted(theirs) = Answer::decode(&ab).unwrap() else { panic!("accepted") };
    assert_eq!(theirs.reads, None);
    assert_eq!(net.read_depth(theirs.qpn), Some(8), "the smaller of the node card's limits");

    // The previous release's version 2 (read limits, no batch segments):
    // answered in version 2, so that client never sees version 3.
    let link2 = crt.link(0, 8).unwrap();
    let mut v2 = link2.local().clone();
    v2.batches = false;
    let body = v2.encode_request();
    assert_eq!(&body[0..2], &[2, 0]);
    let h = kv_common::wire::ReqHeader { body_len: body.len() as u32, req_id: 2, ..h };
    s.write_all(&h.encode()).unwrap();
    s.write_all(&body).unwrap();
    s.read_exact(&mut rb).unwrap();
    let rh = kv_common::wire::RspHeader::decode(&rb);
    let mut ab = vec![0u8; rh.body_len as usize];
    s.read_exact(&mut ab).unwrap();
    assert_eq!(&ab[0..4], &[2, 0, 0, 0], "accepted, in version 2");
    let Answer::Accepted(theirs) = Answer::decode(&ab).unwrap() else { panic!("accepted") };
    assert!(theirs.reads.is_some() && !theirs.batches);
}

/// Against a node of an older release (bootstrap version 1 only) the
/// client is refused its version 3 request, says it again in version 1,
/// and then moves pages by RDMA; its queue pair issues no more READs than
/// the smaller of its own card's limits.
#[test]
fn a_node_of_the_previous_release_is_asked_again_in_bootstrap_version_1() {
    use kv_rdma::bootstrap::{Answer, Endpoint};
    let net = FakeNet::default();
    net.set_read_limits("mlx5_9", 4, 16);
    let old_node = node_engine(&net, "mlx5_0");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // The previous release's node, as far as the bootstrap goes.
    let script = std::thread::spawn(move || {
        let mut s = greeted(&listener, 2);
        let mut versions = Vec::new();
        let mut link = None;
        let mut qpn = 0;
        loop {
            let (h, body) = read_frame(&mut s);
            if h.op != kv_common::wire::Op::RdmaConnect {
                // The put: by RDMA once the queue pair is up.
                answer(&mut s, &h, b"");
                return (versions, h.flags & kv_common::wire::FLAG_RDMA != 0, qpn, link.is_some());
            }
            versions.push(u16::from_le_bytes([body[0], body[1]]));
            match Endpoint::decode_request(&body) {
                Ok(remote) if remote.reads.is_none() => {
                    let l = old_node.link(0, 8).unwrap();
                    l.connect(&remote).unwrap();
                    let mut local = l.local().clone();
                    local.reads = None;
                    qpn = remote.qpn;
                    answer(&mut s, &h, &Answer::Accepted(local).encode());
                    link = Some(l);
                }
                // A version it does not speak.
                _ => answer(&mut s, &h, &Answer::VersionRefused(1).encode()),
            }
        }
    });
    let crt = engine(&net, "mlx5_9");
    let m = vec![Member { id: "n0".into(), addr: addr.to_string(), weight: 1 }];
    let c = BlockingClient::over(Client::with_rdma(m, geo(), Options::default(), crt.clone())).unwrap();
    assert_eq!(c.putv(b"k", &[&page(1, 256 << 10)]), Status::Ok);
    let (versions, by_rdma, qpn, linked) = script.join().unwrap();
    assert_eq!(versions, vec![3, 1], "asked in version 3, then again in 1");
    assert!(linked && by_rdma, "the put named segments: RDMA is up");
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 0);
    assert_eq!(net.read_depth(qpn), Some(4), "the smaller of the client card's limits");
}

/// Against a node of the previous release (bootstrap version 2: no segments
/// in batch items) the client is refused its version 3 request, says it
/// again in version 2, and then sends a batch put as single PUTs naming
/// their segments, never a batch item the node would misread.
#[test]
fn a_node_of_the_previous_release_is_asked_again_in_bootstrap_version_2() {
    use kv_rdma::bootstrap::{Answer, Endpoint};
    let net = FakeNet::default();
    let old_node = node_engine(&net, "mlx5_0");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let script = std::thread::spawn(move || {
        let mut s = greeted(&listener, kv_common::wire::WIRE_VERSION);
        let (mut versions, mut data, mut link) = (Vec::new(), Vec::new(), None);
        while data.len() < 2 {
            let (h, body) = read_frame(&mut s);
            if h.op != kv_common::wire::Op::RdmaConnect {
                data.push((h.op, h.flags));
                answer(&mut s, &h, b"");
                continue;
            }
            versions.push(u16::from_le_bytes([body[0], body[1]]));
            match Endpoint::decode_request(&body) {
                Ok(remote) if remote.version() == 2 => {
                    let l = old_node.link(0, 8).unwrap();
                    l.connect(&remote).unwrap();
                    let mut local = l.local().clone();
                    local.batches = false;
                    answer(&mut s, &h, &Answer::Accepted(local).encode());
                    link = Some(l);
                }
                _ => answer(&mut s, &h, &Answer::VersionRefused(2).encode()),
            }
        }
        (versions, data, link.is_some())
    });
    let crt = engine(&net, "mlx5_9");
    let m = vec![Member { id: "n0".into(), addr: addr.to_string(), weight: 1 }];
    let c = BlockingClient::over(Client::with_rdma(m, geo(), Options::default(), crt.clone())).unwrap();
    let (a, b) = (page(1, 256 << 10), page(2, 256 << 10));
    assert_eq!(c.batch_putv(&[(b"a", vec![&a[..]]), (b"b", vec![&b[..]])]), vec![Status::Ok, Status::Ok]);
    let (versions, data, linked) = script.join().unwrap();
    assert_eq!(versions, vec![3, 2], "asked in version 3, then again in 2");
    assert!(linked);
    let put_by_rdma = (kv_common::wire::Op::Put, kv_common::wire::FLAG_RDMA);
    assert_eq!(data, vec![put_by_rdma, put_by_rdma], "single PUTs naming segments");
    assert_eq!(crt.counters().fallbacks.load(Ordering::Relaxed), 0);
}

/// Named batch items read from disk (no memory tier): each record is read
/// under the node's memory budget and written into the caller's buffers by
/// RDMA; none goes as a single GET.
#[test]
fn named_batch_items_read_from_disk_move_by_rdma() {
    let net = FakeNet::default();
    let node = Node::start_with(Some(node_engine(&net, "mlx5_0")), 0);
    let crt = engine(&net, "mlx5_0");
    let c = client(&node, crt.clone());
    let pages: Vec<Vec<u8>> = (0..6).map(|i| page(80 + i, 192 << 10)).collect();
    let keys: Vec<String> = (0..6).map(|i| format!("d{i}")).collect();
    let puts: Vec<(&[u8], Vec<&[u8]>)> = keys.iter().zip(&pages).map(|(k, p)| (k.as_bytes(), vec![&p[..]])).collect();
    assert!(c.batch_putv(&puts).iter().all(|s| *s == Status::Ok));
    let mut outs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 192 << 10]).collect();
    let mut items: Vec<GetItem> =
        keys.iter().zip(outs.iter_mut()).map(|(k, o)| (k.as_bytes(), vec![&mut o[..]])).collect();
    let st = c.batch_getv(&mut items);
    drop(items);
    assert!(st.iter().all(|s| *s == (Status::Ok, 192 << 10)), "{st:?}");
    assert_eq!(outs, pages);
    assert_eq!(written(node.counters()), 6 * (192 << 10), "placed by RDMA WRITE");
    assert_eq!((node.answered("batch_get") >= 1, node.answered("get")), (true, 0));
    // The node's task gives the budget back once its answer is out, which
    // may be just after the client has read it: polled, with a deadline.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while node.shared.inflight_bytes.available_permits() != node.shared.inflight_units as usize
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        node.shared.inflight_bytes.available_permits(),
        node.shared.inflight_units as usize,
        "budget given back"
    );
}
