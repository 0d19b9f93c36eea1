"""TLS for both tcp paths (the store protocol and the transfer engine): the one place contexts are built.

Settings are three PEM files, the same for every tcp server of an agent
(``AgentSettings.tls_cert_file``, ``tls_key_file``, ``tls_ca_file``): the
certificate and key it serves with, and the CA bundle it checks the servers it
dials against (empty: the system's CAs). The server side does not ask for client
certificates: peers prove the pool credential in the challenge-response
(``pool/handshake.py``) that runs inside the TLS session.

``TlsStream`` is for connections that one thread reads while another writes
(the transfer engine's striped tcp connections). OpenSSL FORBIDS CONCURRENT
SSL_read AND SSL_write ON ONE SSL OBJECT, which is what ``ssl.SSLSocket`` would
do there; the stream runs the TLS state machine over memory BIOs under a lock
that is never held across socket I/O, so a blocked read cannot stall a write.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

__all__ = ["TlsContexts", "TlsSettingsError", "TlsStream", "client_context", "contexts", "looks_like_tls",
           "server_context"]

# A TLS connection opens with a handshake record (content type 22); anything else is a plaintext peer.
TLS_HANDSHAKE_RECORD = 0x16
_RECV_CHUNK = 256 << 10  # ciphertext read per socket call; a TLS record is at most ~16 KiB
_SEND_CHUNK = 256 << 10  # plaintext encrypted per send call (keeps the ciphertext buffer bounded)


class TlsSettingsError(DaybreakError, ValueError):
    """A TLS setting that cannot work (a missing or unreadable file, a certificate without its key)."""


def server_context(*, cert_file: str, key_file: str) -> ssl.SSLContext:
    """The context a tcp server serves TLS with (TLS 1.2 or newer, the ``ssl`` module's default ciphers)."""
    if not cert_file or not key_file:
        raise TlsSettingsError("tls_cert_file and tls_key_file: give both (or neither)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSettingsError(f"tls_cert_file {cert_file!r} / tls_key_file {key_file!r}: {exc}") from exc
    return context


def client_context(*, ca_file: str = "") -> ssl.SSLContext:
    """The context a client checks servers with: their certificate against ``ca_file`` (empty: system CAs)
    and their host name or IP address against the certificate."""
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSettingsError(f"tls_ca_file {ca_file!r}: {exc}") from exc


@dataclass(frozen=True)
class TlsContexts:
    """What one process speaks TLS with: ``server`` for its listeners (None: it serves no TLS), ``client``
    for the connections it opens."""

    server: ssl.SSLContext | None
    client: ssl.SSLContext


def contexts(*, cert_file: str = "", key_file: str = "", ca_file: str = "") -> TlsContexts | None:
    """Both contexts from the three settings; None when no certificate is set (plain tcp)."""
    if not cert_file and not key_file:
        return None
    return TlsContexts(server=server_context(cert_file=cert_file, key_file=key_file),
                       client=client_context(ca_file=ca_file))


def looks_like_tls(sock: socket.socket) -> bool:
    """Peek at the first byte a new connection sent: True for a TLS handshake record.

    Lets a TLS-only server tell a plaintext peer why it is refused instead of failing a handshake
    on bytes that were never TLS. Uses the socket's timeout; ConnectionError when the peer sent nothing.
    """
    first = sock.recv(1, socket.MSG_PEEK)
    if not first:
        raise ConnectionError("peer closed the connection before sending anything")
    return first[0] == TLS_HANDSHAKE_RECORD


class TlsStream:
    """A TLS session over a connected blocking socket, safe for one reader thread and one writer thread.

    Socket-like where ``pool.sockets`` needs it: ``recv_into``, ``send``, ``sendall``,
    ``settimeout``/``gettimeout`` (of the socket below), ``shutdown``, ``close``; it has ``cipher``,
    so ``send_all`` sends buffer by buffer. Build it with ``client`` or ``server``, which run the
    handshake before returning.
    """

    def __init__(self, raw: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self._raw = raw
        self._obj = obj
        self._in = incoming
        self._out = outgoing
        self._lock = threading.Lock()  # guards the SSL object and both BIOs; never held across socket calls
        self._write_lock = threading.Lock()  # ciphertext leaves in the order it was produced
        self._read_lock = threading.Lock()  # one reader at a time (it owns the scratch buffer)
        self._scratch = bytearray(_RECV_CHUNK)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def client(cls, raw: socket.socket, context: ssl.SSLContext, *, server_hostname: str,
               deadline: float) -> TlsStream:
        """Handshake as a client, checking the server's certificate for ``server_hostname``."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        stream = cls(raw, context.wrap_bio(incoming, outgoing, server_hostname=server_hostname), incoming, outgoing)
        stream._handshake(deadline)
        return stream

    @classmethod
    def server(cls, raw: socket.socket, context: ssl.SSLContext, *, deadline: float) -> TlsStream:
        """Handshake as a server; ``deadline`` (``time.monotonic()``) bounds the whole handshake."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        stream = cls(raw, context.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing)
        stream._handshake(deadline)
        return stream

    def _handshake(self, deadline: float) -> None:
        previous = self._raw.gettimeout()
        try:
            while True:
                try:
                    self._obj.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                pending = self._out.read()
                if pending:
                    self._raw.settimeout(_left(deadline))
                    self._raw.sendall(pending)
                if done:
                    return
                self._raw.settimeout(_left(deadline))
                chunk = self._raw.recv(_RECV_CHUNK)
                if not chunk:
                    raise ConnectionError("peer closed the connection during the TLS handshake "
                                          "(does it serve TLS?)")
                self._in.write(chunk)
        finally:
            self._raw.settimeout(previous)

    # -- socket-like surface ---------------------------------------------------------------------
    def cipher(self) -> tuple[str, str, int] | None:
        return self._obj.cipher()

    def version(self) -> str | None:
        return self._obj.version()

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0) -> int:
        """Up to ``nbytes`` (default: all of ``buffer``) plaintext bytes; 0 when the peer closed."""
        view = memoryview(buffer).cast("B")
        want = min(nbytes or view.nbytes, view.nbytes)
        if not want:
            return 0
        with self._read_lock:
            while True:
                with self._lock:
                    try:
                        got: int = self._obj.read(want, view)  # type: ignore[assignment]  # with a buffer: a count
                        return got
                    except ssl.SSLWantReadError:
                        pass
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        return 0
                    has_output = self._out.pending > 0
                if has_output:  # the state machine answered something (a key update): send it if we may
                    self._flush(blocking=False)
                got = self._raw.recv_into(self._scratch)
                if not got:
                    return 0
                with self._lock:
                    self._in.write(memoryview(self._scratch)[:got])

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf)
        return bytes(buf[:got])

    def send(self, data: bytes | bytearray | memoryview) -> int:
        """Encrypt and send up to ``_SEND_CHUNK`` bytes of ``data``; returns how many were taken."""
        view = memoryview(data).cast("B")[:_SEND_CHUNK]
        if not view.nbytes:
            return 0
        with self._write_lock:
            with self._lock:
                self._obj.write(view)
                ciphertext = self._out.read()
            self._raw.sendall(ciphertext)
        return view.nbytes

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            view = view[self.send(view):]

    def _flush(self, *, blocking: bool) -> None:
        # Non-blocking from the reader: a writer stuck on a full socket must not hold the reader too;
        # what is left in the BIO goes out ahead of the next write's records.
        if not self._write_lock.acquire(blocking=blocking):
            return
        try:
            with self._lock:
                ciphertext = self._out.read()
            if ciphertext:
                self._raw.sendall(ciphertext)
        finally:
            self._write_lock.release()

    def settimeout(self, value: float | None) -> None:
        self._raw.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._raw.gettimeout()

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._raw.setsockopt(level, option, value)

    def getpeername(self) -> tuple[str, int]:
        name: tuple[str, int] = self._raw.getpeername()
        return name

    def fileno(self) -> int:
        return self._raw.fileno()

    def shutdown(self, how: int) -> None:
        """Shut the socket below down (wakes a reader blocked in it); no TLS close_notify is sent."""
        self._raw.shutdown(how)

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("TLS handshake deadline passed")
    return left
