"""The KVNode resource: one cluster-scoped object per node, written by that node's agent (topology, memory, tiers).

Why a kind of its own rather than the KVPool status: the topology belongs to
the node, not to a pool (several pools may share a node), each agent writes
only its own object (no write contention on a pool's status, RBAC can pin an
agent to its node's name), and the object is owned by its Node, so it goes
away with the node. The pool's status keeps only the endpoint summary.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from daybreak.api.base import ApiModel, CRDInfo, CustomResource, PrinterColumn
from daybreak.api.kube import Condition, conditions_field
from daybreak.api.labels import KVNODE_KIND, KVNODE_PLURAL

PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"


class KVNodeSpec(ApiModel):
    """Which node this object describes."""

    node_name: str = Field(min_length=1, max_length=253)
    """The Node's name (equal to metadata.name)."""


class NodeAccelerator(ApiModel):
    """One accelerator (GPU) of the node."""

    id: str
    """Topology id, GPU<n> in PCI bus order."""
    pci_bus_id: str | None = None
    """PCI address (domain:bus:device.function)."""
    numa_node: int = -1
    """NUMA node of the device; -1 when unknown."""
    vendor: str = ""
    """sunrise or nvidia."""
    model: str = ""
    """Model name from the runtime, or PCI vendor:device ids."""
    memory_bytes: int = 0
    """Device memory in bytes (0 when no runtime loaded)."""
    runtime_index: int | None = None
    """Device ordinal in the loaded runtime."""
    dmabuf: bool = False
    """Device memory can be exported as a dma-buf."""
    attributes: dict[str, str] = Field(default_factory=dict)
    """DRA-style attributes (resource.kubernetes.io/pciBusID, resource.kubernetes.io/pcieRoot)."""


class NodeNic(ApiModel):
    """One RDMA NIC of the node."""

    id: str
    """Topology id, NIC<n> in device-name order."""
    name: str
    """RDMA device name (mlx5_0)."""
    pci_bus_id: str | None = None
    """PCI address of the NIC function."""
    numa_node: int = -1
    """NUMA node of the NIC; -1 when unknown."""
    active: bool = False
    """At least one port is ACTIVE."""
    link_layer: str = ""
    """InfiniBand or Ethernet (first port)."""
    rate: str = ""
    """Link rate of the first port."""
    netdevs: list[str] = Field(default_factory=list)
    """Network interfaces of the NIC."""
    attributes: dict[str, str] = Field(default_factory=dict)
    """DRA-style attributes (resource.kubernetes.io/pciBusID, resource.kubernetes.io/pcieRoot)."""


class NodeLink(ApiModel):
    """The link class between two devices: SL<n>, NV<n>, PIX, PXB, PHB, NODE or SYS."""

    a: str
    """First device id."""
    b: str
    """Second device id."""
    link: str = Field(pattern=r"^(SL\d+|NV\d+|PIX|PXB|PHB|NODE|SYS)$")
    """Link class."""


class NodeRdma(ApiModel):
    """Whether memory could be registered for RDMA, and if not, why."""

    available: bool = False
    """At least one NIC was opened for registration."""
    reason: str = ""
    """Why RDMA is unavailable (empty when available)."""
    nics: list[str] = Field(default_factory=list)
    """RDMA devices memory is registered with."""


class NicRegistration(ApiModel):
    """A segment's memory region on one NIC."""

    nic: str
    """RDMA device name."""
    lkey: int
    """Local key."""
    rkey: int
    """Remote key peers use."""
    iova: int
    """Address peers use: the virtual address for host and peer-memory MRs, the offset for dma-buf MRs."""
    method: Literal["host", "dmabuf", "peermem"]
    """How the memory was registered."""


class NodeSegment(ApiModel):
    """One memory segment the node's store serves."""

    name: str
    """Segment name."""
    kind: Literal["host", "device"]
    """Host (shared memory) or device memory."""
    length: int = Field(ge=0)
    """Size in bytes."""
    registrations: list[NicRegistration] = Field(default_factory=list)
    """Per-NIC registrations (empty without RDMA)."""
    problem: str = ""
    """Why (part of) the segment could not be registered."""


class NodeTierBytes(ApiModel):
    """A byte count per tier on this node."""

    hbm: int = 0
    """Bytes in the HBM tier (all devices)."""
    dram: int = 0
    """Bytes in the DRAM tier."""
    ssd: int = 0
    """Bytes in the SSD tier."""


class NodeTransport(ApiModel):
    """One transport of the node's transfer engine: whether it works, and what traffic actually used."""

    transport: str = Field(min_length=1, max_length=32)
    """shm, tcp, rdma or link."""
    state: str = Field(pattern=r"^(works|degraded)$")
    """works: the start-up loopback check passed and nothing has fallen back from it since; else degraded."""
    reason: str = Field(default="", max_length=1024)
    """Why it is degraded (the failed check, or how many bytes fell back to which transport)."""
    bytes_used: int = Field(default=0, ge=0)
    """Bytes completed requests moved over this transport since the agent started."""
    store_bytes: int = Field(default=0, ge=0)
    """Block bytes the store itself moved over this transport since the agent started (same-node memcpy for shm,
    its stream for tcp, TLS included), besides the engine's bytesUsed."""
    bytes_fell_back: int = Field(default=0, ge=0)
    """Bytes of requests that preferred this transport but completed on a later one of their chain."""


class NamespaceFlush(ApiModel):
    """What this node's agent deleted for one KVPool flush request (status.flushRequests there)."""

    kv_namespace: str
    """The flushed namespace."""
    requested_at: str = ""
    """The request's requestedAt (a newer request for the same namespace is flushed again)."""
    bytes_freed: int = Field(default=0, ge=0)
    """Bytes deleted from this node's tiers."""
    blocks: int = Field(default=0, ge=0)
    """Blocks deleted."""
    busy: int = Field(default=0, ge=0)
    """Blocks left because a reader held them (they age out)."""
    flushed_at: str = ""
    """When the agent flushed (RFC 3339)."""


class KVNodeStatus(ApiModel):
    """What the node's agent found and serves."""

    accelerator: str | None = None
    """sunrise, nvidia or none (the daybreak.dev/accelerator label)."""
    runtime: str | None = None
    """The accelerator runtime the agent loaded: sunrise, nvidia or host."""
    runtime_skipped: dict[str, str] = Field(default_factory=dict)
    """Why each runtime before the loaded one was not used."""
    link_domain: str | None = None
    """Device-link domain (the daybreak.dev/link-domain label)."""
    accelerators: list[NodeAccelerator] = Field(default_factory=list)
    """Accelerators in PCI bus order."""
    nics: list[NodeNic] = Field(default_factory=list)
    """RDMA NICs."""
    links: list[NodeLink] = Field(default_factory=list)
    """Link class of every GPU-GPU and GPU-NIC pair."""
    nic_rank: dict[str, list[str]] = Field(default_factory=dict)
    """Per accelerator id, NIC ids nearest first."""
    gdr: dict[str, list[str]] = Field(default_factory=dict)
    """Per accelerator id, NIC ids usable for GPUDirect RDMA."""
    peer_memory: list[str] = Field(default_factory=list)
    """Peer-memory clients or modules found."""
    rdma: NodeRdma | None = None
    """RDMA registration state."""
    transports: list[str] = Field(default_factory=list)
    """Transports the node's agent runs (those of the pool's list that came up here: rdma, link, shm, tcp)."""
    segments: list[NodeSegment] = Field(default_factory=list)
    """Memory segments served and their registrations."""
    transfer: list[NodeTransport] = Field(default_factory=list)
    """Per transport of the transfer engine: works or degraded (also a ``Transport<Name>`` condition each)."""
    engine_segments: list[str] = Field(default_factory=list)
    """Segment descriptors (JSON) of the store's memory registered with the transfer engine."""
    capacity: NodeTierBytes | None = None
    """Bytes the node's store can hold, per tier."""
    used: NodeTierBytes | None = None
    """Bytes in use, per tier."""
    namespace_flushes: list[NamespaceFlush] = Field(default_factory=list)
    """The agent's answers to its KVPool's status.flushRequests (dropped when the request is)."""
    agent_version: str | None = None
    """Version of the agent that wrote this status."""
    heartbeat_time: str | None = None
    """When the agent last refreshed this status (RFC 3339)."""
    conditions: list[Condition] = conditions_field()
    """Ready: the agent published a current topology; Transport<Name> (TransportShm, TransportRdma, ...):
    True when that transport works, False (reason Degraded) with the cause."""


class KVNode(CustomResource):
    """One node's accelerators, NICs, link classes, registered memory and tier capacity, kept by its agent."""

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind=KVNODE_KIND,
        plural=KVNODE_PLURAL,
        short_names=("kvn",),
        scope="Cluster",
        printer_columns=(
            PrinterColumn("Accelerator", ".status.accelerator", "string", "sunrise, nvidia or none"),
            PrinterColumn("Devices", ".status.accelerators[*].id", "string", "Accelerator ids", priority=1),
            PrinterColumn("Runtime", ".status.runtime", "string", "Loaded accelerator runtime"),
            PrinterColumn("RDMA", ".status.rdma.available", "boolean", "Memory registered for RDMA"),
            PrinterColumn("Transports", ".status.transports", "string", "Transports offered", priority=1),
            PrinterColumn("Heartbeat", ".status.heartbeatTime", "date", "Last refresh"),
        ),
    )

    kind: Literal["KVNode"] = "KVNode"
    """Kind of this object."""
    spec: KVNodeSpec
    """Which node."""
    status: KVNodeStatus = Field(default_factory=KVNodeStatus)
    """Observed state (written by the node's agent)."""
