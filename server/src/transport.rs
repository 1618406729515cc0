//! The payload's way in and out when it does not travel inline in its frame
//! (docs/ARCHITECTURE.md, "Transports"). Over TCP a put's payload follows its
//! header in the frame and a get's record is the answer's body; nothing here
//! is needed. A transport that reaches the client's memory instead (RDMA:
//! [`crate::rdma`]) is used through two calls only: fill this buffer from
//! these segments (a put), deliver this record to these segments (a get).
//! The segments come in the frame (`kv_common::wire::Segment`); a connection
//! sets its remote memory up with one request (RDMA_CONNECT,
//! docs/PROTOCOL.md §2.8), answered by the node's [`Fabric`].

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use kv_common::wire::Segment;

use crate::store::PooledBuf;

/// A transfer in progress; its error is the reason, for the log and the
/// client (which then sends the payload inline).
pub type Transfer<'a, T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;

/// One connection's reach into its client's memory.
pub trait RemoteMemory: Send + Sync {
    /// False once it broke or its transport was turned off: the connection
    /// forgets it and answers over TCP.
    fn usable(&self) -> bool;
    /// Fills `buf[at..at + len]` from `segs` (whose lengths add up to
    /// `len`) and hands the buffer back.
    fn fill<'a>(&'a self, buf: PooledBuf, at: usize, len: usize, segs: &'a [Segment]) -> Transfer<'a, PooledBuf>;
    /// Delivers `rec[at..]` into `segs` (room for it checked by the caller).
    fn deliver<'a>(&'a self, rec: Arc<PooledBuf>, at: usize, segs: &'a [Segment]) -> Transfer<'a, ()>;
    /// A transfer failed: stop the device touching memory now, before the
    /// answer goes out over TCP.
    fn close(&self);
}

/// What a connection-setup request (RDMA_CONNECT) made of its body.
pub struct Setup {
    /// The answer's body.
    pub answer: Vec<u8>,
    /// The connection's remote memory, when it was set up.
    pub remote: Option<Arc<dyn RemoteMemory>>,
}

/// The node's side of a transport: sets up connections' remote memory and
/// reports its counters.
pub trait Fabric: Send + Sync {
    /// Answers the setup request `body` from `peer` (blocking: creating and
    /// connecting a queue pair are system calls). Err: a malformed request,
    /// answered BAD_REQUEST.
    fn connect(&self, peer: SocketAddr, body: &[u8]) -> Result<Setup, String>;
    /// The transports this build carries, for `build_info` (e.g. "tcp,rdma").
    fn built(&self) -> &'static str;
    /// Its metric families (docs/METRICS.md), written to `/metrics`.
    fn encode_metrics(&self, e: &mut prometheus_client::encoding::DescriptorEncoder<'_>) -> std::fmt::Result;
}

/// A connection's remote memory, once set up.
#[derive(Default)]
pub struct Slot(Mutex<Option<Arc<dyn RemoteMemory>>>);

impl Slot {
    /// The remote memory, if there is one and it still works (a broken one
    /// is dropped here: the client reconnects or goes on over TCP).
    pub fn get(&self) -> Option<Arc<dyn RemoteMemory>> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|r| !r.usable()) {
            *g = None;
        }
        g.clone()
    }

    pub fn set(&self, r: Arc<dyn RemoteMemory>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    }

    /// A transfer through `r` failed: close it and stop using it here.
    pub fn failed(&self, r: &Arc<dyn RemoteMemory>) {
        r.close();
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_some_and(|x| Arc::ptr_eq(x, r)) {
            *g = None;
        }
    }
}
