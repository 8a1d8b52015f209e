"""The kvd package's DMA path on a GPU (run by gpu-check.sh): GPU tensor -> registered
pool slots -> committed -> pinned -> back to the GPU, byte-identical, and its GB/s
against torch's own pinned-memory copies of the same size in the same run, first and
second pass; then an experiment (reported, never failing): one indexing kernel over the
mapped pool, and vLLM-sized pieces one DMA each."""

import sys
import time

import torch

import kvd

ep = sys.argv[1]
assert torch.cuda.is_available(), "no CUDA device for the DMA check"
c = kvd.Client(ep)
layout = {"model": "kvd-dma", "num_layers": 32, "kv_parts": 2, "num_kv_heads": 8, "head_dim": 128,
          "dtype": "bf16", "tokens_per_block": 16, "tp_size": 1, "tp_rank": 0,
          "order": "layer_part_token_head"}
info = c.register_layout(layout)
lid, bb = info["layout_id"], info["block_bytes"]
n = 64  # 64 x 2 MiB = 128 MiB
pool = kvd.torch_pool(c)
src = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device="cuda")
keys = kvd.chunk_hashes(list(range(16 * n)), 16, b"dma")


def timed(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t


batch = c.alloc(lid, keys)
offs = batch.offsets
# Pass 1 is the first DMA into the pool after kvd.torch_pool (which warms CUDA's copy
# paths up at registration): the target is >= 0.9x torch from the first timed
# pass. Pass 2 is the steady state.
d2h = [timed(lambda: [pool[o:o + bb].copy_(src[i], non_blocking=True) for i, o in enumerate(offs)]) for _ in range(2)]
batch.commit()
pin = c.get(lid, keys)
dst = torch.zeros_like(src)
h2d = [timed(lambda: [dst[i].copy_(pool[o:o + bb], non_blocking=True) for i, o in enumerate(pin.offsets)]) for _ in range(2)]
assert torch.equal(src, dst), "bytes differ after GPU -> pool -> GPU"
pinned = torch.empty((n, bb), dtype=torch.uint8, pin_memory=True)
c_d2h = [timed(lambda: [pinned[i].copy_(src[i], non_blocking=True) for i in range(n)]) for _ in range(2)]
c_h2d = [timed(lambda: [dst[i].copy_(pinned[i], non_blocking=True) for i in range(n)]) for _ in range(2)]
gb = n * bb / 1e9
for p, name in ((0, "first pass"), (1, "second pass")):
    print(f"{name}: device->pool {gb / d2h[p]:.1f} GB/s ({c_d2h[p] / d2h[p]:.2f}x torch pinned {gb / c_d2h[p]:.1f}); "
          f"pool->device {gb / h2d[p]:.1f} GB/s ({c_h2d[p] / h2d[p]:.2f}x torch pinned {gb / c_h2d[p]:.1f})")


# An experiment for the connector's CUDA path (not yet its code): the registered pool as a
# CUDA tensor (mapped, and this device reads registered memory at its host address), so
# one indexing kernel moves every slot of a call instead of a DMA per slot; and 32 KiB
# pieces per layer as vLLM's per-layer tensors give them, per-piece DMA against that
# kernel. Its figures say whether the connector should switch.
class _Mapped:
    def __init__(self, addr, size):
        self.__cuda_array_interface__ = {"shape": (size // 8,), "typestr": "<i8", "data": (addr, False), "version": 3}


try:
    pool_dev = torch.as_tensor(_Mapped(c.pool().address, len(c.pool())), device="cuda")
    assert all(o % 8 == 0 for o in pin.offsets), "slots not 8-byte aligned"
    idx = torch.cat([torch.arange(o // 8, (o + bb) // 8, device="cuda") for o in pin.offsets])
    flat = torch.empty(n * bb // 8, dtype=torch.int64, device="cuda")
    k_h2d = [timed(lambda: torch.index_select(pool_dev, 0, idx, out=flat)) for _ in range(2)]
    assert torch.equal(flat.view(torch.uint8).view(n, bb), src), "one-kernel read differs"
    print(f"one indexing kernel over the mapped pool, pool->device: {gb / k_h2d[0]:.1f} / {gb / k_h2d[1]:.1f} GB/s "
          f"(first / second; {c_h2d[1] / k_h2d[1]:.2f}x torch pinned)")
    # vLLM's pieces: 64 x 32 KiB per 2 MiB block, one DMA each, against the same bytes
    # by one kernel.
    pieces = [(i, o + j * (32 << 10)) for i, o in enumerate(pin.offsets) for j in range(bb // (32 << 10))]
    dstp = torch.empty((n, bb), dtype=torch.uint8, device="cuda")
    per = [timed(lambda: [dstp[i, (o - pin.offsets[i]):(o - pin.offsets[i]) + (32 << 10)].copy_(pool[o:o + (32 << 10)], non_blocking=True) for i, o in pieces]) for _ in range(2)]
    print(f"32 KiB pieces, one DMA each, pool->device: {gb / per[1]:.1f} GB/s ({c_h2d[1] / per[1]:.2f}x torch pinned whole blocks)")
except Exception as e:  # an experiment: say what happened, do not fail the check
    print(f"one-kernel experiment did not run: {type(e).__name__}: {e}")
pin.release()
print("torch DMA check: byte-identical")
