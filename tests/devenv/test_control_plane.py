"""The local control plane is real: the official client, kubectl and helm all talk to it."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from kubernetes import client, config

from daybreak.devenv import tools
from daybreak.devenv.cluster import LocalCluster


def _core(c: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(c.kubeconfig)))


def test_namespace_and_configmap_round_trip(kube: LocalCluster) -> None:
    core = _core(kube)
    ns = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="cfg"),
                                                             data={"tier": "dram"}))
    assert core.read_namespaced_config_map("cfg", ns).data == {"tier": "dram"}
    out = kube.kubectl("get", "ns", "-o", "name").stdout.split()
    assert f"namespace/{ns}" in out


def test_kubectl_and_helm_run_from_the_built_tools(kube: LocalCluster) -> None:
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["clientVersion"]["gitVersion"].startswith("v1.37.")
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    helm = subprocess.run([str(tools.find("helm")), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert helm.returncode == 0, helm.stderr
    assert helm.stdout.startswith("v3.")


@pytest.mark.e2e
def test_deployment_runs_on_fake_nodes_and_is_garbage_collected(cluster: LocalCluster) -> None:
    apps = client.AppsV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
    core = _core(cluster)
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    labels = {"app": "web"}
    apps.create_namespaced_deployment(ns, client.V1Deployment(
        metadata=client.V1ObjectMeta(name="web"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="web", image="example.invalid/web:1")]),
            ),
        ),
    ))
    deadline = time.monotonic() + 90
    running: list[client.V1Pod] = []
    while time.monotonic() < deadline:
        pods = core.list_namespaced_pod(ns, label_selector="app=web").items
        running = [p for p in pods if p.status.phase == "Running"]
        if len(running) == 2:
            break
        time.sleep(0.5)
    assert len(running) == 2, [(p.metadata.name, p.status.phase) for p in running]
    assert {p.spec.node_name for p in running} <= {"daybreak-node-0", "daybreak-node-1"}

    apps.delete_namespaced_deployment("web", ns, propagation_policy="Background")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not core.list_namespaced_pod(ns, label_selector="app=web").items:
            break
        time.sleep(0.5)
    assert core.list_namespaced_pod(ns, label_selector="app=web").items == []


@pytest.mark.e2e
def test_fake_nodes_advertise_accelerators(cluster: LocalCluster) -> None:
    nodes = {n.metadata.name: n for n in _core(cluster).list_node().items}
    assert {"daybreak-node-0", "daybreak-node-1"} <= set(nodes)
    node = nodes["daybreak-node-0"]
    assert node.metadata.labels["daybreak.dev/accelerator"] == "sunrise"
    assert node.status.allocatable["daybreak.dev/sunrise"] == "8"
