//! Which nodes a command talks to, and with which page geometry.

use clap::Args;
use kv_common::page::{Geometry, FLAG_MLA};
use kvclient::members::parse_members;
use kvclient::{BlockingClient, Options};

/// The nodes to use: a member list, or one node.
#[derive(Args, Clone, Debug)]
pub struct Target {
    /// Member list `id=host:port[@weight],...` (keys are placed by the weighted ring).
    #[arg(long)]
    pub members: Option<String>,
    /// One node's address (shorthand for `--members n1=ADDR`).
    #[arg(long, conflicts_with = "members")]
    pub node: Option<String>,
    /// Client options `key=value,...` (e.g. io_timeout_ms=10000,batch_concurrency=8).
    #[arg(long, default_value = "")]
    pub options: String,
}

impl Target {
    pub fn members(&self) -> Result<String, String> {
        match (&self.members, &self.node) {
            (Some(m), _) => Ok(m.clone()),
            (None, Some(n)) => Ok(format!("n1={n}")),
            (None, None) => Err("give --members id=host:port,... or --node host:port".into()),
        }
    }

    pub fn client(&self, geo: Geometry) -> Result<BlockingClient, String> {
        let members = parse_members(&self.members()?)?;
        if members.is_empty() {
            return Err("the member list is empty".into());
        }
        let opts = Options::parse(&self.options)?;
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
