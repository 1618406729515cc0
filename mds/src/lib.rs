//! `kv-mds`: the stateless membership service over etcd (DESIGN.md §5).
//!
//! Any number of replicas run side by side with no leader; each is an etcd
//! client and nothing else keeps state. Nodes register and heartbeat to any
//! replica ([`registry`]: leases, takeover, epochs); clients read a group's
//! view, or long-poll it, over HTTP/JSON ([`http`]; the API is in
//! docs/PROTOCOL.md). One etcd watch on the whole key space wakes
//! long-polls when a group's member set changes.

pub mod http;
pub mod registry;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{ConnectOptions, GetOptions, WatchOptions};
use kv_common::mds::{View, ETCD_ROOT};
use tokio::sync::watch;

pub use registry::{RegError, Registry};

/// How many distinct groups one replica follows for long-polls.
const MAX_GROUPS: usize = 4096;

/// The service: the registry plus the per-group change signals long-polls
/// wait on.
pub struct Mds {
    pub reg: Registry,
    watch_etcd: etcd_client::Client,
    groups: Mutex<HashMap<String, watch::Sender<Option<View>>>>,
    /// The etcd watch is established; while false, long-polls re-read.
    watching: AtomicBool,
}

/// Connects to etcd. The connection is made lazily and re-made after
/// failures, so this succeeds while etcd is down; calls then fail until it
/// is back.
pub async fn connect(endpoints: &[String], ttl: Duration) -> Result<Arc<Mds>, String> {
    let urls: Vec<String> =
        endpoints.iter().map(|e| if e.contains("://") { e.clone() } else { format!("http://{e}") }).collect();
    let joined = endpoints.join(",");
    let unary = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_millis(1500))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    let streaming = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        // etcd refuses HTTP/2 pings more often than every 5 s (its
        // --grpc-keepalive-min-time) by closing the connection; a dead etcd
        // process is noticed at once anyway (the connection resets).
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true);
    let etcd = etcd_client::Client::connect(&urls, Some(unary))
        .await
        .map_err(|e| format!("cannot set up the etcd client for {joined}: {e}"))?;
    let watch_etcd = etcd_client::Client::connect(&urls, Some(streaming))
        .await
        .map_err(|e| format!("cannot set up the etcd client for {joined}: {e}"))?;
    Ok(Arc::new(Mds {
        reg: Registry::new(etcd, joined, ttl),
        watch_etcd,
        groups: Mutex::default(),
        watching: AtomicBool::new(false),
    }))
}

impl Mds {
    /// A receiver that sees each new view of `group` (as the watch finds it).
    fn subscribe(&self, group: &str) -> Option<watch::Receiver<Option<View>>> {
        let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = g.get(group) {
            return Some(tx.subscribe());
        }
        if g.len() >= MAX_GROUPS {
            // Groups nobody waits on any more make room.
            g.retain(|_, tx| tx.receiver_count() > 0);
            if g.len() >= MAX_GROUPS {
                return None;
            }
        }
        let (tx, rx) = watch::channel(None);
        g.insert(group.to_string(), tx);
        Some(rx)
    }

    /// Re-reads a followed group's view and publishes it if the epoch
    /// changed (retrying a few times: a lost refresh would leave waiters
    /// asleep until their deadline).
    async fn refresh(&self, group: &str) {
        let followed =
            self.groups.lock().unwrap_or_else(|e| e.into_inner()).get(group).is_some_and(|tx| tx.receiver_count() > 0);
        if !followed {
            return;
        }
        let mut backoff = Duration::from_millis(50);
        let view = loop {
            match self.reg.view(group).await {
                Ok(v) => break v,
                Err(e) if backoff > Duration::from_millis(800) => {
                    tracing::warn!(group, error = %e, "cannot refresh a view after a change: long-polls re-read at their deadline");
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
            }
        };
        if let Some(tx) = self.groups.lock().unwrap_or_else(|e| e.into_inner()).get(group) {
            // `!=`, not `>`: after etcd lost its data, revisions restart lower.
            tx.send_if_modified(|cur| {
                let changed = cur.as_ref().is_none_or(|c| view.epoch != c.epoch);
                if changed {
                    *cur = Some(view);
                }
                changed
            });
        }
    }

    /// The view once its epoch differs from `after`, or at `wait`'s end
    /// (then read afresh).
    pub async fn wait_view(&self, group: &str, after: u64, wait: Duration) -> Result<View, RegError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut rx = self.subscribe(group);
        let mut v = self.reg.view(group).await?;
        loop {
            if v.epoch != after || tokio::time::Instant::now() >= deadline {
                return Ok(v);
            }
            // Without a working watch, fall back to re-reading twice a second.
            let polling = !self.watching.load(Ordering::SeqCst) || rx.is_none();
            let slice = if polling { Duration::from_millis(500) } else { Duration::from_secs(3600) };
            let until = deadline.min(tokio::time::Instant::now() + slice);
            let timer = async {
                tokio::time::sleep_until(until).await;
            };
            match rx.as_mut() {
                Some(r) => {
                    tokio::select! {
                        changed = r.changed() => {
                            if changed.is_ok() {
                                if let Some(nv) = r.borrow_and_update().clone() {
                                    v = nv;
                                }
                            }
                        }
                        _ = timer => v = self.reg.view(group).await?,
                    }
                }
                None => {
                    timer.await;
                    v = self.reg.view(group).await?;
                }
            }
        }
    }

    /// Follows every group's keys with one etcd watch, for as long as the
    /// process runs; re-established with backoff when etcd goes away.
    pub async fn watch_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut etcd = self.watch_etcd.clone();
            // Start the watch just after the current revision, so nothing
            // between the catch-up refresh below and the watch is missed.
            let start =
                match etcd.get(ETCD_ROOT, Some(GetOptions::new().with_prefix().with_keys_only().with_limit(1))).await {
                    Ok(r) => r.header().map(|h| h.revision() + 1),
                    Err(_) => None,
                };
            if let Some(rev) = start {
                let opts = WatchOptions::new().with_prefix().with_start_revision(rev);
                if let Ok(mut ws) = etcd.watch(ETCD_ROOT, Some(opts)).await {
                    self.watching.store(true, Ordering::SeqCst);
                    backoff = Duration::from_millis(100);
                    tracing::debug!(revision = rev, "watching membership keys");
                    // Changes missed while the watch was down.
                    self.refresh_all().await;
                    while let Ok(Some(resp)) = ws.message().await {
                        let mut touched: Vec<String> = Vec::new();
                        for ev in resp.events() {
                            if let Some(g) = ev.kv().and_then(|kv| registry::group_of_key(kv.key())) {
                                if !touched.iter().any(|t| t == g) {
                                    touched.push(g.to_string());
                                }
                            }
                        }
                        for g in touched {
                            self.refresh(&g).await;
                        }
                        if resp.canceled() {
                            break;
                        }
                    }
                    self.watching.store(false, Ordering::SeqCst);
                    tracing::warn!("etcd watch ended: long-polls re-read etcd until it is back");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn refresh_all(&self) {
        let groups: Vec<String> = {
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            g.retain(|_, tx| tx.receiver_count() > 0);
            g.keys().cloned().collect()
        };
        for g in groups {
            self.refresh(&g).await;
        }
    }

    /// Drops per-group and per-node state nobody uses any more, every TTL.
    pub async fn sweep_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.reg.ttl.max(Duration::from_secs(1))).await;
            self.reg.sweep();
            self.groups.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, tx| tx.receiver_count() > 0);
        }
    }
}

/// Parses a duration: `30s`, `500ms`, `2m`, or a plain number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => return Err(format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)")),
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("3h").is_err());
    }
}
