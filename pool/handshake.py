"""The one handshake every Daybreak connection opens with: mutual challenge-response, no secret on the wire.

Both wire stacks call this pair: the store protocol (``pool/connection.py`` and
the agent's store server) and the transfer engine's control connection
(``agent/transfer/control.py``). Each stack supplies a small channel that
carries the four messages in its own frames; the decisions, the MACs and the
constant-time comparisons live here once::

    client -> server  HELLO     identity, claimed scope, client nonce (16 random bytes)
    server -> client  CHALLENGE server nonce, server proof = MAC(key, "server" | transcript)
    client -> server  PROOF     client proof = MAC(key, "client" | transcript)
    server -> client  WELCOME   (the stack's own reply) or a refusal

``key`` is what the claimed scope's credential proves (``pool/credentials.py``);
the transcript is the scope, both identities' claims and both nonces. A
captured exchange cannot be replayed (the server's nonce is fresh per
connection), and a client checks the server's proof before it sends its own,
so a process without the pool's keys learns nothing and cannot pose as an
agent. THIS AUTHENTICATES THE PEERS, NOT THE BYTES THAT FOLLOW: frames after
the handshake are not MACed, so an on-path attacker can still read or alter
them (docs/security.md: run the tcp paths on a trusted network or inside a
tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from daybreak.errors import DaybreakError

Accept_co = TypeVar("Accept_co", covariant=True)

NONCE_BYTES = 16
PROOF_BYTES = 32


class AuthenticationFailed(DaybreakError):
    """The peer did not prove this pool's credential; the connection is refused and closed."""


@dataclass(frozen=True)
class Hello:
    """What a client claims: who it is, the scope it wants and its nonce."""

    identity: str
    scope: str
    nonce: bytes


@dataclass(frozen=True)
class Challenge:
    """The server's nonce and its proof that it knows the key of the claimed scope."""

    nonce: bytes
    proof: bytes


class ClientChannel(Protocol[Accept_co]):
    """The client's half of a stack's framing."""

    def send_hello(self, hello: Hello) -> None: ...

    def recv_challenge(self) -> Challenge:
        """The server's challenge; raises the stack's error on a refusal."""
        ...

    def send_proof(self, proof: bytes) -> None: ...

    def recv_accept(self) -> Accept_co:
        """The server's welcome in this stack's shape; raises the stack's error on a refusal."""
        ...


class ServerChannel(Protocol):
    """The server's half: read HELLO and PROOF, send the challenge, or refuse with a reason."""

    def recv_hello(self) -> Hello: ...

    def send_challenge(self, challenge: Challenge) -> None: ...

    def recv_proof(self) -> bytes: ...

    def send_refusal(self, reason: str) -> None: ...


def token_matches(presented: bytes, expected: bytes) -> bool:
    """Constant-time comparison, so the time a refusal takes says nothing about the expected value."""
    return hmac.compare_digest(presented, expected)


def _proof(key: bytes, label: bytes, hello: Hello, server_nonce: bytes) -> bytes:
    mac = hmac.new(key, label, hashlib.sha256)
    for part in (hello.identity.encode(), hello.scope.encode(), hello.nonce, server_nonce):
        mac.update(struct.pack("<I", len(part)) + part)
    return mac.digest()


def client_hello(channel: ClientChannel[Accept_co], *, key: bytes, scope: str, identity: str = "") -> Accept_co:
    """Open a connection: claim ``scope`` as ``identity`` and prove ``key``; returns the server's welcome.

    Raises AuthenticationFailed when the server cannot prove the same key (not this pool's agent).
    """
    hello = Hello(identity, scope, secrets.token_bytes(NONCE_BYTES))
    channel.send_hello(hello)
    challenge = channel.recv_challenge()
    if len(challenge.nonce) != NONCE_BYTES or not token_matches(
            challenge.proof, _proof(key, b"server", hello, challenge.nonce)):
        raise AuthenticationFailed("the server did not prove it holds this pool's credential "
                                   "(a wrong credential, or not an agent of this pool)")
    channel.send_proof(_proof(key, b"client", hello, challenge.nonce))
    return channel.recv_accept()


def server_accept(channel: ServerChannel, *, key_for: Callable[[str], bytes | None]) -> Hello:
    """Authenticate a new connection; returns its HELLO, or refuses and raises AuthenticationFailed.

    ``key_for(scope)`` is the key a client claiming ``scope`` must hold (None: scope unknown,
    refused after the same exchange, so a refusal's timing does not say which part was wrong).
    The caller sends its stack's welcome after this returns, and closes the connection on the exception.
    """
    hello = channel.recv_hello()
    if len(hello.nonce) != NONCE_BYTES:
        channel.send_refusal("bad handshake")
        raise AuthenticationFailed(f"HELLO nonce of {len(hello.nonce)} bytes from {hello.identity or 'a peer'}")
    known = key_for(hello.scope)
    key = known if known is not None else secrets.token_bytes(PROOF_BYTES)
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    channel.send_challenge(Challenge(server_nonce, _proof(key, b"server", hello, server_nonce)))
    proof = channel.recv_proof()
    if not token_matches(proof, _proof(key, b"client", hello, server_nonce)) or known is None:
        channel.send_refusal("wrong credential")
        raise AuthenticationFailed(f"wrong credential for scope {hello.scope!r} from "
                                   f"{hello.identity or 'an unnamed peer'}")
    return hello
