//! `kv-common`: the types every kvcellar part agrees on, and the few pieces
//! two parts share.
//!
//! It owns the page record of docs/PROTOCOL.md §3 ([`page`]), the weighted Ketama
//! placement of §3 ([`ring`]), the data-plane wire frames ([`wire`], byte tables
//! in docs/PROTOCOL.md), the status codes shared by the wire and the C ABI
//! ([`status`]), the node statistics record ([`stats`]), size parsing
//! ([`size`]), auth tokens ([`auth`]) and tenants' quotas ([`quota`]). Encoders and decoders work on byte
//! slices, so every part (and every fuzz target) uses the same checked code.
//!
//! Without the `daemon` feature two modules do I/O: [`mds`], the one small
//! blocking HTTP client of the membership API (used by nodes, the client
//! library and kvctl), [`driver`], the request driver every data-plane
//! client shares (one connection type over a blocking or a tokio socket),
//! and [`conn`], a bounded pool of blocking driver connections (the node's
//! drain push uses it). The RDMA
//! transport is its own crate, `kv-rdma`.
//! Behind the `daemon` feature, for kv-server and kv-mds only: logging and
//! signals ([`daemon`]) and the accept loop every listener shares
//! ([`listen`]).

pub mod auth;
pub mod cli;
pub mod conn;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod driver;
pub mod io;
#[cfg(feature = "daemon")]
pub mod listen;
pub mod mds;
pub mod page;
pub mod quota;
pub mod ring;
pub mod size;
pub mod stats;
pub mod status;
pub mod wire;

pub use page::{Geometry, PageHeader, HEADER_LEN};
pub use ring::Ring;
pub use status::Status;
