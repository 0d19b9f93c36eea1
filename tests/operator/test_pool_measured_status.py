"""KVPool status reports what the agents measured (their KVNodes), not the spec; agents get the spec's transports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.kvpool import KVPool
from daybreak.operator import pool as pool_mod

ROOT = Path(__file__).resolve().parents[2]


def _pool(**spec: Any) -> KVPool:
    body = yaml.safe_load((ROOT / "examples" / "kvpool-minimal.yaml").read_text())
    body["metadata"]["namespace"] = "ns1"
    body["spec"].update(spec)
    return KVPool.from_body(body)


def _ready_pod(node: str, ip: str) -> dict[str, Any]:
    return {"metadata": {"name": f"a-{node}"}, "spec": {"nodeName": node},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def _kvnode(node: str, *, transports: list[str], moved: dict[str, int]) -> dict[str, Any]:
    return {"metadata": {"name": node}, "spec": {"nodeName": node},
            "status": {"capacity": {"dram": 1 << 20}, "used": {}, "transports": transports,
                       "transfer": [{"transport": t, "state": "works", "bytesUsed": n, "storeBytes": 100}
                                    for t, n in moved.items()]}}


def test_endpoint_transports_and_bytes_come_from_the_agents_reports() -> None:
    pool = _pool(transport={"preference": ["shm", "link", "tcp"]})
    # n0's agent brought up shm and tcp (no accelerator: link stayed off); n1 has not reported yet.
    report = pool_mod.AgentReport.from_kvnode(_kvnode("n0", transports=["shm", "tcp"],
                                                      moved={"shm": 4096, "tcp": 512}))
    assert report is not None
    st = pool_mod.status(pool, daemonset={"status": {"desiredNumberScheduled": 2}},
                         pods=[_ready_pod("n0", "10.0.0.1"), _ready_pod("n1", "10.0.0.2")], reports=[report],
                         existing=None, generation=1)
    by_node = {e["node"]: e for e in st["endpoints"]}
    assert by_node["n0"]["transports"] == ["shm", "tcp"]  # not the spec's shm, link, tcp
    assert by_node["n0"]["bytesMoved"] == {"shm": 4096 + 100, "tcp": 512 + 100}  # the engine's and the store's
    assert by_node["n1"]["transports"] == [] and by_node["n1"]["bytesMoved"] == {}
    parsed = KVPool.from_body({**pool.to_dict(), "status": st})  # the status the schema accepts
    assert [t.value for t in parsed.status.endpoints[0].transports] == ["shm", "tcp"]


def test_the_agent_config_carries_the_pools_transport_preference() -> None:
    values = pool_mod.agent_settings(_pool(transport={"preference": ["tcp"]}))
    assert AgentSettings.model_validate(values).transports == ["tcp"]


def test_agent_settings_refuse_an_unknown_transport_naming_the_field() -> None:
    try:
        AgentSettings(transports=["tcp", "pigeon"])
    except ValueError as exc:
        assert "transports" in str(exc) and "pigeon" in str(exc)
    else:
        raise AssertionError("an unknown transport was accepted")


def test_no_huge_pages_path_remains_in_the_agent_pod() -> None:
    (ds,) = [m for m in pool_mod.build(_pool(), image="img").applied if m["kind"] == "DaemonSet"]
    volumes = ds["spec"]["template"]["spec"]["volumes"]
    assert not any((v.get("hostPath") or {}).get("path") == "/dev/hugepages" for v in volumes)


def test_the_client_knows_the_apis_transport_names() -> None:
    from daybreak.api.kvpool import Transport
    from daybreak.client.datapath import TRANSPORTS

    assert set(TRANSPORTS) == {t.value for t in Transport}
