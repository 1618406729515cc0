//! Placement (docs/PROTOCOL.md §4): which member owns a key, computable from
//! the member list alone by any tool.
//!
//! Two rules, chosen per group by its operator and named in the group's view:
//! - [`Placement::Ketama`] (the default, and a node's choice among its disks):
//!   160 points per unit of weight, a key owned by the member of the first
//!   point at or after the key's point. Its fullest of N equal members owns
//!   about 1.1x the mean share at 3 to 10 members, 1.2x at 100 and 1.25x at
//!   1,000.
//! - [`Placement::MultiProbe`]: 16 points per unit of weight and 64 probes per
//!   key; the key goes to the member whose point follows one of its probes
//!   most closely. The fullest of 1,000 equal members owns 1.02x the mean;
//!   a join moves only the keys the new member takes.

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

/// Points each unit of weight contributes.
pub const VNODES_PER_WEIGHT: u64 = 160;

/// Points each unit of weight contributes under [`Placement::MultiProbe`].
pub const MULTIPROBE_POINTS_PER_WEIGHT: u64 = 16;

/// Probes per key under [`Placement::MultiProbe`].
pub const MULTIPROBE_PROBES: u32 = 64;

/// The rule that places keys on a group's members (docs/PROTOCOL.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// Weighted Ketama: the default, and what a view without a rule means.
    #[default]
    Ketama,
    /// Weighted multi-probe consistent hashing.
    MultiProbe,
}

impl Placement {
    /// Every rule this build knows, in the order clients declare them.
    pub const ALL: [Placement; 2] = [Placement::Ketama, Placement::MultiProbe];

    /// The rule's name in views, etcd and on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Ketama => "ketama",
            Placement::MultiProbe => "multiprobe",
        }
    }

    /// The rule a name stands for; `Err` names the rules this build knows.
    pub fn parse(name: &str) -> Result<Placement, String> {
        Placement::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            format!("placement rule {name:?} is unknown to this build (it knows {})", Placement::known())
        })
    }

    /// The names of [`Placement::ALL`], comma-separated.
    pub fn known() -> String {
        Placement::ALL.map(Placement::name).join(",")
    }

    /// Ring points per unit of weight.
    pub fn points_per_weight(self) -> u64 {
        match self {
            Placement::Ketama => VNODES_PER_WEIGHT,
            Placement::MultiProbe => MULTIPROBE_POINTS_PER_WEIGHT,
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The largest weight a member may have: nodes, kv-mds and clients all
/// refuse more, so a ring never holds more than 1.6 M points per member.
pub const MAX_WEIGHT: u32 = 10_000;

/// One member of a ring: an id and an integer weight (>= 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingMember {
    pub id: String,
    pub weight: u32,
}

/// An immutable ring over members; [`Ring::owner`] returns an index into
/// [`Ring::members`].
#[derive(Debug, Clone, Default)]
pub struct Ring {
    placement: Placement,
    members: Vec<RingMember>,
    /// The points by bucket: `buckets[b]` holds the (point, slot) pairs
    /// whose point's top [`INDEX_BITS`] bits are b (2^INDEX_BITS buckets;
    /// none for an empty ring). A lookup searches only its bucket, and a
    /// ring rebuilt from another shares every bucket no changed member has
    /// a point in.
    buckets: Vec<Bucket>,
    /// `slots[s]`: the index in `members` of the member whose points carry
    /// slot `s` (`u32::MAX`: a slot no point carries). A full build numbers
    /// the slots as the members; [`Ring::rebuilt`] keeps the slots of the
    /// members it keeps, so their points stay as they are, whatever their
    /// new place in the member list.
    slots: Vec<u32>,
    /// Points in all.
    len: usize,
}

/// One bucket of a [`Ring`].
#[derive(Debug, Clone)]
struct Bucket {
    /// Sorted by point, then by the member's id.
    points: Arc<[(u64, u32)]>,
    /// The first (point, slot) of the next non-empty bucket, wrapping:
    /// where a point past this bucket's last one goes.
    next: (u64, u32),
}

/// Buckets of the lookup index (4096: a few points each for rings of
/// hundreds to thousands of points, and a rebuild after one member's join
/// or leave copies a few percent of a 1,000-member ring).
const INDEX_BITS: u32 = 12;

fn bucket_of(p: u64) -> usize {
    (p >> (64 - INDEX_BITS)) as usize
}

/// The point of member `id` number `j`.
pub fn vnode_point(id: &str, j: u64) -> u64 {
    xxh3_64(format!("{id}#{j}").as_bytes())
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// The point of a key.
pub fn key_point(key: &[u8]) -> u64 {
    xxh3_64(key)
}

/// Probe `j` (0-based) of a key whose point is `h` under
/// [`Placement::MultiProbe`]: output `j + 1` of SplitMix64 seeded with `h`.
pub fn probe_point(h: u64, j: u32) -> u64 {
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(u64::from(j) + 1));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Appends member `m`'s points (tagged `i`: its slot): `id#j` hashed, for
/// every j below its weight times the rule's points per weight.
fn push_points(out: &mut Vec<(u64, u32)>, name: &mut Vec<u8>, m: &RingMember, i: u32, placement: Placement) {
    let n = placement.points_per_weight() * u64::from(m.weight.max(1));
    name.clear();
    name.extend_from_slice(m.id.as_bytes());
    name.push(b'#');
    let stem = name.len();
    for j in 0..n {
        name.truncate(stem);
        push_decimal(name, j);
        out.push((xxh3_64(name), i));
    }
}

/// Sorted points (not empty) split into [`Ring`]'s buckets.
fn split_buckets(points: &[(u64, u32)]) -> Vec<Bucket> {
    let empty: Arc<[(u64, u32)]> = Arc::from(Vec::new());
    let mut out = Vec::with_capacity(1 << INDEX_BITS);
    let mut rest = points;
    for b in 0..1usize << INDEX_BITS {
        let n = rest.partition_point(|&(q, _)| bucket_of(q) <= b);
        let points = if n == 0 { empty.clone() } else { Arc::from(&rest[..n]) };
        out.push(Bucket { points, next: (0, 0) });
        rest = &rest[n..];
    }
    link_buckets(&mut out);
    out
}

/// Sets every bucket's `next` (at least one bucket holds a point).
fn link_buckets(buckets: &mut [Bucket]) {
    let Some(mut cur) = buckets.iter().find_map(|b| b.points.first().copied()) else { return };
    for b in buckets.iter_mut().rev() {
        b.next = cur;
        if let Some(&f) = b.points.first() {
            cur = f;
        }
    }
}

impl Ring {
    /// Builds a Ketama ring. Weights below 1 count as 1.
    pub fn new(members: Vec<RingMember>) -> Ring {
        Ring::with_placement(members, Placement::Ketama)
    }

    /// Builds a ring placing keys by `placement`. Weights below 1 count as 1.
    pub fn with_placement(members: Vec<RingMember>, placement: Placement) -> Ring {
        // Clients rebuild their ring on every epoch: no allocation per point,
        // and a sort on integer keys (a member's rank in id order breaks ties
        // between equal points as the rule says: the smaller id first).
        let total: u64 = members.iter().map(|m| placement.points_per_weight() * u64::from(m.weight.max(1))).sum();
        let mut points = Vec::with_capacity(total as usize);
        let mut name = Vec::with_capacity(80);
        for (i, m) in members.iter().enumerate() {
            push_points(&mut points, &mut name, m, i as u32, placement);
        }
        let mut by_id: Vec<u32> = (0..members.len() as u32).collect();
        by_id.sort_by(|&a, &b| members[a as usize].id.as_bytes().cmp(members[b as usize].id.as_bytes()));
        let mut rank = vec![0u32; members.len()];
        for (r, &m) in by_id.iter().enumerate() {
            rank[m as usize] = r as u32;
        }
        points.sort_unstable_by_key(|&(p, m)| (p, rank[m as usize]));
        let slots = (0..members.len() as u32).collect();
        Ring::of_points(placement, members, &points, slots)
    }

    fn of_points(placement: Placement, members: Vec<RingMember>, points: &[(u64, u32)], slots: Vec<u32>) -> Ring {
        if points.is_empty() {
            return Ring { placement, members, slots, ..Ring::default() };
        }
        let buckets = split_buckets(points);
        Ring { placement, members, buckets, slots, len: points.len() }
    }

    /// The ring of `members` under `placement`, built from this one: it
    /// places every key as [`Ring::with_placement`]'s does (its slot numbers
    /// may differ). Members whose id and weight are unchanged keep their
    /// slots and points; only the others are hashed; the buckets holding a
    /// point of a member that joined, left or changed weight are merged
    /// again and every other bucket is shared with this ring. A client
    /// installs a join or a leave of one member among 1,000 in a small
    /// fraction of a full build's time.
    pub fn rebuilt(&self, members: Vec<RingMember>, placement: Placement) -> Ring {
        if placement != self.placement || self.members.is_empty() || members.is_empty() {
            return Ring::with_placement(members, placement);
        }
        // Each id once in the new list, or the full rule decides (a static
        // member list may name an id twice; views never do).
        let mut new_of_id: std::collections::HashMap<&str, u32> =
            std::collections::HashMap::with_capacity(members.len());
        for (i, m) in members.iter().enumerate() {
            if new_of_id.insert(m.id.as_str(), i as u32).is_some() {
                return Ring::with_placement(members, placement);
            }
        }
        // Slots of the members kept (same id, same weight); the points of
        // the other slots are dropped.
        let mut slots = vec![u32::MAX; self.slots.len()];
        let mut kept_new = vec![false; members.len()];
        let mut dropped = false;
        for (s, &o) in self.slots.iter().enumerate() {
            let Some(m) = self.members.get(o as usize) else { continue };
            match new_of_id.get(m.id.as_str()) {
                // (An id the old list named twice keeps one slot.)
                Some(&n) if members[n as usize].weight.max(1) == m.weight.max(1) && !kept_new[n as usize] => {
                    kept_new[n as usize] = true;
                    slots[s] = n;
                }
                _ => dropped = true,
            }
        }
        drop(new_of_id);
        // New members take slots no point of this ring carries, then new
        // ones; a ring whose free slots outgrow its members is built anew.
        let mut free = self.slots.iter().enumerate().filter(|(_, &o)| o == u32::MAX).map(|(s, _)| s);
        let mut fresh = Vec::new();
        let mut name = Vec::with_capacity(80);
        for (i, m) in members.iter().enumerate().filter(|(i, _)| !kept_new[*i]) {
            let s = free.next().unwrap_or_else(|| {
                slots.push(u32::MAX);
                slots.len() - 1
            });
            slots[s] = i as u32;
            push_points(&mut fresh, &mut name, m, s as u32, placement);
        }
        while slots.last() == Some(&u32::MAX) {
            slots.pop();
        }
        if slots.len() > 2 * members.len() + 64 {
            return Ring::with_placement(members, placement);
        }
        let new_id = |s: u32| members[slots[s as usize] as usize].id.as_bytes();
        let old_id = |s: u32| self.members[self.slots[s as usize] as usize].id.as_bytes();
        fresh.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| new_id(a.1).cmp(new_id(b.1))));
        // The buckets holding a dropped point (its member's points hashed
        // again) or a new one are built again; the others are shared.
        let mut dirty: Vec<usize> = fresh.iter().map(|f| bucket_of(f.0)).collect();
        if dropped {
            let mut gone = Vec::new();
            for (s, &o) in self.slots.iter().enumerate() {
                if o != u32::MAX && slots.get(s).is_none_or(|&n| n == u32::MAX) {
                    push_points(&mut gone, &mut name, &self.members[o as usize], s as u32, placement);
                }
            }
            dirty.extend(gone.iter().map(|g| bucket_of(g.0)));
        }
        dirty.sort_unstable();
        dirty.dedup();
        let mut buckets = self.buckets.clone();
        let mut fresh = &fresh[..];
        let mut merged = Vec::new();
        for b in dirty {
            let n = fresh.partition_point(|f| bucket_of(f.0) <= b);
            let (new, later) = fresh.split_at(n);
            fresh = later;
            // Kept points and new ones, by point, then by id.
            merged.clear();
            let mut new = new.iter().peekable();
            for &k in self.buckets[b].points.iter().filter(|k| slots.get(k.1 as usize).is_some_and(|&m| m != u32::MAX))
            {
                while let Some(&&f) = new.peek() {
                    if f.0 < k.0 || (f.0 == k.0 && new_id(f.1) < old_id(k.1)) {
                        merged.push(f);
                        new.next();
                    } else {
                        break;
                    }
                }
                merged.push(k);
            }
            merged.extend(new);
            buckets[b].points = Arc::from(&merged[..]);
        }
        let len = buckets.iter().map(|b| b.points.len()).sum();
        if len == 0 {
            return Ring { placement, members, slots, ..Ring::default() };
        }
        link_buckets(&mut buckets);
        Ring { placement, members, buckets, slots, len }
    }

    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Bytes the ring holds (points, bucket table, slots and member list),
    /// for sizing: an upper bound, as a ring rebuilt from another shares
    /// most buckets with it and empty buckets share one allocation.
    pub fn heap_bytes(&self) -> usize {
        self.len * std::mem::size_of::<(u64, u32)>()
            + self.buckets.capacity() * (std::mem::size_of::<Bucket>() + 16)
            + self.slots.capacity() * std::mem::size_of::<u32>()
            + self.members.iter().map(|m| std::mem::size_of::<RingMember>() + m.id.capacity()).sum::<usize>()
    }

    pub fn members(&self) -> &[RingMember] {
        &self.members
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Index of the member owning `key`, or `None` for an empty ring.
    pub fn owner(&self, key: &[u8]) -> Option<usize> {
        match self.placement {
            Placement::Ketama => self.owner_of_point(key_point(key)),
            Placement::MultiProbe => self.multiprobe_owner(key_point(key)),
        }
    }

    /// The first `n` distinct members (at most all of them) met walking
    /// the ring clockwise from where `key` lands: its owner first, then the
    /// members whose points follow. Computable from the member list alone,
    /// like the owner; a hot key's reads are spread over these
    /// (docs/ARCHITECTURE.md, "Hot keys").
    pub fn owners(&self, key: &[u8], n: usize) -> Vec<usize> {
        let n = n.min(self.members.len());
        let mut out = Vec::with_capacity(n);
        if n == 0 || self.len == 0 {
            return out;
        }
        // Where the key lands: its own point under Ketama, the point of its
        // winning probe under multi-probe (the owner's first point past it).
        let start = match self.placement {
            Placement::Ketama => key_point(key),
            Placement::MultiProbe => self.multiprobe_point(key_point(key)),
        };
        let (mut p, mut slot) = self.successor(start);
        // Members met so far, a bit each (a spread may name hundreds).
        let mut seen = vec![0u64; self.members.len().div_ceil(64)];
        for _ in 0..self.len {
            let m = self.slots[slot as usize] as usize;
            if seen[m / 64] & (1 << (m % 64)) == 0 {
                seen[m / 64] |= 1 << (m % 64);
                out.push(m);
                if out.len() == n {
                    break;
                }
            }
            // The next point: the first past this one (wrapping at the top).
            (p, slot) = self.successor(p.wrapping_add(1));
        }
        out
    }

    /// The winning probe's point of a key whose point is `h` (the ring not
    /// empty): where [`Ring::multiprobe_owner`] lands.
    fn multiprobe_point(&self, h: u64) -> u64 {
        let mut best = (u64::MAX, 0u64);
        for j in 0..MULTIPROBE_PROBES {
            let p = probe_point(h, j);
            let (q, _) = self.successor(p);
            let d = q.wrapping_sub(p);
            if d < best.0 || j == 0 {
                best = (d, p);
            }
        }
        best.1
    }

    /// The multi-probe owner of a key whose point is `h`: of the key's
    /// probes, the one whose next point (wrapping) is nearest decides; on
    /// equal distances the earlier probe wins.
    fn multiprobe_owner(&self, h: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let (_, slot) = self.successor(self.multiprobe_point(h));
        Some(self.slots[slot as usize] as usize)
    }

    /// Index of the member owning a point under Ketama: the first point >=
    /// it, wrapping.
    pub fn owner_of_point(&self, p: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        Some(self.slots[self.successor(p).1 as usize] as usize)
    }

    /// The first (point, slot) at or after p, wrapping (the ring not empty).
    fn successor(&self, p: u64) -> (u64, u32) {
        // Points of earlier buckets are below p and of later ones above:
        // the first point >= p is in p's bucket or the next non-empty one.
        let b = bucket_of(p);
        let bucket = &self.buckets[b];
        let i = bucket.points.partition_point(|&(q, _)| q < p);
        *bucket.points.get(i).unwrap_or(&bucket.next)
    }

    /// Every (point, slot) in order.
    fn points(&self) -> Vec<(u64, u32)> {
        self.buckets.iter().flat_map(|b| b.points.iter().copied()).collect()
    }

    /// Each member's share of keys (sums to 1): under Ketama the fraction of
    /// the hash space its points own; under multi-probe the exact
    /// probability that a key's winning probe falls in one of its arcs.
    pub fn shares(&self) -> Vec<f64> {
        match self.placement {
            Placement::Ketama => self.arc_shares(),
            Placement::MultiProbe => self.multiprobe_shares(),
        }
    }

    /// Each point's arc: from its predecessor (exclusive) to itself, as a
    /// fraction of the hash space.
    fn arcs(points: &[(u64, u32)]) -> Vec<f64> {
        let n = points.len();
        let total = (u64::MAX as f64) + 1.0;
        (0..n)
            .map(|k| {
                let p = points[k].0;
                let prev = if k == 0 { points[n - 1].0 } else { points[k - 1].0 };
                let arc = if n == 1 { u64::MAX as u128 + 1 } else { p.wrapping_sub(prev) as u128 };
                arc as f64 / total
            })
            .collect()
    }

    /// Multi-probe shares. A probe at distance x before a point lies in
    /// that point's arc; with `G(x)` the measure of probes whose distance to
    /// their next point exceeds x (the sum over arcs `a` of max(a - x, 0)),
    /// a point with arc `a` wins a key with probability
    /// `k * integral_0^a G(x)^(k-1) dx` for k probes. G is piecewise linear
    /// between the sorted arc lengths, so the integral is a sum of
    /// `(G(start)^k - G(end)^k) / c` over those pieces, c being the number
    /// of arcs longer than the piece.
    fn multiprobe_shares(&self) -> Vec<f64> {
        let mut out = vec![0f64; self.members.len()];
        let points = self.points();
        if points.is_empty() {
            return out;
        }
        let arcs = Ring::arcs(&points);
        let n = arcs.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| arcs[a].total_cmp(&arcs[b]));
        let k = MULTIPROBE_PROBES as i32;
        // Sum of the arcs from position i (in ascending order) on.
        let mut rest = arcs.iter().sum::<f64>();
        let (mut x0, mut g0, mut acc) = (0f64, 1f64, 0f64);
        for (i, &pt) in order.iter().enumerate() {
            let a = arcs[pt];
            let longer = (n - i) as f64;
            // G at x = a: the arcs from i on, each shortened by a.
            let g1 = (rest - longer * a).max(0.0);
            if a > x0 {
                acc += (g0.powi(k) - g1.powi(k)) / longer;
            }
            out[self.slots[points[pt].1 as usize] as usize] += acc;
            rest -= a;
            (x0, g0) = (a, g1);
        }
        let sum: f64 = out.iter().sum();
        if sum > 0.0 {
            out.iter_mut().for_each(|s| *s /= sum);
        }
        out
    }

    fn arc_shares(&self) -> Vec<f64> {
        let mut owned = vec![0u128; self.members.len()];
        let points = self.points();
        let n = points.len();
        for k in 0..n {
            let (p, m) = points[k];
            // A point owns the arc from its predecessor (exclusive) to itself.
            let prev = if k == 0 { points[n - 1].0 } else { points[k - 1].0 };
            let arc = if k == 0 { (u64::MAX - prev) as u128 + p as u128 + 1 } else { (p - prev) as u128 };
            owned[self.slots[m as usize] as usize] += arc;
        }
        let total = (u64::MAX as f64) + 1.0;
        owned.iter().map(|&o| o as f64 / total).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_ring() -> Ring {
        Ring::new(vec![
            RingMember { id: "n1".into(), weight: 1 },
            RingMember { id: "n2".into(), weight: 2 },
            RingMember { id: "n3".into(), weight: 1 },
        ])
    }

    #[test]
    fn reference_points_and_owners() {
        assert_eq!(vnode_point("n1", 0), 5871587976277132463);
        assert_eq!(vnode_point("n1", 2), 18092196588948305506);
        assert_eq!(vnode_point("n2", 1), 1220977219473610142);
        assert_eq!(vnode_point("n3", 2), 15130129394882933557);
        assert_eq!(key_point(b"key-0"), 9340302149712544120);
        assert_eq!(key_point(b"key-3"), 12615923472555598550);
        let ring = reference_ring();
        let owners = [
            ("key-0", "n2"),
            ("key-1", "n3"),
            ("key-2", "n3"),
            ("key-3", "n3"),
            ("key-4", "n2"),
            ("key-5", "n2"),
            ("key-6", "n2"),
            ("key-7", "n2"),
            ("key-8", "n2"),
            ("key-9", "n2"),
            ("key-10", "n3"),
            ("key-11", "n2"),
            ("key-12", "n3"),
            ("key-13", "n1"),
            ("key-14", "n2"),
            ("key-15", "n2"),
            ("a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9_k", "n2"),
            ("meta-llama/Llama-3.1-8B@8@0@-1a2b3c@bfloat16", "n2"),
        ];
        for (k, want) in owners {
            let i = ring.owner(k.as_bytes()).unwrap();
            assert_eq!(ring.members()[i].id, want, "owner of {k}");
        }
    }

    #[test]
    fn shares_follow_weights() {
        let s = reference_ring().shares();
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(s[1] > 0.4 && s[1] < 0.6, "n2 has weight 2 of 4: {s:?}");
    }

    #[test]
    fn a_keys_owners_start_at_its_owner_and_are_distinct_successors() {
        for placement in [Placement::Ketama, Placement::MultiProbe] {
            let members: Vec<RingMember> = (0..12).map(|i| RingMember { id: format!("node-{i}"), weight: 1 }).collect();
            let ring = Ring::with_placement(members, placement);
            for k in 0..200 {
                let key = format!("key-{k}");
                let all = ring.owners(key.as_bytes(), 64);
                assert_eq!(all.len(), 12, "every member once");
                assert_eq!(Some(all[0]), ring.owner(key.as_bytes()), "{placement}: the owner first");
                let mut seen = all.clone();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), 12);
                assert_eq!(ring.owners(key.as_bytes(), 3), all[..3], "a prefix of the longer list");
            }
            // Without one member, the others keep their order.
            let fewer: Vec<RingMember> =
                (0..12).filter(|&i| i != 5).map(|i| RingMember { id: format!("node-{i}"), weight: 1 }).collect();
            let less = Ring::with_placement(fewer, placement);
            let ids = |r: &Ring, v: Vec<usize>| v.into_iter().map(|i| r.members()[i].id.clone()).collect::<Vec<_>>();
            if placement == Placement::Ketama {
                let mut was = ids(&ring, ring.owners(b"key-7", 12));
                was.retain(|id| id != "node-5");
                assert_eq!(ids(&less, less.owners(b"key-7", 11)), was);
            }
        }
        assert!(Ring::default().owners(b"x", 4).is_empty());
        assert!(reference_ring().owners(b"x", 0).is_empty());
    }

    #[test]
    fn wraps_and_empty() {
        assert_eq!(Ring::default().owner(b"x"), None);
        let ring = reference_ring();
        assert!(ring.owner_of_point(u64::MAX).is_some());
    }

    #[test]
    fn bucket_index_agrees_with_a_full_search() {
        for n in [1u32, 2, 3, 7] {
            let r = Ring::new((0..n).map(|i| RingMember { id: format!("m{i}"), weight: i % 3 + 1 }).collect());
            let points = r.points();
            let full = |p: u64| {
                let i = points.partition_point(|&(q, _)| q < p);
                r.slots[points[if i == points.len() { 0 } else { i }].1 as usize] as usize
            };
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut probes: Vec<u64> = vec![0, 1, u64::MAX, u64::MAX - 1];
            probes.extend(points.iter().flat_map(|&(q, _)| [q, q.wrapping_add(1), q.wrapping_sub(1)]));
            for _ in 0..20_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                probes.push(x);
            }
            for p in probes {
                assert_eq!(r.owner_of_point(p), Some(full(p)), "point {p:#x}, {n} members");
            }
        }
    }

    fn equal(n: usize) -> Vec<RingMember> {
        (0..n).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 }).collect()
    }

    fn max_over_mean(r: &Ring) -> f64 {
        let s = r.shares();
        s.iter().cloned().fold(0.0, f64::max) * s.len() as f64
    }

    /// Vectors from `scripts/placement-vectors.py`, an implementation of
    /// the rule written in Python from docs/PROTOCOL.md alone.
    #[test]
    fn multiprobe_reproduces_the_reference_vectors() {
        let v: serde_json::Value = serde_json::from_str(include_str!("../tests/placement-vectors.json")).unwrap();
        assert_eq!(v["rule"], Placement::MultiProbe.name());
        assert_eq!(v["points_per_weight"], MULTIPROBE_POINTS_PER_WEIGHT);
        assert_eq!(v["probes"], MULTIPROBE_PROBES);
        let small = &v["small"];
        let h = key_point(b"key-0");
        assert_eq!(small["key0_point"], h);
        for j in 0..4 {
            assert_eq!(small["key0_probes"][j as usize], probe_point(h, j), "probe {j}");
        }
        let members: Vec<RingMember> = small["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| RingMember { id: m["id"].as_str().unwrap().into(), weight: m["weight"].as_u64().unwrap() as u32 })
            .collect();
        let check = |r: &Ring, owners: &serde_json::Value, what: &str| {
            for (k, want) in owners.as_object().unwrap() {
                let i = r.owner(k.as_bytes()).unwrap();
                assert_eq!(r.members()[i].id, want.as_str().unwrap(), "{what}: owner of {k}");
            }
        };
        let r = Ring::with_placement(members, Placement::MultiProbe);
        check(&r, &small["owners"], "small");
        for (got, want) in r.shares().iter().zip(small["shares"].as_array().unwrap()) {
            assert!((got - want.as_f64().unwrap()).abs() < 1e-9, "{got} against {want}");
        }
        let fleet = &v["fleet"];
        let f = Ring::with_placement(equal(1000), Placement::MultiProbe);
        check(&f, &fleet["owners"], "fleet");
        assert!((max_over_mean(&f) - fleet["max_over_mean"].as_f64().unwrap()).abs() < 1e-9);
        assert!((f.shares()[0] - fleet["share_gpu_0000"].as_f64().unwrap()).abs() < 1e-12);
        let g = Ring::with_placement(equal(1001), Placement::MultiProbe);
        check(&g, &fleet["owners_after_join"], "fleet after a join");
        assert!((g.shares()[1000] - fleet["joined_share"].as_f64().unwrap()).abs() < 1e-12);
        let mixed = &v["mixed"];
        let members: Vec<RingMember> =
            (0..1000).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 + i % 4 }).collect();
        let total: u32 = members.iter().map(|m| m.weight).sum();
        let m = Ring::with_placement(members.clone(), Placement::MultiProbe);
        check(&m, &mixed["owners"], "mixed");
        let over: Vec<f64> =
            m.shares().iter().zip(&members).map(|(s, mm)| s / (f64::from(mm.weight) / f64::from(total))).collect();
        assert!((over.iter().cloned().fold(0.0, f64::max) - mixed["max_over_fair"].as_f64().unwrap()).abs() < 1e-9);
        assert!((over.iter().cloned().fold(9.0, f64::min) - mixed["min_over_fair"].as_f64().unwrap()).abs() < 1e-9);
    }

    #[test]
    fn multiprobe_keeps_the_fullest_member_within_5_percent_of_the_mean() {
        for n in [3, 10, 100, 1000] {
            let mp = max_over_mean(&Ring::with_placement(equal(n), Placement::MultiProbe));
            let ketama = max_over_mean(&Ring::new(equal(n)));
            println!(
                "{n} equal members: the fullest owns {mp:.4}x the mean under multiprobe, {ketama:.4}x under ketama"
            );
            assert!(mp <= 1.05, "{n} members: the fullest owns {mp:.3}x the mean (ketama: {ketama:.3}x)");
        }
    }

    /// A join moves only the keys the new member takes: at most 1.1/N.
    #[test]
    fn a_multiprobe_join_moves_only_the_keys_the_new_member_takes() {
        let n = 100;
        let before = Ring::with_placement(equal(n), Placement::MultiProbe);
        let after = Ring::with_placement(equal(n + 1), Placement::MultiProbe);
        let keys = 50_000u32;
        let mut moved = 0u32;
        for i in 0..keys {
            let k = format!("page-{i}");
            let (a, b) = (before.owner(k.as_bytes()).unwrap(), after.owner(k.as_bytes()).unwrap());
            if a != b {
                assert_eq!(b, n, "{k} moved between two old members");
                moved += 1;
            }
        }
        let frac = f64::from(moved) / f64::from(keys);
        assert!(frac <= 1.1 / n as f64, "a join moved {frac:.5} of the keys");
        // And at 1,000 members: what moves is the new member's share.
        let grown = Ring::with_placement(equal(1001), Placement::MultiProbe);
        let share = grown.shares()[1000];
        assert!(share <= 1.1 / 1000.0, "a join at 1000 moves {share:.6}");
    }

    /// The exact shares agree with where sampled keys go.
    #[test]
    fn multiprobe_shares_match_sampled_keys() {
        let members: Vec<RingMember> =
            (0..12).map(|i| RingMember { id: format!("node-{i}"), weight: 1 + i % 3 }).collect();
        let r = Ring::with_placement(members, Placement::MultiProbe);
        let keys = 120_000u32;
        let mut got = [0u32; 12];
        for i in 0..keys {
            got[r.owner(format!("k{i}").as_bytes()).unwrap()] += 1;
        }
        for (i, (g, s)) in got.iter().zip(r.shares()).enumerate() {
            let want = s * f64::from(keys);
            let sd = (want * (1.0 - s)).sqrt();
            assert!((f64::from(*g) - want).abs() < 5.0 * sd, "member {i}: {g} keys, expected {want:.0}");
        }
    }

    #[test]
    fn placement_names_round_trip_and_unknown_ones_are_refused() {
        for p in Placement::ALL {
            assert_eq!(Placement::parse(p.name()), Ok(p));
        }
        let e = Placement::parse("jump").unwrap_err();
        assert!(e.contains("\"jump\"") && e.contains("ketama,multiprobe"), "{e}");
        let one = Ring::with_placement(equal(1), Placement::MultiProbe);
        assert_eq!(one.owner(b"x"), Some(0));
        assert_eq!(one.shares(), vec![1.0]);
        assert_eq!(Ring::with_placement(vec![], Placement::MultiProbe).owner(b"x"), None);
    }

    /// The same members, bucket sizes and points, each point naming the same
    /// member (slot numbers may differ), and the same owners at bucket edges
    /// and for sampled keys.
    fn same_placement(a: &Ring, b: &Ring) -> bool {
        let owners = |r: &Ring| r.points().iter().map(|&(p, s)| (p, r.slots[s as usize])).collect::<Vec<_>>();
        let sizes = |r: &Ring| r.buckets.iter().map(|b| b.points.len()).collect::<Vec<_>>();
        let next = |r: &Ring| r.buckets.iter().map(|b| (b.next.0, r.slots[b.next.1 as usize])).collect::<Vec<_>>();
        let edges = (0..1u64 << INDEX_BITS)
            .step_by(61)
            .flat_map(|b| [b << (64 - INDEX_BITS), (b << (64 - INDEX_BITS)).wrapping_sub(1)])
            .chain([0, u64::MAX]);
        a.members == b.members
            && sizes(a) == sizes(b)
            && next(a) == next(b)
            && owners(a) == owners(b)
            && edges.into_iter().all(|p| a.owner_of_point(p) == b.owner_of_point(p))
            && (0..500).all(|i| a.owner(format!("k{i}").as_bytes()) == b.owner(format!("k{i}").as_bytes()))
    }

    fn gpus(n: u32) -> Vec<RingMember> {
        (0..n).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 }).collect()
    }

    #[test]
    fn a_rebuilt_ring_reuses_slots_shares_buckets_and_compacts() {
        for placement in Placement::ALL {
            let full = |m: &[RingMember]| Ring::with_placement(m.to_vec(), placement);
            // A leave frees a slot; the next join takes it.
            let ten = full(&gpus(10));
            let mut nine = gpus(10);
            nine.remove(3);
            let r9 = ten.rebuilt(nine.clone(), placement);
            assert!(same_placement(&r9, &full(&nine)));
            assert_eq!((r9.slots.len(), r9.slots[3]), (10, u32::MAX));
            let mut back = nine.clone();
            back.insert(0, RingMember { id: "gpu-new".into(), weight: 2 });
            let r10 = r9.rebuilt(back.clone(), placement);
            assert!(same_placement(&r10, &full(&back)));
            assert_eq!((r10.slots.len(), r10.slots[3]), (10, 0), "the join took the free slot");
            // A leave and a join at once.
            let mut both = back.clone();
            both.remove(5);
            both.push(RingMember { id: "gpu-other".into(), weight: 1 });
            assert!(same_placement(&r10.rebuilt(both.clone(), placement), &full(&both)));
            // A join shares every bucket without a point of the new member;
            // a reorder shares them all.
            let hundred = full(&gpus(100));
            let mut joined = gpus(100);
            joined.push(RingMember { id: "gpu-new".into(), weight: 1 });
            let j = hundred.rebuilt(joined.clone(), placement);
            assert!(same_placement(&j, &full(&joined)));
            let shared =
                (0..j.buckets.len()).filter(|&b| Arc::ptr_eq(&j.buckets[b].points, &hundred.buckets[b].points)).count();
            let touched = j.buckets.iter().filter(|b| b.points.iter().any(|&(_, s)| s == 100)).count();
            assert_eq!(shared, j.buckets.len() - touched);
            let mut reversed = gpus(100);
            reversed.reverse();
            let r = hundred.rebuilt(reversed.clone(), placement);
            assert!(same_placement(&r, &full(&reversed)));
            assert!((0..r.buckets.len()).all(|b| Arc::ptr_eq(&r.buckets[b].points, &hundred.buckets[b].points)));
            // Free slots past twice the members (plus 64) mean a full build.
            let last = hundred.rebuilt(gpus(100)[99..].to_vec(), placement);
            assert!(same_placement(&last, &full(&gpus(100)[99..])));
            assert_eq!(last.slots, vec![0]);
            let kept = hundred.rebuilt(gpus(100)[65..66].to_vec(), placement);
            assert_eq!(kept.slots.len(), 66, "at the limit: no full build");
            let mut three = gpus(100)[65..66].to_vec();
            three.extend((0..3).map(|i| RingMember { id: format!("late-{i}"), weight: 1 }));
            let filled = kept.rebuilt(three.clone(), placement);
            assert!(same_placement(&filled, &full(&three)));
            assert_eq!(filled.slots.len(), 66, "joins fill the free slots");
        }
    }

    #[test]
    fn a_ring_rebuilt_from_the_last_one_equals_a_full_build() {
        // The same members, index and points, each point naming the same
        // member (slot numbers may differ).
        let same = same_placement;
        for placement in Placement::ALL {
            let mut rng = 0x5eed_u64;
            let mut next = |n: u64| {
                rng = probe_point(rng, 0);
                rng % n
            };
            let mut members: Vec<RingMember> =
                (0..40).map(|i| RingMember { id: format!("gpu-{i:04}"), weight: 1 + i % 3 }).collect();
            let mut ring = Ring::with_placement(members.clone(), placement);
            let mut serial = 40;
            for step in 0..60 {
                match next(5) {
                    // A join, somewhere in the list.
                    0 | 1 => {
                        let at = next(members.len() as u64 + 1) as usize;
                        members.insert(at, RingMember { id: format!("gpu-{serial:04}"), weight: 1 + next(4) as u32 });
                        serial += 1;
                    }
                    // A leave.
                    2 if members.len() > 1 => {
                        members.remove(next(members.len() as u64) as usize);
                    }
                    // A weight change (0 counts as 1).
                    3 => {
                        let at = next(members.len() as u64) as usize;
                        members[at].weight = next(4) as u32;
                    }
                    // Most members leave at once.
                    4 if step % 7 == 0 => members.truncate(members.len() / 4 + 1),
                    // The same set in another order.
                    _ => members.reverse(),
                }
                let full = Ring::with_placement(members.clone(), placement);
                let again = ring.rebuilt(members.clone(), placement);
                assert!(same(&again, &full), "{placement} step {step}: the rebuilt ring differs from a full build");
                assert!(again.slots.len() <= 2 * members.len() + 64, "slots outgrew the members");
                ring = again;
            }
            // Another rule, an empty set, and an id named twice: full builds.
            let other = Placement::ALL.into_iter().find(|p| *p != placement).unwrap();
            assert!(same(&ring.rebuilt(members.clone(), other), &Ring::with_placement(members.clone(), other)));
            assert!(ring.rebuilt(vec![], placement).is_empty());
            let mut twice = members.clone();
            twice.push(members[0].clone());
            let doubled = ring.rebuilt(twice.clone(), placement);
            assert!(same(&doubled, &Ring::with_placement(twice, placement)));
            // From a ring naming an id twice: one of its slots is kept.
            assert!(same(
                &doubled.rebuilt(members.clone(), placement),
                &Ring::with_placement(members.clone(), placement)
            ));
        }
    }
}
