//! What the two daemons (`kv-server`, `kv-mds`) share at start and stop:
//! logging to stderr and waiting for SIGTERM or SIGINT. Behind the `daemon`
//! feature, so the client library does not pull in the runtime's signal
//! handling or the log formatter.

/// Logs at `level` and above to stderr, coloured only on a terminal.
pub fn init_logging(level: tracing::Level) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
