"""The one watch-with-back-off loop: reopen at once after a clean end, back off (doubling, capped) after failures."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from daybreak.client.kubewatch import watch_with_backoff


def _script(outcomes: list[str], stop: asyncio.Event, calls: list[str]) -> Callable[[Callable[[], None]], Awaitable[None]]:
    """A watch_once that plays ``outcomes`` in order: 'fail', 'ok' (clean end), 'progress-fail'; then sets stop."""
    async def watch_once(progress: Callable[[], None]) -> None:
        if not outcomes:
            stop.set()
            await asyncio.Event().wait()  # a watch still open when stop comes: cancelled by the loop
        outcome = outcomes.pop(0)
        calls.append(outcome)
        if outcome == "progress-fail":
            progress()
            raise ConnectionResetError("reset after some events")
        if outcome == "fail":
            raise ConnectionResetError("apiserver restarting")
    return watch_once


def test_failures_back_off_doubling_to_the_ceiling_and_a_clean_end_resets() -> None:
    waits: list[float] = []
    calls: list[str] = []

    async def run() -> None:
        stop = asyncio.Event()
        await watch_with_backoff(_script(["fail", "fail", "fail", "fail", "ok", "fail"], stop, calls),
                                 on_failure=lambda exc, retry_in: waits.append(retry_in), stop=stop,
                                 first_seconds=0.001, max_seconds=0.004)

    asyncio.run(run())
    assert calls == ["fail", "fail", "fail", "fail", "ok", "fail"]
    assert waits == [0.001, 0.002, 0.004, 0.004, 0.001]


def test_a_watch_that_made_progress_starts_again_from_the_shortest_wait() -> None:
    waits: list[float] = []

    async def run() -> None:
        stop = asyncio.Event()
        await watch_with_backoff(_script(["fail", "fail", "progress-fail", "fail"], stop, []),
                                 on_failure=lambda exc, retry_in: waits.append(retry_in), stop=stop,
                                 first_seconds=0.001, max_seconds=1.0)

    asyncio.run(run())
    assert waits == [0.001, 0.002, 0.001, 0.002]


def test_the_failure_is_handed_over_with_its_cause() -> None:
    seen: list[BaseException] = []

    async def run() -> None:
        stop = asyncio.Event()
        await watch_with_backoff(_script(["fail"], stop, []), on_failure=lambda exc, _: seen.append(exc),
                                 stop=stop, first_seconds=0.001)

    asyncio.run(run())
    assert [str(e) for e in seen] == ["apiserver restarting"]


def test_without_a_stop_event_the_loop_runs_until_cancelled() -> None:
    opened = 0

    async def run() -> None:
        nonlocal opened
        started = asyncio.Event()

        async def watch_once(progress: Callable[[], None]) -> None:
            nonlocal opened
            opened += 1
            if opened == 3:
                started.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(watch_with_backoff(watch_once, on_failure=lambda exc, _: None))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert opened == 3  # two clean ends reopened at once, the third watch was open when cancelled
