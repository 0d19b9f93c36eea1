"""updateStrategy.cache flush, the operator's half, against a real API server: it asks through the KVPool's
status, waits for every agent's KVNode report, sums them into retiredKVNamespace.bytesFreed and withdraws."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from support import pool_in_new_namespace

from daybreak.devenv.cluster import LocalCluster
from daybreak.operator.controller import Controller
from daybreak.operator.kube import KVPOOL, KubeClient, load_configuration
from daybreak.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
AT = "2026-12-01T11:00:00Z"


def _kvnode(kube: LocalCluster, name: str, flushes: list[dict[str, Any]]) -> None:
    node = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVNode", "metadata": {"name": name},
            "spec": {"nodeName": name}}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(node))
    kube.kubectl("patch", "kvnode", name, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": {"namespaceFlushes": flushes}}))


def test_the_operator_requests_a_flush_and_sums_the_agents_reports(kube: LocalCluster) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    for crd in ("kvpools", "kvnodes"):
        kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd}.daybreak.dev")
    # A CRD just (re)applied may answer 429 while its storage initializes: wait until KVNodes can be listed.
    kube.kubectl("wait", "--for=jsonpath={.status.acceptedNames.kind}=KVNode", "--timeout=60s",
                 "crd/kvnodes.daybreak.dev")
    for _ in range(100):
        if kube.kubectl("get", "kvnodes", check=False).returncode == 0:
            break
        time.sleep(0.2)
    ns = pool_in_new_namespace(kube, "cflush")
    nodes = [f"{ns}-n0", f"{ns}-n1"]
    endpoints = [{"node": n, "address": f"10.0.0.{i + 1}", "port": 7400} for i, n in enumerate(nodes)]
    kube.kubectl("-n", ns, "patch", "kvpool", "pool", "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": {"endpoints": endpoints}}))
    pdd = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment",
           "metadata": {"name": "d", "namespace": ns, "uid": str(uuid.uuid4())}}

    async def scenario() -> dict[str, Any]:
        configuration, _ = await load_configuration(str(kube.kubeconfig))
        client = KubeClient(configuration)
        c = Controller(client, OperatorSettings(kubeconfig=str(kube.kubeconfig)), fence=lambda: True)
        reasons: list[str] = []
        c.events.record = lambda obj, *, reason, message, type="Normal": reasons.append(reason)  # type: ignore[method-assign]
        status: dict[str, Any] = {"retiredKVNamespace": {"kvNamespace": "m-r1", "policy": "flush", "retiredAt": AT}}
        try:
            async def step() -> dict[str, Any]:
                pool_body = await client.get(KVPOOL, "pool", namespace=ns)
                await c.rollout.flush_retired(pdd, pool_body=pool_body, status=status)
                return dict(await client.get(KVPOOL, "pool", namespace=ns))

            after = await step()
            assert after["status"]["flushRequests"] == [{"kvNamespace": "m-r1", "requestedAt": AT,
                                                         "requestedBy": f"{ns}/d"}]
            assert after["status"]["endpoints"]  # the pool's own status is untouched
            await step()  # no agent has answered: nothing summed, the request stays
            assert status["retiredKVNamespace"].get("bytesFreed") is None
            await asyncio.to_thread(_kvnode, kube, nodes[0], [
                {"kvNamespace": "m-r1", "requestedAt": AT, "bytesFreed": 3000},
                {"kvNamespace": "m-r1", "requestedAt": "2026-01-01T00:00:00Z", "bytesFreed": 999}])  # older one
            after = await step()  # one of two agents answered: still waiting
            assert status["retiredKVNamespace"].get("bytesFreed") is None and after["status"]["flushRequests"]
            await asyncio.to_thread(_kvnode, kube, nodes[1], [
                {"kvNamespace": "m-r1", "requestedAt": AT, "bytesFreed": 4000}])
            after = await step()
            assert status["retiredKVNamespace"]["bytesFreed"] == 7000
            assert "7000 bytes freed on 2 agents" in status["retiredKVNamespace"]["message"]
            assert reasons == ["KVNamespaceFlushed"]
            # Still listed until a reconcile reads the sum back from the stored status: an operator stopped
            # before writing it finds the agents' reports and sums them again, rather than asking anew.
            assert after["status"]["flushRequests"]
            assert len(c.state.queue) == 1 and await c.state.queue.get() == ("PDDeployment", ns, "d")  # queued
            status = {"retiredKVNamespace": dict(status["retiredKVNamespace"])}  # as the next one reads it
            after = await step()
            assert after["status"].get("flushRequests") in (None, [])  # withdrawn: the agents forget it
            assert status["retiredKVNamespace"]["bytesFreed"] == 7000
            await step()  # done: a later reconcile neither re-asks nor re-counts
            assert reasons == ["KVNamespaceFlushed"]
            return after
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        kube.kubectl("delete", "kvnode", *nodes, check=False)
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_two_deployments_of_one_pool_never_write_away_each_others_flush_requests(kube: LocalCluster) -> None:
    """Each deployment computes the pool's flushRequests from the pool it read; a write from an older read is
    refused (409) and redone on the fresh pool, and the pool's own status write never carries the list."""
    ns = pool_in_new_namespace(kube, "cflush2")
    kube.kubectl("-n", ns, "patch", "kvpool", "pool", "--subresource=status", "--type=merge", "-p",
                 json.dumps({"status": {"endpoints": [{"node": "n0", "address": "10.0.0.1", "port": 7400}]}}))
    a = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "a", "namespace": ns}}
    b = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "b", "namespace": ns}}

    def retired(kv_ns: str, **more: Any) -> dict[str, Any]:
        return {"retiredKVNamespace": {"kvNamespace": kv_ns, "policy": "flush", "retiredAt": AT, **more}}

    async def scenario() -> None:
        configuration, _ = await load_configuration(str(kube.kubeconfig))
        client = KubeClient(configuration)
        c = Controller(client, OperatorSettings(kubeconfig=str(kube.kubeconfig)), fence=lambda: True)
        c.events.record = lambda obj, *, reason, message, type="Normal": None  # type: ignore[method-assign]
        try:
            stale = await client.get(KVPOOL, "pool", namespace=ns)  # both deployments read this version
            await c.rollout.flush_retired(a, pool_body=stale, status=retired("a-r1"))
            with_a = await client.get(KVPOOL, "pool", namespace=ns)
            await c.rollout.flush_retired(b, pool_body=stale, status=retired("b-r1"))
            listed = (await client.get(KVPOOL, "pool", namespace=ns))["status"]["flushRequests"]
            assert [(r["kvNamespace"], r["requestedBy"]) for r in listed] == [("a-r1", f"{ns}/a"), ("b-r1", f"{ns}/b")]

            # The pool's reconcile writes its status from the same old read: the requests stay.
            status = {**(stale.get("status") or {}), "endpoints": []}
            status.pop("flushRequests", None)
            await c.status.write(("KVPool", ns, "pool"), body=stale, status=status)
            after = await client.get(KVPOOL, "pool", namespace=ns)
            assert after["status"]["endpoints"] == [] and len(after["status"]["flushRequests"]) == 2

            # a withdraws from the read that preceded b's request: b's stays listed.
            await c.rollout.flush_retired(a, pool_body=with_a, status=retired("a-r1", bytesFreed=0))
            listed = (await client.get(KVPOOL, "pool", namespace=ns))["status"]["flushRequests"]
            assert [r["kvNamespace"] for r in listed] == ["b-r1"]
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
