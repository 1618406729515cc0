"""What both sides of the vLLM connector share: its options, the page
identity and keys, the unit arithmetic, the metadata the scheduler hands
the workers, and the counters (docs/plugins/vllm.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcellar._misses import Misses
from kvcellar.client import Client, Geometry
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
from kvcellar.fingerprint import weights_fingerprint

# A child of vLLM's logger: the lines appear in vLLM's log, in its format.
log = logging.getLogger("vllm.kvcellar")

#: kv_connector_extra_config keys (the cluster keys are the other plugins').
OWN_KEYS = CLUSTER_KEYS + TIMEOUT_KEYS + (
    "model_id", "model_fingerprint", "tenant", "poll_ms", "blocks_per_unit", "lookup_timeout_ms",
    "save_timeout_ms", "load_timeout_ms", "host_staging",
)
#: The library's per-item limit (README, "C ABI conventions").
MAX_SEGMENTS = 4096
UNIT_TOKENS = 256
#: Bounds on one whole library call (docs/plugins/vllm.md, "Bounded cost
#: of a sick node"): a save holds the engine's step, so its bound is about
#: a prefill step; a load holds only its request, so it may take about what
#: recomputing would; a lookup's call ends well before the scheduler stops
#: waiting for it (LOOKUP_CALL_SHARE of lookup_timeout_ms).
SAVE_TIMEOUT_MS = 200
LOAD_TIMEOUT_MS = 1000
LOOKUP_TIMEOUT_MS = 1000
LOOKUP_CALL_SHARE = 0.75

COUNTERS = (
    "lookups", "lookup_tokens", "lookup_hit_tokens", "lookup_timeouts", "lookup_errors", "lookups_shed",
    "load_units", "load_failed_units", "load_bytes", "save_units", "save_failed_units", "save_dropped_units",
    "save_bytes",
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

    def reduce(self) -> Dict[str, Any]:
        return {k: self.data.get(k, 0) for k in COUNTERS if self.data.get(k)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Transfer:
    """One request's units to load or save in this step."""

    req_id: str
    keys: List[str]  # base keys, one per unit (no rank suffix)
    # Per unit, the vLLM block id of each of its blocks; -1 is a block this
    # load skips (already computed locally): its bytes are read into scratch.
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


def kv_spec(kv_cache_config: Any) -> Any:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return groups[0].kv_cache_spec if groups else None


def supported(vllm_config: Any, kv_cache_config: Any) -> Tuple[bool, str]:
    """Attention KV in one cache group: MHA/GQA and MLA. Not: hybrid groups
    (Mamba, sliding-window groups kept apart), context parallel."""
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


def check_hash_seed(cc: Any) -> None:
    """Refuses a per-process random block-hash seed: no other instance, nor
    this one after a restart, could ever hit; every save would be write
    traffic for nothing."""
    algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"prefix_caching_hash_algo={algo} seeds block hashes randomly per process unless "
            "PYTHONHASHSEED is set: set PYTHONHASHSEED (the same value on every vLLM instance "
            "sharing the cache) or use the default sha256"
        )


def _plain(v: Any) -> Any:
    """A config value as plain JSON (what the tag digests must be stable text)."""
    if callable(v) and not isinstance(v, type):
        # A function's text would hold its address: name it instead.
        return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__name__)}"
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def model_identity(vllm_config: Any, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    """What makes the same tokens give other KV, from the configuration
    alone (no weights loaded, so every role and rank computes the same):
    the weights' fingerprint (or the ``model_fingerprint`` option), the
    quantization method, RoPE scaling and parameters, and ``hf_overrides``."""
    mc = vllm_config.model_config
    lc = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(lc, "load_format", None) or "auto")
    fp = cfg.get("model_fingerprint")
    if fp is not None:
        if not isinstance(fp, str) or not fp.strip():
            raise ConfigError(f"{where} key 'model_fingerprint': {fp!r} must be non-empty text")
        fp = "given:" + fp.strip()
    else:
        fp = weights_fingerprint(getattr(mc, "model_weights", "") or mc.model, getattr(mc, "revision", None),
                                 load_format, getattr(lc, "download_dir", None))
    rope: Dict[str, Any] = {}
    for src in (getattr(mc, "hf_config", None), getattr(mc, "hf_text_config", None)):
        for name in ("rope_scaling", "rope_parameters", "rope_theta"):
            v = getattr(src, name, None)
            if v is not None:
                rope[name] = _plain(v)
    overrides = getattr(mc, "hf_overrides", None)
    return {
        "weights": fp,
        "load_format": "dummy" if load_format == "dummy" else None,
        "quantization": _plain(getattr(mc, "quantization", None)),
        "rope": rope or None,
        "hf_overrides": _plain(overrides) if overrides else None,
    }


class Side:
    """The connector's state for one role (the scheduler's or a worker's):
    options, identity, client, keys and counters. ``owner`` is the
    ``KVCellarConnector`` vLLM holds (its base class keeps the metadata
    and the KV cache manager)."""

    def __init__(self, owner: Any, vllm_config: Any, role_name: str, kv_cache_config: Any) -> None:
        self.owner = owner
        self._misses = Misses(log)
        where = "kv_connector_extra_config"
        kt = vllm_config.kv_transfer_config
        cfg = dict(kt.kv_connector_extra_config or {})
        self.settings = plugin_settings(cfg, where)
        self.poll_ms = positive_int(cfg, "poll_ms", DEFAULT_POLL_MS, where)
        self.lookup_timeout_s = positive_int(cfg, "lookup_timeout_ms", LOOKUP_TIMEOUT_MS, where) / 1000.0
        self.lookup_call_ms = max(1, int(self.lookup_timeout_s * 1000 * LOOKUP_CALL_SHARE))
        self.save_timeout_ms = positive_int(cfg, "save_timeout_ms", SAVE_TIMEOUT_MS, where)
        self.load_timeout_ms = positive_int(cfg, "load_timeout_ms", LOAD_TIMEOUT_MS, where)
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
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
        self.tp_rank, self.pp_rank = 0, 0
        self.mla = bool(getattr(mc, "use_mla", False))
        self.active, why = supported(vllm_config, kv_cache_config)
        if not self.active:
            log.warning("kvcellar: the vLLM connector is off for this model: %s; vLLM serves without it", why)
        check_hash_seed(cc)
        if kt.kv_load_failure_policy == "fail":
            # A cache whose failed load fails the request is worse than none.
            log.warning(
                "kvcellar: kv_load_failure_policy was 'fail'; set to 'recompute' "
                "(a failed load from the cache is recomputed, never a failed request)"
            )
            kt.kv_load_failure_policy = "recompute"

        self.identity = self._identity(vllm_config, kv_cache_config)
        if self.active:  # (an inactive connector stores nothing: no weights to name)
            self.identity.update(model_identity(vllm_config, cfg, where))
        self.tag = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.model_hash = identity_hash("kvcellar-vllm/v1", self.identity)
        spec = kv_spec(kv_cache_config)
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
        log.info(
            "kvcellar vLLM connector (%s): %s, group %s, model %s, unit %d blocks of %d tokens, tag %s%s",
            role_name,
            f"mds {','.join(self.settings.mds)}" if self.settings.mds else f"members {self.settings.members}",
            self.settings.group, self.model, self.blocks_per_unit, self.block_size, self.tag,
            "" if self.active else " (off)",
        )

    def _identity(self, vllm_config: Any, kv_cache_config: Any) -> Dict[str, Any]:
        """The KV layout: what makes the same KV other bytes."""
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        sd = getattr(vllm_config, "speculative_config", None)
        spec = kv_spec(kv_cache_config)
        try:
            layers = int(mc.get_total_num_hidden_layers())
        except Exception:  # noqa: BLE001 - older or odd configs
            layers = int(getattr(mc.hf_text_config, "num_hidden_layers", 0) or 0)
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
        dummy = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "")) == "dummy"
        return {
            "model": self.model,
            "revision": getattr(mc, "revision", None),
            "dtype": str(getattr(spec, "dtype", None) or mc.dtype),
            "cache_dtype": str(cc.cache_dtype),
            "block_size": self.block_size,
            "blocks_per_unit": self.blocks_per_unit,
            "layout": str(layout),
            "hash": str(getattr(cc, "prefix_caching_hash_algo", "")),
            # MLA's latent is the same on every TP rank: TP splits share it
            # (not with dummy weights, which vLLM makes up per shard).
            "tp_size": 1 if self.mla and not dummy else self.tp_size,
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

    # -- counters ----------------------------------------------------------------------

    def counters(self) -> Dict[str, int]:
        """This side's counters since it started."""
        with self._stats_lock:
            return {k: self._stats.get(k, 0) for k in COUNTERS}

    def _count(self, **inc: int) -> None:
        with self._stats_lock:
            for k, v in inc.items():
                self._stats[k] = self._stats.get(k, 0) + v
                self._since[k] = self._since.get(k, 0) + v

    def get_kv_connector_stats(self) -> Optional[KVCellarStats]:
        with self._stats_lock:
            since, self._since = self._since, {}
        return KVCellarStats(data=since) if any(since.values()) else None

    # -- keys and units ------------------------------------------------------------------

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

    def _whole_units(self, request: Any, tokens: Optional[int] = None) -> int:
        """Whole units of the request's prompt (of its first ``tokens``)."""
        prompt = int(getattr(request, "num_prompt_tokens", request.num_tokens))
        n = min(len(request.block_hashes) * self.block_size, prompt)
        if tokens is not None:
            n = min(n, tokens)
        return n // self.unit_tokens
