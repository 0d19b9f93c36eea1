"""The pods of a vLLM PDDeployment run vLLM's OpenAI server with Daybreak's KV connector, role by role."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.connectors.blocks import DISCOVERY_TIMEOUT_SECONDS, PoolSettings
from daybreak.operator import deployment as pdd_mod
from daybreak.pool.engine_secret import credential_secret_name

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 1})
    return dict(body)


def _built() -> pdd_mod.DeploymentChildren:
    pdd = PDDeployment.from_body(_load("pddeployment-vllm.yaml"))
    pool_body = _load("kvpool-minimal.yaml")
    pool_body["metadata"]["name"] = pdd.spec.pool_ref.name  # the pool the deployment refers to
    return pdd_mod.build(pdd, KVPool.from_body(pool_body), image="example.test/daybreak:1")


def _pods() -> dict[Role, dict[str, Any]]:
    return {role: m["spec"]["template"]["spec"]
            for role, m in _built().applied if m["kind"] == "Deployment" and role in pdd_mod.ENGINE_ROLES}


def _containers() -> dict[Role, dict[str, Any]]:
    return {role: pod["containers"][0] for role, pod in _pods().items()}


def test_vllm_pods_load_daybreaks_connector_with_a_role_each_and_the_users_args_last() -> None:
    containers = _containers()
    for role, kv_role in ((Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")):
        command = containers[role]["command"]
        assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert command[command.index("--model") + 1] == "meta-llama/Llama-3.1-70B-Instruct"
        assert command[command.index("--revision") + 1] == "1605565b47bb9346c5515c34102e054115b4f98b"
        assert command[command.index("--port") + 1] == "8000"
        # Its own address, as the sim engine: two engines on one host must not share 0.0.0.0:8000.
        assert command[command.index("--host") + 1] == "$(POD_IP)"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in containers[role]["env"]
        assert command[command.index("--block-size") + 1] == "64"  # kvLayout.blockTokens
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "DaybreakConnector", "kv_connector_module_path": "daybreak.connectors.vllm",
                          "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {}}
        assert command[-6:] == ["--tensor-parallel-size", "4", "--max-model-len", "32768", "--max-num-seqs", "256"]
        assert not any("token" in part.lower() for part in command)  # the secret stays in the environment


def test_the_connector_finds_the_pool_through_the_kvpool_named_in_the_pods_environment() -> None:
    container = _containers()[Role.DECODE]
    env = {e["name"]: e for e in container["env"]}
    # The agent-minted kvNamespace credential (docs/security.md), not the pool's token Secret.
    assert env["DAYBREAK_POOL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == credential_secret_name(
        _load("pddeployment-vllm.yaml")["metadata"]["name"], env["DAYBREAK_KV_NAMESPACE"]["value"])
    assert env["DAYBREAK_POOL_REF"]["value"] == "ns1/kv-production"
    # What the kubelet would hand the process: plain values, the Secret resolved.
    resolved = {name: e.get("value", "s3cret") for name, e in env.items()}
    asked: list[tuple[str, float]] = []

    def discover(pool_ref: str, /, *, timeout_seconds: float, kubeconfig: str | None) -> list[str]:
        # The API read itself runs against a real apiserver in tests/connectors/test_connector_discovery.py.
        asked.append((pool_ref, timeout_seconds))
        return ["10.0.0.7:7400", "10.0.0.8:7400"]

    settings = PoolSettings.resolve({}, resolved, discover=discover)
    assert asked == [("ns1/kv-production", DISCOVERY_TIMEOUT_SECONDS)]
    assert settings.endpoints == ("10.0.0.7:7400", "10.0.0.8:7400") and settings.pool_ref == "ns1/kv-production"
    assert settings.token == "s3cret"
    assert settings.namespace == PDDeployment.from_body(_load("pddeployment-vllm.yaml")).spec.kv_namespace()
    assert settings.layout is not None and settings.layout.block_tokens == 64 and settings.layout.num_layers == 80
    # A user who blanks DAYBREAK_POOL_REF in engine.env gets the agents' Service name (cluster DNS).
    by_dns = PoolSettings.resolve({}, {**resolved, "DAYBREAK_POOL_REF": ""}, discover=discover)
    assert by_dns.endpoints == ("kv-production-agents.ns1.svc:7400",) and by_dns.pool_ref == ""
    assert len(asked) == 1


def test_the_engine_pods_may_read_exactly_the_pool_they_are_given() -> None:
    built = _built()
    pods = _pods()
    accounts = {pod["serviceAccountName"] for pod in pods.values()}
    (role,) = [m for m in built.access if m["kind"] == "Role"]
    (binding,) = [m for m in built.access if m["kind"] == "RoleBinding"]
    assert accounts == {role["metadata"]["name"]} == {s["name"] for s in binding["subjects"]}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"apiGroups": ["daybreak.dev"], "resources": ["kvpools"], "resourceNames": ["kv-production"],
            "verbs": ["get"]} in role["rules"]
