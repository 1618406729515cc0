"""The launch configuration in docs/plugins/*.md works as pasted: SGLang's
own parser and factory take the extra-config JSON of docs/plugins/sglang.md,
LMCache's own config loader and backends take the YAML of
docs/plugins/lmcache.md, vLLM's factory builds the connector from the
--kv-transfer-config of docs/plugins/vllm.md, with the cluster from
KVCELLAR_* as the quickstart's
export line sets it. Real engines only (scripts/test-engines.sh)."""

from __future__ import annotations

import json
import os
import re

import pytest

from conftest import ROOT
from pools import fill_page, indices_for, make_pool, read_page, real_sglang

DOCS = os.path.join(ROOT, "docs", "plugins")


def _doc(name: str) -> str:
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


def test_sglang_guide_json_parses_and_loads(cluster, clean_env, tmp_path):
    configs = re.findall(r"--hicache-storage-backend-extra-config '([^']*)'", _doc("sglang.md"))
    assert len(configs) >= 2, "the guide shows the quickstart and the production form"
    parsed = [json.loads(c) for c in configs]
    from kvcellar.hicache import OWN_KEYS, SGLANG_KEYS

    for p in parsed:
        assert p["module_path"] == "kvcellar.hicache" and p["class_name"] == "KvcellarStorage"
        assert set(p) <= set(OWN_KEYS) | set(SGLANG_KEYS), set(p) - set(OWN_KEYS) - set(SGLANG_KEYS)
    if not real_sglang():
        pytest.skip("loading through SGLang needs SGLang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    clean_env.setenv("KVCELLAR_MEMBERS", cluster.members)  # the export line's role
    # A launched server serving the guide's model, downloaded to the hub cache.
    from conftest import fake_hub
    from pools import publish_sglang_model

    fake_hub(clean_env, str(tmp_path / "hub"), "Qwen/Qwen3-8B")
    publish_sglang_model(clean_env, model_path="Qwen/Qwen3-8B")
    extra = HybridCacheController.parse_storage_backend_extra_config(configs[0])[0]
    sc = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                              model_name="Qwen/Qwen3-8B", extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", sc, None)
    pool = make_pool("mha")
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    try:
        want = fill_page(pool, 0, "docs")
        keys = ["d0c5" * 16]
        assert b.batch_set_v1(keys, indices_for(pool, 0, 1)) == [True]
        assert b.batch_get_v1(keys, indices_for(pool, 5, 1)) == [True] and read_page(pool, 5) == want
    finally:
        b.close()


def test_lmcache_guide_yaml_loads(cluster, clean_env, tmp_path):
    block = re.search(r"```yaml\n(.*?)```", _doc("lmcache.md"), re.S)
    assert block, "the guide has a YAML block"
    from lmc import real_lmcache

    if not real_lmcache():
        pytest.skip("loading through LMCache needs LMCache")
    import asyncio
    import threading

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    path = tmp_path / "kvcellar.yaml"
    path.write_text(block.group(1))
    clean_env.setenv("KVCELLAR_MEMBERS", cluster.members)
    from conftest import fake_hub

    fake_hub(clean_env, str(tmp_path / "hub"), "Qwen/Qwen3-8B")  # the guide's model, as vLLM downloaded it
    config = LMCacheEngineConfig.from_file(str(path))
    config.max_local_cpu_size = 0.1  # the guide's 5 GB is an engine's, not a test's
    md = LMCacheMetadata(model_name="Qwen/Qwen3-8B", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, config.chunk_size, 2, 16),
                         chunk_size=config.chunk_size)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    backends = CreateStorageBackends(config, md, loop)
    try:
        remote = backends["RemoteBackend-kvcellar"]
        assert remote.connection is not None, "LMCache did not load the connector from the guide's YAML"
        cpu = backends["LocalCPUBackend"]
        o = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_2LTD)
        o.byte_array.cast("B")[:] = bytes(range(256)) * (o.get_size() // 256)
        k = CacheEngineKey("Qwen/Qwen3-8B", 1, 0, 0xD0C5, torch.bfloat16)
        remote.submit_put_task(k, o).result(10)
        got = remote.get_blocking(k)
        assert got is not None and bytes(got.byte_array) == bytes(o.byte_array)
        got.ref_count_down()
        o.ref_count_down()
    finally:
        for b in reversed(list(backends.values())):
            b.close()
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def test_vllm_guide_flags_load_the_connector(cluster, clean_env, tmp_path):
    """The guide's --kv-transfer-config values, as vLLM parses the flag (JSON
    into its KVTransferConfig; vLLM's whole CLI parser needs a GPU to infer
    its device, so it cannot run here), build the connector through vLLM's
    factory against the cluster the quickstart's export line names."""
    configs = re.findall(r"--kv-transfer-config '([^']*)'", _doc("vllm.md"))
    assert len(configs) >= 2, "the guide shows the quickstart and the production form"
    parsed = [json.loads(c) for c in configs]
    for p in parsed:
        assert p["kv_connector"] == "KVCellarConnector" and p["kv_connector_module_path"] == "kvcellar.vllm"
        assert p["kv_role"] == "kv_both" and p["kv_load_failure_policy"] == "recompute"
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("loading through vLLM needs vLLM")
    from kvcellar.vllm import OWN_KEYS

    for p in parsed:
        extra = p.get("kv_connector_extra_config", {})
        assert set(extra) <= set(OWN_KEYS), set(extra) - set(OWN_KEYS)
    from vllm.config import KVTransferConfig
    from vllm_engine import Engine, model_dir, vllm_config

    clean_env.setenv("KVCELLAR_MEMBERS", cluster.members)  # the export line's role
    clean_env.setenv("PYTHONHASHSEED", "0")  # the guide's line
    vc = vllm_config(model_dir(str(tmp_path)), {})
    vc.kv_transfer_config = KVTransferConfig(**parsed[0])
    e = Engine(vc)
    try:
        prompt = [(i * 29) % 900 + 1 for i in range(300)]
        e.serve([prompt])
        assert e.worker.counters()["save_units"] == 1
    finally:
        e.close()
