"""Masterless placement: rendezvous (highest-random-weight) hashing of keys over the live agents.

Every client and agent ranks the same agents the same way for a key, with no
coordinator. Adding or removing one agent only moves the keys whose top
choice was (or becomes) that agent: about 1/N of them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence


@functools.lru_cache(maxsize=1024)
def _agent_key(agent_id: str) -> bytes:
    return hashlib.blake2b(agent_id.encode(), digest_size=32).digest()


def score(agent_id: str, key: str) -> int:
    """A stable 64-bit weight of ``agent_id`` for ``key``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=_agent_key(agent_id)).digest()
    return int.from_bytes(digest, "little")


def rank(key: str, agents: Sequence[str]) -> list[str]:
    """``agents`` ordered from the key's home (highest weight) down; ties broken by id."""
    return sorted(agents, key=lambda a: (score(a, key), a), reverse=True)
