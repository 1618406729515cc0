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

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{
    self, ItemHead, ReqHeader, Segment, FLAG_CHECK_GEOMETRY, FLAG_HANDOFF, ITEM_AGAIN, ITEM_HANDOFF, ITEM_HOT,
};
use kv_common::wire::{Op, BATCH_ITEM_HEAD, ITEM_DUPLICATE, MAX_BATCH_ANSWER, RSP_FLAG_DUPLICATE};
use kv_common::wire::{ITEM_PLACED, ITEM_RDMA, ITEM_RDMA_FAILED};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::frame::{error_response, respond, Body, Part, Response};
use crate::ops::{counted, PutStep, Session};
use crate::state::Shared;
use crate::store::{GetOutcome, PooledBuf};
use crate::transport::RemoteMemory;

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
    /// Its payload was written into the item's segments (OK), or they are
    /// too small for it (TOO_SMALL): answered with the record's first
    /// bytes (its header and key), this many.
    Placed(Status, Arc<PooledBuf>, usize),
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

/// Begins the BATCH_GET `req` with `body` in hand, on the connection `s`
/// (whose remote memory, if any, takes the payloads of items that name
/// segments).
pub fn start(shared: &Shared, s: &Session, req: &ReqHeader, body: &[u8]) -> Begun {
    let (geo, items) = match wire::decode_batch_get(body) {
        Ok(d) => d,
        Err(e) => return Begun::Answered(error_response(req, Status::BadRequest, &e.to_string())),
    };
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    let handoff_all = req.flags & FLAG_HANDOFF != 0;
    let store = &shared.store;
    let handoff: Vec<bool> = items.iter().map(|i| handoff_all || i.flags & ITEM_HANDOFF != 0).collect();
    // The reads each item stands for (a hot key's read at its owner by a
    // client that spreads its reads, docs/ARCHITECTURE.md "Hot keys").
    let weights: Vec<u8> =
        items.iter().map(|i| if i.flags & ITEM_HOT != 0 { i.spread.clamp(1, wire::MAX_SPREAD) } else { 1 }).collect();
    // Items that name segments are delivered there when the connection's
    // remote memory works; without it they are answered inline (as a GET
    // with FLAG_RDMA is), and the client stops naming.
    let remote = items.iter().any(|i| i.flags & ITEM_RDMA != 0).then(|| s.remote.get()).flatten();
    let segs: Vec<Vec<Segment>> = match &remote {
        Some(_) => items.iter().map(|i| i.segments()).collect(),
        None => Vec::new(),
    };
    let named = |i: usize| segs.get(i).is_some_and(|s| !s.is_empty());
    // The keys in the connection's tenant's namespace (crate::tenant).
    let keys: Vec<std::borrow::Cow<'_, [u8]>> = items.iter().map(|i| crate::tenant::ns_key(s.tenant, i.key)).collect();
    let mut out: Vec<Item> = Vec::with_capacity(items.len());
    let mut pending = false;
    for (i, key) in keys.iter().enumerate() {
        let item = match store.peek_cached(key, check.then_some(&geo)) {
            Some(GetOutcome::Hit(rec)) => Item::Mem(rec),
            Some(GetOutcome::Mismatch) => Item::Done(Status::Mismatch, None),
            _ => match store.try_record_size(key) {
                Some(Some(n)) => Item::Disk(n),
                Some(None) => {
                    store.count_miss(key);
                    Item::Done(Status::Miss, None)
                }
                None => Item::Unknown,
            },
        };
        // A hit to deliver into the client's memory waits for the transfer:
        // not answered from this task.
        pending |= matches!(item, Item::Disk(_) | Item::Unknown) || (named(i) && matches!(item, Item::Mem(_)));
        out.push(item);
    }
    if !pending {
        bound(shared, |i| &keys[i], |_| false, &mut out);
        count_asks(shared, &handoff, &out);
        return Begun::Answered(answer(shared, req, out, |i| &keys[i], &weights));
    }
    Begun::Disk(Started {
        keys: keys.into_iter().map(|k| k.into_owned()).collect(),
        handoff,
        weights,
        geo: check.then_some(geo),
        items: out,
        remote: remote.map(|r| (r, segs)),
    })
}

/// A batch with items still to read from disk.
pub struct Started {
    keys: Vec<Vec<u8>>,
    /// Which items are handoff asks.
    handoff: Vec<bool>,
    /// The reads each item stands for.
    weights: Vec<u8>,
    geo: Option<Geometry>,
    items: Vec<Item>,
    /// Where items that named segments go, when any did.
    remote: Option<Delivery>,
}

/// The connection's remote memory, and each item's segments (empty:
/// answered inline).
type Delivery = (Arc<dyn RemoteMemory>, Vec<Vec<Segment>>);

/// Reads the items of `s` that are on disk, delivers those that named
/// segments, and answers the batch.
pub async fn finish(shared: &Arc<Shared>, session: &Session, req: &ReqHeader, mut s: Started) -> Response {
    // Lengths the reactor could not look up without waiting.
    for (i, item) in s.items.iter_mut().enumerate() {
        if matches!(item, Item::Unknown) {
            let (store, key) = (shared.store.clone(), s.keys[i].clone());
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            *item = match tokio::task::spawn_blocking(move || store.record_size(&key)).await.unwrap_or(None) {
                Some(n) => Item::Disk(n),
                None => {
                    shared.store.count_miss(&s.keys[i]);
                    Item::Done(Status::Miss, None)
                }
            };
        }
    }
    let keys = &s.keys;
    let placed = |i: usize| s.remote.as_ref().is_some_and(|(_, segs)| !segs[i].is_empty());
    bound(shared, |i| &keys[i], placed, &mut s.items);
    // The records read count against --max-inflight until written out, as
    // a single get's do (never more than the whole budget, which would
    // wait forever).
    // A batch with nothing to read (memory hits to deliver) takes none.
    let bytes: u64 = s.items.iter().map(|i| if let Item::Disk(n) = i { *n } else { 0 }).sum();
    let budget: Option<OwnedSemaphorePermit> = match bytes {
        0 => None,
        _ => {
            let units = bytes.div_ceil(4096).clamp(1, u64::from(shared.inflight_units.max(1))) as u32;
            Some(shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open"))
        }
    };
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
    if let Some((remote, segs)) = &s.remote {
        deliver(session, remote, segs, &mut s.items).await;
    }
    count_asks(shared, &s.handoff, &s.items);
    let keys = &s.keys;
    let mut r = answer(shared, req, s.items, |i| &keys[i], &s.weights);
    r.budget = budget;
    r
}

/// Deliveries into the client's memory one batch has going at once.
const DELIVERIES_AT_ONCE: usize = 16;

/// Writes the payloads of the hits that named segments into them (by the
/// connection's remote memory), at most [`DELIVERIES_AT_ONCE`] at a time:
/// such an item is then answered with its header and key and
/// [`ITEM_PLACED`], or TOO_SMALL with them when its segments cannot hold
/// the payload. If a transfer fails, the remote memory is closed and the
/// items not placed are answered inline (within the answer's byte bound).
async fn deliver(session: &Session, remote: &Arc<dyn RemoteMemory>, segs: &[Vec<Segment>], items: &mut [Item]) {
    use futures_util::stream::{self, StreamExt};
    let mut todo = Vec::new();
    for (i, item) in items.iter_mut().enumerate() {
        let Item::Done(Status::Ok, Some(rec)) = item else { continue };
        if segs[i].is_empty() {
            continue;
        }
        let Ok(h) = PageHeader::decode(rec.as_slice()) else { continue };
        let pre = HEADER_LEN + usize::from(h.key_len);
        let room: u64 = segs[i].iter().map(|s| u64::from(s.len)).sum();
        if h.payload_len > room {
            // As over TCP: the caller learns the size it needs.
            *item = Item::Placed(Status::TooSmall, rec.clone(), pre);
            continue;
        }
        todo.push((i, rec.clone(), pre));
    }
    let done: Vec<(usize, usize, Result<(), String>)> = stream::iter(todo)
        .map(|(i, rec, pre)| async move { (i, pre, remote.deliver(rec, pre, &segs[i]).await) })
        .buffer_unordered(DELIVERIES_AT_ONCE)
        .collect()
        .await;
    let mut failed = false;
    for (i, pre, r) in done {
        match r {
            Ok(()) => {
                if let Item::Done(_, Some(rec)) = &items[i] {
                    items[i] = Item::Placed(Status::Ok, rec.clone(), pre);
                }
            }
            Err(e) => {
                if !failed {
                    tracing::warn!(peer = %session.out.peer, error = %e, "RDMA write of a batch get failed; answering over TCP");
                    session.remote.failed(remote);
                }
                failed = true;
            }
        }
    }
    if failed {
        // The items that go inline now must fit the answer's bound: walked
        // in request order, a named item whose record would take the
        // inline records past it is asked again (the others were bounded
        // already).
        let mut total = 0u64;
        for (i, item) in items.iter_mut().enumerate() {
            let Item::Done(_, Some(rec)) = &item else { continue };
            let len = rec.len() as u64;
            if !segs[i].is_empty() && total + len > MAX_BATCH_ANSWER {
                *item = Item::Over;
            } else {
                total += len;
            }
        }
    }
}

/// Counts the batch's handoff asks and their hits (as GET with
/// FLAG_HANDOFF counts each ask).
fn count_asks(shared: &Shared, handoff: &[bool], items: &[Item]) {
    // An item past the answer's bound is asked again (a single GET, which
    // counts itself): it is not an ask here.
    let asks = handoff.iter().zip(items).filter(|(h, i)| **h && !matches!(i, Item::Over)).count();
    if asks > 0 {
        let hit = |i: &Item| matches!(i, Item::Done(Status::Ok, _) | Item::Placed(Status::Ok, _, _));
        let hits = handoff.iter().zip(items).filter(|(h, i)| **h && hit(i)).count();
        shared.handoff.count_asks(asks, hits);
    }
}

/// Marks the items past the answer's byte bound (in request order; the
/// first item goes unless the frame could not carry it), and counts the
/// memory-tier hits that stay served. A memory-tier hit to be `placed` in
/// the client's memory carries no record in the answer; one read from disk
/// still counts (its record is held in the node's memory until delivered,
/// so the bound keeps a frame's reads within 64 MiB as for inline items).
fn bound<'k>(shared: &Shared, key: impl Fn(usize) -> &'k [u8], placed: impl Fn(usize) -> bool, items: &mut [Item]) {
    // A frame's body length is a u32: the heads and the longest messages
    // must fit beside the records, whatever the first item's size.
    let frame_room = u64::from(u32::MAX) - 8 - (BATCH_ITEM_HEAD + OVER.len()) as u64 * items.len() as u64;
    let mut total = 0u64;
    for (i, item) in items.iter_mut().enumerate() {
        let len = match item {
            Item::Mem(_) if placed(i) => 0,
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
/// Each page served counts as a read of its key ([`crate::heat`]; as
/// `weights[i]` reads), and a hot one is marked [`ITEM_HOT`] with its spread.
fn answer<'k>(
    shared: &Shared,
    req: &ReqHeader,
    items: Vec<Item>,
    key: impl Fn(usize) -> &'k [u8],
    weights: &[u8],
) -> Response {
    let mut parts = Vec::with_capacity(1 + 2 * items.len());
    let mut heads = wire::encode_batch_answer_head(items.len()).to_vec();
    for (i, item) in items.into_iter().enumerate() {
        let (status, mut flags, tail) = match item {
            Item::Done(s, rec) => (s, 0, rec.map(Part::Record)),
            Item::Placed(s, rec, pre) => (s, ITEM_PLACED, Some(Part::Bytes(rec.as_slice()[..pre].to_vec()))),
            Item::Over => (Status::Rejected, ITEM_AGAIN, Some(Part::Bytes(OVER.as_bytes().to_vec()))),
            Item::Mem(_) | Item::Disk(_) | Item::Unknown => (Status::Internal, 0, None),
        };
        let len = tail.as_ref().map_or(0, |t| match t {
            Part::Bytes(b) => b.len(),
            Part::Record(r) => r.len(),
        });
        let spread = if status == Status::Ok { shared.heat.read(key(i), weights[i]) } else { 0 };
        if spread > 0 {
            flags |= ITEM_HOT;
        }
        heads.extend_from_slice(&ItemHead { status, flags, spread, len: len as u32 }.encode());
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
    /// Answered on the reader's task ([`put_now`]): status, item flags and
    /// message.
    Answered(Status, u8, Vec<u8>),
    /// Checked and held back on the reader's task: it must reach media.
    ToMedia { flags: u8, copy_age: u16, p: crate::store::ToMedia, mem: OwnedSemaphorePermit },
    /// A record whose payload is in the client's memory ([`ITEM_RDMA`]):
    /// its header and key (`pre`), and the segments to read the payload
    /// from, `record_len` bytes in all.
    Remote { flags: u8, copy_age: u16, pre: Vec<u8>, segs: Vec<Segment>, record_len: usize },
}

/// Why an [`ITEM_RDMA`] put's memory was not taken: the item goes again on
/// its own, where it may wait for it.
const BUDGET_BUSY: &str = "not stored: this node's --max-inflight budget is busy; put it on its own";

/// Reads a remote item's payload into a record buffer: the buffer with its
/// share of `--max-inflight`, or the item's answer. The share is taken only
/// if free now: a frame holds the shares of its later items meanwhile, so
/// waiting here could wait on itself.
async fn fill_remote(
    shared: &Shared,
    s: &Session,
    pre: Vec<u8>,
    segs: Vec<Segment>,
    record_len: usize,
) -> Result<(PooledBuf, OwnedSemaphorePermit), (Status, u8, Vec<u8>)> {
    let Some(remote) = s.remote.get() else {
        return Err((Status::Unavailable, ITEM_RDMA_FAILED, b"rdma: no RDMA queue pair on this connection".to_vec()));
    };
    let units = (record_len as u64).div_ceil(4096).max(1) as u32;
    let Ok(mem) = shared.inflight_bytes.clone().try_acquire_many_owned(units) else {
        return Err((Status::Rejected, ITEM_AGAIN, BUDGET_BUSY.as_bytes().to_vec()));
    };
    let mut buf = shared.store.pool().get(record_len);
    buf.full_mut()[..pre.len()].copy_from_slice(&pre);
    match remote.fill(buf, pre.len(), record_len - pre.len(), &segs).await {
        Ok(mut buf) => {
            buf.set_len(record_len);
            Ok((buf, mem))
        }
        Err(e) => {
            tracing::warn!(peer = %s.out.peer, error = %e, "RDMA read of a batch put failed; the client sends it over TCP");
            s.remote.failed(&remote);
            Err((Status::Unavailable, ITEM_RDMA_FAILED, format!("rdma: {e}").into_bytes()))
        }
    }
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
            let (shared, s) = (&shared, &s);
            async move {
                let (flags, copy_age, step, mem) = match item {
                    PutItem::Refused(status, why) => return (status, 0, why.into_bytes()),
                    PutItem::Answered(status, flags, msg) => return (status, flags, msg),
                    PutItem::ToMedia { flags, copy_age, p, mem } => (flags, copy_age, PutStep::ToMedia(p), mem),
                    PutItem::Record { flags, copy_age, buf, mem } => (flags, copy_age, PutStep::Hop(buf), mem),
                    PutItem::Remote { flags, copy_age, pre, segs, record_len } => {
                        match fill_remote(shared, s, pre, segs, record_len).await {
                            Ok((buf, mem)) => {
                                let one = item_request(&req, flags, copy_age, buf.len());
                                (flags, copy_age, crate::ops::put_step(shared, s.tenant, &one, buf), mem)
                            }
                            Err(answer) => return answer,
                        }
                    }
                };
                let len = match &step {
                    PutStep::Hop(buf) => buf.len(),
                    _ => 0,
                };
                let one = item_request(&req, flags, copy_age, len);
                let r = crate::ops::put_later(shared, s.tenant, &one, step, t0).await;
                drop(mem);
                item_answer(r)
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

/// A BATCH_PUT item as the single PUT it stands for.
fn item_request(req: &ReqHeader, flags: u8, copy_age: u16, len: usize) -> ReqHeader {
    ReqHeader {
        op: Op::Put,
        flags: if flags & ITEM_HANDOFF != 0 { FLAG_HANDOFF } else { 0 },
        copy_age,
        body_len: len as u32,
        req_id: req.req_id,
    }
}

/// A batch item's answer: its status, item flags and message.
type ItemAnswer = (Status, u8, Vec<u8>);

/// A single put's answer as a batch item's.
fn item_answer(r: Response) -> ItemAnswer {
    let (status, rflags, msg) = r.into_item();
    let dup = if rflags & RSP_FLAG_DUPLICATE != 0 { ITEM_DUPLICATE } else { 0 };
    (status, dup, msg)
}

/// The part of a BATCH_PUT done on the reader's task, with no wait: each
/// record's [`crate::ops::put_step`] (most memory-acked puts end there).
/// `Ok`: every item is answered, and this is the batch's answer, to be sent
/// from this task (no hop to another task); `Err`: the items, those
/// answered marked so, for [`put`] to finish on a task of its own.
pub fn put_now(shared: &Shared, tenant: u32, req: &ReqHeader, items: Vec<PutItem>) -> Result<Response, Vec<PutItem>> {
    // Ok: the item's answer; Err: the item, to be finished later.
    let stepped: Vec<Result<ItemAnswer, PutItem>> = items
        .into_iter()
        .map(|item| match item {
            PutItem::Refused(status, why) => Ok((status, 0, why.into_bytes())),
            PutItem::Answered(status, flags, msg) => Ok((status, flags, msg)),
            PutItem::Record { flags, copy_age, buf, mem } => {
                let one = item_request(req, flags, copy_age, buf.len());
                match crate::ops::put_step(shared, tenant, &one, buf) {
                    PutStep::Done(r) => Ok(item_answer(r)),
                    PutStep::ToMedia(p) => Err(PutItem::ToMedia { flags, copy_age, p, mem }),
                    PutStep::Hop(buf) => Err(PutItem::Record { flags, copy_age, buf, mem }),
                }
            }
            PutItem::Remote { .. } | PutItem::ToMedia { .. } => Err(item),
        })
        .collect();
    if stepped.iter().all(Result::is_ok) {
        return Ok(small_answer(req, stepped.into_iter().flatten().collect()));
    }
    Err(stepped
        .into_iter()
        .map(|s| match s {
            Ok((status, flags, msg)) => PutItem::Answered(status, flags, msg),
            Err(item) => item,
        })
        .collect())
}

/// BATCH_DELETE: each key's tombstone first (as DELETE), then the deletes,
/// in one pass off the reactor (each appends to an index journal).
pub async fn delete(shared: &Arc<Shared>, tenant: u32, req: &ReqHeader, body: &[u8]) -> Response {
    let items = match wire::decode_batch_delete(body) {
        Ok(i) => i,
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
    };
    let keys: Vec<Vec<u8>> = items.iter().map(|i| crate::tenant::ns_key(tenant, i.key).into_owned()).collect();
    for k in &keys {
        shared.handoff.deleted(kv_common::page::key_hash(k));
    }
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
        .map(|(status, flags, msg)| {
            (ItemHead { status: *status, flags: *flags, spread: 0, len: msg.len() as u32 }, &msg[..])
        })
        .collect();
    respond(req, Status::Ok, 0, Body::Bytes(wire::encode_batch_answer(&heads)))
}
