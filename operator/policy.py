"""The cluster admin's pool policy: what a KVPool or PDDeployment may make the operator create.

A KVPool creator must not become root on the nodes through the operator: the
agent DaemonSet is host-networked and mounts host paths, so every field of the
pool that reaches it (image, SSD path, tolerations) is checked against this
policy. The same rules run in three places, on purpose:

- at admission, as the chart's ValidatingAdmissionPolicies ``daybreak-pool-policy``
  and ``daybreak-deployment-policy`` (the API server refuses the KVPool or the
  PDDeployment's pod template and names the field);
- in the operator's builders (this module), which refuse to build and set a
  ``PolicyViolation`` condition naming the field: a pool admitted before the
  policy was tightened, or a cluster without the chart's admission policies,
  is still refused;
- on the operator's own writes, as ``daybreak-operator-writes``: whatever the
  operator (or a stolen operator token) asks for, the API server refuses
  privileged, host-PID or host-path workloads outside the tier paths.

The policy reaches the operator as the chart's ConfigMap (the admission
policy's parameter object) mounted as a directory, one file per key; list
values are comma-separated, as CEL reads them with ``split(',')``. KEEP THE
RULES HERE AND IN charts/daybreak/templates/policy.yaml IN STEP: a test checks
both against the same cases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from daybreak.api.kvpool import KVPool
from daybreak.errors import DaybreakError

logger = logging.getLogger(__name__)

# ConfigMap keys (also the Helm values under poolPolicy, and what the admission policy reads as params.data).
KEY_SSD_ROOTS = "allowedSSDRoots"
KEY_AGENT_IMAGES = "allowedAgentImages"
KEY_TOLERATION_KEYS = "allowedTolerationKeys"
KEY_PRIORITY_CLASS = "agentPriorityClassName"
ANY_KEY = "*"

# Host paths an agent mounts besides its SSD directory, and what an engine may mount (the DRAM tier's
# segments for same-node zero copy, huge pages, verbs devices for RDMA clients). Fixed by the product,
# not by the admin: nothing else on the host is ever needed.
AGENT_HOST_PATHS = frozenset({"/sys", "/dev/shm", "/dev/hugepages", "/dev/infiniband"})
ENGINE_HOST_PATHS = frozenset({"/dev/shm", "/dev/hugepages", "/dev/infiniband"})
# Capabilities an engine may add (verbs registration pins memory); agents get theirs from the builder.
ENGINE_CAPABILITIES = frozenset({"IPC_LOCK"})
AGENT_SA_SUFFIX = "-daybreak-agent"  # every agent ServiceAccount's name ends so; the chart's policies match it


@dataclass(frozen=True)
class Violation:
    """One refused field: ``field`` is the path in the object (spec.tiers.ssd.path), ``message`` says why and
    what to do next."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class PolicyError(DaybreakError, ValueError):
    """The object asks for more than the cluster's Daybreak policy allows; nothing was applied."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


class PoolPolicy(BaseModel):
    """What pools may ask for. The defaults are the chart's defaults (a test keeps them equal)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_ssd_roots: tuple[str, ...] = Field(
        default=("/var/lib/daybreak", "/mnt"),
        description="host directories an SSD tier's path must be (or lie under); '/' is refused")
    allowed_agent_images: tuple[str, ...] = Field(
        default=(), description="images a pool may name in spec.agent.image (an entry ending in '/', ':' or '@' is a "
                        "prefix); empty: pools always run the operator's agent image")
    allowed_toleration_keys: tuple[str, ...] = Field(
        default=("daybreak.dev/dedicated", "nvidia.com/gpu"),
        description="taint keys a pool's tolerations may name; '*' also allows key-less tolerations, which "
                    "match every taint (control-plane nodes included)")
    agent_priority_class_name: str = Field(default="", description="priorityClassName of every agent pod (admin-chosen: "
                                                           "pools have no such field); empty: none")

    @field_validator("allowed_ssd_roots")
    @classmethod
    def _roots(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for root in roots:
            clean = root.rstrip("/")
            if not root.startswith("/") or not clean or _has_dot_segments(clean) or "//" in clean:
                raise ValueError(f"SSD root {root!r} must be an absolute, normalised directory other than '/'")
            out.append(clean)
        return tuple(out)

    @classmethod
    def from_data(cls, data: dict[str, str]) -> PoolPolicy:
        """From the ConfigMap's data (string values; lists comma-separated)."""
        values: dict[str, Any] = {}
        for key, field in ((KEY_SSD_ROOTS, "allowed_ssd_roots"), (KEY_AGENT_IMAGES, "allowed_agent_images"),
                           (KEY_TOLERATION_KEYS, "allowed_toleration_keys")):
            if key in data:
                values[field] = _csv(data[key])
        if KEY_PRIORITY_CLASS in data:
            values["agent_priority_class_name"] = data[KEY_PRIORITY_CLASS].strip()
        return cls.model_validate(values)

    @classmethod
    def from_dir(cls, directory: str) -> PoolPolicy:
        """From a mounted ConfigMap: one file per key (Kubernetes' ``..data`` links are skipped)."""
        if not os.path.isdir(directory):
            raise ValueError(f"policy directory {directory!r} does not exist; mount the chart's pool-policy "
                             "ConfigMap there or leave --policy-dir unset for the built-in defaults")
        data = {}
        for name in (KEY_SSD_ROOTS, KEY_AGENT_IMAGES, KEY_TOLERATION_KEYS, KEY_PRIORITY_CLASS):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path) as f:
                    data[name] = f.read()
        return cls.from_data(data)

    def to_data(self) -> dict[str, str]:
        """The ConfigMap form (what the chart renders)."""
        return {KEY_SSD_ROOTS: ",".join(self.allowed_ssd_roots), KEY_AGENT_IMAGES: ",".join(self.allowed_agent_images),
                KEY_TOLERATION_KEYS: ",".join(self.allowed_toleration_keys),
                KEY_PRIORITY_CLASS: self.agent_priority_class_name}

    # -- rules (mirrored in CEL by the chart) ---------------------------------------------------
    def ssd_path_allowed(self, path: str) -> bool:
        if not path.startswith("/") or _has_dot_segments(path) or "//" in path:
            return False
        return any(path == root or path.startswith(root + "/") for root in self.allowed_ssd_roots)

    def agent_image_allowed(self, image: str) -> bool:
        return any(image == a or (a.endswith(("/", ":", "@")) and image.startswith(a))
                   for a in self.allowed_agent_images)

    def toleration_allowed(self, key: str | None) -> bool:
        if ANY_KEY in self.allowed_toleration_keys:
            return True
        return bool(key) and key in self.allowed_toleration_keys


def _has_dot_segments(path: str) -> bool:
    return any(seg in (".", "..") for seg in path.split("/"))


def _listed(items: Iterable[str]) -> str:
    return ", ".join(items) or "(none)"


def pool_violations(pool: KVPool, policy: PoolPolicy) -> list[Violation]:
    """Every field of ``pool`` the policy refuses (empty: the pool may be built)."""
    spec = pool.spec
    out: list[Violation] = []
    if spec.agent.image is not None and not policy.agent_image_allowed(spec.agent.image):
        out.append(Violation("spec.agent.image", (
            f"image {spec.agent.image!r} is not allowed by the cluster's Daybreak pool policy (allowed: "
            f"{_listed(policy.allowed_agent_images)}); remove the field to run the operator's agent image, or ask "
            "the cluster admin to add it to poolPolicy.allowedAgentImages")))
    ssd = spec.tiers.ssd
    if ssd is not None and not policy.ssd_path_allowed(ssd.path):
        out.append(Violation("spec.tiers.ssd.path", (
            f"host path {ssd.path!r} is not under an allowed SSD root ({_listed(policy.allowed_ssd_roots)}); "
            "choose a directory under one of them (no '.' or '..' segments), or ask the cluster admin to add a "
            "root to poolPolicy.allowedSSDRoots")))
    for i, t in enumerate(spec.tolerations):
        if not policy.toleration_allowed(t.key):
            what = f"key {t.key!r}" if t.key else "no key (it matches every taint)"
            out.append(Violation(f"spec.tolerations[{i}].key", (
                f"a toleration with {what} is not allowed by the cluster's Daybreak pool policy (allowed keys: "
                f"{_listed(policy.allowed_toleration_keys)}); ask the cluster admin to add it to "
                "poolPolicy.allowedTolerationKeys")))
    return out


def engine_pod_violations(pod_spec: dict[str, Any], *, where: str) -> list[Violation]:
    """What an engine or router pod template (after the user's partial template is merged) may not contain:
    host namespaces, privileged containers, added capabilities beyond IPC_LOCK, host paths other than the
    pool's shared memory, huge pages and verbs devices, or an agent's ServiceAccount."""
    out: list[Violation] = []
    for flag in ("hostPID", "hostIPC", "hostNetwork"):
        if pod_spec.get(flag):
            out.append(Violation(f"{where}.{flag}", "engines may not share the node's namespaces; remove it"))
    sa = str(pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount") or "")
    if sa.endswith(AGENT_SA_SUFFIX):
        out.append(Violation(f"{where}.serviceAccountName",
                             f"{sa!r} is a pool agent's ServiceAccount (node rights); engines may not use it"))
    for i, vol in enumerate(pod_spec.get("volumes") or []):
        host = (vol or {}).get("hostPath")
        if host is not None and str(host.get("path", "")).rstrip("/") not in ENGINE_HOST_PATHS:
            out.append(Violation(f"{where}.volumes[{i}].hostPath.path", (
                f"host path {host.get('path')!r} is not one engines may mount ({_listed(sorted(ENGINE_HOST_PATHS))})")))
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(pod_spec.get(group) or []):
            ctx = (c or {}).get("securityContext") or {}
            if ctx.get("privileged"):
                out.append(Violation(f"{where}.{group}[{i}].securityContext.privileged",
                                     "privileged engine containers are not allowed; remove it"))
            added = set((ctx.get("capabilities") or {}).get("add") or []) - ENGINE_CAPABILITIES
            if added:
                out.append(Violation(f"{where}.{group}[{i}].securityContext.capabilities.add", (
                    f"capabilities {sorted(added)} are not allowed for engines (allowed: "
                    f"{_listed(sorted(ENGINE_CAPABILITIES))})")))
    return out
