#!/usr/bin/env bash
# Storage backends compared through the engines, the way a user chooses
# between them (plugins/bench/backends.py says exactly what is timed):
#   SGLang 0.5.23 HiCache on its real CPU host pool (MHA page_first, pages of
#   256 KiB and 4 MiB, batches of 64): kvcellar (kvcellar.hicache through
#   SGLang's StorageBackendFactory, v1), kvcellar-mem (the same, nodes with
#   --ack memory), SGLang's file backend (HiCacheFile) and its mooncake
#   backend (MooncakeStore over Mooncake Store, TCP, three storage processes);
#   set, exists and get of fresh pages, every byte read back checked.
#   LMCache 0.5.6: RemoteBackend over kvcellar.lmcache against LocalDiskBackend,
#   built by LMCache from its own config, batches of 8 chunks of 4 and 32 MiB.
# kvcellar runs on three kv-server nodes (target/release, --mem-cap 1G) on
# loopback. Fresh servers for every backend and run; the order of the
# backends rotates from run to run; every round is printed, then a table of
# medians with each run's figures and kvcellar's ratios.
#
# Everything (servers and engines) runs in a private network namespace that
# has only `lo` (unshare -n, so root), as in bench-peers.sh: Mooncake's
# transfer engine opens listening ports that no flag binds to 127.0.0.1.
#
# Usage: scripts/bench-backends.sh [RUNS]          (default 3)
#   ROUNDS=5                   counted rounds per (backend, geometry), after a warm-up round
#   ENGINES="sglang lmcache"
#   SGLANG_BACKENDS=kvcellar,kvcellar-mem,file,mooncake
#   SGLANG_GEOMETRIES=256K,4M
#   LMCACHE_BACKENDS=kvcellar,kvcellar-mem,local_disk
#   LMCACHE_GEOMETRIES=4M,32M
#   MC_SEGMENT=2G              DRAM each Mooncake storage process contributes
#   KVCELLAR_LIB=PATH          the libkvclient.so (default target/release/libkvclient.so)
# Installs what is missing: the engine venvs (scripts/engine-venvs.sh),
# Mooncake Store (PyPI mooncake-transfer-engine-non-cuda, pinned as in
# bench-peers.sh) into SGLang's venv, libibverbs1 (Mooncake's wheel links it;
# no RDMA device is used); builds kv-server and libkvclient.so (release) only
# when target/release lacks them. Results: $KVCELLAR_WORK (default
# target/bench-backends)/results.jsonl (one JSON line per figure),
# rounds.txt (every round), summary.txt (the table), logs/ (servers),
# run<N>-<engine>.log (the engines' own logs).
set -euo pipefail
cd "$(dirname "$0")/.."
MC_VERSION=0.3.13.post1
MC_PACKAGE=mooncake-transfer-engine-non-cuda
runs=${1:-3}
rounds=${ROUNDS:-5}
engines=${ENGINES:-sglang lmcache}
sglang_backends=${SGLANG_BACKENDS:-kvcellar,kvcellar-mem,file,mooncake}
lmcache_backends=${LMCACHE_BACKENDS:-kvcellar,kvcellar-mem,local_disk}
work=${KVCELLAR_WORK:-$PWD/target/bench-backends}
bin=$PWD/target/release
harness=plugins/bench/backends.py

# --- outside the namespace: what needs the network or a compiler ----------
if [ -z "${KVCELLAR_BACKENDS_NETNS:-}" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "bench-backends: needs root (it runs everything in 'unshare -n', a namespace with only loopback)" >&2
    exit 1
  fi
  command -v unshare >/dev/null && command -v ip >/dev/null ||
    { echo "bench-backends: needs unshare (util-linux) and ip (iproute2)" >&2; exit 1; }
  if [ ! -x "$bin/kv-server" ] || { [ -z "${KVCELLAR_LIB:-}" ] && [ ! -f "$bin/libkvclient.so" ]; }; then
    echo "== building kv-server and libkvclient.so (release)"
    bash scripts/deps.sh
    cargo build --release --locked -p kv-server -p kvclient \
      --features kv-server/rdma,kvclient/rdma -q
  fi
  rm -rf "$work"
  mkdir -p "$work"
  want=()
  for e in $engines; do
    case $e in sglang | lmcache) want+=("$e") ;; *) echo "bench-backends: unknown engine $e" >&2; exit 2 ;; esac
  done
  eval "$(bash scripts/engine-venvs.sh "${want[@]}")"
  skip=""
  case " $engines " in *" sglang "*)
    case ",$sglang_backends," in *",mooncake,"*)
      if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
        echo "== installing libibverbs1 (Mooncake's wheel links it; no RDMA device is used)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
      fi
      mc_log=$work/mooncake-install.log
      if ! "$SGLANG_PY" -c 'import mooncake.store' 2>/dev/null; then
        echo "== $MC_PACKAGE==$MC_VERSION into SGLang's venv (log: $mc_log)"
        "$SGLANG_PY" -m pip install --disable-pip-version-check "$MC_PACKAGE==$MC_VERSION" >"$mc_log" 2>&1 || true
      fi
      if out=$("$SGLANG_PY" -c 'import mooncake.store' 2>&1); then
        have=$("$SGLANG_PY" -c "import importlib.metadata as m; print(m.version('$MC_PACKAGE'))" 2>/dev/null || echo "?")
        [ "$have" = "$MC_VERSION" ] || echo "bench-backends: note: SGLang's venv has $MC_PACKAGE $have, not $MC_VERSION"
        # Anything Mooncake's install broke in SGLang's venv is said, not hidden.
        "$SGLANG_PY" -m pip check >"$work/pip-check.txt" 2>&1 ||
          { echo "bench-backends: note: pip check in SGLang's venv:"; cat "$work/pip-check.txt"; }
      else
        skip="mooncake=mooncake.store does not import in SGLang's venv: $(echo "$out" | tail -1)"
      fi
    esac
  esac
  export KVCELLAR_BACKENDS_NETNS=1 KVCELLAR_BACKENDS_SKIP="$skip" SGLANG_PY="${SGLANG_PY:-}" LMCACHE_PY="${LMCACHE_PY:-}"
  exec unshare -n bash "$0" "$@"
fi

# --- inside the namespace -------------------------------------------------
ip link set lo up
export KVCELLAR_LIB=${KVCELLAR_LIB:-$bin/libkvclient.so}
export PYTHONPATH=$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}
export MC_TCP_BIND_ADDRESS=127.0.0.1 LMCACHE_TRACK_USAGE=false LMCACHE_LOG_LEVEL=WARNING
# Each backend takes its configuration from this harness only: the real
# engine classes (no stand-ins), no Mooncake or HiCacheFile settings from
# the environment.
unset KVCELLAR_FORCE_STANDIN KVCELLAR_MDS KVCELLAR_MEMBERS KVCELLAR_OPTIONS SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR \
  SGLANG_HICACHE_MOONCAKE_CONFIG_PATH MOONCAKE_MASTER MOONCAKE_CLIENT MOONCAKE_LOCAL_HOSTNAME LOCAL_HOSTNAME \
  MOONCAKE_PROTOCOL MOONCAKE_GLOBAL_SEGMENT_SIZE MOONCAKE_TE_META_DATA_SERVER MOONCAKE_DEVICE \
  SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY
results=$work/results.jsonl
: >"$results"
skip=()
[ -n "${KVCELLAR_BACKENDS_SKIP:-}" ] && skip=(--skip "$KVCELLAR_BACKENDS_SKIP")

pid=""
stop_child() { # the harness stops and reaps its own servers on SIGTERM
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  pid=""
}
trap stop_child EXIT
trap 'exit 130' INT TERM

echo "== $runs run(s) of $rounds counted rounds; engines: $engines"
status=0
for run in $(seq "$runs"); do
  for engine in $engines; do
    case $engine in
      sglang)
        py=$SGLANG_PY
        args=(--backends "$sglang_backends" --geometries "${SGLANG_GEOMETRIES:-256K,4M}" --mc-segment "${MC_SEGMENT:-2G}"
          "${skip[@]+"${skip[@]}"}") ;;
      lmcache)
        py=$LMCACHE_PY
        args=(--backends "$lmcache_backends" --geometries "${LMCACHE_GEOMETRIES:-4M,32M}") ;;
    esac
    echo "-- run $run: $engine"
    log=$work/run$run-$engine.log
    "$py" "$harness" "$engine" --run "$run" --rounds "$rounds" --out "$results" --work "$work" \
      --bin-dir "$bin" "${args[@]}" 2>"$log" > >(tee -a "$work/rounds.txt") &
    pid=$!
    if ! wait "$pid"; then
      status=1
      echo "bench-backends: run $run, $engine: a backend failed or did not run (the table says which); log: $log"
    fi
    pid=""
  done
done

echo
python3 "$harness" table "$results" | tee "$work/summary.txt"
exit $status
