"""One engine-like workload through a plugin, on three healthy nodes and then
with one of them SIGSTOPped: what the deadline tests of test_hicache.py and
test_lmcache.py assert on, and what plugins/bench/sick_cluster.py prints.

A round is what an engine's storage threads do for one request each:
a save of ``pages`` new pages, a lookup of each of ``pages`` pages stored
before the phases (one call per key, so each key's answer is known), then
a load of those pages in one call. Every backend call is timed. The pages
looked up and loaded were stored while every node was healthy; which of
them the stopped node owns is read from it after it resumes (a client that
names that node alone, with the plugin's geometry), so "keys on healthy
nodes still hit" is checked key by key.

SGLang's rounds go through the backend SGLang's StorageBackendFactory built
over its real host pool (stand-ins without SGLang); LMCache's through the
connector LMCache loaded into its RemoteBackend (stand-ins without LMCache).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from conftest import Cluster, stalled
from kvcellar import Client, Status

KINDS = ("save", "lookup", "load")


@dataclass
class Phase:
    """What one phase measured: the slowest call of each kind (seconds),
    the keys that hit, saves that failed, and the plugin's counters."""

    slowest: Dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    calls: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    looked_up: Set[str] = field(default_factory=set)
    loaded: Set[str] = field(default_factory=set)
    saves_failed: int = 0
    pages_saved: int = 0
    counters: Dict[str, float] = field(default_factory=dict)

    def time(self, kind: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = fn()
        self.slowest[kind] = max(self.slowest[kind], time.perf_counter() - t)
        self.calls[kind] += 1
        return out


def until(ok: Callable[[], bool], limit_s: float = 10.0) -> bool:
    """Polls `ok` until it holds, `limit_s` at most: setting up on a loaded
    machine, a healthy node can miss a deadline and cool down a while
    (``peer_cooldown_ms``), and its pages must still be stored."""
    end = time.monotonic() + limit_s
    while not ok():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def delta(after: Dict[str, float], before: Dict[str, float]) -> Dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("kvplugin_")}


class SGLangDriver:
    """kvcellar.hicache built as test_hicache.make_backend builds it, with
    the package's default deadlines (those are what these tests measure)."""

    name = "sglang"

    def __init__(self, cluster: Cluster, pages: int, page_tokens: int = 16, layers: int = 4, heads: int = 2,
                 head_dim: int = 64, extra: Optional[Dict[str, Any]] = None):
        from pools import fill_page, indices_for, make_pool
        from kvcellar._deadline import DEADLINE_DEFAULTS
        from test_hicache import make_backend

        self.pages = pages
        self.pool = make_pool("mha", size=page_tokens * (4 * pages + 8), page_size=page_tokens, layer_num=layers,
                              head_num=heads, head_dim=head_dim)
        self.b = make_backend(cluster, self.pool, extra={**DEADLINE_DEFAULTS, **(extra or {})})
        self.inner = getattr(self.b, "_backend", self.b)
        self._fill, self._idx = fill_page, indices_for
        self.page_bytes = sum(self.pool.get_page_buffer_meta(indices_for(self.pool, 0, 1))[1])
        self.run = f"{os.getpid()}-{time.time_ns()}"

    def keys(self, tag: str, n: int) -> List[str]:
        return [f"{self.run}-{tag}-{i:08x}".encode().hex()[-64:].rjust(64, "0") for i in range(n)]

    def store(self, keys: Sequence[str]) -> bool:
        ok = True
        for at in range(0, len(keys), self.pages):
            part = list(keys[at : at + self.pages])
            for i, k in enumerate(part):
                self._fill(self.pool, i, k)
            # A set writes only what is missing: again until stored.
            ok &= until(lambda: all(self.b.batch_set_v1(part, self._idx(self.pool, 0, len(part)))))
        return ok

    def prepare(self, keys: Sequence[str]) -> Any:
        for i, k in enumerate(keys):
            self._fill(self.pool, i, k)
        return None

    def save(self, keys: Sequence[str], _: Any) -> List[bool]:
        return list(self.b.batch_set_v1(list(keys), self._idx(self.pool, 0, len(keys))))

    def lookup(self, key: str) -> bool:
        return self.b.batch_exists([key]) == 1

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.b.batch_exists(list(keys))

    def load(self, keys: Sequence[str]) -> List[bool]:
        return list(self.b.batch_get_v1(list(keys), self._idx(self.pool, 2 * self.pages, len(keys))))

    def full_keys(self, keys: Sequence[str]) -> List[str]:
        return self.inner._keys(list(keys), "v1")

    @property
    def geometry(self) -> Any:
        return self.inner.geometry

    def counters(self) -> Dict[str, float]:
        return self.inner.counters()

    def close(self) -> None:
        self.b.close()


class LMCacheDriver:
    """kvcellar.lmcache built by LMCache's own plugin loading (lmc.make_harness)."""

    name = "lmcache"

    def __init__(self, cluster: Cluster, pages: int, chunk_tokens: int = 16, extra: Optional[Dict[str, Any]] = None):
        from lmc import make_harness

        self.pages = pages
        self.h = make_harness({"members": cluster.members, "io_timeout_ms": 3000, "connect_timeout_ms": 500,
                               **(extra or {})}, chunk_size=chunk_tokens)
        self.c = self.h.connector
        probe = self.h.new_chunk("probe")
        self.page_bytes = probe.get_size()
        probe.ref_count_down()
        self.run = os.getpid() << 32 | (time.time_ns() & 0xFFFFFFFF)
        self._n = 0

    def keys(self, tag: str, n: int) -> List[str]:
        base = (self.run << 24) + (sum(tag.encode()) << 16)
        self._n += 1
        return [self.h.key(base + (self._n << 8) + i) for i in range(n)]

    def _put(self, keys: Sequence[str]) -> List[bool]:
        objs = [self.h.new_chunk(k) for k in keys]
        try:
            self.h.run(self.c.batched_put(list(keys), objs))
        finally:
            for o in objs:
                o.ref_count_down()
        st = self.c.client.batch_exist([self.c._key(k) for k in keys])
        return [s is Status.OK for s in st]

    def store(self, keys: Sequence[str]) -> bool:
        return all(until(lambda: all(self._put(keys[at : at + self.pages])))
                   for at in range(0, len(keys), self.pages))

    def prepare(self, keys: Sequence[str]) -> Any:
        return [self.h.new_chunk(k) for k in keys]

    def save(self, keys: Sequence[str], objs: Any) -> List[bool]:
        before = self.c._counters.snapshot()["kvplugin_saves_dropped_total"]
        try:
            self.h.run(self.c.batched_put(list(keys), objs))
        finally:
            for o in objs:
                o.ref_count_down()
        dropped = int(self.c._counters.snapshot()["kvplugin_saves_dropped_total"] - before)
        return [True] * (len(keys) - dropped) + [False] * dropped

    def lookup(self, key: str) -> bool:
        return self.c.batched_contains([key]) == 1

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.c.batched_contains(list(keys))

    def load(self, keys: Sequence[str]) -> List[bool]:
        got = self.h.run(self.c.batched_get(list(keys)))
        out = [g is not None for g in got]
        for g in got:
            if g is not None:
                g.ref_count_down()
        return out

    def full_keys(self, keys: Sequence[str]) -> List[bytes]:
        return [self.c._key(k) for k in keys]

    @property
    def geometry(self) -> Any:
        return self.c.geometry

    def counters(self) -> Dict[str, float]:
        return self.c.stats()

    def close(self) -> None:
        self.h.close()


def run_phase(d: Any, ref: Sequence[str], rounds: int, tag: str, round_s: float = 0.0,
              prefix_lookups: bool = False) -> Phase:
    """`rounds` rounds (see the module docs); `ref`: pages stored before.
    With `round_s`, round r starts no earlier than r * round_s after the
    first (a steady stream of requests rather than a burst). With
    `prefix_lookups`, a round's lookup is one call over its pages, as an
    engine's prefix lookup (its answer, leading hits, names no key)."""
    p = Phase()
    before = d.counters()
    n = d.pages
    t0 = time.monotonic()
    for r in range(rounds):
        wait = t0 + r * round_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # pacing a benchmark's stream, not a wait for readiness
        new = d.keys(f"{tag}{r}", n)
        data = d.prepare(new)
        saved = p.time("save", lambda: d.save(new, data))
        p.pages_saved += sum(saved)
        p.saves_failed += saved.count(False)
        group = list(ref[(r * n) % len(ref) :][:n])
        if prefix_lookups:
            p.time("lookup", lambda: d.lookup_prefix(group))
        for k in [] if prefix_lookups else group:
            if p.time("lookup", lambda: d.lookup(k)):
                p.looked_up.add(k)
        got = p.time("load", lambda: d.load(group))
        p.loaded.update(k for k, ok in zip(group, got) if ok)
    p.counters = delta(d.counters(), before)
    return p


@dataclass
class Outcome:
    healthy: Phase
    sick: Phase
    ref: List[str]
    on_stopped: Set[str]

    def extra(self) -> Dict[str, float]:
        """Per kind: the slowest sick call minus the slowest healthy one (s)."""
        return {k: self.sick.slowest[k] - self.healthy.slowest[k] for k in KINDS}

    def report(self, name: str) -> str:
        rows = [f"{k:6s} slowest {self.healthy.slowest[k] * 1000:7.1f} ms healthy, "
                f"{self.sick.slowest[k] * 1000:7.1f} ms with a stopped node ({self.extra()[k] * 1000:+7.1f} ms; "
                f"{self.sick.calls[k]} calls)" for k in KINDS]
        c = self.sick.counters
        rows.append(f"with the stopped node: {c.get('kvplugin_saves_dropped_deadline_total', 0):.0f} pages dropped "
                    f"for time, {c.get('kvplugin_lookup_deadline_misses_total', 0):.0f} lookups and "
                    f"{c.get('kvplugin_load_deadline_misses_total', 0):.0f} loaded pages cut; the stopped node owns "
                    f"{len(self.on_stopped)} of {len(self.ref)} pages")
        return f"{name}:\n  " + "\n  ".join(rows)


def check_stopped_node(out: Outcome, bound_ms: int, unit: str = "pages") -> List[str]:
    """What a stopped-node run did wrong (empty: nothing). Healthy: every
    save stored, no call cut, every page hit. Stopped: the healthy nodes'
    pages hit and the stopped node's never (asserted: never noise), each
    kind of call met its deadline, none took more than `bound_ms` longer."""
    h, s, ref, stopped = out.healthy, out.sick, set(out.ref), out.on_stopped
    wrong = []
    if h.saves_failed or h.counters["kvplugin_saves_dropped_total"]:
        wrong.append(f"healthy: {h.saves_failed} {unit} not saved")
    if any(h.counters[k] for k in h.counters if "deadline" in k):
        wrong.append(f"healthy: calls cut {h.counters}")
    if h.looked_up != ref or h.loaded != ref:
        wrong.append(f"healthy: {len(ref - h.looked_up)} lookups and {len(ref - h.loaded)} loads missed")
    if not 0 < len(stopped) < len(ref):
        wrong.append(f"the stopped node owns {len(stopped)} of {len(ref)} {unit}")
    if not (0 < s.pages_saved and s.saves_failed == s.counters["kvplugin_saves_dropped_total"] > 0):
        wrong.append(f"stopped: {s.pages_saved} saved, {s.saves_failed} failed, {s.counters}")
    assert not (s.looked_up & stopped or s.loaded & stopped), f"one of the {unit} on the stopped node hit"
    if s.looked_up != ref - stopped or s.loaded != ref - stopped:
        wrong.append(f"stopped: {len(ref - stopped - s.looked_up)} lookups and "
                     f"{len(ref - stopped - s.loaded)} loads on healthy nodes missed")
    for c in ("kvplugin_saves_dropped_deadline_total", "kvplugin_lookup_deadline_misses_total",
              "kvplugin_load_deadline_misses_total"):
        if not s.counters[c]:
            wrong.append(f"stopped: no call met the node's deadline ({c})")
    for k in KINDS:
        if out.extra()[k] * 1000 > bound_ms:
            wrong.append(f"a {k} took {out.extra()[k] * 1000:.0f} ms more")
    return wrong


def until_clean(run: Callable[[], Outcome], check: Callable[[Outcome], List[str]], name: str,
                attempts: int = 3) -> Outcome:
    """Runs the scenario until `check` finds nothing wrong, `attempts` times
    at most. On a loaded machine a healthy node can now and then miss a
    deadline (its process, or ours, not scheduled in time): one clean
    attempt shows the deadlines fit; every attempt failing is a failure.
    Prints each attempt's figures and what was wrong with it."""
    problems: List[str] = []
    for a in range(attempts):
        out = run()
        problems = check(out)
        print(f"\n{out.report(name)}" + (f"\n  attempt {a + 1}: " + "; ".join(problems) if problems else ""))
        if not problems:
            return out
    raise AssertionError(f"{name}: every attempt failed; the last: " + "; ".join(problems))


def sick_cluster(d_factory: Callable[[Cluster], Any], rounds: int, stop: int = 1, round_s: float = 0.0,
                 prefix_lookups: bool = False) -> Outcome:
    """Builds three nodes and the driver, stores the reference pages, runs
    the healthy phase, then the sick one with node `stop` SIGSTOPped
    (SIGCONT in a finally), then reads which reference pages that node owns."""
    cluster = Cluster(3)
    try:
        d = d_factory(cluster)
        try:
            ref = d.keys("ref", rounds * d.pages)
            assert d.store(ref), "the reference pages were not all stored on the healthy cluster"
            run_phase(d, ref, 1, "warm")  # connections made, code paths warm: not counted
            healthy = run_phase(d, ref, rounds, "h", round_s, prefix_lookups)
            with stalled(cluster.nodes[stop]):
                sick = run_phase(d, ref, rounds, "s", round_s, prefix_lookups)
            node = cluster.nodes[stop]
            with Client(f"{node.name}={node.addr}", geometry=d.geometry) as direct:
                st = direct.batch_exist(d.full_keys(ref))
            on_stopped = {k for k, s in zip(ref, st) if s is Status.OK}
            return Outcome(healthy, sick, list(ref), on_stopped)
        finally:
            d.close()
    finally:
        cluster.stop()
