"""Store reads and writes through the transfer engine (issue 10 items 2 and 3): shm and link between real
processes, rdma against the fake verbs, the fallback to tcp when a transport fails, the preflight conditions."""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sunrise_lib.build import build, node

from daybreak.agent.preflight import Preflight
from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.agent.store.datapath import StoreDataPath
from daybreak.agent.store.engine import BlockStore, StoreConfig
from daybreak.agent.store.server import StoreServer
from daybreak.agent.transfer import TransferEngine
from daybreak.client import KVPoolClient
from daybreak.client.datapath import engine_for_pod
from daybreak.client.env import engine_pod_env
from daybreak.pool import shm as pool_shm
from daybreak.pool.credentials import namespace_credential
from daybreak.testing.store_agent import LocalAgent, free_port

MiB = 1 << 20
SIZES = [1, 4096, 65_537, MiB + 3, 3 * MiB]
BUSES = ["0000:12:00.0", "0000:13:00.0"]


def _blocks(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]



def _agent(pool: dict[str, Any], *, extra: list[str] | None = None, env: dict[str, str] | None = None) -> LocalAgent:
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=pool["token_file"], pool=pool["name"],
                       dram="64Mi", extra=extra or [])
    pool["agents"].append(agent)
    if env:
        import os
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return agent.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return agent.start()


def _token(pool: dict[str, Any]) -> str:
    return Path(pool["token_file"]).read_text().strip()


def test_puts_and_gets_move_through_the_engines_shm_transport_byte_exact(pool: dict[str, Any]) -> None:
    agent = _agent(pool)
    assert agent.wait_log("event=preflight transport=shm works=True"), agent.log[-2000:]
    assert agent.wait_log("event=preflight transport=tcp works=True"), agent.log[-2000:]
    data = _blocks(1)
    keys = [f"k{i}" for i in range(len(data))]
    with TransferEngine(token=_token(pool)) as engine, \
            KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
        assert c.batch_put(keys, data) == [1] * len(keys)
        out = [np.zeros(n, np.uint8) for n in SIZES]
        assert c.batch_get_into(keys, out) == SIZES
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert engine.bytes_used == {"shm": 2 * sum(SIZES)}  # every byte, both ways, by shm
        assert engine.bytes_fell_back == {}
    # the same blocks through the store's stream, for a client without an engine
    with KVPoolClient([agent.address], token=_token(pool), namespace="ns", transport="tcp") as c:
        out = [np.zeros(n, np.uint8) for n in SIZES]
        assert c.batch_get_into(keys, out) == SIZES
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


def test_an_engine_pods_engine_is_built_from_its_contract_and_uses_only_the_pools_transports(
        pool: dict[str, Any]) -> None:
    """``engine_for_pod`` (the agent's own builder, ``TransferEngine.from_config``) from the engine-pod contract:
    with shm allowed the bytes move by shm; with tcp only the engine is never the path (the stream is)."""
    agent = _agent(pool)
    assert agent.wait_log("event=preflight transport=shm works=True"), agent.log[-2000:]
    data = _blocks(5)
    keys = [f"pod{i}" for i in range(len(data))]
    shm_pod = engine_pod_env({"DAYBREAK_TRANSPORTS": "shm,tcp"})
    engine = engine_for_pod(shm_pod, token=_token(pool))
    try:
        with KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
            assert c.batch_put(keys, data) == [1] * len(keys)
            out = [np.zeros(n, np.uint8) for n in SIZES]
            assert c.batch_get_into(keys, out) == SIZES
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert engine.bytes_used == {"shm": 2 * sum(SIZES)}
    finally:
        engine.close()
    tcp_engine = engine_for_pod(engine_pod_env({"DAYBREAK_TRANSPORTS": "tcp"}), token=_token(pool))
    try:
        with KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=tcp_engine) as c:
            out = [np.zeros(n, np.uint8) for n in SIZES]
            assert c.batch_get_into(keys, out) == SIZES
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert tcp_engine.bytes_used == {}  # tcp only: the one-round-trip stream, not the engine
    finally:
        tcp_engine.close()


def test_a_failing_shm_path_falls_back_to_tcp_and_the_bytes_are_counted(pool: dict[str, Any],
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(pool)
    data = _blocks(2)
    keys = [f"f{i}" for i in range(len(data))]
    # This process can no longer map the agent's /dev/shm: every shm request's path fails.
    monkeypatch.setattr(pool_shm, "SHM_DIR", tmp_path / "no-shm-here")
    with TransferEngine(token=_token(pool)) as engine, \
            KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
        assert c.batch_put(keys, data) == [1] * len(keys)
        out = [np.zeros(n, np.uint8) for n in SIZES]
        assert c.batch_get_into(keys, out) == SIZES
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert engine.bytes_fell_back.get(("shm", "tcp"), 0) > 0  # nothing fell back silently
        assert engine.bytes_used.get("tcp", 0) > 0


def test_an_engine_holding_only_its_namespace_credential_moves_blocks_over_tcp_by_capability(
        pool: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22: the one-sided path needs no pool secret. The engine pod's engine proves the deployment's
    namespace credential to the agent's engine, and every tcp READ/WRITE carries the capability XLOCATE or
    XALLOC granted for that block: byte-exact both ways, every byte over tcp (shm cannot map here)."""
    agent = _agent(pool)
    cred = namespace_credential(_token(pool).encode(), "ns")
    data = _blocks(4)
    keys = [f"c{i}" for i in range(len(data))]
    monkeypatch.setattr(pool_shm, "SHM_DIR", tmp_path / "no-shm-here")
    with TransferEngine(token=cred) as engine, \
            KVPoolClient([agent.address], token=cred, namespace="ns", engine=engine) as c:
        assert c.batch_put(keys, data) == [1] * len(keys)
        out = [np.zeros(n, np.uint8) for n in SIZES]
        assert c.batch_get_into(keys, out) == SIZES
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert engine.bytes_used.get("tcp", 0) == 2 * sum(SIZES)  # nothing went by the store's stream instead
    assert "tcp one-sided request refused" not in agent.log


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


def test_a_device_buffer_goes_to_the_hbm_tier_of_an_agent_process_over_the_link(
        pool: dict[str, Any], libdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = node(BUSES, links=[[0, 0, 1, 0]], memory_bytes=1 << 30)
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", fake)
    monkeypatch.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
    agent = _agent(pool, extra=["--hbm", "32Mi"],
                   env={"DAYBREAK_SUNRISE_LIB_DIR": str(libdir), "DAYBREAK_RUNTIME": "sunrise"})
    assert agent.wait_log("event=preflight transport=link works=True"), agent.log[-2000:]
    rt = SunriseRuntime.load(lib_dir=str(libdir))
    try:
        sizes = [MiB, 4 * MiB + 17]
        src = [rt.allocate(1, n) for n in sizes]
        dst = [rt.allocate(1, n) for n in sizes]
        want = []
        for buf, n in zip(src, sizes, strict=True):
            payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
            rt.copy_to_device(buf, memoryview(payload))
            want.append(hashlib.sha256(payload).hexdigest())
        with TransferEngine(token=_token(pool), runtime=rt) as engine, \
                KVPoolClient([agent.address], token=_token(pool), namespace="ns", engine=engine) as c:
            assert c.batch_put(["d0", "d1"], src, tier="hbm") == [1, 1]
            assert c.batch_get_into(["d0", "d1"], dst) == sizes
            assert set(engine.bytes_used) == {"link"}
            stats = next(iter(c._conns.values())).stats()
            assert stats["blocks_hbm"] == "2"  # the blocks are in device memory
        for buf, n, digest in zip(dst, sizes, want, strict=True):
            out = bytearray(n)
            rt.copy_to_host(out, buf)
            assert hashlib.sha256(out).hexdigest() == digest
        # The agent checksummed what landed (device memory): a host reader verifies those bytes.
        with KVPoolClient([agent.address], token=_token(pool), namespace="ns", transport="tcp") as c:
            host = [bytearray(n) for n in sizes]
            assert c.batch_get_into(["d0", "d1"], host) == sizes
            assert [hashlib.sha256(h).hexdigest() for h in host] == want
        for buf in src + dst:
            rt.free(buf)
    finally:
        rt.close()


def test_store_blocks_move_over_rdma_between_nodes_against_the_fake_verbs(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transfer"))
    from test_transfer_rdma import Fabric, fake_verbs  # the rdma tests' fake of the pyverbs surface

    fabric = Fabric()
    tag = uuid.uuid4().hex[:6]
    prefix = f"daybreak-trdma{tag}-x"
    store = BlockStore(StoreConfig(prefix=prefix, dram_bytes=64 * MiB))
    store.open()
    try:
        _rdma_round_trip(store, fabric, fake_verbs, tag=tag)
    finally:
        store.close(unlink=True)
        for path in pool_shm.SHM_DIR.glob(f"{prefix}-*"):  # the server's probe segment
            path.unlink(missing_ok=True)


def _rdma_round_trip(store: BlockStore, fabric: Any, fake_verbs: Any, *, tag: str) -> None:
    token = "rdma-test-token"
    agent_engine = TransferEngine(node=f"agent-{tag}", transports=("rdma", "tcp"), token=token,
                                  verbs=fake_verbs(fabric, ["a0", "a1"])).start()
    datapath = StoreDataPath(store=store, engine=agent_engine, own_engine=True)
    datapath.register()
    datapath.preflight = Preflight(engine=agent_engine).run()
    assert {n: c.works for n, c in datapath.preflight.checks.items()} == {"rdma": True, "tcp": True}
    server = StoreServer(store, listen=f"127.0.0.1:{free_port()}", token=token.encode(), pool=f"trdma{tag}", datapath=datapath)
    server.start()
    try:
        client_engine = TransferEngine(node=f"client-{tag}", transports=("rdma", "tcp"), token=token,
                                       verbs=fake_verbs(fabric, ["c0", "c1"])).start()
        data = _blocks(3)
        keys = [f"r{i}" for i in range(len(data))]
        with client_engine, KVPoolClient([server.address], token=token, namespace="ns", engine=client_engine) as c:
            assert c.batch_put(keys, data) == [1] * len(keys)
            out = [np.zeros(n, np.uint8) for n in SIZES]
            assert c.batch_get_into(keys, out) == SIZES
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
            assert client_engine.bytes_used == {"rdma": 2 * sum(SIZES)}
            fabric.down = {"a0", "a1", "c0", "c1"}  # every NIC cut: the engine falls back to tcp, and says so
            out = [np.zeros(n, np.uint8) for n in SIZES]
            assert c.batch_get_into(keys, out) == SIZES
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
            assert client_engine.bytes_fell_back.get(("rdma", "tcp"), 0) > 0
        conditions = {t["transport"]: t for t in datapath.preflight.conditions()}
        assert conditions["rdma"]["state"] == "works" and conditions["tcp"]["state"] == "works"
    finally:
        server.close()


def test_preflight_reports_a_transport_that_cannot_move_bytes_as_degraded() -> None:
    with TransferEngine(transports=("shm", "tcp")) as engine:
        tcp = engine.transport("tcp")
        tcp.start = lambda jobs: [engine.job_path_failed(j, "injected: connection refused", transport="tcp")
                                  for j in jobs]  # type: ignore[method-assign]
        checks = Preflight(engine=engine).run()
        assert checks.checks["shm"].works
        assert not checks.checks["tcp"].works and "injected: connection refused" in checks.checks["tcp"].reason
        engine.bytes_fell_back[("shm", "tcp")] = 4096  # what the engine counts when shm requests fall back
        by = {c["transport"]: c for c in checks.conditions()}
        assert by["shm"]["state"] == "degraded" and "4096 bytes to tcp" in by["shm"]["reason"]
        assert by["tcp"]["state"] == "degraded" and by["shm"]["bytesFellBack"] == 4096
