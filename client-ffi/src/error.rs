//! Why one operation was not served, its one mapping to a status code, and
//! the calling thread's last failure (the one slot the core notes reasons
//! in and the C ABI's `kv_last_error` reads).

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
    /// A socket's timeout is [`OpError::Timeout`]; an answer out of step
    /// (kv_common::driver::out_of_step) is a protocol fault.
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => OpError::Timeout,
            std::io::ErrorKind::InvalidData => OpError::Protocol(e.to_string()),
            _ => OpError::Io(e),
        }
    }
}

/// The calling thread's last failure.
#[derive(Default)]
struct Last {
    /// Why its last request was not served (which node, and what it or the
    /// network said), noted by the core, taken by [`take_last_failure`].
    why: Option<String>,
    /// What `kv_last_error` returns: kept until the thread's next failure.
    message: std::ffi::CString,
}

thread_local! {
    static LAST: std::cell::RefCell<Last> = std::cell::RefCell::new(Last::default());
}

/// Notes why the calling thread's request was not served.
pub(crate) fn note(why: String) {
    // try_with: during thread teardown the slot may be gone; the note is
    // then dropped rather than panicking.
    let _ = LAST.try_with(|l| l.borrow_mut().why = Some(why));
}

/// The reason the calling thread's last failed request was not served,
/// cleared as it is read (blocking callers: the C ABI, kvctl).
pub fn take_last_failure() -> Option<String> {
    LAST.try_with(|l| l.borrow_mut().why.take()).ok().flatten()
}

/// Sets the message the C ABI's `kv_last_error` returns.
pub(crate) fn set_message(msg: impl Into<String>) {
    let s = msg.into().replace('\0', " ");
    let _ = LAST.try_with(|l| l.borrow_mut().message = std::ffi::CString::new(s).unwrap_or_default());
}

/// The message, NUL-terminated, valid until the thread's next failure
/// (None during thread teardown).
pub(crate) fn message_ptr() -> Option<*const std::ffi::c_char> {
    LAST.try_with(|l| l.borrow().message.as_ptr()).ok()
}
