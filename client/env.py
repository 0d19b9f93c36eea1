"""What an engine pod reads from its environment, once for every engine (sim, router, vLLM connector).

The variables are the operator's engine-pod contract, declared once in ``api.enginepod.EnginePodEnv``;
this module adds what ``api/`` may not do, the I/O: reading ``os.environ``, the credential file and
checking the CA file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from daybreak.pool.tls import TlsSettingsError

if TYPE_CHECKING:
    from daybreak.api.enginepod import EnginePodEnv

__all__ = ["POOL_TLS_CA_ENV", "engine_pod_env", "pool_tls_ca_file", "read_pool_token"]

# ``api.enginepod`` is imported only when called: ``import daybreak.client`` loads client and pool modules only.
POOL_TLS_CA_ENV = "DAYBREAK_POOL_TLS_CA_FILE"
"""CA bundle (PEM) the pool's agents are checked against; set by the operator for a pool with spec.tls
(``EnginePodEnv.pool_tls_ca_file``; tests/api/test_engine_pod_contract.py checks the two agree)."""


def engine_pod_env(env: Mapping[str, str] | None = None) -> EnginePodEnv:
    """The engine-pod contract from ``env`` (default ``os.environ``); ``EnginePodEnvError`` names a bad variable."""
    from daybreak.api.enginepod import EnginePodEnv

    return EnginePodEnv.from_env(os.environ if env is None else env)


def read_pool_token(*, token: str = "", token_file: str = "", source: str = "") -> str:
    """The credential: ``token_file``'s text when a file is given (it wins), else ``token``; "" when neither.

    The one precedence of every engine: the caller first picks the source (a flag or the connector's extra
    config replaces the environment's pair), then this. ``source`` names where the file came from in errors.
    """
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            from daybreak.api.enginepod import EnginePodEnvError

            raise EnginePodEnvError(f"{source or 'token file'} {token_file}: cannot read the pool token "
                                    f"({exc.strerror}); mount it there or give the token another way") from None
        if not text:
            from daybreak.api.enginepod import EnginePodEnvError

            raise EnginePodEnvError(f"{source or 'token file'} {token_file} is empty")
        return text
    return token.strip()


def pool_tls_ca_file(env: Mapping[str, str] | None = None, *, override: str = "") -> str | None:
    """The CA file to pass as ``KVPoolClient(tls_ca_file=...)``: ``override`` (a flag) or ``$DAYBREAK_POOL_TLS_CA_FILE``.

    None when neither is set (plain tcp). A set but unreadable file raises ``TlsSettingsError`` now,
    at start-up, instead of failing every later connect.
    """
    # One variable, not the whole contract: a process that only wants TLS is not failed by another variable.
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
