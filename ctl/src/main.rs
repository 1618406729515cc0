//! `kvctl`: the kvcellar operator CLI.
//!
//! Data commands (`put`, `get`, `exist`) go through the client library, so
//! they route by the weighted ring (`--members`) or to one node (`--node`)
//! and verify pages exactly as an engine's get does; they, and `bench`, take
//! `--mds EPS --group G` to use a group's current members, as does `delete`;
//! without flags they use KVCELLAR_MDS / KVCELLAR_MEMBERS / KVCELLAR_GROUP.
//! `stat` and `ping` talk to one node. `ring` shows a group's view from kv-mds and
//! `stat --all` every member's statistics. `bench` measures a cluster beside
//! the limits of this host. `replay` replays a request trace the way an
//! engine's L3 tier calls the group (docs/BENCHMARKS.md, "Trace replay").
//!
//! Every command presents the group's auth token when one is given
//! (`--auth-token-file`, else KVCELLAR_AUTH_TOKEN_FILE); a refused token is
//! one line and exit 2.
//!
//! Exit codes: 0 hit/ok, 1 miss (or not served), 2 usage or error.

mod bench;
mod cluster;
mod health;
mod replay;
mod target;
mod top;

use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kv_common::size::format_size;
use kv_common::status::Status;
use kvclient::Conn;
use target::{GeoArgs, Target};

const EXAMPLES: &str = "Examples:
  kvctl ring --mds 10.0.0.1:7480 --group prod
  kvctl ring --mds 10.0.0.1:7480 --group prod --set-placement multiprobe
  kvctl stat --all --mds 10.0.0.1:7480 --group prod
  kvctl put --mds 10.0.0.1:7480 --group prod page-1 --file page.bin
  kvctl get --members n1=10.0.0.7:7700,n2=10.0.0.8:7700 page-1 --out page.bin
  kvctl exist --node 10.0.0.7:7700 page-1
  kvctl bench --mds 10.0.0.1:7480 --op get --size 4M --threads 8 --duration 10
  kvctl replay --mds 10.0.0.1:7480 --group prod traces/conversation_trace.jsonl --engines 4
  export KVCELLAR_MDS=10.0.0.1:7480 KVCELLAR_GROUP=prod; kvctl ring
  kvctl health --local --timeout-ms 3000      (a container's HEALTHCHECK)

Exit codes: 0 hit/ok, 1 miss or not served, 2 usage or error.";

/// The largest value `kvctl get` reads (a node's --max-record is at most 4G).
const MAX_GET_BYTES: usize = 4 << 30;

#[derive(Parser)]
#[command(name = "kvctl", version, about = "kvcellar operator CLI", after_help = EXAMPLES)]
struct Cli {
    /// Print machine-readable JSON (put, get, exist, delete, stat, ring, ping, health, replay).
    #[arg(long, global = true)]
    json: bool,
    /// Timeout in milliseconds of `stat`, `ring`, `ping` and `health` (the data commands take --options io_timeout_ms=...).
    #[arg(long, global = true, default_value_t = 10_000)]
    timeout_ms: u64,
    /// File holding the group's auth token, presented to nodes and kv-mds (else KVCELLAR_AUTH_TOKEN_FILE).
    #[arg(long, global = true)]
    auth_token_file: Option<std::path::PathBuf>,
    /// File holding an admin token of the group, presented for changes to the group (`ring --set-placement`; else KVCELLAR_ADMIN_TOKEN_FILE, else the auth token).
    #[arg(long, global = true)]
    admin_token_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store a value: from the argument, --file, or standard input.
    Put {
        #[command(flatten)]
        target: Target,
        /// The key: 1-1024 bytes, any characters but NUL.
        key: String,
        /// The value as text (else --file, else standard input).
        value: Option<String>,
        /// Read the value from this file.
        #[arg(long)]
        file: Option<std::path::PathBuf>,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Fetch and verify a value; writes it to standard output or --out.
    Get {
        #[command(flatten)]
        target: Target,
        /// The key to read.
        key: String,
        /// Write the value to this file instead of standard output.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Whether a get with this geometry would hit.
    Exist {
        #[command(flatten)]
        target: Target,
        /// The key to look up.
        key: String,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Remove a key at its owner (or at --node).
    Delete {
        #[command(flatten)]
        target: Target,
        /// The key to remove.
        key: String,
    },
    /// One node's statistics, or with --all every member's and a total.
    Stat {
        /// The node's address (without --all).
        #[arg(required_unless_present = "all")]
        addr: Option<String>,
        /// Every member of the group (--mds) or of --members, then a TOTAL row.
        #[arg(long, conflicts_with = "addr")]
        all: bool,
        /// kv-mds endpoints `host:port,...` (with --all; else KVCELLAR_MDS).
        #[arg(long, requires = "all")]
        mds: Option<String>,
        /// Group (with --mds; else KVCELLAR_GROUP, else "default").
        #[arg(long)]
        group: Option<String>,
        /// Member list instead of --mds (with --all; else KVCELLAR_MEMBERS).
        #[arg(long, requires = "all", conflicts_with = "mds")]
        members: Option<String>,
        /// Also each tenant's quota, bytes, records, evictions (own and for others), hits, misses and puts,
        /// per node (and, with --all, in total).
        #[arg(long)]
        tenants: bool,
    },
    /// A group's view from kv-mds: epoch, placement rule, then each member's weight, vnodes and share of keys.
    Ring {
        /// kv-mds endpoints `host:port,...` (else KVCELLAR_MDS).
        #[arg(long)]
        mds: Option<String>,
        /// Group (else KVCELLAR_GROUP, else "default").
        #[arg(long)]
        group: Option<String>,
        /// First set the group's placement rule (`ketama` or `multiprobe`): a membership transition,
        /// with handoff. Upgrade every kv-mds, node and client first (docs/DEPLOY.md).
        #[arg(long, value_name = "RULE")]
        set_placement: Option<String>,
    },
    /// A group's tenants' quotas from kv-mds (docs/DEPLOY.md, "Tenants"); --set and --unset change
    /// one (an admin's call: --admin-token-file). Nodes follow within a few seconds.
    Tenants {
        /// kv-mds endpoints `host:port,...` (else KVCELLAR_MDS).
        #[arg(long)]
        mds: Option<String>,
        /// Group (else KVCELLAR_GROUP, else "default").
        #[arg(long)]
        group: Option<String>,
        /// Sets a tenant's share of each node: TENANT=SHARE, a share being bytes (200G) or a part of the
        /// node (40%). A tenant over its share evicts its own pages first; what it leaves is lent.
        #[arg(long, value_name = "TENANT=SHARE", conflicts_with = "unset")]
        set: Option<String>,
        /// Removes a tenant's quota (it then borrows what others leave).
        #[arg(long, value_name = "TENANT")]
        unset: Option<String>,
    },
    /// A live view of a group: per node and in total, requests/s, gets/s, read and write throughput,
    /// hit rate by tier, get and put p99, use; refreshed every --interval-ms (Ctrl-C ends it).
    Top {
        /// kv-mds endpoints `host:port,...` (else KVCELLAR_MDS); members re-read every refresh.
        #[arg(long)]
        mds: Option<String>,
        /// Group (with --mds; else KVCELLAR_GROUP, else "default").
        #[arg(long)]
        group: Option<String>,
        /// Member list instead of --mds (else KVCELLAR_MEMBERS).
        #[arg(long, conflicts_with = "mds")]
        members: Option<String>,
        /// Milliseconds between refreshes.
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
        /// Stop after this many refreshes (default: run until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
        /// Also a table of the group's tenants: each one's use of its quota, gets, hit rate, puts and
        /// evictions (own and for other tenants' puts) summed over the nodes.
        #[arg(long)]
        tenants: bool,
    },
    /// Round-trip time to a node.
    Ping {
        /// The node's address, HOST:PORT.
        addr: String,
    },
    /// Measure put/get/exist throughput and latency against a cluster.
    Bench(bench::BenchArgs),
    /// Replay a request trace as an engine's L3 tier (SGLang HiCache) would: per request a batch exist,
    /// a get of the leading hits (verified byte for byte), a put of the rest; reports hits beside the
    /// trace's ceiling and an LRU of the group's capacity. Exit 1 when any page was wrong.
    Replay(replay::ReplayArgs),
    /// Whether a daemon is serving: exit 0 healthy, 1 not, 2 nothing found (for HEALTHCHECK and probes).
    Health {
        /// A /healthz address, HOST:PORT (kv-mds API port, kv-server --metrics-listen port).
        #[arg(required_unless_present = "local")]
        addr: Option<String>,
        /// Find the kv-server or kv-mds running on this host (this container) and ask it:
        /// kv-mds its /healthz, kv-server its disks over the data port.
        #[arg(long, conflicts_with = "addr")]
        local: bool,
        /// With --local, exit 0 when no daemon runs here (containers of the client roles).
        #[arg(long, requires = "local")]
        none_ok: bool,
    },
}

fn main() -> ExitCode {
    // Output piped into `head` and the like: end quietly when the reader
    // goes away, as other command-line tools do, instead of a panic on a
    // failed print. (SIGPIPE stays ignored: a peer closing a socket must be
    // an error, not the end of the process.)
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = kv_common::cli::panic_message(info);
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default_hook(info);
    }));
    let cli: Cli = match kv_common::cli::parse_args("kvctl") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let tokens = read_token(cli.auth_token_file.as_deref(), "--auth-token-file", kv_common::auth::TOKEN_FILE_ENV)
        .and_then(|t| {
            read_token(cli.admin_token_file.as_deref(), "--admin-token-file", kv_common::auth::ADMIN_TOKEN_FILE_ENV)
                .map(|a| (t, a))
        });
    let (token, admin) = match tokens {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvctl: error: {e}");
            return ExitCode::from(2);
        }
    };
    let _ = TOKEN.set(token);
    let _ = ADMIN_TOKEN.set(admin);
    match run(&cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("kvctl: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// The auth token every command presents (set once, in `main`).
static TOKEN: OnceLock<Option<kv_common::auth::Token>> = OnceLock::new();

pub fn token() -> Option<&'static kv_common::auth::Token> {
    TOKEN.get().and_then(|t| t.as_ref())
}

static ADMIN_TOKEN: OnceLock<Option<kv_common::auth::Token>> = OnceLock::new();

/// The token presented for changes to the group: the admin token, else
/// the auth token.
pub fn admin_token() -> Option<&'static kv_common::auth::Token> {
    ADMIN_TOKEN.get().and_then(|t| t.as_ref()).or_else(token)
}

/// The token of the file `flag` names, else of the one the variable `env`
/// names.
fn read_token(
    flag: Option<&std::path::Path>,
    flag_name: &str,
    env: &str,
) -> Result<Option<kv_common::auth::Token>, String> {
    use kv_common::auth::read_token_file;
    if let Some(p) = flag {
        return read_token_file(p).map(Some).map_err(|e| format!("{flag_name}: {e}"));
    }
    match std::env::var(env).ok().filter(|v| !v.trim().is_empty()) {
        Some(p) => read_token_file(std::path::Path::new(p.trim())).map(Some).map_err(|e| format!("{env}: {e}")),
        None => Ok(None),
    }
}

/// A refused token ends the command: one line, exit 2.
fn check_denied(st: Status) -> Result<(), String> {
    if st == Status::Edenied {
        let why = kvclient::error::take_last_failure().unwrap_or_else(|| "the auth token was refused".into());
        return Err(denied_line(&why));
    }
    Ok(())
}

/// A change to the group refused for the credential's role: one line.
pub fn forbidden_line(why: &str) -> String {
    format!("{why} (changes to a group need an admin credential: give it with --admin-token-file or KVCELLAR_ADMIN_TOKEN_FILE)")
}

pub fn denied_line(why: &str) -> String {
    format!("access denied: {why} (give the group's token with --auth-token-file or KVCELLAR_AUTH_TOKEN_FILE)")
}

fn connect(cli: &Cli, addr: &str) -> Result<Conn, String> {
    Conn::connect_with(addr, Duration::from_millis(cli.timeout_ms), token()).map_err(|e| match e {
        kvclient::OpError::Denied => denied_line(&format!("{addr}: {e}")),
        e => e.to_string(),
    })
}

fn status_exit(cli: &Cli, key: &str, st: Status) -> u8 {
    if cli.json {
        println!("{}", serde_json::json!({"key": key, "status": st.name()}));
    } else {
        println!("{}", st.name());
    }
    if st == Status::Ok {
        0
    } else {
        1
    }
}

fn run(cli: &Cli) -> Result<u8, String> {
    match &cli.cmd {
        Cmd::Put { target, key, value, file, geo } => {
            let data = match (value, file) {
                (Some(v), None) => v.clone().into_bytes(),
                (None, Some(f)) => std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?,
                (None, None) => {
                    let mut v = Vec::new();
                    std::io::stdin().read_to_end(&mut v).map_err(|e| e.to_string())?;
                    v
                }
                (Some(_), Some(_)) => return Err("give a value or --file, not both".into()),
            };
            let c = target.client(geo.geometry())?;
            let st = c.putv(key.as_bytes(), &[&data]);
            check_denied(st)?;
            if st != Status::Ok {
                let why = kvclient::error::take_last_failure().unwrap_or_else(|| "no further detail".into());
                eprintln!("kvctl: put not done ({}): {why}", st.name());
            }
            if cli.json {
                println!("{}", serde_json::json!({"key": key, "status": st.name(), "bytes": data.len()}));
            } else if st == Status::Ok {
                println!("ok");
            }
            Ok(u8::from(st != Status::Ok))
        }
        Cmd::Get { target, key, out, geo } => {
            let c = target.client(geo.geometry())?;
            // Try a 4 MiB buffer; on KV_TOO_SMALL the node said how much is needed.
            let mut buf = vec![0u8; 4 << 20];
            let mut r = c.getv(key.as_bytes(), &mut [&mut buf[..]]);
            if let Err((Status::TooSmall, need)) = r {
                // The size comes from the node: bounded before it is allocated.
                if need > MAX_GET_BYTES {
                    return Err(format!(
                        "the node says {key:?} is {need} bytes, more than kvctl reads ({MAX_GET_BYTES} bytes)"
                    ));
                }
                buf = vec![0u8; need];
                r = c.getv(key.as_bytes(), &mut [&mut buf[..]]);
            }
            match r {
                Ok(n) => {
                    let v = &buf[..n];
                    match out {
                        Some(p) => std::fs::write(p, v).map_err(|e| format!("{}: {e}", p.display()))?,
                        None if cli.json => println!("{}", serde_json::json!({"key": key, "status": "ok", "bytes": n})),
                        None => std::io::stdout().write_all(v).map_err(|e| e.to_string())?,
                    }
                    Ok(0)
                }
                Err((st, _)) => {
                    check_denied(st)?;
                    let why = kvclient::error::take_last_failure();
                    if cli.json {
                        println!("{}", serde_json::json!({"key": key, "status": st.name(), "reason": why}));
                    } else {
                        eprintln!("{}{}", st.name(), why.map(|w| format!(": {w}")).unwrap_or_default());
                    }
                    Ok(1)
                }
            }
        }
        Cmd::Exist { target, key, geo } => {
            let c = target.client(geo.geometry())?;
            let st = c.exist(key.as_bytes());
            check_denied(st)?;
            Ok(status_exit(cli, key, st))
        }
        Cmd::Delete { target, key } => {
            let c = target.client(kv_common::page::Geometry::default())?;
            let st = c.delete(key.as_bytes());
            check_denied(st)?;
            Ok(status_exit(cli, key, st))
        }
        Cmd::Ring { mds, group, set_placement } => {
            let (mds, group) = match target::resolve(None, None, mds.as_deref(), group.as_deref())? {
                target::Cluster::Mds { endpoints, group } => (endpoints, group),
                target::Cluster::Members(_) => return Err("ring needs --mds host:port,... (or KVCELLAR_MDS)".into()),
            };
            if let Some(rule) = set_placement {
                let epoch = cluster::set_placement(&mds, &group, rule, Duration::from_millis(cli.timeout_ms))?;
                if !cli.json {
                    println!("group {group} places keys by {rule} from epoch {epoch}");
                }
            }
            let view = cluster::fetch_view(&mds, &group, Duration::from_millis(cli.timeout_ms))?;
            cluster::ring(&view, cli.json)
        }
        Cmd::Tenants { mds, group, set, unset } => {
            let (mds, group) = match target::resolve(None, None, mds.as_deref(), group.as_deref())? {
                target::Cluster::Mds { endpoints, group } => (endpoints, group),
                target::Cluster::Members(_) => {
                    return Err("tenants needs --mds host:port,... (or KVCELLAR_MDS); a node without kv-mds takes its quotas from its own --quotas".into())
                }
            };
            let timeout = Duration::from_millis(cli.timeout_ms);
            let change = match (set, unset) {
                (Some(s), _) => {
                    let (t, q) = s.split_once('=').ok_or("--set: expected TENANT=SHARE, e.g. team-a=40%")?;
                    kv_common::quota::Quota::parse(q).map_err(|e| format!("--set: {e}"))?;
                    Some((t.trim(), Some(q.trim())))
                }
                (None, Some(t)) => Some((t.as_str(), None)),
                (None, None) => None,
            };
            cluster::tenants(&mds, &group, change, timeout, cli.json)
        }
        Cmd::Stat { all: true, mds, group, members, tenants, .. } => {
            let timeout = Duration::from_millis(cli.timeout_ms);
            let cluster = target::resolve(members.as_deref(), None, mds.as_deref(), group.as_deref())
                .map_err(|e| format!("stat --all: {e}"))?;
            let group = target::group_or_env(group.as_deref());
            let (epoch, list) = match cluster {
                target::Cluster::Mds { endpoints, group } => {
                    let v = cluster::fetch_view(&endpoints, &group, timeout)?;
                    (Some(v.epoch), v.members)
                }
                target::Cluster::Members(m) => (None, cluster::member_records(&m)?),
            };
            Ok(cluster::stat_all(&group, epoch, &list, timeout, cli.json, *tenants))
        }
        Cmd::Stat { addr, tenants, .. } => {
            let addr = addr.as_deref().ok_or("give a node address or --all")?;
            let mut c = connect(cli, addr)?;
            let s = c.stats().map_err(|e| e.to_string())?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?);
                return Ok(0);
            }
            let ratio = if s.hits + s.misses > 0 { 100.0 * s.hits as f64 / (s.hits + s.misses) as f64 } else { 0.0 };
            let draining = if s.draining { "  DRAINING (left its group; no puts)" } else { "" };
            println!(
                "node {addr}  version {}  up {}s  connections {}{draining}",
                s.version, s.uptime_secs, s.connections
            );
            println!(
                "used {} of {}  objects {}  hits {}  misses {}  hit {ratio:.1}%  read {}  written {}  evictions {}  failed disks {}",
                format_size(s.used_bytes), format_size(s.capacity_bytes), s.objects, s.hits, s.misses,
                format_size(s.bytes_read), format_size(s.bytes_written), s.evictions, s.failed_disks
            );
            println!("{}", cluster::handoff_line(&s));
            println!(
                "hot keys {}  reads of hot keys {}  turned hot {}  threshold {} reads a window  copies filled {}  held {}",
                s.hot_keys, s.hot_reads, s.hot_marked, s.hot_threshold, s.hot_fills, s.hot_copies_held
            );
            if s.ack_memory {
                println!("{}", cluster::ack_line(&s));
            }
            if s.mem_capacity_bytes > 0 {
                println!("{}", cluster::warm_line(&s));
            }
            if s.mem_capacity_bytes > 0 {
                println!(
                    "memory tier {} of {}  hits {}",
                    format_size(s.mem_used_bytes),
                    format_size(s.mem_capacity_bytes),
                    s.mem_hits
                );
            }
            println!(
                "{:<7} {:>10} {:>10} {:>6} {:>9} {:>9}  {:<8} dir",
                "disk", "used", "cap", "full", "objects", "evicted", "state"
            );
            for d in &s.disks {
                let state = if d.failed { "FAILED" } else { "ok" };
                println!(
                    "{:<7} {:>10} {:>10} {:>6} {:>9} {:>9}  {:<8} {}{}",
                    d.id,
                    format_size(d.used_bytes),
                    format_size(d.capacity_bytes),
                    cluster::full_pct(d.used_bytes, d.capacity_bytes),
                    d.objects,
                    d.evictions,
                    state,
                    d.dir,
                    d.failure.as_ref().map(|f| format!("  ({f})")).unwrap_or_default()
                );
            }
            if *tenants {
                cluster::print_tenants(&[(addr.to_string(), s.tenants.clone())], false);
            }
            Ok(0)
        }
        Cmd::Bench(a) => bench::run(a, cli.json),
        Cmd::Replay(a) => replay::run(a, cli.json, Duration::from_millis(cli.timeout_ms)),
        Cmd::Top { mds, group, members, interval_ms, iterations, tenants } => {
            let timeout = Duration::from_millis(cli.timeout_ms);
            let source = match target::resolve(members.as_deref(), None, mds.as_deref(), group.as_deref())
                .map_err(|e| format!("top: {e}"))?
            {
                target::Cluster::Mds { endpoints, group } => top::Source::Mds { endpoints, group },
                target::Cluster::Members(m) => top::Source::Members(cluster::member_records(&m)?),
            };
            let every = Duration::from_millis((*interval_ms).max(100));
            top::run(&source, every, *iterations, timeout, cli.json, *tenants)
        }
        Cmd::Health { addr, local, none_ok } => {
            health::run(addr.as_deref(), *local, *none_ok, Duration::from_millis(cli.timeout_ms), cli.json)
        }
        Cmd::Ping { addr } => {
            let t = std::time::Instant::now();
            let mut c = connect(cli, addr)?;
            let connected = t.elapsed();
            let t = std::time::Instant::now();
            c.ping(b"kvctl").map_err(|e| e.to_string())?;
            let rtt = t.elapsed();
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"addr": addr, "connect_us": connected.as_micros() as u64, "rtt_us": rtt.as_micros() as u64})
                );
            } else {
                println!("{addr}: connect {:?}, round trip {:?}", connected, rtt);
            }
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_flag_has_help_and_the_man_pages_match() {
        use clap::CommandFactory;
        kv_common::cli::check_command_line(&super::Cli::command());
    }
}
