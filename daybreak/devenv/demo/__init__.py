"""``make demo``: the whole serving path on a local cluster, under a stepped load, in one command.

Phases (docs/walkthrough.md walks through them): a local control plane with
two fake nodes of 8 Sunrise devices and the process kubelet; ``helm install``
of the chart (two operator replicas under leader election); the demo pool and
a sim PDDeployment with the planner on (examples/demo.yaml); agent-style
sessions stepped 1x -> 4x -> 1x plus a slice of the Mooncake trace through the
router, with one agent SIGKILLed halfway; a live view while it runs; a summary.
A real Prometheus (Debian's ``prometheus``, ``make prometheus-deps``) scrapes
the operator, agents, engines and router for the whole run when it is
installed (``daybreak.devenv.prometheus``); without it the demo says so in one
line and runs the same (its live view and summary read /metrics directly).

Environment: ``DEMO_SECONDS`` (load duration, default 120; when set the demo
does not wait at the end), ``DEMO_JSON`` (write the summary there),
``DEMO_HOLD=0`` (do not wait for Ctrl-C; also the default without a terminal),
``DEMO_TRACE`` (the trace; default traces/synthetic_trace.jsonl in the
repository, none when missing), ``DEMO_PROMETHEUS=0`` (no Prometheus even when installed).
The cluster is always torn down at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from daybreak.api import labels as vocab
from daybreak.devenv import prometheus as prometheus_mod
from daybreak.devenv.cluster import ClusterSpec, LocalCluster
from daybreak.devenv.demo import steps
from daybreak.devenv.demo import summary as summary_mod
from daybreak.devenv.demo.live import Sampler
from daybreak.devenv.demo.workload import Workload
from daybreak.logs import setup_logging
from daybreak.serving.load.trace import SYNTHETIC_TRACE

log = logging.getLogger(__name__)

DEFAULT_SECONDS = 120.0
SCALE_IN_WAIT_S = 60.0

# Called before teardown with the cluster, its Prometheus, the load's wall-clock window (start, end)
# and the summary.
AfterLoad = Callable[[LocalCluster, "prometheus_mod.Prometheus | None", float, float, dict[str, object]], None]


def _trace() -> Path | None:
    path = Path(os.environ.get("DEMO_TRACE") or SYNTHETIC_TRACE)
    if not path.is_file():
        print(f"(no trace at {path}: sessions only; set DEMO_TRACE=FILE)", flush=True)
        return None
    return path


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    setup_logging(logging.WARNING)
    scripted = "DEMO_SECONDS" in os.environ
    try:
        seconds = float(os.environ.get("DEMO_SECONDS") or DEFAULT_SECONDS)
    except ValueError:
        print(f"DEMO_SECONDS={os.environ['DEMO_SECONDS']!r}: give a number of seconds", file=sys.stderr)
        return 2
    if seconds < 20:
        print("DEMO_SECONDS must be at least 20 (the planner needs a few intervals per phase)", file=sys.stderr)
        return 2
    out_json = Path(os.environ["DEMO_JSON"]) if os.environ.get("DEMO_JSON") else None
    hold = (not scripted and os.environ.get("DEMO_HOLD", "1") != "0" and sys.stdin.isatty()
            and sys.stdout.isatty())
    return run(seconds=seconds, out_json=out_json, hold=hold,
               prometheus=os.environ.get("DEMO_PROMETHEUS", "1") != "0")


def run(*, seconds: float, out_json: Path | None, hold: bool, prometheus: bool = True,
        after: AfterLoad | None = None) -> int:
    """The demo; ``after`` (``make dashboards``) runs once the summary is out, while the cluster is still up.

    With ``after`` a Prometheus is required: its absence or failure is an error, not a note.
    """
    # SIGTERM (a CI timeout) and SIGINT (even when started in the background, which ignores it) tear down.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    directory = steps.ROOT / ".daybreak" / "demo-cluster"
    shutil.rmtree(directory, ignore_errors=True)  # the demo's own cluster dir: a crashed run's leftovers
    steps.step("starting a local control plane: 2 fake nodes x 8 Sunrise devices, the process kubelet")
    cluster = LocalCluster(directory, ClusterSpec(nodes=2, devices_per_node=8),
                           progress=lambda m: print(m, flush=True))
    started = time.monotonic()
    prom: prometheus_mod.Prometheus | None = None
    try:
        with cluster:
            print(f"cluster ready in {time.monotonic() - started:.1f}s; KUBECONFIG={cluster.kubeconfig}", flush=True)
            try:
                prom = _start_prometheus(cluster, wanted=prometheus or after is not None,
                                         required=after is not None)
                steps.kubectl(cluster, "get", "nodes", "-L",
                              f"{vocab.ACCELERATOR},{vocab.ACCELERATOR_COUNT}")
                steps.install_chart(cluster)
                url = steps.apply_examples(cluster)
                if prom is not None:
                    _show_targets(prom)
                load_started = time.time()
                result = _run_load(cluster, url=url, seconds=seconds)
                load_ended = time.time()
                steps.step("summary")
                print(summary_mod.table(result), flush=True)
                if out_json:
                    out_json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
                    print(f"summary written to {out_json}", flush=True)
                if after is not None:
                    if prom is not None:  # the last samples of the run: one more scrape
                        time.sleep(2 * prom.scrape_interval_s)
                    after(cluster, prom, load_started, load_ended, result)
                if hold:
                    _hold(cluster, prom)
                steps.step("tearing down")
            finally:
                if prom is not None:
                    cpu = prom.cpu_seconds()
                    if cpu is not None:
                        print(f"Prometheus used {cpu:.1f} s of CPU in {time.monotonic() - started:.0f} s; stopped",
                              flush=True)
                    prom.stop()
                    prom.api.close()
    except (steps.DemoError, prometheus_mod.PrometheusError) as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: cluster torn down", file=sys.stderr)
        return 130
    print("done", flush=True)
    return 0 if result["failed_requests"] == 0 else 1


def _run_load(cluster: LocalCluster, *, url: str, seconds: float) -> dict[str, object]:
    tty = sys.stdout.isatty()
    steps.step(f"load through the router at {url} for {seconds:.0f}s: sessions 1x -> 4x -> 1x over a trace slice; "
               "one agent is killed halfway" + ("" if tty else " (plain progress lines: no terminal)"))
    workload = Workload(url=url, seconds=seconds, trace=_trace())
    api = cluster.api()
    sampler = Sampler(api=api, namespace=steps.NS, deployment=steps.DEPLOYMENT, workload=workload, tty=tty)
    killed: list[str] = []

    def killer() -> None:
        time.sleep(seconds / 2)
        try:
            pod = steps.kill_agent(cluster)
        except steps.DemoError as exc:
            sampler.note(f"agent kill skipped: {exc}")
            return
        killed.append(pod)
        sampler.note(f"killed agent {pod} (SIGKILL, no hand-off): requests go on, a miss is a miss",
                     mark="agent killed")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if steps.restarts(cluster, pod) > 0:
                    sampler.note(f"agent {pod} restarted by the kubelet (the DaemonSet's pod; DRAM re-adopted)")
                    return
            except steps.DemoError:
                pass
            time.sleep(1.0)

    sampler.start()
    threading.Thread(target=killer, name="demo-agent-killer", daemon=True).start()
    try:
        asyncio.run(workload.run(on_phase=lambda name: sampler.note(f"phase: {name}", mark=name)))
        workload.phase = "done: waiting for the planner to scale in"
        deadline = time.monotonic() + SCALE_IN_WAIT_S
        # The scale-in window must pass after the step down; wait for it, bounded, so it shows.
        while (not any(e.to_replicas < e.from_replicas for e in sampler.scale_events)
               and time.monotonic() < deadline):
            time.sleep(1.0)
    finally:
        sampler.stop()
        api.close()
    if sampler.tty:
        sys.stdout.write("\033[H\033[J" + sampler.screen())
    return summary_mod.build(workload, sampler, killed_agent=killed[0] if killed else None)


def _start_prometheus(cluster: LocalCluster, *, wanted: bool, required: bool) -> prometheus_mod.Prometheus | None:
    """Prometheus scraping the cluster's pods, or None (said in one line) when it is off or not installed."""
    if not wanted:
        print("(Prometheus off: DEMO_PROMETHEUS=0)", flush=True)
        return None
    executable = prometheus_mod.binary()
    if executable is None:
        if required:
            raise prometheus_mod.PrometheusError("prometheus is not installed: `make prometheus-deps` (Debian "
                                                 "prometheus) first")
        print("(no Prometheus: `prometheus` is not installed; `make prometheus-deps` installs Debian's. "
              "The demo runs the same without it)", flush=True)
        return None
    prom = prometheus_mod.Prometheus(directory=cluster.directory / "prometheus", api=cluster.api(),
                                     executable=executable)
    try:
        prom.start()
    except prometheus_mod.PrometheusError as exc:
        prom.api.close()
        if required:
            raise
        print(f"(no Prometheus: {exc}; the demo runs the same without it)", flush=True)
        return None
    print(f"Prometheus {prom.url} (data in {prom.directory}; targets from the cluster's pods, "
          f"every {prom.scrape_interval_s:g}s)", flush=True)
    return prom


def _show_targets(prom: prometheus_mod.Prometheus) -> None:
    """One line: what Prometheus scrapes per job once the demo's pods run (waits a few scrapes for them)."""
    deadline = time.monotonic() + 20
    while True:
        prom.refresh()
        try:
            active = prom.active_targets()
        except (httpx.HTTPError, KeyError, ValueError) as exc:  # a view, never a reason to stop the demo
            print(f"(Prometheus targets unreadable: {exc})", flush=True)
            return
        jobs: dict[str, list[str]] = {}
        for t in active:
            jobs.setdefault(t["labels"].get("job", "?"), []).append(t.get("health", "unknown"))
        pending = len(active) < len(prom.targets) or any(h == "unknown" for hs in jobs.values() for h in hs)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    shown = ", ".join(f"{job} {hs.count('up')}/{len(hs)} up" for job, hs in sorted(jobs.items()))
    print(f"Prometheus scrapes: {shown or 'nothing yet'}", flush=True)


def _hold(cluster: LocalCluster, prom: prometheus_mod.Prometheus | None) -> None:
    where = (f"Prometheus: {prom.url} (graph: {prom.url}/graph, targets: {prom.url}/targets)" if prom is not None
             else "Prometheus: not running (make prometheus-deps installs it)")
    print(f"\nThe cluster stays up:\n  export KUBECONFIG={cluster.kubeconfig}\n"
          f"  kubectl get kvp,pdd,pods -A\n  .venv/bin/daybreak status -n {steps.NS}\n{where}\n"
          "Dashboards: charts/daybreak/dashboards/*.json (import into Grafana; docs/dashboards/*.png from a run).\n"
          "Press Ctrl-C to tear it down.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()
