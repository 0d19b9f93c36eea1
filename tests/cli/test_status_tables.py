"""The pure parts of `daybreak status`: health words, metrics parsing, tables that fit 100 columns."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from prometheus_client import generate_latest

from daybreak.agent.store.metrics import StoreMetrics
from daybreak.api.kube import Condition
from daybreak.api.kvpool import KVPool
from daybreak.api.node import KVNode
from daybreak.api.pddeployment import PDDeployment
from daybreak.status import (
    AgentMetrics,
    PoolView,
    Snapshot,
    _ranges,
    _short_reason,
    age,
    health,
    human_bytes,
    parse_metrics,
    render_json,
    render_table,
    table,
)

NOW = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
LONG = "a-very-long-namespace-name-that-goes-on"


def _cond(kind: str, status: str, reason: str = "R", message: str = "") -> Condition:
    return Condition.model_validate({"type": kind, "status": status, "reason": reason, "message": message})


def _pool(name: str, *, namespace: str = "default", status: dict[str, Any] | None = None) -> KVPool:
    return KVPool.from_body({"metadata": {"name": name, "namespace": namespace},
                             "spec": {"tiers": {"dram": {"bytesPerNode": "64Gi"}, "hbm": {"bytesPerDevice": "8Gi"}}},
                             "status": status or {}})


def _node(name: str) -> KVNode:
    accs = [{"id": f"GPU{i}", "vendor": "sunrise", "model": "S2", "memoryBytes": 64 << 30} for i in range(8)]
    nics = [{"id": f"NIC{i}", "name": f"mlx5_{i}", "active": True, "linkLayer": "InfiniBand"} for i in range(2)]
    return KVNode.from_body({
        "metadata": {"name": name}, "spec": {"nodeName": name},
        "status": {"accelerator": "sunrise", "runtime": "sunrise", "linkDomain": "rack-7-domain-with-long-name",
                   "accelerators": accs, "nics": nics,
                   "links": [{"a": "GPU0", "b": "GPU1", "link": "SL4"}, {"a": "GPU0", "b": "NIC0", "link": "PIX"}],
                   "nicRank": {f"GPU{i}": [f"NIC{i // 4}", f"NIC{1 - i // 4}"] for i in range(8)},
                   "gdr": {f"GPU{i}": [f"NIC{i // 4}"] for i in range(6)},
                   "rdma": {"available": True, "nics": ["mlx5_0", "mlx5_1"]},
                   "transports": ["shm", "link", "rdma", "tcp"], "heartbeatTime": "2026-12-01T09:59:48Z",
                   "conditions": [{"type": "Ready", "status": "True", "reason": "TopologyPublished"}]},
    })


def test_health_prefers_degraded_then_ready() -> None:
    assert health([]) == "Unknown"
    assert health([_cond("Ready", "True")]) == "Ready"
    assert health([_cond("Ready", "True"), _cond("Degraded", "True")]) == "Degraded"
    assert health([_cond("Ready", "False"), _cond("Progressing", "True")]) == "Progressing"
    assert health([_cond("Ready", "False")]) == "NotReady"


def test_small_formatters() -> None:
    assert [human_bytes(v) for v in (0, 1023, 1536, 64 << 30, 3 << 40)] == ["0 B", "1023 B", "1.5 KiB", "64.0 GiB",
                                                                             "3.0 TiB"]
    assert age("2026-12-01T09:59:48Z", NOW) == "12s" and age(datetime(2026, 11, 29, tzinfo=UTC), NOW) == "2d"
    assert age(None, NOW) == "-" and age("yesterday", NOW) == "?"
    assert _ranges(["GPU0", "GPU1", "GPU2", "GPU5", "NIC0"]) == "GPU0-2,GPU5,NIC0"


def test_metrics_from_a_real_store_registry_are_summed_per_tier() -> None:
    metrics = StoreMetrics()
    metrics.hits.labels(tier="dram").inc(6)
    metrics.hits.labels(tier="ssd").inc(2)
    metrics.misses.inc(2)
    metrics.bytes_out.labels(tier="dram").inc(1 << 20)
    agent = AgentMetrics(node="n1", endpoint="10.0.0.1:9401")
    parse_metrics(generate_latest(metrics.registry).decode(), agent)
    assert agent.hits == {"dram": 6.0, "ssd": 2.0} and agent.misses == 2.0
    assert agent.hit_rate() == 0.8 and agent.bytes_out == {"dram": float(1 << 20)}
    view = PoolView(pool=_pool("p"), metrics_port=9401,
                    agents=[agent, AgentMetrics(node="n2", endpoint="x:1", error="connection refused")])
    assert view.hit_rate() == 0.8 and view.tier_hit_rate("ssd") == 0.2  # the unreachable agent is left out


def test_the_os_reason_is_found_under_the_wrapping_exception() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise RuntimeError("All connection attempts failed") from inner
    except RuntimeError as outer:
        assert _short_reason(outer) == "connection refused"
    assert _short_reason(ValueError("first line\nsecond")) == "first line"


def test_every_line_fits_100_columns_even_with_long_names_and_messages() -> None:
    message = "agent pods on nodes " + ", ".join(f"gpu-node-{i}" for i in range(30)) + " are not ready"
    pool = _pool(f"pool-with-a-rather-long-name-{'x' * 30}", namespace=LONG, status={
        "conditions": [{"type": "Ready", "status": "False", "reason": "AgentsNotReady", "message": message}],
        "nodes": {"desired": 32, "ready": 2}, "capacity": {"dram": 2 << 40, "hbm": 1 << 40},
        "used": {"dram": 1 << 40},
        "endpoints": [{"node": "gpu-node-0", "address": "10.1.2.3", "port": 7400, "transports": ["rdma", "tcp"]}]})
    agents = [AgentMetrics(node="gpu-node-0", endpoint="10.1.2.3:9401", hits={"dram": 3}, misses=1),
              AgentMetrics(node="gpu-node-1-with-a-long-hostname.example.internal", endpoint="10.1.2.4:9401",
                           error="timed out after 2 s")]
    deployment = PDDeployment.from_body({
        "metadata": {"name": "chat-" + "y" * 40, "namespace": LONG},
        "spec": {"poolRef": {"name": pool.metadata.name},
                 "model": {"name": "m", "revision": "r", "kvLayout": {"numLayers": 1, "numKVHeads": 1, "headDim": 8}},
                 "engine": {"kind": "sim"}},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "RolesReady"}],
                   "kvNamespace": "kv-" + "f" * 120}})
    snap = Snapshot(server="https://10.0.0.1:6443", namespace=None, now=NOW,
                    pools=[PoolView(pool=pool, metrics_port=9401, agents=agents)], deployments=[deployment],
                    nodes=[_node("gpu-node-0"), _node("n" * 90)], notes=["listing kvnodes: 403 Forbidden " * 6])
    out = render_table(snap)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert "metrics unreachable: timed out after 2 s" in out
    assert "nearest NIC: GPU0-3 -> NIC0(mlx5_0); GPU4-7 -> NIC1(mlx5_1)" in out
    assert "GDR: GPU0-3 via NIC0; GPU4-5 via NIC1" in out
    assert any(line.split()[:5] == ["gpu-node-0", "8x", "sunrise", "sunrise", "2"] and "6/8" in line
               and "shm,link,rdma,tcp" in line for line in lines), out
    assert "Ready=False AgentsNotReady: agent pods on nodes gpu-node-0" in out  # wrapped, not cut
    assert "are not ready" in out
    data = json.loads(render_json(snap))
    assert data["pools"][0]["hitRate"] == 0.75 and data["pools"][0]["agents"][1]["error"] == "timed out after 2 s"
    assert data["nodes"][0]["gdr"]["GPU7"] == [] and data["namespace"] is None


def test_table_clips_the_widest_column_first() -> None:
    lines = table(["A", "B"], [["short", "z" * 200]], width=40)
    assert all(len(line) <= 40 for line in lines) and lines[1].startswith("short  zzz") and lines[1].endswith("...")


def test_agent_metrics_carry_store_bytes_per_transport_and_the_engines_fallback_bytes() -> None:
    """What an agent's /metrics serves (its store's registry plus the process-wide one) reaches the table."""
    from daybreak.agent.main import AgentRegistry
    from daybreak.agent.transfer import metrics as transfer_metrics

    store = StoreMetrics()
    store.moved("shm", "read", 3 << 20)
    store.moved("tcp", "write", 1 << 20)
    before = transfer_metrics.FALLBACK_BYTES.labels(preferred="rdma", used="tcp")._value.get()
    transfer_metrics.FALLBACK_BYTES.labels(preferred="rdma", used="tcp").inc(4096)
    agent = AgentMetrics(node="n1", endpoint="10.0.0.1:9401")
    parse_metrics(generate_latest(AgentRegistry(store.registry)).decode(), agent)  # type: ignore[arg-type]
    assert agent.transfer_bytes == {"shm": float(3 << 20), "tcp": float(1 << 20)}
    assert agent.fallback_bytes["rdma->tcp"] == before + 4096
    view = PoolView(pool=_pool("p"), metrics_port=9401, agents=[agent])
    text = render_table(Snapshot(server="https://127.0.0.1:6443", namespace=None, now=NOW, pools=[view]))
    assert "rdma->tcp (fallback)" in text and "3.0 MiB" in text
