//! `kv-server` binary: flags, logging, store recovery, serve until SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;

use kv_server::config::{Cli, ServerConfig};
use kv_server::server::{self, Shared};
use kv_server::store::Store;

fn main() -> ExitCode {
    let cli: Cli = match kv_common::cli::parse_args("kv-server") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let cfg = match ServerConfig::resolve(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kv-server: error: {e}");
            return ExitCode::from(2);
        }
    };
    kv_common::daemon::init_logging(cfg.log_level);
    match run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-server: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cfg: ServerConfig) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kv-server")
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    // SIGTERM and SIGINT from now on: one that comes while the disks
    // recover (minutes after a crash) stops the node once they are, rather
    // than killing it mid-recovery or, as a container's PID 1, being lost.
    let mut signals = {
        let _rt = rt.enter();
        kv_common::daemon::Signals::new()
    };
    // Bind first: a port in use is reported before any disk work. The
    // socket listens only once the node is ready (below): until then a
    // client's connect is refused at once instead of waiting on a node that
    // cannot answer yet.
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
    let started = std::time::Instant::now();
    let (store, reports) = Store::open(&cfg.store)?;
    for (d, r) in store.disks().iter().zip(&reports) {
        tracing::info!(
            disk = %d.id, dir = %d.dir.display(), records = r.records, clean = r.clean,
            reclaimed = r.reclaimed, stray_temp_files = r.stray_temp_files,
            torn_journal_bytes = r.torn_journal_bytes, "disk recovered"
        );
    }
    let store = Arc::new(store);
    // With --ack memory: writers of what was acknowledged from memory,
    // eight a disk (their puts share each disk's group commits: with two,
    // a group held at most two records and the queue drained slower).
    let flushers = (8 * store.disks().len()).clamp(8, 64);
    Store::start_flushers(&store, flushers).map_err(|e| format!("cannot start the write-behind flushers: {e}"))?;
    // With a memory tier: readers of pages an exist found only on disk.
    Store::start_warmers(&store, 2).map_err(|e| format!("cannot start the prefetch warmers: {e}"))?;
    if let Some(max) = cfg.store.ack_memory_max {
        tracing::info!(max_unflushed_bytes = max, flushers, "puts acknowledged once in memory (--ack memory)");
    }
    // Serve at full speed from the first request: the memory tier's arena
    // is faulted in (it started before the disks recovered) before the
    // node listens. A bound on the wait keeps a slow machine serving.
    let ready = store.wait_memory_ready(MEMORY_READY_LIMIT);
    if !ready {
        tracing::warn!(
            waited_secs = MEMORY_READY_LIMIT.as_secs(),
            "memory tier not faulted in yet: serving anyway (early requests may be slower)"
        );
    }
    let settings = kv_server::server::NodeSettings {
        idle_timeout: cfg.idle_timeout,
        token: cfg.auth_token.clone(),
        handoff_window: cfg.handoff,
        node_id: cfg.membership.as_ref().map(|m| m.id.clone()),
        group: cfg.membership.as_ref().map(|m| m.group.clone()),
        recovery: kv_server::server::Recovery {
            records: reports.iter().map(|r| r.records).sum(),
            reclaimed: reports.iter().map(|r| r.reclaimed).sum(),
            seconds: started.elapsed().as_secs_f64(),
        },
        fabric: Arc::new(kv_server::rdma::Rdma::start(&cfg.rdma, &store)),
        ..kv_server::server::NodeSettings::new(cfg.max_record, cfg.max_inflight)
    };
    let shared = Shared::new(store, settings);
    if let Some(w) = cfg.auth_token_file.as_deref().and_then(kv_common::auth::loose_permissions) {
        tracing::warn!("{w}");
    }
    let shared = Arc::new(shared);
    let listener = {
        let _rt = rt.enter();
        listen_data_port(socket).map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?
    };
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    rt.block_on(async move {
        let mut metrics_addr = None;
        if let Some(m) = metrics {
            metrics_addr = m.local_addr().ok();
            if let Some(a) = metrics_addr {
                tracing::info!(addr = %a, "metrics listening");
            }
            let labels = kv_server::metrics::const_labels(shared.node_id.as_deref(), shared.group.as_deref());
            let registry = kv_server::metrics::registry(&shared, labels);
            tokio::spawn(kv_server::metrics::serve(m, shared.clone(), registry, rx.clone()));
        }
        // Join the group only now: the node can serve what clients send.
        let early = signals.arrived().await;
        if early {
            tracing::info!("signal received while starting: stopping without joining the group");
        }
        // The address the group knows this node by.
        let advertised = cfg.membership.as_ref().map(|m| match m.advertise.rsplit_once(':') {
            Some((host, "0")) => format!("{host}:{}", addr.port()),
            _ => m.advertise.clone(),
        });
        let membership = match (cfg.membership.clone(), advertised.clone()) {
            (Some(mut m), Some(advertise)) if !early => {
                m.metrics_addr = metrics_addr.map(|a| kv_server::metrics::advertised(a, &advertise));
                Some(
                    kv_server::membership::Membership::start(m, advertise, cfg.auth_token.clone())
                        .map_err(|e| format!("cannot start the membership thread: {e}"))?,
                )
            }
            _ => None,
        };
        let drain = if early { std::time::Duration::ZERO } else { cfg.drain };
        let draining = shared.clone();
        // Where the drain pushes pages: the group's view, through kv-mds.
        let push_to = cfg
            .membership
            .as_ref()
            .filter(|_| cfg.drain_push && !early)
            .map(|m| (m.endpoints.clone(), m.group.clone(), m.id.clone(), advertised.clone(), cfg.auth_token.clone()));
        let in_group = cfg.membership.is_some();
        // The signal streams were made before the first signal: a second
        // one that arrives while the node leaves its group ends the drain.
        tokio::spawn(async move {
            if !early {
                signals.next().await;
                if in_group {
                    tracing::info!(drain_secs = drain.as_secs_f64(), "signal received: leaving the group, then draining");
                } else if !drain.is_zero() {
                    // Static member lists: no group to leave and no view to
                    // push by; clients whose lists change (kv_set_members)
                    // read this node's pages through the handoff meanwhile.
                    tracing::info!(drain_secs = drain.as_secs_f64(), "signal received: draining (no --mds: no group to leave, pages are not pushed; clients whose member lists no longer name this node read its pages through the handoff)");
                } else {
                    tracing::info!("signal received: stopping");
                }
            }
            // Leave the group first, so clients stop routing here while
            // the node still answers what is in flight.
            draining.draining.store(true, std::sync::atomic::Ordering::SeqCst);
            let ends = std::time::Instant::now() + drain;
            let mut left_at = None;
            if let Some(m) = membership {
                left_at = tokio::task::spawn_blocking(move || m.leave(std::time::Duration::from_secs(3))).await.ok().flatten();
            }
            // The drain: gets, exists and deletes are answered (clients
            // find this node's pages through the handoff), puts refused;
            // meanwhile the node pushes its pages, most recently used
            // first, to their owners in the group it left. A second signal
            // ends it early.
            let push = match (&push_to, drain.is_zero()) {
                (Some((mds, group, id, advertised, token)), false) => {
                    let (mds, group, id, advertised, token, shared) =
                        (mds.clone(), group.clone(), id.clone(), advertised.clone(), token.clone(), draining.clone());
                    Some(tokio::task::spawn_blocking(move || {
                        // Pages acknowledged from memory reach their disk
                        // first (puts are refused now), so the push, which
                        // lists the disks, sends them too.
                        let left = shared.store.flush_behind(ends.saturating_duration_since(std::time::Instant::now()));
                        if left > 0 {
                            tracing::warn!(pages = left, "drain: pages acknowledged from memory not yet on disk are not pushed");
                        }
                        let mut client = kv_common::mds::MdsClient::new(mds, std::time::Duration::from_secs(3)).with_token(token.clone());
                        // A view no older than this node's own leave (a
                        // replica may hold an older one that still names it).
                        let view = match left_at {
                            Some(e) => client.view_at_least(&group, e),
                            None => client.view(&group),
                        };
                        match view.map_err(|e| e.to_string()).and_then(|v| Ok((v.placement()?, v))) {
                            Ok((rule, mut v)) => {
                                if kv_server::drain::without_self(&mut v.members, Some(&id), advertised.as_deref()) {
                                    tracing::warn!(epoch = v.epoch, "drain: the group's view still names this node: it is left out of the push");
                                }
                                tracing::info!(epoch = v.epoch, owners = v.members.len(), "drain: pushing pages to their owners");
                                let r = kv_server::drain::push_pages(&shared.store, &shared.handoff, &v.members, rule, token.as_ref(), ends, kv_server::drain::PUSH_THREADS);
                                kv_server::drain::log_report(&r);
                            }
                            Err(e) => tracing::warn!(error = %e, "drain: no view of the group: pages not pushed"),
                        }
                    }))
                }
                _ => None,
            };
            if !drain.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep_until(ends.into()) => tracing::info!("drain over: shutting down"),
                    _ = signals.next() => tracing::info!("second signal: ending the drain"),
                }
            }
            draining.handoff.push_stop.store(true, std::sync::atomic::Ordering::SeqCst);
            if let Some(p) = push {
                // Each push thread stops at its next page (or its 5 s I/O timeout).
                let _ = p.await;
            }
            let _ = tx.send(true);
        });
        // A line tools and tests can wait for (the real port when --listen used port 0).
        println!("kv-server listening on {addr}");
        tracing::info!(%addr, auth = cfg.auth_token.is_some(), recovery_ms = started.elapsed().as_millis() as u64, version = env!("CARGO_PKG_VERSION"), "serving");
        server::run(listener, shared, cfg.max_conns, rx)
            .await
            .map_err(|e| format!("checkpoint at shutdown failed: {e}"))
    })?;
    tracing::info!("stopped cleanly");
    Ok(())
}

/// How long a starting node waits for its memory tier to be faulted in
/// before it serves anyway (a gigabyte takes well under a second where
/// measured; docs/BENCHMARKS.md, "Ready means fast").
const MEMORY_READY_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Connections the kernel queues before the node accepts them.
const LISTEN_BACKLOG: u32 = 1024;

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
fn bind_data_port(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let s = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
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
