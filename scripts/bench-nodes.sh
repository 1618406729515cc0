# Sourced by the benchmark scripts (bench-cluster.sh, bench-pages.sh, bench-warm.sh, ...
# start_bench_nodes CAP [VAR=VALUE...] starts three kv-server nodes from
# $bin on loopback with kv-local, each with one disk directory under
# $work/n<i> (i = 0, 1, 2) capped at CAP and a 512 MiB memory tier, the VAR=VALUE pairs in
# their environment; it waits until each listens and has faulted its memory
# arena in (a node's first minute is not its steady state; up to 60 s),
# prints how long that took, sets $members (`n0=ADDR,...`) and appends
# kv-local's PID to $pids (SIGTERM to it stops the nodes).
# $BENCH_NODE_ARGS, if set, is added to every node's flags; $BENCH_MEM_CAP
# replaces the 512 MiB tier.
start_bench_nodes() {
  local cap=$1 out envs=() kv
  shift
  for kv in "$@"; do envs+=(--env "$kv"); done
  # kv-local (the one loopback-cluster starter) from this tree's release
  # build, starting the nodes of $bin (which may be another build's).
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  [ -x "$here/target/release/kv-local" ] || (cd "$here" && cargo build --release -q -p kv-e2e --bin kv-local)
  out="$work/kv-local.out"
  rm -f "$out"
  # shellcheck disable=SC2086
  "$here/target/release/kv-local" --work "$work" --mds 0 --nodes 3 --id-prefix n --first 0 --wait-arena \
    --bin-dir "$(cd "$bin" && pwd)" ${envs[@]+"${envs[@]}"} \
    -- --cap "$cap" --mem-cap "${BENCH_MEM_CAP:-512M}" --log-level info --drain-secs 0 ${BENCH_NODE_ARGS:-} \
    >"$out" 2>"$work/kv-local.log" </dev/null &
  pids+=($!)
  for _ in $(seq 900); do
    grep -qx ready "$out" 2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "the nodes did not start"; cat "$work/kv-local.log"; exit 1; }
    sleep 0.1
  done
  grep -qx ready "$out" || { echo "the nodes did not come up within 90 s"; cat "$work/kv-local.log"; exit 1; }
  sed -n 's/^\(node [^ ]*: memory arena faulted in.*\)/\1/p' "$out"
  members=$(sed -n 's/^members //p' "$out")
}

# stop_bench_nodes: ends the processes whose PIDs are in $pids (TERM, by
# PID) and reaps them.
stop_bench_nodes() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

# size_bytes SIZE: a size such as 64K, 1M or 2G (or plain bytes) in bytes.
size_bytes() { python3 -c "
s = '$1'; m = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}
print(int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s))"; }
