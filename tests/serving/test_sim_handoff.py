"""A draining sim engine hands the engine-local blocks the pool lacks to the pool (scale-in keeps the cache)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daybreak.client import KVPoolClient
from daybreak.serving.prompt import block_keys, check_block, tokenize
from daybreak.serving.sim.kv import LocalCache
from daybreak.testing.serving_stack import Stack, metric_sum

BLOCK_TOKENS = 16
BLOCK_BYTES = 4096


def test_local_cache_tracks_what_the_pool_lacks() -> None:
    cache = LocalCache(4)
    cache.insert(["a", "b", "c"])
    cache.mark_unpooled(["b", "c", "zz"])  # zz is not cached: ignored
    assert cache.local_only == 2 and cache.unpooled() == ["c", "b"]
    cache.mark_pooled(["c"])
    assert cache.unpooled() == ["b"]
    cache.insert(["d", "e", "f"])  # evicts a and b
    assert cache.local_only == 0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "stack", block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
    try:
        s.add_agents(1, dram="64Mi")
        yield s
    finally:
        s.close()


def _post(address: str, body: dict[str, Any]) -> dict[str, Any]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return dict(json.loads(resp.read()))
    finally:
        conn.close()


def test_a_draining_decode_engine_writes_its_computed_blocks_to_the_pool(stack: Stack) -> None:
    decode = stack.engine("decode")
    prompt = "the draining engine keeps what it computed " * 20
    keys = block_keys(tokenize(prompt), BLOCK_TOKENS)
    assert len(keys) >= 10
    out = _post(decode.address, {"model": "sim", "prompt": prompt, "max_tokens": 2})
    assert out["usage"]["daybreak"]["computed_tokens"] > 0  # the pool held nothing: decode computed it
    assert metric_sum(decode.metrics(), "daybreak_engine_local_only_blocks") == len(keys)
    token = stack.token_file.read_text().strip()
    with KVPoolClient([stack.pool_endpoints], token=token, namespace=stack.kv_namespace, transport="tcp") as pool:
        assert not any(pool.batch_exists(keys))
        decode.stop(timeout_seconds=30)
        assert decode.proc is not None and decode.proc.returncode == 0, decode.tail()
        assert all(pool.batch_exists(keys)), decode.tail()
        buffers = [bytearray(BLOCK_BYTES) for _ in keys]
        sizes = pool.batch_get_into(keys, buffers)
        assert all(size == BLOCK_BYTES for size in sizes)
        assert all(check_block(stack.kv_namespace, k, b) for k, b in zip(keys, buffers, strict=True))
