"""The one watch-with-back-off loop: reopen a Kubernetes watch until told to stop, backing off on failures.

A watch ends two ways: the server closes it at its ``timeout_seconds`` (open
the next one at once) or it fails (apiserver restarting, connection reset,
RBAC not yet bound: wait, doubling up to a ceiling, so a broken apiserver is
not hammered by every agent of a cluster). The agent's pool membership, its
credential minter and its node-label watch all run their watch through
``watch_with_backoff``; what one watch does with its events stays in its
``watch_once``. A watch that delivers events calls ``progress()`` so the
next failure starts again from the shortest wait. Standard library only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
# How long one watch stays open before the server ends it (``timeout_seconds``) and the next one opens.
WATCH_SECONDS = 300


async def watch_with_backoff(watch_once: Callable[[Callable[[], None]], Awaitable[None]], *,
                             on_failure: Callable[[BaseException, float], None],
                             stop: asyncio.Event | None = None,
                             first_seconds: float = FIRST_BACKOFF_SECONDS,
                             max_seconds: float = MAX_BACKOFF_SECONDS) -> None:
    """Run ``watch_once(progress)`` again and again until ``stop`` is set (or, without ``stop``, until cancelled).

    A clean return reopens at once; an exception is handed to ``on_failure(exc, retry_in_seconds)`` (to log it)
    and the next try waits that long, doubling from ``first_seconds`` to ``max_seconds``; ``progress()`` and a
    clean return reset the wait. Setting ``stop`` cancels a running ``watch_once`` and returns.
    """
    backoff = first_seconds

    def progress() -> None:
        nonlocal backoff
        backoff = first_seconds

    while stop is None or not stop.is_set():
        exc: BaseException | None
        if stop is None:
            try:
                await watch_once(progress)
                exc = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of one watch is retried; the caller logs it
                exc = e
        else:
            task = asyncio.ensure_future(watch_once(progress))
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
            stopped.cancel()
            exc = task.exception()
        if exc is None:
            backoff = first_seconds
            continue  # the server closed the watch at its timeout: open the next one
        on_failure(exc, backoff)
        if stop is None:
            await asyncio.sleep(backoff)
        else:
            try:
                await asyncio.wait_for(stop.wait(), timeout=backoff)
            except TimeoutError:
                pass
        backoff = min(backoff * 2, max_seconds)
