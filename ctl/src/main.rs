//! `kvctl`: the kvcellar operator CLI.
//!
//! Status: partial. This issue delivers the single-node data commands
//! (`put`, `get`, `exist`, `delete`) and `stat`/`ping` against one node
//! (`--node`); `--members` routing, `bench`, `ring` and `stat --all` arrive
//! with the client and membership issues.
//!
//! Exit codes: 0 hit/ok, 1 miss (or not served), 2 usage or error.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kv_common::page::{Geometry, FLAG_MLA};
use kv_common::size::format_size;
use kv_common::status::Status;
use kvclient::conn::GetResult;
use kvclient::Conn;

#[derive(Parser)]
#[command(name = "kvctl", version, about = "kvcellar operator CLI")]
struct Cli {
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    json: bool,
    /// I/O timeout in milliseconds.
    #[arg(long, global = true, default_value_t = 10_000)]
    timeout_ms: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Page geometry stamped on put and required on get (defaults: all zero, tp_size 1).
#[derive(Args, Clone)]
struct GeoArgs {
    #[arg(long, default_value_t = 0)]
    model_hash: u64,
    #[arg(long, default_value_t = 0)]
    page_size: u32,
    #[arg(long, default_value_t = 0)]
    dtype_tag: u32,
    #[arg(long, default_value_t = 1)]
    tp_size: u16,
    #[arg(long, default_value_t = 0)]
    tp_rank: u16,
    #[arg(long, default_value_t = 0)]
    layer_num: u16,
    #[arg(long, default_value_t = 0)]
    head_num: u16,
    #[arg(long, default_value_t = 0)]
    head_dim: u16,
    /// MLA page (tp_size/tp_rank not compared).
    #[arg(long)]
    mla: bool,
}

impl GeoArgs {
    fn geometry(&self) -> Geometry {
        Geometry {
            model_hash: self.model_hash,
            page_size: self.page_size,
            dtype_tag: self.dtype_tag,
            tp_size: self.tp_size,
            tp_rank: self.tp_rank,
            layer_num: self.layer_num,
            head_num: self.head_num,
            head_dim: self.head_dim,
            flags: if self.mla { FLAG_MLA } else { 0 },
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Store a value: from the argument, --file, or standard input.
    Put {
        #[arg(long)]
        node: String,
        key: String,
        value: Option<String>,
        #[arg(long)]
        file: Option<std::path::PathBuf>,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Fetch and verify a value; writes it to standard output or --out.
    Get {
        #[arg(long)]
        node: String,
        key: String,
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Whether a get with this geometry would hit.
    Exist {
        #[arg(long)]
        node: String,
        key: String,
        #[command(flatten)]
        geo: GeoArgs,
    },
    /// Remove a key.
    Delete {
        #[arg(long)]
        node: String,
        key: String,
    },
    /// One node's statistics.
    Stat { addr: String },
    /// Round-trip time to a node.
    Ping { addr: String },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{}", kv_common::cli::usage_error_line("kvctl", &e.to_string()));
            return ExitCode::from(2);
        }
    };
    match run(&cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("kvctl: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn connect(cli: &Cli, addr: &str) -> Result<Conn, String> {
    Conn::connect(addr, Duration::from_millis(cli.timeout_ms)).map_err(|e| e.to_string())
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
        Cmd::Put { node, key, value, file, geo } => {
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
            let mut c = connect(cli, node)?;
            match c.put(&geo.geometry(), key.as_bytes(), &data) {
                Ok(fresh) => {
                    if cli.json {
                        println!(
                            "{}",
                            serde_json::json!({"key": key, "status": "ok", "bytes": data.len(), "duplicate": !fresh})
                        );
                    } else {
                        println!("ok{}", if fresh { "" } else { " (already stored)" });
                    }
                    Ok(0)
                }
                Err(kvclient::ClientError::Refused { status, msg }) => {
                    eprintln!("kvctl: put refused ({}): {msg}", status.name());
                    Ok(1)
                }
                Err(e) => Err(e.to_string()),
            }
        }
        Cmd::Get { node, key, out, geo } => {
            let mut c = connect(cli, node)?;
            match c.get(&geo.geometry(), key.as_bytes()).map_err(|e| e.to_string())? {
                GetResult::Hit(v) => {
                    match out {
                        Some(p) => std::fs::write(p, &v).map_err(|e| format!("{}: {e}", p.display()))?,
                        None if cli.json => {
                            println!("{}", serde_json::json!({"key": key, "status": "ok", "bytes": v.len()}))
                        }
                        None => std::io::stdout().write_all(&v).map_err(|e| e.to_string())?,
                    }
                    Ok(0)
                }
                GetResult::NotServed(st) => {
                    if cli.json {
                        println!("{}", serde_json::json!({"key": key, "status": st.name()}));
                    } else {
                        eprintln!("{}", st.name());
                    }
                    Ok(1)
                }
            }
        }
        Cmd::Exist { node, key, geo } => {
            let mut c = connect(cli, node)?;
            let st = c.exist(Some(&geo.geometry()), key.as_bytes()).map_err(|e| e.to_string())?;
            Ok(status_exit(cli, key, st))
        }
        Cmd::Delete { node, key } => {
            let mut c = connect(cli, node)?;
            let st = c.delete(key.as_bytes()).map_err(|e| e.to_string())?;
            Ok(status_exit(cli, key, st))
        }
        Cmd::Stat { addr } => {
            let mut c = connect(cli, addr)?;
            let s = c.stats().map_err(|e| e.to_string())?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?);
                return Ok(0);
            }
            let ratio = if s.hits + s.misses > 0 { 100.0 * s.hits as f64 / (s.hits + s.misses) as f64 } else { 0.0 };
            println!("node {addr}  version {}  up {}s  connections {}", s.version, s.uptime_secs, s.connections);
            println!(
                "used {} of {}  objects {}  hits {}  misses {}  hit {ratio:.1}%  read {}  written {}  evictions {}  failed disks {}",
                format_size(s.used_bytes), format_size(s.capacity_bytes), s.objects, s.hits, s.misses,
                format_size(s.bytes_read), format_size(s.bytes_written), s.evictions, s.failed_disks
            );
            if s.mem_capacity_bytes > 0 {
                println!(
                    "memory tier {} of {}  hits {}",
                    format_size(s.mem_used_bytes),
                    format_size(s.mem_capacity_bytes),
                    s.mem_hits
                );
            }
            println!(
                "{:<7} {:>10} {:>10} {:>9} {:>9}  {:<8} dir",
                "disk", "used", "cap", "objects", "evicted", "state"
            );
            for d in &s.disks {
                let state = if d.failed { "FAILED" } else { "ok" };
                println!(
                    "{:<7} {:>10} {:>10} {:>9} {:>9}  {:<8} {}{}",
                    d.id,
                    format_size(d.used_bytes),
                    format_size(d.capacity_bytes),
                    d.objects,
                    d.evictions,
                    state,
                    d.dir,
                    d.failure.as_ref().map(|f| format!("  ({f})")).unwrap_or_default()
                );
            }
            Ok(0)
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
