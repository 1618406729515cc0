//! `kvclient`: the kvcellar client library.
//!
//! Layers: [`options`] and [`members`] (parsing), [`node`] (a node's
//! connection pool and health), [`exchange`] (one request on one connection,
//! zero-copy scatter/gather, streaming CRC, written once for blocking and
//! async sockets over kv-common's request driver; [`answer`] reads a get's
//! answer into the caller's buffers, [`transport`] the remote way a payload
//! that does not travel inline goes, over the seam in [`remote`], which
//! RDMA ([`rdma`]) implements), [`pipeline`] (an
//! exchange run on a node: slots, bounds, stale retries, health),
//! [`handoff`] (the ring handoff, a layer over the pipeline), [`client`]
//! (the async core: ring routing, batches), [`blocking`] (the facade for
//! synchronous callers), [`call`] (a per-thread bound on a whole call), and the C ABI over it (`libkvclient.so`,
//! `include/kvclient.h`). [`conn`] is the one connection type, over a
//! blocking socket also the tools' and tests' single-connection client. This crate must not depend on the server or
//! on etcd.

pub mod answer;
pub mod blocking;
pub mod call;
pub mod client;
pub mod conn;
pub mod discovery;
pub mod error;
pub mod exchange;
pub mod ffi;
pub mod handoff;
pub mod hello;
pub mod hot;
pub mod members;
pub mod metrics;
pub mod node;
pub mod options;
pub mod pipeline;
pub mod rdma;
pub mod remote;
pub mod small;
pub mod topology;
pub mod transport;

pub use blocking::BlockingClient;
pub use client::Client;
pub use conn::Conn;
pub use error::OpError;
pub use options::Options;
