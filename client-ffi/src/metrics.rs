//! Client counters, rendered as Prometheus text by `kv_stats_snapshot`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::status::Status;

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

#[derive(Default)]
pub struct Metrics {
    by_status: [[AtomicU64; 13]; 4],
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
}

impl Metrics {
    fn count(&self, op: usize, s: Status) {
        self.by_status[op][slot(s)].fetch_add(1, Ordering::Relaxed);
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

    pub fn render(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP kvclient_ops_total Operations by outcome (status name).");
        let _ = writeln!(out, "# TYPE kvclient_ops_total counter");
        for (i, op) in OPS.iter().enumerate() {
            for (j, s) in STATUSES.iter().enumerate() {
                let v = self.by_status[i][j].load(Ordering::Relaxed);
                if v > 0 || *s == Status::Ok {
                    let _ = writeln!(out, "kvclient_ops_total{{op=\"{op}\",status=\"{}\"}} {v}", s.name());
                }
            }
        }
        let mut one = |name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP kvclient_{name} {help}\n# TYPE kvclient_{name} {kind}");
            let _ = writeln!(out, "kvclient_{name} {}", v.load(Ordering::Relaxed));
        };
        one("put_bytes_total", "counter", "Payload bytes stored.", &self.bytes_put);
        one("get_bytes_total", "counter", "Payload bytes read into caller buffers.", &self.bytes_got);
        one("ring_rebuilds_total", "counter", "Times the ring was rebuilt for a new member set.", &self.ring_rebuilds);
        one("stale_retries_total", "counter", "Requests retried once on a fresh connection.", &self.stale_retries);
        one("peer_failures_total", "counter", "I/O failures that started a peer cool-down.", &self.peer_failures);
        one(
            "fast_unavailable_total",
            "counter",
            "Requests answered unavailable at once (peer cooling down).",
            &self.fast_unavailable,
        );
        one("mds_views_total", "counter", "Views received from kv-mds (discovery).", &self.mds_views);
        one("mds_errors_total", "counter", "Discovery rounds in which no kv-mds replica answered.", &self.mds_errors);
        one("mds_up", "gauge", "1 while the last discovery round got an answer from kv-mds.", &self.mds_up);
    }
}
