//! Which nodes a command talks to, and with which page geometry.

use clap::Args;
use kv_common::page::{Geometry, FLAG_MLA};
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Options};

/// The nodes to use: a member list, one node, or a group found through kv-mds.
#[derive(Args, Clone, Debug)]
pub struct Target {
    /// Member list `id=host:port[@weight],...` (keys are placed by the weighted ring).
    #[arg(long, conflicts_with = "mds")]
    pub members: Option<String>,
    /// One node's address (shorthand for `--members n1=ADDR`).
    #[arg(long, conflicts_with_all = ["members", "mds"])]
    pub node: Option<String>,
    /// kv-mds endpoints `host:port,...`: use the group's current members.
    #[arg(long)]
    pub mds: Option<String>,
    /// Group to use with --mds.
    #[arg(long, default_value = "default")]
    pub group: String,
    /// Client options `key=value,...` (e.g. io_timeout_ms=10000,batch_concurrency=8).
    #[arg(long, default_value = "")]
    pub options: String,
}

impl Target {
    pub fn members(&self) -> Result<String, String> {
        match (&self.members, &self.node) {
            (Some(m), _) => Ok(m.clone()),
            (None, Some(n)) => Ok(format!("n1={n}")),
            (None, None) => Err("give --members id=host:port,..., --node host:port or --mds host:port".into()),
        }
    }

    pub fn client(&self, geo: Geometry) -> Result<BlockingClient, String> {
        let opts = Options::parse(&self.options)?;
        if let Some(mds) = &self.mds {
            let eps = kv_common::mds::parse_endpoints(mds).map_err(|e| format!("--mds: {e}"))?;
            let c = BlockingClient::new(Vec::new(), geo, opts).map_err(|e| format!("cannot start the client: {e}"))?;
            let first = c
                .start_discovery(eps, self.group.clone(), std::time::Duration::from_secs(5))
                .map_err(|e| format!("cannot start discovery: {e}"))?;
            first.map_err(|e| format!("no view of group {:?}: {e}", self.group))?;
            if c.core.topology().nodes.is_empty() {
                return Err(format!("group {:?} has no members", self.group));
            }
            return Ok(c);
        }
        let members = parse_members(&self.members()?)?;
        if members.is_empty() {
            return Err("the member list is empty".into());
        }
        BlockingClient::new(members, geo, opts).map_err(|e| format!("cannot start the client: {e}"))
    }
}

/// Page geometry stamped on put and required on get. Defaults: all zero but
/// tp_size 1 (a put and a get with the same flags always agree).
#[derive(Args, Clone, Debug)]
pub struct GeoArgs {
    #[arg(long, default_value_t = 0)]
    pub model_hash: u64,
    #[arg(long, default_value_t = 0)]
    pub page_size: u32,
    #[arg(long, default_value_t = 0)]
    pub dtype_tag: u32,
    #[arg(long, default_value_t = 1)]
    pub tp_size: u16,
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u16,
    #[arg(long, default_value_t = 0)]
    pub layer_num: u16,
    #[arg(long, default_value_t = 0)]
    pub head_num: u16,
    #[arg(long, default_value_t = 0)]
    pub head_dim: u16,
    /// MLA page (tp_size/tp_rank not compared).
    #[arg(long)]
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
