#!/usr/bin/env bash
# Runs every check and test of the project: formatting, lints, the unit,
# protocol and end-to-end tests (real binaries). Installs missing packages.
# Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== build binaries and libkvclient.so (end-to-end tests use them)"
cargo build --workspace --locked
echo "== cargo test"
cargo test --workspace --locked 2>&1 | tee target/test-output.log
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' target/test-output.log
