"""kvcellar: Python access to the kvcellar KV-cache store.

``kvcellar._native`` is the ctypes binding of ``libkvclient.so``. The SGLang
HiCache backend (``kvcellar.hicache``) and the LMCache connector
(``kvcellar.lmcache``) build on it (plugin issue).
"""

__all__ = ["_native"]
