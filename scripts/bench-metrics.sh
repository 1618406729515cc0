#!/usr/bin/env bash
# The cost of the nodes' latency histograms (issue 12): the 64 KiB get
# benchmark of scripts/bench-cluster.sh (three nodes on loopback, pages in
# their 512 MiB memory tier, 8 client threads) with the histograms on and off
# (KVCELLAR_LATENCY_HISTOGRAMS=0), alternating, ROUNDS rounds of each; prints
# every run beside the raw loopback limit measured in it, then the medians.
#
# Usage: scripts/bench-metrics.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
work=$(mktemp -d)
cargo build --release --bins -q
bin=target/release
pids=()
stop_nodes() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done; pids=(); }
trap 'stop_nodes; rm -rf "$work"' EXIT INT TERM
start_nodes() { # histograms (1 or 0)
  members=""
  rm -rf "$work"/n*
  for i in 0 1 2; do
    KVCELLAR_LATENCY_HISTOGRAMS=$1 "$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/n$i" --cap 2G --mem-cap 512M \
      --log-level info >"$work/n$i.out" 2>"$work/n$i.log" &
    pids+=($!)
  done
  for i in 0 1 2; do
    a=
    for _ in $(seq 300); do
      a=$(sed -n 's/^kv-server listening on //p' "$work/n$i.out" 2>/dev/null || true)
      [ -n "$a" ] && break
      sleep 0.1
    done
    [ -n "$a" ] || { echo "node $i did not start"; cat "$work/n$i.log"; exit 1; }
    members="${members}n$i=$a,"
    for _ in $(seq 600); do
      grep -q "memory arena faulted in" "$work/n$i.log" 2>/dev/null && break
      sleep 0.1
    done
  done
}
: >"$work/results"
for r in $(seq "$rounds"); do
  for h in 1 0; do
    start_nodes "$h"
    out=$("$bin/kvctl" --json bench --members "$members" --threads 8 --op get --size 64K --count 40000 --keys 1024)
    stop_nodes
    echo "$out" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read()); h = sys.argv[1]; r = sys.argv[2]
label = "on " if h == "1" else "off"
print(f"round {r} histograms {label}: {j[\"ops_per_sec\"]:.0f} ops/s  p50 {j[\"p50_us\"]:.0f} us  p99 {j[\"p99_us\"]:.0f} us"
      f"  raw loopback {j.get(\"raw_loopback_round_trips_per_sec\", 0):.0f} ops/s (ratio {100*j.get(\"ratio_loopback\", 0):.0f}%)")
with open(sys.argv[3], "a") as f:
    f.write(f"{h} {j[\"ops_per_sec\"]} {j.get(\"ratio_loopback\", 0)}\n")' "$h" "$r" "$work/results"
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
