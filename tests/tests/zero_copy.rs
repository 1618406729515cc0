//! A 4 MiB get into a caller buffer allocates almost nothing: the payload
//! goes from the socket straight into the caller's memory (README.md, "C ABI conventions").
//! Its own test binary, so the counting allocator sees only this test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::page::Geometry;
use kv_e2e::Node;
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Options};

struct Counting;

static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(l.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn a_4mib_get_allocates_under_64kib() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("d");
    let node = Node::start(&["--dir", d.to_str().unwrap(), "--cap", "256M", "--mem-cap", "64M", "--log-level", "warn"]);
    let geo = Geometry { model_hash: 1, page_size: 64, tp_size: 1, ..Default::default() };
    let c = BlockingClient::new(parse_members(&format!("n1={}", node.addr)).unwrap(), geo, Options::default()).unwrap();
    // Every byte differs from its neighbours' positions and every key's page
    // differs: a swapped half or another key's page cannot pass.
    let page = |k: u32| -> Vec<u8> {
        (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(k * 97) >> 13) as u8).collect()
    };
    let mut buf = vec![0u8; 4 << 20];
    let mut halves: Vec<&mut [u8]> = Vec::new();
    for i in 0..4 {
        assert_eq!(c.putv(format!("p{i}").as_bytes(), &[&page(i)]), kv_common::status::Status::Ok);
    }
    // Warm the connection pool and the runtime.
    assert_eq!(c.getv(b"p0", &mut [&mut buf[..]]).unwrap(), 4 << 20);
    assert!(buf == page(0));
    let (k, v) = buf.split_at_mut(2 << 20);
    halves.push(k);
    halves.push(v);
    assert_eq!(c.getv(b"p1", &mut halves).unwrap(), 4 << 20);
    let mut worst = 0;
    for i in 0..4u32 {
        let before = ALLOCATED.load(Ordering::Relaxed);
        let n = c.getv(format!("p{i}").as_bytes(), &mut halves).unwrap();
        let used = ALLOCATED.load(Ordering::Relaxed) - before;
        assert_eq!(n, 4 << 20);
        worst = worst.max(used);
        let want = page(i);
        assert!(halves[0][..] == want[..2 << 20] && halves[1][..] == want[2 << 20..], "p{i}: K then V, in order");
    }
    assert!(worst < 64 * 1024, "a 4 MiB get allocated {worst} bytes");
    eprintln!("a 4 MiB get (two segments) allocated at most {worst} bytes");
}
