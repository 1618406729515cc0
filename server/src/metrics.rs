//! The node's HTTP endpoint on `--metrics-listen`, served by hyper:
//! `GET /metrics` (OpenMetrics text from prometheus-client), the probes
//! `GET /healthz`, `/readyz` and `/livez` (docs/METRICS.md), `GET /` (the
//! dashboard, one self-contained page) and `GET /api/stats` (the page's
//! data: the STATS record as JSON).
//!
//! Request counters and service-time histograms are live prometheus-client
//! metrics updated by the connection tasks ([`crate::op_metrics::OpMetrics`]); everything the
//! store already counts (hits, bytes, disks, ...) is read at scrape time by
//! a [`Collector`] from one [`NodeStats`] record, so the exposition and the
//! STATS op never disagree.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use kv_common::stats::{Interval, NodeStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::state::Shared;

/// The metrics address to register with the group: `listen` itself, or its
/// port on the advertised host when it listens on every address.
pub fn advertised(listen: std::net::SocketAddr, advertise: &str) -> String {
    if listen.ip().is_unspecified() {
        let host = advertise.rsplit_once(':').map_or(advertise, |(h, _)| h);
        format!("{host}:{}", listen.port())
    } else {
        listen.to_string()
    }
}

/// Labels every series of this node carries: `node` and `group` when the
/// node joined a group.
pub fn const_labels(node: Option<&str>, group: Option<&str>) -> Vec<(String, String)> {
    let mut l = Vec::new();
    if let Some(n) = node {
        l.push(("node".to_string(), n.to_string()));
    }
    if let Some(g) = group {
        l.push(("group".to_string(), g.to_string()));
    }
    l
}

/// Builds the node's registry: the live per-op metrics and the collector
/// that reads the store's counters at each scrape.
pub fn registry(shared: &Arc<Shared>, labels: Vec<(String, String)>) -> Registry {
    let labels = labels.into_iter().map(|(k, v)| (k.into(), v.into()));
    let mut r = Registry::with_prefix_and_labels("kvcellar", labels);
    r.register("requests", "Requests answered, by op and wire status", shared.ops.requests.clone());
    r.register(
        "request_duration_seconds",
        "Service time of a request on the node: from the whole request in hand to its answer queued for writing",
        shared.ops.latency.clone(),
    );
    r.register_collector(Box::new(StatsCollector { shared: shared.clone() }));
    r
}

struct StatsCollector {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StatsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsCollector")
    }
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

/// One metric with a series per label set.
fn family<L: prometheus_client::encoding::EncodeLabelSet, M: EncodeMetric>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    series: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in series {
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for StatsCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = self.shared.stats();
        let rec = self.shared.recovery;
        family(
            &mut e,
            "build_info",
            "Build of this node (value 1): version and the transports it was built with",
            MetricType::Gauge,
            [(
                [("version", env!("CARGO_PKG_VERSION")), ("transport", self.shared.fabric.built())],
                ConstGauge::new(1u64),
            )],
        )?;
        gauge(&mut e, "uptime_seconds", "Seconds since the node started", s.uptime_secs)?;
        self.shared.fabric.encode_metrics(&mut e)?;
        family(
            &mut e,
            "hits",
            "Gets served, by tier (memory, disk)",
            MetricType::Counter,
            [
                ([("tier", "memory")], ConstCounter::new(s.mem_hits)),
                ([("tier", "disk")], ConstCounter::new(s.disk_hits)),
            ],
        )?;
        family(
            &mut e,
            "misses",
            "Gets not served, by reason: absent (not stored), mismatch (stored with another geometry), corrupt (found damaged and dropped)",
            MetricType::Counter,
            [
                ([("reason", "absent")], ConstCounter::new(s.misses_absent)),
                ([("reason", "mismatch")], ConstCounter::new(s.mismatches)),
                ([("reason", "corrupt")], ConstCounter::new(s.misses_corrupt)),
            ],
        )?;
        counter(&mut e, "puts", "Records stored by put", s.puts)?;
        counter(
            &mut e,
            "put_duplicates",
            "Puts of keys already stored (answered ok, nothing written)",
            s.put_duplicates,
        )?;
        counter(
            &mut e,
            "put_rejected",
            "Puts refused: disk full, record too large, no disk in service",
            s.put_rejected,
        )?;
        counter(&mut e, "read_bytes", "Record bytes served (bytes out)", s.bytes_read)?;
        counter(&mut e, "written_bytes", "Record bytes stored (bytes in)", s.bytes_written)?;
        counter(&mut e, "evictions", "Records evicted under the byte cap", s.evictions)?;
        counter(
            &mut e,
            "corrupt_dropped",
            "Damaged records found (on a read or by the scrub) and dropped",
            s.corrupt_dropped,
        )?;
        gauge(&mut e, "objects", "Records stored on disk", s.objects)?;
        family(
            &mut e,
            "tier_used_bytes",
            "Bytes held, by tier",
            MetricType::Gauge,
            [
                ([("tier", "memory")], ConstGauge::new(s.mem_used_bytes)),
                ([("tier", "disk")], ConstGauge::new(s.used_bytes)),
            ],
        )?;
        family(
            &mut e,
            "tier_capacity_bytes",
            "Byte cap, by tier (memory 0: the tier is off)",
            MetricType::Gauge,
            [
                ([("tier", "memory")], ConstGauge::new(s.mem_capacity_bytes)),
                ([("tier", "disk")], ConstGauge::new(s.capacity_bytes)),
            ],
        )?;
        let per_disk = |f: fn(&kv_common::stats::DiskStats) -> u64| {
            s.disks.iter().map(move |d| ([("disk", d.id.clone()), ("dir", d.dir.clone())], ConstGauge::new(f(d))))
        };
        family(&mut e, "disk_used_bytes", "Bytes of records, per disk", MetricType::Gauge, per_disk(|d| d.used_bytes))?;
        family(&mut e, "disk_capacity_bytes", "Byte cap, per disk", MetricType::Gauge, per_disk(|d| d.capacity_bytes))?;
        family(&mut e, "disk_objects", "Records, per disk", MetricType::Gauge, per_disk(|d| d.objects))?;
        family(
            &mut e,
            "disk_failed",
            "1 while a disk is out of service",
            MetricType::Gauge,
            per_disk(|d| u64::from(d.failed)),
        )?;
        family(
            &mut e,
            "disk_evictions",
            "Evictions, per disk",
            MetricType::Counter,
            s.disks.iter().map(|d| ([("disk", d.id.clone()), ("dir", d.dir.clone())], ConstCounter::new(d.evictions))),
        )?;
        let per_tenant = |f: fn(&kv_common::stats::TenantStats) -> u64| {
            s.tenants.iter().map(move |t| ([("tenant", t.tenant.clone())], ConstGauge::new(f(t))))
        };
        let tenant_counter = |f: fn(&kv_common::stats::TenantStats) -> u64| {
            s.tenants.iter().map(move |t| ([("tenant", t.tenant.clone())], ConstCounter::new(f(t))))
        };
        family(
            &mut e,
            "tenant_bytes",
            "Bytes of records on disk, per tenant",
            MetricType::Gauge,
            per_tenant(|t| t.bytes),
        )?;
        family(&mut e, "tenant_objects", "Records on disk, per tenant", MetricType::Gauge, per_tenant(|t| t.objects))?;
        family(
            &mut e,
            "tenant_evictions",
            "A tenant's records evicted for room since the disks opened",
            MetricType::Counter,
            tenant_counter(|t| t.evictions),
        )?;
        family(
            &mut e,
            "tenant_evictions_for_others",
            "A tenant's records evicted for another tenant's put (capacity borrowed beyond its quota taken back)",
            MetricType::Counter,
            tenant_counter(|t| t.evicted_for_others),
        )?;
        family(
            &mut e,
            "tenant_quota_bytes",
            "A tenant's share of the node in bytes (0: no quota)",
            MetricType::Gauge,
            per_tenant(|t| t.quota),
        )?;
        family(
            &mut e,
            "tenant_hits",
            "A tenant's gets answered with a page",
            MetricType::Counter,
            tenant_counter(|t| t.hits),
        )?;
        family(
            &mut e,
            "tenant_misses",
            "A tenant's gets answered as a miss",
            MetricType::Counter,
            tenant_counter(|t| t.misses),
        )?;
        family(&mut e, "tenant_puts", "A tenant's puts stored", MetricType::Counter, tenant_counter(|t| t.puts))?;
        gauge(&mut e, "failed_disks", "Disks out of service", s.failed_disks)?;
        gauge(
            &mut e,
            "unverified_records",
            "Records recovered after a crash whose payload awaits its check",
            s.unverified,
        )?;
        gauge(&mut e, "connections", "Client connections open", s.connections)?;
        counter(
            &mut e,
            "denied_connections",
            "Connections refused at the hello for a missing or wrong auth token",
            s.denied_connections,
        )?;
        counter(
            &mut e,
            "refused_connections",
            "Connections refused at the connection cap (--max-conns)",
            s.refused_connections,
        )?;
        counter(
            &mut e,
            "connections_closed_before_hello",
            "Connections closed before their hello: none in 5 s, or the oldest of too many waiting",
            s.closed_before_hello,
        )?;
        counter(
            &mut e,
            "v1_connections",
            "Connections accepted in protocol v1 (clients of the previous release)",
            s.v1_connections,
        )?;
        gauge(
            &mut e,
            "draining",
            "1 while the node drains after a SIGTERM (left its group, takes no puts)",
            u64::from(s.draining),
        )?;
        counter(
            &mut e,
            "handoff_asks",
            "Keys asked here by clients after a miss at their owner (handoff)",
            s.handoff_asks,
        )?;
        counter(&mut e, "handoff_hits", "Handoff asks found here", s.handoff_hits)?;
        counter(
            &mut e,
            "handoff_copies",
            "Handoff copies stored here (pages a client found at a previous owner)",
            s.handoff_copies,
        )?;
        counter(&mut e, "handoff_copy_bytes", "Payload bytes of handoff copies stored here", s.handoff_copy_bytes)?;
        counter(
            &mut e,
            "handoff_refused",
            "Handoff copies refused: the key was deleted within the handoff window",
            s.handoff_refused,
        )?;
        counter(
            &mut e,
            "handoff_copies_too_old",
            "Handoff copies refused: read longer ago than half the handoff window",
            s.handoff_too_old,
        )?;
        gauge(&mut e, "tombstones", "Keys deleted within the handoff window (their copies are refused)", s.tombstones)?;
        gauge(&mut e, "hot_keys", "Keys marked hot now: read past the hot threshold in a window", s.hot_keys)?;
        counter(&mut e, "hot_reads", "Reads served of keys marked hot", s.hot_reads)?;
        counter(&mut e, "hot_marked", "Keys that turned hot", s.hot_marked)?;
        counter(&mut e, "hot_fills", "Copies of hot pages stored here to serve a share of their reads", s.hot_fills)?;
        gauge(
            &mut e,
            "hot_copies_held",
            "Copies of hot pages filled here since the node started and still held",
            s.hot_copies_held,
        )?;
        counter(
            &mut e,
            "hot_refused",
            "Reads of keys past the hot threshold not marked for the bound on the hot set",
            s.hot_refused,
        )?;
        gauge(&mut e, "hot_threshold", "Reads of one key in a window that make it hot now", s.hot_threshold)?;
        counter(&mut e, "drain_pushed", "Pages pushed to their new owners while draining", s.drain_pushed)?;
        counter(
            &mut e,
            "drain_pushed_bytes",
            "Record bytes pushed to new owners while draining",
            s.drain_pushed_bytes,
        )?;
        counter(&mut e, "drain_push_failed", "Pages a draining node's new owners refused", s.drain_push_failed)?;
        counter(
            &mut e,
            "drain_push_owner_failed",
            "Pages a draining node could not deliver: their owner was unreachable or stopped answering",
            s.drain_push_owner_failed,
        )?;
        gauge(&mut e, "drain_push_left", "Pages a drain left unpushed when it ended", s.drain_push_left)?;
        gauge(&mut e, "drain_push_owners", "Owners a draining node pushes its pages to", s.drain_push_owners)?;
        counter(&mut e, "acked_in_memory", "Puts answered once held in memory (--ack memory)", s.acked_in_memory)?;
        gauge(&mut e, "unflushed_bytes", "Bytes acknowledged from memory and not yet on a disk", s.unflushed_bytes)?;
        gauge(
            &mut e,
            "unflushed_max_bytes",
            "Bound on unflushed bytes (--ack-memory-max); 0 with --ack media",
            s.unflushed_max_bytes,
        )?;
        counter(
            &mut e,
            "ack_fallbacks",
            "Puts answered on media because the unflushed bytes were at their bound",
            s.ack_fallbacks,
        )?;
        counter(&mut e, "flushed", "Pages acknowledged from memory and then written to their disk", s.flushed)?;
        counter(
            &mut e,
            "flush_failed",
            "Pages acknowledged from memory that could not be written (they now miss)",
            s.flush_failed,
        )?;
        counter(&mut e, "warmed", "Pages an exist found only on disk, read into the memory tier", s.warmed)?;
        counter(&mut e, "warmed_read", "Gets served from memory of a warmed page (once each)", s.warmed_read)?;
        counter(&mut e, "warm_skipped", "Pages not warmed: the warming budget was spent", s.warm_skipped)?;
        gauge(&mut e, "recovery_records", "Records recovered from the disks' journals at start", rec.records)?;
        gauge(
            &mut e,
            "recovery_reclaimed_records",
            "Records dropped by recovery at start (damaged or overlapping)",
            rec.reclaimed,
        )?;
        ConstGauge::new(rec.seconds).encode(e.encode_descriptor(
            "recovery_seconds",
            "Time the disks took to open and recover at start",
            None,
            MetricType::Gauge,
        )?)?;
        Ok(())
    }
}

type Reply = Response<Full<Bytes>>;

fn reply(code: StatusCode, ctype: &'static str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(ctype));
    r.headers_mut().insert(hyper::header::CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-store"));
    // The MDS dashboard (another origin) reads /api/stats and /healthz;
    // nothing here needs the token (the metrics port stays inside the cluster network: docs/DEPLOY.md).
    r.headers_mut().insert(hyper::header::ACCESS_CONTROL_ALLOW_ORIGIN, hyper::header::HeaderValue::from_static("*"));
    r
}

/// Why the node is not serving, if it is not: every disk out of service.
pub fn unhealthy(s: &NodeStats) -> Option<&'static str> {
    (s.failed_disks as usize == s.disks.len()).then_some("no disk in service")
}

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    registry: Arc<Registry>,
    history: Arc<Mutex<History>>,
) -> Result<Reply, Infallible> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return Ok(reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "only GET\n"));
    }
    let path = req.uri().path().to_string();
    // Gathering stats takes each disk's index lock: off the reactor.
    let r = match path.as_str() {
        "/metrics" => tokio::task::spawn_blocking(move || {
            let mut text = String::with_capacity(16 << 10);
            match prometheus_client::encoding::text::encode(&mut text, &registry) {
                Ok(()) => reply(StatusCode::OK, OPENMETRICS, text),
                Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "encoding failed\n"),
            }
        })
        .await
        .ok(),
        // Live while it serves; a draining node is live (it still answers
        // gets) but not ready (it takes no new work): /readyz says so.
        "/healthz" | "/readyz" => tokio::task::spawn_blocking(move || {
            let s = shared.stats();
            match (unhealthy(&s), s.draining) {
                (Some(why), _) => reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{why}\n")),
                (None, true) if path == "/readyz" => reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "draining\n"),
                (None, true) => reply(StatusCode::OK, "text/plain", "draining\n"),
                (None, false) => reply(StatusCode::OK, "text/plain", "ok\n"),
            }
        })
        .await
        .ok(),
        // Alive: answered whenever this port serves, draining or with no
        // disk in service (a liveness probe; restarting would not help).
        "/livez" => Some(reply(StatusCode::OK, "text/plain", "ok\n")),
        "/api/stats" => tokio::task::spawn_blocking(move || {
            let body = serde_json::to_vec(&*shared.stats()).unwrap_or_default();
            reply(StatusCode::OK, "application/json", body)
        })
        .await
        .ok(),
        "/api/history" => {
            let body = serde_json::to_vec(&*history.lock().unwrap_or_else(|e| e.into_inner())).unwrap_or_default();
            Some(reply(StatusCode::OK, "application/json", body))
        }
        "/" => Some(reply(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD)),
        _ => Some(reply(StatusCode::NOT_FOUND, "text/plain", "not found\n")),
    };
    Ok(r.unwrap_or_else(|| reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "stats unavailable\n")))
}

/// The node's dashboard: one page, no external resources.
pub const DASHBOARD: &str = include_str!("dashboard.html");

/// Connections the metrics port serves at once (scrapers, dashboards and
/// a few people; past it a 503).
pub const MAX_CONNS: usize = 64;

/// Serves the metrics endpoint until shutdown through the daemons' shared
/// accept loop ([`kv_common::listen`]): at most [`MAX_CONNS`] connections,
/// each admitted on its first bytes (10 s for them), HTTP/1.1 with
/// keep-alive and a header read timeout.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, registry: Registry, shutdown: watch::Receiver<bool>) {
    let history = Arc::new(Mutex::new(History::default()));
    tokio::spawn(sampler(shared.clone(), history.clone(), shutdown.clone()));
    let gate =
        kv_common::listen::Gate::new("metrics port", MAX_CONNS, Duration::from_secs(10), Some(Duration::from_secs(5)));
    let service = Arc::new(MetricsPort { shared, registry: Arc::new(registry), history });
    kv_common::listen::run(listener, gate, Arc::default(), service, shutdown).await;
}

struct MetricsPort {
    shared: Arc<Shared>,
    registry: Arc<Registry>,
    history: Arc<Mutex<History>>,
}

impl kv_common::listen::Service for MetricsPort {
    async fn serve(self: Arc<Self>, conn: kv_common::listen::Accepted) {
        let me = self.clone();
        let svc = hyper::service::service_fn(move |req| {
            handle(req, me.shared.clone(), me.registry.clone(), me.history.clone())
        });
        let busy = format!("{{\"error\":\"the metrics port is at its connection cap ({MAX_CONNS}): retry\"}}");
        kv_common::listen::serve_http(conn, svc, &busy, Duration::from_secs(10)).await;
    }
}

/// How often the dashboard's history takes a sample, and how many it keeps
/// (5 minutes).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
pub const SAMPLES_KEPT: usize = 150;

/// One point of the dashboard's charts: rates over the interval before it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Sample {
    /// Seconds since the Unix epoch at the end of the interval.
    pub t: f64,
    /// Gets answered per second (hits, misses and mismatches).
    pub gets: f64,
    /// Share of those gets served, in all and by tier (None without gets).
    pub hit: Option<f64>,
    pub memory_hit: Option<f64>,
    pub disk_hit: Option<f64>,
    pub read_bytes: f64,
    pub written_bytes: f64,
    pub puts: f64,
    pub evictions: f64,
    pub connections: u64,
    pub ops: Vec<OpRate>,
}

/// One op over a sample's interval.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OpRate {
    pub op: String,
    pub rps: f64,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub mean: Option<f64>,
}

/// The last [`SAMPLES_KEPT`] samples, oldest first: the dashboard draws the
/// last minutes at once, even when it was just opened.
#[derive(Debug, Default, serde::Serialize)]
pub struct History {
    pub samples: VecDeque<Sample>,
    /// Each tenant over the last interval only (the dashboard's table; at
    /// most [`kv_common::stats::MAX_TENANTS_SHOWN`] and `other`).
    pub tenants: Vec<kv_common::stats::TenantInterval>,
    #[serde(skip)]
    prev: Option<(std::time::Instant, NodeStats)>,
}

impl History {
    /// Adds the interval from the last record to `cur`.
    pub fn push(&mut self, at: std::time::Instant, cur: NodeStats) {
        if let Some((then, prev)) = self.prev.take() {
            let secs = at.duration_since(then).as_secs_f64().max(1e-3);
            self.samples.push_back(sample(&prev, &cur, secs));
            self.tenants = kv_common::stats::tenant_intervals(&prev.tenants, &cur.tenants, secs);
            while self.samples.len() > SAMPLES_KEPT {
                self.samples.pop_front();
            }
        }
        self.prev = Some((at, cur));
    }
}

/// Rates between two records `secs` apart.
pub fn sample(prev: &NodeStats, cur: &NodeStats, secs: f64) -> Sample {
    let iv = Interval::between(prev, cur, secs);
    let ops = iv
        .ops
        .iter()
        .map(|w| OpRate {
            op: w.op.clone(),
            rps: iv.per_sec(w.count),
            p50: w.quantile(0.5),
            p99: w.quantile(0.99),
            mean: (w.count > 0).then(|| w.sum_seconds / w.count as f64),
        })
        .collect();
    Sample {
        t: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        gets: iv.per_sec(iv.gets),
        hit: iv.hit(),
        memory_hit: iv.memory_hit(),
        disk_hit: iv.disk_hit(),
        read_bytes: iv.per_sec(iv.bytes_read),
        written_bytes: iv.per_sec(iv.bytes_written),
        puts: iv.per_sec(iv.puts),
        evictions: iv.per_sec(iv.evictions),
        connections: cur.connections,
        ops,
    }
}

async fn sampler(shared: Arc<Shared>, history: Arc<Mutex<History>>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = kv_common::listen::stopped(&mut shutdown) => return,
            _ = tick.tick() => {}
        }
        let sh = shared.clone();
        if let Ok(s) = tokio::task::spawn_blocking(move || sh.stats()).await {
            history.lock().unwrap_or_else(|e| e.into_inner()).push(std::time::Instant::now(), (*s).clone());
        }
    }
}
