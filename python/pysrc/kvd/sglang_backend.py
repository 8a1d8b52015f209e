"""kvd as an SGLang HiCache storage backend (``HiCacheStorage``, written against SGLang
0.5.23).

One flag turns it on::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvd",
            "module_path": "kvd.sglang_backend", "class_name": "KvdHiCacheStorage",
            "interface_v1": 1, "endpoint": "ipc:///run/kvd/kvd.sock"}'

SGLang's host pool (L2) pages move to and from kvd slots (L3) with one copy each, page
view to slot view, no intermediate buffer: ``batch_set_v1`` allocates slots for the pages
kvd lacks, copies them in and commits; ``batch_get_v1`` pins, copies out, releases;
``batch_exists`` is one ``lookup``. The plain variants (``get``/``set``/``batch_*``) take
and give pages in the host pool's own flat page order (``get_data_page``), stored in the
same canonical block as the v1 calls, so both interfaces read each other's pages.

**Blocks and keys.** A kvd block is one SGLang page of all this rank's layers, in layout
order ``layer_part_token_head``; the layout names the model (``extra_config.model_id``,
default the digest of the config and weights SGLang's ``model_name`` points at, SPEC
§3.1 "Model identity", so two servers on one checkpoint under two paths share and
replaced weights never do; a pipeline stage adds ``#ppR/N``), the rank's heads and
dtype, and ``tp_rank``, so keys are namespaced by layout: another model, rank, stage or
dtype can never read these pages. SGLang's page keys (its own chained prefix hashes) map to
kvd keys by ``BLAKE2b-128("kvd.sglang.v1\\0" || key)``.

**MLA** (DeepSeek-V3/R1, Kimi-K2: SGLang's ``MLATokenToKVPoolHost``): the latent is the
same on every TP rank, so a page is kept once per node, in a grouped layout (SPEC §3.1:
one ``mla`` group, ``[token][latent]`` per layer, ``tp_size`` 1): rank 0 stores it (the
other ranks' stores succeed without writing, as SGLang's own MLA backends do; SGLang takes
the minimum of the ranks' results), every rank loads it.

**Refused at registration, with the reason:** K and V of different widths, split-head
(heterogeneous TP) storage, host layouts other than ``layer_first``, ``page_first``,
``page_first_direct`` and ``page_head`` (MLA: the first three), DeepSeek's packed fp8 MLA
rows, and dtypes kvd has no name for. Hybrid pools (Mamba states, sliding-window KV) go
through SGLang's ``batch_*_v2`` interface, one transfer per pool: each pool SGLang
registers (``register_mem_host_pool_v2``: Mamba states, SWA KV, ...) gets a grouped layout
of its own (one group: the pool's flat page as bytes, named by the pool, its class,
layout and page size), so its pages are namespaced like the KV's. ``batch_exists_v2``
follows SGLang's hit policies: ``all_pages`` needs every page of the prefix, and
``trailing_pages`` needs the last N pages of a prefix. The latter is probed from the KV
prefix downwards, at most 64 prefixes, so a boundary further down is not offered.
Other policies are refused (no hit from that pool).
``clear()`` is a no-op: pages are content-addressed (never stale) and kvd evicts by LRU.

**Layer by layer (SPEC §16): what SGLang's interface allows.** A storage backend sees
whole host pages only: SGLang prefetches L3 → L2 (host) pages before a request is
scheduled and writes L2 → L3 after its own device → host write-back, with no per-layer
call into the backend. The per-layer overlap with the forward is SGLang's own, in the
L2 → L1 load (its cache controller copies host pages to the GPU one layer at a time and
each attention layer waits for its layer, ``LayerDoneCounter``); pages kvd serves reach
the device that way. So this backend moves pages whole, and there is nothing per layer
for it to do; P/D handoffs in SGLang go through its own disaggregation transfer engines,
not a HiCache backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvd
from kvd.identity import model_identity

logger = logging.getLogger(__name__)

_DTYPES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.uint8: "u8",
}
# Each host layout's page, as a 5-d tensor in its natural order, permuted to the block's
# [layer, K|V, token, head, dim].
_TO_BLOCK = {
    "layer_first": (1, 0, 2, 3, 4),  # [2, L, T, H, D]
    "page_first": (2, 0, 1, 3, 4),  # [2, T, L, H, D]
    "page_first_direct": (1, 0, 2, 3, 4),  # [2, L, T, H, D] (one page)
    "page_head": (3, 0, 2, 1, 4),  # [2, H, T, L, D] (one page)
}


def kvd_key(key: str) -> bytes:
    return hashlib.blake2b(b"kvd.sglang.v1\0" + key.encode(), digest_size=16).digest()


def _model_of(model_name: Optional[str]) -> str:
    """The layout's model for SGLang's ``model_name``: its model path, which SGLang tags
    ``-<format>`` when the host pool has a page format of its own. The path's checkpoint is
    digested (:func:`kvd.identity.model_identity`) and the tag kept."""
    if not model_name:
        return ""
    if not os.path.exists(model_name) and "-" in model_name:
        base, tag = model_name.rsplit("-", 1)
        if os.path.exists(base):
            return f"{model_identity(base)}-{tag}"
    return model_identity(model_name)


class KvdHiCacheStorage(HiCacheStorage):
    """kvd behind SGLang's HiCache L3 interface (see the module's doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        if storage_config.should_split_heads:
            raise ValueError("kvd HiCache backend: split-head storage (prefill and decode of different TP sizes) is not supported")
        self._endpoint = extra.get("endpoint") or os.environ.get("KVD_ENDPOINT")
        self._model = str(extra.get("model_id") or _model_of(storage_config.model_name))
        if not self._model:
            raise ValueError("kvd HiCache backend: no model name; set extra_config.model_id")
        if storage_config.pp_size > 1:
            self._model += f"#pp{storage_config.pp_rank}/{storage_config.pp_size}"
        # A daemon with tenants (SPEC §18): the engine's credential and tenant (default
        # $KVD_TENANT_TOKEN / $KVD_TENANT).
        self._client = kvd.Client(
            self._endpoint,
            name=f"sglang-tp{storage_config.tp_rank}",
            timeout_s=float(extra.get("timeout_s", 10.0)),
            token=extra.get("tenant_token") or None,
            tenant=extra.get("tenant") or None,
        )
        self._pool = kvd.torch_pool(self._client, register_cuda=False)  # host to host: plain copies
        self._inc = self._client.incarnation
        self._lock = threading.Lock()  # SGLang's prefetch and backup threads share this
        self.mem_pool_host = None
        self._lid: Optional[int] = None
        self._mla = False
        self._writes = True
        self._extra: dict[str, tuple[Any, int, int, torch.dtype]] = {}  # pool name -> (host pool, layout id, page bytes, flat page dtype)

    # ------------------------------------------------------------------ the geometry

    def register_mem_pool_host(self, mem_pool_host) -> None:
        p = mem_pool_host
        self._mla = hasattr(p, "kv_lora_rank")
        if self._mla:
            self._register_mla(p)
            super().register_mem_pool_host(mem_pool_host)
            return
        layout = getattr(p, "layout", None)
        if layout not in _TO_BLOCK or getattr(p, "kv_buffer", None) is None:
            raise ValueError(f"kvd HiCache backend: host pool layout {layout!r} ({type(p).__name__}) is not supported; use one of {sorted(_TO_BLOCK)}")
        if not hasattr(p, "head_num") or p.head_dim != getattr(p, "v_head_dim", p.head_dim):
            raise ValueError(f"kvd HiCache backend: {type(p).__name__} has no separate K and V of one width (MLA or packed pools are not supported)")
        if p.dtype not in _DTYPES:
            raise ValueError(f"kvd HiCache backend: KV dtype {p.dtype} has no kvd name")
        cfg = self.storage_config
        self._layout = {
            "model": self._model,
            "num_layers": p.layer_num,
            "kv_parts": 2,
            "num_kv_heads": p.head_num * cfg.tp_size,
            "head_dim": p.head_dim,
            "dtype": _DTYPES[p.dtype],
            "tokens_per_block": p.page_size,
            "tp_size": cfg.tp_size,
            "tp_rank": cfg.tp_rank,
            "order": "layer_part_token_head",
        }
        info = self._client.register_layout(self._layout)
        self._shape = (p.layer_num, 2, p.page_size, p.head_num, p.head_dim)
        want = p.layer_num * 2 * p.page_size * p.head_num * p.head_dim * p.dtype.itemsize
        if info["block_bytes"] != want:
            raise ValueError(f"kvd HiCache backend: the daemon sizes a page at {info['block_bytes']} bytes, the pool at {want}")
        self._bytes = want
        self._lid = info["layout_id"]
        super().register_mem_pool_host(mem_pool_host)

    _MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

    def _register_mla(self, p) -> None:
        """An MLA host pool: one latent row per token and layer, the same on every rank."""
        if p.layout not in self._MLA_LAYOUTS or getattr(p, "kv_buffer", None) is None:
            raise ValueError(f"kvd HiCache backend: MLA host pool layout {p.layout!r} is not supported; use one of {list(self._MLA_LAYOUTS)}")
        if getattr(p, "dsa_kv_cache_store_fp8", False):
            raise ValueError("kvd HiCache backend: packed fp8 MLA rows (DeepSeek sparse attention) are not supported")
        if p.dtype not in _DTYPES:
            raise ValueError(f"kvd HiCache backend: KV dtype {p.dtype} has no kvd name")
        L, T, D = p.layer_num, p.page_size, p.kv_cache_dim
        group = {
            "kind": "mla",
            "layers": L,
            "dtype": _DTYPES[p.dtype],
            "dims": [T, D],
            "arrangement": f"sglang [token,latent] kv_lora_rank={p.kv_lora_rank} rope={p.qk_rope_head_dim}",
            "window": 0,
            "quant": "",
        }
        self._layout = {
            "model": self._model,
            "num_layers": L,
            "kv_parts": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "u8",
            "tokens_per_block": T,
            "tp_size": 1,
            "tp_rank": 0,
            "order": "groups",
            "groups": [group],
        }
        info = self._client.register_layout(self._layout)
        self._shape = (L, T, D)
        want = L * T * D * p.dtype.itemsize
        if info["block_bytes"] != want:
            raise ValueError(f"kvd HiCache backend: the daemon sizes a page at {info['block_bytes']} bytes, the pool at {want}")
        self._bytes = want
        self._lid = info["layout_id"]
        self._writes = self.storage_config.tp_rank == 0

    def _view(self) -> tuple[torch.Tensor, int]:
        """The pool view and the daemon incarnation it maps. After a daemon restart the
        client maps the new pool (and fails one call saying so): view that one then."""
        with self._lock:
            if self._client.incarnation != self._inc:
                self._pool = kvd.torch_pool(self._client, register_cuda=False)
                self._inc = self._client.incarnation
            return self._pool, self._inc

    def _slot(self, pool: torch.Tensor, off: int) -> torch.Tensor:
        return pool[off : off + self._bytes].view(self.mem_pool_host.dtype).view(self._shape)

    def _natural(self, x: torch.Tensor) -> torch.Tensor:
        """A page in the host layout's natural 5-d order, as the block's [L, 2, T, H, D]
        (MLA: its natural 4-d or 5-d order as the block's [L, T, D])."""
        p = self.mem_pool_host
        if self._mla:
            L, T, D = self._shape
            if p.layout == "page_first":
                return x.reshape(T, L, D).permute(1, 0, 2)
            return x.reshape(L, T, D)
        L, _, T, H, D = self._shape
        dims = {
            "layer_first": (2, L, T, H, D),
            "page_first": (2, T, L, H, D),
            "page_first_direct": (2, L, T, H, D),
            "page_head": (2, H, T, L, D),
        }[p.layout]
        return x.reshape(dims).permute(_TO_BLOCK[p.layout])

    def _page(self, index: int) -> torch.Tensor:
        """The host pool's page starting at token ``index``, as a [L, 2, T, H, D] view."""
        p = self.mem_pool_host
        kb, ps = p.kv_buffer, p.page_size
        if self._mla:  # [L, T, D]
            if p.layout == "layer_first":
                return kb[:, index : index + ps, 0, :]
            if p.layout == "page_first":
                return kb[index : index + ps, :, 0, :].permute(1, 0, 2)
            return kb[index // ps, :, :, 0, :]
        if p.layout == "layer_first":
            x = kb[:, :, index : index + ps]
        elif p.layout == "page_first":
            x = kb[:, index : index + ps]
        else:  # one page per index along dim 1
            x = kb[:, index // ps]
        return x.permute(_TO_BLOCK[p.layout])

    def _pages(self, keys: List[str], host_indices: torch.Tensor) -> List[int]:
        ps = self.mem_pool_host.page_size
        if len(host_indices) != len(keys) * ps:
            raise ValueError(f"kvd HiCache backend: {len(keys)} keys for {len(host_indices)} host indices (page size {ps})")
        starts = host_indices[::ps].tolist()
        if any(s % ps for s in starts):
            raise ValueError("kvd HiCache backend: host indices do not start at page boundaries")
        return starts

    def _ready(self) -> bool:
        if self._lid is None:
            logger.warning("kvd HiCache backend: used before register_mem_pool_host")
            return False
        return True

    # --------------------------------------------------------------- v1 (zero copy)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        if not keys or not self._ready():
            return 0
        ks = [kvd_key(k) for k in keys]
        try:
            try:
                return int(self._client.lookup(self._lid, ks)["prefix"])
            except kvd.KvdError as e:
                if e.code != "unknown_layout":
                    raise
                # A restarted daemon forgot the layout (lookup has no session to notice
                # the restart by): register it again, once.
                self._client.register_layout(self._layout)
                return int(self._client.lookup(self._lid, ks)["prefix"])
        except kvd.KvdError as e:
            logger.warning("kvd HiCache backend: lookup failed: %s", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys or not self._ready():
            return [False] * len(keys)
        starts = self._pages(keys, host_indices)
        return self._store(keys, [self._page(s) for s in starts])

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys or not self._ready():
            return [False] * len(keys)
        starts = self._pages(keys, host_indices)
        return self._load(keys, [self._page(s) for s in starts])

    def _store(self, keys: List[str], pages: List[torch.Tensor]) -> List[bool]:
        if not self._writes:
            return [True] * len(keys)  # MLA: rank 0 stores the node's one copy
        return self._put(self._lid, keys, lambda pool, off, i: self._slot(pool, off).copy_(pages[i]))

    def _load(self, keys: List[str], pages: List[torch.Tensor]) -> List[bool]:
        return self._get(self._lid, keys, lambda pool, off, i: pages[i].copy_(self._slot(pool, off)))

    def _put(self, lid: int, keys: List[str], write) -> List[bool]:
        """Allocates ``keys`` under layout ``lid``, ``write(pool, offset, i)`` for each
        page kvd lacks, commits; per key whether kvd holds it now."""
        pool, inc = self._view()
        try:
            batch = self._client.alloc(lid, [kvd_key(k) for k in keys])
        except kvd.KvdError as e:
            logger.warning("kvd HiCache backend: alloc failed: %s", e)
            return [False] * len(keys)
        try:
            if self._client.incarnation != inc:  # offsets of a pool this view does not map
                batch.abort()
                return [False] * len(keys)
            ok = []
            for i, (state, off) in enumerate(zip(batch.status, batch.offsets)):
                if state == "new" and off is not None:
                    write(pool, off, i)
                ok.append(state in ("new", "exists"))
            batch.commit()
            return ok
        except BaseException:
            batch.abort()
            raise

    def _get(self, lid: int, keys: List[str], read) -> List[bool]:
        """Pins ``keys`` under layout ``lid`` and ``read(pool, offset, i)`` for each page
        kvd holds; per key whether it was read."""
        pool, inc = self._view()
        try:
            pin = self._client.get(lid, [kvd_key(k) for k in keys])
        except kvd.KvdError as e:
            logger.warning("kvd HiCache backend: get failed: %s", e)
            return [False] * len(keys)
        try:
            if self._client.incarnation != inc:
                return [False] * len(keys)
            ok = kvd.vouched(self._client, lid, [kvd_key(k) for k in keys], pin)
            for i, off in enumerate(pin.offsets):
                if ok[i]:
                    read(pool, off, i)
            return ok
        finally:
            pin.release()

    # ------------------------------------------- plain variants (flat host pages)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        if not keys or not self._ready() or values is None or len(values) != len(keys):
            return False
        return all(self._store(keys, [self._natural(v) for v in values]))

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if not keys or not self._ready():
            return [None] * len(keys)
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        ok = self._load(keys, [self._natural(t) for t in target_locations])
        return [t if good else None for t, good in zip(target_locations, ok)]

    # ------------------------------------------------- v2 (several host pools)

    # How many prefixes below the KV hit a trailing-pages pool is probed for.
    TRAILING_PROBES = 64

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A host pool beside the KV (Mamba states, SWA KV): its pages in a grouped layout
        of their own, one group of the flat page's bytes."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        page = host_pool.get_dummy_flat_data_page()
        nbytes = page.numel() * page.element_size()
        kind = "".join(ch if ch.isalnum() else "_" for ch in name.lower())[:32] or "pool"
        cfg = self.storage_config
        layout = {
            "model": self._model,
            "num_layers": 1,
            "kv_parts": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "u8",
            "tokens_per_block": int(getattr(host_pool, "page_size", 1) or 1),
            "tp_size": cfg.tp_size,
            "tp_rank": cfg.tp_rank,
            "order": "groups",
            "groups": [
                {
                    "kind": kind,
                    "layers": 1,
                    "dtype": "u8",
                    "dims": [nbytes],
                    "arrangement": f"sglang {type(host_pool).__name__} {getattr(host_pool, 'layout', '?')} flat page {page.numel()}x{page.dtype}"[:256],
                    "window": 0,
                    "quant": "",
                }
            ],
        }
        info = self._client.register_layout(layout)
        if info["block_bytes"] != nbytes:
            raise ValueError(f"kvd HiCache backend: the daemon sizes a {name} page at {info['block_bytes']} bytes, the pool at {nbytes}")
        self._extra[name] = (host_pool, int(info["layout_id"]), nbytes, page.dtype)

    def _pool_prefix(self, lid: int, keys: List[str]) -> int:
        return int(self._client.lookup(lid, [kvd_key(k) for k in keys])["prefix"]) if keys else 0

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        kv = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {str(PoolName.KV): kv} if kv else {}
        restorable = set(range(1, kv + 1))
        try:
            for t in pool_transfers or []:
                if not restorable:
                    break
                name = str(t.name)
                pool = self._extra.get(name)
                if pool is None:
                    logger.warning("kvd HiCache backend: no host pool %r registered; no hit from it", name)
                    restorable = set()
                    break
                lid = pool[1]
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    ok = set(range(1, self._pool_prefix(lid, keys[:kv]) + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    ok = set()
                    for p in sorted(restorable, reverse=True)[: self.TRAILING_PROBES]:
                        lo = max(0, p - trailing)
                        if self._pool_prefix(lid, keys[lo:p]) == p - lo:
                            ok.add(p)
                else:
                    logger.warning("kvd HiCache backend: hit policy %s of pool %r is not supported; no hit from it", t.hit_policy, name)
                    ok = set()
                if ok:
                    hits[name] = max(ok)
                restorable &= ok
        except kvd.KvdError as e:
            logger.warning("kvd HiCache backend: lookup failed: %s", e)
            restorable = set()
        final = max(restorable, default=0)
        return PoolTransferResult(final, hits, sorted(restorable))

    def _pool_io(self, transfers: List[PoolTransfer], store: bool) -> dict[str, List[bool]]:
        out: dict[str, List[bool]] = {}
        for t in transfers:
            name = str(t.name)
            keys = list(t.keys or [])
            if name == str(PoolName.KV):
                if t.host_indices is None:
                    out[name] = [False] * len(keys)
                else:
                    out[name] = self.batch_set_v1(keys, t.host_indices) if store else self.batch_get_v1(keys, t.host_indices)
                continue
            pool = self._extra.get(name)
            ps = int(getattr(pool[0], "page_size", 1) or 1) if pool else 1
            if pool is None or t.host_indices is None or t.host_indices.numel() != len(keys) * ps:
                logger.warning("kvd HiCache backend: pool %r: not registered or %d keys for %s host indices", name, len(keys), None if t.host_indices is None else t.host_indices.numel())
                out[name] = [False] * len(keys)
                continue
            host_pool, lid, nbytes, dtype = pool
            offsets = [int(t.host_indices[i * ps].item()) for i in range(len(keys))]
            out[name] = self._pool_store(lid, nbytes, keys, host_pool, offsets) if store else self._pool_load(lid, nbytes, dtype, keys, host_pool, offsets)
        return out

    def _pool_store(self, lid: int, nbytes: int, keys: List[str], host_pool, offsets: List[int]) -> List[bool]:
        pages = [host_pool.get_data_page(o, flat=True).contiguous().view(torch.uint8) for o in offsets]
        return self._put(lid, keys, lambda pool, off, i: pool[off : off + nbytes].copy_(pages[i]))

    def _pool_load(self, lid: int, nbytes: int, dtype: torch.dtype, keys: List[str], host_pool, offsets: List[int]) -> List[bool]:
        return self._get(lid, keys, lambda pool, off, i: host_pool.set_from_flat_data_page(offsets[i], pool[off : off + nbytes].clone().view(dtype)))

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._pool_io(transfers, store=False)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._pool_io(transfers, store=True)

    def clear(self) -> None:
        return None  # content-addressed pages are never stale; kvd evicts by LRU
