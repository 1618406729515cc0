"""kvcellar.lmcache against real kv-server processes (LMCache's own plugin
loading and backends where LMCache is installed, stand-ins otherwise)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from conftest import GENEROUS_DEADLINES
from kvcellar.config import ConfigError
from lmc import CHUNK, make_harness, real_lmcache


@pytest.fixture()
def h(cluster):
    hh = make_harness({"members": cluster.members, "io_timeout_ms": 3000, "connect_timeout_ms": 500, **GENEROUS_DEADLINES})
    yield hh
    hh.close()


def test_round_trip_every_byte(h):
    c = h.connector
    key = h.key(0x1234)
    obj = h.new_chunk("a")
    want = h.data(obj)
    assert not h.run(c.exists(key))
    h.run(c.put(key, obj))
    assert obj.get_ref_count() == 1, "the connector must not release what it put"
    assert h.run(c.exists(key)) and c.exists_sync(key)
    got = h.run(c.get(key))
    assert got is not None and h.data(got) == want
    assert h.run(c.get(h.key(0x9999))) is None
    assert h.run(c.list()) == []


@pytest.mark.parametrize("meta", [True, False])
def test_partial_chunk_with_and_without_chunk_meta(cluster, meta):
    hh = make_harness({"members": cluster.members, **GENEROUS_DEADLINES}, save_chunk_meta=meta)
    try:
        c = hh.connector
        obj = hh.new_chunk("partial", tokens=CHUNK // 2)
        want = hh.data(obj)
        key = hh.key(0x77 + int(meta))
        hh.run(c.put(key, obj))
        got = hh.run(c.get(key))
        assert got is not None and hh.data(got) == want and got.get_size() == len(want)
    finally:
        hh.close()


def test_batches_leading_hits_and_non_blocking_prefix(h):
    c = h.connector
    keys = [h.key(0x500 + i) for i in range(8)]
    objs = [h.new_chunk(k) for k in keys]
    want = [h.data(o) for o in objs]
    h.run(c.batched_put([k for i, k in enumerate(keys) if i != 5], [o for i, o in enumerate(objs) if i != 5]))
    assert h.run(c.batched_async_contains("l1", keys)) == 5
    assert c.batched_contains(keys) == 5 and c.support_batched_contains()
    got = h.run(c.batched_get(keys))
    assert got[5] is None and all(h.data(g) == w for i, (g, w) in enumerate(zip(got, want)) if i != 5)
    before = h.live_objects()
    prefix = h.run(c.batched_get_non_blocking("l2", keys))
    assert [h.data(p) for p in prefix] == want[:5]
    assert h.live_objects() == before + 5, "objects after the first miss are released"


def test_keys_of_any_characters(h):
    c = h.connector
    keys = [
        h.key(-0x1F, model="org/sub/model"),  # '/' and a leading '-' in the hash
        h.key(bytes.fromhex("00ff10") * 4),  # a bytes chunk hash
        h.key(0xABC) + "@tag%value@x",
        "-leading-dash@" + "z" * 2000,  # longer than the store's keys: hashed
    ]
    for i, k in enumerate(keys):
        o = h.new_chunk(k)
        w = h.data(o)
        h.run(c.put(k, o))
        g = h.run(c.get(k))
        assert g is not None and h.data(g) == w, k[:40]
    assert c.remove_sync(keys[0]) and not c.remove_sync(keys[0])
    assert not h.run(c.exists(keys[0])) and h.run(c.exists(keys[1]))


def test_many_async_calls_in_flight_from_one_loop(h):
    c = h.connector
    keys = [h.key(0x900 + i) for i in range(48)]
    objs = [h.new_chunk(k) for k in keys]
    want = {k: h.data(o) for k, o in zip(keys, objs)}

    async def storm():
        await asyncio.gather(*(c.put(k, o) for k, o in zip(keys, objs)))
        gets = await asyncio.gather(*(c.get(k) for k in keys), *(c.exists(k) for k in keys))
        return gets

    res = h.run(storm())
    got, ex = res[:48], res[48:]
    assert all(ex) and all(g is not None and h.data(g) == want[k] for g, k in zip(got, keys))


def _silent():
    """A listening socket that accepts and never answers (a hung node)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    return silent, "%s:%d" % silent.getsockname()


def test_a_hung_node_costs_each_call_its_deadline(cluster):
    silent, addr = _silent()
    # No cool-down: every call meets the hung node and waits its deadline.
    hh = make_harness({"members": f"hung={addr}", "io_timeout_ms": 5000, "connect_timeout_ms": 3000,
                       "options": "peer_cooldown_ms=0", "lookup_deadline_ms": 150, "load_deadline_ms": 250})
    try:
        c = hh.connector
        for what, call, miss, limit in (
            ("exists", lambda: c.exists(hh.key(1)), False, 0.15),
            ("batched contains", lambda: c.batched_async_contains("x", [hh.key(2), hh.key(3)]), 0, 0.15),
            ("get", lambda: c.get(hh.key(4)), None, 0.25),
        ):
            t = time.monotonic()
            assert hh.run(call()) == miss, what
            took = time.monotonic() - t
            assert limit * 0.8 <= took < limit + 1.0, f"{what} took {took:.3f} s for a {limit:.3f} s deadline"
        assert hh.live_objects() == 0, "a failed get releases its memory object"
        s = c.stats()
        assert s["kvplugin_lookup_deadline_misses_total"] == 3 and s["kvplugin_load_deadline_misses_total"] == 1, s
    finally:
        hh.close()
        silent.close()


def test_a_call_its_caller_gives_up_on_ends_before_its_method_and_releases_what_it_holds(cluster):
    """LMCache gives up waiting on some calls (its wait_for around contains
    and non-blocking gets, a cancelled future in get_blocking): the method
    still ends only once its library call did (at its deadline), so nothing
    runs on in memory objects; the get's object goes back, the put's
    reference too, and the put counts as dropped for time."""
    silent, addr = _silent()
    hh = make_harness({"members": f"hung={addr}", "io_timeout_ms": 5000, "connect_timeout_ms": 3000,
                       "options": "peer_cooldown_ms=0", "load_deadline_ms": 600, "save_deadline_ms": 600})
    try:
        c = hh.connector
        before = hh.live_objects()

        async def give_up(coro):
            t = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(coro, 0.05)
            return time.monotonic() - t

        took = hh.run(give_up(c.get(hh.key(5))))
        assert 0.45 <= took < 3.0, f"the get ended {took:.3f} s after its caller gave up at 0.05 s"
        assert hh.live_objects() == before, "the get's memory object went back"
        obj = hh.new_chunk("held")
        took = hh.run(give_up(c.put(hh.key(6), obj)))
        assert 0.45 <= took < 3.0, f"the put ended {took:.3f} s after its caller gave up at 0.05 s"
        assert obj.get_ref_count() == 1, "the put's reference went back when it ended"
        s = c.stats()
        assert s["kvplugin_saves_dropped_deadline_total"] == 1 and s["kvplugin_saves_dropped_total"] == 1, s
    finally:
        hh.close()
        silent.close()


def test_a_killed_node_gives_misses_not_exceptions():
    from conftest import Cluster

    cl = Cluster(2)
    hh = make_harness({"members": cl.members, "io_timeout_ms": 2000, "connect_timeout_ms": 300, **GENEROUS_DEADLINES})
    try:
        c = hh.connector
        keys = [hh.key(0x300 + i) for i in range(12)]
        hh.run(c.batched_put(keys, [hh.new_chunk(k) for k in keys]))
        assert c.batched_contains(keys) == 12
        cl.nodes[0].kill()
        got = hh.run(c.batched_get(keys))
        assert 0 < sum(g is not None for g in got) < 12
        hh.run(c.batched_put([hh.key(0x400)], [hh.new_chunk("x")]))  # logged, not raised
        assert 0 <= c.batched_contains(keys) < 12
    finally:
        hh.close()
        cl.stop()


def test_bad_config_fails_loudly_at_construction(cluster, clean_env):
    with pytest.raises(ConfigError, match="'mds' and 'members'"):
        make_harness({"mds": "127.0.0.1:7480", "members": cluster.members}).close()
    with pytest.raises(ConfigError, match="io_timeout_ms"):
        make_harness({"members": cluster.members, "io_timeout_ms": "later"}).close()
    with pytest.raises(ConfigError, match="KVCELLAR_MDS / KVCELLAR_MEMBERS"):
        make_harness({}).close()
    # A model name that is neither a path nor a hub id the cache holds.
    with pytest.raises(ConfigError, match="model_fingerprint"):
        make_harness({"members": cluster.members}, fingerprint=None, model="org/model@v1").close()


def test_a_refused_token_fails_at_construction(token_node, clean_env):
    from kvcellar import DeniedError

    with pytest.raises(DeniedError, match="auth token"):
        make_harness({"members": token_node.members}).close()
    h = make_harness({"members": token_node.members, "auth_token_file": token_node.token_file})
    h.close()


def test_the_same_name_serving_other_weights_misses(cluster, monkeypatch, tmp_path):
    """Chunks follow the weights LMCache's model name points at, not the
    name: the same files again hit; a fine-tune written over them at the
    same path, another hub commit miss; model_fingerprint names the
    weights when set (docs/plugins/lmcache.md, "Page identity and the weights")."""
    from conftest import fake_hub
    from test_fingerprint import checkpoint, edited

    def roundtrip(model, put=False, **extra):
        """Whether a connector built now finds the chunk (storing it first with `put`)."""
        hh = make_harness({"members": cluster.members, **GENEROUS_DEADLINES, **extra}, fingerprint=None, model=model)
        try:
            c, key = hh.connector, hh.key(0x5150)
            if put:
                hh.run(c.put(key, hh.new_chunk("weights")))
            got = hh.run(c.get(key))
            if got is not None:
                got.ref_count_down()
            assert (got is not None) == (c.batched_contains([key]) == 1)
            return got is not None
        finally:
            hh.close()

    model = checkpoint(str(tmp_path), "model")
    assert roundtrip(model, put=True)
    assert roundtrip(model), "the same weights (another worker, a restart) hit"
    # vLLM's record of the model it builds the worker for (its current
    # config): its load-time quantization counts, a record of another model does not.
    import sys
    import types

    def vllm_serving(name, quantization=None):
        mc = types.SimpleNamespace(model=name, revision=None, quantization=quantization, hf_overrides=None)
        lc = types.SimpleNamespace(load_format="auto", download_dir=None)
        vc = types.SimpleNamespace(model_config=mc, load_config=lc)
        stub = types.SimpleNamespace(get_current_vllm_config_or_none=lambda: vc)
        monkeypatch.setitem(sys.modules, "vllm.config", stub)

    vllm_serving(model, quantization="fp8")
    assert not roundtrip(model), "the same weights quantized at load miss"
    vllm_serving(str(tmp_path / "another-model"), quantization="fp8")
    assert roundtrip(model), "a record of another model is not this one's"
    monkeypatch.delitem(sys.modules, "vllm.config")
    checkpoint(str(tmp_path), "model", edited(100))  # a fine-tune saved over them
    assert not roundtrip(model), "other weights under the same name and path miss"
    fake_hub(monkeypatch, str(tmp_path / "hub"), "org/model-7b", "a" * 40)
    assert roundtrip("org/model-7b", put=True)
    fake_hub(monkeypatch, str(tmp_path / "hub"), "org/model-7b", "b" * 40)
    assert not roundtrip("org/model-7b"), "another commit of the hub id misses"
    assert roundtrip("org/model-7b", put=True, model_fingerprint="ft-2026-11")
    assert roundtrip("org/model-7b", model_fingerprint="ft-2026-11")
    assert not roundtrip("org/model-7b", model_fingerprint="ft-2026-12")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_loaded_line_and_geometry_separation(cluster):
    lines = _Lines()
    lg = logging.getLogger("kvcellar.lmcache")  # LMCache's loggers do not propagate: listen on ours
    lg.addHandler(lines)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        a = make_harness({"members": cluster.members, **GENEROUS_DEADLINES})
    finally:
        lg.removeHandler(lines)
        lg.setLevel(old)
    try:
        assert any("kvcellar LMCache connector ready" in ln for ln in lines.lines), lines.lines
        key = a.key(0x4242)
        a.run(a.connector.put(key, a.new_chunk("g")))
        b = make_harness({"members": cluster.members, **GENEROUS_DEADLINES}, save_chunk_meta=False)
        try:
            # Same key string, another payload format: never served as this one's.
            assert b.run(b.connector.get(key)) is None
        finally:
            b.close()
    finally:
        a.close()


@pytest.mark.skipif(not real_lmcache(), reason="needs LMCache's own RemoteBackend")
def test_through_lmcache_remote_backend(h):
    """LMCache's RemoteBackend (what its StorageManager calls) over the
    connector it loaded: put, contains, get, batched forms, remove."""
    import asyncio as aio

    rb = h.remote
    k = [h.cache_key(0x7100 + i) for i in range(4)]
    objs = [h.new_chunk(f"rb{i}") for i in range(4)]
    want = [h.data(o) for o in objs]
    rb.submit_put_task(k[0], objs[0]).result(10)
    assert objs[0].get_ref_count() == 1
    assert rb.contains(k[0])
    got = rb.get_blocking(k[0])
    assert got is not None and h.data(got) == want[0]
    got.ref_count_down()
    rb.batched_submit_put_task(k[1:], objs[1:])
    deadline = time.monotonic() + 10  # batched puts have no future: poll
    while rb.batched_contains(k) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rb.batched_contains(k + [h.cache_key(0x7199)]) == 4
    assert aio.run_coroutine_threadsafe(rb.batched_async_contains("l", k), h.loop).result(10) == 4
    res = rb.batched_get_blocking(k)
    assert [h.data(r) for r in res] == want
    for r in res:
        r.ref_count_down()
    assert rb.remove(k[0]) and not rb.contains(k[0])
    for o in objs:
        o.ref_count_down()


#: See test_hicache.SICK_BOUND_MS.
SICK_BOUND_MS = int(os.environ.get("KVCELLAR_SICK_BOUND_MS", "600"))


def test_a_stopped_node_costs_a_call_at_most_its_deadline_and_healthy_chunks_still_hit():
    """One node of three SIGSTOPped: no connector call (batched_put from
    LMCache's event loop, batched_contains as its lookup calls it,
    batched_get) takes more than about its deadline beyond the slowest one
    on the healthy cluster, and every chunk the other nodes own still hits;
    on the healthy cluster, under the same rounds, no chunk is dropped for
    time and every chunk hits (docs/plugins/lmcache.md, "Deadlines"). The
    worst case: no cool-down, so every call that needs the stopped node
    waits for it."""
    from sick import LMCacheDriver, check_stopped_node, sick_cluster, until_clean

    def check(out):
        return check_stopped_node(out, SICK_BOUND_MS, "chunks")

    worst = {"options": "peer_cooldown_ms=0"}
    until_clean(lambda: sick_cluster(lambda c: LMCacheDriver(c, pages=8, extra=worst), rounds=8), check,
                "LMCache connector, 8 chunks of 16 KiB a call")
