//! Which nodes a command talks to, and with which page geometry.

use clap::Args;
use kv_common::page::{Geometry, FLAG_MLA};
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Options};

/// The nodes to use: a member list, one node, or a group found through kv-mds.
#[derive(Args, Clone, Debug)]
pub struct Target {
    /// Member list `id=host:port[@weight],...`; keys are placed by the weighted ring (else KVCELLAR_MEMBERS).
    #[arg(long, conflicts_with = "mds")]
    pub members: Option<String>,
    /// One node's address (shorthand for `--members n1=ADDR`).
    #[arg(long, conflicts_with_all = ["members", "mds"])]
    pub node: Option<String>,
    /// kv-mds endpoints `host:port,...`: use the group's current members (else KVCELLAR_MDS).
    #[arg(long)]
    pub mds: Option<String>,
    /// Group to use with --mds (else KVCELLAR_GROUP, else "default").
    #[arg(long)]
    pub group: Option<String>,
    /// Client options `key=value,...`: connect_timeout_ms, io_timeout_ms, max_conns_per_node, batch_concurrency, peer_cooldown_ms, auth_token_file, rdma_devices (`:`-separated), rdma_depth, rdma_numa, rdma_cache_mb, handoff_ms (0: handoff off), handoff_timeout_ms, handoff_budget_mb.
    #[arg(long, default_value = "")]
    pub options: String,
}

/// Where the cluster is: a group through kv-mds, or a static member list.
#[derive(Debug, PartialEq, Eq)]
pub enum Cluster {
    Mds { endpoints: String, group: String },
    Members(String),
}

/// The environment variables shared by kvctl, the Python `Client` and the
/// plugins; each is used only where the command's own flags leave it out.
pub const ENV_MDS: &str = "KVCELLAR_MDS";
pub const ENV_GROUP: &str = "KVCELLAR_GROUP";
pub const ENV_MEMBERS: &str = "KVCELLAR_MEMBERS";

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// The group: the flag, else KVCELLAR_GROUP, else "default".
pub fn group_or_env(flag: Option<&str>) -> String {
    flag.map(str::to_string).or_else(|| env(ENV_GROUP)).unwrap_or_else(|| "default".into())
}

/// Resolves the cluster from flags (`--members`, `--node`, `--mds`), then
/// from KVCELLAR_MEMBERS / KVCELLAR_MDS. Both variables set is an error
/// naming both, as in the Python client.
pub fn resolve(
    members: Option<&str>,
    node: Option<&str>,
    mds: Option<&str>,
    group: Option<&str>,
) -> Result<Cluster, String> {
    let group = group_or_env(group);
    match (members, node, mds) {
        (Some(m), _, _) => return Ok(Cluster::Members(m.to_string())),
        (None, Some(n), _) => return Ok(Cluster::Members(format!("n1={n}"))),
        (None, None, Some(e)) => return Ok(Cluster::Mds { endpoints: e.to_string(), group }),
        (None, None, None) => {}
    }
    match (env(ENV_MEMBERS), env(ENV_MDS)) {
        (Some(_), Some(_)) => Err(format!("{ENV_MDS} and {ENV_MEMBERS} are both set: keep one")),
        (Some(m), None) => Ok(Cluster::Members(m)),
        (None, Some(e)) => Ok(Cluster::Mds { endpoints: e, group }),
        (None, None) => Err(format!(
            "give --members id=host:port,..., --node host:port or --mds host:port (or set {ENV_MDS} or {ENV_MEMBERS})"
        )),
    }
}

impl Target {
    pub fn cluster(&self) -> Result<Cluster, String> {
        resolve(self.members.as_deref(), self.node.as_deref(), self.mds.as_deref(), self.group.as_deref())
    }

    pub fn client(&self, geo: Geometry) -> Result<BlockingClient, String> {
        let mut opts = Options::parse(&self.options)?;
        if opts.auth_token.is_none() {
            opts.auth_token = crate::token().cloned();
        }
        let members = match self.cluster()? {
            Cluster::Mds { endpoints, group } => {
                let eps = kv_common::mds::parse_endpoints(&endpoints).map_err(|e| format!("--mds: {e}"))?;
                let c =
                    BlockingClient::new(Vec::new(), geo, opts).map_err(|e| format!("cannot start the client: {e}"))?;
                let first = c
                    .start_discovery(eps, group.clone(), std::time::Duration::from_secs(5))
                    .map_err(|e| format!("cannot start discovery: {e}"))?;
                first.map_err(|(st, e)| match st {
                    kv_common::status::Status::Edenied => crate::denied_line(&e),
                    _ => format!("no view of group {group:?}: {e}"),
                })?;
                if c.core.topology().nodes.is_empty() {
                    return Err(format!("group {group:?} has no members"));
                }
                return Ok(c);
            }
            Cluster::Members(m) => parse_members(&m)?,
        };
        if members.is_empty() {
            return Err("the member list is empty".into());
        }
        BlockingClient::new(members, geo, opts).map_err(|e| format!("cannot start the client: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the environment is process-wide.
    #[test]
    fn flags_win_then_the_environment() {
        std::env::remove_var(ENV_MDS);
        std::env::remove_var(ENV_MEMBERS);
        std::env::remove_var(ENV_GROUP);
        assert!(resolve(None, None, None, None).unwrap_err().contains(ENV_MDS));
        std::env::set_var(ENV_MDS, "127.0.0.1:7480");
        assert_eq!(
            resolve(None, None, None, None).unwrap(),
            Cluster::Mds { endpoints: "127.0.0.1:7480".into(), group: "default".into() }
        );
        std::env::set_var(ENV_GROUP, "g2");
        assert_eq!(
            resolve(None, None, None, None).unwrap(),
            Cluster::Mds { endpoints: "127.0.0.1:7480".into(), group: "g2".into() }
        );
        assert_eq!(resolve(Some("a=1.2.3.4:5"), None, None, None).unwrap(), Cluster::Members("a=1.2.3.4:5".into()));
        assert_eq!(resolve(None, Some("1.2.3.4:5"), None, None).unwrap(), Cluster::Members("n1=1.2.3.4:5".into()));
        std::env::set_var(ENV_MEMBERS, "a=1.2.3.4:5");
        let e = resolve(None, None, None, None).unwrap_err();
        assert!(e.contains(ENV_MDS) && e.contains(ENV_MEMBERS), "{e}");
        std::env::remove_var(ENV_MDS);
        assert_eq!(resolve(None, None, None, Some("x")).unwrap(), Cluster::Members("a=1.2.3.4:5".into()));
        std::env::remove_var(ENV_MEMBERS);
        std::env::remove_var(ENV_GROUP);
    }
}

/// Page geometry stamped on put and required on get. Defaults: all zero but
/// tp_size 1 (a put and a get with the same flags always agree).
#[derive(Args, Clone, Debug)]
pub struct GeoArgs {
    /// Model identity (a get must give the put's).
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub model_hash: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub page_size: u32,
    /// The engine's dtype code.
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub dtype_tag: u32,
    /// Tensor-parallel size (not compared with --mla).
    #[arg(long, default_value_t = 1, help_heading = "Page geometry (must match between put and get)")]
    pub tp_size: u16,
    /// Tensor-parallel rank (not compared with --mla).
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub tp_rank: u16,
    /// Layers in the page.
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub layer_num: u16,
    /// KV heads in the page.
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub head_num: u16,
    /// Head dimension.
    #[arg(long, default_value_t = 0, help_heading = "Page geometry (must match between put and get)")]
    pub head_dim: u16,
    /// MLA page: replicated across TP ranks, so tp_size/tp_rank are not compared.
    #[arg(long, help_heading = "Page geometry (must match between put and get)")]
    pub mla: bool,
}

impl GeoArgs {
    pub fn geometry(&self) -> Geometry {
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
