"""Serving discovery against a real kube-apiserver: KVPool status endpoints, EndpointSlices, and a router on them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from support import crds_and_namespace

from daybreak.client import discovery
from daybreak.devenv.cluster import LocalCluster
from daybreak.serving import kube as skube
from daybreak.testing.serving_stack import Stack, metric_sum

NS = "serving-kube"


@pytest.fixture(scope="module")
def api(kube: LocalCluster) -> Iterator[httpx.Client]:
    crds_and_namespace(kube, NS)
    with kube.api() as client:
        # envtest has no controller-manager to create it; pods need their ServiceAccount.
        client.post(f"/api/v1/namespaces/{NS}/serviceaccounts", json={"metadata": {"name": "default"}})
        yield client


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code < 300, r.text
    body: dict[str, Any] = r.json()
    return body


def make_pool(api: httpx.Client, name: str, endpoints: list[tuple[str, int]]) -> None:
    base = f"/apis/daybreak.dev/v1alpha1/namespaces/{NS}/kvpools"
    _ok(api.post(base, json={"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": name},
                             "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}))
    status = {"status": {"endpoints": [{"node": f"node-{i}", "address": a, "port": p, "transports": ["tcp"]}
                                       for i, (a, p) in enumerate(endpoints)]}}
    _ok(api.patch(f"{base}/{name}/status", content=json.dumps(status),
                  headers={"Content-Type": "application/merge-patch+json"}))


def slice_body(name: str, service: str, port: int, endpoints: list[tuple[str, bool | None]]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], **({"conditions": {"ready": r}} if r is not None else {})}
                          for a, r in endpoints]}


def put_slice(api: httpx.Client, body: dict[str, Any]) -> None:
    base = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    name = body["metadata"]["name"]
    current = api.get(f"{base}/{name}")
    if current.status_code == 404:
        _ok(api.post(base, json=body))
    else:
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": current.json()["metadata"]["resourceVersion"]}}
        _ok(api.put(f"{base}/{name}", json=body))


def make_service(api: httpx.Client, name: str, *, role: str) -> None:
    _ok(api.post(f"/api/v1/namespaces/{NS}/services", json={
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
        "spec": {"clusterIP": "None", "selector": {"test-role": role},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}}))


def make_pod(api: httpx.Client, name: str, *, role: str, port: int, ready: bool, kv_namespace: str = "sim") -> None:
    """A pod as a kubelet would report it: bound, with a loopback IP and its Ready condition."""
    base = f"/api/v1/namespaces/{NS}/pods"
    if api.get(f"{base}/{name}").status_code == 404:
        labels = {"test-role": role, "daybreak.dev/kv-namespace": kv_namespace}
        _ok(api.post(base, json={
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": "node-0", "containers": [{"name": "engine", "image": "daybreak",
                                                           "ports": [{"name": "http", "containerPort": port}]}]}}))
    status = {"status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    _ok(api.patch(f"{base}/{name}/status", content=json.dumps(status),
                  headers={"Content-Type": "application/merge-patch+json"}))


def test_pool_endpoints_and_ready_slice_endpoints_are_read_back(kube: LocalCluster, api: httpx.Client) -> None:
    make_pool(api, "lookup", [("127.0.1.1", 7480), ("127.0.1.2", 7480)])
    put_slice(api, slice_body("pre-a", "lookup-prefill", 8000, [("10.1.0.1", True), ("10.1.0.2", False),
                                                                  ("10.1.0.3", None)]))
    put_slice(api, slice_body("pre-b", "lookup-prefill", 8001, [("10.1.0.4", True)]))
    put_slice(api, slice_body("other", "lookup-decode", 8000, [("10.1.0.9", True)]))
    # The API server refuses loopback addresses in slices (why the local cluster needs the pod fallback).
    refused = api.post(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                       json=slice_body("loop", "lookup-loop", 8000, [("127.1.0.1", True)]))
    assert refused.status_code == 422 and "loopback" in refused.text

    async def read() -> tuple[list[str], list[str], list[str], int]:
        client = await discovery.load_api(str(kube.kubeconfig))
        try:
            pool = await discovery.pool_endpoints(client, namespace=NS, pool="lookup")
            prefill = await skube.ready_endpoints(client, namespace=NS, service="lookup-prefill")
            none = await skube.ready_endpoints(client, namespace=NS, service="nothing-here")
            try:
                await discovery.pool_endpoints(client, namespace=NS, pool="missing")
                status = 200
            except discovery.KubeLookupError as exc:
                status = exc.status
            return pool, prefill, none, status
        finally:
            await client.close()

    pool, prefill, none, missing = asyncio.run(read())
    assert pool == ["127.0.1.1:7480", "127.0.1.2:7480"]
    assert prefill == ["10.1.0.1:8000", "10.1.0.3:8000", "10.1.0.4:8001"]
    assert none == [] and missing == 404


def _wait(what: str, probe: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_router_discovers_engines_through_the_api_and_the_pool_from_its_status(kube: LocalCluster, api: httpx.Client,
                                                                           tmp_path: Path) -> None:
    with Stack(tmp_path / "stack") as stack:
        agent = stack.add_agents(1, dram="64Mi")[0]
        host, port = agent.address.split(":")
        make_pool(api, "served", [(host, int(port))])
        prefill = stack.engine("prefill")
        decodes = [stack.engine("decode"), stack.engine("decode")]
        make_service(api, "served-prefill", role="prefill")
        make_service(api, "served-decode", role="decode")
        make_pod(api, "served-prefill-0", role="prefill", port=prefill.port, ready=True)
        for i, d in enumerate(decodes):
            make_pod(api, f"served-decode-{i}", role="decode", port=d.port, ready=True)
        router = stack.start_router(static=False, pool_lookup=False, env={"KUBECONFIG": str(kube.kubeconfig)},
                                    extra=["--namespace", NS, "--prefill-service", "served-prefill",
                                           "--decode-service", "served-decode", "--refresh-seconds", "0.3",
                                           "--pool-ref", f"{NS}/served", "--token-file", str(stack.token_file),
                                           "--kv-namespace", "not-the-engines"])
        url = f"http://{router.address}"
        _wait("both decode pods", lambda: httpx.get(f"{url}/health").json()["decode_pods"] == 2)
        body = {"prompt": list(range(16 * 6)), "max_tokens": 2}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200 and first.headers["x-daybreak-prefill"] == prefill.address
        # The kvNamespace is the engine pods' label read through the API, not the router's flag.
        assert first.headers["x-daybreak-kv-namespace"] == stack.kv_namespace
        # The pool, found through the KVPool's status, now holds the prompt: prefill is skipped.
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert second.status_code == 200 and second.headers["x-daybreak-prefill"] == "skipped"
        # A decode pod marked not ready leaves the rotation.
        make_pod(api, "served-decode-1", role="decode", port=decodes[1].port, ready=False)
        _wait("one decode pod", lambda: httpx.get(f"{url}/health").json()["decode_pods"] == 1)
        seen = {httpx.post(f"{url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1},
                           timeout=30).headers["x-daybreak-decode"] for i in range(6)}
        assert seen == {decodes[0].address}
        assert metric_sum(router.metrics(), 'daybreak_router_ready_pods{role="decode"}') == 1


def test_a_slice_change_reaches_the_router_through_the_watch_not_the_re_read_period(kube: LocalCluster,
                                                                                   api: httpx.Client) -> None:
    """Re-reads 60 s apart: a pod the slice lists (and one it marks not ready) shows within seconds, because the
    watch of the Service's slices asks for the read."""
    from daybreak.serving.router.discovery import RolePods, service_lister, service_watch

    def fqdn_slice(ready: bool) -> dict[str, Any]:
        body = slice_body("watched", "watched-decode", 8000, [("127.0.0.7", ready)])
        return {**body, "addressType": "FQDN"}  # the local cluster's loopback IPs, as its kubelet mirrors them

    async def scenario() -> tuple[list[str], list[str]]:
        client = await discovery.load_api(str(kube.kubeconfig))
        pods = RolePods("decode", lister=service_lister(client, namespace=NS, service="watched-decode"),
                        watch=service_watch(client, namespace=NS, service="watched-decode"),
                        refresh_seconds=60.0, resync_seconds=60.0, scrape_seconds=60.0)

        async def until(addresses: list[str]) -> None:
            while [p.address for p in pods.pods()] != addresses:
                await pods.changed(seconds=0.2)

        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(pods.run(session))
            try:
                await asyncio.wait_for(pods.listed.wait(), 10)
                assert pods.pods() == []
                await asyncio.sleep(1.0)  # the watch is open
                await asyncio.to_thread(put_slice, api, fqdn_slice(True))
                await asyncio.wait_for(until(["127.0.0.7:8000"]), 20)  # a third of the re-read period
                added = [p.address for p in pods.pods()]
                await asyncio.to_thread(put_slice, api, fqdn_slice(False))
                await asyncio.wait_for(until([]), 20)
                return added, [p.address for p in pods.pods()]
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await client.close()

    added, removed = asyncio.run(scenario())
    assert added == ["127.0.0.7:8000"] and removed == []
