"""A de-duplicating, rate-limited work queue of object keys (the controller-runtime workqueue, in asyncio).

Watch events, the periodic re-sync and child changes all just ``add`` a key;
workers ``get`` keys. A key is queued at most once, and NEVER handed to two
workers at the same time: a key added while it is being processed is queued
again when that worker calls ``done``. Failures re-queue with per-key
exponential back-off, so an unreachable apiserver is not hammered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from typing import Generic, TypeVar

from daybreak.operator import metrics

K = TypeVar("K")


class WorkQueue(Generic[K]):
    """Keys to reconcile; FIFO, de-duplicated, one worker per key at a time."""

    def __init__(self, *, base_delay: float = 0.5, max_delay: float = 60.0) -> None:
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._failures: dict[K, int] = {}
        self._delayed: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._shut = False

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, key: K) -> None:
        """Queue ``key`` unless it is queued already."""
        if self._shut or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._wakeup.set()
        metrics.QUEUE_DEPTH.set(len(self._queue))

    def add_after(self, key: K, delay: float) -> None:
        """Queue ``key`` after ``delay`` seconds (an earlier ``add`` still wins)."""
        if delay <= 0:
            self.add(key)
            return
        heapq.heappush(self._delayed, (time.monotonic() + delay, next(self._seq), key))
        self._arm()

    def add_rate_limited(self, key: K) -> float:
        """Queue ``key`` after its back-off (doubling per consecutive failure); returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self.max_delay, self.base_delay * (2 ** failures))
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset ``key``'s back-off after a success."""
        self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    async def get(self) -> K:
        """The next key; the caller owns it until ``done(key)``."""
        while not self._queue:
            if self._shut:
                raise asyncio.CancelledError("work queue shut down")
            self._wakeup.clear()
            await self._wakeup.wait()
        key = self._queue.popleft()
        self._dirty.discard(key)
        self._processing.add(key)
        metrics.QUEUE_DEPTH.set(len(self._queue))
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:  # re-added while in flight: run it once more
            self._queue.append(key)
            self._wakeup.set()

    def shutdown(self) -> None:
        self._shut = True
        if self._timer is not None:
            self._timer.cancel()
        self._wakeup.set()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._delayed:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, self._delayed[0][0] - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            self.add(key)
        self._arm()
