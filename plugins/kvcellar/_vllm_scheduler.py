"""The scheduler side of the vLLM connector: lookups, load planning and
save planning (docs/plugins/vllm.md, "What is stored, and when it is
shared"). It never waits on the network: a lookup runs on a background
thread and vLLM is told "not ready" until it answers."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from kvcellar._vllm_common import KVCellarMetadata, KVCellarWorkerMeta, Side, _Transfer, log
from kvcellar.client import Status

#: Lookups queued or running at once; more are answered as misses at once
#: (a hung node must not build a backlog that outlives it).
MAX_LOOKUPS = 64


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


class SchedulerSide(Side):
    """The connector vLLM's scheduler holds."""

    def __init__(self, owner: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(owner, vllm_config, "scheduler", kv_cache_config)
        self._reqs: Dict[str, _ReqState] = {}
        self._inflight = 0  # lookups queued or running
        self._pending_loads: List[_Transfer] = []
        self._loading_keys: Dict[str, Tuple[str, int]] = {}  # base key -> (request, unit) of planned loads
        self._events: List[Any] = []
        self._want_events = bool(
            getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)
        )
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcellar-lookup")

    def _lookup(self, keys: List[str]) -> List[bool]:
        """Per unit: whether every shard holds it (one batch exist)."""
        c = self._client
        if c is None or not keys:
            return [False] * len(keys)
        sfx = self._shard_suffixes()
        # Bounded: the call ends (its sockets dropped) before the scheduler
        # stops waiting, a stopped node's keys answered TIMEOUT (not found).
        with c.call_timeout(self.lookup_call_ms):
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
        n_units = self._whole_units(request)
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

    def build_connector_meta(self, scheduler_output: Any) -> KVCellarMetadata:
        meta = KVCellarMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.active:
            return meta
        manager = self.owner._kv_cache_manager
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            full = self._whole_units(req, int(req.num_computed_tokens) + int(n_sched))
            if full <= st.saved_units:
                continue
            units = [u for u in range(st.saved_units, full) if u not in st.present]
            st.saved_units = full
            if not units or manager is None:
                continue
            block_ids = list(manager.get_block_ids(rid)[0])
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

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            c, self._client = self._client, None
        self._lookups.shutdown(wait=True, cancel_futures=True)
        if c is not None:
            c.close()
        log.info("kvcellar: connector closed (scheduler); counters %s", self.counters())
