//! Why one operation was not served, and its one mapping to a status code.

use kv_common::status::Status;

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("i/o: {0}")]
    Io(std::io::Error),
    #[error("timed out")]
    Timeout,
    #[error("node unavailable")]
    Unavailable,
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("node answered {0:?}: {1}")]
    Node(Status, String),
}

impl OpError {
    /// The status the caller sees (DESIGN §4: positive = recompute).
    pub fn status(&self) -> Status {
        match self {
            OpError::Io(_) | OpError::Unavailable | OpError::Protocol(_) => Status::Unavailable,
            OpError::Timeout => Status::Timeout,
            OpError::Node(Status::BadRequest, _) => Status::Einval,
            OpError::Node(s, _) => *s,
        }
    }

    /// Whether the failure says the peer is unhealthy (start its cool-down).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, OpError::Io(_) | OpError::Timeout | OpError::Protocol(_))
    }
}

impl From<std::io::Error> for OpError {
    fn from(e: std::io::Error) -> Self {
        OpError::Io(e)
    }
}
