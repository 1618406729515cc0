#!/usr/bin/env bash
# The loopback cluster of scripts/bench-trace.sh, and the membership events
# its replays fire at trace times (kvctl replay --event SECS=COMMAND).
#
# Usage: scripts/trace-cluster.sh WORK up SCALE CAP HANDOFF_SECS   etcd, one kv-mds, nodes n1..nNODES
#        scripts/trace-cluster.sh WORK join ID...                  new nodes join (one after another)
#        scripts/trace-cluster.sh WORK stop ID                     SIGTERM: leave, drain, exit
#        scripts/trace-cluster.sh WORK crash ID SECS               kill -9, back after SECS (wall)
#        scripts/trace-cluster.sh WORK rolling [ID...]             these nodes (default: all) in turn: stop, start, rejoin
#        scripts/trace-cluster.sh WORK down                        stop everything started here
#
# NODES (environment, default 3) is the group's size at `up`; NODE_ARGS
# (environment, at `up`) are more kv-server flags for every node started
# (a memory tier: NODE_ARGS="--mem-cap 64M"); MDS_ARGS more kv-mds flags (a
# credential table: MDS_ARGS="--group-token-file trace=FILE"; kvctl then
# needs KVCELLAR_AUTH_TOKEN_FILE).
# SCALE divides the membership clocks (lease TTL 30 s, drain 30 s, handoff
# window HANDOFF_SECS) as the replay's --speed divides trace time. Nodes
# listen on ports picked at `up` and kept, so a restarted node comes back at
# its address with its disk. Only PIDs recorded under WORK are signalled.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$1
cmd=$2
shift 2
bin=${KVCELLAR_BIN:-$PWD/target/release}
state=$work/state

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

await_line() { # await_line OUTFILE PID NAME
  local out=$1 pid=$2 name=$3
  for _ in $(seq 300); do
    grep -q "^$name listening on " "$out" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$name failed to start; see ${out%.out}.log" >&2; return 1; }
    sleep 0.1
  done
  echo "$name did not come up within 30 s" >&2
  return 1
}

# Waits (up to 30 s) until the group's view lists ID (or, with "gone", does not).
await_member() { # await_member ID [gone]
  local id=$1 want=${2:-in}
  for _ in $(seq 300); do
    if "$bin/kvctl" ring --mds "$(cat "$state/mds")" --group trace --json 2>/dev/null |
      python3 -c 'import json,sys; v=json.load(sys.stdin); sys.exit(0 if sys.argv[1] in [m["id"] for m in v["members"]] else 1)' "$id"; then
      [ "$want" = in ] && return 0
    else
      [ "$want" = gone ] && return 0
    fi
    sleep 0.1
  done
  echo "trace-cluster: $id did not become $want within 30 s" >&2
  return 1
}

start_node() { # start_node ID
  local id=$1 port push=""
  # Handoff off is the behaviour before it: no push on drain either.
  [ "$(cat "$state/handoff")" = 0 ] && push=--no-drain-push
  port=$(cat "$state/$id.port" 2>/dev/null || free_port)
  echo "$port" >"$state/$id.port"
  mkdir -p "$work/$id"
  "$bin/kv-server" --listen "127.0.0.1:$port" --dir "$work/$id/disk" --cap "$(cat "$state/cap")" \
    --mds "$(cat "$state/mds")" --group trace --id "$id" --advertise "127.0.0.1:$port" \
    --drain-secs "$(cat "$state/drain")" --handoff-secs "$(cat "$state/handoff")" --log-level info $push \
    $(cat "$state/node-args" 2>/dev/null) \
    >"$work/$id.out" 2>>"$work/$id.log" &
  echo $! >"$state/$id.pid"
  await_line "$work/$id.out" $! kv-server
  await_member "$id"
}

stop_pid() { # stop_pid FILE SIGNAL: signal the recorded PID, wait for it (60 s)
  local f=$1 sig=$2 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "-$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case $cmd in
  up)
    scale=$1 cap=$2 handoff=$3
    rm -rf "$work"
    mkdir -p "$state"
    echo "$cap" >"$state/cap"
    echo "${NODE_ARGS:-}" >"$state/node-args"
    # The membership clocks, divided by SCALE (etcd leases: whole seconds, at least 2).
    python3 -c "import sys; s=float(sys.argv[1]); print(max(2, round(30/s)))" "$scale" >"$state/ttl"
    python3 -c "import sys; s=float(sys.argv[1]); print(round(30/s, 3))" "$scale" >"$state/drain"
    python3 -c "import sys; s=float(sys.argv[1]); h=int(sys.argv[2]); print(0 if h == 0 else max(3, round(h/s)))" \
      "$scale" "$handoff" >"$state/handoff"
    cport=$(free_port)
    pport=$(free_port)
    etcd --name trace --data-dir "$work/etcd" \
      --listen-client-urls "http://127.0.0.1:$cport" --advertise-client-urls "http://127.0.0.1:$cport" \
      --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
      --initial-cluster "trace=http://127.0.0.1:$pport" --initial-cluster-state new \
      --log-level warn >"$work/etcd.log" 2>&1 &
    echo $! >"$state/etcd.pid"
    for _ in $(seq 300); do
      curl -sf "http://127.0.0.1:$cport/health" >/dev/null 2>&1 && break
      sleep 0.1
    done
    curl -sf "http://127.0.0.1:$cport/health" >/dev/null || { echo "etcd did not come up; see $work/etcd.log" >&2; exit 1; }
    "$bin/kv-mds" --listen 127.0.0.1:0 --etcd "127.0.0.1:$cport" --lease-ttl "$(cat "$state/ttl")s" \
      --handoff-secs "$(cat "$state/handoff")" ${MDS_ARGS:-} >"$work/mds.out" 2>"$work/mds.log" &
    echo $! >"$state/mds.pid"
    await_line "$work/mds.out" $! kv-mds
    sed -n 's/^kv-mds listening on //p' "$work/mds.out" >"$state/mds"
    nodes=${NODES:-3}
    echo "$nodes" >"$state/nodes"
    for i in $(seq "$nodes"); do start_node "n$i"; done
    echo "trace-cluster: up: $nodes nodes of $cap; membership clocks / $scale: lease TTL $(cat "$state/ttl") s," \
      "drain $(cat "$state/drain") s, handoff window $(cat "$state/handoff") s (kv-mds and nodes)"
    ;;
  join) for id in "$@"; do start_node "$id"; done ;;
  stop)
    stop_pid "$state/$1.pid" TERM
    ;;
  crash)
    stop_pid "$state/$1.pid" KILL
    sleep "$2"
    start_node "$1"
    ;;
  rolling)
    ids=("$@")
    [ ${#ids[@]} -gt 0 ] || mapfile -t ids < <(seq -f 'n%g' "$(cat "$state/nodes")")
    for id in "${ids[@]}"; do
      stop_pid "$state/$id.pid" TERM
      start_node "$id"
    done
    ;;
  down)
    for f in "$state"/n*.pid "$state/mds.pid" "$state/etcd.pid"; do
      [ -f "$f" ] || continue
      stop_pid "$f" KILL
    done
    ;;
  mds) cat "$state/mds" ;;
  *)
    echo "usage: scripts/trace-cluster.sh WORK up|join|stop|crash|rolling|down|mds ..." >&2
    exit 2
    ;;
esac
