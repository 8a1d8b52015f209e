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
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec
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
    # Qwen3-Next / Qwen3.5: three Gated DeltaNet layers to one full-attention layer; the
    # recurrent state (conv state, then the delta-rule state) per layer.
    "qwen3-next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "mamba_type": "GDN_ATTN",
    },
    # Jamba / Falcon-H1: Mamba2 layers beside attention ones (one in two here).
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "full_attention"] * 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_n_groups": 2,
        "mamba_n_heads": 2,
        "mamba_head_dim": 8,
        "mamba_type": "MAMBA2",
    },
    # A Llama with a speculative draft layer (EAGLE/MTP): its KV in the same group as the
    # target's (vLLM merges specs that differ only in ``is_draft``).
    "llama-draft": {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "draft_layers": [2],
        "num_key_value_heads": 2,
        "head_dim": 16,
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


# DeepSeek-V4: every layer a sliding-window latent (its own 64-token blocks here 16), a
# compressed layer (ratio 4 or, scaled from 128, 16) its compressed latent in blocks of
# the cache's block size (one state per ``ratio`` tokens) and its compressor's running
# state, a sliding latent of 4- or 8-token blocks over ``coff * ratio`` tokens; a ratio-4
# layer its indexer's compressed keys too. Its KV cache groups have different block sizes:
# vLLM's scheduler block is their least common multiple (64 tokens here). Separate from
# FAMILIES, whose checks are written for one 16-token block per position.
WIDE = {
    "deepseek-v4": {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 3,
        "compress_ratios": [4, 16, 1],
        "head_dim": 256,
        "swa_head_dim": 64,
        "index_head_dim": 128,
        "sliding_window": 32,
    },
}


def layer_name(i):
    return f"model.layers.{i}.self_attn.attn"


def wide_specs(family, dtype=torch.bfloat16):
    """The per-layer KV cache specs DeepSeek-V4's attention modules make (its
    ``get_kv_cache_spec``s: the compressed latent, the indexer's keys, the compressor's
    state and the sliding-window cache), with the tiny dims of ``WIDE[family]`` and its
    ``alignment`` (pages here are already whole multiples of it)."""
    hf = WIDE[family]
    out = {}
    for i, ratio in enumerate(hf["compress_ratios"]):
        p = f"model.layers.{i}.self_attn"
        out[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=hf["swa_head_dim"], dtype=dtype,
            sliding_window=hf["sliding_window"], cache_dtype_str="auto", alignment=512, model_version="deepseek_v4",
        )
        if ratio <= 1:
            continue
        out[f"{p}.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=hf["head_dim"], dtype=dtype, tokens_per_state=ratio,
            cache_dtype_str="auto", alignment=512, model_version="deepseek_v4",
        )
        coff = 1 + (ratio == 4)
        out[f"{p}.compressor.state"] = SlidingWindowMLASpec(
            block_size=4 if ratio == 4 else 8, num_kv_heads=1, max_tp_shards=1, head_size=coff * hf["head_dim"] // 4, dtype=torch.float32,
            sliding_window=coff * ratio, alignment=512,
        )
        if ratio == 4:
            out[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=hf["index_head_dim"], dtype=dtype, tokens_per_state=ratio, alignment=512,
            )
    return out


def recurrent(family):
    return "mamba_type" in FAMILIES.get(family, {})


def state_spec(hf, dtype, tp=1):
    """A recurrent layer's state spec on one of ``tp`` ranks as vLLM's Mamba/GDN layers
    make it (their shape calculators: conv state, then the SSM or delta-rule state), in
    'align' mode, its page padded to an attention page as vLLM's hybrid block-size
    alignment does."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    if hf["mamba_type"] == "GDN_ATTN":
        h = hf["linear_num_value_heads"]
        shapes = calc.gated_delta_net_state_shape(tp, h, h, hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"])
    else:
        shapes = calc.mamba2_state_shape(
            tp, hf["mamba_n_heads"] * hf["mamba_head_dim"], hf["mamba_n_groups"], hf["mamba_n_heads"], hf["mamba_head_dim"], hf["mamba_d_state"], hf["mamba_d_conv"]
        )
    attn_page = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"] // tp, head_size=hf["head_dim"], dtype=dtype).page_size_bytes
    return MambaSpec(
        block_size=BLOCK,
        shapes=shapes,
        dtypes=(dtype, torch.float32),
        page_size_padded=attn_page,
        mamba_type=MambaAttentionBackendEnum[hf["mamba_type"]],
        mamba_cache_mode="align",
    )


def specs(family, dtype=torch.float16, tp=1):
    """The per-layer KV cache specs vLLM's attention layers make for ``family`` on one of
    ``tp`` tensor-parallel ranks (KV heads split between them)."""
    if family in WIDE:
        return wide_specs(family, torch.bfloat16)
    hf = dict(FAMILIES[family])
    if "num_key_value_heads" in hf:
        hf["num_key_value_heads"] //= tp
    out = {}
    for i in range(hf["num_hidden_layers"]):
        kind = hf.get("layer_types", ["full_attention"] * 99)[i]
        if kind in ("linear_attention", "mamba"):
            out[layer_name(i)] = state_spec(FAMILIES[family], dtype, tp)
        elif "kv_lora_rank" in hf:
            out[layer_name(i)] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=hf["kv_lora_rank"] + hf["qk_rope_head_dim"], dtype=dtype, cache_dtype_str="auto"
            )
        elif kind == "sliding_attention":
            out[layer_name(i)] = SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=dtype, sliding_window=hf["sliding_window"]
            )
        elif hf.get("kv_cache_dtype") == "fp8":
            out[layer_name(i)] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR
            )
        else:
            out[layer_name(i)] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=hf["num_key_value_heads"], head_size=hf["head_dim"], dtype=dtype, is_draft=i in hf.get("draft_layers", ())
            )
    return out


def configure(config, family, num_blocks, layout=KVCacheLayout.LBNHC, tp=1):
    """vLLM's own KV cache config for ``family`` on ``config`` (a :func:`ve.vllm_config`)."""
    hf = FAMILIES.get(family) or WIDE[family]
    if hf.get("kv_cache_dtype"):
        config.cache_config.cache_dtype = hf["kv_cache_dtype"]
    if recurrent(family):
        # Recurrent state at block boundaries: vLLM's 'align' mode, which needs its
        # prefix caching on.
        config.cache_config.enable_prefix_caching = True
        config.cache_config.mamba_cache_mode = "align"
        config.cache_config.mamba_block_size = BLOCK
    config.cache_config.kv_cache_layout = layout.name
    layer_specs = specs(family, tp=tp)
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


def state_parts(hf):
    """A recurrent layer's whole state as vLLM shards it between TP ranks: the conv
    state's sub-projections (their channels: GDN's Q, K, V; Mamba2's x, B, C), the
    temporal state's shape (split on its heads), the conv rows."""
    if hf["mamba_type"] == "GDN_ATTN":
        h, k, v = hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        return (h * k, h * k, h * v), (h, v, k), hf["linear_conv_kernel_dim"] - 1
    g = hf["mamba_n_groups"] * hf["mamba_d_state"]
    return (hf["mamba_n_heads"] * hf["mamba_head_dim"], g, g), (hf["mamba_n_heads"], hf["mamba_head_dim"], hf["mamba_d_state"]), hf["mamba_d_conv"] - 1


def expected_state(tokens, layer, hf, rank=0, tp=1, dtype=torch.float16):
    """Rank ``rank``'s (of ``tp``) recurrent state page after ``tokens`` in ``layer``, as
    bytes: the model's whole state, a function of exactly those tokens, cut as vLLM shards
    it (each sub-projection's slice; the temporal state's heads), the conv state in vLLM's
    default layout ``[rows, channels]`` (SD), then the temporal state (float32)."""
    segments, temporal, rows = state_parts(hf)
    h = hashlib.blake2b(b"state" + bytes(str(list(tokens)), "ascii") + bytes([layer]), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h, "little") % (2**31))
    conv = [(torch.rand((n, rows), generator=g) * 4 - 2).to(dtype) for n in segments]

    def cut(j, c):
        groups = hf.get("mamba_n_groups", tp)
        if j > 0 and hf["mamba_type"] == "MAMBA2" and groups % tp:
            # vLLM extends the groups to the ranks: each holds its heads' group whole.
            ds, gi = hf["mamba_d_state"], rank * groups // tp
            return c[gi * ds : (gi + 1) * ds]
        return c[rank * c.shape[0] // tp : (rank + 1) * c.shape[0] // tp]

    conv = torch.cat([cut(j, c) for j, c in enumerate(conv)])
    temp = torch.rand(temporal, generator=g) * 4 - 2
    temp = temp[rank * temporal[0] // tp : (rank + 1) * temporal[0] // tp]
    return torch.cat([conv.t().contiguous().view(-1).view(torch.int8), temp.contiguous().view(-1).view(torch.int8)])


class FamilyEngine(ve.Engine):
    """An engine of one family: scheduler + one worker on CPU KV tensors."""

    def __init__(self, endpoint, family, role="kv_both", num_blocks=64, tp_size=1, model=None, ranks=False, dcp=1, interleave=1, **extra):
        """``ranks``: run a worker for every one of ``tp_size`` ranks, each over its KV
        heads (else rank 0's worker only, over all of them). ``dcp``, ``interleave``:
        vLLM's decode-context parallelism (with ``ranks``), which deals each scheduler
        block's ``BLOCK * dcp`` tokens to the ranks (:func:`vllm_engine.dcp_place`)."""
        from kvd.vllm_connector import KvdConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.family = family
        extra.setdefault("model_id", f"kvd-test/tiny-{family}")
        self.config = ve.vllm_config(endpoint, role, model, **extra)
        self.config.parallel_config.tensor_parallel_size = tp_size
        self.config.parallel_config.decode_context_parallel_size = self.dcp = dcp
        self.config.parallel_config.cp_kv_cache_interleave_size = self.interleave = interleave
        self.split = tp_size if ranks and "num_key_value_heads" in FAMILIES.get(family, {}) else 1
        self.kvcc, sched = configure(self.config, family, num_blocks, tp=self.split)
        layout = KVCacheLayout[self.kvcc.kv_cache_layout]
        self.group_of = {n: gi for gi, g in enumerate(self.kvcc.kv_cache_groups) for n in g.layer_names}
        # Each group's block and tokens per stored state (DeepSeek-V4's differ; BLOCK and 1 elsewhere).
        self.vblock = [g.kv_cache_spec.block_size for g in self.kvcc.kv_cache_groups]
        self.tps = [int(getattr(g.kv_cache_spec, "tokens_per_state", 1)) if not isinstance(g.kv_cache_spec, MambaSpec) else 1 for g in self.kvcc.kv_cache_groups]
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        self.sched_block, self.hash_block = resolve_kv_cache_block_sizes(self.kvcc, self.config) if family in WIDE else (BLOCK * dcp, BLOCK)
        self.workers, self.kvs = [], []
        for r in range(tp_size if ranks else 1):
            kv = allocate_kv_cache(self.kvcc, torch.device("cpu"), layout, self.vblock)
            with ve.rank(r):
                w = KvdConnector(self.config, KVConnectorRole.WORKER, self.kvcc)
                w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.scheduler = Scheduler(self.config, sched, StructuredOutputManager(self.config), block_size=self.sched_block)
        self.sconn = self.scheduler.connector
        self.outputs = {}
        self.computed_by_forward = {}

    def _place(self, pos, gi=None):
        """Where token ``pos`` lies in group ``gi``: (the index of its block, [(rank, state
        index in the rank's block)] for every rank holding it), or None where the token
        completes no stored state (a compressed latent stores one per ``tokens_per_state``
        tokens, at the last)."""
        if getattr(self, "dcp", 1) == 1:
            vb, tps = (BLOCK, 1) if gi is None else (self.vblock[gi], self.tps[gi])
            if (pos + 1) % tps:
                return None
            return pos // vb, [(r, (pos % vb) // tps) for r in range(len(self.kvs))]
        b, d, off = ve.dcp_place(pos, self.dcp, self.interleave)
        return b, [(r, off) for r in range(len(self.kvs)) if r % self.dcp == d]

    def fill_random(self, seed):
        """Every KV cache tensor of every rank with values drawn from ``seed`` (bytes for
        the byte-typed ones: fp8 and recurrent state pages)."""
        g = torch.Generator().manual_seed(seed)
        for kv in self.kvs:
            for t in kv.values():
                if t.dtype in (torch.int8, torch.uint8):
                    t.copy_(torch.randint(-100, 100, t.shape, generator=g, dtype=torch.int8).view(t.dtype))
                else:
                    t.copy_((torch.rand(t.shape, generator=g) * 4 - 2).to(t.dtype))

    def add(self, rid, prompt, max_tokens=2, kv_transfer_params=None, **kw):
        """As vLLM's engine core adds a request when a connector is configured: with its
        block hasher (prefix caching, and Mamba's align mode, need the block hashes), at
        vLLM's hash block size."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        kw.setdefault("block_hasher", get_request_block_hasher(getattr(self, "hash_block", BLOCK), fn, self.config.num_hash_lookahead_tokens))
        return super().add(rid, prompt, max_tokens, kv_transfer_params, **kw)

    def _name(self, layer):
        names = self.__dict__.get("_names")
        if names is None:
            names = self._names = self.layer_names()
        return names[layer]

    def layer_names(self):
        if self.family in WIDE:
            return list(wide_specs(self.family))
        return [layer_name(i) for i in range(FAMILIES[self.family]["num_hidden_layers"])]

    def group_ids(self, rid):
        return [list(x) for x in self.scheduler.kv_cache_manager.get_block_ids(rid)]

    def _token_view(self, block_id, layer, off, rank=0):
        """The layer's cache at offset ``off`` of block ``block_id``: [heads, content]."""
        t = self.kvs[rank][self._name(layer)]
        r = t.shape[0] // self.kvcc.num_blocks
        kb = t.shape[2]
        return t[block_id * r + off // kb][:, off % kb, :]

    def is_state(self, layer):
        return isinstance(self.kvcc.kv_cache_groups[self.group_of[self._name(layer)]].kv_cache_spec, MambaSpec)

    def state_view(self, block_id, layer, rank=0):
        return self.kvs[rank][self._name(layer)][block_id].view(-1)

    def state_ranks(self):
        """(rank, of how many) for every worker's recurrent state: each rank its share
        when the workers split the model's heads, else one worker with the whole state."""
        return [(r, self.split) for r in range(len(self.kvs))] if self.split > 1 else [(0, 1)]

    def write(self, rid, toks, positions, layer):
        ids = self.group_ids(rid)[self.group_of[self._name(layer)]]
        if self.is_state(layer):
            # A recurrent layer: it reads the state after the tokens before the step
            # (vLLM's align mode: from the block of the last computed token), and leaves
            # the state after the step's last token in that token's block.
            start, end = positions.start, positions.stop
            hf = FAMILIES[self.family]
            for r, tp in self.state_ranks():
                if start > 0:
                    got = self.state_view(ids[(start - 1) // BLOCK], layer, r)
                    assert torch.equal(got, expected_state(toks[:start], layer, hf, r, tp)), (
                        f"layer {layer} of rank {r} would continue from a wrong recurrent state at {start} tokens"
                    )
                b = ids[(end - 1) // BLOCK]
                assert b != 0, f"no state block for {end} tokens of layer {layer}"
                self.state_view(b, layer, r).copy_(expected_state(toks[:end], layer, hf, r, tp))
            self.states_read = getattr(self, "states_read", 0) + (start > 0)
            return
        gi = self.group_of[self._name(layer)]
        if positions.start > 0:
            self._read_window(ids, gi, layer, toks, positions.start)
        for pos in positions:
            at = self._place(pos, gi)
            if at is None:
                continue  # (no stored state ends at this token)
            bi, where = at
            b = ids[bi]
            assert b != 0, f"the forward computes position {pos} of layer {layer} into the null block"
            for r, off in where:
                v = self._token_view(b, layer, off, r)
                v.copy_(self._want(toks, pos, layer, v, r))

    def _read_window(self, ids, gi, layer, toks, start):
        """What a sliding layer's attention reads before computing token ``start``: the
        states of the window's tokens before it, each the prompt's own (a hit or a handoff
        that brought a wrong or no block of the window fails here)."""
        w = getattr(self.kvcc.kv_cache_groups[gi].kv_cache_spec, "sliding_window", None)
        if not w:
            return
        for pos in range(max(0, start - w + 1), start):
            at = self._place(pos, gi)
            if at is None:
                continue
            bi, where = at
            b = ids[bi] if bi < len(ids) else 0
            assert b != 0, f"layer {layer} reads token {pos} of its window from the null block"
            for r, off in where:
                got = self._token_view(b, layer, off, r)
                assert torch.equal(got, self._want(toks, pos, layer, got, r)), f"layer {layer} reads token {pos} of its window: it differs"
        self.windows_read = getattr(self, "windows_read", 0) + 1

    def _want(self, toks, pos, layer, v, rank):
        """Rank ``rank``'s heads of the value the whole model's layer writes at ``pos``."""
        h = v.shape[0]
        return expected(toks, pos, layer, (h * self.split,) + tuple(v.shape[1:]), v.dtype)[rank * h : (rank + 1) * h] if self.split > 1 else expected(toks, pos, layer, tuple(v.shape), v.dtype)

    def check_state(self, rid, tokens, nblocks):
        """The state groups' block at the hit's boundary holds the state after exactly
        ``nblocks`` blocks of ``tokens``, in every recurrent layer."""
        for layer in range(len(self.layer_names())):
            if not self.is_state(layer):
                continue
            ids = self.group_ids(rid)[self.group_of[self._name(layer)]]
            for r, tp in self.state_ranks():
                got = self.state_view(ids[nblocks - 1], layer, r)
                want = expected_state(tokens[: nblocks * BLOCK], layer, FAMILIES[self.family], r, tp)
                assert torch.equal(got, want), f"state of layer {layer} of rank {r} at {nblocks} blocks differs"

    def check_groups(self, rid, tokens, nblocks):
        """Every block vLLM keeps for ``rid`` among the first ``nblocks`` holds, in every
        layer of every group, the bytes the prompt's own computation writes. Returns, per
        group, how many of its blocks it keeps (non-null; a position where a group's blocks
        are the scheduler's, as in every family but DeepSeek-V4's)."""
        ids = self.group_ids(rid)
        kept = [0] * len(ids)
        for layer, name in enumerate(self.layer_names()):
            gi = self.group_of[name]
            if self.is_state(layer):
                continue  # (check_state)
            span = self.vblock[gi] * getattr(self, "dcp", 1)
            for b in range(nblocks * self.sched_block // span):
                bid = ids[gi][b] if b < len(ids[gi]) else 0
                if bid == 0:
                    continue
                if layer == self.layer_names().index(self.kvcc.kv_cache_groups[gi].layer_names[0]):
                    kept[gi] += 1
                for pos in range(b * span, (b + 1) * span):
                    at = self._place(pos, gi)
                    for r, off in at[1] if at is not None else ():
                        got = self._token_view(bid, layer, off, r)
                        assert torch.equal(got, self._want(tokens, pos, layer, got, r)), f"rank {r} group {gi} layer {layer} block {b} token {pos - b * span} differs"
        return kept


def configure_pp(config, family, num_blocks, pp, layout=KVCacheLayout.LBNHC):
    """vLLM's own KV cache configs for ``family`` split into ``pp`` pipeline stages (its
    partition, ``get_pp_indices``): per stage the model's groups projected onto the
    stage's layers (``get_kv_cache_configs``), the scheduler's config (stage 0's, as
    vLLM's engine core makes it) and the model's groups."""
    from vllm.distributed.utils import get_pp_indices

    hf = FAMILIES[family]
    if recurrent(family):
        config.cache_config.enable_prefix_caching = True
        config.cache_config.mamba_cache_mode = "align"
        config.cache_config.mamba_block_size = BLOCK
    config.cache_config.kv_cache_layout = layout.name
    every = specs(family)
    stages = []
    for s in range(pp):
        a, e = get_pp_indices(hf["num_hidden_layers"], s, pp)
        stages.append({layer_name(i): every[layer_name(i)] for i in range(a, e)})
    groups = get_global_kv_cache_groups(config, stages)
    mem = [sum(x.page_size_bytes for x in st.values()) * num_blocks for st in stages]
    kvccs = get_kv_cache_configs(config, stages, mem, groups)
    for k in kvccs:
        k.kv_cache_layout = layout.name
    sched = generate_scheduler_kv_cache_config(kvccs)
    config.cache_config.num_gpu_blocks = sched.num_blocks
    return kvccs, sched, groups


class PPFamilyEngine(FamilyEngine):
    """An engine of one family in ``pp`` pipeline stages (TP 1): one worker per stage over
    its stage's layers of every group, the scheduler on stage 0's config, and the workers'
    handshake metadata handed to the scheduler as vLLM's engine core hands it
    (``handshake=False``: never, a scheduler that does not know the stages' layouts)."""

    def __init__(self, endpoint, family, pp=2, role="kv_both", num_blocks=64, handshake=True, **extra):
        from kvd.vllm_connector import KvdConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig
        from vllm.v1.structured_output import StructuredOutputManager

        self.family = family
        extra.setdefault("model_id", f"kvd-test/tiny-{family}")
        self.config = ve.vllm_config(endpoint, role, None, **extra)
        self.config.parallel_config.pipeline_parallel_size = pp
        self.split = 1
        self.stage_kvccs, sched, groups = configure_pp(self.config, family, num_blocks, pp)
        # The model's groups (every stage's layers): what the checks walk.
        self.kvcc = KVCacheConfig(num_blocks=sched.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.group_of = {n: gi for gi, g in enumerate(groups) for n in g.layer_names}
        self.vblock, self.tps = [BLOCK] * len(groups), [1] * len(groups)
        self.sched_block, self.hash_block = BLOCK, BLOCK
        self.workers, self.kvs = [], []
        for s, kvcc in enumerate(self.stage_kvccs):
            kv = allocate_kv_cache(kvcc, torch.device("cpu"), KVCacheLayout[kvcc.kv_cache_layout], [BLOCK] * len(kvcc.kv_cache_groups))
            with ve.stage(s):
                w = KvdConnector(self.config, KVConnectorRole.WORKER, kvcc)
                w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.scheduler = Scheduler(self.config, sched, StructuredOutputManager(self.config), block_size=BLOCK)
        self.sconn = self.scheduler.connector
        if handshake:
            self.sconn.set_xfer_handshake_metadata_pp_aware({(s, 0): w.get_handshake_metadata() for s, w in enumerate(self.workers)})
        self.outputs = {}
        self.computed_by_forward = {}

    def _tensor(self, layer):
        return next(kv for kv in self.kvs if layer_name(layer) in kv)[layer_name(layer)]

    def _token_view(self, block_id, layer, off, rank=0):
        t = self._tensor(layer)
        r = t.shape[0] // self.kvcc.num_blocks
        kb = t.shape[2]
        return t[block_id * r + off // kb][:, off % kb, :]

    def state_view(self, block_id, layer, rank=0):
        return self._tensor(layer)[block_id].view(-1)
