#!/usr/bin/env bash
# The client benchmarks (docs/BENCHMARKS.md, "Client and cluster"): three kv-server nodes on loopback (512 MiB memory
# tier on, disks under a temp dir), kvctl bench with 8 threads, each workload
# run RUNS times (default 3); every line is printed with the limit measured in
# the same run. Nodes are stopped (by PID) at the end.
#
# Usage: scripts/bench-cluster.sh [RUNS] [WORK_DIR]
#   KVCELLAR_BIN=DIR   kv-server and kvctl from DIR (say, a release build of
#                      an earlier commit, to alternate with this tree's)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
# A work dir of our own is removed at the end (the nodes' disks hold GBs,
# and runs alternated in one session would otherwise fill the disk and slow
# the later ones); one given is kept, logs and all.
own_work=0
if [ -n "${2:-}" ]; then work=$2; else work=$(mktemp -d); own_work=1; fi
mkdir -p "$work"
if [ -n "${KVCELLAR_BIN:-}" ]; then
  bin=$KVCELLAR_BIN
else
  cargo build --release --bins -q --features rdma
  bin=target/release
fi
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ "$own_work" = 1 ] && rm -rf "$work"
  return 0
}
trap cleanup EXIT INT TERM
source scripts/bench-nodes.sh
start_bench_nodes 8G
echo "members: $members  (work dir $work)"
run() { # label, kvctl bench args...
  local label=$1; shift
  for r in $(seq "$runs"); do
    echo "== $label (run $r)"
    "$bin/kvctl" bench --members "$members" "$@"
  done
}
run "get 4 MiB, pages in the nodes' memory tier" --threads 8 --op get --size 4M --count 400 --keys 64
run "put 4 MiB" --threads 8 --op put --size 4M --count 200 --raw-disk "$work"
# Batch exists: 20,000 batches a run (under a second here). With 3,000 the
# p99 is the 30 worst samples and one descheduling moves it: A/B tables of
# those runs spread +-20 % (docs/BENCHMARKS.md, sets W and X).
run "batch exist, 128 keys" --threads 8 --op batch-exist --batch 128 --size 4K --count 20000 --keys 1024
run "batch exist, 128 keys, one thread" --op batch-exist --batch 128 --size 4K --count 20000 --keys 1024 --threads 1
run "get 64 KiB" --threads 8 --op get --size 64K --count 40000 --keys 1024
run "batch get 64 KiB x32 (pipelined per connection)" --threads 8 --op get --size 64K --batch 32 --count 1500 --keys 1024
run "batch put 64 KiB x32" --threads 8 --op put --size 64K --batch 32 --count 400
