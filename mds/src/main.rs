//! `kv-mds` binary: flags, logging, the etcd client, the API until SIGTERM.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

/// kvcellar membership service: node leases in etcd, group views with an
/// epoch, long-poll for clients. Stateless: run as many replicas as you like.
const EXAMPLES: &str = "Examples:
  kv-mds --listen 10.0.0.1:7480 --etcd 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379
  kv-mds --listen 127.0.0.1:7480 --etcd http://127.0.0.1:2379 --lease-ttl 3s   (tests)

Nodes register with `kv-server --mds`; clients follow a group with
`kvctl ring --mds`, the C ABI's kv_start_mds_discovery or KVCELLAR_MDS.";

#[derive(Parser, Debug, Clone)]
#[command(name = "kv-mds", version, about, after_help = EXAMPLES)]
struct Cli {
    /// Address the HTTP/JSON API (and /metrics, /healthz) listens on, IP:PORT.
    #[arg(long, default_value = "127.0.0.1:7480")]
    listen: SocketAddr,
    /// etcd endpoints, comma separated (host:port or http://host:port).
    #[arg(long, default_value = "127.0.0.1:2379")]
    etcd: String,
    /// Time to live of the lease held for each node (e.g. 30s, 3s); nodes
    /// heartbeat every third of it. etcd rounds TTLs below about 2 s up.
    #[arg(long, default_value = "30s", value_parser = kv_mds::parse_duration)]
    lease_ttl: Duration,
    /// How long a group's replaced member sets stay in its views (seconds),
    /// so clients find pages on their previous owners after a join, a leave
    /// or a restart; 0 turns this handoff off for the group's clients.
    #[arg(long, default_value_t = 600)]
    handoff_secs: u64,
    /// Connections open at once (nodes' heartbeats, clients' views and
    /// long-polls); more get a 503 and are closed.
    #[arg(long, default_value_t = 4096)]
    max_conns: usize,
    /// Long-polls waiting at once (at most --max-conns); more get a 503 at once and poll again
    /// later or at another replica. Each waiting long-poll holds a connection and a few KiB.
    #[arg(long, default_value_t = kv_mds::http::MAX_LONG_POLLS)]
    max_long_polls: usize,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
    /// File holding the auth token every group's calls must carry (trimmed; 1-1024 visible ASCII characters), or a table of credentials with roles (docs/DEPLOY.md, "Roles"); /healthz and /metrics need none (default: groups are open).
    #[arg(long)]
    auth_token_file: Option<std::path::PathBuf>,
    /// GROUP=PATH: the token or credential table of one group, taking precedence over --auth-token-file for it; repeat for more groups.
    #[arg(long)]
    group_token_file: Vec<String>,
    /// PEM file of the CA that signed etcd's certificate: talk to etcd over TLS (endpoints without a scheme become https://).
    #[arg(long)]
    etcd_cacert: Option<std::path::PathBuf>,
    /// PEM client certificate presented to etcd (with --etcd-key; for etcd's --client-cert-auth).
    #[arg(long, requires = "etcd_key")]
    etcd_cert: Option<std::path::PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<std::path::PathBuf>,
    /// etcd user (etcd's authentication; with --etcd-password-file). kv-mds then waits at start until etcd authenticates it.
    #[arg(long, requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password (trimmed of surrounding whitespace).
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<std::path::PathBuf>,
}

/// Connections the kernel queues for accept: a fleet's clients all
/// re-poll within a second of an epoch change, more than the usual
/// 1024 (the kernel caps it at net.core.somaxconn).
const BACKLOG: u32 = 8192;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(BACKLOG)
}

fn main() -> ExitCode {
    let cli: Cli = match kv_common::cli::parse_args("kv-mds") {
        Ok(c) => c,
        Err(code) => return code,
    };
    if cli.lease_ttl < Duration::from_secs(1) {
        eprintln!("kv-mds: error: --lease-ttl must be at least 1s");
        return ExitCode::from(2);
    }
    let endpoints: Vec<String> =
        cli.etcd.split(',').map(str::trim).filter(|e| !e.is_empty()).map(String::from).collect();
    if endpoints.is_empty() {
        eprintln!("kv-mds: error: --etcd names no endpoint");
        return ExitCode::from(2);
    }
    if cli.handoff_secs > 7 * 86_400 {
        eprintln!("kv-mds: error: --handoff-secs must be at most 604800 (a week)");
        return ExitCode::from(2);
    }
    if cli.max_conns == 0 {
        eprintln!("kv-mds: error: --max-conns must be at least 1");
        return ExitCode::from(2);
    }
    if cli.max_long_polls == 0 {
        eprintln!("kv-mds: error: --max-long-polls must be at least 1");
        return ExitCode::from(2);
    }
    let (tokens, security) = match tokens(&cli).and_then(|t| Ok((t, etcd_security(&cli)?))) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kv-mds: error: {e}");
            return ExitCode::from(2);
        }
    };
    kv_common::daemon::init_logging(cli.log_level);
    for p in cli
        .auth_token_file
        .iter()
        .map(|p| p.as_path())
        .chain(cli.group_token_file.iter().filter_map(|s| s.split_once('=')).map(|(_, p)| std::path::Path::new(p)))
    {
        if let Some(w) = kv_common::auth::loose_permissions(p) {
            tracing::warn!("{w}");
        }
    }
    match run(cli, endpoints, tokens, security) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-mds: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// The tokens of `--auth-token-file` and every `--group-token-file`.
fn tokens(cli: &Cli) -> Result<kv_common::auth::GroupTokens, String> {
    let mut t = kv_common::auth::GroupTokens::default();
    if let Some(p) = &cli.auth_token_file {
        t.all = Some(kv_common::auth::Credentials::read(p).map_err(|e| format!("--auth-token-file: {e}"))?);
    }
    for spec in &cli.group_token_file {
        t.add_group_spec(spec)?;
    }
    Ok(t)
}

/// The TLS files and etcd user of the flags, read now (a missing file is a
/// start-up error, not a failure at the first call).
fn etcd_security(cli: &Cli) -> Result<kv_mds::EtcdSecurity, String> {
    let read = |flag: &str, p: &std::path::Path| std::fs::read(p).map_err(|e| format!("--{flag} {}: {e}", p.display()));
    let mut s = kv_mds::EtcdSecurity::default();
    if let Some(p) = &cli.etcd_cacert {
        s.ca = Some(read("etcd-cacert", p)?);
    }
    if let (Some(c), Some(k)) = (&cli.etcd_cert, &cli.etcd_key) {
        s.identity = Some((read("etcd-cert", c)?, read("etcd-key", k)?));
    }
    if let (Some(u), Some(p)) = (&cli.etcd_user, &cli.etcd_password_file) {
        let pw = String::from_utf8(read("etcd-password-file", p)?)
            .map_err(|_| format!("--etcd-password-file {}: not text", p.display()))?;
        let pw = pw.trim();
        if pw.is_empty() {
            return Err(format!("--etcd-password-file {}: empty", p.display()));
        }
        s.user = Some((u.clone(), pw.to_string()));
    }
    Ok(s)
}

fn run(
    cli: Cli,
    endpoints: Vec<String>,
    tokens: kv_common::auth::GroupTokens,
    security: kv_mds::EtcdSecurity,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("kv-mds")
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    // Nodes' calls (register, heartbeat, deregister) are served on a
    // runtime of their own, with an etcd client of their own: after a
    // membership change a fleet's long-polls keep the main runtime busy for
    // a while, and a heartbeat must not wait behind them. Two threads, as
    // the main runtime: a fleet's start brings every node's registration
    // (a lease, a record and a view read each) within seconds.
    let nodes = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("kv-mds-nodes")
        .build()
        .map_err(|e| format!("cannot start the nodes' runtime: {e}"))?;
    let node_handle = nodes.handle().clone();
    rt.block_on(async move {
        // SIGTERM and SIGINT from now on: one that comes while kv-mds waits
        // for etcd at start stops it there (as a container's PID 1, a signal
        // with no handler yet would be lost).
        let mut signals = kv_common::daemon::Signals::new();
        let listener = listen(cli.listen).map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let connect = kv_mds::connect(
            &endpoints,
            cli.lease_ttl,
            Duration::from_secs(cli.handoff_secs),
            &security,
            Some(&node_handle),
        );
        let mds = tokio::select! {
            m = connect => m?,
            _ = signals.next() => {
                tracing::info!("signal received while connecting to etcd: stopping");
                return Ok(());
            }
        };
        // Say at start whether etcd answers; the service runs either way.
        match mds.reg.view("_probe").await {
            Ok(_) => tracing::info!(etcd = %endpoints.join(","), "etcd reachable"),
            Err(e) => tracing::error!(error = %e, "etcd does not answer yet: calls fail until it does"),
        }
        tokio::spawn(mds.clone().watch_loop());
        tokio::spawn(mds.clone().sweep_loop());
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            signals.next().await;
            tracing::info!("signal received: shutting down");
            let _ = tx.send(true);
        });
        println!("kv-mds listening on {addr}");
        tracing::info!(%addr, open = tokens.is_open(), lease_ttl_ms = cli.lease_ttl.as_millis() as u64, handoff_secs = cli.handoff_secs, version = env!("CARGO_PKG_VERSION"), "serving");
        let tokens = Arc::new(kv_common::auth::Reloadable::new(tokens));
        if !tokens.get().is_open() {
            let again = cli.clone();
            kv_common::daemon::reload_on_hangup("auth token files", tokens.clone(), move || self::tokens(&again), |t| {
                format!("{} group files, {} credentials for every group", t.groups.len(), t.all.as_ref().map_or(0, |c| c.entries().len()))
            });
        } else {
            kv_common::daemon::hangup_reads_nothing("no --auth-token-file or --group-token-file: every group is open");
        }
        let limits = kv_mds::http::Limits {
            max_conns: cli.max_conns,
            max_long_polls: cli.max_long_polls.min(cli.max_conns),
            tokens,
            nodes: Some(node_handle),
        };
        kv_mds::http::serve(listener, mds, limits, rx).await;
        Ok::<(), String>(())
    })?;
    nodes.shutdown_timeout(Duration::from_secs(1));
    // Leases stay in etcd: nodes heartbeat to another replica, which takes them over.
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_flag_has_help_and_the_man_pages_match() {
        use clap::CommandFactory;
        kv_common::cli::check_command_line(&super::Cli::command());
    }
}
