"""What the vLLM connector's scheduler side tells its workers each step (pickled by vLLM
into the step's metadata): loads, saves, handoffs and recurrent state snapshots; and what
each worker tells the scheduler once at start (its layouts: vLLM's handshake metadata).
See :mod:`kvd.vllm_connector`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

# Transfer states after which a transfer moves nothing more.
FINAL = {"done", "failed", "aborted", "expired"}


@dataclass
class Load:
    req_id: str
    keys: list[bytes]
    block_ids: list[Any]  # per position: a block id (classic) or one per group (grouped)
    tenant: Optional[str] = None  # the request's tenant: whose session moves it (SPEC §18)


@dataclass
class Pull:
    req_id: str
    transfer_ids: list[str]  # per TP rank
    keys: list[bytes]  # this engine's keys of the blocks to load
    block_ids: list[Any]  # as in Load
    failed: Optional[str] = None  # the pull could not even start
    # A model with recurrent state: the snapshot at the hit's boundary (its key and the
    # state groups' block ids there), and its transfers per state layout in a handoff.
    state: Optional[tuple[bytes, tuple[int, ...]]] = None
    state_transfer_ids: list[str] = field(default_factory=list)
    # A prefill engine of another TP size (classic layout): its TP size; each rank loads
    # its heads from the shards that hold them.
    src_tp: int = 0
    tenant: Optional[str] = None  # as in Load


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Load] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    # Recurrent state snapshots this step's forward leaves at a block boundary (one key,
    # the state groups' block ids there), saved once the forward is done.
    state_saves: list[Load] = field(default_factory=list)


@dataclass
class KvdHandshake(KVConnectorHandshakeMetadata):
    """A worker's layouts, as it registered them (``get_handshake_metadata``: vLLM's
    engine core gathers them from every worker after the KV caches are registered and
    hands them to the scheduler-side connector, keyed by (PP stage, TP rank)). Pipeline
    stages of a grouped layout need it: a stage's blocks hold the layers vLLM projected
    onto that stage, which only its worker knows."""

    index: int  # the layout's index among the scheduler's (stage, then rank)
    layout: dict[str, Any]
    state_index: int = -1  # the state layout's index, -1 without recurrent state
    state_layout: dict[str, Any] = field(default_factory=dict)
