#!/usr/bin/env bash
# Thundering herd (docs/BENCHMARKS.md, "Hot keys"): 64 client threads of one
# kvctl read the same 8 pages of 64 KiB at once on 10 loopback nodes, from a
# cold start (nothing hot yet): once with hot keys' reads spread (the
# default) and once with spreading off (handoff_ms=0 turns copies off).
# Prints, per run, the gets' p50/p99 and the busiest node's share of the
# reads (max over mean of the nodes' hits) in the first second and after it.
#
# Usage: scripts/bench-herd.sh [SECONDS]   (after cargo build --release --bins)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-6}
bin=${KVCELLAR_BIN:-$PWD/target/release}
work=$(mktemp -d)
trap 'bash scripts/trace-cluster.sh "$work" down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

hits() { # per-node hits, one line, in node order
  "$bin/kvctl" --json stat --all --mds "$mds" --group trace |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(" ".join(str(n["stats"]["hits"]) for n in sorted(j["nodes"], key=lambda n: n["id"])))'
}

balance() { # balance "A" "B": max/mean of the differences B - A
  python3 -c 'import sys; a=[int(x) for x in sys.argv[1].split()]; b=[int(x) for x in sys.argv[2].split()]; d=[y-x for x,y in zip(a,b)]; m=sum(d)/len(d); print(f"{max(d)/m:.2f}x (reads {sum(d)})" if m else "no reads")' "$1" "$2"
}

for mode in spread off; do
  bash scripts/trace-cluster.sh "$work" down >/dev/null 2>&1 || true
  rm -rf "$work"/*
  NODES=10 bash scripts/trace-cluster.sh "$work" up 1 256M 600 >/dev/null
  mds=$(bash scripts/trace-cluster.sh "$work" mds)
  opts=""
  [ "$mode" = off ] && opts="handoff_ms=0"
  out=$work/bench.out
  h0=$(hits)
  "$bin/kvctl" bench --mds "$mds" --group trace --options "$opts" --op get --keys 8 --threads 64 \
    --size 64K --duration "$secs" --no-raw >"$out" 2>&1 &
  pid=$!
  # The first second starts when the 8 pages are stored (the bench stores
  # them first): wait for the first hits.
  for _ in $(seq 200); do
    h=$(hits)
    [ "$h" != "$h0" ] && break
    sleep 0.05
  done
  h0=$(hits)
  sleep 1
  h1=$(hits)
  wait "$pid"
  h2=$(hits)
  echo "== $mode: $(grep -E 'ops/s' "$out" | head -1)"
  grep -E 'p50|p99' "$out" | head -2
  echo "busiest/mean, first second: $(balance "$h0" "$h1")"
  echo "busiest/mean, after it:     $(balance "$h1" "$h2")"
done
