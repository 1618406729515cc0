#!/usr/bin/env bash
# The deployable artifacts, built and tried as a user would (part of
# scripts/test.sh): scripts/package.sh builds the debs, rpms, wheel and
# image; test-packages.sh installs the debs with dpkg (root) and the wheel in
# a fresh venv; test-image.sh runs every role of the image; test-cluster.py
# runs the container cluster through stops, kills and a partition.
# Usage: scripts/test-dist.sh
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== test-dist: $1 (at ${SECONDS}s)"; }
docker=1
if ! docker info >/dev/null 2>&1; then
  docker=0
  echo "SKIPPED: no Docker engine answers here: the image and the container cluster are not built or tested"
fi
step "package.sh"
if [ $docker = 1 ]; then bash scripts/package.sh; else bash scripts/package.sh --no-image; fi
if [ "$(id -u)" = 0 ]; then
  step "test-packages.sh"
  bash scripts/test-packages.sh --built
else
  echo "SKIPPED: not root: the debs are not installed (dpkg -i) here"
fi
if [ $docker = 1 ]; then
  step "test-image.sh"
  bash scripts/test-image.sh
  step "test-cluster.py"
  python3 scripts/test-cluster.py
fi
step "done"
