"""Cluster membership: the store's peers follow the endpoints the operator publishes on the KVPool."""

from __future__ import annotations

import asyncio
import json

from support import pool_in_new_namespace

from daybreak.agent.membership import follow_pool_endpoints, pool_endpoints
from daybreak.agent.publish import load_client
from daybreak.devenv.cluster import LocalCluster


def test_pool_endpoints_are_sorted_unique_and_skip_pods_without_address() -> None:
    pool = {"status": {"endpoints": [
        {"node": "b", "address": "10.0.0.2", "port": 7400},
        {"node": "a", "address": "10.0.0.1", "port": 7400},
        {"node": "a", "address": "10.0.0.1", "port": 7400},
        {"node": "c", "address": "", "port": 7400},
    ]}}
    assert pool_endpoints(pool) == ["10.0.0.1:7400", "10.0.0.2:7400"]
    assert pool_endpoints({}) == []


def _set_endpoints(kube: LocalCluster, ns: str, name: str, addresses: list[str]) -> None:
    endpoints = [{"node": f"n{i}", "address": a, "port": 7400} for i, a in enumerate(addresses)]
    kube.kubectl("-n", ns, "patch", "kvpool", name, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": {"endpoints": endpoints}}))


def test_follower_sees_every_change_of_the_published_endpoints(kube: LocalCluster) -> None:
    ns = pool_in_new_namespace(kube, "members")
    seen: list[list[str]] = []

    async def scenario() -> None:
        api = await load_client(str(kube.kubeconfig))
        stop = asyncio.Event()
        changed = asyncio.Event()

        def on_change(addresses: list[str]) -> None:
            seen.append(addresses)
            changed.set()

        async def next_change() -> list[str]:
            await asyncio.wait_for(changed.wait(), timeout=30)
            changed.clear()
            return seen[-1]

        task = asyncio.create_task(follow_pool_endpoints(api, namespace=ns, pool="pool", on_change=on_change,
                                                         stop=stop))
        try:
            assert await next_change() == []  # the pool exists, nobody is ready yet
            await asyncio.to_thread(_set_endpoints, kube, ns, "pool", ["10.1.0.2", "10.1.0.1"])
            assert await next_change() == ["10.1.0.1:7400", "10.1.0.2:7400"]
            await asyncio.to_thread(_set_endpoints, kube, ns, "pool", ["10.1.0.1"])
            assert await next_change() == ["10.1.0.1:7400"]
            await asyncio.to_thread(kube.kubectl, "-n", ns, "delete", "kvpool", "pool")
            assert await next_change() == []
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)
            await api.close()

    asyncio.run(scenario())
    assert len(seen) == 4
