"""Engines of the model families that need grouped layouts, for the connector's tests.

Each family is a tiny Hugging Face config (the fields the real one uses to shape its KV
cache: ``layer_types`` and ``sliding_window`` of gpt-oss and Gemma 3, ``kv_lora_rank`` and
``qk_rope_head_dim`` of DeepSeek-V3, a Llama with ``kv_cache_dtype = fp8``). The per-layer
KV cache specs are built from those fields as vLLM's attention layers build them; the
groups, their block sizes, the KV cache tensors and their views are then what vLLM itself
computes (``get_global_kv_cache_groups``, ``get_kv_cache_configs``,
``allocate_kv_cache``), with its hybrid allocator on. The engine is
:class:`vllm_engine.Engine`'s (vLLM's real scheduler, KV cache manager and connector
roles) with a forward that writes a deterministic value per (prefix, position, layer)
into each group's block of the position.
"""

import hashlib

import torch
import vllm_engine as ve
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = ve.BLOCK

FAMILIES = {
    # gpt-oss: sliding and full attention layers alternate (sinks are weights, not cache).
    "gpt-oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    # Gemma 3: five sliding layers to one full one.
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 24,
        "num_key_value_heads": 1,
        "head_dim": 32,
    },
    # DeepSeek-V3: one latent per token, kv_lora_rank + the decoupled RoPE part.
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
    },
    # A Llama serving fp8 KV (per-tensor scales from the checkpoint).
    "llama-fp8": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "kv_cache_dtype": "fp8",
    },
}


def layer_name(i):
    return f"model.layers.{i}.self_attn.attn"


def specs(family, dtype=torch.float16):
    """The per-layer KV cache specs vLLM's attention layers make for ``family``."""
    hf = FAMILIES[family]
    out = {}
    for i in range(hf["num_hidden_layers"]):
        if "kv_lora_rank" in hf:
            out[layer_name(i)] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=hf["kv_lora_rank"] + hf["qk_rope_head_dim"], dtype=dtype, cache_dtype_str="auto"
            )
        elif hf.get("layer_types", ["full_attention"] * 99)[i] == "sliding_attention":
            out[layer_name(i)] = SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=dtype, sliding_window=hf["sliding_window"]
            )
        elif hf.get("kv_cache_dtype") == "fp8":
            out[layer_name(i)] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR
            )
        else:
            out[layer_name(i)] = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=dtype)
    return out


def configure(config, family, num_blocks, layout=KVCacheLayout.LBNHC):
    """vLLM's own KV cache config for ``family`` on ``config`` (a :func:`ve.vllm_config`)."""
    hf = FAMILIES[family]
    if hf.get("kv_cache_dtype"):
        config.cache_config.cache_dtype = hf["kv_cache_dtype"]
    config.cache_config.kv_cache_layout = layout.name
    layer_specs = specs(family)
    groups = get_global_kv_cache_groups(config, [layer_specs])
    per_block = sum(s.page_size_bytes for s in layer_specs.values())
    kvcc = get_kv_cache_configs(config, [layer_specs], [per_block * num_blocks], groups)[0]
    kvcc.kv_cache_layout = layout.name
    sched = generate_scheduler_kv_cache_config([kvcc])
    config.cache_config.num_gpu_blocks = sched.num_blocks
    return kvcc, sched


def expected(tokens, pos, layer, shape, dtype):
    """The value a token's computation writes into a layer's cache at ``pos``: ``shape``
    ([heads, content]) in ``dtype``, a function of the whole prefix."""
    h = hashlib.blake2b(bytes(str(tokens[: pos + 1]), "ascii") + bytes([layer]), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h, "little") % (2**31))
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return (torch.rand(shape, generator=g) * 4 - 2).to(dtype)


class FamilyEngine(ve.Engine):
    """An engine of one family: scheduler + one worker on CPU KV tensors."""

    def __init__(self, endpoint, family, role="kv_both", num_blocks=64, tp_size=1, **extra):
        from kvd.vllm_connector import KvdConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.family = family
        extra.setdefault("model_id", f"kvd-test/tiny-{family}")
        self.config = ve.vllm_config(endpoint, role, None, **extra)
        self.config.parallel_config.tensor_parallel_size = tp_size
        self.kvcc, sched = configure(self.config, family, num_blocks)
        layout = KVCacheLayout[self.kvcc.kv_cache_layout]
        self.kv = allocate_kv_cache(self.kvcc, torch.device("cpu"), layout, [BLOCK] * len(self.kvcc.kv_cache_groups))
        self.group_of = {n: gi for gi, g in enumerate(self.kvcc.kv_cache_groups) for n in g.layer_names}
        self.worker = KvdConnector(self.config, KVConnectorRole.WORKER, self.kvcc)
        self.worker.register_kv_caches(self.kv)
        self.scheduler = Scheduler(self.config, sched, StructuredOutputManager(self.config), block_size=BLOCK)
        self.sconn = self.scheduler.connector
        self.outputs = {}
        self.computed_by_forward = {}

    def layer_names(self):
        return [layer_name(i) for i in range(FAMILIES[self.family]["num_hidden_layers"])]

    def group_ids(self, rid):
        return [list(x) for x in self.scheduler.kv_cache_manager.get_block_ids(rid)]

    def _token_view(self, block_id, layer, pos):
        """The layer's cache of position ``pos`` inside block ``block_id``: [heads, content]."""
        t = self.kv[layer_name(layer)]
        r = t.shape[0] // self.kvcc.num_blocks
        kb = t.shape[2]
        return t[block_id * r + (pos % BLOCK) // kb][:, (pos % BLOCK) % kb, :]

    def write(self, rid, toks, positions, layer):
        ids = self.group_ids(rid)[self.group_of[layer_name(layer)]]
        for pos in positions:
            b = ids[pos // BLOCK]
            assert b != 0, f"the forward computes position {pos} of layer {layer} into the null block"
            v = self._token_view(b, layer, pos)
            v.copy_(expected(toks, pos, layer, tuple(v.shape), v.dtype))

    def check_groups(self, rid, tokens, nblocks):
        """Every block vLLM keeps for ``rid`` among the first ``nblocks`` holds, in every
        layer of every group, the bytes the prompt's own computation writes. Returns, per
        group, how many positions it keeps (non-null blocks)."""
        ids = self.group_ids(rid)
        kept = [0] * len(ids)
        for layer, name in enumerate(self.layer_names()):
            gi = self.group_of[name]
            for b in range(nblocks):
                bid = ids[gi][b]
                if bid == 0:
                    continue
                if layer == self.layer_names().index(self.kvcc.kv_cache_groups[gi].layer_names[0]):
                    kept[gi] += 1
                for t in range(BLOCK):
                    pos = b * BLOCK + t
                    got = self._token_view(bid, layer, pos)
                    want = expected(tokens, pos, layer, tuple(got.shape), got.dtype)
                    assert torch.equal(got, want), f"group {gi} layer {layer} block {b} token {t} differs"
        return kept
