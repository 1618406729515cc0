//! `kv-server`: the kvcellar cache node.
//!
//! It owns the multi-disk page store ([`store`]), the data-plane listener
//! ([`server`]) and per-connection handler ([`conn`]; its framing in
//! `frame`, the operations in `ops`, and the payload's way in and out when
//! not inline in [`transport`], whose one implementation is [`rdma`]), configuration
//! ([`config`]), the metrics endpoint ([`metrics`]), its membership in a
//! group through kv-mds (`--mds`, [`membership`]) and ring handoff
//! ([`handoff`]). It speaks the wire protocol of `kv-common` and never
//! rewrites a page record: it validates, stores and returns the client's
//! bytes.

mod batch;
pub mod config;
pub mod conn;
pub mod drain;
mod frame;
pub mod handoff;
pub mod heat;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod op_metrics;
mod ops;
pub mod rdma;
pub mod server;
pub mod state;
pub mod store;
pub mod tenant;
mod tenant_rank;
pub mod transport;
