"""The request trace through kvcellar.hicache on SGLang's REAL host pool,
against ``kvctl replay`` on the same slice and the same nodes.

The first 300 requests of traces/conversation_trace.jsonl, one 512-token
page a block (full blocks only, as ``kvctl replay --pages-per-block 1``),
in trace order, one engine stream. Each request goes through the backend as
SGLang 0.5.23's HiCacheController drives an L3 backend
(``managers/cache_controller.py``):

- hit query (``_storage_hit_query``): ``batch_exists`` over the page keys in
  batches of ``STORAGE_BATCH_SIZE``, stopping at the first short batch;
- prefetch (``_page_transfer``): host pages from the host pool's own
  ``alloc``, then ``batch_get_v1`` of the hits into them, batch by batch;
  a page counts when it and every page before it came back;
- backup (``_page_backup``): the pages after the hits, written into host
  pages, then ``batch_set_v1`` from there, batch by batch.

Leading hits over the slice must be 675 (tests/tests/replay.rs), with every
page read back byte for byte, and equal to what ``kvctl replay --json``
reports for the same slice against the same nodes (another tag), in total
and per window of trace time.

Keys have SGLang's storage-key form: 64 hex digits of a SHA-256 chain, one
a page, each over the previous page's digest and the page's tokens, the
chain seeded by SGLang's own ``storage_namespace_seed`` with the run's tag
as the request's ``cache_salt`` (so runs share no pages). A block's hash id
stands for its 512 tokens: it names the block and everything before it, so
two requests' keys agree exactly where their hash ids do. (SGLang's
``get_hash_str`` itself is not called: in 0.5.23 it JIT-builds a C++
extension with ninja, which the engine venv does not have.)

Needs SGLang (scripts/test-engines.sh); skipped with the stand-ins.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import time
from typing import Dict, List, Tuple

import pytest

from conftest import ROOT, _bin
from pools import real_sglang

TRACE = os.path.join(ROOT, "traces", "conversation_trace.jsonl")
LIMIT = 300
BLOCK_TOKENS = 512
WINDOW_MS = 10_000  # kvctl replay's default --window
# The slice's figures (tests/tests/replay.rs): leading-hit pages with
# capacity above the working set, pages, distinct pages.
SLICE_HITS = 675
SLICE_PAGES = 8_190
SLICE_DISTINCT = 7_515
# Host pool: page_size 512 (a trace block), 1 layer, 1 head of dim 2, fp16:
# 2 KiB of K + 2 KiB of V = 4 KiB a page, kvctl's --page-bytes below. 256
# pages hold the longest request of the slice (235 full blocks).
POOL_PAGES = 256
LAYERS, HEADS, HEAD_DIM = 1, 1, 2

pytestmark = pytest.mark.skipif(
    not real_sglang(), reason="needs SGLang's real host pool and controller constants (scripts/test-engines.sh)"
)


def load_slice() -> List[Tuple[int, List[int]]]:
    """(timestamp ms, full-block hash ids) of the first LIMIT requests."""
    out = []
    with open(TRACE) as f:
        for line in f:
            if len(out) >= LIMIT:
                break
            if line.strip():
                r = json.loads(line)
                out.append((int(r["timestamp"]), r["hash_ids"][: r["input_length"] // BLOCK_TOKENS]))
    return out


def ceiling(chains: List[List[int]]) -> List[int]:
    """Leading hits per request with unlimited capacity: pages before the
    first one no earlier request stored."""
    stored: set = set()
    out = []
    for chain in chains:
        out.append(next((i for i, h in enumerate(chain) if h not in stored), len(chain)))
        stored.update(chain)
    return out


def page_keys(seed_hex: str, chain: List[int]) -> List[str]:
    """One SGLang-form key (64 hex digits) a page: a SHA-256 chain from the
    namespace seed, each link over the prior digest and the page's tokens
    (the block's hash id, 4 bytes little-endian)."""
    prior = bytes.fromhex(seed_hex)
    keys = []
    for h in chain:
        prior = hashlib.sha256(prior + h.to_bytes(4, "little")).digest()
        keys.append(prior.hex())
    return keys


def page_bytes_of(key: str, n: int) -> bytes:
    """The bytes the engine "computed" for a page: a function of its key."""
    return hashlib.shake_128(key.encode()).digest(n)


class HostPages:
    """Pages of the real host pool, by position in an allocation."""

    def __init__(self, pool, indices):
        self.indices = indices
        n = indices.numel() // pool.page_size
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        per = len(ptrs) // n if n else 0
        self.segs = [list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per])) for i in range(n)]

    def write(self, i: int, data: bytes) -> None:
        at = 0
        for p, s in self.segs[i]:
            ctypes.memmove(p, data[at : at + s], s)
            at += s

    def read(self, i: int) -> bytes:
        return b"".join(ctypes.string_at(p, s) for p, s in self.segs[i])

    def zero(self) -> None:
        for segs in self.segs:
            for p, s in segs:
                ctypes.memset(p, 0, s)


def replay_through_backend(backend, pool, reqs, seed_hex: str, page_bytes: int) -> Dict[str, object]:
    """Each request as HiCacheController drives the backend (module docs);
    returns the per-request leading hits and the totals of the checks."""
    from kvcellar._sglang_api import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    ps = pool.page_size
    free_at_start = pool.available_size()
    per_request, wrong, get_missed, failed_sets = [], 0, 0, 0
    for _, chain in reqs:
        keys = page_keys(seed_hex, chain)
        # Hit query.
        hits = 0
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            n = backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=None))
            hits += n
            if n < len(batch):
                break
        # Prefetch of the hits into host pages from the pool's allocator.
        got = 0
        if hits:
            idx = pool.alloc(hits * ps)
            assert idx is not None, "the host pool is full"
            pages = HostPages(pool, idx)
            pages.zero()  # a freed slot may still hold this very page
            hit_keys = keys[:hits]  # the controller's operation.hash_value
            for start in range(0, hits, STORAGE_BATCH_SIZE):
                batch = hit_keys[start : start + STORAGE_BATCH_SIZE]
                res = backend.batch_get_v1(batch, idx[start * ps : (start + len(batch)) * ps],
                                           HiCacheStorageExtraInfo(prefix_keys=None))
                inc = next((i for i, ok in enumerate(res) if not ok), len(batch))
                got += inc
                if inc < len(batch):
                    break
            for i in range(got):
                if pages.read(i) != page_bytes_of(keys[i], page_bytes):
                    wrong += 1
            pool.free(idx)
        get_missed += hits - got
        per_request.append(got)
        # Backup of the pages after the hits, from host pages.
        rest = keys[got:]
        if rest:
            idx = pool.alloc(len(rest) * ps)
            assert idx is not None, "the host pool is full"
            pages = HostPages(pool, idx)
            for i, k in enumerate(rest):
                pages.write(i, page_bytes_of(k, page_bytes))
            for start in range(0, len(rest), STORAGE_BATCH_SIZE):
                batch = rest[start : start + STORAGE_BATCH_SIZE]
                res = backend.batch_set_v1(batch, idx[start * ps : (start + len(batch)) * ps],
                                           HiCacheStorageExtraInfo(prefix_keys=None))
                failed_sets += sum(not ok for ok in res)
            pool.free(idx)
    assert pool.available_size() == free_at_start, "every host page went back to the pool"
    return {"per_request": per_request, "wrong": wrong, "get_missed": get_missed, "failed_sets": failed_sets}


def first_page(pool):
    """host_indices of the pool's first page (to read its size; not allocated)."""
    import torch

    return torch.arange(pool.page_size, dtype=torch.int64)


def windows(reqs, hits: List[int], ceil: List[int]) -> Dict[float, Tuple[int, int, int, int]]:
    """(requests, pages, hits, ceiling hits) per window of trace time that
    has requests, keyed by the window's start in seconds."""
    out: Dict[float, List[int]] = {}
    for (ts, chain), h, c in zip(reqs, hits, ceil):
        w = out.setdefault((ts // WINDOW_MS) * WINDOW_MS / 1000.0, [0, 0, 0, 0])
        w[0] += 1
        w[1] += len(chain)
        w[2] += h
        w[3] += c
    return {k: tuple(v) for k, v in out.items()}


def test_trace_slice_through_the_backend_hits_as_kvctl_replay(cluster):
    from real_pools import make_real_pool
    from sglang.srt.mem_cache.utils import storage_namespace_seed
    from test_hicache import make_backend

    t0 = time.monotonic()
    reqs = load_slice()
    chains = [c for _, c in reqs]
    ceil = ceiling(chains)
    assert len(reqs) == LIMIT
    assert sum(len(c) for c in chains) == SLICE_PAGES
    assert len({h for c in chains for h in c}) == SLICE_DISTINCT
    assert sum(ceil) == SLICE_HITS, "the slice's leading hits, from the trace alone"
    assert max(len(c) for c in chains) <= POOL_PAGES

    pool = make_real_pool("mha", "page_first", POOL_PAGES * BLOCK_TOKENS, BLOCK_TOKENS, LAYERS, HEADS, HEAD_DIM)
    assert type(pool).__module__.startswith("sglang"), type(pool)
    page_bytes = sum(pool.get_page_buffer_meta(first_page(pool))[1])
    run = f"{os.getpid()}-{time.time_ns()}"
    backend = make_backend(cluster, pool)
    try:
        got = replay_through_backend(backend, pool, reqs, storage_namespace_seed(None, f"hicache-replay-{run}"),
                                     page_bytes)
    finally:
        backend.close()
    hits = got["per_request"]
    assert got["wrong"] == 0, f"{got['wrong']} pages read back were not the pages written"
    assert got["get_missed"] == 0, "batch_exists counted pages that batch_get_v1 did not serve"
    assert got["failed_sets"] == 0, f"{got['failed_sets']} pages were not stored"
    assert sum(hits) == SLICE_HITS, f"{sum(hits)} leading-hit pages through the backend, want {SLICE_HITS}"
    assert hits == ceil, "per request, the backend hits exactly what the trace allows"
    backend_s = time.monotonic() - t0

    # The real kvctl replay on the same slice, the same nodes, its own tag.
    t1 = time.monotonic()
    args = [_bin("kvctl"), "replay", "--members", cluster.members, TRACE, "--limit", str(LIMIT), "--engines", "1",
            "--pages-per-block", "1", "--page-bytes", str(page_bytes), "--window", f"{WINDOW_MS}ms",
            "--tag", f"py-kvctl-{run}", "--json"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"kvctl replay exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    j = json.loads(p.stdout)
    assert (j["requests"], j["pages"], j["page_bytes"]) == (LIMIT, SLICE_PAGES, page_bytes), j
    assert j["working_set"]["distinct_pages"] == SLICE_DISTINCT, j
    assert j["ceiling"]["hits"] == SLICE_HITS, j
    assert (j["wrong_pages"], j["get_missed_after_exist"], j["failed_puts"]) == (0, 0, {}), j
    assert j["hits"] == sum(hits), f"kvctl replay {j['hits']} leading hits, the SGLang backend {sum(hits)}"
    kvctl_windows = {
        w["start_s"]: (w["requests"], w["pages"], w["hits"], w["ceiling_hits"]) for w in j["windows"] if w["requests"]
    }
    assert kvctl_windows == windows(reqs, hits, ceil), "per window of trace time, the same hits"
    print(f"\n{LIMIT} requests, {SLICE_PAGES} pages of {page_bytes} B: {sum(hits)} leading hits through "
          f"kvcellar.hicache on {type(pool).__name__} ({backend_s:.1f} s), {j['hits']} through kvctl replay "
          f"({time.monotonic() - t1:.1f} s), over {len(kvctl_windows)} windows of {WINDOW_MS // 1000} s")
