"""LMCache's remote-connector interface: the real classes when LMCache is
importable, else stand-ins with the same names and behaviour as far as a
connector uses them (read from lmcache 0.5.6,
``lmcache/v1/storage_backend/connector/base_connector.py`` and
``lmcache/v1/protocol.py``).

The stand-ins let ``kvcellar.lmcache`` import, and be tested, without torch
or LMCache. ``KVCELLAR_FORCE_STANDIN=1`` selects them even where LMCache is
installed.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, List, Optional

REAL = False

if os.environ.get("KVCELLAR_FORCE_STANDIN") != "1":
    try:
        from lmcache.v1.protocol import RemoteMetadata  # type: ignore[import-not-found]
        from lmcache.v1.storage_backend.connector.base_connector import (  # type: ignore[import-not-found]
            RemoteConnector,
        )

        REAL = True
    except ImportError:
        REAL = False

if not REAL:

    def _nbytes(shape: Any, dtype: Any) -> int:
        n = 1
        for d in shape:
            n *= int(d)
        return n * int(dtype.itemsize)

    @dataclass
    class RemoteMetadata:  # type: ignore[no-redef]
        """length, fmt, then (dtype code, 4 dims) per group, as int32s."""

        length: int
        shapes: list
        dtypes: list
        fmt: Any

        def serialize(self) -> bytes:
            vals = [self.length, int(getattr(self.fmt, "value", self.fmt))]
            for shape, dtype in zip(self.shapes, self.dtypes):
                dims = list(shape) + [0] * (4 - len(shape))
                vals += [int(getattr(dtype, "code", 0))] + [int(d) for d in dims]
            return struct.pack("i" * len(vals), *vals)

        @staticmethod
        def deserialize(s: Any) -> "RemoteMetadata":
            n = len(s) // 4
            vals = struct.unpack_from("i" * n, s)
            groups = (n - 2) // 5
            shapes, dtypes = [], []
            for g in range(groups):
                code, *dims = vals[2 + 5 * g : 7 + 5 * g]
                while dims and dims[-1] == 0:
                    dims.pop()
                shapes.append(tuple(dims))
                dtypes.append(code)
            return RemoteMetadata(vals[0], shapes, dtypes, vals[1])

    class RemoteConnector(metaclass=abc.ABCMeta):  # type: ignore[no-redef]
        def __init__(self, config: Any, metadata: Any):
            assert metadata is not None
            self.save_chunk_meta = (
                config.extra_config is None
                or config.extra_config.get("save_chunk_meta", True)
                or getattr(config, "use_layerwise", False)
            )
            self.meta_shapes = metadata.get_shapes()
            self.meta_dtypes = metadata.get_dtypes()
            self.meta_fmt = metadata.fmt
            self.full_chunk_size_bytes = sum(_nbytes(s, d) for s, d in zip(self.meta_shapes, self.meta_dtypes))
            assert self.full_chunk_size_bytes % metadata.chunk_size == 0
            self.single_token_size = self.full_chunk_size_bytes // metadata.chunk_size
            self.remote_metadata_bytes = 4 * (2 + 5 * len(self.meta_shapes))

        def reshape_partial_chunk(self, memory_obj: Any, bytes_read: int) -> Any:
            if bytes_read == 0 or bytes_read % self.single_token_size or bytes_read > self.full_chunk_size_bytes:
                raise ValueError(f"bytes_read: {bytes_read} is illegal")
            if bytes_read == self.full_chunk_size_bytes:
                return memory_obj
            memory_obj.truncate(bytes_read)
            return memory_obj

        def post_init(self) -> None:
            pass

        @abc.abstractmethod
        async def exists(self, key: Any) -> bool: ...

        @abc.abstractmethod
        def exists_sync(self, key: Any) -> bool: ...

        @abc.abstractmethod
        async def get(self, key: Any) -> Optional[Any]: ...

        @abc.abstractmethod
        async def put(self, key: Any, memory_obj: Any) -> None: ...

        @abc.abstractmethod
        async def list(self) -> List[str]: ...

        @abc.abstractmethod
        async def close(self) -> None: ...

        def support_ping(self) -> bool:
            return False

        async def ping(self) -> int:
            raise NotImplementedError

        def support_batched_get(self) -> bool:
            return False

        async def batched_get(self, keys: List[Any]) -> List[Optional[Any]]:
            raise NotImplementedError

        def support_batched_put(self) -> bool:
            return False

        async def batched_put(self, keys: List[Any], memory_objs: List[Any]) -> None:
            raise NotImplementedError

        @abc.abstractmethod
        def support_batched_async_contains(self) -> bool:
            return True

        async def batched_async_contains(self, lookup_id: str, keys: List[Any], pin: bool = False) -> int:
            results = await asyncio.gather(*[self.exists(k) for k in keys])
            return results.index(False) if False in results else len(results)

        def support_batched_get_non_blocking(self) -> bool:
            return True

        async def batched_get_non_blocking(self, lookup_id: str, keys: List[Any]) -> List[Any]:
            raise NotImplementedError

        def remove_sync(self, key: Any) -> bool:
            raise NotImplementedError

        def batched_contains(self, keys: List[Any]) -> int:
            raise NotImplementedError

        def support_batched_contains(self) -> bool:
            return False



def make_logger(name: str) -> logging.Logger:
    """LMCache's own logger setup where LMCache runs (its loggers print with
    its handler and do not propagate), else a plain logger."""
    if REAL:
        try:
            from lmcache.logging import init_logger  # type: ignore[import-not-found]

            return init_logger(name)
        except ImportError:
            pass
    return logging.getLogger(name)


__all__ = ["REAL", "RemoteConnector", "RemoteMetadata", "make_logger"]
