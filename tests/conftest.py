"""Shared fixtures: real control planes started from the locally built binaries.

``kube`` is envtest-style (etcd + kube-apiserver), started once per session.
``cluster`` is the fuller stack (plus controller-manager, scheduler, kwok
with two fake Sunrise nodes and the process kubelet) for tests marked ``e2e``. Both are torn down at
the end of the session; their logs stay under pytest's basetemp for triage.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daybreak.devenv import tools
from daybreak.devenv.cluster import ClusterSpec, LocalCluster
from daybreak.testing.store_agent import LocalAgent, cleanup_pool


def _start(tmp_path_factory: pytest.TempPathFactory, name: str, spec: ClusterSpec) -> Iterator[LocalCluster]:
    directory = tmp_path_factory.mktemp(name)
    try:
        cluster = LocalCluster(directory, spec, progress=lambda _m: None)
        # Generous: CI's 2 cores may be busy with other test processes while the components start.
        cluster.start(timeout=300)
    except tools.ToolError as exc:
        pytest.fail(f"control-plane binaries missing ({exc}); `make test` builds them")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver on loopback (no controllers: no GC, no pods)."""
    yield from _start(tmp_path_factory, "envtest", ClusterSpec(controllers=False, kwok=False))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The full local stack with 2 kwok nodes of 8 fake Sunrise devices each.

    The process kubelet is on: pods running ``daybreak`` (the operator's agents, engines and routers, the
    chart's operator) really run as local processes, everything else stays kwok's.
    """
    yield from _start(tmp_path_factory, "e2e", ClusterSpec(nodes=2, devices_per_node=8, process_kubelet=True))


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A pool of local agent processes for store tests: its name, token file and the agents a test starts
    (``daybreak.testing.store_agent.LocalAgent``, appended to ``agents``); all killed and their shared memory
    removed afterwards. Test files that need another kind of pool define their own ``pool``."""
    name = f"p{uuid.uuid4().hex[:8]}"
    agents: list[LocalAgent] = []
    yield {"name": name, "token_file": tmp_path / "token", "agents": agents, "tmp": tmp_path}
    for agent in agents:
        agent.kill()
    cleanup_pool(name)
