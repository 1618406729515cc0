#!/usr/bin/env bash
# Checks too slow for every CI run, run by hand and reported in the session
# notes: today the plugin overhead benchmark (scripts/bench-plugins.sh).
# The packages, image and container cluster moved into scripts/test.sh
# (scripts/test-dist.sh).
# Usage: scripts/test-slow.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bench-plugins.sh --rounds 5
