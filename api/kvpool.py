"""The KVPool resource: a pooled, tiered KV cache served by one node agent per selected node."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from daybreak.api.base import (
    DNS_LABEL_NAME_RULE,
    ApiModel,
    CelRule,
    CRDInfo,
    CustomResource,
    PrinterColumn,
    nested,
)
from daybreak.api.kube import (
    ByteQuantity,
    Condition,
    LocalObjectReference,
    ResourceRequirements,
    Toleration,
    conditions_field,
)
from daybreak.api.labels import KVPOOL_KIND, KVPOOL_PLURAL


class EvictionPolicy(StrEnum):
    LRU = "lru"
    S3FIFO = "s3fifo"


class Transport(StrEnum):
    RDMA = "rdma"
    LINK = "link"
    SHM = "shm"
    TCP = "tcp"


class HBMTier(ApiModel):
    """Accelerator memory (HBM) lent to the pool on every device of a node."""

    enabled: bool = True
    """Serve this tier. Leaving the tier out disables it as well."""
    bytes_per_device: ByteQuantity
    """HBM per accelerator device given to the pool (quantity, e.g. 8Gi)."""


class DRAMTier(ApiModel):
    """Host memory in shared-memory segments; survives agent restarts and upgrades."""

    enabled: bool = True
    """Serve this tier. Leaving the tier out disables it as well."""
    bytes_per_node: ByteQuantity
    """Host memory per node given to the pool (quantity, e.g. 64Gi)."""


class SSDTier(ApiModel):
    """Local SSD files below the DRAM tier; blocks evicted from DRAM land here."""

    enabled: bool = True
    """Serve this tier. Leaving the tier out disables it as well."""
    path: str = Field(default="/var/lib/daybreak/kv", pattern=r"^/", max_length=4096)
    """Absolute host directory for the cache files (mounted into the agent as a hostPath)."""
    bytes_per_node: ByteQuantity
    """SSD space per node given to the pool (quantity, e.g. 1Ti)."""


class Tiers(ApiModel):
    """Storage tiers of the pool, fastest first. At least one must be present and enabled."""

    __cel_rules__ = (
        CelRule(
            rule="(has(self.hbm) && self.hbm.enabled) || (has(self.dram) && self.dram.enabled)"
            " || (has(self.ssd) && self.ssd.enabled)",
            message="at least one of tiers.hbm, tiers.dram, tiers.ssd must be present and enabled",
            reason="FieldValueRequired",
            check=lambda t: any(tier is not None and tier.enabled for tier in (t.hbm, t.dram, t.ssd)),
        ),
    )

    hbm: HBMTier | None = None
    """Accelerator memory tier."""
    dram: DRAMTier | None = None
    """Host memory tier. Not backed by huge pages: the former hugePages field did nothing and was removed (a
    manifest that sets it is refused as an unknown field)."""
    ssd: SSDTier | None = None
    """Local SSD tier."""


class Replication(ApiModel):
    """How many copies of each block the pool keeps."""

    replicas: int = Field(default=1, ge=1, le=8)
    """Copies of each block on distinct nodes (1 = no redundancy)."""


class Eviction(ApiModel):
    """When and how the agents free space in a tier."""

    __cel_rules__ = (
        CelRule(
            rule="self.lowWatermark < self.highWatermark",
            message="lowWatermark must be less than highWatermark",
            check=lambda e: e.low_watermark < e.high_watermark,
            field_path=".lowWatermark",
        ),
    )

    policy: EvictionPolicy = EvictionPolicy.LRU
    """Which blocks go first, in every tier: lru (least recently used) or s3fifo (scan-resistant FIFO queues)."""
    high_watermark: float = Field(default=0.9, gt=0, le=1)
    """Fill fraction of a tier at which eviction starts."""
    low_watermark: float = Field(default=0.8, ge=0, lt=1)
    """Fill fraction eviction frees the tier down to; must be below highWatermark."""


def _no_duplicates(items: list[Transport]) -> list[Transport]:
    seen = {item for i, item in enumerate(items) if item in items[:i]}
    if seen:
        raise ValueError(f"duplicate values: {sorted(t.value for t in seen)}")
    return items


# rdma is opt-in: an agent that may use it runs as root with IPC_LOCK and the host's /dev/infiniband
# (operator/pool.py says why), and most nodes have no RDMA NIC, so the default pool stays non-root.
DEFAULT_TRANSPORTS = [Transport.SHM, Transport.LINK, Transport.TCP]


class TransportSpec(ApiModel):
    """Which data paths agents and clients may use between each other."""

    preference: Annotated[list[Transport], AfterValidator(_no_duplicates)] = Field(
        default_factory=lambda: list(DEFAULT_TRANSPORTS),
        min_length=1,
        max_length=4,
        json_schema_extra={"default": [t.value for t in DEFAULT_TRANSPORTS], "x-kubernetes-list-type": "set"},
    )
    """Allowed transports, most preferred first; a path not listed is never used, and each pair of
    endpoints uses the first listed one both support (rdma: RDMA NICs, link: device links within a
    link domain, shm: same node, tcp: anywhere). rdma is not in the default: list it to opt in, and
    the pool's agents then run as root with IPC_LOCK and the host's /dev/infiniband."""


class AuthSpec(ApiModel):
    """How agents and clients authenticate to each other."""

    secret_ref: LocalObjectReference | None = None
    """Secret whose key "token" holds the pool token. When absent the operator generates one
    (Secret <pool>-token) once and never rotates it by itself."""


class TLSSpec(ApiModel):
    """TLS on the pool's tcp paths (the store protocol and the transfer engine), from one Secret."""

    secret_name: str = Field(min_length=1, max_length=253,
                             pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    """A kubernetes.io/tls Secret in the pool's namespace with tls.crt, tls.key and ca.crt (the
    cert-manager convention). Agents serve tls.crt and check peers against ca.crt; engines and the
    router get ca.crt only. The certificate must name every address clients dial: the agents' node
    addresses (agents use the host network) and the agents' Service name."""


class Quotas(ApiModel):
    """What one kvNamespace may hold in each agent, so that one tenant cannot lock the others out.

    Counted per agent and tier by the namespace a key belongs to; a request past a quota is
    refused with an error naming it (docs/store.md "Fair share"). Eviction also takes from the
    namespace furthest over its share of a tier first (the tier divided by the namespaces in it)."""

    held_fraction: float = Field(default=0.5, gt=0, le=1)
    """Fraction of a tier one namespace may hold under readers' leases and uncommitted reservations."""
    pinned_fraction: float = Field(default=0.25, gt=0, le=1)
    """Fraction of a tier one namespace may hold soft-pinned."""
    max_pin_seconds: int = Field(default=600, ge=0, le=86400)
    """Longest soft pin a writer may ask for; a longer one is refused."""
    max_connections_per_credential: int = Field(default=128, ge=1, le=65536)
    """Authenticated store connections per namespace credential on each agent (a deployment's
    engines share one credential and keep one connection per agent each)."""


class AgentSpec(ApiModel):
    """The node agent DaemonSet."""

    image: str | None = Field(default=None, min_length=1)
    """Agent container image; defaults to the operator's own image."""
    resources: ResourceRequirements | None = None
    """Compute resources of the agent container."""
    port: int = Field(default=7400, ge=1, le=65534)
    """Host port the agent serves the store protocol on; the next port (port + 1) serves its
    /metrics. Agents use the host network, so pools that share a node need ports at least 2 apart,
    and both ports must lie in the cluster admin's poolPolicy.agentPortRange."""


class KVPoolSpec(ApiModel):
    """Desired state of a KV cache pool."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a node must carry to run an agent of this pool (empty: every node)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations for the agent pods."""
    tiers: Tiers
    """Storage tiers and their sizes; at least one must be present and enabled."""
    replication: Replication = nested(Replication)
    """Redundancy of stored blocks."""
    eviction: Eviction = nested(Eviction)
    """Eviction policy and watermarks."""
    transport: TransportSpec = nested(TransportSpec)
    """Data paths between endpoints."""
    lease_seconds: int = Field(default=10, ge=1, le=3600)
    """How long a reader's lease protects a block from eviction."""
    auth: AuthSpec | None = None
    """Pool token; generated when absent."""
    tls: TLSSpec | None = None
    """TLS on every tcp path of the pool (docs/security.md has the cost); plain tcp when absent."""
    quotas: Quotas = nested(Quotas)
    """Fair share per kvNamespace: what one namespace may hold, pin and keep connected in each agent."""
    agent: AgentSpec = nested(AgentSpec)
    """Node agent settings."""


class NodeCounts(ApiModel):
    """How many nodes should and do run a ready agent."""

    desired: int = 0
    """Nodes selected by the pool."""
    ready: int = 0
    """Nodes whose agent reports ready."""


class TierBytes(ApiModel):
    """A byte count per tier, summed over the pool's ready nodes."""

    hbm: int = 0
    """Bytes in the HBM tier."""
    dram: int = 0
    """Bytes in the DRAM tier."""
    ssd: int = 0
    """Bytes in the SSD tier."""


class Endpoint(ApiModel):
    """Where one node's agent can be reached."""

    node: str
    """Node name."""
    address: str
    """IP address of the agent."""
    port: int = Field(ge=1, le=65535)
    """Store protocol port."""
    transports: list[Transport] = Field(default_factory=list)
    """Transports this agent runs, as it reported them on its node's KVNode (empty until it reports)."""
    bytes_moved: dict[str, int] = Field(default_factory=dict)
    """Block bytes the agent moved per transport since it started, its transfer engine's and its store's own
    (its KVNode's status.transfer: bytesUsed + storeBytes)."""


class FlushRequest(ApiModel):
    """A retired kvNamespace every agent of the pool deletes from its own store (updateStrategy.cache: flush)."""

    kv_namespace: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """The namespace whose blocks (keys ``<kvNamespace>/...``) are deleted."""
    requested_by: str = ""
    """The PDDeployment (``namespace/name``) that retired it."""
    requested_at: str = ""
    """When the operator asked (RFC 3339); with kvNamespace it names the request the agents report on."""


class KVPoolStatus(ApiModel):
    """Observed state of the pool, written by the operator."""

    observed_generation: int | None = None
    """The metadata.generation this status describes."""
    conditions: list[Condition] = conditions_field()
    """Ready, Progressing and Degraded, with reasons."""
    nodes: NodeCounts = Field(default_factory=NodeCounts)
    """Agent nodes, desired and ready."""
    capacity: TierBytes = Field(default_factory=TierBytes)
    """Bytes the pool can hold, per tier."""
    used: TierBytes = Field(default_factory=TierBytes)
    """Bytes in use, per tier."""
    endpoints: list[Endpoint] = Field(default_factory=list)
    """Ready agents."""
    flush_requests: list[FlushRequest] = Field(default_factory=list)
    """Retired kvNamespaces the agents are to flush; each agent reports on its KVNode (status.namespaceFlushes)."""


class KVPool(CustomResource):
    """A pool of KV cache memory (HBM, DRAM, SSD) served by a node agent on each selected node."""

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind=KVPOOL_KIND,
        plural=KVPOOL_PLURAL,
        short_names=("kvp",),
        printer_columns=(
            PrinterColumn("Ready Nodes", ".status.nodes.ready", "integer", "Nodes with a ready agent"),
            PrinterColumn("Desired Nodes", ".status.nodes.desired", "integer", "Nodes selected", priority=1),
            PrinterColumn("DRAM", ".spec.tiers.dram.bytesPerNode", "string", "DRAM tier per node"),
            PrinterColumn("SSD", ".spec.tiers.ssd.bytesPerNode", "string", "SSD tier per node"),
            PrinterColumn("HBM", ".spec.tiers.hbm.bytesPerDevice", "string", "HBM tier per device", priority=1),
            PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status', "string", "Ready condition",
                          priority=1),
            PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
        ),
    )

    __cel_rules__ = (DNS_LABEL_NAME_RULE,)

    kind: Literal["KVPool"] = "KVPool"
    """Kind of this object."""
    spec: KVPoolSpec
    """Desired state."""
    status: KVPoolStatus = Field(default_factory=KVPoolStatus)
    """Observed state (written by the operator)."""
