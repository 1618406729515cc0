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
  prefix), ``tag`` 16 hex digits of a digest of the page identity (model,
  revision, KV dtype, block size, unit size, cache layout, hash algorithm,
  TP and PP sizes, heads, head sizes, layer count, MLA). The same identity
  is the pages' ``model_hash``. MLA pages carry no TP part: TP rank 0 of
  each stage writes them and every TP rank reads them.
- Scheduler side: :meth:`get_num_new_matched_tokens` answers "not ready"
  (``None``) while a batch exist over the request's units runs on a
  background thread, then the leading whole units every shard holds. It
  never waits on the network; a lookup slower than ``lookup_timeout_ms`` is
  a miss. Loads are asynchronous (vLLM parks the request in
  ``WAITING_FOR_REMOTE_KVS``).
- Worker side: loads run on a background thread straight from the
  sockets into the paged KV cache (no copy on a CPU cache; a GPU cache
  stages through pinned host memory); saves run in :meth:`wait_for_save`
  and are acknowledged before the step ends (vLLM may free and reuse a
  block as soon as the step is over).
- A failure of the store is a miss and a recompute: failed blocks are
  reported to vLLM (``kv_load_failure_policy`` must be ``recompute``; the
  connector sets it when left at vLLM's default ``fail``) and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcellar._misses import Misses
from kvcellar.client import Client, Geometry, Status
from kvcellar.config import (
    CLUSTER_KEYS,
    DEFAULT_POLL_MS,
    TIMEOUT_KEYS,
    ConfigError,
    identity_hash,
    plugin_settings,
    positive_int,
    tenant_prefix,
)

# A child of vLLM's logger: the lines appear in vLLM's log, in its format.
log = logging.getLogger("vllm.kvcellar")

__all__ = ["KVCellarConnector", "KVCellarStats"]

#: kv_connector_extra_config keys (the cluster keys are the other plugins').
OWN_KEYS = CLUSTER_KEYS + TIMEOUT_KEYS + (
    "model_id", "tenant", "poll_ms", "blocks_per_unit", "lookup_timeout_ms", "host_staging",
)
#: The library's per-item limit (README, "C ABI conventions").
MAX_SEGMENTS = 4096
UNIT_TOKENS = 256
#: Lookups queued or running at once; more are answered as misses at once
#: (a hung node must not build a backlog that outlives it).
MAX_LOOKUPS = 64
#: Host memory a staged (GPU) load or save uses at once.
STAGE_BYTES = 256 << 20

COUNTERS = (
    "lookups", "lookup_tokens", "lookup_hit_tokens", "lookup_timeouts", "lookup_errors", "lookups_shed",
    "load_units", "load_failed_units", "load_bytes", "save_units", "save_failed_units", "save_bytes",
)


class KVCellarStats(KVConnectorStats):
    """Counters since the last report, summed over workers (vLLM logs
    ``reduce()`` with its KV transfer metrics)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCellarStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS if self.data.get(k)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Transfer:
    """One request's units to load or save in this step."""

    req_id: str
    keys: List[str]  # base keys, one per unit (no rank suffix)
    # Per unit, the vLLM block id of each of its blocks; -1 is a block this
    # load skips (already computed locally): its bytes go to scratch.
    blocks: List[List[int]]


@dataclass
class KVCellarMetadata(KVConnectorMetadata):
    loads: List[_Transfer] = field(default_factory=list)
    saves: List[_Transfer] = field(default_factory=list)


@dataclass
class KVCellarWorkerMeta(KVConnectorWorkerMetadata):
    """Units this worker stored or found missing in the step (base keys)."""

    stored: Dict[str, int] = field(default_factory=dict)
    missing: Set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVCellarWorkerMeta":
        if isinstance(other, KVCellarWorkerMeta):
            for k, n in other.stored.items():
                self.stored[k] = self.stored.get(k, 0) + n
            self.missing |= other.missing
        return self


@dataclass
class _ReqState:
    """The scheduler's view of one request."""

    request: Any
    lookup: Optional[Future] = None  # over every whole unit of the prompt
    lookup_started: float = 0.0
    hit_units: int = 0  # the load ends here: the leading units present from vLLM's local prefix on
    present: Set[int] = field(default_factory=set)  # units the lookup found stored
    saved_units: int = 0  # units [0, saved_units) stored, hit or handed to a save
    loading: bool = False
    loads: int = 0  # loads planned for this request (a second one is never offered)
    timed_out: bool = False  # no lookup answer (too slow, or shed): no hit, no saves


class _LayerSegments:
    """Where each vLLM block of one layer lives, as raw host segments, in a
    canonical byte order.

    vLLM gives each layer a ``[kernel blocks, heads, tokens, content]`` view
    whose strides follow the cache layout; a vLLM block may span ``k``
    kernel blocks (an attention backend with smaller blocks). A block's
    bytes are ordered as the layout orders one unsplit block (its dims by
    stride, the token dim as kernel-block-major then token), so a
    deployment that splits blocks and one that does not store the same
    bytes; a run of dims dense in memory is one segment.
    """

    def __init__(self, view: Any, num_blocks: int, block_size: int) -> None:
        kb = int(view.shape[0])
        if num_blocks <= 0 or kb % num_blocks:
            raise ValueError(f"{kb} kernel blocks for {num_blocks} blocks")
        k = kb // num_blocks
        if int(view.shape[2]) * k != block_size:
            raise ValueError(f"{k} kernel blocks of {int(view.shape[2])} tokens are not a {block_size}-token block")
        self.view = view
        self.k = k
        es = int(view.element_size())
        self.base = int(view.data_ptr())
        self.block_stride = int(view.stride(0)) * k * es
        # (dim of the view, size, stride) in the canonical order; dim 0 is
        # the kernel block, placed just outside the token dim (2).
        order = sorted((1, 2, 3), key=lambda d: -int(view.stride(d)))
        dims: List[Tuple[int, int, int]] = []
        for d in order:
            if d == 2:
                dims.append((0, k, int(view.stride(0))))
            dims.append((d, int(view.shape[d]), int(view.stride(d))))
        self.order = [d for d, _, _ in dims]  # for staging: the permutation of a [k, H, n, C] slice
        live = [(sz, st) for _, sz, st in dims if sz > 1]
        run = 1
        while live and live[-1][1] == run:
            run *= live.pop()[0]
        if run == 1 and live:
            raise ValueError("the KV cache view has no contiguous innermost dimension")
        offsets = [0]
        for sz, st in live:
            offsets = [o + i * st for o in offsets for i in range(sz)]
        runs: List[Tuple[int, int]] = []
        for o in offsets:  # adjacent runs of one block: one segment
            if runs and runs[-1][0] + runs[-1][1] == o * es:
                runs[-1] = (runs[-1][0], runs[-1][1] + run * es)
            else:
                runs.append((o * es, run * es))
        self.runs = runs
        self.block_bytes = sum(n for _, n in runs)

    def block(self, block_id: int, out_addrs: List[int], out_sizes: List[int]) -> None:
        base = self.base + block_id * self.block_stride
        for off, n in self.runs:
            a = base + off
            if out_addrs and out_addrs[-1] + out_sizes[-1] == a:
                out_sizes[-1] += n  # adjacent in memory: one segment
            else:
                out_addrs.append(a)
                out_sizes.append(n)


class KVCellarConnector(KVConnectorBase_V1):
    """vLLM KV connector over a kvcellar group (see the module docs)."""

    _cache_hit_source = CacheHitSource.DISK

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a later miss.
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._misses = Misses(log)
        where = "kv_connector_extra_config"
        cfg = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = plugin_settings(cfg, where)
        self.poll_ms = positive_int(cfg, "poll_ms", DEFAULT_POLL_MS, where)
        self.lookup_timeout_s = positive_int(cfg, "lookup_timeout_ms", 1000, where) / 1000.0
        mc = vllm_config.model_config
        cc = vllm_config.cache_config
        pc = vllm_config.parallel_config
        self.block_size = int(cc.block_size)
        self.blocks_per_unit = positive_int(cfg, "blocks_per_unit", max(1, UNIT_TOKENS // self.block_size), where)
        self.unit_tokens = self.block_size * self.blocks_per_unit
        staging = cfg.get("host_staging", "auto")
        if staging not in ("auto", "always"):
            raise ConfigError(f"{where} key 'host_staging': {staging!r} must be 'auto' or 'always'")
        self.force_staging = staging == "always"
        model = cfg.get("model_id") or getattr(mc, "served_model_name", None) or mc.model
        if isinstance(model, (list, tuple)):
            model = model[0] if model else None
        if not model or not isinstance(model, str):
            raise ConfigError(f"{where} key 'model_id': vLLM gave no model name, so set 'model_id'")
        self.model = model
        self.prefix = tenant_prefix(cfg.get("tenant"), f"{where} key 'tenant'")
        unknown = sorted(set(cfg) - set(OWN_KEYS))
        if unknown:
            log.warning("kvcellar: ignoring unknown kv_connector_extra_config keys %s", unknown)

        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self.mla = bool(getattr(mc, "use_mla", False))
        self.active, why = self._supported(vllm_config, kv_cache_config)
        if not self.active:
            log.warning("kvcellar: the vLLM connector is off for this model: %s; vLLM serves without it", why)
        self._check_hash_seed(cc)
        if self._kv_transfer_config.kv_load_failure_policy == "fail":
            # A cache whose failed load fails the request is worse than none.
            log.warning(
                "kvcellar: kv_load_failure_policy was 'fail'; set to 'recompute' "
                "(a failed load from the cache is recomputed, never a failed request)"
            )
            self._kv_transfer_config.kv_load_failure_policy = "recompute"

        self.identity = self._identity(vllm_config, kv_cache_config)
        self.tag = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.model_hash = identity_hash("kvcellar-vllm/v1", self.identity)
        spec = self._spec(kv_cache_config)
        self.geometry = Geometry(
            model_hash=self.model_hash,
            page_size=self.unit_tokens & 0xFFFFFFFF,
            dtype_tag=zlib.crc32(str(self.identity.get("dtype")).encode()),
            layer_num=int(self.identity.get("layers") or 0) & 0xFFFF,
            head_num=(1 if self.mla else int(getattr(spec, "num_kv_heads", 0) or 0)) & 0xFFFF,
            head_dim=int(getattr(spec, "head_size", 0) or 0) & 0xFFFF,
            mla=self.mla,
        )
        self._stats_lock = threading.Lock()
        self._stats: Dict[str, int] = {}
        self._since: Dict[str, int] = {}  # since the last get_kv_connector_stats
        self._lock = threading.Lock()
        self._closed = False
        self._client: Optional[Client] = None
        if self.active:
            # Options, members and the auth token are checked now.
            self._client = Client(settings=self.settings, geometry=self.geometry, poll_ms=self.poll_ms)
        # Scheduler side.
        self._reqs: Dict[str, _ReqState] = {}
        self._inflight = 0  # lookups queued or running
        self._pending_loads: List[_Transfer] = []
        self._loading_keys: Dict[str, Tuple[str, int]] = {}  # base key -> (request, unit) of planned loads
        self._events: List[Any] = []
        self._want_events = bool(
            getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)
        )
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcellar-lookup")
        # Worker side.
        self._layers: List[_LayerSegments] = []
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcellar-load")
        self._done_loads: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._worker_meta = KVCellarWorkerMeta()
        self._scratch: Any = None
        self._staging = False
        self.tp_rank, self.pp_rank = 0, 0
        log.info(
            "kvcellar vLLM connector (%s): %s, group %s, model %s, unit %d blocks of %d tokens, tag %s%s",
            role.name.lower(),
            f"mds {','.join(self.settings.mds)}" if self.settings.mds else f"members {self.settings.members}",
            self.settings.group, self.model, self.blocks_per_unit, self.block_size, self.tag,
            "" if self.active else " (off)",
        )

    # -- set-up ---------------------------------------------------------------------

    @staticmethod
    def _spec(kv_cache_config: Any) -> Any:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        return groups[0].kv_cache_spec if groups else None

    def _supported(self, vllm_config: Any, kv_cache_config: Any) -> Tuple[bool, str]:
        """Attention KV in one cache group: MHA/GQA and MLA. Not: hybrid
        groups (Mamba, sliding-window groups kept apart), context parallel."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) != 1:
            return False, f"{len(groups)} KV cache groups (hybrid models are not covered)"
        spec = groups[0].kv_cache_spec
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "MLAAttentionSpec"):
            return False, f"its KV cache is {kind} (only full attention and MLA are covered)"
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            return False, "sliding-window or chunked attention"
        pc = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(pc, name, 1) or 1) > 1:
                return False, f"{name} > 1 (context-parallel KV shards are not covered)"
        return True, ""

    @staticmethod
    def _check_hash_seed(cc: Any) -> None:
        """Refuses a per-process random block-hash seed: no other instance,
        nor this one after a restart, could ever hit; every save would be
        write traffic for nothing."""
        algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
        if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            raise ConfigError(
                f"prefix_caching_hash_algo={algo} seeds block hashes randomly per process unless "
                "PYTHONHASHSEED is set: set PYTHONHASHSEED (the same value on every vLLM instance "
                "sharing the cache) or use the default sha256"
            )

    def _identity(self, vllm_config: Any, kv_cache_config: Any) -> Dict[str, Any]:
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        sd = getattr(vllm_config, "speculative_config", None)
        spec = self._spec(kv_cache_config)
        try:
            layers = int(mc.get_total_num_hidden_layers())
        except Exception:  # noqa: BLE001 - older or odd configs
            layers = int(getattr(mc.hf_text_config, "num_hidden_layers", 0) or 0)
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
        return {
            "model": self.model,
            "revision": getattr(mc, "revision", None),
            "dtype": str(getattr(spec, "dtype", None) or mc.dtype),
            "cache_dtype": str(cc.cache_dtype),
            "block_size": self.block_size,
            "blocks_per_unit": self.blocks_per_unit,
            "layout": str(layout),
            "hash": str(getattr(cc, "prefix_caching_hash_algo", "")),
            # MLA's latent is the same on every TP rank: TP splits share it.
            "tp_size": 1 if self.mla else self.tp_size,
            "pp_size": self.pp_size,
            "spec": type(spec).__name__,
            "kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "head_slots": getattr(spec, "num_head_slots", None),
            "state_bytes": getattr(spec, "state_content_bytes", None),
            "quant": str(getattr(spec, "kv_quant_mode", None)),
            "page_bytes": getattr(spec, "page_size_bytes", None),
            "layers": layers,
            # A draft model's layers share the cache group (and the units).
            "draft": str(getattr(sd, "method", None)) + "/" + str(getattr(getattr(sd, "draft_model_config", None),
                                                                         "model", None)) if sd else None,
            "mla": self.mla,
        }

    def counters(self) -> Dict[str, int]:
        """This side's counters since it started."""
        with self._stats_lock:
            return {k: self._stats.get(k, 0) for k in COUNTERS}

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for k, v in inc.items():
                self._stats[k] = self._stats.get(k, 0) + v
                self._since[k] = self._since.get(k, 0) + v

    # -- keys --------------------------------------------------------------------------

    def _base_key(self, block_hash: bytes) -> str:
        return f"{self.prefix}{bytes(block_hash).hex()}.{self.tag}"

    def _shard_suffixes(self) -> List[str]:
        """Every shard's key suffix (what a whole hit needs)."""
        pp = [f".pp{r}-{self.pp_size}" if self.pp_size > 1 else "" for r in range(self.pp_size)]
        if self.mla or self.tp_size == 1:
            tp = [""]
        else:
            tp = [f".tp{r}-{self.tp_size}" for r in range(self.tp_size)]
        return [t + p for p in pp for t in tp]

    def _my_suffix(self) -> str:
        tp = "" if self.mla or self.tp_size == 1 else f".tp{self.tp_rank}-{self.tp_size}"
        pp = f".pp{self.pp_rank}-{self.pp_size}" if self.pp_size > 1 else ""
        return tp + pp

    def _unit_keys(self, request: Any, first: int, last: int) -> List[str]:
        hashes = request.block_hashes
        u = self.blocks_per_unit
        return [self._base_key(hashes[(i + 1) * u - 1]) for i in range(first, last)]

    # ==================================================================================
    # Scheduler side
    # ==================================================================================

    def _lookup(self, keys: List[str]) -> List[bool]:
        """Per unit: whether every shard holds it (one batch exist)."""
        c = self._client
        if c is None or not keys:
            return [False] * len(keys)
        sfx = self._shard_suffixes()
        st = c.batch_exist([k + s for k in keys for s in sfx])
        n = len(sfx)
        return [all(x is Status.OK for x in st[i * n : (i + 1) * n]) for i in range(len(keys))]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        if not self.active or self._closed:
            return 0, False
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _ReqState(request)
        st.request = request
        if st.loads or st.timed_out:
            # Asked again after a load (it failed, or the request was
            # preempted): recompute rather than risk a loop of failing loads.
            return 0, False
        prompt = int(getattr(request, "num_prompt_tokens", request.num_tokens))
        n_units = min(len(request.block_hashes) * self.block_size, prompt) // self.unit_tokens
        first = num_computed_tokens // self.unit_tokens
        if first >= n_units and st.lookup is None:
            # vLLM holds every whole unit; which the store holds is unknown:
            # no saves (this instance saved them when it computed them).
            st.saved_units = n_units
            return 0, False
        if st.lookup is None:
            # One lookup over every unit, from the first: which units the
            # store holds decides both the hit (from the local prefix on)
            # and the saves (the absent units, those vLLM holds included).
            with self._lock:
                shed = self._inflight >= MAX_LOOKUPS
                if not shed:
                    self._inflight += 1
            if shed:
                return self._give_up(st, n_units, lookups_shed=1)
            keys = self._unit_keys(request, 0, n_units)
            st.lookup_started = time.monotonic()
            try:
                st.lookup = self._lookups.submit(self._misses.run, "lookup", None, lambda: self._lookup(keys))
            except RuntimeError:  # shut down meanwhile
                with self._lock:
                    self._inflight -= 1
                return self._give_up(st, n_units)
            st.lookup.add_done_callback(self._lookup_ended)
            self._count(lookups=1, lookup_tokens=n_units * self.unit_tokens)
        if not st.lookup.done():
            if time.monotonic() - st.lookup_started < self.lookup_timeout_s:
                return None, False  # not ready: vLLM asks again next step
            st.lookup.cancel()
            return self._give_up(st, n_units, lookup_timeouts=1)
        found = st.lookup.result()
        if found is None:
            self._count(lookup_errors=1)
            found = []
        st.present = {i for i, ok in enumerate(found) if ok}
        lead = first
        while lead in st.present:
            lead += 1
        st.hit_units = lead
        matched = st.hit_units * self.unit_tokens - num_computed_tokens
        return (matched, True) if matched > 0 else (0, False)

    def _give_up(self, st: _ReqState, n_units: int, **count: int) -> Tuple[int, bool]:
        """A miss, and no saves for the request: the store is not keeping up
        (a lookup too slow, or too many), and which units it holds is unknown."""
        st.timed_out = True
        st.saved_units = n_units
        if count:
            self._count(**count)
        return 0, False

    def _lookup_ended(self, _f: Future) -> None:
        with self._lock:
            self._inflight -= 1

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        # The load covers [start, start + num_external_tokens): start is what
        # vLLM computed locally (block-aligned), the end a unit boundary.
        end = st.hit_units * self.unit_tokens
        start = end - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        first_u, last_u = start // self.unit_tokens, end // self.unit_tokens
        keys = self._unit_keys(request, first_u, last_u)
        first_block = start // self.block_size
        per_unit: List[List[int]] = []
        for u in range(first_u, last_u):
            b0 = u * self.blocks_per_unit
            per_unit.append(
                [block_ids[b] if b >= first_block else -1 for b in range(b0, b0 + self.blocks_per_unit)]
            )
        self._pending_loads.append(_Transfer(request.request_id, keys, per_unit))
        for u, k in zip(range(first_u, last_u), keys):
            self._loading_keys[k] = (request.request_id, u)
        st.loading = True
        st.loads += 1
        self._count(lookup_hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVCellarMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.active:
            return meta
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            done = int(req.num_computed_tokens) + int(n_sched)
            prompt = int(getattr(req, "num_prompt_tokens", req.num_tokens))
            full = min(done, prompt, len(req.block_hashes) * self.block_size) // self.unit_tokens
            if full <= st.saved_units:
                continue
            units = [u for u in range(st.saved_units, full) if u not in st.present]
            st.saved_units = full
            if not units or self._kv_cache_manager is None:
                continue
            block_ids = list(self._kv_cache_manager.get_block_ids(rid)[0])
            u_b = self.blocks_per_unit
            if len(block_ids) < full * u_b:
                continue
            hashes = req.block_hashes
            meta.saves.append(
                _Transfer(
                    rid,
                    [self._base_key(hashes[(u + 1) * u_b - 1]) for u in units],
                    [block_ids[u * u_b : (u + 1) * u_b] for u in units],
                )
            )
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVCellarWorkerMeta):
            for key in wm.missing:
                # Gone from the store since the lookup: vLLM recomputes the
                # unit, and it is saved again.
                rid, unit = self._loading_keys.pop(key, ("", -1))
                st = self._reqs.get(rid)
                if st is not None:
                    st.present.discard(unit)
            if self._want_events:
                self._note_events(wm)
        for rid in connector_output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = False
            self._forget_loads(rid)

    def _forget_loads(self, rid: str) -> None:
        for k in [k for k, (r, _) in self._loading_keys.items() if r == rid]:
            del self._loading_keys[k]

    def _note_events(self, wm: KVCellarWorkerMeta) -> None:
        try:
            from vllm.distributed.kv_events import BlockRemoved, BlockStored
        except ImportError:  # pragma: no cover - vLLM without events
            return
        writers = self.pp_size * (1 if self.mla else self.tp_size)
        for key, n in wm.stored.items():
            if n >= writers and key not in wm.missing:
                h = bytes.fromhex(key[len(self.prefix):].split(".", 1)[0])
                self._events.append(
                    BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
                                block_size=self.unit_tokens, lora_id=None, medium="kvcellar", lora_name=None)
                )
        for key in wm.missing:
            h = bytes.fromhex(key[len(self.prefix):].split(".", 1)[0])
            self._events.append(BlockRemoved(block_hashes=[h], medium="kvcellar"))

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        if st is not None and not st.loading:
            self._forget_loads(request.request_id)
        # A request whose load still runs keeps its blocks until the workers
        # report the load finished (vLLM frees them then).
        return (bool(st is not None and st.loading), None)

    def take_events(self) -> Iterable[Any]:
        ev, self._events = self._events, []
        return ev

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVConnectorStats:
        return KVCellarStats(data=dict(data or {}))

    # ==================================================================================
    # Worker side
    # ==================================================================================

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        try:
            from vllm.distributed import parallel_state as ps

            if ps.model_parallel_is_initialized():
                self.tp_rank = ps.get_tensor_model_parallel_rank()
                self.pp_rank = ps.get_pp_group().rank_in_group
        except Exception as e:  # noqa: BLE001 - no distributed state (single process)
            log.debug("kvcellar: no vLLM parallel state (%s): rank 0", e)
        if not self.active:
            return
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        order = list(groups[0].layer_names) if groups else []
        names = [n for n in order if n in kv_caches] + sorted(n for n in kv_caches if n not in order)
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        seen: Set[Tuple[int, Tuple[int, ...]]] = set()
        layers: List[_LayerSegments] = []
        try:
            for name in names:
                v = kv_caches[name]
                if isinstance(v, (list, tuple)) or getattr(v, "dim", lambda: 0)() != 4:
                    raise ValueError(f"layer {name} has no [blocks, heads, tokens, content] view")
                ident = (int(v.data_ptr()), tuple(int(x) for x in v.stride()))
                if ident in seen:
                    continue  # a layer sharing another's cache
                seen.add(ident)
                layers.append(_LayerSegments(v, num_blocks, self.block_size))
        except ValueError as e:
            # Scheduler-side hits then fail to load and are recomputed.
            self.active = False
            log.warning("kvcellar: the vLLM connector is off on this worker: %s", e)
            return
        self._layers = layers
        self._staging = self.force_staging or any(lay.view.device.type != "cpu" for lay in layers)
        worst = sum(len(lay.runs) for lay in layers) * self.blocks_per_unit
        if not self._staging and worst > MAX_SEGMENTS:
            raise ConfigError(
                f"kv_connector_extra_config key 'blocks_per_unit': a unit could be {worst} segments "
                f"(more than {MAX_SEGMENTS}); lower it"
            )
        import torch

        self._scratch = torch.empty(max([lay.block_bytes for lay in layers] + [1]), dtype=torch.uint8)
        if not self._staging and self._client is not None:
            storages: Dict[int, int] = {}
            for lay in layers:  # vLLM's layers share one allocation: register it once
                st = lay.view.untyped_storage()
                storages[int(st.data_ptr())] = int(st.nbytes())
            for ptr, n in storages.items():
                self._misses.run("register memory", None, lambda p=ptr, n=n: self._client.register_memory((p, n)))
        log.info(
            "kvcellar: %d KV layers registered (rank tp %d/%d pp %d/%d), %d bytes per unit%s",
            len(layers), self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.unit_bytes(),
            ", staged through host memory" if self._staging else "",
        )

    def unit_bytes(self) -> int:
        return sum(lay.block_bytes for lay in self._layers) * self.blocks_per_unit

    def _units_segments(self, units: Sequence[Sequence[int]]) -> Tuple[List[int], List[int], List[int]]:
        """(addresses, sizes, per-unit counts) of units' segments: layer by
        layer, its blocks in order; a skipped block (-1) reads into scratch.
        Each unit's list is its own (segments merge within a unit only)."""
        scratch = int(self._scratch.data_ptr()) if self._scratch is not None else 0
        addrs: List[int] = []
        sizes: List[int] = []
        counts: List[int] = []
        for blocks in units:
            ua: List[int] = []
            us: List[int] = []
            for lay in self._layers:
                for b in blocks:
                    if b < 0:
                        ua.append(scratch)
                        us.append(lay.block_bytes)
                    else:
                        lay.block(b, ua, us)
            addrs += ua
            sizes += us
            counts.append(len(ua))
        return addrs, sizes, counts

    # -- staging (a cache in device memory) ------------------------------------------------

    def _stage_chunks(self, n: int) -> List[Tuple[int, int]]:
        """Unit ranges of at most STAGE_BYTES of host buffers each (one unit
        at least): what a long prompt pins at once stays bounded."""
        per = max(1, STAGE_BYTES // max(1, self.unit_bytes()))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _stage_buffer(self) -> Any:
        import torch

        return torch.empty(self.unit_bytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    @staticmethod
    def _sync(device: Any) -> None:
        import torch

        if getattr(device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(device)

    def _kernel_index(self, lay: _LayerSegments, blocks: Sequence[int]) -> Any:
        import torch

        ids = [b * lay.k + j for b in blocks for j in range(lay.k)]
        return torch.tensor(ids, dtype=torch.long, device=lay.view.device)

    def _stage_out(self, blocks: Sequence[int]) -> Any:
        """A unit copied into one (pinned) host buffer, in the byte order of
        the zero-copy path."""
        import torch

        buf = self._stage_buffer()
        at = 0
        for lay in self._layers:
            v = lay.view
            sel = v.index_select(0, self._kernel_index(lay, blocks))
            sel = sel.view(len(blocks), lay.k, *v.shape[1:]).permute(0, *[d + 1 for d in lay.order])
            n = lay.block_bytes * len(blocks)
            buf[at : at + n].view(v.dtype).view(sel.shape).copy_(sel)
            at += n
        for lay in self._layers[:1]:
            self._sync(lay.view.device)
        return buf if at == buf.numel() else buf[:at]

    def _stage_in(self, buf: Any, blocks: Sequence[int]) -> None:
        """The inverse of :meth:`_stage_out` for a unit's loaded bytes;
        skipped blocks (-1) are not written."""
        keep = [i for i, b in enumerate(blocks) if b >= 0]
        if not keep:
            return
        at = 0
        for lay in self._layers:
            v = lay.view
            n = lay.block_bytes * len(blocks)
            shape = [len(blocks)] + [lay.k if d == 0 else int(v.shape[d]) for d in lay.order]
            t = buf[at : at + n].view(v.dtype).view(shape)[keep]
            inverse = [0] * 4
            for pos, d in enumerate(lay.order):
                inverse[d] = pos + 1
            t = t.permute(0, *inverse).reshape(len(keep) * lay.k, *v.shape[1:])
            v.index_copy_(0, self._kernel_index(lay, [blocks[i] for i in keep]), t.to(v.device))
            at += n
        for lay in self._layers[:1]:
            self._sync(lay.view.device)

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCellarMetadata):
            return
        for t in meta.loads:
            try:
                self._io.submit(self._load, t)
            except RuntimeError:  # shut down: the load is a failure, reported as one
                self._load_done(t, [False] * len(t.keys), set())

    def _load(self, t: _Transfer) -> None:
        """Runs on the load thread: every unit of one request. Whatever
        happens, the request is reported finished and failed units' blocks
        are reported (vLLM recomputes them)."""
        ok = [False] * len(t.keys)
        missing: Set[str] = set()
        try:
            keys = [k + self._my_suffix() for k in t.keys]
            c = self._client
            if c is not None and self._layers:
                if self._staging:
                    res = []
                    for lo, hi in self._stage_chunks(len(keys)):
                        bufs = [self._stage_buffer() for _ in range(lo, hi)]
                        part = c.batch_get(keys[lo:hi], bufs)
                        for i, r in zip(range(lo, hi), part):
                            if r.status is Status.OK and r.length == bufs[i - lo].numel():
                                self._stage_in(bufs[i - lo], t.blocks[i])
                                ok[i] = True
                        res += part
                else:
                    addrs, sizes, counts = self._units_segments(t.blocks)
                    want = self.unit_bytes()
                    res = c.batch_getv_raw(keys, addrs, sizes, counts)
                    ok = [r.status is Status.OK and r.length == want for r in res]
                missing = {t.keys[i] for i, r in enumerate(res) if r.status is Status.MISS}
        except Exception as e:  # noqa: BLE001 - a failed load is a recompute
            self._misses.error("load", e)
            ok = [False] * len(t.keys)
        finally:
            self._load_done(t, ok, missing)

    def _load_done(self, t: _Transfer, ok: List[bool], missing: Set[str]) -> None:
        bad = [b for good, blocks in zip(ok, t.blocks) if not good for b in blocks if b >= 0]
        self._count(load_units=sum(ok), load_failed_units=len(ok) - sum(ok),
                    load_bytes=sum(ok) * self.unit_bytes())
        with self._lock:
            self._load_errors.update(bad)
            self._done_loads.add(t.req_id)
            self._worker_meta.missing |= missing

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        with self._lock:
            done, self._done_loads = self._done_loads, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    # -- saves -------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole units are saved in wait_for_save

    def _writer(self) -> bool:
        return not self.mla or self.tp_rank == 0

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or not self._writer():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCellarMetadata) or not meta.saves or not self._layers:
            return
        c = self._client
        if c is None:
            return
        base = [k for t in meta.saves for k in t.keys]
        blocks = [b for t in meta.saves for b in t.blocks]
        keys = [k + self._my_suffix() for k in base]

        def run() -> List[Status]:
            if self._staging:
                out: List[Status] = []
                for lo, hi in self._stage_chunks(len(keys)):
                    out += c.batch_put(keys[lo:hi], [self._stage_out(b) for b in blocks[lo:hi]])
                return out
            addrs, sizes, counts = self._units_segments(blocks)
            return c.batch_putv_raw(keys, addrs, sizes, counts)

        st = self._misses.run("save", [Status.UNAVAILABLE] * len(keys), run)
        good = [k for k, s in zip(base, st) if s is Status.OK]
        self._count(save_units=len(good), save_failed_units=len(keys) - len(good),
                    save_bytes=len(good) * self.unit_bytes())
        with self._lock:
            for k in good:
                self._worker_meta.stored[k] = self._worker_meta.stored.get(k, 0) + 1

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        with self._lock:
            wm, self._worker_meta = self._worker_meta, KVCellarWorkerMeta()
        return wm if (wm.stored or wm.missing) else None

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        with self._stats_lock:
            since, self._since = self._since, {}
        return KVCellarStats(data=since) if any(since.values()) else None

    # -- lifecycle -----------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            c, self._client = self._client, None
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)
        if c is not None:
            c.close()
        log.info("kvcellar: connector closed; counters %s", self.counters())
