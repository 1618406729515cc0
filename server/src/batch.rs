//! BATCH_GET (docs/PROTOCOL.md §2.5): many gets in one frame, answered by
//! one frame whose items come in request order. Items in the memory tier
//! are looked up on the reader's task; a batch whose items are all there
//! (or absent) is answered from that task, with no hop to another task or
//! thread. Items that must be read from disk are read as single gets are
//! (each its own blocking read under an I/O slot), at most
//! [`READS_AT_ONCE`] at a time so that one large batch does not queue ahead
//! of other clients' gets, and the answer waits for the slowest of them: an
//! item from disk delays the items from memory of the same batch, never
//! those of other requests.
//! The answer is written with vectored writes straight from the records'
//! buffers.
//!
//! BATCH_PUT and BATCH_DELETE (protocol v4) are here too: the connection's
//! reader takes a batch put's records into their own buffers as they
//! arrive (`crate::conn`), and [`put`] stores them as single puts are
//! stored, a few at once, answering item by item in one frame.

use std::sync::Arc;

use kv_common::page::Geometry;
use kv_common::status::Status;
use kv_common::wire::{self, ItemHead, ReqHeader, FLAG_CHECK_GEOMETRY, FLAG_HANDOFF, ITEM_AGAIN, ITEM_HANDOFF};
use kv_common::wire::{Op, BATCH_ITEM_HEAD, ITEM_DUPLICATE, MAX_BATCH_ANSWER, RSP_FLAG_DUPLICATE};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::frame::{error_response, respond, Body, Part, Response};
use crate::ops::{counted, Session};
use crate::state::Shared;
use crate::store::{GetOutcome, PooledBuf};

/// What one item will be answered with.
enum Item {
    /// Found in the memory tier, not yet counted as served.
    Mem(Arc<PooledBuf>),
    /// Answered: the status, and the record on OK.
    Done(Status, Option<Arc<PooledBuf>>),
    /// Over the answer's byte bound: REJECTED with this message.
    Over,
    /// In a disk's index with this record length: to be read.
    Disk(u64),
    /// A disk's index lock was busy: its length is asked off the reactor.
    Unknown,
}

const OVER: &str = "not served: the batch's answer would pass 64 MiB; ask again";

/// Reads from disk one batch has going at once.
pub const READS_AT_ONCE: usize = 8;

/// How a batch began.
pub enum Begun {
    /// Answered from memory (or refused): send it.
    Answered(Response),
    /// Items must come from disk: [`finish`] answers, on a task of its own.
    Disk(Started),
}

/// Begins the BATCH_GET `req` with `body` in hand.
pub fn start(shared: &Shared, req: &ReqHeader, body: &[u8]) -> Begun {
    let (geo, items) = match wire::decode_batch_get(body) {
        Ok(d) => d,
        Err(e) => return Begun::Answered(error_response(req, Status::BadRequest, &e.to_string())),
    };
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    let handoff_all = req.flags & FLAG_HANDOFF != 0;
    let store = &shared.store;
    let handoff: Vec<bool> = items.iter().map(|i| handoff_all || i.flags & ITEM_HANDOFF != 0).collect();
    let mut out: Vec<Item> = Vec::with_capacity(items.len());
    let mut pending = false;
    for it in &items {
        let item = match store.peek_cached(it.key, check.then_some(&geo)) {
            Some(GetOutcome::Hit(rec)) => Item::Mem(rec),
            Some(GetOutcome::Mismatch) => Item::Done(Status::Mismatch, None),
            _ => match store.try_record_size(it.key) {
                Some(Some(n)) => Item::Disk(n),
                Some(None) => {
                    store.count_miss();
                    Item::Done(Status::Miss, None)
                }
                None => Item::Unknown,
            },
        };
        pending |= matches!(item, Item::Disk(_) | Item::Unknown);
        out.push(item);
    }
    if !pending {
        bound(shared, |i| items[i].key, &mut out);
        count_asks(shared, &handoff, &out);
        return Begun::Answered(answer(req, out));
    }
    Begun::Disk(Started {
        keys: items.iter().map(|i| i.key.to_vec()).collect(),
        handoff,
        geo: check.then_some(geo),
        items: out,
    })
}

/// A batch with items still to read from disk.
pub struct Started {
    keys: Vec<Vec<u8>>,
    /// Which items are handoff asks.
    handoff: Vec<bool>,
    geo: Option<Geometry>,
    items: Vec<Item>,
}

/// Reads the items of `s` that are on disk and answers the batch.
pub async fn finish(shared: &Arc<Shared>, req: &ReqHeader, mut s: Started) -> Response {
    // Lengths the reactor could not look up without waiting.
    for (i, item) in s.items.iter_mut().enumerate() {
        if matches!(item, Item::Unknown) {
            let (store, key) = (shared.store.clone(), s.keys[i].clone());
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            *item = match tokio::task::spawn_blocking(move || store.record_size(&key)).await.unwrap_or(None) {
                Some(n) => Item::Disk(n),
                None => {
                    shared.store.count_miss();
                    Item::Done(Status::Miss, None)
                }
            };
        }
    }
    let keys = &s.keys;
    bound(shared, |i| &keys[i], &mut s.items);
    // The records read count against --max-inflight until written out, as
    // a single get's do (never more than the whole budget, which would
    // wait forever).
    let bytes: u64 = s.items.iter().map(|i| if let Item::Disk(n) = i { *n } else { 0 }).sum();
    let units = bytes.div_ceil(4096).clamp(1, u64::from(shared.inflight_units.max(1))) as u32;
    let budget: OwnedSemaphorePermit =
        shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
    let mut reads = tokio::task::JoinSet::new();
    let disk: Vec<usize> = (0..s.items.len()).filter(|&i| matches!(s.items[i], Item::Disk(_))).collect();
    let mut todo = disk.into_iter();
    let spawn = |reads: &mut tokio::task::JoinSet<_>, i: usize| {
        let (shared, key, geo) = (shared.clone(), s.keys[i].clone(), s.geo);
        reads.spawn(async move {
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            let store = shared.store.clone();
            (i, tokio::task::spawn_blocking(move || store.get(&key, geo.as_ref())).await)
        });
    };
    for i in todo.by_ref().take(READS_AT_ONCE) {
        spawn(&mut reads, i);
    }
    while let Some(done) = reads.join_next().await {
        let Ok((i, read)) = done else {
            // A read task panicked: the item it had is still Disk, and
            // is answered INTERNAL below.
            tracing::error!("a batch get's read task failed");
            if let Some(next) = todo.next() {
                spawn(&mut reads, next);
            }
            continue;
        };
        s.items[i] = match read {
            Ok(GetOutcome::Hit(rec)) => Item::Done(Status::Ok, Some(rec)),
            Ok(GetOutcome::Mismatch) => Item::Done(Status::Mismatch, None),
            Ok(GetOutcome::Miss) => Item::Done(Status::Miss, None),
            Err(_) => {
                tracing::error!("a batch get's read failed");
                Item::Done(Status::Internal, None)
            }
        };
        if let Some(next) = todo.next() {
            spawn(&mut reads, next);
        }
    }
    count_asks(shared, &s.handoff, &s.items);
    let mut r = answer(req, s.items);
    r.budget = Some(budget);
    r
}

/// Counts the batch's handoff asks and their hits (as GET with
/// FLAG_HANDOFF counts each ask).
fn count_asks(shared: &Shared, handoff: &[bool], items: &[Item]) {
    // An item past the answer's bound is asked again (a single GET, which
    // counts itself): it is not an ask here.
    let asks = handoff.iter().zip(items).filter(|(h, i)| **h && !matches!(i, Item::Over)).count();
    if asks > 0 {
        let hits = handoff.iter().zip(items).filter(|(h, i)| **h && matches!(i, Item::Done(Status::Ok, _))).count();
        shared.handoff.count_asks(asks, hits);
    }
}

/// Marks the items past the answer's byte bound (in request order; the
/// first item goes unless the frame could not carry it), and counts the
/// memory-tier hits that stay served.
fn bound<'k>(shared: &Shared, key: impl Fn(usize) -> &'k [u8], items: &mut [Item]) {
    // A frame's body length is a u32: the heads and the longest messages
    // must fit beside the records, whatever the first item's size.
    let frame_room = u64::from(u32::MAX) - 8 - (BATCH_ITEM_HEAD + OVER.len()) as u64 * items.len() as u64;
    let mut total = 0u64;
    for (i, item) in items.iter_mut().enumerate() {
        let len = match item {
            Item::Mem(rec) => rec.len() as u64,
            Item::Disk(n) => *n,
            _ => 0,
        };
        total += len;
        let limit = if i == 0 { frame_room } else { MAX_BATCH_ANSWER.min(frame_room) };
        if len > 0 && total > limit {
            total -= len;
            *item = Item::Over;
        } else if let Item::Mem(_) = item {
            if let Item::Mem(rec) = std::mem::replace(item, Item::Unknown) {
                shared.store.count_cached_hit(key(i), rec.len());
                *item = Item::Done(Status::Ok, Some(rec));
            }
        }
    }
}

/// The answer frame: head, then each item's head and record or message.
fn answer(req: &ReqHeader, items: Vec<Item>) -> Response {
    let mut parts = Vec::with_capacity(1 + 2 * items.len());
    let mut heads = wire::encode_batch_answer_head(items.len()).to_vec();
    for item in items {
        let (status, flags, tail) = match item {
            Item::Done(s, rec) => (s, 0, rec.map(Part::Record)),
            Item::Over => (Status::Rejected, ITEM_AGAIN, Some(Part::Bytes(OVER.as_bytes().to_vec()))),
            Item::Mem(_) | Item::Disk(_) | Item::Unknown => (Status::Internal, 0, None),
        };
        let len = tail.as_ref().map_or(0, |t| match t {
            Part::Bytes(b) => b.len(),
            Part::Record(r) => r.len(),
        });
        heads.extend_from_slice(&ItemHead { status, flags, len: len as u32 }.encode());
        if let Some(t) = tail {
            // Heads gathered since the last record go as one piece.
            parts.push(Part::Bytes(std::mem::take(&mut heads)));
            parts.push(t);
        }
    }
    if !heads.is_empty() {
        parts.push(Part::Bytes(heads));
    }
    respond(req, Status::Ok, 0, Body::Parts(parts))
}

/// Puts of one batch stored at once: on media acks each waits for its
/// flush, and the flushes of puts in flight together are one group commit.
pub const WRITES_AT_ONCE: usize = 8;

/// One item of a BATCH_PUT as the connection's reader took it.
pub enum PutItem {
    /// Refused before the store (not a record, over `--max-record`).
    Refused(Status, String),
    /// A whole record in its own buffer, with its share of `--max-inflight`.
    Record { flags: u8, copy_age: u16, buf: PooledBuf, mem: OwnedSemaphorePermit },
}

/// Stores a BATCH_PUT's items as single puts are stored ([`crate::ops`]'s
/// put pipeline, a handoff copy's rules for items with `ITEM_HANDOFF`), at
/// most [`WRITES_AT_ONCE`] at a time, and answers them in one frame in
/// request order. `rest`: what of the frame's share of `--max-inflight`
/// no item took. `t0`: when the whole frame was in hand.
pub async fn put(
    shared: Arc<Shared>,
    s: Arc<Session>,
    req: ReqHeader,
    items: Vec<PutItem>,
    rest: OwnedSemaphorePermit,
    permit: OwnedSemaphorePermit,
    t0: Instant,
) {
    use futures_util::stream::{self, StreamExt};
    let answers: Vec<(Status, u8, Vec<u8>)> = stream::iter(items)
        .map(|item| {
            let shared = &shared;
            async move {
                match item {
                    PutItem::Refused(status, why) => (status, 0, why.into_bytes()),
                    PutItem::Record { flags, copy_age, buf, mem } => {
                        let one = ReqHeader {
                            op: Op::Put,
                            flags: if flags & ITEM_HANDOFF != 0 { FLAG_HANDOFF } else { 0 },
                            copy_age,
                            body_len: buf.len() as u32,
                            req_id: req.req_id,
                        };
                        let (status, rflags, msg) = crate::ops::store_put(shared, &one, buf, mem, t0).await.into_item();
                        let dup = if rflags & RSP_FLAG_DUPLICATE != 0 { ITEM_DUPLICATE } else { 0 };
                        (status, dup, msg)
                    }
                }
            }
        })
        .buffered(WRITES_AT_ONCE)
        .collect()
        .await;
    drop(rest);
    let r = small_answer(&req, answers);
    s.out.send(counted(&shared, req.op, t0, r)).await;
    drop(permit);
}

/// BATCH_DELETE: each key's tombstone first (as DELETE), then the deletes,
/// in one pass off the reactor (each appends to an index journal).
pub async fn delete(shared: &Arc<Shared>, req: &ReqHeader, body: &[u8]) -> Response {
    let items = match wire::decode_batch_delete(body) {
        Ok(i) => i,
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
    };
    for it in &items {
        shared.handoff.deleted(kv_common::page::key_hash(it.key));
    }
    let keys: Vec<Vec<u8>> = items.iter().map(|i| i.key.to_vec()).collect();
    let store = shared.store.clone();
    let _io = shared.io_slots.acquire().await.expect("semaphore open");
    match tokio::task::spawn_blocking(move || keys.iter().map(|k| store.delete(k)).collect::<Vec<bool>>()).await {
        Ok(found) => small_answer(
            req,
            found.into_iter().map(|f| (if f { Status::Ok } else { Status::Miss }, 0, Vec::new())).collect(),
        ),
        Err(_) => error_response(req, Status::Internal, "internal error"),
    }
}

/// A batch answer without records: the head, then each item's head and
/// message, in one buffer.
fn small_answer(req: &ReqHeader, items: Vec<(Status, u8, Vec<u8>)>) -> Response {
    let heads: Vec<(ItemHead, &[u8])> = items
        .iter()
        .map(|(status, flags, msg)| (ItemHead { status: *status, flags: *flags, len: msg.len() as u32 }, &msg[..]))
        .collect();
    respond(req, Status::Ok, 0, Body::Bytes(wire::encode_batch_answer(&heads)))
}
