"""Host KV pools for the SGLang backend's tests.

``make_pool`` builds SGLang's REAL host pool (``sglang.srt.mem_cache.pool_host``)
when SGLang and torch are importable and the kind can be built on CPU, else a
stand-in backed by real memory whose ``get_page_buffer_meta`` computes the
same pointers and sizes as SGLang 0.5.23's pools (MHA ``page_first`` and
``layer_first``, asymmetric MHA with separate K and V buffers, MLA
``page_first``). Pages are written and compared as bytes through raw
pointers, so one test body serves both.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, List, Sequence


class Indices(list):
    """A host_indices stand-in: what backends use of the tensor."""

    def tolist(self) -> List[int]:
        return list(self)

    def numel(self) -> int:
        return len(self)


class FlatPage:
    """A flat data page (the legacy path's tensor) over real memory."""

    def __init__(self, nbytes: int):
        self.buf = (ctypes.c_char * nbytes)()

    def data_ptr(self) -> int:
        return ctypes.addressof(self.buf)

    def numel(self) -> int:
        return len(self.buf)

    def element_size(self) -> int:
        return 1


_Buffer = FlatPage  # pool memory: the same thing, bigger


class StandInMHAPool:
    """SGLang's MHATokenToKVPoolHost, as far as a storage backend sees it."""

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 layout: str, itemsize: int = 2, v_head_dim: int = 0, dtype: str = "torch.float16"):
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.layout = head_num, head_dim, layout
        self.v_head_dim = v_head_dim or head_dim
        self.itemsize, self.dtype, self.start_layer = itemsize, dtype, 0
        self.asymmetric = self.v_head_dim != head_dim
        k = layer_num * size * head_num * head_dim * itemsize
        v = layer_num * size * head_num * self.v_head_dim * itemsize
        if self.asymmetric:
            self.k_buffer, self.v_buffer = _Buffer(k), _Buffer(v)
            self.kv_buffer = None
        else:
            self.kv_buffer = _Buffer(k + v)

    def _kv(self):
        if self.asymmetric:
            return self.k_buffer.data_ptr(), self.v_buffer.data_ptr()
        base = self.kv_buffer.data_ptr()
        return base, base + self.layer_num * self.size * self.head_num * self.head_dim * self.itemsize

    def get_page_buffer_meta(self, indices: Any):
        idx = indices.tolist()
        assert len(idx) % self.page_size == 0
        kb, vb = self._kv()
        hd, vd, isz, ps, ln, hn = self.head_dim, self.v_head_dim, self.itemsize, self.page_size, self.layer_num, self.head_num
        ptrs, sizes = [], []
        for at in range(0, len(idx), ps):
            i = idx[at]
            if self.layout == "layer_first":
                for layer in range(ln):
                    ptrs.append(kb + (i + layer * self.size) * hn * hd * isz)
                    sizes.append(ps * hn * hd * isz)
                    ptrs.append(vb + (i + layer * self.size) * hn * vd * isz)
                    sizes.append(ps * hn * vd * isz)
            else:
                ptrs.append(kb + i * ln * hn * hd * isz)
                sizes.append(ln * ps * hn * hd * isz)
                ptrs.append(vb + i * ln * hn * vd * isz)
                sizes.append(ln * ps * hn * vd * isz)
        return ptrs, sizes

    def page_bytes(self) -> int:
        return self.layer_num * self.page_size * self.head_num * (self.head_dim + self.v_head_dim) * self.itemsize

    def get_dummy_flat_data_page(self) -> FlatPage:
        return FlatPage(self.page_bytes())

    def get_data_page(self, index: int, flat: bool = True) -> FlatPage:
        page = FlatPage(self.page_bytes())
        at = 0
        for p, s in zip(*self.get_page_buffer_meta(Indices(range(index, index + self.page_size)))):
            ctypes.memmove(page.data_ptr() + at, p, s)
            at += s
        return page

    def set_from_flat_data_page(self, index: int, page: FlatPage) -> None:
        at = 0
        for p, s in zip(*self.get_page_buffer_meta(Indices(range(index, index + self.page_size)))):
            ctypes.memmove(p, page.data_ptr() + at, s)
            at += s


class StandInMLAPool:
    """SGLang's MLATokenToKVPoolHost (page_first), as a backend sees it."""

    def __init__(self, size: int, page_size: int, layer_num: int, kv_lora_rank: int = 64,
                 qk_rope_head_dim: int = 16, layout: str = "page_first", itemsize: int = 2,
                 dtype: str = "torch.bfloat16"):
        self.size, self.page_size, self.layer_num, self.layout = size, page_size, layer_num, layout
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.itemsize, self.dtype, self.start_layer = itemsize, dtype, 0
        self.kv_buffer = _Buffer(size * layer_num * self.kv_cache_dim * itemsize)

    def get_page_buffer_meta(self, indices: Any):
        idx = indices.tolist()
        assert len(idx) % self.page_size == 0
        base, d, isz = self.kv_buffer.data_ptr(), self.kv_cache_dim, self.itemsize
        ptrs = [base + idx[at] * self.layer_num * d * isz for at in range(0, len(idx), self.page_size)]
        return ptrs, [self.layer_num * self.page_size * d * isz] * len(ptrs)

    def get_dummy_flat_data_page(self) -> FlatPage:
        return FlatPage(self.layer_num * self.page_size * self.kv_cache_dim * self.itemsize)

    def get_data_page(self, index: int, flat: bool = True) -> FlatPage:
        page = self.get_dummy_flat_data_page()
        (p,), (s,) = self.get_page_buffer_meta(Indices(range(index, index + self.page_size)))
        ctypes.memmove(page.data_ptr(), p, s)
        return page

    def set_from_flat_data_page(self, index: int, page: FlatPage) -> None:
        (p,), (s,) = self.get_page_buffer_meta(Indices(range(index, index + self.page_size)))
        ctypes.memmove(p, page.data_ptr(), s)


class StandInStatePool:
    """A side pool without page pointers (flat pages only), like a Mamba
    state pool seen through the v2 interface."""

    def __init__(self, size: int, page_size: int, page_bytes: int):
        self.size, self.page_size, self.layout = size, page_size, "state"
        self.page_bytes_ = page_bytes
        self.store = (ctypes.c_char * (size * page_bytes))()

    def get_dummy_flat_data_page(self) -> FlatPage:
        return FlatPage(self.page_bytes_)

    def get_data_page(self, index: int, flat: bool = True) -> FlatPage:
        page = FlatPage(self.page_bytes_)
        ctypes.memmove(page.data_ptr(), ctypes.addressof(self.store) + (index // self.page_size) * self.page_bytes_,
                       self.page_bytes_)
        return page

    def set_from_flat_data_page(self, index: int, page: FlatPage) -> None:
        ctypes.memmove(ctypes.addressof(self.store) + (index // self.page_size) * self.page_bytes_, page.data_ptr(),
                       self.page_bytes_)

    def slot(self, index: int) -> bytes:
        at = (index // self.page_size) * self.page_bytes_
        return bytes(self.store[at : at + self.page_bytes_])


def publish_sglang_model(monkeypatch: Any, **fields: Any) -> None:
    """Makes this process look like a launched SGLang server that serves
    ``fields`` (``model_path``, ``revision``, ``load_format``,
    ``download_dir``, ``quantization``, ``json_model_override_args``): with
    SGLang, its own runtime context holds them as its server arguments (the
    resolved namespaces stay unpublished, as before a scheduler starts);
    without it, a stand-in of that module answers the same reads."""
    import sys
    import types

    args = types.SimpleNamespace(model_path=None, revision=None, load_format="auto", download_dir=None,
                                 quantization=None, json_model_override_args="{}")
    args.__dict__.update(fields)
    if real_sglang():
        import sglang.srt.runtime_context as rc

        monkeypatch.setattr(rc._CONTEXT, "_server_args", args)
        return

    def unpublished():
        raise ValueError("config namespace 'model' not published")

    stub = types.SimpleNamespace(get_model=unpublished, get_server_args=lambda: args)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", stub)


def real_sglang() -> bool:
    from kvcellar import _sglang_api

    return _sglang_api.REAL


def make_pool(kind: str, layout: str = "page_first", size: int = 4096, page_size: int = 16,
              layer_num: int = 4, head_num: int = 2, head_dim: int = 64) -> Any:
    """kind: 'mha', 'mha-asym' (v_head_dim = head_dim // 2) or 'mla'."""
    if real_sglang() and os.environ.get("KVCELLAR_STANDIN_POOLS") != "1":
        from real_pools import make_real_pool  # only importable with torch and sglang

        pool = make_real_pool(kind, layout, size, page_size, layer_num, head_num, head_dim)
        if pool is not None:
            return pool
    if kind == "mla":
        return StandInMLAPool(size, page_size, layer_num, layout=layout)
    v = head_dim // 2 if kind == "mha-asym" else head_dim
    return StandInMHAPool(size, page_size, layer_num, head_num, head_dim, layout, v_head_dim=v)


def indices_for(pool: Any, first_page: int, n_pages: int) -> Any:
    """host_indices of n pages starting at a page slot (a tensor for real pools)."""
    idx = list(range(first_page * pool.page_size, (first_page + n_pages) * pool.page_size))
    assert idx[-1] < pool.size, f"page slot {first_page + n_pages - 1} is outside the pool"
    if type(pool).__module__.startswith("sglang"):
        import torch

        return torch.tensor(idx, dtype=torch.int64)
    return Indices(idx)


def page_segments(pool: Any, first_page: int, n_pages: int):
    ptrs, sizes = pool.get_page_buffer_meta(indices_for(pool, first_page, n_pages))
    per = len(ptrs) // n_pages
    return [(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per]) for i in range(n_pages)]


def fill_page(pool: Any, slot: int, seed: str) -> bytes:
    """Writes content derived from `seed` into page `slot`; returns it."""
    out = bytearray()
    ((ptrs, sizes),) = page_segments(pool, slot, 1)
    h = (sum(seed.encode()) * 7919) & 0xFFFF
    for j, (p, s) in enumerate(zip(ptrs, sizes)):
        chunk = bytes(((i * 131 + h + j * 17) >> 1) & 0xFF for i in range(min(s, 4096)))
        data = (chunk * (s // len(chunk) + 1))[:s]
        ctypes.memmove(p, data, s)
        out += data
    return bytes(out)


def read_page(pool: Any, slot: int) -> bytes:
    ((ptrs, sizes),) = page_segments(pool, slot, 1)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def zero_pages(pool: Any, slots: Sequence[int]) -> None:
    for slot in slots:
        ((ptrs, sizes),) = page_segments(pool, slot, 1)
        for p, s in zip(ptrs, sizes):
            ctypes.memset(p, 0, s)
