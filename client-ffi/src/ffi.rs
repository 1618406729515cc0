//! The C ABI (`include/kvclient.h`; README.md, "C ABI conventions"). All raw-pointer
//! handling of the library lives here: every export checks its pointers
//! (NULL is `KV_EINVAL`, never a crash), catches panics at the boundary
//! (`KV_EINTERNAL`, message in `kv_last_error`), and converts C views into
//! Rust slices for the blocking client. Status codes are never reused.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kv_common::page::{Geometry, MAX_KEY_LEN};
use kv_common::status::Status;

use crate::blocking::BlockingClient;
use crate::members::parse_members;
use crate::options::Options;

/// Done / hit.
pub const KV_OK: c_int = 0;
/// Not stored.
pub const KV_MISS: c_int = 1;
/// Stored page has another geometry or key.
pub const KV_MISMATCH: c_int = 2;
/// Checksum failed.
pub const KV_CORRUPT: c_int = 3;
/// Caller buffer too small; `*out_len` holds the size needed.
pub const KV_TOO_SMALL: c_int = 4;
/// Owner unreachable, cooling down, or no members.
pub const KV_UNAVAILABLE: c_int = 5;
/// The operation timed out.
pub const KV_TIMEOUT: c_int = 6;
/// The node refused the write (full, too large, shutting down).
pub const KV_REJECTED: c_int = 7;
/// Bad argument (null pointer, bad string, bad options).
pub const KV_EINVAL: c_int = -1;
/// Bug; message in `kv_last_error()`.
pub const KV_EINTERNAL: c_int = -2;
/// Refused: missing or wrong auth token (a misconfiguration, never a miss).
pub const KV_EDENIED: c_int = -3;

/// Largest number of segments one item may have (`iovcnt` of one item).
pub const MAX_ITEM_IOVCNT: usize = 4096;
/// Largest number of items in one batch call.
pub const MAX_BATCH_ITEMS: usize = 65536;

/// A caller buffer segment.
#[repr(C)]
pub struct kv_iovec {
    pub base: *mut c_void,
    pub len: usize,
}

/// The model geometry stamped on put and required on get.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kv_geometry {
    pub model_hash: u64,
    pub page_size: u32,
    pub dtype_tag: u32,
    pub tp_size: u16,
    pub tp_rank: u16,
    pub layer_num: u16,
    pub head_num: u16,
    pub head_dim: u16,
    pub flags: u16,
}

/// The client handle as C sees it: an opaque token, never dereferenced
/// (see [`handles`]). The type exists only to give the pointer a name.
pub struct kv_client {
    _opaque: [u8; 0],
}

fn set_error(msg: impl Into<String>) {
    crate::error::set_message(msg);
}

/// Refuses output segments that overlap (within an item or across a
/// batch): two answers landing in the same bytes would make one of them a
/// hit over the other's data.
fn no_overlap(views: &[&mut [u8]]) -> Result<(), c_int> {
    let mut ranges: Vec<(usize, usize)> =
        views.iter().filter(|v| !v.is_empty()).map(|v| (v.as_ptr() as usize, v.len())).collect();
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(einval("output buffers overlap"));
    }
    Ok(())
}

fn code(s: Status) -> c_int {
    match s {
        Status::BadRequest => KV_EINVAL,
        Status::Internal => KV_EINTERNAL,
        s => s.code(),
    }
}

/// Runs `f` behind the panic boundary.
fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(format!("internal error (panic): {msg}"));
            fallback
        }
    }
}

/// The body of an export returning a status: panics caught, `Err(code)`
/// returned as it is.
fn entry(f: impl FnOnce() -> Result<c_int, c_int>) -> c_int {
    guard(KV_EINTERNAL, || f().unwrap_or_else(|e| e))
}

fn einval(msg: impl Into<String>) -> c_int {
    set_error(msg);
    KV_EINVAL
}

/// A C string argument as text; NULL or invalid UTF-8 is an error.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string valid for the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, c_int> {
    if p.is_null() {
        return Err(einval(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, NUL-terminated and valid for the call (caller's contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| einval(format!("{what} is not valid UTF-8")))
}

/// A key argument: 1..=1024 bytes.
///
/// # Safety
/// As [`text`].
unsafe fn key<'a>(p: *const c_char) -> Result<&'a [u8], c_int> {
    if p.is_null() {
        return Err(einval("key is NULL"));
    }
    // SAFETY: non-NULL, NUL-terminated and valid for the call (caller's contract).
    let k = unsafe { CStr::from_ptr(p) }.to_bytes();
    if k.is_empty() || k.len() > MAX_KEY_LEN {
        return Err(einval(format!("key length {} outside 1..=1024", k.len())));
    }
    Ok(k)
}

/// The client behind a live handle, held for the duration of a call.
fn client(c: *const kv_client) -> Result<handles::Call, c_int> {
    if c.is_null() {
        return Err(einval("client handle is NULL"));
    }
    handles::enter(c as usize).ok_or_else(|| einval("client handle is closed or was never opened"))
}

/// The per-item segment limit (README.md, "C ABI conventions": limits apply per item).
fn item_iovcnt(n: usize) -> Result<(), c_int> {
    if n > MAX_ITEM_IOVCNT {
        return Err(einval(format!("iovcnt {n} of one item is over {MAX_ITEM_IOVCNT}")));
    }
    Ok(())
}

/// The per-call item limit of batches.
fn batch_len(n: usize) -> Result<(), c_int> {
    if n > MAX_BATCH_ITEMS {
        return Err(einval(format!("batch of {n} items is over {MAX_BATCH_ITEMS}")));
    }
    Ok(())
}

/// Refuses segment lengths no buffer can have (a slice is at most
/// `isize::MAX` bytes), one by one and in total, before any view is made.
fn check_lengths(v: &[kv_iovec]) -> Result<(), c_int> {
    let mut total: usize = 0;
    for s in v {
        total = total
            .checked_add(s.len)
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or_else(|| einval(format!("iov segment lengths add up past {} bytes", isize::MAX)))?;
    }
    Ok(())
}

/// Read-only views of `n` iovecs.
///
/// # Safety
/// `iov` must be NULL (then `n` must be 0) or point to `n` iovecs whose
/// `base` is valid for reads of `len` bytes for the call.
unsafe fn read_views<'a>(iov: *const kv_iovec, n: usize) -> Result<Vec<&'a [u8]>, c_int> {
    item_iovcnt(n)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    if iov.is_null() {
        return Err(einval("iov is NULL"));
    }
    // SAFETY: iov points to n iovecs (caller's contract).
    let v = unsafe { std::slice::from_raw_parts(iov, n) };
    check_lengths(v)?;
    v.iter()
        .map(|s| match (s.base.is_null(), s.len) {
            (_, 0) => Ok(&[][..]),
            (true, _) => Err(einval("iov segment base is NULL")),
            // SAFETY: base is valid for len readable bytes (caller's contract).
            (false, len) => Ok(unsafe { std::slice::from_raw_parts(s.base as *const u8, len) }),
        })
        .collect()
}

/// Writable views of `n` iovecs.
///
/// # Safety
/// As [`read_views`], for writes; the segments must not overlap.
unsafe fn write_views<'a>(iov: *const kv_iovec, n: usize) -> Result<Vec<&'a mut [u8]>, c_int> {
    item_iovcnt(n)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    if iov.is_null() {
        return Err(einval("iov is NULL"));
    }
    // SAFETY: iov points to n iovecs (caller's contract).
    let v = unsafe { std::slice::from_raw_parts(iov, n) };
    check_lengths(v)?;
    v.iter()
        .map(|s| match (s.base.is_null(), s.len) {
            (_, 0) => Ok(&mut [][..]),
            (true, _) => Err(einval("iov segment base is NULL")),
            // SAFETY: base is valid for len writable bytes, not aliased by
            // another segment (caller's contract).
            (false, len) => Ok(unsafe { std::slice::from_raw_parts_mut(s.base as *mut u8, len) }),
        })
        .collect()
}

fn done(s: Status) -> c_int {
    let why = crate::error::take_last_failure();
    if s != Status::Ok {
        set_error(match why {
            Some(w) => format!("not served: {}: {w}", s.name()),
            None => format!("not served: {}", s.name()),
        });
    }
    code(s)
}

/// Opens a client. See README.md, "C ABI conventions" and the header.
///
/// # Safety
/// `members` and `options` are NULL (options only) or NUL-terminated
/// strings; `geo` points to a `kv_geometry`.
#[no_mangle]
pub unsafe extern "C" fn kv_open(
    members: *const c_char,
    geo: *const kv_geometry,
    options: *const c_char,
) -> *mut kv_client {
    guard(std::ptr::null_mut(), || {
        let open = || -> Result<*mut kv_client, c_int> {
            // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
            let members = unsafe { text(members, "members") }?;
            if geo.is_null() {
                return Err(einval("geometry is NULL"));
            }
            // SAFETY: non-NULL and pointing to a kv_geometry (caller's contract).
            let g = unsafe { *geo };
            // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
            let opts = if options.is_null() { "" } else { unsafe { text(options, "options") }? };
            let members = parse_members(members).map_err(einval)?;
            let opts = Options::parse(opts).map_err(einval)?;
            let geometry = Geometry {
                model_hash: g.model_hash,
                page_size: g.page_size,
                dtype_tag: g.dtype_tag,
                tp_size: g.tp_size,
                tp_rank: g.tp_rank,
                layer_num: g.layer_num,
                head_num: g.head_num,
                head_dim: g.head_dim,
                flags: g.flags,
            };
            let inner = BlockingClient::new(members, geometry, opts).map_err(|e| {
                set_error(format!("cannot start the client runtime: {e}"));
                KV_EINTERNAL
            })?;
            Ok(handles::open(inner) as *mut kv_client)
        };
        open().unwrap_or(std::ptr::null_mut())
    })
}

/// Closes a client: later calls with the handle are KV_EINVAL; waits for
/// calls in flight on other threads, then frees. NULL, or a handle already
/// closed, is a no-op.
///
/// # Safety
/// Always safe: the handle is a token, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn kv_close(c: *mut kv_client) {
    guard((), || {
        if !c.is_null() {
            handles::close(c as usize);
        }
    })
}

/// Replaces the static member set (hot swap).
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `members` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kv_set_members(c: *mut kv_client, members: *const c_char) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let m = parse_members(unsafe { text(members, "members") }?).map_err(einval)?;
        cl.set_members(m);
        Ok(KV_OK)
    })
}

/// Starts membership discovery through kv-mds: long-polls `group`'s view
/// on the first answering replica of `mds_endpoints_csv` (`host:port,...`),
/// each poll waiting up to `poll_ms`, and rebuilds the ring whenever the
/// epoch changes. KV_OK once the first view is applied; KV_UNAVAILABLE when
/// no replica answered within about twice the connect timeout (discovery
/// keeps trying in the background; `kv_last_error` says why). A second call
/// replaces the first. While every replica is down the ring in use stays.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); strings NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kv_start_mds_discovery(
    c: *mut kv_client,
    mds_endpoints_csv: *const c_char,
    group: *const c_char,
    poll_ms: c_int,
) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let eps = unsafe { text(mds_endpoints_csv, "mds_endpoints_csv") }?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let group = unsafe { text(group, "group") }?;
        if poll_ms <= 0 {
            return Err(einval("poll_ms must be positive"));
        }
        let eps = kv_common::mds::parse_endpoints(eps).map_err(einval)?;
        if !kv_common::mds::valid_name(group) {
            return Err(einval(format!("group {group:?} must be 1-64 of A-Z a-z 0-9 . _ -")));
        }
        let poll = std::time::Duration::from_millis(poll_ms as u64);
        match cl.start_discovery(eps, group.to_string(), poll) {
            Ok(Ok(_)) => Ok(KV_OK),
            Ok(Err((Status::Edenied, why))) => {
                set_error(why);
                Err(KV_EDENIED)
            }
            Ok(Err((_, why))) => {
                set_error(format!("{why} (discovery keeps trying in the background)"));
                Err(KV_UNAVAILABLE)
            }
            Err(e) => {
                set_error(format!("cannot start the discovery thread: {e}"));
                Err(KV_EINTERNAL)
            }
        }
    })
}

/// The ring epoch in use (0 for NULL or no members yet).
///
/// # Safety
/// Always safe: `c` is a token (NULL or closed gives 0).
#[no_mangle]
pub unsafe extern "C" fn kv_epoch(c: *const kv_client) -> u64 {
    guard(0, || client(c).map(|cl| cl.core.epoch()).unwrap_or(0))
}

/// Bounds every later call from the calling thread (on any handle) to
/// about `ms` milliseconds in all (0: each request only by the handle's
/// timeouts); returns the previous bound. See `call.rs` and the README.
#[no_mangle]
pub extern "C" fn kv_set_call_timeout_ms(ms: u32) -> u32 {
    crate::call::set_timeout_ms(ms)
}

/// Stores `len` bytes from `buf` under `key`.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `key` NUL-terminated; `buf` readable for `len` bytes
/// (may be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn kv_put(c: *mut kv_client, key: *const c_char, buf: *const c_void, len: usize) -> c_int {
    let iov = kv_iovec { base: buf as *mut c_void, len };
    // SAFETY: forwarded caller contract (one segment).
    unsafe { kv_putv(c, key, &iov, 1) }
}

/// Stores the concatenation of `iovcnt` segments under `key`.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `key` NUL-terminated; `iov` as `read_views`.
#[no_mangle]
pub unsafe extern "C" fn kv_putv(c: *mut kv_client, key: *const c_char, iov: *const kv_iovec, iovcnt: usize) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let k = unsafe { key_arg(key) }?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let views = unsafe { read_views(iov, iovcnt) }?;
        Ok(done(cl.putv(k, &views)))
    })
}

/// # Safety
/// As [`key`].
unsafe fn key_arg<'a>(p: *const c_char) -> Result<&'a [u8], c_int> {
    // SAFETY: forwarded caller contract.
    unsafe { key(p) }
}

/// Reads the page for `key` into `buf` (capacity `cap`).
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `key` NUL-terminated; `buf` writable for `cap` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kv_get(
    c: *mut kv_client,
    key: *const c_char,
    buf: *mut c_void,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    let iov = kv_iovec { base: buf, len: cap };
    // SAFETY: forwarded caller contract (one segment).
    unsafe { kv_getv(c, key, &iov, 1, out_len) }
}

/// Reads the page for `key` scattered over `iovcnt` segments in order.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `key` NUL-terminated; `iov` as `write_views`;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kv_getv(
    c: *mut kv_client,
    key: *const c_char,
    iov: *const kv_iovec,
    iovcnt: usize,
    out_len: *mut usize,
) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let k = unsafe { key_arg(key) }?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let mut views = unsafe { write_views(iov, iovcnt) }?;
        no_overlap(&views)?;
        let (st, n) = match cl.getv(k, &mut views) {
            Ok(n) => (Status::Ok, n),
            Err((s, needed)) => (s, needed),
        };
        if !out_len.is_null() {
            // SAFETY: non-NULL and writable (caller's contract).
            unsafe { *out_len = if st == Status::Ok || st == Status::TooSmall { n } else { 0 } };
        }
        Ok(done(st))
    })
}

/// KV_OK only where a get by this client would hit.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `key` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kv_exist(c: *mut kv_client, key: *const c_char) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let k = unsafe { key_arg(key) }?;
        Ok(done(cl.exist(k)))
    })
}

/// Removes `key` at its owner: KV_OK, or KV_MISS when it was not stored.
///
/// # Safety
/// `c` a handle; `key` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kv_delete(c: *mut kv_client, key: *const c_char) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers this argument.
        let k = unsafe { key_arg(key) }?;
        Ok(done(cl.delete(k)))
    })
}

/// The keys of a batch.
///
/// # Safety
/// `keys` NULL (n = 0) or `n` NUL-terminated strings.
unsafe fn batch_keys<'a>(keys: *const *const c_char, n: usize) -> Result<Vec<&'a [u8]>, c_int> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if keys.is_null() {
        return Err(einval("keys is NULL"));
    }
    // SAFETY: keys points to n pointers (caller's contract).
    let ptrs = unsafe { std::slice::from_raw_parts(keys, n) };
    // SAFETY: each pointer NULL or NUL-terminated (checked by key()).
    ptrs.iter().map(|&p| unsafe { key(p) }).collect()
}

/// Splits `iov` into per-item groups by `iovcnt`.
///
/// # Safety
/// `iovcnt` NULL (n = 0) or `n` counts; `iov` holds their sum.
unsafe fn iov_groups(iov: *const kv_iovec, iovcnt: *const usize, n: usize) -> Result<Vec<(usize, usize)>, c_int> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if iovcnt.is_null() {
        return Err(einval("iovcnt is NULL"));
    }
    // SAFETY: iovcnt points to n counts (caller's contract).
    let counts = unsafe { std::slice::from_raw_parts(iovcnt, n) };
    let mut at = 0usize;
    let mut out = Vec::with_capacity(n);
    for &k in counts {
        out.push((at, k));
        at = at.checked_add(k).ok_or_else(|| einval("iovcnt overflows"))?;
    }
    if at > 0 && iov.is_null() {
        return Err(einval("iov is NULL"));
    }
    Ok(out)
}

/// The items of a batch: key `i` with its `iovcnt[i]` consecutive iovecs
/// turned into views by `views` (read or write).
///
/// # Safety
/// As [`batch_keys`] and [`iov_groups`]; each item's iovecs satisfy `views`'
/// contract.
unsafe fn batch_items<'a, V>(
    n: usize,
    keys: *const *const c_char,
    iov: *const kv_iovec,
    iovcnt: *const usize,
    out_status: *mut c_int,
    views: unsafe fn(*const kv_iovec, usize) -> Result<V, c_int>,
) -> Result<Vec<(&'a [u8], V)>, c_int> {
    batch_len(n)?;
    if n > 0 && out_status.is_null() {
        return Err(einval("out_status is NULL"));
    }
    // SAFETY: forwarded caller contract.
    let ks = unsafe { batch_keys(keys, n) }?;
    // SAFETY: forwarded caller contract.
    let groups = unsafe { iov_groups(iov, iovcnt, n) }?;
    let mut items = Vec::with_capacity(n);
    for (k, (at, cnt)) in ks.into_iter().zip(groups) {
        // SAFETY: the item's iovecs lie inside the caller's array (caller's contract).
        let v = unsafe { views(iov.wrapping_add(at), cnt) }?;
        items.push((k, v));
    }
    Ok(items)
}

fn write_statuses(out: *mut c_int, st: &[Status]) -> c_int {
    let why = crate::error::take_last_failure();
    let failed = st.iter().filter(|&&s| s != Status::Ok && s != Status::Miss).count();
    if failed > 0 {
        set_error(format!(
            "{failed} of {} items not served{}",
            st.len(),
            why.map(|w| format!("; last: {w}")).unwrap_or_default()
        ));
    }
    for (i, s) in st.iter().enumerate() {
        // SAFETY: out points to st.len() writable ints (checked non-NULL by callers).
        unsafe { *out.add(i) = code(*s) };
    }
    // A refused token is the caller's configuration, not a miss: the whole
    // call says so (each item's status says which owners refused).
    if st.contains(&Status::Edenied) {
        return KV_EDENIED;
    }
    st.iter().filter(|&&s| s == Status::Ok).count().min(c_int::MAX as usize) as c_int
}

/// Puts `n` items; item i gathers `iovcnt[i]` consecutive iovecs.
///
/// # Safety
/// Pointers as documented in the header; `out_status` writable for `n` ints.
#[no_mangle]
pub unsafe extern "C" fn kv_batch_putv(
    c: *mut kv_client,
    n: usize,
    keys: *const *const c_char,
    iov: *const kv_iovec,
    iovcnt: *const usize,
    out_status: *mut c_int,
) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers these arguments.
        let items = unsafe { batch_items(n, keys, iov, iovcnt, out_status, read_views) }?;
        let st = cl.batch_putv(&items);
        Ok(write_statuses(out_status, &st))
    })
}

/// Gets `n` items; item i scatters into `iovcnt[i]` consecutive iovecs.
///
/// # Safety
/// Pointers as documented in the header; `out_status` writable for `n`
/// ints; `out_lens` NULL or writable for `n` sizes.
#[no_mangle]
pub unsafe extern "C" fn kv_batch_getv(
    c: *mut kv_client,
    n: usize,
    keys: *const *const c_char,
    iov: *const kv_iovec,
    iovcnt: *const usize,
    out_lens: *mut usize,
    out_status: *mut c_int,
) -> c_int {
    entry(|| {
        let cl = client(c)?;
        // SAFETY: the caller's contract, stated in this function's # Safety, covers these
        // arguments; items' segments do not overlap (the header's contract).
        let mut items = unsafe { batch_items(n, keys, iov, iovcnt, out_status, write_views) }?;
        {
            let all: Vec<&mut [u8]> = items.iter_mut().flat_map(|(_, v)| v.iter_mut().map(|s| &mut **s)).collect();
            no_overlap(&all)?;
        }
        let res = cl.batch_getv(&mut items);
        let st: Vec<Status> = res.iter().map(|r| r.0).collect();
        if !out_lens.is_null() {
            for (i, (s, len)) in res.iter().enumerate() {
                let v = if *s == Status::Ok || *s == Status::TooSmall { *len } else { 0 };
                // SAFETY: out_lens writable for n sizes (caller's contract).
                unsafe { *out_lens.add(i) = v };
            }
        }
        Ok(write_statuses(out_status, &st))
    })
}

/// Per-key exist statuses; one BATCH_EXIST frame per owner.
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `out_status` writable for `n` ints.
#[no_mangle]
pub unsafe extern "C" fn kv_batch_exist(
    c: *mut kv_client,
    n: usize,
    keys: *const *const c_char,
    out_status: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract, stated in this function's # Safety, covers these arguments.
    unsafe { keys_call(c, n, keys, out_status, |cl, ks| cl.batch_exist(ks)) }
}

/// Removes `n` keys at their owners: per key KV_OK or KV_MISS; one
/// BATCH_DELETE frame per owner where the nodes take it.
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `out_status` writable for `n` ints.
#[no_mangle]
pub unsafe extern "C" fn kv_batch_delete(
    c: *mut kv_client,
    n: usize,
    keys: *const *const c_char,
    out_status: *mut c_int,
) -> c_int {
    // SAFETY: the caller's contract, stated in this function's # Safety, covers these arguments.
    unsafe { keys_call(c, n, keys, out_status, |cl, ks| cl.batch_delete(ks)) }
}

/// A batch call over `n` keys with one status each (exist, delete): the
/// arguments checked, `f` run, its statuses written; the number of `KV_OK`.
///
/// # Safety
/// `keys` holds `n` NUL-terminated strings; `out_status` writable for `n` ints.
unsafe fn keys_call(
    c: *mut kv_client,
    n: usize,
    keys: *const *const c_char,
    out_status: *mut c_int,
    f: impl FnOnce(&BlockingClient, &[&[u8]]) -> Vec<Status>,
) -> c_int {
    entry(|| {
        let cl = client(c)?;
        batch_len(n)?;
        if n > 0 && out_status.is_null() {
            return Err(einval("out_status is NULL"));
        }
        // SAFETY: `keys` holds `n` strings (this function's # Safety).
        let ks = unsafe { batch_keys(keys, n) }?;
        let st = f(&cl, &ks);
        Ok(write_statuses(out_status, &st))
    })
}

/// Registers a long-lived region (an engine's host pool) with every RDMA
/// rail once, so payloads land in it and leave it without per-op
/// registration. A checked no-op on TCP. The memory must stay mapped until
/// `kv_unregister_memory` or `kv_close`. KV_UNAVAILABLE when the device
/// refuses it (RLIMIT_MEMLOCK, memory not registrable): the handle then
/// serves over TCP (one line on stderr, the fallback counted).
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `base` NULL only with
/// `len` 0; `[base, base+len)` mapped while registered.
#[no_mangle]
pub unsafe extern "C" fn kv_register_memory(c: *mut kv_client, base: *mut c_void, len: usize) -> c_int {
    guard(KV_EINTERNAL, || {
        let cl = match client(c) {
            Ok(cl) => cl,
            Err(e) => return e,
        };
        if base.is_null() && len > 0 {
            return einval("base is NULL");
        }
        match cl.core.fabric.pin(base as usize, len) {
            Ok(()) => KV_OK,
            Err(e) => {
                set_error(e);
                KV_UNAVAILABLE
            }
        }
    })
}

/// Drops a registration `kv_register_memory` made at `base`. KV_OK, or
/// KV_MISS when none starts there (always KV_OK on TCP).
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL).
#[no_mangle]
pub unsafe extern "C" fn kv_unregister_memory(c: *mut kv_client, base: *mut c_void) -> c_int {
    guard(KV_EINTERNAL, || {
        let cl = match client(c) {
            Ok(cl) => cl,
            Err(e) => return e,
        };
        match cl.core.fabric.unpin(base as usize) {
            true => KV_OK,
            false => KV_MISS,
        }
    })
}

/// Writes Prometheus text into `buf` (NUL-terminated, truncated to `cap`);
/// returns the full length (without NUL) so a caller can size its buffer.
///
/// # Safety
/// `c` any handle value (a closed one is KV_EINVAL); `buf` NULL or writable for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_stats_snapshot(c: *mut kv_client, buf: *mut c_char, cap: usize) -> usize {
    guard(0, || {
        let Ok(cl) = client(c) else { return 0 };
        let text = cl.stats_text();
        if !buf.is_null() && cap > 0 {
            let n = text.len().min(cap - 1);
            // SAFETY: buf writable for cap > n bytes; the regions do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        text.len()
    })
}

/// The calling thread's last error message (never NULL; valid until the
/// thread's next call into the library).
#[no_mangle]
pub extern "C" fn kv_last_error() -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    crate::error::message_ptr().unwrap_or(EMPTY.as_ptr() as *const c_char)
}

/// The library version.
#[no_mangle]
pub extern "C" fn kv_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// The registry of open handles. A `kv_client *` is an id in this registry,
/// never an address: a call with a closed or made-up handle finds nothing
/// and is KV_EINVAL instead of undefined behaviour, and ids are never
/// reused, so a stale handle cannot reach a newer client. Each call holds
/// the client (an `Arc`) for its duration; `kv_close` removes the id, waits
/// for the calls in flight to finish, and drops the client itself.
mod handles {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
    use std::time::Duration;

    use crate::blocking::BlockingClient;

    struct Handle {
        client: BlockingClient,
        closing: AtomicBool,
        lock: Mutex<()>,
        done: Condvar,
    }

    fn table() -> &'static RwLock<HashMap<usize, Arc<Handle>>> {
        static TABLE: OnceLock<RwLock<HashMap<usize, Arc<Handle>>>> = OnceLock::new();
        TABLE.get_or_init(Default::default)
    }

    /// Ids start at 16 and step by 16, so a handle looks like an aligned
    /// pointer to C tools, and small integers passed by mistake are refused.
    static NEXT: AtomicUsize = AtomicUsize::new(16);

    thread_local! {
        /// The handle this thread is inside a call on (0: none), so that a
        /// kv_close reached from inside a call (a signal handler) does not
        /// wait for itself.
        static INSIDE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A call in progress on a live handle.
    pub(super) struct Call(Arc<Handle>, usize);

    impl std::ops::Deref for Call {
        type Target = BlockingClient;
        fn deref(&self) -> &BlockingClient {
            &self.0.client
        }
    }

    impl Drop for Call {
        fn drop(&mut self) {
            let _ = INSIDE.try_with(|c| c.set(self.1));
            if self.0.closing.load(Ordering::Acquire) {
                let _g = self.0.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.0.done.notify_all();
            }
        }
    }

    pub(super) fn open(client: BlockingClient) -> usize {
        let id = NEXT.fetch_add(16, Ordering::Relaxed);
        let h =
            Arc::new(Handle { client, closing: AtomicBool::new(false), lock: Mutex::new(()), done: Condvar::new() });
        table().write().unwrap_or_else(|e| e.into_inner()).insert(id, h);
        id
    }

    pub(super) fn enter(id: usize) -> Option<Call> {
        let h = table().read().unwrap_or_else(|e| e.into_inner()).get(&id).cloned()?;
        let outer = INSIDE.try_with(|c| c.replace(id)).unwrap_or(0);
        Some(Call(h, outer))
    }

    pub(super) fn close(id: usize) {
        let Some(mut h) = table().write().unwrap_or_else(|e| e.into_inner()).remove(&id) else { return };
        h.closing.store(true, Ordering::Release);
        if INSIDE.try_with(|c| c.get() == id).unwrap_or(false) {
            // Closed from inside a call on this very handle: the call's own
            // reference frees the client when it returns.
            return;
        }
        loop {
            // A call's Arc is released just after its notification, so the
            // wait also wakes on a short timeout to see the count drop.
            {
                let g = h.lock.lock().unwrap_or_else(|e| e.into_inner());
                if Arc::strong_count(&h) > 1 {
                    drop(h.done.wait_timeout(g, Duration::from_millis(2)));
                    continue;
                }
            }
            match Arc::try_unwrap(h) {
                Ok(last) => {
                    // Stops discovery, the runtime and every connection here,
                    // on the closing thread.
                    drop(last);
                    return;
                }
                Err(back) => h = back,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::time::{Duration, Instant};

    fn geo() -> kv_geometry {
        kv_geometry {
            model_hash: 1,
            page_size: 1,
            dtype_tag: 1,
            tp_size: 1,
            tp_rank: 0,
            layer_num: 1,
            head_num: 1,
            head_dim: 1,
            flags: 0,
        }
    }

    /// A peer that accepts and then never answers: a call to it lasts its
    /// whole I/O timeout.
    fn silent_peer() -> (std::net::TcpListener, String) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    }

    #[test]
    fn close_waits_for_calls_in_flight_and_later_calls_are_einval() {
        let (peer, addr) = silent_peer();
        let members = CString::new(format!("n1={addr}")).unwrap();
        let opts = CString::new("io_timeout_ms=400,connect_timeout_ms=400").unwrap();
        let g = geo();
        // SAFETY: valid strings and geometry for the call.
        let c = unsafe { kv_open(members.as_ptr(), &g, opts.as_ptr()) };
        assert!(!c.is_null());
        let token = c as usize;
        let call = std::thread::spawn(move || {
            let key = CString::new("k").unwrap();
            let t = Instant::now();
            // SAFETY: a handle token and a valid key.
            let s = unsafe { kv_exist(token as *mut kv_client, key.as_ptr()) };
            (s, t.elapsed(), Instant::now())
        });
        // The peer's accept returns once the call is inside the library
        // (it connected); close under it.
        let (_held, _) = peer.accept().unwrap();
        // SAFETY: a handle from kv_open.
        unsafe { kv_close(c) };
        let closed_at = Instant::now();
        let (s, took, returned_at) = call.join().unwrap();
        assert_eq!(s, KV_TIMEOUT, "the call in flight finished normally");
        assert!(took >= Duration::from_millis(300), "it ran its course ({took:?})");
        assert!(closed_at >= returned_at, "kv_close returned only after the call did");
        let key = CString::new("k").unwrap();
        // SAFETY: a closed handle is a token the registry no longer knows.
        assert_eq!(unsafe { kv_exist(c, key.as_ptr()) }, KV_EINVAL);
        // SAFETY: as above; closing twice is a no-op.
        unsafe { kv_close(c) };
        // A made-up handle is refused the same way.
        // SAFETY: never dereferenced.
        assert_eq!(unsafe { kv_exist(12345 as *mut kv_client, key.as_ptr()) }, KV_EINVAL);
    }
}
