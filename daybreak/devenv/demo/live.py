"""The demo's live view: what the cluster and the workload are doing, sampled once a second.

A ``Sampler`` thread reads the API (role Deployments, the agents' DaemonSet,
``Autoscaled`` Events), the engines' ``/metrics`` (KV bytes they moved) and the
agents' ``/metrics`` (block bytes per transport, ``daybreak_store_bytes_total``),
and the workload's records (requests/s, TTFT, hit rate). On a terminal it redraws one
screen in place with plain ANSI codes; otherwise it prints a progress line
every 5 s and one line per planner decision as it happens.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from daybreak.api import labels as vocab
from daybreak.api.metrics import ENGINE_KV_BYTES, STORE_BYTES, total
from daybreak.devenv.demo.workload import Workload
from daybreak.serving.load.summary import percentile

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "router")
_EVENT = re.compile(r"^(?P<role>prefill|decode) (?P<from>\d+) -> (?P<to>\d+): (?P<reason>.*)$", re.S)
_KV_BYTES = re.compile("^" + total(ENGINE_KV_BYTES) + r'\{[^}]*direction="(read|written)"[^}]*\}\s+(\S+)$', re.M)
_STORE_BYTES = re.compile("^" + total(STORE_BYTES) + r'\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
MAX_METRICS_BYTES = 4 << 20


@dataclass
class ScaleEvent:
    """One planner decision as applied: ``role from -> to`` and why."""

    at_s: float
    role: str
    from_replicas: int
    to_replicas: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 1), "role": self.role, "from": self.from_replicas,
                "to": self.to_replicas, "reason": self.reason}


@dataclass
class _Counted:
    """A scraped counter across restarts of its process: ``total`` is what it counted in all of its lives."""

    last: float = 0.0
    base: float = 0.0

    def see(self, value: float) -> None:
        if value < self.last:  # reset: the process restarted
            self.base += self.last
        self.last = value

    @property
    def total(self) -> float:
        return self.base + self.last


@dataclass
class Sampler:
    """Samples the cluster in a thread while the workload runs; ``stop()`` ends it."""

    api: httpx.Client
    namespace: str
    deployment: str
    workload: Workload
    tty: bool
    notes: list[str] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the load, what)
    scale_events: list[ScaleEvent] = field(default_factory=list)
    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (desired, ready)
    agents: tuple[int, int] = (0, 0)
    # Engine counters per pod, last value seen: a scaled-in pod's bytes stay counted.
    kv_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    # Agent counters per (pod, transport, op): a restarted agent starts from zero again (the kill), so
    # what it had counted before is kept as a base under the new count.
    store_bytes: dict[tuple[str, str, str], _Counted] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._seen_events: set[tuple[str, int]] = set()
        self._thread = threading.Thread(target=self._loop, name="demo-live-view", daemon=True)
        self._scraper = httpx.Client(timeout=2.0)
        self._last_line = 0.0

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._scraper.close()

    def note(self, text: str, *, mark: str | None = None) -> None:
        """Something the demo did (a phase, the agent kill); shown in the view and as a plain line.

        ``mark``: a short name for the summary's timeline (the dashboards draw it as a line).
        """
        if mark:
            self.marks.append((round(self.workload.elapsed(), 1), mark))
        self.notes.append(f"t={self.workload.elapsed():5.1f}s {text}")
        if not self.tty:
            print(self.notes[-1], flush=True)

    def bytes_moved(self) -> dict[str, float]:
        """The engines' KV bytes, by direction (``read``, ``written``)."""
        out = {"read": 0.0, "written": 0.0}
        for per_pod in self.kv_bytes.values():
            for direction, value in per_pod.items():
                out[direction] = out.get(direction, 0.0) + value
        return out

    def bytes_by_transport(self) -> dict[str, dict[str, float]]:
        """The agents' block bytes: transport -> {"read", "written"} (the store's op write counts as written)."""
        out: dict[str, dict[str, float]] = {}
        for (_, transport, op), counted in self.store_bytes.items():
            per = out.setdefault(transport, {"read": 0.0, "written": 0.0})
            per["written" if op == "write" else "read"] += counted.total
        return out

    # -- sampling ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                log.debug("sample failed: %s", exc)
            if self.tty:
                sys.stdout.write("\033[H\033[J" + self.screen())
                sys.stdout.flush()
            elif time.monotonic() - self._last_line >= 5.0:
                self._last_line = time.monotonic()
                print(self.line(), flush=True)
            self._stop.wait(1.0)

    def sample(self) -> None:
        ns, name = self.namespace, self.deployment
        for role in ROLES:
            r = self.api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-{role}")
            if r.status_code == 200:
                d = r.json()
                self.replicas[role] = (int(d["spec"].get("replicas") or 0),
                                       int((d.get("status") or {}).get("readyReplicas") or 0))
        r = self.api.get(f"/apis/apps/v1/namespaces/{ns}/daemonsets")
        if r.status_code == 200:
            for ds in r.json()["items"]:
                st = ds.get("status") or {}
                self.agents = (int(st.get("desiredNumberScheduled") or 0), int(st.get("numberReady") or 0))
        self._events()
        self._pods()

    def _events(self) -> None:
        r = self.api.get(f"/api/v1/namespaces/{self.namespace}/events",
                         params={"fieldSelector": f"involvedObject.name={self.deployment},reason=Autoscaled"})
        if r.status_code != 200:
            return
        items = sorted(r.json()["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        for e in items:
            key = (e["metadata"]["name"], int(e.get("count") or 1))
            if key in self._seen_events:
                continue
            self._seen_events.add(key)
            m = _EVENT.match(e.get("message") or "")
            if not m:
                continue
            ev = ScaleEvent(self.workload.elapsed(), m["role"], int(m["from"]), int(m["to"]), m["reason"])
            self.scale_events.append(ev)
            self.note(f"planner: {ev.role} {ev.from_replicas} -> {ev.to_replicas} ({ev.reason[:100]})")

    def _pods(self) -> None:
        r = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods")
        if r.status_code != 200:
            return
        for pod in r.json()["items"]:
            labels = pod["metadata"].get("labels") or {}
            name, ip = pod["metadata"]["name"], (pod.get("status") or {}).get("podIP")
            if not ip:
                continue
            if labels.get(vocab.DEPLOYMENT) == self.deployment and \
                    labels.get(vocab.ROLE) in ("prefill", "decode"):
                text = self._scrape(f"http://{ip}:8000/metrics")
                per_pod = self.kv_bytes.setdefault(name, {})
                for direction, value in _KV_BYTES.findall(text):
                    per_pod[direction] = max(per_pod.get(direction, 0.0), float(value))
            elif labels.get(vocab.NAME) == "daybreak-agent":
                ports = [p.get("containerPort") for c in pod["spec"].get("containers") or []
                         for p in c.get("ports") or [] if p.get("name") == "metrics"]
                if not ports:
                    continue
                text = self._scrape(f"http://{ip}:{ports[0]}/metrics")
                for m in _STORE_BYTES.finditer(text):
                    lab = dict(_LABEL.findall(m["labels"]))
                    key = (name, lab.get("transport", "?"), lab.get("op", "?"))
                    self.store_bytes.setdefault(key, _Counted()).see(float(m["value"]))

    def _scrape(self, url: str) -> str:
        try:
            resp = self._scraper.get(url)
        except httpx.HTTPError:
            return ""
        if resp.status_code != 200 or len(resp.content) > MAX_METRICS_BYTES:
            return ""
        return resp.text

    # -- rendering --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        w = self.workload
        now = time.monotonic()
        records = list(w.records)
        ok = [r for r in records if r.ok]
        recent = [r for r in ok if r.e2e_s is not None and now - (r.sent_at + r.e2e_s) <= 10.0]
        window = [r.ttft_s for r in ok if r.ttft_s is not None and now - r.sent_at <= 30.0]
        prompt = sum(r.prompt_tokens for r in ok)
        return {"rps": len(recent) / 10.0, "ttft_p50": percentile(window, 50), "ttft_p90": percentile(window, 90),
                "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
                "done": len(ok), "failed": len(records) - len(ok), "in_flight": w.in_flight}

    def line(self) -> str:
        s = self.stats()
        roles = " ".join(f"{role}={self.replicas.get(role, (0, 0))[1]}/{self.replicas.get(role, (0, 0))[0]}"
                         for role in ROLES)
        moved = " ".join(f"{t}_read={_mb(v['read'])} {t}_written={_mb(v['written'])}"
                         for t, v in sorted(self.bytes_by_transport().items())) or "moved=-"
        return (f"t={self.workload.elapsed():5.1f}s [{self.workload.phase}] req/s={s['rps']:.2f} "
                f"ttft_p50={_ms(s['ttft_p50'])} p90={_ms(s['ttft_p90'])} hit={_pct(s['hit_rate'])} "
                f"done={s['done']} failed={s['failed']} {roles} agents={self.agents[1]}/{self.agents[0]} {moved}")

    def screen(self) -> str:
        s = self.stats()
        rows = [
            f"Daybreak demo  t={self.workload.elapsed():5.1f}s  phase: {self.workload.phase}   (Ctrl-C stops)",
            "",
            f"  requests/s (10 s)   {s['rps']:8.2f}     done {s['done']}  failed {s['failed']}  "
            f"in flight {s['in_flight']}",
            f"  TTFT p50 / p90      {_ms(s['ttft_p50']):>8} / {_ms(s['ttft_p90'])}   (last 30 s)",
            f"  hit rate            {_pct(s['hit_rate']):>8}     (prompt tokens whose KV was not computed)",
            *[f"  bytes over {t:<8}  read {_mb(v['read'])}  written {_mb(v['written'])}   (agents' counters)"
              for t, v in sorted(self.bytes_by_transport().items())],
            "",
            "  replicas (ready/desired)",
        ]
        for role in ROLES:
            desired, ready = self.replicas.get(role, (0, 0))
            rows.append(f"    {role:<8} {ready}/{desired}  {'#' * ready}{'.' * max(desired - ready, 0)}")
        rows.append(f"    {'agents':<8} {self.agents[1]}/{self.agents[0]}")
        rows += ["", "  what happened"]
        rows += [f"    {n[:150]}" for n in self.notes[-12:]]
        return "\n".join(rows) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _mb(v: float) -> str:
    return f"{v / 1e6:.1f} MB"
