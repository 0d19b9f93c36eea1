"""Tell the cluster what this node has: labels on the agent's own Node and its KVNode object.

Both are written with server-side apply under the field manager
``daybreak-agent``, so a label the agent stops setting (memory unknown after a
runtime failed, say) is removed by the API server and labels other managers
own are left alone. The agent touches ONLY its own node: every request names
it, and the one watch carries the field selector ``metadata.name=<node>``, so
an RBAC role with ``resourceNames: [<node>]`` is enough (see ``RBAC_RULES``).
Nothing here reads hardware; the caller hands over a Topology and a Registrar.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from daybreak.agent.registration import MemoryRegistrar, Segment
from daybreak.agent.topology import Topology
from daybreak.api import labels as vocab
from daybreak.api.base import GROUP, VERSION
from daybreak.api.kube import Condition, ConditionStatus
from daybreak.api.node import (
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    KVNode,
    KVNodeSpec,
    KVNodeStatus,
    NamespaceFlush,
    NicRegistration,
    NodeAccelerator,
    NodeLink,
    NodeNic,
    NodeRdma,
    NodeSegment,
    NodeTierBytes,
    NodeTransport,
)
from daybreak.client.kubeconfig import load_kube_config
from daybreak.client.kubewatch import WATCH_SECONDS, watch_with_backoff
from daybreak.version import __version__

log = logging.getLogger(__name__)

FIELD_MANAGER = "daybreak-agent"
APPLY = "application/apply-patch+yaml"
LABEL_ACCELERATOR = vocab.ACCELERATOR
LABEL_COUNT = vocab.ACCELERATOR_COUNT
LABEL_MEMORY = vocab.ACCELERATOR_MEMORY
LABEL_RDMA = vocab.RDMA
LABEL_GDR = vocab.GDR
LABEL_LINK_DOMAIN = vocab.LINK_DOMAIN
LABELS = vocab.NODE_LABELS
KVNODE_PLURAL = vocab.KVNODE_PLURAL

# What the agent's ServiceAccount needs, per node (the chart renders one binding per node or uses a
# node-authorizer-like webhook; resourceNames pins each rule to the agent's own objects).
RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"],
     "resourceNames": ["<node>"]},
    {"apiGroups": [GROUP], "resources": [KVNODE_PLURAL], "verbs": ["get", "list", "watch", "patch"],
     "resourceNames": ["<node>"]},
    {"apiGroups": [GROUP], "resources": [f"{KVNODE_PLURAL}/status"], "verbs": ["get", "patch"],
     "resourceNames": ["<node>"]},
    # Server-side apply creates the KVNode on first publish; create cannot be limited by name.
    {"apiGroups": [GROUP], "resources": [KVNODE_PLURAL], "verbs": ["create"]},
]

# _content_type is honoured at run time but missing from kubernetes_asyncio's stubs, hence a splat.
_APPLY_KW: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY}

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def label_value(text: str) -> str:
    """A valid label value (<= 63 chars, alphanumeric ends); long or odd text becomes a stable hash."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    return "h-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def accelerator_kind(topo: Topology) -> str:
    """sunrise | nvidia | none: the loaded runtime, else the vendor sysfs shows (hardware without its driver)."""
    if topo.runtime in ("sunrise", "nvidia"):
        return topo.runtime
    vendors = [g.vendor for g in topo.gpus if g.vendor in ("sunrise", "nvidia")]
    return max(set(vendors), key=vendors.count) if vendors else "none"


def link_domain(topo: Topology, node_name: str) -> str:
    """The device-link fabric this node's accelerators share: the node itself when any pair has a
    Sunrise Link or NVLink bundle (links are intra-node on every part we read), else ``none``."""
    linked = any(p.link.startswith(("SL", "NV")) for p in topo.pairs)
    return label_value(node_name) if linked else "none"


def node_labels(topo: Topology, *, node_name: str, rdma: bool) -> dict[str, str]:
    """The six daybreak.dev labels; accelerator-memory (MiB per device, the smallest) only when known."""
    gpus = topo.gpus
    labels = {
        LABEL_ACCELERATOR: accelerator_kind(topo),
        LABEL_COUNT: str(len(gpus)),
        LABEL_RDMA: "true" if rdma else "false",
        LABEL_GDR: "true" if rdma and any(topo.gdr.values()) else "false",
        LABEL_LINK_DOMAIN: link_domain(topo, node_name),
    }
    memories = [g.memory_bytes for g in gpus if g.memory_bytes > 0]
    if gpus and len(memories) == len(gpus):
        labels[LABEL_MEMORY] = str(min(memories) >> 20)
    return labels


def _attributes(bus_id: str | None, root: str | None) -> dict[str, str]:
    out = {}
    if bus_id:
        out[PCI_BUS_ID_ATTRIBUTE] = bus_id
    if root:
        out[PCIE_ROOT_ATTRIBUTE] = root
    return out


def kvnode_status(topo: Topology, registrar: MemoryRegistrar, *, node_name: str, segments: Sequence[Segment] = (),
                  capacity: Mapping[str, int] | None = None, used: Mapping[str, int] | None = None,
                  now: datetime | None = None, ready_since: datetime | None = None,
                  transfer: Sequence[Mapping[str, Any]] = (), engine_segments: Sequence[str] = (),
                  namespace_flushes: Sequence[NamespaceFlush] = ()) -> KVNodeStatus:
    """The KVNode status for one refresh; ``ready_since`` is the first successful publish (transition time)."""
    now = now or datetime.now(UTC)
    accelerators = [NodeAccelerator(id=g.id, pci_bus_id=g.pci_bus_id, numa_node=g.numa_node, vendor=g.vendor,
                                    model=g.model, memory_bytes=g.memory_bytes, runtime_index=g.runtime_index,
                                    dmabuf=g.dmabuf, attributes=_attributes(g.pci_bus_id, g.pcie_root))
                    for g in topo.gpus]
    nics = [NodeNic(id=n.id, name=n.name, pci_bus_id=n.pci_bus_id, numa_node=n.numa_node, active=n.active,
                    link_layer=str(n.ports[0].get("link_layer", "")) if n.ports else "",
                    rate=str(n.ports[0].get("rate", "")) if n.ports else "", netdevs=list(n.netdevs),
                    attributes=_attributes(n.pci_bus_id, n.pcie_root)) for n in topo.nics]
    node_segments = [
        NodeSegment(name=s.name, kind=s.kind, length=s.length, problem=registrar.problems.get(s.name, ""),
                    registrations=[NicRegistration(nic=r.nic, lkey=r.lkey, rkey=r.rkey, iova=r.iova, method=r.method)
                                   for r in registrar.registrations.get(s.name, [])])
        for s in segments]
    ready = Condition(type="Ready", status=ConditionStatus.TRUE, reason="TopologyPublished",
                      message=f"{len(accelerators)} accelerator(s), {len(nics)} RDMA NIC(s); {registrar.status}",
                      last_transition_time=ready_since or now)
    transports = [NodeTransport(transport=t["transport"], state=t["state"], reason=t.get("reason", ""),
                                bytes_used=t.get("bytesUsed", 0), store_bytes=t.get("storeBytes", 0),
                                bytes_fell_back=t.get("bytesFellBack", 0))
                  for t in transfer]
    conditions = [ready] + [
        Condition(type=f"Transport{t.transport.capitalize()}",
                  status=ConditionStatus.TRUE if t.state == "works" else ConditionStatus.FALSE,
                  reason="Works" if t.state == "works" else "Degraded",
                  message=t.reason or f"{t.transport}: loopback check passed, no fallback", last_transition_time=now)
        for t in transports]
    return KVNodeStatus(
        accelerator=accelerator_kind(topo), runtime=topo.runtime, runtime_skipped=dict(topo.runtime_skipped),
        link_domain=link_domain(topo, node_name), accelerators=accelerators, nics=nics,
        links=[NodeLink(a=p.a, b=p.b, link=p.link) for p in topo.pairs],
        nic_rank=dict(topo.nic_rank), gdr=dict(topo.gdr), peer_memory=list(topo.peer_memory),
        rdma=NodeRdma(available=registrar.rdma, reason=registrar.reason, nics=list(registrar.nic_names)),
        # What the agent's transfer engine really brought up (the pool's list, less what cannot run here);
        # without an engine, the registrar's view of this node.
        transports=[t.transport for t in transports] if transports else registrar.transports(),
        segments=node_segments,
        capacity=NodeTierBytes(**dict(capacity or {})), used=NodeTierBytes(**dict(used or {})),
        agent_version=__version__, heartbeat_time=now.isoformat().replace("+00:00", "Z"), conditions=conditions,
        transfer=transports, engine_segments=list(engine_segments), namespace_flushes=list(namespace_flushes),
    )


async def load_client(kubeconfig: str) -> k8s_client.ApiClient:
    """An ApiClient from a kubeconfig file (``$KUBECONFIG`` when ``kubeconfig`` is empty), else in-cluster."""
    loaded = await load_kube_config(kubeconfig or None)  # "" in the agent's settings: not set
    api = k8s_client.ApiClient(loaded.configuration)
    api.user_agent = f"daybreak-agent/{__version__}"
    return api


class NodePublisher:
    """Applies labels and the KVNode for one node; every call names that node and no other."""

    def __init__(self, api: k8s_client.ApiClient, node_name: str) -> None:
        if not node_name:
            raise ValueError("node_name: the agent must know its node (set DAYBREAK_NODE_NAME from the downward API)")
        self.api = api
        self.node_name = node_name
        self._core = k8s_client.CoreV1Api(api)
        self._custom = k8s_client.CustomObjectsApi(api)
        self._node_uid: str | None = None

    async def close(self) -> None:
        await self.api.close()

    async def node_uid(self) -> str:
        if self._node_uid is None:
            node = await self._core.read_node(self.node_name)
            self._node_uid = str(node.metadata.uid)
        return self._node_uid

    async def apply_labels(self, labels: Mapping[str, str]) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": dict(labels)}}
        await self._core.patch_node(self.node_name, body, **_APPLY_KW)

    async def apply_kvnode(self, status: KVNodeStatus) -> None:
        """Create-or-update the object (owned by the Node, so it is collected with it), then its status."""
        obj = KVNode(spec=KVNodeSpec(node_name=self.node_name))
        meta = {"name": self.node_name, "labels": {vocab.NAME: "daybreak",
                                                   vocab.COMPONENT: "agent",
                                                   vocab.MANAGED_BY: FIELD_MANAGER},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                                     "uid": await self.node_uid()}]}
        body = {"apiVersion": obj.api_version, "kind": obj.kind, "metadata": meta, "spec": obj.spec.to_dict()}
        await self._custom.patch_cluster_custom_object(GROUP, VERSION, KVNODE_PLURAL, self.node_name, body,
                                                       **_APPLY_KW)
        status_body = {"apiVersion": obj.api_version, "kind": obj.kind, "metadata": {"name": self.node_name},
                       "status": status.to_dict()}
        await self._custom.patch_cluster_custom_object_status(GROUP, VERSION, KVNODE_PLURAL, self.node_name,
                                                              status_body, **_APPLY_KW)

    async def publish(self, labels: Mapping[str, str], status: KVNodeStatus) -> None:
        await self.apply_labels(labels)
        await self.apply_kvnode(status)
        log.info("node=%s published labels=%s kvnode=%s", self.node_name,
                 ",".join(f"{k}={v}" for k, v in sorted(labels.items())), self.node_name)

    async def watch_labels(self, desired: Mapping[str, str], drifted: asyncio.Event, *,
                           timeout_seconds: int = WATCH_SECONDS) -> None:
        """Set ``drifted`` whenever this node's daybreak labels differ from ``desired`` (which the caller
        updates in place). Watches ONLY this node (field selector), restarting after each server timeout."""
        selector = f"metadata.name={self.node_name}"

        async def watch_once(progress: Callable[[], None]) -> None:
            async with k8s_watch.Watch().stream(self._core.list_node, field_selector=selector,
                                                timeout_seconds=timeout_seconds) as stream:
                async for event in stream:
                    progress()
                    raw = event.get("raw_object") or {}
                    labels = (raw.get("metadata") or {}).get("labels") or {}
                    mine = {k: v for k, v in labels.items() if k in LABELS}
                    if desired and mine != dict(desired):
                        log.info("node=%s labels drifted have=%s want=%s", self.node_name, mine, dict(desired))
                        drifted.set()

        def failed(exc: BaseException, retry_in: float) -> None:
            # connection resets, payload errors, API refusals: the watch is best effort and retried
            if isinstance(exc, ApiException):
                log.warning("node=%s watch failed status=%s reason=%r retry_in=%.0fs", self.node_name, exc.status,
                            exc.reason, retry_in)
            else:
                log.warning("node=%s watch interrupted error=%r retry_in=%.0fs", self.node_name, str(exc), retry_in)

        await watch_with_backoff(watch_once, on_failure=failed)
