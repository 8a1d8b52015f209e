"""The vLLM connector's worker-side machinery: the mover thread that lands handoffs and
asynchronous loads, the copier (a thread on CPU, a stream on CUDA) that runs a step's
layer copies beside the forward, and one step's layer-wise loads and saves. See
:mod:`kvd.vllm_connector`, whose ``KvdConnector`` these serve."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.logger import init_logger

import kvd
from kvd.vllm_meta import FINAL as _FINAL
from kvd.vllm_meta import KvdConnectorMetadata, Load, Pull

if TYPE_CHECKING:
    from kvd.vllm_connector import KvdConnector

logger = init_logger(__name__)


class _Mover(threading.Thread):
    """The worker's handoff thread: waits for each admitted transfer to land in this
    node's pool, then loads its blocks (by this engine's own keys) into the paged cache on
    a stream of its own, through the worker's client (thread-safe) and mapping. The blocks belong to a request vLLM holds back until it is
    reported, so nothing else reads or writes them meanwhile."""

    def __init__(self, conn: KvdConnector):
        super().__init__(name="kvd-connector-mover", daemon=True)
        self._conn = conn
        self._jobs: "queue.Queue[Optional[Pull]]" = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._stream = torch.cuda.Stream(conn._device) if conn._device.type == "cuda" else None

    def submit(self, p: Pull) -> None:
        self._jobs.put(p)

    def stop(self) -> None:
        self._jobs.put(None)

    def take(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def run(self) -> None:
        while True:
            p = self._jobs.get()
            if p is None:
                return
            try:
                ok = self._move(p)
            except Exception as e:  # never lose the request: report it failed
                logger.warning("kvd connector: handoff of request %s failed: %s", p.req_id, e)
                ok = False
            with self._lock:
                (self._done if ok else self._failed).add(p.req_id)

    def _move(self, p: Pull) -> bool:
        conn = self._conn
        if p.failed:
            logger.warning("kvd connector: request %s: %s; recomputing", p.req_id, p.failed)
            return False
        deadline = time.monotonic() + conn._transfer_timeout_s
        if p.src_tp:
            return self._move_resliced(p, deadline)
        # A layout kept once per node has one transfer for every rank.
        tid = p.transfer_ids[conn._layout_index if len(p.transfer_ids) > 1 else 0] if p.transfer_ids else None
        stid = p.state_transfer_ids[conn._state_index if len(p.state_transfer_ids) > 1 else 0] if p.state_transfer_ids else None
        for t in (tid, stid):
            if t is not None and not self._landed(p, t, deadline):
                return False
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                good = conn._load_pinned(p.tenant, p.keys, p.block_ids)
                self._stream.synchronize()
        else:
            good = conn._load_pinned(p.tenant, p.keys, p.block_ids)
        if good < len(p.block_ids):
            if tid is not None:
                logger.warning("kvd connector: request %s: %d of %d handed-off blocks are not this prompt's; recomputing", p.req_id, len(p.block_ids) - good, len(p.block_ids))
            else:
                logger.warning("kvd connector: request %s: only %d of %d blocks are still in kvd since the lookup and intact; recomputing", p.req_id, good, len(p.block_ids))
            return False
        if p.state is not None and not conn._load_state(p.tenant, *p.state):
            logger.warning("kvd connector: request %s: the recurrent state at the hit's boundary is not in kvd; recomputing", p.req_id)
            return False
        return True

    def _move_resliced(self, p: Pull, deadline: float) -> bool:
        """A handoff from a prefill engine of another TP size: this rank's heads from the
        shards that hold them, each shard's transfer waited for."""
        conn = self._conn
        shards = conn._geo.shards(p.src_tp, conn._rank)
        if not shards or len(p.transfer_ids) != p.src_tp:
            logger.warning("kvd connector: request %s: cannot reslice TP %d shards to rank %d; recomputing", p.req_id, p.src_tp, conn._rank)
            return False
        for s, *_ in shards:
            if not self._landed(p, p.transfer_ids[s], deadline):
                return False
        if p.state is not None:
            # The recurrent state: every source rank's snapshot holds a part of this rank's.
            if len(p.state_transfer_ids) != p.src_tp:
                logger.warning("kvd connector: request %s: %d state snapshots for a TP-%d prefill; recomputing", p.req_id, len(p.state_transfer_ids), p.src_tp)
                return False
            for tid in p.state_transfer_ids:
                if not self._landed(p, tid, deadline):
                    return False
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            good = conn._load_resliced(p.tenant, p.keys, p.block_ids, p.src_tp, shards)
            state_ok = good == len(p.block_ids) and (p.state is None or conn._load_state_resliced(p.tenant, *p.state, p.src_tp))
            if self._stream is not None:
                self._stream.synchronize()
        if good < len(p.block_ids):
            logger.warning("kvd connector: request %s: %d of %d handed-off blocks are not this prompt's; recomputing", p.req_id, len(p.block_ids) - good, len(p.block_ids))
            return False
        if not state_ok:
            logger.warning("kvd connector: request %s: the recurrent state at the handoff's boundary did not land whole; recomputing", p.req_id)
            return False
        return True

    def _landed(self, p: Pull, tid: str, deadline: float) -> bool:
        """Waits until transfer ``tid`` is done; False (logged) when it ended otherwise or
        the deadline passed."""
        conn = self._conn
        pause = 0.001
        while True:
            # Another session's transfer: the reply comes at once, with its state.
            state = conn._client_w(p.tenant).transfer_status(tid).get("state")
            if state == "done":
                break
            if state in _FINAL:
                logger.warning("kvd connector: request %s: handoff %s ended %s; recomputing", p.req_id, tid, state)
                return False
            if time.monotonic() > deadline:
                logger.warning("kvd connector: request %s: handoff %s still %s after %.0f s; recomputing", p.req_id, tid, state, conn._transfer_timeout_s)
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return True


class _Copier:
    """Where a step's layer copies run beside the forward: on CPU a thread of its own
    (torch copies release the GIL), on CUDA a stream of its own. Work is queued in order;
    each item may set an event (a ``threading.Event`` on CPU, a recorded ``torch.cuda.Event``
    on CUDA) that a wait for that layer uses."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._device = device
        if self.cuda:
            self._stream = torch.cuda.Stream(device)
        else:
            self._jobs: "queue.Queue[Optional[Any]]" = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="kvd-connector-copier", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def submit(self, fn, after: Optional[Any] = None) -> Any:
        """Runs ``fn`` after what was queued before (on CUDA also after the current
        stream's work so far, when ``after`` is True); returns its completion event."""
        if self.cuda:
            if after:
                self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                fn()
                ev = torch.cuda.Event()
                ev.record(self._stream)
            return ev
        ev = threading.Event()

        def job():
            try:
                fn()
            finally:
                ev.set()

        self._jobs.put(job)
        return ev

    def wait(self, ev: Any) -> None:
        """The forward waits for ``ev``: on CUDA its stream does (no host wait)."""
        if self.cuda:
            torch.cuda.current_stream(self._device).wait_event(ev)
        else:
            ev.wait()

    def drain(self) -> None:
        """Every queued copy has finished (the host waits)."""
        if self.cuda:
            self._stream.synchronize()
        else:
            self.submit(lambda: None).wait()

    def stop(self) -> None:
        if not self.cuda:
            self._jobs.put(None)


class _Step:
    """One forward's layer-wise loads and saves (module doc). Loads: pinned at the start,
    copied layer by layer on the copier, each layer waited for by the layer that reads
    it; a failure reports the request's blocks as load errors and never leaves a wait
    hanging. Saves: reserved at the start, each layer copied once the forward wrote it,
    committed at the end; a failure commits nothing (a future miss, never a wrong hit)."""

    def __init__(self, conn: "KvdConnector", meta: KvdConnectorMetadata):
        self.c = conn
        self.nl = len(conn._layers)
        self.pins: list[Any] = []
        self.loads: list[tuple[Any, list[int], list[int], list[int]]] = []  # (pool view, offs, block ids, all ids)
        self.load_failed = False
        self.waited = [False] * self.nl
        self.saves: list[tuple[Any, Load, Any, list[int], list[int]]] = []  # (batch, load, pool view, offs, ids)
        self.saved = [False] * self.nl
        self.save_failed: Optional[BaseException] = None
        # Each request moves through its tenant's session (and that session's pool view).
        sessions: dict[Optional[str], Any] = {}

        def session(tenant: Optional[str]) -> tuple[Any, Any, int]:
            if tenant not in sessions:
                try:
                    sessions[tenant] = conn._session(tenant)
                except (kvd.KvdError, OSError) as e:
                    logger.warning("kvd connector: no daemon session for tenant %r this step: %s", tenant, e)
                    sessions[tenant] = None
            if sessions[tenant] is None:
                raise kvd.KvdError("no daemon")
            return sessions[tenant]

        for ld in meta.loads:
            good = 0
            try:
                client, pool, inc = session(ld.tenant)
                pin = client.get(conn._lid, ld.keys, ttl_s=conn._pin_ttl_s)
                self.pins.append(pin)
                if client.incarnation != inc:
                    raise kvd.KvdError("the daemon restarted; the load is retried as a recompute")
                offs = pin.offsets
                good = kvd.vouched_prefix(client, conn._lid, ld.keys, pin)
                if good:
                    self.loads.append((pool, offs[:good], ld.block_ids[:good], ld.block_ids))
            except (kvd.KvdError, OSError) as e:
                logger.warning("kvd connector: load of request %s failed: %s", ld.req_id, e)
            if good < len(ld.block_ids):
                conn._load_errors(ld.block_ids[good:])
        for sv in meta.saves if conn._saves_here else ():
            try:
                client, pool, inc = session(sv.tenant)
                batch = client.alloc(conn._lid, sv.keys)
                if client.incarnation != inc:
                    batch.abort()
                    raise kvd.KvdError("the daemon restarted; this save is skipped")
                todo = [(i, off) for i, (st, off) in enumerate(zip(batch.status, batch.offsets)) if st == "new" and off is not None]
                self.saves.append((batch, sv, pool, [o for _, o in todo], [sv.block_ids[i] for i, _ in todo]))
            except (kvd.KvdError, OSError) as e:
                logger.debug("kvd connector: save of request %s skipped: %s", sv.req_id, e)
        # Every layer's load is queued now, in layer order: layer i lands while the
        # layers before it compute.
        self.events = [self._load_job(l) for l in range(self.nl)] if self.loads else []

    def _load_job(self, l: int) -> Any:
        c = self.c

        def run():
            if self.load_failed:
                return
            try:
                if c._delay is not None and c._delay[0] == l:
                    time.sleep(c._delay[1])
                for pool, offs, ids, _ in self.loads:
                    c._load_layer(pool, offs, ids, l)
            except Exception as e:  # a wait must never hang on it: report, and go on
                logger.warning("kvd connector: loading layer %d failed: %s", l, e)
                self.load_failed = True

        # On CUDA the first load follows the current stream's work so far.
        return c._copier.submit(run, after=l == 0)

    def wait_load(self, l: Optional[int]) -> None:
        if l is None or not self.events:
            return
        self.waited[l] = True
        self.c._copier.wait(self.events[l])

    def save(self, l: Optional[int]) -> None:
        if l is None or not self.saves or self.saved[l]:
            return
        self.saved[l] = True
        c = self.c

        def run():
            if self.save_failed is not None:
                return
            try:
                for _, _, pool, offs, ids in self.saves:
                    if offs:
                        c._save_layer(pool, offs, ids, l)
            except Exception as e:
                self.save_failed = e

        # On CUDA the copy must follow the forward's writes of this layer.
        c._copier.submit(run, after=True)

    def abandon(self) -> None:
        self.c._copier.drain()
        self._release(commit=False)

    def _release(self, commit: bool) -> None:
        """Lets the pins go; commits the saves (``commit``, and every copy went in) or
        gives their slots back."""
        for pin in self.pins:
            try:
                pin.release()
            except (kvd.KvdError, OSError):
                pass
        for batch, sv, _, _, _ in self.saves:
            try:
                if not commit:
                    raise kvd.KvdError("the step was abandoned")
                if self.save_failed is not None:
                    raise kvd.KvdError(f"copying into the slots failed: {self.save_failed}")
                batch.commit()
            except (kvd.KvdError, OSError) as e:
                logger.debug("kvd connector: save of request %s skipped: %s", sv.req_id, e)
                try:
                    batch.abort()
                except (kvd.KvdError, OSError):
                    pass

    def finish(self) -> None:
        c = self.c
        for l in range(self.nl):
            self.save(l)  # layers the model runner did not hand over: saved now
        c._copier.drain()
        if self.loads:
            if self.load_failed:
                for *_, ids in self.loads:
                    c._load_errors(ids)
            elif not all(self.waited):
                # The forward may have read a layer before it landed: recompute.
                for *_, ids in self.loads:
                    c._load_errors(ids)
                if c._layerwise and not c._waits_seen:
                    logger.warning(
                        "kvd connector: the model runner does not call wait_for_layer_load: "
                        "loading whole blocks before the forward from now on"
                    )
                    c._layerwise = False
        self._release(commit=True)
