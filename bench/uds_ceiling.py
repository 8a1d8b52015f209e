"""The ceiling of the payload-frame path on this machine: 256 MiB through one Unix stream
socket between two processes, in 16 MiB writes read with recv_into (no kvd). Prints
GB/s. See bench/README.md, "What local byte isolation costs"."""

import os
import socket
import time

N = 256 << 20
CHUNK = 16 << 20

a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
pid = os.fork()
if pid == 0:
    a.close()
    view = memoryview(bytearray(CHUNK))
    got = 0
    while got < N:
        got += b.recv_into(view, CHUNK)
    b.sendall(b"x")
    os._exit(0)
b.close()
data = b"\x01" * CHUNK
t0 = time.time()
for _ in range(N // CHUNK):
    a.sendall(data)
a.recv(1)
print(f"unix stream socket, 16 MiB writes: {N / (time.time() - t0) / 1e9:.2f} GB/s")
os.waitpid(pid, 0)
