"""The kvd package's DMA path on a GPU (run by gpu-check.sh): GPU tensor -> registered
pool slots -> committed -> pinned -> back to the GPU, byte-identical, and its GB/s
against torch's own pinned-memory copies of the same size in the same run."""

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
d2h = timed(lambda: [pool[o:o + bb].copy_(src[i], non_blocking=True) for i, o in enumerate(offs)])
batch.commit()
pin = c.get(lid, keys)
dst = torch.zeros_like(src)
h2d = timed(lambda: [dst[i].copy_(pool[o:o + bb], non_blocking=True) for i, o in enumerate(pin.offsets)])
pin.release()
assert torch.equal(src, dst), "bytes differ after GPU -> pool -> GPU"
pinned = torch.empty((n, bb), dtype=torch.uint8, pin_memory=True)
c_d2h = timed(lambda: [pinned[i].copy_(src[i], non_blocking=True) for i in range(n)])
c_h2d = timed(lambda: [dst[i].copy_(pinned[i], non_blocking=True) for i in range(n)])
gb = n * bb / 1e9
print(f"device->pool {gb / d2h:.1f} GB/s ({gb / d2h / (gb / c_d2h):.2f}x torch pinned {gb / c_d2h:.1f})")
print(f"pool->device {gb / h2d:.1f} GB/s ({gb / h2d / (gb / c_h2d):.2f}x torch pinned {gb / c_h2d:.1f})")
print("torch DMA check: byte-identical")
