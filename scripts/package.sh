#!/usr/bin/env bash
# Builds kvcellar's packages into dist/: today the Debian packages kv-server,
# kv-mds, kvctl and libkvclient (cargo-deb, cached outside the clone, keyed on
# its version). Still to come here (issue 10): rpms, the manylinux wheel, the
# Docker image, and a glibc 2.28 build baseline.
# Usage: scripts/package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO_DEB_VERSION=3.8.0
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
tools=$CACHE/tools/cargo-deb-$CARGO_DEB_VERSION
if [ ! -x "$tools/bin/cargo-deb" ]; then
  echo "== installing cargo-deb $CARGO_DEB_VERSION into $tools (about 2 minutes, once)"
  cargo install -q cargo-deb --version "$CARGO_DEB_VERSION" --locked --root "$tools"
fi
export PATH=$tools/bin:$PATH
echo "== release build"
cargo build --release --locked -p kv-server -p kv-mds -p kvctl -p kvclient
mkdir -p dist
for p in kv-server kv-mds kvctl kvclient; do
  cargo deb --no-build --locked -p "$p" -o dist/ | sed 's/^/== /'
done
