"""The kvd vLLM connector with the model families that need grouped layouts (SPEC §3.1):
gpt-oss and Gemma 3 (sliding window + full attention), DeepSeek-V3 (MLA), a Llama with fp8
KV, each with the KV cache configuration vLLM itself plans (``vllm_families``), in vLLM
0.33's own scheduler with its hybrid allocator, against real daemons.

argv: PREFILL_ENDPOINT DECODE_ENDPOINT KVD_BINARY. Run by daemon/tests/vllm_connector.rs.
Prints "N passed, M failed".
"""

import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import vllm_engine as ve  # noqa: E402
import vllm_families as vf  # noqa: E402
from checks import caught, check, checkpoint, expired, run  # noqa: E402

import kvd  # noqa: E402
import torch  # noqa: E402
from kvd.vllm_connector import KvdConfigError, KvdConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

P, D, KVD_BIN = sys.argv[1], sys.argv[2], sys.argv[3]
RUN = int.from_bytes(os.urandom(4), "little")  # daemons may outlive a run: fresh prompts
FAMILIES = list(vf.FAMILIES)
_n = [0]


def prompt(seed, n=100):
    return [(RUN + seed * 7919 + 13 * t) % 997 + 1 for t in range(n)]


def rid(tag):
    _n[0] += 1
    return f"{tag}-{os.getpid()}-{_n[0]}"


class rank0:
    """vLLM's TP rank query answers 0 (the harness runs rank 0's worker of a TP-2 engine)."""

    def __enter__(self):
        import vllm.distributed.parallel_state as ps

        self.real = ps.get_tensor_model_parallel_rank
        ps.get_tensor_model_parallel_rank = lambda: 0

    def __exit__(self, *exc):
        import vllm.distributed.parallel_state as ps

        ps.get_tensor_model_parallel_rank = self.real


def finished(e, r):
    return lambda so, out: r in e.outputs and e.outputs[r].finish_reason is not None


def until_computed(e, r, n, within_s=60.0):
    """Steps until ``r`` computed ``n`` tokens (an asynchronous load lands on the mover
    thread meanwhile: bounded by time, not by a count of steps); returns the
    failed_recving seen meanwhile."""
    failed = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        req = e.scheduler.requests.get(r)
        if req is not None and req.num_computed_tokens >= n and r in e.computed_by_forward:
            return failed
        _, out = e.step()
        failed += list(out.failed_recving or ())
        time.sleep(0.005)  # (a yield to the mover, not a margin: the deadline bounds it)
    raise AssertionError(f"{r} never computed {n} tokens in {within_s:.0f} s")


def evict_after_alloc(e, lid, keys):
    """Deletes ``keys`` of layout ``lid`` from the daemon right after vLLM allocated the
    blocks of a hit: a block gone between lookup and load."""
    real = e.sconn.update_state_after_alloc

    def evict_then(request, blocks, n):
        real(request, blocks, n)
        kvd.Client(P).delete(lid, keys)

    e.sconn.update_state_after_alloc = evict_then


def saved(family, toks, endpoint=P, **extra):
    """An engine that computed ``toks`` (saving its blocks); closed."""
    a = vf.FamilyEngine(endpoint, family, **extra)
    r = rid(f"save-{family}")
    a.add(r, toks)
    a.run(finished(a, r))
    a.close()


def window_blocks(e, gi):
    """Blocks vLLM keeps for a sliding group at a hit: the window's."""
    spec = e.kvcc.kv_cache_groups[gi].kv_cache_spec
    return -(-(spec.sliding_window - 1) // vf.BLOCK)


def hit(family, toks, endpoint=P, **extra):
    """A fresh engine's request for ``toks``: (engine, request, per-group kept positions)
    after its prompt was computed, every kept block checked byte for byte."""
    b = vf.FamilyEngine(endpoint, family, **extra)
    r = rid(f"hit-{family}")
    b.add(r, toks)
    failed = until_computed(b, r, len(toks))
    assert not failed, failed
    return b, r, b.check_groups(r, toks, len(toks) // vf.BLOCK)


for _family in FAMILIES:

    @check(
        f"{_family}: save, drop from the engine, load: a 96-token prefix hit, byte-exact in every group; sliding groups load only their window, "
        "recurrent layers continue from the state of exactly that boundary"
    )
    def _(family=_family):
        toks = prompt(sum(map(ord, family)))
        saved(family, toks)
        b, r, kept = hit(family, toks)
        assert not (b.computed_by_forward[r] & set(range(96))), "the hit's positions were not recomputed"
        assert set(range(96, 100)) <= b.computed_by_forward[r]
        for gi, g in enumerate(b.kvcc.kv_cache_groups):
            if isinstance(g.kv_cache_spec, SlidingWindowSpec):
                assert 0 < kept[gi] <= window_blocks(b, gi) + 1 < 6, (gi, kept)
            elif isinstance(g.kv_cache_spec, MambaSpec):
                pass  # the state block at the boundary: check_state
            else:
                assert kept[gi] == 6, (gi, kept)
        if vf.recurrent(family):
            b.check_state(r, toks, 6)
            layers = sum(1 for l in range(len(b.layer_names())) if b.is_state(l))
            assert b.states_read >= layers, "every recurrent layer continued from the loaded state (checked as it read it)"
        b.close()


V4 = "deepseek-v4"


@check(
    "deepseek-v4 (KV cache groups of 4- to 64-token blocks, compressed latents, sliding latents and compressor states): save, drop, load: "
    "a 192-token hit, byte-exact in every group; each sliding layer reads exactly its window from what kvd brought; one latent copy per node"
)
def _():
    toks = prompt(4001, 200)
    saved(V4, toks)
    b = vf.FamilyEngine(P, V4)
    geo = b.worker._geo
    assert geo.block_size == b.sched_block == 64 and geo.replicated and len(b.sconn._lids) == 1, geo
    r = rid("hit-v4")
    b.add(r, toks)
    until_computed(b, r, 200)
    assert not (b.computed_by_forward[r] & set(range(192))), "the hit's positions were not recomputed"
    assert b.windows_read >= 5, "every sliding layer read its window from the loaded blocks"
    kept = b.check_groups(r, toks, 3)
    for gi, g in enumerate(b.kvcc.kv_cache_groups):
        spec = g.kv_cache_spec
        if getattr(spec, "sliding_window", None) is None:
            assert kept[gi] == 192 // spec.block_size, (gi, kept)
    b.close()


@check("deepseek-v4: each group's piece of a position is described (its blocks kept of those per position, their size, tokens per state); another compression ratio is another layout")
def _():
    e = vf.FamilyEngine(P, V4)
    lay = e.worker._geo.layout(0)
    by = {g["arrangement"].split(" blocks=")[1]: g for g in lay["groups"]}
    assert {"2/4x16 tps=1", "4/4x16 tps=4", "2/16x4 tps=1", "2/2x32 tps=4", "1/1x64 tps=16", "2/8x8 tps=1"} == set(by), sorted(by)
    assert by["4/4x16 tps=4"]["kind"] == "mla" and by["4/4x16 tps=4"]["dims"] == [4, 1, 4, 256], by
    assert by["2/16x4 tps=1"]["kind"] == "sliding_mla" and by["2/16x4 tps=1"]["window"] == 8, by
    assert kvd.Client(P).register_layout(lay)["block_bytes"] == e.worker._geo.block_bytes
    e.close()
    orig = vf.WIDE[V4]["compress_ratios"]
    try:
        vf.WIDE[V4]["compress_ratios"] = [4, 8, 1]
        o = vf.FamilyEngine(P, V4)
        assert o.sconn._lids != e.sconn._lids, "another compression: another layout"
        o.close()
    finally:
        vf.WIDE[V4]["compress_ratios"] = orig


@check("negative control: a DeepSeek-V4 connector that loads a compressor state's window blocks in the wrong order is caught when the layer reads its window")
def _():
    import kvd.vllm_connector as vc

    toks = prompt(4101, 200)
    saved(V4, toks)
    real = vc.positions

    def swapped(ids_by_group, geo, first, count):
        out = real(ids_by_group, geo, first, count)
        j = next(i for i, g in enumerate(geo.groups) if g.vblock == 4)
        return [o[:j] + (tuple(reversed(o[j])),) + o[j + 1 :] for o in out]

    vc.positions = swapped
    try:
        caught(lambda: hit_v4(toks), "a compressor state loaded out of order")
    finally:
        vc.positions = real


@check(
    "deepseek-v4: where vLLM keeps more of a sliding group's window than kvd stores per position, the load fails (failed_recving) and the request "
    "recomputes, right; negative control: without that check the layer reads a block nobody filled"
)
def _():
    import dataclasses

    import kvd.vllm_connector as vc
    from kvd import vllm_groups

    toks = prompt(4301, 200)
    real = vllm_groups._positions

    def short(*a, **kw):
        # kvd's pieces keep one block fewer of the 4-token compressor state than vLLM keeps.
        L, plans = real(*a, **kw)
        return L, [dataclasses.replace(p, subs=p.subs - 1) if p.vblock == 4 else p for p in plans]

    vllm_groups._positions = short
    try:
        saved(V4, toks)
        b = vf.FamilyEngine(P, V4)
        r = rid("hit-v4-short")
        b.add(r, toks)
        failed = until_computed(b, r, 200)
        assert r in failed, "the load that would leave a block unfilled failed"
        assert set(range(200)) <= b.computed_by_forward[r], "and the request recomputed"
        b.close()
        real_unfilled = vc.unfilled
        vc.unfilled = lambda *a: None
        try:
            caught(lambda: hit_v4(toks), "a window block nobody filled", needle="reads token")
        finally:
            vc.unfilled = real_unfilled
    finally:
        vllm_groups._positions = real


def hit_v4(toks):
    b = vf.FamilyEngine(P, V4)
    try:
        r = rid("hit-v4")
        b.add(r, toks)
        until_computed(b, r, len(toks))
    finally:
        b.close()


@check("P/D: deepseek-v4 handed off by pull and by push: every group of the 192-token prefix, one latent copy, each sliding layer reading its window from what moved")
def _():
    for mode in ("pull", "push"):
        toks = prompt(4201 + len(mode), 200)
        p = vf.FamilyEngine(P, V4, role="kv_producer")
        r = rid("prefill-v4")
        p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(finished(p, r))
        params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
        assert params["kvd"]["blocks"] == 3 and len(params["kvd"]["transfers"]) == 1, params
        d = vf.FamilyEngine(D, V4, role="kv_consumer", mode=mode)
        r2 = rid("decode-v4")
        d.add(r2, toks, max_tokens=2, kv_transfer_params=params)
        failed = until_computed(d, r2, 200)
        assert not failed, failed
        assert not (d.computed_by_forward[r2] & set(range(192))), "the handed-off prefix was not recomputed"
        assert d.windows_read >= 5
        d.check_groups(r2, toks, 3)
        d.run(finished(d, r2))
        p.close()
        d.close()


@check("the layout is the engine's: every group described (kind, window, dims, dtype, quant), MLA kept once per node, fp8 named with its scales")
def _():
    e = vf.FamilyEngine(P, "gpt-oss")
    lay = e.worker._geo.layout(0)
    assert lay["order"] == "groups" and [g["kind"] for g in lay["groups"]] == ["sliding", "full"], lay
    assert lay["groups"][0]["window"] == 32 and lay["groups"][0]["dims"] == [2, 16, 32], lay
    assert kvd.Client(P).register_layout(lay)["block_bytes"] == e.worker._geo.block_bytes == 2 * 2 * (2 * 16 * 32 * 2)
    e.close()
    with rank0():
        m = vf.FamilyEngine(P, "deepseek-v3", tp_size=2)
    assert m.worker._geo.layout_index(0, 1) == 0, "rank 1 uses the node's one latent layout"
    lay = m.worker._geo.layout(m.worker._geo.layout_index(0, 1))
    assert (lay["tp_size"], lay["tp_rank"]) == (1, 0), "one latent copy per node, whatever the rank"
    assert lay["groups"][0]["kind"] == "mla" and lay["groups"][0]["dims"] == [1, 16, 48], lay
    assert len(m.sconn._lids) == 1, "the scheduler asks one layout, not one per rank"
    m.close()
    f = vf.FamilyEngine(P, "llama-fp8")
    g = f.worker._geo.layout(0)["groups"][0]
    assert g["dtype"] == "u8" and g["quant"] == "fp8_per_tensor;cache_dtype=fp8;scales=checkpoint", g
    f.close()


@check("speculative decoding: every group names the draft model (its layers share the groups), another draft model is another layout")
def _():
    from types import SimpleNamespace

    import shutil

    e = vf.FamilyEngine(P, "llama-draft")
    assert not e.worker._geo.grouped, "no speculative decoding: the classic layout"
    ids = []
    dirs = [os.path.join(tempfile.gettempdir(), f"kvd-draft-{RUN}-{x}") for x in "ab"]
    for draft, d in zip("ab", dirs):
        checkpoint(d, seed=ord(draft))
        object.__setattr__(e.config, "speculative_config", SimpleNamespace(model=d))
        s = KvdConnector(e.config, KVConnectorRole.SCHEDULER, e.kvcc)
        assert s._geo.grouped and all("draft=kvd-model-v1:" in g["arrangement"] for g in s._geo.layout(0)["groups"]), s._geo
        ids.append(s._lids[0])
    assert len(set(ids + e.sconn._lids)) == 3, "each draft model its own layout"
    object.__setattr__(e.config, "speculative_config", None)
    e.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@check("two layouts that differ in a byte-relevant field never share a block: another window or another vLLM arrangement is a miss")
def _():
    toks = prompt(501)
    saved("gpt-oss", toks)
    import vllm_families

    orig = dict(vllm_families.FAMILIES["gpt-oss"])
    try:
        vllm_families.FAMILIES["gpt-oss"]["sliding_window"] = 48
        b = vf.FamilyEngine(P, "gpt-oss")
        r = rid("other-window")
        b.add(r, toks)
        until_computed(b, r, 100)
        assert set(range(100)) <= b.computed_by_forward[r], "another window: no hit"
        b.close()
    finally:
        vllm_families.FAMILIES["gpt-oss"] = orig
    # The same model, its arrangement named otherwise (another vLLM or device): a miss.
    c = vf.FamilyEngine(P, "gpt-oss")
    lay = dict(c.worker._geo.layout(0))
    lay["groups"] = [dict(g, arrangement=g["arrangement"].replace("vllm ", "vllm-next ")) for g in lay["groups"]]
    cl = kvd.Client(P)
    other = cl.register_layout(lay)["layout_id"]
    keys = kvd.chunk_hashes(toks, vf.BLOCK, b"")
    assert cl.lookup(other, keys[:6])["prefix"] == 0
    assert cl.lookup(c.sconn._lids[0], keys[:6])["prefix"] == 6
    c.close()


@check("negative control: a connector that loads one group's pieces a position off is caught by the byte check")
def _():
    import kvd.vllm_connector as vc
    from kvd import vllm_groups

    toks = prompt(601)
    saved("gpt-oss", toks)
    real = vc.positions

    def shifted(ids_by_group, geo, first, count):
        # The sliding group's blocks one position later than the full group's.
        out = real(ids_by_group, geo, first, count)
        nxt = real(ids_by_group, geo, first + 1, count)
        return [(n[0],) + o[1:] for o, n in zip(out, nxt)]

    vc.positions = shifted
    try:
        caught = False
        try:
            b, _, _ = hit("gpt-oss", toks)
            b.close()
        except AssertionError as e:
            caught = "differs" in str(e)
        assert caught, "a misaligned group went unnoticed"
    finally:
        vc.positions = real
    assert vllm_groups.positions is real


@check("negative control: a recurrent state snapshot of the wrong boundary is caught when the layer reads it")
def _():
    import kvd.vllm_connector as vc

    toks = prompt(1101)
    saved("qwen3-next", toks[:80])  # vLLM's align mode leaves the state after 64 tokens
    saved("qwen3-next", toks)  # and after 96
    keys = kvd.chunk_hashes(toks, vf.BLOCK, b"")
    real = vc.state_ids
    b = vf.FamilyEngine(P, "qwen3-next")
    sched = b.sconn
    real_update = sched.update_state_after_alloc

    def wrong_boundary(request, blocks, n):
        real_update(request, blocks, n)
        for p_ in sched._pending_pulls:
            if p_.state is not None:
                p_.state = (keys[3], p_.state[1])  # the snapshot after 4 blocks, into the 6th's

    sched.update_state_after_alloc = wrong_boundary
    r = rid("wrong-state")
    b.add(r, toks)
    caught = False
    try:
        until_computed(b, r, 100)
    except AssertionError as e:
        caught = "wrong recurrent state" in str(e)
    assert caught, "a state of another boundary went unnoticed"
    assert vc.state_ids is real
    b.close()


@check("a recurrent state missing from kvd shortens the hit to the last boundary that has one, with its KV; the layer continues from the right state")
def _():
    toks = prompt(1201)
    saved("jamba", toks[:72])  # align mode: the state after 64 tokens (72 is no boundary)
    saved("jamba", toks)  # state after 96
    b = vf.FamilyEngine(P, "jamba")
    keys = kvd.chunk_hashes(toks, vf.BLOCK, b"")
    kvd.Client(P).delete(b.sconn._slids[0], keys[5:6])
    r = rid("state-gone")
    b.add(r, toks)
    assert not until_computed(b, r, 100)
    assert not (b.computed_by_forward[r] & set(range(64))) and set(range(64, 100)) <= b.computed_by_forward[r], "the hit is 64 tokens"
    b.check_groups(r, toks, 6)
    b.close()


@check(
    "divergent local hybrid hits (Qwen3-Next): vLLM's local cache keeps full attention deeper than the recurrent state; kvd loads only the "
    "tail and the state at its hit's boundary, byte-exact, and the recurrence continues from it; without the capability vLLM reconciles "
    "to the boundary every group agrees on and kvd loads it all; never offered beside a sliding window"
)
def _():
    from kvd.vllm_connector import KvdConnector as K

    def run(capable):
        toks = prompt(1600 + capable)
        e = vf.FamilyEngine(P, "qwen3-next")
        assert e.sconn.supports_divergent_local_hybrid_hits
        if not capable:
            e.sconn.__class__ = type("Incapable", (K,), {"supports_divergent_local_hybrid_hits": False})
        a = rid("div-a")
        e.add(a, toks)
        until_computed(e, a, 100)
        ids = e.group_ids(a)
        e.run(finished(e, a))
        # Block pressure in vLLM's local cache: every recurrent state block gone, full
        # attention from the fifth position on.
        state = {gi for gi, g in enumerate(e.kvcc.kv_cache_groups) if isinstance(g.kv_cache_spec, MambaSpec)}
        gone = {b for gi, lst in enumerate(ids) for b in (lst if gi in state else lst[4:]) if b}
        e.scheduler.kv_cache_manager.block_pool.evict_blocks(gone)
        asked = []
        real = e.sconn.get_num_new_matched_tokens

        def spy(request, n):
            out = real(request, n)
            asked.append((n, out))
            return out

        e.sconn.get_num_new_matched_tokens = spy
        b = rid("div-b")
        e.add(b, toks)
        assert not until_computed(e, b, 100)
        assert not (e.computed_by_forward[b] & set(range(96))), "nothing before the hit's boundary recomputed"
        e.check_groups(b, toks, 6)
        e.check_state(b, toks, 6)
        e.close()
        return asked[0]

    assert run(True) == (64, (32, True)), "the local full-attention hit kept, kvd brings the tail and the state"
    assert run(False) == (0, (96, True)), "reconciled to no local hit, kvd brings everything"
    e = vf.FamilyEngine(P, "gpt-oss")
    assert not e.sconn.supports_divergent_local_hybrid_hits
    e.close()


@check("a position missing from kvd shortens the hit to what every group has; the engine's bytes are right")
def _():
    toks = prompt(701)
    saved("gemma3", toks)
    b = vf.FamilyEngine(P, "gemma3")
    keys = kvd.chunk_hashes(toks, vf.BLOCK, b"")
    cl = kvd.Client(P)
    cl.delete(b.sconn._lids[0], keys[3:4])
    r = rid("short")
    b.add(r, toks)
    failed = until_computed(b, r, 100)
    assert not failed, failed
    assert not (b.computed_by_forward[r] & set(range(48))), "three positions hit"
    assert set(range(48, 100)) <= b.computed_by_forward[r]
    b.check_groups(r, toks, 6)
    b.close()


@check("a block gone between lookup and load: the load fails as vLLM accepts with several groups (failed_recving), the request recomputes and is right")
def _():
    toks = prompt(801)
    saved("gpt-oss", toks)
    b = vf.FamilyEngine(P, "gpt-oss")
    evict_after_alloc(b, b.sconn._lids[0], kvd.chunk_hashes(toks, vf.BLOCK, b"")[2:3])
    r = rid("evicted")
    b.add(r, toks)
    failed = until_computed(b, r, 100)
    assert failed == [r], failed
    assert set(range(100)) <= b.computed_by_forward[r], "recomputed from scratch"
    b.check_groups(r, toks, 6)
    b.close()


def flip_under(e, key, endpoint=P):
    """One bit flipped in the pool under ``key``'s block of engine ``e``'s first layout, in
    its full-attention group (after its writer's checksum was taken); the daemon's
    checksum counters before."""
    cl = kvd.Client(endpoint)
    lid = cl.register_layout(e.sconn._geo.layout(0))["layout_id"]
    assert lid == e.sconn._lids[0]
    pin = cl.get(lid, [key])
    off = pin.offsets[0]
    pin.release()
    # In a full-attention group's bytes: every one of its blocks is loaded at a hit.
    full = next(g for g in e.sconn._geo.groups if not g.window)
    memoryview(cl.pool())[off + full.offset + 29] ^= 0x08
    return cl, cl.stats()["checksums"]


@check("a bit flipped under a cached block of a hybrid (gpt-oss): the load is not vouched for and fails as vLLM accepts with several groups (failed_recving), the request recomputes and is right, the daemon drops the block; negative control: unchecked, the flip reaches the engine")
def _():
    for verify in (True, False):
        toks = prompt(811 + verify)
        saved("gpt-oss", toks)
        keys = kvd.chunk_hashes(toks, vf.BLOCK, b"")
        old = os.environ.get("KVD_VERIFY_LOADS")
        os.environ["KVD_VERIFY_LOADS"] = "1" if verify else "0"
        try:
            b = vf.FamilyEngine(P, "gpt-oss")  # (its client reads the setting)
            cl, before = flip_under(b, keys[2])
            r = rid(f"flipped-{verify}")
            b.add(r, toks)
            failed = until_computed(b, r, 100)
        finally:
            if old is None:
                del os.environ["KVD_VERIFY_LOADS"]
            else:
                os.environ["KVD_VERIFY_LOADS"] = old
        after = cl.stats()["checksums"]
        if verify:
            assert failed == [r], failed
            assert set(range(100)) <= b.computed_by_forward[r], "recomputed from scratch"
            b.check_groups(r, toks, 6)
            assert after["damaged"] == before["damaged"] + 1, (before, after)
            assert cl.lookup(b.sconn._lids[0], keys)["prefix"] == 2, "the damaged block is gone"
        else:
            assert not failed, failed
            try:
                b.check_groups(r, toks, 6)
                raise AssertionError("the flipped bit did not reach the engine: this control cannot fail the check")
            except AssertionError as e:
                if "control" in str(e):
                    raise
            assert after["damaged"] == before["damaged"], (before, after)
        b.close()


@check("one group (MLA, fp8) loads in the step, layer by layer, as the classic layout does; a block gone between lookup and load is reported as a load error and recomputed")
def _():
    for family in ("deepseek-v3", "llama-fp8"):
        toks = prompt(1300 + len(family))
        saved(family, toks)
        b = vf.FamilyEngine(P, family)
        assert not b.sconn._async_loads
        r = rid("sync")
        b.add(r, toks)
        so, out = b.step()
        new = {x.req_id: x.num_computed_tokens for x in so.scheduled_new_reqs}
        assert new.get(r) == 96 and so.num_scheduled_tokens[r] == 4, (family, new)
        assert not out.invalid_block_ids and b.worker._waits_seen
        b.check_groups(r, toks, 6)
        b.close()
    # Gone between lookup and load: vLLM recomputes exactly the blocks from the gap on.
    toks = prompt(1400)
    saved("deepseek-v3", toks)
    b = vf.FamilyEngine(P, "deepseek-v3")
    evict_after_alloc(b, b.sconn._lids[0], kvd.chunk_hashes(toks, vf.BLOCK, b"")[3:4])
    r = rid("sync-evicted")
    b.add(r, toks)
    _, out = b.step()
    ids = b.group_ids(r)[0]
    assert out.invalid_block_ids == set(ids[3:6]), (out.invalid_block_ids, ids)
    until_computed(b, r, 100)
    assert set(range(48, 100)) <= b.computed_by_forward[r]
    b.check_groups(r, toks, 6)
    b.close()


def handoff(family, mode="pull", prefill_tp=1, decode_tp=1, ranks=False, pp=1, dcp=1):
    toks = prompt(900 + len(family) + prefill_tp * 10 + decode_tp * 3 + len(mode) + 50 * ranks + 70 * pp + 110 * dcp)
    nb = 6 // dcp  # scheduler blocks the 99 tokens before the last fill

    def engine(endpoint, **kw):
        return vf.PPFamilyEngine(endpoint, family, pp=pp, **kw) if pp > 1 else vf.FamilyEngine(endpoint, family, ranks=ranks, dcp=dcp, **kw)

    p = engine(P, role="kv_producer", tp_size=prefill_tp) if pp == 1 else engine(P, role="kv_producer")
    r = rid("prefill")
    p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run(finished(p, r))
    params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
    assert params and params["kvd"]["blocks"] == nb, params
    d = engine(D, role="kv_consumer", mode=mode, tp_size=decode_tp) if pp == 1 else engine(D, role="kv_consumer", mode=mode)
    r2 = rid("decode")
    d.add(r2, toks, max_tokens=2, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests[r2].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    failed = until_computed(d, r2, 100)
    assert not failed, failed
    assert not (d.computed_by_forward[r2] & set(range(96))), "the handed-off prefix was not recomputed"
    kept = d.check_groups(r2, toks, nb)
    if vf.recurrent(family):
        d.check_state(r2, toks, nb)
    d.run(finished(d, r2))
    p.close()
    d.close()
    return params, kept


@check("P/D: every family handed off by pull (and gpt-oss by push), byte-exact in every group the decode engine keeps")
def _():
    for family in FAMILIES:
        if family == "qwen3-next":
            continue  # (its own check, with its state)
        params, kept = handoff(family, "pull")
        assert len(params["kvd"]["transfers"]) == 1, (family, params)
        assert max(kept) == 6, (family, kept)
    params, kept = handoff("gpt-oss", "push")
    assert kept[1] == 6 and 0 < kept[0] < 6, kept


@check("P/D: gpt-oss between TP sizes (a worker per rank): TP 2 to 1 and 1 to 2, by pull and push, every group's heads resliced byte for byte on every rank")
def _():
    for ptp, dtp, mode in ((2, 1, "pull"), (1, 2, "pull"), (2, 1, "push")):
        params, kept = handoff("gpt-oss", mode, prefill_tp=ptp, decode_tp=dtp, ranks=True)
        assert len(params["kvd"]["transfers"]) == ptp, params
        assert kept[1] == 6 and 0 < kept[0] < 6, kept
    # Negative control: heads landing on the wrong decode heads are caught.
    from kvd.vllm_groups import GroupedGeometry

    real = GroupedGeometry.shards
    GroupedGeometry.shards = lambda self, src_tp, rank: [(s_, s0, self.total_heads // self.tp_size - d0 - n, n) for s_, s0, d0, n in real(self, src_tp, rank) or []] or None
    try:
        handoff("gpt-oss", "pull", prefill_tp=2, decode_tp=1, ranks=True)
        raise RuntimeError("swapped heads went unnoticed")
    except AssertionError as e:
        assert "differs" in str(e), e
    finally:
        GroupedGeometry.shards = real
    # MLA does not reslice (one copy per node moves as is).
    e = vf.FamilyEngine(P, "deepseek-v3")
    assert e.worker._geo.shards(2, 0) is None
    e.close()


@check(
    "P/D: recurrent hybrids between TP sizes (Qwen3-Next GDN, Jamba Mamba2; a worker per rank): TP 2 to 1 and 1 to 2, by pull and push, "
    "every rank's KV heads and its share of each layer's state (each conv sub-projection's channels, the temporal state's heads) cut from "
    "the prefill ranks that hold them, byte for byte, and the recurrence continues from it; negative control: the conv state cut as one "
    "range is caught; a Mamba2 state whose groups vLLM replicates across ranks does not reslice (a miss)"
)
def _():
    for family in ("qwen3-next", "jamba"):
        for ptp, dtp, mode in ((2, 1, "pull"), (1, 2, "pull"), (2, 1, "push")):
            params, kept = handoff(family, mode, prefill_tp=ptp, decode_tp=dtp, ranks=True)
            assert len(params["kvd"]["transfers"]) == ptp and len(params["kvd"]["state_transfers"]) == ptp, params
            assert kept[-1] == 6, (family, kept)
    import kvd.vllm_groups as vg

    real = vg.split_of

    def one_range(spec):
        sp = real(spec)
        return None if sp is None else vg.replace(sp, segments=(sum(sp.segments),))

    vg.split_of = one_range
    try:
        handoff("qwen3-next", "pull", prefill_tp=2, decode_tp=1, ranks=True)
        raise RuntimeError("a conv state cut as one range went unnoticed")
    except AssertionError as e:
        assert "recurrent state" in str(e) or "differs" in str(e), e
    finally:
        vg.split_of = real
    # Mamba2 with one group on TP 2: vLLM gives each rank a copy of the group's B and C,
    # which no cut of a TP-1 page is: the decode engine computes the prompt, rightly.
    vf.FAMILIES["jamba"]["mamba_n_groups"] = 1
    try:
        toks = prompt(1777)
        p = vf.FamilyEngine(P, "jamba", role="kv_producer", tp_size=2, ranks=True)
        r = rid("one-group-prefill")
        p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(finished(p, r))
        params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
        d = vf.FamilyEngine(D, "jamba", role="kv_consumer", tp_size=1, ranks=True)
        r = rid("one-group-decode")
        d.add(r, toks, max_tokens=2, kv_transfer_params=params)
        until_computed(d, r, 100)
        assert set(range(96)) <= d.computed_by_forward[r], "computed, not loaded"
        d.check_groups(r, toks, 6)
        d.check_state(r, toks, 6)
        d.run(finished(d, r))
        p.close()
        d.close()
    finally:
        vf.FAMILIES["jamba"]["mamba_n_groups"] = 2


@check("P/D: Qwen3-Next (GDN + full attention) handed off by pull and by push: the KV of every position and the state at the boundary, byte-exact")
def _():
    for mode in ("pull", "push"):
        params, kept = handoff("qwen3-next", mode)
        assert len(params["kvd"]["transfers"]) == 1 and len(params["kvd"]["state_transfers"]) == 1, params
        assert kept[-1] == 6, kept


@check("P/D: DeepSeek-V3 (MLA) from a TP-2 prefill to a TP-1 decode and back: one latent copy, one transfer")
def _():
    with rank0():
        for ptp, dtp in ((2, 1), (1, 2)):
            params, kept = handoff("deepseek-v3", prefill_tp=ptp, decode_tp=dtp)
            assert len(params["kvd"]["transfers"]) == 1, params
            assert kept == [6], kept


@check(
    "decode-context parallelism with MLA (DeepSeek-V3, TP 2, DCP 2): the latent kept once per DCP rank, each holding the tokens vLLM deals it; "
    "a hit byte-exact on every rank; P/D between equal engines by pull and push; negative control: a copy per node blind to DCP is caught; "
    "hybrids (sliding, recurrent) with DCP refused by name"
)
def _():
    toks = prompt(1500)
    a = vf.FamilyEngine(P, "deepseek-v3", tp_size=2, ranks=True, dcp=2)
    lays = [a.sconn._geo.layout(i) for i in range(a.sconn._geo.num_layouts)]
    assert [(x["model"].rsplit("#", 1)[1], x["tp_size"], x["tokens_per_block"]) for x in lays] == [("dcp0/2,1", 1, 16), ("dcp1/2,1", 1, 16)], lays
    assert [w._layout_index for w in a.workers] == [0, 1] and [w._saves_here for w in a.workers] == [True, True]
    r = rid("dcp-mla")
    a.add(r, toks)
    a.run(finished(a, r))
    a.close()
    b = vf.FamilyEngine(P, "deepseek-v3", tp_size=2, ranks=True, dcp=2)
    r = rid("dcp-mla-hit")
    b.add(r, toks)
    assert not until_computed(b, r, 100)
    assert not (b.computed_by_forward[r] & set(range(96))), "the hit's tokens were not recomputed"
    assert b.check_groups(r, toks, 3) == [3]
    b.close()
    # Negative control: one latent copy per node, blind to DCP (rank 1 loads rank 0's tokens).
    from kvd.vllm_groups import GroupedGeometry

    real = GroupedGeometry.layout_index
    GroupedGeometry.layout_index = lambda self, stage, rank: 0
    try:
        blind = vf.FamilyEngine(P, "deepseek-v3", tp_size=2, ranks=True, dcp=2)
    finally:
        GroupedGeometry.layout_index = real
    r = rid("dcp-mla-blind")
    blind.add(r, toks)
    assert not until_computed(blind, r, 100)
    caught(lambda: blind.check_groups(r, toks, 3), "another rank's tokens")
    blind.close()
    for mode in ("pull", "push"):
        params, kept = handoff("deepseek-v3", mode, prefill_tp=2, decode_tp=2, ranks=True, dcp=2)
        assert params["kvd"]["dcp"] == [2, 1] and len(params["kvd"]["transfers"]) == 2 and kept == [3], (params, kept)
    # Recurrent state beside attention (vLLM plans it with DCP), and a sliding window
    # (vLLM's planner refuses it itself; the connector too, given such groups).
    try:
        vf.FamilyEngine(P, "qwen3-next", tp_size=2, dcp=2).close()
        raise AssertionError("recurrent state with DCP accepted")
    except KvdConfigError as e:
        assert "recurrent state with decode-context parallelism" in str(e), e
    cfg = ve.vllm_config(P)
    cfg.parallel_config.decode_context_parallel_size = 2
    names = [vf.layer_name(i) for i in range(2)]
    full = FullAttentionSpec(block_size=vf.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=vf.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=32)
    try:
        KvdConnector(cfg, KVConnectorRole.SCHEDULER, ve.kv_cache_config(groups=[KVCacheGroupSpec(layer_names=names[:1], kv_cache_spec=full), KVCacheGroupSpec(layer_names=names[1:], kv_cache_spec=swa)]))
        raise AssertionError("a sliding window with DCP accepted")
    except KvdConfigError as e:
        assert "with decode-context parallelism is not supported" in str(e), e


PP_FAMILIES = ("gpt-oss", "deepseek-v3", "jamba")


@check(
    "pipeline parallelism of grouped layouts (gpt-oss, DeepSeek-V3, Jamba; PP 2): each stage stores its layers of every group under a layout "
    "its worker tells the scheduler; a hit needs every stage's blocks and is byte-exact in every group; P/D between PP-2 engines; "
    "negative controls: one stage's block missing shortens the hit, a scheduler that never heard the stages finds no hit"
)
def _():
    for family in PP_FAMILIES:
        toks = prompt(1300 + len(family))
        a = vf.PPFamilyEngine(P, family)
        lays = a.sconn._stage_layouts[0]
        assert [x["model"].rsplit("#", 1)[1] for x in lays] == ["pp0/2", "pp1/2"], lays
        assert sum(x["num_layers"] for x in lays) == sum(1 for i in range(len(a.layer_names())) if not a.is_state(i)), lays
        r = rid(f"pp-{family}")
        a.add(r, toks)
        a.run(finished(a, r))
        a.close()
        b = vf.PPFamilyEngine(P, family)
        r = rid(f"pp-hit-{family}")
        b.add(r, toks)
        assert not until_computed(b, r, 100)
        assert not (b.computed_by_forward[r] & set(range(96))), (family, "the hit's positions were not recomputed")
        kept = b.check_groups(r, toks, 6)
        assert max(kept) == 6, (family, kept)
        if vf.recurrent(family):
            b.check_state(r, toks, 6)
        b.close()
        # Stage 1's block of the third position gone: no stage hits past it (and a
        # recurrent model, whose state sits at the prompt's last boundary, not at all).
        c = vf.PPFamilyEngine(P, family)
        kvd.Client(P).delete(c.sconn._lids[-1], kvd.chunk_hashes(toks, vf.BLOCK, b"")[2:3])
        r = rid(f"pp-short-{family}")
        c.add(r, toks)
        assert not until_computed(c, r, 100)
        short = 0 if vf.recurrent(family) else 32
        assert not (c.computed_by_forward[r] & set(range(short))) and set(range(short, 100)) <= c.computed_by_forward[r], (family, sorted(c.computed_by_forward[r])[:4])
        c.check_groups(r, toks, 6)
        c.close()
        # A scheduler that never got the workers' layouts: no hit, no handoff.
        n = vf.PPFamilyEngine(P, family, handshake=False)
        r = rid(f"pp-blind-{family}")
        n.add(r, toks)
        assert not until_computed(n, r, 100)
        assert set(range(100)) <= n.computed_by_forward[r]
        n.close()
        params, kept = handoff(family, pp=2)
        assert params["kvd"]["pp"] == 2 and len(params["kvd"]["transfers"]) == 2, params
        assert len(params["kvd"].get("state_transfers", [])) == (2 if vf.recurrent(family) else 0), params
        assert max(kept) == 6, (family, kept)
    # A PP-2 prefill's handoff cannot land on a PP-1 engine: a miss, prefilled there.
    p = vf.PPFamilyEngine(P, "gpt-oss", role="kv_producer", lease_s=1)
    toks = prompt(1399)
    r = rid("pp-prefill")
    p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run(finished(p, r))
    params = json.loads(json.dumps(p.outputs[r].kv_transfer_params))
    p.close()
    one = vf.FamilyEngine(D, "gpt-oss", role="kv_consumer")
    r = rid("pp-mismatch")
    one.add(r, toks, max_tokens=2, kv_transfer_params=params)
    assert not until_computed(one, r, 100)
    assert set(range(100)) <= one.computed_by_forward[r]
    one.close()
    expired(P, params["kvd"]["transfers"])  # (nobody admitted them)


@check("the CUDA path's staged copies (one gather and one indexed copy per layer) move the same bytes as the CPU path's direct ones, in every family")
def _():
    for family in FAMILIES:
        e = vf.FamilyEngine(P, family)
        w = e.worker
        if not w._geo.grouped:
            e.close()
            continue
        e.fill_random(5)
        for cp in filter(None, (w._gcopy, w._scopy)):
            bb = sum(p.layer_bytes * len(p.layer_names) for p in cp.plans)
            slot = -(-bb // 4096) * 4096
            ng = len(cp.plans)
            ids, offs = [(5,) * ng, (1,) * ng, (9,) * ng], [0, 3 * slot, slot]
            pools = []
            for staged in (True, False):
                cp.staged = staged
                pool = torch.zeros(4 * slot, dtype=torch.uint8)
                cp.copy_out(pool, offs, ids)
                pools.append(pool)
            assert torch.equal(pools[0], pools[1]), family
            before = {n: t.clone() for n, t in e.kv.items()}
            for staged in (True, False):
                cp.staged = staged
                dst = [(20 + staged,) * ng, (22 + staged,) * ng, (24 + staged,) * ng]
                cp.copy_in(pools[0], offs, dst)
            names = [n for p in cp.plans for n in p.layer_names]
            for li, (plan, t, _, r) in enumerate(cp.layers):
                src = before[names[li]]
                for src_b, b in zip((5, 1, 9), (20, 22, 24)):
                    for d in (b, b + 1):  # staged, direct
                        assert torch.equal(t[d * r : (d + 1) * r], src[src_b * r : (src_b + 1) * r]), (family, li, d)
            cp.staged = None
        e.close()


@check("multimodal prompts are keyed by their items as vLLM's prefix cache keys them: the same image hits, another image at the same place hits only the blocks before it; prompt embeddings stay out")
def _():
    from kvd.vllm_layout import request_keys
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    toks = prompt(1001)

    def req(ident, offset=40, **kw):
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=offset, length=30))] if ident else None
        return Request(rid("mm"), toks, SamplingParams(max_tokens=1), None, mm_features=mm, **kw)

    a, b, text = (request_keys(req(i), vf.BLOCK) for i in ("img-A", "img-B", None))
    assert a[:2] == b[:2] == text[:2], "blocks before the image are the text prompt's"
    assert a[2] != b[2] and a[2] != text[2] and not set(a[2:]) & set(b[2:]), "from the image's block on, the image counts"
    assert request_keys(req("img-A"), vf.BLOCK) == a, "deterministic"
    moved = request_keys(req("img-A", offset=56), vf.BLOCK)
    assert moved[:3] == text[:3] and moved[3:] != a[3:], "the same image elsewhere is another prompt"
    salted = request_keys(req("img-A", cache_salt="tenant-x"), vf.BLOCK)
    assert not set(salted) & set(a), "the cache salt still separates"
    # In the scheduler: blocks stored under the image-A keys hit for image A only.
    s = KvdConnector(ve.vllm_config(P), KVConnectorRole.SCHEDULER, ve.kv_cache_config())
    cl = kvd.Client(P)
    bb = cl.register_layout(s._geo.layout(0))["block_bytes"]
    cl.store(s._lids[0], a, [b"\0" * bb] * len(a))
    assert s.get_num_new_matched_tokens(req("img-A"), 0) == (96, False)
    assert s.get_num_new_matched_tokens(req("img-B"), 0) == (32, False)
    emb = Request(rid("emb"), None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(100, 8))
    assert request_keys(emb, vf.BLOCK) is None and s.get_num_new_matched_tokens(emb, 0) == (0, False)


@check(
    "refused at start, naming what kvd cannot describe: recurrent state without vLLM's align mode, states per token, DeepSeek-V4.1's bounded-replay window and "
    "compressor ring, a chunked group of blocks smaller than a position, tensors that do not match the spec"
)
def _():
    cfg = ve.vllm_config(P)
    names = [vf.layer_name(i) for i in range(2)]

    def refused(groups, needle, role=KVConnectorRole.SCHEDULER):
        try:
            KvdConnector(cfg, role, ve.kv_cache_config(groups=groups))
        except KvdConfigError as e:
            assert needle in str(e), (needle, str(e))
            return
        raise AssertionError(f"accepted: {needle}")

    full = FullAttentionSpec(block_size=vf.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mamba = MambaSpec(block_size=vf.BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float16, torch.float32))
    refused([KVCacheGroupSpec(layer_names=names[:1], kv_cache_spec=full), KVCacheGroupSpec(layer_names=names[1:], kv_cache_spec=mamba)], "mamba_cache_mode")
    from fractions import Fraction

    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, CircularBufferSpec, SlidingWindowMLASpec

    pooled = MLAAttentionSpec(block_size=vf.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16, tokens_per_state=Fraction(1, 2))
    refused([KVCacheGroupSpec(layer_names=names, kv_cache_spec=pooled)], "tokens_per_state")
    v41 = SlidingWindowMLASpec(block_size=vf.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=32, bounded_replay=True, model_version="deepseek_v4")
    refused([KVCacheGroupSpec(layer_names=names, kv_cache_spec=v41)], "bounded-replay")
    ring = CircularBufferSpec(block_size=vf.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    refused([KVCacheGroupSpec(layer_names=names, kv_cache_spec=ring)], "CircularBufferSpec")
    big = FullAttentionSpec(block_size=2 * vf.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    local = ChunkedLocalAttentionSpec(block_size=vf.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, attention_chunk_size=32)
    refused([KVCacheGroupSpec(layer_names=names[:1], kv_cache_spec=big), KVCacheGroupSpec(layer_names=names[1:], kv_cache_spec=local)], "chunked group of 16-token blocks")
    # A pipeline stage with no attention layers (Qwen3-Next's first two layers are GDN).
    try:
        vf.PPFamilyEngine(P, "qwen3-next").close()
        raise AssertionError("a stage of recurrent layers only accepted")
    except KvdConfigError as e:
        assert "pipeline stage 0 holds no attention layers" in str(e), e
    # K and V of different sizes: described (content = K + V), not refused.
    odd = FullAttentionSpec(block_size=vf.BLOCK, num_kv_heads=2, head_size=16, head_size_v=8, dtype=torch.float16)
    s = KvdConnector(cfg, KVConnectorRole.SCHEDULER, ve.kv_cache_config(groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=odd)]))
    assert s._geo.grouped and s._geo.groups[0].content == 24
    # A worker handed tensors that are not the spec's.
    e = vf.FamilyEngine(P, "gpt-oss")
    kvcc = e.kvcc
    e.close()
    w = KvdConnector(e.config, KVConnectorRole.WORKER, kvcc)
    wrong = {n: torch.zeros((kvcc.num_blocks, 3, vf.BLOCK, 32), dtype=torch.float16) for g in kvcc.kv_cache_groups for n in g.layer_names}
    try:
        w.register_kv_caches(wrong)
        raise AssertionError("wrong shape accepted")
    except KvdConfigError as x:
        assert "does not match its group's spec" in str(x), x


if __name__ == "__main__":
    logging.getLogger("vllm").setLevel(logging.ERROR)
    run()
