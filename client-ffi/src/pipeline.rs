//! The async core's request pipeline: an [`Exchange`] (a request and its
//! answer, exchange.rs) run on one node within a time bound, on a
//! connection from the node's pool (node.rs), once more on a fresh one when
//! a pooled one turned out stale, keeping the node's health. The client's
//! operations (client.rs) route keys and run exchanges through it; the
//! ring handoff (handoff.rs) is a layer over it that asks previous owners
//! with its own bound and health rules.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use kv_common::page::Geometry;
use kv_common::status::Status;

use crate::conn::is_stale;
use crate::error::OpError;
use crate::exchange::{self, GetReply, PutItem};
use crate::metrics::Metrics;
use crate::node::{AsyncConn, Node};
use crate::options::Options;

/// One request exchange on a connection, re-runnable for a retry.
pub(crate) trait Exchange {
    type Out;
    /// Runs on `conn`; on Ok the whole answer was read, so the connection
    /// is between frames and goes back to the pool.
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, geo: &'a Geometry) -> BoxFuture<'a, Result<Self::Out, OpError>>;
}

pub(crate) struct PutX<'b> {
    pub(crate) header: [u8; 64],
    pub(crate) key: &'b [u8],
    pub(crate) bufs: &'b [&'b [u8]],
}

impl Exchange for PutX<'_> {
    type Out = ();
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, _geo: &'a Geometry) -> BoxFuture<'a, Result<(), OpError>> {
        Box::pin(async move { exchange::put(conn, &self.header, self.key, self.bufs, 0, 0).await.map(|_| ()) })
    }
}

/// The puts of one BATCH_PUT frame. Per item: Ok, or the node's refusal.
pub(crate) struct PutManyX<'b> {
    pub(crate) items: Vec<PutItem<'b>>,
}

impl Exchange for PutManyX<'_> {
    type Out = Vec<Result<(), OpError>>;
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, _geo: &'a Geometry) -> BoxFuture<'a, Result<Self::Out, OpError>> {
        Box::pin(async move {
            // One by one to a node that no longer takes batch writes
            // (rolled back since its last hello) or whose RDMA bootstrap
            // predates segments in batch items.
            if conn.batch_puts() {
                return exchange::put_batch(conn, &self.items).await;
            }
            let mut out = Vec::with_capacity(self.items.len());
            for it in &self.items {
                match exchange::put(conn, &it.header, it.key, it.bufs, 0, 0).await {
                    Err(e) if !matches!(e, OpError::Node(..)) => return Err(e),
                    r => out.push(r.map(|_| ())),
                }
            }
            Ok(out)
        })
    }
}

/// The deletes of one BATCH_DELETE frame (keys of 1..=1024 bytes).
pub(crate) struct DeleteManyX<'b> {
    pub(crate) keys: Vec<&'b [u8]>,
}

impl Exchange for DeleteManyX<'_> {
    type Out = Vec<Status>;
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, _geo: &'a Geometry) -> BoxFuture<'a, Result<Self::Out, OpError>> {
        Box::pin(async move {
            if conn.batch_writes() {
                return exchange::delete_batch(conn, &self.keys).await;
            }
            let mut out = Vec::with_capacity(self.keys.len());
            for key in &self.keys {
                out.push(exchange::delete(conn, key).await?);
            }
            Ok(out)
        })
    }
}

pub(crate) struct GetX<'b, 'c> {
    pub(crate) key: &'b [u8],
    pub(crate) bufs: &'b mut [&'c mut [u8]],
    /// Request flags beside the get's own (FLAG_HANDOFF for an ask).
    pub(crate) extra: u8,
    /// The spread a hot key is read with, asked at its owner (0: none).
    pub(crate) weight: u8,
}

impl Exchange for GetX<'_, '_> {
    type Out = GetReply;
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, geo: &'a Geometry) -> BoxFuture<'a, Result<GetReply, OpError>> {
        Box::pin(exchange::get(conn, geo, self.key, self.bufs, self.extra, self.weight))
    }
}

pub(crate) struct GetManyX<'b, 'c> {
    pub(crate) items: Vec<(&'b [u8], &'b mut [&'c mut [u8]])>,
    pub(crate) extra: u8,
    /// Per item, as [`GetX::weight`] (empty: none).
    pub(crate) weights: Vec<u8>,
}

impl Exchange for GetManyX<'_, '_> {
    type Out = Vec<GetReply>;
    fn run<'a>(
        &'a mut self,
        conn: &'a mut AsyncConn,
        geo: &'a Geometry,
    ) -> BoxFuture<'a, Result<Vec<GetReply>, OpError>> {
        // A node that takes batch frames gets the window as one BATCH_GET
        // (an RDMA connection whose bootstrap predates segments in batch
        // items keeps one GET an item).
        // A key a batch frame cannot carry (empty, or over the longest key)
        // would get the whole frame refused: such a window goes as GETs,
        // where only that item is refused.
        let keys_fit = self.items.iter().all(|(k, _)| !k.is_empty() && k.len() <= kv_common::page::MAX_KEY_LEN);
        if conn.batch_gets() && keys_fit {
            Box::pin(exchange::get_batch(conn, geo, &mut self.items, self.extra, &self.weights))
        } else {
            Box::pin(exchange::get_pipelined(conn, geo, &mut self.items, self.extra))
        }
    }
}

pub(crate) struct ExistX<'b> {
    pub(crate) key: &'b [u8],
}

impl Exchange for ExistX<'_> {
    type Out = Status;
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, geo: &'a Geometry) -> BoxFuture<'a, Result<Status, OpError>> {
        Box::pin(exchange::exist(conn, geo, self.key))
    }
}

pub(crate) struct DeleteX<'b> {
    pub(crate) key: &'b [u8],
}

impl Exchange for DeleteX<'_> {
    type Out = Status;
    fn run<'a>(&'a mut self, conn: &'a mut AsyncConn, _geo: &'a Geometry) -> BoxFuture<'a, Result<Status, OpError>> {
        Box::pin(exchange::delete(conn, self.key))
    }
}

pub(crate) struct BatchExistX<'b> {
    pub(crate) keys: Vec<&'b [u8]>,
    pub(crate) extra: u8,
}

impl Exchange for BatchExistX<'_> {
    type Out = Vec<Status>;
    fn run<'a>(
        &'a mut self,
        conn: &'a mut AsyncConn,
        geo: &'a Geometry,
    ) -> BoxFuture<'a, Result<Vec<Status>, OpError>> {
        Box::pin(exchange::batch_exist(conn, geo, &self.keys, self.extra))
    }
}

/// One item of a batch get: the key and the buffers its payload fills.
pub type GetItem<'k, 'b> = (&'k [u8], Vec<&'b mut [u8]>);

/// Gets in flight on one connection at once within a batch lane (on a
/// node that takes batch frames: items in one BATCH_GET frame).
pub const PIPELINE_WINDOW: usize = 16;

/// Runs exchanges on nodes, over a handle's options, geometry and metrics.
#[derive(Clone, Copy)]
pub(crate) struct Pipeline<'c> {
    pub(crate) opts: &'c Options,
    pub(crate) geo: &'c Geometry,
    pub(crate) metrics: &'c Metrics,
}

impl Pipeline<'_> {
    /// Runs an exchange on a connection to `node` within the I/O timeout,
    /// retrying once on a fresh connection when a pooled one was stale, and
    /// keeping the node's health.
    pub(crate) async fn run_on<X: Exchange>(&self, node: &Arc<Node>, x: &mut X) -> Result<X::Out, OpError> {
        // Within the call's bound too (call.rs): an exchange cut by it is
        // dropped here, with its connection, before the call returns.
        let deadline: tokio::time::Instant =
            crate::call::clamp((tokio::time::Instant::now() + self.opts.io_timeout).into_std()).into();
        let mut retried = false;
        loop {
            // Waiting for a local slot is not the peer's doing: a timeout
            // there does not start its cool-down.
            let slot = tokio::time::timeout_at(deadline, node.slot()).await.map_err(|_| OpError::LocalTimeout)??;
            let started = std::time::Instant::now();
            if started >= deadline.into_std() {
                return Err(OpError::LocalTimeout);
            }
            let r =
                tokio::time::timeout_at(deadline, self.attempt(node, x, slot, retried)).await.unwrap_or_else(|_| {
                    // Cut by the call's end before it had a fair time: not the node's fault.
                    let e = if crate::call::cut_early(started, deadline.into_std()) {
                        OpError::LocalTimeout
                    } else {
                        OpError::Timeout
                    };
                    Err((e, false))
                });
            match r {
                Ok(out) => {
                    node.mark_ok();
                    return Ok(out);
                }
                Err((e, reused)) if reused && !retried && is_stale(&e) => {
                    // The node closed a pooled connection (restart, idle
                    // reaping): the other idle ones are as dead. One
                    // transparent retry, on a new connection.
                    self.metrics.stale_retries.fetch_add(1, Ordering::Relaxed);
                    node.drop_idle();
                    retried = true;
                }
                Err((e, _)) => return Err(self.failed(node, e)),
            }
        }
    }

    /// Runs an exchange on `node` within `timeout` (a short one of its
    /// own: a handoff ask, a read of a hot key's copy), once more on a
    /// fresh connection when a pooled one was stale. A local wait for a
    /// connection slot that takes the whole time is `LocalTimeout`. Keeps
    /// no health: the caller decides what a failure means.
    pub(crate) async fn run_short<X: Exchange>(
        &self,
        node: &Arc<Node>,
        timeout: std::time::Duration,
        x: &mut X,
    ) -> Result<X::Out, OpError> {
        let deadline: tokio::time::Instant =
            crate::call::clamp((tokio::time::Instant::now() + timeout).into_std()).into();
        let mut retried = false;
        loop {
            let slot = tokio::time::timeout_at(deadline, node.slot()).await.map_err(|_| OpError::LocalTimeout)??;
            let r = tokio::time::timeout_at(deadline, self.attempt(node, x, slot, retried))
                .await
                .unwrap_or(Err((OpError::Timeout, false)));
            match r {
                Ok(out) => return Ok(out),
                Err((e, reused)) if reused && !retried && is_stale(&e) => {
                    node.drop_idle();
                    retried = true;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// One try: (error, whether the connection came from the pool).
    pub(crate) async fn attempt<X: Exchange>(
        &self,
        node: &Arc<Node>,
        x: &mut X,
        slot: tokio::sync::OwnedSemaphorePermit,
        fresh: bool,
    ) -> Result<X::Out, (OpError, bool)> {
        let mut co = node.checkout(slot, self.opts.connect_timeout, fresh).await.map_err(|e| (e, false))?;
        let reused = co.reused;
        match x.run(co.conn(), self.geo).await {
            Ok(out) => {
                co.release();
                Ok(out)
            }
            Err(e) => Err((e, reused)),
        }
    }

    /// Records a failed request to `node` (its cool-down when the peer
    /// is at fault, and why, for the caller's thread).
    pub(crate) fn failed(&self, node: &Node, e: OpError) -> OpError {
        crate::error::note(format!("node {} ({}): {e}", node.id, node.addr));
        if e.is_peer_failure() {
            self.metrics.peer_failures.fetch_add(1, Ordering::Relaxed);
            node.mark_failed(self.opts.peer_cooldown);
        }
        e
    }
}
