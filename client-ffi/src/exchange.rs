//! Request/response exchanges on one connection, written once for either
//! socket (conn.rs): the async core awaits them, the caller-thread path and
//! the tools run them with `kv_common::driver::block_on`. What a get's
//! answer does to the caller's buffers is answer.rs's; a payload that
//! travels by the connection's remote memory rather than inline goes
//! through transport.rs, which falls back to the inline request here.

use kv_common::driver::{block_on, Socket};
use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::RSP_FLAG_DUPLICATE;
use kv_common::wire::{self, KeyRequest, Op, FLAG_CHECK_GEOMETRY};
use kv_common::wire::{BatchItem, BATCH_ITEM_HEAD, ITEM_RDMA, MAX_BATCH_ANSWER, MAX_BATCH_ITEMS, MAX_ITEM_SEGMENTS};
use kv_common::wire::{PutItemHead, ITEM_AGAIN, ITEM_RDMA_FAILED, MAX_BATCH_PUT_RECORDS};

pub use crate::answer::GetReply;
use crate::answer::{read_get_body, read_item, Follow, FrameReader, MAX_SMALL_ANSWER};
use crate::conn::{Blocking, Conn};
use crate::error::OpError;
use crate::remote::{Access, Named};
use crate::transport;

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
        if transport::put(conn, header, key, bufs).await? {
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
/// caller's buffers, answered item by item. On a connection that reaches
/// the node's memory (RDMA, its bootstrap agreeing on segments in batch
/// items), an item whose buffers can be named sends its header, key and
/// the names instead of the payload ([`ITEM_RDMA`]); the node reads it.
/// A record over the node's `max_record` is refused here, as a single put
/// refuses it; a record over a frame's bound, the items of a frame the
/// node's memory budget refused, and named items the node could not read
/// (or read wrong: a stale registration) go as PUTs of their own.
/// Per item: Ok, or the node's refusal. Err: the exchange failed (the
/// connection's bytes are in doubt).
pub async fn put_batch<S: Socket>(
    conn: &mut Conn<S>,
    items: &[PutItem<'_>],
) -> Result<Vec<Result<(), OpError>>, OpError> {
    let mut out: Vec<Option<Result<(), OpError>>> = (0..items.len()).map(|_| None).collect();
    // Buffers named for the node, and their lists (left empty, with no
    // allocation, when this connection names none).
    let mut named: Vec<Option<Box<dyn Named>>> = Vec::new();
    let mut lists: Vec<Vec<u8>> = Vec::new();
    if conn.remote.as_ref().is_some_and(|r| r.batches()) {
        named = (0..items.len()).map(|_| None).collect();
        lists = vec![Vec::new(); items.len()];
        for (i, it) in items.iter().enumerate() {
            let ranges = it.bufs.iter().map(|b| (b.as_ptr() as usize, b.len())).collect();
            if let Some(n) =
                transport::named(conn, ranges, Access::NodeReads).filter(|n| n.count() <= MAX_ITEM_SEGMENTS)
            {
                n.encode(&mut lists[i]);
                named[i] = Some(n);
            }
        }
    }
    // A frame's records stay within half the node's max_record too: a node
    // holds a whole frame within its --max-inflight budget, which is at
    // least max_record, and refuses a frame it cannot hold. (A named
    // item's payload counts too: the node takes memory for it to read it
    // into.)
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
        let Some(answers) = put_frame(conn, items, &lists, &framed).await? else {
            // Refused whole for the node's memory budget: one by one.
            alone.extend(framed);
            continue;
        };
        for (i, (status, flags, msg)) in framed.into_iter().zip(answers) {
            let by_name = lists.get(i).is_some_and(|l| !l.is_empty());
            out[i] = Some(match status {
                Status::Ok => Ok(()),
                // The node could not read it (its queue pair is gone):
                // inline, and this connection on TCP from now on.
                Status::Unavailable if by_name && flags & ITEM_RDMA_FAILED != 0 => {
                    conn.remote = None;
                    alone.push(i);
                    continue;
                }
                // Its memory budget was busy: on its own.
                Status::Rejected if flags & ITEM_AGAIN != 0 => {
                    alone.push(i);
                    continue;
                }
                // What the node read does not match the CRC computed over
                // the buffers: a stale registration, most likely.
                Status::Corrupt if by_name => {
                    if let Some(n) = named.get_mut(i).and_then(Option::take) {
                        n.stale();
                    }
                    alone.push(i);
                    continue;
                }
                s => Err(OpError::refused(s, &msg)),
            });
        }
        if conn.remote.is_none() {
            // This connection names no more: later frames carry their
            // payloads inline.
            lists.iter_mut().for_each(Vec::clear);
        }
    }
    drop(named);
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

/// One BATCH_PUT frame of `items[framed]` (an item with a segment list in
/// `lists` sends it instead of its payload): per item the node's status,
/// item flags and message; None when the node refused the whole frame as
/// more than its memory budget holds (REJECTED): the items are to go one
/// by one.
async fn put_frame<S: Socket>(
    conn: &mut Conn<S>,
    items: &[PutItem<'_>],
    lists: &[Vec<u8>],
    framed: &[usize],
) -> Result<Option<Vec<(Status, u8, Vec<u8>)>>, OpError> {
    let heads: Vec<[u8; BATCH_ITEM_HEAD]> = framed
        .iter()
        .map(|&i| {
            let it = &items[i];
            let head = match lists.get(i).map_or(0, Vec::len) {
                0 => PutItemHead { flags: 0, copy_age: 0, record_len: it.record_len() as u32 },
                n => PutItemHead { flags: ITEM_RDMA, copy_age: 0, record_len: (HEADER_LEN + it.key.len() + n) as u32 },
            };
            head.encode()
        })
        .collect();
    let count = wire::encode_batch_answer_head(framed.len());
    let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + framed.len() * 4);
    parts.push(&count);
    for (k, &i) in framed.iter().enumerate() {
        parts.push(&heads[k]);
        parts.push(&items[i].header);
        parts.push(items[i].key);
        match lists.get(i).filter(|l| !l.is_empty()) {
            Some(list) => parts.push(list),
            None => parts.extend_from_slice(items[i].bufs),
        }
    }
    let id = conn.request(Op::BatchPut, 0, 0, &parts).await?;
    let h = conn.answer(id, SMALL_AHEAD).await?;
    let body = conn.answer_body(&h, MAX_BATCH_WRITE_ANSWER).await?;
    match h.status {
        Status::Ok => {}
        Status::Rejected => return Ok(None),
        // The whole frame refused (malformed, to the node): every item
        // gets its verdict.
        s => return Ok(Some(framed.iter().map(|_| (s, 0, body.clone())).collect())),
    }
    let answers = wire::decode_batch_answer(&body, framed.len())
        .map_err(|e| OpError::Protocol(format!("batch put answer: {e}")))?;
    Ok(Some(answers.into_iter().map(|(ih, msg)| (ih.status, ih.flags, msg.to_vec())).collect()))
}

/// Deletes on one connection as one BATCH_DELETE frame (a node that agreed
/// on protocol v4; at most [`MAX_BATCH_ITEMS`] keys of 1..=1024 bytes):
/// per key Ok or Miss, or the node's refusal of the frame for every key.
pub async fn delete_batch<S: Socket>(conn: &mut Conn<S>, keys: &[&[u8]]) -> Result<Vec<Status>, OpError> {
    let list: Vec<BatchItem<'_>> = keys.iter().map(|key| BatchItem { flags: 0, key, segs: &[], spread: 0 }).collect();
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

/// One GET. `extra`: request flags beside its own (FLAG_HANDOFF for a
/// handoff ask); `weight`: the spread this client reads a hot key with
/// when it asks the owner (the owner counts the read as that many; 0 for
/// any other read, docs/PROTOCOL.md §2.2).
pub async fn get<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
    weight: u8,
) -> Result<GetReply, OpError> {
    if key.is_empty() || key.len() > kv_common::page::MAX_KEY_LEN {
        // As the node answers such a GET (and before a buffer sized for
        // the longest key is sliced by it).
        let why = format!("key length {} outside 1..={}", key.len(), kv_common::page::MAX_KEY_LEN);
        return Ok(GetReply {
            status: OpError::refused(Status::BadRequest, why.as_bytes()).status(),
            len: 0,
            spread: 0,
        });
    }
    if conn.remote.is_some() {
        if let Some(r) = transport::get(conn, geo, key, bufs, extra, weight).await? {
            return Ok(r);
        }
    }
    get_inline(conn, geo, key, bufs, extra, weight).await
}

async fn get_inline<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    key: &[u8],
    bufs: &mut [&mut [u8]],
    extra: u8,
    weight: u8,
) -> Result<GetReply, OpError> {
    let req = KeyRequest::encode(geo, key);
    let id = conn.request(Op::Get, FLAG_CHECK_GEOMETRY | extra, u16::from(weight), &[&req]).await?;
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
    // until all answers are in (empty: no remote memory, no allocation).
    let mut by_remote: Vec<Option<Box<dyn Named>>> = Vec::new();
    for (key, bufs) in items.iter_mut() {
        let named = if remote { transport::get_request(conn, geo, key, bufs, extra) } else { None };
        let (flags, body, named) = match named {
            Some((flags, body, named)) => (flags, body, Some(named)),
            None => (FLAG_CHECK_GEOMETRY | extra, KeyRequest::encode(geo, key), None),
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
                let (r, stale) = transport::finish_get(conn, geo, key, bufs, &h).await?;
                if stale {
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
        replies[i] = Some(get_inline(conn, geo, key, bufs, extra, 0).await?);
    }
    Ok(replies.into_iter().map(|r| r.expect("every id answered")).collect())
}

/// Several gets on one connection as BATCH_GET frames (a node that agreed
/// on protocol v3): the items split into frames of at most
/// [`MAX_BATCH_ITEMS`] and, counting each item's buffers as the record it
/// may hold, [`MAX_BATCH_ANSWER`] bytes; every frame written at once, then
/// each answer read item by item in request order, each payload straight
/// into its item's buffers with its CRC checked as it lands. On a
/// connection that reaches the node's memory (RDMA, its bootstrap agreeing
/// on segments in batch items), an item whose buffers can be named names
/// them ([`ITEM_RDMA`]): the node writes its payload there and answers its
/// header and key, checked here with the payload's CRC. An item that is not
/// served costs only itself; the connection stays usable unless the bytes
/// themselves are wrong. One reply per item, in item order.
/// `weights[i]` (when given): the spread this client reads item i's key
/// with at its owner ([`get`]; sent as [`wire::ITEM_HOT`] and the item
/// head's second byte).
pub async fn get_batch<S: Socket>(
    conn: &mut Conn<S>,
    geo: &Geometry,
    items: &mut [(&[u8], &mut [&mut [u8]])],
    extra: u8,
    weights: &[u8],
) -> Result<Vec<GetReply>, OpError> {
    // Buffers named for the node, held until the answers are in (empty:
    // this connection names none, no allocation), and their lists.
    let naming = conn.remote.as_ref().is_some_and(|r| r.batches());
    let mut named: Vec<Option<Box<dyn Named>>> = Vec::new();
    let mut lists: Vec<Vec<u8>> = Vec::new();
    if naming {
        for (_, bufs) in items.iter_mut() {
            let n = transport::named(conn, transport::ranges_mut(bufs), Access::NodeWrites)
                .filter(|n| n.count() <= MAX_ITEM_SEGMENTS);
            let mut list = Vec::new();
            if let Some(n) = &n {
                n.encode(&mut list);
            }
            named.push(n);
            lists.push(list);
        }
    }
    let asked: Vec<bool> = named.iter().map(Option::is_some).collect();
    let is_named = |i: usize| asked.get(i).copied().unwrap_or(false);
    let mut frames: Vec<std::ops::Range<usize>> = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, (key, bufs)) in items.iter().enumerate() {
        // A named item's answer is its header and key.
        let payload = if is_named(i) { 0 } else { bufs.iter().map(|b| b.len()).sum::<usize>() };
        let room = (HEADER_LEN + key.len() + payload) as u64;
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
            let list: Vec<BatchItem<'_>> = r
                .clone()
                .map(|i| {
                    let spread = weights.get(i).copied().unwrap_or(0);
                    let hot = if spread > 0 { wire::ITEM_HOT } else { 0 };
                    match lists.get(i).filter(|l| !l.is_empty()) {
                        Some(segs) => BatchItem { flags: ITEM_RDMA | hot, key: items[i].0, segs, spread },
                        None => BatchItem { flags: hot, key: items[i].0, segs: &[], spread },
                    }
                })
                .collect();
            wire::encode_batch_get(geo, &list)
        })
        .collect();
    let list: Vec<(Op, u8, &[u8])> =
        bodies.iter().map(|b| (Op::BatchGet, FLAG_CHECK_GEOMETRY | extra, b.as_slice())).collect();
    let ids = conn.link.send_all(&list).await?;
    let mut replies: Vec<Option<GetReply>> = (0..items.len()).map(|_| None).collect();
    let mut answered = vec![false; frames.len()];
    let (mut again, mut unplaced) = (Vec::new(), false);
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
                *reply = Some(GetReply { status: s, len: 0, spread: 0 });
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
            let (reply, follow) = read_item(&mut rd, geo, key, bufs, is_named(i)).await?;
            match follow {
                Follow::Done => {}
                Follow::Again => again.push(i),
                Follow::Stale => {
                    if let Some(n) = named.get_mut(i).and_then(Option::take) {
                        n.stale();
                    }
                    again.push(i);
                }
                Follow::Unplaced => unplaced = true,
            }
            replies[i] = Some(reply);
        }
        if !rd.done() {
            return Err(OpError::Protocol("batch answer longer than its items".into()));
        }
    }
    drop(named);
    if unplaced {
        // The node answered named items inline: its queue pair for this
        // connection is gone. This connection goes on over TCP.
        conn.remote = None;
    }
    // Items past the answer's byte bound (records larger than the buffers
    // that sized the frames), and payloads placed that failed their CRC:
    // asked again one by one, so each gets the answer a single get gives
    // (TOO_SMALL with the size, or the page), inline.
    for i in again {
        let (key, bufs) = &mut items[i];
        let weight = weights.get(i).copied().unwrap_or(0);
        replies[i] = Some(get_inline(conn, geo, key, bufs, extra, weight).await?);
    }
    Ok(replies.into_iter().map(|r| r.expect("every frame answered")).collect())
}

/// The tools' operations (kvctl, tests) that are the core's exchanges,
/// run on the caller's thread.
impl Conn<Blocking> {
    /// Stores `payload` under `key`. Returns Ok(true) when newly stored,
    /// Ok(false) when the key was already there (write-once).
    pub fn put(&mut self, geo: &Geometry, key: &[u8], payload: &[u8]) -> Result<bool, OpError> {
        let h = PageHeader::new(*geo, key, payload.len() as u64, crc32fast::hash(payload));
        self.put_parts(&[&h.encode(), key, payload])
    }

    /// Sends a record given as parts (header, key, payload) without joining them.
    pub fn put_parts(&mut self, parts: &[&[u8]]) -> Result<bool, OpError> {
        block_on(put_record(self, parts, 0, 0))
    }

    pub fn batch_exist<K: AsRef<[u8]>>(&mut self, geo: &Geometry, keys: &[K]) -> Result<Vec<Status>, OpError> {
        let keys: Vec<&[u8]> = keys.iter().map(AsRef::as_ref).collect();
        block_on(batch_exist(self, geo, &keys, 0))
    }
}
