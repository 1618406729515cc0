//! The member set a client routes by: the ring, the node behind each ring
//! member, and the earlier sets still inside their handoff window
//! (docs/ARCHITECTURE.md, "Ring transitions"). [`Topology::next`] builds
//! the set that follows one, reusing the nodes (their pools and health)
//! of members whose id, address and weight are unchanged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_common::ring::{Placement, Ring, RingMember};

use crate::members::Member;
use crate::node::Node;

/// The member set in use: the ring and the node behind each ring member.
pub struct Topology {
    pub ring: Arc<Ring>,
    pub nodes: Vec<Arc<Node>>,
    pub epoch: u64,
    /// Earlier member sets still within their handoff window, newest first
    /// (at most [`kv_common::mds::MAX_PREVIOUS_SETS`]); empty when handoff
    /// is off (docs/ARCHITECTURE.md, "Ring transitions").
    pub previous: Vec<Arc<Previous>>,
}

/// An earlier member set: a key that misses at its owner is asked at its
/// owner in this set until `until`.
pub struct Previous {
    pub epoch: u64,
    pub ring: Arc<Ring>,
    pub nodes: Vec<Arc<Node>>,
    pub until: Instant,
}

/// A member set from a kv-mds view's `previous`: its epoch, its members,
/// the rule that placed keys on them, and the time its window has left.
pub type GivenSet = (u64, Vec<Member>, Placement, Duration);

fn ring_members(members: &[Member]) -> Vec<RingMember> {
    members.iter().map(|m| RingMember { id: m.id.clone(), weight: m.weight }).collect()
}

fn ring_of(members: &[Member], placement: Placement) -> Ring {
    Ring::with_placement(ring_members(members), placement)
}

/// What places a node: its id, address and weight.
type Placed<'a> = (&'a str, &'a str, u32);

fn placed(n: &Node) -> Placed<'_> {
    (n.id.as_str(), n.addr.as_str(), n.weight)
}

/// A digest of what places a node: installs find nodes by it (checking the
/// node found), without copying ids and addresses or hashing them twice.
fn digest((id, addr, weight): Placed<'_>) -> u64 {
    kv_common::ring::key_point(id.as_bytes()).rotate_left(21)
        ^ kv_common::ring::key_point(addr.as_bytes())
        ^ u64::from(weight)
}

/// A hasher for keys that are already digests (or pointers): one multiply
/// spreads their bits over the table.
#[derive(Default)]
struct Spread(u64);

impl std::hash::Hasher for Spread {
    fn finish(&self) -> u64 {
        // The table indexes by the low bits: bring the product's high bits
        // there (a pointer's low bits are alignment zeros, and stay so
        // through the multiply).
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

type DigestMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<Spread>>;

/// A member set by digest, or `None` when two of its entries share one (the
/// same member named twice, or a digest collision): such a set is never
/// taken for an unchanged one.
fn member_set<'a>(set: impl ExactSizeIterator<Item = Placed<'a>>) -> Option<DigestMap<Placed<'a>>> {
    let mut out = DigestMap::with_capacity_and_hasher(set.len(), Default::default());
    for p in set {
        if out.insert(digest(p), p).is_some() {
            return None;
        }
    }
    Some(out)
}

/// Whether two member sets place every key alike (the same ids, addresses
/// and weights, in any order).
fn same_sets(a: Option<&DigestMap<Placed<'_>>>, b: Option<&DigestMap<Placed<'_>>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.len() == b.len() && a.iter().all(|(d, p)| b.get(d) == Some(p)),
        _ => false,
    }
}

impl Topology {
    /// No members yet.
    pub fn empty() -> Topology {
        Topology { ring: Arc::default(), nodes: vec![], epoch: 0, previous: vec![] }
    }

    /// The topology of `members` placed by `placement` at `epoch`, after
    /// this one. This set is kept as a previous one for `window` (zero: the
    /// handoff is off, no previous set is kept), with the sets still in
    /// theirs and those a kv-mds view names (`given`; its time left wins
    /// for an epoch both have). `make` builds the node of a member not
    /// held yet.
    pub fn next(
        &self,
        members: &[Member],
        placement: Placement,
        epoch: u64,
        given: Vec<GivenSet>,
        window: Duration,
        make: impl Fn(&Member) -> Node,
    ) -> Topology {
        let old = self;
        let now = Instant::now();
        // Nodes whose id, address and weight are unchanged are reused (with
        // their pools and health), from the current set or a previous one.
        let mut known: DigestMap<Arc<Node>> = old
            .nodes
            .iter()
            .chain(old.previous.iter().flat_map(|p| p.nodes.iter()))
            .map(|n| (digest(placed(n)), n.clone()))
            .collect();
        let mut node_for = |m: &Member| -> Arc<Node> {
            let k = (m.id.as_str(), m.addr.as_str(), m.weight);
            let d = digest(k);
            if let Some(n) = known.get(&d).filter(|n| placed(n) == k) {
                return n.clone();
            }
            let n = Arc::new(make(m));
            known.insert(d, n.clone());
            n
        };
        let nodes: Vec<Arc<Node>> = members.iter().map(&mut node_for).collect();
        // A node back in the current set (a restart) is asked again.
        let was: std::collections::HashSet<*const Node, std::hash::BuildHasherDefault<Spread>> =
            old.nodes.iter().map(Arc::as_ptr).collect();
        for n in nodes.iter().filter(|n| !was.contains(&Arc::as_ptr(n))) {
            n.clear_handoff_skip();
        }
        // From the ring it replaces: a join or a leave hashes one member's
        // points, not every member's.
        let ring = Arc::new(old.ring.rebuilt(ring_members(members), placement));
        let mut previous: Vec<Arc<Previous>> = Vec::new();
        if !window.is_zero() {
            let current = member_set(nodes.iter().map(|n| placed(n)));
            let same = |r: &Ring, n: &[Arc<Node>]| {
                r.placement() == placement
                    && same_sets(member_set(n.iter().map(|n| placed(n))).as_ref(), current.as_ref())
            };
            if !old.nodes.is_empty() && !same(&old.ring, &old.nodes) {
                previous.push(Arc::new(Previous {
                    epoch: old.epoch,
                    ring: old.ring.clone(),
                    nodes: old.nodes.clone(),
                    until: now + window,
                }));
            }
            previous.extend(old.previous.iter().filter(|p| p.until > now).cloned());
            for (e, set, rule, left) in given {
                let until = now + left;
                match previous.iter().position(|p| p.epoch == e) {
                    Some(i) => {
                        let p = &previous[i];
                        previous[i] =
                            Arc::new(Previous { epoch: e, ring: p.ring.clone(), nodes: p.nodes.clone(), until });
                    }
                    // A set the view names but this client no longer holds
                    // and was not sent whole (discovery sends only sets it
                    // lacks): nothing to ask there.
                    None if set.is_empty() => {}
                    None => {
                        let nodes = set.iter().map(&mut node_for).collect();
                        let ring = Arc::new(ring_of(&set, rule));
                        previous.push(Arc::new(Previous { epoch: e, ring, nodes, until }));
                    }
                }
            }
            previous.retain(|p| p.until > now && p.epoch != epoch && !same(&p.ring, &p.nodes));
            // Newest first; one set per epoch.
            previous.sort_by_key(|p| std::cmp::Reverse(p.epoch));
            previous.dedup_by_key(|p| p.epoch);
            previous.truncate(kv_common::mds::MAX_PREVIOUS_SETS);
        }
        Topology { ring, nodes, epoch, previous }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_sets_compare_in_any_order_and_a_set_naming_a_member_twice_is_never_unchanged() {
        let (a, b, c) = (("a", "h:1", 1), ("b", "h:2", 1), ("c", "h:3", 1));
        let set = |v: &[Placed<'static>]| member_set(v.iter().copied());
        assert!(same_sets(set(&[a, b, c]).as_ref(), set(&[c, a, b]).as_ref()));
        assert!(!same_sets(set(&[a, b, c]).as_ref(), set(&[a, b]).as_ref()));
        assert!(!same_sets(set(&[a, b, c]).as_ref(), set(&[a, b, ("c", "h:3", 2)]).as_ref()));
        assert!(!same_sets(set(&[a, b, c]).as_ref(), set(&[a, b, ("c", "h:4", 1)]).as_ref()));
        // The same length and every entry present, one missing all the same.
        assert!(set(&[a, a, b]).is_none());
        assert!(!same_sets(set(&[a, a, b]).as_ref(), set(&[a, b, c]).as_ref()));
        assert!(!same_sets(set(&[a, a, b]).as_ref(), set(&[a, a, b]).as_ref()));
    }

    #[test]
    fn the_spread_hasher_moves_pointer_bits_into_the_low_ones() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let h = BuildHasherDefault::<Spread>::default();
        // Pointers 256 bytes apart land on many low-bit values.
        let low: std::collections::HashSet<u64> =
            (0..1024usize).map(|i| h.hash_one((0x7f00_0000_0000usize + i * 256) as *const u8) & 0x7ff).collect();
        assert!(low.len() > 512, "{} of 2,048 buckets", low.len());
    }
}
