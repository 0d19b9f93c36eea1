"""The process kubelet's pure parts: which pods it takes, env expansion, path rewriting, probes, mirrored slices."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daybreak.devenv import kubelet as k


def _pod(*commands: list[str], labels: dict[str, str] | None = None, name: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels or {}},
            "spec": {"nodeName": "n0", "containers": [{"name": f"c{i}", "command": c, "ports": [
                {"name": "http", "containerPort": 8000}]} for i, c in enumerate(commands)]},
            "status": {}}


def test_the_kubelet_takes_exactly_the_pods_kwoks_stages_skip() -> None:
    assert k.is_process_pod(_pod(["daybreak", "agent"]))
    assert k.is_process_pod(_pod(["sleep", "1"], ["daybreak", "router"]))
    assert not k.is_process_pod(_pod(["sleep", "1"]))
    assert not k.is_process_pod(_pod([]))
    assert not k.is_process_pod(_pod(["/usr/bin/daybreak"]))  # kwok's NotIn compares the exact string
    vllm = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert k.is_process_pod(_pod(vllm))
    assert k.is_process_pod(_pod(["sleep", "1"], vllm))
    assert not k.is_process_pod(_pod(["python3", "-m", "vllm.entrypoints.cli.main"]))
    assert not k.is_process_pod(_pod(["python3", "-m"]))  # a short command has no word 2: kwok's null, not in the set
    assert k.KWOK_EXCLUSIONS == [
        {"key": ".spec.containers.[].command.[0]", "operator": "NotIn", "values": ["daybreak"]},
        {"key": ".spec.containers.[].command.[2]", "operator": "NotIn",
         "values": ["vllm.entrypoints.openai.api_server"]}]


def _worker(tmp_path: Path, *, vllm_python: Path | None) -> k.PodWorker:
    kubelet = k.ProcessKubelet(directory=tmp_path, server="https://127.0.0.1:1", ca_cert=tmp_path / "ca",
                               api_factory=lambda: None,  # type: ignore[arg-type,return-value]
                               slot=k.AddressSlot(7), vllm_python=vllm_python)
    return k.PodWorker(kubelet, _pod(["daybreak"]))


def test_a_vllm_container_runs_with_the_configured_interpreter_and_its_args_expanded(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    worker = _worker(tmp_path, vllm_python=python)
    container = {"name": "engine", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server", "--host",
                                               "$(POD_IP)", "--port", "8000"], "args": ["--enforce-eager"]}
    argv = worker.command_line(container, {"POD_IP": "127.7.1.3"})
    assert argv == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.7.1.3", "--port",
                    "8000", "--enforce-eager"]
    daybreak = worker.command_line({"name": "agent", "command": ["daybreak", "agent"]}, {})
    assert Path(daybreak[0]).name == "daybreak" and daybreak[1:] == ["agent"]


def test_a_vllm_container_without_an_interpreter_or_with_another_launcher_gets_a_clear_error(
        tmp_path: Path) -> None:
    missing = _worker(tmp_path, vllm_python=tmp_path / "nope" / "python")
    container = {"name": "engine", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}
    with pytest.raises(ValueError, match="does not exist"):
        missing.command_line(container, {})
    wrapped = {"name": "engine", "command": ["bash", "-c", "vllm.entrypoints.openai.api_server"]}
    with pytest.raises(ValueError, match="must start `python3 -m"):
        missing.command_line(wrapped, {})
    with pytest.raises(ValueError, match="runs neither"):
        missing.command_line({"name": "x", "command": ["sleep", "1"]}, {})


def test_env_expansion_follows_kubernetes_rules() -> None:
    env = {"POD_IP": "127.1.0.7", "PORT": "7400"}
    assert k.expand("$(POD_IP):$(PORT)", env) == "127.1.0.7:7400"
    assert k.expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert k.expand("$$(POD_IP) is escaped", env) == "$(POD_IP) is escaped"


def test_mount_paths_are_rewritten_on_path_boundaries_only() -> None:
    mounts = [("/etc/daybreak", "/c/pods/p/volumes/config"), ("/etc/daybreak/extra", "/c/x"),
              ("/host/sys", "/c/nodes/n0/sys")]
    assert k.rewrite_paths("--config /etc/daybreak/agent.yaml", mounts) == "--config /c/pods/p/volumes/config/agent.yaml"
    assert k.rewrite_paths("/etc/daybreak/extra/f", mounts) == "/c/x/f"  # the longest mount wins
    assert k.rewrite_paths("sysfs_root: /host/sys\n", mounts) == "sysfs_root: /c/nodes/n0/sys\n"
    assert k.rewrite_paths("/etc/daybreakish /x/etc/daybreak", mounts) == "/etc/daybreakish /x/etc/daybreak"
    assert k.rewrite_paths('{"dir": "/etc/daybreak"}', mounts) == '{"dir": "/c/pods/p/volumes/config"}'


def test_downward_api_fields() -> None:
    pod = _pod(["daybreak"], labels={"app": "x"})
    pod["status"] = {"podIP": "127.1.0.3", "hostIP": "127.0.1.1", "podIPs": [{"ip": "127.1.0.3"}]}
    assert k.field_ref(pod, "status.podIP") == "127.1.0.3"
    assert k.field_ref(pod, "status.hostIP") == "127.0.1.1"
    assert k.field_ref(pod, "metadata.name") == "p" and k.field_ref(pod, "metadata.namespace") == "ns"
    assert k.field_ref(pod, "spec.nodeName") == "n0"
    assert k.field_ref(pod, "spec.serviceAccountName") == "default"
    assert k.field_ref(pod, "metadata.labels['app']") == "x"
    with pytest.raises(ValueError, match="not supported"):
        k.field_ref(pod, "status.nonsense")


def test_probe_thresholds_and_initial_delay() -> None:
    probe = k.ProbeState({"initialDelaySeconds": 5, "periodSeconds": 2, "failureThreshold": 2,
                          "successThreshold": 1}, started_at=100.0)
    assert not probe.due(104.9) and probe.due(105.0)
    probe.record(True, 105.0)
    assert probe.result is True and not probe.due(106.0) and probe.due(107.0)
    probe.record(False, 107.0)
    assert probe.result is True  # one failure is below the threshold
    probe.record(False, 109.0)
    assert probe.result is False
    assert k.resolve_port("http", {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}) == 8000
    assert k.resolve_port(9000, {"name": "c"}) == 9000
    with pytest.raises(ValueError, match="not a port"):
        k.resolve_port("grpc", {"name": "c", "ports": []})


def test_addresses_are_loopback_and_kept_apart(tmp_path: Path) -> None:
    first, second = k.claim_slot(tmp_path / "a"), k.claim_slot(tmp_path / "a")
    try:
        assert first.index != second.index  # one slot per running cluster, even for the same directory
        assert first.node_address(0) == f"127.{first.index}.0.1" and first.node_address(1) == f"127.{first.index}.0.2"
        kubelet = k.ProcessKubelet(directory=tmp_path, server="https://x", ca_cert=Path("/ca"), slot=first,
                                   api_factory=lambda: None)  # type: ignore[arg-type,return-value]
        ips = {kubelet.allocate_ip(f"uid-{i}") for i in range(300)}
        assert len(ips) == 300 and all(ip.startswith(f"127.{first.index}.") for ip in ips)
        assert not any(ip.endswith((".0", ".255")) or ip.startswith(first.node_prefix) for ip in ips)
        assert kubelet.allocate_ip("uid-7") in ips  # stable per pod
    finally:
        first.release()
        second.release()
    again = k.claim_slot(tmp_path / "a")  # released: the directory's preferred slot is free again
    assert again.index == first.index
    assert again.path.exists()
    # A claimer that opened the lock file before its holder released it gets the lock of a removed file:
    # it must not take the slot (a third claimer would lock a new file of the same name).
    late = os.open(again.path, os.O_RDWR)
    try:
        assert k.still_linked(late, again.path)
        again.release()
        assert not again.path.exists()  # a cluster stopped cleanly leaves no lock file behind
        assert not k.still_linked(late, again.path)
    finally:
        os.close(late)
    assert k.shm_root(Path("/a")) != k.shm_root(Path("/b"))


def test_the_mirrored_slice_carries_readiness_ports_and_owner() -> None:
    service = {"metadata": {"name": "sim-decode", "namespace": "ns", "uid": "svc-uid"},
               "spec": {"selector": {"role": "decode"}, "ports": [{"name": "http", "port": 8000,
                                                                   "targetPort": "http"}]}}
    ready = SimpleNamespace(pod_ip="127.1.0.2", node="n0", terminating=False,
                            last_status={"conditions": [{"type": "Ready", "status": "True"}]})
    unready = SimpleNamespace(pod_ip="127.1.0.3", node="n1", terminating=False,
                              last_status={"conditions": [{"type": "Ready", "status": "False"}]})
    other = SimpleNamespace(pod_ip="127.1.0.4", node="n1", terminating=False, last_status={})
    body = k.desired_slice(service, [(_pod(["daybreak"], labels={"role": "decode"}, name="a"), ready),
                                     (_pod(["daybreak"], labels={"role": "decode"}, name="b"), unready),
                                     (_pod(["daybreak"], labels={"role": "prefill"}, name="c"), other)])
    assert body is not None
    assert body["addressType"] == "FQDN" and body["metadata"]["name"] == "sim-decode-local"
    assert body["metadata"]["labels"] == {"kubernetes.io/service-name": "sim-decode",
                                          "endpointslice.kubernetes.io/managed-by": k.MANAGER}
    assert body["metadata"]["ownerReferences"][0]["uid"] == "svc-uid"
    assert body["ports"] == [{"port": 8000, "protocol": "TCP", "name": "http"}]
    assert [(e["addresses"], e["conditions"]["ready"]) for e in body["endpoints"]] == [
        (["127.1.0.2"], True), (["127.1.0.3"], False)]
    assert k.desired_slice({**service, "spec": {**service["spec"], "selector": {"role": "none"}}},
                           [(_pod(["daybreak"], labels={"role": "decode"}), ready)]) is None
    assert len(k.slice_name("s" * 80)) <= 63


def test_a_fake_nodes_sysfs_shows_its_accelerators_to_discovery(tmp_path: Path) -> None:
    from daybreak.agent.publish import node_labels
    from daybreak.agent.topology.discover import discover

    k.write_fake_sysfs(tmp_path / "sys", accelerator="sunrise", count=4)
    labels = node_labels(discover(tmp_path / "sys"), node_name="n0", rdma=False)
    assert labels["daybreak.dev/accelerator"] == "sunrise" and labels["daybreak.dev/accelerator-count"] == "4"
    k.write_fake_sysfs(tmp_path / "nv", accelerator="nvidia", count=2)
    labels = node_labels(discover(tmp_path / "nv"), node_name="n1", rdma=False)
    assert labels["daybreak.dev/accelerator"] == "nvidia" and labels["daybreak.dev/accelerator-count"] == "2"


def test_a_host_path_put_in_is_not_rewritten_again_by_a_tmp_mount() -> None:
    # The agent mounts an emptyDir at /tmp while the cluster's pod directories live under /tmp too.
    mounts = [("/etc/daybreak", "/tmp/c/pods/p/volumes/config"), ("/tmp", "/tmp/c/pods/p/volumes/tmp")]
    assert k.rewrite_paths("--config /etc/daybreak/agent.yaml --scratch /tmp/x", mounts) == (
        "--config /tmp/c/pods/p/volumes/config/agent.yaml --scratch /tmp/c/pods/p/volumes/tmp/x")


def test_dev_down_kills_a_vllm_pod_a_dead_supervisor_left_running(tmp_path: Path) -> None:
    """kill_leftovers takes what the kubelet starts, vLLM's `python -m vllm...` too, by the pid files it wrote."""
    module = tmp_path / "lib" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    (module / "api_server.py").write_text("import time\ntime.sleep(120)\n")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path / "lib")}
    engine = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], env=env,
                              start_new_session=True)
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)  # not one of ours: left alone
    try:
        pod = tmp_path / "cluster" / "pods" / "ns_p"
        pod.mkdir(parents=True)
        (pod / "engine.pid").write_text(f"{engine.pid}\n")
        (pod / "other.pid").write_text(f"{other.pid}\n")
        deadline = time.monotonic() + 30
        while b"vllm.entrypoints" not in Path(f"/proc/{engine.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
        assert k.kill_leftovers(tmp_path / "cluster") == [engine.pid]
        assert engine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (engine, other):
            if p.poll() is None:
                p.kill()
            p.wait()
