//! `kvctl top`: a live view of a group, one row per node and a TOTAL,
//! refreshed every interval. It reads each node's STATS record over the
//! data plane (the same counters and service-time histograms `/metrics`
//! exports), so rates and percentiles are over the last interval.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use kv_common::mds::MemberRecord;
use kv_common::size::format_size;
use kv_common::stats::{Interval, NodeStats, TenantInterval};

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
    /// What the rates above were computed from (None before a second record).
    #[serde(skip)]
    interval: Option<Interval>,
    /// Each tenant over the interval (before a second record: holdings,
    /// no rates).
    #[serde(skip)]
    tenants: Vec<TenantInterval>,
}

impl Row {
    /// The shares and percentiles of an interval (rates are per row).
    fn shares_of(&mut self, iv: &Interval) {
        (self.hit, self.memory_hit, self.disk_hit) = (iv.hit(), iv.memory_hit(), iv.disk_hit());
        self.get_p99_s = iv.op("get").and_then(|w| w.quantile(0.99));
        self.put_p99_s = iv.op("put").and_then(|w| w.quantile(0.99));
    }
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
    let Some(p) = prev else {
        // Holdings, no rates: every tenant is new.
        r.tenants = kv_common::stats::tenant_intervals(&[], &cur.tenants, 1.0);
        return r;
    };
    r.tenants = kv_common::stats::tenant_intervals(&p.tenants, &cur.tenants, secs);
    let iv = Interval::between(p, cur, secs);
    r.requests_per_sec = iv.requests_per_sec();
    r.gets_per_sec = iv.per_sec(iv.gets);
    r.read_bytes_per_sec = iv.per_sec(iv.bytes_read);
    r.written_bytes_per_sec = iv.per_sec(iv.bytes_written);
    r.shares_of(&iv);
    r.interval = Some(iv);
    r
}

/// The TOTAL row: sums, hit rates over all gets, p99 over all requests.
pub fn total(rows: &[Row]) -> Row {
    let mut t = Row { id: "TOTAL".into(), reachable: true, ..Row::default() };
    let mut all: Option<Interval> = None;
    for r in rows.iter().filter(|r| r.reachable) {
        t.requests_per_sec += r.requests_per_sec;
        t.gets_per_sec += r.gets_per_sec;
        t.read_bytes_per_sec += r.read_bytes_per_sec;
        t.written_bytes_per_sec += r.written_bytes_per_sec;
        t.used_bytes += r.used_bytes;
        t.capacity_bytes += r.capacity_bytes;
        t.failed_disks += r.failed_disks;
        if let Some(iv) = &r.interval {
            all.get_or_insert_with(Interval::default).add(iv);
        }
    }
    if let Some(iv) = &all {
        t.shares_of(iv);
    }
    let up = rows.iter().filter(|r| r.reachable).count();
    t.addr = format!("{up} of {} nodes", rows.len());
    t
}

/// The group's tenants over the interval: each summed over the reachable
/// nodes, the largest holding first.
pub fn tenant_totals(rows: &[Row]) -> Vec<TenantInterval> {
    let mut all = kv_common::stats::tenant_totals(rows.iter().filter(|r| r.reachable).map(|r| &r.tenants[..]));
    all.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.tenant.cmp(&b.tenant)));
    all
}

/// The tenants' table: use of the quota, rates, evictions (own and those
/// for another tenant's put, which is borrowed room taken back).
pub fn render_tenants(tenants: &[TenantInterval], first: bool) -> String {
    if tenants.is_empty() {
        return "tenants: none reported (nodes of an earlier release)".into();
    }
    let mut t =
        cluster::table(&["TENANT", "USE OF QUOTA", "RECORDS", "GET/S", "HIT%", "PUT/S", "EVICT/S", "FOR OTHERS/S"], 2);
    let per = |x: f64| if first { "-".to_string() } else { format!("{x:.0}") };
    for x in tenants {
        let quota = if x.quota > 0 {
            format!(
                "{} of {} ({:.0}%)",
                format_size(x.bytes),
                format_size(x.quota),
                100.0 * x.bytes as f64 / x.quota as f64
            )
        } else {
            format!("{} (no quota)", format_size(x.bytes))
        };
        t.add_row(vec![
            x.tenant.clone(),
            quota,
            x.objects.to_string(),
            per(x.hits + x.misses),
            pct(x.hit),
            per(x.puts),
            per(x.evictions),
            per(x.evicted_for_others),
        ]);
    }
    format!("{t}")
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
    let balance = match balance(rows) {
        Some((id, m)) => format!("\nread balance: {m:.2}x the mean gets at the busiest node ({id})"),
        None => String::new(),
    };
    format!("{header}\n{t}{balance}{note}")
}

/// The busiest reachable node's gets over the interval against the mean of
/// the reachable nodes, and its id (None before a second refresh or
/// without gets).
pub fn balance(rows: &[Row]) -> Option<(String, f64)> {
    let up: Vec<&Row> = rows.iter().filter(|r| r.reachable && r.interval.is_some()).collect();
    let loads: Vec<f64> = up.iter().map(|r| r.gets_per_sec).collect();
    kv_common::stats::busiest_over_mean(&loads).map(|(i, m)| (up[i].id.clone(), m))
}

/// Runs until interrupted, or for `iterations` refreshes; with `tenants`,
/// each frame also has the group's tenants.
pub fn run(
    source: &Source,
    interval: Duration,
    iterations: Option<u64>,
    timeout: Duration,
    json: bool,
    tenants: bool,
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
            let read_balance = balance(&rows).map(|(id, m)| serde_json::json!({"busiest": id, "max_over_mean": m}));
            let frame = serde_json::json!({"source": label, "nodes": rows, "total": total(&rows),
                "read_balance": read_balance, "tenants": tenant_totals(&rows)});
            println!("{frame}");
        } else {
            let header = format!("kvctl top  {label}  every {:.1}s", interval.as_secs_f64());
            let mut frame = render(&header, &rows, prev.is_empty());
            if tenants {
                frame = format!("{frame}\n\n{}", render_tenants(&tenant_totals(&rows), prev.is_empty()));
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(hits: u64, misses: u64) -> NodeStats {
        NodeStats { hits, misses, ..NodeStats::default() }
    }

    #[test]
    fn the_read_balance_names_the_busiest_reachable_node() {
        let rows = vec![
            row("n1", "a:1", Some(&stats(0, 0)), &stats(100, 20), 2.0),
            row("n2", "a:2", Some(&stats(0, 0)), &stats(30, 10), 2.0),
            Row { id: "n3".into(), ..Row::default() },
            row("n4", "a:4", Some(&stats(0, 0)), &stats(40, 0), 2.0),
        ];
        // Gets per second 60, 20 and 20 at the reachable nodes: 1.8x the mean.
        let (id, m) = balance(&rows).expect("a balance");
        assert_eq!(id, "n1");
        assert!((m - 1.8).abs() < 1e-9, "{m}");
        assert!(render("h", &rows, false).contains("read balance: 1.80x the mean gets at the busiest node (n1)"));
        // Before a second refresh there are no rates, so no balance.
        assert_eq!(balance(&[row("n1", "a:1", None, &stats(5, 0), 0.0)]), None);
    }

    #[test]
    fn the_tenants_table_sums_the_nodes() {
        use kv_common::stats::TenantStats;
        let node = |hits, misses, puts, bytes| NodeStats {
            tenants: vec![
                TenantStats {
                    tenant: "team-a".into(),
                    bytes,
                    quota: 100 << 20,
                    hits,
                    misses,
                    puts,
                    ..Default::default()
                },
                TenantStats { tenant: "default".into(), bytes: 1 << 20, objects: 1, ..Default::default() },
            ],
            ..NodeStats::default()
        };
        let rows = vec![
            row("n1", "a:1", Some(&node(0, 0, 0, 0)), &node(30, 10, 8, 20 << 20), 2.0),
            row("n2", "a:2", Some(&node(0, 0, 0, 0)), &node(10, 10, 4, 30 << 20), 2.0),
            Row { id: "n3".into(), ..Row::default() },
        ];
        let t = tenant_totals(&rows);
        assert_eq!(t[0].tenant, "team-a", "the largest holding first");
        assert_eq!((t[0].hits, t[0].misses, t[0].puts, t[0].bytes, t[0].quota), (20.0, 10.0, 6.0, 50 << 20, 200 << 20));
        let out = render_tenants(&t, false);
        assert!(out.contains("TENANT") && out.contains("FOR OTHERS/S"), "{out}");
        let a = out.lines().find(|l| l.trim_start().starts_with("team-a")).unwrap_or_else(|| panic!("{out}"));
        assert!(a.contains("50.0 MiB of 200.0 MiB (25%)") && a.contains("66.7%"), "{a}");
        assert!(out.lines().any(|l| l.trim_start().starts_with("default") && l.contains("(no quota)")), "{out}");
        // Before a second refresh: holdings, no rates.
        let first = tenant_totals(&[row("n1", "a:1", None, &node(5, 0, 0, 1 << 20), 0.0)]);
        assert_eq!((first[0].hits, first[0].hit), (0.0, None));
        assert!(render_tenants(&first, true)
            .lines()
            .any(|l| l.trim_start().starts_with("team-a") && l.contains(" - ")));
        assert!(render_tenants(&[], false).contains("none reported"));
    }
}
