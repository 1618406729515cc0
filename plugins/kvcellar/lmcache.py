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
thread pool and is bounded by the client's timeouts (LMCache waits on
``contains`` without one). Keys are LMCache's key strings as they are (any
characters; longer than the store's 1024 bytes, hashed). With
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
import math
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvcellar._lmcache_api import RemoteConnector, RemoteMetadata, make_logger
from kvcellar._misses import Misses
from kvcellar.client import Client, ClosedError, Geometry, GetResult, Status
from kvcellar.config import CLUSTER_KEYS, DEFAULT_POLL_MS, ConfigError, identity_hash, resolve, tenant_prefix

log = make_logger("kvcellar.lmcache")

__all__ = ["KvcellarConnector"]

MODULE = "kvcellar.lmcache"
OWN_KEYS = CLUSTER_KEYS + ("io_timeout_ms", "connect_timeout_ms", "tenant", "poll_ms", "max_inflight")
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
                           ("max_inflight", 32)):
            v = own.get(k, self.settings.options.get(k, default))
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
        # The library bounds every request; this is the outer bound of one
        # async call, waiting for a worker thread included. A batch may take
        # one round of requests per `batch_concurrency` items.
        self.timeout_s = (ints["io_timeout_ms"] + ints["connect_timeout_ms"]) / 1000.0 + 1.0
        md = local_cpu_backend.metadata
        self.geometry = self._geometry(md, config)
        # The library checks the options (one clear error) before they are read here.
        self.client = Client(settings=self.settings, geometry=self.geometry, poll_ms=ints["poll_ms"])
        self.batch_rounds = int(self.settings.options.get("batch_concurrency", 8))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=ints["max_inflight"],
                                                           thread_name_prefix="kvcellar-lmcache")
        self._misses = Misses(log)
        log.info(
            "kvcellar LMCache connector ready: %s, group %s, model %s, worker %s/%s, chunk meta %s",
            f"mds {','.join(self.settings.mds)}" if self.settings.mds else f"members {self.settings.members}",
            self.settings.group, getattr(md, "model_name", "?"), getattr(md, "worker_id", "?"),
            getattr(md, "world_size", "?"), "on" if self.save_chunk_meta else "off",
        )

    # -- identity ---------------------------------------------------------------

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
        }
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
        """LMCache's key string (any characters) as a store key."""
        s = key if isinstance(key, str) else key.to_string()
        k = (self.prefix + s).encode()
        if len(k) > MAX_KEY or b"\0" in k:
            k = (self.prefix + "sha256:" + hashlib.sha256(s.encode()).hexdigest()).encode()
        return k

    # -- plumbing -------------------------------------------------------------------

    def _error(self, what: str, e: BaseException) -> None:
        self._misses.error(what, e)

    def _bound(self, items: int) -> float:
        return self.timeout_s * max(1, math.ceil(items / max(1, self.batch_rounds)))

    async def _run(self, fn: Callable[[], Any], what: str, default: Any, items: int = 1,
                   abandon: Optional[Callable[[Any], None]] = None, hold: Sequence[Any] = ()) -> Any:
        """Runs a blocking call off the event loop, bounded in time.

        `hold`: memory objects the call reads; a reference is taken for as
        long as the call runs, so a caller that gave up (timeout, cancel) and
        released its own cannot let LMCache reuse the memory under it.
        `abandon`: gets a result nobody took (to release memory objects)."""
        for o in hold:
            o.ref_count_up()
        try:
            fut = self._pool.submit(fn)
        except RuntimeError:  # closed: the pool takes no more work
            for o in hold:
                o.ref_count_down()
            return default
        if hold:
            fut.add_done_callback(lambda _f: [o.ref_count_down() for o in hold])
        taken = False
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(fut), self._bound(items))
            taken = True
            return result
        except asyncio.TimeoutError as e:
            self._error(f"{what} (no answer within {self._bound(items):.1f} s)", e)
            return default
        except ClosedError:
            return default
        except Exception as e:  # noqa: BLE001 - a failure is a miss for LMCache
            self._error(what, e)
            return default
        finally:
            if not taken and abandon is not None:
                # Also on cancellation (a BaseException): whenever the call
                # completes, its result goes back.
                fut.add_done_callback(
                    lambda f: not f.cancelled() and f.exception() is None and abandon(f.result())
                )

    def _sync(self, what: str, default: Any, fn: Callable[[], Any]) -> Any:
        """A synchronous method's body: a failure is `default`, logged
        (:mod:`kvcellar._misses`)."""
        return self._misses.run(what, default, fn)

    # -- existence ------------------------------------------------------------------

    def _leading(self, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        return self.client.leading_hits([self._key(k) for k in keys])

    async def exists(self, key: Any) -> bool:
        return await self._run(lambda: self.client.exist(self._key(key)) is Status.OK, "exists", False)

    def exists_sync(self, key: Any) -> bool:
        return self._sync("exists", False, lambda: self.client.exist(self._key(key)) is Status.OK)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[Any], pin: bool = False) -> int:
        return await self._run(lambda: self._leading(keys), "batched contains", 0)  # one request per node

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

    def _get_many(self, keys: Sequence[Any]) -> List[Optional[Any]]:
        objs, metas, segs = [], [], []
        try:
            for _ in keys:
                obj = self._allocate()
                if obj is None:
                    raise MemoryError("LMCache's local CPU backend could not allocate a chunk")
                s, m = self._segments(obj)
                objs.append(obj)
                metas.append(m)
                segs.append(s)
            res = self.client.batch_getv([self._key(k) for k in keys], segs)
        except BaseException:
            for o in objs:
                o.ref_count_down()
            raise
        return [self._finish(o, m, r) for o, m, r in zip(objs, metas, res)]

    @staticmethod
    def _release(objs: Any) -> None:
        for o in objs or []:
            if o is not None:
                o.ref_count_down()

    async def get(self, key: Any) -> Optional[Any]:
        out = await self._run(lambda: self._get_many([key]), "get", [None], abandon=self._release)
        return out[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Optional[Any]]:
        return await self._run(lambda: self._get_many(keys), "batched get", [None] * len(keys),
                               items=len(keys), abandon=self._release)

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

    def _put_many(self, keys: Sequence[Any], objs: Sequence[Any]) -> List[Status]:
        st = self.client.batch_putv([self._key(k) for k in keys], [self._put_segments(o) for o in objs])
        bad = [s for s in st if s is not Status.OK]
        if bad:
            self._error("put", RuntimeError(f"{len(bad)} of {len(st)} chunks not stored: {bad[0].name} "
                                            f"({self.client.last_error()})"))
        return st

    async def put(self, key: Any, memory_obj: Any) -> None:
        # LMCache's wrapper releases the object after this returns: no ref_count_down here.
        await self._run(lambda: self._put_many([key], [memory_obj]), "put", None, hold=[memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[Any]) -> None:
        await self._run(lambda: self._put_many(keys, memory_objs), "batched put", None, items=len(keys),
                        hold=list(memory_objs))

    # -- the rest ----------------------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        return self._sync("remove", False, lambda: self.client.delete(self._key(key)) is Status.OK)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the owner of a probe key answers, else the status code."""
        st = await self._run(lambda: self.client.exist(b"kvcellar-ping"), "ping", Status.UNAVAILABLE)
        return 0 if st in (Status.OK, Status.MISS, Status.MISMATCH) else int(st)

    async def list(self) -> List[str]:
        """Always ``[]``: a shared fleet has no cheap listing of its keys."""
        return []

    async def close(self) -> None:
        # Closing waits for calls in flight: off the event loop.
        self._pool.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self.client.close)

    def stats(self) -> Dict[str, float]:
        """The client's counters (``kvclient_*``)."""
        return self.client.counters()
