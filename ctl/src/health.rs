//! `kvctl health`: is a daemon serving? For container HEALTHCHECKs and
//! service probes on hosts without curl.
//!
//! `--local` finds the kv-server or kv-mds running on this host (in this
//! container): processes named so in /proc, their listening TCP sockets from
//! /proc/PID/fd and /proc/net/tcp{,6}. It then asks each daemon:
//! - kv-mds: `GET /healthz` on its API port (200 when etcd answers);
//! - kv-server: the node's statistics over its data port (healthy while at
//!   least one disk is in service), the same fact its `/healthz` reports.
//!
//! Given an address instead, it asks `GET /healthz` there (a kv-mds API port
//! or a kv-server `--metrics-listen` port).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// One daemon found on this host.
#[derive(Debug, PartialEq)]
pub struct Daemon {
    pub pid: u32,
    pub name: String,
    /// Its listening TCP sockets, as addresses to connect to (a wildcard
    /// bind becomes loopback).
    pub listening: Vec<SocketAddr>,
}

/// The verdict on one daemon: healthy or not, and why.
#[derive(Debug)]
pub struct Verdict {
    pub daemon: String,
    pub addr: Option<SocketAddr>,
    pub healthy: bool,
    pub detail: String,
}

const DAEMONS: [&str; 2] = ["kv-server", "kv-mds"];

/// The kvcellar daemons under `proc_root` (normally /proc).
pub fn find_daemons(proc_root: &Path) -> Vec<Daemon> {
    let listening = listening_sockets(proc_root);
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(proc_root) else { return out };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else { continue };
        let name = comm.trim();
        if !DAEMONS.contains(&name) {
            continue;
        }
        let mut addrs = Vec::new();
        if let Ok(fds) = std::fs::read_dir(e.path().join("fd")) {
            for fd in fds.flatten() {
                let Ok(target) = std::fs::read_link(fd.path()) else { continue };
                let t = target.to_string_lossy();
                let Some(inode) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) else { continue };
                if let Some(a) = inode.parse::<u64>().ok().and_then(|i| listening.iter().find(|(n, _)| *n == i)) {
                    addrs.push(a.1);
                }
            }
        }
        addrs.sort();
        addrs.dedup();
        out.push(Daemon { pid, name: name.to_string(), listening: addrs });
    }
    out.sort_by_key(|d| d.pid);
    out
}

/// Listening TCP sockets by inode, from `net/tcp` and `net/tcp6`.
fn listening_sockets(proc_root: &Path) -> Vec<(u64, SocketAddr)> {
    let mut out = Vec::new();
    for (file, v6) in [("net/tcp", false), ("net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(proc_root.join(file)) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            if let (Some(addr), Ok(inode)) = (parse_proc_addr(f[1], v6), f[9].parse::<u64>()) {
                out.push((inode, addr));
            }
        }
    }
    out
}

/// `0100007F:1E14` (or the 32-digit IPv6 form) to an address to connect to:
/// the kernel prints each 32-bit word in host (little-endian) order.
fn parse_proc_addr(s: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16).map(u32::swap_bytes))
        .collect::<Result<_, _>>()
        .ok()?;
    let ip = match (v6, words.as_slice()) {
        (false, [w]) => IpAddr::V4(Ipv4Addr::from(*w)),
        (true, [a, b, c, d]) => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&w.to_be_bytes());
            }
            let ip6 = Ipv6Addr::from(bytes);
            match ip6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(ip6),
            }
        }
        _ => return None,
    };
    let ip = match ip {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        other => other,
    };
    Some(SocketAddr::new(ip, port))
}

/// `GET /healthz` at `addr`: Ok(body) on 200, Err(reason) otherwise.
pub fn http_healthz(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    s.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut resp = Vec::new();
    let _ = s.take(64 * 1024).read_to_end(&mut resp);
    let text = String::from_utf8_lossy(&resp);
    let status = text.lines().next().unwrap_or("");
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.trim().to_string()).unwrap_or_default();
    let code = status.split_whitespace().nth(1).unwrap_or("");
    match code {
        "200" => Ok(body),
        "" => Err(format!("{addr}: no HTTP answer")),
        c => Err(format!("{addr}: HTTP {c}: {body}")),
    }
}

fn check_node(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let mut c = match kvclient::Conn::connect_with(&addr.to_string(), timeout, crate::token()) {
        Ok(c) => c,
        // It answered its hello, so it serves; its disks cannot be asked
        // without the group's token.
        Err(kvclient::OpError::Denied) => {
            return Ok("serving (disks not checked: give the group's auth token to check them)".into())
        }
        Err(e) => return Err(e.to_string()),
    };
    let s = c.stats().map_err(|e| e.to_string())?;
    let in_service = (s.disks.len() as u64).saturating_sub(s.failed_disks);
    if in_service == 0 {
        return Err(format!("{addr}: no disk in service"));
    }
    Ok(format!("{in_service} of {} disks in service, {} objects", s.disks.len(), s.objects))
}

/// Asks one daemon found by `find_daemons`.
pub fn check(d: &Daemon, timeout: Duration) -> Verdict {
    let name = format!("{} (pid {})", d.name, d.pid);
    if d.listening.is_empty() {
        return Verdict { daemon: name, addr: None, healthy: false, detail: "not listening (yet)".into() };
    }
    let mut why = Vec::new();
    for &a in &d.listening {
        let r = if d.name == "kv-mds" { http_healthz(a, timeout) } else { check_node(a, timeout) };
        match r {
            Ok(detail) => return Verdict { daemon: name, addr: Some(a), healthy: true, detail },
            Err(e) => why.push(e),
        }
    }
    Verdict { daemon: name, addr: None, healthy: false, detail: why.join("; ") }
}

/// `kvctl health`: exit 0 when every daemon asked is healthy, 1 when one is
/// not, 2 when there is nothing to ask (0 with `none_ok`).
pub fn run(addr: Option<&str>, local: bool, none_ok: bool, timeout: Duration, json: bool) -> Result<u8, String> {
    let verdicts = if local {
        let found = find_daemons(Path::new("/proc"));
        if found.is_empty() && none_ok {
            println!("no kv-server or kv-mds runs here: nothing to check");
            return Ok(0);
        }
        if found.is_empty() {
            return Err("no kv-server or kv-mds process on this host".into());
        }
        found.iter().map(|d| check(d, timeout)).collect::<Vec<_>>()
    } else {
        let addr = addr.ok_or("give an address (HOST:PORT of /healthz) or --local")?;
        let sa = addr
            .to_socket_addrs()
            .map_err(|e| format!("{addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("{addr}: no address"))?;
        let r = http_healthz(sa, timeout);
        vec![Verdict { daemon: addr.to_string(), addr: Some(sa), healthy: r.is_ok(), detail: r.unwrap_or_else(|e| e) }]
    };
    for v in &verdicts {
        let state = if v.healthy { "healthy" } else { "UNHEALTHY" };
        let at = v.addr.map(|a| format!(" at {a}")).unwrap_or_default();
        if json {
            println!(
                "{}",
                serde_json::json!({"daemon": v.daemon, "addr": v.addr.map(|a| a.to_string()), "healthy": v.healthy, "detail": v.detail})
            );
        } else {
            println!("{}{at}: {state}: {}", v.daemon, v.detail);
        }
    }
    Ok(u8::from(verdicts.iter().any(|v| !v.healthy)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_addresses() {
        assert_eq!(parse_proc_addr("0100007F:1E14", false), Some("127.0.0.1:7700".parse().unwrap()));
        assert_eq!(parse_proc_addr("00000000:1D3C", false), Some("127.0.0.1:7484".parse().unwrap()));
        assert_eq!(parse_proc_addr("0A00000A:0050", false), Some("10.0.0.10:80".parse().unwrap()));
        assert_eq!(parse_proc_addr("00000000000000000000000000000000:1E14", true), Some("[::1]:7700".parse().unwrap()));
        assert_eq!(
            parse_proc_addr("0000000000000000FFFF00000100007F:1E14", true),
            Some("127.0.0.1:7700".parse().unwrap())
        );
        assert_eq!(parse_proc_addr("zz:1", false), None);
    }

    #[test]
    fn finds_a_daemon_and_its_listening_socket_in_a_proc_tree() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path();
        std::fs::create_dir_all(p.join("net")).unwrap();
        std::fs::write(
            p.join("net/tcp"),
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 0100007F:1E14 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n\
             1: 0100007F:1E15 0100007F:9999 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n",
        )
        .unwrap();
        std::fs::create_dir_all(p.join("17/fd")).unwrap();
        std::fs::write(p.join("17/comm"), "kv-server\n").unwrap();
        std::os::unix::fs::symlink("socket:[4242]", p.join("17/fd/5")).unwrap();
        std::os::unix::fs::symlink("socket:[4343]", p.join("17/fd/6")).unwrap();
        std::fs::create_dir_all(p.join("18/fd")).unwrap();
        std::fs::write(p.join("18/comm"), "bash\n").unwrap();
        let found = find_daemons(p);
        assert_eq!(
            found,
            vec![Daemon { pid: 17, name: "kv-server".into(), listening: vec!["127.0.0.1:7700".parse().unwrap()] }]
        );
    }
}
