"""kvd as a vLLM KV connector (``KVConnectorBase_V1``, written against vLLM 0.33).

One line turns it on::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvd/kvd.sock"}}'

What it does
------------
* **Prefix caching.** The scheduler-side connector asks the node's daemon (``lookup``:
  no pin; NVMe-only blocks of the prefix start coming into free DRAM, since the load
  usually follows) for the longest prefix of each prompt it holds under *every* TP
  rank's layout (the minimum counts) and reports those tokens as external hits. The
  worker-side connector loads them into vLLM's paged KV cache **layer by layer**:
  ``start_load_kv`` pins the blocks (one ``get``) and starts copying layer 0, 1, ... on
  a copier (a thread on CPU, a stream of its own on CUDA, one event per layer);
  ``wait_for_layer_load`` waits for exactly its layer, so layer *i* loads while layers
  before it compute. Every newly computed *full prompt block* is saved **as the forward
  produces it**: slots are reserved before the forward (``alloc``), ``save_kv_layer``
  copies that layer into them while the next layers compute, and ``wait_for_save``
  finishes the copies and commits (SPEC §16; ``extra_config.layerwise = false`` loads
  and saves whole blocks around the forward instead). A model runner that never calls
  ``wait_for_layer_load`` for a layer it reads would read it early: the step's loaded
  blocks are then reported as load errors (vLLM recomputes them) and later steps load
  whole blocks before the forward, with a warning. A block that vanished between the
  lookup and the load is reported through ``get_block_ids_with_load_errors``: vLLM
  recomputes it (``kv_load_failure_policy: recompute``; with vLLM's default ``fail``
  the request fails instead, and the connector says so once at start).
* **Prefill/decode disaggregation.** On the prefill side (``kv_producer`` or ``kv_both``),
  ``request_finished`` of a request sent with ``{"do_remote_decode": true}`` exports its
  prompt blocks (one transfer per TP rank, the daemon pins them under a lease) and returns
  JSON-serialisable ``kv_transfer_params``; vLLM frees its own blocks at once, because the
  KV lives in the daemon's pool. On the decode side, ``get_num_new_matched_tokens``
  *admits* the transfer (``extra_config.mode = "pull"``, the default: the decode daemon
  heartbeats the exporter from then on) or registers its slots for a push (``"push"``), and
  answers "load asynchronously"; once vLLM allocated the blocks the pull starts; the
  worker waits for the transfer, loads the blocks **by the keys it computed from its own
  prompt** (a mixed-up or forged ``kv_transfer_params`` can only miss, never load another
  prompt's KV) and reports the request in ``finished_recving`` — or in
  ``failed_recving`` (a killed prefill daemon, an expired lease, a missing block), which
  vLLM turns into a local recompute.
* **Data path.** Pool slots are viewed through ``kvd.torch_pool`` (page-locked and mapped
  with ``cudaHostRegister`` on CUDA, warmed up there): a save gathers the blocks (or one
  layer of them) into a device staging tensor and one indexing kernel writes all of its
  slots' bytes through the pool's device mapping (``kvd._device_view``); a load reads
  them so and scatters. One launch per call, whatever the pieces' size, where a DMA per
  piece costs a call each and runs at a fraction of the link below ~1 MiB (a layer of a
  Llama-3-8B block is 64 KiB). Without a mapping: one DMA per slot. On CPU tensors each
  piece of a block (a layer's K or V) is copied straight between the slot and the paged
  cache.

The block format
----------------
A dense model (one full-attention KV cache group, K and V of one size, no quantization)
keeps kvd's classic layout: a kvd block is one vLLM block of ``block_size`` tokens, all
layers, in order ``layer_part_head_token`` (``[layer][K|V][head][token][head_dim]``), one
layout per TP rank (``tp_rank`` is in the layout id). Every other cache gets a **grouped
layout** (SPEC §3.1, :mod:`kvd.vllm_groups`): each of vLLM's KV cache groups described
from its own spec (kind, window, dtype, the piece per layer, quantization, vLLM's
arrangement), one kvd block per position holding every group's piece, stored and
committed together. That covers MLA (one latent copy per node, handed between TP sizes),
sliding-window and chunked-local hybrids (gpt-oss, Gemma 3: the connector implements
``SupportsHMA``; a load fills only the blocks vLLM keeps for a sliding group), recurrent
hybrids (Qwen3-Next/3.5, Jamba, Falcon-H1: the state at a block boundary as a linked
object of its own layout, a hit only where one exists), fp8 KV (named with where its
scales come from) and the backends' packed or padded pages. A grouped layout of one
group (MLA, fp8) loads like the classic one, layer by layer in the step; with several
groups or recurrent state loads are asynchronous (the request waits one step), because
vLLM then accepts a failed load only as a failed asynchronous one (``failed_recving``),
and recomputes it.

The model is named by ``extra_config.model_id`` (default: the digest of the config and
weights vLLM's ``model`` points at, SPEC §3.1 "Model identity": engines on one checkpoint
under two paths share, weights replaced under one path never meet the old ones; an
explicit ``model_id`` must never be shared between different weights). A handoff's params
carry the prefill's model; a decode engine of another model says so ("prefill's model X,
decode's model Y") and prefills itself. Keys are SPEC §3.2 chunk hashes of the prompt
tokens, salted with the LoRA adapter's name and the request's ``cache_salt`` — so tenants
and adapters never share blocks — and, for multimodal prompts, with their items as vLLM's
own prefix cache keys them (:func:`kvd.vllm_layout.request_keys`).

Tenants (SPEC §18)
------------------
Against a daemon with tenants every session acts for one tenant, decided by its
credential: ``extra_config.tenant_token`` (default ``$KVD_TENANT_TOKEN``) and ``tenant``
(default ``$KVD_TENANT``; needed where the token acts for several). Without more, every
request of the engine is that tenant's. With ``tenant_from`` = ``"cache_salt"`` or
``"lora"`` each request is the tenant its cache salt or LoRA adapter names (through
``tenant_map``, value -> tenant, where one is given; a value the map lacks, and a
request without one, is the engine's tenant): the scheduler and each worker keep a
session per tenant they met, and a request's lookups, loads, saves, exports and pulls
run in its tenant's session (so its blocks live in that tenant's namespace and count
against its shares). A tenant the engine's credential does not act for is refused a
session: such requests run without kvd (no lookup, no save, asked again after 5 s),
never as another tenant's. vLLM takes ``cache_salt`` from the request body, so a
platform that maps salts to tenants sets it at its gateway; the salt also salts the
keys, so a request can only reach blocks stored under the same salt. A handoff's
decode engine must map the request to the prefill's tenant (the same salt or adapter
does); another tenant's session cannot admit it (the transfer's layout is not in its
namespace) and the decode engine prefills. Each worker session maps the pool (one
mapping, and on CUDA one registration, per tenant a worker serves).

Where things are
----------------
This module: the connector (scheduler side: hits, saves, handoffs; worker side: loads,
stores and handoffs through the daemon). :mod:`kvd.vllm_layout`: the geometry from vLLM's
config, the partitions (pipeline stages, DCP ranks), the keys. :mod:`kvd.vllm_classic`:
the classic layout's copies. :mod:`kvd.vllm_groups`: grouped layouts and their copies.
:mod:`kvd.vllm_state`: a recurrent state page between TP sizes. :mod:`kvd.vllm_meta`:
what the scheduler sends the workers, and the workers' layouts it hears back.
:mod:`kvd.vllm_worker`: the mover, the copier and a step's layer-wise loads and saves.

What it refuses (with the reason, at start)
-------------------------------------------
Recurrent state outside vLLM's ``align`` mode (prefix caching off) or with speculative
state blocks, DeepSeek-V4.1's bounded-replay window and compressor ring, states per token, HiSparse host groups,
non-causal attention, encoder/cross-attention caches, dtypes kvd has
no name for, decode-context parallelism beside sliding-window or recurrent groups, prefill
context parallelism, a pipeline stage of a hybrid that holds no attention (or no
recurrent) layers. Requests with prompt embeddings are neither loaded
nor saved.

Pipeline parallelism: each stage keeps its layers under its own layout (``model#ppS/P``),
and a hit needs every stage's blocks; a handoff goes between engines of the same PP size
(one transfer per stage and rank). A dense model's stages are vLLM's partition of its
layers, which the scheduler computes; a grouped layout's stage holds what vLLM projects
onto it of every group (some groups may have no layers there), known only to the stage's
worker, so each worker hands its layouts to the scheduler as vLLM's handshake metadata
(:class:`kvd.vllm_meta.KvdHandshake`); until all of them came the scheduler finds no hit.

Decode-context parallelism (dense and MLA models): vLLM's scheduler block spans
``block_size * DCP`` tokens, and each rank holds, in its block of the same id, the tokens
vLLM deals to its DCP rank (``cp_kv_cache_interleave_size`` at a time). A key is one
scheduler block; each rank stores its share under its own layout (``model#dcpD/N,I``),
and a hit needs every rank's. An MLA latent is kept once per DCP rank (the first TP rank
of each saves it). A handoff goes between engines of the same DCP size and interleave
(another is a miss). Prefill and decode must use the same block size. Between TP
sizes: attention heads are resliced (each decode rank loads its heads from the prefill
shards that hold them, in the classic layout and in grouped ones of full, sliding or
chunked attention; not where TP exceeds the KV heads or a backend packs head slots), an
all-MLA model needs nothing (one copy per node); a recurrent layer's state is cut as vLLM
shards it, each conv sub-projection's channels and the temporal state's heads from the
prefill ranks that hold them (:mod:`kvd.vllm_state`; where the state does not divide
evenly under both sizes, e.g. Mamba2 groups vLLM replicates, the handoff fails and the
decode engine prefills).
"""

from __future__ import annotations

import base64
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

import kvd
from kvd.vllm_classic import ClassicCopier
from kvd.vllm_groups import GroupedCopier, complete, positions, state_ids, unfilled
from kvd.vllm_layout import Geometry, KvdConfigError, geometry, request_keys, request_salt
from kvd.vllm_meta import FINAL as _FINAL
from kvd.vllm_meta import KvdConnectorMetadata, KvdHandshake, Load, Pull
from kvd.vllm_worker import _Copier, _Mover, _Step

__all__ = ["Geometry", "KvdConfigError", "KvdConnector", "KvdConnectorMetadata", "geometry", "request_salt"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

PARAMS_VERSION = 1


# --- scheduler-side state ----------------------------------------------------------


@dataclass
class _Session:
    """A worker's session for one tenant: its client, the view of the pool it mapped and
    the daemon incarnation that view maps, and the prefill shards' layouts registered in
    it ((TP size, rank) -> layout id)."""

    client: kvd.Client
    pool: torch.Tensor
    inc: int
    src_lids: dict[tuple, int] = field(default_factory=dict)


@dataclass
class _Req:
    tokens: list[int]
    keys: list[bytes]  # full prompt blocks
    tenant: Optional[str] = None  # whose session serves it (None: the credential's only tenant)
    saved: int = 0  # leading blocks known to be in kvd (saved, loaded or pulled)
    state_saved: int = 0  # the highest boundary whose state snapshot is in kvd
    matched: Optional[tuple[int, int]] = None  # (num_computed_tokens, external tokens)


@dataclass
class _Remote:
    answer: tuple[int, bool]
    transfers: list[dict[str, Any]]  # every transfer of the handoff (KV, then state)
    kv_ids: list[str] = field(default_factory=list)
    state_ids: list[str] = field(default_factory=list)
    src_tp: int = 0  # the prefill's TP size when its heads are resliced here
    started: bool = False
    tenant: Optional[str] = None  # the request's (its transfers are that session's)


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """The kvd daemon behind vLLM's KV connector interface (see the module's doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = ktc.kv_connector_extra_config or {}
        self._endpoint = extra.get("endpoint") or os.environ.get("KVD_ENDPOINT")
        self._mode = str(extra.get("mode", "pull"))
        if self._mode not in ("pull", "push"):
            raise KvdConfigError(f"kvd connector: mode must be 'pull' or 'push', not {self._mode!r}")
        self._lease_s = float(extra.get("lease_s", 30.0))
        self._pin_ttl_s = float(extra.get("pin_ttl_s", 60.0))
        self._timeout_s = float(extra.get("timeout_s", 10.0))
        # A daemon with tenants (SPEC §18): the credential this engine's sessions present
        # and the tenant they act for (default: $KVD_TENANT_TOKEN / $KVD_TENANT, which the
        # client reads itself), and where a request names its own (see request_tenant).
        self._token = extra.get("tenant_token") or None
        self._tenant = extra.get("tenant") or None
        self._tenant_from = extra.get("tenant_from") or None
        if self._tenant_from not in (None, "cache_salt", "lora"):
            raise KvdConfigError(f"kvd connector: tenant_from must be 'cache_salt' or 'lora', not {self._tenant_from!r}")
        self._tenant_map = extra.get("tenant_map") or {}
        if not isinstance(self._tenant_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in self._tenant_map.items()):
            raise KvdConfigError("kvd connector: tenant_map must map strings (salts or LoRA names) to tenant names")
        self._transfer_timeout_s = float(extra.get("transfer_timeout_s", 120.0))
        self._save = bool(extra.get("save", True))
        self._load = bool(extra.get("load", True))
        self._layerwise = bool(extra.get("layerwise", True))
        # Test knob: hold the copy of one layer's load back this long (a slow layer).
        delay = extra.get("test_delay_layer_load")
        self._delay = (int(delay[0]), float(delay[1])) if delay else None
        self._geo = geometry(vllm_config, kv_cache_config)
        if ktc.kv_load_failure_policy != "recompute":
            logger.warning(
                "kvd connector: kv_load_failure_policy is %r: a block evicted between lookup and load, or a "
                "failed handoff, fails the request; set \"kv_load_failure_policy\": \"recompute\" to recompute it",
                ktc.kv_load_failure_policy,
            )
        self._producer = ktc.is_kv_producer
        self._consumer = ktc.is_kv_consumer
        if role == KVConnectorRole.SCHEDULER:
            self._sched_init()
        else:
            self._worker_init()

    # ---------------------------------------------------------------- scheduler side

    def _sched_init(self) -> None:
        self._reqs: dict[str, _Req] = {}
        self._remote: dict[str, _Remote] = {}
        self._gave_up: set[str] = set()  # handoffs that failed: prefilled here instead
        self._pending_loads: list[Load] = []
        self._pending_pulls: list[Pull] = []
        self._pending_state_saves: list[Load] = []
        self._lids: list[int] = []
        self._slids: list[int] = []
        # A session per tenant the requests name (one without tenant_from): the daemon
        # serves each under its tenant's namespace and shares (SPEC §18).
        self._clients: dict[Optional[str], kvd.Client] = {}
        self._refused: dict[Optional[str], float] = {}  # tenant -> when its hello was refused
        self._warned: set[str] = set()
        # Pipeline stages of a grouped layout: every stage's layouts (KV, state) as its
        # workers registered them, from vLLM's handshake; None until it came.
        self._stage_layouts: Optional[tuple[list[dict], list[dict]]] = None
        if self._geo is not None:
            self._connect_sched(self._tenant)

    @property
    def _from_workers(self) -> bool:
        """Whether the layouts come from the workers (pipeline stages of a grouped layout)."""
        return bool(self._geo is not None and self._geo.grouped and self._geo.pp_size > 1)

    def request_tenant(self, request: "Request") -> Optional[str]:
        """The tenant whose session serves ``request`` (SPEC §18): with
        ``extra_config.tenant_from`` set, its ``cache_salt`` or LoRA adapter's name —
        through ``tenant_map`` where one is given (a value it lacks: the engine's tenant),
        else the value itself names the tenant; the engine's tenant (``tenant``, or the
        credential's only one) for a request without one. The daemon serves a session only
        for a tenant the engine's credential acts for, so a value that names another is
        refused there (the request runs without kvd), never served as someone else's."""
        if self._tenant_from is None:
            return self._tenant
        if self._tenant_from == "lora":
            lora = getattr(request, "lora_request", None)
            v = getattr(lora, "lora_name", None) if lora is not None else None
        else:
            v = getattr(request, "cache_salt", None)
        if not v:
            return self._tenant
        if self._tenant_map:
            return self._tenant_map.get(str(v), self._tenant)
        return str(v)

    # A tenant the daemon refused a session is asked again after this long.
    REFUSED_RETRY_S = 5.0

    def _refused_now(self, tenant: Optional[str]) -> bool:
        """Whether the daemon refused ``tenant`` a session within :attr:`REFUSED_RETRY_S`:
        its requests then run without kvd (nothing looked up, nothing saved)."""
        since = self._refused.get(tenant)
        return since is not None and time.monotonic() - since < self.REFUSED_RETRY_S

    def _connect_sched(self, tenant: Optional[str]) -> kvd.Client:
        if self._refused_now(tenant):
            raise kvd.KvdError(f"the daemon refused a session for tenant {tenant!r} (asked again in {self.REFUSED_RETRY_S:.0f} s)")
        try:
            c = kvd.Client(self._endpoint, name="vllm-scheduler", timeout_s=self._timeout_s, map_pool=False, token=self._token, tenant=tenant)
        except kvd.KvdError as e:
            if getattr(e, "code", None) == "unauthenticated":
                self._refused[tenant] = time.monotonic()
            raise
        self._refused.pop(tenant, None)
        if self._from_workers:
            lays, slays = self._stage_layouts or ([], [])
        else:
            lays = [self._geo.layout(r) for r in range(self._geo.num_layouts)]
            slays = [self._geo.state_layout(r) for r in range(self._num_state_layouts())]
        lids = [c.register_layout(x)["layout_id"] for x in lays]
        slids = [c.register_layout(x)["layout_id"] for x in slays]
        if self._clients and (lids, slids) != (self._lids, self._slids):
            # (layout ids are the layouts' digests, the same in every tenant's session)
            raise kvd.KvdError(f"tenant {tenant!r}'s session names the layouts {lids} {slids}, another's {self._lids} {self._slids}")
        self._lids, self._slids = lids, slids
        self._clients[tenant] = c
        return c

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM's engine core hands every worker's :class:`KvdHandshake` here, keyed by
        (PP stage, TP rank), before the first request: the stages' layouts of a grouped
        layout. Until every one of them came, the scheduler finds no hit and hands off
        nothing (a miss, never a load into layers it cannot name)."""
        if not self._from_workers:
            return
        g = self._geo
        lays: list[Optional[dict]] = [None] * g.num_layouts
        slays: list[Optional[dict]] = [None] * g.num_state_layouts
        for md in metadata.values():
            if not isinstance(md, KvdHandshake) or not 0 <= md.index < len(lays):
                continue
            lays[md.index] = md.layout
            if 0 <= md.state_index < len(slays):
                slays[md.state_index] = md.state_layout
        if any(x is None for x in lays + slays):
            logger.warning("kvd connector: %d of %d pipeline-stage layouts reached the scheduler; serving without kvd hits", sum(x is not None for x in lays + slays), len(lays + slays))
            return
        self._stage_layouts = (lays, slays)
        self._clients.clear()  # (each tenant's session registers the stages' layouts)
        try:
            self._connect_sched(self._tenant)
        except (kvd.KvdError, OSError) as e:
            self._warn("registering the pipeline stages' layouts", e)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, r): md for r, md in metadata.items()})

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """vLLM asks (hybrid allocator, recurrent state): may its local prefix cache report
        a full-attention hit deeper than the recurrent state it still holds? Yes where
        kvd completes it: a load brings the KV after the local hit and the state at its own
        hit's boundary, which is all a recurrent layer reads (vLLM falls back to the
        boundary every group agrees on when kvd has nothing beyond the local hit). Not
        beside sliding-window or chunked groups: their window may reach back into blocks
        the lagging local hit lacks, which a load after it would not bring."""
        g = getattr(self, "_geo", None)
        return bool(g is not None and g.grouped and g.state_groups and all(p.kind in ("full", "mla") for p in g.groups))

    @property
    def _async_loads(self) -> bool:
        """Whether local hits load asynchronously (several KV cache groups, or recurrent
        state: see :meth:`get_num_new_matched_tokens`)."""
        g = self._geo
        return bool(g is not None and g.grouped and (len(g.groups) > 1 or g.state_groups))

    def _num_state_layouts(self) -> int:
        return getattr(self._geo, "num_state_layouts", 0)

    def _sched_client(self, tenant: Optional[str]) -> kvd.Client:
        c = self._clients.get(tenant)
        return c if c is not None else self._connect_sched(tenant)

    def _drop(self, tenant: Optional[str]) -> None:
        """Forgets a tenant's session after a failure (the next call says hello again)."""
        self._clients.pop(tenant, None)

    def _warn(self, what: str, e: BaseException) -> None:
        # One line per kind of failure: a daemon that is down must not flood the log.
        key = f"{what}:{getattr(e, 'code', type(e).__name__)}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("kvd connector: %s: %s (repeats are not logged)", what, e)

    def _state(self, request: "Request") -> Optional[_Req]:
        st = self._reqs.get(request.request_id)
        if st is not None or self._geo is None:
            return st
        keys = request_keys(request, self._geo.key_tokens)
        if keys is None:
            return None  # prompt embeddings: the KV is not a function of what kvd names
        st = _Req(tokens=list(request.prompt_token_ids), keys=keys, tenant=self.request_tenant(request))
        self._reqs[request.request_id] = st
        return st

    def _prefix(self, keys: list[bytes], tenant: Optional[str]) -> int:
        c = self._sched_client(tenant)
        return min(int(c.lookup(lid, keys)["prefix"]) for lid in self._lids)

    # How many boundaries below the KV prefix a hit looks for a state snapshot.
    STATE_PROBES = 64

    def _hit(self, keys: list[bytes], tenant: Optional[str]) -> int:
        """Blocks of ``keys`` a load can serve: the KV prefix every layout holds, and for
        a model with recurrent state the longest such prefix whose boundary has a state
        snapshot in every state layout (the state of another boundary never serves)."""
        if self._from_workers and self._stage_layouts is None:
            return 0  # the stages' layouts are not known yet
        n = self._prefix(keys, tenant) if keys else 0
        if not self._slids or n == 0:
            return n
        c = self._sched_client(tenant)
        for k in range(n, max(0, n - self.STATE_PROBES), -1):
            # Probed without prefetch; the boundary chosen is then looked up (its state
            # starts coming into DRAM from NVMe, as the KV's did).
            if all(int(c.probe(sl, [keys[k - 1]])["prefix"]) == 1 for sl in self._slids):
                for sl in self._slids:
                    c.lookup(sl, [keys[k - 1]])
                return k
        return 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        b = self._geo.key_tokens
        if num_computed_tokens % b:
            return 0, False
        remote = _remote_params(request)
        if remote is not None and self._consumer:
            return self._match_remote(request, st, remote, num_computed_tokens)
        if not self._load or request.request_id in self._gave_up:
            return 0, False  # (a load that failed is recomputed: never offered again)
        usable = (len(st.tokens) - 1) // b  # at least one token must be computed here
        if usable * b <= num_computed_tokens:
            return 0, False
        try:
            hit = self._hit(st.keys[:usable], st.tenant)
        except (kvd.KvdError, OSError) as e:
            self._warn("lookup failed, serving without external hits", e)
            self._drop(st.tenant)
            return 0, False
        n = hit * b - num_computed_tokens
        if n <= 0:
            return 0, False
        st.matched = (num_computed_tokens, n)
        # With several KV cache groups (or recurrent state) loads are asynchronous: vLLM
        # then accepts a failed load only as a failed asynchronous one (failed_recving),
        # never as block-level load errors. One group loads in the step, layer by layer.
        return n, self._async_loads

    def _match_remote(self, request: "Request", st: _Req, remote: dict, num_computed: int) -> tuple[Optional[int], bool]:
        rid = request.request_id
        if rid in self._remote:
            return self._remote[rid].answer
        if rid in self._gave_up:
            return 0, False  # vLLM recomputes after a failed handoff: never retry it
        if self._from_workers and self._stage_layouts is None:
            logger.warning("kvd connector: request %s: the pipeline stages' layouts are not known yet; prefilling here", rid)
            return 0, False
        b = self._geo.key_tokens
        transfers = remote.get("transfers") or []
        state_transfers = remote.get("state_transfers") or []
        try:
            blocks = int(remote["blocks"])
            src_tp = len(transfers)
            # A prefill of another TP size: the classic layout's heads reslice here.
            reslice = (
                src_tp != self._geo.num_layouts
                and self._geo.pp_size == 1
                and all(self._geo.shards(src_tp, r) for r in range(self._geo.tp_size))
            )
            ok = (
                int(remote.get("v", 0)) == PARAMS_VERSION
                and int(remote["block_size"]) == b
                and int(remote.get("pp", 1)) == getattr(self._geo, "pp_size", 1)
                and [int(x) for x in remote.get("dcp", (1, 1))] == [self._geo.dcp_size, self._geo.dcp_interleave]
                and (src_tp == self._geo.num_layouts or reslice)
                and [int(t["rank"]) for t in transfers] == list(range(src_tp))
                # (a resliced handoff has one state snapshot per prefill rank too)
                and [int(t["rank"]) for t in state_transfers] == list(range(src_tp if reslice and self._slids else len(self._slids)))
                and 0 < blocks <= len(st.keys)
                # A recurrent state serves only at its own boundary: the whole handoff.
                and (not self._slids or blocks <= (len(st.tokens) - 1) // b)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            logger.warning("kvd connector: request %s: kv_transfer_params do not match this engine (block size, layouts per TP rank or version); prefilling here", rid)
            return 0, False
        theirs = remote.get("model")
        if theirs is not None and theirs != self._geo.model_id:
            # Their blocks are named by another model: loading by our keys would only miss.
            logger.warning(
                "kvd connector: request %s: prefill's model %s, decode's model %s: not the same weights (or model_id); prefilling here",
                rid,
                theirs,
                self._geo.model_id,
            )
            # (the prefill node's export ends with its lease: this engine cannot even
            # admit it, its layout being another model's)
            return 0, False
        usable = min(blocks, (len(st.tokens) - 1) // b)
        if usable * b <= num_computed:
            return 0, False
        accepted = []
        try:
            c = self._sched_client(st.tenant)
            lids = [c.register_layout(self._geo.layout_for(src_tp, s))["layout_id"] for s in range(src_tp)] if reslice else self._lids
            slids = [c.register_layout(self._geo.state_layout_for(src_tp, s))["layout_id"] for s in range(src_tp)] if reslice and self._slids else self._slids
            todo = [(t, lids[r], st.keys[:blocks]) for r, t in enumerate(transfers)]
            todo += [(t, slids[r], st.keys[blocks - 1 : blocks]) for r, t in enumerate(state_transfers)]
            for t, lid, keys in todo:
                if self._mode == "pull":
                    c.admit(base64.b64decode(t["params"]), ttl_s=self._pin_ttl_s)
                else:
                    c.push_register(t["transfer_id"], lid, keys, remote["node"], ttl_s=self._pin_ttl_s)
                accepted.append(t)
        except (kvd.KvdError, OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("kvd connector: request %s: could not accept the handoff (%s); prefilling here", rid, e)
            self._abort(accepted, st.tenant)
            return 0, False
        answer = (usable * b - num_computed, True)
        self._remote[rid] = _Remote(
            answer=answer,
            transfers=list(transfers) + list(state_transfers),
            kv_ids=[t["transfer_id"] for t in transfers],
            state_ids=[t["transfer_id"] for t in state_transfers],
            src_tp=src_tp if reslice else 0,
            tenant=st.tenant,
        )
        st.matched = (num_computed, answer[0])
        return answer

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens == 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None or st.matched is None:
            return
        computed, n = st.matched
        b = self._geo.key_tokens
        first, count = computed // b, min(n, num_external_tokens) // b
        if self._geo.grouped:
            ids = positions(blocks.get_block_ids(), self._geo, first, count)
        else:
            ids = list(blocks.get_block_ids()[0])[first : first + count]
        keys = st.keys[first : first + count]
        st.saved = max(st.saved, first + count)
        st.matched = None
        remote = self._remote.get(request.request_id)
        state = None
        failed = unfilled(blocks.get_block_ids(), self._geo, first, count) if self._geo.grouped else None
        if self._slids and count:
            end = first + count
            sids = state_ids(blocks.get_block_ids(), self._geo, end - 1)
            if sids is None:
                failed = f"vLLM keeps no recurrent state block at the hit's boundary ({end} blocks)"
            else:
                state = (st.keys[end - 1], sids)
                st.state_saved = max(st.state_saved, end)
        if remote is not None:
            self._pending_pulls.append(
                Pull(
                    req_id=request.request_id,
                    transfer_ids=remote.kv_ids,
                    keys=keys,
                    block_ids=ids,
                    failed=failed,
                    state=state,
                    state_transfer_ids=remote.state_ids,
                    src_tp=remote.src_tp,
                    tenant=st.tenant,
                )
            )
        elif self._async_loads:
            # A local hit loaded asynchronously: the worker's mover loads it (no transfer).
            self._pending_pulls.append(Pull(req_id=request.request_id, transfer_ids=[], keys=keys, block_ids=ids, failed=failed, state=state, tenant=st.tenant))
        else:
            self._pending_loads.append(Load(req_id=request.request_id, keys=keys, block_ids=ids, tenant=st.tenant))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvdConnectorMetadata(loads=self._pending_loads, pulls=self._pending_pulls)
        self._pending_loads, self._pending_pulls = [], []
        for p in meta.pulls:
            self._start_pull(p)
        if self._save and self._geo is not None:
            n = scheduler_output.num_scheduled_tokens
            for r in scheduler_output.scheduled_new_reqs:
                self._saves(meta, r.req_id, r.num_computed_tokens + n.get(r.req_id, 0))
            cached = scheduler_output.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                self._saves(meta, rid, cached.num_computed_tokens[i] + n.get(rid, 0))
        meta.state_saves = self._pending_state_saves
        self._pending_state_saves = []
        return meta

    def _start_pull(self, p: Pull) -> None:
        remote = self._remote.get(p.req_id)
        if remote is None or remote.started or self._mode != "pull":
            return
        remote.started = True
        try:
            c = self._sched_client(remote.tenant)
            for t in remote.transfers:
                c.pull(base64.b64decode(t["params"]), ttl_s=self._pin_ttl_s, wait=False)
        except (kvd.KvdError, OSError, ValueError) as e:
            p.failed = f"the pull did not start: {e}"

    def _saves(self, meta: KvdConnectorMetadata, rid: str, done_tokens: int) -> None:
        st = self._reqs.get(rid)
        if st is None or self._kv_cache_manager is None or self._refused_now(st.tenant):
            return
        upto = min(done_tokens, len(st.tokens)) // self._geo.key_tokens
        if upto <= st.saved:
            return
        upto = min(upto, len(st.keys))
        if self._geo.grouped:
            # Whole positions only: every group's block of each, and a prefix of them.
            ids = complete(self._kv_cache_manager.get_block_ids(rid), self._geo, st.saved, upto)
            upto = st.saved + len(ids)
        else:
            ids = list(self._kv_cache_manager.get_block_ids(rid)[0])
            upto = min(upto, len(ids))
            ids = ids[st.saved : upto]
        if upto > st.saved:
            meta.saves.append(Load(req_id=rid, keys=st.keys[st.saved : upto], block_ids=ids, tenant=st.tenant))
            st.saved = upto
        if self._slids:
            self._state_save(rid, st, done_tokens)

    def _state_save(self, rid: str, st: _Req, done_tokens: int) -> None:
        """A forward that ends exactly at a block boundary leaves the recurrent state of
        that boundary in the state groups' block there (vLLM's align mode: slot ``p`` holds
        the state after ``(p + 1) * block_size`` tokens): saved once the forward is done."""
        b = self._geo.key_tokens
        k = done_tokens // b
        if done_tokens % b or not 0 < k <= len(st.keys) or k <= st.state_saved:
            return
        sids = state_ids(self._kv_cache_manager.get_block_ids(rid), self._geo, k - 1)
        if sids is not None:
            self._pending_state_saves.append(Load(req_id=rid, keys=[st.keys[k - 1]], block_ids=[sids], tenant=st.tenant))
            st.state_saved = k

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        failed = connector_output.failed_recving or set()
        for rid in connector_output.finished_recving or ():
            remote = self._remote.pop(rid, None)
            if remote is not None:
                self._finish(remote.transfers, remote.tenant)
            if rid in failed:
                self._gave_up.add(rid)

    def _finish(self, transfers: list[dict], tenant: Optional[str]) -> None:
        """Drops the scheduler session's hold on ended transfers (pins, live imports)."""
        try:
            c = self._sched_client(tenant)
            for t in transfers:
                try:
                    s = c.transfer_status(t["transfer_id"])
                except kvd.KvdError:
                    continue
                if s.get("state") not in _FINAL:
                    c.abort(t["transfer_id"])
                elif s.get("pin") is not None:
                    c.release(s["pin"])
        except (kvd.KvdError, OSError) as e:
            self._warn("releasing a handoff", e)

    def _abort(self, transfers: list[dict], tenant: Optional[str]) -> None:
        for t in transfers:
            try:
                self._sched_client(tenant).abort(t["transfer_id"])
            except (kvd.KvdError, OSError):
                pass

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM's call with its hybrid allocator on (``SupportsHMA``): as
        :meth:`request_finished` (a handoff's blocks live in the daemon, so vLLM frees
        every group's at once)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._gave_up.discard(rid)
        remote = self._remote.get(rid)
        if remote is not None and not remote.started:
            # Admitted, never pulled (aborted while waiting): let the exporter go now.
            self._remote.pop(rid)
            self._abort(remote.transfers, remote.tenant)
        params = request.kv_transfer_params or {}
        if st is None or not self._producer or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None  # nobody decodes an aborted request
        return False, self._export(rid, st)

    def _export(self, rid: str, st: _Req) -> Optional[dict[str, Any]]:
        keys = st.keys
        if self._slids:
            # The decode side computes at least one token itself: a state snapshot serves
            # it only at a boundary it will load up to.
            keys = keys[: (len(st.tokens) - 1) // self._geo.key_tokens]
        try:
            blocks = self._hit(keys, st.tenant)
        except (kvd.KvdError, OSError) as e:
            self._warn("export lookup failed; the decode side will prefill", e)
            self._drop(st.tenant)
            return None
        if blocks == 0:
            logger.warning("kvd connector: request %s: no prompt block is in kvd; nothing to hand off", rid)
            return None
        c = self._sched_client(st.tenant)
        transfers: list[dict[str, Any]] = []
        state_transfers: list[dict[str, Any]] = []
        try:
            node = c.hello_info().get("node") or {}
            for r, lid in enumerate(self._lids):
                tid = f"{rid}.tp{r}"
                params = c.export(tid, lid, keys[:blocks], lease_s=self._lease_s)
                transfers.append({"rank": r, "transfer_id": tid, "params": base64.b64encode(params).decode()})
            for r, lid in enumerate(self._slids):
                tid = f"{rid}.state.tp{r}"
                params = c.export(tid, lid, keys[blocks - 1 : blocks], lease_s=self._lease_s)
                state_transfers.append({"rank": r, "transfer_id": tid, "params": base64.b64encode(params).decode()})
        except (kvd.KvdError, OSError) as e:
            logger.warning("kvd connector: request %s: export failed (%s); the decode side will prefill", rid, e)
            self._abort(transfers + state_transfers, st.tenant)
            return None
        extra = {"state_transfers": state_transfers} if self._slids else {}
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvd": {
                "v": PARAMS_VERSION,
                "model": self._geo.model_id,
                "blocks": blocks,
                "block_size": self._geo.key_tokens,
                "pp": getattr(self._geo, "pp_size", 1),
                "dcp": [self._geo.dcp_size, self._geo.dcp_interleave],
                "node": node.get("node"),
                "transfers": transfers,
                **extra,
            },
        }

    # ------------------------------------------------------------------- worker side

    def _worker_init(self) -> None:
        self._layers: list[torch.Tensor] = []
        self._errors: set[int] = set()
        # A session per tenant the requests name (the scheduler's request_tenant), each
        # with the view of the pool it mapped; the engine's tenant's opens at start.
        self._sessions: dict[Optional[str], _Session] = {}
        self._refused: dict[Optional[str], float] = {}  # tenant -> when its hello was refused
        self._old_pools: list[torch.Tensor] = []
        # Pool mappings (data_ptr -> kvd._device_view) on CUDA, old pools' too.
        self._mapped: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._mover: Optional[_Mover] = None
        self._copier: Optional[_Copier] = None
        self._step: Optional[_Step] = None
        self._waits_seen = False  # the model runner calls wait_for_layer_load
        self._rank = 0
        self._stage = 0
        if self._geo is not None and self._geo.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        if self._geo is not None and getattr(self._geo, "pp_size", 1) > 1:
            from vllm.distributed.parallel_state import get_pp_group

            self._stage = get_pp_group().rank_in_group
            if self._geo.grouped:
                # This worker's config holds its stage's layers: its geometry is the stage's.
                self._geo = replace(self._geo, stage=self._stage)

    @property
    def _layout_index(self) -> int:
        """This worker's layout among the scheduler's: ``stage * tp_size + rank``, or per
        stage one of a layout kept once per node."""
        return self._geo.layout_index(self._stage, self._rank)

    @property
    def _state_index(self) -> int:
        """This worker's state layout among the scheduler's (:meth:`_layout_index`'s rule)."""
        return self._geo.state_index(self._stage, self._rank)

    def get_handshake_metadata(self) -> Optional[KvdHandshake]:
        """This worker's layouts, which vLLM hands the scheduler (its stage's layers are
        known only here)."""
        g = self._geo
        if g is None or not hasattr(self, "_lid"):
            return None
        state = g.grouped and bool(g.state_groups)
        return KvdHandshake(
            index=self._layout_index,
            layout=g.layout(self._layout_index),
            state_index=self._state_index if state else -1,
            state_layout=g.state_layout(self._state_index) if state else {},
        )

    @property
    def _saves_here(self) -> bool:
        """Whether this worker stores blocks: every rank, but of a layout kept once per
        node (MLA; per DCP rank under decode-context parallelism) its first rank only."""
        g = self._geo
        return not (g is not None and g.grouped and not g.saves(self._rank))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        g = self._geo
        if g is None:
            return
        if g.grouped:
            lacks = g.stage_holds()
            if lacks:
                raise KvdConfigError(f"kvd connector: pipeline stage {self._stage} holds {lacks}: its blocks would be empty (use another pipeline split)")
            self._gcopy = GroupedCopier(g, kv_caches, rows=self._rows)
            self._scopy = GroupedCopier(g, kv_caches, state=True, rows=self._rows) if g.state_groups else None
            self._paged: Any = self._gcopy
        else:
            if g.pp_size > 1 and len(g.layer_names) != g.stage_layers[self._stage]:
                raise KvdConfigError(
                    f"kvd connector: pipeline stage {self._stage} holds {len(g.layer_names)} layers, vLLM's partition says {g.stage_layers[self._stage]}"
                )
            self._paged = ClassicCopier(g, kv_caches, rows=self._rows)
        self._layers = self._paged.tensors()
        self._layer_index = dict(self._paged.index)
        self._device = self._paged.device
        self._connect_worker(self._tenant)
        self._mover = _Mover(self)
        self._mover.start()
        self._copier = _Copier(self._device)

    def _connect_worker(self, tenant: Optional[str]) -> _Session:
        """Opens the worker's session for ``tenant`` (registers its layouts in that
        tenant's namespace, maps the pool). Layout ids are the layouts' digests: every
        tenant's session names the same ones."""
        c = kvd.Client(self._endpoint, name=f"vllm-worker-tp{self._rank}", timeout_s=self._timeout_s, token=self._token, tenant=tenant)
        info = c.register_layout(self._geo.layout(self._layout_index))
        if info["block_bytes"] != self._geo.block_bytes:
            raise KvdConfigError(f"kvd connector: the daemon sizes a block at {info['block_bytes']} bytes, the cache at {self._geo.block_bytes}")
        slid = None
        if self._geo.grouped and self._geo.state_groups:
            sinfo = c.register_layout(self._geo.state_layout(self._state_index))
            if sinfo["block_bytes"] != self._geo.state_bytes:
                raise KvdConfigError(f"kvd connector: the daemon sizes a state snapshot at {sinfo['block_bytes']} bytes, the cache at {self._geo.state_bytes}")
            slid = sinfo["layout_id"]
        if hasattr(self, "_lid") and (info["layout_id"], slid) != (self._lid, self._slid):
            raise kvd.KvdError(f"tenant {tenant!r}'s session names layout {info['layout_id']}, another's {self._lid}")
        self._lid, self._slid = info["layout_id"], slid
        pool = kvd.torch_pool(c, register_cuda=self._device.type == "cuda")
        self._map(pool)
        s = self._sessions[tenant] = _Session(c, pool, c.incarnation)
        return s

    def _session(self, tenant: Optional[str]) -> tuple[kvd.Client, torch.Tensor, int]:
        """The session for ``tenant``: its client, the pool view and the incarnation that
        view maps, read together (the mover thread shares them)."""
        with self._lock:
            s = self._sessions.get(tenant)
            if s is None:
                since = self._refused.get(tenant)
                if since is not None and time.monotonic() - since < self.REFUSED_RETRY_S:
                    raise kvd.KvdError(f"the daemon refused a session for tenant {tenant!r}")
                try:
                    s = self._connect_worker(tenant)
                except kvd.KvdError as e:
                    if getattr(e, "code", None) == "unauthenticated":
                        self._refused[tenant] = time.monotonic()
                    raise
            elif s.client.incarnation != s.inc:
                # The daemon restarted (the client said so once, with DaemonRestarted, and
                # mapped the new pool): view the new mapping. The old view stays referenced,
                # so a page-locked mapping is never unmapped under CUDA.
                self._old_pools.append(s.pool)
                s.pool = kvd.torch_pool(s.client, register_cuda=self._device.type == "cuda")
                self._map(s.pool)
                s.inc = s.client.incarnation
                s.src_lids.clear()
            return s.client, s.pool, s.inc

    def _client_w(self, tenant: Optional[str]) -> kvd.Client:
        return self._session(tenant)[0]

    def _src_lid(self, tenant: Optional[str], key: tuple, layout: dict) -> int:
        """The layout id of a prefill's shard (``key``: its TP size and rank), registered
        once in ``tenant``'s session."""
        s = self._sessions[tenant]
        lid = s.src_lids.get(key)
        if lid is None:
            lid = s.src_lids[key] = s.client.register_layout(layout)["layout_id"]
        return lid

    def _map(self, pool: torch.Tensor) -> None:
        """On CUDA, keeps the pool's device mapping, through which one kernel moves all
        pieces of a copy (:meth:`kvd.vllm_classic.ClassicCopier.read_pool`, ``write_pool``)."""
        if self._device.type != "cuda":
            return
        with torch.cuda.device(self._device):
            v = kvd._device_view(pool)
        if v is not None and v.device == self._device:
            self._mapped[pool.data_ptr()] = v

    def _rows(self, pool: torch.Tensor, starts: list[int], length: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The pool as rows of ``u`` bytes (the largest power of two up to 4 KiB that
        divides every start and the length) and the indices of the rows that cover
        ``[s, s + length)`` for each ``s`` in ``starts``, in order: what one
        ``index_select``/``index_copy_`` moves. The rows are the pool's device mapping on
        CUDA, the pool itself on the CPU (the tests' staged path); None where there is no
        mapping or the pieces are not 8-byte aligned (then one DMA per slot)."""
        view = pool if pool.device == self._device else self._mapped.get(pool.data_ptr())
        if view is None or view.data_ptr() % 8:
            return None
        g = length
        for st in starts:
            g = math.gcd(g, st)
        u = min(4096, g & -g)
        if u < 8:
            return None
        rows = view[: view.numel() - view.numel() % u].view(torch.int64).view(-1, u // 8)
        first = torch.tensor(starts, dtype=torch.long).to(view.device) // u
        idx = (first[:, None] + torch.arange(length // u, device=view.device)).reshape(-1)
        return rows, idx

    def _load_layer(self, pool: torch.Tensor, offs: list[int], block_ids: list[Any], l: int) -> None:
        """Layer ``l`` of pool slots ``offs`` → the paged cache's blocks ``block_ids``."""
        self._paged.load_layer(pool, offs, block_ids, l)

    def _save_layer(self, pool: torch.Tensor, offs: list[int], block_ids: list[Any], l: int) -> None:
        """Layer ``l`` of the paged cache's blocks ``block_ids`` → pool slots ``offs``."""
        self._paged.save_layer(pool, offs, block_ids, l)

    def _copy_in(self, pool: torch.Tensor, offs: list[int], block_ids: list[Any]) -> None:
        """Pool slots ``offs`` → the paged cache's blocks ``block_ids``, finished."""
        self._paged.copy_in(pool, offs, block_ids)
        self._sync()

    def _copy_out(self, pool: torch.Tensor, offs: list[int], block_ids: list[Any]) -> None:
        """The paged cache's blocks ``block_ids`` → pool slots ``offs``, finished."""
        self._paged.copy_out(pool, offs, block_ids)
        self._sync()

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _load_resliced(self, tenant: Optional[str], keys: list[bytes], block_ids: list[int], src_tp: int, shards: list[tuple[int, int, int, int]]) -> int:
        """Loads the leading blocks every source shard holds into ``block_ids``, this
        rank's heads cut from the shards of a TP-``src_tp`` engine's layouts (``shards``:
        :meth:`Geometry.shards`), through ``tenant``'s session; how many it loaded. One
        copy per piece."""
        g = self._geo
        client, pool, inc = self._session(tenant)
        pins = []
        try:
            offsets = []
            lids = []
            for s, *_ in shards:
                lids.append(self._src_lid(tenant, (src_tp, s), g.layout_for(src_tp, s)))
                pin = client.get(lids[-1], keys, ttl_s=self._pin_ttl_s)
                pins.append(pin)
                offsets.append(pin.offsets)
            if client.incarnation != inc:
                raise kvd.KvdError("the daemon restarted; the load is retried as a recompute")
            good = min(kvd.vouched_prefix(client, lid, keys, pin) for lid, pin in zip(lids, pins))
            self._paged.copy_resliced(pool, src_tp, shards, [offs[:good] for offs in offsets], block_ids[:good])
            self._sync()
            return good
        finally:
            for pin in pins:
                pin.release()

    def _load_pinned(self, tenant: Optional[str], keys: list[bytes], block_ids: list[int]) -> int:
        """Loads the leading blocks kvd holds into ``block_ids`` through ``tenant``'s
        session; how many it loaded."""
        client, pool, inc = self._session(tenant)
        pin = client.get(self._lid, keys, ttl_s=self._pin_ttl_s)
        try:
            if client.incarnation != inc:
                # Offsets of another daemon incarnation than the mapping: never read them.
                raise kvd.KvdError("the daemon restarted; the load is retried as a recompute")
            offs = pin.offsets
            good = kvd.vouched_prefix(client, self._lid, keys, pin)
            if good:
                self._copy_in(pool, offs[:good], block_ids[:good])
            return good
        finally:
            pin.release()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata() or self._geo is None or not self._layers:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdConnectorMetadata)
        if self._step is not None:
            # The last step's wait_for_save never came (vLLM always calls it; a caller
            # that does not): its copies end, its pins go, its saves commit nothing.
            self._step.abandon()
        self._step = None
        if self._layerwise and (meta.loads or meta.saves):
            self._step = _Step(self, meta)
            for p in meta.pulls:
                self._mover.submit(p)
            return
        for ld in meta.loads:
            try:
                good = self._load_pinned(ld.tenant, ld.keys, ld.block_ids)
            except (kvd.KvdError, OSError) as e:
                logger.warning("kvd connector: load of request %s failed: %s", ld.req_id, e)
                good = 0
            if good < len(ld.block_ids):
                self._load_errors(ld.block_ids[good:])
        for p in meta.pulls:
            self._mover.submit(p)

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is not None:
            self._waits_seen = True
            step.wait_load(self._layer_index.get(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        step = self._step
        if step is not None:
            step.save(self._layer_index.get(layer_name))

    def wait_for_save(self):
        if not self.has_connector_metadata() or not self._layers:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdConnectorMetadata)
        step, self._step = self._step, None
        if step is not None:
            step.finish()
        else:
            for s in meta.saves if self._saves_here else ():
                try:
                    self._save_blocks(s)
                except (kvd.KvdError, OSError) as e:
                    # A save that fails is a future miss, never a wrong hit: nothing was committed.
                    logger.debug("kvd connector: save of request %s skipped: %s", s.req_id, e)
        for s in meta.state_saves if self._state_saves_here else ():
            try:
                self._save_state(s)
            except (kvd.KvdError, OSError) as e:
                logger.debug("kvd connector: state snapshot of request %s skipped: %s", s.req_id, e)

    @property
    def _state_saves_here(self) -> bool:
        g = self._geo
        return getattr(self, "_scopy", None) is not None and not (g.state_replicated and self._rank != 0)

    def _save_state(self, s: Load) -> None:
        """A recurrent state snapshot (the forward is done: the state groups' blocks hold
        the state of the boundary) into kvd: one object, all state layers, committed whole."""

        def copy(pool: torch.Tensor, offs: list[int], ids: list[Any]) -> None:
            self._scopy.copy_out(pool, offs, ids)
            self._sync()

        self._store(self._slid, s, copy)

    def _load_state_resliced(self, tenant: Optional[str], key: bytes, ids: tuple[int, ...], src_tp: int) -> bool:
        """The snapshot ``key`` of a TP-``src_tp`` prefill: this rank's part of every state
        page cut from the source ranks' snapshots that hold it
        (:meth:`kvd.vllm_groups.GroupedGeometry.state_shards`); whether kvd had them all."""
        from kvd.vllm_state import reslice

        g = self._geo
        plan = g.state_shards(src_tp, self._rank)
        if plan is None:
            return False
        sources = sorted({s for _, cuts in plan for cut in cuts for s, *_ in cut})
        client, pool, inc = self._session(tenant)
        pins = {}
        try:
            for s in sources:
                lid = self._src_lid(tenant, ("state", src_tp, s), g.state_layout_for(src_tp, s))
                pin = pins[s] = client.get(lid, [key], ttl_s=self._pin_ttl_s)
                if client.incarnation != inc:
                    raise kvd.KvdError("the daemon restarted; the load is retried as a recompute")
                if not pin.offsets or not kvd.vouched(client, lid, [key], pin)[0]:
                    return False
            for gi, dplan in enumerate(g.state_groups):
                splan, cuts = plan[gi]
                for layer, name in enumerate(dplan.layer_names):
                    t = self._scopy.layers[self._scopy.index[name]][1]
                    dst = t[ids[gi]].view(torch.uint8).view(-1)
                    for s in sources:
                        at = pins[s].offsets[0] + splan.offset + layer * splan.layer_bytes
                        mine = [[c for c in cut if c[0] == s] for cut in cuts]
                        reslice(dplan.split, dst, splan.split, pool[at : at + splan.layer_bytes], mine)
            self._sync()
            return True
        finally:
            for pin in pins.values():
                pin.release()

    def _load_state(self, tenant: Optional[str], key: bytes, ids: tuple[int, ...]) -> bool:
        """The snapshot ``key`` into the state groups' blocks ``ids`` through ``tenant``'s
        session; whether kvd had it."""
        client, pool, inc = self._session(tenant)
        pin = client.get(self._slid, [key], ttl_s=self._pin_ttl_s)
        try:
            if client.incarnation != inc:
                raise kvd.KvdError("the daemon restarted; the load is retried as a recompute")
            off = pin.offsets[0] if pin.offsets else None
            if off is None or not kvd.vouched(client, self._slid, [key], pin)[0]:
                return False
            self._scopy.copy_in(pool, [off], [ids])
            self._sync()
            return True
        finally:
            pin.release()

    def _save_blocks(self, s: Load) -> None:
        self._store(self._lid, s, self._copy_out)

    def _store(self, lid: int, s: Load, copy_out: Any) -> None:
        """Allocates ``s.keys`` under layout ``lid``, copies the blocks kvd lacks in
        (``copy_out(pool, offsets, block ids)``) and commits; on any failure nothing is
        committed (a future miss, never a wrong hit)."""
        client, pool, inc = self._session(s.tenant)
        batch = client.alloc(lid, s.keys)
        try:
            if client.incarnation != inc:
                raise kvd.KvdError("the daemon restarted; this save is skipped")
            todo = [(i, off) for i, (state, off) in enumerate(zip(batch.status, batch.offsets)) if state == "new" and off is not None]
            if todo:
                copy_out(pool, [off for _, off in todo], [s.block_ids[i] for i, _ in todo])
            batch.commit()
        except BaseException:
            batch.abort()
            raise

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM 0.33's call: finished handoffs, the failed ones also in ``failed_recving``
        (vLLM then recomputes the request). Nothing is ever sent asynchronously: the
        prefill side's blocks live in the daemon, so vLLM frees its own at once."""
        done, failed = self._mover.take() if self._mover is not None else (set(), set())
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def _load_errors(self, ids: list[Any]) -> None:
        """Reports blocks whose load failed (vLLM recomputes them). A grouped layout's
        positions are tuples of one group's block (sync loads are single-group only);
        the null block is never reported."""
        self._errors.update(b for x in ids for b in (x if isinstance(x, tuple) else (x,)) if b)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self):
        if getattr(self, "_mover", None) is not None:
            self._mover.stop()
        if getattr(self, "_copier", None) is not None:
            self._copier.stop()


def _remote_params(request: "Request") -> Optional[dict]:
    p = request.kv_transfer_params
    if isinstance(p, dict) and p.get("do_remote_prefill") and isinstance(p.get("kvd"), dict):
        return p["kvd"]
    return None
