"""vLLM KV connector over kvcellar (vLLM 0.33, ``KVConnectorBase_V1``).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVCellarConnector",
        "kv_connector_module_path": "kvcellar.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mds": "host:port,...", "group": "default"}}'

(docs/plugins/vllm.md has every key.)

What moves, and how:

- A *unit* is ``blocks_per_unit`` consecutive vLLM blocks (default: 256
  tokens, 16 blocks of 16). It is the store's object: one per unit per
  (PP stage, TP shard), holding that rank's layers, block after block, as
  the iovec. Hits and saves count in whole units; a prompt's last partial
  unit is recomputed.
- The key is ``{tenant/}{hash}.{tag}{.tp r-s}{.pp r-s}``: ``hash`` is the
  hex of vLLM's chained hash of the unit's LAST block (it covers the whole
  prefix), ``tag`` 16 hex digits of a digest of the page identity (the
  model, a fingerprint of its weights, quantization, RoPE, overrides, KV
  dtype, block size, unit size, cache layout, hash algorithm, TP and PP
  sizes, heads, head sizes, layer count, MLA). The same identity is the
  pages' ``model_hash``. MLA pages carry no TP part: TP rank 0 of each
  stage writes them and every TP rank reads them.
- Scheduler side (``kvcellar._vllm_scheduler``): the lookup runs on a
  background thread while vLLM is told "not ready" (``None``); it never
  waits on the network. Loads are asynchronous (vLLM parks the request in
  ``WAITING_FOR_REMOTE_KVS``).
- Worker side (``kvcellar._vllm_worker``): loads run on background threads
  straight from the sockets into the paged KV cache (a GPU cache stages
  through pinned host memory); saves run in :meth:`wait_for_save` and are
  acknowledged before the step ends (vLLM may reuse a block as soon as the
  step is over). Every library call is bounded (``save_timeout_ms``,
  ``load_timeout_ms``, 3/4 of ``lookup_timeout_ms``) and returns only once
  it no longer touches vLLM's blocks.
- A failure of the store is a miss and a recompute: failed blocks are
  reported to vLLM (``kv_load_failure_policy`` must be ``recompute``; the
  connector sets it when left at vLLM's default ``fail``) and counted.

This class is thin: it builds the side its role needs and hands vLLM's
calls to it; what both sides share is ``kvcellar._vllm_common``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcellar._vllm_common import (
    COUNTERS,
    OWN_KEYS,
    KVCellarMetadata,
    KVCellarStats,
    KVCellarWorkerMeta,
)
from kvcellar._vllm_scheduler import SchedulerSide
from kvcellar._vllm_worker import WorkerSide

# The options (for checks of the guide), the counters and the metadata
# types are re-exported.
__all__ = ["COUNTERS", "OWN_KEYS", "KVCellarConnector", "KVCellarMetadata", "KVCellarStats", "KVCellarWorkerMeta"]


class KVCellarConnector(KVConnectorBase_V1):
    """vLLM KV connector over a kvcellar group (see the module docs).

    Attributes not found here are the side's (``tag``, ``geometry``,
    ``counters()``, ``active``, ...), read-only introspection."""

    _cache_hit_source = CacheHitSource.DISK

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a later miss.
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: Optional[SchedulerSide] = None
        self._work: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self, vllm_config, kv_cache_config)
        else:
            self._work = WorkerSide(self, vllm_config, kv_cache_config)
        self._side: Any = self._sched or self._work

    def __getattr__(self, name: str) -> Any:
        side = self.__dict__.get("_side")
        if side is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(side, name)

    def _scheduler(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("kvcellar: a scheduler-side call on a worker-side connector")
        return self._sched

    def _worker(self) -> WorkerSide:
        if self._work is None:
            raise RuntimeError("kvcellar: a worker-side call on a scheduler-side connector")
        return self._work

    def _meta(self) -> Optional[KVConnectorMetadata]:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    # -- both sides ------------------------------------------------------------------

    def counters(self) -> Dict[str, int]:
        """This side's counters since it started."""
        return self._side.counters()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        return self._side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVConnectorStats:
        return KVCellarStats(data=dict(data or {}))

    def shutdown(self) -> None:
        self._side.shutdown()

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._scheduler().request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self._scheduler().take_events()

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole units are saved in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self._worker().build_connector_worker_meta()
