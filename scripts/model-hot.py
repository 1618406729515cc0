#!/usr/bin/env python3
"""A model of spreading hot keys' reads (docs/ARCHITECTURE.md, "Hot keys"):
the busiest node's reads against the mean, by placement alone and with a
key's reads spread over the nodes after its owner on the ring.

The reads are the shipped trace's own hits: with unlimited capacity, each
request reads the leading pages of its chain that earlier requests stored
(traces/README.md). "x10" replicates the trace 10 times with only its first
page (the block every request starts with) shared, so that the cold reads
per node stay realistic at 1,000 nodes.

Two rules are modelled. "spread": a key whose reads exceed SHARE x the mean
node's reads is read from R = ceil(reads / (SHARE x mean)) nodes (the owner
and the next R - 1 distinct members on the ring), each serving 1/R of them.
"as built": the nodes' and clients' rule (server/src/heat.rs, client-ffi
src/hot.rs): a key is hot when it takes at least an eighth of its owner's
reads (placement alone: the owner counts spread reads at their weight, so
it sees the key's whole load), and is read from R = its reads over an
eighth of the owner's other reads nodes, 2 to 255, at most the group. The
whole trace stands for one window (the rule is a ratio of reads; the
nodes' floor of 64 reads a window is left out). The ring is
a Ketama ring of 160 points per node on an MD5 hash (a stand-in for the
nodes' xxh3: what matters here is how points spread, not which node a key
lands on).

Usage: scripts/model-hot.py [TRACE]   (default traces/conversation_trace.jsonl)
"""
import bisect
import hashlib
import json
import math
import os
import sys
from collections import Counter

SHARE = 0.25
POINTS = 160
MAX_SPREAD = int(os.environ.get("MAX_SPREAD", "255"))  # kv_common::wire::MAX_SPREAD


def hits(chains):
    stored, c = set(), Counter()
    for ch in chains:
        for p in ch:
            if p not in stored:
                break
            c[p] += 1
        stored.update(ch)
    return c


def h(x):
    return int(hashlib.md5(str(x).encode()).hexdigest()[:15], 16)


def ring(n):
    pts = sorted((h(f"n{i}#{j}"), i) for i in range(n) for j in range(POINTS))
    return [p for p, _ in pts], [i for _, i in pts]


def nodes_of(key, r, pts, ids):
    i = bisect.bisect_left(pts, h(key)) % len(pts)
    out = []
    while len(out) < r:
        m = ids[i % len(pts)]
        if m not in out:
            out.append(m)
        i += 1
    return out


def busiest(reads, n, rule):
    pts, ids = ring(n)
    load = [0.0] * n
    mean = sum(reads.values()) / n
    owned = [0.0] * n
    if rule == "built":
        for k, v in reads.items():
            owned[nodes_of(k, 1, pts, ids)[0]] += v
    for k, v in reads.items():
        r = 1
        if rule == "share" and v > SHARE * mean:
            r = min(n, math.ceil(v / (SHARE * mean)))
        if rule == "built":
            total = owned[nodes_of(k, 1, pts, ids)[0]]
            if v >= total / 8:
                others = (total - v) / 8
                r = min(n, max(2, min(MAX_SPREAD, math.ceil(v / max(others, 1)))))
        for o in nodes_of(k, r, pts, ids):
            load[o] += v / r
    return max(load) / mean


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "traces", "conversation_trace.jsonl")
    reqs = [json.loads(line) for line in open(path) if line.strip()]
    chains = [r["hash_ids"][: r["input_length"] // 512] for r in reqs]
    base = hits(chains)
    first = Counter(ch[0] for ch in chains if ch).most_common(1)[0][0]
    x10 = Counter()
    for k in range(10):
        for p, v in base.items():
            x10[p if p == first else (k, p)] += v
    print(f"{'reads':<6} {'nodes':>5} {'placement alone':>16} {'spread':>8} {'as built':>9}")
    for name, reads, sizes in (("trace", base, (3, 12, 24, 100)), ("x10", x10, (100, 1000))):
        for n in sizes:
            cols = [busiest(reads, n, rule) for rule in (None, "share", "built")]
            print(f"{name:<6} {n:>5} {cols[0]:>15.2f}x {cols[1]:>7.2f}x {cols[2]:>8.2f}x")


if __name__ == "__main__":
    main()
