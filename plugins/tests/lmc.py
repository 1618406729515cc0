"""LMCache pieces for the connector's tests.

``make_connector`` loads ``kvcellar.lmcache`` through LMCache's own plugin
loading with ``LocalCPUBackend`` and ``RemoteBackend`` on CPU where LMCache
is importable (``real_lmc.py``), else builds it over stand-ins of the
local CPU backend and memory objects (real memory, reference counts kept).
Either way the test gets a ``Harness`` with the same methods.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kvcellar import _lmcache_api

import enum

CHUNK = 16


class MemoryFormat(enum.Enum):
    KV_2LTD = 1
    KV_MLA_FMT = 6
LAYERS, HEADS, HEAD_DIM = 2, 4, 32


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    code: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


FLOAT16 = DType("float16", 2, 2)


class MemoryObj:
    """What a connector uses of LMCache's MemoryObj, over real memory."""

    def __init__(self, backend: "StandInCPUBackend", shapes: List[tuple], dtypes: List[DType], fmt: Any):
        self.backend, self.shapes, self.dtypes, self.fmt = backend, [tuple(s) for s in shapes], dtypes, fmt
        self.size = sum(_n(s) * d.itemsize for s, d in zip(shapes, dtypes))
        self.raw = (ctypes.c_char * self.size)()
        self.ref_count = 1

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw).cast("B")[: self.size]

    @property
    def data_ptr(self) -> int:
        return ctypes.addressof(self.raw)

    def get_size(self) -> int:
        return self.size

    def get_shapes(self):
        return self.shapes

    def get_dtypes(self):
        return self.dtypes

    def get_memory_format(self):
        return self.fmt

    def truncate(self, nbytes: int) -> None:
        tokens = nbytes // (self.size // self.shapes[0][2])
        self.shapes = [(s[0], s[1], tokens, s[3]) for s in self.shapes]
        self.size = nbytes

    def get_ref_count(self) -> int:
        return self.ref_count

    def ref_count_up(self) -> None:
        self.ref_count += 1

    def ref_count_down(self) -> None:
        assert self.ref_count > 0, "released twice"
        self.ref_count -= 1
        if self.ref_count == 0:
            self.backend.free(self)


def _n(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class StandInMetadata:
    model_name: str = "org/model@v1"
    world_size: int = 1
    worker_id: int = 0
    kv_dtype: Any = FLOAT16
    use_mla: bool = False
    chunk_size: int = CHUNK
    fmt: Any = MemoryFormat.KV_2LTD

    @property
    def kv_shape(self):
        return (LAYERS, 2, self.chunk_size, HEADS, HEAD_DIM)

    def get_shapes(self):
        return [(2, LAYERS, self.chunk_size, HEADS * HEAD_DIM)]

    def get_dtypes(self):
        return [self.kv_dtype]


@dataclass
class StandInConfig:
    extra_config: Dict[str, Any] = field(default_factory=dict)
    remote_storage_plugins: List[str] = field(default_factory=list)
    use_layerwise: bool = False


class StandInCPUBackend:
    def __init__(self, config: StandInConfig, metadata: StandInMetadata):
        self.config, self.metadata = config, metadata
        self.live: set = set()
        self.spare: Dict[int, List[MemoryObj]] = {}

    def allocate(self, shapes, dtypes, fmt) -> Optional[MemoryObj]:
        """Reuses freed buffers, as LMCache's allocator hands out slices of
        memory it reserved up front."""
        size = sum(_n(s) * d.itemsize for s, d in zip(shapes, dtypes))
        spare = self.spare.get(size)
        if spare:
            o = spare.pop()
            o.shapes, o.dtypes, o.fmt, o.size, o.ref_count = [tuple(s) for s in shapes], dtypes, fmt, size, 1
        else:
            o = MemoryObj(self, shapes, dtypes, fmt)
        self.live.add(id(o))
        return o

    def free(self, o: "MemoryObj") -> None:
        self.live.discard(id(o))
        self.spare.setdefault(len(o.raw), []).append(o)


def real_lmcache() -> bool:
    return _lmcache_api.REAL


class StandInHarness:
    """Connector over stand-ins, driven from a private event loop."""

    def __init__(self, extra: Dict[str, Any], *, worker_id=0, world_size=1, model="org/model@v1",
                 save_chunk_meta=True, name="kvcellar", chunk_size=CHUNK):
        import asyncio
        import threading

        from kvcellar.lmcache import KvcellarConnector

        ex = {f"remote_storage_plugin.{name}.module_path": "kvcellar.lmcache",
              f"remote_storage_plugin.{name}.class_name": "KvcellarConnector", "save_chunk_meta": save_chunk_meta}
        ex.update({f"remote_storage_plugin.{name}.{k}": v for k, v in extra.items()})
        self.config = StandInConfig(ex, [name])
        self.metadata = StandInMetadata(model_name=model, world_size=world_size, worker_id=worker_id,
                                        chunk_size=chunk_size)
        self.backend = StandInCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connector = KvcellarConnector(loop=self.loop, local_cpu_backend=self.backend, config=self.config)

    def run(self, coro, timeout=60):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def key(self, chunk_hash, model=None):
        m = self.metadata
        h = chunk_hash.hex() if isinstance(chunk_hash, bytes) else f"{chunk_hash:x}"
        return f"{model or m.model_name}@{m.world_size}@{m.worker_id}@{h}@half"

    def new_chunk(self, seed: str, tokens: Optional[int] = None) -> MemoryObj:
        tokens = tokens or self.metadata.chunk_size
        shapes = [(2, LAYERS, tokens, HEADS * HEAD_DIM)]
        o = self.backend.allocate(shapes, [FLOAT16], MemoryFormat.KV_2LTD)
        pattern = bytes(((i * 7 + sum(seed.encode())) >> 1) & 0xFF for i in range(256))
        ctypes.memmove(o.raw, (pattern * (o.size // 256 + 1))[: o.size], o.size)
        return o

    @staticmethod
    def data(o) -> bytes:
        return bytes(o.byte_array)

    def live_objects(self) -> int:
        return len(self.backend.live)

    def close(self):
        self.run(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_harness(extra: Dict[str, Any], fingerprint: Optional[str] = "test-weights", **kw) -> Any:
    """`fingerprint`: the connector's model_fingerprint unless `extra` names
    one (None: computed from the model name, a path or hub id)."""
    if fingerprint is not None and "model_fingerprint" not in extra:
        extra = {"model_fingerprint": fingerprint, **extra}
    if real_lmcache():
        from real_lmc import RealHarness

        return RealHarness(extra, **kw)
    return StandInHarness(extra, **kw)
