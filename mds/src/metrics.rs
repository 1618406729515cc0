//! kv-mds's `/metrics` (OpenMetrics text from prometheus-client), its
//! dashboard `/` and the dashboard's data `/api/groups`, on the API port
//! and without the auth token (they reveal no page data; DEPLOY.md says to
//! keep the port inside the cluster).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_common::ring::{Placement, Ring, RingMember};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::Mds;

/// The replica's registry: its counters (read at each scrape) and the etcd
/// call histogram.
pub fn registry(mds: &Arc<Mds>) -> Registry {
    let mut r = Registry::with_prefix("kvmds");
    r.register(
        "etcd_request_duration_seconds",
        "Time of each etcd call this replica made (retries included)",
        mds.reg.etcd_latency.clone(),
    );
    r.register_collector(Box::new(Counters { mds: mds.clone() }));
    r
}

struct Counters {
    mds: Arc<Mds>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Counters")
    }
}

impl Collector for Counters {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let c = &self.mds.reg.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let counters: [(&str, &str, u64); 23] = [
            ("registrations", "Node registrations served", ld(&c.registrations)),
            ("heartbeats", "Node heartbeats served", ld(&c.heartbeats)),
            ("takeovers", "Heartbeats that took a node's lease over from another replica", ld(&c.takeovers)),
            ("deregistrations", "Graceful node leaves served", ld(&c.deregistrations)),
            ("lease_grants", "etcd leases granted (registrations and takeovers)", ld(&c.lease_grants)),
            ("lease_expiries", "Heartbeats that found the node's lease expired in etcd", ld(&c.lease_expiries)),
            ("epoch_bumps", "Epochs this replica advanced (member set changes it wrote)", ld(&c.epoch_bumps)),
            ("etcd_errors", "etcd calls that failed", ld(&c.etcd_errors)),
            ("etcd_retries", "etcd calls sent again after one did not reach a member", ld(&c.etcd_retries)),
            (
                "epoch_settle_retries",
                "Rounds of settling a group's epoch begun again after another writer moved it first",
                ld(&c.settle_retries),
            ),
            (
                "view_reads_shared",
                "View reads answered by a read another call on this replica began after they arrived",
                ld(&c.settles_shared),
            ),
            ("view_reads", "Views read from etcd", ld(&c.views)),
            (
                "long_polls_from_cache",
                "Long-polls that started from the view held for them, without an etcd read",
                ld(&c.views_from_cache),
            ),
            ("polls_from_cache", "Plain polls answered from the view the etcd watch holds", ld(&c.polls_from_cache)),
            (
                "polls_behind_min_epoch",
                "Plain polls whose min_epoch was past the view the etcd watch holds (read from etcd instead)",
                ld(&c.polls_behind_min_epoch),
            ),
            (
                "history_leases_revoked",
                "Leases of history keys revoked once a new epoch trimmed their keys",
                ld(&c.history_leases_revoked),
            ),
            ("views_delta", "Views sent as a change against the epoch the client held", ld(&c.views_delta)),
            (
                "view_encodings",
                "View bodies encoded (each shared by every caller answered with it)",
                ld(&c.view_encodings),
            ),
            ("refused_connections", "Connections refused at the connection cap (--max-conns)", ld(&c.refused_conns)),
            (
                "node_connections",
                "Connections that opened with a node's call, served apart from long-polls (a node keeps one for its heartbeats)",
                ld(&c.node_conns),
            ),
            ("refused_long_polls", "Long-polls refused at the long-poll cap", ld(&c.refused_polls)),
            ("denied_requests", "API calls refused for a missing or wrong auth token (401)", ld(&c.denied)),
            ("forbidden_requests", "API calls refused because the caller's role may not make them (403)", ld(&c.forbidden)),
        ];
        for (name, help, v) in counters {
            ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)?;
        }
        let mut m = e.encode_descriptor(
            "views",
            "Views served, by kind (poll: at once; long_poll: after a wait)",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(ld(&c.views_polled)).encode(m.encode_family(&[("kind", "poll")])?)?;
        ConstCounter::new(ld(&c.views_long_polled)).encode(m.encode_family(&[("kind", "long_poll")])?)?;
        let mut m = e.encode_descriptor(
            "view_bytes",
            "Bytes of view bodies sent, by kind (full: the whole member list; delta: a change against the client's epoch)",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(ld(&c.view_bytes_full)).encode(m.encode_family(&[("kind", "full")])?)?;
        ConstCounter::new(ld(&c.view_bytes_delta)).encode(m.encode_family(&[("kind", "delta")])?)?;
        let gauges: [(&str, &str, u64); 2] = [
            ("long_polls_waiting", "Long-polls waiting now", ld(&c.long_polls_waiting)),
            ("etcd_up", "1 while the last etcd call succeeded", u64::from(self.mds.reg.etcd_healthy())),
        ];
        for (name, help, v) in gauges {
            ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
        }
        let mut m = e.encode_descriptor("build_info", "Build of this replica (value 1)", None, MetricType::Gauge)?;
        ConstGauge::new(1u64).encode(m.encode_family(&[("version", env!("CARGO_PKG_VERSION"))])?)?;
        Ok(())
    }
}

/// One group as the dashboard shows it.
#[derive(Debug, Serialize)]
pub struct GroupInfo {
    pub group: String,
    pub epoch: u64,
    /// The group's placement rule (`ketama`, `multiprobe`).
    pub placement: String,
    /// How many members the view holds (also when `members` is hidden).
    pub member_count: usize,
    /// The group is token-protected and the request did not carry its
    /// token: `members` is left empty (`/api/groups` serves anyone).
    pub hidden: bool,
    pub members: Vec<MemberInfo>,
}

#[derive(Debug, Serialize)]
pub struct MemberInfo {
    pub id: String,
    pub addr: String,
    pub weight: u32,
    pub metrics_addr: Option<String>,
    /// Fraction of the key space the member owns in the client's ring.
    pub share: f64,
    pub vnodes: u64,
    /// This replica's lease on the node, if it holds it.
    pub lease: Option<LeaseInfo>,
}

#[derive(Debug, Serialize)]
pub struct LeaseInfo {
    pub last_heartbeat_ms: u64,
}

/// What `/api/groups` answers.
#[derive(Debug, Serialize)]
pub struct Overview {
    pub version: &'static str,
    pub etcd_up: bool,
    pub lease_ttl_ms: u64,
    pub groups: Vec<GroupInfo>,
    /// Why the groups could not be read (etcd unreachable), if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How long an overview is reused: dashboards and scrapes of any number
/// cost etcd one pass over the groups per period at most.
const OVERVIEW_FOR: Duration = Duration::from_secs(2);

/// [`read_overview`], reused for [`OVERVIEW_FOR`]; one read at a time (the
/// others wait for it and share its answer).
pub async fn overview(mds: &Mds) -> Arc<Overview> {
    static CACHE: tokio::sync::Mutex<Option<(std::time::Instant, Arc<Overview>)>> = tokio::sync::Mutex::const_new(None);
    let mut c = CACHE.lock().await;
    if let Some((at, ov)) = c.as_ref() {
        if at.elapsed() < OVERVIEW_FOR {
            return ov.clone();
        }
    }
    let ov = Arc::new(read_overview(mds).await);
    *c = Some((std::time::Instant::now(), ov.clone()));
    ov
}

/// Every group's view with shares and this replica's leases, read from
/// etcd within 2 s.
pub async fn read_overview(mds: &Mds) -> Overview {
    let read = async {
        let mut out = Vec::new();
        for g in mds.reg.group_names().await? {
            let v = mds.reg.view(&g).await?;
            // A rule this build does not know (set by a newer replica):
            // members without shares rather than shares by another rule.
            let rule = v.placement().ok();
            let ring = Ring::with_placement(
                v.members.iter().map(|m| RingMember { id: m.id.clone(), weight: m.weight }).collect(),
                rule.unwrap_or_default(),
            );
            let shares = if rule.is_some() { ring.shares() } else { Vec::new() };
            let placement = v.placement.clone().unwrap_or_else(|| Placement::Ketama.name().to_string());
            let members: Vec<MemberInfo> = v
                .members
                .into_iter()
                .enumerate()
                .map(|(i, m)| MemberInfo {
                    lease: mds
                        .reg
                        .heartbeat_age(&g, &m.id)
                        .map(|a| LeaseInfo { last_heartbeat_ms: a.as_millis() as u64 }),
                    share: shares.get(i).copied().unwrap_or(0.0),
                    vnodes: rule.unwrap_or_default().points_per_weight() * u64::from(m.weight.max(1)),
                    id: m.id,
                    addr: m.addr,
                    weight: m.weight,
                    metrics_addr: m.metrics_addr,
                })
                .collect();
            out.push(GroupInfo {
                group: g,
                epoch: v.epoch,
                placement,
                member_count: members.len(),
                hidden: false,
                members,
            });
        }
        Ok::<_, crate::RegError>(out)
    };
    let (groups, error) = match tokio::time::timeout(Duration::from_secs(2), read).await {
        Ok(Ok(g)) => (g, None),
        Ok(Err(e)) => (Vec::new(), Some(e.to_string())),
        Err(_) => (Vec::new(), Some("etcd did not answer within 2 s".to_string())),
    };
    Overview {
        version: env!("CARGO_PKG_VERSION"),
        etcd_up: mds.reg.etcd_healthy(),
        lease_ttl_ms: mds.reg.ttl_ms(),
        groups,
        error,
    }
}

/// The whole exposition: the registry, then each group's members and epoch
/// (read from etcd for the scrape; left out when etcd does not answer).
pub async fn render(mds: &Mds, registry: &Registry) -> Result<String, std::fmt::Error> {
    let ov = overview(mds).await;
    let mut groups = Registry::with_prefix("kvmds");
    type PerGroup = Family<Vec<(String, String)>, Gauge>;
    let (members, epochs) = (PerGroup::default(), PerGroup::default());
    for g in &ov.groups {
        let l = vec![("group".to_string(), g.group.clone())];
        members.get_or_create(&l).set(g.members.len() as i64);
        epochs.get_or_create(&l).set(g.epoch as i64);
    }
    groups.register("group_members", "Members in each group's view (etcd read at the scrape)", members);
    groups.register("group_epoch", "Each group's epoch (etcd read at the scrape)", epochs);
    let mut out = String::with_capacity(8 << 10);
    prometheus_client::encoding::text::encode_registry(&mut out, registry)?;
    prometheus_client::encoding::text::encode_registry(&mut out, &groups)?;
    prometheus_client::encoding::text::encode_eof(&mut out)?;
    Ok(out)
}

/// The replica's dashboard: one page, no external resources.
pub const DASHBOARD: &str = include_str!("dashboard.html");
