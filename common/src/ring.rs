//! Weighted Ketama placement (docs/PROTOCOL.md §4), shared by the client ring and a
//! node's choice among its disks so any tool can recompute where a key lives.

use xxhash_rust::xxh3::xxh3_64;

/// Points each unit of weight contributes.
pub const VNODES_PER_WEIGHT: u64 = 160;

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
    members: Vec<RingMember>,
    /// (point, member index), sorted by point then by member id.
    points: Vec<(u64, u32)>,
    /// `index[b]`: the first position in `points` whose point's top
    /// [`INDEX_BITS`] bits are >= b (length 2^INDEX_BITS + 1), so a lookup
    /// searches only its bucket instead of the whole ring.
    index: Vec<u32>,
}

/// Buckets of the lookup index (4096: a few points each for rings of
/// hundreds to thousands of points).
const INDEX_BITS: u32 = 12;

/// The point of member `id` number `j`.
pub fn vnode_point(id: &str, j: u64) -> u64 {
    xxh3_64(format!("{id}#{j}").as_bytes())
}

/// The point of a key.
pub fn key_point(key: &[u8]) -> u64 {
    xxh3_64(key)
}

impl Ring {
    /// Builds a ring. Weights below 1 count as 1.
    pub fn new(members: Vec<RingMember>) -> Ring {
        let mut points = Vec::new();
        for (i, m) in members.iter().enumerate() {
            let n = VNODES_PER_WEIGHT * u64::from(m.weight.max(1));
            points.reserve(n as usize);
            for j in 0..n {
                points.push((vnode_point(&m.id, j), i as u32));
            }
        }
        points.sort_by(|a, b| {
            a.0.cmp(&b.0).then_with(|| members[a.1 as usize].id.as_bytes().cmp(members[b.1 as usize].id.as_bytes()))
        });
        let buckets = 1usize << INDEX_BITS;
        let mut index = Vec::with_capacity(buckets + 1);
        let mut pos = 0usize;
        for b in 0..buckets {
            while pos < points.len() && ((points[pos].0 >> (64 - INDEX_BITS)) as usize) < b {
                pos += 1;
            }
            index.push(pos as u32);
        }
        index.push(points.len() as u32);
        Ring { members, points, index }
    }

    pub fn members(&self) -> &[RingMember] {
        &self.members
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Index of the member owning `key`, or `None` for an empty ring.
    pub fn owner(&self, key: &[u8]) -> Option<usize> {
        self.owner_of_point(key_point(key))
    }

    /// Index of the member owning a point: the first point >= it, wrapping.
    pub fn owner_of_point(&self, p: u64) -> Option<usize> {
        if self.points.is_empty() {
            return None;
        }
        // Points before the bucket are below p and points after it above:
        // the first point >= p is within the bucket or is its end.
        let b = (p >> (64 - INDEX_BITS)) as usize;
        let (lo, hi) = (self.index[b] as usize, self.index[b + 1] as usize);
        let i = lo + self.points[lo..hi].partition_point(|&(q, _)| q < p);
        let i = if i == self.points.len() { 0 } else { i };
        Some(self.points[i].1 as usize)
    }

    /// Fraction of the hash space each member owns (sums to 1).
    pub fn shares(&self) -> Vec<f64> {
        let mut owned = vec![0u128; self.members.len()];
        let n = self.points.len();
        for k in 0..n {
            let (p, m) = self.points[k];
            // A point owns the arc from its predecessor (exclusive) to itself.
            let prev = if k == 0 { self.points[n - 1].0 } else { self.points[k - 1].0 };
            let arc = if k == 0 { (u64::MAX - prev) as u128 + p as u128 + 1 } else { (p - prev) as u128 };
            owned[m as usize] += arc;
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
    fn wraps_and_empty() {
        assert_eq!(Ring::default().owner(b"x"), None);
        let ring = reference_ring();
        assert!(ring.owner_of_point(u64::MAX).is_some());
    }

    #[test]
    fn bucket_index_agrees_with_a_full_search() {
        for n in [1u32, 2, 3, 7] {
            let r = Ring::new((0..n).map(|i| RingMember { id: format!("m{i}"), weight: i % 3 + 1 }).collect());
            let full = |p: u64| {
                let i = r.points.partition_point(|&(q, _)| q < p);
                r.points[if i == r.points.len() { 0 } else { i }].1 as usize
            };
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut probes: Vec<u64> = vec![0, 1, u64::MAX, u64::MAX - 1];
            probes.extend(r.points.iter().flat_map(|&(q, _)| [q, q.wrapping_add(1), q.wrapping_sub(1)]));
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
}
