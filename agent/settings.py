"""The node agent's one typed settings object: defaults < config file < environment < flags.

Environment variables are ``DAYBREAK_<FIELD>`` in upper case (for example
``DAYBREAK_SYSFS_ROOT``, ``DAYBREAK_SUNRISE_LIB_DIR``). The effective settings
are logged once at start-up, with secrets left out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_origin

import yaml

from daybreak.api.agentconfig import AgentConfig, RuntimeChoice

if TYPE_CHECKING:
    from daybreak.pool.tls import TlsContexts

__all__ = ["AgentSettings", "RuntimeChoice"]


class AgentSettings(AgentConfig):
    """Everything one agent process needs to know: ``api.agentconfig.AgentConfig`` (the fields, shared with the
    operator that writes them) plus how the agent loads and uses them."""

    @classmethod
    def load(cls, *, config_file: str | None = None, overrides: dict[str, Any] | None = None,
             environ: dict[str, str] | None = None) -> AgentSettings:
        """Merge the sources in order; later ones win. ``overrides`` are the flags actually given."""
        values: dict[str, Any] = {}
        if config_file:
            text = Path(config_file).read_text()
            loaded = yaml.safe_load(text) if not config_file.endswith(".json") else json.loads(text)
            values.update(loaded or {})
        env = os.environ if environ is None else environ
        for name, field in cls.model_fields.items():
            raw = env.get(f"DAYBREAK_{name.upper()}")
            if raw is None:
                continue
            values[name] = raw.split(",") if get_origin(field.annotation) is list else raw
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)

    def tls(self) -> TlsContexts | None:
        """``pool.tls.TlsContexts`` for both tcp paths, or None when no certificate is set (plain tcp)."""
        from daybreak.pool.tls import contexts

        return contexts(cert_file=self.tls_cert_file, key_file=self.tls_key_file, ca_file=self.tls_ca_file)

    def describe(self) -> str:
        """One key=value line for the start-up log."""
        return " ".join(f"{k}={v}" for k, v in self.model_dump(mode="json").items())
