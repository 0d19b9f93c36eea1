"""A real agent counts the block bytes it moves per transport and serves them on /metrics."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daybreak.agent.transfer import TransferEngine
from daybreak.client import KVPoolClient
from daybreak.pool.connection import Connection, RemoteError
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port


@pytest.fixture
def pool() -> Iterator[str]:
    name = f"b{uuid.uuid4().hex[:8]}"
    yield name
    cleanup_pool(name)


def _start(pool: str, tmp_path: Path, *, metrics_port: int, extra: list[str] | None = None) -> LocalAgent:
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path / "token", pool=pool, dram="32Mi",
                       extra=["--metrics-port", str(metrics_port), *(extra or [])])
    return agent.start()


def _moved(metrics_port: int) -> dict[tuple[str, str], float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "daybreak_store_bytes_total":
                out[(s.labels["transport"], s.labels["op"])] = s.value
    return out


def _put_get(agent: LocalAgent, *, transport: str, prefix: str, count: int, size: int,
             tls_ca_file: str | None = None) -> None:
    data = [bytes([i + 1]) * size for i in range(count)]
    keys = [f"{prefix}{i}" for i in range(count)]
    with KVPoolClient(endpoints=[agent.address], token=agent.token_file.read_text().strip(), namespace="ns",
                      transport=transport, tls_ca_file=tls_ca_file) as c:  # type: ignore[arg-type]
        assert c.batch_put(keys, data) == [1] * count
        out = [bytearray(size) for _ in range(count)]
        assert c.batch_get_into(keys, out) == [size] * count
        assert [bytes(o) for o in out] == data


def test_same_node_memcpy_counts_as_shm_and_the_stream_as_tcp(pool: str, tmp_path: Path) -> None:
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port)
    try:
        assert not any(_moved(port).values())  # nothing moved yet: the counter starts at zero
        _put_get(agent, transport="auto", prefix="s", count=4, size=64 << 10)  # same node: memcpy via /dev/shm
        after_shm = _moved(port)
        assert after_shm.get(("shm", "write")) == 4 * (64 << 10)
        assert after_shm.get(("shm", "read")) == 4 * (64 << 10)
        assert not after_shm.get(("tcp", "write")) and not after_shm.get(("tcp", "read"))
        _put_get(agent, transport="tcp", prefix="t", count=3, size=48 << 10)  # the store's own stream
        after_tcp = _moved(port)
        assert after_tcp.get(("tcp", "write")) == 3 * (48 << 10)
        assert after_tcp.get(("tcp", "read")) == 3 * (48 << 10)
        assert after_tcp.get(("shm", "write")) == after_shm[("shm", "write")]  # the stream added no shm bytes
    finally:
        agent.kill()


def test_a_tls_listener_counts_its_stream_as_tls(pool: str, tmp_path: Path) -> None:
    cert, key = tmp_path / "agent.pem", tmp_path / "agent.key"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port,
                   extra=["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert)])
    try:
        _put_get(agent, transport="tcp", prefix="x", count=2, size=32 << 10, tls_ca_file=str(cert))
        moved = _moved(port)
        assert moved.get(("tls", "write")) == 2 * (32 << 10) and moved.get(("tls", "read")) == 2 * (32 << 10)
        assert not moved.get(("tcp", "write"))
    finally:
        agent.kill()


def test_one_sided_engine_moves_on_this_node_count_as_shm(pool: str, tmp_path: Path) -> None:
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port)
    try:
        assert agent.wait_log("event=preflight transport=shm works=True"), agent.log[-2000:]
        token = agent.token_file.read_text().strip()
        data = [bytes([7]) * (96 << 10), bytes([9]) * (32 << 10)]
        with TransferEngine(token=token) as engine, \
                KVPoolClient([agent.address], token=token, namespace="ns", engine=engine) as c:
            assert c.batch_put(["e0", "e1"], data) == [1, 1]
            out = [bytearray(len(d)) for d in data]
            assert c.batch_get_into(["e0", "e1"], out) == [len(d) for d in data]
        moved = _moved(port)
        assert moved.get(("shm", "write")) == 128 << 10 and moved.get(("shm", "read")) == 128 << 10
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        # the bytes went by the engine's XALLOC / XLOCATE, not by ALLOC / LOCATE memcpy
        assert 'daybreak_store_request_seconds_count{op="xalloc"} 1.0' in text
        assert 'daybreak_store_request_seconds_count{op="xlocate"} 1.0' in text
    finally:
        agent.kill()


def test_an_agent_allowed_only_tcp_serves_same_node_clients_over_tcp(pool: str, tmp_path: Path) -> None:
    """transport.preference [tcp]: no shm bytes, not by memcpy and not by the one-sided engine."""
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port, extra=["--transports", "tcp"])
    try:
        assert agent.wait_log("transports=tcp "), agent.log[-2000:]  # the engine brought up tcp alone
        _put_get(agent, transport="auto", prefix="a", count=3, size=64 << 10)  # same node, yet no memcpy
        token = agent.token_file.read_text().strip()
        data = [bytes([5]) * (32 << 10)]
        with TransferEngine(token=token) as engine, \
                KVPoolClient([agent.address], token=token, namespace="ns", engine=engine) as c:
            assert c.batch_put(["e0"], data) == [1]
            out = [bytearray(32 << 10)]
            assert c.batch_get_into(["e0"], out) == [32 << 10] and bytes(out[0]) == data[0]
        moved = _moved(port)
        assert moved.get(("tcp", "write")) == 3 * (64 << 10) + (32 << 10)
        assert moved.get(("tcp", "read")) == 3 * (64 << 10) + (32 << 10)
        assert not moved.get(("shm", "write")) and not moved.get(("shm", "read"))
        # A client that maps segments anyway (an old one, or one ignoring the hello) is refused, not served.
        conn = Connection(agent.address, token=token.encode())
        try:
            with pytest.raises(RemoteError, match="shm is not among this pool's transports"):
                conn.alloc(["x"], [4096], [0])
        finally:
            conn.close()
    finally:
        agent.kill()


def test_an_agent_allowed_shm_and_tcp_moves_same_node_bytes_over_shm(pool: str, tmp_path: Path) -> None:
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port, extra=["--transports", "shm,tcp"])
    try:
        assert agent.wait_log("transports=shm,tcp "), agent.log[-2000:]
        _put_get(agent, transport="auto", prefix="b", count=2, size=64 << 10)
        moved = _moved(port)
        assert moved.get(("shm", "write")) == 2 * (64 << 10) and moved.get(("shm", "read")) == 2 * (64 << 10)
        assert not moved.get(("tcp", "write")) and not moved.get(("tcp", "read"))
    finally:
        agent.kill()


def test_a_client_told_tcp_only_never_maps_a_same_node_agent(pool: str, tmp_path: Path) -> None:
    """The client side of the preference: an agent offering shm, a client whose pool allows only tcp."""
    port = free_port()
    agent = _start(pool, tmp_path, metrics_port=port)
    try:
        token = agent.token_file.read_text().strip()
        data = [bytes([3]) * (16 << 10), bytes([4]) * (16 << 10)]
        with TransferEngine(token=token) as engine, \
                KVPoolClient([agent.address], token=token, namespace="ns", engine=engine, transports=["tcp"]) as c:
            assert c.batch_put(["c0", "c1"], data) == [1, 1]
            out = [bytearray(16 << 10) for _ in data]
            assert c.batch_get_into(["c0", "c1"], out) == [16 << 10] * 2 and [bytes(o) for o in out] == data
        moved = _moved(port)
        assert moved.get(("tcp", "write")) == 32 << 10 and moved.get(("tcp", "read")) == 32 << 10
        assert not moved.get(("shm", "write")) and not moved.get(("shm", "read"))
    finally:
        agent.kill()


def test_a_client_refuses_an_unknown_transport_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"transports: .*pigeon"):
        KVPoolClient(["127.0.0.1:1"], token="x" * 64, namespace="ns", transports=["pigeon"])
