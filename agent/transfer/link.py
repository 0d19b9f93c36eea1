"""The link transport: device-to-device copies on one node through the accelerator runtime's peer copy."""

from __future__ import annotations

from typing import Any

from daybreak.agent.transfer.engine import TransferEngine, Transport


class LinkTransport(Transport):
    name = "link"

    def __init__(self, engine: TransferEngine, copier: Any) -> None:
        self._engine = engine
        self._copier = copier
