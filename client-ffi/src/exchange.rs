//! Request/response exchanges on one connection, written once for either
//! socket (conn.rs): the async core awaits them, the caller-thread path and
//! the tools run them with `kv_common::driver::block_on`. A get reads the
//! payload from the socket straight into the caller's buffers, in order,
//! and folds each chunk into the CRC as it lands (no page-sized buffer, no
//! second pass).

use kv_common::driver::{self, Socket};
use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, RspHeader, FLAG_CHECK_GEOMETRY};
use kv_common::wire::{BatchItem, ItemHead, BATCH_ITEM_HEAD, MAX_BATCH_ANSWER, MAX_BATCH_ITEMS};
use kv_common::wire::{PutItemHead, MAX_BATCH_PUT_RECORDS};
use kv_common::wire::{FLAG_RDMA, RSP_FLAG_DUPLICATE, RSP_FLAG_RDMA, RSP_FLAG_RDMA_FAILED};

use crate::conn::Conn;
use crate::error::OpError;
use crate::rdma::{Access, Named};

/// Largest error/answer body read into memory (anything else is a record).
pub(crate) const MAX_SMALL_ANSWER: u32 = 1 << 20;

fn ranges_mut(bufs: &mut [&mut [u8]]) -> Vec<(usize, usize)> {
    bufs.iter_mut().map(|b| (b.as_mut_ptr() as usize, b.len())).collect()
}

/// The caller's buffers named for the node to fill or read by the
/// connection's remote transport, if it has one and they qualify (else
/// the payload goes inline).
fn named<S>(conn: &Conn<S>, ranges: Vec<(usize, usize)>, access: Access) -> Option<Named> {
    conn.remote.as_ref()?.name(ranges, access)
}

/// The answer to a GET that asked for RDMA: with RSP_FLAG_RDMA the payload
/// is in the caller's buffers and the body holds the header and key, which
/// are checked as over TCP, and then the payload's CRC over the buffers.
/// An answer without it came inline (the node's queue pair is gone): read
/// as over TCP, and this connection stops asking.
async fn finish_remote_get<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<GetReply, OpError> {
    let placed = h.flags & RSP_FLAG_RDMA != 0;
    if !placed && h.status != Status::TooSmall {
        if h.status == Status::Ok {
            conn.remote = None;
        }
        return read_get_body(conn, geo, key, bufs, h).await;
    }
    let body = conn.answer_body(h, MAX_SMALL_ANSWER).await?;
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
    if !PayloadSink::new(bufs, need).placed(ph.payload_crc) {
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

/// Bytes of an answer read with its frame header when they came with it:
/// a short answer's whole body (a status line, an exist's statuses).
const SMALL_AHEAD: usize = 256;

/// `extra`: request flags beside the exchange's own (FLAG_HANDOFF);
/// `copy_age`: with FLAG_HANDOFF, the copy's age as the header carries it
/// (`kv_common::wire::encode_copy_age`, docs/PROTOCOL.md §2.9), else 0.
/// Ok(true) when newly stored, Ok(false) when the key was there (write-once).
pub async fn put<S: Socket>(
    conn: &mut Conn<S>,
    header: &[u8; HEADER_LEN],
    key: &[u8],
    bufs: &[&[u8]],
    extra: u8,
    copy_age: u16,
) -> Result<bool, OpError> {
    // A handoff copy comes from the client's own staging buffer: inline.
    if conn.remote.is_some() && extra == 0 {
        let payload: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        over_limit(conn, HEADER_LEN as u64 + key.len() as u64 + payload)?;
        if put_remote(conn, header, key, bufs).await? {
            return Ok(true);
        }
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(bufs.len() + 2);
    parts.push(header);
    parts.push(key);
    parts.extend_from_slice(bufs);
    put_record(conn, &parts, extra, copy_age).await
}

/// Refuses here a record the node would close the connection on.
fn over_limit<S: Socket>(conn: &Conn<S>, len: u64) -> Result<(), OpError> {
    if len > conn.max_record() {
        let why = format!("record of {len} bytes exceeds the node's limit of {}", conn.max_record());
        return Err(OpError::Node(Status::Rejected, why));
    }
    Ok(())
}

/// A PUT of a record given as parts (header, key, payload pieces), sent
/// without joining them: Ok(true) when newly stored, Ok(false) when the key
/// was there.
pub(crate) async fn put_record<S: Socket>(
    conn: &mut Conn<S>,
    parts: &[&[u8]],
    extra: u8,
    copy_age: u16,
) -> Result<bool, OpError> {
    over_limit(conn, parts.iter().map(|p| p.len() as u64).sum())?;
    let id = conn.request(Op::Put, extra, copy_age, parts).await?;
    let h = conn.answer(id, SMALL_AHEAD).await?;
    let body = conn.answer_body(&h, MAX_SMALL_ANSWER).await?;
    match h.status {
        Status::Ok => Ok(h.flags & RSP_FLAG_DUPLICATE == 0),
        s => Err(OpError::refused(s, &body)),
    }
}

/// One item of a batch put: its record's header, its key and the pieces
/// of its payload.
pub struct PutItem<'b> {
    pub header: [u8; HEADER_LEN],
    pub key: &'b [u8],
    pub bufs: &'b [&'b [u8]],
}

impl PutItem<'_> {
    /// The record's length: header, key and payload.
    pub fn record_len(&self) -> u64 {
        (HEADER_LEN + self.key.len()) as u64 + self.bufs.iter().map(|b| b.len() as u64).sum::<u64>()
    }
}

/// Longest answer to a BATCH_PUT or BATCH_DELETE read into memory: 1024
/// item heads with messages (a node's are a line each).
const MAX_BATCH_WRITE_ANSWER: u32 = 4 << 20;

/// Puts on one connection as BATCH_PUT frames (a node that agreed on
/// protocol v4), one frame at a time: at most [`MAX_BATCH_ITEMS`] items
/// and [`MAX_BATCH_PUT_RECORDS`] bytes of records (or half the node's
/// `max_record`) a frame, written with vectored writes straight from the
/// caller's buffers, answered item by item. A record over the node's
/// `max_record` is refused here, as a single put refuses it; a record over
/// a frame's bound, or the items of a frame the node's memory budget
/// refused, go as PUTs of their own.
/// Per item: Ok, or the node's refusal. Err: the exchange failed (the
/// connection's bytes are in doubt).
pub async fn put_batch<S: Socket>(
    conn: &mut Conn<S>,
    items: &[PutItem<'_>],
) -> Result<Vec<Result<(), OpError>>, OpError> {
    let mut out: Vec<Option<Result<(), OpError>>> = (0..items.len()).map(|_| None).collect();
    // A frame's records stay within half the node's max_record too: a node
    // holds a whole frame within its --max-inflight budget, which is at
    // least max_record, and refuses a frame it cannot hold.
    let cap = MAX_BATCH_PUT_RECORDS.min(conn.max_record() / 2);
    let mut frames: Vec<Vec<usize>> = Vec::new();
    let (mut cur, mut bytes) = (Vec::new(), 0u64);
    let mut alone = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let len = it.record_len();
        if len > conn.max_record() {
            out[i] = Some(Err(OpError::Node(Status::Rejected, format!("record of {len} bytes over the node's limit"))));
            continue;
        }
        if len > cap {
            alone.push(i);
            continue;
        }
        if !cur.is_empty() && (bytes + len > cap || cur.len() == MAX_BATCH_ITEMS) {
            frames.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        cur.push(i);
        bytes += len;
    }
    if !cur.is_empty() {
        frames.push(cur);
    }
    for framed in frames {
        match put_frame(conn, items, &framed).await? {
            Some(answers) => {
                for (i, r) in framed.into_iter().zip(answers) {
                    out[i] = Some(r);
                }
            }
            // Refused whole for the node's memory budget: one by one.
            None => alone.extend(framed),
        }
    }
    for i in alone {
        let it = &items[i];
        out[i] = Some(match put(conn, &it.header, it.key, it.bufs, 0, 0).await {
            Ok(_) => Ok(()),
            Err(e @ OpError::Node(..)) => Err(e),
            Err(e) => return Err(e),
        });
    }
    Ok(out.into_iter().map(|r| r.expect("every item answered")).collect())
}

/// One BATCH_PUT frame of `items[framed]`: per item Ok or the node's
/// refusal; None when the node refused the whole frame as more than its
/// memory budget holds (REJECTED): the items are to go one by one.
async fn put_frame<S: Socket>(
    conn: &mut Conn<S>,
    items: &[PutItem<'_>],
    framed: &[usize],
) -> Result<Option<Vec<Result<(), OpError>>>, OpError> {
    let heads: Vec<[u8; BATCH_ITEM_HEAD]> = framed
        .iter()
        .map(|&i| PutItemHead { flags: 0, copy_age: 0, record_len: items[i].record_len() as u32 }.encode())
        .collect();
    let count = wire::encode_batch_answer_head(framed.len());
    let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + framed.len() * 4);
    parts.push(&count);
    for (k, &i) in framed.iter().enumerate() {
        parts.push(&heads[k]);
        parts.push(&items[i].header);
        parts.push(items[i].key);
        parts.extend_from_slice(items[i].bufs);
    }
    let id = conn.request(Op::BatchPut, 0, 0, &parts).await?;
    let h = conn.answer(id, SMALL_AHEAD).await?;
    let body = conn.answer_body(&h, MAX_BATCH_WRITE_ANSWER).await?;
    match h.status {
        Status::Ok => {}
        Status::Rejected => return Ok(None),
        // The whole frame refused (malformed, to the node): every item
        // gets its verdict.
        s => return Ok(Some(framed.iter().map(|_| Err(OpError::refused(s, &body))).collect())),
    }
    let answers = wire::decode_batch_answer(&body, framed.len())
        .map_err(|e| OpError::Protocol(format!("batch put answer: {e}")))?;
    Ok(Some(
        answers
            .into_iter()
            .map(|(ih, msg)| match ih.status {
                Status::Ok => Ok(()),
                s => Err(OpError::refused(s, msg)),
            })
            .collect(),
    ))
}

/// Deletes on one connection as one BATCH_DELETE frame (a node that agreed
/// on protocol v4; at most [`MAX_BATCH_ITEMS`] keys of 1..=1024 bytes):
/// per key Ok or Miss, or the node's refusal of the frame for every key.
pub async fn delete_batch<S: Socket>(conn: &mut Conn<S>, keys: &[&[u8]]) -> Result<Vec<Status>, OpError> {
    let list: Vec<BatchItem<'_>> = keys.iter().map(|key| BatchItem { flags: 0, key }).collect();
    let body = wire::encode_batch_delete(&list);
    let id = conn.request(Op::BatchDelete, 0, 0, &[&body]).await?;
    let h = conn.answer(id, SMALL_AHEAD).await?;
    let body = conn.answer_body(&h, MAX_BATCH_WRITE_ANSWER).await?;
    if h.status != Status::Ok {
        return Err(OpError::refused(h.status, &body));
    }
    let answers = wire::decode_batch_answer(&body, keys.len())
        .map_err(|e| OpError::Protocol(format!("batch delete answer: {e}")))?;
    Ok(answers
        .into_iter()
        .map(|(ih, msg)| match ih.status {
            Status::Ok | Status::Miss => ih.status,
            s => OpError::refused(s, msg).status(),
        })
        .collect())
}

/// A put by RDMA: Ok(true) when stored, Ok(false) when it must go inline
/// (no segments, the node could not read them, or what it read failed the
/// CRC: a stale registration), Err as any put.
async fn put_remote<S: Socket>(
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

pub async fn get<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<GetReply, OpError> {
    if key.is_empty() || key.len() > kv_common::page::MAX_KEY_LEN {
        // As the node answers such a GET (and before a buffer sized for
        // the longest key is sliced by it).
        let why = format!("key length {} outside 1..={}", key.len(), kv_common::page::MAX_KEY_LEN);
        return Ok(GetReply { status: OpError::refused(Status::BadRequest, why.as_bytes()).status(), len: 0 });
    }
    if conn.remote.is_some() {
        if let Some(r) = get_remote(conn, geo, key, bufs, extra).await? {
            return Ok(r);
        }
    }
    get_inline(conn, geo, key, bufs, extra).await
}

/// A get by RDMA: None when it must go inline (no segments, or the payload
/// placed failed its CRC: a stale registration; then retried inline).
async fn get_remote<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<Option<GetReply>, OpError> {
    let ranges = ranges_mut(bufs);
    if let Some(named) = named(conn, ranges, Access::NodeWrites) {
        let mut body = Vec::new();
        named.encode(&mut body);
        body.extend_from_slice(&KeyRequest::encode(geo, key));
        let id = conn.request(Op::Get, FLAG_CHECK_GEOMETRY | FLAG_RDMA | extra, 0, &[&body]).await?;
        let h = conn.answer(id, HEADER_LEN + key.len()).await?;
        let r = finish_remote_get(conn, geo, key, bufs, &h).await?;
        if r.status != Status::Corrupt || h.flags & RSP_FLAG_RDMA == 0 {
            return Ok(Some(r));
        }
        // The payload placed by RDMA failed its CRC (a stale registration,
        // most likely): once more, inline.
        named.stale();
    }
    Ok(None)
}

async fn get_inline<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
) -> Result<GetReply, OpError> {
    let req = KeyRequest::encode(geo, key);
    let id = conn.request(Op::Get, FLAG_CHECK_GEOMETRY | extra, 0, &[&req]).await?;
    // The frame header with the page header and key behind it: one read.
    let h = conn.answer(id, HEADER_LEN + key.len()).await?;
    read_get_body(conn, geo, key, bufs, &h).await
}

pub async fn exist<S: Socket>(conn: &mut Conn<S>, geo: &Geometry, key: &[u8]) -> Result<Status, OpError> {
    let id = conn.request(Op::Exist, FLAG_CHECK_GEOMETRY, 0, &[&KeyRequest::encode(geo, key)]).await?;
    Ok(exist_answer(conn, id, Op::Exist, 1).await?[0])
}

/// The answer to an EXIST (one status: Ok, Miss or Mismatch) or to a
/// BATCH_EXIST of `count` keys (a status a key), request `id`; Err with
/// the node's refusal otherwise.
pub(crate) async fn exist_answer<S: Socket>(
    conn: &mut Conn<S>,
    id: u64,
    op: Op,
    count: usize,
) -> Result<Vec<Status>, OpError> {
    let h = conn.answer(id, SMALL_AHEAD.max(8 + count)).await?;
    let body = conn.answer_body(&h, MAX_SMALL_ANSWER).await?;
    match (op, h.status) {
        (Op::Exist, s @ (Status::Ok | Status::Miss | Status::Mismatch)) => Ok(vec![s]),
        (Op::BatchExist, Status::Ok) => {
            let st = wire::decode_batch_status(&body).map_err(|e| OpError::Protocol(e.to_string()))?;
            if st.len() != count {
                return Err(OpError::Protocol("batch answer has the wrong count".into()));
            }
            Ok(st)
        }
        (_, s) => Err(OpError::refused(s, &body)),
    }
}

/// Removes `key` at this node: Ok or Miss (absent).
pub async fn delete<S: Socket>(conn: &mut Conn<S>, key: &[u8]) -> Result<Status, OpError> {
    let id = conn.request(Op::Delete, 0, 0, &[key]).await?;
    let h = conn.answer(id, SMALL_AHEAD).await?;
    let body = conn.answer_body(&h, MAX_SMALL_ANSWER).await?;
    match h.status {
        s @ (Status::Ok | Status::Miss) => Ok(s),
        s => Err(OpError::refused(s, &body)),
    }
}

pub async fn batch_exist<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    keys: &[&[u8]],
    extra: u8,
) -> Result<Vec<Status>, OpError> {
    let body = wire::encode_batch_exist(geo, keys);
    let id = conn.request(Op::BatchExist, FLAG_CHECK_GEOMETRY | extra, 0, &[&body]).await?;
    exist_answer(conn, id, Op::BatchExist, keys.len()).await
}

/// Reads and discards `n` bytes (to keep a pipelined connection in step).
async fn drain<S: Socket>(conn: &mut Conn<S>, n: u64) -> Result<(), OpError> {
    Ok(conn.link.skip(n).await?)
}

/// Several gets on one connection: all requests are written, then the
/// answers read in whatever order the node sends them, each scattered into
/// its own item's buffers (matched by request id) with its CRC checked as
/// it lands. Answers that are not served have their bodies drained, so the
/// connection stays usable. Returns one reply per item, in item order.
pub async fn get_pipelined<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    items: &mut [(&[u8], &mut [&mut [u8]])],
    extra: u8,
) -> Result<Vec<GetReply>, OpError> {
    let remote = conn.remote.is_some();
    let mut frames: Vec<(u8, Vec<u8>)> = Vec::with_capacity(items.len());
    // The items whose buffers were named for the node (None: inline), held
    // until all answers are in (empty: no remote transport, no allocation).
    let mut by_remote: Vec<Option<Named>> = Vec::new();
    for (key, bufs) in items.iter_mut() {
        let mut flags = FLAG_CHECK_GEOMETRY | extra;
        let named = if remote { named(conn, ranges_mut(bufs), Access::NodeWrites) } else { None };
        let body = match &named {
            None => KeyRequest::encode(geo, key),
            Some(n) => {
                let mut body = Vec::new();
                n.encode(&mut body);
                body.extend_from_slice(&KeyRequest::encode(geo, key));
                flags |= FLAG_RDMA;
                body
            }
        };
        if remote {
            by_remote.push(named);
        }
        frames.push((flags, body));
    }
    let list: Vec<(Op, u8, &[u8])> = frames.iter().map(|(f, b)| (Op::Get, *f, b.as_slice())).collect();
    let ids = conn.link.send_all(&list).await?;
    let ahead = HEADER_LEN + items.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    // Items placed by RDMA whose payload failed its CRC: retried inline.
    let mut again = Vec::new();
    let mut replies: Vec<Option<GetReply>> = (0..items.len()).map(|_| None).collect();
    for _ in 0..items.len() {
        let h = conn.link.recv_header(ahead).await?;
        let Some(i) = ids.iter().position(|&id| id == h.req_id).filter(|&i| replies[i].is_none()) else {
            return Err(OpError::Protocol(format!("unexpected answer id {}", h.req_id)));
        };
        let (key, bufs) = &mut items[i];
        replies[i] = Some(match by_remote.get_mut(i).and_then(Option::take) {
            Some(named) => {
                let r = finish_remote_get(conn, geo, key, bufs, &h).await?;
                if r.status == Status::Corrupt && h.flags & RSP_FLAG_RDMA != 0 {
                    again.push((i, named));
                }
                r
            }
            None => read_get_body(conn, geo, key, bufs, &h).await?,
        });
    }
    for (i, named) in again {
        named.stale();
        let (key, bufs) = &mut items[i];
        replies[i] = Some(get_inline(conn, geo, key, bufs, extra).await?);
    }
    Ok(replies.into_iter().map(|r| r.expect("every id answered")).collect())
}

/// Several gets on one connection as BATCH_GET frames (a node that agreed
/// on protocol v3): the items split into frames of at most
/// [`MAX_BATCH_ITEMS`] and, counting each item's buffers as the record it
/// may hold, [`MAX_BATCH_ANSWER`] bytes; every frame written at once, then
/// each answer read item by item in request order, each payload straight
/// into its item's buffers with its CRC checked as it lands. An item that
/// is not served costs only itself; the connection stays usable unless
/// the bytes themselves are wrong. One reply per item, in item order.
pub async fn get_batch<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    items: &mut [(&[u8], &mut [&mut [u8]])],
    extra: u8,
) -> Result<Vec<GetReply>, OpError> {
    let mut frames: Vec<std::ops::Range<usize>> = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, (key, bufs)) in items.iter().enumerate() {
        let room = (HEADER_LEN + key.len() + bufs.iter().map(|b| b.len()).sum::<usize>()) as u64;
        if i > start && (bytes + room > MAX_BATCH_ANSWER || i - start == MAX_BATCH_ITEMS) {
            frames.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += room;
    }
    if start < items.len() {
        frames.push(start..items.len());
    }
    let bodies: Vec<Vec<u8>> = frames
        .iter()
        .map(|r| {
            let list: Vec<BatchItem<'_>> =
                items[r.clone()].iter().map(|(key, _)| BatchItem { flags: 0, key }).collect();
            wire::encode_batch_get(geo, &list)
        })
        .collect();
    let list: Vec<(Op, u8, &[u8])> =
        bodies.iter().map(|b| (Op::BatchGet, FLAG_CHECK_GEOMETRY | extra, b.as_slice())).collect();
    let ids = conn.link.send_all(&list).await?;
    let mut replies: Vec<Option<GetReply>> = (0..items.len()).map(|_| None).collect();
    let mut answered = vec![false; frames.len()];
    let mut again = Vec::new();
    for _ in 0..frames.len() {
        let h = conn.link.recv_header(0).await?;
        let Some(f) = ids.iter().position(|&id| id == h.req_id).filter(|&f| !answered[f]) else {
            return Err(OpError::Protocol(format!("unexpected answer id {}", h.req_id)));
        };
        answered[f] = true;
        let r = frames[f].clone();
        if h.status != Status::Ok {
            // The whole frame refused (a malformed batch): every item gets
            // the node's verdict.
            let body = conn.answer_body(&h, MAX_SMALL_ANSWER).await?;
            let s = OpError::refused(h.status, &body).status();
            for reply in &mut replies[r] {
                *reply = Some(GetReply { status: s, len: 0 });
            }
            continue;
        }
        let mut rd = FrameReader { link: &mut conn.link, left: u64::from(h.body_len) };
        let mut head = [0u8; 8];
        // The answer's head with the first item's heads, in one read.
        rd.fill(head.len() + BATCH_ITEM_HEAD + HEADER_LEN + items[r.start].0.len()).await?;
        rd.exact(&mut head).await?;
        if wire::decode_batch_answer_head(&head) != r.len() {
            return Err(OpError::Protocol("batch answer has the wrong count".into()));
        }
        for i in r {
            let (key, bufs) = &mut items[i];
            let (reply, ask_again) = read_item(&mut rd, geo, key, bufs).await?;
            if ask_again {
                again.push(i);
            }
            replies[i] = Some(reply);
        }
        if !rd.done() {
            return Err(OpError::Protocol("batch answer longer than its items".into()));
        }
    }
    // Items past the answer's byte bound (records larger than the buffers
    // that sized the frames): asked again one by one, so each gets the
    // answer a single get gives (TOO_SMALL with the size, or the page).
    for i in again {
        let (key, bufs) = &mut items[i];
        replies[i] = Some(get_inline(conn, geo, key, bufs, extra).await?);
    }
    Ok(replies.into_iter().map(|r| r.expect("every frame answered")).collect())
}

/// One item of a BATCH_GET answer, leaving `rd` at the next item; true
/// beside the reply when the node asks for the item again
/// ([`wire::ITEM_AGAIN`]).
async fn read_item<S: Socket>(
    rd: &mut FrameReader<'_, S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
) -> Result<(GetReply, bool), OpError> {
    let done = |status, len| Ok((GetReply { status, len }, false));
    let head = HEADER_LEN + key.len();
    // The item's head and, for a hit, the page header and key: one read
    // when the socket has them (a miss leaves the next items' bytes
    // buffered, never more than this).
    rd.fill(BATCH_ITEM_HEAD + head).await?;
    let mut ib = [0u8; BATCH_ITEM_HEAD];
    rd.exact(&mut ib).await?;
    let ih = ItemHead::decode(&ib);
    if ih.status != Status::Ok {
        if ih.len > MAX_SMALL_ANSWER {
            return Err(OpError::Protocol(format!("unexpected {}-byte item answer", ih.len)));
        }
        let mut msg = vec![0u8; ih.len as usize];
        rd.exact(&mut msg).await?;
        if ih.status == Status::Rejected && ih.flags & wire::ITEM_AGAIN != 0 {
            return Ok((GetReply { status: Status::Rejected, len: 0 }, true));
        }
        return match ih.status {
            Status::Miss | Status::Mismatch => done(ih.status, 0),
            s => done(OpError::refused(s, &msg).status(), 0),
        };
    }
    let len = u64::from(ih.len);
    if len < head as u64 {
        rd.skip(len).await?;
        return done(Status::Corrupt, 0);
    }
    let mut hk = [0u8; HEADER_LEN + kv_common::page::MAX_KEY_LEN];
    rd.exact(&mut hk[..head]).await?;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    let ph = match check_get_head(geo, key, len, &hk[..head], cap) {
        Ok(ph) => ph,
        Err(r) => {
            rd.skip(len - head as u64).await?;
            return Ok((r, false));
        }
    };
    let need = ph.payload_len as usize;
    let mut sink = PayloadSink::new(bufs, need);
    while let Some(dst) = sink.next() {
        let n = rd.some(dst).await?;
        sink.filled(n);
    }
    if !sink.verify(ph.payload_crc) {
        return done(Status::Corrupt, 0);
    }
    done(Status::Ok, need)
}

/// The body of one answer frame on its way in, through the connection's
/// buffer (kv_common::driver): an item's heads (its own, the page header,
/// the key) come with one read when the socket has them, and a payload
/// goes from the socket straight into its buffers. It never takes past
/// the frame's end (the next frame may answer another request).
struct FrameReader<'s, S> {
    link: &'s mut driver::Conn<S>,
    /// Bytes of the frame not yet taken.
    left: u64,
}

impl<S: Socket> FrameReader<'_, S> {
    /// Whether the whole frame was taken.
    fn done(&self) -> bool {
        self.left == 0
    }

    fn short() -> OpError {
        OpError::Protocol("batch answer shorter than its items".into())
    }

    /// Has the connection's buffer hold the frame's next `n` bytes (at most
    /// what the frame has left), reading no more than that takes.
    async fn fill(&mut self, n: usize) -> Result<(), OpError> {
        let n = n.min(usize::try_from(self.left).unwrap_or(usize::MAX));
        Ok(self.link.fill(n, n).await?)
    }

    /// Some bytes into `dst`: from the buffer if it holds any, else one
    /// read straight from the socket.
    async fn some(&mut self, dst: &mut [u8]) -> Result<usize, OpError> {
        let n = dst.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if n == 0 {
            return Err(Self::short());
        }
        let got = self.link.some(&mut dst[..n]).await?;
        self.left -= got as u64;
        Ok(got)
    }

    /// Fills all of `dst`.
    async fn exact(&mut self, dst: &mut [u8]) -> Result<(), OpError> {
        if dst.len() as u64 > self.left {
            return Err(Self::short());
        }
        self.link.exact(dst).await?;
        self.left -= dst.len() as u64;
        Ok(())
    }

    /// Reads and drops `n` bytes.
    async fn skip(&mut self, n: u64) -> Result<(), OpError> {
        if n > self.left {
            return Err(Self::short());
        }
        self.link.skip(n).await?;
        self.left -= n;
        Ok(())
    }
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

/// A GET's payload on its way into the caller's segments: `need` bytes
/// (at most the segments' room: [`check_get_head`] made sure), in order,
/// its CRC taken as the bytes arrive. Every reader of a GET answer (the
/// async core's, the caller-thread path's, the RDMA check of bytes already
/// placed) moves bytes only into what [`PayloadSink::next`] gives, so the
/// segment walk and the CRC live here once.
pub(crate) struct PayloadSink<'s, 'b> {
    bufs: &'s mut [&'b mut [u8]],
    seg: usize,
    at: usize,
    left: usize,
    crc: crc32fast::Hasher,
}

impl<'s, 'b> PayloadSink<'s, 'b> {
    pub(crate) fn new(bufs: &'s mut [&'b mut [u8]], need: usize) -> PayloadSink<'s, 'b> {
        PayloadSink { bufs, seg: 0, at: 0, left: need, crc: crc32fast::Hasher::new() }
    }

    /// Where the next bytes of the payload go (None: all of it is in).
    pub(crate) fn next(&mut self) -> Option<&mut [u8]> {
        if self.left == 0 {
            return None;
        }
        while self.at >= self.bufs.get(self.seg)?.len() {
            self.seg += 1;
            self.at = 0;
        }
        let seg = &mut self.bufs[self.seg];
        let end = seg.len().min(self.at + self.left);
        Some(&mut seg[self.at..end])
    }

    /// `n` bytes were written at the start of what [`PayloadSink::next`] gave.
    pub(crate) fn filled(&mut self, n: usize) {
        let seg = &self.bufs[self.seg];
        self.crc.update(&seg[self.at..self.at + n]);
        self.at += n;
        self.left -= n;
    }

    /// Whether the whole payload came and matches the page header's CRC.
    pub(crate) fn verify(self, crc: u32) -> bool {
        self.left == 0 && self.crc.finalize() == crc
    }

    /// The payload is already in the segments (RDMA placed it): whether it
    /// matches the page header's CRC.
    pub(crate) fn placed(mut self, crc: u32) -> bool {
        while let Some(n) = self.next().map(|d| d.len()) {
            self.filled(n);
        }
        self.verify(crc)
    }
}

/// A payload's reads into one segment are at most this long, so its CRC
/// is taken over bytes that just landed (still in the cache).
const PAYLOAD_CHUNK: usize = 256 << 10;

async fn read_get_body<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    h: &RspHeader,
) -> Result<GetReply, OpError> {
    let done = |status, len| Ok(GetReply { status, len });
    if h.status != Status::Ok {
        let body = conn.answer_body(h, MAX_SMALL_ANSWER).await?;
        return match h.status {
            Status::Miss | Status::Mismatch => done(h.status, 0),
            // The answer was read whole: this item alone is not served (a
            // node's internal failure reads as unavailable, never negative).
            s => done(OpError::refused(s, &body).status(), 0),
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
    conn.link.exact(&mut hk[..head]).await?;
    let cap: usize = bufs.iter().map(|b| b.len()).sum();
    let ph = match check_get_head(geo, key, body_len, &hk[..head], cap) {
        Ok(ph) => ph,
        Err(r) => {
            drain(conn, body_len - head as u64).await?;
            return Ok(r);
        }
    };
    let need = ph.payload_len as usize;
    let mut sink = PayloadSink::new(bufs, need);
    while let Some(dst) = sink.next() {
        let k = dst.len().min(PAYLOAD_CHUNK);
        let dst = &mut dst[..k];
        // The bytes that came with the heads, then the rest straight from
        // the socket (on a blocking socket one call a chunk, MSG_WAITALL).
        let n = if conn.link.buffered() > 0 {
            conn.link.some(dst).await?
        } else {
            conn.link.exact(dst).await?;
            k
        };
        sink.filled(n);
    }
    if !sink.verify(ph.payload_crc) {
        return done(Status::Corrupt, 0);
    }
    done(Status::Ok, need)
}

#[cfg(test)]
mod tests {
    use super::PayloadSink;

    /// Writes `payload` through a sink over segments of `sizes` bytes, `chunk`
    /// bytes a read at most: (the segments, whether the CRC matched).
    fn through(sizes: &[usize], payload: &[u8], chunk: usize, crc: u32) -> (Vec<Vec<u8>>, bool) {
        let mut segs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut bufs: Vec<&mut [u8]> = segs.iter_mut().map(|s| s.as_mut_slice()).collect();
        let mut sink = PayloadSink::new(&mut bufs, payload.len());
        let mut at = 0;
        while let Some(dst) = sink.next() {
            let n = dst.len().min(chunk);
            dst[..n].copy_from_slice(&payload[at..at + n]);
            at += n;
            sink.filled(n);
        }
        assert_eq!(at, payload.len(), "every byte asked for");
        let ok = sink.verify(crc);
        (segs, ok)
    }

    #[test]
    fn a_payload_fills_the_segments_in_order_across_empty_ones_and_reads_of_any_size() {
        let payload: Vec<u8> = (1..=9).collect();
        let crc = crc32fast::hash(&payload);
        for chunk in [1, 2, 4, 64] {
            let (segs, ok) = through(&[3, 0, 4, 5], &payload, chunk, crc);
            assert!(ok, "chunk {chunk}");
            assert_eq!(segs, vec![vec![1, 2, 3], vec![], vec![4, 5, 6, 7], vec![8, 9, 0, 0, 0]], "chunk {chunk}");
        }
        assert!(!through(&[9], &payload, 4, crc ^ 1).1, "another CRC is refused");
        assert!(through(&[4], &[], 4, 0).1, "an empty payload");
    }

    #[test]
    fn bytes_already_placed_are_checked_and_a_short_room_never_passes() {
        let payload: Vec<u8> = (1..=6).collect();
        let crc = crc32fast::hash(&payload);
        let (mut a, mut b) = (payload[..2].to_vec(), [payload[2..].to_vec(), vec![7, 7]].concat());
        let mut bufs: Vec<&mut [u8]> = vec![&mut a, &mut b];
        assert!(PayloadSink::new(&mut bufs, 6).placed(crc), "the room's tail is not part of the payload");
        let mut short = [0u8; 4];
        let mut bufs: Vec<&mut [u8]> = vec![&mut short];
        assert!(!PayloadSink::new(&mut bufs, 6).placed(crc32fast::hash(&[0u8; 4])), "4 bytes of room for 6");
    }
}
