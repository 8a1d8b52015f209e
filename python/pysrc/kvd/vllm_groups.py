"""Grouped kvd layouts for vLLM KV caches that are not one dense full-attention group
(SPEC §3.1 "Grouped layouts"): latent MLA caches, sliding-window and chunked-local layers
beside full ones, quantized KV (fp8 and the packed modes), K and V of different sizes,
padded pages. Used by :mod:`kvd.vllm_connector`; the dense case keeps its classic layout
(:class:`kvd.vllm_layout.Geometry`).

The layout is data taken from the engine
----------------------------------------
Each vLLM KV cache group becomes one kvd group, described from vLLM's own spec of it: the
attention kind (``full``, ``sliding`` with its window, ``chunked`` with its chunk, ``mla``),
the dtype of the cache tensor, the piece one layer keeps per block as vLLM's logical
``[heads, states, content]`` view of it (``num_head_slots``/``state_content_bytes`` where a
backend packs, so a packed page is described as it is), and the quantization (the
``kv_quant_mode`` by name, and for per-tensor fp8 where its scales come from: the
checkpoint's, which the model identity covers, or 1.0). The ``arrangement`` names what
decides where a value lies and is not in the shape: the vLLM version, the device and the
KV cache layout. Two engines that differ in any of these never share a block: a vLLM
upgrade that changes the arrangement is a miss, never a wrong hit.

A block of a grouped layout is, for one position of ``block_size`` tokens, every group's
piece of every layer (one object per position, not one per group): a position's groups
are stored and committed together, so no reader sees some of them without the others, and
a hit is the longest prefix of positions the daemon holds whole. Blocks are keyed by the
chunk hashes of the tokens (SPEC §3.2), which chain every earlier token: a piece can only
be the one of exactly that prefix, so a missing position shortens a hit and can never
misalign one. A sliding-window group stores every position's piece, because a later
prompt may stop anywhere; a load copies only the pieces into the blocks vLLM keeps for it
(vLLM hands the null block, id 0, for positions outside the window, and those are
skipped), so a handoff moves the whole prefix but the engine reads only its window.

MLA: the latent is the same on every TP rank, so a model whose groups are all MLA keeps
one copy per node (``tp_size = 1`` in the layout; only rank 0 saves it, every rank loads
it) and hands off between prefill and decode engines of different TP sizes. Attention
groups whose heads are KV heads (full, sliding, chunked; not a backend's packed head
slots) hand off between TP sizes by reslicing: each decode rank copies its heads out of
the prefill shards that hold them (:meth:`GroupedGeometry.shards`,
:meth:`GroupedCopier.copy_resliced`).

Recurrent state (Mamba2, GDN, ... groups) is not per token: a layer keeps one state, valid
after exactly some number of tokens. vLLM's ``align`` mode (prefix caching on) keeps it at
block boundaries: slot ``p`` of a state group holds the state after ``(p + 1) *
block_size`` tokens, written by a forward that ends at that boundary (vLLM splits a
prefill so that one does: the prompt's last boundary). So the state is a **linked
object** of its own grouped layout (kind ``state``, the state page as bytes, described by
the backend, shapes and dtypes), one per boundary that has one, keyed by the chunk hash of
the block that ends at the boundary: the key says exactly which tokens the state is the
state after, so a snapshot of another boundary or prompt can never be loaded for this
one. A hit is the longest KV prefix whose boundary has a snapshot (the scheduler probes
downwards from the KV prefix, at most ``KvdConnector.STATE_PROBES`` boundaries); a load
moves the KV of every position and the one snapshot; a snapshot committed without its KV,
or KV without a snapshot, only shortens hits. A handoff exports both layouts.

Pipeline stages and decode-context parallelism partition a block's bytes: a stage's
block holds its layers of every group (a group with none there has no piece), a DCP
rank's the tokens vLLM deals it; each partition is a layout of its own
(:func:`kvd.vllm_layout.partition_model`), and a hit needs every one of them.

KV cache groups of different block sizes (DeepSeek-V4: compressed latents in blocks of the
cache's size holding one state per ``tokens_per_state`` tokens, an indexer's compressed
keys, sliding-window latents of 64-token blocks, compressor states of 4- or 8-token ones):
a kvd position is vLLM's scheduler block (their least common multiple, where vLLM's hits
land), and a group's piece of it is ``per`` of its blocks one after the other
(:func:`_positions`). A hit is only ever at a position's end, so a sliding group whose
window is shorter than a position keeps only the blocks its window reaches back from the
end (as many as vLLM keeps there); a latent group (MLA, sliding MLA, indexer) is the same
on every rank, so DeepSeek-V4 is kept once per node like DeepSeek-V3. The pieces' blocks,
their size and the tokens per state are in the group's description: another compression
ratio or block size is another layout.

Refused by name (at start): recurrent state outside vLLM's align mode or in blocks other
than the scheduler's, speculative state blocks, states per token (``tokens_per_state <
1``), DeepSeek-V4.1's bounded-replay sliding window and compressor ring (vLLM does not
prefix-cache either: a hit would lack what the model reads), HiSparse host-resident
groups, encoder and cross-attention caches, a chunked-local group of blocks smaller than a
position, and decode-context parallelism beside sliding-window or recurrent groups or with
groups of different block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvd.vllm_layout import _DTYPES, KvdConfigError, dcp_of, head_shards, partition_model
from kvd.vllm_state import StateSplit, split_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

NULL_BLOCK = 0  # vLLM's null block: a position a group does not keep


@dataclass(frozen=True)
class GroupPlan:
    """One vLLM KV cache group as one kvd group."""

    index: int  # the group's index in vLLM's kv_cache_groups
    kind: str
    layer_names: tuple[str, ...]
    heads: int  # H of vLLM's logical [B, H, N, C] view
    states: int  # N per vLLM block
    content: int  # C, in elements of ``dtype``
    dtype: torch.dtype
    window: int
    quant: str
    offset: int  # where the group's pieces start in a kvd block
    draft: str = ""  # the draft model's identity when the group holds draft layers
    sliceable: bool = False  # heads are KV heads (not packed slots): a handoff may reslice them
    split: Optional[StateSplit] = None  # a state group's page, where it divides between TP sizes
    # Groups of different block sizes (DeepSeek-V4): a kvd position is the scheduler's
    # block, ``per`` of this group's vLLM blocks of ``vblock`` tokens, of which a piece
    # keeps the last ``subs`` (all of them, or a sliding group's window at the position's
    # end); ``tps``: tokens per stored state (compressed latents).
    per: int = 1
    subs: int = 1
    vblock: int = 0
    tps: int = 1

    @property
    def unit_bytes(self) -> int:
        """One vLLM block's share of a layer's piece."""
        return self.heads * self.states * self.content * _DTYPES[self.dtype][1]

    @property
    def layer_bytes(self) -> int:
        return self.subs * self.unit_bytes

    def describe(self, arrangement: str, heads: Optional[int] = None) -> dict[str, Any]:
        dims = [self.heads if heads is None else heads, self.states, self.content]
        if self.per != 1 or self.tps != 1:
            # Named only where it departs from one vLLM block of one state per token, so
            # the layouts of every other model keep their ids.
            dims = [self.subs] + dims
            arrangement = f"{arrangement} blocks={self.subs}/{self.per}x{self.vblock} tps={self.tps}"
        return {
            "kind": self.kind,
            "layers": len(self.layer_names),
            "dtype": _DTYPES[self.dtype][0],
            "dims": dims,
            "arrangement": f"{arrangement} draft={self.draft}"[:256] if self.draft else arrangement[:256],
            "window": self.window,
            "quant": self.quant,
        }

    def sub_ids(self, lst: list[int], pos: int) -> list[int]:
        """The vLLM block ids of this group's piece of position ``pos`` (the null block
        where ``lst``, the request's blocks of this group, has none)."""
        first = pos * self.per + self.per - self.subs
        return [int(lst[i]) if i < len(lst) else NULL_BLOCK for i in range(first, first + self.subs)]


@dataclass(frozen=True)
class GroupedGeometry:
    """What one kvd block of this engine is when it needs a grouped layout."""

    model_id: str
    block_size: int
    num_blocks: int
    tp_size: int
    replicated: bool  # every group is the same on every rank (MLA): one copy per node
    groups: tuple[GroupPlan, ...]
    arrangement: str
    # Recurrent state (Mamba/GDN groups): one snapshot per block boundary, its own layout.
    state_groups: tuple[GroupPlan, ...] = ()
    state_replicated: bool = False
    total_heads: int = 0  # the model's KV heads (all ranks), for reslicing between TP sizes
    # Pipeline parallelism: every stage has every group (vLLM projects the model's groups
    # onto each stage, some with no layers there); a geometry describes the blocks of
    # one stage, ``stage``: its layers, under a layout of its own.
    pp_size: int = 1
    stage: int = 0
    # Decode-context parallelism (as :class:`kvd.vllm_layout.Geometry`): a key spans
    # ``block_size * dcp_size`` tokens, a rank's block holds its ``block_size`` of them. A
    # latent kept once per node is then kept once per DCP rank (each holds other tokens).
    dcp_size: int = 1
    dcp_interleave: int = 1

    grouped = True

    @property
    def key_tokens(self) -> int:
        """Tokens per key: the scheduler's block."""
        return self.block_size * self.dcp_size

    @property
    def _per_stage(self) -> int:
        return self.dcp_size if self.replicated else self.tp_size

    def saves(self, rank: int) -> bool:
        """Whether TP rank ``rank`` stores blocks: every rank, but of a layout kept once
        per node (per DCP rank) only the first rank holding it."""
        return not self.replicated or rank < self.dcp_size

    @property
    def block_bytes(self) -> int:
        return sum(g.layer_bytes * len(g.layer_names) for g in self.groups)

    @property
    def num_layouts(self) -> int:
        """Layouts the scheduler asks about: per stage one when replicated, else one per
        rank (index ``stage * per-stage + rank``, :meth:`layout_index`)."""
        return self.pp_size * self._per_stage

    @property
    def num_state_layouts(self) -> int:
        """State layouts (0 without recurrent state), indexed as :meth:`state_index`."""
        return self.pp_size * (1 if self.state_replicated else self.tp_size) if self.state_groups else 0

    def layout_index(self, stage: int, rank: int) -> int:
        return stage * self._per_stage + (rank % self.dcp_size if self.replicated else rank)

    def state_index(self, stage: int, rank: int) -> int:
        return stage * (1 if self.state_replicated else self.tp_size) + (0 if self.state_replicated else rank)

    @property
    def state_bytes(self) -> int:
        return sum(g.layer_bytes * len(g.layer_names) for g in self.state_groups)

    def layout(self, index: int) -> dict[str, Any]:
        """Layout ``index`` (:meth:`layout_index`); of this geometry's stage only: the
        other stages' layers are known to their workers (the scheduler learns their
        layouts from them, :class:`kvd.vllm_connector.KvdHandshake`)."""
        stage, rank = divmod(index, self._per_stage)
        self._own_stage(stage)
        return self._layout(self.groups, self.replicated, rank)

    def _own_stage(self, stage: int) -> None:
        if stage != self.stage:
            raise ValueError(f"pipeline stage {stage}'s layout: this geometry describes stage {self.stage}'s layers")

    def layout_for(self, tp_size: int, rank: int) -> dict[str, Any]:
        """The layout of rank ``rank`` of an engine of this model at TP ``tp_size`` (a
        prefill of another TP size): each group's heads are the model's over ``tp_size``."""
        lay = self._layout(self.groups, False, rank)
        lay["tp_size"] = tp_size
        lay["groups"] = [g.describe(self.arrangement, self.total_heads // tp_size) for g in self.groups if g.layer_names]
        return lay

    def shards(self, src_tp: int, rank: int) -> Optional[list[tuple[int, int, int, int]]]:
        """As :meth:`kvd.vllm_layout.Geometry.shards`: where this rank's heads come from
        in a TP-``src_tp`` engine's blocks, or None where they cannot be resliced (MLA,
        recurrent state that does not divide, packed head slots, heads replicated across
        ranks, pipeline stages, decode-context parallelism)."""
        if (
            self.replicated
            or self.dcp_size > 1
            or self.pp_size > 1
            or not all(g.sliceable and g.per == 1 and g.heads * self.tp_size == self.total_heads for g in self.groups)
        ):
            return None
        if self.state_groups and self.state_shards(src_tp, rank) is None:
            return None
        return head_shards(self.total_heads, src_tp, self.tp_size, rank)

    def _state_plans_at(self, tp: int) -> Optional[tuple[GroupPlan, ...]]:
        """The state groups as an engine of this model at TP ``tp`` has them (content,
        description, offsets), or None where a page does not divide so."""
        if self.state_replicated:
            return None
        out, offset = [], 0
        for g in self.state_groups:
            sp = g.split.at(tp, self.tp_size) if g.split is not None else None
            if sp is None:
                return None
            plan = replace(g, content=sp.nbytes, quant=sp.describe()[:256], offset=offset, split=sp)
            out.append(plan)
            offset += plan.layer_bytes * len(plan.layer_names)
        return tuple(out)

    def state_shards(self, src_tp: int, rank: int) -> Optional[list[tuple[GroupPlan, list[list[tuple[int, int, int, int]]]]]]:
        """Where rank ``rank``'s recurrent state comes from in a TP-``src_tp`` engine's
        snapshots: per state group, the source's plan and, per part of its page
        (:mod:`kvd.vllm_state`), the cuts :func:`kvd.vllm_layout.head_shards` gives; None
        where the state does not divide between the two TP sizes."""
        src = self._state_plans_at(src_tp)
        if src is None:
            return None
        out = []
        for g, sg in zip(self.state_groups, src):
            parts = list(g.split.segments) + [g.split.temporal[0]]
            cuts = [head_shards(n * self.tp_size, src_tp, self.tp_size, rank) for n in parts]
            if any(c is None for c in cuts):
                return None
            out.append((sg, cuts))
        return out

    def state_layout_for(self, tp_size: int, rank: int) -> dict[str, Any]:
        """The state layout of rank ``rank`` of an engine of this model at TP
        ``tp_size`` (a prefill of another TP size), or {} where it has no such split."""
        plans = self._state_plans_at(tp_size)
        if plans is None:
            return {}
        lay = self._layout(plans, False, rank)
        lay["tp_size"] = tp_size
        return lay

    def state_layout(self, index: int) -> dict[str, Any]:
        """The layout of the recurrent state snapshots (one object per block boundary
        that has one; ``index`` as :meth:`state_index`), or {} when the model has no
        recurrent layers."""
        if not self.state_groups:
            return {}
        stage, rank = divmod(index, 1 if self.state_replicated else self.tp_size)
        self._own_stage(stage)
        return self._layout(self.state_groups, self.state_replicated, rank)

    def stage_holds(self) -> Optional[str]:
        """What this stage lacks to be described (None when it has it all): a stage
        without attention layers, or without recurrent ones in a recurrent hybrid, would
        have a block of nothing."""
        if not any(g.layer_names for g in self.groups):
            return "no attention layers"
        if self.state_groups and not any(g.layer_names for g in self.state_groups):
            return "no recurrent layers"
        return None

    def _layout(self, groups: tuple[GroupPlan, ...], replicated: bool, rank: int) -> dict[str, Any]:
        """The layout of TP rank ``rank``, or of DCP rank ``rank`` when ``replicated``."""
        # A group with no layers on this stage has no piece in its blocks.
        groups = tuple(g for g in groups if g.layer_names)
        return {
            "model": partition_model(self.model_id, self.pp_size, self.stage, self.dcp_size, rank % self.dcp_size, self.dcp_interleave),
            "num_layers": sum(len(g.layer_names) for g in groups),
            "kv_parts": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "u8",
            "tokens_per_block": self.block_size,
            "tp_size": 1 if replicated else self.tp_size,
            "tp_rank": 0 if replicated else rank,
            "order": "groups",
            "groups": [g.describe(self.arrangement) for g in groups],
        }


def _state_plan(gi: int, grp: Any, spec: "KVCacheSpec", vllm_config: "VllmConfig", offset: int) -> GroupPlan:
    """A Mamba/GDN group as a kvd group: each layer's state page as bytes, described by
    its backend, shapes and dtypes (vLLM views a state page as ``[1, 1, bytes]``)."""
    cc = vllm_config.cache_config
    if cc.mamba_cache_mode != "align" or spec.mamba_cache_mode != "align":
        raise KvdConfigError(
            f"kvd connector: KV cache group {gi} ({type(spec).__name__}) with mamba_cache_mode {cc.mamba_cache_mode!r}: vLLM keeps recurrent "
            "state at block boundaries only in 'align' mode (turn prefix caching on)"
        )
    if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
        raise KvdConfigError(f"kvd connector: KV cache group {gi}: speculative or prefill-checkpoint state blocks are not supported yet")
    content = int(spec.state_content_size_bytes)
    split = split_of(spec)
    if split is not None and split.nbytes == content:
        quant = split.describe()
    else:
        # Not decomposed (and so not resliced between TP sizes): named as vLLM gives it,
        # with the conv layout, which orients its first shape.
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        split = None
        shapes = ";".join("x".join(str(d) for d in sh) + ":" + str(dt).replace("torch.", "") for sh, dt in zip(spec.shapes, spec.dtypes))
        quant = f"{str(getattr(spec.mamba_type, 'name', spec.mamba_type)).lower()} {shapes} conv={get_conv_state_layout()}"
    return GroupPlan(
        index=gi,
        kind="state",
        layer_names=tuple(grp.layer_names),
        heads=1,
        states=1,
        content=content,
        dtype=torch.int8,
        window=0,
        quant=quant[:256],
        offset=offset,
        split=split,
    )


def _kind(spec: "KVCacheSpec") -> tuple[str, int]:
    """The kvd kind and window of an attention spec, or a refusal naming it."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if type(spec) is MLAAttentionSpec:
        # DeepSeek-V3.2/V4's sparse and compressed latents, their indexer caches: one
        # latent row per stored state, whatever the TP (tokens_per_state in the plan).
        if spec.model_version not in (None, "deepseek_v4"):
            raise KvdConfigError(f"kvd connector: MLA cache of model_version {spec.model_version!r} is not supported")
        return ("mla_indexer" if str(getattr(spec.cache_role, "value", spec.cache_role)) == "indexer" else "mla"), 0
    if type(spec) is SlidingWindowMLASpec:
        if spec.bounded_replay:
            raise KvdConfigError(
                "kvd connector: DeepSeek-V4.1's bounded-replay sliding window is not supported: vLLM does not prefix-cache it "
                "(it replays the window's tokens instead), so a hit would lack what the model reads"
            )
        return "sliding_mla", int(spec.sliding_window)
    if type(spec) is SlidingWindowSpec:
        return "sliding", int(spec.sliding_window)
    if type(spec) is ChunkedLocalAttentionSpec:
        return "chunked", int(spec.attention_chunk_size)
    if type(spec) is FullAttentionSpec:
        if spec.non_causal:
            raise KvdConfigError("kvd connector: non-causal attention (prefix LM) is not supported: a block is not a function of the tokens before it")
        # A sliding or chunked layer the hybrid allocator is off for keeps every block.
        return "full", int(spec.sliding_window or spec.attention_chunk_size or 0)
    if type(spec) is CircularBufferSpec:
        raise KvdConfigError(
            "kvd connector: KV cache spec CircularBufferSpec (DeepSeek-V4.1's compressor ring) is not supported: vLLM does not prefix-cache it, "
            "so the keys still being compressed at a hit's boundary would be missing"
        )
    raise KvdConfigError(
        f"kvd connector: KV cache spec {name} is not supported "
        "(supported: full, sliding-window, chunked-local and MLA attention (DeepSeek-V4's compressed and sliding latents too), recurrent state)"
    )


def _quant(spec: "KVCacheSpec", vllm_config: "VllmConfig") -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if getattr(spec, "topk_buffer_width", None) is not None:
        # A sparse latent's (DeepSeek-V3.2/V4) top-k width: named, though the pages do not hold it.
        return ";".join(x for x in (_quant_mode(spec, cache_dtype), f"topk={spec.topk_buffer_width}") if x)
    return _quant_mode(spec, cache_dtype)


def _quant_mode(spec: "KVCacheSpec", cache_dtype: str) -> str:
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = spec.kv_quant_mode
    if mode == KVQuantMode.NONE:
        return "" if cache_dtype == "auto" else f"cache_dtype={cache_dtype}"
    if mode == KVQuantMode.FP8_PER_TENSOR:
        # Per-tensor scales live in the attention layers, not in the cache: vLLM loads
        # them from the checkpoint (covered by the model identity) or uses 1.0.
        return f"{mode.name.lower()};cache_dtype={cache_dtype};scales=checkpoint"
    # Every other mode keeps its scales inside the page (per token and head, or packed).
    return f"{mode.name.lower()};cache_dtype={cache_dtype};scales=in_page"


def _draft_identity(vllm_config: "VllmConfig") -> str:
    """The draft model's identity (speculative decoding): its layers' KV depends on its
    weights, which the target's model identity does not cover when they are another
    checkpoint (EAGLE); MTP layers live in the target's own checkpoint."""
    from kvd.identity import model_identity

    spec = getattr(vllm_config, "speculative_config", None)
    name = getattr(spec, "model", None) if spec is not None else None
    if not name:
        return "unnamed"
    try:
        return model_identity(str(name), getattr(spec, "revision", None))
    except (OSError, ValueError):
        return str(name)[:128]


def grouped_geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", model_id: str) -> GroupedGeometry:
    """The grouped layout of this engine's KV cache, or :class:`KvdConfigError` naming
    what kvd cannot describe."""
    import vllm

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise KvdConfigError("kvd connector: the engine has no KV cache")
    dcp, interleave = dcp_of(vllm_config)
    from vllm.v1.kv_cache_interface import MambaSpec

    plans: list[GroupPlan] = []
    states: list[GroupPlan] = []
    state_offset = 0
    state_block = None
    replicated_states = []
    for gi, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        if not getattr(grp, "enable_kv_transfer", True) or getattr(grp, "host_resident", False) or str(getattr(getattr(grp, "role", None), "value", "default")) != "default":
            raise KvdConfigError(f"kvd connector: KV cache group {gi}: HiSparse host-resident and accelerator-only replica groups are not supported")
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        specs = list(inner.values()) if inner else [spec]
        first = specs[0]
        for s in specs[1:]:
            if s != first:
                raise KvdConfigError(f"kvd connector: KV cache group {gi} has layers of different specs ({type(first).__name__} and {type(s).__name__})")
        if type(first) is MambaSpec:
            if dcp > 1:
                raise KvdConfigError(f"kvd connector: KV cache group {gi}: recurrent state with decode-context parallelism is not supported (its blocks are not dealt by token)")
            if state_block is None:
                state_block = first.block_size
            elif first.block_size != state_block:
                raise KvdConfigError(f"kvd connector: recurrent state groups of different block_size ({state_block} and {first.block_size} tokens) are not supported")
            plan = _state_plan(gi, grp, first, vllm_config, state_offset)
            states.append(plan)
            replicated_states.append(bool(first.tp_replicated))
            state_offset += plan.layer_bytes * len(plan.layer_names)
            continue
        kind, window = _kind(first)
        if dcp > 1 and (kind not in ("full", "mla") or window or not first.dcp_sharded):
            raise KvdConfigError(
                f"kvd connector: KV cache group {gi} ({kind}{', not sharded by token' if not first.dcp_sharded else ''}) with decode-context parallelism "
                "is not supported: only full-attention and MLA groups whose tokens DCP deals out"
            )
        if dcp > 1 and first.block_size % interleave:
            raise KvdConfigError(f"kvd connector: cp_kv_cache_interleave_size {interleave} does not divide the block size {first.block_size}")
        tps = first.tokens_per_state
        if int(tps) != tps or tps < 1 or first.block_size % int(tps):
            raise KvdConfigError(
                f"kvd connector: KV cache group {gi}: tokens_per_state = {tps} (states per token, or not dividing the block of {first.block_size} tokens) is not supported"
            )
        if first.dtype not in _DTYPES:
            raise KvdConfigError(f"kvd connector: KV cache group {gi}: dtype {first.dtype} has no kvd name (supported: {sorted(v[0] for v in _DTYPES.values())})")
        elsize = _DTYPES[first.dtype][1]
        content_bytes = int(first.state_content_size_bytes)
        if content_bytes % elsize:
            raise KvdConfigError(f"kvd connector: KV cache group {gi}: {content_bytes} content bytes are not whole {first.dtype} elements")
        # Speculative decoding: draft layers may sit in any group (vLLM merges specs that
        # differ only in is_draft), so every group names the draft model.
        draft = _draft_identity(vllm_config) if getattr(vllm_config, "speculative_config", None) is not None else ""
        plan = GroupPlan(
            index=gi,
            kind=kind,
            draft=draft,
            layer_names=tuple(grp.layer_names),
            heads=int(first.num_heads),
            states=int(first.num_states),
            content=content_bytes // elsize,
            dtype=first.dtype,
            window=window,
            quant=_quant(first, vllm_config),
            offset=0,
            sliceable=kind in ("full", "sliding", "chunked") and first.num_head_slots is None and first.state_content_bytes is None,
            vblock=int(first.block_size),
            tps=int(tps),
        )
        plans.append(plan)
    if not plans:
        raise KvdConfigError("kvd connector: a model with recurrent state but no attention layers is not supported")
    block_size, plans = _positions(vllm_config, kv_cache_config, plans, state_block, dcp)
    if len(set(replicated_states)) > 1:
        raise KvdConfigError("kvd connector: recurrent state groups both sharded and replicated across TP ranks are not supported")
    cc = vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None) or "default"
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    arrangement = f"vllm {vllm.__version__} {device} {layout} {backend or 'auto'} [head,state,content]"
    return GroupedGeometry(
        model_id=model_id,
        block_size=int(block_size),
        num_blocks=kv_cache_config.num_blocks,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        replicated=all(p.kind in _LATENT for p in plans) and not states,
        groups=tuple(plans),
        arrangement=arrangement[:256],
        state_groups=tuple(states),
        state_replicated=bool(replicated_states and replicated_states[0]),
        total_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
        pp_size=int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1),
        dcp_size=dcp,
        dcp_interleave=interleave,
    )


# Kinds whose cache is one latent row per stored state, the same on every TP rank.
_LATENT = ("mla", "mla_indexer", "sliding_mla")


def _positions(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", plans: list[GroupPlan], state_block: Optional[int], dcp: int) -> tuple[int, list[GroupPlan]]:
    """A kvd position's tokens and the attention groups' pieces of one, at their offsets.

    One block size: a position is one block of every group, as ever. Groups of different
    block sizes (DeepSeek-V4: 4- and 8-token compressor states, 64-token sliding latents,
    compressed latents of the cache's block size): a position is vLLM's scheduler block
    (the sizes' least common multiple, where vLLM's hits land), ``per`` blocks of each
    group. A group every position of which a hit reads keeps them all; a sliding group
    keeps the blocks its window reaches back from the position's end (as many as vLLM
    keeps at a hit there), since a hit is only ever at a position's end. Recurrent state
    is a snapshot per position and must have the position's size."""
    import math

    sizes = {p.vblock for p in plans}
    if len(sizes) == 1 and (state_block is None or state_block in sizes):
        L = sizes.pop()
    else:
        if dcp > 1:
            raise KvdConfigError("kvd connector: KV cache groups of different block sizes with decode-context parallelism are not supported")
        L = math.lcm(*sizes, *(() if state_block is None else (state_block,)))
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            sched = int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[0])
        except (ImportError, AttributeError, TypeError, ValueError):
            sched = L
        if sched % L:
            raise KvdConfigError(f"kvd connector: vLLM's scheduler block of {sched} tokens is not a multiple of every group's block ({sorted(sizes)})")
        L = sched
        if state_block is not None and state_block != L:
            raise KvdConfigError(f"kvd connector: recurrent state in blocks of {state_block} tokens beside a scheduler block of {L} is not supported")
    out, offset = [], 0
    for p, grp in zip(plans, [kv_cache_config.kv_cache_groups[p.index] for p in plans]):
        per = L // p.vblock
        subs = per
        if per > 1 and p.window:
            if p.kind not in ("sliding", "sliding_mla"):
                raise KvdConfigError(f"kvd connector: KV cache group {p.index}: a {p.kind} group of {p.vblock}-token blocks beside a scheduler block of {L} is not supported")
            extra = int(getattr(grp.kv_cache_spec, "extra_retained_tokens", 0) or 0)
            need = -(-(p.window - 1 + extra) // p.vblock)
            subs = max(1, min(per, need))
        p = replace(p, per=per, subs=subs, offset=offset)
        out.append(p)
        offset += p.layer_bytes * len(p.layer_names)
    return L, out


def complete(ids_by_group: tuple[list[int], ...], geo: GroupedGeometry, first: int, upto: int) -> list[tuple[int, ...]]:
    """The per-position block ids ``(one per group)`` of positions ``first..upto`` that
    every group holds, stopping at the first position one group does not (a save stores
    whole positions only, and a prefix only)."""
    out = []
    for pos in range(first, upto):
        ids = []
        for g in geo.groups:
            b = _ids_at(g, ids_by_group, pos)
            if NULL_BLOCK in (b if isinstance(b, tuple) else (b,)):
                return out
            ids.append(b)
        out.append(tuple(ids))
    return out


def _ids_at(g: GroupPlan, ids_by_group: tuple[list[int], ...], pos: int) -> "int | tuple[int, ...]":
    """Group ``g``'s block id of position ``pos``, or where a position is several of the
    group's blocks (:attr:`GroupPlan.per`) the ids of its piece's blocks."""
    lst = ids_by_group[g.index] if g.index < len(ids_by_group) else []
    if g.per == 1 and g.subs == 1:
        return int(lst[pos]) if pos < len(lst) else NULL_BLOCK
    return tuple(g.sub_ids(list(lst), pos))


def positions(ids_by_group: tuple[list[int], ...], geo: GroupedGeometry, first: int, count: int) -> list[tuple[int, ...]]:
    """The per-position block ids of positions ``first..first+count`` as vLLM allocated
    them for a load: the null block where a group keeps no block there."""
    return [tuple(_ids_at(g, ids_by_group, pos) for g in geo.groups) for pos in range(first, first + count)]


def unfilled(ids_by_group: tuple[list[int], ...], geo: GroupedGeometry, first: int, count: int) -> Optional[str]:
    """Why a load of positions ``first..first+count`` would leave a block vLLM keeps
    unfilled (None when it would not): a sliding group whose piece holds only its window's
    blocks at a position's end, where vLLM keeps more of them (a speculative decoder's
    extra block, a longer retention than the one kvd derived). Such a load must fail (vLLM
    recomputes), never leave the engine reading a block nobody wrote."""
    for g in geo.groups:
        if g.subs == g.per:
            continue
        lst = ids_by_group[g.index] if g.index < len(ids_by_group) else []
        for pos in range(first, first + count):
            head = range(pos * g.per, pos * g.per + g.per - g.subs)
            if any(i < len(lst) and int(lst[i]) != NULL_BLOCK for i in head):
                return f"vLLM keeps more of KV cache group {g.index}'s window than kvd stores per position ({g.subs} of {g.per} blocks)"
    return None


def state_ids(ids_by_group: tuple[list[int], ...], geo: GroupedGeometry, pos: int) -> Optional[tuple[int, ...]]:
    """The state groups' block ids at position ``pos`` (the snapshot after ``pos + 1``
    blocks), or None where one of them keeps no block there."""
    out = []
    for g in geo.state_groups:
        lst = ids_by_group[g.index] if g.index < len(ids_by_group) else []
        b = int(lst[pos]) if 0 <= pos < len(lst) else NULL_BLOCK
        if b == NULL_BLOCK:
            return None
        out.append(b)
    return tuple(out)


class GroupedCopier:
    """Moves the pieces of grouped blocks between pool slots and vLLM's paged caches.

    A layer's piece of block ``b`` is its kernel blocks ``b*r .. b*r+r`` (vLLM splits a
    block into ``r`` kernel blocks when the attention kernel wants smaller ones), viewed
    as bytes and laid out ``[head][r][state][content]`` in the slot, which is the logical
    ``[head, state, content]`` of the whole block. Pieces into the null block are skipped
    on a load (a position the group does not keep).

    On CUDA one layer of many blocks moves with one gather and one indexed copy (``rows``:
    the pool's device mapping as rows of bytes, given by the connector), not one DMA per
    piece; on the CPU (and without rows) one direct copy per piece, which is faster there
    than staging (``staged`` forces either, for the tests)."""

    def __init__(self, geo: GroupedGeometry, kv_caches: dict[str, Any], state: bool = False, rows: Optional[Any] = None):
        self.geo = geo
        self.rows = rows  # rows(pool, starts, length) -> (rows, idx) | None
        self.staged: Optional[bool] = None  # None: on CUDA only
        self.plans = geo.state_groups if state else geo.groups
        self.layers: list[tuple[GroupPlan, torch.Tensor, int, int]] = []  # plan, tensor, offset, r
        self.index: dict[str, int] = {}
        device = None
        for plan in self.plans:
            for li, name in enumerate(plan.layer_names):
                t = kv_caches.get(name)
                if t is None:
                    raise KvdConfigError(f"kvd connector: no KV cache tensor for layer {name}")
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise KvdConfigError(f"kvd connector: layer {name}: KV cache {shape}; expected vLLM's [blocks, heads, states, content]")
                nb, h, n, c = t.shape
                if t.dtype != plan.dtype or h != plan.heads or c != plan.content:
                    raise KvdConfigError(
                        f"kvd connector: layer {name}: KV cache {tuple(t.shape)} {t.dtype} does not match its group's spec "
                        f"({plan.heads} heads, content {plan.content}, {plan.dtype})"
                    )
                if nb % geo.num_blocks or n * (nb // geo.num_blocks) != plan.states:
                    raise KvdConfigError(f"kvd connector: layer {name}: {nb} kernel blocks of {n} states do not split {geo.num_blocks} blocks of {plan.states}")
                if t.stride(-1) != 1:
                    raise KvdConfigError(f"kvd connector: layer {name}: the content dimension is strided")
                if device is not None and t.device != device:
                    raise KvdConfigError(f"kvd connector: layer {name} is on {t.device}, others on {device}")
                device = t.device
                self.index[name] = len(self.layers)
                self.layers.append((plan, t, plan.offset + li * plan.layer_bytes, nb // geo.num_blocks))
        self.device = device

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t, _, _ in self.layers]

    def _pair(self, pool: torch.Tensor, at: int, li: int, block: int, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM blocks ``block .. block + k`` of layer ``li`` and their units of a slot, one
        after the other from byte ``at`` of the pool."""
        plan, t, _, r = self.layers[li]
        n = plan.states // r
        es = _DTYPES[plan.dtype][1]
        slot = pool[at : at + k * plan.unit_bytes].view(k, plan.heads, r, n, plan.content * es)
        cache = t[block * r : (block + k) * r].view(torch.uint8)
        cache = cache.view(k, r, *cache.shape[1:]).permute(0, 2, 1, 3, 4)
        return cache, slot

    @staticmethod
    def _runs(units: list[tuple[int, int]], unit_bytes: int) -> list[tuple[int, int, int]]:
        """``units`` as runs (pool byte, first block, count) of consecutive blocks whose
        units follow one another in the pool: one copy each (a group of small blocks keeps
        several per position, mostly consecutive)."""
        out: list[tuple[int, int, int]] = []
        for at, b in units:
            if out and out[-1][0] + out[-1][2] * unit_bytes == at and out[-1][1] + out[-1][2] == b:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((at, b, 1))
        return out

    def _units(self, li: int, offs: list[int], ids: list[tuple[Any, ...]]) -> list[tuple[int, int]]:
        """Layer ``li``'s (pool byte, vLLM block) pairs of the positions at slots ``offs``
        with block ids ``ids``: one per vLLM block of the layer's piece (a piece of a group
        of smaller blocks is :attr:`GroupPlan.subs` of them, one after the other)."""
        plan, _, o, _ = self.layers[li]
        gpos = self.plans.index(plan)
        out = []
        for off, bids in zip(offs, ids):
            b = bids[gpos]
            subs = b if isinstance(b, (tuple, list)) else (b,)
            out.extend((off + o + j * plan.unit_bytes, int(x)) for j, x in enumerate(subs))
        return out

    def _rows_for(self, t: torch.Tensor, pool: torch.Tensor, starts: list[int], length: int) -> Optional[Any]:
        staged = t.device.type == "cuda" if self.staged is None else self.staged
        return self.rows(pool, starts, length) if staged and self.rows is not None else None

    def _kidx(self, li: int, blocks: list[int]) -> torch.Tensor:
        _, t, _, r = self.layers[li]
        ids = torch.tensor(blocks, dtype=torch.long)
        if r > 1:
            ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
        return ids.to(t.device)

    def load_layer(self, pool: torch.Tensor, offs: list[int], ids: list[tuple[Any, ...]], li: int) -> None:
        plan, t, _, r = self.layers[li]
        todo = [(at, b) for at, b in self._units(li, offs, ids) if b != NULL_BLOCK]
        if not todo:
            return
        rr = self._rows_for(t, pool, [at for at, _ in todo], plan.unit_bytes)
        if rr is not None:
            rows, idx = rr
            n, es = len(todo), _DTYPES[plan.dtype][1]
            x = rows.index_select(0, idx).view(-1).view(torch.uint8).view(n, plan.heads, r, plan.states // r, plan.content * es)
            x = x.permute(0, 2, 1, 3, 4).reshape(n * r, plan.heads, plan.states // r, plan.content * es)
            t.view(torch.uint8).index_copy_(0, self._kidx(li, [b for _, b in todo]), x)
            return
        for at, b, k in self._runs(todo, plan.unit_bytes):
            cache, slot = self._pair(pool, at, li, b, k)
            cache.copy_(slot, non_blocking=True)

    def save_layer(self, pool: torch.Tensor, offs: list[int], ids: list[tuple[Any, ...]], li: int) -> None:
        plan, t, _, r = self.layers[li]
        units = self._units(li, offs, ids)
        if not units:
            return
        if any(b == NULL_BLOCK for _, b in units):  # never: saves are of whole positions (complete())
            raise KvdConfigError("kvd connector: a save of a position a group does not hold")
        rr = self._rows_for(t, pool, [at for at, _ in units], plan.unit_bytes)
        if rr is not None:
            rows, idx = rr
            n, es = len(units), _DTYPES[plan.dtype][1]
            x = t.view(torch.uint8).index_select(0, self._kidx(li, [b for _, b in units]))
            x = x.view(n, r, plan.heads, plan.states // r, plan.content * es).permute(0, 2, 1, 3, 4).contiguous()
            rows.index_copy_(0, idx, x.view(-1).view(torch.int64).view(-1, rows.shape[1]))
            return
        for at, b, k in self._runs(units, plan.unit_bytes):
            cache, slot = self._pair(pool, at, li, b, k)
            slot.copy_(cache, non_blocking=True)

    def copy_resliced(self, pool: torch.Tensor, src_tp: int, shards: list[tuple[int, int, int, int]], offsets: list[list[int]], ids: list[tuple[int, ...]]) -> None:
        """Blocks of a TP-``src_tp`` engine's layouts (``offsets[j]``: the slots of shard
        ``shards[j]``) into this rank's heads of positions ``ids``, one copy per piece;
        the null block skipped."""
        es_of = {p.index: _DTYPES[p.dtype][1] for p in self.plans}
        hs = self.geo.total_heads // src_tp
        # Where each layer's piece sits in a source block (its groups' heads are hs).
        src_off, at = [], 0
        for p in self.plans:
            for _ in p.layer_names:
                src_off.append(at)
                at += hs * p.states * p.content * es_of[p.index]
        for (s, s0, d0, n), offs in zip(shards, offsets):
            for off, bids in zip(offs, ids):
                for li, (plan, t, _, r) in enumerate(self.layers):
                    b = bids[self.plans.index(plan)]
                    if b == NULL_BLOCK:
                        continue
                    es = es_of[plan.index]
                    nb = hs * plan.states * plan.content * es
                    slot = pool[off + src_off[li] : off + src_off[li] + nb].view(hs, r, plan.states // r, plan.content * es)
                    cache = t[b * r : (b + 1) * r].view(torch.uint8).permute(1, 0, 2, 3)
                    cache[d0 : d0 + n].copy_(slot[s0 : s0 + n], non_blocking=True)

    def copy_in(self, pool: torch.Tensor, offs: list[int], ids: list[tuple[int, ...]]) -> None:
        for li in range(len(self.layers)):
            self.load_layer(pool, offs, ids, li)

    def copy_out(self, pool: torch.Tensor, offs: list[int], ids: list[tuple[int, ...]]) -> None:
        for li in range(len(self.layers)):
            self.save_layer(pool, offs, ids, li)
