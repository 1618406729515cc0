//! The node statistics record a STATS request returns (as JSON), shared by
//! the node that fills it and the tools that print it.

use serde::{Deserialize, Serialize};

/// Per-disk figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DiskStats {
    pub id: String,
    pub dir: String,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub objects: u64,
    pub evictions: u64,
    pub failed: bool,
    #[serde(default)]
    pub failure: Option<String>,
    /// Records recovered after a crash whose payload is not yet checked.
    #[serde(default)]
    pub unverified: u64,
}

/// What an operator needs about one node.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeStats {
    pub version: String,
    pub uptime_secs: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub objects: u64,
    pub hits: u64,
    pub misses: u64,
    pub mismatches: u64,
    pub puts: u64,
    pub put_duplicates: u64,
    pub put_rejected: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub evictions: u64,
    pub failed_disks: u64,
    pub corrupt_dropped: u64,
    /// Records recovered after a crash whose payload is not yet checked.
    #[serde(default)]
    pub unverified: u64,
    pub mem_used_bytes: u64,
    pub mem_capacity_bytes: u64,
    pub mem_hits: u64,
    pub connections: u64,
    /// Connections refused at the hello for a missing or wrong auth token.
    #[serde(default)]
    pub denied_connections: u64,
    /// Connections accepted in protocol v1 (clients of the previous release).
    #[serde(default)]
    pub v1_connections: u64,
    /// Connections refused at the connection cap (`--max-conns`).
    #[serde(default)]
    pub refused_connections: u64,
    pub disks: Vec<DiskStats>,
}
