"""kvd: the Python client of the kvd KV-cache daemon.

A thin layer over the Rust ``kvd-client`` (the native module ``kvd._native``): the same
client the Rust engines link, with the GIL released while it waits for the daemon.

    import kvd
    c = kvd.Client()                                  # the node's daemon, pool mapped
    info = c.register_layout(layout)                  # dict with SPEC §3.1 fields
    keys = kvd.chunk_hashes(tokens, 16, b"model-seed")
    batch = c.alloc(info["layout_id"], keys)
    pool = memoryview(c.pool())                       # zero-copy view of the shared pool
    for off in batch.offsets:
        if off is not None:
            pool[off:off + info["block_bytes"]] = ...  # or torch.frombuffer(pool, ...)
    batch.commit()

Errors the daemon answers are :class:`KvdError` with ``code`` (the wire code, e.g.
``"pool_full"``) and ``message``.

Engine integrations (imported only by the engines that load them):
``kvd.vllm_connector.KvdConnector`` (vLLM's ``--kv-transfer-config``) and
``kvd.sglang_backend.KvdHiCacheStorage`` (SGLang's ``--hicache-storage-backend dynamic``).
"""

from ._native import Batch, Client, KvdError, Pinned, Pool, chunk_hashes, layout_id, model_identity

__all__ = ["Batch", "Client", "KvdError", "Pinned", "Pool", "chunk_hashes", "layout_id", "model_identity", "torch_pool", "vouched"]


def vouched(client, layout_id, keys, pin):
    """Per key of ``pin`` (a ``client.get`` of ``keys`` under ``layout_id``), whether its
    block may be read: a hit whose bytes match its writer checksum (SPEC §17; checked in
    place, without the GIL) or that has none. A hit whose bytes do not match is a miss and
    is named to the daemon (``Client.verify``), which checks it itself and drops it. Read
    only the blocks this says ``True`` of: an engine never decodes from bytes kvd did not
    vouch for."""
    checks = pin.verify()
    damaged = [k for k, ok in zip(keys, checks) if ok is False]
    if damaged:
        try:
            client.verify(layout_id, damaged)
        except KvdError:
            pass  # the load counts them as misses either way
    return [o is not None and ok is not False for o, ok in zip(pin.offsets, checks)]


def vouched_prefix(client, layout_id, keys, pin):
    """How many leading keys of ``pin`` may be read (:func:`vouched`)."""
    ok = vouched(client, layout_id, keys, pin)
    return next((i for i, v in enumerate(ok) if not v), len(ok))


def torch_pool(client, register_cuda=True):
    """The pool as a flat ``torch.uint8`` tensor, without a copy.

    With CUDA available (and ``register_cuda``), the mapping is page-locked (portable and
    mapped) once with ``cudaHostRegister`` and CUDA's copy paths are warmed up then, so
    ``gpu_tensor.copy_(pool_tensor[off:off + n], non_blocking=True)`` and back are DMA
    between GPU memory and pool slots, with no bounce buffer, from the first one. The
    tensor (and its registration) is valid until the daemon restarts
    (``client.incarnation`` changes): call this again then.
    """
    import torch

    pool = client.pool()
    if pool is None:
        raise KvdError("the pool is not mapped (Client(map_pool=True) on the daemon's node)")
    t = torch.frombuffer(pool, dtype=torch.uint8)
    if register_cuda and torch.cuda.is_available():
        addr, size = pool.address, len(pool)
        if (addr, size) not in _registered:
            # Portable: every device of the process may DMA to it; mapped: kernels may read
            # and write it through its device address.
            rc = torch.cuda.cudart().cudaHostRegister(addr, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            if int(rc) != 0:
                raise KvdError(f"cudaHostRegister of the pool ({size} bytes) failed: {rc}")
            _registered.add((addr, size))
            _warm_up(t)
    return t


def _device_view(pool):
    """The page-locked (mapped) pool of :func:`torch_pool` as a CUDA ``uint8`` tensor over
    its device mapping, or ``None`` where the driver gives none.

    Kernels read and write the pool through it as they do GPU memory, so a copy of many
    pieces between GPU memory and pool slots is one indexing kernel (``index_select`` /
    ``index_copy_``) instead of one DMA per piece, which costs a call each and runs
    at a fraction of the link below ~1 MiB. The view is valid as long as ``pool``
    (keep both).
    """
    import ctypes

    import torch

    try:
        key = (pool.data_ptr(), pool.numel(), torch.cuda.current_device())
    except (AssertionError, RuntimeError):  # no CUDA in this torch, or no driver
        return None
    if key in _views:
        return _views[key]
    view = None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        get = cuda.cuMemHostGetDevicePointer_v2
        get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        dptr = ctypes.c_uint64()
        torch.cuda.init()  # the device's primary context is current on this thread
        if get(ctypes.byref(dptr), ctypes.c_void_p(pool.data_ptr()), 0) == 0 and dptr.value:
            view = torch.as_tensor(_Mapped(dptr.value, pool.numel()))
            if not view.is_cuda or view.data_ptr() != dptr.value:
                view = None  # a copy, not the mapping: never write through it
    except (OSError, AttributeError, RuntimeError, TypeError):
        view = None
    _views[key] = view
    return view


class _Mapped:
    """A device address range in CUDA's array interface (what ``torch.as_tensor`` takes)."""

    def __init__(self, ptr, size):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 3}


_views = {}


_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


def _warm_up(pool):
    """Pays CUDA's first-use costs (the copy paths both ways, the pool's first DMA) at
    registration instead of in the first transfer: a read of the pool's header page and a
    round trip through torch's own pinned memory. Nothing is written into the pool."""
    import torch

    dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
    dev.copy_(pool[:4096], non_blocking=True)
    pinned = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(dev, non_blocking=True)
    dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()


_registered = set()
