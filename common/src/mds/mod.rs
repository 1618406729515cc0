//! The membership service's HTTP/JSON API (docs/PROTOCOL.md, "MDS API"):
//! the types on the wire (here) and a small blocking client with failover
//! among MDS replicas ([`client`]), used by kv-server (register,
//! heartbeat), the client library (views) and kvctl.

use serde::{Deserialize, Serialize};

mod client;

pub use client::{parse_endpoints, random_below, AbortHandle, MdsClient, KEEP_IDLE, MAX_REPLY, NODE_KEEP_IDLE};

/// Where a group's records live in etcd.
pub const ETCD_ROOT: &str = "/kvcellar/v1/groups/";

/// The longest long-poll an MDS accepts; longer waits are cut to this.
pub const MAX_WAIT_MS: u64 = 60_000;

/// One node as the membership service records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub id: String,
    /// The data-plane address clients and tools dial (`host:port`).
    pub addr: String,
    pub weight: u32,
    /// Where the node serves `/metrics` and its dashboard (`host:port`), if
    /// it does. Not part of the epoch: changing it changes no placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
}

/// A group's member set and the epoch that names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub group: String,
    /// An etcd revision; 0 for a group that never had a member.
    pub epoch: u64,
    /// Sorted by id.
    pub members: Vec<MemberRecord>,
    /// The member sets this group had before, within the handoff window,
    /// newest first, each as a delta against `members` (docs/ARCHITECTURE.md,
    /// "Ring transitions"). Not part of what the epoch names. Absent from
    /// views of a kv-mds without handoff, and ignored by older clients.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous: Vec<PreviousSet>,
    /// The serving replica's handoff window in ms (`--handoff-secs`); 0:
    /// handoff is off for this group's clients. Absent from older replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff_ms: Option<u64>,
    /// The group's placement rule (docs/PROTOCOL.md §4); absent: `ketama`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// Set when the replica sent the members as a change against the epoch
    /// the client named (`delta=1`): `members` is then empty, and
    /// [`View::resolve`] rebuilds it from the client's members of `base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ViewDelta>,
}

/// The members of a view as a change against an earlier epoch's members
/// (docs/PROTOCOL.md §6, "Deltas").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewDelta {
    /// The epoch whose members this change applies to.
    pub base: u64,
    /// Records to add, or to replace the record of the same id, sorted by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub put: Vec<MemberRecord>,
    /// Ids to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
    /// How many members the view has once the change is applied.
    pub count: usize,
    /// [`digest`] of the members once applied and the view's rule: what the
    /// group's epoch key holds. A client whose result differs (it held
    /// other members under that epoch number, as after etcd lost its data)
    /// asks for the whole view.
    pub digest: String,
}

/// The digest a group's epoch key holds (docs/PROTOCOL.md §6.1): the lines
/// `id\taddr\tweight\n` of the members in id order, then under a rule
/// other than Ketama `placement\tRULE\n`, as xxh3-64 in hex followed by
/// the member count in hex. Any change of id, address, weight or rule
/// changes it.
pub fn digest(members: &[MemberRecord], placement: Option<&str>) -> String {
    let mut text = String::new();
    for m in members {
        text.push_str(&format!("{}\t{}\t{}\n", m.id, m.addr, m.weight));
    }
    if let Some(p) = placement {
        text.push_str(&format!("placement\t{p}\n"));
    }
    format!("{:016x}{:08x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()), members.len())
}

impl ViewDelta {
    /// The change that turns `base` (epoch `base_epoch`) into `now` (both
    /// sorted by id).
    pub fn between(base_epoch: u64, base: &[MemberRecord], now: &[MemberRecord], placement: Option<&str>) -> ViewDelta {
        let old: std::collections::HashMap<&str, &MemberRecord> = base.iter().map(|m| (m.id.as_str(), m)).collect();
        let new: std::collections::HashSet<&str> = now.iter().map(|m| m.id.as_str()).collect();
        ViewDelta {
            base: base_epoch,
            put: now.iter().filter(|m| old.get(m.id.as_str()) != Some(m)).cloned().collect(),
            removed: base.iter().filter(|m| !new.contains(m.id.as_str())).map(|m| m.id.clone()).collect(),
            count: now.len(),
            digest: digest(now, placement),
        }
    }
}

/// The rule a view or a previous set names (`None`: Ketama), or why this
/// build cannot follow it.
pub fn placement_of(group: &str, named: Option<&str>) -> Result<crate::ring::Placement, String> {
    match named {
        None => Ok(crate::ring::Placement::Ketama),
        Some(n) => crate::ring::Placement::parse(n).map_err(|_| {
            format!(
                "group {group} places keys by rule {n:?}, which this build does not know (it knows {}): upgrade it",
                crate::ring::Placement::known()
            )
        }),
    }
}

impl View {
    /// The view with its members whole: itself when it carries them, else
    /// its delta applied to `base` (the epoch and members the client holds).
    /// Err when the delta does not apply (another base, or the result does
    /// not have the count it names): the caller asks for the whole view.
    pub fn resolve(mut self, base: Option<(u64, &[MemberRecord])>) -> Result<View, String> {
        let Some(d) = self.delta.take() else { return Ok(self) };
        let (epoch, members) = match base {
            Some((e, m)) if e == d.base => (e, m),
            _ => {
                return Err(format!(
                    "view {} of {} is a change against epoch {}, not held here",
                    self.epoch, self.group, d.base
                ))
            }
        };
        let removed: std::collections::HashSet<&str> = d.removed.iter().map(String::as_str).collect();
        let put: std::collections::HashSet<&str> = d.put.iter().map(|m| m.id.as_str()).collect();
        let mut out: Vec<MemberRecord> = members
            .iter()
            .filter(|m| !removed.contains(m.id.as_str()) && !put.contains(m.id.as_str()))
            .cloned()
            .chain(d.put.iter().cloned())
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out.dedup_by(|a, b| a.id == b.id);
        if out.len() != d.count || digest(&out, self.placement.as_deref()) != d.digest {
            return Err(format!(
                "view {} of {}: the change against epoch {epoch} gives {} members, not the {} it names (or other ones)",
                self.epoch,
                self.group,
                out.len(),
                d.count
            ));
        }
        self.members = out;
        Ok(self)
    }

    /// The group's placement rule, or one clear error when this build does
    /// not know it (a client must then refuse the group, not guess).
    pub fn placement(&self) -> Result<crate::ring::Placement, String> {
        placement_of(&self.group, self.placement.as_deref())
    }
}

/// Most previous member sets a view carries.
pub const MAX_PREVIOUS_SETS: usize = 4;

/// An earlier member set of a group, as a delta against a view's members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreviousSet {
    /// The epoch that named this set while it was current.
    pub epoch: u64,
    /// Milliseconds of its handoff window left when the view was read.
    pub remaining_ms: u64,
    /// Ids in the view's members that this set did not have (or had with
    /// another address or weight).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joined: Vec<String>,
    /// Records this set had that the view's members do not (or have with
    /// another address or weight).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left: Vec<MemberRecord>,
    /// The set's placement rule when it was current; absent: `ketama`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
}

impl PreviousSet {
    /// The delta that turns `current` into `earlier`.
    pub fn between(current: &[MemberRecord], earlier: &[MemberRecord], epoch: u64, remaining_ms: u64) -> PreviousSet {
        use std::collections::HashSet;
        fn placed(m: &MemberRecord) -> (&str, &str, u32) {
            (m.id.as_str(), m.addr.as_str(), m.weight)
        }
        let cur: HashSet<(&str, &str, u32)> = current.iter().map(placed).collect();
        let ear: HashSet<(&str, &str, u32)> = earlier.iter().map(placed).collect();
        let joined = current.iter().filter(|c| !ear.contains(&placed(c))).map(|c| c.id.clone()).collect();
        let left = earlier
            .iter()
            .filter(|e| !cur.contains(&placed(e)))
            .map(|e| MemberRecord { metrics_addr: None, ..e.clone() })
            .collect();
        PreviousSet { epoch, remaining_ms, joined, left, placement: None }
    }

    /// The earlier set itself, from the view's `current` members, sorted by id.
    pub fn apply(&self, current: &[MemberRecord]) -> Vec<MemberRecord> {
        let joined: std::collections::HashSet<&str> = self.joined.iter().map(String::as_str).collect();
        let mut out: Vec<MemberRecord> = current
            .iter()
            .filter(|c| !joined.contains(c.id.as_str()))
            .map(|c| MemberRecord { metrics_addr: None, ..c.clone() })
            .collect();
        out.extend(self.left.iter().cloned());
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}

/// The body of `PUT /v1/groups/{g}/placement`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlacementRequest {
    pub placement: String,
}

/// The answer to `PUT /v1/groups/{g}/placement`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementReply {
    pub placement: String,
    /// The epoch naming the group's members under that rule.
    pub epoch: u64,
}

/// The body of `PUT /v1/groups/{g}/tenants/{t}`: a share such as `40%`
/// or `200G` ([`crate::quota::Quota::parse`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuotaRequest {
    pub quota: String,
}

/// The answer to the tenants calls: the group's quotas after the call,
/// tenant name to share.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotasReply {
    pub quotas: std::collections::BTreeMap<String, String>,
}

/// The body of a register request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub addr: String,
    pub weight: u32,
    /// A token naming this run of the node (new at every start), so the MDS
    /// can tell two nodes given the same id apart. Empty: not checked.
    #[serde(default)]
    pub instance: String,
    /// See [`MemberRecord::metrics_addr`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
}

/// The body of a heartbeat.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    #[serde(default)]
    pub instance: String,
}

/// The answer to register and heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseReply {
    /// The lease's time to live; heartbeat every third of it.
    pub ttl_ms: u64,
    /// True when this replica did not hold the node's lease and took the
    /// node over (granted a new lease, rewrote the record).
    #[serde(default)]
    pub took_over: bool,
    /// The group's epoch after the call (register and deregister only).
    #[serde(default)]
    pub epoch: u64,
}

/// Every non-2xx answer carries this body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// A group or node id's rule (defined beside the per-group tokens).
pub use crate::auth::valid_name;

/// Why an MDS call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MdsError {
    /// The node is not registered (its lease expired or it never was):
    /// register again.
    NotRegistered(String),
    /// The request itself is wrong (4xx); no replica will accept it.
    Rejected(String),
    /// The node id is held by another node (409): two nodes share an id.
    Taken(String),
    /// No replica answered usefully; each reason is listed.
    Unavailable(String),
    /// The call was aborted by [`MdsClient::abort`].
    Aborted,
    /// The MDS refused the auth token (401): missing or wrong for the group.
    Denied(String),
    /// The MDS knows the credential but its role may not make the call
    /// (403): an engine's token changing the group, a node's token bound
    /// to another node id.
    Forbidden(String),
    /// The group places keys by a rule this client does not know (422): it
    /// must refuse the group rather than guess where keys live.
    Unsupported(String),
}

impl std::fmt::Display for MdsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MdsError::NotRegistered(m) => write!(f, "not registered: {m}"),
            MdsError::Rejected(m) => write!(f, "rejected: {m}"),
            MdsError::Taken(m) => write!(f, "id taken: {m}"),
            MdsError::Unavailable(m) => write!(f, "no MDS answered: {m}"),
            MdsError::Aborted => write!(f, "aborted"),
            MdsError::Denied(m) => write!(f, "access denied: {m}"),
            MdsError::Forbidden(m) => write!(f, "not allowed: {m}"),
            MdsError::Unsupported(m) => write!(f, "cannot follow the group: {m}"),
        }
    }
}

impl std::error::Error for MdsError {}
