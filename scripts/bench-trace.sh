#!/usr/bin/env bash
# Trace replays on a loopback cluster (docs/BENCHMARKS.md, "Trace replay"):
#
#   capacity  the whole trace as fast as it goes (--speed 0), 3 nodes, at two
#             capacities: one the working set fits in, one about a third of it;
#   events    a part of the trace time-compressed by SPEED (default 20), with a
#             membership event at trace time EVENT_AT (default 1200 s): a join,
#             a graceful stop, a kill -9 (back after 60 s of trace time) and a
#             rolling restart of every node, each with handoff on and off,
#             beside control runs without an event. The membership clocks
#             (lease TTL, drain, handoff window) are divided by SPEED too.
#             WARM=SECS replays the trace up to SECS before the event as fast
#             as possible (kvctl replay --warm-until) and only the rest at
#             SPEED: with SPEED=1, the events at the trace's own pace.
#   policy    what the nodes keep under pressure (docs/BENCHMARKS.md, "Where the
#             capacity went"): the whole trace as fast as it goes at a quarter
#             and a tenth of its working set on 3 and on 12 nodes, each beside
#             the replay's LRU simulations (pooled, and one per node on the
#             same ring): placed by ketama without and with a memory tier (a
#             third of each node's cap), and by multiprobe. One line a run in
#             policy-summary.txt.
#   fleet     the events at fleet size: NODES (default 24) nodes of CAP (default
#             400M, no memory tier), a control run, then a graceful stop of
#             n12, a join of two nodes, a kill -9 of n7 (back after 60 s of
#             trace time) and a rolling restart of n1-n3, handoff on; the
#             stopped node's push figures (its closing `drain push:` line)
#             beside the hits. scripts/bench-fleet.sh runs it.
#
# Each run gets a fresh cluster (scripts/trace-cluster.sh) and the same key
# tag, so every run places every page alike. Results (one
# kvctl replay JSON per run and summary.txt) go to $KVCELLAR_WORK (default
# target/bench-trace).
#
# Usage: scripts/bench-trace.sh [capacity|events|policy|fleet|all]
#        EVENTS="stop rolling" HANDOFFS=600 scripts/bench-trace.sh events   (a subset)
#        SPEED=1 WARM=30 scripts/bench-trace.sh events                     (real time)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
speed=${SPEED:-20}
at=${EVENT_AT:-1200}
work=${KVCELLAR_WORK:-$PWD/target/bench-trace}
trace=traces/conversation_trace.jsonl
bash scripts/deps.sh
command -v curl >/dev/null || { echo "curl is needed (apt-get install curl)"; exit 1; }
echo "== building (release)"
cargo build --release --locked --bins -q --features rdma
bin=$PWD/target/release
mkdir -p "$work"
cluster="$work/cluster"
trap 'bash scripts/trace-cluster.sh "$cluster" down || true' EXIT
trap 'exit 130' INT TERM
results="$work/results"
# Runs at another pace go to a directory of their own.
[ "$speed" = 20 ] && [ -z "${WARM:-}" ] || results="$work/results-speed$speed${WARM:+-warm$WARM}"
mkdir -p "$results"

replay() { # replay NAME [kvctl replay flags...]: one run on the cluster up now
  local name=$1
  shift
  "$bin/kvctl" --json replay --mds "$(bash scripts/trace-cluster.sh "$cluster" mds)" --group trace \
    "$@" "$trace" >"$results/$name.json" 2>"$results/$name.log" || {
    echo "$name: kvctl replay failed:"
    tail -5 "$results/$name.log"
    return 1
  }
  python3 - "$results/$name.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
lru = r.get("lru") or {}
print(f"{sys.argv[2]}: {r['requests']} requests, {r['pages']} pages, hits {r['hits']} ({100*r['hit_rate']:.1f}%),"
      f" ceiling {r['ceiling']['hits']} ({100*r['ceiling']['hit_rate']:.1f}%),"
      f" LRU at {lru.get('capacity_pages', '?')} pages {lru.get('hits', '?')}; L3 p50 {r['l3_ms']['p50']:.2f} ms"
      f" p99 {r['l3_ms']['p99']:.2f} ms; wrong pages {r['wrong_pages']}; {r['seconds']:.0f} s")
EOF
}

if [ "$what" = capacity ] || [ "$what" = all ]; then
  # The trace's working set at 16 KiB pages is about 3.3 GiB on disk.
  for cap in 1500M 380M; do
    bash scripts/trace-cluster.sh "$cluster" up 1 "$cap" 600
    replay "capacity-3x$cap" --speed 0 --engines 4 --tag trace
    bash scripts/trace-cluster.sh "$cluster" down
  done
fi

ev="bash scripts/trace-cluster.sh $(printf %q "$cluster")"
# Trace time replayed: up to the event, then the longest span measured
# (a request count, so event and control runs replay the same requests
# however fast the machine keeps up).
span=60
rspan=400
# The runs of one span replay the same requests (the control the longest:
# every run is a prefix of it, and what a request gets depends only on
# those before it).
limit_for() { # limit_for SPAN
  python3 -c "
import json, sys
end = ($at + $1 + 20) * 1000
print(sum(1 for l in open('$trace') if json.loads(l)['timestamp'] < end))"
}
warm=()
[ -n "${WARM:-}" ] && warm=(--warm-until "$((at - WARM))")
run_event() { # run_event NAME HANDOFF_SECS SPAN COMMAND   (CAP: each node's, default 1500M)
  bash scripts/trace-cluster.sh "$cluster" up "$speed" "${CAP:-1500M}" "$2"
  replay "$1" --speed "$speed" "${warm[@]}" --engines 4 --limit "$(limit_for "$3")" --tag trace \
    --event-span "$3" --event "$at=$4"
  bash scripts/trace-cluster.sh "$cluster" down
}
crash_back=$(python3 -c "print(60 / $speed)")

# summary DIR TITLE: hits in the span after the event of each run in DIR
# against its control run (NAME-hH.json beside control-hH.json).
summary() {
  python3 - "$1" "$at" "$span" "$rspan" "$speed" "$2" <<'EOF'
import json, sys, os
d, at, span, rspan, speed, title = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
def load(n):
    try:
        return json.load(open(os.path.join(d, n + ".json")))
    except OSError:
        return None
def span_hits(r, s):
    return sum(w["hits"] for w in r["windows"] if at <= w["start_s"] < at + s)
print(f"{title}events at trace time {at:.0f} s, speed {speed} (membership clocks divided by {speed} too)")
print(f"{'event':<9} {'handoff':<8} {'span s':>6} {'hits':>7} {'control':>8} {'loss %':>7} {'wrong':>6}")
for ev in ["join", "stop", "crash", "rolling"]:
    for h in ["600", "0"]:
        r = load(f"{ev}-h{h}")
        c = load(f"control-h{h}")
        if r is None or c is None:
            continue
        s = rspan if ev == "rolling" else span
        hits, ctl = span_hits(r, s), span_hits(c, s)
        loss = 100.0 * (ctl - hits) / ctl if ctl else 0.0
        print(f"{ev:<9} {'on' if h != '0' else 'off':<8} {s:>6.0f} {hits:>7} {ctl:>8} {loss:>7.1f} {r['wrong_pages']:>6}")
a, b = load("control-h600"), load("control-h0")
if a and b: print(f"control vs control (noise): {span_hits(a, span)} vs {span_hits(b, span)} hits in the {span:.0f} s span")
EOF
}

if [ "$what" = events ] || [ "$what" = all ]; then
  # EVENTS and HANDOFFS pick a subset (results of earlier runs are kept).
  for h in ${HANDOFFS:-600 0}; do
    for e in ${EVENTS:-control join stop crash rolling}; do
      case $e in
        control) run_event "control-h$h" "$h" "$rspan" "true" ;;
        join) run_event "join-h$h" "$h" "$span" "$ev join n4" ;;
        stop) run_event "stop-h$h" "$h" "$span" "$ev stop n3" ;;
        crash) run_event "crash-h$h" "$h" "$span" "$ev crash n3 $crash_back" ;;
        rolling) run_event "rolling-h$h" "$h" "$rspan" "$ev rolling" ;;
      esac
    done
  done
  summary "$results" "" | tee "$work/summary.txt"
fi

if [ "$what" = policy ] || [ "$what" = all ]; then
  policy="$work/results-policy"
  mkdir -p "$policy"
  results=$policy
  # The working set on disk: 170,899 pages of 20 KiB, 3,338 MiB; a quarter
  # and a tenth of it over 3 and over 12 nodes.
  for size in "3 278M 93M quarter" "3 111M 37M tenth" "12 70M 23M quarter" "12 28M 9M tenth"; do
    read -r n cap mem frac <<<"$size"
    for variant in ketama ketama-mem multiprobe; do
      args=""
      [ "$variant" = ketama-mem ] && args="--mem-cap $mem"
      NODES=$n NODE_ARGS="$args" bash scripts/trace-cluster.sh "$cluster" up 1 "$cap" 600
      if [ "$variant" = multiprobe ]; then
        "$bin/kvctl" ring --mds "$(bash scripts/trace-cluster.sh "$cluster" mds)" --group trace \
          --set-placement multiprobe >/dev/null
      fi
      # One engine stream: requests in trace order, as the simulations
      # take them (with several, a request can run before the puts of the
      # one before it, which no simulation models).
      replay "$n-$frac-$variant" --speed 0 --engines 1 --tag trace
      bash scripts/trace-cluster.sh "$cluster" down
    done
  done
  python3 - "$policy" <<'EOF' | tee "$work/policy-summary.txt"
import json, sys, os
d = sys.argv[1]
print(f"{'nodes':>5} {'of set':<8} {'placement':<11} {'hits':>7} {'pooled':>7} {'per node':>8} {'/pooled':>8} {'/per node':>9} {'gets max/mean':>13} {'wrong':>5}")
for n in ["3", "12"]:
    for frac in ["quarter", "tenth"]:
        for v in ["ketama", "ketama-mem", "multiprobe"]:
            try:
                r = json.load(open(os.path.join(d, f"{n}-{frac}-{v}.json")))
            except OSError:
                continue
            pooled, part = r["lru"]["hits"], r["nodes"]["partitioned_lru"]["hits"]
            bal = r["nodes"]["gets_max_over_mean"] or 0.0
            print(f"{n:>5} {frac:<8} {v:<11} {r['hits']:>7} {pooled:>7} {part:>8} {100*r['hits']/pooled:>7.1f}% "
                  f"{100*r['hits']/part:>8.1f}% {bal:>13.2f} {r['wrong_pages']:>5}")
EOF
fi

if [ "$what" = fleet ]; then
  export NODES=${NODES:-24}
  export CAP=${CAP:-400M}
  fleet="$work/results-fleet$NODES"
  [ "$speed" = 20 ] && [ -z "${WARM:-}" ] || fleet="$fleet-speed$speed${WARM:+-warm$WARM}"
  mkdir -p "$fleet"
  results=$fleet
  for e in ${EVENTS:-control stop join crash rolling}; do
    case $e in
      control) run_event control-h600 600 "$rspan" "true" ;;
      stop)
        run_event stop-h600 600 "$span" "$ev stop n12"
        grep -h "drain push:\|drain: pushing\|drain: the group\|drain: pages pushed" "$cluster/n12.log" >"$fleet/stop-push.txt" || true
        ;;
      join) run_event join-h600 600 "$span" "$ev join n$((NODES + 1)) n$((NODES + 2))" ;;
      crash) run_event crash-h600 600 "$span" "$ev crash n7 $crash_back" ;;
      rolling) run_event rolling-h600 600 "$rspan" "$ev rolling n1 n2 n3" ;;
    esac
  done
  {
    summary "$fleet" "$NODES nodes; "
    sed 's/^/n12: /' "$fleet/stop-push.txt" 2>/dev/null || true
  } | tee "$fleet/summary.txt"
fi
