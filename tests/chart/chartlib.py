"""Paths and types shared by the chart tests (the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "daybreak"
KUBE_VERSION = "1.37.2"

Helm = Callable[..., subprocess.CompletedProcess[str]]
Render = Callable[..., list[dict[str, Any]]]
