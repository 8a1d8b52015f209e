"""kvd's KV events (SPEC §14) read by vLLM's own event types: a subscriber built the way a
vLLM KV-event consumer is (pyzmq SUB + a DEALER for replay, payloads decoded with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``) catches up by replay,
follows the stream, and writes the prefix index it built to a JSON file the Rust side
compares with the daemon's own answers. Prints "N passed, M failed".

Arguments: PUB endpoint, replay endpoint, output file.
"""

import json
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from checks import check, run

EP, REPLAY, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)
BATCHES = {}  # seq -> (topic, KVEventBatch)


def follow(sub, quiet=0.5):
    last = time.monotonic()
    while time.monotonic() - last < quiet:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            BATCHES[int.from_bytes(seq, "big")] = (topic.decode(), DECODE.decode(payload))
            last = time.monotonic()


@check("every batch decodes as vLLM's KVEventBatch, replayed from 0 and then followed")
def subscribe():
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvd.")
    sub.connect(EP)
    # Wait until the PUB socket delivers a batch (an idle daemon's keepalive comes within a
    # second): from then on nothing is missed, so the replay below leaves no gap. A fixed
    # sleep does not ensure that on a loaded machine.
    deadline = time.monotonic() + 20
    while not sub.poll(100):
        assert time.monotonic() < deadline, "no batch reached the subscriber"
    topic, seq, payload = sub.recv_multipart()
    BATCHES[int.from_bytes(seq, "big")] = (topic.decode(), DECODE.decode(payload))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(REPLAY)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    while True:
        _, topic, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        BATCHES[seq] = (topic.decode(), DECODE.decode(payload))
    follow(sub)
    assert BATCHES, "nothing received"
    assert sorted(BATCHES) == list(range(max(BATCHES) + 1)), "a sequence gap"


@check("the events are vLLM's types with kvd's fields")
def kinds():
    seen = set()
    for topic, b in BATCHES.values():
        assert isinstance(b.ts, float) and b.ts > 1.6e9, b.ts
        for e in b.events:
            seen.add(type(e).__name__)
            if isinstance(e, (BlockStored, BlockRemoved)):
                assert e.medium in ("CPU", "STORAGE"), e.medium
                assert all(isinstance(h, bytes) and len(h) == 16 for h in e.block_hashes)
                assert topic.startswith("kvd.") and len(topic) == 4 + 16, topic
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None and e.token_ids == [] and e.lora_id is None
                assert e.block_size == 16, e.block_size
            if isinstance(e, AllBlocksCleared):
                assert topic == "kvd.all", topic
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= seen, seen


@check("the index a vLLM consumer builds is written out")
def index():
    ix = {}
    for seq in sorted(BATCHES):
        topic, b = BATCHES[seq]
        for e in b.events:
            if isinstance(e, AllBlocksCleared):
                ix.clear()
            elif isinstance(e, BlockStored):
                for h in e.block_hashes:
                    ix.setdefault(topic, {}).setdefault(h.hex(), set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    ix.get(topic, {}).get(h.hex(), set()).discard(e.medium)
    out = {t: {h: sorted(m) for h, m in keys.items() if m} for t, keys in ix.items()}
    with open(OUT, "w") as f:
        json.dump(out, f)


run()
