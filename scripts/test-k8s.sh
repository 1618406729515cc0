#!/usr/bin/env bash
# Tests the Kubernetes manifests (packaging/k8s/; docs/DEPLOY.md,
# "Kubernetes") without a cluster: scripts/test-k8s.py renders every overlay
# with kubectl's built-in Kustomize, validates every object offline against
# the schemas of the Kubernetes versions we support (PyPI
# kubernetes-validate, pinned, in a venv kept outside the clone), checks
# what the nodes and kv-mds depend on in the rendered output, and, with
# Docker and the image (scripts/package.sh), runs the rendered pods'
# commands as containers. Part of scripts/test.sh.
# Usage: scripts/test-k8s.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v kubectl >/dev/null ||
  { echo "FAIL: kubectl is needed (it carries Kustomize: kubectl kustomize); install kubectl 1.27 or later"; exit 1; }
KV_VERSION=1.37.0
cache=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
venv=$cache/k8s/kubernetes-validate-$KV_VERSION
if [ ! -f "$venv/.kvcellar-ready" ]; then
  echo "== kubernetes-validate $KV_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "kubernetes-validate==$KV_VERSION"
  "$venv/bin/python" -c 'import kubernetes_validate, yaml' && touch "$venv/.kvcellar-ready"
fi
exec "$venv/bin/python" scripts/test-k8s.py "$@"
