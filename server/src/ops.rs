//! The operations of the data protocol (docs/PROTOCOL.md §3), above the
//! framing ([`crate::frame`]): each request's task runs one and writes its
//! answer. A put has one pipeline whatever way its payload came (inline in
//! the frame, or filled from the client's memory by a transport:
//! [`crate::transport`]), and a get one answer (the record inline, or
//! delivered to the client's memory).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kv_common::page::{Geometry, PageHeader, HEADER_LEN};
use kv_common::status::Status;
use kv_common::wire::{self, KeyRequest, Op, ReqHeader, Segment};
use kv_common::wire::{
    FLAG_CHECK_GEOMETRY, FLAG_HANDOFF, FLAG_RDMA, RSP_FLAG_DUPLICATE, RSP_FLAG_RDMA, RSP_FLAG_RDMA_FAILED,
};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::frame::{error_response, respond, Body, Out, Response};
use crate::state::Shared;
use crate::store::{GetOutcome, Held, PooledBuf, Presence, PutOutcome, StoreError};
use crate::transport::Slot;

/// A connection as its requests see it: where answers go, and the client's
/// memory when a transport reaches it.
pub struct Session {
    pub out: Out,
    pub remote: Slot,
    /// The tenant its hello's credential bound it to: its keys are taken
    /// in that tenant's namespace (crate::tenant).
    pub tenant: u32,
}

/// Counts an answered request and its service time (from `t0`, when the
/// whole request was in hand).
pub fn counted(shared: &Shared, op: Op, t0: Instant, r: Response) -> Response {
    shared.ops.record(op, r.status, t0.elapsed());
    r
}

/// The one place internal store errors become wire statuses.
fn store_error_status(e: &StoreError) -> Status {
    match e {
        StoreError::BadRecord(_) | StoreError::TenantKey(_) => Status::BadRequest,
        // The client computed the CRC over what it meant to send: bytes
        // damaged on the way (not a caller error; the put may be retried).
        StoreError::BadPayload => Status::Corrupt,
        StoreError::NoDisk => Status::Unavailable,
        StoreError::Full(_) | StoreError::TooLarge(_) => Status::Rejected,
    }
}

/// Runs a request other than PUT whose body is in hand, answering on `s`.
/// Ops answered from memory alone are answered here, on the reader's task;
/// the rest get a task of their own.
pub async fn dispatch(
    shared: &Arc<Shared>,
    s: &Arc<Session>,
    req: ReqHeader,
    body: Vec<u8>,
    permit: OwnedSemaphorePermit,
) {
    let t0 = Instant::now();
    if req.op == Op::BatchGet {
        match crate::batch::start(shared, s, &req, &body) {
            crate::batch::Begun::Answered(r) => {
                s.out.send(counted(shared, req.op, t0, r)).await;
                drop(permit);
            }
            crate::batch::Begun::Disk(started) => {
                let (shared, s) = (shared.clone(), s.clone());
                tokio::spawn(async move {
                    let r = crate::batch::finish(&shared, &s, &req, started).await;
                    s.out.send(counted(&shared, req.op, t0, r)).await;
                    drop(permit);
                });
            }
        }
        return;
    }
    if !matches!(req.op, Op::Get | Op::RdmaConnect | Op::Delete | Op::BatchDelete) {
        if let Some(r) = handle_small(shared, s.tenant, &req, &body) {
            s.out.send(counted(shared, req.op, t0, r)).await;
            drop(permit);
            return;
        }
    }
    let (shared, s) = (shared.clone(), s.clone());
    tokio::spawn(async move {
        let r = match req.op {
            Op::Get => {
                let r = handle_get(&shared, &s, &req, &body).await;
                if req.flags & FLAG_HANDOFF != 0 {
                    shared.handoff.count_asks(1, usize::from(r.status == Status::Ok.to_wire()));
                }
                r
            }
            Op::RdmaConnect => connect(&shared, &s, req, body).await,
            Op::Delete => delete(&shared, s.tenant, &req, &body).await,
            Op::BatchDelete => crate::batch::delete(&shared, s.tenant, &req, &body).await,
            // An index lock was busy (a put, a checkpoint copy) or the op
            // must take locks: answered from the blocking pool instead of
            // making the reactor wait.
            _ => {
                let (s2, tenant) = (shared.clone(), s.tenant);
                // Blocking-pool work waits for an I/O slot like a get does.
                let _io = shared.io_slots.acquire().await.expect("semaphore open");
                tokio::task::spawn_blocking(move || handle_blocking(&s2, tenant, &req, &body))
                    .await
                    .unwrap_or_else(|_| error_response(&req, Status::Internal, "internal error"))
            }
        };
        s.out.send(counted(&shared, req.op, t0, r)).await;
        drop(permit);
    });
}

/// Sets up the connection's remote memory (RDMA_CONNECT) through the node's
/// transport; creating and connecting a queue pair are system calls, so off
/// the reactor.
async fn connect(shared: &Arc<Shared>, s: &Arc<Session>, req: ReqHeader, body: Vec<u8>) -> Response {
    let (fabric, peer) = (shared.fabric.clone(), s.out.peer);
    match tokio::task::spawn_blocking(move || fabric.connect(peer, &body)).await {
        Ok(Ok(setup)) => {
            if let Some(remote) = setup.remote {
                s.remote.set(remote);
            }
            respond(&req, Status::Ok, 0, Body::Bytes(setup.answer))
        }
        Ok(Err(e)) => error_response(&req, Status::BadRequest, &e),
        Err(_) => error_response(&req, Status::Internal, "internal error"),
    }
}

/// DELETE: appends to the index journal (a system call, so off the reactor).
async fn delete(shared: &Arc<Shared>, tenant: u32, req: &ReqHeader, body: &[u8]) -> Response {
    let k = match wire::decode_key(body) {
        Ok(k) => crate::tenant::ns_key(tenant, k),
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
    };
    // The tombstone first: a handoff copy stored meanwhile is then removed
    // by this delete or by itself.
    shared.handoff.deleted(kv_common::page::key_hash(&k));
    let (store, k) = (shared.store.clone(), k.into_owned());
    // Blocking-pool work waits for an I/O slot like a get does.
    let _io = shared.io_slots.acquire().await.expect("semaphore open");
    match tokio::task::spawn_blocking(move || store.delete(&k)).await {
        Ok(true) => respond(req, Status::Ok, 0, Body::Empty),
        Ok(false) => respond(req, Status::Miss, 0, Body::Empty),
        Err(_) => error_response(req, Status::Internal, "internal error"),
    }
}

/// A put's record buffer of `len` bytes starting with `head`, and its share
/// of `--max-inflight` (waited for: the node's memory bounds the puts it
/// takes at once).
pub async fn reserve(shared: &Shared, len: usize, head: &[u8]) -> (PooledBuf, OwnedSemaphorePermit) {
    let units = (len as u64).div_ceil(4096).max(1) as u32;
    let mem = shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
    let mut buf = shared.store.pool().get(len);
    buf.full_mut()[..head.len()].copy_from_slice(head);
    (buf, mem)
}

/// Where a put's payload is.
pub enum Payload {
    /// It came inline in the frame, and the reader's task took its first
    /// step ([`put_step`]) without settling it.
    Stepped(PutStep, OwnedSemaphorePermit),
    /// In the client's memory: the record's header and key came in the
    /// frame (`pre`), the payload is filled from `segs`.
    Remote { pre: Vec<u8>, segs: Vec<Segment>, record_len: usize },
}

/// The put pipeline: the payload into the record's buffer, then the store,
/// then the answer.
/// `t0`: when the whole request was in hand (its service time starts).
pub async fn put(
    shared: Arc<Shared>,
    s: Arc<Session>,
    req: ReqHeader,
    payload: Payload,
    permit: OwnedSemaphorePermit,
    t0: Instant,
) {
    let (step, mem) = match payload {
        Payload::Stepped(step, mem) => (step, mem),
        Payload::Remote { pre, segs, record_len } => {
            let Some(remote) = s.remote.get() else {
                let r = transport_failed(&req, "no RDMA queue pair on this connection");
                return s.out.send(counted(&shared, req.op, t0, r)).await;
            };
            let (buf, mem) = reserve(&shared, record_len, &pre).await;
            match remote.fill(buf, pre.len(), record_len - pre.len(), &segs).await {
                Ok(mut buf) => {
                    buf.set_len(record_len);
                    (put_step(&shared, s.tenant, &req, buf), mem)
                }
                Err(e) => {
                    tracing::warn!(peer = %s.out.peer, error = %e, "RDMA read of a put failed; the client sends it over TCP");
                    s.remote.failed(&remote);
                    let r = transport_failed(&req, &e);
                    return s.out.send(counted(&shared, req.op, t0, r)).await;
                }
            }
        }
    };
    let r = put_later(&shared, s.tenant, &req, step, t0).await;
    drop(mem);
    s.out.send(counted(&shared, req.op, t0, r)).await;
    drop(permit);
}

/// The transfer could not be made: nothing was done, the client sends the
/// request again inline.
fn transport_failed(req: &ReqHeader, why: &str) -> Response {
    respond(req, Status::Unavailable, RSP_FLAG_RDMA_FAILED, Body::Bytes(format!("rdma: {why}").into_bytes()))
}

/// Answers a get hit: delivered into the request's segments when it named
/// some and the connection's remote memory works (the body then holds the
/// header and key only), else with the whole record inline.
async fn answer_hit(
    shared: &Shared,
    s: &Session,
    req: &ReqHeader,
    key: &[u8],
    rec: Arc<PooledBuf>,
    segs: &[Segment],
    budget: Option<OwnedSemaphorePermit>,
) -> Response {
    // A page served is a read of its key (once, when it is answered OK); a
    // hot key's answer says so (docs/ARCHITECTURE.md, "Hot keys").
    let hot = || wire::hot_flags(shared.heat.read(key, req.read_weight()));
    let inline = |rec: Arc<PooledBuf>, budget| {
        let mut r = respond(req, Status::Ok, hot(), Body::Record(rec));
        r.budget = budget;
        r
    };
    if segs.is_empty() {
        return inline(rec, budget);
    }
    let Some(remote) = s.remote.get() else { return inline(rec, budget) };
    let Ok(h) = PageHeader::decode(rec.as_slice()) else { return inline(rec, budget) };
    let pre = HEADER_LEN + usize::from(h.key_len);
    let room: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
    if rec.len().saturating_sub(pre) as u64 > room {
        // As over TCP: the caller learns the size it needs.
        return respond(req, Status::TooSmall, 0, Body::Bytes(rec.as_slice()[..pre].to_vec()));
    }
    match remote.deliver(rec.clone(), pre, segs).await {
        Ok(()) => respond(req, Status::Ok, RSP_FLAG_RDMA | hot(), Body::Bytes(rec.as_slice()[..pre].to_vec())),
        Err(e) => {
            tracing::warn!(peer = %s.out.peer, error = %e, "RDMA write of a get failed; answering over TCP");
            s.remote.failed(&remote);
            inline(rec, budget)
        }
    }
}

/// How far a put got on the task that has its record ([`put_step`]).
pub(crate) enum PutStep {
    /// Answered: refused, a duplicate, or acknowledged from memory.
    Done(Response),
    /// Checked and held back: it must reach media first.
    ToMedia(crate::store::ToMedia),
    /// Not begun (a copy of a handoff, acks on media, a record too large
    /// to check here, or a disk's lock busy now): stored off the reactor.
    Hop(PooledBuf),
}

/// The part of a put that needs no disk I/O and no wait: most memory-acked
/// puts end here, answered, without a hop to a blocking thread and back.
pub(crate) fn put_step(shared: &Shared, tenant: u32, req: &ReqHeader, buf: PooledBuf) -> PutStep {
    if shared.draining.load(Ordering::Relaxed) {
        return PutStep::Done(error_response(
            req,
            Status::Rejected,
            "the node is draining (shutting down): it takes no puts",
        ));
    }
    if req.flags & FLAG_HANDOFF != 0 || !shared.store.acks_in_memory() {
        return PutStep::Hop(buf);
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.store.try_put_held(buf, tenant))) {
        Ok(Ok(Held::Done(r))) => PutStep::Done(put_answer(req, Ok(r))),
        Ok(Ok(Held::ToMedia(p))) => PutStep::ToMedia(p),
        Ok(Err(buf)) => PutStep::Hop(buf),
        Err(_) => PutStep::Done(put_answer(req, Err("a put panicked".to_string()))),
    }
}

/// The rest of a put after [`put_step`]: its answer.
pub(crate) async fn put_later(
    shared: &Arc<Shared>,
    tenant: u32,
    req: &ReqHeader,
    step: PutStep,
    t0: Instant,
) -> Response {
    let store = shared.store.clone();
    // Err: why the put's task failed (a panic), answered as Internal.
    let res: Result<Result<PutOutcome, StoreError>, String> = match step {
        PutStep::Done(r) => return r,
        PutStep::Hop(buf) if req.flags & FLAG_HANDOFF != 0 => return store_copy(shared, tenant, req, buf, t0).await,
        PutStep::ToMedia(p) => {
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            tokio::task::spawn_blocking(move || store.put_to_media(p)).await.map_err(|e| e.to_string())
        }
        PutStep::Hop(buf) => {
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            tokio::task::spawn_blocking(move || store.put_in(buf, tenant)).await.map_err(|e| e.to_string())
        }
    };
    put_answer(req, res)
}

/// A put's answer from its store's outcome (Err: why its task failed).
fn put_answer(req: &ReqHeader, res: Result<Result<PutOutcome, StoreError>, String>) -> Response {
    match res {
        Ok(Ok(PutOutcome::Stored)) => respond(req, Status::Ok, 0, Body::Empty),
        Ok(Ok(PutOutcome::Duplicate)) => respond(req, Status::Ok, RSP_FLAG_DUPLICATE, Body::Empty),
        Ok(Err(e)) => error_response(req, store_error_status(&e), &e.to_string()),
        Err(e) => {
            tracing::error!(error = %e, "put task failed");
            error_response(req, Status::Internal, "internal error")
        }
    }
}

/// Stores a ring-handoff copy (a PUT with FLAG_HANDOFF; docs/PROTOCOL.md
/// §2.9, docs/ARCHITECTURE.md "Ring transitions"): refused when older than
/// half the window, or when its key was deleted within the window (checked
/// before the store and again after; handoff.rs). Copies go straight to
/// media, never acknowledged from memory, and what the second check takes
/// out is the record this copy stored, by its stamp, never a put
/// acknowledged after the delete. The caller holds the copy's share of
/// `--max-inflight` until this returns.
async fn store_copy(shared: &Arc<Shared>, tenant: u32, req: &ReqHeader, buf: PooledBuf, t0: Instant) -> Response {
    let h = &shared.handoff;
    // None: not a record, which the store refuses with the reason.
    let copy = record_key(buf.as_slice()).map(|(key, len)| {
        let key = crate::tenant::ns_key(tenant, &key).into_owned();
        (kv_common::page::key_hash(&key), key, len)
    });
    if copy.as_ref().is_some_and(|(hash, _, _)| h.refuses(*hash)) {
        h.refused.fetch_add(1, Ordering::Relaxed);
        return error_response(req, Status::Rejected, COPY_OF_DELETED);
    }
    // Its age when sent, and the time it has spent here since.
    let age = wire::decode_copy_age(req.copy_age) + t0.elapsed();
    if copy.is_some() && h.too_old(age) {
        h.too_old.fetch_add(1, Ordering::Relaxed);
        let msg = format!(
            "handoff copy too old: its page was read {:.1} s ago, over half this node's handoff window ({} s)",
            age.as_secs_f64(),
            h.window.as_secs()
        );
        return error_response(req, Status::Rejected, &msg);
    }
    let store = shared.store.clone();
    let res = {
        let _io = shared.io_slots.acquire().await.expect("semaphore open");
        tokio::task::spawn_blocking(move || store.put_copy(buf, tenant)).await.map_err(|e| e.to_string())
    };
    if let (Ok(Ok((stored, stamp))), Some((hash, key, len))) = (&res, copy) {
        if let Some(hook) = h.after_copy_stored.get().cloned() {
            let _ = tokio::task::spawn_blocking(move || hook()).await;
        }
        // Deleted while it was being stored: this copy's record is taken
        // out again (a duplicate stored nothing: the record there is a put
        // made after the delete, or one the delete removes itself).
        if let (PutOutcome::Stored, Some(stamp)) = (stored, *stamp) {
            if h.refuses(hash) {
                let (store, k) = (shared.store.clone(), key);
                let _ = tokio::task::spawn_blocking(move || store.delete_if_stamp(&k, stamp)).await;
                h.refused.fetch_add(1, Ordering::Relaxed);
                return error_response(req, Status::Rejected, COPY_OF_DELETED);
            }
        }
        h.copies.fetch_add(1, Ordering::Relaxed);
        h.copy_bytes.fetch_add(len, Ordering::Relaxed);
        if req.flags & wire::FLAG_FILL != 0 {
            h.filled(hash, &key);
        }
    }
    put_answer(req, res.map(|r| r.map(|(o, _)| o)))
}

async fn handle_get(shared: &Arc<Shared>, s: &Session, req: &ReqHeader, body: &[u8]) -> Response {
    let (segs, body) = if req.flags & FLAG_RDMA != 0 {
        match wire::split_segments(body) {
            Ok(s) => s,
            Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
        }
    } else {
        (Vec::new(), body)
    };
    let kr = match KeyRequest::decode(body) {
        Ok(k) => k,
        Err(e) => return error_response(req, Status::BadRequest, &e.to_string()),
    };
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    let geo = kr.geometry;
    let key = crate::tenant::ns_key(s.tenant, kr.key);
    let key = &key[..];
    // A page in the memory tier is answered here, without a hop to the
    // blocking pool (its buffer is shared, not copied; it is bounded by
    // --mem-cap, not by the in-flight budget).
    match shared.store.get_cached(key, check.then_some(&geo)) {
        Some(GetOutcome::Hit(rec)) => return answer_hit(shared, s, req, key, rec, &segs, None).await,
        Some(GetOutcome::Mismatch) => return respond(req, Status::Mismatch, 0, Body::Empty),
        _ => {}
    }
    // The record's bytes count against --max-inflight until written out.
    // Its size comes from the index without blocking this reactor thread
    // behind a put, an eviction or a checkpoint holding the index lock.
    let size = match shared.store.try_record_size(key) {
        Some(s) => s,
        None => {
            let (store, key) = (shared.store.clone(), key.to_vec());
            let _io = shared.io_slots.acquire().await.expect("semaphore open");
            tokio::task::spawn_blocking(move || store.record_size(&key)).await.unwrap_or(None)
        }
    };
    let Some(size) = size else {
        shared.store.count_miss(key);
        return respond(req, Status::Miss, 0, Body::Empty);
    };
    let units = size.div_ceil(4096).clamp(1, shared.limits.max_record.div_ceil(4096)) as u32;
    let budget = shared.inflight_bytes.clone().acquire_many_owned(units).await.expect("semaphore open");
    let owned = key.to_vec();
    let store = shared.store.clone();
    let res = {
        let _io = shared.io_slots.acquire().await.expect("semaphore open");
        tokio::task::spawn_blocking(move || store.get(&owned, check.then_some(&geo))).await
    };
    match res {
        Ok(GetOutcome::Hit(rec)) => answer_hit(shared, s, req, key, rec, &segs, Some(budget)).await,
        Ok(GetOutcome::Mismatch) => respond(req, Status::Mismatch, 0, Body::Empty),
        Ok(GetOutcome::Miss) => respond(req, Status::Miss, 0, Body::Empty),
        Err(e) => {
            tracing::error!(error = %e, "get task failed");
            error_response(req, Status::Internal, "internal error")
        }
    }
}

/// Why a handoff copy is refused (REJECTED).
const COPY_OF_DELETED: &str = "handoff copy of a key deleted within the handoff window";

/// Counts a handoff ask's keys (EXIST, BATCH_EXIST with FLAG_HANDOFF).
fn count_handoff(shared: &Shared, req: &ReqHeader, found: &[Presence]) {
    if req.flags & FLAG_HANDOFF != 0 {
        let hits = found.iter().filter(|p| matches!(p, Presence::Present)).count();
        shared.handoff.count_asks(found.len(), hits);
    }
}

/// The key of a received record and its payload length (None: not a
/// record; the store refuses it with the reason).
fn record_key(rec: &[u8]) -> Option<(Vec<u8>, u64)> {
    let h = PageHeader::decode(rec).ok()?;
    let key = rec.get(HEADER_LEN..HEADER_LEN + usize::from(h.key_len))?;
    Some((key.to_vec(), h.payload_len))
}

fn presence_status(p: Presence) -> Status {
    match p {
        Presence::Present => Status::Ok,
        Presence::Mismatch => Status::Mismatch,
        Presence::Absent => Status::Miss,
    }
}

/// Requests answered from memory alone, inline on the reactor; None when
/// that would mean waiting for a lock (then [`handle_blocking`] answers).
fn handle_small(shared: &Shared, tenant: u32, req: &ReqHeader, body: &[u8]) -> Option<Response> {
    let store = &shared.store;
    match req.op {
        Op::Exist | Op::BatchExist => answer_exist(shared, tenant, req, body, |keys, geo| match keys {
            [key] => store.try_exist(key, geo).map(Found::One),
            keys => store.try_exist_batch(keys, geo).map(Found::Many),
        }),
        Op::Ping => Some(respond(req, Status::Ok, 0, Body::Bytes(body.to_vec()))),
        Op::Stats => None,
        Op::Put | Op::Get | Op::Delete | Op::RdmaConnect | Op::BatchGet | Op::BatchPut | Op::BatchDelete => {
            Some(error_response(req, Status::Internal, "misrouted op"))
        }
    }
}

/// The presence of an exist's keys: one key's without an allocation.
enum Found {
    One(Presence),
    Many(Vec<Presence>),
}

impl Found {
    fn as_slice(&self) -> &[Presence] {
        match self {
            Found::One(p) => std::slice::from_ref(p),
            Found::Many(v) => v,
        }
    }
}

/// EXIST and BATCH_EXIST, the keys' presence found by `lookup` (None: it
/// would have to wait for a lock, and so this answers None too).
fn answer_exist(
    shared: &Shared,
    tenant: u32,
    req: &ReqHeader,
    body: &[u8],
    lookup: impl Fn(&[&[u8]], Option<&Geometry>) -> Option<Found>,
) -> Option<Response> {
    let check = req.flags & FLAG_CHECK_GEOMETRY != 0;
    let (one, many);
    let (geo, keys): (Geometry, &[&[u8]]) = match req.op {
        Op::Exist => match KeyRequest::decode(body) {
            Ok(kr) => {
                one = [kr.key];
                (kr.geometry, &one)
            }
            Err(e) => return Some(error_response(req, Status::BadRequest, &e.to_string())),
        },
        _ => match wire::decode_batch_exist(body) {
            Ok((geo, keys)) => {
                many = keys;
                (geo, &many)
            }
            Err(e) => return Some(error_response(req, Status::BadRequest, &e.to_string())),
        },
    };
    // In the tenant's namespace (crate::tenant); the default tenant's keys
    // are used as they came.
    let ns = crate::tenant::ns_keys(tenant, keys);
    let ns_refs: Vec<&[u8]>;
    let keys = match &ns {
        Some(ns) => {
            ns_refs = ns.iter().map(|k| &k[..]).collect();
            &ns_refs[..]
        }
        None => keys,
    };
    let found = lookup(keys, check.then_some(&geo))?;
    let found = found.as_slice();
    count_handoff(shared, req, found);
    shared.store.warm(keys, found);
    Some(match req.op {
        Op::Exist => respond(req, presence_status(found[0]), 0, Body::Empty),
        _ => {
            let st: Vec<Status> = found.iter().copied().map(presence_status).collect();
            respond(req, Status::Ok, 0, Body::Bytes(wire::encode_batch_status(&st)))
        }
    })
}

/// The same requests, allowed to wait for locks (blocking pool only).
fn handle_blocking(shared: &Shared, tenant: u32, req: &ReqHeader, body: &[u8]) -> Response {
    let store = &shared.store;
    let exist = |keys: &[&[u8]], geo: Option<&Geometry>| match keys {
        [key] => Some(Found::One(store.exist(key, geo))),
        keys => Some(Found::Many(keys.iter().map(|k| store.exist(k, geo)).collect())),
    };
    match req.op {
        Op::Exist | Op::BatchExist => answer_exist(shared, tenant, req, body, exist).unwrap_or_else(|| {
            // `exist` always answers; should that change, an error, not a panic.
            error_response(req, Status::Internal, "internal error")
        }),
        Op::Stats => {
            let json = serde_json::to_vec(&*shared.stats()).unwrap_or_default();
            respond(req, Status::Ok, 0, Body::Bytes(json))
        }
        _ => handle_small(shared, tenant, req, body)
            .unwrap_or_else(|| error_response(req, Status::Internal, "misrouted op")),
    }
}
