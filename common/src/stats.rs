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
    #[serde(default)]
    pub tombstones: u64,
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
