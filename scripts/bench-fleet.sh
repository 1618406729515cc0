#!/usr/bin/env bash
# The data plane at fleet size (docs/BENCHMARKS.md, "24 nodes"), on loopback:
#
#   drain   kv-fleet-drain: NODES (default 24) nodes of one 32 MiB disk each,
#           no memory tier, 60 pages of 16 KiB a node written through a
#           client that follows the group; the node holding the most pages
#           drains (8 s) and exits; prints its push (pushed, refused, failed,
#           left, owners) and how many of its pages are hits at their new
#           owners with the handoff off. RUNS times (default 3); with
#           BEFORE=PATH (another release's kv-server) each run is followed
#           by one of that binary, alternated.
#   events  scripts/bench-trace.sh fleet: a slice of the shipped trace
#           replayed by 4 engines on NODES nodes, with a graceful stop, a join
#           of two, a kill -9 and a rolling restart of three, each beside a
#           control run of the same requests.
#
# Usage: scripts/bench-fleet.sh [drain|events|all]
#        BEFORE=/path/to/old/kv-server RUNS=3 scripts/bench-fleet.sh drain
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
nodes=${NODES:-24}
runs=${RUNS:-3}
bash scripts/deps.sh
echo "== building (release)"
cargo build --release --locked --bins -q --features rdma
if [ "$what" = drain ] || [ "$what" = all ]; then
  for i in $(seq "$runs"); do
    echo "== drain run $i: this tree"
    target/release/kv-fleet-drain --nodes "$nodes"
    if [ -n "${BEFORE:-}" ]; then
      echo "== drain run $i: $BEFORE"
      target/release/kv-fleet-drain --nodes "$nodes" --server-bin "$BEFORE"
    fi
  done
fi
if [ "$what" = events ] || [ "$what" = all ]; then
  NODES=$nodes bash scripts/bench-trace.sh fleet
fi
