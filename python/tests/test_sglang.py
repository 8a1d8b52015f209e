"""The kvd SGLang HiCache backend, built by SGLang 0.5.23's own StorageBackendFactory over
SGLang's real MHA host pool (on CPU), against a real daemon (endpoint in argv[1]).

Pages go through the backend the way SGLang's HiCacheController moves them: its own
``_page_set_zero_copy`` / ``_page_get_zero_copy`` (interface_v1) and ``_generic_page_set``
/ ``_generic_page_get`` (the plain variants), called on a stand-in holding just the fields
they read. Prints "N passed, M failed".
"""

import os
import shutil
import sys
import tempfile
import uuid

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

sys.path.insert(0, os.path.dirname(__file__))
from checks import check, checkpoint, run, start_daemon  # noqa: E402

EP, KVD_BIN = sys.argv[1], sys.argv[2]
L, H, D, PS, N = 2, 2, 16, 16, 256
RUN = uuid.uuid4().hex[:8]  # a daemon may outlive a run: fresh keys


def host_pool(layout):
    """SGLang's real MHA host pool on CPU, its device side a pair of per-layer tensors."""
    k = tuple(torch.zeros((N, H, D), dtype=torch.float16) for _ in range(L))
    v = tuple(torch.zeros((N, H, D), dtype=torch.float16) for _ in range(L))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PS, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.float16, device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=N, start_layer=0, end_layer=L)


def backend(pool, model="kvd-test/sglang-tiny", tp_rank=0, tp_size=1, mla=False, v1=True, endpoint=None):
    extra = {"backend_name": "kvd", "module_path": "kvd.sglang_backend", "class_name": "KvdHiCacheStorage",
             "interface_v1": int(v1), "endpoint": endpoint or EP}
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name=model, extra_config=extra)
    # What HiCacheController does: the factory, then the pool.
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


class Controller:
    """The fields HiCacheController's page movers read."""

    def __init__(self, b, pool):
        self.storage_backend, self.storage_host_pool, self.mem_pool_host, self.page_size = b, pool, pool, PS


class Op:
    request_id = "test"

    def is_terminated(self):
        return False


def fill(pool, pages, seed):
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.get_data_page(p * PS, flat=False)
        pool.set_from_flat_data_page(p * PS, (torch.rand(page.shape, generator=g) * 8 - 4).to(torch.float16).flatten())


def canonical(pool, page):
    """A page as [layer, K|V, token, head, dim], read with the pool's own accessors."""
    x = pool.get_data_page(page * PS, flat=True)
    dims = {"layer_first": (2, L, PS, H, D), "page_first": (2, PS, L, H, D),
            "page_first_direct": (2, L, PS, H, D), "page_head": (2, H, PS, L, D)}[pool.layout]
    perm = {"layer_first": (1, 0, 2, 3, 4), "page_first": (2, 0, 1, 3, 4),
            "page_first_direct": (1, 0, 2, 3, 4), "page_head": (3, 0, 2, 1, 4)}[pool.layout]
    return x.reshape(dims).permute(perm).contiguous()


def indices(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def keys(tag, n):
    return [f"{RUN}-{tag}-{i}" for i in range(n)]


LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@check("each host layout: set -> exists -> get round-trips byte for byte (SGLang's zero-copy movers)")
def _():
    for layout in LAYOUTS:
        pool = host_pool(layout)
        b = backend(pool)
        c = Controller(b, pool)
        src = [1, 2, 3, 5]
        fill(pool, src, seed=len(layout))
        want = [canonical(pool, p) for p in src]
        ks = keys(layout, 4)
        assert HiCacheController._page_set_zero_copy(c, ks, indices(src)) is True, layout
        assert b.batch_exists(ks) == 4
        assert b.batch_exists(ks[:2] + keys("missing", 1) + ks[3:]) == 2, "the leading run only"
        assert b.exists(ks[0]) and not b.exists(keys("missing", 1)[0])
        # Into other pages of the same pool.
        dst = [7, 8, 9, 10]
        assert HiCacheController._page_get_zero_copy(c, Op(), ks, indices(dst)) == 4
        for p, w in zip(dst, want):
            assert torch.equal(canonical(pool, p), w), f"{layout}: page {p}"
        # A miss stops the run: SGLang loads the leading pages only.
        assert b.batch_get_v1(ks[:1] + keys("missing", 1), indices([11, 12])) == [True, False]


@check("a bit flipped in the pool under a stored page: that page reads False (SGLang loads the pages before it), the daemon drops it")
def _():
    import kvd
    from kvd.sglang_backend import kvd_key

    pool = host_pool("layer_first")
    b = backend(pool)
    c = Controller(b, pool)
    fill(pool, [1, 2, 3], seed=77)
    want = [canonical(pool, p) for p in (1, 2, 3)]
    ks = keys("flip", 3)
    assert all(b.batch_set_v1(ks, indices([1, 2, 3])))
    cl = kvd.Client(EP)
    lid = cl.register_layout(b._layout)["layout_id"]
    assert lid == b._lid
    pin = cl.get(lid, [kvd_key(ks[1])])
    off = pin.offsets[0]
    pin.release()
    view = memoryview(cl.pool())
    view[off + 3] ^= 0x80
    before = cl.stats()["checksums"]["damaged"]
    assert b.batch_get_v1(ks, indices([5, 6, 7])) == [True, False, True]
    assert torch.equal(canonical(pool, 5), want[0]) and torch.equal(canonical(pool, 7), want[2])
    assert HiCacheController._page_get_zero_copy(c, Op(), ks, indices([8, 9, 10])) == 1, "the leading run only"
    assert cl.stats()["checksums"]["damaged"] == before + 1
    assert b.batch_exists(ks) == 1, "the damaged page is gone"


@check("pages are stored canonically: a layer_first pool reads what a page_head pool wrote")
def _():
    a, z = host_pool("page_head"), host_pool("layer_first")
    ba, bz = backend(a), backend(z)
    fill(a, [4, 6], seed=9)
    ks = keys("cross", 2)
    assert all(ba.batch_set_v1(ks, indices([4, 6])))
    assert bz.batch_get_v1(ks, indices([0, 1])) == [True, True]
    assert torch.equal(canonical(z, 0), canonical(a, 4)) and torch.equal(canonical(z, 1), canonical(a, 6))


@check("the plain variants (SGLang's generic movers) read and write the same pages as v1")
def _():
    for layout in ("page_first", "layer_first"):
        pool = host_pool(layout)
        b = backend(pool, v1=False)
        c = Controller(b, pool)
        fill(pool, [2, 3], seed=3)
        ks = keys("plain-" + layout, 2)
        assert HiCacheController._generic_page_set(c, ks, indices([2, 3])) is True
        assert HiCacheController._generic_page_get(c, Op(), ks, indices([12, 13])) == 2
        assert torch.equal(canonical(pool, 12), canonical(pool, 2)) and torch.equal(canonical(pool, 13), canonical(pool, 3))
        # ... and v1 reads what the plain set wrote.
        assert b.batch_get_v1(ks, indices([20, 21])) == [True, True]
        assert torch.equal(canonical(pool, 20), canonical(pool, 2))
        assert b.get(keys("missing", 1)[0]) is None
        got = b.get(ks[1])
        assert got is not None and torch.equal(got, pool.get_data_page(3 * PS))


@check("keys are namespaced by layout: another model or TP rank never sees them")
def _():
    pool = host_pool("page_first")
    b = backend(pool)
    fill(pool, [1], seed=1)
    ks = keys("ns", 1)
    assert b.batch_set_v1(ks, indices([1])) == [True]
    assert backend(host_pool("page_first"), model="kvd-test/other").batch_exists(ks) == 0
    assert backend(host_pool("page_first"), tp_rank=1, tp_size=2).batch_exists(ks) == 0
    assert b.batch_set_v1(ks, indices([1])) == [True], "a page kvd already holds is a success"


@check("the model is its weights: one checkpoint under two paths shares pages, replaced weights do not (issue 32.4)")
def _():
    import shutil

    root = tempfile.mkdtemp(prefix="kvd-sgl-model-")
    first = checkpoint(os.path.join(root, "a"), seed=1)
    shutil.copytree(first, os.path.join(root, "elsewhere", "b"))
    pool = host_pool("page_first")
    fill(pool, [1, 2], seed=11)
    ks = keys("identity", 2)
    assert all(backend(pool, model=first).batch_set_v1(ks, indices([1, 2])))
    other_path = backend(host_pool("page_first"), model=os.path.join(root, "elsewhere", "b"))
    assert other_path.batch_exists(ks) == 2, "the same weights under another path share"
    # SGLang tags the name with the host pool's page format when it has one
    assert backend(host_pool("page_first"), model=first + "-fmt1").batch_exists(ks) == 0, "another format tag"
    checkpoint(first, seed=2)  # the weights replaced in place
    assert backend(host_pool("page_first"), model=first).batch_exists(ks) == 0, "replaced weights share nothing"
    shutil.rmtree(root)


R, RP = 32, 16  # kv_lora_rank, qk_rope_head_dim


def mla_pool(layout):
    """SGLang's real MLA host pool on CPU (DeepSeek-V3's latent: kv_lora_rank + RoPE part)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    bufs = tuple(torch.zeros((N, 1, R + RP), dtype=torch.float16) for _ in range(L))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(L)), device_layer_num=L, page_size=PS, kv_lora_rank=R, qk_rope_head_dim=RP,
                         kv_cache_dim=R + RP, dtype=torch.float16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=N, start_layer=0, end_layer=L, target_layer_num=L)


def mla_canonical(pool, page):
    """An MLA page as [layer, token, latent], read with the pool's own accessor."""
    x = pool.get_data_page(page * PS, flat=True)
    if pool.layout == "page_first":
        return x.reshape(PS, L, R + RP).permute(1, 0, 2).contiguous()
    return x.reshape(L, PS, R + RP)


@check("MLA (SGLang's MLA host pool, each of its layouts): one copy per node — rank 0 stores, a TP-2 rank 1 and another layout read it byte for byte, through the zero-copy and the plain movers")
def _():
    writer = mla_pool("layer_first")
    w = backend(writer, tp_rank=0, tp_size=2, mla=True)
    assert w._layout["groups"][0]["kind"] == "mla" and w._layout["tp_size"] == 1
    src = [1, 2, 3]
    fill(writer, src, seed=11)
    want = [mla_canonical(writer, p) for p in src]
    ks = keys("mla", 3)
    # Rank 1 of the same engine: its store succeeds without writing (rank 0 keeps the copy).
    r1 = backend(mla_pool("layer_first"), tp_rank=1, tp_size=2, mla=True)
    assert r1.batch_set_v1(ks, indices(src)) == [True] * 3 and r1.batch_exists(ks) == 0
    assert HiCacheController._page_set_zero_copy(Controller(w, writer), ks, indices(src)) is True
    for layout in ("layer_first", "page_first", "page_first_direct"):
        for rank, tp in ((1, 2), (0, 1)):
            pool = mla_pool(layout)
            b = backend(pool, tp_rank=rank, tp_size=tp, mla=True)
            assert b.batch_exists(ks) == 3, (layout, rank)
            assert HiCacheController._page_get_zero_copy(Controller(b, pool), Op(), ks, indices([7, 8, 9])) == 3
            for p, x in zip([7, 8, 9], want):
                assert torch.equal(mla_canonical(pool, p), x), (layout, rank, p)
            got = b.batch_get(ks)
            for g, x in zip(got, want):
                assert g is not None and torch.equal(b._natural(g), x), (layout, "plain get")
    # The plain set reads what the zero-copy get wrote, in another layout.
    pf = mla_pool("page_first")
    b = backend(pf, mla=True)
    fill(pf, [4], seed=12)
    k2 = keys("mla-plain", 1)
    assert b.batch_set(k2, [pf.get_data_page(4 * PS, flat=True)]) is True
    other = mla_pool("page_first_direct")
    assert backend(other, mla=True).batch_get_v1(k2, indices([5])) == [True]
    assert torch.equal(mla_canonical(other, 5), mla_canonical(pf, 4))
    # An MHA pool of the same model never sees MLA pages (another layout).
    assert backend(host_pool("layer_first")).batch_exists(ks) == 0


def mamba_pool(layout="page_first"):
    """SGLang's real Mamba state host pool on CPU (conv + temporal state per layer)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros((L, 32, 2, 8, 8), dtype=torch.float32), conv=(torch.zeros((L, 32, 3, 48), dtype=torch.float16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=32, pin_memory=False, device="cpu", layout=layout)


@check("hybrid pools through SGLang's v2 interface: KV pages and Mamba states (trailing pages) and SWA KV (another MHA pool) stored, found by SGLang's hit policies, read back byte for byte; a missing state shortens the hit")
def _():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    def pools():
        kvp, mp, swa = host_pool("page_first"), mamba_pool(), host_pool("layer_first")
        b = backend(kvp)
        b.register_mem_host_pool_v2(mp, PoolName.MAMBA)
        b.register_mem_host_pool_v2(swa, PoolName.SWA)
        return b, kvp, mp, swa

    b, kvp, mp, swa = pools()
    src = [1, 2, 3, 4]
    fill(kvp, src, seed=21)
    fill(swa, src, seed=22)
    g = torch.Generator().manual_seed(23)
    for slot in (5, 6):  # the Mamba state after page 2 and after page 4
        mp.set_from_flat_data_page(slot, torch.randint(0, 256, (mp.get_dummy_flat_data_page().numel(),), generator=g, dtype=torch.uint8))
    ks = keys("v2", 4)
    res = b.batch_set_v2([
        PoolTransfer(name=PoolName.KV, keys=ks, host_indices=indices(src)),
        PoolTransfer(name=PoolName.SWA, keys=ks, host_indices=indices(src)),
        PoolTransfer(name=PoolName.MAMBA, keys=[ks[1], ks[3]], host_indices=torch.tensor([5, 6])),
    ])
    assert res == {"kv": [True] * 4, "swa": [True] * 4, "mamba": [True, True]}, res
    # A fresh server: every pool's pages are there, the Mamba state at the boundaries it has.
    b2, kvp2, mp2, swa2 = pools()
    trailing = [PoolTransfer(name=PoolName.MAMBA, keys=[ks[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES),
                PoolTransfer(name=PoolName.SWA, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)]
    r = b2.batch_exists_v2(ks, trailing)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [2, 4]), r
    got = b2.batch_get_v2([
        PoolTransfer(name=PoolName.KV, keys=ks, host_indices=indices([7, 8, 9, 10])),
        PoolTransfer(name=PoolName.SWA, keys=ks, host_indices=indices([7, 8, 9, 10])),
        PoolTransfer(name=PoolName.MAMBA, keys=[ks[3]], host_indices=torch.tensor([11])),
    ])
    assert got == {"kv": [True] * 4, "swa": [True] * 4, "mamba": [True]}, got
    for p, q in zip(src, [7, 8, 9, 10]):
        assert torch.equal(canonical(kvp2, q), canonical(kvp, p)) and torch.equal(canonical(swa2, q), canonical(swa, p))
    assert torch.equal(mp2.get_data_page(11, flat=True), mp.get_data_page(6, flat=True)), "the state after page 4"
    # The state after page 4 gone: the hit is the boundary that still has one (page 2).
    b2._client.delete(b2._extra["mamba"][1], [kvd_key_of(ks[3])])
    assert b2.batch_exists_v2(ks, trailing).restorable_prefix_pages == [2]
    # An MHA pool of the same model never reads the Mamba pool's pages (another layout).
    assert b2._pool_prefix(b2._extra["swa"][1], [ks[1]]) == 1 and b2._pool_prefix(b2._extra["mamba"][1], ks[:1]) == 0


def kvd_key_of(k):
    from kvd.sglang_backend import kvd_key

    return kvd_key(k)


@check("refusals name the reason: an MLA layout kvd does not map, a host pool without separate K and V, mismatched indices")
def _():
    pool = host_pool("layer_first")
    try:
        backend(mla_pool("page_unified"), mla=True)
        raise AssertionError("page_unified MLA accepted")
    except ValueError as e:
        assert "MLA host pool layout 'page_unified'" in str(e), e
    b = backend(pool)
    try:
        b.batch_set_v1(keys("bad", 2), indices([1]))
        raise AssertionError("2 keys for one page accepted")
    except ValueError as e:
        assert "2 keys for 16 host indices" in str(e), e

    class Packed:
        layout, kv_buffer = "page_unified", torch.zeros(1)

    try:
        b.register_mem_pool_host(Packed())
        raise AssertionError("page_unified accepted")
    except ValueError as e:
        assert "page_unified" in str(e), e


@check("a daemon restart: pages go to the new pool, never through the old mapping")
def _():
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvd-sgl-restart-")
    proc = start_daemon(KVD_BIN, d)
    try:
        pool = host_pool("page_first")
        b = backend(pool, endpoint=f"ipc://{d}/kvd.sock")
        fill(pool, [1, 2], seed=5)
        assert all(b.batch_set_v1(keys("r1", 2), indices([1, 2])))
        proc.kill()
        proc.wait()
        os.unlink(f"{d}/kvd.sock")
        proc = start_daemon(KVD_BIN, d)
        assert b.batch_exists(keys("r1", 2)) == 0, "the new daemon holds nothing"
        assert b.batch_exists(keys("r1", 2)) == 0 and b._client.lookup(b._lid, []) is not None, "the layout is registered again"
        ks = keys("r2", 2)
        for _ in range(3):  # the first call after the restart may fail, saying so
            if all(b.batch_set_v1(ks, indices([1, 2]))):
                break
        assert b.batch_get_v1(ks, indices([30, 31])) == [True, True]
        assert torch.equal(canonical(pool, 30), canonical(pool, 1)) and torch.equal(canonical(pool, 31), canonical(pool, 2))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)  # pool, table, sockets: nothing left in /dev/shm


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
    run()
