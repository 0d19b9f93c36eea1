"""The router as a real process in front of real sim engines and a real store agent, on loopback."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daybreak.serving.openai import parse_sse
from daybreak.serving.prompt import block_keys
from daybreak.serving.router.pool_lookup import PoolLookup
from daybreak.serving.sim.server import output_text
from daybreak.testing.serving_stack import Stack, metric_sum

BLOCK_TOKENS = 16


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "stack", block_tokens=BLOCK_TOKENS, block_bytes=4096)
    try:
        s.add_agents(1, dram="64Mi")
        yield s
    finally:
        s.close()


def post(address: str, body: dict[str, Any], *, path: str = "/v1/completions"
         ) -> tuple[int, dict[str, str], bytes]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def events(raw: bytes) -> list[dict[str, Any]]:
    return list(parse_sse(raw))  # the SSE parser clients use (serving/openai.py)


def stream_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c.get("choices"))


def requests_served(proc_metrics: str) -> float:
    return metric_sum(proc_metrics, "vllm:request_success_total")


def test_streamed_and_plain_requests_go_through_prefill_then_decode(stack: Stack) -> None:
    prefill, decode = stack.engine("prefill"), stack.engine("decode")
    router = stack.start_router()
    prompt = "a shared system prompt. " * 10  # 240 bytes: 15 full blocks
    status, headers, raw = post(router.address, {"prompt": prompt + "first", "max_tokens": 5})
    assert status == 200, raw
    reply = json.loads(raw)
    assert reply["choices"][0]["text"] == output_text(5)
    assert headers["x-daybreak-prefill"] == prefill.address and headers["x-daybreak-decode"] == decode.address
    usage = reply["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] == 245
    # Nothing was cached yet: prefill computed the prompt and wrote its 15 blocks, decode read them back.
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["daybreak"]["bytes_written"] == 15 * 4096 and usage["daybreak"]["blocks_corrupt"] == 0
    assert usage["daybreak"]["blocks_checked"] >= 15

    # A streamed chat request, usage asked for: tokens relayed, one final usage chunk.
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, raw = post(router.address, body, path="/v1/chat/completions")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert raw.rstrip().endswith(b"data: [DONE]")
    chunks = events(raw)
    assert stream_text(chunks) == output_text(7)
    finals = [c for c in chunks if not c.get("choices")]
    assert len(finals) == 1 and finals[0]["usage"]["completion_tokens"] == 7
    # Streamed without usage asked for: no usage chunk reaches the client.
    body["stream_options"] = {}
    raw = post(router.address, body, path="/v1/chat/completions")[2]
    assert all(c.get("choices") for c in events(raw)) and stream_text(events(raw)) == output_text(7)

    # Bad input is the client's 400, naming the field; the router keeps serving.
    status, _, raw = post(router.address, {"prompt": {"not": "a prompt"}})
    assert status == 400 and b"prompt" in raw
    status, _, raw = post(router.address, {"prompt": "x", "max_tokens": -3})
    assert status == 400 and b"max_tokens" in raw  # the engine's 400, relayed
    metrics = router.metrics()
    assert metric_sum(metrics, "daybreak_router_requests_total") == 5
    assert metric_sum(metrics, 'daybreak_router_step_seconds_count{role="decode"}') >= 3


def test_prefill_is_skipped_when_the_pool_holds_the_whole_prompt(stack: Stack) -> None:
    prefill = stack.engine("prefill")
    stack.engine("decode")
    router = stack.start_router()
    body = {"prompt": list(range(BLOCK_TOKENS * 8 + 3)), "max_tokens": 2}
    first = post(router.address, body)
    assert first[0] == 200 and first[1]["x-daybreak-prefill"] == prefill.address
    served = requests_served(prefill.metrics())
    second = post(router.address, body)
    assert second[0] == 200 and second[1]["x-daybreak-prefill"] == "skipped"
    assert requests_served(prefill.metrics()) == served  # the prefill engine never saw it
    usage = json.loads(second[2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == BLOCK_TOKENS * 8  # all but the partial tail
    assert metric_sum(router.metrics(), "daybreak_router_prefill_skipped_total") == 1


def test_prefill_pod_holding_the_prefix_locally_is_preferred_when_the_pool_lacks_it(stack: Stack) -> None:
    # No pool lookups at the router (as with an unreachable pool): only engine-local prefixes can tell.
    prefills = [stack.engine("prefill", pool=False), stack.engine("prefill", pool=False)]
    stack.engine("decode", pool=False)
    router = stack.start_router(pool_lookup=False)
    prompt = list(range(BLOCK_TOKENS * 40))
    first = post(router.address, {"prompt": prompt, "max_tokens": 1})[1]["x-daybreak-prefill"]
    assert first in {p.address for p in prefills}
    for i in range(4):
        got = post(router.address, {"prompt": [*prompt, 7, i], "max_tokens": 1})[1]["x-daybreak-prefill"]
        assert got == first


def _killing_stream(address: str, body: dict[str, Any], kill: Any) -> tuple[str, str]:
    """Stream ``body``; after 5 tokens call ``kill(decode_address)``; return (text, decode address)."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    pod = r.getheader("x-daybreak-decode") or ""
    raw, tokens, killed = b"", 0, False
    while True:
        line = r.readline()  # de-chunked
        if not line:
            break
        raw += line
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data:") and b'"text":"' in line and b'"text":""' not in line:
            tokens += 1
            if tokens == 5 and not killed:
                kill(pod)
                killed = True
    conn.close()
    assert killed and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    return stream_text(events(raw)), pod


def test_a_decode_engine_killed_mid_stream_is_resumed_on_another_pod(stack: Stack) -> None:
    stack.engine("prefill")
    decodes = [stack.engine("decode"), stack.engine("decode")]
    router = stack.start_router()
    by_address = {d.address: d for d in decodes}
    text, pod = _killing_stream(router.address, {"prompt": "resume me " * 20, "max_tokens": 60, "stream": True},
                                lambda address: by_address[address].kill())
    assert text == output_text(60)  # every token once, in order
    assert metric_sum(router.metrics(), 'daybreak_router_retries_total{role="decode"}') >= 1
    # The survivor serves what comes next.
    status, headers, _ = post(router.address, {"prompt": "after", "max_tokens": 3})
    assert status == 200 and headers["x-daybreak-decode"] != pod


def test_a_killed_prefill_engine_fails_no_request_under_load(stack: Stack, tmp_path: Path) -> None:
    prefills = [stack.engine("prefill"), stack.engine("prefill")]
    stack.engine("decode")
    router = stack.start_router()
    out = tmp_path / "summary.json"
    load = subprocess.Popen([sys.executable, "-m", "daybreak", "load", "--url", f"http://{router.address}",
                             "--sessions", "6", "--turns", "4", "--rate", "12", "--system-tokens", "600",
                             "--user-tokens", "100", "--output-tokens", "8", "--duration", "60", "--json",
                             str(out), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")
    timer = threading.Timer(0.8, prefills[0].kill)
    timer.start()
    try:
        _, err = load.communicate(timeout=120)
    finally:
        timer.cancel()
    summary = json.loads(out.read_text())
    assert summary["requests"] == 24 and summary["failed_requests"] == 0, (summary, err)


def write_trace(path: Path) -> None:
    # Six requests over three conversations: each shares its earlier blocks (Mooncake-style hash ids).
    rows = [(0, [1, 2, 3], 1400), (50, [10, 11], 1000), (100, [1, 2, 3, 4], 1900), (150, [20], 400),
            (200, [10, 11, 12], 1500), (250, [1, 2, 3, 4, 5], 2400)]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": h}) + "\n"
                            for t, h, n in rows))


def run_load(address: str, *args: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "daybreak", "load", "--url", f"http://{address}", *args,
                           "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_a_restarted_router_keeps_the_hit_rate(stack: Stack, tmp_path: Path) -> None:
    prefill = stack.engine("prefill")
    stack.engine("decode")
    router = stack.start_router()
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    first = run_load(router.address, "--trace", str(trace), out=tmp_path / "first.json")
    assert first["failed_requests"] == 0 and 0 < first["hit_rate"] < 1
    router.kill()  # SIGKILL: nothing handed over, nothing saved
    router = stack.start_router()
    served = requests_served(prefill.metrics())
    second = run_load(router.address, "--trace", str(trace), out=tmp_path / "second.json")
    # Every full block is in the pool: the new router skips every prefill and the hit rate is the most
    # the prompts allow: all but each prompt's partial last block (and its last token, which an engine
    # always computes for its logits).
    lengths = [1400, 1000, 1900, 400, 1500, 2400]
    best = sum(min(n // BLOCK_TOKENS * BLOCK_TOKENS, n - 1) for n in lengths) / sum(lengths)
    assert second["failed_requests"] == 0
    assert second["hit_rate"] == pytest.approx(best)
    assert requests_served(prefill.metrics()) == served
    assert metric_sum(router.metrics(), "daybreak_router_prefill_skipped_total") == 6


def test_load_summary_hit_rate_agrees_with_the_engines_metrics(stack: Stack, tmp_path: Path) -> None:
    engines = [stack.engine("prefill"), stack.engine("decode"), stack.engine("decode")]
    router = stack.start_router()
    summary = run_load(router.address, "--sessions", "4", "--turns", "3", "--rate", "20", "--system-tokens",
                       "800", "--user-tokens", "64", "--output-tokens", "6", out=tmp_path / "s.json")
    assert summary["requests"] == 12 and summary["failed_requests"] == 0
    texts = [e.metrics() for e in engines]
    computed = sum(metric_sum(t, 'daybreak_engine_prompt_tokens_by_source_total{model_name="sim",'
                                 'source="computed"}') for t in texts)
    prompt = sum(metric_sum(t, "vllm:prompt_tokens_total") for t in texts[1:])  # each request: one decode
    assert prompt == summary["prompt_tokens"]
    # The engines count every computed token, decode's recomputed partial tail too; the usage the router
    # reports counts a token computed by both steps once, so the two differ by at most that tail (under a
    # block) per request.
    engines_rate = 1 - computed / prompt
    assert engines_rate <= summary["hit_rate"] <= engines_rate + summary["requests"] * BLOCK_TOKENS / prompt
    # Turns after the first reuse the shared system prompt and their history.
    assert summary["hit_rate"] > 0.5
    written = sum(metric_sum(t, 'daybreak_engine_kv_bytes_total{direction="written",model_name="sim"}')
                  for t in texts)
    assert summary["bytes_written"] == written > 0
    assert summary["ttft_p50_s"] > 0 and summary["itl_p50_s"] > 0


def _hold_stream(address: str, stop: threading.Event) -> None:
    """Keep one long streamed request in flight on ``address`` (read slowly) until ``stop``."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": "hold " * 8, "max_tokens": 100000, "stream": True}))
        r = conn.getresponse()
        while not stop.wait(0.05) and r.readline():
            pass
    except OSError:
        pass
    finally:
        conn.close()


def test_a_draining_engine_answering_503_fails_no_request(stack: Stack) -> None:
    """An engine that is draining refuses new requests with 503: the router retries them on another pod."""
    stack.engine("prefill")
    draining, good = stack.engine("decode"), stack.engine("decode")
    stop = threading.Event()
    # One stream keeps the draining engine in its drain; two on the good one make the draining engine
    # look cheaper, so the router picks it first and must retry every request past its 503.
    holders = [threading.Thread(target=_hold_stream, args=(a, stop), daemon=True)
               for a in (draining.address, good.address, good.address)]
    for t in holders:
        t.start()
    router = stack.start_router()
    try:
        wait_until = time.monotonic() + 30
        while metric_sum(draining.metrics(), "vllm:num_requests_running") < 1 or \
                metric_sum(good.metrics(), "vllm:num_requests_running") < 2:
            assert time.monotonic() < wait_until, "held streams never started"
            time.sleep(0.1)
        assert draining.proc is not None
        draining.proc.send_signal(signal.SIGTERM)
        status, _, _ = post(draining.address, {"prompt": "direct", "max_tokens": 2})
        assert status == 503  # the engine really is refusing while it drains
        time.sleep(1.0)  # the router's scrape sees the loads
        results = [post(router.address, {"prompt": f"request {i} " * 10, "max_tokens": 4, "stream": i % 2 == 1})
                   for i in range(8)]
        assert [s for s, _, _ in results] == [200] * 8, [b[:200] for _, _, b in results]
        assert {h["x-daybreak-decode"] for _, h, _ in results} == {good.address}
        assert metric_sum(router.metrics(), 'daybreak_router_retries_total{role="decode"}') >= 1
        assert metric_sum(router.metrics(), "daybreak_router_request_failures_total") == 0
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=10)


def test_pool_lookups_ask_the_kv_namespace_of_each_request(stack: Stack) -> None:
    """One router, two kvNamespaces (an upgrade): each lookup sees only what its namespace holds."""
    stack.engine("prefill")
    stack.engine("decode")
    router = stack.start_router()
    tokens = list(range(BLOCK_TOKENS * 4 + 1))
    status, _, _ = post(router.address, {"prompt": tokens, "max_tokens": 1})
    assert status == 200  # prefill wrote the blocks under the engines' namespace
    keys = block_keys(tokens, BLOCK_TOKENS)
    addresses = [a.address for a in stack.agents]

    async def endpoints() -> list[str]:
        return addresses

    async def lookups() -> tuple[int | None, int | None, int | None]:
        pool = PoolLookup(endpoints=endpoints, token=stack.token_file.read_text().strip(), namespace="other")
        try:
            return (await pool.prefix(keys, namespace=stack.kv_namespace),
                    await pool.prefix(keys, namespace="a-new-revision"), await pool.prefix(keys))
        finally:
            await pool.close()

    assert asyncio.run(lookups()) == (4, 0, 0)


def test_a_draining_router_serves_what_still_reaches_it_and_closes_those_connections(stack: Stack) -> None:
    """SIGTERM: /health turns 503 (readiness off) but a request that still arrives, here on a kept-alive
    connection, is served and answered with ``Connection: close``; the router exits once quiet."""
    stack.engine("prefill"), stack.engine("decode")
    router = stack.start_router(extra=["--drain-quiet-seconds", "3"])
    host, port = router.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = json.dumps({"prompt": "kept alive " * 8, "max_tokens": 2})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        first = conn.getresponse()
        assert first.status == 200 and (first.getheader("connection") or "").lower() != "close"
        first.read()
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while post_status(router.address, "/health") != 503:
            assert time.monotonic() < deadline, "the router never reported draining"
            time.sleep(0.1)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        late = conn.getresponse()
        assert late.status == 200, late.read()
        assert (late.getheader("connection") or "").lower() == "close"
        assert json.loads(late.read())["choices"][0]["text"] == output_text(2)
        assert metric_sum(router.metrics(), "daybreak_router_drained_requests_total") == 1
    finally:
        conn.close()
    assert router.proc.wait(timeout=30) == 0


def post_status(address: str, path: str) -> int:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return -1
    finally:
        conn.close()
