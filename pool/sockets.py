"""Blocking socket helpers shared by both wire protocols: exact receives, drains and zero-copy sends.

One copy for the store protocol and the transfer engine's tcp transport. The
send loop is linear in the number of buffers (it advances an index instead of
popping from the front of a list) and never joins buffers: each is handed to
``sendmsg`` as its own iovec, so bytes leave from the caller's memory.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

Buffer = bytes | bytearray | memoryview


class Stream(Protocol):
    """A connected plain socket or a TLS stream (``pool.tls.TlsStream``): what these helpers and the wire
    protocols use of a connection."""

    def recv_into(self, buffer: Any, nbytes: int = 0, /) -> int: ...
    def send(self, data: Any, /) -> int: ...
    def sendall(self, data: Any, /) -> Any: ...
    def settimeout(self, value: float | None, /) -> None: ...
    def gettimeout(self) -> float | None: ...
    def shutdown(self, how: int, /) -> None: ...
    def close(self) -> None: ...
    def fileno(self) -> int: ...  # for select(): both have one (the TLS stream its socket's)

# Linux caps one sendmsg at IOV_MAX (1024) iovecs; stay below it.
MAX_IOVECS = 1000


def until(sock: Stream, deadline: float | None) -> None:
    """Give the next socket call only the time left before ``deadline`` (monotonic); TimeoutError once past it."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def recv_exact_into(sock: Stream, view: memoryview, *, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; raises ConnectionError if the peer closes first.

    ``deadline`` (``time.monotonic()``) bounds the whole receive, not each read: a peer sending a
    byte at a time cannot stretch it.
    """
    got = 0
    n = view.nbytes
    while got < n:
        until(sock, deadline)
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += r


def recv_exact(sock: Stream, n: int, *, deadline: float | None = None) -> bytearray:
    """``n`` bytes from ``sock`` in a new buffer."""
    buf = bytearray(n)
    if n:
        recv_exact_into(sock, memoryview(buf), deadline=deadline)
    return buf


def discard(sock: Stream, n: int, *, deadline: float | None = None) -> None:
    """Read and drop ``n`` bytes (data for keys that could not be stored)."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        chunk = min(n, len(scratch))
        recv_exact_into(sock, scratch[:chunk], deadline=deadline)
        n -= chunk


def send_all(sock: Stream, parts: Sequence[Buffer], *, deadline: float | None = None) -> None:
    """``sendmsg`` a list of buffers without joining them, resuming after partial sends.

    ``deadline`` bounds the whole send: a peer that stops reading cannot hold the sender (and what
    it is sending) past it.
    """
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if hasattr(sock, "cipher"):  # a TLS socket has no sendmsg: each buffer goes through the cipher in turn
        for view in views:
            while len(view):
                until(sock, deadline)
                view = view[sock.send(view):]
        return
    raw = cast(socket.socket, sock)  # not TLS: a plain socket
    first = 0
    while first < len(views):
        until(sock, deadline)
        sent = raw.sendmsg(views[first:first + MAX_IOVECS])
        while sent:
            size = views[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0
