"""What one kvd block of a vLLM engine is: the geometry read from vLLM's own config, the
refusals of caches the connector cannot store faithfully, and the per-request salt.
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
}


class KvdConfigError(ValueError):
    """The engine's KV cache is one the connector cannot store faithfully."""


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

    @property
    def dtype_name(self) -> str:
        return _DTYPES[self.dtype][0]

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * 2 * self.heads * self.block_size * self.head_size * _DTYPES[self.dtype][1]

    def layout(self, rank: int) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "num_layers": len(self.layer_names),
            "kv_parts": 2,
            "num_kv_heads": self.total_heads,
            "head_dim": self.head_size,
            "dtype": self.dtype_name,
            "tokens_per_block": self.block_size,
            "tp_size": self.tp_size,
            "tp_rank": rank,
            "order": "layer_part_head_token",
        }


def geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[Optional[Geometry], Optional[str]]:
    """The block geometry, or why this engine's cache is served without kvd.

    Raises :class:`KvdConfigError` for caches the connector must not pretend to handle.
    Returns ``(None, reason)`` for hybrid configurations (no hits reported, nothing saved).
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        return None, f"{len(groups)} KV cache groups ({kinds}): a hybrid model; kvd restores only one full-attention group"
    spec = groups[0].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    specs = list(inner.values()) if inner else [spec]
    first = specs[0]
    for s in specs:
        if isinstance(s, MLAAttentionSpec):
            raise KvdConfigError(
                f"kvd connector: MLA (latent) KV caches are not supported ({type(s).__name__}); "
                "use a model with separate K and V, or run without the kvd connector"
            )
        if not isinstance(s, AttentionSpec) or not isinstance(s, FullAttentionSpec):
            raise KvdConfigError(f"kvd connector: KV cache spec {type(s).__name__} is not supported (full attention only)")
        if s != first and (s.num_kv_heads, s.head_size, s.dtype) != (first.num_kv_heads, first.head_size, first.dtype):
            raise KvdConfigError("kvd connector: layers with different KV shapes are not supported")
        if s.kv_quant_mode != KVQuantMode.NONE:
            raise KvdConfigError(f"kvd connector: quantized KV caches ({s.kv_quant_mode.name}) are not supported")
        if s.head_size_v != s.head_size:
            raise KvdConfigError(f"kvd connector: K and V of different sizes ({s.head_size} vs {s.head_size_v}) are not supported")
        if s.page_size_padded is not None or s.num_head_slots is not None or s.state_content_bytes is not None:
            raise KvdConfigError("kvd connector: padded or packed KV pages are not supported")
        if s.tokens_per_state != 1:
            raise KvdConfigError("kvd connector: compressed KV states (tokens_per_state != 1) are not supported")
        if s.dtype not in _DTYPES:
            raise KvdConfigError(f"kvd connector: KV dtype {s.dtype} has no kvd name (supported: {sorted(v[0] for v in _DTYPES.values())})")
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) > 1:
        raise KvdConfigError("kvd connector: pipeline parallelism is not supported (each stage holds other layers; kvd's blocks hold all of them)")
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        raise KvdConfigError("kvd connector: decode context parallelism is not supported (blocks are sharded by token across ranks)")
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    mc = vllm_config.model_config
    model_id = str(extra.get("model_id") or model_identity(mc.model, getattr(mc, "revision", None)))
    tp = vllm_config.parallel_config.tensor_parallel_size
    total = vllm_config.model_config.get_total_num_kv_heads()
    return (
        Geometry(
            model_id=model_id,
            layer_names=tuple(groups[0].layer_names),
            heads=first.num_kv_heads,
            total_heads=total,
            head_size=first.head_size,
            dtype=first.dtype,
            block_size=first.block_size,
            num_blocks=kv_cache_config.num_blocks,
            tp_size=tp,
        ),
        None,
    )


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
