"""The client library's surface: argument errors, numpy and bytes-like buffers, asyncio, block hashes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daybreak.client import AsyncKVPoolClient, KVPoolClient, KVPoolError, block_hashes
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    pool = f"c{uuid.uuid4().hex[:8]}"
    a = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path_factory.mktemp("client") / "token",
                   pool=pool, dram="32Mi")
    a.start()
    yield a
    a.kill()
    cleanup_pool(pool)


@pytest.fixture
def client(agent: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient(endpoints=[agent.address], token=agent.token_file.read_text().strip(),
                      namespace=f"n{uuid.uuid4().hex[:6]}") as c:
        yield c


def test_block_hashes_chain_prefixes() -> None:
    a = block_hashes(list(range(40)), block_tokens=16)
    b = block_hashes([*range(32), 999, 998], block_tokens=16)
    assert len(a) == 2 and len(b) == 2  # partial trailing blocks get no key
    assert a == b  # same first 32 tokens, same keys
    c = block_hashes([1, *range(1, 32)], block_tokens=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key
    assert block_hashes(list(range(32)), block_tokens=16, salt="lora-1") != a
    assert len(set(a)) == 2 and all(len(k) == 32 for k in a)

    class Layout:
        block_tokens = 8

    assert len(block_hashes(list(range(40)), layout=Layout())) == 5
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes([1, 2], block_tokens=0)
    with pytest.raises(ValueError, match="outside"):
        block_hashes([-1], block_tokens=1)


def test_argument_errors_name_the_field(agent: LocalAgent, client: KVPoolClient) -> None:
    token = agent.token_file.read_text().strip()
    with pytest.raises(ValueError, match="namespace"):
        KVPoolClient(endpoints=[agent.address], token=token, namespace="bad/ns")
    with pytest.raises(ValueError, match="endpoints"):
        KVPoolClient(endpoints=[], token=token, namespace="ns")
    with pytest.raises(ValueError, match="transport"):
        KVPoolClient(endpoints=[agent.address], token=token, namespace="ns", transport="udp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differ in length"):
        client.batch_put(["a", "b"], [b"x"])
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        client.batch_put([""], [b"x"])
    with pytest.raises(ValueError, match=r"buffers\[0\] is read-only"):
        client.batch_get_into(["a"], [b"immutable"])
    with pytest.raises(ValueError, match=r"buffers\[0\] is not C-contiguous"):
        client.batch_put(["a"], [np.zeros((4, 4))[:, 1]])
    with pytest.raises(KVPoolError, match="no agent of the pool is reachable"):
        KVPoolClient(endpoints=[f"127.0.0.1:{free_port()}"], token=token, namespace="ns")


def test_numpy_and_bytes_like_buffers(client: KVPoolClient) -> None:
    floats = np.arange(1000, dtype=np.float32).reshape(10, 100)
    assert client.batch_put(["f", "b", "m"], [floats, b"bytes!", memoryview(bytearray(b"view"))]) == [1, 1, 1]
    out = np.zeros_like(floats)
    small = bytearray(6)
    view = memoryview(bytearray(4))
    assert client.batch_get_into(["f", "b", "m"], [out, small, view]) == [4000, 6, 4]
    assert np.array_equal(out, floats) and small == b"bytes!" and view.tobytes() == b"view"


def test_buffer_too_small_is_an_error_naming_the_key(client: KVPoolClient) -> None:
    assert client.batch_put(["big", "fits"], [b"x" * 5000, b"y" * 10]) == [1, 1]
    fits = bytearray(10)
    with pytest.raises(ValueError, match=r"'big' needs 5000 bytes, buffers\[0\] has 100"):
        client.batch_get_into(["big", "fits"], [bytearray(100), fits])
    assert fits == b"y" * 10  # the others were still filled


def test_pinned_put_and_remove(client: KVPoolClient) -> None:
    assert client.batch_put(["p"], [b"hot prefix"], pin_seconds=60) == [1]
    assert client.batch_exists(["p", "q"]) == [True, False]
    assert client.remove(["p", "q"]) == [True, False]
    assert client.batch_exists(["p"]) == [False]


def test_async_client_round_trip(agent: LocalAgent) -> None:
    async def main() -> None:
        c = await AsyncKVPoolClient.connect([agent.address], token=agent.token_file.read_text().strip(),
                                            namespace="async", transport="tcp")
        async with c:
            data = [np.full(65536, i, np.uint8) for i in range(8)]
            keys = [f"a{i}" for i in range(8)]
            assert await c.batch_put(keys, data) == [1] * 8
            out = [np.zeros(65536, np.uint8) for _ in keys]
            # The event loop keeps running while the client waits on sockets.
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            sizes = await c.batch_get_into(keys, out)
            task.cancel()
            assert sizes == [65536] * 8 and ticks > 0
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
            assert await c.batch_exists([*keys[:2], "nope"]) == [True, True, False]
            assert await c.remove(keys) == [True] * 8

    asyncio.run(main())


def test_help_lists_a_small_public_surface() -> None:
    import daybreak.client as client_module

    assert sorted(client_module.__all__) == ["AsyncKVPoolClient", "KVPoolAuthorizationError", "KVPoolClient",
                                             "KVPoolError", "KVPoolQuotaError", "POOL_TLS_CA_ENV", "block_hashes", "pool_tls_ca_file"]
    for name in ("batch_put", "batch_get_into", "batch_exists", "remove", "close"):
        assert getattr(KVPoolClient, name).__doc__, name
    assert "seconds" in (KVPoolClient.__doc__ or "")


def test_token_file_written_once(tmp_path: Path) -> None:
    from daybreak.agent.main import load_token, parse_size

    path = tmp_path / "tok"
    first = load_token(str(path))
    assert load_token(str(path)) == first and len(first) == 64
    assert parse_size("2Gi", flag="--dram") == 2 << 30
    with pytest.raises(ValueError, match="--dram"):
        parse_size("lots", flag="--dram")
