//! `kvclient`: the kvcellar client.
//!
//! Status: partial. This issue delivers the blocking single-connection core
//! ([`conn::Conn`]) used by tools and tests: the hello, every data-plane op,
//! and the page-header checks of DESIGN.md §2 on get. The pooled multi-node
//! client, the weighted ring routing and the C ABI (`libkvclient.so`,
//! `include/kvclient.h`) arrive with the client issue and wrap this core.
//! This crate must not depend on the server or on etcd.

pub mod conn;

pub use conn::{ClientError, Conn};
