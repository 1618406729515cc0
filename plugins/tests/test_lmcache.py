"""kvcellar.lmcache against real kv-server processes (LMCache's own plugin
loading and backends where LMCache is installed, stand-ins otherwise)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from kvcellar.config import ConfigError
from lmc import CHUNK, make_harness, real_lmcache


@pytest.fixture()
def h(cluster):
    hh = make_harness({"members": cluster.members, "io_timeout_ms": 3000, "connect_timeout_ms": 500})
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
    hh = make_harness({"members": cluster.members}, save_chunk_meta=meta)
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


def test_a_hung_node_is_bounded_by_the_timeout(cluster):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts, never answers
    addr = "%s:%d" % silent.getsockname()
    hh = make_harness({"members": f"hung={addr}", "io_timeout_ms": 500, "connect_timeout_ms": 300})
    try:
        c = hh.connector
        t = time.monotonic()
        assert hh.run(c.exists(hh.key(1))) is False
        assert hh.run(c.batched_async_contains("x", [hh.key(2), hh.key(3)])) == 0
        assert hh.run(c.get(hh.key(4))) is None
        assert time.monotonic() - t < 6, "each call ends within its timeout"
        assert hh.live_objects() == 0, "a failed get releases its memory object"
    finally:
        hh.close()
        silent.close()


def test_calls_that_outlive_their_bound_release_what_they_hold(cluster):
    """The connector's own bound (shorter here than the library's I/O
    timeout): the await gives up, and when the library call ends the get's
    memory object is released and the put's reference returned."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    addr = "%s:%d" % silent.getsockname()
    hh = make_harness({"members": f"hung={addr}", "io_timeout_ms": 1500, "connect_timeout_ms": 300})
    try:
        c = hh.connector
        c.timeout_s = 0.2
        before = hh.live_objects()
        t = time.monotonic()
        assert hh.run(c.get(hh.key(5))) is None
        obj = hh.new_chunk("held")
        hh.run(c.put(hh.key(6), obj))
        assert time.monotonic() - t < 1.4, "both gave up at the connector's bound"
        assert obj.get_ref_count() == 2, "the running put holds a reference"
        deadline = time.monotonic() + 10
        while (hh.live_objects() > before + 1 or obj.get_ref_count() != 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert obj.get_ref_count() == 1 and hh.live_objects() == before + 1, "released once the calls ended"
    finally:
        hh.close()
        silent.close()


def test_a_killed_node_gives_misses_not_exceptions():
    from conftest import Cluster

    cl = Cluster(2)
    hh = make_harness({"members": cl.members, "io_timeout_ms": 2000, "connect_timeout_ms": 300})
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


def test_a_refused_token_fails_at_construction(token_node, clean_env):
    from kvcellar import DeniedError

    with pytest.raises(DeniedError, match="auth token"):
        make_harness({"members": token_node.members}).close()
    h = make_harness({"members": token_node.members, "auth_token_file": token_node.token_file})
    h.close()


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
        a = make_harness({"members": cluster.members})
    finally:
        lg.removeHandler(lines)
        lg.setLevel(old)
    try:
        assert any("kvcellar LMCache connector ready" in ln for ln in lines.lines), lines.lines
        key = a.key(0x4242)
        a.run(a.connector.put(key, a.new_chunk("g")))
        b = make_harness({"members": cluster.members}, save_chunk_meta=False)
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
