"""kvcellar.vllm against vLLM 0.33's REAL classes on CPU (vllm_engine.py
says what is real and what is stood in), with real kv-server nodes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test-engines.sh vllm runs these)")

from vllm_engine import Engine, model_dir, vllm_config  # noqa: E402

from kvcellar import Client, Status  # noqa: E402
from kvcellar.config import ConfigError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT = 256  # tokens per unit by default (16 blocks of 16)


@pytest.fixture(scope="module")
def models():
    with tempfile.TemporaryDirectory(prefix="kvcellar-vllm-") as d:
        yield d


def prompt(seed: int, n: int, shared: int = 0):
    """n tokens: the first ``shared`` common to every seed."""
    return [7 + (i % 50) for i in range(shared)] + [(seed * 131 + i * 17) % 900 + 1 for i in range(n - shared)]


def engine(models, members, **kw):
    extra = {"members": members, **kw.pop("extra", {})}
    mk = {k: kw.pop(k) for k in ("layers", "kv_heads", "head_dim", "name", "weights") if k in kw}
    return Engine(vllm_config(model_dir(models, **mk), extra, **kw))


@contextlib.contextmanager
def pair(models, members, **kw):
    """A writer and a reader instance of one identity, closed after."""
    made = []
    try:
        for _ in range(2):
            made.append(engine(models, members, **kw))
        yield tuple(made)
    finally:
        for e in made:
            e.close()


def lookup(e: Engine, tokens, timeout_s: float = 10.0) -> int:
    """The scheduler connector's final answer for a fresh request."""
    import time

    req = e.request(tokens)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        n, is_async = e.conn.get_num_new_matched_tokens(req, 0)
        if n is not None:
            assert is_async == (n > 0)
            return n
        time.sleep(0.005)
    raise TimeoutError("no answer")


def test_factory_round_trip_byte_for_byte(cluster, models):
    from kvcellar.vllm import KVCellarConnector

    with pair(models, cluster.members) as (w, r):
        assert isinstance(w.conn, KVCellarConnector) and isinstance(w.worker, KVCellarConnector)
        p = prompt(1, 2 * UNIT + 100)
        w.serve([p])
        assert w.worker.counters()["save_units"] == 2
        # The other instance: "not ready" first, then two whole units, loaded
        # asynchronously, every byte as the writer computed it.
        req = r.request(p)
        first = r.conn.get_num_new_matched_tokens(req, 0)
        assert first == (None, False)
        r.add(req)
        r.run()
        assert r.loaded[req.request_id] == 2 * UNIT
        assert r.checked[req.request_id] is True
        assert r.worker.counters()["load_units"] == 2
        assert r.worker.counters()["load_failed_units"] == 0
        assert req.request_id in r.finished
        # Already stored: the reader does not write the hit units again.
        assert r.worker.counters()["save_units"] == 0


def test_leading_whole_units_only(cluster, models):
    with pair(models, cluster.members) as (w, r):
        w.serve([prompt(2, 3 * UNIT)])
        assert lookup(r, prompt(2, 3 * UNIT) + [5] * 40) == 3 * UNIT
        # A prefix of 300 common tokens: one whole unit, not 300.
        assert lookup(r, prompt(2, UNIT + 44) + prompt(99, 400)) == UNIT
        # Shorter than a unit: nothing.
        assert lookup(r, prompt(2, UNIT - 1)) == 0
        # A different first token: no unit.
        assert lookup(r, [3] + prompt(2, 3 * UNIT)[1:]) == 0


def test_another_model_block_size_or_split_misses(cluster, models):
    w = engine(models, cluster.members)
    p = prompt(3, 2 * UNIT + 1)
    try:
        w.serve([p])
        others = [
            engine(models, cluster.members),  # control: the same identity hits
            engine(models, cluster.members, layers=4),
            engine(models, cluster.members, kv_heads=4),
            engine(models, cluster.members, name="other-model"),
            engine(models, cluster.members, block_size=32),
            engine(models, cluster.members, tp=2),
            engine(models, cluster.members, layout="LBHNC"),
            engine(models, cluster.members, extra={"blocks_per_unit": 8}),
            engine(models, cluster.members, extra={"tenant": "team-b"}),
        ]
        try:
            got = [lookup(e, p) for e in others]
        finally:
            for e in others:
                e.close()
        assert got == [2 * UNIT] + [0] * 8
    finally:
        w.close()


def test_many_requests_in_flight(cluster, models):
    with pair(models, cluster.members) as (w, r):
        shared = 2 * UNIT
        prompts = [prompt(100 + i, shared + 50 + i * 7, shared=shared) for i in range(24)]
        w.serve(prompts[:1])
        reqs = r.serve(prompts)
        assert sorted(r.finished) == sorted(q.request_id for q in reqs)
        hits = [r.loaded.get(q.request_id, 0) for q in reqs]
        # Every request that did not find the prefix in vLLM's own cache
        # loaded it from kvcellar; every load is byte for byte.
        assert sum(1 for h in hits if h == shared) >= 1
        assert all(r.checked.values()), r.checked
        assert r.worker.counters()["load_failed_units"] == 0


def test_host_staging_path_round_trips(cluster, models):
    w = engine(models, cluster.members, extra={"host_staging": "always"})
    r = engine(models, cluster.members)  # zero copy: the same bytes either way
    r2 = engine(models, cluster.members, extra={"host_staging": "always"})
    try:
        p = prompt(4, 2 * UNIT + 3)
        w.serve([p])
        for e in (r, r2):
            req = e.serve([p])[0]
            assert e.loaded[req.request_id] == 2 * UNIT and e.checked[req.request_id]
    finally:
        for e in (w, r, r2):
            e.close()


def test_a_killed_node_gives_misses_and_recomputes(models):
    from conftest import Cluster

    c = Cluster(3)
    w = r = None
    try:
        w = engine(models, c.members, extra={"io_timeout_ms": 2000, "connect_timeout_ms": 500})
        r = engine(models, c.members, extra={"io_timeout_ms": 2000, "connect_timeout_ms": 500})
        p = prompt(5, 6 * UNIT)
        w.serve([p])
        req = r.add(r.request(p))
        planned = []

        def kill_before_the_load(out):
            # The scheduler planned the load: two nodes die before the worker runs it.
            if out.kv_connector_metadata.loads and not planned:
                planned.append(sum(len(t.keys) for t in out.kv_connector_metadata.loads))
                c.nodes[0].kill()
                c.nodes[1].kill()

        for _ in range(2000):
            if planned:
                break
            r.step(kill_before_the_load)
        assert planned == [6], "the lookup did not hit every unit"
        r.run()
        assert req.request_id in r.finished  # recomputed, not failed
        cnt = r.worker.counters()
        assert cnt["load_failed_units"] > 0
        # Later lookups see only what the live node holds.
        assert lookup(r, p) < 6 * UNIT
    finally:
        for e in (w, r):
            if e is not None:
                e.close()
        c.stop()


def test_cluster_down_is_a_miss_not_a_failure(models):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    e = engine(models, f"gone=127.0.0.1:{port}", extra={"connect_timeout_ms": 300})
    try:
        req = e.serve([prompt(6, 2 * UNIT)])[0]
        assert req.request_id in e.finished
        cnt = e.worker.counters()
        assert cnt["save_failed_units"] == 2 and cnt["save_units"] == 0
        assert e.conn.counters()["lookups"] == 1
    finally:
        e.close()


def test_events_report_stored_units(cluster, models):
    e = engine(models, cluster.members, events=True)
    taken = []
    take = e.conn.take_events

    def spy():  # the scheduler takes them every step and publishes them
        ev = list(take())
        taken.extend(ev)
        return ev

    e.conn.take_events = spy
    try:
        p = prompt(7, 2 * UNIT + 5)
        req = e.serve([p])[0]
        stored = [x for x in taken if type(x).__name__ == "BlockStored"]
        assert len(stored) == 2 and all(x.block_size == UNIT for x in stored)
        assert [x.block_hashes[0] for x in stored] == [req.block_hashes[15], req.block_hashes[31]]
    finally:
        e.close()


def _scheduler_connector(vc):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_engine import kv_cache_config

    return KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER,
                                               kv_cache_config=kv_cache_config(vc))


def test_decline_and_refuse(cluster, models, monkeypatch):
    # A random per-process hash seed: refused at construction.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        _scheduler_connector(vllm_config(model_dir(models), {"members": cluster.members}, hash_algo="xxhash"))
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    _scheduler_connector(vllm_config(model_dir(models), {"members": cluster.members}, hash_algo="xxhash")).shutdown()
    # Bad keys name themselves.
    with pytest.raises(ConfigError, match="blocks_per_unit"):
        engine(models, cluster.members, extra={"blocks_per_unit": 0})
    with pytest.raises(ConfigError, match="host_staging"):
        engine(models, cluster.members, extra={"host_staging": "sometimes"})


def test_an_unreadable_parallel_state_refuses_to_start(cluster, models):
    """Under TP 2 a worker that cannot tell its rank would store one rank's
    KV under another rank's key: its start fails, in one line."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm_engine import kv_cache_config, parallel_state

    def start(vc):
        kc = kv_cache_config(vc)
        w = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kc)
        try:
            w.register_kv_caches(allocate_kv_cache(kc, torch.device("cpu"), KVCacheLayout[kc.kv_cache_layout]))
            return w.tp_rank
        finally:
            w.shutdown()

    vc = lambda tp: vllm_config(model_dir(models), {"members": cluster.members}, tp=tp)  # noqa: E731
    broken = [
        contextlib.nullcontext(),  # vLLM's parallel state never set up
        parallel_state(1, 2, pp_size=0),  # half set up (no PP group)
        parallel_state(0, 1),  # a TP group of another size than the config's
        parallel_state(2, 2),  # a rank outside the group
    ]
    for ctx in broken:
        with ctx, pytest.raises(RuntimeError, match="parallel state") as e:
            start(vc(2))
        assert "\n" not in str(e.value) and "tensor_parallel_size" in str(e.value), e.value
    with parallel_state(1, 2):
        assert start(vc(2)) == 1
    assert start(vc(1)) == 0  # one process, no parallel state: rank 0 is certain
    _scheduler_connector(vc(2)).shutdown()  # the scheduler needs no rank


def test_hybrid_models_are_declined(cluster, models):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    vc = vllm_config(model_dir(models), {"members": cluster.members})
    kc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)),
        KVCacheGroupSpec(["b"], SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32,
                                                  dtype=torch.float16, sliding_window=64)),
    ])
    c = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kc)
    try:
        assert c.active is False
        e = Engine(vllm_config(model_dir(models), {"members": cluster.members}))
        try:
            req = e.request(prompt(8, 600))
        finally:
            e.close()
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        c.shutdown()


def test_load_failure_policy_becomes_recompute(cluster, models):
    e = engine(models, cluster.members)
    try:
        assert e.vc.kv_transfer_config.kv_load_failure_policy == "recompute"
        assert e.sched.recompute_kv_load_failures is True
    finally:
        e.close()


SEED_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from vllm_engine import Engine, model_dir, vllm_config
import time
mode, members, root = sys.argv[2], sys.argv[3], sys.argv[4]
e = Engine(vllm_config(model_dir(root), {"members": members}))
p = [(i * 37) % 900 + 1 for i in range(600)]
if mode == "write":
    e.serve([p])
    print("saved", e.worker.counters()["save_units"])
else:
    req = e.request(p)
    end = time.monotonic() + 20
    while True:
        n, _ = e.conn.get_num_new_matched_tokens(req, 0)
        if n is not None or time.monotonic() > end:
            break
        time.sleep(0.005)
    print("hit", n)
e.close()
"""


def _seeded(mode: str, seed: str, members: str, root: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", SEED_SCRIPT, HERE, mode, members, root], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_processes_share_hits_only_with_the_same_hash_seed(cluster, models):
    assert _seeded("write", "1234", cluster.members, models) == "saved 2"
    assert _seeded("read", "1234", cluster.members, models) == "hit 512"
    assert _seeded("read", "4321", cluster.members, models) == "hit 0"


def test_client_sees_the_connector_pages(cluster, models):
    """The keys are documented: an operator can find a unit with kvctl."""
    e = engine(models, cluster.members)
    try:
        p = prompt(9, UNIT)
        req = e.serve([p])[0]
        key = f"{bytes(req.block_hashes[15]).hex()}.{e.conn.tag}"
        from kvcellar import Geometry

        with Client(cluster.members, geometry=Geometry(**{
            f: getattr(e.conn.geometry, f) for f in
            ("model_hash", "page_size", "dtype_tag", "layer_num", "head_num", "head_dim")})) as c:
            assert c.exist(key).ok
            assert c.get_bytes(key).length == e.worker.unit_bytes()
    finally:
        e.close()


def test_tensor_parallel_shards_each_rank_its_own_page(cluster, models):
    """MHA under TP 2: one page per unit per rank; a hit needs both."""
    with pair(models, cluster.members, tp=2) as (w, r):
        p = prompt(10, 2 * UNIT + 9)
        w.serve([p])
        assert [x.counters()["save_units"] for x in w.workers] == [2, 2]
        req = r.serve([p])[0]
        assert r.loaded[req.request_id] == 2 * UNIT and r.checked[req.request_id]
        assert [x.counters()["load_units"] for x in r.workers] == [2, 2]
        # One rank's page gone: the unit is not a hit.
        key = f"{bytes(req.block_hashes[31]).hex()}.{r.conn.tag}.tp1-2"
        with Client(cluster.members) as c:
            assert c.delete(key).ok
        assert lookup(r, p) == UNIT


def test_mla_pages_written_by_rank_zero_read_by_every_rank(cluster, models):
    from vllm_engine import Engine as E
    from vllm_engine import mla_model_dir

    vc = lambda: vllm_config(mla_model_dir(models), {"members": cluster.members}, tp=2)  # noqa: E731
    w, r, one = E(vc()), E(vc()), E(vllm_config(mla_model_dir(models), {"members": cluster.members}))
    try:
        assert w.conn.mla and w.conn.geometry.mla
        p = prompt(11, 2 * UNIT + 1)
        w.serve([p])
        assert [x.counters()["save_units"] for x in w.workers] == [2, 0]  # the writer-rank rule
        req = r.serve([p])[0]
        assert r.loaded[req.request_id] == 2 * UNIT and r.checked[req.request_id]
        assert [x.counters()["load_units"] for x in r.workers] == [2, 2]
        # The latent is alike on every rank: a TP-1 instance reads the TP-2 pages.
        req = one.serve([p])[0]
        assert one.loaded[req.request_id] == 2 * UNIT and one.checked[req.request_id]
    finally:
        for e in (w, r, one):
            e.close()


def _scramble(e: Engine, seed: int) -> None:
    """Unrelated requests first, so the blocks a later request gets are not
    consecutive (vLLM hands out freed blocks from the back of its queue)."""
    e.serve([prompt(seed + i, 16 * (3 + (i * 5) % 7)) for i in range(6)])


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_layout_round_trips_multi_unit_batches(cluster, models, layout):
    with pair(models, cluster.members, layout=layout) as (w, r):
        _scramble(w, 200)
        _scramble(r, 300)
        p = prompt(12, 4 * UNIT + 30)
        w.serve([p])
        assert w.worker.counters()["save_units"] == 4
        req = r.serve([p])[0]
        assert r.loaded[req.request_id] == 4 * UNIT
        assert r.checked[req.request_id] is True
        assert r.worker.counters()["load_failed_units"] == 0


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_block_splits_share_pages(cluster, models, layout):
    """A backend with 8-token kernel blocks (each vLLM block two of them)
    stores the bytes an unsplit one does, in the same order, both ways,
    zero copy and staged."""
    vc = lambda **kw: vllm_config(model_dir(models), {"members": cluster.members, **kw}, layout=layout)  # noqa: E731
    plain = Engine(vc())
    split = Engine(vc(), kernel_block_size=8)
    staged = Engine(vc(host_staging="always"), kernel_block_size=8)
    try:
        assert split.layers[0].shape[0] == 2 * split.kc.num_blocks
        p1, p2 = prompt(13, 2 * UNIT + 4), prompt(14, 2 * UNIT + 4)
        plain.serve([p1])
        split.serve([p2])
        for reader, p in ((split, p1), (plain, p2), (staged, p1), (staged, p2)):
            _scramble(reader, 400 + len(reader.finished))
            req = reader.serve([p])[0]
            assert reader.loaded[req.request_id] == 2 * UNIT and reader.checked[req.request_id], (reader, p is p1)
    finally:
        for e in (plain, split, staged):
            e.close()


@pytest.mark.parametrize("staging", ["auto", "always"])
def test_a_load_from_inside_a_unit_brings_the_rest(cluster, models, staging):
    """vLLM's own prefix cache holds 1.5 units of the prompt: the load starts
    in the middle of a unit, its first blocks skipped (their bytes read
    into scratch, every layer's apart), and brings the rest, every byte."""
    with pair(models, cluster.members, extra={"host_staging": staging}) as (w, r):
        p = prompt(24, 3 * UNIT + 5)
        w.serve([p])
        _scramble(r, 500)
        r.serve([p[: UNIT + UNIT // 2] + prompt(25, 40)])  # 1.5 units of p, computed (and cached) here
        before = r.worker.counters()
        req = r.add(r.request(p))
        planned = []

        def spy(out):
            for t in out.kv_connector_metadata.loads:
                planned.append([sum(1 for b in blocks if b < 0) for blocks in t.blocks])

        while r.sched.has_unfinished_requests():
            r.step(spy)
        assert planned == [[UNIT // 32, 0]], planned  # half of unit 1 skipped, unit 2 whole
        assert r.loaded[req.request_id] == 3 * UNIT and r.checked[req.request_id] is True
        cnt = r.worker.counters()
        assert cnt["load_units"] - before["load_units"] == 2
        assert cnt["load_failed_units"] == before["load_failed_units"]


def test_units_in_vllms_own_cache_are_not_saved_again(cluster, models):
    e = engine(models, cluster.members)
    try:
        p = prompt(15, 2 * UNIT + 10)
        e.serve([p])
        assert e.worker.counters()["save_units"] == 2
        e.serve([p, p + [1] * UNIT])  # a local prefix hit, then one new unit
        assert e.worker.counters()["save_units"] == 3
    finally:
        e.close()


def test_a_hung_store_sheds_lookups_and_saves_nothing(models):
    """A node that accepts and never answers: lookups time out into misses,
    requests are served, and nothing piles up behind it."""
    import socket

    from kvcellar import _vllm_scheduler as kv

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    e = engine(models, f"hung=127.0.0.1:{hung.getsockname()[1]}",
               extra={"lookup_timeout_ms": 100, "io_timeout_ms": 1500, "connect_timeout_ms": 500})
    try:
        import time

        reqs = e.serve([prompt(16 + i, 2 * UNIT) for i in range(kv.MAX_LOOKUPS + 8)], until_s=120)
        assert all(q.request_id in e.finished for q in reqs)
        cnt = e.conn.counters()
        # Lookups wait out lookup_timeout_ms, or miss at once once the client
        # cools the node down (how many of each depends on the machine's
        # pace); either way no request is held and none hits.
        assert cnt["lookups"] + cnt["lookups_shed"] >= len(reqs), cnt
        assert e.worker.counters()["save_units"] == 0
        assert sum(e.loaded.values()) == 0
        end = time.monotonic() + 30
        while e.conn._inflight and time.monotonic() < end:
            time.sleep(0.05)
        assert e.conn._inflight == 0  # nothing left queued behind the hung node
    finally:
        e.close()
        hung.close()


def test_staging_moves_long_prompts_in_bounded_chunks(cluster, models, monkeypatch):
    from kvcellar import _vllm_layout as kv

    with pair(models, cluster.members, extra={"host_staging": "always"}) as (w, r):
        monkeypatch.setattr(kv, "STAGE_BYTES", 2 * w.worker.unit_bytes())  # 2 units at a time
        assert w.worker._stage_chunks(5) == [(0, 2), (2, 4), (4, 5)]
        p = prompt(17, 5 * UNIT + 1)
        w.serve([p])
        assert w.worker.counters()["save_units"] == 5
        req = r.serve([p])[0]
        assert r.loaded[req.request_id] == 5 * UNIT and r.checked[req.request_id]


def test_a_unit_evicted_after_the_lookup_is_recomputed_and_saved_again(cluster, models):
    with pair(models, cluster.members) as (w, r):
        p = prompt(18, 3 * UNIT + 2)
        req0 = w.serve([p])[0]
        key = f"{bytes(req0.block_hashes[2 * 16 - 1]).hex()}.{w.conn.tag}"
        req = r.add(r.request(p))
        gone = []

        def evict_before_the_load(out):
            if out.kv_connector_metadata.loads and not gone:
                with Client(cluster.members) as c:
                    gone.append(c.delete(key).ok)

        for _ in range(2000):
            if gone:
                break
            r.step(evict_before_the_load)
        assert gone == [True]
        r.run()
        assert req.request_id in r.finished
        assert r.worker.counters()["load_failed_units"] == 1
        assert r.worker.counters()["save_units"] == 1  # the evicted unit, recomputed, is stored again
        assert lookup(r, p) == 3 * UNIT


# -- the weights and what vLLM does to them are part of the page identity -------------------


def test_a_fine_tune_under_the_same_name_misses(cluster, models):
    """Two checkpoints, a few bytes of one tensor apart, served under one
    name: the reader of the other one computes, it never loads the writer's KV."""
    served = {"served_model_name": "team/tiny"}
    base = engine(models, cluster.members, name="base", **served)
    tuned = engine(models, cluster.members, name="tuned", weights=3, **served)
    twin = engine(models, cluster.members, name="twin", **served)  # the base weights at another path
    try:
        assert base.conn.model == tuned.conn.model == twin.conn.model == "team/tiny"
        p = prompt(20, 2 * UNIT + 7)
        base.serve([p])
        assert base.worker.counters()["save_units"] == 2
        assert lookup(tuned, p) == 0
        assert lookup(twin, p) == 2 * UNIT  # the same weights anywhere share
        req = tuned.serve([p])[0]
        assert tuned.loaded.get(req.request_id, 0) == 0 and tuned.worker.counters()["save_units"] == 2
    finally:
        for e in (base, tuned, twin):
            e.close()


def test_another_quantization_rope_or_override_misses(cluster, models):
    """The same weights with vLLM's online FP8 quantization (``--quantization
    fp8``, ModelConfig's own validation on CPU), or with RoPE scaled through
    ``--hf-overrides``, compute other KV: each misses the plain instance's pages."""
    w = engine(models, cluster.members)
    p = prompt(21, 2 * UNIT + 3)
    try:
        w.serve([p])
        others = [
            engine(models, cluster.members),  # control
            engine(models, cluster.members, quantization="fp8"),
            engine(models, cluster.members, hf_overrides={
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
            engine(models, cluster.members, hf_overrides={"rms_norm_eps": 1e-5}),
        ]
        try:
            assert others[1].vc.model_config.quantization == "fp8"
            got = [lookup(e, p) for e in others]
        finally:
            for e in others:
                e.close()
        assert got == [2 * UNIT, 0, 0, 0]
    finally:
        w.close()


def test_every_role_and_rank_names_the_weights_alike(cluster, models):
    """The scheduler loads no weights and each TP rank another shard: the
    tag comes from the configuration and the checkpoint files, the same for all."""
    a = engine(models, cluster.members, tp=2)
    b = engine(models, cluster.members, tp=2, name="other-weights", weights=1,
               served_model_name=a.vc.model_config.served_model_name)
    try:
        for e in (a, b):
            tags = {e.conn.tag} | {x.tag for x in e.workers}
            assert len(tags) == 1, tags
            assert e.conn.identity["weights"] == e.workers[1].identity["weights"]
        assert a.conn.model == b.conn.model and a.conn.tag != b.conn.tag
    finally:
        a.close()
        b.close()


def test_model_fingerprint_overrides_the_computed_one(cluster, models):
    named = {"extra": {"model_fingerprint": "ckpt-2024-06"}, "served_model_name": "team/named"}
    w = engine(models, cluster.members, name="named-a", **named)
    r = engine(models, cluster.members, name="named-b", weights=5, **named)  # other files, one name given
    other = engine(models, cluster.members, name="named-a", extra={"model_fingerprint": "ckpt-2024-07"},
                   served_model_name="team/named")
    try:
        p = prompt(22, 2 * UNIT)
        w.serve([p])
        assert lookup(r, p) == 2 * UNIT
        assert lookup(other, p) == 0
    finally:
        for e in (w, r, other):
            e.close()


def test_weights_that_cannot_be_named_refuse_to_start(cluster, models):
    from kvcellar.fingerprint import FingerprintError

    bare = model_dir(models, name="no-weights", weights=None)
    with pytest.raises(FingerprintError, match="model_fingerprint"):
        _scheduler_connector(vllm_config(bare, {"members": cluster.members}))
    _scheduler_connector(vllm_config(bare, {"members": cluster.members, "model_fingerprint": "x"})).shutdown()
    with pytest.raises(ConfigError, match="model_fingerprint"):
        _scheduler_connector(vllm_config(bare, {"members": cluster.members, "model_fingerprint": " "}))


def test_dummy_weights_share_only_with_dummy_weights(cluster, models):
    """``--load-format dummy``: vLLM makes the weights up; no file is read,
    and no page is shared with an instance of real weights."""
    real = engine(models, cluster.members)
    d1 = Engine(vllm_config(model_dir(models, name="dummy", weights=None), {"members": cluster.members},
                            load_format="dummy", served_model_name=real.vc.model_config.served_model_name))
    d2 = engine(models, cluster.members, load_format="dummy")  # the same config, weights present but unread
    try:
        p = prompt(23, 2 * UNIT)
        real.serve([p])
        assert lookup(d1, p) == 0
        d1.serve([p])
        assert d1.worker.counters()["save_units"] == 2
        # Dummy instances of one configuration share (benchmarks of the cache).
        assert d2.conn.model == d1.conn.model and lookup(d2, p) == 2 * UNIT
    finally:
        for e in (real, d1, d2):
            e.close()


# -- a sick node costs a step a bounded time ---------------------------------------------------


def _unit_keys(e: Engine, reqs, tenant: str = ""):
    """Every whole unit's key of the requests, as the connector names them."""
    return [f"{tenant}{bytes(q.block_hashes[(u + 1) * 16 - 1]).hex()}.{e.conn.tag}"
            for q in reqs for u in range(len(q.prompt_token_ids) // UNIT)]


def _geometry(e: Engine):
    from kvcellar import Geometry

    return Geometry(**{f: getattr(e.conn.geometry, f) for f in
                       ("model_hash", "page_size", "dtype_tag", "layer_num", "head_num", "head_dim")})


def test_blocks_reused_after_a_timed_out_save_are_never_served(models):
    """One node SIGSTOPped just before the saves: the saves meeting it are
    cut at save_timeout_ms and dropped; the step then overwrites the blocks
    (as vLLM reuses them). Resumed, no key is ever served with the new
    bytes: each is a miss or the bytes of the time of the save."""
    from conftest import Cluster, stalled

    c = Cluster(3)
    made = []
    try:
        w = engine(models, c.members)
        made.append(w)
        prompts = [prompt(30 + i, 3 * UNIT + 4) for i in range(6)]
        reqs = [w.add(w.request(p)) for p in prompts]
        with contextlib.ExitStack() as stack:  # SIGCONT on the way out, whatever happens
            stopped = []

            def stop_before_saves(out):
                if out.kv_connector_metadata.saves and not stopped:
                    stopped.append(stack.enter_context(stalled(c.nodes[1])))

            def reuse_saved_blocks(out):
                for t in out.kv_connector_metadata.saves:
                    for blocks in t.blocks:
                        for v in w.layers:
                            for b in blocks:
                                w._block(v, b).fill_(-1234.5)

            w.run(before_worker=stop_before_saves, after_worker=reuse_saved_blocks)
        cnt = w.worker.counters()
        # Cut at save_timeout_ms (200), not held for io_timeout_ms (10 s).
        assert max(w.hook_s) < 2.0, f"a save meeting the stopped node held a step {max(w.hook_s):.1f} s"
        assert cnt.get("save_dropped_units", 0) > 0 and cnt["save_units"] > 0, cnt
        # The same KV, stored under another tenant with every node healthy.
        ref = engine(models, c.members, extra={"tenant": "ref"})
        made.append(ref)
        ref.serve(prompts)
        assert ref.worker.counters()["save_units"] == 18
        served = 0
        with Client(c.members, geometry=_geometry(w)) as cl:
            for k, kr in zip(_unit_keys(w, reqs), _unit_keys(w, reqs, "ref/")):
                got = cl.get_bytes(k)
                assert got.status in (Status.OK, Status.MISS), (k, got.status)
                if got.ok:
                    served += 1
                    assert got.data == cl.get_bytes(kr).data, f"{k}: bytes written after the save was cut"
        assert served >= cnt["save_units"]
        # Through the connector: whatever a reader loads is the original KV.
        r = engine(models, c.members)
        made.append(r)
        r.serve(prompts)
        assert all(r.checked.values()) and sum(r.loaded.values()) > 0
    finally:
        for e in made:
            e.close()
        c.stop()


def _one_node_stopped(models):
    """Twelve prompts of two units on three nodes: stored by a writer, read
    by a reader with every node healthy, then read by a third instance
    (started with every node up, as a serving one is) while one node is
    SIGSTOPped. Gives what the tests below check."""
    from conftest import Cluster, stalled

    c = Cluster(3)
    made = []
    try:
        prompts = [prompt(40 + i, 2 * UNIT + 10) for i in range(12)]
        named = {"model_id": "tiny"}  # keys (and so their nodes) the same every run
        w = engine(models, c.members, extra=named)
        made.append(w)
        reqs = w.serve(prompts)
        healthy = engine(models, c.members, extra=named)
        made.append(healthy)
        healthy.serve(prompts)
        # Lookups meeting the stopped node take their bound (3/4 of
        # lookup_timeout_ms) off the step; a longer one than the default
        # keeps a slow machine's queued lookups from giving up.
        sick = engine(models, c.members, extra={"lookup_timeout_ms": 3000, **named})
        made.append(sick)
        keys = _unit_keys(w, reqs)
        probe = Client(c.members, geometry=_geometry(w))
        made.append(probe)
        assert probe.batch_exist(keys) == [Status.OK] * 24  # connected before the stop
        with stalled(c.nodes[1]):
            # Which units are on the nodes still up.
            with probe.call_timeout(1000):
                up = [s is Status.OK for s in probe.batch_exist(keys)]
            sq = sick.serve(prompts)
        expect = []
        for i in range(12):
            lead = 0
            while lead < 2 and up[2 * i + lead]:
                lead += 1
            expect.append(lead * UNIT)
        assert 0 < sum(expect) < 24 * UNIT, expect
        return types.SimpleNamespace(
            writer=w.worker.counters(), healthy=healthy.worker.counters(), sick=sick.worker.counters(),
            healthy_loaded=sorted(healthy.loaded.values()), base=max(w.hook_s + healthy.hook_s),
            worst=max(sick.hook_s), loaded=[sick.loaded.get(q.request_id, 0) for q in sq], expect=expect)
    finally:
        for e in made:
            e.close()
        c.stop()


def test_a_stopped_node_costs_a_step_at_most_the_save_bound(models):
    """One node of three SIGSTOPped: the slowest step's connector hooks
    (scheduler and worker, timed per step) take at most ~250 ms more than
    with every node healthy (600 on a loaded machine), the saves it owns
    dropped at save_timeout_ms. Healthy: no save dropped, every whole unit a hit."""
    run = _one_node_stopped(models)
    for cnt in (run.writer, run.healthy):
        assert cnt.get("save_dropped_units", 0) == 0 and cnt["save_failed_units"] == 0, cnt
    assert run.writer["save_units"] == 24
    assert run.healthy_loaded == [2 * UNIT] * 12  # the hit rate of a healthy cluster: every whole unit
    loaded_machine = os.getloadavg()[0] >= (os.cpu_count() or 1) or bool(os.environ.get("CI"))
    allowed = 0.6 if loaded_machine else 0.25
    print(f"\nslowest step's connector hooks: healthy {run.base * 1e3:.0f} ms, one node stopped "
          f"{run.worst * 1e3:.0f} ms (+{(run.worst - run.base) * 1e3:.0f} ms, allowed +{allowed * 1e3:.0f}); "
          f"saves dropped {run.sick.get('save_dropped_units')}, failed {run.sick['save_failed_units']}; "
          f"hits {run.loaded}, on nodes up {run.expect}")
    assert run.worst - run.base <= allowed
    assert run.sick.get("save_dropped_units", 0) > 0  # the first save meeting the stopped node, cut
    assert run.loaded == run.expect  # units on the nodes still up still hit


def test_a_load_never_waits_behind_loads_stalled_on_a_stopped_node(models):
    """Eight requests' loads of units on n1, SIGSTOPped, and then one of a
    unit on n0, all handed to a worker in one step: the n0 load is done in
    a few ms, not once threads held by the stalled loads come free (their
    calls end at load_timeout_ms)."""
    import time

    import torch
    from conftest import Cluster, stalled

    from kvcellar._vllm_common import KVCellarMetadata, _Transfer

    c = Cluster(3)
    made = []
    try:
        named = {"model_id": "tiny"}  # keys (and so their nodes) the same every run
        w = engine(models, c.members, extra=named)
        made.append(w)
        reqs = w.serve([prompt(120 + i, UNIT + 10) for i in range(40)])
        keys = _unit_keys(w, reqs)
        hashes = {k: q.block_hashes[:UNIT // 16] for k, q in zip(keys, reqs)}
        owner = {}
        for n in c.nodes:  # a one-member client asks that node alone
            with Client(f"{n.name}={n.addr}", geometry=_geometry(w)) as one:
                owner.update({k: n.name for k, st in zip(keys, one.batch_exist(keys)) if st is Status.OK})
        stuck = [k for k in keys if owner[k] == "n1"][:8]
        fast = [k for k in keys if owner[k] == "n0"][:1]
        assert len(stuck) == 8 and fast, owner
        r = engine(models, c.members, extra=named)
        made.append(r)
        rw = r.worker
        per_unit = UNIT // 16
        loads = [_Transfer(f"r{i}", [k], [list(range(i * per_unit, (i + 1) * per_unit))])
                 for i, k in enumerate(stuck + fast)]
        with Client(c.members, geometry=_geometry(w)) as probe:  # n1 up and answering
            assert probe.batch_exist(stuck + fast) == [Status.OK] * 9
        done = {}
        with stalled(c.nodes[1]):
            t0 = time.monotonic()
            rw.bind_connector_metadata(KVCellarMetadata(loads=loads))
            rw.start_load_kv(None)
            rw.clear_connector_metadata()
            end = t0 + 30
            while len(done) < len(loads) and time.monotonic() < end:
                _, got = rw.get_finished(set())
                done.update({rid: time.monotonic() - t0 for rid in got or ()})
                time.sleep(0.002)
        assert len(done) == len(loads), done
        slow = max(done[f"r{i}"] for i in range(8))
        bad = rw.get_block_ids_with_load_errors()
        print(f"\nload of a unit on n0: {done['r8'] * 1e3:.0f} ms; loads of units on the stopped n1: "
              f"slowest {slow * 1e3:.0f} ms")
        assert slow >= 0.4  # the stalled loads did stall
        assert done["r8"] < (0.5 if os.environ.get("CI") else 0.25), done
        assert not set(loads[8].blocks[0]) & bad
        assert rw.counters()["load_units"] == 1
        # And what it loaded is the KV the writer computed, block by block.
        for j, b in enumerate(loads[8].blocks[0]):
            for li, v in enumerate(r.layers):
                got = r._block(v, b)
                assert torch.equal(got, r.block_bytes(hashes[fast[0]][j], li, got)), (j, li)
    finally:
        for e in made:
            e.close()
        c.stop()


@pytest.mark.parametrize("owners", [
    ("n0", "n1"),
    # n2 comes after the stopped n1 in member order: its keys must not
    # wait behind n1's new connection.
    ("n2", "n1"),
])
def test_a_first_lookup_meeting_a_stopped_node_finds_the_units_before_it(models, owners):
    """A fresh instance (no connection to the stopped node yet) looks up a
    prompt whose first unit lives on a node up and second on the stopped
    n1: the first unit is a hit, and the node up is not cooled down."""
    from conftest import Cluster, stalled

    c = Cluster(3)
    made = []
    try:
        w = engine(models, c.members, extra={"model_id": "tiny"})
        made.append(w)
        prompts = [prompt(70 + i, 2 * UNIT) for i in range(24)]
        reqs = w.serve(prompts)
        keys = _unit_keys(w, reqs)
        owner = {}
        for n in c.nodes:  # a one-member client asks that node alone
            with Client(f"{n.name}={n.addr}", geometry=_geometry(w)) as one:
                owner.update({k: n.name for k, st in zip(keys, one.batch_exist(keys)) if st is Status.OK})
        pick = [p for i, p in enumerate(prompts) if (owner[keys[2 * i]], owner[keys[2 * i + 1]]) == owners]
        assert pick, f"no prompt with its units on {owners}"
        r = engine(models, c.members, extra={"model_id": "tiny"})
        made.append(r)
        with stalled(c.nodes[1]):
            assert lookup(r, pick[0]) == UNIT
            if len(pick) > 1:
                assert lookup(r, pick[1]) == UNIT  # the node up was not blamed for n1
    finally:
        for e in made:
            e.close()
        c.stop()
