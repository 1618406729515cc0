//! Request/response exchanges on one connection. A get reads the payload
//! from the socket straight into the caller's buffers, in order, and folds
//! each chunk into the CRC as it lands (no page-sized buffer, no second pass).

use std::io::IoSlice;

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, ReqHeader, RspHeader, FLAG_CHECK_GEOMETRY, FRAME_HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::OpError;
use crate::node::AsyncConn;

/// Largest error/answer body read into memory (anything else is a record).
const MAX_SMALL_ANSWER: u32 = 1 << 20;

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

fn refused(status: Status, body: &[u8]) -> OpError {
    OpError::Node(status, String::from_utf8_lossy(body).into_owned())
}

pub async fn put(conn: &mut AsyncConn, header: &[u8; HEADER_LEN], key: &[u8], bufs: &[&[u8]]) -> Result<(), OpError> {
    let payload: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let len = HEADER_LEN as u64 + key.len() as u64 + payload;
    if len > conn.max_record {
        return Err(OpError::Node(Status::Rejected, format!("record of {len} bytes over the node's limit")));
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(bufs.len() + 2);
    parts.push(header);
    parts.push(key);
    parts.extend_from_slice(bufs);
    let id = send(conn, Op::Put, 0, &parts).await?;
    let h = recv_header(conn, id).await?;
    let body = recv_small(conn, &h).await?;
    match h.status {
        Status::Ok => Ok(()),
        s => Err(refused(s, &body)),
    }
}

pub async fn get(
    conn: &mut AsyncConn,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
) -> Result<GetReply, OpError> {
    let req = KeyRequest::encode(geo, key);
    let id = send(conn, Op::Get, FLAG_CHECK_GEOMETRY, &[&req]).await?;
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

pub async fn batch_exist(conn: &mut AsyncConn, geo: &Geometry, keys: &[&[u8]]) -> Result<Vec<Status>, OpError> {
    let body = wire::encode_batch_exist(geo, keys);
    let id = send(conn, Op::BatchExist, FLAG_CHECK_GEOMETRY, &[&body]).await?;
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
) -> Result<Vec<GetReply>, OpError> {
    let mut ids = Vec::with_capacity(items.len());
    let mut frames = Vec::new();
    for (key, _) in items.iter() {
        let body = KeyRequest::encode(geo, key);
        let req_id = conn.next_id;
        conn.next_id += 1;
        frames.extend_from_slice(
            &ReqHeader { op: Op::Get, flags: FLAG_CHECK_GEOMETRY, body_len: body.len() as u32, req_id }.encode(),
        );
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
        replies[i] = Some(read_get_body(conn, geo, key, bufs, &h).await?);
    }
    Ok(replies.into_iter().map(|r| r.expect("every id answered")).collect())
}

/// The body of one GET answer, leaving the connection at the next frame.
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
    if body_len < (HEADER_LEN + key.len()) as u64 {
        drain(conn, body_len).await?;
        return done(Status::Corrupt, 0);
    }
    let mut hb = [0u8; HEADER_LEN];
    conn.stream.read_exact(&mut hb).await?;
    let rest = body_len - HEADER_LEN as u64;
    let ph = match PageHeader::decode(&hb) {
        Ok(ph) if ph.record_len() == body_len => ph,
        _ => {
            drain(conn, rest).await?;
            return done(Status::Corrupt, 0);
        }
    };
    if ph.key_len as usize != key.len() || ph.check_key(key).is_err() || !geo.matches(&ph) {
        drain(conn, rest).await?;
        return done(Status::Mismatch, 0);
    }
    let need = ph.payload_len as usize;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    if need > cap {
        drain(conn, rest).await?;
        return done(Status::TooSmall, need);
    }
    let mut kb = [0u8; kv_common::page::MAX_KEY_LEN];
    let kb = &mut kb[..key.len()];
    conn.stream.read_exact(kb).await?;
    if kb != key {
        drain(conn, need as u64).await?;
        return done(Status::Mismatch, 0);
    }
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
