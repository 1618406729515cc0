#!/usr/bin/env bash
# Puts and gets at the page sizes engines use (docs/BENCHMARKS.md, "Page
# sizes"): three kv-server nodes on loopback (scripts/bench-nodes.sh: one disk
# directory each, a 512 MiB memory tier), kvctl bench with 4 threads and
# batches of 8 at 64 KiB, 256 KiB, 1 MiB and 4 MiB, puts then gets. Every
# figure is printed beside its limit measured in the same run: plain
# O_DIRECT writes of the same size and threads for puts, plain TCP round
# trips of the same bytes for gets. A fresh set of nodes for every run.
#
# Usage: scripts/bench-pages.sh [RUNS]           (default 3)
#   SIZES="64K 256K"      a subset of the sizes
#   NODE_ARGS="..."       extra kv-server flags for every node
#   BEFORE=DIR            also run the kv-server and kvctl of DIR (say, a
#                         release build of an earlier commit), alternating
#                         with this tree's in every run; the table shows both
# Results (one kvctl bench JSON line per figure) go to $KVCELLAR_WORK
# (default target/bench-pages).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
sizes=${SIZES:-64K 256K 1M 4M}
work=${KVCELLAR_WORK:-$PWD/target/bench-pages}
bash scripts/deps.sh
echo "== building (release)"
cargo build --release --locked --bins -q --features rdma
arms=("now=$PWD/target/release")
[ -n "${BEFORE:-}" ] && arms+=("before=$BEFORE")
rm -rf "$work"
mkdir -p "$work"
results=$work/results.jsonl
pids=()
source scripts/bench-nodes.sh
trap stop_bench_nodes EXIT
trap 'exit 130' INT TERM

# bytes BYTES SIZE: batches of 8 pages of SIZE that make about BYTES.
batches() { python3 -c "import sys; from math import ceil; print(max(8, ceil($1 / (8 * $2))))"; }

one_arm() { # one_arm NAME BINDIR RUN
  local name=$1 run=$3 size sb
  bin=$2
  # start_bench_nodes puts the nodes' directories under $work.
  local work=$work/$name-$run
  mkdir -p "$work"
  BENCH_NODE_ARGS=${NODE_ARGS:-} start_bench_nodes 8G
  for size in $sizes; do
    sb=$(size_bytes "$size")
    for op in put get; do
      local n keys
      n=$(batches $((1 << 30)) "$sb")
      # Gets cycle through 256 MiB of pages (in the nodes' memory tiers).
      keys=$(python3 -c "print(max(64, (256 << 20) // $sb))")
      [ "$op" = put ] && extra=(--raw-disk "$work") || extra=(--keys "$keys")
      "$bin/kvctl" --json bench --members "$members" --op "$op" --size "$size" --threads 4 --batch 8 \
        --count "$n" "${extra[@]}" |
        python3 -c "import json,sys; j=json.loads(sys.stdin.read()); j['arm']='$name'; j['run']=$run; print(json.dumps(j))" \
          >>"$results"
      tail -1 "$results" | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
lim = j.get('raw_disk_gb_per_sec') or j.get('raw_loopback_gb_per_sec') or 0
print(f\"{j['arm']:<7} run {j['run']} {j['op']:<4} {j['size'] >> 10:>5} KiB: {j['gb_per_sec']:.3f} GB/s\"
      f\"  p50 {j['p50_us']:.0f} us p99 {j['p99_us']:.0f} us; limit {lim:.3f} GB/s ({100 * j['gb_per_sec'] / lim if lim else 0:.0f}%)\"
      f\"{'' if set(j['statuses']) <= {'ok'} else '  statuses ' + str(j['statuses'])}\")"
    done
  done
  stop_bench_nodes
  pids=()
  rm -rf "$work" # this arm's disks (several GiB)
}

for run in $(seq "$runs"); do
  # Alternate which arm goes first.
  order=("${arms[@]}")
  if [ $((run % 2)) = 0 ] && [ ${#arms[@]} = 2 ]; then order=("${arms[1]}" "${arms[0]}"); fi
  for a in "${order[@]}"; do one_arm "${a%%=*}" "${a#*=}" "$run"; done
done

python3 - "$results" <<'EOF' | tee "$work/summary.txt"
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
arms = sorted({r["arm"] for r in rows}, key=lambda a: a != "now")
print("medians over runs (GB/s; limit = plain O_DIRECT writes for put, plain TCP for get, same run)")
print(f"{'op':<4} {'page':>8} " + " ".join(f"{a + ' GB/s':>12} {a + ' %lim':>10}" for a in arms))
for op in ["put", "get"]:
    for size in sorted({r["size"] for r in rows}):
        cells = []
        for a in arms:
            rs = [r for r in rows if r["arm"] == a and r["op"] == op and r["size"] == size]
            if not rs:
                cells += ["-", "-"]
                continue
            g = statistics.median(r["gb_per_sec"] for r in rs)
            lim = [r["gb_per_sec"] / (r.get("raw_disk_gb_per_sec") or r.get("raw_loopback_gb_per_sec") or 1) for r in rs]
            cells += [f"{g:.3f}", f"{100 * statistics.median(lim):.0f}%"]
        print(f"{op:<4} {size >> 10:>5} KiB " + " ".join(f"{c:>12}" if i % 2 == 0 else f"{c:>10}" for i, c in enumerate(cells)))
EOF
