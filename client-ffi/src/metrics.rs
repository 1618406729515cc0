//! Client counters and latency histograms, rendered as OpenMetrics text
//! (prometheus-client's encoder) by `kv_stats_snapshot`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kv_common::status::Status;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

const STATUSES: [Status; 13] = [
    Status::Ok,
    Status::Miss,
    Status::Mismatch,
    Status::Corrupt,
    Status::TooSmall,
    Status::Unavailable,
    Status::Timeout,
    Status::Rejected,
    Status::BadRequest,
    Status::Internal,
    Status::Einval,
    Status::Edenied,
    Status::Einternal,
];

fn slot(s: Status) -> usize {
    STATUSES.iter().position(|&x| x == s).unwrap_or(STATUSES.len() - 1)
}

const OPS: [&str; 4] = ["put", "get", "exist", "delete"];

/// Calls timed by the latency histograms (batches: the whole call).
pub const TIMED: [&str; 8] = ["put", "get", "exist", "delete", "batch_put", "batch_get", "batch_exist", "batch_delete"];

/// Latency of a call as the caller sees it: 16 µs to 8.4 s, doubling.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(16e-6, 2.0, 20)
}

type OpHistograms = Family<Vec<(&'static str, &'static str)>, Histogram, fn() -> Histogram>;

pub struct Metrics {
    by_status: [[AtomicU64; 13]; 4],
    latency: OpHistograms,
    timed: Vec<Histogram>,
    pub bytes_put: AtomicU64,
    pub bytes_got: AtomicU64,
    pub ring_rebuilds: AtomicU64,
    pub stale_retries: AtomicU64,
    pub peer_failures: AtomicU64,
    pub fast_unavailable: AtomicU64,
    /// Views received from kv-mds (answers to polls and long-polls).
    pub mds_views: AtomicU64,
    /// Discovery rounds in which no MDS replica answered.
    pub mds_errors: AtomicU64,
    /// 1 while the last discovery round got an answer.
    pub mds_up: AtomicU64,
    /// Times discovery moved to another kv-mds replica.
    pub mds_failovers: AtomicU64,
    /// Views taken with an epoch below the highest one taken before (only
    /// from a read of etcd: etcd restored from a backup or wiped).
    pub mds_epoch_regressions: AtomicU64,
    /// Handoff (docs/ARCHITECTURE.md, "Ring transitions").
    pub handoff: Arc<HandoffCounters>,
    /// Hot keys' reads spread over nodes (docs/ARCHITECTURE.md, "Hot keys").
    pub hot: Arc<HotCounters>,
}

/// What spreading hot keys' reads did.
#[derive(Default)]
pub struct HotCounters {
    /// Keys this handle holds hot now.
    pub keys: AtomicU64,
    /// Reads of hot keys sent to another node than the owner, served there.
    pub copy_hits: AtomicU64,
    /// Such reads asked at the owner after all: a miss there (its copy not
    /// made yet, or evicted), or a failure (the node is then skipped for
    /// spread reads for the peer cool-down).
    pub fallbacks: AtomicU64,
    /// Copies written to a node that missed a hot key (fills): stored,
    /// refused (the key was deleted meanwhile), failed.
    pub fills_stored: AtomicU64,
    pub fills_refused: AtomicU64,
    pub fills_failed: AtomicU64,
}

/// What the handoff did: asks at previous owners and background copies.
#[derive(Default)]
pub struct HandoffCounters {
    /// Keys asked at a previous owner after a miss at their owner.
    pub asks: AtomicU64,
    /// Keys found there (served, or counted as hits by exist).
    pub hits: AtomicU64,
    /// Asks that failed (no answer in time, refused connection): that owner
    /// is skipped for the rest of its window.
    pub failures: AtomicU64,
    /// Background copies to the current owner: stored, refused by it
    /// (REJECTED: the key was deleted meanwhile, or the owner is draining
    /// or full), failed.
    pub copies_stored: AtomicU64,
    pub copies_refused: AtomicU64,
    pub copies_failed: AtomicU64,
    /// Payload bytes of copies stored.
    pub copy_bytes: AtomicU64,
    /// Copies not made because the handle's budget was in flight.
    pub budget_drops: AtomicU64,
    /// Copies given up unsent: older than half the handoff window by the
    /// time they would have been sent (docs/ARCHITECTURE.md, "Ring
    /// transitions").
    pub copies_expired: AtomicU64,
    /// Bytes of copies in flight now.
    pub inflight_bytes: AtomicU64,
    /// Previous member sets held now.
    pub sets: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        let latency: OpHistograms = Family::new_with_constructor(|| Histogram::new(latency_buckets()));
        let timed = TIMED.iter().map(|op| latency.get_or_create(&vec![("op", *op)]).clone()).collect();
        Metrics {
            by_status: Default::default(),
            latency,
            timed,
            bytes_put: AtomicU64::new(0),
            bytes_got: AtomicU64::new(0),
            ring_rebuilds: AtomicU64::new(0),
            stale_retries: AtomicU64::new(0),
            peer_failures: AtomicU64::new(0),
            fast_unavailable: AtomicU64::new(0),
            mds_views: AtomicU64::new(0),
            mds_errors: AtomicU64::new(0),
            mds_up: AtomicU64::new(0),
            mds_failovers: AtomicU64::new(0),
            mds_epoch_regressions: AtomicU64::new(0),
            handoff: Arc::default(),
            hot: Arc::default(),
        }
    }
}

/// Per-peer figures for a snapshot.
pub struct PeerSnapshot {
    pub id: String,
    pub addr: String,
    pub up: bool,
    pub idle_conns: u64,
    pub opened: u64,
    pub moved: u64,
    pub failures: u64,
    pub went_down: u64,
    pub came_back: u64,
}

impl Metrics {
    fn count(&self, op: usize, s: Status) {
        self.by_status[op][slot(s)].fetch_add(1, Ordering::Relaxed);
    }

    /// Records the time of a call that started at `t0` (`op` one of [`TIMED`]).
    pub fn timed(&self, op: &str, t0: Instant) {
        if let Some(i) = TIMED.iter().position(|&o| o == op) {
            self.timed[i].observe(t0.elapsed().as_secs_f64());
        }
    }

    pub fn count_put(&self, s: Status, bytes: u64) -> Status {
        self.count(0, s);
        if s == Status::Ok {
            self.bytes_put.fetch_add(bytes, Ordering::Relaxed);
        }
        s
    }

    /// Counts a get; returns (status, needed) for the caller.
    pub fn count_get(&self, s: Status, bytes: u64, needed: usize) -> (Status, usize) {
        self.count(1, s);
        self.bytes_got.fetch_add(bytes, Ordering::Relaxed);
        (s, needed)
    }

    pub fn count_exist(&self, s: Status, _n: u64) -> Status {
        self.count(2, s);
        s
    }

    pub fn count_delete(&self, s: Status) -> Status {
        self.count(3, s);
        s
    }

    /// How many `op` ("put", "get", "exist", "delete") ended with `s`.
    pub fn get_count(&self, op: &str, s: Status) -> u64 {
        let i = OPS.iter().position(|&o| o == op).unwrap_or(0);
        self.by_status[i][slot(s)].load(Ordering::Relaxed)
    }

    /// The whole snapshot as OpenMetrics text.
    pub fn render(
        &self,
        epoch: u64,
        last_error: Option<String>,
        peers: Vec<PeerSnapshot>,
        rdma: &kv_rdma::Counters,
    ) -> String {
        let mut r = Registry::with_prefix("kvclient");
        r.register(
            "op_duration_seconds",
            "Time of a call as the caller sees it, by op (batches: the whole call)",
            self.latency.clone(),
        );
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let by_status = OPS
            .iter()
            .enumerate()
            .flat_map(|(i, op)| {
                STATUSES.iter().enumerate().filter_map(move |(j, s)| {
                    let v = ld(&self.by_status[i][j]);
                    (v > 0 || *s == Status::Ok)
                        .then(|| (vec![("op", op.to_string()), ("status", s.name().to_string())], v))
                })
            })
            .collect();
        let mut fams = vec![
            Fam::counter("ops", "Operations by outcome (status name)", by_status),
            Fam::counter("put_bytes", "Payload bytes stored", vec![(vec![], ld(&self.bytes_put))]),
            Fam::counter("get_bytes", "Payload bytes read into caller buffers", vec![(vec![], ld(&self.bytes_got))]),
            Fam::counter(
                "ring_rebuilds",
                "Times the ring was rebuilt for a new member set",
                vec![(vec![], ld(&self.ring_rebuilds))],
            ),
            Fam::counter(
                "stale_retries",
                "Requests retried once on a fresh connection",
                vec![(vec![], ld(&self.stale_retries))],
            ),
            Fam::counter(
                "peer_failures",
                "I/O failures that started a peer cool-down",
                vec![(vec![], ld(&self.peer_failures))],
            ),
            Fam::counter(
                "fast_unavailable",
                "Requests answered unavailable at once (peer cooling down)",
                vec![(vec![], ld(&self.fast_unavailable))],
            ),
            Fam::counter("mds_views", "Views received from kv-mds (discovery)", vec![(vec![], ld(&self.mds_views))]),
            Fam::counter(
                "mds_errors",
                "Discovery rounds in which no kv-mds replica answered",
                vec![(vec![], ld(&self.mds_errors))],
            ),
            Fam::counter(
                "mds_failovers",
                "Times discovery moved on to another kv-mds replica",
                vec![(vec![], ld(&self.mds_failovers))],
            ),
            Fam::counter(
                "mds_epoch_regressions",
                "Views from kv-mds taken with an epoch below the highest taken before (etcd went back)",
                vec![(vec![], ld(&self.mds_epoch_regressions))],
            ),
            Fam::gauge(
                "mds_up",
                "1 while the last discovery round got an answer from kv-mds",
                vec![(vec![], ld(&self.mds_up))],
            ),
            Fam::gauge("ring_epoch", "Epoch of the ring in use", vec![(vec![], epoch)]),
            Fam::gauge(
                "handoff_sets",
                "Previous member sets held for the handoff",
                vec![(vec![], ld(&self.handoff.sets))],
            ),
            Fam::counter(
                "handoff_asks",
                "Keys asked at a previous owner after a miss at their owner",
                vec![(vec![], ld(&self.handoff.asks))],
            ),
            Fam::counter("handoff_hits", "Keys found at a previous owner", vec![(vec![], ld(&self.handoff.hits))]),
            Fam::counter(
                "handoff_failures",
                "Asks at a previous owner that failed (that owner is skipped for the rest of its window)",
                vec![(vec![], ld(&self.handoff.failures))],
            ),
            Fam::counter(
                "handoff_copies",
                "Background copies of pages found at a previous owner to their owner, by result",
                vec![
                    (vec![("result", "stored".to_string())], ld(&self.handoff.copies_stored)),
                    (vec![("result", "refused".to_string())], ld(&self.handoff.copies_refused)),
                    (vec![("result", "failed".to_string())], ld(&self.handoff.copies_failed)),
                ],
            ),
            Fam::counter(
                "handoff_copy_bytes",
                "Payload bytes of background copies stored",
                vec![(vec![], ld(&self.handoff.copy_bytes))],
            ),
            Fam::counter(
                "handoff_budget_drops",
                "Background copies not made: the handle's copy budget was in flight",
                vec![(vec![], ld(&self.handoff.budget_drops))],
            ),
            Fam::counter(
                "handoff_copies_expired",
                "Background copies given up unsent: older than half the handoff window when their turn came",
                vec![(vec![], ld(&self.handoff.copies_expired))],
            ),
            Fam::gauge("hot_keys", "Keys this handle spreads the reads of now", vec![(vec![], ld(&self.hot.keys))]),
            Fam::counter(
                "hot_spread_reads",
                "Reads of hot keys sent to another node than their owner, by outcome",
                vec![
                    (vec![("result", "hit".to_string())], ld(&self.hot.copy_hits)),
                    (vec![("result", "fallback".to_string())], ld(&self.hot.fallbacks)),
                ],
            ),
            Fam::counter(
                "hot_fills",
                "Copies of hot pages written to a node that missed them, by result",
                vec![
                    (vec![("result", "stored".to_string())], ld(&self.hot.fills_stored)),
                    (vec![("result", "refused".to_string())], ld(&self.hot.fills_refused)),
                    (vec![("result", "failed".to_string())], ld(&self.hot.fills_failed)),
                ],
            ),
        ];
        fams.extend(rdma.families().into_iter().map(|f| Fam {
            name: f.name,
            help: f.help,
            kind: if f.counter { MetricType::Counter } else { MetricType::Gauge },
            series: f.series,
        }));
        if let Some(e) = last_error {
            fams.push(Fam::gauge("mds_last_error_info", "The last discovery failure", vec![(vec![("error", e)], 1)]));
        }
        let peer = |p: &PeerSnapshot| vec![("peer", p.id.clone())];
        fams.push(Fam::gauge(
            "peer_up",
            "0 while a peer is in its cool-down",
            peers.iter().map(|p| (vec![("peer", p.id.clone()), ("addr", p.addr.clone())], u64::from(p.up))).collect(),
        ));
        fams.push(Fam::gauge(
            "peer_idle_conns",
            "Pooled idle connections",
            peers.iter().map(|p| (peer(p), p.idle_conns)).collect(),
        ));
        fams.push(Fam::counter(
            "peer_connections_opened",
            "Connections opened, per peer",
            peers.iter().map(|p| (peer(p), p.opened)).collect(),
        ));
        fams.push(Fam::counter(
            "peer_connections_moved",
            "Idle connections one request path took from the other, per peer",
            peers.iter().map(|p| (peer(p), p.moved)).collect(),
        ));
        fams.push(Fam::counter(
            "peer_io_failures",
            "I/O failures, per peer",
            peers.iter().map(|p| (peer(p), p.failures)).collect(),
        ));
        fams.push(Fam::counter(
            "peer_state_changes",
            "A peer going into its cool-down (to=down) and answering again after one (to=up)",
            peers
                .iter()
                .flat_map(|p| {
                    [
                        (vec![("peer", p.id.clone()), ("to", "down".to_string())], p.went_down),
                        (vec![("peer", p.id.clone()), ("to", "up".to_string())], p.came_back),
                    ]
                })
                .collect(),
        ));
        r.register_collector(Box::new(Fams(fams)));
        let mut out = String::with_capacity(8 << 10);
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

type Series = Vec<(Vec<(&'static str, String)>, u64)>;

/// One metric family of a snapshot, as values read at that moment.
#[derive(Debug)]
struct Fam {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    series: Series,
}

impl Fam {
    fn counter(name: &'static str, help: &'static str, series: Series) -> Fam {
        Fam { name, help, kind: MetricType::Counter, series }
    }
    fn gauge(name: &'static str, help: &'static str, series: Series) -> Fam {
        Fam { name, help, kind: MetricType::Gauge, series }
    }
}

#[derive(Debug)]
struct Fams(Vec<Fam>);

impl Collector for Fams {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let mut m = e.encode_descriptor(f.name, f.help, None, f.kind)?;
            if let [(labels, v)] = f.series.as_slice() {
                if labels.is_empty() {
                    match f.kind {
                        MetricType::Counter => ConstCounter::new(*v).encode(m)?,
                        _ => ConstGauge::new(*v).encode(m)?,
                    }
                    continue;
                }
            }
            for (labels, v) in &f.series {
                match f.kind {
                    MetricType::Counter => ConstCounter::new(*v).encode(m.encode_family(labels)?)?,
                    _ => ConstGauge::new(*v).encode(m.encode_family(labels)?)?,
                }
            }
        }
        Ok(())
    }
}
