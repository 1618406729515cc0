"""What the plugins add to a batch, beside the C ABI called directly on the
same buffers in the same run (docs/BENCHMARKS.md, "Plugins").

- SGLang: ``batch_set_v1`` / ``batch_get_v1`` of 64 pages of 4 MiB (MHA
  page_first: a 2 MiB K and a 2 MiB V segment per page) through
  ``kvcellar.hicache``, against ``kv_batch_putv`` / ``kv_batch_getv`` on the
  pool's own page pointers.
- LMCache: ``batched_put`` / ``batched_get`` of 8 chunks of 32 MiB through
  ``kvcellar.lmcache`` (chunk metadata on, from LMCache's event loop),
  against the C ABI on the same chunk buffers and metadata bytes.
- vLLM (``--only vllm``, in a venv with vLLM): the worker connector's save
  (``wait_for_save`` with a step's metadata of 8 units) and load (the body
  of its load thread) of 8 units of 8 MiB (16 blocks of 16 tokens x 8
  layers of 8 KV heads of 128, fp16) from vLLM's real paged KV cache on
  CPU, against the C ABI on the same blocks' segments.

Each round alternates which goes first; puts use fresh keys (pages are
write-once), gets read the same stored objects both ways. Round 0 warms up
and is not counted. Prints medians and plugin/direct time ratios.

usage: python3 bench_plugins.py [--members M] [--rounds N] [--only sglang,lmcache,vllm]
       (without --members it starts 3 kv-server nodes from KVCELLAR_BIN_DIR,
       default target/release, on loopback)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("KVCELLAR_BIN_DIR", os.path.join(HERE, "..", "..", "target", "release"))

import conftest  # noqa: E402,F401 - finds the binaries and the library
from kvcellar import _native  # noqa: E402
from kvcellar.client import _keys, raw_iovecs  # noqa: E402

GIB = 1 << 30
#: Deadlines far above a batch's time: each batch moves as one call, as the
#: C ABI's does (the plugins' default deadlines slice large batches).
UNBOUNDED = {"lookup_deadline_ms": 60000, "load_deadline_ms": 60000, "save_deadline_ms": 60000}


def timed(fn):
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def direct_batch(lib, handle, keys, addrs, sizes, per, write):
    """kv_batch_putv / kv_batch_getv on raw segments, arrays built outside the
    timing; ``per`` is one segment count for every item or a list of them."""
    n = len(keys)
    ks = _keys(keys)
    arr, keep = raw_iovecs(addrs, sizes)
    counts = (ctypes.c_size_t * n)(*([per] * n if isinstance(per, int) else per))
    st = (ctypes.c_int * n)()
    lens = (ctypes.c_size_t * n)()

    def call():
        if write:
            return lib.kv_batch_putv(handle, n, ks, arr, counts, st)
        return lib.kv_batch_getv(handle, n, ks, arr, counts, lens, st)

    t, ok = timed(call)
    del keep
    return t, ok


def alternate(rounds, ops, make_runs, items):
    """Round 0 warms up and is not counted; each round runs ``op plugin`` and
    ``op direct`` for every op, alternating which goes first. ``make_runs(r)``
    gives the round's {"op who": () -> (seconds, ok)}; ok is True or the
    number of items served."""
    out = {f"{op} {who}": [] for op in ops for who in ("plugin", "direct")}
    for r in range(rounds + 1):
        runs = make_runs(r)
        for op in ops:
            first, second = ("direct", "plugin") if r % 2 else ("plugin", "direct")
            for who in (first, second):
                t, ok = runs[f"{op} {who}"]()
                assert ok is True or ok == items, f"{op} {who} failed"
                if r:
                    out[f"{op} {who}"].append(t)
    return out


def bench_sglang(members, rounds, pages=64):
    from kvcellar._sglang_api import HiCacheStorageConfig
    from kvcellar.hicache import KvcellarStorage
    from pools import StandInMHAPool, fill_page, indices_for

    ps, layers, heads, dim = 64, 32, 8, 64  # K and V of 2 MiB each per page
    pool = StandInMHAPool(size=2 * pages * ps, page_size=ps, layer_num=layers, head_num=heads, head_dim=dim,
                          layout="page_first")
    for i in range(pages):
        fill_page(pool, i, f"bench-{i}")
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench/model",
                               extra_config={"members": members, "interface_v1": 1, "io_timeout_ms": 60000,
                                             "model_fingerprint": "bench-weights", **UNBOUNDED})
    b = KvcellarStorage(cfg, {})
    b.register_mem_pool_host(pool)
    lib, handle = b._client._lib, b._client._handle()
    src, dst = indices_for(pool, 0, pages), indices_for(pool, pages, pages)
    ptrs_src, sizes = pool.get_page_buffer_meta(src)
    ptrs_dst, _ = pool.get_page_buffer_meta(dst)
    per = len(ptrs_src) // pages
    nbytes = sum(sizes)

    def make_runs(r):
        keys = [f"{r:04x}{i:060x}" for i in range(pages)]
        direct_keys = [b._key(f"d{r:03x}{i:060x}", "direct") for i in range(pages)]
        return {
            "set plugin": lambda: timed(lambda: all(b.batch_set_v1(keys, src))),
            "set direct": lambda: direct_batch(lib, handle, direct_keys, ptrs_src, sizes, per, write=True),
            "get plugin": lambda: timed(lambda: all(b.batch_get_v1(keys, dst))),
            # The same stored pages the plugin reads, so both gets fetch identical objects.
            "get direct": lambda: direct_batch(lib, handle, b._keys(keys, "v1"), ptrs_dst, sizes, per, write=False),
        }

    out = alternate(rounds, ("set", "get"), make_runs, pages)
    b.close()
    return out, nbytes


def bench_lmcache(members, rounds, chunks=8):
    import lmc
    from kvcellar._lmcache_api import RemoteMetadata

    lmc.LAYERS, lmc.HEADS, lmc.HEAD_DIM, lmc.CHUNK = 32, 8, 128, 256  # 32 MiB chunks in fp16
    h = lmc.StandInHarness({"members": members, "io_timeout_ms": 60000, "model_fingerprint": "bench-weights",
                            **UNBOUNDED}, model="bench/model", chunk_size=256)
    c = h.connector
    objs = [h.new_chunk(f"c{i}", tokens=256) for i in range(chunks)]
    nbytes = sum(o.get_size() for o in objs)
    assert objs[0].get_size() == 32 << 20
    lib, handle = c.client._lib, c.client._handle()
    meta = [RemoteMetadata(o.get_size(), o.get_shapes(), o.get_dtypes(), o.get_memory_format()).serialize()
            for o in objs]
    meta_bufs = [ctypes.create_string_buffer(m, len(m)) for m in meta]
    addrs, sizes = [], []
    for m, o in zip(meta_bufs, objs):
        addrs += [ctypes.addressof(m), o.data_ptr]
        sizes += [len(m.raw), o.get_size()]
    def plugin_get(keys):
        got = h.run(c.batched_get(keys))
        ok = all(g is not None for g in got)
        for g in got:
            if g is not None:
                g.ref_count_down()
        return ok

    # Warm LMCache's allocator as a running engine has it (buffers reserved).
    warm = [h.backend.allocate(objs[0].get_shapes(), objs[0].get_dtypes(), objs[0].get_memory_format())
            for _ in range(chunks)]
    for w in warm:
        w.ref_count_down()

    def make_runs(r):
        keys = [h.key(0x10000 * (r + 1) + i) for i in range(chunks)]
        dkeys = [("direct/" + k).encode() for k in keys]
        return {
            "put plugin": lambda: timed(lambda: h.run(c.batched_put(keys, objs)) is None),
            "put direct": lambda: direct_batch(lib, handle, dkeys, addrs, sizes, 2, write=True),
            "get plugin": lambda: timed(lambda: plugin_get(keys)),
            "get direct": lambda: direct_batch(lib, handle, [c._key(k) for k in keys], addrs, sizes, 2, write=False),
        }

    out = alternate(rounds, ("put", "get"), make_runs, chunks)
    h.close()
    return out, nbytes


def bench_vllm(members, rounds, units=8):
    import torch
    from kvcellar._vllm_common import KVCellarMetadata, _Transfer
    from vllm_engine import Engine, model_dir, vllm_config
    import tempfile

    root = tempfile.mkdtemp(prefix="kvcellar-bench-vllm-")
    e = Engine(vllm_config(model_dir(root, layers=8, kv_heads=8, head_dim=128),
                           {"members": members, "io_timeout_ms": 60000, "save_timeout_ms": 60000,
                            "load_timeout_ms": 60000}), num_blocks=300)
    w = e.worker
    assert w.unit_bytes() == 8 << 20, w.unit_bytes()
    for v in e.layers:
        v.copy_(torch.randn(v.shape).to(v.dtype))
    bpu = w.blocks_per_unit
    src = [list(range(1 + u * bpu, 1 + (u + 1) * bpu)) for u in range(units)]
    dst = [list(range(1 + (units + u) * bpu, 1 + (units + u + 1) * bpu)) for u in range(units)]

    s_addrs, s_sizes, per, _ = w._units_segments(src)
    d_addrs, d_sizes, _, _ = w._units_segments(dst)
    lib, handle = w._client._lib, w._client._handle()
    nbytes = units * w.unit_bytes()

    def save(keys):
        before = w.counters()["save_units"]
        w.bind_connector_metadata(KVCellarMetadata(saves=[_Transfer("bench", keys, src)]))
        t, _ = timed(w.wait_for_save)
        w.clear_connector_metadata()
        return t, w.counters()["save_units"] - before == units

    def load(keys):
        before = w.counters()["load_failed_units"]
        t, _ = timed(lambda: w._load(_Transfer("bench", keys, dst)))
        w.get_finished(set())
        return t, w.counters()["load_failed_units"] == before and not w.get_block_ids_with_load_errors()

    def make_runs(r):
        keys = [f"{r:04x}{i:060x}.{w.tag}" for i in range(units)]
        dkeys = [f"d{k}" for k in keys]
        return {
            "put plugin": lambda: save(keys),
            "put direct": lambda: direct_batch(lib, handle, dkeys, s_addrs, s_sizes, per, write=True),
            "get plugin": lambda: load(keys),
            "get direct": lambda: direct_batch(lib, handle, keys, d_addrs, d_sizes, per, write=False),
        }

    out = alternate(rounds, ("put", "get"), make_runs, units)
    e.close()
    return out, nbytes


def report(title, out, nbytes):
    print(f"\n{title} ({nbytes / (1 << 20):.0f} MiB a batch, median of {len(next(iter(out.values())))} rounds)")
    for op in ("set", "put", "get"):
        p, d = out.get(f"{op} plugin"), out.get(f"{op} direct")
        if not p:
            continue
        mp, md = statistics.median(p), statistics.median(d)
        paired = statistics.median(a / b for a, b in zip(p, d))
        print(f"  {op:<4} plugin {mp * 1e3:8.1f} ms ({nbytes / mp / GIB:5.2f} GiB/s)   "
              f"C ABI {md * 1e3:8.1f} ms ({nbytes / md / GIB:5.2f} GiB/s)   plugin/direct {mp / md:5.3f}"
              f" (per round {paired:5.3f})   (target < 1.10)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--members")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="sglang,lmcache")
    a = ap.parse_args()
    only = set(a.only.split(","))
    cluster = None
    members = a.members
    if not members:
        from conftest import Cluster

        cluster = Cluster(3, cap="6G")
        members = cluster.members
    try:
        print(f"library {_native.load()._kvcellar_path}, members {members}")
        if "sglang" in only:
            report("SGLang backend, v1 batch of 64 pages of 4 MiB", *bench_sglang(members, a.rounds))
        if "lmcache" in only:
            report("LMCache connector, batch of 8 chunks of 32 MiB", *bench_lmcache(members, a.rounds))
        if "vllm" in only:
            report("vLLM connector, a step's 8 units of 8 MiB", *bench_vllm(members, a.rounds))
    finally:
        if cluster:
            cluster.stop()


if __name__ == "__main__":
    main()
