//! `kv-common`: the types every kvcellar part agrees on.
//!
//! It owns the page record of docs/PROTOCOL.md §3 ([`page`]), the weighted Ketama
//! placement of §3 ([`ring`]), the data-plane wire frames ([`wire`], byte tables
//! in docs/PROTOCOL.md), the status codes shared by the wire and the C ABI
//! ([`status`]), the node statistics record ([`stats`]) and size parsing
//! ([`size`]). It performs no disk I/O and opens no sockets: encoders and
//! decoders here work on byte slices so that every part (and every fuzz target)
//! uses the same checked code.

pub mod auth;
pub mod cli;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod mds;
pub mod page;
pub mod rdma;
pub mod ring;
pub mod size;
pub mod stats;
pub mod status;
pub mod wire;

pub use page::{Geometry, PageHeader, HEADER_LEN};
pub use ring::Ring;
pub use status::Status;
