//! `kv-server`: the kvcellar cache node.
//!
//! It owns the multi-disk page store ([`store`]), the data-plane listener and
//! per-connection handlers ([`server`], [`conn`]), configuration ([`config`])
//! and shutdown ([`shutdown`]). It speaks the wire protocol of `kv-common`
//! and never rewrites a page record: it validates, stores and returns bytes.

pub mod store;
