"""Leader election on a coordination.k8s.io/v1 Lease, so that of N operator replicas exactly one reconciles.

Use case: two operator Pods for availability; kopf itself only has peering
(which pauses, but does not fence). The elector follows client-go's
leaderelection: the holder renews every ``retry_period``; a candidate takes
the Lease only after it has seen the same record unchanged for
``lease_duration`` by ITS OWN clock (no clock-skew assumptions); updates
carry the resourceVersion, so two candidates cannot both win.

THE ONE RULE: a leader that has not renewed for ``renew_deadline`` must stop
writing before anybody else may take over, so ``renew_deadline`` is strictly
shorter than ``lease_duration``. ``is_leader()`` is that fence, checked before
every write; stopping kopf is the second line.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NewType

from daybreak.operator import metrics
from daybreak.operator.kube import LEASE, KubeClient, KubeError

logger = logging.getLogger(__name__)

Identity = NewType("Identity", str)


def make_identity(prefix: str | None = None) -> Identity:
    """``prefix`` (default: the hostname, which is the Pod name in a cluster) plus a random suffix:
    two processes never share an identity, not even a restarted container of the same Pod."""
    return Identity(f"{prefix or socket.gethostname()}_{uuid.uuid4().hex[:8]}")


@dataclass(frozen=True)
class LeaseTiming:
    """Timing of the election in seconds; hand-over after a crash takes about lease_duration + 2 * retry_period."""

    lease_duration: float = 8.0
    renew_deadline: float = 5.0
    retry_period: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "lease timing: need 0 < retry_period < renew_deadline < lease_duration, got "
                f"retry_period={self.retry_period} renew_deadline={self.renew_deadline} "
                f"lease_duration={self.lease_duration}")


def _now_rfc3339() -> str:
    # MicroTime: RFC 3339 with microseconds.
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Campaign for, hold and release one Lease."""

    def __init__(self, client: KubeClient, *, namespace: str, name: str, identity: Identity,
                 timing: LeaseTiming | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing or LeaseTiming()
        self._renewed_at: float | None = None  # monotonic time of our last successful write as holder
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, transitions) last seen
        self._observed_at = 0.0  # monotonic time the observed record last changed
        self._transitions = 0

    # -- the fence -------------------------------------------------------------------
    def is_leader(self) -> bool:
        """True while our last renewal is younger than renew_deadline (by the monotonic clock)."""
        return self._renewed_at is not None and time.monotonic() - self._renewed_at < self.timing.renew_deadline

    def holder(self) -> str | None:
        return self._observed[0] if self._observed else None

    # -- campaign ----------------------------------------------------------------------
    async def acquire(self) -> None:
        """Return once we hold the Lease; retries forever (cancel to give up)."""
        logger.info("leader election campaigning lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
        while True:
            try:
                if await self._try_acquire_or_renew():
                    logger.info("leader election acquired lease=%s/%s identity=%s transitions=%d",
                                self.namespace, self.name, self.identity, self._transitions)
                    metrics.LEADER_TRANSITIONS.inc()
                    return
            except KubeError as exc:
                logger.warning("leader election error lease=%s/%s error=%s", self.namespace, self.name, exc)
            await asyncio.sleep(self.timing.retry_period * random.uniform(1.0, 1.2))

    async def hold(self) -> None:
        """Renew every retry_period; returns when a renewal could not be made within renew_deadline."""
        while True:
            await asyncio.sleep(self.timing.retry_period)
            while True:
                timeout = max(self.timing.retry_period, self.timing.renew_deadline / 2)
                try:
                    if await asyncio.wait_for(self._try_acquire_or_renew(), timeout=timeout):
                        break
                    if self.holder() not in (None, self.identity):
                        logger.warning("leader election lost lease=%s/%s holder=%s",
                                       self.namespace, self.name, self.holder())
                        self._renewed_at = None
                        return
                except (KubeError, TimeoutError) as exc:
                    logger.warning("leader election renew failed lease=%s/%s error=%s",
                                   self.namespace, self.name, exc or "timeout")
                if not self.is_leader():
                    logger.warning("leader election renew deadline passed lease=%s/%s deadline=%.1fs",
                                   self.namespace, self.name, self.timing.renew_deadline)
                    self._renewed_at = None
                    return
                await asyncio.sleep(self.timing.retry_period / 2)

    async def release(self) -> None:
        """Give the Lease up (graceful shutdown) so a standby takes over without waiting for expiry."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = await self.client.get(LEASE, self.name, namespace=self.namespace)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            # client-go's convention: empty holder, 1 s duration: the next candidate wins at once.
            lease["spec"] = {**spec, "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now_rfc3339()}
            await self.client.replace(LEASE, lease, namespace=self.namespace)
            logger.info("leader election released lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
        except KubeError as exc:
            logger.warning("leader election release failed lease=%s/%s error=%s", self.namespace, self.name, exc)

    # -- one round ------------------------------------------------------------------------
    async def _try_acquire_or_renew(self) -> bool:
        started = time.monotonic()
        now = _now_rfc3339()
        duration = max(1, round(self.timing.lease_duration))
        lease = await self.client.get_or_none(LEASE, self.name, namespace=self.namespace)
        if lease is None:
            body: dict[str, Any] = {
                "apiVersion": LEASE.api_version, "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": duration,
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0},
            }
            try:
                await self.client.create(LEASE, body, namespace=self.namespace)
            except KubeError as exc:
                if exc.conflict:  # somebody created it first
                    return False
                raise
            self._renewed_at = started
            self._observe(body["spec"], started)
            return True

        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        self._observe(spec, started)
        remote_duration = float(spec.get("leaseDurationSeconds") or duration)
        if holder and holder != self.identity and started - self._observed_at < remote_duration:
            return False  # held by someone else, and not expired by our clock
        transitions = int(spec.get("leaseTransitions") or 0)
        new_spec = {"holderIdentity": self.identity, "leaseDurationSeconds": duration, "renewTime": now,
                    "acquireTime": spec.get("acquireTime") or now, "leaseTransitions": transitions}
        if holder != self.identity:
            new_spec["acquireTime"] = now
            new_spec["leaseTransitions"] = transitions + 1
        lease["spec"] = new_spec
        try:
            # The resourceVersion in metadata makes this a compare-and-swap.
            await self.client.replace(LEASE, lease, namespace=self.namespace)
        except KubeError as exc:
            if exc.conflict:
                return False
            raise
        self._renewed_at = started
        self._transitions = int(new_spec["leaseTransitions"] or 0)
        self._observe(new_spec, started)
        return True

    def _observe(self, spec: dict[str, Any], at: float) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed = record
            self._observed_at = at
