#!/usr/bin/env bash
# Makes the base image the Dockerfile starts from, since no image registry is
# reachable: a minimal Debian bookworm (debootstrap --variant=minbase) with
# adduser, python3 and the RDMA user-space libraries (libibverbs1 and its
# providers, loaded at run time when devices are named), without docs, man pages, locales or apt lists,
# imported into the local Docker engine as $BASE_TAG. The root filesystem
# tarball is cached outside the clone, keyed on what goes into it.
# Usage: scripts/base-image.sh        (prints the tag)
set -euo pipefail
SUITE=bookworm
INCLUDE=adduser,python3,libibverbs1,ibverbs-providers
BASE_TAG=kvcellar-base:$SUITE
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
key=$(echo "$SUITE $INCLUDE v1" | md5sum | cut -c1-12)
tarball=$CACHE/base/$SUITE-minbase-$key.tar
if docker image inspect "$BASE_TAG" >/dev/null 2>&1 &&
   [ "$(docker image inspect -f '{{index .Config.Labels "kvcellar.base"}}' "$BASE_TAG")" = "$key" ]; then
  echo "$BASE_TAG"; exit 0
fi
mkdir -p "$CACHE/base"
exec 9>"$CACHE/base/.lock"
flock 9
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || {
    echo "base-image: installing debootstrap" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  # The mirror this host's apt uses (deb822 or one-line sources).
  mirror=$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  [ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  echo "base-image: debootstrap $SUITE from $mirror (about a minute, once)" >&2
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 ||
    { tail -20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* "$rootfs"/usr/share/info/*
  tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
fi
docker import --change "LABEL kvcellar.base=$key" --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_TAG" >/dev/null
echo "$BASE_TAG"
