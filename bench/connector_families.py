"""What a hybrid model's save and load cost through the vLLM connector, beside a dense
model's moving the same bytes, and beside this machine's memcpy of those bytes.

Each family is an engine of ``python/tests/vllm_families.py`` (vLLM's own KV cache
planning, its real scheduler and connector roles, CPU KV tensors) against a real daemon;
shapes are Llama-3-8B-like per layer (8 KV heads of 128, fp16, 16-token blocks). The
worker connector saves N blocks (``_save_blocks``: alloc, copy, commit) and loads them
into other blocks (``_load_pinned``: get, copy, release), the same calls a step makes
around the forward, and for a recurrent hybrid the request's one state snapshot too; each is timed over several rounds and the median taken. The ceiling
is ``torch`` copying the same bytes between two buffers (the copies the connector makes,
with no daemon).

    .venv/bin/python bench/connector_families.py --daemon target/release/kvd [--blocks 64] [--rounds 7] [--staged]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
import vllm_engine as ve  # noqa: E402
from checks import start_daemon  # noqa: E402
import vllm_families as vf  # noqa: E402
from kvd.vllm_meta import Load  # noqa: E402

H, D = 8, 128
STAGED = False
BENCH = {
    # dense: 8 full-attention layers (the classic layout)
    "dense": {"model_type": "llama", "num_hidden_layers": 8, "num_key_value_heads": H, "head_dim": D},
    # gpt-oss-like: 4 sliding + 4 full layers, the same bytes per block as dense
    "sliding+full": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "sliding_window": 128,
        "num_key_value_heads": H,
        "head_dim": D,
    },
    # Gemma-3-like: five sliding layers to one full one (many groups of one layer)
    "gemma3-like": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 128,
        "num_key_value_heads": H,
        "head_dim": D,
    },
    # DeepSeek-V3-like MLA: kv_lora_rank 512 + RoPE 64
    "mla": {"model_type": "deepseek_v3", "num_hidden_layers": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
    # Qwen3.5-like recurrent hybrid: three GDN layers to one full one; a save or load moves
    # the blocks and the request's one state snapshot (its page fits an attention page)
    "gdn+full": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_key_value_heads": H,
        "head_dim": D,
        "linear_conv_kernel_dim": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "mamba_type": "GDN_ATTN",
    },
}
# DeepSeek-V4-like (vllm_families.WIDE's layer pattern at 2x its dims): KV cache groups of
# 4- to 64-token blocks, a kvd block per 64-token scheduler block, every group a latent.
BENCH_WIDE = {
    "deepseek-v4-like": {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 6,
        "compress_ratios": [4, 16, 1, 4, 16, 1],
        "head_dim": 512,
        "swa_head_dim": 128,
        "index_head_dim": 256,
        "sliding_window": 32,
    },
}


def model_dir(d):
    """A Llama config.json of these shapes (the classic layout reads the model's KV heads)."""
    m = os.path.join(d, "model")
    os.makedirs(m, exist_ok=True)
    with open(os.path.join(m, "config.json"), "w") as f:
        f.write(ve.CONFIG.replace('"num_key_value_heads": %d' % ve.KV_HEADS, f'"num_key_value_heads": {H}')
                .replace('"head_dim": %d' % ve.HEAD, f'"head_dim": {D}').replace('"num_attention_heads": 4', '"num_attention_heads": 8'))
    return m


def measure(endpoint, family, blocks, rounds, model):
    wide = family in vf.WIDE
    e = vf.FamilyEngine(endpoint, family, num_blocks=(8 if wide else 2) * blocks + 8, model=model)
    w = e.worker
    e.fill_random(1)
    geo = w._geo
    if STAGED and geo.grouped:
        w._gcopy.staged = True  # the CUDA path's copies, run on the CPU
    grouped = geo.grouped
    ngroups = len(geo.groups) if grouped else 1
    src = [1 + i for i in range(blocks)]
    dst = [1 + blocks + i for i in range(blocks)]
    ids = (lambda bs: [tuple([b] * ngroups) for b in bs]) if grouped else (lambda bs: bs)
    if wide:
        # A position is several of a group's blocks: each its own (group tensors are separate).
        src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))

        def ids(bs):
            return [tuple(tuple(1 + (k * g.subs + j) for j in range(g.subs)) if g.per > 1 else 1 + k * 4 for g in geo.groups) for k in bs]

    states = len(geo.state_groups) if grouped else 0
    client = w._client_w()
    save, load = [], []
    for r in range(rounds):
        keys = [os.urandom(16) for _ in range(blocks)]
        t0 = time.perf_counter()
        w._save_blocks(Load(req_id="bench", keys=keys, block_ids=ids(src)))
        if states:
            w._save_state(Load(req_id="bench", keys=keys[-1:], block_ids=[tuple([src[-1]] * states)]))
        t1 = time.perf_counter()
        good = w._load_pinned(client, keys, ids(dst))
        if states:
            assert w._load_state(client, keys[-1], tuple([dst[-1]] * states))
        t2 = time.perf_counter()
        assert good == blocks, good
        save.append(t1 - t0)
        load.append(t2 - t1)
        client.delete(w._lid, keys)
        if states:
            client.delete(w._slid, keys[-1:])
    e.close()
    # memcpy ceiling of the same bytes, as the connector's copies make them
    nbytes = geo.block_bytes * blocks + (geo.state_bytes if states else 0)
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.random_(0, 255)
    cp = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        b.copy_(a)
        cp.append(time.perf_counter() - t0)
    return nbytes, statistics.median(save), statistics.median(load), statistics.median(cp), ngroups + states


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemon", default=os.path.join(HERE, "..", "target", "release", "kvd"))
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--staged", action="store_true", help="grouped layouts copy as on CUDA: one gather and one indexed copy per layer")
    a = ap.parse_args()
    global STAGED
    STAGED = a.staged
    vf.FAMILIES.update(BENCH)
    vf.WIDE.update(BENCH_WIDE)
    d = tempfile.mkdtemp(prefix="kvd-bench-families-", dir="/dev/shm")
    proc = start_daemon(a.daemon, d, pool_size="1GiB")
    try:
        rows = {}
        for fam in list(BENCH) + list(BENCH_WIDE):
            rows[fam] = measure(f"ipc://{d}/kvd.sock", fam, a.blocks, a.rounds, model_dir(d))
        base = rows["dense"]
        print(f"{a.blocks} blocks per call, median of {a.rounds}; GB/s = bytes moved per second")
        print("| family | groups | bytes per call | save GB/s | load GB/s | memcpy GB/s | save/memcpy | load/memcpy | save s/B vs dense | load s/B vs dense |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for fam, (n, sv, ld, cp, ng) in rows.items():
            rel_s = (sv / n) / (base[1] / base[0])
            rel_l = (ld / n) / (base[2] / base[0])
            print(
                f"| {fam} | {ng} | {n // 1024} KiB | {n / sv / 1e9:.2f} | {n / ld / 1e9:.2f} | {n / cp / 1e9:.2f} | "
                f"{cp / sv:.2f} | {cp / ld:.2f} | {rel_s:.2f}x | {rel_l:.2f}x |"
            )
        m = vf.FAMILIES["mla"]
        latent = (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * 2 * m["num_hidden_layers"]
        print(f"MLA pool bytes per token: {latent} at any TP (one copy per node); a per-rank copy at TP 8 would be {8 * latent} (8x)")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
