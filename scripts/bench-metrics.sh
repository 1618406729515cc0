#!/usr/bin/env bash
# The cost of the nodes' latency histograms (docs/BENCHMARKS.md), histograms on and
# off (KVCELLAR_LATENCY_HISTOGRAMS=0), two ways:
# 1. instructions (repeatable whatever the machine's noise): one node under
#    valgrind's callgrind serves the same 4,000 gets of 64 KiB from its
#    memory tier (kvctl bench, 2 threads); the node's instructions in all;
# 2. throughput: the 64 KiB get benchmark of scripts/bench-cluster.sh (three
#    nodes on loopback, pages in their 512 MiB memory tier, 8 client threads),
#    alternating on and off, ROUNDS rounds of each, every run printed beside
#    the raw loopback limit measured in it, then the medians.
#
# Usage: scripts/bench-metrics.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
work=$(mktemp -d)
cargo build --release --bins -q --features rdma
bin=target/release
pids=()
stop_nodes() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done; pids=(); }
trap 'stop_nodes; rm -rf "$work"' EXIT INT TERM
source scripts/bench-nodes.sh
start_nodes() { # histograms (1 or 0)
  rm -rf "$work"/n*
  start_bench_nodes 2G KVCELLAR_LATENCY_HISTOGRAMS="$1" >/dev/null
}
: >"$work/results"
echo "== instructions per node (callgrind), 4,000 gets of 64 KiB"
declare -A insns
for h in 1 0; do
  rm -rf "$work/cg"
  KVCELLAR_LATENCY_HISTOGRAMS=$h valgrind --tool=callgrind --callgrind-out-file="$work/cg.$h" \
    "$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/cg" --cap 1G --mem-cap 256M --log-level warn \
    >"$work/cg.out" 2>"$work/cg.log" &
  vp=$!
  a=
  for _ in $(seq 600); do
    a=$(sed -n 's/^kv-server listening on //p' "$work/cg.out" 2>/dev/null || true)
    [ -n "$a" ] && break
    sleep 0.1
  done
  [ -n "$a" ] || { echo "node under callgrind did not start"; cat "$work/cg.log"; exit 1; }
  "$bin/kvctl" bench --node "$a" --op get --size 64K --keys 256 --count 4000 --threads 2 --no-raw --prefix cg >/dev/null
  kill -TERM $vp
  wait $vp || true
  insns[$h]=$(sed -n 's/^summary: //p' "$work/cg.$h")
  echo "histograms $([ $h = 1 ] && echo on || echo off): ${insns[$h]} instructions"
done
python3 -c 'import sys; on, off = int(sys.argv[1]), int(sys.argv[2]); print("instructions: histograms add %+.2f%% (%d per request of ~4,256)" % (100 * (on - off) / off, (on - off) / 4256))' "${insns[1]}" "${insns[0]}"
echo "== throughput, $rounds rounds each, alternating"
for r in $(seq "$rounds"); do
  for h in 1 0; do
    start_nodes "$h"
    out=$("$bin/kvctl" --json bench --members "$members" --threads 8 --op get --size 64K --count 40000 --keys 1024)
    stop_nodes
    echo "$out" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
h, r, path = sys.argv[1], sys.argv[2], sys.argv[3]
label = "on " if h == "1" else "off"
ops, ratio = j["ops_per_sec"], j.get("ratio_loopback", 0)
print("round %s histograms %s: %.0f ops/s  p50 %.0f us  p99 %.0f us  (%.0f%% of raw loopback)"
      % (r, label, ops, j["p50_us"], j["p99_us"], 100 * ratio))
with open(path, "a") as f:
    f.write("%s %s %s\n" % (h, ops, ratio))' "$h" "$r" "$work/results"
  done
done
python3 - "$work/results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
on = [float(x[1]) for x in rows if x[0] == "1"]
off = [float(x[1]) for x in rows if x[0] == "0"]
ron = [float(x[2]) for x in rows if x[0] == "1"]
roff = [float(x[2]) for x in rows if x[0] == "0"]
m_on, m_off = statistics.median(on), statistics.median(off)
print(f"median get 64 KiB: histograms on {m_on:.0f} ops/s (loopback ratio {100*statistics.median(ron):.0f}%), "
      f"off {m_off:.0f} ops/s ({100*statistics.median(roff):.0f}%): cost {100*(1-m_on/m_off):+.1f}% of throughput")
PY
