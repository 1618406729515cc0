//! Why one operation was not served, and its one mapping to a status code.

use kv_common::status::Status;

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("i/o: {0}")]
    Io(std::io::Error),
    #[error("timed out")]
    Timeout,
    /// Timed out before any byte went to the peer (waiting for a local
    /// connection slot, or the call's time spent on other owners): not the
    /// peer's fault, so no cool-down.
    #[error("timed out waiting locally")]
    LocalTimeout,
    #[error("node unavailable")]
    Unavailable,
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("node answered {0:?}: {1}")]
    Node(Status, String),
    /// The node could not be reached at all (a tool's connect).
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    /// The node refused the auth token at the hello (KV_EDENIED).
    #[error("the node refused this client's auth token (missing or wrong for the group)")]
    Denied,
}

impl OpError {
    /// The status the caller sees (README.md, "C ABI conventions": positive = recompute).
    pub fn status(&self) -> Status {
        match self {
            OpError::Io(_) | OpError::Unavailable | OpError::Protocol(_) => Status::Unavailable,
            OpError::Connect { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => Status::Timeout,
            OpError::Connect { .. } => Status::Unavailable,
            OpError::Timeout | OpError::LocalTimeout => Status::Timeout,
            OpError::Node(Status::BadRequest, _) => Status::Einval,
            // A node's internal failure (or a status this client does not
            // know) is "not served" for the caller, never a negative code.
            OpError::Node(Status::Internal | Status::Einternal | Status::Einval, _) => Status::Unavailable,
            OpError::Node(s, _) => *s,
            OpError::Denied => Status::Edenied,
        }
    }

    /// Whether the failure says the peer is unhealthy (start its cool-down).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, OpError::Io(_) | OpError::Connect { .. } | OpError::Timeout | OpError::Protocol(_))
    }

    /// A node's answer that is not what was asked for, with its reason.
    pub fn refused(status: Status, body: &[u8]) -> OpError {
        OpError::Node(status, String::from_utf8_lossy(body).into_owned())
    }
}

impl From<std::io::Error> for OpError {
    fn from(e: std::io::Error) -> Self {
        OpError::Io(e)
    }
}
