"""The KVPool-to-agent contract: the operator renders exactly the agent's config model, nothing filtered.

Every KVPool in examples/ (and the one in the chart's NOTES) is built by the operator under the chart's
default pool policy; the ConfigMap's agent.yaml is then loaded by the agent's own loader, from a file, as
the DaemonSet's agent does. A key the agent does not know fails the render, naming the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.agentconfig import AgentConfig
from daybreak.api.kvpool import KVPool
from daybreak.operator import pool as pool_mod
from daybreak.operator.pool_policy import PoolPolicy

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "daybreak:test"


def _chart_policy() -> PoolPolicy:
    """The chart's default pool policy, as its ConfigMap hands it to the operator."""
    values = yaml.safe_load((ROOT / "charts/daybreak/values.yaml").read_text())["poolPolicy"]
    data = {k: ",".join(v) if isinstance(v, list) else str(v) for k, v in values.items()
            if k not in ("admission", "deniedNamespaces")}
    return PoolPolicy.from_data(data)


def _example_pools() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVPool":
                out.append((f"{path.name}:{doc['metadata']['name']}", doc))
    notes = (ROOT / "charts/daybreak/templates/NOTES.txt").read_text()
    block = re.search(r"^( +)kind: KVPool\n((?:\1.*\n)+?)\s*POOL", notes, re.M)
    assert block, "the chart's NOTES no longer show a KVPool: update this test"
    indent = len(block.group(1))
    text = "kind: KVPool\n" + "".join(line[indent:] + "\n" for line in block.group(2).splitlines())
    out.append(("NOTES.txt", {"apiVersion": "daybreak.dev/v1alpha1", **yaml.safe_load(text)}))
    return out


EXAMPLES = _example_pools()


def _pool(body: dict[str, Any]) -> KVPool:
    body = {**body, "metadata": {"namespace": "ns1", "uid": "0f0e0d0c-uid", **body["metadata"]}}
    return KVPool.from_body(body)


@pytest.mark.parametrize(("where", "body"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_example_pool_renders_a_config_the_agent_loads_unchanged(where: str, body: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    pool = _pool(body)
    (cm,) = [m for m in pool_mod.build(pool, image=IMAGE, policy=_chart_policy()).applied
             if m["kind"] == "ConfigMap"]
    rendered = yaml.safe_load(cm["data"][pool_mod.AGENT_CONFIG_FILE])
    config_file = tmp_path / pool_mod.AGENT_CONFIG_FILE
    config_file.write_text(cm["data"][pool_mod.AGENT_CONFIG_FILE])
    settings = AgentSettings.load(config_file=str(config_file), environ={})
    # Every rendered key is a field the agent has, and it reads back the value the operator wrote.
    loaded = settings.model_dump(mode="json")
    assert {k: loaded[k] for k in rendered} == rendered
    assert settings.transports == [t.value for t in pool.spec.transport.preference]
    assert settings.pool_name == pool.metadata.name and settings.listen == f"0.0.0.0:{pool.spec.agent.port}"


def test_the_transport_preference_reaches_the_agents_transfer_engine(tmp_path: Path) -> None:
    body = dict(next(b for w, b in EXAMPLES if w.startswith("kvpool-minimal")))
    body["spec"] = {**body["spec"], "transport": {"preference": ["tcp"]}}
    pool = _pool(body)
    rendered = pool_mod.config_data(pool)[pool_mod.AGENT_CONFIG_FILE]
    assert yaml.safe_load(rendered)["transports"] == ["tcp"]
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(rendered)
    settings = AgentSettings.load(config_file=str(config_file), environ={})
    from daybreak.agent.transfer.config import EngineConfig
    from daybreak.agent.transfer.engine import TransferEngine

    local = settings.model_copy(update={"listen": "127.0.0.1:0"})
    engine = TransferEngine.from_config(EngineConfig.for_agent(local, token="t"))
    assert engine._wanted == ("tcp",)


def test_a_key_the_agent_does_not_know_fails_the_render_naming_it() -> None:
    pool = _pool(next(b for w, b in EXAMPLES if w.startswith("kvpool-minimal")))
    written = pool_mod.agent_settings(pool)
    with pytest.raises(pool_mod.AgentConfigError) as caught:
        pool_mod.render_agent_config(pool, {**written, "huge_pages": True})
    assert caught.value.fields == ["huge_pages"]
    assert "huge_pages: Extra inputs are not permitted" in str(caught.value)
    assert "ns1/kv-minimal" in str(caught.value)


def test_a_value_the_agent_would_refuse_fails_the_render_naming_the_field() -> None:
    pool = _pool(next(b for w, b in EXAMPLES if w.startswith("kvpool-minimal")))
    with pytest.raises(pool_mod.AgentConfigError) as caught:
        pool_mod.render_agent_config(pool, {**pool_mod.agent_settings(pool), "transports": ["carrier-pigeon"]})
    assert caught.value.fields == ["transports.0"]


def test_the_agent_refuses_a_config_file_with_a_key_it_does_not_know(tmp_path: Path) -> None:
    config_file = tmp_path / "agent.yaml"
    config_file.write_text("pool_name: p\nhuge_pages: true\n")
    with pytest.raises(ValueError, match="huge_pages"):
        AgentSettings.load(config_file=str(config_file), environ={})


def test_the_agent_settings_are_the_shared_config_model() -> None:
    assert issubclass(AgentSettings, AgentConfig)
    assert AgentSettings.model_fields.keys() == AgentConfig.model_fields.keys()
