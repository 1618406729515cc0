//! `kv-mds`: the stateless membership service over etcd.
//!
//! Status: stub. The MDS (etcd leases held for nodes, views with an epoch,
//! long-poll) is built by the membership issue; until then this crate only
//! reserves its place in the workspace. It will be the only etcd client.
