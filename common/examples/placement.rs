//! What a ring costs a client at fleet size, for both placement rules: build
//! time (a client rebuilds its ring on every epoch: whole, and from the
//! ring it held before a join), memory, lookup time per
//! key, and balance (docs/BENCHMARKS.md, "Membership at scale").
//!
//!     cargo run --release -p kv-common --example placement [MEMBERS]

use std::time::Instant;

use kv_common::ring::{Placement, Ring, RingMember};

fn main() {
    let n: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let keys: Vec<String> = (0..200_000).map(|i| format!("a3f9{i:060x}_k")).collect();
    for (what, members) in [
        ("equal weights", (0..n).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 }).collect::<Vec<_>>()),
        ("weights 1-4", (0..n).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 + i % 4 }).collect()),
    ] {
        let total: u32 = members.iter().map(|m| m.weight).sum();
        for p in Placement::ALL {
            let mut best = f64::MAX;
            let mut ring = Ring::default();
            for _ in 0..5 {
                let t = Instant::now();
                ring = Ring::with_placement(members.clone(), p);
                best = best.min(t.elapsed().as_secs_f64());
            }
            // What a client does on a join: rebuild from the ring it holds.
            let mut joined = members.clone();
            joined.push(RingMember { id: "gpu-new".into(), weight: 1 });
            let mut again = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                let r = ring.rebuilt(joined.clone(), p);
                again = again.min(t.elapsed().as_secs_f64());
                assert_eq!(r.members().len(), joined.len());
            }
            let t = Instant::now();
            let mut sink = 0usize;
            for k in &keys {
                sink = sink.wrapping_add(ring.owner(k.as_bytes()).unwrap_or(0));
            }
            let per_key = t.elapsed().as_secs_f64() / keys.len() as f64;
            let over = ring
                .shares()
                .iter()
                .zip(&members)
                .map(|(s, m)| s / (f64::from(m.weight) / f64::from(total)))
                .fold(0.0, f64::max);
            println!(
                "{n} members, {what}, {p:<10}: build {:>6.2} ms (after a join {:>5.2} ms), ring {:>7.1} KiB, lookup {:>6.0} ns/key, fullest {over:.3}x its fair share ({sink})",
                best * 1e3,
                again * 1e3,
                ring.heap_bytes() as f64 / 1024.0,
                per_key * 1e9,
            );
        }
    }
}
