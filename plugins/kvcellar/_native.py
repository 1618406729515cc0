"""ctypes binding of libkvclient.so (the C ABI of ``client-ffi/include/kvclient.h``).

This module only finds, checks and declares the library; :mod:`kvcellar.client`
is the API to use. Nothing to install: ctypes ships with Python.

Where the library comes from, in order:

1. ``KVCELLAR_LIB`` (a path): only that file is tried.
2. The copy shipped inside this package (``kvcellar/libkvclient*.so``, built
   by ``pip install``).
3. The loader's search path: ``libkvclient.so.0`` (the ``libkvclient``
   system package), then ``libkvclient.so``.

The library must export every function declared below and report a version
with this package's major and minor number; anything else raises
:class:`LibraryError` naming what was looked for.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import List, Optional

from kvcellar._version import __version__

ENV_LIB = "KVCELLAR_LIB"


class LibraryError(ImportError):
    """libkvclient.so is missing, unloadable, or does not match this package."""


class Geometry(ctypes.Structure):
    """``kv_geometry``: the page geometry stamped on put and required on get."""

    _fields_ = [
        ("model_hash", ctypes.c_uint64),
        ("page_size", ctypes.c_uint32),
        ("dtype_tag", ctypes.c_uint32),
        ("tp_size", ctypes.c_uint16),
        ("tp_rank", ctypes.c_uint16),
        ("layer_num", ctypes.c_uint16),
        ("head_num", ctypes.c_uint16),
        ("head_dim", ctypes.c_uint16),
        ("flags", ctypes.c_uint16),
    ]


class IoVec(ctypes.Structure):
    """``kv_iovec``: one caller buffer segment."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


FLAG_MLA = 1
MAX_KEY_LEN = 1024
MAX_ITEM_IOVCNT = 4096
MAX_BATCH_ITEMS = 65536

_c = ctypes
_P = ctypes.c_void_p
_SIGNATURES = {
    "kv_open": (_P, [_c.c_char_p, _c.POINTER(Geometry), _c.c_char_p]),
    "kv_close": (None, [_P]),
    "kv_set_members": (_c.c_int, [_P, _c.c_char_p]),
    "kv_start_mds_discovery": (_c.c_int, [_P, _c.c_char_p, _c.c_char_p, _c.c_int]),
    "kv_epoch": (_c.c_uint64, [_P]),
    "kv_set_call_timeout_ms": (_c.c_uint32, [_c.c_uint32]),
    "kv_put": (_c.c_int, [_P, _c.c_char_p, _c.c_void_p, _c.c_size_t]),
    "kv_putv": (_c.c_int, [_P, _c.c_char_p, _c.POINTER(IoVec), _c.c_size_t]),
    "kv_get": (_c.c_int, [_P, _c.c_char_p, _c.c_void_p, _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "kv_getv": (_c.c_int, [_P, _c.c_char_p, _c.POINTER(IoVec), _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "kv_exist": (_c.c_int, [_P, _c.c_char_p]),
    "kv_delete": (_c.c_int, [_P, _c.c_char_p]),
    "kv_batch_putv": (
        _c.c_int,
        [_P, _c.c_size_t, _c.POINTER(_c.c_char_p), _c.POINTER(IoVec), _c.POINTER(_c.c_size_t), _c.POINTER(_c.c_int)],
    ),
    "kv_batch_getv": (
        _c.c_int,
        [
            _P,
            _c.c_size_t,
            _c.POINTER(_c.c_char_p),
            _c.POINTER(IoVec),
            _c.POINTER(_c.c_size_t),
            _c.POINTER(_c.c_size_t),
            _c.POINTER(_c.c_int),
        ],
    ),
    "kv_batch_exist": (_c.c_int, [_P, _c.c_size_t, _c.POINTER(_c.c_char_p), _c.POINTER(_c.c_int)]),
    "kv_batch_delete": (_c.c_int, [_P, _c.c_size_t, _c.POINTER(_c.c_char_p), _c.POINTER(_c.c_int)]),
    "kv_register_memory": (_c.c_int, [_P, _c.c_void_p, _c.c_size_t]),
    "kv_unregister_memory": (_c.c_int, [_P, _c.c_void_p]),
    "kv_stats_snapshot": (_c.c_size_t, [_P, _c.c_char_p, _c.c_size_t]),
    "kv_last_error": (_c.c_char_p, []),
    "kv_version": (_c.c_char_p, []),
}

_lock = threading.Lock()
_loaded: dict = {}


def candidates() -> List[str]:
    """The paths or names tried, in order (see the module docs)."""
    env = os.environ.get(ENV_LIB, "").strip()
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    shipped = sorted(glob.glob(os.path.join(here, "libkvclient*.so")))
    return shipped + ["libkvclient.so.0", "libkvclient.so"]


def _compatible(lib_version: str) -> bool:
    want = __version__.split(".")[:2]
    return lib_version.split(".")[:2] == want


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads, checks and declares the library once per path."""
    tried = [path] if path else candidates()
    key = tuple(tried)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        errors = []
        for name in tried:
            try:
                lib = ctypes.CDLL(name)
            except OSError as e:
                errors.append(f"{name}: {e}")
                continue
            missing = [f for f in _SIGNATURES if not hasattr(lib, f)]
            if missing:
                errors.append(f"{name}: lacks {', '.join(missing)} (too old, or not libkvclient)")
                continue
            for fname, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, fname)
                fn.restype = res
                fn.argtypes = args
            version = (lib.kv_version() or b"").decode()
            if not _compatible(version):
                errors.append(f"{name}: version {version}, this kvcellar package ({__version__}) needs {'.'.join(__version__.split('.')[:2])}.x")
                continue
            lib._kvcellar_path = name  # type: ignore[attr-defined]
            _loaded[key] = lib
            return lib
        hint = f"set {ENV_LIB} to a libkvclient.so of version {__version__}, or reinstall the kvcellar package"
        raise LibraryError("cannot load libkvclient: " + "; ".join(errors) + f" ({hint})")


def last_error(lib: ctypes.CDLL) -> str:
    """The calling thread's last failure message from the library."""
    return (lib.kv_last_error() or b"").decode(errors="replace")
