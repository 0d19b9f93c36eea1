"""Real ``daybreak sim-engine`` processes against a real standalone store agent: HTTP, KV bytes, metrics, drain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daybreak.client import KVPoolClient
from daybreak.devenv.cluster import LocalCluster
from daybreak.serving.openai import parse_sse
from daybreak.serving.prompt import block_content, block_keys, check_block, tokenize

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 4096
BLOCK_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output is collected; ``start`` waits for its ``event=ready`` line."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str]) -> None:
        self.cmd = list(cmd)
        self.env = env
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 90.0) -> Proc:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, cwd="/")
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if "event=ready" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.cmd[3]} did not become ready:\n{''.join(self.lines[-30:])}")
        return self

    def terminate(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def clean_env(shm_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAYBREAK_") and k != "POD_IP"}
    return {**env, "DAYBREAK_SHM_DIR": str(shm_dir), "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}


class Pool:
    def __init__(self, address: str, token_file: Path, shm_dir: Path) -> None:
        self.address = address
        self.token_file = token_file
        self.shm_dir = shm_dir

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    # A private shared-memory directory: the agent's segments and the engines' probes meet there,
    # and removing it leaves /dev/shm as it was.
    shm_dir = Path("/dev/shm") / f"daybreak-test-sim-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    token_file = tmp_path_factory.mktemp("simpool") / "token"
    address = f"127.0.0.1:{free_port()}"
    agent = Proc([sys.executable, "-m", "daybreak", "agent", "--standalone", "--listen", address, "--dram", "256Mi",
                  "--token-file", str(token_file), "--pool", f"sim{uuid.uuid4().hex[:6]}"], env=clean_env(shm_dir))
    try:
        agent.start()
        yield Pool(address, token_file, shm_dir)
    finally:
        agent.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


class Engine:
    def __init__(self, proc: Proc, port: int, namespace: str) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.namespace = namespace

    def post(self, path: str, body: object, timeout: float = 60.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def complete(self, prompt: str, **extra: object) -> dict[str, object]:
        r = self.post("/v1/completions", {"prompt": prompt, **extra})
        assert r.status_code == 200, r.text
        body: dict[str, object] = r.json()
        return body

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels other than model_name) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


def start_engine(pool: Pool, *, role: str, namespace: str = "simns", extra: Sequence[str] = (),
                 time_scale: float = 0.02) -> Engine:
    port = free_port()
    cmd = [sys.executable, "-m", "daybreak", "sim-engine", "--role", role, "--host", "127.0.0.1", "--port", str(port),
           "--kv-namespace", namespace, "--block-bytes", str(BLOCK_BYTES), "--time-scale", str(time_scale),
           "--model", "sim-test", *extra]
    if "--no-pool" not in extra:
        cmd += ["--pool-endpoints", pool.address, "--token-file", str(pool.token_file)]
    return Engine(Proc(cmd, env=clean_env(pool.shm_dir)).start(), port, namespace)


@pytest.fixture(scope="module")
def engines(pool: Pool) -> Iterator[dict[str, Engine]]:
    started: dict[str, Engine] = {}
    try:
        started["prefill"] = start_engine(pool, role="prefill")
        started["decode"] = start_engine(pool, role="decode")
        started["both"] = start_engine(pool, role="both")
        started["other_ns"] = start_engine(pool, role="both", namespace="simother")
        yield started
    finally:
        for engine in started.values():
            engine.proc.kill()


def unique_prompt(blocks: int, tail: int = 5) -> str:
    head = f"[{uuid.uuid4().hex}]"
    return (head * (blocks * BLOCK_TOKENS // len(head) + 1))[:blocks * BLOCK_TOKENS] + "t" * tail


def daybreak_usage(body: dict[str, object]) -> dict[str, int]:
    usage = body["usage"]
    assert isinstance(usage, dict)
    out: dict[str, int] = usage["daybreak"]
    return out


def test_completions_and_chat_answer_streamed_and_not(engines: dict[str, Engine]) -> None:
    engine = engines["both"]
    body = engine.complete(unique_prompt(2), max_tokens=7)
    assert body["object"] == "text_completion"
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["text"] == "The qui" and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["prompt_tokens"] == 37 and usage["completion_tokens"] == 7 and usage["total_tokens"] == 44  # type: ignore[index]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # type: ignore[index]
    assert daybreak_usage(body)["computed_tokens"] == 37
    assert daybreak_usage(body)["bytes_written"] == 2 * BLOCK_BYTES

    chat = engine.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200
    assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": "The"}
    assert chat.json()["usage"]["prompt_tokens"] == len(b"<|user|>\nhi\n<|assistant|>\n")

    for path, body_extra in (("/v1/completions", {"prompt": unique_prompt(1)}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": unique_prompt(1)}]})):
        r = engine.post(path, {**body_extra, "max_tokens": 5, "stream": True,
                               "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.content.endswith(b"data: [DONE]\n\n")
        events = list(parse_sse(r.content))
        texts = [e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content"))
                 for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
        assert "".join(texts) == "The q"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        if path.endswith("chat/completions"):
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[0]["object"] == "chat.completion.chunk"
    plain = engine.post("/v1/completions", {"prompt": "x" * 20, "stream": True})
    assert all("usage" not in e for e in parse_sse(plain.content))  # usage only when asked for

    # Token ids and Mooncake hash_ids are prompts too; hash_ids wins and shares blocks by id.
    ids = engine.post("/v1/completions", {"prompt": list(range(40)), "max_tokens": 1})
    assert ids.json()["usage"]["prompt_tokens"] == 40
    first = engine.post("/v1/completions", {"hash_ids": [90001, 90002], "input_length": 1000, "max_tokens": 1})
    assert first.json()["usage"]["prompt_tokens"] == 1000
    second = engine.post("/v1/completions", {"hash_ids": [90001, 90003], "max_tokens": 1})
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 512  # block 90001, local


def test_prefill_writes_blocks_a_separate_decode_reads_and_checks_by_content(
        pool: Pool, engines: dict[str, Engine]) -> None:
    prompt = unique_prompt(70)
    produced = engines["prefill"].complete(prompt, max_tokens=1)
    assert produced["usage"]["completion_tokens"] == 1  # type: ignore[index]
    assert daybreak_usage(produced)["bytes_written"] == 70 * BLOCK_BYTES
    assert daybreak_usage(produced)["computed_tokens"] == 70 * BLOCK_TOKENS + 5

    # Any reader can check by content that the pool holds exactly the contract's bytes.
    keys = block_keys(tokenize(prompt), BLOCK_TOKENS)
    with KVPoolClient([pool.address], token=pool.token, namespace="simns") as client:
        buffers = [bytearray(BLOCK_BYTES) for _ in keys]
        assert client.batch_get_into(keys, buffers) == [BLOCK_BYTES] * 70
        assert all(check_block("simns", k, b) for k, b in zip(keys, buffers, strict=True))

    consumed = engines["decode"].complete(prompt, max_tokens=4)
    usage = daybreak_usage(consumed)
    assert consumed["choices"][0]["text"] == "The "  # type: ignore[index]
    assert usage["pool_hit_tokens"] == 70 * BLOCK_TOKENS and usage["blocks_checked"] == 70
    assert usage["blocks_corrupt"] == 0 and usage["bytes_read"] == 70 * BLOCK_BYTES
    assert usage["computed_tokens"] == 5 and usage["bytes_written"] == 0  # a consumer never writes
    metrics = engines["decode"].metrics()
    assert metrics["daybreak_engine_blocks_checked_total"] >= 70
    assert metrics["daybreak_engine_kv_bytes_total{direction=read}"] >= 70 * BLOCK_BYTES


def test_a_decode_computes_what_the_pool_lacks_and_recomputes_a_corrupt_block(
        pool: Pool, engines: dict[str, Engine]) -> None:
    prompt = unique_prompt(4)
    keys = block_keys(tokenize(prompt), BLOCK_TOKENS)
    with KVPoolClient([pool.address], token=pool.token, namespace="simns") as client:
        # Block 0 right, block 1 with another namespace's bytes, blocks 2-3 right: only block 0 is usable.
        blocks = [block_content("simns", keys[0], BLOCK_BYTES), block_content("simother", keys[1], BLOCK_BYTES),
                  block_content("simns", keys[2], BLOCK_BYTES), block_content("simns", keys[3], BLOCK_BYTES)]
        assert client.batch_put(keys, blocks) == [1, 1, 1, 1]
    before = engines["decode"].metrics()["daybreak_engine_blocks_corrupt_total"]
    usage = daybreak_usage(engines["decode"].complete(prompt, max_tokens=2))
    assert usage["pool_hit_tokens"] == BLOCK_TOKENS and usage["blocks_corrupt"] == 1
    assert usage["blocks_checked"] == 2 and usage["computed_tokens"] == 3 * BLOCK_TOKENS + 5
    assert engines["decode"].metrics()["daybreak_engine_blocks_corrupt_total"] == before + 1

    missing = unique_prompt(3)  # never written: all of it is computed, nothing is skipped
    usage = daybreak_usage(engines["decode"].complete(missing, max_tokens=2))
    assert usage["pool_hit_tokens"] == 0 and usage["computed_tokens"] == 3 * BLOCK_TOKENS + 5

    # A long prompt is read by several workers at once: a bad block deep inside still ends the prefix.
    long = unique_prompt(64)
    keys = block_keys(tokenize(long), BLOCK_TOKENS)
    with KVPoolClient([pool.address], token=pool.token, namespace="simns") as client:
        blocks = [block_content("simns" if i != 40 else "simother", k, BLOCK_BYTES) for i, k in enumerate(keys)]
        assert client.batch_put(keys, blocks) == [1] * 64
    usage = daybreak_usage(engines["decode"].complete(long, max_tokens=1))
    assert usage["pool_hit_tokens"] == 40 * BLOCK_TOKENS and usage["blocks_corrupt"] == 1
    assert 41 <= usage["blocks_checked"] <= 64 and usage["computed_tokens"] == 24 * BLOCK_TOKENS + 5


def test_a_shared_prefix_hits_the_pool_from_another_engine_and_another_namespace_never_does(
        engines: dict[str, Engine]) -> None:
    shared = unique_prompt(5, tail=0)
    engines["prefill"].complete(shared + "first question", max_tokens=1)
    before = engines["both"].metrics()
    second = engines["both"].complete(shared + "second question, longer", max_tokens=2)
    usage = daybreak_usage(second)
    assert usage["pool_hit_tokens"] == 5 * BLOCK_TOKENS and usage["local_hit_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK_TOKENS  # type: ignore[index]
    # It writes only what it computed: the blocks after the shared prefix.
    assert usage["bytes_written"] == (len(tokenize(shared + "second question, longer")) // 16 - 5) * BLOCK_BYTES
    after = engines["both"].metrics()
    assert after["daybreak_engine_pool_hits_total"] - before["daybreak_engine_pool_hits_total"] == 5
    assert (after["vllm:external_prefix_cache_hits_total"]
            - before["vllm:external_prefix_cache_hits_total"]) == 5 * BLOCK_TOKENS
    assert after["daybreak_engine_pool_misses_total"] > before["daybreak_engine_pool_misses_total"]

    # The same engine again: now its own cache has the whole prefix (a local hit, nothing read).
    third = daybreak_usage(engines["both"].complete(shared + "second question, longer", max_tokens=1))
    assert third["local_hit_tokens"] > 5 * BLOCK_TOKENS and third["bytes_read"] == 0

    other = daybreak_usage(engines["other_ns"].complete(shared + "first question", max_tokens=1))
    assert other["pool_hit_tokens"] == 0 and other["blocks_checked"] == 0
    assert engines["other_ns"].metrics()["daybreak_engine_pool_hits_total"] == 0


def test_metrics_parse_with_vllm_names_and_types(engines: dict[str, Engine]) -> None:
    engine = engines["both"]
    engine.complete(unique_prompt(1), max_tokens=3, stream=False)
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "daybreak_engine_pool_hits": "counter", "daybreak_engine_pool_misses": "counter",
        "daybreak_engine_kv_bytes": "counter",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        assert all(s.labels.get("model_name") == "sim-test" for s in families[name].samples), name
    samples = engine.metrics()
    assert samples["vllm:time_to_first_token_seconds_count"] >= 1
    assert samples["vllm:inter_token_latency_seconds_count"] >= 2
    assert samples["vllm:num_requests_running"] == 0
    assert samples["vllm:prefix_cache_queries_total"] >= samples["vllm:prefix_cache_hits_total"]
    kv_bytes = {s.labels["direction"] for s in families["daybreak_engine_kv_bytes"].samples if "direction" in s.labels}
    assert kv_bytes == {"read", "written"}


def test_bad_requests_get_400_naming_the_field(engines: dict[str, Engine]) -> None:
    engine = engines["both"]
    cases = [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"hash_ids": "abc"}, "hash_ids"),
        ({"hash_ids": [-1]}, "hash_ids"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ""}, "prompt"),
    ]
    for body, field in cases:
        r = engine.post("/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["error"]["message"], (body, r.text)
    assert engine.post("/v1/chat/completions", {"prompt": "x"}).status_code == 400
    assert engine.post("/v1/chat/completions", {"messages": [{"role": 1}]}).status_code == 400
    raw = httpx.post(engine.url + "/v1/completions", content=b"{not json", timeout=10)
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]
    assert httpx.post(engine.url + "/v1/completions", content=b"[1]", timeout=10).status_code == 400
    assert engine.post("/daybreak/v1/prefix", {"keys": "nope"}).status_code == 400
    # The engine still serves after all of that.
    assert engine.complete("fine", max_tokens=1)["usage"]["completion_tokens"] == 1  # type: ignore[index]


def test_a_no_pool_engine_serves_from_its_local_cache_and_reports_its_prefix(pool: Pool) -> None:
    engine = start_engine(pool, role="both", extra=["--no-pool", "--local-cache-blocks", "4"])
    try:
        prompt = unique_prompt(3)
        first = daybreak_usage(engine.complete(prompt, max_tokens=1))
        assert first["computed_tokens"] == 3 * BLOCK_TOKENS + 5 and first["bytes_written"] == 0
        again = daybreak_usage(engine.complete(prompt, max_tokens=1))
        assert again["local_hit_tokens"] == 3 * BLOCK_TOKENS and again["pool_hit_tokens"] == 0
        keys = block_keys(tokenize(prompt), BLOCK_TOKENS)
        probe = engine.post("/daybreak/v1/prefix", {"keys": [*keys, "f" * 32]})
        assert probe.json() == {"local_blocks": 3}
        engine.complete(unique_prompt(3), max_tokens=1)  # four blocks of room: the old prefix is evicted
        assert engine.post("/daybreak/v1/prefix", {"keys": keys}).json()["local_blocks"] < 3
    finally:
        assert engine.proc.terminate() == 0


def test_sigterm_drains_an_in_flight_stream_then_exits_zero(pool: Pool) -> None:
    engine = start_engine(pool, role="both", time_scale=1.0)
    try:
        assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
        body = {"prompt": unique_prompt(2), "max_tokens": 120, "stream": True,
                "stream_options": {"include_usage": True}}
        received: list[bytes] = []
        with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as response:
            chunks = response.iter_bytes()
            received.append(next(chunks))  # the stream is under way
            assert engine.proc.proc is not None
            engine.proc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(engine.url + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "health did not turn 503 on SIGTERM"
                time.sleep(0.02)
            refused = engine.post("/v1/completions", {"prompt": "late", "max_tokens": 1})
            assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
            received.extend(chunks)
        stream = b"".join(received)
        assert stream.endswith(b"data: [DONE]\n\n")
        events = list(parse_sse(stream))
        assert events[-1]["usage"]["completion_tokens"] == 120
        # The SIGTERM above is the only signal: wait for the drained engine to exit on its own (a second
        # SIGTERM racing its shutdown would read as a kill).
        assert engine.proc.proc.wait(timeout=30) == 0
        assert any("event=drained" in line for line in engine.proc.lines)
    finally:
        engine.proc.kill()


def test_settings_errors_say_what_to_give() -> None:
    run = subprocess.run([sys.executable, "-m", "daybreak", "sim-engine", "--role", "decode"], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if not k.startswith("DAYBREAK_")},
                         timeout=60)
    assert run.returncode == 2 and "--pool-endpoints" in run.stderr and "--no-pool" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "daybreak", "sim-engine", "--no-pool", "--kv-layout", json.dumps({})],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-layout" in bad.stderr


def test_pool_ref_waits_for_the_kvpools_published_endpoints_then_uses_them(
        pool: Pool, kube: LocalCluster, tmp_path: Path) -> None:
    """``--pool-ref NS/NAME`` finds the agents in the KVPool's status through the API (no DNS needed)."""
    cache = f"--cache-dir={tmp_path / 'kubectl-cache'}"
    kube.kubectl(cache, "apply", "-f", str(ROOT / "crds"))
    kube.kubectl(cache, "wait", "--for=condition=Established", "--timeout=60s", "crd/kvpools.daybreak.dev")
    ns = "sim-pool-ref"
    if kube.kubectl(cache, "get", "namespace", ns, check=False).returncode != 0:
        kube.kubectl(cache, "create", "namespace", ns)
    kube.kubectl(cache, "apply", "-n", ns, "-f", str(ROOT / "examples" / "kvpool-minimal.yaml"))
    env = {**clean_env(pool.shm_dir), "KUBECONFIG": str(kube.kubeconfig)}
    port = free_port()
    proc = Proc([sys.executable, "-m", "daybreak", "sim-engine", "--role", "both", "--port", str(port),
                 "--pool-ref", f"{ns}/kv-minimal", "--token-file", str(pool.token_file), "--kv-namespace", "simref",
                 "--block-bytes", str(BLOCK_BYTES), "--time-scale", "0.02"], env=env)
    engine = Engine(proc, port, "simref")
    ready = threading.Thread(target=proc.start, kwargs={"timeout": 120}, daemon=True)
    ready.start()
    try:
        # No endpoints published yet: the engine runs but is not ready.
        deadline = time.monotonic() + 60
        while not any("publishes no endpoints" in line for line in proc.lines):
            assert time.monotonic() < deadline, "".join(proc.lines[-20:])
            time.sleep(0.1)
        assert httpx.get(engine.url + "/health", timeout=10).status_code == 503
        host, agent_port = pool.address.rsplit(":", 1)
        status = {"status": {"endpoints": [{"node": "n1", "address": host, "port": int(agent_port)}]}}
        kube.kubectl(cache, "patch", "-n", ns, "kvpool", "kv-minimal", "--subresource=status", "--type=merge",
                     "-p", json.dumps(status))
        ready.join(timeout=120)
        assert any("event=ready" in line for line in proc.lines), "".join(proc.lines[-20:])
        usage = daybreak_usage(engine.complete(unique_prompt(2), max_tokens=1))
        assert usage["bytes_written"] == 2 * BLOCK_BYTES
        assert proc.terminate() == 0
    finally:
        proc.kill()


def test_a_client_that_goes_away_mid_stream_frees_its_batch_slot(engines: dict[str, Engine]) -> None:
    engine = engines["both"]
    before = engine.metrics()["vllm:generation_tokens_total"]
    body = {"prompt": unique_prompt(1), "max_tokens": 100_000, "stream": True}  # minutes of decoding
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as response:
        chunks = response.iter_bytes()  # held: dropping the iterator would close the stream here
        next(chunks)
        assert engine.metrics()["vllm:num_requests_running"] == 1
    deadline = time.monotonic() + 30
    while engine.metrics()["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the abandoned request kept its slot"
        time.sleep(0.05)
    assert engine.metrics()["vllm:generation_tokens_total"] - before < 100_000
    assert engine.complete("still serving", max_tokens=2)["usage"]["completion_tokens"] == 2  # type: ignore[index]
