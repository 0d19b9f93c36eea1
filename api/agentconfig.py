"""The agent's config: what the operator writes into a pool's ConfigMap and the agent loads, one model.

The KVPool-to-agent hand-off is a contract between two processes, so it is declared once here, in ``api/``
(models, no I/O), like component-base's versioned ``KubeletConfiguration``: the operator renders exactly this
model (``operator/pool.py``, ``agent_settings``) and the agent loads it (``agent/settings.py``,
``AgentSettings`` extends it with its loaders). Unknown keys are refused (``extra="forbid"``) on both sides:
a key the operator writes that the agent does not know fails the reconcile with a condition naming it,
instead of being dropped on the way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AGENT_TRANSPORTS", "AgentConfig", "RuntimeChoice", "TransportName"]

RuntimeChoice = Literal["auto", "sunrise", "nvidia", "host"]
TransportName = Literal["link", "rdma", "shm", "tcp"]
AGENT_TRANSPORTS: tuple[TransportName, ...] = ("link", "rdma", "shm", "tcp")
"""Every transport the agent's transfer engine has (agent/transfer/registry.py TRANSPORTS)."""


class AgentConfig(BaseModel):
    """Everything one agent process needs to know (the config file's keys are these field names)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- identity and cluster --------------------------------------------------
    standalone: bool = Field(False, description="serve a store without Kubernetes")
    node_name: str = Field("", description="the Kubernetes node this agent runs on (from the downward API)")
    pool_name: str = Field("", description="the KVPool this agent serves")
    pool_namespace: str = Field("", description="namespace of the KVPool")
    pool_uid: str = Field("", description="metadata.uid of the KVPool (names its SSD directory: a pool created "
                          "again under the same name never sees the old one's blocks)")
    kubeconfig: str = Field("", description="kubeconfig path when out of cluster; empty means in-cluster")

    # -- hardware discovery ------------------------------------------------------
    sysfs_root: Path = Field(Path("/sys"), description="directory that plays /sys (fixture trees in tests)")
    runtime: RuntimeChoice = Field("auto", description="accelerator runtime; auto tries sunrise, nvidia, host")
    sunrise_lib_dir: str = Field("", description="directory holding libtangrt_shared.so and libptml_shared.so")
    sunrise_pci_vendors: list[str] = Field(
        default_factory=lambda: ["0x1f36"],
        description="PCI vendor ids of Sunrise accelerators (0x1f36 is an unverified placeholder; see docs/hardware.md)")
    rdma_devices: list[str] = Field(default_factory=list,
                                    description="RDMA devices to register memory with; empty means every active one")
    node_refresh_seconds: float = Field(60.0, gt=0, description="how often the node topology and labels are refreshed")

    # -- store ---------------------------------------------------------------------
    listen: str = Field("127.0.0.1:7480", description="host:port the store serves on")
    dram_bytes: int = Field(1 << 30, ge=0, description="DRAM tier size in bytes")
    ssd_path: str = Field("", description="root directory of the SSD tier; the tier lives in "
                          "<ssd_path>/<namespace>_<pool>_<uid>/<address> (standalone: standalone_<pool>_<key id>), "
                          "empty disables it")
    ssd_bytes: int = Field(0, ge=0, description="SSD tier size in bytes")
    hbm_bytes: int = Field(0, ge=0, description="HBM tier size per device in bytes; 0 disables it")
    peers: list[str] = Field(default_factory=list, description="other agents (host:port) in a standalone pool")
    replicas: int = Field(1, ge=1, description="copies of each block")
    token_file: str = Field("", description="file holding the pool token")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it")
    advertise: str = Field("", description="host:port other agents and clients use to reach this store; "
                           "empty means the listen address")
    eviction_policy: Literal["lru", "s3fifo"] = Field("s3fifo", description="order in which blocks leave a tier")
    high_watermark: float = Field(0.9, gt=0, le=1, description="tier fill fraction at which eviction starts")
    low_watermark: float = Field(0.8, ge=0, lt=1, description="tier fill fraction eviction frees down to")
    lease_seconds: int = Field(10, ge=1, le=3600, description="how long a reader's lease protects a block")
    handshake_seconds: float = Field(10.0, gt=0, le=300, description="one deadline for a connection's whole "
                                     "handshake")
    idle_seconds: float = Field(300.0, gt=0, description="an authenticated connection idle this long is closed "
                                "(store and transfer engine)")
    io_seconds: float = Field(30.0, gt=0, description="deadline of one request's body or reply (plus size at "
                              "16 MiB/s)")
    max_connections: int = Field(1024, ge=1, description="connections per tcp server (the store's and the "
                                 "transfer engine's each; pool.admission)")
    max_connections_per_address: int = Field(256, ge=1, description="connections per client address, per tcp "
                                             "server")
    max_connections_per_credential: int = Field(128, ge=1, description="authenticated store connections per "
                                                "namespace credential (the pool secret and agent credential are "
                                                "not capped); keep well below max_connections")
    namespace_held_fraction: float = Field(0.5, gt=0, le=1, description="per kvNamespace: the fraction of a tier "
                                           "it may hold under leases and uncommitted reservations")
    namespace_pinned_fraction: float = Field(0.25, gt=0, le=1, description="per kvNamespace: the fraction of a "
                                             "tier it may hold pinned")
    max_pin_seconds: int = Field(600, ge=0, description="longest soft pin a writer may ask for; a longer one is "
                                 "refused with a quota error")
    tls_cert_file: str = Field("", description="PEM certificate both tcp servers (the store's and the transfer "
                               "engine's) serve TLS with, and then require; empty: plain tcp")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    tls_ca_file: str = Field("", description="PEM CA bundle this agent checks its peers' certificates against "
                             "(store and transfer engine); empty: the system's CAs")
    shm_group_access: bool = Field(False, description="create the DRAM tier's segments mode 0660 for this process's "
                                   "primary group (the operator sets it, with the pool's own group id, so the "
                                   "pool's engines map them); off: 0600")
    keep_segments: bool = Field(False, description="standalone: keep the DRAM tier in /dev/shm and the SSD "
                                "directory after a clean stop (for a restart that re-adopts them)")
    orphan_seconds: float = Field(3600.0, ge=0, description="tiers in /dev/shm and SSD directories under "
                                  "ssd_path with no live owner and untouched this long are removed at start")

    # -- transfer engine ------------------------------------------------------------
    transfer_listen: str = Field("", description="host:port of the transfer engine's tcp server; port 0 picks a "
                                 "free one; empty: the store's listen host, port 0 (never a wider bind than the store)")
    transfer_advertise: str = Field("", description="host:port put into segment descriptors; empty means the "
                                    "bound address")
    transfer_connections: int = Field(2, ge=1, le=64, description="tcp connections per peer engine")
    transfer_slice_bytes: int = Field(4 << 20, ge=4096, le=256 << 20, description="largest tcp slice in bytes")
    transfer_checksum: bool = Field(False, description="crc32c every tcp slice")
    store_transfer: bool = Field(True, description="serve the store's segments through the transfer engine "
                                 "(shm, link, rdma; docs/architecture.md 'Control vs data'); off: the store stream only")
    transfer_timeout_seconds: float = Field(30.0, gt=0, description="default deadline of a transfer batch")
    transports: list[TransportName] = Field(
        default_factory=lambda: list(AGENT_TRANSPORTS), min_length=1,
        description="transports the transfer engine brings up, most preferred first (the KVPool's "
                    "spec.transport.preference); a transport not listed is never used")
