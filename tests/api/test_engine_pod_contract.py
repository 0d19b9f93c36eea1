"""The engine-pod contract: the env the operator renders parses in every reader to the same values.

The operator builds the example sim and vLLM PDDeployments (their real Deployments, as applied); each
container's env is resolved the way the kubelet does (downward-API fields, the credential Secret) and
handed to the sim engine's, the router's and the vLLM connector's own loaders.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.api.enginepod import (
    ENV_PREFIX,
    ENV_VARS,
    EnginePodEnv,
    EnginePodEnvError,
    max_num_seqs,
    vllm_kv_transfer_config,
)
from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.client.env import POOL_TLS_CA_ENV
from daybreak.connectors.blocks import PoolSettings
from daybreak.operator import deployment as dep
from daybreak.serving import router as router_cli
from daybreak.serving import sim
from daybreak.testing.vllm_server import daybreak_transfer_config

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "daybreak:test"
TOKEN = "ns-credential-0123456789"
POD = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0", "metadata.namespace": "ns1",
       "spec.nodeName": "node-a"}


def _example(name: str, kind: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((ROOT / "examples" / name).read_text()):
        if doc and doc.get("kind") == kind:
            return doc
    raise AssertionError(f"no {kind} in examples/{name}")


def _objects(pdd_file: str, pool_file: str) -> tuple[PDDeployment, KVPool]:
    pdd_body = _example(pdd_file, "PDDeployment")
    pool_body = _example(pool_file, "KVPool")
    pdd_body["metadata"] = {**pdd_body["metadata"], "namespace": "ns1", "uid": "u-pdd"}
    pool_body["metadata"] = {**pool_body["metadata"], "namespace": "ns1", "uid": "u-pool"}
    return PDDeployment.from_body(pdd_body), KVPool.from_body(pool_body)


def _containers(pdd: PDDeployment, pool: KVPool) -> dict[str, dict[str, Any]]:
    """The first container of each built workload, by role."""
    out = {}
    for role, manifest in dep.build(pdd, pool, image=IMAGE).applied:
        if manifest["kind"] == "Deployment":
            out[role.value] = manifest["spec"]["template"]["spec"]["containers"][0]
    return out


def _kubelet_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the process sees it: fieldRefs from the pod, the credential from its Secret."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = POD[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert entry["valueFrom"]["secretKeyRef"]["key"] == "token"
            env[entry["name"]] = TOKEN
    return env


CASES = [("pddeployment-sim.yaml", "kvpool-minimal.yaml"), ("pddeployment-vllm.yaml", "kvpool-production.yaml")]


@pytest.mark.parametrize(("pdd_file", "pool_file"), CASES)
def test_the_operator_writes_only_contract_variables_and_each_one_round_trips(pdd_file: str, pool_file: str) -> None:
    pdd, pool = _objects(pdd_file, pool_file)
    for role, container in _containers(pdd, pool).items():
        env = _kubelet_env(container)
        written = {name for name in env if name.startswith(ENV_PREFIX)}
        assert written <= set(ENV_VARS), (role, written - set(ENV_VARS))
        parsed = EnginePodEnv.from_env(env)
        assert parsed == dep.engine_pod_env(pdd, pool, dep.Role(role)).model_copy(update={"pool_token": TOKEN})
        # What the operator renders is exactly what a reader parses back: nothing written is lost.
        rendered = {e["name"]: e.get("value") for e in parsed.to_env()}
        assert rendered == {k: v for k, v in env.items() if k in written and k != "DAYBREAK_POOL_TOKEN"}


def test_the_sim_engine_the_router_and_the_connector_read_the_same_pool_from_the_sim_pods_env() -> None:
    pdd, pool = _objects("pddeployment-sim.yaml", "kvpool-minimal.yaml")
    containers = _containers(pdd, pool)
    prefill = _kubelet_env(containers["prefill"])
    layout = pdd.spec.model.kv_layout
    # The sim engine, with none of its flags given (the command's flags are checked against the env below).
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    settings = sim.settings_from(parser.parse_args([]), env=prefill)
    assert settings.pool_ref == "ns1/kv-minimal" and settings.token == TOKEN
    assert settings.kv_namespace == pdd.spec.kv_namespace() and settings.role.value == "prefill"
    assert settings.layout == layout and settings.block_bytes == layout.bytes_per_block
    assert settings.model == pdd.spec.model.name and settings.port == dep.ENGINE_PORT
    assert settings.transports == tuple(t.value for t in pool.spec.transport.preference)
    command = containers["prefill"]["command"]
    assert command[command.index("--pool-ref") + 1] == settings.pool_ref
    # The vLLM connector's loader on the same env.
    asked: list[str] = []

    def discover(ref: str, *, timeout_seconds: float, kubeconfig: str = "") -> list[str]:
        asked.append(ref)
        return ["10.0.1.1:7400"]

    connector = PoolSettings.resolve({}, prefill, discover=discover)
    assert asked == [settings.pool_ref] and connector.pool_ref == settings.pool_ref
    assert connector.token == settings.token and connector.namespace == settings.kv_namespace
    assert connector.layout == settings.layout and connector.transports == settings.transports
    # The router, on its own pod's env: the same pool, credential and layout; no kvNamespace of its own.
    router_env = _kubelet_env(containers["router"])
    args = router_cli.with_pod_env(_router_args(), env=router_env)
    assert args.pool_ref == settings.pool_ref and args.token == settings.token and args.kv_namespace is None
    assert router_cli.block_tokens_of(args.kv_layout) == layout.block_tokens


def test_the_vllm_pods_env_and_transfer_config_reach_the_connector() -> None:
    pdd, pool = _objects("pddeployment-vllm.yaml", "kvpool-production.yaml")
    containers = _containers(pdd, pool)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        command = containers[role]["command"]
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config == vllm_kv_transfer_config(kv_role=kv_role)
        assert config["kv_connector_extra_config"] == {}  # everything else from the env, no credential in argv
        env = _kubelet_env(containers[role])
        connector = PoolSettings.resolve(config["kv_connector_extra_config"], env,
                                         discover=lambda ref, **_: ["10.0.1.1:7400"])
        assert connector.pool_ref == "ns1/kv-production" and connector.token == TOKEN
        assert connector.namespace == pdd.spec.kv_namespace() and connector.layout == pdd.spec.model.kv_layout
        assert connector.transports == ("rdma", "link", "shm", "tcp") and connector.client_transport == "auto"


def test_the_local_harness_builds_its_transfer_config_with_the_same_builder(tmp_path: Path) -> None:
    local = daybreak_transfer_config(role="kv_both", endpoints=["127.0.0.1:1"], token_file=tmp_path / "t",
                                     namespace="ns")
    shared = vllm_kv_transfer_config(kv_role="kv_both", load_failure_policy=None, extra={
        "endpoints": ["127.0.0.1:1"], "token_file": str(tmp_path / "t"), "namespace": "ns"})
    assert local == shared


def _router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_credential_precedence_in_every_reader(tmp_path: Path) -> None:
    """A file wins over a token in the same source; a credential given to the process replaces the env's."""
    env_file, flag_file = tmp_path / "env-token", tmp_path / "flag-token"
    env_file.write_text("from-env-file\n")
    flag_file.write_text("from-flag-file\n")
    env = {"DAYBREAK_POOL_TOKEN": "from-env", "DAYBREAK_POOL_TOKEN_FILE": str(env_file),
           "DAYBREAK_POOL_ENDPOINTS": "127.0.0.1:7400", "DAYBREAK_KV_NAMESPACE": "ns"}
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    assert sim.settings_from(parser.parse_args([]), env=env).token == "from-env-file"
    assert router_cli.with_pod_env(_router_args(), env=env).token == "from-env-file"
    assert PoolSettings.resolve({}, env).token == "from-env-file"
    # Given to the process: the flag's (or extra config's) pair replaces the env's, its file still winning.
    assert sim.settings_from(parser.parse_args(["--token", "from-flag"]), env=env).token == "from-flag"
    assert sim.settings_from(parser.parse_args(["--token", "x", "--token-file", str(flag_file)]),
                             env=env).token == "from-flag-file"
    assert router_cli.with_pod_env(_router_args("--token", "from-flag"), env=env).token == "from-flag"
    assert router_cli.with_pod_env(_router_args("--token", "x", "--token-file", str(flag_file)),
                                   env=env).token == "from-flag-file"
    assert PoolSettings.resolve({"token": "from-flag"}, env).token == "from-flag"
    assert PoolSettings.resolve({"token": "x", "token_file": str(flag_file)}, env).token == "from-flag-file"


def test_the_clients_ca_variable_is_the_contracts() -> None:
    assert POOL_TLS_CA_ENV == EnginePodEnv.env_name("pool_tls_ca_file")


def test_a_bad_contract_variable_is_refused_naming_it() -> None:
    with pytest.raises(EnginePodEnvError, match=r"\$DAYBREAK_KV_LAYOUT"):
        EnginePodEnv.from_env({"DAYBREAK_KV_LAYOUT": "{not json"})
    with pytest.raises(EnginePodEnvError, match=r"\$DAYBREAK_TRANSPORTS"):
        EnginePodEnv.from_env({"DAYBREAK_TRANSPORTS": "tcp,carrier-pigeon"})
    with pytest.raises(EnginePodEnvError, match=r"\$DAYBREAK_POOL_REF"):
        EnginePodEnv.from_env({"DAYBREAK_POOL_REF": "no-slash"})
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    with pytest.raises(ValueError, match=r"\$DAYBREAK_ENGINE_PORT"):
        sim.settings_from(parser.parse_args([]), env={"DAYBREAK_ENGINE_PORT": "http"})


def test_a_pool_without_shm_keeps_engines_off_shared_memory() -> None:
    pdd, pool = _objects("pddeployment-sim.yaml", "kvpool-minimal.yaml")
    pool = pool.model_copy(update={"spec": pool.spec.model_copy(update={
        "transport": pool.spec.transport.model_copy(update={"preference": [dep.Transport.TCP]})})})
    env = _kubelet_env(_containers(pdd, pool)["decode"])
    assert env["DAYBREAK_TRANSPORTS"] == "tcp"
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    assert sim.settings_from(parser.parse_args([]), env=env).client_transport == "tcp"
    assert PoolSettings.resolve({}, env, discover=lambda ref, **_: ["10.0.1.1:7400"]).client_transport == "tcp"


@pytest.mark.parametrize("args", [["--max-num-seqs", "6"], ["--max-num-seqs=6"], ["--max-batch", "6"],
                                  ["--max-num-seqs", "2", "--time-scale", "2", "--max-num-seqs", "6"]])
def test_the_planner_reads_the_batch_cap_the_sim_engine_runs_with(args: list[str]) -> None:
    # The planner's decode cap comes from engine.args (vLLM's flag); the sim engine must run with that cap.
    pdd, _ = _objects("pddeployment-sim.yaml", "kvpool-minimal.yaml")
    pdd = pdd.model_copy(update={"spec": pdd.spec.model_copy(update={
        "engine": pdd.spec.engine.model_copy(update={"args": args})})})
    command = dep.engine_command(pdd, Role.DECODE)
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    engine = parser.parse_args(command[2:]).max_batch
    assert max_num_seqs(pdd.spec.engine.args) == engine == 6


@pytest.mark.parametrize("args", [[], ["--max-num-seqs"], ["--max-num-seqs", "many"], ["--max-num-seqs=0"],
                                  ["--max-num-batched-tokens", "4"], ["--max-num-seqs", "4", "--max-num-seqs=x"]])
def test_no_cap_is_read_from_args_that_do_not_set_one(args: list[str]) -> None:
    assert max_num_seqs(args) is None
