"""kvcellar.hicache against real kv-server processes.

Without SGLang, against the stand-in base class and stand-in host pools; in
the engine venv (scripts/test-engines.sh), the backend is built through
SGLang's own StorageBackendFactory and drives SGLang's real host pools.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time

import pytest

from conftest import GENEROUS_DEADLINES
from kvcellar._sglang_api import HiCacheStorageConfig, PoolHitPolicy, PoolTransfer
from kvcellar.config import ConfigError
from kvcellar.hicache import KvcellarStorage
from pools import (
    StandInStatePool,
    fill_page,
    indices_for,
    make_pool,
    read_page,
    real_sglang,
    zero_pages,
)


def storage_config(extra, *, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, mla=False, model="org/model-7b",
                   layout="page_first", metrics=False, cp=(0, 1)):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        attn_cp_rank=cp[0], attn_cp_size=cp[1], is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name=model, extra_config=dict(extra),
    )


def make_backend(cluster, pool, *, v1=True, extra=None, **cfg):
    """Creates the backend as SGLang does (through its factory where it is
    installed), then registers the pool in SGLang's attach order."""
    ex = {"backend_name": "kvcellar", "module_path": "kvcellar.hicache", "class_name": "KvcellarStorage",
          "members": cluster.members, "io_timeout_ms": 3000, "connect_timeout_ms": 500,
          # These tests are about pages, not time: a loaded CI machine can take
          # more than the default 200 ms for a batch. The deadline tests set theirs.
          **GENEROUS_DEADLINES,
          # No server publishes the model here: name the weights (None in `extra`: computed).
          "model_fingerprint": "test-weights"}
    if v1:
        ex["interface_v1"] = 1
    ex.update(extra or {})
    sc = storage_config(ex, layout=getattr(pool, "layout", "page_first"), **cfg)
    if real_sglang():
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        backend = StorageBackendFactory.create_backend("dynamic", sc, None)
    else:
        backend = KvcellarStorage(sc, {})
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, "kv")
    backend.on_host_pools_registered()
    return backend


def hashes(tag, n):
    return [f"{tag}{i:060x}"[-64:] for i in range(n)]


POOLS = [("mha", "page_first"), ("mha", "layer_first"), ("mha-asym", "page_first"), ("mla", "page_first")]


@pytest.mark.parametrize("kind,layout", POOLS)
def test_v1_round_trip_every_byte(cluster, kind, layout):
    pool = make_pool(kind, layout)
    b = make_backend(cluster, pool, mla=kind == "mla")
    try:
        keys = hashes(f"rt-{kind}-{layout}-", 8)
        want = [fill_page(pool, i, k) for i, k in enumerate(keys)]
        assert b.batch_set_v1(keys, indices_for(pool, 0, 8)) == [True] * 8
        assert b.batch_exists(keys) == 8
        # Read into other slots: every byte must come back.
        zero_pages(pool, range(20, 28))
        assert b.batch_get_v1(keys, indices_for(pool, 20, 8)) == [True] * 8
        assert [read_page(pool, 20 + i) for i in range(8)] == want
    finally:
        b.close()


def test_leading_hits_stop_at_a_hole_and_set_skips_stored_pages(cluster):
    pool = make_pool("mha")
    b = make_backend(cluster, pool)
    inner = getattr(b, "_backend", b)
    try:
        keys = hashes("hole-", 10)
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert b.batch_set_v1(keys[:4], indices_for(pool, 0, 4)) == [True] * 4
        assert b.batch_set_v1(keys[5:], indices_for(pool, 5, 5)) == [True] * 5
        assert b.batch_exists(keys) == 4
        got = b.batch_get_v1(keys, indices_for(pool, 30, 10))
        assert got[:4] == [True] * 4 and got[4] is False and got[5:] == [True] * 5
        puts = inner._client.counters().get('kvclient_ops_total{op="put",status="ok"}', 0)
        assert b.batch_set_v1(keys, indices_for(pool, 0, 10)) == [True] * 10
        after = inner._client.counters().get('kvclient_ops_total{op="put",status="ok"}', 0)
        assert after - puts == 1, "only the missing page was written"
        assert b.batch_exists(keys) == 10
    finally:
        b.close()


def test_mla_only_the_writer_rank_writes_and_every_rank_reads(cluster):
    pool1 = make_pool("mla")
    reader = make_backend(cluster, pool1, mla=True, tp_rank=1, tp_size=2)
    pool0 = make_pool("mla")
    writer = make_backend(cluster, pool0, mla=True, tp_rank=0, tp_size=2)
    try:
        keys = hashes("mla-", 4)
        for i, k in enumerate(keys):
            fill_page(pool1, i, k)
        assert reader.batch_set_v1(keys, indices_for(pool1, 0, 4)) == [True] * 4
        assert reader.batch_exists(keys) == 0 and writer.batch_exists(keys) == 0, "a non-writer rank wrote"
        want = [fill_page(pool0, i, k) for i, k in enumerate(keys)]
        assert writer.batch_set_v1(keys, indices_for(pool0, 0, 4)) == [True] * 4
        # Rank 1 (and a TP-4 deployment of the same model) read rank 0's pages.
        assert reader.batch_exists(keys) == 4
        assert reader.batch_get_v1(keys, indices_for(pool1, 10, 4)) == [True] * 4
        assert [read_page(pool1, 10 + i) for i in range(4)] == want
        pool4 = make_pool("mla")
        tp4 = make_backend(cluster, pool4, mla=True, tp_rank=3, tp_size=4)
        try:
            assert tp4.batch_exists(keys) == 4
        finally:
            tp4.close()
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize(
    "what,pool_args,cfg",
    [
        ("page size", dict(page_size=32), {}),
        ("model", {}, dict(model="org/other-model")),
        ("tp size", {}, dict(tp_size=2)),
        ("tp rank", {}, dict(tp_size=2, tp_rank=1)),
        ("pp split", {}, dict(pp_size=2, pp_rank=0)),
        ("attention cp", {}, dict(cp=(0, 2))),
        ("layout", dict(layout="layer_first"), {}),
        ("head dim", dict(head_dim=32), {}),
    ],
)
def test_another_identity_misses(cluster, what, pool_args, cfg):
    pool = make_pool("mha")
    b = make_backend(cluster, pool)
    keys = hashes(f"id-{what.replace(' ', '')}-", 4)
    try:
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert b.batch_set_v1(keys, indices_for(pool, 0, 4)) == [True] * 4
        assert b.batch_exists(keys) == 4
    finally:
        b.close()
    pool2 = make_pool("mha", **pool_args)
    other = make_backend(cluster, pool2, **cfg)
    try:
        assert other.batch_exists(keys) == 0, f"another {what} must miss"
        assert other.batch_get_v1(keys, indices_for(pool2, 0, 4)) == [False] * 4
    finally:
        other.close()


def test_large_batches_move_in_slices_under_their_deadline_and_stop_at_a_failed_one(cluster, monkeypatch):
    """A batch larger than what moves in a deadline goes in slices, each
    under its own deadline (one page each here); a load stops after the
    first slice with a page that failed (SGLang uses the leading pages)."""
    import kvcellar._deadline as dl

    pool = make_pool("mha")
    b = make_backend(cluster, pool)
    inner = getattr(b, "_backend", b)
    page = sum(pool.get_page_buffer_meta(indices_for(pool, 0, 1))[1])
    monkeypatch.setattr(dl, "SLICE_RATE", page * 3 // 2 // inner.deadlines.save_ms)
    bounds = []
    real = inner._client.call_timeout
    monkeypatch.setattr(inner._client, "call_timeout", lambda ms: bounds.append(ms) or real(ms))
    try:
        keys = hashes("slices-", 8)
        want = [fill_page(pool, i, k) for i, k in enumerate(keys)]
        stored = [i for i in range(8) if i != 3]
        assert b.batch_set_v1([keys[i] for i in stored[:3]], indices_for(pool, 0, 3)) == [True] * 3
        assert b.batch_set_v1([keys[i] for i in stored[3:]], indices_for(pool, 4, 4)) == [True] * 4
        # Each set: its exist, then one bounded put a page; the first put gets what the exist left.
        assert len(bounds) == 2 + 7 and all(0 < ms <= inner.deadlines.save_ms for ms in bounds), bounds
        bounds.clear()
        zero_pages(pool, range(40, 48))
        got = b.batch_get_v1(keys, indices_for(pool, 40, 8))
        assert got == [True] * 3 + [False] * 5, "the load stops at the slice of the missing page"
        assert bounds == [inner.deadlines.load_ms] * 4, bounds
        assert [read_page(pool, 40 + i) for i in range(3)] == want[:3]
        assert inner.counters()["kvplugin_load_deadline_misses_total"] == 0, "a miss is not a deadline's doing"
    finally:
        b.close()


def test_the_same_name_serving_other_weights_misses(cluster, monkeypatch, tmp_path):
    """Pages follow the weights SGLang says it serves, not the model's name:
    the same files again hit; a fine-tune written over them under the same
    name and path, the same weights quantized at load, another hub commit
    all miss; model_fingerprint names the weights when set
    (docs/plugins/sglang.md, "Page identity and the weights")."""
    from conftest import fake_hub
    from pools import publish_sglang_model
    from test_fingerprint import checkpoint, edited

    model = checkpoint(str(tmp_path), "model")
    keys = hashes("weights-", 4)

    def stored_pages(**extra):
        """How many of the keys a backend built now finds (SGLang's model name unchanged)."""
        pool = make_pool("mha")
        b = make_backend(cluster, pool, extra={"model_fingerprint": None, **extra})
        try:
            n = b.batch_exists(keys)
            assert b.batch_get_v1(keys, indices_for(pool, 0, 4)).count(True) == n
            return n
        finally:
            b.close()

    def store(**extra):
        pool = make_pool("mha")
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        b = make_backend(cluster, pool, extra={"model_fingerprint": None, **extra})
        try:
            assert b.batch_set_v1(keys, indices_for(pool, 0, 4)) == [True] * 4
        finally:
            b.close()

    publish_sglang_model(monkeypatch, model_path=model)
    store()
    assert stored_pages() == 4, "the same weights (another instance, a restart) hit"
    checkpoint(str(tmp_path), "model", edited(100))  # a fine-tune saved over them
    assert stored_pages() == 0, "other weights under the same name and path miss"
    checkpoint(str(tmp_path), "model")
    assert stored_pages() == 4
    publish_sglang_model(monkeypatch, model_path=model, quantization="fp8")
    assert stored_pages() == 0, "the same weights quantized at load miss"
    publish_sglang_model(monkeypatch, model_path=model, json_model_override_args='{"rope_scaling": {"factor": 2}}')
    assert stored_pages() == 0, "the same weights with another RoPE override miss"
    # A hub id: the commit the hub cache resolves names the weights.
    fake_hub(monkeypatch, str(tmp_path / "hub"), "org/model-7b", "a" * 40)
    publish_sglang_model(monkeypatch, model_path="org/model-7b")
    store()
    assert stored_pages() == 4
    fake_hub(monkeypatch, str(tmp_path / "hub"), "org/model-7b", "b" * 40)
    assert stored_pages() == 0, "another commit of the hub id misses"
    # model_fingerprint replaces what the files say: equal texts share pages.
    store(model_fingerprint="ft-2026-11")
    assert stored_pages(model_fingerprint="ft-2026-11") == 4
    assert stored_pages(model_fingerprint="ft-2026-12") == 0


def test_legacy_path_round_trip(cluster):
    pool = make_pool("mha")
    b = make_backend(cluster, pool, v1=False)
    try:
        keys = hashes("legacy-", 5)
        want = [fill_page(pool, i * pool.page_size // pool.page_size, k) for i, k in enumerate(keys)]
        values = [pool.get_data_page(i * pool.page_size, flat=True) for i in range(5)]
        assert b.batch_set(keys, values) is True
        assert b.exists(keys[0]) and b.batch_exists(keys) == 5
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        got = b.batch_get(keys, targets)
        assert all(g is not None for g in got)
        zero_pages(pool, range(5))
        for i, g in enumerate(got):
            pool.set_from_flat_data_page(i * pool.page_size, g)
        assert [read_page(pool, i) for i in range(5)] == want
        assert b.get(hashes("legacy-absent-", 1)[0], pool.get_dummy_flat_data_page()) is None
        assert b.set(keys[0], values[0]) is True
    finally:
        b.close()


def test_v2_side_pool_round_trip_and_hit_policies(cluster):
    pool = make_pool("mha")
    b = make_backend(cluster, pool)
    inner = getattr(b, "_backend", b)
    state = StandInStatePool(size=1024, page_size=pool.page_size, page_bytes=3000)
    inner.register_mem_host_pool_v2(state, "mamba")
    try:
        keys = hashes("v2-", 6)
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert b.batch_set_v1(keys, indices_for(pool, 0, 6)) == [True] * 6
        # State only for the last two pages (a Mamba-like trailing pool).
        for slot in (4, 5):
            page = state.get_dummy_flat_data_page()
            ctypes.memset(page.data_ptr(), 0x40 + slot, 3000)
            state.set_from_flat_data_page(slot * pool.page_size, page)
        t = PoolTransfer(name="mamba", host_indices=indices_for(pool, 4, 2), keys=keys[4:6],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert b.batch_set_v2([t]) == {"mamba": [True, True]}
        want = [state.slot(4 * pool.page_size), state.slot(5 * pool.page_size)]
        r = b.batch_exists_v2(keys, [PoolTransfer(name="mamba", keys=keys[4:6],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert r.kv_hit_pages == 6 and r.extra_pool_hit_pages.get("mamba") == 6
        r = b.batch_exists_v2(keys, [PoolTransfer(name="mamba", keys=keys,
                                                  hit_policy=PoolHitPolicy.ALL_PAGES)])
        assert r.kv_hit_pages == 0, "ALL_PAGES needs the state of every page"
        t2 = PoolTransfer(name="mamba", host_indices=indices_for(pool, 40, 2), keys=keys[4:6])
        assert b.batch_get_v2([t2]) == {"mamba": [True, True]}
        assert [state.slot(40 * pool.page_size), state.slot(41 * pool.page_size)] == want
    finally:
        b.close()


def test_mla_side_pools_written_by_the_right_ranks(cluster):
    """Under MLA, Mamba state is TP-sharded (every rank writes its own),
    while replicated pools (SWA here) are written by the writer rank only,
    under rank-less keys that every rank reads."""
    pools, backends = {}, {}
    for rank in (0, 1):
        pools[rank] = make_pool("mla")
        b = make_backend(cluster, pools[rank], mla=True, tp_rank=rank, tp_size=2)
        inner = getattr(b, "_backend", b)
        for name in ("mamba", "swa"):
            sp = StandInStatePool(size=4096, page_size=pools[rank].page_size, page_bytes=2048)
            inner.register_mem_host_pool_v2(sp, name)
        backends[rank] = (b, inner)
    try:
        keys = hashes("mla-v2-", 2)
        ps = pools[0].page_size
        for rank, (b, inner) in backends.items():
            for name, fill in (("mamba", 0x10 + rank), ("swa", 0x20 + rank)):
                sp = inner.registered_pools[name]
                for slot in (0, 1):
                    page = sp.get_dummy_flat_data_page()
                    ctypes.memset(page.data_ptr(), fill, 2048)
                    sp.set_from_flat_data_page(slot * ps, page)
        # The reader rank first: its SWA writes are acked but not stored.
        for rank in (1, 0):
            b, _ = backends[rank]
            res = b.batch_set_v2([PoolTransfer(name=n, host_indices=indices_for(pools[rank], 0, 2), keys=keys)
                                  for n in ("mamba", "swa")])
            assert res == {"mamba": [True, True], "swa": [True, True]}
        for rank, (b, inner) in backends.items():
            res = b.batch_get_v2([PoolTransfer(name=n, host_indices=indices_for(pools[rank], 50, 2), keys=keys)
                                  for n in ("mamba", "swa")])
            assert res == {"mamba": [True, True], "swa": [True, True]}
            assert inner.registered_pools["mamba"].slot(50 * ps) == bytes([0x10 + rank]) * 2048, "own Mamba state"
            assert inner.registered_pools["swa"].slot(50 * ps) == bytes([0x20]) * 2048, "the writer's SWA page"
    finally:
        for b, _ in backends.values():
            b.close()


def test_a_tag_of_the_old_pool_is_not_kept_for_a_pool_registered_meanwhile(cluster, monkeypatch):
    """A pool registered while a key tag is being computed: the old pool's
    tag answers that call, but is not kept for the new pool's keys."""
    import kvcellar.hicache as hc

    pool = make_pool("mha", layout="page_first")
    b = make_backend(cluster, pool)
    inner = getattr(b, "_backend", b)
    real = hc.pool_identity

    def identity_while_a_pool_is_registered(p):
        with inner._lock:  # what register_mem_pool_host does
            inner._tags = {}
        return real(p)

    try:
        inner._tags = {}
        monkeypatch.setattr(hc, "pool_identity", identity_while_a_pool_is_registered)
        old = inner._tag("kv", pool, "v1")
        monkeypatch.setattr(hc, "pool_identity", real)
        assert ("kv", "v1") not in inner._tags, "the old pool's tag was kept for the new pool"
        assert inner._tag("kv", make_pool("mha", layout="layer_first"), "v1") != old
    finally:
        b.close()


def test_a_key_collision_is_a_mismatch_never_a_wrong_page(cluster, monkeypatch):
    """The header's model_hash is the safety net under the key: with the
    key tag forced equal, another layout's page is refused, not served."""
    monkeypatch.setattr(KvcellarStorage, "_tag", lambda self, *a: "same-tag")
    pool = make_pool("mha", layout="page_first")
    a = make_backend(cluster, pool)
    pool2 = make_pool("mha", layout="layer_first")
    b = make_backend(cluster, pool2)
    try:
        keys = hashes("collide-", 2)
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert a.batch_set_v1(keys, indices_for(pool, 0, 2)) == [True, True]
        getattr(b, "_backend", b)  # through SGLang's wrapper or not
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, indices_for(pool2, 0, 2)) == [False, False]
        assert b.batch_set_v1(keys, indices_for(pool2, 0, 2)) == [False, False], "never stored over another's"
        st = getattr(b, "_backend", b)._client.batch_exist(getattr(b, "_backend", b)._keys(keys, "v1"))
        assert all(x.name == "MISMATCH" for x in st)
    finally:
        a.close()
        b.close()


def test_a_killed_node_gives_misses_not_exceptions():
    from conftest import Cluster

    c = Cluster(2)
    try:
        pool = make_pool("mha")
        b = make_backend(c, pool)
        keys = hashes("kill-", 16)
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert b.batch_set_v1(keys, indices_for(pool, 0, 16)) == [True] * 16
        c.nodes[1].kill()
        got = b.batch_get_v1(keys, indices_for(pool, 50, 16))
        assert 0 < sum(got) < 16, "the live node's pages hit, the dead node's miss"
        assert 0 <= b.batch_exists(keys) < 16
        assert b.batch_set_v1(hashes("kill-new-", 16), indices_for(pool, 0, 16)).count(False) > 0
        b.close()
    finally:
        c.stop()


class FailureInjector:
    """What SGLang's HiCacheStorageFailureInjector does, for stand-in runs:
    each call fails (as its method's failure value) with probability p."""

    def __init__(self, backend, p, seed=1):
        self._backend, self._p, self._r = backend, p, random.Random(seed)

    def _fail(self):
        return self._r.random() < self._p

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return [False] * len(keys) if self._fail() else self._backend.batch_get_v1(keys, host_indices, extra_info)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        return [False] * len(keys) if self._fail() else self._backend.batch_set_v1(keys, host_indices, extra_info)

    def batch_exists(self, keys, extra_info=None):
        return 0 if self._fail() else self._backend.batch_exists(keys, extra_info)

    def close(self):
        self._backend.close()


def test_random_failures_never_give_a_wrong_page(cluster, monkeypatch):
    pool = make_pool("mha")
    if real_sglang():
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
        monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
        b = make_backend(cluster, pool)
        assert type(b).__name__ == "HiCacheStorageFailureInjector"
    else:
        b = FailureInjector(make_backend(cluster, pool), 0.3)
    try:
        keys = hashes("fi-", 12)
        want = {k: fill_page(pool, i, k) for i, k in enumerate(keys)}
        for _ in range(6):
            b.batch_set_v1(keys, indices_for(pool, 0, 12))
        for round_ in range(10):
            zero_pages(pool, range(60, 72))
            got = b.batch_get_v1(keys, indices_for(pool, 60, 12))
            for i, ok in enumerate(got):
                if ok:
                    assert read_page(pool, 60 + i) == want[keys[i]], f"wrong page in round {round_}"
            assert 0 <= b.batch_exists(keys) <= 12
    finally:
        b.close()


def test_close_while_sglang_threads_are_inside_calls(cluster):
    pool = make_pool("mha")
    b = make_backend(cluster, pool)
    keys = hashes("close-", 8)
    want = [fill_page(pool, i, k) for i, k in enumerate(keys)]
    assert b.batch_set_v1(keys, indices_for(pool, 0, 8)) == [True] * 8
    errors, calls = [], [0]
    stop = threading.Event()

    def prefetch():
        while not stop.is_set():
            try:
                assert 0 <= b.batch_exists(keys) <= 8
                calls[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return

    def io(slot):
        while not stop.is_set():
            try:
                got = b.batch_get_v1(keys, indices_for(pool, slot, 8))
                # Whatever a racing close leaves, a page reported read is whole.
                for j, ok in enumerate(got):
                    if ok:
                        assert read_page(pool, slot + j) == want[j], "a page reported read is not the page"
                b.batch_set_v1(keys, indices_for(pool, 0, 8))
                calls[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return

    threads = [threading.Thread(target=prefetch)] + [threading.Thread(target=io, args=(100 + 10 * i,)) for i in range(2)]
    for t in threads:
        t.start()
    end = time.monotonic() + 10
    while calls[0] < 20 and time.monotonic() < end:
        time.sleep(0.01)
    b.close()
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert calls[0] >= 20, "the threads were inside calls when close ran"
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, indices_for(pool, 0, 8)) == [False] * 8


def test_bad_config_names_the_key(cluster, clean_env):
    def build(extra, **kw):
        KvcellarStorage(storage_config(extra, **kw), {})

    with pytest.raises(ConfigError, match="'mds' and 'members'"):
        build({"mds": "127.0.0.1:7480", "members": cluster.members})
    with pytest.raises(ConfigError, match="key 'mds'"):
        build({"mds": "not-an-endpoint"})
    with pytest.raises(ConfigError, match="key 'io_timeout_ms'"):
        build({"members": cluster.members, "io_timeout_ms": "soon"})
    with pytest.raises(ConfigError, match="key 'tenant'"):
        build({"members": cluster.members, "tenant": "a/b"})
    with pytest.raises(ConfigError, match="key 'model_id'"):
        build({"members": cluster.members}, model=None)
    with pytest.raises(ConfigError, match="unknown option"):
        build({"members": cluster.members, "options": "bogus=1"})
    with pytest.raises(ConfigError, match="KVCELLAR_MDS / KVCELLAR_MEMBERS"):
        build({})
    with pytest.raises(ConfigError, match="set 'model_fingerprint'"):
        build({"members": cluster.members})  # no SGLang server published the model it serves
    with pytest.raises(ConfigError, match="key 'model_fingerprint'"):
        build({"members": cluster.members, "model_fingerprint": ""})
    # The environment fills what the extra config leaves out.
    clean_env.setenv("KVCELLAR_MEMBERS", cluster.members)
    KvcellarStorage(storage_config({"model_fingerprint": "w1"}), {}).close()


def test_a_refused_token_fails_at_construction(token_node, clean_env):
    from kvcellar import DeniedError

    with pytest.raises(DeniedError, match="auth token"):
        KvcellarStorage(storage_config({"members": token_node.members}), {})
    clean_env.setenv("KVCELLAR_AUTH_TOKEN_FILE", token_node.token_file)
    KvcellarStorage(storage_config({"members": token_node.members, "model_fingerprint": "w1"}), {}).close()


def test_tenants_are_apart_clear_keeps_pages_and_stats(cluster, caplog):
    pool = make_pool("mha")
    a = make_backend(cluster, pool, extra={"tenant": "team-a"}, metrics=True)
    bb = make_backend(cluster, pool, extra={"tenant": "team-b"})
    try:
        keys = hashes("tenant-", 3)
        for i, k in enumerate(keys):
            fill_page(pool, i, k)
        assert a.batch_set_v1(keys, indices_for(pool, 0, 3)) == [True] * 3
        assert bb.batch_exists(keys) == 0
        with caplog.at_level("INFO", logger="kvcellar.hicache"):
            a.clear()
        assert "leaves the shared L3" in caplog.text
        assert a.batch_exists(keys) == 3
        assert a.batch_get_v1(keys, indices_for(pool, 10, 3)) == [True] * 3
        stats = a.get_stats()
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3] and stats.prefetch_bandwidth[0] > 0
        assert a.get_stats().prefetch_pgs == []
        assert bb.get_stats() is None
    finally:
        a.close()
        bb.close()


#: The most a call with a stopped node may take beyond the slowest healthy
#: one, in ms: the deadlines keep it under 250 ms; a loaded machine adds its
#: own delays, so the assertion allows this much and prints the figure.
SICK_BOUND_MS = int(os.environ.get("KVCELLAR_SICK_BOUND_MS", "600"))


def test_a_stopped_node_costs_a_call_at_most_its_deadline_and_healthy_pages_still_hit():
    """One node of three SIGSTOPped (it accepts, answers nothing): no backend
    call takes more than about its deadline beyond the slowest call on the
    healthy cluster, and every page the other nodes own still hits; on the
    healthy cluster, under the same rounds, no save is dropped for time and
    every page hits (docs/plugins/sglang.md, "Deadlines"). The worst case:
    no cool-down, so every call that needs the stopped node waits for it."""
    from sick import SGLangDriver, check_stopped_node, sick_cluster, until_clean

    def check(out):
        return check_stopped_node(out, SICK_BOUND_MS, "pages")

    worst = {"options": "peer_cooldown_ms=0"}
    until_clean(lambda: sick_cluster(lambda c: SGLangDriver(c, pages=8, extra=worst), rounds=8), check,
                "SGLang HiCache backend, 8 pages of 32 KiB a call")


def test_with_a_cool_down_prefix_lookups_leave_healthy_nodes_serving():
    """As SGLang looks pages up (one batch_exists over a request's pages),
    a round every 100 ms for 2 s, with a cool-down (300 ms here, so the
    stopped node is met again after each): while one node is stopped,
    every page on the other nodes still loads. (A batch exist that had to
    open a connection to the stopped owner must not make a healthy owner
    look dead: it would cool down, and its pages miss meanwhile.)"""
    from sick import SGLangDriver, sick_cluster, until_clean

    def check(out):
        wrong = []
        if out.healthy.loaded != set(out.ref):
            wrong.append(f"healthy: {len(set(out.ref) - out.healthy.loaded)} pages missed")
        missed = set(out.ref) - out.on_stopped - out.sick.loaded
        if missed:
            wrong.append(f"{len(missed)} pages on healthy nodes missed while one node was stopped")
        return wrong

    cool = {"options": "peer_cooldown_ms=300"}
    until_clean(lambda: sick_cluster(lambda c: SGLangDriver(c, pages=8, extra=cool), rounds=20, round_s=0.1,
                                     prefix_lookups=True),
                check, "SGLang HiCache backend, prefix lookups, 300 ms cool-down")
