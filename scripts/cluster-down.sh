#!/usr/bin/env bash
# Stops the container cluster scripts/cluster-up.sh started and removes its
# containers and network; --volumes also removes the nodes' and etcd's data.
# Usage: scripts/cluster-down.sh [--volumes]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .kvcellar-work/cluster.env ] && . .kvcellar-work/cluster.env
KVC_PROJECT=${KVC_PROJECT:-kvcellar}
args=(down --timeout 30)
[ "${1:-}" = "--volumes" ] && args+=(--volumes)
docker-compose -p "$KVC_PROJECT" -f packaging/compose/docker-compose.yml "${args[@]}"
