"""The dashboard renderer's pieces (``make dashboards`` itself is the end-to-end run that draws docs/dashboards/).

Every panel query of the chart's dashboards, as the renderer sends it, must parse as PromQL: checked by
Debian's ``promtool`` (the ``prometheus`` package, ``make prometheus-deps``), so a query Grafana would
reject fails here and not in a demo run four minutes in.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from daybreak.devenv.dashboards import DASHBOARDS, expression, legend, panels


def _queries() -> list[tuple[str, str, str]]:
    out = []
    for file in sorted(DASHBOARDS.glob("*.json")):
        for panel in panels(json.loads(file.read_text())):
            out += [(file.name, panel["title"], t["expr"]) for t in panel["targets"]]
    return out


def test_every_panel_query_parses_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make prometheus-deps` installs Debian's prometheus (it ships promtool)"
    queries = _queries()
    assert len(queries) > 20
    rules = [{"record": f"dashboard:query:{i}", "expr": expression(expr)} for i, (_, _, expr) in enumerate(queries)]
    file = tmp_path / "rules.yml"
    file.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))  # JSON is YAML
    out = subprocess.run([promtool, "check", "rules", str(file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"SUCCESS: {len(queries)} rules found" in out.stdout


def test_template_variables_are_filled_and_unknown_ones_refused() -> None:
    assert expression('sum(rate(x{pool=~"$pool"}[$__rate_interval]))') == 'sum(rate(x{pool=~".*"}[30s]))'
    assert expression('y{deployment=~"${deployment}"}') == 'y{deployment=~".*"}'
    with pytest.raises(ValueError, match=r"\$tenant"):
        expression('z{tenant="$tenant"}')


def test_legends_follow_grafanas_format() -> None:
    assert legend("{{transport}} {{op}}", {"transport": "tcp", "op": "read"}) == "tcp read"
    assert legend("p50 {{ op }}", {"op": "get"}) == "p50 get"
    assert legend(None, {"b": "2", "a": "1"}) == "a=1,b=2"
    assert legend("", {}) == "value"


def test_panels_come_in_reading_order_and_only_with_queries() -> None:
    board = {"panels": [{"title": "b", "gridPos": {"x": 12, "y": 0}, "targets": [{"expr": "1"}]},
                        {"title": "row", "type": "row", "gridPos": {"x": 0, "y": 0}},
                        {"title": "c", "gridPos": {"x": 0, "y": 8}, "targets": [{"expr": "1"}]},
                        {"title": "a", "gridPos": {"x": 0, "y": 0}, "targets": [{"expr": "1"}]}]}
    assert [p["title"] for p in panels(board)] == ["a", "b", "c"]
