"""Tenants (SPEC §18) through the Python package and the vLLM connector, against a real
daemon with a tenants file naming "quiet" and "noisy" (tokens in argv).

argv: ENDPOINT QUIET_TOKEN NOISY_TOKEN. Run by daemon/tests/tenants.rs. Prints
"N passed, M failed".
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import check, run  # noqa: E402

import kvd  # noqa: E402

EP, QUIET, NOISY = sys.argv[1], sys.argv[2], sys.argv[3]
LAYOUT = {"model": "kvd-py/tenants", "num_layers": 2, "kv_parts": 2, "num_kv_heads": 1, "head_dim": 32,
          "dtype": "f16", "tokens_per_block": 16, "tp_size": 1, "tp_rank": 0,
          "order": "layer_part_token_head"}
RUN = int.from_bytes(os.urandom(4), "little")


def tenant(c, name):
    return next(t for t in c.stats()["tenants"] if t["name"] == name)


@check("a Python client's token decides its tenant, and another tenant's blocks are misses")
def _():
    q = kvd.Client(EP, token=QUIET)
    n = kvd.Client(EP, token=NOISY)
    assert q.hello_info()["tenant"] == "quiet" and n.hello_info()["tenant"] == "noisy"
    lq = q.register_layout(LAYOUT)
    ln = n.register_layout(LAYOUT)
    assert lq["layout_id"] == ln["layout_id"] == kvd.layout_id(LAYOUT)
    keys = kvd.chunk_hashes([(RUN + t) % 50000 for t in range(64)], 16, b"")
    q.store(lq["layout_id"], keys, [bytes([7]) * lq["block_bytes"]] * len(keys))
    assert q.lookup(lq["layout_id"], keys)["prefix"] == 4
    assert n.lookup(ln["layout_id"], keys)["prefix"] == 0
    try:
        kvd.Client(EP, token="not-a-token-of-anyone-at-all")
        raise AssertionError("a wrong token was served")
    except kvd.KvdError as e:
        assert e.code == "unauthenticated", e.code


@check("the vLLM connector's sessions act for extra_config's tenant: a prompt one tenant's engine stored is an external hit for that tenant only")
def _():
    import vllm_engine as ve

    toks = [(RUN + 13 * t) % 997 + 1 for t in range(100)]
    r = lambda tag: f"{tag}-{os.getpid()}-{time.monotonic_ns()}"  # noqa: E731

    def finish(e, rid):
        e.run(lambda so, out: rid in e.outputs and e.outputs[rid].finish_reason is not None)

    stats = kvd.Client(EP, token=QUIET)
    before = tenant(stats, "quiet")["blocks"]
    a = ve.Engine(EP, tenant_token=QUIET)
    ra = r("a")
    a.add(ra, toks)
    assert ve.first_schedule(a, ra) == (0, 100)
    finish(a, ra)
    assert tenant(stats, "quiet")["blocks"] >= before + 6, "the engine's blocks are the quiet tenant's"
    b = ve.Engine(EP, tenant_token=QUIET)
    rb = r("b")
    b.add(rb, toks)
    assert ve.first_schedule(b, rb) == (96, 4), "the same tenant's engine hits"
    b.check_blocks(rb, toks, 6)
    finish(b, rb)
    c = ve.Engine(EP, tenant_token=NOISY)
    rc = r("c")
    c.add(rc, toks)
    assert ve.first_schedule(c, rc) == (0, 100), "another tenant's engine finds nothing"
    finish(c, rc)
    for e in (a, b, c):
        e.close()


if __name__ == "__main__":
    run()
