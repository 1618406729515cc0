#!/usr/bin/env bash
# Builds the Docker image kvcellar:<version> and kvcellar:latest from the
# top-level Dockerfile and the packages in dist/ (scripts/package.sh makes
# them, then calls this), on the base image scripts/base-image.sh makes.
# Usage: scripts/image.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
base=$(bash scripts/base-image.sh)
for f in kv-server_"$version"-1_amd64.deb kv-mds_"$version"-1_amd64.deb kvctl_"$version"-1_amd64.deb \
         libkvclient_"$version"-1_amd64.deb kvcellar-"$version"-py3-none-manylinux_2_28_x86_64.whl; do
  [ -e "dist/$f" ] || { echo "image: dist/$f is missing: run scripts/package.sh" >&2; exit 1; }
done
docker build -q --build-arg BASE="$base" --build-arg VERSION="$version" \
  -t "kvcellar:$version" -t kvcellar:latest . >/dev/null
size=$(docker image inspect -f '{{.Size}}' "kvcellar:$version")
echo "   kvcellar:$version and kvcellar:latest, $((size / 1000000)) MB"
