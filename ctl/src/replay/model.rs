//! What a replay could have got, computed from the trace alone: the
//! ceiling (unlimited capacity), an LRU cache of the group's capacity, and
//! the per-window buckets the report groups requests into
//! (docs/BENCHMARKS.md, "Trace replay").

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;

/// Leading hits of each request with unlimited capacity: a page counts
/// when it and every page before it in the request's chain were stored by
/// an earlier request (a request stores its whole chain).
pub fn ceiling<T: Copy + Eq + Hash>(chains: &[&[T]]) -> Vec<u64> {
    let mut stored: HashSet<T> = HashSet::new();
    chains
        .iter()
        .map(|chain| {
            let lead = chain.iter().take_while(|p| stored.contains(p)).count();
            stored.extend(chain.iter().copied());
            lead as u64
        })
        .collect()
}

/// An exact LRU set of at most `cap` entries, with the node's rules
/// (docs/ARCHITECTURE.md, "Eviction and readers"): a get refreshes an
/// entry, an exist does not, a put of a present entry changes nothing and a
/// put of a new one evicts the oldest while the set is full.
pub struct Lru<T> {
    cap: u64,
    clock: u64,
    at: HashMap<T, u64>,
    order: BTreeMap<u64, T>,
}

impl<T: Copy + Eq + Hash> Lru<T> {
    pub fn new(cap: u64) -> Lru<T> {
        Lru { cap, clock: 0, at: HashMap::new(), order: BTreeMap::new() }
    }

    pub fn contains(&self, k: &T) -> bool {
        self.at.contains_key(k)
    }

    /// A get: the entry becomes the most recent.
    pub fn touch(&mut self, k: &T) {
        if let Some(t) = self.at.get_mut(k) {
            self.order.remove(t);
            self.clock += 1;
            *t = self.clock;
            self.order.insert(self.clock, *k);
        }
    }

    /// A put: a new entry enters as the most recent, evicting the oldest.
    pub fn put(&mut self, k: T) {
        if self.cap == 0 || self.at.contains_key(&k) {
            return;
        }
        while self.at.len() as u64 >= self.cap {
            let Some((_, old)) = self.order.pop_first() else { break };
            self.at.remove(&old);
        }
        self.clock += 1;
        self.at.insert(k, self.clock);
        self.order.insert(self.clock, k);
    }
}

/// Leading hits of each request against an LRU cache of `cap` pages, as
/// the replay drives the group: an exist over the chain, a get of the
/// leading hits (refreshing them), a put of the rest.
pub fn lru<T: Copy + Eq + Hash>(chains: &[&[T]], cap: u64) -> Vec<u64> {
    let mut c: Lru<T> = Lru::new(cap);
    chains
        .iter()
        .map(|chain| {
            let lead = chain.iter().take_while(|p| c.contains(*p)).count();
            for p in &chain[..lead] {
                c.touch(p);
            }
            for p in &chain[lead..] {
                c.put(*p);
            }
            lead as u64
        })
        .collect()
}

/// The replay's flow against one LRU per node (each of its node's
/// capacity in pages), a page kept by the node `owner` names: what hash
/// partitioning alone costs against [`lru`] over the pooled capacity.
/// Returns the leading hits of each request and the gets each node served
/// (the leading hits it held).
pub fn lru_partitioned<T: Copy + Eq + Hash>(
    chains: &[&[T]],
    caps: &[u64],
    owner: impl Fn(&T) -> usize,
) -> (Vec<u64>, Vec<u64>) {
    let mut nodes: Vec<Lru<T>> = caps.iter().map(|&c| Lru::new(c)).collect();
    let mut gets = vec![0u64; caps.len()];
    let hits = chains
        .iter()
        .map(|chain| {
            let lead = chain.iter().take_while(|p| nodes.get(owner(p)).is_some_and(|n| n.contains(p))).count();
            for p in &chain[..lead] {
                let o = owner(p);
                nodes[o].touch(p);
                gets[o] += 1;
            }
            for p in &chain[lead..] {
                if let Some(n) = nodes.get_mut(owner(p)) {
                    n.put(*p);
                }
            }
            lead as u64
        })
        .collect();
    (hits, gets)
}

/// The busiest of `counts` against their mean (None when all are 0).
pub fn max_over_mean(counts: &[u64]) -> Option<f64> {
    let loads: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    kv_common::stats::busiest_over_mean(&loads).map(|(_, m)| m)
}

/// The window (index) a trace time in ms falls in.
pub fn window_of(ts_ms: u64, window_ms: u64) -> u64 {
    ts_ms / window_ms.max(1)
}

/// Figures of a set of requests (a window of trace time, or the span after
/// an event).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub requests: u64,
    pub pages: u64,
    pub hits: u64,
    pub ceiling: u64,
}

impl Tally {
    pub fn add(&mut self, pages: u64, hits: u64, ceiling: u64) {
        self.requests += 1;
        self.pages += pages;
        self.hits += hits;
        self.ceiling += ceiling;
    }
}

/// Share of `part` in `all` (0 when `all` is 0).
pub fn rate(part: u64, all: u64) -> f64 {
    if all == 0 {
        0.0
    } else {
        part as f64 / all as f64
    }
}

/// Windows listed at most, empty ones included; beyond that only the
/// windows with requests are listed.
const MAX_WINDOWS: u64 = 100_000;

/// Requests bucketed by window of trace time: (window start in ms, tally),
/// every window from the first request's to the last one's, empty ones
/// included (so a gap shows as a gap) unless there are more than
/// `MAX_WINDOWS` of them.
/// `rows` holds (trace time ms, pages, hits, ceiling hits) per request.
pub fn windows(rows: &[(u64, u64, u64, u64)], window_ms: u64) -> Vec<(u64, Tally)> {
    let window_ms = window_ms.max(1);
    let mut by: BTreeMap<u64, Tally> = BTreeMap::new();
    for &(ts, pages, hits, ceil) in rows {
        by.entry(window_of(ts, window_ms)).or_default().add(pages, hits, ceil);
    }
    let (Some(&first), Some(&last)) = (by.keys().next(), by.keys().next_back()) else {
        return Vec::new();
    };
    if last - first >= MAX_WINDOWS {
        return by.into_iter().map(|(w, t)| (w * window_ms, t)).collect();
    }
    (first..=last).map(|w| (w * window_ms, by.get(&w).copied().unwrap_or_default())).collect()
}

/// The README's figures of a trace, counting every block (partial last
/// blocks too): (blocks, distinct blocks, leading-hit blocks).
pub fn block_figures(hash_chains: &[&[u64]]) -> (u64, u64, u64) {
    let blocks = hash_chains.iter().map(|c| c.len() as u64).sum();
    let distinct = hash_chains.iter().flat_map(|c| c.iter()).collect::<HashSet<_>>().len() as u64;
    (blocks, distinct, ceiling(hash_chains).iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::{parse, Paging};

    #[test]
    fn the_ceiling_counts_leading_pages_stored_earlier() {
        let a: &[u32] = &[1, 2, 3];
        let b: &[u32] = &[1, 2, 4];
        let c: &[u32] = &[1, 5, 3];
        let d: &[u32] = &[1, 2, 4, 6];
        // b: 1, 2 stored by a; c: 1 only (5 is new, so 3 does not count).
        assert_eq!(ceiling(&[a, b, c, d]), vec![0, 2, 1, 3]);
        // Within one request nothing counts: the chain is stored after it.
        let e: &[u32] = &[7, 7];
        assert_eq!(ceiling(&[e]), vec![0]);
    }

    #[test]
    fn the_lru_evicts_the_least_recently_got() {
        let mut c = Lru::new(2);
        c.put(1);
        c.put(2);
        c.touch(&1);
        c.put(3); // evicts 2, the least recently used
        assert!(c.contains(&1) && c.contains(&3) && !c.contains(&2));
        c.put(3); // present: nothing changes
        c.put(4); // evicts 1
        assert!(!c.contains(&1) && c.contains(&3) && c.contains(&4));
        let mut z = Lru::new(0);
        z.put(1);
        assert!(!z.contains(&1));
    }

    #[test]
    fn one_lru_per_node_is_the_pooled_one_with_one_node_and_loses_to_it_when_split() {
        let a: &[u32] = &[1, 2, 3];
        let b: &[u32] = &[1, 2, 4];
        let c: &[u32] = &[5, 6];
        let d: &[u32] = &[1, 2, 3];
        let chains = [a, b, c, d];
        for cap in [4, 5, 100] {
            assert_eq!(lru_partitioned(&chains, &[cap], |_| 0).0, lru(&chains, cap), "cap {cap}");
        }
        // Two nodes of 2 and 3 pages: odd pages on node 0, even on node 1.
        // Pooled (5 pages) d gets 1 and 2; split, node 0 holds 1, 3, 5 in
        // 2 pages, so c's 5 evicts 3 (1 was got by b since): d gets 1, 2.
        let (hits, gets) = lru_partitioned(&chains, &[2, 3], |p| (*p % 2 == 0) as usize);
        assert_eq!(hits, vec![0, 2, 0, 2]);
        assert_eq!(gets, vec![2, 2], "b and d each got 1 from node 0 and 2 from node 1");
        assert_eq!(max_over_mean(&gets), Some(1.0));
        assert_eq!(max_over_mean(&[3, 1]), Some(1.5));
        assert_eq!(max_over_mean(&[0, 0]), None);
        assert_eq!(max_over_mean(&[]), None);
    }

    #[test]
    fn the_lru_simulation_matches_the_ceiling_when_all_fits_and_falls_below_when_not() {
        let a: &[u32] = &[1, 2, 3];
        let b: &[u32] = &[1, 2, 4];
        let c: &[u32] = &[5, 6];
        let d: &[u32] = &[1, 2, 3];
        let chains = [a, b, c, d];
        assert_eq!(lru(&chains, 100), ceiling(&chains));
        // Capacity 5: c's puts evict 3 (1 and 2 were got by b since), so d
        // gets 1 and 2 only.
        assert_eq!(lru(&chains, 5), vec![0, 2, 0, 2]);
        // Capacity 4: c's puts evict 3, then 1: d gets nothing.
        assert_eq!(lru(&chains, 4), vec![0, 2, 0, 0]);
        // Capacity 2: a's own pages push each other out.
        assert_eq!(lru(&chains, 2), vec![0, 0, 0, 0]);
        assert_eq!(lru(&chains, 0), vec![0, 0, 0, 0]);
    }

    #[test]
    fn windows_bucket_by_trace_time_and_keep_empty_ones() {
        let rows = [(0, 4, 1, 2), (9_999, 2, 2, 2), (10_000, 3, 0, 1), (35_000, 1, 1, 1)];
        let w = windows(&rows, 10_000);
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], (0, Tally { requests: 2, pages: 6, hits: 3, ceiling: 4 }));
        assert_eq!(w[1], (10_000, Tally { requests: 1, pages: 3, hits: 0, ceiling: 1 }));
        assert_eq!(w[2], (20_000, Tally::default()));
        assert_eq!(w[3].0, 30_000);
        assert_eq!(window_of(12_345, 1000), 12);
        assert!(windows(&[], 1000).is_empty());
        // Too many windows between the first and the last: the empty ones go.
        let far = windows(&[(0, 1, 0, 0), (10_000_000_000, 1, 1, 1)], 1);
        assert_eq!(far.iter().map(|w| w.0).collect::<Vec<_>>(), vec![0, 10_000_000_000]);
        // Windows start where the first request's window starts.
        assert_eq!(windows(&[(25_000, 1, 0, 0)], 10_000)[0].0, 20_000);
        assert_eq!(rate(1, 4), 0.25);
        assert_eq!(rate(1, 0), 0.0);
    }

    /// The figures traces/README.md gives for the shipped trace.
    #[test]
    fn the_shipped_trace_gives_the_readme_figures() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/conversation_trace.jsonl");
        let f = std::fs::File::open(&path).expect("the shipped trace");
        let reqs = parse(std::io::BufReader::new(f), "conversation_trace.jsonl", 0, None).unwrap();
        assert_eq!(reqs.len(), 12_031);
        let chains: Vec<&[u64]> = reqs.iter().map(|r| &r.hash_ids[..]).collect();
        let (blocks, distinct, lead) = block_figures(&chains);
        assert_eq!((blocks, distinct), (288_500, 182_790));
        assert_eq!(format!("{:.1}%", 100.0 * rate(lead, blocks)), "36.6%");
        // Full pages only (what the replay stores), one page per block.
        let paging = Paging::new(1).unwrap();
        let pages: Vec<_> = reqs.iter().map(|r| paging.pages(r)).collect();
        let chains: Vec<&[_]> = pages.iter().map(|p| &p[..]).collect();
        let all: u64 = chains.iter().map(|c| c.len() as u64).sum();
        let distinct = chains.iter().flat_map(|c| c.iter()).collect::<HashSet<_>>().len();
        let lead: u64 = ceiling(&chains).iter().sum();
        assert_eq!((all, distinct, lead), (276_491, 170_899, 105_592));
    }
}
