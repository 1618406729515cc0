//! Tenants' namespaces in a node (docs/ARCHITECTURE.md, "Tenants"): a
//! connection's hello binds it to the tenant of the credential it
//! presented, and every key it sends is taken as `ns_key(tenant, key)`
//! before it reaches a map of the node (index, memory tier, write-behind
//! set, tombstones, warming sets, heat). Two tenants' keys never meet,
//! whatever bytes they send.
//!
//! The default tenant's keys are themselves (so a group without tenants,
//! its records and its journals are byte for byte as before); another
//! tenant's are [`MARK`], its id (u32, little-endian) and the key. A
//! default-tenant key that begins with [`MARK`] is escaped the same way
//! with id 0, so the map is one-to-one. The records keep the client's key:
//! what reads a record's own key compares it with [`client_key`].
//!
//! A namespaced key is at most [`kv_common::page::MAX_KEY_LEN`] bytes, so
//! the index journal keeps its format (an earlier release reading it finds
//! a tenant's entries failing their key check and reclaims them).

use std::borrow::Cow;

use kv_common::page::MAX_KEY_LEN;

/// The first bytes of a namespaced key.
pub const MARK: [u8; 4] = [0xFF, b'k', b'v', b'T'];

/// What a namespace adds to a key.
pub const PREFIX_LEN: usize = MARK.len() + 4;

/// The longest key of a tenant other than the default (and of a default
/// key escaped for beginning with [`MARK`]).
pub const MAX_TENANT_KEY: usize = MAX_KEY_LEN - PREFIX_LEN;

/// The default tenant's id.
pub const DEFAULT: u32 = 0;

/// The key the node keeps for `key` sent by `tenant`.
pub fn ns_key(tenant: u32, key: &[u8]) -> Cow<'_, [u8]> {
    if tenant == DEFAULT && !key.starts_with(&MARK) {
        return Cow::Borrowed(key);
    }
    let mut k = Vec::with_capacity(PREFIX_LEN + key.len());
    k.extend_from_slice(&MARK);
    k.extend_from_slice(&tenant.to_le_bytes());
    k.extend_from_slice(key);
    Cow::Owned(k)
}

/// The tenant and the client's key of a key the node keeps.
pub fn split(ns: &[u8]) -> (u32, &[u8]) {
    match ns.strip_prefix(&MARK[..]) {
        Some(rest) if rest.len() >= 4 => {
            let id = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            (id, &rest[4..])
        }
        _ => (DEFAULT, ns),
    }
}

/// The client's key of a key the node keeps.
pub fn client_key(ns: &[u8]) -> &[u8] {
    split(ns).1
}

/// Why `tenant` may not use `key`, if it may not: a namespaced key must fit
/// the node's longest key.
pub fn key_refused(tenant: u32, key: &[u8]) -> Option<String> {
    let namespaced = tenant != DEFAULT || key.starts_with(&MARK);
    (namespaced && key.len() > MAX_TENANT_KEY)
        .then(|| format!("key of {} bytes: a tenant's keys are at most {MAX_TENANT_KEY} bytes", key.len()))
}

/// `keys` as `tenant` names them in the node, or None when they are the
/// keys themselves (the default tenant's usual case: nothing is copied).
pub fn ns_keys<'k>(tenant: u32, keys: &[&'k [u8]]) -> Option<Vec<Cow<'k, [u8]>>> {
    if tenant == DEFAULT && !keys.iter().any(|k| k.starts_with(&MARK)) {
        return None;
    }
    Some(keys.iter().map(|k| ns_key(tenant, k)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One-to-one: the default tenant's keys are themselves; every other
    /// (tenant, key) pair gets a key of its own, and splits back.
    #[test]
    fn namespaces_are_one_to_one_and_the_default_is_the_key_itself() {
        assert!(matches!(ns_key(0, b"page-1"), Cow::Borrowed(b"page-1")));
        let mut marked = MARK.to_vec();
        marked.extend_from_slice(b"\x07\0\0\0x");
        let pairs: Vec<(u32, Vec<u8>)> = vec![
            (0, b"page-1".to_vec()),
            (7, b"page-1".to_vec()),
            (8, b"page-1".to_vec()),
            (0, marked.clone()),
            (7, b"x".to_vec()),
            (0, MARK.to_vec()),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for (t, k) in &pairs {
            let ns = ns_key(*t, k);
            assert!(seen.insert(ns.to_vec()), "({t}, {k:?}) collides");
            assert_eq!(split(&ns), (*t, &k[..]));
            assert_eq!(client_key(&ns), &k[..]);
        }
        assert_eq!(ns_key(0, &marked).len(), marked.len() + PREFIX_LEN, "an escaped default key");
        assert!(ns_keys(0, &[b"a", b"b"]).is_none());
        assert_eq!(ns_keys(3, &[b"a"]).unwrap()[0].as_ref(), &ns_key(3, b"a")[..]);
        assert!(key_refused(0, &[b'a'; MAX_KEY_LEN]).is_none());
        assert!(key_refused(3, &[b'a'; MAX_TENANT_KEY]).is_none());
        assert!(key_refused(3, &[b'a'; MAX_TENANT_KEY + 1]).unwrap().contains("at most 1016"));
    }
}
