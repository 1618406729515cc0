#!/usr/bin/env bash
# Checks too slow or too invasive for every CI run, run by hand and reported
# in the session notes: today the Debian packages built, installed with dpkg
# on this machine (root), run and removed (scripts/test-packages.sh), and the
# plugin overhead benchmark (scripts/bench-plugins.sh).
# Usage: scripts/test-slow.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-packages.sh
bash scripts/bench-plugins.sh --rounds 5
