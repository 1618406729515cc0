#!/usr/bin/env bash
# The main job: a local kvcellar cluster on loopback.
#
# Builds release binaries, then starts under a work dir, with kv-local: etcd,
# two kv-mds replicas and three kv-server nodes (two disk dirs each; node n3
# has weight 2), all on 127.0.0.1. Shows `kvctl ring`, a 4 MiB page round trip through
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

# Stops the cluster a run started: kv-local (whose PID this script
# recorded) stops its nodes (they deregister), the MDS replicas and etcd.
# (A cluster left by an earlier release's --keep has a PID file per daemon:
# those are stopped the same way.)
stop_all() {
  [ -d "$pids" ] || return 0
  local f pid found=0
  for f in "$pids"/kv-local.pid "$pids"/node-*.pid "$pids"/mds-*.pid "$pids"/etcd.pid; do
    [ -f "$f" ] || continue
    found=1
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  [ $found -eq 0 ] || echo "== stopped everything the quickstart started (logs in $work)"
}

if [ "${1:-}" = "stop" ]; then
  stop_all
  exit 0
fi
keep=0
[ "${1:-}" = "--keep" ] && keep=1

bash scripts/deps.sh
echo "== building (release)"
cargo build --release --bins -q --features rdma
bin=$PWD/target/release
mkdir -p "$work" "$pids"
stop_all >/dev/null   # a cluster left running by an earlier --keep
[ $keep -eq 1 ] || trap stop_all EXIT INT TERM

# etcd, two kv-mds replicas and three nodes (two disk dirs each, n3 of
# weight 2), started by kv-local (the same code the tests start clusters
# with); it prints each part's address, then "ready".
rm -f "$work/cluster.out"
setsid "$bin/kv-local" --work "$work" --nodes 3 --disks 2 --mds 2 --group quickstart --weights 1,1,2 --metrics \
  -- --cap 512M --mem-cap 64M --drain-secs 1 >"$work/cluster.out" 2>"$work/kv-local.log" </dev/null &
echo $! >"$pids/kv-local.pid"
for _ in $(seq 900); do
  grep -qx ready "$work/cluster.out" 2>/dev/null && break
  kill -0 "$(cat "$pids/kv-local.pid")" 2>/dev/null || { echo "the cluster did not start; see $work/kv-local.log and $work/*.log"; exit 1; }
  sleep 0.1
done
grep -qx ready "$work/cluster.out" || { echo "the cluster did not come up within 90 s; see $work/*.log"; exit 1; }
sed -n 's/^etcd /== etcd on /p' "$work/cluster.out"
mds=$(sed -n 's/^mds //p' "$work/cluster.out")
echo "== kv-mds replicas on $mds"
while read -r kind id addr pid _; do
  if [ "$kind" = node ]; then echo "== kv-server $id (${pid/=/ }) on $addr, disks under $work/$id"; fi
done <"$work/cluster.out"
dash=$(awk '/^node /{for (i = 1; i <= NF; i++) if ($i ~ /^metrics=/) printf " http://%s/", substr($i, 9)}' "$work/cluster.out")
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
