"""``daybreak status`` (also ``kubectl daybreak status``): pools, deployments, tiers, hit rates and node topology.

It reads the API (KVPools, PDDeployments, KVNodes) and scrapes each ready agent's Prometheus ``/metrics``
(hit rates and bytes served), then prints readable tables no wider than 100 columns, or ``-o json``.
Collecting (``collect``) and rendering (``render_table``, ``render_json``) are separate: the renderers are
pure functions of a ``Snapshot`` and unit-tested with fixture objects. An agent whose metrics cannot be read
is reported as ``metrics unreachable: <reason>``; an API that cannot be reached is an error with exit 1.
Heavy imports (the Kubernetes client, httpx) happen inside the functions, so ``kubectl daybreak version``
stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from daybreak.api.kube import Condition
from daybreak.api.kvpool import KVPool
from daybreak.api.metrics import (
    STORE_BYTES,
    STORE_BYTES_OUT,
    STORE_HITS,
    STORE_MISSES,
    TRANSFER_FALLBACK_BYTES,
    total,
)
from daybreak.api.node import KVNode
from daybreak.api.pddeployment import PDDeployment
from daybreak.errors import DaybreakError

logger = logging.getLogger(__name__)

WIDTH = 100
TIERS = ("hbm", "dram", "ssd")
# Where the operator tells agents to serve /metrics when the pool's Service does not say (OperatorSettings).
METRICS_TIMEOUT_SECONDS = 2.0
# A hostile or broken endpoint must not make the command read without bound.
METRICS_MAX_BYTES = 4 << 20


class StatusError(DaybreakError):
    """The API could not be read; the message says what was tried and what to do next."""


# -- what was collected ---------------------------------------------------------------------------------------

@dataclass
class AgentMetrics:
    """One agent's scrape: counters summed over label sets, or why it could not be read."""

    node: str
    endpoint: str
    """host:port of the metrics server."""
    error: str | None = None
    hits: dict[str, float] = field(default_factory=dict)
    """Blocks served, per tier."""
    misses: float = 0.0
    bytes_out: dict[str, float] = field(default_factory=dict)
    """Bytes read out, per tier."""
    transfer_bytes: dict[str, float] = field(default_factory=dict)
    """Block bytes the store moved, per transport (``daybreak_store_bytes_total``, reads and writes)."""
    fallback_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes the transfer engine moved on a later transport than the preferred one, per ``preferred->used``."""

    @property
    def lookups(self) -> float:
        return sum(self.hits.values()) + self.misses

    def hit_rate(self) -> float | None:
        return sum(self.hits.values()) / self.lookups if self.error is None and self.lookups else None


@dataclass
class PoolView:
    """A KVPool and its agents' metrics."""

    pool: KVPool
    metrics_port: int
    agents: list[AgentMetrics] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.pool.metadata.namespace}/{self.pool.metadata.name}"

    def _reached(self) -> list[AgentMetrics]:
        return [a for a in self.agents if a.error is None]

    def hit_rate(self) -> float | None:
        reached = self._reached()
        lookups = sum(a.lookups for a in reached)
        return sum(sum(a.hits.values()) for a in reached) / lookups if lookups else None

    def tier_hit_rate(self, tier: str) -> float | None:
        """Share of all lookups served from ``tier``."""
        reached = self._reached()
        lookups = sum(a.lookups for a in reached)
        return sum(a.hits.get(tier, 0.0) for a in reached) / lookups if lookups else None

    def transports(self) -> list[str]:
        """Transports the ready agents report running (KVPool status.endpoints), in the pool's preference order."""
        offered = {t.value for e in self.pool.status.endpoints for t in e.transports}
        return [t.value for t in self.pool.spec.transport.preference if t.value in offered]

    def transfer_bytes(self) -> dict[str, float]:
        return self._summed("transfer_bytes")

    def fallback_bytes(self) -> dict[str, float]:
        return self._summed("fallback_bytes")

    def _summed(self, counter: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for agent in self._reached():
            for label, value in getattr(agent, counter).items():
                out[label] = out.get(label, 0.0) + value
        return out


@dataclass
class Snapshot:
    """Everything ``daybreak status`` shows, as read at ``now``."""

    server: str
    namespace: str | None
    """The namespace shown; None for all namespaces."""
    now: datetime
    pools: list[PoolView] = field(default_factory=list)
    deployments: list[PDDeployment] = field(default_factory=list)
    nodes: list[KVNode] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What could not be read and why (an RBAC denial on KVNodes, ...)."""


# -- pure helpers -----------------------------------------------------------------------------------------------

def health(conditions: Sequence[Condition]) -> str:
    """One word from Ready/Degraded/Progressing: Degraded, Ready, Progressing, NotReady or Unknown."""
    by_type = {c.type: c.status.value for c in conditions}
    if by_type.get("Degraded") == "True":
        return "Degraded"
    if by_type.get("Ready") == "True":
        return "Ready"
    if by_type.get("Progressing") == "True":
        return "Progressing"
    if by_type.get("Ready") == "False":
        return "NotReady"
    return "Unknown"


def problems(conditions: Sequence[Condition]) -> list[Condition]:
    """Conditions a human should read: Ready not True, Degraded or Progressing True."""
    out = []
    for c in conditions:
        bad = c.status.value != "True" if c.type == "Ready" else c.status.value == "True"
        if bad and c.type in ("Ready", "Degraded", "Progressing"):
            out.append(c)
    return out


def human_bytes(value: float) -> str:
    """Binary units, three significant digits: 0 B, 512 B, 1.5 KiB, 64.0 GiB."""
    if value < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def age(then: str | datetime | None, now: datetime) -> str:
    """``12s``, ``5m``, ``3h``, ``2d`` (kubectl's style), or ``-``."""
    if then is None:
        return "-"
    if isinstance(then, str):
        try:
            then = datetime.fromisoformat(then.replace("Z", "+00:00"))
        except ValueError:
            return "?"
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, width: int = WIDTH,
          keep: Sequence[int] = ()) -> list[str]:
    """Left-aligned columns two spaces apart; the widest columns are clipped (``...``) until a line fits
    ``width``, the columns in ``keep`` only once no other can give more."""
    body = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    floor = [max(len(h), 8) for h in headers]
    gaps = 2 * (len(headers) - 1)
    while sum(widths) + gaps > width:
        shrinkable = [i for i in range(len(widths)) if widths[i] > floor[i]]
        candidates = [i for i in shrinkable if i not in keep] or shrinkable
        if not candidates:
            break
        widths[max(candidates, key=lambda i: widths[i])] -= 1
    lines = []
    for row in [list(headers), *body]:
        cells = [_clip(cell, w).ljust(w) for cell, w in zip(row, widths, strict=True)]
        lines.append(_clip("  ".join(cells).rstrip(), width))
    return lines


def _wrap(text: str, *, indent: str = "  ", width: int = WIDTH) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False) or [indent]


def _condition_lines(conditions: Sequence[Condition]) -> list[str]:
    lines = []
    for c in problems(conditions):
        text = f"{c.type}={c.status.value} {c.reason or ''}: {c.message or ''}".rstrip(": ")
        lines += _wrap(text, indent="    ")
    return lines


def _ranges(ids: Sequence[str]) -> str:
    """GPU0,GPU1,GPU2,GPU5 -> GPU0-2,GPU5 (ids sharing a prefix and consecutive numbers)."""
    parsed: list[tuple[str, int]] = []
    for i in ids:
        prefix = i.rstrip("0123456789")
        digits = i[len(prefix):]
        if not digits:
            return ",".join(ids)
        parsed.append((prefix, int(digits)))
    out: list[str] = []
    start = 0
    for k in range(1, len(parsed) + 1):
        if k == len(parsed) or parsed[k][0] != parsed[k - 1][0] or parsed[k][1] != parsed[k - 1][1] + 1:
            prefix, first = parsed[start]
            last = parsed[k - 1][1]
            out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")
            start = k
    return ",".join(out)


def _group_by(mapping: dict[str, str], order: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Invert accelerator -> value into value -> accelerators, keeping accelerator order."""
    groups: dict[str, list[str]] = {}
    for acc in order:
        if acc in mapping:
            groups.setdefault(mapping[acc], []).append(acc)
    return list(groups.items())


def node_summary(node: KVNode) -> dict[str, Any]:
    """The topology facts shown for a node: accelerators, NICs, link classes, nearest NIC and GDR per GPU."""
    s = node.status
    accs = [a.id for a in s.accelerators]
    nic_ids = {n.id for n in s.nics}
    kinds: dict[str, dict[str, int]] = {"gpu-gpu": {}, "gpu-nic": {}}
    for link in s.links:
        pair = "gpu-nic" if link.a in nic_ids or link.b in nic_ids else "gpu-gpu"
        kinds[pair][link.link] = kinds[pair].get(link.link, 0) + 1
    nic_names = {n.id: n.name for n in s.nics}
    nearest = {acc: ranked[0] for acc, ranked in s.nic_rank.items() if ranked}
    models = sorted({a.model or a.vendor for a in s.accelerators})
    memory = sorted({a.memory_bytes for a in s.accelerators})
    return {
        "name": node.metadata.name,
        "accelerator": s.accelerator or "none",
        "accelerators": len(accs),
        "models": models,
        "memoryBytesPerDevice": memory[0] if len(memory) == 1 else memory,
        "runtime": s.runtime,
        "linkDomain": s.link_domain,
        "nics": [{"id": n.id, "name": n.name, "active": n.active, "linkLayer": n.link_layer, "rate": n.rate}
                 for n in s.nics],
        "links": kinds,
        "nearestNic": {acc: f"{nic}({nic_names.get(nic, '?')})" for acc, nic in nearest.items()},
        "gdr": {acc: s.gdr.get(acc, []) for acc in accs},
        "rdma": None if s.rdma is None else {"available": s.rdma.available, "reason": s.rdma.reason},
        "transports": list(s.transports),
        "capacity": None if s.capacity is None else s.capacity.to_dict(),
        "used": None if s.used is None else s.used.to_dict(),
        "health": health(s.conditions),
        "heartbeatTime": s.heartbeat_time,
        "agentVersion": s.agent_version,
    }


# -- rendering --------------------------------------------------------------------------------------------------

def _scope(snapshot: Snapshot) -> str:
    return "all namespaces" if snapshot.namespace is None else f"namespace {snapshot.namespace}"


def _pool_section(snapshot: Snapshot) -> list[str]:
    lines = ["KV POOLS"]
    if not snapshot.pools:
        return [*lines, f"  no KVPools in {_scope(snapshot)}"]
    rows = []
    for view in snapshot.pools:
        st = view.pool.status
        rows.append([view.key, health(st.conditions), f"{st.nodes.ready}/{st.nodes.desired}",
                     percent(view.hit_rate()), ",".join(view.transports()) or "-",
                     f"{sum(1 for a in view.agents if a.error is None)}/{len(view.agents)}"])
    lines += table(["POOL", "HEALTH", "NODES", "HIT RATE", "TRANSPORTS", "METRICS"], rows)
    for view in snapshot.pools:
        cond = _condition_lines(view.pool.status.conditions)
        if cond:
            lines += [_clip(f"  {view.key}:", WIDTH), *cond]
    return lines


def _tier_section(snapshot: Snapshot) -> list[str]:
    rows = []
    for view in snapshot.pools:
        spec, st = view.pool.spec.tiers, view.pool.status
        for tier in TIERS:
            tier_spec = getattr(spec, tier)
            capacity, used = getattr(st.capacity, tier), getattr(st.used, tier)
            if (tier_spec is None or not tier_spec.enabled) and not capacity:
                continue
            use = percent(used / capacity) if capacity else "-"
            rows.append([view.key, tier, human_bytes(capacity), human_bytes(used), use,
                         percent(view.tier_hit_rate(tier))])
    if not rows:
        return []
    return ["TIERS", *table(["POOL", "TIER", "CAPACITY", "USED", "USE", "HITS"], rows)]


def _agent_section(snapshot: Snapshot) -> list[str]:
    """One small table per pool (no pool column: the unreachable reasons need the width)."""
    lines: list[str] = []
    for view in snapshot.pools:
        if not view.agents:
            continue
        rows = []
        for agent in view.agents:
            if agent.error is not None:
                rows.append([agent.node, agent.endpoint, "-", "-", f"metrics unreachable: {agent.error}"])
            else:
                rows.append([agent.node, agent.endpoint, percent(agent.hit_rate()),
                             human_bytes(sum(agent.bytes_out.values())), "ok"])
        lines += [_clip(f"AGENTS of {view.key}", WIDTH),
                  *table(["NODE", "METRICS", "HIT RATE", "READ", "STATUS"], rows, keep=(4,))]
    moved_rows = [[view.key, transport, human_bytes(value)]
                  for view in snapshot.pools for transport, value in sorted(view.transfer_bytes().items())]
    # Bytes a later transport moved because the preferred one failed: never a silent fallback.
    moved_rows += [[view.key, f"{pair} (fallback)", human_bytes(value)]
                   for view in snapshot.pools for pair, value in sorted(view.fallback_bytes().items()) if value]
    if moved_rows:
        lines += ["TRANSFERS", *table(["POOL", "TRANSPORT", "BYTES MOVED"], moved_rows)]
    return lines


def _replicas(ready: int, desired: int) -> str:
    return f"{ready}/{desired}"


def _deployment_section(snapshot: Snapshot) -> list[str]:
    lines = ["PD DEPLOYMENTS"]
    if not snapshot.deployments:
        return [*lines, f"  no PDDeployments in {_scope(snapshot)}"]
    rows = []
    for d in snapshot.deployments:
        spec, st = d.spec, d.status
        router = _replicas(st.router.ready_replicas, spec.router.replicas) if spec.router.enabled else "off"
        last = st.last_scale
        scale = f"{last.role.value} {last.from_replicas}->{last.to_replicas} {age(last.time, snapshot.now)}" \
            if last else "-"
        rows.append([f"{d.metadata.namespace}/{d.metadata.name}", spec.pool_ref.name, spec.engine.kind.value,
                     health(st.conditions), _replicas(st.prefill.ready_replicas, spec.prefill.replicas),
                     _replicas(st.decode.ready_replicas, spec.decode.replicas), router, scale])
    lines += table(["DEPLOYMENT", "POOL", "ENGINE", "HEALTH", "PREFILL", "DECODE", "ROUTER", "LAST SCALE"], rows)
    for d in snapshot.deployments:
        extra = _condition_lines(d.status.conditions)
        if d.status.kv_namespace:
            extra.insert(0, f"    kv namespace {d.status.kv_namespace}"[:WIDTH])
        if extra:
            lines += [_clip(f"  {d.metadata.namespace}/{d.metadata.name}:", WIDTH), *extra]
    return lines


def _node_section(snapshot: Snapshot) -> list[str]:
    lines = ["NODES"]
    if not snapshot.nodes:
        return [*lines, "  no KVNodes (agents publish one per node they run on)"]
    rows = []
    for node in snapshot.nodes:
        n = node_summary(node)
        s = node.status
        accel = f"{n['accelerators']}x {n['accelerator']}" if n["accelerators"] else n["accelerator"]
        active = sum(1 for nic in s.nics if nic.active)
        rdma = "-" if s.rdma is None else ("yes" if s.rdma.available else "no")
        gdr = f"{sum(1 for v in n['gdr'].values() if v)}/{n['accelerators']}" if n["accelerators"] else "-"
        rows.append([n["name"] or "?", accel, s.runtime or "-", f"{len(s.nics)} ({active} up)",
                     rdma, gdr, ",".join(s.transports) or "-", health(s.conditions), age(s.heartbeat_time, snapshot.now)])
    lines += table(["NODE", "ACCELERATORS", "RUNTIME", "NICS", "RDMA", "GDR", "TRANSPORTS", "HEALTH", "SEEN"], rows,
                   keep=(6,))
    for node in snapshot.nodes:
        lines += _node_details(node)
    return lines


def _node_details(node: KVNode) -> list[str]:
    n = node_summary(node)
    s = node.status
    order = [a.id for a in s.accelerators]
    facts: list[str] = []
    if n["models"]:
        memory = n["memoryBytesPerDevice"]
        mem = human_bytes(memory) if isinstance(memory, int) and memory else "?"
        facts.append(f"devices: {', '.join(n['models'])}, {mem} each"
                     + (f"; link domain {s.link_domain}" if s.link_domain and s.link_domain != "none" else ""))
    for pair, label in (("gpu-gpu", "GPU-GPU"), ("gpu-nic", "GPU-NIC")):
        counts = n["links"][pair]
        if counts:
            facts.append(f"{label} links: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    nearest = _group_by({acc: v for acc, v in n["nearestNic"].items()}, order)
    if nearest:
        facts.append("nearest NIC: " + "; ".join(f"{_ranges(accs)} -> {nic}" for nic, accs in nearest))
    gdr = _group_by({acc: ",".join(v) for acc, v in n["gdr"].items() if v}, order)
    if gdr:
        facts.append("GDR: " + "; ".join(f"{_ranges(accs)} via {nics}" for nics, accs in gdr))
    elif s.accelerators and s.nics:
        facts.append("GDR: none (no GPU-NIC path within PXB with peer memory or dma-buf)")
    if s.rdma is not None and not s.rdma.available and s.rdma.reason:
        facts.append(f"rdma unavailable: {s.rdma.reason}")
    for problem in _condition_lines(s.conditions):
        facts.append(problem.strip())
    if not facts:
        return []
    lines = [_clip(f"  {n['name']}:", WIDTH)]
    for fact in facts:
        lines += _wrap(fact, indent="    ")
    return lines


def render_table(snapshot: Snapshot) -> str:
    """Every section as plain text, each line at most ``WIDTH`` columns."""
    lines = [f"Daybreak status of {snapshot.server} ({_scope(snapshot)})", ""]
    for section in (_pool_section, _tier_section, _agent_section, _deployment_section, _node_section):
        part = section(snapshot)
        if part:
            lines += [*part, ""]
    for note in snapshot.notes:
        lines += _wrap(f"note: {note}", indent="")
    return "\n".join(line[:WIDTH] for line in lines).rstrip() + "\n"


def snapshot_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The same facts as the tables, as JSON-ready data (numbers unformatted)."""
    def conditions(items: Sequence[Condition]) -> list[dict[str, Any]]:
        return [c.to_dict() for c in items]

    pools = []
    for view in snapshot.pools:
        st = view.pool.status
        pools.append({
            "namespace": view.pool.metadata.namespace, "name": view.pool.metadata.name,
            "health": health(st.conditions), "conditions": conditions(st.conditions),
            "nodes": st.nodes.to_dict(), "hitRate": view.hit_rate(), "transports": view.transports(),
            "tiers": {tier: {"capacityBytes": getattr(st.capacity, tier), "usedBytes": getattr(st.used, tier),
                             "hitRate": view.tier_hit_rate(tier)} for tier in TIERS},
            "transferBytes": view.transfer_bytes(), "fallbackBytes": view.fallback_bytes(),
            "metricsPort": view.metrics_port,
            "agents": [{"node": a.node, "endpoint": a.endpoint, "reachable": a.error is None, "error": a.error,
                        "hitRate": a.hit_rate(), "hits": a.hits, "misses": a.misses, "bytesOut": a.bytes_out,
                        "transferBytes": a.transfer_bytes, "fallbackBytes": a.fallback_bytes}
                       for a in view.agents],
        })
    deployments = []
    for d in snapshot.deployments:
        dst, spec = d.status, d.spec
        deployments.append({
            "namespace": d.metadata.namespace, "name": d.metadata.name, "pool": spec.pool_ref.name,
            "engine": spec.engine.kind.value, "model": spec.model.name, "health": health(dst.conditions),
            "conditions": conditions(dst.conditions), "kvNamespace": dst.kv_namespace,
            "prefill": {"desired": spec.prefill.replicas, **dst.prefill.to_dict()},
            "decode": {"desired": spec.decode.replicas, **dst.decode.to_dict()},
            "router": {"enabled": spec.router.enabled, "desired": spec.router.replicas, **dst.router.to_dict()},
            "lastScale": dst.last_scale.to_dict() if dst.last_scale else None,
        })
    return {"server": snapshot.server, "namespace": snapshot.namespace, "time": snapshot.now.isoformat(),
            "pools": pools, "deployments": deployments, "nodes": [node_summary(n) for n in snapshot.nodes],
            "notes": snapshot.notes}


def render_json(snapshot: Snapshot) -> str:
    return json.dumps(snapshot_dict(snapshot), indent=2, sort_keys=True) + "\n"


# -- collecting -------------------------------------------------------------------------------------------------

def parse_metrics(text: str, agent: AgentMetrics) -> None:
    """Fill ``agent`` from Prometheus text (the store's and, when present, the transfer engine's counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == total(STORE_HITS):
                tier = labels.get("tier", "?")
                agent.hits[tier] = agent.hits.get(tier, 0.0) + value
            elif name == total(STORE_MISSES):
                agent.misses += value
            elif name == total(STORE_BYTES_OUT):
                tier = labels.get("tier", "?")
                agent.bytes_out[tier] = agent.bytes_out.get(tier, 0.0) + value
            elif name == total(STORE_BYTES):
                transport = labels.get("transport", "?")
                agent.transfer_bytes[transport] = agent.transfer_bytes.get(transport, 0.0) + value
            elif name == total(TRANSFER_FALLBACK_BYTES):
                pair = f"{labels.get('preferred', '?')}->{labels.get('used', '?')}"
                agent.fallback_bytes[pair] = agent.fallback_bytes.get(pair, 0.0) + value


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


async def scrape(client: Any, agent: AgentMetrics) -> AgentMetrics:
    """GET http://<endpoint>/metrics with a short timeout and a size cap; failures land in ``agent.error``."""
    import httpx

    try:
        async with client.stream("GET", f"http://{agent.endpoint}/metrics") as response:
            if response.status_code != 200:
                agent.error = f"HTTP {response.status_code}"
                return agent
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > METRICS_MAX_BYTES:
                    agent.error = f"response larger than {METRICS_MAX_BYTES} bytes"
                    return agent
        parse_metrics(body.decode("utf-8", "replace"), agent)
    except httpx.TimeoutException:
        agent.error = f"timed out after {METRICS_TIMEOUT_SECONDS:g} s"
    except httpx.HTTPError as exc:
        agent.error = _short_reason(exc)
    except ValueError as exc:  # the Prometheus parser's complaint about a malformed exposition
        agent.error = f"malformed metrics: {exc}"
    return agent


def _short_reason(exc: BaseException) -> str:
    """``connection refused`` rather than httpx's "All connection attempts failed": the OS error in the chain."""
    seen: BaseException | None = exc
    for _ in range(8):  # causes are chained a few levels deep; never loop on a cycle
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        if isinstance(seen, OSError) and seen.strerror:
            return str(seen.strerror).lower()
        seen = seen.__cause__ or seen.__context__
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:120]


async def _metrics_port(kube: Any, view_pool: KVPool, *, override: int | None) -> int:
    """The port named ``metrics`` on the pool's agent Service (what the operator set), else the default."""
    if override:
        return override
    from daybreak.operator import kube as k
    from daybreak.operator.pool import PoolNames

    names = PoolNames(view_pool.metadata.name or "", view_pool.metadata.namespace or "")
    try:
        service = await kube.get_or_none(k.SERVICE, names.service, namespace=view_pool.metadata.namespace)
    except k.KubeError as exc:
        logger.debug("event=service_unreadable pool=%s reason=%s", names.pool, exc)
        service = None
    for port in ((service or {}).get("spec") or {}).get("ports") or []:
        if port.get("name") == "metrics" and isinstance(port.get("port"), int):
            return int(port["port"])
    from daybreak.operator.pool import metrics_port

    return metrics_port(view_pool)  # what the operator configures: the port after the store port


def _explain(exc: Exception, *, server: str, what: str) -> StatusError:
    from daybreak.operator.kube import KubeError

    if isinstance(exc, KubeError):
        if exc.status == 0:
            return StatusError(f"cannot reach the Kubernetes API at {server}: {exc.reason}: {exc.message}. "
                               "Check --kubeconfig (or $KUBECONFIG) and that the cluster is running.")
        if exc.status == 404:
            return StatusError(f"{what}: the API has no such resource (404): are the Daybreak CRDs installed? "
                               "kubectl apply -f crds/ (or helm install daybreak charts/daybreak)")
        if exc.status in (401, 403):
            return StatusError(f"{what}: {exc.status} {exc.reason}: {exc.message}. "
                               "Your credentials may not read Daybreak objects here; try -n NAMESPACE.")
        return StatusError(f"{what}: {exc}")
    return StatusError(f"{what}: {exc}")


def _kubeconfig_source(kubeconfig: str | None) -> str:
    """Where the configuration will come from; a missing file is an error now, not a confusing one later."""
    in_cluster = kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ
    where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    if in_cluster:
        return "the Pod's ServiceAccount"
    if not any(os.path.isfile(os.path.expanduser(p)) for p in where.split(os.pathsep) if p):
        raise StatusError(f"no kubeconfig at {where}: give --kubeconfig FILE or set KUBECONFIG "
                          "(`daybreak dev up` prints one for the local cluster)")
    return where


async def collect(*, kubeconfig: str | None, namespace: str | None, all_namespaces: bool,
                  metrics_port: int | None = None, request_timeout: float = 10.0,
                  now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> Snapshot:
    """Read pools, deployments and nodes from the API and scrape every ready agent's metrics."""
    import httpx

    from daybreak.operator import kube as k

    where = _kubeconfig_source(kubeconfig)
    try:
        configuration, creds = await k.load_configuration(kubeconfig)
    except Exception as exc:  # the loader raises its own ConfigException, OSError or ValueError
        raise StatusError(f"cannot load the Kubernetes configuration from {where}: {exc}. "
                          "Give --kubeconfig FILE or set KUBECONFIG.") from None
    scope = None if all_namespaces else (namespace or creds.default_namespace or "default")
    snapshot = Snapshot(server=creds.server, namespace=scope, now=now())
    kube = k.KubeClient(configuration, connections=8)
    try:
        async def listed(kind: k.ResourceKind, *, required: bool) -> list[dict[str, Any]]:
            path = kind.path(namespace=scope if kind.namespaced else None)
            try:
                result = await kube.request("GET", path, request_timeout=request_timeout)
            except k.KubeError as exc:
                error = _explain(exc, server=creds.server, what=f"listing {kind.plural}")
                if required or exc.status == 0:
                    raise error from None
                snapshot.notes.append(str(error))
                return []
            return list(result.get("items") or [])

        pools = await listed(k.KVPOOL, required=True)
        deployments = await listed(k.PDDEPLOYMENT, required=True)
        nodes = await listed(k.KVNODE, required=False)
        snapshot.deployments = sorted((PDDeployment.from_body(b) for b in deployments),
                                      key=lambda d: (d.metadata.namespace or "", d.metadata.name or ""))
        snapshot.nodes = sorted((KVNode.from_body(b) for b in nodes), key=lambda n: n.metadata.name or "")
        for body in sorted(pools, key=lambda b: (b["metadata"].get("namespace", ""), b["metadata"]["name"])):
            pool = KVPool.from_body(body)
            port = await _metrics_port(kube, pool, override=metrics_port)
            view = PoolView(pool=pool, metrics_port=port,
                            agents=[AgentMetrics(node=e.node, endpoint=_host_port(e.address, port))
                                    for e in pool.status.endpoints])
            snapshot.pools.append(view)
    finally:
        await kube.close()
    agents = [a for view in snapshot.pools for a in view.agents]
    if agents:
        timeout = httpx.Timeout(METRICS_TIMEOUT_SECONDS)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False) as client:
            await asyncio.gather(*(scrape(client, a) for a in agents))
    return snapshot


# -- CLI --------------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config; "
                                             "in a Pod, its ServiceAccount)")
    parser.add_argument("-n", "--namespace", help="namespace of the pools and deployments (default: the context's)")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="pools and deployments of every namespace")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")
    parser.add_argument("--metrics-port", type=int,
                        help="agents' /metrics port (default: the pool's Service port 'metrics', else spec.agent.port + 1)")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="seconds for each API request")


def run(args: argparse.Namespace) -> int:
    if args.namespace and args.all_namespaces:
        print("error: give -n NAMESPACE or -A, not both", file=sys.stderr)
        return 2
    try:
        snapshot = asyncio.run(collect(kubeconfig=args.kubeconfig, namespace=args.namespace,
                                       all_namespaces=args.all_namespaces, metrics_port=args.metrics_port,
                                       request_timeout=args.request_timeout))
    except StatusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render_json(snapshot) if args.output == "json" else render_table(snapshot))
    return 0


def kubectl_plugin() -> int:
    """``kubectl-daybreak``: kubectl runs it for ``kubectl daybreak ...`` with the words after ``daybreak``."""
    from daybreak.cli import main

    return main(sys.argv[1:])
