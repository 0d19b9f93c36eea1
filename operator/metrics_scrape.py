"""Reading engine pods' /metrics for the planner: pod addresses from the API, one bounded HTTP GET each.

The engines are other tenants' processes as far as the operator is concerned:
every scrape has a deadline and a size limit, a body that is not Prometheus
text is a missing sample (the pod counts as silent, never as idle), and one
slow pod cannot hold up the others (all are scraped concurrently).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from daybreak.operator.engine_metrics import MetricsError, PodSample, parse_metrics

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # a vLLM /metrics page is tens of KiB; anything this large is not one


@dataclass(frozen=True)
class Target:
    """One pod to scrape."""

    pod: str
    url: str


def pod_is_live(pod: Mapping[str, Any]) -> bool:
    """A pod the planner counts: it exists and is not being deleted (a terminating pod is already gone)."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp")


def scrape_target(pod: Mapping[str, Any], *, port: int, path: str = "/metrics") -> Target | None:
    """Where a running pod's metrics are; None while it has no IP or is not running (it stays silent)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Target(pod=str(meta.get("name")), url=f"http://{host}:{port}{path}")


async def _scrape_one(session: aiohttp.ClientSession, target: Target, *, deadline_seconds: float) -> PodSample | None:
    try:
        async with session.get(target.url, timeout=aiohttp.ClientTimeout(total=deadline_seconds)) as resp:
            if resp.status != 200:
                logger.debug("scrape refused pod=%s status=%d", target.pod, resp.status)
                return None
            body = await resp.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                logger.warning("scrape too large pod=%s limit=%d", target.pod, MAX_BODY_BYTES)
                return None
            text = body.decode("utf-8", errors="replace")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        logger.debug("scrape failed pod=%s url=%s error=%r", target.pod, target.url, exc)
        return None
    try:
        return parse_metrics(text, pod=target.pod, time=time.monotonic())
    except MetricsError as exc:
        logger.warning("scrape unusable pod=%s error=%s", target.pod, exc)
        return None


async def scrape(session: aiohttp.ClientSession, targets: Iterable[Target], *, deadline_seconds: float) -> dict[str, PodSample]:
    """Samples of every target that answered in time, by pod name."""
    targets = list(targets)
    results = await asyncio.gather(*(_scrape_one(session, t, deadline_seconds=deadline_seconds) for t in targets))
    return {t.pod: r for t, r in zip(targets, results, strict=True) if r is not None}
