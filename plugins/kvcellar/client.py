"""The typed Python client over ``libkvclient.so``.

Statuses come back as :class:`Status` values: a miss, a mismatch or an
unreachable node is an ordinary answer ("not served: recompute"), never an
exception. Exceptions are raised only for caller errors: a bad argument
(:class:`ValueError`), bad configuration (:class:`ConfigError`), a call on a
closed client (:class:`ClosedError`), a refused auth token
(:class:`DeniedError`) or a missing library (:class:`LibraryError`).

Buffers are passed without copies. A *buffer* is anything with the buffer
protocol (``bytes``, ``bytearray``, ``memoryview``, numpy arrays, ctypes
arrays), an object with ``data_ptr()``/``numel()``/``element_size()`` (a
contiguous torch tensor, without importing torch), or a raw
``(address, length)`` pair of ints for memory the caller owns (engine page
pools). Reads need writable buffers.

One client is safe to share between threads, and :meth:`Client.close` may
run while other threads are inside calls: it waits for them, and calls that
start afterwards raise :class:`ClosedError`.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from kvcellar import _native
from kvcellar._native import FLAG_MLA, MAX_KEY_LEN, IoVec, LibraryError
from kvcellar.config import DEFAULT_POLL_MS, ConfigError, Settings, resolve

log = logging.getLogger("kvcellar")

Key = Union[str, bytes]
Buffer = Any
Segment = Union[Buffer, Tuple[int, int]]

__all__ = [
    "Client",
    "ClosedError",
    "ConfigError",
    "DeniedError",
    "GetResult",
    "Geometry",
    "KvcellarError",
    "LibraryError",
    "Status",
    "library_version",
]


class Status(enum.IntEnum):
    """Status codes of the C ABI (README.md, "C ABI conventions"). Positive: not served, recompute."""

    OK = 0
    MISS = 1
    MISMATCH = 2
    CORRUPT = 3
    TOO_SMALL = 4
    UNAVAILABLE = 5
    TIMEOUT = 6
    REJECTED = 7
    EINVAL = -1
    EINTERNAL = -2
    EDENIED = -3

    @property
    def ok(self) -> bool:
        return self is Status.OK


class KvcellarError(Exception):
    """Base of the errors this package raises (caller errors only)."""


class ClosedError(KvcellarError):
    """The client was closed."""


class DeniedError(KvcellarError):
    """The cluster refused the auth token (a misconfiguration, not a miss)."""


class GetResult(NamedTuple):
    """A get's answer: the status, and the payload length on OK (the size
    needed on TOO_SMALL). ``data`` is set by :meth:`Client.get_bytes`."""

    status: Status
    length: int
    data: Optional[bytes] = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclass(frozen=True)
class Geometry:
    """The page geometry every stored page carries; a get succeeds only when
    it equals the reader's (tp_size/tp_rank are not compared for MLA)."""

    model_hash: int = 0
    page_size: int = 0
    dtype_tag: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    layer_num: int = 0
    head_num: int = 0
    head_dim: int = 0
    mla: bool = False

    def to_c(self) -> _native.Geometry:
        for name, bits in (("model_hash", 64), ("page_size", 32), ("dtype_tag", 32)):
            v = getattr(self, name)
            if not 0 <= v < 1 << bits:
                raise ValueError(f"geometry {name}={v} outside 0..2^{bits}")
        for name in ("tp_size", "tp_rank", "layer_num", "head_num", "head_dim"):
            v = getattr(self, name)
            if not 0 <= v < 1 << 16:
                raise ValueError(f"geometry {name}={v} outside 0..65535")
        return _native.Geometry(
            self.model_hash,
            self.page_size,
            self.dtype_tag,
            self.tp_size,
            self.tp_rank,
            self.layer_num,
            self.head_num,
            self.head_dim,
            FLAG_MLA if self.mla else 0,
        )


def library_version(lib_path: Optional[str] = None) -> str:
    """The version libkvclient.so reports (``kv_version()``)."""
    return _native.load(lib_path).kv_version().decode()


def encode_key(key: Key) -> bytes:
    """A key as the library takes it: 1..1024 bytes, no NUL."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    if not k or len(k) > MAX_KEY_LEN or b"\0" in k:
        raise ValueError(f"a key is 1..{MAX_KEY_LEN} bytes without NUL (got {len(k)} bytes)")
    return k


def _view(buf: Segment, writable: bool) -> Tuple[int, int, Any]:
    """(address, length, keepalive) of a segment (see the module docs).

    A read-only buffer that is not ``bytes`` is copied once; the copy is the
    keepalive and must outlive the call.
    """
    if isinstance(buf, tuple):
        addr, n = buf
        if not isinstance(addr, int) or not isinstance(n, int) or n < 0 or (addr == 0 and n > 0):
            raise ValueError("a raw segment is (address, length) with a non-NULL address")
        return addr, n, None
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size") and not isinstance(buf, (bytes, bytearray)):
        device = getattr(buf, "device", None)
        if device is not None and getattr(device, "type", str(device)) != "cpu":
            raise ValueError(f"tensor is on {device}: kvcellar moves pages to and from host memory only")
        contiguous = getattr(buf, "is_contiguous", None)
        if contiguous is not None and not contiguous():
            raise ValueError("tensor must be contiguous")
        return int(buf.data_ptr()), int(buf.numel()) * int(buf.element_size()), buf
    mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("buffer must be contiguous")
    mv = mv.cast("B")
    if mv.nbytes == 0:
        return 0, 0, mv
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes, mv
    if writable:
        raise ValueError("buffer must be writable")
    data = buf if isinstance(buf, bytes) else mv.tobytes()
    # c_char_p over a bytes object points at its own storage (no copy).
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, len(data), data


def _iovecs(segments: Sequence[Segment], writable: bool) -> Tuple[Any, int, List[Any]]:
    """An IoVec array over segments; (array, count, keepalives)."""
    keep: List[Any] = []
    flat = array.array("Q")
    for s in segments:
        addr, n, k = _view(s, writable)
        flat.append(addr)
        flat.append(n)
        if k is not None:
            keep.append(k)
    count = len(segments)
    arr = (IoVec * count).from_buffer(flat) if count else (IoVec * 0)()
    keep.append(flat)
    return arr, count, keep


def raw_iovecs(addrs: Sequence[int], sizes: Sequence[int]) -> Any:
    """An IoVec array over parallel lists of addresses and sizes (engine
    page pointers), built without a Python loop per segment."""
    if len(addrs) != len(sizes):
        raise ValueError("addresses and sizes differ in length")
    flat = array.array("Q", bytes(16 * len(addrs)))
    flat[0::2] = array.array("Q", addrs)
    flat[1::2] = array.array("Q", sizes)
    arr = (IoVec * len(addrs)).from_buffer(flat)
    return arr, flat


def _keys(keys: Sequence[Key]) -> Any:
    return (ctypes.c_char_p * len(keys))(*[encode_key(k) for k in keys])


class Client:
    """A kvcellar client: routes keys over the group's weighted ring and
    verifies every page it serves.

    Open it from a static member list, from kv-mds endpoints and a group, or
    with no arguments from the ``KVCELLAR_*`` environment variables
    (:mod:`kvcellar.config`)::

        with kvcellar.Client(mds="10.0.0.1:7480,10.0.0.2:7480", group="prod") as c:
            c.put("page-1", b"...")
            buf = bytearray(4 << 20)
            r = c.get("page-1", buf)   # GetResult(status=Status.OK, length=...)

    ``geometry`` (a :class:`Geometry`) is stamped on every put and required
    on every get; ``options`` are the library's (``io_timeout_ms``,
    ``connect_timeout_ms``, ``max_conns_per_node``, ``batch_concurrency``,
    ``peer_cooldown_ms``) as a mapping or ``"k=v,..."``.
    """

    def __init__(
        self,
        members: Optional[Union[str, Sequence[str], Mapping[str, str]]] = None,
        *,
        mds: Optional[Union[str, Sequence[str]]] = None,
        group: Optional[str] = None,
        geometry: Optional[Geometry] = None,
        options: Optional[Union[str, Mapping[str, Any]]] = None,
        auth_token_file: Optional[str] = None,
        poll_ms: int = DEFAULT_POLL_MS,
        lib_path: Optional[str] = None,
        settings: Optional[Settings] = None,
    ) -> None:
        self._h: Optional[int] = None
        self._closed = False
        self._close_lock = threading.Lock()
        if settings is None:
            settings = resolve(
                {
                    "members": members,
                    "mds": mds,
                    "group": group,
                    "options": options,
                    "auth_token_file": auth_token_file,
                },
                where="Client",
            )
        if settings.mds is None and settings.members is None:
            raise ConfigError(
                "no cluster given: pass members= or mds= (or set KVCELLAR_MDS or KVCELLAR_MEMBERS)"
            )
        self.settings = settings
        self.geometry = geometry or Geometry()
        self._lib = _native.load(lib_path)
        geo = self.geometry.to_c()
        opts = settings.options_string().encode()
        h = self._lib.kv_open((settings.members or "").encode(), ctypes.byref(geo), opts)
        if not h:
            raise ConfigError(f"cannot open the client: {_native.last_error(self._lib)}")
        self._h = h
        if settings.mds is not None:
            if poll_ms <= 0:
                self.close()
                raise ConfigError("poll_ms must be positive")
            st = self._lib.kv_start_mds_discovery(h, ",".join(settings.mds).encode(), settings.group.encode(), poll_ms)
            if st == Status.UNAVAILABLE:
                log.warning(
                    "kvcellar: no kv-mds answered yet (%s); pages miss until one does",
                    _native.last_error(self._lib),
                )
            elif st == Status.EDENIED:
                msg = _native.last_error(self._lib)
                self.close()
                raise DeniedError(f"kv-mds refused the auth token: {msg}")
            elif st != Status.OK:
                msg = _native.last_error(self._lib)
                self.close()
                raise ConfigError(f"cannot start discovery: {msg}")
        else:
            self._probe_access(settings, geo)

    def _probe_access(self, settings: Settings, geo: Any) -> None:
        """With a static member list nothing has checked the token yet: a
        node that refuses it is a misconfiguration to report now, not a
        stream of misses later. One owner is asked through a throwaway
        handle with short timeouts and no cool-down, so a node that is down
        or hung costs this handle nothing and construction at most ~1 s.
        (With kv-mds, discovery already answered KV_EDENIED.)"""
        from dataclasses import replace

        # Over TCP: the probe needs no RDMA engine (nor a second log line
        # when RDMA falls back).
        opts = {k: v for k, v in settings.options.items() if not k.startswith("rdma_")}
        opts.update(connect_timeout_ms="500", io_timeout_ms="1000", peer_cooldown_ms="0")
        probe = replace(settings, options=opts)
        h = self._lib.kv_open((settings.members or "").encode(), ctypes.byref(geo), probe.options_string().encode())
        if not h:
            return
        try:
            st = self._lib.kv_exist(h, b"kvcellar-auth-probe")
            msg = _native.last_error(self._lib)
        finally:
            self._lib.kv_close(h)
        if st == Status.EDENIED:
            self.close()
            raise DeniedError(f"a node refused the auth token: {msg}")

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Closes the client: waits for calls in flight on other threads;
        later calls raise :class:`ClosedError`. Closing twice is a no-op."""
        with self._close_lock:
            h, self._h = self._h, None
            self._closed = True
        if h:
            self._lib.kv_close(h)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    # -- internals ---------------------------------------------------------

    def _handle(self) -> int:
        h = self._h
        if not h:
            raise ClosedError("the kvcellar client is closed")
        return h

    def _check(self, code: int) -> int:
        """Raises for negative codes (caller errors); returns the rest."""
        if code >= 0:
            return code
        msg = _native.last_error(self._lib)
        if code == Status.EINVAL:
            if self._closed:
                raise ClosedError("the kvcellar client is closed")
            raise ValueError(msg or "invalid argument")
        if code == Status.EDENIED:
            raise DeniedError(msg or "the cluster refused the auth token")
        raise KvcellarError(f"libkvclient internal error: {msg}")

    def _status(self, code: int) -> Status:
        return Status(self._check(code))

    def last_error(self) -> str:
        """Why this thread's last call was not served (which node, and why)."""
        return _native.last_error(self._lib)

    # -- single items ----------------------------------------------------------

    @contextlib.contextmanager
    def call_timeout(self, ms: Optional[int]) -> Iterator[None]:
        """Bounds every call this thread makes inside the block (on any
        handle) to about ``ms`` milliseconds in all (``None`` or 0: no
        bound). Items not answered in time get :attr:`Status.TIMEOUT`; a
        call returns only after nothing of it touches the caller's buffers
        any more, so a call holding engine memory is never abandoned. A node
        that let a request run half the bound unanswered cools down
        (``peer_cooldown_ms``), and every call skips it meanwhile
        (README, "C ABI conventions")."""
        ms = int(ms or 0)
        if ms < 0 or ms > 0xFFFFFFFF:
            raise ValueError(f"call timeout {ms} ms is out of range")
        prev = self._lib.kv_set_call_timeout_ms(ms)
        try:
            yield
        finally:
            self._lib.kv_set_call_timeout_ms(prev)

    def put(self, key: Key, data: Segment) -> Status:
        """Stores ``data`` under ``key`` (write-once: a stored key stays)."""
        return self.putv(key, [data])

    def putv(self, key: Key, segments: Sequence[Segment]) -> Status:
        """Stores the concatenation of ``segments`` as one page."""
        k = encode_key(key)
        arr, n, keep = _iovecs(segments, writable=False)
        st = self._status(self._lib.kv_putv(self._handle(), k, arr, n))
        del keep
        return st

    def get(self, key: Key, buf: Segment) -> GetResult:
        """Reads the page into ``buf``. On ``TOO_SMALL`` ``length`` is the
        size needed; on any status but OK the buffer's contents are undefined."""
        return self.getv(key, [buf])

    def getv(self, key: Key, segments: Sequence[Segment]) -> GetResult:
        """Reads the page scattered over ``segments`` in order."""
        k = encode_key(key)
        arr, n, keep = _iovecs(segments, writable=True)
        out = ctypes.c_size_t(0)
        st = self._status(self._lib.kv_getv(self._handle(), k, arr, n, ctypes.byref(out)))
        del keep
        return GetResult(st, out.value)

    def get_bytes(self, key: Key, size_hint: int = 4 << 20) -> GetResult:
        """Reads the page into new bytes (``data``), sized by the node's
        answer when ``size_hint`` is too small."""
        buf = bytearray(size_hint)
        r = self.get(key, buf)
        if r.status is Status.TOO_SMALL:
            buf = bytearray(r.length)
            r = self.get(key, buf)
        if r.status is not Status.OK:
            return r
        return GetResult(r.status, r.length, bytes(memoryview(buf)[: r.length]))

    def exist(self, key: Key) -> Status:
        """OK only where a get by this client would hit (geometry compared)."""
        return self._status(self._lib.kv_exist(self._handle(), encode_key(key)))

    def delete(self, key: Key) -> Status:
        """Removes ``key`` at its owner: OK, or MISS when it was not stored."""
        return self._status(self._lib.kv_delete(self._handle(), encode_key(key)))

    # -- batches -----------------------------------------------------------------

    def batch_put(self, keys: Sequence[Key], values: Sequence[Segment]) -> List[Status]:
        """Puts one buffer per key; per-item statuses."""
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        return self.batch_putv(keys, [[v] for v in values])

    def batch_putv(self, keys: Sequence[Key], segments: Sequence[Sequence[Segment]]) -> List[Status]:
        """Puts item i as the concatenation of ``segments[i]``."""
        st, _ = self._batch(False, keys, *self._segment_items(keys, segments, writable=False))
        return st

    def batch_putv_raw(
        self, keys: Sequence[Key], addrs: Sequence[int], sizes: Sequence[int], per_item: Union[int, Sequence[int]]
    ) -> List[Status]:
        """Puts item i from ``per_item`` consecutive raw segments
        (``addrs``/``sizes``, e.g. an engine pool's page pointers);
        ``per_item`` is one count for every item or a count per item."""
        st, _ = self._batch(False, keys, *self._raw_items(keys, addrs, sizes, per_item))
        return st

    def batch_get(self, keys: Sequence[Key], bufs: Sequence[Segment]) -> List[GetResult]:
        """Gets one buffer per key; per-item results."""
        if len(keys) != len(bufs):
            raise ValueError("keys and buffers differ in length")
        return self.batch_getv(keys, [[b] for b in bufs])

    def batch_getv(self, keys: Sequence[Key], segments: Sequence[Sequence[Segment]]) -> List[GetResult]:
        """Gets item i scattered over ``segments[i]``."""
        st, lens = self._batch(True, keys, *self._segment_items(keys, segments, writable=True))
        return [GetResult(s, n) for s, n in zip(st, lens)]

    def batch_getv_raw(
        self, keys: Sequence[Key], addrs: Sequence[int], sizes: Sequence[int], per_item: Union[int, Sequence[int]]
    ) -> List[GetResult]:
        """Gets item i into ``per_item`` consecutive raw segments (one count
        for every item, or a count per item)."""
        st, lens = self._batch(True, keys, *self._raw_items(keys, addrs, sizes, per_item))
        return [GetResult(s, n) for s, n in zip(st, lens)]

    @staticmethod
    def _segment_items(keys: Sequence[Key], segments: Sequence[Sequence[Segment]], writable: bool):
        """(iovec array, per-item counts, keepalive) over buffer segments."""
        if len(keys) != len(segments):
            raise ValueError("keys and segment lists differ in length")
        arr, _, keep = _iovecs([s for item in segments for s in item], writable)
        return arr, [len(item) for item in segments], keep

    @staticmethod
    def _raw_items(keys: Sequence[Key], addrs: Sequence[int], sizes: Sequence[int],
                   per_item: Union[int, Sequence[int]]):
        """(iovec array, per-item counts, keepalive) over raw segments."""
        counts = [per_item] * len(keys) if isinstance(per_item, int) else [int(c) for c in per_item]
        if len(counts) != len(keys) or any(c <= 0 for c in counts) or len(addrs) != sum(counts):
            raise ValueError(f"{len(addrs)} segments for {len(keys)} items of {per_item}")
        if any(a == 0 for a in addrs):
            raise ValueError("a segment address is NULL")
        arr, keep = raw_iovecs(addrs, sizes)
        return arr, counts, keep

    def _batch(self, get: bool, keys: Sequence[Key], arr: Any, counts: List[int], keep: Any):
        """One kv_batch_getv / kv_batch_putv: (statuses, lengths)."""
        n = len(keys)
        ks = _keys(keys)
        cnt = (ctypes.c_size_t * n)(*counts)
        st = (ctypes.c_int * n)()
        lens = (ctypes.c_size_t * n)()
        if get:
            self._check(self._lib.kv_batch_getv(self._handle(), n, ks, arr, cnt, lens, st))
        else:
            self._check(self._lib.kv_batch_putv(self._handle(), n, ks, arr, cnt, st))
        del keep  # the buffers stay alive until the call returned
        return [Status(s) for s in st], [int(x) for x in lens]

    def batch_exist(self, keys: Sequence[Key]) -> List[Status]:
        """Per-key exist statuses, one request per owner node."""
        n = len(keys)
        st = (ctypes.c_int * n)()
        self._check(self._lib.kv_batch_exist(self._handle(), n, _keys(keys), st))
        return [Status(s) for s in st]

    def batch_delete(self, keys: Sequence[Key]) -> List[Status]:
        """Removes many keys at their owners: per key OK, or MISS when it
        was not stored (one request per owner node)."""
        n = len(keys)
        st = (ctypes.c_int * n)()
        self._check(self._lib.kv_batch_delete(self._handle(), n, _keys(keys), st))
        return [Status(s) for s in st]

    def leading_hits(self, keys: Sequence[Key]) -> int:
        """How many keys, counted from the first, a get would hit (what
        engines' prefix lookups want)."""
        n = 0
        for s in self.batch_exist(keys):
            if s is not Status.OK:
                break
            n += 1
        return n

    # -- memory, membership, introspection ------------------------------------

    def register_memory(self, buf: Segment) -> Status:
        """Registers memory that pages move to and from once, with every
        RDMA rail (the engine's host pool; a checked no-op on TCP). The
        memory must stay allocated until :meth:`unregister_memory` or
        :meth:`close`."""
        addr, n, keep = _view(buf, writable=False)
        st = self._status(self._lib.kv_register_memory(self._handle(), addr or None, n))
        del keep
        return st

    def unregister_memory(self, buf: Segment) -> Status:
        """Drops what :meth:`register_memory` registered for ``buf``
        (``Status.MISS`` when nothing was; ``Status.OK`` on TCP)."""
        addr, _, keep = _view(buf, writable=False)
        st = self._status(self._lib.kv_unregister_memory(self._handle(), addr or None))
        del keep
        return st

    def set_members(self, members: Union[str, Sequence[str], Mapping[str, str]]) -> None:
        """Replaces the static member set (safe while calls run)."""
        from kvcellar.config import parse_members

        self._check(self._lib.kv_set_members(self._handle(), parse_members(members).encode()))

    @property
    def epoch(self) -> int:
        """The ring epoch in use (the MDS epoch under discovery)."""
        return int(self._lib.kv_epoch(self._handle()))

    def stats(self) -> str:
        """The client's counters as Prometheus text."""
        h = self._handle()
        n = self._lib.kv_stats_snapshot(h, None, 0)
        buf = ctypes.create_string_buffer(n + 64)
        self._lib.kv_stats_snapshot(h, buf, n + 64)
        return buf.value.decode()

    def counters(self) -> Dict[str, float]:
        """:meth:`stats` as ``{"name{labels}": value}``."""
        out: Dict[str, float] = {}
        for line in self.stats().splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out
