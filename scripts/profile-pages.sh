#!/usr/bin/env bash
# Where a request's time goes on a node (docs/BENCHMARKS.md, "Profiles"):
# one kv-server on loopback (one disk directory, a 512 MiB memory tier, on
# media acks as shipped) under a kvctl bench load of OP at SIZE, 4 threads,
# batches of 8 (BATCH). Three passes over the same load, each on fresh nodes:
#   1. plain: throughput, and the node's CPU time and context switches
#      (voluntary: a thread slept, say on a lock or a flush; involuntary:
#      preempted) per page, from /proc (with NODE_ARGS="--ack memory", taken
#      once the flushers wrote what the load left, so each put's flush is in);
#   2. strace -f -c: system calls per page by name, flushes (fdatasync)
#      among them (strace slows the node
#      down many times: its counts are what to read, not its speed);
#   3. perf record (cpu-clock, call graphs): the hottest functions.
# Usage: scripts/profile-pages.sh OP SIZE [COUNT]   OP: put | get | exist
#   KVCELLAR_BIN=DIR   binaries from DIR instead of building this tree
#   NODE_ARGS="..."    extra kv-server flags
#   PLAIN_ONLY=1       the first pass only
#   BATCH=N            batches of N pages (default 8; 1: single PUT/GET frames)
#   CAP=SIZE           the node's --cap (default 8G; smaller: a put load runs
#                      on a full disk, evicting)
# Output under $KVCELLAR_WORK (default target/profile-pages/OP-SIZE).
set -euo pipefail
cd "$(dirname "$0")/.."
op=${1:?usage: scripts/profile-pages.sh put|get|exist SIZE [COUNT]}
size=${2:?usage: scripts/profile-pages.sh put|get|exist SIZE [COUNT]}
count=${3:-}
out=${KVCELLAR_WORK:-$PWD/target/profile-pages}/$op-$size
for t in strace perf; do
  command -v $t >/dev/null || { echo "$t is needed (apt-get install strace linux-perf)"; exit 1; }
done
if [ -z "${KVCELLAR_BIN:-}" ]; then
  cargo build --release --locked --bins -q --features rdma
  bin=$PWD/target/release
else
  bin=$KVCELLAR_BIN
fi
rm -rf "$out"
mkdir -p "$out"
sb=$(python3 -c "
s = '$size'; m = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}
print(int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s))")
batch=${BATCH:-8}
# About 512 MiB of pages a pass unless COUNT (batches) is given.
[ -n "$count" ] || count=$(python3 -c "print(max(16, (512 << 20) // ($batch * $sb)))")
pages=$((count * batch))
node=
dir=
# The node stopped, its disk goes (a put pass writes COUNT x 8 pages: 10 GB
# for 20,000 batches of 64 KiB); its log and output stay.
cleanup() {
  [ -n "$node" ] && kill -TERM "$node" 2>/dev/null && wait "$node" 2>/dev/null
  [ -n "$dir" ] && rm -rf "$dir/disk"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_node() { # start_node DIR: one node; sets $node, $addr and $dir
  rm -rf "$1"
  mkdir -p "$1"
  dir=$1
  # shellcheck disable=SC2086
  "$bin/kv-server" --listen 127.0.0.1:0 --dir "$1/disk" --cap "${CAP:-8G}" --mem-cap 512M --log-level info \
    --drain-secs 0 ${NODE_ARGS:-} >"$1/out" 2>"$1/log" &
  node=$!
  addr=
  for _ in $(seq 600); do
    addr=$(sed -n 's/^kv-server listening on //p' "$1/out")
    [ -n "$addr" ] && grep -q "memory arena faulted in" "$1/log" && break
    kill -0 "$node" 2>/dev/null || { echo "kv-server failed; see $1/log"; exit 1; }
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "kv-server did not come up"; exit 1; }
}

bench() { # bench: the load, on the node up now
  local extra=()
  # Reads cycle through 64 pages (in the memory tier): the puts that store
  # them first are a small part of the pass.
  [ "$op" = put ] || extra=(--keys 64)
  "$bin/kvctl" --json bench --node "$addr" --op "$op" --size "$size" --threads 4 --batch "$batch" \
    --count "$count" --no-raw "${extra[@]}"
}

proc_figures() { # proc_figures PID: utime+stime ticks, voluntary, involuntary switches (all threads)
  python3 - "$1" <<'EOF'
import os, sys
pid = sys.argv[1]
ticks = vol = invol = 0
for t in os.listdir(f"/proc/{pid}/task"):
    try:
        st = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
        ticks += int(st[11]) + int(st[12])
        for l in open(f"/proc/{pid}/task/{t}/status"):
            if l.startswith("voluntary_ctxt_switches"): vol += int(l.split()[1])
            if l.startswith("nonvoluntary_ctxt_switches"): invol += int(l.split()[1])
    except OSError:
        pass
# Threads that ended are counted in the process's own figures.
st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
ticks = max(ticks, int(st[11]) + int(st[12]))
print(ticks, vol, invol)
EOF
}

unflushed() { # unflushed: bytes the node acknowledged from memory and has not yet on its disk ("" if unknown)
  "$bin/kvctl" --json stat "$addr" 2>/dev/null |
    python3 -c 'import json, sys; print(json.load(sys.stdin).get("unflushed_bytes", 0))' 2>/dev/null || true
}

echo "== $op $size: $count batches of $batch ($pages pages) a pass, 4 threads, one node"
start_node "$out/plain"
read -r t0 v0 i0 <<<"$(proc_figures "$node")"
bench >"$out/plain.json"
read -r t1 v1 i1 <<<"$(proc_figures "$node")"
# With memory acks the flushers still write after the load: the figure with
# the flushes is taken once the node holds nothing unflushed (60 s at most;
# "left" says what was unflushed at the load's end, "" when not flushed in time).
t2=$t1
left=-
if [ "$op" = put ] && [[ " ${NODE_ARGS:-} " == *" --ack memory "* ]]; then
  left=$(unflushed)
  end=$((SECONDS + 60))
  until [ "$(unflushed)" = 0 ]; do
    [ "$SECONDS" -lt "$end" ] || { left=; break; }
    sleep 0.1
  done
  read -r t2 _ _ <<<"$(proc_figures "$node")"
  "$bin/kvctl" --json stat "$addr" >"$out/plain-stat.json" 2>/dev/null || true
fi
cleanup
node=
hz=$(getconf CLK_TCK)
python3 - "$out/plain.json" "$pages" "$hz" "$t0" "$t1" "$v0" "$v1" "$i0" "$i1" "$t2" "$left" "$batch" <<'EOF' | tee "$out/summary.txt"
import json, sys
j = json.loads(open(sys.argv[1]).read())
pages, hz = int(sys.argv[2]), int(sys.argv[3])
t0, t1, v0, v1, i0, i1, t2 = map(int, sys.argv[4:11])
left, batch = sys.argv[11], int(sys.argv[12])
print(f"throughput {j['gb_per_sec']:.3f} GB/s, {j['ops_per_sec'] * batch:.0f} pages/s; batch p50 {j['p50_us']:.0f} us p99 {j['p99_us']:.0f} us; statuses {j['statuses']}")
flush = ""
if left == "":
    flush = " (the flushers did not finish within 60 s of the load's end)"
elif left != "-":
    flush = (f" at the load's end ({int(left) / 2**20:.0f} MiB unflushed then), "
             f"{1e6 * (t2 - t0) / hz / pages:.1f} us with the flushes after it")
try:
    st = json.loads(open(sys.argv[1].replace(".json", "-stat.json")).read())
    print(f"puts acknowledged from memory {st['acked_in_memory']}, on media at the bound {st['ack_fallbacks']}; flushed {st['flushed']}")
except (OSError, ValueError, KeyError):
    pass
print(f"node CPU {1e6 * (t1 - t0) / hz / pages:.1f} us a page{flush}; context switches a page: voluntary {(v1 - v0) / pages:.2f}, involuntary {(i1 - i0) / pages:.2f}")
EOF

# PLAIN_ONLY=1: the first pass alone (alternating builds in one sitting).
[ -z "${PLAIN_ONLY:-}" ] || exit 0

start_node "$out/strace"
tasks=()
for t in /proc/"$node"/task/*; do tasks+=(-p "${t##*/}"); done
strace -qq -f -c -o "$out/strace.txt" "${tasks[@]}" 2>/dev/null &
tracer=$!
sleep 1
bench >"$out/strace.json"
kill -INT "$tracer" 2>/dev/null || true
wait "$tracer" 2>/dev/null || true
cleanup
node=
python3 - "$out/strace.txt" "$pages" <<'EOF' | tee -a "$out/summary.txt"
import sys
pages = int(sys.argv[2])
rows = []
for l in open(sys.argv[1]):
    f = l.split()
    if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
        calls = int(f[3])
        rows.append((calls, f[-1]))
rows.sort(reverse=True)
print("system calls a page (strace -f -c): " + ", ".join(f"{name} {calls / pages:.2f}" for calls, name in rows[:12]))
EOF

start_node "$out/perf"
perf record -e cpu-clock -F 499 -g -o "$out/perf.data" -p "$node" 2>"$out/perf.log" &
rec=$!
sleep 1
bench >"$out/perf.json"
kill -INT "$rec" 2>/dev/null || true
wait "$rec" 2>/dev/null || true
cleanup
node=
perf report -i "$out/perf.data" --stdio --no-children --sort symbol 2>/dev/null |
  grep -E '^ +[0-9.]+%' | head -25 | sed -E 's/ +- +- *$//; s/ +$//' >"$out/perf-top.txt" || true
echo "hottest functions on the node (perf, cpu-clock, self time):" | tee -a "$out/summary.txt"
tee -a "$out/summary.txt" <"$out/perf-top.txt"
echo "(files: $out)"
