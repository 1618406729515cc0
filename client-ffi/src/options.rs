//! The `kv_open` options string: `key=value,...` (README.md, "C ABI conventions"). Unknown keys
//! are an error, so a typo never silently runs with a default.

use std::time::Duration;

/// Client options with their defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub max_conns_per_node: usize,
    pub batch_concurrency: usize,
    pub peer_cooldown: Duration,
    /// The group's token, read from `auth_token_file` (None: send none).
    pub auth_token: Option<kv_common::auth::Token>,
    /// `rdma_devices` (`:`-separated), `rdma_depth`, `rdma_numa` (1: prefer
    /// rails on the calling thread's NUMA node).
    pub rdma: kv_rdma::Settings,
    /// `rdma_cache_mb`: bytes of cached registrations of buffers not
    /// registered with `kv_register_memory`, per rail (0: register per op).
    pub rdma_cache_bytes: usize,
    /// `handoff_ms`: how long the client keeps a member set it replaced
    /// (a static list swapped, a view from a kv-mds that sends no
    /// `handoff_ms`) to find pages on their previous owners; 0 turns handoff
    /// off in this client (docs/ARCHITECTURE.md, "Ring transitions").
    pub handoff: Duration,
    /// `handoff_timeout_ms`: the time one ask at a previous owner may take.
    pub handoff_timeout: Duration,
    /// `handoff_budget_mb`: bytes of background copies (pages found at a
    /// previous owner, written to the current one) in flight per handle.
    pub handoff_budget: u64,
    /// `placement`: the rule placing keys on a static member list (`ketama`,
    /// `multiprobe`; docs/PROTOCOL.md §4). Under kv-mds discovery the
    /// group's view names the rule and this is not used.
    pub placement: kv_common::ring::Placement,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            connect_timeout: Duration::from_millis(3000),
            io_timeout: Duration::from_millis(10_000),
            max_conns_per_node: 16,
            batch_concurrency: 8,
            peer_cooldown: Duration::from_millis(2000),
            auth_token: None,
            rdma: kv_rdma::Settings::default(),
            rdma_cache_bytes: 1 << 30,
            handoff: Duration::from_secs(600),
            handoff_timeout: Duration::from_millis(500),
            handoff_budget: 256 << 20,
            placement: kv_common::ring::Placement::Ketama,
        }
    }
}

/// The option keys, for messages and docs.
pub const KEYS: &[&str] = &[
    "connect_timeout_ms",
    "io_timeout_ms",
    "max_conns_per_node",
    "batch_concurrency",
    "peer_cooldown_ms",
    "auth_token_file",
    "rdma_devices",
    "rdma_depth",
    "rdma_numa",
    "rdma_cache_mb",
    "handoff_ms",
    "handoff_timeout_ms",
    "handoff_budget_mb",
    "placement",
];

impl Options {
    /// Parses `key=value,...`; empty means all defaults. `auth_token_file`
    /// is read here (a path with a comma cannot be given).
    pub fn parse(s: &str) -> Result<Options, String> {
        let mut o = Options::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| format!("option {item:?} is not key=value"))?;
            let (k, v) = (k.trim(), v.trim());
            if k == "auth_token_file" {
                if v.is_empty() {
                    return Err("option auth_token_file names no file".into());
                }
                o.auth_token = Some(kv_common::auth::read_token_file(std::path::Path::new(v))?);
                continue;
            }
            if k == "placement" {
                o.placement = kv_common::ring::Placement::parse(v).map_err(|e| format!("option placement: {e}"))?;
                continue;
            }
            if k == "rdma_devices" {
                o.rdma.devices = kv_rdma::parse_devices(v).map_err(|e| format!("option rdma_devices: {e}"))?;
                continue;
            }
            let n: u64 = v.parse().map_err(|_| format!("option {k}: {v:?} is not a whole number"))?;
            let positive = |n: u64| if n == 0 { Err(format!("option {k} must be at least 1")) } else { Ok(n) };
            match k {
                "connect_timeout_ms" => o.connect_timeout = Duration::from_millis(positive(n)?),
                "io_timeout_ms" => o.io_timeout = Duration::from_millis(positive(n)?),
                "max_conns_per_node" => o.max_conns_per_node = positive(n)?.min(1024) as usize,
                "batch_concurrency" => o.batch_concurrency = positive(n)?.min(1024) as usize,
                "peer_cooldown_ms" => o.peer_cooldown = Duration::from_millis(n),
                "rdma_depth" => {
                    o.rdma.depth = u32::try_from(positive(n)?)
                        .ok()
                        .filter(|&d| d <= kv_rdma::MAX_DEPTH)
                        .ok_or_else(|| format!("option rdma_depth must be 1..={}", kv_rdma::MAX_DEPTH))?
                }
                "rdma_numa" if n <= 1 => o.rdma.numa_local = n == 1,
                "rdma_numa" => return Err("option rdma_numa must be 0 or 1".into()),
                "rdma_cache_mb" => o.rdma_cache_bytes = (n.min(1 << 30) as usize) << 20,
                "handoff_ms" => o.handoff = Duration::from_millis(n),
                "handoff_timeout_ms" => o.handoff_timeout = Duration::from_millis(positive(n)?),
                "handoff_budget_mb" => o.handoff_budget = n.min(1 << 30) << 20,
                _ => return Err(format!("unknown option {k:?} (known: {})", KEYS.join(", "))),
            }
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert_eq!(Options::parse("").unwrap(), Options::default());
        let o = Options::parse("io_timeout_ms=250, batch_concurrency=4,peer_cooldown_ms=0").unwrap();
        assert_eq!(o.io_timeout, Duration::from_millis(250));
        assert_eq!(o.batch_concurrency, 4);
        assert_eq!(o.peer_cooldown, Duration::ZERO);
        assert!(Options::parse("io_timeout=5").unwrap_err().contains("unknown option"));
        assert!(Options::parse("io_timeout_ms").unwrap_err().contains("key=value"));
        assert!(Options::parse("io_timeout_ms=-1").unwrap_err().contains("whole number"));
        assert!(Options::parse("max_conns_per_node=0").unwrap_err().contains("at least 1"));
        let o = Options::parse("handoff_ms=0,handoff_timeout_ms=100,handoff_budget_mb=8").unwrap();
        assert_eq!(
            (o.handoff, o.handoff_timeout, o.handoff_budget),
            (Duration::ZERO, Duration::from_millis(100), 8 << 20)
        );
        assert!(Options::parse("handoff_timeout_ms=0").unwrap_err().contains("at least 1"));
        assert_eq!(Options::parse("placement=multiprobe").unwrap().placement, kv_common::ring::Placement::MultiProbe);
        assert!(Options::parse("placement=jump").unwrap_err().contains("knows ketama,multiprobe"));
    }

    #[test]
    fn every_build_takes_the_rdma_keys() {
        let o = Options::parse("rdma_devices=mlx5_0:mlx5_1,rdma_depth=64,rdma_numa=0,rdma_cache_mb=0").unwrap();
        assert_eq!(o.rdma.devices, ["mlx5_0", "mlx5_1"]);
        assert_eq!((o.rdma.depth, o.rdma.numa_local, o.rdma_cache_bytes), (64, false, 0));
        assert_eq!(Options::parse("rdma_devices=").unwrap().rdma.devices, Vec::<String>::new());
        assert!(Options::parse("rdma_devices=mlx5_0;mlx5_1").unwrap_err().contains("rdma_devices"));
        assert!(Options::parse("rdma_depth=0").unwrap_err().contains("at least 1"));
        assert!(Options::parse("rdma_depth=5000").unwrap_err().contains("1..=1024"));
        assert!(Options::parse("rdma_numa=2").unwrap_err().contains("0 or 1"));
    }

    #[test]
    fn the_token_is_read_from_its_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("tok");
        std::fs::write(&p, "abc123\n").unwrap();
        let o = Options::parse(&format!("auth_token_file={}, io_timeout_ms=5", p.display())).unwrap();
        assert_eq!(o.auth_token.unwrap().as_bytes(), b"abc123");
        let e = Options::parse(&format!("auth_token_file={}", d.path().join("no").display())).unwrap_err();
        assert!(e.contains("auth token file"), "{e}");
        assert!(Options::parse("auth_token_file=").unwrap_err().contains("names no file"));
    }
}
