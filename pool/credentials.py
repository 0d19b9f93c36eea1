"""Pool credentials: the pool secret, the agent credential and namespace credentials, all derived without a database.

Three kinds, each a string an operator can put in a Secret or a file:

- the **pool secret** (what ``--token-file`` holds): the admin credential, all namespaces, every op;
- the **agent credential** ``dbk1-agent.<hex>`` = HMAC-SHA256(secret, "agent"): what agents
  present to each other (membership, hand-off, records); engines never hold it;
- a **namespace credential** ``dbk1.<ns>.<hex>`` = HMAC-SHA256(secret, "ns:" + ns): what a
  deployment's engines hold; the agents refuse any key outside ``<ns>/``.

Agents also derive, for their own use only, the key that authenticates the SSD tier's block headers
(``ssd_header_key``, label ``ssd-header``): a different label, so it opens nothing on the wire.

Every agent holds the pool secret and derives the key for whatever scope a client claims, so
no list of issued credentials exists anywhere. A credential is never sent: the handshake
(``pool/handshake.py``) proves possession of the key derived here.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from daybreak.errors import DaybreakError

NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ADMIN, AGENT, NAMESPACE = "admin", "agent", "ns:"
SSD_HEADER = "ssd-header"  # never a handshake scope: Scope.parse_claim knows only the three above
_PREFIX = "dbk1"
# A pool secret shorter than this is refused where it is loaded (a guessable secret is no secret).
MIN_SECRET_CHARS = 32


class CredentialError(DaybreakError, ValueError):
    """A credential string that cannot be used (malformed, or a namespace that is not valid)."""


@dataclass(frozen=True)
class Scope:
    """What a connection may do: ``admin`` (everything), ``agent`` (pool peer) or one namespace."""

    role: str              # ADMIN, AGENT or NAMESPACE
    namespace: str = ""    # for NAMESPACE only

    @property
    def claim(self) -> str:
        """The scope as the handshake names it: ``admin``, ``agent`` or ``ns:<namespace>``."""
        return NAMESPACE + self.namespace if self.role == NAMESPACE else self.role

    @classmethod
    def parse_claim(cls, claim: str) -> Scope | None:
        """The scope a HELLO claims; None for anything this side does not know."""
        if claim in (ADMIN, AGENT):
            return cls(claim)
        if claim.startswith(NAMESPACE) and NAMESPACE_PATTERN.fullmatch(claim[len(NAMESPACE):]):
            return cls(NAMESPACE, claim[len(NAMESPACE):])
        return None

    def allows_key(self, key: str) -> bool:
        """Whether a block key is inside this scope (admin and agent: every key)."""
        return self.role != NAMESPACE or key.startswith(self.namespace + "/")


def _mac(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()


def namespace_credential(secret: bytes, namespace: str) -> str:
    """The credential scoped to ``namespace`` (what one deployment's engines get)."""
    if not NAMESPACE_PATTERN.fullmatch(namespace):
        raise CredentialError(f"namespace {namespace!r} must match {NAMESPACE_PATTERN.pattern}")
    return f"{_PREFIX}.{namespace}.{_mac(secret, NAMESPACE + namespace).hex()}"


def agent_credential(secret: bytes) -> str:
    """The credential agents present to each other."""
    return f"{_PREFIX}-agent.{_mac(secret, AGENT).hex()}"


def ssd_header_key(secret: bytes) -> bytes:
    """The key the SSD tier MACs its block headers and directory marker with (``agent/store/tiers.py``)."""
    return _mac(secret, SSD_HEADER)


def key_for(secret: bytes, scope: Scope) -> bytes:
    """Server side: the key a client claiming ``scope`` must prove it holds."""
    if scope.role == ADMIN:
        return secret
    if scope.role == AGENT:
        return _mac(secret, AGENT)
    return _mac(secret, NAMESPACE + scope.namespace)


def parse(credential: str) -> tuple[Scope, bytes]:
    """Client side: a credential string -> the scope it claims and the key it proves.

    Anything that is not a ``dbk1`` credential is taken as the pool secret itself (admin).
    """
    text = credential.strip()
    if text.startswith(_PREFIX + "-agent."):
        digest = text[len(_PREFIX) + len("-agent."):]
        return Scope(AGENT), _unhex(digest, text)
    if text.startswith(_PREFIX + "."):
        namespace, dot, digest = text[len(_PREFIX) + 1:].rpartition(".")
        if not dot or not NAMESPACE_PATTERN.fullmatch(namespace):
            raise CredentialError("credential: expected dbk1.<namespace>.<hex> "
                                  "(print one with `daybreak credentials --namespace NS`)")
        return Scope(NAMESPACE, namespace), _unhex(digest, text)
    if not text:
        raise CredentialError("credential is empty: give the pool secret or a namespace credential")
    return Scope(ADMIN), text.encode()


def _unhex(digest: str, text: str) -> bytes:
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise CredentialError(f"credential {text[:12]}...: the part after the last dot must be 64 hex digits")
    return raw
