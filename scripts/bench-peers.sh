#!/usr/bin/env bash
# kvcellar beside two peer KV-cache stores, same harness, same workload
# (docs/BENCHMARKS.md, "Peers"): DingoCache 2.7.0 (dfkv) and Mooncake Store.
# Each system gets three storage processes on loopback and is driven by
# plugins/bench/peers.py through its own batch put/get calls from caller
# buffers: 4 client threads, batches of 8 pages, about $BYTES of fresh
# pages per page size, put then get (gets check each page's length and its
# first and last bytes). Fresh servers for every system and run; the order
# of the systems rotates from run to run; the table shows medians, what
# each system's put acknowledgement means, and kvcellar / best peer.
#
# Everything (servers and client) runs in a private network namespace that
# has only `lo`, because the peers listen on the wildcard address: this
# needs root (unshare -n).
#
# Usage: scripts/bench-peers.sh [RUNS]            (default 3)
#   SIZES="64K 4M"        page sizes (default 64K 256K 1M 4M)
#   BYTES=512M            bytes per (system, size, op)
#   SYSTEMS="..."         default "kvcellar dfkv mooncake"; add kvcellar-mem
#                         for kvcellar nodes with --ack memory
#   DFKV_PREFIX=DIR       a DingoCache v2.7.0 built by hand (dfkv_server,
#                         libdfkv.so; docs/BENCHMARKS.md says how). This
#                         script never fetches or builds DingoCache.
#   DFKV_BATCH_CONCURRENCY=1  dfkv's per-call fan-out (1, as its own bench
#                         advises when threads give the concurrency; 0: auto)
#   MC_SEGMENT=2G         DRAM each Mooncake storage process contributes
#   KVCELLAR_LIB=PATH     the libkvclient.so to use (default target/release)
# Mooncake (PyPI mooncake-transfer-engine-non-cuda, pinned below) goes into
# a venv under $KVCELLAR_CACHE (default ~/.cache/kvcellar)/peers. Results:
# $KVCELLAR_WORK (default target/bench-peers)/results.jsonl, summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
MC_VERSION=0.3.13.post1
runs=${1:-3}
sizes=${SIZES:-64K 256K 1M 4M}
bytes=${BYTES:-512M}
systems=${SYSTEMS:-kvcellar dfkv mooncake}
cache=${KVCELLAR_CACHE:-$HOME/.cache/kvcellar}
work=${KVCELLAR_WORK:-$PWD/target/bench-peers}
mc_venv=$cache/peers/mooncake-$MC_VERSION-py3.11
bin=$PWD/target/release

# --- outside the namespace: what needs the network or a compiler ----------
if [ -z "${KVCELLAR_PEERS_NETNS:-}" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "bench-peers: needs root (it runs everything in 'unshare -n', a namespace with only loopback)" >&2
    exit 1
  fi
  command -v unshare >/dev/null && command -v ip >/dev/null ||
    { echo "bench-peers: needs unshare (util-linux) and ip (iproute2)" >&2; exit 1; }
  if [ ! -x "$bin/kv-server" ] || [ ! -x "$bin/kvctl" ]; then
    echo "== building kv-server and kvctl (release)"
    flock /tmp/cargo.lock cargo build --release --locked -p kv-server -p kvctl --features kv-server/rdma -q
  fi
  if [ -z "${KVCELLAR_LIB:-}" ] && [ ! -f "$bin/libkvclient.so" ]; then
    echo "== building libkvclient.so (release)"
    flock /tmp/cargo.lock cargo build --release --locked -p kvclient --features kvclient/rdma -q
  fi
  notes=()
  # Mooncake: a venv keyed on the pinned version; the wheel is cp311.
  mc_status=skip
  case " $systems " in *" mooncake "*)
    if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
      echo "== installing libibverbs1 (Mooncake's wheel links it; no RDMA device is used)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
    fi
    if [ ! -f "$mc_venv/.kvcellar-ready" ]; then
      if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        echo "== Mooncake $MC_VERSION into $mc_venv"
        rm -rf "$mc_venv"
        python3 -m venv "$mc_venv"
        "$mc_venv/bin/pip" install -q "mooncake-transfer-engine-non-cuda==$MC_VERSION" &&
          "$mc_venv/bin/python" -c 'import mooncake.store' && touch "$mc_venv/.kvcellar-ready" || true
      fi
    fi
    [ -f "$mc_venv/.kvcellar-ready" ] && mc_status=ok ||
      notes+=("Mooncake: not available (needs python3.11 and PyPI mooncake-transfer-engine-non-cuda==$MC_VERSION)")
  esac
  export KVCELLAR_PEERS_NETNS=1 KVCELLAR_PEERS_MC=$mc_status
  export KVCELLAR_PEERS_NOTES="$(printf '%s\n' "${notes[@]+"${notes[@]}"}")"
  exec unshare -n bash "$0" "$@"
fi

# --- inside the namespace -------------------------------------------------
ip link set lo up
export KVCELLAR_LIB=${KVCELLAR_LIB:-$bin/libkvclient.so}
export PYTHONPATH=$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}
export MC_TCP_BIND_ADDRESS=127.0.0.1
harness=$PWD/plugins/bench/peers.py
rm -rf "$work"
mkdir -p "$work"
results=$work/results.jsonl
raw=$work/raw-loopback.jsonl
: >"$results"
notes=()
[ -n "${KVCELLAR_PEERS_NOTES:-}" ] && mapfile -t notes <<<"$KVCELLAR_PEERS_NOTES"

pids=()
cleanup() { # TERM every process started here, KILL what is left after 20 s
  local p deadline=$((SECONDS + 20))
  for p in "${pids[@]+"${pids[@]}"}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]+"${pids[@]}"}"; do
    while kill -0 "$p" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  pids=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
source scripts/bench-nodes.sh

# wait_for SECS WHAT CMD...: polls CMD every 0.1 s until it succeeds or SECS pass.
wait_for() {
  local secs=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@"; do
    if [ $SECONDS -ge $deadline ]; then echo "bench-peers: $what not ready after ${secs}s" >&2; return 1; fi
    sleep 0.1
  done
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
listening() { python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 1)" 2>/dev/null; }
sz() { python3 -c "import sys; sys.path.insert(0, '$PWD/plugins/bench'); import peers; print(peers.parse_size('$1'))"; }

# start_SYSTEM DIR: three storage processes; sets $target for the harness.
start_kvcellar() {
  local work=$1
  start_bench_nodes 8G
  target=$members
}
start_kvcellar-mem() {
  local work=$1
  # Memory acks get the DRAM a Mooncake storage process gets ($MC_SEGMENT,
  # 2 GiB), half of it for pages not yet flushed, so a run's puts are
  # acknowledged from memory as the peers' are rather than falling back to
  # media past the default bound (a quarter of the tier).
  BENCH_MEM_CAP=${MC_SEGMENT:-2G} BENCH_NODE_ARGS="--ack memory --ack-memory-max $(( $(sz "${MC_SEGMENT:-2G}") / 2 ))" \
    start_bench_nodes 8G
  target=$members
}
start_dfkv() {
  local dir=$1 i p members=""
  for i in 1 2 3; do
    mkdir -p "$dir/d$i"
    # --cap: decimal bytes, a whole number of 1 GiB extents (fallocated at start)
    "$DFKV_PREFIX/dfkv_server" --dir "$dir/d$i" --port 0 --cap 4294967296 --log WARN \
      >"$dir/s$i.out" 2>"$dir/s$i.log" &
    pids+=($!)
  done
  for i in 1 2 3; do
    wait_for 60 "dfkv_server $i" grep -q '^PORT ' "$dir/s$i.out" || { cat "$dir/s$i.log" >&2; return 1; }
    p=$(sed -n 's/^PORT \([0-9]*\).*/\1/p' "$dir/s$i.out" | head -1)
    members="${members:+$members,}n$i=127.0.0.1:$p"
  done
  target=$members
}
start_mooncake() {
  local dir=$1 i port mport
  port=$(free_port)
  mport=$(free_port)
  "$mc_venv/bin/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$port" \
    --metrics_host=127.0.0.1 --metrics_port="$mport" >"$dir/master.log" 2>&1 &
  pids+=($!)
  wait_for 30 "mooncake_master" listening "$port" || { cat "$dir/master.log" >&2; return 1; }
  for i in 1 2 3; do
    "$mc_venv/bin/python" "$harness" mooncake-serve --master "127.0.0.1:$port" --segment "${MC_SEGMENT:-2G}" \
      >"$dir/store$i.out" 2>"$dir/store$i.log" &
    pids+=($!)
  done
  for i in 1 2 3; do
    wait_for 60 "mooncake storage process $i" grep -q '^READY' "$dir/store$i.out" || { tail -20 "$dir/store$i.log" >&2; return 1; }
  done
  target=127.0.0.1:$port
}

# Which systems can run.
active=()
for s in $systems; do
  case $s in
    kvcellar | kvcellar-mem) active+=("$s") ;;
    dfkv)
      if [ -n "${DFKV_PREFIX:-}" ] && [ -x "$DFKV_PREFIX/dfkv_server" ] && [ -f "$DFKV_PREFIX/libdfkv.so" ]; then
        active+=(dfkv)
      else
        notes+=("DingoCache: not built (set DFKV_PREFIX; docs/BENCHMARKS.md says how)")
      fi ;;
    mooncake) [ "${KVCELLAR_PEERS_MC:-}" = ok ] && active+=(mooncake) ;;
    *) echo "bench-peers: unknown system $s" >&2; exit 2 ;;
  esac
done
for n in "${notes[@]+"${notes[@]}"}"; do [ -n "$n" ] && echo "$n"; done
csizes=$(echo $sizes | tr ' ' ,)
echo "== systems: ${active[*]}; sizes $csizes; $bytes per measurement; $runs run(s)"

for run in $(seq "$runs"); do
  # Rotate the order of the systems from run to run.
  k=$(((run - 1) % ${#active[@]}))
  order=("${active[@]:$k}" "${active[@]:0:$k}")
  for s in "${order[@]}"; do
    dir=$work/$s-$run
    mkdir -p "$dir"
    echo "-- run $run: $s"
    if ! "start_$s" "$dir"; then
      echo "bench-peers: $s did not start (logs in $dir)"
      cleanup
      continue
    fi
    py=python3
    [ "$s" = mooncake ] && py=$mc_venv/bin/python
    # The client's own log (Mooncake's is verbose) goes to $dir/client.log.
    if ! "$py" "$harness" run --system "$s" --target "$target" --sizes "$csizes" --bytes "$bytes" --run "$run" \
      --prefix "peers-$run-$s" --out "$results" 2>"$dir/client.log"; then
      echo "bench-peers: $s run $run: some pages failed or the client failed; its log's tail:"
      tail -5 "$dir/client.log"
    fi
    # Once: the plain TCP loopback figure of the same sizes (kvctl bench --op get).
    if [ "$s" = kvcellar ] && [ ! -s "$raw" ]; then
      for size in $sizes; do
        b=$(sz "$size")
        "$bin/kvctl" --json bench --members "$target" --op get --size "$size" --threads 4 --batch 8 \
          --count "$(((256 << 20) / (8 * b) > 16 ? (256 << 20) / (8 * b) : 16))" \
          --keys "$(((256 << 20) / b > 64 ? (256 << 20) / b : 64))" >>"$raw" || true
      done
    fi
    cleanup
    rm -rf "$dir"/n? "$dir"/d? # the stores' disks
  done
done

echo
python3 "$harness" table "$results" --raw "$raw" | tee "$work/summary.txt"
for n in "${notes[@]+"${notes[@]}"}"; do [ -n "$n" ] && echo "$n" | tee -a "$work/summary.txt"; done
true
