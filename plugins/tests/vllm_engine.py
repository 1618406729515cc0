"""A vLLM 0.33 engine loop on CPU around the REAL scheduler, connector
factory, KV cache planner and allocator, with the model's forward stood in.

What is real: ``VllmConfig`` from a model ``config.json`` written here
(``HF_HUB_OFFLINE``, small weights nothing loads, no tokenizer); ``Scheduler`` (it builds the
scheduler-side connector through ``KVConnectorFactory`` from
``kv_connector_module_path``); the KV cache config from vLLM's planner
(``get_kv_cache_configs``) and the worker's paged KV cache from its
allocator (``allocate_kv_cache``, per-layer ``[blocks, heads, tokens,
content]`` views on CPU); ``Request`` objects with vLLM's block hasher;
``update_from_output`` with a ``KVConnectorOutput`` built as the model
runner's mixin builds it (start_load_kv after the forward, wait_for_save,
get_transfer_results, load errors, worker metadata, stats).

What is stood in: the forward (a GPU attention kernel cannot run here). It
writes, into every block a step computes, bytes derived from that block's
hash and layer, so the same prefix computed anywhere has the same KV and a
loaded block can be checked byte for byte. And the process groups behind
vLLM's parallel state (every TP rank's worker lives in this one process):
``parallel_state`` sets stand-in groups that vLLM's own accessors read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
import types
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

EOS = 999
#: The connector hooks vLLM's scheduler and model runner call each step.
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats")
WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
                "get_block_ids_with_load_errors", "get_kv_connector_stats", "build_connector_worker_meta",
                "clear_connector_metadata")


def write_weights(d: str, edit: int = 0) -> None:
    """A small ``model.safetensors`` (8-byte little-endian header length,
    JSON header, data) in ``d``; ``edit`` changes that many bytes of one
    tensor, as a fine-tune of a few values would. Nothing loads these
    weights (the forward is stood in): they are what the connector's
    weights fingerprint reads."""
    big = bytearray((i * 13) % 251 for i in range(64 << 10))
    for i in range(edit):
        big[100 + i] ^= 0xA5
    tensors = {"model.norm.weight": bytes(range(256)), "model.layers.0.mlp.up_proj.weight": bytes(big)}
    header, at = {}, 0
    for name, b in tensors.items():
        header[name] = {"dtype": "F16", "shape": [len(b) // 2], "data_offsets": [at, at + len(b)]}
        at += len(b)
    raw = json.dumps(header).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def mla_model_dir(root: str) -> str:
    """A local DeepSeek-V2 (MLA) ``config.json``: a 64-wide latent plus 16 rope dims."""
    d = os.path.join(root, "tiny-deepseek")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
                "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
                "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
                "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0, "topk_method": "greedy", "scoring_func": "softmax",
                "norm_topk_prob": False,
            },
            f,
        )
    write_weights(d)
    return d


def model_dir(root: str, layers: int = 3, kv_heads: int = 2, head_dim: int = 32, name: str = "tiny-llama",
              weights: Optional[int] = 0) -> str:
    """A local model directory: a Llama ``config.json`` and small weights
    (``weights``: how many bytes of them differ from the base; None: no
    weights file)."""
    d = os.path.join(root, f"{name}-{layers}-{kv_heads}-{head_dim}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
                "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": head_dim,
            },
            f,
        )
    if weights is not None:
        write_weights(d, weights)
    return d


def vllm_config(model: str, extra: Dict[str, Any], block_size: int = 16, tp: int = 1,
                layout: str = "LBNHC", hash_algo: str = "sha256", events: bool = False,
                load_format: str = "auto", **model_kw: Any) -> VllmConfig:
    """A VllmConfig as ``vllm serve --kv-transfer-config`` builds it;
    ``model_kw`` are more ``ModelConfig`` fields (``quantization``,
    ``hf_overrides``, ``served_model_name``, as vLLM's flags of those names)."""
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=4096,
                     **model_kw)
    sc = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=4096,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo)
    cc.kv_cache_layout = layout  # resolved by the engine core before the connector is built
    kt = KVTransferConfig(kv_connector="KVCellarConnector", kv_connector_module_path="kvcellar.vllm",
                          kv_role="kv_both", kv_connector_extra_config=dict(extra))
    kw: Dict[str, Any] = {}
    if events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt,
                      device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      load_config=LoadConfig(load_format=load_format), **kw)


def kv_cache_config(vc: VllmConfig, num_blocks: int = 600) -> Any:
    """The KV cache config vLLM's planner gives one rank of this model."""
    hf = vc.model_config.hf_text_config
    tp = vc.parallel_config.tensor_parallel_size
    if vc.model_config.use_mla:  # one latent "head", the same on every TP rank
        spec = MLAAttentionSpec(block_size=vc.cache_config.block_size, num_kv_heads=1,
                                head_size=vc.model_config.get_head_size(), dtype=torch.float16)
    else:
        spec = FullAttentionSpec(block_size=vc.cache_config.block_size, num_kv_heads=hf.num_key_value_heads // tp,
                                 head_size=hf.head_dim, dtype=torch.float16)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}]
    groups = get_global_kv_cache_groups(vc, specs)
    memory = spec.page_size_bytes * hf.num_hidden_layers * num_blocks
    cfg = get_kv_cache_configs(vc, specs, [memory], groups)[0]
    cfg.kv_cache_layout = vc.cache_config.kv_cache_layout
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return cfg


@contextlib.contextmanager
def parallel_state(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1):
    """vLLM's parallel state as a worker of that rank sees it while its
    connector is built: the real ``vllm.distributed.parallel_state``
    functions, over stand-in groups (one process cannot join two ranks of
    a real process group); ``pp_size=0`` leaves the PP group unset.
    Restored after."""
    from vllm.distributed import parallel_state as ps

    saved = ps._TP, ps._PP
    ps._TP = types.SimpleNamespace(rank_in_group=tp_rank, world_size=tp_size)
    ps._PP = types.SimpleNamespace(rank_in_group=pp_rank, world_size=pp_size) if pp_size else None
    try:
        yield
    finally:
        ps._TP, ps._PP = saved


class Engine:
    """One vLLM instance: the scheduler (with its connector) and one worker
    per TP rank, each with its own paged KV cache; the workers' outputs are
    combined by vLLM's own ``KVOutputAggregator``."""

    def __init__(self, vc: VllmConfig, num_blocks: int = 600, kernel_block_size: Optional[int] = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.vc = vc
        self.block_size = vc.cache_config.block_size
        self.kc = kv_cache_config(vc, num_blocks)
        self.hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(self.hash_fn)  # the engine core does this at start
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=self.kc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(vc), block_size=self.block_size)
        self.conn = self.sched.connector
        self.mla = bool(vc.model_config.use_mla)
        self.ranks = vc.parallel_config.tensor_parallel_size
        self.workers: List[Any] = []
        self.rank_layers: List[List[torch.Tensor]] = []
        for rank in range(self.ranks):
            with parallel_state(rank, self.ranks):
                w = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                                        kv_cache_config=self.kc)
                # kernel_block_size: an attention backend whose blocks are
                # smaller than vLLM's (each vLLM block spans several).
                caches = allocate_kv_cache(self.kc, torch.device("cpu"), KVCacheLayout[self.kc.kv_cache_layout],
                                           [kernel_block_size] if kernel_block_size else None)
                w.register_kv_caches(caches)
            self.workers.append(w)
            self.rank_layers.append([caches[n] for n in self.kc.kv_cache_groups[0].layer_names])
        self.worker = self.workers[0]
        self.layers = self.rank_layers[0]
        # Time spent in the connector's hooks, per step (what a sick store
        # could add to an engine step).
        self.hook_s: List[float] = []
        self._hook_now = 0.0
        for name in SCHEDULER_HOOKS:
            self._time_hook(self.conn, name)
        for w in self.workers:
            for name in WORKER_HOOKS:
                self._time_hook(w, name)
        self.aggregator = KVOutputAggregator(self.ranks)
        self.loaded: Dict[str, int] = {}  # request -> external tokens loaded
        self.checked: Dict[str, bool] = {}  # request -> loaded blocks equal the expected bytes, every rank
        self.finished: List[str] = []
        self.steps = 0
        self._count = 0

    def _time_hook(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._hook_now += time.perf_counter() - t0

        setattr(obj, name, timed)

    def close(self) -> None:
        for c in [*self.workers, self.conn]:
            try:
                c.shutdown()
            except Exception:
                pass

    # -- requests --------------------------------------------------------------

    def request(self, tokens: Sequence[int], rid: Optional[str] = None) -> Request:
        self._count += 1
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, EOS)
        return Request(request_id=rid or f"r{self._count}", prompt_token_ids=list(tokens), sampling_params=sp,
                       pooling_params=None, mm_features=None,
                       block_hasher=get_request_block_hasher(self.block_size, self.hash_fn))

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        return req

    # -- the stood-in forward ----------------------------------------------------

    def block_bytes(self, block_hash: bytes, layer: int, like: torch.Tensor, rank: int = 0) -> torch.Tensor:
        """The KV a forward gives one block of one layer on one TP rank
        (from its hash; MLA's latent is the same on every rank), shaped like
        ``like`` (a :meth:`_block` view) whatever its kernel-block split."""
        shard = 0 if self.mla else rank
        seed = int.from_bytes(hashlib.sha256(bytes(block_hash) + bytes([layer, shard])).digest()[:8], "little")
        g = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
        k, h, n, c = like.shape
        logical = torch.randn((h, k * n, c), generator=g).to(like.dtype)  # [heads, tokens, content]
        return logical.view(h, k, n, c).permute(1, 0, 2, 3)

    def _block(self, v: torch.Tensor, block_id: int) -> torch.Tensor:
        """One vLLM block of a layer view, as [kernel blocks, heads, tokens, content]."""
        k = v.shape[0] // self.kc.num_blocks
        return v[block_id * k : (block_id + 1) * k]

    def _forward(self, out: Any) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            # schedule() has advanced num_computed_tokens past this step's tokens.
            start, end = req.num_computed_tokens - n, req.num_computed_tokens
            blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            for b in range(start // self.block_size, min(end // self.block_size, len(req.block_hashes))):
                for rank, layers in enumerate(self.rank_layers):
                    for li, v in enumerate(layers):
                        dst = self._block(v, blocks[b])
                        dst.copy_(self.block_bytes(req.block_hashes[b], li, dst, rank))

    def expected_ok(self, rid: str, tokens: int, failed: Optional[set] = None) -> bool:
        """Whether the request's first ``tokens`` tokens hold the KV their
        hashes give (blocks reported as failed loads aside)."""
        req = self.sched.requests[rid]
        blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
        for b in range(tokens // self.block_size):
            if failed and blocks[b] in failed:
                continue
            for rank, layers in enumerate(self.rank_layers):
                for li, v in enumerate(layers):
                    got = self._block(v, blocks[b])
                    if not torch.equal(got, self.block_bytes(req.block_hashes[b], li, got, rank)):
                        return False
        return True

    # -- one engine step ------------------------------------------------------------

    def step(self, before_worker: Any = None, after_worker: Any = None) -> Any:
        """schedule -> worker (bind, forward, start_load_kv, wait_for_save,
        results) -> update_from_output, as vLLM 0.33's engine core and model
        runner mixin order them. ``before_worker(out)`` runs between the
        scheduler and the worker, ``after_worker(out)`` once the workers'
        hooks returned (where vLLM may reuse a finished request's blocks)."""
        self.steps += 1
        self._hook_now = 0.0
        out = self.sched.schedule()
        if before_worker is not None:
            before_worker(out)
        self._forward(out)
        outs = []
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            # The connector's loads are all asynchronous: the mixin starts
            # them after the forward launch.
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outs.append(kvo)
        if after_worker is not None:
            hooks = self._hook_now
            after_worker(out)
            self._hook_now = hooks
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([EOS] if req.num_computed_tokens >= req.num_tokens else [])
        mros = [
            ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                              pooler_output=None, kv_connector_output=kvo)
            for kvo in outs
        ]
        mro = self.aggregator.aggregate(mros)
        kvo = mro.kv_connector_output
        for rid in kvo.finished_recving or ():
            req = self.sched.requests.get(rid)
            if req is not None and rid not in self.checked:
                n = req.num_computed_tokens
                self.loaded[rid] = n
                self.checked[rid] = self.expected_ok(rid, n, kvo.invalid_block_ids)
        outputs = self.sched.update_from_output(out, mro)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
        self.hook_s.append(self._hook_now)
        return out

    def run(self, until_s: float = 60.0, **hooks: Any) -> None:
        """Steps until no request is left (bounded in time); ``hooks`` go to :meth:`step`."""
        end = time.monotonic() + until_s
        while self.sched.has_unfinished_requests():
            if time.monotonic() > end:
                raise TimeoutError(f"requests unfinished after {until_s} s: {list(self.sched.requests)}")
            self.step(**hooks)
            time.sleep(0.001)

    def serve(self, prompts: Sequence[Sequence[int]], until_s: float = 60.0, **hooks: Any) -> List[Request]:
        reqs = [self.add(self.request(p)) for p in prompts]
        self.run(until_s, **hooks)
        return reqs
