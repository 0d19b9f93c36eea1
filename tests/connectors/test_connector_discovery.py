"""The connector finds the pool's agents through the KVPool's status, against a real kube-apiserver with RBAC.

The engine pod's credential here is what the operator gives it: a token of the
PDDeployment's serving ServiceAccount, bound by the operator's own Role
(``serving_access``), in a kubeconfig as the process kubelet writes one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import crds_and_namespace

from daybreak.api.pddeployment import PDDeployment
from daybreak.client import discovery
from daybreak.connectors.blocks import ConnectorConfigError, PoolSettings
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator import deployment as pdd_mod

NS = "connector-discovery"
PDD = "tiny"
POOL = "kv-seen"  # the pool the PDDeployment refers to
OTHER = "kv-other"  # a pool in the same namespace its pods may not read


def _ok(r: httpx.Response) -> Any:
    assert r.status_code < 300, r.text
    return r.json()


def _pool(api: httpx.Client, name: str) -> None:
    base = f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools"
    if api.get(f"{base}/{name}").status_code == 404:
        _ok(api.post(base, json={"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": name},
                                 "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}))


def publish(api: httpx.Client, name: str, endpoints: list[tuple[str, int]]) -> None:
    """What the operator writes: one ``status.endpoints`` entry per ready agent."""
    status = {"status": {"endpoints": [{"node": f"node-{i}", "address": a, "port": p, "transports": ["tcp"]}
                                       for i, (a, p) in enumerate(endpoints)]}}
    _ok(api.patch(f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools/{name}/status", content=json.dumps(status),
                  headers={"Content-Type": "application/merge-patch+json"}))


@pytest.fixture(scope="module")
def api(kube: LocalCluster) -> Iterator[httpx.Client]:
    crds_and_namespace(kube, NS)
    with kube.api() as client:
        yield client


@pytest.fixture(scope="module")
def pod_kubeconfig(kube: LocalCluster, api: httpx.Client, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig holding a token of the serving ServiceAccount, with the operator's Role bound to it."""
    pdd = PDDeployment.from_body({
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": PDD, "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": {"poolRef": {"name": POOL}, "model": {"name": "m", "revision": "r", "kvLayout": {
            "numLayers": 4, "numKVHeads": 4, "headDim": 64, "dtype": "bfloat16", "blockTokens": 128}},
            "engine": {"kind": "vllm", "image": "vllm:local"}}})
    paths = {"ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
             "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
             "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"}
    account = ""
    for manifest in pdd_mod.serving_access(pdd):
        base = paths[manifest["kind"]].format(ns=NS)
        if api.get(f"{base}/{manifest['metadata']['name']}").status_code == 404:
            _ok(api.post(base, json=manifest))
        if manifest["kind"] == "ServiceAccount":
            account = manifest["metadata"]["name"]
    token = _ok(api.post(f"/api/v1/namespaces/{NS}/serviceaccounts/{account}/token", json={
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}))
    path = tmp_path_factory.mktemp("pod") / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "pod",
        "clusters": [{"name": "local", "cluster": {"server": kube.server,
                                                   "certificate-authority": str(kube.pki.ca_cert)}}],
        "users": [{"name": account, "user": {"token": token["status"]["token"]}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": account, "namespace": NS}}]}))
    _pool(api, POOL)
    _pool(api, OTHER)
    return path


def pod_env(kubeconfig: Path, **extra: str) -> dict[str, str]:
    """The decode pod's environment as the kubelet resolves it (the operator's variables, the Secret read)."""
    return {"KUBECONFIG": str(kubeconfig), "DAYBREAK_POOL_REF": f"{NS}/{POOL}",
            "DAYBREAK_POOL_ENDPOINTS": f"{POOL}-agents.{NS}.svc:7400",  # resolves nowhere: no DNS here
            "DAYBREAK_POOL_TOKEN": "t0ken", "DAYBREAK_KV_NAMESPACE": "kv1-abc", **extra}


def test_the_agents_come_from_the_pools_status_read_with_the_pods_own_rights(
        api: httpx.Client, pod_kubeconfig: Path) -> None:
    publish(api, POOL, [("127.0.1.2", 7400), ("127.0.1.1", 7400), ("fd00::5", 7401)])
    settings = PoolSettings.resolve({}, pod_env(pod_kubeconfig))
    assert settings.endpoints == ("127.0.1.1:7400", "127.0.1.2:7400", "[fd00::5]:7401")
    assert settings.pool_ref == f"{NS}/{POOL}" and settings.token == "t0ken"
    # Endpoints in the connector's extra config are used as given: no API read, no pool_ref.
    explicit = PoolSettings.resolve({"endpoints": ["10.9.9.9:1"]}, pod_env(Path("/nonexistent/kubeconfig")))
    assert explicit.endpoints == ("10.9.9.9:1",) and explicit.pool_ref == ""


def test_an_engine_started_before_the_agents_waits_for_the_pool_to_publish_them(
        api: httpx.Client, pod_kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    publish(api, POOL, [])
    timer = threading.Timer(2.0, publish, args=(api, POOL, [("127.0.1.3", 7400)]))
    caplog.set_level(logging.INFO, logger="daybreak.client.discovery")
    timer.start()
    try:
        settings = PoolSettings.resolve({"discovery_timeout_seconds": 60}, pod_env(pod_kubeconfig))
    finally:
        timer.join()
    assert settings.endpoints == ("127.0.1.3:7400",)
    waits = [r.getMessage() for r in caplog.records if "event=pool_endpoints_wait" in r.getMessage()]
    assert waits and f"pool={NS}/{POOL}" in waits[0] and "publishes no endpoints yet" in waits[0], waits
    assert any("event=pool_discovered" in r.getMessage() for r in caplog.records)


def test_a_pool_that_never_publishes_fails_after_the_timeout_naming_the_pool_and_the_cause(
        api: httpx.Client, pod_kubeconfig: Path) -> None:
    publish(api, POOL, [])
    started = time.monotonic()
    with pytest.raises(discovery.PoolDiscoveryError,
                       match=rf"KVPool {NS}/{POOL}: no endpoints after 1.5s; last: the KVPool publishes no endpoints"):
        PoolSettings.resolve({"discovery_timeout_seconds": 1.5}, pod_env(pod_kubeconfig))
    assert time.monotonic() - started >= 1.5  # it waited, it did not fall back to the Service name


@pytest.mark.parametrize(("pool", "as_admin", "status"), [(OTHER, False, "403"), ("kv-missing", True, "404")])
def test_a_pool_the_pod_may_not_read_or_that_is_missing_is_reported_with_the_apis_answer(
        kube: LocalCluster, api: httpx.Client, pod_kubeconfig: Path, pool: str, as_admin: bool, status: str) -> None:
    publish(api, OTHER, [("127.0.1.9", 7400)])  # published, but not this pod's to read
    # The pod's Role names one pool, so any other, present or not, is 403 to it; a 404 needs wider rights.
    env = pod_env(kube.kubeconfig if as_admin else pod_kubeconfig, DAYBREAK_POOL_REF=f"{NS}/{pool}")
    with pytest.raises(discovery.PoolDiscoveryError, match=rf"KVPool {NS}/{pool}: no endpoints after 1s; "
                                                           rf"last: GET \S+/kvpools/{pool}: {status}"):
        PoolSettings.resolve({"discovery_timeout_seconds": 1}, env)


def test_bad_references_and_missing_credentials_fail_at_once(tmp_path: Path) -> None:
    env = pod_env(tmp_path / "unused", KUBECONFIG="")  # no kubeconfig, and this machine is no pod
    started = time.monotonic()
    with pytest.raises(discovery.PoolDiscoveryError, match=r"cannot reach the Kubernetes API: .*no KUBECONFIG set "
                                                           r"and no in-cluster ServiceAccount"):
        discovery.discover_pool_endpoints(f"{NS}/{POOL}", timeout_seconds=60, kubeconfig="",
                                          poll_seconds=0.1)
    assert time.monotonic() - started < 30  # not the 60 s timeout: waiting cannot bring credentials
    with pytest.raises(discovery.PoolRefError, match="is not NAMESPACE/NAME"):
        PoolSettings.resolve({"pool_ref": "just-a-name"}, env)
    # The engine-pod contract refuses it before anything is looked up, naming the variable.
    with pytest.raises(ConnectorConfigError, match=r"\$DAYBREAK_POOL_REF: .*give NAMESPACE/NAME"):
        PoolSettings.resolve({}, {**env, "DAYBREAK_POOL_REF": "just-a-name"})
    with pytest.raises(ConnectorConfigError, match="discovery_timeout_seconds must be a positive number"):
        PoolSettings.resolve({"discovery_timeout_seconds": "soon"}, env)
    with pytest.raises(ConnectorConfigError, match="DAYBREAK_POOL_REF"):
        PoolSettings.resolve({}, {"DAYBREAK_POOL_TOKEN": "t", "DAYBREAK_KV_NAMESPACE": "n"})


def test_the_synchronous_lookup_also_works_from_inside_a_running_event_loop(
        api: httpx.Client, pod_kubeconfig: Path) -> None:
    publish(api, POOL, [("127.0.1.4", 7400)])

    async def engine_with_a_loop() -> list[str]:
        return discovery.discover_pool_endpoints(f"{NS}/{POOL}", timeout_seconds=30, kubeconfig=str(pod_kubeconfig))

    assert asyncio.run(engine_with_a_loop()) == ["127.0.1.4:7400"]


def test_importing_discovery_loads_no_kubernetes_client() -> None:
    """``import daybreak.client`` stays light, and a machine without the Kubernetes client can load both modules."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('kubernetes', 'kubernetes_asyncio', 'aiohttp'):
                    raise ImportError('blocked for the test: ' + name)
        sys.meta_path.insert(0, Block())
        import daybreak.client, daybreak.client.discovery, daybreak.connectors.blocks
        from daybreak.client.discovery import parse_pool_ref
        print(parse_pool_ref('ns/kv-a'))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "('ns', 'kv-a')"
