"""Real vLLM servers on CPU share KV blocks through a standalone Daybreak pool with the DaybreakConnector.

A tiny random-weight Llama model is built locally; a standalone agent is the
pool. Greedy outputs of a server without any connector are the reference.
Servers are module-scoped and started two at a time (2 cores, ~2 GB each).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from daybreak.client import KVPoolClient
from daybreak.connectors.blocks import EngineLayout
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port
from daybreak.testing.vllm_server import VllmServer, daybreak_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# The tiny model (daybreak.testing.tinymodel.SMALL) on vLLM's CPU backend: 128-token blocks.
LAYOUT = EngineLayout(platform="cpu", block_tokens=128, num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                      kv_layout="LBHNC", head_slots=4, content_bytes=256)
MAX_TOKENS = 12
HITS = "vllm:external_prefix_cache_hits_total"


def _prompt(seed: int, length: int = 700) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(length)]


PROMPTS = {name: _prompt(seed) for seed, name in enumerate(("shared", "corrupt", "partial", "pd", "consumer",
                                                                         "routed"))}
# Full blocks a 700-token prompt can load: the last prompt token is always computed.
LOADABLE = (700 - 1) // 128 * 128


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model  # conftest.py: shared with the local-cluster test


@pytest.fixture(scope="module")
def pool(workdir: Path) -> Iterator[LocalAgent]:
    name = f"v{uuid.uuid4().hex[:8]}"
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=workdir / "token", pool=name, dram="256Mi",
                       log_path=workdir / "agent.log")
    agent.start()
    yield agent
    agent.stop()
    cleanup_pool(name)


def _client(pool: LocalAgent, namespace: str) -> KVPoolClient:
    return KVPoolClient(endpoints=[pool.address], token=pool.token_file.read_text().strip(), namespace=namespace)


def _server(vllm_python: Path, model: Path, workdir: Path, name: str, *, cpu: int,
            config: dict[str, object] | None) -> VllmServer:
    return VllmServer(python=vllm_python, model=model, port=free_port(), cpu=cpu, log_path=workdir / f"{name}.log",
                      kv_transfer_config=config)


def _keys(vllm_python: Path, prompt: list[int]) -> list[str]:
    out = subprocess.run([str(vllm_python), "-m", "daybreak.connectors.vllm", "keys", "--fingerprint",
                          LAYOUT.fingerprint(), "--block-tokens", str(LAYOUT.block_tokens),
                          "--layers", str(LAYOUT.num_layers)], input=json.dumps(prompt), capture_output=True,
                         text=True, check=True, env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}, timeout=120)
    keys: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return keys


@pytest.fixture(scope="module")
def reference(vllm_python: Path, model: Path, workdir: Path) -> dict[str, list[int]]:
    """Greedy outputs of a server with no KV connector at all (started and stopped before the others)."""
    plain = _server(vllm_python, model, workdir, "plain", cpu=0, config=None).start()
    try:
        plain.wait_ready()
        return {name: plain.complete(prompt, max_tokens=MAX_TOKENS).token_ids for name, prompt in PROMPTS.items()}
    finally:
        plain.stop()


SHARED_NS = "shared-ns"
PD_NS = "pd-ns"


@pytest.fixture(scope="class")
def shared_engines(vllm_python: Path, model: Path, workdir: Path, pool: LocalAgent,
                   reference: dict[str, list[int]]) -> Iterator[tuple[VllmServer, VllmServer]]:
    config = daybreak_transfer_config(role="kv_both", endpoints=[pool.address], token_file=pool.token_file,
                                      namespace=SHARED_NS)
    a = _server(vllm_python, model, workdir, "engine-a", cpu=0, config=config).start()
    b = _server(vllm_python, model, workdir, "engine-b", cpu=1, config=config).start()
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="class")
def pd_engines(vllm_python: Path, model: Path, workdir: Path, pool: LocalAgent,
               reference: dict[str, list[int]]) -> Iterator[tuple[VllmServer, VllmServer]]:
    def config(role: str) -> dict[str, object]:
        return daybreak_transfer_config(role=role, endpoints=[pool.address], token_file=pool.token_file,
                                        namespace=PD_NS)

    prefill = _server(vllm_python, model, workdir, "prefill", cpu=0, config=config("kv_producer")).start()
    decode = _server(vllm_python, model, workdir, "decode", cpu=1, config=config("kv_consumer")).start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


class TestTwoEnginesShareOnePool:
    """Engines A and B, both kv_both in one namespace: B loads what A computed."""

    def test_second_engine_loads_the_prefix_the_first_computed_and_generates_the_same_tokens(
            self, shared_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]], pool: LocalAgent,
            vllm_python: Path) -> None:
        a, b = shared_engines
        first = a.complete(PROMPTS["shared"], max_tokens=MAX_TOKENS)
        assert first.token_ids == reference["shared"] and first.cached_tokens == 0
        assert a.metric(HITS) == 0
        assert f"fingerprint={LAYOUT.fingerprint()}" in a.log_text()
        keys = _keys(vllm_python, PROMPTS["shared"])
        assert len(keys) == 5 * LAYOUT.num_layers  # 5 full blocks of 700 tokens, one key per layer
        with _client(pool, SHARED_NS) as ns, _client(pool, "another-ns") as other:
            assert all(ns.batch_exists(keys))  # A saved every full block under the keys we derive
            assert not any(other.batch_exists(keys))  # an engine of another namespace would miss them all

        before = b.metric(HITS)
        second = b.complete(PROMPTS["shared"], max_tokens=MAX_TOKENS)
        assert second.token_ids == reference["shared"]
        assert second.cached_tokens == LOADABLE
        assert b.metric(HITS) - before == LOADABLE
        assert "event=loaded blocks=5 failed=0" in b.log_text()
        # Layer by layer: every layer's load was waited for by that layer's attention, and A saved per layer.
        assert "layers_waited=4/4" in b.log_text()
        assert "event=saved blocks=5 stored_keys=20/20 layers_batches=4" in a.log_text()

    def test_blocks_overwritten_with_another_prompts_kv_change_the_output(
            self, shared_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]], pool: LocalAgent,
            vllm_python: Path) -> None:
        a, b = shared_engines
        assert a.complete(PROMPTS["corrupt"], max_tokens=MAX_TOKENS).token_ids == reference["corrupt"]
        donor = _keys(vllm_python, PROMPTS["shared"])
        target = _keys(vllm_python, PROMPTS["corrupt"])
        with _client(pool, SHARED_NS) as ns:
            # Valid bf16 KV, but of another prompt: checksums match, only the meaning is wrong.
            buffers = [bytearray(LAYOUT.block_bytes_per_layer) for _ in donor]
            assert ns.batch_get_into(donor, buffers) == [LAYOUT.block_bytes_per_layer] * len(donor)
            assert ns.batch_put(target, buffers) == [1] * len(target)
        before = b.metric(HITS)
        corrupted = b.complete(PROMPTS["corrupt"], max_tokens=MAX_TOKENS)
        assert b.metric(HITS) - before == LOADABLE
        assert corrupted.token_ids != reference["corrupt"]  # the loaded KV was really used

    def test_a_block_that_fails_to_load_is_recomputed_not_used(
            self, shared_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]], pool: LocalAgent,
            vllm_python: Path) -> None:
        a, b = shared_engines
        assert a.complete(PROMPTS["partial"], max_tokens=MAX_TOKENS).token_ids == reference["partial"]
        keys = _keys(vllm_python, PROMPTS["partial"])
        with _client(pool, SHARED_NS) as ns:
            # Block 2, layer 1: present (so the lookup counts it) but truncated, so the load of it fails.
            assert ns.batch_put([keys[2 * LAYOUT.num_layers + 1]], [b"\0" * 100]) == [1]
        recovered = b.complete(PROMPTS["partial"], max_tokens=MAX_TOKENS)
        assert recovered.token_ids == reference["partial"]
        assert "event=loaded blocks=5 failed=1" in b.log_text()


class TestPrefillThenDecode:
    """A kv_producer prefill engine and a kv_consumer decode engine, driven as ``daybreak router`` drives them:
    the original request to prefill with ``max_tokens: 1, stream: false``, then unchanged to decode."""

    def test_decode_loads_the_prompt_prefill_computed_and_computes_only_the_rest(
            self, pd_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]]) -> None:
        prefill, decode = pd_engines
        request = {"model": str(prefill.model), "prompt": PROMPTS["pd"], "max_tokens": MAX_TOKENS,
                   "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        first = prefill.post("/v1/completions", {**request, "max_tokens": 1, "stream": False})
        assert first["choices"][0]["token_ids"] == reference["pd"][:1]
        before = decode.metric(HITS)
        out = decode.post("/v1/completions", request)
        assert out["choices"][0]["token_ids"] == reference["pd"]
        # Decode computed only the 700 - 640 prompt tokens after the transferred blocks.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
        assert decode.metric(HITS) - before == LOADABLE

    def test_daybreak_router_sends_prefill_then_decode_and_decode_loads_what_prefill_saved(
            self, pd_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]],
            tmp_path: Path) -> None:
        """The real router in front of the two engines: routing on load alone (vLLM's block hashes are
        vLLM's, so no pool lookup), prefill with max_tokens 1, then decode, whose output is the reference."""
        prefill, decode = pd_engines
        port = free_port()
        log = (tmp_path / "router.log").open("w")
        router = subprocess.Popen(
            [str(Path(sys.executable).with_name("daybreak")), "router", "--host", "127.0.0.1", "--port", str(port),
             "--prefill-endpoints", f"127.0.0.1:{prefill.port}", "--decode-endpoints", f"127.0.0.1:{decode.port}",
             "--no-pool-lookup", "--cache-statistics"], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.2)
            before_prefill, before_decode = prefill.metric("vllm:request_success_total"), decode.metric(HITS)
            request = {"model": str(prefill.model), "prompt": PROMPTS["routed"], "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            resp = httpx.post(url + "/v1/completions", json=request, timeout=300)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert out["choices"][0]["token_ids"] == reference["routed"]
            assert prefill.metric("vllm:request_success_total") - before_prefill == 1  # prefill ran once
            assert decode.metric(HITS) - before_decode == LOADABLE  # decode loaded the prompt from the pool
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
        finally:
            router.terminate()
            router.wait(timeout=30)
            log.close()

    def test_a_consumer_saves_nothing_and_a_producer_loads_nothing(
            self, pd_engines: tuple[VllmServer, VllmServer], reference: dict[str, list[int]], pool: LocalAgent,
            vllm_python: Path) -> None:
        prefill, decode = pd_engines
        assert decode.complete(PROMPTS["consumer"], max_tokens=MAX_TOKENS).token_ids == reference["consumer"]
        keys = _keys(vllm_python, PROMPTS["consumer"])
        with _client(pool, PD_NS) as ns:
            assert not any(ns.batch_exists(keys))
            assert all(ns.batch_exists(_keys(vllm_python, PROMPTS["pd"])))  # what the producer saved
        # The pd prompt's blocks are in the pool, but a producer computes instead of loading.
        pd_prefix = PROMPTS["pd"][:LOADABLE] + PROMPTS["consumer"][:100]
        prefill.complete(pd_prefix, max_tokens=1)
        assert prefill.metric(HITS) == 0


def test_an_engine_whose_block_size_differs_from_the_kv_layout_refuses_to_start(
        vllm_python: Path, model: Path, workdir: Path, pool: LocalAgent) -> None:
    layout = {"numLayers": 4, "numKVHeads": 4, "headDim": 64, "dtype": "bfloat16", "blockTokens": 16,
              "platform": "cpu"}
    config = daybreak_transfer_config(role="kv_both", endpoints=[pool.address], token_file=pool.token_file,
                                      namespace="layout-ns", kv_layout=layout)
    server = _server(vllm_python, model, workdir, "bad-layout", cpu=0, config=config).start()
    assert server.wait_exit(timeout_seconds=300) != 0
    assert ("vLLM's block size is 128 tokens but the deployment's kvLayout.blockTokens is 16" in server.log_text())
