//! Flags and the TOML file alternative. Flags win over the file; sizes are
//! written like `512G` or `2T`. Every problem becomes one line for the user.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use kv_common::size::parse_size;
use serde::Deserialize;

use crate::store::{DiskSpec, StoreConfig};

/// kvcellar cache node: serves KV-cache pages from local NVMe disks.
#[derive(Debug, Parser, Default)]
#[command(name = "kv-server", version, about, long_about = None, after_help = SERVER_EXAMPLES)]
pub struct Cli {
    /// Address the data plane listens on, IP:PORT (required), e.g. 10.0.0.7:7700; port 0 picks a free one.
    #[arg(long)]
    pub listen: Option<String>,
    /// Disk directories, comma separated (required); `DIR:SIZE` gives that disk its own cap. Order matters: disks are placed as disk0, disk1, ...
    #[arg(long, value_delimiter = ',')]
    pub dir: Vec<String>,
    /// Bytes each disk may hold (e.g. 512G, 2T; at least 1M), for dirs without their own `:SIZE`.
    #[arg(long)]
    pub cap: Option<String>,
    /// Bytes of memory tier for recently written and read pages, reserved at start (e.g. 8G; default 0: off).
    #[arg(long)]
    pub mem_cap: Option<String>,
    /// TOML file with the same settings (the packaged example lists every key); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Log level: error, warn, info, debug or trace (default info).
    #[arg(long)]
    pub log_level: Option<String>,
    /// Most client connections served at once; more are refused with a hello saying so (default 1024).
    #[arg(long)]
    pub max_conns: Option<usize>,
    /// Threads that serve client connections, each its own single-threaded runtime; a connection stays on one for its life, and no thread steals another's work. 0: the node's work-stealing runtime (a worker per core) serves them (default 0). One thread helps small requests and costs memory-acked puts on a small host (docs/BENCHMARKS.md, Set W).
    #[arg(long)]
    pub conn_threads: Option<usize>,
    /// Seconds a connection may sit idle (no request in flight, none arriving) before the node closes it, freeing its slot; 0: never (default 120). Clients reconnect transparently.
    #[arg(long)]
    pub idle_timeout: Option<u64>,
    /// Largest record (64-byte header + key + payload) a put may carry, 4K..4G (default 256M).
    #[arg(long)]
    pub max_record: Option<String>,
    /// Bytes of put bodies being received or written at once, all connections together; at least --max-record (default 1G).
    #[arg(long)]
    pub max_inflight: Option<String>,
    /// IP:PORT for /metrics and /healthz over HTTP, e.g. 127.0.0.1:9700 (default: off).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Acknowledge a put before the fdatasync that puts it on media: a crash or power loss may lose acknowledged pages (benchmarks and tests only).
    #[arg(long)]
    pub no_sync: bool,
    /// kv-mds endpoints HOST:PORT, comma separated: register this node there and heartbeat (default: run alone).
    #[arg(long)]
    pub mds: Option<String>,
    /// Group to join, 1-64 of A-Z a-z 0-9 . _ - (with --mds; default "default").
    #[arg(long)]
    pub group: Option<String>,
    /// This node's id in its group, 1-64 of A-Z a-z 0-9 . _ - (required with --mds).
    #[arg(long)]
    pub id: Option<String>,
    /// HOST:PORT clients dial to reach this node (required with --mds); port 0 means the port listened on.
    #[arg(long)]
    pub advertise: Option<String>,
    /// Ring weight: this node's share of keys relative to the others, 1..=10000 (with --mds; default 1).
    #[arg(long)]
    pub weight: Option<u32>,
    /// File holding the group's auth token (trimmed; 1-1024 visible ASCII characters), or a table of credentials with roles (docs/DEPLOY.md, "Roles"): clients must present one of its tokens, and the node presents the token, or its node credential, to kv-mds (default: no token, any client is served).
    #[arg(long)]
    pub auth_token_file: Option<PathBuf>,
    /// RDMA devices to serve payloads over, `:`-separated, e.g. mlx5_0:mlx5_1 (one rail each). Any build accepts it; a build without RDMA, or a device that is absent or unusable, means TCP and one log line saying why (default: TCP only).
    #[arg(long)]
    pub rdma_dev: Option<String>,
    /// RDMA work requests in flight per queue pair, 1..=1024: the most this node grants a client (default 32).
    #[arg(long)]
    pub rdma_depth: Option<u32>,
    /// Seconds a node stopped with SIGTERM keeps serving gets, exists and deletes (never puts) after leaving its group, so clients read its pages through the handoff; decimals allowed, 0: stop at once (default 30). A second signal ends the drain.
    #[arg(long)]
    pub drain_secs: Option<f64>,
    /// Seconds a delete keeps refusing handoff copies of its key (match kv-mds --handoff-secs); 0: refuse every handoff copy (default 600).
    #[arg(long)]
    pub handoff_secs: Option<u64>,
    /// When a put is answered: `media` (default: once the page and its index entry are on media; a power loss takes back no acknowledged page) or `memory` (once the page is in the memory tier and queued for its disk: needs --mem-cap; a crash or power loss loses the puts not yet flushed, which then miss cleanly).
    #[arg(long, value_name = "media|memory")]
    pub ack: Option<String>,
    /// With --ack memory: bytes acknowledged and not yet on a disk, at most (e.g. 1G; default a quarter of --mem-cap); past it puts are answered on media.
    #[arg(long)]
    pub ack_memory_max: Option<String>,
    /// Reads of one key in a window (--hot-window-ms) that make it hot at least: its answers then ask clients to spread its reads (docs/ARCHITECTURE.md, "Hot keys"); 0: mark no key (default 64).
    #[arg(long)]
    pub hot_reads: Option<u32>,
    /// The window hot keys are counted in, in ms, 100..=60000 (default 1000).
    #[arg(long)]
    pub hot_window_ms: Option<u64>,
    /// Do not push pages to their new owners while draining (with --mds, a draining node pushes its pages, most recently used first, to the owners in the group it left, until the drain ends).
    #[arg(long)]
    pub no_drain_push: bool,
    /// Tenants' shares of this node, TENANT=SHARE comma separated, a share being bytes (200G) or a part of the node (40%): a tenant over its share evicts its own pages first; what it leaves unused is lent to the others (docs/DEPLOY.md, "Tenants"). For nodes without --mds; a node in a group follows the group's quotas (`kvctl tenants --set`) (default: none, one LRU for all).
    #[arg(long)]
    pub quotas: Option<String>,
}

const SERVER_EXAMPLES: &str = "Examples:
  kv-server --listen 127.0.0.1:7700 --dir /mnt/nvme0/kv,/mnt/nvme1/kv --cap 1T
  kv-server --listen 0.0.0.0:7700 --dir /mnt/nvme0/kv:2T,/mnt/nvme1/kv:1T --mem-cap 16G \\
            --metrics-listen 127.0.0.1:9700 \\
            --mds 10.0.0.1:7480,10.0.0.2:7480 --group prod --id gpu-07 --advertise 10.0.0.7:7700
  kv-server --config /etc/kvcellar/kv-server.toml";

/// The file form (every key optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub dirs: Option<Vec<String>>,
    pub cap: Option<String>,
    pub mem_cap: Option<String>,
    pub log_level: Option<String>,
    pub max_conns: Option<usize>,
    pub conn_threads: Option<usize>,
    pub idle_timeout: Option<u64>,
    pub max_record: Option<String>,
    pub max_inflight: Option<String>,
    pub metrics_listen: Option<String>,
    pub no_sync: Option<bool>,
    pub mds: Option<String>,
    pub group: Option<String>,
    pub id: Option<String>,
    pub advertise: Option<String>,
    pub weight: Option<u32>,
    pub auth_token_file: Option<PathBuf>,
    pub rdma_dev: Option<String>,
    pub rdma_depth: Option<u32>,
    pub drain_secs: Option<f64>,
    pub handoff_secs: Option<u64>,
    pub drain_push: Option<bool>,
    pub ack: Option<String>,
    pub ack_memory_max: Option<String>,
    pub hot_reads: Option<u32>,
    pub hot_window_ms: Option<u64>,
    /// `[quotas]`: tenant name = share (`"200G"`, `"40%"`).
    pub quotas: Option<std::collections::BTreeMap<String, String>>,
}

/// Membership through kv-mds (`--mds`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipConfig {
    pub endpoints: Vec<String>,
    pub group: String,
    pub id: String,
    /// `host:port`; port 0 is replaced by the port actually listened on.
    pub advertise: String,
    pub weight: u32,
    /// The metrics address registered with the group (set at start from
    /// `--metrics-listen`: its port on the advertised host when it listens
    /// on every address).
    pub metrics_addr: Option<String>,
}

/// Everything resolved and checked.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub store: StoreConfig,
    pub log_level: tracing::Level,
    pub max_conns: usize,
    /// Single-threaded runtimes the connections are spread over; 0: the
    /// node's work-stealing runtime serves them.
    pub conn_threads: usize,
    /// None: idle connections are never closed.
    pub idle_timeout: Option<std::time::Duration>,
    pub max_record: u64,
    pub max_inflight: u64,
    pub metrics_listen: Option<SocketAddr>,
    pub membership: Option<MembershipConfig>,
    /// The group's credentials (clients present one of their tokens).
    pub auth: Option<kv_common::auth::Credentials>,
    /// The token this node presents to kv-mds and to other nodes: the
    /// file's one token, or its node credential
    /// ([`kv_common::auth::Credentials::for_node`]).
    pub auth_token: Option<kv_common::auth::Token>,
    /// Where it was read from, for the start-up permission check.
    pub auth_token_file: Option<PathBuf>,
    /// `--rdma-dev` and `--rdma-depth` (no devices: TCP only).
    pub rdma: kv_rdma::Settings,
    /// How long a SIGTERM'd node drains (`--drain-secs`).
    pub drain: std::time::Duration,
    /// How long a delete refuses handoff copies (`--handoff-secs`).
    pub handoff: std::time::Duration,
    /// Whether a draining node pushes its pages to their new owners.
    pub drain_push: bool,
    /// How hot keys are marked (`--hot-reads`, `--hot-window-ms`).
    pub heat: crate::heat::HeatConfig,
    /// Tenants' shares (`--quotas`, `[quotas]`); a node in a group follows
    /// the group's instead.
    pub quotas: kv_common::quota::Quotas,
}

fn size(what: &str, s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| format!("--{what}: {e}"))
}

fn addr(what: &str, s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| format!("--{what}: {s:?} is not an IP:PORT address"))
}

impl ServerConfig {
    pub fn resolve(cli: Cli) -> Result<ServerConfig, String> {
        let file = match &cli.config {
            Some(p) => load_file(p)?,
            None => FileConfig::default(),
        };
        ServerConfig::resolve_with(cli, file)
    }

    /// As [`ServerConfig::resolve`] with the file's settings given (the fuzz
    /// targets drive this with [`parse_file`]).
    pub fn resolve_with(cli: Cli, file: FileConfig) -> Result<ServerConfig, String> {
        let membership = membership(&cli.mds, &cli.group, &cli.id, &cli.advertise, cli.weight, &file)?;
        let listen = cli.listen.or(file.listen).ok_or("--listen is required (e.g. 127.0.0.1:7700)")?;
        let listen = addr("listen", &listen)?;
        let dirs = if cli.dir.is_empty() { file.dirs.unwrap_or_default() } else { cli.dir };
        if dirs.is_empty() {
            return Err("--dir is required (one or more disk directories)".into());
        }
        let cap = cli.cap.or(file.cap);
        let mut disks = Vec::new();
        for d in &dirs {
            let (path, own) = match d.rsplit_once(':') {
                Some((p, s)) if !p.is_empty() => (p, Some(size("dir", s)?)),
                _ => (d.as_str(), None),
            };
            let cap = match (own, &cap) {
                (Some(c), _) => c,
                (None, Some(c)) => size("cap", c)?,
                (None, None) => return Err(format!("no cap for {path}: give --cap SIZE or --dir {path}:SIZE")),
            };
            if cap < 1 << 20 {
                return Err(format!("cap of {path} is below 1M"));
            }
            if path.is_empty() {
                return Err("--dir: empty directory name".into());
            }
            disks.push(DiskSpec { dir: PathBuf::from(path), cap });
        }
        for (i, a) in disks.iter().enumerate() {
            if disks[..i].iter().any(|b| b.dir == a.dir) {
                return Err(format!("--dir: {} is given twice", a.dir.display()));
            }
        }
        let mem_cap = match cli.mem_cap.or(file.mem_cap) {
            Some(s) => size("mem-cap", &s)?,
            None => 0,
        };
        let ack_memory_max = match cli.ack.or(file.ack).as_deref().unwrap_or("media") {
            "media" => {
                if cli.ack_memory_max.is_some() || file.ack_memory_max.is_some() {
                    return Err("--ack-memory-max is for --ack memory".into());
                }
                None
            }
            "memory" => {
                if mem_cap == 0 {
                    return Err("--ack memory needs a memory tier: give --mem-cap".into());
                }
                let max = match cli.ack_memory_max.or(file.ack_memory_max) {
                    Some(s) => size("ack-memory-max", &s)?,
                    None => mem_cap / 4,
                };
                if max == 0 || max > mem_cap {
                    return Err("--ack-memory-max must be more than 0 and at most --mem-cap".into());
                }
                Some(max)
            }
            other => return Err(format!("--ack: {other:?} is not one of media, memory")),
        };
        let max_record = size("max-record", &cli.max_record.or(file.max_record).unwrap_or("256M".into()))?;
        if !(4096..=(u32::MAX as u64)).contains(&max_record) {
            return Err("--max-record must be between 4K and 4G".into());
        }
        let max_inflight = size("max-inflight", &cli.max_inflight.or(file.max_inflight).unwrap_or("1G".into()))?;
        if max_inflight < max_record {
            return Err("--max-inflight must be at least --max-record".into());
        }
        let log_level = cli.log_level.or(file.log_level).unwrap_or("info".into());
        let log_level = log_level
            .parse()
            .map_err(|_| format!("--log-level: {log_level:?} is not one of error, warn, info, debug, trace"))?;
        let metrics_listen = match cli.metrics_listen.or(file.metrics_listen) {
            Some(s) => Some(addr("metrics-listen", &s)?),
            None => None,
        };
        let auth_token_file = cli.auth_token_file.or(file.auth_token_file);
        let auth = match &auth_token_file {
            Some(p) => Some(kv_common::auth::Credentials::read(p).map_err(|e| format!("--auth-token-file: {e}"))?),
            None => None,
        };
        // A member must have a token to present; a node outside a group
        // presents one only to other nodes, if it has one.
        let auth_token = match (&auth, &membership) {
            (Some(c), Some(m)) => Some(c.for_node(Some(&m.id)).map_err(|e| format!("--auth-token-file: {e}"))?),
            (Some(c), None) => c.for_node(None).ok(),
            (None, _) => None,
        };
        let max_conns = cli.max_conns.or(file.max_conns).unwrap_or(1024);
        if max_conns == 0 {
            return Err("--max-conns must be at least 1".into());
        }
        let devices = kv_rdma::parse_devices(&cli.rdma_dev.or(file.rdma_dev).unwrap_or_default())
            .map_err(|e| format!("--rdma-dev: {e}"))?;
        let depth = cli.rdma_depth.or(file.rdma_depth).unwrap_or(kv_rdma::DEFAULT_DEPTH);
        if !(1..=kv_rdma::MAX_DEPTH).contains(&depth) {
            return Err(format!("--rdma-depth must be 1..={}", kv_rdma::MAX_DEPTH));
        }
        let rdma = kv_rdma::Settings { devices, depth, numa_local: true };
        let drain = cli.drain_secs.or(file.drain_secs).unwrap_or(30.0);
        if !(0.0..=86_400.0).contains(&drain) {
            return Err("--drain-secs must be between 0 and 86400".into());
        }
        let handoff = cli.handoff_secs.or(file.handoff_secs).unwrap_or(600);
        if handoff > 7 * 86_400 {
            return Err("--handoff-secs must be at most 604800 (a week)".into());
        }
        let hot_window = cli.hot_window_ms.or(file.hot_window_ms).unwrap_or(1000);
        if !(100..=60_000).contains(&hot_window) {
            return Err("--hot-window-ms must be 100..=60000".into());
        }
        let heat = crate::heat::HeatConfig {
            window: std::time::Duration::from_millis(hot_window),
            min_reads: cli.hot_reads.or(file.hot_reads).unwrap_or(crate::heat::HeatConfig::default().min_reads),
        };
        let quotas = match (cli.quotas, file.quotas) {
            (Some(q), _) => kv_common::quota::Quotas::parse_list(&q).map_err(|e| format!("--quotas: {e}"))?,
            (None, Some(m)) => kv_common::quota::Quotas::from_strings(&m).map_err(|e| format!("[quotas]: {e}"))?,
            (None, None) => Default::default(),
        };
        let disks_n = disks.len();
        Ok(ServerConfig {
            quotas,
            heat,
            drain: std::time::Duration::from_secs_f64(drain),
            drain_push: !cli.no_drain_push && file.drain_push.unwrap_or(true),
            handoff: std::time::Duration::from_secs(handoff),
            membership,
            listen,
            store: StoreConfig {
                disks,
                mem_cap,
                sync_writes: !(cli.no_sync || file.no_sync.unwrap_or(false)),
                pool_bytes: 256 << 20,
                ack_memory_max,
                flushers: StoreConfig::default_flushers(disks_n),
                warmers: crate::store::WARMERS,
            },
            log_level,
            max_conns,
            conn_threads: {
                let n = cli.conn_threads.or(file.conn_threads).unwrap_or(0);
                if n > 1024 {
                    return Err("--conn-threads must be at most 1024".into());
                }
                n
            },
            idle_timeout: match cli.idle_timeout.or(file.idle_timeout).unwrap_or(120) {
                0 => None,
                s => Some(std::time::Duration::from_secs(s)),
            },
            max_record,
            max_inflight,
            metrics_listen,
            auth,
            auth_token,
            auth_token_file,
            rdma,
        })
    }
}

fn membership(
    mds: &Option<String>,
    group: &Option<String>,
    id: &Option<String>,
    advertise: &Option<String>,
    weight: Option<u32>,
    file: &FileConfig,
) -> Result<Option<MembershipConfig>, String> {
    use kv_common::mds::{parse_endpoints, valid_name};
    let group = group.clone().or(file.group.clone());
    let id = id.clone().or(file.id.clone());
    let advertise = advertise.clone().or(file.advertise.clone());
    let weight = weight.or(file.weight);
    let Some(mds) = mds.clone().or(file.mds.clone()) else {
        if group.is_some() || id.is_some() || advertise.is_some() || weight.is_some() {
            return Err("--group, --id, --advertise and --weight need --mds".into());
        }
        return Ok(None);
    };
    let endpoints = parse_endpoints(&mds).map_err(|e| format!("--mds: {e}"))?;
    let id = id.ok_or("--id is required with --mds (this node's name in its group)")?;
    let advertise = advertise.ok_or("--advertise HOST:PORT is required with --mds (the address clients dial)")?;
    let group = group.unwrap_or_else(|| "default".into());
    for (what, v) in [("id", &id), ("group", &group)] {
        if !valid_name(v) {
            return Err(format!("--{what}: {v:?} must be 1-64 of A-Z a-z 0-9 . _ -"));
        }
    }
    match advertise.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {}
        _ => return Err(format!("--advertise: {advertise:?} is not HOST:PORT")),
    }
    let weight = weight.unwrap_or(1);
    if !(1..=kv_common::ring::MAX_WEIGHT).contains(&weight) {
        return Err(format!("--weight: {weight} is outside 1..={}", kv_common::ring::MAX_WEIGHT));
    }
    Ok(Some(MembershipConfig { endpoints, group, id, advertise, weight, metrics_addr: None }))
}

fn load_file(p: &Path) -> Result<FileConfig, String> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("--config {}: {e}", p.display()))?;
    parse_file(&text).map_err(|e| format!("--config {}: {e}", p.display()))
}

/// The TOML form of the configuration, parsed (keys not checked yet).
pub fn parse_file(text: &str) -> Result<FileConfig, String> {
    toml::from_str(text).map_err(|e| e.message().to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_flag_has_help_and_the_man_pages_match() {
        use clap::CommandFactory;
        kv_common::cli::check_command_line(&super::Cli::command());
    }

    use super::*;

    fn cli(args: &[&str]) -> Result<ServerConfig, String> {
        let mut v = vec!["kv-server"];
        v.extend_from_slice(args);
        ServerConfig::resolve(Cli::try_parse_from(v).map_err(|e| e.to_string())?)
    }

    #[test]
    fn flags_with_per_dir_caps() {
        let c = cli(&["--listen", "127.0.0.1:0", "--dir", "/a,/b:2T", "--cap", "512G"]).unwrap();
        assert_eq!(c.store.disks[0].cap, 512 << 30);
        assert_eq!(c.store.disks[1].cap, 2 << 40);
        assert_eq!(c.store.disks[1].dir, PathBuf::from("/b"));
        assert!(c.store.sync_writes);
    }

    #[test]
    fn clear_errors() {
        let e = cli(&["--dir", "/a", "--cap", "1G"]).unwrap_err();
        assert!(e.contains("--listen is required"), "{e}");
        let e = cli(&["--listen", "x", "--dir", "/a", "--cap", "1G"]).unwrap_err();
        assert!(e.contains("not an IP:PORT"), "{e}");
        let e = cli(&["--listen", "127.0.0.1:1", "--dir", "/a"]).unwrap_err();
        assert!(e.contains("no cap for /a"), "{e}");
        let e = cli(&["--listen", "127.0.0.1:1", "--dir", "/a", "--cap", "12Q"]).unwrap_err();
        assert!(e.contains("--cap: invalid size"), "{e}");
        let e = cli(&["--listen", "127.0.0.1:1", "--dir", "/a,/a", "--cap", "1G"]).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
    }

    #[test]
    fn ack_modes() {
        let base = ["--listen", "127.0.0.1:1", "--dir", "/a", "--cap", "1G"];
        let with = |more: &[&str]| cli(&[&base[..], more].concat());
        assert_eq!(with(&[]).unwrap().store.ack_memory_max, None, "media by default");
        assert_eq!(with(&["--ack", "media"]).unwrap().store.ack_memory_max, None);
        let e = with(&["--ack", "memory"]).unwrap_err();
        assert!(e.contains("needs a memory tier"), "{e}");
        assert_eq!(with(&["--ack", "memory", "--mem-cap", "8G"]).unwrap().store.ack_memory_max, Some(2 << 30));
        let c = with(&["--ack", "memory", "--mem-cap", "8G", "--ack-memory-max", "1G"]).unwrap();
        assert_eq!(c.store.ack_memory_max, Some(1 << 30));
        assert!(with(&["--ack", "memory", "--mem-cap", "1G", "--ack-memory-max", "2G"]).is_err());
        assert!(with(&["--ack-memory-max", "1G"]).unwrap_err().contains("for --ack memory"));
        assert!(with(&["--ack", "disk"]).unwrap_err().contains("not one of media, memory"));
    }

    #[test]
    fn membership_flags() {
        let base = ["--listen", "127.0.0.1:1", "--dir", "/a", "--cap", "1G"];
        let with = |more: &[&str]| cli(&[&base[..], more].concat());
        assert_eq!(with(&[]).unwrap().membership, None);
        let m = with(&["--mds", "h:1,h:2", "--id", "n1", "--advertise", "10.0.0.1:0", "--weight", "3"])
            .unwrap()
            .membership
            .unwrap();
        assert_eq!((m.endpoints.len(), m.group.as_str(), m.weight), (2, "default", 3));
        let e = with(&["--mds", "h:1", "--advertise", "h:1"]).unwrap_err();
        assert!(e.contains("--id is required"), "{e}");
        let e = with(&["--mds", "h:1", "--id", "n1"]).unwrap_err();
        assert!(e.contains("--advertise"), "{e}");
        let e = with(&["--mds", "h:1", "--id", "n/1", "--advertise", "h:1"]).unwrap_err();
        assert!(e.contains("--id"), "{e}");
        let e = with(&["--mds", "h:1", "--id", "n1", "--advertise", "h:1", "--weight", "0"]).unwrap_err();
        assert!(e.contains("--weight"), "{e}");
        let e = with(&["--group", "g"]).unwrap_err();
        assert!(e.contains("need --mds"), "{e}");
        let e = with(&["--mds", "nope", "--id", "n1", "--advertise", "h:1"]).unwrap_err();
        assert!(e.contains("--mds"), "{e}");
    }

    #[test]
    fn toml_file_and_override() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("kv.toml");
        std::fs::write(
            &p,
            "listen = \"127.0.0.1:7000\"\ndirs = [\"/x\", \"/y:1G\"]\ncap = \"2G\"\nmem_cap = \"64M\"\n",
        )
        .unwrap();
        let c = cli(&["--config", p.to_str().unwrap(), "--listen", "127.0.0.1:7001"]).unwrap();
        assert_eq!(c.listen.port(), 7001);
        assert_eq!(c.store.disks.len(), 2);
        assert_eq!(c.store.disks[0].cap, 2 << 30);
        assert_eq!(c.store.mem_cap, 64 << 20);
        std::fs::write(&p, "listen = 5\n").unwrap();
        assert!(cli(&["--config", p.to_str().unwrap()]).unwrap_err().contains("--config"));
        std::fs::write(&p, "lisen = \"x\"\n").unwrap();
        assert!(cli(&["--config", p.to_str().unwrap()]).unwrap_err().contains("unknown field"));
    }

    #[test]
    fn the_auth_token_comes_from_a_file() {
        let d = tempfile::tempdir().unwrap();
        let tok = d.path().join("token");
        std::fs::write(&tok, "\tgroup-secret\n").unwrap();
        let base = ["--listen", "127.0.0.1:1", "--dir", "/a", "--cap", "1G"];
        let c = cli(&[&base[..], &["--auth-token-file", tok.to_str().unwrap()]].concat()).unwrap();
        assert_eq!(c.auth_token.unwrap().as_bytes(), b"group-secret");
        assert!(cli(&base).unwrap().auth_token.is_none());
        let p = d.path().join("kv.toml");
        std::fs::write(&p, format!("auth_token_file = {:?}\n", tok.to_str().unwrap())).unwrap();
        let c = cli(&[&base[..], &["--config", p.to_str().unwrap()]].concat()).unwrap();
        assert_eq!(c.auth_token.unwrap().as_bytes(), b"group-secret");
        std::fs::write(&tok, "").unwrap();
        let e = cli(&[&base[..], &["--auth-token-file", tok.to_str().unwrap()]].concat()).unwrap_err();
        assert!(e.contains("--auth-token-file") && e.contains("empty"), "{e}");
        // A credential table: the node presents its own node credential; a
        // member of a group whose table has none for it does not start.
        std::fs::write(&tok, "e role=engine\nn1 role=node node=n1\n").unwrap();
        let member = [
            "--mds",
            "127.0.0.1:7480",
            "--group",
            "g",
            "--advertise",
            "127.0.0.1:1",
            "--auth-token-file",
            tok.to_str().unwrap(),
        ];
        let c = cli(&[&base[..], &member[..], &["--id", "n1"]].concat()).unwrap();
        assert_eq!(c.auth_token.unwrap().as_bytes(), b"n1");
        assert!(c.auth.unwrap().find(b"e").is_some(), "engines' tokens open the data port");
        let e = cli(&[&base[..], &member[..], &["--id", "n2"]].concat()).unwrap_err();
        assert!(e.contains("role=node node=n2"), "{e}");
    }
}
