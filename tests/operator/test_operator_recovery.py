"""The operator rides out an apiserver restart: it logs, backs off, steps down, comes back and reconciles again."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from daybreak.devenv.cluster import ClusterSpec, LocalCluster
from daybreak.testing.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def _wait(what: str, probe: Callable[[], T | None], op: OperatorProcess, timeout: float = 90) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = probe()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}\n{op.log()[-4000:]}")


def _pdd(name: str) -> str:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pddeployment-sim.yaml").read_text())
    body["metadata"] = {"name": name}
    body["spec"]["poolRef"] = {"name": "pool"}
    return yaml.safe_dump(body)


POOL = yaml.safe_dump({"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "pool"},
                       "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}})


def test_operator_survives_an_apiserver_restart(tmp_path: Path) -> None:
    # A private etcd + apiserver: restarting the shared fixtures would disturb other tests.
    cluster = LocalCluster(tmp_path / "cluster", ClusterSpec(controllers=False, kwok=False), progress=lambda _m: None)
    with cluster:
        cluster.kubectl("apply", "-f", str(ROOT / "crds"))
        cluster.kubectl("apply", "-f", "-", stdin=POOL)
        cluster.kubectl("apply", "-f", "-", stdin=_pdd("before"))
        op = OperatorProcess(kubeconfig=cluster.kubeconfig, log_path=tmp_path / "operator.log", namespace="default",
                             identity="solo", resync_seconds=1.0).start()
        try:
            with cluster.api() as api:
                def exists(path: str) -> bool:
                    return api.get(path).status_code == 200

                _wait("children of 'before'", lambda: exists("/apis/apps/v1/namespaces/default/deployments/"
                                                             "before-decode"), op)
                # Down for longer than the renew deadline (5 s): the leader must stop, then come back.
                cluster.restart_apiserver(downtime=8.0)
                cluster.kubectl("apply", "-f", "-", stdin=_pdd("after"))
                _wait("children of 'after'", lambda: exists("/apis/apps/v1/namespaces/default/deployments/"
                                                           "after-decode"), op, timeout=120)
                status = _wait("status of 'after'", lambda: api.get(
                    "/apis/daybreak.dev/v1alpha1/namespaces/default/pddeployments/after").json().get("status"), op)
                assert status.get("kvNamespace")
            assert op.alive()
            log = op.log()
            assert "renew failed" in log or "renew deadline passed" in log
            assert "leadership lost" in log
            assert len(re.findall(r"leader election acquired", log)) >= 2
            # Reconciles that failed during the outage were retried with a growing back-off, per object.
            delays = [float(d) for d in re.findall(r"reconcile failed kind=PDDeployment namespace=default "
                                                   r"name=before .*retry_in=([0-9.]+)s", log)]
            assert len(delays) >= 2, log[-4000:]
            assert delays[1] > delays[0]
            assert op.metric("daybreak_operator_leader") == 1.0
            assert op.metric("daybreak_operator_leader_transitions_total") == 2.0
            assert op.metric("daybreak_operator_apiserver_errors_total", status="0") > 0
            assert "Traceback" not in log
        finally:
            op.stop()
