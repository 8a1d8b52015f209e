"""What the package's test scripts share: named checks, their runner (prints "ok"/"FAIL"
per check and a closing "N passed, M failed" line the Rust side reads), and a daemon of
the script's own for the checks that restart one."""

import os
import subprocess
import sys
import time
import traceback

CHECKS = []


def check(name):
    """Registers the decorated function as a check named ``name``."""
    def deco(f):
        CHECKS.append((name, f))
        return f
    return deco


def run():
    """Runs every check (``KVD_CHECKS=text``: only those whose name contains it, when
    working on one)."""
    only = os.environ.get("KVD_CHECKS")
    passed = failed = 0
    for name, f in CHECKS:
        if only and only not in name:
            continue
        t0 = time.monotonic()
        try:
            f()
            passed += 1
            print(f"ok   {name} ({time.monotonic() - t0:.1f} s)")
        except Exception:
            failed += 1
            print(f"FAIL {name}")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def caught(check, what, needle="differs"):
    """A negative control: ``check()`` must fail with an AssertionError that says
    ``needle``; one that passes raises ("``what`` went unnoticed")."""
    try:
        check()
    except AssertionError as e:
        assert needle in str(e), e
        return
    raise RuntimeError(f"{what} went unnoticed")


def expired(endpoint, transfers, within_s=15.0):
    """Waits for the exports ``transfers`` (a handoff's ``kv_transfer_params``) that no
    decode engine admitted to end with their lease; asserts they did. The bound is many
    leases (the tests' are 1 s) so a loaded machine's late timer still makes it; polled, so
    it costs only what the expiry takes."""
    import kvd

    for t in transfers:
        deadline = time.time() + within_s
        while kvd.Client(endpoint).transfer_status(t["transfer_id"])["state"] == "exported" and time.time() < deadline:
            time.sleep(0.05)
        state = kvd.Client(endpoint).transfer_status(t["transfer_id"])["state"]
        assert state == "expired", (t, state)


def checkpoint(d, seed, config='{"model_type": "llama", "num_hidden_layers": 2}'):
    """A tiny checkpoint in directory ``d``: ``config.json`` and ``model.safetensors`` with
    weights drawn from ``seed`` (64 K values: the identity samples them). Returns ``d``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(config)
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.rand((256, 256), generator=g)}, os.path.join(d, "model.safetensors"))
    return d


def start_daemon(kvd_bin, d, keep=False, pool_size="64MiB"):
    """A kvd (no transfers, a ``pool_size`` pool) on ``ipc://{d}/kvd.sock``; the caller kills it.

    ``keep``: keep the pool across restarts (a service's setting; the bare daemon's default
    is off); off here unless a check is about it, so that a restart check starts from an
    empty daemon. A check that kills the daemon removes ``d`` itself."""
    proc = subprocess.Popen([kvd_bin, "--endpoint", f"ipc://{d}/kvd.sock", "--pool-path", f"{d}/kvd.pool",
                             "--pool-size", pool_size, "--segment-size", "1MiB", "--metrics-addr", "127.0.0.1:0",
                             "--log-level", "warn", "--no-transfers", "--keep-pool", "true" if keep else "false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if os.path.exists(f"{d}/kvd.sock"):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the daemon did not start")
