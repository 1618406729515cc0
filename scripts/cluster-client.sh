#!/usr/bin/env bash
# Runs a command in a throwaway kvcellar container on the cluster's network
# (members advertise names only that network resolves), with KVCELLAR_MDS
# and KVCELLAR_GROUP set to the cluster's.
# Usage: scripts/cluster-client.sh kvctl ring
#        scripts/cluster-client.sh python3 -c 'import kvcellar; print(kvcellar.Client().epoch())'
#        scripts/cluster-client.sh python3       (interactive)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .kvcellar-work/cluster.env ] && . .kvcellar-work/cluster.env
KVC_PROJECT=${KVC_PROJECT:-kvcellar}
[ $# -gt 0 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
tty=()
[ -t 0 ] && [ -t 1 ] && tty=(-t)
exec docker run --rm -i "${tty[@]}" --network "${KVC_PROJECT}_cluster" \
  -e KVCELLAR_MDS=mds1:7480,mds2:7480 -e KVCELLAR_GROUP="${KVC_GROUP:-cluster}" \
  ${KVC_CLIENT_ARGS:-} "${KVC_IMAGE:-kvcellar:latest}" "$@"
