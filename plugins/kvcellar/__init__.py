"""kvcellar: Python access to the kvcellar KV-cache store.

- :class:`kvcellar.Client` — a typed, thread-safe client over ``libkvclient.so``.
- ``kvcellar.hicache`` — the SGLang HiCache L3 backend (imported on demand).
- ``kvcellar.lmcache`` — the LMCache remote connector (imported on demand).
- ``kvcellar.vllm`` — the vLLM KV connector (imported on demand; needs vLLM).

The package imports without torch, sglang, lmcache or vllm. The library is found
through ``KVCELLAR_LIB``, else the copy shipped inside the package, else the
loader's search path; it is loaded on first use and must match this
package's version (see :func:`kvcellar.library_version`).
"""

from kvcellar._version import __version__
from kvcellar.client import (
    Client,
    ClosedError,
    ConfigError,
    DeniedError,
    GetResult,
    Geometry,
    KvcellarError,
    LibraryError,
    Status,
    library_version,
)

__all__ = [
    "Client",
    "ClosedError",
    "ConfigError",
    "DeniedError",
    "GetResult",
    "Geometry",
    "KvcellarError",
    "LibraryError",
    "Status",
    "__version__",
    "library_version",
]
