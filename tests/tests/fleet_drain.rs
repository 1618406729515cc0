//! A drain at fleet size (docs/ARCHITECTURE.md, "Draining"): 22 real nodes
//! of one small disk each, no memory tier, a real etcd and kv-mds. One
//! node drains and exits; its push must reach every owner of its pages
//! (not a few of them), name each in its log, never push to itself, and
//! leave its pages hits at their new owners once it is gone.
//!
//! Its own test binary: nothing else shares the machine's cores with these
//! 22 nodes while it runs (kv_e2e::fleet does the work; kv-fleet-drain
//! prints the same figures for scripts/bench-fleet.sh).

use kv_e2e::fleet::drain_at_scale;

#[test]
fn a_drained_node_of_a_22_node_group_leaves_every_page_a_hit_at_its_new_owner() {
    let f = drain_at_scale("kv-server", 22, 60, 16 << 10, 8);
    let held = f.held.len() as u64;
    let st = &f.stats;
    assert!(f.clean_exit, "clean exit after the drain");
    assert_eq!(st.drain_pushed, held, "every page pushed: {st:?}");
    assert_eq!((st.drain_push_failed, st.drain_push_owner_failed, st.drain_push_left), (0, 0, 0));
    assert_eq!(st.drain_push_owners, f.owners.len() as u64, "owners with pages");
    // Its log names every owner it pushed to, never itself.
    assert!(!f.named.contains_key(&f.drained), "never pushed to itself");
    assert_eq!(
        f.named.keys().cloned().collect::<std::collections::BTreeSet<_>>(),
        f.owners,
        "the log names every new owner"
    );
    assert_eq!(f.named.values().sum::<u64>(), held);
    let closing = f.closing.as_deref().expect("the push's closing line");
    assert!(closing.contains(&format!("{held} of {held} pages pushed to {} owners", f.owners.len())), "{closing}");
    assert!(closing.contains("0 left"), "{closing}");
    // Gone: at least 99 % of its pages are hits at their new owners (all of
    // them, with owners far from full), every other page too, none wrong.
    assert_eq!(f.wrong, 0, "pages served with other bytes");
    assert!(f.lost.len() * 100 <= f.held.len(), "{} of its {} pages missed", f.lost.len(), f.held.len());
    assert_eq!(f.evictions, 0, "owners at a fraction of their caps evict nothing");
    assert!(f.lost.is_empty(), "pages missed at their new owners: {:?}", f.lost);
    assert!(f.other_misses.is_empty(), "pages of other nodes missed: {:?}", f.other_misses);
}
