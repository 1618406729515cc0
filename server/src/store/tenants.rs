//! Tenants' quotas on a node: each tenant's share of the node split across
//! its disks and its memory tier by capacity (docs/ARCHITECTURE.md,
//! "Tenants"); each tier evicts by them (super::shares).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use kv_common::quota::Quotas;

use super::Store;

impl Store {
    /// The node's capacity the quotas are parts of: its disks' caps, in
    /// service or not.
    pub fn capacity(&self) -> u64 {
        self.specs.iter().map(|s| s.cap).sum()
    }

    /// Puts `quotas` in force on every disk and the memory tier (empty:
    /// none, one LRU per tier as without tenants). Returns one line for
    /// each share larger than the node, and for shares adding up to more.
    pub fn set_quotas(&self, quotas: &Quotas) -> Vec<String> {
        *super::lock(&self.quotas) = quotas.clone();
        for d in self.view().live() {
            d.set_shares(self.disk_shares(d.cap()));
        }
        if let Some(mem) = &self.mem {
            mem.set_shares(self.tier_shares(quotas, mem.cap()));
        }
        quotas.warnings(self.capacity())
    }

    /// The quotas in force.
    pub fn quotas(&self) -> Quotas {
        super::lock(&self.quotas).clone()
    }

    /// Each tenant's share of the node in bytes, by tenant id.
    pub fn quota_bytes(&self) -> HashMap<u32, u64> {
        self.quotas().resolve(self.capacity()).into_iter().collect()
    }

    /// The shares of a disk of `cap` bytes under the quotas in force.
    pub(super) fn disk_shares(&self, cap: u64) -> HashMap<u32, u64> {
        self.tier_shares(&super::lock(&self.quotas), cap)
    }

    /// A tier of `cap` bytes keeps of each share the part its capacity is
    /// of the node's.
    fn tier_shares(&self, quotas: &Quotas, cap: u64) -> HashMap<u32, u64> {
        let node = self.capacity().max(1);
        quotas
            .resolve(node)
            .into_iter()
            .map(|(t, b)| (t, (u128::from(b) * u128::from(cap) / u128::from(node)) as u64))
            .collect()
    }
}

/// Gets and puts of one tenant on this node.
#[derive(Default)]
pub struct OpCounts {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub puts: AtomicU64,
}

/// Tenants a node counts gets and puts of one by one; the rest are
/// counted together ([`OTHER`]).
pub const MAX_COUNTED: usize = 4096;

/// The id the tenants past [`MAX_COUNTED`] are counted under.
pub const OTHER: u32 = u32::MAX;

/// Each tenant's gets and puts: the default tenant's without a lookup,
/// the others' in a map read under a shared lock.
#[derive(Default)]
pub(super) struct TenantOps {
    default: OpCounts,
    other: OpCounts,
    named: RwLock<HashMap<u32, Arc<OpCounts>>>,
}

impl TenantOps {
    pub(super) fn of<R>(&self, key: &[u8], f: impl FnOnce(&OpCounts) -> R) -> R {
        let tenant = crate::tenant::split(key).0;
        if tenant == crate::tenant::DEFAULT {
            return f(&self.default);
        }
        {
            let named = self.named.read().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = named.get(&tenant) {
                return f(c);
            }
            if named.len() >= MAX_COUNTED {
                drop(named);
                return f(&self.other);
            }
        }
        let mut named = self.named.write().unwrap_or_else(|e| e.into_inner());
        if named.len() >= MAX_COUNTED && !named.contains_key(&tenant) {
            drop(named);
            return f(&self.other);
        }
        f(named.entry(tenant).or_default())
    }

    /// Hits, misses and puts by tenant id (the default tenant's always).
    pub(super) fn snapshot(&self) -> Vec<(u32, [u64; 3])> {
        let ld = |c: &OpCounts| {
            [c.hits.load(Ordering::Relaxed), c.misses.load(Ordering::Relaxed), c.puts.load(Ordering::Relaxed)]
        };
        let mut out = vec![(crate::tenant::DEFAULT, ld(&self.default))];
        out.extend(self.named.read().unwrap_or_else(|e| e.into_inner()).iter().map(|(t, c)| (*t, ld(c))));
        let other = ld(&self.other);
        if other != [0; 3] {
            out.push((OTHER, other));
        }
        out
    }
}

impl Store {
    /// Each tenant's hits, misses and puts on this node since it started,
    /// by tenant id ([`OTHER`]: those past [`MAX_COUNTED`]).
    pub fn tenant_ops(&self) -> Vec<(u32, [u64; 3])> {
        self.tenant_ops.snapshot()
    }
}
