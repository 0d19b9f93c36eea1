"""``make dashboards``: the chart's Grafana dashboards drawn as PNGs from a real demo run's Prometheus.

One source of truth: every panel's PromQL is read from
``charts/daybreak/dashboards/*.json`` and sent as it is to the demo's
Prometheus (``/api/v1/query_range`` over the load's window); only Grafana's
template variables are filled in (``$pool`` and ``$deployment`` with their
"All" value ``.*``, ``$__rate_interval`` with ``RATE_INTERVAL``). Each
dashboard becomes one PNG (matplotlib, the ``dashboards`` extra), panels in
the dashboard's own order, units as the panel declares them; a panel with no
data in the run says so instead of drawing an empty frame. The run's summary
goes beside them (``run.json``), so every picture has its conditions.

Environment: ``DEMO_SECONDS`` (load duration, default 90), ``DASHBOARDS_OUT``
(default docs/dashboards).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, cast

from daybreak.devenv import demo
from daybreak.devenv.cluster import LocalCluster
from daybreak.devenv.demo import steps
from daybreak.devenv.prometheus import Prometheus, PrometheusError
from daybreak.logs import setup_logging

log = logging.getLogger(__name__)

DASHBOARDS = steps.ROOT / "charts" / "daybreak" / "dashboards"
DEFAULT_OUT = steps.ROOT / "docs" / "dashboards"
DEFAULT_SECONDS = 90.0
LEAD_S = 20.0  # query from a little before the load: the pods' first samples and the base level
# Grafana's $__rate_interval is max(4 x scrape interval, step + scrape interval): 8 s at the demo's 2 s
# scrapes would make the increase() of a scale event a one-sample spike; 30 s shows each as a bar.
RATE_INTERVAL = "30s"
_VARIABLES = {"$__rate_interval": RATE_INTERVAL, "${pool}": ".*", "$pool": ".*", "${deployment}": ".*",
              "$deployment": ".*"}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def expression(expr: str) -> str:
    """A panel's PromQL with Grafana's template variables filled in (All for the selectors)."""
    for name, value in _VARIABLES.items():
        expr = expr.replace(name, value)
    if "$" in expr:
        raise ValueError(f"unknown template variable in {expr!r}")
    return expr


def legend(fmt: str | None, metric: dict[str, str]) -> str:
    """Grafana's legendFormat (``{{label}}``) applied to one series' labels."""
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in sorted(metric.items())) or "value"
    return _LEGEND.sub(lambda m: metric.get(m[1], ""), fmt).strip()


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's graph panels in reading order (top to bottom, left to right)."""
    found = [p for p in dashboard.get("panels") or [] if p.get("targets")]
    return sorted(found, key=lambda p: (p.get("gridPos", {}).get("y", 0), p.get("gridPos", {}).get("x", 0)))


def _unit_overrides(panel: dict[str, Any]) -> list[tuple[re.Pattern[str], str]]:
    """The panel's per-series unit overrides (Grafana ``byName`` / ``byRegexp`` matchers)."""
    out = []
    for override in (panel.get("fieldConfig") or {}).get("overrides") or []:
        matcher = override.get("matcher") or {}
        unit = next((p.get("value") for p in override.get("properties") or [] if p.get("id") == "unit"), None)
        if not unit or matcher.get("id") not in ("byName", "byRegexp"):
            continue
        pattern = matcher.get("options", "")
        out.append((re.compile(pattern if matcher["id"] == "byRegexp" else re.escape(pattern)), str(unit)))
    return out


def query_panels(prom: Prometheus, dashboard: dict[str, Any], *, start: float, end: float,
                 step_s: float, origin: float) -> list[dict[str, Any]]:
    """Every panel's series: ``[{"title", "unit", "series": [(label, unit, [t...], [v...])]}]``, t from ``origin``."""
    out = []
    for panel in panels(dashboard):
        unit = (panel.get("fieldConfig") or {}).get("defaults", {}).get("unit", "short")
        overrides = _unit_overrides(panel)
        series: list[tuple[str, str, list[float], list[float]]] = []
        for target in panel["targets"]:
            for result in prom.query_range(expression(target["expr"]), start=start, end=end, step_s=step_s):
                name = legend(target.get("legendFormat"), result["metric"])
                own = next((u for pattern, u in overrides if pattern.fullmatch(name)), unit)
                series.append((name, own, [float(t) - origin for t, _ in result["values"]],
                               [float(v) for _, v in result["values"]]))
        out.append({"title": panel.get("title", ""), "unit": unit, "series": series})
    return out


# -- drawing ----------------------------------------------------------------------------------------

def _scale(unit: str, values: list[float]) -> tuple[float, str]:
    """Divisor and axis label for a Grafana unit, chosen from the largest value drawn."""
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    if unit in ("bytes", "Bps"):
        for div, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if top >= div:
                return div, name + ("/s" if unit == "Bps" else "")
        return 1.0, "B" + ("/s" if unit == "Bps" else "")
    if unit == "percentunit":
        return 0.01, "%"
    if unit == "s":
        return (0.001, "ms") if top < 1 else (1.0, "s")
    if unit == "ops":
        return 1.0, "per second"
    return 1.0, ""


def _plot(ax: Any, drawn: list[tuple[str, str, list[float], list[float]]], unit: str, colors: Any) -> list[Any]:
    values = [v for _, _, _, vs in drawn for v in vs if math.isfinite(v)]
    div, label = _scale(unit, values)
    lines = [ax.plot(ts, [v / div for v in vs], label=name or "value", linewidth=1.4, color=next(colors))[0]
             for name, _, ts, vs in drawn]
    ax.set_ylabel(label, fontsize=8)
    if values and min(values) >= 0:
        ax.set_ylim(bottom=0)
    return lines


def render(dashboard: dict[str, Any], data: list[dict[str, Any]], *, path: Path, subtitle: str,
           marks: list[tuple[float, str]]) -> None:
    """One PNG: the dashboard's panels two to a row, legends below (as the dashboards place them)."""
    matplotlib = importlib.import_module("matplotlib")  # the optional extra: typed Any, checked the same without it
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    cols = 2
    rows = math.ceil(len(data) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 4.4 * rows + 0.9), squeeze=False, layout="constrained")
    fig.suptitle(f"{dashboard.get('title', path.stem)}\n{subtitle}", fontsize=12)
    palette = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    for ax, panel in zip(axes.flat, data, strict=False):
        ax.set_title(panel["title"], fontsize=11, loc="left")
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("seconds since the load started", fontsize=8)
        ax.tick_params(labelsize=8)
        drawn = [s for s in panel["series"] if any(math.isfinite(v) for v in s[3])]
        if not drawn:
            ax.text(0.5, 0.5, "no series in this run's Prometheus", ha="center", va="center",
                    transform=ax.transAxes, fontsize=10, color="0.4")
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        colors = iter(palette * 8)
        main = [s for s in drawn if s[1] == panel["unit"]]
        other = [s for s in drawn if s[1] != panel["unit"]]
        lines = _plot(ax, main, panel["unit"], colors) if main else []
        if other:  # an override's unit (a ratio beside bytes): its own axis on the right
            twin = ax.twinx()
            twin.tick_params(labelsize=8)
            lines += _plot(twin, other, other[0][1], colors)
        for at, what in marks:
            ax.axvline(at, color="0.55", linewidth=0.8, linestyle=":")
            ax.text(at, 1.0, f" {what}", transform=ax.get_xaxis_transform(), fontsize=6.5, color="0.35",
                    rotation=90, va="top", ha="left")
        ax.legend(handles=lines, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=min(len(lines), 5), frameon=False)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_all(prom: Prometheus, *, start: float, end: float, out: Path, subtitle: str,
             marks: list[tuple[float, str]]) -> list[Path]:
    """Every dashboard of the chart, queried over [start - LEAD_S, end] and drawn to ``out`` (t=0 at ``start``)."""
    begin = start - LEAD_S
    step_s = max(prom.scrape_interval_s, (end - begin) / 400)
    written = []
    for file in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(file.read_text())
        data = query_panels(prom, dashboard, start=begin, end=end, step_s=step_s, origin=start)
        path = out / f"{file.stem}.png"
        render(dashboard, data, path=path, subtitle=subtitle, marks=marks)
        empty = [p["title"] for p in data if not p["series"]]
        print(f"wrote {path} ({len(data)} panels{'; no series: ' + ', '.join(empty) if empty else ''})", flush=True)
        written.append(path)
    return written


def main() -> int:
    setup_logging(logging.WARNING)
    try:
        seconds = float(os.environ.get("DEMO_SECONDS") or DEFAULT_SECONDS)
    except ValueError:
        print(f"DEMO_SECONDS={os.environ['DEMO_SECONDS']!r}: give a number of seconds", file=sys.stderr)
        return 2
    out = Path(os.environ.get("DASHBOARDS_OUT") or DEFAULT_OUT)
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print("matplotlib is missing: pip install -e '.[dashboards]' (make dashboards does)", file=sys.stderr)
        return 2

    def after(cluster: LocalCluster, prom: Prometheus | None, start: float, end: float,
              summary: dict[str, object]) -> None:
        if prom is None:
            raise PrometheusError("no Prometheus in this run")
        steps.step(f"dashboards: the chart's panel queries against {prom.url}, drawn to {out}")
        load = os.getloadavg()
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start))
        subtitle = (f"make dashboards: a {seconds:.0f} s demo run on {when}, queried from its Prometheus "
                    f"(load average {load[0]:.1f} at the end)")
        origin = float(cast(float, summary.get("load_started_unix") or start))
        timeline = cast(list[dict[str, Any]], summary.get("timeline") or [])
        marks = [(float(m["at_s"]), str(m["what"])) for m in timeline]
        draw_all(prom, start=origin, end=end, out=out, subtitle=subtitle, marks=marks)
        run = {"started_utc": when, "demo_seconds": seconds, "query_window_s": round(end - start + LEAD_S, 1),
               "rate_interval": RATE_INTERVAL, "loadavg_at_end": [round(x, 2) for x in load], "summary": summary}
        (out / "run.json").write_text(json.dumps(run, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out / 'run.json'} (the run's summary: the conditions of these pictures)", flush=True)

    return demo.run(seconds=seconds, out_json=None, hold=False, after=after)


if __name__ == "__main__":
    sys.exit(main())
