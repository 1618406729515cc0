#!/usr/bin/env bash
# Builds every kvcellar artifact into dist/:
#   kv-server, kv-mds, kvctl, libkvclient  .deb (cargo-deb) and .rpm (cargo-generate-rpm)
#   kvcellar-<version>-py3-none-manylinux_2_28_x86_64.whl  (the Python package with libkvclient inside)
#   the Docker image kvcellar:<version> and kvcellar:latest, into the local engine
# Everything is built once, against glibc 2.28 (cargo-zigbuild, zig as the
# linker), so it runs on Ubuntu 20.04+, Debian 10+ and RHEL 8+. The tools are
# pinned and cached outside the clone (scripts/tools.sh).
# Usage: scripts/package.sh [--no-image]
set -euo pipefail
cd "$(dirname "$0")/.."
image=1
[ "${1:-}" = "--no-image" ] && image=0
bash scripts/deps.sh --packaging
eval "$(bash scripts/tools.sh)"
triple=x86_64-unknown-linux-gnu
glibc=2.28
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# Shipped binaries carry no debug info or symbols (cargo-generate-rpm does not strip).
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols

echo "== release build for $triple, glibc $glibc (cargo zigbuild)"
# With RDMA (libibverbs is loaded at run time: the same binaries run
# without rdma-core).
cargo zigbuild --release --locked --target "$triple.$glibc" -p kv-server -p kv-mds -p kvctl -p kvclient \
  --features kv-server/rdma,kvctl/rdma,kvclient/rdma
mkdir -p dist
rm -f dist/*"$version"*.deb dist/*"$version"*.rpm dist/kvcellar-"$version"-*.whl

echo "== Debian packages"
for p in kv-server kv-mds kvctl kvclient; do
  cargo deb --no-build --locked --target "$triple" -p "$p" -o dist/ | sed 's/^/   /'
done
echo "== rpm packages"
for d in server mds ctl client-ffi; do
  cargo generate-rpm --target "$triple" -p "$d" -o dist/
done
ls dist/*.rpm | sed 's/^/   /'

echo "== Python wheel"
# setuptools-rust runs cargo-zigbuild for the same target (the library built
# above is reused), then the wheel is tagged for what it needs: any Python 3
# (the library is loaded with ctypes), glibc 2.28.
rm -rf plugins/build
(cd plugins && CARGO=cargo-zigbuild CARGO_BUILD_TARGET="$triple.$glibc" \
  "$KVCELLAR_PYBUILD/bin/python" -m build --wheel --no-isolation --outdir ../target/wheel >/dev/null)
built=$(ls -t target/wheel/kvcellar-"$version"-*.whl | head -1)
"$KVCELLAR_PYBUILD/bin/python" -m wheel tags --remove --python-tag py3 --abi-tag none \
  --platform-tag "manylinux_${glibc/./_}_x86_64" "$built" >/dev/null
mv target/wheel/kvcellar-"$version"-py3-none-manylinux_"${glibc/./_}"_x86_64.whl dist/
rm -rf plugins/build plugins/*.egg-info
ls dist/*.whl | sed 's/^/   /'

if [ $image = 1 ]; then
  echo "== Docker image"
  bash scripts/image.sh
fi
