#!/usr/bin/env bash
# "Ready means fast" (docs/BENCHMARKS.md): how fast three nodes with a 1 GiB
# memory tier serve right after they start. For each run: start 3 kv-server
# nodes on loopback, wait for each one's "listening" line, then at once put
# 1 GiB of 2 MiB pages (4 threads) and get them back. Prints the time until
# all three listened, both rates, the time from start until the gets were
# done, and each node's logged arena fault-in time. Nodes stopped by PID.
#
# Usage: scripts/bench-ready.sh [RUNS]      (default 3; release build)
#   BEFORE=DIR   also run the binaries in DIR (kv-server, kvctl), alternating
#   WAIT=SECS    wait this long after the nodes listen before the workload
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
cargo build --release --locked --bins -q --features rdma
one() { # BIN_DIR LABEL
  local bin=$1 label=$2 work i a t0 t1 t2 put get ms members=""
  work=$(mktemp -d)
  pids=()
  t0=$(date +%s%N)
  for i in 0 1 2; do
    "$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/n$i" --cap 4G --mem-cap 1G --log-level info \
      --drain-secs 0 >"$work/n$i.out" 2>"$work/n$i.log" &
    pids+=($!)
  done
  for i in 0 1 2; do
    a=
    for _ in $(seq 6000); do # up to 60 s
      a=$(sed -n 's/^kv-server listening on //p' "$work/n$i.out" 2>/dev/null || true)
      [ -n "$a" ] && break
      sleep 0.01
    done
    [ -n "$a" ] || { echo "node $i did not start"; cat "$work/n$i.log"; exit 1; }
    members="${members}n$i=$a,"
  done
  t1=$(date +%s%N)
  sleep "${WAIT:-0}"
  put=$("$bin/kvctl" bench --members "$members" --threads 4 --op put --size 2M --count 512 --keys 512 --no-raw |
    sed -n 's/.*ops\/s, \(.*\) GB\/s/\1/p')
  get=$("$bin/kvctl" bench --members "$members" --threads 4 --op get --size 2M --count 512 --keys 512 --no-raw |
    sed -n 's/.*ops\/s, \(.*\) GB\/s/\1/p')
  t2=$(date +%s%N)
  ms=$(sed -n 's/.*memory arena faulted in.* ms=\([0-9]*\).*/\1/p' "$work"/n*.log | tr '\n' ' ')
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
  rm -rf "$work"
  printf '%-8s listening after %5d ms  put %s GB/s  get %s GB/s  start to done %5d ms  arena fault-in ms: %s\n' \
    "$label" $(((t1 - t0) / 1000000)) "$put" "$get" $(((t2 - t0) / 1000000)) "${ms:-(not logged)}"
}
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' EXIT INT TERM
for r in $(seq "$runs"); do
  [ -n "${BEFORE:-}" ] && one "$BEFORE" before
  one target/release now
done
