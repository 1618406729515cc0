#!/usr/bin/env bash
# What prefetch warming buys (docs/BENCHMARKS.md, "Prefetch warming"): three
# kv-server nodes on loopback (scripts/bench-nodes.sh: a 512 MiB memory tier
# each), filled with twice what their tiers hold, so the oldest pages are on
# disk only. Then the engines' pattern over the oldest quarter: a batch
# exist, a pause of GAP_MS, a batch get of the same pages (`kvctl bench --op
# exist-get`), against the same gets unannounced (`--no-exist`), alternating
# which goes first, fresh nodes for each. The gets alone are timed. The
# nodes' warming counters (pages warmed, warmed pages then read, pages past
# the budget) are printed after each arm.
#
# Usage: scripts/bench-warm.sh [RUNS]      (default 3)
#   SIZE=1M  GAP_MS=5  THREADS=4  BATCH=8
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
size=${SIZE:-1M}
gap=${GAP_MS:-5}
threads=${THREADS:-4}
batch=${BATCH:-8}
work=${KVCELLAR_WORK:-$PWD/target/bench-warm}
bash scripts/deps.sh
echo "== building (release)"
cargo build --release --locked --bins -q --features rdma
bin=$PWD/target/release
rm -rf "$work"
mkdir -p "$work"
pids=()
source scripts/bench-nodes.sh
trap stop_bench_nodes EXIT
trap 'exit 130' INT TERM
sb=$(size_bytes "$size")
# Twice the three tiers' bytes; the oldest quarter is read.
keys=$(python3 -c "print(2 * 3 * (512 << 20) // $sb)")
count=$(python3 -c "print(max(1, $keys // 4 // $batch))")
results=$work/results.jsonl

one_arm() { # one_arm NAME RUN [kvctl flags...]
  local name=$1 run=$2
  shift 2
  local work=$work/$name-$run
  mkdir -p "$work"
  start_bench_nodes 8G >/dev/null
  "$bin/kvctl" --json bench --members "$members" --op exist-get --size "$size" --threads "$threads" \
    --batch "$batch" --keys "$keys" --count "$count" --gap-ms "$gap" --no-raw "$@" |
    python3 -c "import json,sys; j=json.loads(sys.stdin.read()); j['arm']='$name'; j['run']=$run; print(json.dumps(j))" \
      >>"$results"
  local w=0 wr=0 ws=0 a s
  for a in ${members//,/ }; do
    s=$("$bin/kvctl" --json stat "${a#*=}")
    read -r a b c <<<"$(python3 -c "import json,sys; j=json.loads(sys.argv[1]); print(j.get('warmed',0), j.get('warmed_read',0), j.get('warm_skipped',0))" "$s")"
    w=$((w + a)) wr=$((wr + b)) ws=$((ws + c))
  done
  tail -1 "$results" | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
print(f\"{j['arm']:<11} run {j['run']}: gets {j['get_gb_per_sec']:.3f} GB/s, p50 {j['get_p50_us']:.0f} us p99 {j['get_p99_us']:.0f} us;\"
      f\" warmed $w, warmed then read $wr, past the budget $ws\"
      f\"{'' if set(j['statuses']) <= {'ok'} else '  statuses ' + str(j['statuses'])}\")"
  stop_bench_nodes
  pids=()
  rm -rf "$work"
}

echo "== $size pages, $keys stored ($((keys * sb >> 20)) MiB), the oldest $((count * batch)) read; $threads threads, batches of $batch, ${gap} ms between exist and get"
for run in $(seq "$runs"); do
  if [ $((run % 2)) = 1 ]; then
    one_arm announced "$run"
    one_arm unannounced "$run" --no-exist
  else
    one_arm unannounced "$run" --no-exist
    one_arm announced "$run"
  fi
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for arm in ("announced", "unannounced"):
    r = [x for x in rows if x["arm"] == arm]
    if r:
        print(f"{arm:<11} median of {len(r)}: gets {statistics.median(x['get_gb_per_sec'] for x in r):.3f} GB/s,"
              f" p50 {statistics.median(x['get_p50_us'] for x in r):.0f} us, p99 {statistics.median(x['get_p99_us'] for x in r):.0f} us")
PY
