"""Where the engine pods of each role are and how loaded they are: discovery and the load scrape.

Two sources of pods: a static list (``--prefill-endpoints``; tests and the
benchmark) or the role Service's EndpointSlices, ready endpoints only. Those
are re-read at once when a watch of the slices says they changed (a pod the
planner started serves as soon as its slice lists it), and every
``RESYNC_SECONDS`` while the watch runs; until it has delivered an event, or
after it failed, every ``refresh_seconds`` instead. The watch only triggers
reads, so a missed event costs a late list, never a wrong one. A failed API
read keeps the last known list (the pods did not vanish because the API
server is slow). Each pod's load is
scraped from its ``/metrics`` about every half second
(``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, the same
names on vLLM and the sim engine); that is cheap and needs no engine-specific
API. Nothing here survives a restart, and nothing needs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from daybreak.api import metrics as names
from daybreak.client.kubewatch import watch_with_backoff
from daybreak.serving import kube
from daybreak.serving.router.choice import Candidate, load_of

log = logging.getLogger(__name__)

RUNNING = names.VLLM_RUNNING
WAITING = names.VLLM_WAITING
# A scrape slower than this counts as failed: a pod that cannot answer /metrics in time is not one to pick.
SCRAPE_TIMEOUT = 1.0
_MAX_METRICS_BYTES = 4 << 20


def parse_load(text: str) -> tuple[float | None, float | None]:
    """(running, waiting) summed over label sets from Prometheus text; None where a metric is absent."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name in (RUNNING, WAITING):
            if line.startswith(name + "{"):
                rest = line[line.rfind("}") + 1:]  # label values may hold spaces, never an unescaped }
            elif line.startswith(name + " "):
                rest = line[len(name):]
            else:
                continue
            parts = rest.split()
            try:
                sums[name] = sums.get(name, 0.0) + float(parts[0])
            except (IndexError, ValueError):
                pass
    return sums.get(RUNNING), sums.get(WAITING)


@dataclass
class PodState:
    """What the router knows about one pod right now."""

    address: str
    in_flight: int = 0
    running: float | None = None
    waiting: float | None = None
    healthy: bool = True
    scraped_at: float = 0.0
    kv_namespace: str | None = None
    """The pod's ``daybreak.dev/kv-namespace`` label (None: static endpoints, or not known)."""

    def candidate(self, local_blocks: int = 0) -> Candidate:
        return Candidate(address=self.address, load=load_of(in_flight=self.in_flight, running=self.running,
                                                           waiting=self.waiting),
                         local_blocks=local_blocks, healthy=self.healthy, kv_namespace=self.kv_namespace)


# Ready ``host:port`` -> the pod's kvNamespace (None where unknown).
EndpointLister = Callable[[], Awaitable[dict[str, str | None]]]
# One watch of the endpoints' source: calls its argument at each event; returns when the server ends the
# watch, raises when it fails.
ChangeWatch = Callable[[Callable[[], None]], Awaitable[None]]
# The re-read period while the watch runs: a backstop for what the slices do not show (the loopback
# fallback's pods), not the way changes are seen.
RESYNC_SECONDS = 10.0


class RolePods:
    """The ready pods of one role, kept fresh by ``run()``; ``pods()`` is what the chooser sees."""

    def __init__(self, role: str, *, lister: EndpointLister | None = None, watch: ChangeWatch | None = None,
                 static: list[str] | None = None, refresh_seconds: float = 1.0,
                 resync_seconds: float = RESYNC_SECONDS, scrape_seconds: float = 0.5) -> None:
        self.role = role
        self._lister = lister
        self._watch = watch
        self._watching = False  # the watch has delivered an event and not failed since
        self._stale = asyncio.Event()  # set by the watch: list again now
        self._refresh = refresh_seconds
        self._resync = max(resync_seconds, refresh_seconds)
        self._scrape = scrape_seconds
        self._pods: dict[str, PodState] = {}
        self.listed = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) when a step ends or the pods listed change
        if static is not None:
            self._set(dict.fromkeys(static))

    def _set(self, addresses: Mapping[str, str | None]) -> None:
        old = self._pods
        self._pods = {a: old.get(a) or PodState(a) for a in addresses}
        for address, namespace in addresses.items():
            self._pods[address].kv_namespace = namespace
        added, removed = set(self._pods) - set(old), set(old) - set(self._pods)
        if added or removed:
            log.info("event=endpoints role=%s ready=%d added=%s removed=%s", self.role, len(self._pods),
                     ",".join(sorted(added)) or "-", ",".join(sorted(removed)) or "-")
            self.notify()
        self.listed.set()

    def notify(self) -> None:
        """Wake whoever waits in ``changed``."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, *, seconds: float) -> None:
        """Return when a step ends or the pods listed change, or after ``seconds`` (health comes from
        scrapes, which do not notify)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    def pods(self) -> list[PodState]:
        return list(self._pods.values())

    def get(self, address: str) -> PodState | None:
        return self._pods.get(address)

    def begin(self, address: str) -> None:
        pod = self._pods.get(address)
        if pod is not None:
            pod.in_flight += 1

    def end(self, address: str, *, failed: bool = False) -> None:
        pod = self._pods.get(address)
        if pod is not None:
            pod.in_flight = max(pod.in_flight - 1, 0)
            if failed:
                pod.healthy = False  # until the next good scrape says otherwise
            self.notify()

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Refresh the list (when not static) and scrape every pod's load, until cancelled."""
        tasks = [asyncio.create_task(self._scrape_loop(session), name=f"scrape-{self.role}")]
        if self._lister is not None:
            tasks.append(asyncio.create_task(self._list_loop(), name=f"list-{self.role}"))
            if self._watch is not None:
                tasks.append(asyncio.create_task(self._watch_loop(), name=f"watch-{self.role}"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    async def _list_loop(self) -> None:
        assert self._lister is not None
        failing = False
        while True:
            self._stale.clear()  # before the read: an event during it asks for the next one
            try:
                self._set(await self._lister())
                if failing:
                    log.info("event=discovery_recovered role=%s", self.role)
                failing = False
            except (kube.KubeLookupError, OSError, TimeoutError) as exc:
                if not failing:
                    log.warning("event=discovery_failed role=%s error=%r action=keep_last_list", self.role, str(exc))
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stale.wait(),
                                       self._resync if self._watching and not failing else self._refresh)

    async def _watch_loop(self) -> None:
        assert self._watch is not None
        watch = self._watch

        async def once(progress: Callable[[], None]) -> None:
            def changed() -> None:
                progress()
                self._watching = True
                self._stale.set()

            await watch(changed)

        told = False  # a watch that never worked (no RBAC for it, say) is logged once, not at every retry

        def failed(exc: BaseException, retry_in: float) -> None:
            nonlocal told
            if self._watching or not told:
                told = True
                log.warning("event=endpoints_watch_failed role=%s error=%r action=poll_every_%gs retry_in=%.0fs",
                            self.role, str(exc) or type(exc).__name__, self._refresh, retry_in)
            self._watching = False

        await watch_with_backoff(once, on_failure=failed)

    async def _scrape_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            pods = self.pods()
            if pods:
                await asyncio.gather(*(self._scrape_one(session, p) for p in pods))
            await asyncio.sleep(self._scrape)

    async def _scrape_one(self, session: aiohttp.ClientSession, pod: PodState) -> None:
        try:
            async with session.get(f"http://{pod.address}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)) as response:
                if response.status != 200:
                    raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
                body = await response.content.read(_MAX_METRICS_BYTES)
            pod.running, pod.waiting = parse_load(body.decode("utf-8", errors="replace"))
            if not pod.healthy:
                log.info("event=pod_healthy role=%s pod=%s", self.role, pod.address)
            pod.healthy = True
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if pod.healthy:
                log.warning("event=scrape_failed role=%s pod=%s error=%r", self.role, pod.address,
                            str(exc) or type(exc).__name__)
            pod.healthy = False
        pod.scraped_at = time.monotonic()


def service_watch(api: object, *, namespace: str, service: str) -> ChangeWatch:
    """A ``ChangeWatch`` of ``service``'s EndpointSlices (``api``: a kubernetes_asyncio ApiClient)."""

    async def watch(on_event: Callable[[], None]) -> None:
        await kube.watch_endpoint_slices(api, namespace=namespace, service=service,  # type: ignore[arg-type]
                                         on_event=on_event)

    return watch


def service_lister(api: object, *, namespace: str, service: str) -> EndpointLister:
    """A lister of ``service``'s ready endpoints with their pods' kvNamespace (``api``: a kubernetes_asyncio ApiClient)."""

    async def list_ready() -> dict[str, str | None]:
        ready = await kube.ready_endpoints(api, namespace=namespace, service=service)  # type: ignore[arg-type]
        if not ready:
            return {}
        labels = await kube.pod_kv_namespaces(api, namespace=namespace)  # type: ignore[arg-type]
        return kube.namespaces_of(ready, labels)

    return list_ready
