"""The engine-pod contract: the ``DAYBREAK_*`` environment the operator gives engine and router pods, one model.

What the operator tells a serving pod (where the pool is, its credential, the kvNamespace, the kv layout,
the transports, the model) crosses a process boundary, so it is declared once, here, with each variable's
name, parser and default (vLLM's ``envs.py``, pydantic-settings' ``env_prefix``): the operator renders it
with ``EnginePodEnv.to_env()`` (``operator/deployment.py``) and every reader parses it with
``EnginePodEnv.from_env()``: the sim engine (``serving/sim``), the router (``serving/router``) and the vLLM
connector (``connectors/blocks.py``). Reading the files it names (the credential file, the CA) is the
client's (``client/env.py``): ``api/`` does no I/O.

ONE credential precedence everywhere: a credential given to the process (a flag, the connector's extra
config) replaces the environment's; within one source a credential file wins over an inline token
(``client.env.read_pool_token``).

The vLLM ``--kv-transfer-config`` is built here once too (``vllm_kv_transfer_config``), and the one engine
flag the operator reads back from ``engine.args`` is parsed here (``max_num_seqs``): vLLM's ``--max-num-seqs``,
which the sim engine takes under the same name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from daybreak.api.kvcompat import KVLayout
from daybreak.errors import DaybreakError

__all__ = ["ENV_PREFIX", "ENV_VARS", "MAX_NUM_SEQS_FLAGS", "VLLM_CONNECTOR", "VLLM_CONNECTOR_MODULE", "EnginePodEnv",
           "EnginePodEnvError", "EngineRole", "VllmKVRole", "max_num_seqs", "vllm_kv_transfer_config"]

ENV_PREFIX = "DAYBREAK_"

EngineRole = Literal["prefill", "decode", "both"]
TransportName = Literal["rdma", "link", "shm", "tcp"]


class EnginePodEnvError(DaybreakError, ValueError):
    """A ``DAYBREAK_*`` variable of the engine-pod contract does not parse; the message names the variable."""


class EnginePodEnv(BaseModel):
    """The engine-pod contract. Each field is the variable ``DAYBREAK_<FIELD>`` (upper case); an empty or unset
    variable is the field's default. Lists are comma-separated, ``kv_layout`` is the kvLayout as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: EngineRole | None = Field(None, description="prefill (kv producer), decode (kv consumer) or both; the "
                                    "sim engine's role (vLLM's is kv_role in its --kv-transfer-config)")
    pool_ref: str = Field("", description="NS/NAME of the KVPool whose status.endpoints list the agents (read "
                          "through the API with the pod's ServiceAccount)")
    pool_endpoints: list[str] = Field(default_factory=list, description="agents host:port (the pool's headless "
                                      "Service; needs cluster DNS): the fallback without pool_ref")
    pool_token: str = Field("", repr=False, description="the kvNamespace credential (from the agent-minted "
                            "Secret); never logged")
    pool_token_file: str = Field("", description="file holding the credential; wins over pool_token")
    pool_tls_ca_file: str = Field("", description="CA bundle (PEM) the agents' TLS certificates are checked "
                                  "against; set for a pool with spec.tls, empty: plain tcp")
    kv_namespace: str = Field("", description="the deployment's kvNamespace (its blocks' namespace)")
    kv_layout: KVLayout | None = Field(None, description="the model's kvLayout (block keys and sizes)")
    block_bytes: int = Field(0, ge=0, le=1 << 30, description="bytes per block the sim engine moves; 0: the "
                             "layout's")
    transports: list[TransportName] = Field(default_factory=list, description="the pool's transports, most "
                                            "preferred first (spec.transport.preference); empty: all")
    model: str = Field("", description="the model served (the sim engine's name for it)")
    engine_port: int = Field(0, ge=0, le=65535, description="the port the engine serves HTTP on; 0: its default")

    @field_validator("pool_ref")
    @classmethod
    def _ns_name(cls, value: str) -> str:
        if value and (value.count("/") != 1 or not all(value.split("/"))):
            raise ValueError(f"give NAMESPACE/NAME, got {value!r}")
        return value

    @staticmethod
    def env_name(field: str) -> str:
        """The variable that carries ``field``."""
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EnginePodEnv:
        """Parse the contract's variables from ``env`` (``os.environ`` in a pod); other variables are ignored.

        Raises ``EnginePodEnvError`` naming the variable at fault.
        """
        values: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            raw = env.get(cls.env_name(name), "").strip()
            if not raw:
                continue
            if name == "kv_layout":
                try:
                    values[name] = json.loads(raw)
                except ValueError as exc:
                    raise EnginePodEnvError(f"${cls.env_name(name)} is not JSON ({exc}); give the kvLayout as a "
                                            "JSON object, e.g. '{\"numLayers\":32,\"numKVHeads\":8,\"headDim\":128,"
                                            "\"blockTokens\":16}'") from None
            elif get_origin(field.annotation) is list:
                values[name] = [v.strip() for v in raw.split(",") if v.strip()]
            else:
                values[name] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = cls.env_name(str(first["loc"][0])) if first["loc"] else "the environment"
            raise EnginePodEnvError(f"${where}: {first['msg']}") from None

    def to_env(self, *, pool_token_from: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """The pod-spec ``env`` entries for the fields that are set, in field order.

        ``pool_token_from`` is a ``valueFrom`` (a ``secretKeyRef``) for ``DAYBREAK_POOL_TOKEN``: the operator
        never puts the credential itself into a pod spec.
        """
        out: list[dict[str, Any]] = []
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if name == "pool_token" or value == field.get_default(call_default_factory=True):
                continue
            if isinstance(value, KVLayout):
                text = json.dumps(value.to_dict(), sort_keys=True)
            elif isinstance(value, list):
                text = ",".join(value)
            else:
                text = str(value)
            out.append({"name": self.env_name(name), "value": text})
        if pool_token_from is not None:
            out.append({"name": self.env_name("pool_token"), "valueFrom": dict(pool_token_from)})
        return out


ENV_VARS: tuple[str, ...] = tuple(EnginePodEnv.env_name(n) for n in EnginePodEnv.model_fields)
"""Every variable of the contract (the operator's policy refuses user variables of the prefix)."""

VLLM_CONNECTOR = "DaybreakConnector"
VLLM_CONNECTOR_MODULE = "daybreak.connectors.vllm"
VllmKVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
VLLM_KV_ROLES: tuple[VllmKVRole, ...] = ("kv_producer", "kv_consumer", "kv_both")


def vllm_kv_transfer_config(*, kv_role: str, extra: Mapping[str, Any] | None = None,
                            load_failure_policy: Literal["recompute", "fail"] | None = "recompute") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for Daybreak's connector (``daybreak.connectors.vllm``), built once.

    In an operator's pod ``extra`` is empty: the pool, credential, kvNamespace and kvLayout reach the connector
    through the environment (``EnginePodEnv``), so the credential never appears on a command line. Outside
    Kubernetes ``extra`` carries them (``endpoints``, ``token_file``, ``namespace``, ...; connectors/blocks.py).
    A failed load is recomputed, never fatal, unless ``load_failure_policy`` says otherwise (None: vLLM's
    default).
    """
    if kv_role not in VLLM_KV_ROLES:
        raise ValueError(f"kv_role: {kv_role!r} is not one of {', '.join(VLLM_KV_ROLES)}")
    config: dict[str, Any] = {"kv_connector": VLLM_CONNECTOR, "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
                              "kv_role": kv_role, "kv_connector_extra_config": dict(extra or {})}
    if load_failure_policy is not None:
        config["kv_load_failure_policy"] = load_failure_policy
    return config


# vLLM's flag for the most sequences a pod runs at once; the sim engine's older spelling is still read.
MAX_NUM_SEQS_FLAGS = ("--max-num-seqs", "--max-batch")


def max_num_seqs(args: Sequence[str]) -> int | None:
    """The running-sequence cap an engine's command line sets (``--max-num-seqs N`` or ``=N``), else None.

    The last occurrence wins, as with argparse. None also when the value does not parse: the engine itself
    refuses such a flag at start-up, and the planner then learns the cap from queues instead.
    """
    found: int | None = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in MAX_NUM_SEQS_FLAGS:
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            parsed = int(value)
        except ValueError:
            found = None
            continue
        found = parsed if parsed >= 1 else None
    return found
