"""SGLang HiCache L3 backend over kvcellar.

Load it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvcellar", "module_path": "kvcellar.hicache",
"class_name": "KvcellarStorage", "interface_v1": 1, "mds": "host:port,...",
"group": "default"}`` (docs/plugins/sglang.md has every key).

Page identity (docs/PROTOCOL.md §3):

- The KEY carries what makes ranks hold different bytes for one token hash:
  ``{tenant/}{hash}.{tag}`` plus ``.tp{rank}-{size}`` for MHA (never for MLA,
  whose pages every TP rank shares), ``.pp{r}-{s}`` when PP > 1,
  ``.cp{r}-{s}`` when attention-CP > 1 and ``.dcp{r}-{s}`` when DCP > 1.
  ``tag`` is 16 hex digits of a digest of the layout identity below plus
  the transfer path (v1 page segments or legacy flat pages, whose byte
  orders differ), so pages of another model or layout are misses and are
  stored beside, not instead of, this one's.
- ``model_hash`` in every page header folds in the model, the host pool's
  class and layout, first layer, layer count, head count and dims
  (v_head_dim, MLA's kv_cache_dim), dtype and page size: whatever reads a
  page with another layout gets a mismatch, never the wrong bytes.
- Both name the weights (:mod:`kvcellar._served`): a fingerprint of the
  files SGLang loads (its published model path, revision, load format and
  download dir), its ``--quantization`` and ``--json-model-override-args``;
  ``model_fingerprint`` replaces the fingerprint. Another fine-tune under
  the same name misses.

Each page moves as ONE object: its ``get_page_buffer_meta`` segments are
the iovec (sizes per segment, so asymmetric K/V, K-only and split MLA pools
work). MLA ranks that are not ``is_storage_writer`` never write. Errors of
the store are misses (``False``/``0``/``None``), never exceptions into
SGLang; bad configuration raises at construction naming the key.

Every store call runs under a deadline (:mod:`kvcellar._deadline`;
docs/plugins/sglang.md, "Deadlines"): ``lookup_deadline_ms`` for exists,
``load_deadline_ms`` per slice of a get, ``save_deadline_ms`` per slice of
a set (its exist check included). SGLang calls the backend from its
prefetch, prefetch-IO and backup threads, never from the scheduler's step;
the deadline bounds how long a request waits for its L3 pages and how long
a backup holds host pages. Calls run on SGLang's own thread and return only
when the library call did: nothing keeps a pointer into the host pool after
a method returns.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvcellar._sglang_api import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
    StorageMetrics,
)
from kvcellar._deadline import DEADLINE_DEFAULTS, DEADLINE_KEYS, Counters, Deadlines, run_slices
from kvcellar._misses import Misses
from kvcellar._served import sglang_model, weights_identity
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

log = logging.getLogger("kvcellar.hicache")

__all__ = ["KvcellarStorage"]

#: extra_config keys of this backend (besides SGLang's own).
OWN_KEYS = CLUSTER_KEYS + TIMEOUT_KEYS + DEADLINE_KEYS + ("model_id", "model_fingerprint", "tenant", "poll_ms")
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")

_POOL_ATTRS = (
    "layout", "page_size", "dtype", "layer_num", "start_layer", "head_num", "head_dim", "v_head_dim",
    "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "size_per_token",
)


def pool_identity(pool: Any) -> Dict[str, str]:
    """What changes how a pool lays out the same page's bytes."""
    ident = {"class": type(pool).__name__}
    for a in _POOL_ATTRS:
        v = getattr(pool, a, None)
        if v is not None and not callable(v):
            ident[a] = str(v)
    return ident


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


class KvcellarStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a kvcellar group (see the module docs).

    Thread-safe: SGLang's prefetch, IO and backup threads call it at once;
    ``close()`` may run while they are inside calls (they then see misses).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self._misses = Misses(log)
        cfg = dict(storage_config.extra_config or {})
        where = "hicache extra_config"
        self.settings = plugin_settings(cfg, where)
        self.poll_ms = positive_int(cfg, "poll_ms", DEFAULT_POLL_MS, where)
        self.deadlines = Deadlines.of({k: positive_int(cfg, k, d, where) for k, d in DEADLINE_DEFAULTS.items()})
        self._counters = Counters(log, self.deadlines)
        model = cfg.get("model_id") or storage_config.model_name
        if not model or not isinstance(model, str):
            raise ConfigError(f"{where} key 'model_id': SGLang gave no model name, so set 'model_id'")
        self.model = model
        self.prefix = tenant_prefix(cfg.get("tenant"), f"{where} key 'tenant'")
        unknown = sorted(set(cfg) - set(OWN_KEYS) - set(SGLANG_KEYS))
        if unknown:
            log.warning("kvcellar: ignoring unknown extra_config keys %s", unknown)
        # Options and members are checked by the library now, not at the
        # first page: a probe handle that is closed at once.
        Client(settings=self._probe_settings()).close()
        # The weights SGLang serves, read once (a fingerprint reads files).
        self.weights, weights_line = weights_identity(cfg.get("model_fingerprint"), sglang_model(), where)

        sc = storage_config
        self.is_mla = bool(sc.is_mla_model)
        self.is_writer = bool(sc.is_storage_writer)
        suffix = ""
        if sc.pp_size > 1:
            suffix += f".pp{sc.pp_rank}-{sc.pp_size}"
        if sc.attn_cp_size > 1:
            suffix += f".cp{sc.attn_cp_rank}-{sc.attn_cp_size}"
        if getattr(sc, "dcp_size", 1) > 1:
            # DCP shards a page by tokens: the TP size and logical page size
            # decide which tokens a shard holds.
            suffix += f".dcp{sc.dcp_rank}-{sc.dcp_size}.tp{sc.tp_size}.lp{sc.logical_page_size}"
        self._tp_suffix = f".tp{sc.tp_rank}-{sc.tp_size}"
        self._shard_suffix = suffix
        self._lock = threading.Lock()
        self._client: Optional[Client] = None
        self._closed = False
        self._tags: Dict[Tuple[str, str], str] = {}
        self._metrics = StorageMetrics() if sc.enable_storage_metrics else None
        self._metrics_lock = threading.Lock()
        self.mem_pool_host: Any = None
        self.registered_pools: Dict[Any, Any] = {}
        log.info(
            "kvcellar HiCache backend ready: %s, group %s, model %s, %s, rank tp %d/%d%s",
            f"mds {','.join(self.settings.mds)}" if self.settings.mds else f"members {self.settings.members}",
            self.settings.group,
            self.model,
            weights_line,
            sc.tp_rank,
            sc.tp_size,
            " (MLA, writer)" if self.is_mla and self.is_writer else " (MLA, reader only)" if self.is_mla else "",
        )

    def _probe_settings(self) -> Any:
        from dataclasses import replace

        # With kv-mds: one round of discovery, so a refused auth token raises
        # DeniedError here, at construction.
        if self.settings.mds is not None:
            return self.settings
        return replace(self.settings, members=self.settings.members or "probe=127.0.0.1:1")

    # -- registration ----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        ident = pool_identity(mem_pool_host)
        ident["model"] = self.model
        ident.update(self.weights)
        self.model_hash = identity_hash("kvcellar-sglang/v1", ident)
        p = mem_pool_host
        if self.is_mla:
            head_num, head_dim = 1, int(getattr(p, "kv_cache_dim", 0) or 0)
        else:
            head_num, head_dim = int(getattr(p, "head_num", 0) or 0), int(getattr(p, "head_dim", 0) or 0)
        sc = self.storage_config
        self.geometry = Geometry(
            model_hash=self.model_hash,
            page_size=int(getattr(p, "page_size", 0) or 0),
            dtype_tag=zlib.crc32(str(getattr(p, "dtype", "")).encode()),
            tp_size=sc.tp_size if not self.is_mla else 1,
            tp_rank=sc.tp_rank if not self.is_mla else 0,
            layer_num=int(getattr(p, "layer_num", 0) or 0) & 0xFFFF,
            head_num=head_num & 0xFFFF,
            head_dim=head_dim & 0xFFFF,
            mla=self.is_mla,
        )
        client = Client(settings=self.settings, geometry=self.geometry, poll_ms=self.poll_ms)
        with self._lock:
            if self._closed:
                client.close()
                return
            old, self._client = self._client, client
            self._tags = {}  # tags digest the pool: a new pool, new tags
        if old is not None:
            old.close()
        # The pool's memory, for RDMA registration: one tensor, or K and V
        # apart (asymmetric pools: a tuple); None in DeepSeek-V4's anchor pool.
        buf = getattr(mem_pool_host, "kv_buffer", None)
        for t in buf if isinstance(buf, (tuple, list)) else [buf] if buf is not None else []:
            try:
                client.register_memory((int(t.data_ptr()), _nbytes(t)))
            except Exception as e:  # noqa: BLE001 - registration is an optimisation
                log.warning("kvcellar: cannot register the host pool's memory: %s", e)

    def on_host_pools_registered(self) -> None:
        if self.mem_pool_host is None:
            raise RuntimeError("kvcellar: no host KV pool was registered")

    # -- keys ----------------------------------------------------------------

    def _tag(self, pool_name: str, pool: Any, path: str) -> str:
        k = (pool_name, path)
        tags = self._tags
        t = tags.get(k)
        if t is None:
            ident = pool_identity(pool)
            ident.update(model=self.model, pool=pool_name, path=path)
            ident.update(self.weights)
            t = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
            # Kept only if no pool was registered meanwhile (that starts a
            # new map): this tag digests the pool this call was given.
            with self._lock:
                if self._tags is tags:
                    tags[k] = t
        return t

    def _tp_sharded(self, pool_name: str) -> bool:
        """Whether each TP rank holds its own bytes for this pool: always
        for MHA; under MLA only Mamba state (the KV latent and the SWA and
        indexer pools are replicated), as SGLang's file backend keys them."""
        return not self.is_mla or pool_name == "mamba"

    def _writes(self, pool_name: str) -> bool:
        """Replicated pools are written by the storage writer rank only."""
        return self.is_writer or self._tp_sharded(pool_name)

    def _key(self, key: str, tag: str, pool_name: str = "kv") -> str:
        rank = self._tp_suffix if self._tp_sharded(pool_name) else ""
        return f"{self.prefix}{key}.{tag}{rank}{self._shard_suffix}"

    def _keys(self, keys: Sequence[str], path: str, pool_name: str = "kv", pool: Any = None) -> List[str]:
        tag = self._tag(pool_name, pool if pool is not None else self.mem_pool_host, path)
        return [self._key(k, tag, pool_name) for k in keys]

    def _c(self) -> Optional[Client]:
        c = self._client
        if c is None and not self._closed:
            log.warning("kvcellar: called before register_mem_pool_host; answering misses")
        return c

    # -- metrics ---------------------------------------------------------------

    def _record(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if self._metrics is None or pages == 0:
            return
        secs = max(time.perf_counter() - started, 1e-9)
        with self._metrics_lock:
            if kind == "get":
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(nbytes / secs / 1e9)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(nbytes / secs / 1e9)

    def get_stats(self) -> Any:
        if self._metrics is None:
            return None
        with self._metrics_lock:
            out, self._metrics = self._metrics, StorageMetrics()
        return out

    # -- shared steps ----------------------------------------------------------------

    def _guarded(self, what: str, default: Any, fn: Any) -> Any:
        """Runs a store step; a closed client or any failure is `default`
        (a miss), never an exception into SGLang (:mod:`kvcellar._misses`)."""
        c = self._c()
        if c is None:
            return default
        return self._misses.run(what, default, lambda: fn(c))

    def counters(self) -> Dict[str, float]:
        """The backend's own counters (``kvplugin_*``: lookups, loads and
        saves cut by their deadline, saves dropped) and its client's
        (``kvclient_*``), docs/plugins/sglang.md "Deadlines"."""
        out = self._counters.snapshot()
        c = self._client
        if c is not None:
            try:
                out.update(c.counters())
            except Exception:  # noqa: BLE001 - closed meanwhile: our own counters still stand
                pass
        return out

    def _exist(self, c: Client, full: List[str]) -> List[Status]:
        """One batch exist under the lookup deadline; keys it cut are counted."""
        with c.call_timeout(self.deadlines.lookup_ms):
            st = c.batch_exist(full)
        self._counters.add("kvplugin_lookup_deadline_misses_total", sum(s is Status.TIMEOUT for s in st))
        return st

    def _load(self, c: Client, sizes: List[int], call: Any) -> List[bool]:
        """A load in slices under the load deadline (`call(lo, hi)`: the
        statuses of pages lo..hi, a short page as MISMATCH)."""
        st, cut = run_slices(c, self.deadlines.load_ms, sizes, call)
        self._counters.add("kvplugin_load_deadline_misses_total",
                           sum(s is Status.TIMEOUT for s in st) + (sum(s is None for s in st) if cut else 0))
        return [s is Status.OK for s in st]

    def _store_missing(self, c: Client, full: List[str], sizes: List[int], put: Any) -> Tuple[List[bool], List[int]]:
        """Writes only the pages not stored yet: (per-page success, indices
        written). A mismatch is another writer's page under the key: it
        stays, and this page is not stored (False, honestly).

        One save deadline covers the exist check and the first slice of
        puts: the check gets at most half of it (and no more than a
        lookup's), the puts what is left. A page the check could not see
        (its owner timed out or cools down) is put all the same: a cooling
        node answers UNAVAILABLE at once, and the others' pages must not
        be lost to it. Pages not stored are counted as dropped, those the
        deadline cut apart. `put(todo)`: statuses of the pages at those indices."""
        started = time.monotonic()
        with c.call_timeout(max(1, min(self.deadlines.lookup_ms, self.deadlines.save_ms // 2))):
            present = c.batch_exist(full)
        out = [s is Status.OK for s in present]
        todo = [i for i, s in enumerate(present) if s not in (Status.OK, Status.MISMATCH)]
        if todo:
            st, cut = run_slices(c, self.deadlines.save_ms, [sizes[i] for i in todo],
                                 lambda lo, hi: put(todo[lo:hi]), started=started)
            for i, s in zip(todo, st):
                out[i] = s is Status.OK
            # Dropped for time: cut, not tried after a cut, or refused by an
            # owner cooling down after the check found it not answering.
            timed = sum(s is Status.TIMEOUT or (s is None and cut)
                        or (s is Status.UNAVAILABLE and present[i] is Status.TIMEOUT) for i, s in zip(todo, st))
            self._counters.add("kvplugin_saves_dropped_total", sum(s is not Status.OK for s in st))
            self._counters.add("kvplugin_saves_dropped_deadline_total", timed)
        return out, todo

    # -- zero-copy page segments (v1, and v2 pools with page pointers) ----------------------

    def _segments(self, pool: Any, host_indices: Any, n: int) -> Tuple[List[int], List[int], int]:
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        ptrs, sizes = list(ptrs), list(sizes)
        if n == 0 or len(ptrs) != len(sizes) or len(ptrs) % n or not ptrs:
            raise ValueError(f"{len(ptrs)} page pointers for {n} keys")
        return ptrs, sizes, len(ptrs) // n

    def _get_pages(self, full: List[str], pool: Any, host_indices: Any) -> List[bool]:
        n = len(full)
        if n == 0:
            return []

        def run(c: Client) -> List[bool]:
            t0 = time.perf_counter()
            ptrs, sizes, per = self._segments(pool, host_indices, n)
            want = [sum(sizes[i * per : (i + 1) * per]) for i in range(n)]

            def call(lo: int, hi: int) -> List[Status]:
                res = c.batch_getv_raw(full[lo:hi], ptrs[lo * per : hi * per], sizes[lo * per : hi * per], per)
                return [r.status if r.status is not Status.OK or r.length == want[lo + j] else Status.MISMATCH
                        for j, r in enumerate(res)]

            out = self._load(c, want, call)
            self._record("get", sum(out), sum(w for w, ok in zip(want, out) if ok), t0)
            return out

        return self._guarded("batch get", [False] * n, run)

    def _set_pages(self, full: List[str], pool: Any, host_indices: Any, pool_name: str) -> List[bool]:
        n = len(full)
        if not self._writes(pool_name):
            return [True] * n  # SGLang acks the backup; the writer rank stores the page
        if n == 0:
            return []

        def run(c: Client) -> List[bool]:
            t0 = time.perf_counter()
            ptrs, sizes, per = self._segments(pool, host_indices, n)
            page = [sum(sizes[i * per : (i + 1) * per]) for i in range(n)]

            def put(todo: List[int]) -> List[Status]:
                addrs = [a for i in todo for a in ptrs[i * per : (i + 1) * per]]
                lens = [x for i in todo for x in sizes[i * per : (i + 1) * per]]
                return c.batch_putv_raw([full[i] for i in todo], addrs, lens, per)

            out, todo = self._store_missing(c, full, page, put)
            self._record("set", sum(out[i] for i in todo), sum(page[i] for i in todo if out[i]), t0)
            return out

        return self._guarded("batch set", [False] * n, run)

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if self.mem_pool_host is None:
            return [False] * len(keys)
        return self._get_pages(self._keys(keys, "v1"), self.mem_pool_host, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if self.mem_pool_host is None:
            return [False] * len(keys)
        return self._set_pages(self._keys(keys, "v1"), self.mem_pool_host, host_indices, "kv")

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading hits: how many keys from the first a get would serve."""
        if not keys:
            return 0

        def run(c: Client) -> int:
            st = self._exist(c, self._keys(keys, self._path()))
            return next((i for i, s in enumerate(st) if s is not Status.OK), len(st))

        return self._guarded("batch exists", 0, run)

    def _path(self) -> str:
        v1 = (self.storage_config.extra_config or {}).get("interface_v1")
        return "v1" if v1 else "flat"

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- flat pages (the legacy path, and v2 pools without page pointers), copied ------------

    def _flat_get(self, full: List[str], pool: Any, targets: Optional[List[Any]] = None) -> List[Any]:
        n = len(full)
        if pool is None or n == 0:
            return [None] * n

        def run(c: Client) -> List[Any]:
            t0 = time.perf_counter()
            tg = targets if targets is not None else [pool.get_dummy_flat_data_page() for _ in full]
            want = [_nbytes(t) for t in tg]

            def call(lo: int, hi: int) -> List[Status]:
                res = c.batch_get(full[lo:hi], tg[lo:hi])
                return [r.status if r.status is not Status.OK or r.length == want[lo + j] else Status.MISMATCH
                        for j, r in enumerate(res)]

            ok = self._load(c, want, call)
            out = [t if good else None for t, good in zip(tg, ok)]
            self._record("get", sum(ok), sum(w for w, good in zip(want, ok) if good), t0)
            return out

        return self._guarded("batch get (flat pages)", [None] * n, run)

    def _flat_set(self, full: List[str], values: List[Any], pool_name: str) -> List[bool]:
        n = len(full)
        if not self._writes(pool_name):
            return [True] * n
        if n == 0 or len(values) != n:
            return [False] * n

        def run(c: Client) -> List[bool]:
            t0 = time.perf_counter()
            sizes = [_nbytes(v) for v in values]
            out, todo = self._store_missing(
                c, full, sizes, lambda todo: c.batch_put([full[i] for i in todo], [values[i] for i in todo])
            )
            self._record("set", sum(out[i] for i in todo), sum(sizes[i] for i in todo if out[i]), t0)
            return out

        return self._guarded("batch set (flat pages)", [False] * n, run)

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        pool = self.mem_pool_host
        if pool is None:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else None
        return self._flat_get(self._keys(keys, "flat", "kv", pool), pool, targets)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or self.mem_pool_host is None:
            return False
        return all(self._flat_set(self._keys(keys, "flat", "kv", self.mem_pool_host), list(values), "kv"))

    # -- v2: pools beside the KV pool (Mamba, SWA, indexer, draft, ...) ------------------

    def _pool(self, name: Any) -> Any:
        pools = getattr(self, "registered_pools", None) or {}
        pool = pools.get(name)
        if pool is None:
            pool = pools.get(str(name))
        if pool is None and str(name) == "kv":
            pool = self.mem_pool_host
        return pool

    @staticmethod
    def _has_meta(pool: Any) -> bool:
        return callable(getattr(pool, "get_page_buffer_meta", None))

    def _pool_keys(self, keys: Sequence[str], name: str, pool: Any) -> List[str]:
        path = "v1" if self._has_meta(pool) else "flat"
        base = list(keys) if name == "kv" else [f"{k}.{name}" for k in keys]
        return self._keys(base, path, name, pool)

    def _transfer_io(self, transfers: List[PoolTransfer], write: bool) -> Dict[str, List[bool]]:
        results: Dict[str, List[bool]] = {}
        for t in transfers:
            name = str(getattr(t, "name", "kv"))
            keys = list(t.keys or [])
            pool = self._pool(t.name)
            if pool is None:
                log.error("kvcellar: no host pool registered under %r", name)
                results[name] = [False] * len(keys)
                continue
            page_size = int(getattr(pool, "page_size", 1) or 1)
            idx = t.host_indices
            count = int(idx.numel()) if hasattr(idx, "numel") else (len(idx) if idx is not None else 0)
            if idx is None or count != len(keys) * page_size:
                log.error("kvcellar: %s indices for pool %s: %d, expected %d", "set" if write else "get",
                          name, count, len(keys) * page_size)
                results[name] = [False] * len(keys)
                continue
            full = self._pool_keys(keys, name, pool)
            if self._has_meta(pool):
                results[name] = (
                    self._set_pages(full, pool, idx, name) if write else self._get_pages(full, pool, idx)
                )
                continue
            offsets = [int(idx[i * page_size]) for i in range(len(keys))]
            if write:
                results[name] = self._flat_set(full, [pool.get_data_page(o, flat=True) for o in offsets], name)
            else:
                ok = []
                for o, page in zip(offsets, self._flat_get(full, pool)):
                    if page is not None:
                        pool.set_from_flat_data_page(o, page)
                    ok.append(page is not None)
                results[name] = ok
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._transfer_io(transfers, write=False)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._transfer_io(transfers, write=True)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The usable KV prefix, shrunk by each side pool's hit policy (as
        SGLang's own file backend computes it), in one exist round."""
        n = len(keys)
        transfers = list(pool_transfers or [])
        groups: List[List[str]] = [self._keys(keys, self._path())]
        for t in transfers:
            pool = self._pool(t.name)
            groups.append(self._pool_keys(keys, str(t.name), pool) if pool is not None else [])
        flat = [k for g in groups for k in g]
        st = self._guarded("batch exists (v2)", None, lambda c: self._exist(c, flat)) if n else None
        if st is None:
            return PoolTransferResult(0, {}, [])
        present: List[List[bool]] = []
        at = 0
        for g in groups:
            present.append([s is Status.OK for s in st[at : at + len(g)]] or [False] * n)
            at += len(g)
        kv_pages = next((i for i, ok in enumerate(present[0]) if not ok), n)
        hits: Dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t, have in zip(transfers, present[1:]):
            name = str(t.name)
            policy = getattr(t.hit_policy, "value", t.hit_policy)
            if policy == "trailing_pages":
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv_pages + 1) if all(have[max(0, p - trailing) : p])}
                boundary = max(ok, default=0)
            elif policy == "block_groups":
                group = max(1, int(getattr(t, "group_pages", 0) or getattr(t, "block_pages", 0) or 1))
                lead = next((i for i, h in enumerate(have) if not h), n)
                boundary = (lead // group) * group
                if boundary:
                    hits[name] = boundary
                continue  # reported, never gates the KV hit
            else:
                boundary = next((i for i in range(kv_pages) if not have[i]), kv_pages)
                ok = set(range(1, boundary + 1))
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hits, restorable)

    # -- lifecycle -------------------------------------------------------------------

    def clear(self) -> None:
        log.info(
            "kvcellar: clear() leaves the shared L3 as it is (other engines use it); "
            "pages age out by LRU, or an operator deletes them"
        )

    def close(self) -> None:
        with self._lock:
            first = not self._closed
            self._closed = True
            c, self._client = self._client, None
        if c is not None:
            c.close()
        cut = {k: int(v) for k, v in self._counters.snapshot().items() if v}
        if first and cut:
            log.info("kvcellar HiCache backend closed; %s", cut)


# SGLang's error messages and docs name the class; keep an alias that reads well.
KvcellarHiCacheStorage = KvcellarStorage
