"""The router's bearer-token credentials: read from a mounted Secret, one file per credential, kept fresh.

A PDDeployment's ``spec.router.auth.secretName`` names a Secret; the
operator mounts it at ``--auth-dir``, where the kubelet writes each key as a
file. The file's name is the credential's **name**: the client's identity for
the per-client limits and the root of its cache salt (``cache_salt``), so
clients of different credentials never share cached blocks. The file's text
is the bearer token.

Tokens are looked up by their SHA-256, so a wrong guess costs the same time
whichever token it resembles, and the tokens themselves are never logged. The
directory is re-read every few seconds (the kubelet updates a mounted Secret in
place), so a rotated or revoked token takes effect without a restart; a
re-read that fails or finds nothing keeps the last good set, because an empty
set would lock every client out on a transient read error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path

from daybreak.errors import DaybreakError

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they would fall to guessing through the router."""
_MAX_TOKEN_BYTES = 4096
RELOAD_SECONDS = 5.0


class AuthConfigError(DaybreakError):
    """The credentials directory is unusable (missing, unreadable, or holds no valid token)."""


def read_credentials(directory: Path) -> dict[str, str]:
    """``name -> token`` of every valid credential file in ``directory``.

    Hidden entries (the kubelet's ``..data`` and ``..<timestamp>`` links) are skipped; a file with a
    token shorter than ``MIN_TOKEN_CHARS`` or longer than 4 KiB is skipped with a warning naming it.
    Raises AuthConfigError when the directory cannot be listed.
    """
    try:
        entries = sorted(os.listdir(directory))
    except OSError as exc:
        raise AuthConfigError(f"--auth-dir {directory}: cannot list it ({exc}); mount the Secret named by "
                              "spec.router.auth.secretName there") from None
    out: dict[str, str] = {}
    for name in entries:
        if name.startswith("."):
            continue
        path = directory / name
        try:
            if not path.is_file():
                continue
            raw = path.read_bytes()[:_MAX_TOKEN_BYTES + 1]
        except OSError as exc:
            log.warning("event=credential_unreadable name=%s error=%s", name, exc)
            continue
        token = raw.decode("utf-8", errors="replace").strip()
        if not MIN_TOKEN_CHARS <= len(token) <= _MAX_TOKEN_BYTES:
            log.warning("event=credential_skipped name=%s reason=token_length_%d_outside_%d..%d", name,
                        len(token), MIN_TOKEN_CHARS, _MAX_TOKEN_BYTES)
            continue
        out[name] = token
    return out


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", errors="replace")).digest()


class Credentials:
    """The bearer tokens the router accepts; ``identify`` maps an Authorization header to a credential name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._by_digest: dict[bytes, str] = {}
        self.load()
        if not self._by_digest:
            raise AuthConfigError(f"--auth-dir {directory}: holds no credential (each key of the Secret is one: "
                                  f"the key names the client, the value is a token of at least {MIN_TOKEN_CHARS} "
                                  "characters)")

    @property
    def names(self) -> list[str]:
        return sorted(set(self._by_digest.values()))

    def load(self) -> bool:
        """Re-read the directory; keep the last good set when it fails or is empty. True when it changed."""
        try:
            found = read_credentials(self.directory)
        except AuthConfigError as exc:
            if self._by_digest:
                log.warning("event=credentials_reload_failed error=%s action=keep_last", exc)
                return False
            raise
        if not found:
            if self._by_digest:
                log.warning("event=credentials_reload_empty dir=%s action=keep_last", self.directory)
            return False
        table = {_digest(token): name for name, token in found.items()}
        if table == self._by_digest:
            return False
        self._by_digest = table
        log.info("event=credentials_loaded count=%d names=%s", len(found), ",".join(sorted(found)))
        return True

    def identify(self, authorization: str | None) -> str | None:
        """The credential name an ``Authorization: Bearer <token>`` header proves, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_digest.get(_digest(token.strip()))

    async def run(self, *, every_seconds: float = RELOAD_SECONDS) -> None:
        """Re-read the directory every ``every_seconds`` until cancelled."""
        while True:
            await asyncio.sleep(every_seconds)
            try:
                await asyncio.to_thread(self.load)
            except AuthConfigError as exc:  # only when nothing was ever loaded, which __init__ rules out
                log.warning("event=credentials_reload_failed error=%s", exc)


def credential_salt(credential: str, client_salt: str | None) -> str:
    """The ``cache_salt`` sent to the engines for a request of ``credential`` that asked for ``client_salt``.

    The credential comes first and is encoded unambiguously (JSON), so no salt a client of one credential
    can send yields another credential's salt: tenants never share blocks, while the clients of one
    credential still share theirs unless they add their own salt.
    """
    return json.dumps(["daybreak-router-credential", credential, client_salt or ""], separators=(",", ":"))
