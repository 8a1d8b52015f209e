"""The classic layout's copies between kvd pool slots and vLLM's paged KV cache, for
:mod:`kvd.vllm_connector` (grouped layouts have :class:`kvd.vllm_groups.GroupedCopier`).

A classic block is one vLLM block of every layer, ``[layer][K|V][head][token][head_dim]``
(``layer_part_head_token``); vLLM's per-layer cache is ``[blocks * r, heads, block_size /
r, K|V]`` (``r`` kernel blocks per block). On CUDA a copy of many slots is one gather (or
scatter) of the cache and one indexing kernel through the pool's device mapping
(``rows``, given by the connector); on the CPU one direct copy per piece. Nothing here
synchronises a stream: the caller does, once per step or load.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from kvd.vllm_layout import Geometry, KvdConfigError


class ClassicCopier:
    """Moves classic blocks between pool slots and one worker's paged KV caches."""

    def __init__(self, geo: Geometry, kv_caches: dict[str, Any], rows: Callable[..., Optional[tuple[torch.Tensor, torch.Tensor]]]):
        """Checks that ``kv_caches`` holds the geometry's layers as vLLM shapes them
        (:class:`KvdConfigError` naming what does not); ``rows(pool, starts, length)``:
        the pool as rows of bytes and the rows' indices, or None (one DMA per slot)."""
        g = self.geo = geo
        self.rows = rows
        missing = [n for n in g.layer_names if n not in kv_caches]
        if missing:
            raise KvdConfigError(f"kvd connector: no KV cache tensor for layers {missing[:4]}")
        layers = [kv_caches[n] for n in g.layer_names]
        t0 = layers[0]
        for name, t in zip(g.layer_names, layers):
            if t.dim() != 4:
                raise KvdConfigError(f"kvd connector: layer {name}: a {t.dim()}-dimensional KV cache {tuple(t.shape)}; expected vLLM's [blocks, heads, tokens, K|V]")
            if t.dtype != g.dtype or t.device != t0.device or t.shape != t0.shape:
                raise KvdConfigError(f"kvd connector: layer {name}: {tuple(t.shape)} {t.dtype} on {t.device} differs from the other layers")
        nb, heads, kb, content = t0.shape
        if heads != g.heads or content != 2 * g.head_size:
            raise KvdConfigError(
                f"kvd connector: KV cache shape {tuple(t0.shape)} does not match the model ({g.heads} KV heads, "
                f"K|V of {2 * g.head_size}); unsupported layout"
            )
        if nb % g.num_blocks or kb * (nb // g.num_blocks) != g.block_size:
            raise KvdConfigError(
                f"kvd connector: {nb} kernel blocks of {kb} tokens do not split {g.num_blocks} blocks of {g.block_size} tokens"
            )
        self.layers = layers
        self.index = {n: i for i, n in enumerate(g.layer_names)}
        self.ratio = nb // g.num_blocks
        self.device = t0.device

    def tensors(self) -> list[torch.Tensor]:
        return self.layers

    def read_pool(self, pool: torch.Tensor, starts: list[int], length: int, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """``length`` bytes at each of ``starts`` in the pool, as one ``shape`` tensor of the
        cache's dtype on its device, moved by one kernel (enqueued on the current stream);
        None where ``rows`` gives no rows."""
        r = self.rows(pool, starts, length)
        if r is None:
            return None
        rows, idx = r
        return rows.index_select(0, idx).view(-1).view(self.geo.dtype).view(shape)

    def write_pool(self, pool: torch.Tensor, starts: list[int], src: torch.Tensor) -> bool:
        """The reverse of :meth:`read_pool`: ``src`` (contiguous, on the cache's device) cut
        into ``len(starts)`` equal runs, run ``j`` to ``starts[j]``, by one kernel; False
        where ``rows`` gives no rows (nothing moved)."""
        if not starts:
            return True
        length = src.numel() * src.element_size() // len(starts)
        r = self.rows(pool, starts, length)
        if r is None:
            return False
        rows, idx = r
        rows.index_copy_(0, idx, src.contiguous().view(-1).view(torch.int64).view(-1, rows.shape[1]))
        return True

    def slot(self, pool: torch.Tensor, off: int) -> torch.Tensor:
        g = self.geo
        return pool[off : off + g.block_bytes].view(g.dtype).view(len(g.layer_names), 2, g.heads, g.block_size, g.head_size)

    def kidx(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self.ratio > 1:
            ids = (ids[:, None] * self.ratio + torch.arange(self.ratio)).reshape(-1)
        return ids.to(self.device)

    def pieces(self, slot: torch.Tensor, block_id: int):
        """(paged-cache view, slot view) pairs that together are one block: per layer, per
        kernel block, K and V. Copying each pair moves the block with no intermediate."""
        for l in range(len(self.layers)):
            yield from self.layer_pieces(slot, block_id, l)

    def layer_pieces(self, slot: torch.Tensor, block_id: int, l: int):
        """:meth:`pieces` of layer ``l`` only."""
        g, r = self.geo, self.ratio
        kb, d = g.block_size // r, g.head_size
        t = self.layers[l]
        for i in range(r):
            page = t[block_id * r + i]  # [heads, kb, K|V]
            for part in (0, 1):
                yield page[..., part * d : (part + 1) * d], slot[l, part, :, i * kb : (i + 1) * kb]

    def load_layer(self, pool: torch.Tensor, offs: list[int], block_ids: list[int], l: int, staged: Optional[bool] = None) -> None:
        """Layer ``l`` of pool slots ``offs`` → paged-cache blocks ``block_ids`` (on CUDA,
        or ``staged``: enqueued on the current stream, every slot's layer into a staging
        tensor by one kernel (:meth:`read_pool`; one DMA per slot without a mapping), one
        scatter; else one copy per piece)."""
        if not (self.device.type == "cuda" if staged is None else staged):
            for off, b in zip(offs, block_ids):
                for dst, src in self.layer_pieces(self.slot(pool, off), b, l):
                    dst.copy_(src)
            return
        g, n, r = self.geo, len(offs), self.ratio
        lb = g.block_bytes // len(g.layer_names)
        shape = (n, 2, g.heads, g.block_size, g.head_size)
        staging = self.read_pool(pool, [off + l * lb for off in offs], lb, shape)
        if staging is None:
            staging = torch.empty(shape, dtype=g.dtype, device=self.device)
            for j, off in enumerate(offs):
                staging[j].copy_(self.slot(pool, off)[l], non_blocking=True)
        kb = g.block_size // r
        x = torch.cat([staging[:, 0], staging[:, 1]], dim=-1)
        x = x.view(n, g.heads, r, kb, 2 * g.head_size).permute(0, 2, 1, 3, 4).reshape(n * r, g.heads, kb, 2 * g.head_size)
        self.layers[l].index_copy_(0, self.kidx(block_ids), x)

    def save_layer(self, pool: torch.Tensor, offs: list[int], block_ids: list[int], l: int, staged: Optional[bool] = None) -> None:
        """Layer ``l`` of paged-cache blocks ``block_ids`` → pool slots ``offs`` (the
        reverse of :meth:`load_layer`)."""
        if not (self.device.type == "cuda" if staged is None else staged):
            for off, b in zip(offs, block_ids):
                for src, dst in self.layer_pieces(self.slot(pool, off), b, l):
                    dst.copy_(src)
            return
        g, n, r = self.geo, len(offs), self.ratio
        kb = g.block_size // r
        x = self.layers[l].index_select(0, self.kidx(block_ids))
        x = x.view(n, r, g.heads, kb, 2 * g.head_size).permute(0, 2, 1, 3, 4).reshape(n, g.heads, g.block_size, 2 * g.head_size)
        staging = torch.stack([x[..., : g.head_size], x[..., g.head_size :]], dim=1).contiguous()
        lb = g.block_bytes // len(g.layer_names)
        if not self.write_pool(pool, [off + l * lb for off in offs], staging):
            for j, off in enumerate(offs):
                self.slot(pool, off)[l].copy_(staging[j], non_blocking=True)

    def copy_in(self, pool: torch.Tensor, offs: list[int], block_ids: list[int]) -> None:
        """Pool slots ``offs`` → paged-cache blocks ``block_ids``. On CUDA: every slot
        into a device staging tensor by one kernel through the pool's mapping (one DMA per
        slot without one), then one scatter; on the CPU: straight from each slot into the
        cache, one copy per piece."""
        if self.device.type != "cuda":
            for off, b in zip(offs, block_ids):
                for dst, src in self.pieces(self.slot(pool, off), b):
                    dst.copy_(src)
            return
        g = self.geo
        shape = (len(offs), len(self.layers), 2, g.heads, g.block_size, g.head_size)
        staging = self.read_pool(pool, offs, g.block_bytes, shape)
        if staging is None:
            staging = torch.empty(shape, dtype=g.dtype, device=self.device)
            for j, off in enumerate(offs):
                staging[j].copy_(self.slot(pool, off), non_blocking=True)
        self.scatter(block_ids, staging)

    def copy_out(self, pool: torch.Tensor, offs: list[int], block_ids: list[int]) -> None:
        """Paged-cache blocks ``block_ids`` → pool slots ``offs`` (the reverse of
        :meth:`copy_in`: on CUDA one gather, then one kernel into every slot)."""
        if self.device.type != "cuda":
            for off, b in zip(offs, block_ids):
                for src, dst in self.pieces(self.slot(pool, off), b):
                    dst.copy_(src)
            return
        staging = self.gather(block_ids)
        if not self.write_pool(pool, offs, staging):
            for j, off in enumerate(offs):
                self.slot(pool, off).copy_(staging[j], non_blocking=True)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks of the paged cache as ``[n, layer, K|V, head, token, dim]`` on its device."""
        g, n, r = self.geo, len(block_ids), self.ratio
        idx = self.kidx(block_ids)
        out = torch.empty((n, len(self.layers), 2, g.heads, g.block_size, g.head_size), dtype=g.dtype, device=self.device)
        kb = g.block_size // r
        for l, t in enumerate(self.layers):
            x = t.index_select(0, idx).view(n, r, g.heads, kb, 2 * g.head_size).permute(0, 2, 1, 3, 4).reshape(n, g.heads, g.block_size, 2 * g.head_size)
            out[:, l, 0].copy_(x[..., : g.head_size])
            out[:, l, 1].copy_(x[..., g.head_size :])
        return out

    def scatter(self, block_ids: list[int], src: torch.Tensor) -> None:
        g, n, r = self.geo, len(block_ids), self.ratio
        idx = self.kidx(block_ids)
        kb = g.block_size // r
        for l, t in enumerate(self.layers):
            x = torch.cat([src[:, l, 0], src[:, l, 1]], dim=-1)
            x = x.view(n, g.heads, r, kb, 2 * g.head_size).permute(0, 2, 1, 3, 4).reshape(n * r, g.heads, kb, 2 * g.head_size)
            t.index_copy_(0, idx, x)

    def copy_resliced(self, pool: torch.Tensor, src_tp: int, shards: list[tuple[int, int, int, int]], offsets: list[list[int]], block_ids: list[int]) -> None:
        """Blocks of a TP-``src_tp`` engine's layouts (``offsets[j]``: the slots of shard
        ``shards[j]``, :meth:`kvd.vllm_layout.Geometry.shards`) into this rank's heads of
        blocks ``block_ids``, one copy per piece."""
        g, r = self.geo, self.ratio
        hs, d = g.total_heads // src_tp, g.head_size
        kb = g.block_size // r
        nbytes = len(g.layer_names) * 2 * hs * g.block_size * d * g.dtype.itemsize
        for (s, s0, d0, n), offs in zip(shards, offsets):
            for off, b in zip(offs, block_ids):
                slot = pool[off : off + nbytes].view(g.dtype).view(len(g.layer_names), 2, hs, g.block_size, d)
                for l, t in enumerate(self.layers):
                    for i in range(r):
                        page = t[b * r + i]  # [heads here, kb, K|V]
                        for part in (0, 1):
                            page[d0 : d0 + n, :, part * d : (part + 1) * d].copy_(slot[l, part, s0 : s0 + n, i * kb : (i + 1) * kb], non_blocking=True)
