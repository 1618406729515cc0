"""SGLang 0.5.23's REAL host pools built on CPU (imported only where torch
and sglang are installed). Device pool first, then the host pool over its
buffer info, as SGLang's cache controller builds them; pin_memory=False
(pinning needs a driver)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


def make_real_pool(kind: str, layout: str, size: int, page_size: int, layer_num: int, head_num: int,
                   head_dim: int) -> Optional[Any]:
    """A host pool of at least `size` tokens, or None where SGLang has no
    such pool (the caller then uses a stand-in)."""
    dev_tokens = size // 2  # host_to_device_ratio 2 gives `size` host tokens (plus a padding page)
    if kind == "mla":
        dev = MLATokenToKVPool(size=dev_tokens, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=64,
                               qk_rope_head_dim=16, layer_num=layer_num, device="cpu", enable_memory_saver=False)
        return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device="cpu", override_kv_cache_dim=dev.kv_cache_dim,
                                    device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                    end_layer=dev.end_layer, target_layer_num=dev.layer_num)
    v_head_dim = head_dim // 2 if kind == "mha-asym" else head_dim
    if kind == "mha-asym" and layout != "page_first":
        return None  # SGLang's asymmetric pool supports page_first only
    dev = MHATokenToKVPool(size=dev_tokens, page_size=page_size, dtype=torch.float16, head_num=head_num,
                           head_dim=head_dim, layer_num=layer_num, device="cpu", enable_memory_saver=False,
                           v_head_dim=v_head_dim)
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                       device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                       end_layer=dev.end_layer)
