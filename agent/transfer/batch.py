"""Transfer requests, per-request results and the batch handle callers wait on (threads or asyncio)."""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from daybreak.errors import DaybreakError

if TYPE_CHECKING:
    from daybreak.agent.transfer.transport import RemoteSegment


class Pump(Protocol):
    """A transport connection that can read its answers in a waiting caller's thread."""

    def pump(self, batch: BatchHandle) -> None: ...

    def kick(self) -> None: ...


class Op(enum.Enum):
    """READ copies remote -> local; WRITE copies local -> remote."""

    READ = "read"
    WRITE = "write"


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"


class TransferError(DaybreakError):
    """A request (or a whole batch, from ``raise_for_status``) did not complete; the message says why."""


@dataclass(slots=True)
class TransferRequest:
    """One READ or WRITE of ``length`` bytes between a local buffer and a remote segment.

    ``local`` is any buffer (``memoryview``, ``bytearray``, ``mmap``; writable for READ) or a
    registered ``LocalSegment``; ``local_offset`` is where in it the bytes start. ``length``
    defaults to the rest of the local buffer. ``capability``: the opaque grant a peer that
    checks one-sided access wants with the request (a store agent's XLOCATE/XALLOC reply,
    ``pool/capability.py``); carried by tcp, b'' for none.
    """

    op: Op
    remote: RemoteSegment
    remote_offset: int
    local: Any
    local_offset: int = 0
    length: int | None = None
    capability: bytes = b""

    @classmethod
    def read(cls, remote: RemoteSegment, remote_offset: int, into: Any, *, local_offset: int = 0,
             length: int | None = None, capability: bytes = b"") -> TransferRequest:
        return cls(Op.READ, remote, remote_offset, into, local_offset, length, capability)

    @classmethod
    def write(cls, remote: RemoteSegment, remote_offset: int, source: Any, *, local_offset: int = 0,
              length: int | None = None, capability: bytes = b"") -> TransferRequest:
        return cls(Op.WRITE, remote, remote_offset, source, local_offset, length, capability)


@dataclass(slots=True)
class RequestResult:
    """Outcome of one request: status, the transport that finished it (or last tried), and the cause."""

    status: Status = Status.PENDING
    transport: str = ""
    error: str = ""
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.status is Status.COMPLETED


class BatchHandle:
    """Completion of one submitted batch: poll (``done``), block (``wait``) or ``await`` it.

    Every request ends ``completed``, ``failed`` or ``timeout`` no later than the batch
    deadline (plus the engine's reaction time); ``results[i]`` belongs to request ``i``.
    After a request fails or times out the bytes of its destination range are undefined.
    """

    __slots__ = ("_aborting", "_callbacks", "_done", "_expire_lock", "_lock", "_on_expire", "_pumps", "_released",
                 "_remaining", "deadline", "handed_out", "results", "size")

    def __init__(self, size: int, *, deadline: float, on_expire: Callable[[BatchHandle], None] | None = None) -> None:
        self.size = size
        self.deadline = deadline  # time.monotonic() value
        self.results = [RequestResult() for _ in range(size)]
        self._remaining = size
        self._lock = threading.Lock()
        # held until the last request finishes: a plain lock is far cheaper than a Condition,
        # and batches are created at KV-block rates
        self._done = threading.Lock()
        self._done.acquire()
        self._callbacks: list[Callable[[BatchHandle], None]] = []
        self._pumps: list[Pump] | None = None
        # set when submit returns: from then on a waiter may already be blocked, so transports
        # must not leave answers for it to read (a fallback after a failure runs on another thread)
        self.handed_out = False
        self._on_expire = on_expire
        # While the transports abort at the deadline, requests they break may finish, but
        # nobody is released until the abort is over (see expire).
        self._aborting = False
        self._released = False
        self._expire_lock = threading.Lock()

    # -- completion, called by the engine and transports -------------------------
    def finish(self, index: int, status: Status, *, transport: str = "", error: str = "") -> bool:
        """Set request ``index``'s final status once; later calls for it are ignored (returns False)."""
        with self._lock:
            result = self.results[index]
            if result.status is not Status.PENDING:
                return False
            result.status = status
            if transport:
                result.transport = transport
            result.error = error
            self._remaining -= 1
            callbacks = self._claim_release()
        if callbacks is not None:
            self._release(callbacks)
        return True

    def _claim_release(self) -> list[Callable[[BatchHandle], None]] | None:
        """With ``_lock`` held: mark the batch released once nothing is pending and no abort runs;
        returns the callbacks to run (outside the lock), or None when it is not time yet."""
        if self._remaining or self._aborting or self._released:
            return None
        self._released = True
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _release(self, callbacks: list[Callable[[BatchHandle], None]]) -> None:
        self._done.release()
        for callback in callbacks:
            callback(self)

    def is_pending(self, index: int) -> bool:
        return self.results[index].status is Status.PENDING

    def expire(self, cause: str = "") -> int:
        """Time out every request still pending; returns how many were.

        The transports abort the batch's in-flight work BEFORE the waiter is released: once
        ``wait`` returns TIMEOUT the caller may reuse its buffers, so no NIC or socket may
        still be writing into them."""
        # The monitor thread and a waiter can both get here at the deadline: the second one
        # waits for the first abort to be over, then finds nothing left to do.
        with self._expire_lock:
            with self._lock:
                if not self._remaining:
                    return 0
                self._aborting = True
            expired = 0
            try:
                if self._on_expire is not None:
                    self._on_expire(self)
            finally:
                for index in range(self.size):
                    if self.results[index].status is Status.PENDING:
                        reason = cause or "deadline passed before the request completed"
                        expired += self.finish(index, Status.TIMEOUT, error=reason)
                with self._lock:
                    self._aborting = False
                    callbacks = self._claim_release()
                if callbacks is not None:
                    self._release(callbacks)
            return expired

    # -- caller side -------------------------------------------------------------------
    def done(self) -> bool:
        if not self._released and self._pumps:
            self._kick()
        return self._released

    def settled(self) -> bool:
        """``done`` without side effects, for the engine's own threads."""
        return self._released

    def _kick(self) -> None:
        """Nobody is going to pump: let the transports' own threads read the answers now."""
        for pump in self._pumps or ():
            pump.kick()

    @property
    def ok(self) -> bool:
        return self.settled() and all(r.status is Status.COMPLETED for r in self.results)

    def wait(self, timeout_s: float | None = None) -> list[RequestResult]:
        """Block until every request has finished or the batch deadline passed (then they time out).

        ``timeout_s`` only bounds this call: when it runs out first, the requests keep going
        and the results returned may still contain ``pending`` entries.
        """
        if not self._released and self._pumps:
            for pump in self._pumps:
                if timeout_s is None:
                    # read our own answers instead of waiting for a transport thread to hand them
                    # over; a pump returns at the latest when the deadline monitor shuts its connection
                    pump.pump(self)
                else:
                    pump.kick()
        if not self._released:
            limit = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
            if self._done.acquire(timeout=max(0.0, limit - time.monotonic())):
                self._done.release()  # let every other waiter through too
        if not self._released and time.monotonic() >= self.deadline:
            self.expire()
        return self.results

    def add_pump(self, pump: Pump) -> None:
        """Let ``wait`` drive a transport's receive path for this batch in the caller's thread."""
        if self._pumps is None:
            self._pumps = [pump]
        elif pump not in self._pumps:
            self._pumps.append(pump)

    def add_done_callback(self, callback: Callable[[BatchHandle], None]) -> None:
        """Call ``callback(handle)`` once every request has finished (at once if already done)."""
        with self._lock:
            if not self._released:
                self._callbacks.append(callback)
                pending = True
            else:
                pending = False
        if pending:
            self._kick()
        else:
            callback(self)

    async def wait_async(self) -> list[RequestResult]:
        """The asyncio form of ``wait``; the deadline still applies."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def wake(_: BatchHandle) -> None:
            loop.call_soon_threadsafe(_settle, future)

        self.add_done_callback(wake)
        try:
            await asyncio.wait_for(asyncio.shield(future), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            # aborting touches sockets and queue pairs, and may wait for the monitor's abort
            await asyncio.to_thread(self.expire)
        return self.results

    def __await__(self) -> Generator[Any, None, list[RequestResult]]:
        return self.wait_async().__await__()

    def raise_for_status(self) -> None:
        """Raise ``TransferError`` listing the requests that did not complete."""
        bad = [(i, r) for i, r in enumerate(self.results) if r.status is not Status.COMPLETED]
        if bad:
            head = "; ".join(f"#{i} {r.status.value} via {r.transport or '-'}: {r.error}" for i, r in bad[:5])
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise TransferError(f"{len(bad)} of {self.size} requests did not complete: {head}{more}")


def summarize(results: Sequence[RequestResult]) -> dict[str, int]:
    """Count results by status, for logs."""
    counts: dict[str, int] = {}
    for result in results:
        counts[result.status.value] = counts.get(result.status.value, 0) + 1
    return counts


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
