"""The host-only runtime: no accelerator, so every device operation is Unsupported (the last fallback)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daybreak.agent.runtime.base import DeviceBuffer, DeviceInfo, PeerLink, Unsupported


class HostRuntime:
    """Always loads; the store serves host memory (DRAM, SSD) only."""

    name = "host"

    def devices(self) -> Sequence[DeviceInfo]:
        return ()

    def peer_links(self) -> Sequence[PeerLink]:
        return ()

    def allocate(self, device: int, size: int) -> DeviceBuffer:
        raise Unsupported("host runtime has no device memory")

    def free(self, buffer: DeviceBuffer) -> None:
        raise Unsupported("host runtime has no device memory")

    def copy_to_device(self, dst: DeviceBuffer, src: Any, *, offset: int = 0) -> None:
        raise Unsupported("host runtime has no device memory")

    def copy_to_host(self, dst: Any, src: DeviceBuffer, *, offset: int = 0) -> None:
        raise Unsupported("host runtime has no device memory")

    def copy_device(self, dst: DeviceBuffer, src: DeviceBuffer, size: int, *,
                    dst_offset: int = 0, src_offset: int = 0) -> None:
        raise Unsupported("host runtime has no device memory")

    def ipc_handle(self, buffer: DeviceBuffer) -> bytes:
        raise Unsupported("host runtime has no device memory")

    def export_dmabuf(self, buffer: DeviceBuffer) -> int:
        raise Unsupported("host runtime has no device memory")

    def close(self) -> None:
        return None
