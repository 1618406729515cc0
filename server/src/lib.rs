//! `kv-server`: the kvcellar cache node.
//!
//! It owns the multi-disk page store ([`store`]), the data-plane listener
//! ([`server`]) and per-connection handler ([`conn`]), configuration
//! ([`config`]), the metrics endpoint ([`metrics`]), its membership in a
//! group through kv-mds (`--mds`, [`membership`]) and ring handoff
//! ([`handoff`]). It speaks the wire protocol of `kv-common` and never
//! rewrites a page record: it validates, stores and returns the client's
//! bytes.

pub mod config;
pub mod conn;
pub mod handoff;
pub mod membership;
pub mod metrics;
pub mod server;
pub mod store;
