//! `kv-server` binary: flags, logging and signals over the node library
//! ([`kv_server::node::Node`]: start, join the group, shut down).

use std::process::ExitCode;

use kv_server::config::{Cli, ServerConfig};
use kv_server::node::Node;

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
    let mut node = Node::start(cfg, rt)?;
    // A line tools and tests can wait for (the real port when --listen used port 0).
    println!("kv-server listening on {}", node.addr());
    // Join the group only now: the node can serve what clients send.
    if node.runtime().block_on(signals.arrived()) {
        tracing::info!("signal received while starting: stopping without joining the group");
        return node.stop();
    }
    if let Err(e) = node.join_group() {
        // Not in the group: stop without a drain, the index checkpointed.
        let _ = node.stop();
        return Err(e);
    }
    node.runtime().block_on(signals.next());
    // The signal streams were made before the first signal: a second one
    // that arrives while the node leaves its group ends the drain.
    node.shutdown(async move { signals.next().await })
}
