"""The kvd vLLM connector inside vLLM 0.33's own scheduler, against real daemons.

argv: PREFILL_ENDPOINT DECODE_ENDPOINT DOOMED_ENDPOINT DOOMED_PID KVD_BINARY
(the third daemon is a prefill node this script kills mid-handoff; with the binary it
starts and restarts a daemon of its own).
Run by daemon/tests/vllm_connector.rs. Prints "N passed, M failed".
"""

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import vllm_engine as ve  # noqa: E402
from checks import caught, check, checkpoint, expired, run, start_daemon  # noqa: E402

import kvd  # noqa: E402
import torch  # noqa: E402
from kvd.vllm_connector import KvdConfigError, KvdConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

P, D, DOOMED, DOOMED_PID, KVD_BIN = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
_n = [0]


RUN = int.from_bytes(os.urandom(4), "little")  # daemons may outlive a run: fresh prompts


def prompt(seed, n=100):
    return [(RUN + seed * 7919 + 13 * t) % 997 + 1 for t in range(n)]


def prefilled(e, r, n):
    """Steps until ``r`` computed its ``n`` prompt tokens (its blocks still allocated)."""
    if e.scheduler.requests[r].num_computed_tokens < n:
        e.run(lambda so, out: e.scheduler.requests[r].num_computed_tokens >= n)


def rid(tag):
    _n[0] += 1
    return f"{tag}-{os.getpid()}-{_n[0]}"


def finished(e, r):
    return lambda so, out: r in e.outputs and e.outputs[r].finish_reason is not None


first_schedule = ve.first_schedule


def step_reports(e, so, r, bad):
    """The worker's output of step ``so`` for request ``r`` (no token sampled), with
    ``bad`` as the blocks whose load failed, handed to vLLM's scheduler."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    mro = ModelRunnerOutput(req_ids=[r], req_id_to_index={r: 0}, sampled_token_ids=[[]],
                            kv_connector_output=KVConnectorOutput(invalid_block_ids=bad))
    e.scheduler.update_from_output(so, mro)


@check("prefix caching: a prompt kvd holds is scheduled with its blocks as external hits and loads byte-identical KV")
def _():
    toks = prompt(1)
    a = ve.Engine(P)
    r1 = rid("a")
    a.add(r1, toks)
    computed, n = first_schedule(a, r1)
    assert (computed, n) == (0, 100), "a cold prompt: nothing external"
    a.run(finished(a, r1))
    # A second engine on the same node (fresh, zeroed KV cache): the 6 full prompt blocks
    # (96 tokens; the 7th is partial) come from kvd; vLLM computes the last 4 tokens.
    b = ve.Engine(P)
    r2 = rid("b")
    b.add(r2, toks)
    computed, n = first_schedule(b, r2)
    assert (computed, n) == (96, 4), (computed, n)
    assert not (b.computed_by_forward[r2] & set(range(96))), "loaded positions were not recomputed"
    b.check_blocks(r2, toks, 6)
    b.run(finished(b, r2))
    # A prompt that shares three blocks, then differs: three blocks hit.
    c = ve.Engine(P)
    r3 = rid("c")
    t3 = toks[:48] + prompt(2, 60)
    c.add(r3, t3)
    assert first_schedule(c, r3) == (48, 60)
    c.check_blocks(r3, t3, 3)
    for e in (a, b, c):
        e.close()


def layerwise_hit(delay, wait_layers, **extra):
    """A prompt saved layer by layer by one engine, then loaded by a second one whose
    layer-1 load is held back ``delay`` s; its "attention" records, per layer, whether the
    prefix it reads is the prompt's. Returns (per-layer results, the step's connector
    output, the engine, its request, the tokens)."""
    toks = prompt(40 + int(delay * 100) + int(wait_layers))
    a = ve.Engine(P, **extra)
    r1 = rid("lw-a")
    a.add(r1, toks)
    a.run(finished(a, r1))
    a.close()
    b = ve.Engine(P, test_delay_layer_load=[1, delay], **extra)
    r2 = rid("lw-b")
    b.add(r2, toks)
    seen = {}

    def attention(so, layer):
        if any(r.req_id == r2 for r in so.scheduled_new_reqs):
            seen[layer] = b.layer_holds(r2, toks, 6, layer)

    for _ in range(50):
        so, out = b.step(wait_layers=wait_layers, on_layer=attention)
        if seen:
            return seen, so, out, b, r2, toks
        time.sleep(0.005)
    raise AssertionError("the request was never scheduled")


@check("layer-wise loads: each layer's prefix is in place when its layer runs, a slow layer is waited for, and saves made layer by layer load byte-identical")
def _():
    seen, so, out, b, r, toks = layerwise_hit(0.3, True)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 96
    assert seen == {0: True, 1: True}, seen
    assert not out.invalid_block_ids, out.invalid_block_ids
    b.check_blocks(r, toks, 6)
    b.close()


@check("negative control: a runner that does not wait for a slow layer reads stale KV; the connector reports the blocks and vLLM recomputes them")
def _():
    seen, so, out, b, r, toks = layerwise_hit(0.3, False)
    assert seen[1] is False, f"the slow layer was read in place without waiting: {seen}"
    ids = b.block_ids(r)
    assert set(ids[:6]) <= set(out.invalid_block_ids or ()), (out.invalid_block_ids, ids)
    # vLLM takes the report: the request recomputes those blocks with its own KV.
    prefilled(b, r, 100)
    b.check_blocks(r, toks, 6)
    assert set(range(96)) <= b.computed_by_forward[r]
    b.close()


@check("whole-block loads and saves (layerwise = false) and a runner that never calls save_kv_layer give the same bytes")
def _():
    seen, _, out, b, r, toks = layerwise_hit(0.0, True, layerwise=False)
    assert seen == {0: True, 1: True} and not out.invalid_block_ids
    b.close()
    toks = prompt(77)
    a = ve.Engine(P)
    r1 = rid("nosave")
    a.add(r1, toks)
    for _ in range(200):
        a.step(save_layers=False)
        if r1 in a.outputs and a.outputs[r1].finish_reason is not None:
            break
    a.close()
    c = ve.Engine(P)
    r2 = rid("nosave-hit")
    c.add(r2, toks)
    assert first_schedule(c, r2) == (96, 4)
    c.check_blocks(r2, toks, 6)
    c.close()


@check("prefix caching on a block-outermost KV layout (BLNHC) and with a LoRA-like cache salt")
def _():
    toks = prompt(3)
    a = ve.Engine(P, layout=KVCacheLayout.BLNHC)
    r1 = rid("a")
    a.add(r1, toks)
    a.run(finished(a, r1))
    b = ve.Engine(P, layout=KVCacheLayout.BLNHC)
    r2 = rid("b")
    b.add(r2, toks)
    assert first_schedule(b, r2) == (96, 4)
    b.check_blocks(r2, toks, 6)
    # The same tokens under another cache salt never meet the first's blocks.
    r3 = rid("salted")
    b.add(r3, toks, cache_salt="tenant-2")
    assert first_schedule(b, r3) == (0, 100)
    a.close()
    b.close()


def evicted_load(seed):
    """A prompt saved by one engine, scheduled by a second (6 blocks hit), and blocks 3..
    deleted from kvd before the second's worker loads them. Returns (the load errors the
    worker reported, the block ids, engines, request, tokens, the step's schedule)."""
    toks = prompt(seed)
    a = ve.Engine(P)
    r1 = rid("a")
    a.add(r1, toks)
    a.run(finished(a, r1))
    b = ve.Engine(P)
    r2 = rid("b")
    b.add(r2, toks)
    so = b.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 96
    keys = kvd.chunk_hashes(toks, ve.BLOCK, b"")
    assert kvd.Client(P).delete(b.sconn._lids[0], keys[3:6]) == ["deleted"] * 3
    w = b.worker
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(None)
    bad = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return bad, b.block_ids(r2), a, b, r2, toks, so


@check("a block evicted between lookup and load is reported and recomputed (kv_load_failure_policy=recompute)")
def _():
    bad, ids, a, b, r2, toks, so = evicted_load(4)
    assert bad == set(ids[3:6]), (bad, ids)
    # vLLM takes the failure: the request keeps the 3 good blocks and recomputes the rest.
    step_reports(b, so, r2, bad)
    assert b.scheduler.requests[r2].num_computed_tokens == 48, b.scheduler.requests[r2].num_computed_tokens
    prefilled(b, r2, 100)
    b.check_blocks(r2, toks, 6)
    assert set(range(48, 100)) <= b.computed_by_forward[r2]
    a.close()
    b.close()


@check("negative control: the same eviction with the load's failure not reported: vLLM computes on the blocks that never loaded, and the check catches it")
def _():
    bad, ids, a, b, r2, toks, so = evicted_load(8)
    assert bad == set(ids[3:6]), (bad, ids)
    # A connector that does not report it: vLLM takes all 6 blocks as loaded.
    step_reports(b, so, r2, set())
    assert b.scheduler.requests[r2].num_computed_tokens >= 96, b.scheduler.requests[r2].num_computed_tokens
    prefilled(b, r2, 100)
    try:
        b.check_blocks(r2, toks, 6)
        raise AssertionError("blocks that never loaded passed the check: this control cannot fail the one above")
    except AssertionError as e:
        if "control" in str(e):
            raise
    a.close()
    b.close()


def flipped_load(seed, verify):
    """A prompt saved by one engine, a bit flipped in the pool under its 4th block, then
    scheduled (6 blocks hit) and loaded by a second engine whose client verifies loads or
    not. Returns (the load errors the worker reported, the block ids, engines, request,
    tokens, the daemon's checksum counters before)."""
    toks = prompt(seed)
    a = ve.Engine(P)
    r1 = rid("a")
    a.add(r1, toks)
    a.run(finished(a, r1))
    keys = kvd.chunk_hashes(toks, ve.BLOCK, b"")
    cl = kvd.Client(P)
    lid = cl.register_layout(a.sconn._geo.layout(0))["layout_id"]
    assert lid == a.sconn._lids[0]
    pin = cl.get(lid, keys[3:4])
    off = pin.offsets[0]
    pin.release()
    pool = memoryview(cl.pool())
    pool[off + 11] ^= 0x04
    before = cl.stats()["checksums"]
    old = os.environ.get("KVD_VERIFY_LOADS")
    os.environ["KVD_VERIFY_LOADS"] = "1" if verify else "0"
    try:
        b = ve.Engine(P)
        r2 = rid("b")
        b.add(r2, toks)
        so = b.scheduler.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 96
        w = b.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
    finally:
        if old is None:
            del os.environ["KVD_VERIFY_LOADS"]
        else:
            os.environ["KVD_VERIFY_LOADS"] = old
    bad = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return bad, b.block_ids(r2), a, b, r2, so, toks, cl, before


@check("a bit flipped in the pool under a cached block: the load is not vouched for, vLLM recomputes from there, the daemon drops the block")
def _():
    bad, ids, a, b, r2, so, toks, cl, before = flipped_load(5, verify=True)
    assert bad == set(ids[3:6]), (bad, ids)
    step_reports(b, so, r2, bad)
    assert b.scheduler.requests[r2].num_computed_tokens == 48, b.scheduler.requests[r2].num_computed_tokens
    prefilled(b, r2, 100)
    b.check_blocks(r2, toks, 6)
    after = cl.stats()["checksums"]
    assert after["damaged"] == before["damaged"] + 1, (before, after)
    assert after["reports"] == before["reports"] + 1, (before, after)
    keys = kvd.chunk_hashes(toks, ve.BLOCK, b"")
    assert cl.lookup(a.sconn._lids[0], keys)["prefix"] == 3, "the damaged block is gone"
    a.close()
    b.close()


@check("negative control: a client that does not verify loads hands vLLM the flipped block as a hit, and its KV is wrong")
def _():
    bad, ids, a, b, r2, so, toks, cl, before = flipped_load(6, verify=False)
    assert bad == set(), bad
    step_reports(b, so, r2, set())
    prefilled(b, r2, 100)
    try:
        b.check_blocks(r2, toks, 6)
        raise AssertionError("the flipped bit did not reach the engine: this control cannot fail the check")
    except AssertionError as e:
        if "control" in str(e):
            raise
    assert cl.stats()["checksums"]["damaged"] == before["damaged"]
    a.close()
    b.close()


@check("the CUDA path's staged gather/scatter moves the same bytes as the CPU path's direct copies (both layouts)")
def _():
    # The CUDA path (one DMA per slot + a device gather/scatter) runs here on CPU tensors:
    # without a GPU it is the only way its index arithmetic is checked.
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC):
        e = ve.Engine(P, layout=layout)
        w = e.worker
        g = torch.Generator().manual_seed(7)
        for t in e.kv.values():
            t.copy_((torch.rand(t.shape, generator=g) * 4 - 2).to(t.dtype))
        ids = [5, 1, 9]
        staged = w._paged.gather(ids)
        direct = torch.zeros_like(staged)
        for j, b in enumerate(ids):
            for src, dst in w._paged.pieces(direct[j], b):
                dst.copy_(src)
        assert torch.equal(staged, direct), layout
        before = {n: t.clone() for n, t in e.kv.items()}
        w._paged.scatter([20, 21, 22], staged)
        for n, t in e.kv.items():
            assert torch.equal(t[[20, 21, 22]], before[n][ids]), (layout, n)
        e.close()


@check("the CUDA path's per-layer staged copies move the same bytes as the CPU path's (both layouts)")
def _():
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC):
        e = ve.Engine(P, layout=layout)
        w = e.worker
        g = torch.Generator().manual_seed(11)
        for t in e.kv.values():
            t.copy_((torch.rand(t.shape, generator=g) * 4 - 2).to(t.dtype))
        bb = w._geo.block_bytes
        pool = torch.zeros(4 * bb, dtype=torch.uint8)
        other = torch.zeros_like(pool)
        ids, offs = [5, 1, 9], [0, bb, 3 * bb]
        for l in range(ve.LAYERS):
            w._paged.save_layer(pool, offs, ids, l, staged=True)
            w._paged.save_layer(other, offs, ids, l, staged=False)
        assert torch.equal(pool, other), layout
        before = {n: t.clone() for n, t in e.kv.items()}
        for l in range(ve.LAYERS):
            w._paged.load_layer(pool, offs, [20, 21, 22], l, staged=True)
        for n, t in e.kv.items():
            assert torch.equal(t[[20, 21, 22]], before[n][ids]), (layout, n)
        e.close()


@check("one indexing kernel per call: whole blocks and layers land where one copy per slot puts them; unaligned pieces are refused, nothing moved")
def _():
    # read_pool/write_pool run over the pool's device mapping on CUDA; here over the
    # pool itself, the same row arithmetic.
    assert ve.LAYERS >= 2
    e = ve.Engine(P)
    w = e.worker
    g = torch.Generator().manual_seed(13)
    for t in e.kv.values():
        t.copy_((torch.rand(t.shape, generator=g) * 4 - 2).to(t.dtype))
    bb = w._geo.block_bytes
    lb = bb // ve.LAYERS
    ids, offs = [5, 1, 9], [3 * bb, 0, 6 * bb]
    staged = w._paged.gather(ids)
    pool = torch.zeros(8 * bb, dtype=torch.uint8)
    assert w._paged.write_pool(pool, offs, staged)
    other = torch.zeros_like(pool)
    for j, off in enumerate(offs):
        w._paged.slot(other, off).copy_(staged[j])
    assert torch.equal(pool, other)
    back = w._paged.read_pool(pool, offs, bb, tuple(staged.shape))
    assert back.dtype == staged.dtype and torch.equal(back, staged)
    # One layer of each slot: the rows are that layer's bytes only.
    layer = w._paged.read_pool(pool, [off + 1 * lb for off in offs], lb, (3,) + tuple(staged.shape[2:]))
    assert torch.equal(layer, staged[:, 1])
    assert w._paged.write_pool(pool, [off + 0 * lb for off in offs], torch.zeros_like(staged[:, 0]))
    assert torch.count_nonzero(pool.view(8, ve.LAYERS, lb)[[3, 0, 6], 0]) == 0
    assert torch.equal(pool.view(8, ve.LAYERS, lb)[:, 1:], other.view(8, ve.LAYERS, lb)[:, 1:])
    # A start not 8-byte aligned: no rows, nothing written (the caller copies per slot).
    before = pool.clone()
    assert w._paged.read_pool(pool, [4], bb, tuple(staged.shape[1:])) is None
    assert not w._paged.write_pool(pool, [4], staged[0])
    assert torch.equal(pool, before)
    # No slots: nothing moved, nothing refused.
    assert w._paged.write_pool(pool, [], staged[:0])
    assert w._paged.read_pool(pool, [], bb, (0,) + tuple(staged.shape[1:])).numel() == 0
    assert torch.equal(pool, before)
    e.close()


@check("every TP rank's layout is asked: the shortest prefix counts")
def _():
    cfg = ve.vllm_config(P)
    cfg.parallel_config.tensor_parallel_size = 2
    kvcc = ve.kv_cache_config()
    s = KvdConnector(cfg, KVConnectorRole.SCHEDULER, kvcc)
    assert len(s._lids) == 2 and s._lids[0] != s._lids[1]
    toks = prompt(5)
    keys = kvd.chunk_hashes(toks, ve.BLOCK, b"")
    cl = kvd.Client(P)
    for lid, n in zip(s._lids, (5, 2)):
        bb = cl.register_layout(s._geo.layout(s._lids.index(lid)))["block_bytes"]
        assert cl.store(lid, keys[:n], [b"\0" * bb] * n) == ["new"] * n
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(rid("tp"), toks, SamplingParams(max_tokens=1), None)
    assert s.get_num_new_matched_tokens(req, 0) == (32, False)


@check("the dense layout stays classic; MLA, K/V of different sizes and hybrid configs get grouped layouts (test_vllm_families.py); tensors of the wrong shape are refused with the reason")
def _():
    cfg = ve.vllm_config(P)
    dense = KvdConnector(cfg, KVConnectorRole.SCHEDULER, ve.kv_cache_config())
    assert not dense._geo.grouped and dense._geo.layout(0)["order"] == "layer_part_head_token"
    mla = MLAAttentionSpec(block_size=ve.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    odd = FullAttentionSpec(block_size=ve.BLOCK, num_kv_heads=ve.KV_HEADS, head_size=16, head_size_v=8, dtype=torch.float16)
    kvcc = ve.kv_cache_config()
    names = kvcc.kv_cache_groups[0].layer_names
    full = kvcc.kv_cache_groups[0].kv_cache_spec
    swa = SlidingWindowSpec(block_size=ve.BLOCK, num_kv_heads=ve.KV_HEADS, head_size=ve.HEAD, dtype=torch.float16, sliding_window=32)
    hybrid = ve.kv_cache_config(groups=[KVCacheGroupSpec(layer_names=names[:1], kv_cache_spec=full),
                                        KVCacheGroupSpec(layer_names=names[1:], kv_cache_spec=swa)])
    for kvcc_, kinds in ((ve.kv_cache_config(spec=mla), ["mla"]), (ve.kv_cache_config(spec=odd), ["full"]), (hybrid, ["full", "sliding"])):
        s = KvdConnector(cfg, KVConnectorRole.SCHEDULER, kvcc_)
        assert s._geo.grouped and [g["kind"] for g in s._geo.layout(0)["groups"]] == kinds, s._geo
    # A worker handed tensors that do not match the model's heads.
    w = KvdConnector(cfg, KVConnectorRole.WORKER, kvcc)
    wrong = {n: torch.zeros((64, 4, ve.BLOCK, 2 * ve.HEAD), dtype=torch.float16) for n in names}
    try:
        w.register_kv_caches(wrong)
        raise AssertionError("wrong shape accepted")
    except KvdConfigError as e:
        assert "does not match the model" in str(e), e


@check("a daemon restart: the connector maps the new pool and never uses offsets across incarnations")
def _():
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvd-vllm-restart-")
    ep = f"ipc://{d}/kvd.sock"
    proc = start_daemon(KVD_BIN, d)
    try:
        a = ve.Engine(ep)
        r1 = rid("before")
        a.add(r1, prompt(40))
        a.run(finished(a, r1))
        old = a.worker._sessions[None].inc
        proc.kill()
        proc.wait()
        os.unlink(f"{d}/kvd.sock")
        proc = start_daemon(KVD_BIN, d)
        # The new daemon holds nothing: no hits; the first save learns of the restart.
        r2 = rid("after")
        a.add(r2, prompt(40))
        assert first_schedule(a, r2) == (0, 100)
        a.run(finished(a, r2))
        toks = prompt(41)
        r3 = rid("saved")
        a.add(r3, toks)
        a.run(finished(a, r3))
        assert a.worker._sessions[None].inc != old, "the worker views the new daemon's pool"
        b = ve.Engine(ep)
        r4 = rid("hit")
        b.add(r4, toks)
        assert first_schedule(b, r4) == (96, 4)
        b.check_blocks(r4, toks, 6)
        a.close()
        b.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)  # pool, table, sockets: nothing left in /dev/shm


@check("a kept pool (a service's setting): after SIGKILL and a new daemon on the same pool, a prompt saved before is a prefix hit in vLLM's scheduler, loaded byte for byte")
def _():
    import subprocess
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvd-vllm-kept-")
    ep = f"ipc://{d}/kvd.sock"
    proc = start_daemon(KVD_BIN, d, keep=True)
    try:
        a = ve.Engine(ep)
        toks = prompt(43)
        r1 = rid("kept")
        a.add(r1, toks)
        a.run(finished(a, r1))
        a.close()

        def kept():
            out = subprocess.run([KVD_BIN, "ctl", "--endpoint", ep, "stats", "--json"],
                                 capture_output=True, check=True, text=True).stdout
            return json.loads(out)["kept"]
        for _ in range(500):  # every saved block sealed (what survives a kill)
            if kept()["sealed"] >= 6:
                break
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        os.unlink(f"{d}/kvd.sock")
        proc = start_daemon(KVD_BIN, d, keep=True)
        b = ve.Engine(ep)
        r2 = rid("kept-hit")
        b.add(r2, toks)
        assert first_schedule(b, r2) == (96, 4)
        b.check_blocks(r2, toks, 6)
        assert kept()["adopted"] >= 6
        b.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)  # pool, table, sockets: nothing left in /dev/shm


def prefill(endpoint, toks, **extra):
    """A prefill engine's request with do_remote_decode; returns its JSON params and the engine."""
    p = ve.Engine(endpoint, role="kv_producer", **extra)
    r = rid("prefill")
    p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run(finished(p, r))
    params = p.outputs[r].kv_transfer_params
    assert params and params["kvd"]["blocks"] == 6, params
    return p, r, json.loads(json.dumps(params))  # what a proxy forwards


def decode_handoff(mode):
    toks = prompt(10 + len(mode))
    p, _, params = prefill(P, toks)
    d = ve.Engine(D, role="kv_consumer", mode=mode)
    r = rid("decode")
    d.add(r, toks, max_tokens=3, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    computed, n = first_schedule(d, r)
    assert (computed, n) == (96, 4), (computed, n)
    # Byte for byte what the prefill engine computed, by the decode engine's block ids.
    d.check_blocks(r, toks, 6)
    assert not (d.computed_by_forward[r] & set(range(96)))
    d.run(finished(d, r))
    # The prefill node's export is done and let go; nothing stays pinned on either side.
    tid = params["kvd"]["transfers"][0]["transfer_id"]
    assert kvd.Client(P).transfer_status(tid)["state"] == "done"
    deadline = time.time() + 5
    while kvd.Client(D).stats()["pinned_blocks"] and time.time() < deadline:
        time.sleep(0.05)
    assert kvd.Client(D).stats()["pinned_blocks"] == 0, kvd.Client(D).stats()
    p.close()
    d.close()


@check("P/D: prefill connector -> kv_transfer_params (JSON) -> decode connector across two daemons, by pull")
def _():
    decode_handoff("pull")


@check("P/D: the same handoff by push (the decode daemon registers its slots, the prefill daemon writes them)")
def _():
    decode_handoff("push")


@check("P/D between TP sizes (classic layout): a TP-2 prefill to a TP-1 decode and TP-1 to TP-2, by pull and push; every decode rank's heads byte for byte")
def _():
    for ptp, dtp, mode in ((2, 1, "pull"), (1, 2, "pull"), (2, 1, "push")):
        toks = prompt(60 + 10 * ptp + dtp + len(mode))
        p = ve.TPEngine(P, ptp, role="kv_producer")
        r = rid("tp-prefill")
        p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(finished(p, r))
        params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
        assert params and params["kvd"]["blocks"] == 6 and len(params["kvd"]["transfers"]) == ptp, params
        d = ve.TPEngine(D, dtp, role="kv_consumer", mode=mode)
        r2 = rid("tp-decode")
        d.add(r2, toks, max_tokens=2, kv_transfer_params=params)
        computed, n = first_schedule(d, r2)
        assert (computed, n) == (96, 4), (ptp, dtp, mode, computed, n)
        assert not (d.computed_by_forward[r2] & set(range(96)))
        d.check_blocks(r2, toks, 6)
        d.run(finished(d, r2))
        p.close()
        d.close()
    # Negative control: heads landing on the wrong decode heads are caught.
    from kvd.vllm_layout import Geometry

    real = Geometry.shards
    Geometry.shards = lambda self, src_tp, rank: [(s_, s0, self.heads - d0 - n, n) for s_, s0, d0, n in real(self, src_tp, rank)]
    try:
        toks = prompt(99)
        p = ve.TPEngine(P, 2, role="kv_producer")
        r = rid("tp-swap")
        p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(finished(p, r))
        d = ve.TPEngine(D, 1, role="kv_consumer")
        r2 = rid("tp-swap-decode")
        d.add(r2, toks, max_tokens=2, kv_transfer_params=json.loads(json.dumps(p.outputs[r].kv_transfer_params)))
        first_schedule(d, r2)
        caught(lambda: d.check_blocks(r2, toks, 6), "swapped heads")
        p.close()
        d.close()
    finally:
        Geometry.shards = real
    # Where TP exceeds the KV heads (heads replicated), no reslicing: a miss, prefilled here.
    s = KvdConnector(ve.vllm_config(D), KVConnectorRole.SCHEDULER, ve.kv_cache_config())
    assert s._geo.shards(2, 0) == [(0, 0, 0, 1), (1, 0, 1, 1)] and s._geo.shards(4, 0) is None


@check("pipeline parallelism (dense): each stage stores its own layers under its own layout; a hit needs every stage's blocks; P/D between engines of the same PP size, and a PP mismatch is a miss")
def _():
    toks = prompt(71)
    a = ve.PPEngine(P, 2)
    lays = [a.sconn._geo.layout(i) for i in range(2)]
    assert [l["model"].rsplit("#", 1)[1] for l in lays] == ["pp0/2", "pp1/2"] and [l["num_layers"] for l in lays] == [1, 1], lays
    r = rid("pp")
    a.add(r, toks)
    a.run(finished(a, r))
    a.close()
    b = ve.PPEngine(P, 2)
    r2 = rid("pp-hit")
    b.add(r2, toks)
    assert first_schedule(b, r2) == (96, 4)
    b.check_blocks(r2, toks, 6)
    b.close()
    # One stage's block gone: no stage hits past it.
    keys = kvd.chunk_hashes(toks, ve.BLOCK, b"")
    c = ve.PPEngine(P, 2)
    kvd.Client(P).delete(c.sconn._lids[1], keys[2:3])
    r3 = rid("pp-short")
    c.add(r3, toks)
    assert first_schedule(c, r3) == (32, 68)
    c.check_blocks(r3, toks, 2)
    c.close()
    # P/D between two PP-2 engines; a PP-1 decode engine cannot take a PP-2 handoff.
    t2 = prompt(72)
    p = ve.PPEngine(P, 2, role="kv_producer")
    rp = rid("pp-prefill")
    p.add(rp, t2, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run(finished(p, rp))
    params = json.loads(json.dumps(p.outputs[rp].kv_transfer_params))
    assert params["kvd"]["pp"] == 2 and len(params["kvd"]["transfers"]) == 2, params
    d = ve.PPEngine(D, 2, role="kv_consumer")
    rd = rid("pp-decode")
    d.add(rd, t2, max_tokens=2, kv_transfer_params=params)
    assert first_schedule(d, rd) == (96, 4)
    d.check_blocks(rd, t2, 6)
    d.run(finished(d, rd))
    one = ve.Engine(D, role="kv_consumer")
    r1 = rid("pp-mismatch")
    one.add(r1, t2, max_tokens=2, kv_transfer_params=params)
    assert first_schedule(one, r1) == (0, 100)
    for e in (p, d, one):
        e.close()


@check(
    "decode-context parallelism (TP 2, DCP 2, interleave 1 and 16): each rank stores the tokens vLLM deals it under its own layout, one key per "
    "32-token scheduler block; a hit loads every rank's tokens byte for byte; P/D between equal engines by pull and push; another interleave or "
    "DCP size is a miss; negative control: a rank loading another rank's tokens is caught"
)
def _():
    from kvd.vllm_layout import Geometry

    for interleave in (1, 16):
        toks = prompt(110 + interleave)
        a = ve.DCPEngine(P, interleave=interleave)
        lays = [a.sconn._geo.layout(i) for i in range(2)]
        assert [x["model"].rsplit("#", 1)[1] for x in lays] == [f"dcp0/2,{interleave}", f"dcp1/2,{interleave}"], lays
        assert [x["tokens_per_block"] for x in lays] == [16, 16], lays
        r = rid("dcp")
        a.add(r, toks)
        a.run(finished(a, r))
        a.close()
        b = ve.DCPEngine(P, interleave=interleave)
        r = rid("dcp-hit")
        b.add(r, toks)
        assert first_schedule(b, r) == (96, 4)
        assert not (b.computed_by_forward[r] & set(range(96)))
        b.check_blocks(r, toks, 3)
        b.close()
        c = ve.DCPEngine(P, interleave=17 - interleave)
        r = rid("dcp-other")
        c.add(r, toks)
        assert first_schedule(c, r) == (0, 100), "another interleave deals other tokens to each rank"
        c.close()
    # Negative control: rank 1 loading rank 0's blocks (a connector blind to DCP).
    toks = prompt(111)
    real = Geometry.layout_index
    Geometry.layout_index = lambda self, stage, rank: 0
    try:
        blind = ve.DCPEngine(P, interleave=1)
    finally:
        Geometry.layout_index = real
    r = rid("dcp-blind")
    blind.add(r, toks)
    assert first_schedule(blind, r) == (96, 4)
    caught(lambda: blind.check_blocks(r, toks, 3), "another rank's tokens")
    blind.close()
    # P/D between DCP-2 engines; a decode engine without DCP prefills itself.
    for mode in ("pull", "push"):
        toks = prompt(130 + len(mode))
        p = ve.DCPEngine(P, role="kv_producer", lease_s=1)
        r = rid("dcp-prefill")
        p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(finished(p, r))
        params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
        assert params["kvd"]["dcp"] == [2, 1] and params["kvd"]["blocks"] == 3 and len(params["kvd"]["transfers"]) == 2, params
        d = ve.DCPEngine(D, role="kv_consumer", mode=mode)
        r2 = rid("dcp-decode")
        d.add(r2, toks, max_tokens=2, kv_transfer_params=params)
        assert first_schedule(d, r2) == (96, 4)
        assert not (d.computed_by_forward[r2] & set(range(96)))
        d.check_blocks(r2, toks, 3)
        d.run(finished(d, r2))
        d.close()
        if mode == "pull":
            p2 = ve.DCPEngine(P, role="kv_producer", lease_s=1)
            toks = prompt(140)
            r = rid("dcp-prefill-2")
            p2.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            p2.run(finished(p2, r))
            params = json.loads(json.dumps(p2.outputs[r].kv_transfer_params))
            p2.close()
            one = ve.DCPEngine(D, dcp=1, role="kv_consumer")
            r2 = rid("dcp-mismatch")
            one.add(r2, toks, max_tokens=2, kv_transfer_params=params)
            assert first_schedule(one, r2) == (0, 100)
            one.close()
            expired(P, params["kvd"]["transfers"])  # (nobody admitted them)
        p.close()


@check("multimodal prompts in vLLM's scheduler: the same image hits and loads its KV byte for byte; another image in the same place hits only the text before it; negative control: keys of the tokens alone would load the other image's KV")
def _():
    import kvd.vllm_connector as vc
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def item(ident):
        return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=40, length=30))]

    def at(ident):
        return lambda pos: [ident] if pos >= 40 else []

    def saved(toks, ident):
        a = ve.MMEngine(P)
        r = rid("mm")
        a.add(r, toks, mm_features=item(ident))
        a.run(finished(a, r))
        a.close()

    toks = prompt(81)
    img_a, img_b = f"img-A-{RUN}", f"img-B-{RUN}"
    saved(toks, img_a)
    b = ve.MMEngine(P)
    r2 = rid("mm-same")
    b.add(r2, toks, mm_features=item(img_a))
    assert first_schedule(b, r2) == (96, 4)
    b.check_blocks_mm(r2, toks, 6, at(img_a))
    b.close()
    c = ve.MMEngine(P)
    r3 = rid("mm-other")
    c.add(r3, toks, mm_features=item(img_b))
    assert first_schedule(c, r3) == (32, 68), "only the blocks before the image"
    prefilled(c, r3, 100)
    c.check_blocks_mm(r3, toks, 6, at(img_b))
    c.close()
    # Negative control: a connector that keys multimodal prompts by their tokens alone.
    real = vc.request_keys

    def tokens_only(request, block_size):
        return kvd.chunk_hashes(list(request.prompt_token_ids), block_size, b"")

    vc.request_keys = tokens_only
    try:
        toks2 = prompt(82)
        saved(toks2, img_a)
        d = ve.MMEngine(P)
        r4 = rid("mm-neg-other")
        d.add(r4, toks2, mm_features=item(img_b))
        assert first_schedule(d, r4) == (96, 4), "keyed by tokens, the other image's blocks hit"
        try:
            d.check_blocks_mm(r4, toks2, 6, at(img_b))
            raise RuntimeError("another image's KV went unnoticed")
        except AssertionError as e:
            assert "differs" in str(e), e
        d.close()
    finally:
        vc.request_keys = real


@check("P/D: malformed, tampered or mixed-up kv_transfer_params never load wrong KV: the decode engine prefills itself")
def _():
    import base64

    toks = prompt(25)
    p, _, good = prefill(P, toks)
    t0 = good["kvd"]["transfers"][0]
    raw = bytearray(base64.b64decode(t0["params"]))
    raw[len(raw) // 2] ^= 0xFF
    tampered = json.loads(json.dumps(good))
    tampered["kvd"]["transfers"][0]["params"] = base64.b64encode(bytes(raw)).decode()
    bad = [
        {"do_remote_prefill": True, "kvd": {"v": 1, "blocks": "many", "block_size": 16, "transfers": []}},
        {"do_remote_prefill": True, "kvd": {"v": 1, "blocks": 6, "block_size": 16, "transfers": "tp0"}},
        {"do_remote_prefill": True, "kvd": {"v": 1, "blocks": 6, "block_size": 16, "transfers": [{"rank": 0, "transfer_id": "x", "params": "!!!"}]}},
        {"do_remote_prefill": True, "kvd": {"v": 1, "blocks": 6, "block_size": 32, "transfers": good["kvd"]["transfers"]}},
        {"do_remote_prefill": True, "kvd": {"v": 2, "blocks": 6, "block_size": 16, "transfers": good["kvd"]["transfers"]}},
        {"do_remote_prefill": True, "kvd": None},
        tampered,
    ]
    d = ve.Engine(D, role="kv_consumer", save=False)  # each attempt starts from nothing
    for params in bad:
        r = rid("bad")
        d.add(r, toks, max_tokens=2, kv_transfer_params=params)
        assert first_schedule(d, r) == (0, 100), params
        prefilled(d, r, 100)
        d.check_blocks(r, toks, 6)
    # Valid params of another prompt (a proxy that mixed two requests up): the transfer
    # itself succeeds, but the decode side loads by its own prompt's keys, misses, and
    # recomputes everything.
    other = prompt(26)
    r = rid("mixed")
    d.add(r, other, max_tokens=2, kv_transfer_params=good)
    prefilled(d, r, 100)
    assert set(range(100)) <= d.computed_by_forward[r]
    d.check_blocks(r, other, 6)
    p.close()
    d.close()


@check("the model is its weights (issue 32.4): one checkpoint under two paths shares, replaced weights do not, a P/D pair of two models says so")
def _():
    import shutil

    root = tempfile.mkdtemp(prefix="kvd-vllm-identity-")
    a = checkpoint(os.path.join(root, "a"), seed=1, config=ve.CONFIG)
    b = os.path.join(root, "mirror", "b")
    shutil.copytree(a, b)
    toks = prompt(40)
    # no model_id: the connector names the model by its checkpoint's digest
    e1 = ve.Engine(P, model=a, model_id=None)
    assert e1.worker._geo.model_id.startswith("kvd-model-v1:"), e1.worker._geo.model_id
    r = rid("id-a")
    e1.add(r, toks)
    assert first_schedule(e1, r) == (0, 100)
    e1.run(finished(e1, r))
    e2 = ve.Engine(P, model=b, model_id=None)
    r = rid("id-b")
    e2.add(r, toks)
    assert first_schedule(e2, r) == (96, 4), "the same weights under another path share"
    e2.check_blocks(r, toks, 6)
    e2.run(finished(e2, r))
    checkpoint(a, seed=2, config=ve.CONFIG)  # the weights at the first path replaced
    e3 = ve.Engine(P, model=a, model_id=None)
    r = rid("id-a2")
    e3.add(r, toks)
    assert first_schedule(e3, r) == (0, 100), "replaced weights share nothing"
    # P/D: the prefill runs the mirror's weights, the decode the replaced ones
    toks = prompt(41)
    p, _, params = prefill(P, toks, model=b, model_id=None, lease_s=1)
    assert params["kvd"]["model"] == e2.worker._geo.model_id, params
    seen = []

    class Catch(logging.Handler):
        def emit(self, rec):
            seen.append(rec.getMessage())

    h = Catch()
    logging.getLogger("kvd.vllm_connector").addHandler(h)
    try:
        d = ve.Engine(D, role="kv_consumer", model=a, model_id=None)
        r = rid("id-pd")
        d.add(r, toks, max_tokens=2, kv_transfer_params=params)
        assert first_schedule(d, r) == (0, 100), "the decode engine prefills itself"
    finally:
        logging.getLogger("kvd.vllm_connector").removeHandler(h)
    assert any("prefill's model" in m and "decode's model" in m for m in seen), seen
    # the prefill node's export (not admitted: another model's layout) ends with its lease
    expired(P, params["kvd"]["transfers"])
    for e in (e1, e2, e3, p, d):
        e.close()
    shutil.rmtree(root)


@check("P/D: an expired lease is a clean miss: the decode engine prefills itself")
def _():
    toks = prompt(20)
    p, _, params = prefill(P, toks, lease_s=0.5)
    time.sleep(1.5)
    d = ve.Engine(D, role="kv_consumer")
    r = rid("late")
    d.add(r, toks, max_tokens=2, kv_transfer_params=params)
    assert first_schedule(d, r) == (0, 100)
    prefilled(d, r, 100)
    d.check_blocks(r, toks, 6)
    p.close()
    d.close()


@check("P/D: a prefill daemon killed after admission is a load failure vLLM recomputes (failed_recving)")
def _():
    toks = prompt(30)
    p, _, params = prefill(DOOMED, toks)
    d = ve.Engine(D, role="kv_consumer")
    r = rid("orphan")
    d.add(r, toks, max_tokens=2, kv_transfer_params=params)
    # The prefill node dies the moment the pull is to start: admitted (the decode daemon
    # heartbeats the exporter), blocks allocated, nothing moved yet.
    start = d.sconn._start_pull

    def kill_then_start(pull):
        os.kill(DOOMED_PID, signal.SIGKILL)
        start(pull)

    d.sconn._start_pull = kill_then_start
    failed = []
    for _ in range(2000):
        so, out = d.step()
        failed += list(out.failed_recving or ())
        if any(nr.req_id == r for nr in so.scheduled_new_reqs) or r in so.scheduled_cached_reqs.req_ids:
            break
        time.sleep(0.01)
    assert failed == [r], failed
    # Recomputed from scratch: every prompt position by the forward, byte-identical.
    prefilled(d, r, 100)
    assert set(range(100)) <= d.computed_by_forward[r]
    d.check_blocks(r, toks, 6)
    p.close()
    d.close()


if __name__ == "__main__":
    logging.getLogger("vllm").setLevel(logging.ERROR)
    run()
