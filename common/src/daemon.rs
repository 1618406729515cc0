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

/// SIGTERM and SIGINT (Ctrl-C) as they arrive, counted from the moment this
/// is made: a signal delivered while its owner is busy elsewhere (a node
/// leaving its group after the first signal) is still seen by the next
/// [`Signals::next`]. Needs a Tokio runtime.
pub struct Signals {
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    pub fn new() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        let streams = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => None,
        };
        Signals { streams }
    }

    /// Whether a signal came that no [`Signals::next`] took yet (taking
    /// it), without waiting.
    pub async fn arrived(&mut self) -> bool {
        tokio::select! {
            biased;
            _ = self.next() => true,
            _ = std::future::ready(()) => false,
        }
    }

    /// The next signal (or the first not yet waited for).
    pub async fn next(&mut self) {
        match &mut self.streams {
            Some((term, int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

impl Default for Signals {
    fn default() -> Signals {
        Signals::new()
    }
}

/// Reads `target` again with `read` at every SIGHUP, for as long as the
/// runtime runs: a file that reads replaces it (logged with `describe`), one
/// that does not leaves the previous value in use and logs why, one line.
/// Needs a Tokio runtime (spawns a task).
pub fn reload_on_hangup<T: Send + Sync + 'static>(
    what: &'static str,
    target: std::sync::Arc<crate::auth::Reloadable<T>>,
    read: impl Fn() -> Result<T, String> + Send + 'static,
    describe: impl Fn(&T) -> String + Send + 'static,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGHUP: {what} are read at start only");
            return;
        }
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            match read() {
                Ok(v) => {
                    tracing::info!("SIGHUP: {what} read again: {}", describe(&v));
                    target.set(v);
                }
                Err(e) => tracing::error!("SIGHUP: {what} not replaced, the previous ones stay in use: {e}"),
            }
        }
    });
}

/// For a daemon with nothing to read again: SIGHUP logs so, one line each,
/// instead of stopping the process (its default action), so a `reload`
/// never stops a daemon that was started without token files. Needs a
/// Tokio runtime (spawns a task).
pub fn hangup_reads_nothing(why: &'static str) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else { return };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: nothing read again ({why})");
        }
    });
}

/// Says yes at most once per `every`: for a log line that a flood of the
/// same event (refusals, denied tokens) must not repeat for each event.
/// `const`, so it can be a `static` beside the code that logs.
#[derive(Debug)]
pub struct Throttle {
    every: std::time::Duration,
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Throttle {
    pub const fn new(every: std::time::Duration) -> Throttle {
        Throttle { every, last: std::sync::Mutex::new(None) }
    }

    /// True the first time, then once `every` has passed since the last yes.
    pub fn ready(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < self.every) {
            return false;
        }
        *last = Some(std::time::Instant::now());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_says_yes_once_per_period() {
        let t = Throttle::new(std::time::Duration::from_secs(3600));
        assert!(t.ready());
        assert!(!t.ready() && !t.ready());
        let t = Throttle::new(std::time::Duration::ZERO);
        assert!(t.ready() && t.ready());
    }
}
