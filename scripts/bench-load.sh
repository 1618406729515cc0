#!/usr/bin/env bash
# Load held (docs/BENCHMARKS.md, "Load held"): three release nodes under 64 client threads
# and 1,050 idle connections for KVCELLAR_LOAD_SECS (default 60); prints
# throughput, latency against the I/O timeout, and each node's RSS and open
# fds idle, at peak and after (tests/tests/load.rs). A benchmark, not a CI
# test: run it by hand (scripts/test-slow.sh does) and report the figures.
# Usage: scripts/bench-load.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
export KVCELLAR_LOAD_SECS=${1:-${KVCELLAR_LOAD_SECS:-60}}
# The idle crowd and the clients need more descriptors than the default 1024.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cargo build --release --workspace --locked -q --features rdma
cargo test --release --locked -q --features rdma -p kv-e2e --test load -- --ignored --nocapture
