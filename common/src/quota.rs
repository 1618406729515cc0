//! Tenants' quotas (docs/DEPLOY.md, "Tenants"): each named tenant's share
//! of a node, as bytes (`200G`) or as a part of the node's capacity
//! (`40%`). One table format serves the node's TOML (`[quotas]`), its
//! `--quotas` flag, kv-mds (a group's setting, kept in etcd as the JSON
//! object of the same strings) and `kvctl tenants --set`.
//!
//! A node splits a tenant's share across its disks (and its memory tier)
//! by capacity; a tenant over its share evicts its own least recently used
//! pages first, and capacity it does not use is lent to the others
//! (docs/ARCHITECTURE.md, "Tenants").

use std::collections::BTreeMap;

use crate::size::{format_size, parse_size};

/// Most tenants a quota table names.
pub const MAX_QUOTAS: usize = 256;

/// The name the default tenant (every credential naming none) goes by.
pub const DEFAULT_TENANT: &str = "default";

/// One tenant's share of a node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quota {
    /// Bytes of the node (its disks together).
    Bytes(u64),
    /// A part of the node's capacity, in (0, 1].
    Part(f64),
}

impl Quota {
    /// `200G`, `1.5T`, `40%` or `0.4` (a part); one line on error.
    pub fn parse(s: &str) -> Result<Quota, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("quota {s:?}: expected a percentage such as 40%"))?;
            return Quota::part(v / 100.0, s);
        }
        if t.chars().all(|c| c.is_ascii_digit() || c == '.') {
            // A bare number is a part of the node (0.4); bytes take a unit.
            let v: f64 = t.parse().map_err(|_| format!("quota {s:?}: bad number"))?;
            if v > 1.0 || !t.contains('.') {
                return Err(format!("quota {s:?}: give a part of the node (40% or 0.4) or bytes with a unit (200G)"));
            }
            return Quota::part(v, s);
        }
        let b = parse_size(t).map_err(|e| format!("quota {s:?}: {e}"))?;
        if b == 0 {
            return Err(format!("quota {s:?}: a quota is at least one byte (remove the tenant's quota instead)"));
        }
        Ok(Quota::Bytes(b))
    }

    fn part(v: f64, s: &str) -> Result<Quota, String> {
        if v.is_finite() && v > 0.0 && v <= 1.0 {
            Ok(Quota::Part(v))
        } else {
            Err(format!("quota {s:?}: a part of the node is more than 0% and at most 100%"))
        }
    }

    /// Bytes of a node (or tier) of `cap` bytes, at most `cap`.
    pub fn bytes_of(&self, cap: u64) -> u64 {
        match *self {
            Quota::Bytes(b) => b.min(cap),
            Quota::Part(p) => ((cap as f64) * p) as u64,
        }
    }
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Quota::Bytes(b) if b % (1 << 40) == 0 => write!(f, "{}T", b >> 40),
            Quota::Bytes(b) if b % (1 << 30) == 0 => write!(f, "{}G", b >> 30),
            Quota::Bytes(b) if b % (1 << 20) == 0 => write!(f, "{}M", b >> 20),
            Quota::Bytes(b) if b % (1 << 10) == 0 => write!(f, "{}K", b >> 10),
            Quota::Bytes(b) => write!(f, "{b}B"),
            Quota::Part(p) => {
                // Six decimals of a percent: 0.07 prints 7%, not 7.000000000000001%.
                let pct = (p * 100.0 * 1e6).round() / 1e6;
                write!(f, "{}%", if pct > 0.0 { pct } else { p * 100.0 })
            }
        }
    }
}

/// A tenant's id as nodes keep it: 0 for [`DEFAULT_TENANT`], else
/// [`crate::auth::tenant_id`].
pub fn tenant_id_of(name: &str) -> u32 {
    if name == DEFAULT_TENANT {
        0
    } else {
        crate::auth::tenant_id(name)
    }
}

/// A group's or a node's quotas: tenant name to share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quotas(pub BTreeMap<String, Quota>);

impl Quotas {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks one entry: the name's rule and the table's bound.
    pub fn insert(&mut self, name: &str, q: Quota) -> Result<(), String> {
        if !crate::auth::valid_name(name) {
            return Err(format!("tenant name {name:?}: 1-64 of A-Z a-z 0-9 . _ -"));
        }
        if !self.0.contains_key(name) && self.0.len() >= MAX_QUOTAS {
            return Err(format!("a quota table names at most {MAX_QUOTAS} tenants"));
        }
        self.0.insert(name.to_string(), q);
        Ok(())
    }

    /// `a=40%,b=200G` (the flag's form; empty: none).
    pub fn parse_list(s: &str) -> Result<Quotas, String> {
        let mut out = Quotas::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, q) =
                item.split_once('=').ok_or_else(|| format!("quota {item:?}: expected TENANT=SHARE, e.g. teamA=40%"))?;
            out.insert(name.trim(), Quota::parse(q)?)?;
        }
        Ok(out)
    }

    /// From a map of strings (the TOML table, the JSON kept in etcd).
    pub fn from_strings<'a>(m: impl IntoIterator<Item = (&'a String, &'a String)>) -> Result<Quotas, String> {
        let mut out = Quotas::default();
        for (name, q) in m {
            out.insert(name, Quota::parse(q)?)?;
        }
        Ok(out)
    }

    /// The map of strings [`Quotas::from_strings`] reads.
    pub fn to_strings(&self) -> BTreeMap<String, String> {
        self.0.iter().map(|(n, q)| (n.clone(), q.to_string())).collect()
    }

    /// Each tenant's bytes on a node of `cap` bytes, by tenant id (a share
    /// larger than the node is the node).
    pub fn resolve(&self, cap: u64) -> Vec<(u32, u64)> {
        self.0.iter().map(|(n, q)| (tenant_id_of(n), q.bytes_of(cap))).collect()
    }

    /// One line for each share larger than a node of `cap` bytes, and for
    /// shares adding up to more than it (they cannot all be kept at once).
    pub fn warnings(&self, cap: u64) -> Vec<String> {
        let mut out = Vec::new();
        let mut sum: u128 = 0;
        for (n, q) in &self.0 {
            if let Quota::Bytes(b) = q {
                if *b > cap {
                    out.push(format!(
                        "tenant {n}'s quota {q} is larger than this node ({}): it is held to the node's size",
                        format_size(cap)
                    ));
                }
            }
            sum += u128::from(q.bytes_of(cap));
        }
        if sum > u128::from(cap) {
            out.push(format!(
                "the quotas add up to more than this node ({}): a tenant below its share may still lose pages to another below its own",
                format_size(cap)
            ));
        }
        out
    }

    /// `a=40%,b=200G`.
    pub fn to_list(&self) -> String {
        self.0.iter().map(|(n, q)| format!("{n}={q}")).collect::<Vec<_>>().join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_parse_and_print_back() {
        assert_eq!(Quota::parse("40%").unwrap(), Quota::Part(0.4));
        assert_eq!(Quota::parse("0.25").unwrap(), Quota::Part(0.25));
        assert_eq!(Quota::parse("200G").unwrap(), Quota::Bytes(200 << 30));
        assert_eq!(Quota::parse("1K").unwrap(), Quota::Bytes(1024));
        for b in [1u64, 1000, 1024, 3 << 20, 5 << 30, 1 << 40] {
            assert_eq!(Quota::parse(&Quota::Bytes(b).to_string()).unwrap(), Quota::Bytes(b), "{b} prints back");
        }
        assert_eq!(Quota::parse("1.0").unwrap(), Quota::Part(1.0));
        for bare in ["1", "1.5", "200"] {
            assert!(Quota::parse(bare).unwrap_err().contains("with a unit"), "{bare}");
        }
        assert_eq!(Quota::parse("7%").unwrap().to_string(), "7%");
        assert_eq!(Quota::parse("0.29").unwrap().to_string(), "29%");
        for bad in ["0%", "101%", "-3%", "abc", "0", "1.5x", "nan%"] {
            let e = Quota::parse(bad).unwrap_err();
            assert!(e.starts_with("quota "), "{e}");
        }
        let q = Quotas::parse_list("teamA=40%, teamB=200G,default=12.5%").unwrap();
        assert_eq!(q.to_list(), "default=12.5%,teamA=40%,teamB=200G");
        assert_eq!(Quotas::parse_list(&q.to_list()).unwrap(), q);
        assert_eq!(Quotas::from_strings(&q.to_strings()).unwrap(), q);
        assert!(Quotas::parse_list("teamA").unwrap_err().contains("TENANT=SHARE"));
        assert!(Quotas::parse_list("bad name=1G").unwrap_err().contains("tenant name"));
        assert!(Quotas::parse_list("").unwrap().is_empty());
    }

    #[test]
    fn shares_resolve_against_a_node() {
        let q = Quotas::parse_list("default=10%,a=50%,b=3G").unwrap();
        let got: BTreeMap<u32, u64> = q.resolve(4 << 30).into_iter().collect();
        assert_eq!(got[&0], (4u64 << 30) / 10);
        assert_eq!(got[&crate::auth::tenant_id("a")], 2 << 30);
        assert_eq!(got[&crate::auth::tenant_id("b")], 3 << 30);
        assert!(q.warnings(4 << 30).len() == 1, "{:?}", q.warnings(4 << 30));
        let w = q.warnings(2 << 30);
        assert!(w.iter().any(|l| l.contains("tenant b's quota 3G is larger than this node")), "{w:?}");
        assert!(Quotas::parse_list("a=50%,b=50%").unwrap().warnings(1 << 30).is_empty());
    }

    #[test]
    fn a_table_is_bounded() {
        let mut q = Quotas::default();
        for i in 0..MAX_QUOTAS {
            q.insert(&format!("t{i}"), Quota::Bytes(1)).unwrap();
        }
        assert!(q.insert("one-more", Quota::Bytes(1)).unwrap_err().contains("at most"));
        q.insert("t0", Quota::Bytes(2)).unwrap();
    }
}
