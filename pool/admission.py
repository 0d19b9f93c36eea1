"""Connection admission for the agent's tcp servers (the store's and the transfer engine's): one set of caps.

Both servers spend a thread per connection, so a cap checked before the thread
is started is what keeps a flood from one address (or from everyone) from
costing memory and descriptors without bound (issue 12 finding 6). ``Admission``
counts every open connection in total and per peer address, refuses past either
cap, and keeps a bounded set of connections still inside their handshake: a new
one displaces the oldest of its address (or of all) instead of being refused, so
a real client, done in a round trip, is never locked out by silent ones. Once
authenticated, a connection also counts against its credential
(``max_connections_per_credential``, the store's namespace credentials): one
tenant's idle connections, from however many addresses, cannot fill the server
(issue 22 finding 3). Refusals and the fd-limit backoff log at most one line a second.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# accept() errors that mean "out of descriptors or kernel memory": back off, the listener is fine.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_SECONDS = 0.1


@dataclass(frozen=True)
class Caps:
    """Connection caps of one server (docs/security.md: each one is a control there)."""

    max_connections: int = 1024           # per server, authenticated or not
    max_connections_per_address: int = 256
    max_preauth: int = 256                # connections inside the handshake; the oldest is dropped for a new one
    max_preauth_per_address: int = 64
    max_connections_per_credential: int = 128  # authenticated, per credential the server caps (see ``authenticated``)

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_address", "max_preauth", "max_preauth_per_address",
                     "max_connections_per_credential"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class Admission:
    """The open connections of one server, by peer address, and which are still handshaking.

    ``label`` goes into every log line (``server=store agent=ID``); ``on_refused`` is called once per
    refused connection (the store counts it in a metric).
    """

    def __init__(self, caps: Caps, *, label: str, on_refused: Callable[[], None] | None = None) -> None:
        self.caps = caps
        self.label = label
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._conns: set[Any] = set()
        self._preauth: OrderedDict[Any, str] = OrderedDict()  # oldest first -> peer host
        self._per_host: Counter[str] = Counter()
        self._credential_of: dict[Any, str] = {}
        self._per_credential: Counter[str] = Counter()
        self._last_log = 0.0

    def admit(self, conn: socket.socket, host: str) -> bool:
        """Count ``conn`` from ``host`` in, or close it and return False when a cap is reached."""
        caps = self.caps
        with self._lock:
            refuse = (len(self._conns) >= caps.max_connections
                      or self._per_host[host] >= caps.max_connections_per_address)
            if not refuse:
                same = [c for c, h in self._preauth.items() if h == host]
                victim = same[0] if len(same) >= caps.max_preauth_per_address else (
                    next(iter(self._preauth)) if len(self._preauth) >= caps.max_preauth else None)
                if victim is not None:
                    # Its serving thread sees the shutdown and releases it; it stays counted until then.
                    self._preauth.pop(victim, None)
                    with contextlib.suppress(OSError):
                        victim.shutdown(socket.SHUT_RDWR)
                self._conns.add(conn)
                self._preauth[conn] = host
                self._per_host[host] += 1
        if refuse:
            if self._on_refused is not None:
                self._on_refused()
            self.log_limited("event=connection_refused %s peer=%s reason=connection_cap", self.label, host)
            conn.close()
            return False
        return True

    def replace(self, old: Any, new: Any) -> None:
        """``old`` now lives on as ``new`` (a TLS wrapper): shutdowns must reach the object that owns the fd."""
        with self._lock:
            self._conns.discard(old)
            self._conns.add(new)
            host = self._preauth.pop(old, None)
            if host is not None:
                self._preauth[new] = host

    def authenticated(self, conn: Any) -> None:
        """The handshake is done: ``conn`` no longer counts against the handshake caps (still against the others)."""
        with self._lock:
            self._preauth.pop(conn, None)

    def admit_credential(self, conn: Any, credential: str) -> bool:
        """Count an authenticated ``conn`` against ``credential`` (the scope it proved); False past the cap.

        On False the caller answers with the reason and closes it (``release`` as usual). Call once per
        connection, after ``authenticated``, for the credentials the server caps.
        """
        with self._lock:
            if self._per_credential[credential] >= self.caps.max_connections_per_credential:
                refused = True
            else:
                refused = False
                self._per_credential[credential] += 1
                self._credential_of[conn] = credential
        if refused:
            self.log_limited("event=connection_refused %s credential=%s reason=credential_cap", self.label, credential)
        return not refused

    def release(self, host: str, *conns: Any) -> None:
        """The connection is closed: each of its objects (raw socket, wrapper) leaves the counts once."""
        with self._lock:
            for conn in conns:
                self._conns.discard(conn)
                self._preauth.pop(conn, None)
                credential = self._credential_of.pop(conn, None)
                if credential is not None:
                    self._per_credential[credential] -= 1
                    if self._per_credential[credential] <= 0:
                        del self._per_credential[credential]
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]

    def shutdown_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def counts(self) -> tuple[int, int]:
        """(all connections, connections inside the handshake)."""
        with self._lock:
            return len(self._conns), len(self._preauth)

    def accept_failed(self, exc: OSError) -> bool:
        """An ``accept()`` error: True (after a logged backoff) when out of descriptors, False otherwise.

        Spinning on accept at the fd limit burns a core and logs nothing; leaving the accept loop stops the
        server for good. Backing off lets closing connections free descriptors.
        """
        if exc.errno not in _RESOURCE_ERRNOS:
            return False
        self.log_limited("event=accept_failed %s reason=%s action=backoff_100ms", self.label,
                         errno.errorcode.get(exc.errno or 0, str(exc)))
        time.sleep(BACKOFF_SECONDS)
        return True

    def log_limited(self, fmt: str, *args: object) -> None:
        """At most one warning a second: a flood must not become a log flood."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < 1.0:
                return
            self._last_log = now
        log.warning(fmt, *args)
