#!/usr/bin/env bash
# Runs every check and test of the project: formatting, lints, the unit,
# protocol and end-to-end tests (real binaries). Installs missing packages.
# Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# The real engines' venvs (several GB on a fresh machine, made once and kept
# outside the clone) download while cargo builds; test-engines.sh waits for them.
mkdir -p target
setsid bash scripts/engine-venvs.sh >/dev/null 2>target/engine-venvs.log &
venvs=$!
# A failing step ends the run: stop the background install with it (a venv
# without its ready-marker is redone next time).
# The Docker base image (debootstrap, about 2 minutes once, then cached) is
# made meanwhile too, for scripts/test-dist.sh.
base=
if docker info >/dev/null 2>&1; then
  setsid bash -c 'bash scripts/deps.sh --packaging && bash scripts/base-image.sh' >target/base-image.log 2>&1 &
  base=$!
fi
trap 'kill -- -$venvs 2>/dev/null || true; [ -z "$base" ] || kill -- -$base 2>/dev/null || true' EXIT

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (-D warnings), the TCP-only build and the RDMA build"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy --workspace --all-targets --locked --features rdma -- -D warnings
# Tests run on the build that ships: with RDMA (sideway; no rdma-core needed
# to build, libibverbs is loaded at run time). There is no RDMA device here:
# the data path runs over the stand-in fabric, the binaries fall back to TCP.
echo "== build binaries and libkvclient.so with RDMA (end-to-end tests use them)"
cargo build --workspace --locked --features rdma
echo "== the previous release's binaries, for the mixed-version test (built once per machine)"
for v in v1 v2 v3 v4; do
  rc=0
  prev=$(bash scripts/prev-release.sh $v) || rc=$?
  if [ "$rc" = 0 ]; then
    case $v in
      v1) export KVCELLAR_PREV_BIN_DIR=$prev KVCELLAR_REQUIRE_PREV=1 ;;
      v2) export KVCELLAR_PREV2_BIN_DIR=$prev KVCELLAR_REQUIRE_PREV2=1 ;;
      v3) export KVCELLAR_PREV3_BIN_DIR=$prev KVCELLAR_REQUIRE_PREV3=1 ;;
      v4) export KVCELLAR_PREV4_BIN_DIR=$prev KVCELLAR_REQUIRE_PREV4=1 ;;
    esac
  elif [ "$rc" = 3 ]; then
    echo "prev-release: the $v release's commit is not in this clone: its mixed-version test is skipped"
  else
    exit "$rc"
  fi
done
bash scripts/prev-release.sh --clean
echo "== cargo test"
# The test binaries are built first, apart: a link that fails for want of
# room or memory on the machine (not for the code) says so here, with the
# machine's free disk and memory, and is tried once more one job at a time.
# cargo's own report of a failed link is a page-long command line; only the
# linker's words are kept.
if ! cargo test --workspace --locked --features rdma --no-run >target/test-build.log 2>&1; then
  echo "cargo test --no-run failed; the errors and the linker's last words:"
  grep -E '^error|collect2|/ld:|ld: |No space|signal [0-9]|Killed|cannot' target/test-build.log | cut -c1-400 | tail -40
  df -h . "${XDG_CACHE_HOME:-$HOME/.cache}" 2>/dev/null || true
  free -m || true
  echo "== cargo test --no-run, again with one job"
  cargo test --workspace --locked --features rdma --no-run -j 1 2>&1 | grep -v '^ *= note: "cc"' | cut -c1-2000
fi
cargo test --workspace --locked --features rdma 2>&1 | tee target/test-output.log
echo "== fuzz targets: a bounded run over the committed corpus (fuzz/; 20 s per target)"
cargo run --locked -q -p kv-fuzz -- run --seconds 20 2>&1 | tee target/fuzz.log
echo "== Python package against real nodes (engine classes stood in)"
bash scripts/test-python.sh 2>&1 | tee target/test-python.log
echo "== Python plugins against the real SGLang, LMCache and vLLM classes, and in a real vLLM engine"
wait $venvs || echo "engine venvs: the background attempt failed (target/engine-venvs.log); trying again"
bash scripts/test-engines.sh 2>&1 | tee target/test-engines.log
echo "== packages, image and container cluster"
[ -z "$base" ] || wait $base || echo "base image: the background attempt failed (target/base-image.log); trying again"
bash scripts/test-dist.sh 2>&1 | tee target/test-dist.log
echo "== Kubernetes manifests: rendered, validated offline, the pods' commands run in containers"
bash scripts/test-k8s.sh 2>&1 | tee target/test-k8s.log
# One closing line for the whole run (cargo prints one per test binary,
# pytest one per run, the dist scripts "NAME: N passed, M failed").
cat target/test-output.log target/test-python.log target/test-engines.log target/test-dist.log target/test-k8s.log | awk '
  /^test result:/ || /^(packages|image|cluster|k8s): [0-9]+ passed, [0-9]+ failed/ {
    for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
  /(passed|failed).* in [0-9.]+s/ && !/^test result:/ {
    for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
  END { printf "tests: %d passed, %d failed\n", p, f }'
