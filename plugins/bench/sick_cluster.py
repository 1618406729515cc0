"""What one stopped node costs a plugin's calls (docs/plugins/sglang.md and
docs/plugins/lmcache.md, "Deadlines").

Three kv-server nodes on loopback. The workload of plugins/tests/sick.py (a
round: a save of ``--pages`` new pages, a lookup of each of ``--pages``
pages stored before, one call per key, then a load of them in one call)
runs ``--rounds`` times on the healthy cluster, a round every
``--round-ms`` at most (a steady stream, long enough to outlast the node's
cool-down more than once), then as many times with one node SIGSTOPped
(SIGCONT in a finally), with the plugin's default deadlines and the
client's default cool-down unless ``--options`` says otherwise.
Prints, per run and as the median of ``--runs`` runs, the slowest save,
lookup and load with and without the stopped node, and what the deadlines
cut.

SGLang: kvcellar.hicache through SGLang's StorageBackendFactory over its
real MHA host pool (stand-ins without SGLang); pages of ``--page-kib``
(64-token pages, 8 layers, 2 heads, page_first). LMCache: the connector
LMCache's own plugin loading builds (stand-ins without LMCache); chunks of
``--page-kib``.

usage: python3 sick_cluster.py {sglang,lmcache} [--runs 3] [--rounds 60] [--round-ms 100] [--pages 8]
       [--page-kib 256] [--options peer_cooldown_ms=...]
       (nodes from KVCELLAR_BIN_DIR, default target/release)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("KVCELLAR_BIN_DIR", os.path.join(HERE, "..", "..", "target", "release"))

import conftest  # noqa: E402,F401 - finds the binaries and the library
from sick import KINDS, LMCacheDriver, SGLangDriver, sick_cluster  # noqa: E402

CUTS = ("kvplugin_saves_dropped_deadline_total", "kvplugin_lookup_deadline_misses_total",
        "kvplugin_load_deadline_misses_total")


def driver(plugin: str, pages: int, page_kib: int, options: str):
    extra = {"options": options} if options else None
    if plugin == "sglang":
        tokens, layers, heads = 64, 8, 2
        head_dim = page_kib * 1024 // (layers * tokens * heads * 2 * 2)
        if head_dim * layers * tokens * heads * 4 != page_kib * 1024:
            raise SystemExit(f"--page-kib {page_kib}: a multiple of 4 is needed")
        return lambda c: SGLangDriver(c, pages, page_tokens=tokens, layers=layers, heads=heads, head_dim=head_dim,
                                      extra=extra)
    # lmc's chunks: 2 layers x K,V x 4 heads x 32 dims x fp16 = 1 KiB a token.
    return lambda c: LMCacheDriver(c, pages, chunk_tokens=page_kib, extra=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plugin", choices=("sglang", "lmcache"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--round-ms", type=int, default=100, help="a round starts every this many ms at most")
    ap.add_argument("--pages", type=int, default=8, help="pages (chunks) a call")
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--options", default="", help="client options, e.g. peer_cooldown_ms=0")
    a = ap.parse_args()
    make = driver(a.plugin, a.pages, a.page_kib, a.options)
    runs = []
    what = f"{a.plugin}, {a.pages} x {a.page_kib} KiB a call, {a.rounds} rounds of {a.round_ms} ms"
    for r in range(a.runs):
        out = sick_cluster(make, a.rounds, round_s=a.round_ms / 1000.0)
        runs.append(out)
        print(f"run {r + 1}: " + out.report(what), flush=True)
    print(f"\nmedian of {a.runs} runs ({what}, nodes from {os.environ['KVCELLAR_BIN_DIR']}):")
    print("| call | slowest, healthy | slowest, one node stopped | more |")
    print("|---|---|---|---|")
    for k in KINDS:
        h = statistics.median(o.healthy.slowest[k] for o in runs) * 1000
        s = statistics.median(o.sick.slowest[k] for o in runs) * 1000
        x = statistics.median(o.extra()[k] for o in runs) * 1000
        print(f"| {k} | {h:.1f} ms | {s:.1f} ms | {x:+.1f} ms |")
    for c in CUTS:
        print(f"{c}: " + ", ".join(f"{o.sick.counters.get(c, 0):.0f}" for o in runs) + " (stopped) / "
              + ", ".join(f"{o.healthy.counters.get(c, 0):.0f}" for o in runs) + " (healthy)")
    hit = [len(o.sick.loaded) / max(1, len(o.ref) - len(o.on_stopped)) for o in runs]
    print("loads with the node stopped: " + ", ".join(f"{x:.0%}" for x in hit) + " of the healthy nodes' pages hit; "
          + "healthy: " + ", ".join(f"{len(o.healthy.loaded) / len(o.ref):.0%}" for o in runs) + " of all pages")


if __name__ == "__main__":
    main()
