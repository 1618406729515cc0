//! The client's side of the hello (docs/PROTOCOL.md §1): version
//! negotiation and the auth token.
//!
//! A client says hello in its newest version (v4: the token, and every
//! batch frame on the connection). A v3 or v2 node refuses that version and
//! names its own: the client connects again in it; a v1 node names v1, and the
//! client connects again in v1 (which carries no token; a v1 node checks
//! none). A node that wants
//! a token refuses a v1 hello as denied: the client connects again in its
//! newest version.
//! So a connection takes at most four tries, and each node's last
//! agreed version is remembered to start the next connection with it.

use kv_common::auth::Token;
use kv_common::driver::Socket;
use kv_common::wire::{self, Hello, HelloVerdict, HELLO_LEN};

use crate::error::OpError;

/// Most connections one hello negotiation may take (v4, v3, v2, v1 against
/// a v1 node whose resets come before its answers).
pub const MAX_TRIES: usize = 4;

/// How one hello ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Frames may follow in `version`.
    Done { version: u16, max_record: u64 },
    /// Close this connection, open another and say hello in this version.
    Again(u16),
}

fn judge(sent: u16, h: &[u8; HELLO_LEN]) -> Result<Step, OpError> {
    let reply = Hello::decode(h).map_err(|e| OpError::Protocol(e.to_string()))?;
    match wire::judge_hello(sent, &reply) {
        // The node echoes the version it accepted; one that names an older
        // one is taken at its word (frames of that version only).
        HelloVerdict::Accepted { max_record } => {
            Ok(Step::Done { version: sent.min(reply.version).max(wire::WIRE_VERSION_MIN), max_record })
        }
        HelloVerdict::Retry(v) => Ok(Step::Again(v)),
        HelloVerdict::Denied => Err(OpError::Denied),
        HelloVerdict::Refused(m) => Err(OpError::Protocol(m)),
    }
}

/// A read of the node's hello failed. A node that refuses the version of
/// a hello with a token closes with the token unread, and the reset that
/// causes can arrive before its answer is read: try one version older
/// then (a v2 node refusing v3, a v1 node refusing v2).
fn after_failed_read(e: std::io::Error, sent: u16, token: Option<&Token>) -> Result<Step, OpError> {
    use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
    if sent >= 2 && token.is_some() && matches!(e.kind(), ConnectionReset | UnexpectedEof) {
        return Ok(Step::Again((sent - 1).max(wire::WIRE_VERSION_MIN)));
    }
    Err(match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => OpError::Timeout,
        _ => OpError::Io(e),
    })
}

/// Says hello at `version` on a socket just connected: a blocking one (its
/// timeouts bound the time, `kv_common::driver::block_on` runs it) or an
/// async one (the caller bounds the time).
pub async fn say<S: Socket>(socket: &mut S, version: u16, token: Option<&Token>) -> Result<Step, OpError> {
    socket.write_parts(&[&wire::client_hello(version, token.map(Token::as_bytes))]).await?;
    let mut h = [0u8; HELLO_LEN];
    match socket.read_exact(&mut h).await {
        Ok(()) => judge(version, &h),
        Err(e) => after_failed_read(e, version, token),
    }
}

/// The error when [`MAX_TRIES`] connections did not settle a version.
pub fn unsettled() -> OpError {
    OpError::Protocol("the node and this client did not agree on a protocol version".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_after_a_hello_with_a_token_steps_down_one_version() {
        let tok = Token::new(b"t").unwrap();
        let reset = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        // A v2 node refusing v3 (token unread): v2 next, not v1, which a v2
        // node with a token would deny.
        assert_eq!(after_failed_read(reset(), 4, Some(&tok)).unwrap(), Step::Again(3));
        assert_eq!(after_failed_read(reset(), 3, Some(&tok)).unwrap(), Step::Again(2));
        assert_eq!(after_failed_read(reset(), 2, Some(&tok)).unwrap(), Step::Again(1));
        assert!(after_failed_read(reset(), 3, None).is_err(), "no token: a reset is an error");
        // The whole walk down from this release's version to v1 fits.
        assert_eq!(usize::from(wire::WIRE_VERSION - wire::WIRE_VERSION_MIN) + 1, MAX_TRIES);
    }
}
