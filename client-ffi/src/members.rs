//! Member lists: `id=host:port[@weight],...` (README.md, "C ABI conventions").
//!
//! Addresses are kept as given and resolved each time a connection is
//! opened (`node.rs`, `small.rs`), not once here: a node that comes back
//! under the same name with another address (a restarted container) is
//! found again without a new member list, and a name that does not resolve
//! right now makes its own node unavailable (a cool-down, fast misses)
//! instead of refusing the whole list.

use std::net::SocketAddr;

/// One cache node as the client knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    /// `host:port` (an IP address or a name), as given.
    pub addr: String,
    pub weight: u32,
}

/// Parses a member list; an empty string is an empty set.
pub fn parse_members(s: &str) -> Result<Vec<Member>, String> {
    let mut out: Vec<Member> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (id, rest) = item.split_once('=').ok_or_else(|| format!("member {item:?} is not id=host:port[@weight]"))?;
        let id = id.trim();
        let (addr, weight) = match rest.rsplit_once('@') {
            Some((a, w)) => {
                let w: u32 =
                    w.trim().parse().map_err(|_| format!("member {id}: weight {w:?} is not a whole number"))?;
                (a.trim(), w)
            }
            None => (rest.trim(), 1),
        };
        let m = member(id, addr, weight)?;
        if out.iter().any(|o| o.id == m.id) {
            return Err(format!("member id {id:?} given twice"));
        }
        out.push(m);
    }
    Ok(out)
}

/// One member from its parts (a list item, or a kv-mds view's record); the
/// address is checked for form, not resolved.
pub fn member(id: &str, addr: &str, weight: u32) -> Result<Member, String> {
    if id.is_empty() {
        return Err(format!("member at {addr:?} has an empty id (expected id=host:port[@weight])"));
    }
    if weight == 0 || weight > kv_common::ring::MAX_WEIGHT {
        // A huge weight would make the ring reserve 160 points per unit:
        // refused here as the node and kv-mds refuse it.
        return Err(format!("member {id}: weight {weight} is outside 1..={}", kv_common::ring::MAX_WEIGHT));
    }
    check_addr(addr).map_err(|e| format!("member {id}: {e}"))?;
    Ok(Member { id: id.to_string(), addr: addr.to_string(), weight })
}

/// `host:port` with a port of 1..=65535 and a host without spaces or commas
/// (an IPv6 address in brackets).
fn check_addr(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let bad = || format!("address {addr:?} is not host:port");
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if port == 0 || host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == ',' || c == '/') {
        return Err(bad());
    }
    Ok(())
}

/// Resolves a member address now (each new connection does).
pub fn resolve(addr: &str) -> std::io::Result<Vec<SocketAddr>> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = addr.parse() {
        return Ok(vec![a]);
    }
    let all: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if all.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr} resolves to no address")));
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_member_lists() {
        let m = parse_members("n1=127.0.0.1:7000, n2=127.0.0.1:7001@3,").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m[1].id.as_str(), m[1].addr.as_str(), m[1].weight), ("n2", "127.0.0.1:7001", 3));
        assert_eq!(m[0].weight, 1);
        assert!(parse_members("").unwrap().is_empty());
        assert!(parse_members("n1").unwrap_err().contains("id=host:port"));
        assert!(parse_members("n1=127.0.0.1:1@0").unwrap_err().contains("outside 1..=10000"));
        // A weight past the bound is refused, not turned into billions of ring points.
        assert!(parse_members("n1=127.0.0.1:1@4000000000").unwrap_err().contains("outside 1..=10000"));
        assert!(parse_members("n1=127.0.0.1:1@10001").unwrap_err().contains("outside 1..=10000"));
        assert_eq!(parse_members("n1=127.0.0.1:1@10000").unwrap()[0].weight, 10_000);
        assert!(parse_members("n1=127.0.0.1:1,n1=127.0.0.1:2").unwrap_err().contains("twice"));
        assert!(parse_members("=127.0.0.1:1").unwrap_err().contains("empty id"));
        assert!(parse_members("n1=nohost:x").is_err());
        assert!(parse_members("n1=:7000").is_err() && parse_members("n1=h:0").is_err());
        // A name is kept as given: resolved per connection, not here (no
        // lookup happens for this one; a test must not query DNS).
        let m = parse_members("n1=no-such-host.invalid:7000,n2=[::1]:7001,n3=localhost:7002").unwrap();
        assert_eq!(m[0].addr, "no-such-host.invalid:7000");
        assert_eq!(resolve(&m[1].addr).unwrap()[0].port(), 7001);
        assert!(resolve(&m[2].addr).unwrap().iter().all(|a| a.ip().is_loopback() && a.port() == 7002));
    }
}
