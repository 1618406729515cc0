"""SGLang's HiCache storage interface: the real classes when SGLang is
importable, else stand-ins with the same names, fields and signatures
(read from sglang 0.5.23, ``sglang/srt/mem_cache/hicache_storage.py`` and
``sglang/srt/observability/metrics_collector.py``).

The stand-ins let ``kvcellar.hicache`` import, and be tested, without torch
or SGLang. ``KVCELLAR_FORCE_STANDIN=1`` selects them even where SGLang is
installed (tests of the package's own import closure).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

REAL = False

if os.environ.get("KVCELLAR_FORCE_STANDIN") != "1":
    try:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
            HiCacheStorage,
            HiCacheStorageConfig,
            HiCacheStorageExtraInfo,
            PoolHitPolicy,
            PoolName,
            PoolTransfer,
            PoolTransferResult,
        )
        from sglang.srt.observability.metrics_collector import StorageMetrics  # type: ignore[import-not-found]

        REAL = True
    except ImportError:
        REAL = False

if not REAL:

    @dataclass
    class HiCacheStorageConfig:  # type: ignore[no-redef]
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        attn_cp_rank: int
        attn_cp_size: int
        is_mla_model: bool
        enable_storage_metrics: bool
        is_page_first_layout: bool
        model_name: Optional[str]
        tp_lcm_size: Optional[int] = None
        should_split_heads: bool = False
        dp_rank: int = 0
        extra_config: Optional[dict] = None
        dcp_size: int = 1
        dcp_rank: int = 0
        logical_page_size: Optional[int] = None

        @property
        def is_storage_writer(self) -> bool:
            return not self.is_mla_model or self.tp_rank == self.dcp_rank

    @dataclass
    class HiCacheStorageExtraInfo:  # type: ignore[no-redef]
        prefix_keys: Optional[List[str]] = None
        extra_info: Optional[dict] = None

    class PoolName(str, Enum):  # type: ignore[no-redef]
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"
        INDEXER = "indexer"
        DRAFT = "draft"

        def __str__(self) -> str:
            return self.value

    class PoolHitPolicy(str, Enum):  # type: ignore[no-redef]
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"
        BLOCK_GROUPS = "block_groups"

    @dataclass
    class PoolTransfer:  # type: ignore[no-redef]
        name: Any
        host_indices: Any = None
        device_indices: Any = None
        keys: Optional[List[str]] = None
        hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
        nodes_to_load: Optional[List[Any]] = None
        indices_from_pool: Any = None
        block_pages: int = 0
        group_pages: int = 0

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        kv_hit_pages: int
        extra_pool_hit_pages: Dict[str, int]
        restorable_prefix_pages: Optional[List[int]] = None

    @dataclass
    class StorageMetrics:  # type: ignore[no-redef]
        prefetch_pgs: List[int] = field(default_factory=list)
        backup_pgs: List[int] = field(default_factory=list)
        prefetch_bandwidth: List[float] = field(default_factory=list)
        backup_bandwidth: List[float] = field(default_factory=list)

    @dataclass
    class HiCacheStorage(ABC):  # type: ignore[no-redef]
        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def on_host_pools_registered(self) -> None:
            pass

        def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                            extra_info: Optional[Any] = None) -> Any:
            raise NotImplementedError()

        def batch_get_v2(self, transfers: List[Any], extra_info: Optional[Any] = None) -> Dict[str, List[bool]]:
            raise NotImplementedError()

        def batch_set_v2(self, transfers: List[Any], extra_info: Optional[Any] = None) -> Dict[str, List[bool]]:
            raise NotImplementedError()

        def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Optional[Any] = None) -> List[bool]:
            pass  # type: ignore[return-value]

        def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Optional[Any] = None) -> List[bool]:
            pass  # type: ignore[return-value]

        @abstractmethod
        def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
            pass

        @abstractmethod
        def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                      target_sizes: Optional[Any] = None) -> Any:
            pass

        @abstractmethod
        def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
                target_sizes: Optional[Any] = None) -> bool:
            pass

        @abstractmethod
        def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                      target_sizes: Optional[Any] = None) -> bool:
            pass

        @abstractmethod
        def exists(self, key: str) -> bool:
            pass

        def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
            for i in range(len(keys)):
                if not self.exists(keys[i]):
                    return i
            return len(keys)

        def clear(self) -> None:
            pass

        def get_stats(self) -> Any:
            return None


__all__ = [
    "REAL",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageMetrics",
]
