#!/usr/bin/env bash
# Starts a kvcellar cluster in Docker containers on one private network:
# etcd as three members, two kv-mds replicas, three kv-server nodes (each on
# its own volume), from packaging/compose/docker-compose.yml. Builds the
# kvcellar image first if it is missing (scripts/package.sh) and a small etcd
# image from this host's etcd (Debian's etcd-server). Waits until the ring
# has three nodes, then prints where to look.
# Usage: scripts/cluster-up.sh        (KVC_PROJECT=name for a second cluster;
#        KVC_MDS1_PORT, KVC_NODE1_METRICS, ... move the published ports)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
export KVC_PROJECT=${KVC_PROJECT:-kvcellar}
export KVC_MDS1_PORT=${KVC_MDS1_PORT:-17480} KVC_MDS2_PORT=${KVC_MDS2_PORT:-17481}
export KVC_NODE1_METRICS=${KVC_NODE1_METRICS:-19701} KVC_NODE2_METRICS=${KVC_NODE2_METRICS:-19702}
export KVC_NODE3_METRICS=${KVC_NODE3_METRICS:-19703}
export KVC_GROUP=${KVC_GROUP:-cluster} KVC_LEASE_TTL=${KVC_LEASE_TTL:-6s}
compose() { docker-compose -p "$KVC_PROJECT" -f packaging/compose/docker-compose.yml "$@"; }

if ! docker image inspect kvcellar:latest >/dev/null 2>&1; then
  echo "== no kvcellar image yet: building the packages and the image (scripts/package.sh)"
  bash scripts/package.sh
fi
base=$(bash scripts/base-image.sh)
if ! docker image inspect kvcellar-etcd:local >/dev/null 2>&1; then
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  cp "$(command -v etcd)" "$ctx/etcd"
  printf 'FROM %s\nCOPY etcd /usr/local/bin/etcd\nEXPOSE 2379 2380\n' "$base" >"$ctx/Dockerfile"
  docker build -q -t kvcellar-etcd:local "$ctx" >/dev/null
fi

mkdir -p .kvcellar-work
env | grep '^KVC_' | sed 's/^/export /' >.kvcellar-work/cluster.env
echo "== starting project $KVC_PROJECT (etcd1-3, mds1-2, node1-3)"
compose up -d 2>&1 | sed 's/^/   /'
echo "== waiting for three nodes in the ring"
deadline=$((SECONDS + 120))
until out=$(bash scripts/cluster-client.sh kvctl --json ring 2>/dev/null) &&
      [ "$(echo "$out" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))')" = 3 ]; do
  [ $SECONDS -lt $deadline ] || { echo "cluster-up: the ring did not reach 3 nodes within 120 s" >&2; compose ps >&2; exit 1; }
  sleep 1
done
bash scripts/cluster-client.sh kvctl ring | sed 's/^/   /'
cat <<TXT

kvcellar cluster "$KVC_PROJECT" is up (group $KVC_GROUP).
  kv-mds API      http://127.0.0.1:$KVC_MDS1_PORT/v1/groups/$KVC_GROUP/view   http://127.0.0.1:$KVC_MDS2_PORT/healthz
  node metrics    http://127.0.0.1:$KVC_NODE1_METRICS/metrics  :$KVC_NODE2_METRICS  :$KVC_NODE3_METRICS   (and /healthz)
  clients run on the cluster network, where member names resolve:
    scripts/cluster-client.sh kvctl ring
    scripts/cluster-client.sh kvctl stat --all
    scripts/cluster-client.sh kvctl put page-1 hello && scripts/cluster-client.sh kvctl get page-1
    scripts/cluster-client.sh python3      (then: import kvcellar; c = kvcellar.Client())
  stop it with scripts/cluster-down.sh (--volumes also drops the pages)
TXT
