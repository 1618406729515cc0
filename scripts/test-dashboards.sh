#!/usr/bin/env bash
# The dashboards in a real browser: headless Chromium (Debian's chromium, a
# 480 MB install made once here when missing) renders the node's and the
# MDS's page of a loopback cluster under load; the rendered text is checked
# and screenshots are saved to target/dashboards/ (docs/ holds copies).
# Run from scripts/test-slow.sh (the install does not fit CI's budget).
# Usage: scripts/test-dashboards.sh   (after cargo build --workspace)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing chromium (once)"
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
fi
cargo build --workspace --locked -q
exec python3 scripts/test-dashboards.py target/dashboards
