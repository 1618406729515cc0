//! Request/response exchanges on one connection. A get reads the payload
//! from the socket straight into the caller's buffers, in order, and folds
//! each chunk into the CRC as it lands (no page-sized buffer, no second pass).

use std::io::IoSlice;

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, ReqHeader, RspHeader, FLAG_CHECK_GEOMETRY, FRAME_HEADER_LEN};
use kv_common::wire::{encode_segments, Segment, MAX_SEGMENTS};
use kv_common::wire::{FLAG_RDMA, RSP_FLAG_RDMA, RSP_FLAG_RDMA_FAILED};
use kv_rdma::engine::{PeerAccess, Registration};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::OpError;
use crate::node::AsyncConn;

/// Largest error/answer body read into memory (anything else is a record).
pub(crate) const MAX_SMALL_ANSWER: u32 = 1 << 20;

/// Payloads smaller than this go inline even on a connection with a queue
/// pair: a small record costs less over TCP than a registration lookup and
/// a remote write.
pub const RDMA_MIN_PAYLOAD: usize = 16 << 10;

/// Names buffers `(address, length)` as segments of the connection's queue
/// pair for the node to `access` (a put's are only read, so read-only
/// memory can be sent), registering them as needed (cached). None: this
/// request goes over TCP (no queue pair, a small payload, or a registration
/// that failed).
fn rdma_segments(
    conn: &AsyncConn,
    bufs: &[(usize, usize)],
    access: PeerAccess,
) -> Option<(Vec<Segment>, Vec<Registration>)> {
    let link = conn.rdma.as_ref()?;
    let total: usize = bufs.iter().map(|b| b.1).sum();
    if total < RDMA_MIN_PAYLOAD || bufs.len() > MAX_SEGMENTS {
        return None;
    }
    let rt = link.runtime();
    let mut segs = Vec::with_capacity(bufs.len());
    let mut regs = Vec::with_capacity(bufs.len());
    for &(addr, len) in bufs.iter().filter(|b| b.1 > 0) {
        let (s, r) = rt.segment_for(link.rail(), addr, len, access).ok()?;
        segs.push(s);
        regs.push(r);
    }
    Some((segs, regs))
}

/// A payload moved by RDMA failed its check: a cached registration may be
/// stale (the caller freed a buffer and new memory was mapped at the same
/// address, so the device used the old pages). Forget the cached ones for
/// these buffers; the retry, inline, and later requests use the memory
/// there now. Pinned regions (`kv_register_memory`) are the caller's word.
fn forget_registrations(rt: Option<&std::sync::Arc<kv_rdma::engine::Runtime>>, ranges: &[(usize, usize)]) {
    if let Some(rt) = rt {
        for &(a, l) in ranges {
            rt.invalidate(a, l);
        }
    }
}

fn ranges_mut(bufs: &mut [&mut [u8]]) -> Vec<(usize, usize)> {
    bufs.iter_mut().map(|b| (b.as_mut_ptr() as usize, b.len())).collect()
}

/// The answer to a GET that asked for RDMA: with RSP_FLAG_RDMA the payload
/// is in the caller's buffers and the body holds the header and key, which
/// are checked as over TCP, and then the payload's CRC over the buffers.
/// An answer without it came inline (the node's queue pair is gone): read
/// as over TCP, and this connection stops asking.
async fn finish_rdma_get(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<GetReply, OpError> {
    let placed = h.flags & RSP_FLAG_RDMA != 0;
    if !placed && h.status != Status::TooSmall {
        if h.status == Status::Ok {
            conn.rdma = None;
        }
        return read_get_body(conn, geo, key, bufs, h).await;
    }
    let body = recv_small(conn, h).await?;
    let done = |status, len| Ok(GetReply { status, len });
    let Ok(ph) = PageHeader::decode(&body) else { return done(Status::Corrupt, 0) };
    if body.len() != HEADER_LEN + key.len()
        || ph.key_len as usize != key.len()
        || ph.check_key(key).is_err()
        || &body[HEADER_LEN..] != key
        || !geo.matches(&ph)
    {
        return done(Status::Mismatch, 0);
    }
    let need = ph.payload_len as usize;
    if !placed {
        return done(Status::TooSmall, need);
    }
    if need > bufs.iter().map(|b| b.len()).sum::<usize>() {
        return done(Status::Corrupt, 0);
    }
    // The device wrote the buffers before the node answered; order this
    // thread's reads after that answer.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    let mut crc = crc32fast::Hasher::new();
    let mut left = need;
    for b in bufs.iter() {
        let take = b.len().min(left);
        crc.update(&b[..take]);
        left -= take;
    }
    if crc.finalize() != ph.payload_crc {
        return done(Status::Corrupt, 0);
    }
    done(Status::Ok, need)
}

/// What a get produced.
#[derive(Debug)]
pub struct GetReply {
    /// Ok, or why not served.
    pub status: Status,
    /// Payload bytes written (Ok), or the size needed (TooSmall).
    pub len: usize,
}

async fn write_all_vectored(conn: &mut AsyncConn, parts: &[&[u8]]) -> Result<(), OpError> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)).collect();
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = conn.stream.write_vectored(rest).await?;
        if n == 0 {
            return Err(OpError::Io(std::io::ErrorKind::WriteZero.into()));
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

async fn send(conn: &mut AsyncConn, op: Op, flags: u8, body: &[&[u8]]) -> Result<u64, OpError> {
    let len: usize = body.iter().map(|b| b.len()).sum();
    let req_id = conn.next_id;
    conn.next_id += 1;
    let h = ReqHeader { op, flags, body_len: len as u32, req_id }.encode();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(body.len() + 1);
    parts.push(&h);
    parts.extend_from_slice(body);
    write_all_vectored(conn, &parts).await?;
    Ok(req_id)
}

async fn recv_header(conn: &mut AsyncConn, req_id: u64) -> Result<RspHeader, OpError> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    conn.stream.read_exact(&mut hb).await?;
    let h = RspHeader::decode(&hb);
    if h.req_id != req_id {
        return Err(OpError::Protocol(format!("answer to request {} while waiting for {req_id}", h.req_id)));
    }
    Ok(h)
}

async fn recv_small(conn: &mut AsyncConn, h: &RspHeader) -> Result<Vec<u8>, OpError> {
    if h.body_len > MAX_SMALL_ANSWER {
        return Err(OpError::Protocol(format!("unexpected {}-byte answer", h.body_len)));
    }
    let mut body = vec![0u8; h.body_len as usize];
    conn.stream.read_exact(&mut body).await?;
    Ok(body)
}

pub(crate) fn refused(status: Status, body: &[u8]) -> OpError {
    OpError::Node(status, String::from_utf8_lossy(body).into_owned())
}

/// `extra`: request flags beside the exchange's own (FLAG_HANDOFF).
pub async fn put(
    conn: &mut AsyncConn,
    header: &[u8; HEADER_LEN],
    key: &[u8],
    bufs: &[&[u8]],
    extra: u8,
) -> Result<(), OpError> {
    let payload: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let len = HEADER_LEN as u64 + key.len() as u64 + payload;
    if len > conn.max_record {
        return Err(OpError::Node(Status::Rejected, format!("record of {len} bytes over the node's limit")));
    }
    // A handoff copy comes from the client's own staging buffer: inline.
    if conn.rdma.is_some() && extra == 0 && put_rdma(conn, header, key, bufs).await? {
        return Ok(());
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(bufs.len() + 2);
    parts.push(header);
    parts.push(key);
    parts.extend_from_slice(bufs);
    let id = send(conn, Op::Put, extra, &parts).await?;
    let h = recv_header(conn, id).await?;
    let body = recv_small(conn, &h).await?;
    match h.status {
        Status::Ok => Ok(()),
        s => Err(refused(s, &body)),
    }
}

/// A put by RDMA: Ok(true) when stored, Ok(false) when it must go inline
/// (no segments, the node could not read them, or what it read failed the
/// CRC: a stale registration), Err as any put.
async fn put_rdma(
    conn: &mut AsyncConn,
    header: &[u8; HEADER_LEN],
    key: &[u8],
    bufs: &[&[u8]],
) -> Result<bool, OpError> {
    let ranges: Vec<(usize, usize)> = bufs.iter().map(|b| (b.as_ptr() as usize, b.len())).collect();
    if let Some((segs, regs)) = rdma_segments(conn, &ranges, PeerAccess::Reads) {
        let rt = conn.rdma.as_ref().map(|l| l.runtime().clone());
        // The node reads the payload from these buffers by RDMA READ.
        let mut tail = Vec::with_capacity(2 + segs.len() * 16);
        encode_segments(&segs, &mut tail);
        let id = send(conn, Op::Put, FLAG_RDMA, &[header, key, &tail]).await?;
        let h = recv_header(conn, id).await?;
        let body = recv_small(conn, &h).await?;
        drop(regs);
        match h.status {
            Status::Ok => return Ok(true),
            // The node could not read it: send it inline, on TCP from now on.
            Status::Unavailable if h.flags & RSP_FLAG_RDMA_FAILED != 0 => conn.rdma = None,
            // What the node read does not match the CRC computed over the
            // buffers: a stale registration, most likely. Send it inline.
            Status::Corrupt => forget_registrations(rt.as_ref(), &ranges),
            s => return Err(refused(s, &body)),
        }
    }
    Ok(false)
}

pub async fn get(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<GetReply, OpError> {
    if conn.rdma.is_some() {
        if let Some(r) = get_rdma(conn, geo, key, bufs, extra).await? {
            return Ok(r);
        }
    }
    get_inline(conn, geo, key, bufs, extra).await
}

/// A get by RDMA: None when it must go inline (no segments, or the payload
/// placed failed its CRC: a stale registration; then retried inline).
async fn get_rdma(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<Option<GetReply>, OpError> {
    let ranges = ranges_mut(bufs);
    if let Some((segs, regs)) = rdma_segments(conn, &ranges, PeerAccess::Writes) {
        let rt = conn.rdma.as_ref().map(|l| l.runtime().clone());
        let mut body = Vec::with_capacity(2 + segs.len() * 16 + 32 + key.len());
        encode_segments(&segs, &mut body);
        body.extend_from_slice(&KeyRequest::encode(geo, key));
        let id = send(conn, Op::Get, FLAG_CHECK_GEOMETRY | FLAG_RDMA | extra, &[&body]).await?;
        let h = recv_header(conn, id).await?;
        let r = finish_rdma_get(conn, geo, key, bufs, &h).await?;
        drop(regs);
        if r.status != Status::Corrupt || h.flags & RSP_FLAG_RDMA == 0 {
            return Ok(Some(r));
        }
        // The payload placed by RDMA failed its CRC (a stale registration,
        // most likely): once more, inline.
        forget_registrations(rt.as_ref(), &ranges);
    }
    Ok(None)
}

async fn get_inline(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<GetReply, OpError> {
    let req = KeyRequest::encode(geo, key);
    let id = send(conn, Op::Get, FLAG_CHECK_GEOMETRY | extra, &[&req]).await?;
    let h = recv_header(conn, id).await?;
    read_get_body(conn, geo, key, bufs, &h).await
}

pub async fn exist(conn: &mut AsyncConn, geo: &Geometry, key: &[u8]) -> Result<Status, OpError> {
    let req = KeyRequest::encode(geo, key);
    let id = send(conn, Op::Exist, FLAG_CHECK_GEOMETRY, &[&req]).await?;
    let h = recv_header(conn, id).await?;
    let body = recv_small(conn, &h).await?;
    match h.status {
        s @ (Status::Ok | Status::Miss | Status::Mismatch) => Ok(s),
        s => Err(refused(s, &body)),
    }
}

/// Removes `key` at this node: Ok or Miss (absent).
pub async fn delete(conn: &mut AsyncConn, key: &[u8]) -> Result<Status, OpError> {
    let id = send(conn, Op::Delete, 0, &[key]).await?;
    let h = recv_header(conn, id).await?;
    let body = recv_small(conn, &h).await?;
    match h.status {
        s @ (Status::Ok | Status::Miss) => Ok(s),
        s => Err(refused(s, &body)),
    }
}

pub async fn batch_exist(
    conn: &mut AsyncConn,
    geo: &Geometry,
    keys: &[&[u8]],
    extra: u8,
) -> Result<Vec<Status>, OpError> {
    let body = wire::encode_batch_exist(geo, keys);
    let id = send(conn, Op::BatchExist, FLAG_CHECK_GEOMETRY | extra, &[&body]).await?;
    let h = recv_header(conn, id).await?;
    let answer = recv_small(conn, &h).await?;
    if h.status != Status::Ok {
        return Err(refused(h.status, &answer));
    }
    let st = wire::decode_batch_status(&answer).map_err(|e| OpError::Protocol(e.to_string()))?;
    if st.len() != keys.len() {
        return Err(OpError::Protocol("batch answer has the wrong count".into()));
    }
    Ok(st)
}

/// Reads and discards `n` bytes (to keep a pipelined connection in step).
async fn drain(conn: &mut AsyncConn, mut n: u64) -> Result<(), OpError> {
    let mut sink = [0u8; 8192];
    while n > 0 {
        let k = n.min(sink.len() as u64) as usize;
        conn.stream.read_exact(&mut sink[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

/// Several gets on one connection: all requests are written, then the
/// answers read in whatever order the node sends them, each scattered into
/// its own item's buffers (matched by request id) with its CRC checked as
/// it lands. Answers that are not served have their bodies drained, so the
/// connection stays usable. Returns one reply per item, in item order.
pub async fn get_pipelined(
    conn: &mut AsyncConn,
    geo: &Geometry,
    items: &mut [(&[u8], &mut [&mut [u8]])],
    extra: u8,
) -> Result<Vec<GetReply>, OpError> {
    let rt = conn.rdma.as_ref().map(|l| l.runtime().clone());
    let mut ids = Vec::with_capacity(items.len());
    let mut frames = Vec::new();
    // Registrations of the items sent by RDMA, held until all answers are in.
    let mut regs = Vec::new();
    // Which items go by RDMA (empty: none; no queue pair, no allocation).
    let mut by_rdma = if rt.is_some() { vec![false; items.len()] } else { Vec::new() };
    for (i, (key, bufs)) in items.iter_mut().enumerate() {
        let mut flags = FLAG_CHECK_GEOMETRY | extra;
        let segs = if rt.is_some() { rdma_segments(conn, &ranges_mut(bufs), PeerAccess::Writes) } else { None };
        let body = match segs {
            None => KeyRequest::encode(geo, key),
            Some((segs, r)) => {
                let mut body = Vec::with_capacity(2 + segs.len() * 16 + 32 + key.len());
                encode_segments(&segs, &mut body);
                body.extend_from_slice(&KeyRequest::encode(geo, key));
                regs.extend(r);
                flags |= FLAG_RDMA;
                by_rdma[i] = true;
                body
            }
        };
        let req_id = conn.next_id;
        conn.next_id += 1;
        frames.extend_from_slice(&ReqHeader { op: Op::Get, flags, body_len: body.len() as u32, req_id }.encode());
        frames.extend_from_slice(&body);
        ids.push(req_id);
    }
    conn.stream.write_all(&frames).await?;
    let mut replies: Vec<Option<GetReply>> = (0..items.len()).map(|_| None).collect();
    for _ in 0..items.len() {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        conn.stream.read_exact(&mut hb).await?;
        let h = RspHeader::decode(&hb);
        let Some(i) = ids.iter().position(|&id| id == h.req_id).filter(|&i| replies[i].is_none()) else {
            return Err(OpError::Protocol(format!("unexpected answer id {}", h.req_id)));
        };
        let (key, bufs) = &mut items[i];
        replies[i] = Some(if by_rdma.get(i) == Some(&true) {
            let r = finish_rdma_get(conn, geo, key, bufs, &h).await?;
            // Placed by RDMA but failing its CRC: retried inline below.
            by_rdma[i] = r.status == Status::Corrupt && h.flags & RSP_FLAG_RDMA != 0;
            r
        } else {
            read_get_body(conn, geo, key, bufs, &h).await?
        });
    }
    drop(regs);
    if by_rdma.iter().any(|&b| b) {
        for (i, (key, bufs)) in items.iter_mut().enumerate().filter(|(i, _)| by_rdma[*i]) {
            forget_registrations(rt.as_ref(), &ranges_mut(bufs));
            replies[i] = Some(get_inline(conn, geo, key, bufs, extra).await?);
        }
    }
    Ok(replies.into_iter().map(|r| r.expect("every id answered")).collect())
}

/// The body of one GET answer, leaving the connection at the next frame.
/// Checks the page header and key that open a get's answer of `body_len`
/// bytes (`hk`: the header, then as many bytes as `key` has) against what
/// was asked: Ok(header) when its payload fits in `cap` bytes, else the
/// reply the item gets (the caller drains the rest of the body).
pub(crate) fn check_get_head(
    geo: &Geometry,
    key: &[u8],
    body_len: u64,
    hk: &[u8],
    cap: usize,
) -> Result<PageHeader, GetReply> {
    let no = |status, len| Err(GetReply { status, len });
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(&hk[..HEADER_LEN]);
    let ph = match PageHeader::decode(&hb) {
        Ok(ph) if ph.record_len() == body_len => ph,
        _ => return no(Status::Corrupt, 0),
    };
    if ph.key_len as usize != key.len() || ph.check_key(key).is_err() || !geo.matches(&ph) || &hk[HEADER_LEN..] != key {
        return no(Status::Mismatch, 0);
    }
    if ph.payload_len as usize > cap {
        return no(Status::TooSmall, ph.payload_len as usize);
    }
    Ok(ph)
}

async fn read_get_body(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<GetReply, OpError> {
    let done = |status, len| Ok(GetReply { status, len });
    if h.status != Status::Ok {
        let body = recv_small(conn, h).await?;
        return match h.status {
            Status::Miss | Status::Mismatch => done(h.status, 0),
            // The answer was read whole: this item alone is not served (a
            // node's internal failure reads as unavailable, never negative).
            s => done(refused(s, &body).status(), 0),
        };
    }
    let body_len = h.body_len as u64;
    let head = HEADER_LEN + key.len();
    if body_len < head as u64 {
        drain(conn, body_len).await?;
        return done(Status::Corrupt, 0);
    }
    // The page header and the key in one read (the key's length is the
    // one asked for; a body at least that long holds both).
    let mut hk = [0u8; HEADER_LEN + kv_common::page::MAX_KEY_LEN];
    conn.stream.read_exact(&mut hk[..head]).await?;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    let ph = match check_get_head(geo, key, body_len, &hk[..head], cap) {
        Ok(ph) => ph,
        Err(r) => {
            drain(conn, body_len - head as u64).await?;
            return Ok(r);
        }
    };
    let need = ph.payload_len as usize;
    let mut crc = crc32fast::Hasher::new();
    let mut left = need;
    for seg in bufs.iter_mut() {
        if left == 0 {
            break;
        }
        let take = seg.len().min(left);
        let dst = &mut seg[..take];
        let mut filled = 0;
        while filled < take {
            let n = conn.stream.read(&mut dst[filled..]).await?;
            if n == 0 {
                return Err(OpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            crc.update(&dst[filled..filled + n]);
            filled += n;
        }
        left -= take;
    }
    if crc.finalize() != ph.payload_crc {
        return done(Status::Corrupt, 0);
    }
    done(Status::Ok, need)
}
