"""One-sided TCP transfers of NIXL (UCX) and Mooncake Transfer Engine, timed the way
`kvd-bench transport` times kvd: two processes on this machine, host memory on both sides,
`--inflight` transfers of `--size` bytes kept in flight, a fresh region of a 256 MiB buffer
for each transfer (walking, as a pool is), latency from posting a transfer until its
completion is seen, GB/s over the wall time of the whole case.

Run by `kvd-bench transport --compare nixl,mooncake` with the venv it installs; prints one
JSON object per case on stdout:
  {"system": "nixl", "op": "read", "size": 1048576, "inflight": 1,
   "gbps": 1.9, "p50_us": 530.0, "p99_us": 900.0, "transfers": 256}
or {"system": ..., "error": "..."} when a system cannot run here.

Usage: peer_transfer.py --system nixl|mooncake --ops read,write --sizes 65536,1048576
       --inflight 1,4 --total 1073741824
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

SPAN = 256 << 20  # bytes registered on each side


def percentile(lat, q):
    s = sorted(lat)
    return s[round((len(s) - 1) * q)] * 1e6 if s else 0.0


def cases(args):
    for op in args.ops:
        for size in args.sizes:
            for inflight in args.inflight:
                if size * inflight > SPAN:
                    continue
                n = max(args.total // size, 4 * inflight)
                yield op, size, inflight, n


def run_pipeline(post, wait, size, inflight, n):
    """Keeps `inflight` transfers posted until `n` were done; slot k uses the k-th
    `size`-sized region (mod the span). Returns (seconds, latencies)."""
    slots = SPAN // size
    lat, pending = [], []
    t0 = time.perf_counter()
    k = 0
    while k < n or pending:
        while k < n and len(pending) < inflight:
            t = time.perf_counter()
            pending.append((post(k % slots), t))
            k += 1
        h, t = pending.pop(0)
        wait(h)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, lat


def report(system, op, size, inflight, secs, lat):
    print(json.dumps({
        "system": system, "op": op, "size": size, "inflight": inflight,
        "gbps": size * len(lat) / secs / 1e9,
        "p50_us": percentile(lat, 0.5), "p99_us": percentile(lat, 0.99),
        "transfers": len(lat),
    }), flush=True)


# ---------------------------------------------------------------- NIXL (UCX over TCP)

def nixl_api():
    # The CUDA-12 build without torch (the `nixl` meta package would pull torch in to
    # choose a build; its host-memory path does not need CUDA).
    import nixl_cu12._api as api
    return api


def nixl_target(conn):
    import numpy as np
    api = nixl_api()
    agent = api.nixl_agent("kvd-bench-target", api.nixl_agent_config(backends=["UCX"]))
    buf = np.full(SPAN, 0x5A, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SPAN, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.send(agent.add_remote_agent(conn.recv()))
    conn.recv()  # done


def nixl_bench(args, conn):
    import numpy as np
    api = nixl_api()
    # No progress thread on the initiator: its wait loop drives UCX (on 2 vCPUs this is
    # about twice as fast as NIXL's default progress thread, which competes for a core).
    agent = api.nixl_agent(
        "kvd-bench-initiator",
        api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = np.full(SPAN, 0xA5, dtype=np.uint8)  # touched: no page faults timed
    agent.register_memory([(buf.ctypes.data, SPAN, 0, "")], "DRAM")
    md, raddr = conn.recv()
    remote = agent.add_remote_agent(md)
    conn.send(agent.get_agent_metadata())
    conn.recv()
    for op, size, inflight, n in cases(args):
        slots = SPAN // size
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            [(buf.ctypes.data + i * size, size, 0) for i in range(slots)], "DRAM")
        far = agent.prep_xfer_dlist(
            remote, [(raddr + i * size, size, 0) for i in range(slots)], "DRAM")
        op_name = op.upper()

        def post(i):
            h = agent.make_prepped_xfer(op_name, local, [i], far, [i])
            if agent.transfer(h) == "ERR":
                raise RuntimeError("NIXL transfer failed to post")
            return h

        def wait(h):
            while True:
                s = agent.check_xfer_state(h)
                if s == "DONE":
                    break
                if s == "ERR":
                    raise RuntimeError("NIXL transfer failed")
            agent.release_xfer_handle(h)

        # warm the connection
        run_pipeline(post, wait, size, 1, 2)
        secs, lat = run_pipeline(post, wait, size, inflight, n)
        report("nixl", op, size, inflight, secs, lat)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(far)


# ---------------------------------------------------------------- Mooncake TE (TCP)

def mooncake_engine():
    import numpy as np
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    buf = np.full(SPAN, 0x5A, dtype=np.uint8)
    if te.register_memory(buf.ctypes.data, SPAN) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    return te, buf


def mooncake_target(conn):
    te, buf = mooncake_engine()
    conn.send((f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data))
    conn.recv()  # done


def mooncake_bench(args, conn):
    te, buf = mooncake_engine()
    target, raddr = conn.recv()
    base = buf.ctypes.data
    for op, size, inflight, n in cases(args):
        submit = te.batch_transfer_async_read if op == "read" else te.batch_transfer_async_write

        def post(i):
            b = submit(target, [base + i * size], [raddr + i * size], [size])
            if b == 0:
                raise RuntimeError("Mooncake transfer failed to post")
            return b

        def wait(b):
            if te.get_batch_transfer_status([b]) != 0:
                raise RuntimeError("Mooncake transfer failed")

        run_pipeline(post, wait, size, 1, 2)
        secs, lat = run_pipeline(post, wait, size, inflight, n)
        report("mooncake", op, size, inflight, secs, lat)


SYSTEMS = {"nixl": (nixl_target, nixl_bench), "mooncake": (mooncake_target, mooncake_bench)}


def target_main(system, conn):
    try:
        SYSTEMS[system][0](conn)
    except Exception:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # see main(): no destructors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--ops", default="read,write")
    p.add_argument("--sizes", default="1048576")
    p.add_argument("--inflight", default="1")
    p.add_argument("--total", type=int, default=1 << 30)
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    if any(o not in ("read", "write") for o in args.ops):
        p.error("--ops: read and/or write")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.inflight = [int(s) for s in args.inflight.split(",")]
    # Force TCP: without this UCX picks shared memory (or CMA) between two processes
    # on one host, which is not the transport being compared.
    os.environ["UCX_TLS"] = "tcp"
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=target_main, args=(args.system, theirs), daemon=True)
    child.start()
    try:
        SYSTEMS[args.system][1](args, mine)
    except Exception as e:
        print(json.dumps({"system": args.system, "error": f"{type(e).__name__}: {e}"}),
              flush=True)
        traceback.print_exc()
        child.kill()
        sys.exit(1)
    mine.send("done")
    child.join(10)
    # NIXL 1.5.1 segfaults in its teardown at interpreter exit (after every case was
    # measured and printed): leave without running destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
