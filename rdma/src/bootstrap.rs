//! The queue-pair bootstrap (docs/PROTOCOL.md, "RDMA_CONNECT"): after the
//! hello, on the accepted and authenticated data connection, the client sends
//! its queue pair's endpoint in an RDMA_CONNECT request and the node answers
//! with its own, so a member keeps one address and the auth token guards the
//! exchange. The body is versioned on its own: a node that speaks another
//! bootstrap version says which, and a node without RDMA says why; either
//! way the connection carries on over TCP.
//!
//! The memory segments a request names (address, length, key) so the node
//! can move the payload by RDMA are part of the frame: `kv_common::wire`.

/// The bootstrap version this code speaks. Version 3 has version 2's
/// layout; saying it means "this end names (client) or serves (node)
/// segments in batch items" (docs/PROTOCOL.md §2.8).
pub const BOOTSTRAP_VERSION: u16 = 3;

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Answer codes.
pub const ACCEPTED: u16 = 0;
pub const VERSION_REFUSED: u16 = 1;
pub const NOT_OFFERED: u16 = 2;
pub const SETUP_FAILED: u16 = 3;
/// Longest reason text in an answer.
pub const MAX_REASON: usize = 1024;

/// One end of a reliable-connected queue pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Work requests in flight this end asks for (request) or grants (answer).
    pub depth: u16,
    pub port: u8,
    /// Path MTU code as in verbs: 1 = 256 ... 5 = 4096 bytes.
    pub mtu: u8,
    /// InfiniBand local id (0 on RoCE).
    pub lid: u16,
    pub gid: [u8; 16],
    /// Queue pair number and starting packet sequence number (24 bits each).
    pub qpn: u32,
    pub psn: u32,
    /// The device this end uses (for logs and counters).
    pub device: String,
    /// The RDMA READs this end's device serves and issues at once (version
    /// 2; None from a peer of version 1, and in a version 1 request).
    pub reads: Option<ReadLimits>,
    /// Version 3: this end takes segments in BATCH_GET and BATCH_PUT items
    /// (only with `reads`: a version 1 endpoint cannot say it).
    pub batches: bool,
}

/// Outstanding RDMA READs of one end's device: as the responder
/// (`max_qp_rd_atom`) and as the initiator (`max_qp_init_rd_atom`). A queue
/// pair may issue no more at once than its own initiator limit and the
/// peer's responder limit: more breaks the queue pair at the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    pub responder: u8,
    pub initiator: u8,
}

impl ReadLimits {
    /// The READs a queue pair with these local limits may have in flight
    /// towards a peer that said `theirs`; against a peer of version 1
    /// (limits unknown), the smaller of the local two.
    pub fn initiator_depth(&self, theirs: Option<ReadLimits>) -> u8 {
        match theirs {
            Some(t) => self.initiator.min(t.responder),
            None => self.initiator.min(self.responder),
        }
    }
}

const FIXED: usize = 33;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    #[error("RDMA bootstrap body too short ({0} bytes)")]
    Short(usize),
    #[error("RDMA bootstrap version {theirs} not spoken (this end speaks {BOOTSTRAP_VERSION})")]
    Version { theirs: u16 },
    #[error("RDMA bootstrap: {0}")]
    Invalid(&'static str),
}

impl Endpoint {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.depth.to_le_bytes());
        out.push(self.port);
        out.push(self.mtu);
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.push(self.device.len() as u8);
        out.extend_from_slice(self.device.as_bytes());
        if let Some(r) = self.reads {
            out.push(r.responder);
            out.push(r.initiator);
        }
    }

    /// The version this endpoint is said in: 3 with read limits and batch
    /// segments, 2 with read limits only, else 1.
    pub fn version(&self) -> u16 {
        match (self.reads.is_some(), self.batches) {
            (true, true) => 3,
            (true, false) => 2,
            (false, _) => 1,
        }
    }

    fn get(b: &[u8], version: u16) -> Result<Endpoint, BootstrapError> {
        // `b` starts after the version.
        if b.len() < FIXED - 2 {
            return Err(BootstrapError::Short(b.len() + 2));
        }
        let n = b[30] as usize;
        let trailer = if version >= 2 { 2 } else { 0 };
        if b.len() != FIXED - 2 + n + trailer {
            return Err(BootstrapError::Invalid("device name length does not match the body"));
        }
        let reads = (trailer == 2).then(|| ReadLimits { responder: b[31 + n], initiator: b[32 + n] });
        if reads.is_some_and(|r| r.responder == 0 || r.initiator == 0) {
            return Err(BootstrapError::Invalid("read limits of 0"));
        }
        let device = std::str::from_utf8(&b[31..31 + n])
            .ok()
            .filter(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_graphic()))
            .ok_or(BootstrapError::Invalid("device name is not printable ASCII"))?
            .to_string();
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[6..22]);
        let e = Endpoint {
            depth: le_u16(b, 0),
            port: b[2],
            mtu: b[3],
            lid: le_u16(b, 4),
            gid,
            qpn: le_u32(b, 22),
            psn: le_u32(b, 26),
            device,
            reads,
            batches: version >= 3,
        };
        if e.depth == 0 || u32::from(e.depth) > super::MAX_DEPTH {
            return Err(BootstrapError::Invalid("depth out of range 1..=1024"));
        }
        if !(1..=5).contains(&e.mtu) {
            return Err(BootstrapError::Invalid("path MTU code out of range 1..=5"));
        }
        if e.port == 0 {
            return Err(BootstrapError::Invalid("port 0"));
        }
        if e.qpn >= 1 << 24 || e.psn >= 1 << 24 {
            return Err(BootstrapError::Invalid("QP number or PSN over 24 bits"));
        }
        Ok(e)
    }

    /// The RDMA_CONNECT request body, in [`Endpoint::version`] (a node of
    /// the previous release speaks only 1: it answers a version 2 request
    /// with [`Answer::VersionRefused`]`(1)`, and the client asks again
    /// without the read limits).
    pub fn encode_request(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + 2 + self.device.len());
        out.extend_from_slice(&self.version().to_le_bytes());
        self.put(&mut out);
        out
    }

    /// Decodes a request (version 1, 2 or 3). A version this end does not
    /// speak is [`BootstrapError::Version`]: answer with
    /// [`Answer::VersionRefused`].
    pub fn decode_request(b: &[u8]) -> Result<Endpoint, BootstrapError> {
        if b.len() < 2 {
            return Err(BootstrapError::Short(b.len()));
        }
        let v = le_u16(b, 0);
        if !(1..=BOOTSTRAP_VERSION).contains(&v) {
            return Err(BootstrapError::Version { theirs: v });
        }
        Endpoint::get(&b[2..], v)
    }
}

/// The node's answer to RDMA_CONNECT (always a status-OK frame; the code
/// inside says what happened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Accepted(Endpoint),
    /// The node speaks this bootstrap version instead.
    VersionRefused(u16),
    /// No RDMA at this node (not built with it, no device named, or its
    /// devices unusable): the reason.
    NotOffered(String),
    /// The node could not set a queue pair up for this request.
    SetupFailed(String),
}

impl Answer {
    /// The answer body. An accepted one is said in the version of the
    /// endpoint it carries (the node answers in the request's version).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&BOOTSTRAP_VERSION.to_le_bytes());
        let (code, text) = match self {
            Answer::Accepted(e) => {
                out[0..2].copy_from_slice(&e.version().to_le_bytes());
                out.extend_from_slice(&ACCEPTED.to_le_bytes());
                e.put(&mut out);
                return out;
            }
            Answer::VersionRefused(v) => {
                out[0..2].copy_from_slice(&v.to_le_bytes());
                (VERSION_REFUSED, "")
            }
            Answer::NotOffered(r) => (NOT_OFFERED, r.as_str()),
            Answer::SetupFailed(r) => (SETUP_FAILED, r.as_str()),
        };
        out.extend_from_slice(&code.to_le_bytes());
        let mut end = text.len().min(MAX_REASON);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        out.extend_from_slice(&text.as_bytes()[..end]);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Answer, BootstrapError> {
        if b.len() < 4 {
            return Err(BootstrapError::Short(b.len()));
        }
        let (v, code) = (le_u16(b, 0), le_u16(b, 2));
        let text = || String::from_utf8_lossy(&b[4..b.len().min(4 + MAX_REASON)]).into_owned();
        match code {
            ACCEPTED if (1..=BOOTSTRAP_VERSION).contains(&v) => Ok(Answer::Accepted(Endpoint::get(&b[4..], v)?)),
            ACCEPTED => Err(BootstrapError::Version { theirs: v }),
            VERSION_REFUSED => Ok(Answer::VersionRefused(v)),
            NOT_OFFERED => Ok(Answer::NotOffered(text())),
            SETUP_FAILED => Ok(Answer::SetupFailed(text())),
            _ => Err(BootstrapError::Invalid("unknown answer code")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep() -> Endpoint {
        Endpoint {
            depth: 32,
            port: 1,
            mtu: 5,
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 2, 0xc9, 0xff, 0xfe, 0, 0, 1],
            qpn: 0x1234,
            psn: 0xabcdef,
            device: "mlx5_0".into(),
            reads: None,
            batches: false,
        }
    }

    /// Version 3 is version 2's layout under another number: it says the
    /// end takes segments in batch items.
    #[test]
    fn version_3_is_version_2_that_takes_batch_segments() {
        let v2 = Endpoint { reads: Some(ReadLimits { responder: 8, initiator: 16 }), ..ep() };
        let v3 = Endpoint { batches: true, ..v2.clone() };
        let (b2, b3) = (v2.encode_request(), v3.encode_request());
        assert_eq!(&b3[0..2], &[3, 0]);
        assert_eq!(b2[2..], b3[2..], "the same layout");
        assert_eq!(Endpoint::decode_request(&b3).unwrap(), v3);
        assert_eq!(Endpoint::decode_request(&b2).unwrap(), v2);
        assert_eq!(Answer::decode(&Answer::Accepted(v3.clone()).encode()).unwrap(), Answer::Accepted(v3));
        // Without read limits it cannot be said: version 1.
        assert_eq!(Endpoint { batches: true, ..ep() }.version(), 1);
    }

    /// Version 2 carries the read limits after the device name; version 1
    /// (the previous release) is still read and answered in its own words.
    #[test]
    fn version_2_carries_read_limits_and_version_1_is_still_spoken() {
        let v2 = Endpoint { reads: Some(ReadLimits { responder: 8, initiator: 16 }), ..ep() };
        let b = v2.encode_request();
        assert_eq!(&b[0..2], &[2, 0]);
        assert_eq!(b.len(), 33 + 6 + 2);
        assert_eq!(&b[b.len() - 2..], &[8, 16]);
        assert_eq!(Endpoint::decode_request(&b).unwrap(), v2);
        let a = Answer::Accepted(v2.clone()).encode();
        assert_eq!(&a[0..2], &[2, 0], "answered in the request's version");
        assert_eq!(Answer::decode(&a).unwrap(), Answer::Accepted(v2.clone()));
        // The previous release's request and answer, byte for byte.
        let v1 = ep().encode_request();
        assert_eq!(&v1[0..2], &[1, 0]);
        assert_eq!(Endpoint::decode_request(&v1).unwrap(), ep());
        assert_eq!(&Answer::Accepted(ep()).encode()[0..2], &[1, 0]);
        // A version 2 request cut to the version 1 length, or limits of 0.
        let mut cut = b.clone();
        cut.truncate(b.len() - 2);
        assert!(Endpoint::decode_request(&cut).is_err());
        let mut zero = b.clone();
        *zero.last_mut().unwrap() = 0;
        assert!(Endpoint::decode_request(&zero).is_err());
        // The depth of READs a queue pair may issue.
        let mine = ReadLimits { responder: 16, initiator: 16 };
        assert_eq!(mine.initiator_depth(Some(ReadLimits { responder: 4, initiator: 16 })), 4);
        assert_eq!(
            ReadLimits { responder: 8, initiator: 16 }.initiator_depth(None),
            8,
            "old peer: the smaller local limit"
        );
    }

    #[test]
    fn requests_and_answers_round_trip_byte_for_byte() {
        let b = ep().encode_request();
        assert_eq!(b.len(), 33 + 6);
        // The worked example of docs/PROTOCOL.md, "RDMA".
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(hex(&b[..8]), "0100200001050700");
        assert_eq!(hex(&b[24..]), "34120000efcdab00066d6c78355f30");
        assert_eq!(&b[0..2], &[1, 0], "version first, little-endian");
        assert_eq!(Endpoint::decode_request(&b).unwrap(), ep());
        for a in [
            Answer::Accepted(ep()),
            Answer::VersionRefused(1),
            Answer::NotOffered("this node has no RDMA device named".into()),
            Answer::SetupFailed("cannot create a QP".into()),
        ] {
            assert_eq!(Answer::decode(&a.encode()).unwrap(), a);
        }
        let acc = Answer::Accepted(ep()).encode();
        assert_eq!(&acc[2..4], &[0, 0]);
        assert_eq!(acc.len(), b.len() + 2);
    }

    #[test]
    fn versions_and_bad_bodies_are_refused_with_a_reason() {
        let mut b = ep().encode_request();
        b[0] = 4;
        assert_eq!(Endpoint::decode_request(&b), Err(BootstrapError::Version { theirs: 4 }));
        assert!(Endpoint::decode_request(&[1]).is_err());
        let good = ep().encode_request();
        assert!(matches!(Endpoint::decode_request(&good[..20]), Err(BootstrapError::Short(_))));
        let mut long = good.clone();
        long.push(b'x');
        assert!(Endpoint::decode_request(&long).is_err());
        for (off, val, what) in [(2, 0u8, "depth"), (5, 9, "MTU"), (4, 0, "port"), (27, 1, "24 bits")] {
            let mut b = good.clone();
            b[off] = val;
            if off == 2 {
                b[3] = 0;
            }
            let e = Endpoint::decode_request(&b).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
        let mut b = good.clone();
        b[33] = 0x07;
        assert!(Endpoint::decode_request(&b).unwrap_err().to_string().contains("printable"));
        // A newer node answering in its own version: refused, not misread.
        let mut a = Answer::Accepted(ep()).encode();
        a[0] = 9;
        assert_eq!(Answer::decode(&a), Err(BootstrapError::Version { theirs: 9 }));
        assert!(Answer::decode(&[1, 0, 7, 0]).is_err());
        assert!(Answer::decode(&[1, 0]).is_err());
        // Reasons are bounded and cut on a character boundary.
        let long = Answer::NotOffered("é".repeat(MAX_REASON)).encode();
        assert!(long.len() <= 4 + MAX_REASON);
        assert!(matches!(Answer::decode(&long), Ok(Answer::NotOffered(_))));
    }
}
