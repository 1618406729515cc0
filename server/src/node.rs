//! A cache node as a library. [`Node::start`] binds the data port, recovers
//! the store, listens and serves; [`Node::join_group`] registers the node
//! with kv-mds; [`Node::shutdown`] does what a SIGTERM asks: leave the
//! group, drain (pushing pages to their owners), stop serving, checkpoint
//! the index (docs/ARCHITECTURE.md, "Connections and the reactor": stopping a node). The `kv-server`
//! binary is a command line and signal handling over it.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ServerConfig;
use crate::membership::Membership;
use crate::server::{self, Shared};
use crate::store::Store;

/// How long a starting node waits for its memory tier to be faulted in
/// before it serves anyway (a gigabyte takes well under a second where
/// measured; docs/BENCHMARKS.md, "Ready means fast").
pub const MEMORY_READY_LIMIT: Duration = Duration::from_secs(60);

/// Connections the kernel queues before the node accepts them.
const LISTEN_BACKLOG: u32 = 1024;

/// How long leaving the group waits for kv-mds's answer.
const LEAVE_LIMIT: Duration = Duration::from_secs(3);

/// A running node: serving on its data port from [`Node::start`] until
/// [`Node::shutdown`] or [`Node::stop`]. End it with one of those two: they
/// stop the accept thread and checkpoint the index, which dropping a
/// `Node` does not (its disks then recover from their journals at the next
/// start, as after a crash).
pub struct Node {
    rt: tokio::runtime::Runtime,
    cfg: ServerConfig,
    shared: Arc<Shared>,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    /// The address the group knows this node by (port 0 made the real one).
    advertised: Option<String>,
    membership: Option<Membership>,
    stop: tokio::sync::watch::Sender<bool>,
    /// The thread driving the data port's accept loop, off the runtime's
    /// workers, as the binary's main thread did before the node was a
    /// library (docs/BENCHMARKS.md, "Set U": no measured difference either
    /// way, so the arrangement every earlier benchmark measured stays).
    served: std::thread::JoinHandle<std::io::Result<()>>,
}

impl Node {
    /// Binds the data port (a port in use fails at once, before any disk
    /// work), recovers the store, waits (bounded) for the memory tier to be
    /// faulted in, then listens and serves on `rt`. Until then a client's
    /// connect is refused at once instead of waiting on a node that cannot
    /// answer yet. The node is not in its group yet: [`Node::join_group`].
    pub fn start(cfg: ServerConfig, rt: tokio::runtime::Runtime) -> Result<Node, String> {
        let socket = {
            let _rt = rt.enter();
            bind_data_port(cfg.listen).map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?
        };
        let metrics = match cfg.metrics_listen {
            Some(a) => Some(
                rt.block_on(tokio::net::TcpListener::bind(a))
                    .map_err(|e| format!("cannot listen on {a} (--metrics-listen): {e}"))?,
            ),
            None => None,
        };
        let started = Instant::now();
        let (store, reports) = Store::open(&cfg.store)?;
        for (d, r) in store.disks().iter().zip(&reports) {
            tracing::info!(
                disk = %d.id, dir = %d.dir.display(), records = r.records, clean = r.clean,
                reclaimed = r.reclaimed, stray_temp_files = r.stray_temp_files,
                torn_journal_bytes = r.torn_journal_bytes, "disk recovered"
            );
        }
        if !cfg.quotas.is_empty() {
            if cfg.membership.is_some() {
                tracing::warn!(
                    "--quotas is for nodes without --mds: this node follows its group's quotas (kvctl tenants --set)"
                );
            } else {
                for w in store.set_quotas(&cfg.quotas) {
                    tracing::warn!("{w}");
                }
                tracing::info!(quotas = %cfg.quotas.to_list(), "tenants' quotas in force");
            }
        }
        if let Some(max) = cfg.store.ack_memory_max {
            tracing::info!(
                max_unflushed_bytes = max,
                flushers = cfg.store.flushers,
                "puts acknowledged once in memory (--ack memory)"
            );
        }
        // Serve at full speed from the first request: the memory tier's
        // arena is faulted in (it started before the disks recovered)
        // before the node listens. A bound on the wait keeps a slow machine
        // serving.
        if !store.wait_memory_ready(MEMORY_READY_LIMIT) {
            tracing::warn!(
                waited_secs = MEMORY_READY_LIMIT.as_secs(),
                "memory tier not faulted in yet: serving anyway (early requests may be slower)"
            );
        }
        let settings = server::NodeSettings {
            idle_timeout: cfg.idle_timeout,
            token: cfg.auth.clone(),
            handoff_window: cfg.handoff,
            node_id: cfg.membership.as_ref().map(|m| m.id.clone()),
            group: cfg.membership.as_ref().map(|m| m.group.clone()),
            recovery: server::Recovery {
                records: reports.iter().map(|r| r.records).sum(),
                reclaimed: reports.iter().map(|r| r.reclaimed).sum(),
                seconds: started.elapsed().as_secs_f64(),
            },
            fabric: Arc::new(crate::rdma::Rdma::start(&cfg.rdma, &store)),
            heat: cfg.heat,
            ..server::NodeSettings::new(cfg.max_record, cfg.max_inflight)
        };
        let shared = Arc::new(Shared::new(store, settings));
        if let Some(w) = cfg.auth_token_file.as_deref().and_then(kv_common::auth::loose_permissions) {
            tracing::warn!("{w}");
        }
        {
            let _rt = rt.enter();
            match (&shared.token, cfg.auth_token_file.clone()) {
                (Some(live), Some(path)) => {
                    let read = move || kv_common::auth::Credentials::read(&path);
                    kv_common::daemon::reload_on_hangup("auth token file", live.clone(), read, |c| {
                        format!("{} credentials", c.entries().len())
                    });
                }
                _ => kv_common::daemon::hangup_reads_nothing("no --auth-token-file: any client is served"),
            }
        }
        let listener = {
            let _rt = rt.enter();
            listen_data_port(socket).map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?
        };
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut metrics_addr = None;
        if let Some(m) = metrics {
            metrics_addr = m.local_addr().ok();
            if let Some(a) = metrics_addr {
                tracing::info!(addr = %a, "metrics listening");
            }
            let labels = crate::metrics::const_labels(shared.node_id.as_deref(), shared.group.as_deref());
            let registry = crate::metrics::registry(&shared, labels);
            rt.spawn(crate::metrics::serve(m, shared.clone(), registry, stopped.clone()));
        }
        let conn_threads = ConnThreads::start(cfg.conn_threads)?;
        let served = {
            let (handle, shared, max_conns) = (rt.handle().clone(), shared.clone(), cfg.max_conns);
            let spread = conn_threads.handles.clone();
            std::thread::Builder::new()
                .name("kv-server-accept".into())
                .spawn(move || {
                    let r = handle.block_on(server::run(listener, shared, max_conns, spread, stopped));
                    // Every connection has ended: their threads stop.
                    conn_threads.stop();
                    r
                })
                .map_err(|e| format!("cannot start the accept thread: {e}"))?
        };
        let advertised = cfg.membership.as_ref().map(|m| match m.advertise.rsplit_once(':') {
            Some((host, "0")) => format!("{host}:{}", addr.port()),
            _ => m.advertise.clone(),
        });
        tracing::info!(
            %addr, auth = cfg.auth.is_some(), recovery_ms = started.elapsed().as_millis() as u64,
            version = env!("CARGO_PKG_VERSION"), "serving"
        );
        Ok(Node { rt, cfg, shared, addr, metrics_addr, advertised, membership: None, stop, served })
    }

    /// The data port's address (the real port when the config named port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics port's address, when there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// What the node serves from (its store, counters and settings).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The runtime the node serves on.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// Registers the node with kv-mds (when the config names a group) and
    /// keeps its lease from a thread of its own. Call once it can serve
    /// what clients send, that is after [`Node::start`].
    pub fn join_group(&mut self) -> Result<(), String> {
        let (Some(mut m), Some(advertise)) = (self.cfg.membership.clone(), self.advertised.clone()) else {
            return Ok(());
        };
        if self.membership.is_some() {
            return Ok(());
        }
        m.metrics_addr = self.metrics_addr.map(|a| crate::metrics::advertised(a, &advertise));
        self.membership = Some(
            Membership::start(m, advertise, self.cfg.auth_token.clone(), {
                let store = self.shared.store.clone();
                Box::new(move |q| {
                    for w in store.set_quotas(q) {
                        tracing::warn!("{w}");
                    }
                })
            })
            .map_err(|e| format!("cannot start the membership thread: {e}"))?,
        );
        Ok(())
    }

    /// Stops at once: no drain, no push (a node asked to stop before it
    /// joined its group). Connections end with their request in flight;
    /// the index is checkpointed.
    pub fn stop(self) -> Result<(), String> {
        self.finish(Duration::ZERO, false, std::future::pending())
    }

    /// What a SIGTERM asks (its log lines are the ones docs/DEPLOY.md
    /// names, "signal received: ..."): leaves the group first (clients
    /// stop routing here while the node still answers what is in flight),
    /// then drains for the configured
    /// time: gets, exists and deletes are answered (clients find this
    /// node's pages through the handoff), puts refused; meanwhile, in a
    /// group with the push on, the node pushes its pages, most recently
    /// used first, to their owners in the group it left. `end_early`
    /// ending ends the drain. Then it stops serving and checkpoints.
    pub fn shutdown(self, end_early: impl Future<Output = ()>) -> Result<(), String> {
        let drain = self.cfg.drain;
        let push = self.cfg.drain_push && self.cfg.membership.is_some();
        if self.cfg.membership.is_some() {
            tracing::info!(drain_secs = drain.as_secs_f64(), "signal received: leaving the group, then draining");
        } else if !drain.is_zero() {
            // Static member lists: no group to leave and no view to push
            // by; clients whose lists change (kv_set_members) read this
            // node's pages through the handoff meanwhile.
            tracing::info!(drain_secs = drain.as_secs_f64(), "signal received: draining (no --mds: no group to leave, pages are not pushed; clients whose member lists no longer name this node read its pages through the handoff)");
        } else {
            tracing::info!("signal received: stopping");
        }
        self.finish(drain, push, end_early)
    }

    fn finish(mut self, drain: Duration, push: bool, end_early: impl Future<Output = ()>) -> Result<(), String> {
        let membership = self.membership.take();
        let Node { rt, cfg, shared, advertised, stop, served, .. } = self;
        rt.block_on(async move {
            shared.draining.store(true, Ordering::SeqCst);
            let ends = Instant::now() + drain;
            let mut left_at = None;
            if let Some(m) = membership {
                left_at = tokio::task::spawn_blocking(move || m.leave(LEAVE_LIMIT)).await.ok().flatten();
            }
            let pushing = match (&cfg.membership, push && !drain.is_zero()) {
                (Some(m), true) => {
                    let (mds, group, id, token) =
                        (m.endpoints.clone(), m.group.clone(), m.id.clone(), cfg.auth_token.clone());
                    let shared = shared.clone();
                    Some(tokio::task::spawn_blocking(move || {
                        push_owned_pages(&shared, &mds, &group, &id, advertised.as_deref(), token, left_at, ends)
                    }))
                }
                _ => None,
            };
            if !drain.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep_until(ends.into()) => tracing::info!("drain over: shutting down"),
                    _ = end_early => tracing::info!("second signal: ending the drain"),
                }
            }
            shared.handoff.push_stop.store(true, Ordering::SeqCst);
            if let Some(p) = pushing {
                // Each push thread stops at its next page (or its 5 s I/O timeout).
                let _ = p.await;
            }
            let _ = stop.send(true);
        });
        match served.join() {
            Ok(Ok(())) => {
                tracing::info!("stopped cleanly");
                Ok(())
            }
            Ok(Err(e)) => Err(format!("checkpoint at shutdown failed: {e}")),
            Err(_) => Err("the data port's accept thread panicked".into()),
        }
    }
}

/// The drain's push (on a blocking thread): pages acknowledged from memory
/// reach their disk first (puts are refused now), so the push, which lists
/// the disks, sends them too; then every page goes to its owner in the
/// group's view, one no older than this node's own leave (`left_at`: a
/// replica may hold an older one that still names it).
#[allow(clippy::too_many_arguments)]
fn push_owned_pages(
    shared: &Shared,
    mds: &[String],
    group: &str,
    id: &str,
    advertised: Option<&str>,
    token: Option<kv_common::auth::Token>,
    left_at: Option<u64>,
    ends: Instant,
) {
    let left = shared.store.flush_behind(ends.saturating_duration_since(Instant::now()));
    if left > 0 {
        tracing::warn!(pages = left, "drain: pages acknowledged from memory not yet on disk are not pushed");
    }
    let mut client = kv_common::mds::MdsClient::new(mds.to_vec(), LEAVE_LIMIT).with_token(token.clone());
    let view = match left_at {
        Some(e) => client.view_at_least(group, e),
        None => client.view(group),
    };
    match view.map_err(|e| e.to_string()).and_then(|v| Ok((v.placement()?, v))) {
        Ok((rule, mut v)) => {
            if crate::drain::without_self(&mut v.members, Some(id), advertised) {
                tracing::warn!(
                    epoch = v.epoch,
                    "drain: the group's view still names this node: it is left out of the push"
                );
            }
            tracing::info!(epoch = v.epoch, owners = v.members.len(), "drain: pushing pages to their owners");
            let r = crate::drain::push_pages(
                &shared.store,
                &shared.handoff,
                &v.members,
                rule,
                token.as_ref(),
                ends,
                crate::drain::PUSH_THREADS,
            );
            crate::drain::log_report(&r);
        }
        Err(e) => tracing::warn!(error = %e, "drain: no view of the group: pages not pushed"),
    }
}

/// The data port, bound (so a port in use fails the start at once) but not
/// yet listening.
///
/// SO_REUSEADDR lets a restarted node rebind its port past the old one's
/// TIME_WAIT sockets, but a bound, not yet listening socket that has it
/// shares its port with any other such socket: a port the kernel picked
/// (port 0) could be bound by another process too, and one of the two then
/// fails at `listen`. So a picked port is bound without it and gets it only
/// just before it listens ([`listen_data_port`]), which is what the
/// connections it accepts inherit.
fn bind_data_port(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let s = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    if addr.port() != 0 {
        s.set_reuseaddr(true)?;
    }
    s.bind(addr)?;
    Ok(s)
}

/// Starts listening on the port [`bind_data_port`] bound, with SO_REUSEADDR.
fn listen_data_port(s: tokio::net::TcpSocket) -> std::io::Result<tokio::net::TcpListener> {
    s.set_reuseaddr(true)?;
    s.listen(LISTEN_BACKLOG)
}

/// The threads of `--conn-threads`: each runs a single-threaded runtime
/// that client connections are placed on, in turn, by the accept loop. A
/// connection's reads, writes and the tasks it spawns stay on its thread:
/// no worker wakes another to steal work (docs/ARCHITECTURE.md, "Threads").
struct ConnThreads {
    handles: Vec<tokio::runtime::Handle>,
    stop: tokio::sync::watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl ConnThreads {
    fn start(n: usize) -> Result<ConnThreads, String> {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut c = ConnThreads { handles: Vec::new(), stop, threads: Vec::new() };
        for i in 0..n {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name("kv-server-conn-io")
                .build()
                .map_err(|e| format!("cannot start a connection runtime: {e}"))?;
            c.handles.push(rt.handle().clone());
            let mut stopped = stopped.clone();
            let t = std::thread::Builder::new()
                .name(format!("kv-conn-{i}"))
                .spawn(move || {
                    rt.block_on(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                })
                .map_err(|e| format!("cannot start a connection thread: {e}"))?;
            c.threads.push(t);
        }
        Ok(c)
    }

    /// Stops the threads (once their connections have ended) and waits for them.
    fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port another server listens on fails the start at once; until the
    /// node is ready a client's connect is refused at once, not left waiting.
    #[test]
    fn a_bound_port_refuses_until_it_listens() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let _rt = rt.enter();
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let taken = bind_data_port(other.local_addr().expect("addr")).map(|_| ()).expect_err("the port is taken");
        assert_eq!(taken.kind(), std::io::ErrorKind::AddrInUse);
        let socket = bind_data_port("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = socket.local_addr().expect("addr");
        let t0 = std::time::Instant::now();
        let e = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5)).expect_err("refused");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(t0.elapsed() < std::time::Duration::from_secs(2), "refused at once");
        let listener = listen_data_port(socket).expect("listen");
        assert_eq!(listener.local_addr().expect("addr"), addr);
        std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5))
            .expect("connects once listening");
    }

    /// A port the kernel picked is the node's alone from the bind on: another
    /// socket with SO_REUSEADDR cannot bind it before the node listens. Once
    /// the node has served on it and stopped, a restart on that port number
    /// binds at once although the closed connections sit in TIME_WAIT.
    #[test]
    fn a_picked_port_is_ours_alone_and_rebinds_after_a_stop() {
        use std::io::{Read, Write};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let _rt = rt.enter();
        let ours = bind_data_port("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = ours.local_addr().expect("addr");
        let other = tokio::net::TcpSocket::new_v4().expect("socket");
        other.set_reuseaddr(true).expect("reuseaddr");
        let e = other.bind(addr).expect_err("the picked port is ours alone");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        drop(other);
        // Serve one connection and close it from the node's side first, so
        // the node's end is the one left in TIME_WAIT.
        let listener = listen_data_port(ours).expect("listen");
        let std_listener = listener.into_std().expect("std");
        std_listener.set_nonblocking(false).expect("blocking");
        let mut client = std::net::TcpStream::connect(addr).expect("connect");
        let (mut served, _) = std_listener.accept().expect("accept");
        served.write_all(b"x").expect("write");
        drop(served);
        let mut b = [0u8; 1];
        assert_eq!(client.read(&mut b).expect("read"), 1);
        assert_eq!(client.read(&mut b).expect("eof"), 0);
        drop(std_listener);
        drop(client);
        let again = bind_data_port(addr).expect("a restart rebinds its port past TIME_WAIT");
        listen_data_port(again).expect("and listens");
    }
}
