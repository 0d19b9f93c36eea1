"""The KVPool examples, rendered by the operator's builders, give the agent the memory its DRAM tier takes.

docs/security.md's accounting: the agent backs its whole DRAM tier in /dev/shm as it starts
(docs/performance.md: peak RSS is the tier plus about 40 MiB) and those pages are charged to its
container. So an agent memory limit below the tier plus the agent's own memory gets the agent OOM-killed
as it starts, and a memory request below the tier lets the scheduler place it on a node where the tier
does not fit. An example copied into a cluster must not do either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.kvpool import KVPool
from daybreak.api.quantity import parse_bytes
from daybreak.operator import pool as pool_mod

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# What the agent needs above its tier: about 40 MiB idle, more with connections and serving threads.
AGENT_OWN_BYTES = 1 << 30


def _pools() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVPool":
                out.append((path.name, doc))
    return out


def _rendered(body: dict[str, Any]) -> tuple[AgentSettings, dict[str, Any]]:
    """The agent's settings file and its container, as the operator builds them from ``body``."""
    body = {**body, "metadata": {**body["metadata"], "namespace": "ns1", "uid": "uid-1", "generation": 1}}
    out = pool_mod.build(KVPool.from_body(body), image="example.test/daybreak:1")
    (cm,) = [m for m in out.applied if m["kind"] == "ConfigMap"]
    (ds,) = [m for m in out.applied if m["kind"] == "DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    return AgentSettings.model_validate(yaml.safe_load(cm["data"][pool_mod.AGENT_CONFIG_FILE])), agent


@pytest.mark.parametrize(("name", "body"), _pools(), ids=[n for n, _ in _pools()])
def test_an_example_pools_agent_memory_covers_its_dram_tier(name: str, body: dict[str, Any]) -> None:
    settings, agent = _rendered(body)
    resources = agent.get("resources") or {}
    limit = (resources.get("limits") or {}).get("memory")
    request = (resources.get("requests") or {}).get("memory")
    if limit is not None:
        assert parse_bytes(limit) >= settings.dram_bytes + AGENT_OWN_BYTES, (name, settings.dram_bytes, limit)
    if request is not None:
        assert parse_bytes(request) >= settings.dram_bytes, (name, settings.dram_bytes, request)


def test_the_production_example_bounds_its_agent_by_a_limit_that_holds_the_tier() -> None:
    """Not vacuous: the production pool sets both, its DRAM tier is on, and the rule above passed for it."""
    (body,) = [b for n, b in _pools() if n == "kvpool-production.yaml"]
    settings, agent = _rendered(body)
    assert settings.dram_bytes == 256 * 2**30
    memory = {kind: parse_bytes(agent["resources"][kind]["memory"]) for kind in ("requests", "limits")}
    assert memory["requests"] == memory["limits"] >= settings.dram_bytes + AGENT_OWN_BYTES, memory
