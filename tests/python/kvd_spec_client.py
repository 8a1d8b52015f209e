"""A kvd client written from protocol/SPEC.md alone (pyzmq + msgpack + the stdlib).

It is the proof that the spec is enough to talk to the daemon from another language; the
test suite runs test_spec_client.py, which drives it against a real daemon.
"""

import hashlib
import itertools
import mmap
import os
import socket
import struct

import msgpack
import zmq

PROTOCOL_VERSION = 1
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "u8": 1}
LAYOUT_FIELDS = ["model", "num_layers", "kv_parts", "num_kv_heads", "head_dim", "dtype",
                 "tokens_per_block", "tp_size", "tp_rank", "order"]


class KvdError(Exception):
    """An `err` reply: SPEC section 5."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ----- SPEC section 3 -----

def blake2b128(data):
    return hashlib.blake2b(data, digest_size=16).digest()


_CRC32C = []


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli, reflected, init and final xor 0xFFFFFFFF): SPEC 17's writer
    checksum (table-driven, from the polynomial alone)."""
    if not _CRC32C:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC32C.append(c)
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def chunk_root(salt=b""):
    return blake2b128(b"kvd.root.v1" + salt)


def chunk_hashes(tokens, tokens_per_block, salt=b""):
    parent = chunk_root(salt)
    out = []
    full = len(tokens) // tokens_per_block * tokens_per_block
    for i in range(0, full, tokens_per_block):
        block = b"".join(struct.pack("<I", t) for t in tokens[i:i + tokens_per_block])
        parent = blake2b128(b"kvd.chunk.v1" + parent + block)
        out.append(parent)
    return out


def layout_id(layout):
    text = "kvd.layout.v1\n" + "".join(f"{f}={layout[f]}\n" for f in LAYOUT_FIELDS)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def block_bytes(layout):
    heads = max(1, layout["num_kv_heads"] // layout["tp_size"])
    return (layout["num_layers"] * layout["kv_parts"] * layout["tokens_per_block"] * heads
            * layout["head_dim"] * DTYPE_BYTES[layout["dtype"]])


def model_identity(path):
    """SPEC 3.1 "Model identity" of a checkpoint directory or one weight file."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
    if os.path.isdir(path):
        names = sorted((n for n in os.listdir(path)
                        if (n == "config.json" or n.endswith(weights)) and os.path.isfile(os.path.join(path, n))),
                       key=lambda n: n.encode())
        files = [(n, n, os.path.join(path, n)) for n in names]
    else:
        files = [("", os.path.basename(path), path)]
    if not any(real.endswith(weights) for _, real, _ in files):
        raise ValueError("no weight file")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvd.model.v1\0")
    for hashed, real, p in files:
        data = open(p, "rb").read()
        h.update(struct.pack("<I", len(hashed.encode())) + hashed.encode() + struct.pack("<Q", len(data)))
        if real == "config.json":
            h.update(data)
            continue
        if real.endswith(".safetensors"):
            (n,) = struct.unpack_from("<Q", data)
            h.update(data[:8 + n])
            a = 8 + n
        else:
            a = min(65536, len(data))
            h.update(data[:a])
        b = len(data)
        if b - a <= 64 * 4096:
            h.update(data[a:b])
        else:
            for i in range(64):
                o = a + i * (b - a - 4096) // 63
                h.update(data[o:o + 4096])
    return "kvd-model-v1:" + h.hexdigest()


# ----- SPEC section 10.1 -----

def secret_bytes(text):
    """The secret: the file's bytes less ASCII space, tab, CR and LF at both ends."""
    return text.strip(b" \t\r\n")


def cluster_key(file_bytes):
    return hashlib.blake2b(b"kvd.cluster-key.v1" + secret_bytes(file_bytes), digest_size=32).digest()


def _mac(key, label, unix_ms, nonce, *parts):
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(label + struct.pack("<QQ", unix_ms, nonce))
    for p in parts:
        h.update(p)
    return h.digest()


def _to(name):
    return struct.pack("<I", len(name.encode())) + name.encode()


def request_mac(key, unix_ms, nonce, to, envelope):
    return _mac(key, b"kvd.peer.req.v2", unix_ms, nonce, _to(to), envelope)


def reply_mac(key, unix_ms, nonce, envelope):
    return _mac(key, b"kvd.peer.reply.v1", unix_ms, nonce, envelope)


def data_mac(key, unix_ms, nonce, to, head):
    return _mac(key, b"kvd.data.v2", unix_ms, nonce, _to(to), head)


def auth_frame(mac, unix_ms, nonce):
    return b"KVA1" + struct.pack("<QQ", unix_ms, nonce) + mac


# ----- SPEC section 10, "Data plane (TCP)" -----

def _pad64(b):
    return b + b"\0" * (-len(b) % 64)


def data_request(key, to, op, handle, token, src_inc, dst_inc, ranges, unix_ms, nonce, crc=False):
    """A data-plane request (op 1 read, 2 write) signed for the data server named `to`;
    a checked write (crc) goes as version 4, everything else as version 3."""
    version = 4 if (op == 2 and crc) else 3
    head = b"KVDX" + struct.pack("<BBH", version, op, 1 if crc else 0)
    head += struct.pack("<QQQQII", handle, token, src_inc, dst_inc, len(ranges), 0)
    head += b"".join(struct.pack("<QQ", off, ln) for off, ln in ranges)
    mac = data_mac(key, unix_ms, nonce, to, head)
    return _pad64(head + struct.pack("<QQ", unix_ms, nonce) + mac)


def read_status(sock):
    """(ok, message) of one data-plane status: 64 bytes, then an error's padded message."""
    def exact(n):
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the data server closed the connection")
            out += chunk
        return out
    status = exact(64)
    (msg_len,) = struct.unpack_from("<I", status, 4)
    assert status[1:4] == b"\0\0\0" and status[8:] == b"\0" * 56, status
    msg = exact(msg_len + (-msg_len % 64))[:msg_len].decode()
    return status[0] == 0, msg


# ----- SPEC sections 1, 2, 4 -----

def encode_request(req_id, op, body=None):
    env = {"v": PROTOCOL_VERSION, "id": req_id, "op": op}
    if body is not None:
        env["body"] = body
    return msgpack.packb(env, use_bin_type=True)


def encode_stream_message(frames):
    """SPEC 1.1: frame count, then each frame's length and bytes (u32 little-endian)."""
    out = [struct.pack("<I", len(frames))]
    for f in frames:
        out += [struct.pack("<I", len(f)), bytes(f)]
    return b"".join(out)


def decode_stream_message(buf):
    """(frames, bytes used) of the first whole message in buf, or None if incomplete."""
    if len(buf) < 4:
        return None
    (n,), at, frames = struct.unpack_from("<I", buf), 4, []
    for _ in range(n):
        if len(buf) < at + 4:
            return None
        (ln,) = struct.unpack_from("<I", buf, at)
        if len(buf) < at + 4 + ln:
            return None
        frames.append(buf[at + 4:at + 4 + ln])
        at += 4 + ln
    return frames, at


class Client:
    def __init__(self, endpoint, timeout_ms=10000):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.timeout_ms = timeout_ms
        self.ids = itertools.count(1)
        self.pool = None
        self.hello_reply = None
        self.stream = None  # SPEC 1.1, once use_stream() connected

    # ----- SPEC section 1.1: the local stream transport -----

    def use_stream(self):
        """Sends every later request over the stream socket `hello` named, after checking
        the greeting's incarnation. Returns the greeting."""
        info = self.hello_reply["stream"]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_ms / 1000)
        s.connect(info["path"])
        self.stream, self.stream_buf = s, b""
        (greeting,) = self.stream_recv()
        greeting = msgpack.unpackb(greeting, raw=False)
        assert greeting["v"] == PROTOCOL_VERSION
        assert greeting["incarnation"] == self.hello_reply["incarnation"], "another daemon"
        return greeting

    def stream_send_raw(self, data):
        self.stream.sendall(data)

    def stream_send(self, frames):
        self.stream_send_raw(encode_stream_message(frames))

    def stream_recv(self):
        """The next whole message's frames; EOFError when the daemon closed."""
        while True:
            frames = decode_stream_message(self.stream_buf)
            if frames is not None:
                frames, used = frames
                self.stream_buf = self.stream_buf[used:]
                return frames
            chunk = self.stream.recv(1 << 16)
            if not chunk:
                raise EOFError("the daemon closed the stream connection")
            self.stream_buf += chunk

    def call(self, op, body=None, payloads=()):
        """One round trip. Returns (ok body, payload frames); raises KvdError on `err`."""
        req_id = next(self.ids)
        frames_out = [encode_request(req_id, op, body), *payloads]
        if self.stream is not None:
            self.stream_send(frames_out)
        else:
            self.sock.send_multipart(frames_out)
        while True:
            if self.stream is not None:
                frames = self.stream_recv()
            else:
                if not self.sock.poll(self.timeout_ms):
                    raise TimeoutError(f"no reply to {op}")
                frames = self.sock.recv_multipart()
            reply = msgpack.unpackb(frames[0], raw=False)
            if reply["id"] != req_id:
                continue  # a late reply to an earlier request
            assert reply["v"] == PROTOCOL_VERSION
            if "err" in reply:
                raise KvdError(reply["err"]["code"], reply["err"]["message"])
            return reply["ok"], frames[1:]

    def hello(self, name="spec-client"):
        ok, _ = self.call("hello", {"client_name": name, "pid": os.getpid()})
        self.hello_reply = ok
        self.client = ok["client"]
        return ok

    def map_pool(self):
        """SPEC section 8: map the pool and check its header."""
        info = self.hello_reply["pool"]
        fd = os.open(info["path"], os.O_RDWR)
        try:
            self.pool = mmap.mmap(fd, info["size_bytes"], mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, inc, size, data_offset = struct.unpack_from("<8sQQQ", self.pool, 0)
        assert magic == b"KVDPOOL1", magic
        assert inc == self.hello_reply["incarnation"], "stale pool file"
        assert size == info["size_bytes"] and data_offset == info["data_offset"]

    def register_layout(self, layout):
        ok, _ = self.call("register_layout", {"layout": layout})
        return ok

    def lookup(self, lid, keys):
        return self.call("lookup", {"layout_id": lid, "keys": keys})[0]

    def alloc(self, lid, keys):
        return self.call("alloc", {"client": self.client, "layout_id": lid, "keys": keys})[0]

    def commit(self, lid, keys, offsets=None, payloads=(), crcs=None):
        body = {"client": self.client, "layout_id": lid, "keys": keys}
        if offsets is not None:
            body["offsets"] = offsets
        if crcs is not None:
            body["crcs"] = crcs
        return self.call("commit", body, payloads)[0]

    def verify(self, lid, keys):
        return self.call("verify", {"client": self.client, "layout_id": lid, "keys": keys})[0]

    def get(self, lid, keys, ttl_ms=None, inline=False):
        body = {"client": self.client, "layout_id": lid, "keys": keys, "inline": inline}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        return self.call("get", body)

    def release(self, pins):
        return self.call("release", {"client": self.client, "pins": pins})[0]

    def delete(self, lid, keys):
        return self.call("delete", {"client": self.client, "layout_id": lid, "keys": keys})[0]

    def reserve(self, lid, count):
        return self.call("reserve", {"client": self.client, "layout_id": lid, "count": count})[0]

    def put(self, lid, keys, offsets):
        body = {"client": self.client, "layout_id": lid, "keys": keys, "offsets": offsets}
        return self.call("put", body)[0]

    def unreserve(self, offsets):
        return self.call("unreserve", {"client": self.client, "offsets": offsets})[0]

    def stats(self):
        return self.call("stats")[0]

    def close(self):
        if self.pool is not None:
            self.pool.close()
        if self.stream is not None:
            self.stream.close()
        self.sock.close()
        self.ctx.term()
