# Sourced by the benchmark scripts (bench-cluster.sh, bench-pages.sh, bench-warm.sh, ...
# start_bench_nodes CAP [VAR=VALUE...] starts three kv-server nodes from
# $bin on loopback, each with one disk directory $work/n<i> capped at CAP
# and a 512 MiB memory tier, the VAR=VALUE pairs in their environment; it
# waits until each listens and has faulted its memory arena in (a node's
# first minute is not its steady state; up to 60 s), prints how long that
# took, sets $members (`n0=ADDR,...`) and appends the PIDs to $pids.
# $BENCH_NODE_ARGS, if set, is added to every node's flags; $BENCH_MEM_CAP
# replaces the 512 MiB tier.
start_bench_nodes() {
  local cap=$1 i a ms
  shift
  members=""
  for i in 0 1 2; do
    env "$@" "$bin/kv-server" --listen 127.0.0.1:0 --dir "$work/n$i" --cap "$cap" --mem-cap "${BENCH_MEM_CAP:-512M}" \
      --log-level info --drain-secs 0 ${BENCH_NODE_ARGS:-} >"$work/n$i.out" 2>"$work/n$i.log" &
    pids+=($!)
  done
  for i in 0 1 2; do
    a=
    for _ in $(seq 300); do
      a=$(sed -n 's/^kv-server listening on //p' "$work/n$i.out" 2>/dev/null || true)
      [ -n "$a" ] && break
      sleep 0.1
    done
    [ -n "$a" ] || { echo "node $i did not start"; cat "$work/n$i.log"; exit 1; }
    members="${members}n$i=$a,"
  done
  for i in 0 1 2; do
    for _ in $(seq 600); do
      grep -q "memory arena faulted in" "$work/n$i.log" 2>/dev/null && break
      sleep 0.1
    done
    ms=$(sed -n 's/.*memory arena faulted in.* ms=\([0-9]*\).*/\1/p' "$work/n$i.log" | head -1)
    echo "node $i: memory arena faulted in${ms:+ in $ms ms}"
  done
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
