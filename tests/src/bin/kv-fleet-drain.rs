//! `kv-fleet-drain`: the drain of one node in a group of many, measured
//! (kv_e2e::fleet; docs/BENCHMARKS.md, "24 nodes"). Prints what the drained
//! node held, pushed, refused, failed and left, how many owners its pages
//! have and how many its log names, and how many of its pages are hits at
//! their new owners once it exited.
//!
//! ```text
//! kv-fleet-drain [--nodes 24] [--per-node 60] [--page-bytes 16384] [--drain-secs 8] [--server-bin PATH]
//! ```
//! `--server-bin`: another release's kv-server (every node runs it).

fn main() {
    let mut nodes = 24;
    let mut per_node = 60;
    let mut page = 16 << 10;
    let mut drain = 8;
    let mut server = "kv-server".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_default();
        let num = |v: &str| -> usize {
            v.parse().unwrap_or_else(|_| {
                eprintln!("{k} needs a number");
                std::process::exit(2)
            })
        };
        match k.as_str() {
            "--nodes" => nodes = num(&v).max(2),
            "--per-node" => per_node = num(&v).max(1),
            "--page-bytes" => page = num(&v).max(1),
            "--drain-secs" => drain = num(&v) as u32,
            "--server-bin" => server = v,
            _ => {
                eprintln!("usage: kv-fleet-drain [--nodes N] [--per-node N] [--page-bytes N] [--drain-secs N] [--server-bin PATH]");
                std::process::exit(2);
            }
        }
    }
    let f = kv_e2e::fleet::drain_at_scale(&server, nodes, per_node, page, drain);
    let held = f.held.len();
    let hits = held - f.lost.len();
    println!("nodes {} pages {} drained {} held {}", f.nodes, f.pages, f.drained, held);
    println!(
        "push: pushed {} refused {} failed {} left {} owners {} (of {} with its pages; its log names {})",
        f.stats.drain_pushed,
        f.stats.drain_push_failed,
        f.stats.drain_push_owner_failed,
        f.stats.drain_push_left,
        f.stats.drain_push_owners,
        f.owners.len(),
        f.named.len()
    );
    if let Some(l) = &f.closing {
        println!("closing line: {}", l.trim());
    }
    println!(
        "after its exit: {hits} of its {held} pages hits at their new owners ({:.1} %), other pages missed {}, wrong {}, evictions {}, clean exit {}",
        100.0 * hits as f64 / held.max(1) as f64,
        f.other_misses.len(),
        f.wrong,
        f.evictions,
        f.clean_exit
    );
}
