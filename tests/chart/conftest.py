"""Helpers of the chart tests: the chart's path and `helm template` / `helm lint` through the built helm."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from chartlib import CHART, KUBE_VERSION, Helm, Render

from daybreak.devenv import tools


@pytest.fixture(scope="session")
def helm() -> Helm:
    """Run helm; returns the completed process (check rc yourself: refusals are what some tests want)."""
    try:
        binary = str(tools.find("helm"))
    except tools.ToolError as exc:
        pytest.fail(f"helm missing ({exc}); `make tools` builds it")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)

    return run


@pytest.fixture(scope="session")
def render_text(helm: Helm) -> Callable[..., str]:
    def run(*extra: str, release: str = "dbk", namespace: str = "daybreak-chart") -> str:
        out = helm("template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    return run


@pytest.fixture(scope="session")
def render(render_text: Callable[..., str]) -> Render:
    def run(*extra: str, release: str = "dbk", namespace: str = "daybreak-chart") -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(render_text(*extra, release=release, namespace=namespace)) if d]

    return run
