"""A KVPool's spec.tls: the agents' mounted Secret and TLS settings, the engines' and router's CA-only mount and env."""

from __future__ import annotations

import argparse
import base64
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.client import POOL_TLS_CA_ENV, KVPoolClient, KVPoolError, pool_tls_ca_file
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.pool.tls import TlsSettingsError
from daybreak.serving import sim
from daybreak.testing import e2e
from daybreak.testing.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.test/daybreak:1"
SECRET = "kv-tls"
T = TypeVar("T")


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 1})
    return dict(body)


def _pool(*, tls: bool) -> KVPool:
    body = _load("kvpool-minimal.yaml")
    if tls:
        body["spec"]["tls"] = {"secretName": SECRET}
    return KVPool.from_body(body)


def _pdd() -> PDDeployment:
    return PDDeployment.from_body(_load("pddeployment-sim.yaml"))


def _daemonset(pool: KVPool) -> dict[str, Any]:
    out = pool_mod.build(pool, image=IMAGE)
    return next(m for m in out.applied if m["kind"] == "DaemonSet")


def _settings(pool: KVPool) -> dict[str, Any]:
    out = pool_mod.build(pool, image=IMAGE)
    config = next(m for m in out.applied if m["kind"] == "ConfigMap")
    return dict(yaml.safe_load(config["data"][pool_mod.AGENT_CONFIG_FILE]))


def _serving_pods(pool: KVPool) -> dict[Role, dict[str, Any]]:
    out = pdd_mod.build(_pdd(), pool, image=IMAGE)
    return {role: m["spec"]["template"] for role, m in out.applied if m["kind"] == "Deployment"}


def test_tls_pool_agents_mount_the_secret_read_only_and_serve_tls_with_it() -> None:
    ds = _daemonset(_pool(tls=True))
    pod = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume == {"name": "tls", "secret": {"secretName": SECRET, "items": [
        {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"},
        {"key": "ca.crt", "path": "ca.crt"}]}}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": pool_mod.TLS_DIR, "readOnly": True}
    settings = _settings(_pool(tls=True))
    assert settings["tls_cert_file"] == f"{pool_mod.TLS_DIR}/tls.crt"
    assert settings["tls_key_file"] == f"{pool_mod.TLS_DIR}/tls.key"
    assert settings["tls_ca_file"] == f"{pool_mod.TLS_DIR}/ca.crt"
    # The same settings object the standalone agent reads, so `daybreak agent --config` accepts the file.
    parsed = AgentSettings.model_validate(settings)
    assert (parsed.tls_cert_file, parsed.tls_key_file) == (settings["tls_cert_file"], settings["tls_key_file"])


def test_plain_pool_has_no_tls_volume_and_no_tls_settings() -> None:
    pod = _daemonset(_pool(tls=False))["spec"]["template"]["spec"]
    assert "tls" not in {v["name"] for v in pod["volumes"]}
    settings = _settings(_pool(tls=False))
    assert not any(settings.get(k) for k in ("tls_cert_file", "tls_key_file", "tls_ca_file"))


def test_turning_tls_on_changes_the_config_hash_so_agents_roll() -> None:
    def config_hash(pool: KVPool) -> str:
        return str(_daemonset(pool)["spec"]["template"]["metadata"]["annotations"][pool_mod.CONFIG_HASH_ANNOTATION])

    assert config_hash(_pool(tls=True)) != config_hash(_pool(tls=False))
    body = _load("kvpool-minimal.yaml")
    body["spec"]["tls"] = {"secretName": "other-tls"}
    assert config_hash(KVPool.from_body(body)) != config_hash(_pool(tls=True))


def test_tls_pool_grants_no_secret_read() -> None:
    """Pods mount the Secret; neither the agent's Role nor anything else the pool creates reads Secrets."""
    out = pool_mod.build(_pool(tls=True), image=IMAGE)
    for manifest in out.applied:
        for rule in manifest.get("rules") or []:
            if "secrets" in rule.get("resources", []):
                assert set(rule["verbs"]) == {"create"}, rule


def test_engines_and_router_of_a_tls_pool_get_only_the_ca_and_the_env_pointing_at_it() -> None:
    pods = _serving_pods(_pool(tls=True))
    assert set(pods) == {Role.PREFILL, Role.DECODE, Role.ROUTER}
    for role, template in pods.items():
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "pool-ca"]
        # Only ca.crt is projected: the Secret's private key never reaches an engine or the router.
        assert volume == {"name": "pool-ca", "projected": {"sources": [{"secret": {
            "name": SECRET, "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}, role
        assert not any("secret" in v for v in spec["volumes"]), role
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "pool-ca"]
        assert mount == {"name": "pool-ca", "mountPath": pdd_mod.POOL_CA_DIR, "readOnly": True}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[POOL_TLS_CA_ENV] == f"{pdd_mod.POOL_CA_DIR}/ca.crt", role
    # The engines keep their same-node shared-memory mount next to the CA.
    for role in (Role.PREFILL, Role.DECODE):
        assert {v["name"] for v in pods[role]["spec"]["volumes"]} == {"dev-shm", "pool-ca"}


def test_engines_of_a_plain_pool_get_no_ca() -> None:
    for role, template in _serving_pods(_pool(tls=False)).items():
        spec = template["spec"]
        assert "pool-ca" not in {v["name"] for v in spec.get("volumes", [])}, role
        assert POOL_TLS_CA_ENV not in {e["name"] for e in spec["containers"][0]["env"]}, role


def test_tls_pool_changes_the_pdd_revision_so_engines_roll() -> None:
    assert (pdd_mod.build(_pdd(), _pool(tls=True), image=IMAGE).revision
            != pdd_mod.build(_pdd(), _pool(tls=False), image=IMAGE).revision)


# -- the engines' one reader of the CA env -------------------------------------------------------
def test_pool_tls_ca_file_reads_the_env_and_the_flag_wins(tmp_path: Path) -> None:
    ca, flag = tmp_path / "ca.crt", tmp_path / "flag.crt"
    ca.write_text("pem")
    flag.write_text("pem")
    assert pool_tls_ca_file({}) is None
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: "  "}) is None
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: str(ca)}) == str(ca)
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: str(ca)}, override=str(flag)) == str(flag)


def test_pool_tls_ca_file_refuses_an_unreadable_file_naming_its_source(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.crt")
    with pytest.raises(TlsSettingsError, match=rf"nope\.crt.*\${POOL_TLS_CA_ENV}.*unreadable"):
        pool_tls_ca_file({POOL_TLS_CA_ENV: missing})
    with pytest.raises(TlsSettingsError, match="from the flag"):
        pool_tls_ca_file({}, override=missing)


def test_sim_engine_takes_the_ca_from_the_operators_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("pem")
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    base = ["--pool-endpoints", "127.0.0.1:7400", "--token", "t" * 32]
    monkeypatch.delenv(POOL_TLS_CA_ENV, raising=False)
    assert sim.settings_from(parser.parse_args(base)).pool_tls_ca_file is None
    monkeypatch.setenv(POOL_TLS_CA_ENV, str(ca))
    settings = sim.settings_from(parser.parse_args(base))
    assert settings.pool_tls_ca_file == str(ca)
    assert f"pool_tls=ca:{ca}" in settings.describe()
    monkeypatch.setenv(POOL_TLS_CA_ENV, str(tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="unreadable"):
        sim.settings_from(parser.parse_args(base))


# -- end to end: a TLS pool on the local cluster, its agents and engines really running ------------------
E2E_NS = "pool-tls-e2e"
E2E_POOL = "kv-tls"
E2E_PDD = "sim-tls"


def _wait(what: str, probe: Callable[[], T | None], *, timeout: float = 240.0,
          on_fail: Callable[[], str] | None = None) -> T:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.5, diagnose=on_fail)


def _openssl(*args: str) -> None:
    made = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr


def _issue(directory: Path, *, ips: list[str], dns: list[str]) -> dict[str, Path]:
    """A CA and a server certificate it signed for ``ips`` and ``dns``: what cert-manager would put in the Secret."""
    files = {k: directory / k for k in ("ca.crt", "ca.key", "tls.crt", "tls.key", "tls.csr", "san.ext")}
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-subj", "/CN=pool-tls-e2e-ca", "-keyout", str(files["ca.key"]), "-out", str(files["ca.crt"]))
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={dns[0]}", "-keyout", str(files["tls.key"]), "-out", str(files["tls.csr"]))
    files["san.ext"].write_text("subjectAltName=" + ",".join([f"IP:{ip}" for ip in ips] + [f"DNS:{d}" for d in dns]))
    _openssl("x509", "-req", "-in", str(files["tls.csr"]), "-CA", str(files["ca.crt"]), "-CAkey", str(files["ca.key"]),
             "-CAcreateserial", "-days", "1", "-extfile", str(files["san.ext"]), "-out", str(files["tls.crt"]))
    return files


class TlsPool:
    def __init__(self, cluster: LocalCluster, api: httpx.Client, operator: OperatorProcess, ca: Path) -> None:
        self.cluster, self.api, self.operator, self.ca = cluster, api, operator, ca

    def pool(self) -> dict[str, Any]:
        body: dict[str, Any] = self.api.get(
            f"/apis/daybreak.dev/v1alpha1/namespaces/{E2E_NS}/kvpools/{E2E_POOL}").json()
        return body

    def endpoints(self) -> list[str]:
        return [f"{e['address']}:{e['port']}" for e in (self.pool().get("status") or {}).get("endpoints") or []]

    def token(self) -> str:
        secret = self.api.get(f"/api/v1/namespaces/{E2E_NS}/secrets/{E2E_POOL}-token").json()
        return base64.b64decode(secret["data"]["token"]).decode()

    def ready_pods(self, role: str) -> list[dict[str, Any]]:
        body = self.api.get(f"/api/v1/namespaces/{E2E_NS}/pods", params={
            "labelSelector": f"daybreak.dev/deployment={E2E_PDD},daybreak.dev/role={role}"}).json()
        return [p for p in body.get("items") or [] if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]

    def diagnose(self) -> str:
        lines = [f"--- operator ---\n{self.operator.log()[-2000:]}"]
        for log in sorted((self.cluster.directory / "pods").glob(f"{E2E_NS}_*/*.log")):
            lines.append(f"--- {log.parent.name}/{log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(lines)


@pytest.fixture(scope="module")
def tls_pool(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsPool]:
    assert cluster.kubelet is not None, "agents and engines must really run: the process kubelet"
    directory = tmp_path_factory.mktemp("pool-tls")
    space = e2e.E2ENamespace(cluster, E2E_NS).open()
    api = space.client
    nodes = api.get("/api/v1/nodes", params={"labelSelector": "daybreak.dev/accelerator=sunrise"}).json()["items"]
    # Agents run on the host network: clients and peers dial the nodes' addresses, so the certificate names them.
    ips = sorted({a["address"] for n in nodes for a in n["status"].get("addresses") or []
                  if a["type"] == "InternalIP"})
    assert ips, nodes
    files = _issue(directory, ips=ips, dns=[f"{E2E_POOL}-agents.{E2E_NS}.svc"])
    cluster.kubectl("-n", E2E_NS, "create", "secret", "generic", SECRET, "--type=kubernetes.io/tls",
                    f"--from-file=tls.crt={files['tls.crt']}", f"--from-file=tls.key={files['tls.key']}",
                    f"--from-file=ca.crt={files['ca.crt']}")
    operator = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=directory / "operator.log", namespace=E2E_NS,
                               identity="pool-tls-e2e", lease_namespace=E2E_NS, resync_seconds=5.0)
    env = TlsPool(cluster, api, operator, files["ca.crt"])
    try:
        operator.start()
        pool = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": E2E_POOL},
                "spec": {"nodeSelector": {"daybreak.dev/accelerator": "sunrise"},
                         "tiers": {"dram": {"bytesPerNode": "64Mi"}},
                         "transport": {"preference": ["shm", "tcp"]}, "tls": {"secretName": SECRET}}}
        layout = {"numLayers": 2, "numKVHeads": 2, "headDim": 16, "blockTokens": 16}  # 4 KiB blocks
        pdd = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": E2E_PDD},
               "spec": {"poolRef": {"name": E2E_POOL},
                        "model": {"name": "sim/tiny", "revision": "tls", "kvLayout": layout},
                        "engine": {"kind": "sim", "args": ["--time-scale", "0.1", "--local-cache-blocks", "0"]},
                        "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "router": {"enabled": False}}}
        cluster.kubectl("apply", "-n", E2E_NS, "-f", "-", stdin=yaml.safe_dump_all([pool, pdd]))
        _wait("the TLS pool Ready", lambda: any(c["type"] == "Ready" and c["status"] == "True"
                                                for c in (env.pool().get("status") or {}).get("conditions") or []),
              on_fail=env.diagnose)
        yield env
    finally:
        operator.stop()
        # KVNodes are per node, not per pool: ours must be gone before later tests run pools on these nodes.
        space.close(nodes=[n["metadata"]["name"] for n in nodes])


@pytest.mark.e2e
def test_tls_pool_agents_serve_tls_to_a_client_with_the_ca_and_refuse_plaintext(tls_pool: TlsPool) -> None:
    endpoints = tls_pool.endpoints()
    assert len(endpoints) >= 2, tls_pool.pool().get("status")
    token = tls_pool.token()
    blocks = [bytes([i]) * 65_537 for i in range(8)]
    keys = [f"tls-e2e-{i}" for i in range(8)]
    for endpoint in endpoints:  # every agent serves TLS with the Secret's certificate, for its own address
        with KVPoolClient([endpoint], token=token, namespace="tls-e2e", transport="tcp", local_first=False,
                          tls_ca_file=str(tls_pool.ca)) as client:
            assert all(n >= 1 for n in client.batch_put(keys, blocks))
            out = [bytearray(65_537) for _ in keys]
            assert client.batch_get_into(keys, out) == [65_537] * len(keys)
            assert [bytes(b) for b in out] == blocks
    with pytest.raises((KVPoolError, OSError)):
        KVPoolClient(endpoints, token=token, namespace="tls-e2e", transport="tcp", timeout_seconds=5)


@pytest.mark.e2e
def test_engines_of_the_tls_pool_reach_it_with_the_projected_ca(tls_pool: TlsPool) -> None:
    """The sim engines read $DAYBREAK_POOL_TLS_CA_FILE: a prefill writes KV over TLS, a decode reads it back."""
    prefill = _wait("a Ready prefill pod", lambda: tls_pool.ready_pods("prefill"), on_fail=tls_pool.diagnose)[0]
    decode = _wait("a Ready decode pod", lambda: tls_pool.ready_pods("decode"), on_fail=tls_pool.diagnose)[0]
    for pod in (prefill, decode):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[POOL_TLS_CA_ENV] == f"{pdd_mod.POOL_CA_DIR}/ca.crt"
    prompt = {"model": "sim/tiny", "prompt": "A shared prefix over TLS. " * 40, "max_tokens": 2}
    wrote = _wait("the prefill engine writing its KV to the pool", lambda: (r := httpx.post(
        f"http://{prefill['status']['podIP']}:8000/v1/completions", json=prompt, timeout=60).json())
        and r["usage"]["daybreak"]["bytes_written"] > 0 and r, timeout=120, on_fail=tls_pool.diagnose)
    assert wrote["usage"]["daybreak"]["blocks_corrupt"] == 0
    # The prefill's write may still be landing when it answers: the decode reads until the blocks are there.
    read = _wait("the decode engine reading the prefix from the pool", lambda: (r := httpx.post(
        f"http://{decode['status']['podIP']}:8000/v1/completions", json=prompt, timeout=60).json())
        and r["usage"]["daybreak"]["pool_hit_tokens"] > 0 and r, timeout=60, on_fail=tls_pool.diagnose)
    assert read["usage"]["daybreak"]["blocks_corrupt"] == 0
