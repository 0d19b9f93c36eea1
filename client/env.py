"""The pool settings an engine pod reads from its environment, once for every engine (sim, router, vLLM)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from daybreak.pool.tls import TlsSettingsError

__all__ = ["POOL_TLS_CA_ENV", "pool_tls_ca_file"]

POOL_TLS_CA_ENV = "DAYBREAK_POOL_TLS_CA_FILE"
"""CA bundle (PEM) the pool's agents are checked against; set by the operator for a pool with spec.tls."""


def pool_tls_ca_file(env: Mapping[str, str] | None = None, *, override: str = "") -> str | None:
    """The CA file to pass as ``KVPoolClient(tls_ca_file=...)``: ``override`` (a flag) or ``$DAYBREAK_POOL_TLS_CA_FILE``.

    None when neither is set (plain tcp). A set but unreadable file raises ``TlsSettingsError`` now,
    at start-up, instead of failing every later connect.
    """
    env = os.environ if env is None else env
    path = (override or env.get(POOL_TLS_CA_ENV, "")).strip()
    if not path:
        return None
    try:
        Path(path).read_bytes()
    except OSError as exc:
        source = "the flag" if override else f"${POOL_TLS_CA_ENV}"
        raise TlsSettingsError(f"pool TLS CA file {path!r} (from {source}) is unreadable: {exc.strerror}; "
                               "mount the pool's CA (ca.crt) there or unset it for plain tcp") from None
    return path
