"""updateStrategy.cache flush, the agent's half: a real store flushes what its KVPool's status asks, in-process."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from support import pool_in_new_namespace

from daybreak.agent.flush import FlushLedger, flush_requests
from daybreak.agent.main import _follow_members, start_store, stop_store
from daybreak.agent.settings import AgentSettings
from daybreak.api.node import KVNodeStatus, NamespaceFlush
from daybreak.client import KVPoolClient
from daybreak.devenv.cluster import LocalCluster
from daybreak.pool.protocol import FlushReply
from daybreak.testing.store_agent import cleanup_pool, free_port

MiB = 1 << 20


def test_flush_requests_skip_invalid_and_duplicate_entries() -> None:
    pool = {"status": {"flushRequests": [
        {"kvNamespace": "m-r1", "requestedAt": "2026-12-01T11:00:00Z"},
        {"kvNamespace": "m-r1", "requestedAt": "2026-12-01T11:00:00Z"},
        {"kvNamespace": "../etc", "requestedAt": "x"},
        {"requestedAt": "x"},
        "junk",
        {"kvNamespace": "m-r1", "requestedAt": "2026-12-01T12:00:00Z"},
    ]}}
    assert flush_requests(pool) == [("m-r1", "2026-12-01T11:00:00Z"), ("m-r1", "2026-12-01T12:00:00Z")]
    assert flush_requests({}) == []


def test_ledger_flushes_each_request_once_and_forgets_withdrawn_ones() -> None:
    calls: list[str] = []

    def flush(ns: str) -> FlushReply:
        calls.append(ns)
        return FlushReply(blocks=2, bytes_freed=10 if len(calls) == 1 else 0, busy=1)

    ledger = FlushLedger(flush)
    first = ledger.apply([("a", "t1")])
    assert [(r.kv_namespace, r.bytes_freed, r.blocks, r.busy) for r in first] == [("a", 10, 2, 1)]
    assert ledger.apply([("a", "t1")]) == []  # every pool event repeats the list: flushed once
    assert calls == ["a"]
    ledger.apply([("a", "t1"), ("a", "t2")])  # a newer request for the same namespace runs again
    assert calls == ["a", "a"]
    ledger.apply([("a", "t2")])
    assert [(r.kv_namespace, r.requested_at) for r in ledger.reports()] == [("a", "t2")]


async def until(done: Callable[[], bool], *, seconds: float = 30.0) -> None:
    """Poll ``done`` (the watch runs in this loop) for at most ``seconds``; the asserts after say what failed."""
    for _ in range(int(seconds * 10)):
        if done():
            return
        await asyncio.sleep(0.1)


def _patch_status(kube: LocalCluster, ns: str, status: dict[str, object]) -> None:
    kube.kubectl("-n", ns, "patch", "kvpool", "pool", "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status}))


def test_agent_flushes_its_store_when_its_kvpool_asks(kube: LocalCluster, tmp_path: Path) -> None:
    ns = pool_in_new_namespace(kube, "flush")
    store_pool = f"f{uuid.uuid4().hex[:8]}"
    address = f"127.0.0.1:{free_port()}"
    settings = AgentSettings(standalone=True, listen=address, dram_bytes=64 * MiB, token_file=str(tmp_path / "s"),
                             pool_name="pool", pool_namespace=ns, kubeconfig=str(kube.kubeconfig), replicas=1)
    # The store's shm names come from the pool name; a unique one keeps parallel tests apart.
    server = start_store(settings.model_copy(update={"pool_name": store_pool}))
    token = (tmp_path / "s").read_text().strip()
    try:
        with KVPoolClient([address], token=token, namespace="m-r1", transport="tcp") as old, \
                KVPoolClient([address], token=token, namespace="m-r2", transport="tcp") as new:
            assert old.batch_put([f"k{i}" for i in range(5)], [bytes([i]) * MiB for i in range(5)]) == [1] * 5
            assert new.batch_put(["k0"], [b"new" * 1000]) == [1]
            ledger = FlushLedger(server.service.flush_namespace)
            server.flush_ledger = ledger

            async def scenario() -> None:
                stop = asyncio.Event()
                task = asyncio.create_task(_follow_members(settings, server, stop))
                try:
                    await asyncio.to_thread(_patch_status, kube, ns, {"flushRequests": [
                        {"kvNamespace": "m-r1", "requestedAt": "2026-12-01T11:00:00Z", "requestedBy": "d/x"}]})
                    await until(lambda: bool(ledger.reports()))
                    # The operator withdraws the request once it has summed the reports: the agent forgets it.
                    await asyncio.to_thread(_patch_status, kube, ns, {"flushRequests": []})
                    await until(lambda: not ledger.reports())
                finally:
                    stop.set()
                    await asyncio.wait_for(task, timeout=10)

            reports_seen: list[NamespaceFlush] = []
            original = ledger.apply

            def recording(requests: Sequence[tuple[str, str]]) -> list[NamespaceFlush]:
                out = original(requests)
                reports_seen.extend(out)
                return out

            ledger.apply = recording  # type: ignore[method-assign]
            asyncio.run(scenario())
            assert len(reports_seen) == 1, reports_seen  # flushed once although the pool changed twice
            report = reports_seen[0]
            assert report.kv_namespace == "m-r1" and report.bytes_freed == 5 * MiB
            assert ledger.reports() == []
            assert old.batch_exists([f"k{i}" for i in range(5)]) == [False] * 5
            assert new.batch_exists(["k0"]) == [True]
        # What the KVNode carries (status.namespaceFlushes), as the operator reads it.
        dumped = KVNodeStatus(namespace_flushes=reports_seen).model_dump(by_alias=True, mode="json")
        assert dumped["namespaceFlushes"][0]["bytesFreed"] == 5 * MiB
        assert dumped["namespaceFlushes"][0]["requestedAt"] == "2026-12-01T11:00:00Z"
    finally:
        stop_store(server, remove=True)
        cleanup_pool(store_pool)
