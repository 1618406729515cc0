#!/usr/bin/env bash
# The plugin benchmark of docs/BENCHMARKS.md ("Plugins"): what kvcellar.hicache
# kvcellar.lmcache and kvcellar.vllm add to a batch beside the C ABI on the
# same buffers (vLLM's part runs in the vLLM venv of scripts/engine-venvs.sh).
# Builds release binaries, starts 3 nodes on loopback, prints medians.
# Usage: scripts/bench-plugins.sh [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release --locked -p kv-server -p kvclient --features kv-server/rdma,kvclient/rdma
bash scripts/test-python.sh --co -q >/dev/null # makes the test venv (pytest) if missing
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
PYVER=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
py=$(ls -d "$CACHE"/venv-test-py"$PYVER"-pytest*/bin/python | tail -1)
export PYTHONPATH=$PWD/plugins KVCELLAR_FORCE_STANDIN=1 KVCELLAR_BIN_DIR=$PWD/target/release
export KVCELLAR_LIB=$PWD/target/release/libkvclient.so
"$py" plugins/bench/bench_plugins.py "$@"
eval "$(bash scripts/engine-venvs.sh vllm)"
unset KVCELLAR_FORCE_STANDIN
"$VLLM_PY" plugins/bench/bench_plugins.py --only vllm "$@"
