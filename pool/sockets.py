"""Blocking socket helpers shared by both wire protocols: exact receives, drains and zero-copy sends.

One copy for the store protocol and the transfer engine's tcp transport. The
send loop is linear in the number of buffers (it advances an index instead of
popping from the front of a list) and never joins buffers: each is handed to
``sendmsg`` as its own iovec, so bytes leave from the caller's memory.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview

# Linux caps one sendmsg at IOV_MAX (1024) iovecs; stay below it.
MAX_IOVECS = 1000


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raises ConnectionError if the peer closes first."""
    got = 0
    n = view.nbytes
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += r


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock`` in a new buffer."""
    buf = bytearray(n)
    if n:
        recv_exact_into(sock, memoryview(buf))
    return buf


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (data for keys that could not be stored)."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        chunk = min(n, len(scratch))
        recv_exact_into(sock, scratch[:chunk])
        n -= chunk


def send_all(sock: socket.socket, parts: Sequence[Buffer]) -> None:
    """``sendmsg`` a list of buffers without joining them, resuming after partial sends."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + MAX_IOVECS])
        while sent:
            size = views[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0
