#!/usr/bin/env bash
# Installs the packaging tools, pinned, into a cache outside the clone (one
# directory per tool and version, so a version bump installs beside the old
# one), and prints the PATH entries to use them. Used by scripts/package.sh.
#   cargo-deb            Debian packages
#   cargo-generate-rpm   rpm packages
#   cargo-zigbuild       builds against glibc 2.28 with zig as the linker
#   ziglang (PyPI)       the zig compiler, in its own venv
#   build, setuptools-rust, wheel (PyPI)   the Python wheel, in a venv
# Usage: eval "$(scripts/tools.sh)"      (progress goes to stderr)
set -euo pipefail
CARGO_DEB_VERSION=3.8.0
CARGO_GENERATE_RPM_VERSION=0.21.1
CARGO_ZIGBUILD_VERSION=0.21.8
ZIGLANG_VERSION=0.17.1
PY_BUILD_PINS="build==1.6.1 setuptools==84.2.1 setuptools-rust==1.13.0 wheel==0.48.0"
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
mkdir -p "$CACHE/tools"
# One installer at a time: two sessions or CI jobs sharing the cache wait.
exec 9>"$CACHE/tools/.lock"
flock 9

crate() { # crate NAME VERSION
  local dir=$CACHE/tools/$1-$2
  if [ ! -x "$dir/bin/$1" ]; then
    echo "tools: installing $1 $2 into $dir (once)" >&2
    # --debug: a third faster to build; the tools run for seconds.
    cargo install -q --debug "$1" --version "$2" --locked --root "$dir.tmp" >&2
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  echo "$dir/bin"
}
paths=()
paths+=("$(crate cargo-deb $CARGO_DEB_VERSION)")
paths+=("$(crate cargo-generate-rpm $CARGO_GENERATE_RPM_VERSION)")
paths+=("$(crate cargo-zigbuild $CARGO_ZIGBUILD_VERSION)")
zig=$CACHE/tools/ziglang-$ZIGLANG_VERSION
if [ ! -e "$zig/.done" ]; then
  echo "tools: installing ziglang $ZIGLANG_VERSION into $zig (once)" >&2
  rm -rf "$zig"
  python3 -m venv "$zig"
  "$zig/bin/pip" install -q --disable-pip-version-check "ziglang==$ZIGLANG_VERSION" >&2
  touch "$zig/.done"
fi
pyb=$CACHE/tools/pybuild-$(echo "$PY_BUILD_PINS" | md5sum | cut -c1-12)
if [ ! -e "$pyb/.done" ]; then
  echo "tools: installing $PY_BUILD_PINS into $pyb (once)" >&2
  rm -rf "$pyb"
  python3 -m venv "$pyb"
  # shellcheck disable=SC2086
  "$pyb/bin/pip" install -q --disable-pip-version-check $PY_BUILD_PINS >&2
  touch "$pyb/.done"
fi
echo "export KVCELLAR_PYBUILD=$pyb"
zigbin=$(echo "$zig"/lib/python3*/site-packages/ziglang/zig)
[ -x "$zigbin" ] || { echo "tools: no zig binary under $zig" >&2; exit 1; }
echo "export PATH=$(IFS=:; echo "${paths[*]}"):\$PATH"
# An absolute path: python's isolated build environments shadow the venv.
echo "export CARGO_ZIGBUILD_ZIG_PATH=$zigbin"
# zig's own cache (about 50 MB) beside the tools, not in the clone.
echo "export ZIG_GLOBAL_CACHE_DIR=$CACHE/tools/zig-cache"
