"""ctypes binding of libkvclient.so (the C ABI in client-ffi/include/kvclient.h).

Nothing to install: ctypes ships with Python. The library is found through
``KVCELLAR_LIB`` (a path), else the loader's search path (``libkvclient.so``).

Status codes follow DESIGN.md §4: positive means "not served, recompute",
negative means the caller erred. Buffers are passed without copies: ``get``
fills a caller-owned writable buffer (bytearray, memoryview, numpy array).
"""

import ctypes
import os

KV_OK = 0
KV_MISS = 1
KV_MISMATCH = 2
KV_CORRUPT = 3
KV_TOO_SMALL = 4
KV_UNAVAILABLE = 5
KV_TIMEOUT = 6
KV_REJECTED = 7
KV_EINVAL = -1
KV_EINTERNAL = -2
KV_FLAG_MLA = 1


class Geometry(ctypes.Structure):
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
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class KvError(RuntimeError):
    """A caller error (negative status) or a failed kv_open."""


_lib = None


def load(path=None):
    """Loads libkvclient.so once and declares its functions."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = ctypes.CDLL(path or os.environ.get("KVCELLAR_LIB") or "libkvclient.so")
    c = ctypes
    p_client = c.c_void_p
    sig = {
        "kv_open": (p_client, [c.c_char_p, c.POINTER(Geometry), c.c_char_p]),
        "kv_close": (None, [p_client]),
        "kv_set_members": (c.c_int, [p_client, c.c_char_p]),
        "kv_epoch": (c.c_uint64, [p_client]),
        "kv_put": (c.c_int, [p_client, c.c_char_p, c.c_void_p, c.c_size_t]),
        "kv_putv": (c.c_int, [p_client, c.c_char_p, c.POINTER(IoVec), c.c_size_t]),
        "kv_get": (c.c_int, [p_client, c.c_char_p, c.c_void_p, c.c_size_t, c.POINTER(c.c_size_t)]),
        "kv_getv": (c.c_int, [p_client, c.c_char_p, c.POINTER(IoVec), c.c_size_t, c.POINTER(c.c_size_t)]),
        "kv_exist": (c.c_int, [p_client, c.c_char_p]),
        "kv_batch_exist": (c.c_int, [p_client, c.c_size_t, c.POINTER(c.c_char_p), c.POINTER(c.c_int)]),
        "kv_batch_putv": (c.c_int, [p_client, c.c_size_t, c.POINTER(c.c_char_p), c.POINTER(IoVec),
                                    c.POINTER(c.c_size_t), c.POINTER(c.c_int)]),
        "kv_batch_getv": (c.c_int, [p_client, c.c_size_t, c.POINTER(c.c_char_p), c.POINTER(IoVec),
                                    c.POINTER(c.c_size_t), c.POINTER(c.c_size_t), c.POINTER(c.c_int)]),
        "kv_register_memory": (c.c_int, [p_client, c.c_void_p, c.c_size_t]),
        "kv_start_mds_discovery": (c.c_int, [p_client, c.c_char_p, c.c_char_p, c.c_int]),
        "kv_stats_snapshot": (c.c_size_t, [p_client, c.c_char_p, c.c_size_t]),
        "kv_last_error": (c.c_char_p, []),
        "kv_version": (c.c_char_p, []),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    _lib = lib
    return lib


def _addr(buf, writable):
    """(address, length, keepalive) of a buffer-protocol object.

    Writable buffers are passed without copying. A read-only buffer that is
    not ``bytes`` (a memoryview slice, a read-only numpy array) is copied
    once; the copy is returned as ``keepalive`` and must outlive the call.
    """
    mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("buffer must be contiguous")
    mv = mv.cast("B")
    if mv.nbytes == 0:
        return None, 0, mv
    if writable:
        if mv.readonly:
            raise ValueError("buffer must be writable")
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes, mv
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes, mv
    data = buf if isinstance(buf, bytes) else mv.tobytes()
    # c_char_p over a bytes object points at its own storage (no copy); the
    # bytes object (kept alive by the caller through `data`) owns it.
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, len(data), data


def _key(key):
    k = key.encode() if isinstance(key, str) else bytes(key)
    if not k or len(k) > 1024 or b"\0" in k:
        raise ValueError("a key is 1..1024 bytes without NUL")
    return k


class Client:
    """One kvcellar client (thread-safe, like the handle it wraps)."""

    def __init__(self, members, geometry, options=None, lib_path=None):
        self._lib = load(lib_path)
        self._geo = geometry if isinstance(geometry, Geometry) else Geometry(**geometry)
        opts = options.encode() if options else None
        self._c = self._lib.kv_open(members.encode(), ctypes.byref(self._geo), opts)
        if not self._c:
            raise KvError(self.last_error())

    def close(self):
        if self._c:
            self._lib.kv_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def last_error(self):
        return (self._lib.kv_last_error() or b"").decode(errors="replace")

    def put(self, key, data):
        addr, n, keep = _addr(data, writable=False)
        r = self._lib.kv_put(self._c, _key(key), addr, n)
        del keep  # alive until the call returned
        return r

    def get(self, key, buf):
        """Fills ``buf``; returns (status, length). On KV_TOO_SMALL the length
        is the size needed."""
        addr, n, keep = _addr(buf, writable=True)
        out = ctypes.c_size_t(0)
        s = self._lib.kv_get(self._c, _key(key), addr, n, ctypes.byref(out))
        del keep
        return s, out.value

    def exist(self, key):
        return self._lib.kv_exist(self._c, _key(key))

    def batch_exist(self, keys):
        arr = (ctypes.c_char_p * len(keys))(*[_key(k) for k in keys])
        st = (ctypes.c_int * len(keys))()
        r = self._lib.kv_batch_exist(self._c, len(keys), arr, st)
        if r < 0:
            raise KvError(self.last_error())
        return list(st)

    def set_members(self, members):
        return self._lib.kv_set_members(self._c, members.encode())

    def start_mds_discovery(self, mds_endpoints, group="default", poll_ms=1000):
        """Follow a group's members through kv-mds (``"host:port,..."``).

        Returns the status: 0 once the first view is applied, KV_UNAVAILABLE
        (5) while no MDS answered yet (discovery keeps trying meanwhile).
        """
        return self._lib.kv_start_mds_discovery(self._c, mds_endpoints.encode(), group.encode(), int(poll_ms))

    def epoch(self):
        return self._lib.kv_epoch(self._c)

    def stats(self):
        n = self._lib.kv_stats_snapshot(self._c, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.kv_stats_snapshot(self._c, buf, n + 1)
        return buf.value.decode()


def version(lib_path=None):
    return load(lib_path).kv_version().decode()
