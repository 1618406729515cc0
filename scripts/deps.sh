#!/usr/bin/env bash
# Installs what building and testing kvcellar needs, only when it is missing.
# Safe to run repeatedly; used by scripts/quickstart.sh and scripts/test.sh.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

apt_updated=0
need_deb() { # need_deb PACKAGE COMMAND   (COMMAND "-": install without checking)
  local pkg=$1 cmd=$2
  [ "$cmd" != - ] && have "$cmd" && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! have apt-get; then
    echo "deps: '$cmd' is missing and this is not a Debian-like system: install '$pkg' by hand" >&2
    exit 1
  fi
  if [ $apt_updated -eq 0 ]; then
    echo "deps: apt-get update" >&2
    $sudo apt-get update -qq
    apt_updated=1
  fi
  echo "deps: installing $pkg" >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$pkg" >/dev/null
}

if ! have cargo; then
  echo "deps: cargo not found: install a Rust toolchain (https://rustup.rs), 1.85 or newer" >&2
  exit 1
fi
need_deb gcc cc
need_deb python3 python3
# The RDMA build (cargo feature rdma, the build tests and packages use):
# sideway's rdma-mummy-sys compiles rdma-core's stubs with cmake and makes
# its bindings with bindgen, which loads libclang. No rdma-core is needed.
need_deb cmake cmake
need_deb clang clang
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need_deb libclang-dev -
need_deb binutils nm
# The C ABI test runs under valgrind (it runs without, with a note, if this fails).
# etcd is the membership store: kv-mds talks to it; tests and the quickstart
# start their own etcd on free loopback ports. protoc builds etcd's gRPC client.
need_deb etcd-server etcd
need_deb protobuf-compiler protoc
# etcdctl and openssl: the etcd TLS and authentication test (tests/tests/etcd_tls.rs).
need_deb etcd-client etcdctl
need_deb openssl openssl
# xfs_io: the fault suite shuts a loop-mounted filesystem down (a failing disk).
need_deb xfsprogs xfs_io
(need_deb valgrind valgrind) || echo "deps: valgrind unavailable: the C ABI test runs without it" >&2
# Packaging and its tests (scripts/package.sh, test-packages.sh, the image
# and the container cluster) need a few more tools.
if [ "${1:-}" = "--packaging" ]; then
  need_deb rpm rpm
  need_deb cpio cpio
  need_deb file file
  need_deb debootstrap debootstrap
  need_deb man-db man
  need_deb docker-compose docker-compose
fi
