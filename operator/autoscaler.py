"""The planner's loop in the operator: every intervalSeconds per autoscaled PDDeployment, scrape, decide, hand over.

Runs inside one leadership term (the term starts and stops it, so a standby
never plans). It only reads (pods, their /metrics) and annotates pods with
their deletion cost; the replica change itself is handed to the
``submit_scale`` callable the wiring gives it (the PDDeployment reconciler's,
which queues the object), so the decision, status.lastScale and the
Deployment apply happen in one reconcile of that object and never race
another worker. It knows no reconciler and no controller. Every write checks
the leader fence first.

It also picks each deployment's planner policy (``autoscaling.policy``),
feeds the planner when each pod was created and when it became Ready (for
the start-up time it learns), and, where a role may go to zero
(``minReplicas: 0``), reads the router pods' ``daybreak_router_held_requests``
gauge (their /metrics on the engine port): the requests waiting for engines
that bring the roles back.

ORDER ON SCALE-IN: the deletion costs are written before the lower replica
count is handed over, so the ReplicaSet controller already knows which pod
is the cheapest to lose when it picks the victim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Protocol

import aiohttp
from pydantic import ValidationError

from daybreak.api.enginepod import max_num_seqs
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import metrics
from daybreak.operator.engine_metrics import RouterBacklog, parse_router_backlog
from daybreak.operator.kube import POD, KubeClient, KubeError, Manifest
from daybreak.operator.metrics_scrape import Target, pod_is_live, scrape, scrape_target
from daybreak.operator.planner import (
    Decision,
    RolePlanner,
    Targets,
    deletion_costs,
    policy_for,
    prefill_handover,
)

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TICK_SECONDS = 0.5  # how often due deployments are looked for (intervals are whole seconds)
MAX_SCRAPE_TIMEOUT = 2.0


def targets_of(pdd: PDDeployment) -> Targets:
    a = pdd.spec.autoscaling
    return Targets(ttft_seconds=a.ttft_seconds, itl_seconds=a.itl_seconds, interval_seconds=float(a.interval_seconds),
                   scale_up_stabilization_seconds=float(a.scale_up_stabilization_seconds),
                   scale_down_stabilization_seconds=float(a.scale_down_stabilization_seconds),
                   max_scale_up_step=a.max_scale_up_step, max_scale_down_step=a.max_scale_down_step,
                   tolerance=a.tolerance)


def ready_at(pods: Iterable[Manifest], *, now_wall: float, now: float) -> dict[str, float]:
    """Each Ready pod and when it became Ready, moved onto the planner's monotonic clock ``now``.

    The Ready condition's lastTransitionTime is the API's wall clock (whole seconds): its age at
    ``now_wall`` is subtracted from ``now``. A Ready pod without the time counts as Ready now.
    """
    out: dict[str, float] = {}
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") != "Ready" or cond.get("status") != "True":
                continue
            age = _age(cond.get("lastTransitionTime"), now_wall=now_wall)
            out[str(pod["metadata"]["name"])] = now - (age or 0.0)
    return out


def created_at(pods: Iterable[Manifest], *, now_wall: float, now: float) -> dict[str, float]:
    """Each pod's creation time on the planner's clock ``now``, for pods whose containers never restarted.

    A pod nobody timed from a decision (there before the planner, or created by a rollout or a
    replacement) is timed from its creation to its Ready transition; after a container restart that
    transition is the restart's, not the start's, so such a pod is left out.
    """
    out: dict[str, float] = {}
    for pod in pods:
        stamp = (pod.get("metadata") or {}).get("creationTimestamp")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        age = _age(stamp, now_wall=now_wall)
        if age is None or any(int(c.get("restartCount") or 0) > 0 for c in statuses):
            continue
        out[str(pod["metadata"]["name"])] = now - age
    return out


def _age(stamp: object, *, now_wall: float) -> float | None:
    """Seconds from an API timestamp (RFC 3339, whole seconds) to ``now_wall``, never negative; None if unset
    or unreadable."""
    if not stamp:
        return None
    try:
        return max(0.0, now_wall - datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


class SubmitScale(Protocol):
    """Where decisions go: the owner of the PDDeployment's reconcile applies them (the planner never writes
    replicas itself)."""

    def __call__(self, *, namespace: str, name: str, decisions: list[Decision]) -> None: ...


class Autoscaler:
    """Planner state per (namespace, deployment, role) and the loop that feeds it."""

    def __init__(self, client: KubeClient, *, deployments: Mapping[tuple[str, str], Manifest],
                 check_leader: Callable[[], None], submit_scale: SubmitScale) -> None:
        """``deployments``: the term's latest PDDeployment bodies by (namespace, name), read at every tick;
        ``check_leader`` raises when this process may not write; ``submit_scale`` takes the decisions."""
        self.client = client
        self.deployments = deployments
        self.check_leader = check_leader
        self.submit_scale = submit_scale
        self.planners: dict[tuple[str, str, str], RolePlanner] = {}
        self.due: dict[tuple[str, str], float] = {}
        self.running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        self._session = aiohttp.ClientSession()
        try:
            while True:
                await asyncio.sleep(TICK_SECONDS)
                self._tick(time.monotonic())
        finally:
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)
            await self._session.close()

    def _tick(self, now: float) -> None:
        live = set()
        for (ns, name), body in list(self.deployments.items()):
            auto = ((body.get("spec") or {}).get("autoscaling") or {})
            if not auto.get("enabled"):
                continue
            key = (ns, name)
            live.add(key)
            if now < self.due.get(key, 0.0) or not self.running.get(key, _DONE).done():
                continue
            self.due[key] = now + float(auto.get("intervalSeconds") or 15)
            self.running[key] = asyncio.create_task(self._plan_safely(ns, name, body), name=f"planner {ns}/{name}")
        for gone in [k for k in self.due if k not in live]:  # deleted or autoscaling turned off: forget it
            self.due.pop(gone, None)
            self.running.pop(gone, None)
            for role in pdd_mod.ENGINE_ROLES:
                self.planners.pop((*gone, role.value), None)

    async def _plan_safely(self, ns: str, name: str, body: Manifest) -> None:
        try:
            await self.plan(ns, name, body)
        except KubeError as exc:
            logger.warning("planner interval failed namespace=%s name=%s status=%s error=%s", ns, name, exc.status,
                           exc.message or exc.reason)
        except Exception:  # a bug must not end the loop for every other deployment
            logger.exception("planner interval crashed namespace=%s name=%s", ns, name)

    async def plan(self, ns: str, name: str, body: Manifest) -> list[Decision]:
        """One interval for one deployment: scrape both roles, decide, annotate victims, hand changes over."""
        try:
            pdd = PDDeployment.from_body(body)
        except ValidationError:
            return []  # the reconcile reports invalid specs
        targets = targets_of(pdd)
        timeout = min(MAX_SCRAPE_TIMEOUT, targets.interval_seconds / 2)
        assert self._session is not None
        decisions = []
        # Where a role may go to zero, the router's held requests are what bring it back; with
        # router.prefillConcurrency they are also prefill's backlog (requests no engine queue shows), and so
        # are the prompts decode computes for lack of prefill room (router.decodePrefill).
        backlog = (await self._router_backlog(ns, pdd, deadline_seconds=timeout)
                   if pdd.spec.router.prefill_concurrency > 0
                   or any(getattr(pdd.spec, r.value).bounds[0] == 0 for r in pdd_mod.ENGINE_ROLES) else None)
        held = backlog.held if backlog is not None else None
        upstream = backlog.held + backlog.decode_prefill if backlog is not None else 0.0
        prefill_left = 0  # prefill pods that exist, terminating ones included (decode goes to zero after them)
        arrivals: float | None = None  # prefill's arrival rate: decode's load a prefill from now
        prefilling = 0.0  # the requests prefill holds: decode sequences a prefill from now
        prefill_ttft: float | None = None  # prefill's TTFT p90: what is left of the target is decode's to wait
        handover: float | None = None  # requests/s prefill's pods pass on flat out: how fast decode's load can come
        for role in pdd_mod.ENGINE_ROLES:  # prefill first
            selector = ",".join(f"{k}={v}" for k, v in pdd_mod.selector_for(pdd, role).items())
            every = await self.client.list(POD, namespace=ns, label_selector=selector)
            pods = [p for p in every if pod_is_live(p)]
            if role is Role.PREFILL:
                prefill_left = len(every)
            names = [str(p["metadata"]["name"]) for p in pods]
            wanted = [t for p in pods if (t := scrape_target(p, port=pdd_mod.ENGINE_PORT)) is not None]
            samples = await scrape(self._session, wanted, deadline_seconds=timeout)
            failed = len(names) - len(samples)
            if failed:
                metrics.PLANNER_SCRAPE_FAILURES.labels(namespace=ns, deployment=name, role=role.value).inc(failed)
            planner = self.planners.setdefault((ns, name, role.value), RolePlanner(role.value))
            if planner.policy.name != pdd.spec.autoscaling.policy.value:
                planner.policy = policy_for(pdd.spec.autoscaling.policy.value)  # changed in the spec: keep learning
            current = pdd_mod.role_replicas(pdd, role)
            now, wall = time.monotonic(), time.time()
            decision = planner.step(now=now, pods=names, samples=samples, current=current,
                                    bounds=getattr(pdd.spec, role.value).bounds, targets=targets,
                                    arrivals=arrivals if role is Role.DECODE else None,
                                    prefilling=prefilling if role is Role.DECODE else 0.0,
                                    ready_at=ready_at(pods, now_wall=wall, now=now),
                                    created_at=created_at(pods, now_wall=wall, now=now), held=held,
                                    prefill_left=prefill_left if role is Role.DECODE else 0,
                                    max_num_seqs=max_num_seqs(pdd.spec.engine.args) if role is Role.DECODE else None,
                                    prefill_ttft=prefill_ttft if role is Role.DECODE else None,
                                    upstream=upstream if role is Role.PREFILL else 0.0,
                                    handover=handover if role is Role.DECODE else None)
            if role is Role.PREFILL:
                arrivals = decision.numbers.get("arrival_rate")
                prefilling = decision.numbers.get("in_flight_now", 0.0)
                prefill_ttft = decision.numbers.get("ttft_p90_s")
                handover = prefill_handover(decision)
            self._export(ns, name, decision)
            logger.debug("planner namespace=%s name=%s role=%s current=%d desired=%d reason=%r", ns, name,
                         role.value, decision.current, decision.desired, decision.reason)
            if decision.changed:
                if decision.desired < decision.current:
                    await self._mark_victims(ns, pods, samples=planner.samples)
                decisions.append(decision)
        if decisions:
            self.submit_scale(namespace=ns, name=name, decisions=decisions)
        return decisions

    async def _router_backlog(self, ns: str, pdd: PDDeployment, *, deadline_seconds: float) -> RouterBacklog | None:
        """What the deployment's routers hold or send past prefill (summed); None when no router reports it."""
        if not pdd.spec.router.enabled:
            return None
        selector = ",".join(f"{k}={v}" for k, v in pdd_mod.selector_for(pdd, Role.ROUTER).items())
        routers = [p for p in await self.client.list(POD, namespace=ns, label_selector=selector) if pod_is_live(p)]
        wanted = [t for p in routers if (t := scrape_target(p, port=pdd_mod.ENGINE_PORT)) is not None]
        found = await asyncio.gather(*(self._backlog_one(t, deadline_seconds=deadline_seconds) for t in wanted))
        values = [v for v in found if v is not None]
        return sum(values[1:], values[0]) if values else None

    async def _backlog_one(self, target: Target, *, deadline_seconds: float) -> RouterBacklog | None:
        assert self._session is not None
        try:
            async with self._session.get(target.url, timeout=aiohttp.ClientTimeout(total=deadline_seconds)) as resp:
                if resp.status != 200:
                    return None
                text = (await resp.content.read(1 << 20)).decode("utf-8", errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        return parse_router_backlog(text)

    def _export(self, ns: str, name: str, d: Decision) -> None:
        for key, value in d.numbers.items():
            metrics.PLANNER_INPUT.labels(namespace=ns, deployment=name, role=d.role, input=key).set(value)
        replicas = metrics.PLANNER_REPLICAS
        replicas.labels(namespace=ns, deployment=name, role=d.role, kind="current").set(d.current)
        replicas.labels(namespace=ns, deployment=name, role=d.role, kind="desired").set(d.desired)
        if "recommended" in d.numbers:
            replicas.labels(namespace=ns, deployment=name, role=d.role, kind="recommended").set(d.numbers["recommended"])
        if d.changed:
            direction = "up" if d.desired > d.current else "down"
            metrics.PLANNER_DECISIONS.labels(namespace=ns, deployment=name, role=d.role, direction=direction).inc()

    async def _mark_victims(self, ns: str, pods: list[Manifest], *, samples: Any) -> None:
        """Set every pod's deletion cost from its last sample: the ReplicaSet deletes the lowest first."""
        costs = deletion_costs(samples, [str(p["metadata"]["name"]) for p in pods])
        for pod in pods:
            pod_name = str(pod["metadata"]["name"])
            value = str(costs[pod_name])
            if ((pod["metadata"].get("annotations") or {}).get(DELETION_COST)) == value:
                continue
            self.check_leader()
            with contextlib.suppress(KubeError):  # a pod that vanished meanwhile needs no cost
                await self.client.patch_merge(
                    POD, pod_name, {"metadata": {"annotations": {DELETION_COST: value}}}, namespace=ns)
        logger.info("scale-in victims ranked namespace=%s costs=%s", ns, costs)


class _Done:
    def done(self) -> bool:
        return True


_DONE: Any = _Done()

