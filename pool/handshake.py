"""The one handshake every Daybreak connection opens with: the client presents the pool token, the server checks it.

Both wire stacks call this pair: the store protocol (``pool/connection.py`` and
the agent's store server) and the transfer engine's control connection
(``agent/transfer/control.py``). Each stack supplies a small channel that
carries the two messages in its own frames, so neither wire format changes;
the decision (and the constant-time comparison) lives here once.

TODAY THE TOKEN TRAVELS IN THE CLEAR inside the HELLO message; making this a
challenge-response (no secret on the wire, no replay) changes this module and
the channels' messages, not the callers of ``client_hello``/``server_accept``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Protocol, TypeVar

from daybreak.errors import DaybreakError

Accept_co = TypeVar("Accept_co", covariant=True)


class AuthenticationFailed(DaybreakError):
    """The peer did not present this pool's credential; the connection is refused and closed."""


@dataclass(frozen=True)
class Hello:
    """What a client presents: the pool token and who it says it is (client name, agent or engine id)."""

    token: bytes
    identity: str = ""


class ClientChannel(Protocol[Accept_co]):
    """The client's half of a stack's framing: send the HELLO, read the server's answer."""

    def send_hello(self, hello: Hello) -> None: ...

    def recv_accept(self) -> Accept_co:
        """The server's welcome in this stack's shape; raises the stack's error on a refusal."""
        ...


class ServerChannel(Protocol):
    """The server's half: read the first message as a HELLO, or refuse with a reason."""

    def recv_hello(self) -> Hello: ...

    def send_refusal(self, reason: str) -> None: ...


def token_matches(presented: bytes, expected: bytes) -> bool:
    """Constant-time comparison, so the time a refusal takes says nothing about the token."""
    return hmac.compare_digest(presented, expected)


def client_hello(channel: ClientChannel[Accept_co], *, token: bytes, identity: str = "") -> Accept_co:
    """Open a connection: present ``token`` as ``identity``; returns the server's welcome."""
    channel.send_hello(Hello(token, identity))
    return channel.recv_accept()


def server_accept(channel: ServerChannel, *, token: bytes) -> Hello:
    """Check a new connection's HELLO against ``token``; returns it, or refuses and raises AuthenticationFailed.

    The caller sends its stack's welcome after this returns, and closes the connection on the exception.
    """
    hello = channel.recv_hello()
    if not token_matches(hello.token, token):
        channel.send_refusal("wrong pool token")
        raise AuthenticationFailed(f"wrong pool token from {hello.identity or 'an unnamed peer'}")
    return hello
