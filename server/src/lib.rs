//! `kv-server`: the kvcellar cache node.
//!
//! It owns the multi-disk page store ([`store`]), the data-plane listener
//! ([`server`]) and per-connection handler ([`conn`]), configuration
//! ([`config`]) and the metrics endpoint ([`metrics`]). It speaks the wire
//! protocol of `kv-common` and never rewrites a page record: it validates,
//! stores and returns the client's bytes. Membership (`--mds`) arrives with
//! the MDS issue.

pub mod config;
pub mod conn;
pub mod handoff;
pub mod membership;
pub mod metrics;
pub mod server;
pub mod store;
