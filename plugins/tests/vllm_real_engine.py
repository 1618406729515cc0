"""A REAL vLLM engine on CPU with kvcellar.vllm as its KV connector.

test_vllm_engine.py and plugins/bench/vllm_engine_tps.py run this file as a
script, one process per job (vLLM spawns its engine core, so the engines are
made under ``if __name__ == "__main__":``)::

    python vllm_real_engine.py JOB.json RESULT.json

JOB.json names the engines to start in turn and what each runs; the script
writes what they did to RESULT.json at the end (docs/plugins/vllm.md,
"Versions and tests"); vLLM logs to stdout and stderr. The model is a tiny
Llama checkpoint written by :func:`write_checkpoint`: real weights, so the
output depends on the KV of the whole prompt (vLLM's dummy weights are so
small that it depends on the last token only, and a loaded prefix could be
wrong unnoticed).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

# The tiny model: Llama-shaped, 2 layers, GQA (4 query heads, 2 KV heads).
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
#: Scales of the attention weights over 1/sqrt(fan in). In a plain torch
#: forward of this model, changing a 300-token prompt's first token changed
#: the greedy output for 2 prompts of 4 at 1/sqrt(fan in) alone, for 4 of 4
#: with these; test_vllm_engine.py checks that another 512-token prefix
#: changes vLLM's output.
QK_SCALE, V_SCALE = 2.0, 4.0
#: The page geometry fields a connector's pages carry.
GEOMETRY = ("model_hash", "page_size", "dtype_tag", "layer_num", "head_num", "head_dim", "mla")


def write_checkpoint(path: str, seed: int) -> str:
    """``config.json`` and ``model.safetensors`` of the tiny Llama, weights
    drawn from ``seed`` (the same seed always gives the same bytes)."""
    import torch
    from safetensors.torch import save_file

    c = CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> "torch.Tensor":
        return (torch.randn(*shape, generator=g) * std).contiguous()

    w = {"model.embed_tokens.weight": normal(v, h, std=1.0), "model.norm.weight": torch.ones(h),
         "lm_head.weight": normal(v, h, std=1 / math.sqrt(h))}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(nh * hd, h, std=QK_SCALE / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal(nkv * hd, h, std=QK_SCALE / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal(nkv * hd, h, std=V_SCALE / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * hd, std=1 / math.sqrt(nh * hd))
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=1 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=1 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=1 / math.sqrt(inter))
    os.makedirs(path, exist_ok=True)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return path


def engine_env() -> Dict[str, str]:
    """The environment of a process running this script."""
    return dict(
        os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONHASHSEED="0",
        # vLLM's own sockets (engine core, workers) on loopback.
        VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1",
        # The worker's OpenMP threads on one core, with a connector or without.
        # vLLM's automatic binding reserves one more core when a KV connector
        # is configured; on two cores it then reserves none and runs the
        # forward on two threads against its own busy scheduler loop
        # (docs/plugins/vllm.md, "Versions and tests"): the same engine
        # with and without the connector is what is measured and tested.
        VLLM_CPU_OMP_THREADS_BIND=str(min(os.sched_getaffinity(0))),
        # LLM.collective_rpc ships a function to the worker (the connector's counters).
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )


def prompt(seed: int, n: int) -> List[int]:
    """n token ids (3..999) drawn from ``seed``."""
    import random

    r = random.Random(seed)
    return [r.randrange(3, CONFIG["vocab_size"]) for _ in range(n)]


# -- run inside the engine's worker (through LLM.collective_rpc) ---------------------


def _worker_connector(_worker: Any = None) -> Optional[Dict[str, Any]]:
    """The worker-side connector's counters and identity (None without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    c = get_kv_transfer_group()
    geometry = getattr(c, "geometry", None)
    return {
        "type": type(c).__name__,
        "active": bool(getattr(c, "active", False)),
        "counters": c.counters() if hasattr(c, "counters") else {},
        "tag": getattr(c, "tag", None),
        "identity": {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                     for k, v in (getattr(c, "identity", None) or {}).items()},
        "geometry": {f: getattr(geometry, f) for f in GEOMETRY} if geometry is not None else None,
        "unit_blocks": getattr(c, "blocks_per_unit", None),
    }


# -- the store, from outside the engine ------------------------------------------------


def unit_hashes(tokens: List[int], identity: Dict[str, Any], unit_blocks: int) -> List[bytes]:
    """vLLM's chained hash of each whole unit's last block (the hash part of
    the connector's keys, docs/plugins/vllm.md "What is stored"), computed
    as vLLM computes block hashes for a prompt of plain token ids."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(identity["hash"])
    kv_cache_utils.init_none_hash(fn)
    size = int(identity["block_size"])
    parent, blocks = None, []
    for i in range(len(tokens) // size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[i * size:(i + 1) * size])
        blocks.append(bytes(parent))
    return [blocks[(u + 1) * unit_blocks - 1] for u in range(len(blocks) // unit_blocks)]


def copy_units(members: str, tokens: List[int], src: Dict[str, Any], dst: Dict[str, Any]) -> int:
    """Stores the pages ``src`` (a connector's tag, identity and geometry)
    holds for the whole units of ``tokens`` under ``dst``'s keys and
    geometry, in place of ``dst``'s own: a direct load of one model's KV
    into another. Returns the units copied."""
    from kvcellar import Client, Geometry, Status

    assert src["tag"] != dst["tag"], "one identity: nothing to copy"
    hashes = unit_hashes(tokens, src["identity"], src["unit_blocks"])
    with Client(members, geometry=Geometry(**src["geometry"])) as a, \
            Client(members, geometry=Geometry(**dst["geometry"])) as b:
        for h in hashes:
            got = a.get_bytes(f"{h.hex()}.{src['tag']}", size_hint=1 << 20)
            assert got.ok, f"no page of the source at {h.hex()}.{src['tag']}: {got.status}"
            key = f"{h.hex()}.{dst['tag']}"
            b.delete(key)  # pages are write-once
            assert b.put(key, got.data) is Status.OK, key
    return len(hashes)


# -- the job ---------------------------------------------------------------------------


def _make_llm(e: Dict[str, Any]) -> Any:
    from vllm import LLM

    kw: Dict[str, Any] = dict(
        model=e["model"], served_model_name=e.get("name") or None, skip_tokenizer_init=True,
        enforce_eager=True, dtype=e.get("dtype", "float32"), max_model_len=e.get("max_model_len", 2048),
        gpu_memory_utilization=0.3, kv_cache_memory_bytes=e.get("kv_cache_bytes", 64 << 20), seed=0,
        enable_prefix_caching=True, max_num_seqs=e.get("max_num_seqs", 16),
    )
    if e.get("extra") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVCellarConnector", "kv_connector_module_path": "kvcellar.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": e["extra"],
        }
    return LLM(**kw)


def _shutdown(llm: Any) -> None:
    """Stops the engine core process now (and waits for it), not at exit."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


def _run(llm: Any, run: Dict[str, Any]) -> Dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if run.get("reset_prefix_cache"):
        assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
    copied = None
    if run.get("copy_units_from"):
        src = run["copy_units_from"]
        copied = copy_units(src["members"], run["prompts"][0], src, llm.collective_rpc(_worker_connector)[0])
    sp = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, detokenize=False,
                        skip_reading_prefix_cache=bool(run.get("skip_reading_prefix_cache")))
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]], sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    return {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [int(o.num_cached_tokens or 0) for o in outs],
        "secs": secs,
        "generated": sum(len(o.outputs[0].token_ids) for o in outs),
        "connector": llm.collective_rpc(_worker_connector)[0],
        "copied_units": copied,
    }


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    results = []
    for e in job["engines"]:
        t0 = time.perf_counter()
        llm = _make_llm(e)
        start_s = time.perf_counter() - t0
        try:
            runs = [_run(llm, r) for r in e["runs"]]
        finally:
            _shutdown(llm)
            del llm
            gc.collect()
        results.append({"start_s": start_s, "runs": runs})
        print(f"engine {len(results)}: started in {start_s:.1f} s", file=sys.stderr, flush=True)
    with open(result_path + ".tmp", "w") as f:
        json.dump({"engines": results}, f)
    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
