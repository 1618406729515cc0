"""The connector loaded by LMCache 0.5.6 itself (imported only where LMCache
is installed): LMCacheEngineConfig with remote_storage_plugins, LMCache's
CreateStorageBackends building LocalCPUBackend and RemoteBackend on CPU on
a running event loop, the connector taken from inside RemoteBackend."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Dict, Optional

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends

import lmc
from kvcellar.config import ConfigError


class RealHarness:
    def __init__(self, extra: Dict[str, Any], *, worker_id=0, world_size=1, model="org/model@v1",
                 save_chunk_meta=True, name="kvcellar", chunk_size=None):
        chunk = chunk_size or lmc.CHUNK
        ex = {f"remote_storage_plugin.{name}.module_path": "kvcellar.lmcache",
              f"remote_storage_plugin.{name}.class_name": "KvcellarConnector", "save_chunk_meta": save_chunk_meta}
        ex.update({f"remote_storage_plugin.{name}.{k}": v for k, v in extra.items()})
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk, local_cpu=True, max_local_cpu_size=0.5, remote_serde="naive",
            remote_storage_plugins=[name], extra_config=ex)
        self.metadata = LMCacheMetadata(
            model_name=model, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
            local_worker_id=worker_id, kv_dtype=torch.float16,
            kv_shape=(lmc.LAYERS, 2, chunk, lmc.HEADS, lmc.HEAD_DIM), chunk_size=chunk)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop)
        self.backend = self.backends["LocalCPUBackend"]
        self.remote = self.backends[f"RemoteBackend-{name}"]
        conn = self.remote.connection
        if conn is None:
            # LMCache swallowed the constructor's exception (it only logs
            # it); rebuild it the way LMCache does to raise it here.
            from kvcellar.lmcache import KvcellarConnector

            self.close()
            KvcellarConnector(loop=self.loop, local_cpu_backend=self.backend, config=self.config)
            raise ConfigError("LMCache did not load the connector")
        self.connector = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
        # Every memory object LMCache hands out, so tests can count the live ones.
        self._allocated = []
        allocate = self.backend.allocate

        def tracked(*a, **kw):
            o = allocate(*a, **kw)
            if o is not None:
                self._allocated.append(o)
            return o

        self.backend.allocate = tracked

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def key(self, chunk_hash, model=None) -> str:
        m = self.metadata
        return CacheEngineKey(model or m.model_name, m.world_size, m.worker_id, chunk_hash, torch.float16).to_string()

    def cache_key(self, chunk_hash) -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(m.model_name, m.world_size, m.worker_id, chunk_hash, torch.float16)

    def new_chunk(self, seed: str, tokens: Optional[int] = None) -> Any:
        tokens = tokens or self.metadata.chunk_size
        shapes = [torch.Size([2, lmc.LAYERS, tokens, lmc.HEADS * lmc.HEAD_DIM])]
        o = self.backend.allocate(shapes, [torch.float16], MemoryFormat.KV_2LTD)
        pattern = bytes(((i * 7 + sum(seed.encode())) >> 1) & 0xFF for i in range(256))
        n = o.get_size()
        o.byte_array.cast("B")[:] = (pattern * (n // 256 + 1))[:n]
        return o

    @staticmethod
    def data(o) -> bytes:
        return bytes(o.byte_array.cast("B")[: o.get_size()])

    def live_objects(self) -> int:
        return sum(o.get_ref_count() > 0 for o in self._allocated)

    def close(self):
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for o in getattr(self, "_allocated", []):  # the tests' own chunks
            while o.get_ref_count() > 0:
                o.ref_count_down()
        for b in reversed(list(getattr(self, "backends", {}).values())):
            b.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
