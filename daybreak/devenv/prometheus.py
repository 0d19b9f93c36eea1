"""A real Prometheus server (Debian's ``prometheus``) as a child process of the local cluster, scraping its pods.

Pods on the local cluster are processes on their own 127.X addresses, and
there is no in-cluster Prometheus Operator, so the scrape targets come from
the API instead: every Daybreak pod (operator, agents, engines, router) that
is Running with a container port named ``metrics`` (else ``http``) becomes a
target in a ``file_sd`` file, labelled like the chart's ServiceMonitors and
PodMonitors relabel (``pool``, ``deployment``, ``role``, ``node``, ``pod``).
A thread rewrites that file every few seconds, so pods the planner adds or
an agent restarted by the kubelet are scraped without a reload.

The server keeps its data in the cluster directory and is stopped with it.
``query_range`` is the HTTP API the dashboard renderer (``devenv/dashboards.py``) reads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from daybreak.api import labels as vocab
from daybreak.devenv.cluster import free_port
from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

SCRAPE_INTERVAL_S = 2.0  # the demo runs for minutes, not hours: fine-grained enough to show each phase
REFRESH_S = 3.0
# Pods worth scraping: their app.kubernetes.io/name label (the chart's and the operator's children).
APPS = ("daybreak", "daybreak-operator", "daybreak-agent", "daybreak-engine", "daybreak-router")


class PrometheusError(DaybreakError, RuntimeError):
    """The Prometheus server did not start or answer; the message names its log."""


def binary() -> Path | None:
    """Debian's ``prometheus`` (``PROMETHEUS`` overrides); None when it is not installed."""
    found = os.environ.get("PROMETHEUS") or shutil.which("prometheus")
    return Path(found) if found else None


def targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file_sd entries for ``pods`` (items of a pod list): one per Running Daybreak pod with a metrics port."""
    out: list[dict[str, Any]] = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        app = labels.get(vocab.NAME, "")
        ip = status.get("podIP")
        if app not in APPS or status.get("phase") != "Running" or not ip:
            continue
        ports = {p.get("name"): p.get("containerPort") for c in spec.get("containers") or []
                 for p in c.get("ports") or []}
        port = ports.get("metrics") or ports.get("http")
        if not port:
            continue
        entry = {"job": app.removeprefix("daybreak-") if app != "daybreak" else "operator",
                 "namespace": meta.get("namespace", ""), "pod": meta["name"], "node": spec.get("nodeName", "")}
        for key, name in ((vocab.POOL, "pool"), (vocab.DEPLOYMENT, "deployment"), (vocab.ROLE, "role")):
            if labels.get(key):
                entry[name] = labels[key]
        host = f"[{ip}]" if ":" in ip else ip
        out.append({"targets": [f"{host}:{port}"], "labels": entry})
    return sorted(out, key=lambda t: t["targets"][0])


def config(*, targets_file: Path, scrape_interval_s: float = SCRAPE_INTERVAL_S) -> str:
    """prometheus.yml: one job fed by ``targets_file`` (its entries carry their own ``job`` label)."""
    interval = f"{scrape_interval_s:g}s"
    return json.dumps({  # JSON is YAML; no YAML writer needed
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": "daybreak", "metrics_path": "/metrics",
                            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}]}],
    }, indent=2) + "\n"


class Prometheus:
    """One Prometheus server for one local cluster; ``start()``, ``stop()``, ``query_range()``.

    ``api`` is the cluster's API client (``LocalCluster.api()``); this object does not close it.
    """

    def __init__(self, *, directory: Path, api: httpx.Client, executable: Path,
                 scrape_interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.directory = directory
        self.api = api
        self.executable = executable
        self.scrape_interval_s = scrape_interval_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = directory / "targets.json"
        self.log_file = directory / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="prometheus-targets", daemon=True)
        self._http = httpx.Client(base_url=self.url, timeout=10.0)
        self.targets: list[dict[str, Any]] = []

    def start(self, *, timeout: float = 60.0) -> Prometheus:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.refresh()
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(config(targets_file=self.targets_file, scrape_interval_s=self.scrape_interval_s))
        with self.log_file.open("ab") as logf:
            self.proc = subprocess.Popen(
                [str(self.executable), f"--config.file={config_file}", f"--storage.tsdb.path={self.directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}; see {self.log_file}")
            try:
                if self._http.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus not ready after {timeout:.0f}s; see {self.log_file}")
            time.sleep(0.3)
        self._thread.start()
        log.info("event=prometheus_started url=%s targets=%d", self.url, len(self.targets))
        return self

    def refresh(self) -> None:
        """Rewrite the targets file from the pods that exist now (atomically: Prometheus watches the file)."""
        r = self.api.get("/api/v1/pods")
        r.raise_for_status()
        found = targets(r.json()["items"])
        if found != self.targets or not self.targets_file.exists():
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(found, indent=1) + "\n")
            tmp.replace(self.targets_file)
            self.targets = found

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.refresh()
            except (httpx.HTTPError, KeyError, ValueError, OSError) as exc:
                log.debug("event=prometheus_targets_failed cause=%r", str(exc))

    def active_targets(self) -> list[dict[str, Any]]:
        """Prometheus's own view of its targets (``/api/v1/targets``): labels, health, last error."""
        r = self._http.get("/api/v1/targets", params={"state": "active"})
        r.raise_for_status()
        return list(r.json()["data"]["activeTargets"])

    def query_range(self, expr: str, *, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """``/api/v1/query_range``: a list of ``{"metric": {...}, "values": [[t, "v"], ...]}``."""
        r = self._http.get("/api/v1/query_range", params={"query": expr, "start": start, "end": end,
                                                          "step": f"{step_s:g}s"})
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"query_range {expr!r}: {body.get('error') or r.status_code}")
        return list(body["data"]["result"])

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the server has used so far: what it costs the demo's 2 cores."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=REFRESH_S + 5)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._http.close()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
