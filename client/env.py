"""What an engine pod reads from its environment, once for every engine (sim, router, vLLM connector).

The variables are the operator's engine-pod contract, declared once in ``api.enginepod.EnginePodEnv``;
this module adds what ``api/`` may not do, the I/O: reading ``os.environ``, the credential file and
checking the CA file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from daybreak.api.enginepod import EnginePodEnv, EnginePodEnvError
from daybreak.pool.tls import TlsSettingsError

__all__ = ["POOL_TLS_CA_ENV", "EnginePodEnv", "EnginePodEnvError", "engine_pod_env", "pool_tls_ca_file",
           "read_pool_token"]

POOL_TLS_CA_ENV = EnginePodEnv.env_name("pool_tls_ca_file")
"""CA bundle (PEM) the pool's agents are checked against; set by the operator for a pool with spec.tls."""


def engine_pod_env(env: Mapping[str, str] | None = None) -> EnginePodEnv:
    """The engine-pod contract from ``env`` (default ``os.environ``); ``EnginePodEnvError`` names a bad variable."""
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
            raise EnginePodEnvError(f"{source or 'token file'} {token_file}: cannot read the pool token "
                                    f"({exc.strerror}); mount it there or give the token another way") from None
        if not text:
            raise EnginePodEnvError(f"{source or 'token file'} {token_file} is empty")
        return text
    return token.strip()


def pool_tls_ca_file(env: Mapping[str, str] | None = None, *, override: str = "") -> str | None:
    """The CA file to pass as ``KVPoolClient(tls_ca_file=...)``: ``override`` (a flag) or ``$DAYBREAK_POOL_TLS_CA_FILE``.

    None when neither is set (plain tcp). A set but unreadable file raises ``TlsSettingsError`` now,
    at start-up, instead of failing every later connect.
    """
    env = os.environ if env is None else env
    # One variable, not the whole contract: a process that only wants TLS is not failed by another variable.
    path = (override or EnginePodEnv.from_env({POOL_TLS_CA_ENV: env.get(POOL_TLS_CA_ENV, "")}).pool_tls_ca_file)
    path = path.strip()
    if not path:
        return None
    try:
        Path(path).read_bytes()
    except OSError as exc:
        source = "the flag" if override else f"${POOL_TLS_CA_ENV}"
        raise TlsSettingsError(f"pool TLS CA file {path!r} (from {source}) is unreadable: {exc.strerror}; "
                               "mount the pool's CA (ca.crt) there or unset it for plain tcp") from None
    return path
