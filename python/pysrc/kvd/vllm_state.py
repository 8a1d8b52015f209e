"""A recurrent layer's state page between TP sizes, for :mod:`kvd.vllm_groups`.

vLLM shards a Mamba/GDN layer's state across TP ranks the way it shards the layer: the
convolution state's channels are the concatenation of sub-projections (Mamba1 ``[x]``,
Mamba2 ``[x | B | C]``, GDN ``[Q | K | V]``), each split evenly between the ranks, and the
temporal (SSM or delta-rule) state is split along its first dimension (heads). One rank's
page is its conv state, then its temporal state (``MambaSpec.shapes``, in that order).
:class:`StateSplit` names those parts, so that a decode rank of one TP size can cut its
state out of the pages a prefill of another TP size wrote: each sub-projection's slice
and the temporal state's heads, from the source ranks that hold them.

Only where the model's whole state divides evenly under both TP sizes: a Mamba2 model
whose groups vLLM replicates to fill the ranks (``n_groups`` not a multiple of TP) has no
such split (its B and C are copies, not slices), and other state kinds (short conv, KDA,
linear attention) are not decomposed here: a handoff between TP sizes is then a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Any, Optional

import torch

# The backends whose conv state is a concatenation of evenly split sub-projections.
_SPLIT_KINDS = ("mamba1", "mamba2", "gdn_attn")


@dataclass(frozen=True)
class StateSplit:
    """One rank's state page: its conv state (``conv_dim_first``: vLLM's ``DS`` layout,
    ``[dim, rows]``; else ``SD``, ``[rows, dim]``) with the channels of each
    sub-projection (``segments``), then its temporal state split on dim 0."""

    kind: str
    conv_rows: int
    segments: tuple[int, ...]
    conv_dtype: torch.dtype
    conv_dim_first: bool
    temporal: tuple[int, ...]
    temporal_dtype: torch.dtype

    @property
    def conv_shape(self) -> tuple[int, int]:
        dim = sum(self.segments)
        return (dim, self.conv_rows) if self.conv_dim_first else (self.conv_rows, dim)

    @property
    def conv_bytes(self) -> int:
        return prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.conv_bytes + prod(self.temporal) * self.temporal_dtype.itemsize

    def at(self, tp: int, from_tp: int) -> Optional["StateSplit"]:
        """This split (of a rank of a TP-``from_tp`` engine) on a rank of a TP-``tp``
        engine of the same model, or None where the state does not divide so."""
        total = [s * from_tp for s in self.segments] + [self.temporal[0] * from_tp]
        if tp <= 0 or any(t % tp for t in total):
            return None
        return replace(self, segments=tuple(t // tp for t in total[:-1]), temporal=(total[-1] // tp,) + self.temporal[1:])

    def views(self, page: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A page's bytes (``nbytes`` of them, uint8) as its conv sub-projections (each
        with the channels on dim 0) and its temporal state."""
        conv = page[: self.conv_bytes].view(self.conv_dtype).view(self.conv_shape)
        if not self.conv_dim_first:
            conv = conv.t()  # [dim, rows], a strided view
        parts, at = [], 0
        for n in self.segments:
            parts.append(conv[at : at + n])
            at += n
        temporal = page[self.conv_bytes : self.nbytes].view(self.temporal_dtype).view(self.temporal)
        return parts, temporal

    def describe(self) -> str:
        """The page as kvd's layout names it (shapes, dtypes, conv layout)."""
        shapes = ";".join(
            "x".join(str(d) for d in sh) + ":" + str(dt).replace("torch.", "")
            for sh, dt in ((self.conv_shape, self.conv_dtype), (self.temporal, self.temporal_dtype))
        )
        return f"{self.kind} {shapes} conv={'DS' if self.conv_dim_first else 'SD'}"


def split_of(spec: Any) -> Optional[StateSplit]:
    """The split of a ``MambaSpec`` page, or None where its state is not a conv state
    of evenly split sub-projections beside a temporal state (see the module's doc)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
    if kind not in _SPLIT_KINDS or len(spec.shapes) != 2 or len(spec.shapes[0]) != 2:
        return None
    ds = is_conv_state_dim_first()
    conv, temporal = tuple(spec.shapes[0]), tuple(spec.shapes[1])
    dim, rows = conv if ds else (conv[1], conv[0])
    if kind == "mamba1":
        segments: tuple[int, ...] = (dim,)
    elif kind == "mamba2":
        x = temporal[0] * temporal[1]  # (heads, head_dim, state)
        if dim <= x or (dim - x) % 2:
            return None
        segments = (x, (dim - x) // 2, (dim - x) // 2)
    else:  # GDN: (v_heads, v_dim, k_dim); conv [Q | K | V], dim(Q) == dim(K)
        v = temporal[0] * temporal[1]
        if dim <= v or (dim - v) % 2:
            return None
        segments = ((dim - v) // 2, (dim - v) // 2, v)
    return StateSplit(
        kind=kind,
        conv_rows=rows,
        segments=segments,
        conv_dtype=spec.dtypes[0],
        conv_dim_first=ds,
        temporal=temporal,
        temporal_dtype=spec.dtypes[1],
    )


def reslice(dst: StateSplit, dst_page: torch.Tensor, src: StateSplit, src_page: torch.Tensor, cuts: list[list[tuple[int, int, int, int]]]) -> None:
    """Copies, from one source rank's page, the parts a destination rank holds:
    ``cuts[j]`` for sub-projection ``j`` (and the last for the temporal state) as
    :func:`kvd.vllm_layout.head_shards` gives them, of this source shard only."""
    dparts, dtemp = dst.views(dst_page)
    sparts, stemp = src.views(src_page)
    for d, s, cut in zip(dparts + [dtemp], sparts + [stemp], cuts):
        for _, s0, d0, n in cut:
            d[d0 : d0 + n].copy_(s[s0 : s0 + n], non_blocking=True)
