#!/usr/bin/env python3
"""Reference vectors for the multi-probe placement rule (docs/PROTOCOL.md §4.2).

An implementation of the rule written from its description in PROTOCOL.md,
independent of the Rust code, so common/src/ring.rs can test that it agrees.
Needs the `xxhash` package (pip install xxhash). Writes JSON to stdout:

    python3 scripts/placement-vectors.py > common/tests/placement-vectors.json
"""
import bisect
import json
import sys

import xxhash

POINTS_PER_WEIGHT = 16
PROBES = 64
M64 = (1 << 64) - 1


def splitmix(h, j):
    """Probe j (0-based) of a key whose point is h: output j+1 of SplitMix64 seeded with h."""
    z = (h + 0x9E3779B97F4A7C15 * (j + 1)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Ring:
    def __init__(self, members):
        # members: [(id, weight)]; points sorted by value, then by id bytes.
        self.ids = [m for m, _ in members]
        pts = []
        for i, (mid, w) in enumerate(members):
            for j in range(POINTS_PER_WEIGHT * max(w, 1)):
                pts.append((xxhash.xxh3_64_intdigest(f"{mid}#{j}".encode()), mid.encode(), i))
        pts.sort()
        self.values = [p for p, _, _ in pts]
        self.owners = [i for _, _, i in pts]

    def successor(self, p):
        i = bisect.bisect_left(self.values, p)
        return 0 if i == len(self.values) else i

    def owner(self, key):
        h = xxhash.xxh3_64_intdigest(key.encode())
        best = None
        for j in range(PROBES):
            p = splitmix(h, j)
            i = self.successor(p)
            d = (self.values[i] - p) & M64
            if best is None or d < best[0]:
                best = (d, i)
        return self.ids[self.owners[best[1]]]

    def shares(self):
        """Exact shares: a point with arc a wins k * integral_0^a G(x)^(k-1) dx."""
        n = len(self.values)
        arcs = []
        for k in range(n):
            prev = self.values[k - 1] if k else self.values[-1]
            arc = (self.values[k] - prev) & M64 if n > 1 else 1 << 64
            arcs.append(arc / 2.0**64)
        order = sorted(range(n), key=lambda i: arcs[i])
        out = [0.0] * len(self.ids)
        rest = sum(arcs)
        x0, g0, acc = 0.0, 1.0, 0.0
        for i, pt in enumerate(order):
            a = arcs[pt]
            longer = n - i
            g1 = max(rest - longer * a, 0.0)
            if a > x0:
                acc += (g0**PROBES - g1**PROBES) / longer
            out[self.owners[pt]] += acc
            rest -= a
            x0, g0 = a, g1
        total = sum(out)
        return [s / total for s in out]


def main():
    small = [("n1", 1), ("n2", 2), ("n3", 1)]
    r = Ring(small)
    h0 = xxhash.xxh3_64_intdigest(b"key-0")
    keys = [f"key-{i}" for i in range(32)] + [
        "a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9a3f9_k",
        "meta-llama/Llama-3.1-8B@8@0@-1a2b3c@bfloat16",
    ]
    out = {
        "rule": "multiprobe",
        "points_per_weight": POINTS_PER_WEIGHT,
        "probes": PROBES,
        "small": {
            "members": [{"id": m, "weight": w} for m, w in small],
            "key0_point": h0,
            "key0_probes": [splitmix(h0, j) for j in range(4)],
            "owners": {k: r.owner(k) for k in keys},
            "shares": r.shares(),
        },
    }
    fleet = [(f"gpu-{i:04d}", 1) for i in range(1000)]
    f = Ring(fleet)
    fs = f.shares()
    grown = Ring(fleet + [("gpu-1000", 1)])
    gs = grown.shares()
    pages = [f"page-{i}" for i in range(48)]
    out["fleet"] = {
        "members": "gpu-0000 .. gpu-0999, weight 1",
        "owners": {k: f.owner(k) for k in pages},
        "max_over_mean": max(fs) * len(fs),
        "share_gpu_0000": fs[0],
        "joined": "gpu-1000",
        "joined_share": gs[-1],
        "owners_after_join": {k: grown.owner(k) for k in pages},
    }
    mixed = [(f"gpu-{i:04d}", 1 + i % 4) for i in range(1000)]
    m = Ring(mixed)
    ms = m.shares()
    total_w = sum(w for _, w in mixed)
    out["mixed"] = {
        "members": "gpu-0000 .. gpu-0999, weight 1 + (i mod 4)",
        "owners": {k: m.owner(k) for k in pages[:16]},
        "max_over_fair": max(s / (w / total_w) for s, (_, w) in zip(ms, mixed)),
        "min_over_fair": min(s / (w / total_w) for s, (_, w) in zip(ms, mixed)),
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
