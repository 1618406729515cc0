//! Membership discovery through kv-mds (`kv_start_mds_discovery`).
//!
//! One thread per client long-polls a group's view ("answer when the epoch
//! passes N, or after poll_ms") on one MDS replica, failing over to the
//! next when a replica does not answer. The ring is rebuilt only when the
//! epoch changes; while every replica is down the client keeps serving on
//! the ring it has, and retries the replicas every second at most.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kv_common::mds::{AbortHandle, MdsClient, MdsError, View};
use kv_common::status::Status;

use crate::client::Client;
use crate::members::{member, Member};

/// The running discovery of one client; dropping it stops the thread.
pub struct Discovery {
    stop: Arc<AtomicBool>,
    abort: AbortHandle,
    thread: Option<JoinHandle<()>>,
}

/// How long dropping a discovery waits for its thread. A thread stuck in a
/// connect to a blackholed MDS (which the abort cannot cut short) is left to
/// finish on its own: it holds the client by an `Arc`, sees the stop flag
/// when its connect times out, and exits; `kv_close` does not wait for it.
const JOIN_WAIT: Duration = Duration::from_millis(300);

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Cuts a long-poll in progress short.
        self.abort.abort();
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + JOIN_WAIT;
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The members of a view as the client routes to them. Addresses are not
/// resolved here (each connection resolves its node's name), so a name that
/// does not resolve makes only that node unavailable; a record of bad form
/// (which kv-mds does not accept) holds the view back.
fn members_of(v: &View) -> (Vec<Member>, Vec<String>) {
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for m in &v.members {
        match member(&m.id, &m.addr, m.weight) {
            Ok(one) => out.push(one),
            Err(e) => bad.push(e),
        }
    }
    (out, bad)
}

/// The previous member sets a view names (a set with a record of bad form,
/// which kv-mds accepts none of, or placed by a rule this build does not
/// know, is left out). Sets of an epoch in `held` (the client has them
/// already) come without their members: only their time left is new, and
/// rebuilding a thousand members per set on every epoch is work a fleet's
/// every client would repeat.
fn previous_of(v: &View, held: &std::collections::HashSet<u64>) -> Vec<crate::client::GivenSet> {
    v.previous
        .iter()
        .filter_map(|p| {
            let set: Result<Vec<Member>, String> = if held.contains(&p.epoch) {
                Ok(Vec::new())
            } else {
                p.apply(&v.members).iter().map(|m| member(&m.id, &m.addr, m.weight)).collect()
            };
            let rule = kv_common::mds::placement_of(&v.group, p.placement.as_deref()).ok()?;
            Some((p.epoch, set.ok()?, rule, Duration::from_millis(p.remaining_ms)))
        })
        .collect()
}

/// How the first round of discovery failed: `Unavailable` (no replica
/// answered usefully) or `Edenied` (the MDS refused the auth token).
pub type FirstError = (Status, String);

/// Starts discovery; returns once the first view is applied (`Ok(epoch)`)
/// or `first_wait` has passed without one (`Err(why)`; discovery goes on).
pub fn start(
    core: Arc<Client>,
    endpoints: Vec<String>,
    group: String,
    poll: Duration,
    first_wait: Duration,
) -> std::io::Result<(Discovery, Result<u64, FirstError>)> {
    let stop = Arc::new(AtomicBool::new(false));
    // Above the MDS's 2.5 s budget for etcd (a slow etcd is then a 503 to
    // fail over on, not a timeout).
    let timeout = core.opts.connect_timeout.clamp(Duration::from_secs(3), Duration::from_secs(10));
    let named = endpoints.join(",");
    let mds = MdsClient::new(endpoints, timeout).with_token(core.opts.auth_token.clone());
    let abort = mds.abort_handle();
    let (tx, rx) = mpsc::channel::<Result<u64, FirstError>>();
    let s = stop.clone();
    let thread =
        std::thread::Builder::new().name("kvclient-mds".into()).spawn(move || run(core, mds, group, poll, &s, tx))?;
    let first = rx.recv_timeout(first_wait).unwrap_or_else(|_| {
        Err((Status::Unavailable, format!("no MDS of {named} answered within {} ms", first_wait.as_millis())))
    });
    Ok((Discovery { stop, abort, thread: Some(thread) }, first))
}

fn run(
    core: Arc<Client>,
    mut mds: MdsClient,
    group: String,
    poll: Duration,
    stop: &AtomicBool,
    tx: mpsc::Sender<Result<u64, FirstError>>,
) {
    let m = &core.metrics;
    // The epoch of the view applied; None before the first (and after a
    // 422, to ask for a whole view again).
    let mut applied: Option<u64> = None;
    // The highest epoch taken so far, kept across a 422: a replica may hold
    // an older view than one another replica gave, so every plain poll after
    // the first asks for at least this (`min_epoch`, docs/PROTOCOL.md §6).
    let mut floor: Option<u64> = None;
    // The members of that epoch: what the replica's deltas apply to.
    let mut held: Vec<kv_common::mds::MemberRecord> = Vec::new();
    let mut first = Some(tx);
    while !stop.load(Ordering::SeqCst) {
        let asked = std::time::Instant::now();
        let before = applied;
        // Every answer while the client holds an epoch comes from a long-poll
        // or a `min_epoch` poll, which kv-mds answers from etcd when the view
        // it holds is older: one below the floor means etcd itself went back.
        let whole = |mds: &mut MdsClient| match floor {
            None => mds.view(&group),
            Some(f) => mds.view_at_least(&group, f),
        };
        let answer = match applied {
            None => whole(&mut mds),
            // The answer may be a change against the members held (a few
            // hundred bytes rather than the whole list).
            Some(e) => mds.wait_view_delta(&group, e, poll).and_then(|v| match v.resolve(Some((e, &held))) {
                Ok(v) => Ok(v),
                // A change against another epoch than the one held (a
                // replica misbehaving): ask for the whole view.
                Err(_) => whole(&mut mds),
            }),
        };
        m.mds_failovers.store(mds.failovers, Ordering::Relaxed);
        match answer {
            Ok(mut v) => {
                m.mds_views.fetch_add(1, Ordering::Relaxed);
                m.mds_up.store(1, Ordering::Relaxed);
                if applied != Some(v.epoch) {
                    if let Some(f) = floor.filter(|f| v.epoch < *f) {
                        // Only a read of etcd answers below the floor (see
                        // above): its revisions restarted lower. Follow it,
                        // but say so.
                        m.mds_epoch_regressions.fetch_add(1, Ordering::Relaxed);
                        let msg = format!(
                            "the epoch of group {group} went back from {f} to {} (etcd restored from a backup or wiped): following it",
                            v.epoch
                        );
                        eprintln!("kvcellar: discovery: {msg}");
                        core.set_discovery_error(msg);
                    }
                    // Up, or down after etcd went back (then from there).
                    floor = Some(v.epoch);
                    let rule = match v.placement() {
                        Ok(r) => r,
                        Err(msg) => {
                            // A replica that did not check the rule the
                            // client named: refuse the group as for a 422.
                            refuse(&core, &mut first, msg);
                            applied = Some(v.epoch);
                            held = v.members;
                            continue;
                        }
                    };
                    let (members, bad) = members_of(&v);
                    let had = !core.topology().nodes.is_empty();
                    if !bad.is_empty() {
                        // Every client must build the same ring for an epoch:
                        // rather than a ring without this member, keep the
                        // one in use and try again. (Only a malformed record
                        // gets here, never a name that does not resolve.)
                        let msg = format!("view {} of {group}: {}", v.epoch, bad.join("; "));
                        fail(&core, &mut first, Status::Unavailable, msg);
                        pause(stop, poll.min(Duration::from_secs(1)));
                        continue;
                    }
                    if members.is_empty() && had {
                        // An empty view after an MDS or etcd outage (leases
                        // lapsed, nodes not yet back) would drop every page
                        // route at once: keep the ring; cool-downs handle
                        // nodes that are really gone.
                        core.set_discovery_error(format!(
                            "view {} of {group} has no members: keeping the ring in use",
                            v.epoch
                        ));
                    } else {
                        let window = v.handoff_ms.map(Duration::from_millis);
                        // The sets this client holds: its previous ones, and
                        // the current one, which becomes previous now.
                        let topo = core.topology();
                        let held_sets = topo.previous.iter().map(|p| p.epoch).chain([topo.epoch]).collect();
                        core.install(members, rule, Some(v.epoch), previous_of(&v, &held_sets), window);
                    }
                    applied = Some(v.epoch);
                    held = std::mem::take(&mut v.members);
                }
                if let Some(tx) = first.take() {
                    let _ = tx.send(Ok(v.epoch));
                } else if before.is_some() && before != Some(v.epoch) {
                    // An epoch change woke every client's long-poll at once:
                    // come back at a random moment of a short window, so the
                    // replicas do not take all the new long-polls in one
                    // instant. (This view is already in use.)
                    pause(stop, repoll_jitter(poll));
                } else if before == Some(v.epoch) && asked.elapsed() < poll / 2 {
                    // A long-poll that came back early with nothing new (an
                    // old replica, a stale answer): do not spin on it.
                    pause(stop, (poll / 2).min(Duration::from_secs(1)));
                }
            }
            Err(MdsError::Aborted) => break,
            Err(MdsError::Unsupported(msg)) => {
                m.mds_errors.fetch_add(1, Ordering::Relaxed);
                refuse(&core, &mut first, msg);
                // Asks again at the error pace: the group may switch back,
                // or the replicas be told the rule was set by mistake.
                applied = None;
                pause(stop, poll.min(Duration::from_secs(1)));
            }
            Err(e) => {
                m.mds_errors.fetch_add(1, Ordering::Relaxed);
                m.mds_up.store(0, Ordering::Relaxed);
                // A refused token is a misconfiguration: the starter gets
                // KV_EDENIED; the thread keeps asking (the MDS may be
                // given the token later) at the same pace as after errors.
                let st = if matches!(e, MdsError::Denied(_) | MdsError::Forbidden(_)) {
                    Status::Edenied
                } else {
                    Status::Unavailable
                };
                fail(&core, &mut first, st, format!("MDS discovery of group {group}: {e}"));
                // Every replica failed: keep the ring, try again shortly.
                pause(stop, poll.min(Duration::from_secs(1)));
            }
        }
    }
}

/// The group is placed by a rule this build does not know: rather than
/// send keys to members another rule would not pick, serve none (every
/// call answers KV_UNAVAILABLE, and `kv_stats_snapshot` says why).
fn refuse(core: &Client, first: &mut Option<mpsc::Sender<Result<u64, FirstError>>>, msg: String) {
    if !core.topology().nodes.is_empty() {
        core.install(Vec::new(), kv_common::ring::Placement::Ketama, None, Vec::new(), Some(Duration::ZERO));
    }
    fail(core, first, Status::Einval, msg);
}

/// Records a failed round; the first one also answers the starter (who
/// returns KV_UNAVAILABLE while discovery keeps trying behind it).
fn fail(core: &Client, first: &mut Option<mpsc::Sender<Result<u64, FirstError>>>, st: Status, msg: String) {
    core.set_discovery_error(msg.clone());
    if let Some(tx) = first.take() {
        let _ = tx.send(Err((st, msg)));
    }
}

/// The longest wait before the long-poll that follows an epoch change.
/// Measured with 10,000 clients on two replicas (docs/BENCHMARKS.md,
/// "Membership at scale"): re-polls spread over a second leave the replicas
/// free to deliver the change to every client first; a second change within
/// that second reaches a client at most this much later.
const REPOLL_SPREAD: Duration = Duration::from_millis(1000);

/// How long to wait before the long-poll that follows an epoch change: a
/// random share of a window of a quarter of the poll, at most
/// [`REPOLL_SPREAD`].
fn repoll_jitter(poll: Duration) -> Duration {
    let window = (poll / 4).min(REPOLL_SPREAD).as_millis() as usize;
    Duration::from_millis(kv_common::mds::random_below(window + 1) as u64)
}

fn pause(stop: &AtomicBool, d: Duration) {
    let until = std::time::Instant::now() + d;
    while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_common::mds::MemberRecord;

    #[test]
    fn repolls_after_a_change_are_spread_within_a_short_window() {
        let poll = Duration::from_millis(30_000);
        let waits: Vec<Duration> = (0..200).map(|_| repoll_jitter(poll)).collect();
        assert!(waits.iter().all(|w| *w <= Duration::from_millis(1000)));
        let distinct: std::collections::HashSet<_> = waits.iter().collect();
        assert!(distinct.len() > 50, "spread over the window: {}", distinct.len());
        assert!(repoll_jitter(Duration::from_millis(100)) <= Duration::from_millis(25));
    }

    #[test]
    fn dropping_discovery_does_not_wait_out_a_connect_to_a_blackholed_mds() {
        use std::os::fd::AsRawFd;
        // A listener that never accepts, its backlog cut to one: once one
        // connection fills it, further SYNs are dropped and a connect hangs
        // until its timeout (a blackholed address, on loopback).
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // SAFETY: `l` owns this open listening socket; listen() only changes its backlog.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let addr = l.local_addr().unwrap();
        let _fill: Vec<_> = (0..4)
            .filter_map(|_| std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
            .collect();
        let opts = crate::Options { connect_timeout: Duration::from_secs(10), ..Default::default() };
        let core = Arc::new(Client::new(Vec::new(), kv_common::page::Geometry::default(), opts));
        let (d, first) =
            start(core, vec![addr.to_string()], "g".into(), Duration::from_millis(100), Duration::from_millis(200))
                .unwrap();
        assert!(first.is_err(), "no view from a blackholed MDS: {first:?}");
        let t0 = std::time::Instant::now();
        drop(d);
        assert!(t0.elapsed() < Duration::from_secs(2), "drop waited {:?}", t0.elapsed());
    }

    #[test]
    fn a_name_that_does_not_resolve_does_not_hold_the_view_back() {
        let rec =
            |id: &str, addr: &str| MemberRecord { id: id.into(), addr: addr.into(), weight: 1, metrics_addr: None };
        let v = View {
            group: "g".into(),
            epoch: 7,
            members: vec![rec("a", "127.0.0.1:7000"), rec("b", "no-such-host.invalid:7000")],
            previous: vec![],
            handoff_ms: None,
            placement: None,
            delta: None,
        };
        let (members, bad) = members_of(&v);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            members.iter().map(|m| m.addr.as_str()).collect::<Vec<_>>(),
            ["127.0.0.1:7000", "no-such-host.invalid:7000"]
        );
        let v = View { members: vec![rec("c", "no-port")], ..v };
        assert_eq!(members_of(&v).1.len(), 1, "a malformed record is still refused");
    }
}
