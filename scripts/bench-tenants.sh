#!/usr/bin/env bash
# Noisy neighbour (docs/BENCHMARKS.md, "Tenants"): two tenants share 3
# loopback nodes of CAP each. Tenant B reads its working set (a fifth of
# the group, pages of 256 KiB) as an engine does on prefix hits (a batch
# exist of 16 pages, 200 ms later their batch get; two streams, so each
# page is read again every few seconds) while tenant A writes as fast as it
# can for the same SECONDS (many times the group's capacity); once
# without quotas (one LRU per disk) and once with half of every node each
# (kvctl tenants --set). Prints, per run, B's hit rate and get p50/p99, what
# A wrote against the capacity, and each tenant's evictions.
#
# Usage: scripts/bench-tenants.sh [SECONDS] [CAP]   (after cargo build --release --bins)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
cap=${2:-64M}
bin=${KVCELLAR_BIN:-$PWD/target/release}
work=$(mktemp -d)
keep=$(mktemp -d)
trap 'bash scripts/trace-cluster.sh "$work" down >/dev/null 2>&1 || true; rm -rf "$work" "$keep"' EXIT

printf 'a-token role=engine tenant=team-a\nb-token role=engine tenant=team-b\nadm role=admin\nnodes role=node\n' >"$keep/table"
for t in a-token b-token adm nodes; do printf '%s\n' "$t" >"$keep/$t"; done
chmod 600 "$keep"/*
export KVCELLAR_AUTH_TOKEN_FILE=$keep/nodes
cap_bytes=$(python3 -c 'import sys; u={"K":1<<10,"M":1<<20,"G":1<<30}; s=sys.argv[1]; print(int(s[:-1])*u[s[-1]] if s[-1] in u else int(s))' "$cap")
b_keys=$((3 * cap_bytes / 5 / (256 << 10)))

tenants() { # per-tenant evictions (own, for others) over the nodes
  "$bin/kvctl" --json stat --all --mds "$mds" --group trace |
    python3 -c '
import json, sys
j = json.load(sys.stdin); s = {}
for n in j["nodes"]:
    for t in n["stats"].get("tenants", []):
        a = s.setdefault(t["tenant"], [0, 0, 0, 0, 0])
        a[0] += t["evictions"]; a[1] += t.get("evicted_for_others", 0); a[2] += t["bytes"]
        a[3] += t.get("hits", 0); a[4] += t.get("misses", 0)
print("  ".join(f"{k}: page hit rate {100 * v[3] / max(v[3] + v[4], 1):.1f}% ({v[4]} misses), evicted {v[0]} ({v[1]} for others), holds {v[2] >> 20} MiB"
                for k, v in sorted(s.items()) if k != "default"))'
}

for mode in none halves; do
  bash scripts/trace-cluster.sh "$work" down >/dev/null 2>&1 || true
  rm -rf "${work:?}"/*
  MDS_ARGS="--group-token-file trace=$keep/table" NODE_ARGS="--no-sync --auth-token-file $keep/table " \
    bash scripts/trace-cluster.sh "$work" up 1 "$cap" 600 >/dev/null
  mds=$(bash scripts/trace-cluster.sh "$work" mds)
  if [ "$mode" = halves ]; then
    for q in team-a=50% team-b=50%; do
      "$bin/kvctl" --admin-token-file "$keep/adm" tenants --mds "$mds" --group trace --set "$q" >/dev/null
    done
    for _ in $(seq 100); do
      "$bin/kvctl" --json stat --all --mds "$mds" --group trace |
        python3 -c 'import json,sys; j=json.load(sys.stdin); sys.exit(0 if all(any(t.get("quota",0)>0 for t in n["stats"].get("tenants",[])) for n in j["nodes"]) else 1)' && break
      sleep 0.1
    done
  fi
  "$bin/kvctl" --json --auth-token-file "$keep/b-token" bench --mds "$mds" --group trace --op exist-get --keys "$b_keys" \
    --batch 16 --gap-ms 200 --size 256K --threads 2 --duration "$secs" --no-raw --prefix b >"$work/b.json" 2>"$work/b.err" &
  b=$!
  "$bin/kvctl" --json --auth-token-file "$keep/a-token" bench --mds "$mds" --group trace --op put \
    --size 256K --threads 2 --duration "$secs" --no-raw --prefix a >"$work/a.json" 2>"$work/a.err" || true
  wait $b || true
  python3 - "$work/a.json" "$work/b.json" "$mode" "$cap_bytes" "$b_keys" <<'PY'
import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
mode, cap, keys = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# Batches: a status per batch (its worst item); the pages' hits from the nodes.
ok = b["statuses"].get("ok", 0); total = sum(b["statuses"].values())
p50, p99 = b.get("get_p50_us", b["p50_us"]), b.get("get_p99_us", b["p99_us"])
written = a["statuses"].get("ok", 0) * a["size"]
print(f"quotas {mode:6}: B {keys} pages ({keys * 256 / 1024:.0f} MiB of {3 * cap >> 20} MiB): {100 * ok / max(total, 1):.1f}% of "
      f"{total} batch gets whole, get p50 {p50:.0f} us p99 {p99:.0f} us; "
      f"A wrote {written / (3 * cap):.1f}x the group ({a['ops_per_sec']:.0f} puts/s, p99 {a['p99_us']:.0f} us)")
PY
  echo "  $(tenants)"
done
