"""The pods of a vLLM PDDeployment run vLLM's OpenAI server with Daybreak's KV connector, role by role."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.connectors.blocks import PoolSettings
from daybreak.operator import deployment as pdd_mod
from daybreak.pool.engine_secret import credential_secret_name

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 1})
    return dict(body)


def _containers() -> dict[Role, dict[str, Any]]:
    pdd, pool = PDDeployment.from_body(_load("pddeployment-vllm.yaml")), KVPool.from_body(_load("kvpool-minimal.yaml"))
    out = pdd_mod.build(pdd, pool, image="example.test/daybreak:1")
    return {role: m["spec"]["template"]["spec"]["containers"][0]
            for role, m in out.applied if m["kind"] == "Deployment" and role in pdd_mod.ENGINE_ROLES}


def test_vllm_pods_load_daybreaks_connector_with_a_role_each_and_the_users_args_last() -> None:
    containers = _containers()
    for role, kv_role in ((Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")):
        command = containers[role]["command"]
        assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert command[command.index("--model") + 1] == "meta-llama/Llama-3.1-70B-Instruct"
        assert command[command.index("--revision") + 1] == "1605565b47bb9346c5515c34102e054115b4f98b"
        assert command[command.index("--port") + 1] == "8000"
        assert command[command.index("--block-size") + 1] == "64"  # kvLayout.blockTokens
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "DaybreakConnector", "kv_connector_module_path": "daybreak.connectors.vllm",
                          "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {}}
        assert command[-4:] == ["--tensor-parallel-size", "4", "--max-model-len", "32768"]
        assert not any("token" in part.lower() for part in command)  # the secret stays in the environment


def test_the_connector_finds_the_pool_from_the_pods_environment() -> None:
    container = _containers()[Role.DECODE]
    env = {e["name"]: e for e in container["env"]}
    # The agent-minted kvNamespace credential (docs/security.md), not the pool's token Secret.
    assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == credential_secret_name(
        _load("pddeployment-vllm.yaml")["metadata"]["name"], env["DAYBREAK_KV_NAMESPACE"]["value"])
    # What the kubelet would hand the process: plain values, the Secret resolved.
    resolved = {name: e.get("value", "s3cret") for name, e in env.items()}
    settings = PoolSettings.resolve({}, resolved)
    assert settings.endpoints == ("kv-minimal-agents.ns1.svc:7400",)
    assert settings.token == "s3cret"
    assert settings.namespace == PDDeployment.from_body(_load("pddeployment-vllm.yaml")).spec.kv_namespace()
    assert settings.layout is not None and settings.layout.block_tokens == 64 and settings.layout.num_layers == 80
