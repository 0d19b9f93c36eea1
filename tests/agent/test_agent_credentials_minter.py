"""The credential minter against the real API server: an agent's ServiceAccount, bound by the rendered
per-pool Role, creates each deployment's namespace-credential Secret, and a real agent accepts it for that
namespace only."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import ssl
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support import crds_in_new_namespace

from daybreak.agent.credentials_minter import mint_pool_credentials
from daybreak.agent.publish import load_client
from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment
from daybreak.client import KVPoolAuthorizationError, KVPoolClient
from daybreak.devenv.cluster import LocalCluster
from daybreak.operator import pool as pool_mod
from daybreak.pool.connection import Connection, RemoteError
from daybreak.pool.engine_secret import credential_secret_name
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

REPO = Path(__file__).resolve().parents[2]


def _agent_kubeconfig(kube: LocalCluster, *, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the pool's agent ServiceAccount (what the kubelet would hand it)."""
    token = kube.kubectl("create", "token", "-n", namespace, account, "--duration=1h").stdout.strip()
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "agent",
        "clusters": [{"name": "local", "cluster": {"server": kube.server,
                                                   "certificate-authority": str(kube.pki.ca_cert)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "local", "user": "agent", "namespace": namespace}}],
    }))
    return path


def _secret(kube: LocalCluster, ns: str, name: str) -> dict[str, Any] | None:
    with kube.api() as api:
        resp = api.get(f"/api/v1/namespaces/{ns}/secrets/{name}")
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.json()  # type: ignore[no-any-return]


async def _wait_secret(kube: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    for _ in range(300):
        found = await asyncio.to_thread(_secret, kube, ns, name)
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"Secret {ns}/{name} was not minted within 30s")


def test_agent_mints_a_scoped_credential_a_real_agent_accepts_for_that_namespace_only(
        kube: LocalCluster, tmp_path: Path) -> None:
    ns = crds_in_new_namespace(kube, "mint")
    pool_doc = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    pool_doc["metadata"] = {"name": "kv-minimal", "namespace": ns}
    pool = KVPool.model_validate(pool_doc)
    # The agent's ServiceAccount, Role and RoleBinding exactly as the operator renders them.
    rbac = [m for m in pool_mod.build(pool, image="daybreak:dev").applied
            if m["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    kube.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(rbac))
    account = pool_mod.PoolNames("kv-minimal", ns).service_account
    kubeconfig = _agent_kubeconfig(kube, namespace=ns, account=account, path=tmp_path / "agent.kubeconfig")

    pdd_doc = yaml.safe_load((REPO / "examples" / "pddeployment-sim.yaml").read_text())
    pdd_doc["metadata"] = {"name": "sim-llama", "namespace": ns}
    other = json.loads(json.dumps(pdd_doc))
    other["metadata"]["name"] = "elsewhere"
    other["spec"]["poolRef"] = {"name": "another-pool"}
    kube.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([pdd_doc, other]))
    kv_ns = PDDeployment.model_validate(pdd_doc).spec.kv_namespace()
    name = credential_secret_name("sim-llama", kv_ns)

    secret_file = tmp_path / "pool-secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    secret_file.chmod(0o600)
    pool_secret = secret_file.read_text().strip().encode()

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        api = await load_client(str(kubeconfig))
        stop = asyncio.Event()
        task = asyncio.create_task(mint_pool_credentials(api, namespace=ns, pool="kv-minimal",
                                                         pool_secret=pool_secret, stop=stop))
        try:
            first = await _wait_secret(kube, ns, name)
            # A kvNamespace rollout: the operator records the retiring namespace and the new one; the
            # minter adds the new namespace's Secret and leaves the old one for the pods still on it.
            status = {"status": {"kvNamespace": "rolled-ns", "retiringKVNamespace": {"kvNamespace": kv_ns}}}
            await asyncio.to_thread(kube.kubectl, "-n", ns, "patch", "pdd", "sim-llama", "--subresource=status",
                                    "--type=merge", "-p", json.dumps(status))
            rolled = await _wait_secret(kube, ns, credential_secret_name("sim-llama", "rolled-ns"))
            assert not task.done()
            return first, rolled
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=15)
            await api.close()

    minted, rolled = asyncio.run(scenario())
    meta = minted["metadata"]
    uid = kube.kubectl("-n", ns, "get", "pdd", "sim-llama", "-o", "jsonpath={.metadata.uid}").stdout.strip()
    assert meta["ownerReferences"] == [{"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment",
                                        "name": "sim-llama", "uid": uid}]
    assert meta["labels"]["daybreak.dev/deployment"] == "sim-llama" and minted["immutable"] is True
    credential = base64.b64decode(minted["data"]["token"]).decode()
    assert credential.startswith(f"dbk1.{kv_ns}.") and pool_secret.decode() not in credential
    assert base64.b64decode(rolled["data"]["token"]).decode().startswith("dbk1.rolled-ns.")
    # Nothing for the deployment of another pool.
    listed = json.loads(kube.kubectl("-n", ns, "get", "secrets", "-o", "json").stdout)["items"]
    assert not any(s["metadata"]["name"].startswith("elsewhere") for s in listed)

    # The agent's account may create Secrets but never read or list them (nor change what it minted).
    token = json.loads(kubeconfig.read_text())["users"][0]["user"]["token"]
    with httpx.Client(base_url=kube.server, verify=ssl.create_default_context(cafile=str(kube.pki.ca_cert)), timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as agent_api:
        assert agent_api.get(f"/api/v1/namespaces/{ns}/secrets/{name}").status_code == 403
        assert agent_api.get(f"/api/v1/namespaces/{ns}/secrets").status_code == 403
        assert agent_api.delete(f"/api/v1/namespaces/{ns}/secrets/{name}").status_code == 403

    # A real agent holding the pool secret accepts the minted credential for its namespace, nothing else.
    pool_name = f"m{uuid.uuid4().hex[:8]}"
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=secret_file, pool=pool_name, dram="64Mi",
                       peers=[], extra=[])
    try:
        agent.start()
        with KVPoolClient(endpoints=[agent.address], token=credential, namespace=kv_ns, transport="tcp") as c:
            assert c.batch_put(["block-0"], [b"kv-bytes"]) == [1]
            out = bytearray(16)
            assert c.batch_get_into(["block-0"], [out]) == [8] and bytes(out[:8]) == b"kv-bytes"
        with pytest.raises(KVPoolAuthorizationError):
            KVPoolClient(endpoints=[agent.address], token=credential, namespace="rolled-ns")
        conn = Connection(agent.address, token=credential.encode())
        try:
            with pytest.raises(RemoteError, match="not authorized"):
                conn.exists(["rolled-ns/block-0"])
        finally:
            conn.close()
    finally:
        agent.kill()
        cleanup_pool(pool_name)
