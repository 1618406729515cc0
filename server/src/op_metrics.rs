//! The node's request counters and service-time histograms, by op and wire
//! status: live prometheus-client metrics the connection tasks update
//! ([`OpMetrics::record`]), exported on `/metrics` (crate::metrics) and read
//! back as latency records for STATS and the dashboard.

use std::sync::OnceLock;
use std::time::Duration;

use kv_common::stats::OpLatency;
use kv_common::status::Status;
use kv_common::wire::Op;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The ops a node serves, in wire order (index = op number - 1).
const OPS: [(Op, &str); 11] = [
    (Op::Put, "put"),
    (Op::Get, "get"),
    (Op::Exist, "exist"),
    (Op::BatchExist, "batch_exist"),
    (Op::Delete, "delete"),
    (Op::Stats, "stats"),
    (Op::Ping, "ping"),
    (Op::RdmaConnect, "rdma_connect"),
    (Op::BatchGet, "batch_get"),
    (Op::BatchPut, "batch_put"),
    (Op::BatchDelete, "batch_delete"),
];

/// Wire statuses 0..=9 (kv_common::status).
const WIRE_STATUSES: u8 = 10;

type Labels = Vec<(&'static str, &'static str)>;

/// Histogram bounds of service time: 8 µs to 8.4 s, doubling (21 buckets
/// and +Inf): a memory-tier get lands in the first few, a 4 MiB put with
/// its flush in the middle, a stalled disk at the top.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(8e-6, 2.0, 21)
}

/// Per-op request counters (by wire status) and service-time histograms.
/// Each series is made at its first use (the main ops' `ok` counters and
/// histograms at start, so dashboards have them from the first scrape);
/// recording is then an atomic add and, for the histogram, one short lock
/// per op's histogram, shared by every worker thread (cost measured in
/// docs/BENCHMARKS.md).
pub struct OpMetrics {
    pub(crate) requests: Family<Labels, Counter>,
    pub(crate) latency: Family<Labels, Histogram, fn() -> Histogram>,
    counters: [[OnceLock<Counter>; WIRE_STATUSES as usize]; OPS.len()],
    hists: [OnceLock<Histogram>; OPS.len()],
    /// False turns the histograms off (`KVCELLAR_LATENCY_HISTOGRAMS=0`; for
    /// measuring their cost).
    histograms: bool,
}

impl Default for OpMetrics {
    fn default() -> Self {
        OpMetrics::new(std::env::var("KVCELLAR_LATENCY_HISTOGRAMS").map_or(true, |v| v != "0"))
    }
}

impl OpMetrics {
    pub fn new(histograms: bool) -> OpMetrics {
        let m = OpMetrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            counters: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
            hists: std::array::from_fn(|_| OnceLock::new()),
            histograms,
        };
        for i in 0..5 {
            m.counter(i, Status::Ok.to_wire());
            if histograms {
                m.hist(i);
            }
        }
        m
    }

    fn counter(&self, i: usize, status: u8) -> &Counter {
        self.counters[i][status as usize].get_or_init(|| {
            self.requests.get_or_create(&vec![("op", OPS[i].1), ("status", Status::from_wire(status).name())]).clone()
        })
    }

    fn hist(&self, i: usize) -> &Histogram {
        self.hists[i].get_or_init(|| self.latency.get_or_create(&vec![("op", OPS[i].1)]).clone())
    }

    /// Counts one answered request and its service time (from the whole
    /// request in hand to its answer queued for writing).
    pub fn record(&self, op: Op, status: u8, took: Duration) {
        let i = (op as usize).wrapping_sub(1);
        if i >= OPS.len() || status >= WIRE_STATUSES {
            return;
        }
        self.counter(i, status).inc();
        if self.histograms {
            self.hist(i).observe(took.as_secs_f64());
        }
    }

    /// Every op's histogram as [`OpLatency`] records (the same series
    /// `/metrics` exports), for STATS, the dashboard and `kvctl top`.
    /// Ops never asked are left out.
    pub fn latencies(&self) -> Vec<OpLatency> {
        OPS.iter()
            .zip(&self.hists)
            .filter_map(|(&(_, op), hist)| {
                let hist = hist.get()?;
                // prometheus-client keeps its buckets private: read them
                // back from its own exposition of this one histogram.
                let mut reg = Registry::default();
                reg.register("h", "", hist.clone());
                let mut text = String::new();
                prometheus_client::encoding::text::encode_registry(&mut text, &reg).ok()?;
                OpLatency::from_exposition(op, &text).filter(|l| l.count > 0)
            })
            .collect()
    }
}
