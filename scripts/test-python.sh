#!/usr/bin/env bash
# The Python package's tests (plugins/tests) against real kv-server processes,
# with the engines' base classes stood in (no torch, sglang or lmcache): the
# package from the source tree, the library from target/debug. The venv
# (pytest, and prometheus_client for its OpenMetrics parser) lives outside
# the clone, keyed on the pinned versions.
# Usage: scripts/test-python.sh [pytest args...]   (after cargo build --workspace)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST_VERSION=8.3.5
PROMCLIENT_VERSION=0.21.1
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
PYVER=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=$CACHE/venv-test-py$PYVER-pytest$PYTEST_VERSION-prom$PROMCLIENT_VERSION
if [ ! -f "$venv/.ready" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "pytest==$PYTEST_VERSION" \
    "prometheus_client==$PROMCLIENT_VERSION"
  touch "$venv/.ready"
fi
export KVCELLAR_BIN_DIR=$PWD/target/debug
export KVCELLAR_LIB=$PWD/target/debug/libkvclient.so
export PYTHONPATH=$PWD/plugins${PYTHONPATH:+:$PYTHONPATH}
export KVCELLAR_FORCE_STANDIN=1
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q plugins/tests "$@"
