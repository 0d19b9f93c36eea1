"""Helpers shared by several test modules (pytest does not collect this file)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from daybreak.devenv.cluster import LocalCluster

# What the lent GPU machine lacks: the GPU check scripts must run without them.
GPU_MACHINE_ABSENT = ("pydantic", "kopf", "kubernetes", "kubernetes_asyncio")
REPO = Path(__file__).resolve().parents[1]


def apply_crds(kube: LocalCluster) -> None:
    """Every CRD of crds/ applied server-side and Established."""
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(REPO / "crds"))


def crds_and_namespace(kube: LocalCluster, namespace: str) -> None:
    """The CRDs applied and Established, and ``namespace`` there (created once per cluster)."""
    apply_crds(kube)
    if kube.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        kube.kubectl("create", "namespace", namespace)


def crds_in_new_namespace(kube: LocalCluster, prefix: str) -> str:
    """``apply_crds`` and a new namespace ``<prefix>-<6 hex>``; returns it."""
    apply_crds(kube)
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", namespace)
    return namespace


def pool_in_new_namespace(kube: LocalCluster, prefix: str) -> str:
    """``crds_in_new_namespace`` holding examples/kvpool-minimal.yaml as KVPool ``pool``; returns the namespace."""
    namespace = crds_in_new_namespace(kube, prefix)
    pool = yaml.safe_load((REPO / "examples" / "kvpool-minimal.yaml").read_text())
    pool["metadata"] = {"name": "pool", "namespace": namespace}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    return namespace


def layout(sizes: Sequence[int], *, gap: int = 4096) -> list[tuple[int, int]]:
    """``(offset, size)`` of each size packed into one segment, ``gap`` bytes apart."""
    out, offset = [], 0
    for size in sizes:
        out.append((offset, size))
        offset += size + gap
    return out


def run_without_gpu_machine_deps(script: Path, *args: str, env: dict[str, str] | None = None
                                 ) -> subprocess.CompletedProcess[str]:
    """Run a ``hack/`` script as on the GPU machine: a fresh interpreter where the heavy modules fail to import."""
    wrapper = textwrap.dedent(f"""
        import runpy, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {GPU_MACHINE_ABSENT!r}:
                    raise ImportError('not on the GPU machine: ' + name)
        sys.meta_path.insert(0, Block())
        sys.argv = [{script.name!r}, *{list(args)!r}]
        runpy.run_path({str(script)!r}, run_name='__main__')
    """)
    return subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, timeout=120, cwd="/",
                          env=env)
