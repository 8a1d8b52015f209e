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
"""

from ._native import Batch, Client, KvdError, Pinned, Pool, chunk_hashes, layout_id

__all__ = ["Batch", "Client", "KvdError", "Pinned", "Pool", "chunk_hashes", "layout_id"]
