"""kvcellar.Client against real kv-server processes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

import kvcellar
from kvcellar import Client, ClosedError, ConfigError, DeniedError, Geometry, Status


def page(key: str, n: int) -> bytes:
    """Content derived from the key, so every byte can be checked."""
    seed = sum(key.encode()) & 0xFF
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


GEO = Geometry(model_hash=7, page_size=16, dtype_tag=2, tp_size=1, layer_num=4, head_num=2, head_dim=64)


def test_version_matches_library():
    assert kvcellar.__version__ == kvcellar.library_version()


def test_round_trips_over_every_buffer_kind(cluster):
    with Client(cluster.members, geometry=GEO) as c:
        data = page("a", 1 << 20)
        assert c.put("a", data) is Status.OK
        buf = bytearray(2 << 20)
        r = c.get("a", buf)
        assert r.status is Status.OK and r.length == len(data) and buf[: r.length] == data
        # memoryview slice (read-only, copied once), and a raw (address, length).
        assert c.put("mv", memoryview(data)[100:4196]) is Status.OK
        raw = (ctypes.c_char * 4096)()
        assert c.get("mv", (ctypes.addressof(raw), 4096)) == (Status.OK, 4096, None)
        assert bytes(raw) == data[100:4196]
        # scatter over segments, gather from segments
        a, b = bytearray(3000), bytearray(2000)
        assert c.putv("v", [data[:3000], data[3000:5000]]) is Status.OK
        assert c.getv("v", [b, a]).status is Status.OK
        assert bytes(b) + bytes(a)[:3000] == data[:5000]
        # too small reports the size; get_bytes sizes itself
        assert c.get("a", bytearray(10)) == (Status.TOO_SMALL, len(data), None)
        assert c.get_bytes("a", size_hint=16).data == data
        assert c.exist("a") is Status.OK and c.exist("absent") is Status.MISS
        assert c.get("absent", buf).status is Status.MISS


def test_batches_and_leading_hits(cluster):
    with Client(cluster.members, geometry=GEO) as c:
        keys = [f"b{i}" for i in range(20)]
        vals = [page(k, 8192 + i) for i, k in enumerate(keys)]
        # a hole at index 7
        st = c.batch_put([k for i, k in enumerate(keys) if i != 7], [v for i, v in enumerate(vals) if i != 7])
        assert st == [Status.OK] * 19
        assert c.leading_hits(keys) == 7
        ex = c.batch_exist(keys)
        assert ex[7] is Status.MISS and ex.count(Status.OK) == 19
        bufs = [bytearray(10000) for _ in keys]
        res = c.batch_get(keys, bufs)
        for i, (r, v) in enumerate(zip(res, vals)):
            if i == 7:
                assert r.status is Status.MISS
            else:
                assert r.ok and r.length == len(v) and bufs[i][: r.length] == v
        # a batch delete: removed where stored, a miss at the hole
        gone = c.batch_delete(keys[5:10])
        assert gone == [Status.OK, Status.OK, Status.MISS, Status.OK, Status.OK]
        assert c.batch_exist(keys[5:10]) == [Status.MISS] * 5
        assert c.leading_hits(keys) == 5
        # raw pointer form: 2 segments per item
        segs = [(ctypes.c_char * 4096)() for _ in range(4)]
        addrs = [ctypes.addressof(s) for s in segs]
        for i, s in enumerate(segs):
            ctypes.memset(s, i + 1, 4096)
        assert c.batch_putv_raw(["r0", "r1"], addrs, [4096] * 4, 2) == [Status.OK, Status.OK]
        for s in segs:
            ctypes.memset(s, 0, 4096)
        got = c.batch_getv_raw(["r0", "r1"], addrs, [4096] * 4, 2)
        assert [g.status for g in got] == [Status.OK, Status.OK] and all(g.length == 8192 for g in got)
        assert [bytes(s)[0] for s in segs] == [1, 2, 3, 4]
        # a count per item: 1 segment, then 3
        assert c.batch_putv_raw(["q0", "q1"], addrs, [4096] * 4, [1, 3]) == [Status.OK, Status.OK]
        got = c.batch_getv_raw(["q0", "q1"], addrs, [4096] * 4, [1, 3])
        assert [g.length for g in got] == [4096, 3 * 4096]
        with pytest.raises(ValueError):
            c.batch_getv_raw(["q0", "q1"], addrs, [4096] * 4, [1, 2])


def test_geometry_is_checked_and_delete(cluster):
    with Client(cluster.members, geometry=GEO) as c:
        assert c.put("g", b"x" * 100) is Status.OK
        with Client(cluster.members, geometry=Geometry(model_hash=8)) as other:
            assert other.get("g", bytearray(100)).status is Status.MISMATCH
            assert other.exist("g") is Status.MISMATCH
        assert c.delete("g") is Status.OK
        assert c.delete("g") is Status.MISS and c.exist("g") is Status.MISS


def test_caller_errors_raise_and_misses_do_not(cluster):
    with Client(cluster.members, geometry=GEO) as c:
        with pytest.raises(ValueError):
            c.put("a\0b", b"x")
        with pytest.raises(ValueError):
            c.put("k" * 1025, b"x")
        with pytest.raises(ValueError):
            c.get("a", b"read-only bytes")
        with pytest.raises(ValueError):
            c.batch_put(["a"], [])
    with pytest.raises(ConfigError, match="unknown option"):
        Client(cluster.members, options="bogus=1")
    with pytest.raises(ConfigError, match="'mds' and 'members'"):
        Client(cluster.members, mds="127.0.0.1:1")
    # A member nobody listens on: a status, not an exception.
    with Client("n1=127.0.0.1:1", options={"connect_timeout_ms": 300}) as c:
        assert c.put("k", b"x") is Status.UNAVAILABLE
        assert "127.0.0.1:1" in c.last_error()


def test_environment_opens_the_client(cluster, clean_env):
    with pytest.raises(ConfigError, match="KVCELLAR_MDS or KVCELLAR_MEMBERS"):
        Client()
    clean_env.setenv("KVCELLAR_MEMBERS", cluster.members)
    clean_env.setenv("KVCELLAR_OPTIONS", "io_timeout_ms=5000")
    with Client(geometry=GEO) as c:
        assert c.put("env", b"e" * 10) is Status.OK
        assert c.settings.options == {"io_timeout_ms": "5000"}
    clean_env.setenv("KVCELLAR_MDS", "127.0.0.1:7480")
    with pytest.raises(ConfigError, match="KVCELLAR_MDS and KVCELLAR_MEMBERS are both set"):
        Client()
    # An explicit choice wins over the environment's.
    with Client(cluster.members) as c:
        assert c.settings.mds is None


def test_a_refused_token_raises_at_construction(token_node, clean_env):
    # The right token, as an argument or from the environment.
    with Client(token_node.members, geometry=GEO, auth_token_file=token_node.token_file) as c:
        assert c.put("tok", b"t" * 100) is Status.OK
        assert c.settings.auth_token_file == token_node.token_file
    clean_env.setenv("KVCELLAR_AUTH_TOKEN_FILE", token_node.token_file)
    with Client(token_node.members, geometry=GEO) as c:
        assert c.exist("tok") is Status.OK
    clean_env.delenv("KVCELLAR_AUTH_TOKEN_FILE")
    # No token, or a wrong one: DeniedError now, not misses later.
    with pytest.raises(DeniedError, match="auth token"):
        Client(token_node.members, geometry=GEO)
    with pytest.raises(DeniedError, match="auth token"):
        Client(token_node.members, geometry=GEO, auth_token_file=token_node.wrong_file)
    with pytest.raises(ConfigError, match="no token file"):
        Client(token_node.members, auth_token_file="/nonexistent/token")


def test_close_while_threads_are_inside_calls(cluster):
    c = Client(cluster.members, geometry=GEO)
    data = page("c", 1 << 20)
    for i in range(8):
        assert c.put(f"c{i}", data) is Status.OK
    stop = threading.Event()
    errors, outcomes = [], {"ok": 0, "closed": 0}

    def worker(i):
        buf = bytearray(1 << 20)
        while not stop.is_set():
            try:
                r = c.get(f"c{i % 8}", buf)
                assert r.status is Status.OK and buf == data
                outcomes["ok"] += 1
            except ClosedError:
                outcomes["closed"] += 1
                return
            except Exception as e:  # noqa: BLE001 - any other error fails the test
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while outcomes["ok"] < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    c.close()
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert outcomes["ok"] >= 30 and outcomes["closed"] >= 1
    with pytest.raises(ClosedError):
        c.exist("c0")
    c.close()  # twice: a no-op


def test_imports_without_engines_and_names_a_missing_library(tmp_path):
    code = (
        "import sys, kvcellar, kvcellar.hicache, kvcellar.lmcache\n"
        "assert 'torch' not in sys.modules and 'sglang' not in sys.modules and 'lmcache' not in sys.modules, "
        "[m for m in ('torch','sglang','lmcache') if m in sys.modules]\n"
        "print('imported')\n"
    )
    env = dict(os.environ, KVCELLAR_FORCE_STANDIN="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr
    missing = str(tmp_path / "nope.so")
    code = "import kvcellar\ntry:\n    kvcellar.Client('n1=127.0.0.1:1')\nexcept kvcellar.LibraryError as e:\n    print('ERR', e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KVCELLAR_LIB=missing),
                         capture_output=True, text=True)
    assert "ERR cannot load libkvclient" in out.stdout and missing in out.stdout, out.stdout + out.stderr
    # A library without this version's functions (here: the C library).
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KVCELLAR_LIB="libc.so.6"),
                         capture_output=True, text=True)
    assert "lacks kv_open" in out.stdout and "kv_delete" in out.stdout, out.stdout + out.stderr


def test_members_by_name_are_resolved_per_connection(cluster):
    """A member given by name (here from /etc/hosts, no DNS) is resolved
    when a connection opens, not when the list is parsed."""
    by_name = ",".join(f"{n.name}=localhost:{n.addr.rsplit(':', 1)[1]}" for n in cluster.nodes)
    with Client(by_name, geometry=GEO) as c:
        assert c.put("by-name", b"n" * 1000) is Status.OK
        assert c.get_bytes("by-name").data == b"n" * 1000
    with Client(cluster.members, geometry=GEO) as c:
        assert c.exist("by-name") is Status.OK, "the same ring, by name or by address"


def test_rdma_options_fall_back_to_tcp_and_say_why(cluster):
    """rdma_devices names a device this machine does not have: the client
    serves over TCP, counts one fallback, and registering a pool is a
    checked no-op."""
    with Client(cluster.members, geometry=GEO, options="rdma_devices=mlx5_0,rdma_depth=16") as c:
        pool = bytearray(4 << 20)
        assert c.register_memory(pool) is Status.OK
        data = page("r", 1 << 20)
        assert c.put("r", data) is Status.OK
        r = c.get("r", pool)
        assert r.status is Status.OK and pool[: r.length] == data
        assert c.unregister_memory(pool) is Status.OK
        counters = c.counters()
        assert counters.get("kvclient_rdma_fallbacks_total") == 1, counters
        assert counters.get("kvclient_rdma_completions_total") == 0
    with pytest.raises(ConfigError):
        Client(cluster.members, geometry=GEO, options="rdma_devices=mlx5_0;mlx5_1")


def test_rdma_fallback_is_one_line_per_handle(cluster):
    """The line saying why RDMA is not used comes once per client, even with
    a static member list (whose token probe uses a handle of its own)."""
    code = (
        "import kvcellar, sys\n"
        "c = kvcellar.Client(sys.argv[1], geometry=kvcellar.Geometry(model_hash=1), options='rdma_devices=mlx5_0')\n"
        "assert c.put('k', b'v' * 100) is kvcellar.Status.OK\n"
        "c.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", code, cluster.members], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if "RDMA" in l]
    assert len(lines) == 1 and "using TCP" in lines[0], r.stderr


def test_a_call_timeout_bounds_a_batch_on_a_stopped_node_and_never_serves_bytes_changed_after_it():
    """One node of three SIGSTOPped: a bounded batch put returns in about
    its bound, healthy owners' items stored, the stopped owner's TIMEOUT;
    the next call skips the cooling node at once. Buffers changed after the
    call returned are never what is stored, and never served."""
    from conftest import Cluster, stalled

    cluster = Cluster(3)
    try:
        keys = [f"ct-{i}" for i in range(24)]
        n = 256 << 10
        bufs = [bytearray(page(k, n)) for k in keys]
        orig = [bytes(b) for b in bufs]
        # A long cool-down so the second call surely meets it.
        with Client(cluster.members, geometry=GEO, options="peer_cooldown_ms=5000") as c:
            with stalled(cluster.nodes[1]):
                t0 = time.monotonic()
                with c.call_timeout(300):
                    st = c.batch_put(keys, bufs)
                took = time.monotonic() - t0
                # What the engine does once the call returned: reuse the memory.
                for b in bufs:
                    b[:] = b"\xee" * len(b)
                assert took < 1.5, f"a 300 ms call took {took:.3f} s"
                assert st.count(Status.OK) > 0 and Status.TIMEOUT in st, st
                stopped = [k for k, s in zip(keys, st) if s is Status.TIMEOUT]
                assert all(s in (Status.OK, Status.TIMEOUT) for s in st), st
                # The stopped node cools down: a second call does not wait for it.
                t0 = time.monotonic()
                with c.call_timeout(300):
                    st2 = c.batch_exist(keys)
                    gets = c.batch_get(keys, [bytearray(n) for _ in keys])
                assert time.monotonic() - t0 < 1.0
                assert [s for k, s in zip(keys, st2) if k in stopped] == [Status.UNAVAILABLE] * len(stopped)
                assert all(g.status is Status.OK for k, g in zip(keys, gets) if k not in stopped)
                # Outside the block the thread is unbounded again.
                assert c._lib.kv_set_call_timeout_ms(0) == 0
        # Resumed: whatever the stopped node stored is the bytes of the
        # time of the call, never those written after it returned.
        with Client(cluster.members, geometry=GEO) as c:
            for k, want in zip(keys, orig):
                buf = bytearray(n)
                r = c.get(k, buf)
                assert r.status in (Status.OK, Status.MISS), (k, r)
                if r.status is Status.OK:
                    assert bytes(buf[: r.length]) == want, f"{k}: served bytes changed after the call"
    finally:
        cluster.stop()
