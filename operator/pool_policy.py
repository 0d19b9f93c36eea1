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

Engine and router pods are held to a restricted profile: non-root, seccomp
RuntimeDefault, no host namespaces, host ports, node pinning, priority or
runtime classes, no SELinux or AppArmor overrides, tolerations only of the
admin's keys, volumes only of the listed types, Secrets only the minted
kvNamespace credential and the pool's CA, and the ``DAYBREAK_*`` variables
the operator writes are not the user's to set. What the user writes (the
PDDeployment's ``engine.env`` and partial templates) is checked by
``deployment_violations`` (admission: daybreak-deployment-policy); what the
operator builds from it, by ``engine_pod_violations`` (its write policy:
daybreak-operator-writes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment
from daybreak.errors import DaybreakError

logger = logging.getLogger(__name__)

# ConfigMap keys (also the Helm values under poolPolicy, and what the admission policy reads as params.data).
KEY_SSD_ROOTS = "allowedSSDRoots"
KEY_AGENT_IMAGES = "allowedAgentImages"
KEY_TOLERATION_KEYS = "allowedTolerationKeys"
KEY_PRIORITY_CLASS = "agentPriorityClassName"
KEY_AGENT_PORTS = "agentPortRange"
KEY_POOL_GROUPS = "poolGroupRange"
ANY_KEY = "*"

# Host paths an agent mounts besides its SSD directory, and what an engine may mount (the DRAM tier's
# segments for same-node zero copy, huge pages an engine's own template asks for, verbs devices for RDMA
# clients). Fixed by the product, not by the admin: nothing else on the host is ever needed. Agents no
# longer mount /dev/hugepages (the KVPool's hugePages field was removed: nothing used huge pages).
AGENT_HOST_PATHS = frozenset({"/sys", "/dev/shm", "/dev/infiniband"})
ENGINE_HOST_PATHS = frozenset({"/dev/shm", "/dev/hugepages", "/dev/infiniband"})
# Capabilities an engine may add (verbs registration pins memory); agents get theirs from the builder.
ENGINE_CAPABILITIES = frozenset({"IPC_LOCK"})
AGENT_SA_SUFFIX = "-daybreak-agent"  # every agent ServiceAccount's name ends so; the chart's policies match it
# Volume types an engine pod may have (restricted Pod Security's list without inline csi, plus the host
# paths above). nfs, iscsi, inline csi and the like reach storage the cluster admin never granted.
ENGINE_VOLUME_TYPES = ("configMap", "downwardAPI", "emptyDir", "ephemeral", "hostPath", "persistentVolumeClaim",
                       "projected", "secret")
ENGINE_SECCOMP = "RuntimeDefault"
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
OPERATOR_ENV_PREFIX = "DAYBREAK_"  # the engines' contract with the operator (operator/deployment.py)
# An engine's Secrets: its kvNamespace credential (pool/engine_secret.py names it <pdd>-kv-<10 hex>, key
# "token") and, for a pool with TLS, the ca.crt key of the pool's TLS Secret (never its tls.key).
CREDENTIAL_KEY = "token"
CREDENTIAL_NAME = re.compile(r"-kv-[0-9a-f]{10}$")
CA_KEY = "ca.crt"
# Pod securityContext fields that carry the pool's ids; only the operator sets them.
ID_FIELDS = ("runAsUser", "runAsGroup", "fsGroup", "supplementalGroups")


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


def _range(raw: str) -> tuple[int, int]:
    low, sep, high = raw.partition("-")
    if not sep:
        raise ValueError(f"range {raw!r} must be written low-high, e.g. 7400-7599")
    return int(low.strip()), int(high.strip())


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
    agent_port_range: tuple[int, int] = Field(
        default=(7400, 7599),
        description="host ports (inclusive) a pool's agents may use: spec.agent.port and the next one (its /metrics) "
                    "must both lie in it")
    pool_group_range: tuple[int, int] = Field(
        default=(200000, 299999),
        description="ids (inclusive) a pool's group id is drawn from: its agents' group, and its engines' user and "
                    "group, so that one pool's engines cannot map another pool's shared-memory segments")

    @field_validator("agent_port_range", "pool_group_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        low, high = value
        if not 1 <= low < high or high > (1 << 31) - 1:
            raise ValueError(f"range {low}-{high} must be two increasing positive numbers")
        return value

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
        for key, field in ((KEY_AGENT_PORTS, "agent_port_range"), (KEY_POOL_GROUPS, "pool_group_range")):
            if data.get(key, "").strip():
                values[field] = _range(data[key])
        return cls.model_validate(values)

    @classmethod
    def from_dir(cls, directory: str) -> PoolPolicy:
        """From a mounted ConfigMap: one file per key (Kubernetes' ``..data`` links are skipped)."""
        if not os.path.isdir(directory):
            raise ValueError(f"policy directory {directory!r} does not exist; mount the chart's pool-policy "
                             "ConfigMap there or leave --policy-dir unset for the built-in defaults")
        data = {}
        for name in (KEY_SSD_ROOTS, KEY_AGENT_IMAGES, KEY_TOLERATION_KEYS, KEY_PRIORITY_CLASS, KEY_AGENT_PORTS,
                     KEY_POOL_GROUPS):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path) as f:
                    data[name] = f.read()
        return cls.from_data(data)

    def to_data(self) -> dict[str, str]:
        """The ConfigMap form (what the chart renders)."""
        return {KEY_SSD_ROOTS: ",".join(self.allowed_ssd_roots), KEY_AGENT_IMAGES: ",".join(self.allowed_agent_images),
                KEY_TOLERATION_KEYS: ",".join(self.allowed_toleration_keys),
                KEY_PRIORITY_CLASS: self.agent_priority_class_name,
                KEY_AGENT_PORTS: "-".join(map(str, self.agent_port_range)),
                KEY_POOL_GROUPS: "-".join(map(str, self.pool_group_range))}

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

    def agent_port_allowed(self, port: int) -> bool:
        """The store port and the next one (the agent's /metrics) both in the admin's range."""
        low, high = self.agent_port_range
        return low <= port and port + 1 <= high

    def pool_group(self, pool_uid: str) -> int:
        """The pool's group id: fixed by its metadata.uid, spread over the admin's range.

        Two pools may draw the same id (a birthday collision: about n^2/2 in the range size); they are
        then as separated as every pool was before, no worse. A changed range gives every pool a new id.
        """
        low, high = self.pool_group_range
        digest = int.from_bytes(hashlib.sha256(pool_uid.encode()).digest()[:8], "big")
        return low + digest % (high - low + 1)


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
    if not policy.agent_port_allowed(spec.agent.port):
        low, high = policy.agent_port_range
        out.append(Violation("spec.agent.port", (
            f"port {spec.agent.port} (and {spec.agent.port + 1} for /metrics) is not in the cluster's agent port "
            f"range {low}-{high}; choose a port from {low} to {high - 1}, at least 2 away from the ports of other "
            "pools on the same nodes, or ask the cluster admin to widen poolPolicy.agentPortRange")))
    return out


def _secret_refs(container: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field below the container, Secret name, key) of every Secret a container's env reads."""
    out = []
    for j, e in enumerate(container.get("env") or []):
        ref = ((e or {}).get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            out.append((f"env[{j}].valueFrom.secretKeyRef", str(ref.get("name", "")), str(ref.get("key", ""))))
    for j, e in enumerate(container.get("envFrom") or []):
        ref = (e or {}).get("secretRef")
        if ref is not None:
            out.append((f"envFrom[{j}].secretRef", str(ref.get("name", "")), "*"))
    return out


def _volume_secrets(volume: dict[str, Any]) -> list[tuple[str, list[str] | None]]:
    """(Secret name, listed keys or None for all) of a secret or projected volume."""
    out: list[tuple[str, list[str] | None]] = []
    if "secret" in volume:
        sec = volume["secret"] or {}
        items = sec.get("items")
        out.append((str(sec.get("secretName", "")), [str(x.get("key")) for x in items] if items else None))
    for source in ((volume.get("projected") or {}).get("sources") or []):
        sec = (source or {}).get("secret")
        if sec is not None:
            items = sec.get("items")
            out.append((str(sec.get("name", "")), [str(x.get("key")) for x in items] if items else None))
    return out


def _security_context_violations(ctx: dict[str, Any], *, where: str, user: bool) -> list[Violation]:
    """The rules a pod's or a container's securityContext shares."""
    out: list[Violation] = []
    for name in ID_FIELDS:
        value = ctx.get(name)
        if value is None:
            continue
        if user:
            out.append(Violation(f"{where}.{name}", (
                "engines run as the pool's user and group ids, which only the operator sets (so that one pool's "
                "engines cannot map another pool's shared memory); remove it")))
        elif value == 0 or (isinstance(value, list) and 0 in value):
            out.append(Violation(f"{where}.{name}", "engines may not run as root (id 0)"))
    if ctx.get("runAsNonRoot") is False:
        out.append(Violation(f"{where}.runAsNonRoot", "engines run as non-root; remove it"))
    seccomp = (ctx.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp != ENGINE_SECCOMP:
        out.append(Violation(f"{where}.seccompProfile.type", (
            f"seccomp profile {seccomp!r} is not allowed for engines (they run {ENGINE_SECCOMP}); remove it")))
    for name in ("seLinuxOptions", "appArmorProfile", "sysctls"):
        if name in ctx:
            out.append(Violation(f"{where}.{name}", "engines may not override SELinux, AppArmor or sysctls; remove it"))
    if ctx.get("privileged"):
        out.append(Violation(f"{where}.privileged", "privileged engine containers are not allowed; remove it"))
    if ctx.get("allowPrivilegeEscalation"):
        out.append(Violation(f"{where}.allowPrivilegeEscalation", "engines may not gain privileges; remove it"))
    if ctx.get("procMount") not in (None, "Default"):
        out.append(Violation(f"{where}.procMount", "engines use the default /proc mount; remove it"))
    added = set((ctx.get("capabilities") or {}).get("add") or []) - ENGINE_CAPABILITIES
    if added:
        out.append(Violation(f"{where}.capabilities.add", (
            f"capabilities {sorted(added)} are not allowed for engines (allowed: "
            f"{_listed(sorted(ENGINE_CAPABILITIES))})")))
    return out


def _pod_violations(pod_spec: dict[str, Any], *, where: str, policy: PoolPolicy, user: bool,
                    credential: str = "") -> list[Violation]:
    """The restricted profile of an engine or router pod spec. ``user``: the user's partial template (ids and
    Secrets are the operator's to add); else a built pod spec, whose Secrets may be only ``credential`` (key
    token) and the ca.crt key of any Secret."""
    out: list[Violation] = []
    for flag in ("hostPID", "hostIPC", "hostNetwork"):
        if pod_spec.get(flag):
            out.append(Violation(f"{where}.{flag}", "engines may not share the node's namespaces; remove it"))
    for name in ("nodeName", "priorityClassName", "runtimeClassName"):
        if pod_spec.get(name):
            out.append(Violation(f"{where}.{name}", (
                "engines are placed by the scheduler with the cluster's default priority and runtime; remove it "
                "(spec.<role>.nodeSelector chooses nodes)")))
    sa = str(pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount") or "")
    if sa.endswith(AGENT_SA_SUFFIX):
        out.append(Violation(f"{where}.serviceAccountName",
                             f"{sa!r} is a pool agent's ServiceAccount (node rights); engines may not use it"))
    for i, t in enumerate(pod_spec.get("tolerations") or []):
        key = (t or {}).get("key")
        if not policy.toleration_allowed(key):
            what = f"key {key!r}" if key else "no key (it matches every taint)"
            out.append(Violation(f"{where}.tolerations[{i}].key", (
                f"a toleration with {what} is not allowed by the cluster's Daybreak pool policy (allowed keys: "
                f"{_listed(policy.allowed_toleration_keys)}); ask the cluster admin to add it to "
                "poolPolicy.allowedTolerationKeys")))
    out += _security_context_violations(pod_spec.get("securityContext") or {}, where=f"{where}.securityContext",
                                        user=user)
    if not user:
        ctx = pod_spec.get("securityContext") or {}
        if ctx.get("runAsNonRoot") is not True or (ctx.get("seccompProfile") or {}).get("type") != ENGINE_SECCOMP:
            out.append(Violation(f"{where}.securityContext", (
                f"engine pods must set runAsNonRoot: true and seccompProfile {ENGINE_SECCOMP}")))
    for i, vol in enumerate(pod_spec.get("volumes") or []):
        vol = vol or {}
        kinds = [k for k in vol if k != "name"]
        refused = [k for k in kinds if k not in ENGINE_VOLUME_TYPES]
        if refused:
            out.append(Violation(f"{where}.volumes[{i}]", (
                f"volume type {', '.join(refused)} is not allowed for engines (allowed: "
                f"{_listed(ENGINE_VOLUME_TYPES)}); ask the cluster admin for a PersistentVolumeClaim instead")))
        host = vol.get("hostPath")
        if host is not None and str(host.get("path", "")).rstrip("/") not in ENGINE_HOST_PATHS:
            out.append(Violation(f"{where}.volumes[{i}].hostPath.path", (
                f"host path {host.get('path')!r} is not one engines may mount ({_listed(sorted(ENGINE_HOST_PATHS))})")))
        for name, keys in _volume_secrets(vol):
            if user or keys is None or any(k != CA_KEY for k in keys):
                out.append(Violation(f"{where}.volumes[{i}]", (
                    f"Secret {name!r}: engines get only their kvNamespace credential and the pool's {CA_KEY}, "
                    "which the operator adds; remove it")))
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(pod_spec.get(group) or []):
            c = c or {}
            at = f"{where}.{group}[{i}]"
            out += _security_context_violations(c.get("securityContext") or {}, where=f"{at}.securityContext",
                                                user=user)
            for j, port in enumerate(c.get("ports") or []):
                if (port or {}).get("hostPort"):
                    out.append(Violation(f"{at}.ports[{j}].hostPort", "engines may not take node ports; remove it"))
            for j, e in enumerate(c.get("env") or []):
                if user and str((e or {}).get("name", "")).startswith(OPERATOR_ENV_PREFIX):
                    out.append(Violation(f"{at}.env[{j}].name", (
                        f"{e.get('name')} is set by the operator (the engine's contract with the pool); remove it")))
            for path, name, key in _secret_refs(c):
                if user or key != CREDENTIAL_KEY or name != credential:
                    out.append(Violation(f"{at}.{path}", (
                        f"Secret {name!r}: engines get only their kvNamespace credential and the pool's {CA_KEY}, "
                        "which the operator adds; remove it")))
    return out


def deployment_violations(pdd: PDDeployment, policy: PoolPolicy) -> list[Violation]:
    """What a PDDeployment's user-written parts (``spec.engine.env``, the roles' partial templates) may not
    contain; mirrors the chart's daybreak-deployment-policy."""
    out: list[Violation] = []
    for i, e in enumerate(pdd.spec.engine.env):
        if e.name.startswith(OPERATOR_ENV_PREFIX):
            out.append(Violation(f"spec.engine.env[{i}].name", (
                f"{e.name} is set by the operator (the engine's contract with the pool); remove it")))
        if e.value_from and "secretKeyRef" in e.value_from:
            out.append(Violation(f"spec.engine.env[{i}].valueFrom.secretKeyRef", (
                f"engines get only their kvNamespace credential and the pool's {CA_KEY}, which the operator "
                "adds; remove it")))
    for role in ("prefill", "decode"):
        template = getattr(pdd.spec, role).template or {}
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        for key in annotations:
            if str(key).startswith(APPARMOR_ANNOTATION):
                out.append(Violation(f"spec.{role}.template.metadata.annotations", (
                    f"{key}: engines may not override AppArmor; remove it")))
        out += _pod_violations(template.get("spec") or {}, where=f"spec.{role}.template.spec", policy=policy,
                               user=True)
    return out


def engine_pod_violations(template: dict[str, Any], *, where: str, policy: PoolPolicy,
                          credential: str) -> list[Violation]:
    """What an engine or router pod template the operator built may not contain (the restricted profile);
    ``credential`` is the only Secret it may read a key (token) of. Mirrors daybreak-operator-writes."""
    out: list[Violation] = []
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    if any(str(k).startswith(APPARMOR_ANNOTATION) for k in annotations):
        out.append(Violation(f"{where}.metadata.annotations", "engines may not override AppArmor; remove it"))
    out += _pod_violations(template.get("spec") or {}, where=f"{where}.spec", policy=policy, user=False,
                           credential=credential)
    return out
