"""The router holds requests while no engine is ready (scale from zero), with real sim engines started late.

The router runs in the test's event loop on a loopback port (its discovery fed by a lister the test
controls, as EndpointSlices would be); the engines are real ``daybreak sim-engine`` processes, started
only after the request arrived. The planner reads the held-requests gauge with its own parser.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from daybreak.api.metrics import ROUTER_HELD_REQUESTS as HELD_REQUESTS
from daybreak.operator.engine_metrics import RouterBacklog, parse_router_backlog
from daybreak.serving.router.discovery import RolePods
from daybreak.serving.router.server import HOLD_RETRY_AFTER_SECONDS, Router, RouterConfig
from daybreak.serving.sim.server import output_text
from daybreak.testing.serving_stack import Stack, metric_sum
from daybreak.testing.store_agent import free_port

PROMPT = {"prompt": "a prompt that waits for engines to start. " * 4, "max_tokens": 4}


class Endpoints:
    """What discovery lists for one role: empty until the test says the pods are ready."""

    def __init__(self) -> None:
        self.ready: dict[str, str | None] = {}

    async def __call__(self) -> dict[str, str | None]:
        return dict(self.ready)


async def _serving(config: RouterConfig, body: Callable[[str, Endpoints, Endpoints], Awaitable[None]]) -> None:
    prefill, decode = Endpoints(), Endpoints()
    router = Router(config=config, prefill=RolePods("prefill", lister=prefill, refresh_seconds=0.1),
                    decode=RolePods("decode", lister=decode, refresh_seconds=0.1))
    runner = web.AppRunner(router.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await body(f"http://127.0.0.1:{port}", prefill, decode)
    finally:
        await runner.cleanup()


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as r:
        return await r.text()


async def _backlog(session: aiohttp.ClientSession, url: str) -> RouterBacklog | None:
    return parse_router_backlog(await _metrics(session, url))


async def _held(session: aiohttp.ClientSession, url: str) -> float | None:
    backlog = await _backlog(session, url)
    return None if backlog is None else backlog.held


async def _until(what: str, check: Callable[[], Awaitable[bool]], *, seconds: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None
                ) -> tuple[int, dict[str, str], bytes]:
    async with session.post(f"{url}/v1/completions", json=body or PROMPT) as r:
        return r.status, dict(r.headers), await r.read()


def test_a_request_sent_with_no_engines_is_held_and_answered_once_they_are_ready(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack")

    async def scenario(url: str, prefill: Endpoints, decode: Endpoints) -> None:
        async with aiohttp.ClientSession() as session:
            # A router that can hold reports the gauge at 0 before anything is held: the planner may go to zero.
            assert await _held(session, url) == 0.0
            async with session.get(f"{url}/health") as r:
                assert r.status == 200, "a router at zero engines must stay Ready, or nothing reaches it"
            request = asyncio.create_task(_post(session, url))
            await _until("the request to be held", lambda: _is_held(session, url, 1.0))
            assert not request.done()
            metrics = await _metrics(session, url)
            assert metric_sum(metrics, HELD_REQUESTS + '{role="decode"}') == 1.0
            # The engines start only now (as the planner's pods would), and discovery lists them once up.
            engines = await asyncio.gather(asyncio.to_thread(stack.engine, "prefill", pool=False),
                                           asyncio.to_thread(stack.engine, "decode", pool=False))
            prefill.ready = {engines[0].address: None}
            decode.ready = {engines[1].address: None}
            status, _, raw = await asyncio.wait_for(request, 60)
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == output_text(4)
            assert await _held(session, url) == 0.0
            assert metric_sum(await _metrics(session, url), "daybreak_router_hold_seconds_count") == 1.0

    try:
        asyncio.run(_serving(RouterConfig(hold_queue=4, hold_seconds=120), scenario))
    finally:
        stack.close()


async def _is_held(session: aiohttp.ClientSession, url: str, count: float) -> bool:
    return await _held(session, url) == count


def test_a_full_hold_queue_answers_503_with_retry_after_and_a_gone_client_frees_its_slot() -> None:
    async def scenario(url: str, _prefill: Endpoints, _decode: Endpoints) -> None:
        async with aiohttp.ClientSession() as watcher:
            first = aiohttp.ClientSession()
            held = asyncio.create_task(_post(first, url))
            await _until("the first request to be held", lambda: _is_held(watcher, url, 1.0))
            status, headers, raw = await _post(watcher, url)
            assert status == 503, raw
            assert headers["Retry-After"] == str(HOLD_RETRY_AFTER_SECONDS)
            assert b"--hold-queue" in raw
            # The held client goes away: its slot is free again, and the next request is held, not refused.
            held.cancel()
            await first.close()
            await _until("the slot to be freed", lambda: _is_held(watcher, url, 0.0))
            again = asyncio.create_task(_post(watcher, url))
            await _until("the next request to be held", lambda: _is_held(watcher, url, 1.0))
            again.cancel()

    asyncio.run(_serving(RouterConfig(hold_queue=1, hold_seconds=120), scenario))


def test_a_hold_past_its_deadline_answers_503_with_retry_after() -> None:
    async def scenario(url: str, _prefill: Endpoints, _decode: Endpoints) -> None:
        async with aiohttp.ClientSession() as session:
            status, headers, raw = await _post(session, url)
            assert status == 503, raw
            assert headers["Retry-After"] == str(HOLD_RETRY_AFTER_SECONDS)
            assert b"--hold-seconds" in raw
            metrics = await _metrics(session, url)
            assert metric_sum(metrics, 'daybreak_router_request_failures_total{reason="hold_expired"}') == 1.0
            assert parse_router_backlog(metrics) == RouterBacklog(held=0.0)

    asyncio.run(_serving(RouterConfig(hold_queue=4, hold_seconds=0.5), scenario))


def test_without_holding_there_is_no_gauge_and_no_readiness_at_zero() -> None:
    """``--hold-queue 0``: the old behaviour, and the planner (no gauge) keeps a pod per role."""

    async def scenario(url: str, _prefill: Endpoints, _decode: Endpoints) -> None:
        async with aiohttp.ClientSession() as session:
            assert await _held(session, url) is None
            async with session.get(f"{url}/health") as r:
                assert r.status == 503

    asyncio.run(_serving(RouterConfig(hold_queue=0), scenario))


def test_the_hold_flags_refuse_bad_values_naming_the_flag() -> None:
    for flags, name in ((["--hold-seconds", "0"], "--hold-seconds"), (["--hold-queue", "-1"], "--hold-queue")):
        done = subprocess.run([sys.executable, "-m", "daybreak", "router", "--decode-endpoints", "127.0.0.1:1",
                               *flags], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert name in done.stderr, done.stderr


def test_with_prefill_concurrency_a_request_waits_in_the_router_for_the_first_pod_with_room(tmp_path: Path) -> None:
    """``--prefill-concurrency 1``: two more requests than the one prefill pod takes wait in the router, count
    in the gauge under role prefill, and a prefill pod listed while they wait (one the planner just
    started) takes them; bound at arrival, they would have queued on the first pod."""
    stack = Stack(tmp_path / "stack")
    slow = ["--prefill-per-token-seconds", "0.03"]  # about a second of prefill per prompt: long enough to queue

    async def scenario(url: str, prefill: Endpoints, decode: Endpoints) -> None:
        first, second, dec = await asyncio.gather(
            asyncio.to_thread(stack.engine, "prefill", pool=False, extra=slow),
            asyncio.to_thread(stack.engine, "prefill", pool=False, extra=slow),
            asyncio.to_thread(stack.engine, "decode", pool=False))
        prefill.ready = {first.address: None}
        decode.ready = {dec.address: None}
        async with aiohttp.ClientSession() as session:
            await _until("the router to list the engines", lambda: _health_ok(session, url))
            requests = [asyncio.create_task(_post(session, url)) for _ in range(3)]
            await _until("two requests to wait for prefill room", lambda: _is_held(session, url, 2.0))
            assert metric_sum(await _metrics(session, url), HELD_REQUESTS + '{role="prefill"}') == 2.0
            prefill.ready = {first.address: None, second.address: None}  # the planner's new pod is Ready
            answers = await asyncio.wait_for(asyncio.gather(*requests), 60)
            assert [status for status, _, _ in answers] == [200, 200, 200], answers
            served = [headers["x-daybreak-prefill"] for _, headers, _ in answers]
            assert second.address in served, served
            assert await _held(session, url) == 0.0

    try:
        asyncio.run(_serving(RouterConfig(hold_queue=8, hold_seconds=120, prefill_concurrency=1,
                                          debug_headers=True), scenario))
    finally:
        stack.close()


Send = Callable[[str, int, int], "asyncio.Task[int]"]


def _answer_order(stack: Stack, *, per_token: str, target: float | None,
                  script: Callable[[Send, aiohttp.ClientSession, str], Awaitable[None]]) -> list[str]:
    """The order in which the requests ``script`` sends (``send(name, first token id, prompt tokens)``) are
    answered by a router with ``--prefill-concurrency 1`` (and ``target`` as ``--ttft-target``) in front of one
    prefill pod at ``per_token`` seconds a prompt token and one decode pod. Every request must succeed."""
    done: dict[str, float] = {}

    async def scenario(url: str, prefill: Endpoints, decode: Endpoints) -> None:
        slow = ["--prefill-per-token-seconds", per_token]
        pre, dec = await asyncio.gather(asyncio.to_thread(stack.engine, "prefill", pool=False, extra=slow),
                                        asyncio.to_thread(stack.engine, "decode", pool=False))
        prefill.ready = {pre.address: None}
        decode.ready = {dec.address: None}
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[int]] = []
        async with aiohttp.ClientSession() as session:
            await _until("the router to list the engines", lambda: _health_ok(session, url))

            async def request(name: str, first: int, tokens: int) -> int:
                # Distinct token ids: no prompt is a cache hit of another.
                status, _, _ = await _post(session, url, {"prompt": list(range(first, first + tokens)),
                                                          "max_tokens": 2})
                done[name] = loop.time()
                return status

            def send(name: str, first: int, tokens: int) -> asyncio.Task[int]:
                tasks.append(asyncio.create_task(request(name, first, tokens)))
                return tasks[-1]

            await script(send, session, url)
            assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [200] * len(tasks)

    try:
        asyncio.run(_serving(RouterConfig(hold_queue=8, hold_seconds=120, prefill_concurrency=1,
                                          ttft_target_seconds=target), scenario))
    finally:
        stack.close()
    return sorted(done, key=done.__getitem__)


def test_with_a_ttft_target_a_request_that_can_still_make_it_goes_before_one_that_cannot(tmp_path: Path) -> None:
    """``--prefill-concurrency 1 --ttft-target 4.5``, one prefill pod taking about 2.75 s a prompt: A takes
    the pod, B waits for it from 0.5 s, C arrives at about 2 s. When A ends, B has waited 2.25 s and a prefill
    more takes it past the target wherever it goes; C (0.7 s in) still makes it if it goes now. It does: C is
    answered before B, and B after, not failed. First come, first served gives the slot to B: both miss."""

    async def script(send: Send, session: aiohttp.ClientSession, url: str) -> None:
        send("A", 1000, 100)  # 100-token prompts: 2.75 s of prefill each
        await asyncio.sleep(0.5)  # A takes the pod on arrival
        send("B", 2000, 100)
        await _until("B to wait for prefill room", lambda: _is_held(session, url, 1.0))
        await asyncio.sleep(1.5)
        send("C", 3000, 100)

    assert _answer_order(Stack(tmp_path / "deadline"), per_token="0.0275", target=4.5,
                         script=script) == ["A", "C", "B"]
    assert _answer_order(Stack(tmp_path / "arrival"), per_token="0.0275", target=None,
                         script=script) == ["A", "B", "C"]


def test_with_a_ttft_target_a_long_prompt_that_can_no_longer_make_it_waits_behind_a_short_one(
        tmp_path: Path) -> None:
    """``--ttft-target 5``, one prefill pod at 30 ms a prompt token: A (100 tokens, 3 s) takes the pod, B (130
    tokens, 3.9 s) waits from 1.45 s, C (10 tokens, 0.3 s) from 2.2 s. When A ends B has waited about 1.6 s:
    within the target at the mean step timed so far (A's 3 s), not at its own 3.9 s. C goes first and makes
    it; B is answered after it. (With the mean step B went first and both missed.)"""

    async def script(send: Send, session: aiohttp.ClientSession, url: str) -> None:
        send("A", 1000, 100)
        await asyncio.sleep(1.45)  # A has the pod
        send("B", 2000, 130)
        await asyncio.sleep(0.75)
        send("C", 3000, 10)

    assert _answer_order(Stack(tmp_path / "stack"), per_token="0.03", target=5.0,
                         script=script) == ["A", "C", "B"]


async def _health_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(f"{url}/health") as r:
        body = await r.json()
    return r.status == 200 and "holding" not in str(body.get("status"))


def test_with_decode_prefill_a_request_that_finds_no_prefill_room_is_prefilled_by_decode(tmp_path: Path) -> None:
    """``--prefill-concurrency 1 --decode-prefill 1``: of three requests at once, the one prefill pod takes
    one, decode computes the next one's prompt itself instead of letting it wait, and the third waits for
    whichever frees first; the planner reads both the one waiting and the one on decode as prefill's."""
    stack = Stack(tmp_path / "stack")
    slow = ["--prefill-per-token-seconds", "0.03"]  # about a second per prompt on either role

    async def scenario(url: str, prefill: Endpoints, decode: Endpoints) -> None:
        pre, dec = await asyncio.gather(asyncio.to_thread(stack.engine, "prefill", pool=False, extra=slow),
                                        asyncio.to_thread(stack.engine, "decode", pool=False, extra=slow))
        prefill.ready = {pre.address: None}
        decode.ready = {dec.address: None}
        async with aiohttp.ClientSession() as session:
            await _until("the router to list the engines", lambda: _health_ok(session, url))
            requests = [asyncio.create_task(_post(session, url)) for _ in range(3)]
            await _until("one request on prefill, one prefilled by decode, one waiting",
                         lambda: _backlog_is(session, url, RouterBacklog(held=1.0, decode_prefill=1.0)))
            answers = await asyncio.wait_for(asyncio.gather(*requests), 60)
            assert [status for status, _, _ in answers] == [200, 200, 200], answers
            assert all(json.loads(raw)["choices"][0]["text"] == output_text(4) for _, _, raw in answers)
            routes = sorted(headers["x-daybreak-prefill"] for _, headers, _ in answers)
            assert routes.count("decode") >= 1 and routes.count(pre.address) >= 1, routes
            metrics = await _metrics(session, url)
            assert parse_router_backlog(metrics) == RouterBacklog(held=0.0, decode_prefill=0.0)
            assert metric_sum(metrics, 'daybreak_router_prefill_skipped_total{reason="no_prefill_room"}') == \
                routes.count("decode")

    try:
        asyncio.run(_serving(RouterConfig(hold_queue=8, hold_seconds=120, prefill_concurrency=1, decode_prefill=1,
                                          debug_headers=True), scenario))
    finally:
        stack.close()


async def _backlog_is(session: aiohttp.ClientSession, url: str, want: RouterBacklog) -> bool:
    return await _backlog(session, url) == want


def test_decode_prefill_or_a_ttft_target_without_prefill_concurrency_is_refused_naming_both_flags() -> None:
    for flag in ("--decode-prefill", "--ttft-target"):
        done = subprocess.run([sys.executable, "-m", "daybreak", "router", "--decode-endpoints", "127.0.0.1:1",
                               "--prefill-endpoints", "127.0.0.1:2", flag, "1"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"{flag} needs --prefill-concurrency" in done.stderr, done.stderr
