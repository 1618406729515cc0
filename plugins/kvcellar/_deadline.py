"""Deadlines of the engine plugins' store calls, and the counters they keep.

A sick node (hung, stopped, swapping) must cost an engine a bounded time,
not one ``io_timeout_ms`` per call (docs/plugins/sglang.md and
docs/plugins/lmcache.md, "Deadlines"). Every store call a plugin makes runs
inside the library's per-call deadline, :meth:`kvcellar.Client.call_timeout`:
items not done by then come back ``TIMEOUT`` (``UNAVAILABLE`` while their
node cools down after it), and the call returns only once nothing of it
touches the engine's buffers any more. A plugin never returns while a call
it started still runs.

Three deadlines, one per kind of call (milliseconds):

- ``lookup_deadline_ms`` (100): an exist of a batch of keys. One request
  per owner node; a healthy node answers a few hundred keys in about a
  millisecond on loopback, a few on a data-centre network.
- ``load_deadline_ms`` (200) and ``save_deadline_ms`` (200): a get or put
  of pages. A healthy node moves a few MiB pages in milliseconds.

Loads and saves are cut into slices, each under its own deadline, so a
large healthy batch (SGLang hands up to 128 pages of several MiB to one
call, LMCache chunks of tens of MiB) is never cut for being large: a slice
holds what moves in its deadline at :data:`SLICE_RATE` (0.25 GiB/s: 50 MiB
for 200 ms; one page when a page is larger), so on a path at least twice as
fast a healthy slice ends in under half its deadline. A slice with a page
that failed ends the call (engines use the leading pages only); a node that
timed out is skipped at once by every later call while it cools down
(``peer_cooldown_ms``), so one call pays at most about one deadline for it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from kvcellar.client import Client, Status

#: The deadline options both plugins take, and their defaults (ms).
DEADLINE_DEFAULTS: Dict[str, int] = {
    "lookup_deadline_ms": 100,
    "load_deadline_ms": 200,
    "save_deadline_ms": 200,
}
DEADLINE_KEYS = tuple(DEADLINE_DEFAULTS)

#: Bytes per millisecond of deadline one slice of a load or save may hold
#: (0.25 GiB/s): a slice under a 200 ms deadline holds up to 50 MiB.
SLICE_RATE = 256 << 10

#: The plugins' own counters (beside the client's ``kvclient_*``).
COUNTERS = (
    # keys a lookup answered absent because its deadline ran out
    "kvplugin_lookup_deadline_misses_total",
    # pages (LMCache: chunks) a load missed because its deadline ran out
    "kvplugin_load_deadline_misses_total",
    # pages a save dropped because its deadline ran out (cut, or not tried after a cut)
    "kvplugin_saves_dropped_deadline_total",
    # pages a save dropped for any reason (the deadline included)
    "kvplugin_saves_dropped_total",
)


@dataclass(frozen=True)
class Deadlines:
    lookup_ms: int = DEADLINE_DEFAULTS["lookup_deadline_ms"]
    load_ms: int = DEADLINE_DEFAULTS["load_deadline_ms"]
    save_ms: int = DEADLINE_DEFAULTS["save_deadline_ms"]

    @classmethod
    def of(cls, values: Dict[str, int]) -> "Deadlines":
        return cls(values["lookup_deadline_ms"], values["load_deadline_ms"], values["save_deadline_ms"])


#: Per deadline counter: the call it counts, what it counts, its option.
_CUT = {
    "kvplugin_lookup_deadline_misses_total": ("lookup", "keys missed", "lookup_deadline_ms"),
    "kvplugin_load_deadline_misses_total": ("load", "pages missed", "load_deadline_ms"),
    "kvplugin_saves_dropped_deadline_total": ("save", "pages dropped", "save_deadline_ms"),
}


class Counters:
    """Thread-safe counters of one plugin instance. The first time a
    deadline cuts a call of a kind, one WARNING line says so; later cuts
    are counted only."""

    def __init__(self, log: Optional[logging.Logger] = None, deadlines: Optional["Deadlines"] = None) -> None:
        self._lock = threading.Lock()
        self._v: Dict[str, int] = {k: 0 for k in COUNTERS}
        self._log = log
        self._deadlines = deadlines

    def add(self, name: str, n: int = 1) -> None:
        if not n:
            return
        with self._lock:
            first = self._v[name] == 0
            self._v[name] += n
        cut = _CUT.get(name)
        if first and cut and self._log is not None:
            kind, what, opt = cut
            ms = getattr(self._deadlines, f"{kind}_ms", "?") if self._deadlines else "?"
            self._log.warning(
                "kvcellar: a %s was cut by its deadline (%s=%s): %d %s. A node does not answer in time, or the "
                "deadline is short for the pages' size; counted in %s, not logged again", kind, opt, ms, n, what, name)

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._v.items()}


def left_ms(ms: int, started: Optional[float]) -> int:
    """What is left of a deadline of ``ms`` begun at ``started`` (monotonic
    seconds; None: now); 0 when nothing is."""
    if started is None:
        return ms
    return max(0, ms - int((time.monotonic() - started) * 1000))


def run_slices(
    client: Client,
    ms: int,
    sizes: Sequence[int],
    call: Callable[[int, int], Iterable[Status]],
    started: Optional[float] = None,
) -> Tuple[List[Optional[Status]], bool]:
    """Runs ``call(lo, hi)`` (the statuses of items lo..hi) over slices of
    the items, each under ``client.call_timeout`` of ``ms`` and holding
    what moves in it at :data:`SLICE_RATE` (the first slice: what is left
    of ``ms`` since ``started``, when given). Stops after a slice with an
    item not OK. Returns each item's status (None: not tried) and whether a
    deadline cut the call (an item TIMEOUT, or no time left for the first
    slice)."""
    out: List[Optional[Status]] = [None] * len(sizes)
    lo = 0
    while lo < len(sizes):
        budget = left_ms(ms, started) if lo == 0 else ms
        if budget <= 0:
            return out, True
        hi = lo + _fit(sizes, lo, budget * SLICE_RATE)
        with client.call_timeout(budget):
            st = list(call(lo, hi))
        out[lo:hi] = st
        if any(s is not Status.OK for s in st):
            return out, any(s is Status.TIMEOUT for s in st)
        lo = hi
    return out, False


def _fit(sizes: Sequence[int], lo: int, limit: int) -> int:
    """How many items from ``lo`` fit in ``limit`` bytes (at least one)."""
    n, acc = 0, 0
    for s in sizes[lo:]:
        if n and acc + s > limit:
            break
        acc += s
        n += 1
    return n


__all__ = ["COUNTERS", "DEADLINE_DEFAULTS", "DEADLINE_KEYS", "SLICE_RATE", "Counters", "Deadlines", "left_ms",
           "run_slices"]
