"""The node side of the agent process: discover hardware, register the store's memory, publish, refresh.

``NodeAgent.start`` loads the runtime, reads the topology and opens the RDMA
registrar (all blocking work runs in threads); ``NodeAgent.run`` publishes the
labels and the KVNode and refreshes them every ``node_refresh_seconds`` or
as soon as someone edits this node's daybreak labels. ``run_node_agent`` is
what the agent process main calls in cluster mode; standalone mode uses
``start`` alone (no Kubernetes). ``python -c 'from daybreak.agent.node import
main; main()'`` runs just this part, configured from ``DAYBREAK_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from daybreak.agent.registration import MemoryRegistrar, Registrar, Segment
from daybreak.agent.runtime import LoadedRuntime, load_runtime
from daybreak.agent.settings import AgentSettings
from daybreak.agent.topology import Topology, discover, parse_vendor_ids
from daybreak.logs import setup_logging

if TYPE_CHECKING:
    from daybreak.agent.publish import NodePublisher

log = logging.getLogger(__name__)

SegmentSource = Callable[[], Sequence[Segment]]
UsageSource = Callable[[], Mapping[str, int]]
# (topology, usable NIC names) -> the registrar to use instead of opening our own (the rdma transport's).
RegistrarFactory = Callable[[Topology, list[str]], MemoryRegistrar]
RETRY_SECONDS = 5.0  # after a failed publish, well below the refresh period
DRIFT_DEBOUNCE_SECONDS = 1.0


class NodeAgent:
    """Hardware, registration and publishing state of one node (one instance per agent process)."""

    def __init__(self, settings: AgentSettings, *, store_segments: SegmentSource | None = None,
                 tier_usage: UsageSource | None = None, registrar_factory: RegistrarFactory | None = None,
                 transfer_state: Callable[[], Any] | None = None,
                 namespace_flushes: Callable[[], Any] | None = None,
                 tier_capacity: Callable[[], dict[str, int]] | None = None) -> None:
        self.settings = settings
        self._capacity = tier_capacity  # the store's allocated bytes per tier, when it runs in this process
        self._flushes: Callable[[], Any] = namespace_flushes or (lambda: [])
        # The store's transfer engine: (per-transport conditions, segment descriptors) for KVNode
        self._transfer: Callable[[], Any] = transfer_state or (lambda: ([], []))
        self._segments = store_segments or (lambda: ())
        self._usage = tier_usage or (lambda: {})
        self._registrar_factory = registrar_factory
        self._vendors = parse_vendor_ids(settings.sunrise_pci_vendors)
        self.loaded: LoadedRuntime | None = None
        self.topology: Topology | None = None
        self.registrar: MemoryRegistrar = Registrar(reason="not started")
        self._registered: dict[str, Segment] = {}
        self._ready_since: datetime | None = None

    # -- hardware ------------------------------------------------------------------------
    def _discover(self) -> Topology:
        assert self.loaded is not None
        rt = self.loaded.runtime
        return discover(self.settings.sysfs_root, runtime=self.loaded.name, runtime_devices=rt.devices(),
                        peer_links=rt.peer_links(), sunrise_vendors=self._vendors, runtime_skipped=self.loaded.skipped)

    def _usable_nics(self, topo: Topology) -> list[str]:
        wanted = set(self.settings.rdma_devices)
        return [n.name for n in topo.nics if n.active and (not wanted or n.name in wanted)]

    async def start(self) -> None:
        """Load the runtime, read the topology, open the registrar and register the current segments."""
        s = self.settings
        self.loaded = await asyncio.to_thread(load_runtime, s.runtime, sunrise_lib_dir=s.sunrise_lib_dir)
        self.topology = await asyncio.to_thread(self._discover)
        topo = self.topology
        log.info("node=%s runtime=%s accelerators=%d nics=%d gdr_pairs=%d", s.node_name or "-", topo.runtime,
                 len(topo.gpus), len(topo.nics), sum(len(v) for v in topo.gdr.values()))
        nics = self._usable_nics(topo)
        if self._registrar_factory is not None:
            self.registrar = await asyncio.to_thread(self._registrar_factory, topo, nics)
        else:
            self.registrar = await asyncio.to_thread(Registrar.open, nics, peer_memory=bool(topo.peer_memory))
        await self.sync_segments()

    async def sync_segments(self) -> None:
        """Register segments the store added, deregister the ones it dropped."""
        current = {seg.name: seg for seg in self._segments()}
        runtime = self.loaded.runtime if self.loaded else None
        for name in set(self._registered) - set(current):
            await asyncio.to_thread(self.registrar.deregister, name)
            del self._registered[name]
        for name, seg in current.items():
            if name not in self._registered:
                await asyncio.to_thread(self.registrar.register, seg, runtime=runtime)
                self._registered[name] = seg

    async def refresh(self) -> None:
        """Re-read sysfs (ports go up and down, NICs get hot-plugged) and the store's segments."""
        self.topology = await asyncio.to_thread(self._discover)
        await self.sync_segments()

    def capacity(self) -> dict[str, int]:
        if self._capacity is not None:
            return {"dram": 0, "ssd": 0, "hbm": 0} | dict(self._capacity())
        s = self.settings
        devices = len(self.loaded.runtime.devices()) if self.loaded else 0
        return {"dram": s.dram_bytes, "ssd": s.ssd_bytes if s.ssd_path else 0, "hbm": s.hbm_bytes * devices}

    # -- cluster ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Publish now and on every refresh until ``stop`` is set."""
        from daybreak.agent.publish import NodePublisher, load_client

        s = self.settings
        publisher = NodePublisher(await load_client(s.kubeconfig), s.node_name)
        desired: dict[str, str] = {}
        drifted = asyncio.Event()
        watcher = asyncio.create_task(publisher.watch_labels(desired, drifted), name="daybreak-node-watch")
        try:
            while not stop.is_set():
                delay = s.node_refresh_seconds
                # Cleared before publishing, never after: an edit that lands while we publish must
                # still wake the loop (at worst we publish once more for nothing).
                drifted.clear()
                try:
                    await self._publish_once(publisher, desired)
                except Exception as exc:  # the API server may be away for a while; the node keeps serving
                    log.warning("node=%s publish failed error=%r; retrying in %.0fs", s.node_name, str(exc),
                                RETRY_SECONDS)
                    delay = RETRY_SECONDS
                waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(drifted.wait())]
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if drifted.is_set() and not stop.is_set():
                    # Another writer fighting over our labels must not turn this into a busy loop.
                    await asyncio.sleep(DRIFT_DEBOUNCE_SECONDS)
                if not stop.is_set():
                    await self.refresh()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await publisher.close()

    async def _publish_once(self, publisher: NodePublisher, desired: dict[str, str]) -> None:
        from daybreak.agent.publish import kvnode_status, node_labels

        assert self.topology is not None
        s = self.settings
        labels = node_labels(self.topology, node_name=s.node_name, rdma=self.registrar.rdma)
        now = datetime.now(UTC)
        status = kvnode_status(self.topology, self.registrar, node_name=s.node_name,
                               segments=list(self._registered.values()), capacity=self.capacity(),
                               used=self._usage(), now=now, ready_since=self._ready_since or now,
                               transfer=self._transfer()[0], engine_segments=self._transfer()[1],
                               namespace_flushes=self._flushes())
        desired.clear()
        desired.update(labels)
        await publisher.publish(labels, status)
        self._ready_since = self._ready_since or now

    async def close(self) -> None:
        """Deregister every MR, close NIC contexts and the runtime (shutdown)."""
        await asyncio.to_thread(self.registrar.close)
        self._registered.clear()
        if self.loaded is not None:
            await asyncio.to_thread(self.loaded.runtime.close)


async def run_node_agent(settings: AgentSettings, *, store_segments: SegmentSource | None = None,
                         tier_usage: UsageSource | None = None, stop: asyncio.Event | None = None,
                         started: Callable[[NodeAgent], None] | None = None,
                         registrar_factory: RegistrarFactory | None = None,
                         transfer_state: Callable[[], Any] | None = None,
                         namespace_flushes: Callable[[], Any] | None = None,
                         tier_capacity: Callable[[], dict[str, int]] | None = None) -> None:
    """Cluster mode: discover -> register -> publish, refreshing until ``stop``; always cleans up.

    ``started`` is called once discovery and registration are done (the process main can hand the
    loaded runtime and topology to the store from there)."""
    if not settings.node_name:
        raise ValueError("node_name: cluster mode needs the node name (DAYBREAK_NODE_NAME from the downward API)")
    stop = stop or asyncio.Event()
    agent = NodeAgent(settings, store_segments=store_segments, tier_usage=tier_usage,
                      registrar_factory=registrar_factory, transfer_state=transfer_state,
                      namespace_flushes=namespace_flushes, tier_capacity=tier_capacity)
    try:
        await agent.start()
        if started is not None:
            started(agent)
        await agent.run(stop)
    finally:
        await agent.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run only the node side (no store), configured from DAYBREAK_* variables; stops on SIGTERM/SIGINT."""
    setup_logging(logging.INFO)
    settings = AgentSettings.load()
    log.info("settings %s", settings.describe())

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_node_agent(settings, stop=stop)

    asyncio.run(_main())
    return 0
