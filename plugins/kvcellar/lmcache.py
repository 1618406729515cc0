"""LMCache remote connector over kvcellar.

Loaded by LMCache's plugin mechanism (docs/plugins/lmcache.md)::

    remote_storage_plugins: ["kvcellar"]
    extra_config:
      remote_storage_plugin.kvcellar.module_path: kvcellar.lmcache
      remote_storage_plugin.kvcellar.class_name: KvcellarConnector
      remote_storage_plugin.kvcellar.mds: "10.0.0.1:7480,10.0.0.2:7480"
      remote_storage_plugin.kvcellar.group: default

Settings are read from ``remote_storage_plugin.<name>.<key>`` for the plugin
name whose ``module_path`` is this module (else ``kvcellar.<key>``), the
``KVCELLAR_*`` environment variables filling what is left out.

Every async method runs its blocking library call on the connector's own
thread pool, under a deadline counted from when LMCache called it (waiting
for a thread included; :mod:`kvcellar._deadline`, docs/plugins/lmcache.md
"Deadlines"): ``lookup_deadline_ms`` for contains and exists,
``load_deadline_ms`` per slice of a get, ``save_deadline_ms`` per slice of
a put. A method returns only once its library call did, so nothing of a
call touches a memory object after its method is over, even when LMCache
gives up waiting and cancels it. Keys are LMCache's key strings (any
characters; longer than the store's 1024 bytes, hashed) behind a tag that
digests the page identity: the model, a fingerprint of its weights and the
quantization and overrides the engine applies (:mod:`kvcellar._served`;
``model_fingerprint`` replaces the fingerprint), KV shape and dtype, chunk
size and format; the same identity is every page's ``model_hash``. With
``save_chunk_meta`` (LMCache's default) the chunk's metadata is stored in
front of the payload, in one object. A failure is a miss, logged once per
cause at ERROR; a bad configuration raises at construction (LMCache then
logs it and runs without this tier, so check for the INFO line
``kvcellar LMCache connector ready``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hashlib
import json
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvcellar._lmcache_api import RemoteConnector, RemoteMetadata, make_logger
from kvcellar._deadline import DEADLINE_DEFAULTS, DEADLINE_KEYS, Counters, Deadlines, left_ms, run_slices
from kvcellar._misses import Misses
from kvcellar._served import sglang_model, vllm_model, weights_identity
from kvcellar.client import Client, ClosedError, Geometry, GetResult, Status
from kvcellar.config import CLUSTER_KEYS, DEFAULT_POLL_MS, ConfigError, identity_hash, resolve, tenant_prefix

log = make_logger("kvcellar.lmcache")

__all__ = ["KvcellarConnector"]

MODULE = "kvcellar.lmcache"
OWN_KEYS = CLUSTER_KEYS + DEADLINE_KEYS + ("io_timeout_ms", "connect_timeout_ms", "tenant", "poll_ms",
                                          "max_inflight", "model_fingerprint")
MAX_KEY = 1024


def _plugin_prefix(config: Any) -> str:
    """``remote_storage_plugin.<name>.`` of the plugin that loaded this
    module, else ``kvcellar.``."""
    extra = getattr(config, "extra_config", None) or {}
    names = list(getattr(config, "remote_storage_plugins", None) or [])
    names += [k.split(".")[1] for k in extra if k.startswith("remote_storage_plugin.") and k.count(".") >= 2]
    for n in dict.fromkeys(names):
        if extra.get(f"remote_storage_plugin.{n}.module_path") == MODULE:
            return f"remote_storage_plugin.{n}."
    return "kvcellar."


class KvcellarConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvcellar group (see the module docs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None) -> None:
        config = config if config is not None else local_cpu_backend.config
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra = getattr(config, "extra_config", None) or {}
        pre = _plugin_prefix(config)
        where = f"LMCache extra_config ({pre}*)"
        own = {k[len(pre):]: v for k, v in extra.items() if k.startswith(pre)}
        self.settings = resolve({k: own.get(k) for k in CLUSTER_KEYS}, where=where)
        if self.settings.mds is None and self.settings.members is None:
            raise ConfigError(f"{where}: give {pre}mds and {pre}group, or {pre}members "
                              "(or set KVCELLAR_MDS / KVCELLAR_MEMBERS)")
        ints = {}
        for k, default in (("io_timeout_ms", 10000), ("connect_timeout_ms", 3000), ("poll_ms", DEFAULT_POLL_MS),
                           ("max_inflight", 32), *DEADLINE_DEFAULTS.items()):
            v = own.get(k, self.settings.options.get(k, default) if k in ("io_timeout_ms", "connect_timeout_ms")
                        else default)
            try:
                v = int(v)
                if v <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError(f"{where} key '{pre}{k}': {v!r} must be a positive integer") from None
            ints[k] = v
        for k in ("io_timeout_ms", "connect_timeout_ms"):
            self.settings.options[k] = str(ints[k])
        self.prefix = tenant_prefix(own.get("tenant"), f"{where} key '{pre}tenant'")
        self.deadlines = Deadlines.of(ints)
        self._counters = Counters(log, self.deadlines)
        md = local_cpu_backend.metadata
        self.weights, weights_line = weights_identity(own.get("model_fingerprint"), self._served(md), where,
                                                      key=f"{pre}model_fingerprint")
        self.geometry = self._geometry(md, config)
        # The library checks the options (one clear error) before they are read here.
        self.client = Client(settings=self.settings, geometry=self.geometry, poll_ms=ints["poll_ms"])
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=ints["max_inflight"],
                                                           thread_name_prefix="kvcellar-lmcache")
        self._misses = Misses(log)
        log.info(
            "kvcellar LMCache connector ready: %s, group %s, model %s, %s, worker %s/%s, chunk meta %s",
            f"mds {','.join(self.settings.mds)}" if self.settings.mds else f"members {self.settings.members}",
            self.settings.group, getattr(md, "model_name", "?"), weights_line, getattr(md, "worker_id", "?"),
            getattr(md, "world_size", "?"), "on" if self.save_chunk_meta else "off",
        )

    # -- identity ---------------------------------------------------------------

    @staticmethod
    def _served(md: Any) -> Optional[Dict[str, Any]]:
        """What names the weights: LMCache's ``model_name`` is the path or
        hub id the engine loads (vLLM's ``model_config.model``, SGLang's
        ``model_path``); the engine's own record of that model, when this
        process holds one (vLLM building this worker, a launched SGLang),
        adds its revision, load format, download dir, quantization and
        overrides."""
        name = str(getattr(md, "model_name", "") or "")
        if not name:
            return None
        for rec in (vllm_model(), sglang_model()):
            if rec is not None and rec["model"] == name:
                return rec
        return {"model": name}

    def _geometry(self, md: Any, config: Any) -> Geometry:
        shape = list(getattr(md, "kv_shape", ()) or ())
        ident = {
            "model": str(getattr(md, "model_name", "")),
            "kv_shape": [int(x) for x in shape],
            "kv_dtype": str(getattr(md, "kv_dtype", "")),
            "use_mla": bool(getattr(md, "use_mla", False)),
            "chunk_size": int(getattr(md, "chunk_size", 0) or 0),
            "fmt": str(self.meta_fmt),
            "shapes": [str(tuple(s)) for s in self.meta_shapes],
            "dtypes": [str(d) for d in self.meta_dtypes],
            "chunk_meta": bool(self.save_chunk_meta),
            **self.weights,
        }
        # In the key too: pages of other weights or another layout are
        # stored beside these, never refused in their place (write-once).
        self.tag = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        mla = ident["use_mla"]
        dim = lambda i: int(shape[i]) & 0xFFFF if len(shape) > i else 0  # noqa: E731
        return Geometry(
            model_hash=identity_hash("kvcellar-lmcache/v1", ident),
            page_size=ident["chunk_size"],
            dtype_tag=zlib.crc32(ident["kv_dtype"].encode()),
            tp_size=0 if mla else int(getattr(md, "world_size", 1)) & 0xFFFF,
            tp_rank=0 if mla else int(getattr(md, "worker_id", 0)) & 0xFFFF,
            layer_num=dim(0),
            head_num=dim(3),
            head_dim=dim(4),
            mla=mla,
        )

    def _key(self, key: Any) -> bytes:
        """LMCache's key string (any characters) as a store key:
        ``{tenant/}{tag}/{key}``, the tag naming the identity."""
        s = key if isinstance(key, str) else key.to_string()
        k = f"{self.prefix}{self.tag}/{s}".encode()
        if len(k) > MAX_KEY or b"\0" in k:
            k = f"{self.prefix}{self.tag}/sha256:{hashlib.sha256(s.encode()).hexdigest()}".encode()
        return k

    # -- plumbing -------------------------------------------------------------------

    def _error(self, what: str, e: BaseException) -> None:
        self._misses.error(what, e)

    async def _run(self, fn: Callable[[float], Any], what: str, default: Any,
                   abandon: Optional[Callable[[Any], None]] = None, hold: Sequence[Any] = ()) -> Any:
        """Runs ``fn(started)`` off the event loop; ``started`` (monotonic) is
        when LMCache called, from which ``fn`` counts its deadline. Awaits
        the call to its end: its deadline bounds it.

        If the caller cancels (LMCache's ``wait_for`` around some calls),
        this still waits for the call to return before it ends, so no call
        runs on in the engine's memory behind a method that is over.
        `hold`: memory objects the call reads; a reference is held while it
        runs. `abandon`: gets a result nobody took (to release memory objects)."""
        started = time.monotonic()
        for o in hold:
            o.ref_count_up()
        try:
            fut = self._pool.submit(fn, started)
        except RuntimeError:  # closed: the pool takes no more work
            for o in hold:
                o.ref_count_down()
            return default
        if hold:
            fut.add_done_callback(lambda _f: [o.ref_count_down() for o in hold])
        done = asyncio.wrap_future(fut)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            while not done.done():
                try:
                    await asyncio.wait({done})
                except asyncio.CancelledError:
                    continue
            if abandon is not None and not done.cancelled() and done.exception() is None:
                abandon(done.result())
            raise
        except ClosedError:
            return default
        except Exception as e:  # noqa: BLE001 - a failure is a miss for LMCache
            self._error(what, e)
            return default

    def _sync(self, what: str, default: Any, fn: Callable[[], Any]) -> Any:
        """A synchronous method's body: a failure is `default`, logged
        (:mod:`kvcellar._misses`)."""
        return self._misses.run(what, default, fn)

    # -- existence ------------------------------------------------------------------

    def _exist(self, keys: Sequence[Any], started: Optional[float] = None) -> List[Status]:
        """One batch exist under what is left of the lookup deadline; keys
        it cut (or left unasked, no time left) are counted and absent."""
        if not keys:
            return []
        ms = left_ms(self.deadlines.lookup_ms, started)
        if ms <= 0:
            self._counters.add("kvplugin_lookup_deadline_misses_total", len(keys))
            return [Status.TIMEOUT] * len(keys)
        with self.client.call_timeout(ms):
            st = self.client.batch_exist([self._key(k) for k in keys])
        self._counters.add("kvplugin_lookup_deadline_misses_total", sum(s is Status.TIMEOUT for s in st))
        return st

    def _leading(self, keys: Sequence[Any], started: Optional[float] = None) -> int:
        st = self._exist(keys, started)
        return next((i for i, s in enumerate(st) if s is not Status.OK), len(st))

    async def exists(self, key: Any) -> bool:
        return await self._run(lambda t: self._leading([key], t) == 1, "exists", False)

    def exists_sync(self, key: Any) -> bool:
        return self._sync("exists", False, lambda: self._leading([key]) == 1)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[Any], pin: bool = False) -> int:
        return await self._run(lambda t: self._leading(keys, t), "batched contains", 0)  # one request per node

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[Any]) -> int:
        return self._sync("batched contains", 0, lambda: self._leading(keys))

    # -- get ---------------------------------------------------------------------------

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _segments(self, obj: Any) -> Tuple[List[Any], Any]:
        meta = (ctypes.c_char * self.remote_metadata_bytes)() if self.save_chunk_meta else None
        segs = ([meta] if meta is not None else []) + [obj.byte_array]
        return segs, meta

    def _finish(self, obj: Any, meta: Any, r: GetResult) -> Optional[Any]:
        """The memory object for a completed read, or None (obj released)."""
        try:
            if r.status is not Status.OK:
                obj.ref_count_down()
                return None
            payload = r.length
            if meta is not None:
                payload -= self.remote_metadata_bytes
                md = RemoteMetadata.deserialize(bytes(meta))
                if md.length != payload:
                    raise ValueError(f"stored metadata says {md.length} bytes, {payload} arrived")
            if payload != self.full_chunk_size_bytes:
                obj = self.reshape_partial_chunk(obj, payload)
            return obj
        except Exception as e:  # noqa: BLE001
            self._error("get (chunk check)", e)
            obj.ref_count_down()
            return None

    def _get_many(self, keys: Sequence[Any], started: Optional[float] = None) -> List[Optional[Any]]:
        """Reads chunks into memory objects it allocates, in slices under
        the load deadline (the first under what is left since `started`);
        chunks after the first that failed are not read (LMCache uses the
        leading ones)."""
        objs, metas, segs = [], [], []
        res: List[GetResult] = [GetResult(Status.MISS, 0)] * len(keys)
        try:
            for _ in keys:
                obj = self._allocate()
                if obj is None:
                    raise MemoryError("LMCache's local CPU backend could not allocate a chunk")
                s, m = self._segments(obj)
                objs.append(obj)
                metas.append(m)
                segs.append(s)
            full = [self._key(k) for k in keys]

            def call(lo: int, hi: int) -> List[Status]:
                res[lo:hi] = self.client.batch_getv(full[lo:hi], segs[lo:hi])
                return [r.status for r in res[lo:hi]]

            sizes = [o.get_size() + (self.remote_metadata_bytes if m is not None else 0) for o, m in zip(objs, metas)]
            st, cut = run_slices(self.client, self.deadlines.load_ms, sizes, call, started=started)
        except BaseException:
            for o in objs:
                o.ref_count_down()
            raise
        timed = sum(s is Status.TIMEOUT for s in st) + (sum(s is None for s in st) if cut else 0)
        self._counters.add("kvplugin_load_deadline_misses_total", timed)
        return [self._finish(o, m, r) for o, m, r in zip(objs, metas, res)]

    @staticmethod
    def _release(objs: Any) -> None:
        for o in objs or []:
            if o is not None:
                o.ref_count_down()

    async def get(self, key: Any) -> Optional[Any]:
        out = await self._run(lambda t: self._get_many([key], t), "get", [None], abandon=self._release)
        return out[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Optional[Any]]:
        return await self._run(lambda t: self._get_many(keys, t), "batched get", [None] * len(keys),
                               abandon=self._release)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[Any]) -> List[Any]:
        got = await self.batched_get(keys)
        out = []
        for i, o in enumerate(got):
            if o is None:
                self._release(got[i + 1 :])
                break
            out.append(o)
        return out

    # -- put -------------------------------------------------------------------------------

    def _put_segments(self, obj: Any) -> List[Any]:
        buf = obj.byte_array
        if not self.save_chunk_meta:
            return [buf]
        md = RemoteMetadata(len(buf), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format())
        return [md.serialize(), buf]

    def _put_many(self, keys: Sequence[Any], objs: Sequence[Any], started: Optional[float] = None) -> List[Status]:
        """Stores chunks in slices under the save deadline (the first under
        what is left since `started`); after a slice with a chunk not
        stored the rest are dropped too (a chunk after a hole is never a
        prefix hit). Dropped chunks are counted, those the deadline cut apart."""
        full = [self._key(k) for k in keys]
        segs = [self._put_segments(o) for o in objs]
        sizes = [o.get_size() + (self.remote_metadata_bytes if self.save_chunk_meta else 0) for o in objs]
        st, cut = run_slices(self.client, self.deadlines.save_ms, sizes,
                             lambda lo, hi: self.client.batch_putv(full[lo:hi], segs[lo:hi]), started=started)
        dropped = sum(s is not Status.OK for s in st)
        self._counters.add("kvplugin_saves_dropped_total", dropped)
        self._counters.add("kvplugin_saves_dropped_deadline_total",
                           sum(s is Status.TIMEOUT for s in st) + (sum(s is None for s in st) if cut else 0))
        if dropped:
            first = next(s for s in st if s is not Status.OK)
            why = f"{first.name} ({self.client.last_error()})" if first is not None else "no time left"
            self._error("put", RuntimeError(f"{dropped} of {len(st)} chunks not stored: {why}"))
        return [s if s is not None else Status.TIMEOUT for s in st]

    async def put(self, key: Any, memory_obj: Any) -> None:
        # LMCache's wrapper releases the object after this returns: no ref_count_down here.
        await self._run(lambda t: self._put_many([key], [memory_obj], t), "put", None, hold=[memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[Any]) -> None:
        await self._run(lambda t: self._put_many(keys, memory_objs, t), "batched put", None,
                        hold=list(memory_objs))

    # -- the rest ----------------------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        return self._sync("remove", False, lambda: self.client.delete(self._key(key)) is Status.OK)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the owner of a probe key answers, else the status code."""
        def probe(started: float) -> Status:
            with self.client.call_timeout(max(1, left_ms(self.deadlines.lookup_ms, started))):
                return self.client.exist(b"kvcellar-ping")

        st = await self._run(probe, "ping", Status.UNAVAILABLE)
        return 0 if st in (Status.OK, Status.MISS, Status.MISMATCH) else int(st)

    async def list(self) -> List[str]:
        """Always ``[]``: a shared fleet has no cheap listing of its keys."""
        return []

    async def close(self) -> None:
        # Closing waits for calls in flight: off the event loop.
        self._pool.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self.client.close)

    def stats(self) -> Dict[str, float]:
        """The connector's own counters (``kvplugin_*``: lookups, loads and
        saves cut by their deadline, chunks dropped) and the client's
        (``kvclient_*``), docs/plugins/lmcache.md "Deadlines"."""
        out = self._counters.snapshot()
        try:
            out.update(self.client.counters())
        except ClosedError:
            pass
        return out
