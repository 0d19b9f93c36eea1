"""Per-client admission at the router: who a client is, and how many requests it may have in flight.

A client is its credential's name when the router requires a bearer token
(``serving.router.auth``), else its peer address. Behind a proxy or an
ingress every client has the proxy's address and shares one budget: turn on
authentication there. A request over its client's budget is answered 429 at
once (with ``Retry-After``) instead of queueing, so one client holding many
streams, read or not, cannot take every decode slot from the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

ClientId = NewType("ClientId", str)
"""``credential:<name>`` or ``peer:<address>``."""

DEFAULT_MAX_CONCURRENT_PER_CLIENT = 128
"""Generous on purpose: a load generator or an application server is one client by address; a deployment
whose clients are many people sets it lower (``--max-concurrent-per-client``) or turns on auth."""


def client_id(*, credential: str | None, peer: str | None) -> ClientId:
    """The identity the limits count under."""
    if credential is not None:
        return ClientId(f"credential:{credential}")
    return ClientId(f"peer:{peer or 'unknown'}")


@dataclass
class ConcurrencyLimits:
    """Requests in flight per client, bounded by ``per_client`` (0: unbounded)."""

    per_client: int = DEFAULT_MAX_CONCURRENT_PER_CLIENT
    _in_flight: dict[ClientId, int] = field(default_factory=dict)

    def try_acquire(self, client: ClientId) -> bool:
        """Count one more request of ``client``; False (nothing counted) when it is at its limit."""
        held = self._in_flight.get(client, 0)
        if self.per_client and held >= self.per_client:
            return False
        self._in_flight[client] = held + 1
        return True

    def release(self, client: ClientId) -> None:
        """One request of ``client`` ended."""
        held = self._in_flight.get(client, 0) - 1
        if held > 0:
            self._in_flight[client] = held
        else:
            self._in_flight.pop(client, None)  # the table holds only active clients

    def in_flight(self, client: ClientId) -> int:
        return self._in_flight.get(client, 0)
