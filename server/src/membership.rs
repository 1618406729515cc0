//! Joining a group through kv-mds (`--mds`): register once the node can
//! serve, heartbeat every third of the lease TTL to any reachable replica,
//! register again when told the lease is gone, deregister on shutdown;
//! and follow the group's tenants' quotas, read with the heartbeats at
//! most every [`QUOTA_POLL`].
//!
//! It runs on its own thread with blocking HTTP calls: membership traffic is
//! a request every few seconds, and keeping it off the data-plane runtime
//! means a slow or dead MDS can never delay a page.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kv_common::mds::{AbortHandle, MdsClient, MdsError, RegisterRequest};

use crate::config::MembershipConfig;

/// Timeout of one MDS call (connect, then each read); above the MDS's own
/// 2.5 s budget for etcd, so a slow etcd is a 503 (fail over), not a retry
/// racing the first request.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest pause between registration attempts while no MDS answers.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often a node reads its group's quotas (with a heartbeat): a quota
/// set with `kvctl tenants --set` is in force on every node within about
/// this and a heartbeat period.
pub const QUOTA_POLL: Duration = Duration::from_secs(2);

/// What the node does with the group's quotas when they change.
pub type OnQuotas = Box<dyn FnMut(&kv_common::quota::Quotas) + Send>;

pub struct Membership {
    stop: Arc<(Mutex<bool>, Condvar)>,
    abort: AbortHandle,
    thread: Option<JoinHandle<Option<u64>>>,
}

/// Sleeps up to `d`; true when asked to stop meanwhile.
fn pause(stop: &(Mutex<bool>, Condvar), d: Duration) -> bool {
    let (lock, cv) = stop;
    let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    let (guard, _) = cv.wait_timeout_while(guard, d, |s| !*s).unwrap_or_else(|e| e.into_inner());
    *guard
}

impl Membership {
    /// Starts registering `cfg.id` with `addr` as its address.
    pub fn start(
        cfg: MembershipConfig,
        addr: String,
        token: Option<kv_common::auth::Token>,
        on_quotas: OnQuotas,
    ) -> std::io::Result<Membership> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let client = MdsClient::new(cfg.endpoints.clone(), CALL_TIMEOUT)
            .with_token(token)
            .with_keep_idle(kv_common::mds::NODE_KEEP_IDLE);
        let abort = client.abort_handle();
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kv-membership".into())
            .spawn(move || run(cfg, addr, client, &s, on_quotas))?;
        Ok(Membership { stop, abort, thread: Some(thread) })
    }

    /// Deregisters (at most `limit` spent on it) and ends the thread.
    /// Returns the group's epoch after the leave, when kv-mds answered it.
    pub fn leave(mut self, limit: Duration) -> Option<u64> {
        {
            let (lock, cv) = &*self.stop;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_all();
        }
        let t = self.thread.take()?;
        let deadline = std::time::Instant::now() + limit;
        while !t.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if t.is_finished() {
            t.join().ok().flatten()
        } else {
            tracing::warn!("deregistration did not finish in time: the lease will expire instead");
            self.abort.abort();
            None
        }
    }
}

/// A token new at every start of the process: the MDS uses it to tell a
/// restart (same id, new instance: it replaces the record) from two nodes
/// configured with the same id (the one replaced is told at its heartbeat).
fn instance_token() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{:x}", std::process::id(), nanos)
}

/// Returns the epoch after the deregistration, when it was answered.
fn run(
    cfg: MembershipConfig,
    addr: String,
    mut mds: MdsClient,
    stop: &(Mutex<bool>, Condvar),
    mut on_quotas: OnQuotas,
) -> Option<u64> {
    let mut quotas = Quotas::new();
    let instance = instance_token();
    let req = RegisterRequest {
        addr: addr.clone(),
        weight: cfg.weight,
        instance: instance.clone(),
        metrics_addr: cfg.metrics_addr.clone(),
    };
    let (group, id) = (cfg.group.as_str(), cfg.id.as_str());
    let mut ttl: Option<Duration> = None;
    let mut backoff = Duration::from_millis(100);
    // The last failure logged, so a long outage is one line, not one per try.
    let mut last_failure: Option<String> = None;
    loop {
        if *stop.0.lock().unwrap_or_else(|e| e.into_inner()) {
            break;
        }
        let wait = match ttl {
            None => match mds.register(group, id, &req) {
                Ok(r) => {
                    let t = Duration::from_millis(r.ttl_ms.max(1000));
                    if last_failure.is_some() {
                        tracing::info!("an MDS answers again");
                    }
                    tracing::info!(mds = mds.current(), group, id, %addr, weight = cfg.weight, epoch = r.epoch,
                        lease_ttl_ms = r.ttl_ms, "registered");
                    ttl = Some(t);
                    last_failure = None;
                    quotas.poll(&mut mds, group, &mut on_quotas);
                    backoff = Duration::from_millis(100);
                    t / 3
                }
                Err(MdsError::Aborted) => break,
                Err(e) => {
                    let msg = e.to_string();
                    if matches!(e, MdsError::Denied(_) | MdsError::Forbidden(_)) {
                        if last_failure.as_deref() != Some(msg.as_str()) {
                            tracing::error!(error = %msg, group, "kv-mds refuses this node's credential (check --auth-token-file on both sides: a token of the group with role=node, bound to no node or to this node's id; retrying)");
                        }
                    } else if last_failure.is_none() {
                        tracing::warn!(error = %msg, "cannot register yet (serving meanwhile; retrying)");
                    } else {
                        tracing::debug!(error = %msg, "registration retry failed");
                    }
                    last_failure = Some(msg);
                    let w = backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    w
                }
            },
            Some(t) => match mds.heartbeat(group, id, &instance) {
                Ok(r) => {
                    if r.took_over {
                        tracing::info!(mds = mds.current(), "heartbeat: this MDS replica took the lease over");
                    }
                    if last_failure.take().is_some() {
                        tracing::info!(mds = mds.current(), "heartbeats answered again");
                    }
                    quotas.poll(&mut mds, group, &mut on_quotas);
                    t / 3
                }
                Err(MdsError::NotRegistered(m)) => {
                    tracing::warn!(reason = %m, "the MDS no longer has this node: registering again");
                    ttl = None;
                    continue;
                }
                Err(MdsError::Taken(m)) => {
                    // Another node registered with this id after us. Do not
                    // take it back (two nodes would flap); keep asking: once
                    // the other leaves, the heartbeat says "not registered"
                    // and this node registers again.
                    if last_failure.as_deref() != Some("taken") {
                        tracing::error!(reason = %m, "this node's id is taken by another node: out of the group until it leaves (check --id)");
                        last_failure = Some("taken".into());
                    }
                    t / 3
                }
                Err(MdsError::Aborted) => break,
                Err(e) => {
                    let msg = e.to_string();
                    if last_failure.is_none() {
                        tracing::warn!(error = %msg, "heartbeat failed (retrying; the lease lasts {} ms)", t.as_millis());
                    } else {
                        tracing::debug!(error = %msg, "heartbeat retry failed");
                    }
                    last_failure = Some(msg);
                    // Retry sooner than the regular period: the lease is running out.
                    (t / 6).max(Duration::from_millis(200))
                }
            },
        };
        if pause(stop, wait) {
            break;
        }
    }
    // Leave at once rather than at lease expiry (also when registration
    // never got an answer: a request may have landed without its reply).
    match mds.deregister(group, id, &instance) {
        Ok(r) => {
            tracing::info!(mds = mds.current(), group, id, epoch = r.epoch, "deregistered");
            Some(r.epoch)
        }
        Err(MdsError::Taken(_)) => {
            tracing::info!("not deregistering: another node holds this id now");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not deregister: the lease will expire instead");
            None
        }
    }
}

/// The group's quotas as last read, and when.
struct Quotas {
    held: Option<kv_common::quota::Quotas>,
    read: Option<std::time::Instant>,
    /// The last failure logged (one line per distinct failure).
    failed: Option<String>,
}

impl Quotas {
    fn new() -> Quotas {
        Quotas { held: None, read: None, failed: None }
    }

    /// Reads the group's quotas when [`QUOTA_POLL`] has passed, and hands
    /// them on when they changed. A read that fails, or a table that does
    /// not parse, keeps the quotas in force (one log line).
    fn poll(&mut self, mds: &mut MdsClient, group: &str, on: &mut OnQuotas) {
        if self.read.is_some_and(|t| t.elapsed() < QUOTA_POLL) {
            return;
        }
        self.read = Some(std::time::Instant::now());
        let got = match mds.quotas(group) {
            Ok(r) => kv_common::quota::Quotas::from_strings(&r.quotas),
            // An MDS of an earlier release has no tenants call: no quotas.
            Err(MdsError::Rejected(m) | MdsError::NotRegistered(m)) if m.contains("no such call") => {
                Ok(Default::default())
            }
            Err(e) => Err(e.to_string()),
        };
        match got {
            Ok(q) => {
                self.failed = None;
                if self.held.as_ref() != Some(&q) {
                    if self.held.is_some() || !q.is_empty() {
                        tracing::info!(group, quotas = %q.to_list(), "the group's tenants' quotas in force");
                    }
                    on(&q);
                    self.held = Some(q);
                }
            }
            Err(e) => {
                if self.failed.as_deref() != Some(e.as_str()) {
                    tracing::warn!(group, error = %e, "cannot read the group's quotas: the ones in force are kept");
                    self.failed = Some(e);
                }
            }
        }
    }
}
