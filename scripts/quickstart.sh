#!/usr/bin/env bash
# The main job: a local kvcellar cluster on loopback.
#
# Builds release binaries, then starts under a work dir: etcd, two kv-mds
# replicas and three kv-server nodes (two disk dirs each; node n3 has weight
# 2), all on 127.0.0.1. Shows `kvctl ring`, a 4 MiB page round trip through
# the group, a short `kvctl bench` (with `kvctl top` during its gets), and
# `kvctl stat --all`, and where the dashboards are. Then stops everything it
# started (also on Ctrl-C).
#
# Usage: scripts/quickstart.sh [--keep]   leave the cluster running
#        scripts/quickstart.sh stop       stop a cluster left running
# Work dir: $KVCELLAR_WORK (default ./.kvcellar-work); logs are there.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${KVCELLAR_WORK:-$PWD/.kvcellar-work}
pids="$work/pids"

# Stops what a run started, newest first: nodes (they deregister), then the
# MDS replicas, then etcd. Only PIDs this script recorded are signalled.
stop_all() {
  [ -d "$pids" ] || return 0
  for f in "$pids"/node-*.pid "$pids"/mds-*.pid "$pids"/etcd.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  echo "== stopped everything the quickstart started (logs in $work)"
}

if [ "${1:-}" = "stop" ]; then
  stop_all
  exit 0
fi
keep=0
[ "${1:-}" = "--keep" ] && keep=1

bash scripts/deps.sh
command -v curl >/dev/null || { echo "curl is needed (apt-get install curl)"; exit 1; }
echo "== building (release)"
cargo build --release --bins -q --features rdma
bin=$PWD/target/release
mkdir -p "$work" "$pids"
stop_all >/dev/null   # a cluster left running by an earlier --keep
[ $keep -eq 1 ] || trap stop_all EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits (up to 30 s) for a daemon's "NAME listening on ADDR" line; prints ADDR.
await_addr() { # await_addr OUTFILE PID NAME
  local out=$1 pid=$2 name=$3 addr=""
  for _ in $(seq 300); do
    addr=$(sed -n "s/^$name listening on //p" "$out" 2>/dev/null || true)
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "$name failed to start; see ${out%.out}.log" >&2; return 1; }
    sleep 0.1
  done
  echo "$name did not come up within 30 s; see ${out%.out}.log" >&2
  return 1
}

# etcd, on two free ports, from an empty data dir each run.
cport=$(free_port); pport=$(free_port)
rm -rf "$work/etcd"
etcd --name kvcellar --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$cport" --advertise-client-urls "http://127.0.0.1:$cport" \
  --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
  --initial-cluster "kvcellar=http://127.0.0.1:$pport" --initial-cluster-state new \
  --log-level warn >"$work/etcd.log" 2>&1 &
echo $! >"$pids/etcd.pid"
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$cport/health" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -sf "http://127.0.0.1:$cport/health" >/dev/null || { echo "etcd did not come up; see $work/etcd.log"; exit 1; }
echo "== etcd on 127.0.0.1:$cport"

mds=""
for i in 1 2; do
  "$bin/kv-mds" --listen 127.0.0.1:0 --etcd "127.0.0.1:$cport" --lease-ttl 10s \
    >"$work/mds-$i.out" 2>"$work/mds-$i.log" &
  pid=$!
  echo $pid >"$pids/mds-$i.pid"
  addr=$(await_addr "$work/mds-$i.out" $pid kv-mds)
  echo "== kv-mds replica $i (pid $pid) on $addr"
  mds=${mds:+$mds,}$addr
done

dash=""
for i in 1 2 3; do
  weight=1; [ $i -eq 3 ] && weight=2
  mport=$(free_port)
  dash="$dash http://127.0.0.1:$mport/"
  "$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/n$i/disk0,$work/n$i/disk1" --cap 512M \
    --mem-cap 64M --mds "$mds" --group quickstart --id "n$i" --advertise 127.0.0.1:0 --weight $weight \
    --metrics-listen "127.0.0.1:$mport" --drain-secs 1 \
    >"$work/node-$i.out" 2>"$work/node-$i.log" &
  pid=$!
  echo $pid >"$pids/node-$i.pid"
  addr=$(await_addr "$work/node-$i.out" $pid kv-server)
  echo "== kv-server n$i (pid $pid, weight $weight) on $addr, disks under $work/n$i"
done

# Wait (up to 30 s) until the group lists all three nodes.
for _ in $(seq 300); do
  n=$("$bin/kvctl" ring --mds "$mds" --group quickstart --json 2>/dev/null |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))' 2>/dev/null || echo 0)
  [ "$n" = 3 ] && break
  sleep 0.1
done
echo "== kvctl ring --mds $mds --group quickstart"
"$bin/kvctl" ring --mds "$mds" --group quickstart

target=(--mds "$mds" --group quickstart)
geo=(--model-hash 20817 --page-size 64 --layer-num 61 --head-num 1 --head-dim 576 --mla)
key="quickstart-$(date +%s%N)"   # a new key each run: pages are write-once
head -c $((4 << 20)) /dev/urandom >"$work/page.bin"
echo "== kvctl put a 4 MiB page as $key, get it back, compare"
"$bin/kvctl" put "${target[@]}" "${geo[@]}" --file "$work/page.bin" "$key"
"$bin/kvctl" get "${target[@]}" "${geo[@]}" --out "$work/page.out" "$key"
if cmp -s "$work/page.bin" "$work/page.out"; then
  echo "round trip: 4194304 bytes identical (header, key, geometry and CRC verified)"
else
  echo "round trip FAILED: the page read back differs"; exit 1
fi

echo "== kvctl bench: 1 MiB puts, then gets, 4 threads, 3 s each (kvctl top during the gets)"
"$bin/kvctl" bench "${target[@]}" --op put --size 1M --threads 4 --duration 3 --prefix quickstart
"$bin/kvctl" bench "${target[@]}" --op get --size 1M --threads 4 --duration 4 --keys 64 --prefix quickstart \
  >"$work/bench-get.txt" &
bench=$!
sleep 1.5
"$bin/kvctl" top "${target[@]}" --iterations 2 --interval-ms 1000 | awk 'BEGIN { RS = "" } NR == 2'
wait $bench
cat "$work/bench-get.txt"

echo "== kvctl stat --all --mds $mds --group quickstart"
"$bin/kvctl" stat --all "${target[@]}"
echo "== dashboards: kv-mds http://${mds%%,*}/ (the ring), nodes$dash"

if [ $keep -eq 1 ]; then
  root=$(pwd)
  envline="export KVCELLAR_MDS=$mds KVCELLAR_GROUP=quickstart KVCELLAR_LIB=$bin/libkvclient.so PYTHONPATH=$root/plugins\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "$envline" >"$work/env"
  echo "== left running; to use it from kvctl, Python (kvcellar.Client()), SGLang or LMCache, run:"
  echo "$envline"
  echo "== (also in $work/env); then try: $bin/kvctl ring"
  echo "== stop it with: scripts/quickstart.sh stop"
fi
