//! Data-plane wire frames (byte tables in docs/PROTOCOL.md).
//!
//! A connection opens with a hello each way (16 bytes; from protocol v2 the
//! client's is followed by its auth token), then carries frames:
//! a 16-byte header and `body_len` body bytes. Every frame carries a request
//! id, so several requests may be in flight on one connection and responses
//! may come back in any order. Decoders here check every claimed length
//! against [`Limits`] before a caller allocates anything.

use crate::page::{le_u16, le_u32, le_u64};
use crate::page::{Geometry, PageHeader, GEOMETRY_WIRE_LEN, MAX_KEY_LEN};
use crate::status::Status;

/// `"KVCW"` as a little-endian u32: opens the client hello and server reply.
pub const WIRE_MAGIC: u32 = 0x5743_564B;
/// The newest protocol version this code speaks. v2 added the auth token
/// after the client's hello; v3 the batch frames (BATCH_GET) and, in the
/// client's hello, room for a tenant id; v4 the batch writes (BATCH_PUT,
/// BATCH_DELETE). Other frames are the same in every version.
pub const WIRE_VERSION: u16 = 4;
/// The first version that carries batch frames: a client sends them only on
/// a connection whose hello agreed on this version or a later one.
pub const WIRE_VERSION_BATCH: u16 = 3;
/// The first version that carries BATCH_PUT and BATCH_DELETE.
pub const WIRE_VERSION_BATCH_WRITE: u16 = 4;
/// The oldest version this code still speaks (a node serves v1 clients when
/// it has no token; a client falls back to v1 against a v1 node).
pub const WIRE_VERSION_MIN: u16 = 1;
/// Node hello status: accepted.
pub const HELLO_ACCEPTED: u16 = 0;
/// Node hello status: version not spoken (the reply's version is the node's
/// newest); the node closes.
pub const HELLO_VERSION_REFUSED: u16 = 1;
/// Node hello status: missing or wrong auth token; the node closes.
pub const HELLO_DENIED: u16 = 2;
/// Node hello status: the node is at its connection cap (`--max-conns`);
/// it closes. Try again later or treat the node as unavailable.
pub const HELLO_BUSY: u16 = 3;
/// Node hello status (v3 and later): accepted, and bound to the tenant the
/// client's hello named; only a node or admin credential may name one (a
/// node's drain push of a tenant's pages). A node of an earlier release
/// answers [`HELLO_ACCEPTED`] and binds the credential's tenant instead.
pub const HELLO_ACCEPTED_FOR_TENANT: u16 = 4;
/// Bytes of each hello.
pub const HELLO_LEN: usize = 16;
/// Bytes of a frame header (request or response).
pub const FRAME_HEADER_LEN: usize = 16;
/// Most keys one BATCH_EXIST may carry.
pub const MAX_BATCH_KEYS: usize = 4096;
/// Largest body of a request other than PUT and BATCH_EXIST.
pub const MAX_SMALL_BODY: u32 = 64 * 1024;
/// Largest BATCH_EXIST body: geometry, count and 4096 maximal keys.
pub const MAX_BATCH_BODY: u32 = (GEOMETRY_WIRE_LEN + 4 + MAX_BATCH_KEYS * (2 + MAX_KEY_LEN)) as u32;
/// Most items one BATCH_GET may name.
pub const MAX_BATCH_ITEMS: usize = 1024;
/// Bytes before a BATCH_GET's first item: geometry, count, reserved.
pub const BATCH_GET_HEAD: usize = GEOMETRY_WIRE_LEN + 8;
/// Bytes of an item's head in a BATCH_GET request (flags, reserved, key
/// length) and of an item's head in its answer (status, flags, reserved,
/// length).
pub const BATCH_ITEM_HEAD: usize = 8;
/// Most segments one batch item names ([`ITEM_RDMA`]); an item whose
/// buffers are in more pieces goes inline.
pub const MAX_ITEM_SEGMENTS: usize = 64;
/// Largest BATCH_GET body: its head and 1024 items with maximal keys, each
/// naming [`MAX_ITEM_SEGMENTS`] segments.
pub const MAX_BATCH_GET_BODY: u32 =
    (BATCH_GET_HEAD + MAX_BATCH_ITEMS * (4 + MAX_KEY_LEN + 2 + SEGMENT_LEN * MAX_ITEM_SEGMENTS)) as u32;
/// The records one BATCH_GET answer carries stop at 64 MiB: the items past
/// that (the first item always goes, whatever its size) are answered
/// REJECTED, to be asked again. A client splits its batches so that this
/// never happens when each buffer is at least its record's payload.
pub const MAX_BATCH_ANSWER: u64 = 64 << 20;
/// Per-item flag in a BATCH_GET: a handoff ask for this item (as
/// [`FLAG_HANDOFF`] on a GET; the frame's FLAG_HANDOFF sets it for all).
pub const ITEM_HANDOFF: u8 = 1;
/// Per-item flag in a BATCH_GET request: the client spreads this key's
/// reads, over as many nodes as the item head's second byte says, and this
/// read at its owner stands for that many (nodes before this release
/// ignore it). On a BATCH_GET answer's `OK` item: the key is hot at this
/// node, and the item head's third byte is its spread (docs/PROTOCOL.md §2.5).
pub const ITEM_HOT: u8 = 2;
/// Per-item flag in a BATCH_GET or BATCH_PUT (on a connection whose RDMA
/// bootstrap agreed on version 3, docs/PROTOCOL.md §2.8): the payload moves
/// by RDMA. A BATCH_GET item's key is followed by a segment list for the
/// node to write the payload into; a BATCH_PUT item's record is the page
/// header and key followed by a segment list to read the payload from.
pub const ITEM_RDMA: u8 = 4;
/// Flag on an item of a BATCH_GET or BATCH_PUT answer: `REJECTED` only
/// because the answer reached its byte bound ([`MAX_BATCH_ANSWER`]; a get)
/// or the node's memory budget was busy for an [`ITEM_RDMA`] put; ask it
/// again on its own.
pub const ITEM_AGAIN: u8 = 1;
/// Flag on an `OK` (or `TOO_SMALL`) item of a BATCH_GET answer to an
/// [`ITEM_RDMA`] item: the payload was written into the item's segments;
/// the item's bytes are the record's header and key only.
pub const ITEM_PLACED: u8 = 4;
/// Flag on an `UNAVAILABLE` item of a BATCH_PUT answer to an [`ITEM_RDMA`]
/// item: the node could not read the payload (no queue pair, or it broke);
/// nothing was stored. Send it again inline.
pub const ITEM_RDMA_FAILED: u8 = 8;
/// Flag on an item of a BATCH_PUT answer: `OK`, the key was already stored
/// (as [`RSP_FLAG_DUPLICATE`] on a PUT).
pub const ITEM_DUPLICATE: u8 = 2;
/// Bytes before a BATCH_PUT's or BATCH_DELETE's first item, and before the
/// first item of any batch answer: u32 count, u32 reserved.
pub const BATCH_HEAD: usize = 8;
/// The records one BATCH_PUT carries stop at 64 MiB (a larger record goes
/// as a PUT of its own).
pub const MAX_BATCH_PUT_RECORDS: u64 = 64 << 20;
/// Largest BATCH_PUT body: its head, 1024 item heads and 64 MiB of records.
pub const MAX_BATCH_PUT_BODY: u32 =
    (BATCH_HEAD + MAX_BATCH_ITEMS * BATCH_ITEM_HEAD) as u32 + MAX_BATCH_PUT_RECORDS as u32;
/// Largest BATCH_DELETE body: its head and 1024 items with maximal keys.
pub const MAX_BATCH_DELETE_BODY: u32 = (BATCH_HEAD + MAX_BATCH_ITEMS * (4 + MAX_KEY_LEN)) as u32;
/// Request flag: compare the stored geometry with the request's (GET, EXIST, BATCH_EXIST).
pub const FLAG_CHECK_GEOMETRY: u8 = 1;
/// Response flag on PUT: the key was already stored (write-once; not rewritten).
pub const RSP_FLAG_DUPLICATE: u16 = 1;
/// Request flag (GET, PUT): the payload moves by RDMA over the queue pair
/// this connection set up with RDMA_CONNECT. A GET body is then a segment
/// list followed by the key request; a PUT body is the record's header and
/// key followed by a segment list instead of the payload ([`Segment`]).
pub const FLAG_RDMA: u8 = 2;
/// Request flag (GET, EXIST, BATCH_EXIST, PUT): a handoff request
/// (docs/ARCHITECTURE.md, "Ring transitions"). On GET and EXIST: the key
/// missed at its owner and is asked here, at a previous owner (counted).
/// On PUT: a copy of a page read from a previous owner, which the node
/// refuses (REJECTED) when the key was deleted within the handoff window.
/// Nodes that predate it ignore the bit.
pub const FLAG_HANDOFF: u8 = 4;
/// Request flag on a PUT with [`FLAG_HANDOFF`]: the copy fills a node of a
/// hot key's spread (docs/ARCHITECTURE.md, "Hot keys"), taken as any
/// handoff copy and counted apart too. Nodes that predate it ignore the bit.
pub const FLAG_FILL: u8 = 8;
/// Response flag on GET: the payload was written into the request's
/// segments; the body holds the record's header and key only.
pub const RSP_FLAG_RDMA: u16 = 2;
/// Response flag: the RDMA transfer could not be made (no queue pair, or it
/// broke); nothing was stored. Send the request again without FLAG_RDMA.
pub const RSP_FLAG_RDMA_FAILED: u16 = 4;
/// Response flag on a GET answered `OK`: the key is hot at this node; the
/// flags' high byte is its spread, the nodes its reads should be spread
/// over, the owner included (docs/PROTOCOL.md §2.3).
pub const RSP_FLAG_HOT: u16 = 8;

/// The response flags that mark a key hot with `spread` (0: none).
pub fn hot_flags(spread: u8) -> u16 {
    if spread == 0 {
        0
    } else {
        RSP_FLAG_HOT | (u16::from(spread) << 8)
    }
}

/// The spread a GET answer's flags mark its key with (0: not hot).
pub fn spread_of_flags(flags: u16) -> u8 {
    if flags & RSP_FLAG_HOT == 0 {
        0
    } else {
        (flags >> 8) as u8
    }
}

/// Operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Put = 1,
    Get = 2,
    Exist = 3,
    BatchExist = 4,
    Delete = 5,
    Stats = 6,
    Ping = 7,
    /// Sets up this connection's RDMA queue pair (rdma::bootstrap).
    RdmaConnect = 8,
    /// Many gets in one frame, answered by one frame (protocol v3).
    BatchGet = 9,
    /// Many puts in one frame, answered by one frame (protocol v4).
    BatchPut = 10,
    /// Many deletes in one frame, answered by one frame (protocol v4).
    BatchDelete = 11,
}

impl Op {
    pub fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Put,
            2 => Op::Get,
            3 => Op::Exist,
            4 => Op::BatchExist,
            5 => Op::Delete,
            6 => Op::Stats,
            7 => Op::Ping,
            8 => Op::RdmaConnect,
            9 => Op::BatchGet,
            10 => Op::BatchPut,
            11 => Op::BatchDelete,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Exist => "exist",
            Op::BatchExist => "batch_exist",
            Op::Delete => "delete",
            Op::Stats => "stats",
            Op::Ping => "ping",
            Op::RdmaConnect => "rdma_connect",
            Op::BatchGet => "batch_get",
            Op::BatchPut => "batch_put",
            Op::BatchDelete => "batch_delete",
        }
    }
}

/// Why bytes from a peer were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#010x}: not a kvcellar peer")]
    Magic(u32),
    #[error("unsupported protocol version {0}")]
    Version(u16),
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("{op} body of {len} bytes exceeds the limit of {max}")]
    TooLarge { op: &'static str, len: u64, max: u64 },
    #[error("malformed {0} body")]
    Malformed(&'static str),
    #[error("truncated frame")]
    Truncated,
}

/// Limits a node enforces on what a peer claims.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest record a PUT may carry.
    pub max_record: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_record: 256 << 20 }
    }
}

/// The hello each side sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    /// Client v1: 0. Client v2: the length of the auth token that follows
    /// the hello (0: none). Node: [`HELLO_ACCEPTED`],
    /// [`HELLO_VERSION_REFUSED`] or [`HELLO_DENIED`] (then it closes).
    pub status: u16,
    /// Server: the largest record it accepts. Client v1 and v2: 0. Client
    /// v3: its tenant id in the low 32 bits (0: none), the high 32 reserved.
    pub max_record: u64,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&WIRE_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.max_record.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, WireError> {
        let magic = le_u32(b, 0);
        if magic != WIRE_MAGIC {
            return Err(WireError::Magic(magic));
        }
        Ok(Hello { version: le_u16(b, 4), status: le_u16(b, 6), max_record: le_u64(b, 8) })
    }
}

/// What a client sends to open a connection at `version`: the hello, and
/// from v2 the token after it (its length in the hello's status field).
///
/// From v3 the client's bytes 8..12 carry a tenant id (0: none) and bytes
/// 12..16 are reserved (0); before v3 all eight bytes are 0.
pub fn client_hello(version: u16, token: Option<&[u8]>) -> Vec<u8> {
    client_hello_for(version, token, 0)
}

/// [`client_hello`] naming `tenant` (v3 and later): a node or admin
/// credential acting for that tenant ([`HELLO_ACCEPTED_FOR_TENANT`]).
pub fn client_hello_for(version: u16, token: Option<&[u8]>, tenant: u32) -> Vec<u8> {
    let token = if version >= 2 { token.unwrap_or(&[]) } else { &[] };
    let len = token.len().min(crate::auth::MAX_TOKEN_LEN);
    let room = if version >= WIRE_VERSION_BATCH { u64::from(tenant) } else { 0 };
    let mut b = Hello { version, status: len as u16, max_record: room }.encode().to_vec();
    b.extend_from_slice(&token[..len]);
    b
}

/// What a client makes of the node's hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloVerdict {
    /// Frames may follow, in the version sent.
    Accepted { max_record: u64 },
    /// Connect again and say hello in this version.
    Retry(u16),
    /// The node wants another auth token (KV_EDENIED).
    Denied,
    /// No version in common, or an answer this code does not know.
    Refused(String),
}

/// Judges the node's `reply` to a hello sent at version `sent`.
pub fn judge_hello(sent: u16, reply: &Hello) -> HelloVerdict {
    match reply.status {
        HELLO_ACCEPTED | HELLO_ACCEPTED_FOR_TENANT => HelloVerdict::Accepted { max_record: reply.max_record },
        HELLO_VERSION_REFUSED if reply.version < sent && reply.version >= WIRE_VERSION_MIN => {
            HelloVerdict::Retry(reply.version)
        }
        HELLO_VERSION_REFUSED => HelloVerdict::Refused(format!(
            "the node speaks protocol v{}, this client v{WIRE_VERSION_MIN} to v{WIRE_VERSION}",
            reply.version
        )),
        // A v1 hello carries no token: a node that wants one is asked again
        // in a version that carries it, the newest the node names (a v2
        // node refuses a v3 hello).
        HELLO_DENIED if sent < 2 => HelloVerdict::Retry(reply.version.clamp(2, WIRE_VERSION)),
        HELLO_DENIED => HelloVerdict::Denied,
        HELLO_BUSY => HelloVerdict::Refused("the node is at its connection cap (--max-conns)".into()),
        s => HelloVerdict::Refused(format!("the node answered the hello with unknown status {s}")),
    }
}

/// What a node makes of a client's hello (before reading any token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientHello {
    /// Spoken: read `token_len` bytes of token next (0 for v1).
    Speak { version: u16, token_len: usize },
    /// Not spoken: answer [`HELLO_VERSION_REFUSED`] with the node's version.
    Unsupported(u16),
    /// A token longer than any valid one: not a well-behaved client.
    TokenTooLong(usize),
}

impl ClientHello {
    pub fn judge(h: &Hello) -> ClientHello {
        if !(WIRE_VERSION_MIN..=WIRE_VERSION).contains(&h.version) {
            return ClientHello::Unsupported(h.version);
        }
        let token_len = if h.version >= 2 { h.status as usize } else { 0 };
        if token_len > crate::auth::MAX_TOKEN_LEN {
            return ClientHello::TokenTooLong(token_len);
        }
        ClientHello::Speak { version: h.version, token_len }
    }
}

/// A request frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqHeader {
    pub op: Op,
    pub flags: u8,
    /// Bytes 2..4. For a PUT with [`FLAG_HANDOFF`]: the copy's age, how
    /// long ago the page it copies was read ([`encode_copy_age`]). For a
    /// GET: the spread the client reads a hot key with, so that the owner
    /// counts this read as that many ([`ReqHeader::read_weight`]).
    /// Otherwise 0, and ignored by nodes (so is a copy's age or a spread
    /// on nodes that predate it; a copy from a client that predates it
    /// reads as age 0).
    pub copy_age: u16,
    pub body_len: u32,
    pub req_id: u64,
}

impl ReqHeader {
    /// The reads a GET stands for: the spread in bytes 2..4, at most
    /// [`MAX_SPREAD`], at least 1 (docs/PROTOCOL.md §2.2).
    pub fn read_weight(&self) -> u8 {
        self.copy_age.clamp(1, u16::from(MAX_SPREAD)) as u8
    }
}

/// The most nodes a hot key's reads are spread over.
/// (255, what a byte holds: on the shipped trace replicated 10 times over
/// 1,000 nodes the one page every request shares needs about 250 nodes to
/// be no more than the others' load; scripts/model-hot.py.)
pub const MAX_SPREAD: u8 = 255;

/// Below this encoded value a copy's age counts units of
/// [`COPY_AGE_FINE_MS`]; from it on, units of [`COPY_AGE_COARSE_MS`] past
/// the fine range's end (docs/PROTOCOL.md §2.2).
pub const COPY_AGE_COARSE_FROM: u16 = 0x8000;
/// The fine unit of a copy's age: 100 ms, up to 3276.7 s.
pub const COPY_AGE_FINE_MS: u64 = 100;
/// The coarse unit of a copy's age: 10 s, from 3276.8 s on.
pub const COPY_AGE_COARSE_MS: u64 = 10_000;
/// Where the coarse range starts, in milliseconds.
const COPY_AGE_COARSE_BASE_MS: u64 = COPY_AGE_COARSE_FROM as u64 * COPY_AGE_FINE_MS;

/// A handoff copy's age as bytes 2..4 of its PUT header carry it: 100 ms
/// units up to 3276.7 s, then 10 s units, rounded down, saturating at
/// 0xFFFF ("at least [`decode_copy_age`]`(0xFFFF)`", about 91.9 h).
pub fn encode_copy_age(age: std::time::Duration) -> u16 {
    let ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
    if ms < COPY_AGE_COARSE_BASE_MS {
        (ms / COPY_AGE_FINE_MS) as u16
    } else {
        let units =
            ((ms - COPY_AGE_COARSE_BASE_MS) / COPY_AGE_COARSE_MS).min(u64::from(u16::MAX - COPY_AGE_COARSE_FROM));
        COPY_AGE_COARSE_FROM + units as u16
    }
}

/// The age an encoded copy age stands for: at least this old (the encoding
/// rounds down; 0xFFFF means this old or older).
pub fn decode_copy_age(v: u16) -> std::time::Duration {
    let ms = if v < COPY_AGE_COARSE_FROM {
        u64::from(v) * COPY_AGE_FINE_MS
    } else {
        COPY_AGE_COARSE_BASE_MS + u64::from(v - COPY_AGE_COARSE_FROM) * COPY_AGE_COARSE_MS
    };
    std::time::Duration::from_millis(ms)
}

impl ReqHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0] = self.op as u8;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.copy_age.to_le_bytes());
        b[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b
    }

    /// Decodes a header and checks its body length against `limits`.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN], limits: &Limits) -> Result<ReqHeader, WireError> {
        let op = Op::from_u8(b[0]).ok_or(WireError::UnknownOp(b[0]))?;
        let h = ReqHeader { op, flags: b[1], copy_age: le_u16(b, 2), body_len: le_u32(b, 4), req_id: le_u64(b, 8) };
        let max = match op {
            Op::Put => limits.max_record.min(u32::MAX as u64),
            Op::BatchExist => MAX_BATCH_BODY as u64,
            Op::BatchGet => MAX_BATCH_GET_BODY as u64,
            Op::BatchPut => MAX_BATCH_PUT_BODY as u64,
            Op::BatchDelete => MAX_BATCH_DELETE_BODY as u64,
            _ => MAX_SMALL_BODY as u64,
        };
        if h.body_len as u64 > max {
            return Err(WireError::TooLarge { op: op.name(), len: h.body_len as u64, max });
        }
        Ok(h)
    }
}

/// A response frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RspHeader {
    pub status: Status,
    pub op: u8,
    pub flags: u16,
    pub body_len: u32,
    pub req_id: u64,
}

impl RspHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0] = self.status.to_wire();
        b[1] = self.op;
        b[2..4].copy_from_slice(&self.flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> RspHeader {
        RspHeader {
            status: Status::from_wire(b[0]),
            op: b[1],
            flags: le_u16(b, 2),
            body_len: le_u32(b, 4),
            req_id: le_u64(b, 8),
        }
    }
}

/// Body of GET and EXIST: geometry then key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRequest<'a> {
    pub geometry: Geometry,
    pub key: &'a [u8],
}

impl<'a> KeyRequest<'a> {
    pub fn encode(geometry: &Geometry, key: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(GEOMETRY_WIRE_LEN + key.len());
        v.extend_from_slice(&geometry.encode());
        v.extend_from_slice(key);
        v
    }

    pub fn decode(b: &'a [u8]) -> Result<KeyRequest<'a>, WireError> {
        let geometry = Geometry::decode(b).ok_or(WireError::Malformed("key request"))?;
        let key = &b[GEOMETRY_WIRE_LEN..];
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(WireError::Malformed("key request"));
        }
        Ok(KeyRequest { geometry, key })
    }
}

/// Body of DELETE: the key alone.
pub fn decode_key(b: &[u8]) -> Result<&[u8], WireError> {
    if b.is_empty() || b.len() > MAX_KEY_LEN {
        return Err(WireError::Malformed("key"));
    }
    Ok(b)
}

/// Body of BATCH_EXIST: geometry, u32 count, then `count` × (u16 len, key).
pub fn encode_batch_exist<K: AsRef<[u8]>>(geometry: &Geometry, keys: &[K]) -> Vec<u8> {
    let total: usize = keys.iter().map(|k| 2 + k.as_ref().len()).sum();
    let mut v = Vec::with_capacity(GEOMETRY_WIRE_LEN + 4 + total);
    v.extend_from_slice(&geometry.encode());
    v.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        let k = k.as_ref();
        v.extend_from_slice(&(k.len() as u16).to_le_bytes());
        v.extend_from_slice(k);
    }
    v
}

/// Decodes a BATCH_EXIST body. The count is checked against the body length
/// before anything is allocated.
pub fn decode_batch_exist(b: &[u8]) -> Result<(Geometry, Vec<&[u8]>), WireError> {
    const WHAT: &str = "batch_exist";
    let geometry = Geometry::decode(b).ok_or(WireError::Malformed(WHAT))?;
    let rest = &b[GEOMETRY_WIRE_LEN..];
    if rest.len() < 4 {
        return Err(WireError::Malformed(WHAT));
    }
    let count = le_u32(rest, 0) as usize;
    let mut rest = &rest[4..];
    // Each key takes at least 3 bytes: a count beyond that is a lie.
    if count > MAX_BATCH_KEYS || count > rest.len() / 3 {
        return Err(WireError::Malformed(WHAT));
    }
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        if rest.len() < 2 {
            return Err(WireError::Malformed(WHAT));
        }
        let n = le_u16(rest, 0) as usize;
        if n == 0 || n > MAX_KEY_LEN || rest.len() < 2 + n {
            return Err(WireError::Malformed(WHAT));
        }
        keys.push(&rest[2..2 + n]);
        rest = &rest[2 + n..];
    }
    if !rest.is_empty() {
        return Err(WireError::Malformed(WHAT));
    }
    Ok((geometry, keys))
}

/// Body of a BATCH_EXIST response: u32 count then one status byte per key.
pub fn encode_batch_status(st: &[Status]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + st.len());
    v.extend_from_slice(&(st.len() as u32).to_le_bytes());
    v.extend(st.iter().map(|s| s.to_wire()));
    v
}

/// Decodes a BATCH_EXIST answer's statuses. Bit 7 of each byte
/// ([`EXIST_FLAGS_MASK`]) is kept for a per-key flag (from protocol v4;
/// nodes of this release send 0) and read past.
pub fn decode_batch_status(b: &[u8]) -> Result<Vec<Status>, WireError> {
    if b.len() < 4 {
        return Err(WireError::Malformed("batch status"));
    }
    let n = le_u32(b, 0) as usize;
    if b.len() - 4 != n {
        return Err(WireError::Malformed("batch status"));
    }
    Ok(b[4..].iter().map(|&x| Status::from_wire(x & !EXIST_FLAGS_MASK)).collect())
}

/// The bits of a BATCH_EXIST answer's status byte kept for per-key flags
/// (a later release's "hot" mark): clients read past them.
pub const EXIST_FLAGS_MASK: u8 = 0x80;

/// One item of a BATCH_GET request: its flags ([`ITEM_HANDOFF`],
/// [`ITEM_HOT`], [`ITEM_RDMA`]), key and, with [`ITEM_RDMA`], the segment
/// list as the frame carries it ([`encode_segments`]; empty otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchItem<'a> {
    pub flags: u8,
    pub key: &'a [u8],
    pub segs: &'a [u8],
    /// The item head's second byte. With [`ITEM_HOT`] on a BATCH_GET item:
    /// the spread the client reads the key with, so the owner counts this
    /// read as that many (docs/PROTOCOL.md §2.5); 0 otherwise.
    pub spread: u8,
}

impl BatchItem<'_> {
    /// The segments the item names (empty without [`ITEM_RDMA`]); a
    /// decoded item's list was checked already.
    pub fn segments(&self) -> Vec<Segment> {
        if self.flags & ITEM_RDMA == 0 {
            return Vec::new();
        }
        decode_segments(self.segs).unwrap_or_default()
    }
}

/// A BATCH_GET body (docs/PROTOCOL.md §2.5): geometry, u32 count, u32
/// reserved, then per item u8 flags, u8 reserved, u16 key length, key.
pub fn encode_batch_get(geometry: &Geometry, items: &[BatchItem<'_>]) -> Vec<u8> {
    let total: usize = items.iter().map(|i| 4 + i.key.len() + i.segs.len()).sum();
    let mut v = Vec::with_capacity(BATCH_GET_HEAD + total);
    v.extend_from_slice(&geometry.encode());
    encode_key_items(&mut v, items);
    v
}

/// Decodes a BATCH_GET body. The count is checked against the body length
/// before anything is allocated; the body must end after the last key.
pub fn decode_batch_get(b: &[u8]) -> Result<(Geometry, Vec<BatchItem<'_>>), WireError> {
    const WHAT: &str = "batch_get";
    if b.len() < BATCH_GET_HEAD {
        return Err(WireError::Malformed(WHAT));
    }
    let geometry = Geometry::decode(b).ok_or(WireError::Malformed(WHAT))?;
    Ok((geometry, decode_key_items(&b[GEOMETRY_WIRE_LEN..], WHAT, true)?))
}

/// A batch's count and items of the BATCH_GET shape (flags, reserved, u16
/// key length, key, and with [`ITEM_RDMA`] where `segments` allows it a
/// segment list of 1..=[`MAX_ITEM_SEGMENTS`]), which must fill `b` exactly.
fn decode_key_items<'a>(b: &'a [u8], what: &'static str, segments: bool) -> Result<Vec<BatchItem<'a>>, WireError> {
    if b.len() < BATCH_HEAD {
        return Err(WireError::Malformed(what));
    }
    let count = le_u32(b, 0) as usize;
    let mut rest = &b[BATCH_HEAD..];
    // Each item takes at least 5 bytes: a count beyond that is a lie.
    if count == 0 || count > MAX_BATCH_ITEMS || count > rest.len() / 5 {
        return Err(WireError::Malformed(what));
    }
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        if rest.len() < 4 {
            return Err(WireError::Malformed(what));
        }
        let n = le_u16(rest, 2) as usize;
        if n == 0 || n > MAX_KEY_LEN || rest.len() < 4 + n {
            return Err(WireError::Malformed(what));
        }
        let (flags, spread, key) = (rest[0], rest[1], &rest[4..4 + n]);
        rest = &rest[4 + n..];
        let mut segs: &[u8] = &[];
        if segments && flags & ITEM_RDMA != 0 {
            if rest.len() < 2 {
                return Err(WireError::Malformed(what));
            }
            let k = le_u16(rest, 0) as usize;
            if k > MAX_ITEM_SEGMENTS || rest.len() < 2 + k * SEGMENT_LEN {
                return Err(WireError::Malformed(what));
            }
            segs = &rest[..2 + k * SEGMENT_LEN];
            decode_segments(segs).map_err(|_| WireError::Malformed(what))?;
            rest = &rest[segs.len()..];
        }
        items.push(BatchItem { flags, key, segs, spread });
    }
    if !rest.is_empty() {
        return Err(WireError::Malformed(what));
    }
    Ok(items)
}

/// The items after a batch's count, in the BATCH_GET shape.
fn encode_key_items(v: &mut Vec<u8>, items: &[BatchItem<'_>]) {
    v.extend_from_slice(&(items.len() as u32).to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    for i in items {
        v.push(i.flags);
        v.push(i.spread);
        v.extend_from_slice(&(i.key.len() as u16).to_le_bytes());
        v.extend_from_slice(i.key);
        v.extend_from_slice(i.segs);
    }
}

/// A BATCH_DELETE body (docs/PROTOCOL.md §2.5): u32 count, u32 reserved,
/// then items as a BATCH_GET's (flags 0, reserved, u16 key length, key;
/// never a segment list).
pub fn encode_batch_delete(items: &[BatchItem<'_>]) -> Vec<u8> {
    let total: usize = items.iter().map(|i| 4 + i.key.len()).sum();
    let mut v = Vec::with_capacity(BATCH_HEAD + total);
    encode_key_items(&mut v, items);
    v
}

/// Decodes a BATCH_DELETE body; it must end after the last key.
pub fn decode_batch_delete(b: &[u8]) -> Result<Vec<BatchItem<'_>>, WireError> {
    decode_key_items(b, "batch_delete", false)
}

/// The head of one item of a BATCH_PUT request: flags ([`ITEM_HANDOFF`]:
/// a handoff copy, aged `copy_age` as a PUT's header carries it), and the
/// length of the record that follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutItemHead {
    pub flags: u8,
    pub copy_age: u16,
    pub record_len: u32,
}

impl PutItemHead {
    pub fn encode(&self) -> [u8; BATCH_ITEM_HEAD] {
        let mut b = [0u8; BATCH_ITEM_HEAD];
        b[0] = self.flags;
        b[2..4].copy_from_slice(&self.copy_age.to_le_bytes());
        b[4..8].copy_from_slice(&self.record_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; BATCH_ITEM_HEAD]) -> PutItemHead {
        PutItemHead { flags: b[0], copy_age: le_u16(b, 2), record_len: le_u32(b, 4) }
    }

    /// Whether this item's record fits in the `left` bytes of the body
    /// that follow its head (a record that does not is a malformed frame).
    pub fn fits(&self, left: u64) -> bool {
        u64::from(self.record_len) <= left
    }
}

/// The segments of a put whose payload is in the client's memory (a PUT
/// with [`FLAG_RDMA`], a BATCH_PUT item with [`ITEM_RDMA`]): after the page
/// header `h`, `rest` is the key and a segment list of at most `max`
/// segments whose lengths add up to the header's `payload_len`.
pub fn remote_put_segments(h: &PageHeader, rest: &[u8], max: usize) -> Result<Vec<Segment>, String> {
    let list = rest.get(usize::from(h.key_len)..).ok_or("RDMA put body is not header, key and segment list")?;
    let segs = decode_segments(list).map_err(|e| e.to_string())?;
    if segs.len() > max {
        return Err(format!("RDMA put names {} segments, over {max}", segs.len()));
    }
    if segs.iter().map(|s| u64::from(s.len)).sum::<u64>() != h.payload_len {
        return Err("RDMA put: segments do not add up to the payload length".into());
    }
    Ok(segs)
}

/// The count a BATCH_PUT's head announces, if it is within 1..=1024.
pub fn batch_count(b: &[u8; BATCH_HEAD]) -> Option<usize> {
    let n = le_u32(b, 0) as usize;
    (1..=MAX_BATCH_ITEMS).contains(&n).then_some(n)
}

/// A BATCH_PUT body taken as it arrives: the one place its framing rules
/// are kept. A node reads a frame through it as the bytes come in
/// (`server/src/conn.rs`); [`decode_batch_put`] is the same over a slice.
/// The rules: a head with a count of 1..=1024, then that many items, each
/// an 8-byte head and a record that fit in the body, and nothing after the
/// last. An `Err` is why the frame is malformed (refused whole); the
/// records themselves are checked one by one, each its item's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutFrame {
    /// Body bytes not yet taken.
    left: u64,
    /// Items not yet taken.
    items: usize,
}

impl PutFrame {
    /// A frame of `body_len` bytes, before its head: the head must fit.
    pub fn open(body_len: u64) -> Result<PutFrame, &'static str> {
        match body_len.checked_sub(BATCH_HEAD as u64) {
            Some(left) => Ok(PutFrame { left, items: 0 }),
            None => Err("shorter than its head"),
        }
    }

    /// Takes the head: the count it announces.
    pub fn count(&mut self, head: &[u8; BATCH_HEAD]) -> Result<usize, &'static str> {
        let n = batch_count(head).ok_or("its count is not within 1..=1024")?;
        self.items = n;
        Ok(n)
    }

    /// Body bytes not yet taken: what to skip when the frame is refused.
    pub fn left(&self) -> u64 {
        self.left
    }

    /// Whether another item follows (its head then fits in the body).
    pub fn more(&self) -> Result<bool, &'static str> {
        match self.items {
            0 => Ok(false),
            _ if self.left < BATCH_ITEM_HEAD as u64 => Err("an item's head passes the frame's end"),
            _ => Ok(true),
        }
    }

    /// Takes an item's head, and its record's bytes as to be read next:
    /// the record must fit in what is left of the body.
    pub fn item(&mut self, b: &[u8; BATCH_ITEM_HEAD]) -> Result<PutItemHead, &'static str> {
        self.left -= BATCH_ITEM_HEAD as u64;
        self.items -= 1;
        let ih = PutItemHead::decode(b);
        self.left = self.left.checked_sub(u64::from(ih.record_len)).ok_or("an item's record passes the frame's end")?;
        Ok(ih)
    }

    /// After the last item: nothing may follow it.
    pub fn end(&self) -> Result<(), &'static str> {
        match self.left {
            0 => Ok(()),
            _ => Err("bytes follow its last item"),
        }
    }
}

/// Splits a whole BATCH_PUT body into its items' heads and records by the
/// rules of [`PutFrame`], which a node applies as the bytes arrive. The
/// records themselves are checked one by one (`page::parse_record`): a bad
/// one is that item's refusal, not the frame's.
pub fn decode_batch_put(b: &[u8]) -> Result<Vec<(PutItemHead, &[u8])>, WireError> {
    let bad = |_| WireError::Malformed("batch_put");
    let mut frame = PutFrame::open(b.len() as u64).map_err(bad)?;
    let head: &[u8; BATCH_HEAD] = b[..BATCH_HEAD].try_into().expect("the head fits");
    let count = frame.count(head).map_err(bad)?;
    let mut at = BATCH_HEAD;
    let mut items = Vec::with_capacity(count);
    while frame.more().map_err(bad)? {
        let ih = frame.item(b[at..at + BATCH_ITEM_HEAD].try_into().expect("the head fits")).map_err(bad)?;
        at += BATCH_ITEM_HEAD;
        let n = ih.record_len as usize;
        items.push((ih, &b[at..at + n]));
        at += n;
    }
    frame.end().map_err(bad)?;
    Ok(items)
}

/// A whole BATCH_PUT body from items' heads and records (the client writes
/// the same bytes from its buffers, without this copy).
pub fn encode_batch_put(items: &[(PutItemHead, &[u8])]) -> Vec<u8> {
    let mut v = Vec::with_capacity(BATCH_HEAD + items.iter().map(|(_, r)| BATCH_ITEM_HEAD + r.len()).sum::<usize>());
    v.extend_from_slice(&encode_batch_answer_head(items.len()));
    for (h, r) in items {
        v.extend_from_slice(&h.encode());
        v.extend_from_slice(r);
    }
    v
}

/// Decodes the body of a BATCH_PUT or BATCH_DELETE answer: one head per
/// item, each followed by its message (empty on `OK` and `MISS`). It must
/// hold exactly `count` items.
pub fn decode_batch_answer(b: &[u8], count: usize) -> Result<Vec<(ItemHead, &[u8])>, WireError> {
    const WHAT: &str = "batch answer";
    let head: &[u8; BATCH_HEAD] =
        b.get(..BATCH_HEAD).and_then(|h| h.try_into().ok()).ok_or(WireError::Malformed(WHAT))?;
    if decode_batch_answer_head(head) != count || count > b.len() / BATCH_ITEM_HEAD {
        return Err(WireError::Malformed(WHAT));
    }
    let mut rest = &b[BATCH_HEAD..];
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        let ib: &[u8; BATCH_ITEM_HEAD] =
            rest.get(..BATCH_ITEM_HEAD).and_then(|h| h.try_into().ok()).ok_or(WireError::Malformed(WHAT))?;
        let ih = ItemHead::decode(ib);
        rest = &rest[BATCH_ITEM_HEAD..];
        let n = ih.len as usize;
        let msg = rest.get(..n).ok_or(WireError::Malformed(WHAT))?;
        items.push((ih, msg));
        rest = &rest[n..];
    }
    if !rest.is_empty() {
        return Err(WireError::Malformed(WHAT));
    }
    Ok(items)
}

/// The body of a BATCH_PUT or BATCH_DELETE answer: the head, then each
/// item's head and message.
pub fn encode_batch_answer(items: &[(ItemHead, &[u8])]) -> Vec<u8> {
    let mut v = Vec::with_capacity(BATCH_HEAD + items.iter().map(|(_, m)| BATCH_ITEM_HEAD + m.len()).sum::<usize>());
    v.extend_from_slice(&encode_batch_answer_head(items.len()));
    for (h, m) in items {
        v.extend_from_slice(&h.encode());
        v.extend_from_slice(m);
    }
    v
}

/// The head of a BATCH_GET answer's body: u32 count, u32 reserved.
pub fn encode_batch_answer_head(count: usize) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&(count as u32).to_le_bytes());
    b
}

/// The item count a BATCH_GET answer's head announces.
pub fn decode_batch_answer_head(b: &[u8; 8]) -> usize {
    le_u32(b, 0) as usize
}

/// The head of one item in a BATCH_GET answer: its status, flags (0) and
/// the length of what follows (the record on OK; a message or nothing
/// otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemHead {
    pub status: Status,
    pub flags: u8,
    /// With [`ITEM_HOT`] on a BATCH_GET answer: the spread (nodes to read
    /// the key from, owner included); otherwise 0.
    pub spread: u8,
    pub len: u32,
}

impl ItemHead {
    pub fn encode(&self) -> [u8; BATCH_ITEM_HEAD] {
        let mut b = [0u8; BATCH_ITEM_HEAD];
        b[0] = self.status.to_wire();
        b[1] = self.flags;
        b[2] = self.spread;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; BATCH_ITEM_HEAD]) -> ItemHead {
        ItemHead { status: Status::from_wire(b[0]), flags: b[1], spread: b[2], len: le_u32(b, 4) }
    }
}

/// Most segments one request may name.
pub const MAX_SEGMENTS: usize = 1024;
/// Bytes of one segment.
pub const SEGMENT_LEN: usize = 16;

/// A piece of the peer's registered memory that a request names (docs/PROTOCOL.md
/// §2.8): where a payload goes (a GET with [`FLAG_RDMA`]) or comes from (a PUT
/// with it) when it does not travel inline in the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
}

/// Appends `u16 count` and the segments.
pub fn encode_segments(segs: &[Segment], out: &mut Vec<u8>) {
    out.extend_from_slice(&(segs.len() as u16).to_le_bytes());
    for s in segs {
        out.extend_from_slice(&s.addr.to_le_bytes());
        out.extend_from_slice(&s.rkey.to_le_bytes());
        out.extend_from_slice(&s.len.to_le_bytes());
    }
}

/// Splits a body that starts with a segment list: the segments, and the
/// bytes after them.
pub fn split_segments(b: &[u8]) -> Result<(Vec<Segment>, &[u8]), WireError> {
    if b.len() < 2 {
        return Err(WireError::Malformed("segment list"));
    }
    let end = 2 + le_u16(b, 0) as usize * SEGMENT_LEN;
    if b.len() < end {
        return Err(WireError::Malformed("segment list (longer than the body)"));
    }
    Ok((decode_segments(&b[..end])?, &b[end..]))
}

/// Decodes what [`encode_segments`] wrote, which must fill `b` exactly.
pub fn decode_segments(b: &[u8]) -> Result<Vec<Segment>, WireError> {
    if b.len() < 2 {
        return Err(WireError::Malformed("segment list"));
    }
    let n = le_u16(b, 0) as usize;
    if n == 0 || n > MAX_SEGMENTS {
        return Err(WireError::Malformed("segment list (count out of range 1..=1024)"));
    }
    if b.len() != 2 + n * SEGMENT_LEN {
        return Err(WireError::Malformed("segment list (length does not match its count)"));
    }
    let segs: Vec<Segment> = (0..n)
        .map(|i| {
            let o = 2 + i * SEGMENT_LEN;
            Segment { addr: le_u64(b, o), rkey: le_u32(b, o + 8), len: le_u32(b, o + 12) }
        })
        .collect();
    if segs.iter().any(|s| s.len == 0 || s.addr.checked_add(u64::from(s.len)).is_none()) {
        return Err(WireError::Malformed("segment list (an empty segment or one that wraps the address space)"));
    }
    Ok(segs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn geo() -> Geometry {
        Geometry { model_hash: 7, page_size: 64, tp_size: 2, ..Default::default() }
    }

    #[test]
    fn headers_round_trip() {
        let h = ReqHeader { op: Op::Get, flags: FLAG_CHECK_GEOMETRY, copy_age: 0, body_len: 40, req_id: 99 };
        assert_eq!(h.read_weight(), 1, "an unweighted get is one read");
        assert_eq!(ReqHeader { copy_age: 12, ..h }.read_weight(), 12);
        assert_eq!(ReqHeader { copy_age: 9000, ..h }.read_weight(), MAX_SPREAD, "at most the widest spread");
        assert_eq!(ReqHeader::decode(&h.encode(), &Limits::default()).unwrap(), h);
        let copy = ReqHeader { op: Op::Put, flags: FLAG_HANDOFF, copy_age: 0xABCD, body_len: 81, req_id: 10 };
        let b = copy.encode();
        assert_eq!(&b[..8], &[1, 4, 0xCD, 0xAB, 81, 0, 0, 0], "the age in bytes 2..4, little-endian");
        assert_eq!(ReqHeader::decode(&b, &Limits::default()).unwrap(), copy);
        let r = RspHeader { status: Status::Mismatch, op: 2, flags: 1, body_len: 0, req_id: 5 };
        assert_eq!(RspHeader::decode(&r.encode()), r);
        let hello = Hello { version: 1, status: 0, max_record: 1 << 28 };
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        let mut bad = hello.encode();
        bad[0] = b'G';
        assert!(matches!(Hello::decode(&bad), Err(WireError::Magic(_))));
    }

    #[test]
    fn copy_ages_round_trip() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        // The fine range: 100 ms units, rounded down.
        assert_eq!(encode_copy_age(Duration::ZERO), 0);
        assert_eq!(encode_copy_age(ms(99)), 0);
        assert_eq!(encode_copy_age(ms(250)), 2);
        assert_eq!(decode_copy_age(2), ms(200));
        assert_eq!(encode_copy_age(ms(3_276_799)), 0x7FFF);
        assert_eq!(decode_copy_age(0x7FFF), ms(3_276_700));
        // The coarse range: 10 s units past 3276.8 s.
        assert_eq!(encode_copy_age(ms(3_276_800)), 0x8000);
        assert_eq!(decode_copy_age(0x8000), ms(3_276_800));
        // docs/PROTOCOL.md §2.2's examples.
        assert_eq!(encode_copy_age(ms(250)).to_le_bytes(), [0x02, 0x00]);
        assert_eq!(encode_copy_age(Duration::from_secs(300)).to_le_bytes(), [0xb8, 0x0b]);
        assert_eq!(encode_copy_age(Duration::from_secs(4 * 3600)).to_le_bytes(), [0x58, 0x84]);
        let four_hours = Duration::from_secs(4 * 3600);
        assert!(four_hours - decode_copy_age(encode_copy_age(four_hours)) < Duration::from_secs(10));
        // Saturated: at least about 91.9 h.
        assert_eq!(encode_copy_age(Duration::from_secs(400_000)), 0xFFFF);
        assert_eq!(encode_copy_age(Duration::MAX), 0xFFFF);
        assert_eq!(decode_copy_age(0xFFFF), ms(3_276_800 + 0x7FFF * 10_000));
        // Monotonic, never older than the truth, and each code decodes to
        // an age that encodes back to it.
        let mut last = 0;
        for s in (0..400_000u64).step_by(7) {
            let age = ms(s * 997);
            let v = encode_copy_age(age);
            assert!(v >= last);
            assert!(decode_copy_age(v) <= age);
            assert_eq!(encode_copy_age(decode_copy_age(v)), v);
            last = v;
        }
    }

    #[test]
    fn hellos_negotiate_version_and_token() {
        let b = client_hello(2, Some(b"tok"));
        assert_eq!(b.len(), HELLO_LEN + 3);
        let h = Hello::decode(b[..HELLO_LEN].try_into().unwrap()).unwrap();
        assert_eq!(ClientHello::judge(&h), ClientHello::Speak { version: 2, token_len: 3 });
        assert_eq!(&b[HELLO_LEN..], b"tok");
        // v1 carries no token, whatever the caller has.
        let b = client_hello(1, Some(b"tok"));
        assert_eq!(b.len(), HELLO_LEN);
        let h = Hello::decode(b[..].try_into().unwrap()).unwrap();
        assert_eq!(ClientHello::judge(&h), ClientHello::Speak { version: 1, token_len: 0 });
        let h = Hello { version: WIRE_VERSION + 1, status: 0, max_record: 0 };
        assert_eq!(ClientHello::judge(&h), ClientHello::Unsupported(WIRE_VERSION + 1));
        let h = Hello { version: 4, status: 0, max_record: 0 };
        assert_eq!(ClientHello::judge(&h), ClientHello::Speak { version: 4, token_len: 0 });
        let h = Hello { version: 2, status: 5000, max_record: 0 };
        assert_eq!(ClientHello::judge(&h), ClientHello::TokenTooLong(5000));
        // The client's side.
        let reply = |version, status| Hello { version, status, max_record: 9 };
        assert_eq!(judge_hello(2, &reply(2, HELLO_ACCEPTED)), HelloVerdict::Accepted { max_record: 9 });
        assert_eq!(judge_hello(2, &reply(1, HELLO_VERSION_REFUSED)), HelloVerdict::Retry(1), "an old node");
        assert!(matches!(judge_hello(1, &reply(1, HELLO_VERSION_REFUSED)), HelloVerdict::Refused(_)));
        assert_eq!(judge_hello(1, &reply(3, HELLO_DENIED)), HelloVerdict::Retry(3), "a node that wants a token");
        assert_eq!(judge_hello(1, &reply(2, HELLO_DENIED)), HelloVerdict::Retry(2), "a v2 node that wants one");
        assert_eq!(judge_hello(4, &reply(3, HELLO_VERSION_REFUSED)), HelloVerdict::Retry(3), "a v3 node");
        assert_eq!(judge_hello(2, &reply(2, HELLO_DENIED)), HelloVerdict::Denied);
        assert!(matches!(judge_hello(2, &reply(2, 77)), HelloVerdict::Refused(_)));
    }

    #[test]
    fn lengths_are_checked_before_allocation() {
        let l = Limits { max_record: 1 << 20 };
        let big_put = ReqHeader { op: Op::Put, flags: 0, copy_age: 0, body_len: (1 << 20) + 1, req_id: 1 };
        assert!(matches!(ReqHeader::decode(&big_put.encode(), &l), Err(WireError::TooLarge { .. })));
        let big_get = ReqHeader { op: Op::Get, flags: 0, copy_age: 0, body_len: MAX_SMALL_BODY + 1, req_id: 1 };
        assert!(ReqHeader::decode(&big_get.encode(), &l).is_err());
        let mut unknown = big_get.encode();
        unknown[0] = 77;
        assert_eq!(ReqHeader::decode(&unknown, &l), Err(WireError::UnknownOp(77)));
    }

    #[test]
    fn bodies_round_trip() {
        let body = KeyRequest::encode(&geo(), b"key-1");
        let r = KeyRequest::decode(&body).unwrap();
        assert_eq!((r.geometry, r.key), (geo(), &b"key-1"[..]));
        let keys = vec![b"a".to_vec(), b"bb".to_vec(), vec![b'c'; 1024]];
        let body = encode_batch_exist(&geo(), &keys);
        let (g, got) = decode_batch_exist(&body).unwrap();
        assert_eq!(g, geo());
        assert_eq!(got, keys.iter().map(|k| k.as_slice()).collect::<Vec<_>>());
        let st = vec![Status::Ok, Status::Miss, Status::Mismatch];
        assert_eq!(decode_batch_status(&encode_batch_status(&st)).unwrap(), st);
        let mut flagged = encode_batch_status(&st);
        flagged[4] |= EXIST_FLAGS_MASK;
        assert_eq!(decode_batch_status(&flagged).unwrap(), st, "a per-key flag is read past");
        assert!(decode_batch_exist(&body[..body.len() - 1]).is_err());
        assert!(KeyRequest::decode(&body[..GEOMETRY_WIRE_LEN]).is_err());
    }

    #[test]
    fn batch_gets_round_trip_and_lies_are_refused() {
        let long = vec![b'c'; MAX_KEY_LEN];
        let items = [
            BatchItem { flags: 0, key: b"a", segs: &[], spread: 0 },
            BatchItem { flags: ITEM_HANDOFF | ITEM_HOT, key: b"bb", segs: &[], spread: 7 },
            BatchItem { flags: 0, key: &long, segs: &[], spread: 0 },
        ];
        let body = encode_batch_get(&geo(), &items);
        // The hot item's spread is its head's second byte.
        let second = BATCH_GET_HEAD + 4 + 1;
        assert_eq!(&body[second..second + 2], &[ITEM_HANDOFF | ITEM_HOT, 7]);
        assert_eq!(body.len(), BATCH_GET_HEAD + 3 * 4 + 1 + 2 + MAX_KEY_LEN);
        assert_eq!(&body[GEOMETRY_WIRE_LEN..BATCH_GET_HEAD + 4], &[3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        let (g, got) = decode_batch_get(&body).unwrap();
        assert_eq!((g, got.as_slice()), (geo(), &items[..]));
        for cut in 1..body.len() {
            assert!(decode_batch_get(&body[..body.len() - cut]).is_err(), "cut {cut}");
        }
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(decode_batch_get(&trailing).is_err(), "trailing bytes");
        assert!(decode_batch_get(&encode_batch_get(&geo(), &[])).is_err(), "an empty batch");
        let mut zero_key = encode_batch_get(&geo(), &items[..1]);
        zero_key[BATCH_GET_HEAD + 2] = 0;
        assert!(decode_batch_get(&zero_key[..BATCH_GET_HEAD + 4]).is_err(), "a key of 0 bytes");
        let mut lie = body.clone();
        lie[GEOMETRY_WIRE_LEN..GEOMETRY_WIRE_LEN + 4].copy_from_slice(&(MAX_BATCH_ITEMS as u32 + 1).to_le_bytes());
        assert!(decode_batch_get(&lie).is_err(), "more items than allowed");
        let h = ItemHead { status: Status::TooSmall, flags: 0, spread: 0, len: 0x0102_0304 };
        assert_eq!(h.encode(), [4, 0, 0, 0, 4, 3, 2, 1]);
        assert_eq!(ItemHead::decode(&h.encode()), h);
        assert_eq!(decode_batch_answer_head(&encode_batch_answer_head(17)), 17);
        let over = ReqHeader { op: Op::BatchGet, flags: 0, copy_age: 0, body_len: MAX_BATCH_GET_BODY + 1, req_id: 1 };
        assert!(ReqHeader::decode(&over.encode(), &Limits::default()).is_err(), "a body over the op's limit");
    }

    #[test]
    fn batch_items_naming_segments_round_trip_and_bad_lists_are_refused() {
        let mut list = Vec::new();
        encode_segments(
            &[Segment { addr: 0x1000, rkey: 7, len: 4096 }, Segment { addr: 0x9000, rkey: 7, len: 12 }],
            &mut list,
        );
        let items = [
            BatchItem { flags: ITEM_RDMA, key: b"a", segs: &list, spread: 0 },
            BatchItem { flags: 0, key: b"bb", segs: &[], spread: 0 },
            BatchItem { flags: ITEM_RDMA | ITEM_HANDOFF, key: b"c", segs: &list, spread: 0 },
        ];
        let body = encode_batch_get(&geo(), &items);
        assert_eq!(body.len(), BATCH_GET_HEAD + 3 * 4 + 4 + 2 * list.len());
        let (_, got) = decode_batch_get(&body).unwrap();
        assert_eq!(got, items);
        assert_eq!(got[0].segments().len(), 2);
        assert!(got[1].segments().is_empty());
        for cut in 1..body.len() {
            assert!(decode_batch_get(&body[..body.len() - cut]).is_err(), "cut {cut}");
        }
        // A list of 0 or more than MAX_ITEM_SEGMENTS segments, an empty one.
        let mut none = Vec::new();
        encode_segments(&[], &mut none);
        let mut many = Vec::new();
        encode_segments(&vec![Segment { addr: 1, rkey: 1, len: 1 }; MAX_ITEM_SEGMENTS + 1], &mut many);
        let mut empty = Vec::new();
        encode_segments(&[Segment { addr: 1, rkey: 1, len: 0 }], &mut empty);
        for bad in [&none, &many, &empty] {
            let body = encode_batch_get(&geo(), &[BatchItem { flags: ITEM_RDMA, key: b"a", segs: bad, spread: 0 }]);
            assert!(decode_batch_get(&body).is_err());
        }
        // A batch delete never carries a list: the bit is ignored there.
        let del = encode_batch_delete(&[BatchItem { flags: ITEM_RDMA, key: b"a", segs: &[], spread: 0 }]);
        assert_eq!(decode_batch_delete(&del).unwrap()[0].key, b"a");

        let h = crate::page::PageHeader::new(geo(), b"k", 4108, 0);
        let mut rest = b"k".to_vec();
        rest.extend_from_slice(&list);
        assert_eq!(remote_put_segments(&h, &rest, MAX_ITEM_SEGMENTS).unwrap().len(), 2);
        assert!(remote_put_segments(&h, &rest, 1).is_err(), "over the item's limit");
        let short = crate::page::PageHeader::new(geo(), b"k", 4107, 0);
        assert!(remote_put_segments(&short, &rest, MAX_ITEM_SEGMENTS).is_err(), "lengths that do not add up");
        assert!(remote_put_segments(&h, &rest[..rest.len() - 1], MAX_ITEM_SEGMENTS).is_err());
    }

    #[test]
    fn batch_writes_round_trip_and_lies_are_refused() {
        let (r0, r1) = (crate::page::build_record(geo(), b"k0", b"zero"), vec![9u8; 70]);
        let items = [
            (PutItemHead { flags: 0, copy_age: 0, record_len: r0.len() as u32 }, &r0[..]),
            (PutItemHead { flags: ITEM_HANDOFF, copy_age: 0x8001, record_len: 70 }, &r1[..]),
        ];
        let body = encode_batch_put(&items);
        assert_eq!(body.len(), BATCH_HEAD + 2 * BATCH_ITEM_HEAD + r0.len() + 70);
        assert_eq!(&body[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&body[8 + 8 + r0.len()..8 + 16 + r0.len()], &[1, 0, 1, 0x80, 70, 0, 0, 0]);
        assert_eq!(decode_batch_put(&body).unwrap(), items);
        for cut in 1..body.len() {
            assert!(decode_batch_put(&body[..body.len() - cut]).is_err(), "cut {cut}");
        }
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(decode_batch_put(&trailing).is_err(), "trailing bytes");
        assert!(decode_batch_put(&encode_batch_put(&[])).is_err(), "an empty batch");
        let mut lie = body.clone();
        lie[..4].copy_from_slice(&(MAX_BATCH_ITEMS as u32 + 1).to_le_bytes());
        assert!(decode_batch_put(&lie).is_err(), "more items than allowed");
        assert_eq!(batch_count(&[0, 4, 0, 0, 0, 0, 0, 0]), Some(1024));
        assert_eq!(batch_count(&[1, 4, 0, 0, 0, 0, 0, 0]), None);

        let keys = [
            BatchItem { flags: 0, key: b"a", segs: &[], spread: 0 },
            BatchItem { flags: 0, key: b"bb", segs: &[], spread: 0 },
        ];
        let del = encode_batch_delete(&keys);
        assert_eq!(del, [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, b'a', 0, 0, 2, 0, b'b', b'b']);
        assert_eq!(decode_batch_delete(&del).unwrap(), keys);
        assert!(decode_batch_delete(&del[..del.len() - 1]).is_err());

        let answer = [
            (ItemHead { status: Status::Ok, flags: ITEM_DUPLICATE, spread: 0, len: 0 }, &b""[..]),
            (ItemHead { status: Status::Rejected, flags: 0, spread: 0, len: 4 }, &b"full"[..]),
        ];
        let a = encode_batch_answer(&answer);
        assert_eq!(decode_batch_answer(&a, 2).unwrap(), answer);
        assert!(decode_batch_answer(&a, 3).is_err(), "the wrong count");
        assert!(decode_batch_answer(&a[..a.len() - 1], 2).is_err(), "a message cut short");
        for (op, max) in [(Op::BatchPut, MAX_BATCH_PUT_BODY), (Op::BatchDelete, MAX_BATCH_DELETE_BODY)] {
            let ok = ReqHeader { op, flags: 0, copy_age: 0, body_len: max, req_id: 1 };
            assert!(ReqHeader::decode(&ok.encode(), &Limits::default()).is_ok());
            let over = ReqHeader { body_len: max + 1, ..ok };
            assert!(ReqHeader::decode(&over.encode(), &Limits::default()).is_err(), "{op:?} over its limit");
        }
    }

    #[test]
    fn a_v3_hello_has_room_for_a_tenant_and_older_ones_keep_their_zeros() {
        let named = Hello::decode(client_hello_for(3, Some(b"tok"), 0xABCD)[..HELLO_LEN].try_into().unwrap()).unwrap();
        assert_eq!(named.max_record, 0xABCD, "a tenant named in bytes 8..12");
        let acting = Hello { version: 3, status: HELLO_ACCEPTED_FOR_TENANT, max_record: 9 };
        assert_eq!(judge_hello(3, &acting), HelloVerdict::Accepted { max_record: 9 });
        let v3 = client_hello(3, Some(b"tok"));
        assert_eq!(&v3[..16], &[0x4b, 0x56, 0x43, 0x57, 3, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&v3[16..], b"tok");
        assert_eq!(client_hello(1, Some(b"tok")).len(), HELLO_LEN, "v1 carries no token");
        let mut h = [0u8; HELLO_LEN];
        h.copy_from_slice(&v3[..16]);
        assert_eq!(ClientHello::judge(&Hello::decode(&h).unwrap()), ClientHello::Speak { version: 3, token_len: 3 });
        // A v2 node refuses v3 naming v2: the client says hello again in v2.
        let refused = Hello { version: 2, status: HELLO_VERSION_REFUSED, max_record: 0 };
        assert_eq!(judge_hello(3, &refused), HelloVerdict::Retry(2));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let l = Limits::default();
            if bytes.len() >= FRAME_HEADER_LEN {
                let mut h = [0u8; FRAME_HEADER_LEN];
                h.copy_from_slice(&bytes[..FRAME_HEADER_LEN]);
                if let Ok(r) = ReqHeader::decode(&h, &l) {
                    prop_assert!(r.body_len as u64 <= l.max_record.max(MAX_BATCH_BODY as u64));
                }
                let _ = RspHeader::decode(&h);
                let _ = Hello::decode(&h);
            }
            let _ = KeyRequest::decode(&bytes);
            let _ = decode_key(&bytes);
            if let Ok((_, keys)) = decode_batch_exist(&bytes) {
                prop_assert!(keys.len() <= bytes.len() / 3);
            }
            let _ = decode_batch_status(&bytes);
            if let Ok((_, items)) = decode_batch_get(&bytes) {
                prop_assert!(items.len() <= bytes.len() / 5);
            }
            if let Ok(items) = decode_batch_put(&bytes) {
                prop_assert!(items.len() <= bytes.len() / BATCH_ITEM_HEAD);
            }
            if let Ok(items) = decode_batch_delete(&bytes) {
                prop_assert!(items.len() <= bytes.len() / 5);
            }
            for n in [1, 2, 7] {
                if let Ok(items) = decode_batch_answer(&bytes, n) {
                    prop_assert_eq!(items.len(), n);
                }
            }
            let _ = crate::page::parse_record(&bytes);
        }

        #[test]
        fn truncated_batches_are_refused(n in 1usize..20, cut in 1usize..64) {
            let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("key-{i}").into_bytes()).collect();
            let body = encode_batch_exist(&geo(), &keys);
            let cut = cut.min(body.len());
            prop_assert!(decode_batch_exist(&body[..body.len() - cut]).is_err());
        }
    }

    #[test]
    fn segments_are_checked() {
        let segs = [Segment { addr: 0x7f00_0000_0000, rkey: 9, len: 4096 }, Segment { addr: 1, rkey: 2, len: 3 }];
        let mut b = Vec::new();
        encode_segments(&segs, &mut b);
        assert_eq!(b.len(), 2 + 32);
        assert_eq!(decode_segments(&b).unwrap(), segs);
        assert!(decode_segments(&b[..b.len() - 1]).is_err());
        assert!(decode_segments(&[0, 0]).is_err());
        let mut wrap = Vec::new();
        encode_segments(&[Segment { addr: u64::MAX, rkey: 1, len: 2 }], &mut wrap);
        assert!(decode_segments(&wrap).is_err());
        let mut with_tail = b.clone();
        with_tail.extend_from_slice(b"key");
        let (s, rest) = split_segments(&with_tail).unwrap();
        assert_eq!((s.as_slice(), rest), (&segs[..], &b"key"[..]));
        assert!(split_segments(&b[..20]).is_err());
        let mut empty = Vec::new();
        encode_segments(&[Segment { addr: 1, rkey: 1, len: 0 }], &mut empty);
        assert!(decode_segments(&empty).is_err());
    }
}
