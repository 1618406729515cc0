//! The node statistics record a STATS request returns (as JSON), shared by
//! the node that fills it and the tools that print it.

use serde::{Deserialize, Serialize};

/// Per-disk figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DiskStats {
    pub id: String,
    pub dir: String,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub objects: u64,
    pub evictions: u64,
    pub failed: bool,
    #[serde(default)]
    pub failure: Option<String>,
    /// Records recovered after a crash whose payload is not yet checked.
    #[serde(default)]
    pub unverified: u64,
}

/// What an operator needs about one node.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeStats {
    pub version: String,
    pub uptime_secs: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub objects: u64,
    pub hits: u64,
    pub misses: u64,
    pub mismatches: u64,
    pub puts: u64,
    pub put_duplicates: u64,
    pub put_rejected: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub evictions: u64,
    pub failed_disks: u64,
    pub corrupt_dropped: u64,
    /// Records recovered after a crash whose payload is not yet checked.
    #[serde(default)]
    pub unverified: u64,
    pub mem_used_bytes: u64,
    pub mem_capacity_bytes: u64,
    pub mem_hits: u64,
    pub connections: u64,
    /// Connections refused at the hello for a missing or wrong auth token.
    #[serde(default)]
    pub denied_connections: u64,
    /// Connections accepted in protocol v1 (clients of the previous release).
    #[serde(default)]
    pub v1_connections: u64,
    /// Connections refused at the connection cap (`--max-conns`).
    #[serde(default)]
    pub refused_connections: u64,
    /// Connections closed before their hello: none within the hello
    /// deadline, or the oldest closed to make room for new ones.
    #[serde(default)]
    pub closed_before_hello: u64,
    /// Gets that found their record damaged (dropped, answered as a miss;
    /// included in `misses`).
    #[serde(default)]
    pub misses_corrupt: u64,
    /// Gets of keys not stored (part of `misses`), and gets served from
    /// the disks (part of `hits`).
    #[serde(default)]
    pub misses_absent: u64,
    #[serde(default)]
    pub disk_hits: u64,
    /// The node's `--id` and `--group` when it joined a group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Service time per op (the histograms `/metrics` exports).
    #[serde(default)]
    pub latency: Vec<OpLatency>,
    pub disks: Vec<DiskStats>,
    /// True while the node drains after a SIGTERM (left its group; serves
    /// gets, exists and deletes, refuses puts).
    #[serde(default)]
    pub draining: bool,
    /// Ring handoff (docs/ARCHITECTURE.md, "Ring transitions"): keys asked
    /// here by clients whose owner missed them, and those found; copies of
    /// pages found elsewhere stored here, their payload bytes, and copies
    /// refused for a delete within the window; tombstones held.
    #[serde(default)]
    pub handoff_asks: u64,
    #[serde(default)]
    pub handoff_hits: u64,
    #[serde(default)]
    pub handoff_copies: u64,
    #[serde(default)]
    pub handoff_copy_bytes: u64,
    #[serde(default)]
    pub handoff_refused: u64,
    /// Handoff copies refused for their age: read longer ago than half the
    /// node's handoff window (docs/PROTOCOL.md §2.9).
    #[serde(default)]
    pub handoff_too_old: u64,
    #[serde(default)]
    pub tombstones: u64,
    /// Hot keys (docs/ARCHITECTURE.md, "Hot keys"): keys marked hot now,
    /// reads of hot keys served, keys that turned hot, reads not marked for
    /// the bound on the hot set, and the reads in a window that make a key
    /// hot now.
    #[serde(default)]
    pub hot_keys: u64,
    #[serde(default)]
    pub hot_reads: u64,
    #[serde(default)]
    pub hot_marked: u64,
    #[serde(default)]
    pub hot_refused: u64,
    #[serde(default)]
    pub hot_threshold: u64,
    /// Copies of hot pages stored here to serve a share of their reads
    /// (fills, also counted in `handoff_copies`).
    #[serde(default)]
    pub hot_fills: u64,
    /// Of those fills, the copies still held here (fills since the node
    /// started, at most 65,536 tracked; evicted and deleted ones not).
    #[serde(default)]
    pub hot_copies_held: u64,
    /// Each tenant's holding at this node (docs/DEPLOY.md, "Tenants"):
    /// at most [`MAX_TENANTS_SHOWN`], the largest by bytes, the rest summed
    /// under the name `other`.
    #[serde(default)]
    pub tenants: Vec<TenantStats>,
    /// Pages this node pushed to their new owners while draining, their
    /// record bytes, and pushes refused or failed.
    #[serde(default)]
    pub drain_pushed: u64,
    #[serde(default)]
    pub drain_pushed_bytes: u64,
    #[serde(default)]
    pub drain_push_failed: u64,
    /// A drain's pages not delivered because their owner could not be
    /// reached or stopped answering; pages left when the drain ended
    /// before their turn; owners that held pages of this node's.
    #[serde(default)]
    pub drain_push_owner_failed: u64,
    #[serde(default)]
    pub drain_push_left: u64,
    #[serde(default)]
    pub drain_push_owners: u64,
    /// `ack = "memory"` (docs/ARCHITECTURE.md, "Acknowledging puts"): puts
    /// answered once held in memory; bytes held and not yet on a disk, and
    /// their bound; puts answered on media because the bound was reached;
    /// pages written by the flushers, and pages they could not write (which
    /// then miss). All 0 with `ack = "media"`.
    #[serde(default)]
    pub ack_memory: bool,
    #[serde(default)]
    pub acked_in_memory: u64,
    #[serde(default)]
    pub unflushed_bytes: u64,
    #[serde(default)]
    pub unflushed_max_bytes: u64,
    #[serde(default)]
    pub ack_fallbacks: u64,
    #[serde(default)]
    pub flushed: u64,
    #[serde(default)]
    pub flush_failed: u64,
    /// Prefetch warming: pages an exist found only on disk and read into
    /// the memory tier; gets served from memory of such a page (once each);
    /// pages not warmed because the warming budget was spent.
    #[serde(default)]
    pub warmed: u64,
    #[serde(default)]
    pub warmed_read: u64,
    #[serde(default)]
    pub warm_skipped: u64,
}

/// One op's service-time histogram on a node: the same series `/metrics`
/// exports as `kvcellar_request_duration_seconds`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct OpLatency {
    pub op: String,
    pub count: u64,
    pub sum_seconds: f64,
    /// (upper bound in seconds, requests at or under it), ascending; the
    /// +Inf bucket is `count`.
    pub buckets: Vec<(f64, u64)>,
}

impl OpLatency {
    /// Requests and buckets since `earlier` (a sample of the same op).
    pub fn since(&self, earlier: Option<&OpLatency>) -> OpLatency {
        let Some(e) = earlier else { return self.clone() };
        OpLatency {
            op: self.op.clone(),
            count: self.count.saturating_sub(e.count),
            sum_seconds: (self.sum_seconds - e.sum_seconds).max(0.0),
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(i, &(le, c))| (le, c.saturating_sub(e.buckets.get(i).map_or(0, |b| b.1))))
                .collect(),
        }
    }

    /// The `q` quantile (0..=1) in seconds, interpolated inside its bucket
    /// as PromQL's `histogram_quantile` does; None without requests. Past
    /// the last bound: the last bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let (mut lo, mut below) = (0.0, 0u64);
        for &(le, c) in &self.buckets {
            if c as f64 >= rank {
                if c == below {
                    return Some(le);
                }
                return Some(lo + (le - lo) * (rank - below as f64) / (c - below) as f64);
            }
            lo = le;
            below = c;
        }
        Some(lo)
    }

    /// Reads one histogram from OpenMetrics/Prometheus text holding only it
    /// (its `_bucket`, `_sum` and `_count` lines; other lines are skipped).
    pub fn from_exposition(op: &str, text: &str) -> Option<OpLatency> {
        let mut l = OpLatency { op: op.to_string(), ..OpLatency::default() };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ')?;
            if let Some(at) = series.find("le=\"") {
                let le = &series[at + 4..];
                let le = &le[..le.find('"')?];
                if le != "+Inf" {
                    l.buckets.push((le.parse().ok()?, value.parse().ok()?));
                }
            } else if series.ends_with("_sum") {
                l.sum_seconds = value.parse().ok()?;
            } else if series.ends_with("_count") {
                l.count = value.parse().ok()?;
            }
        }
        Some(l)
    }
}

/// What one node did between two of its records: the counts and each op's
/// service-time window, from which every rate shown is computed (the
/// dashboard's samples and `kvctl top`'s rows, docs/METRICS.md). Intervals
/// of several nodes over the same time add up ([`Interval::add`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Interval {
    pub secs: f64,
    pub hits: u64,
    pub mem_hits: u64,
    pub disk_hits: u64,
    /// Gets answered: hits, misses and mismatches.
    pub gets: u64,
    /// Puts answered: stored, duplicates and refused.
    pub puts: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub evictions: u64,
    /// Each op's requests and histogram over the interval.
    pub ops: Vec<OpLatency>,
}

impl Interval {
    /// The interval from `prev` to `cur`, `secs` (at least 1 ms) apart.
    /// Counters that went back (a restarted node) count as zero.
    pub fn between(prev: &NodeStats, cur: &NodeStats, secs: f64) -> Interval {
        let d = |f: fn(&NodeStats) -> u64| f(cur).saturating_sub(f(prev));
        let hits = d(|s| s.hits);
        Interval {
            secs: secs.max(1e-3),
            hits,
            mem_hits: d(|s| s.mem_hits),
            disk_hits: d(|s| s.disk_hits),
            gets: hits + d(|s| s.misses) + d(|s| s.mismatches),
            puts: d(|s| s.puts) + d(|s| s.put_duplicates) + d(|s| s.put_rejected),
            bytes_read: d(|s| s.bytes_read),
            bytes_written: d(|s| s.bytes_written),
            evictions: d(|s| s.evictions),
            ops: cur.latency.iter().map(|l| l.since(prev.latency.iter().find(|p| p.op == l.op))).collect(),
        }
    }

    /// Adds another node's interval over the same time: counts and
    /// histograms sum (a histogram of another bucket layout, from another
    /// release, is left out of that op's sum).
    pub fn add(&mut self, o: &Interval) {
        self.secs = self.secs.max(o.secs);
        self.hits += o.hits;
        self.mem_hits += o.mem_hits;
        self.disk_hits += o.disk_hits;
        self.gets += o.gets;
        self.puts += o.puts;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.evictions += o.evictions;
        for w in &o.ops {
            match self.ops.iter_mut().find(|m| m.op == w.op) {
                None => self.ops.push(w.clone()),
                Some(m) if m.buckets.len() == w.buckets.len() => {
                    for (x, y) in m.buckets.iter_mut().zip(&w.buckets) {
                        x.1 += y.1;
                    }
                    m.count += w.count;
                    m.sum_seconds += w.sum_seconds;
                }
                Some(_) => {}
            }
        }
    }

    pub fn per_sec(&self, n: u64) -> f64 {
        n as f64 / self.secs
    }

    /// Requests of every op, per second.
    pub fn requests_per_sec(&self) -> f64 {
        self.per_sec(self.ops.iter().map(|o| o.count).sum())
    }

    /// A share of the gets (None without gets).
    fn share(&self, n: u64) -> Option<f64> {
        (self.gets > 0).then(|| n as f64 / self.gets as f64)
    }

    /// Share of gets served, in all, from the memory tier, from the disks.
    pub fn hit(&self) -> Option<f64> {
        self.share(self.hits)
    }

    pub fn memory_hit(&self) -> Option<f64> {
        self.share(self.mem_hits)
    }

    pub fn disk_hit(&self) -> Option<f64> {
        self.share(self.disk_hits)
    }

    /// One op's window (None: the node served none of it, ever).
    pub fn op(&self, name: &str) -> Option<&OpLatency> {
        self.ops.iter().find(|o| o.op == name)
    }
}

/// The read balance of a group: the busiest of `loads` (each node's gets
/// over the same interval) against their mean, and which it is (None when
/// there are none, or all are 0). 1.0 is an even spread; a node that alone
/// serves a group of N gives N. `kvctl top`, `kvctl replay` and the kv-mds
/// dashboard show it (docs/METRICS.md, "Read balance").
pub fn busiest_over_mean(loads: &[f64]) -> Option<(usize, f64)> {
    let sum: f64 = loads.iter().sum();
    if loads.is_empty() || sum <= 0.0 || !sum.is_finite() {
        return None;
    }
    let (at, max) = loads.iter().copied().enumerate().fold((0, f64::MIN), |b, (i, v)| if v > b.1 { (i, v) } else { b });
    Some((at, max * loads.len() as f64 / sum))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_balance_is_the_busiest_against_the_mean() {
        assert_eq!(busiest_over_mean(&[1.0, 1.0, 1.0]), Some((0, 1.0)));
        assert_eq!(busiest_over_mean(&[1.0, 3.0]), Some((1, 1.5)));
        assert_eq!(busiest_over_mean(&[0.0, 0.0, 5.0, 0.0]), Some((2, 4.0)));
        assert_eq!(busiest_over_mean(&[0.0, 0.0]), None);
        assert_eq!(busiest_over_mean(&[]), None);
    }

    fn rec(hits: u64, mem: u64, misses: u64, gets_done: u64) -> NodeStats {
        NodeStats {
            hits,
            mem_hits: mem,
            disk_hits: hits - mem,
            misses,
            bytes_read: hits * 100,
            latency: vec![OpLatency {
                op: "get".into(),
                count: gets_done,
                sum_seconds: gets_done as f64 * 1e-4,
                buckets: vec![(1e-4, gets_done), (1e-3, gets_done)],
            }],
            ..NodeStats::default()
        }
    }

    #[test]
    fn an_interval_gives_rates_and_tier_shares() {
        let iv = Interval::between(&rec(10, 4, 0, 10), &rec(40, 24, 10, 50), 2.0);
        assert_eq!((iv.hits, iv.mem_hits, iv.disk_hits, iv.gets), (30, 20, 10, 40));
        assert_eq!(iv.per_sec(iv.gets), 20.0);
        assert_eq!(iv.requests_per_sec(), 20.0);
        assert_eq!((iv.hit(), iv.memory_hit(), iv.disk_hit()), (Some(0.75), Some(0.5), Some(0.25)));
        assert_eq!(iv.op("get").map(|w| w.count), Some(40));
        assert_eq!(Interval::between(&rec(0, 0, 0, 0), &rec(0, 0, 0, 0), 1.0).hit(), None);
    }

    #[test]
    fn a_restarted_node_counts_zero_and_intervals_add() {
        let back = Interval::between(&rec(40, 24, 10, 50), &rec(5, 5, 0, 5), 1.0);
        assert_eq!((back.gets, back.hits, back.requests_per_sec()), (0, 0, 0.0), "counters that went back count zero");
        let mut sum = Interval::between(&rec(0, 0, 0, 0), &rec(10, 10, 0, 10), 1.0);
        sum.add(&Interval::between(&rec(0, 0, 0, 0), &rec(10, 0, 10, 20), 1.0));
        assert_eq!(
            (sum.hit(), sum.memory_hit(), sum.disk_hit()),
            (Some(20.0 / 30.0), Some(10.0 / 30.0), Some(10.0 / 30.0))
        );
        assert_eq!(sum.op("get").map(|w| (w.count, w.buckets[0].1)), Some((30, 30)));
    }
}

/// Most tenants a node's statistics and `/metrics` name one by one.
pub const MAX_TENANTS_SHOWN: usize = 64;

/// What one tenant holds at a node.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TenantStats {
    /// Its name from the node's credential table; `default` for the
    /// default tenant; `id-XXXXXXXX` for an id the table no longer names;
    /// `other` for those past [`MAX_TENANTS_SHOWN`].
    pub tenant: String,
    /// Bytes of its records on disk (extents), and its records.
    pub bytes: u64,
    pub objects: u64,
    /// Its records evicted for room since the disks opened.
    pub evictions: u64,
    /// Of those, the ones evicted for another tenant's put: capacity it
    /// borrowed beyond its quota taken back (without quotas, any other
    /// tenant's put).
    #[serde(default)]
    pub evicted_for_others: u64,
    /// Its share of the node in bytes (its quota); 0: none (it borrows
    /// what others leave).
    #[serde(default)]
    pub quota: u64,
    /// Its gets answered with a page, and as a miss, and its puts stored,
    /// since the node started.
    #[serde(default)]
    pub hits: u64,
    #[serde(default)]
    pub misses: u64,
    #[serde(default)]
    pub puts: u64,
}

impl TenantStats {
    /// Adds `o`'s figures (its name aside): a tenant over nodes, or the
    /// tenants summed as `other`.
    pub fn add(&mut self, o: &TenantStats) {
        self.bytes += o.bytes;
        self.objects += o.objects;
        self.evictions += o.evictions;
        self.evicted_for_others += o.evicted_for_others;
        self.quota += o.quota;
        self.hits += o.hits;
        self.misses += o.misses;
        self.puts += o.puts;
    }
}

/// One tenant over one interval: what it holds at the end of it and its
/// rates over it. Computed by [`tenant_intervals`] for the node's
/// dashboard (`/api/history`) and `kvctl top --tenants`; a group's total
/// per tenant is the sum over its nodes ([`TenantInterval::add`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TenantInterval {
    pub tenant: String,
    /// Its share in bytes (0: none), its bytes and records at the end.
    pub quota: u64,
    pub bytes: u64,
    pub objects: u64,
    /// Gets answered with a page and as a miss, puts stored, per second.
    pub hits: f64,
    pub misses: f64,
    pub puts: f64,
    /// Its records evicted per second, and of those the ones evicted for
    /// another tenant's put.
    pub evictions: f64,
    pub evicted_for_others: f64,
    /// Share of its gets answered with a page (None without gets).
    pub hit: Option<f64>,
}

impl TenantInterval {
    /// Adds another node's figures over the same time (rates and holdings
    /// sum; the hit rate is that of the sum).
    pub fn add(&mut self, o: &TenantInterval) {
        self.quota += o.quota;
        self.bytes += o.bytes;
        self.objects += o.objects;
        self.hits += o.hits;
        self.misses += o.misses;
        self.puts += o.puts;
        self.evictions += o.evictions;
        self.evicted_for_others += o.evicted_for_others;
        self.hit = hit_share(self.hits, self.misses);
    }
}

fn hit_share(hits: f64, misses: f64) -> Option<f64> {
    (hits + misses > 0.0).then(|| hits / (hits + misses))
}

/// Each tenant of `cur` over the `secs` since `prev`, in `cur`'s order.
/// A tenant absent from `prev` has holdings and no rates this once: its
/// counters may be older than the interval (it was summed as `other`, or
/// known by its id, in `prev`). Counters that went back (a restarted node,
/// `other` losing a tenant) count as zero.
pub fn tenant_intervals(prev: &[TenantStats], cur: &[TenantStats], secs: f64) -> Vec<TenantInterval> {
    let secs = secs.max(1e-3);
    cur.iter()
        .map(|c| {
            let p = prev.iter().find(|p| p.tenant == c.tenant);
            let rate = |f: fn(&TenantStats) -> u64| p.map_or(0.0, |p| f(c).saturating_sub(f(p)) as f64 / secs);
            let (hits, misses) = (rate(|s| s.hits), rate(|s| s.misses));
            TenantInterval {
                tenant: c.tenant.clone(),
                quota: c.quota,
                bytes: c.bytes,
                objects: c.objects,
                hits,
                misses,
                puts: rate(|s| s.puts),
                evictions: rate(|s| s.evictions),
                evicted_for_others: rate(|s| s.evicted_for_others),
                hit: hit_share(hits, misses),
            }
        })
        .collect()
}

/// Several nodes' tenants summed by name, in the order of first sight.
pub fn tenant_totals<'a>(nodes: impl IntoIterator<Item = &'a [TenantInterval]>) -> Vec<TenantInterval> {
    let mut out: Vec<TenantInterval> = Vec::new();
    for node in nodes {
        for t in node {
            match out.iter_mut().find(|o| o.tenant == t.tenant) {
                Some(o) => o.add(t),
                None => out.push(t.clone()),
            }
        }
    }
    out
}

#[cfg(test)]
mod tenant_tests {
    use super::*;

    fn t(name: &str, hits: u64, misses: u64, puts: u64, ev: u64, others: u64) -> TenantStats {
        TenantStats {
            tenant: name.into(),
            bytes: 100,
            objects: 2,
            quota: 1000,
            hits,
            misses,
            puts,
            evictions: ev,
            evicted_for_others: others,
        }
    }

    #[test]
    fn a_tenants_rates_and_the_groups_sum() {
        let a = tenant_intervals(&[t("a", 10, 0, 4, 0, 0)], &[t("a", 40, 10, 8, 6, 2), t("b", 4, 4, 0, 0, 0)], 2.0);
        assert_eq!(
            (a[0].hits, a[0].misses, a[0].puts, a[0].evictions, a[0].evicted_for_others),
            (15.0, 5.0, 2.0, 3.0, 1.0)
        );
        assert_eq!(a[0].hit, Some(0.75));
        // A tenant new since the last record: holdings, no rates yet.
        assert_eq!((a[1].hits, a[1].hit, a[1].objects), (0.0, None, 2));
        // A restarted node's counters went back: zero, not a huge rate.
        let back = tenant_intervals(&[t("a", 40, 10, 8, 6, 2)], &[t("a", 1, 0, 0, 0, 0)], 1.0);
        assert_eq!((back[0].hits, back[0].hit), (0.0, None));
        let other = tenant_intervals(&[t("a", 0, 0, 0, 0, 0)], &[t("a", 0, 20, 0, 0, 0)], 2.0);
        let sum = tenant_totals([&a[..], &other[..]]);
        assert_eq!(sum.len(), 2);
        assert_eq!(
            (sum[0].tenant.as_str(), sum[0].hits, sum[0].misses, sum[0].bytes, sum[0].quota),
            ("a", 15.0, 15.0, 200, 2000)
        );
        assert_eq!(sum[0].hit, Some(0.5));
    }
}
