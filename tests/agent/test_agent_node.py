"""NodeAgent without a cluster: discovery with the Sunrise test libraries, segment registration bookkeeping,
capacity, and a publish loop that survives an unreachable API server and stops cleanly."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path

import pytest
from sunrise_lib.build import build, node

from daybreak.agent.node import NodeAgent, run_node_agent
from daybreak.agent.registration import Segment
from daybreak.agent.settings import AgentSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
BUSES = ["0000:03:00.0", "0000:04:00.0", "0000:12:00.0", "0000:13:00.0"]


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("sunrise-lib"))


def test_start_registers_and_tracks_segments(libdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYBREAK_FAKE_SUNRISE", node(BUSES, links=[[0, 0, 1, 0]], memory_bytes=8 << 30))
    segments = [Segment(name="dram-0", address=0x1000, length=4096)]
    settings = AgentSettings(sysfs_root=FIXTURES / "box4", sunrise_lib_dir=str(libdir), hbm_bytes=1 << 30,
                             dram_bytes=3 << 30)
    agent = NodeAgent(settings, store_segments=lambda: segments)

    async def scenario() -> None:
        await agent.start()
        assert agent.loaded is not None and agent.loaded.name == "sunrise"
        assert agent.topology is not None and agent.topology.link("GPU0", "GPU1") == "SL1"
        # no pyverbs here: the registrar says why and nothing is registered, but the segment is tracked
        assert not agent.registrar.rdma and agent.registrar.status.startswith("rdma unavailable: ")
        assert set(agent.registrar.problems) == {"dram-0"}
        assert agent.capacity() == {"dram": 3 << 30, "ssd": 0, "hbm": 4 << 30}
        segments[:] = [Segment(name="dram-1", address=0x2000, length=4096)]
        await agent.sync_segments()
        assert set(agent.registrar.problems) == {"dram-1"}  # dram-0 was dropped
        await agent.refresh()
        await agent.close()

    asyncio.run(scenario())


def test_publish_loop_survives_an_unreachable_apiserver(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    settings = AgentSettings(node_name="node-a", kubeconfig=str(kubeconfig), sysfs_root=FIXTURES / "nonic",
                             runtime="host")

    async def scenario() -> None:
        stop = asyncio.Event()

        class StopOnFailure(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "publish failed" in record.getMessage():
                    stop.set()

        handler = StopOnFailure()
        logging.getLogger("daybreak.agent.node").addHandler(handler)
        try:
            await asyncio.wait_for(run_node_agent(settings, stop=stop), timeout=120)
        finally:
            logging.getLogger("daybreak.agent.node").removeHandler(handler)

    caplog.set_level(logging.INFO)
    asyncio.run(scenario())
    assert any("node=node-a publish failed" in r.getMessage() for r in caplog.records)


def test_cluster_mode_needs_the_node_name() -> None:
    with pytest.raises(ValueError, match="node_name"):
        asyncio.run(run_node_agent(AgentSettings()))
