"""The operator's one typed settings object: defaults < environment (DAYBREAK_OPERATOR_<FIELD>) < flags."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from daybreak.operator.pool_policy import PoolPolicy
from daybreak.version import __version__

ENV_PREFIX = "DAYBREAK_OPERATOR_"


class OperatorSettings(BaseModel):
    """Everything one operator process needs to know; logged once at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- cluster access ----------------------------------------------------------------
    kubeconfig: str | None = Field(None, description="kubeconfig file; unset: in-cluster ServiceAccount, "
                                                      "else $KUBECONFIG / ~/.kube/config")
    service_account_dir: str = Field("/var/run/secrets/kubernetes.io/serviceaccount",
                                     description="in cluster: where the ServiceAccount token, ca.crt and namespace are")
    namespace: str | None = Field(None, description="watch only this namespace (comma-separated for several: the "
                                                    "chart's operator.watchNamespaces, where its RBAC is bound)")
    all_namespaces: bool = Field(False, description="watch every namespace (the default when no namespace is set)")

    # -- leader election -----------------------------------------------------------------
    lease_name: str = Field("daybreak-operator", min_length=1, description="name of the leader Lease")
    lease_namespace: str | None = Field(None, description="namespace of the Lease; default: the operator's own "
                                                          "namespace (in cluster), --namespace, else default")
    lease_duration_seconds: float = Field(8.0, gt=0, description="how long a silent leader keeps the Lease")
    renew_deadline_seconds: float = Field(5.0, gt=0, description="a leader that cannot renew for this long stops")
    retry_period_seconds: float = Field(1.0, gt=0, description="renew / campaign interval")
    identity: str | None = Field(None, description="prefix of this replica's Lease identity (default: hostname); "
                                                   "a random suffix is always added")

    # -- reconciling ------------------------------------------------------------------------
    resync_seconds: float = Field(30.0, gt=0, description="level-based re-apply period of every object")
    workers: int = Field(8, ge=1, le=256, description="objects reconciled concurrently")
    max_backoff_seconds: float = Field(60.0, gt=0, description="ceiling of the per-object retry back-off")
    image: str = Field(f"ghcr.io/daybreak-ai/daybreak:{__version__}",
                       description="image for agents, routers and sim engines when a resource names none")

    # -- pool policy (docs/security.md) ---------------------------------------------------------
    policy_dir: str | None = Field(None, description="the chart's pool-policy ConfigMap mounted as a directory; "
                                                     "unset: the built-in defaults (the chart's defaults)")
    pool_policy: PoolPolicy = Field(default_factory=lambda: PoolPolicy(),
                                    description="loaded from policy_dir; what pools may ask for")

    # -- observability ----------------------------------------------------------------------
    metrics_port: int = Field(8080, ge=0, le=65535, description="/metrics port (0 disables)")
    metrics_address: str = Field("0.0.0.0", description="address /metrics listens on")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")

    @model_validator(mode="after")
    def _check(self) -> OperatorSettings:
        if self.namespace and self.all_namespaces:
            raise ValueError("namespace and all_namespaces are exclusive: give --namespace NS or --all-namespaces")
        if not (0 < self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds):
            raise ValueError("lease timing: need retry_period_seconds < renew_deadline_seconds < "
                             "lease_duration_seconds")
        return self

    @property
    def clusterwide(self) -> bool:
        return not self.namespace

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The watched namespaces; empty means every namespace."""
        return tuple(n.strip() for n in (self.namespace or "").split(",") if n.strip())

    @classmethod
    def load(cls, *, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Merge environment and the flags actually given (``None`` means not given)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            if name == "pool_policy":
                continue  # structured: only through policy_dir
            raw = env.get(f"{ENV_PREFIX}{name.upper()}")
            if raw is not None:
                values[name] = raw
        values.update({k: v for k, v in (overrides or {}).items() if v is not None and k in cls.model_fields})
        if values.get("policy_dir") and "pool_policy" not in values:
            values["pool_policy"] = PoolPolicy.from_dir(str(values["policy_dir"]))
        return cls.model_validate(values)

    def describe(self) -> str:
        """One key=value line for the start-up log."""
        return " ".join(f"{k}={v}" for k, v in self.model_dump(mode="json").items())
