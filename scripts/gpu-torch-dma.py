"""The kvd package's DMA path on a GPU (run by gpu-check.sh): GPU tensor -> registered
pool slots -> committed -> pinned -> back to the GPU, byte-identical, and its GB/s
against torch's own pinned-memory copies of the same size in the same run, first and
second pass; then the vLLM connector's path (one indexing kernel over the pool's device
mapping per call: whole blocks both ways, 64 KiB layers) against one DMA per piece."""

import math
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


# The vLLM connector's path (kvd._device_view: the pool's device mapping; one indexing
# kernel moves every piece of a call), on whole blocks and on one layer of each block
# (64 KiB, a layer-wise save or load), against one DMA per piece. Reported; a wrong byte
# fails the check, a driver that gives no mapping is said and does not.
view = kvd._device_view(pool)
if view is None:
    print("no device mapping of the pool: the connector copies one DMA per slot")
else:
    batch2 = c.alloc(lid, kvd.chunk_hashes(list(range(16 * n)), 16, b"dma-kernel"))
    g = math.gcd(bb // 32, *pin.offsets, *batch2.offsets)
    u = min(4096, g & -g)  # row bytes, as the connector picks them
    assert u >= 8, f"slots {u}-byte aligned"
    rows = view[: view.numel() - view.numel() % u].view(torch.int64).view(-1, u // 8)

    def idx(starts, length):
        first = torch.tensor(starts, dtype=torch.long, device="cuda") // u
        return (first[:, None] + torch.arange(length // u, device="cuda")).reshape(-1)

    whole = idx(pin.offsets, bb)
    flat = torch.empty((n * bb // u, u // 8), dtype=torch.int64, device="cuda")
    k_h2d = [timed(lambda: torch.index_select(rows, 0, whole, out=flat)) for _ in range(2)]
    assert torch.equal(flat.view(torch.uint8).view(n, bb), src), "one-kernel read differs"
    print(f"one kernel, whole blocks, pool->device: {gb / k_h2d[0]:.1f} / {gb / k_h2d[1]:.1f} GB/s "
          f"(first / second; {c_h2d[1] / k_h2d[1]:.2f}x torch pinned)")
    # Write back into a second allocation's slots (the bytes read above), then read them.
    whole2 = idx(batch2.offsets, bb)
    k_d2h = [timed(lambda: rows.index_copy_(0, whole2, flat)) for _ in range(2)]
    batch2.commit()
    assert all(torch.equal(pool[o:o + bb].cuda(), src[i]) for i, o in enumerate(batch2.offsets)), "one-kernel write differs"
    print(f"one kernel, whole blocks, device->pool: {gb / k_d2h[0]:.1f} / {gb / k_d2h[1]:.1f} GB/s "
          f"(first / second; {c_d2h[1] / k_d2h[1]:.2f}x torch pinned)")
    # One layer (64 KiB) of every block: 32 calls of n pieces, as a layer-wise load makes.
    lb = bb // 32
    layer_idx = [idx([o + l * lb for o in pin.offsets], lb) for l in range(32)]
    out = torch.empty((n * lb // u, u // 8), dtype=torch.int64, device="cuda")
    k_layers = timed(lambda: [torch.index_select(rows, 0, i, out=out) for i in layer_idx])
    per = timed(lambda: [dst[i, l * lb:(l + 1) * lb].copy_(pool[o + l * lb:o + (l + 1) * lb], non_blocking=True)
                         for l in range(32) for i, o in enumerate(pin.offsets)])
    print(f"64 KiB layers, pool->device: one kernel per layer {gb / k_layers:.1f} GB/s, one DMA per piece {gb / per:.1f} GB/s "
          f"({c_h2d[1] / k_layers:.2f}x / {c_h2d[1] / per:.2f}x torch pinned whole blocks)")
pin.release()
print("torch DMA check: byte-identical")
