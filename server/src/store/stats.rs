//! The store's counters and its statistics ([`Store::stats`]).

use std::sync::atomic::{AtomicU64, Ordering};

use kv_common::stats::NodeStats;

use super::health::Slot;
use super::Store;

#[derive(Default)]
pub(super) struct Counters {
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) mismatches: AtomicU64,
    pub(super) puts: AtomicU64,
    pub(super) put_duplicates: AtomicU64,
    pub(super) put_rejected: AtomicU64,
    pub(super) bytes_read: AtomicU64,
    pub(super) bytes_written: AtomicU64,
    pub(super) mem_hits: AtomicU64,
    pub(super) misses_corrupt: AtomicU64,
    /// Kept apart (not derived by subtraction) so each exported counter is
    /// monotonic even when read while gets run.
    pub(super) misses_absent: AtomicU64,
    pub(super) disk_hits: AtomicU64,
}

impl Store {
    /// What each tenant holds on the disks in service, summed over them, by
    /// tenant id (crate::tenant): records' extent bytes, records, and their
    /// evictions since the store opened (those of disks since taken out of
    /// service included, so the count never goes down).
    pub fn tenants(&self) -> std::collections::BTreeMap<u32, super::disk::TenantUse> {
        let mut out: std::collections::BTreeMap<u32, super::disk::TenantUse> = Default::default();
        let v = self.view();
        for d in v.live() {
            for (t, u) in d.tenant_use() {
                out.entry(t).or_default().add(&u);
            }
        }
        for (t, [evictions, for_others]) in &v.carried.tenants {
            let u = out.entry(*t).or_default();
            u.evictions += evictions;
            u.evicted_for_others += for_others;
        }
        out
    }

    pub fn stats(&self) -> NodeStats {
        let v = self.view();
        let disks: Vec<_> = v
            .slots
            .iter()
            .zip(&v.carried.disks)
            .map(|(s, c)| {
                let mut st = match s {
                    Slot::Live(d) => d.stats(),
                    Slot::Down(dd) => kv_common::stats::DiskStats {
                        id: dd.id.clone(),
                        dir: dd.dir.display().to_string(),
                        used_bytes: 0,
                        capacity_bytes: dd.cap,
                        objects: 0,
                        evictions: 0,
                        failed: true,
                        failure: Some(dd.failure.clone()),
                        unverified: 0,
                    },
                };
                st.evictions += c[0];
                st
            })
            .collect();
        let corrupt_dropped = v
            .slots
            .iter()
            .zip(&v.carried.disks)
            .map(|(s, c)| {
                c[1] + match s {
                    Slot::Live(d) => d.corrupt_dropped(),
                    Slot::Down(_) => 0,
                }
            })
            .sum();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeStats {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_secs: self.started.elapsed().as_secs(),
            used_bytes: disks.iter().map(|d| d.used_bytes).sum(),
            capacity_bytes: disks.iter().map(|d| d.capacity_bytes).sum(),
            objects: disks.iter().map(|d| d.objects).sum(),
            evictions: disks.iter().map(|d| d.evictions).sum(),
            failed_disks: disks.iter().filter(|d| d.failed).count() as u64,
            corrupt_dropped,
            unverified: disks.iter().map(|d| d.unverified).sum(),
            hits: ld(&self.c.hits),
            misses: ld(&self.c.misses),
            mismatches: ld(&self.c.mismatches),
            puts: ld(&self.c.puts),
            put_duplicates: ld(&self.c.put_duplicates),
            put_rejected: ld(&self.c.put_rejected),
            bytes_read: ld(&self.c.bytes_read),
            bytes_written: ld(&self.c.bytes_written),
            mem_used_bytes: self.mem.as_ref().map_or(0, |m| m.used()),
            mem_capacity_bytes: self.mem.as_ref().map_or(0, |m| m.cap()),
            mem_hits: ld(&self.c.mem_hits),
            connections: 0,
            denied_connections: 0,
            v1_connections: 0,
            refused_connections: 0,
            closed_before_hello: 0,
            misses_corrupt: ld(&self.c.misses_corrupt),
            misses_absent: ld(&self.c.misses_absent),
            disk_hits: ld(&self.c.disk_hits),
            node_id: None,
            group: None,
            latency: Vec::new(),
            disks,
            ack_memory: self.behind.is_some(),
            acked_in_memory: self.behind.as_ref().map_or(0, |b| ld(&b.c.acked)),
            unflushed_bytes: self.behind.as_ref().map_or(0, |b| b.bytes()),
            unflushed_max_bytes: self.behind.as_ref().map_or(0, |b| b.max_bytes()),
            ack_fallbacks: self.behind.as_ref().map_or(0, |b| ld(&b.c.fallbacks)),
            flushed: self.behind.as_ref().map_or(0, |b| ld(&b.c.flushed)),
            flush_failed: self.behind.as_ref().map_or(0, |b| ld(&b.c.flush_failed)),
            warmed: self.warmer.as_ref().map_or(0, |w| ld(&w.c.warmed)),
            warmed_read: self.warmer.as_ref().map_or(0, |w| ld(&w.c.warmed_read)),
            warm_skipped: self.warmer.as_ref().map_or(0, |w| ld(&w.c.skipped)),
            ..NodeStats::default()
        }
    }
}
