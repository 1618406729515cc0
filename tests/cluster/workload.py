"""Client workload for the container cluster test (scripts/test-cluster.py).

Runs inside a kvcellar container on the cluster network (the image has the
`kvcellar` package) and reaches the group through KVCELLAR_MDS. Every page's
content is derived from its key, so each get is checked byte for byte: a
wrong page is counted, never assumed away.

  workload.py fill   PREFIX COUNT SIZE               put COUNT pages
  workload.py verify PREFIX COUNT SIZE               get them all and compare
  workload.py watch  PREFIX COUNT SIZE SECONDS       get them round-robin for
      SECONDS, printing one JSON line per get: [unix time, ms, status, wrong]
Each command ends with one JSON summary line: {"summary": {...}}.
"""

import hashlib
import json
import sys
import time

import kvcellar

OPTIONS = "io_timeout_ms=1000,connect_timeout_ms=1000,peer_cooldown_ms=2000"


def page(key: str, size: int) -> bytes:
    block = b"".join(hashlib.blake2b(f"{key}/{i}".encode(), digest_size=64).digest() for i in range(64))
    reps = -(-size // len(block))
    return (block * reps)[:size]


def main() -> int:
    cmd, prefix, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    keys = [f"{prefix}-{i}" for i in range(count)]
    c = kvcellar.Client(options=OPTIONS, poll_ms=200)
    # Wait (bounded) for the first view from kv-mds.
    deadline = time.time() + 30
    while c.epoch == 0 and time.time() < deadline:
        time.sleep(0.05)
    buf = bytearray(size)
    out = {"keys": count, "size": size, "epoch": c.epoch}
    if cmd == "fill":
        ok = 0
        for k in keys:
            ok += c.put(k, page(k, size)) == kvcellar.Status.OK
        out.update(ok=ok)
    elif cmd == "verify":
        hits = misses = wrong = 0
        not_served = {}
        for k in keys:
            r = c.get(k, buf)
            if r.status == kvcellar.Status.OK:
                hits += 1
                wrong += bytes(buf[: r.length]) != page(k, size)
            else:
                misses += 1
                not_served[r.status.name] = not_served.get(r.status.name, 0) + 1
        out.update(hits=hits, misses=misses, wrong=wrong, verified_bytes=hits * size, not_served=not_served)
    elif cmd == "watch":
        seconds = float(sys.argv[5])
        expect = {k: page(k, size) for k in keys}
        end = time.time() + seconds
        n = hits = wrong = worst = 0
        while time.time() < end:
            k = keys[n % count]
            t0 = time.time()
            r = c.get(k, buf)
            ms = (time.time() - t0) * 1000
            bad = r.status == kvcellar.Status.OK and bytes(buf[: r.length]) != expect[k]
            hits += r.status == kvcellar.Status.OK
            wrong += bad
            worst = max(worst, ms)
            print(json.dumps([round(t0, 4), round(ms, 2), int(r.status), int(bad), k]), flush=True)
            n += 1
        out.update(gets=n, hits=hits, wrong=wrong, worst_ms=round(worst, 1))
    else:
        print(f"unknown command {cmd}", file=sys.stderr)
        return 2
    out["epoch_end"] = c.epoch
    c.close()
    print(json.dumps({"summary": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
