//! The figures of a replay, as a table or as one JSON object
//! (docs/BENCHMARKS.md, "Trace replay").

use std::collections::BTreeMap;

use kv_common::size::format_size;
use serde_json::json;

use super::model::{self, rate, Tally};
use super::trace::{PageId, Request};
use super::{EventRun, Layout, Outcome, Plan, Served};
use crate::cluster::table;

/// The distinct pages of the replayed slice and what they take.
#[derive(Clone, Copy, Debug)]
pub struct WorkingSet {
    pub distinct_pages: u64,
    pub payload_bytes: u64,
    /// A record (64-byte header, key, payload) rounded up to the 4 KiB
    /// extent the node stores it in, for the longest key of the run.
    pub footprint_per_page: u64,
    pub disk_bytes: u64,
}

pub struct Input<'a> {
    pub name: &'a str,
    pub plan: &'a Plan,
    pub reqs: &'a [Request],
    pub pages: &'a [Vec<PageId>],
    pub outcomes: &'a [Outcome],
    pub working: WorkingSet,
    /// Bytes and where the figure came from.
    pub capacity: Option<(u64, String)>,
    /// The group's members and the gets each served during the replay.
    pub layout: Option<(&'a Layout, Vec<Option<Served>>)>,
    pub runs: Vec<Option<EventRun>>,
    pub wall: f64,
}

pub struct Lru {
    pub capacity_bytes: u64,
    pub source: String,
    pub capacity_pages: u64,
    pub hits: u64,
}

/// One member: its capacity, the gets an LRU of that capacity on the same
/// ring would have served, and what it did (None: no statistics).
pub struct NodeRow {
    pub id: String,
    pub capacity_bytes: Option<u64>,
    pub capacity_pages: u64,
    pub simulated_gets: u64,
    pub served: Option<Served>,
}

/// The per-node figures: an LRU per node on the group's ring, each of its
/// node's capacity (what hash partitioning alone costs against the pooled
/// LRU), and the read balance.
pub struct Nodes {
    pub rows: Vec<NodeRow>,
    pub partitioned_hits: u64,
    /// Gets the busiest member served against the mean, measured (every
    /// member answered) and simulated.
    pub gets_max_over_mean: Option<f64>,
    pub simulated_max_over_mean: Option<f64>,
}

pub struct EventReport {
    pub at_ms: u64,
    pub command: String,
    pub run: Option<EventRun>,
    pub span: Tally,
}

pub struct Prefill {
    pub tokens_per_s: f64,
    pub saved_s: f64,
    pub load_s: f64,
}

pub struct Report {
    pub name: String,
    pub tag: String,
    pub per_block: u32,
    pub page_tokens: u64,
    pub page_bytes: u64,
    pub engines: usize,
    pub speed: f64,
    /// Trace time (ms) before which the requests went as fast as possible.
    pub warm_until_ms: Option<u64>,
    pub wall: f64,
    pub slice_requests: u64,
    pub requests: u64,
    pub pages: u64,
    pub hits: u64,
    pub ceiling: u64,
    pub lru: Option<Lru>,
    pub nodes: Option<Nodes>,
    /// Every block of the issued requests, partial last blocks too
    /// (traces/README.md's figures): blocks, distinct, leading hits.
    pub blocks: (u64, u64, u64),
    pub working: WorkingSet,
    pub l3_p50_ms: f64,
    pub l3_p99_ms: f64,
    pub l3_max_ms: f64,
    pub get_s: f64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub wrong_pages: u64,
    pub get_missed: u64,
    pub chain_end: BTreeMap<&'static str, u64>,
    pub failed_puts: BTreeMap<&'static str, u64>,
    pub window_ms: u64,
    pub windows: Vec<(u64, Tally)>,
    pub event_span_ms: u64,
    pub events: Vec<EventReport>,
    pub prefill: Option<Prefill>,
}

pub fn build(i: Input<'_>) -> Report {
    let plan = i.plan;
    let issued: Vec<usize> = (0..i.reqs.len()).filter(|&k| i.outcomes[k].issued).collect();
    let chains: Vec<&[PageId]> = issued.iter().map(|&k| &i.pages[k][..]).collect();
    let ceiling = model::ceiling(&chains);
    let lru = i.capacity.map(|(bytes, source)| {
        let capacity_pages = bytes / i.working.footprint_per_page.max(1);
        let hits = model::lru(&chains, capacity_pages).iter().sum();
        Lru { capacity_bytes: bytes, source, capacity_pages, hits }
    });
    let nodes = i.layout.map(|(l, served)| nodes(l, served, &chains, plan, i.working.footprint_per_page));
    let hash_chains: Vec<&[u64]> = issued.iter().map(|&k| &i.reqs[k].hash_ids[..]).collect();
    let blocks = model::block_figures(&hash_chains);

    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).ok();
    let mut r = Report {
        name: i.name.to_string(),
        tag: plan.tag.clone(),
        per_block: plan.paging.per_block,
        page_tokens: plan.paging.page_tokens(),
        page_bytes: plan.page_bytes as u64,
        engines: plan.engines,
        speed: plan.speed,
        warm_until_ms: plan.warm_until_ms,
        wall: i.wall,
        slice_requests: i.reqs.len() as u64,
        requests: issued.len() as u64,
        pages: chains.iter().map(|c| c.len() as u64).sum(),
        hits: 0,
        ceiling: ceiling.iter().sum(),
        lru,
        nodes,
        blocks,
        working: i.working,
        l3_p50_ms: 0.0,
        l3_p99_ms: 0.0,
        l3_max_ms: 0.0,
        get_s: 0.0,
        bytes_in: 0,
        bytes_out: 0,
        wrong_pages: 0,
        get_missed: 0,
        chain_end: BTreeMap::new(),
        failed_puts: BTreeMap::new(),
        window_ms: plan.window_ms,
        windows: Vec::new(),
        event_span_ms: plan.event_span_ms,
        events: Vec::new(),
        prefill: None,
    };
    let mut rows = Vec::with_capacity(issued.len());
    let mut load_ns = 0u64;
    for (n, &k) in issued.iter().enumerate() {
        let o = &i.outcomes[k];
        r.hits += o.hits;
        r.bytes_in += o.bytes_in;
        r.bytes_out += o.bytes_out;
        r.wrong_pages += o.wrong;
        r.get_missed += o.get_missed;
        r.get_s += o.get_ns as f64 / 1e9;
        if let Some(e) = o.end {
            *r.chain_end.entry(e).or_default() += 1;
        }
        for (s, c) in &o.failed_puts {
            *r.failed_puts.entry(s).or_default() += c;
        }
        if !i.pages[k].is_empty() {
            if let Some(h) = h.as_mut() {
                h.saturating_record(o.l3_ns.max(1));
            }
        }
        if o.hits > 0 {
            load_ns += o.l3_ns;
        }
        rows.push((i.reqs[k].ts_ms, i.pages[k].len() as u64, o.hits, ceiling[n]));
    }
    if let Some(h) = h.filter(|h| !h.is_empty()) {
        r.l3_p50_ms = h.value_at_quantile(0.50) as f64 / 1e6;
        r.l3_p99_ms = h.value_at_quantile(0.99) as f64 / 1e6;
        r.l3_max_ms = h.max() as f64 / 1e6;
    }
    r.windows = model::windows(&rows, plan.window_ms);
    r.events = plan
        .events
        .iter()
        .zip(i.runs)
        .map(|(e, run)| {
            let mut span = Tally::default();
            for &(ts, pages, hits, ceil) in &rows {
                if ts >= e.at_ms && ts < e.at_ms.saturating_add(plan.event_span_ms) {
                    span.add(pages, hits, ceil);
                }
            }
            EventReport { at_ms: e.at_ms, command: e.command.clone(), run, span }
        })
        .collect();
    r.prefill = plan.prefill.map(|rate| Prefill {
        tokens_per_s: rate,
        saved_s: (r.hits * r.page_tokens) as f64 / rate,
        load_s: load_ns as f64 / 1e9,
    });
    r
}

fn nodes(l: &Layout, served: Vec<Option<Served>>, chains: &[&[PageId]], plan: &Plan, footprint: u64) -> Nodes {
    let mut owner: std::collections::HashMap<PageId, usize> = std::collections::HashMap::new();
    for p in chains.iter().flat_map(|c| c.iter()) {
        owner.entry(*p).or_insert_with(|| l.owner(super::trace::key(&plan.tag, *p).as_bytes()));
    }
    let caps: Vec<u64> = l.capacity.iter().map(|c| c.unwrap_or(0) / footprint.max(1)).collect();
    let (hits, sim_gets) = model::lru_partitioned(chains, &caps, |p| owner.get(p).copied().unwrap_or(0));
    let measured: Option<Vec<u64>> = served.iter().map(|s| s.map(|s| s.gets)).collect();
    Nodes {
        rows: l
            .ids
            .iter()
            .enumerate()
            .map(|(k, id)| NodeRow {
                id: id.clone(),
                capacity_bytes: l.capacity[k],
                capacity_pages: caps[k],
                simulated_gets: sim_gets[k],
                served: served[k],
            })
            .collect(),
        partitioned_hits: hits.iter().sum(),
        gets_max_over_mean: measured.as_deref().and_then(model::max_over_mean),
        simulated_max_over_mean: model::max_over_mean(&sim_gets),
    }
}

fn pct(part: u64, all: u64) -> String {
    format!("{:.1}%", 100.0 * rate(part, all))
}

/// A bar of `width` characters for a share in [0, 1].
fn bar(share: f64, width: usize) -> String {
    let n = ((share.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    "#".repeat(n)
}

impl Report {
    pub fn json(&self) -> serde_json::Value {
        let windows: Vec<_> = self
            .windows
            .iter()
            .map(|(start, t)| {
                json!({
                    "start_s": *start as f64 / 1000.0, "requests": t.requests, "pages": t.pages, "hits": t.hits,
                    "hit_rate": rate(t.hits, t.pages), "ceiling_hits": t.ceiling,
                    "ceiling_hit_rate": rate(t.ceiling, t.pages),
                })
            })
            .collect();
        let events: Vec<_> = self
            .events
            .iter()
            .map(|e| {
                json!({
                    "at_s": e.at_ms as f64 / 1000.0, "command": e.command,
                    "reached": e.run.is_some(),
                    "status": e.run.as_ref().map(|r| r.status.clone()),
                    "started_s": e.run.as_ref().map(|r| r.started_s),
                    "ended_s": e.run.as_ref().map(|r| r.ended_s),
                    "span_s": self.event_span_ms as f64 / 1000.0,
                    "requests": e.span.requests, "pages": e.span.pages, "hits": e.span.hits,
                    "hit_rate": rate(e.span.hits, e.span.pages), "ceiling_hits": e.span.ceiling,
                })
            })
            .collect();
        json!({
            "trace": self.name, "tag": self.tag,
            "pages_per_block": self.per_block, "page_tokens": self.page_tokens, "page_bytes": self.page_bytes,
            "engines": self.engines, "speed": self.speed,
            "warm_until_s": self.warm_until_ms.map(|w| w as f64 / 1000.0), "seconds": self.wall,
            "requests": self.requests, "requests_in_slice": self.slice_requests,
            "pages": self.pages, "hits": self.hits, "hit_rate": rate(self.hits, self.pages),
            "ceiling": {"hits": self.ceiling, "hit_rate": rate(self.ceiling, self.pages)},
            "lru": self.lru.as_ref().map(|l| json!({
                "capacity_bytes": l.capacity_bytes, "capacity_source": l.source,
                "capacity_pages": l.capacity_pages, "hits": l.hits, "hit_rate": rate(l.hits, self.pages),
            })),
            "nodes": self.nodes.as_ref().map(|n| json!({
                "partitioned_lru": {"hits": n.partitioned_hits, "hit_rate": rate(n.partitioned_hits, self.pages)},
                "gets_max_over_mean": n.gets_max_over_mean,
                "simulated_gets_max_over_mean": n.simulated_max_over_mean,
                "members": n.rows.iter().map(|r| json!({
                    "id": r.id, "capacity_bytes": r.capacity_bytes, "capacity_pages": r.capacity_pages,
                    "simulated_gets": r.simulated_gets, "gets": r.served.map(|s| s.gets),
                    "used_bytes": r.served.map(|s| s.used_bytes), "evictions": r.served.map(|s| s.evictions),
                })).collect::<Vec<_>>(),
            })),
            "all_blocks": {
                "blocks": self.blocks.0, "distinct": self.blocks.1, "ceiling_hits": self.blocks.2,
                "ceiling_hit_rate": rate(self.blocks.2, self.blocks.0),
            },
            "working_set": {
                "distinct_pages": self.working.distinct_pages, "payload_bytes": self.working.payload_bytes,
                "footprint_bytes_per_page": self.working.footprint_per_page, "disk_bytes": self.working.disk_bytes,
            },
            "l3_ms": {"p50": self.l3_p50_ms, "p99": self.l3_p99_ms, "max": self.l3_max_ms},
            "get_seconds": self.get_s,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "wrong_pages": self.wrong_pages, "get_missed_after_exist": self.get_missed,
            "chain_end": self.chain_end, "failed_puts": self.failed_puts,
            "window_s": self.window_ms as f64 / 1000.0, "window_clock": "trace", "windows": windows,
            "events": events,
            "prefill": self.prefill.as_ref().map(|p| json!({
                "tokens_per_s": p.tokens_per_s, "saved_s": p.saved_s, "load_s": p.load_s,
                "net_s": p.saved_s - p.load_s,
            })),
        })
    }

    pub fn print(&self) {
        let speed = match (self.speed > 0.0, self.warm_until_ms) {
            (false, _) => "as fast as possible".to_string(),
            (true, None) => format!("speed {}x", self.speed),
            (true, Some(w)) => {
                format!("as fast as possible up to trace time {} s, then speed {}x", w as f64 / 1000.0, self.speed)
            }
        };
        println!(
            "replay of {}: {} of {} requests in {:.1} s, {} engine stream(s), {speed}, tag {}",
            self.name, self.requests, self.slice_requests, self.wall, self.engines, self.tag
        );
        let mut t = table(&["FIGURE", "VALUE"], 9);
        let mut row = |k: &str, v: String| {
            t.add_row(vec![k.to_string(), v]);
        };
        row("requests", self.requests.to_string());
        row(
            "pages",
            format!(
                "{} ({} a block, {} tokens, {} each)",
                self.pages,
                self.per_block,
                self.page_tokens,
                format_size(self.page_bytes)
            ),
        );
        row(
            "working set",
            format!(
                "{} distinct pages, {} payload, {} on disk ({} a page)",
                self.working.distinct_pages,
                format_size(self.working.payload_bytes),
                format_size(self.working.disk_bytes),
                format_size(self.working.footprint_per_page)
            ),
        );
        row("leading-hit pages", self.hits.to_string());
        row("hit rate", pct(self.hits, self.pages));
        row("ceiling (unlimited capacity)", format!("{} ({})", self.ceiling, pct(self.ceiling, self.pages)));
        match &self.lru {
            Some(l) => row(
                "LRU at group capacity",
                format!(
                    "{} ({}); {} = {} pages ({})",
                    l.hits,
                    pct(l.hits, self.pages),
                    format_size(l.capacity_bytes),
                    l.capacity_pages,
                    l.source
                ),
            ),
            None => row("LRU at group capacity", "not simulated (no capacity)".into()),
        }
        if let Some(n) = &self.nodes {
            row(
                "LRU per node, same ring",
                format!("{} ({}); each node's capacity", n.partitioned_hits, pct(n.partitioned_hits, self.pages)),
            );
            row(
                "gets busiest/mean node",
                format!(
                    "{} (LRU per node: {})",
                    n.gets_max_over_mean.map_or("-".into(), |m| format!("{m:.2}")),
                    n.simulated_max_over_mean.map_or("-".into(), |m| format!("{m:.2}"))
                ),
            );
        }
        row(
            "all blocks, partial too",
            format!(
                "{} blocks, {} distinct, ceiling {} ({})",
                self.blocks.0,
                self.blocks.1,
                self.blocks.2,
                pct(self.blocks.2, self.blocks.0)
            ),
        );
        row(
            "L3 time per request",
            format!(
                "p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms (exist + get)",
                self.l3_p50_ms, self.l3_p99_ms, self.l3_max_ms
            ),
        );
        row("bytes in (gets)", format_size(self.bytes_in));
        row("bytes out (puts)", format_size(self.bytes_out));
        row("wrong pages", if self.wrong_pages == 0 { "0".into() } else { format!("{} !!!", self.wrong_pages) });
        row("get missed after exist hit", format!("{} pages", self.get_missed));
        if let Some(p) = &self.prefill {
            row(
                "prefill saved",
                format!(
                    "{:.1} s at {} tokens/s, minus {:.1} s loading = {:.1} s",
                    p.saved_s,
                    p.tokens_per_s,
                    p.load_s,
                    p.saved_s - p.load_s
                ),
            );
        }
        println!("{t}");

        if let Some(n) = &self.nodes {
            println!();
            println!(
                "per node (full and evictions at the end; gets served: the node's own count over the replay; LRU gets: an \
                 LRU of its capacity on the same ring):"
            );
            let mut t = table(&["NODE", "CAPACITY", "PAGES", "FULL", "EVICTIONS", "GETS SERVED", "LRU GETS"], 1);
            for r in &n.rows {
                t.add_row(vec![
                    r.id.clone(),
                    r.capacity_bytes.map_or("-".into(), format_size),
                    r.capacity_pages.to_string(),
                    match (r.served, r.capacity_bytes) {
                        (Some(s), Some(c)) => crate::cluster::full_pct(s.used_bytes, c),
                        _ => "-".into(),
                    },
                    r.served.map_or("-".into(), |s| s.evictions.to_string()),
                    r.served.map_or("-".into(), |s| s.gets.to_string()),
                    r.simulated_gets.to_string(),
                ]);
            }
            println!("{t}");
        }
        println!();
        println!("requests whose leading hits ended at a page that was not served, by status:");
        let mut t = table(&["STATUS", "REQUESTS"], 1);
        for (k, v) in &self.chain_end {
            t.add_row(vec![k.to_string(), v.to_string()]);
        }
        if self.chain_end.is_empty() {
            t.add_row(vec!["(none)".to_string(), "0".to_string()]);
        }
        println!("{t}");
        println!();
        println!("failed puts, by status:");
        let mut t = table(&["STATUS", "PAGES"], 1);
        for (k, v) in &self.failed_puts {
            t.add_row(vec![k.to_string(), v.to_string()]);
        }
        if self.failed_puts.is_empty() {
            t.add_row(vec!["(none)".to_string(), "0".to_string()]);
        }
        println!("{t}");

        if !self.events.is_empty() {
            println!();
            println!("events (trace clock) and the {} s of trace time after each:", self.event_span_ms as f64 / 1000.0);
            let mut t = table(
                &["AT (s)", "COMMAND", "STATUS", "RAN (wall s)", "REQUESTS", "PAGES", "HITS", "HIT%", "CEILING%"],
                4,
            );
            for e in &self.events {
                let (status, ran) = match &e.run {
                    Some(r) => (r.status.clone(), format!("{:.1}-{:.1}", r.started_s, r.ended_s)),
                    None => ("not reached".to_string(), "-".to_string()),
                };
                t.add_row(vec![
                    format!("{}", e.at_ms as f64 / 1000.0),
                    e.command.clone(),
                    status,
                    ran,
                    e.span.requests.to_string(),
                    e.span.pages.to_string(),
                    e.span.hits.to_string(),
                    pct(e.span.hits, e.span.pages),
                    pct(e.span.ceiling, e.span.pages),
                ]);
            }
            println!("{t}");
        }

        println!();
        println!(
            "hit rate per {} s window of trace time (the trace's timestamps, not wall time):",
            self.window_ms as f64 / 1000.0
        );
        let mut t = table(&["WINDOW (s)", "REQUESTS", "PAGES", "HITS", "HIT%", "CEILING%", "HIT% (# = 5%)"], 1);
        if let Some(c) = t.column_mut(6) {
            c.set_cell_alignment(comfy_table::CellAlignment::Left);
        }
        for (start, w) in &self.windows {
            t.add_row(vec![
                format!("{}", *start as f64 / 1000.0),
                w.requests.to_string(),
                w.pages.to_string(),
                w.hits.to_string(),
                pct(w.hits, w.pages),
                pct(w.ceiling, w.pages),
                bar(rate(w.hits, w.pages), 20),
            ]);
        }
        println!("{t}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bars_scale() {
        assert_eq!(super::bar(0.5, 20), "#".repeat(10));
        assert_eq!(super::bar(2.0, 20).len(), 20);
        assert_eq!(super::bar(0.0, 20), "");
        assert_eq!(super::pct(1, 3), "33.3%");
    }
}
