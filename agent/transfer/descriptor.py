"""Segment descriptors: the small, serialisable record a peer needs to reach a registered segment.

A descriptor is published by the engine that owns the segment (through the
store's index, a node status object, or any side channel) and handed to
``TransferEngine.open_remote`` on the other side. It carries one entry per
transport that can reach the segment; a transport whose entry is missing is
simply not a candidate for that segment.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DESCRIPTOR_VERSION = 1

SegmentKind = Literal["host", "device"]


class NicRegion(BaseModel):
    """The segment as registered with one RDMA NIC (a pyverbs MR): what RDMA READ/WRITE targets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nic: str = Field(description="RDMA device name on the owning node, for example mlx5_0")
    port: int = Field(default=1, ge=1, le=255, description="port number on that device")
    gid: str = Field(default="", description="GID the owner's queue pairs use (colon-separated hex)")
    lid: int = Field(default=0, ge=0, le=0xFFFF, description="port LID (InfiniBand only; 0 on RoCE)")
    addr: int = Field(ge=0, description="remote address of byte 0 (IOVA for dma-buf MRs)")
    rkey: int = Field(ge=0, le=0xFFFFFFFF, description="remote key of the MR")


class DeviceRegion(BaseModel):
    """A segment in accelerator memory, reachable by peer copy from another device on the same node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: str = Field(description="accelerator runtime that owns the memory (sunrise, nvidia, host)")
    device: int = Field(ge=0, description="device index on the owning node")
    pci_bus_id: str = Field(default="", description="PCI bus id of the device, for topology lookups")
    ipc_handle: str = Field(default="", description="runtime IPC handle, hex-encoded; empty when not exportable")


class SegmentDescriptor(BaseModel):
    """Everything a peer needs to reach one registered segment; small and JSON-serialisable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(default=DESCRIPTOR_VERSION, description="descriptor format version")
    segment_id: str = Field(min_length=1, description="globally unique id: '<engine_id>/<name>'")
    engine_id: str = Field(min_length=1, description="id of the owning engine (one per process)")
    node: str = Field(min_length=1, description="node the owning engine runs on; shm and link need equality")
    size: int = Field(gt=0, description="segment size in bytes")
    kind: SegmentKind = Field(default="host", description="host memory or device memory")
    shm_name: str = Field(default="", description="/dev/shm name for the shm transport; empty when not shared")
    tcp_endpoint: str = Field(default="", description="host:port of the owning engine's tcp server")
    tcp_handle: int = Field(default=0, ge=0, le=0xFFFFFFFF, description="segment number on that tcp server")
    rdma: tuple[NicRegion, ...] = Field(default=(), description="one entry per NIC the segment is registered with")
    device: DeviceRegion | None = Field(default=None, description="set for device memory")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    def to_bytes(self) -> bytes:
        return self.to_json().encode()

    @classmethod
    def from_json(cls, text: str | bytes) -> SegmentDescriptor:
        """Parse and validate; a bad descriptor raises ``ValueError`` naming the offending field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"segment descriptor is not JSON: {exc}") from None
        return cls.from_dict(raw)

    from_bytes = from_json

    @classmethod
    def from_dict(cls, raw: object) -> SegmentDescriptor:
        if not isinstance(raw, dict):
            raise ValueError("segment descriptor must be a JSON object")
        if raw.get("version", DESCRIPTOR_VERSION) != DESCRIPTOR_VERSION:
            raise ValueError(f"segment descriptor field 'version': unsupported {raw.get('version')!r}, "
                             f"this build reads {DESCRIPTOR_VERSION}")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"segment descriptor field {where!r}: {first['msg']}") from None

    @property
    def tcp_address(self) -> tuple[str, int]:
        """``tcp_endpoint`` split into (host, port); raises ``ValueError`` naming the field if malformed."""
        host, sep, port = self.tcp_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"segment descriptor field 'tcp_endpoint': expected host:port, got {self.tcp_endpoint!r}")
        return host.strip("[]"), int(port)
