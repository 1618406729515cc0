#!/usr/bin/env bash
# Creates (only when missing) the venvs that hold the REAL engines the
# Python plugins are tested against, outside the repo:
#   $CACHE/engines/sglang-<ver>-py<X.Y>   sglang (full dependency install) + pytest
#   $CACHE/engines/lmcache-<ver>-py<X.Y>  lmcache (full dependency install) + pytest
#   $CACHE/engines/vllm-<ver>-py<X.Y>     vllm (full dependency install) + pytest
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
# wheelhouses 4.1 GB + 3.1 GB. A failed venv stays for inspection until the
# next run removes it.
#
# Both installs run concurrently (mostly network-bound); each logs to
# $CACHE/engines/<venv name>.log. Progress goes to stderr; stdout gets only:
#   SGLANG_PY=<python of the sglang venv>
#   LMCACHE_PY=<python of the lmcache venv>
#   VLLM_PY=<python of the vllm venv>
# so `eval "$(scripts/engine-venvs.sh)"` works.
#
# Usage: scripts/engine-venvs.sh [sglang|lmcache|vllm]...   (default: all)
# Env:   KVCELLAR_CACHE  cache root (see above)
#        KVCELLAR_PYTHON interpreter to build the venvs from (default python3)
set -euo pipefail

SGLANG_VERSION=0.5.23
LMCACHE_VERSION=0.5.6
VLLM_VERSION=0.33.0

# Full dependency installs: this is what runs on CPU. sglang 0.5.23 pins
# torch==2.14.1 itself; lmcache 0.5.6 takes the newest torch (2.15.0 when
# written). No --no-deps override was needed on this platform (Debian
# bookworm, CPython 3.11, x86_64): every dependency installs from a wheel.
SGLANG_SPEC=("sglang==$SGLANG_VERSION" "pytest")
LMCACHE_SPEC=("lmcache==$LMCACHE_VERSION" "pytest")
VLLM_SPEC=("vllm==$VLLM_VERSION" "pytest")

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

# build_venv DIR WHEELS CHECK SPEC... : install into a fresh venv from the
# wheelhouse; fill the wheelhouse from the registry first when it lacks
# something. Each step is checked explicitly: `set -e` does not apply inside a
# function called from an `if`.
build_venv() {
  local dir=$1 wheels=$2 check=$3
  shift 3
  local pip=(-m pip --disable-pip-version-check)
  echo "== $(date -u +%FT%TZ) creating $dir"
  "$PYTHON" -m venv "$dir" || return 1
  echo "== offline install from $wheels: $*"
  if ! "$dir/bin/python" "${pip[@]}" install --progress-bar off --no-index --find-links "$wheels" "$@"; then
    echo "== wheelhouse incomplete: pip wheel $* (from the registry)"
    "$dir/bin/python" "${pip[@]}" wheel --progress-bar off --wheel-dir "$wheels" "$@" || return 1
    rm -rf "$dir" && "$PYTHON" -m venv "$dir" || return 1
    echo "== offline install from $wheels: $*"
    "$dir/bin/python" "${pip[@]}" install --progress-bar off --no-index --find-links "$wheels" "$@" || return 1
  fi
  echo "== import check"
  "$dir/bin/python" -c "$check" || return 1
  echo "== pip freeze"
  "$dir/bin/python" "${pip[@]}" freeze || return 1
}

# ensure_venv NAME VERSION CHECK SPEC... : prints nothing on stdout.
ensure_venv() {
  local name=$1 version=$2 check=$3
  shift 3
  local tag="$name-$version-py$PYVER"
  local dir="$ENGINES/$tag"
  local marker="$dir/.kvcellar-ready"
  local logf="$ENGINES/$tag.log"
  local wheels="$WHEELS/$tag"
  local want
  want="spec: $* python: $PYVER check: $(printf %s "$check" | cksum | cut -d" " -f1)"
  if [ -f "$marker" ] && [ "$(head -n1 "$marker")" = "$want" ] && [ -x "$dir/bin/python" ]; then
    log "$name: ready at $dir (cached)"
    return 0
  fi
  local t0=$SECONDS
  log "$name: installing into $dir (log: $logf)"
  rm -rf "$dir"
  mkdir -p "$wheels"
  if ! build_venv "$dir" "$wheels" "$check" "$@" >"$logf" 2>&1; then
    log "$name: FAILED after $((SECONDS - t0)) s; see $logf (tail below)"
    tail -n 20 "$logf" >&2
    return 1
  fi
  { echo "$want"; echo "built: $(date -u +%FT%TZ) in $((SECONDS - t0)) s"; } >"$marker"
  log "$name: installed in $((SECONDS - t0)) s at $dir"
}

want_sglang=0 want_lmcache=0 want_vllm=0
if [ $# -eq 0 ]; then want_sglang=1 want_lmcache=1 want_vllm=1; fi
for arg in "$@"; do
  case $arg in
    sglang) want_sglang=1 ;;
    lmcache) want_lmcache=1 ;;
    vllm) want_vllm=1 ;;
    *) echo "usage: $0 [sglang|lmcache|vllm]..." >&2; exit 2 ;;
  esac
done

pids=()
if [ $want_sglang -eq 1 ]; then
  ensure_venv sglang "$SGLANG_VERSION" "$SGLANG_CHECK" "${SGLANG_SPEC[@]}" &
  pids+=($!)
fi
if [ $want_lmcache -eq 1 ]; then
  ensure_venv lmcache "$LMCACHE_VERSION" "$LMCACHE_CHECK" "${LMCACHE_SPEC[@]}" &
  pids+=($!)
fi
if [ $want_vllm -eq 1 ]; then
  ensure_venv vllm "$VLLM_VERSION" "$VLLM_CHECK" "${VLLM_SPEC[@]}" &
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
