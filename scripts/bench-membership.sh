#!/usr/bin/env bash
# "Membership at scale" of docs/BENCHMARKS.md: kv-mds-load (tests/src/bin/
# kv-mds-load.rs) plays NODES nodes and CLIENTS clients against 2 kv-mds
# replicas and a 3-member etcd on loopback, RUNS times for each setting,
# alternating, and prints the medians:
#   before      kv-mds of BEFORE_REV (the release before the fleet-scale
#               work) and clients as that release's: the first replica, no
#               re-poll spread, whole views, a 1 s long-poll (the plugins'
#               old default); no library clients (today's library cannot
#               behave as the old one)
#   after       this tree's kv-mds; simulated clients as today's library,
#               REAL of them the library itself; 30 s long-polls
#   after-mp    as after, the group placed by the multiprobe rule (the
#               library clients rebuild their rings ~10x faster)
#   after-sim   as after, no library clients: what the membership tier
#               does when the library's own work (ring builds, on each
#               engine's host in production) does not share these 2 cores
# Usage: scripts/bench-membership.sh [--runs N] [--quick]
#   --quick: 1 run of each at 300 nodes and 3,000 clients.
# Environment: NODES (1000), CLIENTS (10000), REAL (200), RUNS (3),
#   BEFORE_REV (ab1a9b1), OUT (target/bench-membership),
#   SETTINGS ("before after after-mp after-sim").
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-1000} CLIENTS=${CLIENTS:-10000} REAL=${REAL:-200} RUNS=${RUNS:-3}
BEFORE_REV=${BEFORE_REV:-ab1a9b1}
SETTINGS=${SETTINGS:-before after after-mp after-sim}
OUT=${OUT:-target/bench-membership}
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --quick) NODES=300 CLIENTS=3000 REAL=50 RUNS=1; shift ;;
    *) echo "usage: $0 [--runs N] [--quick]" >&2; exit 2 ;;
  esac
done
bash scripts/deps.sh
cargo build --release --locked -p kv-mds -p kv-e2e --bin kv-mds --bin kv-mds-load

# The earlier kv-mds, built once per revision outside the clone.
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
rev=$(git rev-parse --short "$BEFORE_REV")
old="$CACHE/mds-$rev/kv-mds"
if [[ " $SETTINGS " == *" before "* ]] && [ ! -x "$old" ]; then
  src="$CACHE/mds-$rev-src"
  rm -rf "$src"
  git worktree prune
  git worktree add --detach "$src" "$rev" >/dev/null
  (cd "$src" && cargo build --release --locked -p kv-mds --target-dir "$CACHE/mds-target")
  mkdir -p "$(dirname "$old")"
  cp "$CACHE/mds-target/release/kv-mds" "$old"
  git worktree remove --force "$src"
fi

mkdir -p "$OUT"
for setting in $SETTINGS; do rm -f "$OUT/$setting"-[0-9]*.json; done
load=target/release/kv-mds-load
common=(--nodes "$NODES" --clients "$CLIENTS" --joins 5 --gap-ms 6000)
for i in $(seq 1 "$RUNS"); do
  for setting in $SETTINGS; do
    case $setting in
      before) args=(--mds-bin "$old" --legacy --wait-ms 1000 --real-clients 0) ;;
      after) args=(--wait-ms 30000 --real-clients "$REAL") ;;
      after-mp) args=(--wait-ms 30000 --real-clients "$REAL" --placement multiprobe) ;;
      after-sim) args=(--wait-ms 30000 --real-clients 0) ;;
    esac
    echo "== $setting, run $i of $RUNS" >&2
    "$load" run "${common[@]}" "${args[@]}" --json "$OUT/$setting-$i.json" | tee "$OUT/$setting-$i.txt" >&2
  done
done

python3 - "$OUT" <<'EOF'
import glob, json, math, statistics, sys
out = sys.argv[1]
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")
def f(x, unit=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "never"
    return f"{x:.0f}{unit}" if abs(x) >= 10 else f"{x:.2f}{unit}"
rows = []
for setting in ("before", "after", "after-mp", "after-sim"):
    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{setting}-[0-9]*.json"))]
    if not runs:
        continue
    lp = [p for r in runs for p in r["propagation"] if not p["plain_polls"]]
    inf = lambda v: math.inf if v is None else v
    row = {
        "setting": setting, "runs": len(runs), "clients": runs[0]["clients"], "nodes": runs[0]["nodes"],
        "p50": med([inf(p["p50_ms"]) for p in lp]), "p99": med([inf(p["p99_ms"]) for p in lp]),
        "p100": med([inf(p["p100_ms"]) for p in lp]),
        "in1s": med([p["within_1s"] * 100 for p in lp]), "in3s": med([p["within_3s"] * 100 for p in lp]),
        "never": max(p["missing"] for p in lp) if lp else 0,
        "hb_p99": med([r["heartbeat_ms"]["p99"] for r in runs]),
        "reg_p99": med([r["register_join_ms"]["p99"] for r in runs]),
        "rss": max(m["rss_peak_mib"] for r in runs for m in r["mds"]),
        "cpu": med([m["cpu_pct_mean"] for r in runs for m in r["mds"]]),
        "fds": max(m["fds_peak"] for r in runs for m in r["mds"]),
        "props": med([r["etcd"]["proposals_per_s"] for r in runs]),
        "db": max(r["etcd"]["db_size_mib"] for r in runs),
        "bytes": med([r["view_bytes_per_change"] for r in runs]),
        "reads": med([r["mds_etcd_view_reads"] for r in runs]),
        "errors": med([sum(r["errors"].values()) for r in runs]),
        "valid": sum(1 for r in runs if r["valid"]),
    }
    rows.append(row)
print(f"\nMembership at scale: medians of {rows[0]['runs'] if rows else 0} runs ({out})")
hdr = ["setting", "clients", "50% hold", "99%", "100%", "<=1 s", "<=3 s", "hb p99", "join reg p99",
       "kv-mds RSS", "kv-mds CPU", "fds", "etcd props/s", "etcd db", "view bytes/change", "etcd view reads", "errors", "valid runs"]
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for r in rows:
    print("| " + " | ".join([
        r["setting"], str(r["clients"]), f(r["p50"], " ms"), f(r["p99"], " ms"), f(r["p100"], " ms"),
        f(r["in1s"], " %"), f(r["in3s"], " %"), f(r["hb_p99"], " ms"), f(r["reg_p99"], " ms"),
        f(r["rss"], " MiB"), f(r["cpu"], " %"), str(r["fds"]), f(r["props"]), f(r["db"], " MiB"),
        f(r["bytes"] / 1e6, " MB"), f(r["reads"]), f(r["errors"]), f"{r['valid']}/{r['runs']}",
    ]) + " |")
EOF
