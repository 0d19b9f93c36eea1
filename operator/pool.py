"""What a KVPool turns into (agent DaemonSet, config, token, Service, RBAC) and how its status is summed up.

Pure functions of the pool and the observed children: no I/O here, so the
shape of every child is unit-testable and the reconciler stays a loop of
"build, apply, observe".

Agent privileges, and why each is needed (nothing else is granted; docs/security.md):
- host ``/sys`` read-only at ``/host/sys``: topology discovery (PCI, NUMA, RDMA devices);
- host ``/dev/shm``: the DRAM tier lives in shared-memory segments there, so a
  restarted agent re-adopts them and same-node engines map them (zero copy);
- the SSD tier's host directory, when the tier is enabled, and only under a
  root the cluster admin allowed (``PoolPolicy.allowed_ssd_roots``); the agent
  keeps the pool's blocks in its own subdirectory named after the pool's
  namespace, name and uid, and removes it when the pool leaves the node;
- host ``/dev/infiniband`` when rdma is an allowed transport (verbs devices;
  rdma is opt-in: the default transport list leaves it out);
- ``IPC_LOCK``, with rdma only: pinning registered memory; with it the kernel
  ignores RLIMIT_MEMLOCK for verbs registration, which is how "memlock
  unlimited" is expressed in a Pod (there is no ulimit field);
- ``hostNetwork``: agents are reached on the node's own addresses (RDMA NICs,
  no overlay hop), as Mooncake's and NCCL's node daemons are. Each pool's
  agents take two host ports, ``spec.agent.port`` (store) and the next one
  (/metrics), from the admin's ``poolPolicy.agentPortRange``: no port is
  shared by every pool, so pools with different ports share nodes.

The agent runs as user 65532 with no capabilities and a read-only root file
system unless rdma is allowed (a capability is effective only for
uid 0 in a container: Kubernetes has no ambient capabilities, and
no_new_privs disables file capabilities). The SSD directory, created root-owned by the kubelet, is handed
to 65532 by an init container that holds only CHOWN and DAC_READ_SEARCH.

Its primary group is the pool's own id (``PoolPolicy.pool_group``), which its
engines run as: the DRAM tier's segments are created mode 0660, so the pool's
engines map them and other pools' engines (another id, never root) cannot.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from daybreak.api import labels as vocab
from daybreak.api.agentconfig import AgentConfig
from daybreak.api.kvpool import KVPool, Transport
from daybreak.errors import DaybreakError
from daybreak.operator import conditions as cond
from daybreak.operator.children import dns_name, standard_labels
from daybreak.operator.kube import Manifest
from daybreak.operator.pool_policy import AGENT_SA_SUFFIX, PolicyError, PoolPolicy, pool_violations

AGENT_APP = "daybreak-agent"
AGENT_COMPONENT = "agent"
AGENT_CLUSTERROLE = "daybreak-agent"
AGENT_BINDING = "daybreak-agents"  # the chart's ClusterRoleBinding; the operator edits only its subjects
AGENT_UID = 65532  # the image's non-root user
TOKEN_KEY = "token"
CONFIG_DIR = "/etc/daybreak"
AGENT_CONFIG_FILE = "agent.yaml"
POOL_FILE = "pool.json"
TOKEN_DIR = "/var/run/daybreak/token"
TLS_DIR = "/var/run/daybreak/tls"  # the pool's spec.tls Secret (kubernetes.io/tls keys, cert-manager's ca.crt)
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"
HOST_SYS = "/host/sys"
CONFIG_HASH_ANNOTATION = vocab.CONFIG_HASH


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
        return dns_name(self.pool, AGENT_SA_SUFFIX.removeprefix("-"), limit=253)

    @property
    def config(self) -> str:
        return dns_name(self.pool, "agent-config")

    @property
    def service(self) -> str:
        return dns_name(self.pool, "agents")

    @property
    def generated_token(self) -> str:
        return dns_name(self.pool, "token")

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
    return {k: full[k] for k in (vocab.POOL, vocab.COMPONENT)}


def metrics_port(pool: KVPool) -> int:
    """The agents' /metrics port: the one after the store port (both host ports, both the pool's own)."""
    return pool.spec.agent.port + 1


class AgentConfigError(DaybreakError, ValueError):
    """The agent config rendered from a KVPool is one the agent would refuse (a key it does not know, a value
    out of range): the reconcile fails with a condition naming the field instead of the DaemonSet crash-looping.

    A bug of the operator, never of the user's spec (the KVPool's schema admitted it), so the message says so.
    """

    def __init__(self, pool: KVPool, exc: ValidationError) -> None:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in exc.errors())
        self.fields = [".".join(str(p) for p in e["loc"]) for e in exc.errors()]
        super().__init__(f"the agent config rendered for KVPool {pool.metadata.namespace}/{pool.metadata.name} is "
                         f"not one the agent accepts ({problems}); the operator and agent versions disagree on "
                         "api.agentconfig.AgentConfig: run an operator and agents of the same release")


def agent_settings(pool: KVPool) -> dict[str, Any]:
    """The agent's config file (``api.agentconfig.AgentConfig``), rendered from the pool's effective spec.

    Exactly the model the agent loads: every key below is a field of it, nothing is filtered on the way, and
    a key it does not know raises ``AgentConfigError`` (a condition on the pool, not a crash-looping agent).
    """
    spec = pool.spec
    tiers = spec.tiers
    dram = tiers.dram if tiers.dram and tiers.dram.enabled else None
    ssd = tiers.ssd if tiers.ssd and tiers.ssd.enabled else None
    hbm = tiers.hbm if tiers.hbm and tiers.hbm.enabled else None
    candidate: dict[str, Any] = {
        "pool_name": pool.metadata.name,
        "pool_namespace": pool.metadata.namespace,
        # Names the pool's SSD directory under ssd_path: a pool created again under this name starts empty.
        "pool_uid": pool.metadata.uid or "",
        "sysfs_root": HOST_SYS,
        "listen": f"0.0.0.0:{spec.agent.port}",
        "dram_bytes": dram.bytes_per_node if dram else 0,
        "ssd_path": ssd.path if ssd else "",
        "ssd_bytes": ssd.bytes_per_node if ssd else 0,
        "hbm_bytes": hbm.bytes_per_device if hbm else 0,
        "replicas": spec.replication.replicas,
        "token_file": f"{TOKEN_DIR}/{TOKEN_KEY}",
        "metrics_port": metrics_port(pool),
        "shm_group_access": True,  # the pool's engines share the agent's primary group (the pool's id)
        "eviction_policy": spec.eviction.policy.value,
        "high_watermark": spec.eviction.high_watermark,
        "low_watermark": spec.eviction.low_watermark,
        "lease_seconds": spec.lease_seconds,
        "namespace_held_fraction": spec.quotas.held_fraction,
        "namespace_pinned_fraction": spec.quotas.pinned_fraction,
        "max_pin_seconds": spec.quotas.max_pin_seconds,
        "max_connections_per_credential": spec.quotas.max_connections_per_credential,
        "transports": [t.value for t in spec.transport.preference],
    }
    if spec.tls is not None:
        # The standalone agent's TLS settings, pointed at the mounted Secret: both tcp paths serve TLS only.
        candidate |= {"tls_cert_file": f"{TLS_DIR}/{TLS_CERT_KEY}", "tls_key_file": f"{TLS_DIR}/{TLS_KEY_KEY}",
                      "tls_ca_file": f"{TLS_DIR}/{TLS_CA_KEY}"}
    return render_agent_config(pool, candidate)


def render_agent_config(pool: KVPool, candidate: dict[str, Any]) -> dict[str, Any]:
    """``candidate`` validated as the agent's ``AgentConfig`` and dumped as it will be written (the keys given,
    in the agent's own types); raises ``AgentConfigError`` naming every key the agent would refuse."""
    try:
        config = AgentConfig.model_validate(candidate)
    except ValidationError as exc:
        raise AgentConfigError(pool, exc) from exc
    return config.model_dump(mode="json", include=set(candidate))


def config_data(pool: KVPool) -> dict[str, str]:
    return {
        AGENT_CONFIG_FILE: yaml.safe_dump(agent_settings(pool), sort_keys=True),
        POOL_FILE: json.dumps(pool.spec.to_dict(), indent=2, sort_keys=True),
    }


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def rdma_wanted(pool: KVPool) -> bool:
    return Transport.RDMA in pool.spec.transport.preference


def agent_needs_root(pool: KVPool) -> bool:
    """rdma (IPC_LOCK must be effective) needs uid 0; nothing else does."""
    return rdma_wanted(pool)


def agent_subject(namespace: str, service_account: str) -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}


def subject_key(subject: dict[str, Any]) -> tuple[str, str, str]:
    return (str(subject.get("kind", "")), str(subject.get("namespace", "")), str(subject.get("name", "")))


def agent_binding(subjects: list[dict[str, Any]]) -> Manifest:
    """The shared binding of every pool's agent ServiceAccount to the chart's daybreak-agent ClusterRole (the
    chart ships it; the operator creates it only when run without the chart, e.g. by a developer)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": AGENT_BINDING, "labels": {vocab.NAME: AGENT_APP,
                                                       vocab.COMPONENT: AGENT_COMPONENT}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_CLUSTERROLE},
        "subjects": subjects,
    }


@dataclass
class PoolChildren:
    """Everything a pool owns, in apply order, plus the token Secret (created once, never re-applied)."""

    applied: list[Manifest] = field(default_factory=list)
    token_secret: Manifest | None = None


def build(pool: KVPool, *, image: str, policy: PoolPolicy | None = None) -> PoolChildren:
    """The desired children of ``pool``; raises PolicyError (naming the fields) when the policy refuses it."""
    policy = policy or PoolPolicy()
    violations = pool_violations(pool, policy)
    if violations:
        raise PolicyError(violations)
    name = pool.metadata.name or ""
    namespace = pool.metadata.namespace or ""
    names = PoolNames(name, namespace)
    spec = pool.spec
    labels = labels_for(pool)
    data = config_data(pool)
    secret_name = token_secret_name(pool)
    out = PoolChildren()

    out.applied.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": names.service_account}})
    # Namespaced rights: read its own pool (its endpoints are the membership; the watch carries a
    # metadata.name field selector, which is what lets list/watch honour resourceNames), and mint the
    # engines' namespace credentials. The pool token comes through the mount only. Node and KVNode rights come from the shared binding (the chart's ClusterRole,
    # limited to the agent's own node by the chart's admission policy).
    out.applied.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": names.agent},
        "rules": [
            {"apiGroups": [vocab.GROUP], "resources": [vocab.KVPOOL_PLURAL], "resourceNames": [name],
             "verbs": ["get", "list", "watch"]},
            # The credential minter (daybreak.agent.credentials_minter): see the pool's PDDeployments and
            # create their namespace-credential Secrets. No get/list/update/delete of Secrets.
            {"apiGroups": [vocab.GROUP], "resources": [vocab.PDDEPLOYMENT_PLURAL], "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
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
                      {"name": "metrics", "port": metrics_port(pool), "targetPort": metrics_port(pool),
                       "protocol": "TCP"}],
            # Engines must only see agents that serve (readiness), never half-started ones.
            "publishNotReadyAddresses": False,
        },
    })
    out.applied.append(daemonset(pool, image=image, labels=labels, config_hash=_hash(data), secret_name=secret_name,
                                 priority_class=policy.agent_priority_class_name,
                                 group=policy.pool_group(pool.metadata.uid or "")))
    if not (spec.auth and spec.auth.secret_ref):
        out.token_secret = {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name}, "type": "Opaque",
            "stringData": {TOKEN_KEY: secrets.token_urlsafe(32)},
        }
    return out


def daemonset(pool: KVPool, *, image: str, labels: dict[str, str], config_hash: str, secret_name: str,
              group: int, priority_class: str = "") -> Manifest:
    """The agent DaemonSet; ``group`` is the pool's id (the agents' primary group, its engines' user and group)."""
    names = PoolNames(pool.metadata.name or "", pool.metadata.namespace or "")
    spec = pool.spec
    volumes: list[dict[str, Any]] = [
        {"name": "host-sys", "hostPath": {"path": "/sys", "type": "Directory"}},
        {"name": "dev-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
        {"name": "config", "configMap": {"name": names.config}},
        {"name": "token", "secret": {"secretName": secret_name, "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}},
        # The root file system is read-only; scratch space for Python and the libraries is this.
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "host-sys", "mountPath": HOST_SYS, "readOnly": True},
        {"name": "dev-shm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.tls is not None:
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls.secret_name, "items": [
            {"key": key, "path": key} for key in (TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY)]}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    root = agent_needs_root(pool)
    init: list[dict[str, Any]] = []
    ssd = spec.tiers.ssd
    if ssd and ssd.enabled:
        volumes.append({"name": "ssd", "hostPath": {"path": ssd.path, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "ssd", "mountPath": ssd.path})
        if not root:
            # The kubelet creates the directory root-owned; hand it (not following links) to the agent's user.
            init.append({
                "name": "ssd-owner", "image": spec.agent.image or image,
                "command": ["chown", "-R", "-h", f"{AGENT_UID}:{group}", ssd.path],
                "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "privileged": False,
                                    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"add": ["CHOWN", "DAC_READ_SEARCH"], "drop": ["ALL"]}},
                "volumeMounts": [{"name": "ssd", "mountPath": ssd.path}],
            })
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
                  {"name": "metrics", "containerPort": metrics_port(pool), "protocol": "TCP"}],
        "securityContext": {
            "privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"add": ["IPC_LOCK"] if rdma_wanted(pool) else [], "drop": ["ALL"]},
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
        # The pool's id as primary group: segments the agent creates are the pool's group's (mode 0660).
        "securityContext": ({"runAsUser": 0, "runAsGroup": group, "runAsNonRoot": False} if root else
                            {"runAsUser": AGENT_UID, "runAsGroup": group, "runAsNonRoot": True})
        | {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    if init:
        pod_spec["initContainers"] = init
    if priority_class:
        pod_spec["priorityClassName"] = priority_class
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
    """What one node's agent published (its KVNode status): capacity and use per tier, in bytes, and the
    transports it runs with the bytes each moved (never the spec's list: what the agent measured)."""

    node: str
    capacity: dict[str, int]
    used: dict[str, int]
    transports: tuple[str, ...] = ()
    bytes_moved: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_kvnode(cls, obj: Manifest) -> AgentReport | None:
        status = obj.get("status") or {}
        if not status.get("capacity"):
            return None
        node = (obj.get("spec") or {}).get("nodeName") or (obj.get("metadata") or {}).get("name", "")
        moved = {str(t.get("transport", "")): int(t.get("bytesUsed") or 0) + int(t.get("storeBytes") or 0)
                 for t in status.get("transfer") or []}
        return cls(node=str(node), capacity=dict(status.get("capacity") or {}), used=dict(status.get("used") or {}),
                   transports=tuple(str(t) for t in status.get("transports") or []), bytes_moved=moved)


def status(pool: KVPool, *, daemonset: Manifest | None, pods: list[Manifest], reports: list[AgentReport],
           existing: dict[str, Any] | None, generation: int | None) -> dict[str, Any]:
    """The pool's status from its DaemonSet, its agent Pods and what the agents report."""
    ds_status = (daemonset or {}).get("status") or {}
    desired = int(ds_status.get("desiredNumberScheduled") or 0)
    ready_pods = [p for p in pods if _pod_ready(p) and not (p.get("metadata") or {}).get("deletionTimestamp")]
    ready = min(len(ready_pods), desired) if daemonset is not None else 0
    port = pool.spec.agent.port
    reported = {r.node: r for r in reports}
    endpoints = sorted(
        ({"node": p["spec"].get("nodeName", ""), "address": (p.get("status") or {}).get("podIP", ""),
          "port": port, **_measured_transports(reported.get(p["spec"].get("nodeName", "")))}
         for p in ready_pods if (p.get("status") or {}).get("podIP")),
        key=lambda e: (e["node"], e["address"]),
    )
    ready_nodes = {e["node"] for e in endpoints}
    capacity = {"hbm": 0, "dram": 0, "ssd": 0}
    used = {"hbm": 0, "dram": 0, "ssd": 0}
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
        conds.append(cond.Condition(type="Ready", status=cond.FALSE, reason="AgentsPending", message="the agent DaemonSet does not exist yet"))
        conds.append(cond.Condition(type="Degraded", status=cond.FALSE, reason="AsExpected", message=""))
    elif desired == 0:
        sel = ",".join(f"{k}={v}" for k, v in sorted(pool.spec.node_selector.items())) or "(none)"
        conds.append(cond.Condition(type="Ready", status=cond.FALSE, reason="NoNodesSelected",
                                    message=f"no schedulable node matches nodeSelector {sel}; label nodes or fix the "
                                            "selector and tolerations"))
        conds.append(cond.Condition(type="Degraded", status=cond.FALSE, reason="AsExpected", message=""))
    elif ready >= desired:
        conds.append(cond.Condition(type="Ready", status=cond.TRUE, reason="AgentsReady", message=f"{ready}/{desired} agents ready"))
        conds.append(cond.Condition(type="Degraded", status=cond.FALSE, reason="AsExpected", message=""))
    else:
        conds.append(cond.Condition(type="Ready", status=cond.FALSE, reason="AgentsNotReady",
                                    message=f"{ready}/{desired} agents ready; see the agent pods' events and logs"))
        degraded = cond.TRUE if ready > 0 else cond.FALSE
        reason = "AgentsUnavailable" if ready > 0 else "AgentsStarting"
        conds.append(cond.Condition(type="Degraded", status=degraded, reason=reason,
                                    message=f"{desired - ready} of {desired} agents not ready" if ready > 0 else ""))
    old = existing or {}
    return {
        # flushRequests is the deployments' (rollout.py, written with a resourceVersion precondition): a
        # copy from the cached body written back here would drop a request made since that read.
        **{k: v for k, v in old.items() if k not in ("conditions", "nodes", "capacity", "used", "endpoints",
                                                     "observedGeneration", "flushRequests")},
        "observedGeneration": generation,
        "conditions": cond.merge(old.get("conditions"), conds, generation=generation),
        "nodes": {"desired": desired, "ready": ready},
        "capacity": capacity,
        "used": used,
        "endpoints": endpoints,
    }


def _measured_transports(report: AgentReport | None) -> dict[str, Any]:
    """An endpoint's transports and bytes per transport as its agent reported them; none before it reports.

    Names the API does not know (a newer agent's) are left out: the status schema would refuse them.
    """
    if report is None:
        return {"transports": [], "bytesMoved": {}}
    known = {t.value for t in Transport}
    return {"transports": [t for t in report.transports if t in known],
            "bytesMoved": {t: n for t, n in sorted(report.bytes_moved.items()) if t in known}}


def _pod_ready(pod: Manifest) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False
