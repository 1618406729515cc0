//! The listener: accepts connections under a cap, hands each to
//! [`crate::conn::serve`], runs periodic store upkeep, and on shutdown stops
//! accepting, lets connections finish what they started, then checkpoints
//! the store so the next start trusts it. The state the connections share
//! is [`crate::state`] (re-exported here).

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use crate::state::{Fresh, NodeSettings, Recovery, Shared};
use crate::store::Store;

/// Serves on `listener` until `shutdown` turns true, then drains and
/// checkpoints. Returns the checkpoint's result.
///
/// The accept loop is the one every listener shares
/// ([`kv_common::listen`]): a connection is admitted to one of `max_conns`
/// slots only once its hello is accepted; before that it counts against a
/// small budget of openings with a short deadline, so sockets that never say
/// hello cannot hold the slots of clients that do.
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    max_conns: usize,
    spread: Vec<tokio::runtime::Handle>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let upkeep = tokio::spawn(upkeep(shared.store.clone(), shutdown.clone()));
    let windows = tokio::spawn(heat_windows(shared.clone(), shutdown.clone()));
    let hello_deadline = HELLO_DEADLINE.min(shared.frame_timeout);
    // No limit on the drain: connections end their own within DRAIN_MAX plus
    // the frame they are in, and the checkpoint below must come after every
    // request they started.
    let mut gate = kv_common::listen::Gate::new("data port", max_conns, hello_deadline, None);
    gate.spread = spread;
    let counters = shared.listener.clone();
    kv_common::listen::run(listener, gate, counters, Arc::new(DataPlane(shared.clone())), shutdown).await;
    let _ = upkeep.await;
    let _ = windows.await;
    let store = shared.store.clone();
    let r = tokio::task::spawn_blocking(move || store.close()).await;
    r.unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Time a new connection has for its hello (its first bytes come within a
/// round trip of the connect).
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// The data plane as a service of the shared accept loop.
struct DataPlane(Arc<Shared>);

impl kv_common::listen::Service for DataPlane {
    async fn serve(self: Arc<Self>, conn: kv_common::listen::Accepted) {
        crate::conn::serve(conn, self.0.clone()).await;
    }
}

/// Ends hot keys' windows on time (they may be as short as 100 ms), apart
/// from the store's upkeep, which may wait for a disk.
async fn heat_windows(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = kv_common::listen::stopped(&mut shutdown) => return,
            _ = tick.tick() => {}
        }
        shared.heat.tick(std::time::Instant::now());
    }
}

async fn upkeep(store: Arc<Store>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = kv_common::listen::stopped(&mut shutdown) => return,
            _ = tick.tick() => {}
        }
        let s = store.clone();
        let _ = tokio::task::spawn_blocking(move || {
            s.maintain();
            // After a crash: check recovered payloads at up to 256 MiB/s.
            s.scrub(256 << 20);
        })
        .await;
    }
}
