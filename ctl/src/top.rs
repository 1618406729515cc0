//! `kvctl top`: a live view of a group, one row per node and a TOTAL,
//! refreshed every interval. It reads each node's STATS record over the
//! data plane (the same counters and service-time histograms `/metrics`
//! exports), so rates and percentiles are over the last interval.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use kv_common::mds::MemberRecord;
use kv_common::size::format_size;
use kv_common::stats::{NodeStats, OpLatency};

use crate::cluster;

/// Where the members come from: kv-mds (re-read each round, so joins and
/// leaves show) or a fixed list.
pub enum Source {
    Mds { endpoints: String, group: String },
    Members(Vec<MemberRecord>),
}

/// One node over one interval.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Row {
    pub id: String,
    pub addr: String,
    pub reachable: bool,
    pub requests_per_sec: f64,
    pub gets_per_sec: f64,
    pub read_bytes_per_sec: f64,
    pub written_bytes_per_sec: f64,
    /// Share of gets served, in all and by tier (None: no gets).
    pub hit: Option<f64>,
    pub memory_hit: Option<f64>,
    pub disk_hit: Option<f64>,
    pub get_p99_s: Option<f64>,
    pub put_p99_s: Option<f64>,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub failed_disks: u64,
    #[serde(skip)]
    get_window: Option<OpLatency>,
    #[serde(skip)]
    put_window: Option<OpLatency>,
    #[serde(skip)]
    deltas: [u64; 3],
}

fn op<'a>(s: &'a NodeStats, name: &str) -> Option<&'a OpLatency> {
    s.latency.iter().find(|l| l.op == name)
}

/// The interval from `prev` to `cur`, `secs` long.
pub fn row(id: &str, addr: &str, prev: Option<&NodeStats>, cur: &NodeStats, secs: f64) -> Row {
    let mut r = Row {
        id: id.to_string(),
        addr: addr.to_string(),
        reachable: true,
        used_bytes: cur.used_bytes,
        capacity_bytes: cur.capacity_bytes,
        failed_disks: cur.failed_disks,
        ..Row::default()
    };
    let Some(p) = prev else { return r };
    let d = |f: fn(&NodeStats) -> u64| f(cur).saturating_sub(f(p));
    let secs = secs.max(1e-3);
    let requests: u64 = cur.latency.iter().map(|l| l.since(op(p, &l.op)).count).sum();
    let (hits, mem) = (d(|s| s.hits), d(|s| s.mem_hits));
    let gets = hits + d(|s| s.misses) + d(|s| s.mismatches);
    r.deltas = [hits, mem, gets];
    r.requests_per_sec = requests as f64 / secs;
    r.gets_per_sec = gets as f64 / secs;
    r.read_bytes_per_sec = d(|s| s.bytes_read) as f64 / secs;
    r.written_bytes_per_sec = d(|s| s.bytes_written) as f64 / secs;
    let share = |n: u64| (gets > 0).then(|| n as f64 / gets as f64);
    (r.hit, r.memory_hit, r.disk_hit) = (share(hits), share(mem), share(hits.saturating_sub(mem)));
    r.get_window = op(cur, "get").map(|l| l.since(op(p, "get")));
    r.put_window = op(cur, "put").map(|l| l.since(op(p, "put")));
    r.get_p99_s = r.get_window.as_ref().and_then(|w| w.quantile(0.99));
    r.put_p99_s = r.put_window.as_ref().and_then(|w| w.quantile(0.99));
    r
}

/// Two windows of one op summed (same bucket bounds: same release).
fn merge(a: Option<OpLatency>, b: &Option<OpLatency>) -> Option<OpLatency> {
    match (a, b) {
        (None, b) => b.clone(),
        (a, None) => a,
        (Some(mut a), Some(b)) => {
            if a.buckets.len() == b.buckets.len() {
                for (x, y) in a.buckets.iter_mut().zip(&b.buckets) {
                    x.1 += y.1;
                }
                a.count += b.count;
                a.sum_seconds += b.sum_seconds;
            }
            Some(a)
        }
    }
}

/// The TOTAL row: sums, hit rates over all gets, p99 over all requests.
pub fn total(rows: &[Row]) -> Row {
    let mut t = Row { id: "TOTAL".into(), reachable: true, ..Row::default() };
    let (mut get_w, mut put_w) = (None, None);
    for r in rows.iter().filter(|r| r.reachable) {
        t.requests_per_sec += r.requests_per_sec;
        t.gets_per_sec += r.gets_per_sec;
        t.read_bytes_per_sec += r.read_bytes_per_sec;
        t.written_bytes_per_sec += r.written_bytes_per_sec;
        t.used_bytes += r.used_bytes;
        t.capacity_bytes += r.capacity_bytes;
        t.failed_disks += r.failed_disks;
        for i in 0..3 {
            t.deltas[i] += r.deltas[i];
        }
        get_w = merge(get_w, &r.get_window);
        put_w = merge(put_w, &r.put_window);
    }
    let [hits, mem, gets] = t.deltas;
    let share = |n: u64| (gets > 0).then(|| n as f64 / gets as f64);
    (t.hit, t.memory_hit, t.disk_hit) = (share(hits), share(mem), share(hits.saturating_sub(mem)));
    t.get_p99_s = get_w.as_ref().and_then(|w| w.quantile(0.99));
    t.put_p99_s = put_w.as_ref().and_then(|w| w.quantile(0.99));
    let up = rows.iter().filter(|r| r.reachable).count();
    t.addr = format!("{up} of {} nodes", rows.len());
    t
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn ms(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| if v < 1e-3 { format!("{:.0}us", v * 1e6) } else { format!("{:.2}ms", v * 1e3) })
}

fn rate(b: f64) -> String {
    format!("{}/s", format_size(b as u64))
}

/// Prints one frame as a table.
pub fn render(header: &str, rows: &[Row], first: bool) -> String {
    let mut t = cluster::table(
        &[
            "NODE", "ADDRESS", "REQ/S", "GET/S", "READ", "WRITE", "HIT%", "MEM%", "DISK%", "GET P99", "PUT P99", "USE",
            "FAILED",
        ],
        2,
    );
    let mut line = |r: &Row| {
        if !r.reachable {
            t.add_row(vec![r.id.clone(), r.addr.clone(), "UNREACHABLE".into()]);
            return;
        }
        let use_pct = if r.capacity_bytes > 0 { 100.0 * r.used_bytes as f64 / r.capacity_bytes as f64 } else { 0.0 };
        t.add_row(vec![
            r.id.clone(),
            r.addr.clone(),
            format!("{:.0}", r.requests_per_sec),
            format!("{:.0}", r.gets_per_sec),
            rate(r.read_bytes_per_sec),
            rate(r.written_bytes_per_sec),
            pct(r.hit),
            pct(r.memory_hit),
            pct(r.disk_hit),
            ms(r.get_p99_s),
            ms(r.put_p99_s),
            format!("{use_pct:.1}% of {}", format_size(r.capacity_bytes)),
            r.failed_disks.to_string(),
        ]);
    };
    for r in rows {
        line(r);
    }
    line(&total(rows));
    let note = if first { "\n(rates appear from the second refresh)" } else { "" };
    format!("{header}\n{t}{note}")
}

/// Runs until interrupted, or for `iterations` refreshes.
pub fn run(
    source: &Source,
    interval: Duration,
    iterations: Option<u64>,
    timeout: Duration,
    json: bool,
) -> Result<u8, String> {
    let tty = std::io::stdout().is_terminal() && !json;
    let mut prev: HashMap<String, (Instant, NodeStats)> = HashMap::new();
    let mut n = 0u64;
    let mut last: Option<(String, Vec<MemberRecord>)> = None;
    loop {
        let started = Instant::now();
        let (label, members) = match source {
            Source::Mds { endpoints, group } => match cluster::fetch_view(endpoints, group, timeout) {
                Ok(v) => {
                    let got = (format!("group {group}  epoch {}", v.epoch), v.members);
                    last = Some(got.clone());
                    got
                }
                // kv-mds away for a moment: the members last seen, and why.
                Err(e) => match &last {
                    Some((label, m)) => (format!("{label}  (kv-mds: {e})"), m.clone()),
                    None => return Err(e),
                },
            },
            Source::Members(m) => ("members".to_string(), m.clone()),
        };
        let stats = cluster::gather(&members, timeout);
        let now = Instant::now();
        let mut rows = Vec::new();
        let mut next = HashMap::new();
        for (m, s) in members.iter().zip(stats) {
            match s {
                Ok(s) => {
                    let p = prev.get(&m.id);
                    rows.push(row(&m.id, &m.addr, p.map(|x| &x.1), &s, p.map_or(0.0, |x| (now - x.0).as_secs_f64())));
                    next.insert(m.id.clone(), (now, s));
                }
                Err(_) => rows.push(Row { id: m.id.clone(), addr: m.addr.clone(), ..Row::default() }),
            }
        }
        if json {
            let frame = serde_json::json!({"source": label, "nodes": rows, "total": total(&rows)});
            println!("{frame}");
        } else {
            let header = format!("kvctl top  {label}  every {:.1}s", interval.as_secs_f64());
            let frame = render(&header, &rows, prev.is_empty());
            if tty {
                // Home and clear, then the frame: a steady picture.
                println!("\x1b[H\x1b[2J{frame}");
            } else {
                println!("{frame}\n");
            }
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        prev = next;
        n += 1;
        if iterations.is_some_and(|max| n >= max) {
            return Ok(0);
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}
