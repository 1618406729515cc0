"""The worker side of the vLLM connector: the paged KV cache's segments,
loads on background threads, saves acknowledged before the step ends
(docs/plugins/vllm.md, "What is stored, and when it is shared")."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Set, Tuple

from kvcellar import _vllm_layout as layout
from kvcellar._vllm_common import (
    MAX_SEGMENTS,
    KVCellarMetadata,
    KVCellarWorkerMeta,
    Side,
    _Transfer,
    log,
)
from kvcellar.client import GetResult, Status
from kvcellar.config import ConfigError

#: Most threads running loads at once. The pool starts a thread only when
#: none is idle, so there is one per load in flight (up to this many): a
#: request's load never waits for a thread that another request's load
#: holds on a stalled node (each load's call is bounded by load_timeout_ms).
LOAD_THREADS_MAX = 64


class _Budget:
    """What is left of a bound that spans several library calls (the
    staged path makes one call per chunk of units)."""

    def __init__(self, ms: int) -> None:
        self.end = time.monotonic() + ms / 1000.0

    def left_ms(self) -> int:
        return int((self.end - time.monotonic()) * 1000)


class WorkerSide(Side):
    """The connector each vLLM worker (one per TP rank and PP stage) holds."""

    def __init__(self, owner: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(owner, vllm_config, "worker", kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._layers: List[layout.LayerSegments] = []
        self._io = ThreadPoolExecutor(max_workers=LOAD_THREADS_MAX, thread_name_prefix="kvcellar-load")
        self._done_loads: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._worker_meta = KVCellarWorkerMeta()
        self._scratch = layout.Scratch()
        self._staging = False
        if self.active:
            try:
                self.tp_rank, self.pp_rank = self._ranks()
            except RuntimeError:
                self.shutdown()
                raise

    def _ranks(self) -> Tuple[int, int]:
        """This worker's (TP rank, PP rank) from vLLM's parallel state, set
        up before vLLM builds a worker's connector. The rank names this
        worker's pages: a guess could store one rank's KV under another's
        key, so under TP x PP > 1 a state that cannot be read refuses the
        start (docs/plugins/vllm.md, "One object per unit per rank")."""
        try:
            from vllm.distributed import parallel_state as ps

            if not ps.model_parallel_is_initialized():
                raise RuntimeError("model_parallel_is_initialized() is False")
            tp, pp = ps.get_tp_group(), ps.get_pp_group()
            got = (int(tp.rank_in_group), int(tp.world_size), int(pp.rank_in_group), int(pp.world_size))
        except Exception as e:  # noqa: BLE001 - whatever fails, the rank is unknown
            if self.tp_size * self.pp_size == 1:
                return 0, 0  # one process: rank 0 is certain
            why = f"{type(e).__name__}: {e}".replace("\n", " ")
        else:
            tp_rank, tp_n, pp_rank, pp_n = got
            if (tp_n, pp_n) == (self.tp_size, self.pp_size) and 0 <= tp_rank < tp_n and 0 <= pp_rank < pp_n:
                return tp_rank, pp_rank
            why = f"it gives TP rank {tp_rank} of {tp_n}, PP rank {pp_rank} of {pp_n}"
        raise RuntimeError(
            f"kvcellar: vLLM's parallel state cannot give this worker's rank ({why}) with "
            f"tensor_parallel_size={self.tp_size} and pipeline_parallel_size={self.pp_size}; the rank names "
            "the pages this worker stores, so the vLLM connector refuses to start"
        )

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        if not self.active:
            return
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        order = list(groups[0].layer_names) if groups else []
        names = [n for n in order if n in kv_caches] + sorted(n for n in kv_caches if n not in order)
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        seen: Set[Tuple[int, Tuple[int, ...]]] = set()
        layers: List[layout.LayerSegments] = []
        try:
            for name in names:
                v = kv_caches[name]
                if isinstance(v, (list, tuple)) or getattr(v, "dim", lambda: 0)() != 4:
                    raise ValueError(f"layer {name} has no [blocks, heads, tokens, content] view")
                ident = (int(v.data_ptr()), tuple(int(x) for x in v.stride()))
                if ident in seen:
                    continue  # a layer sharing another's cache
                seen.add(ident)
                layers.append(layout.LayerSegments(v, num_blocks, self.block_size))
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

    def _units_segments(self, units: List[List[int]]) -> Tuple[List[int], List[int], List[int], Any]:
        return layout.units_segments(self._layers, units, self._scratch)

    def _stage_chunks(self, n: int) -> List[Tuple[int, int]]:
        return layout.stage_chunks(n, self.unit_bytes())

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, KVCellarMetadata):
            return
        for t in meta.loads:
            try:
                self._io.submit(self._load, t)
            except RuntimeError:  # shut down: the load is a failure, reported as one
                self._load_done(t, [False] * len(t.keys), set())

    def _load(self, t: _Transfer) -> None:
        """Runs on a load thread: every unit of one request. Whatever
        happens, the request is reported finished (after the library call
        returned) and failed units' blocks are reported (vLLM recomputes
        them)."""
        ok = [False] * len(t.keys)
        missing: Set[str] = set()
        try:
            keys = [k + self._my_suffix() for k in t.keys]
            c = self._client
            if c is not None and self._layers:
                budget = _Budget(self.load_timeout_ms)
                if self._staging:
                    res: List[GetResult] = []
                    for lo, hi in self._stage_chunks(len(keys)):
                        left = budget.left_ms()
                        if left <= 0:  # the bound is spent: the rest is recomputed
                            res += [GetResult(Status.TIMEOUT, 0)] * (len(keys) - lo)
                            break
                        bufs = [layout.stage_buffer(self.unit_bytes()) for _ in range(lo, hi)]
                        with c.call_timeout(left):
                            part = c.batch_get(keys[lo:hi], bufs)
                        for i, r in zip(range(lo, hi), part):
                            if r.status is Status.OK and r.length == bufs[i - lo].numel():
                                layout.stage_in(self._layers, bufs[i - lo], t.blocks[i])
                                ok[i] = True
                        res += part
                else:
                    addrs, sizes, counts, keep = self._units_segments(t.blocks)
                    want = self.unit_bytes()
                    # The call returns only once nothing of it writes into
                    # the blocks any more; only then is the load reported.
                    with c.call_timeout(self.load_timeout_ms):
                        res = c.batch_getv_raw(keys, addrs, sizes, counts)
                    del keep
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

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        with self._lock:
            done, self._done_loads = self._done_loads, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    # -- saves -------------------------------------------------------------------------

    def _writer(self) -> bool:
        return not self.mla or self.tp_rank == 0

    def wait_for_save(self, meta: Any) -> None:
        if not self._writer() or not isinstance(meta, KVCellarMetadata) or not meta.saves or not self._layers:
            return
        c = self._client
        if c is None:
            return
        base = [k for t in meta.saves for k in t.keys]
        blocks = [b for t in meta.saves for b in t.blocks]
        keys = [k + self._my_suffix() for k in base]

        budget = _Budget(self.save_timeout_ms)

        def run() -> List[Status]:
            # Bounded: a save holds the step. The call returns only once
            # nothing of it reads the blocks any more (vLLM may reuse them
            # when the step ends); units it could not store in time are
            # dropped (TIMEOUT), never finished later from reused blocks.
            if self._staging:
                out: List[Status] = []
                for lo, hi in self._stage_chunks(len(keys)):
                    left = budget.left_ms()
                    if left <= 0:
                        return out + [Status.TIMEOUT] * (len(keys) - lo)
                    ub = self.unit_bytes()
                    staged = [layout.stage_out(self._layers, b, ub) for b in blocks[lo:hi]]
                    with c.call_timeout(max(1, budget.left_ms())):
                        out += c.batch_put(keys[lo:hi], staged)
                return out
            addrs, sizes, counts, _ = self._units_segments(blocks)
            with c.call_timeout(self.save_timeout_ms):
                return c.batch_putv_raw(keys, addrs, sizes, counts)

        st = self._misses.run("save", [Status.UNAVAILABLE] * len(keys), run)
        good = [k for k, s in zip(base, st) if s is Status.OK]
        dropped = sum(1 for s in st if s is Status.TIMEOUT)
        self._count(save_units=len(good), save_dropped_units=dropped,
                    save_failed_units=len(keys) - len(good) - dropped, save_bytes=len(good) * self.unit_bytes())
        with self._lock:
            for k in good:
                self._worker_meta.stored[k] = self._worker_meta.stored.get(k, 0) + 1

    def build_connector_worker_meta(self) -> Optional[KVCellarWorkerMeta]:
        with self._lock:
            wm, self._worker_meta = self._worker_meta, KVCellarWorkerMeta()
        return wm if (wm.stored or wm.missing) else None

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            c, self._client = self._client, None
        self._io.shutdown(wait=True)
        if c is not None:
            c.close()
        log.info("kvcellar: connector closed (worker tp %d pp %d); counters %s",
                 self.tp_rank, self.pp_rank, self.counters())
