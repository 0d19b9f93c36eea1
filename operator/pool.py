"""What a KVPool turns into (agent DaemonSet, config, token, Service, RBAC) and how its status is summed up.

Pure functions of the pool and the observed children: no I/O here, so the
shape of every child is unit-testable and the reconciler stays a loop of
"build, apply, observe".

Agent privileges, and why each is needed (nothing else is granted):
- host ``/sys`` read-only at ``/host/sys``: topology discovery (PCI, NUMA, RDMA devices);
- host ``/dev/shm``: the DRAM tier lives in shared-memory segments there, so a
  restarted agent re-adopts them and same-node engines map them (zero copy);
- the SSD tier's host directory, when the tier is enabled;
- host ``/dev/infiniband`` when rdma is an allowed transport (verbs devices);
- ``IPC_LOCK``: pinning registered memory; with it the kernel ignores
  RLIMIT_MEMLOCK for mlock and verbs registration, which is how "memlock
  unlimited" is expressed in a Pod (there is no ulimit field);
- ``hostNetwork``: agents are reached on the node's own addresses (RDMA NICs,
  no overlay hop), as Mooncake's and NCCL's node daemons are.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import yaml

from daybreak.api.kvpool import KVPool, Transport
from daybreak.operator import conditions as cond
from daybreak.operator.children import dns_name, standard_labels
from daybreak.operator.kube import Manifest

AGENT_APP = "daybreak-agent"
AGENT_COMPONENT = "agent"
AGENT_CLUSTERROLE = "daybreak-agent"
AGENT_SA_SUFFIX = "daybreak-agent"  # installed by the chart (nodes: get, list, watch, patch)
TOKEN_KEY = "token"
CONFIG_DIR = "/etc/daybreak"
AGENT_CONFIG_FILE = "agent.yaml"
POOL_FILE = "pool.json"
TOKEN_DIR = "/var/run/daybreak/token"
HOST_SYS = "/host/sys"
CONFIG_HASH_ANNOTATION = "daybreak.dev/config-hash"
NAMESPACE_LABEL = "daybreak.dev/namespace"


@dataclass(frozen=True)
class PoolNames:
    """Names of a pool's children (stable; long pool names are cut with a hash)."""

    pool: str
    namespace: str

    @property
    def agent(self) -> str:  # DaemonSet, Role, RoleBinding
        return dns_name(self.pool, "agent")

    @property
    def service_account(self) -> str:
        """Ends in -daybreak-agent: the chart's admission policy recognises agents by this suffix."""
        return dns_name(self.pool, AGENT_SA_SUFFIX, limit=253)

    @property
    def config(self) -> str:
        return dns_name(self.pool, "agent-config")

    @property
    def service(self) -> str:
        return dns_name(self.pool, "agents")

    @property
    def generated_token(self) -> str:
        return dns_name(self.pool, "token")

    @property
    def cluster_binding(self) -> str:
        return dns_name("daybreak-agent", self.namespace, self.pool, limit=253)

    def service_host(self) -> str:
        """DNS name of the headless Service: resolves to every ready agent."""
        return f"{self.service}.{self.namespace}.svc"


def token_secret_name(pool: KVPool) -> str:
    names = PoolNames(pool.metadata.name or "", pool.metadata.namespace or "")
    if pool.spec.auth and pool.spec.auth.secret_ref:
        return pool.spec.auth.secret_ref.name
    return names.generated_token


def labels_for(pool: KVPool, component: str = AGENT_COMPONENT) -> dict[str, str]:
    name = pool.metadata.name or ""
    return standard_labels(name=AGENT_APP, instance=dns_name(name), component=component, pool=dns_name(name))


def selector_for(pool: KVPool) -> dict[str, str]:
    """The agent Pods of this pool (immutable in the DaemonSet, so kept minimal)."""
    full = labels_for(pool)
    return {k: full[k] for k in ("daybreak.dev/pool", "app.kubernetes.io/component")}


def agent_settings(pool: KVPool, *, metrics_port: int) -> dict[str, Any]:
    """The agent's settings file: the pool's effective config in AgentSettings' field names."""
    from daybreak.agent.settings import AgentSettings  # the agent's own schema: what we write, it can read

    spec = pool.spec
    tiers = spec.tiers
    dram = tiers.dram if tiers.dram and tiers.dram.enabled else None
    ssd = tiers.ssd if tiers.ssd and tiers.ssd.enabled else None
    hbm = tiers.hbm if tiers.hbm and tiers.hbm.enabled else None
    candidate: dict[str, Any] = {
        "pool_name": pool.metadata.name,
        "pool_namespace": pool.metadata.namespace,
        "sysfs_root": HOST_SYS,
        "listen": f"0.0.0.0:{spec.agent.port}",
        "dram_bytes": dram.bytes_per_node if dram else 0,
        "huge_pages": bool(dram and dram.huge_pages),
        "ssd_path": ssd.path if ssd else "",
        "ssd_bytes": ssd.bytes_per_node if ssd else 0,
        "hbm_bytes": hbm.bytes_per_device if hbm else 0,
        "replicas": spec.replication.replicas,
        "token_file": f"{TOKEN_DIR}/{TOKEN_KEY}",
        "metrics_port": metrics_port,
        "eviction_policy": spec.eviction.policy.value,
        "high_watermark": spec.eviction.high_watermark,
        "low_watermark": spec.eviction.low_watermark,
        "lease_seconds": spec.lease_seconds,
        "transports": [t.value for t in spec.transport.preference],
    }
    known = AgentSettings.model_fields
    values = {k: v for k, v in candidate.items() if k in known}
    # Validate now: a config the agent would refuse must fail the reconcile, not crash-loop the DaemonSet.
    AgentSettings.model_validate(values)
    return values


def config_data(pool: KVPool, *, metrics_port: int) -> dict[str, str]:
    return {
        AGENT_CONFIG_FILE: yaml.safe_dump(agent_settings(pool, metrics_port=metrics_port), sort_keys=True),
        POOL_FILE: json.dumps(pool.spec.to_dict(), indent=2, sort_keys=True),
    }


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def rdma_wanted(pool: KVPool) -> bool:
    return Transport.RDMA in pool.spec.transport.preference


@dataclass
class PoolChildren:
    """Everything a pool owns, in apply order, plus the token Secret (created once, never re-applied)."""

    applied: list[Manifest] = field(default_factory=list)
    token_secret: Manifest | None = None
    cluster_binding: Manifest | None = None


def build(pool: KVPool, *, image: str, metrics_port: int) -> PoolChildren:
    """The desired children of ``pool``."""
    name = pool.metadata.name or ""
    namespace = pool.metadata.namespace or ""
    names = PoolNames(name, namespace)
    spec = pool.spec
    labels = labels_for(pool)
    data = config_data(pool, metrics_port=metrics_port)
    secret_name = token_secret_name(pool)
    out = PoolChildren()

    out.applied.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": names.service_account}})
    # Namespaced rights: read its own pool (endpoints = membership) and its peers. The token comes through
    # the mount only. Per-node reports go to the cluster-scoped KVNode (the chart's ClusterRole).
    out.applied.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": names.agent},
        "rules": [
            {"apiGroups": ["daybreak.dev"], "resources": ["kvpools"], "resourceNames": [name],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    })
    out.applied.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": names.agent},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.agent},
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account, "namespace": namespace}],
    })
    out.applied.append({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": names.config}, "data": data,
    })
    out.applied.append({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": names.service},
        "spec": {
            "clusterIP": "None", "selector": selector_for(pool),
            "ports": [{"name": "store", "port": spec.agent.port, "targetPort": spec.agent.port, "protocol": "TCP"},
                      {"name": "metrics", "port": metrics_port, "targetPort": metrics_port, "protocol": "TCP"}],
            # Engines must only see agents that serve (readiness), never half-started ones.
            "publishNotReadyAddresses": False,
        },
    })
    out.applied.append(daemonset(pool, image=image, metrics_port=metrics_port, labels=labels,
                                 config_hash=_hash(data), secret_name=secret_name))
    if not (spec.auth and spec.auth.secret_ref):
        out.token_secret = {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name}, "type": "Opaque",
            "stringData": {TOKEN_KEY: secrets.token_urlsafe(32)},
        }
    # Nodes are cluster-scoped, so reading and labelling them needs a cluster binding; a namespaced
    # owner cannot own it (no garbage collection): the operator sweeps bindings of vanished pools.
    out.cluster_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": names.cluster_binding,
                     "labels": {**labels, NAMESPACE_LABEL: dns_name(namespace)},
                     "annotations": {"daybreak.dev/pool": f"{namespace}/{name}"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_CLUSTERROLE},
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account, "namespace": namespace}],
    }
    return out


def daemonset(pool: KVPool, *, image: str, metrics_port: int, labels: dict[str, str], config_hash: str,
              secret_name: str) -> Manifest:
    names = PoolNames(pool.metadata.name or "", pool.metadata.namespace or "")
    spec = pool.spec
    volumes: list[dict[str, Any]] = [
        {"name": "host-sys", "hostPath": {"path": "/sys", "type": "Directory"}},
        {"name": "dev-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
        {"name": "config", "configMap": {"name": names.config}},
        {"name": "token", "secret": {"secretName": secret_name, "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "host-sys", "mountPath": HOST_SYS, "readOnly": True},
        {"name": "dev-shm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    ssd = spec.tiers.ssd
    if ssd and ssd.enabled:
        volumes.append({"name": "ssd", "hostPath": {"path": ssd.path, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "ssd", "mountPath": ssd.path})
    if spec.tiers.dram and spec.tiers.dram.enabled and spec.tiers.dram.huge_pages:
        volumes.append({"name": "hugepages", "hostPath": {"path": "/dev/hugepages", "type": "Directory"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    if rdma_wanted(pool):
        # No type check: nodes without RDMA still run the agent (it falls back to tcp).
        volumes.append({"name": "infiniband", "hostPath": {"path": "/dev/infiniband"}})
        mounts.append({"name": "infiniband", "mountPath": "/dev/infiniband"})
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.agent.image or image,
        "command": ["daybreak", "agent", "--config", f"{CONFIG_DIR}/{AGENT_CONFIG_FILE}"],
        "env": [
            {"name": "DAYBREAK_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "DAYBREAK_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "DAYBREAK_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # hostNetwork: the pod IP is the node's address, which peers and engines dial.
            {"name": "DAYBREAK_ADVERTISE", "value": f"$(DAYBREAK_POD_IP):{spec.agent.port}"},
            # ...and the one it listens on (store and metrics): several fake nodes of the local cluster
            # share one host, each on its own loopback address.
            {"name": "DAYBREAK_LISTEN", "value": f"$(DAYBREAK_POD_IP):{spec.agent.port}"},
        ],
        "ports": [{"name": "store", "containerPort": spec.agent.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}],
        "securityContext": {
            "privileged": False, "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]},
        },
        "volumeMounts": mounts,
        "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "store"}, "initialDelaySeconds": 30, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    if spec.agent.resources is not None:
        container["resources"] = spec.agent.resources.to_dict()
    pod_spec: dict[str, Any] = {
        "serviceAccountName": names.service_account,
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        # Agents hand their blocks to other nodes before leaving (node drain): give them time.
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_dict() for t in spec.tolerations]
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": names.agent},
        "spec": {
            "selector": {"matchLabels": selector_for(pool)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
                "spec": pod_spec,
            },
        },
    }


# -- status ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentReport:
    """What one node's agent published (its KVNode status): capacity and use per tier, in bytes."""

    node: str
    capacity: dict[str, int]
    used: dict[str, int]

    @classmethod
    def from_kvnode(cls, obj: Manifest) -> AgentReport | None:
        status = obj.get("status") or {}
        if not status.get("capacity"):
            return None
        node = (obj.get("spec") or {}).get("nodeName") or (obj.get("metadata") or {}).get("name", "")
        return cls(node=str(node), capacity=dict(status.get("capacity") or {}), used=dict(status.get("used") or {}))


def status(pool: KVPool, *, daemonset: Manifest | None, pods: list[Manifest], reports: list[AgentReport],
           existing: dict[str, Any] | None, generation: int | None) -> dict[str, Any]:
    """The pool's status from its DaemonSet, its agent Pods and what the agents report."""
    ds_status = (daemonset or {}).get("status") or {}
    desired = int(ds_status.get("desiredNumberScheduled") or 0)
    ready_pods = [p for p in pods if _pod_ready(p) and not (p.get("metadata") or {}).get("deletionTimestamp")]
    ready = min(len(ready_pods), desired) if daemonset is not None else 0
    port = pool.spec.agent.port
    transports = [t.value for t in pool.spec.transport.preference]
    endpoints = sorted(
        ({"node": p["spec"].get("nodeName", ""), "address": (p.get("status") or {}).get("podIP", ""),
          "port": port, "transports": transports}
         for p in ready_pods if (p.get("status") or {}).get("podIP")),
        key=lambda e: (e["node"], e["address"]),
    )
    ready_nodes = {e["node"] for e in endpoints}
    capacity = {"hbm": 0, "dram": 0, "ssd": 0}
    used = {"hbm": 0, "dram": 0, "ssd": 0}
    reported = {r.node: r for r in reports}
    for node in ready_nodes:
        report = reported.get(node)
        if report is not None:
            for tier in capacity:
                capacity[tier] += int(report.capacity.get(tier, 0))
                used[tier] += int(report.used.get(tier, 0))
        else:
            # No report yet: count what the spec promises per node (HBM needs the device count: left out).
            tiers = pool.spec.tiers
            if tiers.dram and tiers.dram.enabled:
                capacity["dram"] += tiers.dram.bytes_per_node
            if tiers.ssd and tiers.ssd.enabled:
                capacity["ssd"] += tiers.ssd.bytes_per_node

    conds: list[cond.Condition] = []
    if daemonset is None:
        conds.append(cond.Condition("Ready", cond.FALSE, "AgentsPending", "the agent DaemonSet does not exist yet"))
        conds.append(cond.Condition("Degraded", cond.FALSE, "AsExpected", ""))
    elif desired == 0:
        sel = ",".join(f"{k}={v}" for k, v in sorted(pool.spec.node_selector.items())) or "(none)"
        conds.append(cond.Condition("Ready", cond.FALSE, "NoNodesSelected",
                                    f"no schedulable node matches nodeSelector {sel}; label nodes or fix the "
                                    "selector and tolerations"))
        conds.append(cond.Condition("Degraded", cond.FALSE, "AsExpected", ""))
    elif ready >= desired:
        conds.append(cond.Condition("Ready", cond.TRUE, "AgentsReady", f"{ready}/{desired} agents ready"))
        conds.append(cond.Condition("Degraded", cond.FALSE, "AsExpected", ""))
    else:
        conds.append(cond.Condition("Ready", cond.FALSE, "AgentsNotReady",
                                    f"{ready}/{desired} agents ready; see the agent pods' events and logs"))
        degraded = cond.TRUE if ready > 0 else cond.FALSE
        reason = "AgentsUnavailable" if ready > 0 else "AgentsStarting"
        conds.append(cond.Condition("Degraded", degraded, reason,
                                    f"{desired - ready} of {desired} agents not ready" if ready > 0 else ""))
    old = existing or {}
    return {
        **{k: v for k, v in old.items() if k not in ("conditions", "nodes", "capacity", "used", "endpoints",
                                                     "observedGeneration")},
        "observedGeneration": generation,
        "conditions": cond.merge(old.get("conditions"), conds, generation=generation),
        "nodes": {"desired": desired, "ready": ready},
        "capacity": capacity,
        "used": used,
        "endpoints": endpoints,
    }


def _pod_ready(pod: Manifest) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False
