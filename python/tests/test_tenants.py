"""Tenants (SPEC §18) through the Python package and the vLLM connector, against a real
daemon with a tenants file naming "quiet" and "noisy" (tokens in argv).

argv: ENDPOINT QUIET_TOKEN NOISY_TOKEN ENGINE_TOKEN ENDPOINT2 OPS_TOKEN (the engine's
token acts for both tenants; a second daemon with the same file for handoffs; the
operator's token sees every figure). Run by
daemon/tests/tenants.rs. Prints "N passed, M failed".
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import check, run  # noqa: E402

import kvd  # noqa: E402

EP, QUIET, NOISY, ENGINE, EP2, OPS = sys.argv[1:7]
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


def blocks(ep, name):
    return tenant(kvd.Client(ep, token=QUIET if name == "quiet" else NOISY), name)["blocks"]


def served(e, rid, toks, **kw):
    """Adds ``rid``, returns what the first schedule computes and loads, runs it out."""
    import vllm_engine as ve

    e.add(rid, toks, **kw)
    first = ve.first_schedule(e, rid)
    e.run(lambda so, out: rid in e.outputs and e.outputs[rid].finish_reason is not None)
    return first


def rid(tag):
    return f"{tag}-{os.getpid()}-{time.monotonic_ns()}"


@check("per-request tenants (tenant_from=cache_salt): each request is stored, found and charged in the tenant its salt names; a salt naming a tenant the engine's credential does not act for gets no kvd")
def _():
    import vllm_engine as ve

    toks = [(RUN + 7 * t) % 991 + 1 for t in range(100)]
    q0, n0 = blocks(EP, "quiet"), blocks(EP, "noisy")
    multi = ve.Engine(EP, tenant_token=ENGINE, tenant="quiet", tenant_from="cache_salt")
    assert multi.sconn.request_tenant(multi.add(rid("probe"), toks[:20], cache_salt="noisy")) == "noisy"
    assert served(multi, rid("n"), toks, cache_salt="noisy") == (0, 100)
    assert blocks(EP, "noisy") >= n0 + 6 and blocks(EP, "quiet") == q0, "the salt's tenant holds the blocks"
    # the same salt in the same tenant hits, through an engine of that tenant only
    assert served(ve.Engine(EP, tenant_token=NOISY), rid("n2"), toks, cache_salt="noisy") == (96, 4)
    assert served(ve.Engine(EP, tenant_token=QUIET), rid("q2"), toks, cache_salt="noisy") == (0, 100), "another tenant finds nothing, keys alike"
    # no salt: the engine's tenant
    assert served(multi, rid("d"), toks) == (0, 100)
    assert blocks(EP, "quiet") >= q0 + 6
    assert served(ve.Engine(EP, tenant_token=QUIET), rid("d2"), toks) == (96, 4)
    # a salt naming a tenant the credential does not act for: no lookup, no save, no
    # fallback, and the daemon is asked once, not at every step
    refused = lambda: kvd.Client(EP, token=OPS).stats()["tenancy"]["refused_hellos"]  # noqa: E731
    q1, n1, r1 = blocks(EP, "quiet"), blocks(EP, "noisy"), refused()
    other = [(RUN + 11 * t) % 983 + 1 for t in range(100)]
    assert served(multi, rid("x"), other, cache_salt="nobody") == (0, 100)
    assert (blocks(EP, "quiet"), blocks(EP, "noisy")) == (q1, n1), "nothing stored for a tenant the engine may not act for"
    assert served(multi, rid("x2"), other, cache_salt="nobody") == (0, 100)
    assert refused() - r1 == 1, f"{refused() - r1} refused hellos"


@check("per-request tenants through tenant_map and LoRA: mapped values name their tenant, others the engine's")
def _():
    import vllm_engine as ve
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    toks = [(RUN + 5 * t) % 977 + 1 for t in range(100)]
    m = ve.Engine(EP, tenant_token=ENGINE, tenant="quiet", tenant_from="cache_salt", tenant_map={"s-3f9a": "noisy"})
    n0 = blocks(EP, "noisy")
    assert served(m, rid("m"), toks, cache_salt="s-3f9a") == (0, 100)
    assert blocks(EP, "noisy") >= n0 + 6
    assert served(ve.Engine(EP, tenant_token=NOISY), rid("m2"), toks, cache_salt="s-3f9a") == (96, 4)
    req = lambda **kw: Request(rid("l"), toks, SamplingParams(max_tokens=1), None, **kw)  # noqa: E731
    assert m.sconn.request_tenant(req(cache_salt="unmapped")) == "quiet"
    assert m.sconn.request_tenant(req()) == "quiet"
    lo = ve.Engine(EP, tenant_token=ENGINE, tenant="quiet", tenant_from="lora")
    assert lo.sconn.request_tenant(req(lora_request=LoRARequest("noisy", 1, "/nonexistent"))) == "noisy"
    assert lo.sconn.request_tenant(req(cache_salt="noisy")) == "quiet", "tenant_from=lora reads the adapter, not the salt"
    from kvd.vllm_layout import KvdConfigError

    try:
        ve.Engine(EP, tenant_from="header")
        raise AssertionError("an unknown tenant_from was accepted")
    except KvdConfigError:
        pass


@check("per-request tenants in a handoff: the prefill's export and the decode's pull run in the request's tenant; a decode engine of another tenant cannot admit it and prefills itself")
def _():
    import vllm_engine as ve

    toks = [(RUN + 3 * t) % 971 + 1 for t in range(100)]
    p = ve.Engine(EP, role="kv_producer", tenant_token=ENGINE, tenant="quiet", tenant_from="cache_salt")
    r = rid("p")
    p.add(r, toks, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, cache_salt="noisy")
    p.run(lambda so, out: r in p.outputs and p.outputs[r].finish_reason is not None)
    params = p.outputs[r].kv_transfer_params
    assert params and params["kvd"]["blocks"] == 6, params
    n0 = blocks(EP2, "noisy")
    wrong = ve.Engine(EP2, role="kv_consumer", tenant_token=QUIET)
    rw = rid("w")
    wrong.add(rw, toks, max_tokens=2, kv_transfer_params=params, cache_salt="noisy")
    assert ve.first_schedule(wrong, rw) == (0, 100), "another tenant's decode engine prefills"
    d = ve.Engine(EP2, role="kv_consumer", tenant_token=ENGINE, tenant="quiet", tenant_from="cache_salt")
    rd = rid("d")
    d.add(rd, toks, max_tokens=3, kv_transfer_params=params, cache_salt="noisy")
    d.step()
    assert ve.first_schedule(d, rd) == (96, 4)
    d.check_blocks(rd, toks, 6)
    d.run(lambda so, out: rd in d.outputs and d.outputs[rd].finish_reason is not None)
    assert blocks(EP2, "noisy") >= n0 + 6, "the pulled blocks are the request's tenant's"


if __name__ == "__main__":
    run()
