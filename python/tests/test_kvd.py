"""The kvd Python package against a real daemon (endpoint in argv[1]).

Run by daemon/tests/python_package.rs after `maturin develop` installed the package
into the test venv. Prints "N passed, M failed" like the spec client's test.
"""

import os
import sys
import threading
import time

import kvd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
import kvd_spec_client as spec  # noqa: E402  (written from SPEC.md alone: an independent check)

sys.path.insert(0, os.path.dirname(__file__))
from checks import check, run  # noqa: E402

EP, EP2, HOST_DIR = sys.argv[1], sys.argv[2], sys.argv[3]
LAYOUT = {"model": "kvd-py/test", "num_layers": 2, "kv_parts": 2, "num_kv_heads": 1, "head_dim": 32,
          "dtype": "f16", "tokens_per_block": 16, "tp_size": 1, "tp_rank": 0,
          "order": "layer_part_token_head"}


def keys(seed, n):
    return kvd.chunk_hashes([(seed * 7919 + t) % 50000 for t in range(16 * n)], 16, seed.to_bytes(4, "little"))


@check("hashes and layout ids agree with the SPEC's own Python implementation")
def _():
    toks = list(range(40))
    assert kvd.chunk_hashes(toks, 16, b"s") == spec.chunk_hashes(toks, 16, b"s")
    assert len(kvd.chunk_hashes(toks, 16, b"")) == 2, "a partial block has no key"
    assert kvd.layout_id(LAYOUT) == spec.layout_id(LAYOUT)


@check("model_identity agrees with the SPEC's own Python implementation (shards, a .bin, one file alone)")
def _():
    import tempfile

    d = tempfile.mkdtemp()
    rnd = os.urandom(600_000)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    for i, size in enumerate((300_000, 100)):
        header = ('{"t":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (size, size)).encode()
        with open(os.path.join(d, f"model-{i:05}-of-00002.safetensors"), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header + rnd[:size])
    with open(os.path.join(d, "extra.bin"), "wb") as f:
        f.write(rnd)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write("{}")
    assert kvd.model_identity(d) == spec.model_identity(d)
    one = os.path.join(d, "extra.bin")
    assert kvd.model_identity(one) == spec.model_identity(one)
    try:
        kvd.model_identity(os.path.join(d, "absent"))
        raise AssertionError("a missing checkpoint was digested")
    except OSError:
        pass


@check("register_layout, alloc, write through a memoryview of the pool, commit, lookup and probe, get, read back")
def _():
    c = kvd.Client(EP)
    info = c.register_layout(LAYOUT)
    assert info["layout_id"] == kvd.layout_id(LAYOUT)
    bb = info["block_bytes"]
    ks = keys(1, 3)
    pool = memoryview(c.pool())
    assert pool.nbytes == len(c.pool()) > 0 and not pool.readonly
    batch = c.alloc(info["layout_id"], ks)
    assert batch.status == ["new"] * 3
    for i, off in enumerate(batch.offsets):
        pool[off:off + bb] = bytes([i + 1]) * bb
    assert batch.commit() == 3
    assert c.lookup(info["layout_id"], ks)["prefix"] == 3
    probed = c.probe(info["layout_id"], ks + keys(98, 1))
    assert probed["prefix"] == 3 and len(probed["tiers"]) == 3, probed
    assert probed == c.lookup(info["layout_id"], ks + keys(98, 1))
    assert c.probe(info["layout_id"], ks, local_only=True) == c.probe(info["layout_id"], ks)
    pin = c.get(info["layout_id"], ks + keys(99, 1))
    assert pin.valid and pin.pin is not None
    offs = pin.offsets
    assert offs[3] is None, "a miss"
    for i in range(3):
        assert bytes(pool[offs[i]:offs[i] + bb]) == bytes([i + 1]) * bb
    pin.release()
    assert not pin.valid
    assert c.stats()["pinned_blocks"] == 0


@check("zero copy: numpy and torch views of the pool see the daemon's bytes")
def _():
    import numpy as np
    import torch
    c = kvd.Client(EP)
    lid = c.register_layout(LAYOUT)["layout_id"]
    bb = c.register_layout(LAYOUT)["block_bytes"]
    ks = keys(2, 1)
    data = bytes(range(256)) * (bb // 256)
    assert c.store(lid, ks, [data]) == ["new"]
    pin = c.get(lid, ks)
    off = pin.offsets[0]
    arr = np.frombuffer(c.pool(), dtype=np.uint8, count=bb, offset=off)
    assert arr.tobytes() == data
    t = torch.frombuffer(c.pool(), dtype=torch.uint8, count=bb, offset=off)
    assert t[:4].tolist() == [0, 1, 2, 3]
    # A write through the numpy view lands in the pool itself (same memory).
    batch = c.alloc(lid, keys(3, 1))
    w = np.frombuffer(c.pool(), dtype=np.uint8, count=bb, offset=batch.offsets[0])
    w[:] = 7
    batch.commit()
    assert c.get(lid, keys(3, 1)).offsets[0] is not None
    pin.release()


@check("daemon errors are KvdError with the wire code")
def _():
    c = kvd.Client(EP)
    try:
        c.lookup(12345, keys(1, 1))
        raise AssertionError("no error")
    except kvd.KvdError as e:
        assert e.code == "unknown_layout", e.code
        assert "12345" in e.message or "layout" in e.message
    try:
        c.transfer_status("never-exported")
        raise AssertionError("no error")
    except kvd.KvdError as e:
        assert e.code == "unknown_transfer", e.code
    try:
        c.lookup(1, [b"short"])
        raise AssertionError("no error")
    except ValueError as e:
        assert "16" in str(e)


@check("delete, stats, store status")
def _():
    c = kvd.Client(EP)
    lid = c.register_layout(LAYOUT)["layout_id"]
    bb = c.register_layout(LAYOUT)["block_bytes"]
    ks = keys(4, 2)
    assert c.store(lid, ks, [b"\x01" * bb, b"\x02" * bb]) == ["new", "new"]
    assert c.store(lid, ks, [b"\x01" * bb, b"\x02" * bb]) == ["exists", "exists"]
    assert c.delete(lid, ks + keys(5, 1)) == ["deleted", "deleted", "missing"]
    assert c.stats()["incarnation"] == c.incarnation


@check("export, transfer_status, abort (prefill side)")
def _():
    c = kvd.Client(EP)
    lid = c.register_layout(LAYOUT)["layout_id"]
    bb = c.register_layout(LAYOUT)["block_bytes"]
    ks = keys(6, 2)
    c.store(lid, ks, [b"\x03" * bb] * 2)
    params = c.export("py-req-1", lid, ks, lease_s=5.0)
    assert isinstance(params, bytes) and len(params) > 0
    st = c.transfer_status("py-req-1")
    assert st["role"] == "exporter" and st["state"] == "exported", st
    r = c.abort("py-req-1")
    assert r["aborted"] is True and r["state"] == "aborted", r


@check("calls that wait release the GIL")
def _():
    # A daemon that never answers: the hello waits for its 1 s timeout. Meanwhile this
    # thread must keep running Python.
    ticks = [0]
    done = threading.Event()

    def wait():
        try:
            kvd.Client("ipc:///tmp/kvd-py-nobody-%d.sock" % os.getpid(), timeout_s=1.0)
        except kvd.KvdError:
            pass
        finally:
            done.set()

    t = threading.Thread(target=wait)
    t0 = time.monotonic()
    t.start()
    while not done.is_set():
        ticks[0] += 1
        time.sleep(0.001)
    t.join()
    assert time.monotonic() - t0 >= 0.9
    assert ticks[0] > 100, f"only {ticks[0]} ticks while the client waited: the GIL was held"


@check("writer checksums: a batch's commit sends them, a flipped pool byte is not vouched for and is dropped")
def _():
    import zlib  # noqa: F401  (CRC-32C is not in the stdlib: computed below)

    def crc32c(b):
        c = 0xFFFFFFFF
        for x in b:
            c ^= x
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        return c ^ 0xFFFFFFFF

    c = kvd.Client(EP)
    info = c.register_layout(LAYOUT)
    lid, bb = info["layout_id"], info["block_bytes"]
    ks = keys(21, 3)
    pool = memoryview(c.pool())
    batch = c.alloc(lid, ks)
    blocks = [bytes([(i * 37 + j) % 251 for j in range(bb)]) for i in range(3)]
    for i, off in enumerate(batch.offsets):
        pool[off:off + bb] = blocks[i]
    assert batch.commit() == 3
    pin = c.get(lid, ks)
    assert pin.crcs == [crc32c(b) for b in blocks], "the checksum of the bytes the batch wrote"
    assert pin.verify() == [True, True, True]
    off = pin.offsets[1]
    pin.release()
    pool[off + 5] ^= 0x01  # a bit flipped in the pool
    before = c.stats()["checksums"]
    pin = c.get(lid, ks)
    assert pin.verify() == [True, False, True]
    assert kvd.vouched(c, lid, ks, pin) == [True, False, True]
    pin.release()
    after = c.stats()["checksums"]
    assert after["damaged"] == before["damaged"] + 1 and after["reports"] == before["reports"] + 1, after
    assert c.lookup(lid, ks)["prefix"] == 1, "dropped: the prefix ends before it"
    assert c.verify(lid, ks) == ["intact", "missing", "intact"]


@check("the GPU tier on the host stand-in: numpy caches in shared memory, store, load, GPU-to-GPU pull")
def _():
    import numpy as np
    c, d = kvd.Client(EP), kvd.Client(EP)
    info = c.register_layout(LAYOUT)
    lid, bb = info["layout_id"], info["block_bytes"]
    d.register_layout(LAYOUT)
    n = 8

    def cache(name, fill):
        m = np.memmap(os.path.join(HOST_DIR, name), dtype=np.uint8, mode="w+", shape=(n, bb))
        m[:] = (np.arange(n * bb, dtype=np.uint64) * 7 % 251).astype(np.uint8).reshape(n, bb) if fill else 0
        m.flush()
        return m

    src, dst, dst2 = cache("py-src", True), cache("py-dst", False), cache("py-dst2", False)
    whole = [(0, 0, bb, bb)]
    rs = c.gpu_register(lid, [(b"py-src", n * bb)], n, whole)["registration"]
    rd = c.gpu_register(lid, [(b"py-dst", n * bb)], n, whole)["registration"]
    # The decode engine splits each block in two halves over two offsets of its file.
    half = bb // 2
    r2 = d.gpu_register(lid, [(b"py-dst2", n * bb)], n, [(0, 0, half, half), (0, n * half, half, half)])["registration"]
    ks = keys(8, 3)
    assert c.gpu_store(rs, ks, [5, 1, 2]) == ["stored"] * 3
    assert c.gpu_store(rs, ks[:1], [0]) == ["exists"]
    assert c.gpu_load(rd, ks + keys(9, 1), [0, 1, 2, 3]) == 3
    for i, b in enumerate([5, 1, 2]):
        assert (dst[i] == src[b]).all(), f"block {b}"
    assert (dst[3] == 0).all(), "after the prefix: untouched"
    p = c.gpu_export(rs, "py-gpu-1", ks, [5, 1, 2], lease_s=5.0)
    assert d.gpu_pull(r2, [4, 6, 7], p) == 3
    flat = np.asarray(dst2).reshape(-1)
    for i, b in zip([5, 1, 2], [4, 6, 7]):
        got = np.concatenate([flat[b * half:(b + 1) * half], flat[n * half + b * half:n * half + (b + 1) * half]])
        assert (got == src[i]).all(), f"pulled block {i}"
    assert c.gpu_export_status("py-gpu-1")["state"] == "done"
    try:
        d.gpu_pull(r2, [4, 6, 7], p)
        raise AssertionError("a second pull")
    except kvd.KvdError as e:
        assert e.code == "invalid_state", e.code
    assert [r["registration"] for r in c.gpu_list()["registrations"]] == [rs, rd]
    assert c.gpu_unregister(rd) == 0


@check("prefill -> decode across two daemons from Python: pull, then push")
def _():
    a, b = kvd.Client(EP), kvd.Client(EP2)
    info = a.register_layout(LAYOUT)
    lid, bb = info["layout_id"], info["block_bytes"]
    b.register_layout(LAYOUT)
    ks = keys(10, 3)
    blocks = [bytes([40 + i]) * bb for i in range(3)]
    assert a.store(lid, ks, blocks) == ["new"] * 3
    params = a.export("py-pd-1", lid, ks, lease_s=10.0)
    done = b.pull(params, wait=True)
    assert done["state"] == "done", done
    pool = memoryview(b.pool())
    for i, off in enumerate(done["offsets"]):
        assert bytes(pool[off:off + bb]) == blocks[i], f"block {i}"
    b.release(done["pin"])
    assert b.lookup(lid, ks)["prefix"] == 3, "committed on the decode node"
    # Push: the decode side registers first, the prefill's export writes into its slots.
    ks2 = keys(11, 2)
    a.store(lid, ks2, [b"\x09" * bb, b"\x0a" * bb])
    node = a.hello_info()["node"]["node"]
    b.push_register("py-pd-2", lid, ks2, node, ttl_s=10.0)
    a.export("py-pd-2", lid, ks2, lease_s=10.0)
    st = b.transfer_status("py-pd-2", wait_s=10.0)
    assert st["state"] == "done", st
    for off, want in zip(st["offsets"], [b"\x09" * bb, b"\x0a" * bb]):
        assert bytes(pool[off:off + bb]) == want
    b.release(st["pin"])


@check("torch_pool: a flat uint8 tensor over the pool, the same memory")
def _():
    import torch
    c = kvd.Client(EP)
    info = c.register_layout(LAYOUT)
    lid, bb = info["layout_id"], info["block_bytes"]
    t = kvd.torch_pool(c)
    assert t.dtype == torch.uint8 and t.numel() == len(c.pool())
    ks = keys(12, 1)
    batch = c.alloc(lid, ks)
    o = batch.offsets[0]
    t[o:o + bb] = 5
    batch.commit()
    pin = c.get(lid, ks)
    assert bytes(memoryview(c.pool())[pin.offsets[0]:pin.offsets[0] + 4]) == b"\x05" * 4
    pin.release()
    # The pool's device mapping (the vLLM connector's one-kernel copies): without a
    # usable CUDA device there is none, said by None (the connector then copies per
    # slot), never an exception.
    if not torch.cuda.is_available():
        assert kvd._device_view(t) is None


run()
