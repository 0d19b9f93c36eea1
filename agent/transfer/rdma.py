"""The rdma transport: pyverbs RC queue pairs per NIC pair, RDMA WRITE/READ striped across ranked NICs."""

from __future__ import annotations

from typing import Any

from daybreak.agent.transfer.engine import TransferEngine, Transport


class RdmaUnavailable(Exception):
    """No usable RDMA stack (pyverbs missing, no devices, no active port); the engine falls back to tcp."""


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(self, engine: TransferEngine, *, verbs: Any = None, topology: Any = None) -> None:
        try:
            import pyverbs.device  # noqa: F401
        except ImportError as exc:
            raise RdmaUnavailable(f"pyverbs not importable: {exc}") from None
        raise RdmaUnavailable("rdma transport not implemented yet")
