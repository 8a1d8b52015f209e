"""What one kvd block of a vLLM engine is: the geometry read from vLLM's own config (the
classic layout here; grouped layouts in :mod:`kvd.vllm_groups`), the refusals of caches
the connector cannot store faithfully, and the per-request salt.
Used by :mod:`kvd.vllm_connector` (see its doc for the block format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvd.identity import model_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_DTYPES = {
    torch.float16: ("f16", 2),
    torch.bfloat16: ("bf16", 2),
    torch.float32: ("f32", 4),
    torch.float8_e4m3fn: ("fp8_e4m3", 1),
    torch.float8_e5m2: ("fp8_e5m2", 1),
    torch.uint8: ("u8", 1),
    torch.int8: ("u8", 1),  # raw bytes: vLLM's view of a recurrent state page
}


class KvdConfigError(ValueError):
    """The engine's KV cache is one the connector cannot store faithfully."""


def partition_model(model_id: str, pp: int, stage: int, dcp: int, dcp_rank: int, interleave: int) -> str:
    """The model a layout names: the model, and where the engine's partition puts this
    layout's bytes: its pipeline stage (``#ppS/P``) and its decode-context-parallel rank
    with vLLM's interleave (``#dcpD/N,I``: which tokens of each block the rank holds).
    Blocks of two partitions never share a layout."""
    out = model_id
    if pp > 1:
        out += f"#pp{stage}/{pp}"
    if dcp > 1:
        out += f"#dcp{dcp_rank}/{dcp},{interleave}"
    return out


@dataclass(frozen=True)
class Geometry:
    """What one kvd block of this engine is, derived from vLLM's own config."""

    model_id: str
    layer_names: tuple[str, ...]
    heads: int  # KV heads of this rank
    total_heads: int  # KV heads of the model
    head_size: int
    dtype: torch.dtype
    block_size: int
    num_blocks: int
    tp_size: int
    # Pipeline parallelism: each stage's blocks hold its own layers, under its own layout
    # (``stage_layers``: layers per stage, as vLLM partitions them).
    pp_size: int = 1
    stage_layers: tuple[int, ...] = ()
    # Decode-context parallelism: a scheduler block (a key) spans ``block_size * dcp_size``
    # tokens, and rank ``r`` holds ``block_size`` of them, those vLLM deals to DCP rank
    # ``r % dcp_size`` (``dcp_interleave`` tokens at a time), in its block of the same id.
    dcp_size: int = 1
    dcp_interleave: int = 1

    grouped = False

    @property
    def key_tokens(self) -> int:
        """Tokens per key: the scheduler's block (a rank's block holds ``block_size``)."""
        return self.block_size * self.dcp_size

    @property
    def num_layouts(self) -> int:
        """Layouts the scheduler asks about: one per pipeline stage and TP rank, index
        ``stage * tp_size + rank``."""
        return self.pp_size * self.tp_size

    @property
    def dtype_name(self) -> str:
        return _DTYPES[self.dtype][0]

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * 2 * self.heads * self.block_size * self.head_size * _DTYPES[self.dtype][1]

    def layout_index(self, stage: int, rank: int) -> int:
        return stage * self.tp_size + rank

    def layout(self, index: int) -> dict[str, Any]:
        """Layout ``index`` (``stage * tp_size + rank``; the TP rank without PP)."""
        stage, rank = divmod(index, self.tp_size)
        return self.layout_for(self.tp_size, rank, stage)

    def layout_for(self, tp_size: int, rank: int, stage: int = 0) -> dict[str, Any]:
        """The layout of rank ``rank`` (of pipeline stage ``stage``) of an engine of this
        model at TP ``tp_size`` (a prefill engine of another TP size, whose shards a
        handoff reslices). A stage's layout names the stage in its model and holds the
        stage's layers."""
        pp = self.pp_size > 1
        return {
            "model": partition_model(self.model_id, self.pp_size, stage, self.dcp_size, rank % self.dcp_size, self.dcp_interleave),
            "num_layers": self.stage_layers[stage] if pp else len(self.layer_names),
            "kv_parts": 2,
            "num_kv_heads": self.total_heads,
            "head_dim": self.head_size,
            "dtype": self.dtype_name,
            "tokens_per_block": self.block_size,
            "tp_size": tp_size,
            "tp_rank": rank,
            "order": "layer_part_head_token",
        }

    def shards(self, src_tp: int, rank: int) -> Optional[list[tuple[int, int, int, int]]]:
        """Where rank ``rank``'s heads come from when an engine of TP ``src_tp`` wrote
        them (:func:`head_shards`); None under decode-context parallelism (a rank's
        tokens are not another TP size's)."""
        if self.dcp_size > 1:
            return None
        return head_shards(self.total_heads, src_tp, self.tp_size, rank)


def head_shards(heads: int, src_tp: int, tp: int, rank: int) -> Optional[list[tuple[int, int, int, int]]]:
    """Rank ``rank`` of ``tp`` holds KV heads ``rank*heads/tp ..``; an engine of TP
    ``src_tp`` wrote them in its shards: ``(shard, first head in the shard, first head
    here, heads)`` per shard that holds some, or None when either side replicates heads
    (TP above the KV heads) or does not split them evenly."""
    if src_tp <= 0 or tp <= 0 or heads <= 0 or heads % src_tp or heads % tp or src_tp > heads or tp > heads:
        return None
    hs, hd = heads // src_tp, heads // tp
    a, b = rank * hd, (rank + 1) * hd
    out = []
    for s in range(src_tp):
        lo, hi = max(a, s * hs), min(b, (s + 1) * hs)
        if lo < hi:
            out.append((s, lo - s * hs, lo - a, hi - lo))
    return out


def _classic(groups: list, vllm_config: "VllmConfig") -> bool:
    """Whether the cache is one dense full-attention group: kvd's classic layout, which
    moves K and V per head (and reslices heads between TP sizes where the engine can)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    if len(groups) != 1 or getattr(vllm_config, "speculative_config", None) is not None:
        # Speculative decoding: a draft model's layers may share the groups (vLLM merges
        # specs that differ only in is_draft), so the layout names the draft model too.
        return False
    spec = groups[0].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    specs = list(inner.values()) if inner else [spec]
    first = specs[0]
    return all(
        type(s) is FullAttentionSpec
        and s.sliding_window is None
        and s.attention_chunk_size is None
        and not s.non_causal
        and s.kv_quant_mode == KVQuantMode.NONE
        and s.head_size_v == s.head_size
        and s.page_size_padded is None
        and s.num_head_slots is None
        and s.state_content_bytes is None
        and s.tokens_per_state == 1
        and s.dtype in _DTYPES
        and s.dtype != torch.uint8
        and (s.num_kv_heads, s.head_size, s.dtype, s.block_size) == (first.num_kv_heads, first.head_size, first.dtype, first.block_size)
        for s in specs
    )


def geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
    """The block geometry: the classic :class:`Geometry` for one dense full-attention
    group, else a :class:`kvd.vllm_groups.GroupedGeometry` (SPEC §3.1 "Grouped layouts").

    Raises :class:`KvdConfigError`, naming the field, for caches kvd cannot describe.
    """
    par = vllm_config.parallel_config
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    dcp, interleave = dcp_of(vllm_config)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    mc = vllm_config.model_config
    model_id = str(extra.get("model_id") or model_identity(mc.model, getattr(mc, "revision", None)))
    groups = list(kv_cache_config.kv_cache_groups)
    if not _classic(groups, vllm_config):
        from kvd.vllm_groups import grouped_geometry

        return grouped_geometry(vllm_config, kv_cache_config, model_id)
    if dcp > 1 and groups[0].kv_cache_spec.block_size % interleave:
        raise KvdConfigError(f"kvd connector: cp_kv_cache_interleave_size {interleave} does not divide the block size {groups[0].kv_cache_spec.block_size}")
    stage_layers: tuple[int, ...] = ()
    if pp > 1:
        from vllm.distributed.utils import get_pp_indices

        n = int(mc.hf_config.num_hidden_layers)
        stage_layers = tuple(e - a for a, e in (get_pp_indices(n, s, pp) for s in range(pp)))
    spec = groups[0].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    first = list(inner.values())[0] if inner else spec
    return Geometry(
        model_id=model_id,
        layer_names=tuple(groups[0].layer_names),
        heads=first.num_kv_heads,
        total_heads=vllm_config.model_config.get_total_num_kv_heads(),
        head_size=first.head_size,
        dtype=first.dtype,
        block_size=first.block_size,
        num_blocks=kv_cache_config.num_blocks,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        pp_size=pp,
        stage_layers=stage_layers,
        dcp_size=dcp,
        dcp_interleave=interleave,
    )


def dcp_of(vllm_config: "VllmConfig") -> tuple[int, int]:
    """(decode-context-parallel size, interleave): how vLLM deals each block's tokens to
    ranks (token ``o`` of a scheduler block to DCP rank ``o // interleave % size``).
    Refuses prefill context parallelism, which shards prompts another way."""
    par = vllm_config.parallel_config
    if int(getattr(par, "prefill_context_parallel_size", 1) or 1) > 1:
        raise KvdConfigError("kvd connector: prefill context parallelism is not supported (prompts sharded across ranks while they are computed)")
    dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    return dcp, int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1) if dcp > 1 else 1


def request_salt(request: "Request") -> bytes:
    """SPEC §3.2's salt: blocks of one LoRA adapter or cache salt never meet another's."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    return "\n".join(parts).encode()


def request_keys(request: "Request", block_size: int) -> Optional[list[bytes]]:
    """The kvd keys of a request's full prompt blocks (SPEC §3.2 chunk hashes salted by
    :func:`request_salt`), or None when its KV is not a function of what kvd can name
    (prompt embeddings).

    Multimodal prompts are keyed as vLLM's own prefix cache keys them: a block depends on
    the items (their ``identifier``: the content hash, LoRA-prefixed where it applies) and
    where they sit, besides its tokens (the placeholder tokens of two images are equal).
    The chain restarts at the block where an item starts, its root salted with the
    request's salt, the key of the block before it, and every item starting in that block
    (identifier, offset, length): blocks before the first item are shared with the same
    text prompt, and every block from an item on depends on it and on all earlier ones.
    """
    import kvd

    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    tokens = list(request.prompt_token_ids)
    salt = request_salt(request)
    items = sorted(getattr(request, "mm_features", None) or [], key=lambda f: f.mm_position.offset)
    if not items:
        return kvd.chunk_hashes(tokens, block_size, salt)
    if any(not getattr(f, "identifier", None) for f in items):
        return None
    full = len(tokens) // block_size
    starts: dict[int, list] = {}
    for f in items:
        starts.setdefault(f.mm_position.offset // block_size, []).append(f)
    keys: list[bytes] = []
    bounds = sorted(b for b in starts if b < full) + [full]
    keys += kvd.chunk_hashes(tokens[: bounds[0] * block_size], block_size, salt)
    for b, end in zip(bounds, bounds[1:]):
        seg_salt = salt + b"\nmm.after=" + (keys[-1] if keys else b"root")
        for f in starts[b]:
            seg_salt += f"\nmm={f.identifier}@{f.mm_position.offset}+{f.mm_position.length}".encode()
        keys += kvd.chunk_hashes(tokens[b * block_size : end * block_size], block_size, seg_salt)
    return keys

