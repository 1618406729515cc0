//! Which tenants a node's statistics name one by one (docs/METRICS.md,
//! `kvcellar_tenant_*`): the largest [`MAX_TENANTS_SHOWN`] by bytes, each
//! under its name, and the rest summed as `other`.
//!
//! The ranking moves as tenants grow and shrink, and a counter must never
//! go down (Prometheus reads a drop as a restart and counts the whole
//! value again). So `other` sums, for each tenant in it, only what the
//! tenant did since it joined `other` (all of it for a tenant never named
//! before), and keeps what a tenant added while in it once the tenant
//! leaves (named again, or gone from the list). A tenant named again
//! starts its own series anew, with its counts since the node started.

use std::collections::{HashMap, HashSet};

use kv_common::stats::{TenantStats, MAX_TENANTS_SHOWN};

/// A tenant's counters: evictions, those for others, hits, misses, puts.
type Counts = [u64; 5];

fn counts(t: &TenantStats) -> Counts {
    [t.evictions, t.evicted_for_others, t.hits, t.misses, t.puts]
}

fn add_counts(t: &mut TenantStats, c: Counts) {
    t.evictions += c[0];
    t.evicted_for_others += c[1];
    t.hits += c[2];
    t.misses += c[3];
    t.puts += c[4];
}

/// What `now` added since `base` (never below it: see [`Ranking::rank`]).
fn since(now: Counts, base: Counts) -> Counts {
    std::array::from_fn(|i| now[i].saturating_sub(base[i]))
}

/// The ranking's memory from one gather to the next (one at a time).
#[derive(Default)]
pub struct Ranking {
    /// Each tenant summed in `other` at the last gather: its counts when
    /// it joined (zero for one never named), and at that gather.
    in_other: HashMap<u32, (Counts, Counts)>,
    /// What tenants that have left `other` added while they were in it.
    carried: Counts,
    /// The tenants named one by one at the last gather.
    named: HashSet<u32>,
}

impl Ranking {
    /// Splits `all` (each tenant's figures, counters since the node
    /// started) into the named ones, largest holding first, and `other`:
    /// the rest, with `apart` (operations the store counted together past
    /// its limit on tenants). `other` is `None` while it never held or
    /// counted anything.
    pub fn rank(
        &mut self,
        mut all: Vec<(u32, TenantStats)>,
        apart: Option<TenantStats>,
    ) -> (Vec<(u32, TenantStats)>, Option<TenantStats>) {
        all.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(b.1.quota.cmp(&a.1.quota)).then(a.0.cmp(&b.0)));
        let rest = all.split_off(all.len().min(MAX_TENANTS_SHOWN));
        let show = !rest.is_empty() || apart.is_some();
        let mut other = apart.unwrap_or_default();
        let mut now_in = HashMap::with_capacity(rest.len());
        for (id, t) in &rest {
            let now = counts(t);
            let base = match self.in_other.get(id) {
                Some(&(mut base, last)) => {
                    // Should a tenant's own count go down (the store
                    // carries a disk's counts across its leaving service,
                    // so only a counter it does not carry would): what it
                    // added in `other` until then is kept, and it counts
                    // on from its new value.
                    for i in 0..base.len() {
                        if now[i] < last[i] {
                            self.carried[i] += last[i] - base[i];
                            base[i] = now[i];
                        }
                    }
                    base
                }
                None if self.named.contains(id) => now,
                None => [0; 5],
            };
            other.bytes += t.bytes;
            other.objects += t.objects;
            other.quota += t.quota;
            add_counts(&mut other, since(now, base));
            now_in.insert(*id, (base, now));
        }
        for (id, (base, last)) in self.in_other.drain() {
            if !now_in.contains_key(&id) {
                let left = since(last, base);
                self.carried = std::array::from_fn(|i| self.carried[i] + left[i]);
            }
        }
        add_counts(&mut other, self.carried);
        self.in_other = now_in;
        self.named = all.iter().map(|(id, _)| *id).collect();
        let show = show || self.carried != [0; 5];
        (all, show.then(|| TenantStats { tenant: "other".into(), ..other }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(bytes: u64, hits: u64, evictions: u64) -> TenantStats {
        TenantStats { bytes, hits, evictions, ..Default::default() }
    }

    /// `n` tenants (ids 1..=n) of `bytes` each, 10 hits each; tenant
    /// `big` holds `big_bytes` and has `big_hits`.
    fn fleet(n: u32, big: u32, big_bytes: u64, big_hits: u64) -> Vec<(u32, TenantStats)> {
        (1..=n).map(|id| (id, if id == big { t(big_bytes, big_hits, 1) } else { t(1000, 10, 0) })).collect()
    }

    #[test]
    fn up_to_the_limit_every_tenant_is_named_and_there_is_no_other() {
        let mut r = Ranking::default();
        let (named, other) = r.rank(fleet(MAX_TENANTS_SHOWN as u32, 0, 0, 0), None);
        assert_eq!(named.len(), MAX_TENANTS_SHOWN);
        assert!(other.is_none());
        let (_, other) = r.rank(vec![(1, t(5, 0, 0))], Some(t(0, 3, 0)));
        assert_eq!(other.map(|o| o.hits), Some(3), "operations counted apart show as other");
    }

    #[test]
    fn other_never_goes_down_as_tenants_move_in_and_out_of_it() {
        let n = MAX_TENANTS_SHOWN as u32 + 1;
        let mut r = Ranking::default();
        // Tenant 65 (the last id, equal bytes) starts in other with 10 hits.
        let (named, other) = r.rank(fleet(n, 0, 0, 0), None);
        assert!(!named.iter().any(|(id, _)| *id == n));
        let o = other.unwrap();
        assert_eq!((o.tenant.as_str(), o.hits, o.bytes), ("other", 10, 1000));
        // It grows past everyone (25 hits): named, with all of them. Its
        // share of other stays: the 10 hits it had there at the last look.
        // Tenant 64 drops into other at 10 hits: from now on, only what it adds.
        let (named, other) = r.rank(fleet(n, n, 5000, 25), None);
        assert_eq!(named[0].0, n);
        assert_eq!(named[0].1.hits, 25);
        let o = other.unwrap();
        assert_eq!((o.hits, o.bytes), (10, 1000));
        // Tenant 64 does 7 more hits in other.
        let mut all = fleet(n, n, 5000, 25);
        all[63].1.hits = 17;
        let (_, other) = r.rank(all.clone(), None);
        assert_eq!(other.unwrap().hits, 17);
        // Tenant 65 shrinks below everyone: in other again, from its 30 hits
        // and 1 eviction on; 64 is named again and leaves its 7 in other.
        all[64].1 = t(10, 30, 1);
        let (named, other) = r.rank(all.clone(), None);
        assert!(named.iter().any(|(id, _)| *id == 64), "64 named again");
        let o = other.unwrap();
        assert_eq!((o.hits, o.evictions, o.bytes), (17, 0, 10));
        all[64].1 = t(10, 34, 2);
        let (_, other) = r.rank(all, None);
        assert_eq!(other.map(|o| (o.hits, o.evictions)), Some((21, 1)));
    }

    #[test]
    fn other_stays_once_it_counted_something_and_a_tenant_gone_keeps_its_share() {
        let n = MAX_TENANTS_SHOWN as u32 + 1;
        let mut r = Ranking::default();
        let (_, other) = r.rank(fleet(n, 0, 0, 0), None);
        assert_eq!(other.unwrap().hits, 10);
        // Tenant 65 is gone (its records deleted, its counters with them):
        // other keeps its 10 hits and still shows.
        let (named, other) = r.rank(fleet(n - 1, 0, 0, 0), None);
        assert_eq!(named.len(), MAX_TENANTS_SHOWN);
        assert_eq!(other.map(|o| (o.hits, o.bytes)), Some((10, 0)));
    }

    #[test]
    fn a_tenant_whose_own_count_goes_down_leaves_other_where_it_was() {
        let n = MAX_TENANTS_SHOWN as u32 + 1;
        let mut r = Ranking::default();
        let mut all = fleet(n, 0, 0, 0);
        all[64].1.evictions = 50;
        assert_eq!(r.rank(all.clone(), None).1.map(|o| o.evictions), Some(50));
        // Its own count falls to 20 (a counter the store would not carry).
        all[64].1.evictions = 20;
        assert_eq!(r.rank(all.clone(), None).1.map(|o| o.evictions), Some(50));
        // Then it counts on from there.
        all[64].1.evictions = 23;
        assert_eq!(r.rank(all.clone(), None).1.map(|o| o.evictions), Some(53));
        // And as it leaves other for good, other keeps all 53.
        let (_, other) = r.rank(all[..64].to_vec(), None);
        assert_eq!(other.map(|o| o.evictions), Some(53));
    }
}
