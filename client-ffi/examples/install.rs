//! What installing a member change costs the client library at fleet size
//! (docs/BENCHMARKS.md, "Membership at scale"): CLIENTS clients each hold a
//! view of MEMBERS members, then each installs the view after one join, as
//! discovery does when an epoch changes. Prints the CPU time per client,
//! for both placement rules.
//!
//!     cargo run --release -p kvclient --example install [MEMBERS] [CLIENTS] [ROUNDS]
//!
//! With ROUNDS > 1 the member joins and leaves again in turn, and the median
//! round is printed (a profiler then sees installs, not the first builds).

use std::time::Instant;

use kv_common::ring::Placement;
use kvclient::members::Member;
use kvclient::{Client, Options};

fn main() {
    let n: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let clients: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(200);
    let rounds: usize = std::env::args().nth(3).and_then(|a| a.parse().ok()).unwrap_or(1).max(1);
    let member =
        |i: u32| Member { id: format!("gpu-{i:04}"), addr: format!("10.0.{}.{}:7700", i / 256, i % 256), weight: 1 };
    let before: Vec<Member> = (0..n).map(member).collect();
    let mut after = before.clone();
    after.push(member(n));
    for rule in Placement::ALL {
        // Handoff on, as in a deployment: the replaced set is kept.
        let opts = Options { placement: rule, ..Options::default() };
        let all: Vec<Client> = (0..clients)
            .map(|_| {
                let c = Client::new(Vec::new(), Default::default(), opts.clone());
                c.install(before.clone(), rule, Some(1), Vec::new(), None);
                c
            })
            .collect();
        let mut per: Vec<f64> = (0..rounds)
            .map(|r| {
                let view = if r % 2 == 0 { &after } else { &before };
                let t = Instant::now();
                for c in &all {
                    c.install(view.clone(), rule, Some(2 + r as u64), Vec::new(), None);
                }
                t.elapsed().as_secs_f64() / clients as f64
            })
            .collect();
        per.sort_by(f64::total_cmp);
        let per = per[per.len() / 2];
        println!(
            "{n} members, {rule:<10}: one join or leave installed by each of {clients} clients: {:.2} ms per client ({:.0} ms in all; median of {rounds} rounds)",
            per * 1e3,
            per * clients as f64 * 1e3
        );
    }
}
