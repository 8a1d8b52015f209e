"""Drives kvd_spec_client against a running daemon: `python3 test_spec_client.py ENDPOINT
SECRET_FILE` (the cluster secret the daemon uses, for the peer authentication check).

Checks the SPEC test vectors, then a full store/load through the client's own mapping
of the pool, the payload-frame path, and error replies. Prints `N passed, 0 failed`.
"""

import json
import os
import socket
import struct
import sys

import msgpack

import time

import zmq

from kvd_spec_client import (Client, KvdError, auth_frame, block_bytes, chunk_hashes, chunk_root,
                             cluster_key, crc32c, data_mac, data_request, encode_request, layout_id,
                             model_identity, read_status, reply_mac, request_mac)

CHECKS = []


def check(name):
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


@check("chunk hash vectors (SPEC 9)")
def _(_c):
    assert chunk_root().hex() == "58d4f89d7e4dc7b5c6d9fbbfa41f89c6"
    hs = chunk_hashes(list(range(8)), 4)
    assert [h.hex() for h in hs] == ["6a4c1eb202f154a901681a677d6b4482",
                                     "afec44ee23047b447cc08a91602d52c7"]
    assert chunk_hashes(list(range(8)), 4, b"tenant-a")[0].hex() == "455fade4997302f02b478efe74434241"
    assert chunk_hashes(list(range(7)), 4)[1:] == []  # partial blocks have no key


TINY = {"model": "kvd-test/tiny", "num_layers": 4, "kv_parts": 2, "num_kv_heads": 8,
        "head_dim": 64, "dtype": "bf16", "tokens_per_block": 16, "tp_size": 2, "tp_rank": 1,
        "order": "layer_part_token_head"}


@check("layout id vector (SPEC 9)")
def _(_c):
    assert layout_id(TINY) == 2120015939447464954
    assert block_bytes(TINY) == 65536


@check("envelope vectors (SPEC 9)")
def _(_c):
    assert encode_request(1, "hello", {"client_name": "py", "pid": 42}).hex() == \
        "84a17601a2696401a26f70a568656c6c6fa4626f647982ab636c69656e745f6e616d65a27079a37069642a"
    frame = encode_request(7, "lookup", {"layout_id": 0x0102030405060708, "keys": [b"\xab" * 16]})
    assert frame.hex() == ("84a17601a2696407a26f70a66c6f6f6b7570a4626f647982a96c61796f75745f6964cf"
                           "0102030405060708a46b65797391c410abababababababababababababababab")
    ok = msgpack.unpackb(bytes.fromhex("83a17601a2696407a26f6b82a670726566697800a5746965727390"))
    assert ok == {"v": 1, "id": 7, "ok": {"prefix": 0, "tiers": []}}
    err = msgpack.unpackb(bytes.fromhex(
        "83a17601a2696409a365727282a4636f6465aa756e6b6e6f776e5f6f70a76d657373616765ae756e6b6e6f776e206f7020227822"))
    assert err["err"] == {"code": "unknown_op", "message": 'unknown op "x"'}


@check("hello, register_layout (id matches our computation)")
def _(c):
    h = c.hello()
    assert h["protocol"] == 1 and h["incarnation"] != 0 and h["client"] != 0
    assert h["limits"]["max_keys_per_request"] > 0
    c.map_pool()
    r = c.register_layout(TINY)
    assert r["layout_id"] == layout_id(TINY)
    assert r["block_bytes"] == 65536 and r["slot_bytes"] % h["pool"]["slot_align"] == 0


@check("alloc, write through our own mapping, commit, lookup, get, read, release")
def _(c):
    lid = layout_id(TINY)
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    keys = chunk_hashes(tokens, 16, b"spec")
    assert len(keys) == 5
    bb = block_bytes(TINY)
    a = c.alloc(lid, keys[:3])
    assert a["status"] == ["new"] * 3 and a["ttl_ms"] > 0
    blobs = [os.urandom(bb) for _ in range(3)]
    for off, blob in zip(a["offsets"], blobs):
        assert off % c.hello_reply["pool"]["slot_align"] == 0
        c.pool[off:off + bb] = blob
    assert c.lookup(lid, keys)["prefix"] == 0  # invisible until committed
    assert c.commit(lid, keys[:3], a["offsets"]) == {"committed": 3}
    assert c.lookup(lid, keys) == {"prefix": 3, "tiers": ["dram"] * 3}
    ok, frames = c.get(lid, keys, ttl_ms=5000)
    assert frames == [] and ok["pin"] is not None and ok["ttl_ms"] == 5000
    assert ok["offsets"][3:] == [None, None]
    for off, blob in zip(ok["offsets"][:3], blobs):
        assert c.pool[off:off + bb] == blob
    assert c.release([ok["pin"]]) == {"released": 1}
    try:
        c.release([ok["pin"]])
        raise AssertionError("double release accepted")
    except KvdError as e:
        assert e.code == "unknown_pin"
    again = c.alloc(lid, keys[:4])
    assert again["status"] == ["exists", "exists", "exists", "new"]
    assert again["offsets"][:3] == [None] * 3
    assert c.delete(lid, keys[3:4]) == {"status": ["deleted"]}  # abort our reservation


@check("pipelined store: reserve, write ahead, put (stored / exists), unreserve")
def _(c):
    lid = layout_id(TINY)
    bb = block_bytes(TINY)
    keys = chunk_hashes(list(range(5000, 5000 + 16 * 3)), 16, b"pipelined")
    r = c.reserve(lid, 4)
    assert len(r["offsets"]) == 4 and r["ttl_ms"] > 0
    blobs = [os.urandom(bb) for _ in range(4)]
    for off, blob in zip(r["offsets"], blobs):
        c.pool[off:off + bb] = blob
    assert c.stats()["reserved"] >= 4
    assert c.lookup(lid, keys)["prefix"] == 0  # a reserved slot is no block
    assert c.put(lid, keys[:2], r["offsets"][:2]) == {"status": ["stored", "stored"]}
    # a key already cached keeps its bytes; the slot naming it is freed
    assert c.put(lid, [keys[0], keys[2]], r["offsets"][2:4])["status"] == ["exists", "stored"]
    ok, _ = c.get(lid, keys)
    got = [bytes(c.pool[o:o + bb]) for o in ok["offsets"]]
    assert got == [blobs[0], blobs[1], blobs[3]]
    c.release([ok["pin"]])
    try:
        c.put(lid, keys[:1], r["offsets"][:1])  # put once
        raise AssertionError("a slot put twice")
    except KvdError as e:
        assert e.code == "invalid_state"
    more = c.reserve(lid, 2)["offsets"]
    assert c.unreserve(more) == {"released": 2}


@check("payload frames: commit with bytes, get inline")
def _(c):
    lid = layout_id(TINY)
    bb = block_bytes(TINY)
    keys = chunk_hashes(list(range(64)), 16, b"inline")
    a = c.alloc(lid, keys)
    blobs = [os.urandom(bb) for _ in keys]
    assert c.commit(lid, keys, payloads=blobs)["committed"] == 4
    ok, frames = c.get(lid, keys + [b"\x00" * 16], inline=True)
    assert ok["pin"] is None and ok["offsets"][4] is None
    assert [bytes(f) for f in frames] == blobs
    assert len(a["offsets"]) == 4


@check("errors: unknown op, wrong version, bad key, double commit, foreign session")
def _(c):
    def expect(code, fn):
        try:
            fn()
        except KvdError as e:
            assert e.code == code, (e.code, code)
            return
        raise AssertionError(f"expected {code}")
    lid = layout_id(TINY)
    expect("unknown_op", lambda: c.call("defragment"))
    expect("invalid_argument", lambda: c.lookup(lid, [b"short"]))
    expect("unknown_layout", lambda: c.lookup(12345, []))
    keys = chunk_hashes(list(range(16)), 16, b"dup")
    a = c.alloc(lid, keys)
    c.commit(lid, keys, a["offsets"])
    expect("invalid_state", lambda: c.commit(lid, keys))
    other = Client(sys.argv[1])
    other.hello("other")
    ok, _ = c.get(lid, keys)
    expect("not_owner", lambda: other.release([ok["pin"]]))
    c.release([ok["pin"]])
    other.close()
    # a wrong version keeps the id
    c.sock.send(msgpack.packb({"v": 9, "id": 4242, "op": "stats"}))
    reply = msgpack.unpackb(c.sock.recv_multipart()[0])
    assert reply["id"] == 4242 and reply["err"]["code"] == "unsupported_version"


@check("stream transport (SPEC 1.1): vectors, greeting, every op, bad framing closes")
def _(c):
    from kvd_spec_client import decode_stream_message, encode_stream_message
    msg = encode_stream_message([bytes.fromhex("81a17601"), b"ab"])
    assert msg.hex() == "020000000400000081a17601020000006162"
    assert decode_stream_message(msg) == ([bytes.fromhex("81a17601"), b"ab"], len(msg))
    assert decode_stream_message(msg[:-1]) is None
    g = msgpack.packb({"v": 1, "incarnation": 0x0102030405060708})
    assert g.hex() == "82a17601ab696e6361726e6174696f6ecf0102030405060708"
    s = Client(sys.argv[1])
    h = s.hello("stream")
    assert h["stream"]["path"].endswith(".stream") and h["stream"]["max_frames"] >= 2
    assert s.use_stream()["incarnation"] == h["incarnation"]
    lid = layout_id(TINY)
    assert s.register_layout(TINY)["layout_id"] == lid
    bb = block_bytes(TINY)
    keys = chunk_hashes(list(range(32)), 16, b"stream")
    blobs = [os.urandom(bb) for _ in keys]
    s.alloc(lid, keys)
    assert s.commit(lid, keys, payloads=blobs)["committed"] == 2
    ok, frames = s.get(lid, keys, inline=True)
    assert [bytes(f) for f in frames] == blobs
    try:
        s.call("defragment")
        raise AssertionError("unknown op accepted")
    except KvdError as e:
        assert e.code == "unknown_op"
    assert s.delete(lid, keys) == {"status": ["deleted"] * 2}
    s.stream_send_raw(struct.pack("<I", 0))  # a message of no frames: closed at once
    try:
        s.stream_recv()
        raise AssertionError("the connection stayed open")
    except (EOFError, ConnectionResetError):
        pass
    s.close()


@check("peer authentication vectors (SPEC 10.1): key, white space, request, reply, data-plane MACs")
def _(_c):
    k = cluster_key(b"a" * 32)
    assert k.hex() == "19c29c94c0256f208d05a016ef2b9d69b900c3911caf0d6dfb74e95f26a775ff"
    assert cluster_key(b" \t" + b"a" * 32 + b"\r\n") == k
    assert cluster_key(b"a" * 32 + b"\x0b\n").hex() == "70814662435e7caed09b955e6509a08f7288d822b3ff9a939734456a6e5f7571"
    to, ms = "tcp://10.0.0.5:7101", 1700000000000
    assert request_mac(k, ms, 42, to, b"kvd").hex() == "f46cce1f0995adc81ce0e995ee61b71a560f8b792bf87d57ff82ad059c734568"
    assert reply_mac(k, ms, 42, b"kvd").hex() == "3d41243aea40503ec37766bf25edca1e94b4c6b1686caa178a984763e7e0a5c6"
    assert data_mac(k, ms, 42, to, b"kvd").hex() == "86d2faee56e6a8151c67e3b01f311401fa31fd86743a64705f29c1ceef4d8c97"


def signed_peer_call(c, op, body, to=None, timeout_ms=5000):
    """One peer request signed from the SPEC (10.1) on the daemon's control endpoint:
    (reply, frames, unix_ms, nonce), or None when no reply came within the timeout."""
    node = c.hello_reply["node"]
    key = cluster_key(open(sys.argv[2], "rb").read())
    me = {"node": "tcp://127.0.0.1:9", "data": "127.0.0.1:9", "incarnation": 5, "host": ""}
    s = c.ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node["node"])
    try:
        env = encode_request(next(c.ids), op, {"from": me, "to_incarnation": node["incarnation"], **body})
        ms = int(time.time() * 1000)
        nonce = int.from_bytes(os.urandom(8), "little")
        s.send_multipart([env, auth_frame(request_mac(key, ms, nonce, to or node["node"], env), ms, nonce)])
        if not s.poll(timeout_ms):
            return None
        frames = s.recv_multipart()
        return msgpack.unpackb(frames[0], raw=False), frames, ms, nonce
    finally:
        s.close()


@check("a peer request signed from the SPEC is served by the node it names (sealed reply) and refused elsewhere")
def _(c):
    key = cluster_key(open(sys.argv[2], "rb").read())
    got = signed_peer_call(c, "peer_heartbeat", {"transfers": ["none"]})
    assert got is not None, "no reply"
    reply, frames, ms, nonce = got
    assert "ok" in reply and reply["ok"]["unknown"] == ["none"], reply
    assert len(frames) == 2 and frames[1] == auth_frame(reply_mac(key, ms, nonce, frames[0]), ms, nonce), \
        "the reply is sealed with the request's stamp"
    got = signed_peer_call(c, "peer_heartbeat", {"transfers": ["none"]}, to="tcp://10.9.9.9:7101")
    assert got is not None, "no reply"
    reply, frames, _, _ = got
    assert reply["err"]["code"] == "unauthenticated" and len(frames) == 1, (reply, frames)


@check("model identity (SPEC 3.1): the vector checkpoint")
def _(_c):
    import tempfile

    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(b'{"model_type": "llama"}')
    header = b'{"w":{"dtype":"F32","shape":[100000],"data_offsets":[0,400000]}}'
    body = b"".join(struct.pack("<I", ((i * 2654435761) % 2**32) ^ 7) for i in range(100000))
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + body)
    assert model_identity(d) == "kvd-model-v1:598dc877a1d39c9fe03a8e9d16f5012d", model_identity(d)


@check("stats back to baseline")
def _(c):
    s = c.stats()
    assert s["pins"] == 0 and s["pending"] == 0 and s["reserved"] == 0, s
    assert s["blocks"] == 3 + 3 + 4 + 1, s
    assert s["errors"]["unknown_op"] >= 1


# ----- Issue 44: the places an outside client found the daemon and the SPEC apart -----
# (after the baseline check: these leave pins, transfers and refusals behind)

def expect_err(code, fn):
    try:
        fn()
    except KvdError as e:
        assert e.code == code, (e.code, code, e.message)
        return e
    raise AssertionError(f"expected {code}")


@check("control endpoint: a signed envelope over max_envelope_bytes, within the frame cap, gets a sealed too_large (SPEC 6, 10.1 step 2)")
def _(c):
    lim = c.hello_reply["limits"]
    cap = max(lim["max_envelope_bytes"], lim["max_block_bytes"]) + 64 * 1024
    size = (lim["max_envelope_bytes"] + cap) // 2
    assert size > lim["max_envelope_bytes"] + 64 * 1024, \
        f"run the daemon with blocks larger than envelopes (limits {lim})"
    got = signed_peer_call(c, "peer_heartbeat", {"transfers": ["x"], "pad": b"\0" * size})
    assert got is not None, f"no reply to a signed {size}-byte envelope (the frame cap is {cap})"
    reply, frames, ms, nonce = got
    assert reply["err"]["code"] == "too_large", reply
    key = cluster_key(open(sys.argv[2], "rb").read())
    assert len(frames) == 2 and frames[1] == auth_frame(reply_mac(key, ms, nonce, frames[0]), ms, nonce), \
        "the refusal is sealed"


def data_plane(c):
    node = c.hello_reply["node"]
    host, port = node["data"].rsplit(":", 1)
    return node, (host, int(port)), cluster_key(open(sys.argv[2], "rb").read())


def data_ask(c, unix_ms, dst_inc, handle=0x5EC):
    """A signed one-range read on a new data-plane connection: (ok, message, closed after)."""
    node, addr, key = data_plane(c)
    s = socket.create_connection(addr, timeout=10)
    try:
        nonce = int.from_bytes(os.urandom(8), "little")
        s.sendall(data_request(key, node["data"], 1, handle, 1, 5, dst_inc, [(0, 4096)], unix_ms, nonce))
        ok, msg = read_status(s)
        s.settimeout(1.0)
        try:
            closed = s.recv(1) == b""
        except socket.timeout:
            closed = False
        return ok, msg, closed
    finally:
        s.close()


@check("data plane: a signed request stamped before the daemon started is unauthenticated and closes the connection, one signed for an earlier life too (SPEC 10.1)")
def _(c):
    inc = c.hello_reply["node"]["incarnation"]
    now = int(time.time() * 1000)
    started = now - c.stats()["uptime_ms"]
    # the control: a fresh request for this life reaches the grant check, and a refused
    # read leaves the connection open
    ok, msg, closed = data_ask(c, now, inc)
    assert not ok and msg.startswith("unknown_transfer"), msg
    assert not closed, "a refused read closed the connection"
    stamps = [started - d for d in (1500, 5000, 15000, 25000) if now - (started - d) < 29000]
    assert stamps, "the daemon has run too long for a stamp before its start to be fresh"
    for ms in stamps:
        for dst in (inc, inc ^ 1):  # this life, and an earlier one's
            ok, msg, closed = data_ask(c, ms, dst)
            assert not ok and msg.startswith("unauthenticated"), (started - ms, dst == inc, msg)
            assert closed, f"the connection stayed open after {msg!r}"


@check("data plane: a connection that sends nothing is closed at auth_timeout_ms and counted in connections_refused (SPEC 4, 10)")
def _(c):
    before = c.stats()["transfers"]["connections_refused"]
    _, addr, _ = data_plane(c)
    s = socket.create_connection(addr, timeout=20)
    t0 = time.time()
    assert s.recv(1) == b"", "the idle connection was closed"
    waited = time.time() - t0
    s.close()
    assert waited >= 1.0, f"closed after {waited:.2f} s, before the 2 s auth timeout"
    counted = None
    for _ in range(50):
        counted = c.stats()["transfers"]["connections_refused"]
        if counted > before:
            break
        time.sleep(0.1)
    assert counted == before + 1, (before, counted)


@check("a refusal logs the name the daemon expects, on the control endpoint and the data plane (SPEC 10.1)")
def _(c):
    if len(sys.argv) < 4:
        raise AssertionError("pass the daemon's log (--log-format json, info) as the third argument")
    node = c.hello_reply["node"]
    got = signed_peer_call(c, "peer_heartbeat", {"transfers": ["x"]}, to="tcp://10.9.9.9:7101")
    assert got is not None and got[0]["err"]["code"] == "unauthenticated", got
    # another name: the data MAC is for another server
    _, addr, key = data_plane(c)
    s = socket.create_connection(addr, timeout=10)
    ms, nonce = int(time.time() * 1000), int.from_bytes(os.urandom(8), "little")
    s.sendall(data_request(key, "10.9.9.9:7102", 1, 0x10C, 1, 5, node["incarnation"], [(0, 64)], ms, nonce))
    ok, msg = read_status(s)
    s.close()
    assert not ok and msg.startswith("unauthenticated"), msg
    want = {"unauthenticated peer message refused": node["node"], "data-plane request refused": node["data"]}
    seen = {}
    for _ in range(50):
        for line in open(sys.argv[3], errors="replace"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            f = rec.get("fields", {})
            # (grant refusals share the data plane's message: those do not name a MAC's
            # receiver)
            if f.get("message") in want and "expected" in f:
                seen[f["message"]] = f["expected"]
        if len(seen) == len(want):
            break
        time.sleep(0.1)
    assert seen == want, (seen, want)


@check("GPU tier off: all eight GPU ops answer invalid_state with the reason (SPEC 13)")
def _(c):
    lid = layout_id(TINY)
    k = chunk_hashes(list(range(16)), 16, b"gpu-off")
    client = c.hello_reply["client"]
    params = {"transfer_id": "g", "incarnation": c.hello_reply["incarnation"], "handle": 1, "token": 1,
              "layout_id": lid, "keys": k, "lease_ms": 1000}
    calls = {
        "gpu_register": {"layout_id": lid, "regions": [{"handle": b"x", "size": 4096}], "num_blocks": 1,
                         "segments": [{"region": 0, "offset": 0, "stride": 65536, "len": 65536}]},
        "gpu_unregister": {"registration": 1},
        "gpu_list": {},
        "gpu_store": {"registration": 1, "keys": k, "blocks": [0]},
        "gpu_load": {"registration": 1, "keys": k, "blocks": [0]},
        "gpu_export": {"registration": 1, "transfer_id": "g", "keys": k, "blocks": [0]},
        "gpu_pull": {"registration": 1, "blocks": [0], "params": params},
        "gpu_export_status": {"transfer_id": "g"},
    }
    for op, body in calls.items():
        e = expect_err("invalid_state", lambda: c.call(op, {"client": client, **body}))
        assert "GPU tier is off" in e.message, (op, e.message)


@check("layer-wise: parts_done is reported, 0 included, by a staged export and a push registration (SPEC 16)")
def _(c):
    lid = layout_id(TINY)
    client = c.hello_reply["client"]
    k = chunk_hashes(list(range(9000, 9000 + 32)), 16, b"staged")
    ok, _ = c.call("export", {"client": client, "transfer_id": "spec-staged", "layout_id": lid, "keys": k,
                              "parts": 4, "staged": True})
    assert len(ok["slots"]) == 2, ok
    st, _ = c.call("transfer_status", {"client": client, "transfer_id": "spec-staged"})
    assert st["parts"] == 4 and "parts_done" in st and st["parts_done"] == 0, st
    r, _ = c.call("push_register", {"client": client, "transfer_id": "spec-push", "layout_id": lid,
                                    "keys": chunk_hashes(list(range(9100, 9100 + 32)), 16, b"staged"),
                                    "node": c.hello_reply["node"]["node"], "parts": 4})
    assert r["parts"] == 4 and "parts_done" in r and r["parts_done"] == 0, r
    for t in ("spec-staged", "spec-push"):
        c.call("abort", {"client": client, "transfer_id": t})


@check("a peer_ op unknown to the daemon is unauthenticated on a client endpoint, like a known one (SPEC 10)")
def _(c):
    expect_err("unauthenticated", lambda: c.call("peer_heartbeat", {"transfers": []}))
    expect_err("unauthenticated", lambda: c.call("peer_defragment", {}))
    expect_err("unknown_op", lambda: c.call("defragment"))


@check("KV events topic vector (SPEC 14): the layout id's number in hex")
def _(_c):
    assert "kvd.%016x" % layout_id(TINY) == "kvd.1d6bcf43bceea3fa"


@check("writer checksums (SPEC 17): the vector, commit with crcs, get replies carry them, a flipped byte is a miss and verify drops it")
def _(c):
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes((i * 31 + 7) % 256 for i in range(65536))) == 0x55DD3DCD
    lid = layout_id(TINY)
    bb = block_bytes(TINY)
    keys = chunk_hashes(list(range(7000, 7000 + 16 * 3)), 16, b"checksums")
    a = c.alloc(lid, keys)
    blobs = [os.urandom(bb) for _ in keys]
    for off, blob in zip(a["offsets"], blobs):
        c.pool[off:off + bb] = blob
    expect_err("invalid_argument", lambda: c.commit(lid, keys, a["offsets"], crcs=[1]))
    assert c.commit(lid, keys, a["offsets"], crcs=[crc32c(b) for b in blobs]) == {"committed": 3}
    ok, _ = c.get(lid, keys + [b"\x01" * 16])
    assert ok["crcs"] == [crc32c(b) for b in blobs] + [None], ok
    c.release([ok["pin"]])
    # A bit flipped in the pool under the second block: an inline get (the daemon checks
    # as it copies) answers it as a miss, and the daemon dropped it.
    off = a["offsets"][1]
    c.pool[off + 3] = c.pool[off + 3] ^ 0x40
    before = c.stats()["checksums"]
    ok, frames = c.get(lid, keys, inline=True)
    assert ok["offsets"][1] is None and [bytes(f) for f in frames] == [blobs[0], blobs[2]], ok
    after = c.stats()["checksums"]
    assert after["damaged"] == before["damaged"] + 1, (before, after)
    assert c.verify(lid, keys) == {"status": ["intact", "missing", "intact"]}
    # A payload frame that does not match the crc sent with it is refused.
    more = chunk_hashes(list(range(7100, 7100 + 16)), 16, b"checksums")
    c.alloc(lid, more)
    blob = os.urandom(bb)
    expect_err("invalid_argument", lambda: c.commit(lid, more, payloads=[blob], crcs=[crc32c(blob) ^ 1]))
    assert c.commit(lid, more, payloads=[blob], crcs=[crc32c(blob)]) == {"committed": 1}


def main():
    client = Client(sys.argv[1])
    passed = failed = 0
    for name, fn in CHECKS:
        try:
            fn(client)
            passed += 1
            print(f"ok   {name}")
        except Exception as e:  # report every check, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    client.close()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
