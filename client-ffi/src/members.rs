//! Member lists: `id=host:port[@weight],...` (DESIGN.md §4).

use std::net::SocketAddr;

/// One cache node as the client knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    pub addr: SocketAddr,
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

/// One member from its parts (a list item, or a kv-mds view's record):
/// the address resolved now.
pub fn member(id: &str, addr: &str, weight: u32) -> Result<Member, String> {
    if id.is_empty() {
        return Err(format!("member at {addr:?} has an empty id (expected id=host:port[@weight])"));
    }
    if weight == 0 {
        return Err(format!("member {id}: weight must be at least 1"));
    }
    let addr = resolve(addr).map_err(|e| format!("member {id}: {e}"))?;
    Ok(Member { id: id.to_string(), addr, weight })
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    addr.to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_member_lists() {
        let m = parse_members("n1=127.0.0.1:7000, n2=127.0.0.1:7001@3,").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m[1].id.as_str(), m[1].addr.port(), m[1].weight), ("n2", 7001, 3));
        assert_eq!(m[0].weight, 1);
        assert!(parse_members("").unwrap().is_empty());
        assert!(parse_members("n1").unwrap_err().contains("id=host:port"));
        assert!(parse_members("n1=127.0.0.1:1@0").unwrap_err().contains("at least 1"));
        assert!(parse_members("n1=127.0.0.1:1,n1=127.0.0.1:2").unwrap_err().contains("twice"));
        assert!(parse_members("=127.0.0.1:1").unwrap_err().contains("empty id"));
        assert!(parse_members("n1=nohost:x").is_err());
    }
}
