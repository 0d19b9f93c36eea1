"""A router no client can starve or read others' cache through: real router and sim-engine processes on loopback.

Covers the router half of issue 22's finding 5: clients that hang up or never read free their decode slots
(cancellation, deadline), per-client limits answer 429, ``max_tokens`` is bounded by the context, bearer-token
auth, no pod addresses in response headers, and no cross-client cache oracle (``cache_salt``, per-credential
salts, cache statistics only when asked for).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from daybreak.serving.openai import parse_sse
from daybreak.serving.router.auth import credential_salt
from daybreak.serving.sim.server import output_text
from daybreak.testing.serving_stack import HOST, Proc, Stack, metric_sum
from daybreak.testing.store_agent import free_port

BLOCK_TOKENS = 16
CONTEXT = 4096
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef"
COMPUTED = 'daybreak_engine_prompt_tokens_by_source_total{model_name="sim",source="computed"}'
RUNNING = "vllm:num_requests_running"


@dataclass
class Routers:
    """Routers started over one stack's engines, each with its own flags; all stopped at the end."""

    stack: Stack
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, *flags: str, pool_lookup: bool = True) -> Proc:
        s = self.stack
        port = free_port()
        args = ["router", "--host", HOST, "--port", str(port), "--kv-layout", s.layout_json, "--log-level",
                "warning", "--decode-endpoints", ",".join(p.address for p in s.decode),
                "--prefill-endpoints", ",".join(p.address for p in s.prefill), *flags]
        if pool_lookup and s.agents:
            args += ["--pool-endpoints", s.pool_endpoints, "--token-file", str(s.token_file),
                     "--kv-namespace", s.kv_namespace]
        proc = Proc(name, args, s.directory / f"{name}.log", port)
        self.started.append(proc)
        return proc.start()

    def close(self) -> None:
        for proc in self.started:
            proc.stop(timeout_seconds=10)


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """An agent, a prefill and a decode engine sharing the pool; the context is CONTEXT tokens."""
    stack = Stack(tmp_path_factory.mktemp("pooled") / "stack", block_tokens=BLOCK_TOKENS, block_bytes=4096,
                  engine_flags=["--max-model-len", str(CONTEXT)])
    routers = Routers(stack)
    try:
        stack.add_agents(1, dram="64Mi")
        stack.engine("prefill")
        stack.engine("decode")
        yield routers
    finally:
        routers.close()
        stack.close()


@pytest.fixture(scope="module")
def scarce(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """Prefill and a decode engine of 16 slots, no pool; slowed down so held streams cost little CPU."""
    stack = Stack(tmp_path_factory.mktemp("scarce") / "stack", block_tokens=BLOCK_TOKENS, time_scale=4.0)
    routers = Routers(stack)
    try:
        stack.engine("prefill", pool=False)
        stack.engine("decode", pool=False, extra=["--max-batch", "16"])
        yield routers
    finally:
        routers.close()
        stack.close()


def connect(address: str, *, source: str | None = None, timeout: float = 60) -> http.client.HTTPConnection:
    host, port = address.split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout,
                                      source_address=(source, 0) if source else None)


def post(address: str, body: dict[str, Any], *, path: str = "/v1/completions", token: str | None = None,
         source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = connect(address, source=source)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get(address: str, path: str, *, token: str | None = None) -> int:
    conn = connect(address, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        return conn.getresponse().status
    finally:
        conn.close()


def events(raw: bytes) -> list[dict[str, Any]]:
    return list(parse_sse(raw))  # the SSE parser clients use (serving/openai.py)


def wait_for(what: str, probe: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def open_stream(address: str, body: dict[str, Any], *, source: str | None = None) -> http.client.HTTPConnection:
    """Send a streamed request and return the connection with its response headers read, body unread."""
    conn = connect(address, source=source)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn


def hang_up(router: Proc, body: dict[str, Any]) -> None:
    """Send a non-streamed request and close the connection before any answer: the client is gone."""
    payload = json.dumps(body).encode()
    seen = metric_sum(router.metrics(), "daybreak_router_requests_total")
    with socket.create_connection((HOST, router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        # Hang up only once the router is serving it (a connection closed before that is no request).
        wait_for("the router to take the request", lambda: metric_sum(
            router.metrics(), "daybreak_router_requests_total") > seen)


def running(engine: Proc) -> float:
    return metric_sum(engine.metrics(), RUNNING)


# -- starvation -------------------------------------------------------------------------------------------------


def test_sixteen_clients_that_hang_up_free_every_decode_slot_for_a_seventeenth(scarce: Routers) -> None:
    """8 streams read one chunk and drop, 8 plain requests hang up unanswered: the router cancels its
    upstream steps, the engine drops all 16 sequences, and the next client is served."""
    router = scarce.start("router-cancel")
    decode = scarce.stack.decode[0]
    long = {"max_tokens": 100000}
    streams = [open_stream(router.address, {"prompt": f"abandoned stream {i} " * 4, **long}) for i in range(8)]
    for conn in streams:
        r = conn.getresponse()
        assert r.status == 200
        assert r.readline().startswith(b"data:")  # one chunk, then the client is gone
        conn.close()
    for i in range(8):
        hang_up(router, {"prompt": f"abandoned plain {i} " * 4, **long})
    wait_for("the router to notice all 16 clients gone", lambda: metric_sum(
        router.metrics(), 'daybreak_router_request_failures_total{reason="client_gone"}') == 16)
    wait_for("the decode engine to drop every abandoned sequence", lambda: running(decode) == 0)
    status, _, raw = post(router.address, {"prompt": "the seventeenth client", "max_tokens": 4})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == output_text(4)


def test_streams_nobody_reads_end_at_the_request_deadline_and_free_their_slots(scarce: Routers) -> None:
    router = scarce.start("router-deadline", "--request-timeout-seconds", "3")
    decode = scarce.stack.decode[0]
    held = [open_stream(router.address, {"prompt": f"never read {i} " * 4, "max_tokens": 100000})
            for i in range(16)]
    try:
        wait_for("the 16 unread streams to hold every slot", lambda: running(decode) >= 16)
        wait_for("the deadline to end them",
                 lambda: metric_sum(router.metrics(),
                                    'daybreak_router_request_failures_total{reason="request_timeout"}') >= 16)
        wait_for("the decode engine to free their slots", lambda: running(decode) == 0)
        status, _, raw = post(router.address, {"prompt": "the seventeenth client", "max_tokens": 4})
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == output_text(4)
        # The unread stream, read at last: its tokens, then an error event saying the deadline ended it.
        r = held[0].getresponse()
        assert r.status == 200
        chunks = events(r.read())
        assert chunks and "deadline" in chunks[-1]["error"]["message"]
    finally:
        for conn in held:
            conn.close()


def test_a_client_over_its_concurrency_limit_gets_429_while_another_client_is_served(scarce: Routers) -> None:
    router = scarce.start("router-limit", "--max-concurrent-per-client", "2")
    held = [open_stream(router.address, {"prompt": f"held {i}", "max_tokens": 100000}) for i in range(2)]
    try:
        for conn in held:
            assert conn.getresponse().status == 200  # both admitted and streaming
        status, headers, raw = post(router.address, {"prompt": "a third from the same client", "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1"
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"
        # Another client (another address) is served meanwhile.
        status, _, raw = post(router.address, {"prompt": "another client", "max_tokens": 2}, source="127.0.0.2")
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == output_text(2)
    finally:
        for conn in held:
            conn.close()
    # Once its streams end, the first client is admitted again.
    wait_for("the held streams to be released", lambda: post(
        router.address, {"prompt": "the first client again", "max_tokens": 2})[0] == 200)


# -- bounds on a request ----------------------------------------------------------------------------------------


def test_max_tokens_beyond_the_context_is_refused_with_the_bound(pooled: Routers) -> None:
    """The router learns the context length from the engines' /v1/models and refuses (never caps) an
    output that cannot fit beside the prompt, naming the field and the most it could ask for."""
    router = pooled.start("router-cap")
    prefill = pooled.stack.prefill[0]
    seen = metric_sum(prefill.metrics(), "vllm:request_success_total")
    prompt = list(range(100))
    status, _, raw = post(router.address, {"prompt": prompt, "max_tokens": 1 << 20})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "max_tokens" and str(CONTEXT - 100) in error["message"]
    assert str(CONTEXT) in error["message"]
    status, _, raw = post(router.address, {"prompt": prompt, "max_tokens": CONTEXT - 99, "stream": True})
    assert status == 400 and b"max_tokens" in raw
    status, _, raw = post(router.address, {"prompt": [1] * CONTEXT, "max_tokens": 1})
    assert status == 400 and b"context" in raw
    assert metric_sum(prefill.metrics(), "vllm:request_success_total") == seen  # refused at the router
    status, _, raw = post(router.address, {"prompt": prompt, "max_tokens": 3})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    # An engine reached directly refuses the same way (the router is not the only guard).
    status, _, raw = post(prefill.address, {"prompt": prompt, "max_tokens": CONTEXT})
    assert status == 400 and b"max_tokens" in raw and str(CONTEXT - 100).encode() in raw


# -- what replies tell ------------------------------------------------------------------------------------------


def test_replies_name_no_internal_address_and_carry_no_cache_statistics_by_default(pooled: Routers) -> None:
    router = pooled.start("router-private")
    internal = [p.address for p in (*pooled.stack.prefill, *pooled.stack.decode)]
    internal += [a.address for a in pooled.stack.agents]
    body = {"prompt": "what headers say " * 8, "max_tokens": 3}
    replies = [post(router.address, body) for _ in range(2)]  # the second finds the prompt cached
    streamed = post(router.address, {**body, "stream": True, "stream_options": {"include_usage": True}})
    for status, headers, raw in [*replies, streamed]:
        assert status == 200, raw
        assert not [k for k in headers if k.startswith("x-daybreak")], headers
        text = " ".join(f"{k}: {v}" for k, v in headers.items())
        assert not [a for a in internal if a in text], text
    for _, _, raw in replies:
        usage = json.loads(raw)["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 3
        assert "prompt_tokens_details" not in usage and "daybreak" not in usage, usage
    finals = [c for c in events(streamed[2]) if not c.get("choices")]
    assert len(finals) == 1 and set(finals[0]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_clients_with_different_cache_salts_share_no_cached_blocks(pooled: Routers) -> None:
    router = pooled.start("router-salt", "--cache-statistics")
    prefill = pooled.stack.prefill[0]
    prompt = list(range(1000, 1000 + BLOCK_TOKENS * 10))  # ten full blocks, no partial one
    first = post(router.address, {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    again = post(router.address, {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert first[0] == again[0] == 200
    assert json.loads(again[2])["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    computed = metric_sum(prefill.metrics(), COMPUTED)
    other = post(router.address, {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"})
    assert other[0] == 200, other[2]
    usage = json.loads(other[2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # The engine missed too: it computed the whole prompt again (neither its own cache nor the pool matched).
    assert metric_sum(prefill.metrics(), COMPUTED) - computed == len(prompt)
    status, _, raw = post(router.address, {"prompt": prompt, "max_tokens": 1, "cache_salt": ""})
    assert status == 400 and json.loads(raw)["error"]["param"] == "cache_salt"


# -- authentication ---------------------------------------------------------------------------------------------


def test_with_auth_on_only_a_known_token_is_served_and_each_credential_has_its_own_cache(
        pooled: Routers, tmp_path: Path) -> None:
    secret = tmp_path / "router-auth"
    secret.mkdir()
    (secret / "alice").write_text(ALICE + "\n")
    (secret / "bob").write_text(BOB)
    (secret / "..data").mkdir()  # the kubelet's bookkeeping in a mounted Secret: not a credential
    router = pooled.start("router-auth", "--auth-dir", str(secret), "--cache-statistics")
    body = {"prompt": list(range(5000, 5000 + BLOCK_TOKENS * 6)), "max_tokens": 2}
    for token in (None, "not-a-token-at-all-0000", ALICE[:-1], "Basic " + ALICE):
        status, headers, raw = post(router.address, body, token=token)
        assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (token, raw)
    assert get(router.address, "/v1/models") == 401
    assert get(router.address, "/v1/models", token=BOB) == 200
    assert get(router.address, "/health") == 200  # probes need no token
    status, _, raw = post(router.address, body, token=ALICE)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == output_text(2)
    status, _, raw = post(router.address, body, token=ALICE)
    assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # alice's own cache
    status, _, raw = post(router.address, body, token=BOB)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A client cannot reach another credential's cache by sending its salt: salts nest under the credential.
    status, _, raw = post(router.address, {**body, "cache_salt": credential_salt("alice", None)}, token=BOB)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A revoked token stops working without a restart (the directory is re-read).
    (secret / "bob").unlink()
    wait_for("bob's token to be revoked", lambda: post(router.address, body, token=BOB)[0] == 401, timeout=30)
    assert post(router.address, body, token=ALICE)[0] == 200


def test_a_router_without_a_usable_credential_refuses_to_start(tmp_path: Path) -> None:
    empty = tmp_path / "auth"
    empty.mkdir()
    (empty / "short").write_text("too-short")
    proc = Proc("router-noauth", ["router", "--host", HOST, "--port", str(free_port()), "--decode-endpoints",
                                  "127.0.0.1:9", "--auth-dir", str(empty)], tmp_path / "router.log", 0)
    with pytest.raises(RuntimeError, match="holds no credential"):
        proc.start(timeout_seconds=30)


def test_one_client_holding_many_streams_is_still_one_client_per_credential(pooled: Routers, tmp_path: Path) -> None:
    """Under auth the limit counts per credential, whatever address the requests come from."""
    secret = tmp_path / "router-auth"
    secret.mkdir()
    (secret / "alice").write_text(ALICE)
    (secret / "bob").write_text(BOB)
    router = pooled.start("router-auth-limit", "--auth-dir", str(secret), "--max-concurrent-per-client", "1")
    stop = threading.Event()
    started = threading.Event()

    def hold() -> None:
        conn = connect(router.address)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "held by alice", "max_tokens": 3000, "stream": True}),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"})
            r = conn.getresponse()
            started.set()
            while not stop.wait(0.05) and r.readline():
                pass
        finally:
            conn.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert started.wait(60)
        status, _, _ = post(router.address, {"prompt": "alice again", "max_tokens": 1}, token=ALICE,
                            source="127.0.0.3")
        assert status == 429
        status, _, _ = post(router.address, {"prompt": "bob", "max_tokens": 1}, token=BOB)
        assert status == 200
    finally:
        stop.set()
        holder.join(timeout=30)
