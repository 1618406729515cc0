//! The payload's way when it does not travel inline in its frame
//! (docs/ARCHITECTURE.md, "Transports"): the client's side of the node's
//! `server/src/transport.rs`. Over TCP a put's payload follows its header
//! in the frame and a get's record is the answer's body (exchange.rs, with
//! nothing from here). A connection that reaches the node's memory holds a
//! `remote::RemoteMemory` (RDMA: rdma.rs's `Remote`), used through one call:
//! name these buffers for the node to read (a put) or write (a get). The
//! names go in the frame (`kv_common::wire::Segment`, FLAG_RDMA); the node
//! moves the payload and answers over TCP. Whatever goes wrong on the way
//! (no names, a node that could not move it, a payload that fails its CRC)
//! ends in the same request sent inline, so a transport can only make a
//! request faster, never change what it returns.

use kv_common::driver::Socket;
use kv_common::page::{Geometry, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{KeyRequest, Op, RspHeader, FLAG_CHECK_GEOMETRY};
use kv_common::wire::{FLAG_RDMA, RSP_FLAG_RDMA, RSP_FLAG_RDMA_FAILED};

use crate::answer::{check_placed, check_placed_head, read_get_body, GetReply, MAX_SMALL_ANSWER};
use crate::conn::Conn;
use crate::error::OpError;
use crate::remote::{Access, Named};

/// Bytes of an answer read with its frame header when they came with it.
const SMALL_AHEAD: usize = 256;

pub(crate) fn ranges_mut(bufs: &mut [&mut [u8]]) -> Vec<(usize, usize)> {
    bufs.iter_mut().map(|b| (b.as_mut_ptr() as usize, b.len())).collect()
}

/// The caller's buffers named for the node to fill or read by the
/// connection's remote memory, if it has one and they qualify (else the
/// payload goes inline).
pub(crate) fn named<S>(conn: &Conn<S>, ranges: Vec<(usize, usize)>, access: Access) -> Option<Box<dyn Named>> {
    conn.remote.as_ref()?.name(ranges, access)
}

/// The answer to a GET that asked for RDMA: with RSP_FLAG_RDMA the payload
/// is in the caller's buffers and the body holds the header and key, which
/// are checked as over TCP, and then the payload's CRC over the buffers.
/// An answer without it came inline (the node's remote memory is gone):
/// read as over TCP, and this connection stops naming buffers. True beside
/// the reply when a payload placed failed its CRC: the names are stale and
/// the get is to go again inline.
pub(crate) async fn finish_get<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<(GetReply, bool), OpError> {
    let placed = h.flags & RSP_FLAG_RDMA != 0;
    if !placed && h.status != Status::TooSmall {
        if h.status == Status::Ok {
            conn.remote = None;
        }
        return Ok((read_get_body(conn, geo, key, bufs, h).await?, false));
    }
    let body = conn.answer_body(h, MAX_SMALL_ANSWER).await?;
    let ph = match check_placed_head(geo, key, &body) {
        Ok(ph) => ph,
        Err(r) => return Ok((r, false)),
    };
    if !placed {
        return Ok((GetReply { status: Status::TooSmall, len: ph.payload_len as usize, spread: 0 }, false));
    }
    // A corrupt payload placed remotely: the names may be stale.
    let mut r = check_placed(bufs, &ph);
    let stale = r.status == Status::Corrupt;
    if r.status == Status::Ok {
        r.spread = kv_common::wire::spread_of_flags(h.flags);
    }
    Ok((r, stale))
}

/// A put by RDMA: Ok(true) when stored, Ok(false) when it must go inline
/// (no segments, the node could not read them, or what it read failed the
/// CRC: a stale registration), Err as any put.
pub(crate) async fn put<S: Socket>(
    conn: &mut Conn<S>,
    header: &[u8; HEADER_LEN],
    key: &[u8],
    bufs: &[&[u8]],
) -> Result<bool, OpError> {
    let ranges: Vec<(usize, usize)> = bufs.iter().map(|b| (b.as_ptr() as usize, b.len())).collect();
    if let Some(named) = named(conn, ranges, Access::NodeReads) {
        // The node reads the payload from these buffers by RDMA READ.
        let mut tail = Vec::new();
        named.encode(&mut tail);
        let id = conn.request(Op::Put, FLAG_RDMA, 0, &[header, key, &tail]).await?;
        let h = conn.answer(id, SMALL_AHEAD).await?;
        let body = conn.answer_body(&h, MAX_SMALL_ANSWER).await?;
        match h.status {
            Status::Ok => return Ok(true),
            // The node could not read it: send it inline, on TCP from now on.
            Status::Unavailable if h.flags & RSP_FLAG_RDMA_FAILED != 0 => conn.remote = None,
            // What the node read does not match the CRC computed over the
            // buffers: a stale registration, most likely. Send it inline.
            Status::Corrupt => named.stale(),
            s => return Err(OpError::refused(s, &body)),
        }
    }
    Ok(false)
}

/// A get by RDMA: None when it must go inline (no segments, or the payload
/// placed failed its CRC: a stale registration; then retried inline).
pub(crate) async fn get<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
    weight: u8,
) -> Result<Option<GetReply>, OpError> {
    let Some((flags, body, named)) = get_request(conn, geo, key, bufs, extra) else { return Ok(None) };
    let id = conn.request(Op::Get, flags, u16::from(weight), &[&body]).await?;
    let h = conn.answer(id, HEADER_LEN + key.len()).await?;
    let (r, again) = finish_get(conn, geo, key, bufs, &h).await?;
    if !again {
        return Ok(Some(r));
    }
    // The payload placed failed its CRC (a stale registration, most
    // likely): once more, inline.
    named.stale();
    Ok(None)
}

/// A GET naming `bufs` for the node to write the payload into: its flags,
/// its body and the names (held until the answer is in). None: this get
/// goes inline (no remote memory, or the buffers do not qualify).
pub(crate) fn get_request<S>(
    conn: &Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Option<(u8, Vec<u8>, Box<dyn Named>)> {
    let named = named(conn, ranges_mut(bufs), Access::NodeWrites)?;
    let mut body = Vec::new();
    named.encode(&mut body);
    body.extend_from_slice(&KeyRequest::encode(geo, key));
    Some((FLAG_CHECK_GEOMETRY | FLAG_RDMA | extra, body, named))
}
